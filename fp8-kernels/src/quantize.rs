//! Launchers of the quantize family: quantize with fused amax, current-scaling quantize,
//! amax alone, and dequantize. Each validates everything first (nothing is enqueued on an
//! error), then enqueues on the given stream without synchronising or allocating, so it works
//! eagerly and inside a stream capture alike.
//!
//! Alignment: every high-precision buffer and every FP8 data buffer must start on a 16-byte
//! boundary (buffers from [`DeviceBuffer::alloc`](cuda_graph::DeviceBuffer::alloc) always
//! do). Lengths need not be multiples of anything: the kernels do the tail separately.

use cuda_graph::{DeviceBuffer, Error, KernelArgs, LaunchConfig, Result, Stream};

use crate::module::kernel;
use crate::tensor::{DeviceScalar, Fp8Tensor, HpBuffer, check_align};

/// Threads per block of the elementwise kernels.
const BLOCK: u32 = 256;
/// Resident blocks per SM the grid is sized for (the kernels loop grid-stride).
const BLOCKS_PER_SM: u32 = 4;
/// Alignment every data buffer must have.
pub const ALIGN: u64 = 16;
/// Threads of the fused current-scaling kernel (one block).
const FUSED_BLOCK: u32 = 1024;
/// Largest tensor [`quantize_current`] handles in one fused launch (the kernel's one block
/// holds 16 elements a thread in registers; keep in step with `FUSED_PER_THREAD`).
pub const FUSED_CURRENT_MAX: usize = FUSED_BLOCK as usize * 16;

/// Grid for `vectors` work items: enough blocks, at most `BLOCKS_PER_SM` per SM, at least 1.
fn grid(sms: u32, vectors: u64) -> u32 {
    let need = vectors.div_ceil(u64::from(BLOCK)).max(1);
    need.min(u64::from(sms.saturating_mul(BLOCKS_PER_SM))) as u32
}

/// A scalar's index as the kernels take it.
pub(crate) fn idx(s: &DeviceScalar) -> Result<u32> {
    u32::try_from(s.index())
        .map_err(|_| Error::InvalidArgument(format!("scalar index {} above u32", s.index())))
}

fn same_len(what: &str, a: usize, b: usize) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what}: input has {a} elements, output {b}"
        )))
    }
}

/// `out = saturate_rne(input * scale)` in `out.format()`, with `scale` read from
/// `out.scale()` on the device; writes `out.scale_inv() = 1 / scale`; maxes `max |input|`
/// (unscaled; NaN wins) into `out.amax()`, which must hold a non-negative value (zero it
/// before the first step; the delayed-scaling update does). When `noop` is given and holds
/// 1.0 at run time, nothing at all is written.
///
/// Requirements: `input.len() == out.numel()`; input and `out.data()` 16-byte aligned.
pub fn quantize<'a>(
    stream: &Stream,
    input: impl Into<HpBuffer<'a>>,
    out: &Fp8Tensor,
    noop: Option<&DeviceScalar>,
) -> Result<()> {
    let input: HpBuffer<'a> = input.into();
    launch_quantize(stream, "fp8_quantize", input, out, noop)
}

