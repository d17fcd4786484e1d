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
//! * [`Error`]: every failure, carrying the driver call, its result code, name and message.
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
mod context;
pub mod driver;
mod event;
mod exec;
mod graph;
mod launch;
mod memory;
mod module;
mod node;
mod stream;

pub use context::Context;
pub use cuda_graph_sys as sys;
pub use error::{Error, Result};
pub use event::{Event, EventFlags};
pub use exec::{GraphExec, InstantiateFlags, NodeId, UpdateOutcome, UpdateReason};
pub use graph::{Graph, Resource};
pub use launch::{KernelArg, KernelArgs, LaunchAttribute, LaunchConfig};
pub use memory::{Allocation, DeviceBuffer, DeviceRepr, MemPool, PinnedBuffer};
pub use module::{Kernel, Module};
pub use node::{
    ChildGraphNode, Edge, EdgeKind, EmptyNode, EventRecordNode, EventWaitNode, HostNode,
    KernelNode, MemAllocNode, MemFreeNode, MemcpyNode, MemsetNode, MemsetValue, Node, NodeKind,
};
pub use stream::Stream;
