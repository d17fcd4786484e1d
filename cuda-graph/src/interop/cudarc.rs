//! Interop with [cudarc](https://docs.rs/cudarc/0.19) (feature `cudarc`): adopt its context,
//! streams, slices and kernels without `unsafe`, capture the work cudarc and cuBLAS (through
//! cudarc) enqueue into a [`Graph`](crate::Graph), and hand this crate's buffers and streams
//! to cudarc.
//!
//! | cudarc | this crate | kept alive |
//! |---|---|---|
//! | `Arc<CudaContext>` | [`Context::from_cudarc`] | the device's primary context (retained once more) |
//! | `Arc<CudaStream>` | [`Stream::from_cudarc`] | the `Arc<CudaStream>`, by every clone of the stream |
//! | `CudaSlice<T>` | [`DeviceBuffer::from_cudarc`] | the slice, by every view, graph and exec; cudarc's drop frees it |
//! | `CudaFunction` | [`Kernel::from_cudarc`] | the function (and its `Arc<CudaModule>`) |
//! | `&DeviceBuffer<T>` as a kernel argument | `launch_builder(..).arg(&buf)` | nothing: register it (below) |
//! | `DeviceBuffer<T>` for cuBLAS and cudarc copies | [`DeviceBuffer::as_cudarc`] | nothing: register it (below) |
//! | this crate's [`Stream`] as a `CudaStream` | [`Stream::with_cudarc`] | the stream, while cudarc holds it |
//!
//! cudarc's [`DriverError`] and [`CublasError`] convert into [`Error`] (`?` works in capture
//! closures).
//!
//! # Capturing cudarc work
//!
//! Inside [`Stream::capture`] on a stream adopted with [`Stream::from_cudarc`], work that
//! cudarc enqueues on the same `CudaStream` is captured like work of this crate. Graph
//! nodes made that way use memory, modules and library handles this crate did not see:
//! register each with [`CaptureScope::keep_alive`](crate::CaptureScope::keep_alive) — a
//! buffer's [`resource`](DeviceBuffer::resource), `Arc::new(function.clone())` for a
//! `CudaFunction`, an `Arc<CudaBlas>` (its handle owns cuBLAS's default workspace) — and the
//! graph and every exec made from it keep them alive. Kernel nodes captured that way are
//! updated like any other: find one with [`Graph::nodes`](crate::Graph::nodes),
//! [`KernelNode::try_from`](crate::KernelNode) and
//! [`Graph::kernel_function`](crate::Graph::kernel_function) (compare with
//! [`Kernel::as_raw`]), then [`GraphExec::set_kernel_params`](crate::GraphExec::set_kernel_params)
//! with the [`Kernel::from_cudarc`] of the same function. Conditional bodies are captured on
//! a scratch stream of this crate: lend it to cudarc with [`Stream::with_cudarc`].
//!
//! cuBLAS may allocate its workspace with stream-ordered allocation while capturing, which
//! becomes graph memory nodes; those are refused inside conditional bodies and child graphs.
//! NVIDIA's advice ([cuBLAS and CUDA graphs](https://docs.nvidia.com/cuda/cublas/#cuda-graphs-support))
//! is to give the handle a workspace of your own with `cublasSetWorkspace_v2`
//! (`cudarc::cublas::sys`), and keep that buffer alive with the graph.
//!
//! ```no_run
//! use std::sync::Arc;
//! use cuda_graph::{CaptureMode, DeviceBuffer, GraphExec, InstantiateFlags, Stream};
//! use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let ptx = "";
//! let cu_ctx = CudaContext::new(0)?;
//! // Before allocating what will be captured: see "event tracking" below.
//! // SAFETY: this program orders its streams itself (it uses one).
//! unsafe { cu_ctx.disable_event_tracking() };
//! let cu_stream = cu_ctx.new_stream()?;
//! let stream = Stream::from_cudarc(&cu_stream)?; // keeps `cu_stream` alive
//! let x = DeviceBuffer::from_cudarc(cu_stream.clone_htod(&[1.0f32; 256])?)?;
//! let module = cu_ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx))?;
//! let double = module.load_function("double_f32")?;
//! let graph = stream.capture(CaptureMode::ThreadLocal, |s| {
//!     let n = 256u32;
//!     let cfg = LaunchConfig::for_num_elems(n);
//!     // SAFETY: double_f32(float*, unsigned) touches x[0..n).
//!     unsafe { cu_stream.launch_builder(&double).arg(&x).arg(&n).launch(cfg) }?;
//!     s.keep_alive(x.resource());
//!     s.keep_alive(Arc::new(double.clone()));
//!     Ok(())
//! })?;
//! drop((x, module, double)); // the graph keeps what it needs
//! let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
//! exec.launch(&stream)?;
//! stream.synchronize()?;
//! # Ok(()) }
//! ```
//!
//! # cudarc's event tracking during a capture
//!
//! What cudarc 0.19 does (`driver/safe/core.rs`, `launch.rs`): a `CudaContext` *manages
//! stream synchronization* once it is in multi-stream mode (a stream was made with
//! `new_stream`, `new_stream_with_priority` or `CudaStream::fork`; `default_stream` and
//! `wrap_borrowed_stream` do not count) while event tracking is on (the default; see
//! `is_managing_stream_synchronization`). Every `CudaSlice` allocated while tracking is on
//! carries a read and a write `CudaEvent`. While the context manages synchronization, each
//! use of a slice on a stream — a kernel argument (`launch_builder().arg(&slice)`), a copy, a
//! memset, a cuBLAS call (`device_ptr`, `device_ptr_mut`) — first makes that stream wait
//! (`cuStreamWaitEvent`) on the slice's write event (and, for a write, its read event), then
//! records the read or write event on that stream; dropping (or `leak`ing) a slice makes its
//! allocating stream wait on both before `cuMemFreeAsync`.
//!
//! During a capture this connects captured work with work outside the capture, which the
//! driver refuses rather than ignores (CUDA programming guide, "Prohibited and Unhandled
//! Operations"):
//! * the capturing stream waits on an event last recorded *outside* the capture (every slice
//!   written before the capture): the driver answers `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`
//!   (905) and the capture is invalidated. A kernel launch returns that error; copies and
//!   cuBLAS calls only store it in the context (`CudaContext::record_err`), where the next
//!   cudarc call on the context returns it (`check_err`). The scope fails with
//!   [`Error::CaptureInvalidated`], whose `call` is `"a cudarc driver call"` when the error
//!   came back through `?`, [`UNKNOWN_CAPTURE_CALL`](crate::UNKNOWN_CAPTURE_CALL) when
//!   cudarc kept it;
//! * the slices' events end up recorded *inside* the capture: they stand for graph nodes,
//!   not for work that ran, so later eager waits on them (the next use of the slice, its
//!   drop) depend on a capture that has ended.
//!
//! So, while capturing, cudarc must not track the slices the captured work uses. Either:
//! * call `unsafe { CudaContext::disable_event_tracking() }` before the capture (in cudarc
//!   0.19 every wait and record is skipped while tracking is off, also for slices allocated
//!   before), and order the streams yourself (with one stream, stream order does it); or
//! * hand cudarc no `CudaSlice` inside the capture: adopt the slices with
//!   [`DeviceBuffer::from_cudarc`] first and pass the buffers (`.arg(&buf)`,
//!   [`DeviceBuffer::as_cudarc`]), which carry no events. An adopted slice keeps its events
//!   for its drop, which then waits on them on its own stream: don't let the last holder of
//!   an adopted buffer go while that stream is capturing.
//!
//! With tracking off during the capture nothing is recorded in it, so tracking may be turned
//! back on afterwards (`enable_event_tracking`; slices allocated while it was off stay
//! untracked, as cudarc documents).
//!
//! # Libraries at run time
//!
//! cudarc is built with dynamic loading, like this crate: nothing is linked at build time;
//! cudarc opens `libcuda.so` on first use and `libcublas.so.13` (or another name of its
//! list) on the first cuBLAS call, by name, through the dynamic loader's search path, and
//! **panics** when a library is missing. Put the folder of `libcublas.so.13` on
//! `LD_LIBRARY_PATH` (from PyTorch's NVIDIA wheels:
//! `$(python3 -c 'import nvidia; print(nvidia.__path__[0])')/cu13/lib`, or `.../cublas/lib`
//! for the older per-library wheels), and check it first with
//! `unsafe { cudarc::cublas::sys::is_culib_present() }` to fail with a message instead.

