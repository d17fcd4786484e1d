// Probe behind docs/perf-notes.md, "sixth session" (not part of the product, not built by
// cargo): the floors of the MoE step's byte streams with no math.
// - Loads: 128 CTAs stream fc1's FP8 weights (8 x 4096 x 2048 bytes) through a TMA ring of
//   2-6 stages, the B box read as 256 (or 128) rows x 128 B of the row-major weights (the
//   GEMM's box, with and without L2 promotion) or as one contiguous box (a tiled layout); a
//   consumer warp that only waits, optionally spinning 500 ns a stage (about a 128 x 256 x 128
//   wgmma), loading an A box from L2 beside B, and holding each stage one k-block longer (the
//   fast-accumulation ring).
// - Stores: 132 CTAs TMA-store 128 x BN bf16 tiles of fc1's weight gradient (134 MB) in the
//   weight-gradient GEMM's tile order, with one or two staging buffers, against a memset.
// - A plain coalesced read of the weights' bytes: the read yardstick.
// Each case runs after a 512 MB L2 flush; medians of 15 (11 for the stores).
//
// Build here (CUDA 13 from scripts/setup.sh), run on the H200:
//   T=.toolchain/cuda/nvidia/cu13
//   $T/bin/nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -I $T/include \
//       docs/probes/tma_stream.cu -o tma_stream -L $T/lib -lcudart_static
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

struct alignas(64) Desc { CUtensorMap m; };

