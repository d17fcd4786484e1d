// Kernels of the dropless top-k MoE layer around its expert GEMMs (src/moe/routing.rs):
// router, top-k and gates, the dispatch plan into the packed expert-major layout, the
// auxiliary losses, the combine, and the backward of each.
//
// Deterministic: every floating-point sum has a fixed order (sequential loops, fixed shuffle
// trees, fixed shared-memory trees and sums over warps in warp order), the dispatch keeps
// token order, and the only atomics are integer counts in shared memory (their result does
// not depend on the order). No kernel synchronises with the host or reads the routing back:
// everything data-dependent stays on the device, so the kernels replay in CUDA graphs as the
// routing changes.
//
// Thread mapping of the [*, H] bf16 rows: a thread takes W consecutive columns h .. h + W - 1
// of each row it touches, W = 8 (one 16-byte load or store) when H % 8 == 0 and the row
// pointers are 16-byte aligned, else W = 1 (the scalar path: the same code instantiated with
// W = 1, for odd shapes such as H = 20). The 256 threads of a block cover 256 * W columns
// per pass, so at H = 2048 a thread holds one 16-byte piece of every row the block reads.
// Small T gets more blocks (fewer tokens per block), large T more tokens per block (the
// launcher picks them, routing.rs); each thread issues a batch of loads (8 or more, all of a
// pass where the registers allow) before it uses any, so several 16-byte loads per thread are
// in flight.
#include <cuda_bf16.h>
#include <cuda_graph/pdl.cuh>

#include "vec.cuh"
#include "warp.cuh"

#define MOE_BLOCK 256
#define MOE_WARPS (MOE_BLOCK / 32)
// The most tokens per block of the router forward and the input gradient (`MAX_WR_TOKENS` in
// routing.rs): the tokens that share each Wr load.
#define MOE_TOKENS 8
// The most (token, expert) rows per block of the combine and its backward (`ROW_SLOTS`), all
// of them loaded in one go, and the most tokens per such block (`MAX_ROW_TOKENS`).
#define MOE_SLOTS 8
#define MOE_ROW_TOKENS 4
// The most experts per token (`MAX_TOP_K`).
#define MOE_TOP_K 8
// The most experts (`MAX_EXPERTS`).
#define MOE_MAX_EXPERTS 512
// Threads of the plan scan's single block (`SCAN_BLOCK`).
#define MOE_SCAN_BLOCK 1024
// The single-block plan (moe_plan_small): at most this many passes of MOE_SCAN_BLOCK
// assignments (`SMALL_PLAN_ASSIGNMENTS`) and this many experts (`SMALL_PLAN_EXPERTS`).
#define MOE_SMALL_PASSES 4
#define MOE_SMALL_EXPERTS 256
// Experts per block of the router weight gradient (held in registers per thread).
#define MOE_WGRAD_EXPERTS 8
// Columns per block of the router weight gradient: 32 lanes x 8 (`WGRAD_COLS`).
#define MOE_WGRAD_COLS 256

