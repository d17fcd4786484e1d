// Causal multi-head self-attention and its backward, flash-attention-2 style on bf16 tensor
// cores (mma.sync m16n8k16, f32 accumulate; ldmatrix; cp.async double buffering), for sm_80
// and newer. Launchers and the layout: src/model/attention.rs.
//
// Layout: qkv [T, 3d] bf16 (T = B * S rows, token t = b * S + s; row t holds q of heads
// 0..H (D each), then k, then v; d = H * D); o, d_o [T, d]; lse, delta [B, H, S] f32.
// Scores are handled in log2 units: x = (q . k) * scale * log2(e), so exp(scale q.k - lse) =
// exp2(x - lse * log2(e)); lse is stored as a natural log.
//
// Every kernel: a block of W warps owns R = W * 16 * MT rows (queries, or keys for dk/dv),
// each warp 16 * MT of them (MT m16 tiles, which share every B fragment a warp loads: at MT =
// 2 a warp reads half the shared memory per product), grid (B * H, ceil(S / R)). The other
// side's tiles (N rows) are double-buffered in shared memory with rows padded to D + 8
// elements (so the 8 rows an ldmatrix reads fall in distinct banks); rows past S are
// zero-filled by cp.async and never stored. Only tiles that meet the causal diagonal (or the
// end of the sequence) are masked; tiles wholly above it are skipped, per block and per warp.
// The configurations (Cfg below) are mirrored by src/model/attention.rs.
//
// * attention_forward_d{D}: per R queries, walks the key tiles 0..diagonal in order with an
//   online softmax (running max and sum in f32), P rounded to bf16 for P V, o = acc / sum
//   rounded once, lse = max + log(sum).
// * attention_backward_dq_d{D}: per R queries: delta = rowsum(d_o * o) (f32, into the
//   workspace and shared memory), then over the key tiles in order: S = Q K^T, P = exp2(x -
//   lse) (recomputed from the saved lse), dP = dO V^T, dS = P (dP - delta), dQ += dS K.
// * attention_backward_dkdv_d{D}: per R keys, over the query tiles from the diagonal to the
//   end in order: S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T, dS^T, dK += dS^T Q.
// No atomics: each output element is owned by one thread, and its sums run in a fixed order,
// so results are bit-identical run to run. The dk/dv kernel reads the delta the dq kernel
// wrote (the launch before it; its PDL wait orders them).
#include <cuda_bf16.h>
#include <stdint.h>
#include <cuda_graph/pdl.cuh>

