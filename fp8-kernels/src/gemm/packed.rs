//! Grouped GEMMs over the packed (dropless MoE) layout: every group's rows lie back to back
//! in one `[capacity, ...]` buffer, group `g` from row `offsets[g]` to `offsets[g + 1]`,
//! with `offsets` (`groups + 1` int32) on the device.
//!
//! * [`grouped_gemm_packed`]: forward and data gradient, `D[r,:] = A[r,:] . B[g]^T` for the
//!   rows `r` of group `g`;
//! * [`grouped_gemm_packed_swiglu`]: the forward of a SwiGLU expert's fc1 with the E4M3
//!   cast of `silu(gate) * up` fused into the sm_90a kernel's epilogue;
//! * [`grouped_gemm_wgrad`]: weight gradient, `D[g] = A[:, rows of g] . B[:, rows of g]^T`, a
//!   reduction over each group's rows.
//!
//! The offsets are read by the kernels when they run (no host synchronisation), so a captured
//! graph stays right as they change between replays. Both run on the portable `mma.sync`
//! kernel by default, which follows the rules below for any offsets. Both also have an sm_90a
//! TMA + wgmma kernel, on explicit [`GemmPath::Hopper`] (the MoE layer's choice on Hopper,
//! where it builds the offsets): it needs offsets that are multiples of [`ALIGN_ROWS`]. It
//! clamps them to `[0, capacity]` and stays inside its buffers whatever they hold, but does
//! not follow the rules below for other values: the forward computes a whole 128-row tile
//! with its first row's group (rows past that group are then written with it, or left
//! unwritten when accumulating), the weight gradient sums whole 128-column blocks.
//!
//! # How the kernels read the offsets
//! Entry `i` is taken as `eff(i) = clamp(offsets[i], 0, capacity)` rounded down to a multiple
//! of 16, and group `g` owns the rows `[lo_g, hi_g)` with `total = eff(groups)`,
//! `lo_g = min(eff(g), total)`, `hi_g = clamp(eff(g + 1), lo_g, total)`
//! ([`reference::packed_rows`](super::reference::packed_rows) computes exactly this).
//! Well-formed offsets (`offsets[0] = 0`, non-decreasing, multiples of [`ALIGN_ROWS`], the
//! last `<= capacity`) are taken as they are. Malformed ones never make a kernel access
//! memory outside its buffers: negative entries count as 0, entries past `capacity` as
//! `capacity`, a decreasing entry makes its group empty, and no row at or past `total` is
//! read (forward: A; wgrad: columns of A and B) or written (forward: D). What else happens:
//! * forward, non-decreasing `eff`: exactly the rows above, each with its group's B, even
//!   where a group boundary falls inside a 128-row tile (the tile is computed group by
//!   group); rows before `eff(0)` are not written;
//! * forward, decreasing `eff` (overlapping groups): every row written lies in
//!   `[0, total)` and is computed with the B of a group that owns it; which rows are
//!   written, with which group, is unspecified, and with `accumulate` a row may be added to
//!   more than once;
//! * wgrad: always exactly `D[g]` over `[lo_g, hi_g)`, whatever the order of the entries.

use cuda_graph::half::bf16;
use cuda_graph::{DeviceBuffer, Result, Stream};

use super::{
    ALIGN, Bias, GemmOptions, GemmOut, GemmPath, K_ALIGN, MAX_GRID_X, MAX_GRID_YZ, Operand,
    check_addr, check_len, check_max_sms, invalid, mul, portable,
};
use crate::cast_transpose::check_outputs;
use crate::format::Fp8Format;
use crate::moe_cast::{CastScaling, FusedCastOut, RowsInUse, swiglu_cast_transpose};
use crate::tensor::DeviceScalar;

/// Group offsets of the packed layout are multiples of this many rows (the Hopper kernel's
/// row tile, and a multiple of the portable kernel's), so every aligned 128-row tile lies in
/// one group; the packed forward's `capacity` must be a multiple of it too.
pub const ALIGN_ROWS: usize = 128;

/// Rows (packed forward) or M (wgrad) per CTA tile of the portable kernels.
const TILE_M: usize = 128;
/// N per CTA tile.
const TILE_N: usize = 128;

/// The shape of a packed grouped GEMM ([`grouped_gemm_packed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PackedShape {
    /// The number of groups (experts), `>= 1`.
    pub groups: usize,
    /// Rows of the packed A and D, a positive multiple of [`ALIGN_ROWS`]; the offsets decide
    /// which of them are computed.
    pub capacity: usize,
    /// Rows of each group's B, columns of D.
    pub n: usize,
    /// The reduction length, a multiple of [`K_ALIGN`].
    pub k: usize,
}