namespace {

// The max m of a token's `experts` logits and z = sum_e exp(l_e - m), lanes striding over the
// experts, both reduced across the warp (every lane gets them): softmax_e = exp(l_e - m) / z,
// log-sum-exp = m + log z.
struct LogitStats {
    float m, z;
};
__device__ __forceinline__ LogitStats warp_logit_stats(const float *l, unsigned experts, unsigned lane) {
    float m = -INFINITY;
    for (unsigned e = lane; e < experts; e += 32) m = fmaxf(m, l[e]);
    m = warp_max(m);
    float z = 0.0f;
    for (unsigned e = lane; e < experts; e += 32) z += expf(l[e] - m);
    return LogitStats{m, warp_sum(z)};
}

// N (4 or 8) sums over the warp at once: every lane l ends with the warp's total of
// v[(l >> S) & (N - 1)], S = 5 - log2(N) (lanes l >> S the same hold the same total). First
// log2(N) halving exchanges (lanes l and l ^ o, o = 16, 8, ..., each keep half of the values
// and add the partner's copy of that half), then xor steps over the remaining lane bits:
// N - 1 + S shuffles instead of 5 N. The tree is fixed (lanes l, l ^ 16 first, then ^ 8, ^ 4,
// ^ 2, ^ 1) and each pair sum is the same whichever lane forms it, so the result is the same
// on every run.
template <int N> __device__ __forceinline__ float warp_sum_n(float (&v)[N]) {
    static_assert(N == 4 || N == 8, "4 or 8 sums");
    const unsigned lane = threadIdx.x & 31u;
#pragma unroll
    for (int n = N / 2, o = 16; n >= 1; n /= 2, o /= 2) { // n: values kept, o: partner distance
        const bool upper = (lane & (unsigned)o) != 0;
#pragma unroll
        for (int j = 0; j < n; ++j) {
            const float send = upper ? v[j] : v[j + n];
            const float keep = upper ? v[j + n] : v[j];
            v[j] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
    }
    float r = v[0];
#pragma unroll
    for (int o = 16 / N; o > 0; o /= 2) r += __shfl_xor_sync(0xffffffffu, r, o);
    return r;
}

// The larger of two (value, index) candidates: larger value, ties to the lower index; an
// index of -1 is "none" and loses to everything.
__device__ __forceinline__ void better(float &v, int &i, float v2, int i2) {
    if (i2 < 0) return;
    if (i < 0 || v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

__device__ __forceinline__ float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

// W consecutive bf16 as loaded (one 16-byte vector for W = 8, one element for W = 1), kept
// packed until used so that many loads fit in registers at once.
template <int W> struct Bf16s;
template <> struct Bf16s<8> {
    uint4 u;
    __device__ __forceinline__ void load(const __nv_bfloat16 *p) {
        u = __ldg(reinterpret_cast<const uint4 *>(p));
    }
    __device__ __forceinline__ void to_f32(float (&f)[8]) const { bf16x8_to_f32(u, f); }
};
template <> struct Bf16s<1> {
    __nv_bfloat16 b;
    __device__ __forceinline__ void load(const __nv_bfloat16 *p) { b = __ldg(p); }
    __device__ __forceinline__ void to_f32(float (&f)[1]) const { f[0] = __bfloat162float(b); }
};

template <int N> struct Const {
    static constexpr int value = N;
};

// The row kernels' compile-time layout: f(Const<KS>, Const<W>) with KS = k rounded up to a
// power of two (a block's (token i, expert j) row lives in register slot i * KS + j, so that
// every slot index is a constant and the slots stay in registers) and W = 8 when `vec`, else
// 1.
template <typename F> __device__ __forceinline__ void with_row_layout(unsigned k, bool vec, F f) {
    const auto w = [&](auto ks) {
        if (vec)
            f(ks, Const<8>{});
        else
            f(ks, Const<1>{});
    };
    if (k <= 1)
        w(Const<1>{});
    else if (k <= 2)
        w(Const<2>{});
    else if (k <= 4)
        w(Const<4>{});
    else
        w(Const<8>{});
}

// k rounded up to a power of two (the KS of with_row_layout).
__device__ __forceinline__ unsigned slots_per_token(unsigned k) {
    return k <= 1 ? 1u : k <= 2 ? 2u : k <= 4 ? 4u : 8u;
}

// A row block's register slots for KS: TT tokens (i) of KS slots each, slot q = i * KS + j
// holding expert j < k of token i; NS = TT * KS <= MOE_SLOTS slots in all.
template <int KS> struct RowSlots {
    static constexpr int TT = MOE_SLOTS / KS < MOE_ROW_TOKENS ? MOE_SLOTS / KS : MOE_ROW_TOKENS;
    static constexpr int NS = TT * KS;
};

// Top-k over s[0..experts) by one warp: k (<= 8) rounds of a warp argmax (larger score,
// ties to the lower expert), each excluding the experts chosen before. Every lane gets the
// experts in descending score order in `chosen` and their scores in `chosen_v` (registers:
// the rounds share nothing through shared memory, and each lane reads only its own s[e]).
__device__ __forceinline__ void warp_topk(const float *s, unsigned experts, unsigned k,
                                          int (&chosen)[8], float (&chosen_v)[8]) {
    const unsigned lane = threadIdx.x & 31u;
#pragma unroll
    for (unsigned j = 0; j < 8; ++j) {
        chosen[j] = -1;
        chosen_v[j] = 0.0f;
        if (j >= k) continue;
        float v = 0.0f;
        int i = -1;
        for (unsigned e = lane; e < experts; e += 32) {
            bool taken = false;
#pragma unroll
            for (unsigned q = 0; q < j; ++q) taken |= chosen[q] == (int)e;
            if (!taken) better(v, i, s[e], (int)e);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
            const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
            better(v, i, v2, i2);
        }
        // The xor tree leaves every lane with the same winner.
        chosen[j] = i;
        chosen_v[j] = v;
    }
}

// The router forward's dot products for experts g0 .. g0 + NE - 1 and the block's nt tokens:
// r[i] of lane l = the warp's part of logit (t0 + i, g0 + l / (32 / NE)). Warp w takes the
// columns w * 32 * W + MOE_BLOCK * W * n (lane l the W from l * W on), in n order; per column
// group a thread sums its W products in h order, then warp_sum_n adds the lanes. Each thread
// loads its Wr columns of the NE experts once for all nt <= NT tokens (registers), and the
// nt x pieces all in flight together. NE x NT = 32: 4 experts a pass for up to 8 tokens (8 x
// pieces and 4 experts' Wr fit 128 registers; the next group's x loads hit L1), 8 for up to
// 4 (one pass fewer at E = 8: one round trip for Wr fewer in the small-T blocks).
template <int W, int NE, int NT>
__device__ __forceinline__ void router_dots(const __nv_bfloat16 *xb, const float *wr,
                                            unsigned hidden, unsigned experts, unsigned g0,
                                            unsigned nt, float (&r)[NT]) {
    static_assert(NE * NT == 32 && NT <= MOE_TOKENS, "a pass's sums per thread");
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < NT; ++i) r[i] = 0.0f;
    // h0 is the warp's first column of the pass: the bound is warp-uniform, as the shuffles
    // of warp_sum_n need the whole warp.
    for (unsigned h0 = warp * 32 * W; h0 < hidden; h0 += MOE_BLOCK * W) {
        const unsigned h = h0 + lane * W;
        const bool in = h < hidden; // W = 8: hidden % 8 == 0, so all 8 columns are
        float w[NE][W];
#pragma unroll
        for (int j = 0; j < NE; ++j) {
            if (in && g0 + j < experts) {
                load_f32<W>(wr + (size_t)(g0 + j) * hidden + h, w[j]);
            } else {
#pragma unroll
                for (int v = 0; v < W; ++v) w[j][v] = 0.0f;
            }
        }
        Bf16s<W> xr[NT];
#pragma unroll
        for (int i = 0; i < NT; ++i)
            if (in && (unsigned)i < nt) xr[i].load(xb + (size_t)i * hidden + h);
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            if ((unsigned)i >= nt) break; // block-uniform
            float xf[W];
            if (in) {
                xr[i].to_f32(xf);
            } else {
#pragma unroll
                for (int v = 0; v < W; ++v) xf[v] = 0.0f;
            }
            float a[NE];
#pragma unroll
            for (int j = 0; j < NE; ++j) {
                a[j] = 0.0f;
#pragma unroll
                for (int v = 0; v < W; ++v) a[j] = fmaf(xf[v], w[j][v], a[j]);
            }
            r[i] += warp_sum_n(a);
        }
    }
}

// The gates' gradient, a block's dot products: acc[q] = this thread's part of dy[t0 + i, :] .
// y[row of (i, j), :] for register slot q = i * KS + j (0 for a slot without a row). The
// thread takes the columns h = threadIdx.x * W + MOE_BLOCK * W * n in n order, each group's
// W products in h order; it loads each token's dy piece once and every slot's y piece, all
// in flight together.
template <int KS, int W>
__device__ __forceinline__ void gate_dots(const __nv_bfloat16 *dy, const __nv_bfloat16 *y,
                                          const int (*rs)[MOE_TOP_K], unsigned t0, unsigned nt,
                                          unsigned hidden, unsigned k, float (&acc)[MOE_SLOTS]) {
    constexpr int TT = RowSlots<KS>::TT, NS = RowSlots<KS>::NS;
    int row[NS];
#pragma unroll
    for (int q = 0; q < MOE_SLOTS; ++q) acc[q] = 0.0f;
#pragma unroll
    for (int q = 0; q < NS; ++q) {
        const unsigned i = q / KS, j = q % KS;
        row[q] = i < nt && j < k ? rs[i][j] : -1;
    }
    for (unsigned h = threadIdx.x * W; h < hidden; h += MOE_BLOCK * W) {
        Bf16s<W> dv[TT], yv[NS];
#pragma unroll
        for (int i = 0; i < TT; ++i)
            if ((unsigned)i < nt) dv[i].load(dy + (size_t)(t0 + i) * hidden + h);
#pragma unroll
        for (int q = 0; q < NS; ++q)
            if (row[q] >= 0) yv[q].load(y + (size_t)row[q] * hidden + h);
#pragma unroll
        for (int q = 0; q < NS; ++q) {
            if (row[q] < 0) continue;
            float a[W], b[W];
            dv[q / KS].to_f32(a);
            yv[q].to_f32(b);
#pragma unroll
            for (int v = 0; v < W; ++v) acc[q] = fmaf(a[v], b[v], acc[q]);
        }
    }
}

// The logits' gradient of one token, by one warp, from its logits l, the aux loss's gradient
// on each score ce[e], its top-k experts tk, gates gt and the gates' gradient dg (k each);
// s and ds are the warp's scratch rows (experts floats each). Writes dl[0 .. experts).
//   through the gates:  softmax without renormalisation: d s_e = sum_j [e_j = e] dg_j;
//                       renormalised (sigmoid always): d s_{e_i} = (dg_i - sum_j dg_j g_j) / S,
//                       S = sum of the chosen scores;
//   the aux loss:       c_e = aux_coef * E * f_e / T on p[t, e]: softmax p = s, so d s_e += c_e;
//                       sigmoid p = s / Q, so d s_e += (c_e - sum_e' c_e' p_e') / Q;
//   to the logits:      softmax d l_e = s_e (d s_e - sum_e' d s_e' s_e');
//                       sigmoid d l_e = d s_e s_e (1 - s_e);
//   the z-loss:         d l_e += z_coef * (2 / T) * lse * softmax(l)_e.
__device__ __forceinline__ void token_backward(const float *l, const float *ce, const int *tk,
                                               const float *gt, const float *dg, float *s,
                                               float *ds, float *dl, unsigned tokens,
                                               unsigned experts, unsigned k, unsigned score_fn,
                                               unsigned renormalize, float z_coef) {
    const unsigned lane = threadIdx.x & 31u;
    const LogitStats st = warp_logit_stats(l, experts, lane);
    const float m = st.m, z = st.z;
    const float lse = m + logf(z);
    float q = 0.0f;
    for (unsigned e = lane; e < experts; e += 32) {
        const float v = score_fn == 0 ? expf(l[e] - m) / z : sigmoidf(l[e]);
        s[e] = v;
        q += v;
    }
    q = warp_sum(q);
    // The aux loss's gradient on the scores; for sigmoid its mean over p needs a sum first.
    float cp = 0.0f;
    for (unsigned e = lane; e < experts; e += 32) {
        const float c = ce[e];
        ds[e] = c;
        cp += c * (s[e] / q);
    }
    cp = warp_sum(cp);
    if (score_fn != 0)
        for (unsigned e = lane; e < experts; e += 32) ds[e] = (ds[e] - cp) / q;
    __syncwarp();
    // Through the gates (lane 0: k <= 8 terms, in j order).
    if (lane == 0) {
        const bool norm = score_fn != 0 || renormalize != 0;
        float sum = 0.0f, dot = 0.0f;
        for (unsigned j = 0; j < k; ++j) {
            const int e = tk[j];
            if (e >= 0 && (unsigned)e < experts) sum += s[e];
            dot += dg[j] * gt[j];
        }
        for (unsigned j = 0; j < k; ++j) {
            const int e = tk[j];
            if (e < 0 || (unsigned)e >= experts) continue;
            ds[e] += norm ? (dg[j] - dot) / sum : dg[j];
        }
    }
    __syncwarp();
    float sds = 0.0f;
    if (score_fn == 0) {
        for (unsigned e = lane; e < experts; e += 32) sds += ds[e] * s[e];
        sds = warp_sum(sds);
    }
    const float zc = z_coef * 2.0f / (float)tokens * lse;
    for (unsigned e = lane; e < experts; e += 32) {
        const float sm = expf(l[e] - m) / z;
        const float v = score_fn == 0 ? s[e] * (ds[e] - sds) : ds[e] * s[e] * (1.0f - s[e]);
        dl[e] = v + zc * sm;
    }
}

// The combine, a block's rows: out[t0 + i, :] = sum_j gates * y[row of (i, j), :] in j order
// (f32, fmaf from 0), rounded to bf16; a row of -1 adds nothing. All the block's row loads of
// a column group are in flight together.
template <int KS, int W>
__device__ __forceinline__ void combine_rows(const __nv_bfloat16 *y, const int (*rs)[MOE_TOP_K],
                                             const float (*gs)[MOE_TOP_K], __nv_bfloat16 *out,
                                             unsigned t0, unsigned nt, unsigned hidden,
                                             unsigned k) {
    constexpr int TT = RowSlots<KS>::TT, NS = RowSlots<KS>::NS;
    int row[NS];
    float g[NS];
#pragma unroll
    for (int q = 0; q < NS; ++q) {
        const unsigned i = q / KS, j = q % KS;
        const bool ok = i < nt && j < k;
        row[q] = ok ? rs[i][j] : -1;
        g[q] = ok ? gs[i][j] : 0.0f;
    }
    for (unsigned h = threadIdx.x * W; h < hidden; h += MOE_BLOCK * W) {
        Bf16s<W> yv[NS];
#pragma unroll
        for (int q = 0; q < NS; ++q)
            if (row[q] >= 0) yv[q].load(y + (size_t)row[q] * hidden + h);
#pragma unroll
        for (int i = 0; i < TT; ++i) {
            if ((unsigned)i >= nt) break;
            float acc[W];
#pragma unroll
            for (int v = 0; v < W; ++v) acc[v] = 0.0f;
#pragma unroll
            for (int j = 0; j < KS; ++j) {
                const int q = i * KS + j;
                if (row[q] < 0) continue;
                float f[W];
                yv[q].to_f32(f);
#pragma unroll
                for (int v = 0; v < W; ++v) acc[v] = fmaf(g[q], f[v], acc[v]);
            }
            store_bf16<W>(out + (size_t)(t0 + i) * hidden + h, acc);
        }
    }
}

// The input gradient, a block's rows (see moe_unpermute_backward): per pass of W columns,
// the experts' rows j outer and the MOE_TOKENS tokens inner (the tokens' loads in flight
// together, each element's terms in j order; a missing row loads nothing), then the router's
// part with each Wr piece loaded once for all the tokens. (Not all of a token's rows at once
// as in the combine: the 64 sums of 8 tokens x 8 columns and 8 loads fill 128 registers.)
template <int W>
__device__ __forceinline__ void unpermute_rows(const __nv_bfloat16 *dxp,
                                               const int (*rs)[MOE_TOP_K], const float *dl,
                                               const float *wr, __nv_bfloat16 *dx, unsigned t0,
                                               unsigned nt, unsigned hidden, unsigned experts,
                                               unsigned k) {
    const float4 *dl4 = reinterpret_cast<const float4 *>(dl);
    static_assert(MOE_TOKENS == 8, "d_logits of one expert: two float4");
    for (unsigned h = threadIdx.x * W; h < hidden; h += MOE_BLOCK * W) {
        float acc[MOE_TOKENS][W];
#pragma unroll
        for (int i = 0; i < MOE_TOKENS; ++i)
#pragma unroll
            for (int v = 0; v < W; ++v) acc[i][v] = 0.0f;
        for (unsigned j = 0; j < k; ++j) {
            int row[MOE_TOKENS];
            Bf16s<W> raw[MOE_TOKENS];
#pragma unroll
            for (int i = 0; i < MOE_TOKENS; ++i) {
                row[i] = (unsigned)i < nt ? rs[i][j] : -1;
                if (row[i] >= 0) raw[i].load(dxp + (size_t)row[i] * hidden + h);
            }
#pragma unroll
            for (int i = 0; i < MOE_TOKENS; ++i) {
                if (row[i] < 0) continue;
                float f[W];
                raw[i].to_f32(f);
#pragma unroll
                for (int v = 0; v < W; ++v) acc[i][v] += f[v];
            }
        }
#pragma unroll 4
        for (unsigned e = 0; e < experts; ++e) {
            float w[W];
            load_f32<W>(wr + (size_t)e * hidden + h, w);
            const float4 da = dl4[2 * e], db = dl4[2 * e + 1];
            const float d[MOE_TOKENS] = {da.x, da.y, da.z, da.w, db.x, db.y, db.z, db.w};
#pragma unroll
            for (int i = 0; i < MOE_TOKENS; ++i)
#pragma unroll
                for (int v = 0; v < W; ++v) acc[i][v] = fmaf(d[i], w[v], acc[i][v]);
        }
#pragma unroll
        for (int i = 0; i < MOE_TOKENS; ++i)
            if ((unsigned)i < nt) store_bf16<W>(dx + (size_t)(t0 + i) * hidden + h, acc[i]);
    }
}

// A lane's 8 columns of a router-weight-gradient block (columns c0 .. c0 + 255): 8
// consecutive ones, c0 + 8 lane + v (one 16-byte load), or with !VEC c0 + lane + 32 v (eight
// 2-byte loads, each warp access still 64 contiguous bytes); either way the block covers
// MOE_WGRAD_COLS columns, so the grid does not depend on the path.
template <bool VEC> __device__ __forceinline__ unsigned wgrad_col(unsigned c0, unsigned v) {
    const unsigned lane = threadIdx.x & 31u;
    return VEC ? c0 + lane * 8 + v : c0 + lane + 32 * v;
}

template <bool VEC> struct Cols8;
template <> struct Cols8<true> {
    uint4 u;
    __device__ __forceinline__ void load(const __nv_bfloat16 *row, unsigned c0, unsigned hidden) {
        const unsigned c = wgrad_col<true>(c0, 0);
        u = c < hidden ? __ldg(reinterpret_cast<const uint4 *>(row + c)) : make_uint4(0, 0, 0, 0);
    }
    __device__ __forceinline__ void to_f32(float (&f)[8]) const { bf16x8_to_f32(u, f); }
};
template <> struct Cols8<false> {
    __nv_bfloat16 b[8];
    __device__ __forceinline__ void load(const __nv_bfloat16 *row, unsigned c0, unsigned hidden) {
#pragma unroll
        for (int v = 0; v < 8; ++v) {
            const unsigned c = wgrad_col<false>(c0, v);
            b[v] = c < hidden ? __ldg(row + c) : __float2bfloat16_rn(0.0f);
        }
    }
    __device__ __forceinline__ void to_f32(float (&f)[8]) const {
#pragma unroll
        for (int v = 0; v < 8; ++v) f[v] = __bfloat162float(b[v]);
    }
};

// The router weight gradient's per-warp sums: acc[g][v] = sum over the warp's tokens i = warp
// + MOE_WARPS n of the chunk (in order) of dls[i][g] * x[i, column v of the lane]; B tokens'
// loads in flight together.
template <bool VEC>
__device__ __forceinline__ void wgrad_dots(const __nv_bfloat16 *xc, const float *dls,
                                           unsigned nt, unsigned hidden, unsigned c0,
                                           float (&acc)[MOE_WGRAD_EXPERTS][8]) {
    constexpr int B = VEC ? 8 : 4; // the scalar path holds 8 registers per token
    const unsigned warp = threadIdx.x >> 5;
    const float4 *d4 = reinterpret_cast<const float4 *>(dls);
    static_assert(MOE_WGRAD_EXPERTS == 8, "one token's d_logits: two float4");
    for (unsigned i0 = warp; i0 < nt; i0 += B * MOE_WARPS) {
        Cols8<VEC> xr[B];
#pragma unroll
        for (int u = 0; u < B; ++u) {
            const unsigned i = i0 + u * MOE_WARPS;
            if (i < nt) xr[u].load(xc + (size_t)i * hidden, c0, hidden);
        }
#pragma unroll
        for (int u = 0; u < B; ++u) {
            const unsigned i = i0 + u * MOE_WARPS;
            if (i >= nt) break;
            float xf[8];
            xr[u].to_f32(xf);
            const float4 da = d4[2 * i], db = d4[2 * i + 1];
            const float d[MOE_WGRAD_EXPERTS] = {da.x, da.y, da.z, da.w, db.x, db.y, db.z, db.w};
#pragma unroll
            for (int g = 0; g < MOE_WGRAD_EXPERTS; ++g)
#pragma unroll
                for (int v = 0; v < 8; ++v) acc[g][v] = fmaf(d[g], xf[v], acc[g][v]);
        }
    }
}

template <bool VEC>
__device__ __forceinline__ void wgrad_store(float *pc, unsigned hidden, unsigned experts,
                                            unsigned e0, unsigned c0,
                                            const float (&acc)[MOE_WGRAD_EXPERTS][8]) {
#pragma unroll
    for (int g = 0; g < MOE_WGRAD_EXPERTS; ++g) {
        if (e0 + g >= experts) break;
        float *pr = pc + (size_t)(e0 + g) * hidden;
        if (VEC) {
            const unsigned c = wgrad_col<true>(c0, 0);
            if (c < hidden) {
                float4 *p4 = reinterpret_cast<float4 *>(pr + c);
                p4[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
                p4[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
            }
        } else {
#pragma unroll
            for (int v = 0; v < 8; ++v) {
                const unsigned c = wgrad_col<false>(c0, v);
                if (c < hidden) pr[c] = acc[g][v];
            }
        }
    }
}

} // namespace

// Router forward, one block of MOE_BLOCK threads per `tpb` (<= MOE_TOKENS) tokens t0 + i
// (the last block may have fewer), dynamic shared memory 2 * MOE_TOKENS * experts floats.
//   logits[t, e] = sum_h x[t, h] * wr[e, h]   (experts 8 or 4 at a time: router_dots gives
//                  each warp's part for all the block's tokens, the 8 warps' parts are added
//                  in warp order), or, when `precomputed`, read from `logits` (moe_router_logits
//                  wrote them: many experts)
// then warp i finishes token t0 + i:
//   score: softmax (score_fn 0) or sigmoid (1) of the logits;
//   probs[t, e]  = the per-token distribution the aux loss uses: softmax, or the sigmoid
//                  scores divided by their sum;
//   topk[t, j]   = the expert of the j-th largest logit (ties to the lower expert): the
//                  j-th largest score, without the ties f32 scores add;
//   gates[t, j]  = softmax: score (divided by the sum of the k chosen scores if renormalize);
//                  sigmoid: score / sum of the k chosen scores;
//   lse[t]       = logsumexp of the logits (for the z-loss);
// and the block's sums for the losses (moe_plan_scan adds them up), column-major over the
// blocks: loss_partial[e * blocks + block] = sum over its tokens (in order) of probs[t, e],
// loss_partial[experts * blocks + block] = the sum of lse[t]^2.
// (At least 2 blocks per SM in the launch bounds: 128 registers hold a thread's Wr pieces of
// 4 experts and the x pieces of 8 tokens.)
extern "C" __global__ void __launch_bounds__(MOE_BLOCK, 2)
    moe_router_forward(const __nv_bfloat16 *x, const float *wr, float *logits, float *probs,
                       int *topk, float *gates, float *lse, float *loss_partial, unsigned tokens,
                       unsigned hidden, unsigned experts, unsigned k, unsigned score_fn,
                       unsigned renormalize, unsigned tpb, unsigned precomputed) {
    cuda_graph::pdl_enter();
    extern __shared__ float sh[]; // l: [MOE_TOKENS][experts] logits (then probs), s: scores
    __shared__ float part[MOE_WARPS][32]; // [warp][i * NE + j] of a pass
    __shared__ float lse_sh[MOE_TOKENS];
    static_assert(MOE_TOKENS <= MOE_WARPS, "a warp finishes each token");
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned t0 = blockIdx.x * tpb;
    if (t0 >= tokens) return;
    const unsigned nt = min(tpb, tokens - t0); // block-uniform
    const __nv_bfloat16 *xb = x + (size_t)t0 * hidden;
    const bool vec = hidden % 8 == 0 && aligned16(x) && aligned16(wr);
    if (precomputed) {
        // moe_router_logits wrote the block's logits (rows t0 .. t0 + nt - 1, contiguous).
        const float *lb = logits + (size_t)t0 * experts;
        for (unsigned i = threadIdx.x; i < nt * experts; i += MOE_BLOCK) sh[i] = lb[i];
        __syncthreads();
    }
    // The dot products, NE experts a pass (router_dots: 8 when the block has at most 4
    // tokens, else 4), the 8 warps' parts added in warp order.
    const auto passes = [&](auto ne) {
        constexpr int NE = decltype(ne)::value, NT = 32 / NE;
        for (unsigned g0 = 0; g0 < experts; g0 += NE) {
            float r[NT];
            if (vec)
                router_dots<8, NE, NT>(xb, wr, hidden, experts, g0, nt, r);
            else
                router_dots<1, NE, NT>(xb, wr, hidden, experts, g0, nt, r);
            // Lanes (32 / NE) m .. (32 / NE) (m + 1) - 1 hold the same sums (expert g0 + m);
            // the first writes them.
            if ((lane & (32 / NE - 1)) == 0) {
#pragma unroll
                for (int i = 0; i < NT; ++i)
                    if ((unsigned)i < nt) part[warp][i * NE + lane / (32 / NE)] = r[i];
            }
            __syncthreads();
            if (threadIdx.x < nt * NE) {
                const unsigned i = threadIdx.x / NE, j = threadIdx.x % NE;
                if (g0 + j < experts) {
                    float v = part[0][threadIdx.x];
#pragma unroll
                    for (int w = 1; w < MOE_WARPS; ++w) v += part[w][threadIdx.x];
                    sh[(size_t)i * experts + g0 + j] = v;
                }
            }
            __syncthreads(); // part is written again by the next group
        }
    };
    if (!precomputed) {
        if (nt <= 4)
            passes(Const<8>{});
        else
            passes(Const<4>{});
    }
    if (warp < nt) {
        const unsigned t = t0 + warp;
        float *l = sh + (size_t)warp * experts, *s = sh + (size_t)(MOE_TOKENS + warp) * experts;
        const LogitStats st = warp_logit_stats(l, experts, lane);
        const float m = st.m, z = st.z;
        float q = 0.0f; // sum of the sigmoid scores
        for (unsigned e = lane; e < experts; e += 32) {
            const float v = score_fn == 0 ? expf(l[e] - m) / z : sigmoidf(l[e]);
            s[e] = v;
            q += v;
        }
        q = warp_sum(q);
        // Top-k ranked by the logits, which every score function is monotone in: the f32
        // scores are not strictly (near-equal logits can round to one score, a tie the
        // lower expert would win though its logit is smaller). Values are the scores.
        int chosen[8];
        float chosen_v[8];
        warp_topk(l, experts, k, chosen, chosen_v);
        __syncwarp(); // every lane's s[e]
#pragma unroll
        for (unsigned j = 0; j < 8; ++j) chosen_v[j] = chosen[j] >= 0 ? s[chosen[j]] : 0.0f;
        float *lr = logits + (size_t)t * experts, *pr = probs + (size_t)t * experts;
        for (unsigned e = lane; e < experts; e += 32) {
            const float p = score_fn == 0 ? s[e] : s[e] / q;
            if (!precomputed) lr[e] = l[e];
            pr[e] = p;
            l[e] = p; // for the loss sums below
        }
        const float ls = m + logf(z);
        if (lane == 0) {
            lse[t] = ls;
            lse_sh[warp] = ls;
            float sum = 0.0f;
#pragma unroll
            for (unsigned j = 0; j < 8; ++j)
                if (j < k) sum += chosen_v[j];
            const bool norm = score_fn != 0 || renormalize != 0;
#pragma unroll
            for (unsigned j = 0; j < 8; ++j) {
                if (j >= k) continue;
                topk[(size_t)t * k + j] = chosen[j];
                gates[(size_t)t * k + j] = norm ? chosen_v[j] / sum : chosen_v[j];
            }
        }
    }
    __syncthreads();
    for (unsigned c = threadIdx.x; c <= experts; c += MOE_BLOCK) {
        float v = 0.0f;
        for (unsigned i = 0; i < nt; ++i)
            v += c < experts ? sh[(size_t)i * experts + c] : lse_sh[i] * lse_sh[i];
        loss_partial[(size_t)c * gridDim.x + blockIdx.x] = v;
    }
}

// Tiled GEMMs on the CUDA cores for the router at many experts (the launcher's choice,
// routing.rs), where the per-block dot products of moe_router_forward and
// moe_router_wgrad_partial read all of Wr (or sweep all the tokens) once per few tokens or
// experts. A block of RL_THREADS threads computes a 64 x 64 tile C[m, n] = sum_k A[k, m] *
// B[k, n] in f32, each output one fmaf chain in k order (deterministic); thread (ty, tx) holds
// rows ty * 8 .. + 7 and columns tx * 4 .. + 3 (32 sums). The reduction goes in chunks of RL_K
// through two shared-memory buffers, k-major, the next chunk's global loads in registers
// while this one is used: 2 + 1 16-byte shared loads per 32 fmaf. `Loader` fetches a chunk
// (`load(k0)`, 16 values of A and of B per thread) and writes it to the buffers (`store`).
#define RL_T 64
#define RL_K 32
#define RL_THREADS 128
#define RL_PAD (RL_T + 4)
static_assert(RL_T * RL_K == 16 * RL_THREADS, "one 16-value piece of A and of B per thread");
typedef float RlTile[RL_K][RL_PAD];

template <class Loader>
__device__ __forceinline__ void rl_tile_gemm(Loader &ld, unsigned k_len, RlTile *as, RlTile *bs,
                                             float (&acc)[8][4]) {
    const unsigned tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    const unsigned chunks = (k_len + RL_K - 1) / RL_K;
    ld.load(0);
    ld.store(as[0], bs[0]);
    __syncthreads();
    for (unsigned c = 0; c < chunks; ++c) {
        const int buf = c & 1;
        if (c + 1 < chunks) ld.load((c + 1) * RL_K);
#pragma unroll
        for (int kk = 0; kk < RL_K; ++kk) {
            const float4 a0 = *reinterpret_cast<const float4 *>(&as[buf][kk][ty * 8]);
            const float4 a1 = *reinterpret_cast<const float4 *>(&as[buf][kk][ty * 8 + 4]);
            const float4 b = *reinterpret_cast<const float4 *>(&bs[buf][kk][tx * 4]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float bb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], bb[j], acc[i][j]);
        }
        // The other buffer was last read in the previous chunk, before this chunk's barrier.
        if (c + 1 < chunks) ld.store(as[buf ^ 1], bs[buf ^ 1]);
        __syncthreads();
    }
}

// 8 consecutive values of a row as f32 (one or two 16-byte loads), and one value.
__device__ __forceinline__ void rl_load8(const __nv_bfloat16 *p, float (&f)[8]) {
    Bf16s<8> b;
    b.load(p);
    b.to_f32(f);
}
__device__ __forceinline__ void rl_load8(const float *p, float (&f)[8]) { load_f32<8>(p, f); }
__device__ __forceinline__ float rl_load1(const __nv_bfloat16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ float rl_load1(const float *p) { return __ldg(p); }

// 16 consecutive values (bf16 or f32) of a row from column c, as f32 (those at or past
// `len`, or all when `!valid`, are 0): 16-byte loads when `vec` and the 16 lie below len,
// else one by one.
template <typename E>
__device__ __forceinline__ void rl_load(const E *row, unsigned c, unsigned len, bool valid,
                                        bool vec, float (&v)[16]) {
    if (vec && c + 16 <= len) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            float f[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            if (valid) rl_load8(row + c + 8 * q, f);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[8 * q + i] = f[i];
        }
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = valid && c + i < len ? rl_load1(row + c + i) : 0.0f;
    }
}

// One thread's 16 values of an operand tile, loaded from a row-major array (`base`, rows of
// `len` elements) and written to a k-major shared tile. Transposed (`RlPieceT`): the tile's
// 64 m-rows are rows m0 .. m0 + 63 of the array and its k runs along them (thread i: row
// i / 2, k (i % 2) * 16 .. + 15 of the chunk). Natural (`RlPieceN`): the tile's k-rows are the
// array's rows kb .. ke - 1 and its 64 columns run along them from c0 (thread i: k-row i / 4,
// columns (i % 4) * 16 .. + 15). Past the array's rows or row length the values are 0.
template <typename E> struct RlPieceT {
    const E *base;
    unsigned rows, len, m0;
    bool vec;
    float v[16];
    __device__ __forceinline__ void load(unsigned k0) {
        const unsigned r = m0 + threadIdx.x / 2;
        rl_load(base + (size_t)min(r, rows - 1) * len, k0 + (threadIdx.x % 2) * 16, len,
                r < rows, vec, v);
    }
    __device__ __forceinline__ void store(RlTile &t) const {
#pragma unroll
        for (int i = 0; i < 16; ++i) t[(threadIdx.x % 2) * 16 + i][threadIdx.x / 2] = v[i];
    }
};
template <typename E> struct RlPieceN {
    const E *base;
    unsigned kb, ke, len, c0;
    bool vec;
    float v[16];
    __device__ __forceinline__ void load(unsigned k0) {
        const unsigned r = kb + k0 + threadIdx.x / 4;
        rl_load(base + (size_t)(r < ke ? r : kb) * len, c0 + (threadIdx.x % 4) * 16, len, r < ke,
                vec, v);
    }
    __device__ __forceinline__ void store(RlTile &t) const {
        float *row = &t[threadIdx.x / 4][(threadIdx.x % 4) * 16];
#pragma unroll
        for (int i = 0; i < 16; i += 4)
            *reinterpret_cast<float4 *>(row + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
    }
};
// rl_tile_gemm's loader from two pieces: A's into `as`, B's into `bs`.
template <class A, class B> struct RlLoader {
    A a;
    B b;
    __device__ __forceinline__ void load(unsigned k0) {
        a.load(k0);
        b.load(k0);
    }
    __device__ __forceinline__ void store(RlTile &as, RlTile &bs) const {
        a.store(as);
        b.store(bs);
    }
};

// logits[t, e] = sum_h x[t, h] * wr[e, h] in f32 (see rl_tile_gemm; m = tokens, n = experts,
// k = hidden, both operands transposed into the tiles): block (bx, by) takes the tokens
// bx * 64 .. + 63 and the experts by * 64 .. + 63. moe_router_forward then reads them
// (`precomputed`).
extern "C" __global__ void __launch_bounds__(RL_THREADS)
    moe_router_logits(const __nv_bfloat16 *x, const float *wr, float *logits, unsigned tokens,
                      unsigned hidden, unsigned experts) {
    cuda_graph::pdl_enter();
    __shared__ __align__(16) RlTile as[2], bs[2];
    const unsigned t0 = blockIdx.x * RL_T, e0 = blockIdx.y * RL_T;
    const bool vec = hidden % 8 == 0 && aligned16(x) && aligned16(wr);
    RlLoader<RlPieceT<__nv_bfloat16>, RlPieceT<float>> ld{{x, tokens, hidden, t0, vec},
                                                           {wr, experts, hidden, e0, vec}};
    float acc[8][4];
    rl_tile_gemm(ld, hidden, as, bs, acc);
    const unsigned tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const unsigned t = t0 + ty * 8 + i;
        if (t >= tokens) break;
        float *row = logits + (size_t)t * experts;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const unsigned e = e0 + tx * 4 + j;
            if (e < experts) row[e] = acc[i][j];
        }
    }
}

// Router weight gradient, step 1 of 2 for many experts: partial[c, e, h] = sum over the
// tokens t of chunk c (`chunk` tokens each, in order) of d_logits[t, e] * x[t, h] (see
// rl_tile_gemm); grid (ceil(H / 64), ceil(E / 64), chunks). moe_router_wgrad_reduce adds the
// chunks in order.
extern "C" __global__ void __launch_bounds__(RL_THREADS)
    moe_router_wgrad_tiled(const float *d_logits, const __nv_bfloat16 *x, float *partial,
                           unsigned tokens, unsigned hidden, unsigned experts, unsigned chunk) {
    cuda_graph::pdl_enter();
    __shared__ __align__(16) RlTile as[2], bs[2];
    const unsigned h0 = blockIdx.x * RL_T, e0 = blockIdx.y * RL_T, t0 = blockIdx.z * chunk;
    if (t0 >= tokens) return;
    const unsigned nt = min(chunk, tokens - t0);
    // m = experts, n = hidden columns, k = the chunk's tokens; both operands are token-major.
    RlLoader<RlPieceN<float>, RlPieceN<__nv_bfloat16>> ld{
        {d_logits, t0, t0 + nt, experts, e0, experts % 4 == 0 && aligned16(d_logits)},
        {x, t0, t0 + nt, hidden, h0, hidden % 8 == 0 && aligned16(x)}};
    float acc[8][4];
    rl_tile_gemm(ld, nt, as, bs, acc);
    const unsigned tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float *pc = partial + (size_t)blockIdx.z * experts * hidden;
    const bool vec = hidden % 4 == 0 && aligned16(partial);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const unsigned e = e0 + ty * 8 + i;
        if (e >= experts) break;
        float *row = pc + (size_t)e * hidden;
        const unsigned h = h0 + tx * 4;
        if (vec && h + 4 <= hidden) {
            *reinterpret_cast<float4 *>(row + h) =
                make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (h + j < hidden) row[h + j] = acc[i][j];
        }
    }
}

