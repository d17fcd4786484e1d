//! [`DeviceBuffer`]: typed device memory, and views of it.

use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use cuda_graph_sys::CUdeviceptr;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::memory::alloc::{Allocation, ForeignOwner, Free};
use crate::memory::{DeviceRepr, MemPool};
use crate::resources::Resource;
use crate::stream::Stream;

/// `len` elements of `T` in device memory: a whole allocation, or a view of part of one.
///
/// The memory is shared with every view made from this buffer ([`slice`](Self::slice),
/// [`split_at`](Self::split_at), [`reinterpret`](Self::reinterpret)) and with the graphs
/// and execs whose nodes use any of them (through an `Arc` of the allocation), so dropping
/// buffers while a graph can still run never frees memory under it. The allocation is
/// returned when the last of them goes.
///
/// Writes enqueued through the safe API take `&self` (the [rule](crate::memory#one-rule-for-device-writes)).
///
/// ```no_run
/// use cuda_graph::{Context, DeviceBuffer, Stream};
/// use half::bf16;
///
/// let ctx = Context::default_device()?;
/// let stream = Stream::new(&ctx)?;
/// let buf = DeviceBuffer::<f32>::alloc(&ctx, 1024)?;
/// let (head, tail) = buf.split_at(256)?;          // two views of the same memory
/// tail.memset_bytes(&stream, 0)?;                  // a device write through `&`
/// let halves = head.reinterpret::<bf16>()?;        // 256 f32 = 512 bf16
/// assert_eq!(halves.len(), 512);
/// let bytes = buf.slice(4..8)?.reinterpret::<u8>()?;
/// assert_eq!(bytes.len(), 16);
/// # Ok::<(), cuda_graph::Error>(())
/// ```
pub struct DeviceBuffer<T: DeviceRepr> {
    alloc: Arc<Allocation>,
    /// The address of element 0, at a stable place, for kernel argument lists.
    ptr: CUdeviceptr,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: DeviceRepr> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("type", &std::any::type_name::<T>())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("allocation", &format_args!("{:#x}", self.alloc.ptr()))
            .finish()
    }
}

impl<T: DeviceRepr> DeviceBuffer<T> {
    pub(crate) fn bytes_for(len: usize) -> Result<usize> {
        len.checked_mul(size_of::<T>())
            .ok_or_else(|| Error::invalid(format!("{len} elements overflow usize bytes")))
    }

    /// The whole of `alloc` as `len` elements.
    pub(crate) fn from_alloc(alloc: Allocation, len: usize) -> DeviceBuffer<T> {
        DeviceBuffer {
            ptr: alloc.ptr(),
            alloc: Arc::new(alloc),
            len,
            _t: PhantomData,
        }
    }

    /// Allocates `len` elements with `cuMemAlloc`. The contents are unspecified.
    ///
    /// Wraps [`cuMemAlloc`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html).
    /// Errors: [`Error::InvalidArgument`] when `len` elements overflow `usize` bytes;
    /// [`Error::Driver`]: out of memory, or refused where a capture forbids unsafe calls
    /// (see [capture modes](crate::capture#modes)), which invalidates that capture; inside a
    /// capture allocate from a [`GraphPool`](crate::GraphPool) or with
    /// [`DeviceBuffer::alloc_async`].
    pub fn alloc(ctx: &Arc<Context>, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = Self::bytes_for(len)?;
        ctx.bind()?;
        let mut ptr = 0;
        if bytes > 0 {
            // SAFETY: valid out-pointer; the context is current.
            unsafe { cu!(cuMemAlloc(&mut ptr, bytes)) }?;
        }
        Ok(Self::from_alloc(
            Allocation::new(ptr, bytes, Free::Sync, ctx, None),
            len,
        ))
    }

    /// Allocates `data.len()` elements and copies `data` into them (waits for the copy).
    ///
    /// Errors: those of [`DeviceBuffer::alloc`] and [`DeviceBuffer::copy_from_host`]; the wait
    /// makes it illegal on a capturing stream.
    pub fn from_host(stream: &Stream, data: &[T]) -> Result<DeviceBuffer<T>> {
        let buf = DeviceBuffer::alloc(stream.context(), data.len())?;
        buf.copy_from_host(stream, data)?;
        Ok(buf)
    }

