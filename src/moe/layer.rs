//! [`MoeLayer`]: a dropless top-k mixture-of-experts layer with SwiGLU experts, FP8 expert
//! GEMMs and the full backward, as a [`Callable`] of the graphed-callables runtime.
//!
//! # The layer
//! `x` (`[T, H]` bf16) -> router ([`Router`]: logits, scores, top-k, gates, plan, aux and z
//! losses) -> permute fused with the E4M3 cast into the packed expert-major layout
//! ([`gather_cast_transpose`]) -> fc1 (`[E, 2F, H]`, gate rows first) -> SwiGLU fused with the
//! E4M3 cast of fc2's input ([`swiglu_cast_transpose`]) -> fc2 (`[E, H, F]`) -> combine (the
//! gate-weighted sum of each token's `k` expert rows, bf16 out).
//!
//! The backward, all of it: the gates' gradient and from it the router logits' (through the
//! scores, top-k, renormalisation, aux and z losses), the combine's backward fused with the
//! cast of dY to the gradient format (E5M2 in the HYBRID recipe, E4M3 in the E4M3 one),
//! fc2's dgrad and wgrad, the SwiGLU backward fused with its casts, fc1's dgrad and wgrad,
//! then `dx` and the router weight's gradient. Weight gradients accumulate (in f32, or in
//! bf16 with [`GradDtype::Bf16`]), or, with [`MoeLayer::with_step_gradients`], hold one step's
//! sum (microbatch 0 writes them).
//!
//! # Expert GEMMs ([`ExpertGemm`])
//! * [`ExpertGemm::PerExpert`] (the reference): the offsets are read to the host (a stream
//!   synchronisation) and each expert with tokens gets a dense [`gemm`] over its rows (its
//!   token count rounded up to [`ALIGN_ROWS`]; padding rows are zero); its weight gradient is
//!   the grouped weight-gradient kernel restricted to that expert. Under graphed callables:
//!   breaking-layer capture (Megatron's `moe_router` / `moe_preprocess` scopes): forward
//!   `[Graphed: router + permute] [Eager: experts] [Graphed: combine]`, backward
//!   `[Graphed: gates' and router gradients + dY cast] [Eager: experts] [Graphed: dx]`.
//! * [`ExpertGemm::Grouped`]: grouped GEMMs reading the offsets on the device; nothing on
//!   the host between the kernels, so each pass is one graph (full-layer capture). Where
//!   fc1's tiles are more than one wave of the SMs, fc1 and the SwiGLU cast are one call
//!   ([`grouped_gemm_packed_swiglu`]): on the sm_90a path the cast runs in fc1's epilogue,
//!   one kernel instead of two, with the same bits.
//!
//! # FP8 state
//! [`tensors`]`(E) = 4 + 2E` tensors of a shared [`DelayedScaling`], from the layer's
//! `first_tensor`: x and h (E4M3), dY and dA (the gradient format), then fc1's weight of every
//! expert and fc2's of every expert (E4M3) ([`formats`]): each expert's weights have their own
//! scale, like TransformerEngine's grouped linear, and the grouped GEMMs read one scale per
//! expert. The expert weights are cast once per step in [`Callable::cast_weights`] (skipped on
//! later microbatches exactly like single linears: the slot's noop flag or the runtime's IF
//! node). A warmup forward reports ([`Slot::record_tensors`]) the weight tensors of the
//! experts that got tokens only, so the runtime registers for scale updates exactly the
//! experts warmup routed to.
//!
//! # Saved buffers (per microbatch)
//! `saved[0]` the routing ([`RoutingBuffers::from_bytes`]), `[1]` `X^T` E4M3 `[H, C]`, `[2]`
//! fc1's output `a` bf16 `[C, 2F]`, `[3]` `h^T` E4M3 `[F, C]`, `[4]` fc2's output `y` bf16
//! `[C, H]`, `[5]` the four scale_invs the casts wrote (x, h, dY, dA), `[6]` `dY^T` `[H, C]`,
//! `[7]` `dA^T` `[2F, C]` (`C` = the capacity). The row-major FP8 copies live only within a
//! pass and are shared by the microbatches.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cuda_graph::half::bf16;
use cuda_graph::{DeviceBuffer, Error, Event, Result, Stream};
use fp8_kernels::gemm::{
    GemmOptions, GemmOut, GemmPath, GemmShape, GroupedOperand, Operand, PackedShape, WgradShape,
    gemm, grouped_gemm_packed, grouped_gemm_packed_swiglu, grouped_gemm_wgrad,
};
use fp8_kernels::{
    BatchedCastOut, CastScaling, DelayedScaling, DeviceScalar, Fp8Format, Fp8Tensor, FusedCastOut,
    Gather, HpBuffer, RowsInUse, ScalarSlots, cast_transpose_batched, gather_cast_transpose,
    swiglu_backward_cast_transpose, swiglu_cast_transpose,
};
use graphed_callables::{Callable, SegmentKind, Slot};

use crate::zeroed;

use super::routing::{ALIGN_ROWS, Router, RouterConfig, RoutingBuffers, RoutingDims};

/// The activation and gradient tensors of a layer (x, h, dY, dA), before the weights.
pub(crate) const ACTIVATIONS: usize = 4;
/// Offsets of the layer's tensors from its first.
const X: usize = 0;
const HID: usize = 1;
const DY: usize = 2;
const DA: usize = 3;

/// The parts of each pass (router side, experts, combine side).
const PARTS: usize = 3;

/// How many tensors of the [`DelayedScaling`] state a layer of `experts` experts uses: x, h,
/// dY, dA, then fc1's and fc2's weight of every expert.
pub fn tensors(experts: usize) -> usize {
    ACTIVATIONS + 2 * experts
}

/// The offset of expert `e`'s fc1 weight tensor from the layer's first.
fn w1_tensor(e: usize) -> usize {
    ACTIVATIONS + e
}

/// The offset of expert `e`'s fc2 weight tensor from the layer's first.
fn w2_tensor(experts: usize, e: usize) -> usize {
    ACTIVATIONS + experts + e
}

/// The FP8 recipe of the gradients (TransformerEngine's `Format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Recipe {
    /// E4M3 forward, E5M2 gradients.
    Hybrid,
    /// E4M3 everywhere.
    E4M3,
}

/// The formats of a layer's [`tensors`] in state order: x, h (E4M3), dY, dA (the recipe's
/// gradient format), the `2 * experts` weights (E4M3).
pub fn formats(recipe: Fp8Recipe, experts: usize) -> Vec<Fp8Format> {
    let g = grad_format(recipe);
    let f = Fp8Format::E4M3;
    let mut v = vec![f, f, g, g];
    v.resize(tensors(experts), f);
    v
}

/// The gradients' format of a recipe.
fn grad_format(recipe: Fp8Recipe) -> Fp8Format {
    match recipe {
        Fp8Recipe::Hybrid => Fp8Format::E5M2,
        Fp8Recipe::E4M3 => Fp8Format::E4M3,
    }
}

/// The format of activation tensor `t` (x, h, dY, dA) of a recipe.
fn activation_format(recipe: Fp8Recipe, t: usize) -> Fp8Format {
    if t == DY || t == DA {
        grad_format(recipe)
    } else {
        Fp8Format::E4M3
    }
}

/// How the expert GEMMs run (see the [module documentation](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpertGemm {
    /// Dense GEMMs per expert on host-read offsets (breaking-layer capture).
    PerExpert,
    /// Grouped GEMMs on device offsets (full-layer capture).
    Grouped,
}

/// The type of the expert weights' gradients (`dW1`, `dW2`; the router weight's stays f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GradDtype {
    /// f32 (the default): like Megatron-LM's `main_grad`, microbatches add up without
    /// rounding to bf16 in between.
    #[default]
    F32,
    /// bf16, the parameters' type: like PyTorch's `.grad` of bf16 parameters, or
    /// TransformerEngine without `fuse_wgrad_accumulation`. Half the bytes written (and read,
    /// when accumulating); a microbatch's sum is rounded to bf16 once, and every later
    /// microbatch's addition rounds again.
    Bf16,
}

/// An expert weight's gradient buffer, of the layer's [`GradDtype`].
#[derive(Debug)]
pub enum WeightGrad {
    /// [`GradDtype::F32`].
    F32(DeviceBuffer<f32>),
    /// [`GradDtype::Bf16`].
    Bf16(DeviceBuffer<bf16>),
}

impl WeightGrad {
    /// `n` zeros of `dtype`.
    fn zeroed(stream: &Stream, n: usize, dtype: GradDtype) -> Result<WeightGrad> {
        Ok(match dtype {
            GradDtype::F32 => WeightGrad::F32(zeroed(stream, n)?),
            GradDtype::Bf16 => WeightGrad::Bf16(zeroed(stream, n)?),
        })
    }

    /// The element type.
    pub fn dtype(&self) -> GradDtype {
        match self {
            WeightGrad::F32(_) => GradDtype::F32,
            WeightGrad::Bf16(_) => GradDtype::Bf16,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            WeightGrad::F32(b) => b.len(),
            WeightGrad::Bf16(b) => b.len(),
        }
    }

    /// Whether it has no elements (never, for a layer's gradient).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Another handle to the same memory ([`DeviceBuffer::share`]).
    pub fn share(&self) -> WeightGrad {
        match self {
            WeightGrad::F32(b) => WeightGrad::F32(b.share()),
            WeightGrad::Bf16(b) => WeightGrad::Bf16(b.share()),
        }
    }

