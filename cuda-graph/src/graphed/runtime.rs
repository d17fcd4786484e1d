//! Building graphed callables: static buffers, warmup, capture.

use std::cell::Cell;
use std::sync::Arc;

use crate::capture::CaptureMode;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::exec::{GraphExec, InstantiateFlags};
use crate::memory::{DeviceBuffer, DeviceRepr};
use crate::pool::GraphPool;
use crate::stream::Stream;

use super::buffers::{BufferPlan, Shapes, StaticBuffers};
use super::callable::{Callable, Slot};
use super::replay::ReplayCursor;
use super::schedule::{LayerStep, Pass, Schedule};

/// How [`GraphedCallables::build`] works.
#[derive(Debug, Clone)]
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
}

impl GraphedOptions {
    /// The defaults for the schedule of `order` with `layers_per_chunk`
    /// ([`Schedule::new`]); an invalid order is [`Error::Schedule`] naming the position.
    pub fn from_order(order: &[i64], layers_per_chunk: Vec<usize>) -> Result<GraphedOptions> {
        Ok(GraphedOptions::new(Schedule::new(order, layers_per_chunk)?))
    }

    /// The defaults for `schedule`: 3 warmup iterations, no buffer reuse, a new pool with
    /// no scratch, thread-local capture.
    pub fn new(schedule: Schedule) -> GraphedOptions {
        GraphedOptions {
            schedule,
            warmup_iters: 3,
            reuse_buffers: false,
            pool: None,
            scratch_bytes: 0,
            capture_mode: CaptureMode::ThreadLocal,
        }
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
    /// Forward execs by graph index ([`Layout::index`](super::Layout::index)).
    pub(crate) forward: Vec<GraphExec>,
    /// Backward execs by graph index.
    pub(crate) backward: Vec<GraphExec>,
    pub(crate) pool: GraphPool,
    pub(crate) cursor: Cell<ReplayCursor>,
    pub(crate) ctx: Arc<Context>,
    /// Input and output-gradient copies enqueued by replays.
    pub(crate) copies: Cell<u64>,
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

/// Runs the pass of `ls` for its callable on `stream` (eagerly, or inside a capture).
fn run_pass<T: DeviceRepr>(
    callables: &mut [Box<dyn Callable<T>>],
    schedule: &Schedule,
    buffers: &StaticBuffers<T>,
    pool: &GraphPool,
    ls: LayerStep,
    stream: &Stream,
    warmup: bool,
) -> Result<()> {
    let at = schedule
        .layout()
        .locate(ls.graph)
        .ok_or_else(|| Error::invalid(format!("internal: graph {} out of range", ls.graph)))?;
    let slot = Slot {
        at,
        inputs: buffers.inputs(ls.graph),
        outputs: buffers.outputs(ls.graph),
        saved: buffers.saved(ls.graph),
        pool,
        warmup,
    };
    let callable = callables
        .get_mut(ls.callable)
        .ok_or_else(|| Error::invalid(format!("internal: callable {} missing", ls.callable)))?;
    match ls.step.pass() {
        Pass::Forward => callable.forward(stream, &slot.inputs, &slot.outputs, &slot),
        Pass::Backward => {
            let go = buffers.grad_outputs(ls.graph);
            let gi = buffers.grad_inputs(ls.graph);
            callable.backward(stream, &go, &gi, &slot)
        }
        Pass::WeightGrad => Err(Error::invalid(
            "graphed callables: a separate weight-gradient pass is not supported yet",
        )),
    }
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
    /// every graph's pass `warmup_iters` times in [`Schedule::layer_steps`] order; capture
    /// records them in that order into the one pool and instantiates and uploads each.
    ///
    /// Errors: [`Error::InvalidArgument`] for wrong counts or lengths, layers of a chunk
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
        } = options;
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

        let mut callables = callables;
        // Extension point (FP8): snapshot the callables' scaling state here and restore it
        // after warmup; record which FP8 modules each callable ran for amax registration.
        for _ in 0..warmup_iters {
            for ls in schedule.layer_steps() {
                run_pass(&mut callables, &schedule, &buffers, &pool, ls, &cap, true)?;
            }
        }
        cap.synchronize()?;

        let mut forward: Vec<Option<GraphExec>> =
            (0..layout.total_graphs()).map(|_| None).collect();
        let mut backward: Vec<Option<GraphExec>> =
            (0..layout.total_graphs()).map(|_| None).collect();
        for ls in schedule.layer_steps() {
            let graph = cap.capture(capture_mode, |s| {
                run_pass(
                    &mut callables,
                    &schedule,
                    &buffers,
                    &pool,
                    ls,
                    s.stream(),
                    false,
                )
            })?;
            let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
            exec.upload(&cap)?;
            let slot = match ls.step.pass() {
                Pass::Forward => &mut forward[ls.graph],
                _ => &mut backward[ls.graph],
            };
            *slot = Some(exec);
        }
        let collect = |v: Vec<Option<GraphExec>>, what: &str| {
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
            pool,
            cursor: Cell::new(ReplayCursor::default()),
            ctx,
            copies: Cell::new(0),
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

    /// The forward exec of graph index `graph`, or `None` if out of range.
    pub fn forward_exec(&self, graph: usize) -> Option<&GraphExec> {
        self.forward.get(graph)
    }

    /// The backward exec of graph index `graph`, or `None` if out of range.
    pub fn backward_exec(&self, graph: usize) -> Option<&GraphExec> {
        self.backward.get(graph)
    }
}