// Dispatch plan, step 1 of 3. Block c takes assignments i in [c * MOE_BLOCK, (c + 1) *
// MOE_BLOCK) (i = t * k + j, token order) and counts them per expert into
// block_counts[c * experts + e] (shared-memory integer atomics: the counts do not depend on
// their order). Dynamic shared memory: experts ints.
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_plan_count(const int *topk, int *block_counts, unsigned assignments, unsigned experts) {
    cuda_graph::pdl_enter();
    extern __shared__ int hist[];
    for (unsigned e = threadIdx.x; e < experts; e += MOE_BLOCK) hist[e] = 0;
    __syncthreads();
    const unsigned i = blockIdx.x * MOE_BLOCK + threadIdx.x;
    if (i < assignments) {
        const int e = topk[i];
        if (e >= 0 && (unsigned)e < experts) atomicAdd(&hist[e], 1);
    }
    __syncthreads();
    for (unsigned e = threadIdx.x; e < experts; e += MOE_BLOCK)
        block_counts[(size_t)blockIdx.x * experts + e] = hist[e];
}

// The losses' column sums of the plan (moe_plan_scan, moe_plan_small): warp `first` + w of
// `warps` takes the columns c = w, w + warps, ... <= experts of loss_partial ([experts +
// 1][parts]), lane l its rows l, l + 32, ... in order (8 loads in flight, the last group's
// predicated), then a fixed xor tree: col[c] = the column's sum, the same whichever warp
// forms it.
__device__ __forceinline__ void plan_loss_columns(const float *loss_partial, float *col,
                                                  unsigned experts, unsigned parts,
                                                  unsigned first, unsigned warps) {
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    for (unsigned c = warp - first; c <= experts; c += warps) {
        const float *p = loss_partial + (size_t)c * parts;
        float acc = 0.0f;
        for (unsigned r = lane; r < parts; r += 8 * 32) {
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) v[u] = r + u * 32 < parts ? __ldg(p + r + u * 32) : 0.0f;
#pragma unroll
            for (int u = 0; u < 8; ++u)
                if (r + u * 32 < parts) acc += v[u];
        }
        acc = warp_sum(acc);
        if (lane == 0) col[c] = acc;
    }
}