    /// Enqueues zeroing it on `stream` (also inside a capture).
    pub fn zero(&self, stream: &Stream) -> Result<()> {
        self.zero_range(stream, None)
    }

    /// Enqueues zeroing elements `range` (all for `None`).
    fn zero_range(&self, stream: &Stream, range: Option<std::ops::Range<usize>>) -> Result<()> {
        self.with_out(range, |d| match d {
            GemmOut::F32(b) => b.memset_bytes(stream, 0),
            GemmOut::Bf16(b) => b.memset_bytes(stream, 0),
        })
    }

    /// The gradient read back as f32 (bf16 widened exactly; waits for `stream`).
    pub fn to_f32_vec(&self, stream: &Stream) -> Result<Vec<f32>> {
        Ok(match self {
            WeightGrad::F32(b) => b.to_vec(stream)?,
            WeightGrad::Bf16(b) => b.to_vec(stream)?.iter().map(|x| x.to_f32()).collect(),
        })
    }

    /// The buffer as the FP8 kernels' high-precision input (f32 or bf16).
    pub fn view(&self) -> HpBuffer<'_> {
        match self {
            WeightGrad::F32(b) => HpBuffer::F32(b),
            WeightGrad::Bf16(b) => HpBuffer::Bf16(b),
        }
    }

    /// The f32 buffer ([`GradDtype::F32`]).
    pub fn as_f32(&self) -> Option<&DeviceBuffer<f32>> {
        match self {
            WeightGrad::F32(b) => Some(b),
            WeightGrad::Bf16(_) => None,
        }
    }

    /// The bf16 buffer ([`GradDtype::Bf16`]).
    pub fn as_bf16(&self) -> Option<&DeviceBuffer<bf16>> {
        match self {
            WeightGrad::Bf16(b) => Some(b),
            WeightGrad::F32(_) => None,
        }
    }

    /// Calls `f` with elements `range` as a GEMM output (a view; the whole buffer for
    /// `None`).
    fn with_out<R>(
        &self,
        range: Option<std::ops::Range<usize>>,
        f: impl FnOnce(GemmOut<'_>) -> Result<R>,
    ) -> Result<R> {
        match (self, range) {
            (WeightGrad::F32(b), None) => f(GemmOut::from(b)),
            (WeightGrad::Bf16(b), None) => f(GemmOut::from(b)),
            (WeightGrad::F32(b), Some(r)) => f(GemmOut::from(&b.slice(r)?)),
            (WeightGrad::Bf16(b), Some(r)) => f(GemmOut::from(&b.slice(r)?)),
        }
    }
}

/// A layer's shape and settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeLayerConfig {
    /// Tokens per microbatch (`T`).
    pub tokens: usize,
    /// Hidden size (`H`), a multiple of 16.
    pub hidden: usize,
    /// Expert FFN size (`F`), a multiple of 16.
    pub ffn: usize,
    /// Experts (`E`).
    pub experts: usize,
    /// The router.
    pub router: RouterConfig,
    /// The gradients' FP8 format.
    pub recipe: Fp8Recipe,
    /// How the expert GEMMs run.
    pub expert_gemm: ExpertGemm,
    /// The scaling of the activations and gradients the layer casts (x, h, dY, dA): delayed
    /// (the state's scales, amaxes recorded for its update) or current (each cast computes
    /// its tensor's amax first). The expert weights keep delayed scaling: they are cast once
    /// per step.
    pub scaling: CastScaling,
    /// The type of the expert weights' gradients.
    pub grad_dtype: GradDtype,
}

impl MoeLayerConfig {
    /// The router's shape.
    pub fn routing_dims(&self) -> RoutingDims {
        RoutingDims {
            tokens: self.tokens,
            hidden: self.hidden,
            experts: self.experts,
            top_k: self.router.top_k,
            align: ALIGN_ROWS,
        }
    }

    /// Rows of the packed layout.
    pub fn capacity(&self) -> usize {
        self.routing_dims().capacity()
    }

    /// Checks the shape: the router's rules, `H` and `F` positive multiples of 16, every
    /// buffer within i32 elements.
    pub fn check(&self) -> Result<()> {
        self.routing_dims().check()?;
        for (name, v) in [("hidden", self.hidden), ("ffn", self.ffn)] {
            if v == 0 || v % 16 != 0 {
                return Err(Error::InvalidArgument(format!(
                    "MoeLayerConfig: {name} = {v} must be a positive multiple of 16"
                )));
            }
        }
        let (c, e, h, f) = (
            self.capacity() as u128,
            self.experts as u128,
            self.hidden as u128,
            self.ffn as u128,
        );
        if [c * 2 * f, c * h, e * 2 * f * h]
            .iter()
            .any(|&n| n > i32::MAX as u128)
        {
            return Err(Error::InvalidArgument(format!(
                "MoeLayerConfig: {self:?} has a buffer above 2^31 elements"
            )));
        }
        Ok(())
    }

    /// The per-microbatch saved buffers' sizes in bytes (see the [module
    /// documentation](self)).
    pub fn saved_bytes(&self) -> Result<Vec<usize>> {
        self.check()?;
        let (c, h, f) = (self.capacity(), self.hidden, self.ffn);
        Ok(vec![
            RoutingBuffers::bytes(self.routing_dims())?,
            h * c,
            c * 2 * f * 2,
            f * c,
            c * h * 2,
            4 * 4,
            h * c,
            2 * f * c,
        ])
    }
}

/// The layer's initial parameters, host copies: `wr` `[E, H]` f32, `w1` `[E, 2F, H]` and `w2`
/// `[E, H, F]` as f32 (rounded to bf16 on upload).
#[derive(Debug, Clone)]
pub struct MoeParams {
    /// The router weight.
    pub wr: Vec<f32>,
    /// fc1 of every expert (rows `0..F` gate, `F..2F` up).
    pub w1: Vec<f32>,
    /// fc2 of every expert.
    pub w2: Vec<f32>,
}

/// The layer. See the [module documentation](self).
#[derive(Debug)]
pub struct MoeLayer {
    cfg: MoeLayerConfig,
    router: Router,
    scaling: Arc<DelayedScaling>,
    first_tensor: usize,
    path: GemmPath,
    /// Whether the sm_90a kernels run on the device ([`hopper_available`]: `Auto` then runs
    /// the grouped GEMMs on them).
    ///
    /// [`hopper_available`]: fp8_kernels::gemm::hopper_available
    hopper: bool,
    /// Whether microbatch 0's weight-gradient pass writes the weight gradients instead of
    /// adding to them ([`MoeLayer::with_step_gradients`]).
    step_gradients: bool,
    wr: DeviceBuffer<f32>,
    dwr: DeviceBuffer<f32>,
    w1: DeviceBuffer<bf16>,
    dw1: WeightGrad,
    w2: DeviceBuffer<bf16>,
    dw2: WeightGrad,
    /// The E4M3 weights, row-major (`[E, 2F, H]`, `[E, H, F]`) and per expert transposed
    /// (`[E, H, 2F]`, `[E, F, H]`).
    w1_q: DeviceBuffer<u8>,
    w1_t: DeviceBuffer<u8>,
    w2_q: DeviceBuffer<u8>,
    w2_t: DeviceBuffer<u8>,
    /// The scale_inv each expert's weights were cast with: fc1's `E`, then fc2's `E`.
    w_si: DeviceBuffer<f32>,
    /// Row-major FP8 copies within a pass: x, h (forward), dY, dA (backward).
    xq: DeviceBuffer<u8>,
    hq: DeviceBuffer<u8>,
    dyq: DeviceBuffer<u8>,
    daq: DeviceBuffer<u8>,
    /// bf16 intermediates within a backward: fc2's dgrad `[C, F]`, fc1's dgrad `[C, H]`.
    dh: DeviceBuffer<bf16>,
    dxp: DeviceBuffer<bf16>,
    /// Fast accumulation in the forward GEMMs ([`MoeLayer::with_fast_forward_accumulation`]).
    fast_forward: bool,
    /// The SMs the experts' weight gradients take beside their data gradients
    /// ([`MoeLayer::with_weight_grads_beside`]); `None`: after them, on the caller's stream.
    wgrad_sms: Option<usize>,
    /// The stream the weight gradients run on beside the data gradients, and the event that
    /// hands work over between it and the caller's ([`MoeLayer::hand_over`]).
    side: Stream,
    handoff: Event,
    /// The SMs dx and the router weight's gradient take beside the experts' weight gradients
    /// ([`MoeLayer::with_router_grads_beside`]); `None`: the router weight's gradient beside
    /// dx after them.
    router_sms: Option<usize>,
    /// The stream the router's gradients run on (beside dx, or beside the experts' weight
    /// gradients).
    router_side: Stream,
    /// The device's SM count (the fusion and beside rules).
    sms: usize,
    /// The FP8 expert weights are written by the optimizer, not cast in the step
    /// ([`MoeLayer::with_fp8_weights_from_optimizer`]); shared with every
    /// [`MoeAdamW`](super::optim::MoeAdamW) of the layer, which reads it at each step.
    optimizer_casts: Arc<AtomicBool>,
}

