//! FP8 GEMM: two f32 matrices quantized to E4M3 on the device (per-tensor scales read from
//! device memory), multiplied by the FP8 GEMM into bf16, checked against an f64 reference of
//! the same quantized values, then the same work captured into a graph and replayed with new
//! data and a new scale without re-capturing.
//!
//! `cargo run -p fp8-kernels --example fp8_gemm` (needs an NVIDIA GPU, sm_89 or newer).

use cuda_graph::half::bf16;
use cuda_graph::{CaptureMode, Context, DeviceBuffer, GraphExec, InstantiateFlags, Stream};
use fp8_kernels::gemm::{GemmOptions, GemmShape, Operand, gemm};
use fp8_kernels::{Fp8Format, Fp8Tensor, quantize, reference};

const M: usize = 256;
const N: usize = 512;
const K: usize = 1024;

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
        })
        .collect()
}

/// max |got - want| / max |want| against an f64 reference of the quantized operands.
fn check(a: &[f32], b: &[f32], sa: f32, sb: f32, got: &[bf16]) -> f64 {
    let e4 = Fp8Format::E4M3;
    let qa: Vec<f64> = a
        .iter()
        .map(|&x| {
            f64::from(reference::dequantize(
                reference::quantize(x, sa, e4),
                1.0 / sa,
                e4,
            ))
        })
        .collect();
    let qb: Vec<f64> = b
        .iter()
        .map(|&x| {
            f64::from(reference::dequantize(
                reference::quantize(x, sb, e4),
                1.0 / sb,
                e4,
            ))
        })
        .collect();
    let (mut err, mut mag) = (0f64, 0f64);
    for i in 0..M {
        for j in 0..N {
            let want: f64 = (0..K).map(|k| qa[i * K + k] * qb[j * K + k]).sum();
            err = err.max((f64::from(got[i * N + j]) - want).abs());
            mag = mag.max(want.abs());
        }
    }
    err / mag
}

/// A quantized tensor as a GEMM operand.
fn operand(t: &Fp8Tensor) -> Operand<'_> {
    Operand {
        data: t.data(),
        format: t.format(),
        scale_inv: t.scale_inv(),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = Context::default_device()?;
    let stream = Stream::new(&ctx)?;
    let (a, b) = (random(M * K, 1), random(N * K, 2));
    let (a_dev, b_dev) = (
        DeviceBuffer::from_host(&stream, &a)?,
        DeviceBuffer::from_host(&stream, &b)?,
    );
    let qa = Fp8Tensor::new(&stream, &[M, K], Fp8Format::E4M3)?;
    let qb = Fp8Tensor::new(&stream, &[N, K], Fp8Format::E4M3)?;
    let d = DeviceBuffer::<bf16>::alloc(&ctx, M * N)?;
    let (sa, sb) = (64.0f32, 32.0f32);
    qa.scale().write(&stream, sa)?;
    qb.scale().write(&stream, sb)?;

    // Quantize both operands, then D = A . B^T in bf16; scale_inv read on the device.
    let work = |s: &Stream| -> cuda_graph::Result<()> {
        quantize(s, &a_dev, &qa, None)?;
        quantize(s, &b_dev, &qb, None)?;
        gemm(
            s,
            GemmShape::new(M, N, K),
            operand(&qa),
            operand(&qb),
            &d,
            GemmOptions::new(),
        )
    };
    work(&stream)?;
    let rel = check(&a, &b, sa, sb, &d.to_vec(&stream)?);
    println!("eager: {M}x{N}x{K} FP8 GEMM, max rel. error {rel:.2e} against f64");
    if rel.is_nan() || rel >= 1e-2 {
        return Err(format!("eager GEMM error {rel:.2e} above 1e-2 (bf16 output)").into());
    }

    // The same work as a graph; new data and a new scale go in by copies, no re-capture.
    let graph = stream.capture(CaptureMode::Global, |s| work(s.stream()))?;
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
    let a2 = random(M * K, 3);
    a_dev.copy_from_host(&stream, &a2)?;
    qa.scale().write(&stream, 16.0)?;
    exec.launch(&stream)?;
    stream.synchronize()?;
    let rel = check(&a2, &b, 16.0, sb, &d.to_vec(&stream)?);
    println!("graph replay with new A and scale: max rel. error {rel:.2e}");
    if rel.is_nan() || rel >= 1e-2 {
        return Err(format!("replayed GEMM error {rel:.2e} above 1e-2").into());
    }
    Ok(())
}
