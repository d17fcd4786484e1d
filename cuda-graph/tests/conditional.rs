//! GPU tests of conditional nodes: IF, IF-ELSE, WHILE, SWITCH in explicit graphs and inside a
//! stream capture, nesting, and handle defaults. Each test builds its own context, streams
//! and buffers, replays the graph several times with different device-side inputs, and
//! compares the buffers with values computed on the host.

use std::sync::{Arc, Mutex, MutexGuard};

use cuda_graph::sys::{CUgraph, CUstreamCaptureMode};
use cuda_graph::{
    ConditionSource, ConditionalHandle, Context, DeviceBuffer, Error, Graph, GraphExec, Kernel,
    KernelArgs, LaunchConfig, Module, Result, Stream,
};

static TEST_KERNELS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/test_kernels.fatbin"));

const N: usize = 256;

struct Fixture {
    ctx: Arc<Context>,
    stream: Stream,
    add: Kernel,
    /// Held for the whole test (dropped last): a capture on one thread is invalidated (901)
    /// by allocations, frees and module loads other threads make in the same context, so the
    /// tests of this binary run one at a time even under a parallel test harness.
    _serial: MutexGuard<'static, ()>,
}

fn fixture() -> Fixture {
    static SERIAL: Mutex<()> = Mutex::new(());
    let serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = Context::default_device().expect("context");
    let stream = Stream::new(&ctx).expect("stream");
    let module = Module::from_image(&ctx, TEST_KERNELS).expect("test kernels");
    let add = module.kernel("add_f32").expect("add_f32");
    Fixture {
        ctx,
        stream,
        add,
        _serial: serial,
    }
}

/// `x[i] += v` for every element, enqueued on `s`.
fn add(s: &Stream, k: &Kernel, x: &DeviceBuffer<f32>, v: f32) -> Result<()> {
    let n = x.len() as u32;
    let args = KernelArgs::new().arg(x).arg(&v).arg(&n);
    // SAFETY: add_f32(float*, float, unsigned) touches x[0..n), which x holds.
    unsafe { s.launch(k, &LaunchConfig::for_elements(n, 128), &args) }
}

/// A buffer of N copies of `v` (poisoned with `v`, which the tests choose).
fn filled(s: &Stream, v: f32) -> DeviceBuffer<f32> {
    DeviceBuffer::from_host(s, &[v; N]).expect("buffer")
}

fn set_i32(s: &Stream, b: &DeviceBuffer<i32>, v: i32) {
    b.copy_from_host(s, &[v]).expect("copy flag");
}

fn assert_all(s: &Stream, b: &DeviceBuffer<f32>, want: f32, what: &str) {
    let got = b.to_vec(s).expect("read back");
    for (i, &g) in got.iter().enumerate() {
        assert_eq!(g, want, "{what}: element {i} is {g}, expected {want}");
    }
}

fn replay(exec: &GraphExec, s: &Stream) {
    exec.launch(s).expect("launch");
    s.synchronize().expect("sync after launch");
}

/// Begins a raw thread-local capture on `s` (the capture scope lives elsewhere); global mode
/// would make the allocations and synchronizations of tests running on other threads fail.
fn begin_capture(s: &Stream) {
    // SAFETY: live non-blocking stream; mode is a valid enum value.
    let rc = unsafe {
        cuda_graph::sys::driver()
            .unwrap()
            .cuStreamBeginCapture()
            .unwrap()(
            s.as_raw(),
            CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )
    };
    assert_eq!(rc.0, 0, "cuStreamBeginCapture");
}

fn end_capture(ctx: &Arc<Context>, s: &Stream) -> Graph {
    let mut g: CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun on this stream and thread.
    let rc = unsafe {
        cuda_graph::sys::driver()
            .unwrap()
            .cuStreamEndCapture()
            .unwrap()(s.as_raw(), &mut g)
    };
    assert_eq!(rc.0, 0, "cuStreamEndCapture");
    assert!(!g.is_null());
    // SAFETY: a fresh graph of ctx that nothing else owns.
    unsafe { Graph::from_raw(ctx, g) }
}

