// Quantize (high precision -> FP8, fused amax), dequantize (FP8 -> high precision) and amax.
//
// All kernels: grid-stride over 16-byte input vectors (8-byte for dequantize), the tail
// (n not a multiple of the vector width) done by block 0, blockDim a multiple of 32.
// Scalar slots (scale, scale_inv, amax, noop) are device pointers, nullable where noted, so
// a captured graph stays right when their values change.
#pragma once
#include "common.cuh"

namespace fp8k {

template <int BYTES> struct Bytes;
template <> struct Bytes<4> { using T = uint32_t; };
template <> struct Bytes<8> { using T = uint2; };

// y[i] = sat_rne(x[i] * s) for V consecutive floats, packed into V bytes.
template <__nv_fp8_interpretation_t F, int V>
__device__ __forceinline__ void cast_pack(const float *f, float s, uint8_t *out) {
#pragma unroll
    for (int k = 0; k < V / 2; ++k) {
        const __nv_fp8x2_storage_t p =
            __nv_cvt_float2_to_fp8x2(make_float2(f[2 * k] * s, f[2 * k + 1] * s), __NV_SATFINITE, F);
        out[2 * k] = uint8_t(p & 0xffu);
        out[2 * k + 1] = uint8_t(p >> 8);
    }
}

// CURRENT = false: scale read from *scale; amax (nullable) gets max|x| (unscaled) maxed in.
// CURRENT = true: scale derived from *amax (already reduced by fp8_amax_*), written to *scale.
// Both write scale_inv = 1 / scale (nullable). With *noop == 1 nothing is written at all.
template <typename In, __nv_fp8_interpretation_t F, bool CURRENT>
__device__ __forceinline__ void quantize(const In *__restrict__ x, uint8_t *__restrict__ y,
                                         unsigned long long n, float *scale, float *scale_inv,
                                         float *amax, const float *noop) {
    if (is_noop(noop)) return;
    constexpr int V = 16 / sizeof(In);
    const float s = CURRENT ? current_scale(*amax, FormatMax<F>::value) : *scale;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        if (CURRENT) *scale = s;
        if (scale_inv != nullptr) *scale_inv = 1.0f / s;
    }
    const unsigned long long nv = n / V;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned m = 0;
    const uint4 *xv = reinterpret_cast<const uint4 *>(x);
    using Out = typename Bytes<V>::T;
    Out *yv = reinterpret_cast<Out *>(y);
    // UNROLL independent 16-byte loads in flight per thread before any is used.
    constexpr int UNROLL = 4;
    for (unsigned long long base = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; base < nv;
         base += stride * UNROLL) {
        uint4 raw[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const unsigned long long i = base + u * stride;
            if (i < nv) raw[u] = __ldg(xv + i);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const unsigned long long i = base + u * stride;
            if (i >= nv) break;
            float f[V];
            unpack16<In>(raw[u], f);
            Out o;
            cast_pack<F, V>(f, s, reinterpret_cast<uint8_t *>(&o));
            yv[i] = o;
            if (!CURRENT) {
#pragma unroll
                for (int k = 0; k < V; ++k) m = max(m, abs_bits(f[k]));
            }
        }
    }
    const unsigned long long tail = n - nv * V;
    if (blockIdx.x == 0 && threadIdx.x < tail) {
        const unsigned long long i = nv * V + threadIdx.x;
        const float f = to_f32(x[i]);
        y[i] = __nv_cvt_float_to_fp8(f * s, __NV_SATFINITE, F);
        if (!CURRENT) m = max(m, abs_bits(f));
    }
    if (!CURRENT && amax != nullptr) block_amax_atomic(m, amax);
}

// Current scaling in one pass for tensors that fit one block's registers (n <= blockDim.x *
// FUSED_PER_THREAD): read once, reduce amax in the block, derive the scale, cast from
// registers. Writes exactly what the three-launch path writes (amax = max|x|, scale,
// scale_inv, data); nothing when *noop == 1.
constexpr int FUSED_PER_THREAD = 16;

