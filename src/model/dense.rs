//! [`Dense`]: the model's linear layers (attention's QKV and output projections, the LM
//! head), `y = x W^T` over bf16 activations with FP8 GEMMs and per-tensor delayed scaling.
//!
//! The three GEMMs are those of [`Fp8Linear`](crate::linear::Fp8Linear) (see the layouts in
//! [`fp8_kernels::gemm`]): forward `Y = X . W^T` (E4M3 x E4M3), data gradient `dX = dY . W`
//! (E5M2 x E4M3, B = `W^T`), weight gradient `dW (+)= dY^T . X` (E5M2 x E4M3 from the
//! cast-transposes of dY and X), accumulated in f32. Activations and their gradients are
//! bf16 (the output may be f32: the LM head's logits); the master weights and their gradient
//! are f32, and the FP8 copies of W and `W^T` are cast from the master once per step
//! ([`Dense::cast_weight`]).
//!
//! FP8 state: three consecutive tensors of a shared [`DelayedScaling`] starting at the
//! layer's first tensor: x (E4M3), W (E4M3), dY (E5M2) ([`crate::linear::FORMATS`]). Each
//! cast reads its tensor's scale and maxes `|value|` into its amax; the caller updates the
//! state once per step. What the backward of a microbatch needs from its forward, `X^T` and
//! the `scale_inv` it was cast with, lives in caller-owned [`DenseSaved`] buffers (one set
//! per microbatch); everything else is the layer's scratch, shared by its passes, which run
//! one at a time on one stream.

use std::sync::Arc;

use cuda_graph::half::bf16;
use cuda_graph::{DeviceBuffer, Error, Result, Stream};
use fp8_kernels::gemm::{GemmOptions, GemmOut, GemmShape, Operand, gemm};
use fp8_kernels::{DelayedScaling, DeviceScalar, Fp8Format, Fp8Tensor, cast_transpose};

use crate::linear::{FORMATS, TENSORS, check_shape};
use crate::zeroed;

/// Offsets of x, W and dY from a layer's first tensor.
const X: usize = 0;
const W: usize = 1;
const DY: usize = 2;

/// What one microbatch's backward reads from its forward: `X^T` (`[in, tokens]` E4M3
/// bytes) and the `scale_inv` X was cast with.
#[derive(Debug)]
pub struct DenseSaved {
    /// `X^T`, E4M3.
    pub x_t: DeviceBuffer<u8>,
    /// The `scale_inv` of the cast (one f32, a view of its own buffer).
    pub x_si: DeviceScalar,
}

impl DenseSaved {
    /// The saved buffers of `layer`'s passes, zeroed (written by each forward).
    pub fn alloc(stream: &Stream, layer: &Dense) -> Result<DenseSaved> {
        Ok(DenseSaved {
            x_t: zeroed(stream, layer.tokens * layer.in_features)?,
            x_si: DeviceScalar::new(stream, 1.0)?,
        })
    }
}

/// An FP8 linear layer over bf16 activations; see the [module documentation](self).
pub struct Dense {
    tokens: usize,
    in_features: usize,
    out_features: usize,
    scaling: Arc<DelayedScaling>,
    first_tensor: usize,
    /// `[out, in]` f32 master weights and their gradient.
    w: DeviceBuffer<f32>,
    dw: DeviceBuffer<f32>,
    /// W's E4M3 copy `[out, in]` (state's scale and amax, its own `scale_inv`) and `W^T`.
    w_fp8: Fp8Tensor,
    w_t: DeviceBuffer<u8>,
    /// Scratch: the forward's E4M3 X `[tokens, in]`, the backward's E5M2 dY `[tokens, out]`,
    /// `dY^T` `[out, tokens]` and dY's `scale_inv`.
    x_fp8: DeviceBuffer<u8>,
    dy_fp8: DeviceBuffer<u8>,
    dy_t: DeviceBuffer<u8>,
    dy_si: DeviceScalar,
}

