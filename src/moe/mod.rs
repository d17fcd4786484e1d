//! The dropless top-k mixture-of-experts layer for FP8 training under CUDA graphs.
//!
//! * [`layer`]: [`MoeLayer`](layer::MoeLayer), SwiGLU experts with FP8 GEMMs and the full
//!   backward, a [`Callable`](graphed_callables::Callable) of the graphed-callables runtime:
//!   eager, breaking-layer graphs (router and combine graphed, experts eager on host-read
//!   counts) or full-layer graphs (grouped GEMMs reading the counts on the device);
//! * [`ep`]: [`ExpertParallelMoe`](ep::ExpertParallelMoe), the layer's experts spread over
//!   the ranks of a group (NCCL across GPUs, or [`LocalGroup`](ep::LocalGroup) threads on one
//!   device), equal to the single-GPU layer on each rank's tokens;
//! * [`optim`]: [`MoeAdamW`](optim::MoeAdamW), AdamW for the layer on the device, writing
//!   the FP8 expert weights itself when the layer asks for that (no cast in the step);
//! * [`routing`]: the router (softmax or sigmoid scores, top-k, gates, aux and z losses), the
//!   dispatch plan into the packed expert-major layout, the combine, and the backward of each,
//!   deterministic and free of host synchronisation;
//! * [`reference`](mod@reference): the f64 host model of the whole layer (forward and backward, and a
//!   variant that rounds where the device does) the tests hold the device to.

pub mod ep;
pub mod layer;
pub mod optim;
pub mod reference;
pub mod routing;
