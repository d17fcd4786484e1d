//! The model's shape ([`ModelConfig`]) and the training run's settings ([`TrainConfig`]).

use cuda_graph::{Error, Result};
use serde::{Deserialize, Serialize};

/// The byte-level vocabulary.
pub const VOCAB: usize = 256;
/// The attention heads' width.
pub const HEAD_DIM: usize = 64;

/// The transformer's shape and the microbatch it is built for.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Model width `d`.
    pub d_model: usize,
    /// Attention heads (`d_model / heads` must be [`HEAD_DIM`]).
    pub heads: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Experts of each block's MoE layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Each expert's FFN width `F` (SwiGLU: fc1 is `[2F, d]`).
    pub ffn: usize,
    /// Tokens per sequence (the context).
    pub context: usize,
    /// Sequences per microbatch.
    pub batch: usize,
    /// Coefficient of the router's load-balancing loss, per layer.
    pub aux_coef: f32,
    /// RMSNorm's epsilon.
    pub norm_eps: f32,
}

impl Default for ModelConfig {
    /// Issue 14's default: d 512, 8 heads, 4 blocks, 8 experts top-2 with F = 1024, context
    /// 256, 16 sequences per microbatch.
    fn default() -> ModelConfig {
        ModelConfig {
            d_model: 512,
            heads: 8,
            layers: 4,
            experts: 8,
            top_k: 2,
            ffn: 1024,
            context: 256,
            batch: 16,
            aux_coef: 1e-2,
            norm_eps: 1e-5,
        }
    }
}

impl ModelConfig {
    /// Tokens per microbatch (`batch * context`).
    pub fn tokens(&self) -> usize {
        self.batch * self.context
    }

    /// Checks the shape: everything positive, `d_model = heads * 64`, `d_model`, `ffn` and
    /// the microbatch's tokens multiples of 16 (GEMM dimensions), `top_k <= experts`,
    /// finite non-negative coefficients.
    pub fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidArgument(format!("model config: {what}")));
        for (name, v) in [
            ("d_model", self.d_model),
            ("heads", self.heads),
            ("layers", self.layers),
            ("experts", self.experts),
            ("top_k", self.top_k),
            ("ffn", self.ffn),
            ("context", self.context),
            ("batch", self.batch),
        ] {
            if v == 0 {
                return bad(format!("{name} must be positive"));
            }
        }
        if self.heads.checked_mul(HEAD_DIM) != Some(self.d_model) {
            return bad(format!(
                "d_model {} must be heads ({}) x {HEAD_DIM}",
                self.d_model, self.heads
            ));
        }
        if self.ffn % 16 != 0 {
            return bad(format!("ffn {} must be a multiple of 16", self.ffn));
        }
        if self
            .batch
            .checked_mul(self.context)
            .is_none_or(|t| t % 16 != 0)
        {
            return bad(format!(
                "batch x context ({} x {}) must be a multiple of 16",
                self.batch, self.context
            ));
        }
        if self.top_k > self.experts {
            return bad(format!(
                "top_k {} exceeds the {} experts",
                self.top_k, self.experts
            ));
        }
        if !(self.aux_coef.is_finite() && self.aux_coef >= 0.0) {
            return bad(format!(
                "aux_coef {} must be finite and >= 0",
                self.aux_coef
            ));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return bad(format!("norm_eps {} must be finite and > 0", self.norm_eps));
        }
        Ok(())
    }

    /// Parameters of the model (embedding, blocks, final norm, head).
    pub fn parameters(&self) -> usize {
        let (d, e, f) = (self.d_model, self.experts, self.ffn);
        let block = 2 * d + 4 * d * d + e * d + e * 3 * f * d;
        2 * VOCAB * d + self.layers * block + d
    }
}

