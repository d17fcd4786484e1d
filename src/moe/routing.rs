//! The device side of a dropless top-k MoE layer around its expert GEMMs: the router with
//! its top-k, gates and auxiliary losses, the dispatch plan into the packed expert-major
//! layout, the combine, and the backward of each. Kernels in `src/kernels/moe_routing.cu`.
//!
//! # What runs where
//! [`Router::forward`]: `logits = x . Wr^T` (bf16 x, f32 Wr and math), the scores (softmax or
//! sigmoid, [`ScoreFn`]), the top-k experts per token (ties to the lower expert), the gates,
//! then the plan: per-expert counts, `offsets` (`E + 1` entries, each expert's first row,
//! every one a multiple of `align`), `row_of[t * k + j]` (the packed row of token `t`'s `j`-th
//! expert) and `token_of_row[r]` (the inverse; -1 for padding rows), token order kept within
//! each expert; then the load-balancing and z losses. The experts' activations are moved into
//! the packed layout by [`fp8_kernels::gather_cast_transpose`] with `token_of_row`.
//! [`Router::combine`] weighs each token's `k` expert rows by the gates. The backward:
//! [`Router::combine_backward`] (the gates' gradient, then the logits' through the scores,
//! top-k, renormalisation, aux and z losses), [`Router::input_backward`] (the input gradient:
//! the experts' rows summed back to tokens plus the router's part) and
//! [`Router::weight_backward`] (the router weight's gradient).
//!
//! Nothing here reads the routing back to the host or synchronises: all of it can be
//! captured once and replayed as the routing changes. Every floating-point sum has a fixed
//! order, so results are bit-identical run to run and between eager and graph replays.
//!
//! # The packed layout
//! `capacity = round_up(T * k + E * (align - 1), align)` rows, a static bound of the rows the
//! plan can use (`offsets[E] <= T * k + E * (align - 1)`): no capacity factor, no dropped
//! token. `align` is the expert GEMM's row tile ([`ALIGN_ROWS`]), so no GEMM tile straddles
//! two experts.

use std::sync::Arc;

use cuda_graph::half::bf16;
use cuda_graph::{DeviceBuffer, Error, Kernel, KernelArgs, LaunchConfig, Module, Result, Stream};

/// The kernels, built from `src/kernels/moe_routing.cu`.
pub(crate) static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/moe_routing.fatbin"));

/// Threads per block of every kernel but the plan scan (`MOE_BLOCK`).
const BLOCK: u32 = 256;
/// Warps per block (`MOE_WARPS`).
const WARPS: u32 = BLOCK / 32;
/// Threads of the plan scan's single block (`MOE_SCAN_BLOCK`).
const SCAN_BLOCK: u32 = 1024;
/// The most assignments (`T * k`) of the single-block plan (`MOE_SMALL_PASSES` passes of
/// `SCAN_BLOCK`): one launch instead of three, where the three cost more in latency than the
/// work (T = 256, top-2: 9.6 us).
const SMALL_PLAN_ASSIGNMENTS: usize = 4 * SCAN_BLOCK as usize;
/// The most experts of the single-block plan (`MOE_SMALL_EXPERTS`).
const SMALL_PLAN_EXPERTS: usize = 256;
/// The most tokens per chunk of the router weight gradient's first step.
const WGRAD_CHUNK: usize = 128;
/// The fewest tokens per chunk of the router weight gradient.
const WGRAD_MIN_CHUNK: usize = 16;
/// The chunk count the router weight gradient aims at below 128-token chunks: at small T,
/// 128-token chunks leave most SMs idle while each block walks its tokens one after another
/// (T = 256: 16 blocks, 7.5 us).
const WGRAD_CHUNKS_AIM: usize = 16;
/// The most tokens per block of the router forward and the input gradient, which read all of
/// `Wr` in every block and use each piece for all the block's tokens (`MOE_TOKENS`).
const MAX_WR_TOKENS: usize = 8;
/// From this many experts on, the router's logits come from `moe_router_logits`, a tiled
/// GEMM (64 tokens x 64 experts per block, every Wr piece used for 64 tokens), before
/// `moe_router_forward` finishes the tokens from them: its own dot products read all of Wr
/// once per 8 tokens, which at E = 256, H = 2048, T = 4096 took 0.40 ms on an H200 (0.15 ms
/// tiled, plus 0.03 to finish). The router weight gradient (`moe_router_wgrad_tiled`, 0.13 ms
/// against 0.25) goes through the same tile loop; the input gradient does not (a tiled
/// version measured slower: docs/perf-notes.md, 2026-12-02).
const TILED_ROUTER_EXPERTS: usize = 32;
/// Tokens per chunk of `moe_router_wgrad_tiled` (the router weight gradient from
/// [`TILED_ROUTER_EXPERTS`] experts on): ceil(T / 1024) partial sums, added in order.
const WGRAD_TILED_TOKENS: usize = 1024;
const _: () = assert!(
    WGRAD_TILED_TOKENS >= WGRAD_CHUNK,
    "the partials fit the buffer"
);
/// Rows and columns of a `moe_router_logits` / `moe_router_wgrad_tiled` block's tile (`RL_T`).
const ROUTER_TILE: u32 = 64;
/// Threads per block of the tiled router kernels (`RL_THREADS`).
const ROUTER_TILE_THREADS: u32 = 128;

