//! Executable graphs: instantiate, upload, launch, whole-graph update and per-node updates.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bitflags::bitflags;
use cuda_graph_sys::{
    CUDA_GRAPH_INSTANTIATE_PARAMS, CUgraphExec, CUgraphInstantiateResult, CUgraphNode,
};

use crate::context::Context;
use crate::error::{Error, Result, UpdateReason};
use crate::event::Event;
use crate::graph::{
    Graph, OwnedGraph, copy_bytes, host_params, kernel_params, memcpy_d2d, memset_params,
};
use crate::ids::NodeId;
use crate::launch::{KernelArgs, LaunchConfig};
use crate::memory::{DeviceBuffer, DeviceRepr};
use crate::module::Kernel;
use crate::node::{
    ChildGraphNode, EventRecordNode, EventWaitNode, HostCallback, HostNode, KernelNode, MemcpyNode,
    MemsetNode, MemsetValue, Node,
};
use crate::resources::{Resource, ResourceSet};
use crate::stream::Stream;

/// What [`GraphExec::update_or_reinstantiate`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UpdateOutcome {
    /// The exec was updated in place.
    Updated,
    /// The update was refused; the exec was replaced by a fresh instantiation.
    Reinstantiated,
}

bitflags! {
    /// Flags of [`GraphExec::instantiate`] (`CUDA_GRAPH_INSTANTIATE_FLAG_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct InstantiateFlags: u64 {
        /// Free graph memory allocations left unfreed when the graph is launched again.
        const AUTO_FREE_ON_LAUNCH = 1;
        /// Upload the graph as part of instantiation (needs an upload stream).
        const UPLOAD = 2;
        /// Allow launching the graph from the device (not with `AUTO_FREE_ON_LAUNCH`).
        const DEVICE_LAUNCH = 4;
        /// Use each node's priority attribute instead of the launch stream's.
        const USE_NODE_PRIORITY = 8;
    }
}

/// An instantiated graph. It keeps alive everything its graph held at instantiation (and
/// what later updates install), so the memory and modules its nodes use outlive it even if
/// the user's handles and the graph are dropped. It also keeps the graph object it was
/// instantiated from (not the `Graph` value): the driver resolves node handles through it.
///
/// # Node handles
///
/// The per-node setters take handles of the graph the exec was instantiated from, and —
/// unlike the raw driver — also handles of any graph it was later [updated](Self::update)
/// to, which the exec translates (nodes pair in creation order, which is how graphs built or
/// captured by the same code pair; the kinds are checked): those of the latest update's graph
/// always, those of earlier updates' graphs while their [`Graph`] lives (an exec updated from
/// a fresh graph every step holds no more than that). So after
/// [`update_or_reinstantiate(g)`](Self::update_or_reinstantiate), `g`'s handles are valid
/// whichever way it went; the first graph's handles stay valid after updates, but not after
/// a reinstantiation (a new topology has other nodes). The first setter after an update pairs
/// the nodes (`cuGraphGetNodes`, `cuGraphNodeGetType`); an [`Error::Driver`] of theirs is that
/// setter's error.
///
/// # Threads
///
/// An exec is `Send` and `Sync`: launches and uploads from several threads are serialised
/// (see [`GraphExec::launch`]), and it may be dropped on any thread, even while a launch
/// runs. The per-node setters look nodes up through the graph the exec was made from (and
/// the graphs it was updated to), and the driver forbids concurrent calls on one graph: the
/// setters and the [`Graph`]'s own methods therefore share a lock, so editing the graph on
/// one thread while a setter of its exec runs on another is serialized. Not covered: nodes a
/// stream capture adds ([`Stream::capture_into`](crate::Stream::capture_into) the same
/// graph) — do not run this exec's setters while capturing into its graph.
///
/// # Dropping
///
/// Every launch is followed by an event record (under a lock, so the event always marks
/// the latest launch; launches of one exec run in launch order). Dropping a launched exec
/// waits for that event only — not for the whole context — before releasing what it keeps
/// alive. If that wait fails (the context hit a sticky error), the memory is leaked rather
/// than freed under work that may still run.
pub struct GraphExec {
    raw: CUgraphExec,
    ctx: Arc<Context>,
    resources: ResourceSet,
    /// The graph object the exec was instantiated from: kept alive for the setters' node
    /// lookups (the driver resolves node handles through it), and its lock serializes those
    /// setters with the `Graph`'s own calls.
    origin: Arc<OwnedGraph>,
    /// Node handles of graphs this exec was updated to, mapped to `origin`'s.
    aliases: HashMap<CUgraphNode, CUgraphNode>,
    /// The graphs of updates whose handles are not mapped yet (mapped on first use, so that
    /// updates stay cheap), oldest first.
    pending_alias: Vec<Arc<OwnedGraph>>,
    /// The graphs whose handles `aliases` maps, with those handles: kept so that their node
    /// addresses are not reused by other graphs while the map holds them, and dropped (with
    /// their handles) once this exec is all that holds them (`prune_aliases`).
    alias_graphs: Vec<(Arc<OwnedGraph>, Vec<CUgraphNode>)>,
    /// The graph of the latest update: its handles stay valid even once its `Graph` is
    /// dropped (this extra count keeps `prune_aliases` off it), as the origin's do.
    latest: Option<Arc<OwnedGraph>>,
    /// Recorded after every launch; `None` until the first launch.
    completion: Mutex<Option<Event>>,
}

