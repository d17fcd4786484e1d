//! Building graphed callables: static buffers, warmup, capture.

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use crate::capture::CaptureMode;
use crate::conditional::ConditionalHandle;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::exec::{GraphExec, InstantiateFlags};
use crate::graph::Graph;
use crate::memory::{DeviceBuffer, DeviceRepr};
use crate::pool::GraphPool;
use crate::stream::Stream;

use super::buffers::{BufferPlan, Shapes, StaticBuffers, buffer_sets};
use super::callable::{Callable, Slot};
use super::program::{Item, Part, Programs};
use super::replay::ReplayCursor;
use super::schedule::{LayerStep, Pass, Schedule};
use super::segments::{SegmentKind, SegmentPlan};
use super::weights::{
    AfterWarmupHook, Fp8Enabled, Fp8Recorder, ReductionGroup, StepHook, WarmupHook, WarmupRecord,
    WeightCaching, identity_group,
};

/// How [`GraphedCallables::build`] works.
///
/// Not `Clone`: the hooks are boxed closures.
pub struct GraphedOptions {
    /// The pipeline schedule, with the layers per chunk.
    pub schedule: Schedule,
    /// How often every callable runs (in schedule order) before capture, so lazily created
    /// handles, workspaces and allocations happen outside it. Default 3.
    pub warmup_iters: usize,
    /// Reuse the static buffers (inputs, outputs, gradients, saved activations) of a
    /// microbatch whose backward is done for a later microbatch of the same chunk, as the
    /// schedule allows (see [the static buffers](super#static-buffers)): a chunk then holds
    /// as many buffer sets as it has microbatches in flight at once. The static outputs a
    /// replay returns stay valid until that chunk's next forward that takes the same set
    /// ([`GraphedCallables::buffer_set`]). Default `false`.
    pub reuse_buffers: bool,
    /// The pool the static buffers and the callables' temporaries ([`Slot::pool`]) come
    /// from. Default `None`: a new pool sized for the static buffers plus
    /// [`scratch_bytes`](Self::scratch_bytes).
    pub pool: Option<GraphPool>,
    /// Extra bytes for temporaries when the pool is created by the build. Default 0.
    pub scratch_bytes: usize,
    /// The capture mode of every graph. Default [`CaptureMode::ThreadLocal`].
    pub capture_mode: CaptureMode,
    /// Capture the consecutive graphed segments of a step (the forward or backward of one
    /// (chunk, microbatch)) into one graph, across its layers; only eager segments split
    /// it. Default `true`: one graph launch per step instead of one per layer. `false`
    /// gives one graph per (chunk, microbatch, layer), pass and graphed segment, as
    /// TransformerEngine does. Replays compute the same either way; see
    /// [`GraphedCallables::forward_exec`] for what the inspection methods return.
    pub merge_layers: bool,
    /// How weight casts ([`Callable::cast_weights`]) are limited to the first microbatch of
    /// each step. Default [`WeightCaching::detect`]: `Conditional` when the driver has
    /// conditional IF nodes, else `NoopFlag`. See [`weights`](super::weights).
    pub weight_caching: WeightCaching,
    /// Which callables run with FP8 ([`Slot::fp8_enabled`]); callables with FP8 off get no
    /// runtime-managed weight casts. Default [`Fp8Enabled::All`].
    pub fp8: Fp8Enabled,
    /// The group amaxes are reduced over, for the hooks to use
    /// ([`GraphedCallables::reduction_group`]). Default [`IdentityGroup`](super::IdentityGroup)
    /// (one process).
    pub reduction_group: Arc<dyn ReductionGroup>,
    /// Run after every forward replay's launches, with the replay stream and the step (e.g.
    /// to enqueue the fused amax reduction and scale update). Default `None`.
    pub after_forward: Option<StepHook>,
    /// Run after every backward replay's launches, like
    /// [`after_forward`](Self::after_forward). Default `None`.
    pub after_backward: Option<StepHook>,
    /// Run once on the warmup stream before the first warmup pass (after the static buffers
    /// are zeroed and the sample inputs copied in): snapshot the scaling state warmup will
    /// change (amax histories, scales). Default `None`.
    pub before_warmup: Option<WarmupHook>,
    /// Run once on the warmup stream after the last warmup pass, before capture, with what
    /// warmup recorded ([`WarmupRecord`]: the FP8 tensors each callable reported through
    /// [`Slot::record_fp8_tensors`]): restore what [`before_warmup`](Self::before_warmup)
    /// saved, so the delayed-scaling history does not carry warmup's iterations, and
    /// register the tensors that ran for the amax reduction (MoE filtering, see
    /// [`weights`](super::weights)). Default `None`.
    pub after_warmup: Option<AfterWarmupHook>,
}

