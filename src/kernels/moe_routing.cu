// Kernels of the dropless top-k MoE layer around its expert GEMMs (src/moe/routing.rs):
// router, top-k and gates, the dispatch plan into the packed expert-major layout, the
// auxiliary losses, the combine, and the backward of each.
//
// Deterministic: every floating-point sum has a fixed order (sequential loops, fixed shuffle
// trees and one fixed shared-memory tree), the dispatch keeps token order, and the only
// atomics are integer counts in shared memory (their result does not depend on the order). No
// kernel synchronises with the host or reads the routing back: everything data-dependent
// stays on the device, so the kernels replay in CUDA graphs as the routing changes.
#include <cuda_bf16.h>
#include <cuda_graph/pdl.cuh>

#define MOE_BLOCK 256
#define MOE_WARPS (MOE_BLOCK / 32)
// Tokens per block of the router forward and the input gradient (one per warp in the former).
#define MOE_TOKENS MOE_WARPS
// Threads of the single block of the auxiliary losses (`LOSSES_BLOCK` in routing.rs).
#define MOE_LOSSES_BLOCK 1024
// Experts per block (held in registers per thread) of the router weight gradient.
#define MOE_WGRAD_EXPERTS 8

namespace {

// Sum over the warp by a fixed xor tree: the same order on every run.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
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

// Whether a pointer allows 16-byte vector accesses. The vector paths below also need rows a
// multiple of 8 bf16 (16 bytes) apart, so every row start is aligned when the base is.
__device__ __forceinline__ bool aligned16(const void *p) {
    return (reinterpret_cast<size_t>(p) & 15) == 0;
}

// Eight bf16 (one 16-byte load) as floats (exact).
__device__ __forceinline__ void bf16x8_to_f32(const uint4 &u, float *f) {
    const __nv_bfloat162 *b = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 v = __bfloat1622float2(b[i]);
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
    }
}

__device__ __forceinline__ uint4 load16(const __nv_bfloat16 *p) {
    return __ldg(reinterpret_cast<const uint4 *>(p));
}

// Eight floats rounded to bf16 (to nearest even, as __float2bfloat16_rn), one 16-byte store.
__device__ __forceinline__ void store_bf16x8(__nv_bfloat16 *p, const float *f) {
    uint4 u;
    __nv_bfloat162 *b = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) b[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    *reinterpret_cast<uint4 *>(p) = u;
}

// Eight floats from two 16-byte loads.
__device__ __forceinline__ void load_f32x8(const float *p, float *f) {
    const float4 a = __ldg(reinterpret_cast<const float4 *>(p));
    const float4 b = __ldg(reinterpret_cast<const float4 *>(p) + 1);
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
    f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

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

} // namespace

