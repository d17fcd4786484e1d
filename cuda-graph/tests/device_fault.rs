//! GPU test of device faults: a kernel that traps (`__trap()`) or fails a device-side
//! `assert` inside a graph comes back as a sticky [`Error::Driver`] from the call that waits
//! for it, the context then reports itself unusable ([`Context::check_health`]) and every
//! later call fails the same way, and nothing hangs: not the waits, not the drops.
//!
//! A sticky error poisons the primary context for the whole process, so each case runs in a
//! process of its own: the test runs its own binary again per case, with `FAULT_CASE_ENV`
//! naming the case, and the child checks it. A watchdog aborts a child that hangs.

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_graph::sys::CUresult;
use cuda_graph::{
    CaptureMode, Context, DeviceBuffer, Error, Event, GraphExec, InstantiateFlags, LaunchConfig,
    Module, Stream, kernel_args,
};

mod common;
use common::FATBIN;
#[path = "common/watchdog.rs"]
mod watchdog;
use watchdog::Watchdog;

const FAULT_CASE_ENV: &str = "CUDA_GRAPH_FAULT_CASE";
const THIS_TEST: &str = "a_fault_inside_a_graph_is_a_sticky_error_and_nothing_hangs";
/// How long a child may take before its watchdog aborts it.
const CHILD_LIMIT: Duration = Duration::from_secs(60);

/// The cases: the kernel that faults, and the result codes its fault may come back as.
/// `__trap()` came back as `CUDA_ERROR_LAUNCH_FAILED` (719) on the H200 with driver 580.159
/// (an illegal instruction is accepted too); a device-side assert has its own code (710).
const CASES: &[(&str, &str, &[CUresult])] = &[
    (
        "trap",
        "add_one_or_trap",
        &[
            CUresult::CUDA_ERROR_LAUNCH_FAILED,
            CUresult::CUDA_ERROR_ILLEGAL_INSTRUCTION,
        ],
    ),
    (
        "assert",
        "add_one_or_assert",
        &[CUresult::CUDA_ERROR_ASSERT],
    ),
];

