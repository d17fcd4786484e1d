// Scaling bookkeeping: amax reset for current scaling, and TE's delayed-scaling update.
#pragma once
#include "common.cuh"

// *amax = 0 unless *noop == 1 (a memset would ignore the noop flag). One thread.
// Slots: idx = (amax, noop).
extern "C" __global__ void fp8_zero_amax(float *amax, const float *noop, uint2 idx) {
    cuda_graph::pdl_enter();
    if (fp8k::is_noop(fp8k::slot(noop, idx.y))) return;
    if (blockIdx.x == 0 && threadIdx.x == 0) amax[idx.x] = 0.0f;
}

// One block per tensor t, blockDim >= H (a multiple of 32, <= 1024).
// history[t*H + 0] is the slot the quantize kernels max the current amax into; the update
//   - takes amax = history[t*H] (most recent) or max over the H slots (fmaxf: NaN ignored),
//   - rolls: new[i] = old[i+1] for 0 < i < H-1, new[H-1] = old[0], new[0] = 0
//     (TransformerEngine's roll by -1 followed by zeroing slot 0),
//   - (tensors with registered[t] == 0 are left alone entirely)
//   - scale = scaled_max[t] / amax when amax is finite and > 0, else the old scale;
//     an infinite scale becomes FLT_MAX; scale_inv = 1 / scale.
extern "C" __global__ void fp8_delayed_scaling_update(float *history, float *scale, float *scale_inv,
                                                      const float *scaled_max,
                                                      const unsigned *registered, unsigned H,
                                                      int most_recent) {
    __shared__ float warp_max[32];
    cuda_graph::pdl_enter();
    const unsigned t = blockIdx.x, i = threadIdx.x;
    if (registered[t] == 0u) return; // not registered: history and scales untouched
    float *h = history + (unsigned long long)t * H;
    const float last = h[0];
    float a = 0.0f;
    if (i < H) a = (i + 1 < H) ? h[i + 1] : last;
    __syncthreads(); // every read of the old history happens before any write
    if (i < H) h[i] = (i > 0) ? a : 0.0f;
    float m = fmaxf(0.0f, a);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if ((i & 31u) == 0) warp_max[i >> 5] = m;
    __syncthreads();
    if (i == 0) {
        const unsigned nwarps = (blockDim.x + 31u) >> 5;
        for (unsigned w = 1; w < nwarps; ++w) m = fmaxf(m, warp_max[w]);
        const float amax = most_recent ? last : m;
        float s = scale[t];
        if (isfinite(amax) && amax > 0.0f) s = scaled_max[t] / amax;
        if (isinf(s)) s = 3.402823466e+38f;
        scale[t] = s;
        scale_inv[t] = 1.0f / s;
    }
}
