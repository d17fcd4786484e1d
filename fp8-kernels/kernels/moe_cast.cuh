// FP8 casts fused with the data movement and elementwise math of a dropless MoE layer, all
// through cast_transpose_src (cast_transpose.cuh): each writes its result in FP8 row-major and
// transposed in one pass, amax fused, and never materialises the high-precision tensor.
//
// The layer's packed layout: `rows` (the capacity) rows, of which the first `*used` (the
// device-side end of the last expert's rows) are in use; each expert's rows start at a
// multiple of the GEMM row tile, and the rows between one expert's tokens and the next
// expert's start are zero padding. Tiles past `*used` are skipped (not written); rows past it
// inside a written tile are written as zero.
//
// * Gather (the permute, and the combine's backward): row r is the token row
//   `x[token_of_row[r] / k]`, times `row_scale[token_of_row[r]]` when row_scale is given (the
//   combine backward: dY[r] = gate * dy[t]); a negative or out-of-range entry is a padding row
//   (zero).
// * SwiGLU: a is [rows, 2F] (gate columns 0..F, up columns F..2F); the output [rows, F] is
//   silu(gate) * up, with silu(v) = v * sigmoid(v).
// * The SwiGLU sources take `pad` (nullable, the dispatch's token_of_row): a row r with
//   pad[r] < 0 is padding, read as zeros without loading it (at small token counts half the
//   rows in use are padding).
// * SwiGLU backward: from a and dh [rows, F], the output [rows, 2F] is
//   d gate = dh * up * silu'(gate) (columns 0..F) and d up = dh * silu(gate) (columns F..2F),
//   silu'(v) = sigmoid(v) * (1 + v * (1 - sigmoid(v))).
// All math in f32 (expf), one rounding at the FP8 cast.
//
// The backward's source gives both halves of one column from the same three loads (OUT = 2:
// d gate at output column c, d up at F + c), so each input byte is read, and each sigmoid
// computed, once (tiles over the 2F output columns would do both twice).
#pragma once
#include "cast_transpose.cuh"

