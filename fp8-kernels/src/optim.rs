//! AdamW on the device, capturable, and fused with the FP8 cast of the weights it updates.
//!
//! [`AdamWState`] holds an optimizer's device state: the step count, the learning rate and the
//! bias-correction powers `beta1^t`, `beta2^t`. [`AdamWState::begin_step`] advances it (one
//! tiny kernel); then every parameter tensor is updated from that state:
//!
//! * [`AdamWState::update`]: elementwise over f32 master weights and their moments, from an
//!   f32 or bf16 gradient, optionally writing a bf16 copy of the new weights;
//! * [`AdamWState::update_cast_transpose_batched`]: the same over a batch of equally shaped
//!   matrices (a MoE layer's expert weights) with their FP8 cast-transpose (the update writes
//!   the FP8 bytes instead of a copy, a second pass transposes them): the new weights,
//!   rounded to bf16, are cast row-major and transposed with each matrix's scale,
//!   their `1 / scale` and amax written, exactly as [`cast_transpose_batched`] of the bf16
//!   copy would (TransformerEngine's FP8 parameters: the optimizer writes the FP8 weights, so
//!   no forward casts them).
//!
//! Nothing is read back to the host, so a whole optimizer step can be captured into a graph
//! and replayed: each replay advances the device step count. The learning rate is read on
//! the device ([`AdamWState::lr`]), so a schedule may change it between replays.
//!
//! The update is PyTorch's `torch.optim.AdamW` (decoupled weight decay, no amsgrad), each
//! operation explicitly rounded, so the host model [`reference::adamw`](crate::reference::adamw)
//! reproduces it bit for bit:
//!
//! ```text
//! g  = grad * grad_scale                       (grad_scale: 1, or a clipping factor)
//! m  = beta1 m + (1 - beta1) g                 (one fma)
//! v  = beta2 v + (1 - beta2) g g               (one fma)
//! p  = p (1 - lr wd) - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//! ```
//!
//! [`cast_transpose_batched`]: crate::cast_transpose_batched

use cuda_graph::half::bf16;
use cuda_graph::{DeviceBuffer, Error, KernelArgs, LaunchConfig, Result, Stream};

use crate::cast_transpose::{BatchedCastOut, batch_numel, blocks_per_matrix};
use crate::format::DType;
use crate::module::kernel;
use crate::quantize::ALIGN;
use crate::tensor::{DeviceScalar, HpBuffer, check_align};

/// Tile edge (bytes), threads and resident blocks per SM of the FP8 transpose (`TT`,
/// `TRANSPOSE_THREADS`, `TRANSPOSE_CTAS_PER_SM` in `kernels/adamw.cuh`).
const TRANSPOSE_TILE: usize = 128;
const TRANSPOSE_THREADS: u32 = 256;
const TRANSPOSE_CTAS_PER_SM: u32 = 4;
/// Threads per block of the elementwise update (`ADAMW_THREADS`).
const ELEMENTWISE_THREADS: u32 = 256;
/// Blocks per SM of the elementwise update's grid-stride grid.
const ELEMENTWISE_BLOCKS_PER_SM: u32 = 8;
/// Elements of the device state: step count, learning rate, `beta1^t`, `beta2^t`.
const STATE_LEN: usize = 4;

/// AdamW's hyperparameters (PyTorch's `torch.optim.AdamW` names and defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    /// The learning rate the state starts with ([`AdamWState::lr`] holds the current one).
    pub lr: f32,
    /// The first moment's decay.
    pub beta1: f32,
    /// The second moment's decay.
    pub beta2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// Decoupled weight decay (the weights are multiplied by `1 - lr * weight_decay`).
    pub weight_decay: f32,
}

