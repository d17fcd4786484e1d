//! [`Fp8Moe`]: a first FP8 mixture-of-experts layer (top-1 routing, one linear per
//! expert), **forward only**, runnable eagerly, as a breaking-layer graphed callable and as
//! a full-layer graphed callable.
//!
//! # The layer
//!
//! With `T` tokens, hidden size `H`, expert output size `F` and `E` experts
//! ([`MoeConfig`]):
//!
//! 1. **Router** (f32, a kernel of this crate, deterministic): `logits[T, E] = x[T, H] .
//!    Wr[E, H]^T`; each token goes to its top-1 expert (argmax, ties to the lowest index)
//!    with gate = the softmax probability of that expert.
//! 2. **Dispatch** (deterministic, no atomics): a one-block kernel counts tokens per expert
//!    (`counts`, int32 on the device) and gives each token its position within its expert,
//!    the number of earlier tokens routed to the same expert (token order is kept). x is
//!    quantized to E4M3 with current scaling ([`quantize_current`], one scale for the whole
//!    `[T, H]`), then its FP8 rows are scattered into the masked layout `[E, m_max, H]`
//!    (`m_max = T`: one expert may get every token). Quantizing before the scatter gives the
//!    same bytes as quantizing the scattered buffer (the cast is elementwise with one
//!    scale) and reads `T * H` instead of `E * T * H` elements. Rows at or beyond an
//!    expert's count are don't-care (stale).
//! 3. **Experts**: `h[e][r, :] = x_e[r, :] . W_e^T` for the real rows `r < counts[e]`, FP8
//!    E4M3 x E4M3 with f32 output into `[E, m_max, F]`; the expert weights `[E, F, H]` are
//!    cast once at construction with one current scale for all experts. Two ways
//!    ([`ExpertGemm`]): per-expert dense [`gemm`] calls on exactly `counts[e]` rows (the
//!    counts are read to the host: dynamic shapes, a stream synchronization), or one
//!    [`grouped_gemm`] that reads the counts on the device.
//! 4. **Combine**: `y[t, :] = gate[t] * h[expert[t]][pos[t], :]` (f32 `[T, F]`).
//!
//! # Modes
//!
//! * Eager (the reference): call [`Callable::forward`] directly with a [`Slot::new`]; with
//!   [`ExpertGemm::PerExpert`] it reads the counts to the host and runs dense GEMMs of the
//!   exact sizes.
//! * Breaking-layer ([`ExpertGemm::PerExpert`] under
//!   [`GraphedCallables`](graphed_callables::GraphedCallables)): forward segments
//!   `[Graphed: router + dispatch] [Eager: experts] [Graphed: combine]`. The eager segment
//!   runs the same per-expert GEMMs as the eager mode, so the two are bit-identical.
//! * Full-layer ([`ExpertGemm::Grouped`]): the whole forward is one graph; the experts are
//!   a grouped GEMM with device-side counts, so the graph stays right as the token
//!   distribution changes. It equals an eager run of the same layer bit for bit, and the
//!   per-expert dense path to the tensor-core bound (the two GEMM kernels may differ).
//!
//! # Backward: trivial
//!
//! This round is forward only. The graphed runtime needs a backward per callable, so the
//! backward writes zeros into the input gradient and computes no parameter gradients
//! ([`Callable::parameters`] and [`Callable::gradients`] are empty): it lets the layer sit
//! in a training schedule, nothing more.
//!
//! # Buffers across segments
//!
//! The intermediates (logits, expert, position, gate, counts, the FP8 x, the dispatched
//! rows, the expert outputs) live in the layer itself, at fixed addresses, shared by all
//! microbatches. That is enough here: a forward replay runs its three segments back to back
//! on one stream before the next forward starts, and the (trivial) backward reads none of
//! them. A real backward would need the routing per microbatch in [`Slot::saved`].

pub mod layer;
pub mod routing;

