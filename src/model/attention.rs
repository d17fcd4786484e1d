//! Causal multi-head self-attention for the train job's model, forward and backward, bf16
//! in and out with f32 softmax and accumulation. Kernels in `src/kernels/attention.cu`; the
//! f64 model they are tested against is [`attention_reference`](super::attention_reference).
//!
//! # Layout
//! A batch of `B` sequences of `S` tokens (`T = B * S` rows, token `t = b * S + s`), `H` heads
//! of dimension `D` ([`SUPPORTED_HEAD_DIMS`]), model width `d = H * D`:
//!
//! * `qkv` `[T, 3d]` bf16: row `t` holds q (heads `0..H`, `D` columns each), then k, then v;
//! * `o` `[T, d]` bf16: head `h` at columns `h * D ..`;
//! * `lse` `[B, H, S]` f32: the natural log-sum-exp of each query's scaled scores, saved by
//!   the forward for the backward;
//! * the backward's `d_o` `[T, d]` and `dqkv` `[T, 3d]` (dq, dk, dv where q, k, v are).
//!
//! Token `s` of a sequence attends to tokens `0..=s` of the same sequence with scores
//! `scale * q . k` (normally `scale = 1 / sqrt(D)`: [`AttentionShape::default_scale`]).
//!
//! # Kernels
//! Flash-attention-2 style on bf16 tensor cores (`mma.sync` m16n8k16 with f32 accumulators,
//! so sm_80 and newer): blocks of 4 warps own 64 or 128 queries (or keys), each warp 16 or
//! 32; key (or query) tiles are double-buffered in shared memory with `cp.async`; tiles
//! wholly above the causal diagonal are skipped and only those meeting it are masked. The
//! forward keeps an online softmax in f32 and rounds P to bf16 for `P V`; each output is
//! rounded to bf16 once. The backward recomputes P from the saved `lse` and rounds P and `dS`
//! to bf16 for their products.
//!
//! On the H200, the train job's shape (B = 16, S = 256, H = 8, D = 64) takes 12.0 us forward
//! and 34.7 us backward (means of 50 back-to-back calls); one sequence of 1024 tokens, 24.0
//! and 47.8 us.
//!
//! # Launches
//! Everything is enqueue-only: no allocation, no synchronisation, so a forward or backward
//! can be captured into a CUDA graph. Lengths, alignment and overlaps are checked before any
//! launch. The forward is one launch; the backward two: the query-side kernel (dq, and
//! `delta = rowsum(d_o * o)` into the workspace), then the key-side kernel (dk, dv, walking
//! the query tiles from the diagonal on). Every output element is owned by one thread whose
//! sums run in a fixed order, with no atomics, so results are bit-identical run to run and
//! between eager runs and graph replays.

use std::sync::Arc;

use cuda_graph::half::bf16;
use cuda_graph::{Context, DeviceBuffer, Error, Kernel, LaunchConfig, Module, Result, Stream};
use cuda_graph::{DeviceRepr, kernel_args};

use super::ops::check_len;

/// The kernels, built from `src/kernels/attention.cu`.
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/attention.fatbin"));

/// The head dimensions the kernels are built for.
pub const SUPPORTED_HEAD_DIMS: [usize; 3] = [32, 64, 128];

/// The longest sequence accepted (far above what the model uses; it keeps every index
/// within the kernels' 32-bit arithmetic and the grid's y dimension, `S / 64`, small).
pub const MAX_SEQ: usize = 1 << 16;

/// One kernel's tiling (`Cfg<W, MT, N>` in the kernels): `warps` warps of `16 * m_tiles`
/// rows each (queries, or keys for dk/dv), the other side in tiles of `n` rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tiling {
    warps: u32,
    m_tiles: u32,
    n: u32,
}

impl Tiling {
    const fn new(warps: u32, m_tiles: u32, n: u32) -> Tiling {
        Tiling { warps, m_tiles, n }
    }

    fn threads(self) -> u32 {
        32 * self.warps
    }

    /// Rows a block owns.
    fn rows(self) -> u32 {
        16 * self.m_tiles * self.warps
    }
}

/// The forward's, dq's and dk/dv's tilings of head dimension `d` (`Tiles<D>` in the kernels,
/// which must match; the kernels say why these).
fn tilings(d: usize) -> [Tiling; 3] {
    match d {
        128 => [
            Tiling::new(4, 1, 64),
            Tiling::new(4, 1, 32),
            Tiling::new(4, 1, 16),
        ],
        _ => [
            Tiling::new(4, 2, 64),
            Tiling::new(4, 1, 64),
            Tiling::new(4, 1, 64),
        ],
    }
}

