//! Helpers shared by the fp8-kernels GPU tests: seeded random data with specials, uploads
//! in every input dtype with the exact host widening, poisoning, capture, and the probes'
//! event timing.
#![allow(dead_code)] // each test file uses a different subset

use std::sync::Arc;

use cuda_graph::half::{bf16, f16};
use cuda_graph::{CaptureMode, Context, DeviceBuffer, Event, Graph, Result, Stream};
use fp8_kernels::gemm::{Bias, GemmOut};
use fp8_kernels::reference as r;
use fp8_kernels::{DType, DeviceScalar, Fp8Format, Fp8Tensor, HpBuffer};

pub const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

pub const POISON_F32: u32 = 0xdead_beef;

/// Mean milliseconds per call of `f` on `stream` over 20 calls, timed with CUDA events after
/// one untimed call (the bandwidth probes' clock).
pub fn mean_ms(stream: &Stream, f: &mut dyn FnMut()) -> f32 {
    const ITERS: u16 = 20;
    let ctx = stream.context();
    let (start, end) = (Event::new(ctx).unwrap(), Event::new(ctx).unwrap());
    f();
    start.record(stream).unwrap();
    for _ in 0..ITERS {
        f();
    }
    end.record(stream).unwrap();
    end.synchronize().unwrap();
    Event::elapsed_ms(&start, &end).unwrap() / f32::from(ITERS)
}

pub fn setup() -> (Arc<Context>, Stream) {
    let ctx = Context::default_device().expect("a CUDA device");
    let stream = Stream::new(&ctx).expect("a stream");
    (ctx, stream)
}

/// xorshift64: deterministic, seeded per test case so data differs between cases.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// A generator for case `seed` (any seed, zero included: xorshift never leaves zero).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    /// A random FP8 byte with a finite value (NaN and inf excluded).
    pub fn fp8(&mut self, fmt: Fp8Format) -> u8 {
        loop {
            let b = (self.next() >> 32) as u8;
            if r::decode(b, fmt).is_finite() {
                return b;
            }
        }
    }
    /// `n` random finite FP8 bytes.
    pub fn bytes(&mut self, n: usize, fmt: Fp8Format) -> Vec<u8> {
        (0..n).map(|_| self.fp8(fmt)).collect()
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// Values over a wide range of magnitudes (fp8 subnormals to beyond the max), both signs.
    pub fn value(&mut self) -> f32 {
        let v = self.next();
        let mant = f32::from_bits(0x3f80_0000 | ((v >> 40) as u32 & 0x7f_ffff));
        let exp = (v % 48) as i32 - 28;
        let x = mant * 2f32.powi(exp);
        if v & (1 << 20) != 0 { -x } else { x }
    }
}

/// A high-precision input on the device, with its exact f32 widening on the host.
pub enum Input {
    F32(DeviceBuffer<f32>),
    F16(DeviceBuffer<f16>),
    Bf16(DeviceBuffer<bf16>),
}

impl Input {
    pub fn view(&self) -> HpBuffer<'_> {
        match self {
            Input::F32(b) => HpBuffer::F32(b),
            Input::F16(b) => HpBuffer::F16(b),
            Input::Bf16(b) => HpBuffer::Bf16(b),
        }
    }
}

/// Uploads `xs` rounded to `dtype`; returns the device input and the widened host values.
pub fn upload(stream: &Stream, dtype: DType, xs: &[f32]) -> (Input, Vec<f32>) {
    let bits: Vec<u32> = xs.iter().map(|&x| r::narrow(x, dtype)).collect();
    let wide: Vec<f32> = bits.iter().map(|&b| r::widen(b, dtype)).collect();
    let input = match dtype {
        DType::F32 => Input::F32(DeviceBuffer::from_host(stream, xs).unwrap()),
        DType::F16 => {
            let h: Vec<f16> = bits.iter().map(|&b| f16::from_bits(b as u16)).collect();
            Input::F16(DeviceBuffer::from_host(stream, &h).unwrap())
        }
        DType::Bf16 => {
            let h: Vec<bf16> = bits.iter().map(|&b| bf16::from_bits(b as u16)).collect();
            Input::Bf16(DeviceBuffer::from_host(stream, &h).unwrap())
        }
    };
    (input, wide)
}

/// Random data with specials sprinkled in (inf, NaN, zeros, huge, fp8 subnormals).
pub fn random_data(seed: u64, n: usize, specials: bool) -> Vec<f32> {
    let mut rng = Rng(seed | 1);
    let mut xs: Vec<f32> = (0..n).map(|_| rng.value()).collect();
    if specials && n >= 7 {
        let sp = [
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -0.0,
            1e30,
            2f32.powi(-10),
            -448.0 * 1.04,
        ];
        for (i, s) in sp.iter().enumerate() {
            xs[(i * 7919 + 3) % n] = *s;
        }
    }
    xs
}

/// Whether the device converts with the FP8 instructions (sm_89+), whose NaN output the
/// reference pins exactly; older devices run CUDA's software fallback (any NaN accepted).
pub fn hardware_fp8() -> bool {
    let dev = cuda_graph::driver::Device::get(0).expect("device 0");
    dev.compute_capability().expect("compute capability") >= (8, 9)
}

