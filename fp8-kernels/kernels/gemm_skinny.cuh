// The skinny FP8 GEMM for sm_90a (m <= 128 rows of A: decode-time projections, a layer's
// small microbatches), weight-bound: B [n, k] is tens of MB and A a few hundred KB. The tiles
// of gemm_sm90.cuh would give such a problem n / 128 CTAs, half of each 128-row tile empty for
// m <= 64, and leave most SMs idle.
//
// Here the operands swap roles (swap-AB): the wgmma's 64-row "A" side is 64 rows of B (the
// weights), its "N" side the MN rows of A (MN = 64 or 128, zeros past m from the TMA's
// out-of-bounds fill), so a consumer warpgroup computes D^T[64 columns of D, MN rows of D].
// A CTA (a producer warpgroup and two consumers) covers 128 columns of D over one slice of K;
// the CTAs of a thread-block cluster (cluster dimension S, 1 to 8) take the S slices
// of K of the same columns. Each CTA writes its f32 partial tile to its shared memory; after a
// cluster barrier, CTA r sums rows r * MN / S .. (r + 1) * MN / S of the S partials, read
// through distributed shared memory in rank order (deterministic: no atomics, no workspace, no
// second kernel), and stores them: D = sa * sb * sum (+ bias[c]) (+ D). A second cluster
// barrier keeps every CTA's shared memory alive until the others have read it.
//
// Shared memory: STAGES x (B 128 x 128 bytes + A MN x 128 bytes), 128-byte swizzled by TMA,
// 1024-byte aligned, as deep as fits (the bytes in flight are what a weight-bound kernel
// needs); after the main loop the partial tile [MN][PSTRIDE] f32 takes the ring's space (rows
// of D, columns padded to 132 so that a warp's column-major writes hit distinct banks);
// full[STAGES], empty[STAGES].
#pragma once
#include "gemm_sm90.cuh"

namespace fp8k {
namespace sm90 {

template <int MN> struct SkinnyCfg {
    static_assert(MN == 64 || MN == 128, "skinny width");
    static constexpr int TILE_W = 128 * BK;  // 128 rows of B
    static constexpr int TILE_X = MN * BK;   // MN rows of A
    static constexpr int STAGE_BYTES = TILE_W + TILE_X;
    static constexpr int PSTRIDE = 128 + 4;
    // The partial tile takes the ring's space once the main loop is done with it.
    static constexpr int PARTIAL = MN * PSTRIDE * 4;
    static constexpr int MAX_STAGES = 12;
    static constexpr int FIT = (SMEM_LIMIT - 1024 - 2 * MAX_STAGES * 8) / STAGE_BYTES;
    static constexpr int STAGES = FIT < MAX_STAGES ? FIT : MAX_STAGES;
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 2 * STAGES * 8 + 1024;
    static_assert(STAGES >= 4 && SMEM_BYTES <= SMEM_LIMIT && PARTIAL <= STAGES * STAGE_BYTES,
                  "shared memory");
};

#ifdef FP8K_SM90A
__device__ __forceinline__ uint32_t cluster_ctarank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ uint32_t cluster_nctarank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}
// Every thread of every CTA of the cluster: writes before it (shared memory included) are
// visible to reads after it anywhere in the cluster.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The address of this CTA's shared `addr` in the shared memory of cluster CTA `rank`.
__device__ __forceinline__ uint32_t cluster_map(uint32_t addr, uint32_t rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
__device__ __forceinline__ float4 ld_cluster_f4(uint32_t addr) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}
#endif


// dims = (m, n, k, 0) with m <= MN, n a multiple of 4; flags = (sa index, sb index, bias kind
// 0/1 bf16/2 f32, bit 0 of w: accumulate into D). Grid: (n / 128 rounded up) x S CTAs in
// clusters of S along x (blockIdx.x = column tile * S + rank). FAST: fast accumulation
// (E4M3 x E4M3 into bf16, as gemm's FAST); otherwise each k-block's products are promoted
// into the f32 sum.
template <__nv_fp8_interpretation_t FA, __nv_fp8_interpretation_t FB, typename Out, int MN,
          bool FAST>
__device__ __forceinline__ void gemm_skinny(const TmaDesc *ta, const TmaDesc *tb, Out *d,
                                            const void *bias, const float *sa, const float *sb,
                                            uint4 dims, uint4 flags) {
#ifdef FP8K_SM90A
    using C = SkinnyCfg<MN>;
    constexpr int STAGES = C::STAGES, PSTRIDE = C::PSTRIDE;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t base = opaque_u32((raw + 1023u) & ~1023u);
    const uint32_t partial = base;  // (the ring's space, after the main loop)
    const uint32_t bars = base + STAGES * C::STAGE_BYTES;
    auto full = [&](int s) { return bars + 8u * s; };
    auto empty = [&](int s) { return bars + 8u * (STAGES + s); };
    auto tile_w = [&](int s) { return base + s * C::STAGE_BYTES; };
    auto tile_x = [&](int s) { return base + s * C::STAGE_BYTES + C::TILE_W; };

    const int m = int(dims.x), n = int(dims.y), k = int(dims.z);
    const int kblocks = (k + BK - 1) / BK;
    const uint32_t splits = cluster_nctarank(), rank = cluster_ctarank();
    const int nt = int(blockIdx.x / splits);
    // This CTA's k-blocks: the rank-th of `splits` near-equal slices.
    const int kb_lo = int(rank * uint32_t(kblocks) / splits);
    const int kb_hi = int((rank + 1) * uint32_t(kblocks) / splits);
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(ta)) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(tb)) : "memory");
        init_ring(STAGES, full, empty);
    }
    __syncthreads();
    cuda_graph::pdl_enter();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (threadIdx.x == 0) {
            int stage = 0;
            uint32_t phase = 0;
            for (int kb = kb_lo; kb < kb_hi; ++kb) {
                mbar_wait(empty(stage), phase ^ 1u);
                mbar_expect_tx(full(stage), C::STAGE_BYTES);
                tma_load_3d(tile_w(stage), tb, full(stage), kb * BK, nt * 128, 0);
                tma_load_3d(tile_x(stage), ta, full(stage), kb * BK, 0, 0);
                if (++stage == STAGES) {
                    stage = 0;
                    phase ^= 1u;
                }
            }
        }
        // The consumers' two cluster barriers (below), with nothing held across them: the
        // producer runs on 40 registers.
        __syncwarp();
        cluster_sync();
        cluster_sync();
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
        const int cw = wg - 1;
        const int t128 = threadIdx.x - 128 * wg;
        const int warp = t128 / 32, lane = t128 % 32;
        constexpr int NACC = MN / 2;
        float acc[NACC];
