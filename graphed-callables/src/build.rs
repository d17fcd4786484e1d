//! Building graphed callables: validation and static buffers, warmup, the weight-cast
//! probe, capture. [`GraphedCallables::build`] runs these phases in order; [`Rig`] is what
//! each needs besides the callables (and what replays need to run eager segments).

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use cuda_graph::CaptureMode;
use cuda_graph::ConditionalHandle;
use cuda_graph::Event;
use cuda_graph::Graph;
use cuda_graph::GraphPool;
use cuda_graph::Stream;
use cuda_graph::{DeviceBuffer, DeviceRepr};
use cuda_graph::{Error, Result};
use cuda_graph::{GraphExec, InstantiateFlags};

use crate::buffers::{BufferPlan, Shapes, StaticBuffers, buffer_sets};
use crate::callable::{Callable, Slot};
use crate::program::{Item, Part, Programs};
use crate::replay::{ReplayCursor, copy_in};
use crate::runtime::{CastFlags, GraphedCallables, GraphedOptions, ReplayHooks};
use crate::schedule::{LayerStep, Pass, Schedule};
use crate::segments::{SegmentKind, SegmentPlan};
use crate::weights::{TensorRecorder, WarmupRecord, WeightCaching};

/// The callables, boxed.
type Callables<T> = [Box<dyn Callable<T>>];

/// What running one segment of a (chunk, microbatch, layer) needs besides its callable:
/// the schedule, the static buffers, the weight-cast flags, the pool and the segment plans.
pub(crate) struct Rig<'a, T: DeviceRepr> {
    pub(crate) schedule: &'a Schedule,
    pub(crate) buffers: &'a StaticBuffers<T>,
    pub(crate) flags: &'a CastFlags,
    pub(crate) pool: &'a GraphPool,
    pub(crate) forward_plans: &'a [SegmentPlan],
    pub(crate) backward_plans: &'a [SegmentPlan],
}

/// Whether a forward's weight casts run right before its cast segment.
#[derive(Clone, Copy)]
enum Cast<'e> {
    /// No cast here (backward passes, a forward whose callable casts nothing or has FP8
    /// off, or casts already captured in the graph's IF node).
    Skip,
    /// `cast_weights` then the segment, unconditionally (warmup; the noop-flag mechanism).
    Always,
    /// The casts were captured on a forked stream ending in this event: the segment runs
    /// beside them and waits for it ([`Slot::wait_weight_cast`]) before reading the weights.
    Beside(&'e Arc<Event>),
}

/// Callable `c`.
fn callable_mut<T: DeviceRepr>(
    callables: &mut Callables<T>,
    c: usize,
) -> Result<&mut Box<dyn Callable<T>>> {
    callables
        .get_mut(c)
        .ok_or_else(|| Error::invalid(format!("internal: callable {c} missing")))
}

