//! Conditional nodes: IF, IF-ELSE, WHILE and SWITCH, in explicit graphs and during a stream
//! capture, and the device helper kernels that set their condition values.
//!
//! A conditional node runs one of its body graphs (or loops over one) depending on a 32-bit
//! value attached to a [`ConditionalHandle`]. The value is set only on the device: by a
//! kernel that calls `cudaGraphSetConditional`, for example the helper kernels this crate
//! ships ([`ConditionalHandle::set_on`] and [`Graph::add_set_condition`]), or by the handle's
//! default, applied at every launch when the handle was made with `reset_each_launch`.
//!
//! Bodies are filled by a closure that receives a capturing [`Stream`]: everything the
//! closure enqueues on it (kernel launches, copies, memsets, condition setters, nested
//! conditionals through [`Stream::capture_if`] and friends) becomes the body's nodes.
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
//! graph.add_while(&[], handle, |s| {
//!     body(s)?;
//!     handle.decrement_on(s, &counter)
//! })?;
//! let exec = GraphExec::instantiate(&graph, Default::default())?;
//! exec.launch(&stream)?;
//! # Ok::<(), cuda_graph::Error>(())
//! ```

use std::sync::Arc;

use cuda_graph_sys::{
    CU_GRAPH_COND_ASSIGN_DEFAULT, CUDA_CONDITIONAL_NODE_PARAMS, CUgraph, CUgraphConditionalHandle,
    CUgraphConditionalNodeType, CUgraphEdgeData, CUgraphNode, CUgraphNodeParams, CUgraphNodeType,
    CUstreamCaptureMode, CUstreamUpdateCaptureDependencies_flags,
};

use crate::capture::{CaptureInfo, CaptureStatus};
use crate::context::Context;
use crate::driver::{Feature, driver_version};
use crate::error::{Error, Result};
use crate::exec::NodeId;
use crate::graph::{Graph, Resource};
use crate::launch::{KernelArgs, LaunchConfig};
use crate::memory::DeviceBuffer;
use crate::module::Module;
use crate::stream::Stream;

/// The helper kernels of `kernels/conditional.cu`.
static HELPER_IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/conditional.fatbin"));

/// A body-filling closure, for [`Graph::add_switch`] and [`Stream::capture_switch`].
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
    fn raw(self) -> (CUgraphConditionalNodeType, u32) {
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
    fn check(self) -> Result<()> {
        if self == ConditionalKind::Switch(0) {
            return Err(Error::invalid("a SWITCH node needs at least one case"));
        }
        self.required_feature().check_driver(driver_version()?)
    }
}

/// The value a conditional node reads, by handle (`CUgraphConditionalHandle`). A plain
/// `Copy` identifier: it belongs to the graph it was created for (the top-level graph, or the
/// body graph that holds its node) and to that graph's context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConditionalHandle {
    raw: CUgraphConditionalHandle,
    default: u32,
    reset_each_launch: bool,
    /// The graph it was created for, to reject use in another graph (an address, never
    /// dereferenced).
    graph: usize,
    /// The context, as an address, to reject setters on streams of another context.
    ctx: usize,
}

impl ConditionalHandle {
    /// A handle for a conditional node of `graph`. With `reset_each_launch` the value is set
    /// to `default` at the start of every launch (`CU_GRAPH_COND_ASSIGN_DEFAULT`). Without
    /// it the driver does not apply `default` at all (seen on driver 13.0: the first launch
    /// read 0 with a default of 1), and each launch sees what device code last set, also in
    /// an earlier launch: set the value before the node reads it.
    pub fn new(graph: &mut Graph, default: u32, reset_each_launch: bool) -> Result<Self> {
        create_handle(graph.context(), graph.as_raw(), default, reset_each_launch)
    }

    /// A handle for a conditional node that will be added to the graph `stream` is
    /// capturing into (see [`Stream::capture_if`]); [`Error::InvalidArgument`] when `stream`
    /// is not capturing.
    pub fn in_capture(stream: &Stream, default: u32, reset_each_launch: bool) -> Result<Self> {
        Feature::ConditionalIfWhile.check_driver(driver_version()?)?;
        let info = capture_info(stream)?;
        create_handle(stream.context(), info.graph, default, reset_each_launch)
    }

    /// Loads the helper kernels of [`ConditionalHandle::set_on`] for `ctx` now. Their first
    /// use loads them otherwise; call this before a capture in `GLOBAL` mode, where loading a
    /// module may be a prohibited call that invalidates the capture.
    pub fn load_helpers(ctx: &Arc<Context>) -> Result<()> {
        Module::embedded(ctx, HELPER_IMAGE).map(drop)
    }

    /// The raw handle, e.g. to pass to your own kernels that call `cudaGraphSetConditional`.
    pub fn as_raw(&self) -> CUgraphConditionalHandle {
        self.raw
    }

    /// The value the handle starts each launch with when it
    /// [resets each launch](ConditionalHandle::resets_each_launch).
    pub fn default_value(&self) -> u32 {
        self.default
    }