/// The shape of a packed grouped weight gradient ([`grouped_gemm_wgrad`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WgradShape {
    /// The number of groups (experts), `>= 1`.
    pub groups: usize,
    /// Columns (the row stride) of A and B: the packed buffer's rows, a positive multiple of
    /// [`K_ALIGN`]; the offsets decide each group's reduction range within it.
    pub capacity: usize,
    /// Rows of A and of each `D[g]`.
    pub m: usize,
    /// Rows of B, columns of each `D[g]`.
    pub n: usize,
}

/// The `scale_inv` of a grouped operand: one for all groups, or one per group.
#[derive(Debug, Clone, Copy)]
pub enum GroupScales<'a> {
    /// One per-tensor scale_inv for every group.
    Tensor(&'a DeviceScalar),
    /// `groups` f32 values on the device, group `g` scaled by element `g` (read at run time).
    PerGroup(&'a DeviceBuffer<f32>),
}

/// The per-group operand B of [`grouped_gemm_packed`]: `[groups, rows, K]` FP8 bytes and its
/// scales. `From` an [`Operand`] (one scale for all groups); [`GroupedOperand::per_group`]
/// for one scale per group.
#[derive(Debug, Clone, Copy)]
pub struct GroupedOperand<'a> {
    /// `[groups, rows, K]` row-major bytes.
    pub data: &'a DeviceBuffer<u8>,
    /// E4M3 or E5M2 (the same for every group).
    pub format: Fp8Format,
    /// Multiplies each group's product; read on the device at run time.
    pub scale_inv: GroupScales<'a>,
}

impl<'a> GroupedOperand<'a> {
    /// An operand with one `scale_inv` per group (`scales_inv` holds `groups` values).
    pub fn per_group(
        data: &'a DeviceBuffer<u8>,
        format: Fp8Format,
        scales_inv: &'a DeviceBuffer<f32>,
    ) -> GroupedOperand<'a> {
        GroupedOperand {
            data,
            format,
            scale_inv: GroupScales::PerGroup(scales_inv),
        }
    }
}

impl<'a> From<Operand<'a>> for GroupedOperand<'a> {
    fn from(o: Operand<'a>) -> GroupedOperand<'a> {
        GroupedOperand {
            data: o.data,
            format: o.format,
            scale_inv: GroupScales::Tensor(o.scale_inv),
        }
    }
}

/// A validated packed forward problem, as the kernel path receives it.
pub(crate) struct PackedProblem<'a> {
    pub shape: PackedShape,
    pub a: Operand<'a>,
    pub b: GroupedOperand<'a>,
    pub d: GemmOut<'a>,
    pub offsets: &'a DeviceBuffer<i32>,
    pub bias: Option<Bias<'a>>,
    pub accumulate: bool,
    /// The tile-width hint ([`GemmOptions::expected_rows`]).
    pub expected_rows: Option<usize>,
    /// Fast accumulation allowed ([`GemmOptions::fast_accumulation`]).
    pub fast: bool,
    /// The SM cap ([`GemmOptions::max_sms`]).
    pub max_sms: Option<usize>,
}

/// A validated packed weight-gradient problem.
pub(crate) struct WgradProblem<'a> {
    pub shape: WgradShape,
    pub a: Operand<'a>,
    pub b: Operand<'a>,
    pub d: GemmOut<'a>,
    pub offsets: &'a DeviceBuffer<i32>,
    pub accumulate: bool,
    /// The SM cap ([`GemmOptions::max_sms`]).
    pub max_sms: Option<usize>,
}

/// The plain numbers [`validate_packed`] looks at: `(length, address)` of each buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PackedDesc {
    pub groups: usize,
    pub capacity: usize,
    pub n: usize,
    pub k: usize,
    pub a: (usize, u64),
    pub b: (usize, u64),
    pub d: (usize, u64),
    pub bias: Option<(usize, u64)>,
    pub offsets: (usize, u64),
    /// Per-group scales of B, when given.
    pub b_scales: Option<(usize, u64)>,
}

/// The plain numbers [`validate_wgrad`] looks at.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WgradDesc {
    pub groups: usize,
    pub capacity: usize,
    pub m: usize,
    pub n: usize,
    pub a: (usize, u64),
    pub b: (usize, u64),
    pub d: (usize, u64),
    pub offsets: (usize, u64),
    /// Whether a bias was given (refused).
    pub bias: bool,
}

fn check_groups(what: &str, groups: usize) -> Result<()> {
    if groups == 0 || groups > MAX_GRID_YZ {
        return Err(invalid(
            what,
            format!("groups = {groups} outside 1..={MAX_GRID_YZ}"),
        ));
    }
    Ok(())
}

/// `groups + 1` int32 offsets, 4-byte aligned (`groups` already checked, so no overflow).
fn check_offsets(what: &str, groups: usize, (len, addr): (usize, u64)) -> Result<()> {
    check_len(what, "offsets", len, groups + 1)?;
    check_addr(what, "offsets", addr, 4)
}