/// Current scaling: `out.amax() = max |input|`, then `scale = fp8_max / amax` (1 when amax is
/// 0, inf or NaN; f32::MAX when that overflows) written to `out.scale()`, then the cast with
/// that scale and `out.scale_inv() = 1 / scale`. Tensors of at most [`FUSED_CURRENT_MAX`]
/// elements take one fused launch (read once, reduce in one block, cast from registers);
/// larger ones three (reset amax, amax, cast). Both write the same bytes and scalars, and
/// honour `noop`: with `noop == 1.0` nothing is written.
///
/// Requirements: `input.len() == out.numel()`; input and `out.data()` 16-byte aligned.
pub fn quantize_current<'a>(
    stream: &Stream,
    input: impl Into<HpBuffer<'a>>,
    out: &Fp8Tensor,
    noop: Option<&DeviceScalar>,
) -> Result<()> {
    let input: HpBuffer<'a> = input.into();
    validate_quantize(&input, out)?;
    if input.len() <= FUSED_CURRENT_MAX {
        let name = format!(
            "fp8_quantize_current_fused_{}_{}",
            input.dtype().name(),
            out.format().name()
        );
        let (k, _) = kernel(stream.context(), &name)?;
        return launch_cast(
            stream,
            &k,
            LaunchConfig::linear(1, FUSED_BLOCK),
            &input,
            out,
            noop,
        );
    }
    let noop_idx = noop.map(idx).transpose()?.unwrap_or(0);
    let amax_idx = idx(out.amax())?;
    // The cast's slot indices too, so that no launch is enqueued before an error.
    idx(out.scale())?;
    idx(out.scale_inv())?;
    let ctx = stream.context();
    // Look every kernel up before enqueueing anything.
    let (zero, _) = kernel(ctx, "fp8_zero_amax")?;
    let (amax_k, sms) = kernel(ctx, &format!("fp8_amax_{}", input.dtype().name()))?;
    let cast_name = format!(
        "fp8_quantize_current_{}_{}",
        input.dtype().name(),
        out.format().name()
    );
    let (cast, _) = kernel(ctx, &cast_name)?;
    let null = 0u64;
    let pair = [amax_idx, noop_idx];
    let amax_buf: &DeviceBuffer<f32> = out.amax().buffer();
    let args = KernelArgs::new().arg(amax_buf);
    let args = match noop {
        Some(s) => args.arg(s.buffer()),
        None => args.arg(&null),
    }
    .arg(&pair);
    // SAFETY: fp8_zero_amax(float*, const float*, uint2) writes amax[idx.x] only; the index
    // is inside the buffer (DeviceScalar checks it).
    unsafe { stream.launch_pdl(&zero, &LaunchConfig::linear(1, 32), &args) }?;
    launch_amax(stream, &amax_k, sms, &input, out.amax(), noop)?;
    let cfg = cast_config(sms, &input);
    launch_cast(stream, &cast, cfg, &input, out, noop)
}

fn validate_quantize(input: &HpBuffer<'_>, out: &Fp8Tensor) -> Result<()> {
    same_len("quantize", input.len(), out.numel())?;
    check_align("quantize input", input.device_ptr(), ALIGN)?;
    check_align("FP8 output", out.data().as_raw(), ALIGN)
}

fn launch_quantize(
    stream: &Stream,
    prefix: &str,
    input: HpBuffer<'_>,
    out: &Fp8Tensor,
    noop: Option<&DeviceScalar>,
) -> Result<()> {
    validate_quantize(&input, out)?;
    let name = format!("{prefix}_{}_{}", input.dtype().name(), out.format().name());
    let (k, sms) = kernel(stream.context(), &name)?;
    let cfg = cast_config(sms, &input);
    launch_cast(stream, &k, cfg, &input, out, noop)
}

/// Grid-stride configuration of the elementwise cast over `input`.
fn cast_config(sms: u32, input: &HpBuffer<'_>) -> LaunchConfig {
    let vec = 16 / input.dtype().size() as u64;
    LaunchConfig::linear(grid(sms, input.len() as u64 / vec), BLOCK)
}

/// Launches a (validated) quantize kernel with signature
/// `(const In*, uint8_t*, u64 n, float* scale, float* scale_inv, float* amax, const float* noop, uint4 idx)`.
fn launch_cast(
    stream: &Stream,
    k: &cuda_graph::Kernel,
    cfg: LaunchConfig,
    input: &HpBuffer<'_>,
    out: &Fp8Tensor,
    noop: Option<&DeviceScalar>,
) -> Result<()> {
    let n = input.len() as u64;
    let null = 0u64;
    let indices = [
        idx(out.scale())?,
        idx(out.scale_inv())?,
        idx(out.amax())?,
        noop.map(idx).transpose()?.unwrap_or(0),
    ];
    let args = input
        .push_to(KernelArgs::new())
        .arg(out.data())
        .arg(&n)
        .arg(out.scale().buffer())
        .arg(out.scale_inv().buffer())
        .arg(out.amax().buffer());
    let args = match noop {
        Some(s) => args.arg(s.buffer()),
        None => args.arg(&null),
    }
    .arg(&indices);
    // SAFETY: the kernel reads n elements of the input type from the input buffer and writes
    // n bytes to out.data(), both checked to hold n elements and 16-byte aligned (the vector
    // width); each scalar slot index is inside its buffer (DeviceScalar checks it).
    unsafe { stream.launch_pdl(k, &cfg, &args) }
}

/// Maxes `max |input|` (NaN wins) into `amax`, which must hold a non-negative value. With
/// `noop == 1.0` at run time nothing is written.
///
/// Requirements: input 16-byte aligned.
pub fn amax<'a>(
    stream: &Stream,
    input: impl Into<HpBuffer<'a>>,
    amax: &DeviceScalar,
    noop: Option<&DeviceScalar>,
) -> Result<()> {
    let input: HpBuffer<'a> = input.into();
    check_align("amax input", input.device_ptr(), ALIGN)?;
    idx(amax)?;
    let (k, sms) = kernel(
        stream.context(),
        &format!("fp8_amax_{}", input.dtype().name()),
    )?;
    launch_amax(stream, &k, sms, &input, amax, noop)
}