impl std::fmt::Debug for GraphedOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hook = |h: bool| if h { "Some(<hook>)" } else { "None" };
        f.debug_struct("GraphedOptions")
            .field("schedule", &self.schedule)
            .field("warmup_iters", &self.warmup_iters)
            .field("reuse_buffers", &self.reuse_buffers)
            .field("pool", &self.pool)
            .field("scratch_bytes", &self.scratch_bytes)
            .field("capture_mode", &self.capture_mode)
            .field("merge_layers", &self.merge_layers)
            .field("weight_caching", &self.weight_caching)
            .field("fp8", &self.fp8)
            .field("reduction_group", &self.reduction_group)
            .field("after_forward", &hook(self.after_forward.is_some()))
            .field("after_backward", &hook(self.after_backward.is_some()))
            .field("before_warmup", &hook(self.before_warmup.is_some()))
            .field("after_warmup", &hook(self.after_warmup.is_some()))
            .finish()
    }
}

impl GraphedOptions {
    /// The defaults for the schedule of `order` with `layers_per_chunk`
    /// ([`Schedule::new`]); an invalid order is [`Error::Schedule`] naming the position.
    pub fn from_order(order: &[i64], layers_per_chunk: Vec<usize>) -> Result<GraphedOptions> {
        Ok(GraphedOptions::new(Schedule::new(order, layers_per_chunk)?))
    }

    /// The defaults for `schedule`: 3 warmup iterations, no buffer reuse, a new pool with
    /// no scratch, thread-local capture, one graph per step (layers merged), the weight caching the driver supports
    /// ([`WeightCaching::detect`]), the identity reduction group, no hooks.
    pub fn new(schedule: Schedule) -> GraphedOptions {
        GraphedOptions {
            schedule,
            warmup_iters: 3,
            reuse_buffers: false,
            pool: None,
            scratch_bytes: 0,
            capture_mode: CaptureMode::ThreadLocal,
            merge_layers: true,
            weight_caching: WeightCaching::detect(),
            fp8: Fp8Enabled::All,
            reduction_group: identity_group(),
            after_forward: None,
            after_backward: None,
            before_warmup: None,
            after_warmup: None,
        }
    }

    /// These options with [`merge_layers`](Self::merge_layers) set to `merge`.
    pub fn with_merge_layers(mut self, merge: bool) -> GraphedOptions {
        self.merge_layers = merge;
        self
    }

    /// These options with weight caching `mode`.
    pub fn with_weight_caching(mut self, mode: WeightCaching) -> GraphedOptions {
        self.weight_caching = mode;
        self
    }
}

/// A model's callables captured as forward and backward graphs per (chunk, microbatch,
/// layer) under a pipeline schedule; see the [module documentation](super) for the whole
/// picture and an example.
///
/// Replays take `&self`, so buffers it returned (a chunk's outputs) can be passed straight
/// back in (as the next chunk's inputs); the replay position lives in a `Cell`, which makes
/// the type `Send` but not `Sync`: replay one `GraphedCallables` from one thread at a time.
pub struct GraphedCallables<T: DeviceRepr> {
    pub(crate) schedule: Schedule,
    pub(crate) callables: Vec<Box<dyn Callable<T>>>,
    pub(crate) buffers: StaticBuffers<T>,
    /// What each step launches and runs ([`Programs`]), and which segments each exec holds.
    pub(crate) programs: Programs,
    /// [`GraphedOptions::merge_layers`] of the build.
    pub(crate) merge_layers: bool,
    /// The execs, by the programs' exec index.
    pub(crate) execs: Vec<GraphExec>,
    /// The forward segments of each callable, by callable index.
    pub(crate) forward_plans: Vec<SegmentPlan>,
    /// The backward segments of each callable, by callable index.
    pub(crate) backward_plans: Vec<SegmentPlan>,
    pub(crate) pool: GraphPool,
    pub(crate) cursor: Cell<ReplayCursor>,
    pub(crate) ctx: Arc<Context>,
    /// Input and output-gradient copies enqueued by replays.
    pub(crate) copies: Cell<u64>,
    /// The captured graphs (kept for inspection), like the execs.
    pub(crate) graphs: Vec<Graph>,
    /// Weight caching: the mode, the flags, which forward graphs cast.
    pub(crate) weights: CastFlags,
    pub(crate) hooks: RefCell<ReplayHooks>,
    pub(crate) reduction_group: Arc<dyn ReductionGroup>,
    pub(crate) warmup_record: WarmupRecord,
    /// The buffer set of each (chunk, microbatch) ([`buffer_sets`]).
    pub(crate) sets: Vec<usize>,
}

/// The hooks replays run.
pub(crate) struct ReplayHooks {
    pub(crate) after_forward: Option<StepHook>,
    pub(crate) after_backward: Option<StepHook>,
}

