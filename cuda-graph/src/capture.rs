//! Stream capture as a closure scope.
//!
//! [`Stream::capture`] begins capturing on a stream, runs a closure that enqueues work, and
//! ends the capture, returning the recorded [`Graph`]. Work enqueued through this crate
//! during the capture hands the stream what it uses (buffers, modules), and the graph keeps
//! all of it alive.
//!
//! # Modes
//!
//! [`CaptureMode`] decides which *potentially unsafe* driver calls (calls that could
//! implicitly synchronize with captured work, such as `cuMemAlloc`, `cuMemFree` or
//! `cuMemcpy` without a stream) are refused while the capture runs:
//!
//! * [`CaptureMode::Global`] (the driver's default): refused on every thread whose own mode
//!   is not relaxed, while any global capture runs in the process;
//! * [`CaptureMode::ThreadLocal`]: refused only on the thread that began the capture, so
//!   other threads may allocate and capture their own streams;
//! * [`CaptureMode::Relaxed`]: never refused (the caller vouches for what they do).
//!
//! In a multi-threaded program prefer [`CaptureMode::ThreadLocal`]: during a global capture
//! a plain `DeviceBuffer::alloc` or a synchronous copy on *any* other thread fails (900) and
//! invalidates the capture (seen on the H200, driver 13.0).
//!
//! # What invalidates a capture
//!
//! A refused unsafe call, synchronizing or querying the capturing stream
//! ([`Stream::synchronize`], [`Stream::is_idle`]), synchronizing its context or device,
//! synchronizing or querying an event recorded in the capture, or waiting on work outside
//! the capture. The driver then returns `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` (900) from
//! the offending call, every later call on the capture returns `..._INVALIDATED` (901), and
//! the scope ends with [`Error::CaptureInvalidated`] naming the offending call.
//!
//! The call is known because every failing driver call made through this crate that returns
//! a stream-capture error records itself, once, in a thread-local slot that the scope reads
//! and clears; swallowing the error (`let _ = stream.synchronize();`) does not hide it. A
//! capture invalidated by another thread (e.g. its `cuMemAlloc` during a global capture), or
//! by a driver call made outside this crate, is reported with
//! `call == `[`UNKNOWN_CAPTURE_CALL`].
//!
//! # Threads
//!
//! Outside [`CaptureMode::Relaxed`] a capture must end on the thread that began it
//! (otherwise `CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`, 908); the scope guarantees that,
//! since it is not `Send` and the closure runs on the calling thread. Work may still be
//! enqueued on the captured streams from other threads in relaxed mode.
//!
//! # Failure
//!
//! If the closure returns an error or panics, or the capture is invalidated, the scope joins
//! its forks, ends the capture, discards the partial graph (for [`Stream::capture_into`]:
//! removes the nodes it added), restores the thread's capture mode and leaves the origin
//! and forked streams usable, not capturing. A panic continues unwinding afterwards.
//!
//! ```no_run
//! use cuda_graph::{CaptureMode, Context, DeviceBuffer, GraphExec, InstantiateFlags, Stream};
//! let ctx = Context::default_device()?;
//! let stream = Stream::new(&ctx)?;
//! let mut a = DeviceBuffer::<f32>::alloc(&ctx, 1024)?;
//! let mut b = DeviceBuffer::<f32>::alloc(&ctx, 1024)?;
//! let graph = stream.capture(CaptureMode::ThreadLocal, |s| {
//!     a.memset_bytes(s.stream(), 0)?;
//!     let side = s.fork()?; // runs concurrently with the origin
//!     b.memset_bytes(&side, 0)?;
//!     s.join(&side)?; // the origin continues after both
//!     Ok(())
//! })?;
//! let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
//! exec.launch(&stream)?;
//! stream.synchronize()?;
//! # Ok::<(), cuda_graph::Error>(())
//! ```

use std::sync::Arc;

use cuda_graph_sys::{
    CUgraph, CUgraphEdgeData, CUgraphNode, CUresult, CUstreamCaptureMode, CUstreamCaptureStatus,
};

