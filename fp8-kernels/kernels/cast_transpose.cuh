// Cast-transpose: one pass over a [rows, cols] row-major high-precision matrix writes its
// FP8 cast row-major ([rows, cols]) and transposed ([cols, rows]), and maxes amax.
//
// The matrix comes from a *source* (below): a plain matrix (MatrixSource), or values computed
// on the fly from other buffers (the MoE kernels of moe_cast.cuh: a gather of token rows, the
// SwiGLU and its backward), so those fuse with the cast. A source gives V-wide vectors (one
// 16-byte load of a 16-bit matrix, or what the fused math makes of its loads) and single
// elements. A source may give OUT values per input position (the SwiGLU backward: d gate and
// d up of one column from the same loads): output group j is written at output column
// j * cols + c, so the output is [rows, OUT * cols]. Rows at or past `*used` (the fused
// kernels' rows in use, read on the device; all rows when `used` is null) read as zero; tiles
// entirely past it are skipped (nothing written).
//
// Tiles of CtTile::TR rows x TC (64) source columns (OUT x 64 output columns), numbered
// row-tile-major over the tiles in use. The grid is persistent: a few resident CTAs of
// CT_THREADS threads per SM (CT_CTAS_PER_SM, or a source's own count in moe_cast.cuh; the
// launchers size the grid, and blockIdx.y picks the matrix of a batched cast), and CTA b
// takes tiles b, b + gridDim.x, ... . With one CTA per tile, short-lived CTAs would leave SMs
// idle between them and, at a few waves (the MoE casts have ~2), many SMs idle through the
// last one; here every CTA has the same number of tiles, to within one, and its loads stay
// in flight across tile boundaries.
//
// A tile is on the fast path when it lies inside the matrix and rows % 16 == 0 and
// cols % 16 == 0 (every vector 16-byte aligned, checked by the launcher): each thread does 4
// independent 16-byte loads (4 consecutive rows, one vector of V columns), converts once,
// and, before storing anything, issues the 4 loads of its *next* tile, so that tile's bytes
// are in flight while this one is stored (the loads of the first tile go out before the
// loop). It then stores its 4 row-major pieces (V bytes each), transposes the 4 x V bytes in
// registers into V words of 4 rows each and puts them in shared memory (rows of the
// transposed tile, padded so the word stores and loads are conflict-free); after one
// barrier each thread stores 16-byte pieces of transposed rows (a warp writes 4 whole
// 128-byte lines of 16-bit input's transposed rows). Other tiles (edges, odd shapes) go
// element by element through the same shared tile. Two shared tiles alternate between
// consecutive tiles, so a tile needs one barrier, not two (see the loop).
//
// amax: each thread maxes its values' |bits| over all its tiles; one block-level reduction
// and one atomicMax per CTA at the end.
#pragma once
#include "common.cuh"