use std::sync::Arc;

use cuda_graph::{DeviceBuffer, Error, Kernel, LaunchConfig, Module, Result};
use cuda_graph::{Stream, kernel_args};
use fp8_kernels::gemm::{
    GemmOptions, GemmPath, GemmShape, GroupedShape, K_ALIGN, Operand, gemm, grouped_gemm,
};
use fp8_kernels::{Fp8Format, Fp8Tensor, quantize_current};
use graphed_callables::{Callable, SegmentKind, Slot};

pub mod reference;

/// The layer's kernels, built from `src/kernels/moe.cu`.
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/moe.fatbin"));

/// The most experts a layer may have (the dispatch kernel's shared memory holds
/// `experts * 256` counters).
pub const MAX_EXPERTS: usize = 32;
/// Threads of the router kernel (`MOE_ROUTER_BLOCK` in moe.cu).
const ROUTER_BLOCK: u32 = 256;
/// Threads of the dispatch-plan kernel (one block).
const PLAN_BLOCK: u32 = 256;
/// Threads per token of the scatter and combine kernels.
const ROW_BLOCK: u32 = 128;

/// The shape of a MoE layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeConfig {
    /// Tokens per microbatch (`T`), also the per-expert capacity `m_max`.
    pub tokens: usize,
    /// Hidden size (`H`), the experts' input features: a multiple of 16 (the GEMMs' K).
    pub hidden: usize,
    /// Expert output features (`F`): a multiple of 16.
    pub ffn: usize,
    /// Experts (`E`), 1 to [`MAX_EXPERTS`].
    pub experts: usize,
}

impl MoeConfig {
    /// Checks the shape rules: `tokens >= 1`, `hidden` and `ffn` positive multiples of 16,
    /// `1 <= experts <= MAX_EXPERTS`, `[E, T, max(H, F)]` and `[E, F, H]` within `u32`
    /// elements.
    pub fn check(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(format!("Fp8Moe: {m}")));
        if self.tokens == 0 {
            return bad("tokens must be at least 1".into());
        }
        for (name, v) in [("hidden", self.hidden), ("ffn", self.ffn)] {
            if v == 0 || v % K_ALIGN != 0 {
                return bad(format!(
                    "{name} = {v} must be a positive multiple of {K_ALIGN}"
                ));
            }
        }
        if self.experts == 0 || self.experts > MAX_EXPERTS {
            return bad(format!(
                "experts = {} must be within 1..={MAX_EXPERTS}",
                self.experts
            ));
        }
        let wide = self.hidden.max(self.ffn);
        let sizes = [
            self.experts
                .checked_mul(self.tokens)
                .and_then(|x| x.checked_mul(wide)),
            self.experts
                .checked_mul(self.ffn)
                .and_then(|x| x.checked_mul(self.hidden)),
        ];
        if sizes
            .iter()
            .any(|s| s.is_none_or(|s| s > u32::MAX as usize))
        {
            return bad(format!("{self:?} has a buffer above 2^32 elements"));
        }
        Ok(())
    }
}

/// How the experts' GEMMs run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpertGemm {
    /// The counts are read to the host and each expert with tokens gets a dense [`gemm`] of
    /// exactly its count rows. Under graphed callables: breaking-layer capture, forward
    /// segments `[Graphed, Eager, Graphed]`.
    PerExpert,
    /// One [`grouped_gemm`] reading the counts on the device. Under graphed callables:
    /// full-layer capture, the forward is one graph.
    Grouped,
}

/// The routing of one forward, read back from the device ([`Fp8Moe::routing`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// `[T, E]` router logits.
    pub logits: Vec<f32>,
    /// The chosen expert per token.
    pub expert: Vec<i32>,
    /// Each token's row within its expert (the number of earlier tokens of that expert).
    pub position: Vec<i32>,
    /// The softmax probability of the chosen expert, per token.
    pub gate: Vec<f32>,
    /// Tokens per expert.
    pub counts: Vec<i32>,
}

