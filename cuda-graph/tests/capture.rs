//! GPU tests of stream capture scopes: replay equals eager, keep-alive, failure handling
//! (error, panic, invalidation, unjoined forks), concurrent thread-local captures, capture
//! into an existing graph, capture status.

use std::sync::{Arc, Barrier, Mutex, MutexGuard};

use cuda_graph::{
    Allocation, CaptureMode, CaptureStatus, Context, DeviceBuffer, Error, Graph, GraphExec,
    InstantiateFlags, Kernel, KernelArgs, LaunchConfig, Module, Stream,
};

const IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/test_kernels.fatbin"));
const BLOCK: u32 = 128;

struct Kernels {
    set: Kernel,
    add: Kernel,
    mul: Kernel,
    axpy: Kernel,
}

impl Kernels {
    fn load(ctx: &Arc<Context>) -> Kernels {
        let module = Module::from_image(ctx, IMAGE).expect("load test_kernels.fatbin");
        Kernels {
            set: module.kernel("set_f32").unwrap(),
            add: module.kernel("add_f32").unwrap(),
            mul: module.kernel("mul_f32").unwrap(),
            axpy: module.kernel("axpy_f32").unwrap(),
        }
    }

    fn cfg(x: &DeviceBuffer<f32>) -> LaunchConfig {
        LaunchConfig::for_elements(x.len() as u32, BLOCK)
    }

    /// `x[i] = v`
    fn set(&self, s: &Stream, x: &DeviceBuffer<f32>, v: f32) -> cuda_graph::Result<()> {
        let n = x.len() as u32;
        // SAFETY: set_f32(float*, float, unsigned) writes x[0..n).
        unsafe {
            s.launch(
                &self.set,
                &Self::cfg(x),
                &KernelArgs::new().arg(x).arg(&v).arg(&n),
            )
        }
    }

    /// `x[i] += v`
    fn add(&self, s: &Stream, x: &DeviceBuffer<f32>, v: f32) -> cuda_graph::Result<()> {
        let n = x.len() as u32;
        // SAFETY: add_f32(float*, float, unsigned) touches x[0..n).
        unsafe {
            s.launch(
                &self.add,
                &Self::cfg(x),
                &KernelArgs::new().arg(x).arg(&v).arg(&n),
            )
        }
    }

    /// `x[i] *= v`
    fn mul(&self, s: &Stream, x: &DeviceBuffer<f32>, v: f32) -> cuda_graph::Result<()> {
        let n = x.len() as u32;
        // SAFETY: mul_f32(float*, float, unsigned) touches x[0..n).
        unsafe {
            s.launch(
                &self.mul,
                &Self::cfg(x),
                &KernelArgs::new().arg(x).arg(&v).arg(&n),
            )
        }
    }

    /// `y[i] = a * x[i] + y[i]`
    fn axpy(
        &self,
        s: &Stream,
        a: f32,
        x: &DeviceBuffer<f32>,
        y: &DeviceBuffer<f32>,
    ) -> cuda_graph::Result<()> {
        assert_eq!(x.len(), y.len());
        let n = y.len() as u32;
        // SAFETY: axpy_f32(float, const float*, float*, unsigned) reads x, writes y, both
        // n elements, distinct buffers.
        unsafe {
            s.launch(
                &self.axpy,
                &Self::cfg(y),
                &KernelArgs::new().arg(&a).arg(x).arg(y).arg(&n),
            )
        }
    }
}

/// Serialises the tests of this binary: a global-mode capture makes `cuMemAlloc` and
/// synchronous copies fail, and invalidates the capture, on *every* thread of the process
/// (the driver's rule), so tests running in parallel threads would break each other's
/// captures. Each test holds this lock for its whole run.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn setup() -> (Arc<Context>, Stream, Kernels) {
    let ctx = Context::default_device().expect("a CUDA device");
    let stream = Stream::new(&ctx).unwrap();
    let k = Kernels::load(&ctx);
    (ctx, stream, k)
}

fn buffer(stream: &Stream, data: &[f32]) -> DeviceBuffer<f32> {
    DeviceBuffer::from_host(stream, data).unwrap()
}

