// Portable FP8 GEMM (sm_80 and newer): D[M,N] = alpha * A[M,K] . B[N,K]^T (+ bias) (+ D),
// both operands K-major ("TN"), fp32 accumulation, bf16 (RNE) or f32 output.
//
// Every FP8 value is exact in f16 (E4M3: 2^-9..448, E5M2: 2^-16..57344), and the product of
// two f16 values with at most 4 significant bits each is exact in f32, so the kernel widens
// the FP8 bytes to f16 in registers and issues mma.sync.m16n8k16.f32.f16.f16.f32, which every
// GPU from sm_80 on has. The only rounding is in the fp32 accumulation and the epilogue.
//
// Tiles: BM x 128 x 32 (BM = 128, or 64 for the block-scaled kernel, which keeps a second
// accumulator), 256 threads = 8 warps as 2 (M) x 4 (N), warp tile (BM/2) x 32. Operand
// tiles go global -> shared with cp.async (16-byte chunks; rows out of range and the K tail
// are zero-filled), double-buffered; shared rows are padded to 48 bytes, which makes the
// 2-byte fragment reads conflict-free. Grid: x = M tiles, y = N tiles, z = groups.
//
// Grouped GEMM: counts[g] (int32 on the device, clamped to [0, M]) is the number of real rows
// of group g; CTAs whose M tile starts at or beyond it return at once, and rows >= counts[g]
// are neither read nor written. Nothing on the host depends on the counts.
//
// Packed grouped GEMMs (dropless MoE, see "Packed layout" below): the rows of every group lie
// back to back in one [capacity, K] buffer from device offsets. gemm_packed (forward / data
// gradient) gives each CTA a 128-row tile, which finds its group by binary search over the
// offsets; gemm_wgrad (weight gradient) runs one grid z-slice per group with the group's
// reduction range [offsets[g], offsets[g+1]) of K-major operands of row stride capacity.
// All three share gemm_tile, the main loop over one output tile.
#pragma once
#include "common.cuh"

namespace fp8k {

constexpr int GM_THREADS = 256;
constexpr int GM_BN = 128;
constexpr int GM_BK = 32;
constexpr int GM_LDS = 48; // shared row stride in bytes (32 + 16 padding)

// Bias kinds as the launcher passes them.
constexpr int GM_BIAS_NONE = 0, GM_BIAS_F32 = 1, GM_BIAS_BF16 = 2;

__device__ __forceinline__ unsigned smem_addr(const void *p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; src_bytes = 0 zero-fills the destination.
__device__ __forceinline__ void cp_async16(void *dst, const void *src, unsigned src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Two FP8 bytes (low byte first) -> an f16x2 register (exact).
template <__nv_fp8_interpretation_t F> __device__ __forceinline__ unsigned fp8x2_to_h2(unsigned short v) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v), F);
    return static_cast<unsigned>(h.x) | (static_cast<unsigned>(h.y) << 16);
}

