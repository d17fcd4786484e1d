//! GPU tests of exec updates: whole-graph update, re-instantiation on topology change,
//! per-node setters and enable/disable.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cuda_graph::{
    DeviceBuffer, Error, Event, Graph, GraphExec, InstantiateFlags, LaunchConfig, MemsetValue,
    UpdateOutcome, UpdateReason, kernel_args,
};

mod common;
use common::{Gpu, POISON};

const N: u32 = 4096;

fn cfg() -> LaunchConfig {
    LaunchConfig::for_elements(N, 256)
}

use common::assert_all;

/// x = 1 (memset), then `adds` times x += v.
fn build(gpu: &Gpu, x: &DeviceBuffer<f32>, v: f32, adds: usize) -> Graph {
    let add = gpu.k("add_f32");
    let mut g = Graph::new(&gpu.ctx).unwrap();
    let mut prev = g
        .add_memset(&[], x, MemsetValue::U32(1.0f32.to_bits()))
        .unwrap()
        .node();
    for _ in 0..adds {
        // SAFETY: add_f32(float*, float, unsigned) over N elements of x.
        prev = unsafe { g.add_kernel(&[prev], &add, &cfg(), &kernel_args![*x, v, N]) }
            .unwrap()
            .node();
    }
    g
}

/// The memset node of a graph of [`build`] (its first node).
fn memset_node(g: &Graph) -> cuda_graph::MemsetNode {
    let first = g.nodes().unwrap()[0];
    cuda_graph::MemsetNode::try_from(first).unwrap()
}

