// Block-scaled quantize (DeepSeek-V3 style): one fp32 scale per 1x128 row block
// (activations) or per 128x128 tile (weights) of a [rows, cols] row-major matrix.
//
// Per block: amax = max |x| (f32 bit-pattern max, NaN wins); scale = current_scale(amax,
// fp8_max) (1 when amax is 0, inf or NaN; FLT_MAX when fp8_max / amax overflows);
// y = sat_rne(x * scale); scale_inv = 1 / scale written to the block's slot. Edge blocks use
// only their real elements.
#pragma once
#include "common.cuh"

namespace fp8k {

// One warp per (row, 128-column block); any number of warps per CTA.
template <typename In, __nv_fp8_interpretation_t F>
__device__ __forceinline__ void quantize_1x128(const In *__restrict__ x, uint8_t *__restrict__ y,
                                               float *__restrict__ scale_inv,
                                               unsigned long long rows, unsigned long long cols) {
    const unsigned long long nb = (cols + 127) / 128;
    const unsigned long long w = (unsigned long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (w >= rows * nb) return; // whole warps leave together
    const unsigned lane = threadIdx.x & 31u;
    const unsigned long long r = w / nb, c0 = (w % nb) * 128;
    const unsigned long long len = min(128ull, cols - c0);
    const unsigned long long base = r * cols + c0;
    float f[4];
    unsigned m = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned c = lane + 32u * i;
        f[i] = 0.0f;
        if (c < len) {
            f[i] = to_f32(x[base + c]);
            m = max(m, abs_bits(f[i]));
        }
    }
    m = __reduce_max_sync(0xffffffffu, canonical_amax(m));
    const float s = current_scale(__uint_as_float(m), FormatMax<F>::value);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned c = lane + 32u * i;
        if (c < len) y[base + c] = __nv_cvt_float_to_fp8(f[i] * s, __NV_SATFINITE, F);
    }
    if (lane == 0) scale_inv[w] = 1.0f / s;
}

// Vector path of 1x128, for cols % V == 0 (V = 16 / sizeof(In); input 16-byte aligned):
// a group of L = 128 / V lanes per block, each lane one 16-byte vector; each group does
// BW1X128_U consecutive blocks (that many loads in flight per thread); the group's amax by
// xor-shuffles within the group (every lane of the warp takes part).
constexpr int BW1X128_U = 4;

