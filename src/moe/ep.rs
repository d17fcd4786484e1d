//! Expert parallelism: the MoE layer's experts spread over the ranks of a group
//! ([`ExpertParallelMoe`]), each rank holding `E / N` of them and its own tokens.
//!
//! # The exchange
//! With [`ExpertGemm::Grouped`] (full-layer) every size is static, so a pass has nothing on
//! the host and captures as one graph, eager or replayed:
//!
//! 1. Each rank routes its own `T` tokens over all `E` experts ([`Router::forward`]: the same
//!    router weight on every rank), then gathers every rank's tokens (`[N T, H]` bf16), top-k
//!    experts and gates ([`ExpertGroup::all_gather`]).
//! 2. Each rank plans its own experts over the `N T` gathered tokens (the assignments of other
//!    ranks' experts are not placed), permutes and casts the rows it holds into its packed
//!    layout, and runs fc1, SwiGLU and fc2 on them: the single-GPU layer's kernels
//!    ([`MoeLayer`]) on `E / N` experts.
//! 3. Each expert output row goes back to the rank whose token it is
//!    ([`ExpertGroup::all_to_all`]): rank `s`'s block holds one row per assignment of its
//!    `T k` (the rows of this rank's experts written, the rest left), a static bound of what
//!    any rank can get from another; the receiver takes each assignment's row from the block
//!    of the rank holding its expert, into its own packed layout, and combines as the
//!    single-GPU layer does.
//!
//! With [`ExpertGemm::PerExpert`] (breaking-layer, eager: the experts' GEMMs read their
//! counts back as on one GPU) step 3 moves exact sizes: each rank's offsets are gathered too
//! and read back, and each rank gets, from each owner, the rows of its packed layout over the
//! owner's experts (its padding rows included), straight into its packed layout, by an
//! all-to-all of uneven blocks ([`ExpertGroup::all_to_all_v`]).
//!
//! The backward mirrors it: the gates' and router's gradients on the token's rank, dY
//! gathered (`[N T, H]`) and cast into the experts' layout scaled by the gathered gates, the
//! experts' data and weight gradients on their rank, fc1's data gradient rows sent back as in
//! step 3, and the input and router-weight gradients on the token's rank.
//!
//! Every row a rank's experts compute sees the same operands, scales and sums as on one GPU,
//! so each rank's output, input gradient, router-weight gradient and losses equal the
//! single-GPU layer's on that rank's tokens bit for bit, given the same FP8 scales (delayed
//! scaling with the amax reduced over the group, TransformerEngine's `fp8_group`: rows cast
//! on one rank are multiplied on another). An expert's weight gradient sums its rows from all
//! ranks in one GEMM (the single GPU: one per microbatch, added), so it equals the sum over
//! the ranks' tokens to f32 rounding.
//!
//! The router weight is replicated: its gradient here is the rank's own tokens', to be
//! all-reduced with the other replicated parameters (data parallelism over the group).

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use cuda_graph::half::bf16;
use cuda_graph::{
    CaptureStatus, DeviceBuffer, DeviceRepr, Error, Event, Kernel, KernelArgs, LaunchConfig,
    Module, Result, Stream,
};
use fp8_kernels::{DelayedScaling, DeviceScalar, HpBuffer, ReductionGroup};
use graphed_callables::{Callable, SegmentKind, Slot};

use super::layer::{ExpertGemm, MoeLayer, MoeLayerConfig, MoeParams, Saved, WeightGrad};
use super::routing::{FATBIN, Router, RoutingBuffers};
use crate::zeroed;

/// A reduction over the ranks of a group ([`ExpertGroup::all_reduce`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupOp {
    /// The sum.
    Sum,
    /// The sum divided by the ranks.
    Avg,
    /// The maximum.
    Max,
}

/// The collectives expert parallelism needs over the ranks of a group, with those of an
/// expert-parallel model's data-parallel part
/// ([`Model::new_expert_parallel_in`](crate::model::Model::new_expert_parallel_in)): NCCL
/// ([`NcclGroup`](crate::dist::NcclGroup)) across GPUs, or [`LocalGroup`] for ranks that are
/// threads of one process on one device. Every rank calls each collective with buffers of the
/// same lengths, in the same order; the work is stream-ordered on `stream` (enqueue only).
pub trait ExpertGroup: Send + Sync + std::fmt::Debug {
    /// This rank, `0 .. size()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn size(&self) -> usize;

    /// Every rank's `send` gathered into every rank's `recv` (`size() * send.len()` bytes,
    /// rank `r`'s at `r * send.len()`).
    fn all_gather(
        &self,
        stream: &Stream,
        send: &DeviceBuffer<u8>,
        recv: &DeviceBuffer<u8>,
    ) -> Result<()>;

    /// Block `p` of every rank's `send` to rank `p`, landing in block `r` (the sender's rank)
    /// of `p`'s `recv`; both `size()` blocks of `send.len() / size()` bytes.
    fn all_to_all(
        &self,
        stream: &Stream,
        send: &DeviceBuffer<u8>,
        recv: &DeviceBuffer<u8>,
    ) -> Result<()>;

    /// An all-to-all of uneven blocks: `send_counts[p]` bytes of `send` (blocks back to back
    /// in rank order) to rank `p`, `recv_counts[p]` bytes from rank `p` into `recv` (back to
    /// back in rank order). Rank `p`'s `send_counts[r]` must equal rank `r`'s
    /// `recv_counts[p]`.
    fn all_to_all_v(
        &self,
        stream: &Stream,
        send: (&DeviceBuffer<u8>, &[usize]),
        recv: (&DeviceBuffer<u8>, &[usize]),
    ) -> Result<()>;

    /// Every rank's `buf` replaced by `op` over the ranks' `buf`s, element by element (the
    /// same bits on every rank).
    ///
    /// Errors: an element type the group cannot reduce ([`LocalGroup`]: f32 and bf16).
    fn all_reduce(&self, stream: &Stream, buf: HpBuffer<'_>, op: GroupOp) -> Result<()>;

    /// Runs `calls`, collectives of this group, as one batch where the group batches them
    /// (NCCL's group: one launch); by default one after the other.
    fn batch(&self, calls: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        calls()
    }

    /// Whether the collectives can be captured into a CUDA graph (NCCL's can, on a stream
    /// under capture; [`LocalGroup`]'s cannot).
    fn capturable(&self) -> bool;
}

/// How long a [`LocalGroup`] rank waits for the others at a collective by default.
pub const LOCAL_GROUP_TIMEOUT: Duration = Duration::from_secs(60);

/// The variable that overrides [`LOCAL_GROUP_TIMEOUT`] for [`LocalGroup::new`]: a positive
/// number of seconds, fractions allowed (e.g. for runs under compute-sanitizer, whose
/// kernels run far slower while the ranks' host threads wait on each other).
pub const LOCAL_GROUP_TIMEOUT_VAR: &str = "FP8_MOE_LOCAL_GROUP_TIMEOUT";

/// The wait `value` of [`LOCAL_GROUP_TIMEOUT_VAR`] sets (unset or blank: the default).
fn local_group_timeout(value: Option<&str>) -> Result<Duration> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(LOCAL_GROUP_TIMEOUT);
    };
    v.parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{LOCAL_GROUP_TIMEOUT_VAR}={v:?}: expected a positive number of seconds"
            ))
        })
}

