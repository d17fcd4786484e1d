//! The portable GEMM path: `kernels/gemm_mma.cuh`, an `mma.sync` kernel for sm_80 and newer
//! (FP8 widened to f16 in registers, which is exact; fp32 accumulation), its block-scaled
//! variant, the packed grouped GEMMs (forward and weight gradient), and the
//! one-thread-per-output reference kernel. Callers validate first (see
//! [`validate`](super::validate)); these functions only build the launch.

use cuda_graph::{Error, KernelArgs, LaunchConfig, Result, Stream};

use super::packed::{GroupScales, PackedProblem, WgradProblem};
use super::{Bias, BlockOperand, GemmOptions, GemmOut, GemmProblem};
use crate::module::kernel;
use crate::quantize::idx;

/// Threads per CTA of the MMA kernels (8 warps; `GM_THREADS`).
const THREADS: u32 = 256;
/// Tile rows of the plain kernel (`BM` with `WMF = 4`).
const BM: usize = 128;
/// Tile rows of the block-scaled kernel (`BM` with `WMF = 2`).
const BM_BLOCKWISE: usize = 64;
/// Tile columns (`GM_BN`).
const BN: usize = 128;
/// Bias kinds as the kernels take them (`GM_BIAS_*`).
const BIAS_NONE: i32 = 0;
const BIAS_F32: i32 = 1;
const BIAS_BF16: i32 = 2;
/// Threads per block and blocks per SM of the reference kernel.
const REF_THREADS: u32 = 256;
const REF_BLOCKS_PER_SM: u32 = 8;

/// A null device pointer argument.
static NULL: u64 = 0;

fn push_out<'a>(args: KernelArgs<'a>, d: &GemmOut<'a>) -> KernelArgs<'a> {
    match *d {
        GemmOut::Bf16(b) => args.arg(b),
        GemmOut::F32(b) => args.arg(b),
    }
}

fn push_bias<'a>(args: KernelArgs<'a>, bias: &Option<Bias<'a>>) -> KernelArgs<'a> {
    match *bias {
        Some(Bias::Bf16(b)) => args.arg(b),
        Some(Bias::F32(b)) => args.arg(b),
        None => args.arg(&NULL),
    }
}

fn bias_kind(bias: &Option<Bias<'_>>) -> i32 {
    match bias {
        None => BIAS_NONE,
        Some(Bias::F32(_)) => BIAS_F32,
        Some(Bias::Bf16(_)) => BIAS_BF16,
    }
}

fn grid_dim(what: &str, x: usize) -> Result<u32> {
    u32::try_from(x).map_err(|_| Error::InvalidArgument(format!("{what}: grid of {x} blocks")))
}

/// Enqueues the MMA kernel for a validated problem: grid (M tiles, N tiles, groups).
pub(crate) fn launch(stream: &Stream, p: &GemmProblem<'_>) -> Result<()> {
    let name = format!(
        "fp8_gemm_mma_{}_{}_{}",
        p.a.format.name(),
        p.b.format.name(),
        p.d.name()
    );
    let (k, _sms) = kernel(stream.context(), &name)?;
    let (ia, ib) = (idx(p.a.scale_inv)?, idx(p.b.scale_inv)?);
    let kind = bias_kind(&p.bias);
    let acc = i32::from(p.accumulate);
    let (m64, n64, k64) = (p.m as u64, p.n as u64, p.k as u64);
    let args = KernelArgs::new().arg(p.a.data).arg(p.b.data);
    let args = push_bias(push_out(args, &p.d), &p.bias).arg(&kind);
    let args = match p.counts {
        Some(c) => args.arg(c),
        None => args.arg(&NULL),
    }
    .arg(p.a.scale_inv.buffer())
    .arg(&ia)
    .arg(p.b.scale_inv.buffer())
    .arg(&ib)
    .arg(&m64)
    .arg(&n64)
    .arg(&k64)
    .arg(&acc);
    let mut cfg = LaunchConfig::linear(grid_dim("gemm", p.m.div_ceil(BM))?, THREADS);
    cfg.grid.1 = grid_dim("gemm", p.n.div_ceil(BN))?;
    cfg.grid.2 = grid_dim("gemm", p.groups)?;
    // SAFETY: validation checked A = groups*m*k, B = groups*n*k, D = groups*m*n elements,
    // bias = n, counts = groups, all 16-byte (counts 4-byte) aligned, K % 16 == 0; the
    // kernel reads A/B in 16-byte chunks only inside rows < m (< counts[g]) / < n and k < K,
    // writes D only at rows < min(m, counts[g]) and columns < n; the scale slot indices are
    // inside their buffers (DeviceScalar checks them). Argument order and types match
    // fp8_gemm_mma_* in gemm_mma.cuh.
    unsafe { stream.launch_pdl(&k, &cfg, &args) }
}

