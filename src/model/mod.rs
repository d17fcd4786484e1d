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

use cuda_graph::{DeviceBuffer, DeviceRepr, Result, Stream};

/// `n` elements zeroed on `stream`. The model's buffers start defined: GEMM outputs are
/// written by TMA bulk stores, which compute-sanitizer's initcheck does not see, so a buffer
/// a GEMM fills first would read as uninitialised to it (scripts/sanitize.sh), and no pass
/// ever reads bytes nothing wrote.
pub(crate) fn zeroed<T: DeviceRepr>(stream: &Stream, n: usize) -> Result<DeviceBuffer<T>> {
    let b = DeviceBuffer::alloc(stream.context(), n)?;
    b.memset_bytes(stream, 0)?;
    Ok(b)
}
pub use transformer::{GraphMode, HostTensor, Model, StepStats};