/// Ranks that are threads of one process, their buffers on one device: an [`ExpertGroup`]
/// whose collectives are device-to-device copies ordered by events (the all-reduce: every
/// rank's buffer gathered, then reduced in rank order by a kernel), to run (and test) expert
/// parallelism without several GPUs. Each rank's thread calls every collective, in the same
/// order as the others (a rank that calls another collective than its peers gets an error
/// naming both, as do they); a call returns once every rank has called it (each waits at
/// most the group's timeout and then fails naming the ranks that never came). Eager only: a
/// collective cannot be captured (its copies read buffers of other threads' streams).
#[derive(Debug, Clone)]
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    size: usize,
    timeout: Duration,
    state: Mutex<MeetState>,
    turn: Condvar,
}

/// Where the ranks stand at the current meeting point, and what they posted there.
#[derive(Debug)]
struct MeetState {
    generation: u64,
    arrived: Vec<bool>,
    /// The arrivals of the meeting under way.
    posts: Vec<Option<Arrival>>,
    /// The arrivals of the last completed meeting, for the ranks that waited in it (a rank
    /// that completes a meeting may post to the next before they wake; the next cannot
    /// complete before they arrive there).
    last: Arc<Vec<Option<Arrival>>>,
}

/// Which call of which collective a rank arrived at a meeting for: (collective, round).
type Tag = (&'static str, &'static str);

/// A rank's arrival at a meeting: what it came for and what it brought.
#[derive(Debug)]
struct Arrival {
    tag: Tag,
    post: Option<Post>,
}

/// A rank's part of a collective: its send buffer and the event its stream recorded when
/// the buffer was ready (or, in the second round, when it was done reading the others').
#[derive(Debug)]
struct Post {
    send: DeviceBuffer<u8>,
    /// Bytes of `send` for each rank (back to back), in an uneven all-to-all.
    counts: Vec<usize>,
    event: Arc<Event>,
}

impl LocalGroup {
    /// The `size` ranks of a new group, rank `r` at index `r`: hand one to each thread. Each
    /// waits at most [`LOCAL_GROUP_TIMEOUT`] at a collective, or what
    /// [`LOCAL_GROUP_TIMEOUT_VAR`] says.
    ///
    /// Errors: [`Error::InvalidArgument`] for `size == 0` or a malformed variable.
    pub fn new(size: usize) -> Result<Vec<LocalGroup>> {
        let var = std::env::var(LOCAL_GROUP_TIMEOUT_VAR).ok();
        LocalGroup::with_timeout(size, local_group_timeout(var.as_deref())?)
    }

    /// [`new`](Self::new) with the wait at each collective bounded by `timeout`.
    pub fn with_timeout(size: usize, timeout: Duration) -> Result<Vec<LocalGroup>> {
        if size == 0 {
            return Err(Error::InvalidArgument(
                "LocalGroup: a group needs at least one rank".into(),
            ));
        }
        let shared = Arc::new(Shared {
            size,
            timeout,
            state: Mutex::new(MeetState {
                generation: 0,
                arrived: vec![false; size],
                posts: (0..size).map(|_| None).collect(),
                last: Arc::new(Vec::new()),
            }),
            turn: Condvar::new(),
        });
        Ok((0..size)
            .map(|rank| LocalGroup {
                rank,
                shared: shared.clone(),
            })
            .collect())
    }

    /// Posts `post` (when given) for the collective `tag`, waits until every rank has
    /// arrived, and returns every rank's post of this meeting. Errors when a rank arrived for
    /// another collective (the ranks' calls are out of order: every rank sees it).
    fn meet(&self, tag: Tag, post: Option<Post>) -> Result<Arc<Vec<Option<Arrival>>>> {
        let arrivals = self.arrive(tag, post)?;
        let name = |(what, round): Tag| format!("{what} ({round})");
        if let Some((p, theirs)) = arrivals
            .iter()
            .enumerate()
            .find_map(|(p, a)| a.as_ref().filter(|a| a.tag != tag).map(|a| (p, a.tag)))
        {
            return Err(Error::InvalidArgument(format!(
                "LocalGroup: rank {} called {} while rank {p} called {}: every rank must call \
                 the group's collectives in the same order",
                self.rank,
                name(tag),
                name(theirs)
            )));
        }
        Ok(arrivals)
    }

    /// The meeting itself: posts this rank's arrival, waits for every rank's.
    fn arrive(&self, tag: Tag, post: Option<Post>) -> Result<Arc<Vec<Option<Arrival>>>> {
        let sh = &self.shared;
        let poisoned = || Error::InvalidArgument("LocalGroup: a rank panicked".into());
        let mut st = sh.state.lock().map_err(|_| poisoned())?;
        let generation = st.generation;
        st.arrived[self.rank] = true;
        st.posts[self.rank] = Some(Arrival { tag, post });
        if st.arrived.iter().all(|&a| a) {
            let fresh = (0..sh.size).map(|_| None).collect();
            let posts = Arc::new(std::mem::replace(&mut st.posts, fresh));
            st.arrived.iter_mut().for_each(|a| *a = false);
            st.generation += 1;
            st.last = posts.clone();
            sh.turn.notify_all();
            return Ok(posts);
        }
        let (mut st, wait) = sh
            .turn
            .wait_timeout_while(st, sh.timeout, |s| s.generation == generation)
            .map_err(|_| poisoned())?;
        if wait.timed_out() && st.generation == generation {
            let missing: Vec<usize> = (0..sh.size).filter(|&r| !st.arrived[r]).collect();
            // Leave the meeting as it found this rank.
            st.arrived[self.rank] = false;
            st.posts[self.rank] = None;
            return Err(Error::InvalidArgument(format!(
                "LocalGroup: rank {} waited {:?} at {} for ranks {missing:?}, which never \
                 arrived",
                self.rank, sh.timeout, tag.0
            )));
        }
        Ok(st.last.clone())
    }

    /// One collective: for every rank `p`, the bytes `src` of its `send` copied to `dst` of
    /// this rank's `recv`, `(src, dst) = blocks(p, p's send counts)`. Each copy waits for the
    /// sender's buffer to be ready on its stream; each rank's stream then waits until every
    /// rank has copied from it, so work it enqueues later may overwrite its `send`. A rank
    /// whose copies fail (a block its sender does not have) still meets the others after
    /// them, so that they do not wait for it until the timeout, and then reports the error.
    fn exchange(
        &self,
        what: &'static str,
        stream: &Stream,
        (send, counts): (&DeviceBuffer<u8>, &[usize]),
        recv: &DeviceBuffer<u8>,
        blocks: impl Fn(usize, &[usize]) -> Result<(Range<usize>, Range<usize>)>,
    ) -> Result<()> {
        self.check_eager(what, stream)?;
        let ctx = stream.context();
        let event = |s: &Stream| -> Result<Arc<Event>> {
            let e = Event::for_sync(ctx)?;
            e.record(s)?;
            Ok(Arc::new(e))
        };
        let ready = Post {
            send: send.share(),
            counts: counts.to_vec(),
            event: event(stream)?,
        };
        let arrivals = self.meet((what, "send buffers ready"), Some(ready))?;
        let copied = arrivals.iter().enumerate().try_for_each(|(p, a)| {
            let post = a.as_ref().and_then(|a| a.post.as_ref()).ok_or_else(|| {
                Error::InvalidArgument(format!("LocalGroup: rank {p} posted nothing at {what}"))
            })?;
            let (src, dst) = blocks(p, &post.counts)?;
            stream.wait_event(&post.event)?;
            recv.slice(dst)?
                .copy_from_device(stream, &post.send.slice(src)?)
        });
        let done = Post {
            send: send.share(),
            counts: Vec::new(),
            event: event(stream)?,
        };
        let dones = self.meet((what, "copies done"), Some(done))?;
        for post in dones.iter().flatten().filter_map(|a| a.post.as_ref()) {
            stream.wait_event(&post.event)?;
        }
        copied
    }

