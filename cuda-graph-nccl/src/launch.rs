//! A `torchrun`-like launcher: start one process per GPU, watch them, stop them together.
//!
//! [`launch`] starts [`LaunchConfig::nproc_per_node`] copies of a program on this node, each with
//! the environment a multi-process job expects, forwards their output, and waits. When every
//! process exits successfully it returns a [`LaunchReport`]; as soon as one fails (a non-zero
//! exit code or a signal), it kills the others and returns [`LaunchError::RankFailed`] naming the
//! first failure. `fp8-moe --gpus N` is built on it.
//!
//! # The children's environment
//!
//! Each child inherits the launcher's environment, then [`LaunchConfig::env`] is applied, then
//! the launcher's own variables, which therefore win over both:
//!
//! | Variable           | Value                                             |
//! |--------------------|---------------------------------------------------|
//! | `RANK`             | `node_rank * nproc_per_node + local_rank`         |
//! | `LOCAL_RANK`       | `0..nproc_per_node`                               |
//! | `WORLD_SIZE`       | `nnodes * nproc_per_node`                         |
//! | `LOCAL_WORLD_SIZE` | `nproc_per_node`                                  |
//! | `NODE_RANK`        | [`LaunchConfig::node_rank`]                       |
//! | `MASTER_ADDR`      | [`LaunchConfig::master_addr`]                     |
//! | `MASTER_PORT`      | [`LaunchConfig::master_port`], or the port picked |
//! | `NCCL_NVLS_ENABLE` | always `0`                                        |
//!
//! `NCCL_NVLS_ENABLE=0` keeps NCCL from using `NVLink` SHARP / multicast, which must stay off on the
//! shared machines this workspace runs on; the launcher sets it unconditionally, overriding an
//! inherited value or one in [`LaunchConfig::env`]. These are the variables
//! [`RendezvousConfig::from_env`](crate::rendezvous::RendezvousConfig::from_env) reads.
//!
//! The children's standard input is `/dev/null`.
//!
//! # Ports
//!
//! With [`LaunchConfig::master_port`] `None` (single node only), the launcher binds
//! `master_addr:0`, notes the port the system picked and closes the socket before starting the
//! children. Another process could take the port in between; the window is small, and the
//! rendezvous then fails with a clear "could not listen" error on rank 0. A multi-node job needs
//! an explicit port that every node's launcher is given.
//!
//! # Stopping
//!
//! The launcher polls the children every 20 ms. Stopping means `SIGKILL` ([`Child::kill`]), sent
//! to the children only: processes they started themselves are not tracked. If the launcher
//! itself dies (killed by a scheduler, say), the kernel kills the children too
//! (`PR_SET_PDEATHSIG`), so none is left holding its GPU or waiting in a collective.
//! Interrupting the launcher from a terminal (Ctrl-C) interrupts the children too, since they
//! share its process group.
//!
//! # Example
//!
//! ```no_run
//! use cuda_graph_nccl::launch::{launch, LaunchConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut cfg = LaunchConfig::new(4, std::env::current_exe()?);
//! cfg.args = vec!["--worker".into()];
//! let report = launch(&cfg)?; // lines come out as "[rank 2] ..."
//! println!("4 ranks met on port {}", report.master_port);
//! # Ok(())
//! # }
//! ```

use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How often the launcher checks on its children.
const POLL_INTERVAL: Duration = Duration::from_millis(20);
/// How long the launcher waits, once every child has exited, for their output to drain. Only a
/// process the child started, still holding its stdout or stderr, makes it wait that long.
const OUTPUT_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// Longer lines are forwarded in pieces of this many bytes.
const MAX_LINE_LEN: u64 = 64 * 1024;

/// What happens to the children's standard output and error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Output {
    /// The children write straight to the launcher's stdout and stderr.
    Inherit,
    /// Each line is forwarded to the launcher's stdout or stderr as `[rank R] line`, whole (lines
    /// of different ranks never mix within a line). The default.
    #[default]
    Prefixed,
    /// Lines are collected, without their line ending, into [`RankReport::stdout`] and
    /// [`RankReport::stderr`] (lossily decoded as UTF-8) and not printed.
    Capture,
}