/// The dynamic shared memory of each kernel of head dimension `d`, as the kernels lay it out
/// (tiles of `d + 8` bf16 a row): the forward holds its queries and two stages of keys and
/// values; the dq kernel its queries and their `d_o`, two stages of keys and values, and its
/// queries' `lse` and `delta`; the dk/dv kernel its keys and values, two stages of queries
/// and their `d_o`, `lse` and `delta`.
fn shared_bytes(d: usize) -> [usize; 3] {
    let row = (d + 8) * 2;
    let [f, q, k] = tilings(d).map(|t| (t.rows() as usize, t.n as usize));
    [
        (f.0 + 4 * f.1) * row,
        (2 * q.0 + 4 * q.1) * row + 2 * q.0 * 4,
        (2 * k.0 + 4 * k.1) * row + 4 * k.1 * 4,
    ]
}

/// The shape of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionShape {
    /// Sequences (`B`).
    pub batch: usize,
    /// Tokens per sequence (`S`), `1..=`[`MAX_SEQ`].
    pub seq: usize,
    /// Heads (`H`).
    pub heads: usize,
    /// Dimension of each head (`D`), one of [`SUPPORTED_HEAD_DIMS`].
    pub head_dim: usize,
}

impl AttentionShape {
    /// A shape of `batch` sequences of `seq` tokens, `heads` heads of `head_dim` (checked
    /// where it is used, or by [`check`](Self::check)).
    pub fn new(batch: usize, seq: usize, heads: usize, head_dim: usize) -> AttentionShape {
        AttentionShape {
            batch,
            seq,
            heads,
            head_dim,
        }
    }

    /// Checks the shape: every dimension at least 1, `head_dim` one of
    /// [`SUPPORTED_HEAD_DIMS`], `seq <= MAX_SEQ`, `batch * heads` within a grid's x
    /// dimension, and every buffer (`qkv`'s `T * 3d` elements the largest) within `i32`.
    pub fn check(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(format!("AttentionShape: {m}")));
        let AttentionShape {
            batch,
            seq,
            heads,
            head_dim,
        } = *self;
        for (name, v) in [("batch", batch), ("seq", seq), ("heads", heads)] {
            if v == 0 {
                return bad(format!("{name} must be at least 1"));
            }
        }
        if !SUPPORTED_HEAD_DIMS.contains(&head_dim) {
            return bad(format!(
                "head_dim = {head_dim} is not supported (one of {SUPPORTED_HEAD_DIMS:?})"
            ));
        }
        if seq > MAX_SEQ {
            return bad(format!("seq = {seq} is above the limit {MAX_SEQ}"));
        }
        let limit = i32::MAX as u128;
        let (b, s, h, d) = (batch as u128, seq as u128, heads as u128, head_dim as u128);
        if b * h > limit || b * s * 3 * h * d > limit {
            return bad(format!("{self:?} has a buffer above 2^31 elements"));
        }
        Ok(())
    }

    /// Rows `T = batch * seq`.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }

    /// Model width `d = heads * head_dim`.
    pub fn width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Elements of `qkv` and `dqkv`: `T * 3d`.
    pub fn qkv_len(&self) -> usize {
        self.tokens() * 3 * self.width()
    }

    /// Elements of `o` and `d_o`: `T * d`.
    pub fn o_len(&self) -> usize {
        self.tokens() * self.width()
    }

    /// Elements of `lse`: `B * H * S`.
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads * self.seq
    }

    /// The usual softmax scale `1 / sqrt(head_dim)`.
    pub fn default_scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// The three kernels of one head dimension, their tilings and dynamic shared memory.
#[derive(Debug, Clone)]
struct HeadKernels {
    forward: Kernel,
    dq: Kernel,
    dkdv: Kernel,
    /// [`tilings`] of the head dimension.
    tiling: [Tiling; 3],
    /// [`shared_bytes`] of the head dimension.
    shared: [u32; 3],
}

/// Causal self-attention's kernels, loaded once per context. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Attention {
    /// One entry per [`SUPPORTED_HEAD_DIMS`] entry, in that order.
    kernels: Arc<Vec<HeadKernels>>,
    _module: Module,
}

