//! One device allocation and how it goes back to its owner.

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cuda_graph_sys::CUdeviceptr;

use crate::context::Context;
use crate::memory::MemPool;
use crate::resources::Resource;
use crate::stream::Stream;

/// How an allocation is returned to the driver.
#[derive(Debug)]
pub(crate) enum Free {
    /// `cuMemFree`, which waits for the device.
    Sync,
    /// `cuMemFreeAsync` on the stream it was allocated on, ordered after its work.
    Async(Stream),
    /// A range of a [`GraphPool`](crate::GraphPool), returned to it.
    Pool(Arc<crate::pool::PoolInner>),
    /// Stream-ordered allocation made while its stream was capturing: a graph memory node.
    /// Freed like `Async` (inside the capture that is a free node). The capture that made
    /// it does not keep it alive (that graph owns the memory between its alloc and free
    /// nodes); graphs captured after that capture ended do, like any other memory
    /// (`Allocation::capture_open`).
    InGraph(Stream),
    /// Memory owned by another library (a cudarc slice, ...): dropping the owner frees it,
    /// its own way.
    Foreign(#[allow(dead_code)] ForeignOwner), // held only to be dropped with the allocation
    /// Memory this crate does not own and cannot keep alive (`DeviceBuffer::from_raw`).
    Borrowed,
}

/// The owner of foreign memory, dropped when the last view and graph using it are gone.
pub(crate) struct ForeignOwner(#[allow(dead_code)] pub(crate) Box<dyn Any + Send + Sync>);

impl std::fmt::Debug for ForeignOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ForeignOwner")
    }
}

/// The resource that keeps nothing alive (what graph-owned allocations register).
fn no_resource() -> Resource {
    static NONE: std::sync::OnceLock<Resource> = std::sync::OnceLock::new();
    NONE.get_or_init(|| Arc::new(())).clone()
}

/// One device allocation; freed when the last `Arc` goes (buffers, views, graphs and execs
/// that use it hold one).
#[derive(Debug)]
pub struct Allocation {
    ptr: CUdeviceptr,
    bytes: usize,
    free: Free,
    ctx: Arc<Context>,
    /// A pool the allocation came from stays alive until the allocation is freed.
    _pool: Option<Arc<MemPool>>,
    /// For a graph memory node (`Free::InGraph`): whether the capture that made it is still
    /// running (cleared when this crate's capture scope ends; one it did not start never
    /// clears it, and such memory is never kept alive by graphs, as before).
    capture_open: AtomicBool,
}

impl Allocation {
    pub(crate) fn new(
        ptr: CUdeviceptr,
        bytes: usize,
        free: Free,
        ctx: &Arc<Context>,
        pool: Option<Arc<MemPool>>,
    ) -> Allocation {
        let capture_open = AtomicBool::new(matches!(free, Free::InGraph(_)));
        Allocation {
            ptr,
            bytes,
            free,
            ctx: ctx.clone(),
            _pool: pool,
            capture_open,
        }
    }

    pub(crate) fn new_pooled(
        ptr: CUdeviceptr,
        bytes: usize,
        ctx: &Arc<Context>,
        pool: Arc<crate::pool::PoolInner>,
    ) -> Allocation {
        Allocation::new(ptr, bytes, Free::Pool(pool), ctx, None)
    }

    /// What a graph using this allocation must keep alive.
    pub(crate) fn keep_alive(self: &Arc<Self>) -> Resource {
        match &self.free {
            Free::Pool(pool) => pool.clone() as Resource,
            Free::InGraph(_) if self.capture_open.load(Ordering::Acquire) => no_resource(),
            Free::Borrowed => no_resource(),
            _ => self.clone() as Resource,
        }
    }

    /// Marks a graph memory node's capture as ended: graphs captured from now on keep the
    /// memory alive like any other.
    pub(crate) fn end_capture(&self) {
        self.capture_open.store(false, Ordering::Release);
    }

    /// The device address of the allocation's first byte.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The context the memory belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if self.ptr == 0 || matches!(self.free, Free::Borrowed | Free::Foreign(_)) {
            // Nothing to free, or the foreign owner (dropped with `self.free`) frees it.
            return;
        }
        let Ok(d) = cuda_graph_sys::driver() else {
            return;
        };
        // Errors cannot be reported from drop; the driver keeps the memory then.
        match &self.free {
            Free::Sync => {
                let _ = self.ctx.bind();
                if let Ok(free) = d.cuMemFree() {
                    // SAFETY: owned allocation, freed once; cuMemFree waits for the device.
                    unsafe { free(self.ptr) };
                }
            }
            Free::Async(stream) | Free::InGraph(stream) => {
                let _ = self.ctx.ensure_current();
                if let Ok(free) = d.cuMemFreeAsync() {
                    // SAFETY: owned allocation, freed once, ordered on its stream.
                    unsafe { free(self.ptr, stream.as_raw()) };
                }
            }
            Free::Pool(pool) => pool.release(self.ptr, self.bytes),
            Free::Borrowed | Free::Foreign(_) => {}
        }
    }
}
