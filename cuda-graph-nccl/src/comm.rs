//! Communicators, unique ids and the collectives.

use std::ffi::{CStr, c_char, c_void};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cuda_graph::{Context, DeviceBuffer, DeviceRepr, Resource, Stream};

use crate::error::{Error, Result};
use crate::library::{Nccl, nccl};
use crate::rendezvous::{RendezvousConfig, meet};
use crate::sys::{self, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t};

/// The entry point `$name` of `$lib` (an [`Nccl`]), or [`Error::Missing`].
macro_rules! entry {
    ($lib:expr, $name:ident) => {
        $lib.lib.$name.as_ref().map_err(|_| Error::Missing {
            name: stringify!($name),
        })
    };
}

/// Turns an NCCL result into `Ok` or [`Error::Nccl`] with NCCL's strings for it.
fn check(lib: &Nccl, call: &'static str, result: ncclResult_t, comm: ncclComm_t) -> Result<()> {
    if result == ncclResult_t::ncclSuccess {
        return Ok(());
    }
    let text = |p: *const c_char| {
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: NCCL returns NUL-terminated strings that live as long as the library
            // (static tables) or until the next NCCL call on this thread (the last error);
            // the bytes are copied at once.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let message = match entry!(lib, ncclGetErrorString) {
        // SAFETY: takes any result code by value.
        Ok(f) => text(unsafe { f(result) }),
        Err(_) => String::new(),
    };
    let detail = match entry!(lib, ncclGetLastError) {
        // SAFETY: a null or live communicator; NCCL only reads it.
        Ok(f) => text(unsafe { f(comm) }),
        Err(_) => String::new(),
    };
    Err(Error::Nccl {
        call,
        result,
        message,
        detail,
    })
}

/// An NCCL unique id: the 128 bytes with which the ranks of one communicator find each other.
/// Rank 0 makes it ([`UniqueId::new`]) and hands it to the others: through
/// [`Communicator::from_rendezvous`], a file ([`publish`](Self::publish) /
/// [`wait_for_file`](Self::wait_for_file)), or an environment variable
/// ([`to_hex`](Self::to_hex) / [`from_hex`](Self::from_hex)).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId([u8; UniqueId::BYTES]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({}..)", &self.to_hex()[..16])
    }
}

impl UniqueId {
    /// Its size in bytes (`NCCL_UNIQUE_ID_BYTES`).
    pub const BYTES: usize = sys::NCCL_UNIQUE_ID_BYTES as usize;

    /// A fresh id from `ncclGetUniqueId` (it also starts NCCL's bootstrap listener in this
    /// process, which the other ranks reach through the id).
    ///
    /// Errors: those of [`nccl()`]; [`Error::Nccl`].
    pub fn new() -> Result<UniqueId> {
        let lib = nccl()?;
        let f = entry!(lib, ncclGetUniqueId)?;
        let mut raw = sys::ncclUniqueId::default();
        // SAFETY: valid out-pointer to a 128-byte id.
        let r = unsafe { f(&mut raw) };
        check(lib, "ncclGetUniqueId", r, std::ptr::null_mut())?;
        Ok(UniqueId(raw.internal.map(|c| c as u8)))
    }

