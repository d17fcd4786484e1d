// Causal multi-head self-attention and its backward (launchers: src/model/attention.rs).
//
// Layout: qkv [T, 3d] bf16 (T = B * S rows, token t = b * S + s; row t holds q of heads
// 0..H (D each), then k, then v; d = H * D); o, d_o [T, d]; lse, delta [B, H, S] f32.
// Scores are kept in log2 units: x = (q . k) * scale * log2(e), so exp(scale q.k - lse) =
// exp2(x - lse * log2(e)).
//
// This first version is the simple one: one warp per query (forward, dq) or key (dk, dv),
// lanes over the head dimension, f32 throughout, every sum in a fixed order.
#include <cuda_bf16.h>
#include <cuda_graph/pdl.cuh>

#define ATT_WARPS 4
#define ATT_BLOCK (ATT_WARPS * 32)

namespace {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Loads a head's row (D values, lane-strided: lane holds columns lane + 32 i).
template <int D>
__device__ __forceinline__ void load_row(const __nv_bfloat16 *p, float (&x)[D / 32]) {
    const unsigned lane = threadIdx.x & 31u;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) x[i] = __bfloat162float(p[lane + 32 * i]);
}

template <int D>
__device__ __forceinline__ void store_row(__nv_bfloat16 *p, const float (&x)[D / 32]) {
    const unsigned lane = threadIdx.x & 31u;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) p[lane + 32 * i] = __float2bfloat16_rn(x[i]);
}

template <int D>
__device__ __forceinline__ float dot(const float (&a)[D / 32], const float (&b)[D / 32]) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) s = fmaf(a[i], b[i], s);
    return warp_sum(s);
}

// Grid (B * H, ceil(S / ATT_WARPS)); warp w of block (bh, y) takes query s = y * 4 + w.
template <int D>
__device__ __forceinline__ void forward_simple(const __nv_bfloat16 *qkv, __nv_bfloat16 *o,
                                               float *lse, unsigned seq, unsigned heads,
                                               float scale_log2) {
    const unsigned warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const unsigned bh = blockIdx.x, b = bh / heads, h = bh % heads;
    const unsigned s = blockIdx.y * ATT_WARPS + warp;
    if (s >= seq) return;
    const size_t d = (size_t)heads * D, w3 = 3 * d;
    const __nv_bfloat16 *base = qkv + (size_t)b * seq * w3 + (size_t)h * D;
    float q[D / 32], k[D / 32], v[D / 32], acc[D / 32];
    load_row<D>(base + s * w3, q);
#pragma unroll
    for (int i = 0; i < D / 32; ++i) acc[i] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (unsigned j = 0; j <= s; ++j) {
        load_row<D>(base + j * w3 + d, k);
        load_row<D>(base + j * w3 + 2 * d, v);
        const float x = dot<D>(q, k) * scale_log2;
        const float mn = fmaxf(m, x);
        const float alpha = exp2f(m - mn), p = exp2f(x - mn);
        l = l * alpha + p;
#pragma unroll
        for (int i = 0; i < D / 32; ++i) acc[i] = acc[i] * alpha + p * v[i];
        m = mn;
    }
    const float inv = 1.0f / l;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) acc[i] *= inv;
    store_row<D>(o + ((size_t)b * seq + s) * d + (size_t)h * D, acc);
    if (lane == 0) lse[(size_t)bh * seq + s] = (m + log2f(l)) * LN2;
}

// dq, and delta = rowsum(d_o * o) into `delta` for the dk/dv kernel. Grid as the forward's.
template <int D>
__device__ __forceinline__ void backward_dq_simple(const __nv_bfloat16 *qkv,
                                                   const __nv_bfloat16 *o, const float *lse,
                                                   const __nv_bfloat16 *d_o,
                                                   __nv_bfloat16 *dqkv, float *delta,
                                                   unsigned seq, unsigned heads, float scale,
                                                   float scale_log2) {
    const unsigned warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const unsigned bh = blockIdx.x, b = bh / heads, h = bh % heads;
    const unsigned s = blockIdx.y * ATT_WARPS + warp;
    if (s >= seq) return;
    const size_t d = (size_t)heads * D, w3 = 3 * d;
    const size_t t = (size_t)b * seq + s;
    const __nv_bfloat16 *base = qkv + (size_t)b * seq * w3 + (size_t)h * D;
    float q[D / 32], k[D / 32], v[D / 32], g[D / 32], acc[D / 32];
    load_row<D>(o + t * d + (size_t)h * D, acc);
    load_row<D>(d_o + t * d + (size_t)h * D, g);
    const float dl = dot<D>(g, acc);
    if (lane == 0) delta[(size_t)bh * seq + s] = dl;
    load_row<D>(base + s * w3, q);
#pragma unroll
    for (int i = 0; i < D / 32; ++i) acc[i] = 0.0f;
    const float l2 = lse[(size_t)bh * seq + s] * LOG2E;
    for (unsigned j = 0; j <= s; ++j) {
        load_row<D>(base + j * w3 + d, k);
        load_row<D>(base + j * w3 + 2 * d, v);
        const float p = exp2f(dot<D>(q, k) * scale_log2 - l2);
        const float ds = p * (dot<D>(g, v) - dl);
#pragma unroll
        for (int i = 0; i < D / 32; ++i) acc[i] = fmaf(ds, k[i], acc[i]);
    }
#pragma unroll
    for (int i = 0; i < D / 32; ++i) acc[i] *= scale;
    store_row<D>(dqkv + t * w3 + (size_t)h * D, acc);
}

