//! Executable graphs: instantiate, upload, launch.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bitflags::bitflags;
use cuda_graph_sys::{
    CUDA_GRAPH_INSTANTIATE_PARAMS, CUgraphExec, CUgraphInstantiateResult, CUgraphNode,
};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::graph::{Graph, Resource};
use crate::stream::Stream;

bitflags! {
    /// Flags of [`GraphExec::instantiate`] (`CUDA_GRAPH_INSTANTIATE_FLAG_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct InstantiateFlags: u64 {
        /// Free graph memory allocations left unfreed when the graph is launched again.
        const AUTO_FREE_ON_LAUNCH = 1;
        /// Upload the graph as part of instantiation (needs an upload stream).
        const UPLOAD = 2;
        /// Allow launching the graph from the device (not with `AUTO_FREE_ON_LAUNCH`).
        const DEVICE_LAUNCH = 4;
        /// Use each node's priority attribute instead of the launch stream's.
        const USE_NODE_PRIORITY = 8;
    }
}

/// An instantiated graph. It keeps alive everything its graph held at instantiation (and
/// what later updates install), so the memory and modules its nodes use outlive it even if
/// the user's handles and the graph are dropped.
#[derive(Debug)]
pub struct GraphExec {
    raw: CUgraphExec,
    ctx: Arc<Context>,
    resources: Vec<Resource>,
    /// Set by the first launch: dropping must then wait for the device before releasing
    /// memory the launches may still use.
    launched: AtomicBool,
}

// SAFETY: an exec may be launched from any thread; mutation (updates) takes &mut self.
unsafe impl Send for GraphExec {}
// SAFETY: launching through &self is thread-safe in the driver.
unsafe impl Sync for GraphExec {}

impl GraphExec {
    /// Instantiates `graph`. `UPLOAD` needs a stream: use [`GraphExec::instantiate_on`].
    pub fn instantiate(graph: &Graph, flags: InstantiateFlags) -> Result<GraphExec> {
        if flags.contains(InstantiateFlags::UPLOAD) {
            return Err(Error::invalid(
                "InstantiateFlags::UPLOAD needs an upload stream: use instantiate_on",
            ));
        }
        GraphExec::instantiate_impl(graph, flags, None)
    }

    /// Instantiates `graph`, uploading it on `stream` when `flags` has `UPLOAD`.
    pub fn instantiate_on(
        graph: &Graph,
        flags: InstantiateFlags,
        stream: &Stream,
    ) -> Result<GraphExec> {
        GraphExec::instantiate_impl(graph, flags, Some(stream))
    }

    fn instantiate_impl(
        graph: &Graph,
        flags: InstantiateFlags,
        stream: Option<&Stream>,
    ) -> Result<GraphExec> {
        if flags.contains(InstantiateFlags::AUTO_FREE_ON_LAUNCH | InstantiateFlags::DEVICE_LAUNCH) {
            return Err(Error::invalid(
                "AUTO_FREE_ON_LAUNCH and DEVICE_LAUNCH cannot be combined",
            ));
        }
        graph.context().bind()?;
        let mut params = CUDA_GRAPH_INSTANTIATE_PARAMS {
            flags: flags.bits(),
            hUploadStream: stream.map_or(std::ptr::null_mut(), Stream::as_raw),
            ..Default::default()
        };
        let mut raw = std::ptr::null_mut();
        // SAFETY: live graph, valid params and out-pointer.
        let rc = unsafe {
            cuda_graph_sys::driver()?.cuGraphInstantiateWithParams()?(
                &mut raw,
                graph.as_raw(),
                &mut params,
            )
        };
        if rc != cuda_graph_sys::CUresult::CUDA_SUCCESS
            || params.result_out != CUgraphInstantiateResult::CUDA_GRAPH_INSTANTIATE_SUCCESS
        {
            return Err(Error::Instantiate {
                source: Box::new(Error::driver("cuGraphInstantiateWithParams", rc)),
                result: params.result_out,
                node: NodeId(params.hErrNode_out),
            });
        }
        Ok(GraphExec {
            raw,
            ctx: graph.context().clone(),
            resources: graph.resources().to_vec(),
            launched: AtomicBool::new(false),
        })
    }

    /// Uploads the exec's work to the device ahead of its first launch, on `stream`.
    pub fn upload(&self, stream: &Stream) -> Result<()> {
        // SAFETY: live exec and stream.
        unsafe { cu!(cuGraphUpload(self.raw, stream.as_raw())) }
    }

    /// Launches the graph on `stream`. One exec runs one launch at a time, in stream order.
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        self.launched.store(true, Ordering::Relaxed);
        // SAFETY: live exec and stream; the exec keeps alive what its nodes use.
        unsafe { cu!(cuGraphLaunch(self.raw, stream.as_raw())) }
    }

    /// The raw handle; valid while this exec lives.
    pub fn as_raw(&self) -> CUgraphExec {
        self.raw
    }

    /// The context it belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Keeps `resource` alive for as long as this exec (used by updates that install new
    /// memory or modules).
    pub fn keep_alive(&mut self, resource: Resource) {
        self.resources.push(resource);
    }

    /// Everything this exec keeps alive.
    pub fn resources(&self) -> &[Resource] {
        &self.resources
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        // A launch may still be running on any stream, and stream-ordered frees of the
        // resources would not be ordered after it: wait for the device first.
        if self.launched.load(Ordering::Relaxed) && !self.resources.is_empty() {
            let _ = self.ctx.synchronize();
        }
        if let Ok(destroy) = cuda_graph_sys::driver().and_then(|d| d.cuGraphExecDestroy()) {
            // SAFETY: owned exec, destroyed once; the driver defers destruction until a
            // running launch completes.
            unsafe { destroy(self.raw) };
        }
    }
}

/// A node of a graph, as the driver names it (`CUgraphNode`); a plain identifier, valid
/// while its graph lives. Typed node handles in `graph.rs` wrap it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeId(pub CUgraphNode);

// SAFETY: an opaque identifier; using it requires the graph, which enforces thread rules.
unsafe impl Send for NodeId {}
// SAFETY: as above.
unsafe impl Sync for NodeId {}
