//! FP8 casts fused with a dropless MoE layer's data movement and SwiGLU: each launcher writes
//! its result in FP8 row-major and transposed in one pass (the layout the expert GEMMs take:
//! row-major for the forward and data-gradient GEMMs, transposed for the weight-gradient
//! GEMMs), maxes amax, and never stores the high-precision tensor.
//!
//! # The packed layout
//! The layer permutes its `T * k` token assignments into a buffer of `rows` (the capacity)
//! rows in expert-major order: each expert's rows start at a multiple of the GEMM's row tile,
//! and the rows between one expert's last token and the next expert's start are padding,
//! written as zero. Only the first [`RowsInUse`] rows (an int32 read on the device when the
//! kernel runs, e.g. the last entry of the experts' offsets) are in use: tiles past it are
//! skipped (not written), so the casts cost what the tokens need, not what the capacity
//! allows, and a captured graph stays right as the routing changes.
//!
//! # Kernels
//! * [`gather_cast_transpose`]: row `r` is `input[token_of_row[r] / k]`, times
//!   `row_scale[token_of_row[r]]` when given: the permute of the layer's input (no scale)
//!   and the backward of its combine (`dY[r] = gate * dy[t]`). An entry that is negative or
//!   not below `tokens * k` is a padding row (zero).
//! * [`swiglu_cast_transpose`]: `a` is `[rows, 2F]` (gate columns `0..F`, up columns
//!   `F..2F`), the output `[rows, F]` is `silu(gate) * up`, `silu(v) = v * sigmoid(v)`.
//! * [`swiglu_backward_cast_transpose`]: from `a` and `dh` `[rows, F]`, the output
//!   `[rows, 2F]` is `d gate = dh * up * silu'(gate)` (columns `0..F`) and
//!   `d up = dh * silu(gate)` (columns `F..2F`), `silu'(v) = s (1 + v (1 - s))`, `s = sigmoid(v)`.
//!
//! The math is f32 (the sigmoid from the hardware's `exp2` and reciprocal approximations:
//! `__expf`, `__fdividef`, a few ulp), rounded once by the FP8 cast: `sat_rne(v * scale)`,
//! `out.scale_inv() = 1 / scale` written, nothing written when `noop` holds 1. The scale
//! ([`CastScaling`]): delayed, read from `out.scale()`, with `max |v|` (unscaled, rows in use
//! only) maxed into `out.amax()` (one launch); or current, `out.amax()` set to this tensor's
//! `max |v|` first and `scale = fp8_max / amax` (1 when the amax is 0 or not finite) written to
//! `out.scale()` and used (three launches: zero the amax, the amax pass, the cast). Every
//! launcher validates first (nothing is enqueued on an error), then enqueues without
//! synchronising or allocating (capturable).

use cuda_graph::half::bf16;
use cuda_graph::{DeviceBuffer, Error, KernelArgs, LaunchConfig, Result, Stream};

use crate::cast_transpose::{
    CTAS_PER_SM, THREADS, blocks_per_matrix, check_outputs, matrix_numel, push_noop, slot_indices,
    tile_count,
};
use crate::format::DType;
use crate::module::kernel;
use crate::quantize::ALIGN;
use crate::tensor::{DeviceScalar, Fp8Tensor, HpBuffer, check_align};

/// Resident blocks per SM of the SwiGLU cast's grid (`SWIGLU_CTAS_PER_SM` in
/// `kernels/moe_cast.cuh`; keep in step).
const SWIGLU_CTAS_PER_SM: u32 = 3;
/// Resident blocks per SM of the SwiGLU backward's grid (`SWIGLU_BWD_CTAS_PER_SM`).
const SWIGLU_BWD_CTAS_PER_SM: u32 = 2;
/// The largest `k` of a gather (top-k routing).
pub const MAX_TOP_K: usize = 8;

/// The number of rows in use of a packed buffer: the int32 at `index` of `buf`, read on the
/// device when the kernel runs (negative counts as 0, more than the buffer's rows as all);
/// optionally ([`padding`](Self::padding)) which of them are padding.
#[derive(Debug, Clone, Copy)]
pub struct RowsInUse<'a> {
    buf: &'a DeviceBuffer<i32>,
    index: u32,
    padding: Option<&'a DeviceBuffer<i32>>,
}