    /// Refuses a collective on a capturing stream: its copies wait on other threads' streams,
    /// which no capture may do.
    fn check_eager(&self, what: &str, stream: &Stream) -> Result<()> {
        if stream.capture_status()? == CaptureStatus::None {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "LocalGroup {what}: the stream is capturing, and a LocalGroup's collectives cannot \
             be captured (they wait on the other ranks' streams); run them eagerly"
        )))
    }

    fn check_lengths(&self, what: &str, send: usize, recv: usize, ok: bool) -> Result<()> {
        if ok {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "LocalGroup {what}: send of {send} bytes and recv of {recv} do not fit {} ranks",
            self.shared.size
        )))
    }
}

impl ExpertGroup for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_gather(
        &self,
        stream: &Stream,
        send: &DeviceBuffer<u8>,
        recv: &DeviceBuffer<u8>,
    ) -> Result<()> {
        let (n, size) = (send.len(), self.shared.size);
        self.check_lengths("all_gather", n, recv.len(), recv.len() == n * size)?;
        self.exchange("all_gather", stream, (send, &[]), recv, |p, _| {
            Ok((0..n, p * n..(p + 1) * n))
        })
    }

    fn all_to_all(
        &self,
        stream: &Stream,
        send: &DeviceBuffer<u8>,
        recv: &DeviceBuffer<u8>,
    ) -> Result<()> {
        let (len, size, r) = (send.len(), self.shared.size, self.rank);
        let ok = recv.len() == len && len % size == 0;
        self.check_lengths("all_to_all", len, recv.len(), ok)?;
        let b = len / size;
        self.exchange("all_to_all", stream, (send, &[]), recv, |p, _| {
            Ok((r * b..(r + 1) * b, p * b..(p + 1) * b))
        })
    }

    fn all_to_all_v(
        &self,
        stream: &Stream,
        (send, send_counts): (&DeviceBuffer<u8>, &[usize]),
        (recv, recv_counts): (&DeviceBuffer<u8>, &[usize]),
    ) -> Result<()> {
        let (size, r) = (self.shared.size, self.rank);
        let fits = |counts: &[usize], len: usize| {
            counts.len() == size
                && counts
                    .iter()
                    .try_fold(0usize, |a, &c| a.checked_add(c))
                    .is_some_and(|t| t <= len)
        };
        let ok = fits(send_counts, send.len()) && fits(recv_counts, recv.len());
        self.check_lengths("all_to_all_v", send.len(), recv.len(), ok)?;
        let start = |counts: &[usize], p: usize| counts[..p].iter().sum::<usize>();
        self.exchange(
            "all_to_all_v",
            stream,
            (send, send_counts),
            recv,
            |p, theirs| {
                if theirs.len() != size || theirs[r] != recv_counts[p] {
                    return Err(Error::InvalidArgument(format!(
                        "LocalGroup all_to_all_v: rank {p} sends {:?} bytes to rank {r}, which \
                     expects {}",
                        theirs.get(r),
                        recv_counts[p]
                    )));
                }
                let (src, dst) = (start(theirs, r), start(recv_counts, p));
                Ok((src..src + theirs[r], dst..dst + recv_counts[p]))
            },
        )
    }

    /// Every rank's `buf` gathered into a buffer of this rank's stream, then reduced there
    /// in rank order (sums in f32, bf16 rounded once): f32 and bf16.
    fn all_reduce(&self, stream: &Stream, buf: HpBuffer<'_>, op: GroupOp) -> Result<()> {
        let size = self.shared.size;
        // The module is loaded once per context and its kernels looked up once (both cached
        // by the crate), on `stream`'s context.
        let module = Module::embedded(stream.context(), FATBIN)?;
        let (kernel, send) = match buf {
            HpBuffer::F32(b) => (
                module.kernel("moe_ep_reduce_ranks_f32")?,
                b.reinterpret::<u8>()?,
            ),
            HpBuffer::Bf16(b) => (
                module.kernel("moe_ep_reduce_ranks_bf16")?,
                b.reinterpret::<u8>()?,
            ),
            HpBuffer::F16(_) => {
                return Err(Error::InvalidArgument(
                    "LocalGroup all_reduce: f16 is not reduced (f32 and bf16 are)".into(),
                ));
            }
        };
        if buf.is_empty() {
            return Ok(());
        }
        self.check_eager("all_reduce", stream)?;
        let rows = DeviceBuffer::<u8>::alloc_async(stream, size * send.len())?;
        self.all_gather(stream, &send, &rows)?;
        let (len, ranks) = (
            buf.len() as u64,
            u32::try_from(size).map_err(|_| too_large("ranks", size))?,
        );
        let (max_op, post) = match op {
            GroupOp::Sum => (0u32, 1.0f32),
            GroupOp::Avg => (0, 1.0 / size as f32),
            GroupOp::Max => (1, 1.0),
        };
        let args = KernelArgs::new()
            .arg(&rows)
            .arg(&send)
            .arg(&len)
            .arg(&ranks)
            .arg(&max_op)
            .arg(&post);
        let blocks = buf.len().div_ceil(BLOCK as usize).clamp(1, 4096) as u32;
        // SAFETY: the grid-stride loop reads rows[r * len + i] for r < ranks, i < len (the
        // gathered `ranks x len` elements: `size` times `buf`'s bytes allocated) and writes
        // send[i] (`buf`'s len elements), both of the kernel's element type.
        unsafe { stream.launch_pdl(&kernel, &LaunchConfig::linear(blocks, BLOCK), &args) }
    }

    fn capturable(&self) -> bool {
        false
    }
}

/// The amax reduction (TransformerEngine's `fp8_group`) over ranks that are threads on one
/// device: [`ExpertGroup::all_reduce`]'s maximum (eager only, as every collective of the
/// group).
impl ReductionGroup for LocalGroup {
    fn all_reduce_max(&self, stream: &Stream, amaxes: &DeviceBuffer<f32>) -> Result<()> {
        self.all_reduce(stream, HpBuffer::F32(amaxes), GroupOp::Max)
    }

    fn size(&self) -> usize {
        self.shared.size
    }
}

/// The expert-parallel kernels (in `src/kernels/moe_routing.cu`).
#[derive(Debug)]
struct Kernels {
    local_experts: Kernel,
    to_sources: Kernel,
    from_owners: Kernel,
    to_sources_exact: Kernel,
    _module: Module,
}

/// Threads per block of the expert-parallel kernels (`MOE_BLOCK`), a row per warp in the
/// row copies.
const BLOCK: u32 = 256;
const ROWS_PER_BLOCK: u32 = BLOCK / 32;

