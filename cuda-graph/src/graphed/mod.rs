//! Graphed callables: capture the forward and backward passes of a model's layers as CUDA
//! graphs under a pipeline schedule and replay them in place of eager calls, as
//! TransformerEngine's `make_graphed_callables` does for PyTorch.
//!
//! This module so far holds the pure logic everything else builds on:
//!
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
//! # Example
//!
//! ```
//! use cuda_graph::graphed::{Pass, Schedule, Step};
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
//! // Chunk 2 appears more often than chunk 1: rejected, with the position.
//! let err = Schedule::new(&[1, 2, 2, -2, -2, -1], vec![1, 1]).unwrap_err();
//! assert_eq!(
//!     err.to_string(),
//!     "order[3] = -2 is entry 3 of chunk 2, but chunk 1 appears only 2 times: every chunk \
//!      needs the same number of entries, a forward and a backward per microbatch"
//! );
//! # Ok::<(), cuda_graph::graphed::ScheduleError>(())
//! ```

mod layout;
mod schedule;

pub use layout::{GraphIndex, Layout};
pub use schedule::{LayerStep, OrderEntry, Pass, Schedule, ScheduleError, Step};
