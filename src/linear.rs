//! [`Fp8Linear`]: `y = x W^T (+ b)` with FP8 GEMMs and per-tensor delayed scaling, usable
//! as a [`Callable`] of [`GraphedCallables`](graphed_callables::GraphedCallables) and
//! eagerly (the same struct, driven directly with [`Slot::new`]).
//!
//! # Activations are f32
//!
//! Inputs, outputs and their gradients are f32 buffers (`Callable<f32>`), to keep the layer
//! simple: quantize and cast-transpose read f32, the GEMMs write f32. Weights and their
//! gradients are f32 too; the bias and its gradient are f32.
//!
//! # The three GEMMs (layouts of [`fp8_kernels::gemm`])
//!
//! With `M` = tokens, `K` = `in_features`, `N` = `out_features`:
//! * forward: `Y[M,N] = X[M,K] . W[N,K]^T (+ b)`: A = the E4M3 cast of x, B = the E4M3 copy
//!   of W;
//! * data gradient: `dX[M,K] = dY[M,N] . W`: A = the E5M2 cast of dY, B = `W^T` (`[K,N]`,
//!   the cast-transpose of W);
//! * weight gradient: `dW[N,K] += dY^T . X`: A = `dY^T` (`[N,M]`), B = `X^T` (`[K,M]`), both
//!   cast-transposes; accumulated into `dW` in f32. `db += column sums of dY` (f32, from the
//!   unquantized dY, by a deterministic kernel of this crate).
//!
//! The GEMM rule `K % 16 == 0` applies to all three, so `in_features`, `out_features` and
//! `tokens` must each be a multiple of 16 ([`check_shape`]).
//!
//! # FP8 state
//!
//! Three tensors of one shared [`DelayedScaling`] (usually one state for a whole stack, so
//! one launch updates every layer), starting at the layer's `first_tensor`:
//! `first_tensor + 0` = x (E4M3), `+ 1` = W (E4M3), `+ 2` = dY (E5M2) ([`FORMATS`]).
//! Quantizing x (forward), W ([`Callable::cast_weights`]) and dY (backward) reads the
//! state's scale and maxes |value| into its amax slot; the caller runs
//! [`DelayedScaling::update`] after each forward and each backward pass (in graphed mode
//! through the `after_forward` / `after_backward` hooks).
//!
//! The `scale_inv` a GEMM multiplies by is the one the cast wrote, kept beside the FP8
//! bytes, not the state's: the state's scale changes at every update, but W's FP8 copy is
//! reused for a whole step and x's for the backward of its microbatch, which must be undone
//! with the scale they were cast with.
//!
//! # Weight caching
//!
//! [`Callable::cast_weights`] cast-transposes W into the layer's FP8 copies (`W` and `W^T`,
//! shared by all microbatches: they change only on a step's first microbatch). It passes
//! [`Slot::skip_weight_cast`] to the kernel as its noop flag when the runtime gives one
//! ([`WeightCaching::NoopFlag`](graphed_callables::WeightCaching::NoopFlag)); otherwise it
//! casts unconditionally (the IF node of
//! [`WeightCaching::Conditional`](graphed_callables::WeightCaching::Conditional), or an
//! eager caller that calls it only on the first microbatch).
//!
//! # Saved activations
//!
//! What the backward of a microbatch needs from its forward lives in the runtime's
//! per-(chunk, microbatch, layer) saved buffers ([`Callable::saved_bytes`], [`Slot::saved`]):
//! `saved[0]` holds the E4M3 bytes of `X^T` (`[K, M]`, written by the forward's
//! cast-transpose) and `saved[1]` the one f32 `scale_inv` it was cast with (4 bytes, viewed
//! as an `f32`); the backward adds the E5M2 bytes of `dY^T`
//! (`saved[2]`, `[N, M]`) and its `scale_inv` (`saved[3]`) for the weight gradient, which
//! may run later in a step of its own (split weight gradients:
//! [`Callable::backward_input`] then [`Callable::backward_weight`], schedules with
//! `-k - 0.5` entries). An eager caller passes one such set per microbatch. Everything else
//! the layer keeps (the FP8 x and dY) lives only within one pass and is shared by all
//! microbatches.
//!
//! # FP8 off: the high-precision path
//!
//! A pass whose slot has FP8 off ([`Slot::low_precision`] is `false`: graphed callables with
//! [`GraphedOptions::low_precision`](graphed_callables::GraphedOptions::low_precision) off for this callable,
//! or an eager slot made with [`Slot::with_low_precision`]`(false)`) computes the same three GEMMs in
//! f32 from the f32 weights, with no quantization at all:
//! * forward: `Y = X . W^T (+ b)`;
//! * backward: `dX = dY . W` and `dW += dY^T . X`, with `X` the microbatch's forward input
//!   ([`Slot::inputs`]`[0]`, which the runtime keeps per microbatch; an eager caller passes
//!   the same buffer to both passes), and `db +=` the column sums of dY as in the FP8 path.
//!
//! It reads and writes nothing of the scaling state (no amax, no scale, no
//! [`Slot::record_tensors`]: warmup records no tensor of this layer, so none is
//! registered), does not touch the FP8 weight copies, and leaves the saved buffers unused
//! (the runtime allocates them all the same, [`Callable::saved_bytes`] does not depend on
//! the slot). The runtime never calls [`Callable::cast_weights`] for a callable with FP8
//! off; called anyway, it still casts (harmless: nothing on this path reads the copies).
//!
//! The GEMMs are this crate's own kernels (`src/kernels/fp8_linear.cu`): a shared-memory
//! tiled SGEMM, 32 x 32 output tiles, where one thread sums each output element with `fmaf`
//! over `k = 0, 1, ...` in order (then adds the bias, or adds the sum onto `dW`). No atomics
//! and no split-K, so every element's bits depend only on the inputs: graphed replays equal
//! eager runs bit for bit. Built for correctness, not speed (no tensor cores). The error of
//! an element is that of a sequential f32 sum of its `K` products: at most about
//! `(K + 1) * 2^-24` times the sum of their magnitudes.