namespace {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

typedef __nv_bfloat16 bf16;

// One kernel's tiling: W warps of 16 * MT rows each (R rows a block), the other side in
// tiles of N rows.
template <int W_, int MT_, int N_> struct Cfg {
    static constexpr int W = W_, MT = MT_, N = N_;
    static constexpr int THREADS = 32 * W, R = 16 * MT * W;
};
// Per head dimension, as measured on the H200 at 16 x 256 x 8 x 64 and 4 x 1024 x 8 x 64
// (mean of 50 back-to-back calls): two m-tiles a warp took the forward from 15.2 / 47.2 us
// to 13.3 / 41.9 (12.0 / 35.8 with exp2_ftz and the scale folded into it). The backward
// kernels are latency-bound: at two m-tiles, whose accumulators leave registers only for
// tiles of 16 or 32, their many short iterations took 51 / 162 us against 37 / 96 with one
// m-tile and tiles of 64; forcing the dq kernel to 4 blocks an SM (128 registers, a 24-byte
// spill) cost 36.6 / 97.6 against 34.7 / 79.4 at its own 136 registers. At D = 128 the
// backward tiles are 32 and 16, for the registers and sm_89's 99 KiB of shared memory.
// src/model/attention.rs mirrors these.
template <int D> struct Tiles {
    typedef Cfg<4, 2, 64> Fwd;
    typedef Cfg<4, 1, 64> Dq;
    typedef Cfg<4, 1, 64> Dkdv;
};
template <> struct Tiles<128> {
    typedef Cfg<4, 1, 64> Fwd;
    typedef Cfg<4, 1, 32> Dq;
    typedef Cfg<4, 1, 16> Dkdv;
};

// Padded row length of a shared tile of head dimension D.
template <int D> __host__ __device__ constexpr int pad() { return D + 8; }

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, or 16 zero bytes when !valid (src must still be a mapped
// address; the callers clamp it into the tensor).
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async4(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(valid ? 4 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Rows x D of a row-major global tensor (row stride `ld` elements) into a padded shared
// tile by the block's THREADS threads; rows >= valid are zero-filled (valid >= 1).
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(bf16 *sm, const bf16 *g, size_t ld, int valid) {
    constexpr int CPR = D / 8; // 16-byte chunks per row
#pragma unroll
    for (int c = threadIdx.x; c < ROWS * CPR; c += THREADS) {
        const int r = c / CPR, cc = c % CPR;
        const bool ok = r < valid;
        cp_async16(sm + r * pad<D>() + cc * 8, g + (size_t)(ok ? r : 0) * ld + cc * 8, ok);
    }
}

// `n` floats into shared memory, zero from `valid` on (valid >= 1).
template <int THREADS>
__device__ __forceinline__ void load_floats(float *sm, const float *g, int n, int valid) {
    for (int i = threadIdx.x; i < n; i += THREADS) cp_async4(sm + i, g + (i < valid ? i : 0), i < valid);
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const bf16 *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16 *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// c += a b: m16n8k16, bf16 operands, f32 accumulators.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x with no special handling of subnormal results (one MUFU.EX2; exp2f adds a range check
// and two multiplies): probabilities below 2^-126 are 0 either way after rounding to bf16.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

// The A fragment (16 x 16) of rows row0.., columns kk * 16.. of a padded [rows][D] tile.
template <int D>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16 *t, int row0, int kk) {
    const int l = threadIdx.x & 31;
    ldmatrix_x4(a, t + (row0 + (l & 15)) * pad<D>() + kk * 16 + (l >> 4) * 8);
}

// B fragments of n-tiles n0 and n0 + 8 for k-chunk kk, from a padded tile stored [n][k]
// (the product's B is the tile transposed: K for Q K^T): b[0], b[1] for n0; b[2], b[3] for
// n0 + 8.
template <int D>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const bf16 *t, int n0, int kk) {
    const int l = threadIdx.x & 31;
    ldmatrix_x4(b, t + (n0 + (l & 7) + ((l >> 4) << 3)) * pad<D>() + kk * 16 + ((l >> 3) & 1) * 8);
}

// The same from a padded tile stored [k][n] (V for P V): columns n0.. n0 + 15 of rows kk *
// 16 .. + 15.
template <int D>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const bf16 *t, int kk, int n0) {
    const int l = threadIdx.x & 31;
    ldmatrix_x4_trans(b, t + (kk * 16 + (l & 15)) * pad<D>() + n0 + (l >> 4) * 8);
}

// acc[MT][N / 8][4] = A B^T over D: A the warp's 16 * MT rows (from row0) of tile `a`
// [.][D], B the N rows of tile `b` [N][D] (scores: Q K^T, dO V^T, K Q^T, V dO^T).
template <int D, int N, int MT>
__device__ __forceinline__ void rows_times_rows(float (&acc)[MT][N / 8][4], const bf16 *a,
                                                int row0, const bf16 *b) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][j][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t af[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) load_a<D>(af[m], a, row0 + 16 * m, kk);
#pragma unroll
        for (int j = 0; j < N / 8; j += 2) {
            uint32_t bf[4];
            load_b_nk<D>(bf, b, j * 8, kk);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                mma(acc[m][j], af[m], bf[0], bf[1]);
                mma(acc[m][j + 1], af[m], bf[2], bf[3]);
            }
        }
    }
}

