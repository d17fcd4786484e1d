//! Conditional nodes: IF, IF-ELSE, WHILE and SWITCH, in explicit graphs and during a stream
//! capture, and the device helper kernels that set their condition values.
//!
//! A conditional node runs one of its body graphs (or loops over one) depending on a 32-bit
//! value attached to a [`ConditionalHandle`]. The value is set only on the device: by a
//! kernel that calls `cudaGraphSetConditional`, for example the helper kernels this crate
//! ships ([`ConditionalHandle::set_on`] and
//! [`Graph::add_set_condition`](crate::Graph::add_set_condition)), or by the handle's default,
//! applied at every launch when the handle was made with `reset_each_launch`.
//!
//! Bodies are filled by a closure that receives a capturing [`Stream`]: everything the
//! closure enqueues on it (kernel launches, copies, memsets, condition setters, nested
//! conditionals through [`Stream::capture_if`] and friends) becomes the body's nodes.
//!
//! The code is split by job: `handle` (handles and the setter kernels), `explicit`
//! ([`Graph::add_if`](crate::Graph::add_if) and friends), `capture` ([`Stream::capture_if`]
//! and friends) and `body` (adding the node and capturing its bodies, shared by both).
//!
//! # Rules for conditional bodies
//!
//! Rules the driver enforces (breaking them fails at node creation or instantiation):
//! * bodies may hold only kernel, empty, child-graph, memset, memcpy and conditional nodes,
//!   all of the graph's context: no host nodes, event nodes, memory alloc/free nodes
//!   (`DeviceBuffer::alloc_async` in a body fails), no work on other contexts;
//! * a graph holding conditional nodes cannot be cloned or used as a child graph, and only
//!   one exec made from it may exist at a time;
//! * a handle must be used by exactly one conditional node of the graph it was created for;
//!   a handle no node uses makes instantiation fail;
//! * bodies are captured on a scratch stream (thread-local mode), so while a body closure
//!   runs, synchronous allocations, frees or module loads made by *other threads* in the
//!   same context can invalidate the capture (error 901): build graphs with conditionals
//!   while no other thread does such work, and load the setter kernels ahead with
//!   [`ConditionalHandle::load_helpers`];
//! * IF and WHILE need a driver >= 12.4, IF-ELSE and SWITCH >= 12.8
//!   ([`Feature::ConditionalIfWhile`], [`Feature::ConditionalIfElseSwitch`]); the methods
//!   here return [`Error::Unsupported`] before any driver call on older drivers.
//!
//! ```no_run
//! use cuda_graph::{ConditionalHandle, Context, DeviceBuffer, Graph, GraphExec, Stream};
//! # fn body(s: &Stream) -> cuda_graph::Result<()> { Ok(()) }
//! let ctx = Context::default_device()?;
//! let stream = Stream::new(&ctx)?;
//! let counter = DeviceBuffer::<i32>::from_host(&stream, &[5])?;
//! let mut graph = Graph::new(&ctx)?;
//! // A counted loop: the body runs `counter` times (counter >= 1).
//! let handle = ConditionalHandle::new(&mut graph, 1, true)?;
//! let _node: cuda_graph::ConditionalNode = graph.add_while(&[], handle, |s| {
//!     body(s)?;
//!     handle.decrement_on(s, &counter)
//! })?;
//! let exec = GraphExec::instantiate(&graph, Default::default())?;
//! exec.launch(&stream)?;
//! # Ok::<(), cuda_graph::Error>(())
//! ```

mod body;
mod capture;
mod explicit;
mod handle;

pub use handle::{ConditionSource, ConditionalHandle};

use crate::driver::{Feature, driver_version};
use crate::error::{Error, Result};
use crate::stream::Stream;
use cuda_graph_sys::CUgraphConditionalNodeType;

/// A body-filling closure, for [`Graph::add_switch`](crate::Graph::add_switch) and
/// [`Stream::capture_switch`].
pub type Body<'a> = Box<dyn FnOnce(&Stream) -> Result<()> + 'a>;

