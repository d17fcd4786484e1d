//! The primary context of a device, shared by everything created on it.

use std::sync::{Arc, OnceLock};

use cuda_graph_sys::CUcontext;

use crate::driver::{Device, init};
use crate::error::Result;

/// A device's primary context (the one the runtime API and PyTorch use too), retained for as
/// long as this value lives. Streams, buffers, modules and graphs hold an `Arc<Context>`, so
/// the context outlives them all.
///
/// Methods bind the context to the calling thread before driver calls that need a current
/// context, so it can be used from any thread.
#[derive(Debug)]
pub struct Context {
    raw: CUcontext,
    device: Device,
    /// Whether launches may use programmatic dependent launch ([`Context::supports_pdl`]).
    pdl: OnceLock<bool>,
    /// The device's SM count, asked once ([`Context::multiprocessor_count`]).
    sms: OnceLock<u32>,
}

// SAFETY: the only field that is not `Send` by itself is the raw `CUcontext`. The driver API
// is thread-safe and takes a context handle on any thread: the handle is not tied to the
// thread that retained it, and the methods that need a current context make it current on
// the calling thread first (`bind`). Releasing the retain (`Drop`) is legal on any thread.
unsafe impl Send for Context {}
// SAFETY: through `&self` the fields are only read (the handle, the device ordinal) or set
// once through a `OnceLock`, which is `Sync`; the handle only goes to driver calls, which
// are thread-safe, so two threads may use one context at the same time.
unsafe impl Sync for Context {}

impl Context {
    /// Retains the primary context of `device` and makes it current on this thread.
    ///
    /// Wraps [`cuDevicePrimaryCtxRetain`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PRIMARY__CTX.html)
    /// (released on drop).
    /// Errors: those of [`init`]; [`Error::Driver`](crate::Error::Driver) from the retain or
    /// from making the context current.
    pub fn new(device: Device) -> Result<Arc<Context>> {
        init()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer and device.
        unsafe { cu!(cuDevicePrimaryCtxRetain(&mut raw, device.as_raw())) }?;
        let ctx = Arc::new(Context {
            raw,
            device,
            pdl: OnceLock::new(),
            sms: OnceLock::new(),
        });
        ctx.bind()?;
        Ok(ctx)
    }

    /// The primary context of device 0.
    ///
    /// Errors: those of [`Device::get`] (including [`Error::NoDevice`](crate::Error::NoDevice))
    /// and [`Context::new`].
    pub fn default_device() -> Result<Arc<Context>> {
        Context::new(Device::get(0)?)
    }

    /// Makes this context current on the calling thread. Methods that need a current context
    /// call it themselves, which is what lets a context be used from any thread.
    ///
    /// Wraps [`cuCtxSetCurrent`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html).
    /// Errors: [`Error::Driver`](crate::Error::Driver).
    pub fn bind(&self) -> Result<()> {
        // SAFETY: raw is a live, retained context.
        unsafe { cu!(cuCtxSetCurrent(self.raw)) }
    }

    /// [`bind`](Self::bind) unless this context is already current on the calling thread:
    /// what every stream-ordered call (launches, copies, events, stream-ordered allocations)
    /// does first, so a stream made on one thread may be used from any other (the driver
    /// refuses a kernel launch from a thread with no current context). One query of the
    /// thread's current context when it is already this one.
    pub(crate) fn ensure_current(&self) -> Result<()> {
        let mut current = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        unsafe { cu!(cuCtxGetCurrent(&mut current)) }?;
        if current == self.raw {
            return Ok(());
        }
        self.bind()
    }

    /// Waits for all work in this context to finish.
    ///
    /// Uses the CUDA 13.0 `cuCtxSynchronize`, which names the context. A driver before 13.0
    /// lacks that ABI; then this binds the context to the calling thread and calls the older
    /// form, which waits for the current context. Without either, the error names the entry:
    /// the wait is never skipped.
    ///
    /// Wraps [`cuCtxSynchronize`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html).
    /// Errors: [`Error::Driver`](crate::Error::Driver), including a fault of earlier work in the
    /// context; illegal while a stream of the context captures (it invalidates the capture).
    /// [`Error::Load`](crate::Error::Load) only when the driver has neither form.
    pub fn synchronize(&self) -> Result<()> {
        let d = cuda_graph_sys::driver()?;
        if let Ok(sync) = d.cuCtxSynchronize() {
            // SAFETY: raw is a live, retained context.
            return crate::error::check("cuCtxSynchronize", unsafe { sync(self.raw) });
        }
        let sync = d.cuCtxSynchronize_v2000()?;
        self.bind()?;
        // SAFETY: no arguments; this context is current on this thread (bound just above).
        crate::error::check("cuCtxSynchronize", unsafe { sync() })
    }