__device__ __forceinline__ void mma_f16_16816(float *c, const unsigned *a, const unsigned *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <typename Out> __device__ __forceinline__ float load_out(const Out *p);
template <> __device__ __forceinline__ float load_out<float>(const float *p) { return *p; }
template <> __device__ __forceinline__ float load_out<__nv_bfloat16>(const __nv_bfloat16 *p) {
    return __bfloat162float(*p);
}

// The epilogue of one output element: v = acc * alpha (+ bias[col]) (+ D), rounded once.
template <typename Out>
__device__ __forceinline__ void store_out(Out *d, unsigned long long at, float acc, float alpha,
                                          const void *bias, int bias_kind, unsigned long long col,
                                          int accumulate) {
    float v = acc * alpha;
    if (bias_kind == GM_BIAS_F32) v += static_cast<const float *>(bias)[col];
    else if (bias_kind == GM_BIAS_BF16) v += __bfloat162float(static_cast<const __nv_bfloat16 *>(bias)[col]);
    if (accumulate) v += load_out<Out>(d + at);
    d[at] = from_f32<Out>(v);
}

// Real rows of group g: M, or counts[g] clamped to [0, M].
__device__ __forceinline__ unsigned long long group_rows(const int *counts, unsigned g,
                                                         unsigned long long m) {
    if (counts == nullptr) return m;
    const int c = counts[g];
    return c <= 0 ? 0ull : min(static_cast<unsigned long long>(c), m);
}

// One output tile of D = alpha * A . B^T (+ bias) (+ D): rows [m0, m0 + BM) by columns
// [n0, n0 + GM_BN), of which only rows m0 + [row_lo, row_hi) (0 <= row_lo <= row_hi <= BM,
// relative to the tile) and columns < n are read and written (the rest of the operand tiles
// is zero-filled). Row r of A starts at a + r * lda, row c of B at b + c * ldb (16-byte
// aligned: lda, ldb and k are multiples of 16, a and b 16-byte aligned); element (r, c) of D
// is d[r * n + c]. k is the reduction length (a multiple of 16; 0 gives acc = 0). Every
// thread of the CTA must call it with the same arguments; its last shared-memory read is
// followed by a __syncthreads(), so it may be called again in a loop.
//
// WMF = M fragments (of 16 rows) per warp: BM = 2 * 16 * WMF.
// BLOCKWISE: per-128-of-K scales, sa [rows, KB] (per row r, indexed from a's row 0) and
// sb [ceil(N/128), KB] (per 128 columns; BN == 128 so one value per CTA and k-block),
// applied when each k-block ends; alpha is then ignored.
template <__nv_fp8_interpretation_t FA, __nv_fp8_interpretation_t FB, typename Out, int WMF, bool BLOCKWISE>
__device__ __forceinline__ void gemm_tile(const uint8_t *__restrict__ a, unsigned long long lda,
                                          const uint8_t *__restrict__ b, unsigned long long ldb,
                                          Out *__restrict__ d, const void *bias, int bias_kind,
                                          float alpha, const float *__restrict__ sa,
                                          const float *__restrict__ sb, unsigned long long m0,
                                          unsigned long long n0, int row_lo, int row_hi,
                                          unsigned long long n,
                                          unsigned long long k, int accumulate) {
    constexpr int BM = 2 * 16 * WMF;
    __shared__ __align__(16) uint8_t As[2][BM][GM_LDS];
    __shared__ __align__(16) uint8_t Bs[2][GM_BN][GM_LDS];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3; // 2 x 4 warps
    const int gid = lane >> 2, tig = lane & 3;

    // One 16-byte chunk = (row, half of the 32-byte k slice). A zero-filled chunk reads
    // nothing (src_bytes = 0); its source operand is the tile's base pointer.
    auto load_tile = [&](int buf, unsigned long long k0) {
        for (int c = tid; c < BM * 2; c += GM_THREADS) {
            const int r = c >> 1, h = c & 1;
            const unsigned long long gk = k0 + h * 16;
            const bool ok = r >= row_lo && r < row_hi && gk < k;
            cp_async16(&As[buf][r][h * 16], ok ? a + (m0 + r) * lda + gk : a, ok ? 16u : 0u);
        }
        for (int c = tid; c < GM_BN * 2; c += GM_THREADS) {
            const int r = c >> 1, h = c & 1;
            const unsigned long long gr = n0 + r, gk = k0 + h * 16;
            const bool ok = gr < n && gk < k;
            cp_async16(&Bs[buf][r][h * 16], ok ? b + gr * ldb + gk : b, ok ? 16u : 0u);
        }
        cp_async_commit();
    };

    float acc[WMF][4][4];
    float part[BLOCKWISE ? WMF : 1][4][4];
#pragma unroll
    for (int i = 0; i < WMF; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;
    if constexpr (BLOCKWISE) {
#pragma unroll
        for (int i = 0; i < WMF; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) part[i][j][q] = 0.0f;
    }

    const unsigned long long ktiles = (k + GM_BK - 1) / GM_BK;
    const unsigned long long kblocks = (k + 127) / 128;
    if (ktiles > 0) load_tile(0, 0);
    for (unsigned long long kt = 0; kt < ktiles; ++kt) {
        const int buf = static_cast<int>(kt & 1);
        if (kt + 1 < ktiles) {
            load_tile(buf ^ 1, (kt + 1) * GM_BK);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < GM_BK; kk += 16) {
            unsigned af[WMF][4], bf[4][2];
#pragma unroll
            for (int i = 0; i < WMF; ++i) {
                const int r = wm * (BM / 2) + i * 16 + gid;
                const uint8_t *p0 = &As[buf][r][kk + 2 * tig];
                const uint8_t *p1 = &As[buf][r + 8][kk + 2 * tig];
                af[i][0] = fp8x2_to_h2<FA>(*reinterpret_cast<const unsigned short *>(p0));
                af[i][1] = fp8x2_to_h2<FA>(*reinterpret_cast<const unsigned short *>(p1));
                af[i][2] = fp8x2_to_h2<FA>(*reinterpret_cast<const unsigned short *>(p0 + 8));
                af[i][3] = fp8x2_to_h2<FA>(*reinterpret_cast<const unsigned short *>(p1 + 8));
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int r = wn * 32 + j * 8 + gid;
                const uint8_t *p = &Bs[buf][r][kk + 2 * tig];
                bf[j][0] = fp8x2_to_h2<FB>(*reinterpret_cast<const unsigned short *>(p));
                bf[j][1] = fp8x2_to_h2<FB>(*reinterpret_cast<const unsigned short *>(p + 8));
            }
#pragma unroll
            for (int i = 0; i < WMF; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if constexpr (BLOCKWISE) mma_f16_16816(part[i][j], af[i], bf[j]);
                    else mma_f16_16816(acc[i][j], af[i], bf[j]);
                }
        }
        if constexpr (BLOCKWISE) {
            // End of a 128-wide k-block (4 k-tiles) or of K: promote with the block's scales.
            if (((kt + 1) % (128 / GM_BK)) == 0 || kt + 1 == ktiles) {
                const unsigned long long kb = kt / (128 / GM_BK);
                const float s_b = sb[(n0 / GM_BN) * kblocks + kb];
#pragma unroll
                for (int i = 0; i < WMF; ++i) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int r = wm * (BM / 2) + i * 16 + gid + h * 8;
                        const float s = r >= row_lo && r < row_hi ? sa[(m0 + r) * kblocks + kb] * s_b : 0.0f;
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            acc[i][j][2 * h] += part[i][j][2 * h] * s;
                            acc[i][j][2 * h + 1] += part[i][j][2 * h + 1] * s;
                            part[i][j][2 * h] = 0.0f;
                            part[i][j][2 * h + 1] = 0.0f;
                        }
                    }
                }
            }
        }
        __syncthreads(); // the buffer just read is the next iteration's (or call's) load target
    }

