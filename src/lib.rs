//! `fp8_moe`: an FP8 MoE layer built on the workspace (`cuda-graph`, `fp8-kernels`).
//!
//! * [`linear::Fp8Linear`]: `y = x W^T (+ b)` with FP8 GEMMs (E4M3 forward, E5M2
//!   gradients) and per-tensor delayed scaling, implementing
//!   [`graphed_callables::Callable`] (weight casts, saved activations in the runtime's
//!   per-microbatch buffers) and usable eagerly with the same kernels; with FP8 off for it
//!   ([`graphed_callables::Slot::low_precision`]) it runs f32 GEMMs instead;
//! * [`moe::layer::MoeLayer`]: the dropless top-k SwiGLU MoE layer with FP8 expert GEMMs and
//!   the full backward, eager, breaking-layer or full-layer under graphed callables
//!   ([`moe`]);
//! * [`scaling::ScalingSnapshot`]: save and restore a delayed-scaling state around
//!   graphed-callables warmup.
//! * [`model::Model`]: the train job's byte-level MoE transformer (attention and MoE blocks
//!   over FP8 linears, AdamW, gradient clipping), its training step eager or as CUDA graphs
//!   in four modes with the same bits, its checkpointable state, evaluation and generation;
//! * [`train`]: the train job itself (`fp8-moe train`): corpus, sampler, checkpoints, report.
//! * [`dist`]: beyond one GPU: a launched process's place in the job, its NCCL communicator,
//!   and the FP8 amax reduction over NCCL ([`dist::NcclGroup`], TransformerEngine's
//!   `fp8_group`).
//!
//! The binary `fp8-moe` (src/main.rs) is the command-line front end and benchmark.

#![deny(missing_docs)]

pub mod dist;
pub mod linear;
pub mod model;
pub mod moe;
pub mod rng;
pub mod scaling;
pub mod train;

pub use linear::Fp8Linear;
pub use moe::layer::{ExpertGemm, GradDtype, MoeLayer, MoeLayerConfig, MoeParams, WeightGrad};
pub use scaling::ScalingSnapshot;

/// `n` elements zeroed on `stream`. The crate's device buffers start defined: GEMM outputs
/// are written by TMA bulk stores, which compute-sanitizer's initcheck does not see, so a
/// buffer a GEMM fills first would read as uninitialised to it (scripts/sanitize.sh), and no
/// pass ever reads bytes nothing wrote.
pub(crate) fn zeroed<T: cuda_graph::DeviceRepr>(
    stream: &cuda_graph::Stream,
    n: usize,
) -> cuda_graph::Result<cuda_graph::DeviceBuffer<T>> {
    let b = cuda_graph::DeviceBuffer::alloc(stream.context(), n)?;
    b.memset_bytes(stream, 0)?;
    Ok(b)
}

/// The README's Rust examples, compiled (not run) as doctests of this crate, which depends on
/// every crate they use.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
