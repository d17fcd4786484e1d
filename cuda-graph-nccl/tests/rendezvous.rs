//! The rendezvous, with threads as ranks over loopback. Every test uses its own free port and
//! short timeouts, so the tests run in parallel and each finishes within a few seconds.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cuda_graph_nccl::rendezvous::{
    DEFAULT_TIMEOUT, MAGIC, MAX_PAYLOAD_LEN, PROTOCOL_VERSION, RendezvousConfig, RendezvousError,
    TIMEOUT_VAR, meet,
};

/// A port that was free a moment ago (the kernel does not hand it out again right away).
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

fn config(port: u16, rank: usize, world_size: usize, timeout: Duration) -> RendezvousConfig {
    RendezvousConfig {
        timeout,
        ..RendezvousConfig::new("127.0.0.1", port, rank, world_size)
    }
}

/// `len` bytes from a time-seeded xorshift, different on every run.
fn random_bytes(len: usize) -> Vec<u8> {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let mut state = ((nanos as u64) ^ 0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// Runs `meet` for one rank on its own thread; rank 0 offers `payload`.
fn spawn_rank(
    cfg: RendezvousConfig,
    payload: Vec<u8>,
) -> thread::JoinHandle<Result<Vec<u8>, RendezvousError>> {
    thread::spawn(move || meet(&cfg, || Ok::<_, String>(payload)))
}

/// A hello as a client of another version or world would send it.
fn hello(magic: &[u8; 8], version: u32, rank: u64, world_size: u64) -> Vec<u8> {
    let mut bytes = magic.to_vec();
    bytes.extend_from_slice(&version.to_le_bytes());
    bytes.extend_from_slice(&rank.to_le_bytes());
    bytes.extend_from_slice(&world_size.to_le_bytes());
    bytes
}

/// Connects a raw socket to a server that may not be listening yet.
fn connect_raw(port: u16) -> TcpStream {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(stream) => {
                stream
                    .set_read_timeout(Some(Duration::from_secs(5)))
                    .unwrap();
                return stream;
            }
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("could not connect to 127.0.0.1:{port}: {e}"),
        }
    }
}

/// Reads one frame from rank 0: (kind, body).
fn read_frame(stream: &mut TcpStream) -> (u8, Vec<u8>) {
    let mut header = [0u8; 5];
    stream.read_exact(&mut header).unwrap();
    let len = u32::from_le_bytes(header[1..].try_into().unwrap()) as usize;
    let mut body = vec![0; len];
    stream.read_exact(&mut body).unwrap();
    (header[0], body)
}

