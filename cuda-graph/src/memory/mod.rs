//! Device memory: typed buffers and views of them, the element types they hold, memory
//! pools and pinned host buffers.
//!
//! * [`DeviceBuffer<T>`]: `len` elements of `T` on the device. A buffer is a *view* of an
//!   allocation: [`DeviceBuffer::slice`], [`DeviceBuffer::split_at`] and
//!   [`DeviceBuffer::reinterpret`] give more views of the same memory, each kept alive by
//!   graphs and execs exactly like the buffer it came from (they share its allocation).
//! * [`DeviceRepr`]: what may live in device memory: the primitive numbers, `half`'s
//!   [`f16`](half::f16) and [`bf16`](half::bf16), and arrays of them.
//! * [`MemPool`] (stream-ordered allocation), [`PinnedBuffer`] (page-locked host memory).
//!
//! # One rule for device writes
//!
//! **Work that the device performs takes `&`.** Every enqueued write — kernel launches,
//! copies, memsets, the FP8 launchers and GEMMs of `fp8-kernels`, the replays of the
//! `graphed-callables` runtime — takes the buffers it writes by shared reference, and so does every read.
//! `&mut` is never needed to write device memory through this crate.
//!
//! Why: the borrow checker sees the host, not the device. A write is *enqueued* at the call
//! and *happens* later, in stream order; in a graph it happens again at every replay, long
//! after any borrow taken at capture has ended. A `&mut` at the call would promise an
//! exclusivity that does not hold where it matters, and would forbid what graphs need
//! (static buffers shared by many captured graphs, views of one allocation handed to
//! several kernels). Ordering device accesses is the job of streams, events and graph
//! edges; the host never holds a Rust reference into device memory, so shared handles
//! cannot cause undefined behaviour on the host. What the borrow checker still guards is the
//! host side: a host slice given to a copy is borrowed until the copy has finished.

mod alloc;
mod buffer;
mod copy;
mod mem_pool;
mod pinned;
mod repr;

pub use alloc::Allocation;
pub use buffer::DeviceBuffer;
pub use mem_pool::MemPool;
pub use pinned::PinnedBuffer;
pub use repr::DeviceRepr;