/// One of the layer's expert weights as an optimizer sees it: handles sharing the layer's
/// memory (valid after the layer moved into a runtime), its batch shape and where its FP8
/// cast goes.
#[derive(Debug)]
pub(crate) struct ExpertWeight {
    /// The bf16 weights `[E, rows, cols]`.
    pub(crate) w: DeviceBuffer<bf16>,
    /// Their gradient.
    pub(crate) grad: WeightGrad,
    /// `(E, rows, cols)`.
    pub(crate) shape: (usize, usize, usize),
    /// The FP8 copies, row-major and per expert transposed.
    pub(crate) q: DeviceBuffer<u8>,
    pub(crate) t: DeviceBuffer<u8>,
    /// Each expert's scale, scale_inv and amax slots.
    pub(crate) scale: ScalarSlots,
    pub(crate) scale_inv: ScalarSlots,
    pub(crate) amax: ScalarSlots,
}

impl ExpertWeight {
    /// Where the cast of these weights writes.
    pub(crate) fn cast_out(&self) -> BatchedCastOut<'_> {
        BatchedCastOut {
            data: &self.q,
            data_t: &self.t,
            format: Fp8Format::E4M3,
            scale: self.scale.clone(),
            scale_inv: self.scale_inv.clone(),
            amax: self.amax.clone(),
        }
    }
}

/// Expected rows an expert from which f32 weight gradients run beside the data gradients by
/// default ([`MoeLayer::with_weight_grads_beside`]).
const BESIDE_ROWS: usize = 512;

/// The default of [`MoeLayer::with_weight_grads_beside`] on a device of `sms` SMs: half of
/// them for f32 weight gradients of grouped experts with at least [`BESIDE_ROWS`] expected
/// rows each, else none. On an H200 at T = 4096 (E = 8, 1024 rows an expert) the f32 step
/// took 0.850-0.851 ms beside on 66 SMs against 0.862-0.867 after (56 SMs: 0.896-0.903, 76:
/// 0.874-0.876); with bf16 gradients (a weight gradient half as long), at T = 256 and at
/// E = 256 (128 rows an expert) it was slower (docs/perf-notes.md).
fn default_wgrad_sms(cfg: &MoeLayerConfig, sms: usize) -> Option<usize> {
    let rows = cfg.routing_dims().expected_rows() / cfg.experts.max(1);
    let beside = cfg.grad_dtype == GradDtype::F32
        && cfg.expert_gemm == ExpertGemm::Grouped
        && rows >= BESIDE_ROWS;
    Some(sms / 2).filter(|&w| beside && w > 0)
}

/// The SMs dx and the router weight's gradient take by default beside the experts' weight
/// gradients ([`MoeLayer::with_router_grads_beside`]).
const ROUTER_BESIDE_SMS: usize = 8;

/// The most `T * (E + k)` (the router backward's multiply-adds per hidden column: `E` for
/// its weight gradient, `E + k` for dx) with which dx and the router weight's gradient run
/// beside the experts' weight gradients by default: on a few SMs they must end before the
/// weight gradients do.
const ROUTER_BESIDE_WORK: usize = 4096;

/// The default of [`MoeLayer::with_router_grads_beside`] on a device of `sms` SMs:
/// [`ROUTER_BESIDE_SMS`] for grouped experts whose router backward is small (`T * (E + k)` at
/// most [`ROUTER_BESIDE_WORK`]) on a device with room for it, else none (weight gradients
/// [beside](MoeLayer::with_weight_grads_beside) the data gradients take precedence:
/// [`MoeLayer::router_split`]). On an H200 at T = 256 (E =
/// 8, top-2) the backward took 0.126 ms with 4 or 8 SMs against 0.132 (bf16 weight
/// gradients), 0.180 against 0.181 (f32); at T = 4096 on 16 SMs it was slower (0.538 against
/// 0.529, bf16; docs/perf-notes.md).
fn default_router_sms(cfg: &MoeLayerConfig, sms: usize) -> Option<usize> {
    let work = cfg.tokens * (cfg.experts + cfg.router.top_k);
    let small = cfg.expert_gemm == ExpertGemm::Grouped && work <= ROUTER_BESIDE_WORK;
    Some(ROUTER_BESIDE_SMS).filter(|&r| small && sms > 2 * r)
}

/// One of an expert's two linears (fc1: H -> 2F, fc2: F -> H).
#[derive(Debug, Clone, Copy)]
enum Fc {
    One,
    Two,
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// The saved buffers of a slot, checked against the layer's sizes.
pub(crate) struct Saved<'a> {
    pub(crate) routing: RoutingBuffers,
    x_t: &'a DeviceBuffer<u8>,
    a: DeviceBuffer<bf16>,
    h_t: &'a DeviceBuffer<u8>,
    pub(crate) y: DeviceBuffer<bf16>,
    /// The four scale_invs (x, h, dY, dA).
    si: [DeviceScalar; 4],
    dy_t: &'a DeviceBuffer<u8>,
    da_t: &'a DeviceBuffer<u8>,
}

impl MoeLayer {
    /// A layer of `cfg` with parameters `params`, gradients zeroed, using tensors
    /// `first_tensor .. first_tensor + `[`tensors`]`(E)` of `scaling` (formats
    /// [`formats`]`(cfg.recipe, E)`).
    /// Allocates and uploads (waits; not during a capture) and loads its kernels.
    pub fn new(
        stream: &Stream,
        cfg: MoeLayerConfig,
        params: &MoeParams,
        scaling: Arc<DelayedScaling>,
        first_tensor: usize,
    ) -> Result<MoeLayer> {
        cfg.check()?;
        let (e, h, f, c) = (cfg.experts, cfg.hidden, cfg.ffn, cfg.capacity());
        for (name, got, want) in [
            ("wr", params.wr.len(), e * h),
            ("w1", params.w1.len(), e * 2 * f * h),
            ("w2", params.w2.len(), e * h * f),
        ] {
            if got != want {
                return Err(Error::InvalidArgument(format!(
                    "MoeLayer: {name} has {got} elements, {cfg:?} needs {want}"
                )));
            }
        }
        for (i, want) in formats(cfg.recipe, cfg.experts).iter().enumerate() {
            let t = first_tensor.saturating_add(i);
            if scaling.format(t) != Some(*want) {
                return Err(Error::InvalidArgument(format!(
                    "MoeLayer: scaling tensor {t} is {:?}, the layer needs {want:?} (tensors \
                     first_tensor.. are x, h, dY, dA, then W1 and W2 of each expert)",
                    scaling.format(t)
                )));
            }
        }
        let router = Router::new(stream, cfg.routing_dims(), cfg.router)?;
        fp8_kernels::module(stream.context())?;
        let w_si = DeviceBuffer::from_host(stream, &vec![1f32; 2 * e])?;
        let sms = usize::try_from(stream.context().device().multiprocessor_count()?).unwrap_or(0);
        let layer = MoeLayer {
            cfg,
            router,
            scaling,
            first_tensor,
            path: GemmPath::Auto,
            hopper: fp8_kernels::gemm::hopper_available(stream.context())?,
            step_gradients: false,
            wr: DeviceBuffer::from_host(stream, &params.wr)?,
            dwr: zeroed(stream, e * h)?,
            w1: DeviceBuffer::from_host(stream, &to_bf16(&params.w1))?,
            dw1: WeightGrad::zeroed(stream, e * 2 * f * h, cfg.grad_dtype)?,
            w2: DeviceBuffer::from_host(stream, &to_bf16(&params.w2))?,
            dw2: WeightGrad::zeroed(stream, e * h * f, cfg.grad_dtype)?,
            w1_q: zeroed(stream, e * 2 * f * h)?,
            w1_t: zeroed(stream, e * 2 * f * h)?,
            w2_q: zeroed(stream, e * h * f)?,
            w2_t: zeroed(stream, e * h * f)?,
            w_si,
            xq: zeroed(stream, c * h)?,
            hq: zeroed(stream, c * f)?,
            dyq: zeroed(stream, c * h)?,
            daq: zeroed(stream, c * 2 * f)?,
            dh: zeroed(stream, c * f)?,
            dxp: zeroed(stream, c * h)?,
            fast_forward: true,
            wgrad_sms: default_wgrad_sms(&cfg, sms),
            side: Stream::new(stream.context())?,
            handoff: Event::for_sync(stream.context())?,
            router_sms: default_router_sms(&cfg, sms),
            router_side: Stream::new(stream.context())?,
            sms,
            optimizer_casts: Arc::new(AtomicBool::new(false)),
        };
        stream.synchronize()?;
        Ok(layer)
    }

    /// This layer with its expert GEMMs on `path` (default [`GemmPath::Auto`]). `Auto` runs
    /// the grouped GEMMs ([`grouped_gemm_packed`], [`grouped_gemm_wgrad`]) on the sm_90a
    /// kernels on a compute capability 9.0 device (the layer's offsets are the aligned ones
    /// those kernels need) and on the portable kernels elsewhere; `Portable` keeps them
    /// portable; `Hopper` asks for the sm_90a kernels (an error elsewhere). The per-expert
    /// dense GEMMs take `path` as [`gemm`] does.
    pub fn with_gemm_path(mut self, path: GemmPath) -> MoeLayer {
        self.path = path;
        self
    }

    /// This layer with its weight gradients holding one step's sum (`true`) instead of
    /// adding up until the caller zeroes them (`false`, the default, like [`Fp8Linear`]'s):
    /// the weight-gradient pass of microbatch 0 (the slot's [`GraphIndex`] microbatch) writes
    /// `dW1`, `dW2` and `dWr` (experts without tokens get zeros), later microbatches add to
    /// them. The runtime runs a chunk's weight-gradient passes in microbatch order (also when
    /// the schedule splits them off), so microbatch 0's comes first in every step, and no
    /// zeroing is needed between steps: it saves reading the gradients once per step
    /// (`4 E (3 F H) + 4 E H` bytes in f32), what TransformerEngine's `zero_out_wgrad` saves.
    ///
    /// [`Fp8Linear`]: crate::linear::Fp8Linear
    /// [`GraphIndex`]: graphed_callables::GraphIndex
    pub fn with_step_gradients(mut self, on: bool) -> MoeLayer {
        self.step_gradients = on;
        self
    }

