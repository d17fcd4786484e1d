//! The model's elementwise and reduction kernels around its GEMMs, attention and MoE layers,
//! with their backward passes: [`Ops`] (kernels in `src/kernels/model_ops.cu`, f64 host
//! models in [`super::ops_reference`]).
//!
//! * the byte embedding: [`Ops::embedding_forward`], [`Ops::embedding_backward`];
//! * RMSNorm: [`Ops::rmsnorm_forward`], [`Ops::rmsnorm_backward`] (input gradient with the
//!   residual gradient added, weight gradient);
//! * the residual add [`Ops::add`];
//! * the loss: [`Ops::cross_entropy`] (forward and logits gradient fused), [`Ops::sum`];
//! * gradient-norm clipping: [`Ops::grad_norm_clip`] (PyTorch's `clip_grad_norm_` factor,
//!   left in device memory for the optimizer).
//!
//! # Conventions
//! Activations are bf16, row-major `[rows, cols]`; the kernels compute in f32 and round once
//! on store (to nearest even). Every launcher only enqueues (no synchronisation, no
//! allocation), so all of them can be captured into CUDA graphs; each checks every length
//! and overlap first and returns [`Error::InvalidArgument`] with nothing enqueued when one is
//! wrong. Every floating-point sum has a fixed order that depends only on the shape and on
//! whether the buffers allow the 16-byte vector path (no floating-point atomics), so two
//! runs, and an eager run and a graph replay, give the same bits.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use cuda_graph::{Context, DeviceBuffer, Stream, half::bf16};
//! # use fp8_moe::model::ops::Ops;
//! # fn main() -> cuda_graph::Result<()> {
//! let ctx = Context::default_device()?;
//! let stream = Stream::new(&ctx)?;
//! let ops = Ops::new(&ctx)?;
//! let (rows, cols) = (4096, 512);
//! let x = DeviceBuffer::<bf16>::alloc(&ctx, rows * cols)?;
//! let w = DeviceBuffer::from_host(&stream, &vec![1.0f32; cols])?;
//! let y = DeviceBuffer::<bf16>::alloc(&ctx, rows * cols)?;
//! let rstd = DeviceBuffer::<f32>::alloc(&ctx, rows)?;
//! ops.rmsnorm_forward(&stream, &x, &w, &y, &rstd, 1e-5)?;
//! # Ok(()) }
//! ```

use std::sync::Arc;

use cuda_graph::half::bf16;
use cuda_graph::{
    Context, DeviceBuffer, DeviceRepr, Error, Kernel, KernelArgs, LaunchConfig, Module, Result,
    Stream,
};
use fp8_kernels::HpBuffer;

/// The kernels, built from `src/kernels/model_ops.cu`.
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/model_ops.fatbin"));

/// Threads per block of the row and elementwise kernels (`OPS_BLOCK`).
const BLOCK: u32 = 256;
/// Rows per block of the warp-per-row kernels (`OPS_WARPS`).
const ROWS_PER_BLOCK: usize = BLOCK as usize / 32;
/// Threads of the single-block reductions (`OPS_REDUCE_BLOCK`).
const REDUCE_BLOCK: u32 = 1024;
/// Threads per block of the embedding backward (`EMB_THREADS`).
const EMB_THREADS: u32 = 512;
/// The most column groups per embedding-backward block (`EMB_GROUPS`).
const EMB_GROUPS: usize = 32;
/// Rows per chunk of RMSNorm's weight gradient: one workspace row each (`RMS_CHUNK_ROWS`).
const RMS_CHUNK_ROWS: usize = 32;
/// The most column groups per weight-gradient block (`RMS_GROUPS`).
const RMS_GROUPS: usize = 64;
/// Threads of the weight-gradient reduce: 32 columns x 8 chunk lanes (`RMS_REDUCE_LANES`).
const RMS_REDUCE_THREADS: u32 = 32 * 8;
/// Tensors per gradient-norm launch (`GN_SLOTS`).
const GN_SLOTS: usize = 16;
/// Elements per block the gradient norm aims at (64 KiB of f32).
const GN_ELEMS: usize = 16 * 1024;
/// The most blocks (partial sums) per tensor of the gradient norm.
const GN_MAX_BLOCKS: usize = 1024;
/// The most elements of any buffer: the kernels count rows and columns in 32 bits.
const MAX_ELEMS: usize = i32::MAX as usize;

/// Elements of the workspace [`Ops::rmsnorm_backward`] needs for `rows x cols`: one row of
/// partial weight-gradient sums per 32 rows.
pub fn rmsnorm_backward_workspace_len(rows: usize, cols: usize) -> usize {
    rows.div_ceil(RMS_CHUNK_ROWS) * cols
}

/// Elements of the workspace [`Ops::grad_norm_clip`] needs for tensors of these lengths: one
/// partial sum per block, about one block per 16 Ki elements (at most 1024 per tensor, none
/// for an empty one).
pub fn grad_norm_workspace_len(tensor_lens: &[usize]) -> usize {
    tensor_lens.iter().map(|&n| gn_layout(n).0).sum()
}