fn poison(stream: &Stream, x: &DeviceBuffer<f32>) {
    x.copy_from_host(stream, &vec![f32::NAN; x.len()]).unwrap();
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn instantiate(g: &Graph) -> GraphExec {
    GraphExec::instantiate(g, InstantiateFlags::empty()).expect("instantiate captured graph")
}

/// Checks that a stream is not capturing and runs eager work: sets a fresh buffer and reads
/// it back.
fn assert_usable(ctx: &Arc<Context>, s: &Stream, k: &Kernels, what: &str) {
    assert_eq!(
        s.capture_status().unwrap(),
        CaptureStatus::None,
        "{what}: still capturing"
    );
    let x = DeviceBuffer::<f32>::alloc(ctx, 77).unwrap();
    poison(s, &x);
    k.set(s, &x, 6.5)
        .unwrap_or_else(|e| panic!("{what}: eager launch: {e}"));
    k.add(s, &x, 0.25).unwrap();
    s.synchronize()
        .unwrap_or_else(|e| panic!("{what}: synchronize: {e}"));
    assert_eq!(
        x.to_vec(s).unwrap(),
        vec![6.75f32; 77],
        "{what}: eager result"
    );
}

// ---------- 1. capture-and-replay equals eager, multi-kernel, multi-stream ----------

const N: usize = 10_007;

struct Bufs {
    a: DeviceBuffer<f32>,
    b: DeviceBuffer<f32>,
    c: DeviceBuffer<f32>,
    d: DeviceBuffer<f32>,
}

fn inputs() -> (Vec<f32>, Vec<f32>) {
    let a = (0..N).map(|i| i as f32 * 0.5 - 100.0).collect();
    let b = (0..N).map(|i| (i % 7) as f32 + 0.125).collect();
    (a, b)
}

impl Bufs {
    fn new(s: &Stream) -> Bufs {
        let (a, b) = inputs();
        let nan = vec![f32::NAN; N];
        Bufs {
            a: buffer(s, &a),
            b: buffer(s, &b),
            c: buffer(s, &nan),
            d: buffer(s, &nan),
        }
    }

    fn reset(&mut self, s: &Stream) {
        let (a, b) = inputs();
        self.a.copy_from_host(s, &a).unwrap();
        self.b.copy_from_host(s, &b).unwrap();
        poison(s, &self.c);
        poison(s, &self.d);
    }

    fn read(&self, s: &Stream) -> [Vec<f32>; 4] {
        [
            self.a.to_vec(s).unwrap(),
            self.b.to_vec(s).unwrap(),
            self.c.to_vec(s).unwrap(),
            self.d.to_vec(s).unwrap(),
        ]
    }
}

// The workload in parts: origin first, two side streams, origin concurrently, then the end.
fn origin_first(k: &Kernels, s: &Stream, x: &Bufs) -> cuda_graph::Result<()> {
    k.add(s, &x.a, 1.5)?;
    k.mul(s, &x.a, 3.0)
}
fn side_one(k: &Kernels, s: &Stream, x: &Bufs) -> cuda_graph::Result<()> {
    k.axpy(s, 0.5, &x.a, &x.b) // B = 0.5 A + B
}
fn side_two(k: &Kernels, s: &Stream, x: &Bufs) -> cuda_graph::Result<()> {
    k.set(s, &x.d, -1.0)?;
    k.axpy(s, 0.125, &x.a, &x.d) // D = 0.125 A - 1
}
fn origin_concurrent(k: &Kernels, s: &Stream, x: &Bufs) -> cuda_graph::Result<()> {
    k.set(s, &x.c, 2.0)?;
    k.add(s, &x.c, 1.0)
}
fn origin_last(k: &Kernels, s: &Stream, x: &Bufs) -> cuda_graph::Result<()> {
    k.axpy(s, 2.0, &x.b, &x.c)?; // C = 2B + C
    k.axpy(s, 1.0, &x.d, &x.c)?; // C += D
    k.mul(s, &x.c, 0.5)
}

/// The host's idea of the result (nvcc contracts `a * x + y` into an FMA, so compare with a
/// tolerance; replay against eager is compared bit for bit).
fn host_reference() -> [Vec<f32>; 4] {
    let (a0, b0) = inputs();
    let a: Vec<f32> = a0.iter().map(|&v| (v + 1.5) * 3.0).collect();
    let b: Vec<f32> = a.iter().zip(&b0).map(|(&a, &b)| 0.5 * a + b).collect();
    let d: Vec<f32> = a.iter().map(|&a| 0.125 * a - 1.0).collect();
    let c: Vec<f32> = b
        .iter()
        .zip(&d)
        .map(|(&b, &d)| (2.0 * b + 3.0 + d) * 0.5)
        .collect();
    [a, b, c, d]
}

#[test]
#[ignore = "needs a CUDA device"]
fn replay_equals_eager_for_a_forked_multi_kernel_workload() {
    let _serial = serial();
    let (ctx, origin, k) = setup();

    // Eager, with plain stream waits.
    let eager_bufs = Bufs::new(&origin);
    let side1 = Stream::new(&ctx).unwrap();
    let side2 = Stream::new(&ctx).unwrap();
    origin_first(&k, &origin, &eager_bufs).unwrap();
    side1.wait_stream(&origin).unwrap();
    side_one(&k, &side1, &eager_bufs).unwrap();
    side2.wait_stream(&origin).unwrap();
    side_two(&k, &side2, &eager_bufs).unwrap();
    origin_concurrent(&k, &origin, &eager_bufs).unwrap();
    origin.wait_stream(&side1).unwrap();
    origin.wait_stream(&side2).unwrap();
    origin_last(&k, &origin, &eager_bufs).unwrap();
    origin.synchronize().unwrap();
    let eager = eager_bufs.read(&origin);
    let reference = host_reference();
    for (name, (got, want)) in ["A", "B", "C", "D"]
        .iter()
        .zip(eager.iter().zip(&reference))
    {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                "eager {name}[{i}] = {g}, host says {w}"
            );
        }
    }

    // Captured, on fresh buffers.
    let mut bufs = Bufs::new(&origin);
    let graph = origin
        .capture(CaptureMode::Global, |s| {
            origin_first(&k, s.stream(), &bufs)?;
            let s1 = s.fork()?;
            side_one(&k, &s1, &bufs)?;
            let s2 = s.fork()?;
            side_two(&k, &s2, &bufs)?;
            origin_concurrent(&k, s.stream(), &bufs)?;
            s.join(&s1)?;
            s.join(&s2)?;
            origin_last(&k, s.stream(), &bufs)
        })
        .expect("capture");
    assert_eq!(origin.capture_status().unwrap(), CaptureStatus::None);
    // Nothing ran during capture: the buffers still hold their inputs / poison.
    let untouched = bufs.read(&origin);
    assert_eq!(
        bits(&untouched[0]),
        bits(&inputs().0),
        "A changed by capture"
    );
    assert!(
        untouched[2].iter().all(|v| v.is_nan()),
        "C changed by capture"
    );

    let exec = instantiate(&graph);
    for replay in 0..3 {
        bufs.reset(&origin);
        exec.launch(&origin).unwrap();
        origin.synchronize().unwrap();
        let got = bufs.read(&origin);
        for (name, (g, e)) in ["A", "B", "C", "D"].iter().zip(got.iter().zip(&eager)) {
            assert_eq!(
                bits(g),
                bits(e),
                "replay {replay}: {name} differs from eager"
            );
        }
    }
}