/// A rank's part of an expert-parallel MoE layer. See the [module documentation](self).
///
/// Saved buffers per microbatch ([`saved_bytes`](Self::saved_bytes)): `[0]` the rank's
/// routing over all `E` experts ([`RoutingBuffers::from_bytes`], as the single-GPU layer's),
/// `[1]` the expert outputs of its assignments in its packed layout (`[C, H]` bf16), `[2]`
/// every rank's gates (`[N T, k]` f32), `[3]` every rank's offsets (`[N, E + 1]` i32) and
/// `[4]` packed rows of its assignments (`[N T, k]` i32) (the exact-size exchange's), then
/// the saved buffers of the rank's experts as a [`MoeLayer`] over the `N T` gathered tokens.
#[derive(Debug)]
pub struct ExpertParallelMoe {
    cfg: MoeLayerConfig,
    group: Arc<dyn ExpertGroup>,
    router: Router,
    wr: DeviceBuffer<f32>,
    dwr: DeviceBuffer<f32>,
    /// This rank's experts over every rank's tokens.
    experts: MoeLayer,
    k: Kernels,
    /// Every rank's tokens `[N T, H]` in the forward, their dY in the backward.
    gathered: DeviceBuffer<bf16>,
    /// Every rank's top-k experts `[N T, k]`.
    topk_all: DeviceBuffer<i32>,
    /// The row exchange's blocks: `N` blocks of `T k` rows of `H`.
    send: DeviceBuffer<bf16>,
    recv: DeviceBuffer<bf16>,
    /// fc1's data gradient of this rank's assignments, in its packed layout.
    dxp: DeviceBuffer<bf16>,
    /// [`saved_bytes`](Self::saved_bytes), checked at construction.
    saved_bytes: Vec<usize>,
}

/// The saved buffers of one microbatch as views.
struct EpSaved<'a> {
    routing: RoutingBuffers,
    y: DeviceBuffer<bf16>,
    gates_all: DeviceBuffer<f32>,
    /// Every rank's offsets (`[N, E + 1]`) and packed row of each assignment (`[N T, k]`):
    /// the exact-size exchange's layout.
    offsets_all: DeviceBuffer<i32>,
    row_of_all: DeviceBuffer<i32>,
    experts: Saved<'a>,
}

/// The saved buffers before the experts' own.
const OWN_SAVED: usize = 5;

/// The configuration of the rank's experts as a [`MoeLayer`]: `E / N` experts over every
/// rank's tokens.
fn experts_config(cfg: &MoeLayerConfig, ranks: usize) -> MoeLayerConfig {
    MoeLayerConfig {
        tokens: cfg.tokens * ranks,
        experts: cfg.experts / ranks.max(1),
        ..*cfg
    }
}

/// Checks that `cfg` can be split over `ranks` ranks: the layer's own rules, `E` a multiple
/// of the ranks, and at least `k` experts per rank (the experts' plan takes up to `k` of a
/// token's assignments).
pub fn check_split(cfg: &MoeLayerConfig, ranks: usize) -> Result<()> {
    cfg.check()?;
    experts_per_rank(cfg.experts, cfg.router.top_k, ranks)?;
    experts_config(cfg, ranks).check()
}

/// The experts each of `ranks` ranks holds when `experts` experts of a top-`top_k` layer are
/// spread over them: the split must be even, with at least `top_k` a rank.
///
/// Errors: the split, described ([`Error::InvalidArgument`]).
pub fn experts_per_rank(experts: usize, top_k: usize, ranks: usize) -> Result<usize> {
    if ranks == 0 || experts % ranks != 0 {
        return Err(Error::InvalidArgument(format!(
            "expert parallelism: {experts} experts do not split over {ranks} ranks"
        )));
    }
    let per = experts / ranks;
    if per < top_k {
        return Err(Error::InvalidArgument(format!(
            "expert parallelism: {per} experts per rank over {ranks} ranks, fewer than top_k = \
             {top_k}"
        )));
    }
    Ok(per)
}

impl ExpertParallelMoe {
    /// This rank's part of the layer `cfg` (`cfg.tokens` tokens on each rank, `cfg.experts`
    /// over all ranks), from the parameters of all `E` experts (the same on every rank; the
    /// rank keeps its experts' slices and the router weight). Its experts use tensors
    /// `first_tensor .. first_tensor + `[`tensors`](super::layer::tensors)`(E / N)` of
    /// `scaling` (x, h, dY, dA, then W1 and W2 of each of its experts). Allocates and uploads
    /// (waits; not during a capture).
    ///
    /// Errors: [`check_split`]'s, parameters of the wrong length, the scaling tensors'
    /// formats, and the device's.
    pub fn new(
        stream: &Stream,
        cfg: MoeLayerConfig,
        params: &MoeParams,
        scaling: Arc<DelayedScaling>,
        first_tensor: usize,
        group: Arc<dyn ExpertGroup>,
    ) -> Result<ExpertParallelMoe> {
        let ranks = group.size();
        check_split(&cfg, ranks)?;
        let (e, h, f) = (cfg.experts, cfg.hidden, cfg.ffn);
        for (name, got, want) in [
            ("wr", params.wr.len(), e * h),
            ("w1", params.w1.len(), e * 2 * f * h),
            ("w2", params.w2.len(), e * h * f),
        ] {
            if got != want {
                return Err(Error::InvalidArgument(format!(
                    "ExpertParallelMoe: {name} has {got} elements, {cfg:?} needs {want}"
                )));
            }
        }
        let per_rank = e / ranks;
        let mine = group.rank() * per_rank..(group.rank() + 1) * per_rank;
        let local = MoeParams {
            wr: vec![0.0; per_rank * h],
            w1: params.w1[mine.start * 2 * f * h..mine.end * 2 * f * h].to_vec(),
            w2: params.w2[mine.start * h * f..mine.end * h * f].to_vec(),
        };
        let experts = MoeLayer::new(
            stream,
            experts_config(&cfg, ranks),
            &local,
            scaling,
            first_tensor,
        )?
        .with_weight_grads_beside(None)
        .with_router_grads_beside(None);
        let module = Module::embedded(stream.context(), FATBIN)?;
        let k = Kernels {
            local_experts: module.kernel("moe_ep_local_experts")?,
            to_sources: module.kernel("moe_ep_rows_to_sources")?,
            from_owners: module.kernel("moe_ep_rows_from_owners")?,
            to_sources_exact: module.kernel("moe_ep_rows_to_sources_exact")?,
            _module: module,
        };
        let (t, k_top) = (cfg.tokens, cfg.router.top_k);
        let mut layer = ExpertParallelMoe {
            router: Router::new(stream, cfg.routing_dims(), cfg.router)?,
            wr: DeviceBuffer::from_host(stream, &params.wr)?,
            dwr: zeroed(stream, e * h)?,
            experts,
            k,
            gathered: zeroed(stream, ranks * t * h)?,
            topk_all: zeroed(stream, ranks * t * k_top)?,
            // The static exchange's blocks, or the exact one's rows of every source's packed
            // layout over this rank's experts (each at most the capacity).
            send: zeroed(stream, ranks * (t * k_top).max(cfg.capacity()) * h)?,
            recv: zeroed(stream, ranks * t * k_top * h)?,
            dxp: zeroed(stream, cfg.capacity() * h)?,
            cfg,
            group,
            saved_bytes: Vec::new(),
        };
        layer.saved_bytes = layer.saved_layout()?;
        stream.synchronize()?;
        Ok(layer)
    }

    /// The whole layer's shape (this rank's tokens, every rank's experts).
    pub fn config(&self) -> MoeLayerConfig {
        self.cfg
    }

    /// The group the experts are spread over.
    pub fn group(&self) -> &Arc<dyn ExpertGroup> {
        &self.group
    }

    /// Experts on each rank (`E / N`, checked at construction).
    fn per_rank(&self) -> usize {
        self.cfg.experts / self.group.size()
    }

    /// The experts this rank holds (numbers among all `E`).
    pub fn local_experts(&self) -> Range<usize> {
        let r = self.group.rank();
        r * self.per_rank()..(r + 1) * self.per_rank()
    }

