//! Threads: captures on several threads at once, one exec shared by launching threads, an
//! exec dropped on another thread while it runs, and the `Send`/`Sync` status of every public
//! type (checked at compile time, so that test runs everywhere; the GPU tests move and share
//! the handles whose `unsafe impl`s claim it).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use cuda_graph::{
    CaptureMode, DeviceBuffer, Error, Event, Graph, GraphExec, InstantiateFlags, LaunchConfig,
    MemPool, Node, PinnedBuffer, Stream, kernel_args,
};

mod common;
use common::{Gpu, POISON, assert_all};
#[path = "common/watchdog.rs"]
mod watchdog;
use watchdog::Watchdog;

fn cfg(n: u32) -> LaunchConfig {
    LaunchConfig::for_elements(n, 128)
}

/// Capturing threads of the first test.
const THREADS: usize = 8;
/// Kernels in each thread's chain.
const STEPS: usize = 24;

/// What thread `t`'s chain leaves in x and y, computed on the host with the same f32
/// operations: x = t + 1, then per step `x += i + t` or (every third) `x *= 0.5`; y = 100 + t
/// on a forked stream, then y = 2x + y.
fn reference(t: usize) -> (f32, f32) {
    let mut x = t as f32 + 1.0;
    for i in 0..STEPS {
        if i % 3 == 2 {
            x *= 0.5;
        } else {
            x += (i + t) as f32;
        }
    }
    (x, 2.0 * x + (100 + t) as f32)
}

/// What a capturing thread hands back to the main thread: moving these across threads is
/// part of the test (`Graph`, `Stream`, `DeviceBuffer`, `PinnedBuffer`, `Event` and node
/// handles are `Send`).
struct Captured {
    t: usize,
    graph: Graph,
    nodes: Vec<Node>,
    x: DeviceBuffer<f32>,
    y: DeviceBuffer<f32>,
    /// x and y as the thread's last replay left them, read into pinned memory.
    host: PinnedBuffer<f32>,
    /// Recorded on the thread's stream after its last replay.
    done: Event,
    stream: Stream,
}