/// Enqueues the block-scaled MMA kernel for a validated problem (scale lengths checked).
#[allow(clippy::too_many_arguments)] // the entry point's arguments, passed on
pub(crate) fn launch_blockwise(
    stream: &Stream,
    m: usize,
    n: usize,
    k: usize,
    a: &BlockOperand<'_>,
    b: &BlockOperand<'_>,
    d: &GemmOut<'_>,
    opts: &GemmOptions<'_>,
) -> Result<()> {
    let name = format!(
        "fp8_gemm_blockwise_{}_{}_{}",
        a.format.name(),
        b.format.name(),
        d.name()
    );
    let (kern, _sms) = kernel(stream.context(), &name)?;
    let kind = bias_kind(&opts.bias);
    let acc = i32::from(opts.accumulate);
    let (m64, n64, k64) = (m as u64, n as u64, k as u64);
    let args = KernelArgs::new().arg(a.data).arg(b.data);
    let args = push_bias(push_out(args, d), &opts.bias)
        .arg(&kind)
        .arg(a.scales_inv)
        .arg(b.scales_inv)
        .arg(&m64)
        .arg(&n64)
        .arg(&k64)
        .arg(&acc);
    let mut cfg = LaunchConfig::linear(
        grid_dim("gemm_blockwise", m.div_ceil(BM_BLOCKWISE))?,
        THREADS,
    );
    cfg.grid.1 = grid_dim("gemm_blockwise", n.div_ceil(BN))?;
    // SAFETY: as for `launch` with one group; in addition the kernel reads
    // sa[r * ceil(k/128) + kb] for rows r < m and sb[(c / 128) * ceil(k/128) + kb] for
    // column tiles c / 128 < ceil(n/128), kb < ceil(k/128): both lengths were checked.
    unsafe { stream.launch_pdl(&kern, &cfg, &args) }
}

/// Enqueues the packed grouped GEMM for a validated problem: grid (capacity / 128 row
/// tiles, N tiles).
pub(crate) fn launch_packed(stream: &Stream, p: &PackedProblem<'_>) -> Result<()> {
    let name = format!(
        "fp8_gemm_packed_{}_{}_{}",
        p.a.format.name(),
        p.b.format.name(),
        p.d.name()
    );
    let (k, _sms) = kernel(stream.context(), &name)?;
    let ia = idx(p.a.scale_inv)?;
    // B's scales: one slot (stride 0) or `groups` values from element 0 (stride 1).
    let (sb, ib, sb_stride) = match p.b.scale_inv {
        GroupScales::Tensor(s) => (s.buffer(), idx(s)?, 0u32),
        GroupScales::PerGroup(s) => (s, 0u32, 1u32),
    };
    let kind = bias_kind(&p.bias);
    let acc = i32::from(p.accumulate);
    let s = p.shape;
    let groups = u32::try_from(s.groups)
        .map_err(|_| Error::InvalidArgument(format!("grouped_gemm_packed: {} groups", s.groups)))?;
    let (cap64, n64, k64) = (s.capacity as u64, s.n as u64, s.k as u64);
    let args = KernelArgs::new().arg(p.a.data).arg(p.b.data);
    let args = push_bias(push_out(args, &p.d), &p.bias)
        .arg(&kind)
        .arg(p.offsets)
        .arg(p.a.scale_inv.buffer())
        .arg(&ia)
        .arg(sb)
        .arg(&ib)
        .arg(&sb_stride)
        .arg(&groups)
        .arg(&cap64)
        .arg(&n64)
        .arg(&k64)
        .arg(&acc);
    let mut cfg = LaunchConfig::linear(grid_dim("grouped_gemm_packed", s.capacity / BM)?, THREADS);
    cfg.grid.1 = grid_dim("grouped_gemm_packed", s.n.div_ceil(BN))?;
    // SAFETY: validation checked A = capacity*k, B = groups*n*k, D = capacity*n elements,
    // bias = n, offsets = groups + 1, per-group scales = groups, A/B/D/bias 16-byte aligned
    // (offsets and scales 4-byte), k % 16 == 0, capacity % 128 == 0. The kernel reads
    // offsets[0..=groups] only, clamps every entry to [0, capacity] (rounded down to 16), so
    // it reads A and writes D only at rows < capacity (and columns < n, k < K), B only for
    // groups g < groups, and sb[ib + g * stride] inside the scale buffer (the slot index is
    // checked by DeviceScalar, or g < groups = its length). Argument order and types match
    // fp8_gemm_packed_* in gemm_mma.cuh.
    unsafe { stream.launch_pdl(&k, &cfg, &args) }
}

