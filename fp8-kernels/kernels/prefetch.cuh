// L2 prefetch of one device byte range: a cache hint, no result. A kernel that waits on
// memory it does not write (weights, read only by later kernels) can have those bytes brought
// into L2 while latency-bound kernels leave DRAM idle; the GEMM that reads them next then
// streams from L2. On sm_90 each lane issues bulk prefetches (`cp.async.bulk.prefetch.L2`,
// the TMA unit walks the range) of PREFETCH_CHUNK bytes; below sm_90 one `prefetch.global.L2`
// per 128-byte line. The range is buf[offset .. offset + bytes), offset and bytes multiples
// of 16 (the launcher rounds inwards).
//
// Nothing here reads or writes memory in the program's sense, so the prefetches go out before
// the programmatic-dependent-launch wait (overlapping the previous kernel); the wait comes
// before the kernel exits, so the chain of waits that orders the kernels after this one is
// unbroken.
#pragma once
#include "common.cuh"

namespace fp8k {
constexpr unsigned PREFETCH_CHUNK = 16384;  // bytes per bulk prefetch
constexpr unsigned PREFETCH_THREADS = 128;
} // namespace fp8k

extern "C" __global__ void __launch_bounds__(fp8k::PREFETCH_THREADS)
    fp8_prefetch_l2(const uint8_t *buf, unsigned long long offset, unsigned long long bytes, unsigned mode) {
    const uint8_t *base = buf + offset;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (mode == 1) {
        for (unsigned long long l = first; l * 128 < bytes; l += stride)
            asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(base + l * 128) : "memory");
    } else {
    const unsigned long long chunk = mode == 2 ? 4096 : fp8k::PREFETCH_CHUNK; // mode 3: 16 KiB over all SMs
    const unsigned long long chunks = (bytes + chunk - 1) / chunk;
    for (unsigned long long c = first; c < chunks;
         c += stride) {
        const unsigned long long off = c * chunk;
        const unsigned long long left = bytes - off;
        const unsigned size = left < chunk ? (unsigned)left : (unsigned)chunk;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + off), "r"(size)
                     : "memory");
#else
        for (unsigned b = 0; b < size; b += 128)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(base + off + b) : "memory");
#endif
    }
    }
    cuda_graph::pdl_enter();
}
