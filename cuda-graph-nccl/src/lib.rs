//! NCCL for cuda-graph: communicators and collectives on any [`Stream`](cuda_graph::Stream)
//! and inside stream captures, with NCCL loaded at run time, and the pieces a multi-process
//! job needs to start: a TCP [rendezvous] and a torchrun-like [launcher](launch).
//!
//! * [`nccl()`]: opens `libnccl.so.2` once, on first use ([`LIBRARY_VAR`] names another), and
//!   checks it is NCCL [`MIN_VERSION`] or newer. Nothing links against NCCL: programs start,
//!   and run their one-GPU paths, where it is missing.
//! * [`UniqueId`]: what the ranks of a communicator meet through, passed by the
//!   [rendezvous], a file or an environment variable.
//! * [`Communicator`]: one rank on one GPU ([`Communicator::init_rank`],
//!   [`Communicator::from_env`]), or every GPU of one process ([`Communicator::init_all`]);
//!   all-reduce, broadcast, all-gather, reduce-scatter, all-to-all (even and uneven) and
//!   send/receive, [grouped](group).
//! * [`sys`]: the raw bindings (bindgen over `nccl.h`), for what is not wrapped.
//!
//! # Graphs
//!
//! A collective called on a stream that is being captured is captured: the graph replays
//! it. The captured graph keeps the operands and the communicator alive (through
//! [`Stream::keep_alive_in_capture`](cuda_graph::Stream::keep_alive_in_capture)), as it does
//! for cuda-graph's own launches. Every rank must capture, and later replay, the same
//! collectives in the same order. Make the communicator before the capture: its set-up is
//! not capturable.
//!
//! # NVLink multicast
//!
//! Keep `NCCL_NVLS_ENABLE=0` in the environment of every process on shared machines (the
//! [launcher](launch) sets it for its children): NVLink SHARP multicast objects can put
//! shared GPUs out of service. The crate enforces it: loading NCCL ([`nccl`]) sets the
//! variable to `0` when it is unset, before NCCL can read it, and refuses any other value.
//!
//! # Example
//!
//! ```no_run
//! use cuda_graph::{Context, DeviceBuffer, Stream, driver::Device};
//! use cuda_graph_nccl::{Communicator, ReduceOp};
//! // Started by `fp8-moe --gpus N ...` or any launcher that sets MASTER_ADDR, MASTER_PORT,
//! // RANK, WORLD_SIZE and LOCAL_RANK.
//! let local: i32 = std::env::var("LOCAL_RANK")?.parse()?;
//! let ctx = Context::new(Device::get(local)?)?;
//! let stream = Stream::new(&ctx)?;
//! let comm = Communicator::from_env(&ctx)?;
//! let grads = DeviceBuffer::from_host(&stream, &vec![1.0f32; 1 << 20])?;
//! comm.all_reduce_in_place(&grads, ReduceOp::Sum, &stream)?;
//! stream.synchronize()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod comm;
mod error;
pub mod launch;
mod library;
pub mod rendezvous;
pub mod sys;

pub use comm::{Communicator, NcclType, ReduceOp, UniqueId, group};
pub use error::{Error, Result, result_name};
pub use library::{LIBNCCL, LIBRARY_VAR, MIN_VERSION, NVLS_VAR, Nccl, Version, nccl};