#pragma unroll
        for (int i = 0; i < NACC; ++i) acc[i] = 0.0f;
        // The wgmma's A side: this consumer's 64 rows of B; its B side: the MN rows of A.
        RingPos<STAGES> ring;
        auto ops = [&](int st) { return make_uint2(tile_w(st) + cw * 64 * BK, tile_x(st)); };
        auto nothing = [] {};
        auto release = [&](int st) {
            if (lane == 0) mbar_arrive(empty(st));
        };
        if constexpr (FAST) {
            consume_fast<FB, FA, MN>(acc, kb_lo, kb_hi, ring, full, ops, nothing, release);
        } else {
            consume_promoted<FB, FA, MN>(kb_lo, kb_hi, ring, full, ops, nothing, release,
                                         [](int) {}, [&](const float(&part)[NACC], int, bool) {
#pragma unroll
                                             for (int i = 0; i < NACC; ++i) acc[i] += part[i];
                                         });
        }
        // Both consumers' products done (the partial tile overwrites the ring, whose last
        // stages the other consumer's wgmma may still read; every load was consumed).
        named_sync(1, 256);
        // The partial tile, transposed to rows of D: acc[4p + {0, 1}] is column c0 (and c0 + 8
        // for acc[4p + {2, 3}]) of D, rows 8p + 2 (lane % 4) + {0, 1}.
        float *const pp = reinterpret_cast<float *>(smem_raw + (partial - raw));
        const int c0 = cw * 64 + warp * 16 + lane / 4;
