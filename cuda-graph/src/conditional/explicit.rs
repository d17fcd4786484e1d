//! Conditional nodes of explicitly built graphs: [`Graph::add_if`] and friends.

use cuda_graph_sys::CUgraphNode;

use crate::error::{Error, Result};
use crate::graph::Graph;
use crate::ids::NodeId;
use crate::node::{ConditionalNode, KernelNode, Node};
use crate::stream::Stream;

use super::body::{add_node, capture_into, fill_bodies};
use super::handle::check_handle_graph;
use super::{Body, ConditionSource, ConditionalHandle, ConditionalKind};

impl Graph {
    /// Adds an IF node after `deps`: `then` fills the body through a capturing stream, which
    /// runs when the handle's value is non-zero. Needs a driver >= 12.4. What a body may
    /// hold: the [rules for conditional bodies](crate::conditional#rules-for-conditional-bodies).
    ///
    /// Wraps [`cuGraphAddNode`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
    /// (a conditional node); each body is then captured into its body graph on a scratch stream
    /// ([`cuStreamBeginCaptureToGraph`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)).
    ///
    /// # Errors
    /// * [`Error::Unsupported`] on a driver without this kind of node, and
    ///   [`Error::InvalidArgument`] when `handle` was created for another graph: both before
    ///   the graph is touched.
    /// * A body closure's own error, or [`Error::Driver`] from adding the node or capturing a
    ///   body. The node is in the graph by then, its bodies partly filled: discard the graph.
    pub fn add_if<F>(
        &mut self,
        deps: &[Node],
        handle: ConditionalHandle,
        then: F,
    ) -> Result<ConditionalNode>
    where
        F: FnOnce(&Stream) -> Result<()>,
    {
        self.add_conditional(
            deps,
            handle,
            ConditionalKind::If,
            vec![Box::new(then) as Body<'_>],
        )
    }

    /// Adds an IF node with an else body: `then` runs when the value is non-zero, `else_`
    /// when it is zero. Needs a driver >= 12.8.
    ///
    /// Errors: as [`Graph::add_if`].
    pub fn add_if_else<F, G>(
        &mut self,
        deps: &[Node],
        handle: ConditionalHandle,
        then: F,
        else_: G,
    ) -> Result<ConditionalNode>
    where
        F: FnOnce(&Stream) -> Result<()>,
        G: FnOnce(&Stream) -> Result<()>,
    {
        self.add_conditional(
            deps,
            handle,
            ConditionalKind::IfElse,
            vec![Box::new(then) as Body<'_>, Box::new(else_)],
        )
    }

    /// Adds a WHILE node: the body runs while the handle's value is non-zero, tested before
    /// each iteration; the body must set the value (e.g. [`ConditionalHandle::decrement_on`])
    /// or the loop never ends. Needs a driver >= 12.4.
    ///
    /// Errors: as [`Graph::add_if`].
    pub fn add_while<F>(
        &mut self,
        deps: &[Node],
        handle: ConditionalHandle,
        body: F,
    ) -> Result<ConditionalNode>
    where
        F: FnOnce(&Stream) -> Result<()>,
    {
        self.add_conditional(
            deps,
            handle,
            ConditionalKind::While,
            vec![Box::new(body) as Body<'_>],
        )
    }

    /// Adds a SWITCH node over `cases`: case `value` runs, a value `>= cases.len()` runs
    /// nothing. Needs a driver >= 12.8.
    ///
    /// Errors: [`Error::InvalidArgument`] for no cases (or more than `u32::MAX`), before the
    /// driver is asked; otherwise as [`Graph::add_if`].
    pub fn add_switch(
        &mut self,
        deps: &[Node],
        handle: ConditionalHandle,
        cases: Vec<Body<'_>>,
    ) -> Result<ConditionalNode> {
        let n = u32::try_from(cases.len())
            .map_err(|_| Error::invalid(format!("{} SWITCH cases", cases.len())))?;
        self.add_conditional(deps, handle, ConditionalKind::Switch(n), cases)
    }

    /// Adds a one-thread kernel node after `deps` that sets `handle` from `source`, and
    /// returns it; put it before the conditional node that reads the handle.
    ///
    /// Captures [`ConditionalHandle::set_on`]'s [`cuLaunchKernel`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EXEC.html)
    /// into this graph ([`cuStreamBeginCaptureToGraph`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)),
    /// so the graph keeps the helpers' module alive as for any captured launch.
    /// Errors: [`Error::InvalidArgument`] when `handle` belongs to another context or a source
    /// buffer is empty; those of [`ConditionalHandle::set_on`]; [`Error::Driver`] from the
    /// capture.
    pub fn add_set_condition(
        &mut self,
        deps: &[Node],
        handle: ConditionalHandle,
        source: ConditionSource<'_>,
    ) -> Result<KernelNode> {
        handle.check_context(self.context())?;
        source.check()?;
        let raw_deps: Vec<CUgraphNode> = deps.iter().map(|d| d.id.0).collect();
        let (ctx, raw, owner) = (self.context().clone(), self.as_raw(), self.owner().clone());
        owner.check_nodes(&raw_deps)?;
        let (resources, ends) =
            owner.locked(|| capture_into(&ctx, raw, &raw_deps, |s| handle.set_on(s, source)))?;
        for r in resources {
            self.keep_alive(r);
        }
        match ends.as_slice() {
            [one] => {
                owner.note_node(*one);
                Ok(KernelNode(NodeId(*one)))
            }
            // One kernel launch captured after `deps` is exactly one new node.
            _ => Err(Error::invalid(format!(
                "expected the setter to add one node, the capture ended on {}",
                ends.len()
            ))),
        }
    }

    fn add_conditional(
        &mut self,
        deps: &[Node],
        handle: ConditionalHandle,
        kind: ConditionalKind,
        bodies: Vec<Body<'_>>,
    ) -> Result<ConditionalNode> {
        kind.check()?;
        check_handle_graph(&handle, self.as_raw())?;
        let raw_deps: Vec<CUgraphNode> = deps.iter().map(|d| d.id.0).collect();
        let (ctx, raw, owner) = (self.context().clone(), self.as_raw(), self.owner().clone());
        owner.check_nodes(&raw_deps)?;
        // The node and its bodies are edited under the graph's lock: an exec of this graph may
        // run per-node setters on another thread.
        let (node, resources) = owner.locked(|| {
            let (node, body_graphs) =
                add_node(&ctx, raw, &raw_deps, std::ptr::null(), handle, kind)?;
            Ok::<_, Error>((node, fill_bodies(&ctx, &body_graphs, bodies)?))
        })?;
        for r in resources {
            self.keep_alive(r);
        }
        owner.note_node(node);
        Ok(ConditionalNode(NodeId(node)))
    }
}
