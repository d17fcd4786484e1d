//! FP8 GEMM: `D[M,N] = scale_inv_a * scale_inv_b * A[M,K] x B[N,K]^T (+ bias) (+ D)`.
//!
//! Both operands are K-major ("TN"): A is `[M, K]` row-major and B is `[N, K]` row-major,
//! which is how a linear layer stores activations and weights. The other two GEMMs of a
//! linear layer take cast-transpose outputs so they have the same layout:
//! * forward: `Y[M,N] = X[M,K] . W[N,K]^T` — A = X, B = W;
//! * data gradient: `dX[M,K] = dY[M,N] . W[N,K]` — A = dY, B = W^T (`[K,N]`, the
//!   cast-transpose of W);
//! * weight gradient: `dW[N,K] = dY^T . X` — A = dY^T (`[N,M]`), B = X^T (`[K,M]`), both
//!   cast-transposes.
//!
//! Every entry point takes exactly this one layout: A `[rows, K]` and B `[cols, K]`, both
//! row-major FP8 bytes, D `[rows, cols]` row-major:
//! * [`gemm`]: one GEMM;
//! * [`grouped_gemm`]: MoE experts in the *masked* layout, A `[G, m_max, K]`, B `[G, N, K]`,
//!   D `[G, m_max, N]`, with per-group row counts on the device;
//! * [`grouped_gemm_packed`]: MoE experts in the *packed* (dropless) layout, A
//!   `[capacity, K]` holding every group's rows back to back from device offsets
//!   (`groups + 1` int32, multiples of [`ALIGN_ROWS`]), B `[G, N, K]`, D `[capacity, N]`;
//!   forward and data gradient; [`grouped_gemm_packed_swiglu`] is the SwiGLU expert's fc1
//!   with the FP8 cast of fc2's input fused into its epilogue;
//! * [`grouped_gemm_wgrad`]: the packed layout's weight gradient, A `[M, capacity]` and B
//!   `[N, capacity]` (the transposes of the packed dY and X, so the reduction runs along
//!   the packed rows, each group over its own offsets range), D `[G, M, N]`;
//! * [`gemm_blockwise`]: block-scaled (1x128 / 128x128) operands;
//! * [`gemm_reference`]: the slow GPU test oracle.
//!
//! The packed entry points have rules of their own (capacity, offsets; see their docs and
//! the module documentation of their [`packed`] submodule, which also says what the
//! kernels do with malformed offsets); the rules below are those of the others.
//!
//! # Rules (checked before anything is enqueued; nothing is written on an error)
//! * `M, N, K >= 1`, and `K % 16 == 0` ([`K_ALIGN`]): every row of A and B then starts on a
//!   16-byte boundary, which the kernels' 16-byte loads need. M and N are free.
//! * Buffer lengths exactly match the shapes (`A: [G,] M x K`, `B: [G,] N x K`,
//!   `D: [G,] M x N`, bias `N`, counts `G`), sizes computed without overflow.
//! * A, B, D and the bias start on a 16-byte boundary ([`ALIGN`](crate::ALIGN); buffers from
//!   [`DeviceBuffer::alloc`] always do).
//! * Formats: all four combinations of E4M3 and E5M2 (E4M3 x E4M3 forward, E5M2 x E4M3 and
//!   E4M3 x E5M2 for gradients, E5M2 x E5M2). The portable path widens FP8 to f16, in which
//!   every value of both formats is exact, so it takes every combination; Hopper's
//!   `wgmma` also has all four.
//! * At most 65535 groups and `ceil(N / 128) <= 65535` (grid limits).
//!
//! # Numerics
//! FP8 x FP8 products are exact in fp32 and accumulate in fp32; the epilogue computes
//! `acc * (scale_inv_a * scale_inv_b) (+ bias) (+ D)` in f32 and rounds once to the output
//! (bf16: round to nearest even). NaN and inf inputs (E5M2) propagate as IEEE arithmetic
//! does.
//!
//! # Paths
//! [`GemmPath::Portable`] is an `mma.sync` kernel that runs on sm_80 and newer (FP8 widened to
//! f16 in registers, fp32 accumulation). [`GemmPath::Hopper`] is the sm_90a `wgmma` kernel;
//! [`GemmPath::Auto`] takes it where the device and problem allow and the portable path
//! otherwise; the packed GEMMs run the portable kernel by default (the packed forward has an
//! sm_90a kernel on explicit `Hopper`; the packed weight gradient refuses `Hopper`).
//! On the sm_90a path a plain GEMM of at most 128 rows whose 128-column tiles leave SMs idle
//! (decode-sized batches against large weights, such as 64 x 4096 x 7168) runs the skinny
//! kernel: the weights take the tensor cores' 64-row side (swap-AB), K is split over a
//! thread-block cluster of 2 to 8 CTAs (as many as the device holds in one wave, which the
//! driver reports), and the CTAs add their f32 partial sums through
//! distributed shared memory in a fixed order: no workspace, no second kernel, the same bits
//! every run (the sum's order differs from the unsplit kernel's, within f32 rounding).
//! Every launcher enqueues without synchronising or allocating, so the GEMMs can be captured
//! into graphs; scales, grouped row counts and packed offsets are read on the device.

pub mod packed;
mod portable;
pub mod reference;

pub use packed::{
    ALIGN_ROWS, GroupScales, GroupedOperand, PackedShape, WgradShape, grouped_gemm_packed,
    grouped_gemm_packed_swiglu, grouped_gemm_wgrad,
};

use cuda_graph::half::bf16;
use cuda_graph::{DeviceBuffer, Error, Result, Stream};

pub(crate) mod hopper;

use crate::format::Fp8Format;
use crate::tensor::DeviceScalar;