/// Every rule of [`grouped_gemm_packed`].
pub(crate) fn validate_packed(what: &str, p: &PackedDesc) -> Result<()> {
    check_groups(what, p.groups)?;
    if p.n == 0 || p.k == 0 {
        return Err(invalid(
            what,
            format!("N and K must be >= 1 (got N = {}, K = {})", p.n, p.k),
        ));
    }
    if p.k % K_ALIGN != 0 {
        return Err(invalid(
            what,
            format!("K = {} is not a multiple of {K_ALIGN}", p.k),
        ));
    }
    if p.capacity == 0 || p.capacity % ALIGN_ROWS != 0 {
        return Err(invalid(
            what,
            format!(
                "capacity = {} is not a positive multiple of {ALIGN_ROWS}",
                p.capacity
            ),
        ));
    }
    if p.n.div_ceil(TILE_N) > MAX_GRID_YZ || p.capacity / TILE_M > MAX_GRID_X {
        return Err(invalid(
            what,
            format!(
                "capacity = {} x N = {} is above the grid limits",
                p.capacity, p.n
            ),
        ));
    }
    check_len(what, "A", p.a.0, mul(what, &[p.capacity, p.k])?)?;
    check_len(what, "B", p.b.0, mul(what, &[p.groups, p.n, p.k])?)?;
    check_len(what, "D", p.d.0, mul(what, &[p.capacity, p.n])?)?;
    check_addr(what, "A", p.a.1, ALIGN)?;
    check_addr(what, "B", p.b.1, ALIGN)?;
    check_addr(what, "D", p.d.1, ALIGN)?;
    if let Some((len, addr)) = p.bias {
        check_len(what, "bias", len, p.n)?;
        check_addr(what, "bias", addr, ALIGN)?;
    }
    check_offsets(what, p.groups, p.offsets)?;
    if let Some((len, addr)) = p.b_scales {
        check_len(what, "B scales", len, p.groups)?;
        check_addr(what, "B scales", addr, 4)?;
    }
    Ok(())
}

/// Every rule of [`grouped_gemm_wgrad`].
pub(crate) fn validate_wgrad(what: &str, p: &WgradDesc) -> Result<()> {
    check_groups(what, p.groups)?;
    if p.m == 0 || p.n == 0 {
        return Err(invalid(
            what,
            format!("M and N must be >= 1 (got M = {}, N = {})", p.m, p.n),
        ));
    }
    if p.capacity == 0 || p.capacity % K_ALIGN != 0 {
        return Err(invalid(
            what,
            format!(
                "capacity = {} is not a positive multiple of {K_ALIGN}",
                p.capacity
            ),
        ));
    }
    if p.n.div_ceil(TILE_N) > MAX_GRID_YZ || p.m.div_ceil(TILE_M) > MAX_GRID_X {
        return Err(invalid(
            what,
            format!("M = {} x N = {} is above the grid limits", p.m, p.n),
        ));
    }
    if p.bias {
        return Err(invalid(
            what,
            "a bias is not meaningful for a weight gradient (opts.bias must be None)".into(),
        ));
    }
    check_len(what, "A", p.a.0, mul(what, &[p.m, p.capacity])?)?;
    check_len(what, "B", p.b.0, mul(what, &[p.n, p.capacity])?)?;
    check_len(what, "D", p.d.0, mul(what, &[p.groups, p.m, p.n])?)?;
    check_addr(what, "A", p.a.1, ALIGN)?;
    check_addr(what, "B", p.b.1, ALIGN)?;
    check_addr(what, "D", p.d.1, ALIGN)?;
    check_offsets(what, p.groups, p.offsets)
}