// out[MT][D / 8][4] += P B: P the warp's 16 * MT x N probabilities (or dS) as accumulator
// fragments p[MT][N / 8][4] (rounded to bf16 here), B the tile `b` [N][D] (V, dO, Q or K).
template <int D, int N, int MT>
__device__ __forceinline__ void probs_times_tile(float (&out)[MT][D / 8][4],
                                                 const float (&p)[MT][N / 8][4],
                                                 const bf16 *b) {
#pragma unroll
    for (int kc = 0; kc < N / 16; ++kc) {
        uint32_t af[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            af[m][0] = pack_bf16(p[m][2 * kc][0], p[m][2 * kc][1]);
            af[m][1] = pack_bf16(p[m][2 * kc][2], p[m][2 * kc][3]);
            af[m][2] = pack_bf16(p[m][2 * kc + 1][0], p[m][2 * kc + 1][1]);
            af[m][3] = pack_bf16(p[m][2 * kc + 1][2], p[m][2 * kc + 1][3]);
        }
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            uint32_t bf[4];
            load_b_kn<D>(bf, b, kc, n * 8);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                mma(out[m][n], af[m], bf[0], bf[1]);
                mma(out[m][n + 1], af[m], bf[2], bf[3]);
            }
        }
    }
}

template <int D, int MT>
__device__ __forceinline__ void zero(float (&acc)[MT][D / 8][4]) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;
}

// Stores the warp's 16 * MT x D accumulator rows (row0 + 16 m + g, + 8 of the block) times
// `mul` as bf16 to dst (row stride ld), rows >= valid skipped.
template <int D, int MT>
__device__ __forceinline__ void store_rows(bf16 *dst, size_t ld,
                                           const float (&acc)[MT][D / 8][4], int row0,
                                           int valid, float mul) {
    const int l = threadIdx.x & 31, g = l >> 2, tq = l & 3;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + 16 * m + g + 8 * r;
            if (row >= valid) continue;
            bf16 *p = dst + (size_t)row * ld + 2 * tq;
#pragma unroll
            for (int n = 0; n < D / 8; ++n)
                *reinterpret_cast<__nv_bfloat162 *>(p + n * 8) =
                    __floats2bfloat162_rn(acc[m][n][2 * r] * mul, acc[m][n][2 * r + 1] * mul);
        }
}