impl Default for AdamW {
    /// PyTorch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 1e-2.
    fn default() -> AdamW {
        AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

impl AdamW {
    /// Checks the values: finite; `0 <= beta1, beta2 < 1`; `eps > 0`; `lr >= 0`;
    /// `weight_decay >= 0`.
    pub fn check(&self) -> Result<()> {
        let AdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } = *self;
        let bad = |what: &str| Err(Error::InvalidArgument(format!("AdamW: {what} ({self:?})")));
        if ![lr, beta1, beta2, eps, weight_decay]
            .iter()
            .all(|v| v.is_finite())
        {
            return bad("every hyperparameter must be finite");
        }
        if !(0.0..1.0).contains(&beta1) || !(0.0..1.0).contains(&beta2) {
            return bad("beta1 and beta2 must lie in [0, 1)");
        }
        if eps <= 0.0 {
            return bad("eps must be positive");
        }
        if lr < 0.0 || weight_decay < 0.0 {
            return bad("lr and weight_decay must not be negative");
        }
        Ok(())
    }

    /// The kernels' by-value hyperparameters `(beta1, beta2, eps, weight_decay)`.
    fn kernel_hyper(&self) -> [f32; 4] {
        [self.beta1, self.beta2, self.eps, self.weight_decay]
    }
}

/// One tensor an update works on: f32 master weights, their gradient and their two moments,
/// all of the same length; the moments start at zero. `bf16_copy`, when given (same length),
/// receives the new weights rounded to bf16 (a model's working copy).
#[derive(Debug, Clone, Copy)]
pub struct AdamWTensor<'a> {
    /// The weights, updated in place.
    pub param: &'a DeviceBuffer<f32>,
    /// Their gradient, f32 or bf16.
    pub grad: HpBuffer<'a>,
    /// The first moment (`exp_avg`), updated in place.
    pub exp_avg: &'a DeviceBuffer<f32>,
    /// The second moment (`exp_avg_sq`), updated in place.
    pub exp_avg_sq: &'a DeviceBuffer<f32>,
    /// Where the new weights go as bf16, if anywhere.
    pub bf16_copy: Option<&'a DeviceBuffer<bf16>>,
}

impl AdamWTensor<'_> {
    /// Checks lengths (all equal, `n` if given), the gradient's type and 16-byte alignment
    /// (8 is all a bf16 buffer needs, but every buffer from `alloc` has 256). Returns the
    /// length.
    fn check(&self, what: &str, n: Option<usize>) -> Result<usize> {
        if self.grad.dtype() == DType::F16 {
            return Err(Error::InvalidArgument(format!(
                "{what}: the gradient must be f32 or bf16, not f16"
            )));
        }
        let (len, want) = (self.param.len(), n.unwrap_or(self.param.len()));
        if len != want {
            return Err(Error::InvalidArgument(format!(
                "{what}: the weights have {len} elements, the shape needs {want}"
            )));
        }
        let copy = self.bf16_copy.map(|c| (c.len(), c.as_raw()));
        for (name, buf) in [
            ("weights", Some((len, self.param.as_raw()))),
            ("gradient", Some((self.grad.len(), self.grad.device_ptr()))),
            ("exp_avg", Some((self.exp_avg.len(), self.exp_avg.as_raw()))),
            (
                "exp_avg_sq",
                Some((self.exp_avg_sq.len(), self.exp_avg_sq.as_raw())),
            ),
            ("bf16 copy", copy),
        ] {
            let Some((l, addr)) = buf else { continue };
            if l != want {
                return Err(Error::InvalidArgument(format!(
                    "{what}: {name} has {l} elements, the weights {want}"
                )));
            }
            check_align(format_args!("{what} {name}"), addr, ALIGN)?;
        }
        Ok(want)
    }

    /// Pushes `param, grad, exp_avg, exp_avg_sq, copy` (a null copy when none).
    fn push_to<'k>(&self, args: KernelArgs<'k>, null: &'k u64) -> KernelArgs<'k>
    where
        Self: 'k,
    {
        let args = self
            .grad
            .push_to(args.arg(self.param))
            .arg(self.exp_avg)
            .arg(self.exp_avg_sq);
        match self.bf16_copy {
            Some(c) => args.arg(c),
            None => args.arg(null),
        }
    }
}

/// An optimizer's device state (see the [module documentation](self)): the step count, the
/// learning rate and the bias-correction powers, shared by every tensor it updates.
#[derive(Debug)]
pub struct AdamWState {
    hyper: AdamW,
    /// `[steps, lr, beta1^steps, beta2^steps]`.
    state: DeviceBuffer<f32>,
}