// The rest of the plan once the counts (`cnt`) and the losses' column sums (`col`) are in
// shared memory, by a block of MOE_SCAN_BLOCK threads (wtot: MOE_SCAN_BLOCK / 32 ints):
//   offsets[0] = 0, offsets[e + 1] = offsets[e] + counts[e] rounded up to `align` (one thread
//     per expert, a block-wide integer scan), also into `off`; counts[e] = cnt[e];
//   token_of_row[r] = -1 for the rows no assignment takes: each expert's padding [offsets[e]
//     + counts[e], offsets[e + 1]) and the rows from offsets[E] to `rows` (the assignment
//     writes all the others, so the whole buffer is written on every run);
//   losses[0] = aux = aux_coef * E * sum_e f_e * P_e, f_e = counts[e] / (T * k), P_e = (1/T)
//     sum_t probs[t, e]; losses[1] = z = z_coef * (1/T) * sum_t lse[t]^2 (warp 0:
//     lane-strided terms, a fixed xor tree).
// `off` is readable by every thread on return (a barrier follows its writes); nothing after
// that barrier is waited for.
__device__ __forceinline__ void plan_offsets_and_losses(const int *cnt, int *off, const float *col,
                                                        int *wtot, int *counts, int *offsets,
                                                        int *token_of_row, float *losses,
                                                        unsigned experts, unsigned align,
                                                        unsigned rows, unsigned tokens, unsigned k,
                                                        float aux_coef, float z_coef) {
    const unsigned tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    const int rv = tid < experts ? (int)(((unsigned)cnt[tid] + align - 1) / align * align) : 0;
    if (tid < experts) counts[tid] = cnt[tid];
    const int incl = warp_scan(rv);
    if (lane == 31) wtot[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const int w = wtot[lane];
        wtot[lane] = warp_scan(w) - w; // the warps' exclusive prefix
    }
    __syncthreads();
    const int excl = wtot[warp] + incl - rv;
    if (tid < experts) {
        off[tid] = excl;
        offsets[tid] = excl;
    }
    if (tid + 1 == experts) {
        off[experts] = excl + rv;
        offsets[experts] = excl + rv;
    }
    __syncthreads();
    for (unsigned e = warp; e < experts; e += MOE_SCAN_BLOCK / 32)
        for (int r = off[e] + cnt[e] + (int)lane; r < off[e + 1]; r += 32) token_of_row[r] = -1;
    for (unsigned r = (unsigned)off[experts] + tid; r < rows; r += MOE_SCAN_BLOCK)
        token_of_row[r] = -1;
    if (warp == 0) {
        float aux = 0.0f;
        for (unsigned e = lane; e < experts; e += 32) {
            const float f = (float)cnt[e] / ((float)tokens * (float)k);
            aux += f * (col[e] / (float)tokens);
        }
        aux = warp_sum(aux);
        if (lane == 0) {
            losses[0] = aux_coef * (float)experts * aux;
            losses[1] = z_coef * col[experts] / (float)tokens;
        }
    }
}