namespace fp8k {

// Resident CTAs per SM of the persistent grids (launchers' constants; keep in step), chosen
// so the registers fit without spilling: the SwiGLU's 2 loads per vector (128 bytes a thread
// in flight) take up to 80 registers, 3 CTAs per SM; the backward's 3 loads (192 bytes) and
// 16 outputs per row up to 128, 2 CTAs per SM. Both keep 96 KB per SM in flight.
constexpr unsigned SWIGLU_CTAS_PER_SM = 3;
constexpr unsigned SWIGLU_BWD_CTAS_PER_SM = 2;

template <typename In> struct GatherSource {
    static constexpr int V = 16 / sizeof(In);
    static constexpr int OUT = 1;
    struct Raw {
        uint4 v;
        float g;
    };
    const In *x;
    unsigned long long cols;
    const int *token_of_row;
    unsigned long long assignments; // tokens * k: valid entries of token_of_row are below it
    unsigned k;
    const float *row_scale; // nullable
    __device__ __forceinline__ long long assignment(unsigned long long r) const {
        const int a = token_of_row[r];
        return (a < 0 || (unsigned long long)a >= assignments) ? -1 : (long long)a;
    }
    __device__ __forceinline__ Raw load(unsigned long long r, unsigned long long c) const {
        const long long a = assignment(r);
        if (a < 0) return Raw{make_uint4(0, 0, 0, 0), 0.0f};
        const unsigned long long t = (unsigned long long)a / k;
        return Raw{__ldg(reinterpret_cast<const uint4 *>(x + t * cols + c)), row_scale ? row_scale[a] : 1.0f};
    }
    __device__ __forceinline__ void unpack(const Raw &raw, float *f) const {
        unpack16<In>(raw.v, f);
#pragma unroll
        for (int i = 0; i < V; ++i) f[i] *= raw.g;
    }
    __device__ __forceinline__ void at(unsigned long long r, unsigned long long c, float *f) const {
        const long long a = assignment(r);
        if (a < 0) {
            f[0] = 0.0f;
            return;
        }
        const unsigned long long t = (unsigned long long)a / k;
        f[0] = to_f32(x[t * cols + c]) * (row_scale ? row_scale[a] : 1.0f);
    }
};

struct SwigluSource {
    static constexpr int V = 8;
    static constexpr int OUT = 1;
    struct Raw {
        uint4 gate, up;
    };
    const __nv_bfloat16 *a; // [rows, 2 * ffn]
    unsigned long long ffn;
    const int *pad; // nullable: rows with pad[r] < 0 read as zeros
    __device__ __forceinline__ bool padding(unsigned long long r) const { return pad != nullptr && pad[r] < 0; }
    __device__ __forceinline__ Raw load(unsigned long long r, unsigned long long c) const {
        if (padding(r)) return Raw{make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
        const __nv_bfloat16 *row = a + r * 2 * ffn;
        return Raw{__ldg(reinterpret_cast<const uint4 *>(row + c)),
                   __ldg(reinterpret_cast<const uint4 *>(row + ffn + c))};
    }
    __device__ __forceinline__ static float swiglu(float g, float u) { return swiglu_f32(g, u); }
    __device__ __forceinline__ void unpack(const Raw &raw, float *f) const {
        float g[V], u[V];
        unpack16<__nv_bfloat16>(raw.gate, g);
        unpack16<__nv_bfloat16>(raw.up, u);
#pragma unroll
        for (int i = 0; i < V; ++i) f[i] = swiglu(g[i], u[i]);
    }
    __device__ __forceinline__ void at(unsigned long long r, unsigned long long c, float *f) const {
        if (padding(r)) {
            f[0] = swiglu(0.0f, 0.0f);
            return;
        }
        const __nv_bfloat16 *row = a + r * 2 * ffn;
        f[0] = swiglu(to_f32(row[c]), to_f32(row[ffn + c]));
    }
};

struct SwigluBackwardSource {
    static constexpr int V = 8;
    static constexpr int OUT = 2; // f[0 .. V): d gate, f[V .. 2V): d up
    struct Raw {
        uint4 gate, up, dh;
    };
    const __nv_bfloat16 *a;  // [rows, 2 * ffn]
    const __nv_bfloat16 *dh; // [rows, ffn]
    unsigned long long ffn;
    const int *pad; // nullable: rows with pad[r] < 0 read as zeros
    __device__ __forceinline__ bool padding(unsigned long long r) const { return pad != nullptr && pad[r] < 0; }
    // d gate (upper = false) or d up (upper = true) of one column.
    __device__ __forceinline__ static float grad(float g, float u, float d, bool upper) {
        const float s = sigmoid_f32(g);
        return upper ? d * (g * s) : d * u * (s * (1.0f + g * (1.0f - s)));
    }
    __device__ __forceinline__ Raw load(unsigned long long r, unsigned long long c) const {
        if (padding(r)) {
            const uint4 z = make_uint4(0, 0, 0, 0);
            return Raw{z, z, z};
        }
        const __nv_bfloat16 *row = a + r * 2 * ffn;
        return Raw{__ldg(reinterpret_cast<const uint4 *>(row + c)),
                   __ldg(reinterpret_cast<const uint4 *>(row + ffn + c)),
                   __ldg(reinterpret_cast<const uint4 *>(dh + r * ffn + c))};
    }
    __device__ __forceinline__ void unpack(const Raw &raw, float *f) const {
        float g[V], u[V], d[V];
        unpack16<__nv_bfloat16>(raw.gate, g);
        unpack16<__nv_bfloat16>(raw.up, u);
        unpack16<__nv_bfloat16>(raw.dh, d);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            f[i] = grad(g[i], u[i], d[i], false);
            f[V + i] = grad(g[i], u[i], d[i], true);
        }
    }
    __device__ __forceinline__ void at(unsigned long long r, unsigned long long c, float *f) const {
        if (padding(r)) {
            f[0] = grad(0.0f, 0.0f, 0.0f, false);
            f[1] = grad(0.0f, 0.0f, 0.0f, true);
            return;
        }
        const __nv_bfloat16 *row = a + r * 2 * ffn;
        const float g = to_f32(row[c]), u = to_f32(row[ffn + c]), d = to_f32(dh[r * ffn + c]);
        f[0] = grad(g, u, d, false);
        f[1] = grad(g, u, d, true);
    }
};

} // namespace fp8k

// Slots: idx = (scale, scale_inv, amax, noop) indices into their buffers; `used` is
// used_buf[used_idx]. Each cast has a delayed-scaling entry (suffix-less: the scale from
// *scale, amax maxed) and a current-scaling one (_current: the scale from *amax, which the
// format-independent _amax entry filled after the amax was zeroed). COLS is the source's
// columns (the output has Src::OUT times as many); CTAS the resident CTAs per SM the
// launcher sizes the grid for.
#define FP8K_MOE_SRC_GATHER(IN_T)                                                                  \
    const fp8k::GatherSource<IN_T> src{x, cols, token_of_row, assignments, k, row_scale}
#define FP8K_MOE_SRC_SWIGLU const fp8k::SwigluSource src{a, ffn, pad}
#define FP8K_MOE_SRC_SWIGLU_BWD const fp8k::SwigluBackwardSource src{a, dh, ffn, pad}

#define FP8K_MOE_GATHER_PARAMS(IN_T)                                                               \
    const IN_T *x, const int *token_of_row, const float *row_scale, unsigned long long assignments, \
        unsigned k
#define FP8K_MOE_SWIGLU_PARAMS const __nv_bfloat16 *a, const int *pad
#define FP8K_MOE_SWIGLU_BWD_PARAMS const __nv_bfloat16 *a, const __nv_bfloat16 *dh, const int *pad