use std::sync::Arc;

use cuda_graph_sys::{CUcontext, CUresult, CUstream};
use cudarc::cublas::result::CublasError;
use cudarc::driver::sys::CUstreamCaptureStatus;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice,
    DriverError, LaunchArgs, PushKernelArg, SyncOnDrop,
};

use crate::context::Context;
use crate::driver::Device;
use crate::error::{Error, Result, note_capture_error};
use crate::memory::{DeviceBuffer, DeviceRepr};
use crate::module::Kernel;
use crate::stream::Stream;

/// The `call` of errors that come from cudarc: which driver call failed is not known here.
const CUDARC_CALL: &str = "a cudarc driver call";

impl From<DriverError> for Error {
    /// An [`Error::Driver`] with cudarc's result code (a stream-capture error is also noted
    /// as the capture's cause, as for this crate's own calls).
    fn from(e: DriverError) -> Error {
        let code = CUresult(e.0 as u32);
        note_capture_error(CUDARC_CALL, code);
        Error::driver(CUDARC_CALL, code)
    }
}

impl From<CublasError> for Error {
    /// An [`Error::External`] carrying the cuBLAS status.
    fn from(e: CublasError) -> Error {
        Error::external(e)
    }
}

/// Whether a cudarc context and this crate's are the same driver context.
fn same_context(cu: &CudaContext, ours: &Context) -> bool {
    cu.cu_ctx() as CUcontext == ours.as_raw()
}

