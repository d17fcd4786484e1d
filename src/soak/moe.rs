//! The MoE part of the soak: the training layer [`MoeLayer`] (top-1 softmax router, SwiGLU
//! experts, FP8 expert GEMMs, forward and backward) as full-layer graphs
//! ([`ExpertGemm::Grouped`]: one graph per forward and one per backward, the grouped GEMMs
//! reading the per-expert offsets on the device) under the schedule `[1, 1, 1, -1, -1, -1]`,
//! replayed with a new input and a new output gradient every microbatch, the inputs planned
//! so that the per-expert token counts differ from the previous forward replay's.
//!
//! # What a check compares
//!
//! A replay is a forward or a backward graph launch (6 per training step). A microbatch is
//! checked when the number of its forward or its backward replay is a multiple of
//! `check_every`: right before its backward the graphed layer's weight gradients are zeroed,
//! and right after it an eager run of an identical layer ([`Reference`]: the same
//! parameters, its own scaling state with the same fixed scales) on the same input and
//! output gradient, its gradients zeroed too, is compared bit for bit with the graphs (the
//! full-layer graphs run the eager kernels, tests/moe_layer.rs): the output, the input
//! gradient, the three weight gradients (fc1, fc2, router: one backward's worth on both
//! sides), the gates, the aux and z losses and the routing (counts, offsets, each token's
//! expert). The counts, and each token's expert, must also be what the host planned, and
//! the counts must differ from those of the forward replay before.
//!
//! Nothing updates the scales: both layers keep the fixed scales of [`scales`] for the
//! whole run (no scale-update hooks), so the amaxes their casts record never feed back into
//! a cast, and a pass's results depend on its input, its output gradient and the parameters
//! alone. The only state the graphed layer carries from replay to replay is its weight
//! gradients' accumulation, which a check zeroes first; so a check sees the replays it
//! compares, not the unchecked ones before it (the MLP workload, which updates its scales,
//! runs its eager twin in lockstep instead).
//!
//! # Routing that the host decides
//!
//! The router weights give expert `e` the feature `e` with weight 8 (0 for the others) and
//! every feature from `E` on small noise (|w| <= 1/16). An input row sets feature `k` to 4
//! and the other first `E` features to 0, the rest noise (|x| <= 1, then rounded to bf16,
//! which keeps |x| <= 1): expert `k`'s logit is 32 plus noise, every other one noise alone,
//! and the noise is at most `(H - E) / 16` = 7.5 for H = 128. So the token goes to `k`
//! whatever the rounding, and the host knows each replay's counts before it runs:
//! [`plan_experts`] draws them so that they differ from the previous replay's.
//!
//! # Reading the graphed layer's routing
//!
//! Each microbatch's routing is its layer's saved buffer 0, which the runtime hands out
//! ([`GraphedCallables::saved`]): read after a replay, it holds what that replay routed.

use std::sync::Arc;

use cuda_graph::half::bf16;
use cuda_graph::{DeviceBuffer, Stream};
use fp8_kernels::{AmaxAlgo, CastScaling, DelayedScaling, Fp8Format};
use fp8_moe::moe::layer::{
    ExpertGemm, Fp8Recipe, GradDtype, MoeLayer, MoeLayerConfig, MoeParams, WeightGrad, formats,
};
use fp8_moe::moe::routing::{RouterConfig, RoutingBuffers, ScoreFn};
use graphed_callables::{
    Callable, GraphIndex, GraphedCallables, GraphedOptions, Schedule, Slot, Step,
};

use super::{Rng, Stats, diff_problem};
use crate::bench::BenchResult;

/// The soak's MoE layer: small, so a replay is bound by its launches, not its math. Top-1
/// softmax (the host decides the routing, see the [module documentation](self)), with the
/// aux and z losses on so that the router's backward has work.
pub const MOE: MoeLayerConfig = MoeLayerConfig {
    tokens: 128,
    hidden: 128,
    ffn: 64,
    experts: 8,
    router: RouterConfig {
        top_k: 1,
        score: ScoreFn::Softmax,
        renormalize: false,
        aux_coef: 1e-2,
        z_coef: 1e-3,
    },
    recipe: Fp8Recipe::Hybrid,
    expert_gemm: ExpertGemm::Grouped,
    scaling: CastScaling::Delayed,
    grad_dtype: GradDtype::F32,
};
/// Microbatches of the schedule `[1, 1, 1, -1, -1, -1]`: a forward and a backward graph each.
const MICROBATCHES: usize = 3;
const ORDER: [i64; 6] = [1, 1, 1, -1, -1, -1];
/// A routing feature's value in the input, and the router weight that reads it.
const ROUTE_X: f32 = 4.0;
const ROUTE_W: f32 = 8.0;
/// The scale of the noise in the input and in the router and expert weights.
const X_NOISE: f32 = 1.0;
const W_NOISE: f32 = 1.0 / 16.0;
/// The scale of the output gradients.
const DY_NOISE: f32 = 1.0;