use crate::error::{CaptureCause, Error, Result, replace_capture_cause};
use crate::event::Event;
use crate::graph::Graph;
use crate::resources::Resource;
use crate::stream::Stream;

/// The `call` of an [`Error::CaptureInvalidated`] whose cause was not seen on the capturing
/// thread: another thread, or a driver call made outside this crate, invalidated it.
pub const UNKNOWN_CAPTURE_CALL: &str = "unknown (another thread, or a call outside this crate)";

/// How a capture treats potentially unsafe driver calls (`CUstreamCaptureMode`); see the
/// [module documentation](self#modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    /// Unsafe calls are refused, and invalidate the capture, on any thread not in relaxed
    /// mode while the capture runs (`CU_STREAM_CAPTURE_MODE_GLOBAL`).
    Global,
    /// Unsafe calls are refused only on the capturing thread
    /// (`CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`).
    ThreadLocal,
    /// No call is refused (`CU_STREAM_CAPTURE_MODE_RELAXED`); the capture may also end on
    /// another thread.
    Relaxed,
}

impl CaptureMode {
    /// The driver's value.
    pub fn to_raw(self) -> CUstreamCaptureMode {
        match self {
            CaptureMode::Global => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CaptureMode::Relaxed => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        }
    }

    /// The mode for a driver value; `None` for a value this crate does not know.
    pub fn from_raw(raw: CUstreamCaptureMode) -> Option<CaptureMode> {
        match raw {
            CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL => Some(CaptureMode::Global),
            CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => {
                Some(CaptureMode::ThreadLocal)
            }
            CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED => Some(CaptureMode::Relaxed),
            _ => None,
        }
    }
}

/// Whether a stream is capturing (`CUstreamCaptureStatus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CaptureStatus {
    /// Not capturing.
    None,
    /// Capturing.
    Active,
    /// Part of a capture that was invalidated and has not ended yet.
    Invalidated,
}

impl CaptureStatus {
    /// The driver's value.
    pub fn to_raw(self) -> CUstreamCaptureStatus {
        match self {
            CaptureStatus::None => CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE,
            CaptureStatus::Active => CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE,
            CaptureStatus::Invalidated => {
                CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED
            }
        }
    }

    /// The status for a driver value; `None` for a value this crate does not know.
    pub fn from_raw(raw: CUstreamCaptureStatus) -> Option<CaptureStatus> {
        match raw {
            CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Some(CaptureStatus::None),
            CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Some(CaptureStatus::Active),
            CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => {
                Some(CaptureStatus::Invalidated)
            }
            _ => None,
        }
    }
}

fn status_from_raw(raw: CUstreamCaptureStatus) -> Result<CaptureStatus> {
    CaptureStatus::from_raw(raw)
        .ok_or_else(|| Error::invalid(format!("unknown stream capture status {}", raw.0)))
}

/// Swaps the calling thread's capture mode (`cuThreadExchangeStreamCaptureMode`), returning
/// the previous one.
fn exchange_thread_mode(mode: CUstreamCaptureMode) -> Result<CUstreamCaptureMode> {
    let mut m = mode;
    // SAFETY: valid in/out pointer.
    unsafe { cu!(cuThreadExchangeStreamCaptureMode(&mut m)) }?;
    Ok(m)
}

/// Runs `f` with this thread's capture mode set to `RELAXED` (and restores it after, also on
/// error): calls the driver counts as potentially unsafe during a `GLOBAL` or `THREAD_LOCAL`
/// capture — loading a module, allocating — are then not refused and do not invalidate a
/// capture running on this or another thread. Used for lazy, one-time set-up work (module
/// loads) that may happen to run first inside a capture; it must not touch the capturing
/// stream.
pub(crate) fn relaxed<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    let saved = exchange_thread_mode(CaptureMode::Relaxed.to_raw())?;
    let out = f();
    let restored = exchange_thread_mode(saved);
    let out = out?;
    restored?;
    Ok(out)
}

