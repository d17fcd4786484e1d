//! Device memory: typed buffers (synchronous or stream-ordered allocation), memory pools and
//! pinned host buffers.

use std::marker::PhantomData;
use std::sync::Arc;

use cuda_graph_sys::{CUdeviceptr, CUmemoryPool};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::graph::Resource;
use crate::stream::Stream;

/// Plain data that may be copied to and from the device bit for bit.
///
/// # Safety
/// Every bit pattern must be a valid value, with no padding and no pointers to host memory.
pub unsafe trait DeviceRepr: Copy + Send + Sync + 'static {}

macro_rules! device_repr {
    ($($t:ty),*) => { $(
        // SAFETY: primitive numbers: every bit pattern is valid, no padding.
        unsafe impl DeviceRepr for $t {}
    )* };
}
device_repr!(u8, i8, u16, i16, u32, i32, u64, i64, usize, isize, f32, f64);
// SAFETY: arrays of plain data are plain data.
unsafe impl<T: DeviceRepr, const N: usize> DeviceRepr for [T; N] {}

/// How an allocation is returned to the driver.
#[derive(Debug)]
enum Free {
    /// `cuMemFree`, which waits for the device.
    Sync,
    /// `cuMemFreeAsync` on the stream it was allocated on, ordered after its work.
    Async(Stream),
    /// A range of a [`GraphPool`](crate::GraphPool), returned to it.
    Pool(Arc<crate::pool::PoolInner>),
    /// Stream-ordered allocation made while its stream was capturing: a graph memory node.
    /// Freed like `Async` (inside the capture that is a free node). Graphs do not keep it
    /// alive: the graph owns that memory between its alloc and free nodes.
    InGraph(Stream),
}

/// The resource that keeps nothing alive (what graph-owned allocations register).
fn no_resource() -> Resource {
    static NONE: std::sync::OnceLock<Resource> = std::sync::OnceLock::new();
    NONE.get_or_init(|| Arc::new(())).clone()
}

/// One device allocation; freed when the last `Arc` goes (buffers, graphs and execs that use
/// it hold one).
#[derive(Debug)]
pub struct Allocation {
    ptr: CUdeviceptr,
    bytes: usize,
    free: Free,
    ctx: Arc<Context>,
    /// A pool the allocation came from stays alive until the allocation is freed.
    _pool: Option<Arc<MemPool>>,
}

impl Allocation {
    pub(crate) fn new_pooled(
        ptr: CUdeviceptr,
        bytes: usize,
        ctx: &Arc<Context>,
        pool: Arc<crate::pool::PoolInner>,
    ) -> Allocation {
        Allocation {
            ptr,
            bytes,
            free: Free::Pool(pool),
            ctx: ctx.clone(),
            _pool: None,
        }
    }

    /// What a graph using this allocation must keep alive.
    pub(crate) fn keep_alive(self: &Arc<Self>) -> Resource {
        match &self.free {
            Free::Pool(pool) => pool.clone() as Resource,
            Free::InGraph(_) => no_resource(),
            _ => self.clone() as Resource,
        }
    }

    /// The device address.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if self.ptr == 0 {
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
                    // SAFETY: owned allocation, freed once.
                    unsafe { free(self.ptr) };
                }
            }
            Free::Async(stream) | Free::InGraph(stream) => {
                if let Ok(free) = d.cuMemFreeAsync() {
                    // SAFETY: owned allocation, freed once, ordered on its stream.
                    unsafe { free(self.ptr, stream.as_raw()) };
                }
            }
            Free::Pool(pool) => pool.release(self.ptr, self.bytes),
        }
    }
}

