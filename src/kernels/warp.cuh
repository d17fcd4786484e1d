// Warp-wide sums, max and scan shared by the root package's kernels (moe_routing.cu,
// model_ops.cu). The float sums run a fixed xor tree, so every run adds in the same order:
// the kernels built on them are deterministic, as CUDA graphs replayed against eager runs
// need.
#pragma once

namespace {

// Sum over the warp by a fixed xor tree: the same order on every run.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Inclusive prefix sum over the warp's lanes (integers: exact in any order).
__device__ __forceinline__ int warp_scan(int v) {
    const unsigned lane = threadIdx.x & 31u;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= (unsigned)o) v += n;
    }
    return v;
}

}  // namespace