// ---------------------------------------------------------------------------------------
// Forward. Dynamic shared memory: Q [R][D + 8], K [2][N][D + 8], V [2][N][D + 8] bf16.
template <int D>
__device__ __forceinline__ void forward_tc(const bf16 *qkv, bf16 *o, float *lse, unsigned seq,
                                           unsigned heads, float scale_log2) {
    typedef typename Tiles<D>::Fwd C;
    constexpr int BQ = C::R, BK = C::N, MT = C::MT, NT = C::THREADS, SD = pad<D>();
    extern __shared__ __align__(16) unsigned char smem[];
    bf16 *sq = reinterpret_cast<bf16 *>(smem);
    bf16 *sk = sq + BQ * SD;      // [2][BK][SD]
    bf16 *sv = sk + 2 * BK * SD;  // [2][BK][SD]
    const int warp = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, tq = l & 3;
    const unsigned bh = blockIdx.x, b = bh / heads, h = bh % heads;
    // Heaviest (last) query tiles first.
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BQ;
    const int nq = min(BQ, (int)seq - q0);
    const size_t d = (size_t)heads * D, w3 = 3 * d;
    const bf16 *base = qkv + (size_t)b * seq * w3 + (size_t)h * D;
    const int nkb = (q0 + nq - 1) / BK + 1;
    const int row0 = warp * 16 * MT;
    // The warp's last query: key tiles past it are all masked for the warp.
    const int last = q0 + row0 + 16 * MT - 1;

    load_tile<D, BQ, NT>(sq, base + (size_t)q0 * w3, w3, nq);
    load_tile<D, BK, NT>(sk, base + d, w3, min(BK, (int)seq));
    load_tile<D, BK, NT>(sv, base + 2 * d, w3, min(BK, (int)seq));
    cp_async_commit();

    float acc[MT][D / 8][4];
    zero<D, MT>(acc);
    float m[MT][2], sum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) m[mt][r] = -INFINITY, sum[mt][r] = 0.0f;

    for (int kb = 0; kb < nkb; ++kb) {
        const int k0 = kb * BK;
        if (kb + 1 < nkb) {
            const int st = (kb + 1) & 1, k1 = k0 + BK, nk = min(BK, (int)seq - k1);
            load_tile<D, BK, NT>(sk + st * BK * SD, base + (size_t)k1 * w3 + d, w3, nk);
            load_tile<D, BK, NT>(sv + st * BK * SD, base + (size_t)k1 * w3 + 2 * d, w3, nk);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        // Tile 0 is never skipped, so every row's max is finite from the first tile on (key
        // 0 is unmasked for every query), and a later tile whose keys are all masked for a
        // row leaves it unchanged.
        if (k0 <= last) {
            const bf16 *tk = sk + (kb & 1) * BK * SD, *tv = sv + (kb & 1) * BK * SD;
            float x[MT][BK / 8][4];
            rows_times_rows<D, BK, MT>(x, sq, row0, tk);
            // Keys past the diagonal (which includes every key past S: those are beyond every
            // query) are masked; only tiles reaching past the warp's first query hold them.
            if (k0 + BK - 1 > q0 + row0) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int j = 0; j < BK / 8; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int key = k0 + j * 8 + 2 * tq + (e & 1);
                            const int query = q0 + row0 + 16 * mt + g + 8 * (e >> 1);
                            if (key > query) x[mt][j][e] = -INFINITY;
                        }
            }
            // Online softmax per row (r = 0: row g, r = 1: row g + 8 of each m-tile; a row's
            // 4 lanes agree on the max). The max is taken over the unscaled scores (scale >
            // 0) and the scale folded into exp2's argument.
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    float mx = -INFINITY;
#pragma unroll
                    for (int j = 0; j < BK / 8; ++j)
                        mx = fmaxf(mx, fmaxf(x[mt][j][2 * r], x[mt][j][2 * r + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float mn = fmaxf(m[mt][r], mx * scale_log2);
                    const float alpha = exp2_ftz(m[mt][r] - mn);
                    m[mt][r] = mn;
                    float s = 0.0f;
#pragma unroll
                    for (int j = 0; j < BK / 8; ++j) {
                        x[mt][j][2 * r] = exp2_ftz(fmaf(x[mt][j][2 * r], scale_log2, -mn));
                        x[mt][j][2 * r + 1] =
                            exp2_ftz(fmaf(x[mt][j][2 * r + 1], scale_log2, -mn));
                        s += x[mt][j][2 * r] + x[mt][j][2 * r + 1];
                    }
                    sum[mt][r] = sum[mt][r] * alpha + s;
#pragma unroll
                    for (int n = 0; n < D / 8; ++n) {
                        acc[mt][n][2 * r] *= alpha;
                        acc[mt][n][2 * r + 1] *= alpha;
                    }
                }
            probs_times_tile<D, BK, MT>(acc, x, tv);
        }
        __syncthreads(); // the next iteration's prefetch overwrites this stage
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float s = sum[mt][r];
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            s += __shfl_xor_sync(0xffffffffu, s, 2);
            const float inv = 1.0f / s;
            const int row = row0 + 16 * mt + g + 8 * r;
            if (tq == 0 && row < nq)
                lse[(size_t)bh * seq + q0 + row] = (m[mt][r] + log2f(s)) * LN2;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                acc[mt][n][2 * r] *= inv;
                acc[mt][n][2 * r + 1] *= inv;
            }
        }
    store_rows<D, MT>(o + ((size_t)b * seq + q0) * d + (size_t)h * D, d, acc, row0, nq, 1.0f);
}

