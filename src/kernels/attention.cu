// Causal multi-head self-attention and its backward, flash-attention-2 style on bf16 tensor
// cores (mma.sync m16n8k16, f32 accumulate; ldmatrix; cp.async double buffering), for sm_80
// and newer. Launchers and the layout: src/model/attention.rs.
//
// Layout: qkv [T, 3d] bf16 (T = B * S rows, token t = b * S + s; row t holds q of heads
// 0..H (D each), then k, then v; d = H * D); o, d_o [T, d]; lse, delta [B, H, S] f32.
// Scores are handled in log2 units: x = (q . k) * scale * log2(e), so exp(scale q.k - lse) =
// exp2(x - lse * log2(e)); lse is stored as a natural log.
//
// Every kernel: 4 warps (ATT_BLOCK threads), each owning 16 rows of the block's 64 rows
// (queries, or keys for dk/dv), grid (B * H, ceil(S / 64)). Tiles live in shared memory with
// rows padded to D + 8 elements (so the 8 rows an ldmatrix reads fall in distinct banks);
// rows past S are zero-filled by cp.async and never stored. Only tiles that meet the causal
// diagonal (or the end of the sequence) are masked; tiles wholly above it are skipped.
//
// * attention_forward_d{D}: per 64 queries, walks the key tiles 0..diagonal in order with an
//   online softmax (running max and sum in f32), P rounded to bf16 for P V, o = acc / sum
//   rounded once, lse = max + log(sum).
// * attention_backward_dq_d{D}: per 64 queries: delta = rowsum(d_o * o) (f32, into the
//   workspace and shared memory), then over the key tiles in order: S = Q K^T, P = exp2(x -
//   lse) (recomputed from the saved lse), dP = dO V^T, dS = P (dP - delta), dQ += dS K.
// * attention_backward_dkdv_d{D}: per 64 keys, over the query tiles from the diagonal to the
//   end in order: S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T, dS^T, dK += dS^T Q.
// No atomics: each output element is owned by one thread, and its sums run in a fixed order,
// so results are bit-identical run to run. The dk/dv kernel reads the delta the dq kernel
// wrote (the launch before it; its PDL wait orders them).
#include <cuda_bf16.h>
#include <stdint.h>
#include <cuda_graph/pdl.cuh>

#define ATT_WARPS 4
#define ATT_BLOCK (ATT_WARPS * 32)
// Rows (queries or keys) per block: 16 per warp.
#define ATT_ROWS 64

namespace {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

typedef __nv_bfloat16 bf16;

// Padded row length of a shared tile of head dimension D.
template <int D> __host__ __device__ constexpr int pad() { return D + 8; }

// Key tile of the dq kernel and query tile of the dk/dv kernel: 32 at D = 128 keeps their
// shared memory (2 * 64 + 4 * tile rows of D + 8 bf16, plus 2 * 64 or 4 * tile floats)
// within sm_89's 99 KiB. src/model/attention.rs computes the same sizes.
template <int D> __host__ __device__ constexpr int back_tile() { return D == 128 ? 32 : 64; }

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

// Rows `rows` x D of a row-major global tensor (row stride `ld` elements) into a padded
// shared tile; rows >= valid are zero-filled (valid >= 1).
template <int D, int R>
__device__ __forceinline__ void load_tile(bf16 *sm, const bf16 *g, size_t ld, int valid) {
    constexpr int CPR = D / 8; // 16-byte chunks per row
#pragma unroll
    for (int c = threadIdx.x; c < R * CPR; c += ATT_BLOCK) {
        const int r = c / CPR, cc = c % CPR;
        const bool ok = r < valid;
        cp_async16(sm + r * pad<D>() + cc * 8, g + (size_t)(ok ? r : 0) * ld + cc * 8, ok);
    }
}

// `n` floats (n <= ATT_BLOCK) into shared memory, zero past `valid` (valid >= 1).
__device__ __forceinline__ void load_floats(float *sm, const float *g, int n, int valid) {
    const int i = threadIdx.x;
    if (i < n) cp_async4(sm + i, g + (i < valid ? i : 0), i < valid);
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

// acc[N / 8][4] = A B^T over D: A the warp's 16 rows (from row0) of tile `a` [.][D], B the
// N rows of tile `b` [N][D] (scores: Q K^T, dO V^T, K Q^T, V dO^T).
template <int D, int N>
__device__ __forceinline__ void rows_times_rows(float (&acc)[N / 8][4], const bf16 *a,
                                                int row0, const bf16 *b) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t af[4];
        load_a<D>(af, a, row0, kk);
#pragma unroll
        for (int j = 0; j < N / 8; j += 2) {
            uint32_t bf[4];
            load_b_nk<D>(bf, b, j * 8, kk);
            mma(acc[j], af, bf[0], bf[1]);
            mma(acc[j + 1], af, bf[2], bf[3]);
        }
    }
}

