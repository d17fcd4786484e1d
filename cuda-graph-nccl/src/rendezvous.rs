//! How the processes of a multi-process job meet: a small TCP rendezvous.
//!
//! Every process (rank) of a job calls [`meet`] with the same address, port and world size.
//! Rank 0 listens on that address, waits until every other rank has connected, and then hands
//! each of them the same opaque payload, which it produced with the closure given to [`meet`]. In
//! practice the payload is NCCL's 128-byte unique id, but this module knows nothing of NCCL: it is
//! the part of `torchrun`'s `MASTER_ADDR` / `MASTER_PORT` dance that gets one blob from rank 0 to
//! everyone else, with errors that say which rank is missing and why.
//!
//! # Configuration
//!
//! [`RendezvousConfig::from_env`] reads the variables a launcher (`torchrun`, or
//! [`launch`](crate::launch::launch) behind `fp8-moe --gpus N`) sets: `MASTER_ADDR`,
//! `MASTER_PORT`, `RANK`, `WORLD_SIZE`, and optionally `CUDA_GRAPH_RENDEZVOUS_TIMEOUT` (seconds,
//! default 300). [`RendezvousConfig::from_vars`] does the same from any lookup function.
//!
//! # Behaviour
//!
//! * **World size 1**: no socket at all; the payload closure is called and its bytes returned.
//! * **Rank 0** binds `addr:port` (std sets `SO_REUSEADDR` on Unix listeners, so a port still in
//!   `TIME_WAIT` from a previous run can be bound again at once, but a port another process is
//!   listening on cannot), calls the payload closure once, then accepts connections until every
//!   rank `1..world_size` has arrived. Connections are handled without blocking, so a client that
//!   connects and says nothing, or sends garbage, holds up no one. A client whose connection
//!   closes before the payload is ready counts as missing again and may reconnect.
//! * **Other ranks** connect, retrying (the server may not be up yet) until the deadline, and
//!   send a hello naming their rank and world size.
//! * **Validation**: rank 0 rejects a hello with the wrong magic bytes or protocol version, a
//!   different world size, a rank outside `1..world_size`, or a rank that has already arrived
//!   (the first connection keeps the rank). A rejected client gets a reason and returns
//!   [`RendezvousError::Rejected`]; rank 0 keeps waiting for the rest and lists the rejections
//!   (up to 16) in its [`RendezvousError::Timeout`] should it time out, so a misconfigured
//!   launch (two processes claiming rank 1, hence rank 2 missing) is visible on rank 0 too.
//! * **Delivery**: once all ranks have arrived, rank 0 sends the payload to each, then waits for a
//!   one-byte acknowledgement from each before it returns, so its `Ok` means every rank has the
//!   payload. A rank that fails to acknowledge makes rank 0 return
//!   [`RendezvousError::Undelivered`] naming it (the ranks that did receive it have already
//!   returned `Ok`).
//!
//! # Deadlines
//!
//! Every wait is bounded by [`RendezvousConfig::timeout`], measured from the call to [`meet`]:
//! the accept loop, the connection attempts and every read and write. There are two exceptions,
//! both involving [`FINAL_EXCHANGE_MARGIN`]: once every rank has arrived, rank 0 gives the
//! delivery at least that long even if its deadline is nearly spent; and a client that rank 0
//! has accepted waits for the verdict until rank 0's own deadline (which rank 0 tells it) plus
//! that margin, if that is later than its own deadline. The latter
//! makes a timeout read the same on every rank even when the ranks started at different times:
//! when rank 0 times out, it sends every connected client the list of missing ranks, and the
//! client returns a [`RendezvousError::Timeout`] with the same list and message as rank 0's.
//!
//! Name resolution (`getaddrinfo`) is the one step std cannot bound; use an IP address for
//! `MASTER_ADDR` when that matters.
//!
//! # Protocol (version 1)
//!
//! Integers are little-endian.
//!
//! | Direction       | Message  | Layout                                                                          |
//! |-----------------|----------|---------------------------------------------------------------------------------|
//! | client → rank 0 | hello    | [`MAGIC`] (8 bytes) · [`PROTOCOL_VERSION`] `u32` · rank `u64` · world size `u64` |
//! | rank 0 → client | frame    | kind `u8` · body length `u32` (at most [`MAX_PAYLOAD_LEN`]) · body               |
//! | client → rank 0 | ack      | one byte `0x06`, after a payload frame                                          |
//!
//! Frame kinds: `1` *wait* (body: `u64` milliseconds rank 0 will still wait; sent as soon as the
//! hello is accepted), `2` *payload* (body: the payload), `3` *rejected* (body: UTF-8 reason), `4`
//! *timeout* (body: `u64` milliseconds waited · `u32` count · that many `u64` missing ranks ·
//! UTF-8 notes separated by `\n`), `5` *aborted* (body: UTF-8 reason). A client receives at most
//! one *wait* frame followed by exactly one of the others.
//!
//! # Example
//!
//! ```no_run
//! use cuda_graph_nccl::rendezvous::{meet, RendezvousConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cfg = RendezvousConfig::from_env()?;
//! // On rank 0 the closure produces the bytes every rank receives; elsewhere it is never called.
//! let unique_id = meet(&cfg, || Ok::<_, std::io::Error>(vec![42; 128]))?;
//! assert_eq!(unique_id.len(), 128);
//! # Ok(())
//! # }
//! ```