    /// The id from its bytes. Errors: [`Error::InvalidArgument`] unless there are exactly
    /// [`BYTES`](Self::BYTES).
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        let bytes: [u8; UniqueId::BYTES] = bytes.try_into().map_err(|_| {
            Error::InvalidArgument(format!(
                "an NCCL unique id has {} bytes, not {}",
                UniqueId::BYTES,
                bytes.len()
            ))
        })?;
        Ok(UniqueId(bytes))
    }

    /// Its bytes.
    pub fn as_bytes(&self) -> &[u8; UniqueId::BYTES] {
        &self.0
    }

    /// Lower-case hex, 256 characters (for an environment variable or a command line).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The id from [`to_hex`](Self::to_hex)'s form (surrounding white space ignored).
    /// Errors: [`Error::InvalidArgument`] naming what is wrong.
    pub fn from_hex(text: &str) -> Result<UniqueId> {
        let text = text.trim();
        if text.len() != 2 * UniqueId::BYTES || !text.is_ascii() {
            return Err(Error::InvalidArgument(format!(
                "an NCCL unique id in hex has {} digits, this has {} characters",
                2 * UniqueId::BYTES,
                text.chars().count()
            )));
        }
        let mut bytes = [0u8; UniqueId::BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).map_err(|_| {
                Error::InvalidArgument(format!(
                    "an NCCL unique id in hex has a non-hex digit near position {}",
                    2 * i
                ))
            })?;
        }
        Ok(UniqueId(bytes))
    }

    /// Writes the id (as hex) to `path` atomically: a temporary file beside it, then a
    /// rename, so a reader never sees half an id. Errors: [`Error::InvalidArgument`] with the
    /// I/O error and the path.
    pub fn publish(&self, path: &Path) -> Result<()> {
        let io = |e: std::io::Error, what: &Path| {
            Error::InvalidArgument(format!("cannot write {}: {e}", what.display()))
        };
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".{}.tmp", std::process::id()));
        let tmp = std::path::PathBuf::from(tmp);
        std::fs::write(&tmp, self.to_hex()).map_err(|e| io(e, &tmp))?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io(e, path)
        })
    }

    /// Waits until `path` holds an id ([`publish`](Self::publish)'s file) and reads it,
    /// polling every 10 ms. Errors: [`Error::InvalidArgument`] when `timeout` passes first
    /// (naming the file) or the file is not an id.
    pub fn wait_for_file(path: &Path, timeout: Duration) -> Result<UniqueId> {
        let start = Instant::now();
        loop {
            match std::fs::read_to_string(path) {
                Ok(text) => {
                    return UniqueId::from_hex(&text)
                        .map_err(|e| Error::InvalidArgument(format!("{}: {e}", path.display())));
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(Error::InvalidArgument(format!(
                        "cannot read {}: {e}",
                        path.display()
                    )));
                }
            }
            if start.elapsed() >= timeout {
                return Err(Error::InvalidArgument(format!(
                    "no NCCL unique id appeared in {} within {:.1} s (did rank 0 start?)",
                    path.display(),
                    timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn raw(&self) -> sys::ncclUniqueId {
        sys::ncclUniqueId {
            internal: self.0.map(|b| b as c_char),
        }
    }
}

/// An element type NCCL reduces and moves.
///
/// # Safety
/// [`DATA_TYPE`](Self::DATA_TYPE) must describe the type's bytes exactly: NCCL reads and
/// writes `count * size_of::<Self>()` bytes as that type.
pub unsafe trait NcclType: DeviceRepr {
    /// NCCL's name for the type.
    const DATA_TYPE: ncclDataType_t;
}

macro_rules! nccl_types {
    ($($t:ty => $v:ident),* $(,)?) => {$(
        // SAFETY: the NCCL type of the same width and encoding.
        unsafe impl NcclType for $t {
            const DATA_TYPE: ncclDataType_t = ncclDataType_t::$v;
        }
    )*};
}
nccl_types! {
    i8 => ncclInt8, u8 => ncclUint8, i32 => ncclInt32, u32 => ncclUint32,
    i64 => ncclInt64, u64 => ncclUint64, half::f16 => ncclFloat16, f32 => ncclFloat32,
    f64 => ncclFloat64, half::bf16 => ncclBfloat16,
}

/// A reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Maximum (TransformerEngine's amax reduction).
    Max,
    /// Minimum.
    Min,
    /// Mean over the ranks (the sum divided by the rank count, as NCCL computes it).
    Avg,
}

impl ReduceOp {
    fn raw(self) -> ncclRedOp_t {
        match self {
            ReduceOp::Sum => ncclRedOp_t::ncclSum,
            ReduceOp::Prod => ncclRedOp_t::ncclProd,
            ReduceOp::Max => ncclRedOp_t::ncclMax,
            ReduceOp::Min => ncclRedOp_t::ncclMin,
            ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        }
    }
}

/// The raw communicator handle.
struct RawComm(ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread; this crate serialises the calls
// made on one communicator (`Inner::lock`), as NCCL requires.
unsafe impl Send for RawComm {}
// SAFETY: as above: shared references only reach NCCL under the lock.
unsafe impl Sync for RawComm {}

struct Inner {
    raw: RawComm,
    lock: Mutex<()>,
    ctx: Arc<Context>,
    rank: usize,
    size: usize,
    lib: &'static Nccl,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Errors cannot be reported from a drop; the handle is gone either way.
        let _ = self.ctx.bind();
        if let Ok(f) = entry!(self.lib, ncclCommDestroy) {
            // SAFETY: the last reference to a live communicator: no call runs on it (every
            // graph that captured work on it holds an `Arc` of this and was dropped), so it
            // is destroyed exactly once.
            unsafe { f(self.raw.0) };
        }
    }
}

/// One rank's NCCL communicator on one GPU.
///
/// Every collective enqueues on the [`Stream`] it is given, which must belong to the
/// communicator's device, and returns without waiting; inside a stream capture
/// ([`Stream::capture`]) it is captured and replays with the graph. What a captured
/// collective reads and writes, and the communicator itself, are kept alive by the graph
/// (as cuda-graph's own launches are), so dropping them early never frees memory under a
/// replay.
///
/// Collectives are matched across ranks by order: every rank must call the same collectives
/// with the same counts in the same order (NCCL's rule). A rank that never makes its call
/// leaves the others waiting on the device. Calls on one communicator from several threads
/// are serialised here; when one thread drives several communicators of the same job
/// ([`Communicator::init_all`]), wrap each round of calls in [`group`].
///
/// Clones share the communicator; it is destroyed with the last clone (and the last graph
/// that captured work on it).
#[derive(Clone)]
pub struct Communicator {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.inner.rank)
            .field("size", &self.inner.size)
            .field("device", &self.inner.ctx.device().as_raw())
            .finish_non_exhaustive()
    }
}

fn to_i32(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::InvalidArgument(format!("{what} {v} is too large")))
}

impl Communicator {
    /// Joins communicator `id` as `rank` of `size`, on `ctx`'s device (one process per GPU).
    /// Blocks until every rank has joined: start all of them (the rendezvous of
    /// [`from_rendezvous`](Self::from_rendezvous) bounds the wait for the processes to
    /// start; this call then waits for NCCL's own connection set-up).
    ///
    /// Errors: [`Error::InvalidArgument`] for `rank >= size` or `size == 0`; those of
    /// [`nccl()`]; [`Error::Nccl`] (e.g. two ranks on one GPU: `ncclInvalidUsage`).
    pub fn init_rank(
        ctx: &Arc<Context>,
        size: usize,
        rank: usize,
        id: &UniqueId,
    ) -> Result<Communicator> {
        if size == 0 || rank >= size {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of {size}: a communicator needs 0 <= rank < size"
            )));
        }
        let (n, r) = (to_i32("size", size)?, to_i32("rank", rank)?);
        let lib = nccl()?;
        let f = entry!(lib, ncclCommInitRank)?;
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the id is passed by value; the current context is the
        // device's primary context, which is the device NCCL's runtime calls use.
        let res = unsafe { f(&mut raw, n, id.raw(), r) };
        check(lib, "ncclCommInitRank", res, std::ptr::null_mut())?;
        Ok(Communicator::adopt(lib, raw, ctx, rank, size))
    }

    /// One communicator per context, all of one job driven by this process (NCCL's
    /// `ncclCommInitAll`): rank `i` on `ctxs[i]`'s device. Drive them from one thread with
    /// [`group`] around each round of collectives.
    ///
    /// Errors: [`Error::InvalidArgument`] for no contexts or two on one device; those of
    /// [`nccl()`]; [`Error::Nccl`].
    pub fn init_all(ctxs: &[Arc<Context>]) -> Result<Vec<Communicator>> {
        if ctxs.is_empty() {
            return Err(Error::InvalidArgument(
                "init_all needs at least one context".into(),
            ));
        }
        let devices: Vec<i32> = ctxs.iter().map(|c| c.device().as_raw()).collect();
        for (i, d) in devices.iter().enumerate() {
            if devices[..i].contains(d) {
                return Err(Error::InvalidArgument(format!(
                    "device {d} appears twice: NCCL puts one rank on each GPU"
                )));
            }
        }
        let lib = nccl()?;
        let f = entry!(lib, ncclCommInitAll)?;
        let mut raws = vec![std::ptr::null_mut(); ctxs.len()];
        ctxs[0].bind()?;
        // SAFETY: `raws` holds one slot per device; `devices` lists that many ordinals.
        let res = unsafe {
            f(
                raws.as_mut_ptr(),
                to_i32("device count", ctxs.len())?,
                devices.as_ptr(),
            )
        };
        check(lib, "ncclCommInitAll", res, std::ptr::null_mut())?;
        Ok(raws
            .into_iter()
            .zip(ctxs)
            .enumerate()
            .map(|(rank, (raw, ctx))| Communicator::adopt(lib, raw, ctx, rank, ctxs.len()))
            .collect())
    }

    /// Meets the job's other processes at `cfg`'s address (rank 0 makes the unique id and
    /// hands it out; see [`crate::rendezvous`]), then [`init_rank`](Self::init_rank)s.
    ///
    /// Errors: [`Error::Rendezvous`] (a rank that never arrived is named), then those of
    /// [`UniqueId::new`] and [`init_rank`](Self::init_rank).
    pub fn from_rendezvous(ctx: &Arc<Context>, cfg: &RendezvousConfig) -> Result<Communicator> {
        // Rank 0's id is made inside the rendezvous; its error is carried back as text.
        let bytes = meet(cfg, || UniqueId::new().map(|id| id.as_bytes().to_vec()))?;
        let id = UniqueId::from_bytes(&bytes)?;
        Communicator::init_rank(ctx, cfg.world_size, cfg.rank, &id)
    }

    /// [`from_rendezvous`](Self::from_rendezvous) with the launcher's environment
    /// ([`RendezvousConfig::from_env`]: `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`).
    pub fn from_env(ctx: &Arc<Context>) -> Result<Communicator> {
        Communicator::from_rendezvous(ctx, &RendezvousConfig::from_env()?)
    }

    fn adopt(
        lib: &'static Nccl,
        raw: ncclComm_t,
        ctx: &Arc<Context>,
        rank: usize,
        size: usize,
    ) -> Communicator {
        Communicator {
            inner: Arc::new(Inner {
                raw: RawComm(raw),
                lock: Mutex::new(()),
                ctx: ctx.clone(),
                rank,
                size,
                lib,
            }),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// The context (device) this rank runs on.
    pub fn context(&self) -> &Arc<Context> {
        &self.inner.ctx
    }

    /// The raw handle, for NCCL calls this crate does not wrap. It stays valid while this
    /// communicator (or a clone) lives; do not destroy it.
    pub fn as_raw(&self) -> ncclComm_t {
        self.inner.raw.0
    }

    /// An error NCCL met asynchronously (a peer that failed, a network error), if any.
    ///
    /// Errors: [`Error::Nccl`] carrying the asynchronous error (call
    /// `ncclCommGetAsyncError`).
    pub fn async_error(&self) -> Result<()> {
        let lib = self.inner.lib;
        let f = entry!(lib, ncclCommGetAsyncError)?;
        let _guard = self.lock();
        let mut state = ncclResult_t::ncclSuccess;
        // SAFETY: live communicator, valid out-pointer.
        let r = unsafe { f(self.inner.raw.0, &mut state) };
        check(lib, "ncclCommGetAsyncError", r, self.inner.raw.0)?;
        check(lib, "ncclCommGetAsyncError", state, self.inner.raw.0)
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        // The guarded value is `()`: a panic while it was held leaves nothing inconsistent.
        self.inner.lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn same_context(&self, what: &str, ctx: &Arc<Context>) -> Result<()> {
        if ctx.as_raw() == self.inner.ctx.as_raw() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "{what} belongs to device {}, the communicator (rank {}) to device {}",
                ctx.device().as_raw(),
                self.inner.rank,
                self.inner.ctx.device().as_raw()
            )))
        }
    }

    /// Enqueues one NCCL call on `stream` over `buffers` (named for errors): checks that the
    /// stream and buffers belong to the communicator's device, binds its context, makes the
    /// call under the communicator's lock (`call_nccl` gets the raw communicator and stream),
    /// and, once NCCL accepted it, hands the operands and the communicator to a capture
    /// running on `stream`.
    fn enqueue<T: DeviceRepr>(
        &self,
        call: &'static str,
        stream: &Stream,
        buffers: &[(&str, &DeviceBuffer<T>)],
        call_nccl: impl FnOnce(ncclComm_t, sys::cudaStream_t) -> Result<ncclResult_t>,
    ) -> Result<()> {
        self.same_context("the stream", stream.context())?;
        for (what, b) in buffers {
            self.same_context(what, b.context())?;
        }
        self.inner.ctx.bind()?;
        let result = {
            let _guard = self.lock();
            call_nccl(self.inner.raw.0, stream.as_raw().cast())?
        };
        check(self.inner.lib, call, result, self.inner.raw.0)?;
        let comm: Resource = self.inner.clone();
        stream.keep_alive_in_capture(
            buffers
                .iter()
                .map(|(_, b)| b.resource())
                .chain(std::iter::once(comm)),
        );
        Ok(())
    }

    /// Errors unless `whole` holds one block of `block` elements per rank.
    fn check_one_per_rank(&self, what: &str, whole: usize, block: usize) -> Result<()> {
        if block.checked_mul(self.inner.size) == Some(whole) {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "{what} needs {block} elements times {} ranks, it has {whole}",
            self.inner.size
        )))
    }

    fn check_peer(&self, what: &str, peer: usize) -> Result<i32> {
        if peer >= self.inner.size {
            return Err(Error::InvalidArgument(format!(
                "{what} {peer} is not a rank of this communicator (size {})",
                self.inner.size
            )));
        }
        to_i32(what, peer)
    }

    /// Every rank's `send` reduced with `op` into every rank's `recv` (NCCL all-reduce).
    /// `send` and `recv` may be the same buffer ([`all_reduce_in_place`](Self::all_reduce_in_place)).
    ///
    /// Errors: [`Error::InvalidArgument`] for lengths that differ or operands of another
    /// device; [`Error::Nccl`].
    pub fn all_reduce<T: NcclType>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &DeviceBuffer<T>,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        same_len("all_reduce", send, recv)?;
        let f = entry!(self.inner.lib, ncclAllReduce)?;
        self.enqueue(
            "ncclAllReduce",
            stream,
            &[("send", send), ("recv", recv)],
            |c, s| {
                // SAFETY: both buffers hold `len` elements of T on the communicator's device
                // (checked by `enqueue`) and outlive the work (a capture retains them; outside
                // one, freeing device memory waits for the device); the stream is live.
                Ok(unsafe {
                    f(
                        ptr(send),
                        ptr_mut(recv),
                        send.len(),
                        T::DATA_TYPE,
                        op.raw(),
                        c,
                        s,
                    )
                })
            },
        )
    }

    /// [`all_reduce`](Self::all_reduce) with `buf` as both operands.
    pub fn all_reduce_in_place<T: NcclType>(
        &self,
        buf: &DeviceBuffer<T>,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        self.all_reduce(buf, buf, op, stream)
    }

    /// `root`'s `send` into every rank's `recv` (only the root's `send` is read; the same
    /// buffer on both sides is the in-place form).
    ///
    /// Errors: [`Error::InvalidArgument`] for lengths that differ, a root out of range or
    /// operands of another device; [`Error::Nccl`].
    pub fn broadcast<T: NcclType>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &DeviceBuffer<T>,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        same_len("broadcast", send, recv)?;
        let root = self.check_peer("root", root)?;
        let f = entry!(self.inner.lib, ncclBroadcast)?;
        self.enqueue(
            "ncclBroadcast",
            stream,
            &[("send", send), ("recv", recv)],
            |c, s| {
                // SAFETY: as in `all_reduce`: both buffers hold `len` elements on this device.
                Ok(unsafe {
                    f(
                        ptr(send),
                        ptr_mut(recv),
                        send.len(),
                        T::DATA_TYPE,
                        root,
                        c,
                        s,
                    )
                })
            },
        )
    }

    /// Every rank's `send` (n elements) gathered into every rank's `recv` (`n * size`,
    /// rank `r`'s part at `r * n`).
    ///
    /// Errors: [`Error::InvalidArgument`] unless `recv.len() == send.len() * size`, or for
    /// operands of another device; [`Error::Nccl`].
    pub fn all_gather<T: NcclType>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &DeviceBuffer<T>,
        stream: &Stream,
    ) -> Result<()> {
        let n = send.len();
        self.check_one_per_rank("all_gather: recv", recv.len(), n)?;
        let f = entry!(self.inner.lib, ncclAllGather)?;
        self.enqueue(
            "ncclAllGather",
            stream,
            &[("send", send), ("recv", recv)],
            |c, s| {
                // SAFETY: send holds n elements and recv n * size on this device (checked above).
                Ok(unsafe { f(ptr(send), ptr_mut(recv), n, T::DATA_TYPE, c, s) })
            },
        )
    }

    /// Every rank's `send` (`n * size` elements) reduced with `op`, rank `r` keeping the
    /// `r`-th block of `n` in its `recv` (n elements).
    ///
    /// Errors: [`Error::InvalidArgument`] unless `send.len() == recv.len() * size`, or for
    /// operands of another device; [`Error::Nccl`].
    pub fn reduce_scatter<T: NcclType>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &DeviceBuffer<T>,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let n = recv.len();
        self.check_one_per_rank("reduce_scatter: send", send.len(), n)?;
        let f = entry!(self.inner.lib, ncclReduceScatter)?;
        self.enqueue(
            "ncclReduceScatter",
            stream,
            &[("send", send), ("recv", recv)],
            |c, s| {
                // SAFETY: send holds n * size elements and recv n on this device (checked above).
                Ok(unsafe { f(ptr(send), ptr_mut(recv), n, T::DATA_TYPE, op.raw(), c, s) })
            },
        )
    }

    /// Block `p` of every rank's `send` to rank `p`, landing in block `r` (the sender's rank)
    /// of `p`'s `recv`; blocks are `len / size` elements (NCCL's `ncclAlltoAll`).
    ///
    /// Errors: [`Error::InvalidArgument`] unless both have the same length, a multiple of the
    /// size, or for operands of another device; [`Error::Nccl`].
    pub fn all_to_all<T: NcclType>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &DeviceBuffer<T>,
        stream: &Stream,
    ) -> Result<()> {
        let size = self.inner.size;
        if send.len() != recv.len() || send.len() % size != 0 {
            return Err(Error::InvalidArgument(format!(
                "all_to_all: send ({}) and recv ({}) need one length, a multiple of {size} ranks",
                send.len(),
                recv.len()
            )));
        }
        let f = entry!(self.inner.lib, ncclAlltoAll)?;
        self.enqueue(
            "ncclAlltoAll",
            stream,
            &[("send", send), ("recv", recv)],
            |c, s| {
                // SAFETY: both hold size blocks of len / size elements on this device.
                Ok(unsafe {
                    f(
                        ptr(send),
                        ptr_mut(recv),
                        send.len() / size,
                        T::DATA_TYPE,
                        c,
                        s,
                    )
                })
            },
        )
    }

    /// An all-to-all of uneven blocks, as grouped sends and receives: `send_counts[p]`
    /// elements from `send` (blocks back to back, in rank order) go to rank `p`;
    /// `recv_counts[p]` elements from rank `p` land in `recv` (back to back, in rank order).
    /// Rank `p`'s `send_counts[r]` must equal rank `r`'s `recv_counts[p]` (NCCL matches the
    /// pairs; a mismatch is undefined there, so exchange the counts first, e.g. with
    /// [`all_to_all`](Self::all_to_all) of one count per rank).
    ///
    /// Errors: [`Error::InvalidArgument`] unless both count lists have one entry per rank and
    /// fit their buffers, or for operands of another device; [`Error::Nccl`].
    pub fn all_to_all_v<T: NcclType>(
        &self,
        send: &DeviceBuffer<T>,
        send_counts: &[usize],
        recv: &DeviceBuffer<T>,
        recv_counts: &[usize],
        stream: &Stream,
    ) -> Result<()> {
        let size = self.inner.size;
        for (what, counts, buf) in [("send", send_counts, send), ("recv", recv_counts, recv)] {
            if counts.len() != size {
                return Err(Error::InvalidArgument(format!(
                    "all_to_all_v: {what}_counts has {} entries for {size} ranks",
                    counts.len()
                )));
            }
            let total = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c));
            if total.is_none_or(|t| t > buf.len()) {
                return Err(Error::InvalidArgument(format!(
                    "all_to_all_v: {what}_counts add up past {what}'s {} elements",
                    buf.len()
                )));
            }
        }
        let lib = self.inner.lib;
        let (fsend, frecv) = (entry!(lib, ncclSend)?, entry!(lib, ncclRecv)?);
        let elem = std::mem::size_of::<T>() as u64;
        group(|| {
            self.enqueue(
                "ncclSend/ncclRecv",
                stream,
                &[("send", send), ("recv", recv)],
                |c, s| {
                    let (mut soff, mut roff) = (0u64, 0u64);
                    for peer in 0..size {
                        let p = to_i32("peer", peer)?;
                        let (sp, rp) = (
                            (send.as_raw() + soff) as *const c_void,
                            (recv.as_raw() + roff) as *mut c_void,
                        );
                        // SAFETY: each block lies inside its buffer (the counts' sums were checked
                        // against the lengths), on this device; NCCL pairs the send and receive
                        // inside the group.
                        let r = unsafe { fsend(sp, send_counts[peer], T::DATA_TYPE, p, c, s) };
                        check(lib, "ncclSend", r, c)?;
                        // SAFETY: as above, for the receive block.
                        let r = unsafe { frecv(rp, recv_counts[peer], T::DATA_TYPE, p, c, s) };
                        check(lib, "ncclRecv", r, c)?;
                        soff += send_counts[peer] as u64 * elem;
                        roff += recv_counts[peer] as u64 * elem;
                    }
                    Ok(ncclResult_t::ncclSuccess)
                },
            )
        })
    }

    /// Sends `buf` to rank `peer`, which must [`recv`](Self::recv) as many elements from
    /// this rank. Pair sends and receives inside [`group`] (alone, a send blocks on the
    /// device until its receive is posted, and two ranks sending to each other first
    /// deadlock).
    ///
    /// Errors: [`Error::InvalidArgument`] for a peer out of range or a buffer of another
    /// device; [`Error::Nccl`].
    pub fn send<T: NcclType>(
        &self,
        buf: &DeviceBuffer<T>,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        let p = self.check_peer("peer", peer)?;
        let f = entry!(self.inner.lib, ncclSend)?;
        self.enqueue("ncclSend", stream, &[("buf", buf)], |c, s| {
            // SAFETY: buf holds len elements on this device.
            Ok(unsafe { f(ptr(buf), buf.len(), T::DATA_TYPE, p, c, s) })
        })
    }

    /// Receives `buf.len()` elements from rank `peer` (see [`send`](Self::send)).
    ///
    /// Errors: as [`send`](Self::send).
    pub fn recv<T: NcclType>(
        &self,
        buf: &DeviceBuffer<T>,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        let p = self.check_peer("peer", peer)?;
        let f = entry!(self.inner.lib, ncclRecv)?;
        self.enqueue("ncclRecv", stream, &[("buf", buf)], |c, s| {
            // SAFETY: buf holds len elements on this device.
            Ok(unsafe { f(ptr_mut(buf), buf.len(), T::DATA_TYPE, p, c, s) })
        })
    }
}