impl std::fmt::Debug for GraphExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphExec")
            .field("raw", &self.raw)
            .field("resources", &self.resources.as_slice().len())
            .field("aliases", &self.aliases.len())
            .finish()
    }
}

// SAFETY: the fields that are not `Send` by themselves are driver handles (the exec, its
// origin graph, node handles in `aliases`) and the `CUgraph` of `pending_alias`; none is tied
// to a thread. Every driver call on them needs `&mut self` or the `completion` lock (see
// `Sync`), so moving the exec to another thread cannot make two calls overlap. Dropping it
// there is also fine: `Drop` waits for the last launch before releasing what it keeps alive,
// and `cuGraphExecDestroy` may run on any thread.
//
// The origin graph object is shared with the `Graph` it came from and with other execs of
// it. The per-node setters pass its node handles, which the driver looks up through that
// graph, and `resolve` reads its nodes (and the pending graph's): each such call holds that
// graph object's lock (`OwnedGraph::locked`), which the `Graph`'s own driver calls hold too,
// so calls on one graph object never overlap across threads (see "Threads" in the docs).
unsafe impl Send for GraphExec {}
// SAFETY: the driver does not synchronise calls on one exec (graph objects are "not
// internally synchronized", https://docs.nvidia.com/cuda/cuda-driver-api/graphs-thread-safety.html),
// so both `&self` methods that call the driver on the exec (`launch`, `upload`) hold the
// `completion` mutex for the call: launches from several threads are serialised on the host,
// each followed by its completion record, and run on the device one at a time in that order
// (one exec runs one launch at a time). `synchronize` takes the same mutex to reach the
// event, whose driver calls are thread-safe. The other `&self` methods only read fields that
// `&mut self` methods alone change.
unsafe impl Sync for GraphExec {}

impl GraphExec {
    /// Instantiates `graph`. `UPLOAD` needs a stream: use [`GraphExec::instantiate_on`].
    ///
    /// Wraps [`cuGraphInstantiateWithParams`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    ///
    /// # Errors
    /// * [`Error::InvalidArgument`], before any driver call, for `UPLOAD`, or for
    ///   `AUTO_FREE_ON_LAUNCH` with `DEVICE_LAUNCH` (which the driver does not allow together);
    /// * [`Error::Instantiate`] when the driver refuses the graph, with its
    ///   `CUgraphInstantiateResult` and the node it blamed (e.g. a conditional handle that no
    ///   node uses);
    /// * [`Error::Driver`] from making the graph's context current.
    pub fn instantiate(graph: &Graph, flags: InstantiateFlags) -> Result<GraphExec> {
        if flags.contains(InstantiateFlags::UPLOAD) {
            return Err(Error::invalid(
                "InstantiateFlags::UPLOAD needs an upload stream: use instantiate_on",
            ));
        }
        GraphExec::instantiate_impl(graph, flags, None)
    }