use std::fmt::{self, Write as _};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

/// The eight bytes every hello starts with.
pub const MAGIC: [u8; 8] = *b"CGNCCLRV";

/// The protocol version a hello carries; rank 0 rejects any other.
pub const PROTOCOL_VERSION: u32 = 1;

/// The largest payload (and the largest frame body of any kind) the protocol carries: 1 MiB.
///
/// The cap keeps a garbled length prefix from allocating gigabytes.
pub const MAX_PAYLOAD_LEN: usize = 1 << 20;

/// The timeout [`RendezvousConfig::new`] and [`RendezvousConfig::from_env`] use by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The extra time the final exchange may take beyond the deadline; see the [module docs](self).
pub const FINAL_EXCHANGE_MARGIN: Duration = Duration::from_secs(5);

/// The environment variable holding the rendezvous timeout in seconds.
pub const TIMEOUT_VAR: &str = "CUDA_GRAPH_RENDEZVOUS_TIMEOUT";

/// Length of the client's hello.
const HELLO_LEN: usize = 28;
/// Frame kinds sent by rank 0.
const KIND_WAIT: u8 = 1;
const KIND_PAYLOAD: u8 = 2;
const KIND_REJECTED: u8 = 3;
const KIND_TIMEOUT: u8 = 4;
const KIND_ABORTED: u8 = 5;
/// The byte a client sends once it has the payload.
const ACK: u8 = 0x06;
/// How long rank 0 sleeps when nothing happened in a round of its accept loop.
const POLL_INTERVAL: Duration = Duration::from_millis(10);
/// How long a client sleeps between connection attempts.
const RETRY_INTERVAL: Duration = Duration::from_millis(50);
/// The longest single connection attempt.
const CONNECT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long rank 0 spends telling a client it is rejected or that the rendezvous failed.
const NOTICE_TIMEOUT: Duration = Duration::from_secs(1);
/// How many rejections rank 0 remembers for its timeout message.
const MAX_NOTES: usize = 16;

/// The rendezvous parameters of one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousConfig {
    /// The address rank 0 listens on and the others connect to (`MASTER_ADDR`): an IP address or
    /// a host name.
    pub addr: String,
    /// The TCP port (`MASTER_PORT`). May be 0 only when `world_size` is 1.
    pub port: u16,
    /// This process's rank, below `world_size` (`RANK`).
    pub rank: usize,
    /// The number of ranks in the job, at least 1 (`WORLD_SIZE`).
    pub world_size: usize,
    /// How long [`meet`] may take, measured from the call; must not be zero.
    pub timeout: Duration,
}