impl Context {
    /// The context of a cudarc [`CudaContext`]: the primary context of its device, retained
    /// once more for as long as the returned value lives (cudarc's own `Arc` is not needed
    /// for that).
    ///
    /// Errors ([`Error::InvalidArgument`]): a non-primary cudarc context
    /// (`CudaContext::new_non_primary`, `new_cig`, `from_raw_context`), which this crate
    /// cannot share; the driver's.
    pub fn from_cudarc(ctx: &Arc<CudaContext>) -> Result<Arc<Context>> {
        if !ctx.is_primary() {
            return Err(Error::invalid(
                "cudarc context: not a primary context; cuda-graph shares primary contexts only",
            ));
        }
        let ordinal = i32::try_from(ctx.ordinal())
            .map_err(|_| Error::invalid(format!("cudarc device ordinal {}", ctx.ordinal())))?;
        let ours = Context::new(Device::get(ordinal)?)?;
        if !same_context(ctx, &ours) {
            return Err(Error::invalid(format!(
                "cudarc context {:p} is not the primary context {:p} of device {ordinal}",
                ctx.cu_ctx(),
                ours.as_raw()
            )));
        }
        Ok(ours)
    }
}

impl Stream {
    /// Adopts a cudarc stream: the returned stream (and every clone of it) keeps the
    /// `Arc<CudaStream>` alive, and never destroys the stream itself; cudarc does, when its
    /// last `Arc` goes. Work enqueued through cudarc on `stream` and through this crate on
    /// the returned stream is one queue, in order.
    ///
    /// Capture ([`Stream::capture`]) needs a stream made with `CudaContext::new_stream` (or
    /// `fork`): the legacy default stream (`default_stream`) cannot be captured.
    ///
    /// Errors: as [`Context::from_cudarc`] for the stream's context.
    pub fn from_cudarc(stream: &Arc<CudaStream>) -> Result<Stream> {
        let ctx = Context::from_cudarc(stream.context())?;
        let raw = stream.cu_stream() as CUstream;
        // SAFETY: `raw` is the stream of the CudaStream, which belongs to `ctx` (the same
        // primary context, checked by `from_cudarc`) and stays valid for as long as the
        // CudaStream lives: the owner handed over is an `Arc` of it.
        Ok(unsafe { Stream::from_owner(&ctx, raw, Arc::new(stream.clone())) })
    }

    /// Runs `f` with this stream lent to cudarc as an `Arc<CudaStream>` (of cudarc context
    /// `ctx`, which must be this stream's context): cudarc work `f` enqueues on it lands on
    /// this stream, in order, and is captured when this stream captures — e.g. in the body
    /// closures of [`Stream::capture_if`] and friends, which capture on a scratch stream of
    /// this crate.
    ///
    /// The lent `CudaStream` does not own the stream (cudarc never destroys it). If `f` keeps
    /// a clone of it (or of something holding one, such as a `CudaBlas`) past its return,
    /// this stream is never destroyed, so that the clone stays valid: a leak, never a
    /// dangling stream.
    ///
    /// Errors ([`Error::InvalidArgument`], `f` not called): `ctx` is not this stream's
    /// context.
    pub fn with_cudarc<R>(
        &self,
        ctx: &Arc<CudaContext>,
        f: impl FnOnce(&Arc<CudaStream>) -> R,
    ) -> Result<R> {
        if !same_context(ctx, self.context()) {
            return Err(Error::invalid(
                "with_cudarc: the cudarc context is not the stream's context",
            ));
        }
        // SAFETY: `self` is a live stream of `ctx` (checked above). The wrapper is only
        // used while `self` lives: `Lent` leaks a handle of this stream (so it is never
        // destroyed) if a clone of the wrapper survives `f`, also when `f` panics. Ordering
        // is stream order: cudarc enqueues on this very stream.
        let wrapper = unsafe { ctx.wrap_borrowed_stream(self.as_raw() as _) };
        let lent = Lent {
            stream: self,
            wrapper,
        };
        Ok(f(&lent.wrapper))
    }
}