// ---------- 2. the graph keeps alive what it uses ----------

fn allocation_ptrs(resources: &[cuda_graph::Resource]) -> Vec<u64> {
    resources
        .iter()
        .filter_map(|r| r.downcast_ref::<Allocation>().map(Allocation::ptr))
        .collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn graph_and_exec_keep_captured_buffers_alive() {
    let _serial = serial();
    let (ctx, stream, k) = setup();
    let n = 4099;
    let src_data: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let src = buffer(&stream, &src_data);
    let tmp = DeviceBuffer::<f32>::alloc(&ctx, n).unwrap();
    let out = buffer(&stream, &vec![f32::NAN; n]);
    let (src_ptr, tmp_ptr) = (src.as_raw(), tmp.as_raw());

    let graph = stream
        .capture(CaptureMode::ThreadLocal, |s| {
            k.set(s.stream(), &tmp, 3.0)?;
            k.axpy(s.stream(), 2.0, &src, &tmp)?; // tmp = 2 src + 3
            k.set(s.stream(), &out, 0.0)?;
            k.axpy(s.stream(), 1.0, &tmp, &out) // out = tmp
        })
        .unwrap();
    let held = allocation_ptrs(graph.resources());
    for (what, p) in [("src", src_ptr), ("tmp", tmp_ptr), ("out", out.as_raw())] {
        assert!(held.contains(&p), "graph does not hold {what}: {held:x?}");
    }
    let exec = instantiate(&graph);
    assert!(allocation_ptrs(exec.resources()).contains(&tmp_ptr));
    drop(graph);
    drop(src);
    drop(tmp);

    // Memory still held is not handed out again: new allocations land elsewhere, and
    // filling them cannot disturb the graph's inputs.
    let mut decoys = Vec::new();
    for _ in 0..8 {
        let d = buffer(&stream, &vec![-7.0f32; n]);
        assert_ne!(d.as_raw(), src_ptr, "src memory was freed and reused");
        assert_ne!(d.as_raw(), tmp_ptr, "tmp memory was freed and reused");
        decoys.push(d);
    }
    for _ in 0..2 {
        poison(&stream, &out);
        exec.launch(&stream).unwrap();
        stream.synchronize().unwrap();
        let want: Vec<f32> = src_data.iter().map(|&x| 2.0f32.mul_add(x, 3.0)).collect();
        let got = out.to_vec(&stream).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "out[{i}] = {g}, want {w}"
            );
        }
    }
}