impl RendezvousConfig {
    /// A configuration with the [`DEFAULT_TIMEOUT`].
    pub fn new(addr: impl Into<String>, port: u16, rank: usize, world_size: usize) -> Self {
        Self {
            addr: addr.into(),
            port,
            rank,
            world_size,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Reads the launcher's environment; see [`from_vars`](Self::from_vars) for the rules.
    ///
    /// # Errors
    ///
    /// [`RendezvousError::Env`] naming the first missing or invalid variable and its value.
    /// A value that is not valid UTF-8 is shown lossily and is invalid.
    pub fn from_env() -> Result<Self, RendezvousError> {
        Self::from_vars(|name| {
            std::env::var_os(name).map(|value| value.to_string_lossy().into_owned())
        })
    }

    /// Builds a configuration from `lookup(name)`, which returns a variable's value or `None`
    /// when it is unset.
    ///
    /// * `WORLD_SIZE` (a positive integer) and `RANK` (below `WORLD_SIZE`) are required.
    /// * `MASTER_ADDR` and `MASTER_PORT` (1 to 65535) are required when `WORLD_SIZE` is above 1;
    ///   for a single process they default to `127.0.0.1` and 0, but are still checked if set.
    /// * [`TIMEOUT_VAR`] (`CUDA_GRAPH_RENDEZVOUS_TIMEOUT`) is an optional positive number of
    ///   seconds, fractions allowed; unset or empty means [`DEFAULT_TIMEOUT`].
    ///
    /// Surrounding whitespace is ignored.
    ///
    /// # Errors
    ///
    /// [`RendezvousError::Env`] naming the first missing or invalid variable and its value.
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, RendezvousError> {
        let world_size = parse_var(&lookup, "WORLD_SIZE", "a positive integer", |v| {
            v.parse::<usize>().ok().filter(|&n| n >= 1)
        })?;
        let world_size = require("WORLD_SIZE", world_size.map(|(n, _)| n))?;
        let rank = parse_var(&lookup, "RANK", "a non-negative integer", |v| {
            v.parse::<usize>().ok()
        })?;
        let (rank, raw_rank) = require("RANK", rank)?;
        if rank >= world_size {
            return Err(RendezvousError::Env {
                var: "RANK".to_owned(),
                value: Some(raw_rank),
                reason: format!("the rank must be below WORLD_SIZE={world_size}"),
            });
        }

        let addr = parse_var(&lookup, "MASTER_ADDR", "a host name or IP address", |v| {
            (!v.is_empty()).then(|| v.to_owned())
        })?
        .map(|(addr, _)| addr);
        let port = parse_var(
            &lookup,
            "MASTER_PORT",
            "a port number from 1 to 65535",
            |v| v.parse::<u16>().ok().filter(|&p| p != 0),
        )?
        .map(|(port, _)| port);
        let (addr, port) = if world_size > 1 {
            (require("MASTER_ADDR", addr)?, require("MASTER_PORT", port)?)
        } else {
            (
                addr.unwrap_or_else(|| "127.0.0.1".to_owned()),
                port.unwrap_or(0),
            )
        };

        let timeout = match lookup(TIMEOUT_VAR) {
            Some(raw) if !raw.trim().is_empty() => raw
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|secs| *secs > 0.0)
                .and_then(|secs| Duration::try_from_secs_f64(secs).ok())
                .ok_or_else(|| RendezvousError::Env {
                    var: TIMEOUT_VAR.to_owned(),
                    value: Some(raw),
                    reason: "expected a positive number of seconds".to_owned(),
                })?,
            _ => DEFAULT_TIMEOUT,
        };

        let cfg = Self {
            addr,
            port,
            rank,
            world_size,
            timeout,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// `addr:port` as it appears in messages, with an IPv6 address in brackets.
    #[must_use]
    pub fn endpoint(&self) -> String {
        if self.addr.contains(':') && !self.addr.starts_with('[') {
            format!("[{}]:{}", self.addr, self.port)
        } else {
            format!("{}:{}", self.addr, self.port)
        }
    }

    /// The address without the brackets of an IPv6 literal written `[::1]`.
    fn host(&self) -> &str {
        let addr = self.addr.trim();
        addr.strip_prefix('[')
            .and_then(|a| a.strip_suffix(']'))
            .unwrap_or(addr)
    }

    /// Checks the configuration as [`meet`] does: a world size of at least 1, a rank below it, a
    /// non-zero timeout, and for more than one rank a non-empty address and a non-zero port.
    ///
    /// # Errors
    ///
    /// [`RendezvousError::InvalidConfig`] saying what is wrong.
    pub fn validate(&self) -> Result<(), RendezvousError> {
        let invalid = |reason: String| Err(RendezvousError::InvalidConfig { reason });
        if self.world_size == 0 {
            return invalid("the world size is 0; it must be at least 1".to_owned());
        }
        if self.rank >= self.world_size {
            return invalid(format!(
                "rank {} is out of range for world size {} (ranks are 0 to {})",
                self.rank,
                self.world_size,
                self.world_size - 1
            ));
        }
        if self.timeout.is_zero() {
            return invalid("the timeout is zero".to_owned());
        }
        if self.world_size > 1 && self.addr.trim().is_empty() {
            return invalid("the address is empty".to_owned());
        }
        if self.world_size > 1 && self.port == 0 {
            return invalid(format!(
                "port 0 at {}: the ranks of a {}-rank job must agree on a fixed port",
                self.addr, self.world_size
            ));
        }
        Ok(())
    }
}

/// The value of a required variable, or the error saying it is not set.
fn require<T>(var: &str, value: Option<T>) -> Result<T, RendezvousError> {
    value.ok_or_else(|| RendezvousError::Env {
        var: var.to_owned(),
        value: None,
        reason: "a launcher such as torchrun or `fp8-moe --gpus N` sets MASTER_ADDR, \
                 MASTER_PORT, RANK and WORLD_SIZE"
            .to_owned(),
    })
}

/// Reads and parses one variable: `Ok(None)` when unset, the parsed value and its raw text when
/// valid, and an error naming the variable and the value otherwise.
fn parse_var<T>(
    lookup: &impl Fn(&str) -> Option<String>,
    var: &str,
    expected: &str,
    parse: impl FnOnce(&str) -> Option<T>,
) -> Result<Option<(T, String)>, RendezvousError> {
    let Some(raw) = lookup(var) else {
        return Ok(None);
    };
    match parse(raw.trim()) {
        Some(value) => Ok(Some((value, raw))),
        None => Err(RendezvousError::Env {
            var: var.to_owned(),
            value: Some(raw),
            reason: format!("expected {expected}"),
        }),
    }
}

/// Why a rendezvous failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// A launcher variable is missing or invalid.
    #[error("{}", describe_env(var, value.as_deref(), reason))]
    Env {
        /// The variable's name.
        var: String,
        /// Its value, or `None` when it is unset.
        value: Option<String>,
        /// What is wrong, or for a missing variable, who normally sets it.
        reason: String,
    },

    /// The [`RendezvousConfig`] is inconsistent.
    #[error("invalid rendezvous configuration: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: String,
    },

    /// Rank 0 could not listen on the address, typically because the port is in use.
    #[error("rank 0 could not listen on {addr}: {source}{}", bind_hint(source))]
    Bind {
        /// The address and port.
        addr: String,
        /// The operating system's error.
        source: io::Error,
    },

    /// A non-zero rank could not connect to rank 0 before the deadline.
    #[error(
        "could not reach rank 0 at {addr} within {} (last error: {last_error})",
        seconds(*waited)
    )]
    Unreachable {
        /// Rank 0's address and port.
        addr: String,
        /// How long this rank tried.
        waited: Duration,
        /// The error of the last attempt.
        #[source]
        last_error: io::Error,
    },

    /// Rank 0 gave up waiting for some ranks. Rank 0 returns it, and so does every client that
    /// was connected at the time, with the same fields (and so the same message).
    #[error("{}", describe_timeout(addr, *world_size, missing, *waited, rejected))]
    Timeout {
        /// Rank 0's address and port.
        addr: String,
        /// The world size.
        world_size: usize,
        /// The ranks that never arrived, in increasing order.
        missing: Vec<usize>,
        /// How long rank 0 waited (to the millisecond).
        waited: Duration,
        /// The connections rank 0 rejected while waiting (at most 16), each as
        /// `"PEER: REASON"`.
        rejected: Vec<String>,
    },

    /// Rank 0 rejected this rank's hello.
    #[error("rank 0 at {addr} rejected this rank: {reason}")]
    Rejected {
        /// Rank 0's address and port.
        addr: String,
        /// Rank 0's reason.
        reason: String,
    },

    /// Rank 0 failed after this rank arrived and called the rendezvous off.
    #[error("rank 0 at {addr} aborted the rendezvous: {reason}")]
    Aborted {
        /// Rank 0's address and port.
        addr: String,
        /// Rank 0's reason.
        reason: String,
    },

    /// The payload closure failed on rank 0.
    #[error("rank 0 could not produce the rendezvous payload: {message}")]
    Payload {
        /// The closure's error, displayed.
        message: String,
    },

    /// The payload closure returned more than [`MAX_PAYLOAD_LEN`] bytes.
    #[error("the rendezvous payload is {len} bytes; the limit is {max} bytes")]
    PayloadTooLarge {
        /// The payload's length.
        len: usize,
        /// [`MAX_PAYLOAD_LEN`].
        max: usize,
    },

    /// Rank 0 sent the payload, but some ranks did not acknowledge it.
    #[error(
        "rank 0 at {addr} could not confirm that {} received the payload: {reason}",
        describe_ranks(ranks)
    )]
    Undelivered {
        /// Rank 0's address and port.
        addr: String,
        /// The ranks that did not acknowledge.
        ranks: Vec<usize>,
        /// The first failure.
        reason: String,
    },

    /// A connection failed or timed out while talking to the other side.
    #[error("rendezvous at {addr} failed on rank {rank} while {context}: {source}")]
    Connection {
        /// Rank 0's address and port.
        addr: String,
        /// The rank that saw the failure.
        rank: usize,
        /// What it was doing.
        context: &'static str,
        /// The error; [`io::ErrorKind::TimedOut`] when the deadline passed and
        /// [`io::ErrorKind::UnexpectedEof`] when the other side closed the connection.
        source: io::Error,
    },

    /// Rank 0 answered with something this version does not understand.
    #[error("rank 0 at {addr} sent an invalid reply: {reason}")]
    Protocol {
        /// Rank 0's address and port.
        addr: String,
        /// What was wrong with it.
        reason: String,
    },
}