/// K must be a multiple of this.
pub const K_ALIGN: usize = 16;
/// The alignment (bytes) of A, B, D and the bias.
const ALIGN: u64 = crate::quantize::ALIGN;
/// Largest `gridDim.y` / `gridDim.z` (N tiles, groups).
const MAX_GRID_YZ: usize = 65535;
/// Largest `gridDim.x` (M tiles).
const MAX_GRID_X: usize = (1 << 31) - 1;

/// The shape of a GEMM: `D[m, n] = A[m, k] . B[n, k]^T`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmShape {
    /// Rows of A and D (tokens, for a linear layer's forward).
    pub m: usize,
    /// Rows of B, columns of D (output features).
    pub n: usize,
    /// The reduction length: columns of A and B (input features); a multiple of
    /// [`K_ALIGN`].
    pub k: usize,
}

impl GemmShape {
    /// `m x n x k`.
    pub fn new(m: usize, n: usize, k: usize) -> GemmShape {
        GemmShape { m, n, k }
    }
}

/// The shape of a grouped GEMM ([`grouped_gemm`]): `groups` GEMMs of up to `m_max` rows
/// each, all `n x k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GroupedShape {
    /// The number of groups (experts).
    pub groups: usize,
    /// Rows allocated per group; each group's real row count is read on the device.
    pub m_max: usize,
    /// Rows of each B, columns of D.
    pub n: usize,
    /// The reduction length, a multiple of [`K_ALIGN`].
    pub k: usize,
}

/// Where a GEMM writes its output: `[M, N]` row-major (or `[G, m_max, N]` grouped).
/// `From` a `&DeviceBuffer<bf16>` or `&DeviceBuffer<f32>`.
#[derive(Debug, Clone, Copy)]
pub enum GemmOut<'a> {
    /// bf16 output.
    Bf16(&'a DeviceBuffer<bf16>),
    /// f32 output.
    F32(&'a DeviceBuffer<f32>),
}

impl<'a> From<&'a DeviceBuffer<bf16>> for GemmOut<'a> {
    fn from(b: &'a DeviceBuffer<bf16>) -> GemmOut<'a> {
        GemmOut::Bf16(b)
    }
}

impl<'a> From<&'a DeviceBuffer<f32>> for GemmOut<'a> {
    fn from(b: &'a DeviceBuffer<f32>) -> GemmOut<'a> {
        GemmOut::F32(b)
    }
}

/// An optional bias of `N` elements, added to every row. `From` a `&DeviceBuffer<bf16>` or
/// `&DeviceBuffer<f32>`.
#[derive(Debug, Clone, Copy)]
pub enum Bias<'a> {
    /// bf16 bias.
    Bf16(&'a DeviceBuffer<bf16>),
    /// f32 bias.
    F32(&'a DeviceBuffer<f32>),
}

impl<'a> From<&'a DeviceBuffer<bf16>> for Bias<'a> {
    fn from(b: &'a DeviceBuffer<bf16>) -> Bias<'a> {
        Bias::Bf16(b)
    }
}

impl<'a> From<&'a DeviceBuffer<f32>> for Bias<'a> {
    fn from(b: &'a DeviceBuffer<f32>) -> Bias<'a> {
        Bias::F32(b)
    }
}

/// One FP8 operand: K-major data and its per-tensor `scale_inv` on the device.
#[derive(Debug, Clone, Copy)]
pub struct Operand<'a> {
    /// `[rows, K]` row-major bytes (grouped: `[G, rows, K]`).
    pub data: &'a DeviceBuffer<u8>,
    /// E4M3 or E5M2.
    pub format: Fp8Format,
    /// Multiplies the product; read on the device at run time.
    pub scale_inv: &'a DeviceScalar,
}

impl<'a> Operand<'a> {
    /// The operand an [`Fp8Tensor`](crate::Fp8Tensor) is: its bytes, its format and its
    /// `scale_inv` (so that they cannot disagree). The tensor's bytes must be `[rows, K]`
    /// row-major, as the GEMM reads them.
    pub fn from_tensor(t: &'a crate::Fp8Tensor) -> Operand<'a> {
        Operand {
            data: t.data(),
            format: t.format(),
            scale_inv: t.scale_inv(),
        }
    }
}

impl<'a> From<&'a crate::Fp8Tensor> for Operand<'a> {
    fn from(t: &'a crate::Fp8Tensor) -> Operand<'a> {
        Operand::from_tensor(t)
    }
}

/// A validated problem, as the kernel paths receive it.
pub(crate) struct GemmProblem<'a> {
    /// Rows of A and D (grouped: `m_max`, rows per group).
    pub m: usize,
    /// Rows of B, columns of D.
    pub n: usize,
    /// The reduction length.
    pub k: usize,
    /// Groups (1 for a plain GEMM).
    pub groups: usize,
    /// Per-group real row counts, int32 on the device (grouped GEMM only).
    pub counts: Option<&'a DeviceBuffer<i32>>,
    /// A: `[m, k]` (grouped `[groups, m, k]`).
    pub a: Operand<'a>,
    /// B: `[n, k]` (grouped `[groups, n, k]`).
    pub b: Operand<'a>,
    /// D: `[m, n]` (grouped `[groups, m, n]`).
    pub d: GemmOut<'a>,
    /// Added to every row of D.
    pub bias: Option<Bias<'a>>,
    /// Add the product to D's current contents instead of overwriting.
    pub accumulate: bool,
    /// Fast accumulation allowed ([`GemmOptions::fast_accumulation`]).
    pub fast: bool,
    /// Split-K scratch ([`GemmOptions::workspace`]; plain GEMMs only).
    pub workspace: Option<&'a DeviceBuffer<u8>>,
    /// The SM cap ([`GemmOptions::max_sms`]).
    pub max_sms: Option<usize>,
    /// Keep each element's sum over all of K in one CTA ([`GemmOptions::whole_k`]).
    pub whole_k: bool,
}

impl GemmOut<'_> {
    /// The element count.
    pub fn len(&self) -> usize {
        match self {
            GemmOut::Bf16(b) => b.len(),
            GemmOut::F32(b) => b.len(),
        }
    }
    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device address.
    pub fn device_ptr(&self) -> u64 {
        match self {
            GemmOut::Bf16(b) => b.as_raw(),
            GemmOut::F32(b) => b.as_raw(),
        }
    }
    /// Lower-case name used in kernel symbols: `bf16` or `f32`.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            GemmOut::Bf16(_) => "bf16",
            GemmOut::F32(_) => "f32",
        }
    }
    /// Bytes per element: 2 or 4.
    pub(crate) fn elem_size(&self) -> usize {
        match self {
            GemmOut::Bf16(_) => 2,
            GemmOut::F32(_) => 4,
        }
    }
}

