//! Graph definitions: ownership, the resources their nodes keep alive, explicit building
//! with typed nodes and edges, queries, clone and DOT export.

use std::collections::HashSet;
use std::ffi::CString;
use std::path::Path;
use std::sync::{Arc, Mutex};

use cuda_graph_sys::{
    CUDA_HOST_NODE_PARAMS, CUDA_KERNEL_NODE_PARAMS_v2, CUDA_MEM_ALLOC_NODE_PARAMS, CUDA_MEMCPY3D,
    CUDA_MEMSET_NODE_PARAMS, CUdeviceptr, CUfunction, CUgraph, CUgraphEdgeData, CUgraphNode,
    CUmemAllocationType, CUmemLocationType, CUmemorytype,
};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::ids::NodeId;
use crate::launch::{KernelArgs, LaunchConfig};
use crate::memory::{DeviceBuffer, DeviceRepr};
use crate::module::Kernel;
use crate::node::{
    ChildGraphNode, Edge, EdgeKind, EmptyNode, EventRecordNode, EventWaitNode, HostCallback,
    HostNode, KernelNode, MemAllocNode, MemFreeNode, MemcpyNode, MemsetNode, MemsetValue, Node,
    NodeKind, host_trampoline,
};
use crate::resources::{Resource, ResourceSet};

/// A CUDA graph definition, owned; destroyed on drop.
///
/// Nodes added through the safe API (captured or explicit) register what they use, and the
/// graph holds it; an exec instantiated from the graph takes a copy of that list.
#[derive(Debug)]
pub struct Graph {
    raw: CUgraph,
    /// Destroys `raw` when the last holder goes: the graph itself and every exec made from
    /// it, because the driver's per-node exec setters look nodes up through the graph they
    /// came from (seen on the H200: with the graph destroyed, they return INVALID_VALUE).
    owner: Arc<OwnedGraph>,
    ctx: Arc<Context>,
    resources: ResourceSet,
}

/// The destroy-on-drop part of a [`Graph`], shared with execs (as a [`Resource`] and typed),
/// and the lock that serializes the driver calls on the graph object: the `Graph`'s own
/// (which edit or read it) and those of execs made from it (per-node setters look their node
/// handles up through it), which may run on other threads.
#[derive(Debug)]
pub(crate) struct OwnedGraph {
    raw: CUgraph,
    lock: Mutex<()>,
    /// Addresses of nodes known to be in the graph (those this crate added, then all of them
    /// as the driver lists them when a handle is not found): what node handles are checked
    /// against before they reach the driver (`check_nodes`).
    known: Mutex<HashSet<usize>>,
}

// SAFETY: the graph handle is only used by `Drop` (by whoever drops the last `Arc`, when no
// other holder is left; `cuGraphDestroy` is not tied to a thread) and, through `locked`, by
// calls serialized by the mutex.
unsafe impl Send for OwnedGraph {}
// SAFETY: the only `&self` access to the graph object goes through `locked`, which holds the
// mutex for the call: calls on the graph object never overlap, as the driver requires.
unsafe impl Sync for OwnedGraph {}

impl OwnedGraph {
    /// Runs `f` (driver calls on the graph object, or on nodes looked up through it) with
    /// the graph's lock held. Never nest: `f` must not call `locked` on the same graph.
    pub(crate) fn locked<R>(&self, f: impl FnOnce() -> R) -> R {
        // A poisoned lock only means a panic while another call held it; the graph object
        // is the driver's, not ours, so keep going.
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        f()
    }

    /// The graph handle.
    pub(crate) fn raw(&self) -> CUgraph {
        self.raw
    }

    /// Notes a node this crate just added to the graph.
    pub(crate) fn note_node(&self, node: CUgraphNode) {
        self.known
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node as usize);
    }

    /// Checks that every one of `nodes` is a node of this graph, so that the driver is never
    /// handed a handle of another graph, or of one that was destroyed (it would read freed
    /// memory). A handle not seen yet makes the graph's nodes be listed again (nodes added by
    /// captures into it). Not inside `locked` (it takes the lock to list the nodes).
    ///
    /// Errors: [`Error::InvalidArgument`] naming the first stranger; those of listing.
    pub(crate) fn check_nodes(&self, nodes: &[CUgraphNode]) -> Result<()> {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        if nodes.iter().all(|n| known.contains(&(*n as usize))) {
            return Ok(());
        }
        let all = self.locked(|| raw_nodes(self.raw))?;
        known.clear();
        known.extend(all.into_iter().map(|n| n as usize));
        match nodes.iter().find(|n| !known.contains(&(**n as usize))) {
            None => Ok(()),
            Some(n) => Err(Error::invalid(format!(
                "node {n:?} is not a node of this graph (a handle of another graph, of a \
                 clone's original, or of a graph that was dropped)"
            ))),
        }
    }
}