/// Packed grouped GEMM (forward and data gradient of a dropless MoE layer): for every group
/// `g` and every row `r` it owns (`offsets[g] <= r < offsets[g + 1]`),
/// `D[r,:] = a.scale_inv * sb_g * A[r,:] . B[g]^T (+ bias) (+ D[r,:])`, where `sb_g` is
/// `b`'s one scale_inv or its scale for group `g` ([`GroupScales`]).
///
/// A is `[capacity, k]` (the packed rows), B `[groups, n, k]` (one weight per group; pass an
/// [`Operand`] for one scale, [`GroupedOperand::per_group`] for one per group), D
/// `[capacity, n]`, all row-major, bias `n` elements; `offsets` holds `groups + 1` int32 on
/// the device, read by the kernel when it runs (see the [module documentation](self) for
/// what it does with malformed ones). Rows at or past `offsets[groups]` are neither read nor
/// written; padding rows inside a group are computed like the others. Forward:
/// A = permuted activations, B = W; data gradient: A = packed dY, B = W^T per group.
///
/// Rules (checked before anything is enqueued; nothing is written on an error): `groups` in
/// `1..=65535`, `n >= 1`, `k` a positive multiple of [`K_ALIGN`], `capacity` a positive
/// multiple of [`ALIGN_ROWS`], exact buffer lengths, A/B/D/bias 16-byte aligned, offsets and
/// per-group scales 4-byte aligned, `ceil(n / 128) <= 65535`. `Auto` and `Portable` run the
/// portable kernel; [`GemmPath::Hopper`] runs the sm_90a TMA + wgmma kernel, which also needs
/// compute capability 9.0, `n` even and every offset a multiple of [`ALIGN_ROWS`] (the offsets
/// are on the device, so `Auto` can not check that and keeps the portable kernel; callers that
/// own the layout, like the MoE layer, ask for `Hopper`). On that kernel
/// [`GemmOptions::expected_rows`] picks the tile width for the rows the offsets are expected
/// to use (the whole capacity without it). Enqueues one kernel, never synchronises or
/// allocates (capturable).
pub fn grouped_gemm_packed<'a>(
    stream: &Stream,
    shape: PackedShape,
    a: Operand<'a>,
    b: impl Into<GroupedOperand<'a>>,
    d: impl Into<GemmOut<'a>>,
    offsets: &'a DeviceBuffer<i32>,
    opts: GemmOptions<'a>,
) -> Result<()> {
    let problem = packed_problem(
        "grouped_gemm_packed",
        shape,
        a,
        b.into(),
        d.into(),
        offsets,
        &opts,
    )?;
    match opts.path {
        // The sm90 kernel on request only: it needs aligned offsets, which Auto can not check
        // (they are on the device), and Auto promises the rules of the module docs.
        GemmPath::Hopper => super::hopper::launch_packed(stream, &problem),
        GemmPath::Auto | GemmPath::Portable => portable::launch_packed(stream, &problem),
    }
}

/// The packed GEMM of a SwiGLU expert's fc1 with the E4M3 cast of fc2's input:
/// [`grouped_gemm_packed`] into `d` (`[capacity, 2F]` bf16: gate columns `0..F`, up columns
/// `F..2F`, `F = shape.n / 2`), then `h = cast(silu(gate) * up)` of D's bf16 values into
/// `h.out` (`[capacity, F]`) and transposed into `h.out_t` (`[F, capacity]`) for the rows
/// below `offsets[groups]`: exactly what [`grouped_gemm_packed`] followed by
/// [`swiglu_cast_transpose`] (with [`RowsInUse::last`] of `offsets`) writes, bit for bit,
/// scale_inv and amax included.
///
/// On [`GemmPath::Hopper`] with delayed scaling and no noop flag, E4M3 operands and `h`, and
/// F a multiple of 64, it is one kernel: each tile computes matching gate and up columns
/// and its epilogue writes h beside D (the SwiGLU kernel's read of D, 2F bf16 values a row,
/// and its launch are saved). Otherwise it runs those two kernels.
///
/// Rules (checked; nothing is written on an error): those of [`grouped_gemm_packed`] and
/// of [`swiglu_cast_transpose`] for `[capacity, F]`: `shape.n` even, F a positive multiple
/// of 16, `h.out` of shape `[capacity, F]`, `h.out_t` of `capacity * F` bytes, 16-byte
/// aligned. Enqueues without synchronising or allocating (capturable).
#[allow(clippy::too_many_arguments)] // the GEMM's operands and the cast's output
pub fn grouped_gemm_packed_swiglu<'a>(
    stream: &Stream,
    shape: PackedShape,
    a: Operand<'a>,
    b: impl Into<GroupedOperand<'a>>,
    d: &'a DeviceBuffer<bf16>,
    offsets: &'a DeviceBuffer<i32>,
    opts: GemmOptions<'a>,
    h: FusedCastOut<'a>,
) -> Result<()> {
    let what = "grouped_gemm_packed_swiglu";
    let ffn = shape.n / 2;
    if shape.n % 2 != 0 || ffn % 16 != 0 {
        return Err(invalid(
            what,
            format!(
                "N = {} must be 2F with F a positive multiple of 16 (gate and up columns)",
                shape.n
            ),
        ));
    }
    let b = b.into();
    let problem = packed_problem(what, shape, a, b, d.into(), offsets, &opts)?;
    check_outputs(what, shape.capacity, ffn, h.out, h.out_t)?;
    let used = RowsInUse::last(offsets)?;
    let plain = h.scaling != CastScaling::Delayed || h.noop.is_some();
    if opts.path == GemmPath::Hopper
        && !plain
        && super::hopper::launch_packed_swiglu(stream, &problem, (h.out, h.out_t))?
    {
        return Ok(());
    }
    grouped_gemm_packed(stream, shape, a, b, d, offsets, opts)?;
    swiglu_cast_transpose(stream, d, (shape.capacity, ffn), used, h)
}