/// The runtime-owned weight-cast flags, one per (chunk, microbatch) at
/// `chunk * num_microbatches + microbatch`, and which forward graphs cast.
#[derive(Debug)]
pub(crate) struct CastFlags {
    pub(crate) mode: WeightCaching,
    /// `Conditional`: the IF values (1 = cast).
    pub(crate) cond: Vec<DeviceBuffer<i32>>,
    /// `NoopFlag`: the noop flags (1.0 = skip).
    pub(crate) noop: Vec<DeviceBuffer<f32>>,
    /// Per forward graph: whether its `cast_weights` enqueues any work (always `false` for a
    /// forward with no graphed segment or a callable with FP8 off: the runtime does not cast
    /// for it).
    pub(crate) casts: Vec<bool>,
    /// Per callable: FP8 on ([`GraphedOptions::fp8`]).
    pub(crate) fp8: Vec<bool>,
}

impl CastFlags {
    fn new(
        ctx: &Arc<Context>,
        mode: WeightCaching,
        pairs: usize,
        graphs: usize,
        fp8: Vec<bool>,
        stream: &Stream,
    ) -> Result<CastFlags> {
        let mut flags = CastFlags {
            mode,
            cond: Vec::new(),
            noop: Vec::new(),
            casts: vec![false; graphs],
            fp8,
        };
        // Warmup casts on every microbatch: the flags start at "cast" (1 for IF, 0.0 for
        // the noop flag, both all-zero bits except the IF's 1).
        match mode {
            WeightCaching::Conditional => {
                for _ in 0..pairs {
                    let mut b = DeviceBuffer::<i32>::alloc(ctx, 1)?;
                    b.fill_u32_bits(stream, mode.flag_bits(true))?;
                    flags.cond.push(b);
                }
            }
            WeightCaching::NoopFlag => {
                for _ in 0..pairs {
                    let mut b = DeviceBuffer::<f32>::alloc(ctx, 1)?;
                    b.fill_u32_bits(stream, mode.flag_bits(true))?;
                    flags.noop.push(b);
                }
            }
        }
        Ok(flags)
    }

    /// The flag buffer of pair `pair` as 32-bit words (whichever the mode uses).
    pub(crate) fn raw_flag(
        &self,
        pair: usize,
    ) -> Option<(cuda_graph_sys::CUdeviceptr, crate::graph::Resource)> {
        match self.mode {
            WeightCaching::Conditional => self.cond.get(pair).map(|b| (b.as_raw(), b.resource())),
            WeightCaching::NoopFlag => self.noop.get(pair).map(|b| (b.as_raw(), b.resource())),
        }
    }
}

impl<T: DeviceRepr> std::fmt::Debug for GraphedCallables<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphedCallables")
            .field("schedule", &self.schedule)
            .field("graphs", &self.execs.len())
            .field("static_buffers", &self.buffers.arena.len())
            .field("next_step", &self.cursor.get().next_step(&self.schedule))
            .finish()
    }
}

/// What happens to a forward pass's weight casts right before its cast segment.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cast {
    /// No cast here (backward passes, a forward whose callable casts nothing, or casts
    /// already captured in the graph's IF node).
    Skip,
    /// `cast_weights` then the segment, unconditionally (warmup; the noop-flag mechanism).
    Always,
}

/// The slot of graph `graph`.
pub(crate) fn slot_of<'a, T: DeviceRepr>(
    schedule: &Schedule,
    buffers: &'a StaticBuffers<T>,
    flags: &'a CastFlags,
    pool: &'a GraphPool,
    graph: usize,
    warmup: Option<&'a Fp8Recorder>,
) -> Result<Slot<'a, T>> {
    let layout = schedule.layout();
    let at = layout
        .locate(graph)
        .ok_or_else(|| Error::invalid(format!("internal: graph {graph} out of range")))?;
    let pair = at.chunk * layout.num_microbatches() + at.microbatch;
    let fp8 = layout
        .callable_of_graph(graph)
        .and_then(|c| flags.fp8.get(c).copied())
        .unwrap_or(true);
    Ok(Slot {
        at,
        inputs: buffers.inputs(graph),
        outputs: buffers.outputs(graph),
        saved: buffers.saved(graph),
        pool,
        warmup: warmup.is_some(),
        skip_weight_cast: flags.noop.get(pair),
        recorder: warmup,
        fp8,
    })
}