// Step 2 of 3, one block of MOE_SCAN_BLOCK threads: everything that needs all the tokens.
// Warps 0 .. 15 and 16 .. 31 work side by side, then all of them:
//   per expert, an exclusive scan of the block counts in block order (block_counts becomes
//     each block's base within the expert), the total its count: warp w takes experts 8 w ..
//     8 w + 7 (then + 128, ...), lane l the blocks l, l + 32, ..., a shuffle scan per 32
//     blocks, the 8 experts' loads in flight together;
//   the losses' column sums (plan_loss_columns, warps 16 .. 31);
//   then the counts, offsets, padding rows and losses (plan_offsets_and_losses).
extern "C" __global__ void __launch_bounds__(MOE_SCAN_BLOCK)
    moe_plan_scan(int *block_counts, const float *loss_partial, int *counts, int *offsets,
                  int *token_of_row, float *losses, unsigned blocks, unsigned experts,
                  unsigned align, unsigned rows, unsigned parts, unsigned tokens, unsigned k,
                  float aux_coef, float z_coef) {
    cuda_graph::pdl_enter();
    __shared__ int cnt[MOE_MAX_EXPERTS];
    __shared__ int off[MOE_MAX_EXPERTS + 1];
    __shared__ float col[MOE_MAX_EXPERTS + 1];
    __shared__ int wtot[MOE_SCAN_BLOCK / 32];
    constexpr unsigned SIDE = MOE_SCAN_BLOCK / 64; // warps on each side
    const unsigned tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    if (warp < SIDE) {
        for (unsigned e0 = warp * 8; e0 < experts; e0 += SIDE * 8) {
            int carry[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) carry[j] = 0;
            for (unsigned c0 = 0; c0 < blocks; c0 += 32) {
                const unsigned c = c0 + lane;
                int v[8];
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    v[j] = c < blocks && e0 + j < experts
                               ? block_counts[(size_t)c * experts + e0 + j]
                               : 0;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int incl = warp_scan(v[j]);
                    if (c < blocks && e0 + j < experts)
                        block_counts[(size_t)c * experts + e0 + j] = carry[j] + incl - v[j];
                    carry[j] += __shfl_sync(0xffffffffu, incl, 31);
                }
            }
            if (lane == 0) {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (e0 + j >= experts) break;
                    cnt[e0 + j] = carry[j];
                }
            }
        }
    } else {
        plan_loss_columns(loss_partial, col, experts, parts, SIDE, SIDE);
    }
    __syncthreads();
    plan_offsets_and_losses(cnt, off, col, wtot, counts, offsets, token_of_row, losses, experts,
                            align, rows, tokens, k, aux_coef, z_coef);
}