/// What to launch, and where this node stands in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Processes to start on this node (usually one per GPU); at least 1.
    pub nproc_per_node: usize,
    /// Nodes in the job; at least 1.
    pub nnodes: usize,
    /// This node's index, below `nnodes`.
    pub node_rank: usize,
    /// The address of rank 0's node, where the rendezvous listens.
    pub master_addr: String,
    /// The rendezvous port; `None` picks a free one (single node only).
    pub master_port: Option<u16>,
    /// The program every child runs.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra environment for the children, applied over the inherited environment and under the
    /// launcher's own variables (see the [module docs](self)).
    pub env: Vec<(OsString, OsString)>,
    /// What happens to the children's output.
    pub output: Output,
}

impl LaunchConfig {
    /// A single-node launch of `nproc_per_node` copies of `program`, without arguments, meeting
    /// at `127.0.0.1` on a free port, with prefixed output.
    pub fn new(nproc_per_node: usize, program: impl Into<PathBuf>) -> Self {
        Self {
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".to_owned(),
            master_port: None,
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            output: Output::default(),
        }
    }

    /// The number of ranks in the whole job, `nnodes * nproc_per_node`.
    ///
    /// # Errors
    ///
    /// [`LaunchError::InvalidConfig`] if the configuration is not [valid](Self::validate).
    pub fn world_size(&self) -> Result<usize, LaunchError> {
        self.validate()?;
        self.nnodes
            .checked_mul(self.nproc_per_node)
            .ok_or_else(|| invalid("nnodes * nproc_per_node overflows".to_owned()))
    }

    /// Checks the configuration as [`launch`] does: at least one process and one node, a node
    /// rank below `nnodes`, a master address, and a non-zero port, which a multi-node job must
    /// give.
    ///
    /// # Errors
    ///
    /// [`LaunchError::InvalidConfig`] saying what is wrong.
    pub fn validate(&self) -> Result<(), LaunchError> {
        if self.nproc_per_node == 0 {
            return Err(invalid(
                "nproc_per_node is 0; it must be at least 1".to_owned(),
            ));
        }
        if self.nnodes == 0 {
            return Err(invalid("nnodes is 0; it must be at least 1".to_owned()));
        }
        if self.node_rank >= self.nnodes {
            return Err(invalid(format!(
                "node_rank {} is out of range for {} node(s) (node ranks are 0 to {})",
                self.node_rank,
                self.nnodes,
                self.nnodes - 1
            )));
        }
        if self.master_addr.trim().is_empty() {
            return Err(invalid("master_addr is empty".to_owned()));
        }
        match self.master_port {
            Some(0) => Err(invalid(
                "master_port is 0; give a real port, or None to pick a free one".to_owned(),
            )),
            None if self.nnodes > 1 => Err(invalid(format!(
                "a {}-node job needs a master_port every node agrees on; a free port can only \
                 be picked for a single node",
                self.nnodes
            ))),
            _ => Ok(()),
        }
    }
}

fn invalid(reason: String) -> LaunchError {
    LaunchError::InvalidConfig { reason }
}

/// How a launch ended: every rank of this node, in order of local rank.
#[derive(Debug, Clone)]
pub struct LaunchReport {
    /// The rendezvous address given to the children.
    pub master_addr: String,
    /// The rendezvous port given to the children (the one picked when none was configured).
    pub master_port: u16,
    /// The number of ranks in the whole job.
    pub world_size: usize,
    /// This node's ranks, by local rank.
    pub ranks: Vec<RankReport>,
}

/// How one child ended.
#[derive(Debug, Clone)]
pub struct RankReport {
    /// Its global rank.
    pub rank: usize,
    /// Its rank on this node.
    pub local_rank: usize,
    /// Its process id.
    pub pid: u32,
    /// Its exit status; `None` only if it could not be reaped.
    pub status: Option<ExitStatus>,
    /// Its standard output lines with [`Output::Capture`]; empty otherwise.
    pub stdout: Vec<String>,
    /// Its standard error lines with [`Output::Capture`]; empty otherwise.
    pub stderr: Vec<String>,
}