impl Bias<'_> {
    /// The element count.
    pub fn len(&self) -> usize {
        match self {
            Bias::Bf16(b) => b.len(),
            Bias::F32(b) => b.len(),
        }
    }
    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device address.
    pub fn device_ptr(&self) -> u64 {
        match self {
            Bias::Bf16(b) => b.as_raw(),
            Bias::F32(b) => b.as_raw(),
        }
    }
    /// Bytes per element.
    pub fn elem_size(&self) -> usize {
        match self {
            Bias::Bf16(_) => 2,
            Bias::F32(_) => 4,
        }
    }
}

/// Which kernel computes a GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GemmPath {
    /// The Hopper kernel where the device (sm_90) and the problem allow it, else the
    /// portable one.
    #[default]
    Auto,
    /// The sm_90a `wgmma` kernel only; an error where it is unavailable or does not take
    /// the problem.
    Hopper,
    /// The `mma.sync` kernel (sm_80 and newer), for any problem within the module's rules.
    Portable,
}

/// The optional parts of a GEMM: bias, accumulation, kernel path. `GemmOptions::default()`
/// is no bias, overwrite D, [`GemmPath::Auto`]; the builder methods set one field each.
#[derive(Debug, Clone, Copy, Default)]
pub struct GemmOptions<'a> {
    /// `N` elements added to every row of D (16-byte aligned).
    pub bias: Option<Bias<'a>>,
    /// Add the product (and bias) to D's current contents instead of overwriting D.
    pub accumulate: bool,
    /// Which kernel runs.
    pub path: GemmPath,
    /// Packed GEMMs ([`grouped_gemm_packed`]) only: the rows the offsets are expected to put
    /// in use (`offsets[groups]`), which the device reads only when the kernel runs. The
    /// sm_90a kernel picks its tile width for this many rows instead of the whole capacity
    /// (a dropless MoE layer's capacity allows for every expert's worst padding, twice the
    /// rows in use at small token counts), and at most one 128-row tile a group on average
    /// it lets the weights leave L2 first (each weight tile is then read about once). It never
    /// changes the result, only the speed.
    pub expected_rows: Option<usize>,
    /// Allow fast accumulation (TransformerEngine's forward-GEMM default, cuBLASLt's
    /// `FAST_ACCUM`): on the sm_90a path, for E4M3 x E4M3 with a bf16 D, the tensor cores
    /// accumulate over all of K in their own accumulator instead of handing each 128-deep
    /// block's products to an f32 sum: faster, and the sum keeps fewer bits (docs/perf-notes.md
    /// has the figures). Elsewhere the GEMM is computed as without it. Default `false`.
    pub fast_accumulation: bool,
    /// Plain GEMMs ([`gemm`]) only: scratch memory (16-byte aligned) the sm_90a path may
    /// split K over when the output's 128 x 128 tiles fill at most a quarter of the SMs and
    /// the skinny kernel (see the module docs: at most 128 rows, no workspace needed) does
    /// not take the problem (fewer than 4 splits cost more than they gain). The splits write
    /// f32 partial products into it and one more kernel adds them in split order into D
    /// (with the bias, and D when accumulating):
    /// deterministic, and within the f32 rounding of the unsplit sum. A workspace of
    /// [`split_k_workspace_bytes`] bytes allows every split the path may choose; a smaller
    /// one limits the splits to what fits, none at all computes the GEMM unsplit. It must
    /// not be used by other work between the GEMM's launch and its completion.
    pub workspace: Option<&'a DeviceBuffer<u8>>,
    /// The most SMs the sm_90a kernels' persistent grid occupies (cuBLASLt's
    /// `SM_COUNT_TARGET`; at least 1, capped at the device's count; `None`: every SM). For
    /// work that runs beside the GEMM on another stream, such as a weight gradient beside a
    /// data gradient: a persistent GEMM sized for every SM holds them all (one CTA an SM)
    /// until its last tile, so concurrent kernels wait for it. The tile width and split-K
    /// choices are made for this many SMs. The result does not change, only the speed. The
    /// portable kernels, which launch one CTA a tile, ignore it.
    pub max_sms: Option<usize>,
    /// Plain GEMMs ([`gemm`]) only: never split K (neither over the skinny kernel's cluster
    /// nor over a [`workspace`](Self::workspace)), so each element is summed over all of K
    /// by one CTA in k order, exactly as the grouped kernels sum it: a dense GEMM over one
    /// group's rows then gives the grouped GEMM's bits (a MoE layer's per-expert reference
    /// path uses this to match its grouped path bit for bit). Default `false`.
    pub whole_k: bool,
}

/// The most K splits a plain GEMM takes on the sm_90a path ([`GemmOptions::workspace`]).
pub const MAX_SPLIT_K: usize = 8;