// ---------------------------------------------------------------------------------------
// dq (and delta). Dynamic shared memory: Q, dO [R][D + 8]; K, V [2][N][D + 8] bf16; then
// lse and delta [R] f32 each.
template <int D>
__device__ __forceinline__ void backward_dq_tc(const bf16 *qkv, const bf16 *o,
                                               const float *lse, const bf16 *d_o, bf16 *dqkv,
                                               float *delta, unsigned seq, unsigned heads,
                                               float scale, float scale_log2) {
    typedef typename Tiles<D>::Dq C;
    constexpr int BQ = C::R, BK = C::N, MT = C::MT, NT = C::THREADS, SD = pad<D>();
    extern __shared__ __align__(16) unsigned char smem[];
    bf16 *sq = reinterpret_cast<bf16 *>(smem);
    bf16 *sdo = sq + BQ * SD;
    bf16 *sk = sdo + BQ * SD;    // [2][BK][SD]
    bf16 *sv = sk + 2 * BK * SD; // [2][BK][SD]
    float *sl = reinterpret_cast<float *>(sv + 2 * BK * SD); // [BQ]
    float *sdl = sl + BQ;                                    // [BQ]
    const int warp = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, tq = l & 3;
    const unsigned bh = blockIdx.x, b = bh / heads, h = bh % heads;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BQ;
    const int nq = min(BQ, (int)seq - q0);
    const size_t d = (size_t)heads * D, w3 = 3 * d;
    const bf16 *base = qkv + (size_t)b * seq * w3 + (size_t)h * D;
    const size_t orow = ((size_t)b * seq + q0) * d + (size_t)h * D; // o / d_o of query q0
    const int nkb = (q0 + nq - 1) / BK + 1;
    const int row0 = warp * 16 * MT;
    const int last = q0 + row0 + 16 * MT - 1;

    load_tile<D, BQ, NT>(sq, base + (size_t)q0 * w3, w3, nq);
    load_tile<D, BQ, NT>(sdo, d_o + orow, d, nq);
    load_tile<D, BK, NT>(sk, base + d, w3, min(BK, (int)seq));
    load_tile<D, BK, NT>(sv, base + 2 * d, w3, min(BK, (int)seq));
    load_floats<NT>(sl, lse + (size_t)bh * seq + q0, BQ, nq);
    cp_async_commit();

    // delta = rowsum(d_o * o) of the block's queries while the tiles load: TPR threads a
    // row, D / TPR columns each in order, then their sums (xor shuffles).
    {
        constexpr int TPR = NT / BQ;
        static_assert(TPR * BQ == NT && (TPR == 1 || TPR == 2), "threads per query");
        const int row = threadIdx.x / TPR, part = threadIdx.x % TPR;
        float s = 0.0f;
        if (row < nq) {
            const bf16 *po = o + orow + (size_t)row * d + part * (D / TPR);
            const bf16 *pg = d_o + orow + (size_t)row * d + part * (D / TPR);
#pragma unroll
            for (int c = 0; c < D / TPR; c += 8) {
                const uint4 vo = *reinterpret_cast<const uint4 *>(po + c);
                const uint4 vg = *reinterpret_cast<const uint4 *>(pg + c);
                const __nv_bfloat162 *a = reinterpret_cast<const __nv_bfloat162 *>(&vo);
                const __nv_bfloat162 *bb = reinterpret_cast<const __nv_bfloat162 *>(&vg);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float2 fa = __bfloat1622float2(a[i]), fb = __bfloat1622float2(bb[i]);
                    s = fmaf(fa.x, fb.x, s);
                    s = fmaf(fa.y, fb.y, s);
                }
            }
        }
        if (TPR == 2) s += __shfl_xor_sync(0xffffffffu, s, 1);
        if (part == 0) {
            sdl[row] = s;
            if (row < nq) delta[(size_t)bh * seq + q0 + row] = s;
        }
    }

    float acc[MT][D / 8][4];
    zero<D, MT>(acc);
    float l2[MT][2], dl[MT][2];

    for (int kb = 0; kb < nkb; ++kb) {
        const int k0 = kb * BK;
        if (kb + 1 < nkb) {
            const int st = (kb + 1) & 1, k1 = k0 + BK, nk = min(BK, (int)seq - k1);
            load_tile<D, BK, NT>(sk + st * BK * SD, base + (size_t)k1 * w3 + d, w3, nk);
            load_tile<D, BK, NT>(sv + st * BK * SD, base + (size_t)k1 * w3 + 2 * d, w3, nk);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        if (kb == 0) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    l2[mt][r] = sl[row0 + 16 * mt + g + 8 * r] * LOG2E;
                    dl[mt][r] = sdl[row0 + 16 * mt + g + 8 * r];
                }
        }
        if (k0 <= last) {
            const bf16 *tk = sk + (kb & 1) * BK * SD, *tv = sv + (kb & 1) * BK * SD;
            float x[MT][BK / 8][4], dp[MT][BK / 8][4];
            rows_times_rows<D, BK, MT>(x, sq, row0, tk);
            rows_times_rows<D, BK, MT>(dp, sdo, row0, tv);
            const bool diag = k0 + BK - 1 > q0 + row0;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < BK / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = e >> 1;
                        const float p = exp2_ftz(fmaf(x[mt][j][e], scale_log2, -l2[mt][r]));
                        float ds = p * (dp[mt][j][e] - dl[mt][r]);
                        if (diag) {
                            const int key = k0 + j * 8 + 2 * tq + (e & 1);
                            const int query = q0 + row0 + 16 * mt + g + 8 * r;
                            if (key > query) ds = 0.0f;
                        }
                        x[mt][j][e] = ds;
                    }
            probs_times_tile<D, BK, MT>(acc, x, tk);
        }
        __syncthreads();
    }
    store_rows<D, MT>(dqkv + ((size_t)b * seq + q0) * w3 + (size_t)h * D, w3, acc, row0, nq,
                      scale);
}