/// The fixed scale of each tensor of a layer's scaling state, in its order (x, h, dY, dA,
/// then every expert's fc1 and fc2 weight; [`formats`]): powers of two that keep the soak's
/// values well inside the formats' range (x and h within 4, the weights within 1/16 (E4M3
/// up to 448); dY within 1 and dA well below it (E5M2 up to 57344)) and their bulk clear of
/// the subnormals.
pub fn scales() -> Vec<f32> {
    let mut s = vec![64.0, 64.0, 4096.0, 4096.0];
    s.resize(formats(MOE.recipe, MOE.experts).len(), 4096.0);
    s
}

/// A scaling state for [`MOE`] holding [`scales`], history 1; nothing updates it.
fn fixed_scaling(stream: &Stream) -> BenchResult<Arc<DelayedScaling>> {
    let fmts: Vec<Fp8Format> = formats(MOE.recipe, MOE.experts);
    let scaling = DelayedScaling::new(stream, &fmts, 1, 0, AmaxAlgo::MostRecent)?;
    for (t, s) in scales().into_iter().enumerate() {
        scaling.scale(t)?.write(stream, s)?;
    }
    Ok(Arc::new(scaling))
}

/// A layer of [`MOE`] with `params` and its own [`fixed_scaling`].
pub fn layer(stream: &Stream, params: &MoeParams) -> BenchResult<MoeLayer> {
    Ok(MoeLayer::new(
        stream,
        MOE,
        params,
        fixed_scaling(stream)?,
        0,
    )?)
}

/// Router weights `[E, H]`: expert `e` reads feature `e` with weight 8 and no other routing
/// feature; the features from `E` on get noise.
pub fn router_weights(rng: &mut Rng, cfg: MoeLayerConfig) -> Vec<f32> {
    let (e, h) = (cfg.experts, cfg.hidden);
    let mut w = vec![0f32; e * h];
    for (i, row) in w.chunks_mut(h.max(1)).enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            *v = if j < e {
                if j == i { ROUTE_W } else { 0.0 }
            } else {
                rng.uniform(W_NOISE)
            };
        }
    }
    w
}

/// The layer's parameters: [`router_weights`], and noise for fc1 (`[E, 2F, H]`) and fc2
/// (`[E, H, F]`).
pub fn params(rng: &mut Rng, cfg: MoeLayerConfig) -> MoeParams {
    let (e, h, f) = (cfg.experts, cfg.hidden, cfg.ffn);
    MoeParams {
        wr: router_weights(rng, cfg),
        w1: rng.vec(e * 2 * f * h, W_NOISE),
        w2: rng.vec(e * h * f, W_NOISE),
    }
}

/// Draws each token's expert for the next replay into `experts_of` (one per token) and
/// returns the per-expert counts, which differ from `prev` whenever that is possible
/// (at least 2 experts and 1 token). The patterns, drawn per replay: every token to one
/// expert (1 in 16), two experts taking turns (1 in 16), or each token to a "hot" expert
/// with a random probability and uniformly otherwise (so some experts often get none).
/// When the draw repeats `prev`, token 0 moves to the next expert.
pub fn plan_experts(
    rng: &mut Rng,
    experts: usize,
    prev: &[i32],
    experts_of: &mut [usize],
) -> Vec<i32> {
    let mut counts = vec![0i32; experts];
    if experts == 0 {
        return counts;
    }
    let pattern = rng.below(16);
    let hot = rng.below(experts);
    let other = rng.below(experts);
    let p_hot = rng.below(1025);
    for (t, e) in experts_of.iter_mut().enumerate() {
        *e = match pattern {
            0 => hot,
            1 => {
                if t % 2 == 0 {
                    hot
                } else {
                    other
                }
            }
            _ => {
                if rng.below(1024) < p_hot {
                    hot
                } else {
                    rng.below(experts)
                }
            }
        };
        counts[*e] += 1;
    }
    if counts == prev
        && experts > 1
        && let Some(first) = experts_of.first_mut()
    {
        counts[*first] -= 1;
        *first = (*first + 1) % experts;
        counts[*first] += 1;
    }
    counts
}