namespace fp8k {

constexpr unsigned CT_THREADS = 256;
// Resident CTAs per SM the persistent grid of the plain cast and the gather is sized for
// (their launchers' CTAS_PER_SM; keep in step): 4 x 256 threads with at most 64 registers
// each (__launch_bounds__). A thread keeps 64 bytes (one tile's loads) in flight, 64 KB per
// SM, well above the ~20 KB per SM that H200's read bandwidth (about half of 4.8 TB/s here)
// times its loaded latency (~1 us) asks for. Sources with more loads per vector take fewer
// (moe_cast.cuh).
constexpr unsigned CT_CTAS_PER_SM = 4;

template <int V_, int OUT_> struct CtTile {
    static constexpr int V = V_;                                  // elements per source vector
    static constexpr int OUT = OUT_;                              // outputs per source element
    static constexpr int TC = 64;                                 // tile columns (source)
    static constexpr int TR = 4 * int(CT_THREADS) * V / TC;       // tile rows: 128 or 64 (f32)
    static constexpr int NCV = TC / V;                            // column vectors per row
    static constexpr int S = TR / 4 + (V == 8 ? 1 : 2);           // shared words per transposed row
    static constexpr int KC = TR / 16;                            // 16-byte pieces per transposed row
    static constexpr int WORDS = OUT * TC * S;                    // one shared tile
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

// The rows in use: *used (an int on the device, clamped to 0..rows), or rows when null.
__device__ __forceinline__ unsigned long long rows_in_use(const int *used, unsigned long long rows) {
    if (used == nullptr) return rows;
    const int u = *used;
    return u < 0 ? 0ull : ((unsigned long long)u < rows ? (unsigned long long)u : rows);
}

// A tile's first row and column, and whether it takes the fast path.
struct TilePos {
    unsigned long long row0, col0;
    bool fast;
};

// The tiles of one matrix: those in use (row tiles up to the rows in use, all column tiles;
// fewer than 2^31, checked by the launchers) and where each lies. Every value is uniform over
// the CTA, so every thread takes the same branches and reaches the same barriers.
template <typename T> struct TileWalk {
    unsigned long long rows, rows_used, cols;
    unsigned tiles_c, tiles;
    bool aligned;
    __device__ __forceinline__ TileWalk(unsigned long long rows_, unsigned long long used_,
                                        unsigned long long cols_)
        : rows(rows_), rows_used(used_), cols(cols_), tiles_c(unsigned((cols_ + T::TC - 1) / T::TC)),
          tiles(unsigned((used_ + T::TR - 1) / T::TR) * tiles_c), aligned(rows_ % 16 == 0 && cols_ % 16 == 0) {}
    // Fast when inside the matrix (rows past the ones in use are loaded as zero, not skipped,
    // so the last, partly used row of tiles stays on the fast path) and aligned.
    __device__ __forceinline__ TilePos pos(unsigned tile) const {
        const unsigned long long row0 = (unsigned long long)(tile / tiles_c) * T::TR;
        const unsigned long long col0 = (unsigned long long)(tile % tiles_c) * T::TC;
        return TilePos{row0, col0, aligned && row0 + T::TR <= rows && col0 + T::TC <= cols};
    }
};

// A thread's place in a fast tile: a warp covers 4 column vectors x 8 row groups, so each
// load reads 64 contiguous bytes a row, and the shared stores of the transposed tile are
// conflict-free (V * S == 8 mod 32 words: the 4 column vectors land 8 banks apart, the 8 row
// groups on consecutive banks). The thread handles rows 4 * rg .. 4 * rg + 3 of column
// vector cv.
template <typename T> struct FastLane {
    unsigned cv, rg;
    __device__ __forceinline__ explicit FastLane(unsigned t) {
        const unsigned lane = t & 31u, warp = t >> 5;
        constexpr unsigned WC = T::NCV / 4; // warps across the tile's columns
        cv = (warp % WC) * 4 + (lane & 3u);
        rg = (warp / WC) * 8 + (lane >> 2);
    }
    // The four loads of the thread's rows of the tile at p, issued together; rows past the
    // ones in use are not loaded but zero (each source's unpack makes +0 of a zero Raw, which
    // casts to the byte 0 and adds nothing to amax, as the edge path's zeros do).
    template <typename Src>
    __device__ __forceinline__ void load4(const Src &src, const TilePos &p, unsigned long long rows_used,
                                          typename Src::Raw *raw) const {
        const unsigned long long r = p.row0 + 4 * rg, c = p.col0 + cv * T::V;
#pragma unroll
        for (int i = 0; i < 4; ++i) raw[i] = r + i < rows_used ? src.load(r + i, c) : typename Src::Raw{};
    }
};

// The plain source: a [rows, cols] row-major matrix of In.
template <typename In> struct MatrixSource {
    static constexpr int V = 16 / sizeof(In);
    static constexpr int OUT = 1;
    using Raw = uint4;
    const In *x;
    unsigned long long cols;
    __device__ __forceinline__ Raw load(unsigned long long r, unsigned long long c) const {
        return __ldg(reinterpret_cast<const uint4 *>(x + r * cols + c));
    }
    __device__ __forceinline__ void unpack(const Raw &raw, float *f) const { unpack16<In>(raw, f); }
    __device__ __forceinline__ void at(unsigned long long r, unsigned long long c, float *f) const {
        f[0] = to_f32(x[r * cols + c]);
    }
};

// One fast tile at p: converts the thread's loaded rows (raw), issues the loads of the tile
// at `next` (when `prefetch`) into raw, then stores the tile row-major and, through the
// shared tile smw, transposed. One barrier, between the shared stores and loads.
template <typename Src, __nv_fp8_interpretation_t F, typename T>
__device__ __forceinline__ void fast_tile(const Src &src, const TileWalk<T> &tw, const FastLane<T> &fl,
                                          const TilePos &p, const TilePos &next, bool prefetch,
                                          typename Src::Raw *raw, float s, unsigned &m, uint8_t *y,
                                          uint8_t *yt, unsigned *smw) {
    constexpr int V = T::V, OUT = T::OUT, TC = T::TC, S = T::S, KC = T::KC;
    const unsigned long long row0 = p.row0, col0 = p.col0;
    const unsigned long long rows = tw.rows, cols = tw.cols, out_cols = OUT * cols;
    const unsigned cv = fl.cv, rg = fl.rg;
    unsigned o[OUT][4][V / 4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float f[OUT * V];
        src.unpack(raw[i], f);
#pragma unroll
        for (int k = 0; k < OUT * V; ++k) m = max(m, abs_bits(f[k]));
#pragma unroll
        for (int j = 0; j < OUT; ++j) {
#pragma unroll
            for (int k = 0; k < V / 4; ++k) o[j][i][k] = cast4<F>(f + j * V + 4 * k, s);
        }
    }
    // raw is consumed: the next tile's loads go out now and stay in flight during the stores.
    if (prefetch) fl.load4(src, next, tw.rows_used, raw);
    const unsigned long long r = row0 + rg * 4, c = col0 + cv * V;
#pragma unroll
    for (int j = 0; j < OUT; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            uint8_t *dst = y + (r + i) * out_cols + j * cols + c;
            if constexpr (V == 8) {
                *reinterpret_cast<uint2 *>(dst) = make_uint2(o[j][i][0], o[j][i][1]);
            } else {
                *reinterpret_cast<unsigned *>(dst) = o[j][i][0];
            }
        }
#pragma unroll
        for (int k = 0; k < V / 4; ++k) {
            unsigned w[4];
            transpose4x4(o[j][0][k], o[j][1][k], o[j][2][k], o[j][3][k], w);
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) smw[(j * TC + cv * V + 4 * k + jj) * S + rg] = w[jj];
        }
    }
    __syncthreads();
    // Transposed row cc of the shared tile (output column (cc / TC) * cols + col0 + cc % TC),
    // piece k (16 rows): for 16-bit input 32 consecutive q of a warp read words cc * S + 4k + e
    // of 4 consecutive cc and all 8 k, on 32 distinct banks (S == 1 mod 32), and store 4 whole
    // 128-byte transposed rows of the tile. (f32, off the hot path: 8 cc of 64 bytes, and up
    // to 4-way conflicts, S being 2 mod 8 for the conflict-free stores.)
#pragma unroll
    for (unsigned q = threadIdx.x; q < unsigned(OUT * TC * KC); q += CT_THREADS) {
        const unsigned cc = q / KC, k = q % KC;
        const unsigned *w = smw + cc * S + 4 * k;
        const unsigned long long oc = (cc / TC) * cols + col0 + cc % TC;
        *reinterpret_cast<uint4 *>(yt + oc * rows + row0 + 16 * k) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// One tile off the fast path (edges, odd shapes) at p: element by element through the shared
// tile (as bytes), bound-checking every element. One barrier, between the shared stores and
// loads.
template <typename Src, __nv_fp8_interpretation_t F, typename T>
__device__ __forceinline__ void edge_tile(const Src &src, const TileWalk<T> &tw, const TilePos &p, float s,
                                          unsigned &m, uint8_t *y, uint8_t *yt, unsigned *smw) {
    constexpr int OUT = T::OUT, TR = T::TR, TC = T::TC, S = T::S;
    const unsigned long long row0 = p.row0, col0 = p.col0;
    const unsigned long long rows = tw.rows, cols = tw.cols, out_cols = OUT * cols;
    const unsigned t = threadIdx.x;
    uint8_t *smb = reinterpret_cast<uint8_t *>(smw);
    // The thread's loads in groups of EL (unrolled, predicated) ahead of their conversions
    // and stores: independent loads in flight together instead of one round trip per
    // element, which dominated small tensors (a whole 16 x 128 input is edge). Groups,
    // not all PER at once, keep the register count (and the fast path's occupancy) low.
    constexpr int PER = TR * TC / int(CT_THREADS), EL = 4;
    static_assert(PER % EL == 0, "edge groups");
    for (int i0 = 0; i0 < PER; i0 += EL) {
        float f[EL][OUT];
#pragma unroll
        for (int e = 0; e < EL; ++e) {
            const unsigned q = t + unsigned(i0 + e) * CT_THREADS, rr = q / TC, cc = q % TC;
            const unsigned long long gr = row0 + rr, gc = col0 + cc;
            if (gr < tw.rows_used && gc < cols) {
                src.at(gr, gc, f[e]);
            } else {
#pragma unroll
                for (int j = 0; j < OUT; ++j) f[e][j] = 0.0f;
            }
        }
#pragma unroll
        for (int e = 0; e < EL; ++e) {
            const unsigned q = t + unsigned(i0 + e) * CT_THREADS, rr = q / TC, cc = q % TC;
            const unsigned long long gr = row0 + rr, gc = col0 + cc;
            if (gr < rows && gc < cols) {
#pragma unroll
                for (int j = 0; j < OUT; ++j) {
                    m = max(m, abs_bits(f[e][j]));
                    const uint8_t b = __nv_cvt_float_to_fp8(f[e][j] * s, __NV_SATFINITE, F);
                    y[gr * out_cols + j * cols + gc] = b;
                    smb[(j * TC + cc) * S * 4 + rr] = b;
                }
            }
        }
    }
    __syncthreads();
    for (unsigned q = t; q < unsigned(OUT * TR * TC); q += CT_THREADS) {
        const unsigned cc = q / TR, rr = q % TR;
        const unsigned long long gr = row0 + rr, gc = col0 + cc % TC;
        if (gr < rows && gc < cols) yt[((cc / TC) * cols + gc) * rows + gr] = smb[cc * S * 4 + rr];
    }
}

// The cast of one matrix by the CTAs of one blockIdx.y (gridDim.x of them). used: the rows
// in use (nullable: all). CURRENT: current scaling. *amax already holds max |value| of this
// tensor (the amax pass below ran before); the scale is fp8_max / amax (current_scale),
// written to *scale by block 0 beside scale_inv, and amax is left as it is.
template <typename Src, __nv_fp8_interpretation_t F, bool CURRENT = false>
__device__ __forceinline__ void cast_transpose_src(const Src &src, uint8_t *__restrict__ y,
                                                   uint8_t *__restrict__ yt, unsigned long long rows,
                                                   const int *used, unsigned long long cols, float *scale,
                                                   float *scale_inv, float *amax, const float *noop) {
    using T = CtTile<Src::V, Src::OUT>;
    __shared__ unsigned sm[2][T::WORDS];
    // The flag and the rows in use are independent loads (one round trip); the scale is needed
    // only at the first conversion, so its load may follow the noop check, beside the first
    // tile's loads.
    const bool skip = is_noop(noop);
    const TileWalk<T> tw(rows, rows_in_use(used, rows), cols);
    const float s = CURRENT ? current_scale(*amax, FormatMax<F>::value) : *scale;
    if (skip) return;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        if (scale_inv != nullptr) *scale_inv = 1.0f / s;
        if (CURRENT) *scale = s;
    }
    const FastLane<T> fl(threadIdx.x);
    typename Src::Raw raw[4];
    unsigned m = 0;
    unsigned tile = blockIdx.x;
    TilePos cur = tw.pos(tile);
    if (tile < tw.tiles && cur.fast) fl.load4(src, cur, tw.rows_used, raw);
    // The CTA's i-th tile uses shared tile sm[i % 2]. A thread writing it for tile i + 2 has
    // passed tile i + 1's barrier, which every thread reaches only after its reads of tile i:
    // no barrier at the end of a tile.
    for (unsigned b = 0; tile < tw.tiles; tile += gridDim.x, b ^= 1u) {
        const TilePos next = tw.pos(tile + gridDim.x);
        const bool prefetch = tile + gridDim.x < tw.tiles && next.fast;
        if (cur.fast) {
            fast_tile<Src, F>(src, tw, fl, cur, next, prefetch, raw, s, m, y, yt, sm[b]);
        } else {
            if (prefetch) fl.load4(src, next, tw.rows_used, raw);
            edge_tile<Src, F>(src, tw, cur, s, m, y, yt, sm[b]);
        }
        cur = next;
    }
    if (!CURRENT && amax != nullptr) block_amax_atomic(m, amax);
}

// The amax pass of current scaling: max |value| of the source's rows in use into *amax (which
// must hold 0 or a smaller value), over the same tiles and grid as cast_transpose_src, the
// next tile's loads issued before this tile's values are maxed.
template <typename Src>
__device__ __forceinline__ void amax_src(const Src &src, unsigned long long rows, const int *used,
                                         unsigned long long cols, float *amax, const float *noop) {
    using T = CtTile<Src::V, Src::OUT>;
    constexpr int V = T::V, OUT = T::OUT, TR = T::TR, TC = T::TC;
    const bool skip = is_noop(noop);
    const TileWalk<T> tw(rows, rows_in_use(used, rows), cols);
    if (skip) return;
    const unsigned t = threadIdx.x;
    const FastLane<T> fl(t);
    typename Src::Raw raw[4];
    unsigned m = 0;
    unsigned tile = blockIdx.x;
    TilePos cur = tw.pos(tile);
    if (tile < tw.tiles && cur.fast) fl.load4(src, cur, tw.rows_used, raw);
    for (; tile < tw.tiles; tile += gridDim.x) {
        const TilePos next = tw.pos(tile + gridDim.x);
        const bool prefetch = tile + gridDim.x < tw.tiles && next.fast;
        if (cur.fast) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float f[OUT * V];
                src.unpack(raw[i], f);
#pragma unroll
                for (int k = 0; k < OUT * V; ++k) m = max(m, abs_bits(f[k]));
            }
            if (prefetch) fl.load4(src, next, tw.rows_used, raw);
        } else {
            if (prefetch) fl.load4(src, next, tw.rows_used, raw);
            for (unsigned q = t; q < unsigned(TR * TC); q += CT_THREADS) {
                const unsigned long long gr = cur.row0 + q / TC, gc = cur.col0 + q % TC;
                if (gr < tw.rows_used && gc < cols) {
                    float f[OUT];
                    src.at(gr, gc, f);
#pragma unroll
                    for (int j = 0; j < OUT; ++j) m = max(m, abs_bits(f[j]));
                }
            }
        }
        cur = next;
    }
    if (amax != nullptr) block_amax_atomic(m, amax);
}

} // namespace fp8k

