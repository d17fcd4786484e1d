// Cast-transpose: one pass over a [rows, cols] row-major high-precision matrix writes its
// FP8 cast row-major ([rows, cols]) and transposed ([cols, rows]), and maxes amax.
//
// The matrix comes from a *source* (below): a plain matrix (MatrixSource), or values computed
// on the fly from other buffers (the MoE kernels of moe_cast.cuh: a gather of token rows, the
// SwiGLU and its backward), so those fuse with the cast. A source gives V-wide vectors (one
// 16-byte load of a 16-bit matrix, or what the fused math makes of its loads) and single
// elements. Rows at or past `rows_used` (read on the device by the fused kernels; `rows` for
// the plain cast) read as zero; tiles entirely past it are skipped (nothing written).
//
// One CTA of CT_THREADS threads per tile of CtTile<V>::TR rows x TC (64) columns; the grid
// is 1-D over tiles, column tiles fastest. A tile is on the fast path when it is full and
// rows % 16 == 0 and cols % 16 == 0 (every base pointer 16-byte aligned, checked by the
// launcher): each thread does 4 independent 16-byte loads (4 consecutive rows, one vector of
// V columns), converts once, stores its 4 row-major pieces (V bytes each), transposes the
// 4 x V bytes in registers into V words of 4 rows each and puts them in shared memory
// (rows of the transposed tile, padded so the word stores and loads are conflict-free);
// then each thread stores 16-byte pieces of transposed rows. Other tiles (edges, odd
// shapes) go element by element through the same shared tile.
#pragma once
#include "common.cuh"

namespace fp8k {

constexpr unsigned CT_THREADS = 256;

template <int V_> struct CtTile {
    static constexpr int V = V_;                                  // elements per source vector
    static constexpr int TC = 64;                                 // tile columns
    static constexpr int TR = 4 * int(CT_THREADS) * V / TC;       // tile rows: 128 or 64 (f32)
    static constexpr int NCV = TC / V;                            // column vectors per row
    static constexpr int S = TR / 4 + (V == 8 ? 1 : 2);           // shared words per transposed row
    static constexpr int KC = TR / 16;                            // 16-byte pieces per transposed row
};

// Four floats cast to four FP8 bytes in one word (first element in the low byte).
template <__nv_fp8_interpretation_t F>
__device__ __forceinline__ unsigned cast4(const float *f, float s) {
    const unsigned lo = __nv_cvt_float2_to_fp8x2(make_float2(f[0] * s, f[1] * s), __NV_SATFINITE, F);
    const unsigned hi = __nv_cvt_float2_to_fp8x2(make_float2(f[2] * s, f[3] * s), __NV_SATFINITE, F);
    return lo | (hi << 16);
}

// 4x4 byte transpose: w[j] = (a.byte j, b.byte j, c.byte j, d.byte j).
__device__ __forceinline__ void transpose4x4(unsigned a, unsigned b, unsigned c, unsigned d, unsigned *w) {
    const unsigned ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);
    const unsigned cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
    w[0] = __byte_perm(ab_lo, cd_lo, 0x5410);
    w[1] = __byte_perm(ab_lo, cd_lo, 0x7632);
    w[2] = __byte_perm(ab_hi, cd_hi, 0x5410);
    w[3] = __byte_perm(ab_hi, cd_hi, 0x7632);
}

// A thread's place in a full tile (the fast path): a warp covers 4 column vectors x 8 row
// groups, so each load reads 64 contiguous bytes a row, and the shared stores of the
// transposed tile are conflict-free (V * S == 8 mod 32 words). The thread handles rows
// 4 * rg .. 4 * rg + 3 of column vector cv.
template <typename T> struct FastLane {
    unsigned cv, rg;
    __device__ __forceinline__ explicit FastLane(unsigned t) {
        const unsigned lane = t & 31u, warp = t >> 5;
        constexpr unsigned WC = T::NCV / 4; // warps across the tile's columns
        cv = (warp % WC) * 4 + (lane & 3u);
        rg = (warp / WC) * 8 + (lane >> 2);
    }
    // The four loads of rows r .. r + 3 at column c, issued together.
    template <typename Src>
    __device__ __forceinline__ void load4(const Src &src, unsigned long long r, unsigned long long c,
                                          typename Src::Raw *raw) const {
#pragma unroll
        for (int i = 0; i < 4; ++i) raw[i] = src.load(r + i, c);
    }
};

// The plain source: a [rows, cols] row-major matrix of In.
template <typename In> struct MatrixSource {
    static constexpr int V = 16 / sizeof(In);
    using Raw = uint4;
    const In *x;
    unsigned long long cols;
    __device__ __forceinline__ Raw load(unsigned long long r, unsigned long long c) const {
        return __ldg(reinterpret_cast<const uint4 *>(x + r * cols + c));
    }
    __device__ __forceinline__ void unpack(const Raw &raw, float *f) const { unpack16<In>(raw, f); }
    __device__ __forceinline__ float at(unsigned long long r, unsigned long long c) const {
        return to_f32(x[r * cols + c]);
    }
};