/// The launch of a tiled router kernel over `grid` tiles (static shared memory).
fn tiled_launch(grid: (u32, u32, u32)) -> LaunchConfig {
    LaunchConfig {
        grid,
        block: (ROUTER_TILE_THREADS, 1, 1),
        shared_mem_bytes: 0,
        attributes: Vec::new(),
    }
}
/// Tokens per block of the `Wr` kernels: one block per 128 tokens would be about one per SM;
/// more tokens per block only once that many blocks fill the GPU.
const WR_TOKENS_STEP: usize = 128;
/// The most (token, expert) rows per block of the combine and its backward (`MOE_SLOTS`).
const ROW_SLOTS: usize = 8;
/// The most tokens per block of the combine and its backward (`MOE_ROW_TOKENS`).
const MAX_ROW_TOKENS: usize = 4;
/// The combine kernels take one more token per block for every 256 tokens: at least 256
/// blocks (two per SM) before blocks grow.
const ROW_TOKENS_STEP: usize = 256;
// The combine's backward takes (3 * tokens + 1) * E floats of dynamic shared memory: within
// the 48 KiB a launch gets without opting in, beside its static arrays (768 bytes).
const _: () = assert!((3 * MAX_ROW_TOKENS + 1) * MAX_EXPERTS * 4 + 768 <= 48 * 1024);
/// Columns per block of the router weight gradient's first step (`MOE_WGRAD_COLS`).
const WGRAD_COLS: u32 = 256;
/// Experts per block of the router weight gradient's first step (`MOE_WGRAD_EXPERTS`).
const WGRAD_EXPERTS: u32 = 8;

/// The most experts a router may have (the kernels keep per-expert values in shared memory).
pub const MAX_EXPERTS: usize = 512;
/// The most experts per token.
pub const MAX_TOP_K: usize = fp8_kernels::MAX_TOP_K;
/// The packed layout's row alignment: the expert GEMMs' row tile.
pub const ALIGN_ROWS: usize = fp8_kernels::gemm::ALIGN_ROWS;

/// How the router turns logits into scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScoreFn {
    /// `softmax` over the experts; the gates are the chosen probabilities, renormalised over
    /// the `k` chosen when [`RouterConfig::renormalize`] is set.
    Softmax,
    /// `sigmoid` per expert (DeepSeek-V3); the gates are the chosen scores divided by their
    /// sum (always normalised over the `k` chosen).
    Sigmoid,
}

/// The router's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterConfig {
    /// Experts per token, `1..=`[`MAX_TOP_K`] and at most the number of experts.
    pub top_k: usize,
    /// The score function.
    pub score: ScoreFn,
    /// Renormalise the softmax gates over the chosen `k` (ignored for sigmoid, which always
    /// is).
    pub renormalize: bool,
    /// Coefficient of the load-balancing loss `E * sum_e f_e * P_e` (0 turns it off).
    pub aux_coef: f32,
    /// Coefficient of the router z-loss `mean_t logsumexp(logits_t)^2` (0 turns it off).
    pub z_coef: f32,
}

impl Default for RouterConfig {
    /// Top-2 softmax without renormalisation, aux loss 1e-2, no z-loss (Megatron's defaults
    /// for a Mixtral-style layer).
    fn default() -> RouterConfig {
        RouterConfig {
            top_k: 2,
            score: ScoreFn::Softmax,
            renormalize: false,
            aux_coef: 1e-2,
            z_coef: 0.0,
        }
    }
}

/// The router's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutingDims {
    /// Tokens (`T`).
    pub tokens: usize,
    /// Hidden size (`H`).
    pub hidden: usize,
    /// Experts (`E`), `1..=`[`MAX_EXPERTS`].
    pub experts: usize,
    /// Experts per token (`k`).
    pub top_k: usize,
    /// Row alignment of each expert's rows in the packed layout (normally
    /// [`ALIGN_ROWS`]); at least 1.
    pub align: usize,
}

impl RoutingDims {
    /// Checks the shape: every dimension at least 1, `E <= MAX_EXPERTS`, `1 <= k <=
    /// min(E, MAX_TOP_K)`, and every buffer (`[T, H]`, `[T, E]`, the capacity) within i32
    /// elements (the kernels index rows with 32-bit integers).
    pub fn check(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(format!("RoutingDims: {m}")));
        let RoutingDims {
            tokens,
            hidden,
            experts,
            top_k,
            align,
        } = *self;
        for (name, v) in [("tokens", tokens), ("hidden", hidden), ("align", align)] {
            if v == 0 {
                return bad(format!("{name} must be at least 1"));
            }
        }
        if experts == 0 || experts > MAX_EXPERTS {
            return bad(format!(
                "experts = {experts} must be within 1..={MAX_EXPERTS}"
            ));
        }
        if top_k == 0 || top_k > MAX_TOP_K.min(experts) {
            return bad(format!(
                "top_k = {top_k} must be within 1..={} (at most {MAX_TOP_K} and the {experts} experts)",
                MAX_TOP_K.min(experts)
            ));
        }
        let limit = i32::MAX as u128;
        let (t, h, e, k, a) = (
            tokens as u128,
            hidden as u128,
            experts as u128,
            top_k as u128,
            align as u128,
        );
        let capacity = (t * k + e * (a - 1)).div_ceil(a) * a;
        if t * h > limit || t * e > limit || capacity > limit || e * h > limit {
            return bad(format!("{self:?} has a buffer above 2^31 elements"));
        }
        Ok(())
    }

    /// Rows of the packed layout: `round_up(T * k + E * (align - 1), align)` (checked by
    /// [`check`](Self::check) to fit).
    pub fn capacity(&self) -> usize {
        let a = self.align.max(1);
        (self.tokens * self.top_k + self.experts * (a - 1)).div_ceil(a) * a
    }

    /// The rows of the packed layout expected in use: the `T * k` assignments plus half an
    /// alignment of padding per expert, at most the capacity. The expert GEMMs pick their tile
    /// width for it ([`GemmOptions::expected_rows`]); the capacity allows for a whole
    /// alignment per expert, which at small `T` doubles the rows.
    ///
    /// [`GemmOptions::expected_rows`]: fp8_kernels::gemm::GemmOptions::expected_rows
    pub fn expected_rows(&self) -> usize {
        (self.tokens * self.top_k + self.experts * (self.align / 2)).min(self.capacity())
    }

    /// Blocks of the plan kernels: one per 256 assignments.
    fn plan_blocks(&self) -> usize {
        (self.tokens * self.top_k).div_ceil(BLOCK as usize)
    }

    /// Tokens per block of the router forward and the input gradient (`1..=MAX_WR_TOKENS`).
    fn wr_tokens_per_block(&self) -> usize {
        self.tokens.div_ceil(WR_TOKENS_STEP).clamp(1, MAX_WR_TOKENS)
    }

    /// Blocks of the router forward: each writes one row of the losses' partial sums.
    fn router_blocks(&self) -> usize {
        self.tokens.div_ceil(self.wr_tokens_per_block())
    }

    /// Tokens per block of the combine and its backward: at most `ROW_SLOTS` rows with `k`
    /// rounded up to a power of two (the kernels' register layout), at most
    /// `MAX_ROW_TOKENS`, one per `ROW_TOKENS_STEP` tokens; at least 1.
    fn row_tokens_per_block(&self) -> usize {
        (ROW_SLOTS / self.top_k.next_power_of_two())
            .min(MAX_ROW_TOKENS)
            .min(self.tokens / ROW_TOKENS_STEP)
            .max(1)
    }

    /// Whether the dispatch plan runs as one single-block launch (`moe_plan_small`): few
    /// assignments and experts.
    fn single_block_plan(&self) -> bool {
        self.tokens * self.top_k <= SMALL_PLAN_ASSIGNMENTS && self.experts <= SMALL_PLAN_EXPERTS
    }

    /// Tokens per chunk of the router weight gradient (its partial sums' order): T / 16
    /// within 16 ..= 128.
    fn wgrad_chunk(&self) -> usize {
        self.tokens
            .div_ceil(WGRAD_CHUNKS_AIM)
            .clamp(WGRAD_MIN_CHUNK, WGRAD_CHUNK)
    }

    /// Token chunks of the router weight gradient.
    fn wgrad_chunks(&self) -> usize {
        self.tokens.div_ceil(self.wgrad_chunk())
    }
}