#[test]
fn world_of_one_opens_no_socket() {
    // An address that is not local: binding it would fail, so success proves no socket.
    let cfg = RendezvousConfig::new("192.0.2.1", 9, 0, 1);
    let calls = AtomicUsize::new(0);
    let got = meet(&cfg, || {
        calls.fetch_add(1, Ordering::SeqCst);
        Ok::<_, String>(b"solo".to_vec())
    })
    .unwrap();
    assert_eq!(got, b"solo");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[test]
fn four_ranks_get_rank_zero_payload() {
    let port = free_port();
    let payload = random_bytes(128);
    let ranks: Vec<_> = (0..4)
        .map(|rank| {
            // Only rank 0's payload counts; the others offer garbage that must never appear.
            let offer = if rank == 0 {
                payload.clone()
            } else {
                vec![0xEE; 3]
            };
            spawn_rank(config(port, rank, 4, Duration::from_secs(10)), offer)
        })
        .collect();
    for (rank, handle) in ranks.into_iter().enumerate() {
        let got = handle
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(got, payload, "rank {rank}");
    }
}

#[test]
fn payload_closure_runs_only_on_rank_zero() {
    let port = free_port();
    let calls = std::sync::Arc::new(AtomicUsize::new(0));
    let ranks: Vec<_> = (0..3)
        .map(|rank| {
            let cfg = config(port, rank, 3, Duration::from_secs(10));
            let calls = calls.clone();
            thread::spawn(move || {
                meet(&cfg, || {
                    calls.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, String>(vec![rank as u8])
                })
            })
        })
        .collect();
    for handle in ranks {
        assert_eq!(handle.join().unwrap().unwrap(), vec![0]);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[test]
fn ranks_started_in_shuffled_order_with_delays() {
    let port = free_port();
    let payload = random_bytes(64);
    let mut handles = HashMap::new();
    // Clients 3 and 1 start before the server exists and must retry.
    for rank in [3, 1, 0, 2] {
        let cfg = config(port, rank, 4, Duration::from_secs(10));
        handles.insert(rank, spawn_rank(cfg, payload.clone()));
        thread::sleep(Duration::from_millis(150));
    }
    for (rank, handle) in handles {
        let got = handle
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(got, payload, "rank {rank}");
    }
}

#[test]
fn timeout_names_the_missing_ranks_on_every_rank() {
    let port = free_port();
    let timeout = Duration::from_millis(1000);
    // Rank 1 starts first, so its own deadline is the earlier one: it must still report rank 0's
    // verdict rather than a timeout of its own.
    let rank1 = spawn_rank(config(port, 1, 4, timeout), Vec::new());
    thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    let rank0 = spawn_rank(config(port, 0, 4, timeout), b"id".to_vec());

    let err0 = rank0.join().unwrap().unwrap_err();
    let elapsed = started.elapsed();
    let err1 = rank1.join().unwrap().unwrap_err();
    assert!(elapsed < Duration::from_secs(4), "rank 0 took {elapsed:?}");
    for err in [&err0, &err1] {
        match err {
            RendezvousError::Timeout {
                missing,
                world_size,
                waited,
                ..
            } => {
                assert_eq!(missing, &[2, 3]);
                assert_eq!(*world_size, 4);
                assert!(*waited >= timeout, "{waited:?}");
            }
            other => panic!("expected a timeout, got: {other}"),
        }
    }
    let message = err0.to_string();
    assert!(
        message.contains(&format!(
            "rendezvous at 127.0.0.1:{port} timed out after 1."
        )),
        "{message}"
    );
    assert!(
        message.contains("ranks 2, 3 of 4 never arrived"),
        "{message}"
    );
    assert_eq!(err1.to_string(), message);
}

#[test]
fn duplicate_rank_is_rejected_and_the_rest_complete() {
    let port = free_port();
    let payload = random_bytes(16);
    let timeout = Duration::from_secs(10);
    let rank0 = spawn_rank(config(port, 0, 3, timeout), payload.clone());
    let (tx, rx) = mpsc::channel();
    for _ in 0..2 {
        let cfg = config(port, 1, 3, timeout);
        let tx = tx.clone();
        thread::spawn(move || tx.send(meet(&cfg, || Ok::<_, String>(Vec::new()))));
        thread::sleep(Duration::from_millis(100));
    }
    // Nothing can complete before rank 2 arrives, so the first answer is the rejection.
    let first = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    match first {
        Err(RendezvousError::Rejected { reason, .. }) => {
            assert!(reason.contains("rank 1 has already arrived"), "{reason}");
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
    let rank2 = spawn_rank(config(port, 2, 3, timeout), Vec::new());
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(5)).unwrap().unwrap(),
        payload
    );
    assert_eq!(rank2.join().unwrap().unwrap(), payload);
    assert_eq!(rank0.join().unwrap().unwrap(), payload);
}

#[test]
fn duplicate_rank_is_reported_when_rank_zero_times_out() {
    let port = free_port();
    let timeout = Duration::from_millis(2000);
    let rank0 = spawn_rank(config(port, 0, 3, timeout), b"id".to_vec());
    let first = spawn_rank(config(port, 1, 3, timeout), Vec::new());
    thread::sleep(Duration::from_millis(200));
    let second = spawn_rank(config(port, 1, 3, timeout), Vec::new());

    let err0 = rank0.join().unwrap().unwrap_err();
    let message = err0.to_string();
    let RendezvousError::Timeout {
        missing, rejected, ..
    } = &err0
    else {
        panic!("expected a timeout, got: {message}");
    };
    assert_eq!(missing, &[2]);
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert!(message.contains("rank 2 of 3 never arrived"), "{message}");
    assert!(message.contains("rank 1 has already arrived"), "{message}");
    let results = [first.join().unwrap(), second.join().unwrap()];
    let rejections = results
        .iter()
        .filter(|r| matches!(r, Err(RendezvousError::Rejected { .. })))
        .count();
    let timeouts = results
        .iter()
        .filter(|r| matches!(r, Err(RendezvousError::Timeout { missing, .. }) if missing == &[2]))
        .count();
    assert_eq!((rejections, timeouts), (1, 1), "{results:?}");
}

#[test]
fn world_size_mismatch_is_rejected() {
    let port = free_port();
    let timeout = Duration::from_secs(10);
    let rank0 = spawn_rank(config(port, 0, 2, timeout), b"ok".to_vec());
    let stray = meet(&config(port, 1, 3, timeout), || Ok::<_, String>(Vec::new()));
    match stray {
        Err(RendezvousError::Rejected { reason, .. }) => {
            assert!(
                reason.contains("world size 3") && reason.contains("world size 2"),
                "{reason}"
            );
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
    let rank1 = spawn_rank(config(port, 1, 2, timeout), Vec::new());
    assert_eq!(rank1.join().unwrap().unwrap(), b"ok");
    assert_eq!(rank0.join().unwrap().unwrap(), b"ok");
}

#[test]
fn garbage_and_silent_connections_do_not_break_the_rendezvous() {
    let port = free_port();
    let timeout = Duration::from_secs(10);
    let payload = random_bytes(32);
    let rank0 = spawn_rank(config(port, 0, 3, timeout), payload.clone());

    // Connects and says nothing: must not hold anyone up.
    let _silent = connect_raw(port);
    // Not our protocol at all.
    let mut http = connect_raw(port);
    http.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let (kind, reason) = read_frame(&mut http);
    assert_eq!(kind, 3);
    let reason = String::from_utf8(reason).unwrap();
    assert!(
        reason.contains("not a cuda-graph-nccl rendezvous"),
        "{reason}"
    );
    // Our magic, another version.
    let mut future = connect_raw(port);
    future
        .write_all(&hello(&MAGIC, PROTOCOL_VERSION + 1, 1, 3))
        .unwrap();
    let (kind, reason) = read_frame(&mut future);
    assert_eq!(kind, 3);
    assert!(
        String::from_utf8_lossy(&reason).contains("protocol version"),
        "{reason:?}"
    );

    let started = Instant::now();
    let ranks = [1, 2].map(|rank| spawn_rank(config(port, rank, 3, timeout), Vec::new()));
    for handle in ranks {
        assert_eq!(handle.join().unwrap().unwrap(), payload);
    }
    assert_eq!(rank0.join().unwrap().unwrap(), payload);
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[test]
fn a_rank_that_leaves_before_the_payload_can_rejoin() {
    let port = free_port();
    let timeout = Duration::from_secs(10);
    let rank0 = spawn_rank(config(port, 0, 3, timeout), b"again".to_vec());
    {
        // Rank 1 arrives (rank 0 answers with a wait frame), then its process dies.
        let mut ghost = connect_raw(port);
        ghost
            .write_all(&hello(&MAGIC, PROTOCOL_VERSION, 1, 3))
            .unwrap();
        assert_eq!(read_frame(&mut ghost).0, 1);
    }
    let ranks = [1, 2].map(|rank| spawn_rank(config(port, rank, 3, timeout), Vec::new()));
    for handle in ranks {
        assert_eq!(handle.join().unwrap().unwrap(), b"again");
    }
    assert_eq!(rank0.join().unwrap().unwrap(), b"again");
}

#[test]
fn rank_zero_reports_a_rank_that_never_acknowledges() {
    let port = free_port();
    let rank0 = spawn_rank(config(port, 0, 2, Duration::from_secs(10)), b"id".to_vec());
    let mut client = connect_raw(port);
    client
        .write_all(&hello(&MAGIC, PROTOCOL_VERSION, 1, 2))
        .unwrap();
    assert_eq!(read_frame(&mut client).0, 1);
    assert_eq!(read_frame(&mut client), (2, b"id".to_vec()));
    // Hangs up without the acknowledgement.
    drop(client);
    let err = rank0.join().unwrap().unwrap_err();
    match &err {
        RendezvousError::Undelivered { ranks, .. } => assert_eq!(ranks, &[1]),
        other => panic!("expected an undelivered payload, got {other:?}"),
    }
    assert!(
        err.to_string()
            .contains("could not confirm that rank 1 received the payload"),
        "{err}"
    );
}

#[test]
fn client_without_server_cannot_reach_rank_zero() {
    let port = free_port();
    let started = Instant::now();
    let err = meet(&config(port, 1, 2, Duration::from_millis(400)), || {
        Ok::<_, String>(Vec::new())
    })
    .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(
        matches!(err, RendezvousError::Unreachable { .. }),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.starts_with(&format!(
            "could not reach rank 0 at 127.0.0.1:{port} within 0."
        )),
        "{message}"
    );
    assert!(message.contains("last error:"), "{message}");
}

#[test]
fn client_reports_a_server_that_vanishes() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let fake = thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut hello = [0u8; 28];
        stream.read_exact(&mut hello).unwrap();
        // Hangs up without a word.
    });
    let err = meet(&config(port, 1, 2, Duration::from_secs(5)), || {
        Ok::<_, String>(Vec::new())
    })
    .unwrap_err();
    fake.join().unwrap();
    match &err {
        RendezvousError::Connection { source, rank, .. } => {
            assert_eq!(source.kind(), std::io::ErrorKind::UnexpectedEof);
            assert_eq!(*rank, 1);
        }
        other => panic!("expected a connection error, got {other:?}"),
    }
    assert!(err.to_string().contains("closed the connection"), "{err}");
}

#[test]
fn client_rejects_an_oversized_frame() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let fake = thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut hello = [0u8; 28];
        stream.read_exact(&mut hello).unwrap();
        // A payload frame claiming 4 GiB - 1 bytes.
        stream.write_all(&[2, 0xff, 0xff, 0xff, 0xff]).unwrap();
        thread::sleep(Duration::from_millis(200));
    });
    let err = meet(&config(port, 1, 2, Duration::from_secs(5)), || {
        Ok::<_, String>(Vec::new())
    })
    .unwrap_err();
    fake.join().unwrap();
    assert!(err.to_string().contains("exceeds the limit"), "{err}");
}