/// Fills `x` (`[T, H]` bf16, `T = experts_of.len()`) with the rows that route token `t` to
/// `experts_of[t]`: the routing features one-hot ([`ROUTE_X`]), the rest noise.
pub fn fill_input(rng: &mut Rng, cfg: MoeLayerConfig, experts_of: &[usize], x: &mut [bf16]) {
    for (row, &k) in x.chunks_mut(cfg.hidden.max(1)).zip(experts_of) {
        for (j, v) in row.iter_mut().enumerate() {
            let f = if j < cfg.experts {
                if j == k { ROUTE_X } else { 0.0 }
            } else {
                rng.uniform(X_NOISE)
            };
            *v = bf16::from_f32(f);
        }
    }
}

/// Fills `dy` with an output gradient: noise within [`DY_NOISE`], rounded to bf16.
pub fn fill_grad(rng: &mut Rng, dy: &mut [bf16]) {
    for v in dy {
        *v = bf16::from_f32(rng.uniform(DY_NOISE));
    }
}

/// What the host planned for one input: each token's expert and the per-expert counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// The expert of each token.
    pub experts_of: Vec<usize>,
    /// Tokens per expert.
    pub counts: Vec<i32>,
}

impl Plan {
    /// A plan for [`MOE`]'s tokens, all to expert 0 (what a zero input routes to: every logit
    /// ties, and ties go to the lower expert).
    pub fn all_to_first() -> Plan {
        let mut counts = vec![0; MOE.experts];
        counts[0] = MOE.tokens as i32;
        Plan {
            experts_of: vec![0; MOE.tokens],
            counts,
        }
    }

    /// Draws this plan anew ([`plan_experts`]) with counts that differ from `prev`'s, and
    /// fills `x` with an input that routes as planned ([`fill_input`]).
    pub fn redraw(&mut self, rng: &mut Rng, prev: &[i32], x: &mut [bf16]) {
        self.counts = plan_experts(rng, MOE.experts, prev, &mut self.experts_of);
        fill_input(rng, MOE, &self.experts_of, x);
    }
}

/// Chunk 0, layer 0 of `microbatch`.
pub fn at(microbatch: usize) -> GraphIndex {
    GraphIndex {
        chunk: 0,
        microbatch,
        layer: 0,
    }
}

/// The bits of bf16 values as the f32 values they are (exact; NaN payloads kept), so
/// [`diff_problem`] compares them bit for bit.
fn widen(v: &[bf16]) -> Vec<f32> {
    v.iter()
        .map(|b| f32::from_bits(u32::from(b.to_bits()) << 16))
        .collect()
}

/// One microbatch's routing, read back from its saved routing buffer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoutingRead {
    /// Tokens per expert.
    pub counts: Vec<i32>,
    /// Each expert's first packed row (`E + 1`).
    pub offsets: Vec<i32>,
    /// Each token's expert (top-1).
    pub topk: Vec<i32>,
    /// Each token's gate.
    pub gates: Vec<f32>,
    /// The aux loss and the z-loss.
    pub losses: Vec<f32>,
}

impl RoutingRead {
    /// Reads the routing in `saved` (a microbatch's saved buffer 0) on `stream` (waits).
    pub fn read(stream: &Stream, saved: &DeviceBuffer<u8>) -> BenchResult<RoutingRead> {
        let r = RoutingBuffers::from_bytes(MOE.routing_dims(), saved)?;
        Ok(RoutingRead {
            counts: r.counts.to_vec(stream)?,
            offsets: r.offsets.to_vec(stream)?,
            topk: r.topk.to_vec(stream)?,
            gates: r.gates.to_vec(stream)?,
            losses: r.losses.to_vec(stream)?,
        })
    }
}

/// Views of a layer's weight gradients (f32, accumulated by every backward): fc1's, fc2's,
/// the router's. They stay valid after the layer moves into the runtime.
pub struct Grads {
    experts: [WeightGrad; 2],
    router: DeviceBuffer<f32>,
}

impl Grads {
    /// The names of the gradients, in order.
    const NAMES: [&'static str; 3] = [
        "fc1 weight gradient",
        "fc2 weight gradient",
        "router weight gradient",
    ];

