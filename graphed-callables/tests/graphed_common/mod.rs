//! The device helper shared by the graphed-callables GPU tests (graphed, graphed_fp8,
//! graphed_segments): a context, a stream and the graphed test kernels.
#![allow(dead_code)] // each test file uses a different subset

use std::sync::Arc;

use cuda_graph::{
    Context, DeviceBuffer, DeviceRepr, Kernel, LaunchConfig, Module, Stream, kernel_args,
};
use graphed_callables::Step;

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
    /// `bytes` bytes of 0xff (NaN as f32 words), for saved buffers.
    pub fn poisoned_bytes(&self, bytes: usize) -> DeviceBuffer<u8> {
        self.upload(&vec![0xffu8; bytes])
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

/// Per replay, in order: the step and the forward's output or the backward's input gradient.
pub type Replays = [(Step, Vec<f32>)];
/// Per callable: `(dw, db)`.
pub type Grads = [(Vec<f32>, Vec<f32>)];

/// Every replay's values and every callable's `(dw, db)` are equal bit for bit: `steps` holds,
/// in replay order, the step and the forward's output or the backward's input gradient.
pub fn assert_replays_bit_equal(got: (&Replays, &Grads), want: (&Replays, &Grads), what: &str) {
    assert_eq!(got.0.len(), want.0.len(), "{what}: number of steps");
    for (k, ((sg, g), (sw, w))) in got.0.iter().zip(want.0).enumerate() {
        assert_eq!(sg, sw, "{what}: replay {k} ran another step");
        assert_bits_equal(g, w, &format!("{what}: replay {k} ({sg:?})"));
    }
    assert_eq!(got.1.len(), want.1.len(), "{what}: callables");
    for (c, ((gw, gb), (ww, wb))) in got.1.iter().zip(want.1).enumerate() {
        assert_bits_equal(gw, ww, &format!("{what}: dw of callable {c}"));
        assert_bits_equal(gb, wb, &format!("{what}: db of callable {c}"));
    }
}

/// `got` and `want` have the same length and the same bits, element by element.
pub fn assert_bits_equal(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{what} element {i}: {g} vs expected {w}"
        );
    }
}
