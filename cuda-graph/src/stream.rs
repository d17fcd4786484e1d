//! Streams: ordered queues of device work.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use cuda_graph_sys::{CUresult, CUstream, CUstream_flags};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::memory::Allocation;
use crate::resources::{Resource, ResourceSet};

/// A non-blocking CUDA stream. Cloning gives another handle to the same stream; the stream is
/// destroyed when the last handle goes (unless it was borrowed with [`Stream::from_raw`]).
///
/// Everything enqueued through the safe API that refers to a buffer or module also hands the
/// stream an `Arc` of it while a capture is running, so a captured graph keeps alive what its
/// nodes use.
#[derive(Debug, Clone)]
pub struct Stream {
    inner: Arc<StreamInner>,
}

#[derive(Debug)]
struct StreamInner {
    raw: CUstream,
    ctx: Arc<Context>,
    owned: bool,
    /// What keeps a stream adopted from another library alive ([`Stream::from_owner`]).
    _owner: Option<Resource>,
    /// Resources used by work enqueued during an ongoing capture (see `capture.rs`).
    captured: Mutex<Option<ResourceSet>>,
    /// Graph memory nodes allocated on this stream during the ongoing capture: marked ended
    /// with it, so that later captures keep them alive.
    graph_allocs: Mutex<Vec<Weak<Allocation>>>,
    /// Whether `captured` is collecting: lets eager launches skip the lock.
    collecting: AtomicBool,
}

// SAFETY: the only field that is not `Send` by itself is the raw `CUstream`, a driver handle
// not tied to a thread: work may be enqueued on it from any thread, and the last handle may
// be dropped on any thread (`cuStreamDestroy` lets queued work finish). `_owner` is `Send`
// and `Sync` by type.
unsafe impl Send for StreamInner {}
// SAFETY: through `&self` the handle only goes to driver calls, which are thread-safe:
// several threads may enqueue on one stream at once (the driver serialises the submissions;
// their order is the order the calls happen to take). The only state changed through `&self`
// is the capture collection, behind a `Mutex` and an atomic flag.
unsafe impl Sync for StreamInner {}

impl Stream {
    /// A new non-blocking stream with default priority.
    ///
    /// Wraps [`cuStreamCreate`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    /// Errors: [`Error::Driver`] (also from making `ctx` current).
    pub fn new(ctx: &Arc<Context>) -> Result<Stream> {
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current.
        unsafe {
            cu!(cuStreamCreate(
                &mut raw,
                CUstream_flags::CU_STREAM_NON_BLOCKING.0
            ))
        }?;
        Ok(Stream::wrap(ctx, raw, true, None))
    }

    /// A new non-blocking stream with a priority; lower numbers run first. The driver clamps
    /// values outside [`Context::stream_priority_range`].
    ///
    /// Wraps [`cuStreamCreateWithPriority`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    /// Errors: [`Error::Driver`] (also from making `ctx` current).
    pub fn with_priority(ctx: &Arc<Context>, priority: i32) -> Result<Stream> {
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current.
        unsafe {
            cu!(cuStreamCreateWithPriority(
                &mut raw,
                CUstream_flags::CU_STREAM_NON_BLOCKING.0,
                priority
            ))
        }?;
        Ok(Stream::wrap(ctx, raw, true, None))
    }

    /// Borrows a stream created elsewhere (cudarc, candle, PyTorch); it is not destroyed on
    /// drop.
    ///
    /// # Safety
    /// `raw` must be a live stream of `ctx` and outlive every handle and every piece of work
    /// made from this value.
    pub unsafe fn from_raw(ctx: &Arc<Context>, raw: CUstream) -> Stream {
        Stream::wrap(ctx, raw, false, None)
    }

    /// Adopts a stream owned by another library: `owner` (e.g. cudarc's `Arc<CudaStream>`)
    /// is kept alive for as long as any handle to this stream lives, and dropped after the
    /// last one; the stream itself is not destroyed by this crate. Prefer a safe adopter
    /// where one exists (the `cudarc` feature's `Stream::from_cudarc`).
    ///
    /// # Safety
    /// `raw` must be a stream of `ctx` that stays valid for as long as `owner` lives.
    pub unsafe fn from_owner(ctx: &Arc<Context>, raw: CUstream, owner: Resource) -> Stream {
        Stream::wrap(ctx, raw, false, Some(owner))
    }

    fn wrap(ctx: &Arc<Context>, raw: CUstream, owned: bool, owner: Option<Resource>) -> Stream {
        Stream {
            inner: Arc::new(StreamInner {
                raw,
                ctx: ctx.clone(),
                owned,
                _owner: owner,
                captured: Mutex::new(None),
                graph_allocs: Mutex::new(Vec::new()),
                collecting: AtomicBool::new(false),
            }),
        }
    }

    /// The raw handle; valid while any handle to this stream lives.
    pub fn as_raw(&self) -> CUstream {
        self.inner.raw
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.inner.ctx
    }

    /// Blocks until all work on the stream is done.
    ///
    /// Wraps [`cuStreamSynchronize`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    /// Errors: [`Error::Driver`], including a fault of earlier work on the stream. Illegal
    /// while the stream captures: the driver refuses it and invalidates the capture, which
    /// then ends in [`Error::CaptureInvalidated`] naming this call.
    pub fn synchronize(&self) -> Result<()> {
        self.context().ensure_current()?;
        // SAFETY: live handle.
        unsafe { cu!(cuStreamSynchronize(self.inner.raw)) }
    }