    /// Views of `layer`'s gradients.
    pub fn of(layer: &MoeLayer) -> Grads {
        Grads {
            experts: [layer.fc1().1.share(), layer.fc2().1.share()],
            router: layer.router_weight().1.share(),
        }
    }

    /// Enqueues zeroing every gradient on `stream` (also inside a capture).
    pub fn zero(&self, stream: &Stream) -> cuda_graph::Result<()> {
        self.experts.iter().try_for_each(|g| g.zero(stream))?;
        self.router.memset_bytes(stream, 0)
    }

    /// The gradients, read back (waits).
    pub fn read(&self, stream: &Stream) -> BenchResult<[Vec<f32>; 3]> {
        let [a, b] = &self.experts;
        Ok([
            a.to_f32_vec(stream)?,
            b.to_f32_vec(stream)?,
            self.router.to_vec(stream)?,
        ])
    }
}

/// What one forward and backward of a microbatch produced, read back.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PassResult {
    /// The output, bf16 widened bit for bit ([`widen`]).
    pub y: Vec<f32>,
    /// The input gradient, likewise.
    pub dx: Vec<f32>,
    /// The weight gradients after this backward ([`Grads`] order).
    pub grads: [Vec<f32>; 3],
    /// The routing.
    pub routing: RoutingRead,
}

impl PassResult {
    /// Reads a pass's results: output `y`, input gradient `dx`, the weight gradients, the
    /// routing in `routing` (the saved buffer 0). Waits for `stream`.
    pub fn read(
        stream: &Stream,
        y: &DeviceBuffer<bf16>,
        dx: &DeviceBuffer<bf16>,
        grads: &Grads,
        routing: &DeviceBuffer<u8>,
    ) -> BenchResult<PassResult> {
        Ok(PassResult {
            y: widen(&y.to_vec(stream)?),
            dx: widen(&dx.to_vec(stream)?),
            grads: grads.read(stream)?,
            routing: RoutingRead::read(stream, routing)?,
        })
    }

    /// The floating-point results, named.
    fn floats(&self) -> [(&'static str, &[f32]); 7] {
        let [g1, g2, gr] = &self.grads;
        [
            ("output", &self.y),
            ("input gradient", &self.dx),
            (Grads::NAMES[0], g1),
            (Grads::NAMES[1], g2),
            (Grads::NAMES[2], gr),
            ("gates", &self.routing.gates),
            ("losses", &self.routing.losses),
        ]
    }
}

/// What is wrong with a graphed pass (`got`) against the eager one of the same input and
/// output gradient (`eager`) and the `plan` its input was made from; empty when nothing is.
/// Every float is compared bit for bit, and a non-finite eager value is a problem of its
/// own (the comparison would mean little); the counts and each token's expert must be the
/// plan's, and the routing (counts, offsets, experts) eager's.
pub fn pass_problems(got: &PassResult, eager: &PassResult, plan: &Plan) -> Vec<String> {
    let mut problems = Vec::new();
    for ((what, g), (_, e)) in got.floats().into_iter().zip(eager.floats()) {
        if let Some(i) = e.iter().position(|v| !v.is_finite()) {
            problems.push(format!("eager {what} element {i} is {}", e[i]));
        }
        problems.extend(diff_problem(what, g, e));
    }
    let r = &got.routing;
    if r.counts != plan.counts {
        problems.push(format!(
            "counts {:?}, the input planned {:?}",
            r.counts, plan.counts
        ));
    }
    let off_plan = r
        .topk
        .iter()
        .zip(&plan.experts_of)
        .filter(|&(&g, &p)| usize::try_from(g).ok() != Some(p))
        .count()
        + r.topk.len().abs_diff(plan.experts_of.len());
    if off_plan > 0 {
        let first = r
            .topk
            .iter()
            .zip(&plan.experts_of)
            .position(|(&g, &p)| usize::try_from(g).ok() != Some(p))
            .map(|t| {
                format!(
                    ", first token {t} to expert {} (planned {})",
                    r.topk[t], plan.experts_of[t]
                )
            })
            .unwrap_or_default();
        problems.push(format!("{off_plan} tokens routed off the plan{first}"));
    }
    let e = &eager.routing;
    if r.counts != e.counts || r.offsets != e.offsets || r.topk != e.topk {
        problems.push(format!(
            "routing differs from eager (counts {:?} vs {:?}, offsets {:?} vs {:?})",
            r.counts, e.counts, r.offsets, e.offsets
        ));
    }
    problems
}

/// A microbatch's buffers outside the runtime: output, input gradient, saved buffers.
pub struct PassBuffers {
    y: DeviceBuffer<bf16>,
    dx: DeviceBuffer<bf16>,
    saved: Vec<DeviceBuffer<u8>>,
}

impl PassBuffers {
    /// Zeroed buffers for `layer` (waits; not during a capture).
    pub fn new(stream: &Stream, layer: &MoeLayer) -> BenchResult<PassBuffers> {
        let n = MOE.tokens * MOE.hidden;
        let zeros = || DeviceBuffer::from_host(stream, &vec![bf16::ZERO; n]);
        Ok(PassBuffers {
            y: zeros()?,
            dx: zeros()?,
            saved: layer
                .saved_bytes()
                .iter()
                .map(|&b| DeviceBuffer::from_host(stream, &vec![0u8; b]))
                .collect::<Result<_, _>>()?,
        })
    }