impl<'a> RowsInUse<'a> {
    /// The int32 at `index` of `buf`; an error when `index` is outside it.
    pub fn at(buf: &'a DeviceBuffer<i32>, index: usize) -> Result<RowsInUse<'a>> {
        if index >= buf.len() {
            return Err(Error::InvalidArgument(format!(
                "RowsInUse: index {index} outside a buffer of {} int32",
                buf.len()
            )));
        }
        let index = u32::try_from(index)
            .map_err(|_| Error::InvalidArgument(format!("RowsInUse: index {index} above u32")))?;
        Ok(RowsInUse {
            buf,
            index,
            padding: None,
        })
    }

    /// These rows, with `token_of_row` (one int32 per row of the packed buffer, on the device:
    /// the dispatch plan's) marking padding: a row whose entry is negative is read as zeros.
    /// The SwiGLU casts then skip loading those rows (a dropless layer's padding is zeros
    /// anyway: the result is the same, with less read; at 256 tokens, top-2 of 8 experts,
    /// half the rows in use are padding). The gathers read `token_of_row` themselves and
    /// ignore this. The casts check that it holds a row for every row of their buffer.
    pub fn padding(mut self, token_of_row: &'a DeviceBuffer<i32>) -> RowsInUse<'a> {
        self.padding = Some(token_of_row);
        self
    }

    /// The last int32 of `buf` (the end of the last expert's rows in an offsets buffer of
    /// `experts + 1` entries); an error when `buf` is empty.
    pub fn last(buf: &'a DeviceBuffer<i32>) -> Result<RowsInUse<'a>> {
        match buf.len() {
            0 => Err(Error::InvalidArgument(
                "RowsInUse: empty offsets buffer".into(),
            )),
            n => RowsInUse::at(buf, n - 1),
        }
    }
}

/// How a fused cast picks its scale (see the [module documentation](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CastScaling {
    /// The scale in `out.scale()` (a delayed-scaling recipe's); the amax maxed into
    /// `out.amax()` for the next update.
    #[default]
    Delayed,
    /// The scale from this tensor's own amax, computed first (three launches).
    Current,
}

/// Where a fused cast writes, and how it scales: `out` (row-major, its scale, scale_inv and
/// amax slots) and `out_t` (the transposed bytes).
#[derive(Debug, Clone, Copy)]
pub struct FusedCastOut<'a> {
    /// The row-major FP8 output `[rows, cols]` and its scalars.
    pub out: &'a Fp8Tensor,
    /// The transposed FP8 output, `rows * cols` bytes (`[cols, rows]`).
    pub out_t: &'a DeviceBuffer<u8>,
    /// Delayed or current scaling.
    pub scaling: CastScaling,
    /// A device flag: 1.0 at run time means write nothing.
    pub noop: Option<&'a DeviceScalar>,
}

impl<'a> FusedCastOut<'a> {
    /// Delayed scaling, no noop flag.
    pub fn new(out: &'a Fp8Tensor, out_t: &'a DeviceBuffer<u8>) -> FusedCastOut<'a> {
        FusedCastOut {
            out,
            out_t,
            scaling: CastScaling::Delayed,
            noop: None,
        }
    }

    /// This output with `scaling`.
    pub fn scaling(mut self, scaling: CastScaling) -> FusedCastOut<'a> {
        self.scaling = scaling;
        self
    }
}

/// The source of a fused cast, as its kernels take it.
enum Source<'a> {
    Gather {
        input: HpBuffer<'a>,
        token_of_row: &'a DeviceBuffer<i32>,
        row_scale: Option<&'a DeviceBuffer<f32>>,
        assignments: u64,
        k: u32,
    },
    Swiglu {
        a: &'a DeviceBuffer<bf16>,
        pad: Option<&'a DeviceBuffer<i32>>,
    },
    SwigluBackward {
        a: &'a DeviceBuffer<bf16>,
        dh: &'a DeviceBuffer<bf16>,
        pad: Option<&'a DeviceBuffer<i32>>,
    },
}

impl Source<'_> {
    /// Pushes the source's kernel parameters (`null` holds 0: an absent pointer).
    fn push<'k>(&'k self, args: KernelArgs<'k>, null: &'k u64) -> KernelArgs<'k> {
        match self {
            Source::Gather {
                input,
                token_of_row,
                row_scale,
                assignments,
                k,
            } => {
                let args = input.push_to(args).arg(*token_of_row);
                let args = match row_scale {
                    Some(g) => args.arg(*g),
                    None => args.arg(null),
                };
                args.arg(assignments).arg(k)
            }
            Source::Swiglu { a, pad } => push_pad(args.arg(*a), *pad, null),
            Source::SwigluBackward { a, dh, pad } => push_pad(args.arg(*a).arg(*dh), *pad, null),
        }
    }
}