/// The host model of routing and dispatch: from `[T, E]` logits, each token's expert
/// (argmax by strict `>` from expert 0, so ties go to the lowest index and a NaN logit
/// wins only at index 0, exactly as the kernel does), its position within the expert,
/// and the per-expert counts. The gate is not modelled (the device's `expf` may differ
/// from the host's in the last bit).
pub fn plan_routing(logits: &[f32], experts: usize) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let mut counts = vec![0i32; experts];
    let (mut expert, mut position) = (Vec::new(), Vec::new());
    if experts == 0 {
        return (expert, position, counts);
    }
    for row in logits.chunks(experts) {
        let mut best = 0;
        for e in 1..row.len() {
            if row[e] > row[best] {
                best = e;
            }
        }
        expert.push(best as i32);
        position.push(counts[best]);
        counts[best] += 1;
    }
    (expert, position, counts)
}

/// The device buffers of the routing: `[T, E]` logits, `[T]` expert, position and gate,
/// `[E]` counts.
#[derive(Debug)]
struct RoutingBuffers {
    logits: DeviceBuffer<f32>,
    expert: DeviceBuffer<i32>,
    pos: DeviceBuffer<i32>,
    gate: DeviceBuffer<f32>,
    counts: DeviceBuffer<i32>,
}

/// A handle on a layer's routing buffers that stays valid when the layer is moved into a
/// [`GraphedCallables`](graphed_callables::GraphedCallables) (which hides its concrete
/// type): [`read`](Self::read) gives the routing of the layer's last forward.
#[derive(Debug, Clone)]
pub struct RoutingHandle(Arc<RoutingBuffers>);

impl RoutingHandle {
    /// The routing of the last forward, read back (waits for `stream`; order it after the
    /// forward, e.g. on the same stream).
    pub fn read(&self, stream: &Stream) -> Result<Routing> {
        let r = &self.0;
        Ok(Routing {
            logits: r.logits.to_vec(stream)?,
            expert: r.expert.to_vec(stream)?,
            position: r.pos.to_vec(stream)?,
            gate: r.gate.to_vec(stream)?,
            counts: r.counts.to_vec(stream)?,
        })
    }
}

/// An FP8 top-1 MoE layer over a fixed number of tokens, forward only; see the
/// [module documentation](self).
///
/// # Example: eagerly
///
/// ```no_run
/// use graphed_callables::{Callable, GraphIndex, Slot};
/// use cuda_graph::{Context, DeviceBuffer, GraphPool, Stream};
/// use fp8_moe::moe::{ExpertGemm, Fp8Moe, MoeConfig};
///
/// let ctx = Context::default_device()?;
/// let stream = Stream::new(&ctx)?;
/// let cfg = MoeConfig { tokens: 64, hidden: 128, ffn: 256, experts: 4 };
/// let wr = vec![0.01f32; 4 * 128];
/// let w = vec![0.02f32; 4 * 256 * 128];
/// let mut moe = Fp8Moe::new(&stream, cfg, &wr, &w, ExpertGemm::PerExpert)?;
/// let x = DeviceBuffer::from_host(&stream, &vec![0.5f32; 64 * 128])?;
/// let y = DeviceBuffer::<f32>::alloc(&ctx, 64 * 256)?;
/// let pool = GraphPool::new(&ctx, 256)?;
/// let at = GraphIndex { chunk: 0, microbatch: 0, layer: 0 };
/// let slot = Slot::new(at, vec![&x], vec![&y], vec![]).with_pool(&pool);
/// moe.forward(&stream, &[&x], &[&y], &slot)?;
/// let routing = moe.routing(&stream)?;
/// assert_eq!(routing.counts.iter().sum::<i32>(), 64);
/// # Ok::<(), cuda_graph::Error>(())
/// ```
pub struct Fp8Moe {
    cfg: MoeConfig,
    experts_gemm: ExpertGemm,
    path: GemmPath,
    /// `[E, H]` f32 router weights.
    wr: DeviceBuffer<f32>,
    /// `[E * F, H]` E4M3 expert weights, one current scale.
    w_fp8: Fp8Tensor,
    /// Logits, expert, position, gate, counts (shared with [`RoutingHandle`]s).
    r: Arc<RoutingBuffers>,
    /// `[T, H]` E4M3 x (current scaling).
    x_fp8: Fp8Tensor,
    /// `[E, T, H]` dispatched FP8 rows.
    x_disp: DeviceBuffer<u8>,
    /// `[E, T, F]` f32 expert outputs.
    h: DeviceBuffer<f32>,
    router: Kernel,
    plan: Kernel,
    scatter: Kernel,
    combine: Kernel,
    zero: Kernel,
    _module: Module,
}