use std::sync::Arc;

use cuda_graph::{DeviceBuffer, Error, Kernel, LaunchConfig, Module, Result};
use cuda_graph::{Stream, kernel_args};
use fp8_kernels::gemm::{GemmOptions, GemmPath, GemmShape, K_ALIGN, Operand, gemm};
use fp8_kernels::{DelayedScaling, DeviceScalar, Fp8Format, Fp8Tensor, cast_transpose};
use graphed_callables::{Callable, Slot};

/// The crate's own kernels (the bias gradient and the f32 GEMMs of the FP8-off path), built
/// from `src/kernels/fp8_linear.cu`.
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fp8_linear.fatbin"));

/// Output tile edge of the f32 GEMM kernels (`SGEMM_TILE` in `fp8_linear.cu`).
const SGEMM_TILE: usize = 32;
/// Threads per block in y of the f32 GEMM kernels (`SGEMM_ROWS` in `fp8_linear.cu`); x is
/// [`SGEMM_TILE`].
const SGEMM_ROWS: u32 = 8;

/// How many tensors of the [`DelayedScaling`] state one layer uses.
pub const TENSORS: usize = 3;

/// The formats of a layer's tensors, in state order: x (E4M3), W (E4M3), dY (E5M2).
pub const FORMATS: [Fp8Format; TENSORS] = [Fp8Format::E4M3, Fp8Format::E4M3, Fp8Format::E5M2];

/// Offset of x's tensor from a layer's first tensor.
const X: usize = 0;
/// Offset of W's tensor.
const W: usize = 1;
/// Offset of dY's tensor.
const DY: usize = 2;

/// Checks the shape rules of a layer: every dimension at least 1 and a multiple of 16 (it
/// is the K of one of the three GEMMs), the sizes within `u32` for the kernels.
pub fn check_shape(tokens: usize, in_features: usize, out_features: usize) -> Result<()> {
    for (name, v) in [
        ("tokens", tokens),
        ("in_features", in_features),
        ("out_features", out_features),
    ] {
        if v == 0 || v % K_ALIGN != 0 {
            return Err(Error::InvalidArgument(format!(
                "Fp8Linear: {name} = {v} must be a positive multiple of {K_ALIGN} (it is K of \
                 one of the layer's GEMMs)"
            )));
        }
    }
    let big = [
        tokens.checked_mul(in_features),
        tokens.checked_mul(out_features),
        in_features.checked_mul(out_features),
    ];
    if big.iter().any(|p| p.is_none_or(|p| p > u32::MAX as usize)) {
        return Err(Error::InvalidArgument(format!(
            "Fp8Linear: {tokens} x {in_features} x {out_features} has a matrix above 2^32 \
             elements"
        )));
    }
    Ok(())
}

/// The saved-buffer sizes in bytes of a layer: `X^T` (`tokens * in_features` E4M3 bytes)
/// and its `scale_inv` (one f32), then `dY^T` (`tokens * out_features` E5M2 bytes) and its
/// `scale_inv`.
pub fn saved_bytes(tokens: usize, in_features: usize, out_features: usize) -> Vec<usize> {
    vec![
        tokens * in_features,
        size_of::<f32>(),
        tokens * out_features,
        size_of::<f32>(),
    ]
}