// Matrix blockIdx.y of a batch: input, outputs and transposed outputs at g * rows * cols
// elements; its scalar slots at idx + g * stride (idx = (scale, scale_inv, amax, noop) and
// stride = (scale, scale_inv, amax) in elements of their buffers; the noop flag is shared).
#define FP8K_CAST_TRANSPOSE(IN_NAME, IN_T, FMT_NAME, FMT)                                           \
    extern "C" __global__ void __launch_bounds__(fp8k::CT_THREADS, fp8k::CT_CTAS_PER_SM)           \
        fp8_cast_transpose_##IN_NAME##_##FMT_NAME(const IN_T *x, uint8_t *y, uint8_t *yt,          \
                                                  unsigned long long rows, unsigned long long cols, \
                                                  float *scale, float *scale_inv, float *amax,     \
                                                  const float *noop, uint4 idx, uint3 stride) {    \
        cuda_graph::pdl_enter();                                                                   \
        const unsigned g = blockIdx.y;                                                             \
        const unsigned long long off = (unsigned long long)g * rows * cols;                        \
        fp8k::cast_transpose_src<fp8k::MatrixSource<IN_T>, FMT>(                                   \
            fp8k::MatrixSource<IN_T>{x + off, cols}, y + off, yt + off, rows, nullptr, cols,       \
            fp8k::slot(scale, idx.x + g * stride.x), fp8k::slot(scale_inv, idx.y + g * stride.y),  \
            fp8k::slot(amax, idx.z + g * stride.z), fp8k::slot(noop, idx.w));                      \
    }

FP8K_CAST_TRANSPOSE(f32, float, e4m3, __NV_E4M3)
FP8K_CAST_TRANSPOSE(f32, float, e5m2, __NV_E5M2)
FP8K_CAST_TRANSPOSE(f16, __half, e4m3, __NV_E4M3)
FP8K_CAST_TRANSPOSE(f16, __half, e5m2, __NV_E5M2)
FP8K_CAST_TRANSPOSE(bf16, __nv_bfloat16, e4m3, __NV_E4M3)
FP8K_CAST_TRANSPOSE(bf16, __nv_bfloat16, e5m2, __NV_E5M2)
