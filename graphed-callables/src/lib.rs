//! Graphed callables: capture the forward and backward passes of a model's layers as CUDA
//! graphs under a pipeline schedule and replay them in place of eager calls, as
//! TransformerEngine's `make_graphed_callables` does for PyTorch.
//!
//! # Pieces
//!
//! * [`Callable`]: one layer's forward and backward over static buffers, enqueued on a
//!   given stream; [`Slot`] is the per-(chunk, microbatch, layer) context it gets.
//! * [`GraphedCallables::build`]: allocates the static buffers from one [`GraphPool`](cuda_graph::GraphPool),
//!   warms up, captures every (chunk, microbatch, layer)'s forward and backward in schedule
//!   order, instantiates and uploads the graphs; [`GraphedOptions`] configures it. By default
//!   ([`GraphedOptions::merge_layers`]) the layers of one step (the forward or backward of a
//!   (chunk, microbatch)) go into one graph, so a replay is one graph launch; without it
//!   each layer's pass is a graph of its own, as in TransformerEngine. Layers split into
//!   segments ([`segments`]) break the step's graph at their eager segments.
//! * [`GraphedCallables::forward`] / [`GraphedCallables::backward`]: replay in schedule
//!   order (anything else is [`Error::ReplayOrder`]).
//! * [`Schedule`]: the pipeline order (the reference's `_order`: `k` forward, `-k` backward,
//!   `-k - 0.5` weight gradient of 1-based chunk `k`), validated up front; an invalid order
//!   is a [`ScheduleError`] naming the offending position. [`Schedule::steps`] gives the
//!   [`Step`]s in execution order with their (chunk, microbatch) resolved, and
//!   [`Schedule::layer_steps`] every graph in the order warmup runs and capture records
//!   them.
//! * [`Layout`]: the one place for the index math. Graphs are laid out (chunk, microbatch,
//!   layer); callables and their parameters (chunk, layer), shared by microbatches.
//!
//! Chunks, microbatches and layers are 0-based everywhere except in the order itself and in
//! the messages that quote it.
//!
//! # Example: build and train
//!
//! ```no_run
//! use graphed_callables::{Callable, GraphedCallables, GraphedOptions, Step};
//! use cuda_graph::{Context, DeviceBuffer, Stream};
//! # fn my_layers() -> Vec<Box<dyn Callable<f32>>> { unimplemented!() }
//! let ctx = Context::default_device()?;
//! let stream = Stream::new(&ctx)?;
//! // 2 chunks of 2 layers (callables laid out (chunk, layer)), 3 microbatches, interleaved;
//! // every layer maps 1024 floats to 1024 floats.
//! let order = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1];
//! let options = GraphedOptions::from_order(&order, vec![2, 2])?;
//! let sample = DeviceBuffer::<f32>::alloc(&ctx, 1024)?;
//! // Sample inputs per callable; only each chunk's first layer reads them.
//! let samples = vec![vec![&sample], vec![], vec![&sample], vec![]];
//! let graphed = GraphedCallables::build(&stream, my_layers(), &samples, options)?;
//!
//! let x = DeviceBuffer::<f32>::alloc(&ctx, 1024)?; // a microbatch's input
//! let dy = DeviceBuffer::<f32>::alloc(&ctx, 1024)?; // the loss gradient
//! for &step in graphed.schedule().steps() {
//!     match step {
//!         Step::Forward { chunk, microbatch } => {
//!             // Copies x into the static input (it is another allocation), replays the
//!             // chunk's forward graphs and returns the static outputs of its last layer.
//!             let y = graphed.forward(chunk, microbatch, &[&x], &stream)?;
//!             let _ = &y[0];
//!         }
//!         Step::Backward { chunk, microbatch } => {
//!             let dx = graphed.backward(chunk, microbatch, &[&dy], &stream)?;
//!             let _ = &dx[0];
//!         }
//!         // Only in schedules with `-k - 0.5` entries (split weight gradients).
//!         Step::WeightGrad { chunk, microbatch } => {
//!             graphed.weight_grad(chunk, microbatch, &stream)?
//!         }
//!     }
//! }
//! stream.synchronize()?;
//! # Ok::<(), graphed_callables::Error>(())
//! ```
//!
//! # Example: schedules
//!
//! ```
//! use graphed_callables::{Pass, Schedule, Step};
//!
//! // An interleaved pipeline: 2 chunks x 3 microbatches, chunks of 2 and 3 layers.
//! let schedule = Schedule::new(&[1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1], vec![2, 3])?;
//! assert_eq!(schedule.num_chunks(), 2);
//! assert_eq!(schedule.num_microbatches(), 3);
//! assert_eq!(schedule.steps()[6], Step::Forward { chunk: 0, microbatch: 2 });
//!
//! // The graphs of the fifth step (backward of chunk 1, microbatch 0), last layer first.
//! let graphs: Vec<usize> = schedule
//!     .layer_steps()
//!     .filter(|g| g.position == 4)
//!     .map(|g| g.graph)
//!     .collect();
//! assert_eq!(graphs, [8, 7, 6]);
//! assert!(schedule.layer_steps().all(|g| g.step.pass() != Pass::WeightGrad));
//!
//! // Split weight gradients: `-k - 0.5` runs chunk k's weight gradients of its next
//! // microbatch, after that microbatch's backward.
//! let split = Schedule::from_f64(&[1.0, 1.0, -1.0, -1.0, -1.5, -1.5], vec![1])?;
//! assert!(split.splits_weight_grad());
//! assert_eq!(split.steps()[4], Step::WeightGrad { chunk: 0, microbatch: 0 });
//!
//! // Chunk 2 appears more often than chunk 1: rejected, with the position.
//! let err = Schedule::new(&[1, 2, 2, -2, -2, -1], vec![1, 1]).unwrap_err();
//! assert_eq!(
//!     err.to_string(),
//!     "order[3] = -2 is entry 3 of chunk 2, but chunk 1 appears only 2 times: every chunk \
//!      needs the same number of entries, a forward and a backward per microbatch"
//! );
//! # Ok::<(), graphed_callables::ScheduleError>(())
//! ```