/// An FP8 linear layer `y = x W^T (+ b)` over a fixed number of tokens; see the
/// [module documentation](self).
///
/// Each pass follows its slot's [`Slot::low_precision`]: FP8 GEMMs with delayed scaling when
/// on (the default of [`Slot::new`]), f32 GEMMs from the f32 weights that leave the FP8
/// state alone when off ([FP8 off](self#fp8-off-the-high-precision-path)). A layer may run
/// either way from pass to pass, as long as a microbatch's backward follows a forward of the
/// same kind (the FP8 backward reads what the FP8 forward saved).
///
/// # Example: eagerly, one microbatch
///
/// ```no_run
/// use std::sync::Arc;
/// use graphed_callables::{Callable, GraphIndex, Slot};
/// use cuda_graph::{Context, DeviceBuffer, Stream};
/// use fp8_kernels::{AmaxAlgo, DelayedScaling};
/// use fp8_moe::linear::{self, Fp8Linear};
///
/// let ctx = Context::default_device()?;
/// let stream = Stream::new(&ctx)?;
/// let scaling = Arc::new(DelayedScaling::new(&stream, &linear::FORMATS, 16, 0, AmaxAlgo::Max)?);
/// let w = vec![0.01f32; 256 * 128];
/// let mut layer = Fp8Linear::new(&stream, 64, 128, 256, &w, None, scaling.clone(), 0)?;
/// let x = DeviceBuffer::from_host(&stream, &vec![0.5f32; 64 * 128])?;
/// let y = DeviceBuffer::<f32>::alloc(&ctx, 64 * 256)?;
/// // The saved buffers the backward reads (FP8 X^T and dY^T, their scales), in bytes.
/// let saved: Vec<DeviceBuffer<u8>> = layer
///     .saved_bytes()
///     .iter()
///     .map(|&n| DeviceBuffer::alloc(&ctx, n))
///     .collect::<Result<_, _>>()?;
/// let at = GraphIndex { chunk: 0, microbatch: 0, layer: 0 };
/// let slot = Slot::new(at, vec![&x], vec![&y], saved.iter().collect());
/// layer.cast_weights(&stream, &slot)?; // first microbatch of the step
/// layer.forward(&stream, &[&x], &[&y], &slot)?;
/// scaling.update(&stream)?;
/// stream.synchronize()?;
/// # Ok::<(), cuda_graph::Error>(())
/// ```
pub struct Fp8Linear {
    tokens: usize,
    in_features: usize,
    out_features: usize,
    scaling: Arc<DelayedScaling>,
    first_tensor: usize,
    path: GemmPath,
    /// `[out, in]` f32.
    w: DeviceBuffer<f32>,
    dw: DeviceBuffer<f32>,
    bias: Option<(DeviceBuffer<f32>, DeviceBuffer<f32>)>,
    /// W's E4M3 copy `[out, in]`: scale and amax of the state, `scale_inv` its own.
    w_fp8: Fp8Tensor,
    /// `W^T` `[in, out]`, cast with the same scale as `w_fp8`.
    w_t: DeviceBuffer<u8>,
    /// The forward's E4M3 x `[M, in]` (one pass only).
    x_fp8: DeviceBuffer<u8>,
    /// The backward's E5M2 dY `[M, out]` (one pass only; `dY^T` and its `scale_inv` go
    /// into the saved buffers, for the weight gradient).
    dy_fp8: DeviceBuffer<u8>,
    bias_grad: Kernel,
    /// The f32 GEMMs of the FP8-off path.
    hp: HpKernels,
    _module: Module,
}

/// The f32 GEMM kernels of the FP8-off path (`fp8_linear_hp_*` in `fp8_linear.cu`).
struct HpKernels {
    /// `y = x . W^T`.
    forward: Kernel,
    /// `y = x . W^T + b`.
    forward_bias: Kernel,
    /// `dX = dY . W`.
    dgrad: Kernel,
    /// `dW += dY^T . X`.
    wgrad: Kernel,
}

impl HpKernels {
    fn load(module: &Module) -> Result<HpKernels> {
        Ok(HpKernels {
            forward: module.kernel("fp8_linear_hp_forward_f32")?,
            forward_bias: module.kernel("fp8_linear_hp_forward_bias_f32")?,
            dgrad: module.kernel("fp8_linear_hp_dgrad_f32")?,
            wgrad: module.kernel("fp8_linear_hp_wgrad_f32")?,
        })
    }
}

/// The launch of an f32 GEMM kernel with a `rows x cols` output: one block of
/// `SGEMM_TILE x SGEMM_ROWS` threads per `SGEMM_TILE`-square output tile, on a 1-D grid.
fn sgemm_config(rows: usize, cols: usize) -> Result<LaunchConfig> {
    let tiles = rows
        .div_ceil(SGEMM_TILE)
        .checked_mul(cols.div_ceil(SGEMM_TILE))
        .filter(|&t| t <= i32::MAX as usize)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "Fp8Linear: an f32 GEMM output of {rows} x {cols} needs more than 2^31 - 1 \
                 blocks"
            ))
        })?;
    Ok(LaunchConfig {
        grid: (tiles.max(1) as u32, 1, 1),
        block: (SGEMM_TILE as u32, SGEMM_ROWS, 1),
        shared_mem_bytes: 0,
        attributes: Vec::new(),
    })
}

