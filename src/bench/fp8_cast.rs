//! `fp8-moe bench fp8-cast`: the memory-bound FP8 kernels against a device-to-device copy
//! measured in the same run.
//!
//! * quantize bf16 -> E4M3 with fused amax over 2^28 elements, counted as 3 bytes per element
//!   (2 read, 1 written);
//! * cast-transpose of an 8192 x 16384 bf16 matrix, counted as 4 bytes per element (2 read,
//!   1 + 1 written);
//! * the yardstick: a copy of the 2^28-element bf16 buffer, counted as read + write bytes.
//!
//! Each kernel's output is spot-checked against the CPU reference before it is timed.

use cuda_graph::half::bf16;
use cuda_graph::{Context, DeviceBuffer, Stream};
use fp8_kernels::reference;
use fp8_kernels::{DType, Fp8Format, Fp8Tensor, HpBuffer, cast_transpose, quantize};

use super::{BenchResult, Row, event_median_ms, xorshift};

const WARMUP: usize = 3;
const REPS: usize = 20;
const QUANT_N: usize = 1 << 28;
const CT_ROWS: usize = 8192;
const CT_COLS: usize = 16384;
/// The scale the kernels multiply by; the data spans about +-100, so it stays in range.
const SCALE: f32 = 2.0;

/// Random bf16 bits, roughly uniform in +-100, never all zero.
fn random_bf16(n: usize, seed: u64) -> Vec<bf16> {
    let mut next = xorshift(seed);
    (0..n)
        .map(|_| {
            let x = ((next() >> 11) as f64 / (1u64 << 53) as f64 * 200.0 - 100.0) as f32;
            bf16::from_bits(reference::narrow(x, DType::Bf16) as u16)
        })
        .collect()
}

/// Checks `got` against the reference quantization of `input` at the given indices.
fn spot_check(
    input: &[bf16],
    got: &[u8],
    picks: impl Iterator<Item = usize>,
    what: &str,
) -> BenchResult<()> {
    for i in picks {
        let x = reference::widen(u32::from(input[i].to_bits()), DType::Bf16);
        let want = reference::quantize(x, SCALE, Fp8Format::E4M3);
        if got[i] != want {
            return Err(
                format!("{what}: element {i}: got {:#04x}, want {want:#04x}", got[i]).into(),
            );
        }
    }
    Ok(())
}

/// Every 9973rd index below `n`, plus the last (covering the tail).
fn picks(n: usize) -> impl Iterator<Item = usize> {
    (0..n).step_by(9973).chain(std::iter::once(n - 1))
}

/// Runs the benchmark; returns the rows.
pub fn run() -> BenchResult<Vec<Row>> {
    let ctx = Context::default_device()?;
    let stream = Stream::new(&ctx)?;

    // Quantize with fused amax, and the copy yardstick on the same buffer.
    let host = random_bf16(QUANT_N, 1);
    let input = DeviceBuffer::from_host(&stream, &host)?;
    let copy = DeviceBuffer::<bf16>::alloc(&ctx, QUANT_N)?;
    let q = Fp8Tensor::new(&stream, &[QUANT_N], Fp8Format::E4M3)?;
    q.scale().write(&stream, SCALE)?;
    q.data().memset_bytes(&stream, 0xff)?;
    quantize(&stream, HpBuffer::Bf16(&input), &q, None)?;
    spot_check(
        &host,
        &q.data().to_vec(&stream)?,
        picks(QUANT_N),
        "quantize",
    )?;
    let want_amax = reference::amax(
        host.iter()
            .map(|&b| reference::widen(u32::from(b.to_bits()), DType::Bf16)),
    );
    if q.amax().read(&stream)? != want_amax {
        return Err("quantize: amax differs from the reference".into());
    }

    let copy_ms = event_median_ms(&stream, WARMUP, REPS, || {
        copy.copy_from_device(&stream, &input).map_err(Into::into)
    })?;
    let quant_ms = event_median_ms(&stream, WARMUP, REPS, || {
        quantize(&stream, HpBuffer::Bf16(&input), &q, None).map_err(Into::into)
    })?;
    drop((copy, q, input));

    // Cast-transpose.
    let n = CT_ROWS * CT_COLS;
    let host = random_bf16(n, 2);
    let input = DeviceBuffer::from_host(&stream, &host)?;
    let out = Fp8Tensor::new(&stream, &[CT_ROWS, CT_COLS], Fp8Format::E4M3)?;
    let out_t = DeviceBuffer::<u8>::alloc(&ctx, n)?;
    out.scale().write(&stream, SCALE)?;
    out_t.memset_bytes(&stream, 0xff)?;
    cast_transpose(
        &stream,
        HpBuffer::Bf16(&input),
        CT_ROWS,
        CT_COLS,
        &out,
        &out_t,
        None,
    )?;
    spot_check(
        &host,
        &out.data().to_vec(&stream)?,
        picks(n),
        "cast-transpose (rows)",
    )?;
    // out_t[c * rows + r] is the cast of input[r * cols + c].
    let transposed: Vec<u8> = {
        let t = out_t.to_vec(&stream)?;
        (0..n)
            .map(|i| t[(i % CT_COLS) * CT_ROWS + i / CT_COLS])
            .collect()
    };
    spot_check(&host, &transposed, picks(n), "cast-transpose (transposed)")?;
    let ct_ms = event_median_ms(&stream, WARMUP, REPS, || {
        cast_transpose(
            &stream,
            HpBuffer::Bf16(&input),
            CT_ROWS,
            CT_COLS,
            &out,
            &out_t,
            None,
        )
        .map_err(Into::into)
    })?;

    let gbs = |bytes: f64, ms: f64| bytes / (ms * 1e-3) / 1e9;
    let copy_gbs = gbs(2.0 * 2.0 * QUANT_N as f64, copy_ms);
    let quant_gbs = gbs(3.0 * QUANT_N as f64, quant_ms);
    let ct_gbs = gbs(4.0 * n as f64, ct_ms);
    Ok(vec![
        Row {
            name: "device-to-device copy, 2^28 bf16 (read + write)".into(),
            value: copy_gbs,
            unit: "GB/s",
            yardstick: format!("{copy_ms:.3} ms; the yardstick (H200 datasheet 4800)"),
            pass: None,
        },
        Row {
            name: "quantize bf16 -> e4m3 + amax, 2^28 (3 B/elem)".into(),
            value: quant_gbs,
            unit: "GB/s",
            yardstick: format!(
                "{quant_ms:.3} ms; {:.2} of the copy; target >= 3600 and >= 0.88x; torch.compile 2851, PyTorch eager 359",
                quant_gbs / copy_gbs
            ),
            pass: Some(quant_gbs >= 3600.0 && quant_gbs >= 0.88 * copy_gbs),
        },
        Row {
            name: "cast-transpose bf16 -> e4m3, 8192 x 16384 (4 B/elem)".into(),
            value: ct_gbs,
            unit: "GB/s",
            yardstick: format!(
                "{ct_ms:.3} ms; {:.2} of the copy; target >= 3000",
                ct_gbs / copy_gbs
            ),
            pass: Some(ct_gbs >= 3000.0),
        },
    ])
}