    /// Instantiates `graph`, uploading it on `stream` when `flags` has `UPLOAD`.
    ///
    /// Wraps [`cuGraphInstantiateWithParams`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: as [`GraphExec::instantiate`], which refuses `UPLOAD`; here a failed upload
    /// is an [`Error::Instantiate`].
    pub fn instantiate_on(
        graph: &Graph,
        flags: InstantiateFlags,
        stream: &Stream,
    ) -> Result<GraphExec> {
        GraphExec::instantiate_impl(graph, flags, Some(stream))
    }

    fn instantiate_impl(
        graph: &Graph,
        flags: InstantiateFlags,
        stream: Option<&Stream>,
    ) -> Result<GraphExec> {
        if flags.contains(InstantiateFlags::AUTO_FREE_ON_LAUNCH | InstantiateFlags::DEVICE_LAUNCH) {
            return Err(Error::invalid(
                "AUTO_FREE_ON_LAUNCH and DEVICE_LAUNCH cannot be combined",
            ));
        }
        graph.context().bind()?;
        let mut params = CUDA_GRAPH_INSTANTIATE_PARAMS {
            flags: flags.bits(),
            hUploadStream: stream.map_or(std::ptr::null_mut(), Stream::as_raw),
            ..Default::default()
        };
        let mut raw = std::ptr::null_mut();
        let instantiate = cuda_graph_sys::driver()?.cuGraphInstantiateWithParams()?;
        // SAFETY: live graph, valid params and out-pointer; under the graph object's lock
        // (another exec's setters may look nodes up through it).
        let rc = graph
            .owner()
            .locked(|| unsafe { instantiate(&mut raw, graph.as_raw(), &mut params) });
        if rc != cuda_graph_sys::CUresult::CUDA_SUCCESS
            || params.result_out != CUgraphInstantiateResult::CUDA_GRAPH_INSTANTIATE_SUCCESS
        {
            return Err(Error::Instantiate {
                source: Box::new(Error::driver("cuGraphInstantiateWithParams", rc)),
                result: params.result_out,
                node: NodeId(params.hErrNode_out),
            });
        }
        Ok(GraphExec {
            raw,
            ctx: graph.context().clone(),
            resources: graph.resources().iter().cloned().collect(),
            origin: graph.owner().clone(),
            aliases: HashMap::new(),
            pending_alias: Vec::new(),
            alias_graphs: Vec::new(),
            latest: None,
            completion: Mutex::new(None),
        })
    }

    /// Uploads the exec's work to the device ahead of its first launch, on `stream`, so the
    /// first launch does not pay for it. Serialised with launches from other threads, like
    /// [`GraphExec::launch`].
    ///
    /// Wraps [`cuGraphUpload`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`].
    pub fn upload(&self, stream: &Stream) -> Result<()> {
        // The driver does not synchronise calls on one exec: take the launch lock.
        let _serial = self
            .completion
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        stream.context().ensure_current()?;
        // SAFETY: live exec and stream; no other call on the exec runs (the lock).
        unsafe { cu!(cuGraphUpload(self.raw, stream.as_raw())) }
    }