// ---------- 3. the closure returns an error ----------

#[test]
#[ignore = "needs a CUDA device"]
fn closure_error_propagates_and_leaves_the_stream_usable() {
    let _serial = serial();
    let (ctx, stream, k) = setup();
    let x = DeviceBuffer::<f32>::alloc(&ctx, 100).unwrap();
    let mut side_out = None;
    let r = stream.capture(CaptureMode::Global, |s| {
        k.set(s.stream(), &x, 1.0)?;
        let side = s.fork()?;
        k.add(&side, &x, 1.0)?;
        side_out = Some(side); // left unjoined on purpose: the error wins
        Err(Error::InvalidArgument("stop here".into()))
    });
    match r {
        Err(Error::InvalidArgument(m)) => assert_eq!(m, "stop here"),
        other => panic!("expected the closure's error, got {other:?}"),
    }
    assert_usable(&ctx, &stream, &k, "origin");
    assert_usable(&ctx, &side_out.unwrap(), &k, "forked stream");
    // And a second capture on the same stream works.
    let g = stream
        .capture(CaptureMode::Global, |s| k.set(s.stream(), &x, 2.0))
        .expect("capture after a failed one");
    instantiate(&g).launch(&stream).unwrap();
    assert_eq!(x.to_vec(&stream).unwrap(), vec![2.0f32; 100]);
}

// ---------- 4. the closure panics ----------

#[test]
#[ignore = "needs a CUDA device"]
fn closure_panic_ends_the_capture_and_unwinds() {
    let _serial = serial();
    let (ctx, stream, k) = setup();
    let x = DeviceBuffer::<f32>::alloc(&ctx, 100).unwrap();
    let side_out = std::sync::Mutex::new(None);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        stream.capture(CaptureMode::Global, |s| {
            k.set(s.stream(), &x, 1.0)?;
            let side = s.fork()?;
            k.add(&side, &x, 1.0)?;
            *side_out.lock().unwrap() = Some(side);
            panic!("boom inside capture");
        })
    }));
    let payload = r.expect_err("the panic must continue unwinding");
    assert_eq!(
        payload.downcast_ref::<&str>().copied(),
        Some("boom inside capture")
    );
    assert_usable(&ctx, &stream, &k, "origin after panic");
    let side = side_out.lock().unwrap().take().unwrap();
    assert_usable(&ctx, &side, &k, "forked stream after panic");
    // The thread's capture mode was restored: allocation works outside a capture.
    DeviceBuffer::<f32>::alloc(&ctx, 10).expect("cuMemAlloc after the panic");
}

// ---------- 5. synchronize inside a capture ----------

