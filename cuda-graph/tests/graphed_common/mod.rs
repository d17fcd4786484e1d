//! The device helper shared by the graphed-callables GPU tests (graphed, graphed_fp8,
//! graphed_segments): a context, a stream and the graphed test kernels.
#![allow(dead_code)] // each test file uses a different subset

use std::sync::Arc;

use cuda_graph::{
    Context, DeviceBuffer, DeviceRepr, Kernel, LaunchConfig, Module, Stream, kernel_args,
};

/// tests/kernels/graphed_kernels.cu.
pub const FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/graphed_kernels.fatbin"));

pub struct Gpu {
    pub ctx: Arc<Context>,
    pub stream: Stream,
    pub module: Module,
}

impl Gpu {
    pub fn new() -> Gpu {
        let ctx = Context::default_device().expect("context");
        let stream = Stream::new(&ctx).expect("stream");
        let module = Module::from_image(&ctx, FATBIN).expect("graphed test kernels");
        Gpu {
            ctx,
            stream,
            module,
        }
    }
    pub fn k(&self, name: &str) -> Kernel {
        self.module.kernel(name).expect(name)
    }
    /// A buffer holding `v`, after the copy completed.
    pub fn upload<T: DeviceRepr>(&self, v: &[T]) -> DeviceBuffer<T> {
        let b = DeviceBuffer::from_host(&self.stream, v).expect("upload");
        self.stream.synchronize().expect("sync");
        b
    }
    /// The contents of `b` once earlier work on the stream is done.
    pub fn read<T: DeviceRepr>(&self, b: &DeviceBuffer<T>) -> Vec<T> {
        let v = b.to_vec(&self.stream).expect("read back");
        self.stream.synchronize().expect("sync");
        v
    }
    /// A buffer of `len` NaNs (poison).
    pub fn poisoned(&self, len: usize) -> DeviceBuffer<f32> {
        self.upload(&vec![f32::NAN; len])
    }
    /// Sets every element of `b` (through `&`, as callables may) and waits.
    pub fn fill(&self, b: &DeviceBuffer<f32>, v: f32) {
        let n = b.len() as u32;
        // SAFETY: gl_fill writes n floats of b.
        unsafe {
            self.stream
                .launch(
                    &self.k("gl_fill"),
                    &LaunchConfig::for_elements(n, 128),
                    &kernel_args![*b, v, n],
                )
                .expect("fill");
        }
        self.stream.synchronize().expect("sync");
    }
}
