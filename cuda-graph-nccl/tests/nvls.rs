//! CPU test: loading NCCL keeps NVLink multicast off in this process. With
//! `NCCL_NVLS_ENABLE` unset, `nccl()` sets it to `0` before NCCL can read it; with any other
//! value it refuses to load NCCL at all. The environment is per process, so each scenario
//! runs in a child process of this test binary.

use std::process::Command;

use cuda_graph_nccl::{NVLS_VAR, nccl};

const SCENARIO_ENV: &str = "CUDA_GRAPH_NVLS_SCENARIO";
const THIS_TEST: &str = "nvlink_multicast_stays_off";

#[test]
fn nvlink_multicast_stays_off() {
    if let Ok(scenario) = std::env::var(SCENARIO_ENV) {
        check(&scenario);
        println!("nvls scenario {scenario}: checked");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    for (scenario, value) in [("unset", None), ("zero", Some("0")), ("on", Some("1"))] {
        let mut child = Command::new(&exe);
        child
            .args(["--exact", THIS_TEST, "--nocapture", "--test-threads=1"])
            .env(SCENARIO_ENV, scenario);
        match value {
            Some(v) => child.env(NVLS_VAR, v),
            None => child.env_remove(NVLS_VAR),
        };
        let out = child.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(&format!("nvls scenario {scenario}: checked")),
            "scenario {scenario} ({:?}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The checks of one scenario, in the child process.
fn check(scenario: &str) {
    // Whether NCCL itself is found here does not matter: the variable is settled first.
    let loaded = nccl();
    match scenario {
        "unset" | "zero" => {
            assert_eq!(std::env::var(NVLS_VAR).as_deref(), Ok("0"));
            if let Err(e) = loaded {
                assert!(!e.to_string().contains(NVLS_VAR), "{e}");
            }
        }
        "on" => {
            let e = loaded.unwrap_err().to_string();
            assert!(
                e.contains("NCCL_NVLS_ENABLE=1") && e.contains("stays off"),
                "{e}"
            );
            // A second ask gives the same refusal (the outcome is kept).
            assert!(nccl().unwrap_err().to_string().contains("stays off"));
        }
        other => panic!("unknown scenario {other}"),
    }
}