#pragma unroll
    for (int i = 0; i < WMF; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int r = wm * (BM / 2) + i * 16 + gid + (q >> 1) * 8;
                const unsigned long long c = n0 + wn * 32 + j * 8 + 2 * tig + (q & 1);
                if (r >= row_lo && r < row_hi && c < n)
                    store_out<Out>(d, (m0 + r) * n + c, acc[i][j][q], alpha, bias, bias_kind, c, accumulate);
            }
}

// The plain and masked grouped GEMM (grid x = M tiles, y = N tiles, z = groups): A
// [groups, m, k], B [groups, n, k], D [groups, m, n]; group g's real rows are
// group_rows(counts, g, m).
template <__nv_fp8_interpretation_t FA, __nv_fp8_interpretation_t FB, typename Out, int WMF, bool BLOCKWISE>
__device__ __forceinline__ void gemm_mma(const uint8_t *__restrict__ a, const uint8_t *__restrict__ b,
                                         Out *__restrict__ d, const void *bias, int bias_kind,
                                         const int *counts, float alpha, const float *__restrict__ sa,
                                         const float *__restrict__ sb, unsigned long long m,
                                         unsigned long long n, unsigned long long k, int accumulate) {
    constexpr int BM = 2 * 16 * WMF;
    const unsigned g = blockIdx.z;
    const unsigned long long rows = group_rows(counts, g, m);
    const unsigned long long m0 = static_cast<unsigned long long>(blockIdx.x) * BM;
    const unsigned long long n0 = static_cast<unsigned long long>(blockIdx.y) * GM_BN;
    if (m0 >= rows) return; // the whole CTA leaves together
    gemm_tile<FA, FB, Out, WMF, BLOCKWISE>(a + static_cast<unsigned long long>(g) * m * k, k,
                                           b + static_cast<unsigned long long>(g) * n * k, k,
                                           d + static_cast<unsigned long long>(g) * m * n, bias,
                                           bias_kind, alpha, sa, sb, m0, n0, 0,
                                           static_cast<int>(min(rows - m0, static_cast<unsigned long long>(BM))),
                                           n, k, accumulate);
}