    /// Whether all work on the stream is done.
    ///
    /// Wraps [`cuStreamQuery`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    /// Errors: [`Error::Driver`] for any result but success and `CUDA_ERROR_NOT_READY`
    /// (`false`); illegal while the stream captures, as for [`Stream::synchronize`].
    pub fn is_idle(&self) -> Result<bool> {
        self.context().ensure_current()?;
        // SAFETY: live handle.
        let rc = unsafe { cuda_graph_sys::driver()?.cuStreamQuery()?(self.inner.raw) };
        match rc {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            rc => Err(Error::driver("cuStreamQuery", rc)),
        }
    }

    /// Makes later work on this stream wait for `event`.
    ///
    /// Wraps [`cuStreamWaitEvent`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    /// Errors: [`Error::Driver`].
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.context().ensure_current()?;
        // SAFETY: live handles; flags must be 0.
        unsafe { cu!(cuStreamWaitEvent(self.inner.raw, event.as_raw(), 0)) }
    }

    /// Makes later work on this stream wait for all work enqueued so far on `other`, through
    /// a new event (released at once: the wait already holds the dependency).
    ///
    /// Wraps [`cuStreamWaitEvent`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    /// on an event recorded on `other`.
    /// Errors: [`Error::Driver`] from creating or recording the event, or from the wait.
    pub fn wait_stream(&self, other: &Stream) -> Result<()> {
        let event = Event::for_sync(self.context())?;
        event.record(other)?;
        self.wait_event(&event)
    }

    /// The stream's priority.
    ///
    /// Wraps [`cuStreamGetPriority`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    /// Errors: [`Error::Driver`].
    pub fn priority(&self) -> Result<i32> {
        let mut p = 0;
        self.context().ensure_current()?;
        // SAFETY: valid out-pointer, live handle.
        unsafe { cu!(cuStreamGetPriority(self.inner.raw, &mut p)) }?;
        Ok(p)
    }

    /// Hands `resource` to the capture running on this stream, if any, so the captured graph
    /// keeps it alive. Outside a capture nothing is needed here: `cuMemFree` waits for the
    /// device, and a stream-ordered free queues behind its own stream's work (work on other
    /// streams must be ordered before the drop by the user: see `DeviceBuffer::alloc_async`).
    pub(crate) fn retain_for_capture(&self, resource: impl FnOnce() -> Resource) {
        if !self.inner.collecting.load(Ordering::Acquire) {
            return;
        }
        let mut captured = self
            .inner
            .captured
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(set) = captured.as_mut() {
            set.insert(resource());
        }
    }

    /// Keeps `resources` alive for as long as the graph being captured on this stream, and
    /// every exec made from it, lives; outside a capture it does nothing.
    ///
    /// For work enqueued through calls other than this crate's (a communication library's
    /// collectives, say): the safe launches and copies register their buffers themselves, and
    /// this lets other libraries give their operands, and their own handles, the same
    /// guarantee. Streams forked from the capture collect into the same graph.
    pub fn keep_alive_in_capture(&self, resources: impl IntoIterator<Item = Resource>) {
        self.retain_all_for_capture(resources);
    }

    /// [`Stream::retain_for_capture`] for several resources under one lock.
    pub(crate) fn retain_all_for_capture(&self, resources: impl IntoIterator<Item = Resource>) {
        if !self.is_collecting() {
            return;
        }
        let mut captured = self
            .inner
            .captured
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(set) = captured.as_mut() {
            set.extend(resources);
        }
    }

    /// Whether a capture is collecting resources on this stream.
    #[inline]
    pub(crate) fn is_collecting(&self) -> bool {
        self.inner.collecting.load(Ordering::Acquire)
    }

    /// Starts collecting resources for a capture (see `retain_for_capture`).
    pub(crate) fn start_collecting(&self) {
        self.inner.collecting.store(true, Ordering::Release);
        *self
            .inner
            .captured
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(ResourceSet::default());
    }

    /// Notes a stream-ordered allocation made on this stream: while this crate's capture
    /// collects here, it is a graph memory node of that capture, ended with it.
    pub(crate) fn note_graph_allocation(&self, alloc: &Arc<Allocation>) {
        if self.is_collecting() {
            self.inner
                .graph_allocs
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(Arc::downgrade(alloc));
        }
    }

    /// Marks the graph memory nodes allocated on this stream during the capture that ends
    /// as ended (see [`Allocation::end_capture`]).
    pub(crate) fn end_graph_allocations(&self) {
        let allocs = std::mem::take(
            &mut *self
                .inner
                .graph_allocs
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
        for a in allocs.iter().filter_map(Weak::upgrade) {
            a.end_capture();
        }
    }

    /// Stops collecting and returns what was collected.
    pub(crate) fn take_collected(&self) -> Vec<Resource> {
        self.inner.collecting.store(false, Ordering::Release);
        self.inner
            .captured
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
            .map(ResourceSet::into_vec)
            .unwrap_or_default()
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Stream) -> bool {
        self.inner.raw == other.inner.raw
    }
}

impl Eq for Stream {}

impl Drop for StreamInner {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        if let Ok(destroy) = cuda_graph_sys::driver().and_then(|d| d.cuStreamDestroy()) {
            // SAFETY: owned handle, destroyed once; the driver lets queued work finish.
            unsafe { destroy(self.raw) };
        }
    }
}