/// Runs segment `segment` (of kind `kind`) of the pass of `ls` for its callable on `stream`:
/// eagerly (warmup, with the callable's recorder) or inside a capture (graphed segments
/// only, `warmup` `None`). `cast` applies before the segment (the caller passes non-`Skip`
/// only for a forward's cast segment).
#[allow(clippy::too_many_arguments)]
fn run_segment<T: DeviceRepr>(
    callables: &mut [Box<dyn Callable<T>>],
    schedule: &Schedule,
    buffers: &StaticBuffers<T>,
    flags: &CastFlags,
    pool: &GraphPool,
    ls: LayerStep,
    segment: usize,
    kind: SegmentKind,
    stream: &Stream,
    warmup: Option<&Fp8Recorder>,
    cast: Cast,
) -> Result<()> {
    let slot = slot_of(schedule, buffers, flags, pool, ls.graph, warmup)?;
    let callable = callables
        .get_mut(ls.callable)
        .ok_or_else(|| Error::invalid(format!("internal: callable {} missing", ls.callable)))?;
    match ls.step.pass() {
        Pass::Forward => {
            if cast == Cast::Always {
                callable.cast_weights(stream, &slot)?;
            }
            match kind {
                SegmentKind::Graphed => {
                    callable.forward_segment(segment, stream, &slot.inputs, &slot.outputs, &slot)
                }
                SegmentKind::Eager => {
                    callable.forward_eager(segment, stream, &slot.inputs, &slot.outputs, &slot)
                }
            }
        }
        Pass::Backward => {
            let go = buffers.grad_outputs(ls.graph);
            let gi = buffers.grad_inputs(ls.graph);
            match kind {
                // Split weight gradients: the backward step computes input gradients only
                // (build checked the backward is the single default segment).
                SegmentKind::Graphed if schedule.splits_weight_grad() => {
                    callable.backward_input(stream, &go, &gi, &slot)
                }
                SegmentKind::Graphed => callable.backward_segment(segment, stream, &go, &gi, &slot),
                SegmentKind::Eager => callable.backward_eager(segment, stream, &go, &gi, &slot),
            }
        }
        Pass::WeightGrad => {
            let go = buffers.grad_outputs(ls.graph);
            callable.backward_weight(stream, &go, &slot)
        }
    }
}

/// Copies graph `graph`'s sample inputs into its static inputs on `stream` (those that are
/// not the static buffers themselves; lengths were checked).
fn copy_samples<T: DeviceRepr>(
    buffers: &mut StaticBuffers<T>,
    samples: &[Vec<&DeviceBuffer<T>>],
    graph: usize,
    stream: &Stream,
) -> Result<()> {
    let Some(sample) = samples.get(graph) else {
        return Ok(());
    };
    let dst = buffers.plan.graphs[graph].inputs.clone();
    for (src, d) in sample.iter().zip(dst) {
        if src.as_raw() != buffers.arena[d].as_raw() {
            buffers.arena[d].copy_from_device(stream, src)?;
        }
    }
    Ok(())
}

/// The segment plan of `ls`'s pass.
fn plan_of<'p>(
    forward: &'p [SegmentPlan],
    backward: &'p [SegmentPlan],
    ls: LayerStep,
) -> Result<&'p SegmentPlan> {
    let plans = match ls.step.pass() {
        Pass::Forward => forward,
        _ => backward,
    };
    plans
        .get(ls.callable)
        .ok_or_else(|| Error::invalid(format!("internal: callable {} has no plan", ls.callable)))
}

/// The validated segment plans of every callable, forward and backward.
fn segment_plans<T: DeviceRepr>(
    callables: &[Box<dyn Callable<T>>],
) -> Result<(Vec<SegmentPlan>, Vec<SegmentPlan>)> {
    let mut forward = Vec::with_capacity(callables.len());
    let mut backward = Vec::with_capacity(callables.len());
    for (c, callable) in callables.iter().enumerate() {
        for (what, kinds, out) in [
            ("forward", callable.forward_segments(), &mut forward),
            ("backward", callable.backward_segments(), &mut backward),
        ] {
            if kinds.is_empty() {
                return Err(Error::invalid(format!(
                    "callable {c} declares no {what} segments; a pass needs at least one \
                     (the default is one graphed segment)"
                )));
            }
            out.push(SegmentPlan::new(kinds)?);
        }
    }
    Ok((forward, backward))
}