/// What `cuStreamGetCaptureInfo` reports of a stream, copied out of the driver-owned arrays.
pub(crate) struct CaptureInfo {
    /// None, active or invalidated.
    pub(crate) status: CaptureStatus,
    /// The graph being captured into (null when not capturing).
    pub(crate) graph: CUgraph,
    /// The nodes the next captured work will depend on.
    pub(crate) deps: Vec<CUgraphNode>,
    /// The edge data of those dependencies (empty or one per dependency).
    pub(crate) edges: Vec<CUgraphEdgeData>,
}

/// The capture state of `stream` (`cuStreamGetCaptureInfo_v3`).
pub(crate) fn capture_info(stream: &Stream) -> Result<CaptureInfo> {
    let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id = 0u64;
    let mut graph: CUgraph = std::ptr::null_mut();
    let mut deps: *const CUgraphNode = std::ptr::null();
    let mut edges: *const CUgraphEdgeData = std::ptr::null();
    let mut n = 0usize;
    stream.context().ensure_current()?;
    // SAFETY: valid out-pointers; the driver owns the returned arrays, which stay valid until
    // the next call on the stream, and they are copied below before any.
    unsafe {
        cu!(cuStreamGetCaptureInfo(
            stream.as_raw(),
            &mut status,
            &mut id,
            &mut graph,
            &mut deps,
            &mut edges,
            &mut n
        ))
    }?;
    let status = status_from_raw(status)?;
    let deps = if deps.is_null() || n == 0 {
        Vec::new()
    } else {
        // SAFETY: the driver returned `n` nodes at `deps`.
        unsafe { std::slice::from_raw_parts(deps, n) }.to_vec()
    };
    let edges = if edges.is_null() || n == 0 {
        Vec::new()
    } else {
        // SAFETY: the driver returned `n` edge records at `edges`.
        unsafe { std::slice::from_raw_parts(edges, n) }.to_vec()
    };
    Ok(CaptureInfo {
        status,
        graph,
        deps,
        edges,
    })
}

/// The capture status of `stream` and its current capture dependencies, sorted (empty when
/// not capturing).
fn capture_dependencies(stream: &Stream) -> Result<(CaptureStatus, Vec<CUgraphNode>)> {
    let CaptureInfo {
        status, mut deps, ..
    } = capture_info(stream)?;
    deps.sort_unstable();
    Ok((status, deps))
}

/// Every node of `graph`.
fn graph_nodes(graph: CUgraph) -> Result<Vec<CUgraphNode>> {
    let mut n = 0usize;
    // SAFETY: live graph; a null array asks for the count.
    unsafe { cu!(cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n)) }?;
    let mut nodes = vec![std::ptr::null_mut(); n];
    if n > 0 {
        // SAFETY: the array has room for `n` nodes; the driver writes at most `n`.
        unsafe { cu!(cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n)) }?;
        nodes.truncate(n);
    }
    Ok(nodes)
}

/// The nodes of `graph` that no other node depends on (its current ends), sorted.
fn graph_leaves(graph: CUgraph) -> Result<Vec<CUgraphNode>> {
    let nodes = graph_nodes(graph)?;
    let mut n = 0usize;
    // SAFETY: live graph; null arrays ask for the edge count.
    unsafe {
        cu!(cuGraphGetEdges(
            graph,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut n
        ))
    }?;
    let mut from = vec![std::ptr::null_mut(); n];
    let mut to = vec![std::ptr::null_mut(); n];
    let mut data = vec![CUgraphEdgeData::default(); n];
    if n > 0 {
        // SAFETY: three arrays with room for `n` edges each.
        unsafe {
            cu!(cuGraphGetEdges(
                graph,
                from.as_mut_ptr(),
                to.as_mut_ptr(),
                data.as_mut_ptr(),
                &mut n
            ))
        }?;
        from.truncate(n);
    }
    from.sort_unstable();
    let mut leaves: Vec<CUgraphNode> = nodes
        .into_iter()
        .filter(|node| from.binary_search(node).is_err())
        .collect();
    leaves.sort_unstable();
    Ok(leaves)
}