/// A device buffer's address as NCCL's send pointer.
fn ptr<T: DeviceRepr>(b: &DeviceBuffer<T>) -> *const c_void {
    b.as_raw() as *const c_void
}

/// A device buffer's address as NCCL's receive pointer.
fn ptr_mut<T: DeviceRepr>(b: &DeviceBuffer<T>) -> *mut c_void {
    b.as_raw() as *mut c_void
}

/// Errors unless the two operands of `what` have one length.
fn same_len<T: DeviceRepr>(
    what: &str,
    send: &DeviceBuffer<T>,
    recv: &DeviceBuffer<T>,
) -> Result<()> {
    if send.len() == recv.len() {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what}: send has {} elements, recv {}",
            send.len(),
            recv.len()
        )))
    }
}

/// Runs `calls` between `ncclGroupStart` and `ncclGroupEnd`: NCCL launches the collectives
/// and point-to-point calls made inside as one operation (sends with their receives, one
/// thread driving several GPUs' communicators). The group is ended even when `calls` fails;
/// the first error is returned. Groups nest.
///
/// A call refused by this crate's own checks (lengths, devices) reaches NCCL not at all, but
/// the calls queued before it do: the group's end launches them, and their peers' matching
/// calls must still be made, or those wait on the device. Check every call's arguments
/// before the group when a refusal must leave nothing in flight.
///
/// Errors: those of `calls`; those of [`nccl()`]; [`Error::Nccl`] from the group's end (where
/// NCCL reports errors of the grouped calls).
pub fn group<R>(calls: impl FnOnce() -> Result<R>) -> Result<R> {
    let lib = nccl()?;
    let (start, end) = (entry!(lib, ncclGroupStart)?, entry!(lib, ncclGroupEnd)?);
    // SAFETY: takes no arguments; opens a group on this thread.
    check(
        lib,
        "ncclGroupStart",
        unsafe { start() },
        std::ptr::null_mut(),
    )?;
    let out = calls();
    // SAFETY: closes the group opened above, on the same thread.
    let ended = check(lib, "ncclGroupEnd", unsafe { end() }, std::ptr::null_mut());
    let out = out?;
    ended?;
    Ok(out)
}