    /// Whether the value is reset to the default at every launch.
    pub fn resets_each_launch(&self) -> bool {
        self.reset_each_launch
    }

    /// Enqueues a one-thread helper kernel on `stream` that sets this handle's value from
    /// `source`. Meant for a stream that is capturing into this handle's graph (a body
    /// closure's stream, or the capturing stream before [`Stream::capture_if`]): the setter
    /// must run inside a launch of that graph. The graph keeps the buffer alive.
    pub fn set_on(&self, stream: &Stream, source: ConditionSource<'_>) -> Result<()> {
        self.check_context(stream.context())?;
        source.check()?;
        let module = Module::embedded(stream.context(), HELPER_IMAGE)?;
        let raw = self.raw;
        let config = LaunchConfig::linear(1, 1);
        let (name, args) = match &source {
            ConditionSource::Const(v) => ("cond_set_const", KernelArgs::new().arg(&raw).arg(v)),
            ConditionSource::I32(b) => ("cond_set_from_i32", KernelArgs::new().arg(&raw).arg(*b)),
            ConditionSource::NonZeroI32(b) => {
                ("cond_set_nonzero_i32", KernelArgs::new().arg(&raw).arg(*b))
            }
            ConditionSource::PositiveI32(b) => {
                ("cond_set_positive_i32", KernelArgs::new().arg(&raw).arg(*b))
            }
            ConditionSource::F32(b) => ("cond_set_from_f32", KernelArgs::new().arg(&raw).arg(*b)),
            ConditionSource::Decrement(b) => {
                ("cond_decrement", KernelArgs::new().arg(&raw).arg(*b))
            }
        };
        let kernel = &module.kernel(name)?;
        // SAFETY: the helper kernels take (u64 handle, u32 or pointer) and touch only element
        // 0 of the buffer, which `source.check` proved exists; one thread, so the value is
        // set without races. The handle belongs to this context (checked above).
        unsafe { stream.launch(kernel, &config, &args) }
    }

    /// `set_on(stream, ConditionSource::Const(value))`.
    pub fn set_const_on(&self, stream: &Stream, value: u32) -> Result<()> {
        self.set_on(stream, ConditionSource::Const(value))
    }

    /// Sets the value to `flag[0]` (an IF/WHILE flag or a SWITCH index).
    pub fn set_from_flag_on(&self, stream: &Stream, flag: &DeviceBuffer<i32>) -> Result<()> {
        self.set_on(stream, ConditionSource::I32(flag))
    }

    /// Sets the value to `flag[0] != 0.0` (1 or 0).
    pub fn set_from_f32_flag_on(&self, stream: &Stream, flag: &DeviceBuffer<f32>) -> Result<()> {
        self.set_on(stream, ConditionSource::F32(flag))
    }

    /// Counted loops: `counter[0] -= 1`, then the value is `counter[0] > 0`.
    pub fn decrement_on(&self, stream: &Stream, counter: &DeviceBuffer<i32>) -> Result<()> {
        self.set_on(stream, ConditionSource::Decrement(counter))
    }

    fn check_context(&self, ctx: &Arc<Context>) -> Result<()> {
        if ctx.as_raw() as usize == self.ctx {
            Ok(())
        } else {
            Err(Error::invalid(
                "the conditional handle belongs to another context",
            ))
        }
    }
}