#[test]
#[ignore = "needs a CUDA device"]
fn synchronize_inside_capture_is_capture_invalidated() {
    let _serial = serial();
    let (ctx, stream, k) = setup();
    let x = DeviceBuffer::<f32>::alloc(&ctx, 100).unwrap();

    // Propagated with `?`.
    let r = stream.capture(CaptureMode::Global, |s| {
        k.set(s.stream(), &x, 1.0)?;
        s.stream().synchronize()?;
        k.add(s.stream(), &x, 1.0)
    });
    match &r {
        Err(Error::CaptureInvalidated { call, source }) => {
            assert_eq!(*call, "cuStreamSynchronize", "{r:?}");
            assert!(
                matches!(
                    **source,
                    Error::Driver {
                        call: "cuStreamSynchronize",
                        ..
                    }
                ),
                "source: {source:?}"
            );
        }
        other => panic!("expected CaptureInvalidated, got {other:?}"),
    }
    assert_usable(&ctx, &stream, &k, "after propagated invalidation");

    // Swallowed by the closure, which then even launches more work and returns Ok.
    let r = stream.capture(CaptureMode::ThreadLocal, |s| {
        k.set(s.stream(), &x, 1.0)?;
        let _ = s.stream().synchronize();
        let _ = k.add(s.stream(), &x, 1.0); // 901 on an invalidated capture
        Ok(())
    });
    match &r {
        Err(Error::CaptureInvalidated { call, .. }) => {
            assert_eq!(*call, "cuStreamSynchronize", "{r:?}")
        }
        other => panic!("expected CaptureInvalidated, got {other:?}"),
    }
    assert_usable(&ctx, &stream, &k, "after swallowed invalidation");

    // With a fork that has work: both streams leave the invalidated capture.
    let mut side_out = None;
    let r = stream.capture(CaptureMode::Global, |s| {
        let side = s.fork()?;
        k.set(&side, &x, 1.0)?;
        side_out = Some(side);
        s.stream().synchronize()
    });
    assert!(
        matches!(
            r,
            Err(Error::CaptureInvalidated {
                call: "cuStreamSynchronize",
                ..
            })
        ),
        "{r:?}"
    );
    assert_usable(&ctx, &stream, &k, "origin after invalidation with a fork");
    assert_usable(&ctx, &side_out.unwrap(), &k, "fork after invalidation");
}

// ---------- 5b. invalidated by another thread ----------

#[test]
#[ignore = "needs a CUDA device"]
fn global_capture_invalidated_by_another_thread_names_no_call() {
    let _serial = serial();
    let (ctx, stream, k) = setup();
    let x = DeviceBuffer::<f32>::alloc(&ctx, 100).unwrap();
    let mut other = None;
    let r = stream.capture(CaptureMode::Global, |s| {
        k.set(s.stream(), &x, 1.0)?;
        other = Some(
            std::thread::scope(|t| {
                t.spawn(|| DeviceBuffer::<f32>::alloc(&ctx, 1024).map(|_| ()))
                    .join()
            })
            .expect("allocating thread"),
        );
        k.add(s.stream(), &x, 1.0)
    });
    let other = other.unwrap();
    assert_eq!(
        other.as_ref().err().and_then(Error::code).map(|c| c.0),
        Some(900),
        "cuMemAlloc on another thread during a global capture: {other:?}"
    );
    match &r {
        Err(Error::CaptureInvalidated { call, .. }) => {
            assert_eq!(*call, cuda_graph::UNKNOWN_CAPTURE_CALL, "{r:?}")
        }
        other => panic!("expected CaptureInvalidated, got {other:?}"),
    }
    assert_usable(&ctx, &stream, &k, "after invalidation by another thread");
}

// ---------- 6. cuMemAlloc inside a global capture ----------

#[test]
#[ignore = "needs a CUDA device"]
fn alloc_inside_global_capture_is_capture_invalidated() {
    let _serial = serial();
    let (ctx, stream, k) = setup();
    let x = DeviceBuffer::<f32>::alloc(&ctx, 100).unwrap();
    let r = stream.capture(CaptureMode::Global, |s| {
        k.set(s.stream(), &x, 1.0)?;
        let _tmp = DeviceBuffer::<f32>::alloc(&ctx, 1 << 20)?;
        Ok(())
    });
    match &r {
        Err(Error::CaptureInvalidated { call, source }) => {
            assert_eq!(*call, "cuMemAlloc", "{r:?}");
            assert_eq!(
                source.code().map(|c| c.0),
                Some(900),
                "cuMemAlloc under global capture: {source:?}"
            );
        }
        other => panic!("expected CaptureInvalidated, got {other:?}"),
    }
    assert_usable(&ctx, &stream, &k, "after cuMemAlloc in capture");
}