// Router forward, one block of MOE_BLOCK threads per MOE_TOKENS tokens t0 + i (the last block
// may have fewer), dynamic shared memory 2 * MOE_TOKENS * experts floats.
//   logits[t, e] = sum_h x[t, h] * wr[e, h]   (warp w takes experts w, w + 8, ... for all the
//                  block's tokens, so each wr[e, h] is loaded once per block; when hidden % 8
//                  == 0 and x, wr are 16-byte aligned, lane l sums the 8-element groups
//                  h = 8 (l + 32 n) .. + 7 for n = 0, 1, ... in order (16-byte loads), else h =
//                  l, l + 32, ... in order; then a fixed xor tree)
// then warp i finishes token t0 + i:
//   score: softmax (score_fn 0) or sigmoid (1) of the logits;
//   probs[t, e]  = the per-token distribution the aux loss uses: softmax, or the sigmoid
//                  scores divided by their sum;
//   topk[t, j]   = the j-th largest score (ties to the lower expert);
//   gates[t, j]  = softmax: score (divided by the sum of the k chosen scores if renormalize);
//                  sigmoid: score / sum of the k chosen scores;
//   lse[t]       = logsumexp of the logits (for the z-loss).
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_router_forward(const __nv_bfloat16 *x, const float *wr, float *logits, float *probs,
                       int *topk, float *gates, float *lse, unsigned tokens, unsigned hidden,
                       unsigned experts, unsigned k, unsigned score_fn, unsigned renormalize) {
    cuda_graph::pdl_enter();
    extern __shared__ float sh[]; // l: [MOE_TOKENS][experts] logits, then s: the scores
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned t0 = blockIdx.x * MOE_TOKENS;
    if (t0 >= tokens) return;
    const unsigned nt = min((unsigned)MOE_TOKENS, tokens - t0); // block-uniform
    const __nv_bfloat16 *xb = x + (size_t)t0 * hidden;
    const bool vec = hidden % 8 == 0 && aligned16(x) && aligned16(wr);
    for (unsigned e = warp; e < experts; e += MOE_WARPS) {
        const float *w = wr + (size_t)e * hidden;
        float acc[MOE_TOKENS];
#pragma unroll
        for (int i = 0; i < MOE_TOKENS; ++i) acc[i] = 0.0f;
        // Past the last token (the last block) the loads repeat its row (all loads
        // unconditional, in flight together); those sums are dropped.
        if (vec) {
            for (unsigned h = lane * 8; h < hidden; h += 32 * 8) {
                float wv[8];
                load_f32x8(w + h, wv);
                uint4 xr[MOE_TOKENS];
#pragma unroll
                for (int i = 0; i < MOE_TOKENS; ++i)
                    xr[i] = load16(xb + (size_t)min((unsigned)i, nt - 1) * hidden + h);
#pragma unroll
                for (int i = 0; i < MOE_TOKENS; ++i) {
                    float xv[8];
                    bf16x8_to_f32(xr[i], xv);
#pragma unroll
                    for (int v = 0; v < 8; ++v) acc[i] = fmaf(xv[v], wv[v], acc[i]);
                }
            }
        } else {
            for (unsigned h = lane; h < hidden; h += 32) {
                const float wv = w[h];
                __nv_bfloat16 xr[MOE_TOKENS];
#pragma unroll
                for (int i = 0; i < MOE_TOKENS; ++i)
                    xr[i] = xb[(size_t)min((unsigned)i, nt - 1) * hidden + h];
#pragma unroll
                for (int i = 0; i < MOE_TOKENS; ++i)
                    acc[i] = fmaf(__bfloat162float(xr[i]), wv, acc[i]);
            }
        }
#pragma unroll
        for (int i = 0; i < MOE_TOKENS; ++i) {
            if ((unsigned)i >= nt) continue;
            const float v = warp_sum(acc[i]);
            if (lane == 0) sh[(size_t)i * experts + e] = v;
        }
    }
    __syncthreads();
    if (warp >= nt) return;
    const unsigned t = t0 + warp;
    float *l = sh + (size_t)warp * experts, *s = sh + (size_t)(MOE_TOKENS + warp) * experts;
    float m = -INFINITY;
    for (unsigned e = lane; e < experts; e += 32) m = fmaxf(m, l[e]);
    m = warp_max(m);
    float z = 0.0f;
    for (unsigned e = lane; e < experts; e += 32) z += expf(l[e] - m);
    z = warp_sum(z);
    float q = 0.0f; // sum of the sigmoid scores
    for (unsigned e = lane; e < experts; e += 32) {
        const float v = score_fn == 0 ? expf(l[e] - m) / z : sigmoidf(l[e]);
        s[e] = v;
        q += v;
    }
    q = warp_sum(q);
    float *lr = logits + (size_t)t * experts, *pr = probs + (size_t)t * experts;
    for (unsigned e = lane; e < experts; e += 32) {
        lr[e] = l[e];
        pr[e] = score_fn == 0 ? s[e] : s[e] / q;
    }
    if (lane == 0) lse[t] = m + logf(z);
    __syncwarp();
    int chosen[8];
    float chosen_v[8];
    warp_topk(s, experts, k, chosen, chosen_v);
    if (lane == 0) {
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

// Step 2 of 3, one block: per expert, an exclusive scan of the block counts in block order
// (block_counts becomes each block's base within the expert), counts[e] = the total; then
// offsets[0] = 0, offsets[e + 1] = offsets[e] + counts[e] rounded up to `align`.
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_plan_scan(int *block_counts, int *counts, int *offsets, unsigned blocks, unsigned experts,
                  unsigned align) {
    cuda_graph::pdl_enter();
    for (unsigned e = threadIdx.x; e < experts; e += MOE_BLOCK) {
        int run = 0;
        for (unsigned c = 0; c < blocks; ++c) {
            const size_t q = (size_t)c * experts + e;
            const int n = block_counts[q];
            block_counts[q] = run;
            run += n;
        }
        counts[e] = run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int off = 0;
        offsets[0] = 0;
        for (unsigned e = 0; e < experts; ++e) {
            const int c = counts[e];
            off += (int)(((unsigned)c + align - 1) / align * align);
            offsets[e + 1] = off;
        }
    }
}

// Step 3 of 3, the same blocks as step 1. Assignment i of expert e goes to row
//   offsets[e] + (its block's base within e) + (earlier assignments of e in its block),
// the last term from warp match masks and per-warp counts: token order within each expert.
// row_of[i] = that row (-1 for an expert out of range); token_of_row[row] = i (the launcher
// fills token_of_row with -1 first, so padding rows stay -1). Dynamic shared memory:
// MOE_WARPS * experts ints.
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_plan_assign(const int *topk, const int *block_base, const int *offsets, int *row_of,
                    int *token_of_row, unsigned assignments, unsigned experts) {
    cuda_graph::pdl_enter();
    extern __shared__ int warp_counts[]; // [MOE_WARPS][experts]
    for (unsigned q = threadIdx.x; q < MOE_WARPS * experts; q += MOE_BLOCK) warp_counts[q] = 0;
    __syncthreads();
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned i = blockIdx.x * MOE_BLOCK + threadIdx.x;
    int e = i < assignments ? topk[i] : -1;
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
    const int row = offsets[e] + block_base[(size_t)blockIdx.x * experts + e] + before + (int)rank;
    row_of[i] = row;
    token_of_row[row] = (int)i;
}

// The auxiliary losses, one block of MOE_LOSSES_BLOCK threads:
//   aux = aux_coef * E * sum_e f_e * P_e, f_e = counts[e] / (T * k), P_e = (1/T) sum_t probs[t, e]
//   z   = z_coef * (1/T) * sum_t lse[t]^2
// losses[0] = aux, losses[1] = z. probs is read as rows of `cols` vectors (float4 when E % 4 ==
// 0 and probs is 16-byte aligned, else floats): thread g * cols + c (g < groups =
// MOE_LOSSES_BLOCK / cols) sums vector c of the rows t = g, g + groups, ... in order; the
// groups' sums are then added by a fixed pairwise tree (group g += group g + ceil(n / 2) while
// n > 1 groups remain), the experts' terms by a lane-strided sum and a fixed xor tree. The
// z-loss: thread-strided sums in order, then fixed xor trees. (At least 1 block per SM in the
// launch bounds lets ptxas keep the eight loads in flight.)
extern "C" __global__ void __launch_bounds__(MOE_LOSSES_BLOCK, 1)
    moe_router_losses(const float *probs, const float *lse, const int *counts, float *losses,
                      unsigned tokens, unsigned experts, unsigned k, float aux_coef, float z_coef) {
    cuda_graph::pdl_enter();
    // [groups][experts] per-group sums: groups * experts <= 4 * MOE_LOSSES_BLOCK (float4
    // vectors) or MOE_LOSSES_BLOCK (floats), as cols <= experts <= 512.
    __shared__ __align__(16) float red[4 * MOE_LOSSES_BLOCK];
    __shared__ float zw[MOE_LOSSES_BLOCK / 32];
    const unsigned tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    const bool vec = experts % 4 == 0 && aligned16(probs);
    const unsigned cols = vec ? experts / 4 : experts;
    const unsigned groups = MOE_LOSSES_BLOCK / cols;
    const unsigned g = tid / cols, c = tid % cols;
    if (g < groups) {
        // Eight loads in flight, then their sums in t order.
        unsigned t = g;
        if (vec) {
            const float4 *p4 = reinterpret_cast<const float4 *>(probs);
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (; t + 7 * groups < tokens; t += 8 * groups) {
                float4 v[8];
#pragma unroll
                for (int u = 0; u < 8; ++u) v[u] = __ldg(p4 + (size_t)(t + u * groups) * cols + c);
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    acc.x += v[u].x;
                    acc.y += v[u].y;
                    acc.z += v[u].z;
                    acc.w += v[u].w;
                }
            }
            for (; t < tokens; t += groups) {
                const float4 v = __ldg(p4 + (size_t)t * cols + c);
                acc.x += v.x;
                acc.y += v.y;
                acc.z += v.z;
                acc.w += v.w;
            }
            reinterpret_cast<float4 *>(red)[g * cols + c] = acc;
        } else {
            float acc = 0.0f;
            for (; t + 7 * groups < tokens; t += 8 * groups) {
                float v[8];
#pragma unroll
                for (int u = 0; u < 8; ++u) v[u] = __ldg(probs + (size_t)(t + u * groups) * cols + c);
#pragma unroll
                for (int u = 0; u < 8; ++u) acc += v[u];
            }
            for (; t < tokens; t += groups) acc += __ldg(probs + (size_t)t * cols + c);
            red[g * experts + c] = acc;
        }
    }
    float z = 0.0f;
    for (unsigned t = tid; t < tokens; t += MOE_LOSSES_BLOCK) z += lse[t] * lse[t];
    z = warp_sum(z);
    if (lane == 0) zw[warp] = z;
    __syncthreads();
    for (unsigned n = groups; n > 1;) {
        const unsigned half = (n + 1) / 2;
        for (unsigned q = tid; q < (n - half) * experts; q += MOE_LOSSES_BLOCK)
            red[q] += red[q + half * experts];
        __syncthreads();
        n = half;
    }
    if (warp != 0) return;
    float aux = 0.0f;
    for (unsigned e = lane; e < experts; e += 32) {
        const float f = (float)counts[e] / ((float)tokens * (float)k);
        aux += f * (red[e] / (float)tokens);
    }
    aux = warp_sum(aux);
    static_assert(MOE_LOSSES_BLOCK / 32 == 32, "one warp sums the per-warp z sums");
    z = warp_sum(zw[lane]);
    if (lane == 0) {
        losses[0] = aux_coef * (float)experts * aux;
        losses[1] = z_coef * z / (float)tokens;
    }
}

// Combine: out[t, :] = sum_j gates[t, j] * y[row_of[t, j], :] in j order (f32), rounded to
// bf16. One block per token; a negative row contributes nothing. Each thread takes 8
// consecutive h (16-byte loads and stores) when hidden % 8 == 0 and y, out are 16-byte
// aligned, else single h.
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_combine_forward(const __nv_bfloat16 *y, const int *row_of, const float *gates,
                        __nv_bfloat16 *out, unsigned tokens, unsigned hidden, unsigned k,
                        unsigned rows) {
    cuda_graph::pdl_enter();
    __shared__ int rs[8]; // the token's rows, -1 where out of range (k <= 8)
    __shared__ float gs[8];
    const unsigned t = blockIdx.x;
    if (t >= tokens) return;
    if (threadIdx.x < k) {
        const int r = row_of[(size_t)t * k + threadIdx.x];
        rs[threadIdx.x] = r >= 0 && (unsigned)r < rows ? r : -1;
        gs[threadIdx.x] = gates[(size_t)t * k + threadIdx.x];
    }
    __syncthreads();
    __nv_bfloat16 *o = out + (size_t)t * hidden;
    if (hidden % 8 == 0 && aligned16(y) && aligned16(out)) {
        for (unsigned h = threadIdx.x * 8; h < hidden; h += MOE_BLOCK * 8) {
            uint4 yv[8]; // all k rows' loads in flight first
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if ((unsigned)j < k && rs[j] >= 0) yv[j] = load16(y + (size_t)rs[j] * hidden + h);
            float acc[8];
#pragma unroll
            for (int v = 0; v < 8; ++v) acc[v] = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if ((unsigned)j >= k || rs[j] < 0) continue;
                float f[8];
                bf16x8_to_f32(yv[j], f);
#pragma unroll
                for (int v = 0; v < 8; ++v) acc[v] = fmaf(gs[j], f[v], acc[v]);
            }
            store_bf16x8(o + h, acc);
        }
    } else {
        for (unsigned h = threadIdx.x; h < hidden; h += MOE_BLOCK) {
            float acc = 0.0f;
            for (unsigned j = 0; j < k; ++j)
                if (rs[j] >= 0) acc = fmaf(gs[j], __bfloat162float(y[(size_t)rs[j] * hidden + h]), acc);
            o[h] = __float2bfloat16_rn(acc);
        }
    }
}