/// Validates a packed GEMM's arguments (`what` names the entry point in errors) into the
/// problem the launchers take.
fn packed_problem<'a>(
    what: &str,
    shape: PackedShape,
    a: Operand<'a>,
    b: GroupedOperand<'a>,
    d: GemmOut<'a>,
    offsets: &'a DeviceBuffer<i32>,
    opts: &GemmOptions<'a>,
) -> Result<PackedProblem<'a>> {
    let b_scales = match b.scale_inv {
        GroupScales::Tensor(_) => None,
        GroupScales::PerGroup(s) => Some((s.len(), s.as_raw())),
    };
    validate_packed(
        what,
        &PackedDesc {
            groups: shape.groups,
            capacity: shape.capacity,
            n: shape.n,
            k: shape.k,
            a: (a.data.len(), a.data.as_raw()),
            b: (b.data.len(), b.data.as_raw()),
            d: (d.len(), d.device_ptr()),
            bias: opts.bias.map(|x| (x.len(), x.device_ptr())),
            offsets: (offsets.len(), offsets.as_raw()),
            b_scales,
        },
    )?;
    check_max_sms(what, opts.max_sms)?;
    Ok(PackedProblem {
        shape,
        a,
        b,
        d,
        offsets,
        bias: opts.bias,
        accumulate: opts.accumulate,
        expected_rows: opts.expected_rows,
        fast: opts.fast_accumulation,
        max_sms: opts.max_sms,
    })
}

/// Packed grouped weight gradient (dW of every expert): for every group `g`,
/// `D[g] = a.scale_inv * b.scale_inv * A[:, rows of g] . B[:, rows of g]^T (+ D[g])`, a
/// reduction over the group's rows `offsets[g]..offsets[g + 1]` of the packed buffer, whose
/// length `K_g` is read on the device.
///
/// A is `[m, capacity]` (the transpose of the packed dY: dY^T), B `[n, capacity]` (X^T), both
/// row-major with row stride `capacity`, D `[groups, m, n]`; `offsets` holds `groups + 1`
/// int32 on the device, read when the kernel runs (see the [module documentation](self)).
/// A group with `K_g = 0` gets `D[g] = 0` (+0.0), or, with `opts.accumulate`, keeps `D[g]`
/// unchanged. Columns at or past `offsets[groups]` are never read.
///
/// Rules (checked before anything is enqueued; nothing is written on an error): `groups` in
/// `1..=65535`, `m, n >= 1`, `capacity` a positive multiple of [`K_ALIGN`], exact buffer
/// lengths, A/B/D 16-byte aligned, offsets 4-byte aligned, `ceil(n / 128) <= 65535`, no
/// bias (`opts.bias` is refused: it has no meaning for a weight gradient).
/// `Auto` and `Portable` run the portable kernel; [`GemmPath::Hopper`] the sm_90a TMA + wgmma
/// kernel (refused on other devices), which needs every offset a multiple of [`ALIGN_ROWS`]:
/// it reduces over whole 128-column blocks, clamped to `[0, capacity]`, so with other offsets
/// a group's sum may take in its neighbours' columns (still never reading outside A and B).
/// Enqueues one kernel, never synchronises or allocates (capturable).
pub fn grouped_gemm_wgrad<'a>(
    stream: &Stream,
    shape: WgradShape,
    a: Operand<'a>,
    b: Operand<'a>,
    d: impl Into<GemmOut<'a>>,
    offsets: &'a DeviceBuffer<i32>,
    opts: GemmOptions<'a>,
) -> Result<()> {
    let what = "grouped_gemm_wgrad";
    let d = d.into();
    validate_wgrad(
        what,
        &WgradDesc {
            groups: shape.groups,
            capacity: shape.capacity,
            m: shape.m,
            n: shape.n,
            a: (a.data.len(), a.data.as_raw()),
            b: (b.data.len(), b.data.as_raw()),
            d: (d.len(), d.device_ptr()),
            offsets: (offsets.len(), offsets.as_raw()),
            bias: opts.bias.is_some(),
        },
    )?;
    check_max_sms(what, opts.max_sms)?;
    let problem = WgradProblem {
        shape,
        a,
        b,
        d,
        offsets,
        accumulate: opts.accumulate,
        max_sms: opts.max_sms,
    };
    match opts.path {
        // As for the packed forward: the sm90 kernel on request (it needs aligned offsets).
        GemmPath::Hopper => super::hopper::launch_wgrad(stream, &problem),
        GemmPath::Auto | GemmPath::Portable => portable::launch_wgrad(stream, &problem),
    }
}

#[cfg(test)]
mod tests {
    use cuda_graph::Error;

    use super::*;

    pub(super) fn ok_packed(groups: usize, capacity: usize, n: usize, k: usize) -> PackedDesc {
        PackedDesc {
            groups,
            capacity,
            n,
            k,
            a: (capacity * k, 0x1000),
            b: (groups * n * k, 0x2000),
            d: (capacity * n, 0x3000),
            bias: Some((n, 0x4000)),
            offsets: (groups + 1, 0x5004),
            b_scales: Some((groups, 0x6004)),
        }
    }