fn describe_env(var: &str, value: Option<&str>, reason: &str) -> String {
    match value {
        None => format!("environment variable {var} is not set ({reason})"),
        Some(value) => format!("environment variable {var}={value:?} is invalid: {reason}"),
    }
}

fn bind_hint(source: &io::Error) -> &'static str {
    if source.kind() == io::ErrorKind::AddrInUse {
        " (is another job using this MASTER_PORT?)"
    } else {
        ""
    }
}

fn seconds(duration: Duration) -> String {
    format!("{:.1} s", duration.as_secs_f64())
}

/// "rank 2" or "ranks 2, 3".
fn describe_ranks(ranks: &[usize]) -> String {
    let list = ranks
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    match ranks.len() {
        1 => format!("rank {list}"),
        _ => format!("ranks {list}"),
    }
}

fn describe_timeout(
    addr: &str,
    world_size: usize,
    missing: &[usize],
    waited: Duration,
    rejected: &[String],
) -> String {
    let mut message = format!(
        "rendezvous at {addr} timed out after {}: {} of {world_size} never arrived",
        seconds(waited),
        describe_ranks(missing)
    );
    if !rejected.is_empty() {
        let _ = write!(message, "; rank 0 rejected: {}", rejected.join("; "));
    }
    message
}

/// Meets the other ranks and returns rank 0's payload on every rank.
///
/// On rank 0, `payload` is called once, right after the listener is bound (a failure is reported
/// at once, before any waiting), and its bytes are handed to every rank once all `world_size`
/// ranks have arrived. Other ranks never call it. With a world size of 1 no socket is opened.
/// See the [module docs](self) for the protocol and the deadlines.
///
/// # Errors
///
/// Rank 0 returns [`InvalidConfig`](RendezvousError::InvalidConfig),
/// [`Bind`](RendezvousError::Bind), [`Payload`](RendezvousError::Payload),
/// [`PayloadTooLarge`](RendezvousError::PayloadTooLarge), [`Timeout`](RendezvousError::Timeout)
/// (naming the ranks that never arrived) or [`Undelivered`](RendezvousError::Undelivered).
/// Another rank returns [`InvalidConfig`](RendezvousError::InvalidConfig),
/// [`Unreachable`](RendezvousError::Unreachable), [`Rejected`](RendezvousError::Rejected),
/// rank 0's [`Timeout`](RendezvousError::Timeout) or [`Aborted`](RendezvousError::Aborted),
/// [`Connection`](RendezvousError::Connection) (rank 0 vanished, or no verdict in time) or
/// [`Protocol`](RendezvousError::Protocol).
pub fn meet<E: fmt::Display>(
    cfg: &RendezvousConfig,
    payload: impl FnOnce() -> Result<Vec<u8>, E>,
) -> Result<Vec<u8>, RendezvousError> {
    let start = Instant::now();
    cfg.validate()?;
    let deadline =
        start
            .checked_add(cfg.timeout)
            .ok_or_else(|| RendezvousError::InvalidConfig {
                reason: format!("the timeout of {:?} is too large", cfg.timeout),
            })?;
    if cfg.world_size == 1 {
        produce(payload)
    } else if cfg.rank == 0 {
        serve(cfg, start, deadline, payload)
    } else {
        join(cfg, start, deadline)
    }
}