// The whole plan in one block of MOE_SCAN_BLOCK threads, for few assignments (at most
// MOE_SMALL_PASSES * MOE_SCAN_BLOCK) and experts (at most MOE_SMALL_EXPERTS): moe_plan_count,
// moe_plan_scan and moe_plan_assign in one launch, with the same results. The assignments go
// in passes of MOE_SCAN_BLOCK, in order: per pass each warp counts its assignments per
// expert (match masks: rank = earlier lanes with the same expert), warp e turns expert e's
// 32 warp counts into exclusive prefixes on top of the earlier passes' count of e, and each
// assignment's rank within its expert (token order) is kept in a register; then the counts,
// the losses' column sums, the offsets (plan_offsets_and_losses), and row_of[i] = offsets[e]
// + rank, token_of_row[row] = i (-1 in row_of for an expert out of range).
extern "C" __global__ void __launch_bounds__(MOE_SCAN_BLOCK)
    moe_plan_small(const int *topk, const float *loss_partial, int *counts, int *offsets,
                   int *row_of, int *token_of_row, float *losses, unsigned assignments,
                   unsigned experts, unsigned align, unsigned rows, unsigned parts,
                   unsigned tokens, unsigned k, float aux_coef, float z_coef) {
    cuda_graph::pdl_enter();
    __shared__ int cnt[MOE_SMALL_EXPERTS];
    __shared__ int off[MOE_SMALL_EXPERTS + 1];
    __shared__ float col[MOE_SMALL_EXPERTS + 1];
    __shared__ int wtot[MOE_SCAN_BLOCK / 32];
    __shared__ int wc[MOE_SCAN_BLOCK / 32][MOE_SMALL_EXPERTS];
    constexpr unsigned WARPS = MOE_SCAN_BLOCK / 32;
    const unsigned tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    for (unsigned e = tid; e < experts; e += MOE_SCAN_BLOCK) cnt[e] = 0;
    int ex[MOE_SMALL_PASSES], rank[MOE_SMALL_PASSES];
    // Every pass's experts, loaded together.
#pragma unroll
    for (int p = 0; p < MOE_SMALL_PASSES; ++p) {
        const unsigned i = p * MOE_SCAN_BLOCK + tid;
        ex[p] = i < assignments ? topk[i] : -1;
        if (ex[p] >= 0 && (unsigned)ex[p] >= experts) ex[p] = -2; // out of range: not placed
    }
#pragma unroll
    for (int p = 0; p < MOE_SMALL_PASSES; ++p) {
        if ((unsigned)p * MOE_SCAN_BLOCK >= assignments) break; // block-uniform
        for (unsigned e = lane; e < experts; e += 32) wc[warp][e] = 0;
        __syncwarp();
        const int e = ex[p];
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        rank[p] = __popc(peers & ((1u << lane) - 1u));
        if (e >= 0 && rank[p] == 0) wc[warp][e] = __popc(peers);
        __syncthreads();
        // Warp q scans expert q's 32 warp counts, lane w the count of warp w.
        static_assert(WARPS == 32, "a lane per warp");
        for (unsigned q = warp; q < experts; q += WARPS) {
            const int c = wc[lane][q];
            const int incl = warp_scan(c), base = cnt[q];
            __syncwarp();
            wc[lane][q] = base + incl - c;
            if (lane == 31) cnt[q] = base + incl;
        }
        __syncthreads();
        if (e >= 0) rank[p] += wc[warp][e];
        __syncthreads(); // wc is cleared by the next pass
    }
    plan_loss_columns(loss_partial, col, experts, parts, 0, WARPS);
    __syncthreads();
    plan_offsets_and_losses(cnt, off, col, wtot, counts, offsets, token_of_row, losses, experts,
                            align, rows, tokens, k, aux_coef, z_coef);
#pragma unroll
    for (int p = 0; p < MOE_SMALL_PASSES; ++p) {
        const unsigned i = p * MOE_SCAN_BLOCK + tid;
        if (i >= assignments) break;
        if (ex[p] < 0) {
            row_of[i] = -1;
            continue;
        }
        const int row = off[ex[p]] + rank[p];
        row_of[i] = row;
        token_of_row[row] = (int)i;
    }
}

// Step 3 of 3, the same blocks as step 1. Assignment i of expert e goes to row
//   offsets[e] + (its block's base within e) + (earlier assignments of e in its block),
// the last term from warp match masks and per-warp counts: token order within each expert.
// row_of[i] = that row (-1 for an expert out of range); token_of_row[row] = i (the padding
// rows are moe_plan_scan's). The block's first rows per expert are loaded into shared memory
// while topk is read (one round trip). Dynamic shared memory: (MOE_WARPS + 1) * experts ints.
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_plan_assign(const int *topk, const int *block_base, const int *offsets, int *row_of,
                    int *token_of_row, unsigned assignments, unsigned experts) {
    cuda_graph::pdl_enter();
    extern __shared__ int sa[]; // [MOE_WARPS][experts] per-warp counts, then [experts] bases
    int *warp_counts = sa, *base = sa + MOE_WARPS * experts;
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned i = blockIdx.x * MOE_BLOCK + threadIdx.x;
    int e = i < assignments ? topk[i] : -1;
    for (unsigned q = threadIdx.x; q < experts; q += MOE_BLOCK)
        base[q] = offsets[q] + block_base[(size_t)blockIdx.x * experts + q];
    for (unsigned q = threadIdx.x; q < MOE_WARPS * experts; q += MOE_BLOCK) warp_counts[q] = 0;
    __syncthreads();
    if (e >= 0 && (unsigned)e >= experts) e = -2; // out of range: its own group, not placed
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const unsigned rank = __popc(peers & ((1u << lane) - 1u));
    if (e >= 0 && rank == 0) warp_counts[warp * experts + e] = __popc(peers);
    __syncthreads();
    if (i >= assignments) return;
    if (e < 0) {
        row_of[i] = -1;
        return;
    }
    int before = 0;
    for (unsigned w = 0; w < warp; ++w) before += warp_counts[w * experts + e];
    const int row = base[e] + before + (int)rank;
    row_of[i] = row;
    token_of_row[row] = (int)i;
}

// Combine: out[t, :] = sum_j gates[t, j] * y[row_of[t, j], :] in j order (f32), rounded to
// bf16; a negative row contributes nothing. One block per `tpb` tokens t0 + i (tpb <=
// RowSlots<KS>::TT: tpb * KS <= MOE_SLOTS, KS = k rounded up to a power of two, and tpb <=
// MOE_ROW_TOKENS; the last block may have fewer): the block's tpb * k rows and gates go to
// shared memory first, then combine_rows (each thread W columns per pass, all the rows'
// loads in flight together). (At least 4 blocks per SM in the launch bounds: 64 registers
// still hold the 8 loads.)
extern "C" __global__ void __launch_bounds__(MOE_BLOCK, 4)
    moe_combine_forward(const __nv_bfloat16 *y, const int *row_of, const float *gates,
                        __nv_bfloat16 *out, unsigned tokens, unsigned hidden, unsigned k,
                        unsigned rows, unsigned tpb) {
    cuda_graph::pdl_enter();
    __shared__ int rs[MOE_ROW_TOKENS][MOE_TOP_K]; // [i][j], -1 where out of range
    __shared__ float gs[MOE_ROW_TOKENS][MOE_TOP_K];
    const unsigned t0 = blockIdx.x * tpb;
    if (t0 >= tokens) return;
    const unsigned nt = min(tpb, tokens - t0); // block-uniform
    if (threadIdx.x < nt * k) {
        const unsigned i = threadIdx.x / k, j = threadIdx.x % k;
        const size_t a = (size_t)t0 * k + threadIdx.x;
        const int r = row_of[a];
        rs[i][j] = r >= 0 && (unsigned)r < rows ? r : -1;
        gs[i][j] = gates[a];
    }
    __syncthreads();
    const bool vec = hidden % 8 == 0 && aligned16(y) && aligned16(out);
    with_row_layout(k, vec, [&](auto ks, auto w) {
        combine_rows<decltype(ks)::value, decltype(w)::value>(y, rs, gs, out, t0, nt, hidden, k);
    });
}

