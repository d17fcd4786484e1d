//! Helpers shared by the GPU tests of explicit graphs and exec updates.
#![allow(dead_code)] // each test file uses a different subset

use std::sync::Arc;

use cuda_graph::{Context, DeviceBuffer, GraphExec, Kernel, Module, Stream};

/// The test kernels (tests/kernels/test_kernels.cu).
pub const FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/test_kernels.fatbin"));
/// What outputs are filled with before a run: a NaN no kernel produces.
pub const POISON: u32 = 0x7fc0_dead;

/// A context, a stream, the test kernels, and buffers of `n` floats.
pub struct Gpu {
    pub ctx: Arc<Context>,
    pub stream: Stream,
    pub module: Module,
    pub n: u32,
}

impl Gpu {
    pub fn new(n: u32) -> Gpu {
        let ctx = Context::default_device().expect("context");
        let stream = Stream::new(&ctx).expect("stream");
        let module = Module::from_image(&ctx, FATBIN).expect("test kernels");
        Gpu {
            ctx,
            stream,
            module,
            n,
        }
    }
    pub fn k(&self, name: &str) -> Kernel {
        self.module.kernel(name).expect(name)
    }
    /// A poisoned buffer of `n` floats.
    pub fn buf(&self) -> DeviceBuffer<f32> {
        let b = DeviceBuffer::alloc(&self.ctx, self.n as usize).expect("alloc");
        self.poison(&b);
        b
    }
    pub fn poison(&self, b: &DeviceBuffer<f32>) {
        b.fill_u32_bits(&self.stream, POISON).expect("poison");
        self.stream.synchronize().expect("sync");
    }
    pub fn read(&self, b: &DeviceBuffer<f32>) -> Vec<f32> {
        b.to_vec(&self.stream).expect("read back")
    }
    pub fn run(&self, exec: &GraphExec) {
        exec.launch(&self.stream).expect("launch");
        self.stream.synchronize().expect("sync");
    }
}

/// Asserts every element of `v` equals `want`.
pub fn assert_all(v: &[f32], want: f32, what: &str) {
    for (i, &x) in v.iter().enumerate() {
        assert_eq!(x, want, "{what}[{i}] = {x}, expected {want}");
    }
}