/// The optimizer and the run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Microbatches per optimizer step (gradient accumulation).
    pub microbatches: usize,
    /// Peak learning rate.
    pub lr: f32,
    /// Linear warmup steps from 0 to `lr`; cosine decay to `lr / 10` after.
    pub warmup: usize,
    /// Optimizer steps.
    pub steps: usize,
    /// AdamW's decoupled weight decay on the matrices (norms and the embedding take none).
    pub weight_decay: f32,
    /// AdamW's betas.
    pub betas: (f32, f32),
    /// AdamW's epsilon.
    pub eps: f32,
    /// The gradient-norm clip.
    pub clip: f32,
    /// The seed of the initial weights and the data.
    pub seed: u64,
}

impl Default for TrainConfig {
    fn default() -> TrainConfig {
        TrainConfig {
            microbatches: 4,
            lr: 1e-3,
            warmup: 20,
            steps: 500,
            weight_decay: 0.1,
            betas: (0.9, 0.95),
            eps: 1e-8,
            clip: 1.0,
            seed: 1234,
        }
    }
}

impl TrainConfig {
    /// The learning rate of step `step` (0-based): linear warmup over `warmup` steps, then a
    /// cosine from `lr` down to `lr / 10` at the last step.
    pub fn lr_at(&self, step: usize) -> f32 {
        if step < self.warmup {
            return self.lr * (step + 1) as f32 / self.warmup as f32;
        }
        let span = self.steps.saturating_sub(self.warmup).max(1) as f64;
        let t = ((step - self.warmup) as f64 / span).min(1.0);
        let cos = 0.5 * (1.0 + (std::f64::consts::PI * t).cos());
        (self.lr as f64 * (0.1 + 0.9 * cos)) as f32
    }

    /// Checks the settings: at least one microbatch and step, finite positive rates and a
    /// positive clip.
    pub fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidArgument(format!("train config: {what}")));
        if self.microbatches == 0 || self.steps == 0 {
            return bad("microbatches and steps must be positive".into());
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!("lr {} must be finite and > 0", self.lr));
        }
        if !(self.clip.is_finite() && self.clip > 0.0) {
            return bad(format!("clip {} must be finite and > 0", self.clip));
        }
        fp8_kernels::AdamW {
            lr: self.lr,
            beta1: self.betas.0,
            beta2: self.betas.1,
            eps: self.eps,
            weight_decay: self.weight_decay,
        }
        .check()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_issue_14s() {
        let c = ModelConfig::default();
        c.check().unwrap();
        assert_eq!(c.tokens(), 4096);
        assert_eq!(c.d_model / c.heads, HEAD_DIM);
        // 4 blocks of 2 norms, QKV + proj (4 d^2), router (E d), 8 experts of 3 F d.
        assert_eq!(
            c.parameters(),
            2 * 256 * 512 + 4 * (2 * 512 + 4 * 512 * 512 + 8 * 512 + 8 * 3 * 1024 * 512) + 512
        );
    }

    #[test]
    fn bad_configs_are_refused() {
        let ok = ModelConfig::default();
        for bad in [
            ModelConfig { heads: 7, ..ok },
            ModelConfig { layers: 0, ..ok },
            ModelConfig { top_k: 9, ..ok },
            ModelConfig { ffn: 1000, ..ok },
            ModelConfig {
                batch: 1,
                context: 15,
                ..ok
            },
            ModelConfig {
                aux_coef: f32::NAN,
                ..ok
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn schedule_warms_up_then_decays_to_a_tenth() {
        let t = TrainConfig {
            lr: 1.0,
            warmup: 10,
            steps: 110,
            ..TrainConfig::default()
        };
        assert!((t.lr_at(0) - 0.1).abs() < 1e-6);
        assert!((t.lr_at(9) - 1.0).abs() < 1e-6);
        assert!((t.lr_at(10) - 1.0).abs() < 1e-6);
        assert!((t.lr_at(60) - 0.55).abs() < 1e-6);
        assert!((t.lr_at(110) - 0.1).abs() < 1e-6);
        assert!((1..110).all(|s| t.lr_at(s) <= t.lr_at(s.min(9)) + 1e-6));
    }
}