#pragma unroll
        for (int p = 0; p < MN / 8; ++p) {
            const int r = 8 * p + 2 * (lane % 4);
            pp[r * PSTRIDE + c0] = acc[4 * p];
            pp[(r + 1) * PSTRIDE + c0] = acc[4 * p + 1];
            pp[r * PSTRIDE + c0 + 8] = acc[4 * p + 2];
            pp[(r + 1) * PSTRIDE + c0 + 8] = acc[4 * p + 3];
        }
        // Every CTA's partial tile written (and visible across the cluster).
        __syncwarp();
        cluster_sync();
        // This CTA's rows of the tile: the sum over the cluster's partials in rank order.
        const int row0 = int(rank) * MN / int(splits);
        const int rows = int(rank + 1) * MN / int(splits) - row0;
        const float alpha = sa[flags.x] * sb[flags.y];
        const int bias_kind = bias == nullptr ? 0 : int(flags.z);
        const bool accumulate = (flags.w & 1u) != 0;
        for (int i = threadIdx.x - 128; i < rows * 32; i += 256) {
            const int r = row0 + i / 32, c = (i % 32) * 4;
            const int col = nt * 128 + c;
            if (r >= m || col >= n) continue;
            const uint32_t at = partial + uint32_t((r * PSTRIDE + c) * 4);
            float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (uint32_t q = 0; q < splits; ++q) {
                const float4 v = ld_cluster_f4(cluster_map(at, q));
                s.x += v.x;
                s.y += v.y;
                s.z += v.z;
                s.w += v.w;
            }
            float o[4] = {alpha * s.x, alpha * s.y, alpha * s.z, alpha * s.w};
            Out *const dst = d + size_t(r) * size_t(n) + col;
#pragma unroll
            for (int j = 0; j < 4; ++j) o[j] += bias_at(bias, bias_kind, col + j);
            if (accumulate) {
                const float2 lo = load2<Out>(dst), hi = load2<Out>(dst + 2);
                o[0] += lo.x;
                o[1] += lo.y;
                o[2] += hi.x;
                o[3] += hi.y;
            }
            store2<Out>(dst, o[0], o[1]);
            store2<Out>(dst + 2, o[2], o[3]);
        }
        // No CTA leaves (freeing its shared memory) before the others have read its partial.
        __syncwarp();
        cluster_sync();
    }
#else
    __trap();
#endif
}

}  // namespace sm90
}  // namespace fp8k

// fp8_gemm_sm90_skinny_{a}_{b}_{out}_m{MN}: the promoted sum for every format pair and output;
// fp8_gemm_sm90_skinny_fast_e4m3_e4m3_bf16_m{MN}: fast accumulation.
#define FP8K_GEMM_SKINNY(NAME, FA, FB, OT, MN, FAST)                                                   \
    extern "C" __global__ void __launch_bounds__(fp8k::sm90::THREADS, 1)                             \
        fp8_gemm_sm90_skinny_##NAME##_m##MN(const __grid_constant__ fp8k::sm90::TmaDesc ta,            \
                                            const __grid_constant__ fp8k::sm90::TmaDesc tb, OT *d,     \
                                            const void *bias, const float *sa, const float *sb,        \
                                            uint4 dims, uint4 flags) {                                 \
        fp8k::sm90::gemm_skinny<FA, FB, OT, MN, FAST>(&ta, &tb, d, bias, sa, sb, dims, flags);         \
    }
#define FP8K_GEMM_SKINNY_OUTS(AN, FA, BN_, FB, MN)                                                     \
    FP8K_GEMM_SKINNY(AN##_##BN_##_bf16, FA, FB, __nv_bfloat16, MN, false)                            \
    FP8K_GEMM_SKINNY(AN##_##BN_##_f32, FA, FB, float, MN, false)
#define FP8K_GEMM_SKINNY_ALL(MN)                                                                       \
    FP8K_GEMM_SKINNY_OUTS(e4m3, __NV_E4M3, e4m3, __NV_E4M3, MN)                                      \
    FP8K_GEMM_SKINNY_OUTS(e4m3, __NV_E4M3, e5m2, __NV_E5M2, MN)                                      \
    FP8K_GEMM_SKINNY_OUTS(e5m2, __NV_E5M2, e4m3, __NV_E4M3, MN)                                      \
    FP8K_GEMM_SKINNY_OUTS(e5m2, __NV_E5M2, e5m2, __NV_E5M2, MN)                                      \
    FP8K_GEMM_SKINNY(fast_e4m3_e4m3_bf16, __NV_E4M3, __NV_E4M3, __nv_bfloat16, MN, true)
FP8K_GEMM_SKINNY_ALL(64)
FP8K_GEMM_SKINNY_ALL(128)