// ---------------------------------------------------------------------------------------
// dk, dv. Dynamic shared memory: K, V [R][D + 8]; Q, dO [2][N][D + 8] bf16; then lse and
// delta [2][N] f32 each.
template <int D>
__device__ __forceinline__ void backward_dkdv_tc(const bf16 *qkv, const float *lse,
                                                 const bf16 *d_o, bf16 *dqkv,
                                                 const float *delta, unsigned seq,
                                                 unsigned heads, float scale,
                                                 float scale_log2) {
    typedef typename Tiles<D>::Dkdv C;
    constexpr int BK = C::R, BQ = C::N, MT = C::MT, NT = C::THREADS, SD = pad<D>();
    extern __shared__ __align__(16) unsigned char smem[];
    bf16 *sk = reinterpret_cast<bf16 *>(smem);
    bf16 *sv = sk + BK * SD;
    bf16 *sq = sv + BK * SD;      // [2][BQ][SD]
    bf16 *sdo = sq + 2 * BQ * SD; // [2][BQ][SD]
    float *sl = reinterpret_cast<float *>(sdo + 2 * BQ * SD); // [2][BQ]
    float *sdl = sl + 2 * BQ;                                 // [2][BQ]
    const int warp = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, tq = l & 3;
    const unsigned bh = blockIdx.x, b = bh / heads, h = bh % heads;
    const int k0 = blockIdx.y * BK; // heaviest (first) key tiles first
    const int nk = min(BK, (int)seq - k0);
    const size_t d = (size_t)heads * D, w3 = 3 * d;
    const bf16 *base = qkv + (size_t)b * seq * w3 + (size_t)h * D;
    const bf16 *gbase = d_o + (size_t)b * seq * d + (size_t)h * D;
    const float *lrow = lse + (size_t)bh * seq, *drow = delta + (size_t)bh * seq;
    const int qb0 = k0 / BQ, nqb = ((int)seq + BQ - 1) / BQ;
    const int row0 = warp * 16 * MT;
    // The warp's first key: query tiles ending before it are all masked for the warp.
    const int first = k0 + row0;

    auto load_queries = [&](int qb, int st) {
        const int q0 = qb * BQ, nq = min(BQ, (int)seq - q0);
        load_tile<D, BQ, NT>(sq + st * BQ * SD, base + (size_t)q0 * w3, w3, nq);
        load_tile<D, BQ, NT>(sdo + st * BQ * SD, gbase + (size_t)q0 * d, d, nq);
        load_floats<NT>(sl + st * BQ, lrow + q0, BQ, nq);
        load_floats<NT>(sdl + st * BQ, drow + q0, BQ, nq);
    };
    load_tile<D, BK, NT>(sk, base + (size_t)k0 * w3 + d, w3, nk);
    load_tile<D, BK, NT>(sv, base + (size_t)k0 * w3 + 2 * d, w3, nk);
    load_queries(qb0, 0);
    cp_async_commit();

    float dk[MT][D / 8][4], dv[MT][D / 8][4];
    zero<D, MT>(dk);
    zero<D, MT>(dv);

    for (int qb = qb0; qb < nqb; ++qb) {
        const int q0 = qb * BQ, it = qb - qb0;
        if (qb + 1 < nqb) load_queries(qb + 1, (it + 1) & 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        if (q0 + BQ - 1 >= first) {
            const int st = it & 1;
            const bf16 *tq_ = sq + st * BQ * SD, *tdo = sdo + st * BQ * SD;
            const float *tl = sl + st * BQ, *tdl = sdl + st * BQ;
            float x[MT][BQ / 8][4], dp[MT][BQ / 8][4];
            rows_times_rows<D, BQ, MT>(x, sk, row0, tq_);  // S^T: keys x queries
            rows_times_rows<D, BQ, MT>(dp, sv, row0, tdo); // dP^T
            // Queries before a key (tiles meeting the diagonal) and past S (the last tile)
            // drop out.
            const bool edge = q0 < first + 16 * MT - 1 || q0 + BQ > (int)seq;
#pragma unroll
            for (int j = 0; j < BQ / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int qc = j * 8 + 2 * tq + (e & 1);
                    const float lq = tl[qc] * LOG2E, dq = tdl[qc];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        float p = exp2_ftz(fmaf(x[mt][j][e], scale_log2, -lq));
                        if (edge) {
                            const int key = first + 16 * mt + g + 8 * (e >> 1), query = q0 + qc;
                            if (query < key || query >= (int)seq) p = 0.0f;
                        }
                        x[mt][j][e] = p;
                        dp[mt][j][e] = p * (dp[mt][j][e] - dq);
                    }
                }
            probs_times_tile<D, BQ, MT>(dv, x, tdo);
            probs_times_tile<D, BQ, MT>(dk, dp, tq_);
        }
        __syncthreads();
    }
    bf16 *out = dqkv + ((size_t)b * seq + k0) * w3 + (size_t)h * D;
    store_rows<D, MT>(out + d, w3, dk, row0, nk, scale);
    store_rows<D, MT>(out + 2 * d, w3, dv, row0, nk, 1.0f);
}

} // namespace