/// Bytes of a workspace that lets `gemm` split K as far as it may for `shape`
/// ([`GemmOptions::workspace`]): [`MAX_SPLIT_K`] f32 copies of D.
pub fn split_k_workspace_bytes(shape: GemmShape) -> usize {
    MAX_SPLIT_K
        .saturating_mul(shape.m)
        .saturating_mul(shape.n)
        .saturating_mul(4)
}

impl<'a> GemmOptions<'a> {
    /// No bias, overwrite D, [`GemmPath::Auto`].
    pub fn new() -> GemmOptions<'a> {
        GemmOptions::default()
    }
    /// With a bias.
    pub fn bias(mut self, bias: impl Into<Bias<'a>>) -> GemmOptions<'a> {
        self.bias = Some(bias.into());
        self
    }
    /// Accumulating into D (or not).
    pub fn accumulate(mut self, accumulate: bool) -> GemmOptions<'a> {
        self.accumulate = accumulate;
        self
    }
    /// On a given path.
    pub fn path(mut self, path: GemmPath) -> GemmOptions<'a> {
        self.path = path;
        self
    }
    /// With the rows a packed GEMM's offsets are expected to put in use (a tuning hint; see
    /// [`GemmOptions::expected_rows`]).
    pub fn expected_rows(mut self, rows: usize) -> GemmOptions<'a> {
        self.expected_rows = Some(rows);
        self
    }
    /// With fast accumulation allowed (or not; see [`GemmOptions::fast_accumulation`]).
    pub fn fast_accumulation(mut self, on: bool) -> GemmOptions<'a> {
        self.fast_accumulation = on;
        self
    }
    /// With a split-K workspace (see [`GemmOptions::workspace`]).
    pub fn workspace(mut self, workspace: &'a DeviceBuffer<u8>) -> GemmOptions<'a> {
        self.workspace = Some(workspace);
        self
    }
    /// On at most `sms` SMs (see [`GemmOptions::max_sms`]).
    pub fn max_sms(mut self, sms: usize) -> GemmOptions<'a> {
        self.max_sms = Some(sms);
        self
    }
    /// With K never split (see [`GemmOptions::whole_k`]).
    pub fn whole_k(mut self, on: bool) -> GemmOptions<'a> {
        self.whole_k = on;
        self
    }
}

/// [`GemmOptions::max_sms`] of 0 is refused.
pub(crate) fn check_max_sms(what: &str, max_sms: Option<usize>) -> Result<()> {
    if max_sms == Some(0) {
        return Err(invalid(what, "max_sms = 0 (at least one SM)".into()));
    }
    Ok(())
}

/// A block-scaled FP8 operand: K-major data and one f32 `scale_inv` per block, as
/// [`quantize_blockwise`](crate::quantize_blockwise) writes them.
#[derive(Debug, Clone, Copy)]
pub struct BlockOperand<'a> {
    /// `[rows, K]` row-major bytes.
    pub data: &'a DeviceBuffer<u8>,
    /// E4M3 or E5M2.
    pub format: Fp8Format,
    /// A: 1x128 blocks, `[M, ceil(K/128)]` row-major
    /// ([`BlockShape::Row1x128`](crate::BlockShape::Row1x128)); B: 128x128 blocks,
    /// `[ceil(N/128), ceil(K/128)]` row-major
    /// ([`BlockShape::Tile128x128`](crate::BlockShape::Tile128x128)).
    pub scales_inv: &'a DeviceBuffer<f32>,
}

/// The plain numbers validation looks at (lengths, addresses), so the rules are testable
/// without a device.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Desc {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub groups: usize,
    pub a: (usize, u64),
    pub b: (usize, u64),
    pub d: (usize, u64),
    pub bias: Option<(usize, u64)>,
    pub counts: Option<(usize, u64)>,
}

fn invalid(what: &str, msg: String) -> Error {
    Error::InvalidArgument(format!("{what}: {msg}"))
}

fn mul(what: &str, xs: &[usize]) -> Result<usize> {
    // A zero factor makes the product 0 however large the others are.
    if xs.contains(&0) {
        return Ok(0);
    }
    xs.iter()
        .try_fold(1usize, |p, &x| p.checked_mul(x))
        .ok_or_else(|| invalid(what, format!("size {xs:?} overflows usize")))
}

fn check_len(what: &str, name: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(invalid(
            what,
            format!("{name} has {got} elements, the shape needs {want}"),
        ))
    }
}

fn check_addr(what: &str, name: &str, addr: u64, align: u64) -> Result<()> {
    if addr % align == 0 {
        Ok(())
    } else {
        Err(invalid(
            what,
            format!("{name} at {addr:#x} is not {align}-byte aligned"),
        ))
    }
}

/// Every rule of the module documentation.
pub(crate) fn validate(what: &str, p: &Desc) -> Result<()> {
    if p.m == 0 || p.n == 0 || p.k == 0 {
        return Err(invalid(
            what,
            format!("M, N, K must be >= 1 (got {} x {} x {})", p.m, p.n, p.k),
        ));
    }
    if p.k % K_ALIGN != 0 {
        return Err(invalid(
            what,
            format!("K = {} is not a multiple of {K_ALIGN}", p.k),
        ));
    }
    if p.groups == 0 || p.groups > MAX_GRID_YZ {
        return Err(invalid(
            what,
            format!("groups = {} outside 1..={MAX_GRID_YZ}", p.groups),
        ));
    }
    if p.n.div_ceil(128) > MAX_GRID_YZ || p.m.div_ceil(64) > MAX_GRID_X {
        return Err(invalid(
            what,
            format!("{} x {} is above the grid limits", p.m, p.n),
        ));
    }
    check_len(what, "A", p.a.0, mul(what, &[p.groups, p.m, p.k])?)?;
    check_len(what, "B", p.b.0, mul(what, &[p.groups, p.n, p.k])?)?;
    check_len(what, "D", p.d.0, mul(what, &[p.groups, p.m, p.n])?)?;
    check_addr(what, "A", p.a.1, ALIGN)?;
    check_addr(what, "B", p.b.1, ALIGN)?;
    check_addr(what, "D", p.d.1, ALIGN)?;
    if let Some((len, addr)) = p.bias {
        check_len(what, "bias", len, p.n)?;
        check_addr(what, "bias", addr, ALIGN)?;
    }
    if let Some((len, addr)) = p.counts {
        check_len(what, "counts", len, p.groups)?;
        check_addr(what, "counts", addr, 4)?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)] // the plain numbers of every argument
