//! GPU tests of the graph pool: allocation inside a capture, and two graphs captured in
//! execution order sharing memory for their temporaries.

use std::sync::Arc;

use cuda_graph::{
    CaptureMode, Context, DeviceBuffer, GraphExec, GraphPool, InstantiateFlags, Kernel,
    LaunchConfig, Module, Stream, kernel_args,
};

const TEST_KERNELS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/test_kernels.fatbin"));

#[test]
#[ignore = "needs a CUDA device"]
fn graphs_captured_in_order_share_pool_memory_and_replay_correctly() {
    let ctx = Context::default_device().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let module = Module::from_image(&ctx, TEST_KERNELS).unwrap();
    let (set, add, axpy) = (
        module.kernel("set_f32").unwrap(),
        module.kernel("add_f32").unwrap(),
        module.kernel("axpy_f32").unwrap(),
    );
    let n = 4097u32;
    let cfg = LaunchConfig::for_elements(n, 256);
    let pool = GraphPool::new(&ctx, 1 << 20).unwrap();
    let out_a = DeviceBuffer::<f32>::from_host(&stream, &vec![f32::NAN; n as usize]).unwrap();
    let out_b = DeviceBuffer::<f32>::from_host(&stream, &vec![f32::NAN; n as usize]).unwrap();

    // Graph A: tmp = 3; tmp += 1; out_a = 2 * tmp + out_a(=0 first)
    let mut tmp_a_addr = 0;
    let graph_a = stream
        .capture(CaptureMode::ThreadLocal, |s| {
            // Allocating from the pool makes no driver call: legal inside a capture.
            let tmp = pool.alloc::<f32>(n as usize)?;
            tmp_a_addr = tmp.as_raw();
            // SAFETY: the kernels touch n elements of buffers that hold n.
            unsafe {
                s.stream()
                    .launch(&set, &cfg, &kernel_args![tmp, 3.0f32, n])?;
                s.stream()
                    .launch(&add, &cfg, &kernel_args![tmp, 1.0f32, n])?;
                s.stream()
                    .launch(&set, &cfg, &kernel_args![out_a, 0.0f32, n])?;
                s.stream()
                    .launch(&axpy, &cfg, &kernel_args![2.0f32, tmp, out_a, n])
            }
        })
        .expect("capture with a pool allocation inside");
    assert_eq!(
        pool.free_bytes(),
        pool.capacity(),
        "A's temporary went back to the pool"
    );

    // Graph B, captured after A: its temporary gets A's range.
    let graph_b = stream
        .capture(CaptureMode::ThreadLocal, |s| {
            let tmp = pool.alloc::<f32>(n as usize)?;
            assert_eq!(tmp.as_raw(), tmp_a_addr, "B reuses A's freed range");
            // SAFETY: as above.
            unsafe {
                s.stream()
                    .launch(&set, &cfg, &kernel_args![tmp, 10.0f32, n])?;
                s.stream()
                    .launch(&set, &cfg, &kernel_args![out_b, 1.0f32, n])?;
                s.stream()
                    .launch(&axpy, &cfg, &kernel_args![0.5f32, tmp, out_b, n])
            }
        })
        .unwrap();
    let exec_a = GraphExec::instantiate(&graph_a, InstantiateFlags::empty()).unwrap();
    let exec_b = GraphExec::instantiate(&graph_b, InstantiateFlags::empty()).unwrap();
    drop((graph_a, graph_b));
    // Replayed in capture order on one stream, each sees its own temporary's values.
    for _ in 0..3 {
        exec_a.launch(&stream).unwrap();
        exec_b.launch(&stream).unwrap();
        assert!(out_a.to_vec(&stream).unwrap().iter().all(|&v| v == 8.0));
        assert!(out_b.to_vec(&stream).unwrap().iter().all(|&v| v == 6.0));
    }
    // The pool's memory outlives the pool handle while execs use it.
    drop(pool);
    exec_a.launch(&stream).unwrap();
    assert!(out_a.to_vec(&stream).unwrap().iter().all(|&v| v == 8.0));
}

/// A context, a stream and the test kernels `set_f32` and `axpy_f32`.
fn set_and_axpy() -> (Arc<Context>, Stream, Kernel, Kernel) {
    let ctx = Context::default_device().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let module = Module::from_image(&ctx, TEST_KERNELS).unwrap();
    let (set, axpy) = (
        module.kernel("set_f32").unwrap(),
        module.kernel("axpy_f32").unwrap(),
    );
    (ctx, stream, set, axpy)
}

