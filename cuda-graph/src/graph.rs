//! Graph definitions: ownership and the resources their nodes keep alive.

use std::any::Any;
use std::sync::Arc;

use cuda_graph_sys::CUgraph;

use crate::context::Context;
use crate::error::Result;

/// Something a graph's nodes use (a device allocation, a module, a child graph's resources)
/// and must keep alive for as long as the graph, or an exec made from it, may run.
pub type Resource = Arc<dyn Any + Send + Sync>;

/// A CUDA graph definition, owned; destroyed on drop.
///
/// Nodes added through the safe API (captured or explicit) register what they use, and the
/// graph holds it; an exec instantiated from the graph takes a copy of that list.
#[derive(Debug)]
pub struct Graph {
    raw: CUgraph,
    ctx: Arc<Context>,
    resources: Vec<Resource>,
}

// SAFETY: a graph may move between threads; it is not Sync because graph objects are not
// thread-safe (the driver's rule), and every mutation goes through &mut self.
unsafe impl Send for Graph {}

impl Graph {
    /// An empty graph.
    pub fn new(ctx: &Arc<Context>) -> Result<Graph> {
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; flags must be 0.
        unsafe { cu!(cuGraphCreate(&mut raw, 0)) }?;
        // SAFETY: just created, owned by nobody else.
        Ok(unsafe { Graph::from_raw(ctx, raw) })
    }

    /// Takes ownership of a raw graph (destroyed on drop).
    ///
    /// # Safety
    /// `raw` must be a live graph of `ctx` that nothing else destroys. Memory and modules its
    /// nodes use are not kept alive unless registered with [`Graph::keep_alive`].
    pub unsafe fn from_raw(ctx: &Arc<Context>, raw: CUgraph) -> Graph {
        Graph {
            raw,
            ctx: ctx.clone(),
            resources: Vec::new(),
        }
    }

    /// The raw handle; valid while this graph lives.
    pub fn as_raw(&self) -> CUgraph {
        self.raw
    }

    /// The context it belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Keeps `resource` alive for as long as this graph and execs made from it.
    pub fn keep_alive(&mut self, resource: Resource) {
        self.resources.push(resource);
    }

    /// Everything this graph keeps alive.
    pub fn resources(&self) -> &[Resource] {
        &self.resources
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if let Ok(destroy) = cuda_graph_sys::driver().and_then(|d| d.cuGraphDestroy()) {
            // SAFETY: owned graph, destroyed once; execs made from it are independent.
            unsafe { destroy(self.raw) };
        }
    }
}
