//! GPU tests of the core handles: buffers, copies, memsets, pools, modules, launches,
//! events and streams.

use std::sync::Arc;

use cuda_graph::{
    Context, DeviceBuffer, Error, Event, GraphPool, KernelArgs, LaunchAttribute, LaunchConfig,
    MemPool, Module, PinnedBuffer, Stream, kernel_args,
};

const TEST_KERNELS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/test_kernels.fatbin"));

fn setup() -> (Arc<Context>, Stream, Module) {
    let ctx = Context::default_device().expect("context");
    let stream = Stream::new(&ctx).expect("stream");
    let module = Module::from_image(&ctx, TEST_KERNELS).expect("test kernels load");
    (ctx, stream, module)
}

/// Deterministic pseudo-random floats, exactly representable, different per seed.
fn data(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % 4096) as f32 * 0.25 - 512.0
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn copies_round_trip_and_memsets_write_every_element() {
    let (ctx, stream, _) = setup();
    let host = data(10_007, 1);
    let buf = DeviceBuffer::<f32>::alloc(&ctx, host.len()).unwrap();
    buf.copy_from_host(&stream, &host).unwrap();
    assert_eq!(buf.to_vec(&stream).unwrap(), host);

    let other = DeviceBuffer::<f32>::from_host(&stream, &data(10_007, 2)).unwrap();
    other.copy_from_device(&stream, &buf).unwrap();
    assert_eq!(other.to_vec(&stream).unwrap(), host);

    other.fill_u32_bits(&stream, 1.5f32.to_bits()).unwrap();
    assert!(other.to_vec(&stream).unwrap().iter().all(|&v| v == 1.5));
    other.memset_bytes(&stream, 0).unwrap();
    assert!(
        other
            .to_vec(&stream)
            .unwrap()
            .iter()
            .all(|&v| v.to_bits() == 0)
    );

    let bytes = DeviceBuffer::<u8>::alloc(&ctx, 3).unwrap();
    assert!(matches!(
        bytes.fill_u32_bits(&stream, 0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        buf.copy_from_host(&stream, &host[..10]),
        Err(Error::InvalidArgument(_))
    ));
    // The failed copy changed nothing.
    assert_eq!(buf.to_vec(&stream).unwrap(), host);
}

#[test]
#[ignore = "needs a CUDA device"]
fn async_and_pool_allocations_work_and_free_in_stream_order() {
    let (ctx, stream, module) = setup();
    let pool = MemPool::new(&ctx).unwrap();
    let add = module.kernel("add_f32").unwrap();
    let host = data(4099, 3);
    for round in 0..3 {
        let a = DeviceBuffer::<f32>::alloc_async(&stream, host.len()).unwrap();
        let b = DeviceBuffer::<f32>::alloc_from_pool(&stream, &pool, host.len()).unwrap();
        a.copy_from_host(&stream, &host).unwrap();
        b.copy_from_device(&stream, &a).unwrap();
        let n = host.len() as u32;
        let v = round as f32 + 0.5;
        // SAFETY: add_f32(float*, float, unsigned) touches b[0..n).
        unsafe {
            stream.launch(
                &add,
                &LaunchConfig::for_elements(n, 128),
                &kernel_args![b, v, n],
            )
        }
        .unwrap();
        let got = b.to_vec(&stream).unwrap();
        for (i, (&g, &h)) in got.iter().zip(&host).enumerate() {
            assert_eq!(g, h + v, "round {round} element {i}");
        }
    }
    stream.synchronize().unwrap();
    assert!(pool.reserved_bytes().unwrap() > 0);
    pool.trim_to(0).unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn graph_pool_hands_out_disjoint_aligned_ranges_and_reuses_freed_ones() {
    let (ctx, stream, _) = setup();
    let pool = GraphPool::new(&ctx, 1 << 20).unwrap();
    let a = pool.alloc::<f32>(1000).unwrap();
    let b = pool.alloc::<f32>(1000).unwrap();
    assert_eq!(a.as_raw() % 256, 0);
    assert!(b.as_raw() >= a.as_raw() + 4000, "ranges overlap");
    let a = a;
    let b = b;
    a.copy_from_host(&stream, &data(1000, 4)).unwrap();
    b.copy_from_host(&stream, &data(1000, 5)).unwrap();
    assert_eq!(
        a.to_vec(&stream).unwrap(),
        data(1000, 4),
        "b's write clobbered a"
    );
    let a_addr = a.as_raw();
    drop(a);
    let c = pool.alloc::<f32>(500).unwrap();
    assert_eq!(c.as_raw(), a_addr, "a freed range is reused first");
    assert!(matches!(
        pool.alloc::<f32>(1 << 20),
        Err(Error::InvalidArgument(_))
    ));
    drop((b, c));
    assert_eq!(pool.free_bytes(), pool.capacity());
}

#[test]
#[ignore = "needs a CUDA device"]
fn launch_checks_argument_sizes_before_running() {
    let (ctx, stream, module) = setup();
    let axpy = module.kernel("axpy_f32").unwrap();
    assert_eq!(axpy.param_sizes(), Some(&[4usize, 8, 8, 4][..]));
    let x = DeviceBuffer::from_host(&stream, &data(300, 6)).unwrap();
    let y0 = data(300, 7);
    let y = DeviceBuffer::from_host(&stream, &y0).unwrap();
    let n = 300u32;
    // A 64-bit scale where the kernel takes a float: rejected, nothing runs.
    let wrong = KernelArgs::new().arg(&2.0f64).arg(&x).arg(&y).arg(&n);
    // SAFETY: rejected before launch.
    let err = unsafe { stream.launch(&axpy, &LaunchConfig::for_elements(n, 64), &wrong) };
    assert!(matches!(err, Err(Error::InvalidArgument(_))), "{err:?}");
    // Missing argument: rejected too.
    let short = KernelArgs::new().arg(&2.0f32).arg(&x).arg(&y);
    // SAFETY: rejected before launch.
    let err = unsafe { stream.launch(&axpy, &LaunchConfig::for_elements(n, 64), &short) };
    assert!(matches!(err, Err(Error::InvalidArgument(_))), "{err:?}");
    assert_eq!(
        y.to_vec(&stream).unwrap(),
        y0,
        "a rejected launch wrote nothing"
    );

    // The right list runs, with and without launch attributes.
    let a = 2.0f32;
    let cfg = LaunchConfig::for_elements(n, 64).with(LaunchAttribute::Priority(0));
    // SAFETY: axpy_f32(float, const float*, float*, unsigned) over 300 elements of x and y.
    unsafe { stream.launch(&axpy, &cfg, &kernel_args![a, x, y, n]) }.unwrap();
    let got = y.to_vec(&stream).unwrap();
    let xs = data(300, 6);
    for i in 0..300 {
        assert_eq!(got[i], 2.0 * xs[i] + y0[i], "element {i}");
    }
    drop(ctx);
}

#[test]
#[ignore = "needs a CUDA device"]
fn bad_ptx_reports_the_jit_log_and_missing_kernel_is_an_error() {
    let (ctx, _, module) = setup();
    let err = Module::from_ptx(&ctx, ".version 8.0\n.target sm_90\nthis is not ptx").unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::ModuleLoad { .. }), "{msg}");
    assert!(msg.contains("cuModuleLoadDataEx"), "{msg}");
    assert!(module.kernel("no_such_kernel").is_err());
    assert!(matches!(
        Module::from_image(&ctx, &[]),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
#[ignore = "needs a CUDA device"]
fn events_time_and_order_streams() {
    let (ctx, s1, module) = setup();
    let s2 = Stream::with_priority(&ctx, ctx.stream_priority_range().unwrap().1).unwrap();
    let (least, greatest) = ctx.stream_priority_range().unwrap();
    assert!(greatest <= least);
    assert_eq!(s2.priority().unwrap(), greatest);
    let set = module.kernel("set_f32").unwrap();
    let add = module.kernel("add_f32").unwrap();
    let n = 1u32 << 20;
    let buf = DeviceBuffer::<f32>::alloc(&ctx, n as usize).unwrap();
    let cfg = LaunchConfig::for_elements(n, 256);
    let (start, end) = (Event::new(&ctx).unwrap(), Event::new(&ctx).unwrap());
    start.record(&s1).unwrap();
    // SAFETY: both kernels touch buf[0..n).
    unsafe { s1.launch(&set, &cfg, &kernel_args![buf, 3.0f32, n]) }.unwrap();
    end.record(&s1).unwrap();
    // s2 must see s1's set before adding.
    s2.wait_event(&end).unwrap();
    // SAFETY: as above.
    unsafe { s2.launch(&add, &cfg, &kernel_args![buf, 1.0f32, n]) }.unwrap();
    s2.synchronize().unwrap();
    assert!(end.is_complete().unwrap());
    let ms = Event::elapsed_ms(&start, &end).unwrap();
    assert!(ms > 0.0 && ms < 1000.0, "{ms} ms");
    assert!(buf.to_vec(&s1).unwrap().iter().all(|&v| v == 4.0));
    assert!(s1.is_idle().unwrap());
}

#[test]
#[ignore = "needs a CUDA device"]
fn pinned_buffers_are_host_slices() {
    let (ctx, stream, _) = setup();
    let mut pinned = PinnedBuffer::<f32>::zeroed(&ctx, 777).unwrap();
    assert!(pinned.iter().all(|&v| v == 0.0));
    pinned.copy_from_slice(&data(777, 8));
    let dev = DeviceBuffer::from_host(&stream, &pinned).unwrap();
    assert_eq!(dev.to_vec(&stream).unwrap(), data(777, 8));
}

#[test]
#[ignore = "needs a CUDA device"]
fn embedded_images_load_once_per_context_and_kernels_are_cached() {
    static IMAGE: &[u8] = TEST_KERNELS;
    let (ctx, _stream, _) = setup();
    let a = Module::embedded(&ctx, IMAGE).unwrap();
    let b = Module::embedded(&ctx, IMAGE).unwrap();
    assert_eq!(
        a.as_raw(),
        b.as_raw(),
        "one loaded module per image and context"
    );
    let (k1, k2) = (a.kernel("axpy_f32").unwrap(), b.kernel("axpy_f32").unwrap());
    assert_eq!(k1.as_raw(), k2.as_raw());
    assert_eq!(k1.param_sizes(), k2.param_sizes());
    assert_eq!(k2.name(), "axpy_f32");
    assert!(
        a.kernel("no_such_kernel").is_err(),
        "a failed lookup is not cached as a hit"
    );
}