/// A stream lent to cudarc by [`Stream::with_cudarc`]; on drop, leaks the stream if cudarc's
/// wrapper of it is still referenced.
struct Lent<'s> {
    stream: &'s Stream,
    wrapper: Arc<CudaStream>,
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        // With one strong and no weak reference left, ours is the last: nothing can use the
        // raw stream after this. Otherwise a clone escaped and may outlive `self.stream`.
        if Arc::strong_count(&self.wrapper) > 1 || Arc::weak_count(&self.wrapper) > 0 {
            std::mem::forget(self.stream.clone());
        }
    }
}

impl<T: DeviceRepr> DeviceBuffer<T> {
    /// Adopts a cudarc slice: the buffer (and its views, and the graphs and execs using them)
    /// owns the `CudaSlice` and drops it after the last of them, which frees the memory
    /// cudarc's way (`cuMemFreeAsync` on the slice's stream, or `cuMemFree`).
    ///
    /// On adoption the memory becomes idle: the slice's stream is made to wait for every use
    /// cudarc tracked (see [event tracking](self#cudarcs-event-tracking-during-a-capture)),
    /// then synchronized, so work enqueued through cudarc on the slice before is complete.
    /// After that, ordering is the caller's, as for any buffer: work enqueued on other
    /// streams must finish before the last holder goes (the free is ordered on the slice's
    /// stream only, as for [`DeviceBuffer::alloc_async`]).
    ///
    /// Errors: the slice's stream is capturing ([`Error::InvalidArgument`]; adopt before the
    /// capture); its context is not a primary context ([`Context::from_cudarc`]); cudarc's
    /// errors, among them errors stored in its context by earlier calls.
    pub fn from_cudarc(mut slice: CudaSlice<T>) -> Result<DeviceBuffer<T>> {
        let stream = slice.stream().clone();
        if stream.capture_status()? != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(Error::invalid(
                "DeviceBuffer::from_cudarc: the slice's stream is capturing; adopt slices \
                 before the capture",
            ));
        }
        let ctx = Context::from_cudarc(slice.context())?;
        let (ptr, record) = slice.device_ptr_mut(&stream);
        drop(record);
        stream.synchronize()?;
        let len = slice.len();
        // SAFETY: the slice owns `len` elements of `T` at `ptr` in `ctx` (cudarc allocates
        // them with cuMemAlloc(Async), aligned for any `T`), and keeps them allocated until
        // it is dropped; dropping it (any thread) frees them, ordered on its stream.
        unsafe { DeviceBuffer::from_owner(&ctx, ptr, len, Box::new(slice)) }
    }

    /// This buffer as a cudarc device slice on `stream`, for cudarc's APIs that take
    /// `DevicePtr` / `DevicePtrMut` arguments: cuBLAS (`Gemm`, `Gemv`), copies
    /// (`memcpy_htod`, `memcpy_dtoh`, `clone_dtoh`), `memset_zeros`. Writes go through `&`,
    /// as everywhere in this crate ([the rule](crate::memory#one-rule-for-device-writes)).
    ///
    /// The view carries no cudarc events, so cudarc's event tracking never applies to it:
    /// order its uses with the streams (its `stream` is what cudarc calls "the stream this
    /// memory was allocated on"; cudarc uses it only to tell peer copies between contexts).
    /// A graph capturing work on it does not know about it: register
    /// [`resource`](DeviceBuffer::resource) with
    /// [`CaptureScope::keep_alive`](crate::CaptureScope::keep_alive).
    ///
    /// For kernel arguments pass the buffer itself: `launch_builder(..).arg(&buf)`.
    ///
    /// Errors ([`Error::InvalidArgument`]): `stream` belongs to another context.
    pub fn as_cudarc<'a>(&'a self, stream: &'a Arc<CudaStream>) -> Result<CudarcView<'a, T>> {
        if !same_context(stream.context(), self.context()) {
            return Err(Error::invalid(
                "as_cudarc: the cudarc stream belongs to another context than the buffer",
            ));
        }
        Ok(CudarcView { buf: self, stream })
    }
}