impl std::fmt::Debug for Fp8Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fp8Linear")
            .field("tokens", &self.tokens)
            .field("in_features", &self.in_features)
            .field("out_features", &self.out_features)
            .field("bias", &self.bias.is_some())
            .field("first_tensor", &self.first_tensor)
            .field("path", &self.path)
            .finish()
    }
}

/// `len` bytes on the device, zeroed on `stream`: the layer's FP8 copies hold defined bytes
/// before their first cast (an FP8-off layer never casts, and reading its copies back must
/// not read uninitialized memory).
fn zeroed(stream: &Stream, len: usize) -> Result<DeviceBuffer<u8>> {
    let b = DeviceBuffer::alloc(stream.context(), len)?;
    b.memset_bytes(stream, 0)?;
    Ok(b)
}

/// The f32 `scale_inv` kept in a 4-byte saved buffer, as a device scalar (a view).
fn scalar_of(buf: &DeviceBuffer<u8>) -> Result<DeviceScalar> {
    DeviceScalar::at(&buf.slice(..size_of::<f32>())?.reinterpret::<f32>()?, 0)
}

impl Fp8Linear {
    /// A layer of `tokens` rows, `in_features` -> `out_features`, with weights `weight`
    /// (`[out_features, in_features]` row-major f32), an optional `bias` (`out_features`),
    /// gradients zeroed, using tensors `first_tensor .. first_tensor + 3` of `scaling`
    /// (whose formats must be [`FORMATS`]). Allocates and uploads (waits; not during a
    /// capture) and loads the kernels it needs, so nothing is loaded inside a capture.
    #[allow(clippy::too_many_arguments)] // shape, parameters, FP8 state
    pub fn new(
        stream: &Stream,
        tokens: usize,
        in_features: usize,
        out_features: usize,
        weight: &[f32],
        bias: Option<&[f32]>,
        scaling: Arc<DelayedScaling>,
        first_tensor: usize,
    ) -> Result<Fp8Linear> {
        check_shape(tokens, in_features, out_features)?;
        let ctx = stream.context().clone();
        if weight.len() != in_features * out_features {
            return Err(Error::InvalidArgument(format!(
                "Fp8Linear: weight has {} elements, [{out_features}, {in_features}] needs {}",
                weight.len(),
                in_features * out_features
            )));
        }
        if let Some(b) = bias
            && b.len() != out_features
        {
            return Err(Error::InvalidArgument(format!(
                "Fp8Linear: bias has {} elements, out_features is {out_features}",
                b.len()
            )));
        }
        for (k, want) in FORMATS.iter().enumerate() {
            let t = first_tensor.saturating_add(k);
            match scaling.format(t) {
                Some(f) if f == *want => {}
                got => {
                    return Err(Error::InvalidArgument(format!(
                        "Fp8Linear: scaling tensor {t} is {got:?}, the layer needs {want:?} \
                         (tensors first_tensor..first_tensor+3 are x, W, dY)"
                    )));
                }
            }
        }
        let module = Module::embedded(&ctx, FATBIN)?;
        let bias_grad = module.kernel("fp8_linear_bias_grad_f32")?;
        let hp = HpKernels::load(&module)?;
        // Load fp8-kernels' module now rather than lazily inside a capture.
        fp8_kernels::module(&ctx)?;

        let w = DeviceBuffer::from_host(stream, weight)?;
        let dw = DeviceBuffer::from_host(stream, &vec![0f32; weight.len()])?;
        let bias = match bias {
            Some(b) => Some((
                DeviceBuffer::from_host(stream, b)?,
                DeviceBuffer::from_host(stream, &vec![0f32; b.len()])?,
            )),
            None => None,
        };
        let w_scale_inv = DeviceBuffer::from_host(stream, &[1f32])?;
        let w_fp8 = Fp8Tensor::from_parts(
            zeroed(stream, weight.len())?,
            &[out_features, in_features],
            Fp8Format::E4M3,
            scaling.scale(first_tensor + W)?,
            DeviceScalar::at(&w_scale_inv, 0)?,
            scaling.amax(first_tensor + W)?,
        )?;
        let layer = Fp8Linear {
            tokens,
            in_features,
            out_features,
            first_tensor,
            path: GemmPath::Auto,
            w,
            dw,
            bias,
            w_fp8,
            w_t: zeroed(stream, weight.len())?,
            x_fp8: zeroed(stream, tokens * in_features)?,
            dy_fp8: zeroed(stream, tokens * out_features)?,
            bias_grad,
            hp,
            _module: module,
            scaling,
        };
        stream.synchronize()?;
        Ok(layer)
    }