// out[D / 8][4] += P B: P the warp's 16 x N probabilities (or dS) as accumulator fragments
// p[N / 8][4] (rounded to bf16 here), B the tile `b` [N][D] (V, dO, Q or K).
template <int D, int N>
__device__ __forceinline__ void probs_times_tile(float (&out)[D / 8][4],
                                                 const float (&p)[N / 8][4], const bf16 *b) {
#pragma unroll
    for (int kc = 0; kc < N / 16; ++kc) {
        uint32_t af[4];
        af[0] = pack_bf16(p[2 * kc][0], p[2 * kc][1]);
        af[1] = pack_bf16(p[2 * kc][2], p[2 * kc][3]);
        af[2] = pack_bf16(p[2 * kc + 1][0], p[2 * kc + 1][1]);
        af[3] = pack_bf16(p[2 * kc + 1][2], p[2 * kc + 1][3]);
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            uint32_t bf[4];
            load_b_kn<D>(bf, b, kc, n * 8);
            mma(out[n], af, bf[0], bf[1]);
            mma(out[n + 1], af, bf[2], bf[3]);
        }
    }
}

// Stores the warp's 16 x D accumulator rows (row0 + g, row0 + g + 8 of the block) times
// `mul` as bf16 to dst (row stride ld), rows >= valid skipped.
template <int D>
__device__ __forceinline__ void store_rows(bf16 *dst, size_t ld, const float (&acc)[D / 8][4],
                                           int row0, int valid, float mul) {
    const int l = threadIdx.x & 31, g = l >> 2, tq = l & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + g + 8 * r;
        if (row >= valid) continue;
        bf16 *p = dst + (size_t)row * ld + 2 * tq;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<__nv_bfloat162 *>(p + n * 8) =
                __floats2bfloat162_rn(acc[n][2 * r] * mul, acc[n][2 * r + 1] * mul);
    }
}

// ---------------------------------------------------------------------------------------
// Forward. Dynamic shared memory: Q [64][D + 8], K [2][64][D + 8], V [2][64][D + 8] bf16.
template <int D>
__device__ __forceinline__ void forward_tc(const bf16 *qkv, bf16 *o, float *lse, unsigned seq,
                                           unsigned heads, float scale_log2) {
    constexpr int BQ = ATT_ROWS, BK = ATT_ROWS, SD = pad<D>();
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

    load_tile<D, BQ>(sq, base + (size_t)q0 * w3, w3, nq);
    load_tile<D, BK>(sk, base + d, w3, min(BK, (int)seq));
    load_tile<D, BK>(sv, base + 2 * d, w3, min(BK, (int)seq));
    cp_async_commit();

    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, sum[2] = {0.0f, 0.0f};
    const int row0 = warp * 16;

    for (int kb = 0; kb < nkb; ++kb) {
        const int k0 = kb * BK;
        if (kb + 1 < nkb) {
            const int st = (kb + 1) & 1, k1 = k0 + BK, nk = min(BK, (int)seq - k1);
            load_tile<D, BK>(sk + st * BK * SD, base + (size_t)k1 * w3 + d, w3, nk);
            load_tile<D, BK>(sv + st * BK * SD, base + (size_t)k1 * w3 + 2 * d, w3, nk);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const bf16 *tk = sk + (kb & 1) * BK * SD, *tv = sv + (kb & 1) * BK * SD;

        float x[BK / 8][4];
        rows_times_rows<D, BK>(x, sq, row0, tk);
        // Keys past the diagonal (which includes every key past S: those are beyond every
        // query) are masked; only the last tile can hold them.
        const bool diag = k0 + BK - 1 > q0;
#pragma unroll
        for (int j = 0; j < BK / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                x[j][e] *= scale_log2;
                if (diag) {
                    const int key = k0 + j * 8 + 2 * tq + (e & 1);
                    const int query = q0 + row0 + g + 8 * (e >> 1);
                    if (key > query) x[j][e] = -INFINITY;
                }
            }
        // Online softmax per row (r = 0: row g, r = 1: row g + 8; a row's 4 lanes agree on
        // the max). Every row has an unmasked key in every tile it visits (key k0 <= q0 <=
        // the query), so the max stays finite.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < BK / 8; ++j) mx = fmaxf(mx, fmaxf(x[j][2 * r], x[j][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m[r], mx);
            const float alpha = exp2f(m[r] - mn);
            m[r] = mn;
            float s = 0.0f;
#pragma unroll
            for (int j = 0; j < BK / 8; ++j) {
                x[j][2 * r] = exp2f(x[j][2 * r] - mn);
                x[j][2 * r + 1] = exp2f(x[j][2 * r + 1] - mn);
                s += x[j][2 * r] + x[j][2 * r + 1];
            }
            sum[r] = sum[r] * alpha + s;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                acc[n][2 * r] *= alpha;
                acc[n][2 * r + 1] *= alpha;
            }
        }
        probs_times_tile<D, BK>(acc, x, tv);
        __syncthreads(); // the next iteration's prefetch overwrites this stage
    }

    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
        sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
        inv[r] = 1.0f / sum[r];
        const int row = row0 + g + 8 * r;
        if (tq == 0 && row < nq) lse[(size_t)bh * seq + q0 + row] = (m[r] + log2f(sum[r])) * LN2;
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] *= inv[e >> 1];
    store_rows<D>(o + ((size_t)b * seq + q0) * d + (size_t)h * D, d, acc, row0, nq, 1.0f);
}

