//! Interop with other Rust CUDA stacks, each behind a cargo feature of its name.
//!
//! * [`cudarc`] (feature `cudarc`): adopt cudarc's context, streams, slices and
//!   kernels without `unsafe`, capture the work cudarc and cuBLAS enqueue into a [`Graph`],
//!   and hand this crate's buffers and streams to cudarc.
//!
//! [`Graph`]: crate::Graph

#[cfg(feature = "cudarc")]
pub mod cudarc;
