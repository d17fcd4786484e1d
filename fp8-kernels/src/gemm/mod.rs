//! FP8 GEMM: `D[M,N] = scale_inv_a * scale_inv_b * A[M,K] x B[N,K]^T (+ bias) (+ D)`.
//!
//! Both operands are K-major ("TN"): A is `[M, K]` row-major and B is `[N, K]` row-major,
//! which is how a linear layer stores activations and weights. The other two GEMMs of a
//! linear layer take cast-transpose outputs so they have the same layout:
//! * forward: `Y[M,N] = X[M,K] . W[N,K]^T` — A = X, B = W;
//! * data gradient: `dX[M,K] = dY[M,N] . W[N,K]` — A = dY, B = W^T (`[K,N]`, the
//!   cast-transpose of W);
//! * weight gradient: `dW[N,K] = dY^T . X` — A = dY^T (`[N,M]`), B = X^T (`[K,M]`), both
//!   cast-transposes.
//!
//! (Work in progress: the types below are the contract between the entry points and the
//! kernel paths.)

use cuda_graph::DeviceBuffer;

pub(crate) mod hopper;

use crate::format::Fp8Format;
use crate::tensor::DeviceScalar;

/// Where a GEMM writes its output: `[M, N]` row-major (or `[G, m_max, N]` grouped).
pub enum GemmOut<'a> {
    /// bf16 output, as `u16` bits.
    Bf16(&'a DeviceBuffer<u16>),
    /// f32 output.
    F32(&'a DeviceBuffer<f32>),
}

/// An optional bias of `N` elements, added to every row.
pub enum Bias<'a> {
    /// bf16 bias, as `u16` bits.
    Bf16(&'a DeviceBuffer<u16>),
    /// f32 bias.
    F32(&'a DeviceBuffer<f32>),
}

/// One FP8 operand: K-major data and its per-tensor `scale_inv` on the device.
pub struct Operand<'a> {
    /// `[rows, K]` row-major bytes (grouped: `[G, rows, K]`).
    pub data: &'a DeviceBuffer<u8>,
    /// E4M3 or E5M2.
    pub format: Fp8Format,
    /// Multiplies the product; read on the device at run time.
    pub scale_inv: &'a DeviceScalar,
}

/// A validated problem, as the kernel paths receive it.
#[allow(dead_code)] // the entry points and kernel paths are being built on it
pub(crate) struct GemmProblem<'a> {
    /// Rows of A and D (grouped: `m_max`, rows per group).
    pub m: usize,
    /// Rows of B, columns of D.
    pub n: usize,
    /// The reduction length.
    pub k: usize,
    /// Groups (1 for a plain GEMM).
    pub groups: usize,
    /// Per-group real row counts, int32 on the device (grouped GEMM only).
    pub counts: Option<&'a DeviceBuffer<i32>>,
    /// A: `[m, k]` (grouped `[groups, m, k]`).
    pub a: Operand<'a>,
    /// B: `[n, k]` (grouped `[groups, n, k]`).
    pub b: Operand<'a>,
    /// D: `[m, n]` (grouped `[groups, m, n]`).
    pub d: GemmOut<'a>,
    /// Added to every row of D.
    pub bias: Option<Bias<'a>>,
    /// Add the product to D's current contents instead of overwriting.
    pub accumulate: bool,
}