/// The device buffers of one routing (one microbatch): what the forward writes and the
/// backward reads, plus the backward's own intermediates, all views of one byte buffer (so a
/// layer can keep them in the graphed runtime's per-microbatch saved buffers:
/// [`RoutingBuffers::bytes`], [`RoutingBuffers::from_bytes`]). int32 / f32, row-major.
#[derive(Debug)]
pub struct RoutingBuffers {
    dims: RoutingDims,
    /// `[T, E]` router logits.
    pub logits: DeviceBuffer<f32>,
    /// `[T, E]` the per-token distribution the aux loss uses (softmax, or the sigmoid scores
    /// over their sum).
    pub probs: DeviceBuffer<f32>,
    /// `[T]` logsumexp of the logits.
    pub lse: DeviceBuffer<f32>,
    /// `[T, k]` the chosen experts, in descending score order.
    pub topk: DeviceBuffer<i32>,
    /// `[T, k]` the gates.
    pub gates: DeviceBuffer<f32>,
    /// `[E]` assignments per expert.
    pub counts: DeviceBuffer<i32>,
    /// `[E + 1]` each expert's first packed row; `offsets[E]` is the rows in use.
    pub offsets: DeviceBuffer<i32>,
    /// `[T, k]` the packed row of each assignment.
    pub row_of: DeviceBuffer<i32>,
    /// `[capacity]` the assignment `t * k + j` each packed row holds, -1 for padding.
    pub token_of_row: DeviceBuffer<i32>,
    /// `[2]` the aux loss and the z-loss (coefficients applied).
    pub losses: DeviceBuffer<f32>,
    /// `[T, k]` the gates' gradient (backward).
    pub d_gates: DeviceBuffer<f32>,
    /// `[T, E]` the logits' gradient (backward).
    pub d_logits: DeviceBuffer<f32>,
    block_counts: DeviceBuffer<i32>,
    /// `[E + 1, router blocks]`: per router-forward block, its tokens' sums of each expert's
    /// probability and of `lse^2` (the losses' first step).
    loss_partial: DeviceBuffer<f32>,
    wgrad_partial: DeviceBuffer<f32>,
}

/// Each field's start in the byte buffer is a multiple of this.
const FIELD_ALIGN: usize = 256;

/// The element counts of the fields, in layout order (all 4-byte elements).
fn field_lens(d: RoutingDims) -> [usize; 15] {
    let (t, e, k, h) = (d.tokens, d.experts, d.top_k, d.hidden);
    [
        t * e,                       // logits
        t * e,                       // probs
        t,                           // lse
        t * k,                       // topk
        t * k,                       // gates
        e,                           // counts
        e + 1,                       // offsets
        t * k,                       // row_of
        d.capacity(),                // token_of_row
        2,                           // losses
        t * k,                       // d_gates
        t * e,                       // d_logits
        d.plan_blocks() * e,         // block_counts
        (e + 1) * d.router_blocks(), // loss_partial
        d.wgrad_chunks() * e * h,    // wgrad_partial
    ]
}

impl RoutingBuffers {
    /// Bytes of one routing's buffers for `dims` (checked).
    pub fn bytes(dims: RoutingDims) -> Result<usize> {
        dims.check()?;
        Ok(field_lens(dims)
            .iter()
            .map(|n| (n * 4).next_multiple_of(FIELD_ALIGN))
            .sum())
    }

    /// The buffers as views of `bytes` (at least [`bytes`](Self::bytes)`(dims)` long,
    /// 256-byte aligned: the graphed runtime's saved buffers are). The contents are whatever
    /// `bytes` holds; [`Router::forward`] writes everything the backward reads.
    pub fn from_bytes(dims: RoutingDims, bytes: &DeviceBuffer<u8>) -> Result<RoutingBuffers> {
        let need = RoutingBuffers::bytes(dims)?;
        if bytes.len() < need {
            return Err(Error::InvalidArgument(format!(
                "RoutingBuffers: {} bytes given, {dims:?} needs {need}",
                bytes.len()
            )));
        }
        let mut at = 0;
        let mut next = |n: usize| -> Result<DeviceBuffer<u8>> {
            let v = bytes.slice(at..at + n * 4)?;
            at += (n * 4).next_multiple_of(FIELD_ALIGN);
            Ok(v)
        };
        let l = field_lens(dims);
        let f = |b: DeviceBuffer<u8>| b.reinterpret::<f32>();
        let i = |b: DeviceBuffer<u8>| b.reinterpret::<i32>();
        Ok(RoutingBuffers {
            dims,
            logits: f(next(l[0])?)?,
            probs: f(next(l[1])?)?,
            lse: f(next(l[2])?)?,
            topk: i(next(l[3])?)?,
            gates: f(next(l[4])?)?,
            counts: i(next(l[5])?)?,
            offsets: i(next(l[6])?)?,
            row_of: i(next(l[7])?)?,
            token_of_row: i(next(l[8])?)?,
            losses: f(next(l[9])?)?,
            d_gates: f(next(l[10])?)?,
            d_logits: f(next(l[11])?)?,
            block_counts: i(next(l[12])?)?,
            loss_partial: f(next(l[13])?)?,
            wgrad_partial: f(next(l[14])?)?,
        })
    }