impl Drop for OwnedGraph {
    fn drop(&mut self) {
        if let Ok(destroy) = cuda_graph_sys::driver().and_then(|d| d.cuGraphDestroy()) {
            // SAFETY: owned graph, destroyed once; execs made from it are independent of
            // its destruction (they only keep it for node lookups).
            unsafe { destroy(self.raw) };
        }
    }
}

// SAFETY: a graph object is not tied to a thread; what the driver asks is that calls on one
// graph object never overlap ("not internally synchronized",
// https://docs.nvidia.com/cuda/cuda-driver-api/graphs-thread-safety.html). `Graph` is
// therefore `Send` but not `Sync`: its methods, which take `&mut self` or `&self`, run on one
// thread at a time. (Execs instantiated from it keep the graph object for node lookups; see
// the note at `GraphExec`'s `Send`.)
unsafe impl Send for Graph {}

impl Graph {
    /// An empty graph.
    ///
    /// Wraps [`cuGraphCreate`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`] (also from making `ctx` current).
    pub fn new(ctx: &Arc<Context>) -> Result<Graph> {
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; flags must be 0.
        unsafe { cu!(cuGraphCreate(&mut raw, 0)) }?;
        // SAFETY: just created, owned by nobody else.
        Ok(unsafe { Graph::from_raw(ctx, raw) })
    }

    /// Takes ownership of a raw graph (destroyed on drop).
    ///
    /// # Safety
    /// `raw` must be a live graph of `ctx` that nothing else destroys. Memory and modules its
    /// nodes use are not kept alive unless registered with [`Graph::keep_alive`].
    pub unsafe fn from_raw(ctx: &Arc<Context>, raw: CUgraph) -> Graph {
        Graph {
            raw,
            owner: Arc::new(OwnedGraph {
                raw,
                lock: Mutex::new(()),
                known: Mutex::new(HashSet::new()),
            }),
            ctx: ctx.clone(),
            resources: ResourceSet::default(),
        }
    }

    /// The raw handle; valid while this graph lives.
    pub fn as_raw(&self) -> CUgraph {
        self.raw
    }

    /// The context it belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Keeps `resource` alive for as long as this graph and execs made from it.
    pub fn keep_alive(&mut self, resource: Resource) {
        self.resources.insert(resource);
    }

    /// Everything this graph keeps alive.
    pub fn resources(&self) -> &[Resource] {
        self.resources.as_slice()
    }

    /// The shared graph object and its lock (see [`OwnedGraph`]).
    pub(crate) fn owner(&self) -> &Arc<OwnedGraph> {
        &self.owner
    }
}

/// The nodes of a live graph, in creation order (`cuGraphGetNodes`).
pub(crate) fn raw_nodes(graph: CUgraph) -> Result<Vec<CUgraphNode>> {
    // SAFETY: a live graph; the array (null or with room for `*n` nodes) and count are valid.
    node_list(|nodes, n| unsafe { cu!(cuGraphGetNodes(graph, nodes, n)) })
}

/// A node list the driver fills with the count-then-fill protocol of `cuGraphGetNodes` and
/// `cuGraphGetRootNodes`: `get(null, &mut n)` asks for the count, `get(array, &mut n)` fills.
fn node_list(
    mut get: impl FnMut(*mut CUgraphNode, &mut usize) -> Result<()>,
) -> Result<Vec<CUgraphNode>> {
    let mut n = 0usize;
    get(std::ptr::null_mut(), &mut n)?;
    // The driver refuses a zero-length array, so an empty answer ends here.
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut raw = vec![std::ptr::null_mut(); n];
    get(raw.as_mut_ptr(), &mut n)?;
    raw.truncate(n);
    Ok(raw)
}

/// The driver's type of a live node.
pub(crate) fn raw_node_type(node: CUgraphNode) -> Result<cuda_graph_sys::CUgraphNodeType> {
    let mut t = cuda_graph_sys::CUgraphNodeType(0);
    // SAFETY: a live node, valid out-pointer.
    unsafe { cu!(cuGraphNodeGetType(node, &mut t)) }?;
    Ok(t)
}