// ---- Packed (dropless MoE) layout ------------------------------------------------------
//
// Group g's rows of the packed buffer start at offsets[g] (int32 on the device, groups + 1
// entries). The kernels read each entry as
//   eff(i) = clamp(offsets[i], 0, capacity) rounded down to a multiple of 16
// and give group g the rows
//   [lo_g, hi_g) with total = eff(groups), lo_g = min(eff(g), total),
//                     hi_g = clamp(eff(g + 1), lo_g, total),
// so whatever the offsets hold, every row touched lies in [0, total) within [0, capacity),
// and (wgrad) every K range starts on a 16-byte boundary. Well-formed offsets (0 first,
// non-decreasing, multiples of 16, the last <= capacity) are taken as they are.

__device__ __forceinline__ unsigned long long packed_offset(const int *offsets, unsigned i,
                                                            unsigned long long capacity) {
    const int o = offsets[i];
    const unsigned long long c = o <= 0 ? 0ull : min(static_cast<unsigned long long>(o), capacity);
    return c & ~15ull;
}

struct RowRange {
    unsigned long long lo, hi;
};

__device__ __forceinline__ RowRange packed_rows(const int *offsets, unsigned g, unsigned long long total,
                                                unsigned long long capacity) {
    const unsigned long long lo = min(packed_offset(offsets, g, capacity), total);
    const unsigned long long hi = min(max(packed_offset(offsets, g + 1, capacity), lo), total);
    return {lo, hi};
}

// Packed grouped GEMM, forward / data gradient: grid x = capacity / 128 row tiles, y = N
// tiles. A [capacity, k], B [groups, n, k], D [capacity, n]; rows of group g use B[g] and
// alpha = sa[ia] * sb[ib + g * sb_stride] (sb_stride 0: one scale, 1: one per group).
//
// The CTA's rows [m0, m0 + 128): it leaves at once when m0 >= total; else it finds by
// binary search the first group whose end eff(g + 1) is past m0, and computes the rows of
// that group in its tile, then of the following groups while they start inside the tile.
// With offsets that are multiples of 128 that is one group (empty groups ending at m0 are
// skipped by the search); with non-decreasing offsets that are not, a tile straddling
// groups is computed group by group, so the result is still right. Non-monotone offsets:
// each row written is in [0, total) and computed with some group's B; which is unspecified.
template <__nv_fp8_interpretation_t FA, __nv_fp8_interpretation_t FB, typename Out>
__device__ __forceinline__ void gemm_packed(const uint8_t *__restrict__ a, const uint8_t *__restrict__ b,
                                            Out *__restrict__ d, const void *bias, int bias_kind,
                                            const int *offsets, const float *sa, unsigned ia,
                                            const float *sb, unsigned ib, unsigned sb_stride,
                                            unsigned groups, unsigned long long capacity,
                                            unsigned long long n, unsigned long long k, int accumulate) {
    constexpr int WMF = 4;
    constexpr unsigned long long BM = 2 * 16 * WMF;
    const unsigned long long m0 = static_cast<unsigned long long>(blockIdx.x) * BM, m1 = m0 + BM;
    const unsigned long long n0 = static_cast<unsigned long long>(blockIdx.y) * GM_BN;
    const unsigned long long total = packed_offset(offsets, groups, capacity);
    if (m0 >= total) return; // the whole CTA leaves together
    // First g in [0, groups) with eff(g + 1) > m0 (groups if none).
    unsigned lo = 0, hi = groups;
    while (lo < hi) {
        const unsigned mid = lo + (hi - lo) / 2;
        if (packed_offset(offsets, mid + 1, capacity) > m0) hi = mid;
        else lo = mid + 1;
    }
#pragma unroll 1
    for (unsigned g = lo; g < groups; ++g) {
        const RowRange rows = packed_rows(offsets, g, total, capacity);
        if (rows.lo >= m1) break; // starts past the tile
        const unsigned long long r0 = max(rows.lo, m0), r1 = min(rows.hi, m1);
        if (r0 < r1) {
            const float alpha = sa[ia] * sb[ib + g * sb_stride];
            gemm_tile<FA, FB, Out, WMF, false>(a, k, b + static_cast<unsigned long long>(g) * n * k, k, d,
                                               bias, bias_kind, alpha, nullptr, nullptr, m0, n0,
                                               static_cast<int>(r0 - m0), static_cast<int>(r1 - m0), n, k,
                                               accumulate);
        }
        if (rows.hi >= m1 || rows.hi >= total) break; // the tile (or every row) is done
    }
}

