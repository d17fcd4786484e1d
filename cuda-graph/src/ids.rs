//! Plain identifiers of driver objects, shared by every module that names them.

use cuda_graph_sys::CUgraphNode;

/// A node of a graph, as the driver names it (`CUgraphNode`); a plain identifier, valid
/// while its graph lives. The typed node handles ([`KernelNode`](crate::KernelNode), ...)
/// wrap it. Only this crate makes them (from the driver's answers), so safe code cannot hand
/// the driver an address that was never a node, and every method that takes one checks that
/// it is a node of its graph (a handle of another graph, or of a dropped one, is an error);
/// [`from_raw`](Self::from_raw) is the unsafe way in for handles from other libraries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeId(pub(crate) CUgraphNode);

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

    /// The driver's handle.
    pub fn as_raw(&self) -> CUgraphNode {
        self.0
    }

    /// The identifier of a driver node handle made elsewhere (another library's graph).
    ///
    /// # Safety
    /// `raw` must be null or a node of a live graph, and stay one for as long as the
    /// identifier is used with the graph (and its execs) that hold it: every method that
    /// takes a node hands it to the driver, which dereferences it.
    pub unsafe fn from_raw(raw: CUgraphNode) -> NodeId {
        NodeId(raw)
    }
}