#[test]
#[ignore = "needs a CUDA device"]
fn handles_of_every_live_updated_graph_reach_the_exec() {
    // Updated twice: the second update must not lose the first's handles while its graph
    // lives, and the latest's stay valid after its graph is dropped.
    let gpu = Gpu::new(N);
    let x = gpu.buf();
    let g1 = build(&gpu, &x, 1.0, 1);
    let mut exec = GraphExec::instantiate(&g1, InstantiateFlags::empty()).unwrap();
    let (g2, g3) = (build(&gpu, &x, 2.0, 1), build(&gpu, &x, 3.0, 1));
    exec.update(&g2).unwrap();
    exec.update(&g3).unwrap();
    let (m2, m3) = (memset_node(&g2), memset_node(&g3));
    drop(g3);
    for (what, node, start) in [("g2's handle", m2, 5.0f32), ("g3's handle", m3, 7.0)] {
        exec.set_memset_params(&node, &x, MemsetValue::U32(start.to_bits()))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        gpu.poison(&x);
        gpu.run(&exec);
        assert_all(&gpu.read(&x), start + 3.0, what);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn update_with_new_arguments_takes_effect_on_the_next_launch() {
    let gpu = Gpu::new(N);
    let x1 = gpu.buf();
    let g1 = build(&gpu, &x1, 2.0, 1);
    let mut exec = GraphExec::instantiate(&g1, InstantiateFlags::empty()).unwrap();
    drop(g1);
    gpu.run(&exec);
    assert_all(&gpu.read(&x1), 3.0, "x1 before the update");

    // Same topology, another buffer and scalar.
    let x2 = gpu.buf();
    let g2 = build(&gpu, &x2, 10.0, 1);
    exec.update(&g2).expect("update");
    drop(g2);
    let x2_addr = x2.as_raw();
    let x2_read = {
        // The exec keeps x2's memory even when the user's buffer is gone; read it through a
        // borrowed view after the launch.
        drop(x2);
        // SAFETY: the exec holds the allocation alive; N floats.
        unsafe { DeviceBuffer::<f32>::from_raw(&gpu.ctx, x2_addr, N as usize) }
    };
    gpu.poison(&x1);
    gpu.run(&exec);
    assert_all(&gpu.read(&x2_read), 11.0, "x2 after the update");
    let untouched: Vec<u32> = gpu.read(&x1).iter().map(|f| f.to_bits()).collect();
    assert!(
        untouched.iter().all(|&b| b == POISON),
        "x1 written after the update"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn topology_change_is_reported_and_the_helper_reinstantiates() {
    let gpu = Gpu::new(N);
    let x = gpu.buf();
    let g1 = build(&gpu, &x, 2.0, 1);
    let mut exec = GraphExec::instantiate(&g1, InstantiateFlags::empty()).unwrap();
    gpu.run(&exec);
    assert_all(&gpu.read(&x), 3.0, "x, one add");

    let g2 = build(&gpu, &x, 2.0, 2);
    match exec.update(&g2) {
        Err(Error::Update { reason, .. }) => {
            assert_eq!(reason, UpdateReason::TopologyChanged)
        }
        other => panic!("expected Error::Update(TopologyChanged), got {other:?}"),
    }
    // The refused update left the exec as it was.
    gpu.poison(&x);
    gpu.run(&exec);
    assert_all(&gpu.read(&x), 3.0, "x after the refused update");

    let outcome = exec
        .update_or_reinstantiate(&g2, InstantiateFlags::empty())
        .expect("reinstantiate");
    assert_eq!(outcome, UpdateOutcome::Reinstantiated);
    gpu.poison(&x);
    gpu.run(&exec);
    assert_all(&gpu.read(&x), 5.0, "x, two adds");

    let g3 = build(&gpu, &x, 4.0, 2);
    let outcome = exec
        .update_or_reinstantiate(&g3, InstantiateFlags::empty())
        .expect("update");
    assert_eq!(outcome, UpdateOutcome::Updated);
    gpu.poison(&x);
    gpu.run(&exec);
    assert_all(&gpu.read(&x), 9.0, "x, two adds of 4");
}

#[test]
#[ignore = "needs a CUDA device"]
fn per_node_setters_and_enable_disable_take_effect() {
    let gpu = Gpu::new(N);
    let add = gpu.k("add_f32");
    let (mut x, y) = (gpu.buf(), gpu.buf());
    let w = DeviceBuffer::from_host(&gpu.stream, &vec![42.0f32; N as usize]).unwrap();

    // x = 1; x += 2; y = x; (empty)
    let mut g = Graph::new(&gpu.ctx).unwrap();
    let m = g
        .add_memset(&[], &x, MemsetValue::U32(1.0f32.to_bits()))
        .unwrap();
    // SAFETY: add_f32 over N elements of x.
    let k =
        unsafe { g.add_kernel(&[m.node()], &add, &cfg(), &kernel_args![x, 2.0f32, N]) }.unwrap();
    let c = g.add_memcpy(&[k.node()], &y, &x).unwrap();
    let e = g.add_empty(&[c.node()]).unwrap();
    let mut exec = GraphExec::instantiate(&g, InstantiateFlags::empty()).unwrap();
    // The setters take node handles of the graph the exec was made from; that graph may be
    // gone by then.
    drop(g);
    let reset = |gpu: &Gpu, x: &DeviceBuffer<f32>, y: &DeviceBuffer<f32>| {
        gpu.poison(x);
        gpu.poison(y);
    };
    gpu.run(&exec);
    assert_all(&gpu.read(&y), 3.0, "y initially");

    // Kernel scalar change.
    // SAFETY: add_f32 over N elements of x.
    unsafe { exec.set_kernel_params(&k, &add, &cfg(), &kernel_args![x, 5.0f32, N]) }.unwrap();
    reset(&gpu, &mut x, &y);
    gpu.run(&exec);
    assert_all(&gpu.read(&y), 6.0, "y after the scalar change");

    // Grid change: only the first half gets the add.
    let half = LaunchConfig::linear(N / 2 / 128, 128);
    // SAFETY: as above; fewer threads than elements.
    unsafe { exec.set_kernel_params(&k, &add, &half, &kernel_args![x, 5.0f32, N]) }.unwrap();
    reset(&gpu, &mut x, &y);
    gpu.run(&exec);
    let v = gpu.read(&y);
    assert_all(
        &v[..N as usize / 2],
        6.0,
        "first half after the grid change",
    );
    assert_all(
        &v[N as usize / 2..],
        1.0,
        "second half after the grid change",
    );
    // SAFETY: as above.
    unsafe { exec.set_kernel_params(&k, &add, &cfg(), &kernel_args![x, 5.0f32, N]) }.unwrap();

    // Memset value change.
    exec.set_memset_params(&m, &x, MemsetValue::U32(2.0f32.to_bits()))
        .unwrap();
    reset(&gpu, &mut x, &y);
    gpu.run(&exec);
    assert_all(&gpu.read(&y), 7.0, "y after the memset change");

    // Memcpy source change.
    exec.set_memcpy_params(&c, &y, &w).unwrap();
    reset(&gpu, &mut x, &y);
    gpu.run(&exec);
    assert_all(&gpu.read(&y), 42.0, "y after the memcpy source change");
    assert_all(&gpu.read(&x), 7.0, "x still computed");
    exec.set_memcpy_params(&c, &y, &x).unwrap();

    // Disable the kernel: x stays at the memset value.
    assert!(exec.node_enabled(k).unwrap());
    exec.set_node_enabled(k, false).unwrap();
    assert!(!exec.node_enabled(k).unwrap());
    reset(&gpu, &mut x, &y);
    gpu.run(&exec);
    assert_all(&gpu.read(&y), 2.0, "y with the kernel disabled");
    exec.set_node_enabled(k, true).unwrap();
    reset(&gpu, &mut x, &y);
    gpu.run(&exec);
    assert_all(&gpu.read(&y), 7.0, "y with the kernel re-enabled");

    // Disable the memset: x keeps what it held (poisoned to 10 here), plus 5.
    exec.set_node_enabled(m, false).unwrap();
    let ten = DeviceBuffer::from_host(&gpu.stream, &vec![10.0f32; N as usize]).unwrap();
    x.copy_from_device(&gpu.stream, &ten).unwrap();
    gpu.run(&exec);
    assert_all(&gpu.read(&y), 15.0, "y with the memset disabled");
    exec.set_node_enabled(m, true).unwrap();

    // Empty nodes cannot be disabled: refused before the driver.
    assert!(matches!(
        exec.set_node_enabled(e, false),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        exec.node_enabled(e),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
#[ignore = "needs a CUDA device"]
fn host_and_child_graph_setters_take_effect() {
    let gpu = Gpu::new(N);
    let add = gpu.k("add_f32");
    let x = gpu.buf();
    let child_adding = |v: f32| {
        let mut c = Graph::new(&gpu.ctx).unwrap();
        // SAFETY: add_f32 over N elements of x.
        unsafe { c.add_kernel(&[], &add, &cfg(), &kernel_args![x, v, N]) }.unwrap();
        c
    };
    let first = Arc::new(AtomicU64::new(0));
    let second = Arc::new(AtomicU64::new(0));

    let mut g = Graph::new(&gpu.ctx).unwrap();
    let m = g
        .add_memset(&[], &x, MemsetValue::U32(1.0f32.to_bits()))
        .unwrap();
    let child = g.add_child_graph(&[m.node()], &child_adding(1.0)).unwrap();
    let f = first.clone();
    let h = g
        .add_host(&[child.node()], move || {
            f.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    let e1 = Arc::new(Event::for_sync(&gpu.ctx).unwrap());
    let rec = g.add_event_record(&[h.node()], &e1).unwrap();
    let wait = g.add_event_wait(&[rec.node()], &e1).unwrap();
    let mut exec = GraphExec::instantiate(&g, InstantiateFlags::empty()).unwrap();
    drop(g);
    gpu.run(&exec);
    assert_all(&gpu.read(&x), 2.0, "x with the first child");
    // Re-point the event nodes: the new event is recorded by the next launch.
    let e2 = Arc::new(Event::for_sync(&gpu.ctx).unwrap());
    exec.set_event_record_event(&rec, &e2).unwrap();
    exec.set_event_wait_event(&wait, &e2).unwrap();
    drop(e1);
    assert_eq!(first.load(Ordering::SeqCst), 1);

    exec.set_child_graph(&child, &child_adding(7.0)).unwrap();
    let s = second.clone();
    let h2 = exec
        .set_host_callback(&h, move || {
            s.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    gpu.poison(&x);
    gpu.run(&exec);
    gpu.run(&exec);
    assert_all(&gpu.read(&x), 8.0, "x with the replaced child");
    assert_eq!(
        first.load(Ordering::SeqCst),
        1,
        "old callback no longer called"
    );
    assert_eq!(
        second.load(Ordering::SeqCst),
        2,
        "new callback called per launch"
    );
    assert_eq!(h2.panic_count(), 0);
    e2.synchronize().expect("event recorded by the graph");
    assert!(e2.is_complete().unwrap());
}

#[test]
#[ignore = "needs a CUDA device"]
fn setters_take_either_graphs_node_handles_after_an_update() {
    let gpu = Gpu::new(N);
    let add = gpu.k("add_f32");
    let x = gpu.buf();
    let mk = |v: f32| {
        let mut g = Graph::new(&gpu.ctx).unwrap();
        let m = g
            .add_memset(&[], &x, MemsetValue::U32(1.0f32.to_bits()))
            .unwrap();
        // SAFETY: add_f32 over N elements of x.
        let k = unsafe { g.add_kernel(&[m.node()], &add, &cfg(), &kernel_args![x, v, N]) }.unwrap();
        (g, k)
    };
    let (g1, k1) = mk(2.0);
    let (g2, k2) = mk(3.0);
    let mut exec = GraphExec::instantiate(&g1, InstantiateFlags::empty()).unwrap();
    exec.update(&g2).unwrap();
    drop((g1, g2));
    // SAFETY: as above.
    let r1 = unsafe { exec.set_kernel_params(&k1, &add, &cfg(), &kernel_args![x, 4.0f32, N]) };
    gpu.run(&exec);
    let v1 = gpu.read(&x)[0];
    // SAFETY: as above.
    let r2 = unsafe { exec.set_kernel_params(&k2, &add, &cfg(), &kernel_args![x, 5.0f32, N]) };
    gpu.run(&exec);
    let v2 = gpu.read(&x)[0];
    // The driver keeps the nodes of the graph the exec was instantiated from (on the H200,
    // driver 13.0, its setters refuse the update's handles with INVALID_VALUE); the exec
    // translates the update's handles to them, also after both graphs were dropped.
    r1.expect("setter with the original graph's handle, graphs dropped");
    assert_eq!(v1, 5.0, "1 + 4 after the setter");
    r2.expect("setter with the update's graph's handle, graphs dropped");
    assert_eq!(
        v2, 6.0,
        "1 + 5 after the setter through the update's handle"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn instantiate_failure_names_the_driver_result_and_node() {
    let gpu = Gpu::new(N);
    let x = gpu.buf();
    let mut g = build(&gpu, &x, 1.0, 2);
    // Device-launchable graphs may not contain host nodes: the driver refuses at
    // instantiation and blames the host node.
    let host = g.add_host(&[], || {}).unwrap();
    match GraphExec::instantiate(&g, InstantiateFlags::DEVICE_LAUNCH) {
        Err(Error::Instantiate { result, node, .. }) => {
            assert_ne!(
                result,
                cuda_graph::sys::CUgraphInstantiateResult::CUDA_GRAPH_INSTANTIATE_SUCCESS
            );
            assert_eq!(node, host.id(), "the failing node is the host node");
        }
        other => panic!("expected Error::Instantiate, got {other:?}"),
    }
    // Rejected before the driver: contradictory flags, and UPLOAD without a stream.
    for flags in [
        InstantiateFlags::AUTO_FREE_ON_LAUNCH | InstantiateFlags::DEVICE_LAUNCH,
        InstantiateFlags::UPLOAD,
    ] {
        assert!(matches!(
            GraphExec::instantiate(&g, flags),
            Err(Error::InvalidArgument(_))
        ));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn instantiate_with_upload_then_launch_runs() {
    let gpu = Gpu::new(N);
    let x = gpu.buf();
    let g = build(&gpu, &x, 0.5, 4);
    let exec = GraphExec::instantiate_on(&g, InstantiateFlags::UPLOAD, &gpu.stream).unwrap();
    exec.upload(&gpu.stream).unwrap();
    gpu.run(&exec);
    assert_all(&gpu.read(&x), 3.0, "1 + 4 x 0.5");
}