    /// This layer with its GEMMs on `path` (default [`GemmPath::Auto`]).
    pub fn with_gemm_path(mut self, path: GemmPath) -> Fp8Linear {
        self.path = path;
        self
    }

    /// Rows (tokens) of x and y.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// Columns of x.
    pub fn in_features(&self) -> usize {
        self.in_features
    }
    /// Columns of y.
    pub fn out_features(&self) -> usize {
        self.out_features
    }
    /// The shared delayed-scaling state.
    pub fn scaling(&self) -> &Arc<DelayedScaling> {
        &self.scaling
    }
    /// The layer's first tensor in [`scaling`](Self::scaling) (x; W and dY follow).
    pub fn first_tensor(&self) -> usize {
        self.first_tensor
    }
    /// The f32 weights `[out, in]`.
    pub fn weight(&self) -> &DeviceBuffer<f32> {
        &self.w
    }
    /// The weight gradient `[out, in]` (accumulated by every backward).
    pub fn weight_grad(&self) -> &DeviceBuffer<f32> {
        &self.dw
    }
    /// The bias, if any.
    pub fn bias(&self) -> Option<&DeviceBuffer<f32>> {
        self.bias.as_ref().map(|(b, _)| b)
    }
    /// The bias gradient, if there is a bias.
    pub fn bias_grad(&self) -> Option<&DeviceBuffer<f32>> {
        self.bias.as_ref().map(|(_, g)| g)
    }
    /// W's E4M3 copy (`[out, in]`) and its `scale_inv`, as the last cast left them.
    pub fn weight_fp8(&self) -> &Fp8Tensor {
        &self.w_fp8
    }
    /// `W^T`'s E4M3 bytes (`[in, out]`), as the last cast left them.
    pub fn weight_t_fp8(&self) -> &DeviceBuffer<u8> {
        &self.w_t
    }

    /// The FP8-off forward: `y = x . W^T (+ b)` in f32 (`x`, `y` of the layer's lengths,
    /// checked by the caller).
    fn forward_hp(
        &self,
        stream: &Stream,
        x: &DeviceBuffer<f32>,
        y: &DeviceBuffer<f32>,
    ) -> Result<()> {
        let (m, n, k) = self.dims();
        let cfg = sgemm_config(self.tokens, self.out_features)?;
        match &self.bias {
            // SAFETY: fp8_linear_hp_forward_bias_f32(const float* x, const float* w, const
            // float* bias, float* y, u32 m, u32 n, u32 k) reads m * k floats of x, n * k of
            // w and n of bias and writes m * n of y: the lengths of x and y (checked by
            // one_each), of w ([out, in]) and of bias (out). Every access is bounds-checked
            // against m, n, k; the grid is sgemm_config's for [m, n] and the block
            // (SGEMM_TILE, SGEMM_ROWS), what the kernel expects. y is a separate buffer
            // (the runtime's static output, or the caller's).
            Some((b, _)) => unsafe {
                stream.launch_pdl(
                    &self.hp.forward_bias,
                    &cfg,
                    &kernel_args![*x, self.w, *b, *y, m, n, k],
                )
            },
            // SAFETY: as above, fp8_linear_hp_forward_f32(x, w, y, m, n, k) without bias.
            None => unsafe {
                stream.launch_pdl(
                    &self.hp.forward,
                    &cfg,
                    &kernel_args![*x, self.w, *y, m, n, k],
                )
            },
        }
    }

