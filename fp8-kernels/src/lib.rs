//! FP8 kernels for Hopper, written in CUDA, compiled by nvcc at build time into one fatbin
//! (loaded once per context) and launched through [`cuda_graph`] on any stream, captured or
//! not.
//!
//! * [`Fp8Format`] (E4M3, E5M2) and [`DType`] (f32, f16, bf16 inputs and outputs);
//! * [`Fp8Tensor`]: FP8 bytes plus the device scalars that go with them ([`DeviceScalar`]:
//!   scale, scale_inv, amax); high-precision buffers are `DeviceBuffer<f32>`,
//!   `DeviceBuffer<f16>` or `DeviceBuffer<bf16>` (`half`'s types), passed as they are
//!   (launchers take `impl Into<`[`HpBuffer`]`>`);
//! * [`quantize`] (fused amax, optional noop flag), [`quantize_current`] (current scaling),
//!   [`amax`], [`dequantize`];
//! * [`cast_transpose`]: the FP8 cast row-major and transposed in one pass, amax fused;
//!   [`cast_transpose_batched`]: the same for a batch of equally shaped matrices (a MoE
//!   layer's expert weights) in one launch, each with its own scale, scale_inv and amax
//!   ([`ScalarSlots`]);
//! * the dropless MoE layer's casts, fused with its data movement and SwiGLU
//!   ([`gather_cast_transpose`], [`swiglu_cast_transpose`], [`swiglu_backward_cast_transpose`]):
//!   the permute into the packed expert-major layout, the combine's backward, the SwiGLU and
//!   its backward, each straight to FP8 row-major and transposed;
//! * [`quantize_blockwise`]: block-scaled quantize (1x128 or 128x128 blocks, [`BlockShape`]),
//!   fp32 scales written beside the data;
//! * [`DelayedScaling`]: TransformerEngine's delayed-scaling state for many tensors on the
//!   device, updated by one launch;
//! * [`optim`]: AdamW on the device, capturable ([`AdamWState`]), and fused with the FP8
//!   cast-transpose of the weights it updates (the optimizer writes the FP8 weights);
//! * [`reference`](mod@reference): the bit-exact CPU model the GPU tests compare against.
//!
//! Everything that changes per step (scales, amax, noop flags) is read from device memory by
//! the kernels, so a captured graph replays correctly as those values change. Launchers
//! validate shapes, lengths and alignment before enqueueing anything, never synchronise and
//! never allocate.
//!
//! Every kernel is launched with programmatic dependent launch where the device has it
//! ([`Stream::launch_pdl`](cuda_graph::Stream::launch_pdl); sm_90, `CUDA_GRAPH_PDL=0` turns it
//! off): it may be scheduled while the previous kernel on the stream still runs, and waits
//! (`griddepcontrol.wait`) before touching any memory, so results are unchanged while the
//! launch latency between back-to-back kernels (in a graph, a chain of them) is hidden. The
//! Hopper GEMM sets up its barriers and prefetches its tensor maps before the wait.
//!
//! Conversion semantics: round to nearest even; finite values beyond the max finite value
//! and +-inf saturate to +-max finite (448 for E4M3, 57344 for E5M2); NaN stays NaN.
//!
//! # Example
//!
//! ```no_run
//! use cuda_graph::{Context, DeviceBuffer, Stream};
//! use fp8_kernels::{Fp8Format, Fp8Tensor, quantize};
//!
//! let ctx = Context::default_device()?;
//! let stream = Stream::new(&ctx)?;
//! let x = DeviceBuffer::from_host(&stream, &[1.0f32, -2.5, 300.0, 1e6, 0.01])?;
//! let y = Fp8Tensor::new(&stream, &[5], Fp8Format::E4M3)?;
//! y.scale().write(&stream, 2.0)?;
//! quantize(&stream, &x, &y, None)?;
//! let bytes = y.data().to_vec(&stream)?;
//! assert_eq!(bytes[3], 0x7e); // 2e6 saturates to 448
//! assert_eq!(y.amax().read(&stream)?, 1e6); // amax of the unscaled input
//! assert_eq!(y.scale_inv().read(&stream)?, 0.5);
//! # Ok::<(), cuda_graph::Error>(())
//! ```

#![deny(missing_docs)]

mod block_scale;
mod cast_transpose;
mod format;
pub mod gemm;
mod module;
pub mod moe_cast;
pub mod optim;
#[cfg(test)]
mod prop_util;
mod quantize;
pub mod reference;
mod scaling;
mod tensor;

pub use block_scale::{BlockShape, quantize_blockwise};
pub use cast_transpose::{
    BatchedCastOut, MAX_BATCH, ScalarSlots, TILE_COLS, cast_transpose, cast_transpose_batched,
    tile_rows,
};
pub use format::{DType, Fp8Format};
pub use module::{FATBIN, module};
pub use moe_cast::{
    CastScaling, FusedCastOut, Gather, MAX_TOP_K, RowsInUse, gather_cast_transpose,
    swiglu_backward_cast_transpose, swiglu_cast_transpose,
};
pub use optim::{AdamW, AdamWState, AdamWTensor};
pub use quantize::{ALIGN, FUSED_CURRENT_MAX, amax, dequantize, quantize, quantize_current};
pub use scaling::{
    AmaxAlgo, DelayedScaling, IdentityGroup, MAX_HISTORY, MAX_MARGIN, ReductionGroup,
};
pub use tensor::{DeviceScalar, Fp8Tensor, HpBuffer};