/// A typed device buffer of `len` elements of `T`.
///
/// The memory is shared with graphs and execs whose nodes use it (through an `Arc`), so
/// dropping the buffer while a graph can still run never frees memory under it.
#[derive(Debug)]
pub struct DeviceBuffer<T: DeviceRepr> {
    alloc: Arc<Allocation>,
    /// The address again, at a stable place, for kernel argument lists.
    ptr: CUdeviceptr,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: DeviceRepr> DeviceBuffer<T> {
    pub(crate) fn bytes_for(len: usize) -> Result<usize> {
        len.checked_mul(size_of::<T>())
            .ok_or_else(|| Error::invalid(format!("{len} elements overflow usize bytes")))
    }

    pub(crate) fn from_alloc(alloc: Allocation, len: usize) -> DeviceBuffer<T> {
        DeviceBuffer {
            ptr: alloc.ptr,
            alloc: Arc::new(alloc),
            len,
            _t: PhantomData,
        }
    }

    /// Allocates `len` elements with `cuMemAlloc`. The contents are unspecified.
    pub fn alloc(ctx: &Arc<Context>, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = Self::bytes_for(len)?;
        ctx.bind()?;
        let mut ptr = 0;
        if bytes > 0 {
            // SAFETY: valid out-pointer; the context is current.
            unsafe { cu!(cuMemAlloc(&mut ptr, bytes)) }?;
        }
        Ok(Self::from_alloc(
            Allocation {
                ptr,
                bytes,
                free: Free::Sync,
                ctx: ctx.clone(),
                _pool: None,
            },
            len,
        ))
    }

    /// Allocates `len` elements and copies `data` into them.
    pub fn from_host(stream: &Stream, data: &[T]) -> Result<DeviceBuffer<T>> {
        let mut buf = DeviceBuffer::alloc(stream.context(), data.len())?;
        buf.copy_from_host(stream, data)?;
        Ok(buf)
    }

    /// Allocates `len` elements, ordered on `stream`, from the device's current pool
    /// (`cuMemAllocAsync`); freed on the same stream when dropped.
    ///
    /// Inside a capture this becomes a graph memory node, and dropping the buffer inside the
    /// capture adds the matching free node: the graph owns that memory between the two, so
    /// graphs do not keep such buffers alive. A buffer kept past the end of its capture is
    /// freed (stream-ordered) when dropped; until then the graph cannot be launched again
    /// unless instantiated with `AUTO_FREE_ON_LAUNCH`.
    pub fn alloc_async(stream: &Stream, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = Self::bytes_for(len)?;
        let free = Self::stream_ordered_free(stream)?;
        let mut ptr = 0;
        if bytes > 0 {
            // SAFETY: valid out-pointer, live stream.
            unsafe { cu!(cuMemAllocAsync(&mut ptr, bytes, stream.as_raw())) }?;
        }
        Ok(Self::from_alloc(
            Allocation {
                ptr,
                bytes,
                free,
                ctx: stream.context().clone(),
                _pool: None,
            },
            len,
        ))
    }

    /// How a stream-ordered allocation on `stream` is freed: graph-owned while capturing.
    fn stream_ordered_free(stream: &Stream) -> Result<Free> {
        Ok(match stream.capture_status()? {
            crate::CaptureStatus::None => Free::Async(stream.clone()),
            _ => Free::InGraph(stream.clone()),
        })
    }

    /// Allocates `len` elements from `pool`, ordered on `stream`; freed on the same stream.
    /// Inside a capture this is a graph memory node, as with [`DeviceBuffer::alloc_async`].
    pub fn alloc_from_pool(
        stream: &Stream,
        pool: &Arc<MemPool>,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        let bytes = Self::bytes_for(len)?;
        let free = Self::stream_ordered_free(stream)?;
        let mut ptr = 0;
        if bytes > 0 {
            // SAFETY: valid out-pointer, live stream and pool.
            unsafe {
                cu!(cuMemAllocFromPoolAsync(
                    &mut ptr,
                    bytes,
                    pool.raw,
                    stream.as_raw()
                ))
            }?;
        }
        Ok(Self::from_alloc(
            Allocation {
                ptr,
                bytes,
                free,
                ctx: stream.context().clone(),
                _pool: Some(pool.clone()),
            },
            len,
        ))
    }

    /// Wraps memory allocated elsewhere, without taking ownership.
    ///
    /// # Safety
    /// `ptr` must point to at least `len` elements of `T` in `ctx`, stay allocated while this
    /// buffer and every graph using it live, and not be freed by this crate.
    pub unsafe fn from_raw(ctx: &Arc<Context>, ptr: CUdeviceptr, len: usize) -> DeviceBuffer<T> {
        let bytes = len * size_of::<T>();
        let alloc = Allocation {
            ptr: 0, // not ours: Drop does nothing
            bytes,
            free: Free::Sync,
            ctx: ctx.clone(),
            _pool: None,
        };
        DeviceBuffer {
            alloc: Arc::new(alloc),
            ptr,
            len,
            _t: PhantomData,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// The device address; valid while this buffer (or a graph holding it) lives.
    pub fn as_raw(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Where the device address is stored, for kernel argument lists.
    pub(crate) fn ptr_ref(&self) -> &CUdeviceptr {
        &self.ptr
    }

    /// The allocation behind this buffer.
    pub(crate) fn allocation(&self) -> &Arc<Allocation> {
        &self.alloc
    }

    /// What a graph or exec using this buffer keeps alive: the allocation itself, or for a
    /// [`GraphPool`](crate::GraphPool) buffer the pool's memory (so the range can serve later
    /// captures once this buffer is dropped; see the pool's contract).
    pub fn resource(&self) -> Resource {
        self.alloc.keep_alive()
    }

    fn check_len(&self, other: usize, what: &str) -> Result<()> {
        if other == self.len {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "{what}: buffer has {} elements, host slice {other}",
                self.len
            )))
        }
    }

    /// Copies `src` into the buffer, ordered on `stream`, and waits for the copy (and all
    /// earlier work on `stream`).
    pub fn copy_from_host(&mut self, stream: &Stream, src: &[T]) -> Result<()> {
        self.check_len(src.len(), "copy_from_host")?;
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: src is valid for `bytes` reads until the synchronize below returns.
        unsafe {
            cu!(cuMemcpyHtoDAsync(
                self.ptr,
                src.as_ptr().cast(),
                self.bytes(),
                stream.as_raw()
            ))
        }?;
        stream.synchronize()
    }

    /// Copies the buffer into `dst`, ordered on `stream` after earlier work, and waits.
    pub fn copy_to_host(&self, stream: &Stream, dst: &mut [T]) -> Result<()> {
        self.check_len(dst.len(), "copy_to_host")?;
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: dst is valid for `bytes` writes until the synchronize below returns; every
        // bit pattern is a valid T.
        unsafe {
            cu!(cuMemcpyDtoHAsync(
                dst.as_mut_ptr().cast(),
                self.ptr,
                self.bytes(),
                stream.as_raw()
            ))
        }?;
        stream.synchronize()
    }

    /// The buffer's contents, copied after earlier work on `stream`.
    pub fn to_vec(&self, stream: &Stream) -> Result<Vec<T>> {
        let mut v = Vec::with_capacity(self.len);
        // SAFETY: T is plain data (any bit pattern valid); copy_to_host writes every element
        // before the vector is read, and an error drops it without reading.
        #[allow(clippy::uninit_vec)]
        unsafe {
            v.set_len(self.len)
        };
        self.copy_to_host(stream, &mut v)?;
        Ok(v)
    }

    /// Enqueues a device-to-device copy of `src` into this buffer on `stream`.
    pub fn copy_from_device(&mut self, stream: &Stream, src: &DeviceBuffer<T>) -> Result<()> {
        if src.len != self.len {
            return Err(Error::invalid(format!(
                "copy_from_device: destination has {} elements, source {}",
                self.len, src.len
            )));
        }
        if self.len == 0 {
            return Ok(());
        }
        stream.retain_for_capture(|| src.resource());
        stream.retain_for_capture(|| self.resource());
        // SAFETY: both ranges are live allocations of `bytes` bytes.
        unsafe {
            cu!(cuMemcpyDtoDAsync(
                self.ptr,
                src.ptr,
                self.bytes(),
                stream.as_raw()
            ))
        }
    }

    /// Enqueues setting every byte to `value` on `stream`.
    pub fn memset_bytes(&mut self, stream: &Stream, value: u8) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        stream.retain_for_capture(|| self.resource());
        // SAFETY: live allocation of `bytes` bytes.
        unsafe {
            cu!(cuMemsetD8Async(
                self.ptr,
                value,
                self.bytes(),
                stream.as_raw()
            ))
        }
    }