/// Why a launch failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// The [`LaunchConfig`] is inconsistent.
    #[error("invalid launch configuration: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: String,
    },

    /// No free port could be found for the rendezvous.
    #[error("could not pick a free rendezvous port on {addr}: {source}")]
    FreePort {
        /// The address the launcher tried to bind.
        addr: String,
        /// The operating system's error.
        source: io::Error,
    },

    /// A child could not be started; the ones already started were killed.
    #[error("could not start rank {rank} ({}): {source}", program.display())]
    Spawn {
        /// The program.
        program: PathBuf,
        /// The rank that could not be started.
        rank: usize,
        /// The operating system's error.
        source: io::Error,
    },

    /// A child failed; the others still running were killed.
    #[error(
        "rank {rank} (local rank {local_rank}) {}{}",
        describe_status(*status),
        describe_stopped(stopped)
    )]
    RankFailed {
        /// The global rank of the first child seen failing.
        rank: usize,
        /// Its local rank.
        local_rank: usize,
        /// How it ended.
        status: ExitStatus,
        /// The ranks that were still running and that the launcher therefore killed. (One may
        /// still end with an exit code of its own, having noticed its peers' death first.)
        stopped: Vec<usize>,
        /// Every rank of this node, with the captured output under [`Output::Capture`].
        report: Box<LaunchReport>,
    },

    /// The launcher could not query a child's state; all children were killed.
    #[error("could not wait for rank {rank}: {source}")]
    Wait {
        /// The rank.
        rank: usize,
        /// The operating system's error.
        source: io::Error,
    },
}

/// "exited with code 3" or "was killed by signal 9 (SIGKILL)".
fn describe_status(status: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            let core = if status.core_dumped() {
                ", core dumped"
            } else {
                ""
            };
            return match signal_name(signal) {
                Some(name) => format!("was killed by signal {signal} ({name}{core})"),
                None => format!("was killed by signal {signal}{core}"),
            };
        }
    }
    match status.code() {
        Some(code) => format!("exited with code {code}"),
        None => format!("ended with {status}"),
    }
}

#[cfg(unix)]
fn signal_name(signal: i32) -> Option<&'static str> {
    // The numbers POSIX fixes, plus those Linux shares on x86 and Arm.
    Some(match signal {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        5 => "SIGTRAP",
        6 => "SIGABRT",
        8 => "SIGFPE",
        9 => "SIGKILL",
        #[cfg(target_os = "linux")]
        7 => "SIGBUS",
        #[cfg(target_os = "linux")]
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        _ => return None,
    })
}

fn describe_stopped(stopped: &[usize]) -> String {
    match stopped {
        [] => String::new(),
        [rank] => format!("; killed rank {rank}"),
        ranks => {
            let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
            format!("; killed ranks {}", list.join(", "))
        }
    }
}

/// Launches this node's ranks and waits for all of them; see the [module docs](self).
///
/// Returns once every child has exited successfully, or as soon as one fails (after killing and
/// reaping the others). The output-forwarding threads are joined before it returns; should a
/// process started by a child still hold the pipes 5 s after every child has exited, its output
/// is abandoned (the thread ends on its own when the pipe closes).
///
/// # Errors
///
/// [`LaunchError::InvalidConfig`] and [`LaunchError::FreePort`] before anything starts;
/// [`LaunchError::Spawn`] if a child cannot be started; [`LaunchError::RankFailed`] when a child
/// fails (the first one seen, with every rank's status and captured output);
/// [`LaunchError::Wait`] if a child's state cannot be queried.
pub fn launch(cfg: &LaunchConfig) -> Result<LaunchReport, LaunchError> {
    let world_size = cfg.world_size()?;
    let master_port = match cfg.master_port {
        Some(port) => port,
        None => free_port(&cfg.master_addr)?,
    };
    let mut report = LaunchReport {
        master_addr: cfg.master_addr.clone(),
        master_port,
        world_size,
        ranks: Vec::with_capacity(cfg.nproc_per_node),
    };
    let mut children: Vec<Running> = Vec::with_capacity(cfg.nproc_per_node);
    for local_rank in 0..cfg.nproc_per_node {
        let rank = cfg.node_rank * cfg.nproc_per_node + local_rank;
        match spawn_rank(cfg, world_size, master_port, rank, local_rank) {
            Ok(child) => children.push(child),
            Err(source) => {
                stop(&mut children);
                finish(children, &mut report);
                return Err(LaunchError::Spawn {
                    program: cfg.program.clone(),
                    rank,
                    source,
                });
            }
        }
    }

    let failure = monitor(&mut children);
    let failed_index = match &failure {
        Some(Failure::Exited(index, _) | Failure::Wait(index, _)) => Some(*index),
        None => None,
    };
    let stopped = children
        .iter()
        .enumerate()
        .filter(|(index, child)| child.killed && Some(*index) != failed_index)
        .map(|(_, child)| child.rank)
        .collect();
    finish(children, &mut report);
    match failure {
        None => Ok(report),
        Some(Failure::Wait(index, source)) => Err(LaunchError::Wait {
            rank: report.ranks[index].rank,
            source,
        }),
        Some(Failure::Exited(index, status)) => Err(LaunchError::RankFailed {
            rank: report.ranks[index].rank,
            local_rank: report.ranks[index].local_rank,
            status,
            stopped,
            report: Box::new(report),
        }),
    }
}