/// A side stream forked in a scope, with its capture dependencies when it last joined the
/// origin (or forked from it): if they changed, it has work the origin does not wait for.
struct Fork {
    stream: Stream,
    joined_at: Vec<CUgraphNode>,
}

/// The scope of a running capture, handed to the closure of [`Stream::capture`]: the origin
/// stream, and forking to and joining from side streams.
///
/// Dropping it without finishing (a panic in the closure) ends the capture, discards what
/// was captured and restores the thread's capture mode. It is not `Send`: the capture ends
/// on the thread that began it.
pub struct CaptureScope<'s> {
    origin: &'s Stream,
    forks: Vec<Fork>,
    /// The graph captured into by [`Stream::capture_into`] and the nodes it had before;
    /// `None` for a capture into a new graph.
    target: Option<(CUgraph, Vec<CUgraphNode>)>,
    saved_mode: CUstreamCaptureMode,
    saved_cause: Option<CaptureCause>,
    ended: bool,
}

impl std::fmt::Debug for CaptureScope<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptureScope")
            .field("origin", &self.origin.as_raw())
            .field("forks", &self.forks.len())
            .field("into_existing_graph", &self.target.is_some())
            .finish()
    }
}

/// What ending a scope gives: the graph (new, or the target) and the resources to keep.
struct Captured {
    graph: CUgraph,
    resources: Vec<Resource>,
}