    /// The output.
    pub fn y(&self) -> &DeviceBuffer<bf16> {
        &self.y
    }

    /// The input gradient.
    pub fn dx(&self) -> &DeviceBuffer<bf16> {
        &self.dx
    }

    /// The saved routing (saved buffer 0), which [`RoutingRead::read`] reads.
    pub fn routing(&self) -> BenchResult<&DeviceBuffer<u8>> {
        self.saved
            .first()
            .ok_or_else(|| "internal: the MoE layer has no saved buffers".into())
    }
}

/// One whole training pass of `layer` on `x` and `dy` into `bufs`, enqueued on `stream`
/// (eagerly, or inside a capture: nothing here waits): the weight gradients zeroed, the
/// weights cast, the forward, the backward. Its weight gradients then hold this backward's
/// alone.
pub fn train_pass(
    layer: &mut MoeLayer,
    stream: &Stream,
    x: &DeviceBuffer<bf16>,
    dy: &DeviceBuffer<bf16>,
    bufs: &PassBuffers,
) -> cuda_graph::Result<()> {
    let slot = Slot::new(at(0), vec![x], vec![&bufs.y], bufs.saved.iter().collect());
    Grads::of(layer).zero(stream)?;
    layer.cast_weights(stream, &slot)?;
    layer.forward(stream, &[x], &[&bufs.y], &slot)?;
    layer.backward(stream, &[dy], &[&bufs.dx], &slot)
}

/// An eager MoE layer: the reference every graphed pass is compared with, bit for bit.
pub struct Reference {
    layer: MoeLayer,
    grads: Grads,
    bufs: PassBuffers,
}

impl Reference {
    /// A layer with `params` and its own scaling state of fixed [`scales`].
    pub fn new(stream: &Stream, params: &MoeParams) -> BenchResult<Reference> {
        let layer = layer(stream, params)?;
        Ok(Reference {
            grads: Grads::of(&layer),
            bufs: PassBuffers::new(stream, &layer)?,
            layer,
        })
    }

