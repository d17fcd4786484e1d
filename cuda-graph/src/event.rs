//! Events: timing and cross-stream ordering.

use std::sync::Arc;

use bitflags::bitflags;
use cuda_graph_sys::{CUevent, CUresult};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::stream::Stream;

bitflags! {
    /// Flags of [`Event::with_flags`] (`CU_EVENT_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct EventFlags: u32 {
        /// `synchronize` blocks the thread instead of spinning.
        const BLOCKING_SYNC = 0x1;
        /// No timing data: cheaper to record and wait on.
        const DISABLE_TIMING = 0x2;
    }
}

/// A CUDA event, owned; destroyed on drop.
#[derive(Debug)]
pub struct Event {
    raw: CUevent,
    ctx: Arc<Context>,
}

// SAFETY: the only field that is not `Send` by itself is the raw `CUevent`, a driver handle
// not tied to a thread; it may be recorded, waited on, queried and destroyed from any thread.
unsafe impl Send for Event {}
// SAFETY: `&self` methods only pass the handle to driver calls, which are thread-safe. Two
// threads recording one event at once is not a data race: the event marks whichever record
// the driver took last.
unsafe impl Sync for Event {}

impl Event {
    /// An event that records timestamps (for [`Event::elapsed_ms`]).
    ///
    /// Errors: as [`Event::with_flags`].
    pub fn new(ctx: &Arc<Context>) -> Result<Event> {
        Event::with_flags(ctx, EventFlags::empty())
    }

    /// An event with no timing, for ordering streams (cheaper to record and wait on).
    ///
    /// Errors: as [`Event::with_flags`].
    pub fn for_sync(ctx: &Arc<Context>) -> Result<Event> {
        Event::with_flags(ctx, EventFlags::DISABLE_TIMING)
    }

    /// An event with explicit flags.
    ///
    /// Wraps [`cuEventCreate`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html).
    /// Errors: [`Error::Driver`] (also from making `ctx` current).
    pub fn with_flags(ctx: &Arc<Context>, flags: EventFlags) -> Result<Event> {
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current.
        unsafe { cu!(cuEventCreate(&mut raw, flags.bits())) }?;
        Ok(Event {
            raw,
            ctx: ctx.clone(),
        })
    }

    /// Records the event at the current end of `stream`'s work.
    ///
    /// Wraps [`cuEventRecord`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html).
    /// Errors: [`Error::Driver`].
    pub fn record(&self, stream: &Stream) -> Result<()> {
        stream.context().ensure_current()?;
        // SAFETY: both handles are live.
        unsafe { cu!(cuEventRecord(self.raw, stream.as_raw())) }
    }

    /// Blocks until the recorded work completes.
    ///
    /// Wraps [`cuEventSynchronize`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html).
    /// Errors: [`Error::Driver`], including a fault of the recorded work;
    /// `CUDA_ERROR_CAPTURED_EVENT` for an event recorded in a running capture, which this
    /// invalidates.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.ensure_current()?;
        // SAFETY: live handle.
        unsafe { cu!(cuEventSynchronize(self.raw)) }
    }

    /// Whether the recorded work has completed.
    ///
    /// Wraps [`cuEventQuery`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html).
    /// Errors: [`Error::Driver`] for any result but success and `CUDA_ERROR_NOT_READY`
    /// (`false`); illegal on an event recorded in a running capture, as for
    /// [`Event::synchronize`].
    pub fn is_complete(&self) -> Result<bool> {
        self.ctx.ensure_current()?;
        // SAFETY: live handle.
        let rc = unsafe { cuda_graph_sys::driver()?.cuEventQuery()?(self.raw) };
        match rc {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            rc => Err(Error::driver("cuEventQuery", rc)),
        }
    }

    /// Milliseconds between `start` and `end`, both recorded and complete.
    ///
    /// Wraps [`cuEventElapsedTime`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html).
    /// Errors: [`Error::Driver`]: `CUDA_ERROR_NOT_READY` while either is pending;
    /// `CUDA_ERROR_INVALID_HANDLE` when either was never recorded or has no timing
    /// ([`Event::for_sync`]).
    pub fn elapsed_ms(start: &Event, end: &Event) -> Result<f32> {
        let mut ms = 0.0f32;
        start.ctx.ensure_current()?;
        // SAFETY: valid out-pointer, live handles.
        unsafe { cu!(cuEventElapsedTime(&mut ms, start.raw, end.raw)) }?;
        Ok(ms)
    }

    /// The raw handle; valid while this value lives.
    pub fn as_raw(&self) -> CUevent {
        self.raw
    }

    /// The context it was created in.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok(destroy) = cuda_graph_sys::driver().and_then(|d| d.cuEventDestroy()) {
            // SAFETY: owned handle, destroyed once. The driver defers the destruction until
            // recorded work completes.
            unsafe { destroy(self.raw) };
        }
    }
}