impl<T: DeviceRepr> GraphedCallables<T> {
    /// Allocates the static buffers, warms up and captures every graph.
    ///
    /// * `stream`: the work is ordered after what `stream` holds, and `stream` waits for
    ///   it at the end (nothing here synchronizes it). Warmup and capture both run on one
    ///   internal stream forked from it, so handles a callable creates lazily per stream
    ///   are made during warmup on the very stream capture then uses.
    /// * `callables`: one per (chunk, layer), at [`Layout::callable_index`](super::Layout::callable_index).
    /// * `sample_inputs`: per graph index ([`Layout::index`](super::Layout::index)), the
    ///   inputs warmup and capture use. Only layer 0 of each (chunk, microbatch) reads
    ///   them (later layers read their predecessor's outputs); entries of later layers may be
    ///   empty and are otherwise ignored.
    ///
    /// Every static buffer is zeroed first (so warmup's backward sees zero output
    /// gradients). Warmup runs every graph's pass `warmup_iters` times in
    /// [`Schedule::layer_steps`] order (every segment, eager ones included), copying each
    /// (chunk, microbatch)'s sample inputs into its static inputs right before its forward
    /// (so microbatches that share buffers under
    /// [`reuse_buffers`](GraphedOptions::reuse_buffers) each see their own); capture
    /// records them in that order into the one pool (a graph per step, or per layer and
    /// graphed segment, see [`GraphedOptions::merge_layers`]) and instantiates and uploads
    /// each.
    ///
    /// Errors: [`Error::InvalidArgument`] for wrong counts or lengths, a callable declaring
    /// an empty segment list ([`Callable::forward_segments`]), layers of a chunk that do not
    /// chain (see [`buffers`](super#static-buffers)), a schedule with weight-gradient steps
    /// and a callable with a segmented backward, a per-callable FP8 list of the wrong
    /// length, a pool too small; any error of a callable, of a capture or of
    /// instantiation. Schedules are validated when built
    /// ([`Error::Schedule`]).
    pub fn build(
        stream: &Stream,
        callables: Vec<Box<dyn Callable<T>>>,
        sample_inputs: &[Vec<&DeviceBuffer<T>>],
        options: GraphedOptions,
    ) -> Result<GraphedCallables<T>> {
        let GraphedOptions {
            schedule,
            warmup_iters,
            reuse_buffers,
            pool,
            scratch_bytes,
            capture_mode,
            merge_layers,
            weight_caching,
            fp8,
            reduction_group,
            after_forward,
            after_backward,
            mut before_warmup,
            mut after_warmup,
        } = options;
        weight_caching.check()?;
        let layout = schedule.layout().clone();
        if sample_inputs.len() != layout.total_graphs() {
            return Err(Error::invalid(format!(
                "{} sets of sample inputs given, one per graph ({}) needed",
                sample_inputs.len(),
                layout.total_graphs()
            )));
        }
        let shapes: Vec<Shapes> = callables
            .iter()
            .map(|c| Shapes {
                inputs: c.input_lens(),
                outputs: c.output_lens(),
                saved: c.saved_lens(),
            })
            .collect();
        let sets = buffer_sets(&schedule, reuse_buffers);
        let plan = BufferPlan::new(&layout, &shapes, &sets)?;
        let (forward_plans, backward_plans) = segment_plans(&callables)?;
        if schedule.splits_weight_grad()
            && let Some(c) = backward_plans.iter().position(|p| !p.is_single_graph())
        {
            return Err(Error::invalid(format!(
                "callable {c} splits its backward into segments; a schedule with separate \
                 weight-gradient steps (-k - 0.5) needs single-graph backwards"
            )));
        }
        let ctx = stream.context().clone();
        let pool = match pool {
            Some(p) => p,
            None => {
                let bytes = plan
                    .pool_bytes(size_of::<T>())?
                    .checked_add(scratch_bytes)
                    .ok_or_else(|| Error::invalid("pool size overflows usize"))?;
                GraphPool::new(&ctx, bytes)?
            }
        };
        let mut buffers = StaticBuffers::<T>::alloc(plan, &pool)?;

        let cap = Stream::new(&ctx)?;
        cap.wait_stream(stream)?;
        for b in buffers.arena.iter_mut() {
            b.memset_bytes(&cap, 0)?;
        }
        for (g, sample) in sample_inputs.iter().enumerate() {
            let at = layout
                .locate(g)
                .ok_or_else(|| Error::invalid(format!("internal: graph {g} out of range")))?;
            if at.layer != 0 && sample.is_empty() {
                continue;
            }
            let want = &shapes[layout.callable_at(at.chunk, at.layer)].inputs;
            let got: Vec<usize> = sample.iter().map(|b| b.len()).collect();
            if &got != want {
                return Err(Error::invalid(format!(
                    "sample inputs of graph {g} ({at}) have lengths {got:?}, the callable \
                     takes {want:?}"
                )));
            }
        }

        let mut flags = CastFlags::new(
            &ctx,
            weight_caching,
            layout.num_chunks() * layout.num_microbatches(),
            layout.total_graphs(),
            fp8.resolve(layout.total_callables())?,
            &cap,
        )?;

        let mut callables = callables;
        // What each callable reports running during warmup (MoE filtering).
        let recorders: Vec<Fp8Recorder> = callables.iter().map(|_| Fp8Recorder::new()).collect();
        // The caller snapshots its scaling state here and restores it after warmup, and
        // registers the FP8 tensors that ran (the hooks).
        if let Some(h) = before_warmup.as_mut() {
            h(&cap)?;
        }
        for _ in 0..warmup_iters {
            for ls in schedule.layer_steps() {
                if ls.step.pass() == Pass::Forward && ls.layer == 0 {
                    copy_samples(&mut buffers, sample_inputs, ls.graph, &cap)?;
                }
                // Every segment in order, eagerly (eager segments included). First-microbatch
                // semantics: every forward casts (before its first graphed segment), so lazy
                // cast state is created before capture.
                let plan = plan_of(&forward_plans, &backward_plans, ls)?;
                let cast_at = match ls.step.pass() {
                    Pass::Forward if flags.fp8[ls.callable] => plan.cast_segment(),
                    _ => None,
                };
                for (segment, &kind) in plan.kinds().iter().enumerate() {
                    let cast = if cast_at == Some(segment) {
                        Cast::Always
                    } else {
                        Cast::Skip
                    };
                    run_segment(
                        &mut callables,
                        &schedule,
                        &buffers,
                        &flags,
                        &pool,
                        ls,
                        segment,
                        kind,
                        &cap,
                        recorders.get(ls.callable),
                        cast,
                    )?;
                }
            }
        }
        let warmup_record = WarmupRecord::new(recorders.iter().map(Fp8Recorder::tensors).collect());
        if let Some(h) = after_warmup.as_mut() {
            h(&cap, &warmup_record)?;
        }
        cap.synchronize()?;

        // Which forward graphs cast anything: capture each one's casts into a throwaway
        // graph (nothing runs). Graphs that cast nothing get no IF node and no flag write;
        // a forward with no graphed segment gets no runtime casts at all.
        for ls in schedule.layer_steps() {
            if ls.step.pass() != Pass::Forward
                || !flags.fp8[ls.callable]
                || plan_of(&forward_plans, &backward_plans, ls)?
                    .cast_segment()
                    .is_none()
            {
                continue;
            }
            let probe = cap.capture(capture_mode, |s| {
                let slot = slot_of(&schedule, &buffers, &flags, &pool, ls.graph, None)?;
                let callable = callables.get_mut(ls.callable).ok_or_else(|| {
                    Error::invalid(format!("internal: callable {} missing", ls.callable))
                })?;
                callable.cast_weights(s.stream(), &slot)
            })?;
            flags.casts[ls.graph] = !probe.nodes()?.is_empty();
        }
        if weight_caching == WeightCaching::Conditional && flags.casts.iter().any(|&c| c) {
            // Loaded outside any capture: loading a module may invalidate a global capture.
            ConditionalHandle::load_helpers(&ctx)?;
        }

        // Capture, step by step in schedule order, one graph per launch item of the
        // programs (a run of graphed segments, merged across layers or not).
        let programs = Programs::new(&schedule, &forward_plans, &backward_plans, merge_layers)?;
        let mut execs = Vec::with_capacity(programs.execs());
        let mut graphs = Vec::with_capacity(programs.execs());
        for item in programs.steps().flatten() {
            let Item::Launch { exec, parts } = item else {
                continue;
            };
            debug_assert_eq!(*exec, execs.len());
            // The parts whose weight casts this graph holds: each casting forward's cast
            // segment.
            let casts_at = |part: &Part| -> Result<bool> {
                let ls = part.ls;
                Ok(ls.step.pass() == Pass::Forward
                    && flags.casts[ls.graph]
                    && plan_of(&forward_plans, &backward_plans, ls)?.cast_segment()
                        == Some(part.segment))
            };
            let mut casting = Vec::new();
            for part in parts {
                if casts_at(part)? {
                    casting.push(*part);
                }
            }
            let graph = cap.capture(capture_mode, |s| {
                let stream = s.stream();
                if weight_caching == WeightCaching::Conditional && !casting.is_empty() {
                    // One IF node at the head of the graph holds the casts of every layer in
                    // it (one per step when layers are merged): a setter kernel copies the
                    // step's flag into the handle, which starts every launch at 0 (no cast).
                    // Casts read only the weights, so casting a later layer's before an
                    // earlier layer's forward changes nothing.
                    let step = casting[0].ls.step;
                    let pair = step.chunk() * layout.num_microbatches() + step.microbatch();
                    let flag = flags.cond.get(pair).ok_or_else(|| {
                        Error::invalid(format!("internal: no cast flag for pair {pair}"))
                    })?;
                    let handle = ConditionalHandle::in_capture(stream, 0, true)?;
                    handle.set_from_flag_on(stream, flag)?;
                    stream.capture_if(handle, |body| {
                        for part in &casting {
                            let slot =
                                slot_of(&schedule, &buffers, &flags, &pool, part.ls.graph, None)?;
                            let callable =
                                callables.get_mut(part.ls.callable).ok_or_else(|| {
                                    Error::invalid(format!(
                                        "internal: callable {} missing",
                                        part.ls.callable
                                    ))
                                })?;
                            callable.cast_weights(body, &slot)?;
                        }
                        Ok(())
                    })?;
                }
                for part in parts {
                    let cast =
                        if weight_caching == WeightCaching::NoopFlag && casting.contains(part) {
                            Cast::Always
                        } else {
                            Cast::Skip
                        };
                    run_segment(
                        &mut callables,
                        &schedule,
                        &buffers,
                        &flags,
                        &pool,
                        part.ls,
                        part.segment,
                        SegmentKind::Graphed,
                        stream,
                        None,
                        cast,
                    )?;
                }
                Ok(())
            })?;
            let e = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
            e.upload(&cap)?;
            execs.push(e);
            graphs.push(graph);
        }
        stream.wait_stream(&cap)?;
        Ok(GraphedCallables {
            schedule,
            callables,
            buffers,
            programs,
            merge_layers,
            execs,
            forward_plans,
            backward_plans,
            pool,
            cursor: Cell::new(ReplayCursor::default()),
            ctx,
            copies: Cell::new(0),
            graphs,
            weights: flags,
            hooks: RefCell::new(ReplayHooks {
                after_forward,
                after_backward,
            }),
            reduction_group,
            warmup_record,
            sets,
        })
    }

