//! [`ModelOptimizer`]: AdamW over every parameter of the [`Model`](super::Model), on the
//! device and capturable, with the gradients scaled by the step's clipping factor.
//!
//! The dense parameters (embedding, norms, projections, LM head) have f32 master weights
//! that are the parameters themselves; matrices take weight decay, norms and the embedding
//! none (two [`AdamWState`]s). Each MoE layer has its own [`MoeAdamW`], which ends every
//! expert weight's update with the FP8 cast the next forward reads.

use cuda_graph::{DeviceBuffer, Result, Stream};
use fp8_kernels::{AdamW, AdamWState, AdamWTensor, DeviceScalar, HpBuffer};

use crate::moe::optim::MoeAdamW;
use crate::zeroed;

/// One dense parameter: its weights (updated in place), gradient and moments.
#[derive(Debug)]
pub struct DenseParam {
    /// The name it has in checkpoints.
    pub name: String,
    /// f32 weights (a handle sharing the layer's memory).
    pub param: DeviceBuffer<f32>,
    /// Its f32 gradient (shared handle).
    pub grad: DeviceBuffer<f32>,
    /// AdamW's first moment.
    pub exp_avg: DeviceBuffer<f32>,
    /// AdamW's second moment.
    pub exp_avg_sq: DeviceBuffer<f32>,
    /// Whether weight decay applies.
    pub decay: bool,
}

/// AdamW over a model; see the [module documentation](self).
#[derive(Debug)]
pub struct ModelOptimizer {
    decay: AdamWState,
    no_decay: AdamWState,
    dense: Vec<DenseParam>,
    moe: Vec<MoeAdamW>,
}

impl ModelOptimizer {
    /// An optimizer over `dense` (name, weights, gradient, decay?) and the MoE layers'
    /// optimizers, with hyperparameters `hyper` (`weight_decay` for the decaying tensors;
    /// the MoE optimizers were made with theirs). Moments start at zero.
    pub fn new(
        stream: &Stream,
        hyper: AdamW,
        dense: Vec<(String, DeviceBuffer<f32>, DeviceBuffer<f32>, bool)>,
        moe: Vec<MoeAdamW>,
    ) -> Result<ModelOptimizer> {
        let dense = dense
            .into_iter()
            .map(|(name, param, grad, decay)| {
                Ok(DenseParam {
                    exp_avg: zeroed(stream, param.len())?,
                    exp_avg_sq: zeroed(stream, param.len())?,
                    name,
                    param,
                    grad,
                    decay,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let no_decay = AdamW {
            weight_decay: 0.0,
            ..hyper
        };
        Ok(ModelOptimizer {
            decay: AdamWState::new(stream, hyper)?,
            no_decay: AdamWState::new(stream, no_decay)?,
            dense,
            moe,
        })
    }

    /// The dense parameters.
    pub fn dense(&self) -> &[DenseParam] {
        &self.dense
    }

    /// The MoE layers' optimizers.
    pub fn moe(&self) -> &[MoeAdamW] {
        &self.moe
    }

    /// Every optimizer state's device buffer (`[steps, lr, beta1^t, beta2^t]`): the dense
    /// states, then the MoE layers'.
    pub fn states(&self) -> Vec<&AdamWState> {
        let mut s = vec![&self.decay, &self.no_decay];
        s.extend(self.moe.iter().map(|m| m.state()));
        s
    }

    /// Enqueues writing `lr` as every state's learning rate (a host-to-device copy; not
    /// during a capture: a step graph reads the rate from the device at each replay).
    pub fn set_lr(&self, stream: &Stream, lr: f32) -> Result<()> {
        for s in self.states() {
            s.lr()?.write(stream, lr)?;
        }
        Ok(())
    }

    /// Enqueues one step: every state's step count advances, then every parameter's
    /// update with its gradient multiplied by `grad_scale` (the clipping factor).
    pub fn step(&self, stream: &Stream, grad_scale: &DeviceScalar) -> Result<()> {
        self.decay.begin_step(stream)?;
        self.no_decay.begin_step(stream)?;
        for p in &self.dense {
            let state = if p.decay { &self.decay } else { &self.no_decay };
            let t = AdamWTensor {
                param: &p.param,
                grad: HpBuffer::F32(&p.grad),
                exp_avg: &p.exp_avg,
                exp_avg_sq: &p.exp_avg_sq,
                bf16_copy: None,
            };
            state.update(stream, &t, Some(grad_scale))?;
        }
        for m in &self.moe {
            m.step(stream, Some(grad_scale))?;
        }
        Ok(())
    }
}
