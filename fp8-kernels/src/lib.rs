//! FP8 kernels for Hopper, written in CUDA, compiled by nvcc at build time and launched
//! through [`cuda_graph`] on any stream, captured or not.
//!
//! The kernels land family by family (quantize and scaling first, then GEMM and grouped
//! GEMM); this crate has none yet.
