//! GPU tests of the 0.2 API: buffer views and their keep-alive, device writes through `&`,
//! `KernelArg` for borrowed and shared buffers, capture closures that return values or the
//! caller's errors, exec drops that wait for their own launches only, node handles that stay
//! valid after an update or a reinstantiation, and refused conditional defaults.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_graph::half::{bf16, f16};
use cuda_graph::{
    CaptureMode, ConditionalHandle, DeviceBuffer, Error, Graph, GraphExec, InstantiateFlags,
    LaunchConfig, PinnedBuffer, Stream, UpdateOutcome, kernel_args,
};

mod common;
use common::{Gpu, POISON, assert_all};

const N: u32 = 1000;

fn cfg(n: u32) -> LaunchConfig {
    LaunchConfig::for_elements(n, 128)
}

#[test]
#[ignore = "needs a CUDA device"]
fn views_write_only_their_range_and_reinterpret_the_same_bytes() {
    let gpu = Gpu::new(N);
    let set = gpu.k("set_f32");
    let buf = gpu.buf();
    let (head, tail) = buf.split_at(400).unwrap();
    let mid = tail.slice(100..300).unwrap(); // elements 500..700 of buf
    assert_eq!((head.len(), tail.len(), mid.len()), (400, 600, 200));
    assert_eq!(mid.as_raw(), buf.as_raw() + 500 * 4);
    assert!(mid.overlaps(&tail) && !mid.overlaps(&head));
    // SAFETY: set_f32 writes n floats of its buffer; each view has n elements.
    unsafe {
        gpu.stream
            .launch(&set, &cfg(200), &kernel_args![&mid, 3.0f32, 200u32])
            .unwrap();
        gpu.stream
            .launch(&set, &cfg(400), &kernel_args![head, -1.0f32, 400u32])
            .unwrap();
    }
    let v = gpu.read(&buf);
    for (i, &x) in v.iter().enumerate() {
        let want = match i {
            0..400 => -1.0,
            500..700 => 3.0,
            _ => f32::from_bits(POISON),
        };
        assert_eq!(x.to_bits(), want.to_bits(), "buf[{i}]");
    }
    // The same bytes seen as u8 and u32.
    let bytes = mid.reinterpret::<u8>().unwrap();
    assert_eq!(bytes.len(), 800);
    let b = bytes.to_vec(&gpu.stream).unwrap();
    assert_eq!(&b[..4], &3.0f32.to_le_bytes());
    let words = buf.slice(500..502).unwrap().reinterpret::<u32>().unwrap();
    assert_eq!(words.to_vec(&gpu.stream).unwrap(), [3.0f32.to_bits(); 2]);
    // bf16 and f16 are element types: 2 bytes, bit-exact round trips.
    let halves = buf.slice(0..2).unwrap().reinterpret::<bf16>().unwrap();
    assert_eq!(halves.len(), 4);
    let h: Vec<f16> = (0..8).map(|i| f16::from_f32(i as f32 * 0.5)).collect();
    let hb = DeviceBuffer::from_host(&gpu.stream, &h).unwrap();
    assert_eq!(hb.to_vec(&gpu.stream).unwrap(), h);
}