    /// The microbatch's forward input the FP8-off weight gradient reads ([`Slot::inputs`]);
    /// an error naming the slot when it is not one buffer of `tokens * in_features`.
    fn hp_input<'a>(&self, slot: &Slot<'a, f32>) -> Result<&'a DeviceBuffer<f32>> {
        match slot.inputs() {
            [x] if x.len() == self.tokens * self.in_features => Ok(*x),
            xs => Err(Error::InvalidArgument(format!(
                "Fp8Linear backward at {} with FP8 off: needs the forward input (one buffer of \
                 {} elements) in the slot's inputs, got lengths {:?}",
                slot.at(),
                self.tokens * self.in_features,
                xs.iter().map(|x| x.len()).collect::<Vec<_>>()
            ))),
        }
    }

    /// The FP8-off input gradient: `dX = dY . W` in f32 (`dy`, `dx` checked by the caller).
    fn dgrad_hp(
        &self,
        stream: &Stream,
        dy: &DeviceBuffer<f32>,
        dx: &DeviceBuffer<f32>,
    ) -> Result<()> {
        let (m, n, k) = self.dims();
        // SAFETY: fp8_linear_hp_dgrad_f32(const float* dy, const float* w, float* dx, u32 m,
        // u32 n, u32 k) reads m * n floats of dy and n * k of w and writes m * k of dx: the
        // lengths of dy and dx (checked by one_each) and of w; accesses bounds-checked; the
        // grid is sgemm_config's for the [m, k] output. dx is the pass's own gradient
        // buffer, not read by the launch.
        unsafe {
            stream.launch_pdl(
                &self.hp.dgrad,
                &sgemm_config(self.tokens, self.in_features)?,
                &kernel_args![*dy, self.w, *dx, m, n, k],
            )
        }
    }

    /// The FP8-off weight gradient: `dW += dY^T . X` in f32 (`dy` checked by the caller;
    /// `x` is the microbatch's forward input, [`Slot::inputs`]).
    fn wgrad_hp(
        &self,
        stream: &Stream,
        dy: &DeviceBuffer<f32>,
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let (m, n, k) = self.dims();
        let x = self.hp_input(slot)?;
        // SAFETY: fp8_linear_hp_wgrad_f32(const float* dy, const float* x, float* dw, u32 m,
        // u32 n, u32 k) reads m * n floats of dy and m * k of x (its length, checked above)
        // and adds into n * k of dw (the layer's [out, in] gradient); accesses
        // bounds-checked; the grid is sgemm_config's for the [n, k] output.
        unsafe {
            stream.launch_pdl(
                &self.hp.wgrad,
                &sgemm_config(self.out_features, self.in_features)?,
                &kernel_args![*dy, *x, self.dw, m, n, k],
            )
        }
    }

    /// `db +=` the column sums of `dy` (`[tokens, out]`, its length checked by the caller),
    /// if the layer has a bias.
    fn add_bias_grad(&self, stream: &Stream, dy: &DeviceBuffer<f32>) -> Result<()> {
        let Some((_, db)) = &self.bias else {
            return Ok(());
        };
        let (rows, cols, _) = self.dims();
        // SAFETY: fp8_linear_bias_grad_f32(const float* dy, float* db, u32 rows, u32 cols)
        // reads rows * cols floats of dy (its length, checked by one_each) and adds to cols
        // floats of db (out_features long); one thread per column, bound-checked.
        unsafe {
            stream.launch_pdl(
                &self.bias_grad,
                &LaunchConfig::for_elements(cols, 128),
                &kernel_args![*dy, *db, rows, cols],
            )
        }
    }

    /// `(tokens, out_features, in_features)` as the kernels take them (`m`, `n`, `k`;
    /// within `u32` by [`check_shape`]).
    fn dims(&self) -> (u32, u32, u32) {
        (
            self.tokens as u32,
            self.out_features as u32,
            self.in_features as u32,
        )
    }
}

impl Callable<f32> for Fp8Linear {
    fn input_lens(&self) -> Vec<usize> {
        vec![self.tokens * self.in_features]
    }

    fn output_lens(&self) -> Vec<usize> {
        vec![self.tokens * self.out_features]
    }

    fn saved_bytes(&self) -> Vec<usize> {
        saved_bytes(self.tokens, self.in_features, self.out_features)
    }

    fn parameters(&self) -> Vec<&DeviceBuffer<f32>> {
        let mut p = vec![&self.w];
        p.extend(self.bias());
        p
    }

    fn gradients(&self) -> Vec<&DeviceBuffer<f32>> {
        let mut g = vec![&self.dw];
        g.extend(self.bias_grad());
        g
    }

    /// Cast-transposes W into its E4M3 copies (`W`, `W^T`), maxing |W| into W's amax;
    /// skipped on the device when the slot's noop flag reads 1.0. Casts whatever the slot's
    /// [`low_precision`](Slot::low_precision) (the runtime does not call it with FP8 off; the
    /// FP8-off passes never read the copies).
    fn cast_weights(&mut self, stream: &Stream, slot: &Slot<'_, f32>) -> Result<()> {
        slot.record_tensors([self.first_tensor + W]);
        let noop = slot
            .skip_weight_cast()
            .map(|f| DeviceScalar::at(f, 0))
            .transpose()?;
        cast_transpose(
            stream,
            &self.w,
            self.out_features,
            self.in_features,
            &self.w_fp8,
            &self.w_t,
            noop.as_ref(),
        )
    }

