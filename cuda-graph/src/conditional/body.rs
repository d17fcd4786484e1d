//! Adding a conditional node and capturing its bodies, shared by explicit building and
//! stream capture.

use std::sync::Arc;

use cuda_graph_sys::{
    CUDA_CONDITIONAL_NODE_PARAMS, CUgraph, CUgraphEdgeData, CUgraphNode, CUgraphNodeParams,
    CUgraphNodeType, CUstreamCaptureMode,
};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::resources::Resource;
use crate::stream::Stream;

use super::capture::capture_info;
use super::{Body, ConditionalHandle, ConditionalKind};

/// Adds the conditional node; returns it and its driver-owned body graphs.
pub(crate) fn add_node(
    ctx: &Arc<Context>,
    graph: CUgraph,
    deps: &[CUgraphNode],
    edges: *const CUgraphEdgeData,
    handle: ConditionalHandle,
    kind: ConditionalKind,
) -> Result<(CUgraphNode, Vec<CUgraph>)> {
    let (type_, size) = kind.raw();
    // Every byte not set below stays zero, as the driver requires.
    let mut params = CUgraphNodeParams {
        type_: CUgraphNodeType::CU_GRAPH_NODE_TYPE_CONDITIONAL,
        ..Default::default()
    };
    params.__bindgen_anon_1.conditional = CUDA_CONDITIONAL_NODE_PARAMS {
        handle: handle.raw,
        type_,
        size,
        phGraph_out: std::ptr::null_mut(),
        ctx: ctx.as_raw(),
    };
    let mut node: CUgraphNode = std::ptr::null_mut();
    ctx.bind()?;
    // SAFETY: live graph; `deps` (and `edges`, when non-null) hold deps.len() entries;
    // fully initialised params of the conditional variant.
    unsafe {
        cu!(cuGraphAddNode(
            &mut node,
            graph,
            if deps.is_empty() {
                std::ptr::null()
            } else {
                deps.as_ptr()
            },
            edges,
            deps.len(),
            &mut params
        ))
    }?;
    // SAFETY: the driver wrote the conditional variant's phGraph_out.
    let out = unsafe { params.__bindgen_anon_1.conditional.phGraph_out };
    if out.is_null() {
        return Err(Error::invalid(
            "the driver returned no body graphs for the conditional node",
        ));
    }
    // SAFETY: the driver returns an array of `size` body graphs, valid while the node lives.
    let bodies = unsafe { std::slice::from_raw_parts(out, size as usize) }.to_vec();
    Ok((node, bodies))
}

pub(crate) fn fill_bodies(
    ctx: &Arc<Context>,
    graphs: &[CUgraph],
    bodies: Vec<Body<'_>>,
) -> Result<Vec<Resource>> {
    let mut all = Vec::new();
    for (&g, body) in graphs.iter().zip(bodies) {
        let (resources, _) = capture_into(ctx, g, &[], body)?;
        all.extend(resources);
    }
    Ok(all)
}

/// Ends a capture begun on the scratch stream even when the closure panics or fails, so the
/// stream is never destroyed mid-capture.
struct EndCapture<'a>(&'a Stream);

impl Drop for EndCapture<'_> {
    fn drop(&mut self) {
        if let Ok(end) = cuda_graph_sys::driver().and_then(|d| d.cuStreamEndCapture()) {
            let mut g: CUgraph = std::ptr::null_mut();
            // SAFETY: live stream that began a capture into an existing graph; the graph
            // returned is that one (owned elsewhere), so nothing is destroyed here.
            unsafe { end(self.0.as_raw(), &mut g) };
        }
    }
}

/// Captures what `f` enqueues on a scratch stream into `graph` after `deps`; returns the
/// resources the work uses and the nodes the capture ended on.
pub(crate) fn capture_into<F>(
    ctx: &Arc<Context>,
    graph: CUgraph,
    deps: &[CUgraphNode],
    f: F,
) -> Result<(Vec<Resource>, Vec<CUgraphNode>)>
where
    F: FnOnce(&Stream) -> Result<()>,
{
    let scratch = Stream::new(ctx)?;
    scratch.start_collecting();
    // SAFETY: live scratch stream and graph; `deps` are nodes of `graph`; no edge data.
    unsafe {
        cu!(cuStreamBeginCaptureToGraph(
            scratch.as_raw(),
            graph,
            if deps.is_empty() {
                std::ptr::null()
            } else {
                deps.as_ptr()
            },
            std::ptr::null(),
            deps.len(),
            CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        ))
    }?;
    let guard = EndCapture(&scratch);
    let outcome = f(&scratch);
    let ends = match outcome {
        Ok(()) => capture_info(&scratch).map(|i| i.deps),
        Err(e) => Err(e),
    };
    std::mem::forget(guard);
    let mut g: CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above; the graph returned is `graph`, owned elsewhere.
    let end = unsafe { cu!(cuStreamEndCapture(scratch.as_raw(), &mut g)) };
    let resources = scratch.take_collected();
    let ends = ends?;
    end?;
    Ok((resources, ends))
}