    /// Buffers for `dims` in an allocation of their own, zeroed, ready for
    /// [`Router::forward`]. Waits for the fill (not during a capture).
    pub fn new(stream: &Stream, dims: RoutingDims) -> Result<RoutingBuffers> {
        let bytes = DeviceBuffer::<u8>::alloc(stream.context(), RoutingBuffers::bytes(dims)?)?;
        bytes.memset_bytes(stream, 0)?;
        stream.synchronize()?;
        RoutingBuffers::from_bytes(dims, &bytes)
    }

    /// The shape these buffers were made for.
    pub fn dims(&self) -> RoutingDims {
        self.dims
    }
}

/// The routing kernels of one context.
#[derive(Debug, Clone)]
struct Kernels {
    forward: Kernel,
    logits: Kernel,
    plan_count: Kernel,
    plan_scan: Kernel,
    plan_small: Kernel,
    plan_assign: Kernel,
    combine: Kernel,
    combine_backward: Kernel,
    input_backward: Kernel,
    wgrad_partial: Kernel,
    wgrad_tiled: Kernel,
    wgrad_reduce: Kernel,
    _module: Module,
}

/// The router and the dispatch/combine around the experts for one shape and
/// configuration. Cheap to clone (the kernels are shared handles).
#[derive(Debug, Clone)]
pub struct Router {
    dims: RoutingDims,
    cfg: RouterConfig,
    /// The dims as the kernels take them.
    n: Dims32,
    k: Arc<Kernels>,
}

/// A router's dims as u32 kernel arguments (checked to fit i32 by [`RoutingDims::check`]).
#[derive(Debug, Clone, Copy)]
struct Dims32 {
    t: u32,
    h: u32,
    e: u32,
    k: u32,
    align: u32,
    /// The packed layout's rows (the capacity).
    rows: u32,
    /// `T * k`.
    assignments: u32,
    /// Blocks of the plan kernels.
    blocks: u32,
    /// Tokens per chunk of the router weight gradient.
    chunk: u32,
    /// Token chunks of the router weight gradient.
    chunks: u32,
    /// Tokens per block of the router forward and the input gradient.
    wr_tokens: u32,
    /// Blocks of the router forward.
    router_blocks: u32,
    /// Tokens per block of the combine and its backward.
    row_tokens: u32,
}

impl Dims32 {
    fn of(d: RoutingDims) -> Dims32 {
        let u = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        Dims32 {
            t: u(d.tokens),
            h: u(d.hidden),
            e: u(d.experts),
            k: u(d.top_k),
            align: u(d.align),
            rows: u(d.capacity()),
            assignments: u(d.tokens * d.top_k),
            blocks: u(d.plan_blocks()),
            chunk: u(d.wgrad_chunk()),
            chunks: u(d.wgrad_chunks()),
            wr_tokens: u(d.wr_tokens_per_block()),
            router_blocks: u(d.router_blocks()),
            row_tokens: u(d.row_tokens_per_block()),
        }
    }
}

/// Checks one buffer's length.
fn check_len(what: &str, name: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what}: {name} has {got} elements, the routing's shape needs {want}"
        )))
    }
}

impl Router {
    /// A router for `dims` and `cfg` (`cfg.top_k` must equal `dims.top_k`); loads the
    /// kernels into the stream's context.
    pub fn new(stream: &Stream, dims: RoutingDims, cfg: RouterConfig) -> Result<Router> {
        dims.check()?;
        if cfg.top_k != dims.top_k {
            return Err(Error::InvalidArgument(format!(
                "Router: config top_k {} differs from the shape's {}",
                cfg.top_k, dims.top_k
            )));
        }
        for (name, v) in [("aux_coef", cfg.aux_coef), ("z_coef", cfg.z_coef)] {
            if !v.is_finite() {
                return Err(Error::InvalidArgument(format!(
                    "Router: {name} = {v} must be finite"
                )));
            }
        }
        let module = Module::embedded(stream.context(), FATBIN)?;
        let k = Kernels {
            forward: module.kernel("moe_router_forward")?,
            logits: module.kernel("moe_router_logits")?,
            plan_count: module.kernel("moe_plan_count")?,
            plan_scan: module.kernel("moe_plan_scan")?,
            plan_small: module.kernel("moe_plan_small")?,
            plan_assign: module.kernel("moe_plan_assign")?,
            combine: module.kernel("moe_combine_forward")?,
            combine_backward: module.kernel("moe_combine_backward")?,
            input_backward: module.kernel("moe_unpermute_backward")?,
            wgrad_partial: module.kernel("moe_router_wgrad_partial")?,
            wgrad_tiled: module.kernel("moe_router_wgrad_tiled")?,
            wgrad_reduce: module.kernel("moe_router_wgrad_reduce")?,
            _module: module,
        };
        Ok(Router {
            dims,
            cfg,
            n: Dims32::of(dims),
            k: Arc::new(k),
        })
    }

    /// The shape.
    pub fn dims(&self) -> RoutingDims {
        self.dims
    }

    /// The configuration.
    pub fn config(&self) -> RouterConfig {
        self.cfg
    }

    fn check_buffers(&self, what: &str, b: &RoutingBuffers) -> Result<()> {
        if b.dims != self.dims {
            return Err(Error::InvalidArgument(format!(
                "{what}: buffers made for {:?}, the router is {:?}",
                b.dims, self.dims
            )));
        }
        Ok(())
    }