    /// This layer with fast accumulation in its forward GEMMs (fc1 and fc2:
    /// [`GemmOptions::fast_accumulation`], TransformerEngine's default for forward GEMMs) on
    /// or off; default on. The data- and weight-gradient GEMMs always promote their sums to
    /// f32 per 128-deep block, as TransformerEngine's do.
    pub fn with_fast_forward_accumulation(mut self, on: bool) -> MoeLayer {
        self.fast_forward = on;
        self
    }

    /// This layer with the experts' weight-gradient GEMMs (dW2, then dW1) in the backward on
    /// a side stream beside the data-gradient chain (fc2's dgrad, the SwiGLU backward, fc1's
    /// dgrad, dx and the router's gradients), on `sms` of the device's SMs while the data
    /// gradients' GEMMs take the others ([`GemmOptions::max_sms`]); `None` runs them after
    /// the data gradients on the caller's stream, each GEMM on every SM. Grouped experts
    /// only (the per-expert mode ignores it), and only where the backward computes the
    /// weight gradients (not in a split [`Callable::backward_weight`]). The results are the
    /// same bits either way; only the speed changes. `sms` is clamped to leave at least one
    /// SM to each side. Default: half the SMs for f32 weight gradients where each expert
    /// expects at least 512 rows (the shapes where it was measured faster), `None` otherwise.
    pub fn with_weight_grads_beside(mut self, sms: Option<usize>) -> MoeLayer {
        self.wgrad_sms = sms;
        self
    }

    /// This layer with dx and the router weight's gradient in the backward on `sms` SMs beside
    /// the experts' weight-gradient GEMMs (dW2, dW1), which take the other SMs
    /// ([`GemmOptions::max_sms`]); `None` runs them after the weight gradients, the router
    /// weight's gradient beside dx. These router kernels are small and bound by their
    /// latency, so on a few SMs they can end before the weight gradients, which then lose
    /// only those SMs. Grouped experts whose weight gradients run after the data gradients
    /// (not [beside](Self::with_weight_grads_beside) them), in a backward that computes the
    /// weight gradients (not a split [`Callable::backward_weight`]); ignored elsewhere. The
    /// results are the same bits either way; only the speed changes. `sms` is clamped to leave
    /// at least one SM to the weight gradients. Default: 8 SMs where `T * (E + k) <= 4096`
    /// (T = 256 at 8 experts top-2, where it was measured faster), `None` otherwise.
    pub fn with_router_grads_beside(mut self, sms: Option<usize>) -> MoeLayer {
        self.router_sms = sms;
        self
    }

    /// This layer with its FP8 expert weights written by the optimizer instead of cast in the
    /// step (TransformerEngine's FP8 parameters): [`Callable::cast_weights`] enqueues nothing,
    /// so no forward casts the weights and no forward graph holds a cast, and a
    /// [`MoeAdamW`](super::optim::MoeAdamW) made for this layer ends each expert weight's
    /// update with its FP8 cast, fused ([`AdamWState::update_cast_transpose_batched`]): the
    /// same bytes, scales and amaxes the step's cast would write from the updated weights.
    /// The current weights are cast once now, eagerly, with the scales the scaling state
    /// holds (waits; not during a capture).
    ///
    /// The bf16 weights ([`fc1`](Self::fc1), [`fc2`](Self::fc2)) are then the ones the layer
    /// was built with: the optimizer keeps the f32 master weights
    /// ([`MoeAdamW::master_fc1`](super::optim::MoeAdamW::master_fc1)) and writes only FP8.
    /// Something else that updates the bf16 weights must cast them itself (switch the mode
    /// off with `false`, which casts nothing now). Optimizers made for this layer earlier
    /// follow the new mode from their next step.
    ///
    /// [`AdamWState::update_cast_transpose_batched`]: fp8_kernels::AdamWState::update_cast_transpose_batched
    pub fn with_fp8_weights_from_optimizer(self, stream: &Stream, on: bool) -> Result<MoeLayer> {
        if on {
            for ew in self.expert_weights()? {
                cast_transpose_batched(stream, &ew.w, ew.shape, &ew.cast_out(), None)?;
            }
            stream.synchronize()?;
        }
        self.optimizer_casts.store(on, Ordering::Release);
        Ok(self)
    }

    /// Whether the optimizer writes the FP8 expert weights
    /// ([`with_fp8_weights_from_optimizer`](Self::with_fp8_weights_from_optimizer)).
    pub fn fp8_weights_from_optimizer(&self) -> bool {
        self.optimizer_casts.load(Ordering::Acquire)
    }

    /// The mode flag itself, shared with the optimizers of this layer (the mode may change
    /// after they were made).
    pub(crate) fn optimizer_casts_flag(&self) -> Arc<AtomicBool> {
        self.optimizer_casts.clone()
    }

    /// fc1's and fc2's weights as an optimizer sees them (handles sharing the layer's
    /// memory).
    pub(crate) fn expert_weights(&self) -> Result<[ExpertWeight; 2]> {
        let (e, h, f) = (self.cfg.experts, self.cfg.hidden, self.cfg.ffn);
        let weight = |w: &DeviceBuffer<bf16>,
                      grad: &WeightGrad,
                      (q, t): (&DeviceBuffer<u8>, &DeviceBuffer<u8>),
                      (rows, cols): (usize, usize),
                      first: usize|
         -> Result<ExpertWeight> {
            let tensor = self.first_tensor + first;
            Ok(ExpertWeight {
                w: w.share(),
                grad: grad.share(),
                shape: (e, rows, cols),
                q: q.share(),
                t: t.share(),
                scale: self.scaling.scale_slots(tensor)?,
                scale_inv: ScalarSlots::new(DeviceScalar::at(&self.w_si, first - ACTIVATIONS)?, 1),
                amax: self.scaling.amax_slots(tensor)?,
            })
        };
        Ok([
            weight(
                &self.w1,
                &self.dw1,
                (&self.w1_q, &self.w1_t),
                (2 * f, h),
                w1_tensor(0),
            )?,
            weight(
                &self.w2,
                &self.dw2,
                (&self.w2_q, &self.w2_t),
                (h, f),
                w2_tensor(e, 0),
            )?,
        ])
    }

    /// Casts each expert's W1 and W2 to E4M3 ([`Callable::cast_weights`]; skipped on the
    /// device when `noop` reads 1.0).
    pub(crate) fn cast_expert_weights(
        &self,
        stream: &Stream,
        noop: Option<&DeviceScalar>,
    ) -> Result<()> {
        for ew in self.expert_weights()? {
            cast_transpose_batched(stream, &ew.w, ew.shape, &ew.cast_out(), noop)?;
        }
        Ok(())
    }

    /// fc1's data gradient in the packed layout (`[C, H]` bf16, a buffer of the pass), written
    /// by [`experts_backward`](Self::experts_backward).
    pub(crate) fn packed_input_grad(&self) -> &DeviceBuffer<bf16> {
        &self.dxp
    }

    /// The router weight and its gradient as an optimizer sees them (shared handles).
    pub(crate) fn router_params(&self) -> (DeviceBuffer<f32>, DeviceBuffer<f32>) {
        (self.wr.share(), self.dwr.share())
    }

    /// Whether the weight-gradient pass of `slot` adds to the gradients (otherwise it writes
    /// them: microbatch 0 with [`with_step_gradients`](Self::with_step_gradients)).
    pub(crate) fn accumulate_grads(&self, slot: &Slot<'_, bf16>) -> bool {
        !(self.step_gradients && slot.at().microbatch == 0)
    }

    /// The path of the grouped GEMMs: `Auto` resolved to the sm_90a kernels on Hopper.
    fn grouped_path(&self) -> GemmPath {
        match self.path {
            GemmPath::Auto if self.hopper => GemmPath::Hopper,
            p => p,
        }
    }

    /// The configuration.
    pub fn config(&self) -> MoeLayerConfig {
        self.cfg
    }

    /// The router weight `[E, H]` f32 and its gradient.
    pub fn router_weight(&self) -> (&DeviceBuffer<f32>, &DeviceBuffer<f32>) {
        (&self.wr, &self.dwr)
    }

    /// fc1's weights `[E, 2F, H]` bf16 and their gradient ([`GradDtype`]).
    pub fn fc1(&self) -> (&DeviceBuffer<bf16>, &WeightGrad) {
        (&self.w1, &self.dw1)
    }

    /// fc2's weights `[E, H, F]` bf16 and their gradient ([`GradDtype`]).
    pub fn fc2(&self) -> (&DeviceBuffer<bf16>, &WeightGrad) {
        (&self.w2, &self.dw2)
    }

    /// The routing of a microbatch, as views of its saved buffers (read its losses, counts
    /// or plan after a forward).
    pub fn routing_of(&self, saved: &DeviceBuffer<u8>) -> Result<RoutingBuffers> {
        RoutingBuffers::from_bytes(self.cfg.routing_dims(), saved)
    }

