// Vector loads and stores of row elements shared by the root package's kernels
// (moe_routing.cu, model_ops.cu): a thread moves W consecutive elements, W = 8 (bf16: one
// 16-byte access) or 4 where the launcher found the rows 16-byte aligned, else 1.
#pragma once

#include <cuda_bf16.h>

namespace {

// Whether a pointer allows 16-byte vector accesses. The vector paths also need rows a
// multiple of 8 bf16 (16 bytes) apart, so every row start is aligned when the base is.
__device__ __forceinline__ bool aligned16(const void *p) {
    return (reinterpret_cast<size_t>(p) & 15) == 0;
}

// Eight bf16 (one 16-byte word) as floats (exact).
__device__ __forceinline__ void bf16x8_to_f32(const uint4 &u, float *f) {
    const __nv_bfloat162 *b = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 v = __bfloat1622float2(b[i]);
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
    }
}

// W consecutive floats (two 16-byte loads for W = 8, one for W = 4).
template <int W> __device__ __forceinline__ void load_f32(const float *p, float (&f)[W]) {
    if constexpr (W == 8 || W == 4) {
#pragma unroll
        for (int i = 0; i < W / 4; ++i) {
            const float4 a = __ldg(reinterpret_cast<const float4 *>(p) + i);
            f[4 * i] = a.x, f[4 * i + 1] = a.y, f[4 * i + 2] = a.z, f[4 * i + 3] = a.w;
        }
    } else {
#pragma unroll
        for (int v = 0; v < W; ++v) f[v] = __ldg(p + v);
    }
}

// W floats rounded to bf16 (to nearest even): one 16-byte store for W = 8, 8 bytes for W = 4.
template <int W> __device__ __forceinline__ void store_bf16(__nv_bfloat16 *p, const float (&f)[W]) {
    if constexpr (W == 8) {
        uint4 u;
        __nv_bfloat162 *b = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
        for (int i = 0; i < 4; ++i) b[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
        *reinterpret_cast<uint4 *>(p) = u;
    } else if constexpr (W == 4) {
        uint2 u;
        __nv_bfloat162 *b = reinterpret_cast<__nv_bfloat162 *>(&u);
        b[0] = __floats2bfloat162_rn(f[0], f[1]);
        b[1] = __floats2bfloat162_rn(f[2], f[3]);
        *reinterpret_cast<uint2 *>(p) = u;
    } else {
#pragma unroll
        for (int v = 0; v < W; ++v) p[v] = __float2bfloat16_rn(f[v]);
    }
}

}  // namespace
