// Kernels of the FP8 linear layer (src/linear.rs) that fp8-kernels does not provide.

// Bias gradient: db[c] += sum over r of dy[r * cols + c], for a row-major [rows, cols] f32
// dy. One thread per column sums its rows in order, so the result is deterministic (no
// atomics; the same bits on every run).
#include <cuda_graph/pdl.cuh>

extern "C" __global__ void fp8_linear_bias_grad_f32(const float* dy, float* db,
                                                    unsigned int rows, unsigned int cols) {
    cuda_graph::pdl_enter();
    unsigned int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float acc = 0.0f;
    for (unsigned int r = 0; r < rows; ++r) acc += dy[(size_t)r * cols + c];
    db[c] += acc;
}

// ---------------------------------------------------------------------------------------
// The high-precision (FP8 off) GEMMs of the layer, in f32: a shared-memory tiled SGEMM.
//
// Correctness and determinism over speed: each output element is computed by one thread,
// as fmaf(a_p, b_p, acc) for p = 0, 1, ..., K-1 in that order from acc = 0 (then the bias or
// the old value added once), so its bits depend only on the inputs, never on the launch
// or on other work: a graph replay gives the bits of an eager run. No atomics, no split-K.
// Any sizes (tiles at the edges are bounds-checked), no alignment beyond float's.
//
// Launch: block (SGEMM_TILE, SGEMM_ROWS, 1); a 1-D grid of ceil(M / SGEMM_TILE) *
// ceil(N / SGEMM_TILE) blocks, block b computing the output tile (b / tiles_n, b % tiles_n)
// (1-D, so neither dimension meets the 65535 limit of gridDim.y). src/linear.rs mirrors
// the two constants.
#define SGEMM_TILE 32u // output tile edge and depth of a K slab
#define SGEMM_ROWS 8u  // threads in y; a thread computes SGEMM_TILE / SGEMM_ROWS rows of a column

// C[i, j] (= or +=) sum over p < K of A(i, p) * B(p, j) (+ bias[j]), C row-major [M, N]:
//   A(i, p) = a[i * K + p]  (A_T false: a is [M, K])  or  a[p * M + i]  (A_T true: [K, M]);
//   B(p, j) = b[p * N + j]  (B_T false: b is [K, N])  or  b[j * K + p]  (B_T true: [N, K]).
// ACCUM: C[i, j] = C[i, j] + sum; BIAS: C[i, j] = sum + bias[j] (bias has N elements).
template <bool A_T, bool B_T, bool ACCUM, bool BIAS>
__device__ __forceinline__ void fp8_linear_sgemm(const float* __restrict__ a,
                                                 const float* __restrict__ b,
                                                 const float* __restrict__ bias,
                                                 float* __restrict__ c, unsigned int M,
                                                 unsigned int N, unsigned int K) {
    // +1 column: the transposed stores (and column reads) hit 32 different banks.
    __shared__ float sa[SGEMM_TILE][SGEMM_TILE + 1]; // sa[i][p] = A(i0 + i, p0 + p)
    __shared__ float sb[SGEMM_TILE][SGEMM_TILE + 1]; // sb[p][j] = B(p0 + p, j0 + j)
    const unsigned int tiles_n = (N + SGEMM_TILE - 1u) / SGEMM_TILE;
    const unsigned int i0 = (blockIdx.x / tiles_n) * SGEMM_TILE;
    const unsigned int j0 = (blockIdx.x % tiles_n) * SGEMM_TILE;
    const unsigned int tx = threadIdx.x, ty = threadIdx.y;
    constexpr unsigned int PER = SGEMM_TILE / SGEMM_ROWS;
    float acc[PER]; // rows i0 + ty + r * SGEMM_ROWS, column j0 + tx
#pragma unroll
    for (unsigned int r = 0; r < PER; ++r) acc[r] = 0.0f;

    for (unsigned int p0 = 0; p0 < K; p0 += SGEMM_TILE) {
        const unsigned int depth = min(SGEMM_TILE, K - p0);
        // Loads run tx along each operand's contiguous dimension (coalesced); out-of-range
        // elements are zero and never summed (the loop below stops at depth; rows and
        // columns past M and N are never stored).
        for (unsigned int r = ty; r < SGEMM_TILE; r += SGEMM_ROWS) {
            if (A_T) {
                const unsigned int i = i0 + tx, p = p0 + r;
                sa[tx][r] = (i < M && p < K) ? a[(size_t)p * M + i] : 0.0f;
            } else {
                const unsigned int i = i0 + r, p = p0 + tx;
                sa[r][tx] = (i < M && p < K) ? a[(size_t)i * K + p] : 0.0f;
            }
            if (B_T) {
                const unsigned int j = j0 + r, p = p0 + tx;
                sb[tx][r] = (j < N && p < K) ? b[(size_t)j * K + p] : 0.0f;
            } else {
                const unsigned int j = j0 + tx, p = p0 + r;
                sb[r][tx] = (j < N && p < K) ? b[(size_t)p * N + j] : 0.0f;
            }
        }
        __syncthreads();
        for (unsigned int p = 0; p < depth; ++p) {
            const float bv = sb[p][tx];
#pragma unroll
            for (unsigned int r = 0; r < PER; ++r)
                acc[r] = fmaf(sa[ty + r * SGEMM_ROWS][p], bv, acc[r]);
        }
        __syncthreads(); // the slab is read by all before the next one overwrites it
    }

    const unsigned int j = j0 + tx;
    if (j >= N) return;
#pragma unroll
    for (unsigned int r = 0; r < PER; ++r) {
        const unsigned int i = i0 + ty + r * SGEMM_ROWS;
        if (i >= M) break;
        const size_t at = (size_t)i * N + j;
        float v = acc[r];
        if (BIAS) v = v + bias[j];
        if (ACCUM) v = c[at] + v;
        c[at] = v;
    }
}