    /// The schedule the graphs were captured for.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The pool every static buffer and captured temporary came from.
    pub fn pool(&self) -> &GraphPool {
        &self.pool
    }

    /// The context of the graphs.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The callables, by [`Layout::callable_index`](super::Layout::callable_index).
    pub fn callables(&self) -> &[Box<dyn Callable<T>>] {
        &self.callables
    }

    /// The parameters graph `graph` (forward and backward) runs with: those of its
    /// callable ([`Layout::callable_of_graph`](super::Layout::callable_of_graph)). `None`
    /// if out of range.
    pub fn parameters_of(&self, graph: usize) -> Option<Vec<&DeviceBuffer<T>>> {
        let c = self.schedule.layout().callable_of_graph(graph)?;
        Some(self.callables[c].parameters())
    }

    /// How many input and output-gradient copies replays have enqueued so far (buffers
    /// passed in that were not the static buffers themselves).
    pub fn input_copies(&self) -> u64 {
        self.copies.get()
    }

    /// The exec that holds segment `segment` of graph index `graph`'s `pass`; `None` if out
    /// of range or that segment is eager.
    fn exec_index(&self, pass: Pass, graph: usize, segment: usize) -> Option<usize> {
        self.programs.exec_of(pass, graph, segment)
    }

    /// The first graphed segment of graph index `graph`'s `pass`.
    fn first_graphed(&self, pass: Pass, graph: usize) -> Option<usize> {
        let plan = match pass {
            Pass::Forward => self.forward_plan(graph)?,
            _ => self.backward_plan(graph)?,
        };
        plan.cast_segment()
    }