impl AdamWState {
    /// A state at step 0 with `hyper` (checked) and its learning rate (uploads and waits; not
    /// during a capture).
    pub fn new(stream: &Stream, hyper: AdamW) -> Result<AdamWState> {
        hyper.check()?;
        let init: [f32; STATE_LEN] = [0.0, hyper.lr, 1.0, 1.0];
        let state = DeviceBuffer::from_host(stream, &init)?;
        Ok(AdamWState { hyper, state })
    }

    /// The hyperparameters (`lr` as given at construction).
    pub fn hyper(&self) -> AdamW {
        self.hyper
    }

    /// The learning rate on the device: write it ([`DeviceScalar::write`], or any kernel) to
    /// change it for the next updates.
    pub fn lr(&self) -> Result<DeviceScalar> {
        DeviceScalar::at(&self.state, 1)
    }

    /// The whole state, `[steps, lr, beta1^steps, beta2^steps]` (f32; the count is exact to
    /// 2^24 steps), e.g. to save and restore it with the moments.
    pub fn buffer(&self) -> &DeviceBuffer<f32> {
        &self.state
    }

    /// The completed steps (reads and waits; not during a capture).
    pub fn steps(&self, stream: &Stream) -> Result<u64> {
        Ok(DeviceScalar::at(&self.state, 0)?.read(stream)? as u64)
    }

    /// Enqueues the start of a step: the count advances and the bias corrections with it.
    /// Every update of the step follows it on the stream (an update before the first
    /// `begin_step` would divide by `1 - beta1^0 = 0`).
    pub fn begin_step(&self, stream: &Stream) -> Result<()> {
        let (k, _) = kernel(stream.context(), "fp8_adamw_begin")?;
        let args = KernelArgs::new()
            .arg(&self.state)
            .arg(&self.hyper.beta1)
            .arg(&self.hyper.beta2);
        // SAFETY: one thread writes elements 0, 2 and 3 of the state (4 elements).
        unsafe { stream.launch_pdl(&k, &LaunchConfig::linear(1, 32), &args) }
    }

    /// Enqueues the update of `t` (see the [module documentation](self)), its gradient
    /// multiplied by `grad_scale` when given (read on the device: a clipping factor).
    ///
    /// Requirements (checked before any launch; nothing is written on an error): every
    /// buffer of `t` has the weights' length; the gradient is f32 or bf16; every buffer is
    /// 16-byte aligned.
    pub fn update(
        &self,
        stream: &Stream,
        t: &AdamWTensor<'_>,
        grad_scale: Option<&DeviceScalar>,
    ) -> Result<()> {
        let n = t.check("AdamW update", None)?;
        if n == 0 {
            return Ok(());
        }
        let name = format!("fp8_adamw_{}", t.grad.dtype().name());
        let (k, sms) = kernel(stream.context(), &name)?;
        let (null, n64) = (0u64, n as u64);
        let (hyper, gs) = (self.hyper.kernel_hyper(), scalar_ptr(grad_scale));
        let args = t
            .push_to(uses_scale(KernelArgs::new(), grad_scale), &null)
            .arg(&n64)
            .arg(&self.state)
            .arg(&hyper)
            .arg(&gs);
        let cfg = batched_grid(
            n.div_ceil(4 * ELEMENTWISE_THREADS as usize),
            (sms, ELEMENTWISE_BLOCKS_PER_SM),
            1,
            ELEMENTWISE_THREADS,
        );
        // SAFETY: the kernel touches elements 0..n of the weights, gradient, moments and copy
        // (all checked to hold exactly n elements and to be 16-byte aligned, its widest
        // access), and reads the 4-element state and the scale's element.
        unsafe { stream.launch_pdl(&k, &cfg, &args) }
    }

