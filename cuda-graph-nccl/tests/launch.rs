//! The launcher, with real processes meeting over loopback: the test binary re-executes itself
//! as the children, which run only [`child_entry`].

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cuda_graph_nccl::launch::{LaunchConfig, LaunchError, LaunchReport, Output, launch};
use cuda_graph_nccl::rendezvous::{RendezvousConfig, meet};

/// Set in the children: makes [`child_entry`] do its work.
const CHILD_VAR: &str = "CUDA_GRAPH_NCCL_LAUNCH_TEST_CHILD";
/// Rank 0's payload, in hex.
const PAYLOAD_VAR: &str = "CUDA_GRAPH_NCCL_LAUNCH_TEST_PAYLOAD";
/// `RANK:CODE`: that rank exits with that code at once.
const FAIL_VAR: &str = "CUDA_GRAPH_NCCL_LAUNCH_TEST_FAIL";
/// Non-empty: this child is itself a launcher of two prefixed children.
const NESTED_VAR: &str = "CUDA_GRAPH_NCCL_LAUNCH_TEST_NESTED";
/// A file path: this process is a launcher of two `sh` children that append their PIDs to
/// it and sleep, until the test kills the launcher.
const ORPHAN_VAR: &str = "CUDA_GRAPH_NCCL_LAUNCH_TEST_ORPHANS";
/// How many numbered lines each child prints before meeting.
const CHATTY_VAR: &str = "CUDA_GRAPH_NCCL_LAUNCH_TEST_CHATTY";
/// Pads the numbered lines, so that a line torn by interleaving would show.
const PAD: &str =
    "................................................................................";
/// Marks the child's result line (the test harness prints `test child_entry ... ` before it, on
/// the same line).
const RESULT_MARK: &str = "RESULT: ";

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// The children's body; does nothing in a normal test run.
#[test]
fn child_entry() {
    if std::env::var_os(CHILD_VAR).is_none() {
        return;
    }
    if !env_or(NESTED_VAR, "").is_empty() {
        run_nested_launcher();
    }
    if let Some(file) = std::env::var_os(ORPHAN_VAR) {
        run_sleepy_launcher(file);
    }
    let rank = env_or("RANK", "?");
    if let Some((fail_rank, code)) = env_or(FAIL_VAR, "").split_once(':') {
        if fail_rank == rank {
            eprintln!("rank {rank} fails on purpose");
            std::process::exit(code.parse().unwrap_or(1));
        }
    }
    let chatty: usize = env_or(CHATTY_VAR, "0").parse().unwrap_or(0);
    if chatty > 0 {
        // Ends the harness's "test child_entry ... " line.
        println!();
    }
    for i in 0..chatty {
        println!("rank {rank} line {i} {PAD}");
    }
    eprintln!("rank {rank} on stderr");
    let cfg = match RendezvousConfig::from_env() {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(90);
        }
    };
    let payload = match meet(&cfg, || decode_hex(&env_or(PAYLOAD_VAR, ""))) {
        Ok(payload) => payload,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(91);
        }
    };
    println!(
        "{RESULT_MARK}rank {} of {} local {} of {} node {} got {} NVLS={}",
        cfg.rank,
        cfg.world_size,
        env_or("LOCAL_RANK", "?"),
        env_or("LOCAL_WORLD_SIZE", "?"),
        env_or("NODE_RANK", "?"),
        encode_hex(&payload),
        env_or("NCCL_NVLS_ENABLE", "unset"),
    );
}

/// The middle process of the nested test: launches two children with prefixed output and exits
/// with the result.
fn run_nested_launcher() -> ! {
    // Ends this process's own "test child_entry ... " line.
    println!();
    let mut cfg = child_config(2, &env_or(PAYLOAD_VAR, ""), &[(NESTED_VAR, "")]);
    cfg.output = Output::Prefixed;
    match launch(&cfg) {
        Ok(_) => std::process::exit(0),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(92);
        }
    }
}

/// A launcher of two children that note their PIDs in `file` and sleep a minute.
fn run_sleepy_launcher(file: OsString) -> ! {
    let mut cfg = LaunchConfig::new(2, "/bin/sh");
    cfg.args = ["-c", "echo $$ >> \"$0\"; exec sleep 60"]
        .map(OsString::from)
        .to_vec();
    cfg.args.push(file);
    cfg.output = Output::Inherit;
    let code = match launch(&cfg) {
        Ok(_) => 0,
        Err(_) => 93,
    };
    std::process::exit(code)
}

fn encode_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn decode_hex(hex: &str) -> Result<Vec<u8>, String> {
    (0..hex.len())
        .step_by(2)
        .map(|i| {
            hex.get(i..i + 2)
                .and_then(|pair| u8::from_str_radix(pair, 16).ok())
                .ok_or_else(|| format!("bad hex {hex:?}"))
        })
        .collect()
}