/// Pushes a SwiGLU source's padding marks (`null`, which holds 0, when absent).
fn push_pad<'k>(
    args: KernelArgs<'k>,
    pad: Option<&'k DeviceBuffer<i32>>,
    null: &'k u64,
) -> KernelArgs<'k> {
    match pad {
        Some(p) => args.arg(p),
        None => args.arg(null),
    }
}

/// The padding marks of `used`, checked to cover `rows` rows.
fn checked_padding<'a>(
    what: &str,
    used: RowsInUse<'a>,
    rows: usize,
) -> Result<Option<&'a DeviceBuffer<i32>>> {
    match used.padding {
        Some(p) if p.len() < rows => Err(Error::InvalidArgument(format!(
            "{what}: the padding marks (token_of_row) have {} entries, the {rows} rows need \
             one each",
            p.len()
        ))),
        p => Ok(p),
    }
}

/// Enqueues one fused cast family's launches: `name` the kernel family (the format suffix and
/// the `_current` / `_amax` entries are derived from it), `dims` = (rows, the source's
/// columns as the kernel takes them), `tiles` the tiles of all `rows`, `ctas_per_sm` the
/// family's resident blocks per SM.
fn launch_fused(
    stream: &Stream,
    name: &str,
    source: Source<'_>,
    dims: (u64, u64),
    used: RowsInUse<'_>,
    (tiles, ctas_per_sm): (u32, u32),
    dst: FusedCastOut<'_>,
) -> Result<()> {
    let out = dst.out;
    let indices = slot_indices(out, dst.noop)?;
    let fmt = out.format().name();
    let null = 0u64;
    let (rows, cols) = dims;
    let current = dst.scaling == CastScaling::Current;
    let kname = if current {
        format!("{name}_current_{fmt}")
    } else {
        format!("{name}_{fmt}")
    };
    let (kern, sms) = kernel(stream.context(), &kname)?;
    // A persistent grid over the tiles of all rows; the kernels stop at the rows in use.
    let cfg = LaunchConfig::linear(blocks_per_matrix(tiles, sms, ctas_per_sm, 1), THREADS);
    if current {
        let amax_idx = [indices[2], indices[3]];
        let (zero, _) = kernel(stream.context(), "fp8_zero_amax")?;
        let args =
            push_noop(KernelArgs::new().arg(out.amax().buffer()), dst.noop, &null).arg(&amax_idx);
        // SAFETY: fp8_zero_amax(float*, const float*, uint2) writes amax[idx.x] only, an
        // index inside the amax buffer (DeviceScalar checks it); it reads the noop slot.
        unsafe { stream.launch_pdl(&zero, &LaunchConfig::linear(1, 32), &args) }?;
        let (amax, _) = kernel(stream.context(), &format!("{name}_amax"))?;
        let args = source
            .push(KernelArgs::new(), &null)
            .arg(&rows)
            .arg(&cols)
            .arg(used.buf)
            .arg(&used.index)
            .arg(out.amax().buffer());
        let args = push_noop(args, dst.noop, &null).arg(&amax_idx);
        // SAFETY: the amax pass reads what the cast below reads (see there) and writes only
        // the amax slot.
        unsafe { stream.launch_pdl(&amax, &cfg, &args) }?;
    }
    let args = source
        .push(KernelArgs::new(), &null)
        .arg(out.data())
        .arg(dst.out_t)
        .arg(&rows)
        .arg(&cols)
        .arg(used.buf)
        .arg(&used.index)
        .arg(out.scale().buffer())
        .arg(out.scale_inv().buffer())
        .arg(out.amax().buffer());
    let args = push_noop(args, dst.noop, &null).arg(&indices);
    // SAFETY: the callers checked that the kernel's reads (the source, rows x cols of it
    // through `source`'s buffers) and writes (rows x the output's columns bytes to each of
    // out.data() and out_t, 16-byte aligned) are inside their buffers; used.buf is read at a
    // checked index; the scalar slots are inside their buffers (DeviceScalar checks them).
    unsafe { stream.launch_pdl(&kern, &cfg, &args) }
}