#[test]
#[ignore = "needs a CUDA device"]
fn bad_views_are_errors_that_name_the_input() {
    let gpu = Gpu::new(N);
    let buf = gpu.buf();
    let e = buf.slice(10..1001).unwrap_err().to_string();
    assert!(e.contains("1000 elements"), "{e}");
    #[allow(clippy::reversed_empty_ranges)]
    let e = buf.slice(20..10).unwrap_err().to_string();
    assert!(e.contains("slice"), "{e}");
    assert!(buf.split_at(1001).is_err());
    let bytes = buf.reinterpret::<u8>().unwrap();
    let e = bytes
        .slice(1..5)
        .unwrap()
        .reinterpret::<f32>()
        .unwrap_err()
        .to_string();
    assert!(e.contains("aligned"), "{e}");
    let e = bytes
        .slice(0..6)
        .unwrap()
        .reinterpret::<f32>()
        .unwrap_err()
        .to_string();
    assert!(e.contains("multiple of 4"), "{e}");
    // Copies between overlapping views are refused before anything is enqueued.
    let (a, b) = (buf.slice(0..10).unwrap(), buf.slice(5..15).unwrap());
    assert!(matches!(
        a.copy_from_device(&gpu.stream, &b),
        Err(Error::InvalidArgument(_))
    ));
    // A copy onto the same view is a no-op, not an error.
    a.copy_from_device(&gpu.stream, &a.share()).unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn graphs_keep_views_alive_after_every_handle_is_dropped() {
    let gpu = Gpu::new(N);
    let set = gpu.k("set_f32");
    let out = gpu.buf();
    let exec = {
        let parent = DeviceBuffer::<f32>::alloc(&gpu.ctx, 4 * N as usize).unwrap();
        let view = parent.slice(N as usize..2 * N as usize).unwrap();
        // Written once before capture: initcheck judges a graph's copy nodes when the graph
        // is launched, before the kernel ahead of the copy has run, and would report the
        // copy's source as uninitialized otherwise. The kernel overwrites it at every replay.
        parent.memset_bytes(&gpu.stream, 0).unwrap();
        gpu.stream.synchronize().unwrap();
        let graph = gpu
            .stream
            .capture(CaptureMode::ThreadLocal, |s| {
                // SAFETY: set_f32 writes N floats of the N-element view.
                unsafe {
                    s.stream()
                        .launch(&set, &cfg(N), &kernel_args![&view, 7.0f32, N])
                }?;
                out.copy_from_device(s.stream(), &view)
            })
            .unwrap();
        GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap()
        // parent, view and graph are dropped here
    };
    // Allocations made now would reuse the views' memory had it been freed.
    let decoys: Vec<DeviceBuffer<f32>> = (0..8).map(|_| gpu.buf()).collect();
    gpu.poison(&out);
    gpu.run(&exec);
    assert_all(&gpu.read(&out), 7.0, "out after replay");
    for d in &decoys {
        assert!(
            gpu.read(d).iter().all(|x| x.to_bits() == POISON),
            "decoy untouched"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn kernel_args_take_borrowed_and_shared_buffers() {
    let gpu = Gpu::new(N);
    let add = gpu.k("add_f32");
    let x = gpu.buf();
    x.copy_from_host(&gpu.stream, &vec![1.0; N as usize])
        .unwrap();
    let shared = Arc::new(x);
    let borrowed: &DeviceBuffer<f32> = &shared;
    // SAFETY: add_f32 touches N floats of the N-element buffer.
    unsafe {
        gpu.stream
            .launch(&add, &cfg(N), &kernel_args![borrowed, 1.0f32, N])
            .unwrap();
        gpu.stream
            .launch(&add, &cfg(N), &kernel_args![shared, 2.0f32, N])
            .unwrap();
    }
    assert_all(&gpu.read(&shared), 4.0, "x + 1 + 2");
}

#[derive(Debug)]
struct MyError(u32);

impl std::fmt::Display for MyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "my error {}", self.0)
    }
}

impl std::error::Error for MyError {}

#[test]
#[ignore = "needs a CUDA device"]
fn capture_closures_return_values_and_carry_the_callers_errors() {
    let gpu = Gpu::new(N);
    let set = gpu.k("set_f32");
    let pool = cuda_graph::GraphPool::new(&gpu.ctx, 1 << 20).unwrap();
    let (graph, tmp) = gpu
        .stream
        .capture_with(CaptureMode::ThreadLocal, |s| {
            let tmp = pool.alloc::<f32>(N as usize)?;
            // SAFETY: set_f32 writes N floats of the N-element pool buffer.
            unsafe {
                s.stream()
                    .launch(&set, &cfg(N), &kernel_args![&tmp, 5.0f32, N])
            }?;
            Ok(tmp)
        })
        .unwrap();
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
    gpu.run(&exec);
    assert_all(&gpu.read(&tmp), 5.0, "the buffer the closure returned");

    let err = gpu
        .stream
        .capture(CaptureMode::ThreadLocal, |_| {
            Err(Error::external(MyError(42)))
        })
        .unwrap_err();
    match &err {
        Error::External(e) => assert_eq!(e.downcast_ref::<MyError>().map(|m| m.0), Some(42)),
        other => panic!("expected External, got {other:?}"),
    }
    assert_eq!(err.to_string(), "my error 42");
    // The stream is usable again.
    gpu.stream.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn dropping_a_launched_exec_waits_for_its_own_launches_not_the_context() {
    let gpu = Gpu::new(N);
    let spin = gpu.k("spin_until_set");
    let add = gpu.k("add_f32");
    let flag = PinnedBuffer::<u32>::zeroed(&gpu.ctx, 1).unwrap();
    let flag_addr = flag.as_ptr() as u64; // host-mapped: the same address on the device
    let busy = Stream::new(&gpu.ctx).unwrap();
    // SAFETY: spin_until_set reads one u32 at a pinned, device-mapped host address that lives
    // until the stream is synchronized below.
    unsafe {
        busy.launch(&spin, &LaunchConfig::linear(1, 1), &kernel_args![flag_addr])
            .unwrap()
    };
    // A watchdog releases the spinning kernel if the drop below waited for the whole context
    // (it would never return otherwise).
    let addr = flag.as_ptr() as usize;
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watchdog = std::thread::spawn({
        let done = done.clone();
        move || {
            let start = Instant::now();
            while !done.load(std::sync::atomic::Ordering::Acquire)
                && start.elapsed() < Duration::from_secs(20)
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            // SAFETY: the pinned flag outlives the test body, which joins this thread.
            unsafe { std::ptr::write_volatile(addr as *mut u32, 1) };
        }
    });

    let x = gpu.buf();
    x.copy_from_host(&gpu.stream, &vec![0.0; N as usize])
        .unwrap();
    let graph = gpu
        .stream
        .capture(CaptureMode::ThreadLocal, |s| {
            // SAFETY: add_f32 touches N floats of x.
            unsafe {
                s.stream()
                    .launch(&add, &cfg(N), &kernel_args![&x, 1.0f32, N])
            }
        })
        .unwrap();
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
    for _ in 0..3 {
        exec.launch(&gpu.stream).unwrap();
    }
    let t0 = Instant::now();
    drop(exec);
    let dropped_after = t0.elapsed();
    assert!(
        dropped_after < Duration::from_secs(10),
        "dropping the exec took {dropped_after:?}: it waited for unrelated work"
    );
    assert!(
        busy.is_idle().is_ok_and(|idle| !idle),
        "the other stream still spins"
    );
    assert_all(
        &gpu.read(&x),
        3.0,
        "the three launches finished before the drop returned",
    );
    done.store(true, std::sync::atomic::Ordering::Release);
    watchdog.join().unwrap();
    busy.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn node_handles_stay_valid_after_update_or_reinstantiate() {
    let gpu = Gpu::new(N);
    let set = gpu.k("set_f32");
    let x = gpu.buf();
    let build = |v: f32, extra: bool| {
        let mut g = Graph::new(&gpu.ctx).unwrap();
        // SAFETY: set_f32 writes N floats of x.
        let k = unsafe { g.add_kernel(&[], &set, &cfg(N), &kernel_args![&x, v, N]) }.unwrap();
        if extra {
            g.add_empty(&[k.node()]).unwrap();
        }
        (g, k)
    };
    let (g1, k1) = build(1.0, false);
    let mut exec = GraphExec::instantiate(&g1, InstantiateFlags::empty()).unwrap();
    gpu.run(&exec);
    assert_all(&gpu.read(&x), 1.0, "first graph");

    // Same topology: updated in place; the new graph's handle drives per-node updates.
    let (g2, k2) = build(2.0, false);
    assert_eq!(
        exec.update_or_reinstantiate(&g2, InstantiateFlags::empty())
            .unwrap(),
        UpdateOutcome::Updated
    );
    // SAFETY: as above.
    unsafe { exec.set_kernel_params(&k2, &set, &cfg(N), &kernel_args![&x, 3.0f32, N]) }.unwrap();
    gpu.run(&exec);
    assert_all(&gpu.read(&x), 3.0, "set through the updated graph's handle");
    // The first graph's handle still works too.
    // SAFETY: as above.
    unsafe { exec.set_kernel_params(&k1, &set, &cfg(N), &kernel_args![&x, 4.0f32, N]) }.unwrap();
    gpu.run(&exec);
    assert_all(&gpu.read(&x), 4.0, "set through the first graph's handle");
    exec.set_node_enabled(k2, false).unwrap();
    gpu.poison(&x);
    gpu.run(&exec);
    assert!(
        gpu.read(&x).iter().all(|v| v.to_bits() == POISON),
        "disabled via k2"
    );
    exec.set_node_enabled(k2, true).unwrap();

    // Another topology: reinstantiated; its handle works the same way.
    let (g3, k3) = build(5.0, true);
    assert_eq!(
        exec.update_or_reinstantiate(&g3, InstantiateFlags::empty())
            .unwrap(),
        UpdateOutcome::Reinstantiated
    );
    // SAFETY: as above.
    unsafe { exec.set_kernel_params(&k3, &set, &cfg(N), &kernel_args![&x, 6.0f32, N]) }.unwrap();
    gpu.run(&exec);
    assert_all(
        &gpu.read(&x),
        6.0,
        "set through the reinstantiated graph's handle",
    );
    drop((g1, g2, g3));
    // SAFETY: as above.
    unsafe { exec.set_kernel_params(&k3, &set, &cfg(N), &kernel_args![&x, 7.0f32, N]) }.unwrap();
    gpu.run(&exec);
    assert_all(&gpu.read(&x), 7.0, "after the graphs were dropped");
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_default_without_reset_each_launch_is_refused() {
    let gpu = Gpu::new(N);
    let mut g = Graph::new(&gpu.ctx).unwrap();
    let e = ConditionalHandle::new(&mut g, 1, false).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert!(e.to_string().contains("reset_each_launch"), "{e}");
    // A zero default without reset, and any default with reset, are fine.
    ConditionalHandle::new(&mut g, 0, false).unwrap();
    ConditionalHandle::new(&mut g, 1, true).unwrap();
}
