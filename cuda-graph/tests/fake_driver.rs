//! CPU test of the safe crate on fake drivers (cuda-graph-sys/tests/fake/fake_cuda.c): on a
//! driver before 13.0, `Context::synchronize` really waits, through the older
//! `cuCtxSynchronize`, and never silently skips the wait; a sticky failure of that wait is
//! what `Context::check_health` reports.
//!
//! The driver is process-wide and loaded once, so each fake driver gets a process of its own:
//! the test runs its own binary again for every scenario, with `CUDA_GRAPH_LIBCUDA` naming
//! that scenario's fake library from the start, and the child checks the scenario.

#[path = "../../cuda-graph-sys/tests/fake/mod.rs"]
mod fake;

use std::process::Command;
use std::sync::Arc;

use cuda_graph::sys::{self, CUresult, LIBCUDA_ENV, LoadError};
use cuda_graph::{Context, Error, Event};
use fake::{Fake, calls};

const SCENARIO_ENV: &str = "CUDA_GRAPH_FAKE_SCENARIO";
const THIS_TEST: &str = "context_synchronize_waits_on_fake_drivers";

fn scenarios() -> Vec<(&'static str, Fake)> {
    vec![
        ("13.0", Fake::new()),
        ("12.8", Fake::new().version(12080)),
        ("12.4", Fake::new().version(12040)),
        (
            "12.8-sync-fails",
            Fake::new().version(12080).failing("cuCtxSynchronize"),
        ),
        (
            "12.8-no-sync",
            Fake::new().version(12080).missing("cuCtxSynchronize"),
        ),
    ]
}

#[test]
fn context_synchronize_waits_on_fake_drivers() {
    if let Ok(scenario) = std::env::var(SCENARIO_ENV) {
        check(&scenario);
        println!("fake driver scenario {scenario}: checked");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    for (scenario, fake) in scenarios() {
        let out = Command::new(&exe)
            .args(["--exact", THIS_TEST, "--nocapture", "--test-threads=1"])
            .env(SCENARIO_ENV, scenario)
            .env(LIBCUDA_ENV, fake.build())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success()
                && stdout.contains(&format!("fake driver scenario {scenario}: checked")),
            "scenario {scenario} ({:?}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The checks of one scenario, in the child process whose driver is that fake.
fn check(scenario: &str) {
    let ctx = Context::default_device().expect("the fake driver has one device");
    let d = sys::driver().unwrap();
    let count = |counter: &str| calls(d, counter);
    match scenario {
        "13.0" => {
            assert_eq!(d.fallbacks(), []);
            ctx.synchronize().unwrap();
            synchronize_on_another_thread(&ctx).unwrap();
            assert_eq!(count("cuCtxSynchronize@13000"), 2);
            assert_eq!(count("cuCtxSynchronize@2000"), 0);
        }
        "12.8" | "12.4" => {
            assert!(d.cuCtxSynchronize().is_err());
            assert!(
                d.fallbacks()
                    .iter()
                    .any(|f| f.accessor == "cuCtxSynchronize_v2000"),
                "{:?}",
                d.fallbacks()
            );
            ctx.synchronize().unwrap();
            assert_eq!(count("cuCtxSynchronize@2000"), 1);
            // The older form waits for the *current* context (the fake fails without one):
            // synchronize binds it, on a thread where nothing is current too.
            unbind(d);
            ctx.synchronize().unwrap();
            synchronize_on_another_thread(&ctx).unwrap();
            assert_eq!(count("cuCtxSynchronize@2000"), 3);
            assert_eq!(count("cuCtxSynchronize@13000"), 0);
            // cuEventElapsedTime: the 12080 ABI on 12.8, its same-signature fallback on 12.4.
            let (start, end) = (Event::new(&ctx).unwrap(), Event::new(&ctx).unwrap());
            assert_eq!(Event::elapsed_ms(&start, &end).unwrap(), 1.5);
            let abi = if scenario == "12.8" { 12080 } else { 2000 };
            assert_eq!(count(&format!("cuEventElapsedTime@{abi}")), 1);
        }
        "12.8-sync-fails" => {
            let err = ctx.synchronize().unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::Driver {
                        call: "cuCtxSynchronize",
                        code: CUresult::CUDA_ERROR_LAUNCH_FAILED,
                        name: "CUDA_ERROR_LAUNCH_FAILED",
                        ..
                    }
                ),
                "{err:?}"
            );
            assert_eq!(count("cuCtxSynchronize@2000"), 1);
            // A launch failure is sticky: check_health reports the context unusable.
            let err = ctx.check_health().unwrap_err();
            assert!(err.is_sticky(), "{err:?}");
            assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_LAUNCH_FAILED));
            assert_eq!(count("cuCtxSynchronize@2000"), 2);
        }
        "12.8-no-sync" => {
            let err = ctx.synchronize().unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::Load(LoadError::Missing {
                        name: "cuCtxSynchronize",
                        ..
                    })
                ),
                "{err:?}"
            );
            assert!(err.to_string().contains("cuCtxSynchronize"), "{err}");
        }
        other => panic!("unknown scenario {other}"),
    }
    assert_eq!(count("plain"), 0, "a plain libcuda export was called");
}

fn unbind(d: &sys::Driver) {
    // SAFETY: a null context unbinds the calling thread's current context.
    let rc = unsafe { d.cuCtxSetCurrent().unwrap()(std::ptr::null_mut()) };
    assert_eq!(rc, CUresult::CUDA_SUCCESS);
}

fn synchronize_on_another_thread(ctx: &Arc<Context>) -> cuda_graph::Result<()> {
    std::thread::scope(|s| s.spawn(|| ctx.synchronize()).join().unwrap())
}