#[test]
fn port_in_use_is_a_bind_error() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let err = meet(&config(port, 0, 2, Duration::from_secs(5)), || {
        Ok::<_, String>(Vec::new())
    })
    .unwrap_err();
    match &err {
        RendezvousError::Bind { source, .. } => {
            assert_eq!(source.kind(), std::io::ErrorKind::AddrInUse);
        }
        other => panic!("expected a bind error, got {other:?}"),
    }
    let message = err.to_string();
    assert!(
        message.starts_with(&format!("rank 0 could not listen on 127.0.0.1:{port}: ")),
        "{message}"
    );
    assert!(message.contains("MASTER_PORT"), "{message}");
}

#[test]
fn payload_failure_is_reported_at_once() {
    let solo = meet(&RendezvousConfig::new("127.0.0.1", 0, 0, 1), || {
        Err::<Vec<u8>, _>("libnccl.so.2 not found")
    });
    let err = solo.unwrap_err();
    assert!(matches!(err, RendezvousError::Payload { .. }));
    assert_eq!(
        err.to_string(),
        "rank 0 could not produce the rendezvous payload: libnccl.so.2 not found"
    );

    // With other ranks, rank 0 fails before waiting for anyone.
    let started = Instant::now();
    let err = meet(&config(free_port(), 0, 4, Duration::from_secs(30)), || {
        Err::<Vec<u8>, _>("no GPU")
    })
    .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(err.to_string().ends_with("no GPU"), "{err}");
}

