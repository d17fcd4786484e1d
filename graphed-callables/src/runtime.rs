//! The graphed callables' options and state; building is in `build.rs`, replaying in
//! `replay.rs`.

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use crate::error::Result;
use cuda_graph::CaptureMode;
use cuda_graph::Context;
use cuda_graph::Graph;
use cuda_graph::GraphExec;
use cuda_graph::GraphPool;
use cuda_graph::Stream;
use cuda_graph::{DeviceBuffer, DeviceRepr};

use crate::buffers::StaticBuffers;
use crate::callable::Callable;
use crate::program::Programs;
use crate::replay::ReplayCursor;
use crate::schedule::{Pass, Schedule};
use crate::segments::SegmentPlan;
use crate::weights::{
    AfterWarmupHook, LowPrecision, StepHook, WarmupHook, WarmupRecord, WeightCaching,
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
    /// The pool the static buffers and the callables' temporaries ([`Slot::pool`](crate::Slot::pool)) come
    /// from. Default `None`: a new pool sized for the static buffers plus
    /// [`scratch_bytes`](Self::scratch_bytes).
    ///
    /// A pool's graphs must run one at a time, in capture order: the temporaries a capture
    /// freed are reused by the next capture, so their addresses are baked into several
    /// graphs. Give each build a pool of its own (two builds over one pool would put one's
    /// static buffers on the other's temporaries), and do not allocate from it outside the
    /// runtime (see [`GraphedCallables::pool`]).
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
    /// each step. Default [`WeightCaching::Static`] (casts only in the first microbatch's
    /// graphs: the cheapest, on any driver); [`WeightCaching::detect`] picks the best
    /// device-flag mechanism instead. See [`weights`](crate::weights).
    pub weight_caching: WeightCaching,
    /// Which callables run with FP8 ([`Slot::low_precision`](crate::Slot::low_precision)); callables with FP8 off get no
    /// runtime-managed weight casts. Default [`LowPrecision::All`].
    pub low_precision: LowPrecision,
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
    /// [`Slot::record_tensors`](crate::Slot::record_tensors)): restore what [`before_warmup`](Self::before_warmup)
    /// saved, so the delayed-scaling history does not carry warmup's iterations, and
    /// register the tensors that ran for the amax reduction (MoE filtering, see
    /// [`weights`](crate::weights)). Default `None`.
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
            .field("low_precision", &self.low_precision)
            .field("after_forward", &hook(self.after_forward.is_some()))
            .field("after_backward", &hook(self.after_backward.is_some()))
            .field("before_warmup", &hook(self.before_warmup.is_some()))
            .field("after_warmup", &hook(self.after_warmup.is_some()))
            .finish()
    }
}

impl GraphedOptions {
    /// The defaults for the schedule of `order` with `layers_per_chunk`
    /// ([`Schedule::new`]); an invalid order is [`Error::Schedule`](crate::Error::Schedule) naming the position.
    pub fn from_order(order: &[i64], layers_per_chunk: Vec<usize>) -> Result<GraphedOptions> {
        Ok(GraphedOptions::new(Schedule::new(order, layers_per_chunk)?))
    }

