//! Safe CUDA graphs for Rust.
//!
//! This crate sits on [`cuda_graph_sys`], which loads the CUDA driver at run time, so
//! programs built with it start on machines without a GPU and report a clear error there.
//!
//! * [`driver`]: initialisation, the driver version, devices and the graph features the
//!   installed driver supports.
//! * [`Context`], [`Stream`], [`Event`], [`DeviceBuffer`], [`MemPool`], [`PinnedBuffer`],
//!   [`Module`] and [`Kernel`]: owned handles, freed on drop.
//! * [`KernelArgs`] and [`LaunchConfig`]: typed launches, checked against the kernel's
//!   parameter sizes.
//! * [`Graph`]: graph definitions that keep alive what their nodes use; explicit building
//!   with typed nodes ([`KernelNode`], [`MemcpyNode`], ...) and edges ([`EdgeKind`]).
//! * [`GraphExec`]: instantiate, launch, whole-graph update ([`UpdateReason`]) and per-node
//!   updates.
//! * [`ConditionalHandle`], [`Graph::add_if`], [`Stream::capture_while`] and friends:
//!   conditional nodes (IF, IF-ELSE, WHILE, SWITCH) and the device helpers that set them.
//! * [`capture`]: stream capture as a closure scope ([`Stream::capture`]), with forks and
//!   joins to side streams.
//! * [`Error`]: every failure, carrying the driver call, its result code, name and message.
//!
//! # Errors
//!
//! Each function that calls the driver links the NVIDIA driver API page of the call it wraps
//! (where the driver lists that call's result codes) and says what it returns on failure.
//! Three rules hold throughout:
//! * [`Error::Load`]: the driver library cannot be opened, predates CUDA 12.0, or lacks an
//!   entry point at the ABI this crate uses. Entry points newer than 12.0 are named where a
//!   function needs one; a feature gate ([`Error::Unsupported`]) usually answers first.
//! * [`Error::Driver`] names the call that failed and its result. Many functions first make
//!   their context current, so `cuCtxSetCurrent` may be the call named; a fault of earlier
//!   asynchronous work surfaces from whichever call comes next.
//! * [`Error::InvalidArgument`] comes from this crate's own checks, made before the driver
//!   call they guard.
//!
//! A fault of device code (an illegal address, a device-side `assert` or `__trap()`) is
//! *sticky*: it poisons the context, and every later call fails with it.
//! [`Error::is_sticky`] tells such errors apart, and [`Context::check_health`] asks whether
//! the context can still run work. Out of memory is not sticky: earlier graphs keep working.
//!
//! # Threads
//!
//! Handles are `Send` and `Sync` (contexts, streams, events, modules, kernels, buffers, pools,
//! execs), except [`Graph`], which is `Send` only (the driver does not synchronise calls on
//! one graph), and [`CaptureScope`], which stays on the thread that began the capture. An
//! exec shared by threads may be launched from all of them: the launches are serialised and
//! run one at a time. Capture with [`CaptureMode::ThreadLocal`] when other threads keep
//! working meanwhile (see [`capture`](crate::capture#modes)).
//!
//! # Lifetimes: what keeps device memory alive
//!
//! Work enqueued through the safe API registers what it uses. A kernel launch or copy made
//! during a capture hands the stream `Arc`s of the kernel's module and of every
//! [`DeviceBuffer`] argument; the captured [`Graph`] keeps them, and every [`GraphExec`]
//! instantiated from it (or updated to it) keeps a copy. Dropping your buffers, modules or the
//! graph while an exec may still run therefore never frees memory under it; dropping an exec
//! that was launched waits for the device before releasing what it held.
//!
//! What this does *not* protect — the raw paths:
//! * device addresses passed as plain integers (`buf.as_raw()` inside a `#[repr(C)]` struct
//!   argument, or a `u64` scalar), and [`DeviceBuffer::from_raw`] memory owned elsewhere;
//! * graphs adopted with [`Graph::from_raw`] and nodes added with raw driver calls;
//! * what kernels do: a kernel that indexes past its buffers corrupts device memory, which is
//!   why [`Stream::launch`] is `unsafe` (argument *sizes* are checked, not meaning).
//!
//! For those, register the resource yourself with [`Graph::keep_alive`] /
//! [`GraphExec::keep_alive`], or keep it alive for as long as the exec lives.
//!
//! # Graph memory
//!
//! Two ways to give captured graphs memory of their own, with different trade-offs: a
//! [`GraphPool`] (ordinary memory reserved up front and carved without driver calls; several
//! graphs captured in execution order share it, as PyTorch's graph pool does) and graph memory
//! nodes (`DeviceBuffer::alloc_async` during a capture; the driver shares physical pages across
//! graphs and [`driver::Device::graph_mem_trim`] returns unused ones, but such graphs cannot be
//! cloned or instantiated twice). The [`GraphPool`] docs spell out the contract.
//!
//! # Example
//!
//! ```no_run
//! use cuda_graph::driver::{self, Device, Feature};
//! let version = driver::driver_version()?;
//! let dev = Device::get(0)?;
//! println!("{} on CUDA {version}", dev.name()?);
//! if dev.supports(Feature::ConditionalIfWhile)? {
//!     println!("conditional nodes available");
//! }
//! # Ok::<(), cuda_graph::Error>(())
//! ```

#[macro_use]
mod error;
pub mod capture;
pub mod conditional;
mod context;
pub mod driver;
mod event;
mod exec;
mod graph;
mod ids;
#[cfg(feature = "cudarc")]
pub mod interop;
mod launch;
pub mod memory;
mod module;
mod node;
pub mod pool;
mod resources;
mod stream;

pub use capture::{CaptureMode, CaptureScope, CaptureStatus, UNKNOWN_CAPTURE_CALL};
pub use conditional::{Body, ConditionSource, ConditionalHandle, ConditionalKind};
pub use context::Context;
pub use cuda_graph_sys as sys;
pub use error::{Error, Result, UpdateReason};
pub use event::{Event, EventFlags};
pub use exec::{GraphExec, InstantiateFlags, UpdateOutcome};
pub use graph::Graph;
pub use ids::NodeId;
pub use launch::{KernelArg, KernelArgs, LaunchAttribute, LaunchConfig};
pub use memory::{Allocation, DeviceBuffer, DeviceRepr, MemPool, PinnedBuffer};
pub use module::{Kernel, Module};
pub use node::{
    ChildGraphNode, ConditionalNode, Edge, EdgeKind, EmptyNode, EventRecordNode, EventWaitNode,
    HostNode, KernelNode, MemAllocNode, MemFreeNode, MemcpyNode, MemsetNode, MemsetValue, Node,
    NodeKind,
};
pub use pool::{GraphPool, POOL_ALIGN};
pub use resources::Resource;
pub use stream::Stream;

/// cudarc, the version [`interop::cudarc`] is built against (feature `cudarc`).
#[cfg(feature = "cudarc")]
pub use cudarc;
/// `half`, whose [`f16`](half::f16) and [`bf16`](half::bf16) are this crate's half-precision
/// element types (re-exported so users name the same version).
pub use half;