/// Kernel node parameters; the argument values are copied by the driver during the call.
pub(crate) fn kernel_params(
    kernel: &Kernel,
    config: &LaunchConfig,
    args: &KernelArgs<'_>,
) -> Result<CUDA_KERNEL_NODE_PARAMS_v2> {
    kernel.check_args(args.sizes())?;
    let (g, b) = (config.grid, config.block);
    Ok(CUDA_KERNEL_NODE_PARAMS_v2 {
        func: kernel.as_raw(),
        gridDimX: g.0,
        gridDimY: g.1,
        gridDimZ: g.2,
        blockDimX: b.0,
        blockDimY: b.1,
        blockDimZ: b.2,
        sharedMemBytes: config.shared_mem_bytes,
        kernelParams: args.as_param_array(),
        ..Default::default()
    })
}

/// A 1-D device-to-device copy of `bytes` bytes.
pub(crate) fn memcpy_d2d(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> CUDA_MEMCPY3D {
    CUDA_MEMCPY3D {
        srcMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcDevice: src,
        dstMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstDevice: dst,
        WidthInBytes: bytes,
        Height: 1,
        Depth: 1,
        ..Default::default()
    }
}

/// Checks two buffers for a copy and returns the byte count.
pub(crate) fn copy_bytes<T: DeviceRepr>(
    dst: &DeviceBuffer<T>,
    src: &DeviceBuffer<T>,
) -> Result<usize> {
    if dst.len() != src.len() {
        return Err(Error::invalid(format!(
            "memcpy node: destination has {} elements, source {}",
            dst.len(),
            src.len()
        )));
    }
    if dst.is_empty() {
        return Err(Error::invalid("memcpy node: empty buffers"));
    }
    Ok(dst.bytes())
}

/// 1-D memset parameters over the whole buffer.
pub(crate) fn memset_params<T: DeviceRepr>(
    dst: &DeviceBuffer<T>,
    value: MemsetValue,
) -> Result<CUDA_MEMSET_NODE_PARAMS> {
    let (v, elem) = value.raw();
    let bytes = dst.bytes();
    if bytes == 0 || bytes % elem as usize != 0 {
        return Err(Error::invalid(format!(
            "memset node: {bytes} bytes is not a positive multiple of the {elem}-byte value"
        )));
    }
    Ok(CUDA_MEMSET_NODE_PARAMS {
        dst: dst.as_raw(),
        pitch: bytes,
        value: v,
        elementSize: elem,
        width: bytes / elem as usize,
        height: 1,
    })
}

/// Host node parameters pointing at `cb`, which the caller keeps alive.
pub(crate) fn host_params(cb: &Arc<HostCallback>) -> CUDA_HOST_NODE_PARAMS {
    CUDA_HOST_NODE_PARAMS {
        fn_: Some(host_trampoline),
        userData: Arc::as_ptr(cb).cast_mut().cast(),
    }
}

/// Sets launch attributes on a kernel node of a graph.
fn set_kernel_attributes(node: CUgraphNode, config: &LaunchConfig) -> Result<()> {
    for a in &config.attributes {
        let raw = a.to_raw();
        // SAFETY: live node; the value union is valid for the attribute id it was built for.
        unsafe { cu!(cuGraphKernelNodeSetAttribute(node, raw.id, &raw.value)) }?;
    }
    Ok(())
}

impl Graph {
    /// The handle of a node just added, noted as this graph's.
    fn wrap_node(&self, raw: CUgraphNode) -> NodeId {
        self.owner.note_node(raw);
        NodeId(raw)
    }

    /// The raw handles of `deps`, checked to be nodes of this graph.
    fn raw_deps(&self, deps: &[Node]) -> Result<Vec<CUgraphNode>> {
        let raw: Vec<CUgraphNode> = deps.iter().map(|n| n.id.0).collect();
        self.owner.check_nodes(&raw)?;
        Ok(raw)
    }

    /// Adds a kernel node launching `kernel` with `config` and `args` after `deps`.
    ///
    /// The argument sizes are checked against the kernel's parameters; the driver copies the
    /// argument values, and the graph keeps the kernel's module and the buffers alive.
    /// `config.attributes` become the node's kernel attributes.
    ///
    /// Wraps [`cuGraphAddKernelNode`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html),
    /// and [`cuGraphKernelNodeSetAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
    /// per attribute.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the argument sizes do not match the kernel's parameters
    /// (nothing is added); [`Error::Driver`]. When setting an attribute fails, the node is
    /// already in the graph.
    ///
    /// # Safety
    /// As [`crate::Stream::launch`]: the kernel runs arbitrary device code, so the arguments
    /// must be what it expects, and it must stay inside the buffers it is given, whenever
    /// the graph runs.
    pub unsafe fn add_kernel(
        &mut self,
        deps: &[Node],
        kernel: &Kernel,
        config: &LaunchConfig,
        args: &KernelArgs<'_>,
    ) -> Result<KernelNode> {
        let params = kernel_params(kernel, config, args)?;
        let deps = self.raw_deps(deps)?;
        self.ctx.bind()?;
        let mut node = std::ptr::null_mut();
        // SAFETY: live graph, dependency array of deps.len() nodes, params valid for the call
        // (argument values borrowed by `args`).
        self.owner.locked(|| unsafe {
            cu!(cuGraphAddKernelNode(
                &mut node,
                self.raw,
                deps.as_ptr(),
                deps.len(),
                &params
            ))
        })?;
        self.keep_alive(kernel.module_resource());
        for r in args.resources() {
            self.keep_alive(r);
        }
        self.owner.locked(|| set_kernel_attributes(node, config))?;
        Ok(KernelNode(self.wrap_node(node)))
    }

    /// Adds a 1-D device-to-device copy of all of `src` into `dst` (same length) after `deps`.
    ///
    /// Wraps [`cuGraphAddMemcpyNode`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::InvalidArgument`] when the lengths differ or the buffers are empty;
    /// [`Error::Driver`].
    pub fn add_memcpy<T: DeviceRepr>(
        &mut self,
        deps: &[Node],
        dst: &DeviceBuffer<T>,
        src: &DeviceBuffer<T>,
    ) -> Result<MemcpyNode> {
        let bytes = copy_bytes(dst, src)?;
        let params = memcpy_d2d(dst.as_raw(), src.as_raw(), bytes);
        let deps = self.raw_deps(deps)?;
        self.ctx.bind()?;
        let mut node = std::ptr::null_mut();
        // SAFETY: live graph and context; both ranges are live allocations of `bytes`, kept
        // alive below.
        self.owner.locked(|| unsafe {
            cu!(cuGraphAddMemcpyNode(
                &mut node,
                self.raw,
                deps.as_ptr(),
                deps.len(),
                &params,
                self.ctx.as_raw()
            ))
        })?;
        self.keep_alive(dst.resource());
        self.keep_alive(src.resource());
        Ok(MemcpyNode(self.wrap_node(node)))
    }

    /// Adds a memset of all of `dst` to `value` (1, 2 or 4 bytes wide; the buffer's size must
    /// be a multiple of it) after `deps`.
    ///
    /// Wraps [`cuGraphAddMemsetNode`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::InvalidArgument`] when `dst` is empty or its size is not a multiple
    /// of the value's width; [`Error::Driver`].
    pub fn add_memset<T: DeviceRepr>(
        &mut self,
        deps: &[Node],
        dst: &DeviceBuffer<T>,
        value: MemsetValue,
    ) -> Result<MemsetNode> {
        let params = memset_params(dst, value)?;
        let deps = self.raw_deps(deps)?;
        self.ctx.bind()?;
        let mut node = std::ptr::null_mut();
        // SAFETY: live graph and context; dst is a live allocation covered by the params,
        // kept alive below.
        self.owner.locked(|| unsafe {
            cu!(cuGraphAddMemsetNode(
                &mut node,
                self.raw,
                deps.as_ptr(),
                deps.len(),
                &params,
                self.ctx.as_raw()
            ))
        })?;
        self.keep_alive(dst.resource());
        Ok(MemsetNode(self.wrap_node(node)))
    }

    /// Adds a node calling `f` on a driver thread after `deps`.
    ///
    /// The closure is kept alive by the graph (and by execs and clones). It must not call
    /// CUDA driver functions (the driver forbids it in host nodes). Calls never overlap (a
    /// mutex guards the closure). A panic is caught and counted ([`HostNode::panic_count`]);
    /// the graph continues as if the callback returned.
    ///
    /// Wraps [`cuGraphAddHostNode`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`].
    pub fn add_host(
        &mut self,
        deps: &[Node],
        f: impl FnMut() + Send + 'static,
    ) -> Result<HostNode> {
        let cb = Arc::new(HostCallback::new(f));
        let params = host_params(&cb);
        let deps = self.raw_deps(deps)?;
        let mut node = std::ptr::null_mut();
        // SAFETY: live graph; the callback pointer stays valid while the graph keeps `cb`.
        self.owner.locked(|| unsafe {
            cu!(cuGraphAddHostNode(
                &mut node,
                self.raw,
                deps.as_ptr(),
                deps.len(),
                &params
            ))
        })?;
        self.keep_alive(cb.clone());
        Ok(HostNode {
            id: self.wrap_node(node),
            callback: cb,
        })
    }

    /// Adds a node that records `event` when `deps` complete. The graph keeps the event alive.
    ///
    /// Wraps [`cuGraphAddEventRecordNode`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`].
    pub fn add_event_record(
        &mut self,
        deps: &[Node],
        event: &Arc<Event>,
    ) -> Result<EventRecordNode> {
        let deps = self.raw_deps(deps)?;
        let mut node = std::ptr::null_mut();
        // SAFETY: live graph and event (kept alive below).
        self.owner.locked(|| unsafe {
            cu!(cuGraphAddEventRecordNode(
                &mut node,
                self.raw,
                deps.as_ptr(),
                deps.len(),
                event.as_raw()
            ))
        })?;
        self.keep_alive(event.clone());
        Ok(EventRecordNode(self.wrap_node(node)))
    }

    /// Adds a node that waits for `event` (its most recent record at the time the graph is
    /// launched) after `deps`. The graph keeps the event alive.
    ///
    /// Wraps [`cuGraphAddEventWaitNode`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`].
    pub fn add_event_wait(&mut self, deps: &[Node], event: &Arc<Event>) -> Result<EventWaitNode> {
        let deps = self.raw_deps(deps)?;
        let mut node = std::ptr::null_mut();
        // SAFETY: live graph and event (kept alive below).
        self.owner.locked(|| unsafe {
            cu!(cuGraphAddEventWaitNode(
                &mut node,
                self.raw,
                deps.as_ptr(),
                deps.len(),
                event.as_raw()
            ))
        })?;
        self.keep_alive(event.clone());
        Ok(EventWaitNode(self.wrap_node(node)))
    }

    /// Adds a no-op node, to join or fan out dependencies.
    ///
    /// Wraps [`cuGraphAddEmptyNode`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`].
    pub fn add_empty(&mut self, deps: &[Node]) -> Result<EmptyNode> {
        let deps = self.raw_deps(deps)?;
        let mut node = std::ptr::null_mut();
        // SAFETY: live graph, valid dependency array.
        self.owner.locked(|| unsafe {
            cu!(cuGraphAddEmptyNode(
                &mut node,
                self.raw,
                deps.as_ptr(),
                deps.len()
            ))
        })?;
        Ok(EmptyNode(self.wrap_node(node)))
    }

    /// Adds a node running a copy of `child` after `deps` (the driver clones it; later
    /// changes to `child` do not affect this graph). This graph keeps `child`'s resources.
    ///
    /// Wraps [`cuGraphAddChildGraphNode`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`], also for a child holding memory alloc/free or conditional
    /// nodes, which the driver refuses.
    pub fn add_child_graph(&mut self, deps: &[Node], child: &Graph) -> Result<ChildGraphNode> {
        let deps = self.raw_deps(deps)?;
        let mut node = std::ptr::null_mut();
        // SAFETY: live graphs, valid dependency array; the child is cloned by the driver.
        self.owner.locked(|| unsafe {
            cu!(cuGraphAddChildGraphNode(
                &mut node,
                self.raw,
                deps.as_ptr(),
                deps.len(),
                child.raw
            ))
        })?;
        self.resources.extend(child.resources().iter().cloned());
        Ok(ChildGraphNode(self.wrap_node(node)))
    }

    /// Adds a graph memory allocation of `bytes` on the context's device after `deps` and
    /// returns the node with its device address, fixed for the graph's life.
    ///
    /// The memory is valid for nodes ordered after this one and before its
    /// [`Graph::add_mem_free`] node (or, without one, until freed by the user; see
    /// `InstantiateFlags::AUTO_FREE_ON_LAUNCH`). A graph holding memory nodes cannot be
    /// cloned ([`Graph::try_clone`] fails with error 801), used as a child graph, or
    /// instantiated more than once at a time.
    ///
    /// Wraps [`cuGraphAddMemAllocNode`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::InvalidArgument`] for 0 bytes; [`Error::Driver`] (also from making the
    /// context current).
    pub fn add_mem_alloc(&mut self, deps: &[Node], bytes: usize) -> Result<MemAllocNode> {
        if bytes == 0 {
            return Err(Error::invalid("mem alloc node of 0 bytes"));
        }
        let mut params = CUDA_MEM_ALLOC_NODE_PARAMS {
            bytesize: bytes,
            ..Default::default()
        };
        params.poolProps.allocType = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        params.poolProps.location.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        params.poolProps.location.id = self.ctx.device().as_raw();
        let deps = self.raw_deps(deps)?;
        self.ctx.bind()?;
        let mut node = std::ptr::null_mut();
        // SAFETY: live graph, valid params (no access descriptors); the driver writes dptr.
        self.owner.locked(|| unsafe {
            cu!(cuGraphAddMemAllocNode(
                &mut node,
                self.raw,
                deps.as_ptr(),
                deps.len(),
                &mut params
            ))
        })?;
        Ok(MemAllocNode {
            id: self.wrap_node(node),
            ptr: params.dptr,
            bytes,
        })
    }

    /// Adds a node freeing graph memory at `ptr` (from [`Graph::add_mem_alloc`] of this graph,
    /// which must be among its ancestors) after `deps`.
    ///
    /// Wraps [`cuGraphAddMemFreeNode`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`] (e.g. `ptr` not allocated by a memory node of this graph, or
    /// freed twice).
    pub fn add_mem_free(&mut self, deps: &[Node], ptr: CUdeviceptr) -> Result<MemFreeNode> {
        let deps = self.raw_deps(deps)?;
        let mut node = std::ptr::null_mut();
        // SAFETY: live graph, valid dependency array; the driver checks `ptr`.
        self.owner.locked(|| unsafe {
            cu!(cuGraphAddMemFreeNode(
                &mut node,
                self.raw,
                deps.as_ptr(),
                deps.len(),
                ptr
            ))
        })?;
        Ok(MemFreeNode(self.wrap_node(node)))
    }

    fn add_edge(&mut self, from: NodeId, to: NodeId, kind: EdgeKind) -> Result<()> {
        self.owner.check_nodes(&[from.0, to.0])?;
        let data: CUgraphEdgeData = kind.to_raw();
        // SAFETY: live graph, one-element arrays.
        self.owner
            .locked(|| unsafe { cu!(cuGraphAddDependencies(self.raw, &from.0, &to.0, &data, 1)) })
    }

    /// Makes `to` depend fully on `from`.
    ///
    /// Wraps [`cuGraphAddDependencies`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`]; [`Error::Load`] on a driver before 12.3, which lacks the ABI
    /// used.
    pub fn add_dependency(&mut self, from: impl Into<Node>, to: impl Into<Node>) -> Result<()> {
        self.add_edge(from.into().id, to.into().id, EdgeKind::Full)
    }

    /// Adds a programmatic edge (programmatic dependent launch, Hopper and newer): `to` may
    /// start before `from` finishes and must wait (`griddepcontrol.wait`,
    /// `cudaGridDependencySynchronize`) before reading `from`'s output.
    ///
    /// Wraps [`cuGraphAddDependencies`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`]; [`Error::Load`] on a driver before 12.3, which lacks the ABI
    /// used.
    pub fn add_programmatic_dependency(
        &mut self,
        from: &KernelNode,
        to: &KernelNode,
    ) -> Result<()> {
        self.add_edge(from.id(), to.id(), EdgeKind::Programmatic)
    }

    /// Adds an edge of any kind.
    ///
    /// Wraps [`cuGraphAddDependencies`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`]; [`Error::Load`] on a driver before 12.3, which lacks the ABI
    /// used.
    pub fn add_dependency_with(&mut self, from: NodeId, to: NodeId, kind: EdgeKind) -> Result<()> {
        self.add_edge(from, to, kind)
    }

    /// Removes the edge `from -> to` of kind `kind` (the edge data must match).
    ///
    /// Wraps [`cuGraphRemoveDependencies`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`] (also when no such edge exists); [`Error::Load`] on a driver
    /// before 12.3, which lacks the ABI used.
    pub fn remove_dependency(&mut self, from: NodeId, to: NodeId, kind: EdgeKind) -> Result<()> {
        self.owner.check_nodes(&[from.0, to.0])?;
        let data = kind.to_raw();
        // SAFETY: live graph, one-element arrays.
        self.owner.locked(|| unsafe {
            cu!(cuGraphRemoveDependencies(
                self.raw, &from.0, &to.0, &data, 1
            ))
        })
    }

    /// Every node, with its kind, in creation order.
    ///
    /// Wraps [`cuGraphGetNodes`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
    /// and [`cuGraphNodeGetType`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`].
    pub fn nodes(&self) -> Result<Vec<Node>> {
        let raw = self.owner.locked(|| raw_nodes(self.raw))?;
        self.typed(raw)
    }

    /// The nodes without dependencies.
    ///
    /// Wraps [`cuGraphGetRootNodes`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
    /// and [`cuGraphNodeGetType`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`].
    pub fn root_nodes(&self) -> Result<Vec<Node>> {
        let raw = self.owner.locked(|| {
            // SAFETY: this live graph; the array (null or with room for `*n` nodes) and
            // count are valid.
            node_list(|nodes, n| unsafe { cu!(cuGraphGetRootNodes(self.raw, nodes, n)) })
        })?;
        self.typed(raw)
    }

    fn typed(&self, raw: Vec<CUgraphNode>) -> Result<Vec<Node>> {
        raw.into_iter()
            .map(|r| {
                let id = NodeId(r);
                Ok(Node {
                    id,
                    kind: self.node_type(id)?,
                })
            })
            .collect()
    }

    /// The function a kernel node of this graph launches
    /// ([`cuGraphKernelNodeGetParams`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)):
    /// compare it with [`Kernel::as_raw`] to find, among the nodes of a captured graph, those
    /// that launch a given kernel (e.g. to update one with
    /// [`GraphExec::set_kernel_params`](crate::GraphExec::set_kernel_params)). Null for a
    /// node that launches a library kernel (`CUkernel`, the node's `kern` field) rather than
    /// a context's function.
    pub fn kernel_function(&self, node: &KernelNode) -> Result<CUfunction> {
        self.owner.check_nodes(&[node.id().0])?;
        let mut params = CUDA_KERNEL_NODE_PARAMS_v2::default();
        // SAFETY: a kernel node of this live graph, valid out-pointer; only `func` is read
        // (the argument array it also returns is owned by the node).
        self.owner
            .locked(|| unsafe { cu!(cuGraphKernelNodeGetParams(node.id().0, &mut params)) })?;
        Ok(params.func)
    }

    /// The grid a kernel node of this graph launches (blocks in x, y, z), from
    /// [`cuGraphKernelNodeGetParams`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html):
    /// e.g. to see how many CTAs a captured persistent kernel was given.
    /// Errors: [`Error::Driver`].
    pub fn kernel_grid(&self, node: &KernelNode) -> Result<(u32, u32, u32)> {
        self.owner.check_nodes(&[node.id().0])?;
        let mut params = CUDA_KERNEL_NODE_PARAMS_v2::default();
        // SAFETY: a kernel node of this live graph, valid out-pointer; only the grid is read.
        self.owner
            .locked(|| unsafe { cu!(cuGraphKernelNodeGetParams(node.id().0, &mut params)) })?;
        Ok((params.gridDimX, params.gridDimY, params.gridDimZ))
    }

    /// The kind of a node of this graph.
    ///
    /// Wraps [`cuGraphNodeGetType`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`].
    pub fn node_type(&self, node: NodeId) -> Result<NodeKind> {
        self.owner.check_nodes(&[node.0])?;
        let mut t = cuda_graph_sys::CUgraphNodeType(0);
        // SAFETY: a node of this live graph, valid out-pointer.
        self.owner
            .locked(|| unsafe { cu!(cuGraphNodeGetType(node.0, &mut t)) })?;
        Ok(NodeKind::from_raw(t))
    }

    /// Every edge with its kind, in the driver's order.
    ///
    /// Wraps [`cuGraphGetEdges`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`]; [`Error::Load`] on a driver before 12.3, which lacks the ABI
    /// used.
    pub fn edges(&self) -> Result<Vec<Edge>> {
        let mut n = 0usize;
        // SAFETY: null arrays ask for the count.
        self.owner.locked(|| unsafe {
            cu!(cuGraphGetEdges(
                self.raw,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut n
            ))
        })?;
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut from = vec![std::ptr::null_mut(); n];
        let mut to = vec![std::ptr::null_mut(); n];
        let mut data = vec![CUgraphEdgeData::default(); n];
        // SAFETY: three arrays with room for n entries each.
        self.owner.locked(|| unsafe {
            cu!(cuGraphGetEdges(
                self.raw,
                from.as_mut_ptr(),
                to.as_mut_ptr(),
                data.as_mut_ptr(),
                &mut n
            ))
        })?;
        Ok((0..n.min(from.len()))
            .map(|i| Edge {
                from: NodeId(from[i]),
                to: NodeId(to[i]),
                kind: EdgeKind::from_raw(&data[i]),
            })
            .collect())
    }

    /// The nodes `node` depends on, with the kind of each edge.
    ///
    /// Wraps [`cuGraphNodeGetDependencies`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`]; [`Error::Load`] on a driver before 12.3, which lacks the ABI
    /// used.
    pub fn dependencies(&self, node: NodeId) -> Result<Vec<(NodeId, EdgeKind)>> {
        self.neighbours(node, true)
    }

    /// The nodes that depend on `node`, with the kind of each edge.
    ///
    /// Wraps [`cuGraphNodeGetDependentNodes`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`]; [`Error::Load`] on a driver before 12.3, which lacks the ABI
    /// used.
    pub fn dependents(&self, node: NodeId) -> Result<Vec<(NodeId, EdgeKind)>> {
        self.neighbours(node, false)
    }

    fn neighbours(&self, node: NodeId, up: bool) -> Result<Vec<(NodeId, EdgeKind)>> {
        self.owner.check_nodes(&[node.0])?;
        let d = cuda_graph_sys::driver()?;
        let (f, call) = if up {
            (
                d.cuGraphNodeGetDependencies()?,
                "cuGraphNodeGetDependencies",
            )
        } else {
            (
                d.cuGraphNodeGetDependentNodes()?,
                "cuGraphNodeGetDependentNodes",
            )
        };
        let mut n = 0usize;
        // SAFETY: a node of this live graph; null arrays ask for the count.
        let rc = self
            .owner
            .locked(|| unsafe { f(node.0, std::ptr::null_mut(), std::ptr::null_mut(), &mut n) });
        crate::error::check(call, rc)?;
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut nodes = vec![std::ptr::null_mut(); n];
        let mut data = vec![CUgraphEdgeData::default(); n];
        // SAFETY: arrays with room for n entries each.
        let rc = self
            .owner
            .locked(|| unsafe { f(node.0, nodes.as_mut_ptr(), data.as_mut_ptr(), &mut n) });
        crate::error::check(call, rc)?;
        Ok((0..n.min(nodes.len()))
            .map(|i| (NodeId(nodes[i]), EdgeKind::from_raw(&data[i])))
            .collect())
    }

    /// A copy of this graph sharing the kept-alive resources. Node handles of this graph are
    /// not valid in the clone.
    ///
    /// Wraps [`cuGraphClone`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::Driver`]; `CUDA_ERROR_NOT_SUPPORTED` (801) for graphs holding memory
    /// alloc/free or conditional nodes.
    pub fn try_clone(&self) -> Result<Graph> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: live graph, valid out-pointer.
        self.owner
            .locked(|| unsafe { cu!(cuGraphClone(&mut raw, self.raw)) })?;
        // SAFETY: just created, owned by nobody else.
        let mut g = unsafe { Graph::from_raw(&self.ctx, raw) };
        g.resources = self.resources.clone();
        Ok(g)
    }

    /// Writes the graph as Graphviz DOT to `path`; `flags` are `CU_GRAPH_DEBUG_DOT_FLAGS_*`
    /// bits (`CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE` = 1 gives everything).
    ///
    /// Wraps [`cuGraphDebugDotPrint`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: [`Error::InvalidArgument`] when `path` is not UTF-8 or contains a NUL byte;
    /// [`Error::Driver`] (e.g. the file cannot be written).
    pub fn to_dot_file(&self, path: &Path, flags: u32) -> Result<()> {
        let s = path
            .to_str()
            .ok_or_else(|| Error::invalid(format!("path {} is not UTF-8", path.display())))?;
        let c = CString::new(s).map_err(|_| Error::invalid("path contains a NUL byte"))?;
        // SAFETY: live graph, NUL-terminated path.
        self.owner
            .locked(|| unsafe { cu!(cuGraphDebugDotPrint(self.raw, c.as_ptr(), flags)) })
    }

    /// The graph as verbose Graphviz DOT text (through a temporary file, as the driver only
    /// writes files).
    ///
    /// Errors: as [`Graph::to_dot_file`]; [`Error::InvalidArgument`] carrying the I/O error
    /// when the file cannot be read back.
    pub fn to_dot_string(&self) -> Result<String> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "cuda-graph-{}-{}.dot",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let written = self.to_dot_file(&path, 1);
        let text = written.and_then(|()| {
            std::fs::read_to_string(&path)
                .map_err(|e| Error::invalid(format!("reading {}: {e}", path.display())))
        });
        let _ = std::fs::remove_file(&path);
        text
    }
}