// The combine's backward into the router: the gates' gradient and then the logits'. One
// block per `tpb` tokens t0 + i (tpb as for the combine), dynamic shared memory (3 * tpb + 1)
// * experts floats.
//   d_gates[t, j] = sum_h dy[t, h] * y[row_of[t, j], h] (0 for a negative row): gate_dots's
//                   per-thread sums, warp_sum_n over each warp, the warps' sums in warp order;
//   d_logits[t, :] = token_backward (one warp per token) from the saved logits, top-k, gates
//                   and counts, and the block's d_gates.
// Everything the second part reads is loaded into shared memory with the rows at the start
// (one round trip).
__device__ __forceinline__ void
combine_backward_block(const __nv_bfloat16 *dy, const __nv_bfloat16 *y, const int *row_of,
                       const float *logits, const int *topk, const float *gates,
                       const int *counts, float *d_gates, float *d_logits, unsigned tokens,
                       unsigned hidden, unsigned experts, unsigned k, unsigned rows, unsigned tpb,
                       unsigned score_fn, unsigned renormalize, float aux_coef, float z_coef) {
    // [tpb][experts] logits, [tpb][experts] scores, [tpb][experts] their gradients, then
    // [experts] the aux loss's gradient on each score.
    extern __shared__ float sb[];
    __shared__ int rs[MOE_ROW_TOKENS][MOE_TOP_K], tk[MOE_ROW_TOKENS][MOE_TOP_K]; // [i][j]
    __shared__ float gt[MOE_ROW_TOKENS][MOE_TOP_K], dg[MOE_ROW_TOKENS][MOE_TOP_K];
    __shared__ float part[MOE_WARPS][MOE_SLOTS];
    static_assert(MOE_ROW_TOKENS <= MOE_WARPS, "a warp finishes each token");
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned t0 = blockIdx.x * tpb;
    if (t0 >= tokens) return;
    const unsigned nt = min(tpb, tokens - t0), na = nt * k; // block-uniform
    float *lg = sb, *sc = sb + (size_t)tpb * experts, *dsc = sb + (size_t)2 * tpb * experts;
    float *ce = sb + (size_t)3 * tpb * experts;
    for (unsigned q = threadIdx.x; q < nt * experts; q += MOE_BLOCK)
        lg[q] = logits[(size_t)t0 * experts + q];
    const float inv_tk = 1.0f / ((float)tokens * (float)k);
    const float aux_scale = aux_coef * (float)experts / (float)tokens;
    for (unsigned e = threadIdx.x; e < experts; e += MOE_BLOCK)
        ce[e] = aux_scale * (float)counts[e] * inv_tk;
    if (threadIdx.x < na) {
        const unsigned i = threadIdx.x / k, j = threadIdx.x % k;
        const size_t a = (size_t)t0 * k + threadIdx.x;
        const int r = row_of[a];
        rs[i][j] = r >= 0 && (unsigned)r < rows ? r : -1;
        tk[i][j] = topk[a];
        gt[i][j] = gates[a];
    }
    __syncthreads();
    float acc[MOE_SLOTS];
    const bool vec = hidden % 8 == 0 && aligned16(dy) && aligned16(y);
    with_row_layout(k, vec, [&](auto ks, auto w) {
        gate_dots<decltype(ks)::value, decltype(w)::value>(dy, y, rs, t0, nt, hidden, k, acc);
    });
    const float v = warp_sum_n(acc);
    if ((lane & 3) == 0) part[warp][lane >> 2] = v;
    __syncthreads();
    if (threadIdx.x < na) {
        const unsigned i = threadIdx.x / k, j = threadIdx.x % k;
        const unsigned q = i * slots_per_token(k) + j;
        float g = part[0][q];
#pragma unroll
        for (int w = 1; w < MOE_WARPS; ++w) g += part[w][q];
        dg[i][j] = g;
        d_gates[(size_t)t0 * k + threadIdx.x] = g;
    }
    __syncthreads();
    if (warp < nt) {
        const size_t o = (size_t)warp * experts;
        token_backward(lg + o, ce, tk[warp], gt[warp], dg[warp], sc + o, dsc + o,
                       d_logits + (size_t)(t0 + warp) * experts, tokens, experts, k, score_fn,
                       renormalize, z_coef);
    }
}

// `beside_previous` (block-uniform): the kernel before this one on the stream touches none of
// what this one reads or writes, so it runs beside that kernel (cuda_graph::pdl_enter_beside
// and pdl_exit_beside).
extern "C" __global__ void __launch_bounds__(MOE_BLOCK, 2)
    moe_combine_backward(const __nv_bfloat16 *dy, const __nv_bfloat16 *y, const int *row_of,
                         const float *logits, const int *topk, const float *gates,
                         const int *counts, float *d_gates, float *d_logits, unsigned tokens,
                         unsigned hidden, unsigned experts, unsigned k, unsigned rows,
                         unsigned tpb, unsigned score_fn, unsigned renormalize, float aux_coef,
                         float z_coef, unsigned beside_previous) {
    if (beside_previous) {
        cuda_graph::pdl_enter_beside();
    } else {
        cuda_graph::pdl_enter();
    }
    combine_backward_block(dy, y, row_of, logits, topk, gates, counts, d_gates, d_logits, tokens,
                           hidden, experts, k, rows, tpb, score_fn, renormalize, aux_coef,
                           z_coef);
    if (beside_previous) cuda_graph::pdl_exit_beside();
}

// The input gradient: dx[t, h] = sum_j dxp[row_of[t, j], h] (j order) + sum_e d_logits[t, e] *
// wr[e, h] (e order), f32, rounded to bf16. One block per `tpb` (<= MOE_TOKENS) tokens t0 + i
// (the last block may have fewer), so each wr[e, h] is loaded once per block and used for all
// of them from registers; dynamic shared memory MOE_TOKENS * experts floats (the tokens'
// d_logits, expert-major). unpermute_rows does the rest: W columns per thread per pass, the
// tokens' j-th rows loaded together; the per-element order is the same for W = 8 and W = 1.
extern "C" __global__ void __launch_bounds__(MOE_BLOCK, 2)
    moe_unpermute_backward(const __nv_bfloat16 *dxp, const int *row_of, const float *d_logits,
                           const float *wr, __nv_bfloat16 *dx, unsigned tokens, unsigned hidden,
                           unsigned experts, unsigned k, unsigned rows, unsigned tpb) {
    cuda_graph::pdl_enter();
    extern __shared__ __align__(16) float dl[]; // [experts][MOE_TOKENS], 0 past the last token
    __shared__ int rs[MOE_TOKENS][MOE_TOP_K];   // rows, -1 where out of range
    const unsigned t0 = blockIdx.x * tpb;
    if (t0 >= tokens) return;
    const unsigned nt = min(tpb, tokens - t0); // block-uniform
    for (unsigned q = threadIdx.x; q < MOE_TOKENS * experts; q += MOE_BLOCK) {
        const unsigned i = q / experts, e = q % experts;
        dl[e * MOE_TOKENS + i] = i < nt ? d_logits[(size_t)(t0 + i) * experts + e] : 0.0f;
    }
    for (unsigned q = threadIdx.x; q < nt * k; q += MOE_BLOCK) {
        const unsigned i = q / k, j = q % k;
        const int r = row_of[(size_t)t0 * k + q];
        rs[i][j] = r >= 0 && (unsigned)r < rows ? r : -1;
    }
    __syncthreads();
    const bool vec = hidden % 8 == 0 && aligned16(dxp) && aligned16(wr) && aligned16(dx);
    if (vec)
        unpermute_rows<8>(dxp, rs, dl, wr, dx, t0, nt, hidden, experts, k);
    else
        unpermute_rows<1>(dxp, rs, dl, wr, dx, t0, nt, hidden, experts, k);
}

// The router weight's gradient, step 1 of 2: partial[c, e, h] = sum over the tokens t of
// chunk c (chunk tokens each) of d_logits[t, e] * x[t, h]. Grid (ceil(H / MOE_WGRAD_COLS),
// chunks, ceil(E / MOE_WGRAD_EXPERTS)), dynamic shared memory chunk * MOE_WGRAD_EXPERTS floats
// (the chunk's d_logits of the block's experts). Every warp of block (b, c, g) takes the same
// 256 columns from b * 256 (8 per lane, wgrad_col: 16-byte loads when H % 8 == 0 and x,
// partial are 16-byte aligned) for experts g * 8 .. g * 8 + 7, warp w the chunk's tokens w,
// w + 8, ... (wgrad_dots); the 8 warps' sums are then added by a fixed tree in shared memory
// (warp w += warp w + n for n = 4, 2, 1) and warp 0 writes them. (At least 2 blocks per SM in
// the launch bounds: 64 sums and 8 loads per thread fit 128 registers.)
extern "C" __global__ void __launch_bounds__(MOE_BLOCK, 2)
    moe_router_wgrad_partial(const float *d_logits, const __nv_bfloat16 *x, float *partial,
                             unsigned tokens, unsigned hidden, unsigned experts, unsigned chunk) {
    cuda_graph::pdl_enter();
    extern __shared__ __align__(16) float dls[]; // [chunk][MOE_WGRAD_EXPERTS]
    __shared__ float red[MOE_WARPS / 2][MOE_WGRAD_EXPERTS * 8][32];
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned e0 = blockIdx.z * MOE_WGRAD_EXPERTS, c0 = blockIdx.x * MOE_WGRAD_COLS;
    const unsigned t0 = blockIdx.y * chunk;
    if (t0 >= tokens) return;
    const unsigned nt = min(chunk, tokens - t0);
    for (unsigned q = threadIdx.x; q < nt * MOE_WGRAD_EXPERTS; q += MOE_BLOCK) {
        const unsigned i = q / MOE_WGRAD_EXPERTS, e = e0 + q % MOE_WGRAD_EXPERTS;
        dls[q] = e < experts ? d_logits[(size_t)(t0 + i) * experts + e] : 0.0f;
    }
    __syncthreads();
    float acc[MOE_WGRAD_EXPERTS][8];
#pragma unroll
    for (int g = 0; g < MOE_WGRAD_EXPERTS; ++g)
#pragma unroll
        for (int v = 0; v < 8; ++v) acc[g][v] = 0.0f;
    const __nv_bfloat16 *xc = x + (size_t)t0 * hidden;
    const bool vec = hidden % 8 == 0 && aligned16(x) && aligned16(partial);
    if (vec)
        wgrad_dots<true>(xc, dls, nt, hidden, c0, acc);
    else
        wgrad_dots<false>(xc, dls, nt, hidden, c0, acc);
    for (unsigned n = MOE_WARPS / 2; n > 0; n >>= 1) {
        if (warp >= n && warp < 2 * n) {
#pragma unroll
            for (int g = 0; g < MOE_WGRAD_EXPERTS; ++g)
#pragma unroll
                for (int v = 0; v < 8; ++v) red[warp - n][g * 8 + v][lane] = acc[g][v];
        }
        __syncthreads();
        if (warp < n) {
#pragma unroll
            for (int g = 0; g < MOE_WGRAD_EXPERTS; ++g)
#pragma unroll
                for (int v = 0; v < 8; ++v) acc[g][v] += red[warp][g * 8 + v][lane];
        }
        __syncthreads();
    }
    if (warp != 0) return;
    float *pc = partial + (size_t)blockIdx.y * experts * hidden;
    if (vec)
        wgrad_store<true>(pc, hidden, experts, e0, c0, acc);
    else
        wgrad_store<false>(pc, hidden, experts, e0, c0, acc);
}