    /// Enqueues the update of `count` matrices of `[rows, cols]` (matrix `g` at element
    /// `g * rows * cols` of every buffer of `t`) with their FP8 cast-transpose into `out`
    /// (two launches: the update writing the row-major FP8 bytes, then their transpose): the
    /// new weights rounded to bf16 are cast with matrix `g`'s scale into `out.data` and
    /// `out.data_t` at byte `g * rows * cols`, `1 / scale` is written to its scale_inv slot
    /// and `max |w|` maxed into its amax slot; the bytes and scalars are exactly those of
    /// [`update`](Self::update) with a bf16 copy followed by
    /// [`cast_transpose_batched`](crate::cast_transpose_batched) of that copy.
    ///
    /// Requirements (checked before any launch; nothing is written on an error): as
    /// [`update`](Self::update), with every buffer of `t` holding `count * rows * cols`
    /// elements, and as [`cast_transpose_batched`](crate::cast_transpose_batched) for `out`
    /// (`1 <= count <= MAX_BATCH`, outputs of `count * rows * cols` bytes, slots inside
    /// their buffers).
    pub fn update_cast_transpose_batched(
        &self,
        stream: &Stream,
        t: &AdamWTensor<'_>,
        (count, rows, cols): (usize, usize, usize),
        out: &BatchedCastOut<'_>,
        grad_scale: Option<&DeviceScalar>,
    ) -> Result<()> {
        let what = "AdamW update + cast_transpose_batched";
        let n = batch_numel(what, (count, rows, cols))?;
        t.check(what, Some(n))?;
        for (name, len, addr) in [
            ("row-major output", out.data.len(), out.data.as_raw()),
            ("transposed output", out.data_t.len(), out.data_t.as_raw()),
        ] {
            if len != n {
                return Err(Error::InvalidArgument(format!(
                    "{what}: {name} has {len} bytes, {count} x [{rows}, {cols}] needs {n}"
                )));
            }
            check_align(format_args!("{what} {name}"), addr, ALIGN)?;
        }
        let slots = out.kernel_slots(what, count)?;
        let name = format!(
            "fp8_adamw_cast_{}_{}",
            t.grad.dtype().name(),
            out.format.name()
        );
        let (k, sms) = kernel(stream.context(), &name)?;
        let (null, rows64, cols64) = (0u64, rows as u64, cols as u64);
        // The 4-wide path needs every matrix 4-element aligned (the bases are 16-byte).
        let vec = i32::from((rows * cols) % 4 == 0);
        let (hyper, gs) = (self.hyper.kernel_hyper(), scalar_ptr(grad_scale));
        let indices = slots.map(|s| s[0]);
        let strides = slots.map(|s| s[1]);
        let args = t
            .push_to(uses_scale(KernelArgs::new(), grad_scale), &null)
            .arg(out.data)
            .arg(&rows64)
            .arg(&cols64)
            .arg(&self.state)
            .arg(&hyper)
            .arg(&gs)
            .arg(out.scale.first().buffer())
            .arg(out.scale_inv.first().buffer())
            .arg(out.amax.first().buffer())
            .arg(&indices)
            .arg(&strides)
            .arg(&vec);
        let per_matrix = (rows * cols).div_ceil(4 * ELEMENTWISE_THREADS as usize);
        let cfg = batched_grid(
            per_matrix,
            (sms, ELEMENTWISE_BLOCKS_PER_SM),
            count,
            ELEMENTWISE_THREADS,
        );
        // SAFETY: the blocks of matrix g touch its rows * cols elements (at g * rows * cols) of
        // the weights, gradient, moments, copy and y, which hold count * rows * cols each
        // (checked), 16-byte aligned (the 4-wide path runs only when every matrix starts
        // 4-element aligned); the slots first + g * stride (g < count) lie inside their
        // buffers (checked); it reads the 4-element state and the scale's element.
        unsafe { stream.launch_pdl(&k, &cfg, &args) }?;
        let (k, _) = kernel(stream.context(), "fp8_transpose_batched")?;
        let tiles = rows.div_ceil(TRANSPOSE_TILE) * cols.div_ceil(TRANSPOSE_TILE);
        let args = KernelArgs::new()
            .arg(out.data)
            .arg(out.data_t)
            .arg(&rows64)
            .arg(&cols64);
        let cfg = batched_grid(
            tiles,
            (sms, TRANSPOSE_CTAS_PER_SM),
            count,
            TRANSPOSE_THREADS,
        );
        // SAFETY: the blocks of matrix g read its rows * cols bytes of data and write as many
        // of data_t (both count * rows * cols bytes, 16-byte aligned: checked), bound-checking
        // every byte of a tile off the 16-byte path (which needs rows and cols multiples of
        // 16, so every 16-byte piece is aligned).
        unsafe { stream.launch_pdl(&k, &cfg, &args) }
    }
}