//! # Static buffers
//!
//! Every (chunk, microbatch, layer) has its own static inputs, outputs, output gradients,
//! input gradients and saved activations ([`Callable::saved_bytes`]), all carved from the
//! one [`GraphPool`](cuda_graph::GraphPool). Within a (chunk, microbatch) the layers chain: layer `l + 1`'s inputs
//! are layer `l`'s outputs (the same allocations), and layer `l`'s output gradients are
//! layer `l + 1`'s input gradients, so a replay moves no data between layers. That needs
//! layer `l`'s output lengths to equal layer `l + 1`'s input lengths; a chunk whose layers
//! do not chain is rejected at build.
//!
//! # Saved activations
//!
//! By default nothing is shared between microbatches: the buffers of microbatch `b` (its
//! static inputs and outputs, and the saved buffers its callables fill) are written only by
//! its own forward replay, so they hold its activations until its backward replay however
//! many other microbatches run in between. A callable keeps per-microbatch state in
//! [`Slot::saved`] (or reads [`Slot::inputs`] / [`Slot::outputs`] in its backward), never
//! in itself. With [`GraphedOptions::reuse_buffers`] a microbatch whose backward (and
//! weight-gradient step) is done hands its buffers to a later microbatch of the same chunk,
//! as the schedule allows ([`GraphedCallables::buffer_set`]); activations still survive
//! until their own backward.
//!
//! # Split weight gradients
//!
//! A schedule with `-k - 0.5` entries ([`Schedule::from_f64`]) gives each microbatch's
//! weight gradients a step of their own after its backward (TransformerEngine's delayed
//! weight-gradient computation, used to fill pipeline bubbles): the backward step calls
//! [`Callable::backward_input`], the weight-gradient step
//! ([`GraphedCallables::weight_grad`]) [`Callable::backward_weight`], each captured into
//! graphs of their own.
//!
//! # Warmup and capture
//!
//! Both run on one internal stream forked from the stream given to the build: warmup runs
//! every pass [`GraphedOptions::warmup_iters`] times in exactly [`Schedule::layer_steps`]
//! order with exactly the static buffers capture uses (sample inputs copied in first), then
//! capture records the passes in that same order: a step's layers into one graph, or each
//! layer's pass into its own without [`GraphedOptions::merge_layers`]; eager segments run
//! in warmup but are never captured and split the step's graph. Callable `c` runs in
//! the graphs of (chunk, microbatch, layer) with [`Layout::callable_of_graph`] = `c`, so
//! parameters pair with graphs through [`Layout`] only.
//!
//! Warmup calls [`Callable::cast_weights`] before every forward (first-microbatch
//! semantics), between the [`GraphedOptions::before_warmup`] and
//! [`GraphedOptions::after_warmup`] hooks. Before capture, each forward graph's casts are
//! captured once into a throwaway graph to find which graphs cast at all
//! ([`GraphedCallables::casts_weights`]); the captured graphs are kept
//! ([`GraphedCallables::forward_graph`]) for inspection.
//!
//! # Weight caching and hooks
//!
//! * FP8 weight caching, FP8-agnostic: [`Callable::cast_weights`] enqueues a layer's
//!   per-step casts, which run on each chunk's first microbatch only. By default
//!   ([`WeightCaching::Static`]) they are captured into the first microbatch's forward graphs
//!   and nowhere else. Or the runtime owns a device flag per (chunk, microbatch), written on
//!   the replay stream in [`GraphedCallables::forward`] before the launches from
//!   [`GraphedCallables::is_first_microbatch`], and read either by an IF conditional node
//!   around the casts ([`WeightCaching::Conditional`]) or by the cast kernels as a noop flag
//!   ([`WeightCaching::NoopFlag`], [`Slot::skip_weight_cast`]). See [`weights`].
//! * Casts beside the forward: a callable whose forward starts with work that does not read
//!   its cast weights says so ([`Callable::overlaps_weight_cast`]); the graph's casts are then
//!   captured on a fork that runs beside that work, and the callable waits for them
//!   ([`Slot::wait_weight_cast`]) before its first read of the cast weights.
//! * Amax reduction and scale updates: [`GraphedOptions::after_forward`] and
//!   [`GraphedOptions::after_backward`] run after every replay's launches (one fused launch
//!   of the caller's, e.g. an amax reduction and scale update); [`GraphedOptions::before_warmup`] and
//!   [`GraphedOptions::after_warmup`] snapshot and restore scaling state around warmup.
//!
//! # Breaking-layer capture (MoE)
//!
//! A callable's passes may be sequences of segments ([`Callable::forward_segments`],
//! [`Callable::backward_segments`]), each [`SegmentKind::Graphed`] (one graph per segment,
//! pass and (chunk, microbatch, layer)) or [`SegmentKind::Eager`] (run by the host at replay
//! between the launches, on the replay stream, with the same slot's static buffers; it may
//! read sizes to the host and launch dynamic-shaped work). Full-layer capture (one graph)
//! stays the default, for layers whose dynamic part reads its sizes from device memory. See
//! [`segments`].
//!
mod buffers;
mod build;
mod callable;
mod error;
mod layout;
mod program;
mod replay;
mod runtime;
mod schedule;
pub mod segments;
pub mod weights;

pub use callable::{Callable, Slot};
pub use error::{Error, Result};
pub use layout::{GraphIndex, Layout};
pub use runtime::{GraphedCallables, GraphedOptions};
pub use schedule::{LayerStep, OrderEntry, Pass, Schedule, ScheduleError, Step};
pub use segments::{SegmentKind, SegmentPlan, SegmentRun};
pub use weights::{
    AfterWarmupHook, LowPrecision, StepHook, TensorRecorder, WarmupHook, WarmupRecord,
    WeightCaching,
};