/// The gradient norm's split of an `n`-element tensor: (blocks, elements per block), the
/// elements per block a multiple of 8 (so every block's range starts 16-byte aligned when the
/// tensor does) and no block empty.
fn gn_layout(n: usize) -> (usize, usize) {
    if n == 0 {
        return (0, 0);
    }
    let aim = n.div_ceil(GN_ELEMS).clamp(1, GN_MAX_BLOCKS);
    let per = n.div_ceil(aim).next_multiple_of(8);
    (n.div_ceil(per), per)
}

/// Column groups per block (a power of two, at most `cap`) for `pieces` groups of columns.
fn column_groups(pieces: usize, cap: usize) -> usize {
    pieces.next_power_of_two().min(cap)
}

/// Whether a device address is 16-byte aligned.
fn aligned16<T: DeviceRepr>(b: &DeviceBuffer<T>) -> bool {
    b.as_raw() % 16 == 0
}

/// A buffer's device memory, for the overlap checks.
#[derive(Debug, Clone, Copy)]
struct Span {
    name: &'static str,
    start: u64,
    end: u64,
}

impl Span {
    fn of<T: DeviceRepr>(name: &'static str, b: &DeviceBuffer<T>) -> Span {
        Span {
            name,
            start: b.as_raw(),
            end: b.as_raw() + b.bytes() as u64,
        }
    }

    fn overlaps(&self, o: &Span) -> bool {
        self.start < o.end && o.start < self.end
    }
}

/// Checks that no output overlaps another output or an input.
fn check_disjoint(what: &str, outputs: &[Span], inputs: &[Span]) -> Result<()> {
    for (i, o) in outputs.iter().enumerate() {
        for x in outputs[i + 1..].iter().chain(inputs) {
            if o.overlaps(x) {
                return Err(Error::InvalidArgument(format!(
                    "{what}: {} ({:#x}..{:#x}) overlaps {} ({:#x}..{:#x})",
                    o.name, o.start, o.end, x.name, x.start, x.end
                )));
            }
        }
    }
    Ok(())
}

/// Checks one buffer's length.
pub(crate) fn check_len(what: &str, name: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what}: {name} has {got} elements, the shape needs {want}"
        )))
    }
}

/// Checks that a count fits the kernels' 32-bit indices and returns it as u32.
fn check_count(what: &str, name: &str, n: usize) -> Result<u32> {
    if n <= MAX_ELEMS {
        Ok(n as u32)
    } else {
        Err(Error::InvalidArgument(format!(
            "{what}: {name} = {n} exceeds {MAX_ELEMS} (the kernels index in 32 bits)"
        )))
    }
}

/// `rows x cols` from a buffer of `len` elements with `rows` given: cols = len / rows, which
/// must divide exactly and be at least 1.
fn cols_of(what: &str, name: &str, len: usize, rows: usize, rows_name: &str) -> Result<usize> {
    if rows == 0 {
        return Err(Error::InvalidArgument(format!(
            "{what}: {rows_name} is empty"
        )));
    }
    if len == 0 || len % rows != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what}: {name} has {len} elements, not a positive multiple of the {rows} {rows_name}"
        )));
    }
    Ok(len / rows)
}

/// Checks `rows x cols` (both at least 1, the product within the kernels' 32-bit indices)
/// and returns the product.
fn check_rows_cols(what: &str, rows: usize, cols: usize) -> Result<usize> {
    if rows == 0 || cols == 0 {
        return Err(Error::InvalidArgument(format!(
            "{what}: {rows} rows x {cols} columns: both must be at least 1"
        )));
    }
    check_count(what, "rows x cols", rows.saturating_mul(cols)).map(|_| rows * cols)
}

/// The model-ops kernels of one context. Cheap to clone (shared handles); share one per
/// context (`Arc<Ops>` or clones).
#[derive(Debug, Clone)]
pub struct Ops {
    ctx: Arc<Context>,
    k: Arc<Kernels>,
}

#[derive(Debug)]
struct Kernels {
    embedding_forward: Kernel,
    embedding_backward: Kernel,
    rmsnorm_forward: Kernel,
    rmsnorm_backward: Kernel,
    rmsnorm_dw_reduce: Kernel,
    add: Kernel,
    cross_entropy: Kernel,
    sum: Kernel,
    grad_sq_partial: Kernel,
    grad_norm_final: Kernel,
    _module: Module,
}

impl Ops {
    /// Loads the kernels into `ctx` (once per process and context: the module is shared).
    pub fn new(ctx: &Arc<Context>) -> Result<Ops> {
        let module = Module::embedded(ctx, FATBIN)?;
        let k = Kernels {
            embedding_forward: module.kernel("ops_embedding_forward")?,
            embedding_backward: module.kernel("ops_embedding_backward")?,
            rmsnorm_forward: module.kernel("ops_rmsnorm_forward")?,
            rmsnorm_backward: module.kernel("ops_rmsnorm_backward")?,
            rmsnorm_dw_reduce: module.kernel("ops_rmsnorm_dw_reduce")?,
            add: module.kernel("ops_add")?,
            cross_entropy: module.kernel("ops_cross_entropy")?,
            sum: module.kernel("ops_sum")?,
            grad_sq_partial: module.kernel("ops_grad_sq_partial")?,
            grad_norm_final: module.kernel("ops_grad_norm_final")?,
            _module: module,
        };
        Ok(Ops {
            ctx: ctx.clone(),
            k: Arc::new(k),
        })
    }

