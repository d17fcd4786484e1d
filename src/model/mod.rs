//! The train job's model: a byte-level decoder-only transformer whose blocks are
//! [RMSNorm -> causal self-attention -> residual -> RMSNorm -> MoE -> residual], trained in
//! FP8 under CUDA graphs (`fp8-moe train`).
//!
//! * [`ops`]: the model's elementwise and reduction kernels (embedding, RMSNorm, residual
//!   adds, cross-entropy, gradient-norm clipping) with their backward passes;
//! * [`attention`]: causal multi-head self-attention (bf16, f32 softmax) and its backward;
//! * [`ops_reference`], [`attention_reference`]: their f64 host models, which the GPU tests
//!   compare against.

pub mod attention;
pub mod attention_reference;
pub mod ops;
pub mod ops_reference;
