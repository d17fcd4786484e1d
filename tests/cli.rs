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

/// Runs the CLI with `args` against a libcuda that does not exist and asserts what a user
/// without a driver sees: exit code 1, nothing on stdout, one line on stderr naming the
/// missing driver, no panic.
fn assert_fails_without_a_driver(args: &[&str]) {
    let out = cli(args, &[("CUDA_GRAPH_LIBCUDA", "/nonexistent/libcuda.so.1")]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(out.stdout.is_empty(), "nothing on stdout: {out:?}");
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    assert!(
        err.starts_with("fp8-moe: error: no CUDA driver:"),
        "{err:?}"
    );
    assert!(!err.contains("panicked"), "{err:?}");
}

#[test]
fn info_without_a_driver_fails_with_one_clear_line() {
    assert_fails_without_a_driver(&["info"]);
}

#[test]
fn train_without_a_driver_fails_with_one_clear_line() {
    assert_fails_without_a_driver(&["train", "--steps", "1"]);
}

#[test]
fn gpus_starts_one_process_per_gpu_and_stops_them_all_on_a_failure() {
    // Without a driver every rank fails: the launcher reports the first failure in one line
    // after the ranks' own (prefixed) lines, and exits 1.
    let out = cli(
        &[
            "--gpus",
            "3",
            "bench",
            "dist",
            "--json",
            "/nonexistent/x.json",
        ],
        &[("CUDA_GRAPH_LIBCUDA", "/nonexistent/libcuda.so.1")],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    let last = err.lines().last().unwrap_or("");
    assert!(
        last.starts_with("fp8-moe: error:") && last.contains("rank"),
        "{err:?}"
    );
    assert!(
        err.lines()
            .any(|l| l.starts_with("[rank ") && l.contains("no CUDA driver")),
        "{err:?}"
    );
    assert!(!err.contains("panicked"), "{err:?}");
}

#[test]
fn gpus_refuses_the_commands_that_run_on_one_gpu() {
    let out = cli(&["--gpus", "2", "info"], &[]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("--gpus runs `bench dist`, `train --dp N` and `train --ep N`"),
        "{err:?}"
    );
    for parallel in ["--dp", "--ep"] {
        let out = cli(&["--gpus", "2", "train", parallel, "3"], &[]);
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains("needs --dp 2 or --ep 2"), "{err:?}");
    }
    // Over several machines the ranks are every node's: 2 GPUs on each of 2 nodes are 4.
    let out = cli(&["--gpus", "2", "--nnodes", "2", "train", "--ep", "2"], &[]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("over 2 nodes (4 ranks) train needs --dp 4 or --ep 4"),
        "{err:?}"
    );
}

#[test]
fn train_parallelism_is_data_or_expert_with_as_many_processes() {
    // Both kinds at once are refused by the parser.
    let out = cli(&["train", "--dp", "2", "--ep", "2"], &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("--ep") && err.contains("--dp"), "{err:?}");
    // --ep N in a process of a one-rank job: the launcher line, before any device is used.
    let out = cli(&["train", "--ep", "2"], &[]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("fp8-moe --gpus 2 train --ep 2"), "{err:?}");
    assert!(!err.contains("panicked"), "{err:?}");
}

#[test]
fn train_refuses_settings_that_contradict_a_resumed_checkpoint() {
    let out = cli(&["train", "--resume", "ck", "--lr", "0.1"], &[]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("--resume") && err.contains("--lr"), "{err:?}");
}

/// Asserts a usage error: exit code 2, nothing on stdout, and stderr with clap's error line
/// (mentioning `what`) followed by the usage of `usage`.
fn assert_usage_error(out: Output, what: &str, usage: &str) {
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(out.stdout.is_empty(), "nothing on stdout: {out:?}");
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.starts_with("error: "), "{err:?}");
    assert!(err.lines().next().unwrap().contains(what), "{err:?}");
    assert!(err.contains(&format!("Usage: {usage}")), "{err:?}");
    assert!(!err.contains("panicked"), "{err:?}");
}