    /// The eager [`train_pass`] of `x` and `dy`, read back (waits for `stream`).
    pub fn run(
        &mut self,
        stream: &Stream,
        x: &DeviceBuffer<bf16>,
        dy: &DeviceBuffer<bf16>,
    ) -> BenchResult<PassResult> {
        train_pass(&mut self.layer, stream, x, dy, &self.bufs)?;
        PassResult::read(
            stream,
            &self.bufs.y,
            &self.bufs.dx,
            &self.grads,
            self.bufs.routing()?,
        )
    }
}

/// The graphed MoE layer, its eager twin, and the host side of their data.
pub struct MoeSoak {
    graphed: GraphedCallables<bf16>,
    /// The graphed layer's routing buffer of each microbatch.
    routing: Vec<DeviceBuffer<u8>>,
    /// The graphed layer's weight gradients.
    grads: Grads,
    reference: Reference,
    /// A step's data in one upload: the three inputs, then the three output gradients.
    staging: DeviceBuffer<bf16>,
    /// Views of `staging`, one per microbatch.
    inputs: Vec<DeviceBuffer<bf16>>,
    grad_outputs: Vec<DeviceBuffer<bf16>>,
    host: Vec<bf16>,
    /// What each microbatch's input of this step was planned to route.
    plans: Vec<Plan>,
    /// The counts of the last planned input.
    last_planned: Vec<i32>,
    /// The microbatch of the last forward replay.
    last_forward: usize,
    rng: Rng,
    /// Replays (forward and backward graph launches), checks, mismatches.
    pub stats: Stats,
    /// Checks whose counts differed from the forward replay before.
    pub counts_changed: u64,
}

impl MoeSoak {
    /// Builds the graphed layer (warmup and capture included) and its eager twin, with
    /// parameters from `weights_rng` and data from `rng`.
    pub fn new(stream: &Stream, weights_rng: &mut Rng, rng: Rng) -> BenchResult<MoeSoak> {
        let params = params(weights_rng, MOE);
        let layer = layer(stream, &params)?;
        let grads = Grads::of(&layer);
        let reference = Reference::new(stream, &params)?;
        let n = MOE.tokens * MOE.hidden;
        // Zeros: the build's warmup runs on them (see `last_planned` below).
        let staging = DeviceBuffer::from_host(stream, &vec![bf16::ZERO; 2 * MICROBATCHES * n])?;
        let view = |i: usize| staging.slice(i * n..(i + 1) * n);
        let inputs = (0..MICROBATCHES).map(view).collect::<Result<Vec<_>, _>>()?;
        let grad_outputs = (MICROBATCHES..2 * MICROBATCHES)
            .map(view)
            .collect::<Result<Vec<_>, _>>()?;
        let graphed = GraphedCallables::build(
            stream,
            vec![Box::new(layer) as Box<dyn Callable<bf16>>],
            &[vec![&inputs[0]]],
            GraphedOptions::new(Schedule::new(&ORDER, vec![1])?),
        )?;
        // Each microbatch's routing: saved buffer 0 of its (only) layer.
        let routing = (0..MICROBATCHES)
            .map(|mb| {
                graphed
                    .saved(0, mb, 0)?
                    .first()
                    .map(|b| b.share())
                    .ok_or_else(|| {
                        cuda_graph::Error::InvalidArgument(format!(
                            "soak: the MoE layer of microbatch {mb} has no saved buffers"
                        ))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Warmup ended with the forward of the last microbatch, on zeros: every token to
        // expert 0, which the first plan differs from like any other.
        let first = Plan::all_to_first();
        Ok(MoeSoak {
            graphed,
            routing,
            grads,
            reference,
            host: vec![bf16::ZERO; staging.len()],
            staging,
            inputs,
            grad_outputs,
            last_planned: first.counts.clone(),
            plans: vec![first; MICROBATCHES],
            last_forward: MICROBATCHES - 1,
            rng,
            stats: Stats::default(),
            counts_changed: 0,
        })
    }

    /// One training step of the schedule on new data (one upload): each microbatch's
    /// forward, then each backward; a microbatch is checked (see the [module
    /// documentation](self)) when its forward's or its backward's replay number is a
    /// multiple of `check_every`.
    pub fn step(&mut self, stream: &Stream, check_every: u64) -> BenchResult<()> {
        let n = MOE.tokens * MOE.hidden;
        let (xs, dys) = self.host.split_at_mut(MICROBATCHES * n);
        for (plan, x) in self.plans.iter_mut().zip(xs.chunks_mut(n)) {
            plan.redraw(&mut self.rng, &self.last_planned, x);
            self.last_planned.clone_from(&plan.counts);
        }
        fill_grad(&mut self.rng, dys);
        // Waits for the previous step, whose launches read the old data.
        self.staging.copy_from_host(stream, &self.host)?;
        let first = self.stats.replays;
        let mut checked = [false; MICROBATCHES];
        for (i, st) in self.graphed.schedule().steps().iter().enumerate() {
            if (first + i as u64) % check_every.max(1) == 0 {
                checked[st.microbatch()] = true;
            }
        }
        let mut before: [Option<Vec<i32>>; MICROBATCHES] = Default::default();
        // By index: a check borrows `self` mutably between the steps.
        for i in 0..self.graphed.schedule().steps().len() {
            let st = self.graphed.schedule().steps()[i];
            let mb = st.microbatch();
            match st {
                Step::Forward { .. } => {
                    if checked[mb] {
                        let prev = RoutingBuffers::from_bytes(
                            MOE.routing_dims(),
                            &self.routing[self.last_forward],
                        )?;
                        before[mb] = Some(prev.counts.to_vec(stream)?);
                    }
                    self.graphed.forward(0, mb, &[&self.inputs[mb]], stream)?;
                    self.last_forward = mb;
                    self.stats.replays += 1;
                }
                Step::Backward { .. } => {
                    if checked[mb] {
                        self.grads.zero(stream)?;
                    }
                    self.graphed
                        .backward(0, mb, &[&self.grad_outputs[mb]], stream)?;
                    self.stats.replays += 1;
                    if checked[mb] {
                        self.check(stream, mb, first, before[mb].take())?;
                    }
                }
                Step::WeightGrad { .. } => return Err("no weight-gradient steps".into()),
            }
        }
        Ok(())
    }

    /// Compares microbatch `mb`'s forward and backward just replayed (the step began at
    /// replay `first`) with an eager run on the same data; `before` holds the counts of the
    /// forward replay before `mb`'s.
    fn check(
        &mut self,
        stream: &Stream,
        mb: usize,
        first: u64,
        before: Option<Vec<i32>>,
    ) -> BenchResult<()> {
        let (Some(y), Some(dx)) = (
            self.graphed.static_outputs(0, mb)?.first(),
            self.graphed.static_grad_inputs(0, mb)?.first(),
        ) else {
            return Err("internal: the graphed MoE layer has no output or input gradient".into());
        };
        let got = PassResult::read(stream, y, dx, &self.grads, &self.routing[mb])?;
        let eager = self
            .reference
            .run(stream, &self.inputs[mb], &self.grad_outputs[mb])?;
        let mut problems = pass_problems(&got, &eager, &self.plans[mb]);
        if let Some(before) = before {
            if got.routing.counts != before {
                self.counts_changed += 1;
            } else {
                problems.push(format!(
                    "counts {:?} did not change from the forward replay before",
                    got.routing.counts
                ));
            }
        }
        self.stats.record_check(
            || format!("MoE microbatch {mb} of the step from replay {first}"),
            problems,
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fp8_moe::moe::reference as rf;
    use fp8_moe::moe::routing::ALIGN_ROWS;

    #[test]
    fn the_soak_layer_is_valid_and_full_layer() {
        MOE.check().unwrap();
        assert_eq!(MOE.expert_gemm, ExpertGemm::Grouped);
        assert_eq!(MOE.router.top_k, 1);
        assert_eq!(scales().len(), formats(MOE.recipe, MOE.experts).len());
        // The largest input (a routing feature) and weight stay far below E4M3's 448, a
        // unit output gradient below E5M2's 57344.
        let s = scales();
        assert!(ROUTE_X * s[0] <= 256.0 && W_NOISE * s[4] <= 256.0);
        assert!(DY_NOISE * s[2] <= 4096.0);
        assert!(s.iter().all(|v| v.log2().fract() == 0.0), "powers of two");
    }

    #[test]
    fn planned_counts_always_change_and_cover_the_patterns() {
        let mut rng = Rng::new(7, 1);
        let mut experts_of = vec![0usize; MOE.tokens];
        let mut prev = vec![0i32; MOE.experts];
        let (mut all_to_one, mut some_empty) = (0, 0);
        for _ in 0..20_000 {
            let counts = plan_experts(&mut rng, MOE.experts, &prev, &mut experts_of);
            assert_ne!(counts, prev);
            assert_eq!(counts.iter().sum::<i32>(), MOE.tokens as i32);
            let mut recount = vec![0i32; MOE.experts];
            for &e in &experts_of {
                recount[e] += 1;
            }
            assert_eq!(recount, counts, "counts match the assignment");
            all_to_one += usize::from(counts.iter().any(|&c| c >= MOE.tokens as i32 - 1));
            some_empty += usize::from(counts.contains(&0));
            prev = counts;
        }
        assert!(all_to_one > 500, "{all_to_one}");
        assert!(some_empty > 2_000, "{some_empty}");
    }

    #[test]
    fn a_repeated_draw_moves_token_zero() {
        // Two tokens, two experts: the draws repeat often; the counts still change.
        let mut rng = Rng::new(3, 2);
        let mut experts_of = vec![0usize; 2];
        let mut prev = vec![1, 1];
        for _ in 0..1000 {
            let counts = plan_experts(&mut rng, 2, &prev, &mut experts_of);
            assert_ne!(counts, prev);
            prev = counts;
        }
        // One expert: nothing to change, nothing panics.
        let counts = plan_experts(&mut rng, 1, &[2], &mut experts_of);
        assert_eq!(counts, [2]);
        assert!(plan_experts(&mut rng, 0, &[], &mut experts_of).is_empty());
    }

    /// The host model of the router (`moe::reference`, f64) routes every bf16 input token
    /// where the plan says, with the margin the module docs derive: the device's f32 sums
    /// can not flip it. The first plan also differs from a zero input's routing.
    #[test]
    fn routing_features_decide_the_expert_with_a_wide_margin() {
        let mut rng = Rng::new(11, 3);
        let p = params(&mut rng, MOE);
        let dims = rf::MoeDims {
            tokens: MOE.tokens,
            hidden: MOE.hidden,
            ffn: MOE.ffn,
            experts: MOE.experts,
            align: ALIGN_ROWS,
        };
        let cfg = rf::RouterConfig::from(MOE.router);
        let wr: Vec<f64> = p.wr.iter().map(|&v| f64::from(v)).collect();
        let mut x = vec![bf16::ZERO; MOE.tokens * MOE.hidden];
        let zero = rf::route(&dims, &cfg, &vec![0.0; x.len()], &wr).unwrap();
        let first = Plan::all_to_first();
        assert_eq!(zero.topk, vec![0; MOE.tokens], "ties go to expert 0");
        let mut plan = first.clone();
        let mut prev = first.counts.clone();
        for _ in 0..50 {
            plan.redraw(&mut rng, &prev, &mut x);
            assert_ne!(plan.counts, prev);
            let xf: Vec<f64> = x.iter().map(|v| f64::from(v.to_f32())).collect();
            assert!(xf.iter().all(|v| v.abs() <= f64::from(ROUTE_X)));
            let r = rf::route(&dims, &cfg, &xf, &wr).unwrap();
            for (t, l) in r.logits.chunks(MOE.experts).enumerate() {
                let k = plan.experts_of[t];
                let best_other = l
                    .iter()
                    .enumerate()
                    .filter(|&(e, _)| e != k)
                    .map(|(_, &v)| v)
                    .fold(f64::NEG_INFINITY, f64::max);
                assert!(
                    l[k] - best_other > 16.0,
                    "token {t}: margin {}",
                    l[k] - best_other
                );
            }
            let want: Vec<u32> = plan.experts_of.iter().map(|&e| e as u32).collect();
            assert_eq!(r.topk, want);
            let counts: Vec<i32> = r.plan.counts.iter().map(|&c| c as i32).collect();
            assert_eq!(counts, plan.counts);
            prev.clone_from(&plan.counts);
        }
    }

    #[test]
    fn bf16_widens_bit_for_bit() {
        let v = [bf16::from_f32(1.5), bf16::NEG_ZERO, bf16::from_bits(0x7fc1)];
        let w = widen(&v);
        assert_eq!(w[0], 1.5);
        assert_eq!(w[1].to_bits(), 0x8000_0000);
        assert_eq!(w[2].to_bits(), 0x7fc1_0000, "NaN payload kept");
    }

    fn pass(y: Vec<f32>, counts: Vec<i32>, topk: Vec<i32>) -> PassResult {
        PassResult {
            y,
            dx: vec![0.5, -0.5],
            grads: [vec![1.0], vec![2.0], vec![3.0]],
            routing: RoutingRead {
                offsets: vec![0, 128, 256],
                counts,
                topk,
                gates: vec![1.0, 1.0],
                losses: vec![0.01, 0.2],
            },
        }
    }

    #[test]
    fn problems_name_what_differs() {
        let plan = Plan {
            experts_of: vec![0, 1],
            counts: vec![1, 1],
        };
        let eager = pass(vec![1.0, 2.0], vec![1, 1], vec![0, 1]);
        let ok = pass_problems(&eager, &eager, &plan);
        assert!(ok.is_empty(), "{ok:?}");
        let p = pass_problems(&pass(vec![1.0, 2.5], vec![2, 0], vec![0, 0]), &eager, &plan);
        assert_eq!(p.len(), 4, "{p:?}");
        assert!(p[0].starts_with("output: 1 of 2"), "{p:?}");
        assert!(p[1].contains("planned"), "{p:?}");
        assert!(
            p[2].contains("1 tokens routed off the plan, first token 1 to expert 0"),
            "{p:?}"
        );
        assert!(p[3].contains("eager"), "{p:?}");
        let mut bad_grad = eager.clone();
        bad_grad.grads[2][0] = 3.5;
        let p = pass_problems(&bad_grad, &eager, &plan);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].starts_with("router weight gradient"), "{p:?}");
        let nan = pass(vec![f32::NAN, 2.0], vec![1, 1], vec![0, 1]);
        let p = pass_problems(&nan, &nan, &plan);
        assert_eq!(
            p.len(),
            1,
            "same NaN bits match; the eager NaN is named: {p:?}"
        );
        assert!(p[0].starts_with("eager output element 0"), "{p:?}");
    }
}