impl std::fmt::Debug for Fp8Moe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fp8Moe")
            .field("cfg", &self.cfg)
            .field("experts_gemm", &self.experts_gemm)
            .field("path", &self.path)
            .finish()
    }
}

impl Fp8Moe {
    /// A layer of shape `cfg` with router weights `router_weight` (`[E, H]` row-major f32)
    /// and expert weights `expert_weights` (`[E, F, H]` row-major f32: expert `e`'s
    /// `[F, H]` linear weight), its experts run as `experts_gemm`. Allocates, uploads, casts
    /// the expert weights to E4M3 and waits (not during a capture); loads the kernels.
    pub fn new(
        stream: &Stream,
        cfg: MoeConfig,
        router_weight: &[f32],
        expert_weights: &[f32],
        experts_gemm: ExpertGemm,
    ) -> Result<Fp8Moe> {
        cfg.check()?;
        let MoeConfig {
            tokens: t,
            hidden: hd,
            ffn: f,
            experts: e,
        } = cfg;
        if router_weight.len() != e * hd {
            return Err(Error::InvalidArgument(format!(
                "Fp8Moe: router weight has {} elements, [{e}, {hd}] needs {}",
                router_weight.len(),
                e * hd
            )));
        }
        if expert_weights.len() != e * f * hd {
            return Err(Error::InvalidArgument(format!(
                "Fp8Moe: expert weights have {} elements, [{e}, {f}, {hd}] needs {}",
                expert_weights.len(),
                e * f * hd
            )));
        }
        let ctx = stream.context().clone();
        let module = Module::embedded(&ctx, FATBIN)?;
        let router = module.kernel("moe_router_f32")?;
        let plan = module.kernel("moe_dispatch_plan")?;
        let scatter = module.kernel("moe_scatter_rows")?;
        let combine = module.kernel("moe_combine_f32")?;
        let zero = module.kernel("moe_zero_f32")?;
        // Load fp8-kernels' module now rather than lazily inside a capture.
        fp8_kernels::module(&ctx)?;

        let wr = DeviceBuffer::from_host(stream, router_weight)?;
        let w = DeviceBuffer::from_host(stream, expert_weights)?;
        let w_fp8 = Fp8Tensor::new(stream, &[e * f, hd], Fp8Format::E4M3)?;
        quantize_current(stream, &w, &w_fp8, None)?;
        let moe = Fp8Moe {
            cfg,
            experts_gemm,
            path: GemmPath::Auto,
            wr,
            w_fp8,
            r: Arc::new(RoutingBuffers {
                logits: DeviceBuffer::from_host(stream, &vec![0f32; t * e])?,
                expert: DeviceBuffer::from_host(stream, &vec![0i32; t])?,
                pos: DeviceBuffer::from_host(stream, &vec![0i32; t])?,
                gate: DeviceBuffer::from_host(stream, &vec![0f32; t])?,
                counts: DeviceBuffer::from_host(stream, &vec![0i32; e])?,
            }),
            x_fp8: Fp8Tensor::new(stream, &[t, hd], Fp8Format::E4M3)?,
            x_disp: DeviceBuffer::from_host(stream, &vec![0u8; e * t * hd])?,
            h: DeviceBuffer::from_host(stream, &vec![0f32; e * t * f])?,
            router,
            plan,
            scatter,
            combine,
            zero,
            _module: module,
        };
        // The f32 expert weights are not kept; wait for the cast before dropping them.
        stream.synchronize()?;
        drop(w);
        Ok(moe)
    }