#[test]
fn unknown_command_prints_usage_and_exits_2() {
    let out = cli(&["frobnicate"], &[]);
    assert_usage_error(out, "'frobnicate'", "fp8-moe [OPTIONS] <COMMAND>");
}

#[test]
fn unknown_bench_prints_usage_and_exits_2() {
    let out = cli(&["bench", "nope"], &[]);
    assert_usage_error(out, "'nope'", "fp8-moe bench [OPTIONS] <BENCH>");
}

#[test]
fn bench_json_without_a_path_exits_2() {
    let out = cli(&["bench", "graph", "--json"], &[]);
    assert_usage_error(out, "--json", "fp8-moe bench graph");
}

#[test]
fn help_lists_the_commands_and_benchmarks() {
    let out = cli(&["--help"], &[]);
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8(out.stdout).unwrap();
    assert!(
        help.contains("Usage: fp8-moe [OPTIONS] <COMMAND>"),
        "{help}"
    );
    assert!(help.contains("--gpus <N>"), "{help}");
    for line in ["info ", "bench ", "train "] {
        assert!(
            help.lines().any(|l| l.trim_start().starts_with(line)),
            "no {line:?} in {help}"
        );
    }

    let out = cli(&["bench", "--help"], &[]);
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8(out.stdout).unwrap();
    assert!(help.contains("--json <PATH>"), "{help}");
    assert!(help.contains("bench-<name>.json"), "{help}");
    for bench in ["graph", "fp8-cast", "gemm", "graphed"] {
        assert!(
            help.lines()
                .any(|l| l.trim_start().starts_with(&format!("{bench} "))),
            "no {bench:?} in {help}"
        );
        let out = cli(&["bench", bench, "--help"], &[]);
        assert!(out.status.success(), "{out:?}");
        let help = String::from_utf8(out.stdout).unwrap();
        assert!(
            help.contains(&format!("Usage: fp8-moe bench {bench} [OPTIONS]")),
            "{help}"
        );
    }
}

#[test]
fn soak_help_lists_its_flags_and_defaults() {
    let out = cli(&["soak", "--help"], &[]);
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8(out.stdout).unwrap();
    assert!(help.contains("Usage: fp8-moe soak [OPTIONS]"), "{help}");
    for flag in [
        "--replays <N>",
        "--check-every <N>",
        "--update-every <N>",
        "--seed <S>",
        "--workload <WORKLOAD>",
        "--max-seconds <S>",
        "--json <PATH>",
    ] {
        assert!(help.contains(flag), "no {flag:?} in {help}");
    }
    for default in [
        "[default: 2000000]",
        "[default: 1000]",
        "[default: both]",
        "[default: soak.json]",
    ] {
        assert!(help.contains(default), "no {default:?} in {help}");
    }
    for workload in ["moe", "mlp", "both"] {
        assert!(
            help.contains(&format!("- {workload}:")),
            "no workload {workload:?} in {help}"
        );
    }
    let out = cli(&["--help"], &[]);
    let help = String::from_utf8(out.stdout).unwrap();
    assert!(
        help.lines().any(|l| l.trim_start().starts_with("soak ")),
        "no soak in {help}"
    );
}

#[test]
fn soak_bad_flags_print_usage_and_exit_2() {
    let usage = "fp8-moe soak [OPTIONS]";
    assert_usage_error(cli(&["soak", "--frobnicate"], &[]), "--frobnicate", usage);
    assert_usage_error(cli(&["soak", "--workload", "gpu"], &[]), "'gpu'", usage);
    assert_usage_error(cli(&["soak", "--check-every", "0"], &[]), "'0'", usage);
    assert_usage_error(cli(&["soak", "--replays", "many"], &[]), "'many'", usage);
    assert_usage_error(cli(&["soak", "--max-seconds=0"], &[]), "positive", usage);
    assert_usage_error(cli(&["soak", "--replays"], &[]), "--replays", usage);
}

