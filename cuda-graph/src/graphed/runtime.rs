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

use super::buffers::{BufferPlan, Shapes, StaticBuffers};
use super::callable::{Callable, Slot};
use super::replay::ReplayCursor;
use super::schedule::{LayerStep, Pass, Schedule};
use super::segments::{SegmentKind, SegmentPlan, SegmentRun};
use super::weights::{ReductionGroup, StepHook, WarmupHook, WeightCaching, identity_group};

/// How [`GraphedCallables::build`] works.
///
/// Not `Clone`: the hooks are boxed closures.
pub struct GraphedOptions {
    /// The pipeline schedule, with the layers per chunk.
    pub schedule: Schedule,
    /// How often every callable runs (in schedule order) before capture, so lazily created
    /// handles, workspaces and allocations happen outside it. Default 3.
    pub warmup_iters: usize,
    /// Reuse input/output buffers across microbatches once a chunk's backward is captured.
    /// Not implemented yet: must be `false` (the default); `true` is rejected at build.
    pub reuse_buffers: bool,
    /// The pool the static buffers and the callables' temporaries ([`Slot::pool`]) come
    /// from. Default `None`: a new pool sized for the static buffers plus
    /// [`scratch_bytes`](Self::scratch_bytes).
    pub pool: Option<GraphPool>,
    /// Extra bytes for temporaries when the pool is created by the build. Default 0.
    pub scratch_bytes: usize,
    /// The capture mode of every graph. Default [`CaptureMode::ThreadLocal`].
    pub capture_mode: CaptureMode,
    /// How weight casts ([`Callable::cast_weights`]) are limited to the first microbatch of
    /// each step. Default [`WeightCaching::detect`]: `Conditional` when the driver has
    /// conditional IF nodes, else `NoopFlag`. See [`weights`](super::weights).
    pub weight_caching: WeightCaching,
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
    /// Run once on the warmup stream after the last warmup pass, before capture: restore
    /// what [`before_warmup`](Self::before_warmup) saved, so the delayed-scaling history
    /// does not carry warmup's iterations. Default `None`.
    pub after_warmup: Option<WarmupHook>,
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
            .field("weight_caching", &self.weight_caching)
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
    /// no scratch, thread-local capture, the weight caching the driver supports
    /// ([`WeightCaching::detect`]), the identity reduction group, no hooks.
    pub fn new(schedule: Schedule) -> GraphedOptions {
        GraphedOptions {
            schedule,
            warmup_iters: 3,
            reuse_buffers: false,
            pool: None,
            scratch_bytes: 0,
            capture_mode: CaptureMode::ThreadLocal,
            weight_caching: WeightCaching::detect(),
            reduction_group: identity_group(),
            after_forward: None,
            after_backward: None,
            before_warmup: None,
            after_warmup: None,
        }
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
    /// Forward execs by graph index ([`Layout::index`](super::Layout::index)), one per
    /// graphed segment of the forward (in segment order; empty for an eager-only forward).
    pub(crate) forward: Vec<Vec<GraphExec>>,
    /// Backward execs by graph index, one per graphed backward segment.
    pub(crate) backward: Vec<Vec<GraphExec>>,
    /// The forward segments of each callable, by callable index.
    pub(crate) forward_plans: Vec<SegmentPlan>,
    /// The backward segments of each callable, by callable index.
    pub(crate) backward_plans: Vec<SegmentPlan>,
    pub(crate) pool: GraphPool,
    pub(crate) cursor: Cell<ReplayCursor>,
    pub(crate) ctx: Arc<Context>,
    /// Input and output-gradient copies enqueued by replays.
    pub(crate) copies: Cell<u64>,
    /// The captured graphs (kept for inspection), by graph index, like the execs.
    pub(crate) forward_graphs: Vec<Vec<Graph>>,
    pub(crate) backward_graphs: Vec<Vec<Graph>>,
    /// Weight caching: the mode, the flags, which forward graphs cast.
    pub(crate) weights: CastFlags,
    pub(crate) hooks: RefCell<ReplayHooks>,
    pub(crate) reduction_group: Arc<dyn ReductionGroup>,
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
    /// forward with no graphed segment: the runtime does not cast for it).
    pub(crate) casts: Vec<bool>,
}

impl CastFlags {
    fn new(
        ctx: &Arc<Context>,
        mode: WeightCaching,
        pairs: usize,
        graphs: usize,
        stream: &Stream,
    ) -> Result<CastFlags> {
        let mut flags = CastFlags {
            mode,
            cond: Vec::new(),
            noop: Vec::new(),
            casts: vec![false; graphs],
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
            .field("graphs", &self.forward.len())
            .field("static_buffers", &self.buffers.arena.len())
            .field("next_step", &self.cursor.get().next_step(&self.schedule))
            .finish()
    }
}

/// What happens to a forward pass's weight casts.
#[derive(Clone, Copy)]
enum Cast<'a> {
    /// No cast (backward passes, or a forward whose callable casts nothing).
    Skip,
    /// `cast_weights` then `forward`, unconditionally (warmup; the noop-flag mechanism).
    Always,
    /// A setter kernel sets an IF handle from the flag, the IF body holds `cast_weights`,
    /// then `forward` (captures only).
    Conditional(&'a DeviceBuffer<i32>),
}

/// The slot of graph `graph`.
pub(crate) fn slot_of<'a, T: DeviceRepr>(
    schedule: &Schedule,
    buffers: &'a StaticBuffers<T>,
    flags: &'a CastFlags,
    pool: &'a GraphPool,
    graph: usize,
    warmup: bool,
) -> Result<Slot<'a, T>> {
    let layout = schedule.layout();
    let at = layout
        .locate(graph)
        .ok_or_else(|| Error::invalid(format!("internal: graph {graph} out of range")))?;
    let pair = at.chunk * layout.num_microbatches() + at.microbatch;
    Ok(Slot {
        at,
        inputs: buffers.inputs(graph),
        outputs: buffers.outputs(graph),
        saved: buffers.saved(graph),
        pool,
        warmup,
        skip_weight_cast: flags.noop.get(pair),
    })
}