/// The kind of a conditional node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConditionalKind {
    /// IF without else: the body runs when the value is non-zero.
    If,
    /// IF with an else body: the first runs when the value is non-zero, the second when zero.
    IfElse,
    /// WHILE: the body runs again and again while the value is non-zero (checked before
    /// each iteration, so a zero value on entry runs it no time).
    While,
    /// SWITCH over `n` bodies: body `value` runs; a value `>= n` runs nothing.
    Switch(u32),
}

impl ConditionalKind {
    /// The driver feature this kind needs.
    pub fn required_feature(self) -> Feature {
        match self {
            ConditionalKind::If | ConditionalKind::While => Feature::ConditionalIfWhile,
            ConditionalKind::IfElse | ConditionalKind::Switch(_) => {
                Feature::ConditionalIfElseSwitch
            }
        }
    }

    /// The driver's node type and number of bodies.
    pub(crate) fn raw(self) -> (CUgraphConditionalNodeType, u32) {
        match self {
            ConditionalKind::If => (CUgraphConditionalNodeType::CU_GRAPH_COND_TYPE_IF, 1),
            ConditionalKind::IfElse => (CUgraphConditionalNodeType::CU_GRAPH_COND_TYPE_IF, 2),
            ConditionalKind::While => (CUgraphConditionalNodeType::CU_GRAPH_COND_TYPE_WHILE, 1),
            ConditionalKind::Switch(n) => {
                (CUgraphConditionalNodeType::CU_GRAPH_COND_TYPE_SWITCH, n)
            }
        }
    }

    /// Checks the body count, then the installed driver; no other driver call is made.
    pub(crate) fn check(self) -> Result<()> {
        if self == ConditionalKind::Switch(0) {
            return Err(Error::invalid("a SWITCH node needs at least one case"));
        }
        self.required_feature().check_driver(driver_version()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::DriverVersion;

    #[test]
    fn kinds_map_to_features() {
        assert_eq!(
            ConditionalKind::If.required_feature(),
            Feature::ConditionalIfWhile
        );
        assert_eq!(
            ConditionalKind::While.required_feature(),
            Feature::ConditionalIfWhile
        );
        assert_eq!(
            ConditionalKind::IfElse.required_feature(),
            Feature::ConditionalIfElseSwitch
        );
        assert_eq!(
            ConditionalKind::Switch(3).required_feature(),
            Feature::ConditionalIfElseSwitch
        );
    }

    #[test]
    fn kinds_are_gated_by_driver_version() {
        let gate = |k: ConditionalKind, v: i32| {
            k.required_feature().check_driver(DriverVersion(v)).is_ok()
        };
        for (v, if_while, else_switch) in [
            (12030, false, false),
            (12040, true, false),
            (12070, true, false),
            (12080, true, true),
            (13000, true, true),
        ] {
            assert_eq!(gate(ConditionalKind::If, v), if_while, "IF at {v}");
            assert_eq!(gate(ConditionalKind::While, v), if_while, "WHILE at {v}");
            assert_eq!(
                gate(ConditionalKind::IfElse, v),
                else_switch,
                "IF-ELSE at {v}"
            );
            assert_eq!(
                gate(ConditionalKind::Switch(2), v),
                else_switch,
                "SWITCH at {v}"
            );
        }
    }

    #[test]
    fn raw_types_and_sizes() {
        use CUgraphConditionalNodeType as T;
        assert_eq!(ConditionalKind::If.raw(), (T::CU_GRAPH_COND_TYPE_IF, 1));
        assert_eq!(ConditionalKind::IfElse.raw(), (T::CU_GRAPH_COND_TYPE_IF, 2));
        assert_eq!(
            ConditionalKind::While.raw(),
            (T::CU_GRAPH_COND_TYPE_WHILE, 1)
        );
        assert_eq!(
            ConditionalKind::Switch(5).raw(),
            (T::CU_GRAPH_COND_TYPE_SWITCH, 5)
        );
    }

    #[test]
    fn empty_switch_is_rejected_before_the_driver() {
        assert!(matches!(
            ConditionalKind::Switch(0).check(),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn helper_image_is_embedded() {
        assert!(handle::HELPER_IMAGE.len() > 64);
    }
}