    fn saved<'a>(&self, slot: &Slot<'a, bf16>) -> Result<Saved<'a>> {
        self.saved_from(slot.saved(), &slot.at())
    }

    /// The saved buffers `s` (of a microbatch at `at`) as views.
    pub(crate) fn saved_from<'a>(
        &self,
        s: &[&'a DeviceBuffer<u8>],
        at: &dyn std::fmt::Display,
    ) -> Result<Saved<'a>> {
        let want = self.cfg.saved_bytes()?;
        if s.len() != want.len() || s.iter().zip(&want).any(|(b, &w)| b.len() < w) {
            return Err(Error::InvalidArgument(format!(
                "MoeLayer at {at}: saved buffers of {:?} bytes, the layer needs {want:?}",
                s.iter().map(|b| b.len()).collect::<Vec<_>>()
            )));
        }
        let (c, h, f) = (self.cfg.capacity(), self.cfg.hidden, self.cfg.ffn);
        let si = s[5].slice(..16)?.reinterpret::<f32>()?;
        Ok(Saved {
            routing: RoutingBuffers::from_bytes(self.cfg.routing_dims(), s[0])?,
            x_t: s[1],
            a: s[2].slice(..c * 2 * f * 2)?.reinterpret()?,
            h_t: s[3],
            y: s[4].slice(..c * h * 2)?.reinterpret()?,
            si: [
                DeviceScalar::at(&si, 0)?,
                DeviceScalar::at(&si, 1)?,
                DeviceScalar::at(&si, 2)?,
                DeviceScalar::at(&si, 3)?,
            ],
            dy_t: s[6],
            da_t: s[7],
        })
    }

    fn tensor(
        &self,
        data: &DeviceBuffer<u8>,
        shape: &[usize],
        t: usize,
        si: &DeviceScalar,
    ) -> Result<Fp8Tensor> {
        let ft = self.first_tensor + t;
        Fp8Tensor::from_parts(
            data.share(),
            shape,
            activation_format(self.cfg.recipe, t),
            self.scaling.scale(ft)?,
            si.clone(),
            self.scaling.amax(ft)?,
        )
    }

    /// fc1's per-expert scale_inv (`E` values).
    fn w1_scales(&self) -> Result<DeviceBuffer<f32>> {
        self.w_si.slice(..self.cfg.experts)
    }

    /// fc2's per-expert scale_inv (`E` values).
    fn w2_scales(&self) -> Result<DeviceBuffer<f32>> {
        self.w_si.slice(self.cfg.experts..)
    }

    /// A fused cast's output with the layer's scaling of activations and gradients.
    fn cast<'a>(&self, out: &'a Fp8Tensor, out_t: &'a DeviceBuffer<u8>) -> FusedCastOut<'a> {
        FusedCastOut::new(out, out_t).scaling(self.cfg.scaling)
    }

    fn check_io<'a>(
        &self,
        what: &str,
        a: &[&'a DeviceBuffer<bf16>],
        b: &[&'a DeviceBuffer<bf16>],
    ) -> Result<(&'a DeviceBuffer<bf16>, &'a DeviceBuffer<bf16>)> {
        let n = self.cfg.tokens * self.cfg.hidden;
        match (a, b) {
            ([a], [b]) if a.len() == n && b.len() == n => Ok((a, b)),
            _ => Err(Error::InvalidArgument(format!(
                "MoeLayer {what}: takes one buffer each way of {n} elements, got {:?} and {:?}",
                a.iter().map(|x| x.len()).collect::<Vec<_>>(),
                b.iter().map(|x| x.len()).collect::<Vec<_>>()
            ))),
        }
    }

    /// One of the expert GEMMs over the packed rows: `D[rows of e] = A[rows of e] .
    /// B[e]^T` for every expert, A `[C, k]`, B `[E, n, k]` (E4M3, expert `e` scaled by
    /// `b_scales[e]`), D `[C, n]` bf16. Grouped: one launch on the device offsets; per
    /// expert: the offsets read back (`host_offsets`).
    #[allow(clippy::too_many_arguments)] // the GEMM's operands
    fn experts_gemm(
        &self,
        stream: &Stream,
        routing: &RoutingBuffers,
        host_offsets: Option<&[i32]>,
        (n, k): (usize, usize),
        a: Operand<'_>,
        (b, b_scales): (&DeviceBuffer<u8>, &DeviceBuffer<f32>),
        (d, fast, max_sms): (&DeviceBuffer<bf16>, bool, Option<usize>),
    ) -> Result<()> {
        let (groups, capacity) = (self.cfg.experts, self.cfg.capacity());
        let Some(off) = host_offsets else {
            let mut opts = self.packed_options(fast);
            opts.max_sms = max_sms;
            let shape = PackedShape {
                groups,
                capacity,
                n,
                k,
            };
            let b = GroupedOperand::per_group(b, Fp8Format::E4M3, b_scales);
            return grouped_gemm_packed(stream, shape, a, b, d, &routing.offsets, opts);
        };
        for e in 0..groups {
            let (r0, r1) = (off[e] as usize, off[e + 1] as usize);
            if r1 <= r0 {
                continue;
            }
            let rows = r1 - r0;
            let a_e = a.data.slice(r0 * k..r1 * k)?;
            let b_e = b.slice(e * n * k..(e + 1) * n * k)?;
            let si_e = DeviceScalar::at(b_scales, e)?;
            let d_e = d.slice(r0 * n..r1 * n)?;
            gemm(
                stream,
                GemmShape::new(rows, n, k),
                Operand { data: &a_e, ..a },
                Operand {
                    data: &b_e,
                    format: Fp8Format::E4M3,
                    scale_inv: &si_e,
                },
                &d_e,
                // K unsplit: the grouped kernel's sums, so both modes give the same bits.
                GemmOptions::new()
                    .path(self.path)
                    .fast_accumulation(fast)
                    .whole_k(true),
            )?;
        }
        Ok(())
    }

    /// Whether fc1 takes the SwiGLU cast into its epilogue ([`grouped_gemm_packed_swiglu`]):
    /// where its tiles (the expected rows in 128-row tiles by 2F in 256 columns) are more than
    /// one wave of the SMs. The fused epilogue lengthens each tile (the cast's compute and
    /// stores come after D's, on the tile's critical path) and saves the SwiGLU kernel: on an
    /// H200, T = 4096 (1088 tiles) the forward 0.281-0.284 ms against 0.293-0.301 with the two
    /// kernels; T = 256 (128 tiles, one each) fc1 alone 38.2 us fused against 28.5 + 5.8.
    fn fuse_swiglu(&self) -> bool {
        let rows = self.cfg.routing_dims().expected_rows();
        let tiles = rows.div_ceil(ALIGN_ROWS) * (2 * self.cfg.ffn).div_ceil(256);
        tiles > self.sms
    }

    /// The options of the grouped kernels over the packed rows (`fast`: fast accumulation).
    fn packed_options(&self, fast: bool) -> GemmOptions<'static> {
        GemmOptions::new()
            .path(self.grouped_path())
            .expected_rows(self.cfg.routing_dims().expected_rows())
            .fast_accumulation(fast)
    }

    /// A weight gradient of every expert: `D[e] (+)= A[:, rows of e] . B[:, rows of e]^T`
    /// (added with `accumulate`, else written: an expert without rows gets zeros), A
    /// `[m, C]`, B `[n, C]` (the transposed packed copies), D `[E, m, n]` f32. Per expert:
    /// the grouped kernel on one expert's two offsets, for the experts with rows.
    #[allow(clippy::too_many_arguments)] // the GEMM's operands
    fn experts_wgrad(
        &self,
        stream: &Stream,
        routing: &RoutingBuffers,
        host_offsets: Option<&[i32]>,
        (m, n): (usize, usize),
        a: Operand<'_>,
        b: Operand<'_>,
        (d, accumulate): (&WeightGrad, bool),
        max_sms: Option<usize>,
    ) -> Result<()> {
        let capacity = self.cfg.capacity();
        let mut opts = GemmOptions::new()
            .path(self.grouped_path())
            .accumulate(accumulate);
        opts.max_sms = max_sms;
        let Some(off) = host_offsets else {
            let shape = WgradShape {
                groups: self.cfg.experts,
                capacity,
                m,
                n,
            };
            return d.with_out(None, |d| {
                grouped_gemm_wgrad(stream, shape, a, b, d, &routing.offsets, opts)
            });
        };
        for e in 0..self.cfg.experts {
            let range = e * m * n..(e + 1) * m * n;
            if off[e + 1] <= off[e] {
                if !accumulate {
                    d.zero_range(stream, Some(range))?;
                }
                continue;
            }
            let shape = WgradShape {
                groups: 1,
                capacity,
                m,
                n,
            };
            let off_e = routing.offsets.slice(e..e + 2)?;
            d.with_out(Some(range), |d_e| {
                grouped_gemm_wgrad(stream, shape, a, b, d_e, &off_e, opts)
            })?;
        }
        Ok(())
    }

    /// The offsets read back, when the experts run per expert (waits for `stream`).
    fn host_offsets(&self, stream: &Stream, routing: &RoutingBuffers) -> Result<Option<Vec<i32>>> {
        match self.cfg.expert_gemm {
            ExpertGemm::Grouped => Ok(None),
            ExpertGemm::PerExpert => routing.offsets.to_vec(stream).map(Some),
        }
    }

    /// Forward part 1: router, plan, permute fused with x's cast.
    fn route(&self, stream: &Stream, x: &DeviceBuffer<bf16>, s: &Saved<'_>) -> Result<()> {
        self.router.forward(stream, x, &self.wr, &s.routing)?;
        self.permute(stream, x, s)
    }

    /// The dispatch of an expert-parallel rank's experts ([`super::ep`]): the plan from the
    /// experts already in `s.routing.topk` (this layer's experts numbered from 0, another
    /// rank's out of range and not placed), then the permute fused with x's cast, `x` being
    /// every rank's tokens (`[T, H]` with this layer's `T`).
    pub(crate) fn dispatch_planned(
        &self,
        stream: &Stream,
        x: &DeviceBuffer<bf16>,
        s: &Saved<'_>,
    ) -> Result<()> {
        self.router.plan(stream, &s.routing)?;
        self.permute(stream, x, s)
    }

    /// The permute of `x` into the packed layout of `s.routing`, fused with x's cast.
    fn permute(&self, stream: &Stream, x: &DeviceBuffer<bf16>, s: &Saved<'_>) -> Result<()> {
        let (t, h) = (self.cfg.tokens, self.cfg.hidden);
        let x_fp8 = self.tensor(&self.xq, &[self.cfg.capacity(), h], X, &s.si[0])?;
        let gather = Gather {
            token_of_row: &s.routing.token_of_row,
            top_k: self.cfg.router.top_k,
            row_scale: None,
        };
        let used = RowsInUse::last(&s.routing.offsets)?;
        gather_cast_transpose(stream, x, (t, h), gather, used, self.cast(&x_fp8, s.x_t))
    }

    /// Forward part 2: fc1, SwiGLU + cast, fc2.
    pub(crate) fn experts_forward(&self, stream: &Stream, s: &Saved<'_>) -> Result<()> {
        let (c, h, f) = (self.cfg.capacity(), self.cfg.hidden, self.cfg.ffn);
        let host = self.host_offsets(stream, &s.routing)?;
        let e4 = Fp8Format::E4M3;
        let x = Operand {
            data: &self.xq,
            format: e4,
            scale_inv: &s.si[0],
        };
        let h_fp8 = self.tensor(&self.hq, &[c, f], HID, &s.si[1])?;
        if host.is_none() && self.fuse_swiglu() {
            // fc1 with the SwiGLU cast in its epilogue (one kernel on the sm_90a path; the
            // same bits as the two kernels below).
            let shape = PackedShape {
                groups: self.cfg.experts,
                capacity: c,
                n: 2 * f,
                k: h,
            };
            let w1_scales = self.w1_scales()?;
            let w1 = GroupedOperand::per_group(&self.w1_q, e4, &w1_scales);
            grouped_gemm_packed_swiglu(
                stream,
                shape,
                x,
                w1,
                &s.a,
                &s.routing.offsets,
                self.packed_options(self.fast_forward),
                self.cast(&h_fp8, s.h_t),
            )?;
        } else {
            self.experts_gemm(
                stream,
                &s.routing,
                host.as_deref(),
                (2 * f, h),
                x,
                (&self.w1_q, &self.w1_scales()?),
                (&s.a, self.fast_forward, None),
            )?;
            // The padding rows (zeros) are not read.
            let used = RowsInUse::last(&s.routing.offsets)?.padding(&s.routing.token_of_row);
            swiglu_cast_transpose(stream, &s.a, (c, f), used, self.cast(&h_fp8, s.h_t))?;
        }
        self.experts_gemm(
            stream,
            &s.routing,
            host.as_deref(),
            (h, f),
            Operand {
                data: &self.hq,
                format: e4,
                scale_inv: &s.si[1],
            },
            (&self.w2_q, &self.w2_scales()?),
            (&s.y, self.fast_forward, None),
        )
    }

    /// Backward part 1: the gates' and the router logits' gradients and dY's cast into the
    /// packed layout.
    fn combine_backward(
        &self,
        stream: &Stream,
        dy: &DeviceBuffer<bf16>,
        s: &Saved<'_>,
    ) -> Result<()> {
        // dY's cast (which scales by the forward's gates), then the gates' and logits'
        // gradients (read by part 3 only) beside it: they read and write nothing the cast
        // does, so they start while it runs and wait for it only at their end. One stream:
        // run beside the cast on a second one, the gradients held SMs that the next GEMM's
        // persistent CTAs then started late on (T = 256, f32 weight gradients: 0.276-0.280
        // ms a step against 0.267-0.268 in one stream; docs/perf-notes.md).
        self.cast_output_grad(stream, dy, &s.routing.gates, s)?;
        self.router
            .combine_backward_beside_previous(stream, dy, &s.y, &s.routing)
    }

    /// dY (`[T, H]`) into the packed layout, each row scaled by its assignment's gate in
    /// `gates` (`[T, k]`), fused with its cast to the gradient format.
    pub(crate) fn cast_output_grad(
        &self,
        stream: &Stream,
        dy: &DeviceBuffer<bf16>,
        gates: &DeviceBuffer<f32>,
        s: &Saved<'_>,
    ) -> Result<()> {
        let (t, h) = (self.cfg.tokens, self.cfg.hidden);
        let dy_fp8 = self.tensor(&self.dyq, &[self.cfg.capacity(), h], DY, &s.si[2])?;
        let gather = Gather {
            token_of_row: &s.routing.token_of_row,
            top_k: self.cfg.router.top_k,
            row_scale: Some(gates),
        };
        let used = RowsInUse::last(&s.routing.offsets)?;
        gather_cast_transpose(stream, dy, (t, h), gather, used, self.cast(&dy_fp8, s.dy_t))
    }

    /// The SMs of the weight gradients and of the data gradients' GEMMs when the backward
    /// with weight gradients (`weights`) runs them beside each other
    /// ([`with_weight_grads_beside`](Self::with_weight_grads_beside)); `None` otherwise.
    fn beside_split(&self, weights: bool) -> Option<(usize, usize)> {
        self.split_sms(self.wgrad_sms.filter(|_| weights))
    }

    /// `sms` SMs (clamped to leave at least one) for work beside a GEMM and the rest for the
    /// GEMM; `None` without `sms`, for per-expert GEMMs (no persistent grid to cap) or on a
    /// device of one SM.
    fn split_sms(&self, sms: Option<usize>) -> Option<(usize, usize)> {
        let w = sms?;
        if self.cfg.expert_gemm != ExpertGemm::Grouped || self.sms < 2 {
            return None;
        }
        let w = w.clamp(1, self.sms - 1);
        Some((w, self.sms - w))
    }

    /// The SMs of the router's gradients and of the experts' weight gradients when a
    /// backward with weight gradients runs them beside each other
    /// ([`with_router_grads_beside`](Self::with_router_grads_beside)); `None` otherwise.
    /// Weight gradients beside the data gradients take precedence.
    fn router_split(&self) -> Option<(usize, usize)> {
        if self.beside_split(true).is_some() {
            return None;
        }
        self.split_sms(self.router_sms)
    }

    /// Makes later work on `to` wait for the work enqueued so far on `from`, through the
    /// layer's one hand-over event: a wait takes the event's latest record when it is
    /// enqueued (or captured), so recording it again for the next hand-over is safe.
    fn hand_over(&self, from: &Stream, to: &Stream) -> Result<()> {
        self.handoff.record(from)?;
        to.wait_event(&self.handoff)
    }

    /// Backward part 2: the experts' data gradients (fc2 dgrad, SwiGLU backward + casts,
    /// fc1 dgrad) and, with `weights = Some(accumulate)`, their weight gradients: after
    /// them, or beside them on the side stream ([`beside_split`](Self::beside_split)), left
    /// for [`router_backward`](Self::router_backward) to join; or, with the router's
    /// gradients beside them ([`router_split`](Self::router_split)), left to part 3.
    pub(crate) fn experts_backward(
        &self,
        stream: &Stream,
        s: &Saved<'_>,
        weights: Option<bool>,
    ) -> Result<()> {
        let (c, h, f) = (self.cfg.capacity(), self.cfg.hidden, self.cfg.ffn);
        let host = self.host_offsets(stream, &s.routing)?;
        let g = grad_format(self.cfg.recipe);
        let split = self.beside_split(weights.is_some());
        let (wgrad_sms, dgrad_sms) = (split.map(|x| x.0), split.map(|x| x.1));
        if let (Some(accumulate), Some(_)) = (weights, split) {
            // dW2 needs dY^T (part 1) and h^T (the forward): it starts with fc2's dgrad.
            self.hand_over(stream, &self.side)?;
            self.fc_wgrad(Fc::Two, &self.side, s, None, accumulate, wgrad_sms)?;
        }
        // dh = dY . W2 (B = W2^T per expert, [F, H]).
        self.experts_gemm(
            stream,
            &s.routing,
            host.as_deref(),
            (f, h),
            Operand {
                data: &self.dyq,
                format: g,
                scale_inv: &s.si[2],
            },
            (&self.w2_t, &self.w2_scales()?),
            (&self.dh, false, dgrad_sms),
        )?;
        let da_fp8 = self.tensor(&self.daq, &[c, 2 * f], DA, &s.si[3])?;
        let used = RowsInUse::last(&s.routing.offsets)?.padding(&s.routing.token_of_row);
        swiglu_backward_cast_transpose(
            stream,
            &s.a,
            &self.dh,
            (c, f),
            used,
            self.cast(&da_fp8, s.da_t),
        )?;
        if let (Some(accumulate), Some(_)) = (weights, split) {
            // dW1 needs dA^T, just written.
            self.hand_over(stream, &self.side)?;
            self.fc_wgrad(Fc::One, &self.side, s, None, accumulate, wgrad_sms)?;
        }
        // dXp = dA . W1 (B = W1^T per expert, [H, 2F]).
        self.experts_gemm(
            stream,
            &s.routing,
            host.as_deref(),
            (h, 2 * f),
            Operand {
                data: &self.daq,
                format: g,
                scale_inv: &s.si[3],
            },
            (&self.w1_t, &self.w1_scales()?),
            (&self.dxp, false, dgrad_sms),
        )?;
        match (weights, split) {
            // With the router's gradients beside them, part 3 runs them.
            (Some(accumulate), None) if self.router_split().is_none() => {
                self.experts_weight_backward(stream, s, host.as_deref(), accumulate)
            }
            _ => Ok(()),
        }
    }

    /// The experts' weight gradients from the saved transposed copies:
    /// `dW2[e] (+)= dY_e^T . h_e`, `dW1[e] (+)= dA_e^T . X_e` (added with `accumulate`).
    fn experts_weight_backward(
        &self,
        stream: &Stream,
        s: &Saved<'_>,
        host: Option<&[i32]>,
        accumulate: bool,
    ) -> Result<()> {
        self.fc_wgrad(Fc::Two, stream, s, host, accumulate, None)?;
        self.fc_wgrad(Fc::One, stream, s, host, accumulate, None)
    }

    /// The weight gradient of one expert linear, the GEMMs on at most `max_sms` SMs:
    /// `dW2[e] (+)= dY_e^T . h_e` or `dW1[e] (+)= dA_e^T . X_e`.
    fn fc_wgrad(
        &self,
        fc: Fc,
        stream: &Stream,
        s: &Saved<'_>,
        host: Option<&[i32]>,
        accumulate: bool,
        max_sms: Option<usize>,
    ) -> Result<()> {
        let (h, f) = (self.cfg.hidden, self.cfg.ffn);
        let ((m, n), (a, a_si), (b, b_si), d) = match fc {
            Fc::Two => ((h, f), (s.dy_t, &s.si[2]), (s.h_t, &s.si[1]), &self.dw2),
            Fc::One => ((2 * f, h), (s.da_t, &s.si[3]), (s.x_t, &s.si[0]), &self.dw1),
        };
        self.experts_wgrad(
            stream,
            &s.routing,
            host,
            (m, n),
            Operand {
                data: a,
                format: grad_format(self.cfg.recipe),
                scale_inv: a_si,
            },
            Operand {
                data: b,
                format: Fp8Format::E4M3,
                scale_inv: b_si,
            },
            (d, accumulate),
            max_sms,
        )
    }

    /// Backward part 3: dx (and, with `weights = Some(accumulate)`, the router weight's
    /// gradient beside it on the router's stream) from the logits' gradient of part 1, or,
    /// with the router's gradients beside the experts' weight gradients
    /// ([`router_split`](Self::router_split)), both on the router's stream beside those; then,
    /// where part 2 ran the experts' weight gradients beside, the join of their stream.
    fn router_backward(
        &self,
        stream: &Stream,
        x: &DeviceBuffer<bf16>,
        dx: &DeviceBuffer<bf16>,
        s: &Saved<'_>,
        weights: Option<bool>,
    ) -> Result<()> {
        let Some(accumulate) = weights else {
            return self
                .router
                .input_backward(stream, &self.dxp, &self.wr, &s.routing, dx);
        };
        // The router's two gradients read the logits' gradient (and dx fc1's dgrad, both
        // written before this part) and nothing the other or the experts' weight gradients
        // write, so they run beside each other and beside those.
        self.hand_over(stream, &self.router_side)?;
        let r = &self.router_side;
        if let Some((_, wgrad_sms)) = self.router_split() {
            self.router
                .input_backward(r, &self.dxp, &self.wr, &s.routing, dx)?;
            self.router
                .weight_backward(r, x, &s.routing, &self.dwr, accumulate)?;
            self.fc_wgrad(Fc::Two, stream, s, None, accumulate, Some(wgrad_sms))?;
            self.fc_wgrad(Fc::One, stream, s, None, accumulate, Some(wgrad_sms))?;
        } else {
            self.router
                .weight_backward(r, x, &s.routing, &self.dwr, accumulate)?;
            self.router
                .input_backward(stream, &self.dxp, &self.wr, &s.routing, dx)?;
        }
        self.hand_over(r, stream)?;
        if self.beside_split(true).is_some() {
            self.hand_over(&self.side, stream)?;
        }
        Ok(())
    }

    /// In a warmup pass, reports the weight tensors of the experts that got tokens (reads
    /// the counts back: warmup is eager). Captures and replays report nothing.
    pub(crate) fn record_routed_weights(
        &self,
        stream: &Stream,
        s: &Saved<'_>,
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        if !slot.is_warmup() {
            return Ok(());
        }
        let counts = s.routing.counts.to_vec(stream)?;
        let e_n = self.cfg.experts;
        let routed = counts
            .iter()
            .enumerate()
            .filter(|&(_, &c)| c > 0)
            .flat_map(|(e, _)| [w1_tensor(e), w2_tensor(e_n, e)])
            .map(|t| self.first_tensor + t);
        slot.record_tensors(routed);
        Ok(())
    }

    /// Part `part` of the forward: 0 router + permute (and, in warmup, the routed experts'
    /// weight tensors reported), 1 the experts, 2 the combine. The per-expert mode's segments
    /// are these parts; the grouped mode runs all three as one.
    fn forward_part(
        &self,
        part: usize,
        stream: &Stream,
        inputs: &[&DeviceBuffer<bf16>],
        outputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        self.fp8_only(slot)?;
        let (x, out) = self.check_io("forward", inputs, outputs)?;
        let s = self.saved(slot)?;
        match part {
            0 => {
                self.record_activation_tensors(slot);
                self.route(stream, x, &s)?;
                self.record_routed_weights(stream, &s, slot)
            }
            1 => {
                // The router and the permute above ran beside the weight casts.
                slot.wait_weight_cast(stream)?;
                self.experts_forward(stream, &s)
            }
            2 => self.router.combine(stream, &s.y, &s.routing, out),
            _ => Err(self.not_a_segment(slot, "forward", part, "a part")),
        }
    }

    /// Part `part` of the backward: 0 the gates' and logits' gradients and dY's cast, 1 the
    /// experts, 2 dx; with `weights`, parts 1 and 2 also compute their weight gradients
    /// (without, [`Callable::backward_weight`] does it later).
    fn backward_part(
        &self,
        part: usize,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<bf16>],
        grad_inputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
        weights: bool,
    ) -> Result<()> {
        self.fp8_only(slot)?;
        let (dy, dx) = self.check_io("backward", grad_outputs, grad_inputs)?;
        let s = self.saved(slot)?;
        match part {
            0 => {
                self.record_gradient_tensors(slot);
                self.combine_backward(stream, dy, &s)
            }
            1 => self.experts_backward(stream, &s, weights.then(|| self.accumulate_grads(slot))),
            2 => {
                let w = weights.then(|| self.accumulate_grads(slot));
                self.router_backward(stream, self.forward_input(slot)?, dx, &s, w)
            }
            _ => Err(self.not_a_segment(slot, "backward", part, "a part")),
        }
    }

    /// The error for a segment (or part) the layer does not have in its mode.
    fn not_a_segment(
        &self,
        slot: &Slot<'_, bf16>,
        pass: &str,
        segment: usize,
        what: &str,
    ) -> Error {
        Error::InvalidArgument(format!(
            "MoeLayer at {} ({:?}): {pass} segment {segment} is not {what}",
            slot.at(),
            self.cfg.expert_gemm
        ))
    }

    /// Reports the activation tensors the forward casts (x, h) to warmup's recorder.
    pub(crate) fn record_activation_tensors(&self, slot: &Slot<'_, bf16>) {
        slot.record_tensors([self.first_tensor + X, self.first_tensor + HID]);
    }

    /// Reports the gradient tensors the backward casts (dY, dA).
    pub(crate) fn record_gradient_tensors(&self, slot: &Slot<'_, bf16>) {
        slot.record_tensors([self.first_tensor + DY, self.first_tensor + DA]);
    }

    pub(crate) fn fp8_only(&self, slot: &Slot<'_, bf16>) -> Result<()> {
        if slot.low_precision() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "MoeLayer at {}: has no high-precision path (FP8 is off for it)",
                slot.at()
            )))
        }
    }

    fn grouped_only(&self, slot: &Slot<'_, bf16>, what: &str) -> Result<()> {
        if self.cfg.expert_gemm == ExpertGemm::Grouped {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "MoeLayer at {}: {what} need the full-layer mode (ExpertGemm::Grouped)",
                slot.at()
            )))
        }
    }

    fn forward_input<'a>(&self, slot: &Slot<'a, bf16>) -> Result<&'a DeviceBuffer<bf16>> {
        match slot.inputs() {
            [x] => Ok(x),
            i => Err(Error::InvalidArgument(format!(
                "MoeLayer at {}: the slot has {} forward inputs, the layer one",
                slot.at(),
                i.len()
            ))),
        }
    }
}