// dk, dv: warp w of block (bh, y) takes key j = y * 4 + w and walks the queries i >= j in
// order. Reads the delta the dq kernel wrote.
template <int D>
__device__ __forceinline__ void backward_dkdv_simple(const __nv_bfloat16 *qkv,
                                                     const float *lse,
                                                     const __nv_bfloat16 *d_o,
                                                     __nv_bfloat16 *dqkv, const float *delta,
                                                     unsigned seq, unsigned heads, float scale,
                                                     float scale_log2) {
    const unsigned warp = threadIdx.x >> 5;
    const unsigned bh = blockIdx.x, b = bh / heads, h = bh % heads;
    const unsigned j = blockIdx.y * ATT_WARPS + warp;
    if (j >= seq) return;
    const size_t d = (size_t)heads * D, w3 = 3 * d;
    const __nv_bfloat16 *base = qkv + (size_t)b * seq * w3 + (size_t)h * D;
    const __nv_bfloat16 *gbase = d_o + (size_t)b * seq * d + (size_t)h * D;
    float q[D / 32], k[D / 32], v[D / 32], g[D / 32], dk[D / 32], dv[D / 32];
    load_row<D>(base + j * w3 + d, k);
    load_row<D>(base + j * w3 + 2 * d, v);
#pragma unroll
    for (int i = 0; i < D / 32; ++i) dk[i] = dv[i] = 0.0f;
    for (unsigned i = j; i < seq; ++i) {
        load_row<D>(base + i * w3, q);
        load_row<D>(gbase + i * d, g);
        const float l2 = lse[(size_t)bh * seq + i] * LOG2E;
        const float p = exp2f(dot<D>(q, k) * scale_log2 - l2);
        const float ds = p * (dot<D>(g, v) - delta[(size_t)bh * seq + i]);
#pragma unroll
        for (int c = 0; c < D / 32; ++c) {
            dv[c] = fmaf(p, g[c], dv[c]);
            dk[c] = fmaf(ds, q[c], dk[c]);
        }
    }
#pragma unroll
    for (int c = 0; c < D / 32; ++c) dk[c] *= scale;
    const size_t t = (size_t)b * seq + j;
    store_row<D>(dqkv + t * w3 + d + (size_t)h * D, dk);
    store_row<D>(dqkv + t * w3 + 2 * d + (size_t)h * D, dv);
}

} // namespace

#define ATT_KERNELS(D)                                                                         \
    extern "C" __global__ void __launch_bounds__(ATT_BLOCK)                                    \
        attention_forward_d##D(const __nv_bfloat16 *qkv, __nv_bfloat16 *o, float *lse,         \
                               unsigned seq, unsigned heads, float scale_log2) {               \
        cuda_graph::pdl_enter();                                                               \
        forward_simple<D>(qkv, o, lse, seq, heads, scale_log2);                                \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(ATT_BLOCK) attention_backward_dq_d##D(        \
        const __nv_bfloat16 *qkv, const __nv_bfloat16 *o, const float *lse,                    \
        const __nv_bfloat16 *d_o, __nv_bfloat16 *dqkv, float *delta, unsigned seq,             \
        unsigned heads, float scale, float scale_log2) {                                       \
        cuda_graph::pdl_enter();                                                               \
        backward_dq_simple<D>(qkv, o, lse, d_o, dqkv, delta, seq, heads, scale, scale_log2);   \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(ATT_BLOCK) attention_backward_dkdv_d##D(      \
        const __nv_bfloat16 *qkv, const float *lse, const __nv_bfloat16 *d_o,                  \
        __nv_bfloat16 *dqkv, const float *delta, unsigned seq, unsigned heads, float scale,    \
        float scale_log2) {                                                                    \
        cuda_graph::pdl_enter();                                                               \
        backward_dkdv_simple<D>(qkv, lse, d_o, dqkv, delta, seq, heads, scale, scale_log2);    \
    }

ATT_KERNELS(32)
ATT_KERNELS(64)
ATT_KERNELS(128)