#[test]
#[ignore = "needs a CUDA device"]
fn graph_memory_nodes_reserve_memory_that_trim_returns() {
    let (ctx, stream, set, axpy) = set_and_axpy();
    let n = 1u32 << 22; // 16 MiB of scratch
    let cfg = LaunchConfig::for_elements(n, 256);
    let out = DeviceBuffer::<f32>::from_host(&stream, &vec![f32::NAN; n as usize]).unwrap();
    let dev = ctx.device();
    dev.graph_mem_trim().unwrap();
    let graph = stream
        .capture(CaptureMode::ThreadLocal, |s| {
            // Stream-ordered allocation and free inside a capture become graph memory nodes.
            let tmp = DeviceBuffer::<f32>::alloc_async(s.stream(), n as usize)?;
            // SAFETY: the kernels touch n elements of buffers that hold n.
            unsafe {
                s.stream()
                    .launch(&set, &cfg, &kernel_args![tmp, 2.0f32, n])?;
                s.stream()
                    .launch(&set, &cfg, &kernel_args![out, 1.0f32, n])?;
                s.stream()
                    .launch(&axpy, &cfg, &kernel_args![3.0f32, tmp, out, n])
            }
        })
        .unwrap();
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
    for _ in 0..2 {
        exec.launch(&stream).unwrap();
        assert!(out.to_vec(&stream).unwrap().iter().all(|&v| v == 7.0));
    }
    let usage = dev.graph_mem_usage().unwrap();
    assert!(usage.reserved >= u64::from(n) * 4, "{usage:?}");
    assert!(usage.used_high >= u64::from(n) * 4, "{usage:?}");
    drop((exec, graph));
    stream.synchronize().unwrap();
    dev.graph_mem_trim().unwrap();
    let after = dev.graph_mem_usage().unwrap();
    assert!(
        after.reserved < usage.reserved,
        "trim returned nothing: {usage:?} -> {after:?}"
    );
}

/// A buffer allocated inside one capture (a graph memory node) and kept past it is memory
/// like any other for the graphs captured after: they keep it alive, so dropping the buffer
/// frees nothing while such a graph lives (its memory is not handed out again under it).
#[test]
#[ignore = "needs a CUDA device"]
fn a_graph_memory_buffer_is_kept_alive_by_later_captures() {
    let (_ctx, stream, set, axpy) = set_and_axpy();
    let n = 1u32 << 20;
    let cfg = LaunchConfig::for_elements(n, 256);
    let out = DeviceBuffer::<f32>::from_host(&stream, &vec![f32::NAN; n as usize]).unwrap();
    // Graph A allocates tmp (= 2) and hands it out of the capture.
    let (a, tmp) = stream
        .capture_with(CaptureMode::ThreadLocal, |s| {
            let tmp = DeviceBuffer::<f32>::alloc_async(s.stream(), n as usize)?;
            // SAFETY: set_f32 writes n elements of tmp.
            unsafe {
                s.stream()
                    .launch(&set, &cfg, &kernel_args![tmp, 2.0f32, n])?
            };
            Ok(tmp)
        })
        .unwrap();
    GraphExec::instantiate(&a, InstantiateFlags::empty())
        .unwrap()
        .launch(&stream)
        .unwrap();
    // Graph B reads it: out = 3 tmp + 1.
    let b = stream
        .capture(CaptureMode::ThreadLocal, |s| {
            // SAFETY: the kernels touch n elements of buffers that hold n.
            unsafe {
                s.stream()
                    .launch(&set, &cfg, &kernel_args![out, 1.0f32, n])?;
                s.stream()
                    .launch(&axpy, &cfg, &kernel_args![3.0f32, tmp, out, n])
            }
        })
        .unwrap();
    let b = GraphExec::instantiate(&b, InstantiateFlags::empty()).unwrap();
    drop(tmp);
    // Were tmp's memory freed, these stream-ordered allocations would take it.
    let others: Vec<DeviceBuffer<f32>> = (0..4)
        .map(|_| {
            let o = DeviceBuffer::<f32>::alloc_async(&stream, n as usize).unwrap();
            o.fill_u32_bits(&stream, 100.0f32.to_bits()).unwrap();
            o
        })
        .collect();
    b.launch(&stream).unwrap();
    assert!(out.to_vec(&stream).unwrap().iter().all(|&v| v == 7.0));
    drop(others);
}
