//! End-to-end tests of the `fp8-moe` CLI.

use std::process::{Command, Output};

/// The CLI under test: `FP8_MOE_BIN` when set (the GPU bundle runs tests away from the build
/// tree), else the binary cargo built for this test.
fn cli(args: &[&str], env: &[(&str, &str)]) -> Output {
    let bin = std::env::var("FP8_MOE_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_fp8-moe").into());
    let mut cmd = Command::new(bin);
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("the CLI starts")
}

#[test]
fn info_without_a_driver_fails_with_one_clear_line() {
    let out = cli(
        &["info"],
        &[("CUDA_GRAPH_LIBCUDA", "/nonexistent/libcuda.so.1")],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty(), "nothing on stdout");
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    assert!(
        err.starts_with("fp8-moe: error: no CUDA driver:"),
        "{err:?}"
    );
    assert!(!err.contains("panicked"), "{err:?}");
}

#[test]
fn unknown_command_prints_usage_and_exits_2() {
    let out = cli(&["frobnicate"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8(out.stderr)
            .unwrap()
            .starts_with("usage: fp8-moe")
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn info_reports_driver_device_and_conditional_nodes() {
    let out = cli(&["info"], &[]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(out.status.success(), "info failed: {stderr}");
    assert!(stdout.starts_with("driver: CUDA "), "{stdout}");
    assert!(stdout.contains("device 0: "), "{stdout}");
    assert!(stdout.contains(" SMs, "), "{stdout}");
    let line = |name: &str| {
        stdout
            .lines()
            .find(|l| l.contains(name))
            .unwrap_or_else(|| panic!("no line for {name}: {stdout}"))
            .to_owned()
    };
    // The project targets drivers >= 12.8, which have every conditional node type.
    assert!(
        line("conditional IF and WHILE nodes").contains(" yes "),
        "{stdout}"
    );
    assert!(
        line("conditional IF-ELSE and SWITCH nodes").contains(" yes "),
        "{stdout}"
    );
}