fn desc(
    m: usize,
    n: usize,
    k: usize,
    groups: usize,
    a: &DeviceBuffer<u8>,
    b: &DeviceBuffer<u8>,
    d: &GemmOut<'_>,
    bias: Option<&Bias<'_>>,
    counts: Option<&DeviceBuffer<i32>>,
) -> Desc {
    Desc {
        m,
        n,
        k,
        groups,
        a: (a.len(), a.as_raw()),
        b: (b.len(), b.as_raw()),
        d: (d.len(), d.device_ptr()),
        bias: bias.map(|x| (x.len(), x.device_ptr())),
        counts: counts.map(|c| (c.len(), c.as_raw())),
    }
}

/// Whether [`GemmPath::Hopper`] runs on the device of `ctx` (compute capability 9.0, for
/// which the kernels hold sm_90a code). A caller that knows its packed offsets are aligned
/// (multiples of [`ALIGN_ROWS`]) can pick the sm_90a packed kernels with it, which
/// [`GemmPath::Auto`] does not do for the packed layout.
pub fn hopper_available(ctx: &std::sync::Arc<cuda_graph::Context>) -> Result<bool> {
    hopper::available(ctx)
}

/// Tries the Hopper path: `Ok(true)` when it enqueued the GEMM, `Ok(false)` when it does not
/// take this device or problem (nothing enqueued).
fn try_hopper(stream: &Stream, p: &GemmProblem<'_>) -> Result<bool> {
    if !hopper::available(stream.context())? {
        return Ok(false);
    }
    match hopper::launch(stream, p) {
        Ok(()) => Ok(true),
        // Not its shape or alignment; it validates before enqueueing anything.
        Err(Error::InvalidArgument(_)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Runs a validated problem on the path asked for.
fn dispatch(stream: &Stream, p: &GemmProblem<'_>, path: GemmPath) -> Result<()> {
    match path {
        GemmPath::Portable => portable::launch(stream, p),
        GemmPath::Auto => {
            if try_hopper(stream, p)? {
                Ok(())
            } else {
                portable::launch(stream, p)
            }
        }
        GemmPath::Hopper => {
            if try_hopper(stream, p)? {
                Ok(())
            } else {
                Err(Error::InvalidArgument(format!(
                    "GemmPath::Hopper: the Hopper kernel is unavailable here or does not take \
                     {} x {} x {} ({} group(s))",
                    p.m, p.n, p.k, p.groups
                )))
            }
        }
    }
}

/// `D[M,N] = a.scale_inv * b.scale_inv * A[M,K] . B[N,K]^T (+ bias) (+ D)`.
///
/// A (`a.data`) is `[m, k]` row-major, B (`b.data`) `[n, k]` row-major (both K-major; see the
/// [module documentation](self) for the layouts of a linear layer's three GEMMs), D `[m, n]`
/// row-major in bf16 or f32. The scales are read on the device when the kernel runs. With
/// `opts.accumulate` the result is added to D's current contents (read in D's type).
/// Validation follows the module's rules; nothing is enqueued on an error. Enqueues one
/// kernel, never synchronises or allocates (capturable).
pub fn gemm<'a>(
    stream: &Stream,
    shape: GemmShape,
    a: Operand<'a>,
    b: Operand<'a>,
    d: impl Into<GemmOut<'a>>,
    opts: GemmOptions<'a>,
) -> Result<()> {
    let GemmShape { m, n, k } = shape;
    let p = dense_problem("gemm", m, n, k, a, b, d.into(), &opts)?;
    if let Some(ws) = opts.workspace {
        check_workspace("gemm", ws, &p)?;
    }
    dispatch(stream, &p, opts.path)
}

/// A split-K workspace must be 16-byte aligned and share no byte with A, B, D or the bias
/// (the splits write it while the kernel reads them).
fn check_workspace(what: &str, ws: &DeviceBuffer<u8>, p: &GemmProblem<'_>) -> Result<()> {
    let span = |ptr: u64, bytes: usize| (ptr, ptr.saturating_add(bytes as u64));
    let w = span(ws.as_raw(), ws.len());
    if w.0 % 16 != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what}: the workspace at {:#x} is not 16-byte aligned",
            w.0
        )));
    }
    let scalar = |s: &DeviceScalar| span(s.device_ptr(), size_of::<f32>());
    let mut others = vec![
        ("A", span(p.a.data.as_raw(), p.a.data.len())),
        ("B", span(p.b.data.as_raw(), p.b.data.len())),
        ("D", span(p.d.device_ptr(), p.d.len() * p.d.elem_size())),
        ("A's scale_inv", scalar(p.a.scale_inv)),
        ("B's scale_inv", scalar(p.b.scale_inv)),
    ];
    if let Some(b) = &p.bias {
        others.push(("the bias", span(b.device_ptr(), b.len() * b.elem_size())));
    }
    for (name, o) in others {
        if w.0 < o.1 && o.0 < w.1 {
            return Err(Error::InvalidArgument(format!(
                "{what}: the workspace overlaps {name}"
            )));
        }
    }
    Ok(())
}