/// Runs segment `segment` (of kind `kind`) of the pass of `ls` for its callable on `stream`:
/// eagerly (warmup) or inside a capture (graphed segments only). `cast` applies before the
/// segment (the caller passes non-`Skip` only for a forward's cast segment).
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
    warmup: bool,
    cast: Cast<'_>,
) -> Result<()> {
    let slot = slot_of(schedule, buffers, flags, pool, ls.graph, warmup)?;
    let callable = callables
        .get_mut(ls.callable)
        .ok_or_else(|| Error::invalid(format!("internal: callable {} missing", ls.callable)))?;
    match ls.step.pass() {
        Pass::Forward => {
            match cast {
                Cast::Skip => {}
                Cast::Always => callable.cast_weights(stream, &slot)?,
                Cast::Conditional(flag) => {
                    // The handle starts every launch at 0 (no cast) and the setter copies
                    // the flag into it right before the IF node reads it.
                    let handle = ConditionalHandle::in_capture(stream, 0, true)?;
                    handle.set_from_flag_on(stream, flag)?;
                    stream.capture_if(handle, |body| callable.cast_weights(body, &slot))?;
                }
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
                SegmentKind::Graphed => callable.backward_segment(segment, stream, &go, &gi, &slot),
                SegmentKind::Eager => callable.backward_eager(segment, stream, &go, &gi, &slot),
            }
        }
        Pass::WeightGrad => Err(Error::invalid(
            "graphed callables: a separate weight-gradient pass is not supported yet",
        )),
    }
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
    /// gradients), then the sample inputs are copied into the static inputs. Warmup runs
    /// every graph's pass `warmup_iters` times in [`Schedule::layer_steps`] order (every
    /// segment, eager ones included); capture records them in that order into the one pool
    /// (one graph per graphed segment, see [`segments`](super::segments)) and instantiates
    /// and uploads each.
    ///
    /// Errors: [`Error::InvalidArgument`] for wrong counts or lengths, a callable declaring
    /// an empty segment list ([`Callable::forward_segments`]), layers of a chunk
    /// that do not chain (see [`buffers`](super#static-buffers)), a weight-gradient split
    /// or `reuse_buffers` (not implemented), a pool too small; any error of a callable, of
    /// a capture or of instantiation. Schedules are validated when built
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
            weight_caching,
            reduction_group,
            after_forward,
            after_backward,
            mut before_warmup,
            mut after_warmup,
        } = options;
        weight_caching.check()?;
        if reuse_buffers {
            return Err(Error::invalid(
                "graphed callables: reuse_buffers is not implemented yet",
            ));
        }
        if schedule.splits_weight_grad() {
            return Err(Error::invalid(
                "graphed callables: a separate weight-gradient pass (-k - 0.5) is not \
                 supported yet",
            ));
        }
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
        let plan = BufferPlan::new(&layout, &shapes)?;
        let (forward_plans, backward_plans) = segment_plans(&callables)?;
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
            if at.layer != 0 {
                continue;
            }
            let dst = buffers.plan.graphs[g].inputs.clone();
            for (src, d) in sample.iter().zip(dst) {
                if src.as_raw() != buffers.arena[d].as_raw() {
                    buffers.arena[d].copy_from_device(&cap, src)?;
                }
            }
        }

        let mut flags = CastFlags::new(
            &ctx,
            weight_caching,
            layout.num_chunks() * layout.num_microbatches(),
            layout.total_graphs(),
            &cap,
        )?;

        let mut callables = callables;
        // The caller snapshots its scaling state here and restores it after warmup (the
        // hooks); MoE filtering of amax registration also hangs off these hooks.
        if let Some(h) = before_warmup.as_mut() {
            h(&cap)?;
        }
        for _ in 0..warmup_iters {
            for ls in schedule.layer_steps() {
                // Every segment in order, eagerly (eager segments included). First-microbatch
                // semantics: every forward casts (before its first graphed segment), so lazy
                // cast state is created before capture.
                let plan = plan_of(&forward_plans, &backward_plans, ls)?;
                let cast_at = match ls.step.pass() {
                    Pass::Forward => plan.cast_segment(),
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
                        true,
                        cast,
                    )?;
                }
            }
        }
        if let Some(h) = after_warmup.as_mut() {
            h(&cap)?;
        }
        cap.synchronize()?;

        // Which forward graphs cast anything: capture each one's casts into a throwaway
        // graph (nothing runs). Graphs that cast nothing get no IF node and no flag write;
        // a forward with no graphed segment gets no runtime casts at all.
        for ls in schedule.layer_steps() {
            if ls.step.pass() != Pass::Forward
                || plan_of(&forward_plans, &backward_plans, ls)?
                    .cast_segment()
                    .is_none()
            {
                continue;
            }
            let probe = cap.capture(capture_mode, |s| {
                let slot = slot_of(&schedule, &buffers, &flags, &pool, ls.graph, false)?;
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

        let total = layout.total_graphs();
        let mut forward: Vec<Option<Vec<GraphExec>>> = (0..total).map(|_| None).collect();
        let mut backward: Vec<Option<Vec<GraphExec>>> = (0..total).map(|_| None).collect();
        let mut forward_graphs: Vec<Vec<Graph>> = (0..total).map(|_| Vec::new()).collect();
        let mut backward_graphs: Vec<Vec<Graph>> = (0..total).map(|_| Vec::new()).collect();
        for ls in schedule.layer_steps() {
            let pair = {
                let at = layout.locate(ls.graph).ok_or_else(|| {
                    Error::invalid(format!("internal: graph {} out of range", ls.graph))
                })?;
                at.chunk * layout.num_microbatches() + at.microbatch
            };
            let plan = plan_of(&forward_plans, &backward_plans, ls)?;
            let cast_at = match ls.step.pass() {
                Pass::Forward => plan.cast_segment(),
                _ => None,
            };
            let mut execs = Vec::with_capacity(plan.graphs());
            let mut graphs = Vec::with_capacity(plan.graphs());
            // One graph per graphed segment, in segment order; eager segments are never
            // captured.
            for run in plan.runs() {
                let SegmentRun::Graphed { segment, .. } = run else {
                    continue;
                };
                let cast = match (
                    cast_at == Some(segment),
                    flags.casts[ls.graph],
                    weight_caching,
                ) {
                    (true, true, WeightCaching::Conditional) => {
                        Cast::Conditional(flags.cond.get(pair).ok_or_else(|| {
                            Error::invalid(format!("internal: no cast flag for pair {pair}"))
                        })?)
                    }
                    (true, true, WeightCaching::NoopFlag) => Cast::Always,
                    _ => Cast::Skip,
                };
                let graph = cap.capture(capture_mode, |s| {
                    run_segment(
                        &mut callables,
                        &schedule,
                        &buffers,
                        &flags,
                        &pool,
                        ls,
                        segment,
                        SegmentKind::Graphed,
                        s.stream(),
                        false,
                        cast,
                    )
                })?;
                let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
                exec.upload(&cap)?;
                execs.push(exec);
                graphs.push(graph);
            }
            let (slot, kept) = match ls.step.pass() {
                Pass::Forward => (&mut forward[ls.graph], &mut forward_graphs[ls.graph]),
                _ => (&mut backward[ls.graph], &mut backward_graphs[ls.graph]),
            };
            *slot = Some(execs);
            *kept = graphs;
        }
        let collect = |v: Vec<Option<Vec<GraphExec>>>, what: &str| {
            v.into_iter()
                .enumerate()
                .map(|(g, e)| {
                    e.ok_or_else(|| {
                        Error::invalid(format!("the schedule never runs the {what} of graph {g}"))
                    })
                })
                .collect::<Result<Vec<_>>>()
        };
        let forward = collect(forward, "forward")?;
        let backward = collect(backward, "backward")?;
        stream.wait_stream(&cap)?;
        Ok(GraphedCallables {
            schedule,
            callables,
            buffers,
            forward,
            backward,
            forward_plans,
            backward_plans,
            pool,
            cursor: Cell::new(ReplayCursor::default()),
            ctx,
            copies: Cell::new(0),
            forward_graphs,
            backward_graphs,
            weights: flags,
            hooks: RefCell::new(ReplayHooks {
                after_forward,
                after_backward,
            }),
            reduction_group,
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

    /// The forward exec of graph index `graph`: that of its forward's first graphed segment
    /// (the only one for a single-graph forward). `None` if out of range or the forward has
    /// no graphed segment.
    pub fn forward_exec(&self, graph: usize) -> Option<&GraphExec> {
        self.forward.get(graph)?.first()
    }

    /// The backward exec of graph index `graph`: that of its backward's first graphed
    /// segment. `None` if out of range or the backward has no graphed segment.
    pub fn backward_exec(&self, graph: usize) -> Option<&GraphExec> {
        self.backward.get(graph)?.first()
    }

    /// The exec of forward segment `segment` of graph index `graph`; `None` if out of range
    /// or that segment is eager.
    pub fn forward_segment_exec(&self, graph: usize, segment: usize) -> Option<&GraphExec> {
        let k = self.forward_plan(graph)?.graph_of(segment)?;
        self.forward.get(graph)?.get(k)
    }

    /// The exec of backward segment `segment` of graph index `graph`; `None` if out of
    /// range or that segment is eager.
    pub fn backward_segment_exec(&self, graph: usize, segment: usize) -> Option<&GraphExec> {
        let k = self.backward_plan(graph)?.graph_of(segment)?;
        self.backward.get(graph)?.get(k)
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

    /// The captured forward graph of graph index `graph` (the source of
    /// [`forward_exec`](Self::forward_exec): its first graphed segment), for inspecting its
    /// structure; `None` if out of range or the forward has no graphed segment. With
    /// [`WeightCaching::Conditional`] and a callable that casts, it holds the setter kernel
    /// and the IF node ([`NodeKind::Conditional`](crate::NodeKind::Conditional)).
    pub fn forward_graph(&self, graph: usize) -> Option<&Graph> {
        self.forward_graphs.get(graph)?.first()
    }

    /// The captured backward graph of graph index `graph` (its first graphed segment);
    /// `None` if out of range or the backward has no graphed segment.
    pub fn backward_graph(&self, graph: usize) -> Option<&Graph> {
        self.backward_graphs.get(graph)?.first()
    }

    /// The captured graph of forward segment `segment` of graph index `graph`; `None` if
    /// out of range or that segment is eager.
    pub fn forward_segment_graph(&self, graph: usize, segment: usize) -> Option<&Graph> {
        let k = self.forward_plan(graph)?.graph_of(segment)?;
        self.forward_graphs.get(graph)?.get(k)
    }

    /// The captured graph of backward segment `segment` of graph index `graph`; `None` if
    /// out of range or that segment is eager.
    pub fn backward_segment_graph(&self, graph: usize, segment: usize) -> Option<&Graph> {
        let k = self.backward_plan(graph)?.graph_of(segment)?;
        self.backward_graphs.get(graph)?.get(k)
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

    /// The amax reduction group of the options.
    pub fn reduction_group(&self) -> &Arc<dyn ReductionGroup> {
        &self.reduction_group
    }
}