// ---------- 7. unjoined fork ----------

#[test]
#[ignore = "needs a CUDA device"]
fn unjoined_fork_is_an_error_and_streams_stay_usable() {
    let _serial = serial();
    let (ctx, stream, k) = setup();
    let x = DeviceBuffer::<f32>::alloc(&ctx, 100).unwrap();
    let y = DeviceBuffer::<f32>::alloc(&ctx, 100).unwrap();
    let mut sides = Vec::new();
    let r = stream.capture(CaptureMode::Global, |s| {
        k.set(s.stream(), &x, 1.0)?;
        let joined = s.fork()?;
        k.set(&joined, &y, 1.0)?;
        s.join(&joined)?;
        let idle = s.fork()?; // forked, never used: not unjoined work
        let unjoined = s.fork()?;
        k.add(&unjoined, &y, 1.0)?;
        let rejoined_then_used = s.fork()?;
        s.join(&rejoined_then_used)?;
        k.add(&rejoined_then_used, &y, 1.0)?; // work after its join
        sides.extend([joined, idle, unjoined, rejoined_then_used]);
        k.add(s.stream(), &x, 1.0)
    });
    match r {
        Err(Error::UnjoinedFork { forks }) => assert_eq!(forks, 2),
        other => panic!("expected UnjoinedFork, got {other:?}"),
    }
    assert_usable(&ctx, &stream, &k, "origin");
    for (i, side) in sides.iter().enumerate() {
        assert_usable(&ctx, side, &k, &format!("fork {i}"));
    }
    // An unused fork alone is fine.
    stream
        .capture(CaptureMode::Global, |s| {
            k.set(s.stream(), &x, 5.0)?;
            let _idle = s.fork()?;
            Ok(())
        })
        .expect("a fork without work needs no join");
}

// ---------- 8. concurrent thread-local captures on two threads ----------