template <typename In, __nv_fp8_interpretation_t F>
__device__ __forceinline__ void quantize_current_fused(const In *__restrict__ x, uint8_t *__restrict__ y,
                                                       unsigned n, float *scale, float *scale_inv,
                                                       float *amax, const float *noop) {
    if (is_noop(noop)) return;
    float f[FUSED_PER_THREAD];
    unsigned m = 0;
#pragma unroll
    for (int k = 0; k < FUSED_PER_THREAD; ++k) {
        const unsigned i = threadIdx.x + k * blockDim.x;
        f[k] = i < n ? to_f32(x[i]) : 0.0f;
        m = max(m, abs_bits(f[k]));
    }
    const float a = __uint_as_float(block_max_broadcast(m));
    const float s = current_scale(a, FormatMax<F>::value);
    if (threadIdx.x == 0) {
        *amax = a;
        *scale = s;
        if (scale_inv != nullptr) *scale_inv = 1.0f / s;
    }
#pragma unroll
    for (int k = 0; k < FUSED_PER_THREAD; ++k) {
        const unsigned i = threadIdx.x + k * blockDim.x;
        if (i < n) y[i] = __nv_cvt_float_to_fp8(f[k] * s, __NV_SATFINITE, F);
    }
}

// max |x| maxed into *amax (must hold a non-negative float); nothing when *noop == 1.
template <typename In>
__device__ __forceinline__ void amax_only(const In *__restrict__ x, unsigned long long n, float *amax,
                                          const float *noop) {
    if (is_noop(noop)) return;
    constexpr int V = 16 / sizeof(In);
    const unsigned long long nv = n / V;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned m = 0;
    const uint4 *xv = reinterpret_cast<const uint4 *>(x);
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < nv;
         i += stride) {
        float f[V];
        unpack16<In>(__ldg(xv + i), f);
#pragma unroll
        for (int k = 0; k < V; ++k) m = max(m, abs_bits(f[k]));
    }
    const unsigned long long tail = n - nv * V;
    if (blockIdx.x == 0 && threadIdx.x < tail) m = max(m, abs_bits(to_f32(x[nv * V + threadIdx.x])));
    block_amax_atomic(m, amax);
}

// y[i] = narrow(decode(x[i]) * *scale_inv); 8 elements a vector.
template <typename Out, __nv_fp8_interpretation_t F>
__device__ __forceinline__ void dequantize(const uint8_t *__restrict__ x, Out *__restrict__ y,
                                           unsigned long long n, const float *scale_inv) {
    const float si = *scale_inv;
    const unsigned long long nv = n / 8;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const uint2 *xv = reinterpret_cast<const uint2 *>(x);
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < nv;
         i += stride) {
        const uint2 raw = __ldg(xv + i);
        const uint8_t *b = reinterpret_cast<const uint8_t *>(&raw);
        Out o[8];
#pragma unroll
        for (int k = 0; k < 8; k += 2) {
            const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
                __nv_fp8x2_storage_t(b[k] | (unsigned(b[k + 1]) << 8)), F);
            const __half2 h2(h);
            o[k] = from_f32<Out>(__low2float(h2) * si);
            o[k + 1] = from_f32<Out>(__high2float(h2) * si);
        }
        uint4 *dst = reinterpret_cast<uint4 *>(y + i * 8);
#pragma unroll
        for (int k = 0; k < int(8 * sizeof(Out) / 16); ++k) dst[k] = reinterpret_cast<const uint4 *>(o)[k];
    }
    const unsigned long long tail = n - nv * 8;
    if (blockIdx.x == 0 && threadIdx.x < tail) {
        const unsigned long long i = nv * 8 + threadIdx.x;
        const __half h(__nv_cvt_fp8_to_halfraw(x[i], F));
        y[i] = from_f32<Out>(__half2float(h) * si);
    }
}

} // namespace fp8k