    /// Enqueues setting every element to `value` on `stream`; `T` must be 4 bytes wide.
    pub fn fill_u32_bits(&mut self, stream: &Stream, value: u32) -> Result<()> {
        if size_of::<T>() != 4 {
            return Err(Error::invalid(format!(
                "fill_u32_bits needs 4-byte elements, not {}",
                size_of::<T>()
            )));
        }
        if self.len == 0 {
            return Ok(());
        }
        stream.retain_for_capture(|| self.resource());
        // SAFETY: live allocation of `len` 4-byte words.
        unsafe { cu!(cuMemsetD32Async(self.ptr, value, self.len, stream.as_raw())) }
    }
}

/// A device memory pool for stream-ordered allocation (`cuMemPoolCreate`). Several graphs
/// that never run concurrently can draw from one pool; see the crate docs on graph memory.
#[derive(Debug)]
pub struct MemPool {
    raw: CUmemoryPool,
    ctx: Arc<Context>,
}

// SAFETY: pools may be used from any thread.
unsafe impl Send for MemPool {}
// SAFETY: as above.
unsafe impl Sync for MemPool {}

impl MemPool {
    /// A new pool on the context's device that keeps freed memory (release threshold
    /// `u64::MAX`) instead of returning it to the OS at every synchronize.
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
    pub fn trim_to(&self, keep_bytes: usize) -> Result<()> {
        // SAFETY: live pool.
        unsafe { cu!(cuMemPoolTrimTo(self.raw, keep_bytes)) }
    }