/// Checks that a buffer starts on a 16-byte boundary (the kernels load 16-byte vectors).
fn check_aligned<T: DeviceRepr>(what: &str, name: &str, b: &DeviceBuffer<T>) -> Result<()> {
    if b.as_raw() % 16 == 0 {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what}: {name} must start on a 16-byte boundary (it is at {:#x})",
            b.as_raw()
        )))
    }
}

/// Checks that an output does not overlap an input or another output.
fn check_apart<T: DeviceRepr, U: DeviceRepr>(
    what: &str,
    (an, a): (&str, &DeviceBuffer<T>),
    (bn, b): (&str, &DeviceBuffer<U>),
) -> Result<()> {
    if a.overlaps(b) {
        Err(Error::InvalidArgument(format!(
            "{what}: {an} and {bn} overlap"
        )))
    } else {
        Ok(())
    }
}

/// Checks the scale: finite and positive (the forward takes each row's maximum over the
/// unscaled scores).
fn check_scale(what: &str, scale: f32) -> Result<()> {
    if scale.is_finite() && scale > 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what}: scale = {scale} must be finite and positive"
        )))
    }
}

/// The shape's sizes as the kernels take them (checked to fit by [`AttentionShape::check`]).
fn u32_of(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl Attention {
    /// Loads the kernels into `ctx` (once per process and context: the module is shared).
    pub fn new(ctx: &Arc<Context>) -> Result<Attention> {
        let module = Module::embedded(ctx, FATBIN)?;
        let kernels = SUPPORTED_HEAD_DIMS
            .iter()
            .map(|&d| {
                let k = HeadKernels {
                    forward: module.kernel(&format!("attention_forward_d{d}"))?,
                    dq: module.kernel(&format!("attention_backward_dq_d{d}"))?,
                    dkdv: module.kernel(&format!("attention_backward_dkdv_d{d}"))?,
                    tiling: tilings(d),
                    shared: shared_bytes(d).map(u32_of),
                };
                for (kernel, bytes) in [&k.forward, &k.dq, &k.dkdv].iter().zip(shared_bytes(d)) {
                    kernel.set_max_dynamic_shared_memory(bytes)?;
                }
                Ok(k)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Attention {
            kernels: Arc::new(kernels),
            _module: module,
        })
    }

    /// Elements of f32 workspace [`backward`](Self::backward) needs: `delta` (`[B, H, S]`).
    pub fn backward_workspace_len(shape: AttentionShape) -> usize {
        shape.lse_len()
    }

    /// What both passes check and compute first: the shape, the scale, the lengths of
    /// `qkv`, `o` and `lse`; then the head dimension's kernels, `(seq, heads)` as the kernels
    /// take them and the scale in log2 units.
    fn prepare(
        &self,
        what: &str,
        shape: &AttentionShape,
        scale: f32,
        (qkv, o, lse): (&DeviceBuffer<bf16>, &DeviceBuffer<bf16>, &DeviceBuffer<f32>),
    ) -> Result<(&HeadKernels, u32, u32, f32)> {
        shape.check()?;
        check_scale(what, scale)?;
        check_len(what, "qkv", qkv.len(), shape.qkv_len())?;
        check_len(what, "o", o.len(), shape.o_len())?;
        check_len(what, "lse", lse.len(), shape.lse_len())?;
        let k = SUPPORTED_HEAD_DIMS
            .iter()
            .position(|&d| d == shape.head_dim)
            .map(|i| &self.kernels[i])
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{what}: head dim {} has no kernel", shape.head_dim))
            })?;
        let (seq, heads) = (u32_of(shape.seq), u32_of(shape.heads));
        Ok((k, seq, heads, scale * std::f32::consts::LOG2_E))
    }

    /// The launch of kernel `i` (0 forward, 1 dq, 2 dk/dv) of `k`: grid `(B * H, ceil(S /
    /// rows))`, its threads and dynamic shared memory.
    fn config(shape: &AttentionShape, k: &HeadKernels, i: usize) -> LaunchConfig {
        let t = k.tiling[i];
        LaunchConfig {
            grid: (
                u32_of(shape.batch * shape.heads),
                u32_of(shape.seq).div_ceil(t.rows()),
                1,
            ),
            block: (t.threads(), 1, 1),
            shared_mem_bytes: k.shared[i],
            attributes: Vec::new(),
        }
    }

    /// The forward: `o` (`[T, d]`) and `lse` (`[B, H, S]`) from `qkv` (`[T, 3d]`), softmax
    /// scale `scale` (finite and positive; normally [`AttentionShape::default_scale`]). One launch.
    ///
    /// Errors: [`Error::InvalidArgument`] (nothing launched) for a bad shape or scale, a
    /// length other than the shape's, a bf16 buffer not 16-byte aligned, or outputs that
    /// overlap `qkv` or each other; [`Error::Driver`] from the launch.
    pub fn forward(
        &self,
        stream: &Stream,
        shape: AttentionShape,
        scale: f32,
        qkv: &DeviceBuffer<bf16>,
        o: &DeviceBuffer<bf16>,
        lse: &DeviceBuffer<f32>,
    ) -> Result<()> {
        let what = "Attention::forward";
        let (k, seq, heads, scale_log2) = self.prepare(what, &shape, scale, (qkv, o, lse))?;
        check_aligned(what, "qkv", qkv)?;
        check_aligned(what, "o", o)?;
        check_apart(what, ("o", o), ("qkv", qkv))?;
        check_apart(what, ("lse", lse), ("qkv", qkv))?;
        check_apart(what, ("lse", lse), ("o", o))?;
        // SAFETY: attention_forward_d{D}(const bf16 *qkv, bf16 *o, float *lse, unsigned seq,
        // unsigned heads, float scale_log2) with D = shape.head_dim: block (bh, y), bh < B *
        // H, reads the q, k, v columns of head bh % H of rows s < S of sequence bh / H (qkv is
        // T * 3d, checked; rows past S are zero-filled, their source address clamped to the
        // sequence's first row) in 16-byte pieces (qkv 16-byte aligned, checked; d and D are
        // multiples of 8), and writes o's and lse's entries of its queries below S (T * d and
        // B * H * S, checked); o and lse overlap neither qkv nor each other. The dynamic
        // shared memory is shared_bytes(D)[0], the kernel's layout, allowed in `new`.
        unsafe {
            stream.launch_pdl(
                &k.forward,
                &Self::config(&shape, k, 0),
                &kernel_args![qkv, o, lse, seq, heads, scale_log2],
            )
        }
    }

    /// The backward: dq, dk and dv into `dqkv` (`[T, 3d]`, where q, k and v are in `qkv`)
    /// of a loss with gradient `d_o` (`[T, d]`) on the forward's output, from the forward's
    /// inputs and outputs (`qkv`, `o`, `lse`, the same `scale`). `workspace` holds at least
    /// [`backward_workspace_len`](Self::backward_workspace_len) f32 (its contents are
    /// overwritten). Two launches.
    ///
    /// Errors: [`Error::InvalidArgument`] (nothing launched) for a bad shape or scale, a
    /// length other than the shape's (the workspace: shorter than it needs), a bf16 buffer
    /// not 16-byte aligned, or `dqkv` or `workspace` overlapping any other buffer;
    /// [`Error::Driver`] from the launches.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        stream: &Stream,
        shape: AttentionShape,
        scale: f32,
        qkv: &DeviceBuffer<bf16>,
        o: &DeviceBuffer<bf16>,
        lse: &DeviceBuffer<f32>,
        d_o: &DeviceBuffer<bf16>,
        dqkv: &DeviceBuffer<bf16>,
        workspace: &DeviceBuffer<f32>,
    ) -> Result<()> {
        let what = "Attention::backward";
        let (k, seq, heads, scale_log2) = self.prepare(what, &shape, scale, (qkv, o, lse))?;
        check_len(what, "d_o", d_o.len(), shape.o_len())?;
        check_len(what, "dqkv", dqkv.len(), shape.qkv_len())?;
        let ws_len = Self::backward_workspace_len(shape);
        if workspace.len() < ws_len {
            return Err(Error::InvalidArgument(format!(
                "{what}: workspace has {} elements, the shape needs at least {ws_len}",
                workspace.len()
            )));
        }
        let delta = workspace.slice(..ws_len)?;
        for (name, b) in [("qkv", qkv), ("o", o), ("d_o", d_o), ("dqkv", dqkv)] {
            check_aligned(what, name, b)?;
        }
        for (name, b) in [("qkv", qkv), ("o", o), ("d_o", d_o)] {
            check_apart(what, ("dqkv", dqkv), (name, b))?;
            check_apart(what, ("workspace", &delta), (name, b))?;
        }
        check_apart(what, ("dqkv", dqkv), ("lse", lse))?;
        check_apart(what, ("workspace", &delta), ("lse", lse))?;
        check_apart(what, ("workspace", &delta), ("dqkv", dqkv))?;
        // SAFETY: attention_backward_dq_d{D}(const bf16 *qkv, const bf16 *o, const float
        // *lse, const bf16 *d_o, bf16 *dqkv, float *delta, unsigned seq, unsigned heads,
        // float scale, float scale_log2): block (bh, y) reads head bh % H's columns of rows s
        // < S of sequence bh / H in qkv (T * 3d), o and d_o (T * d), in 16-byte pieces (all
        // 16-byte aligned, checked), and their lse entries (B * H * S), all lengths checked;
        // it writes the dq columns of its queries below S in dqkv (T * 3d) and their delta
        // entries (B * H * S, the workspace's first part). The outputs overlap no input and
        // not each other (checked). Dynamic shared memory: shared_bytes(D)[1], allowed in
        // `new`.
        unsafe {
            stream.launch_pdl(
                &k.dq,
                &Self::config(&shape, k, 1),
                &kernel_args![qkv, o, lse, d_o, dqkv, delta, seq, heads, scale, scale_log2],
            )
        }?;
        // SAFETY: attention_backward_dkdv_d{D}(const bf16 *qkv, const float *lse, const bf16
        // *d_o, bf16 *dqkv, const float *delta, unsigned seq, unsigned heads, float scale,
        // float scale_log2): as above (shared_bytes(D)[2] of shared memory), reading delta
        // (written by the launch before, which its PDL wait orders) and writing the dk and dv
        // columns of its keys below S in dqkv.
        unsafe {
            stream.launch_pdl(
                &k.dkdv,
                &Self::config(&shape, k, 2),
                &kernel_args![qkv, lse, d_o, dqkv, delta, seq, heads, scale, scale_log2],
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_checked() {
        for d in SUPPORTED_HEAD_DIMS {
            AttentionShape::new(16, 256, 8, d).check().unwrap();
        }
        AttentionShape::new(1, 1, 1, 64).check().unwrap();
        AttentionShape::new(1, MAX_SEQ, 1, 64).check().unwrap();
        for bad in [
            AttentionShape::new(0, 256, 8, 64),
            AttentionShape::new(16, 0, 8, 64),
            AttentionShape::new(16, 256, 0, 64),
            AttentionShape::new(16, 256, 8, 0),
            AttentionShape::new(16, 256, 8, 48),
            AttentionShape::new(16, 256, 8, 256),
            AttentionShape::new(1, MAX_SEQ + 1, 1, 64),
            AttentionShape::new(1 << 16, 1 << 10, 8, 64),
        ] {
            let e = bad.check().unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument(ref m) if m.starts_with("AttentionShape")),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn sizes_follow_the_layout() {
        let s = AttentionShape::new(16, 256, 8, 64);
        assert_eq!(s.tokens(), 4096);
        assert_eq!(s.width(), 512);
        assert_eq!(s.qkv_len(), 4096 * 1536);
        assert_eq!(s.o_len(), 4096 * 512);
        assert_eq!(s.lse_len(), 16 * 8 * 256);
        assert_eq!(Attention::backward_workspace_len(s), 16 * 8 * 256);
        assert_eq!(s.default_scale(), 0.125);
    }

    #[test]
    fn grid_covers_every_row() {
        for d in SUPPORTED_HEAD_DIMS {
            for t in tilings(d) {
                let rows = t.rows() as usize;
                assert!((64..=128).contains(&rows), "{t:?}");
                assert!(MAX_SEQ.div_ceil(rows) <= 65535, "{t:?}");
            }
        }
        // The train job's shape: 128 queries a forward block, 64 rows a backward block.
        assert_eq!(tilings(64).map(|t| t.rows()), [128, 64, 64]);
    }

    #[test]
    fn tilings_fit_the_kernels() {
        for d in SUPPORTED_HEAD_DIMS {
            let [f, q, k] = tilings(d);
            for t in [f, q, k] {
                // Each n-tile pair of the products, the 16-byte loads, at most 128 threads.
                assert!(t.n >= 16 && t.n % 16 == 0 && t.threads() <= 128, "{t:?}");
            }
            // The dq kernel's delta: one or two threads a query.
            assert!(
                q.threads() == q.rows() || q.threads() == 2 * q.rows(),
                "{q:?}"
            );
            // sm_89 allows 99 KiB of dynamic shared memory per block (sm_80: 163 KiB, sm_90:
            // 227 KiB).
            for bytes in shared_bytes(d) {
                assert!(bytes <= 99 * 1024, "head_dim {d}: {bytes} bytes");
                assert_eq!(bytes % 16, 0);
            }
        }
    }
}