    /// The router weight (`[E, H]` f32, replicated) and its gradient from this rank's tokens.
    pub fn router_weight(&self) -> (&DeviceBuffer<f32>, &DeviceBuffer<f32>) {
        (&self.wr, &self.dwr)
    }

    /// fc1's weights of this rank's experts (`[E / N, 2F, H]`) and their gradient.
    pub fn fc1(&self) -> (&DeviceBuffer<bf16>, &WeightGrad) {
        self.experts.fc1()
    }

    /// fc2's weights of this rank's experts (`[E / N, H, F]`) and their gradient.
    pub fn fc2(&self) -> (&DeviceBuffer<bf16>, &WeightGrad) {
        self.experts.fc2()
    }

    /// The per-microbatch saved buffers' sizes in bytes (see the [type
    /// documentation](Self)).
    pub fn saved_bytes(&self) -> Vec<usize> {
        self.saved_bytes.clone()
    }

    fn saved_layout(&self) -> Result<Vec<usize>> {
        let (n, c) = (self.group.size(), self.cfg.capacity());
        let (t, h, k) = (self.cfg.tokens, self.cfg.hidden, self.cfg.router.top_k);
        let e = self.cfg.experts;
        let mut v = vec![
            RoutingBuffers::bytes(self.cfg.routing_dims())?,
            c * h * 2,
            n * t * k * 4,
            n * (e + 1) * 4,
            n * t * k * 4,
        ];
        v.extend(self.experts.config().saved_bytes()?);
        Ok(v)
    }

    /// The routing of a microbatch over all experts (its losses, counts or plan), from its
    /// first saved buffer.
    pub fn routing_of(&self, saved: &DeviceBuffer<u8>) -> Result<RoutingBuffers> {
        RoutingBuffers::from_bytes(self.cfg.routing_dims(), saved)
    }

    /// Casts this rank's expert weights to E4M3 (once per step, before the forwards);
    /// nothing when their optimizer writes them
    /// ([`with_fp8_weights_from_optimizer`](Self::with_fp8_weights_from_optimizer)).
    pub fn cast_weights(&self, stream: &Stream) -> Result<()> {
        if self.fp8_weights_from_optimizer() {
            return Ok(());
        }
        self.experts.cast_expert_weights(stream, None)
    }

    fn saved<'a>(&self, saved: &[&'a DeviceBuffer<u8>]) -> Result<EpSaved<'a>> {
        let want = &self.saved_bytes;
        if saved.len() != want.len() || saved.iter().zip(want).any(|(b, &w)| b.len() < w) {
            return Err(Error::InvalidArgument(format!(
                "ExpertParallelMoe: saved buffers of {:?} bytes, the layer needs {want:?}",
                saved.iter().map(|b| b.len()).collect::<Vec<_>>()
            )));
        }
        let (c, h) = (self.cfg.capacity(), self.cfg.hidden);
        let n = self.group.size() * self.cfg.tokens * self.cfg.router.top_k;
        let e1 = self.group.size() * (self.cfg.experts + 1);
        Ok(EpSaved {
            routing: self.routing_of(saved[0])?,
            y: saved[1].slice(..c * h * 2)?.reinterpret()?,
            gates_all: saved[2].slice(..n * 4)?.reinterpret()?,
            offsets_all: saved[3].slice(..e1 * 4)?.reinterpret()?,
            row_of_all: saved[4].slice(..n * 4)?.reinterpret()?,
            experts: self
                .experts
                .saved_from(&saved[OWN_SAVED..], &"an expert-parallel rank")?,
        })
    }

    fn check_tokens(&self, what: &str, bufs: &[(&str, &DeviceBuffer<bf16>)]) -> Result<()> {
        let n = self.cfg.tokens * self.cfg.hidden;
        for (name, b) in bufs {
            if b.len() != n {
                return Err(Error::InvalidArgument(format!(
                    "ExpertParallelMoe {what}: {name} has {} elements, [T, H] is {n}",
                    b.len()
                )));
            }
        }
        Ok(())
    }

    /// Every rank's `send` into `recv`.
    fn gather<T: DeviceRepr>(
        &self,
        stream: &Stream,
        send: &DeviceBuffer<T>,
        recv: &DeviceBuffer<T>,
    ) -> Result<()> {
        self.group
            .all_gather(stream, &send.reinterpret()?, &recv.reinterpret()?)
    }

    /// The forward of this rank's tokens `x` (`[T, H]` bf16) into `out` (`[T, H]`), with
    /// the microbatch's saved buffers. Every rank of the group runs it at once (collectives
    /// inside). Capturable in full-layer mode ([`ExpertGemm::Grouped`]) over a capturable
    /// group (NCCL); breaking-layer mode reads counts back, so it runs eagerly. Call
    /// [`cast_weights`](Self::cast_weights) once per step before the first forward. (In the
    /// graphed-callables runtime the layer runs through its [`Callable`] methods instead.)
    pub fn forward(
        &self,
        stream: &Stream,
        x: &DeviceBuffer<bf16>,
        out: &DeviceBuffer<bf16>,
        saved: &[&DeviceBuffer<u8>],
    ) -> Result<()> {
        self.forward_in(stream, x, out, saved, None)
    }

    /// [`forward`](Self::forward), in the runtime's `slot` when given: the experts wait for
    /// the slot's weight cast, and a warmup reports the routed experts' weight tensors.
    fn forward_in(
        &self,
        stream: &Stream,
        x: &DeviceBuffer<bf16>,
        out: &DeviceBuffer<bf16>,
        saved: &[&DeviceBuffer<u8>],
        slot: Option<&Slot<'_, bf16>>,
    ) -> Result<()> {
        self.check_tokens("forward", &[("x", x), ("out", out)])?;
        let s = self.saved(saved)?;
        self.router.forward(stream, x, &self.wr, &s.routing)?;
        self.gather(stream, x, &self.gathered)?;
        self.gather(stream, &s.routing.topk, &self.topk_all)?;
        self.gather(stream, &s.routing.gates, &s.gates_all)?;
        if self.exact() {
            self.gather(stream, &s.routing.offsets, &s.offsets_all)?;
            self.gather(stream, &s.routing.row_of, &s.row_of_all)?;
        }
        self.renumber_experts(stream, &s.experts.routing.topk)?;
        self.experts
            .dispatch_planned(stream, &self.gathered, &s.experts)?;
        if let Some(slot) = slot {
            self.experts
                .record_routed_weights(stream, &s.experts, slot)?;
            slot.wait_weight_cast(stream)?;
        }
        self.experts.experts_forward(stream, &s.experts)?;
        self.rows_home(stream, &s.experts.y, &s, &s.y)?;
        self.router.combine(stream, &s.y, &s.routing, out)
    }

    /// The backward of the output gradient `dy` into `dx` (both `[T, H]`), `x` being the
    /// forward's input: the router weight's gradient (this rank's tokens) and this rank's
    /// experts' weight gradients (every rank's tokens) written, or added to with
    /// `accumulate`. Every rank runs it at once, as the forward.
    pub fn backward(
        &self,
        stream: &Stream,
        x: &DeviceBuffer<bf16>,
        dy: &DeviceBuffer<bf16>,
        dx: &DeviceBuffer<bf16>,
        saved: &[&DeviceBuffer<u8>],
        accumulate: bool,
    ) -> Result<()> {
        self.check_tokens("backward", &[("x", x), ("dy", dy), ("dx", dx)])?;
        let s = self.saved(saved)?;
        self.router.combine_backward(stream, dy, &s.y, &s.routing)?;
        self.gather(stream, dy, &self.gathered)?;
        self.experts
            .cast_output_grad(stream, &self.gathered, &s.gates_all, &s.experts)?;
        self.experts
            .experts_backward(stream, &s.experts, Some(accumulate))?;
        self.rows_home(stream, self.experts.packed_input_grad(), &s, &self.dxp)?;
        self.router
            .input_backward(stream, &self.dxp, &self.wr, &s.routing, dx)?;
        self.router
            .weight_backward(stream, x, &s.routing, &self.dwr, accumulate)
    }

    /// The gathered top-k as this rank's expert numbers, into the experts' routing.
    fn renumber_experts(&self, stream: &Stream, local: &DeviceBuffer<i32>) -> Result<()> {
        let n = self.topk_all.len();
        if local.len() != n {
            return Err(Error::InvalidArgument(format!(
                "ExpertParallelMoe: the experts' top-k has {} entries, {n} gathered",
                local.len()
            )));
        }
        let start = self.local_experts().start;
        let (n32, first) = (
            u32::try_from(n).map_err(|_| too_large("assignments", n))?,
            i32::try_from(start).map_err(|_| too_large("experts", start))?,
        );
        let args = KernelArgs::new()
            .arg(&self.topk_all)
            .arg(local)
            .arg(&n32)
            .arg(&first);
        // SAFETY: thread i < n reads topk_all[i] and writes local[i]; both hold n entries
        // (checked above).
        unsafe {
            stream.launch_pdl(
                &self.k.local_experts,
                &LaunchConfig::linear(n32.div_ceil(BLOCK), BLOCK),
                &args,
            )
        }
    }

    /// The rows `rows` (`[C', H]`, this rank's experts' packed layout) sent home: each
    /// gathered assignment's row to its token's rank, which places the rows of its own
    /// assignments into `home` (`[C, H]`, its packed layout over all experts).
    fn rows_home(
        &self,
        stream: &Stream,
        rows: &DeviceBuffer<bf16>,
        s: &EpSaved<'_>,
        home: &DeviceBuffer<bf16>,
    ) -> Result<()> {
        if self.exact() {
            return self.rows_home_exact(stream, rows, s, home);
        }
        let h = self.cfg.hidden;
        let (local_rows, home_rows) = (rows.len() / h, home.len() / h);
        let all = self.topk_all.len();
        let mine = self.cfg.tokens * self.cfg.router.top_k;
        let send = self.send.slice(..all * h)?;
        let u = |name: &str, v: usize| u32::try_from(v).map_err(|_| too_large(name, v));
        let (all32, mine32, h32) = (u("assignments", all)?, u("assignments", mine)?, u("H", h)?);
        let (local32, home32) = (u("rows", local_rows)?, u("rows", home_rows)?);
        let (per_rank, ranks) = (
            u("experts", self.per_rank())?,
            u("ranks", self.group.size())?,
        );
        let row_of = &s.experts.routing.row_of;
        if row_of.len() != all || s.routing.row_of.len() != mine {
            return Err(Error::InvalidArgument(
                "ExpertParallelMoe: the row exchange's buffers do not match the shape".into(),
            ));
        }
        let args = KernelArgs::new()
            .arg(rows)
            .arg(row_of)
            .arg(&send)
            .arg(&all32)
            .arg(&h32)
            .arg(&local32);
        // SAFETY: warp i < all reads row_of[i] (all entries, checked) and, when that row is
        // inside [0, local_rows), its H elements of `rows` (local_rows * H), writing row i of
        // `send` (all * H, checked); the 16-byte accesses only when H % 8 == 0 and the kernel
        // finds both 16-byte aligned.
        unsafe {
            stream.launch_pdl(
                &self.k.to_sources,
                &LaunchConfig::linear(all32.div_ceil(ROWS_PER_BLOCK), BLOCK),
                &args,
            )
        }?;
        self.group
            .all_to_all(stream, &send.reinterpret()?, &self.recv.reinterpret()?)?;
        let args = KernelArgs::new()
            .arg(&self.recv)
            .arg(&s.routing.topk)
            .arg(&s.routing.row_of)
            .arg(home)
            .arg(&mine32)
            .arg(&h32)
            .arg(&home32)
            .arg(&per_rank)
            .arg(&ranks);
        // SAFETY: warp a < mine reads topk[a] and row_of[a] (mine entries each, checked), and
        // for an expert e < ranks * per_rank and a row inside [0, home_rows) copies row
        // (e / per_rank) * mine + a < ranks * mine of `recv` (ranks * mine * H = all * H
        // elements) into that row of `home` (home_rows * H); vector accesses as above.
        unsafe {
            stream.launch_pdl(
                &self.k.from_owners,
                &LaunchConfig::linear(mine32.div_ceil(ROWS_PER_BLOCK), BLOCK),
                &args,
            )
        }
    }
}