    /// The defaults for `schedule`: 3 warmup iterations, no buffer reuse, a new pool with
    /// no scratch, thread-local capture, one graph per step (layers merged), static weight
    /// casts ([`WeightCaching::Static`]), FP8 on for every callable, the identity reduction
    /// group, no hooks.
    pub fn new(schedule: Schedule) -> GraphedOptions {
        GraphedOptions {
            schedule,
            warmup_iters: 3,
            reuse_buffers: false,
            pool: None,
            scratch_bytes: 0,
            capture_mode: CaptureMode::ThreadLocal,
            merge_layers: true,
            weight_caching: WeightCaching::Static,
            low_precision: LowPrecision::All,
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
    pub(crate) warmup_record: WarmupRecord,
    /// The buffer set of each (chunk, microbatch) ([`buffer_sets`]).
    pub(crate) sets: Vec<usize>,
    /// The stream of the latest replay (the build's before the first): a replay on another
    /// stream first waits for it ([`GraphedCallables::follow_previous`]).
    pub(crate) last_stream: RefCell<Option<Stream>>,
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
    /// Per callable: FP8 on ([`GraphedOptions::low_precision`]).
    pub(crate) fp8: Vec<bool>,
}

impl CastFlags {
    /// The flags of `pairs` (chunk, microbatch) pairs for `mode`, starting at "cast";
    /// `casts` empty until the build's probe fills it.
    pub(crate) fn new(
        ctx: &Arc<Context>,
        mode: WeightCaching,
        pairs: usize,
        fp8: Vec<bool>,
        stream: &Stream,
    ) -> Result<CastFlags> {
        let mut flags = CastFlags {
            mode,
            cond: Vec::new(),
            noop: Vec::new(),
            casts: Vec::new(),
            fp8,
        };
        // Warmup casts on every microbatch: the flags start at "cast" (1 for IF, 0.0 for
        // the noop flag). A mode without a flag (Static) gets none.
        let Some(bits) = mode.flag_bits(true) else {
            return Ok(flags);
        };
        for _ in 0..pairs {
            if mode == WeightCaching::Conditional {
                let b = DeviceBuffer::<i32>::alloc(ctx, 1)?;
                b.fill_u32_bits(stream, bits)?;
                flags.cond.push(b);
            } else {
                let b = DeviceBuffer::<f32>::alloc(ctx, 1)?;
                b.fill_u32_bits(stream, bits)?;
                flags.noop.push(b);
            }
        }
        Ok(flags)
    }

    /// The flag buffer of pair `pair` as one 32-bit word (whichever the mode uses; `None`
    /// for [`WeightCaching::Static`], which has none).
    pub(crate) fn flag_word(&self, pair: usize) -> Option<DeviceBuffer<u32>> {
        match self.mode {
            WeightCaching::Conditional => self.cond.get(pair)?.reinterpret().ok(),
            WeightCaching::NoopFlag => self.noop.get(pair)?.reinterpret().ok(),
            WeightCaching::Static => None,
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

impl<T: DeviceRepr> GraphedCallables<T> {
    /// The schedule the graphs were captured for.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The pool every static buffer and captured temporary came from. For inspection: a
    /// buffer allocated from it now could take a range a captured graph still uses as a
    /// temporary (graphs keep the pool's memory alive, not their ranges of it).
    pub fn pool(&self) -> &GraphPool {
        &self.pool
    }

    /// The context of the graphs.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The callables, by [`Layout::callable_index`](crate::Layout::callable_index).
    pub fn callables(&self) -> &[Box<dyn Callable<T>>] {
        &self.callables
    }

    /// The parameters graph `graph` (forward and backward) runs with: those of its
    /// callable ([`Layout::callable_of_graph`](crate::Layout::callable_of_graph)). `None`
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
    /// kernel and one IF node ([`NodeKind::Conditional`](cuda_graph::NodeKind::Conditional))
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
    /// [`Callable::cast_weights`] at the build's probe (only such graphs get the IF node or
    /// the flag writes; the casts sit in the forward's first graphed segment, and with
    /// [`WeightCaching::Static`] only in the first microbatch's graphs); `false` for a
    /// forward with no graphed segment or FP8 off (the runtime does not cast for it); `None`
    /// if out of range.
    pub fn casts_weights(&self, graph: usize) -> Option<bool> {
        self.weights.casts.get(graph).copied()
    }

    /// What warmup recorded: the FP8 tensors each callable reported running
    /// ([`Slot::record_tensors`](crate::Slot::record_tensors)), the set [`GraphedOptions::after_warmup`] was given.
    pub fn warmup_record(&self) -> &WarmupRecord {
        &self.warmup_record
    }
}