/// Runs the payload closure and checks the length.
fn produce<E: fmt::Display>(
    payload: impl FnOnce() -> Result<Vec<u8>, E>,
) -> Result<Vec<u8>, RendezvousError> {
    let bytes = payload().map_err(|e| RendezvousError::Payload {
        message: e.to_string(),
    })?;
    if bytes.len() > MAX_PAYLOAD_LEN {
        return Err(RendezvousError::PayloadTooLarge {
            len: bytes.len(),
            max: MAX_PAYLOAD_LEN,
        });
    }
    Ok(bytes)
}

// ---------------------------------------------------------------------------------------------
// Rank 0
// ---------------------------------------------------------------------------------------------

fn serve<E: fmt::Display>(
    cfg: &RendezvousConfig,
    start: Instant,
    deadline: Instant,
    payload: impl FnOnce() -> Result<Vec<u8>, E>,
) -> Result<Vec<u8>, RendezvousError> {
    let addr = cfg.endpoint();
    let listener =
        TcpListener::bind((cfg.host(), cfg.port)).map_err(|source| RendezvousError::Bind {
            addr: addr.clone(),
            source,
        })?;
    let payload = produce(payload)?;
    listener
        .set_nonblocking(true)
        .map_err(|source| RendezvousError::Connection {
            addr: addr.clone(),
            rank: 0,
            context: "configuring the listener",
            source,
        })?;
    let mut server = Server {
        addr,
        world_size: cfg.world_size,
        start,
        deadline,
        arrived: (0..cfg.world_size).map(|_| None).collect(),
        pending: Vec::new(),
        notes: Vec::new(),
    };
    server.gather(&listener)?;
    // No one else may connect now; the listener closes before the delivery.
    drop(listener);
    server.deliver(&payload)?;
    Ok(payload)
}

/// Rank 0's state while ranks arrive.
struct Server {
    addr: String,
    world_size: usize,
    start: Instant,
    deadline: Instant,
    /// The connection of each rank that has arrived; index 0 is always `None`.
    arrived: Vec<Option<Client>>,
    /// Connections whose hello is incomplete.
    pending: Vec<Pending>,
    /// Rejections, for the timeout message.
    notes: Vec<String>,
}

/// An accepted rank.
struct Client {
    stream: TcpStream,
    peer: SocketAddr,
}

/// A connection whose hello has not fully arrived.
struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    hello: [u8; HELLO_LEN],
    len: usize,
}

/// What reading from a pending connection gave.
enum Progress {
    /// Nothing more to read now.
    Waiting,
    /// The whole hello is here.
    Complete,
    /// The connection closed or failed; drop it silently.
    Closed,
    /// The bytes so far cannot be a valid hello.
    Invalid(String),
}