/// 16 bytes that differ from run to run, as hex.
fn random_hex() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{nanos:032x}")
}

/// A launch of this test binary running only `child_entry`, output captured.
fn child_config(nproc: usize, payload_hex: &str, extra: &[(&str, &str)]) -> LaunchConfig {
    let mut cfg = LaunchConfig::new(nproc, std::env::current_exe().unwrap());
    cfg.args = ["--exact", "child_entry", "--nocapture", "--test-threads=1"]
        .map(OsString::from)
        .to_vec();
    cfg.output = Output::Capture;
    cfg.env = [
        (CHILD_VAR, "1"),
        (PAYLOAD_VAR, payload_hex),
        ("CUDA_GRAPH_RENDEZVOUS_TIMEOUT", "20"),
    ]
    .iter()
    .chain(extra)
    .map(|(k, v)| (OsString::from(k), OsString::from(v)))
    .collect();
    cfg
}

/// The result each child prints, by local rank.
fn rank_lines(report: &LaunchReport) -> Vec<String> {
    report
        .ranks
        .iter()
        .map(|rank| {
            rank.stdout
                .iter()
                .find_map(|line| Some(line.split_once(RESULT_MARK)?.1.to_owned()))
                .unwrap_or_else(|| panic!("rank {} printed no result: {rank:?}", rank.rank))
        })
        .collect()
}

#[test]
fn three_ranks_meet_with_the_launcher_environment() {
    let payload = random_hex();
    // The caller asks for NVLink multicast; the launcher must turn it off regardless.
    let cfg = child_config(3, &payload, &[("NCCL_NVLS_ENABLE", "1")]);
    let report = launch(&cfg).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.world_size, 3);
    assert_eq!(report.master_addr, "127.0.0.1");
    assert_ne!(report.master_port, 0);
    for (local, rank) in report.ranks.iter().enumerate() {
        assert_eq!((rank.rank, rank.local_rank), (local, local));
        assert!(rank.status.unwrap().success());
    }
    let expected: Vec<String> = (0..3)
        .map(|r| format!("rank {r} of 3 local {r} of 3 node 0 got {payload} NVLS=0"))
        .collect();
    assert_eq!(rank_lines(&report), expected);
}

#[test]
fn prefixed_output_arrives_in_whole_lines() {
    let payload = random_hex();
    let lines = 300;
    let cfg = child_config(
        1,
        &payload,
        &[(NESTED_VAR, "1"), (CHATTY_VAR, &lines.to_string())],
    );
    let report = launch(&cfg).unwrap_or_else(|e| panic!("{e}"));
    let middle = &report.ranks[0];
    for rank in 0..2 {
        let prefix = format!("[rank {rank}] ");
        let own: Vec<&str> = middle
            .stdout
            .iter()
            .filter_map(|line| line.strip_prefix(&prefix))
            .collect();
        // Every numbered line, whole and in order, even though both ranks wrote at once.
        let numbered: Vec<&str> = own
            .iter()
            .copied()
            .filter(|line| line.starts_with("rank "))
            .collect();
        let expected: Vec<String> = (0..lines)
            .map(|i| format!("rank {rank} line {i} {PAD}"))
            .collect();
        assert_eq!(numbered, expected, "rank {rank}");
        let result =
            format!("{RESULT_MARK}rank {rank} of 2 local {rank} of 2 node 0 got {payload} NVLS=0");
        assert!(
            own.iter().any(|line| line.ends_with(&result)),
            "rank {rank}: {own:?}"
        );
        assert!(
            middle
                .stderr
                .contains(&format!("{prefix}rank {rank} on stderr")),
            "{:?}",
            middle.stderr
        );
    }
    // Nothing else carries a prefix, and no prefixed line holds a second prefix.
    for line in &middle.stdout {
        assert_eq!(
            line.matches("[rank ").count(),
            usize::from(line.starts_with("[rank ")),
            "{line}"
        );
    }
}

#[test]
fn two_nodes_meet_over_loopback() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let payload = random_hex();
    let nodes: Vec<_> = (0..2)
        .map(|node_rank| {
            let mut cfg = child_config(2, &payload, &[]);
            cfg.nnodes = 2;
            cfg.node_rank = node_rank;
            cfg.master_port = Some(port);
            thread::spawn(move || launch(&cfg))
        })
        .collect();
    let mut lines = Vec::new();
    for node in nodes {
        let report = node.join().unwrap().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(report.master_port, port);
        lines.extend(rank_lines(&report));
    }
    let expected: Vec<String> = (0..4)
        .map(|r| {
            format!(
                "rank {r} of 4 local {} of 2 node {} got {payload} NVLS=0",
                r % 2,
                r / 2
            )
        })
        .collect();
    assert_eq!(lines, expected);
}