// CURRENT: current scaling. *amax already holds max |value| of this tensor (the amax pass
// below ran before); the scale is fp8_max / amax (current_scale), written to *scale by block
// 0 beside scale_inv, and amax is left as it is.
template <typename Src, __nv_fp8_interpretation_t F, bool CURRENT = false>
__device__ __forceinline__ void cast_transpose_src(const Src &src, uint8_t *__restrict__ y,
                                                   uint8_t *__restrict__ yt, unsigned long long rows,
                                                   unsigned long long rows_used, unsigned long long cols,
                                                   float *scale, float *scale_inv, float *amax,
                                                   const float *noop) {
    using T = CtTile<Src::V>;
    constexpr int V = T::V, TR = T::TR, TC = T::TC, S = T::S;
    __shared__ unsigned sm[TC * S];
    if (is_noop(noop)) return;
    const float s = CURRENT ? current_scale(*amax, FormatMax<F>::value) : *scale;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        if (scale_inv != nullptr) *scale_inv = 1.0f / s;
        if (CURRENT) *scale = s;
    }
    const unsigned long long tiles_c = (cols + TC - 1) / TC;
    const unsigned long long row0 = (blockIdx.x / tiles_c) * TR, col0 = (blockIdx.x % tiles_c) * TC;
    if (rows_used > rows) rows_used = rows;
    if (row0 >= rows_used) return; // the whole tile is past the rows in use: nothing to write
    const unsigned t = threadIdx.x;
    unsigned m = 0;
    const bool fast = row0 + TR <= rows_used && col0 + TC <= cols && rows % 16 == 0 && cols % 16 == 0;
    if (fast) {
        const FastLane<T> fl(t);
        const unsigned cv = fl.cv, rg = fl.rg;
        const unsigned long long r = row0 + rg * 4, c = col0 + cv * V;
        typename Src::Raw raw[4];
        fl.load4(src, r, c, raw);
        unsigned o[4][V / 4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float f[V];
            src.unpack(raw[i], f);
#pragma unroll
            for (int k = 0; k < V; ++k) m = max(m, abs_bits(f[k]));
#pragma unroll
            for (int k = 0; k < V / 4; ++k) o[i][k] = cast4<F>(f + 4 * k, s);
            uint8_t *dst = y + (r + i) * cols + c;
            if constexpr (V == 8) {
                *reinterpret_cast<uint2 *>(dst) = make_uint2(o[i][0], o[i][1]);
            } else {
                *reinterpret_cast<unsigned *>(dst) = o[i][0];
            }
        }
#pragma unroll
        for (int k = 0; k < V / 4; ++k) {
            unsigned w[4];
            transpose4x4(o[0][k], o[1][k], o[2][k], o[3][k], w);
#pragma unroll
            for (int j = 0; j < 4; ++j) sm[(cv * V + 4 * k + j) * S + rg] = w[j];
        }
        __syncthreads();
#pragma unroll
        for (unsigned q = t; q < unsigned(TC * T::KC); q += CT_THREADS) {
            const unsigned cc = q / T::KC, k = q % T::KC;
            const unsigned *src = sm + cc * S + 4 * k;
            *reinterpret_cast<uint4 *>(yt + (col0 + cc) * rows + row0 + 16 * k) =
                make_uint4(src[0], src[1], src[2], src[3]);
        }
    } else {
        uint8_t *smb = reinterpret_cast<uint8_t *>(sm);
        // The thread's loads in groups of EL (unrolled, predicated) ahead of their conversions
        // and stores: independent loads in flight together instead of one round trip per
        // element, which dominated small tensors (a whole 16 x 128 input is edge). Groups,
        // not all PER at once, keep the register count (and the fast path's occupancy) low.
        constexpr int PER = TR * TC / int(CT_THREADS), EL = 4;
        static_assert(PER % EL == 0, "edge groups");
        for (int i0 = 0; i0 < PER; i0 += EL) {
            float f[EL];
#pragma unroll
            for (int e = 0; e < EL; ++e) {
                const unsigned q = t + unsigned(i0 + e) * CT_THREADS, rr = q / TC, cc = q % TC;
                const unsigned long long gr = row0 + rr, gc = col0 + cc;
                f[e] = (gr < rows_used && gc < cols) ? src.at(gr, gc) : 0.0f;
            }
#pragma unroll
            for (int e = 0; e < EL; ++e) {
                const unsigned q = t + unsigned(i0 + e) * CT_THREADS, rr = q / TC, cc = q % TC;
                const unsigned long long gr = row0 + rr, gc = col0 + cc;
                if (gr < rows && gc < cols) {
                    m = max(m, abs_bits(f[e]));
                    const uint8_t b = __nv_cvt_float_to_fp8(f[e] * s, __NV_SATFINITE, F);
                    y[gr * cols + gc] = b;
                    smb[cc * S * 4 + rr] = b;
                }
            }
        }
        __syncthreads();
        for (unsigned q = t; q < unsigned(TR * TC); q += CT_THREADS) {
            const unsigned cc = q / TR, rr = q % TR;
            const unsigned long long gr = row0 + rr, gc = col0 + cc;
            if (gr < rows && gc < cols) yt[gc * rows + gr] = smb[cc * S * 4 + rr];
        }
    }
    if (!CURRENT && amax != nullptr) block_amax_atomic(m, amax);
}