template <typename In, __nv_fp8_interpretation_t F>
__device__ __forceinline__ void quantize_1x128_vec(const In *__restrict__ x, uint8_t *__restrict__ y,
                                                   float *__restrict__ scale_inv,
                                                   unsigned long long rows, unsigned long long cols) {
    constexpr int V = 16 / sizeof(In);
    constexpr unsigned L = 128 / V, G = 32 / L;
    constexpr int U = BW1X128_U;
    const unsigned long long nb = (cols + 127) / 128, total = rows * nb;
    const unsigned lane = threadIdx.x & 31u, sub = lane % L, grp = lane / L;
    const unsigned long long gw = (unsigned long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const unsigned long long first = (gw * G + grp) * U;
    uint4 raw[U];
    unsigned long long at[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const unsigned long long b = first + u;
        const unsigned long long r = b / nb, c = (b % nb) * 128 + sub * V;
        ok[u] = b < total && c < cols;
        at[u] = r * cols + c;
        if (ok[u]) raw[u] = __ldg(reinterpret_cast<const uint4 *>(x + at[u]));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
        float f[V];
        unsigned m = 0;
        if (ok[u]) {
            unpack16<In>(raw[u], f);
#pragma unroll
            for (int k = 0; k < V; ++k) m = max(m, abs_bits(f[k]));
        }
#pragma unroll
        for (unsigned off = L / 2; off > 0; off /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
        const float s = current_scale(__uint_as_float(canonical_amax(m)), FormatMax<F>::value);
        if (ok[u]) {
            unsigned o[V / 4];
#pragma unroll
            for (int k = 0; k < V / 4; ++k) {
                const unsigned lo = __nv_cvt_float2_to_fp8x2(make_float2(f[4 * k] * s, f[4 * k + 1] * s),
                                                             __NV_SATFINITE, F);
                const unsigned hi = __nv_cvt_float2_to_fp8x2(
                    make_float2(f[4 * k + 2] * s, f[4 * k + 3] * s), __NV_SATFINITE, F);
                o[k] = lo | (hi << 16);
            }
            if constexpr (V == 8) {
                *reinterpret_cast<uint2 *>(y + at[u]) = make_uint2(o[0], o[1]);
            } else {
                *reinterpret_cast<unsigned *>(y + at[u]) = o[0];
            }
        }
        if (sub == 0 && first + u < total) scale_inv[first + u] = 1.0f / s;
    }
}

// One CTA per 128x128 tile (blockDim.x a multiple of 32, at most 1024): amax pass, block
// reduction, cast pass (re-reading the tile, which is in L1/L2 by then).
template <typename In, __nv_fp8_interpretation_t F>
__device__ __forceinline__ void quantize_128x128(const In *__restrict__ x, uint8_t *__restrict__ y,
                                                 float *__restrict__ scale_inv,
                                                 unsigned long long rows, unsigned long long cols) {
    __shared__ unsigned warp_max[32];
    const unsigned long long nbc = (cols + 127) / 128;
    const unsigned long long r0 = (blockIdx.x / nbc) * 128, c0 = (blockIdx.x % nbc) * 128;
    const unsigned hr = unsigned(min(128ull, rows - r0)), hc = unsigned(min(128ull, cols - c0));
    unsigned m = 0;
    for (unsigned q = threadIdx.x; q < 128u * 128u; q += blockDim.x) {
        const unsigned rr = q >> 7, cc = q & 127u;
        if (rr < hr && cc < hc) m = max(m, abs_bits(to_f32(x[(r0 + rr) * cols + c0 + cc])));
    }
    m = __reduce_max_sync(0xffffffffu, canonical_amax(m));
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) warp_max[warp] = m;
    __syncthreads();
    m = 0;
    for (unsigned k = 0; k < (blockDim.x + 31u) / 32u; ++k) m = max(m, warp_max[k]);
    const float s = current_scale(__uint_as_float(m), FormatMax<F>::value);
    for (unsigned q = threadIdx.x; q < 128u * 128u; q += blockDim.x) {
        const unsigned rr = q >> 7, cc = q & 127u;
        if (rr < hr && cc < hc) {
            const unsigned long long i = (r0 + rr) * cols + c0 + cc;
            y[i] = __nv_cvt_float_to_fp8(to_f32(x[i]) * s, __NV_SATFINITE, F);
        }
    }
    if (threadIdx.x == 0) scale_inv[blockIdx.x] = 1.0f / s;
}

} // namespace fp8k

#define FP8K_BLOCKWISE(IN_NAME, IN_T, FMT_NAME, FMT)                                                \
    extern "C" __global__ void fp8_quantize_1x128_##IN_NAME##_##FMT_NAME(                           \
        const IN_T *x, uint8_t *y, float *scale_inv, unsigned long long rows,                      \
        unsigned long long cols) {                                                                 \
        cuda_graph::pdl_enter();                                                                   \
        fp8k::quantize_1x128<IN_T, FMT>(x, y, scale_inv, rows, cols);                              \
    }                                                                                              \
    extern "C" __global__ void fp8_quantize_1x128v_##IN_NAME##_##FMT_NAME(                          \
        const IN_T *x, uint8_t *y, float *scale_inv, unsigned long long rows,                      \
        unsigned long long cols) {                                                                 \
        cuda_graph::pdl_enter();                                                                   \
        fp8k::quantize_1x128_vec<IN_T, FMT>(x, y, scale_inv, rows, cols);                          \
    }                                                                                              \
    extern "C" __global__ void fp8_quantize_128x128_##IN_NAME##_##FMT_NAME(                         \
        const IN_T *x, uint8_t *y, float *scale_inv, unsigned long long rows,                      \
        unsigned long long cols) {                                                                 \
        cuda_graph::pdl_enter();                                                                   \
        fp8k::quantize_128x128<IN_T, FMT>(x, y, scale_inv, rows, cols);                            \
    }

FP8K_BLOCKWISE(f32, float, e4m3, __NV_E4M3)
FP8K_BLOCKWISE(f32, float, e5m2, __NV_E5M2)
FP8K_BLOCKWISE(f16, __half, e4m3, __NV_E4M3)
FP8K_BLOCKWISE(f16, __half, e5m2, __NV_E5M2)
FP8K_BLOCKWISE(bf16, __nv_bfloat16, e4m3, __NV_E4M3)
FP8K_BLOCKWISE(bf16, __nv_bfloat16, e5m2, __NV_E5M2)