/// Validates a plain (one-group) GEMM and builds its problem.
#[allow(clippy::too_many_arguments)] // mirrors gemm
fn dense_problem<'a>(
    what: &str,
    m: usize,
    n: usize,
    k: usize,
    a: Operand<'a>,
    b: Operand<'a>,
    d: GemmOut<'a>,
    opts: &GemmOptions<'a>,
) -> Result<GemmProblem<'a>> {
    validate(
        what,
        &desc(m, n, k, 1, a.data, b.data, &d, opts.bias.as_ref(), None),
    )?;
    check_max_sms(what, opts.max_sms)?;
    Ok(GemmProblem {
        m,
        n,
        k,
        groups: 1,
        counts: None,
        a,
        b,
        d,
        bias: opts.bias,
        accumulate: opts.accumulate,
        fast: opts.fast_accumulation,
        workspace: opts.workspace,
        max_sms: opts.max_sms,
        whole_k: opts.whole_k,
    })
}

/// Grouped GEMM for MoE experts (the "masked" layout): for every group `g < groups`,
/// `D[g][r,:] = a.scale_inv * b.scale_inv * A[g][r,:] . B[g]^T (+ bias) (+ D[g][r,:])` for the
/// real rows `r < counts[g]` only.
///
/// A is `[groups, m_max, k]`, B `[groups, n, k]` (one weight matrix per group), D
/// `[groups, m_max, n]`, all row-major; `counts` holds `groups` int32 row counts on the
/// device, read by the kernel when it runs (clamped to `[0, m_max]`). Rows at or beyond a
/// group's count are neither read nor written. One launch, no host synchronisation: a
/// captured graph stays correct when the counts change between replays. Validation follows
/// the module's rules (and `counts.len() == groups`); nothing is enqueued on an error.
pub fn grouped_gemm<'a>(
    stream: &Stream,
    shape: GroupedShape,
    a: Operand<'a>,
    b: Operand<'a>,
    d: impl Into<GemmOut<'a>>,
    counts: &'a DeviceBuffer<i32>,
    opts: GemmOptions<'a>,
) -> Result<()> {
    let GroupedShape {
        groups,
        m_max,
        n,
        k,
    } = shape;
    let d = d.into();
    let what = "grouped_gemm";
    validate(
        what,
        &desc(
            m_max,
            n,
            k,
            groups,
            a.data,
            b.data,
            &d,
            opts.bias.as_ref(),
            Some(counts),
        ),
    )?;
    check_max_sms(what, opts.max_sms)?;
    let p = GemmProblem {
        m: m_max,
        n,
        k,
        groups,
        counts: Some(counts),
        a,
        b,
        d,
        bias: opts.bias,
        accumulate: opts.accumulate,
        fast: opts.fast_accumulation,
        workspace: None,
        max_sms: opts.max_sms,
        whole_k: false,
    };
    dispatch(stream, &p, opts.path)
}

/// Block-scaled GEMM (DeepSeek-V3 style):
/// `D[m,n] = sum over kb of (A[m, kb-block] . B[n, kb-block]) * sa[m, kb] * sb[n / 128, kb]
/// (+ bias) (+ D)`, each k-block (128 wide, the last one partial) summed in fp32, scaled, and
/// added into an fp32 accumulator.
///
/// A is `[m, k]` with 1x128 scales `sa = a.scales_inv`, `[m, ceil(k/128)]`; B is `[n, k]` with
/// 128x128 scales `sb = b.scales_inv`, `[ceil(n/128), ceil(k/128)]` — what
/// [`quantize_blockwise`](crate::quantize_blockwise) writes with
/// [`BlockShape::Row1x128`](crate::BlockShape::Row1x128) and
/// [`BlockShape::Tile128x128`](crate::BlockShape::Tile128x128). `opts.path`: `Auto` takes the
/// sm_90a kernel (TMA + wgmma, the scales applied as each k-block is added to the f32 sum)
/// for E4M3 x E4M3 on a compute capability 9.0 device when the shape allows it (K a multiple
/// of 16, N even, A and B 16-byte aligned), the portable `mma.sync` kernel otherwise;
/// `Hopper` asks for the former (an error where it can not run), `Portable` for the latter.
/// Validation follows the module's rules plus the two scale lengths; nothing is enqueued on
/// an error.
pub fn gemm_blockwise<'a>(
    stream: &Stream,
    shape: GemmShape,
    a: BlockOperand<'a>,
    b: BlockOperand<'a>,
    d: impl Into<GemmOut<'a>>,
    opts: GemmOptions<'a>,
) -> Result<()> {
    let GemmShape { m, n, k } = shape;
    let d = d.into();
    let what = "gemm_blockwise";
    validate(
        what,
        &desc(m, n, k, 1, a.data, b.data, &d, opts.bias.as_ref(), None),
    )?;
    check_max_sms(what, opts.max_sms)?;
    let kb = k.div_ceil(128);
    check_len(what, "A scales", a.scales_inv.len(), mul(what, &[m, kb])?)?;
    check_len(
        what,
        "B scales",
        b.scales_inv.len(),
        mul(what, &[n.div_ceil(128), kb])?,
    )?;
    let hopper = |stream: &Stream| -> Result<bool> {
        if !hopper::available(stream.context())? {
            return Ok(false);
        }
        let shape = (m, n, k);
        match hopper::launch_blockwise(stream, shape, (&a, &b), &d, &opts) {
            Ok(()) => Ok(true),
            // Not its formats, shape or alignment; it checks before enqueueing anything.
            Err(Error::InvalidArgument(_)) => Ok(false),
            Err(e) => Err(e),
        }
    };
    match opts.path {
        GemmPath::Portable => portable::launch_blockwise(stream, m, n, k, &a, &b, &d, &opts),
        GemmPath::Auto => {
            if hopper(stream)? {
                Ok(())
            } else {
                portable::launch_blockwise(stream, m, n, k, &a, &b, &d, &opts)
            }
        }
        GemmPath::Hopper => {
            if hopper(stream)? {
                Ok(())
            } else {
                Err(Error::InvalidArgument(format!(
                    "gemm_blockwise with GemmPath::Hopper: the sm_90a block-scaled kernel is \
                     unavailable here or does not take {m} x {n} x {k} ({} x {})",
                    a.format.name(),
                    b.format.name()
                )))
            }
        }
    }
}