    /// This layer with its expert GEMMs on `path` (default [`GemmPath::Auto`]).
    pub fn with_path(mut self, path: GemmPath) -> Fp8Moe {
        self.path = path;
        self
    }

    /// The shape.
    pub fn config(&self) -> MoeConfig {
        self.cfg
    }

    /// How the experts run.
    pub fn expert_gemm(&self) -> ExpertGemm {
        self.experts_gemm
    }

    /// The expert weights' E4M3 copy (`[E * F, H]`) and its scalars.
    pub fn expert_weights_fp8(&self) -> &Fp8Tensor {
        &self.w_fp8
    }

    /// The E4M3 x of the last forward (`[T, H]`) and its scalars.
    pub fn input_fp8(&self) -> &Fp8Tensor {
        &self.x_fp8
    }

    /// The routing of the last forward, read back (waits for `stream`).
    pub fn routing(&self, stream: &Stream) -> Result<Routing> {
        self.routing_handle().read(stream)
    }

    /// A handle on the routing buffers, to read the routing after the layer was moved into
    /// a graphed runtime.
    pub fn routing_handle(&self) -> RoutingHandle {
        RoutingHandle(self.r.clone())
    }

    /// The expert outputs of the last forward, `[E, T, F]` (rows at or beyond an expert's
    /// count are stale), read back (waits for `stream`).
    pub fn expert_outputs(&self, stream: &Stream) -> Result<Vec<f32>> {
        self.h.to_vec(stream)
    }