impl<'s> CaptureScope<'s> {
    /// Begins capturing on `origin`, into `target` if given (new nodes depend on the
    /// target's current ends).
    fn begin(
        origin: &'s Stream,
        mode: CaptureMode,
        target: Option<CUgraph>,
    ) -> Result<CaptureScope<'s>> {
        origin.context().bind()?;
        // Read the thread's mode (swap and swap back) so it can be restored at the end,
        // whatever the closure does to it.
        let saved_mode = exchange_thread_mode(mode.to_raw())?;
        exchange_thread_mode(saved_mode)?;
        let target = match target {
            None => {
                // SAFETY: live, non-legacy stream (this crate only makes non-blocking ones).
                unsafe { cu!(cuStreamBeginCapture(origin.as_raw(), mode.to_raw())) }?;
                None
            }
            Some(graph) => {
                let before = {
                    let mut nodes = graph_nodes(graph)?;
                    nodes.sort_unstable();
                    nodes
                };
                let leaves = graph_leaves(graph)?;
                // SAFETY: live stream and graph; `leaves` are nodes of the graph, with default
                // edges (null edge data).
                unsafe {
                    cu!(cuStreamBeginCaptureToGraph(
                        origin.as_raw(),
                        graph,
                        leaves.as_ptr(),
                        std::ptr::null(),
                        leaves.len(),
                        mode.to_raw()
                    ))
                }?;
                Some((graph, before))
            }
        };
        // Only now: a failed begin (e.g. the stream already captures) must not disturb a
        // collection in progress.
        origin.start_collecting();
        let saved_cause = replace_capture_cause(None);
        Ok(CaptureScope {
            origin,
            forks: Vec::new(),
            target,
            saved_mode,
            saved_cause,
            ended: false,
        })
    }

    /// The origin stream, on which the capture began and will end.
    pub fn stream(&self) -> &Stream {
        self.origin
    }

    /// Makes the captured graph (and every exec made from it) keep `resource` alive.
    ///
    /// Work enqueued through this crate registers what it uses by itself; this is for work
    /// enqueued on a captured stream by other libraries (cudarc, cuBLAS through cudarc, raw
    /// driver calls), whose memory, modules and library handles the graph's nodes use when
    /// it replays: e.g. a buffer's [`resource`](crate::DeviceBuffer::resource), or an
    /// `Arc` of cudarc's `CudaFunction` or `CudaBlas`. Dropped with the graph and its
    /// execs; dropped at the end of the scope if the capture fails.
    pub fn keep_alive(&self, resource: Resource) {
        self.origin.retain_for_capture(|| resource);
    }

    /// A new non-blocking side stream that joins the capture: it waits for the work
    /// enqueued on the origin so far, and what is enqueued on it afterwards is captured,
    /// running concurrently with later origin work. Before the scope ends, join it back with
    /// [`CaptureScope::join`] after its last work, or the scope fails with
    /// [`Error::UnjoinedFork`].
    ///
    /// Wraps [`cuStreamWaitEvent`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    /// on an event recorded on the origin, and records the fork's capture dependencies
    /// ([`cuStreamGetCaptureInfo`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html))
    /// to tell later whether it joined.
    /// Errors: [`Error::Driver`] from creating the stream or the event, recording, waiting
    /// or the query; [`Error::Load`] on a driver before 12.3, which lacks the query's ABI.
    pub fn fork(&mut self) -> Result<Stream> {
        let ctx = self.origin.context();
        let side = Stream::new(ctx)?;
        let event = Event::for_sync(ctx)?;
        event.record(self.origin)?;
        side.wait_event(&event)?;
        side.start_collecting();
        let (_, joined_at) = capture_dependencies(&side)?;
        self.forks.push(Fork {
            stream: side.clone(),
            joined_at,
        });
        Ok(side)
    }

    /// Makes the origin wait for all work enqueued so far on `side` (a stream from
    /// [`CaptureScope::fork`], or any stream taking part in the capture).
    ///
    /// Only the origin and the forks collect what their captured work uses: a stream brought
    /// into the capture otherwise (waiting on an event recorded on a captured stream) has its
    /// work captured, but the graph does not keep that work's buffers alive. Fork instead,
    /// or hand them to [`keep_alive`](Self::keep_alive).
    ///
    /// Wraps [`cuStreamWaitEvent`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    /// on an event recorded on `side`; for a fork, also [`cuStreamGetCaptureInfo`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    /// Errors: [`Error::Driver`]; [`Error::Load`] on a driver before 12.3, as for
    /// [`CaptureScope::fork`].
    pub fn join(&mut self, side: &Stream) -> Result<()> {
        let event = Event::for_sync(self.origin.context())?;
        event.record(side)?;
        self.origin.wait_event(&event)?;
        if let Some(fork) = self.forks.iter_mut().find(|f| f.stream == *side) {
            fork.joined_at = capture_dependencies(side)?.1;
        }
        Ok(())
    }

    /// How many forks have work the origin does not wait for.
    fn unjoined(&self) -> Result<usize> {
        let mut count = 0;
        for fork in &self.forks {
            let (status, deps) = capture_dependencies(&fork.stream)?;
            if status == CaptureStatus::Active && deps != fork.joined_at {
                count += 1;
            }
        }
        Ok(count)
    }

    /// Ends the capture after the closure returned `outcome`. On success returns the graph.
    fn finish(mut self, outcome: Result<()>) -> Result<Captured> {
        self.ended = true;
        let unjoined = if outcome.is_ok() {
            self.unjoined()
        } else {
            Ok(0)
        };
        let status = capture_dependencies(self.origin).map(|(s, _)| s);
        let end = self.end();
        let cause = replace_capture_cause(self.saved_cause.take());
        let restored = exchange_thread_mode(self.saved_mode);
        let invalidated = matches!(status, Ok(CaptureStatus::Invalidated))
            || end.rc == CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        let fail = |this: &mut CaptureScope<'_>, e: Error| {
            this.discard(end.graph);
            Err(e)
        };
        let call = cause.map_or(UNKNOWN_CAPTURE_CALL, |(call, _)| call);
        if let Err(e) = outcome {
            if invalidated {
                let source = Box::new(e);
                return fail(&mut self, Error::CaptureInvalidated { call, source });
            }
            return fail(&mut self, e);
        }
        if invalidated {
            let source = Box::new(match cause {
                Some((call, code)) => Error::driver(call, code),
                None => Error::driver("cuStreamEndCapture", end.rc),
            });
            return fail(&mut self, Error::CaptureInvalidated { call, source });
        }
        let unjoined = match unjoined {
            Ok(n) => n,
            Err(e) => return fail(&mut self, e),
        };
        if unjoined > 0 {
            return fail(&mut self, Error::UnjoinedFork { forks: unjoined });
        }
        if end.rc == CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED {
            // Every fork is joined before ending, so this means a stream outside the
            // scope's forks joined the capture and was left behind.
            return fail(&mut self, Error::UnjoinedFork { forks: 1 });
        }
        if end.rc != CUresult::CUDA_SUCCESS || end.graph.is_null() {
            let e = Error::driver("cuStreamEndCapture", end.rc);
            return fail(&mut self, e);
        }
        if let Err(e) = restored {
            return fail(&mut self, e);
        }
        Ok(Captured {
            graph: end.graph,
            resources: end.resources,
        })
    }

    /// Joins every fork (no nodes follow, so this adds no edges; it only lets the driver end
    /// a capture whose forks did nothing or were left unjoined), ends the capture and takes
    /// the collected resources. Errors of the joins are ignored: the end's result decides.
    fn end(&mut self) -> Ended {
        let forks: Vec<Stream> = self.forks.iter().map(|f| f.stream.clone()).collect();
        for side in &forks {
            let _ = self.join(side);
        }
        let mut graph: CUgraph = std::ptr::null_mut();
        let rc = match cuda_graph_sys::driver().and_then(|d| d.cuStreamEndCapture()) {
            // SAFETY: live stream that this scope began capturing, on this thread; valid
            // out-pointer. Called raw so that its result is not noted as a capture cause.
            Ok(end) => unsafe { end(self.origin.as_raw(), &mut graph) },
            // Unreachable in practice: the table resolved cuStreamBeginCapture already.
            Err(_) => CUresult::CUDA_ERROR_NOT_FOUND,
        };
        let mut resources = self.origin.take_collected();
        self.origin.end_graph_allocations();
        for side in &forks {
            resources.extend(side.take_collected());
            side.end_graph_allocations();
        }
        Ended {
            rc,
            graph,
            resources,
        }
    }

    /// Throws away what the capture produced: the new graph, or the nodes added to the
    /// target graph.
    fn discard(&mut self, graph: CUgraph) {
        let Ok(d) = cuda_graph_sys::driver() else {
            return;
        };
        match &self.target {
            None => {
                if graph.is_null() {
                    return;
                }
                if let Ok(destroy) = d.cuGraphDestroy() {
                    // SAFETY: the graph was just returned by cuStreamEndCapture and is owned
                    // by nobody else.
                    unsafe { destroy(graph) };
                }
            }
            Some((target, before)) => {
                let (Ok(nodes), Ok(destroy)) = (graph_nodes(*target), d.cuGraphDestroyNode())
                else {
                    return;
                };
                for node in nodes {
                    if before.binary_search(&node).is_err() {
                        // SAFETY: a node of the target that this capture added; destroying
                        // it also removes its edges.
                        unsafe { destroy(node) };
                    }
                }
            }
        }
    }
}