impl std::fmt::Debug for Dense {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dense")
            .field("tokens", &self.tokens)
            .field("in_features", &self.in_features)
            .field("out_features", &self.out_features)
            .field("first_tensor", &self.first_tensor)
            .finish()
    }
}

impl Dense {
    /// A layer of `tokens` rows, `in_features -> out_features`, with master weights `weight`
    /// (`[out, in]` row-major), its gradient zeroed, using tensors `first_tensor ..
    /// first_tensor + 3` of `scaling` (formats [`FORMATS`]). Every dimension must be a
    /// positive multiple of 16 ([`check_shape`]). Allocates and uploads (not in a capture).
    pub fn new(
        stream: &Stream,
        (tokens, in_features, out_features): (usize, usize, usize),
        weight: &[f32],
        scaling: Arc<DelayedScaling>,
        first_tensor: usize,
    ) -> Result<Dense> {
        check_shape(tokens, in_features, out_features)?;
        if weight.len() != in_features * out_features {
            return Err(Error::InvalidArgument(format!(
                "Dense: weight has {} elements, [{out_features}, {in_features}] needs {}",
                weight.len(),
                in_features * out_features
            )));
        }
        for (i, want) in FORMATS.iter().enumerate() {
            let t = first_tensor.saturating_add(i);
            if scaling.format(t) != Some(*want) {
                return Err(Error::InvalidArgument(format!(
                    "Dense: tensor {t} of the scaling state must be {want:?} (x, W, dY at \
                     {first_tensor}..{}), the state has {:?}",
                    first_tensor + TENSORS,
                    scaling.format(t)
                )));
            }
        }
        let zeroed_u8 = |n: usize| zeroed::<u8>(stream, n);
        let w = DeviceBuffer::from_host(stream, weight)?;
        let dw = zeroed::<f32>(stream, weight.len())?;
        let w_fp8 = Fp8Tensor::from_parts(
            zeroed_u8(weight.len())?,
            &[out_features, in_features],
            Fp8Format::E4M3,
            scaling.scale(first_tensor + W)?,
            DeviceScalar::new(stream, 1.0)?,
            scaling.amax(first_tensor + W)?,
        )?;
        let layer = Dense {
            tokens,
            in_features,
            out_features,
            first_tensor,
            w,
            dw,
            w_fp8,
            w_t: zeroed_u8(weight.len())?,
            x_fp8: zeroed_u8(tokens * in_features)?,
            dy_fp8: zeroed_u8(tokens * out_features)?,
            dy_t: zeroed_u8(tokens * out_features)?,
            dy_si: DeviceScalar::new(stream, 1.0)?,
            scaling,
        };
        stream.synchronize()?;
        Ok(layer)
    }

    /// Rows per pass.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Input width.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output width.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// The first of the layer's three tensors in the scaling state.
    pub fn first_tensor(&self) -> usize {
        self.first_tensor
    }

    /// The f32 master weights `[out, in]` (the optimizer updates them in place).
    pub fn weight(&self) -> &DeviceBuffer<f32> {
        &self.w
    }

    /// Their gradient `[out, in]` f32.
    pub fn weight_grad(&self) -> &DeviceBuffer<f32> {
        &self.dw
    }

    /// Cast-transposes the master weights into the FP8 copies the GEMMs read (`W`, `W^T`,
    /// W's amax maxed); skipped on the device when `noop` reads 1.0. Once per step, before
    /// the first forward.
    pub fn cast_weight(&self, stream: &Stream, noop: Option<&DeviceScalar>) -> Result<()> {
        cast_transpose(
            stream,
            &self.w,
            self.out_features,
            self.in_features,
            &self.w_fp8,
            &self.w_t,
            noop,
        )
    }