// Step 2 of 2: dwr[q] (+)= sum over chunks c of partial[c, q]. Four lanes per group of four
// consecutive q (one float4 when n % 4 == 0 and partial, dwr are 16-byte aligned): lane s
// sums the chunks s, s + 4, ... in order (8 loads in flight), then (s0 + s1) + (s2 + s3) by
// two xor shuffles.
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_router_wgrad_reduce(const float *partial, float *dwr, unsigned n, unsigned chunks,
                            unsigned accumulate) {
    cuda_graph::pdl_enter();
    const size_t first = (size_t)blockIdx.x * MOE_BLOCK + threadIdx.x;
    const size_t g = first / 4, groups = ((size_t)n + 3) / 4;
    // Whole warps past the end leave; the others stay whole for the shuffles.
    if ((first & ~(size_t)31) / 4 >= groups) return;
    const unsigned s = threadIdx.x & 3u;
    const bool vec = n % 4 == 0 && aligned16(partial) && aligned16(dwr);
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (g < groups) {
        if (vec) {
            const float4 *p = reinterpret_cast<const float4 *>(partial) + g;
            const size_t stride = n / 4;
            unsigned c = s;
            for (; c + 7 * 4 < chunks; c += 8 * 4) {
                float4 v[8];
#pragma unroll
                for (int u = 0; u < 8; ++u) v[u] = __ldg(p + (size_t)(c + 4 * u) * stride);
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    a[0] += v[u].x;
                    a[1] += v[u].y;
                    a[2] += v[u].z;
                    a[3] += v[u].w;
                }
            }
            for (; c < chunks; c += 4) {
                const float4 v = __ldg(p + (size_t)c * stride);
                a[0] += v.x;
                a[1] += v.y;
                a[2] += v.z;
                a[3] += v.w;
            }
        } else {
            for (unsigned c = s; c < chunks; c += 4)
#pragma unroll
                for (int v = 0; v < 4; ++v)
                    if (g * 4 + v < n) a[v] += __ldg(partial + (size_t)c * n + g * 4 + v);
        }
    }
#pragma unroll
    for (int v = 0; v < 4; ++v) {
        a[v] += __shfl_xor_sync(0xffffffffu, a[v], 1);
        a[v] += __shfl_xor_sync(0xffffffffu, a[v], 2);
    }
    if (g >= groups || s != 0) return;
    if (vec) {
        float4 *d4 = reinterpret_cast<float4 *>(dwr) + g;
        float4 r = make_float4(a[0], a[1], a[2], a[3]);
        if (accumulate) {
            const float4 o = *d4;
            r = make_float4(o.x + a[0], o.y + a[1], o.z + a[2], o.w + a[3]);
        }
        *d4 = r;
    } else {
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const size_t q = g * 4 + v;
            if (q < n) dwr[q] = accumulate ? dwr[q] + a[v] : a[v];
        }
    }
}

// Expert parallelism (src/moe/ep.rs): every rank's tokens and top-k experts are gathered on
// every rank, each rank plans and runs its own experts over all of them, and sends each
// expert output row back to the rank whose token it is, in that rank's assignment order.

// local[i] = topk[i] - first: this rank's experts numbered from 0, another rank's out of [0,
// per_rank) (the plan leaves those unplaced).
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_ep_local_experts(const int *topk, int *local, unsigned n, int first) {
    cuda_graph::pdl_enter();
    const unsigned i = blockIdx.x * MOE_BLOCK + threadIdx.x;
    if (i < n) local[i] = topk[i] - first;
}

// out[i] = rows[0][i] op rows[1][i] op ... op rows[ranks - 1][i] for i < len, `rows` the
// ranks' copies back to back (`ranks x len`), op a sum (in f32, rank order; then times
// `post`, 1 but for an average) or a max (fmaxf), bf16 elements rounded once: the same bits
// on every rank (LocalGroup's all-reduce). A grid-stride loop.
template <typename T> __device__ __forceinline__ float ep_load(const T *p, size_t i);
template <> __device__ __forceinline__ float ep_load<float>(const float *p, size_t i) {
    return p[i];
}
template <>
__device__ __forceinline__ float ep_load<__nv_bfloat16>(const __nv_bfloat16 *p, size_t i) {
    return __bfloat162float(p[i]);
}
__device__ __forceinline__ void ep_store(float *p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void ep_store(__nv_bfloat16 *p, size_t i, float v) {
    p[i] = __float2bfloat16_rn(v);
}

template <typename T>
__device__ __forceinline__ void ep_reduce_ranks(const T *rows, T *out, unsigned long long len,
                                                unsigned ranks, unsigned max_op, float post) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += stride) {
        float acc = ep_load(rows, i);
        for (unsigned r = 1; r < ranks; ++r) {
            const float v = ep_load(rows, (size_t)r * len + i);
            acc = max_op ? fmaxf(acc, v) : acc + v;
        }
        ep_store(out, i, max_op ? acc : acc * post);
    }
}

extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_ep_reduce_ranks_f32(const float *rows, float *out, unsigned long long len, unsigned ranks,
                            unsigned max_op, float post) {
    cuda_graph::pdl_enter();
    ep_reduce_ranks(rows, out, len, ranks, max_op, post);
}

extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_ep_reduce_ranks_bf16(const __nv_bfloat16 *rows, __nv_bfloat16 *out,
                             unsigned long long len, unsigned ranks, unsigned max_op, float post) {
    cuda_graph::pdl_enter();
    ep_reduce_ranks(rows, out, len, ranks, max_op, post);
}

// One bf16 row of `hidden` elements copied by a warp (16 bytes a lane per step when `vec`).
__device__ __forceinline__ void ep_copy_row(const __nv_bfloat16 *src, __nv_bfloat16 *dst,
                                            unsigned hidden, bool vec, unsigned lane) {
    if (vec) {
        for (unsigned c = lane * 8; c < hidden; c += 32 * 8)
            *reinterpret_cast<uint4 *>(dst + c) = __ldg(reinterpret_cast<const uint4 *>(src + c));
    } else {
        for (unsigned c = lane; c < hidden; c += 32) dst[c] = src[c];
    }
}

// send[i, :] = y[row_of[i], :] for the gathered assignments i < n whose expert is this
// rank's (row_of[i] inside [0, rows)); the other rows of `send` are left as they are. A warp
// per assignment.
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_ep_rows_to_sources(const __nv_bfloat16 *y, const int *row_of, __nv_bfloat16 *send,
                           unsigned n, unsigned hidden, unsigned rows) {
    cuda_graph::pdl_enter();
    const unsigned lane = threadIdx.x & 31u;
    const unsigned i = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5);
    if (i >= n) return;
    const int r = row_of[i];
    if (r < 0 || (unsigned)r >= rows) return;
    const bool vec = hidden % 8 == 0 && aligned16(y) && aligned16(send);
    ep_copy_row(y + (size_t)r * hidden, send + (size_t)i * hidden, hidden, vec, lane);
}

// y[row_of[a], :] = recv[(topk[a] / per_rank) * n + a, :] for this rank's assignments a < n:
// each row from the block of the rank holding its expert (`recv` holds `ranks` blocks of n
// rows). A warp per assignment; rows outside [0, rows) and experts outside [0, ranks *
// per_rank) are skipped.
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_ep_rows_from_owners(const __nv_bfloat16 *recv, const int *topk, const int *row_of,
                            __nv_bfloat16 *y, unsigned n, unsigned hidden, unsigned rows,
                            unsigned per_rank, unsigned ranks) {
    cuda_graph::pdl_enter();
    const unsigned lane = threadIdx.x & 31u;
    const unsigned a = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5);
    if (a >= n) return;
    const int r = row_of[a], e = topk[a];
    if (r < 0 || (unsigned)r >= rows || e < 0 || (unsigned)e >= ranks * per_rank) return;
    const unsigned owner = (unsigned)e / per_rank;
    const bool vec = hidden % 8 == 0 && aligned16(recv) && aligned16(y);
    ep_copy_row(recv + ((size_t)owner * n + a) * hidden, y + (size_t)r * hidden, hidden, vec, lane);
}

// The exact-size exchange (breaking-layer, ExpertGemm::PerExpert): each source's rows of this
// rank's experts [first, first + per_rank) in the source's own packed order, the sources'
// blocks back to back, so that the source receives them straight into its packed layout.
// For the gathered assignments i = s * n + a whose expert is this rank's (local_row_of[i]
// inside [0, rows_in)): send[base(s) + row_of_all[i] - offsets_all[s][first], :] =
// rows[local_row_of[i], :], base(s) = sum over s' < s of offsets_all[s'][first + per_rank] -
// offsets_all[s'][first] (offsets_all: `ranks` rows of experts + 1). The sources' padding
// rows are left as they are. A warp per assignment.
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_ep_rows_to_sources_exact(const __nv_bfloat16 *rows, const int *local_row_of,
                                 const int *row_of_all, const int *offsets_all,
                                 __nv_bfloat16 *send, unsigned n, unsigned ranks,
                                 unsigned hidden, unsigned rows_in, unsigned send_rows,
                                 unsigned experts, unsigned first, unsigned per_rank) {
    cuda_graph::pdl_enter();
    const unsigned lane = threadIdx.x & 31u;
    const unsigned i = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5);
    if (i >= n * ranks) return;
    const int r = local_row_of[i];
    if (r < 0 || (unsigned)r >= rows_in) return;
    const unsigned s = i / n;
    long long base = 0;
    for (unsigned q = 0; q < s; ++q) {
        const int *o = offsets_all + (size_t)q * (experts + 1);
        base += o[first + per_rank] - o[first];
    }
    const long long dst = base + row_of_all[i] - offsets_all[(size_t)s * (experts + 1) + first];
    if (dst < 0 || dst >= (long long)send_rows) return;
    const bool vec = hidden % 8 == 0 && aligned16(rows) && aligned16(send);
    ep_copy_row(rows + (size_t)r * hidden, send + (size_t)dst * hidden, hidden, vec, lane);
}
