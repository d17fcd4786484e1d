//! Device memory pools for stream-ordered allocation.

use std::sync::Arc;

use cuda_graph_sys::CUmemoryPool;

use crate::context::Context;
use crate::error::Result;

/// A device memory pool for stream-ordered allocation (`cuMemPoolCreate`). Several graphs
/// that never run concurrently can draw from one pool; see the crate docs on graph memory.
#[derive(Debug)]
pub struct MemPool {
    pub(crate) raw: CUmemoryPool,
    ctx: Arc<Context>,
}

// SAFETY: the only field that is not `Send` by itself is the raw `CUmemoryPool`, a driver
// handle not tied to a thread: pools serve stream-ordered allocations from any stream and
// thread, and may be destroyed on any thread.
unsafe impl Send for MemPool {}
// SAFETY: `&self` methods only pass the handle to thread-safe driver calls (allocation,
// `cuMemPoolTrimTo`, attribute queries); no state changes on the Rust side.
unsafe impl Sync for MemPool {}

impl MemPool {
    /// A new pool on the context's device that keeps freed memory (release threshold
    /// `u64::MAX`) instead of returning it to the OS at every synchronize.
    ///
    /// Wraps [`cuMemPoolCreate`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    /// and [`cuMemPoolSetAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    /// Errors: [`Error::Driver`](crate::Error::Driver) (also from making `ctx` current); a
    /// pool whose threshold cannot be set is destroyed again.
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<MemPool>> {
        use cuda_graph_sys::{
            CUmemAllocationType, CUmemLocationType, CUmemPool_attribute, CUmemPoolProps,
        };
        ctx.bind()?;
        let mut props = CUmemPoolProps {
            allocType: CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            ..Default::default()
        };
        props.location.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = ctx.device().as_raw();
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid props and out-pointer.
        unsafe { cu!(cuMemPoolCreate(&mut raw, &props)) }?;
        let pool = Arc::new(MemPool {
            raw,
            ctx: ctx.clone(),
        });
        let mut threshold = u64::MAX;
        // SAFETY: the attribute takes a u64.
        unsafe {
            cu!(cuMemPoolSetAttribute(
                raw,
                CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&raw mut threshold).cast()
            ))
        }?;
        Ok(pool)
    }

    /// Releases unused memory until the pool holds at most `keep_bytes`.
    ///
    /// Wraps [`cuMemPoolTrimTo`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    /// Errors: [`Error::Driver`](crate::Error::Driver).
    pub fn trim_to(&self, keep_bytes: usize) -> Result<()> {
        // SAFETY: live pool.
        unsafe { cu!(cuMemPoolTrimTo(self.raw, keep_bytes)) }
    }

    /// Bytes the pool currently holds from the device (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`).
    ///
    /// Wraps [`cuMemPoolGetAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    /// Errors: [`Error::Driver`](crate::Error::Driver).
    pub fn reserved_bytes(&self) -> Result<u64> {
        let mut v = 0u64;
        // SAFETY: the attribute writes a u64.
        unsafe {
            cu!(cuMemPoolGetAttribute(
                self.raw,
                cuda_graph_sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                (&raw mut v).cast()
            ))
        }?;
        Ok(v)
    }

    /// The raw handle.
    pub fn as_raw(&self) -> CUmemoryPool {
        self.raw
    }

    /// The context of the pool's device.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for MemPool {
    fn drop(&mut self) {
        if let Ok(destroy) = cuda_graph_sys::driver().and_then(|d| d.cuMemPoolDestroy()) {
            // SAFETY: owned pool; allocations from it hold an Arc, so none is outstanding.
            unsafe { destroy(self.raw) };
        }
    }
}