#[test]
#[ignore = "needs a CUDA device"]
fn a_fault_inside_a_graph_is_a_sticky_error_and_nothing_hangs() {
    if let Ok(case) = std::env::var(FAULT_CASE_ENV) {
        let _watchdog = Watchdog::arm(format!("device fault case {case}"), CHILD_LIMIT);
        let &(_, kernel, codes) = CASES
            .iter()
            .find(|c| c.0 == case)
            .unwrap_or_else(|| panic!("unknown case {case}"));
        check_case(kernel, codes);
        println!("device fault case {case}: checked");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    for &(case, _, _) in CASES {
        let (status, stdout, stderr) = run_child(&exe, case);
        assert!(
            status.is_some_and(|s| s.success())
                && stdout.contains(&format!("device fault case {case}: checked")),
            "case {case} ({status:?}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
        );
        // Shown with --nocapture: what the driver said, for the log.
        println!("case {case}:\n{stdout}");
    }
}

/// Runs this test in a child process for `case`; kills it if it outlives its own watchdog.
/// Returns its exit status (`None` when killed), stdout and stderr.
fn run_child(
    exe: &std::path::Path,
    case: &str,
) -> (Option<std::process::ExitStatus>, String, String) {
    let mut child = Command::new(exe)
        .args([
            "--exact",
            THIS_TEST,
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(FAULT_CASE_ENV, case)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let read = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = pipe.read_to_string(&mut s);
            s
        })
    };
    let out = read(Box::new(child.stdout.take().unwrap()));
    let err = read(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if start.elapsed() > CHILD_LIMIT + Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (status, out.join().unwrap(), err.join().unwrap())
}

/// Asserts `r` failed with a sticky driver error of one of `codes`, from `call`; returns
/// the code.
fn expect_sticky<T: std::fmt::Debug>(
    what: &str,
    r: cuda_graph::Result<T>,
    call: &str,
    codes: &[CUresult],
) -> CUresult {
    let e = match r {
        Ok(v) => panic!("{what}: expected a sticky error from {call}, got Ok({v:?})"),
        Err(e) => e,
    };
    println!("{what}: {e}");
    assert!(e.is_sticky(), "{what}: not sticky: {e:?}");
    match &e {
        Error::Driver {
            call: c,
            code,
            name,
            ..
        } => {
            assert_eq!(*c, call, "{what}: the call named");
            assert!(
                codes.contains(code),
                "{what}: code {code:?} not in {codes:?}"
            );
            let shown = e.to_string();
            assert!(
                shown.contains(call) && shown.contains(name),
                "{what}: the message names the call and the code: {shown}"
            );
            *code
        }
        other => panic!("{what}: expected Error::Driver, got {other:?}"),
    }
}

/// The checks of one case, in the child process.
fn check_case(kernel: &str, codes: &[CUresult]) {
    const N: u32 = 4096;
    let cfg = LaunchConfig::for_elements(N, 128);
    let ctx = Context::default_device().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let module = Module::from_image(&ctx, FATBIN).unwrap();
    let faulty = module.kernel(kernel).unwrap();
    let add = module.kernel("add_f32").unwrap();
    let flag = DeviceBuffer::<u32>::from_host(&stream, &[0]).unwrap();
    let x = DeviceBuffer::<f32>::from_host(&stream, &vec![0.0; N as usize]).unwrap();
    let graph = stream
        .capture(CaptureMode::ThreadLocal, |s| {
            // SAFETY: the kernel reads flag[0] and adds to N floats of x; add_f32 adds to N
            // floats of x.
            unsafe {
                s.stream()
                    .launch(&faulty, &cfg, &kernel_args![&flag, &x, N])?;
                s.stream().launch(&add, &cfg, &kernel_args![&x, 1.0f32, N])
            }
        })
        .unwrap();
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();

    // Healthy first: the flag is clear.
    exec.launch(&stream).unwrap();
    exec.synchronize().unwrap();
    assert!(x.to_vec(&stream).unwrap().iter().all(|&v| v == 2.0));
    ctx.check_health().unwrap();

    // The flag set, the next replay faults. The launch itself is asynchronous: it returns
    // before the kernel runs (a sticky error from it is accepted too), and the wait for the
    // exec reports the fault.
    flag.copy_from_host(&stream, &[1]).unwrap();
    match exec.launch(&stream) {
        Ok(()) => println!("the faulting launch was enqueued"),
        Err(e) => {
            expect_sticky(
                "the faulting launch",
                Err::<(), _>(e),
                "cuGraphLaunch",
                codes,
            );
        }
    }
    let code = expect_sticky(
        "waiting for the exec",
        exec.synchronize(),
        "cuEventSynchronize",
        codes,
    );
    let same = &[code][..];

    // The context is unusable from now on, for every call, on every thread.
    let t0 = Instant::now();
    expect_sticky("check_health", ctx.check_health(), "cuCtxSynchronize", same);
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "check_health on a poisoned context took {:?}",
        t0.elapsed()
    );
    expect_sticky(
        "the stream",
        stream.synchronize(),
        "cuStreamSynchronize",
        same,
    );
    expect_sticky(
        "launching the exec again",
        exec.launch(&stream),
        "cuGraphLaunch",
        same,
    );
    expect_sticky(
        "a new allocation",
        DeviceBuffer::<f32>::alloc(&ctx, 16),
        "cuMemAlloc",
        same,
    );
    expect_sticky(
        "a copy to the host",
        x.to_vec(&stream),
        "cuMemcpyDtoHAsync",
        same,
    );
    let other = {
        let ctx = Arc::clone(&ctx);
        std::thread::spawn(move || ctx.check_health())
            .join()
            .unwrap()
    };
    expect_sticky(
        "check_health on another thread",
        other,
        "cuCtxSynchronize",
        same,
    );
    expect_sticky(
        "a new stream",
        Stream::new(&ctx).map(drop),
        "cuStreamCreate",
        same,
    );
    expect_sticky(
        "a new event",
        Event::new(&ctx).map(drop),
        "cuEventCreate",
        same,
    );
    let again = GraphExec::instantiate(&graph, InstantiateFlags::empty())
        .map(drop)
        .unwrap_err();
    println!("instantiating again: {again}");
    assert!(again.is_sticky(), "{again:?}");
    assert!(
        matches!(&again, Error::Instantiate { source, .. } if source.code() == Some(code)),
        "{again:?}"
    );

    // Drops: the exec's drop waits for its last launch, fails, and leaks what it holds
    // rather than freeing it under the device; the rest release what they can.
    let t0 = Instant::now();
    drop(exec);
    drop(graph);
    drop((x, flag, add, faulty, module, stream));
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "the drops took {:?}",
        t0.elapsed()
    );
    expect_sticky(
        "still poisoned",
        ctx.check_health(),
        "cuCtxSynchronize",
        same,
    );
}