    fn score_args(&self) -> (u32, u32) {
        (
            match self.cfg.score {
                ScoreFn::Softmax => 0,
                ScoreFn::Sigmoid => 1,
            },
            u32::from(self.cfg.renormalize),
        )
    }

    /// The router and the plan: logits, scores, top-k, gates, counts, offsets, `row_of`,
    /// `token_of_row` and the two losses into `b`, from `x` (`[T, H]` bf16) and `wr` (`[E,
    /// H]` f32). Two to five launches (the tiled logits at many experts, the forward, then the
    /// plan in one launch or three); capturable.
    pub fn forward(
        &self,
        stream: &Stream,
        x: &DeviceBuffer<bf16>,
        wr: &DeviceBuffer<f32>,
        b: &RoutingBuffers,
    ) -> Result<()> {
        let what = "Router::forward";
        self.check_buffers(what, b)?;
        let d = self.dims;
        check_len(what, "x", x.len(), d.tokens * d.hidden)?;
        check_len(what, "wr", wr.len(), d.experts * d.hidden)?;
        let Dims32 {
            t,
            h,
            e,
            k,
            wr_tokens,
            router_blocks,
            ..
        } = self.n;
        let (score, renorm) = self.score_args();
        let precomputed = u32::from(d.experts >= TILED_ROUTER_EXPERTS);
        if precomputed != 0 {
            let cfg = tiled_launch((t.div_ceil(ROUTER_TILE), e.div_ceil(ROUTER_TILE), 1));
            let args = KernelArgs::new()
                .arg(x)
                .arg(wr)
                .arg(&b.logits)
                .arg(&t)
                .arg(&h)
                .arg(&e);
            // SAFETY: block (bx, by) reads x's rows t < T (T * H checked) and wr's rows e < E
            // (E * H checked), columns h < H (the 16-byte loads only when H % 8 == 0 and both
            // are 16-byte aligned, which the kernel checks, and only for whole 16-column
            // pieces below H), and writes logits[t, e] for t < T, e < E (T * E allocated); its
            // shared memory is static.
            unsafe { stream.launch_pdl(&self.k.logits, &cfg, &args) }?;
        }
        let mut cfg = LaunchConfig::linear(router_blocks, BLOCK);
        cfg.shared_mem_bytes = 2 * MAX_WR_TOKENS as u32 * e * 4;
        let args = KernelArgs::new()
            .arg(x)
            .arg(wr)
            .arg(&b.logits)
            .arg(&b.probs)
            .arg(&b.topk)
            .arg(&b.gates)
            .arg(&b.lse)
            .arg(&b.loss_partial)
            .arg(&t)
            .arg(&h)
            .arg(&e)
            .arg(&k)
            .arg(&score)
            .arg(&renorm)
            .arg(&wr_tokens)
            .arg(&precomputed);
        // SAFETY: block c handles the tokens t = c * wr_tokens + i < T (wr_tokens <= 8, the
        // kernel's MOE_TOKENS): reads x's rows t (T * H checked) and all of wr (E * H
        // checked), or with `precomputed` rows t of logits (T * E), writes rows t of logits
        // (without `precomputed`) and probs (T * E), lse[t], topk and gates at t * k
        // + j (T * k), and loss_partial[c' * router_blocks + c] for c' <= E ((E + 1) *
        // router_blocks allocated, the grid is router_blocks); the shared memory holds the 2 *
        // 8 * E floats it uses. The 16-byte vector loads are taken only when H % 8 == 0 and the
        // kernel finds x and wr 16-byte aligned.
        unsafe { stream.launch_pdl(&self.k.forward, &cfg, &args) }?;
        self.plan(stream, b)
    }

    /// The arguments the plan's scan and its single-block form end with: E, the row
    /// alignment, the capacity, the losses' partial rows, T, k, the two loss coefficients.
    fn plan_scalars<'a>(&'a self, args: KernelArgs<'a>) -> KernelArgs<'a> {
        let n = &self.n;
        args.arg(&n.e)
            .arg(&n.align)
            .arg(&n.rows)
            .arg(&n.router_blocks)
            .arg(&n.t)
            .arg(&n.k)
            .arg(&self.cfg.aux_coef)
            .arg(&self.cfg.z_coef)
    }