    /// Whether the context can still run work: waits for the work enqueued in it so far
    /// (as [`Context::synchronize`]) and reports the first fault of that work.
    ///
    /// A fault of device code (an out-of-bounds access, a device-side `assert` or
    /// `__trap()`, an illegal instruction) is *sticky*: the driver returns it from then on to
    /// every call in the context, and with the primary context that is every call of the
    /// process; the context cannot be repaired, and the process must exit before it can use
    /// the device again. Such an error is usually first seen by whatever call waits next
    /// (a stream, event or exec `synchronize`); this is the call to make when a program must
    /// know whether to go on or stop. Once the context is poisoned it returns at once.
    ///
    /// Wraps [`cuCtxSynchronize`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html);
    /// the sticky codes are listed at [`Error::is_sticky`](crate::Error::is_sticky).
    ///
    /// # Errors
    /// * [`Error::Driver`](crate::Error::Driver) naming `cuCtxSynchronize` whose
    ///   [`is_sticky`](crate::Error::is_sticky) is true: the context is unusable.
    /// * Any other error of [`Context::synchronize`]: the context is not known to be
    ///   unusable. Like it, this is illegal while a stream of the context captures (it
    ///   invalidates the capture).
    ///
    /// ```no_run
    /// # fn f(ctx: &cuda_graph::Context) {
    /// match ctx.check_health() {
    ///     Ok(()) => {}
    ///     Err(e) if e.is_sticky() => {
    ///         eprintln!("the GPU context is unusable, exiting: {e}");
    ///         std::process::exit(1);
    ///     }
    ///     Err(e) => eprintln!("could not check the context: {e}"),
    /// }
    /// # }
    /// ```
    pub fn check_health(&self) -> Result<()> {
        self.synchronize()
    }

    /// The device it belongs to.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Whether kernels launched in this context may use programmatic dependent launch
    /// ([`Stream::launch_pdl`](crate::Stream::launch_pdl)): the driver and device have it
    /// ([`Feature::ProgrammaticDependentLaunch`](crate::driver::Feature::ProgrammaticDependentLaunch))
    /// and the environment variable `CUDA_GRAPH_PDL` is not `0` (the switch for measuring
    /// without it, or ruling it out when debugging). Asked once per context; a failed query
    /// counts as "no".
    pub fn supports_pdl(&self) -> bool {
        *self.pdl.get_or_init(|| {
            std::env::var("CUDA_GRAPH_PDL").map_or(true, |v| v != "0")
                && self
                    .device
                    .supports(crate::driver::Feature::ProgrammaticDependentLaunch)
                    .unwrap_or(false)
        })
    }

    /// The device's multiprocessor (SM) count, asked from the driver once per context and
    /// then read from memory: launchers that size grids from it call it per launch.
    ///
    /// Errors: those of [`Device::multiprocessor_count`] on the first call.
    pub fn multiprocessor_count(&self) -> Result<u32> {
        if let Some(&sms) = self.sms.get() {
            return Ok(sms);
        }
        let sms = u32::try_from(self.device.multiprocessor_count()?).unwrap_or(0);
        Ok(*self.sms.get_or_init(|| sms))
    }

    /// The raw handle; valid while this value lives.
    pub fn as_raw(&self) -> CUcontext {
        self.raw
    }

    /// `(free, total)` bytes of this context's device memory, as the driver counts them now.
    /// `free` is what every process and context on the device leaves; `total - free` is the
    /// memory in use, which is what a leak check samples. The driver hands out device memory
    /// in pages (2 MiB on recent GPUs), so `free` moves in such steps.
    ///
    /// Binds the context first: the driver reports the current context's device.
    ///
    /// Wraps [`cuMemGetInfo`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html).
    /// Errors: [`Error::Driver`](crate::Error::Driver), including from making the context
    /// current.
    ///
    /// ```no_run
    /// let ctx = cuda_graph::Context::default_device()?;
    /// let (free, total) = ctx.memory_info()?;
    /// println!("{} of {} MiB in use", (total - free) >> 20, total >> 20);
    /// # Ok::<(), cuda_graph::Error>(())
    /// ```
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; this context is current on this thread (bound above).
        unsafe { cu!(cuMemGetInfo(&mut free, &mut total)) }?;
        Ok((free, total))
    }

    /// `(least, greatest)` stream priority; numerically lower is higher priority.
    ///
    /// Wraps [`cuCtxGetStreamPriorityRange`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html).
    /// Errors: [`Error::Driver`](crate::Error::Driver).
    pub fn stream_priority_range(&self) -> Result<(i32, i32)> {
        self.bind()?;
        let (mut least, mut greatest) = (0, 0);
        // SAFETY: valid out-pointers, context current.
        unsafe { cu!(cuCtxGetStreamPriorityRange(&mut least, &mut greatest)) }?;
        Ok((least, greatest))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if let Ok(release) = cuda_graph_sys::driver().and_then(|d| d.cuDevicePrimaryCtxRelease()) {
            // SAFETY: balances the retain in `new`; nothing holds the context any more.
            unsafe { release(self.device.as_raw()) };
        }
    }
}