impl<'a, T: DeviceRepr> Rig<'a, T> {
    /// The slot of graph index `graph`; `recorder` is given in warmup only.
    pub(crate) fn slot(
        &self,
        graph: usize,
        recorder: Option<&'a TensorRecorder>,
    ) -> Result<Slot<'a, T>> {
        let layout = self.schedule.layout();
        let at = layout
            .locate(graph)
            .ok_or_else(|| Error::invalid(format!("internal: graph {graph} out of range")))?;
        let pair = at.chunk * layout.num_microbatches() + at.microbatch;
        let fp8 = layout
            .callable_of_graph(graph)
            .and_then(|c| self.flags.fp8.get(c).copied())
            .unwrap_or(true);
        Ok(Slot {
            at,
            inputs: self.buffers.inputs(graph),
            outputs: self.buffers.outputs(graph),
            saved: self.buffers.saved(graph),
            pool: Some(self.pool),
            warmup: recorder.is_some(),
            skip_weight_cast: self.flags.noop.get(pair),
            weight_cast: None,
            recorder,
            fp8,
        })
    }

    /// The segment plan of `ls`'s pass (a weight-gradient pass has its backward's, which
    /// build checked is the single default segment).
    fn plan(&self, ls: LayerStep) -> Result<&'a SegmentPlan> {
        let plans = match ls.step.pass() {
            Pass::Forward => self.forward_plans,
            _ => self.backward_plans,
        };
        plans.get(ls.callable).ok_or_else(|| {
            Error::invalid(format!("internal: callable {} has no plan", ls.callable))
        })
    }

    /// The segment of `ls`'s forward that the runtime casts weights before: the first graphed
    /// one, for callables with FP8 on; `None` for other passes.
    fn cast_segment(&self, ls: LayerStep) -> Result<Option<usize>> {
        Ok(match ls.step.pass() {
            Pass::Forward if self.flags.fp8.get(ls.callable) == Some(&true) => {
                self.plan(ls)?.cast_segment()
            }
            _ => None,
        })
    }

    /// Runs segment `segment` (of kind `kind`) of `ls`'s pass on `stream`: eagerly (warmup,
    /// with the callable's `recorder`) or inside a capture (graphed segments only,
    /// `recorder` `None`), after the weight casts when `cast` says so.
    #[allow(clippy::too_many_arguments)]
    fn run_segment(
        &self,
        callables: &mut Callables<T>,
        ls: LayerStep,
        segment: usize,
        kind: SegmentKind,
        stream: &Stream,
        recorder: Option<&'a TensorRecorder>,
        cast: Cast<'_>,
    ) -> Result<()> {
        let mut slot = self.slot(ls.graph, recorder)?;
        let callable = callable_mut(callables, ls.callable)?;
        match cast {
            Cast::Always if ls.step.pass() == Pass::Forward => {
                callable.cast_weights(stream, &slot)?
            }
            Cast::Beside(event) => slot.weight_cast = Some(event.clone()),
            _ => {}
        }
        if kind == SegmentKind::Eager {
            return self.run_eager_with(&**callable, ls, segment, stream, &slot);
        }
        let go = || self.buffers.grad_outputs(ls.graph);
        let gi = || self.buffers.grad_inputs(ls.graph);
        match ls.step.pass() {
            Pass::Forward => {
                callable.forward_segment(segment, stream, &slot.inputs, &slot.outputs, &slot)
            }
            // Split weight gradients: the backward step computes input gradients only.
            Pass::Backward if self.schedule.splits_weight_grad() => {
                callable.backward_input(stream, &go(), &gi(), &slot)
            }
            Pass::Backward => callable.backward_segment(segment, stream, &go(), &gi(), &slot),
            Pass::WeightGrad => callable.backward_weight(stream, &go(), &slot),
        }
    }

    /// Runs eager segment `segment` of `ls`'s pass (in warmup, and between the launches of
    /// a replay) with the slot's buffers.
    pub(crate) fn run_eager(
        &self,
        callable: &dyn Callable<T>,
        ls: LayerStep,
        segment: usize,
        stream: &Stream,
    ) -> Result<()> {
        let slot = self.slot(ls.graph, None)?;
        self.run_eager_with(callable, ls, segment, stream, &slot)
    }

    fn run_eager_with(
        &self,
        callable: &dyn Callable<T>,
        ls: LayerStep,
        segment: usize,
        stream: &Stream,
        slot: &Slot<'a, T>,
    ) -> Result<()> {
        match ls.step.pass() {
            Pass::Forward => {
                callable.forward_eager(segment, stream, &slot.inputs, &slot.outputs, slot)
            }
            _ => {
                let go = self.buffers.grad_outputs(ls.graph);
                let gi = self.buffers.grad_inputs(ls.graph);
                callable.backward_eager(segment, stream, &go, &gi, slot)
            }
        }
    }

    /// Runs every pass `iters` times in [`Schedule::layer_steps`] order on `stream`, every
    /// segment eagerly, each callable reporting to its recorder; copies each (chunk,
    /// microbatch)'s samples into its static inputs right before its forward. Every forward
    /// casts first (first-microbatch semantics), so lazy cast state exists before capture.
    fn warmup(
        &self,
        callables: &mut Callables<T>,
        samples: &[Vec<&DeviceBuffer<T>>],
        iters: usize,
        recorders: &'a [TensorRecorder],
        stream: &Stream,
    ) -> Result<()> {
        for _ in 0..iters {
            for ls in self.schedule.layer_steps() {
                if ls.step.pass() == Pass::Forward && ls.layer == 0 {
                    self.copy_samples(samples, ls.graph, stream)?;
                }
                let cast_at = self.cast_segment(ls)?;
                for (segment, &kind) in self.plan(ls)?.kinds().iter().enumerate() {
                    let cast = if cast_at == Some(segment) {
                        Cast::Always
                    } else {
                        Cast::Skip
                    };
                    let recorder = recorders.get(ls.callable);
                    self.run_segment(callables, ls, segment, kind, stream, recorder, cast)?;
                }
            }
        }
        Ok(())
    }

    /// Copies graph `graph`'s sample inputs into its static inputs on `stream` (those that
    /// are not the static buffers themselves).
    fn copy_samples(
        &self,
        samples: &[Vec<&DeviceBuffer<T>>],
        graph: usize,
        stream: &Stream,
    ) -> Result<()> {
        let layout = self.schedule.layout();
        let Some(sample) = layout.callable_of_graph(graph).and_then(|c| samples.get(c)) else {
            return Ok(());
        };
        // Lengths were checked by check_samples.
        for (src, dst) in sample.iter().zip(self.buffers.inputs(graph)) {
            copy_in(dst, src, stream)?;
        }
        Ok(())
    }

    /// Per forward graph index, whether its callable's `cast_weights` enqueues anything:
    /// captured once into a throwaway graph (nothing runs). Forwards with no graphed
    /// segment or with FP8 off get `false` (the runtime does not cast for them).
    fn probe_casts(
        &self,
        callables: &mut Callables<T>,
        mode: CaptureMode,
        stream: &Stream,
    ) -> Result<Vec<bool>> {
        let mut casts = vec![false; self.schedule.layout().total_graphs()];
        for ls in self.schedule.layer_steps() {
            if self.cast_segment(ls)?.is_none() {
                continue;
            }
            let probe = stream.capture(mode, |s| self.cast_weights(callables, ls, s.stream()))?;
            casts[ls.graph] = !probe.nodes()?.is_empty();
        }
        Ok(casts)
    }

    /// `ls`'s callable's `cast_weights` with its (non-warmup) slot.
    fn cast_weights(
        &self,
        callables: &mut Callables<T>,
        ls: LayerStep,
        stream: &Stream,
    ) -> Result<()> {
        let slot = self.slot(ls.graph, None)?;
        callable_mut(callables, ls.callable)?.cast_weights(stream, &slot)
    }

    /// Whether the graph of `part` holds that layer's weight casts: its forward's cast
    /// segment, when the probe found casts.
    fn casts_at(&self, part: &Part) -> Result<bool> {
        Ok(self.flags.casts.get(part.ls.graph) == Some(&true)
            && self.cast_segment(part.ls)? == Some(part.segment))
    }

    /// Captures one graph per launch item of `programs`, in schedule order, on `stream`;
    /// instantiates and uploads each.
    fn capture(
        &self,
        callables: &mut Callables<T>,
        programs: &Programs,
        mode: CaptureMode,
        caching: WeightCaching,
        stream: &Stream,
    ) -> Result<(Vec<GraphExec>, Vec<Graph>)> {
        let mut execs = Vec::with_capacity(programs.execs());
        let mut graphs = Vec::with_capacity(programs.execs());
        for item in programs.steps().flatten() {
            let Item::Launch { exec, parts } = item else {
                continue;
            };
            debug_assert_eq!(*exec, execs.len());
            let mut casting = Vec::new();
            for part in parts {
                if self.casts_at(part)? {
                    casting.push(*part);
                }
            }
            // Noop flag: always captured, the kernels skip on the device. Static: captured
            // in the first microbatch's graphs only. Conditional: in the IF node.
            let captured = |part: &Part| {
                casting.contains(part)
                    && match caching {
                        WeightCaching::NoopFlag => true,
                        WeightCaching::Static => part.ls.step.is_first_microbatch(),
                        WeightCaching::Conditional => false,
                    }
            };
            let beside = Self::casts_beside(callables, &casting, caching, &captured);
            let graph = stream.capture(mode, |s| {
                let main = s.stream().clone();
                // Casts beside the segments: on a fork, which the segments wait for through
                // their slots (Callable::overlaps_weight_cast) and the graph's end joins.
                let side = if beside { Some(s.fork()?) } else { None };
                let cast_stream = side.as_ref().unwrap_or(&main);
                if caching == WeightCaching::Conditional && !casting.is_empty() {
                    self.capture_cast_if(callables, &casting, cast_stream)?;
                }
                let ready = match &side {
                    Some(side) => {
                        for part in casting.iter().filter(|p| captured(p)) {
                            self.cast_weights(callables, part.ls, side)?;
                        }
                        let event = Arc::new(Event::for_sync(side.context())?);
                        event.record(side)?;
                        Some(event)
                    }
                    None => None,
                };
                for part in parts {
                    let cast = match &ready {
                        Some(event) if casting.contains(part) => Cast::Beside(event),
                        None if captured(part) => Cast::Always,
                        _ => Cast::Skip,
                    };
                    let (ls, seg) = (part.ls, part.segment);
                    self.run_segment(callables, ls, seg, SegmentKind::Graphed, &main, None, cast)?;
                }
                if let Some(side) = &side {
                    s.join(side)?;
                }
                Ok(())
            })?;
            let e = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
            e.upload(stream)?;
            execs.push(e);
            graphs.push(graph);
        }
        Ok((execs, graphs))
    }

    /// Whether a graph's weight casts go on a fork beside its segments: there are casts to
    /// capture in it (an IF node, or `captured` parts) and every casting part's callable
    /// [overlaps](Callable::overlaps_weight_cast) them.
    fn casts_beside(
        callables: &Callables<T>,
        casting: &[Part],
        caching: WeightCaching,
        captured: &dyn Fn(&Part) -> bool,
    ) -> bool {
        let any = match caching {
            WeightCaching::Conditional => !casting.is_empty(),
            _ => casting.iter().any(captured),
        };
        any && casting.iter().all(|part| {
            callables
                .get(part.ls.callable)
                .is_some_and(|c| c.overlaps_weight_cast())
        })
    }

    /// Captures, on the capturing `stream`, one IF node holding the casts of every part in
    /// `casting` (all of one step): a setter kernel copies the step's flag into the handle,
    /// which starts every launch at 0 (no cast). Casts read only the weights, so casting a
    /// later layer's before an earlier layer's forward changes nothing.
    fn capture_cast_if(
        &self,
        callables: &mut Callables<T>,
        casting: &[Part],
        stream: &Stream,
    ) -> Result<()> {
        let Some(first) = casting.first() else {
            return Ok(());
        };
        let step = first.ls.step;
        let pair = step.chunk() * self.schedule.num_microbatches() + step.microbatch();
        let flag = self
            .flags
            .cond
            .get(pair)
            .ok_or_else(|| Error::invalid(format!("internal: no cast flag for pair {pair}")))?;
        let handle = ConditionalHandle::in_capture(stream, 0, true)?;
        handle.set_from_flag_on(stream, flag)?;
        stream.capture_if(handle, |body| {
            casting
                .iter()
                .try_for_each(|part| self.cast_weights(callables, part.ls, body))
        })
    }
}