// The layer's three GEMMs; m = tokens, n = out_features, k = in_features throughout.

// Forward: y[m, n] = x[m, k] . w[n, k]^T.
extern "C" __global__ void fp8_linear_hp_forward_f32(const float* x, const float* w, float* y,
                                                     unsigned int m, unsigned int n,
                                                     unsigned int k) {
    cuda_graph::pdl_enter();
    fp8_linear_sgemm<false, true, false, false>(x, w, nullptr, y, m, n, k);
}

// Forward with bias: y[m, n] = x[m, k] . w[n, k]^T + bias[n].
extern "C" __global__ void fp8_linear_hp_forward_bias_f32(const float* x, const float* w,
                                                          const float* bias, float* y,
                                                          unsigned int m, unsigned int n,
                                                          unsigned int k) {
    cuda_graph::pdl_enter();
    fp8_linear_sgemm<false, true, false, true>(x, w, bias, y, m, n, k);
}

// Data gradient: dx[m, k] = dy[m, n] . w[n, k] (a GEMM of M = m, N = k, K = n).
extern "C" __global__ void fp8_linear_hp_dgrad_f32(const float* dy, const float* w, float* dx,
                                                   unsigned int m, unsigned int n,
                                                   unsigned int k) {
    cuda_graph::pdl_enter();
    fp8_linear_sgemm<false, false, false, false>(dy, w, nullptr, dx, m, k, n);
}

// Weight gradient: dw[n, k] += dy[m, n]^T . x[m, k] (a GEMM of M = n, N = k, K = m; A = dy
// read transposed).
extern "C" __global__ void fp8_linear_hp_wgrad_f32(const float* dy, const float* x, float* dw,
                                                   unsigned int m, unsigned int n,
                                                   unsigned int k) {
    cuda_graph::pdl_enter();
    fp8_linear_sgemm<true, false, true, false>(dy, x, nullptr, dw, n, k, m);
}