// The amax pass of current scaling: max |value| of the source's rows in use into *amax (which
// must hold 0 or a smaller value), tile by tile exactly as cast_transpose_src reads them.
template <typename Src>
__device__ __forceinline__ void amax_src(const Src &src, unsigned long long rows,
                                         unsigned long long rows_used, unsigned long long cols,
                                         float *amax, const float *noop) {
    using T = CtTile<Src::V>;
    constexpr int V = T::V, TR = T::TR, TC = T::TC;
    if (is_noop(noop)) return;
    const unsigned long long tiles_c = (cols + TC - 1) / TC;
    const unsigned long long row0 = (blockIdx.x / tiles_c) * TR, col0 = (blockIdx.x % tiles_c) * TC;
    if (rows_used > rows) rows_used = rows;
    if (row0 >= rows_used) return;
    const unsigned t = threadIdx.x;
    unsigned m = 0;
    if (row0 + TR <= rows_used && col0 + TC <= cols && rows % 16 == 0 && cols % 16 == 0) {
        const FastLane<T> fl(t);
        typename Src::Raw raw[4];
        fl.load4(src, row0 + fl.rg * 4, col0 + fl.cv * V, raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float f[V];
            src.unpack(raw[i], f);
#pragma unroll
            for (int k = 0; k < V; ++k) m = max(m, abs_bits(f[k]));
        }
    } else {
        for (unsigned q = t; q < unsigned(TR * TC); q += CT_THREADS) {
            const unsigned long long gr = row0 + q / TC, gc = col0 + q % TC;
            if (gr < rows_used && gc < cols) m = max(m, abs_bits(src.at(gr, gc)));
        }
    }
    if (amax != nullptr) block_amax_atomic(m, amax);
}

template <typename In, __nv_fp8_interpretation_t F>
__device__ __forceinline__ void cast_transpose(const In *__restrict__ x, uint8_t *__restrict__ y,
                                               uint8_t *__restrict__ yt, unsigned long long rows,
                                               unsigned long long cols, float *scale,
                                               float *scale_inv, float *amax, const float *noop) {
    cast_transpose_src<MatrixSource<In>, F>(MatrixSource<In>{x, cols}, y, yt, rows, rows, cols, scale,
                                            scale_inv, amax, noop);
}

} // namespace fp8k

// Slots: idx = (scale, scale_inv, amax, noop) indices into their buffers.
#define FP8K_CAST_TRANSPOSE(IN_NAME, IN_T, FMT_NAME, FMT)                                           \
    extern "C" __global__ void __launch_bounds__(fp8k::CT_THREADS)                                 \
        fp8_cast_transpose_##IN_NAME##_##FMT_NAME(const IN_T *x, uint8_t *y, uint8_t *yt,          \
                                                  unsigned long long rows, unsigned long long cols, \
                                                  float *scale, float *scale_inv, float *amax,     \
                                                  const float *noop, uint4 idx) {                  \
        cuda_graph::pdl_enter();                                                                   \
        fp8k::cast_transpose<IN_T, FMT>(x, y, yt, rows, cols, fp8k::slot(scale, idx.x),            \
                                        fp8k::slot(scale_inv, idx.y), fp8k::slot(amax, idx.z),     \
                                        fp8k::slot(noop, idx.w));                                  \
    }

FP8K_CAST_TRANSPOSE(f32, float, e4m3, __NV_E4M3)
FP8K_CAST_TRANSPOSE(f32, float, e5m2, __NV_E5M2)
FP8K_CAST_TRANSPOSE(f16, __half, e4m3, __NV_E4M3)
FP8K_CAST_TRANSPOSE(f16, __half, e5m2, __NV_E5M2)
FP8K_CAST_TRANSPOSE(bf16, __nv_bfloat16, e4m3, __NV_E4M3)
FP8K_CAST_TRANSPOSE(bf16, __nv_bfloat16, e5m2, __NV_E5M2)