// The gates' gradient: d_gates[i] = sum_h dy[t, h] * y[row_of[i], h] for each assignment i =
// t * k + j, one warp per assignment (blocks of MOE_WARPS assignments); 0 for a negative row.
// When hidden % 8 == 0 and dy, y are 16-byte aligned, lane l sums the 8-element groups h =
// 8 (l + 32 n) .. + 7 for n = 0, 1, ... in order (16-byte loads), else h = l, l + 32, ... in
// order; then a fixed xor tree.
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_combine_backward_gates(const __nv_bfloat16 *dy, const __nv_bfloat16 *y, const int *row_of,
                               float *d_gates, unsigned tokens, unsigned hidden, unsigned k,
                               unsigned rows) {
    cuda_graph::pdl_enter();
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const size_t i = (size_t)blockIdx.x * MOE_WARPS + warp;
    if (i >= (size_t)tokens * k) return;
    const size_t t = i / k;
    const int r = row_of[i];
    float acc = 0.0f;
    if (r >= 0 && (unsigned)r < rows) {
        const __nv_bfloat16 *dr = dy + t * hidden, *yr = y + (size_t)r * hidden;
        if (hidden % 8 == 0 && aligned16(dy) && aligned16(y)) {
            // Batches of 4 groups per lane: their loads in flight together, then the sums in
            // h order.
            for (unsigned h0 = lane * 8; h0 < hidden; h0 += 4 * 32 * 8) {
                uint4 a[4], b[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const unsigned h = h0 + u * 32 * 8;
                    if (h < hidden) {
                        a[u] = load16(dr + h);
                        b[u] = load16(yr + h);
                    }
                }
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    if (h0 + u * 32 * 8 >= hidden) break;
                    float af[8], bf[8];
                    bf16x8_to_f32(a[u], af);
                    bf16x8_to_f32(b[u], bf);
#pragma unroll
                    for (int v = 0; v < 8; ++v) acc = fmaf(af[v], bf[v], acc);
                }
            }
        } else {
            for (unsigned h = lane; h < hidden; h += 32)
                acc = fmaf(__bfloat162float(dr[h]), __bfloat162float(yr[h]), acc);
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) d_gates[i] = acc;
}