    /// The forward exec of graph index `graph`: the one holding its forward's first graphed
    /// segment. With [`GraphedOptions::merge_layers`] (the default) an exec holds a whole
    /// run of graphed segments of its step, so the layers of one (chunk, microbatch) share
    /// it; without, it is this layer's own. `None` if out of range or the forward has no
    /// graphed segment.
    pub fn forward_exec(&self, graph: usize) -> Option<&GraphExec> {
        self.forward_segment_exec(graph, self.first_graphed(Pass::Forward, graph)?)
    }

    /// The backward exec of graph index `graph`: the one holding its backward's first
    /// graphed segment (shared as for [`forward_exec`](Self::forward_exec)). `None` if out
    /// of range or the backward has no graphed segment.
    pub fn backward_exec(&self, graph: usize) -> Option<&GraphExec> {
        self.backward_segment_exec(graph, self.first_graphed(Pass::Backward, graph)?)
    }

    /// The exec holding forward segment `segment` of graph index `graph`; `None` if out of
    /// range or that segment is eager.
    pub fn forward_segment_exec(&self, graph: usize, segment: usize) -> Option<&GraphExec> {
        self.execs
            .get(self.exec_index(Pass::Forward, graph, segment)?)
    }

    /// The exec holding backward segment `segment` of graph index `graph`; `None` if out of
    /// range or that segment is eager.
    pub fn backward_segment_exec(&self, graph: usize, segment: usize) -> Option<&GraphExec> {
        self.execs
            .get(self.exec_index(Pass::Backward, graph, segment)?)
    }

    /// The exec of graph index `graph`'s weight-gradient pass (schedules with `-k - 0.5`
    /// entries; shared by the step's layers when merged); `None` if out of range or the
    /// schedule has no weight-gradient steps.
    pub fn weight_grad_exec(&self, graph: usize) -> Option<&GraphExec> {
        self.execs.get(self.exec_index(Pass::WeightGrad, graph, 0)?)
    }