#[test]
fn oversized_payload_is_refused() {
    let cfg = config(free_port(), 0, 2, Duration::from_secs(5));
    let err = meet(&cfg, || Ok::<_, String>(vec![0; MAX_PAYLOAD_LEN + 1])).unwrap_err();
    assert!(
        matches!(err, RendezvousError::PayloadTooLarge { len, max } if len == MAX_PAYLOAD_LEN + 1 && max == MAX_PAYLOAD_LEN),
        "{err:?}"
    );
    // The limit itself is fine (a world of one sends nothing, but the rule is the same).
    let solo = RendezvousConfig::new("127.0.0.1", 0, 0, 1);
    assert_eq!(
        meet(&solo, || Ok::<_, String>(vec![7; MAX_PAYLOAD_LEN]))
            .unwrap()
            .len(),
        MAX_PAYLOAD_LEN
    );
}

#[test]
fn large_payload_reaches_every_rank() {
    let port = free_port();
    let payload = random_bytes(MAX_PAYLOAD_LEN);
    let ranks: Vec<_> = (0..3)
        .map(|rank| {
            spawn_rank(
                config(port, rank, 3, Duration::from_secs(10)),
                payload.clone(),
            )
        })
        .collect();
    for handle in ranks {
        assert!(handle.join().unwrap().unwrap() == payload);
    }
}