__device__ __forceinline__ uint32_t su(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_init(uint32_t b, uint32_t c) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(b), "r"(c)); }
__device__ __forceinline__ void bar_wait(uint32_t b, uint32_t ph) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0,1,0,p;\n}\n" : "=r"(done) : "r"(b), "r"(ph) : "memory");
    } while (!done);
}
__device__ __forceinline__ void bar_arrive(uint32_t b) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(b) : "memory"); }
__device__ __forceinline__ void bar_tx(uint32_t b, uint32_t n) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(n) : "memory"); }
__device__ __forceinline__ void tma2(uint32_t dst, const CUtensorMap *m, uint32_t bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(dst), "l"((uint64_t)m), "r"(bar), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void tma3(uint32_t dst, const CUtensorMap *m, uint32_t bar, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(dst), "l"((uint64_t)m), "r"(bar), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
__device__ __forceinline__ uint64_t gtime() { uint64_t t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }

// mode 0: B strided 2D box; mode 1: B tiled 3D box; with_a: also a 16 KB A box from L2.
// hold: the consumer releases stage s only after stage s+1 arrived (the FAST ring).
__global__ void __launch_bounds__(64, 1) stream(const __grid_constant__ Desc b2, const __grid_constant__ Desc b3,
                                                 const __grid_constant__ Desc a2, const __grid_constant__ Desc b2n, int mode, int stages, int kblocks,
                                                 int spin_ns, int with_a, int hold, int bn) {
    extern __shared__ __align__(1024) uint8_t sm[];
    const uint32_t base = (su(sm) + 1023) & ~1023u;
    const int tile_b = bn * 128, stage_bytes = tile_b + (with_a ? 16384 : 0);
    const uint32_t bars = base + stages * stage_bytes;
    auto full = [&](int s) { return bars + 8 * s; };
    auto empty = [&](int s) { return bars + 8 * (stages + s); };
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) { bar_init(full(s), 1); bar_init(empty(s), 1); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int t = blockIdx.x;
    const int g = t / (4096 / bn), nt = t % (4096 / bn);
    const int row0 = g * 4096 + nt * bn;
    if (threadIdx.x == 0) {
        int s = 0; uint32_t ph = 0;
        for (int kb = 0; kb < kblocks; ++kb) {
            bar_wait(empty(s), ph ^ 1);
            bar_tx(full(s), stage_bytes);
            const uint32_t dst = base + s * stage_bytes;
            if (mode == 0) tma2(dst, &b2.m, full(s), kb * 128, row0);
            else if (mode == 2) tma2(dst, &b2n.m, full(s), kb * 128, row0);
            else tma3(dst, &b3.m, full(s), 0, 0, (row0 / bn) * kblocks + kb);
            if (with_a) tma2(dst + tile_b, &a2.m, full(s), kb * 128, (g % 8) * 128);
            if (++s == stages) { s = 0; ph ^= 1; }
        }
    } else if (threadIdx.x == 32) {
        int s = 0; uint32_t ph = 0; int held = -1;
        for (int kb = 0; kb < kblocks; ++kb) {
            bar_wait(full(s), ph);
            if (spin_ns > 0) { const uint64_t t0 = gtime(); while (gtime() - t0 < (uint64_t)spin_ns) {} }
            if (hold) { if (held >= 0) bar_arrive(empty(held)); held = s; }
            else bar_arrive(empty(s));
            if (++s == stages) { s = 0; ph ^= 1; }
        }
        if (held >= 0) bar_arrive(empty(held));
    }
}

// Stores: each CTA writes tiles of 128 x bn bf16 (boxes of 64 rows x 64 columns) of a
// [rows][2048] bf16 D in wgrad order (n fastest), from `bufs` staging buffers per warp-half,
// waiting only for the copy engine's read of a buffer before reusing it; two issuing threads
// (one per consumer half) like the GEMM.
__device__ __forceinline__ void tma_st2(const CUtensorMap *m, uint32_t src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"((uint64_t)m), "r"(src), "r"(c0), "r"(c1) : "memory");
}
__global__ void __launch_bounds__(64, 1) store_tiles(const __grid_constant__ Desc dm, int tiles, int ntiles, int bn,
                                                      int bufs, int spin_ns) {
    extern __shared__ __align__(1024) uint8_t sm[];
    const uint32_t base = (su(sm) + 1023) & ~1023u;
    const int half = threadIdx.x / 32;
    if (threadIdx.x % 32 != 0) return;
    const int box = 64 * 128;  // 64 rows x 64 bf16
    const int per = bn / 64;   // boxes per half-tile
    int buf = 0, used = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int mt = t / ntiles, nt = t % ntiles;
        if (spin_ns > 0) { const uint64_t t0 = gtime(); while (gtime() - t0 < (uint64_t)spin_ns) {} }
        if (used >= bufs) asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(0) : "memory");
        const uint32_t src = base + (half * bufs + buf) * per * box;
        for (int j = 0; j < per; ++j) tma_st2(&dm.m, src + j * box, nt * bn + j * 64, mt * 128 + half * 64);
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        if (++buf == bufs) buf = 0;
        ++used;
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void memset_k(int4 *p, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = make_int4(1, 2, 3, 4);
}

__global__ void flush(const int4 *p, size_t n, int *sink) {
    int4 acc = make_int4(0, 0, 0, 0);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int4 v = p[i]; acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345) *sink = 1;
}

int main() {
    PFN_cuTensorMapEncodeTiled_v12000 enc = nullptr;
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", (void **)&enc, 12000, cudaEnableDefault, &q));
    const int E = 8, N = 4096, K = 2048;
    const size_t wbytes = (size_t)E * N * K;
    uint8_t *w, *a; int4 *fl; int *sink;
    CK(cudaMalloc(&w, wbytes)); CK(cudaMemset(w, 1, wbytes));
    CK(cudaMalloc(&a, 1024 * K)); CK(cudaMemset(a, 2, 1024 * K));
    const size_t fbytes = 512ull << 20;
    CK(cudaMalloc(&fl, fbytes)); CK(cudaMemset(fl, 3, fbytes)); CK(cudaMalloc(&sink, 4));
    int bns[2] = {256, 128};
    for (int bi = 0; bi < 2; ++bi) {
        const int bn = bns[bi];
        Desc b2, b3, a2, b2n;
        {
            cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)E * N}; cuuint64_t str[1] = {(cuuint64_t)K};
            cuuint32_t box[2] = {128, (cuuint32_t)bn}; cuuint32_t es[2] = {1, 1};
            if (enc(&b2.m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, w, dims, str, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)) { printf("enc b2\n"); return 1; }
            if (enc(&b2n.m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, w, dims, str, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)) { printf("enc b2n\n"); return 1; }
        }
        {
            cuuint64_t dims[3] = {128, (cuuint64_t)bn, (cuuint64_t)(wbytes / (128 * bn))};
            cuuint64_t str[2] = {128, (cuuint64_t)128 * bn};
            cuuint32_t box[3] = {128, (cuuint32_t)bn, 1}; cuuint32_t es[3] = {1, 1, 1};
            if (enc(&b3.m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, w, dims, str, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)) { printf("enc b3\n"); return 1; }
        }
        {
            cuuint64_t dims[2] = {(cuuint64_t)K, 1024}; cuuint64_t str[1] = {(cuuint64_t)K};
            cuuint32_t box[2] = {128, 128}; cuuint32_t es[2] = {1, 1};
            if (enc(&a2.m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, a, dims, str, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)) { printf("enc a2\n"); return 1; }
        }
        CK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, 232448));
        const int tiles = E * (N / bn);
        const int kblocks = K / 128;
        cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
        for (int with_a = 0; with_a < 2; ++with_a)
        for (int hold = 0; hold < 2; ++hold)
        for (int spin : {0, 500})
        for (int stages : {2, 3, 4, 6}) {
            const int stage_bytes = bn * 128 + (with_a ? 16384 : 0);
            const int smem = stages * stage_bytes + 2 * stages * 8 + 1024;
            if (smem > 232448) continue;
            if (hold && stages < 3) continue;
            for (int mode = 0; mode < 3; ++mode) {
                std::vector<float> ts;
                for (int it = 0; it < 15; ++it) {
                    flush<<<264, 1024>>>(fl, fbytes / 16, sink);
                    CK(cudaEventRecord(e0));
                    stream<<<tiles, 64, smem>>>(b2, b3, a2, b2n, mode, stages, kblocks, spin, with_a, hold, bn);
                    CK(cudaEventRecord(e1));
                    CK(cudaEventSynchronize(e1));
                    float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); ts.push_back(ms * 1000.f);
                }
                CK(cudaGetLastError());
                std::sort(ts.begin(), ts.end());
                const float us = ts[ts.size() / 2];
                const double bytes = (double)wbytes + (with_a ? (double)tiles * kblocks * 16384 : 0.0);
                printf("bn %d a %d hold %d spin %3d stages %d %-7s %7.2f us  B %6.2f TB/s (L2->SM %5.2f)\n", bn, with_a, hold, spin, stages,
                       mode == 1 ? "tiled" : mode == 2 ? "str-nop" : "strided", us, wbytes / us / 1e6, bytes / us / 1e6);
            }
        }
    }
    // Stores: dW1 at T = 256 bf16 is [8 * 4096][2048] bf16 = 134 MB.
    {
        const size_t rows = 8 * 4096, cols = 2048, dbytes = rows * cols * 2;
        uint8_t *d; CK(cudaMalloc(&d, dbytes));
        cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
        Desc dm;
        cuuint64_t dims[2] = {cols, rows}; cuuint64_t str[1] = {cols * 2};
        cuuint32_t box[2] = {64, 64}; cuuint32_t es[2] = {1, 1};
        if (enc(&dm.m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, d, dims, str, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)) { printf("enc d\n"); return 1; }
        CK(cudaFuncSetAttribute(store_tiles, cudaFuncAttributeMaxDynamicSharedMemorySize, 232448));
        for (int bn : {128, 192, 256})
        for (int bufs : {1, 2})
        for (int spin : {0, 500, 1000}) {
            const int ntiles = (int)((cols + bn - 1) / bn), tiles = (int)(rows / 128) * ntiles;
            const int smem = 2 * bufs * (bn / 64) * 8192 + 1024;
            std::vector<float> ts;
            for (int it = 0; it < 11; ++it) {
                flush<<<264, 1024>>>(fl, fbytes / 16, sink);
                CK(cudaEventRecord(e0));
                store_tiles<<<132, 64, smem>>>(dm, tiles, ntiles, bn, bufs, spin);
                CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
                float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); ts.push_back(ms * 1000.f);
            }
            CK(cudaGetLastError());
            std::sort(ts.begin(), ts.end());
            printf("store bn %d bufs %d spin %4d: %7.2f us %5.2f TB/s\n", bn, bufs, spin, ts[5], dbytes / ts[5] / 1e6);
        }
        std::vector<float> ts;
        for (int it = 0; it < 11; ++it) {
            flush<<<264, 1024>>>(fl, fbytes / 16, sink);
            CK(cudaEventRecord(e0));
            memset_k<<<132 * 4, 512>>>((int4 *)d, dbytes / 16);
            CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
            float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); ts.push_back(ms * 1000.f);
        }
        std::sort(ts.begin(), ts.end());
        printf("memset kernel 134 MB: %.2f us %.2f TB/s\n", ts[5], dbytes / ts[5] / 1e6);
    }
    // A plain read of 64 MB for the DRAM yardstick.
    {
        cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
        std::vector<float> ts;
        for (int it = 0; it < 15; ++it) {
            flush<<<264, 1024>>>(fl, fbytes / 16, sink);
            CK(cudaEventRecord(e0));
            flush<<<132 * 4, 512>>>((const int4 *)w, wbytes / 16, sink);
            CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
            float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); ts.push_back(ms * 1000.f);
        }
        std::sort(ts.begin(), ts.end());
        printf("plain read 64 MB: %.2f us, %.2f TB/s\n", ts[7], wbytes / ts[7] / 1e6);
    }
    return 0;
}