    /// The dispatch plan from `b.topk` (count, scan, assign), with the losses and the padding
    /// rows of `token_of_row` in the scan; one single-block launch of all three for few
    /// assignments and experts.
    pub(crate) fn plan(&self, stream: &Stream, b: &RoutingBuffers) -> Result<()> {
        let Dims32 {
            e,
            assignments,
            blocks,
            ..
        } = self.n;
        if self.dims.single_block_plan() {
            let args = KernelArgs::new()
                .arg(&b.topk)
                .arg(&b.loss_partial)
                .arg(&b.counts)
                .arg(&b.offsets)
                .arg(&b.row_of)
                .arg(&b.token_of_row)
                .arg(&b.losses)
                .arg(&assignments);
            let args = self.plan_scalars(args);
            // SAFETY: one block reads topk (T * k <= 4 * 1024, its passes' bound) and
            // loss_partial ((E + 1) * router_blocks), writes counts (E), offsets (E + 1),
            // row_of (T * k), the two losses, and token_of_row at rows below offsets[E] <=
            // capacity (each expert's assignments at offsets[e] + rank, rank < counts[e], the
            // padding and the rows from offsets[E] up to the capacity); its static shared
            // memory is sized for E <= 256 (checked above).
            return unsafe {
                stream.launch_pdl(
                    &self.k.plan_small,
                    &LaunchConfig::linear(1, SCAN_BLOCK),
                    &args,
                )
            };
        }
        let mut cfg = LaunchConfig::linear(blocks, BLOCK);
        cfg.shared_mem_bytes = e * 4;
        let args = KernelArgs::new()
            .arg(&b.topk)
            .arg(&b.block_counts)
            .arg(&assignments)
            .arg(&e);
        // SAFETY: block c reads topk at c * 256 + i < T * k and writes block_counts[c * E ..
        // (c + 1) * E] (blocks * E allocated); shared memory holds E ints.
        unsafe { stream.launch_pdl(&self.k.plan_count, &cfg, &args) }?;
        let args = KernelArgs::new()
            .arg(&b.block_counts)
            .arg(&b.loss_partial)
            .arg(&b.counts)
            .arg(&b.offsets)
            .arg(&b.token_of_row)
            .arg(&b.losses)
            .arg(&blocks);
        let args = self.plan_scalars(args);
        // SAFETY: one block rewrites block_counts (blocks * E), reads loss_partial ((E + 1) *
        // router_blocks), writes counts (E), offsets (E + 1), the two losses, and
        // token_of_row at rows in [offsets[e] + counts[e], offsets[e + 1]) and [offsets[E],
        // capacity), all below the capacity (the offsets are the prefix sums of the counts
        // rounded up, and the capacity bounds their total); its static shared memory is sized
        // for MAX_EXPERTS (E <= MAX_EXPERTS checked).
        unsafe {
            stream.launch_pdl(
                &self.k.plan_scan,
                &LaunchConfig::linear(1, SCAN_BLOCK),
                &args,
            )
        }?;
        let mut cfg = LaunchConfig::linear(blocks, BLOCK);
        cfg.shared_mem_bytes = (WARPS + 1) * e * 4;
        let args = KernelArgs::new()
            .arg(&b.topk)
            .arg(&b.block_counts)
            .arg(&b.offsets)
            .arg(&b.row_of)
            .arg(&b.token_of_row)
            .arg(&assignments)
            .arg(&e);
        // SAFETY: reads topk (T * k), block_counts (blocks * E) and offsets (E + 1); writes
        // row_of (T * k) and token_of_row at rows offsets[e] + rank, where rank < counts[e]
        // and offsets[e] + counts[e] <= offsets[E] <= capacity (as above); shared memory
        // holds (8 + 1) * E ints.
        unsafe { stream.launch_pdl(&self.k.plan_assign, &cfg, &args) }
    }

    /// `out[t, :] = sum_j gates[t, j] * y[row_of[t, j], :]` in j order (f32, rounded to
    /// bf16): `y` is the experts' packed output `[capacity, H]`, `out` `[T, H]`.
    pub fn combine(
        &self,
        stream: &Stream,
        y: &DeviceBuffer<bf16>,
        b: &RoutingBuffers,
        out: &DeviceBuffer<bf16>,
    ) -> Result<()> {
        let what = "Router::combine";
        self.check_buffers(what, b)?;
        let d = self.dims;
        check_len(what, "y", y.len(), d.capacity() * d.hidden)?;
        check_len(what, "out", out.len(), d.tokens * d.hidden)?;
        let Dims32 {
            t,
            h,
            k,
            rows,
            row_tokens,
            ..
        } = self.n;
        let args = KernelArgs::new()
            .arg(y)
            .arg(&b.row_of)
            .arg(&b.gates)
            .arg(out)
            .arg(&t)
            .arg(&h)
            .arg(&k)
            .arg(&rows)
            .arg(&row_tokens);
        // SAFETY: block c handles the tokens t = c * row_tokens + i < T (row_tokens * k
        // rounded up to a power of two <= 8 and row_tokens <= 4, the kernel's MOE_SLOTS and
        // MOE_ROW_TOKENS): reads row_of and gates at t * k + j (T * k) and y rows r < rows
        // (checked in the kernel; capacity * H checked), and writes out's rows t (T * H); the
        // 16-byte vector accesses are taken only when H % 8 == 0 and the kernel finds y and
        // out 16-byte aligned.
        unsafe {
            stream.launch_pdl(
                &self.k.combine,
                &LaunchConfig::linear(t.div_ceil(row_tokens), BLOCK),
                &args,
            )
        }
    }

    /// The combine's backward into the router, from the layer's output gradient `dy` (`[T,
    /// H]`) and the experts' output `y`: the gates' gradient `b.d_gates[t, j] = dy[t, :] .
    /// y[row_of[t, j], :]`, then from it and the saved routing the logits' gradient
    /// `b.d_logits`: through the gates (score function, top-k, renormalisation), the aux loss
    /// and the z-loss (each counted with weight 1 in the loss). One kernel.
    pub fn combine_backward(
        &self,
        stream: &Stream,
        dy: &DeviceBuffer<bf16>,
        y: &DeviceBuffer<bf16>,
        b: &RoutingBuffers,
    ) -> Result<()> {
        self.combine_backward_placed(stream, dy, y, b, false)
    }

    /// [`combine_backward`](Self::combine_backward) beside the kernel enqueued just before it
    /// on `stream`, which must write none of what it reads (`dy`, `y`, `b`'s routing) or
    /// writes (`b.d_gates`, `b.d_logits`): with programmatic dependent launch it starts while
    /// that kernel runs and waits for it only before it exits, so later work still follows
    /// both. The same results.
    pub fn combine_backward_beside_previous(
        &self,
        stream: &Stream,
        dy: &DeviceBuffer<bf16>,
        y: &DeviceBuffer<bf16>,
        b: &RoutingBuffers,
    ) -> Result<()> {
        self.combine_backward_placed(stream, dy, y, b, true)
    }