// Packed grouped weight gradient: grid x = M tiles, y = N tiles, z = groups. A [m, capacity]
// and B [n, capacity] (K-major, row stride capacity), D [groups, m, n]:
// D[g] = alpha * A[:, lo_g..hi_g] . B[:, lo_g..hi_g]^T (+ D[g]). K_g = hi_g - lo_g is a
// multiple of 16; when it is 0 the CTA writes +0 to its tile of D[g] (or, accumulating,
// leaves it alone).
template <__nv_fp8_interpretation_t FA, __nv_fp8_interpretation_t FB, typename Out>
__device__ __forceinline__ void gemm_wgrad(const uint8_t *__restrict__ a, const uint8_t *__restrict__ b,
                                           Out *__restrict__ d, const int *offsets, float alpha,
                                           unsigned groups, unsigned long long capacity,
                                           unsigned long long m, unsigned long long n, int accumulate) {
    constexpr int WMF = 4;
    constexpr unsigned long long BM = 2 * 16 * WMF;
    const unsigned g = blockIdx.z;
    const unsigned long long m0 = static_cast<unsigned long long>(blockIdx.x) * BM;
    const unsigned long long n0 = static_cast<unsigned long long>(blockIdx.y) * GM_BN;
    const unsigned long long total = packed_offset(offsets, groups, capacity);
    const RowRange ks = packed_rows(offsets, g, total, capacity);
    d += static_cast<unsigned long long>(g) * m * n;
    if (ks.hi == ks.lo) {
        if (accumulate) return;
        for (unsigned i = threadIdx.x; i < BM * GM_BN; i += GM_THREADS) {
            const unsigned long long r = m0 + i / GM_BN, c = n0 + i % GM_BN;
            if (r < m && c < n) d[r * n + c] = from_f32<Out>(0.0f);
        }
        return;
    }
    gemm_tile<FA, FB, Out, WMF, false>(a + ks.lo, capacity, b + ks.lo, capacity, d, nullptr, GM_BIAS_NONE,
                                       alpha, nullptr, nullptr, m0, n0, 0, static_cast<int>(min(m - m0, BM)), n,
                                       ks.hi - ks.lo, accumulate);
}

// Slow test oracle: one thread per output element (grid-stride over groups * M * N), FP8
// decoded exactly, products and sums in f32 in k order, the same epilogue as the MMA kernel.
template <__nv_fp8_interpretation_t FA, __nv_fp8_interpretation_t FB, typename Out>
__device__ __forceinline__ void gemm_reference(const uint8_t *a, const uint8_t *b, Out *d,
                                               const void *bias, int bias_kind, const int *counts,
                                               float alpha, unsigned long long groups,
                                               unsigned long long m, unsigned long long n,
                                               unsigned long long k, int accumulate) {
    const unsigned long long total = groups * m * n;
    for (unsigned long long i = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
         i < total; i += static_cast<unsigned long long>(gridDim.x) * blockDim.x) {
        const unsigned long long g = i / (m * n), r = (i / n) % m, c = i % n;
        if (r >= group_rows(counts, static_cast<unsigned>(g), m)) continue;
        const uint8_t *ar = a + (g * m + r) * k;
        const uint8_t *br = b + (g * n + c) * k;
        float s = 0.0f;
        for (unsigned long long q = 0; q < k; ++q) {
            const float x = __half2float(__half(__nv_cvt_fp8_to_halfraw(ar[q], FA)));
            const float y = __half2float(__half(__nv_cvt_fp8_to_halfraw(br[q], FB)));
            s = fmaf(x, y, s);
        }
        store_out<Out>(d, i, s, alpha, bias, bias_kind, c, accumulate);
    }
}

// alpha = *sa * *sb, read at run time (scalar slots as (buffer, index)).
__device__ __forceinline__ float gemm_alpha(const float *sa, unsigned ia, const float *sb, unsigned ib) {
    return sa[ia] * sb[ib];
}

} // namespace fp8k

// Minimum CTAs per SM asked of the packed kernels: 2 caps them at 128 registers (the group
// loop of gemm_packed otherwise lets ptxas take ~170, one CTA per SM), which fits without
// spills where FP8 converts in hardware (sm_89+: SASS in the fatbin); below that (the
// compute_80 PTX, JIT-compiled) the software conversion needs more and the cap would spill.
// Launch bounds may differ per __CUDA_ARCH__ (CUDA programming guide, "Launch Bounds"); the
// host never reads them.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#define FP8K_PACKED_MIN_BLOCKS 1
#else
#define FP8K_PACKED_MIN_BLOCKS 2
#endif