/// Slow test oracle: the same result as [`gemm`] from a simple kernel, one thread per output
/// element, FP8 decoded exactly and multiplied and summed in f32 in k order, then the same
/// epilogue. For checking the fast paths on shapes too large for the CPU reference; not for
/// production use. Same arguments and rules as [`gemm`] (`opts.path` is ignored).
pub fn gemm_reference<'a>(
    stream: &Stream,
    shape: GemmShape,
    a: Operand<'a>,
    b: Operand<'a>,
    d: impl Into<GemmOut<'a>>,
    opts: GemmOptions<'a>,
) -> Result<()> {
    let GemmShape { m, n, k } = shape;
    let p = dense_problem("gemm_reference", m, n, k, a, b, d.into(), &opts)?;
    portable::launch_reference(stream, &p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok_desc(m: usize, n: usize, k: usize, groups: usize) -> Desc {
        Desc {
            m,
            n,
            k,
            groups,
            a: (groups * m * k, 0x1000),
            b: (groups * n * k, 0x2000),
            d: (groups * m * n, 0x3000),
            bias: Some((n, 0x4000)),
            counts: (groups > 1).then_some((groups, 0x5000)),
        }
    }

    #[test]
    fn max_sms_of_zero_is_refused() {
        let err = check_max_sms("gemm", Some(0)).unwrap_err().to_string();
        assert!(err.contains("gemm") && err.contains("max_sms = 0"), "{err}");
        assert!(check_max_sms("gemm", Some(1)).is_ok());
        assert!(check_max_sms("gemm", Some(usize::MAX)).is_ok());
        assert!(check_max_sms("gemm", None).is_ok());
        assert_eq!(GemmOptions::new().max_sms(7).max_sms, Some(7));
    }

    #[test]
    fn valid_problems_pass() {
        for (m, n, k, g) in [
            (1, 8, 16, 1),
            (77, 40, 48, 1),
            (130, 136, 272, 1),
            (4096, 16, 256, 1),
            (512, 4096, 2048, 8),
            (1, 1, 16, 65535),
        ] {
            let d = ok_desc(m, n, k, g);
            assert!(
                validate("t", &d).is_ok(),
                "{m}x{n}x{k} g{g}: {:?}",
                validate("t", &d)
            );
        }
    }

    #[test]
    fn bad_problems_are_rejected() {
        let base = ok_desc(64, 32, 32, 2);
        let cases: Vec<(&str, Desc)> = vec![
            ("m = 0", Desc { m: 0, ..base }),
            ("n = 0", Desc { n: 0, ..base }),
            ("k = 0", Desc { k: 0, ..base }),
            (
                "k % 16",
                Desc {
                    k: 40,
                    ..ok_desc(64, 32, 40, 2)
                },
            ),
            (
                "groups = 0",
                Desc {
                    groups: 0,
                    a: (0, 0x1000),
                    b: (0, 0x2000),
                    d: (0, 0x3000),
                    ..base
                },
            ),
            (
                "A short",
                Desc {
                    a: (base.a.0 - 1, 0x1000),
                    ..base
                },
            ),
            (
                "A long",
                Desc {
                    a: (base.a.0 + 16, 0x1000),
                    ..base
                },
            ),
            (
                "B short",
                Desc {
                    b: (base.b.0 - 16, 0x2000),
                    ..base
                },
            ),
            (
                "D short",
                Desc {
                    d: (base.d.0 - 1, 0x3000),
                    ..base
                },
            ),
            (
                "A misaligned",
                Desc {
                    a: (base.a.0, 0x1008),
                    ..base
                },
            ),
            (
                "B misaligned",
                Desc {
                    b: (base.b.0, 0x2001),
                    ..base
                },
            ),
            (
                "D misaligned",
                Desc {
                    d: (base.d.0, 0x3004),
                    ..base
                },
            ),
            (
                "bias length",
                Desc {
                    bias: Some((31, 0x4000)),
                    ..base
                },
            ),
            (
                "bias misaligned",
                Desc {
                    bias: Some((32, 0x4002)),
                    ..base
                },
            ),
            (
                "counts length",
                Desc {
                    counts: Some((3, 0x5000)),
                    ..base
                },
            ),
            (
                "counts misaligned",
                Desc {
                    counts: Some((2, 0x5002)),
                    ..base
                },
            ),
            (
                "overflow",
                Desc {
                    m: usize::MAX / 2,
                    k: 32,
                    ..base
                },
            ),
            (
                "n tiles",
                Desc {
                    n: 65536 * 128,
                    ..base
                },
            ),
            (
                "too many groups",
                Desc {
                    groups: 65536,
                    ..base
                },
            ),
        ];
        for (name, d) in cases {
            let e = validate("t", &d);
            assert!(
                matches!(e, Err(Error::InvalidArgument(_))),
                "{name}: {d:?} gave {e:?}"
            );
        }
    }

    #[test]
    fn options_builder() {
        let o = GemmOptions::new().accumulate(true).path(GemmPath::Portable);
        assert!(o.accumulate && o.bias.is_none() && o.path == GemmPath::Portable);
        assert_eq!(GemmOptions::default().path, GemmPath::Auto);
    }
}

/// Generated inputs for the validation: never a panic, accepted exactly where the module's
/// rules (restated independently below) accept, and every error names a quantity that
/// breaks a rule, with its value.
#[cfg(test)]
mod prop {
    use proptest::prelude::*;
    use proptest::sample::select;

    use super::*;
    use crate::prop_util::{addr, config, fits, len, make_len};

    /// Every rule `d` breaks, each as the fragments an error for it must contain (the
    /// quantity's name and value).
    fn broken(d: &Desc) -> Vec<Vec<String>> {
        let mut v = Vec::new();
        let (m, n, k, g) = (d.m, d.n, d.k, d.groups);
        if m == 0 || n == 0 || k == 0 {
            v.push(vec!["M, N, K".into(), format!("{m} x {n} x {k}")]);
        }
        if k % 16 != 0 {
            v.push(vec![format!("K = {k}"), "multiple of 16".into()]);
        }
        if g == 0 || g > 65535 {
            v.push(vec![format!("groups = {g}")]);
        }
        // Grid limits: N tiles of 128 in gridDim.y, M tiles of 64 in gridDim.x.
        if n.div_ceil(128) > 65535 || m.div_ceil(64) > (1 << 31) - 1 {
            v.push(vec![format!("{m} x {n}"), "grid limits".into()]);
        }
        for (name, (len, addr), dims) in [
            ("A", d.a, [g, m, k]),
            ("B", d.b, [g, n, k]),
            ("D", d.d, [g, m, n]),
        ] {
            match fits(&dims) {
                None => v.push(vec![format!("{dims:?}"), "overflows".into()]),
                Some(want) if len != want => {
                    v.push(vec![
                        format!("{name} has {len} elements"),
                        format!("{want}"),
                    ]);
                }
                Some(_) => {}
            }
            if addr % 16 != 0 {
                v.push(vec![format!("{name} at {addr:#x}"), "16-byte".into()]);
            }
        }
        if let Some((len, addr)) = d.bias {
            if len != n {
                v.push(vec![format!("bias has {len} elements"), format!("{n}")]);
            }
            if addr % 16 != 0 {
                v.push(vec![format!("bias at {addr:#x}"), "16-byte".into()]);
            }
        }
        if let Some((len, addr)) = d.counts {
            if len != g {
                v.push(vec![format!("counts has {len} elements"), format!("{g}")]);
            }
            if addr % 4 != 0 {
                v.push(vec![format!("counts at {addr:#x}"), "4-byte".into()]);
            }
        }
        v
    }

    /// Small sizes mostly; zero; around the grid limits; huge.
    fn dim() -> impl Strategy<Value = usize> {
        prop_oneof![
            8 => 1usize..=300,
            3 => (1usize..=64).prop_map(|x| x * 16),
            1 => Just(0usize),
            2 => select(vec![
                65535 * 128,
                65535 * 128 + 1,
                ((1 << 31) - 1) * 64,
                ((1 << 31) - 1) * 64 + 1,
                1 << 32,
                1 << 40,
                usize::MAX / 16,
                usize::MAX / 2,
                usize::MAX,
            ]),
            1 => any::<usize>(),
        ]
    }

    /// K: a multiple of 16 mostly, else any size.
    fn k_dim() -> impl Strategy<Value = usize> {
        prop_oneof![
            6 => (1usize..=64).prop_map(|x| x * 16),
            1 => (1usize..=1 << 50).prop_map(|x| x * 16),
            3 => dim(),
        ]
    }

    fn groups() -> impl Strategy<Value = usize> {
        prop_oneof![
            8 => 1usize..=4,
            1 => Just(0usize),
            1 => select(vec![65535, 65536, usize::MAX]),
            1 => any::<usize>(),
        ]
    }

    prop_compose! {
        fn desc_strategy()(
            (m, n, k, groups) in (dim(), dim(), k_dim(), groups()),
            lens in [len(), len(), len(), len(), len()],
            addrs in [addr(), addr(), addr(), addr(), addr()],
            bias in any::<bool>(),
            counts in any::<bool>(),
        ) -> Desc {
            Desc {
                m,
                n,
                k,
                groups,
                a: (make_len(lens[0], fits(&[groups, m, k])), addrs[0]),
                b: (make_len(lens[1], fits(&[groups, n, k])), addrs[1]),
                d: (make_len(lens[2], fits(&[groups, m, n])), addrs[2]),
                bias: bias.then(|| (make_len(lens[3], Some(n)), addrs[3])),
                counts: counts.then(|| (make_len(lens[4], Some(groups)), addrs[4])),
            }
        }
    }

    proptest! {
        #![proptest_config(config(100_000))]

        #[test]
        fn validate_accepts_exactly_the_rules(d in desc_strategy()) {
            let broken = broken(&d);
            match validate("prop_gemm", &d) {
                Ok(()) => prop_assert!(broken.is_empty(), "{:?} accepted, breaks {:?}", d, broken),
                Err(Error::InvalidArgument(msg)) => {
                    prop_assert!(msg.starts_with("prop_gemm: "), "{}", msg);
                    prop_assert!(
                        broken.iter().any(|frags| frags.iter().all(|f| msg.contains(f.as_str()))),
                        "{:?}: {:?} names none of {:?}", d, msg, broken
                    );
                }
                Err(e) => prop_assert!(false, "{:?}: not InvalidArgument: {:?}", d, e),
            }
        }

        #[test]
        fn mul_is_the_checked_product(xs in proptest::collection::vec(dim(), 0..=4)) {
            let fits = fits(&xs);
            match mul("prop_mul", &xs) {
                Ok(p) => prop_assert_eq!(Some(p), fits),
                Err(e) => {
                    prop_assert_eq!(fits, None);
                    let msg = e.to_string();
                    prop_assert!(msg.contains("prop_mul") && msg.contains(&format!("{xs:?}")), "{}", msg);
                }
            }
        }
    }
}
