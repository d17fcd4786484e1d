//! Node handles of explicitly built graphs: an untyped [`Node`] and one typed handle per kind,
//! so per-node exec setters take the kind they can update.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cuda_graph_sys::{CUdeviceptr, CUgraphEdgeData, CUgraphNodeType};

use crate::ids::NodeId;

/// The kind of a graph node (`CUgraphNodeType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NodeKind {
    /// A kernel launch.
    Kernel,
    /// A memory copy.
    Memcpy,
    /// A memory set.
    Memset,
    /// A host callback.
    Host,
    /// An embedded (child) graph.
    ChildGraph,
    /// A no-op, for joining dependencies.
    Empty,
    /// Waits for an event.
    EventWait,
    /// Records an event.
    EventRecord,
    /// Signals external semaphores.
    ExtSemaphoresSignal,
    /// Waits on external semaphores.
    ExtSemaphoresWait,
    /// A graph memory allocation.
    MemAlloc,
    /// A graph memory free.
    MemFree,
    /// A batch of memory operations.
    BatchMemOp,
    /// A conditional node (IF, WHILE, SWITCH).
    Conditional,
    /// A kind this crate does not know (from a newer driver).
    Unknown(u32),
}

impl NodeKind {
    /// The kind for a driver value.
    pub fn from_raw(t: CUgraphNodeType) -> NodeKind {
        match t.0 {
            0 => NodeKind::Kernel,
            1 => NodeKind::Memcpy,
            2 => NodeKind::Memset,
            3 => NodeKind::Host,
            4 => NodeKind::ChildGraph,
            5 => NodeKind::Empty,
            6 => NodeKind::EventWait,
            7 => NodeKind::EventRecord,
            8 => NodeKind::ExtSemaphoresSignal,
            9 => NodeKind::ExtSemaphoresWait,
            10 => NodeKind::MemAlloc,
            11 => NodeKind::MemFree,
            12 => NodeKind::BatchMemOp,
            13 => NodeKind::Conditional,
            v => NodeKind::Unknown(v),
        }
    }

    /// Whether `cuGraphNodeSetEnabled` accepts nodes of this kind (kernel, memcpy, memset).
    pub fn can_be_disabled(self) -> bool {
        matches!(self, NodeKind::Kernel | NodeKind::Memcpy | NodeKind::Memset)
    }
}

/// Any node of a graph: its driver handle and its kind. Typed handles convert into it with
/// `node()` or `Node::from`; dependency lists take `&[Node]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Node {
    /// The driver's handle.
    pub id: NodeId,
    /// Its kind.
    pub kind: NodeKind,
}