/// Binds `addr:0` and returns the port the system picked (the socket is closed again).
fn free_port(addr: &str) -> Result<u16, LaunchError> {
    // An IPv6 literal may come bracketed, as in `[::1]`.
    let host = addr.trim();
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    TcpListener::bind((host, 0))
        .and_then(|listener| listener.local_addr())
        .map(|local| local.port())
        .map_err(|source| LaunchError::FreePort {
            addr: addr.to_owned(),
            source,
        })
}

/// A started child.
struct Running {
    rank: usize,
    local_rank: usize,
    child: Child,
    status: Option<ExitStatus>,
    /// Whether the launcher killed it.
    killed: bool,
    stdout: Option<JoinHandle<Vec<String>>>,
    stderr: Option<JoinHandle<Vec<String>>>,
}

/// Makes the kernel kill `command`'s process when the launcher dies, so that a launcher
/// killed alone (`SIGKILL` from a scheduler) leaves no rank behind.
fn die_with_the_launcher(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    let launcher = std::process::id();
    // SAFETY: the closure runs in the child between fork and exec; it calls only prctl and
    // getppid (async-signal-safe), allocates nothing and touches no state of the parent.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The launcher died before the prctl: no signal will come, so do not start.
            if libc::getppid() as u32 != launcher {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

fn spawn_rank(
    cfg: &LaunchConfig,
    world_size: usize,
    master_port: u16,
    rank: usize,
    local_rank: usize,
) -> io::Result<Running> {
    let piped = cfg.output != Output::Inherit;
    let stdio = || {
        if piped {
            Stdio::piped()
        } else {
            Stdio::inherit()
        }
    };
    let mut command = Command::new(&cfg.program);
    command
        .args(&cfg.args)
        .envs(cfg.env.iter().map(|(key, value)| (key, value)))
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", local_rank.to_string())
        .env("WORLD_SIZE", world_size.to_string())
        .env("LOCAL_WORLD_SIZE", cfg.nproc_per_node.to_string())
        .env("NODE_RANK", cfg.node_rank.to_string())
        .env("MASTER_ADDR", &cfg.master_addr)
        .env("MASTER_PORT", master_port.to_string())
        // NVLink multicast stays off on the shared machines, whatever the caller's environment.
        .env("NCCL_NVLS_ENABLE", "0")
        .stdin(Stdio::null())
        .stdout(stdio())
        .stderr(stdio());
    die_with_the_launcher(&mut command);
    let mut running = Running {
        rank,
        local_rank,
        child: command.spawn()?,
        status: None,
        killed: false,
        stdout: None,
        stderr: None,
    };
    let forwarders = (|| -> io::Result<()> {
        if let Some(pipe) = running.child.stdout.take() {
            running.stdout = Some(forwarder(pipe, rank, Stream::Stdout, cfg.output)?);
        }
        if let Some(pipe) = running.child.stderr.take() {
            running.stderr = Some(forwarder(pipe, rank, Stream::Stderr, cfg.output)?);
        }
        Ok(())
    })();
    if let Err(e) = forwarders {
        stop(std::slice::from_mut(&mut running));
        return Err(e);
    }
    Ok(running)
}

#[derive(Debug, Clone, Copy)]
enum Stream {
    Stdout,
    Stderr,
}

fn forwarder(
    pipe: impl Read + Send + 'static,
    rank: usize,
    stream: Stream,
    output: Output,
) -> io::Result<JoinHandle<Vec<String>>> {
    let name = match stream {
        Stream::Stdout => format!("rank {rank} stdout"),
        Stream::Stderr => format!("rank {rank} stderr"),
    };
    thread::Builder::new()
        .name(name)
        .spawn(move || forward(BufReader::new(pipe), rank, stream, output))
}

/// Copies lines from a child's pipe until it closes; returns them under [`Output::Capture`].
///
/// Reading continues even when the launcher's own output fails (say, a closed pipe), so that a
/// child never blocks on a full pipe.
fn forward(mut reader: impl BufRead, rank: usize, stream: Stream, output: Output) -> Vec<String> {
    let prefix = format!("[rank {rank}] ");
    let mut captured = Vec::new();
    let mut line = Vec::new();
    loop {
        line.clear();
        match (&mut reader)
            .take(MAX_LINE_LEN)
            .read_until(b'\n', &mut line)
        {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
        if output == Output::Capture {
            let text = line.strip_suffix(b"\n").unwrap_or(&line);
            let text = text.strip_suffix(b"\r").unwrap_or(text);
            captured.push(String::from_utf8_lossy(text).into_owned());
            continue;
        }
        let mut message = Vec::with_capacity(prefix.len() + line.len() + 1);
        message.extend_from_slice(prefix.as_bytes());
        message.extend_from_slice(&line);
        if !message.ends_with(b"\n") {
            message.push(b'\n');
        }
        // One write under the stream's lock: lines of different ranks never mix.
        let _ = match stream {
            Stream::Stdout => io::stdout().lock().write_all(&message),
            Stream::Stderr => io::stderr().lock().write_all(&message),
        };
    }
    captured
}

/// Why monitoring stopped early, with the index of the child concerned.
enum Failure {
    /// It exited unsuccessfully.
    Exited(usize, ExitStatus),
    /// `try_wait` failed.
    Wait(usize, io::Error),
}

/// Waits until every child has exited, or one fails (the others are then stopped).
fn monitor(children: &mut [Running]) -> Option<Failure> {
    loop {
        let mut running = false;
        for index in 0..children.len() {
            let child = &mut children[index];
            if child.status.is_some() {
                continue;
            }
            match child.child.try_wait() {
                Ok(Some(status)) => {
                    child.status = Some(status);
                    if !status.success() {
                        stop(children);
                        return Some(Failure::Exited(index, status));
                    }
                }
                Ok(None) => running = true,
                Err(e) => {
                    stop(children);
                    return Some(Failure::Wait(index, e));
                }
            }
        }
        if !running {
            return None;
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// Kills every child still running, then reaps them all.
///
/// A child counts as killed if it was still running when this was called, however it ended:
/// once rank 0 dies, the others may well exit on their own before their signal lands.
fn stop(children: &mut [Running]) {
    // First see who has exited already, then kill the rest: a child killed first could take
    // another down with it before that one is checked.
    for child in children.iter_mut().filter(|c| c.status.is_none()) {
        if let Ok(Some(status)) = child.child.try_wait() {
            child.status = Some(status);
        }
    }
    for child in children.iter_mut().filter(|c| c.status.is_none()) {
        // Fails only if the child has already been reaped.
        child.killed = child.child.kill().is_ok();
    }
    for child in children.iter_mut().filter(|c| c.status.is_none()) {
        child.status = child.child.wait().ok();
    }
}

/// Joins the output threads (giving up on those still blocked after [`OUTPUT_DRAIN_TIMEOUT`])
/// and records every child in the report.
fn finish(children: Vec<Running>, report: &mut LaunchReport) {
    let deadline = Instant::now() + OUTPUT_DRAIN_TIMEOUT;
    let all_done = |children: &[Running]| {
        children.iter().all(|c| {
            c.stdout.as_ref().is_none_or(JoinHandle::is_finished)
                && c.stderr.as_ref().is_none_or(JoinHandle::is_finished)
        })
    };
    while !all_done(&children) && Instant::now() < deadline {
        thread::sleep(POLL_INTERVAL);
    }
    let join = |handle: Option<JoinHandle<Vec<String>>>| match handle {
        Some(handle) if handle.is_finished() => handle.join().unwrap_or_default(),
        // Still blocked (a grandchild holds the pipe): leave the thread to end on its own.
        _ => Vec::new(),
    };
    for child in children {
        report.ranks.push(RankReport {
            rank: child.rank,
            local_rank: child.local_rank,
            pid: child.child.id(),
            status: child.status,
            stdout: join(child.stdout),
            stderr: join(child.stderr),
        });
    }
}