    pub(super) fn ok_wgrad(groups: usize, capacity: usize, m: usize, n: usize) -> WgradDesc {
        WgradDesc {
            groups,
            capacity,
            m,
            n,
            a: (m * capacity, 0x1000),
            b: (n * capacity, 0x2000),
            d: (groups * m * n, 0x3000),
            offsets: (groups + 1, 0x5004),
            bias: false,
        }
    }

    fn rejects(what: &str, r: Result<()>, fragment: &str) {
        match r {
            Err(Error::InvalidArgument(msg)) => assert!(
                msg.starts_with("t: ") && msg.contains(fragment),
                "{what}: {msg:?} lacks {fragment:?}"
            ),
            other => panic!("{what}: expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn valid_packed_problems_pass() {
        for (g, cap, n, k) in [
            (1, 128, 1, 16),
            (4, 1024, 72, 80),
            (256, 32768, 24, 32),
            (65535, 128, 8, 16),
            (8, 4096, 7168, 2048),
        ] {
            let d = ok_packed(g, cap, n, k);
            assert!(validate_packed("t", &d).is_ok(), "{d:?}");
            let d = PackedDesc {
                bias: None,
                b_scales: None,
                ..d
            };
            assert!(validate_packed("t", &d).is_ok(), "{d:?}");
        }
    }

    #[test]
    fn bad_packed_problems_name_the_argument() {
        let base = ok_packed(4, 512, 40, 48);
        let cases: Vec<(&str, PackedDesc, &str)> = vec![
            (
                "groups = 0",
                PackedDesc {
                    groups: 0,
                    ..ok_packed(0, 512, 40, 48)
                },
                "groups = 0",
            ),
            (
                "groups too many",
                ok_packed(65536, 128, 1, 16),
                "groups = 65536",
            ),
            ("n = 0", PackedDesc { n: 0, ..base }, "N = 0"),
            ("k = 0", PackedDesc { k: 0, ..base }, "K = 0"),
            ("k % 16", ok_packed(4, 512, 40, 40), "K = 40"),
            ("capacity = 0", ok_packed(4, 0, 40, 48), "capacity = 0"),
            (
                "capacity % 128",
                ok_packed(4, 500, 40, 48),
                "capacity = 500",
            ),
            (
                "capacity % 128 (16-aligned)",
                ok_packed(4, 528, 40, 48),
                "capacity = 528",
            ),
            (
                "A length",
                PackedDesc {
                    a: (base.a.0 + 16, 0x1000),
                    ..base
                },
                "A has",
            ),
            (
                "B length",
                PackedDesc {
                    b: (base.b.0 - 48, 0x2000),
                    ..base
                },
                "B has",
            ),
            (
                "D length",
                PackedDesc {
                    d: (base.d.0 - 1, 0x3000),
                    ..base
                },
                "D has",
            ),
            (
                "A misaligned",
                PackedDesc {
                    a: (base.a.0, 0x1008),
                    ..base
                },
                "A at 0x1008",
            ),
            (
                "D misaligned",
                PackedDesc {
                    d: (base.d.0, 0x3004),
                    ..base
                },
                "D at 0x3004",
            ),
            (
                "bias length",
                PackedDesc {
                    bias: Some((39, 0x4000)),
                    ..base
                },
                "bias has 39",
            ),
            (
                "offsets length = groups",
                PackedDesc {
                    offsets: (4, 0x5004),
                    ..base
                },
                "offsets has 4",
            ),
            (
                "offsets misaligned",
                PackedDesc {
                    offsets: (5, 0x5002),
                    ..base
                },
                "offsets at 0x5002",
            ),
            (
                "B scales length",
                PackedDesc {
                    b_scales: Some((5, 0x6004)),
                    ..base
                },
                "B scales has 5",
            ),
            (
                "B scales misaligned",
                PackedDesc {
                    b_scales: Some((4, 0x6001)),
                    ..base
                },
                "B scales at 0x6001",
            ),
            (
                "n tiles",
                PackedDesc {
                    n: 65536 * 128,
                    ..base
                },
                "grid limits",
            ),
            ("overflow", PackedDesc { k: 1 << 60, ..base }, "overflows"),
        ];
        for (name, d, frag) in cases {
            rejects(name, validate_packed("t", &d), frag);
        }
    }

    #[test]
    fn valid_wgrad_problems_pass() {
        for (g, cap, m, n) in [
            (1, 16, 1, 1),
            (4, 1040, 72, 80),
            (256, 32768, 24, 32),
            (65535, 16, 8, 16),
        ] {
            let d = ok_wgrad(g, cap, m, n);
            assert!(validate_wgrad("t", &d).is_ok(), "{d:?}");
        }
    }

    #[test]
    fn bad_wgrad_problems_name_the_argument() {
        let base = ok_wgrad(4, 528, 40, 48);
        let cases: Vec<(&str, WgradDesc, &str)> = vec![
            ("groups = 0", ok_wgrad(0, 528, 40, 48), "groups = 0"),
            ("m = 0", WgradDesc { m: 0, ..base }, "M = 0"),
            ("n = 0", WgradDesc { n: 0, ..base }, "N = 0"),
            ("capacity = 0", ok_wgrad(4, 0, 40, 48), "capacity = 0"),
            ("capacity % 16", ok_wgrad(4, 520, 40, 48), "capacity = 520"),
            ("bias", WgradDesc { bias: true, ..base }, "bias"),
            (
                "A length",
                WgradDesc {
                    a: (base.a.0 - 16, 0x1000),
                    ..base
                },
                "A has",
            ),
            (
                "B length",
                WgradDesc {
                    b: (base.b.0 + 1, 0x2000),
                    ..base
                },
                "B has",
            ),
            (
                "D length (one group short)",
                WgradDesc {
                    d: (3 * 40 * 48, 0x3000),
                    ..base
                },
                "D has",
            ),
            (
                "B misaligned",
                WgradDesc {
                    b: (base.b.0, 0x2010 + 8),
                    ..base
                },
                "B at 0x2018",
            ),
            (
                "offsets length",
                WgradDesc {
                    offsets: (6, 0x5004),
                    ..base
                },
                "offsets has 6",
            ),
            (
                "n tiles",
                WgradDesc {
                    n: 65535 * 128 + 1,
                    ..base
                },
                "grid limits",
            ),
        ];
        for (name, d, frag) in cases {
            rejects(name, validate_wgrad("t", &d), frag);
        }
    }
}

/// Generated inputs for the packed validations: never a panic, accepted exactly where the
/// rules (restated independently below) accept, and every error names a quantity that breaks
/// a rule, with its value. Mirrors the property test of [`validate`](super::validate).
#[cfg(test)]
mod prop {
    use proptest::prelude::*;
    use proptest::sample::select;

    use cuda_graph::Error;

    use super::*;
    use crate::prop_util::{addr, config, fits, len, make_len};

    /// Small sizes mostly; zero; multiples of 16 and 128; around the grid limits; huge.
    fn dim() -> impl Strategy<Value = usize> {
        prop_oneof![
            6 => 1usize..=300,
            3 => (1usize..=64).prop_map(|x| x * 16),
            3 => (1usize..=64).prop_map(|x| x * 128),
            1 => Just(0usize),
            2 => select(vec![
                65535 * 128,
                65535 * 128 + 1,
                ((1 << 31) - 1) * 128,
                ((1 << 31) - 1) * 128 + 128,
                1 << 40,
                usize::MAX / 256 * 128,
                usize::MAX / 2,
                usize::MAX,
            ]),
            1 => any::<usize>(),
        ]
    }

    fn groups() -> impl Strategy<Value = usize> {
        prop_oneof![
            8 => 1usize..=300,
            1 => Just(0usize),
            1 => select(vec![65535, 65536, usize::MAX]),
            1 => any::<usize>(),
        ]
    }

    /// Rules on a buffer: `(name, (len, addr), wanted length if it fits, alignment)`.
    fn buffer_rules(
        v: &mut Vec<Vec<String>>,
        name: &str,
        (len, addr): (usize, u64),
        dims: &[usize],
        align: u64,
    ) {
        match fits(dims) {
            None => v.push(vec![format!("{dims:?}"), "overflows".into()]),
            Some(want) if len != want => {
                v.push(vec![
                    format!("{name} has {len} elements"),
                    format!("{want}"),
                ]);
            }
            Some(_) => {}
        }
        if addr % align != 0 {
            v.push(vec![
                format!("{name} at {addr:#x}"),
                format!("{align}-byte"),
            ]);
        }
    }

    fn groups_rule(v: &mut Vec<Vec<String>>, g: usize) {
        if g == 0 || g > 65535 {
            v.push(vec![format!("groups = {g}")]);
        }
    }

    /// Every rule a packed problem breaks.
    fn broken_packed(d: &PackedDesc) -> Vec<Vec<String>> {
        let mut v = Vec::new();
        let (g, cap, n, k) = (d.groups, d.capacity, d.n, d.k);
        groups_rule(&mut v, g);
        if n == 0 || k == 0 {
            v.push(vec![format!("N = {n}, K = {k}")]);
        }
        if k % 16 != 0 {
            v.push(vec![format!("K = {k}"), "multiple of 16".into()]);
        }
        if cap == 0 || cap % 128 != 0 {
            v.push(vec![format!("capacity = {cap}"), "multiple of 128".into()]);
        }
        if n.div_ceil(128) > 65535 || cap / 128 > (1 << 31) - 1 {
            v.push(vec![format!("capacity = {cap} x N = {n}"), "grid".into()]);
        }
        buffer_rules(&mut v, "A", d.a, &[cap, k], 16);
        buffer_rules(&mut v, "B", d.b, &[g, n, k], 16);
        buffer_rules(&mut v, "D", d.d, &[cap, n], 16);
        if let Some(bias) = d.bias {
            buffer_rules(&mut v, "bias", bias, &[n], 16);
        }
        // groups + 1 only matters where groups passed its own rule.
        buffer_rules(&mut v, "offsets", d.offsets, &[g.saturating_add(1)], 4);
        if let Some(s) = d.b_scales {
            buffer_rules(&mut v, "B scales", s, &[g], 4);
        }
        v
    }

    /// Every rule a wgrad problem breaks.
    fn broken_wgrad(d: &WgradDesc) -> Vec<Vec<String>> {
        let mut v = Vec::new();
        let (g, cap, m, n) = (d.groups, d.capacity, d.m, d.n);
        groups_rule(&mut v, g);
        if m == 0 || n == 0 {
            v.push(vec![format!("M = {m}, N = {n}")]);
        }
        if cap == 0 || cap % 16 != 0 {
            v.push(vec![format!("capacity = {cap}"), "multiple of 16".into()]);
        }
        if n.div_ceil(128) > 65535 || m.div_ceil(128) > (1 << 31) - 1 {
            v.push(vec![format!("M = {m} x N = {n}"), "grid".into()]);
        }
        if d.bias {
            v.push(vec!["bias".into(), "weight gradient".into()]);
        }
        buffer_rules(&mut v, "A", d.a, &[m, cap], 16);
        buffer_rules(&mut v, "B", d.b, &[n, cap], 16);
        buffer_rules(&mut v, "D", d.d, &[g, m, n], 16);
        buffer_rules(&mut v, "offsets", d.offsets, &[g.saturating_add(1)], 4);
        v
    }

    prop_compose! {
        fn packed_strategy()(
            (groups, capacity, n, k) in (groups(), dim(), dim(), dim()),
            lens in [len(), len(), len(), len(), len(), len()],
            addrs in [addr(), addr(), addr(), addr(), addr(), addr()],
            bias in any::<bool>(),
            b_scales in any::<bool>(),
        ) -> PackedDesc {
            PackedDesc {
                groups,
                capacity,
                n,
                k,
                a: (make_len(lens[0], fits(&[capacity, k])), addrs[0]),
                b: (make_len(lens[1], fits(&[groups, n, k])), addrs[1]),
                d: (make_len(lens[2], fits(&[capacity, n])), addrs[2]),
                bias: bias.then(|| (make_len(lens[3], Some(n)), addrs[3])),
                offsets: (make_len(lens[4], groups.checked_add(1)), addrs[4]),
                b_scales: b_scales.then(|| (make_len(lens[5], Some(groups)), addrs[5])),
            }
        }
    }

    prop_compose! {
        fn wgrad_strategy()(
            (groups, capacity, m, n) in (groups(), dim(), dim(), dim()),
            lens in [len(), len(), len(), len()],
            addrs in [addr(), addr(), addr(), addr()],
            bias in proptest::bool::weighted(0.05),
        ) -> WgradDesc {
            WgradDesc {
                groups,
                capacity,
                m,
                n,
                a: (make_len(lens[0], fits(&[m, capacity])), addrs[0]),
                b: (make_len(lens[1], fits(&[n, capacity])), addrs[1]),
                d: (make_len(lens[2], fits(&[groups, m, n])), addrs[2]),
                offsets: (make_len(lens[3], groups.checked_add(1)), addrs[3]),
                bias,
            }
        }
    }

    fn judge(
        what: &str,
        got: Result<()>,
        broken: &[Vec<String>],
        desc: &dyn std::fmt::Debug,
    ) -> std::result::Result<(), TestCaseError> {
        match got {
            Ok(()) => prop_assert!(
                broken.is_empty(),
                "{:?} accepted, breaks {:?}",
                desc,
                broken
            ),
            Err(Error::InvalidArgument(msg)) => {
                prop_assert!(msg.starts_with(&format!("{what}: ")), "{}", msg);
                prop_assert!(
                    broken
                        .iter()
                        .any(|frags| frags.iter().all(|f| msg.contains(f.as_str()))),
                    "{:?}: {:?} names none of {:?}",
                    desc,
                    msg,
                    broken
                );
            }
            Err(e) => prop_assert!(false, "{:?}: not InvalidArgument: {:?}", desc, e),
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(config(50_000))]

        #[test]
        fn validate_packed_accepts_exactly_the_rules(d in packed_strategy()) {
            judge("prop_packed", validate_packed("prop_packed", &d), &broken_packed(&d), &d)?;
        }

        #[test]
        fn validate_wgrad_accepts_exactly_the_rules(d in wgrad_strategy()) {
            judge("prop_wgrad", validate_wgrad("prop_wgrad", &d), &broken_wgrad(&d), &d)?;
        }
    }
}