    /// Bytes the pool currently holds from the device (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`).
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

/// Page-locked host memory (`cuMemAllocHost`): fast, truly asynchronous host-device copies.
#[derive(Debug)]
pub struct PinnedBuffer<T: DeviceRepr> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<Context>,
}

// SAFETY: owns its memory like a Box<[T]>.
unsafe impl<T: DeviceRepr> Send for PinnedBuffer<T> {}
// SAFETY: shared access is read-only.
unsafe impl<T: DeviceRepr> Sync for PinnedBuffer<T> {}

impl<T: DeviceRepr> PinnedBuffer<T> {
    /// `len` elements of pinned memory, every byte zero.
    pub fn zeroed(ctx: &Arc<Context>, len: usize) -> Result<PinnedBuffer<T>> {
        let bytes = DeviceBuffer::<T>::bytes_for(len)?.max(1);
        ctx.bind()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer; context current.
        unsafe { cu!(cuMemAllocHost(&mut p, bytes)) }?;
        // SAFETY: p is valid for `bytes` writes.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, bytes) };
        Ok(PinnedBuffer {
            ptr: p.cast(),
            len,
            ctx: ctx.clone(),
        })
    }
}

impl<T: DeviceRepr> std::ops::Deref for PinnedBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: ptr is valid for len initialised elements while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T: DeviceRepr> std::ops::DerefMut for PinnedBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as above, and &mut self is unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: DeviceRepr> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        if let Ok(free) = cuda_graph_sys::driver().and_then(|d| d.cuMemFreeHost()) {
            // SAFETY: owned allocation, freed once.
            unsafe { free(self.ptr.cast()) };
        }
    }
}