impl Pending {
    fn poll(&mut self) -> Progress {
        while self.len < HELLO_LEN {
            match self.stream.read(&mut self.hello[self.len..]) {
                Ok(0) => return Progress::Closed,
                Ok(n) => {
                    self.len += n;
                    if let Some(reason) = check_hello_prefix(&self.hello[..self.len]) {
                        return Progress::Invalid(reason);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Progress::Waiting,
                Err(_) => return Progress::Closed,
            }
        }
        Progress::Complete
    }
}

/// Rejects a hello as soon as its first bytes show it is not one of ours.
fn check_hello_prefix(bytes: &[u8]) -> Option<String> {
    let magic_len = bytes.len().min(MAGIC.len());
    if bytes[..magic_len] != MAGIC[..magic_len] {
        return Some("not a cuda-graph-nccl rendezvous (bad magic bytes)".to_owned());
    }
    let version = u32::from_le_bytes(bytes.get(8..12)?.try_into().ok()?);
    (version != PROTOCOL_VERSION).then(|| {
        format!(
            "the client speaks rendezvous protocol version {version}, \
             rank 0 speaks version {PROTOCOL_VERSION}"
        )
    })
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

impl Server {
    /// Accepts and validates connections until every rank has arrived or the deadline passes.
    fn gather(&mut self, listener: &TcpListener) -> Result<(), RendezvousError> {
        loop {
            let mut busy = self.accept_new(listener)?;
            busy |= self.advance_pending();
            self.drop_departed();
            if self.arrived[1..].iter().all(Option::is_some) {
                return Ok(());
            }
            let now = Instant::now();
            if now >= self.deadline {
                return Err(self.time_out(now));
            }
            if !busy {
                thread::sleep(POLL_INTERVAL.min(self.deadline - now));
            }
        }
    }

    /// Accepts every waiting connection; true if there was one.
    fn accept_new(&mut self, listener: &TcpListener) -> Result<bool, RendezvousError> {
        let mut accepted = false;
        loop {
            match listener.accept() {
                Ok((stream, peer)) => {
                    accepted = true;
                    // Accepted sockets inherit non-blocking mode on some platforms, not on
                    // Linux; make it explicit. A socket that refuses is dropped.
                    if stream.set_nonblocking(true).is_ok() {
                        let _ = stream.set_nodelay(true);
                        self.pending.push(Pending {
                            stream,
                            peer,
                            hello: [0; HELLO_LEN],
                            len: 0,
                        });
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(accepted),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted
                            | io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::ConnectionReset
                    ) => {}
                Err(source) => {
                    self.abort(&format!("rank 0 could not accept connections: {source}"));
                    return Err(RendezvousError::Connection {
                        addr: self.addr.clone(),
                        rank: 0,
                        context: "accepting connections",
                        source,
                    });
                }
            }
        }
    }

    /// Reads what the pending connections have sent and admits or rejects complete hellos;
    /// true if anything happened.
    fn advance_pending(&mut self) -> bool {
        let mut busy = false;
        let mut i = 0;
        while i < self.pending.len() {
            let progress = self.pending[i].poll();
            if matches!(progress, Progress::Waiting) {
                i += 1;
                continue;
            }
            busy = true;
            let pending = self.pending.swap_remove(i);
            match progress {
                Progress::Complete => self.admit(pending),
                Progress::Invalid(reason) => self.reject(pending.stream, pending.peer, &reason),
                Progress::Waiting | Progress::Closed => {}
            }
        }
        busy
    }

    /// Validates a complete hello and records the rank, or rejects it.
    fn admit(&mut self, pending: Pending) {
        let Pending {
            mut stream,
            peer,
            hello,
            ..
        } = pending;
        let rank = match self.check_hello(&hello) {
            Ok(rank) => rank,
            Err(reason) => return self.reject(stream, peer, &reason),
        };
        let wait = self.deadline.saturating_duration_since(Instant::now());
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        let frame = encode_frame(KIND_WAIT, &wait_ms.to_le_bytes());
        // A client that cannot take a few bytes now is gone; it counts as missing.
        if write_all_by(&mut stream, &frame, Instant::now() + NOTICE_TIMEOUT).is_ok() {
            self.arrived[rank] = Some(Client { stream, peer });
        }
    }

    /// The rank a hello claims, or why it is rejected.
    fn check_hello(&self, hello: &[u8; HELLO_LEN]) -> Result<usize, String> {
        let (Some(rank), Some(world_size)) = (u64_at(hello, 12), u64_at(hello, 20)) else {
            return Err("truncated hello".to_owned());
        };
        let last = self.world_size - 1;
        if usize::try_from(world_size).ok() != Some(self.world_size) {
            return Err(format!(
                "rank {rank} has world size {world_size}, but rank 0 has world size {}",
                self.world_size
            ));
        }
        if rank == 0 {
            return Err(format!(
                "a second process claims rank 0 (the other ranks are 1 to {last})"
            ));
        }
        let Some(rank) = usize::try_from(rank).ok().filter(|&r| r <= last) else {
            return Err(format!(
                "rank {rank} is out of range (ranks are 0 to {last})"
            ));
        };
        match &self.arrived[rank] {
            Some(existing) if !is_closed(&existing.stream) => Err(format!(
                "rank {rank} has already arrived from {}",
                existing.peer
            )),
            _ => Ok(rank),
        }
    }

    /// Tells a client why it is rejected (best effort) and notes it for the timeout message.
    fn reject(&mut self, mut stream: TcpStream, peer: SocketAddr, reason: &str) {
        let frame = encode_frame(KIND_REJECTED, reason.as_bytes());
        let _ = write_all_by(&mut stream, &frame, Instant::now() + NOTICE_TIMEOUT);
        if self.notes.len() < MAX_NOTES {
            self.notes.push(format!("{peer}: {reason}"));
        }
    }

    /// Forgets the ranks whose connection has closed, so they count as missing again.
    fn drop_departed(&mut self) {
        for slot in &mut self.arrived {
            if slot
                .as_ref()
                .is_some_and(|client| is_closed(&client.stream))
            {
                *slot = None;
            }
        }
    }

    fn missing(&self) -> Vec<usize> {
        (1..self.world_size)
            .filter(|&rank| self.arrived[rank].is_none())
            .collect()
    }

    /// Builds the timeout error and sends it to every connected client.
    fn time_out(&mut self, now: Instant) -> RendezvousError {
        // Whole milliseconds, so that the clients' copy (sent in milliseconds) reads the same.
        let waited_ms =
            u64::try_from(now.duration_since(self.start).as_millis()).unwrap_or(u64::MAX);
        let missing = self.missing();
        let mut body = Vec::new();
        body.extend_from_slice(&waited_ms.to_le_bytes());
        body.extend_from_slice(
            &u32::try_from(missing.len())
                .unwrap_or(u32::MAX)
                .to_le_bytes(),
        );
        for &rank in &missing {
            body.extend_from_slice(&(rank as u64).to_le_bytes());
        }
        body.extend_from_slice(self.notes.join("\n").as_bytes());
        self.notify_all(&encode_frame(KIND_TIMEOUT, &body));
        RendezvousError::Timeout {
            addr: self.addr.clone(),
            world_size: self.world_size,
            missing,
            waited: Duration::from_millis(waited_ms),
            rejected: std::mem::take(&mut self.notes),
        }
    }

    /// Tells every connected client that rank 0 gives up.
    fn abort(&mut self, reason: &str) {
        self.notify_all(&encode_frame(KIND_ABORTED, reason.as_bytes()));
    }

    fn notify_all(&mut self, frame: &[u8]) {
        for client in self.arrived.iter_mut().flatten() {
            let _ = write_all_by(&mut client.stream, frame, Instant::now() + NOTICE_TIMEOUT);
        }
    }

    /// Sends the payload to every rank, then collects every acknowledgement.
    fn deliver(&mut self, payload: &[u8]) -> Result<(), RendezvousError> {
        let deadline = self.deadline.max(Instant::now() + FINAL_EXCHANGE_MARGIN);
        let frame = encode_frame(KIND_PAYLOAD, payload);
        let mut failures: Vec<(usize, io::Error)> = Vec::new();
        let mut sent = Vec::new();
        for (rank, slot) in self.arrived.iter_mut().enumerate() {
            if let Some(client) = slot {
                match write_all_by(&mut client.stream, &frame, deadline) {
                    Ok(()) => sent.push(rank),
                    Err(e) => failures.push((rank, e)),
                }
            }
        }
        for rank in sent {
            let Some(client) = self.arrived[rank].as_mut() else {
                continue;
            };
            let mut ack = [0u8];
            let result = read_exact_by(&mut client.stream, &mut ack, deadline).and_then(|()| {
                if ack[0] == ACK {
                    Ok(())
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("expected the acknowledgement byte, got {:#04x}", ack[0]),
                    ))
                }
            });
            if let Err(e) = result {
                failures.push((rank, e));
            }
        }
        if failures.is_empty() {
            return Ok(());
        }
        failures.sort_by_key(|(rank, _)| *rank);
        let reason = format!("rank {}: {}", failures[0].0, failures[0].1);
        Err(RendezvousError::Undelivered {
            addr: self.addr.clone(),
            ranks: failures.into_iter().map(|(rank, _)| rank).collect(),
            reason,
        })
    }
}

/// True if the peer has closed the connection (or it failed); false while it is open, even if
/// the peer has sent unexpected bytes.
fn is_closed(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let mut byte = [0u8];
    match stream.peek(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Other ranks
// ---------------------------------------------------------------------------------------------

fn join(
    cfg: &RendezvousConfig,
    start: Instant,
    deadline: Instant,
) -> Result<Vec<u8>, RendezvousError> {
    let addr = cfg.endpoint();
    let connection_error = |context: &'static str| {
        let addr = addr.clone();
        move |source| RendezvousError::Connection {
            addr,
            rank: cfg.rank,
            context,
            source,
        }
    };
    let mut stream = connect(cfg, &addr, start, deadline)?;
    let _ = stream.set_nodelay(true);

    let mut hello = Vec::with_capacity(HELLO_LEN);
    hello.extend_from_slice(&MAGIC);
    hello.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    hello.extend_from_slice(&(cfg.rank as u64).to_le_bytes());
    hello.extend_from_slice(&(cfg.world_size as u64).to_le_bytes());
    write_all_by(&mut stream, &hello, deadline).map_err(connection_error("sending its hello"))?;

    let mut frame = read_frame(&mut stream, deadline)
        .map_err(connection_error("waiting for rank 0 to accept it"))?;
    if frame.kind == KIND_WAIT {
        let server_wait = u64_at(&frame.body, 0)
            .filter(|_| frame.body.len() == 8)
            .ok_or_else(|| RendezvousError::Protocol {
                addr: addr.clone(),
                reason: format!("a wait frame of {} bytes", frame.body.len()),
            })?;
        // Rank 0 is the authority on when the rendezvous is over: wait for its verdict until its
        // own deadline (plus a margin for the verdict to travel), and never less than ours.
        let verdict_deadline = Instant::now()
            .checked_add(Duration::from_millis(server_wait))
            .and_then(|d| d.checked_add(FINAL_EXCHANGE_MARGIN))
            .map_or(deadline, |d| d.max(deadline));
        frame = read_frame(&mut stream, verdict_deadline)
            .map_err(connection_error("waiting for the payload"))?;
    }

    let text = |body: &[u8]| String::from_utf8_lossy(body).into_owned();
    match frame.kind {
        KIND_PAYLOAD => {
            // Rank 0 reports a missing acknowledgement; this rank has what it needs either way.
            let _ = write_all_by(&mut stream, &[ACK], Instant::now() + FINAL_EXCHANGE_MARGIN);
            Ok(frame.body)
        }
        KIND_REJECTED => Err(RendezvousError::Rejected {
            addr,
            reason: text(&frame.body),
        }),
        KIND_ABORTED => Err(RendezvousError::Aborted {
            addr,
            reason: text(&frame.body),
        }),
        KIND_TIMEOUT => Err(
            decode_timeout(&frame.body, &addr, cfg.world_size).unwrap_or_else(|| {
                RendezvousError::Protocol {
                    addr: addr.clone(),
                    reason: format!("a malformed timeout frame of {} bytes", frame.body.len()),
                }
            }),
        ),
        kind => Err(RendezvousError::Protocol {
            addr,
            reason: format!("an unexpected frame of kind {kind}"),
        }),
    }
}

fn decode_timeout(body: &[u8], addr: &str, world_size: usize) -> Option<RendezvousError> {
    let waited_ms = u64_at(body, 0)?;
    let count = usize::try_from(u32::from_le_bytes(body.get(8..12)?.try_into().ok()?)).ok()?;
    let notes_at = count.checked_mul(8)?.checked_add(12)?;
    let missing = (0..count)
        .map(|i| u64_at(body, 12 + 8 * i).and_then(|rank| usize::try_from(rank).ok()))
        .collect::<Option<Vec<_>>>()?;
    let rejected = String::from_utf8_lossy(body.get(notes_at..)?)
        .split('\n')
        .filter(|note| !note.is_empty())
        .map(str::to_owned)
        .collect();
    Some(RendezvousError::Timeout {
        addr: addr.to_owned(),
        world_size,
        missing,
        waited: Duration::from_millis(waited_ms),
        rejected,
    })
}

/// Connects to rank 0, retrying until the deadline.
fn connect(
    cfg: &RendezvousConfig,
    addr: &str,
    start: Instant,
    deadline: Instant,
) -> Result<TcpStream, RendezvousError> {
    let mut last_error = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(RendezvousError::Unreachable {
                addr: addr.to_owned(),
                waited: start.elapsed(),
                last_error: last_error.unwrap_or_else(|| {
                    io::Error::new(io::ErrorKind::TimedOut, "no attempt before the deadline")
                }),
            });
        }
        let attempt = left
            .min(CONNECT_ATTEMPT_TIMEOUT)
            .max(Duration::from_millis(1));
        match try_connect(cfg.host(), cfg.port, attempt) {
            Ok(stream) => return Ok(stream),
            Err(e) => last_error = Some(e),
        }
        thread::sleep(RETRY_INTERVAL.min(deadline.saturating_duration_since(Instant::now())));
    }
}

fn try_connect(host: &str, port: u16, timeout: Duration) -> io::Result<TcpStream> {
    let mut last_error = None;
    for addr in (host, port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, timeout) {
            Ok(stream) => return Ok(stream),
            Err(e) => last_error = Some(e),
        }
    }
    Err(last_error.unwrap_or_else(|| {
        io::Error::new(io::ErrorKind::NotFound, "the address resolved to nothing")
    }))
}