    fn combine_backward_placed(
        &self,
        stream: &Stream,
        dy: &DeviceBuffer<bf16>,
        y: &DeviceBuffer<bf16>,
        b: &RoutingBuffers,
        beside_previous: bool,
    ) -> Result<()> {
        let what = "Router::combine_backward";
        self.check_buffers(what, b)?;
        let d = self.dims;
        check_len(what, "dy", dy.len(), d.tokens * d.hidden)?;
        check_len(what, "y", y.len(), d.capacity() * d.hidden)?;
        let Dims32 {
            t,
            h,
            e,
            k,
            rows,
            row_tokens,
            ..
        } = self.n;
        let (score, renorm) = self.score_args();
        let beside = u32::from(beside_previous);
        let mut cfg = LaunchConfig::linear(t.div_ceil(row_tokens), BLOCK);
        cfg.shared_mem_bytes = (3 * row_tokens + 1) * e * 4;
        let args = KernelArgs::new()
            .arg(dy)
            .arg(y)
            .arg(&b.row_of)
            .arg(&b.logits)
            .arg(&b.topk)
            .arg(&b.gates)
            .arg(&b.counts)
            .arg(&b.d_gates)
            .arg(&b.d_logits)
            .arg(&t)
            .arg(&h)
            .arg(&e)
            .arg(&k)
            .arg(&rows)
            .arg(&row_tokens)
            .arg(&score)
            .arg(&renorm)
            .arg(&self.cfg.aux_coef)
            .arg(&self.cfg.z_coef)
            .arg(&beside);
        // SAFETY: block c handles the tokens t = c * row_tokens + i < T (row_tokens as in
        // `combine`): reads dy's rows t (T * H), y's rows row_of[t * k + j] when inside [0,
        // rows) (capacity * H), logits' rows t (T * E), topk, gates and row_of at t * k + j (T *
        // k) and counts (E); writes d_gates at t * k + j and d_logits' rows t; all lengths
        // checked; the shared memory holds the (3 * row_tokens + 1) * E floats it uses; the
        // 16-byte vector loads are taken only when H % 8 == 0 and the kernel finds dy and y
        // 16-byte aligned. With `beside_previous` it touches these before the previous kernel
        // ends, which the caller vouches writes none of them (and it waits for that kernel
        // before exiting).
        unsafe { stream.launch_pdl(&self.k.combine_backward, &cfg, &args) }
    }

    /// The input gradient `dx[t, :] = sum_j dxp[row_of[t, j], :] + d_logits[t, :] . wr`
    /// (f32, rounded to bf16): `dxp` is the experts' input gradient in the packed layout
    /// (`[capacity, H]`), `wr` the router weight (`[E, H]`), `dx` `[T, H]`.
    pub fn input_backward(
        &self,
        stream: &Stream,
        dxp: &DeviceBuffer<bf16>,
        wr: &DeviceBuffer<f32>,
        b: &RoutingBuffers,
        dx: &DeviceBuffer<bf16>,
    ) -> Result<()> {
        let what = "Router::input_backward";
        self.check_buffers(what, b)?;
        let d = self.dims;
        check_len(what, "dxp", dxp.len(), d.capacity() * d.hidden)?;
        check_len(what, "wr", wr.len(), d.experts * d.hidden)?;
        check_len(what, "dx", dx.len(), d.tokens * d.hidden)?;
        let Dims32 {
            t,
            h,
            e,
            k,
            rows,
            wr_tokens,
            ..
        } = self.n;
        let mut cfg = LaunchConfig::linear(t.div_ceil(wr_tokens), BLOCK);
        cfg.shared_mem_bytes = MAX_WR_TOKENS as u32 * e * 4;
        let args = KernelArgs::new()
            .arg(dxp)
            .arg(&b.row_of)
            .arg(&b.d_logits)
            .arg(wr)
            .arg(dx)
            .arg(&t)
            .arg(&h)
            .arg(&e)
            .arg(&k)
            .arg(&rows)
            .arg(&wr_tokens);
        // SAFETY: block c handles the tokens t = c * wr_tokens + i < T (wr_tokens <= 8, the
        // kernel's MOE_TOKENS): reads row_of at t * k + j, dxp rows inside [0, rows) (checked
        // in the kernel), d_logits' rows t, all of wr, and writes dx's rows t; lengths
        // checked; shared memory holds the 8 * E floats it uses; the 16-byte vector accesses
        // are taken only when H % 8 == 0 and the kernel finds dxp, wr and dx 16-byte aligned.
        unsafe { stream.launch_pdl(&self.k.input_backward, &cfg, &args) }
    }