    /// The context the kernels were loaded into.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    fn check_stream(&self, what: &str, stream: &Stream) -> Result<()> {
        if stream.context().as_raw() == self.ctx.as_raw() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "{what}: the stream belongs to another context than these kernels"
            )))
        }
    }

    /// `out[t, :] = bf16(table[tokens[t], :])`: `tokens` `[T]`, `table` `[vocab, d]` f32,
    /// `out` `[T, d]`. A token outside `0..vocab` writes a row of zeros (the train job's
    /// tokens are bytes, never outside). One launch.
    pub fn embedding_forward(
        &self,
        stream: &Stream,
        tokens: &DeviceBuffer<i32>,
        table: &DeviceBuffer<f32>,
        out: &DeviceBuffer<bf16>,
        vocab: usize,
    ) -> Result<()> {
        let what = "Ops::embedding_forward";
        self.check_stream(what, stream)?;
        let d = cols_of(what, "table", table.len(), vocab, "vocab")?;
        let t = tokens.len();
        check_len(what, "out", out.len(), t * d)?;
        check_count(what, "table", table.len())?;
        check_count(what, "out", out.len())?;
        check_disjoint(
            what,
            &[Span::of("out", out)],
            &[Span::of("tokens", tokens), Span::of("table", table)],
        )?;
        if t == 0 {
            return Ok(());
        }
        let vec = d % 8 == 0 && aligned16(table) && aligned16(out);
        let w = if vec { 8 } else { 1 };
        let pieces = t * (d / w);
        let (t32, d32, v32, vec32) = (t as u32, d as u32, vocab as u32, u32::from(vec));
        let args = KernelArgs::new()
            .arg(tokens)
            .arg(table)
            .arg(out)
            .arg(&t32)
            .arg(&d32)
            .arg(&v32)
            .arg(&vec32);
        // SAFETY: thread p < T * d / W reads tokens[p / (d / W)] (T checked) and, for a token
        // below vocab, table's W elements at token * d + c (vocab * d checked), and writes
        // out's W elements at t * d + c (T * d checked); W = 8 only when d % 8 == 0 and table
        // and out are 16-byte aligned (so every row start is).
        unsafe {
            stream.launch_pdl(
                &self.k.embedding_forward,
                &LaunchConfig::linear(pieces.div_ceil(BLOCK as usize) as u32, BLOCK),
                &args,
            )
        }
    }

    /// `dtable[v, :] (+)= sum over t with tokens[t] == v of dout[t, :]` (f32; added to
    /// `dtable` when `accumulate`, else every element of `dtable` is written, rows no token
    /// selects with 0): `tokens` `[T]` (T >= 1), `dout` `[T, d]`, `dtable` `[vocab, d]`.
    /// Tokens outside `0..vocab` add nothing.
    ///
    /// Deterministic without atomics: one block per (row v, slice of columns) scans all the
    /// tokens in order and adds the selected rows of `dout`: in increasing `t` within each of
    /// a few interleaved lanes (the selected rows' ranks modulo the lane count), then the
    /// lanes in order. Each block reads all of `tokens`, which suits the byte vocabulary
    /// (256) of the train job, not vocabularies of tens of thousands. One launch.
    pub fn embedding_backward(
        &self,
        stream: &Stream,
        tokens: &DeviceBuffer<i32>,
        dout: &DeviceBuffer<bf16>,
        dtable: &DeviceBuffer<f32>,
        accumulate: bool,
    ) -> Result<()> {
        let what = "Ops::embedding_backward";
        self.check_stream(what, stream)?;
        let t = tokens.len();
        let d = cols_of(what, "dout", dout.len(), t, "tokens")?;
        let vocab = cols_of(what, "dtable", dtable.len(), d, "columns of dout")?;
        check_count(what, "dout", dout.len())?;
        check_count(what, "dtable", dtable.len())?;
        check_disjoint(
            what,
            &[Span::of("dtable", dtable)],
            &[Span::of("tokens", tokens), Span::of("dout", dout)],
        )?;
        let vec = d % 8 == 0 && aligned16(dout);
        let pieces = if vec { d / 8 } else { d };
        let slices = pieces.div_ceil(column_groups(pieces, EMB_GROUPS));
        if slices > u16::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "{what}: {d} columns are more than the kernel's grid takes"
            )));
        }
        let (t32, d32) = (t as u32, d as u32);
        let (acc, vec32) = (u32::from(accumulate), u32::from(vec));
        let cfg = LaunchConfig {
            grid: (vocab as u32, slices as u32, 1),
            block: (EMB_THREADS, 1, 1),
            shared_mem_bytes: 0,
            attributes: Vec::new(),
        };
        let args = KernelArgs::new()
            .arg(tokens)
            .arg(dout)
            .arg(dtable)
            .arg(&t32)
            .arg(&d32)
            .arg(&acc)
            .arg(&vec32);
        // SAFETY: block (v, s) reads all T tokens (T checked) and dout's rows t < T at columns
        // below d (T * d checked; the column groups past d are idle), and writes dtable's row
        // v < vocab at columns below d (vocab * d checked); W = 8 only when d % 8 == 0 and dout
        // is 16-byte aligned; the shared memory is static.
        unsafe { stream.launch_pdl(&self.k.embedding_backward, &cfg, &args) }
    }

    /// RMSNorm: `rstd[t] = 1 / sqrt(mean_c(x[t, c]^2) + eps)`, `y = bf16(x * rstd * w)`:
    /// `x`, `y` `[rows, cols]`, `w` `[cols]` f32, `rstd` `[rows]` (rows = `rstd.len()`, cols =
    /// `w.len()`, both at least 1). `y` must not overlap `x`. One launch, a warp per row.
    pub fn rmsnorm_forward(
        &self,
        stream: &Stream,
        x: &DeviceBuffer<bf16>,
        w: &DeviceBuffer<f32>,
        y: &DeviceBuffer<bf16>,
        rstd: &DeviceBuffer<f32>,
        eps: f32,
    ) -> Result<()> {
        let what = "Ops::rmsnorm_forward";
        self.check_stream(what, stream)?;
        let (rows, cols) = (rstd.len(), w.len());
        let n = check_rows_cols(what, rows, cols)?;
        check_len(what, "x", x.len(), n)?;
        check_len(what, "y", y.len(), n)?;
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "{what}: eps = {eps} must be finite and not negative"
            )));
        }
        check_disjoint(
            what,
            &[Span::of("y", y), Span::of("rstd", rstd)],
            &[Span::of("x", x), Span::of("w", w)],
        )?;
        let vec = cols % 8 == 0 && aligned16(x) && aligned16(w) && aligned16(y);
        let (r32, c32, vec32) = (rows as u32, cols as u32, u32::from(vec));
        let args = KernelArgs::new()
            .arg(x)
            .arg(w)
            .arg(y)
            .arg(rstd)
            .arg(&r32)
            .arg(&c32)
            .arg(&eps)
            .arg(&vec32);
        // SAFETY: warp r < rows of the grid reads x's row r and w (rows * cols, cols checked)
        // and writes y's row r and rstd[r] (rows * cols, rows checked); the 16-byte accesses
        // only when cols % 8 == 0 and x, w, y are 16-byte aligned.
        unsafe {
            stream.launch_pdl(
                &self.k.rmsnorm_forward,
                &LaunchConfig::linear(rows.div_ceil(ROWS_PER_BLOCK) as u32, BLOCK),
                &args,
            )
        }
    }

    /// RMSNorm's backward from the forward's `x`, `w`, `rstd` and the output gradient `dy`:
    /// with `xhat = x * rstd` and `g = dy * w`,
    /// `dx = bf16(residual_grad + rstd * (g - xhat * mean_c(g * xhat)))` (`residual_grad`
    /// absent counts as 0) and `dw (+)= sum_t dy * xhat` (added to `dw` when
    /// `accumulate_dw`). Shapes as [`rmsnorm_forward`](Self::rmsnorm_forward); `workspace`
    /// holds at least [`rmsnorm_backward_workspace_len`]`(rows, cols)` f32.
    ///
    /// `dx` may be the same buffer as `residual_grad` (each element is read, then written,
    /// by one thread); otherwise no output may overlap another buffer. The weight gradient is
    /// summed in a fixed order: per chunk of 32 rows (in a few interleaved row lanes, then
    /// the lanes in order) into `workspace`, then the chunks in a fixed interleaving of 8.
    /// Two launches (the input gradient and the weight gradient's partial sums share the
    /// first).
    #[allow(clippy::too_many_arguments)] // the forward's buffers, the gradients, the workspace
    pub fn rmsnorm_backward(
        &self,
        stream: &Stream,
        x: &DeviceBuffer<bf16>,
        w: &DeviceBuffer<f32>,
        rstd: &DeviceBuffer<f32>,
        dy: &DeviceBuffer<bf16>,
        residual_grad: Option<&DeviceBuffer<bf16>>,
        dx: &DeviceBuffer<bf16>,
        dw: &DeviceBuffer<f32>,
        accumulate_dw: bool,
        workspace: &DeviceBuffer<f32>,
    ) -> Result<()> {
        let what = "Ops::rmsnorm_backward";
        self.check_stream(what, stream)?;
        let (rows, cols) = (rstd.len(), w.len());
        let n = check_rows_cols(what, rows, cols)?;
        check_len(what, "x", x.len(), n)?;
        check_len(what, "dy", dy.len(), n)?;
        check_len(what, "dx", dx.len(), n)?;
        check_len(what, "dw", dw.len(), cols)?;
        if let Some(r) = residual_grad {
            check_len(what, "residual_grad", r.len(), n)?;
        }
        let ws_len = rmsnorm_backward_workspace_len(rows, cols);
        if workspace.len() < ws_len {
            return Err(Error::InvalidArgument(format!(
                "{what}: workspace has {} elements, {rows} x {cols} needs {ws_len}",
                workspace.len()
            )));
        }
        check_count(what, "workspace", ws_len)?;
        let workspace = workspace.slice(..ws_len)?;
        let mut inputs = vec![
            Span::of("x", x),
            Span::of("w", w),
            Span::of("rstd", rstd),
            Span::of("dy", dy),
        ];
        if let Some(r) = residual_grad.filter(|r| !r.same_memory(dx)) {
            inputs.push(Span::of("residual_grad", r));
        }
        check_disjoint(
            what,
            &[
                Span::of("dx", dx),
                Span::of("dw", dw),
                Span::of("workspace", &workspace),
            ],
            &inputs,
        )?;
        let vec = cols % 8 == 0
            && aligned16(x)
            && aligned16(dy)
            && aligned16(dx)
            && aligned16(w)
            && residual_grad.is_none_or(aligned16);
        let pieces = if vec { cols / 8 } else { cols };
        let slices = pieces.div_ceil(column_groups(pieces, RMS_GROUPS));
        let chunks = rows.div_ceil(RMS_CHUNK_ROWS);
        let dx_blocks = rows.div_ceil(ROWS_PER_BLOCK);
        let grid = dx_blocks + chunks * slices;
        let grid32 = check_count(what, "the grid", grid)?;
        let (r32, c32, dxb32, chunks32) =
            (rows as u32, cols as u32, dx_blocks as u32, chunks as u32);
        let (has_res, vec32) = (u32::from(residual_grad.is_some()), u32::from(vec));
        // Absent, the kernel reads no residual: any valid pointer fills the argument.
        let res = residual_grad.unwrap_or(dy);
        let args = KernelArgs::new()
            .arg(x)
            .arg(w)
            .arg(rstd)
            .arg(dy)
            .arg(res)
            .arg(dx)
            .arg(&workspace)
            .arg(&r32)
            .arg(&c32)
            .arg(&has_res)
            .arg(&dxb32)
            .arg(&vec32);
        // SAFETY: blocks below dx_blocks: warp r < rows reads rows r of x, dy and (has_res)
        // residual_grad, rstd[r] and w, and writes dx's row r (all rows * cols / rows / cols
        // checked; dx and residual_grad are the same buffer or disjoint, and each element is
        // read by the thread that then writes it). The others: block b reads x, dy at rows of
        // chunk b / slices (< rows) and columns below cols, rstd at those rows, and writes
        // workspace[chunk * cols + col] (ceil(rows / 32) * cols checked); static shared
        // memory. The 16-byte accesses only when cols % 8 == 0 and x, w, dy, dx and the
        // residual are 16-byte aligned.
        unsafe {
            stream.launch_pdl(
                &self.k.rmsnorm_backward,
                &LaunchConfig::linear(grid32, BLOCK),
                &args,
            )
        }?;
        let acc = u32::from(accumulate_dw);
        let args = KernelArgs::new()
            .arg(&workspace)
            .arg(dw)
            .arg(&c32)
            .arg(&chunks32)
            .arg(&acc);
        // SAFETY: thread (column col < cols, lane l) reads workspace[c * cols + col] for
        // chunks c < ceil(rows / 32) (checked) and lane 0 reads/writes dw[col] (cols checked).
        unsafe {
            stream.launch_pdl(
                &self.k.rmsnorm_dw_reduce,
                &LaunchConfig::linear(cols.div_ceil(32) as u32, RMS_REDUCE_THREADS),
                &args,
            )
        }
    }

    /// `out = bf16(a + b)` elementwise (f32 sum), all three of one length. `out` may be `a`
    /// or `b` (the same buffer) but must not overlap them otherwise. One launch.
    pub fn add(
        &self,
        stream: &Stream,
        a: &DeviceBuffer<bf16>,
        b: &DeviceBuffer<bf16>,
        out: &DeviceBuffer<bf16>,
    ) -> Result<()> {
        let what = "Ops::add";
        self.check_stream(what, stream)?;
        let n = a.len();
        check_len(what, "b", b.len(), n)?;
        check_len(what, "out", out.len(), n)?;
        let n32 = check_count(what, "a", n)?;
        let inputs: Vec<Span> = [("a", a), ("b", b)]
            .into_iter()
            .filter(|(_, x)| !x.same_memory(out))
            .map(|(name, x)| Span::of(name, x))
            .collect();
        check_disjoint(what, &[Span::of("out", out)], &inputs)?;
        if n == 0 {
            return Ok(());
        }
        let vec = u32::from(aligned16(a) && aligned16(b) && aligned16(out));
        let args = KernelArgs::new().arg(a).arg(b).arg(out).arg(&n32).arg(&vec);
        // SAFETY: thread p touches elements [8p, min(n, 8p + 8)) of a, b and out (n each,
        // checked), reading each before writing it (out is a, b or disjoint from both); the
        // 16-byte accesses only for whole pieces when all three are 16-byte aligned.
        unsafe {
            stream.launch_pdl(
                &self.k.add,
                &LaunchConfig::linear(n.div_ceil(8 * BLOCK as usize) as u32, BLOCK),
                &args,
            )
        }
    }

    /// Cross-entropy forward and backward in one pass over `logits` (`[T, V]` f32, T =
    /// `targets.len()` >= 1): `loss_rows[t] = logsumexp(logits[t]) - logits[t, targets[t]]`
    /// (f32, max-subtracted) and `dlogits = bf16((softmax(logits[t]) - onehot(targets[t])) *
    /// grad_scale)` (`[T, V]`). A negative target marks a row to ignore (PyTorch's
    /// `ignore_index`): loss and gradient 0. A target `>= V` is a data error: that row's loss
    /// and gradient are NaN, so it shows in the loss. One launch, a warp per row.
    pub fn cross_entropy(
        &self,
        stream: &Stream,
        logits: &DeviceBuffer<f32>,
        targets: &DeviceBuffer<i32>,
        grad_scale: f32,
        loss_rows: &DeviceBuffer<f32>,
        dlogits: &DeviceBuffer<bf16>,
    ) -> Result<()> {
        let what = "Ops::cross_entropy";
        self.check_stream(what, stream)?;
        let t = targets.len();
        let v = cols_of(what, "logits", logits.len(), t, "targets")?;
        check_len(what, "loss_rows", loss_rows.len(), t)?;
        check_len(what, "dlogits", dlogits.len(), logits.len())?;
        check_count(what, "logits", logits.len())?;
        if !grad_scale.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "{what}: grad_scale = {grad_scale} must be finite"
            )));
        }
        check_disjoint(
            what,
            &[
                Span::of("loss_rows", loss_rows),
                Span::of("dlogits", dlogits),
            ],
            &[Span::of("logits", logits), Span::of("targets", targets)],
        )?;
        let vec = v % 4 == 0 && aligned16(logits) && dlogits.as_raw() % 8 == 0;
        let (t32, v32, vec32) = (t as u32, v as u32, u32::from(vec));
        let args = KernelArgs::new()
            .arg(logits)
            .arg(targets)
            .arg(&grad_scale)
            .arg(loss_rows)
            .arg(dlogits)
            .arg(&t32)
            .arg(&v32)
            .arg(&vec32);
        // SAFETY: warp r < T reads targets[r] and logits' row r (T * V checked; the target
        // element only when inside 0..V), writes loss_rows[r] and dlogits' row r (T, T * V
        // checked); 16-byte loads and 8-byte stores only when V % 4 == 0, logits is 16-byte
        // and dlogits 8-byte aligned.
        unsafe {
            stream.launch_pdl(
                &self.k.cross_entropy,
                &LaunchConfig::linear(t.div_ceil(ROWS_PER_BLOCK) as u32, BLOCK),
                &args,
            )
        }
    }

    /// `out[index] (+)= sum(values)`: one block sums in f64 in a fixed order (strided over
    /// 1024 threads, then a fixed tree), then rounds once to f32 (with `accumulate` the old
    /// value is added in f64 before that rounding). An empty `values` sums to 0. One launch.
    pub fn sum(
        &self,
        stream: &Stream,
        values: &DeviceBuffer<f32>,
        out: &DeviceBuffer<f32>,
        index: usize,
        accumulate: bool,
    ) -> Result<()> {
        let what = "Ops::sum";
        self.check_stream(what, stream)?;
        if index >= out.len() {
            return Err(Error::InvalidArgument(format!(
                "{what}: index {index} is outside out's {} elements",
                out.len()
            )));
        }
        let n32 = check_count(what, "values", values.len())?;
        let i32_ = check_count(what, "index", index)?;
        let target = out.slice(index..index + 1)?;
        check_disjoint(
            what,
            &[Span::of("out[index]", &target)],
            &[Span::of("values", values)],
        )?;
        let (acc, vec) = (u32::from(accumulate), u32::from(aligned16(values)));
        let args = KernelArgs::new()
            .arg(values)
            .arg(out)
            .arg(&n32)
            .arg(&i32_)
            .arg(&acc)
            .arg(&vec);
        // SAFETY: one block reads values[0..n) (float4 pieces only when 16-byte aligned) and
        // thread 0 reads/writes out[index] (index < out.len() checked).
        unsafe { stream.launch_pdl(&self.k.sum, &LaunchConfig::linear(1, REDUCE_BLOCK), &args) }
    }

    /// Gradient-norm clipping with PyTorch's `clip_grad_norm_` semantics, left in device
    /// memory: `out[0]` = the L2 norm of all of `grads` together (f32, f16 or bf16 tensors;
    /// squares summed in f64: per block of about 16 Ki elements into `workspace`, rounded to
    /// f32, then one fixed-order f64 sum), `out[1]` = `min(1, max_norm / (norm + 1e-6))` in
    /// f32, the factor to multiply the gradients by (`fp8_kernels::AdamWState::update`'s
    /// `grad_scale` is `DeviceScalar::at(out, 1)`). A NaN norm gives a NaN factor (PyTorch's
    /// `clamp` propagates it: a NaN gradient shows in the update, not hidden), an infinite
    /// norm a factor of 0. `out` has at least 2 elements, `workspace` at least
    /// [`grad_norm_workspace_len`] of the tensors' lengths; `max_norm` is finite and
    /// positive. One launch per 16 non-empty tensors plus one; no tensor (or only empty ones)
    /// gives norm 0, factor 1.
    pub fn grad_norm_clip(
        &self,
        stream: &Stream,
        grads: &[HpBuffer<'_>],
        workspace: &DeviceBuffer<f32>,
        max_norm: f32,
        out: &DeviceBuffer<f32>,
    ) -> Result<()> {
        let what = "Ops::grad_norm_clip";
        self.check_norm_args(what, max_norm, out)?;
        // Everything checked before the first launch.
        let out2 = out.slice(..2)?;
        grads_clear_of(what, &[Span::of("out", &out2)], grads)?;
        let parts = grad_norm_workspace_len(&grads.iter().map(|g| g.len()).collect::<Vec<_>>());
        if workspace.len() >= parts {
            check_disjoint(
                what,
                &[
                    Span::of("workspace", &workspace.slice(..parts)?),
                    Span::of("out", &out2),
                ],
                &[],
            )?;
        }
        let parts = self.grad_norm_partials(stream, grads, workspace)?;
        self.grad_norm_finish(stream, &workspace.slice(..parts)?, max_norm, out)
    }

    /// The first half of [`grad_norm_clip`](Self::grad_norm_clip): the squares of `grads`
    /// summed per block into `workspace[0..parts)` (each tensor's partials in list order,
    /// [`grad_norm_workspace_len`] of them, returned). With
    /// [`grad_norm_finish`](Self::grad_norm_finish) over the partials of several calls laid
    /// back to back it gives the norm of all their tensors: expert parallelism gathers each
    /// rank's experts' partials after the replicated ones'.
    pub fn grad_norm_partials(
        &self,
        stream: &Stream,
        grads: &[HpBuffer<'_>],
        workspace: &DeviceBuffer<f32>,
    ) -> Result<usize> {
        let what = "Ops::grad_norm_partials";
        self.check_stream(what, stream)?;
        let parts: usize = grads.iter().map(|g| gn_layout(g.len()).0).sum();
        if workspace.len() < parts {
            return Err(Error::InvalidArgument(format!(
                "{what}: workspace has {} elements, the {} tensors need {parts}",
                workspace.len(),
                grads.len()
            )));
        }
        check_count(what, "the workspace's partial sums", parts)?;
        let workspace = workspace.slice(..parts)?;
        grads_clear_of(what, &[Span::of("workspace", &workspace)], grads)?;
        let live: Vec<&HpBuffer<'_>> = grads.iter().filter(|g| !g.is_empty()).collect();
        let mut base = 0usize;
        for group in live.chunks(GN_SLOTS) {
            let mut lens = [0u64; GN_SLOTS];
            let mut per = [0u64; GN_SLOTS];
            let mut dtype = [0u32; GN_SLOTS];
            let mut start = [0u32; GN_SLOTS + 1];
            let mut blocks = 0usize;
            for (i, g) in group.iter().enumerate() {
                let (nb, pe) = gn_layout(g.len());
                start[i] = blocks as u32;
                lens[i] = g.len() as u64;
                per[i] = pe as u64;
                dtype[i] = match g {
                    HpBuffer::F32(_) => 0,
                    HpBuffer::Bf16(_) => 1,
                    HpBuffer::F16(_) => 2,
                };
                blocks += nb;
            }
            start[group.len()..].fill(blocks as u32);
            let base32 = base as u32;
            let mut args = KernelArgs::new();
            for i in 0..GN_SLOTS {
                args = match group.get(i) {
                    Some(HpBuffer::F32(b)) => args.arg(*b),
                    Some(HpBuffer::Bf16(b)) => args.arg(*b),
                    Some(HpBuffer::F16(b)) => args.arg(*b),
                    // An unused slot: no block reads it; any valid pointer fills it.
                    None => args.arg(&workspace),
                };
            }
            let args = args
                .arg(&lens)
                .arg(&per)
                .arg(&start)
                .arg(&dtype)
                .arg(&workspace)
                .arg(&base32);
            // SAFETY: block b of slot i (start[i] <= b < start[i + 1], the grid is the
            // group's blocks) reads tensor i's elements [k * per, min(len, (k + 1) * per)),
            // k = b - start[i] < ceil(len / per), as its dtype (f32 / bf16 / f16, the
            // buffer's own), 16-byte loads only when the tensor is 16-byte aligned (per is a
            // multiple of 8, so every range start is); writes workspace[base + b] (base +
            // blocks <= the parts checked). Unused slots have no blocks.
            unsafe {
                stream.launch_pdl(
                    &self.k.grad_sq_partial,
                    &LaunchConfig::linear(blocks as u32, BLOCK),
                    &args,
                )
            }?;
            base += blocks;
        }
        debug_assert_eq!(base, parts);
        Ok(parts)
    }

    /// The second half of [`grad_norm_clip`](Self::grad_norm_clip): `out[0]` the L2 norm
    /// whose squares' partial sums are all of `partials` (one fixed-order f64 sum), `out[1]`
    /// the clipping factor for `max_norm`.
    pub fn grad_norm_finish(
        &self,
        stream: &Stream,
        partials: &DeviceBuffer<f32>,
        max_norm: f32,
        out: &DeviceBuffer<f32>,
    ) -> Result<()> {
        let what = "Ops::grad_norm_finish";
        self.check_stream(what, stream)?;
        self.check_norm_args(what, max_norm, out)?;
        let parts32 = check_count(what, "the partial sums", partials.len())?;
        let out = out.slice(..2)?;
        check_disjoint(
            what,
            &[Span::of("out", &out)],
            &[Span::of("partials", partials)],
        )?;
        let args = KernelArgs::new()
            .arg(partials)
            .arg(&parts32)
            .arg(&max_norm)
            .arg(&out);
        // SAFETY: one block reads partials[0..parts) (its length) and writes out[0] and
        // out[1] (2 checked).
        unsafe {
            stream.launch_pdl(
                &self.k.grad_norm_final,
                &LaunchConfig::linear(1, REDUCE_BLOCK),
                &args,
            )
        }
    }

    /// The clip's arguments: `max_norm` finite and positive, `out` two elements at least.
    fn check_norm_args(&self, what: &str, max_norm: f32, out: &DeviceBuffer<f32>) -> Result<()> {
        if !(max_norm.is_finite() && max_norm > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "{what}: max_norm = {max_norm} must be finite and positive"
            )));
        }
        if out.len() < 2 {
            return Err(Error::InvalidArgument(format!(
                "{what}: out has {} elements, needs 2 (the norm and the factor)",
                out.len()
            )));
        }
        Ok(())
    }
}