// Kernel symbols: fp8_gemm_{mma,blockwise,reference,packed,wgrad}_<a fmt>_<b fmt>_<out>.
#define FP8K_GEMM(AN, FA, BN_, FB, ON, OT)                                                          \
    extern "C" __global__ void __launch_bounds__(fp8k::GM_THREADS) fp8_gemm_mma_##AN##_##BN_##_##ON(   \
        const uint8_t *a, const uint8_t *b, OT *d, const void *bias, int bias_kind, const int *counts, \
        const float *sa, unsigned ia, const float *sb, unsigned ib, unsigned long long m,           \
        unsigned long long n, unsigned long long k, int accumulate) {                              \
        cuda_graph::pdl_enter();                                                                   \
        fp8k::gemm_mma<FA, FB, OT, 4, false>(a, b, d, bias, bias_kind, counts,                     \
                                             fp8k::gemm_alpha(sa, ia, sb, ib), nullptr, nullptr, m, \
                                             n, k, accumulate);                                     \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(fp8k::GM_THREADS)                                 \
        fp8_gemm_blockwise_##AN##_##BN_##_##ON(const uint8_t *a, const uint8_t *b, OT *d,          \
                                               const void *bias, int bias_kind, const float *sa,    \
                                               const float *sb, unsigned long long m,              \
                                               unsigned long long n, unsigned long long k,         \
                                               int accumulate) {                                   \
        cuda_graph::pdl_enter();                                                                   \
        fp8k::gemm_mma<FA, FB, OT, 2, true>(a, b, d, bias, bias_kind, nullptr, 1.0f, sa, sb, m, n, \
                                            k, accumulate);                                        \
    }                                                                                              \
    extern "C" __global__ void fp8_gemm_reference_##AN##_##BN_##_##ON(                             \
        const uint8_t *a, const uint8_t *b, OT *d, const void *bias, int bias_kind, const int *counts, \
        const float *sa, unsigned ia, const float *sb, unsigned ib, unsigned long long groups,      \
        unsigned long long m, unsigned long long n, unsigned long long k, int accumulate) {        \
        cuda_graph::pdl_enter();                                                                   \
        fp8k::gemm_reference<FA, FB, OT>(a, b, d, bias, bias_kind, counts,                         \
                                         fp8k::gemm_alpha(sa, ia, sb, ib), groups, m, n, k,        \
                                         accumulate);                                              \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(fp8k::GM_THREADS, FP8K_PACKED_MIN_BLOCKS) fp8_gemm_packed_##AN##_##BN_##_##ON( \
        const uint8_t *a, const uint8_t *b, OT *d, const void *bias, int bias_kind, const int *offsets, \
        const float *sa, unsigned ia, const float *sb, unsigned ib, unsigned sb_stride, unsigned groups, \
        unsigned long long capacity, unsigned long long n, unsigned long long k, int accumulate) {  \
        cuda_graph::pdl_enter();                                                                   \
        fp8k::gemm_packed<FA, FB, OT>(a, b, d, bias, bias_kind, offsets, sa, ia, sb, ib, sb_stride, \
                                      groups, capacity, n, k, accumulate);                         \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(fp8k::GM_THREADS, FP8K_PACKED_MIN_BLOCKS) fp8_gemm_wgrad_##AN##_##BN_##_##ON( \
        const uint8_t *a, const uint8_t *b, OT *d, const int *offsets, const float *sa, unsigned ia, \
        const float *sb, unsigned ib, unsigned groups, unsigned long long capacity,                \
        unsigned long long m, unsigned long long n, int accumulate) {                              \
        cuda_graph::pdl_enter();                                                                   \
        fp8k::gemm_wgrad<FA, FB, OT>(a, b, d, offsets, fp8k::gemm_alpha(sa, ia, sb, ib), groups,   \
                                     capacity, m, n, accumulate);                                  \
    }

#define FP8K_GEMM_OUTS(AN, FA, BN_, FB)                                                             \
    FP8K_GEMM(AN, FA, BN_, FB, f32, float)                                                          \
    FP8K_GEMM(AN, FA, BN_, FB, bf16, __nv_bfloat16)

FP8K_GEMM_OUTS(e4m3, __NV_E4M3, e4m3, __NV_E4M3)
FP8K_GEMM_OUTS(e4m3, __NV_E4M3, e5m2, __NV_E5M2)
FP8K_GEMM_OUTS(e5m2, __NV_E5M2, e4m3, __NV_E4M3)
FP8K_GEMM_OUTS(e5m2, __NV_E5M2, e5m2, __NV_E5M2)