/// The result of `cuStreamEndCapture` and the resources collected.
struct Ended {
    rc: CUresult,
    graph: CUgraph,
    resources: Vec<Resource>,
}

impl Drop for CaptureScope<'_> {
    /// Only reached without `finish`: the closure panicked. Cleans up, ignoring errors
    /// (nothing can be reported while unwinding).
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        self.ended = true;
        let end = self.end();
        self.discard(end.graph);
        replace_capture_cause(self.saved_cause.take());
        let _ = exchange_thread_mode(self.saved_mode);
    }
}

impl Stream {
    /// Captures the work `f` enqueues on this stream (and on streams forked from the scope)
    /// into a new graph; see the [module documentation](crate::capture) for modes, what
    /// invalidates a capture and what happens on failure.
    ///
    /// Wraps [`cuStreamBeginCapture`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    /// and [`cuStreamEndCapture`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    ///
    /// # Errors
    /// Whatever the error, the partial graph is discarded and the streams are usable.
    /// * The closure's error, or [`Error::CaptureInvalidated`] carrying it when the capture
    ///   was also invalidated.
    /// * [`Error::CaptureInvalidated`] naming the call that invalidated the capture.
    /// * [`Error::UnjoinedFork`] when a fork has work the origin does not wait for.
    /// * [`Error::Driver`] from beginning the capture (e.g. the stream captures already; the
    ///   closure does not run then), from ending it, or from switching the thread's capture
    ///   mode.
    pub fn capture<F>(&self, mode: CaptureMode, f: F) -> Result<Graph>
    where
        F: FnOnce(&mut CaptureScope<'_>) -> Result<()>,
    {
        self.capture_with(mode, f).map(|(graph, ())| graph)
    }

    /// [`Stream::capture`] for a closure that returns a value besides the graph (buffers it
    /// made, node handles, sizes): `Ok((graph, value))`. Errors of your own code inside the
    /// closure travel as [`Error::External`] (`Error::external(e)`).
    ///
    /// Errors: as [`Stream::capture`].
    ///
    /// ```no_run
    /// # use cuda_graph::{CaptureMode, DeviceBuffer, GraphPool, Stream};
    /// # fn f(stream: &Stream, pool: &GraphPool) -> cuda_graph::Result<()> {
    /// let (graph, out) = stream.capture_with(CaptureMode::Global, |s| {
    ///     let out = pool.alloc::<f32>(1024)?; // no driver call: legal while capturing
    ///     out.memset_bytes(s.stream(), 0)?;
    ///     Ok(out)
    /// })?;
    /// # Ok(()) }
    /// ```
    pub fn capture_with<F, R>(&self, mode: CaptureMode, f: F) -> Result<(Graph, R)>
    where
        F: FnOnce(&mut CaptureScope<'_>) -> Result<R>,
    {
        let mut scope = CaptureScope::begin(self, mode, None)?;
        let (outcome, value) = match f(&mut scope) {
            Ok(v) => (Ok(()), Some(v)),
            Err(e) => (Err(e), None),
        };
        let captured = scope.finish(outcome)?;
        // SAFETY: the graph was just returned by cuStreamEndCapture, in this context, and
        // is owned by nobody else.
        let mut graph = unsafe { Graph::from_raw(self.context(), captured.graph) };
        for r in captured.resources {
            graph.keep_alive(r);
        }
        match value {
            Some(v) => Ok((graph, v)),
            None => Err(Error::invalid(
                "capture: the closure failed but finish succeeded",
            )),
        }
    }

    /// Like [`Stream::capture`], but appends the captured nodes to `graph`: they depend on
    /// the graph's current ends (nodes with
    /// no dependents), so they run after everything already in it. What they use is added
    /// to the graph's keep-alive list. On error the nodes the capture added are removed.
    ///
    /// Wraps [`cuStreamBeginCaptureToGraph`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    /// and [`cuStreamEndCapture`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html);
    /// finds the graph's ends with [`cuGraphGetNodes`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
    /// and [`cuGraphGetEdges`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::InvalidArgument`] when `graph` and the stream belong to different
    /// contexts; those of [`Stream::capture`]; [`Error::Load`] on a driver before 12.3,
    /// which lacks the ABI used.
    pub fn capture_into<F>(&self, graph: &mut Graph, mode: CaptureMode, f: F) -> Result<()>
    where
        F: FnOnce(&mut CaptureScope<'_>) -> Result<()>,
    {
        if !Arc::ptr_eq(graph.context(), self.context())
            && graph.context().as_raw() != self.context().as_raw()
        {
            return Err(Error::invalid(
                "capture_into: the graph and the stream belong to different contexts",
            ));
        }
        let mut scope = CaptureScope::begin(self, mode, Some(graph.as_raw()))?;
        let outcome = f(&mut scope);
        let captured = scope.finish(outcome)?;
        for r in captured.resources {
            graph.keep_alive(r);
        }
        Ok(())
    }

    /// Whether this stream is capturing. Legal during a capture.
    ///
    /// Wraps [`cuStreamIsCapturing`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    /// Errors: [`Error::Driver`]; [`Error::InvalidArgument`] for a status this crate does not
    /// know (from a newer driver).
    pub fn capture_status(&self) -> Result<CaptureStatus> {
        let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        self.context().ensure_current()?;
        // SAFETY: live stream, valid out-pointer.
        unsafe { cu!(cuStreamIsCapturing(self.as_raw(), &mut status)) }?;
        status_from_raw(status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_map_to_the_driver_values() {
        for (mode, raw) in [
            (CaptureMode::Global, 0),
            (CaptureMode::ThreadLocal, 1),
            (CaptureMode::Relaxed, 2),
        ] {
            assert_eq!(mode.to_raw().0, raw, "{mode:?}");
            assert_eq!(CaptureMode::from_raw(mode.to_raw()), Some(mode));
        }
        assert_eq!(CaptureMode::from_raw(CUstreamCaptureMode(7)), None);
    }

    #[test]
    fn statuses_map_to_the_driver_values() {
        for (status, raw) in [
            (CaptureStatus::None, 0),
            (CaptureStatus::Active, 1),
            (CaptureStatus::Invalidated, 2),
        ] {
            assert_eq!(status.to_raw().0, raw, "{status:?}");
            assert_eq!(CaptureStatus::from_raw(status.to_raw()), Some(status));
        }
        assert_eq!(CaptureStatus::from_raw(CUstreamCaptureStatus(9)), None);
        assert!(status_from_raw(CUstreamCaptureStatus(9)).is_err());
    }

    #[test]
    fn capture_errors_are_noted_once_per_thread_and_901_names_no_cause() {
        let saved = replace_capture_cause(None);
        crate::error::check("cuLaunchKernel", CUresult::CUDA_ERROR_INVALID_VALUE).unwrap_err();
        assert_eq!(replace_capture_cause(None), None, "not a capture error");
        crate::error::check(
            "cuLaunchKernel",
            CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        )
        .unwrap_err();
        assert_eq!(replace_capture_cause(None), None, "901 is a consequence");
        crate::error::check(
            "cuStreamSynchronize",
            CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        )
        .unwrap_err();
        crate::error::check(
            "cuMemAlloc",
            CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        )
        .unwrap_err();
        assert_eq!(
            replace_capture_cause(None),
            Some((
                "cuStreamSynchronize",
                CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
            )),
            "the first cause is kept"
        );
        crate::error::check("cuEventQuery", CUresult::CUDA_ERROR_CAPTURED_EVENT).unwrap_err();
        assert_eq!(
            replace_capture_cause(None).map(|c| c.0),
            Some("cuEventQuery")
        );
        // Another thread's errors are not this thread's.
        std::thread::spawn(|| {
            crate::error::check(
                "cuMemAlloc",
                CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
            )
            .unwrap_err();
        })
        .join()
        .unwrap();
        assert_eq!(replace_capture_cause(saved), None);
    }

    #[test]
    fn capture_errors_display_their_cause() {
        let e = Error::CaptureInvalidated {
            call: "cuStreamSynchronize",
            source: Box::new(Error::InvalidArgument("x".into())),
        };
        assert_eq!(
            e.to_string(),
            "stream capture invalidated by cuStreamSynchronize: invalid argument: x"
        );
        assert_eq!(
            Error::UnjoinedFork { forks: 2 }.to_string(),
            "stream capture ended with 2 forked stream(s) not joined back to the origin"
        );
    }
}