/// A grid of `count` matrices (`blockIdx.y`), each with the blocks [`blocks_per_matrix`]
/// gives for `units` of work (at most `(sms, per_sm)` resident blocks shared by them), of
/// `threads` threads. `count <= MAX_BATCH` (checked by the callers).
fn batched_grid(
    units: usize,
    (sms, per_sm): (u32, u32),
    count: usize,
    threads: u32,
) -> LaunchConfig {
    let count = count as u32;
    let units = u32::try_from(units).unwrap_or(u32::MAX);
    LaunchConfig {
        grid: (blocks_per_matrix(units, sms, per_sm, count), count, 1),
        ..LaunchConfig::linear(1, threads)
    }
}

/// The kernels' `grad_scale` pointer: the scalar's own address, or null.
fn scalar_ptr(s: Option<&DeviceScalar>) -> u64 {
    s.map_or(0, DeviceScalar::device_ptr)
}

/// `args` with the buffer of `grad_scale` (passed by address, [`scalar_ptr`]) marked as used,
/// so that a captured graph keeps it alive.
fn uses_scale<'a>(args: KernelArgs<'a>, grad_scale: Option<&'a DeviceScalar>) -> KernelArgs<'a> {
    match grad_scale {
        Some(s) => args.uses(s.buffer()),
        None => args,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hyperparameters_are_checked() {
        assert!(AdamW::default().check().is_ok());
        for bad in [
            AdamW {
                lr: f32::NAN,
                ..AdamW::default()
            },
            AdamW {
                beta1: 1.0,
                ..AdamW::default()
            },
            AdamW {
                beta2: -0.1,
                ..AdamW::default()
            },
            AdamW {
                eps: 0.0,
                ..AdamW::default()
            },
            AdamW {
                lr: -1e-3,
                ..AdamW::default()
            },
            AdamW {
                weight_decay: -1.0,
                ..AdamW::default()
            },
        ] {
            let e = bad.check().unwrap_err().to_string();
            assert!(e.contains("AdamW"), "{e}");
        }
    }

    /// The kernels' f32 arithmetic (the host model) stays within a few f32 roundings per step
    /// of the formula evaluated in f64 over 200 steps (the bias corrections by powi there,
    /// by running products in the state).
    #[test]
    fn host_model_follows_the_f64_formula() {
        use crate::reference::{adamw, adamw_begin};
        let h = AdamW {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.05,
        };
        let [b1, b2, lr, wd, eps] = [h.beta1, h.beta2, h.lr, h.weight_decay, h.eps].map(f64::from);
        let mut state = [0.0f32, h.lr, 1.0, 1.0];
        let (mut p, mut m, mut v) = (0.3f32, 0.0f32, 0.0f32);
        let (mut pd, mut md, mut vd) = (0.3f64, 0.0f64, 0.0f64);
        let mut worst = 0f64;
        for t in 1..=200i32 {
            let g = ((f64::from(t) * 0.7).sin() * 0.1) as f32;
            adamw_begin(&mut state, h.beta1, h.beta2);
            adamw(&h, &state, g, 1.0, &mut p, &mut m, &mut v);
            let gd = f64::from(g);
            pd *= 1.0 - lr * wd;
            md = b1 * md + (1.0 - b1) * gd;
            vd = b2 * vd + (1.0 - b2) * gd * gd;
            let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
            pd -= lr / bc1 * md / (vd.sqrt() / bc2.sqrt() + eps);
            worst = worst.max((f64::from(p) - pd).abs());
        }
        assert_eq!(state[0], 200.0);
        // p moves by up to lr = 1e-2 a step; each step's f32 roundings are ~1e-8 of it.
        assert!(worst < 2e-6, "host model off the f64 formula by {worst:e}");
        assert!((pd - 0.3).abs() > 1e-2, "the weights moved: {pd}");
    }
}