/// The validated segment plans of every callable, forward and backward.
fn segment_plans<T: DeviceRepr>(
    callables: &Callables<T>,
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

/// Checks that the sample inputs fit: one set per callable; the first callable of each
/// chunk's with the lengths it takes, any other's empty or with its lengths.
fn check_samples<T: DeviceRepr>(
    schedule: &Schedule,
    shapes: &[Shapes],
    samples: &[Vec<&DeviceBuffer<T>>],
) -> Result<()> {
    let layout = schedule.layout();
    if samples.len() != layout.total_callables() {
        return Err(Error::invalid(format!(
            "{} sets of sample inputs given, one per callable ({}) needed",
            samples.len(),
            layout.total_callables()
        )));
    }
    for chunk in 0..layout.num_chunks() {
        let callables = layout
            .chunk_callables(chunk)
            .ok_or_else(|| Error::invalid(format!("internal: chunk {chunk} out of range")))?;
        let first = callables.start;
        for c in callables {
            let sample = &samples[c];
            if c != first && sample.is_empty() {
                continue;
            }
            let want = &shapes[c].inputs;
            let got: Vec<usize> = sample.iter().map(|b| b.len()).collect();
            if &got != want {
                return Err(Error::invalid(format!(
                    "sample inputs of callable {c} (chunk {chunk}, layer {}) have lengths \
                     {got:?}, the callable takes {want:?}",
                    c - first
                )));
            }
        }
    }
    Ok(())
}

impl<T: DeviceRepr> GraphedCallables<T> {
    /// Allocates the static buffers, warms up and captures every graph.
    ///
    /// * `stream`: the work is ordered after what `stream` holds, and `stream` waits for
    ///   it at the end (nothing here synchronizes it). Warmup and capture both run on one
    ///   internal stream forked from it, so handles a callable creates lazily per stream
    ///   are made during warmup on the very stream capture then uses.
    /// * `callables`: one per (chunk, layer), at [`Layout::callable_index`](crate::Layout::callable_index).
    /// * `sample_inputs`: per callable (same order as `callables`), the inputs warmup and
    ///   capture use, for every microbatch. Only the first callable of each chunk reads them
    ///   (later layers read their predecessor's outputs); the others' may be empty (if
    ///   given, their lengths are checked and the data unused).
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
    /// Errors: [`InvalidArgument`](cuda_graph::Error::InvalidArgument) for wrong counts or lengths, a callable declaring
    /// an empty segment list ([`Callable::forward_segments`]), layers of a chunk that do not
    /// chain (see [`buffers`](super#static-buffers)), a schedule with weight-gradient steps
    /// and a callable with a segmented backward, a per-callable FP8 list of the wrong
    /// length, a pool too small; any error of a callable, of a capture or of
    /// instantiation. Schedules are validated when built
    /// ([`Error::Schedule`](crate::Error::Schedule)).
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
            low_precision: fp8,
            after_forward,
            after_backward,
            mut before_warmup,
            mut after_warmup,
        } = options;
        weight_caching.check()?;
        let mut callables = callables;

        // Validation and static buffers.
        let layout = schedule.layout().clone();
        let shapes: Vec<Shapes> = callables
            .iter()
            .map(|c| Shapes {
                inputs: c.input_lens(),
                outputs: c.output_lens(),
                saved: c.saved_bytes(),
            })
            .collect();
        let sets = buffer_sets(&schedule, reuse_buffers);
        let plan = BufferPlan::new(&layout, &shapes, &sets)?;
        check_samples(&schedule, &shapes, sample_inputs)?;
        let (forward_plans, backward_plans) = segment_plans(&callables)?;
        if schedule.splits_weight_grad()
            && let Some(c) = backward_plans.iter().position(|p| !p.is_single_graph())
        {
            return Err(Error::invalid(format!(
                "callable {c} splits its backward into segments; a schedule with separate \
                 weight-gradient steps (-k - 0.5) needs single-graph backwards"
            )));
        }
        let fp8 = fp8.resolve(layout.total_callables())?;
        let programs = Programs::new(&schedule, &forward_plans, &backward_plans, merge_layers)?;
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
        let buffers = StaticBuffers::<T>::alloc(plan, &pool)?;
        let cap = Stream::new(&ctx)?;
        cap.wait_stream(stream)?;
        // Every static buffer starts at zero, saved buffers included: a callable that reads a
        // saved buffer it writes only on some passes (or a tensor view past what it wrote)
        // sees zeros, never stale pool memory.
        for b in &buffers.arena {
            b.memset_bytes(&cap, 0)?;
        }
        for b in &buffers.saved_arena {
            b.memset_bytes(&cap, 0)?;
        }
        let pairs = layout.num_chunks() * layout.num_microbatches();
        let mut flags = CastFlags::new(&ctx, weight_caching, pairs, fp8, &cap)?;

        // A fresh set of borrows each time (`flags.casts` is filled in between).
        macro_rules! rig {
            () => {
                Rig {
                    schedule: &schedule,
                    buffers: &buffers,
                    flags: &flags,
                    pool: &pool,
                    forward_plans: &forward_plans,
                    backward_plans: &backward_plans,
                }
            };
        }

        // Warmup, between the caller's hooks (snapshot; restore and register what ran).
        let recorders: Vec<TensorRecorder> =
            callables.iter().map(|_| TensorRecorder::new()).collect();
        if let Some(h) = before_warmup.as_mut() {
            h(&cap)?;
        }
        rig!().warmup(
            &mut callables,
            sample_inputs,
            warmup_iters,
            &recorders,
            &cap,
        )?;
        let warmup_record =
            WarmupRecord::new(recorders.iter().map(TensorRecorder::tensors).collect());
        if let Some(h) = after_warmup.as_mut() {
            h(&cap, &warmup_record)?;
        }
        // Warmup's backwards added into the parameter gradients (zeros for a linear layer,
        // not for an aux loss's or a regularizer's terms): training starts from zero.
        for c in &callables {
            for g in c.gradients() {
                g.memset_bytes(&cap, 0)?;
            }
        }
        cap.synchronize()?;

        // Which forwards cast anything: only those get an IF node or the flag writes.
        flags.casts = rig!().probe_casts(&mut callables, capture_mode, &cap)?;
        if weight_caching == WeightCaching::Conditional && flags.casts.iter().any(|&c| c) {
            // Loaded outside any capture: loading a module may invalidate a global capture.
            ConditionalHandle::load_helpers(&ctx)?;
        }

        // Capture, step by step in schedule order.
        let (execs, graphs) = rig!().capture(
            &mut callables,
            &programs,
            capture_mode,
            weight_caching,
            &cap,
        )?;
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
            warmup_record,
            sets,
            last_stream: RefCell::new(Some(stream.clone())),
        })
    }

    /// The rig of these graphs (for eager segments at replay).
    pub(crate) fn rig(&self) -> Rig<'_, T> {
        Rig {
            schedule: &self.schedule,
            buffers: &self.buffers,
            flags: &self.weights,
            pool: &self.pool,
            forward_plans: &self.forward_plans,
            backward_plans: &self.backward_plans,
        }
    }
}
