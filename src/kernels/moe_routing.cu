// Kernels of the dropless top-k MoE layer around its expert GEMMs (src/moe/routing.rs):
// router, top-k and gates, the dispatch plan into the packed expert-major layout, the
// auxiliary losses, the combine, and the backward of each.
//
// Deterministic: every floating-point sum has a fixed order (sequential loops and fixed
// shuffle trees), the dispatch keeps token order, and the only atomics are integer counts in
// shared memory (their result does not depend on the order). No kernel synchronises with the
// host or reads the routing back: everything data-dependent stays on the device, so the
// kernels replay in CUDA graphs as the routing changes.
#include <cuda_bf16.h>
#include <cuda_graph/pdl.cuh>

#define MOE_BLOCK 256
#define MOE_WARPS (MOE_BLOCK / 32)

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

// Top-k over s[0..experts) by one warp: k rounds of a warp argmax (larger score, ties to the
// lower expert), each excluding the experts chosen before. `chosen` (k entries, shared) gets
// the experts in descending score order.
__device__ void warp_topk(const float *s, unsigned experts, unsigned k, int *chosen) {
    const unsigned lane = threadIdx.x & 31u;
    for (unsigned j = 0; j < k; ++j) {
        float v = 0.0f;
        int i = -1;
        for (unsigned e = lane; e < experts; e += 32) {
            bool taken = false;
            for (unsigned q = 0; q < j; ++q) taken |= chosen[q] == (int)e;
            if (!taken) better(v, i, s[e], (int)e);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
            const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
            better(v, i, v2, i2);
        }
        if (lane == 0) chosen[j] = i;
        __syncwarp();
    }
}

} // namespace