    /// Launches the graph on `stream` ([`cuGraphLaunch`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)).
    /// One exec runs one launch at a time, in launch order, whatever the streams.
    ///
    /// The exec is `Sync`: threads sharing it may launch it at the same time. Their launches
    /// are serialised (a lock on the host; the driver then orders each launch of the exec
    /// after the previous one), so they never overlap on the device and none is refused. To
    /// run one graph concurrently, instantiate it once per stream.
    ///
    /// Errors: [`Error::Driver`]: from `cuGraphLaunch` (e.g. an invalid stream, a graph whose
    /// memory nodes were not freed, a sticky error of the context); from creating the completion
    /// event on the first launch ([`cuEventCreate`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html));
    /// or from recording it after the launch ([`cuEventRecord`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)),
    /// when the launch is already enqueued.
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        let mut completion = self
            .completion
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if completion.is_none() {
            *completion = Some(Event::for_sync(&self.ctx)?);
        }
        stream.context().ensure_current()?;
        if stream.is_collecting() {
            // Launched into a capture of this crate's: the graph being captured keeps what
            // the exec's nodes use. The completion event stays with the eager launches (one
            // recorded inside a capture would be a captured node, not this launch's end).
            stream.retain_all_for_capture(self.resources.as_slice().iter().cloned());
            // SAFETY: as below.
            return unsafe { cu!(cuGraphLaunch(self.raw, stream.as_raw())) };
        }
        // SAFETY: live exec and stream; the exec keeps alive what its nodes use; no other
        // call on the exec runs (the lock).
        unsafe { cu!(cuGraphLaunch(self.raw, stream.as_raw())) }?;
        match completion.as_ref() {
            Some(event) => event.record(stream),
            None => Ok(()),
        }
    }

    /// Waits until every launch of this exec so far has finished (one event, not the whole
    /// context). Returns at once if it was never launched.
    ///
    /// Wraps [`cuEventSynchronize`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
    /// on the event recorded after the last launch.
    /// Errors: [`Error::Driver`], including a fault of the launched work.
    pub fn synchronize(&self) -> Result<()> {
        let completion = self
            .completion
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match completion.as_ref() {
            Some(event) => event.synchronize(),
            None => Ok(()),
        }
    }

    /// The node of the instantiated graph that `node` stands for: itself, or its pair if it
    /// belongs to a graph this exec was updated to.
    fn resolve(&mut self, node: NodeId) -> Result<CUgraphNode> {
        self.prune_aliases();
        while let Some(graph) = self.pending_alias.first().cloned() {
            let typed = |g: &OwnedGraph| {
                g.locked(|| {
                    crate::graph::raw_nodes(g.raw())?
                        .into_iter()
                        .map(|n| Ok((n, crate::graph::raw_node_type(n)?)))
                        .collect::<Result<Vec<_>>>()
                })
            };
            let (ours, theirs) = (typed(&self.origin)?, typed(&graph)?);
            self.pending_alias.remove(0);
            if ours.len() == theirs.len() && ours.iter().zip(&theirs).all(|(a, b)| a.1 == b.1) {
                let pairs: Vec<(CUgraphNode, CUgraphNode)> = ours
                    .iter()
                    .zip(&theirs)
                    .filter(|(a, b)| a.0 != b.0)
                    .map(|(a, b)| (b.0, a.0))
                    .collect();
                self.aliases.extend(pairs.iter().copied());
                self.alias_graphs
                    .push((graph, pairs.into_iter().map(|(b, _)| b).collect()));
            }
        }
        let raw = self.aliases.get(&node.0).copied().unwrap_or(node.0);
        // A node of neither graph (another graph's, or a dropped one's) never reaches the
        // driver, which would read freed memory.
        self.origin.check_nodes(&[raw])?;
        self.ctx.ensure_current()?;
        Ok(raw)
    }

    /// Forgets the graphs of earlier updates (and their mapped handles) that only this exec
    /// still holds: their `Graph` is gone, so their handles are no longer valid anyway, and an
    /// exec updated from a fresh graph every step keeps no more than the live ones (and the
    /// latest).
    fn prune_aliases(&mut self) {
        self.pending_alias.retain(|g| Arc::strong_count(g) > 1);
        let aliases = &mut self.aliases;
        self.alias_graphs.retain(|(g, keys)| {
            let live = Arc::strong_count(g) > 1;
            if !live {
                for k in keys {
                    aliases.remove(k);
                }
            }
            live
        });
    }

    /// The raw handle; valid while this exec lives.
    pub fn as_raw(&self) -> CUgraphExec {
        self.raw
    }

    /// The context it belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Keeps `resource` alive for as long as this exec (used by updates that install new
    /// memory or modules).
    pub fn keep_alive(&mut self, resource: Resource) {
        self.resources.insert(resource);
    }

    /// Everything this exec keeps alive.
    pub fn resources(&self) -> &[Resource] {
        self.resources.as_slice()
    }

    /// Keeps alive every resource in `more` that this exec does not hold yet.
    ///
    /// Old resources are never dropped by updates: a launch enqueued before the update may
    /// still use them, and dropping them would need a device synchronize. The list grows only
    /// by resources it does not already hold (compared by address).
    fn absorb(&mut self, more: impl IntoIterator<Item = Resource>) {
        self.resources.extend(more);
    }

    /// Updates the exec in place to `graph`'s parameters; later launches use them, launches
    /// already enqueued are unaffected.
    ///
    /// `graph` must have the same topology as the graph this exec was made from (same nodes
    /// of the same kinds, edges in the same order), e.g. the same building code run with
    /// other arguments. On success the exec also keeps `graph`'s resources alive, and still
    /// the old ones: a launch enqueued before the update may use them.
    ///
    /// The driver resolves node handles only through the graph the exec was instantiated
    /// from (it refuses handles of `graph` with `CUDA_ERROR_INVALID_VALUE`, seen on the H200
    /// with driver 13.0); the per-node setters translate them, so both graphs' handles work
    /// afterwards (see [node handles](Self#node-handles)).
    ///
    /// Wraps [`cuGraphExecUpdate`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Update`] with the driver's reason and the node it blamed, the exec
    /// unchanged; [`Error::Driver`] from making the context current.
    pub fn update(&mut self, graph: &Graph) -> Result<()> {
        let mut info = cuda_graph_sys::CUgraphExecUpdateResultInfo {
            result: cuda_graph_sys::CUgraphExecUpdateResult(0),
            errorNode: std::ptr::null_mut(),
            errorFromNode: std::ptr::null_mut(),
        };
        self.ctx.bind()?;
        let update = cuda_graph_sys::driver()?.cuGraphExecUpdate()?;
        // SAFETY: live exec and graph, valid out-pointer; under the new graph's lock (as
        // instantiation) and the exec's own: no launch or setter of it runs meanwhile.
        let rc = graph
            .owner()
            .locked(|| unsafe { update(self.raw, graph.as_raw(), &mut info) });
        let reason = UpdateReason::from_raw(info.result);
        if rc != cuda_graph_sys::CUresult::CUDA_SUCCESS || reason.is_some() {
            return Err(Error::Update {
                source: Box::new(Error::driver("cuGraphExecUpdate", rc)),
                reason: reason.unwrap_or(UpdateReason::Error),
                node: NodeId(info.errorNode),
            });
        }
        self.absorb(graph.resources().iter().cloned());
        let owner = graph.owner();
        let known = Arc::ptr_eq(owner, &self.origin)
            || self.pending_alias.iter().any(|g| Arc::ptr_eq(g, owner))
            || self.alias_graphs.iter().any(|(g, _)| Arc::ptr_eq(g, owner));
        if !known {
            self.pending_alias.push(owner.clone());
        }
        self.latest = Some(owner.clone());
        self.prune_aliases();
        Ok(())
    }

    /// Updates to `graph`, or, when the driver refuses the update for a structural reason
    /// ([`UpdateReason::reinstantiate_helps`]), replaces this exec with a fresh instantiation
    /// of `graph` with `flags` (the old exec is dropped, which waits for its own last
    /// launch). Either way, per-node setters then take `graph`'s node handles (see
    /// [node handles](Self#node-handles)).
    ///
    /// Errors, all leaving the exec unchanged: [`Error::Update`] for a reason a fresh
    /// instantiation cannot fix ([`UpdateReason::Error`], unknown reasons); those of
    /// [`GraphExec::instantiate`] when the replacement fails (it refuses `UPLOAD` in
    /// `flags`); [`Error::Driver`] from making the context current.
    pub fn update_or_reinstantiate(
        &mut self,
        graph: &Graph,
        flags: InstantiateFlags,
    ) -> Result<UpdateOutcome> {
        match self.update(graph) {
            Ok(()) => Ok(UpdateOutcome::Updated),
            Err(Error::Update { reason, .. }) if reason.reinstantiate_helps() => {
                let fresh = GraphExec::instantiate(graph, flags)?;
                // The old exec is dropped here: it waits for its own launches only.
                *self = fresh;
                Ok(UpdateOutcome::Reinstantiated)
            }
            Err(e) => Err(e),
        }
    }

    /// Changes a kernel node's function, grid, block, shared memory and arguments for later
    /// launches. The kernel must be of the same context. The exec keeps the kernel's module
    /// and the new buffers alive. `config.attributes` are ignored (attributes cannot be
    /// changed per exec).
    ///
    /// Wraps [`cuGraphExecKernelNodeSetParams`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the argument sizes do not match the kernel's
    /// parameters (nothing is changed); [`Error::Driver`] when the driver refuses the change.
    ///
    /// # Safety
    /// As [`crate::Stream::launch`]: the arguments must be what the kernel expects and it
    /// must stay inside the buffers it is given.
    pub unsafe fn set_kernel_params(
        &mut self,
        node: &KernelNode,
        kernel: &Kernel,
        config: &LaunchConfig,
        args: &KernelArgs<'_>,
    ) -> Result<()> {
        let params = kernel_params(kernel, config, args)?;
        let node = self.resolve(node.id())?;
        self.ctx.bind()?;
        // SAFETY: live exec; the params point at argument values borrowed for the call.
        self.origin
            .locked(|| unsafe { cu!(cuGraphExecKernelNodeSetParams(self.raw, node, &params)) })?;
        self.absorb(std::iter::once(kernel.module_resource()).chain(args.resources()));
        Ok(())
    }

    /// Changes a memcpy node's buffers (1-D device-to-device, same length as each other; the
    /// node's original devices and context must stay the same).
    ///
    /// Wraps [`cuGraphExecMemcpyNodeSetParams`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::InvalidArgument`] when the lengths differ or the buffers are empty;
    /// [`Error::Driver`] when the driver refuses the change.
    pub fn set_memcpy_params<T: DeviceRepr>(
        &mut self,
        node: &MemcpyNode,
        dst: &DeviceBuffer<T>,
        src: &DeviceBuffer<T>,
    ) -> Result<()> {
        let bytes = copy_bytes(dst, src)?;
        let params = memcpy_d2d(dst.as_raw(), src.as_raw(), bytes);
        let node = self.resolve(node.id())?;
        self.ctx.bind()?;
        // SAFETY: live exec and context; both ranges live, kept alive below.
        self.origin.locked(|| unsafe {
            cu!(cuGraphExecMemcpyNodeSetParams(
                self.raw,
                node,
                &params,
                self.ctx.as_raw()
            ))
        })?;
        self.absorb([dst.resource(), src.resource()]);
        Ok(())
    }

    /// Changes a memset node's buffer and value (1-D, same context).
    ///
    /// Wraps [`cuGraphExecMemsetNodeSetParams`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::InvalidArgument`] when `dst` is empty or its size is not a multiple
    /// of the value's width; [`Error::Driver`] when the driver refuses the change (it may
    /// refuse a different element size).
    pub fn set_memset_params<T: DeviceRepr>(
        &mut self,
        node: &MemsetNode,
        dst: &DeviceBuffer<T>,
        value: MemsetValue,
    ) -> Result<()> {
        let params = memset_params(dst, value)?;
        let node = self.resolve(node.id())?;
        self.ctx.bind()?;
        // SAFETY: live exec and context; dst live, kept alive below.
        self.origin.locked(|| unsafe {
            cu!(cuGraphExecMemsetNodeSetParams(
                self.raw,
                node,
                &params,
                self.ctx.as_raw()
            ))
        })?;
        self.absorb([dst.resource()]);
        Ok(())
    }

    /// Replaces a host node's closure for later launches. Returns the node's handle carrying
    /// the new closure's panic count.
    ///
    /// Wraps [`cuGraphExecHostNodeSetParams`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`].
    pub fn set_host_callback(
        &mut self,
        node: &HostNode,
        f: impl FnMut() + Send + 'static,
    ) -> Result<HostNode> {
        let cb = Arc::new(HostCallback::new(f));
        let params = host_params(&cb);
        let raw = self.resolve(node.id())?;
        // SAFETY: live exec; the callback stays alive while the exec holds `cb`.
        self.origin
            .locked(|| unsafe { cu!(cuGraphExecHostNodeSetParams(self.raw, raw, &params)) })?;
        self.resources.insert(cb.clone());
        Ok(HostNode {
            id: node.id(),
            callback: cb,
        })
    }

    /// Replaces a child graph node's graph; `child` must have the child's topology. The exec
    /// keeps `child`'s resources.
    ///
    /// Wraps [`cuGraphExecChildGraphNodeSetParams`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`], also for a `child` of another topology.
    pub fn set_child_graph(&mut self, node: &ChildGraphNode, child: &Graph) -> Result<()> {
        let node = self.resolve(node.id())?;
        // SAFETY: live exec and graph.
        self.origin.locked(|| unsafe {
            cu!(cuGraphExecChildGraphNodeSetParams(
                self.raw,
                node,
                child.as_raw()
            ))
        })?;
        self.absorb(child.resources().iter().cloned());
        Ok(())
    }

    /// Makes an event record node record `event` in later launches; the exec keeps it alive.
    ///
    /// Wraps [`cuGraphExecEventRecordNodeSetEvent`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`].
    pub fn set_event_record_event(
        &mut self,
        node: &EventRecordNode,
        event: &Arc<Event>,
    ) -> Result<()> {
        let node = self.resolve(node.id())?;
        // SAFETY: live exec and event.
        self.origin.locked(|| unsafe {
            cu!(cuGraphExecEventRecordNodeSetEvent(
                self.raw,
                node,
                event.as_raw()
            ))
        })?;
        self.absorb([event.clone() as Resource]);
        Ok(())
    }

    /// Makes an event wait node wait for `event` in later launches; the exec keeps it alive.
    ///
    /// Wraps [`cuGraphExecEventWaitNodeSetEvent`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`].
    pub fn set_event_wait_event(&mut self, node: &EventWaitNode, event: &Arc<Event>) -> Result<()> {
        let node = self.resolve(node.id())?;
        // SAFETY: live exec and event.
        self.origin.locked(|| unsafe {
            cu!(cuGraphExecEventWaitNodeSetEvent(
                self.raw,
                node,
                event.as_raw()
            ))
        })?;
        self.absorb([event.clone() as Resource]);
        Ok(())
    }

    /// Enables or disables a kernel, memcpy or memset node for later launches; a disabled
    /// node does nothing but still orders its dependents.
    ///
    /// Wraps [`cuGraphNodeSetEnabled`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::InvalidArgument`] for other kinds, without a driver call;
    /// [`Error::Driver`].
    pub fn set_node_enabled(&mut self, node: impl Into<Node>, enabled: bool) -> Result<()> {
        let node = check_toggle(node.into())?;
        let raw = self.resolve(node.id)?;
        // SAFETY: live exec.
        self.origin
            .locked(|| unsafe { cu!(cuGraphNodeSetEnabled(self.raw, raw, enabled as u32)) })
    }

    /// Whether a kernel, memcpy or memset node is enabled.
    ///
    /// Wraps [`cuGraphNodeGetEnabled`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::InvalidArgument`] for other kinds, without a driver call;
    /// [`Error::Driver`].
    pub fn node_enabled(&mut self, node: impl Into<Node>) -> Result<bool> {
        let node = check_toggle(node.into())?;
        let raw = self.resolve(node.id)?;
        let mut on = 0u32;
        // SAFETY: live exec, valid out-pointer.
        self.origin
            .locked(|| unsafe { cu!(cuGraphNodeGetEnabled(self.raw, raw, &mut on)) })?;
        Ok(on != 0)
    }
}