// ---------------------------------------------------------------------------------------------
// Framing and deadline-bounded I/O
// ---------------------------------------------------------------------------------------------

/// A frame from rank 0.
struct Frame {
    kind: u8,
    body: Vec<u8>,
}

fn encode_frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(5 + body.len());
    frame.push(kind);
    // Every caller keeps bodies under MAX_PAYLOAD_LEN, far below u32::MAX.
    frame.extend_from_slice(&u32::try_from(body.len()).unwrap_or(u32::MAX).to_le_bytes());
    frame.extend_from_slice(body);
    frame
}

fn read_frame(stream: &mut TcpStream, deadline: Instant) -> io::Result<Frame> {
    let mut header = [0u8; 5];
    read_exact_by(stream, &mut header, deadline)?;
    let len = u32::from_le_bytes([header[1], header[2], header[3], header[4]]);
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    if len > MAX_PAYLOAD_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes exceeds the limit of {MAX_PAYLOAD_LEN} bytes"),
        ));
    }
    let mut body = vec![0; len];
    read_exact_by(stream, &mut body, deadline)?;
    Ok(Frame {
        kind: header[0],
        body,
    })
}

/// The time left before `deadline`, at least a millisecond (a zero socket timeout is an error),
/// or a `TimedOut` error once it has passed.
fn time_left(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "timed out before the deadline",
        ))
    } else {
        Ok(left.max(Duration::from_millis(1)))
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// `read_exact` in blocking mode, each read bounded by the time left.
fn read_exact_by(stream: &mut TcpStream, mut buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    while !buf.is_empty() {
        stream.set_read_timeout(Some(time_left(deadline)?))?;
        match stream.read(buf) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the other side closed the connection",
                ));
            }
            Ok(n) => buf = &mut std::mem::take(&mut buf)[n..],
            // Loop: the next `time_left` reports the deadline.
            Err(e) if is_timeout(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `write_all` in blocking mode, each write bounded by the time left.
fn write_all_by(stream: &mut TcpStream, mut buf: &[u8], deadline: Instant) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    while !buf.is_empty() {
        stream.set_write_timeout(Some(time_left(deadline)?))?;
        match stream.write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if is_timeout(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