    /// The router weight's gradient `dwr (+)= d_logits^T . x` (`[E, H]` f32; added to `dwr`
    /// when `accumulate`), summed over tokens in a fixed order (chunks of 16 to 128 tokens
    /// by T, then the chunks in order).
    pub fn weight_backward(
        &self,
        stream: &Stream,
        x: &DeviceBuffer<bf16>,
        b: &RoutingBuffers,
        dwr: &DeviceBuffer<f32>,
        accumulate: bool,
    ) -> Result<()> {
        let what = "Router::weight_backward";
        self.check_buffers(what, b)?;
        let d = self.dims;
        check_len(what, "x", x.len(), d.tokens * d.hidden)?;
        check_len(what, "dwr", dwr.len(), d.experts * d.hidden)?;
        let Dims32 {
            t,
            h,
            e,
            chunk,
            chunks,
            ..
        } = self.n;
        let n32 = e * h;
        // Both kernels take the same arguments: (the kernel, its launch, tokens per chunk,
        // the chunks of partial sums it writes).
        let (kernel, cfg, chunk, chunks) = if d.experts >= TILED_ROUTER_EXPERTS {
            let chunk = WGRAD_TILED_TOKENS as u32;
            let tiled = t.div_ceil(chunk);
            let cfg = tiled_launch((h.div_ceil(ROUTER_TILE), e.div_ceil(ROUTER_TILE), tiled));
            (&self.k.wgrad_tiled, cfg, chunk, tiled)
        } else {
            let cfg = LaunchConfig {
                grid: (h.div_ceil(WGRAD_COLS), chunks, e.div_ceil(WGRAD_EXPERTS)),
                shared_mem_bytes: chunk * WGRAD_EXPERTS * 4,
                ..LaunchConfig::linear(1, BLOCK)
            };
            (&self.k.wgrad_partial, cfg, chunk, chunks)
        };
        let args = KernelArgs::new()
            .arg(&b.d_logits)
            .arg(x)
            .arg(&b.wgrad_partial)
            .arg(&t)
            .arg(&h)
            .arg(&e)
            .arg(&chunk);
        // SAFETY: each block reads d_logits and x at the tokens of its chunk (< T), experts < E
        // and columns < H, and writes wgrad_partial[c * E * H + e * H + h] for its chunk c <
        // `chunks` = ceil(T / chunk) (the tiled kernel's chunks are longer:
        // WGRAD_TILED_TOKENS >= WGRAD_CHUNK >= chunk; that many * E * H allocated).
        // moe_router_wgrad_partial (block (b, c, g): experts g * 8 + i, columns b * 256 + i)
        // holds the chunk * 8 floats of dynamic shared memory it uses, and takes
        // 16-byte accesses only when H % 8 == 0 and it finds x and wgrad_partial 16-byte
        // aligned; moe_router_wgrad_tiled (block (bx, by, c): a 64 x 64 tile) has static shared
        // memory and takes 16-byte loads only for whole 16-value pieces below E or H, when E %
        // 4 == 0 / H % 8 == 0 and it finds the buffer 16-byte aligned.
        unsafe { stream.launch_pdl(kernel, &cfg, &args) }?;
        let acc = u32::from(accumulate);
        let args = KernelArgs::new()
            .arg(&b.wgrad_partial)
            .arg(dwr)
            .arg(&n32)
            .arg(&chunks)
            .arg(&acc);
        // SAFETY: four threads per group of four q < E * H read wgrad_partial at c * E * H + q
        // and one reads/writes dwr[q] (E * H checked); the float4 accesses are taken only when
        // E * H % 4 == 0 and the kernel finds wgrad_partial and dwr 16-byte aligned.
        unsafe {
            stream.launch_pdl(
                &self.k.wgrad_reduce,
                &LaunchConfig::linear((n32.div_ceil(4) * 4).div_ceil(BLOCK), BLOCK),
                &args,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(tokens: usize, experts: usize, top_k: usize, align: usize) -> RoutingDims {
        RoutingDims {
            tokens,
            hidden: 64,
            experts,
            top_k,
            align,
        }
    }

    #[test]
    fn plan_form_and_wgrad_chunks_follow_the_shape() {
        // One launch up to 4096 assignments and 256 experts (the kernel's passes and shared
        // arrays), three past either.
        for (t, e, k, one) in [
            (256, 8, 2, true),
            (2048, 16, 2, true),
            (600, 256, 4, true),
            (2100, 8, 2, false),
            (600, 256, 8, false),
            (60, 300, 4, false),
        ] {
            assert_eq!(
                dims(t, e, k, 128).single_block_plan(),
                one,
                "T {t} E {e} k {k}"
            );
        }
        // Router weight-gradient chunks: T / 16 tokens within 16..=128, covering every token.
        for (t, chunk, chunks) in [(256, 16, 16), (1024, 64, 16), (4096, 128, 32), (10, 16, 1)] {
            let d = dims(t, 8, 2, 128);
            assert_eq!(
                (d.wgrad_chunk(), d.wgrad_chunks()),
                (chunk, chunks),
                "T {t}"
            );
            assert!(d.wgrad_chunk() * d.wgrad_chunks() >= t);
        }
    }

    #[test]
    fn capacity_bounds_every_plan() {
        // The worst case: every expert's count one past a multiple of align.
        for (t, e, k, a) in [
            (4096, 8, 2, 128),
            (4096, 256, 8, 128),
            (5, 3, 2, 4),
            (1, 1, 1, 1),
        ] {
            let d = dims(t, e, k, a);
            d.check().unwrap();
            let cap = d.capacity();
            let expected = d.expected_rows();
            assert!(t * k <= expected && expected <= cap, "{expected} of {cap}");
            assert_eq!(cap % a, 0);
            assert!(cap >= t * k + e * (a - 1), "{d:?}");
            assert!(cap < t * k + e * (a - 1) + a, "{d:?}");
        }
        assert_eq!(dims(256, 8, 2, 128).capacity(), 1536);
    }

    #[test]
    fn blocks_fit_the_kernels_layouts() {
        for t in [1, 100, 256, 1101, 4096, 1 << 16] {
            for (e, k) in [
                (8, 1),
                (8, 2),
                (5, 3),
                (16, 4),
                (256, 8),
                (MAX_EXPERTS, 1),
                (MAX_EXPERTS, 2),
            ] {
                let d = dims(t, e, k, 128);
                let w = d.wr_tokens_per_block();
                assert!((1..=MAX_WR_TOKENS).contains(&w), "{d:?}");
                assert_eq!(d.router_blocks(), t.div_ceil(w), "{d:?}");
                let r = d.row_tokens_per_block();
                assert!((1..=MAX_ROW_TOKENS).contains(&r), "{d:?}");
                assert!(r * k.next_power_of_two() <= ROW_SLOTS, "{d:?}");
            }
        }
        // The H200 shapes: T = 256 spreads over more blocks, T = 4096 shares more per block.
        let (small, large) = (dims(256, 8, 2, 128), dims(4096, 8, 2, 128));
        assert_eq!(
            (small.wr_tokens_per_block(), small.router_blocks()),
            (2, 128)
        );
        assert_eq!(
            (large.wr_tokens_per_block(), large.router_blocks()),
            (8, 512)
        );
        assert_eq!(small.row_tokens_per_block(), 1);
        assert_eq!(large.row_tokens_per_block(), 4);
    }

    #[test]
    fn bad_shapes_name_the_dimension() {
        let msg = |d: RoutingDims| d.check().unwrap_err().to_string();
        assert!(msg(dims(0, 8, 2, 128)).contains("tokens"));
        assert!(msg(dims(8, 0, 1, 128)).contains("experts = 0"));
        assert!(msg(dims(8, MAX_EXPERTS + 1, 2, 128)).contains("experts"));
        assert!(msg(dims(8, 8, 0, 128)).contains("top_k = 0"));
        assert!(msg(dims(8, 8, 9, 128)).contains("top_k = 9"));
        assert!(msg(dims(8, 2, 3, 128)).contains("top_k = 3"));
        assert!(msg(dims(8, 8, 2, 0)).contains("align"));
        assert!(msg(dims(1 << 30, 8, 8, 128)).contains("2^31"));
    }
}
