//! Plain identifiers of driver objects, shared by every module that names them.

use cuda_graph_sys::CUgraphNode;

/// A node of a graph, as the driver names it (`CUgraphNode`); a plain identifier, valid
/// while its graph lives. The typed node handles ([`KernelNode`](crate::KernelNode), ...)
/// wrap it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeId(pub CUgraphNode);

// SAFETY: an opaque identifier; using it requires the graph, which enforces thread rules.
unsafe impl Send for NodeId {}
// SAFETY: as above.
unsafe impl Sync for NodeId {}

impl NodeId {
    /// The null node (what the driver reports when it blames no node).
    pub fn null() -> NodeId {
        NodeId(std::ptr::null_mut())
    }

    /// Whether this is the null node.
    pub fn is_null(&self) -> bool {
        self.0.is_null()
    }
}