// ---------------------------------------------------------------------------------------
// dq (and delta). Dynamic shared memory: Q, dO [64][D + 8]; K, V [2][BK][D + 8] bf16; then
// lse * log2(e) and delta [64] f32 each.
template <int D>
__device__ __forceinline__ void backward_dq_tc(const bf16 *qkv, const bf16 *o,
                                               const float *lse, const bf16 *d_o, bf16 *dqkv,
                                               float *delta, unsigned seq, unsigned heads,
                                               float scale, float scale_log2) {
    constexpr int BQ = ATT_ROWS, BK = back_tile<D>(), SD = pad<D>();
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

    load_tile<D, BQ>(sq, base + (size_t)q0 * w3, w3, nq);
    load_tile<D, BQ>(sdo, d_o + orow, d, nq);
    load_tile<D, BK>(sk, base + d, w3, min(BK, (int)seq));
    load_tile<D, BK>(sv, base + 2 * d, w3, min(BK, (int)seq));
    load_floats(sl, lse + (size_t)bh * seq + q0, BQ, nq);
    cp_async_commit();

    // delta = rowsum(d_o * o) of the block's queries while the tiles load: two threads a
    // row, D / 2 columns each in order, then their two sums.
    {
        static_assert(ATT_BLOCK == 2 * BQ, "two threads per query");
        const int row = threadIdx.x >> 1, half = threadIdx.x & 1;
        float s = 0.0f;
        if (row < nq) {
            const bf16 *po = o + orow + (size_t)row * d + half * (D / 2);
            const bf16 *pg = d_o + orow + (size_t)row * d + half * (D / 2);
#pragma unroll
            for (int c = 0; c < D / 2; c += 8) {
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
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        if (half == 0) {
            sdl[row] = s;
            if (row < nq) delta[(size_t)bh * seq + q0 + row] = s;
        }
    }

    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
    const int row0 = warp * 16;
    float l2[2], dl[2];

    for (int kb = 0; kb < nkb; ++kb) {
        const int k0 = kb * BK;
        if (kb + 1 < nkb) {
            const int st = (kb + 1) & 1, k1 = k0 + BK, nk = min(BK, (int)seq - k1);
            load_tile<D, BK>(sk + st * BK * SD, base + (size_t)k1 * w3 + d, w3, nk);
            load_tile<D, BK>(sv + st * BK * SD, base + (size_t)k1 * w3 + 2 * d, w3, nk);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        if (kb == 0) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                l2[r] = sl[row0 + g + 8 * r] * LOG2E;
                dl[r] = sdl[row0 + g + 8 * r];
            }
        }
        const bf16 *tk = sk + (kb & 1) * BK * SD, *tv = sv + (kb & 1) * BK * SD;
        float x[BK / 8][4], dp[BK / 8][4];
        rows_times_rows<D, BK>(x, sq, row0, tk);
        rows_times_rows<D, BK>(dp, sdo, row0, tv);
        const bool diag = k0 + BK - 1 > q0;
#pragma unroll
        for (int j = 0; j < BK / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                const float p = exp2f(x[j][e] * scale_log2 - l2[r]);
                float ds = p * (dp[j][e] - dl[r]);
                if (diag) {
                    const int key = k0 + j * 8 + 2 * tq + (e & 1);
                    const int query = q0 + row0 + g + 8 * r;
                    if (key > query) ds = 0.0f;
                }
                x[j][e] = ds;
            }
        probs_times_tile<D, BK>(acc, x, tk);
        __syncthreads();
    }
    store_rows<D>(dqkv + ((size_t)b * seq + q0) * w3 + (size_t)h * D, w3, acc, row0, nq, scale);
}

// ---------------------------------------------------------------------------------------
// dk, dv. Dynamic shared memory: K, V [64][D + 8]; Q, dO [2][BQ][D + 8] bf16; then lse and
// delta [2][BQ] f32 each.
template <int D>
__device__ __forceinline__ void backward_dkdv_tc(const bf16 *qkv, const float *lse,
                                                 const bf16 *d_o, bf16 *dqkv,
                                                 const float *delta, unsigned seq,
                                                 unsigned heads, float scale,
                                                 float scale_log2) {
    constexpr int BK = ATT_ROWS, BQ = back_tile<D>(), SD = pad<D>();
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

    auto load_queries = [&](int qb, int st) {
        const int q0 = qb * BQ, nq = min(BQ, (int)seq - q0);
        load_tile<D, BQ>(sq + st * BQ * SD, base + (size_t)q0 * w3, w3, nq);
        load_tile<D, BQ>(sdo + st * BQ * SD, gbase + (size_t)q0 * d, d, nq);
        load_floats(sl + st * BQ, lrow + q0, BQ, nq);
        load_floats(sdl + st * BQ, drow + q0, BQ, nq);
    };
    load_tile<D, BK>(sk, base + (size_t)k0 * w3 + d, w3, nk);
    load_tile<D, BK>(sv, base + (size_t)k0 * w3 + 2 * d, w3, nk);
    load_queries(qb0, 0);
    cp_async_commit();

    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;
    const int row0 = warp * 16;

    for (int qb = qb0; qb < nqb; ++qb) {
        const int q0 = qb * BQ, it = qb - qb0;
        if (qb + 1 < nqb) load_queries(qb + 1, (it + 1) & 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const int st = it & 1;
        const bf16 *tq_ = sq + st * BQ * SD, *tdo = sdo + st * BQ * SD;
        const float *tl = sl + st * BQ, *tdl = sdl + st * BQ;

        float x[BQ / 8][4], dp[BQ / 8][4];
        rows_times_rows<D, BQ>(x, sk, row0, tq_);  // S^T: keys x queries
        rows_times_rows<D, BQ>(dp, sv, row0, tdo); // dP^T
        // Queries before the key (the diagonal tiles) and past S (the last tile) drop out.
        const bool edge = q0 < k0 + BK - 1 || q0 + BQ > (int)seq;
#pragma unroll
        for (int j = 0; j < BQ / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qc = j * 8 + 2 * tq + (e & 1);
                float p = exp2f(x[j][e] * scale_log2 - tl[qc] * LOG2E);
                if (edge) {
                    const int key = k0 + row0 + g + 8 * (e >> 1), query = q0 + qc;
                    if (query < key || query >= (int)seq) p = 0.0f;
                }
                x[j][e] = p;
                dp[j][e] = p * (dp[j][e] - tdl[qc]);
            }
        probs_times_tile<D, BQ>(dv, x, tdo);
        probs_times_tile<D, BQ>(dk, dp, tq_);
        __syncthreads();
    }
    bf16 *out = dqkv + ((size_t)b * seq + k0) * w3 + (size_t)h * D;
    store_rows<D>(out + d, w3, dk, row0, nk, scale);
    store_rows<D>(out + 2 * d, w3, dv, row0, nk, 1.0f);
}

} // namespace

#define ATT_KERNELS(D)                                                                         \
    extern "C" __global__ void __launch_bounds__(ATT_BLOCK)                                    \
        attention_forward_d##D(const bf16 *qkv, bf16 *o, float *lse, unsigned seq,             \
                               unsigned heads, float scale_log2) {                             \
        cuda_graph::pdl_enter();                                                               \
        forward_tc<D>(qkv, o, lse, seq, heads, scale_log2);                                    \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(ATT_BLOCK) attention_backward_dq_d##D(        \
        const bf16 *qkv, const bf16 *o, const float *lse, const bf16 *d_o, bf16 *dqkv,         \
        float *delta, unsigned seq, unsigned heads, float scale, float scale_log2) {           \
        cuda_graph::pdl_enter();                                                               \
        backward_dq_tc<D>(qkv, o, lse, d_o, dqkv, delta, seq, heads, scale, scale_log2);       \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(ATT_BLOCK) attention_backward_dkdv_d##D(      \
        const bf16 *qkv, const float *lse, const bf16 *d_o, bf16 *dqkv, const float *delta,    \
        unsigned seq, unsigned heads, float scale, float scale_log2) {                         \
        cuda_graph::pdl_enter();                                                               \
        backward_dkdv_tc<D>(qkv, lse, d_o, dqkv, delta, seq, heads, scale, scale_log2);        \
    }

ATT_KERNELS(32)
ATT_KERNELS(64)
ATT_KERNELS(128)