/// The layer in the graphed-callables runtime: full-layer ([`ExpertGemm::Grouped`]) over a
/// group whose collectives can be captured (NCCL's) is one graphed segment each way, its
/// collectives inside the graphs; breaking-layer ([`ExpertGemm::PerExpert`], which reads
/// counts back) and any pass over a group that cannot be captured (a [`LocalGroup`]) is one
/// eager segment each way, which casts the weights itself on a step's first microbatch (the
/// runtime casts in graphed segments only). Every rank builds and runs the same schedule.
/// Weight gradients accumulate, or with
/// [`with_step_gradients`](ExpertParallelMoe::with_step_gradients) microbatch 0 writes them.
impl Callable<bf16> for ExpertParallelMoe {
    fn input_lens(&self) -> Vec<usize> {
        vec![self.cfg.tokens * self.cfg.hidden]
    }

    fn output_lens(&self) -> Vec<usize> {
        vec![self.cfg.tokens * self.cfg.hidden]
    }

    fn saved_bytes(&self) -> Vec<usize> {
        self.saved_bytes.clone()
    }

    /// This rank's experts' weights to E4M3, skipped on the device when the slot's noop flag
    /// reads 1.0 (later microbatches of a step); nothing when their optimizer writes them.
    fn cast_weights(&mut self, stream: &Stream, slot: &Slot<'_, bf16>) -> Result<()> {
        if self.fp8_weights_from_optimizer() {
            return Ok(());
        }
        let noop = slot
            .skip_weight_cast()
            .map(|f| DeviceScalar::at(f, 0))
            .transpose()?;
        self.experts.cast_expert_weights(stream, noop.as_ref())
    }

    /// Yes: the router, the gathers, the plan and the permute read neither the cast weights
    /// nor their scales; the experts wait for the casts.
    fn overlaps_weight_cast(&self) -> bool {
        true
    }

    fn forward(
        &mut self,
        stream: &Stream,
        inputs: &[&DeviceBuffer<bf16>],
        outputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        self.slot_forward(stream, inputs, outputs, slot)
    }