/// Where a helper kernel takes a conditional value from ([`ConditionalHandle::set_on`]).
/// Buffers are read (and, for `Decrement`, written) at element 0 when the setter runs.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum ConditionSource<'a> {
    /// A constant.
    Const(u32),
    /// `buf[0]` as an unsigned value: a flag or a SWITCH index (negative values become large
    /// and select no SWITCH case).
    I32(&'a DeviceBuffer<i32>),
    /// `buf[0] != 0` (1 or 0).
    NonZeroI32(&'a DeviceBuffer<i32>),
    /// `buf[0] > 0` (1 or 0), without changing it: the test at the head of a counted loop.
    PositiveI32(&'a DeviceBuffer<i32>),
    /// `buf[0] != 0.0` (1 or 0; NaN counts as non-zero).
    F32(&'a DeviceBuffer<f32>),
    /// `buf[0] -= 1`, then `buf[0] > 0` (1 or 0): the test at the end of a counted loop.
    Decrement(&'a DeviceBuffer<i32>),
}

impl ConditionSource<'_> {
    fn check(&self) -> Result<()> {
        let empty = match self {
            ConditionSource::Const(_) => false,
            ConditionSource::I32(b)
            | ConditionSource::NonZeroI32(b)
            | ConditionSource::PositiveI32(b)
            | ConditionSource::Decrement(b) => b.is_empty(),
            ConditionSource::F32(b) => b.is_empty(),
        };
        if empty {
            Err(Error::invalid("a condition source buffer needs an element"))
        } else {
            Ok(())
        }
    }
}

impl Graph {
    /// Adds an IF node after `deps`: `then` fills the body through a capturing stream, which
    /// runs when the handle's value is non-zero. Needs a driver >= 12.4.
    pub fn add_if<F>(
        &mut self,
        deps: &[NodeId],
        handle: ConditionalHandle,
        then: F,
    ) -> Result<NodeId>
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
    pub fn add_if_else<F, G>(
        &mut self,
        deps: &[NodeId],
        handle: ConditionalHandle,
        then: F,
        else_: G,
    ) -> Result<NodeId>
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
    pub fn add_while<F>(
        &mut self,
        deps: &[NodeId],
        handle: ConditionalHandle,
        body: F,
    ) -> Result<NodeId>
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
    pub fn add_switch(
        &mut self,
        deps: &[NodeId],
        handle: ConditionalHandle,
        cases: Vec<Body<'_>>,
    ) -> Result<NodeId> {
        let n = u32::try_from(cases.len())
            .map_err(|_| Error::invalid(format!("{} SWITCH cases", cases.len())))?;
        self.add_conditional(deps, handle, ConditionalKind::Switch(n), cases)
    }

    /// Adds a one-thread kernel node after `deps` that sets `handle` from `source`, and
    /// returns it; put it before the conditional node that reads the handle.
    pub fn add_set_condition(
        &mut self,
        deps: &[NodeId],
        handle: ConditionalHandle,
        source: ConditionSource<'_>,
    ) -> Result<NodeId> {
        handle.check_context(self.context())?;
        source.check()?;
        let raw_deps: Vec<CUgraphNode> = deps.iter().map(|d| d.0).collect();
        let (resources, ends) = capture_into(self.context(), self.as_raw(), &raw_deps, |s| {
            handle.set_on(s, source)
        })?;
        for r in resources {
            self.keep_alive(r);
        }
        match ends.as_slice() {
            [one] => Ok(NodeId(*one)),
            // One kernel launch captured after `deps` is exactly one new node.
            _ => Err(Error::invalid(format!(
                "expected the setter to add one node, the capture ended on {}",
                ends.len()
            ))),
        }
    }

    fn add_conditional(
        &mut self,
        deps: &[NodeId],
        handle: ConditionalHandle,
        kind: ConditionalKind,
        bodies: Vec<Body<'_>>,
    ) -> Result<NodeId> {
        kind.check()?;
        check_handle_graph(&handle, self.as_raw())?;
        let raw_deps: Vec<CUgraphNode> = deps.iter().map(|d| d.0).collect();
        let ctx = self.context().clone();
        let (node, body_graphs) = add_node(
            &ctx,
            self.as_raw(),
            &raw_deps,
            std::ptr::null(),
            handle,
            kind,
        )?;
        let resources = fill_bodies(&ctx, &body_graphs, bodies)?;
        for r in resources {
            self.keep_alive(r);
        }
        Ok(NodeId(node))
    }
}

impl Stream {
    /// During a capture on this stream: adds an IF node after the work captured so far, fills
    /// its body with `then` (captured on a scratch stream into the body graph) and makes the
    /// capture continue after the node. `handle` comes from
    /// [`ConditionalHandle::in_capture`] on this stream. [`Error::InvalidArgument`] when the
    /// stream is not capturing. Needs a driver >= 12.4.
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

    /// During a capture: a WHILE node (see [`Stream::capture_if`], [`Graph::add_while`]).
    /// Needs a driver >= 12.4.
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

    /// During a capture: a SWITCH node over `cases` (see [`Graph::add_switch`]). Needs a
    /// driver >= 12.8.
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
fn capture_info(stream: &Stream) -> Result<CaptureInfo> {
    let info = crate::capture::capture_info(stream)?;
    if info.status != CaptureStatus::Active || info.graph.is_null() {
        return Err(Error::invalid(format!(
            "the stream is not capturing (capture status {:?})",
            info.status
        )));
    }
    Ok(info)
}

fn create_handle(
    ctx: &Arc<Context>,
    graph: CUgraph,
    default: u32,
    reset_each_launch: bool,
) -> Result<ConditionalHandle> {
    Feature::ConditionalIfWhile.check_driver(driver_version()?)?;
    let flags = if reset_each_launch {
        CU_GRAPH_COND_ASSIGN_DEFAULT
    } else {
        0
    };
    let mut raw = 0;
    // SAFETY: live graph and context, valid out-pointer, flags 0 or ASSIGN_DEFAULT.
    unsafe {
        cu!(cuGraphConditionalHandleCreate(
            &mut raw,
            graph,
            ctx.as_raw(),
            default,
            flags
        ))
    }?;
    Ok(ConditionalHandle {
        raw,
        default,
        reset_each_launch,
        graph: graph as usize,
        ctx: ctx.as_raw() as usize,
    })
}

fn check_handle_graph(handle: &ConditionalHandle, graph: CUgraph) -> Result<()> {
    if handle.graph == graph as usize {
        Ok(())
    } else {
        Err(Error::invalid(
            "the conditional handle was created for another graph (a body's handle comes \
             from ConditionalHandle::in_capture on the body's stream)",
        ))
    }
}

/// Adds the conditional node; returns it and its driver-owned body graphs.
fn add_node(
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

fn fill_bodies(
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
fn capture_into<F>(
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
        assert!(HELPER_IMAGE.len() > 64);
    }
}