impl Callable<bf16> for MoeLayer {
    fn input_lens(&self) -> Vec<usize> {
        vec![self.cfg.tokens * self.cfg.hidden]
    }

    fn output_lens(&self) -> Vec<usize> {
        vec![self.cfg.tokens * self.cfg.hidden]
    }

    fn saved_bytes(&self) -> Vec<usize> {
        // Checked at construction, so this cannot fail.
        self.cfg.saved_bytes().unwrap_or_default()
    }

    /// Casts each expert's W1 and W2 to E4M3, row-major and transposed: one batched
    /// cast-transpose per weight over all experts, each expert with its own scale, scale_inv
    /// and amax (consecutive tensors of the delayed-scaling state); skipped on the device when
    /// the slot's noop flag reads 1.0. The weight tensors are reported by the forward, for the
    /// experts that got tokens. Nothing when the optimizer writes the FP8 weights
    /// ([`MoeLayer::with_fp8_weights_from_optimizer`]).
    fn cast_weights(&mut self, stream: &Stream, slot: &Slot<'_, bf16>) -> Result<()> {
        if self.fp8_weights_from_optimizer() {
            return Ok(());
        }
        let noop = slot
            .skip_weight_cast()
            .map(|f| DeviceScalar::at(f, 0))
            .transpose()?;
        self.cast_expert_weights(stream, noop.as_ref())
    }