macro_rules! typed_node {
    ($(#[$doc:meta])* $name:ident, $kind:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub struct $name(pub(crate) NodeId);

        impl $name {
            /// The driver's handle.
            pub fn id(&self) -> NodeId {
                self.0
            }
            /// As an untyped [`Node`].
            pub fn node(&self) -> Node {
                Node { id: self.0, kind: $kind }
            }
        }

        impl From<$name> for Node {
            fn from(n: $name) -> Node {
                n.node()
            }
        }

        impl From<&$name> for Node {
            fn from(n: &$name) -> Node {
                n.node()
            }
        }

        /// The typed handle of an untyped node of this kind, e.g. one found with
        /// [`Graph::nodes`](crate::Graph::nodes) in a captured graph, for the exec's per-node
        /// setters. Errors ([`Error::InvalidArgument`](crate::Error::InvalidArgument)): a node
        /// of another kind.
        impl TryFrom<Node> for $name {
            type Error = crate::Error;
            fn try_from(n: Node) -> Result<$name, crate::Error> {
                if n.kind == $kind {
                    Ok($name(n.id))
                } else {
                    Err(crate::Error::invalid(format!(
                        "a {:?} node is not a {}",
                        n.kind,
                        stringify!($name)
                    )))
                }
            }
        }
    };
}

typed_node!(
    /// A conditional node ([`crate::Graph::add_if`], [`add_while`](crate::Graph::add_while),
    /// ...).
    ConditionalNode,
    NodeKind::Conditional
);
typed_node!(
    /// A kernel node ([`crate::Graph::add_kernel`]).
    KernelNode,
    NodeKind::Kernel
);
typed_node!(
    /// A memcpy node ([`crate::Graph::add_memcpy`]).
    MemcpyNode,
    NodeKind::Memcpy
);
typed_node!(
    /// A memset node ([`crate::Graph::add_memset`]).
    MemsetNode,
    NodeKind::Memset
);
typed_node!(
    /// A child graph node ([`crate::Graph::add_child_graph`]).
    ChildGraphNode,
    NodeKind::ChildGraph
);
typed_node!(
    /// An empty node ([`crate::Graph::add_empty`]).
    EmptyNode,
    NodeKind::Empty
);
typed_node!(
    /// An event record node ([`crate::Graph::add_event_record`]).
    EventRecordNode,
    NodeKind::EventRecord
);
typed_node!(
    /// An event wait node ([`crate::Graph::add_event_wait`]).
    EventWaitNode,
    NodeKind::EventWait
);
typed_node!(
    /// A memory free node ([`crate::Graph::add_mem_free`]).
    MemFreeNode,
    NodeKind::MemFree
);

/// A memory allocation node ([`crate::Graph::add_mem_alloc`]) and the address it allocates,
/// fixed for the graph's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemAllocNode {
    pub(crate) id: NodeId,
    pub(crate) ptr: CUdeviceptr,
    pub(crate) bytes: usize,
}

impl MemAllocNode {
    /// The driver's handle.
    pub fn id(&self) -> NodeId {
        self.id
    }
    /// As an untyped [`Node`].
    pub fn node(&self) -> Node {
        Node {
            id: self.id,
            kind: NodeKind::MemAlloc,
        }
    }
    /// The device address the node allocates (valid between this node and its free node
    /// while the graph runs).
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl From<MemAllocNode> for Node {
    fn from(n: MemAllocNode) -> Node {
        n.node()
    }
}

/// A host callback node ([`crate::Graph::add_host`]). It shares the closure with the graph, so
/// it can report whether calls panicked.
#[derive(Debug, Clone)]
pub struct HostNode {
    pub(crate) id: NodeId,
    pub(crate) callback: Arc<HostCallback>,
}

impl HostNode {
    /// The driver's handle.
    pub fn id(&self) -> NodeId {
        self.id
    }
    /// As an untyped [`Node`].
    pub fn node(&self) -> Node {
        Node {
            id: self.id,
            kind: NodeKind::Host,
        }
    }
    /// How many calls of this node's closure panicked. A panic is caught in the callback
    /// trampoline (it never unwinds into the driver); the graph goes on as if the callback
    /// had returned, and the panic message goes to the panic hook (stderr by default).
    pub fn panic_count(&self) -> u64 {
        self.callback.panics()
    }
}

impl From<&HostNode> for Node {
    fn from(n: &HostNode) -> Node {
        n.node()
    }
}

/// The kind of a dependency edge (`CUgraphDependencyType` and ports).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EdgeKind {
    /// A full dependency: the downstream node starts after the upstream node completes.
    Full,
    /// Programmatic dependent launch between kernel nodes: the downstream kernel may start
    /// once the upstream kernel triggers (`griddepcontrol.launch_dependents`) or completes;
    /// it must wait (`griddepcontrol.wait`) before reading the upstream kernel's output.
    Programmatic,
    /// Programmatic, from the launch-order port: the downstream kernel may start once all
    /// blocks of the upstream kernel have started.
    ProgrammaticLaunchOrder,
    /// Edge data this crate does not model (ports and type as the driver reports them).
    Other {
        /// `from_port`.
        from_port: u8,
        /// `to_port`.
        to_port: u8,
        /// `type`.
        kind: u8,
    },
}