    fn backward(
        &mut self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<bf16>],
        grad_inputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        self.slot_backward(stream, grad_outputs, grad_inputs, slot)
    }

    fn forward_segments(&self) -> Vec<SegmentKind> {
        vec![if self.graphed() {
            SegmentKind::Graphed
        } else {
            SegmentKind::Eager
        }]
    }

    fn backward_segments(&self) -> Vec<SegmentKind> {
        self.forward_segments()
    }

    fn forward_segment(
        &mut self,
        segment: usize,
        stream: &Stream,
        inputs: &[&DeviceBuffer<bf16>],
        outputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        match (self.graphed(), segment) {
            (true, 0) => Callable::forward(self, stream, inputs, outputs, slot),
            _ => Err(self.not_a_segment("forward", segment, "graphed")),
        }
    }

    fn forward_eager(
        &self,
        segment: usize,
        stream: &Stream,
        inputs: &[&DeviceBuffer<bf16>],
        outputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        if (self.graphed(), segment) != (false, 0) {
            return Err(self.not_a_segment("forward", segment, "eager"));
        }
        // A forward of eager segments only gets no casts from the runtime: its first
        // microbatch of a step casts here.
        if slot.is_first_microbatch() {
            self.cast_weights(stream)?;
        }
        self.slot_forward(stream, inputs, outputs, slot)
    }

    fn backward_segment(
        &mut self,
        segment: usize,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<bf16>],
        grad_inputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        match (self.graphed(), segment) {
            (true, 0) => Callable::backward(self, stream, grad_outputs, grad_inputs, slot),
            _ => Err(self.not_a_segment("backward", segment, "graphed")),
        }
    }

    fn backward_eager(
        &self,
        segment: usize,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<bf16>],
        grad_inputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        if (self.graphed(), segment) != (false, 0) {
            return Err(self.not_a_segment("backward", segment, "eager"));
        }
        self.slot_backward(stream, grad_outputs, grad_inputs, slot)
    }
}

/// The one buffer each way a pass takes.
fn one_each<'a>(
    what: &str,
    a: &[&'a DeviceBuffer<bf16>],
    b: &[&'a DeviceBuffer<bf16>],
) -> Result<(&'a DeviceBuffer<bf16>, &'a DeviceBuffer<bf16>)> {
    match (a, b) {
        ([a], [b]) => Ok((a, b)),
        _ => Err(Error::InvalidArgument(format!(
            "ExpertParallelMoe {what}: takes one buffer each way, got {} and {}",
            a.len(),
            b.len()
        ))),
    }
}

impl ExpertParallelMoe {
    /// The forward in the runtime's `slot`: the activation tensors reported, then
    /// [`forward_in`](Self::forward_in).
    fn slot_forward(
        &self,
        stream: &Stream,
        inputs: &[&DeviceBuffer<bf16>],
        outputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        self.experts.fp8_only(slot)?;
        let (x, out) = one_each("forward", inputs, outputs)?;
        self.experts.record_activation_tensors(slot);
        self.forward_in(stream, x, out, slot.saved(), Some(slot))
    }

    /// The backward in the runtime's `slot`: the gradient tensors reported, the weight
    /// gradients written or added to by the slot's step-gradient rule.
    fn slot_backward(
        &self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<bf16>],
        grad_inputs: &[&DeviceBuffer<bf16>],
        slot: &Slot<'_, bf16>,
    ) -> Result<()> {
        self.experts.fp8_only(slot)?;
        let (dy, dx) = one_each("backward", grad_outputs, grad_inputs)?;
        let (x, _) = one_each("backward", slot.inputs(), slot.outputs())?;
        self.experts.record_gradient_tensors(slot);
        let accumulate = self.experts.accumulate_grads(slot);
        self.backward(stream, x, dy, dx, slot.saved(), accumulate)
    }

    /// This layer with its weight gradients (the experts' and the router's) holding one
    /// step's sum in the runtime (microbatch 0 writes them) instead of accumulating.
    pub fn with_step_gradients(mut self, on: bool) -> ExpertParallelMoe {
        self.experts = self.experts.with_step_gradients(on);
        self
    }

    /// This layer with its experts' FP8 weights written by their optimizer
    /// ([`MoeAdamW::new_expert_parallel`](super::optim::MoeAdamW::new_expert_parallel)), as
    /// [`MoeLayer::with_fp8_weights_from_optimizer`]: casts them now (waits), and from then
    /// on the layer casts nothing itself ([`cast_weights`](Self::cast_weights) and the
    /// runtime's casts do nothing).
    ///
    /// Errors: the device's.
    pub fn with_fp8_weights_from_optimizer(
        mut self,
        stream: &Stream,
        on: bool,
    ) -> Result<ExpertParallelMoe> {
        self.experts = self.experts.with_fp8_weights_from_optimizer(stream, on)?;
        Ok(self)
    }

    /// Whether the optimizer writes the FP8 expert weights.
    pub fn fp8_weights_from_optimizer(&self) -> bool {
        self.experts.fp8_weights_from_optimizer()
    }

    /// This layer with its experts' forward GEMMs accumulating fast (the default) or
    /// promoted ([`MoeLayer::with_fast_forward_accumulation`]).
    pub fn with_fast_forward_accumulation(mut self, on: bool) -> ExpertParallelMoe {
        self.experts = self.experts.with_fast_forward_accumulation(on);
        self
    }

    /// This rank's experts as a layer over every rank's tokens (their weights, gradients and
    /// FP8 state, as an optimizer sees them).
    pub(crate) fn experts_layer(&self) -> &MoeLayer {
        &self.experts
    }

    /// The router weight and its gradient as an optimizer sees them (shared handles).
    pub(crate) fn router_params(&self) -> (DeviceBuffer<f32>, DeviceBuffer<f32>) {
        (self.wr.share(), self.dwr.share())
    }

    /// The error for a segment the layer does not have in its mode.
    fn not_a_segment(&self, pass: &str, segment: usize, what: &str) -> Error {
        Error::InvalidArgument(format!(
            "ExpertParallelMoe ({:?}): {pass} segment {segment} is not {what}",
            self.cfg.expert_gemm
        ))
    }

    /// Whether the graphed-callables runtime captures the layer's passes: full-layer
    /// ([`ExpertGemm::Grouped`]) over a group whose collectives can be captured. Otherwise
    /// each pass is one eager segment (over a [`LocalGroup`], full-layer too).
    fn graphed(&self) -> bool {
        self.cfg.expert_gemm == ExpertGemm::Grouped && self.group.capturable()
    }

    /// Whether rows go home in exact sizes (breaking-layer, [`ExpertGemm::PerExpert`]).
    fn exact(&self) -> bool {
        self.cfg.expert_gemm == ExpertGemm::PerExpert
    }

    /// [`rows_home`](Self::rows_home) in exact sizes (breaking-layer): every rank's offsets
    /// read back (a stream synchronisation), each source's rows of this rank's experts sent
    /// in its own packed order, with its padding rows, so that they land in its packed layout
    /// directly (the owners' blocks follow each other there in rank order).
    fn rows_home_exact(
        &self,
        stream: &Stream,
        rows: &DeviceBuffer<bf16>,
        s: &EpSaved<'_>,
        home: &DeviceBuffer<bf16>,
    ) -> Result<()> {
        let (n, r, per) = (self.group.size(), self.group.rank(), self.per_rank());
        let (e, h) = (self.cfg.experts, self.cfg.hidden);
        let off = s.offsets_all.to_vec(stream)?;
        // Rows of rank q's packed layout over the experts of `owner`.
        let span = |q: usize, owner: usize| -> Result<usize> {
            let o = &off[q * (e + 1)..(q + 1) * (e + 1)];
            let (a, b) = (o[owner * per], o[(owner + 1) * per]);
            usize::try_from(b - a)
                .ok()
                .filter(|_| a >= 0 && (b as usize) <= self.cfg.capacity())
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "ExpertParallelMoe: rank {q}'s offsets {a}..{b} of rank {owner}'s experts \
                         are not a range of its packed layout"
                    ))
                })
        };
        let rows2 = |v: usize| v * h * 2;
        let send_counts = (0..n)
            .map(|q| span(q, r).map(rows2))
            .collect::<Result<Vec<_>>>()?;
        let recv_counts = (0..n)
            .map(|q| span(r, q).map(rows2))
            .collect::<Result<Vec<_>>>()?;
        let mine = self.cfg.tokens * self.cfg.router.top_k;
        let (local_row_of, row_of_all) = (&s.experts.routing.row_of, &s.row_of_all);
        if local_row_of.len() != n * mine || row_of_all.len() != n * mine {
            return Err(Error::InvalidArgument(
                "ExpertParallelMoe: the row exchange's buffers do not match the shape".into(),
            ));
        }
        let u = |name: &str, v: usize| u32::try_from(v).map_err(|_| too_large(name, v));
        let (mine32, n32, h32) = (u("assignments", mine)?, u("ranks", n)?, u("H", h)?);
        let all32 = u("assignments", n * mine)?;
        let (rows_in, send_rows) = (u("rows", rows.len() / h)?, u("rows", self.send.len() / h)?);
        let (e32, first, per32) = (u("experts", e)?, u("experts", r * per)?, u("experts", per)?);
        let args = KernelArgs::new()
            .arg(rows)
            .arg(local_row_of)
            .arg(row_of_all)
            .arg(&s.offsets_all)
            .arg(&self.send)
            .arg(&mine32)
            .arg(&n32)
            .arg(&h32)
            .arg(&rows_in)
            .arg(&send_rows)
            .arg(&e32)
            .arg(&first)
            .arg(&per32);
        // SAFETY: warp i < n * mine reads local_row_of[i] and row_of_all[i] (n * mine each,
        // checked), offsets_all's rows q <= i / mine < n at columns first and first + per <= E
        // (n * (E + 1) entries, the saved buffer's), the H elements of `rows` at a row inside
        // [0, rows_in) (rows_in * H), and writes a row inside [0, send_rows) of `send`
        // (send_rows * H); the 16-byte accesses only when H % 8 == 0 and the kernel finds both
        // 16-byte aligned.
        unsafe {
            stream.launch_pdl(
                &self.k.to_sources_exact,
                &LaunchConfig::linear(all32.div_ceil(ROWS_PER_BLOCK), BLOCK),
                &args,
            )
        }?;
        self.group.all_to_all_v(
            stream,
            (&self.send.reinterpret()?, &send_counts),
            (&home.reinterpret()?, &recv_counts),
        )
    }
}