    /// The captured graph of [`weight_grad_exec`](Self::weight_grad_exec).
    pub fn weight_grad_graph(&self, graph: usize) -> Option<&Graph> {
        self.graphs
            .get(self.exec_index(Pass::WeightGrad, graph, 0)?)
    }

    /// The forward segments of graph index `graph` (those of its callable); `None` if out
    /// of range.
    pub fn forward_plan(&self, graph: usize) -> Option<&SegmentPlan> {
        let c = self.schedule.layout().callable_of_graph(graph)?;
        self.forward_plans.get(c)
    }

    /// The backward segments of graph index `graph`; `None` if out of range.
    pub fn backward_plan(&self, graph: usize) -> Option<&SegmentPlan> {
        let c = self.schedule.layout().callable_of_graph(graph)?;
        self.backward_plans.get(c)
    }

    /// The captured graph of [`forward_exec`](Self::forward_exec), for inspecting its
    /// structure; `None` if out of range or the forward has no graphed segment. With
    /// [`WeightCaching::Conditional`] and a callable that casts, it starts with a setter
    /// kernel and one IF node ([`NodeKind::Conditional`](crate::NodeKind::Conditional))
    /// whose body holds the casts of every casting layer in the graph.
    pub fn forward_graph(&self, graph: usize) -> Option<&Graph> {
        let segment = self.first_graphed(Pass::Forward, graph)?;
        self.forward_segment_graph(graph, segment)
    }

    /// The captured graph of [`backward_exec`](Self::backward_exec); `None` if out of range
    /// or the backward has no graphed segment.
    pub fn backward_graph(&self, graph: usize) -> Option<&Graph> {
        let segment = self.first_graphed(Pass::Backward, graph)?;
        self.backward_segment_graph(graph, segment)
    }

    /// The captured graph holding forward segment `segment` of graph index `graph`; `None`
    /// if out of range or that segment is eager.
    pub fn forward_segment_graph(&self, graph: usize, segment: usize) -> Option<&Graph> {
        self.graphs
            .get(self.exec_index(Pass::Forward, graph, segment)?)
    }

    /// The captured graph holding backward segment `segment` of graph index `graph`; `None`
    /// if out of range or that segment is eager.
    pub fn backward_segment_graph(&self, graph: usize, segment: usize) -> Option<&Graph> {
        self.graphs
            .get(self.exec_index(Pass::Backward, graph, segment)?)
    }

    /// The buffer set (numbered from 0 within the chunk) whose static buffers (chunk,
    /// microbatch) uses: the microbatch itself without
    /// [`reuse_buffers`](GraphedOptions::reuse_buffers); with it, microbatches of a chunk
    /// with the same set share every static buffer, one after the other. `None` out of
    /// range.
    pub fn buffer_set(&self, chunk: usize, microbatch: usize) -> Option<usize> {
        if chunk >= self.schedule.num_chunks() || microbatch >= self.schedule.num_microbatches() {
            return None;
        }
        self.sets
            .get(chunk * self.schedule.num_microbatches() + microbatch)
            .copied()
    }

    /// Whether consecutive graphed segments of a step share one graph
    /// ([`GraphedOptions::merge_layers`]).
    pub fn merges_layers(&self) -> bool {
        self.merge_layers
    }

    /// The number of graphs (execs) the build captured: one per step with
    /// [`GraphedOptions::merge_layers`] and no eager segments, one per (chunk, microbatch,
    /// layer), pass and graphed segment without merging.
    pub fn num_graphs(&self) -> usize {
        self.execs.len()
    }

    /// The weight-caching mechanism the forward graphs were captured with.
    pub fn weight_caching(&self) -> WeightCaching {
        self.weights.mode
    }

    /// Whether forward graph `graph`'s callable enqueued any work in
    /// [`Callable::cast_weights`] at capture (only such graphs get the IF node or the flag
    /// writes; the casts sit in the forward's first graphed segment); `false` for a forward
    /// with no graphed segment (the runtime does not cast for it); `None` if out of range.
    pub fn casts_weights(&self, graph: usize) -> Option<bool> {
        self.weights.casts.get(graph).copied()
    }

    /// What warmup recorded: the FP8 tensors each callable reported running
    /// ([`Slot::record_fp8_tensors`]), the set [`GraphedOptions::after_warmup`] was given.
    pub fn warmup_record(&self) -> &WarmupRecord {
        &self.warmup_record
    }

    /// The amax reduction group of the options.
    pub fn reduction_group(&self) -> &Arc<dyn ReductionGroup> {
        &self.reduction_group
    }
}