fn launch_amax(
    stream: &Stream,
    k: &cuda_graph::Kernel,
    sms: u32,
    input: &HpBuffer<'_>,
    amax: &DeviceScalar,
    noop: Option<&DeviceScalar>,
) -> Result<()> {
    let n = input.len() as u64;
    let vec = 16 / input.dtype().size() as u64;
    let null = 0u64;
    let indices = [idx(amax)?, noop.map(idx).transpose()?.unwrap_or(0)];
    let args = input.push_to(KernelArgs::new()).arg(&n).arg(amax.buffer());
    let args = match noop {
        Some(s) => args.arg(s.buffer()),
        None => args.arg(&null),
    }
    .arg(&indices);
    let cfg = LaunchConfig::linear(grid(sms, n / vec), BLOCK);
    // SAFETY: reads n input elements (buffer holds n, 16-byte aligned), writes amax[idx]
    // (inside its buffer).
    unsafe { stream.launch_pdl(k, &cfg, &args) }
}

/// `out = narrow_rne(decode(input) * scale_inv)` with `scale_inv` read from
/// `input.scale_inv()` on the device. NaN bytes give NaN, E5M2 infinities give infinities.
///
/// Requirements: `out.len() == input.numel()`; `input.data()` and `out` 16-byte aligned.
pub fn dequantize<'a>(
    stream: &Stream,
    input: &Fp8Tensor,
    out: impl Into<HpBuffer<'a>>,
) -> Result<()> {
    let out: HpBuffer<'a> = out.into();
    same_len("dequantize", input.numel(), out.len())?;
    check_align("FP8 input", input.data().as_raw(), ALIGN)?;
    check_align("dequantize output", out.device_ptr(), ALIGN)?;
    let si_idx = idx(input.scale_inv())?;
    let name = format!(
        "fp8_dequantize_{}_{}",
        input.format().name(),
        out.dtype().name()
    );
    let (k, sms) = kernel(stream.context(), &name)?;
    let n = input.numel() as u64;
    let args = out
        .push_to(KernelArgs::new().arg(input.data()))
        .arg(&n)
        .arg(input.scale_inv().buffer())
        .arg(&si_idx);
    let cfg = LaunchConfig::linear(grid(sms, n / 8), BLOCK);
    // SAFETY: reads n bytes of input.data() and writes n elements of out (both checked to
    // hold n, 16-byte aligned); reads scale_inv[idx] inside its buffer.
    unsafe { stream.launch_pdl(&k, &cfg, &args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_is_bounded_by_sms_and_work() {
        assert_eq!(grid(132, 0), 1);
        assert_eq!(grid(132, 1), 1);
        assert_eq!(grid(132, 257), 2);
        assert_eq!(grid(132, 1 << 30), 528);
    }

    use crate::prop_util::config;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(config(100_000))]

        /// Equal lengths pass; an error names what and both lengths.
        #[test]
        fn same_len_is_equality(a in any::<usize>(), b in prop_oneof![any::<usize>(), 0usize..4]) {
            for (a, b) in [(a, b), (a, a), (b, b)] {
                match same_len("prop_quantize", a, b) {
                    Ok(()) => prop_assert_eq!(a, b),
                    Err(e) => {
                        prop_assert_ne!(a, b);
                        let msg = e.to_string();
                        prop_assert!(
                            msg.contains("prop_quantize: ")
                                && msg.contains(&format!("input has {a} elements"))
                                && msg.contains(&format!("output {b}")),
                            "{}", msg
                        );
                    }
                }
            }
        }

        /// Enough blocks of 256 for the work, capped at 4 per SM, at least 1 (SM counts
        /// are at least 1).
        #[test]
        fn grid_is_bounded(sms in prop_oneof![1u32..=200, any::<u32>().prop_map(|s| s.max(1))],
                           vectors in prop_oneof![0u64..100_000, any::<u64>()]) {
            let need = vectors.div_ceil(256).max(1);
            let cap = (u64::from(sms) * 4).min(u64::from(u32::MAX));
            prop_assert_eq!(u64::from(grid(sms, vectors)), need.min(cap));
        }
    }
}