    /// Yes: the router, the dispatch plan and the permute (forward part 0) read neither
    /// the cast weights nor their scales, so in a capture they run beside the casts and the
    /// experts wait for them.
    fn overlaps_weight_cast(&self) -> bool {
        true
    }

    /// The whole pass eagerly: router + permute, experts, combine.
    fn forward(
        &mut self,
        stream: &Stream,
        inputs: &[&DeviceBuffer<bf16>],
        outputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        (0..PARTS).try_for_each(|p| self.forward_part(p, stream, inputs, outputs, slot))
    }

    /// The whole pass eagerly: gates' gradient + dY cast, experts, router backward.
    fn backward(
        &mut self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<bf16>],
        grad_inputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        (0..PARTS)
            .try_for_each(|p| self.backward_part(p, stream, grad_outputs, grad_inputs, slot, true))
    }

    /// The data-gradient half (split weight gradients; full-layer mode only: the runtime
    /// needs a single-segment backward for them): gates' gradient, dY's cast, the experts'
    /// dgrads, the router backward and dx. The weight gradients' inputs stay in the saved
    /// buffers.
    fn backward_input(
        &mut self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<bf16>],
        grad_inputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        self.grouped_only(slot, "split weight gradients")?;
        (0..PARTS)
            .try_for_each(|p| self.backward_part(p, stream, grad_outputs, grad_inputs, slot, false))
    }

    /// The weight-gradient half: the experts' and the router's weight gradients from the
    /// saved buffers (the routing's d_logits, the transposed FP8 copies).
    fn backward_weight(
        &mut self,
        stream: &Stream,
        _grad_outputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        self.fp8_only(slot)?;
        self.grouped_only(slot, "split weight gradients")?;
        let s = self.saved(slot)?;
        let x = self.forward_input(slot)?;
        let accumulate = self.accumulate_grads(slot);
        self.experts_weight_backward(stream, &s, None, accumulate)?;
        self.router
            .weight_backward(stream, x, &s.routing, &self.dwr, accumulate)
    }

    /// Grouped: one graphed segment. Per expert: `[Graphed, Eager, Graphed]` (router +
    /// permute, experts, combine).
    fn forward_segments(&self) -> Vec<SegmentKind> {
        match self.cfg.expert_gemm {
            ExpertGemm::Grouped => vec![SegmentKind::Graphed],
            ExpertGemm::PerExpert => {
                vec![
                    SegmentKind::Graphed,
                    SegmentKind::Eager,
                    SegmentKind::Graphed,
                ]
            }
        }
    }

    /// Like [`forward_segments`](Callable::forward_segments): gates' gradient + dY cast,
    /// experts, router backward.
    fn backward_segments(&self) -> Vec<SegmentKind> {
        self.forward_segments()
    }

    /// Grouped: segment 0 is the whole forward. Per expert: segments 0 (router + permute) and
    /// 2 (combine).
    fn forward_segment(
        &mut self,
        segment: usize,
        stream: &Stream,
        inputs: &[&DeviceBuffer<bf16>],
        outputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        match (self.cfg.expert_gemm, segment) {
            (ExpertGemm::Grouped, 0) => self.forward(stream, inputs, outputs, slot),
            (ExpertGemm::PerExpert, 0 | 2) => {
                self.forward_part(segment, stream, inputs, outputs, slot)
            }
            _ => Err(self.not_a_segment(slot, "forward", segment, "graphed")),
        }
    }

    /// Per expert: segment 1, the experts (reads the offsets back).
    fn forward_eager(
        &self,
        segment: usize,
        stream: &Stream,
        inputs: &[&DeviceBuffer<bf16>],
        outputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        match (self.cfg.expert_gemm, segment) {
            (ExpertGemm::PerExpert, 1) => self.forward_part(1, stream, inputs, outputs, slot),
            _ => Err(self.not_a_segment(slot, "forward", segment, "eager")),
        }
    }

    /// Like [`forward_segment`](Callable::forward_segment): segment 0 (gates' gradient + dY
    /// cast, or the whole backward) and 2 (router backward).
    fn backward_segment(
        &mut self,
        segment: usize,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<bf16>],
        grad_inputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        match (self.cfg.expert_gemm, segment) {
            (ExpertGemm::Grouped, 0) => self.backward(stream, grad_outputs, grad_inputs, slot),
            (ExpertGemm::PerExpert, 0 | 2) => {
                self.backward_part(segment, stream, grad_outputs, grad_inputs, slot, true)
            }
            _ => Err(self.not_a_segment(slot, "backward", segment, "graphed")),
        }
    }

    /// Per expert: segment 1, the experts' backward.
    fn backward_eager(
        &self,
        segment: usize,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<bf16>],
        grad_inputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        match (self.cfg.expert_gemm, segment) {
            (ExpertGemm::PerExpert, 1) => {
                self.backward_part(1, stream, grad_outputs, grad_inputs, slot, true)
            }
            _ => Err(self.not_a_segment(slot, "backward", segment, "eager")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::routing::ScoreFn;

    fn cfg() -> MoeLayerConfig {
        MoeLayerConfig {
            tokens: 256,
            hidden: 2048,
            ffn: 2048,
            experts: 8,
            router: RouterConfig {
                top_k: 2,
                score: ScoreFn::Softmax,
                renormalize: false,
                aux_coef: 0.01,
                z_coef: 0.0,
            },
            recipe: Fp8Recipe::Hybrid,
            expert_gemm: ExpertGemm::Grouped,
            scaling: CastScaling::Delayed,
            grad_dtype: GradDtype::F32,
        }
    }

    #[test]
    fn router_grads_beside_by_default_only_for_a_small_router() {
        assert_eq!(default_router_sms(&cfg(), 132), Some(ROUTER_BESIDE_SMS));
        // No room beside them on a small device.
        assert_eq!(default_router_sms(&cfg(), 16), None);
        let big = MoeLayerConfig {
            tokens: 4096,
            ..cfg()
        };
        for other in [
            big,
            MoeLayerConfig {
                grad_dtype: GradDtype::Bf16,
                ..big
            },
            MoeLayerConfig {
                expert_gemm: ExpertGemm::PerExpert,
                ..cfg()
            },
            MoeLayerConfig {
                experts: 256,
                ffn: 256,
                router: RouterConfig {
                    top_k: 8,
                    ..cfg().router
                },
                ..cfg()
            },
        ] {
            assert_eq!(default_router_sms(&other, 132), None, "{other:?}");
        }
    }

    #[test]
    fn weight_grads_beside_by_default_only_for_f32_at_large_t() {
        let big = MoeLayerConfig {
            tokens: 4096,
            ..cfg()
        };
        assert_eq!(default_wgrad_sms(&big, 132), Some(66));
        assert_eq!(default_wgrad_sms(&big, 1), None);
        for other in [
            cfg(),
            MoeLayerConfig {
                grad_dtype: GradDtype::Bf16,
                ..big
            },
            MoeLayerConfig {
                expert_gemm: ExpertGemm::PerExpert,
                ..big
            },
            MoeLayerConfig {
                experts: 256,
                ffn: 256,
                router: RouterConfig {
                    top_k: 8,
                    ..big.router
                },
                ..big
            },
        ] {
            assert_eq!(default_wgrad_sms(&other, 132), None, "{other:?}");
        }
    }

    #[test]
    fn saved_buffers_follow_the_capacity() {
        let c = cfg();
        let cap = c.capacity();
        assert_eq!(cap, 1536);
        let s = c.saved_bytes().unwrap();
        assert_eq!(s.len(), 8);
        assert_eq!(
            &s[1..],
            &[
                2048 * cap,
                cap * 4096 * 2,
                2048 * cap,
                cap * 2048 * 2,
                16,
                2048 * cap,
                4096 * cap
            ]
        );
    }

    #[test]
    fn shapes_and_formats_are_checked() {
        let mut c = cfg();
        c.ffn = 24;
        assert!(c.check().unwrap_err().to_string().contains("ffn = 24"));
        let mut c = cfg();
        c.hidden = 0;
        assert!(c.check().unwrap_err().to_string().contains("hidden"));
        let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
        assert_eq!(
            formats(Fp8Recipe::Hybrid, 2),
            vec![e4, e4, e5, e5, e4, e4, e4, e4]
        );
        assert_eq!(formats(Fp8Recipe::E4M3, 1), vec![e4; 6]);
        assert_eq!(tensors(256), 516);
        // Expert e's weights: fc1's after the four activations, fc2's after every fc1.
        assert_eq!(
            (w1_tensor(0), w1_tensor(3), w2_tensor(4, 0), w2_tensor(4, 3)),
            (4, 7, 8, 11)
        );
    }
}