    /// FP8 on: casts x (and `X^T` into the saved buffers) to E4M3, then the FP8 GEMM. FP8
    /// off: the f32 GEMM from the f32 weights, nothing else.
    fn forward(
        &mut self,
        stream: &Stream,
        inputs: &[&DeviceBuffer<f32>],
        outputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let (m, k, n) = (self.tokens, self.in_features, self.out_features);
        let (x, y) = one_each("forward", inputs, outputs, m * k, m * n)?;
        if !slot.low_precision() {
            return self.forward_hp(stream, x, y);
        }
        slot.record_tensors([self.first_tensor + X]);
        let [x_t, si_buf, _, _] = saved_buffers(slot)?;
        let x_si = scalar_of(si_buf)?;
        let x_fp8 = Fp8Tensor::from_parts(
            self.x_fp8.share(),
            &[m, k],
            Fp8Format::E4M3,
            self.scaling.scale(self.first_tensor + X)?,
            x_si.clone(),
            self.scaling.amax(self.first_tensor + X)?,
        )?;
        // x and X^T in one pass; X^T (and the scale_inv it was cast with) stay in the
        // microbatch's saved buffers for the weight gradient.
        cast_transpose(stream, x, m, k, &x_fp8, x_t, None)?;
        let mut opts = GemmOptions::new().path(self.path);
        if let Some((b, _)) = &self.bias {
            opts = opts.bias(b);
        }
        gemm(
            stream,
            GemmShape::new(m, n, k),
            Operand {
                data: x_fp8.data(),
                format: Fp8Format::E4M3,
                scale_inv: &x_si,
            },
            Operand {
                data: self.w_fp8.data(),
                format: Fp8Format::E4M3,
                scale_inv: self.w_fp8.scale_inv(),
            },
            y,
            opts,
        )
    }

    /// [`backward_input`](Callable::backward_input) then
    /// [`backward_weight`](Callable::backward_weight): FP8 on, dY cast to E5M2 (and `dY^T`
    /// kept in the saved buffers), the dgrad and wgrad FP8 GEMMs (X from the saved buffers);
    /// FP8 off, the f32 GEMMs, X from [`Slot::inputs`]. Both: the bias gradient from the
    /// unquantized dY.
    fn backward(
        &mut self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<f32>],
        grad_inputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        self.backward_input(stream, grad_outputs, grad_inputs, slot)?;
        self.backward_weight(stream, grad_outputs, slot)
    }

    /// `dX = dY . W`. FP8 on: casts dY to E5M2 with its delayed scale (amax into the
    /// state), keeping `dY^T` and its `scale_inv` in `saved[2..4]` for the weight gradient,
    /// then the dgrad FP8 GEMM; FP8 off: the f32 dgrad.
    fn backward_input(
        &mut self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<f32>],
        grad_inputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let (m, k, n) = (self.tokens, self.in_features, self.out_features);
        let (dy, dx) = one_each("backward", grad_outputs, grad_inputs, m * n, m * k)?;
        if !slot.low_precision() {
            // Checked here too, so a bad slot fails before anything is enqueued.
            self.hp_input(slot)?;
            return self.dgrad_hp(stream, dy, dx);
        }
        slot.record_tensors([self.first_tensor + DY]);
        let [_, _, dy_t, dy_si_buf] = saved_buffers(slot)?;
        let dy_si = scalar_of(dy_si_buf)?;
        let dy_fp8 = Fp8Tensor::from_parts(
            self.dy_fp8.share(),
            &[m, n],
            Fp8Format::E5M2,
            self.scaling.scale(self.first_tensor + DY)?,
            dy_si.clone(),
            self.scaling.amax(self.first_tensor + DY)?,
        )?;
        cast_transpose(stream, dy, m, n, &dy_fp8, dy_t, None)?;
        // dX[M, K] = dY[M, N] . W[N, K]: B = W^T [K, N].
        gemm(
            stream,
            GemmShape::new(m, k, n),
            Operand {
                data: dy_fp8.data(),
                format: Fp8Format::E5M2,
                scale_inv: &dy_si,
            },
            Operand {
                data: &self.w_t,
                format: Fp8Format::E4M3,
                scale_inv: self.w_fp8.scale_inv(),
            },
            dx,
            GemmOptions::new().path(self.path),
        )
    }

    /// `dW += dY^T . X` and the bias gradient. FP8 on: the wgrad FP8 GEMM from the `dY^T`
    /// and `X^T` the backward and forward kept in the saved buffers; FP8 off: the f32 wgrad
    /// from dY and [`Slot::inputs`]. `grad_outputs` is the dY the backward read.
    fn backward_weight(
        &mut self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let (m, k, n) = (self.tokens, self.in_features, self.out_features);
        let dy = match grad_outputs {
            [dy] if dy.len() == m * n => *dy,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "Fp8Linear weight gradient: takes one output gradient of {} elements, \
                     got lengths {:?}",
                    m * n,
                    grad_outputs.iter().map(|g| g.len()).collect::<Vec<_>>()
                )));
            }
        };
        if !slot.low_precision() {
            self.wgrad_hp(stream, dy, slot)?;
            return self.add_bias_grad(stream, dy);
        }
        let [x_t, x_si_buf, dy_t, dy_si_buf] = saved_buffers(slot)?;
        let x_si = scalar_of(x_si_buf)?;
        let dy_si = scalar_of(dy_si_buf)?;
        // dW[N, K] += dY^T[N, M] . X^T[K, M]^T.
        gemm(
            stream,
            GemmShape::new(n, k, m),
            Operand {
                data: dy_t,
                format: Fp8Format::E5M2,
                scale_inv: &dy_si,
            },
            Operand {
                data: x_t,
                format: Fp8Format::E4M3,
                scale_inv: &x_si,
            },
            &self.dw,
            GemmOptions::new().path(self.path).accumulate(true),
        )?;
        self.add_bias_grad(stream, dy)
    }
}

