//! The train job's model: a byte-level decoder-only transformer whose blocks are
//! [RMSNorm -> causal self-attention -> residual -> RMSNorm -> MoE -> residual], trained in
//! FP8 under CUDA graphs (`fp8-moe train`).
//!
//! * [`transformer::Model`]: the model, its training step in every [`GraphMode`], its
//!   checkpointable state, evaluation and generation;
//! * [`block::Block`]: one transformer block, a graphed callable;
//! * [`dense::Dense`]: the FP8 linear layers over bf16 activations;
//! * [`optim::ModelOptimizer`]: AdamW over every parameter;
//! * [`ops`]: the model's elementwise and reduction kernels (embedding, RMSNorm, residual
//!   adds, cross-entropy, gradient-norm clipping) with their backward passes;
//! * [`attention`]: causal multi-head self-attention (bf16, f32 softmax) and its backward;
//! * [`ops_reference`], [`attention_reference`]: their f64 host models, which the GPU tests
//!   compare against;
//! * [`config`]: the model's shape and the run's settings.

pub mod attention;
pub mod attention_reference;
pub mod block;
pub mod config;
pub mod dense;
pub mod ops;
pub mod ops_reference;
pub mod optim;
pub mod transformer;

pub use config::{ModelConfig, TrainConfig};

pub use transformer::{GraphMode, HostTensor, Model, StepStats};
