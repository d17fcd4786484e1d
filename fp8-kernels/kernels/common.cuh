// Shared helpers of the FP8 kernels: element loads, conversions, amax reduction.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <cuda_graph/pdl.cuh>

namespace fp8k {

constexpr float E4M3_MAX = 448.0f;
constexpr float E5M2_MAX = 57344.0f;

template <__nv_fp8_interpretation_t F> struct FormatMax;
template <> struct FormatMax<__NV_E4M3> { static constexpr float value = E4M3_MAX; };
template <> struct FormatMax<__NV_E5M2> { static constexpr float value = E5M2_MAX; };

// Exact widening of one input element to f32.
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// Unpacks a 16-byte vector of In into 16 / sizeof(In) floats (exact).
template <typename In>
__device__ __forceinline__ void unpack16(const uint4 &raw, float *f) {
    const In *e = reinterpret_cast<const In *>(&raw);
#pragma unroll
    for (int k = 0; k < int(16 / sizeof(In)); ++k) f[k] = to_f32(e[k]);
}

// Narrowing from f32, round to nearest even (used by dequantize).
template <typename Out> __device__ __forceinline__ Out from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// |x| as its f32 bit pattern: for non-negative floats the integer order is the float order,
// and every NaN sorts above +inf, so an integer max propagates NaN.
__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// One canonical NaN (0x7fc00000) for the amax result, whatever the inputs' payloads.
__device__ __forceinline__ unsigned canonical_amax(unsigned bits) {
    return bits > 0x7f800000u ? 0x7fc00000u : bits;
}

// Block-wide max of `bits`, then ONE atomicMax of the float bits into *amax (which must
// hold a non-negative float or be zero). Every thread of the block must call it.
__device__ __forceinline__ void block_amax_atomic(unsigned bits, float *amax) {
    __shared__ unsigned warp_max[32];
    bits = __reduce_max_sync(0xffffffffu, canonical_amax(bits));
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) warp_max[warp] = bits;
    __syncthreads();
    if (warp == 0) {
        const unsigned nwarps = (blockDim.x + 31u) >> 5;
        unsigned v = lane < nwarps ? warp_max[lane] : 0u;
        v = __reduce_max_sync(0xffffffffu, v);
        if (lane == 0 && v != 0u) atomicMax(reinterpret_cast<unsigned *>(amax), v);
    }
}

// Block-wide max of `bits`, canonicalised (one NaN), returned to every thread. Every thread
// of the block must call it.
__device__ __forceinline__ unsigned block_max_broadcast(unsigned bits) {
    __shared__ unsigned warp_max[32];
    __shared__ unsigned result;
    bits = __reduce_max_sync(0xffffffffu, canonical_amax(bits));
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) warp_max[warp] = bits;
    __syncthreads();
    if (warp == 0) {
        const unsigned nwarps = (blockDim.x + 31u) >> 5;
        const unsigned v = __reduce_max_sync(0xffffffffu, lane < nwarps ? warp_max[lane] : 0u);
        if (lane == 0) result = v;
    }
    __syncthreads();
    return result;
}

// Scale for current scaling: fp8_max / amax, or 1 when amax is 0, inf or NaN; an
// overflowing quotient (tiny amax) becomes FLT_MAX.
__device__ __forceinline__ float current_scale(float amax, float fp8_max) {
    if (!(amax > 0.0f) || isinf(amax)) return 1.0f;
    float s = fp8_max / amax;
    return isinf(s) ? 3.402823466e+38f : s;
}

// Scalar slots arrive as (buffer, index) pairs, so the launcher can pass the buffers
// themselves (and a capture keeps them alive); a null buffer is an absent slot.
template <typename T> __device__ __forceinline__ T *slot(T *buf, unsigned idx) {
    return buf == nullptr ? nullptr : buf + idx;
}

// The logistic function with the hardware's exp2 and reciprocal approximations (a few ulp of
// f32, far below the FP8 cast's rounding that follows): the accurate expf and IEEE division
// made the SwiGLU casts issue-bound (37 and 53 us at T = 4096 against ~25 and ~42 us of
// memory traffic on the H200). Saturates cleanly: exp(-v) = inf gives 0, NaN stays NaN.
__device__ __forceinline__ float sigmoid_f32(float v) { return __fdividef(1.0f, 1.0f + __expf(-v)); }

// silu(g) * up, silu(v) = v * sigmoid(v): the SwiGLU of the MoE casts (moe_cast.cuh) and of
// the fc1 GEMM's fused epilogue (gemm_sm90.cuh), one formula so the two agree bit for bit.
__device__ __forceinline__ float swiglu_f32(float g, float u) { return g * sigmoid_f32(g) * u; }

// Whether a noop flag (nullable device float) asks the kernel to do nothing.
__device__ __forceinline__ bool is_noop(const float *noop) { return noop != nullptr && *noop == 1.0f; }

} // namespace fp8k