    /// Checks a pass's buffers: one each way, of lengths `a_len` and `b_len`.
    fn one_each<'a>(
        what: &str,
        a: &[&'a DeviceBuffer<f32>],
        b: &[&'a DeviceBuffer<f32>],
        a_len: usize,
        b_len: usize,
    ) -> Result<(&'a DeviceBuffer<f32>, &'a DeviceBuffer<f32>)> {
        match (a, b) {
            ([a], [b]) if a.len() == a_len && b.len() == b_len => Ok((a, b)),
            _ => Err(Error::InvalidArgument(format!(
                "Fp8Moe {what}: takes one buffer each way of {a_len} and {b_len} elements, got \
                 {:?} and {:?}",
                a.iter().map(|x| x.len()).collect::<Vec<_>>(),
                b.iter().map(|x| x.len()).collect::<Vec<_>>()
            ))),
        }
    }

    /// Router, dispatch plan, x's FP8 cast and the scatter (capturable).
    fn route_and_dispatch(&mut self, stream: &Stream, x: &DeviceBuffer<f32>) -> Result<()> {
        let (t, hd, e) = (
            self.cfg.tokens as u32,
            self.cfg.hidden as u32,
            self.cfg.experts as u32,
        );
        // SAFETY: moe_router_f32(const float* x, const float* wr, float* logits, int*
        // expert, float* gate, u32 tokens, u32 hidden, u32 experts): one block of exactly
        // MOE_ROUTER_BLOCK (= ROUTER_BLOCK) threads per token; reads x [T, H] (length checked
        // by the caller) and wr [E, H], writes logits [T, E], expert [T], gate [T], all
        // owned by this layer with those lengths.
        unsafe {
            stream.launch_pdl(
                &self.router,
                &LaunchConfig::linear(t, ROUTER_BLOCK),
                &kernel_args![
                    *x,
                    self.wr,
                    self.r.logits,
                    self.r.expert,
                    self.r.gate,
                    t,
                    hd,
                    e
                ],
            )
        }?;
        let mut cfg = LaunchConfig::linear(1, PLAN_BLOCK);
        cfg.shared_mem_bytes = e * PLAN_BLOCK * 4;
        // SAFETY: moe_dispatch_plan(const int* expert, int* pos, int* counts, u32 tokens, u32
        // experts): one block, experts * blockDim ints of dynamic shared memory (at most
        // 32 * 256 * 4 = 32 KiB, under the 48 KiB default); reads expert [T], writes pos [T]
        // and counts [E]; experts <= MAX_EXPERTS <= PLAN_BLOCK (checked at construction).
        unsafe {
            stream.launch_pdl(
                &self.plan,
                &cfg,
                &kernel_args![self.r.expert, self.r.pos, self.r.counts, t, e],
            )
        }?;
        quantize_current(stream, x, &self.x_fp8, None)?;
        let vecs = hd / 16;
        // SAFETY: moe_scatter_rows(const uint4* src, uint4* dst, const int* expert, const
        // int* pos, u32 tokens, u32 vecs, u32 m_max, u32 experts): src is x_fp8 [T, H] bytes
        // = T rows of H / 16 16-byte vectors (H % 16 == 0, 16-byte aligned allocation), dst
        // x_disp [E, T, H] bytes; rows with an expert or position out of range are skipped.
        unsafe {
            stream.launch_pdl(
                &self.scatter,
                &LaunchConfig::linear(t, ROW_BLOCK),
                &kernel_args![
                    *self.x_fp8.data(),
                    self.x_disp,
                    self.r.expert,
                    self.r.pos,
                    t,
                    vecs,
                    t,
                    e
                ],
            )
        }
    }

    /// The experts as one grouped GEMM with device counts (capturable).
    fn experts_grouped(&self, stream: &Stream) -> Result<()> {
        let MoeConfig {
            tokens: t,
            hidden: hd,
            ffn: f,
            experts: e,
        } = self.cfg;
        grouped_gemm(
            stream,
            GroupedShape {
                groups: e,
                m_max: t,
                n: f,
                k: hd,
            },
            Operand {
                data: &self.x_disp,
                format: Fp8Format::E4M3,
                scale_inv: self.x_fp8.scale_inv(),
            },
            Operand {
                data: self.w_fp8.data(),
                format: Fp8Format::E4M3,
                scale_inv: self.w_fp8.scale_inv(),
            },
            &self.h,
            &self.r.counts,
            GemmOptions::new().path(self.path),
        )
    }

    /// The experts as dense GEMMs on exactly the counted rows: reads the counts to the host
    /// (synchronizes `stream`; not capturable).
    fn experts_per_expert(&self, stream: &Stream) -> Result<()> {
        let MoeConfig {
            tokens: t,
            hidden: hd,
            ffn: f,
            experts: _,
        } = self.cfg;
        let counts = self.r.counts.to_vec(stream)?;
        for (g, &c) in counts.iter().enumerate() {
            let c = usize::try_from(c).unwrap_or(0).min(t);
            if c == 0 {
                continue;
            }
            let a = self.x_disp.slice(g * t * hd..(g * t + c) * hd)?;
            let b = self.w_fp8.data().slice(g * f * hd..(g + 1) * f * hd)?;
            let d = self.h.slice(g * t * f..(g * t + c) * f)?;
            gemm(
                stream,
                GemmShape::new(c, f, hd),
                Operand {
                    data: &a,
                    format: Fp8Format::E4M3,
                    scale_inv: self.x_fp8.scale_inv(),
                },
                Operand {
                    data: &b,
                    format: Fp8Format::E4M3,
                    scale_inv: self.w_fp8.scale_inv(),
                },
                &d,
                GemmOptions::new().path(self.path),
            )?;
        }
        Ok(())
    }

    /// The combine (capturable).
    fn combine_into(&self, stream: &Stream, y: &DeviceBuffer<f32>) -> Result<()> {
        let (t, f, e) = (
            self.cfg.tokens as u32,
            self.cfg.ffn as u32,
            self.cfg.experts as u32,
        );
        // SAFETY: moe_combine_f32(const float* h, const int* expert, const int* pos, const
        // float* gate, float* y, u32 tokens, u32 ffn, u32 m_max, u32 experts): reads h
        // [E, T, F] at rows expert * T + pos (range-checked in the kernel), expert, pos,
        // gate [T]; writes y [T, F] (length checked by the caller).
        unsafe {
            stream.launch_pdl(
                &self.combine,
                &LaunchConfig::linear(t, ROW_BLOCK),
                &kernel_args![
                    self.h,
                    self.r.expert,
                    self.r.pos,
                    self.r.gate,
                    *y,
                    t,
                    f,
                    t,
                    e
                ],
            )
        }
    }

    fn lens(&self) -> (usize, usize) {
        (
            self.cfg.tokens * self.cfg.hidden,
            self.cfg.tokens * self.cfg.ffn,
        )
    }
}

impl Callable<f32> for Fp8Moe {
    fn input_lens(&self) -> Vec<usize> {
        vec![self.lens().0]
    }