fn check_toggle(node: Node) -> Result<Node> {
    if node.kind.can_be_disabled() {
        Ok(node)
    } else {
        Err(Error::invalid(format!(
            "only kernel, memcpy and memset nodes can be enabled or disabled, not {:?}",
            node.kind
        )))
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        // A launch may still be running on any stream, and stream-ordered frees of the
        // resources would not be ordered after it: wait for this exec's last launch first.
        // If the wait fails, leak what the exec holds rather than free it under the device.
        if !self.resources.is_empty() && self.synchronize().is_err() {
            std::mem::forget(std::mem::take(&mut self.resources));
        }
        if let Ok(destroy) = cuda_graph_sys::driver().and_then(|d| d.cuGraphExecDestroy()) {
            // SAFETY: owned exec, destroyed once; the driver defers destruction until a
            // running launch completes.
            unsafe { destroy(self.raw) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::NodeKind;
    use cuda_graph_sys::CUgraphExecUpdateResult as R;

    #[test]
    fn update_reasons_map_from_driver_values() {
        assert_eq!(
            UpdateReason::from_raw(R::CU_GRAPH_EXEC_UPDATE_SUCCESS),
            None
        );
        assert_eq!(
            UpdateReason::from_raw(R::CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED),
            Some(UpdateReason::TopologyChanged)
        );
        assert_eq!(
            UpdateReason::from_raw(R::CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED),
            Some(UpdateReason::NodeTypeChanged)
        );
        assert_eq!(
            UpdateReason::from_raw(R::CU_GRAPH_EXEC_UPDATE_ERROR_UNSUPPORTED_FUNCTION_CHANGE),
            Some(UpdateReason::UnsupportedFunctionChange)
        );
        assert_eq!(
            UpdateReason::from_raw(R::CU_GRAPH_EXEC_UPDATE_ERROR_ATTRIBUTES_CHANGED),
            Some(UpdateReason::AttributesChanged)
        );
        assert_eq!(
            UpdateReason::from_raw(R(42)),
            Some(UpdateReason::Unknown(42))
        );
    }

    #[test]
    fn reinstantiation_only_for_structural_reasons() {
        assert!(UpdateReason::TopologyChanged.reinstantiate_helps());
        assert!(UpdateReason::NodeTypeChanged.reinstantiate_helps());
        assert!(UpdateReason::NotSupported.reinstantiate_helps());
        assert!(UpdateReason::ParametersChanged.reinstantiate_helps());
        assert!(!UpdateReason::Error.reinstantiate_helps());
        assert!(!UpdateReason::Unknown(9).reinstantiate_helps());
    }

    #[test]
    fn enabling_is_refused_for_other_kinds_before_the_driver() {
        let host = Node {
            id: NodeId(std::ptr::null_mut()),
            kind: NodeKind::Host,
        };
        assert!(matches!(check_toggle(host), Err(Error::InvalidArgument(_))));
        let k = Node {
            id: NodeId(std::ptr::null_mut()),
            kind: NodeKind::Kernel,
        };
        assert!(check_toggle(k).is_ok());
    }

    #[test]
    fn update_error_names_reason_and_node() {
        let e = Error::Update {
            source: Box::new(Error::Driver {
                call: "cuGraphExecUpdate",
                code: cuda_graph_sys::CUresult(910),
                name: "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
                message: "the graph update was not performed",
            }),
            reason: UpdateReason::TopologyChanged,
            node: NodeId(std::ptr::null_mut()),
        };
        let s = e.to_string();
        assert!(s.contains("TopologyChanged") && s.contains("910"), "{s}");
    }
}