/// The one input and one output of a pass, of lengths `a_len` and `b_len`; an error when
/// the counts or lengths are wrong.
fn one_each<'a>(
    what: &str,
    a: &[&'a DeviceBuffer<f32>],
    b: &[&'a DeviceBuffer<f32>],
    a_len: usize,
    b_len: usize,
) -> Result<(&'a DeviceBuffer<f32>, &'a DeviceBuffer<f32>)> {
    match (a, b) {
        ([a], [b]) if a.len() == a_len && b.len() == b_len => Ok((a, b)),
        ([a], [b]) => Err(Error::InvalidArgument(format!(
            "Fp8Linear {what}: buffers of {} and {} elements, the layer needs {a_len} and \
             {b_len}",
            a.len(),
            b.len()
        ))),
        _ => Err(Error::InvalidArgument(format!(
            "Fp8Linear {what}: takes one buffer each way, got {} and {}",
            a.len(),
            b.len()
        ))),
    }
}

/// The slot's four saved buffers (`X^T` bytes, its `scale_inv`, `dY^T` bytes, its
/// `scale_inv`).
fn saved_buffers<'a>(slot: &Slot<'a, f32>) -> Result<[&'a DeviceBuffer<u8>; 4]> {
    match slot.saved() {
        [xt, x_si, dyt, dy_si] => Ok([*xt, *x_si, *dyt, *dy_si]),
        s => Err(Error::InvalidArgument(format!(
            "Fp8Linear at {}: needs 4 saved buffers (X^T, its scale_inv, dY^T, its \
             scale_inv), got {}",
            slot.at(),
            s.len()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_follow_the_gemm_rules() {
        assert!(check_shape(64, 128, 256).is_ok());
        assert!(check_shape(16, 16, 16).is_ok());
        let e = check_shape(60, 128, 256).unwrap_err().to_string();
        assert!(e.contains("tokens = 60"), "{e}");
        let e = check_shape(64, 100, 256).unwrap_err().to_string();
        assert!(e.contains("in_features = 100"), "{e}");
        let e = check_shape(64, 128, 0).unwrap_err().to_string();
        assert!(e.contains("out_features = 0"), "{e}");
        assert!(check_shape(1 << 20, 1 << 13, 16).is_err(), "2^33 elements");
    }

    #[test]
    fn saved_buffers_hold_xt_bytes_and_one_scale() {
        assert_eq!(saved_bytes(64, 128, 32), vec![64 * 128, 4, 64 * 32, 4]);
        assert_eq!(saved_bytes(16, 16, 16), vec![256, 4, 256, 4]);
    }

    #[test]
    fn sgemm_launch_covers_the_output_in_tiles() {
        // 48 x 112: 2 x 4 tiles of 32 (partial at both edges), blocks of 32 x 8 threads.
        let cfg = sgemm_config(48, 112).unwrap();
        assert_eq!(cfg.grid, (8, 1, 1));
        assert_eq!(cfg.block, (32, 8, 1));
        assert_eq!(cfg.shared_mem_bytes, 0);
        assert_eq!(sgemm_config(64, 256).unwrap().grid, (2 * 8, 1, 1));
        assert_eq!(sgemm_config(1, 1).unwrap().grid, (1, 1, 1));
        // A layer at check_shape's element limit, 2^27 x 16 (at most 2^23 tiles), fits.
        assert!(check_shape(1 << 27, 16, 16).is_ok());
        assert_eq!(sgemm_config(1 << 27, 16).unwrap().grid, (1 << 22, 1, 1));
        let e = sgemm_config(1 << 40, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("2^31 - 1 blocks"), "{e}");
    }

    #[test]
    fn formats_are_e4m3_forward_e5m2_backward() {
        assert_eq!(FORMATS[X], Fp8Format::E4M3);
        assert_eq!(FORMATS[W], Fp8Format::E4M3);
        assert_eq!(FORMATS[DY], Fp8Format::E5M2);
        assert_eq!(FORMATS.len(), TENSORS);
    }
}