/// Which token row each packed row holds, for [`gather_cast_transpose`].
#[derive(Debug, Clone, Copy)]
pub struct Gather<'a> {
    /// `[rows]`: the assignment `t * k + j` a row holds (token `t`'s `j`-th expert), or a
    /// negative value for a padding row.
    pub token_of_row: &'a DeviceBuffer<i32>,
    /// Experts per token (`k`), `1..=`[`MAX_TOP_K`].
    pub top_k: usize,
    /// Optional `[tokens * k]` per-assignment factor (the gates, for the combine's
    /// backward).
    pub row_scale: Option<&'a DeviceBuffer<f32>>,
}

/// Gathers token rows into the packed layout and casts them: `out[r, :] =
/// cast(input[token_of_row[r] / k, :] * row_scale[token_of_row[r]])` for the rows in use
/// (padding rows zero), written row-major into `dst.out` (`[rows, cols]`, `rows =
/// token_of_row.len()`) and transposed into `dst.out_t` (`[cols, rows]`). See the [module
/// documentation](self) for the scaling and the rows in use.
///
/// Requirements (checked; nothing is written on an error): `input` f32 or bf16 of
/// `tokens * cols` elements, `tokens >= 1`, `cols >= 1`; `1 <= top_k <= 8`, `tokens * top_k`
/// within i32; `row_scale` of `tokens * top_k` elements; `dst.out.shape() == [rows, cols]`,
/// `dst.out_t` of `rows * cols` bytes; the input and outputs 16-byte aligned.
pub fn gather_cast_transpose<'a>(
    stream: &Stream,
    input: impl Into<HpBuffer<'a>>,
    (tokens, cols): (usize, usize),
    gather: Gather<'a>,
    used: RowsInUse<'a>,
    dst: FusedCastOut<'_>,
) -> Result<()> {
    let what = "gather_cast_transpose";
    let input: HpBuffer<'a> = input.into();
    let dtype = input.dtype();
    if dtype == DType::F16 {
        return Err(Error::InvalidArgument(format!(
            "{what}: input must be f32 or bf16, not f16"
        )));
    }
    let n = matrix_numel(what, tokens, cols)?;
    if input.len() != n {
        return Err(Error::InvalidArgument(format!(
            "{what}: input has {} elements, [{tokens}, {cols}] needs {n}",
            input.len()
        )));
    }
    let k = gather.top_k;
    if !(1..=MAX_TOP_K).contains(&k) {
        return Err(Error::InvalidArgument(format!(
            "{what}: top_k = {k} must be within 1..={MAX_TOP_K}"
        )));
    }
    let assignments = match tokens.checked_mul(k) {
        Some(a) if a <= i32::MAX as usize => a,
        _ => {
            return Err(Error::InvalidArgument(format!(
                "{what}: {tokens} tokens x top_k {k} assignments exceed i32"
            )));
        }
    };
    if let Some(g) = gather.row_scale
        && g.len() != assignments
    {
        return Err(Error::InvalidArgument(format!(
            "{what}: row_scale has {} elements, {tokens} tokens x top_k {k} needs {assignments}",
            g.len()
        )));
    }
    let rows = gather.token_of_row.len();
    check_align(format_args!("{what} input"), input.device_ptr(), ALIGN)?;
    check_outputs(what, rows, cols, dst.out, dst.out_t)?;
    let tiles = tile_count(rows, cols, dtype)?;
    let source = Source::Gather {
        input,
        token_of_row: gather.token_of_row,
        row_scale: gather.row_scale,
        assignments: assignments as u64,
        k: k as u32,
    };
    // The kernels read input rows only at token indices a / k with 0 <= a < tokens * k
    // (other entries are padding), each of cols elements inside the checked tokens * cols;
    // row_scale at those a (tokens * k checked); token_of_row at rows < its length.
    launch_fused(
        stream,
        &format!("fp8_moe_gather_cast_transpose_{}", dtype.name()),
        source,
        (rows as u64, cols as u64),
        used,
        (tiles, CTAS_PER_SM),
        dst,
    )
}

/// Checks `a` (`[rows, 2 * ffn]` bf16) and `ffn` for the SwiGLU casts: `rows >= 1`,
/// `ffn` a positive multiple of 16, `a` 16-byte aligned.
fn check_swiglu_input(what: &str, a: &DeviceBuffer<bf16>, rows: usize, ffn: usize) -> Result<()> {
    if ffn == 0 || ffn % 16 != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what}: ffn = {ffn} must be a positive multiple of 16"
        )));
    }
    let n = matrix_numel(what, rows, ffn)?;
    let want = n.checked_mul(2).ok_or_else(|| {
        Error::InvalidArgument(format!("{what}: [{rows}, 2 x {ffn}] overflows usize"))
    })?;
    if a.len() != want {
        return Err(Error::InvalidArgument(format!(
            "{what}: a has {} elements, [{rows}, 2 x {ffn}] needs {want}",
            a.len()
        )));
    }
    check_align(format_args!("{what} a"), a.as_raw(), ALIGN)
}