pub fn scalar_bits(stream: &Stream, s: &DeviceScalar) -> u32 {
    s.read(stream).unwrap().to_bits()
}

/// Captures `f`'s work on `stream` into a graph (thread-local mode); the graph keeps the
/// buffers the work uses alive.
pub fn capture(_ctx: &Arc<Context>, stream: &Stream, f: impl FnOnce() -> Result<()>) -> Graph {
    stream
        .capture(CaptureMode::ThreadLocal, |_| f())
        .expect("work enqueued during capture")
}

/// After a cast with a device-side `scale`: amax holds `want_amax` bit for bit, scale_inv is
/// `1 / scale`, and the scale itself was left alone.
pub fn assert_cast_scalars(
    stream: &Stream,
    out: &Fp8Tensor,
    want_amax: f32,
    scale: f32,
    what: &str,
) {
    assert_eq!(
        scalar_bits(stream, out.amax()),
        want_amax.to_bits(),
        "{what}: amax"
    );
    assert_eq!(
        out.scale_inv().read(stream).unwrap(),
        1.0 / scale,
        "{what}: scale_inv"
    );
    assert_eq!(
        out.scale().read(stream).unwrap(),
        scale,
        "{what}: scale kept"
    );
}

/// An output buffer of either type.
pub enum Out {
    F32(DeviceBuffer<f32>),
    Bf16(DeviceBuffer<bf16>),
}

impl Out {
    pub fn new(ctx: &Arc<Context>, dtype: DType, n: usize) -> Out {
        match dtype {
            DType::F32 => Out::F32(DeviceBuffer::alloc(ctx, n).unwrap()),
            _ => Out::Bf16(DeviceBuffer::alloc(ctx, n).unwrap()),
        }
    }
    pub fn dtype(&self) -> DType {
        match self {
            Out::F32(_) => DType::F32,
            Out::Bf16(_) => DType::Bf16,
        }
    }
    pub fn view(&self) -> GemmOut<'_> {
        match self {
            Out::F32(b) => GemmOut::F32(b),
            Out::Bf16(b) => GemmOut::Bf16(b),
        }
    }
    /// All bytes 0xff (a NaN in both types); waits.
    pub fn poison(&mut self, stream: &Stream) {
        match self {
            Out::F32(b) => b.memset_bytes(stream, 0xff).unwrap(),
            Out::Bf16(b) => b.memset_bytes(stream, 0xff).unwrap(),
        }
        stream.synchronize().unwrap();
    }
    /// Sets the contents to `xs` rounded to the type; returns the stored values.
    pub fn fill(&mut self, stream: &Stream, xs: &[f32]) -> Vec<f32> {
        let dt = self.dtype();
        let bits: Vec<u32> = xs.iter().map(|&x| r::narrow(x, dt)).collect();
        match self {
            Out::F32(b) => b.copy_from_host(stream, xs).unwrap(),
            Out::Bf16(b) => {
                let h: Vec<bf16> = bits.iter().map(|&x| bf16::from_bits(x as u16)).collect();
                b.copy_from_host(stream, &h).unwrap()
            }
        }
        stream.synchronize().unwrap();
        bits.iter().map(|&x| r::widen(x, dt)).collect()
    }
    /// The raw bits of every element.
    pub fn bits(&self, stream: &Stream) -> Vec<u32> {
        match self {
            Out::F32(b) => b
                .to_vec(stream)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect(),
            Out::Bf16(b) => b
                .to_vec(stream)
                .unwrap()
                .iter()
                .map(|&x| u32::from(x.to_bits()))
                .collect(),
        }
    }
    pub fn values(&self, stream: &Stream) -> Vec<f32> {
        let dt = self.dtype();
        self.bits(stream).iter().map(|&b| r::widen(b, dt)).collect()
    }
    pub fn poison_bits(&self) -> u32 {
        match self {
            Out::F32(_) => u32::MAX,
            Out::Bf16(_) => 0xffff,
        }
    }
}

/// A bias of either type on the device, with its values as the kernel sees them.
pub enum BiasBuf {
    F32(DeviceBuffer<f32>),
    Bf16(DeviceBuffer<bf16>),
}

impl BiasBuf {
    pub fn new(stream: &Stream, dtype: DType, xs: &[f32]) -> (BiasBuf, Vec<f32>) {
        let bits: Vec<u32> = xs.iter().map(|&x| r::narrow(x, dtype)).collect();
        let wide = bits.iter().map(|&b| r::widen(b, dtype)).collect();
        let buf = match dtype {
            DType::F32 => BiasBuf::F32(DeviceBuffer::from_host(stream, xs).unwrap()),
            _ => {
                let h: Vec<bf16> = bits.iter().map(|&b| bf16::from_bits(b as u16)).collect();
                BiasBuf::Bf16(DeviceBuffer::from_host(stream, &h).unwrap())
            }
        };
        (buf, wide)
    }
    pub fn view(&self) -> Bias<'_> {
        match self {
            BiasBuf::F32(b) => Bias::F32(b),
            BiasBuf::Bf16(b) => Bias::Bf16(b),
        }
    }
}