#[test]
#[ignore = "needs a CUDA device"]
fn threads_capture_their_own_streams_at_the_same_time() {
    const N: u32 = 4096;
    let _watchdog = Watchdog::arm("threads_capture_their_own_streams_at_the_same_time", {
        Duration::from_secs(120)
    });
    let gpu = Gpu::new(N);
    // Shared by every thread: the context (`Arc<Context>`), the module (cloned), a memory
    // pool (`Arc<MemPool>`).
    let pool = MemPool::new(&gpu.ctx).unwrap();
    // Threads begin capturing together, and all captures are running (between the first
    // and the second wait of `inside`) while a thread that does not capture allocates and
    // frees device memory and loads a module: under thread-local mode that is legal, and
    // invalidates none of the captures.
    let start = Barrier::new(THREADS);
    let inside = Barrier::new(THREADS + 1);
    let results: Vec<Captured> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (ctx, module, pool) = (&gpu.ctx, gpu.module.clone(), &pool);
                let (start, inside) = (&start, &inside);
                s.spawn(move || {
                    // Kernel lookups from every thread at once go through the module's cache.
                    let (set, add, mul, axpy) = (
                        module.kernel("set_f32").unwrap(),
                        module.kernel("add_f32").unwrap(),
                        module.kernel("mul_f32").unwrap(),
                        module.kernel("axpy_f32").unwrap(),
                    );
                    let stream = Stream::new(ctx).unwrap();
                    let x =
                        DeviceBuffer::<f32>::alloc_from_pool(&stream, pool, N as usize).unwrap();
                    let y =
                        DeviceBuffer::<f32>::alloc_from_pool(&stream, pool, N as usize).unwrap();
                    stream.synchronize().unwrap();
                    start.wait();
                    let graph = stream
                        .capture(CaptureMode::ThreadLocal, |scope| {
                            inside.wait();
                            let s = scope.stream();
                            // SAFETY: each kernel touches N floats of the N-element x and y.
                            unsafe {
                                s.launch(&set, &cfg(N), &kernel_args![&x, t as f32 + 1.0, N])?;
                                for i in 0..STEPS {
                                    if i % 3 == 2 {
                                        s.launch(&mul, &cfg(N), &kernel_args![&x, 0.5f32, N])?;
                                    } else {
                                        let v = (i + t) as f32;
                                        s.launch(&add, &cfg(N), &kernel_args![&x, v, N])?;
                                    }
                                }
                                let side = scope.fork()?;
                                let y0 = (100 + t) as f32;
                                side.launch(&set, &cfg(N), &kernel_args![&y, y0, N])?;
                                scope.join(&side)?;
                                let s = scope.stream();
                                s.launch(&axpy, &cfg(N), &kernel_args![2.0f32, &x, &y, N])?;
                            }
                            inside.wait();
                            Ok(())
                        })
                        .unwrap_or_else(|e| panic!("thread {t}: capture failed: {e}"));
                    let nodes = graph.nodes().unwrap();
                    // Replays on this thread, each checked from poisoned buffers.
                    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
                    let (want_x, want_y) = reference(t);
                    let mut host = PinnedBuffer::<f32>::zeroed(ctx, 2 * N as usize).unwrap();
                    for replay in 0..5 {
                        x.fill_u32_bits(&stream, POISON).unwrap();
                        y.fill_u32_bits(&stream, POISON).unwrap();
                        exec.launch(&stream).unwrap();
                        let (hx, hy) = host.split_at_mut(N as usize);
                        x.copy_to_host(&stream, hx).unwrap();
                        y.copy_to_host(&stream, hy).unwrap();
                        assert_all(hx, want_x, &format!("thread {t} replay {replay}: x"));
                        assert_all(hy, want_y, &format!("thread {t} replay {replay}: y"));
                    }
                    let done = Event::for_sync(ctx).unwrap();
                    exec.launch(&stream).unwrap();
                    done.record(&stream).unwrap();
                    Captured {
                        t,
                        graph,
                        nodes,
                        x,
                        y,
                        host,
                        done,
                        stream,
                    }
                })
            })
            .collect();
        // The thread that does not capture: synchronous allocations and frees, and a module
        // load, while every capture runs.
        s.spawn(|| {
            inside.wait();
            for _ in 0..16 {
                let b = DeviceBuffer::<u8>::alloc(&gpu.ctx, 1 << 20).unwrap();
                drop(b);
            }
            let m = cuda_graph::Module::from_image(&gpu.ctx, common::FATBIN).unwrap();
            m.kernel("count_up").unwrap();
            inside.wait();
        });
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });

    // Back on the main thread: each thread's last replay, read through its event; then each
    // graph instantiated again here and replayed on the main stream.
    for c in &results {
        let (want_x, want_y) = reference(c.t);
        c.done.synchronize().unwrap();
        let (hx, hy) = c.host.split_at(N as usize);
        assert_all(hx, want_x, &format!("thread {}: pinned x", c.t));
        assert_all(hy, want_y, &format!("thread {}: pinned y", c.t));
        assert_eq!(c.nodes.len(), STEPS + 3, "thread {}: nodes", c.t);
        assert!(c.stream.is_idle().unwrap());
    }
    for c in &results {
        let exec = GraphExec::instantiate(&c.graph, InstantiateFlags::empty()).unwrap();
        gpu.poison(&c.x);
        gpu.poison(&c.y);
        gpu.run(&exec);
        let (want_x, want_y) = reference(c.t);
        assert_all(&gpu.read(&c.x), want_x, &format!("thread {}: x", c.t));
        assert_all(&gpu.read(&c.y), want_y, &format!("thread {}: y", c.t));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_invalidated_capture_on_one_thread_leaves_the_others_intact() {
    const N: u32 = 1024;
    let _watchdog = Watchdog::arm(
        "an_invalidated_capture_on_one_thread_leaves_the_others_intact",
        Duration::from_secs(60),
    );
    let gpu = Gpu::new(N);
    let inside = Barrier::new(4);
    std::thread::scope(|s| {
        for t in 0..4u32 {
            let (gpu, inside) = (&gpu, &inside);
            s.spawn(move || {
                let set = gpu.k("set_f32");
                let stream = Stream::new(&gpu.ctx).unwrap();
                let x = gpu.buf();
                let r = stream.capture(CaptureMode::ThreadLocal, |scope| {
                    inside.wait();
                    // SAFETY: set_f32 writes N floats of x.
                    unsafe {
                        scope
                            .stream()
                            .launch(&set, &cfg(N), &kernel_args![&x, t as f32, N])
                    }?;
                    if t == 0 {
                        // Illegal on a capturing stream: invalidates this capture only.
                        let _ = scope.stream().synchronize();
                    }
                    inside.wait();
                    Ok(())
                });
                match (t, r) {
                    (0, Err(Error::CaptureInvalidated { call, .. })) => {
                        assert_eq!(call, "cuStreamSynchronize");
                    }
                    (0, other) => panic!("thread 0: expected CaptureInvalidated, got {other:?}"),
                    (_, Ok(graph)) => {
                        let exec =
                            GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
                        exec.launch(&stream).unwrap();
                        exec.synchronize().unwrap();
                        let v = x.to_vec(&stream).unwrap();
                        assert_all(&v, t as f32, &format!("thread {t}"));
                    }
                    (_, Err(e)) => panic!("thread {t}: another thread's invalidation hit: {e}"),
                }
                // The invalidated thread's stream is usable again.
                stream.synchronize().unwrap();
            });
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn one_exec_launched_from_two_threads_runs_every_launch_once_in_turn() {
    // Large enough that each launch takes a while, so that overlapping launches would lose
    // increments (add_f32 reads and writes x without atomics).
    const N: u32 = 1 << 22;
    const PER_THREAD: usize = 400;
    let _watchdog = Watchdog::arm(
        "one_exec_launched_from_two_threads_runs_every_launch_once_in_turn",
        Duration::from_secs(120),
    );
    let gpu = Gpu::new(N);
    let add = gpu.k("add_f32");
    let x = gpu.buf();
    x.memset_bytes(&gpu.stream, 0).unwrap();
    gpu.stream.synchronize().unwrap();
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
    let launching = AtomicBool::new(true);
    std::thread::scope(|s| {
        let launchers: Vec<_> = (0..2)
            .map(|t| {
                let (exec, ctx) = (&exec, &gpu.ctx);
                s.spawn(move || {
                    // Each thread launches on a stream of its own.
                    let stream = Stream::new(ctx).unwrap();
                    for i in 0..PER_THREAD {
                        exec.launch(&stream).unwrap();
                        if t == 1 && i % 100 == 0 {
                            // Uploads are serialised with the launches too.
                            exec.upload(&stream).unwrap();
                        }
                    }
                    stream.synchronize().unwrap();
                })
            })
            .collect();
        // A third thread waits for the exec's latest launch, again and again, meanwhile.
        s.spawn(|| {
            while launching.load(Ordering::Acquire) {
                exec.synchronize().unwrap();
            }
        });
        for l in launchers {
            l.join().unwrap();
        }
        launching.store(false, Ordering::Release);
    });
    exec.synchronize().unwrap();
    assert_all(
        &gpu.read(&x),
        (2 * PER_THREAD) as f32,
        "x after every launch of both threads",
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_exec_dropped_on_another_thread_while_it_runs_keeps_its_memory_until_done() {
    const N: u32 = 1 << 16;
    let gpu = Gpu::new(N);
    let spin = gpu.k("spin_until_set");
    let set = gpu.k("set_f32");
    let flag = PinnedBuffer::<u32>::zeroed(&gpu.ctx, 1).unwrap();
    let flag_addr = flag.as_ptr() as u64; // host-mapped: the same address on the device
    // Releases the spinning kernel after a while whatever happens, so a failing test ends.
    let addr = flag.as_ptr() as usize;
    let released = Arc::new(AtomicBool::new(false));
    let watchdog = std::thread::spawn({
        let released = released.clone();
        move || {
            let start = Instant::now();
            while !released.load(Ordering::Acquire) && start.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(10));
            }
            // SAFETY: the pinned flag outlives this thread, which the test joins.
            unsafe { std::ptr::write_volatile(addr as *mut u32, 1) };
        }
    });

    let work = Stream::new(&gpu.ctx).unwrap();
    // Stream-ordered memory: its free (cuMemFreeAsync on `alloc_stream`) does not wait for
    // the device, so a free made too early would hand the range to the next allocation on
    // that stream while the graph still writes it.
    let alloc_stream = Stream::new(&gpu.ctx).unwrap();
    let out = gpu.buf();
    let (exec, tmp_range) = {
        let tmp = DeviceBuffer::<f32>::alloc_async(&alloc_stream, N as usize).unwrap();
        alloc_stream.synchronize().unwrap();
        let graph = work
            .capture(CaptureMode::ThreadLocal, |s| {
                // SAFETY: spin_until_set reads one u32 at a pinned, device-mapped address that
                // outlives the launch; set_f32 writes N floats of tmp.
                unsafe {
                    s.stream().launch(
                        &spin,
                        &LaunchConfig::linear(1, 1),
                        &kernel_args![flag_addr],
                    )?;
                    s.stream()
                        .launch(&set, &cfg(N), &kernel_args![&tmp, 7.0f32, N])?;
                }
                out.copy_from_device(s.stream(), &tmp)
            })
            .unwrap();
        let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
        (exec, (tmp.as_raw(), tmp.bytes()))
        // tmp and graph are dropped here: only the exec keeps tmp's memory (and the graph
        // object) alive.
    };
    exec.launch(&work).unwrap();

    // The exec moves to another thread and is dropped there while its launch spins.
    let dropped = Arc::new(AtomicBool::new(false));
    let dropper = std::thread::spawn({
        let dropped = dropped.clone();
        move || {
            drop(exec);
            dropped.store(true, Ordering::Release);
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    // Decoys of the same size from the same stream and pool: had the drop freed tmp, they
    // would get its range back.
    let decoys: Vec<DeviceBuffer<f32>> = (0..8)
        .map(|_| DeviceBuffer::alloc_async(&alloc_stream, N as usize).unwrap())
        .collect();
    for d in &decoys {
        let (a, b) = (d.as_raw(), d.as_raw() + d.bytes() as u64);
        let (ta, tb) = (tmp_range.0, tmp_range.0 + tmp_range.1 as u64);
        assert!(
            b <= ta || tb <= a,
            "a decoy got the in-flight graph's memory"
        );
        d.fill_u32_bits(&alloc_stream, POISON).unwrap();
    }
    alloc_stream.synchronize().unwrap();
    assert!(
        !dropped.load(Ordering::Acquire),
        "the drop returned while the exec's launch still ran"
    );

    released.store(true, Ordering::Release);
    watchdog.join().unwrap();
    dropper.join().unwrap();
    assert!(dropped.load(Ordering::Acquire));
    assert_all(&gpu.read(&out), 7.0, "the graph's output");
    for d in &decoys {
        let v = d.to_vec(&alloc_stream).unwrap();
        assert!(
            v.iter().all(|x| x.to_bits() == POISON),
            "a decoy was written"
        );
    }
    work.synchronize().unwrap();
}

/// Compile-time checks of `Send` and `Sync`: `assert_send::<T>()` does not compile unless
/// `T: Send`; `assert_not_impl!(T: Sync)` does not compile if `T: Sync` (the
/// `static_assertions` trick: with the trait implemented, the method call is ambiguous).
fn assert_send<T: Send>() {}
fn assert_sync<T: Sync>() {}

macro_rules! assert_not_impl {
    ($t:ty: $tr:path) => {
        const _: fn() = || {
            trait AmbiguousIfImpl<A> {
                fn some_item() {}
            }
            impl<T: ?Sized> AmbiguousIfImpl<()> for T {}
            #[allow(dead_code)]
            struct Invalid;
            impl<T: ?Sized + $tr> AmbiguousIfImpl<Invalid> for T {}
            let _ = <$t as AmbiguousIfImpl<_>>::some_item;
        };
    };
}

// A graph moves between threads but is never shared: graph objects are not thread-safe.
assert_not_impl!(cuda_graph::Graph: Sync);
// A capture ends on the thread that began it.
assert_not_impl!(cuda_graph::CaptureScope<'static>: Send);
assert_not_impl!(cuda_graph::CaptureScope<'static>: Sync);
// Argument lists point into the caller's values for one call.
assert_not_impl!(cuda_graph::KernelArgs<'static>: Send);
assert_not_impl!(cuda_graph::KernelArgs<'static>: Sync);

#[test]
fn public_types_are_send_and_sync_as_documented() {
    use cuda_graph::*;
    macro_rules! send_sync {
        ($($t:ty),* $(,)?) => { $( assert_send::<$t>(); assert_sync::<$t>(); )* };
    }
    // Handles with an `unsafe impl` (the SAFETY comments say why), and what holds them.
    send_sync!(
        Context,
        Arc<Context>,
        Stream,
        Event,
        GraphExec,
        Module,
        Kernel,
        MemPool,
        PinnedBuffer<f32>,
        NodeId,
    );
    // Types that are Send and Sync through their fields.
    send_sync!(
        DeviceBuffer<f32>,
        DeviceBuffer<half::bf16>,
        Allocation,
        GraphPool,
        pool::PoolInner,
        Resource,
        Node,
        NodeKind,
        KernelNode,
        MemcpyNode,
        MemsetNode,
        HostNode,
        ChildGraphNode,
        EmptyNode,
        EventRecordNode,
        EventWaitNode,
        MemAllocNode,
        MemFreeNode,
        ConditionalNode,
        Edge,
        EdgeKind,
        MemsetValue,
        ConditionalHandle,
        ConditionalKind,
        ConditionSource<'static>,
        CaptureMode,
        CaptureStatus,
        LaunchConfig,
        LaunchAttribute,
        InstantiateFlags,
        EventFlags,
        UpdateOutcome,
        UpdateReason,
        Error,
        driver::Device,
        driver::DriverVersion,
        driver::Feature,
        driver::GraphMemUsage,
    );
    // `Graph`: Send only (the negative half is the `assert_not_impl!` above).
    assert_send::<Graph>();
}

/// A `Graph` edited on one thread while another thread runs per-node setters of an exec made
/// from it: the setters look their node handles up through that graph object, and the two
/// sides share its lock, so every setter takes effect and the edits all land.
#[test]
#[ignore = "needs a CUDA device"]
fn graph_edits_and_exec_setters_on_two_threads_are_serialized() {
    const N: u32 = 4096;
    let gpu = Gpu::new(N);
    let set = gpu.k("set_f32");
    let x = gpu.buf();
    let mut graph = Graph::new(&gpu.ctx).unwrap();
    // SAFETY: set_f32 writes N floats of x.
    let k = unsafe { graph.add_kernel(&[], &set, &cfg(N), &kernel_args![&x, 0.0f32, N]) }.unwrap();
    let mut exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
    const EDITS: usize = 2000;
    let editor = std::thread::spawn(move || {
        // The graph moves here and grows while the exec's setters run on the test thread.
        let mut last = k.node();
        for _ in 0..EDITS {
            last = graph.add_empty(&[last]).unwrap().node();
        }
        graph.nodes().unwrap().len()
    });
    for i in 0..200u32 {
        let v = i as f32;
        // SAFETY: as above.
        unsafe { exec.set_kernel_params(&k, &set, &cfg(N), &kernel_args![&x, v, N]) }.unwrap();
        gpu.run(&exec);
        assert_all(&gpu.read(&x), v, "x after the setter");
    }
    assert_eq!(editor.join().unwrap(), EDITS + 1, "every edit landed");
}

/// Every stream-ordered call made on a thread where no context is current (each on a fresh
/// thread of its own, so none relies on an earlier call's binding): the handles were made on
/// the main thread, and each call makes its stream's context current itself (the driver
/// refuses a kernel launch, and may refuse the rest, from a thread with none).
#[test]
#[ignore = "needs a CUDA device"]
fn stream_ordered_calls_work_from_threads_with_no_current_context() {
    const N: u32 = 4096;
    let gpu = Gpu::new(N);
    let (set, add_pdl) = (gpu.k("set_f32"), gpu.k("add_one_pdl"));
    let (x, y) = (gpu.buf(), gpu.buf());
    let other = Stream::new(&gpu.ctx).unwrap();
    let done = Event::for_sync(&gpu.ctx).unwrap();
    let mut graph = Graph::new(&gpu.ctx).unwrap();
    // SAFETY: add_one_pdl reads and writes N floats of y.
    unsafe { graph.add_kernel(&[], &add_pdl, &cfg(N), &kernel_args![&y, N]) }.unwrap();
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
    let s = &gpu.stream;
    let fresh = |what: &str, call: &(dyn Fn() -> cuda_graph::Result<()> + Sync)| {
        std::thread::scope(|t| t.spawn(call).join().unwrap())
            .unwrap_or_else(|e| panic!("{what} on a thread with no current context: {e}"));
    };
    fresh("memset", &|| x.fill_u32_bits(s, 0));
    // SAFETY: set_f32 writes N floats of x; add_one_pdl reads and writes N floats of x.
    fresh("launch", &|| unsafe {
        s.launch(&set, &cfg(N), &kernel_args![&x, 2.0f32, N])
    });
    fresh("programmatic launch", &|| unsafe {
        s.launch_pdl(&add_pdl, &cfg(N), &kernel_args![&x, N])
    });
    fresh("device copy", &|| y.copy_from_device(s, &x));
    fresh("stream-ordered allocation", &|| {
        let b = DeviceBuffer::<f32>::alloc_async(s, N as usize)?;
        b.copy_from_device(s, &y)
    });
    fresh("graph launch", &|| exec.launch(s));
    fresh("event record", &|| done.record(s));
    fresh("event wait", &|| other.wait_event(&done));
    fresh("host wait on the event", &|| done.synchronize());
    fresh("host wait on the stream", &|| s.synchronize());
    // x = 2 + 1, y = x + 1 (the graph's kernel); read back on yet another fresh thread.
    let read = |b: &DeviceBuffer<f32>| {
        std::thread::scope(|t| t.spawn(|| b.to_vec(&other)).join().unwrap()).unwrap()
    };
    assert_all(&read(&x), 3.0, "x");
    assert_all(&read(&y), 4.0, "y");
    fresh("host copies", &|| {
        let mut h = vec![0f32; N as usize];
        x.copy_from_host(s, &h)?;
        y.copy_to_host(s, &mut h)?;
        assert_all(&h, 4.0, "y through copy_to_host");
        Ok(())
    });
    assert_all(&read(&x), 0.0, "x after copy_from_host");
}
