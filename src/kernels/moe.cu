// Kernels of the FP8 MoE layer (src/moe.rs): router, dispatch plan, scatter, combine.
//
// Everything here is deterministic: fixed summation orders, no atomics, so the same inputs
// give the same bits on every run (eagerly and inside graphs alike).

// Threads per block of moe_router_f32 (the launcher must use exactly this many).
#include <cuda_graph/pdl.cuh>

#define MOE_ROUTER_BLOCK 256

// Router and top-1: one block per token t.
//   logits[t, e] = sum over h of x[t, h] * wr[e, h]   (f32; thread i sums h = i, i + 256, ...
//                  in order with fmaf, then a fixed shared-memory tree)
//   expert[t]    = argmax over e of logits[t, e] (strict > from expert 0: ties to the lowest index)
//   gate[t]      = softmax(logits[t, :])[expert[t]] = 1 / sum over e of exp(l_e - l_max)
extern "C" __global__ void moe_router_f32(const float* x, const float* wr, float* logits,
                                          int* expert, float* gate, unsigned int tokens,
                                          unsigned int hidden, unsigned int experts) {
    cuda_graph::pdl_enter();
    __shared__ float red[MOE_ROUTER_BLOCK];
    unsigned int t = blockIdx.x;
    if (t >= tokens) return;
    const float* xr = x + (size_t)t * hidden;
    float* lr = logits + (size_t)t * experts;
    for (unsigned int e = 0; e < experts; ++e) {
        const float* w = wr + (size_t)e * hidden;
        float acc = 0.0f;
        for (unsigned int h = threadIdx.x; h < hidden; h += MOE_ROUTER_BLOCK)
            acc = fmaf(xr[h], w[h], acc);
        red[threadIdx.x] = acc;
        __syncthreads();
        for (unsigned int s = MOE_ROUTER_BLOCK / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
            __syncthreads();
        }
        if (threadIdx.x == 0) lr[e] = red[0];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        unsigned int best = 0;
        float m = lr[0];
        for (unsigned int e = 1; e < experts; ++e) {
            if (lr[e] > m) {
                m = lr[e];
                best = e;
            }
        }
        float sum = 0.0f;
        for (unsigned int e = 0; e < experts; ++e) sum += expf(lr[e] - m);
        expert[t] = (int)best;
        gate[t] = 1.0f / sum;
    }
}

// Dispatch plan, one block (any blockDim >= experts), dynamic shared memory
// experts * blockDim ints. Thread i owns the contiguous token range
// [i * chunk, (i + 1) * chunk) with chunk = ceil(tokens / blockDim):
//   1. it counts its tokens per expert;
//   2. thread e < experts scans expert e's per-thread counts (exclusive, in thread order),
//      writing counts[e] = the total;
//   3. each thread walks its tokens again in order: pos[t] = (tokens of expert[t] before
//      this thread's range) + (earlier tokens of the same expert in the range).
// So pos[t] = the number of tokens t' < t with expert[t'] == expert[t]: token order is kept
// within each expert, independent of scheduling. Tokens with an expert out of range get
// pos = -1 and are not counted.
extern "C" __global__ void moe_dispatch_plan(const int* expert, int* pos, int* counts,
                                             unsigned int tokens, unsigned int experts) {
    cuda_graph::pdl_enter();
    extern __shared__ int sc[];  // [experts][blockDim.x]
    unsigned int nt = blockDim.x, i = threadIdx.x;
    unsigned int chunk = (tokens + nt - 1) / nt;
    unsigned int lo = min(i * chunk, tokens), hi = min(lo + chunk, tokens);
    for (unsigned int e = 0; e < experts; ++e) sc[e * nt + i] = 0;
    for (unsigned int t = lo; t < hi; ++t) {
        int e = expert[t];
        if (e >= 0 && (unsigned int)e < experts) sc[(unsigned int)e * nt + i] += 1;
    }
    __syncthreads();
    if (i < experts) {
        int run = 0;
        for (unsigned int j = 0; j < nt; ++j) {
            int c = sc[i * nt + j];
            sc[i * nt + j] = run;
            run += c;
        }
        counts[i] = run;
    }
    __syncthreads();
    for (unsigned int t = lo; t < hi; ++t) {
        int e = expert[t];
        if (e >= 0 && (unsigned int)e < experts) {
            pos[t] = sc[(unsigned int)e * nt + i];
            sc[(unsigned int)e * nt + i] += 1;
        } else {
            pos[t] = -1;
        }
    }
}

// Scatter rows of 16-byte vectors: row t of src ([tokens, vecs]) goes to row
// expert[t] * m_max + pos[t] of dst ([experts * m_max, vecs]). One block per token.
extern "C" __global__ void moe_scatter_rows(const uint4* src, uint4* dst, const int* expert,
                                            const int* pos, unsigned int tokens,
                                            unsigned int vecs, unsigned int m_max,
                                            unsigned int experts) {
    cuda_graph::pdl_enter();
    unsigned int t = blockIdx.x;
    if (t >= tokens) return;
    int e = expert[t], p = pos[t];
    if (e < 0 || (unsigned int)e >= experts || p < 0 || (unsigned int)p >= m_max) return;
    size_t row = (size_t)e * m_max + (size_t)p;
    for (unsigned int v = threadIdx.x; v < vecs; v += blockDim.x)
        dst[row * vecs + v] = src[(size_t)t * vecs + v];
}

// Combine: y[t, f] = gate[t] * h[expert[t] * m_max + pos[t], f] (h is [experts, m_max, ffn]
// f32); 0 for a token without a valid expert. One block per token.
extern "C" __global__ void moe_combine_f32(const float* h, const int* expert, const int* pos,
                                           const float* gate, float* y, unsigned int tokens,
                                           unsigned int ffn, unsigned int m_max,
                                           unsigned int experts) {
    cuda_graph::pdl_enter();
    unsigned int t = blockIdx.x;
    if (t >= tokens) return;
    int e = expert[t], p = pos[t];
    bool ok = e >= 0 && (unsigned int)e < experts && p >= 0 && (unsigned int)p < m_max;
    float g = gate[t];
    size_t row = ok ? ((size_t)e * m_max + (size_t)p) : 0;
    for (unsigned int f = threadIdx.x; f < ffn; f += blockDim.x)
        y[(size_t)t * ffn + f] = ok ? g * h[row * ffn + f] : 0.0f;
}

// out[i] = 0 for i < n (the trivial backward's input gradient).
extern "C" __global__ void moe_zero_f32(float* out, unsigned int n) {
    cuda_graph::pdl_enter();
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 0.0f;
}