/// Checks that no gradient of `grads` overlaps one of `outputs`.
fn grads_clear_of(what: &str, outputs: &[Span], grads: &[HpBuffer<'_>]) -> Result<()> {
    for (i, g) in grads.iter().enumerate() {
        let bytes = match g {
            HpBuffer::F32(b) => b.bytes(),
            HpBuffer::Bf16(b) => b.bytes(),
            HpBuffer::F16(b) => b.bytes(),
        };
        let span = Span {
            name: "a gradient",
            start: g.device_ptr(),
            end: g.device_ptr() + bytes as u64,
        };
        if let Some(o) = outputs.iter().find(|o| o.overlaps(&span)) {
            return Err(Error::InvalidArgument(format!(
                "{what}: {} overlaps gradient {i} ({:#x}..{:#x})",
                o.name, span.start, span.end
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grad_norm_layout_covers_each_tensor() {
        for n in [
            1,
            7,
            8,
            9,
            512,
            16 * 1024,
            16 * 1024 + 1,
            1 << 20,
            3 * (1 << 20) + 5,
            100_000_007,
        ] {
            let (blocks, per) = gn_layout(n);
            assert!((1..=GN_MAX_BLOCKS).contains(&blocks), "{n}: {blocks}");
            assert_eq!(per % 8, 0, "{n}");
            assert!(blocks * per >= n, "{n}: covered");
            assert!((blocks - 1) * per < n, "{n}: no empty block");
        }
        assert_eq!(gn_layout(0), (0, 0));
        // About one block per 16 Ki elements below the cap.
        assert_eq!(gn_layout(1 << 20).0, 64);
        assert_eq!(gn_layout(100).0, 1);
        assert_eq!(grad_norm_workspace_len(&[0, 100, 1 << 20, 0]), 65);
        assert_eq!(grad_norm_workspace_len(&[]), 0);
    }

    #[test]
    fn rmsnorm_workspace_is_one_row_per_chunk() {
        assert_eq!(rmsnorm_backward_workspace_len(4096, 512), 128 * 512);
        assert_eq!(rmsnorm_backward_workspace_len(1, 20), 20);
        assert_eq!(rmsnorm_backward_workspace_len(33, 7), 2 * 7);
    }

    #[test]
    fn column_groups_fill_the_blocks() {
        // The train job's d = 512 in 16-byte pieces: 64 pieces, so the embedding backward
        // takes two slices of 32 groups (16 row lanes each) and the weight gradient one of 64
        // (4 row lanes).
        assert_eq!(column_groups(64, EMB_GROUPS), 32);
        assert_eq!(column_groups(64, RMS_GROUPS), 64);
        assert_eq!(column_groups(20, RMS_GROUPS), 32);
        assert_eq!(column_groups(1, EMB_GROUPS), 1);
        for pieces in 1..300 {
            for cap in [EMB_GROUPS, RMS_GROUPS] {
                let g = column_groups(pieces, cap);
                assert!(g.is_power_of_two() && g <= cap);
                assert!(g >= pieces.min(cap));
            }
        }
        // Every thread of a block has a (group, lane) slot.
        assert_eq!(EMB_THREADS as usize % EMB_GROUPS, 0);
        assert_eq!(BLOCK as usize % RMS_GROUPS, 0);
    }

    #[test]
    fn spans_overlap_only_when_they_share_bytes() {
        let s = |start, end| Span {
            name: "s",
            start,
            end,
        };
        assert!(s(0, 16).overlaps(&s(8, 24)));
        assert!(!s(0, 16).overlaps(&s(16, 24)));
        assert!(!s(0, 0).overlaps(&s(0, 16)), "empty spans overlap nothing");
        assert!(check_disjoint("t", &[s(0, 16)], &[s(16, 32), s(32, 48)]).is_ok());
        let e = check_disjoint("t", &[s(0, 16), s(8, 9)], &[]).unwrap_err();
        assert!(e.to_string().contains("overlaps"), "{e}");
    }

    #[test]
    fn shape_checks_name_the_buffer() {
        let msg = |r: Result<usize>| r.unwrap_err().to_string();
        assert_eq!(cols_of("t", "x", 12, 3, "rows").unwrap(), 4);
        assert!(msg(cols_of("t", "x", 13, 3, "rows")).contains("x has 13"));
        assert!(msg(cols_of("t", "x", 0, 3, "rows")).contains("x has 0"));
        assert!(msg(cols_of("t", "x", 12, 0, "rows")).contains("rows is empty"));
        assert!(check_count("t", "n", MAX_ELEMS).is_ok());
        assert!(check_count("t", "n", MAX_ELEMS + 1).is_err());
        assert!(
            check_len("t", "y", 3, 4)
                .unwrap_err()
                .to_string()
                .contains("y has 3")
        );
    }
}