fn too_large(name: &str, v: usize) -> Error {
    Error::InvalidArgument(format!("ExpertParallelMoe: {v} {name} exceed 32 bits"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::layer::{ExpertGemm, Fp8Recipe, GradDtype};
    use crate::moe::routing::{RouterConfig, ScoreFn};
    use fp8_kernels::CastScaling;

    #[test]
    fn experts_must_split_evenly_with_top_k_each() {
        // 8 experts, top-2.
        for (ok, per) in [(1, 8), (2, 4), (4, 2)] {
            assert_eq!(experts_per_rank(8, 2, ok).unwrap(), per);
        }
        for bad in [0, 3, 8, 16] {
            let e = experts_per_rank(8, 2, bad).unwrap_err().to_string();
            assert!(e.contains(&format!("over {bad} ranks")), "{e}");
        }
    }

    fn cfg(experts: usize, top_k: usize) -> MoeLayerConfig {
        MoeLayerConfig {
            tokens: 64,
            hidden: 64,
            ffn: 32,
            experts,
            router: RouterConfig {
                top_k,
                score: ScoreFn::Softmax,
                renormalize: false,
                aux_coef: 0.0,
                z_coef: 0.0,
            },
            recipe: Fp8Recipe::Hybrid,
            expert_gemm: ExpertGemm::Grouped,
            scaling: CastScaling::Delayed,
            grad_dtype: GradDtype::F32,
        }
    }

    #[test]
    fn the_split_needs_whole_experts_and_top_k_per_rank() {
        check_split(&cfg(8, 2), 1).unwrap();
        check_split(&cfg(8, 2), 2).unwrap();
        check_split(&cfg(8, 2), 4).unwrap();
        let e = check_split(&cfg(8, 2), 3).unwrap_err().to_string();
        assert!(e.contains("do not split over 3"), "{e}");
        let e = check_split(&cfg(8, 2), 8).unwrap_err().to_string();
        assert!(e.contains("fewer than top_k"), "{e}");
        let e = check_split(&cfg(8, 2), 0).unwrap_err().to_string();
        assert!(e.contains("0 ranks"), "{e}");
    }

    #[test]
    fn the_experts_plan_every_ranks_tokens() {
        let c = experts_config(&cfg(8, 2), 4);
        assert_eq!((c.tokens, c.experts), (256, 2));
        assert!(c.capacity() >= 256 * 2, "every gathered assignment fits");
    }

    #[test]
    fn a_local_group_needs_a_rank() {
        assert!(LocalGroup::new(0).is_err());
        let g = LocalGroup::new(3).unwrap();
        assert_eq!(
            g.iter()
                .map(|g| (g.rank(), ExpertGroup::size(g)))
                .collect::<Vec<_>>(),
            [(0, 3), (1, 3), (2, 3)]
        );
    }

    #[test]
    fn a_rank_that_never_comes_is_named() {
        let g = LocalGroup::with_timeout(3, Duration::from_millis(50)).unwrap();
        let e = g[1]
            .meet(("the test", "one"), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 1") && e.contains("[0, 2]"), "{e}");
    }

    #[test]
    fn the_timeout_variable_takes_positive_seconds() {
        assert_eq!(local_group_timeout(None).unwrap(), LOCAL_GROUP_TIMEOUT);
        assert_eq!(local_group_timeout(Some(" ")).unwrap(), LOCAL_GROUP_TIMEOUT);
        assert_eq!(
            local_group_timeout(Some(" 1.5 ")).unwrap(),
            Duration::from_millis(1500)
        );
        assert_eq!(
            local_group_timeout(Some("1200")).unwrap(),
            Duration::from_secs(1200)
        );
        for bad in ["0", "-3", "soon", "inf", "NaN", "1e400"] {
            let e = local_group_timeout(Some(bad)).unwrap_err().to_string();
            assert!(
                e.contains(LOCAL_GROUP_TIMEOUT_VAR) && e.contains(bad),
                "{e}"
            );
        }
    }

    #[test]
    fn ranks_at_different_collectives_all_get_an_error_naming_both() {
        let g = LocalGroup::new(2).unwrap();
        let tags = [
            ("all_gather", "send buffers ready"),
            ("all_to_all", "send buffers ready"),
        ];
        let handles: Vec<_> = g
            .into_iter()
            .zip(tags)
            .map(|(g, tag)| std::thread::spawn(move || g.meet(tag, None).map(|_| ())))
            .collect();
        for h in handles {
            let e = h.join().unwrap().unwrap_err().to_string();
            assert!(
                e.contains("all_gather (send buffers ready)")
                    && e.contains("all_to_all (send buffers ready)")
                    && e.contains("same order"),
                "{e}"
            );
        }
    }

    #[test]
    fn ranks_meet_and_see_each_others_posts() {
        let g = LocalGroup::new(4).unwrap();
        let handles: Vec<_> = g
            .into_iter()
            .map(|g| {
                std::thread::spawn(move || {
                    (0..3)
                        .map(|_| g.meet(("the test", "one"), None).map(|p| p.len()))
                        .collect::<Result<Vec<_>>>()
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap().unwrap(), [4, 4, 4]);
        }
    }
}