impl EdgeKind {
    /// The driver's edge data.
    pub fn to_raw(self) -> CUgraphEdgeData {
        let (from_port, to_port, kind) = match self {
            EdgeKind::Full => (0, 0, 0),
            EdgeKind::Programmatic => (
                cuda_graph_sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
                0,
                cuda_graph_sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC.0
                    as u8,
            ),
            EdgeKind::ProgrammaticLaunchOrder => (
                cuda_graph_sys::CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER as u8,
                0,
                cuda_graph_sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC.0
                    as u8,
            ),
            EdgeKind::Other {
                from_port,
                to_port,
                kind,
            } => (from_port, to_port, kind),
        };
        CUgraphEdgeData {
            from_port,
            to_port,
            type_: kind,
            reserved: [0; 5],
        }
    }

    /// The kind of the driver's edge data.
    pub fn from_raw(e: &CUgraphEdgeData) -> EdgeKind {
        let programmatic =
            cuda_graph_sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC.0 as u8;
        match (e.from_port as u32, e.to_port, e.type_) {
            (0, 0, 0) => EdgeKind::Full,
            (cuda_graph_sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, 0, t) if t == programmatic => {
                EdgeKind::Programmatic
            }
            (cuda_graph_sys::CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER, 0, t) if t == programmatic => {
                EdgeKind::ProgrammaticLaunchOrder
            }
            _ => EdgeKind::Other {
                from_port: e.from_port,
                to_port: e.to_port,
                kind: e.type_,
            },
        }
    }
}

/// A dependency edge as reported by [`crate::Graph::edges`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Edge {
    /// The upstream node.
    pub from: NodeId,
    /// The downstream node.
    pub to: NodeId,
    /// Its kind.
    pub kind: EdgeKind,
}

/// The value of a memset node: 1, 2 or 4 bytes, repeated over the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemsetValue {
    /// Every byte.
    U8(u8),
    /// Every 2-byte element.
    U16(u16),
    /// Every 4-byte element (e.g. the bits of an `f32`: `MemsetValue::U32(1.5f32.to_bits())`).
    U32(u32),
}

impl MemsetValue {
    /// `(value, element size)` as the driver takes them.
    pub(crate) fn raw(self) -> (u32, u32) {
        match self {
            MemsetValue::U8(v) => (v as u32, 1),
            MemsetValue::U16(v) => (v as u32, 2),
            MemsetValue::U32(v) => (v, 4),
        }
    }
}

/// The closure of a host node, shared by the graph, its clones and execs. The driver calls
/// [`host_trampoline`] with a pointer to it.
pub(crate) struct HostCallback {
    f: Mutex<Box<dyn FnMut() + Send>>,
    panics: AtomicU64,
}