    /// Allocates `len` elements, ordered on `stream`, from the device's current pool
    /// (`cuMemAllocAsync`); freed on the same stream when the last view goes.
    ///
    /// The free is ordered after `stream`'s work only. Work on *other* streams that uses the
    /// buffer must be ordered before the last view is dropped (make `stream` wait for them,
    /// [`Stream::wait_event`], or synchronize them): otherwise the memory may be handed out
    /// again while that work still reads or writes it. [`DeviceBuffer::alloc`] has no such
    /// rule (`cuMemFree` waits for the device).
    ///
    /// Inside a capture this becomes a graph memory node, and dropping the buffer inside the
    /// capture adds the matching free node: the graph owns that memory between the two, so
    /// that capture's graph does not keep the buffer alive. A buffer kept past the end of its
    /// capture is freed (stream-ordered) when dropped; until then the graph cannot be
    /// launched again unless instantiated with `AUTO_FREE_ON_LAUNCH`. Graphs captured after
    /// its capture ended keep it alive like any other buffer.
    ///
    /// Wraps [`cuMemAllocAsync`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    /// Errors: [`Error::InvalidArgument`] when the byte count overflows; [`Error::Driver`]
    /// from asking whether `stream` captures or from the allocation (out of memory; inside a
    /// conditional body, where memory nodes are not allowed).
    pub fn alloc_async(stream: &Stream, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = Self::bytes_for(len)?;
        let free = Self::stream_ordered_free(stream)?;
        let mut ptr = 0;
        if bytes > 0 {
            stream.context().ensure_current()?;
            // SAFETY: valid out-pointer, live stream.
            unsafe { cu!(cuMemAllocAsync(&mut ptr, bytes, stream.as_raw())) }?;
        }
        let buf = Self::from_alloc(
            Allocation::new(ptr, bytes, free, stream.context(), None),
            len,
        );
        stream.note_graph_allocation(&buf.alloc);
        Ok(buf)
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
    ///
    /// Wraps [`cuMemAllocFromPoolAsync`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    /// Errors: as [`DeviceBuffer::alloc_async`].
    pub fn alloc_from_pool(
        stream: &Stream,
        pool: &Arc<MemPool>,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        let bytes = Self::bytes_for(len)?;
        let free = Self::stream_ordered_free(stream)?;
        let mut ptr = 0;
        if bytes > 0 {
            stream.context().ensure_current()?;
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
        let buf = Self::from_alloc(
            Allocation::new(ptr, bytes, free, stream.context(), Some(pool.clone())),
            len,
        );
        stream.note_graph_allocation(&buf.alloc);
        Ok(buf)
    }

    /// Wraps memory allocated elsewhere, without taking ownership; graphs cannot keep it
    /// alive. Prefer a safe adopter where one exists (e.g. the `cudarc` feature's
    /// `DeviceBuffer::from_cudarc`), or [`DeviceBuffer::from_owner`].
    ///
    /// # Safety
    /// `ptr` must point to at least `len` elements of `T` in `ctx`, aligned for `T`, stay
    /// allocated while this buffer, its views and every graph and exec using them live, and
    /// not be freed by this crate.
    pub unsafe fn from_raw(ctx: &Arc<Context>, ptr: CUdeviceptr, len: usize) -> DeviceBuffer<T> {
        let bytes = len.saturating_mul(size_of::<T>());
        DeviceBuffer {
            alloc: Arc::new(Allocation::new(ptr, bytes, Free::Borrowed, ctx, None)),
            ptr,
            len,
            _t: PhantomData,
        }
    }

    /// Adopts memory owned by another library: `owner` is kept alive (and so the memory
    /// allocated) for as long as this buffer, its views and every graph and exec using them
    /// live, and dropped after the last of them.
    ///
    /// # Safety
    /// `ptr` must point to at least `len` elements of `T` in `ctx`, aligned for `T`, and stay
    /// allocated for as long as `owner` lives; dropping `owner` must be a valid way to give
    /// the memory back (it may be dropped on any thread, after the device stopped using it
    /// through this crate's handles).
    ///
    /// Errors: [`Error::InvalidArgument`] when the byte count overflows; no driver call.
    pub unsafe fn from_owner(
        ctx: &Arc<Context>,
        ptr: CUdeviceptr,
        len: usize,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<DeviceBuffer<T>> {
        let bytes = Self::bytes_for(len)?;
        let free = Free::Foreign(ForeignOwner(owner));
        Ok(DeviceBuffer {
            alloc: Arc::new(Allocation::new(ptr, bytes, free, ctx, None)),
            ptr,
            len,
            _t: PhantomData,
        })
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

    /// The device address of element 0; valid while this buffer (or a graph holding its
    /// allocation) lives.
    pub fn as_raw(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The context the memory belongs to.
    pub fn context(&self) -> &Arc<Context> {
        self.alloc.context()
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
    /// captures once this buffer is dropped; see the [pool's contract](crate::pool)).
    pub fn resource(&self) -> Resource {
        self.alloc.keep_alive()
    }

    /// Another handle to all of this buffer's memory (a view of every element), kept alive
    /// like this buffer. Cheap (an `Arc` clone, no driver call). Not `Clone`, so that a copy
    /// of the *data* is never implied: this is a handle.
    pub fn share(&self) -> DeviceBuffer<T> {
        self.view(0, self.len)
    }

    /// A view of elements `range` of this buffer: the same memory, kept alive like this
    /// buffer. Cheap (no driver call).
    ///
    /// Errors: [`Error::InvalidArgument`] for a range that is decreasing or ends past
    /// [`len`](Self::len) (nothing is made).
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceBuffer<T>> {
        let start = match range.start_bound() {
            Bound::Included(&s) => Some(s),
            Bound::Excluded(&s) => s.checked_add(1),
            Bound::Unbounded => Some(0),
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.checked_add(1),
            Bound::Excluded(&e) => Some(e),
            Bound::Unbounded => Some(self.len),
        };
        match (start, end) {
            (Some(s), Some(e)) if s <= e && e <= self.len => Ok(self.view(s, e - s)),
            _ => Err(Error::invalid(format!(
                "slice {:?}..{:?} out of a buffer of {} elements",
                range.start_bound(),
                range.end_bound(),
                self.len
            ))),
        }
    }

    /// Two views: elements `..mid` and `mid..`. Cheap (no driver call).
    ///
    /// Errors: [`Error::InvalidArgument`] for `mid` past [`len`](Self::len).
    pub fn split_at(&self, mid: usize) -> Result<(DeviceBuffer<T>, DeviceBuffer<T>)> {
        if mid > self.len {
            return Err(Error::invalid(format!(
                "split_at({mid}) of a buffer of {} elements",
                self.len
            )));
        }
        Ok((self.view(0, mid), self.view(mid, self.len - mid)))
    }

    /// The same memory viewed as elements of `U`: `bytes() / size_of::<U>()` of them.
    ///
    /// Errors: [`Error::InvalidArgument`] (nothing is made) when `U` is zero-sized, the byte
    /// size is not a multiple of `size_of::<U>()`, or the address is not aligned for `U`.
    pub fn reinterpret<U: DeviceRepr>(&self) -> Result<DeviceBuffer<U>> {
        let (bytes, size, align) = (self.bytes(), size_of::<U>(), align_of::<U>());
        let what = || {
            format!(
                "reinterpret {} bytes at {:#x} from {} to {}",
                bytes,
                self.ptr,
                std::any::type_name::<T>(),
                std::any::type_name::<U>()
            )
        };
        if size == 0 {
            return Err(Error::invalid(format!("{}: zero-sized type", what())));
        }
        if bytes % size != 0 {
            return Err(Error::invalid(format!(
                "{}: not a multiple of {size} bytes",
                what()
            )));
        }
        if self.ptr % align as u64 != 0 {
            return Err(Error::invalid(format!(
                "{}: address not {align}-byte aligned",
                what()
            )));
        }
        Ok(DeviceBuffer {
            alloc: self.alloc.clone(),
            ptr: self.ptr,
            len: bytes / size,
            _t: PhantomData,
        })
    }

    /// Elements `start .. start + len`, unchecked: the callers checked the range.
    fn view(&self, start: usize, len: usize) -> DeviceBuffer<T> {
        DeviceBuffer {
            alloc: self.alloc.clone(),
            ptr: self.ptr + (start * size_of::<T>()) as u64,
            len,
            _t: PhantomData,
        }
    }

    /// Whether `other` is a view of the same memory as `self` (same address and length).
    pub fn same_memory<U: DeviceRepr>(&self, other: &DeviceBuffer<U>) -> bool {
        self.ptr == other.ptr && self.bytes() == other.bytes()
    }

    /// Whether the two ranges of device memory overlap.
    pub fn overlaps<U: DeviceRepr>(&self, other: &DeviceBuffer<U>) -> bool {
        let a = (self.ptr, self.ptr + self.bytes() as u64);
        let b = (other.ptr, other.ptr + other.bytes() as u64);
        a.0 < b.1 && b.0 < a.1
    }
}