// Router forward, one block of MOE_BLOCK threads per token t, dynamic shared memory
// 2 * experts floats.
//   logits[t, e] = sum_h x[t, h] * wr[e, h]   (warp w takes experts w, w + 8, ...; lane l sums
//                  h = l, l + 32, ... in order; then a fixed xor tree)
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
    extern __shared__ float sh[];
    float *l = sh, *s = sh + experts;
    __shared__ int chosen[8];
    const unsigned t = blockIdx.x, lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (t >= tokens) return;
    const __nv_bfloat16 *xr = x + (size_t)t * hidden;
    for (unsigned e = warp; e < experts; e += MOE_WARPS) {
        const float *w = wr + (size_t)e * hidden;
        float acc = 0.0f;
        for (unsigned h = lane; h < hidden; h += 32) acc = fmaf(__bfloat162float(xr[h]), w[h], acc);
        acc = warp_sum(acc);
        if (lane == 0) l[e] = acc;
    }
    __syncthreads();
    if (warp != 0) return;
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
    warp_topk(s, experts, k, chosen);
    if (lane == 0) {
        float sum = 0.0f;
        for (unsigned j = 0; j < k; ++j) sum += s[chosen[j]];
        const bool norm = score_fn != 0 || renormalize != 0;
        for (unsigned j = 0; j < k; ++j) {
            topk[(size_t)t * k + j] = chosen[j];
            gates[(size_t)t * k + j] = norm ? s[chosen[j]] / sum : s[chosen[j]];
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

// The auxiliary losses, one block:
//   aux = aux_coef * E * sum_e f_e * P_e, f_e = counts[e] / (T * k), P_e = (1/T) sum_t probs[t, e]
//   z   = z_coef * (1/T) * sum_t lse[t]^2
// losses[0] = aux, losses[1] = z. Thread-strided partial sums in order, then a fixed tree.
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_router_losses(const float *probs, const float *lse, const int *counts, float *losses,
                      unsigned tokens, unsigned experts, unsigned k, float aux_coef, float z_coef) {
    cuda_graph::pdl_enter();
    __shared__ float red[2][MOE_BLOCK];
    float aux = 0.0f, z = 0.0f;
    for (unsigned e = threadIdx.x; e < experts; e += MOE_BLOCK) {
        float p = 0.0f;
        for (unsigned t = 0; t < tokens; ++t) p += probs[(size_t)t * experts + e];
        const float f = (float)counts[e] / ((float)tokens * (float)k);
        aux += f * (p / (float)tokens);
    }
    for (unsigned t = threadIdx.x; t < tokens; t += MOE_BLOCK) z += lse[t] * lse[t];
    red[0][threadIdx.x] = aux;
    red[1][threadIdx.x] = z;
    __syncthreads();
    for (unsigned o = MOE_BLOCK / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) {
            red[0][threadIdx.x] += red[0][threadIdx.x + o];
            red[1][threadIdx.x] += red[1][threadIdx.x + o];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        losses[0] = aux_coef * (float)experts * red[0][0];
        losses[1] = z_coef * red[1][0] / (float)tokens;
    }
}

// Combine: out[t, :] = sum_j gates[t, j] * y[row_of[t, j], :] in j order (f32), rounded to
// bf16. One block per token; a negative row contributes nothing.
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_combine_forward(const __nv_bfloat16 *y, const int *row_of, const float *gates,
                        __nv_bfloat16 *out, unsigned tokens, unsigned hidden, unsigned k,
                        unsigned rows) {
    cuda_graph::pdl_enter();
    const unsigned t = blockIdx.x;
    if (t >= tokens) return;
    for (unsigned h = threadIdx.x; h < hidden; h += MOE_BLOCK) {
        float acc = 0.0f;
        for (unsigned j = 0; j < k; ++j) {
            const int r = row_of[(size_t)t * k + j];
            if (r >= 0 && (unsigned)r < rows)
                acc = fmaf(gates[(size_t)t * k + j], __bfloat162float(y[(size_t)r * hidden + h]), acc);
        }
        out[(size_t)t * hidden + h] = __float2bfloat16_rn(acc);
    }
}

// The gates' gradient: d_gates[t, j] = sum_h dy[t, h] * y[row_of[t, j], h] (lane-strided in
// order, then a fixed xor tree). One block per token, warp j takes the token's j-th expert.
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_combine_backward_gates(const __nv_bfloat16 *dy, const __nv_bfloat16 *y, const int *row_of,
                               float *d_gates, unsigned tokens, unsigned hidden, unsigned k,
                               unsigned rows) {
    cuda_graph::pdl_enter();
    const unsigned t = blockIdx.x, lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (t >= tokens || warp >= k) return;
    const int r = row_of[(size_t)t * k + warp];
    float acc = 0.0f;
    if (r >= 0 && (unsigned)r < rows) {
        const __nv_bfloat16 *dr = dy + (size_t)t * hidden, *yr = y + (size_t)r * hidden;
        for (unsigned h = lane; h < hidden; h += 32)
            acc = fmaf(__bfloat162float(dr[h]), __bfloat162float(yr[h]), acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) d_gates[(size_t)t * k + warp] = acc;
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
// wr[e, h] (e order), f32, rounded to bf16. One block per token, dynamic shared memory
// experts floats (the token's d_logits).
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_unpermute_backward(const __nv_bfloat16 *dxp, const int *row_of, const float *d_logits,
                           const float *wr, __nv_bfloat16 *dx, unsigned tokens, unsigned hidden,
                           unsigned experts, unsigned k, unsigned rows) {
    cuda_graph::pdl_enter();
    extern __shared__ float dl[];
    const unsigned t = blockIdx.x;
    if (t >= tokens) return;
    for (unsigned e = threadIdx.x; e < experts; e += MOE_BLOCK) dl[e] = d_logits[(size_t)t * experts + e];
    __syncthreads();
    for (unsigned h = threadIdx.x; h < hidden; h += MOE_BLOCK) {
        float acc = 0.0f;
        for (unsigned j = 0; j < k; ++j) {
            const int r = row_of[(size_t)t * k + j];
            if (r >= 0 && (unsigned)r < rows) acc += __bfloat162float(dxp[(size_t)r * hidden + h]);
        }
        for (unsigned e = 0; e < experts; ++e) acc = fmaf(dl[e], wr[(size_t)e * hidden + h], acc);
        dx[(size_t)t * hidden + h] = __float2bfloat16_rn(acc);
    }
}

// The router weight's gradient, step 1 of 2: partial[c, e, h] = sum over the tokens t of
// chunk c (chunk tokens each, in order) of d_logits[t, e] * x[t, h]. Grid (ceil(E * H /
// MOE_BLOCK), chunks); one thread per (e, h).
extern "C" __global__ void __launch_bounds__(MOE_BLOCK)
    moe_router_wgrad_partial(const float *d_logits, const __nv_bfloat16 *x, float *partial,
                             unsigned tokens, unsigned hidden, unsigned experts, unsigned chunk) {
    cuda_graph::pdl_enter();
    const size_t q = (size_t)blockIdx.x * MOE_BLOCK + threadIdx.x;
    if (q >= (size_t)experts * hidden) return;
    const unsigned e = (unsigned)(q / hidden), h = (unsigned)(q % hidden);
    const unsigned t0 = blockIdx.y * chunk, t1 = min(tokens, t0 + chunk);
    float acc = 0.0f;
    for (unsigned t = t0; t < t1; ++t)
        acc = fmaf(d_logits[(size_t)t * experts + e], __bfloat162float(x[(size_t)t * hidden + h]), acc);
    partial[(size_t)blockIdx.y * experts * hidden + q] = acc;
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