#define ATT_KERNELS(D)                                                                         \
    extern "C" __global__ void __launch_bounds__(Tiles<D>::Fwd::THREADS)                       \
        attention_forward_d##D(const bf16 *qkv, bf16 *o, float *lse, unsigned seq,             \
                               unsigned heads, float scale_log2) {                             \
        cuda_graph::pdl_enter();                                                               \
        forward_tc<D>(qkv, o, lse, seq, heads, scale_log2);                                    \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(Tiles<D>::Dq::THREADS)                        \
        attention_backward_dq_d##D(const bf16 *qkv, const bf16 *o, const float *lse,           \
                                   const bf16 *d_o, bf16 *dqkv, float *delta, unsigned seq,    \
                                   unsigned heads, float scale, float scale_log2) {            \
        cuda_graph::pdl_enter();                                                               \
        backward_dq_tc<D>(qkv, o, lse, d_o, dqkv, delta, seq, heads, scale, scale_log2);       \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(Tiles<D>::Dkdv::THREADS)                      \
        attention_backward_dkdv_d##D(const bf16 *qkv, const float *lse, const bf16 *d_o,       \
                                     bf16 *dqkv, const float *delta, unsigned seq,             \
                                     unsigned heads, float scale, float scale_log2) {          \
        cuda_graph::pdl_enter();                                                               \
        backward_dkdv_tc<D>(qkv, lse, d_o, dqkv, delta, seq, heads, scale, scale_log2);        \
    }

ATT_KERNELS(32)
ATT_KERNELS(64)
ATT_KERNELS(128)