/// Enqueues the packed grouped weight gradient for a validated problem: grid (M tiles,
/// N tiles, groups).
pub(crate) fn launch_wgrad(stream: &Stream, p: &WgradProblem<'_>) -> Result<()> {
    let name = format!(
        "fp8_gemm_wgrad_{}_{}_{}",
        p.a.format.name(),
        p.b.format.name(),
        p.d.name()
    );
    let (k, _sms) = kernel(stream.context(), &name)?;
    let (ia, ib) = (idx(p.a.scale_inv)?, idx(p.b.scale_inv)?);
    let acc = i32::from(p.accumulate);
    let s = p.shape;
    let groups = u32::try_from(s.groups)
        .map_err(|_| Error::InvalidArgument(format!("grouped_gemm_wgrad: {} groups", s.groups)))?;
    let (cap64, m64, n64) = (s.capacity as u64, s.m as u64, s.n as u64);
    let args = KernelArgs::new().arg(p.a.data).arg(p.b.data);
    let args = push_out(args, &p.d)
        .arg(p.offsets)
        .arg(p.a.scale_inv.buffer())
        .arg(&ia)
        .arg(p.b.scale_inv.buffer())
        .arg(&ib)
        .arg(&groups)
        .arg(&cap64)
        .arg(&m64)
        .arg(&n64)
        .arg(&acc);
    let mut cfg = LaunchConfig::linear(grid_dim("grouped_gemm_wgrad", s.m.div_ceil(BM))?, THREADS);
    cfg.grid.1 = grid_dim("grouped_gemm_wgrad", s.n.div_ceil(BN))?;
    cfg.grid.2 = groups;
    // SAFETY: validation checked A = m*capacity, B = n*capacity, D = groups*m*n elements,
    // offsets = groups + 1, A/B/D 16-byte aligned (offsets 4-byte), capacity % 16 == 0,
    // groups <= 65535. The kernel reads offsets[0..=groups] only and clamps every entry to
    // [0, capacity] rounded down to 16, so the reduction range [lo, hi) of a group lies in
    // [0, capacity) on 16-byte boundaries: it reads A at rows < m and B at rows < n within
    // columns [lo, hi), and writes D[g] only at rows < m, columns < n. Argument order and
    // types match fp8_gemm_wgrad_* in gemm_mma.cuh.
    unsafe { stream.launch_pdl(&k, &cfg, &args) }
}

/// Enqueues the reference kernel (grid-stride, one thread per output) for a validated
/// problem.
pub(crate) fn launch_reference(stream: &Stream, p: &GemmProblem<'_>) -> Result<()> {
    let name = format!(
        "fp8_gemm_reference_{}_{}_{}",
        p.a.format.name(),
        p.b.format.name(),
        p.d.name()
    );
    let (k, sms) = kernel(stream.context(), &name)?;
    let (ia, ib) = (idx(p.a.scale_inv)?, idx(p.b.scale_inv)?);
    let kind = bias_kind(&p.bias);
    let acc = i32::from(p.accumulate);
    let (g64, m64, n64, k64) = (p.groups as u64, p.m as u64, p.n as u64, p.k as u64);
    let args = KernelArgs::new().arg(p.a.data).arg(p.b.data);
    let args = push_bias(push_out(args, &p.d), &p.bias).arg(&kind);
    let args = match p.counts {
        Some(c) => args.arg(c),
        None => args.arg(&NULL),
    }
    .arg(p.a.scale_inv.buffer())
    .arg(&ia)
    .arg(p.b.scale_inv.buffer())
    .arg(&ib)
    .arg(&g64)
    .arg(&m64)
    .arg(&n64)
    .arg(&k64)
    .arg(&acc);
    let total = (p.groups as u64).saturating_mul(p.m as u64 * p.n as u64);
    let need = total.div_ceil(u64::from(REF_THREADS)).max(1);
    let grid = need.min(u64::from(sms.saturating_mul(REF_BLOCKS_PER_SM))) as u32;
    let cfg = LaunchConfig::linear(grid, REF_THREADS);
    // SAFETY: as for `launch`; the kernel visits i < groups * m * n (the validated length of
    // D) and reads whole rows of A and B inside their validated lengths.
    unsafe { stream.launch_pdl(&k, &cfg, &args) }
}