/// `out = cast(silu(gate) * up)` of the packed fc1 output `a` (`[rows, 2 * ffn]` bf16, gate
/// columns first), row-major into `dst.out` (`[rows, ffn]`) and transposed into `dst.out_t`
/// (`[ffn, rows]`), for the rows in use; rows `used` marks as padding
/// ([`RowsInUse::padding`]) are read as zeros. See the [module documentation](self).
///
/// Requirements (checked; nothing is written on an error): `rows >= 1`; `ffn` a positive
/// multiple of 16; `a` of `rows * 2 * ffn` elements; `dst.out.shape() == [rows, ffn]`,
/// `dst.out_t` of `rows * ffn` bytes; all 16-byte aligned; padding marks, when given, at
/// least `rows` of them.
pub fn swiglu_cast_transpose(
    stream: &Stream,
    a: &DeviceBuffer<bf16>,
    (rows, ffn): (usize, usize),
    used: RowsInUse<'_>,
    dst: FusedCastOut<'_>,
) -> Result<()> {
    let what = "swiglu_cast_transpose";
    check_swiglu_input(what, a, rows, ffn)?;
    check_outputs(what, rows, ffn, dst.out, dst.out_t)?;
    let pad = checked_padding(what, used, rows)?;
    let tiles = tile_count(rows, ffn, DType::Bf16)?;
    // The kernels read rows * 2 * ffn elements of a and, with padding marks, one int32 per
    // row (both checked).
    launch_fused(
        stream,
        "fp8_swiglu_cast_transpose_bf16",
        Source::Swiglu { a, pad },
        (rows as u64, ffn as u64),
        used,
        (tiles, SWIGLU_CTAS_PER_SM),
        dst,
    )
}

/// The SwiGLU backward fused with its casts: from `a` (`[rows, 2 * ffn]` bf16) and `dh`
/// (`[rows, ffn]` bf16), `out = cast([d gate, d up])` row-major into `dst.out` (`[rows, 2 *
/// ffn]`) and transposed into `dst.out_t` (`[2 * ffn, rows]`), for the rows in use; rows
/// `used` marks as padding ([`RowsInUse::padding`]) are read as zeros (`a` and `dh`). See
/// the [module documentation](self).
///
/// Requirements (checked; nothing is written on an error): as [`swiglu_cast_transpose`],
/// plus `dh` of `rows * ffn` elements, 16-byte aligned, and `dst.out.shape() == [rows, 2 *
/// ffn]`.
pub fn swiglu_backward_cast_transpose(
    stream: &Stream,
    a: &DeviceBuffer<bf16>,
    dh: &DeviceBuffer<bf16>,
    (rows, ffn): (usize, usize),
    used: RowsInUse<'_>,
    dst: FusedCastOut<'_>,
) -> Result<()> {
    let what = "swiglu_backward_cast_transpose";
    check_swiglu_input(what, a, rows, ffn)?;
    if dh.len() != rows * ffn {
        return Err(Error::InvalidArgument(format!(
            "{what}: dh has {} elements, [{rows}, {ffn}] needs {}",
            dh.len(),
            rows * ffn
        )));
    }
    check_align(format_args!("{what} dh"), dh.as_raw(), ALIGN)?;
    check_outputs(what, rows, 2 * ffn, dst.out, dst.out_t)?;
    let pad = checked_padding(what, used, rows)?;
    // Tiles over the ffn source columns: each gives d gate and d up of its columns.
    let tiles = tile_count(rows, ffn, DType::Bf16)?;
    // The kernels read rows * 2 * ffn elements of a, rows * ffn of dh and, with padding
    // marks, one int32 per row (all checked).
    launch_fused(
        stream,
        "fp8_swiglu_backward_cast_transpose_bf16",
        Source::SwigluBackward { a, dh, pad },
        (rows as u64, ffn as u64),
        used,
        (tiles, SWIGLU_BWD_CTAS_PER_SM),
        dst,
    )
}
