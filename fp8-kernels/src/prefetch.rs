//! L2 prefetch of device memory: a cache hint enqueued as one small kernel.
//!
//! A layer whose next GEMM streams weights that nothing in between writes can have them
//! brought into L2 while latency-bound kernels (routing, small casts) leave DRAM idle; the
//! GEMM then reads them from L2. The kernel issues the prefetches before its
//! programmatic-dependent-launch wait (they neither read nor write memory in the program's
//! sense, so they can overlap the previous kernel) and waits before it exits, so the order of
//! the work after it is unchanged. Prefetching changes no result; at worst it costs DRAM
//! bandwidth and evicts other lines from L2.

use std::ops::Range;

use cuda_graph::{DeviceBuffer, DeviceRepr, Error, KernelArgs, LaunchConfig, Result, Stream};
use cuda_graph_sys::CUdevice_attribute;

use crate::module::kernel;

/// Threads per block of the prefetch kernel (`PREFETCH_THREADS` in prefetch.cuh).
const THREADS: u32 = 128;
/// Bytes per bulk prefetch (`PREFETCH_CHUNK` in prefetch.cuh).
const CHUNK: u64 = 16384;

/// The device's L2 cache size in bytes.
///
/// # Errors
/// [`Error::Driver`](cuda_graph::Error::Driver) when the driver does not answer.
pub fn l2_cache_bytes(stream: &Stream) -> Result<usize> {
    let bytes = stream
        .context()
        .device()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?;
    Ok(bytes.max(0) as usize)
}

/// Enqueues an L2 prefetch of `buf[range]` (elements): one launch, capturable, nothing
/// written. The byte range is rounded inwards to 16-byte bounds (a range shorter than that
/// enqueues nothing). On sm_90 the TMA unit walks the range in 16 KiB bulk prefetches; below
/// it one `prefetch.global.L2` per 128-byte line.
///
/// # Errors
/// [`Error::InvalidArgument`] when `range` is not inside `buf` (nothing is enqueued);
/// [`Error::Driver`](cuda_graph::Error::Driver) when the launch fails.
pub fn prefetch_l2<T: DeviceRepr>(
    stream: &Stream,
    buf: &DeviceBuffer<T>,
    range: Range<usize>,
) -> Result<()> {
    if range.start > range.end || range.end > buf.len() {
        return Err(Error::InvalidArgument(format!(
            "prefetch_l2: range {range:?} is not inside a buffer of {} elements",
            buf.len()
        )));
    }
    let size = size_of::<T>() as u64;
    let lo = (range.start as u64 * size).next_multiple_of(16);
    let hi = range.end as u64 * size / 16 * 16;
    if hi <= lo {
        return Ok(());
    }
    let bytes = hi - lo;
    let (k, sms) = kernel(stream.context(), "fp8_prefetch_l2")?;
    let mode: u32 = std::env::var("FP8_PREFETCH_MODE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let blocks = match mode {
        0 => bytes
            .div_ceil(CHUNK)
            .div_ceil(u64::from(THREADS))
            .min(u64::from(sms)) as u32,
        1 => bytes
            .div_ceil(128)
            .div_ceil(u64::from(THREADS))
            .min(u64::from(8 * sms)) as u32,
        _ => sms,
    };
    let args = KernelArgs::new().arg(buf).arg(&lo).arg(&bytes).arg(&mode);
    // SAFETY: the kernel only issues L2 prefetches (no loads or stores) of buf's bytes lo ..
    // lo + bytes, inside the buffer (range checked above, rounded inwards); a prefetch of
    // memory another kernel writes meanwhile is a coherent hint. Passing the buffer keeps its
    // memory alive in a captured graph.
    unsafe { stream.launch_pdl(&k, &LaunchConfig::linear(blocks, THREADS), &args) }
}
