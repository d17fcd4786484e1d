//! GPU tests of explicit graph building: typed nodes, edges, queries, clone and DOT export.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cuda_graph::{
    DeviceBuffer, EdgeKind, Error, Event, Graph, GraphExec, InstantiateFlags, KernelNode,
    LaunchConfig, MemsetValue, Node, NodeKind, Stream, kernel_args,
};

mod common;
use common::Gpu;

const N: u32 = 4099;

fn cfg() -> LaunchConfig {
    LaunchConfig::for_elements(N, 256)
}

/// Every element of a whole buffer equals `want`.
fn assert_all(v: &[f32], want: f32, what: &str) {
    assert_eq!(v.len(), N as usize, "{what}: length");
    common::assert_all(v, want, what);
}

/// The diamond: a = 1 (memset); a += 2; {b = a; b *= 3} and {c = a; c += 5}; c = 2*b + c.
/// Host result: a = 3, b = 9, c = 2*9 + 8 = 26.
struct Diamond {
    graph: Graph,
    memset: Node,
    add_a: KernelNode,
    copies: [Node; 2],
    mul_b: KernelNode,
    add_c: KernelNode,
    axpy: KernelNode,
}

fn diamond(
    gpu: &Gpu,
    a: &DeviceBuffer<f32>,
    b: &DeviceBuffer<f32>,
    c: &DeviceBuffer<f32>,
) -> Diamond {
    let (add, mul, axpy) = (gpu.k("add_f32"), gpu.k("mul_f32"), gpu.k("axpy_f32"));
    let mut g = Graph::new(&gpu.ctx).expect("graph");
    let memset = g
        .add_memset(&[], a, MemsetValue::U32(1.0f32.to_bits()))
        .expect("memset node")
        .node();
    // SAFETY: add_f32(float*, float, unsigned) over N elements of a.
    let add_a = unsafe { g.add_kernel(&[memset], &add, &cfg(), &kernel_args![*a, 2.0f32, N]) }
        .expect("add node");
    let cb = g
        .add_memcpy(&[add_a.node()], b, a)
        .expect("memcpy b")
        .node();
    let cc = g
        .add_memcpy(&[add_a.node()], c, a)
        .expect("memcpy c")
        .node();
    // SAFETY: as above.
    let mul_b = unsafe { g.add_kernel(&[cb], &mul, &cfg(), &kernel_args![*b, 3.0f32, N]) }
        .expect("mul node");
    // SAFETY: as above.
    let add_c = unsafe { g.add_kernel(&[cc], &add, &cfg(), &kernel_args![*c, 5.0f32, N]) }
        .expect("add c node");
    // SAFETY: axpy_f32(float a, const float* x, float* y, unsigned n) over N elements.
    let axpy = unsafe {
        g.add_kernel(
            &[mul_b.node(), add_c.node()],
            &axpy,
            &cfg(),
            &kernel_args![2.0f32, *b, *c, N],
        )
    }
    .expect("axpy node");
    Diamond {
        graph: g,
        memset,
        add_a,
        copies: [cb, cc],
        mul_b,
        add_c,
        axpy,
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn diamond_of_kernels_memset_memcpy_replays() {
    let gpu = Gpu::new(N);
    let (mut a, mut b, mut c) = (gpu.buf(), gpu.buf(), gpu.buf());
    let d = diamond(&gpu, &a, &b, &c);
    let exec = GraphExec::instantiate(&d.graph, InstantiateFlags::empty()).expect("instantiate");
    drop(d); // the exec keeps everything alive
    for replay in 0..3 {
        for x in [&mut a, &mut b, &mut c] {
            gpu.poison(x);
        }
        exec.launch(&gpu.stream).expect("launch");
        gpu.stream.synchronize().expect("sync");
        assert_all(&gpu.read(&a), 3.0, &format!("a, replay {replay}"));
        assert_all(&gpu.read(&b), 9.0, &format!("b, replay {replay}"));
        assert_all(&gpu.read(&c), 26.0, &format!("c, replay {replay}"));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn queries_report_what_was_built_and_clone_and_dot_work() {
    let gpu = Gpu::new(N);
    let (mut a, mut b, mut c) = (gpu.buf(), gpu.buf(), gpu.buf());
    let d = diamond(&gpu, &a, &b, &c);
    let g = &d.graph;

    let nodes = g.nodes().expect("nodes");
    assert_eq!(nodes.len(), 7, "{nodes:?}");
    let count = |k: NodeKind| nodes.iter().filter(|n| n.kind == k).count();
    assert_eq!(
        (
            count(NodeKind::Kernel),
            count(NodeKind::Memcpy),
            count(NodeKind::Memset)
        ),
        (4, 2, 1)
    );
    assert_eq!(g.root_nodes().expect("roots"), vec![d.memset]);
    let edges = g.edges().expect("edges");
    assert_eq!(edges.len(), 7, "{edges:?}");
    assert!(edges.iter().all(|e| e.kind == EdgeKind::Full), "{edges:?}");
    assert_eq!(g.node_type(d.axpy.id()).unwrap(), NodeKind::Kernel);
    assert_eq!(g.node_type(d.copies[0].id).unwrap(), NodeKind::Memcpy);

    let mut deps: Vec<_> = g
        .dependencies(d.axpy.id())
        .expect("deps")
        .into_iter()
        .map(|x| x.0)
        .collect();
    deps.sort_by_key(|n| n.as_raw() as usize);
    let mut want = vec![d.mul_b.id(), d.add_c.id()];
    want.sort_by_key(|n| n.as_raw() as usize);
    assert_eq!(deps, want);
    let mut down: Vec<_> = g
        .dependents(d.add_a.id())
        .expect("dependents")
        .into_iter()
        .map(|x| x.0)
        .collect();
    down.sort_by_key(|n| n.as_raw() as usize);
    let mut want = vec![d.copies[0].id, d.copies[1].id];
    want.sort_by_key(|n| n.as_raw() as usize);
    assert_eq!(down, want);

    let dot = g.to_dot_string().expect("dot");
    assert!(dot.contains("digraph"), "not DOT: {dot:.200}");
    for name in ["add_f32", "mul_f32", "axpy_f32"] {
        assert!(dot.contains(name), "DOT lacks {name}");
    }

    let clone = g.try_clone().expect("clone");
    assert_eq!(clone.nodes().unwrap().len(), 7);
    assert_eq!(clone.edges().unwrap().len(), 7);
    let mut d = d;
    // An extra edge and its removal show in the edge list.
    d.graph.add_dependency(d.memset, d.axpy).expect("add edge");
    assert_eq!(d.graph.edges().unwrap().len(), 8);
    d.graph
        .remove_dependency(d.memset.id, d.axpy.id(), EdgeKind::Full)
        .expect("remove edge");
    assert_eq!(d.graph.edges().unwrap().len(), 7);
    drop(d);

    let exec =
        GraphExec::instantiate(&clone, InstantiateFlags::empty()).expect("instantiate clone");
    drop(clone);
    for replay in 0..2 {
        for x in [&mut a, &mut b, &mut c] {
            gpu.poison(x);
        }
        exec.launch(&gpu.stream).expect("launch");
        assert_all(&gpu.read(&a), 3.0, &format!("clone a, replay {replay}"));
        assert_all(&gpu.read(&b), 9.0, &format!("clone b, replay {replay}"));
        assert_all(&gpu.read(&c), 26.0, &format!("clone c, replay {replay}"));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn host_callback_runs_each_replay_and_panics_are_contained() {
    let gpu = Gpu::new(N);
    let count_up = gpu.k("count_up");
    let dev_count = DeviceBuffer::<u32>::from_host(&gpu.stream, &[0]).expect("counter");
    let hits = Arc::new(AtomicU64::new(0));

    let mut g = Graph::new(&gpu.ctx).unwrap();
    // SAFETY: count_up(unsigned*) touches element 0 only.
    let k = unsafe {
        g.add_kernel(
            &[],
            &count_up,
            &LaunchConfig::linear(1, 32),
            &kernel_args![dev_count],
        )
    }
    .unwrap();
    let h = hits.clone();
    let host = g
        .add_host(&[k.node()], move || {
            h.fetch_add(1, Ordering::SeqCst);
        })
        .expect("host node");
    let exec = GraphExec::instantiate(&g, InstantiateFlags::empty()).unwrap();
    drop(g);
    for i in 1..=3u64 {
        exec.launch(&gpu.stream).unwrap();
        gpu.stream.synchronize().unwrap();
        assert_eq!(
            hits.load(Ordering::SeqCst),
            i,
            "host callback calls after {i} replays"
        );
    }
    assert_eq!(host.panic_count(), 0);
    assert_eq!(dev_count.to_vec(&gpu.stream).unwrap(), vec![3]);

    // A panicking callback: caught in the trampoline, counted, and the graph goes on to the
    // kernel after it.
    dev_count.copy_from_host(&gpu.stream, &[0]).unwrap();
    let mut g = Graph::new(&gpu.ctx).unwrap();
    let bad = g
        .add_host(&[], || panic!("host callback panics on purpose"))
        .unwrap();
    // SAFETY: as above.
    unsafe {
        g.add_kernel(
            &[bad.node()],
            &count_up,
            &LaunchConfig::linear(1, 32),
            &kernel_args![dev_count],
        )
    }
    .unwrap();
    let exec = GraphExec::instantiate(&g, InstantiateFlags::empty()).unwrap();
    for _ in 0..2 {
        exec.launch(&gpu.stream).unwrap();
    }
    gpu.stream
        .synchronize()
        .expect("stream fine after panicking callbacks");
    assert_eq!(bad.panic_count(), 2);
    assert_eq!(
        dev_count.to_vec(&gpu.stream).unwrap(),
        vec![2],
        "kernel after the panicking callback ran"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn event_nodes_order_two_graphs_and_a_stream() {
    let gpu = Gpu::new(N);
    let other = Stream::new(&gpu.ctx).unwrap();
    let set = gpu.k("set_f32");
    let (x, y) = (gpu.buf(), gpu.buf());
    let event = Arc::new(Event::for_sync(&gpu.ctx).unwrap());

    // Graph 1 (on gpu.stream): x = 7, then record.
    let mut g1 = Graph::new(&gpu.ctx).unwrap();
    // SAFETY: set_f32(float*, float, unsigned) over N elements.
    let k = unsafe { g1.add_kernel(&[], &set, &cfg(), &kernel_args![x, 7.0f32, N]) }.unwrap();
    let rec = g1.add_event_record(&[k.node()], &event).unwrap();
    // Graph 2 (on the other stream): wait, then y = x.
    let mut g2 = Graph::new(&gpu.ctx).unwrap();
    let wait = g2.add_event_wait(&[], &event).unwrap();
    g2.add_memcpy(&[wait.node()], &y, &x).unwrap();
    assert_eq!(g1.node_type(rec.id()).unwrap(), NodeKind::EventRecord);
    assert_eq!(g2.node_type(wait.id()).unwrap(), NodeKind::EventWait);
    let e1 = GraphExec::instantiate(&g1, InstantiateFlags::empty()).unwrap();
    let e2 = GraphExec::instantiate(&g2, InstantiateFlags::empty()).unwrap();
    drop((g1, g2));

    e1.launch(&gpu.stream).unwrap();
    e2.launch(&other).unwrap();
    other.synchronize().unwrap();
    assert_all(
        &y.to_vec(&other).unwrap(),
        7.0,
        "y after graph-to-graph event",
    );

    // Graph -> plain stream: the stream waits on the event the graph records.
    gpu.poison(&y);
    e1.launch(&gpu.stream).unwrap();
    other.wait_event(&event).unwrap();
    y.copy_from_device(&other, &x).unwrap();
    other.synchronize().unwrap();
    assert_all(
        &y.to_vec(&other).unwrap(),
        7.0,
        "y after graph-to-stream event",
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn child_graph_nodes_run_the_child() {
    let gpu = Gpu::new(N);
    let (add, mul) = (gpu.k("add_f32"), gpu.k("mul_f32"));
    let x = gpu.buf();

    // Child: x += 1; x *= 2.
    let mut child = Graph::new(&gpu.ctx).unwrap();
    // SAFETY: add_f32 / mul_f32 over N elements of x.
    let k = unsafe { child.add_kernel(&[], &add, &cfg(), &kernel_args![x, 1.0f32, N]) }.unwrap();
    // SAFETY: as above.
    unsafe { child.add_kernel(&[k.node()], &mul, &cfg(), &kernel_args![x, 2.0f32, N]) }.unwrap();

    // Parent: x = 3; child; child -> ((3+1)*2+1)*2 = 18.
    let mut g = Graph::new(&gpu.ctx).unwrap();
    let m = g
        .add_memset(&[], &x, MemsetValue::U32(3.0f32.to_bits()))
        .unwrap();
    let c1 = g.add_child_graph(&[m.node()], &child).unwrap();
    let c2 = g.add_child_graph(&[c1.node()], &child).unwrap();
    assert_eq!(g.node_type(c2.id()).unwrap(), NodeKind::ChildGraph);
    drop(child); // the driver cloned it; the parent holds its resources
    let exec = GraphExec::instantiate(&g, InstantiateFlags::empty()).unwrap();
    drop(g);
    for replay in 0..2 {
        gpu.poison(&x);
        exec.launch(&gpu.stream).unwrap();
        assert_all(&gpu.read(&x), 18.0, &format!("x, replay {replay}"));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn mem_alloc_and_free_nodes_give_working_scratch_memory() {
    let gpu = Gpu::new(N);
    let (set, add) = (gpu.k("set_f32"), gpu.k("add_f32"));
    let out = gpu.buf();

    let mut g = Graph::new(&gpu.ctx).unwrap();
    let alloc = g.add_mem_alloc(&[], N as usize * 4).expect("alloc node");
    assert_ne!(alloc.ptr(), 0);
    // SAFETY: the node's address holds N floats between the alloc and free nodes.
    let scratch = unsafe { DeviceBuffer::<f32>::from_raw(&gpu.ctx, alloc.ptr(), N as usize) };
    // SAFETY: set_f32 / add_f32 over N elements of the scratch memory, ordered after the
    // alloc node and before the free node.
    let k1 = unsafe {
        g.add_kernel(
            &[alloc.node()],
            &set,
            &cfg(),
            &kernel_args![scratch, 4.5f32, N],
        )
    }
    .unwrap();
    // SAFETY: as above.
    let k2 = unsafe {
        g.add_kernel(
            &[k1.node()],
            &add,
            &cfg(),
            &kernel_args![scratch, 0.25f32, N],
        )
    }
    .unwrap();
    let cp = g.add_memcpy(&[k2.node()], &out, &scratch).unwrap();
    let free = g
        .add_mem_free(&[cp.node()], alloc.ptr())
        .expect("free node");
    assert_eq!(g.node_type(alloc.id()).unwrap(), NodeKind::MemAlloc);
    assert_eq!(g.node_type(free.id()).unwrap(), NodeKind::MemFree);

    match g.try_clone() {
        Err(e) => assert_eq!(e.code().map(|c| c.0), Some(801), "clone error: {e}"),
        Ok(_) => panic!("cloning a graph with memory nodes should fail with 801"),
    }

    let exec = GraphExec::instantiate(&g, InstantiateFlags::empty()).unwrap();
    for replay in 0..3 {
        gpu.poison(&out);
        exec.launch(&gpu.stream).unwrap();
        assert_all(&gpu.read(&out), 4.75, &format!("out, replay {replay}"));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn programmatic_edges_compute_the_same_as_full_edges() {
    const CHAIN: usize = 16;
    let gpu = Gpu::new(N);
    let pdl = gpu.k("add_one_pdl");
    for programmatic in [false, true] {
        let x = gpu.buf();
        let mut g = Graph::new(&gpu.ctx).unwrap();
        let m = g.add_memset(&[], &x, MemsetValue::U32(0)).unwrap();
        let mut prev: Option<KernelNode> = None;
        for _ in 0..CHAIN {
            let deps = if prev.is_none() {
                vec![m.node()]
            } else {
                vec![]
            };
            // SAFETY: add_one_pdl(float*, unsigned) over N elements of x.
            let k = unsafe { g.add_kernel(&deps, &pdl, &cfg(), &kernel_args![x, N]) }.unwrap();
            if let Some(p) = prev {
                if programmatic {
                    g.add_programmatic_dependency(&p, &k)
                        .expect("programmatic edge");
                } else {
                    g.add_dependency(p, k).unwrap();
                }
            }
            prev = Some(k);
        }
        let edges = g.edges().unwrap();
        assert_eq!(edges.len(), CHAIN);
        let want = if programmatic {
            EdgeKind::Programmatic
        } else {
            EdgeKind::Full
        };
        assert_eq!(
            edges.iter().filter(|e| e.kind == want).count(),
            if programmatic { CHAIN - 1 } else { CHAIN },
            "{edges:?}"
        );
        let exec = GraphExec::instantiate(&g, InstantiateFlags::empty()).expect("instantiate");
        for replay in 0..3 {
            gpu.poison(&x);
            exec.launch(&gpu.stream).unwrap();
            assert_all(
                &gpu.read(&x),
                CHAIN as f32,
                &format!("programmatic={programmatic}, replay {replay}"),
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn kernel_nodes_check_argument_sizes() {
    let gpu = Gpu::new(N);
    let add = gpu.k("add_f32");
    let x = gpu.buf();
    let mut g = Graph::new(&gpu.ctx).unwrap();
    // SAFETY: rejected before the driver is called (a u64 where a f32 is expected).
    let r = unsafe { g.add_kernel(&[], &add, &cfg(), &kernel_args![x, 1.0f64, N]) };
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    assert_eq!(g.nodes().unwrap().len(), 0);
    assert!(g.root_nodes().unwrap().is_empty());
    assert!(g.edges().unwrap().is_empty());
    // A single node has no dependencies or dependents.
    let e = g.add_empty(&[]).unwrap();
    assert!(g.dependencies(e.id()).unwrap().is_empty());
    assert!(g.dependents(e.id()).unwrap().is_empty());
    assert_eq!(g.root_nodes().unwrap(), vec![Node::from(e)]);
}

/// Node handles of another graph, or of a graph that was dropped, never reach the driver
/// (which would read freed memory): every method that takes one refuses it, the graph and
/// the exec are unharmed.
#[test]
#[ignore = "needs a CUDA device"]
fn node_handles_of_other_or_dropped_graphs_are_refused() {
    let gpu = Gpu::new(N);
    let x = gpu.buf();
    let mut g = Graph::new(&gpu.ctx).unwrap();
    let mine = g
        .add_memset(&[], &x, MemsetValue::U32(1.0f32.to_bits()))
        .unwrap();
    let dropped = {
        let mut other = Graph::new(&gpu.ctx).unwrap();
        other.add_empty(&[]).unwrap().node()
    };
    let mut live = Graph::new(&gpu.ctx).unwrap();
    let foreign = live
        .add_memset(&[], &x, MemsetValue::U32(5.0f32.to_bits()))
        .unwrap();
    for (what, n) in [
        ("a dropped graph's", dropped),
        ("another graph's", foreign.node()),
    ] {
        let refused = |e: Error| assert!(e.to_string().contains("not a node of"), "{what}: {e}");
        refused(g.add_empty(&[n]).unwrap_err());
        refused(g.node_type(n.id).unwrap_err());
        refused(g.dependents(n.id).unwrap_err());
        refused(g.add_dependency(mine.node(), n).unwrap_err());
    }
    g.add_empty(&[mine.node()]).unwrap();
    assert_eq!(g.nodes().unwrap().len(), 2, "the graph is unharmed");
    let mut exec = GraphExec::instantiate(&g, InstantiateFlags::empty()).unwrap();
    let e = exec
        .set_memset_params(&foreign, &x, MemsetValue::U32(7.0f32.to_bits()))
        .unwrap_err();
    assert!(e.to_string().contains("not a node of"), "{e}");
    gpu.poison(&x);
    gpu.run(&exec);
    assert_all(&gpu.read(&x), 1.0, "the exec kept its memset");
}