#[test]
fn soak_without_a_driver_fails_with_one_clear_line() {
    let json =
        std::env::temp_dir().join(format!("fp8-moe-soak-nodriver-{}.json", std::process::id()));
    assert_fails_without_a_driver(&["soak", "--replays", "6", "--json", json.to_str().unwrap()]);
    assert!(!json.exists(), "no report without a run");
}

/// A short soak on the GPU: every path (replays, checks, both kinds of update, memory
/// samples) runs, nothing mismatches, and the JSON report says so.
#[test]
#[ignore = "needs a CUDA device"]
fn short_soak_passes_and_writes_its_report() {
    let json = std::env::temp_dir().join(format!("fp8-moe-soak-{}.json", std::process::id()));
    let out = cli(
        &[
            "soak",
            "--replays",
            "3000",
            "--check-every",
            "50",
            "--update-every",
            "200",
            "--json",
            json.to_str().unwrap(),
        ],
        &[],
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(out.status.success(), "soak failed:\n{stdout}\n{stderr}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).unwrap();
    assert_eq!(doc["pass"], true, "{doc}");
    assert_eq!(doc["mismatches"], 0, "{doc}");
    let workloads = doc["workloads"].as_array().unwrap();
    assert_eq!(workloads.len(), 2, "{doc}");
    let total: u64 = workloads
        .iter()
        .map(|w| w["replays"].as_u64().unwrap())
        .sum();
    assert!(total >= 3000, "{doc}");
    for w in workloads {
        assert!(w["checks"].as_u64().unwrap() >= 10, "{w}");
    }
    let moe = &workloads[0];
    assert_eq!(moe["name"], "moe");
    assert_eq!(moe["counts_changed"], moe["checks"], "{moe}");
    let u = &doc["updates"];
    assert!(u["events"].as_u64().unwrap() >= 10, "{u}");
    assert!(u["chain_per_node"].as_u64().unwrap() >= 20, "{u}");
    assert!(
        u["moe_whole_graph"]["updates"].as_u64().unwrap() >= 10,
        "{u}"
    );
    assert!(
        doc["memory"]["samples"].as_array().unwrap().len() >= 2,
        "{doc}"
    );
}

#[test]
fn version_is_the_package_version() {
    for args in [
        &["--version"][..],
        &["info", "--version"],
        &["bench", "gemm", "--version"],
        &["soak", "--version"],
    ] {
        let out = cli(args, &[]);
        assert!(out.status.success(), "{args:?}: {out:?}");
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert!(
            stdout.trim_end().ends_with(env!("CARGO_PKG_VERSION")),
            "{args:?}: {stdout:?}"
        );
    }
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

#[path = "../cuda-graph-sys/tests/fake/mod.rs"]
mod fake;

/// `info` on an older driver (a fake CUDA 12.8 `libcuda` lacking one entry): it reports the
/// entries resolved at an older ABI and the ones missing, and still succeeds.
#[test]
fn info_names_the_fallbacks_and_missing_entries_of_an_older_driver() {
    let lib = fake::Fake::new()
        .version(12080)
        .missing("cuGraphConditionalHandleCreate")
        .path();
    let out = cli(&["info"], &[("CUDA_GRAPH_LIBCUDA", lib.as_str())]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(out.status.success(), "info failed: {stderr}\n{stdout}");
    assert!(stdout.starts_with("driver: CUDA 12.8 (12080)"), "{stdout}");
    assert!(stdout.contains("Fake CUDA device"), "{stdout}");
    for entry in ["cuCtxSynchronize", "cuCtxGetDevice"] {
        assert!(
            stdout.contains(&format!(
                "driver entry point fallback: {entry} at ABI 2000 instead of 13000"
            )),
            "{entry}: {stdout}"
        );
    }
    let missing: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("driver entry point missing:"))
        .collect();
    assert_eq!(missing.len(), 1, "{stdout}");
    assert!(
        missing[0].contains("cuGraphConditionalHandleCreate"),
        "{stdout}"
    );
}

/// The losses of `run.json`'s steps, as f32 bits by step.
fn run_losses(report: &std::path::Path) -> Vec<(u64, u32)> {
    let text = std::fs::read_to_string(report.join("run.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s[0].as_u64().unwrap(),
                (s[1].as_f64().unwrap() as f32).to_bits(),
            )
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn train_saved_and_resumed_equals_one_run_and_refuses_a_corrupt_checkpoint() {
    let dir = std::env::temp_dir().join(format!("fp8-moe-cli-train-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let text: String = (0..4000)
        .map(|i| ["graph ", "replay ", "kernel ", "tensor\n"][i % 4].repeat(1 + i % 3))
        .collect();
    std::fs::write(dir.join("corpus.txt"), text).unwrap();
    let p = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let small = [
        "train",
        "--layers",
        "1",
        "--d-model",
        "128",
        "--experts",
        "4",
        "--ffn",
        "256",
        "--context",
        "64",
        "--batch",
        "4",
        "--microbatches",
        "2",
        "--steps",
        "6",
        "--quiet",
        "--compare-steps",
        "0",
        "--sample-bytes",
        "0",
        "--eval-every",
        "0",
    ];
    let run = |extra: &[&str]| {
        let data = p("corpus.txt");
        let mut args: Vec<&str> = extra.to_vec();
        args.extend(["--data", data.as_str()]);
        let out = cli(&args, &[]);
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let (full, a, b) = (p("full"), p("a"), p("b"));
    let mut whole = small.to_vec();
    whole.extend(["--report", full.as_str()]);
    run(&whole);
    let mut first = small.to_vec();
    let ck = p("ck");
    first.extend([
        "--report",
        a.as_str(),
        "--stop-after",
        "3",
        "--save",
        ck.as_str(),
    ]);
    run(&first);
    let out = run(&[
        "train",
        "--resume",
        ck.as_str(),
        "--report",
        b.as_str(),
        "--quiet",
        "--compare-steps",
        "0",
        "--sample-bytes",
        "0",
        "--eval-every",
        "0",
    ]);
    assert!(out.contains("resumed"), "{out}");
    let want = run_losses(&dir.join("full"));
    let mut got = run_losses(&dir.join("a"));
    got.extend(run_losses(&dir.join("b")));
    assert_eq!(want.len(), 6);
    assert_eq!(
        got, want,
        "saved at 3 and resumed: the losses differ from one run"
    );
    let data = p("corpus.txt");
    // A flipped byte in the weights is refused with a message naming the file.
    let model = dir.join("ck").join("model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    let i = bytes.len() / 2;
    bytes[i] ^= 0x40;
    std::fs::write(&model, bytes).unwrap();
    let out = cli(
        &[
            "train",
            "--resume",
            ck.as_str(),
            "--report",
            b.as_str(),
            "--quiet",
            "--data",
            &data,
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("model.safetensors"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn train_refuses_what_would_fail_at_the_end_before_it_trains() {
    // Checked before any device is used (here there is none): the checkpoint's folder, the
    // sample's settings, a report folder that is the checkpoint's.
    let dir = std::env::temp_dir().join(format!("fp8-moe-cli-save-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("notes.txt");
    std::fs::write(&file, b"keep me").unwrap();
    let no_driver = [("CUDA_GRAPH_LIBCUDA", "/nonexistent/libcuda.so.1")];
    let f = file.to_str().unwrap();
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    for (args, want) in [
        (
            vec!["train", "--save", f],
            "--save: refusing to write a checkpoint over",
        ),
        (vec!["train", "--temperature=-1"], "--temperature -1"),
        (
            vec!["train", "--sample-bytes", "99999999999"],
            "--sample-bytes",
        ),
        (
            vec!["train", "--save", c, "--report", c],
            "give them different folders",
        ),
    ] {
        let out = cli(&args, &no_driver);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {out:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains(want), "{args:?}: {err:?}");
        assert!(!err.contains("panicked"), "{err:?}");
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
    assert!(!ckpt.exists());
    let _ = std::fs::remove_dir_all(&dir);
}
