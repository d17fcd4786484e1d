//! Plain identifiers of driver objects, shared by every module that names them.

use cuda_graph_sys::CUgraphNode;

/// A node of a graph, as the driver names it (`CUgraphNode`); a plain identifier, valid
/// while its graph lives. The typed node handles ([`KernelNode`](crate::KernelNode), ...)
/// wrap it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeId(pub CUgraphNode);

// SAFETY: a plain identifier: this type never dereferences the pointer or calls the driver
// with it. Every driver call that takes a node goes through a `Graph` (not `Sync`) or a
// `GraphExec` method, which carry the thread rules.
unsafe impl Send for NodeId {}
// SAFETY: as for `Send`; a `NodeId` is `Copy` and has no interior mutability.
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