/// A [`DeviceBuffer`] seen by cudarc, from [`DeviceBuffer::as_cudarc`]: implements cudarc's
/// [`DeviceSlice`], [`DevicePtr`] and [`DevicePtrMut`] without event tracking.
#[derive(Debug)]
pub struct CudarcView<'a, T: DeviceRepr> {
    buf: &'a DeviceBuffer<T>,
    stream: &'a Arc<CudaStream>,
}

impl<T: DeviceRepr> DeviceSlice<T> for CudarcView<'_, T> {
    fn len(&self) -> usize {
        self.buf.len()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T: DeviceRepr> DevicePtr<T> for CudarcView<'_, T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.buf.as_raw(), SyncOnDrop::Sync(None))
    }
}

impl<T: DeviceRepr> DevicePtrMut<T> for CudarcView<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.buf.as_raw(), SyncOnDrop::Sync(None))
    }
}

// SAFETY: pushes one 8-byte kernel argument, the buffer's device address, by the address of
// the field that holds it inside the buffer, borrowed for `'b`, which outlives the builder
// (`'b: 'a`): what cudarc pushes for a `&CudaSlice`. What the kernel does with the memory is
// the launch's business (`LaunchArgs::launch` is unsafe).
unsafe impl<'a, 'b: 'a, T: DeviceRepr> PushKernelArg<&'b DeviceBuffer<T>> for LaunchArgs<'a> {
    fn arg(&mut self, arg: &'b DeviceBuffer<T>) -> &mut Self {
        <Self as PushKernelArg<&'b u64>>::arg(self, arg.ptr_ref())
    }
}

impl Kernel {
    /// The kernel of a cudarc [`CudaFunction`], for this crate's launches, kernel nodes and
    /// [`GraphExec::set_kernel_params`](crate::GraphExec::set_kernel_params) (e.g. on a node
    /// captured from a cudarc launch of the same function). It keeps a clone of the function,
    /// and so its module, loaded. Its name comes from the driver (`cuFuncGetName`, driver >=
    /// 12.3; `"cudarc kernel"` before), its parameter sizes as for [`Module::kernel`](crate::Module::kernel).
    pub fn from_cudarc(function: &CudaFunction) -> Result<Kernel> {
        let raw = function.cu_function() as cuda_graph_sys::CUfunction;
        let name = function_name(raw).unwrap_or_else(|| "cudarc kernel".to_owned());
        // SAFETY: `raw` is the function of the CudaFunction, whose module stays loaded while
        // the CudaFunction (holding an Arc of it) lives: the owner handed over is a clone.
        unsafe { Kernel::from_owner(raw, Arc::new(function.clone()), &name) }
    }
}

/// The function's name (`cuFuncGetName`), when the driver has the entry.
fn function_name(raw: cuda_graph_sys::CUfunction) -> Option<String> {
    let get = cuda_graph_sys::driver().ok()?.cuFuncGetName().ok()?;
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: a live function and a valid out-pointer; on success the driver returns a
    // NUL-terminated string it owns, valid while the function's module is loaded (copied
    // below, while the caller holds the function).
    let rc = unsafe { get(&mut name, raw) };
    if rc != CUresult::CUDA_SUCCESS || name.is_null() {
        return None;
    }
    // SAFETY: as above.
    Some(
        unsafe { std::ffi::CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cudarc_errors_become_driver_errors_and_note_capture_causes() {
        use cudarc::driver::sys::CUresult as CuRc;
        let saved = crate::error::replace_capture_cause(None);
        let e = Error::from(DriverError(CuRc::CUDA_ERROR_INVALID_VALUE));
        assert_eq!(e.code(), Some(CUresult::CUDA_ERROR_INVALID_VALUE));
        assert_eq!(crate::error::replace_capture_cause(None), None);
        let e = Error::from(DriverError(CuRc::CUDA_ERROR_STREAM_CAPTURE_ISOLATION));
        assert_eq!(e.code(), Some(CUresult(905)));
        assert!(e.to_string().starts_with(CUDARC_CALL), "{e}");
        assert_eq!(
            crate::error::replace_capture_cause(saved),
            Some((CUDARC_CALL, CUresult(905)))
        );
    }

    #[test]
    fn cublas_errors_are_carried() {
        use cudarc::cublas::sys::cublasStatus_t;
        let e = Error::from(CublasError(cublasStatus_t::CUBLAS_STATUS_NOT_INITIALIZED));
        assert!(matches!(e, Error::External(_)));
        assert!(e.to_string().contains("NOT_INITIALIZED"), "{e}");
    }
}