#[test]
#[ignore = "needs a CUDA device"]
fn if_in_an_explicit_graph_follows_a_device_flag() {
    let f = fixture();
    let x = filled(&f.stream, 5.0);
    let flag = DeviceBuffer::<i32>::from_host(&f.stream, &[0]).unwrap();
    let mut graph = Graph::new(&f.ctx).unwrap();
    let h = ConditionalHandle::new(&mut graph, 0, true).unwrap();
    let set = graph
        .add_set_condition(&[], h, ConditionSource::I32(&flag))
        .unwrap();
    graph
        .add_if(&[set.node()], h, |s| add(s, &f.add, &x, 1.0))
        .unwrap();
    let exec = GraphExec::instantiate(&graph, Default::default()).unwrap();
    // A setter enqueued eagerly would run outside any launch of the graph: refused, and the
    // context stays usable.
    let e = h.set_from_flag_on(&f.stream, &flag).unwrap_err();
    assert!(e.to_string().contains("not eagerly"), "{e}");
    let mut want = 5.0;
    for i in 0..4 {
        let v = i % 2;
        set_i32(&f.stream, &flag, v);
        replay(&exec, &f.stream);
        want += v as f32;
        assert_all(&f.stream, &x, want, &format!("IF replay {i} with flag {v}"));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn if_else_in_an_explicit_graph_takes_one_branch() {
    let f = fixture();
    let x = filled(&f.stream, 0.5);
    let flag = DeviceBuffer::<f32>::from_host(&f.stream, &[0.0]).unwrap();
    let mut graph = Graph::new(&f.ctx).unwrap();
    let h = ConditionalHandle::new(&mut graph, 0, true).unwrap();
    let set = graph
        .add_set_condition(&[], h, ConditionSource::F32(&flag))
        .unwrap();
    graph
        .add_if_else(
            &[set.node()],
            h,
            |s| add(s, &f.add, &x, 1.0),
            |s| add(s, &f.add, &x, 100.0),
        )
        .unwrap();
    let exec = GraphExec::instantiate(&graph, Default::default()).unwrap();
    let mut want = 0.5;
    for (i, v) in [1.0, 0.0, 1.0, -0.0, 0.25].into_iter().enumerate() {
        flag.copy_from_host(&f.stream, &[v]).unwrap();
        replay(&exec, &f.stream);
        want += if v != 0.0 { 1.0 } else { 100.0 };
        assert_all(
            &f.stream,
            &x,
            want,
            &format!("IF-ELSE replay {i} with flag {v}"),
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn while_loop_counts_on_the_device() {
    let f = fixture();
    let x = filled(&f.stream, 3.0);
    let counter = DeviceBuffer::<i32>::from_host(&f.stream, &[0]).unwrap();
    let mut graph = Graph::new(&f.ctx).unwrap();
    let h = ConditionalHandle::new(&mut graph, 0, true).unwrap();
    let test = graph
        .add_set_condition(&[], h, ConditionSource::PositiveI32(&counter))
        .unwrap();
    graph
        .add_while(&[test.node()], h, |s| {
            add(s, &f.add, &x, 1.0)?;
            h.decrement_on(s, &counter)
        })
        .unwrap();
    let exec = GraphExec::instantiate(&graph, Default::default()).unwrap();
    let mut want = 3.0;
    for k in [1, 5, 17, 0] {
        set_i32(&f.stream, &counter, k);
        replay(&exec, &f.stream);
        want += k as f32;
        assert_all(&f.stream, &x, want, &format!("WHILE with k = {k}"));
        let left = counter.to_vec(&f.stream).unwrap()[0];
        assert_eq!(left, 0, "counter after the loop with k = {k}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn switch_runs_the_selected_case_or_none() {
    let f = fixture();
    let x = filled(&f.stream, 0.0);
    let index = DeviceBuffer::<i32>::from_host(&f.stream, &[0]).unwrap();
    let mut graph = Graph::new(&f.ctx).unwrap();
    let h = ConditionalHandle::new(&mut graph, 0, true).unwrap();
    let set = graph
        .add_set_condition(&[], h, ConditionSource::I32(&index))
        .unwrap();
    let (k, xr) = (&f.add, &x);
    graph
        .add_switch(
            &[set.node()],
            h,
            vec![
                Box::new(move |s: &Stream| add(s, k, xr, 1.0)),
                Box::new(move |s: &Stream| add(s, k, xr, 10.0)),
                Box::new(move |s: &Stream| add(s, k, xr, 100.0)),
            ],
        )
        .unwrap();
    let exec = GraphExec::instantiate(&graph, Default::default()).unwrap();
    let mut want = 0.0;
    for (i, inc) in [(0, 1.0), (1, 10.0), (2, 100.0), (3, 0.0), (1, 10.0)] {
        set_i32(&f.stream, &index, i);
        replay(&exec, &f.stream);
        want += inc;
        assert_all(&f.stream, &x, want, &format!("SWITCH with index {i}"));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn while_containing_an_if() {
    let f = fixture();
    let every = filled(&f.stream, 0.0);
    let gated = filled(&f.stream, 0.0);
    let counter = DeviceBuffer::<i32>::from_host(&f.stream, &[0]).unwrap();
    let flag = DeviceBuffer::<i32>::from_host(&f.stream, &[0]).unwrap();
    let mut graph = Graph::new(&f.ctx).unwrap();
    let h = ConditionalHandle::new(&mut graph, 0, true).unwrap();
    let test = graph
        .add_set_condition(&[], h, ConditionSource::PositiveI32(&counter))
        .unwrap();
    graph
        .add_while(&[test.node()], h, |s| {
            add(s, &f.add, &every, 1.0)?;
            let inner = ConditionalHandle::in_capture(s, 0, false)?;
            inner.set_from_flag_on(s, &flag)?;
            s.capture_if(inner, |t| add(t, &f.add, &gated, 10.0))?;
            h.decrement_on(s, &counter)
        })
        .unwrap();
    let exec = GraphExec::instantiate(&graph, Default::default()).unwrap();
    let (mut want_every, mut want_gated) = (0.0, 0.0);
    for (k, v) in [(4, 1), (3, 0), (2, 1)] {
        set_i32(&f.stream, &counter, k);
        set_i32(&f.stream, &flag, v);
        replay(&exec, &f.stream);
        want_every += k as f32;
        want_gated += if v != 0 { 10.0 * k as f32 } else { 0.0 };
        assert_all(
            &f.stream,
            &every,
            want_every,
            &format!("loop body, k = {k}"),
        );
        assert_all(
            &f.stream,
            &gated,
            want_gated,
            &format!("inner IF, k = {k}, flag {v}"),
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn if_inside_a_stream_capture() {
    let f = fixture();
    let x = filled(&f.stream, 2.0);
    let after = filled(&f.stream, 0.0);
    let flag = DeviceBuffer::<i32>::from_host(&f.stream, &[0]).unwrap();
    ConditionalHandle::load_helpers(&f.ctx).unwrap();
    begin_capture(&f.stream);
    let built = (|| -> Result<()> {
        let h = ConditionalHandle::in_capture(&f.stream, 0, true)?;
        h.set_from_flag_on(&f.stream, &flag)?;
        f.stream.capture_if(h, |s| add(s, &f.add, &x, 1.0))?;
        // Work after the node runs on every launch, after the IF.
        add(&f.stream, &f.add, &after, 1.0)
    })();
    let graph = end_capture(&f.ctx, &f.stream);
    built.expect("building the captured IF");
    let exec = GraphExec::instantiate(&graph, Default::default()).unwrap();
    let mut want = 2.0;
    for i in 0..4 {
        let v = (i + 1) % 2;
        set_i32(&f.stream, &flag, v);
        replay(&exec, &f.stream);
        want += v as f32;
        assert_all(
            &f.stream,
            &x,
            want,
            &format!("captured IF replay {i}, flag {v}"),
        );
        assert_all(
            &f.stream,
            &after,
            (i + 1) as f32,
            "work after the captured IF",
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn while_inside_a_stream_capture() {
    let f = fixture();
    let x = filled(&f.stream, 0.0);
    let counter = DeviceBuffer::<i32>::from_host(&f.stream, &[0]).unwrap();
    ConditionalHandle::load_helpers(&f.ctx).unwrap();
    begin_capture(&f.stream);
    let built = (|| -> Result<()> {
        let h = ConditionalHandle::in_capture(&f.stream, 0, true)?;
        h.set_on(&f.stream, ConditionSource::PositiveI32(&counter))?;
        f.stream.capture_while(h, |s| {
            add(s, &f.add, &x, 1.0)?;
            h.decrement_on(s, &counter)
        })?;
        add(&f.stream, &f.add, &x, 1000.0)
    })();
    let graph = end_capture(&f.ctx, &f.stream);
    built.expect("building the captured WHILE");
    let exec = GraphExec::instantiate(&graph, Default::default()).unwrap();
    let mut want = 0.0;
    for k in [1, 5, 17] {
        set_i32(&f.stream, &counter, k);
        replay(&exec, &f.stream);
        want += k as f32 + 1000.0;
        assert_all(&f.stream, &x, want, &format!("captured WHILE, k = {k}"));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn default_value_with_reset_runs_the_body_every_launch() {
    let f = fixture();
    let x = filled(&f.stream, 0.0);
    let mut graph = Graph::new(&f.ctx).unwrap();
    let h = ConditionalHandle::new(&mut graph, 1, true).unwrap();
    assert_eq!((h.default_value(), h.resets_each_launch()), (1, true));
    // The body clears the value; the reset brings it back to 1 at the next launch.
    graph
        .add_if(&[], h, |s| {
            add(s, &f.add, &x, 1.0)?;
            h.set_const_on(s, 0)
        })
        .unwrap();
    let exec = GraphExec::instantiate(&graph, Default::default()).unwrap();
    for i in 1..=3 {
        replay(&exec, &f.stream);
        assert_all(&f.stream, &x, i as f32, &format!("launch {i} with reset"));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn value_without_reset_persists_across_launches() {
    let f = fixture();
    let x = filled(&f.stream, 0.0);
    let flag = DeviceBuffer::<i32>::from_host(&f.stream, &[0]).unwrap();
    let mut graph = Graph::new(&f.ctx).unwrap();
    let h = ConditionalHandle::new(&mut graph, 0, false).unwrap();
    // The IF reads the value the previous launch left: the setter runs after it.
    let node = graph.add_if(&[], h, |s| add(s, &f.add, &x, 1.0)).unwrap();
    graph
        .add_set_condition(&[node.node()], h, ConditionSource::I32(&flag))
        .unwrap();
    let exec = GraphExec::instantiate(&graph, Default::default()).unwrap();
    set_i32(&f.stream, &flag, 1);
    replay(&exec, &f.stream);
    // The first launch reads the driver's initial value (0 on driver 13.0, not promised).
    let first = x.to_vec(&f.stream).unwrap()[0];
    assert!(first == 0.0 || first == 1.0, "first launch left {first}");
    let mut want = first;
    for (i, (next, runs)) in [(0, true), (1, false), (1, true), (0, true)]
        .into_iter()
        .enumerate()
    {
        set_i32(&f.stream, &flag, next);
        replay(&exec, &f.stream);
        want += if runs { 1.0 } else { 0.0 };
        assert_all(
            &f.stream,
            &x,
            want,
            &format!("launch {} without reset", i + 2),
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn misuse_is_rejected_before_the_driver() {
    let f = fixture();
    // Not capturing: no handle, no node.
    assert!(matches!(
        ConditionalHandle::in_capture(&f.stream, 0, true),
        Err(Error::InvalidArgument(_))
    ));
    let mut g1 = Graph::new(&f.ctx).unwrap();
    let h1 = ConditionalHandle::new(&mut g1, 0, true).unwrap();
    assert!(matches!(
        f.stream.capture_if(h1, |_| Ok(())),
        Err(Error::InvalidArgument(_))
    ));
    // A handle of another graph.
    let mut g2 = Graph::new(&f.ctx).unwrap();
    assert!(matches!(
        g2.add_if(&[], h1, |_| Ok(())),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        g1.add_switch(&[], h1, Vec::new()),
        Err(Error::InvalidArgument(_))
    ));
    // A body's error comes back, and the body stream's capture is ended.
    let err = g1
        .add_if(&[], h1, |_| {
            Err(Error::InvalidArgument("from the body".into()))
        })
        .unwrap_err();
    assert!(err.to_string().contains("from the body"), "{err}");
}