#[test]
#[ignore = "needs a CUDA device"]
fn concurrent_thread_local_captures_on_two_threads() {
    let _serial = serial();
    let barrier = Arc::new(Barrier::new(2));
    let workers: Vec<_> = (0..2)
        .map(|t| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let (ctx, stream, k) = setup();
                let n = 3001 + 17 * t;
                let x = DeviceBuffer::<f32>::alloc(&ctx, n).unwrap();
                let y = DeviceBuffer::<f32>::alloc(&ctx, n).unwrap();
                let (v, m) = (1.0 + t as f32, 10.0 + t as f32);
                let graph = stream
                    .capture(CaptureMode::ThreadLocal, |s| {
                        barrier.wait(); // both captures are running
                        assert_eq!(s.stream().capture_status()?, CaptureStatus::Active);
                        k.set(s.stream(), &x, v)?;
                        let side = s.fork()?;
                        k.set(&side, &y, 0.5)?;
                        k.mul(s.stream(), &x, m)?;
                        s.join(&side)?;
                        k.axpy(s.stream(), 1.0, &y, &x)?;
                        barrier.wait(); // both still running before either ends
                        Ok(())
                    })
                    .unwrap_or_else(|e| panic!("thread {t}: capture: {e}"));
                let exec = instantiate(&graph);
                let x = x;
                for _ in 0..3 {
                    poison(&stream, &x);
                    exec.launch(&stream).unwrap();
                    stream.synchronize().unwrap();
                    assert_eq!(
                        x.to_vec(&stream).unwrap(),
                        vec![v * m + 0.5; n],
                        "thread {t}: replay"
                    );
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker thread");
    }
}

// ---------- 9. capture into an existing graph ----------

fn node_count(g: &Graph) -> usize {
    let mut n = 0usize;
    // SAFETY: live graph; a null array asks for the count.
    let rc = unsafe {
        cuda_graph::sys::driver()
            .unwrap()
            .cuGraphGetNodes()
            .unwrap()(g.as_raw(), std::ptr::null_mut(), &mut n)
    };
    assert_eq!(rc.0, 0, "cuGraphGetNodes");
    n
}

#[test]
#[ignore = "needs a CUDA device"]
fn capture_into_appends_after_the_existing_graph() {
    let _serial = serial();
    let (ctx, stream, k) = setup();
    let x = DeviceBuffer::<f32>::alloc(&ctx, 1000).unwrap();
    let y = DeviceBuffer::<f32>::alloc(&ctx, 1000).unwrap();
    let mut graph = stream
        .capture(CaptureMode::Global, |s| {
            k.set(s.stream(), &x, 1.0)?;
            k.add(s.stream(), &x, 2.0)
        })
        .unwrap();
    assert_eq!(node_count(&graph), 2);
    let before = graph.resources().len();
    stream
        .capture_into(&mut graph, CaptureMode::Global, |s| {
            assert_eq!(s.stream().capture_status()?, CaptureStatus::Active);
            let side = s.fork()?;
            k.set(&side, &y, 4.0)?;
            k.mul(s.stream(), &x, 10.0)?; // must run after set and add: (1 + 2) * 10
            s.join(&side)?;
            k.axpy(s.stream(), 1.0, &y, &x) // + 4
        })
        .expect("capture_into");
    assert_eq!(stream.capture_status().unwrap(), CaptureStatus::None);
    assert_eq!(node_count(&graph), 5);
    assert!(
        graph.resources().len() > before,
        "resources of the appended part"
    );

    // A failing capture_into leaves the graph as it was.
    let r = stream.capture_into(&mut graph, CaptureMode::Global, |s| {
        k.add(s.stream(), &x, 100.0)?;
        Err(Error::InvalidArgument("discard".into()))
    });
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    assert_eq!(
        node_count(&graph),
        5,
        "failed capture_into left nodes behind"
    );
    assert_usable(&ctx, &stream, &k, "after failed capture_into");

    let exec = instantiate(&graph);
    for _ in 0..3 {
        poison(&stream, &x);
        exec.launch(&stream).unwrap();
        stream.synchronize().unwrap();
        assert_eq!(x.to_vec(&stream).unwrap(), vec![34.0f32; 1000]);
        assert_eq!(y.to_vec(&stream).unwrap(), vec![4.0f32; 1000]);
    }
}

// ---------- 10. capture status ----------

#[test]
#[ignore = "needs a CUDA device"]
fn capture_status_is_active_inside_and_none_outside() {
    let _serial = serial();
    let (ctx, stream, k) = setup();
    let x = DeviceBuffer::<f32>::alloc(&ctx, 10).unwrap();
    assert_eq!(stream.capture_status().unwrap(), CaptureStatus::None);
    let mut seen = Vec::new();
    let mut side_out = None;
    for mode in [
        CaptureMode::Global,
        CaptureMode::ThreadLocal,
        CaptureMode::Relaxed,
    ] {
        let g = stream
            .capture(mode, |s| {
                seen.push(s.stream().capture_status()?);
                k.set(s.stream(), &x, 1.0)?;
                let side = s.fork()?;
                seen.push(side.capture_status()?);
                k.add(&side, &x, 1.0)?;
                s.join(&side)?;
                side_out = Some(side);
                Ok(())
            })
            .unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        assert_eq!(stream.capture_status().unwrap(), CaptureStatus::None);
        let side = side_out.take().unwrap();
        assert_eq!(side.capture_status().unwrap(), CaptureStatus::None);
        instantiate(&g).launch(&stream).unwrap();
        assert_eq!(x.to_vec(&stream).unwrap(), vec![2.0f32; 10], "{mode:?}");
    }
    assert_eq!(seen, vec![CaptureStatus::Active; 6]);

    // An invalidated capture reports Invalidated until it ends.
    let mut inside = None;
    let r = stream.capture(CaptureMode::Global, |s| {
        let _ = s.stream().synchronize();
        inside = Some(s.stream().capture_status()?);
        Ok(())
    });
    assert!(matches!(r, Err(Error::CaptureInvalidated { .. })), "{r:?}");
    assert_eq!(inside, Some(CaptureStatus::Invalidated));
    assert_eq!(stream.capture_status().unwrap(), CaptureStatus::None);
}
