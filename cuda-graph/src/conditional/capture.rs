//! Conditional nodes added during a stream capture: [`Stream::capture_if`] and friends.

use cuda_graph_sys::CUstreamUpdateCaptureDependencies_flags;

use crate::capture::{CaptureInfo, CaptureStatus};
use crate::error::{Error, Result};
use crate::stream::Stream;

use super::body::{add_node, fill_bodies};
use super::handle::check_handle_graph;
use super::{Body, ConditionalHandle, ConditionalKind};

impl Stream {
    /// During a capture on this stream: adds an IF node after the work captured so far, fills
    /// its body with `then` (captured on a scratch stream into the body graph) and makes the
    /// capture continue after the node. `handle` comes from
    /// [`ConditionalHandle::in_capture`] on this stream. Needs a driver >= 12.4.
    ///
    /// Wraps [`cuGraphAddNode`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
    /// on the capture's graph (found with [`cuStreamGetCaptureInfo`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)),
    /// then [`cuStreamUpdateCaptureDependencies`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    /// so the capture continues after the node.
    ///
    /// # Errors
    /// * [`Error::Unsupported`] on a driver without this kind of node; [`Error::InvalidArgument`]
    ///   when the stream is not capturing, or `handle` was created for another graph: both
    ///   before anything is added.
    /// * A body closure's own error, or [`Error::Driver`] from adding the node or capturing a
    ///   body. The node has been added by then: fail the capture (return the error from its
    ///   closure), so the scope discards the graph.
    pub fn capture_if<F>(&self, handle: ConditionalHandle, then: F) -> Result<()>
    where
        F: FnOnce(&Stream) -> Result<()>,
    {
        self.capture_conditional(
            handle,
            ConditionalKind::If,
            vec![Box::new(then) as Body<'_>],
        )
    }

    /// During a capture: an IF node with an else body (see [`Stream::capture_if`]). Needs a
    /// driver >= 12.8.
    ///
    /// Errors: as [`Stream::capture_if`].
    pub fn capture_if_else<F, G>(&self, handle: ConditionalHandle, then: F, else_: G) -> Result<()>
    where
        F: FnOnce(&Stream) -> Result<()>,
        G: FnOnce(&Stream) -> Result<()>,
    {
        self.capture_conditional(
            handle,
            ConditionalKind::IfElse,
            vec![Box::new(then) as Body<'_>, Box::new(else_)],
        )
    }

    /// During a capture: a WHILE node (see [`Stream::capture_if`],
    /// [`Graph::add_while`](crate::Graph::add_while)). Needs a driver >= 12.4.
    ///
    /// Errors: as [`Stream::capture_if`].
    pub fn capture_while<F>(&self, handle: ConditionalHandle, body: F) -> Result<()>
    where
        F: FnOnce(&Stream) -> Result<()>,
    {
        self.capture_conditional(
            handle,
            ConditionalKind::While,
            vec![Box::new(body) as Body<'_>],
        )
    }

    /// During a capture: a SWITCH node over `cases` (see
    /// [`Graph::add_switch`](crate::Graph::add_switch)). Needs a driver >= 12.8.
    ///
    /// Errors: [`Error::InvalidArgument`] for no cases (or more than `u32::MAX`), before the
    /// driver is asked; otherwise as [`Stream::capture_if`].
    pub fn capture_switch(&self, handle: ConditionalHandle, cases: Vec<Body<'_>>) -> Result<()> {
        let n = u32::try_from(cases.len())
            .map_err(|_| Error::invalid(format!("{} SWITCH cases", cases.len())))?;
        self.capture_conditional(handle, ConditionalKind::Switch(n), cases)
    }

    fn capture_conditional(
        &self,
        handle: ConditionalHandle,
        kind: ConditionalKind,
        bodies: Vec<Body<'_>>,
    ) -> Result<()> {
        kind.check()?;
        let info = capture_info(self)?;
        check_handle_graph(&handle, info.graph)?;
        let edges = if info.edges.is_empty() {
            std::ptr::null()
        } else {
            info.edges.as_ptr()
        };
        let (mut node, body_graphs) =
            add_node(self.context(), info.graph, &info.deps, edges, handle, kind)?;
        // SAFETY: live capturing stream; one valid node of its capture graph; no edge data
        // (a full dependency); SET replaces the stream's dependencies with the node.
        unsafe {
            cu!(cuStreamUpdateCaptureDependencies(
                self.as_raw(),
                &mut node,
                std::ptr::null(),
                1,
                CUstreamUpdateCaptureDependencies_flags::CU_STREAM_SET_CAPTURE_DEPENDENCIES.0
            ))
        }?;
        let resources = fill_bodies(self.context(), &body_graphs, bodies)?;
        for r in resources {
            self.retain_for_capture(|| r);
        }
        Ok(())
    }
}

/// The capture state of `stream`, which must be capturing.
pub(crate) fn capture_info(stream: &Stream) -> Result<CaptureInfo> {
    let info = crate::capture::capture_info(stream)?;
    if info.status != CaptureStatus::Active || info.graph.is_null() {
        return Err(Error::invalid(format!(
            "the stream is not capturing (capture status {:?})",
            info.status
        )));
    }
    Ok(info)
}