// Router backward, one warp per token (blocks of MOE_BLOCK threads = MOE_WARPS tokens),
// dynamic shared memory MOE_WARPS * 2 * experts floats. From the saved logits, top-k and
// gates, the gates' gradient and the expert counts:
//   through the gates:  softmax without renormalisation: d s_e = sum_j [e_j = e] dg_j;
//                       renormalised (sigmoid always): d s_{e_i} = (dg_i - sum_j dg_j g_j) / S,
//                       S = sum of the chosen scores;
//   the aux loss:       c_e = aux_coef * E * f_e / T on p[t, e]: softmax p = s, so d s_e += c_e;
//                       sigmoid p = s / Q, so d s_e += (c_e - sum_e' c_e' p_e') / Q;
//   to the logits:      softmax d l_e = s_e (d s_e - sum_e' d s_e' s_e');
//                       sigmoid d l_e = d s_e s_e (1 - s_e);
//   the z-loss:         d l_e += z_coef * (2 / T) * lse * softmax(l)_e.
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_router_backward(const float *logits, const int *topk, const float *gates,
                        const float *d_gates, const int *counts, float *d_logits, unsigned tokens,
                        unsigned experts, unsigned k, unsigned score_fn, unsigned renormalize,
                        float aux_coef, float z_coef) {
    cuda_graph::pdl_enter();
    extern __shared__ float sh[];
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned t = blockIdx.x * MOE_WARPS + warp;
    if (t >= tokens) return;
    float *s = sh + (size_t)warp * 2 * experts, *ds = s + experts;
    const float *l = logits + (size_t)t * experts;
    float m = -INFINITY;
    for (unsigned e = lane; e < experts; e += 32) m = fmaxf(m, l[e]);
    m = warp_max(m);
    float z = 0.0f;
    for (unsigned e = lane; e < experts; e += 32) z += expf(l[e] - m);
    z = warp_sum(z);
    const float lse = m + logf(z);
    float q = 0.0f;
    for (unsigned e = lane; e < experts; e += 32) {
        const float v = score_fn == 0 ? expf(l[e] - m) / z : sigmoidf(l[e]);
        s[e] = v;
        q += v;
    }
    q = warp_sum(q);
    const float inv_tk = 1.0f / ((float)tokens * (float)k);
    const float aux_scale = aux_coef * (float)experts / (float)tokens;
    // The aux loss's gradient on the scores; for sigmoid its mean over p needs a sum first.
    float cp = 0.0f;
    for (unsigned e = lane; e < experts; e += 32) {
        const float c = aux_scale * (float)counts[e] * inv_tk;
        ds[e] = c;
        cp += c * (s[e] / q);
    }
    cp = warp_sum(cp);
    if (score_fn != 0)
        for (unsigned e = lane; e < experts; e += 32) ds[e] = (ds[e] - cp) / q;
    __syncwarp();
    // Through the gates (lane 0: k <= 8 terms, in j order).
    if (lane == 0) {
        const int *tk = topk + (size_t)t * k;
        const float *g = gates + (size_t)t * k, *dg = d_gates + (size_t)t * k;
        const bool norm = score_fn != 0 || renormalize != 0;
        float sum = 0.0f, dot = 0.0f;
        for (unsigned j = 0; j < k; ++j) {
            const int e = tk[j];
            if (e >= 0 && (unsigned)e < experts) sum += s[e];
            dot += dg[j] * g[j];
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
    float *dl = d_logits + (size_t)t * experts;
    for (unsigned e = lane; e < experts; e += 32) {
        const float sm = expf(l[e] - m) / z;
        const float v = score_fn == 0 ? s[e] * (ds[e] - sds) : ds[e] * s[e] * (1.0f - s[e]);
        dl[e] = v + zc * sm;
    }
}

// The input gradient: dx[t, h] = sum_j dxp[row_of[t, j], h] (j order) + sum_e d_logits[t, e] *
// wr[e, h] (e order), f32, rounded to bf16. One block per MOE_TOKENS tokens t0 + i (the last
// block may have fewer), so each wr[e, h] is loaded once per block and used for all of them
// from registers; dynamic shared memory MOE_TOKENS * experts floats (the tokens' d_logits,
// expert-major). Each thread takes 8 consecutive h (16-byte loads and stores) when hidden % 8
// == 0 and dxp, wr, dx are 16-byte aligned, else single h; the per-element order is the same
// either way.
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_unpermute_backward(const __nv_bfloat16 *dxp, const int *row_of, const float *d_logits,
                           const float *wr, __nv_bfloat16 *dx, unsigned tokens, unsigned hidden,
                           unsigned experts, unsigned k, unsigned rows) {
    cuda_graph::pdl_enter();
    extern __shared__ __align__(16) float dl[]; // [experts][MOE_TOKENS], 0 past the last token
    __shared__ int rs[MOE_TOKENS][8];           // rows, -1 where out of range (k <= 8)
    const unsigned t0 = blockIdx.x * MOE_TOKENS;
    if (t0 >= tokens) return;
    const unsigned nt = min((unsigned)MOE_TOKENS, tokens - t0); // block-uniform
    for (unsigned q = threadIdx.x; q < MOE_TOKENS * experts; q += MOE_BLOCK) {
        const unsigned i = q / experts, e = q % experts;
        dl[e * MOE_TOKENS + i] = i < nt ? d_logits[(size_t)(t0 + i) * experts + e] : 0.0f;
    }
    for (unsigned q = threadIdx.x; q < MOE_TOKENS * k; q += MOE_BLOCK) {
        const unsigned i = q / k, j = q % k;
        const int r = i < nt ? row_of[(size_t)(t0 + i) * k + j] : -1;
        rs[i][j] = r >= 0 && (unsigned)r < rows ? r : -1;
    }
    __syncthreads();
    const float4 *dl4 = reinterpret_cast<const float4 *>(dl);
    static_assert(MOE_TOKENS == 8, "d_logits of one expert: two float4");
    if (hidden % 8 == 0 && aligned16(dxp) && aligned16(wr) && aligned16(dx)) {
        for (unsigned h = threadIdx.x * 8; h < hidden; h += MOE_BLOCK * 8) {
            float acc[MOE_TOKENS][8];
#pragma unroll
            for (int i = 0; i < MOE_TOKENS; ++i)
#pragma unroll
                for (int v = 0; v < 8; ++v) acc[i][v] = 0.0f;
            // j outer, tokens inner: the tokens' loads in flight together, each element's
            // terms still in j order.
            // A negative row loads row 0 (the capacity is at least 1 row) and adds nothing.
            for (unsigned j = 0; j < k; ++j) {
                uint4 raw[MOE_TOKENS];
#pragma unroll
                for (int i = 0; i < MOE_TOKENS; ++i)
                    raw[i] = load16(dxp + (size_t)max(rs[i][j], 0) * hidden + h);
#pragma unroll
                for (int i = 0; i < MOE_TOKENS; ++i) {
                    if (rs[i][j] < 0) continue;
                    float f[8];
                    bf16x8_to_f32(raw[i], f);
#pragma unroll
                    for (int v = 0; v < 8; ++v) acc[i][v] += f[v];
                }
            }
#pragma unroll 4
            for (unsigned e = 0; e < experts; ++e) {
                float w[8];
                load_f32x8(wr + (size_t)e * hidden + h, w);
                const float4 da = dl4[2 * e], db = dl4[2 * e + 1];
                const float d[MOE_TOKENS] = {da.x, da.y, da.z, da.w, db.x, db.y, db.z, db.w};
#pragma unroll
                for (int i = 0; i < MOE_TOKENS; ++i)
#pragma unroll
                    for (int v = 0; v < 8; ++v) acc[i][v] = fmaf(d[i], w[v], acc[i][v]);
            }
#pragma unroll
            for (int i = 0; i < MOE_TOKENS; ++i)
                if ((unsigned)i < nt) store_bf16x8(dx + (size_t)(t0 + i) * hidden + h, acc[i]);
        }
    } else {
        for (unsigned h = threadIdx.x; h < hidden; h += MOE_BLOCK) {
            float acc[MOE_TOKENS];
#pragma unroll
            for (int i = 0; i < MOE_TOKENS; ++i) {
                acc[i] = 0.0f;
                if ((unsigned)i >= nt) continue;
                for (unsigned j = 0; j < k; ++j) {
                    const int r = rs[i][j];
                    if (r >= 0) acc[i] += __bfloat162float(dxp[(size_t)r * hidden + h]);
                }
            }
            for (unsigned e = 0; e < experts; ++e) {
                const float w = wr[(size_t)e * hidden + h];
#pragma unroll
                for (int i = 0; i < MOE_TOKENS; ++i) acc[i] = fmaf(dl[e * MOE_TOKENS + i], w, acc[i]);
            }
#pragma unroll
            for (int i = 0; i < MOE_TOKENS; ++i)
                if ((unsigned)i < nt) dx[(size_t)(t0 + i) * hidden + h] = __float2bfloat16_rn(acc[i]);
        }
    }
}

// The router weight's gradient, step 1 of 2: partial[c, e, h] = sum over the tokens t of
// chunk c (chunk tokens each, in order) of d_logits[t, e] * x[t, h]. Grid (ceil(ceil(H / 2) /
// MOE_BLOCK), chunks, ceil(E / MOE_WGRAD_EXPERTS)), dynamic shared memory chunk *
// MOE_WGRAD_EXPERTS floats (the chunk's d_logits of the block's experts). Thread p of block
// (b, c, g) takes h = 2 (b * MOE_BLOCK + p) and h + 1 for experts g * MOE_WGRAD_EXPERTS + (0 ..
// MOE_WGRAD_EXPERTS), so each x[t, h] is loaded once per group of experts (one 4-byte load of
// the pair when hidden is even and x 4-byte aligned, else two 2-byte loads). (At least 1 block
// per SM in the launch bounds lets ptxas keep a batch's 16 loads in flight.)
extern "C" __global__ void __launch_bounds__(MOE_BLOCK, 1)
    moe_router_wgrad_partial(const float *d_logits, const __nv_bfloat16 *x, float *partial,
                             unsigned tokens, unsigned hidden, unsigned experts, unsigned chunk) {
    cuda_graph::pdl_enter();
    extern __shared__ __align__(16) float dls[]; // [chunk][MOE_WGRAD_EXPERTS]
    static_assert(MOE_WGRAD_EXPERTS == 8, "one token's d_logits: two float4");
    const unsigned e0 = blockIdx.z * MOE_WGRAD_EXPERTS;
    const unsigned t0 = blockIdx.y * chunk;
    if (t0 >= tokens) return;
    const unsigned nt = min(chunk, tokens - t0);
    for (unsigned q = threadIdx.x; q < nt * MOE_WGRAD_EXPERTS; q += MOE_BLOCK) {
        const unsigned i = q / MOE_WGRAD_EXPERTS, e = e0 + q % MOE_WGRAD_EXPERTS;
        dls[q] = e < experts ? d_logits[(size_t)(t0 + i) * experts + e] : 0.0f;
    }
    __syncthreads();
    const unsigned h = 2 * (blockIdx.x * MOE_BLOCK + threadIdx.x);
    if (h >= hidden) return;
    const bool pair = h + 1 < hidden;
    const __nv_bfloat16 *xp = x + (size_t)t0 * hidden + h;
    const float4 *d4 = reinterpret_cast<const float4 *>(dls);
    float a0[MOE_WGRAD_EXPERTS], a1[MOE_WGRAD_EXPERTS];
#pragma unroll
    for (int g = 0; g < MOE_WGRAD_EXPERTS; ++g) a0[g] = a1[g] = 0.0f;
    const bool vec = hidden % 2 == 0 && (reinterpret_cast<size_t>(x) & 3) == 0;
    const auto load = [&](unsigned i) {
        const __nv_bfloat16 *xi = xp + (size_t)i * hidden;
        if (vec) return *reinterpret_cast<const __nv_bfloat162 *>(xi);
        __nv_bfloat162 v;
        v.x = xi[0];
        v.y = pair ? xi[1] : __float2bfloat16_rn(0.0f);
        return v;
    };
    const auto step = [&](unsigned i, __nv_bfloat162 xv) {
        const float2 xf = __bfloat1622float2(xv);
        const float4 da = d4[2 * i], db = d4[2 * i + 1];
        const float d[MOE_WGRAD_EXPERTS] = {da.x, da.y, da.z, da.w, db.x, db.y, db.z, db.w};
#pragma unroll
        for (int g = 0; g < MOE_WGRAD_EXPERTS; ++g) {
            a0[g] = fmaf(d[g], xf.x, a0[g]);
            a1[g] = fmaf(d[g], xf.y, a1[g]);
        }
    };
    // Batches of 16 tokens: their x loads in flight together, then the sums in token order.
    unsigned i0 = 0;
    for (; i0 + 16 <= nt; i0 += 16) {
        __nv_bfloat162 xv[16];
#pragma unroll
        for (int u = 0; u < 16; ++u) xv[u] = load(i0 + u);
#pragma unroll
        for (int u = 0; u < 16; ++u) step(i0 + u, xv[u]);
    }
    for (; i0 < nt; ++i0) step(i0, load(i0));
    float *pc = partial + (size_t)blockIdx.y * experts * hidden;
#pragma unroll
    for (int g = 0; g < MOE_WGRAD_EXPERTS; ++g) {
        const unsigned e = e0 + g;
        if (e >= experts) break;
        pc[(size_t)e * hidden + h] = a0[g];
        if (pair) pc[(size_t)e * hidden + h + 1] = a1[g];
    }
}

// Step 2 of 2: dwr[e, h] (+)= sum over chunks c in order of partial[c, e, h].
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_router_wgrad_reduce(const float *partial, float *dwr, unsigned n, unsigned chunks,
                            unsigned accumulate) {
    cuda_graph::pdl_enter();
    const size_t q = (size_t)blockIdx.x * MOE_BLOCK + threadIdx.x;
    if (q >= n) return;
    float acc = 0.0f;
    for (unsigned c = 0; c < chunks; ++c) acc += partial[(size_t)c * n + q];
    dwr[q] = accumulate ? dwr[q] + acc : acc;
}