    /// `y = x W^T`: casts x (E4M3, delayed scale; `X^T` and its `scale_inv` into `saved`),
    /// then the FP8 GEMM into `y` (`[tokens, out]`, bf16 or f32). `fast` takes the GEMM's
    /// fast accumulation (TransformerEngine's forward default).
    pub fn forward<'a>(
        &'a self,
        stream: &Stream,
        x: &'a DeviceBuffer<bf16>,
        y: impl Into<GemmOut<'a>>,
        saved: &'a DenseSaved,
        fast: bool,
    ) -> Result<()> {
        let (m, k, n) = (self.tokens, self.in_features, self.out_features);
        self.check_len("forward input", x.len(), m * k)?;
        self.check_saved(saved)?;
        let x_fp8 = self.tensor(&self.x_fp8, m, k, X, &saved.x_si)?;
        cast_transpose(stream, x, m, k, &x_fp8, &saved.x_t, None)?;
        gemm(
            stream,
            GemmShape::new(m, n, k),
            Operand {
                data: &self.x_fp8,
                format: Fp8Format::E4M3,
                scale_inv: &saved.x_si,
            },
            // E4M3, [out, in]: the layer's cached weight, format and scale with it.
            Operand::from_tensor(&self.w_fp8),
            y,
            GemmOptions::new().fast_accumulation(fast),
        )
    }

    /// The backward of a microbatch whose forward wrote `saved`: casts `dy` (`[tokens,
    /// out]`, E5M2, delayed scale), then `dx = dY . W` (when `dx` is given) and `dW (+)=
    /// dY^T . X` (added when `accumulate`, written otherwise).
    pub fn backward(
        &self,
        stream: &Stream,
        dy: &DeviceBuffer<bf16>,
        dx: Option<&DeviceBuffer<bf16>>,
        saved: &DenseSaved,
        accumulate: bool,
    ) -> Result<()> {
        let (m, k, n) = (self.tokens, self.in_features, self.out_features);
        self.check_len("output gradient", dy.len(), m * n)?;
        if let Some(dx) = dx {
            self.check_len("input gradient", dx.len(), m * k)?;
        }
        self.check_saved(saved)?;
        let dy_fp8 = self.tensor(&self.dy_fp8, m, n, DY, &self.dy_si)?;
        cast_transpose(stream, dy, m, n, &dy_fp8, &self.dy_t, None)?;
        if let Some(dx) = dx {
            gemm(
                stream,
                GemmShape::new(m, k, n),
                Operand {
                    data: &self.dy_fp8,
                    format: Fp8Format::E5M2,
                    scale_inv: &self.dy_si,
                },
                Operand {
                    data: &self.w_t,
                    format: Fp8Format::E4M3,
                    scale_inv: self.w_fp8.scale_inv(),
                },
                dx,
                GemmOptions::new(),
            )?;
        }
        gemm(
            stream,
            GemmShape::new(n, k, m),
            Operand {
                data: &self.dy_t,
                format: Fp8Format::E5M2,
                scale_inv: &self.dy_si,
            },
            Operand {
                data: &saved.x_t,
                format: Fp8Format::E4M3,
                scale_inv: &saved.x_si,
            },
            &self.dw,
            GemmOptions::new().accumulate(accumulate),
        )
    }

    /// An FP8 view of `data` (`[rows, cols]`) cast with tensor `offset`'s scale and amax and
    /// writing its `scale_inv` to `si`.
    fn tensor(
        &self,
        data: &DeviceBuffer<u8>,
        rows: usize,
        cols: usize,
        offset: usize,
        si: &DeviceScalar,
    ) -> Result<Fp8Tensor> {
        let t = self.first_tensor + offset;
        Fp8Tensor::from_parts(
            data.share(),
            &[rows, cols],
            FORMATS[offset],
            self.scaling.scale(t)?,
            si.clone(),
            self.scaling.amax(t)?,
        )
    }

    fn check_len(&self, what: &str, got: usize, want: usize) -> Result<()> {
        if got == want {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "{self:?}: the {what} has {got} elements, the layer takes {want}"
            )))
        }
    }

    fn check_saved(&self, saved: &DenseSaved) -> Result<()> {
        self.check_len("saved X^T", saved.x_t.len(), self.tokens * self.in_features)
    }
}