#[test]
fn a_failing_rank_stops_the_others_quickly() {
    let started = Instant::now();
    // Without the launcher's intervention, ranks 0 and 2 would wait 30 s for rank 1.
    let cfg = child_config(
        3,
        "00",
        &[(FAIL_VAR, "1:3"), ("CUDA_GRAPH_RENDEZVOUS_TIMEOUT", "30")],
    );
    let err = launch(&cfg).unwrap_err();
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    let message = err.to_string();
    match err {
        LaunchError::RankFailed {
            rank,
            local_rank,
            status,
            stopped,
            report,
        } => {
            assert_eq!((rank, local_rank), (1, 1));
            assert_eq!(status.code(), Some(3));
            assert_eq!(stopped, [0, 2], "{report:#?}");
            assert_eq!(
                report.ranks[1].stderr,
                ["rank 1 fails on purpose".to_owned()]
            );
            // Killed, or (having seen a peer die first) failed on their own.
            for other in [0, 2] {
                let status = report.ranks[other].status.unwrap();
                assert!(!status.success(), "rank {other}: {status}");
            }
            assert_eq!(report.ranks[0].status.unwrap().signal(), Some(9));
        }
        other => panic!("expected a rank failure, got {other:?}"),
    }
    assert_eq!(
        message,
        "rank 1 (local rank 1) exited with code 3; killed ranks 0, 2"
    );
}

#[test]
fn a_missing_program_is_a_spawn_error() {
    let cfg = LaunchConfig::new(2, "/nonexistent/cuda-graph-nccl-test-program");
    let err = launch(&cfg).unwrap_err();
    match &err {
        LaunchError::Spawn { rank, source, .. } => {
            assert_eq!(*rank, 0);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected a spawn error, got {other:?}"),
    }
    assert!(
        err.to_string()
            .starts_with("could not start rank 0 (/nonexistent/cuda-graph-nccl-test-program): "),
        "{err}"
    );
}

#[test]
fn invalid_configurations_are_refused() {
    let base = LaunchConfig::new(2, "/bin/true");
    type Edit = fn(&mut LaunchConfig);
    let cases: [(Edit, &str); 6] = [
        (|c| c.nproc_per_node = 0, "nproc_per_node is 0"),
        (|c| c.nnodes = 0, "nnodes is 0"),
        (
            |c| {
                c.nnodes = 2;
                c.node_rank = 2;
                c.master_port = Some(29500);
            },
            "node_rank 2 is out of range for 2 node(s)",
        ),
        (
            |c| c.nnodes = 2,
            "a 2-node job needs a master_port every node agrees on",
        ),
        (|c| c.master_port = Some(0), "master_port is 0"),
        (|c| c.master_addr.clear(), "master_addr is empty"),
    ];
    for (edit, expected) in cases {
        let mut cfg = base.clone();
        edit(&mut cfg);
        let err = launch(&cfg).unwrap_err();
        assert!(
            matches!(err, LaunchError::InvalidConfig { .. }),
            "{cfg:?}: {err:?}"
        );
        assert!(err.to_string().contains(expected), "{err}");
    }
    let mut multi = base.clone();
    multi.nnodes = 3;
    multi.node_rank = 2;
    multi.master_port = Some(29500);
    assert_eq!(multi.world_size().unwrap(), 6);
}

#[test]
fn killing_the_launcher_alone_kills_its_children() {
    // A launcher killed with SIGKILL (a scheduler, an OOM kill) cannot stop its children
    // itself: the kernel must (the parent-death signal), or they would keep their GPUs.
    let file = std::env::temp_dir().join(format!(
        "cuda-graph-nccl-orphans-{}-{}",
        std::process::id(),
        random_hex()
    ));
    let mut launcher = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, "1")
        .env(ORPHAN_VAR, &file)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let pids: Vec<i32> = loop {
        let pids: Vec<i32> = std::fs::read_to_string(&file)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        if pids.len() == 2 {
            break pids;
        }
        assert!(
            Instant::now() < deadline,
            "the children never started: {pids:?}"
        );
        thread::sleep(Duration::from_millis(20));
    };
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    let alive = |pid: i32| {
        // A zombie (reaped by init shortly) counts as gone.
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                !s.split(") ")
                    .nth(1)
                    .is_some_and(|rest| rest.starts_with('Z'))
            })
            .unwrap_or(false)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&p| alive(p)) {
        assert!(
            Instant::now() < deadline,
            "children {pids:?} outlived their launcher"
        );
        thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::remove_file(&file);
}