// One family: NAME, its source parameters and construction, and its columns.
#define FP8K_MOE_CAST(NAME, PARAMS, SRC, COLS, CTAS, FMT_NAME, FMT)                                \
    extern "C" __global__ void __launch_bounds__(fp8k::CT_THREADS, CTAS) NAME##_##FMT_NAME(        \
        PARAMS, uint8_t *y, uint8_t *yt, unsigned long long rows, unsigned long long COLS,         \
        const int *used_buf, unsigned used_idx, float *scale, float *scale_inv, float *amax,       \
        const float *noop, uint4 idx) {                                                            \
        cuda_graph::pdl_enter();                                                                   \
        SRC;                                                                                       \
        fp8k::cast_transpose_src<decltype(src), FMT, false>(                                       \
            src, y, yt, rows, used_buf + used_idx, COLS, fp8k::slot(scale, idx.x),                 \
            fp8k::slot(scale_inv, idx.y), fp8k::slot(amax, idx.z), fp8k::slot(noop, idx.w));       \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(fp8k::CT_THREADS, CTAS) NAME##_current_##FMT_NAME( \
        PARAMS, uint8_t *y, uint8_t *yt, unsigned long long rows, unsigned long long COLS,         \
        const int *used_buf, unsigned used_idx, float *scale, float *scale_inv, float *amax,       \
        const float *noop, uint4 idx) {                                                            \
        cuda_graph::pdl_enter();                                                                   \
        SRC;                                                                                       \
        fp8k::cast_transpose_src<decltype(src), FMT, true>(                                        \
            src, y, yt, rows, used_buf + used_idx, COLS, fp8k::slot(scale, idx.x),                 \
            fp8k::slot(scale_inv, idx.y), fp8k::slot(amax, idx.z), fp8k::slot(noop, idx.w));       \
    }

#define FP8K_MOE_AMAX(NAME, PARAMS, SRC, COLS, CTAS)                                               \
    extern "C" __global__ void __launch_bounds__(fp8k::CT_THREADS, CTAS) NAME##_amax(              \
        PARAMS, unsigned long long rows, unsigned long long COLS, const int *used_buf,             \
        unsigned used_idx, float *amax, const float *noop, uint2 idx) {                            \
        cuda_graph::pdl_enter();                                                                   \
        SRC;                                                                                       \
        fp8k::amax_src(src, rows, used_buf + used_idx, COLS, fp8k::slot(amax, idx.x),              \
                       fp8k::slot(noop, idx.y));                                                   \
    }

#define FP8K_MOE_GATHER_ALL(IN_NAME, IN_T)                                                         \
    FP8K_MOE_CAST(fp8_moe_gather_cast_transpose_##IN_NAME, FP8K_MOE_GATHER_PARAMS(IN_T),            \
                  FP8K_MOE_SRC_GATHER(IN_T), cols, fp8k::CT_CTAS_PER_SM, e4m3, __NV_E4M3)          \
    FP8K_MOE_CAST(fp8_moe_gather_cast_transpose_##IN_NAME, FP8K_MOE_GATHER_PARAMS(IN_T),            \
                  FP8K_MOE_SRC_GATHER(IN_T), cols, fp8k::CT_CTAS_PER_SM, e5m2, __NV_E5M2)          \
    FP8K_MOE_AMAX(fp8_moe_gather_cast_transpose_##IN_NAME, FP8K_MOE_GATHER_PARAMS(IN_T),            \
                  FP8K_MOE_SRC_GATHER(IN_T), cols, fp8k::CT_CTAS_PER_SM)

FP8K_MOE_GATHER_ALL(bf16, __nv_bfloat16)
FP8K_MOE_GATHER_ALL(f32, float)
FP8K_MOE_CAST(fp8_swiglu_cast_transpose_bf16, FP8K_MOE_SWIGLU_PARAMS, FP8K_MOE_SRC_SWIGLU, ffn,
              fp8k::SWIGLU_CTAS_PER_SM, e4m3, __NV_E4M3)
FP8K_MOE_CAST(fp8_swiglu_cast_transpose_bf16, FP8K_MOE_SWIGLU_PARAMS, FP8K_MOE_SRC_SWIGLU, ffn,
              fp8k::SWIGLU_CTAS_PER_SM, e5m2, __NV_E5M2)
FP8K_MOE_AMAX(fp8_swiglu_cast_transpose_bf16, FP8K_MOE_SWIGLU_PARAMS, FP8K_MOE_SRC_SWIGLU, ffn,
              fp8k::SWIGLU_CTAS_PER_SM)
FP8K_MOE_CAST(fp8_swiglu_backward_cast_transpose_bf16, FP8K_MOE_SWIGLU_BWD_PARAMS,
              FP8K_MOE_SRC_SWIGLU_BWD, ffn, fp8k::SWIGLU_BWD_CTAS_PER_SM, e4m3, __NV_E4M3)
FP8K_MOE_CAST(fp8_swiglu_backward_cast_transpose_bf16, FP8K_MOE_SWIGLU_BWD_PARAMS,
              FP8K_MOE_SRC_SWIGLU_BWD, ffn, fp8k::SWIGLU_BWD_CTAS_PER_SM, e5m2, __NV_E5M2)
FP8K_MOE_AMAX(fp8_swiglu_backward_cast_transpose_bf16, FP8K_MOE_SWIGLU_BWD_PARAMS,
              FP8K_MOE_SRC_SWIGLU_BWD, ffn, fp8k::SWIGLU_BWD_CTAS_PER_SM)