impl std::fmt::Debug for HostCallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostCallback")
            .field("panics", &self.panics.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl HostCallback {
    pub(crate) fn new(f: impl FnMut() + Send + 'static) -> HostCallback {
        HostCallback {
            f: Mutex::new(Box::new(f)),
            panics: AtomicU64::new(0),
        }
    }

    /// How many calls panicked.
    pub(crate) fn panics(&self) -> u64 {
        self.panics.load(Ordering::Relaxed)
    }

    /// Runs the closure; a panic is caught and counted, never unwound into the driver.
    fn call(&self) {
        let result = catch_unwind(AssertUnwindSafe(|| {
            // A callback that panicked before left the mutex poisoned; the closure's state is
            // whatever the panic left, which is the closure's own business: keep calling it.
            let mut f = self.f.lock().unwrap_or_else(|p| p.into_inner());
            f()
        }));
        if result.is_err() {
            self.panics.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The `CUhostFn` of every host node; `user` points to a live [`HostCallback`].
pub(crate) unsafe extern "C" fn host_trampoline(user: *mut std::ffi::c_void) {
    if user.is_null() {
        return;
    }
    // SAFETY: `user` is the address of a HostCallback inside an Arc that the graph (and every
    // exec and clone using the node) keeps alive while the node can run.
    let cb = unsafe { &*(user as *const HostCallback) };
    // `call` catches panics; anything escaping it (a panic while printing the panic message)
    // would abort instead of unwinding through C, as extern "C" functions abort on unwind.
    cb.call();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_kinds_map_from_driver_values() {
        assert_eq!(
            NodeKind::from_raw(CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL),
            NodeKind::Kernel
        );
        assert_eq!(
            NodeKind::from_raw(CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE),
            NodeKind::MemFree
        );
        assert_eq!(
            NodeKind::from_raw(CUgraphNodeType::CU_GRAPH_NODE_TYPE_CONDITIONAL),
            NodeKind::Conditional
        );
        assert_eq!(
            NodeKind::from_raw(CUgraphNodeType(99)),
            NodeKind::Unknown(99)
        );
        assert!(NodeKind::Memset.can_be_disabled());
        assert!(!NodeKind::Host.can_be_disabled());
    }

    #[test]
    fn typed_handles_come_from_nodes_of_their_kind_only() {
        let id = NodeId(std::ptr::null_mut());
        let kernel = Node {
            id,
            kind: NodeKind::Kernel,
        };
        assert_eq!(KernelNode::try_from(kernel).unwrap(), KernelNode(id));
        assert_eq!(Node::from(KernelNode::try_from(kernel).unwrap()), kernel);
        let memset = Node {
            id,
            kind: NodeKind::Memset,
        };
        let e = KernelNode::try_from(memset).unwrap_err();
        assert!(matches!(e, crate::Error::InvalidArgument(_)), "{e}");
        assert!(
            e.to_string().contains("Memset node is not a KernelNode"),
            "{e}"
        );
        assert!(MemsetNode::try_from(memset).is_ok());
        let cond = Node {
            id,
            kind: NodeKind::Conditional,
        };
        assert!(ConditionalNode::try_from(cond).is_ok());
        assert!(EmptyNode::try_from(cond).is_err());
    }

    #[test]
    fn edge_kinds_round_trip() {
        for k in [
            EdgeKind::Full,
            EdgeKind::Programmatic,
            EdgeKind::ProgrammaticLaunchOrder,
            EdgeKind::Other {
                from_port: 7,
                to_port: 0,
                kind: 0,
            },
        ] {
            assert_eq!(EdgeKind::from_raw(&k.to_raw()), k);
        }
        let p = EdgeKind::Programmatic.to_raw();
        assert_eq!(
            (p.from_port, p.to_port, p.type_, p.reserved),
            (1, 0, 1, [0; 5])
        );
        assert_eq!(EdgeKind::Full.to_raw().type_, 0);
    }

    #[test]
    fn memset_values_carry_element_size() {
        assert_eq!(MemsetValue::U8(0xab).raw(), (0xab, 1));
        assert_eq!(MemsetValue::U16(0xabcd).raw(), (0xabcd, 2));
        assert_eq!(MemsetValue::U32(1.5f32.to_bits()).raw(), (0x3fc0_0000, 4));
    }

    #[test]
    fn host_callback_counts_panics_and_keeps_running() {
        let hits = Arc::new(AtomicU64::new(0));
        let h = hits.clone();
        let cb = HostCallback::new(move || {
            let n = h.fetch_add(1, Ordering::Relaxed);
            if n == 1 {
                panic!("second call panics");
            }
        });
        for _ in 0..3 {
            // SAFETY: a pointer to a live HostCallback, as the driver would pass it.
            unsafe { host_trampoline((&cb as *const HostCallback).cast_mut().cast()) };
        }
        assert_eq!(hits.load(Ordering::Relaxed), 3);
        assert_eq!(cb.panics(), 1);
    }
}