    fn output_lens(&self) -> Vec<usize> {
        vec![self.lens().1]
    }

    /// The whole forward, eagerly (with [`ExpertGemm::PerExpert`] it synchronizes `stream`
    /// to read the counts, so it can not be captured; the runtime calls the segments).
    fn forward(
        &mut self,
        stream: &Stream,
        inputs: &[&DeviceBuffer<f32>],
        outputs: &[&DeviceBuffer<f32>],
        _slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let (il, ol) = self.lens();
        let (x, y) = Self::one_each("forward", inputs, outputs, il, ol)?;
        self.route_and_dispatch(stream, x)?;
        match self.experts_gemm {
            ExpertGemm::PerExpert => self.experts_per_expert(stream)?,
            ExpertGemm::Grouped => self.experts_grouped(stream)?,
        }
        self.combine_into(stream, y)
    }

    /// Trivial (forward-only layer): zeros the input gradient; no parameter gradients.
    fn backward(
        &mut self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<f32>],
        grad_inputs: &[&DeviceBuffer<f32>],
        _slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let (il, ol) = self.lens();
        let (_, dx) = Self::one_each("backward", grad_outputs, grad_inputs, ol, il)?;
        let n = il as u32;
        // SAFETY: moe_zero_f32(float* out, u32 n) writes n floats of dx (length il, checked
        // by one_each; il fits u32 by MoeConfig::check); one thread per element,
        // bound-checked.
        unsafe {
            stream.launch_pdl(
                &self.zero,
                &LaunchConfig::for_elements(n, 256),
                &kernel_args![*dx, n],
            )
        }
    }

    fn forward_segments(&self) -> Vec<SegmentKind> {
        match self.experts_gemm {
            ExpertGemm::PerExpert => {
                vec![
                    SegmentKind::Graphed,
                    SegmentKind::Eager,
                    SegmentKind::Graphed,
                ]
            }
            ExpertGemm::Grouped => vec![SegmentKind::Graphed],
        }
    }

    fn forward_segment(
        &mut self,
        segment: usize,
        stream: &Stream,
        inputs: &[&DeviceBuffer<f32>],
        outputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let (il, ol) = self.lens();
        let (x, y) = Self::one_each("forward", inputs, outputs, il, ol)?;
        match (self.experts_gemm, segment) {
            (ExpertGemm::Grouped, 0) => {
                self.route_and_dispatch(stream, x)?;
                self.experts_grouped(stream)?;
                self.combine_into(stream, y)
            }
            (ExpertGemm::PerExpert, 0) => self.route_and_dispatch(stream, x),
            (ExpertGemm::PerExpert, 2) => self.combine_into(stream, y),
            (mode, s) => Err(Error::InvalidArgument(format!(
                "Fp8Moe at {} ({mode:?}): forward segment {s} is not a graphed segment",
                slot.at()
            ))),
        }
    }