#[test]
fn invalid_configurations_are_refused() {
    let cases = [
        (
            RendezvousConfig::new("127.0.0.1", 1234, 0, 0),
            "world size is 0",
        ),
        (
            RendezvousConfig::new("127.0.0.1", 1234, 4, 4),
            "rank 4 is out of range for world size 4",
        ),
        (RendezvousConfig::new("127.0.0.1", 0, 1, 2), "port 0"),
        (RendezvousConfig::new(" ", 1234, 1, 2), "address is empty"),
        (config(1234, 0, 2, Duration::ZERO), "timeout is zero"),
    ];
    for (cfg, expected) in cases {
        let err = meet(&cfg, || Ok::<_, String>(Vec::new())).unwrap_err();
        assert!(
            matches!(err, RendezvousError::InvalidConfig { .. }),
            "{cfg:?}: {err:?}"
        );
        assert!(err.to_string().contains(expected), "{cfg:?}: {err}");
    }
}

fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |name| map.get(name).cloned()
}

#[test]
fn from_vars_reads_the_launcher_environment() {
    let cfg = RendezvousConfig::from_vars(vars(&[
        ("MASTER_ADDR", "10.0.0.7"),
        ("MASTER_PORT", " 29500 "),
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
    ]))
    .unwrap();
    assert_eq!(cfg, RendezvousConfig::new("10.0.0.7", 29500, 3, 8));
    assert_eq!(cfg.timeout, DEFAULT_TIMEOUT);
    assert_eq!(cfg.endpoint(), "10.0.0.7:29500");

    let cfg = RendezvousConfig::from_vars(vars(&[
        ("MASTER_ADDR", "::1"),
        ("MASTER_PORT", "29500"),
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        (TIMEOUT_VAR, "2.5"),
    ]))
    .unwrap();
    assert_eq!(cfg.timeout, Duration::from_millis(2500));
    assert_eq!(cfg.endpoint(), "[::1]:29500");

    // A single process needs no master.
    let cfg = RendezvousConfig::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "1")])).unwrap();
    assert_eq!((cfg.rank, cfg.world_size), (0, 1));
}

#[test]
fn from_vars_names_the_bad_variable_and_value() {
    let base = [
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
    ];
    let with = |var: &str, value: Option<&str>| {
        let mut pairs: Vec<(&str, &str)> =
            base.iter().copied().filter(|(k, _)| *k != var).collect();
        if let Some(value) = value {
            pairs.push((var, value));
        }
        RendezvousConfig::from_vars(vars(&pairs)).unwrap_err()
    };
    let cases = [
        (
            with("RANK", None),
            "RANK",
            None,
            "environment variable RANK is not set",
        ),
        (
            with("WORLD_SIZE", Some("four")),
            "WORLD_SIZE",
            Some("four"),
            "environment variable WORLD_SIZE=\"four\" is invalid: expected a positive integer",
        ),
        (
            with("WORLD_SIZE", Some("0")),
            "WORLD_SIZE",
            Some("0"),
            "expected a positive integer",
        ),
        (
            with("RANK", Some("4")),
            "RANK",
            Some("4"),
            "environment variable RANK=\"4\" is invalid: the rank must be below WORLD_SIZE=4",
        ),
        (
            with("RANK", Some("-1")),
            "RANK",
            Some("-1"),
            "expected a non-negative integer",
        ),
        (
            with("MASTER_PORT", Some("70000")),
            "MASTER_PORT",
            Some("70000"),
            "environment variable MASTER_PORT=\"70000\" is invalid: expected a port number from 1 to 65535",
        ),
        (
            with("MASTER_PORT", None),
            "MASTER_PORT",
            None,
            "environment variable MASTER_PORT is not set",
        ),
        (
            with("MASTER_ADDR", Some("")),
            "MASTER_ADDR",
            Some(""),
            "expected a host name or IP address",
        ),
        (
            with(TIMEOUT_VAR, Some("soon")),
            TIMEOUT_VAR,
            Some("soon"),
            "CUDA_GRAPH_RENDEZVOUS_TIMEOUT=\"soon\" is invalid: expected a positive number of seconds",
        ),
        (
            with(TIMEOUT_VAR, Some("0")),
            TIMEOUT_VAR,
            Some("0"),
            "expected a positive number of seconds",
        ),
    ];
    for (err, var, value, message) in cases {
        match &err {
            RendezvousError::Env {
                var: got_var,
                value: got_value,
                ..
            } => {
                assert_eq!(got_var, var);
                assert_eq!(got_value.as_deref(), value);
            }
            other => panic!("expected an environment error for {var}, got {other:?}"),
        }
        assert!(err.to_string().contains(message), "{err}");
    }
}