// Slots: idx = (scale, scale_inv, amax, noop) indices into their buffers.
#define FP8K_QUANTIZE(IN_NAME, IN_T, FMT_NAME, FMT)                                                 \
    extern "C" __global__ void fp8_quantize_##IN_NAME##_##FMT_NAME(                                 \
        const IN_T *x, uint8_t *y, unsigned long long n, float *scale, float *scale_inv,           \
        float *amax, const float *noop, uint4 idx) {                                               \
        cuda_graph::pdl_enter();                                                                   \
        fp8k::quantize<IN_T, FMT, false>(x, y, n, fp8k::slot(scale, idx.x),                        \
                                         fp8k::slot(scale_inv, idx.y), fp8k::slot(amax, idx.z),    \
                                         fp8k::slot(noop, idx.w));                                 \
    }                                                                                              \
    extern "C" __global__ void fp8_quantize_current_##IN_NAME##_##FMT_NAME(                         \
        const IN_T *x, uint8_t *y, unsigned long long n, float *scale, float *scale_inv,           \
        float *amax, const float *noop, uint4 idx) {                                               \
        cuda_graph::pdl_enter();                                                                   \
        fp8k::quantize<IN_T, FMT, true>(x, y, n, fp8k::slot(scale, idx.x),                         \
                                        fp8k::slot(scale_inv, idx.y), fp8k::slot(amax, idx.z),     \
                                        fp8k::slot(noop, idx.w));                                  \
    }                                                                                              \
    extern "C" __global__ void fp8_quantize_current_fused_##IN_NAME##_##FMT_NAME(                   \
        const IN_T *x, uint8_t *y, unsigned long long n, float *scale, float *scale_inv,           \
        float *amax, const float *noop, uint4 idx) {                                               \
        cuda_graph::pdl_enter();                                                                   \
        fp8k::quantize_current_fused<IN_T, FMT>(x, y, unsigned(n), fp8k::slot(scale, idx.x),       \
                                                fp8k::slot(scale_inv, idx.y),                      \
                                                fp8k::slot(amax, idx.z), fp8k::slot(noop, idx.w)); \
    }

FP8K_QUANTIZE(f32, float, e4m3, __NV_E4M3)
FP8K_QUANTIZE(f32, float, e5m2, __NV_E5M2)
FP8K_QUANTIZE(f16, __half, e4m3, __NV_E4M3)
FP8K_QUANTIZE(f16, __half, e5m2, __NV_E5M2)
FP8K_QUANTIZE(bf16, __nv_bfloat16, e4m3, __NV_E4M3)
FP8K_QUANTIZE(bf16, __nv_bfloat16, e5m2, __NV_E5M2)

// Slots: idx = (amax, noop).
#define FP8K_AMAX(IN_NAME, IN_T)                                                                   \
    extern "C" __global__ void fp8_amax_##IN_NAME(const IN_T *x, unsigned long long n, float *amax, \
                                                  const float *noop, uint2 idx) {                  \
        cuda_graph::pdl_enter();                                                                   \
        fp8k::amax_only<IN_T>(x, n, fp8k::slot(amax, idx.x), fp8k::slot(noop, idx.y));             \
    }

FP8K_AMAX(f32, float)
FP8K_AMAX(f16, __half)
FP8K_AMAX(bf16, __nv_bfloat16)

// Slot: scale_inv[idx].
#define FP8K_DEQUANTIZE(FMT_NAME, FMT, OUT_NAME, OUT_T)                                             \
    extern "C" __global__ void fp8_dequantize_##FMT_NAME##_##OUT_NAME(                              \
        const uint8_t *x, OUT_T *y, unsigned long long n, const float *scale_inv, unsigned idx) {  \
        cuda_graph::pdl_enter();                                                                   \
        fp8k::dequantize<OUT_T, FMT>(x, y, n, scale_inv + idx);                                    \
    }

FP8K_DEQUANTIZE(e4m3, __NV_E4M3, f32, float)
FP8K_DEQUANTIZE(e4m3, __NV_E4M3, f16, __half)
FP8K_DEQUANTIZE(e4m3, __NV_E4M3, bf16, __nv_bfloat16)
FP8K_DEQUANTIZE(e5m2, __NV_E5M2, f32, float)
FP8K_DEQUANTIZE(e5m2, __NV_E5M2, f16, __half)
FP8K_DEQUANTIZE(e5m2, __NV_E5M2, bf16, __nv_bfloat16)