    fn forward_eager(
        &self,
        segment: usize,
        stream: &Stream,
        _inputs: &[&DeviceBuffer<f32>],
        _outputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        match (self.experts_gemm, segment) {
            (ExpertGemm::PerExpert, 1) => self.experts_per_expert(stream),
            (mode, s) => Err(Error::InvalidArgument(format!(
                "Fp8Moe at {} ({mode:?}): forward segment {s} is not an eager segment",
                slot.at()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(tokens: usize, hidden: usize, ffn: usize, experts: usize) -> MoeConfig {
        MoeConfig {
            tokens,
            hidden,
            ffn,
            experts,
        }
    }

    #[test]
    fn shape_rules() {
        assert!(cfg(64, 128, 256, 4).check().is_ok());
        assert!(cfg(1, 16, 16, 1).check().is_ok());
        assert!(cfg(4096, 2048, 2048, 8).check().is_ok());
        let e = cfg(0, 128, 256, 4).check().unwrap_err().to_string();
        assert!(e.contains("tokens"), "{e}");
        let e = cfg(64, 100, 256, 4).check().unwrap_err().to_string();
        assert!(e.contains("hidden = 100"), "{e}");
        let e = cfg(64, 128, 8, 4).check().unwrap_err().to_string();
        assert!(e.contains("ffn = 8"), "{e}");
        let e = cfg(64, 128, 256, 0).check().unwrap_err().to_string();
        assert!(e.contains("experts = 0"), "{e}");
        let e = cfg(64, 128, 256, 33).check().unwrap_err().to_string();
        assert!(e.contains("experts = 33"), "{e}");
        assert!(
            cfg(1 << 20, 1 << 12, 16, 2).check().is_err(),
            "2^33 elements"
        );
    }

    #[test]
    fn routing_keeps_token_order_and_breaks_ties_low() {
        // 5 tokens, 3 experts.
        let logits = [
            0.0,
            1.0,
            0.5, // -> 1
            2.0,
            2.0,
            1.0, // tie -> 0
            0.0,
            3.0,
            3.0, // tie -> 1
            f32::NAN,
            -1.0,
            -2.0, // nothing is > NaN -> 0
            -1.0,
            -1.0,
            5.0, // -> 2
        ];
        let (expert, pos, counts) = plan_routing(&logits, 3);
        assert_eq!(expert, [1, 0, 1, 0, 2]);
        assert_eq!(pos, [0, 0, 1, 1, 0]);
        assert_eq!(counts, [2, 2, 1]);
    }

    #[test]
    fn routing_all_to_one_expert() {
        let logits: Vec<f32> = (0..8).flat_map(|_| [0.0, 0.0, 1.0, 0.0]).collect();
        let (expert, pos, counts) = plan_routing(&logits, 4);
        assert_eq!(expert, [2; 8]);
        assert_eq!(pos, (0..8).collect::<Vec<i32>>());
        assert_eq!(counts, [0, 0, 8, 0]);
    }

    #[test]
    fn per_expert_segments_break_the_layer() {
        // The plans the two modes declare, checked without a device through SegmentPlan.
        use graphed_callables::SegmentPlan;
        let breaking = SegmentPlan::new(vec![
            SegmentKind::Graphed,
            SegmentKind::Eager,
            SegmentKind::Graphed,
        ])
        .unwrap();
        assert_eq!(breaking.graphs(), 2);
        assert!(
            SegmentPlan::new(vec![SegmentKind::Graphed])
                .unwrap()
                .is_single_graph()
        );
    }
}
