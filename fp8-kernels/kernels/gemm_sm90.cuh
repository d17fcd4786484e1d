// FP8 GEMM for sm_90a: TMA loads into a shared-memory ring guarded by mbarriers, wgmma
// (QGMMA) consumers, fp32 promotion of the tensor-core partial sums every 128 of K, a
// persistent grid with a tile scheduler that reads the per-group row counts on the device.
// Three layouts (Mode): grouped blocks, the packed MoE layout, and the packed weight gradient,
// whose reduction range per group is read from the device offsets.
//
// D[g, r, c] = sa * sb * sum_k A[g, r, k] * B[g, c, k] (+ bias[c]) (+ D[g, r, c])
// for r < min(counts[g], m) (every r < m when counts is null), c < n.
//
// CTA: 384 threads = 3 warpgroups. Warpgroup 0 is the producer (one thread issues the TMA
// loads; registers given back with setmaxnreg), warpgroups 1 and 2 are consumers, each
// computing 64 rows x BN columns of the tile with wgmma m64nBNk32.
// Tile 128 x BN x 128 (BN = 128, 192 or 256; each consumer computes 64 x BN). The 256-wide
// grouped and packed kernels compute a short last wave's tiles in column halves (tail_halves).
// Shared memory: STAGES x (A 128x128 bytes + B BNx128 bytes), 128-byte swizzled by TMA,
// 1024-byte aligned; then the two consumers' output staging (64 x BN of the output type each,
// half of that for f32 at BN 192, which goes through in two parts); then full[STAGES] and
// empty[STAGES] mbarriers. The ring is as deep as the rest leaves room
// for (Cfg), at most 6 stages.
//
// Epilogue, two ways. The store epilogue (D overwritten with every row of the tile: the
// packed layouts, or grouped blocks without counts): each consumer writes its scaled 64 x BN
// (+ bias) into its staging in the 128-byte swizzled layout of a TMA store box, and one of
// its threads issues the bulk tensor stores; the consumer goes on to its next tile's main
// loop while the copy engine drains the staging (it waits for that read only before writing
// the staging again). Accumulating into an f32 D, the boxes are added into it by the copy
// engine (bulk tensor reduce-add in L2) instead of stored. Grouped blocks with row counts take
// it for the tiles whose rows all lie below their group's count, and the register epilogue
// for the group's last, partial tile. The register epilogue (those tiles, accumulating into a
// bf16 D, a D the store's tensor map can not describe): stores from registers, rows below the
// group's count, reading D first when accumulating.
#pragma once
#include "common.cuh"

namespace fp8k {
namespace sm90 {

constexpr int BM = 128, BK = 128;
constexpr int THREADS = 384;
constexpr int TILE_A = BM * BK;  // bytes
// Per tile width BN (128, 192 or 256): B tile bytes, stage bytes, ring depth, shared memory.
// With `Out` the output type: the staging of the store epilogue, and the ring depth that fits
// beside it in the 227 KiB a CTA may have. The staging holds a consumer's 64 x BN outputs in
// PARTS parts stored one after the other: one part, except f32 at BN 192, whose whole tile
// (96 KiB for both consumers) would leave room for 3 stages; in two halves of 96 columns it
// leaves 4; and BN 256 (bf16 out only: fast accumulation, or the promoted E4M3 x E4M3 sum),
// two halves of 128 columns, 4 stages.
// Stages: BN 128: 6 for bf16 out, 5 for f32; BN 192: 4 for both; BN 256: 4. After the
// barriers, the packed layout's group offsets (OFFSETS_CACHED ints, see gemm), then SCALES
// bytes a stage (the block-scaled kernel's scales, BLOCK_SCALE_BYTES; 0 otherwise), which cost
// the block-scaled kernel a stage at BN 128. Keep in step with `smem_bytes` in
// src/gemm/hopper.rs.
constexpr int SMEM_LIMIT = 232448;
// The packed layout (PACKED) with fewer groups than this copies its groups + 1 offsets into
// shared memory at the start, so that every tile lookup (a binary search over them) reads
// shared memory: from global memory each step of the search was a dependent load, and the
// CTA's first TMA load waited for the chain. (Not WGRAD, whose tiles need no search: there it
// measured 3-4 us slower in the T = 256 MoE step with f32 gradients.)
constexpr int OFFSETS_CACHED = 64;
template <int BN, typename Out, int SCALES = 0> struct Cfg {
    static constexpr int TILE_B = BN * BK;
    static constexpr int STAGE_BYTES = TILE_A + TILE_B;
    // (The block-scaled 256-wide tile: 4 parts, whose 16 KiB of staging leave room for 4
    // stages with the scales; in 2 parts it would keep 3.)
    static constexpr int PARTS = BN == 256 && SCALES > 0                      ? 4
                                 : (BN == 192 && sizeof(Out) == 4) || BN == 256 ? 2
                                                                                : 1;
    static constexpr int STAGING = 2 * 64 * (BN / PARTS) * int(sizeof(Out));
    static constexpr int FIT =
        (SMEM_LIMIT - 1024 - STAGING - 2 * 6 * 8 - 4 * OFFSETS_CACHED) / (STAGE_BYTES + SCALES);
    static constexpr int STAGES = FIT < 6 ? FIT : 6;
    static constexpr int SMEM_BYTES = STAGES * (STAGE_BYTES + SCALES) + STAGING + 2 * STAGES * 8 +
                                      4 * OFFSETS_CACHED + 1024;
    static_assert(STAGES >= 3 && SMEM_BYTES <= SMEM_LIMIT, "shared memory");
};
// Columns of one 128-byte swizzled store box (the swizzle's row width), and 64 rows of them.
template <typename Out> struct StoreBox {
    static constexpr int COLS = 128 / int(sizeof(Out));
    static constexpr int BYTES = 64 * 128;
};
// m-tiles per rasterization band: consecutive tiles walk down a band of this many m-tiles,
// then move one n-tile right, so a wave of CTAs shares A and B panels in L2.
constexpr int BAND = 16;

// A CUtensorMap, passed by value as a __grid_constant__ parameter (128 bytes, 64-aligned).
struct alignas(64) TmaDesc {
    unsigned long long v[16];
};

// A tile: group g, m-tile mt, n-tile nt; `half` 0 for the whole tile, 1 or 2 for its first or
// second BN / 2 columns alone (a tail half: see tail_halves).
struct Tile {
    int g, mt, nt;
    int half = 0;
};

// Tail halves (the 256-wide tiles of the grouped and packed layouts): the tiles of a last
// wave that would leave at least half the grid idle (total % grid = R, 0 < 2R <= grid) are
// computed as 2R column halves by 2R CTAs, each half in half the time, with the same products
// in the same order (the same bits). Returns R, or 0 where the tail stays whole.
__device__ __forceinline__ int tail_halves(int total, int grid) {
    const int r = total % grid;
    return r > 0 && 2 * r <= grid ? r : 0;
}

// The fused SwiGLU epilogue's second output (SWIGLU in gemm): D is fc1's [m, 2F] (gate
// columns 0..F, up columns F..2F) and h = cast(silu(gate) * up), F = n / 2 columns, the
// E4M3 input of fc2, written as the MoE cast of the SwiGLU (moe_cast.cuh) writes it.
struct SwigluOut {
    const TmaDesc *ty;  // h [m, F], boxes of 64 rows x 64 bytes, 64-byte swizzle (box64)
    const TmaDesc *tyt; // h^T [F, m] (the weight gradient's operand), the same boxes
    const float *scale; // the delayed-scaling scale of the cast
    float *scale_inv;   // 1 / scale, written by CTA 0 (nullable)
    float *amax;        // max |h| maxed in as float bits (nullable)
};

// The per-group m-tile count: rows below min(count, m), in tiles of BM.
__device__ __forceinline__ int group_mtiles(const int *counts, int g, int m) {
    int rows = m;
    if (counts != nullptr) rows = min(max(__ldg(counts + g), 0), m);
    return (rows + BM - 1) / BM;
}

// Tile t of the grouped problem (tiles of empty rows skipped), or g = -1 past the end.
__device__ __forceinline__ Tile tile_at(int t, const int *counts, int groups, int m, int ntiles) {
    for (int g = 0; g < groups; ++g) {
        const int mt = group_mtiles(counts, g, m);
        const int c = mt * ntiles;
        if (t < c) {
            const int band = t / (BAND * ntiles);
            const int within = t - band * BAND * ntiles;
            const int h = min(BAND, mt - band * BAND);
            return Tile{g, band * BAND + within % h, within / h};
        }
        t -= c;
    }
    return Tile{-1, 0, 0};
}

__device__ __forceinline__ int total_tiles(const int *counts, int groups, int m, int ntiles) {
    int total = 0;
    for (int g = 0; g < groups; ++g) total += group_mtiles(counts, g, m) * ntiles;
    return total;
}

// The packed layout (dropless MoE): m = the capacity, group g's rows are offsets[g] ..
// offsets[g + 1] (multiples of BM, so a tile belongs to one group), read on the device.
// Offsets are clamped to [0, m]. `offsets` is the device array or its copy in shared memory
// (a generic load reads either).
__device__ __forceinline__ int packed_offset(const int *offsets, int g, int m) {
    return min(max(offsets[g], 0), m);
}

// The m-tiles in use: up to offsets[groups].
__device__ __forceinline__ int packed_mtiles(const int *offsets, int groups, int m) {
    return (packed_offset(offsets, groups, m) + BM - 1) / BM;
}

// The group whose rows hold `row`: the last g with offsets[g] <= row (binary search; empty
// groups before it share its offset).
__device__ __forceinline__ int packed_group(const int *offsets, int groups, int m, int row) {
    int lo = 0, hi = groups - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (packed_offset(offsets, mid, m) <= row) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// Tile t of the packed problem, in bands of BAND m-tiles like tile_at; mt is absolute.
__device__ __forceinline__ Tile packed_tile_at(int t, const int *offsets, int groups, int m,
                                               int ntiles) {
    const int mts = packed_mtiles(offsets, groups, m);
    const int band = t / (BAND * ntiles);
    const int within = t - band * BAND * ntiles;
    const int h = min(BAND, mts - band * BAND);
    const int mt = band * BAND + within % h;
    return Tile{packed_group(offsets, groups, m, mt * BM), mt, within / h};
}

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FP8K_SM90A 1

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// `x`, which the compiler can no longer recompute from its inputs (it keeps the register).
__device__ __forceinline__ uint32_t opaque_u32(uint32_t x) {
    uint32_t r;
    asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}

// An L2 eviction priority for a bulk copy (a `createpolicy` cache policy); `on` false issues
// the copy without one.
struct L2Hint {
    bool on;
    uint64_t policy;
};
constexpr L2Hint NO_HINT{false, 0};
// Lines first out of L2: a stream written once and not read again by this kernel.
__device__ __forceinline__ L2Hint l2_evict_first() {
    uint64_t p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return L2Hint{true, p};
}
// Lines kept in L2 over others: operands many tiles read again.
__device__ __forceinline__ L2Hint l2_evict_last() {
    uint64_t p;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
    return L2Hint{true, p};
}

// 3-D tiled TMA load of the box at (c0, c1, c2) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const TmaDesc *map, uint32_t bar, int c0,
                                            int c1, int c2, L2Hint hint = NO_HINT) {
    const uint64_t m = reinterpret_cast<uint64_t>(map);
    if (hint.on) {
        asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                     ".L2::cache_hint [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(dst),
                     "l"(m), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "l"(hint.policy)
                     : "memory");
    } else {
        asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(dst),
                     "l"(m), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
                     : "memory");
    }
}

// 3-D tiled TMA store of the shared box at `src` to (c0, c1, c2) of `map` (out-of-bounds
// elements are not written), in the thread's current bulk group; with `add`, the box is added
// into `map` (D += box) by the copy engine in L2 instead: f32 only (bf16 would round twice).
__device__ __forceinline__ void tma_store_3d(const TmaDesc *map, uint32_t src, int c0, int c1, int c2,
                                             bool add = false, L2Hint hint = NO_HINT) {
    const uint64_t m = reinterpret_cast<uint64_t>(map);
    // (The policy is operand %5, named in the instruction only with the hint.)
#define FP8K_TMA_STORE(OP, HINT, ...)                                                               \
    asm volatile(OP ".bulk_group" HINT " [%0, {%2, %3, %4}], [%1]" __VA_ARGS__ ";" ::"l"(m), "r"(src), \
                 "r"(c0), "r"(c1), "r"(c2), "l"(hint.policy)                                       \
                 : "memory")
    if (add && hint.on) {
        FP8K_TMA_STORE("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile", ".L2::cache_hint", ", %5");
    } else if (add) {
        FP8K_TMA_STORE("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile", "");
    } else if (hint.on) {
        FP8K_TMA_STORE("cp.async.bulk.tensor.3d.global.shared::cta", ".L2::cache_hint", ", %5");
    } else {
        FP8K_TMA_STORE("cp.async.bulk.tensor.3d.global.shared::cta", "");
    }
#undef FP8K_TMA_STORE
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until the thread's bulk groups have read their shared sources (the staging is free again).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Until the thread's bulk groups are complete (their writes done).
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Generic-proxy writes to shared memory made visible to the async proxy (the TMA store).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Barrier `id` over `threads` threads (one consumer warpgroup), not the whole CTA.
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Arrives at named barrier `id` without waiting (a bar.sync of the other `threads` waits).
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// The fused casts' staging: boxes of 64 rows x 64 bytes in the 64-byte swizzle of TMA (the
// 16-byte chunk q of row r at chunk q ^ ((r / 2) % 4)), so that a warp's stores of 8 rows x 4
// column pairs, or of their transposes, hit distinct banks.
constexpr int BOX64 = 64 * 64;
__device__ __forceinline__ uint32_t box64(int r, int b) {
    const uint32_t o = uint32_t(r) * 64u + uint32_t(b);
    return o ^ (((o >> 7) & 3u) << 4);
}
// Bytes (lo, hi) of `v` at (r, c) and (r, c + 1) of a box (c even: one 2-byte store).
__device__ __forceinline__ void put_pair(uint8_t *box, int r, int c, unsigned v) {
    *reinterpret_cast<unsigned short *>(box + box64(r, c)) = (unsigned short)v;
}
// The same pair transposed: at (c, r) and (c + 1, r).
__device__ __forceinline__ void put_pair_t(uint8_t *box, int c, int r, unsigned v) {
    box[box64(c, r)] = uint8_t(v);
    box[box64(c + 1, r)] = uint8_t(v >> 8);
}

// wgmma shared-memory descriptor of a K-major tile written by TMA with 128-byte swizzle:
// rows of 128 bytes, 8-row groups 1024 bytes apart (stride byte offset), leading byte offset
// unused (the k32 slice lies inside one swizzle row), layout type 1 = 128B swizzle.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
    uint64_t d = 0;
    d |= static_cast<uint64_t>((addr & 0x3ffffu) >> 4);
    d |= static_cast<uint64_t>(1) << 16;
    d |= static_cast<uint64_t>(1024 >> 4) << 32;
    d |= static_cast<uint64_t>(1) << 62;
    return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }

#define FP8K_WGMMA_N64(TYPES)                                                                      \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                         \
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32." TYPES " "                                  \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                                                                          \
                 "%32, %33, p, 1, 1;\n}\n"                                                             \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                                                \
                 : "l"(da), "l"(db), "r"(scale_d))

#define FP8K_WGMMA_N128(TYPES)                                                                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                         \
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32." TYPES " "                                 \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "                                                                          \
                 "%64, %65, p, 1, 1;\n}\n"                                                             \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                                                \
                 : "l"(da), "l"(db), "r"(scale_d))

#define FP8K_WGMMA_N192(TYPES)                                                                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"                                         \
                 "wgmma.mma_async.sync.aligned.m64n192k32.f32." TYPES " "                                 \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "                                                                          \
                 "%96, %97, p, 1, 1;\n}\n"                                                             \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])                                                                                \
                 : "l"(da), "l"(db), "r"(scale_d))

#define FP8K_WGMMA_N256(TYPES)                                                                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                        \
                 "wgmma.mma_async.sync.aligned.m64n256k32.f32." TYPES " "                                 \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "                                                                          \
                 "%128, %129, p, 1, 1;\n}\n"                                                            \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])                                                                                \
                 : "l"(da), "l"(db), "r"(scale_d))

#define FP8K_WGMMA_TYPES(MACRO)                                                                    \
    if constexpr (FA == __NV_E4M3 && FB == __NV_E4M3) {                                           \
        MACRO("e4m3.e4m3");                                                                        \
    } else if constexpr (FA == __NV_E4M3 && FB == __NV_E5M2) {                                    \
        MACRO("e4m3.e5m2");                                                                        \
    } else if constexpr (FA == __NV_E5M2 && FB == __NV_E4M3) {                                    \
        MACRO("e5m2.e4m3");                                                                        \
    } else {                                                                                       \
        MACRO("e5m2.e5m2");                                                                        \
    }

// One m64nBNk32 wgmma: d (+)= A[64 x 32] . B[BN x 32]^T from shared memory descriptors
// (BN 64: the skinny GEMM's, gemm_skinny.cuh).
template <__nv_fp8_interpretation_t FA, __nv_fp8_interpretation_t FB, int BN>
__device__ __forceinline__ void wgmma_fp8(float (&d)[BN / 2], uint64_t da, uint64_t db, int scale_d) {
    if constexpr (BN == 64) {
        FP8K_WGMMA_TYPES(FP8K_WGMMA_N64)
    } else if constexpr (BN == 128) {
        FP8K_WGMMA_TYPES(FP8K_WGMMA_N128)
    } else if constexpr (BN == 192) {
        FP8K_WGMMA_TYPES(FP8K_WGMMA_N192)
    } else {
        static_assert(BN == 256, "BN is 64, 128, 192 or 256");
        FP8K_WGMMA_TYPES(FP8K_WGMMA_N256)
    }
}

// The ring's barriers (one thread, before the CTA's first barrier): full(s) completes on the
// producer's arrival with its bytes (and `full_arrivals - 1` more: the block-scaled kernel's
// scale copies), empty(s) on one arrival per consumer warp (two consumer warpgroups).
template <class Full, class Empty>
__device__ __forceinline__ void init_ring(int stages, Full full, Empty empty, int full_arrivals = 1) {
    for (int s = 0; s < stages; ++s) {
        mbar_init(full(s), full_arrivals);
        mbar_init(empty(s), 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// A consumer's place in the ring of stages: the stage it reads next and the phase of that
// stage's full barrier.
template <int STAGES> struct RingPos {
    int stage = 0;
    uint32_t phase = 0;
    __device__ __forceinline__ void advance() {
        if (++stage == STAGES) {
            stage = 0;
            phase ^= 1u;
        }
    }
};

// One k-block (BK deep) of a consumer's products as one wgmma group: d (+)= the 64 x BK slice
// of the wgmma's A side at shared address `a` times the N x BK slice of its B side at `b` (both
// K-major in TMA's 128-byte swizzle). `add`: d accumulates; otherwise the first k32 step
// overwrites it.
template <__nv_fp8_interpretation_t FA, __nv_fp8_interpretation_t FB, int N>
__device__ __forceinline__ void mma_kblock(float (&d)[N / 2], uint32_t a, uint32_t b, bool add) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 32; ++kk) {
        wgmma_fp8<FA, FB, N>(d, sw128_desc(a + kk * 32), sw128_desc(b + kk * 32), add || kk > 0 ? 1 : 0);
    }
    wgmma_commit();
}

// A consumer's k-blocks [lo, hi) from the ring, summed by the tensor cores (fast accumulation):
// each k-block's group stays in flight while the next one is issued, and its stage is
// released when it retires. `full(stage)` is the stage's full barrier, `ops(stage)` the
// (A, B) addresses of this consumer's operands in it, `issued()` runs once after the first
// k-block is issued (work to hide under it), `release(stage)` frees a stage.
template <__nv_fp8_interpretation_t FA, __nv_fp8_interpretation_t FB, int N, int STAGES,
          class Full, class Ops, class Issued, class Release>
__device__ __forceinline__ void consume_fast(float (&acc)[N / 2], int lo, int hi, RingPos<STAGES> &ring,
                                             Full full, Ops ops, Issued issued, Release release) {
    int held = -1;  // the stage whose group is still in flight
    for (int kb = lo; kb < hi; ++kb) {
        mbar_wait(full(ring.stage), ring.phase);
        const uint2 ab = ops(ring.stage);
        mma_kblock<FA, FB, N>(acc, ab.x, ab.y, true);
        if (kb == lo) issued();
        wgmma_wait1();
        if (held >= 0) release(held);
        held = ring.stage;
        ring.advance();
    }
    wgmma_wait0();
    if (held >= 0) release(held);
}

// One k-block of consume_promoted (FIRST: the range's first, whose products start the sum and
// after whose first group `issued` runs).
template <bool FIRST, __nv_fp8_interpretation_t FA, __nv_fp8_interpretation_t FB, int N, int STAGES,
          class Full, class Ops, class Issued, class Release, class Landed, class Promote>
__device__ __forceinline__ void promoted_kblock(RingPos<STAGES> &ring, Full &full, Ops &ops, Issued &issued,
                                                Release &release, Landed &landed, Promote &promote) {
    constexpr int H = N > 192 ? 2 : 1, NH = N / H;
    mbar_wait(full(ring.stage), ring.phase);
    landed(ring.stage);
    const uint2 ab = ops(ring.stage);
#pragma unroll
    for (int h = 0; h < H; ++h) {
        float part[NH / 2];
        mma_kblock<FA, FB, NH>(part, ab.x, ab.y + h * NH * BK, false);
        if (FIRST && h == 0) issued();
        wgmma_wait0();
        if (h == H - 1) release(ring.stage);
        promote(part, h, FIRST);
    }
    ring.advance();
}

// Pins registers in place against the asm around them (wgmma's issue and waits): the compiler
// may not move their reads and writes across it, so a set of products is read only after the
// wait that retires it, and written (by the next wgmma) only after those reads.
template <int N> __device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// consume_promoted up to 128 columns, pipelined: each k-block's products are issued before the
// previous k-block's are promoted, into two sets of product registers that take turns (p, q;
// 64 + 64 beside the 64 of the sum), so the tensor cores run the next group while the consumer
// adds the last one into the sum (the 192- and 256-wide sums have no registers for a second
// set). The same additions in the same order as consume_promoted: the same bits. A stage is
// released once its group has retired, one k-block later, as in consume_fast; `landed(stage)`
// runs then, just before the release (the block scales of the retired k-block are read there,
// so one set of scale registers serves: the next k-block's are read at its own retirement).
template <__nv_fp8_interpretation_t FA, __nv_fp8_interpretation_t FB, int N, int STAGES,
          class Full, class Ops, class Issued, class Release, class Landed, class Promote>
__device__ __forceinline__ void consume_pipelined(int lo, int hi, RingPos<STAGES> &ring, Full full, Ops ops,
                                                  Issued issued, Release release, Landed landed,
                                                  Promote promote) {
    static_assert(N <= 128, "two sets of products beside the sum fit up to 128 columns");
    if (lo >= hi) return;
    float p[N / 2], q[N / 2];
    // Issues the next k-block into d; returns its stage.
    auto issue = [&](float(&d)[N / 2]) {
        mbar_wait(full(ring.stage), ring.phase);
        const uint2 ab = ops(ring.stage);
        fence_regs(d);
        mma_kblock<FA, FB, N>(d, ab.x, ab.y, false);
        const int st = ring.stage;
        ring.advance();
        return st;
    };
    // Waits for all but `in_flight` groups; reads what else the retired one's stage holds,
    // releases it and adds its products.
    auto retire = [&](float(&d)[N / 2], int st, bool in_flight, bool first) {
        if (in_flight) {
            wgmma_wait1();
        } else {
            wgmma_wait0();
        }
        fence_regs(d);
        landed(st);
        release(st);
        promote(d, 0, first);
    };
    int sp = issue(p);
    issued();
    if (lo + 1 == hi) {
        retire(p, sp, false, true);
        return;
    }
    int sq = issue(q);
    retire(p, sp, true, true);
    int kb = lo + 2;
    for (; kb + 1 < hi; kb += 2) {
        sp = issue(p);
        retire(q, sq, true, false);
        sq = issue(q);
        retire(p, sp, true, false);
    }
    if (kb < hi) {
        sp = issue(p);
        retire(q, sq, true, false);
        retire(p, sp, false, false);
    } else {
        retire(q, sq, false, false);
    }
}

// consume_fast with each k-block's products promoted into the f32 sum by `promote(part, h,
// first)` after its group retires (`first`: the range's first k-block, whose products start
// the sum instead of adding to it; a constant at each call, so each inlined copy is
// specialised); `landed(stage)` runs when the k-block's stage has landed, before
// its products are issued (reads of what else the stage holds, complete before
// `release(stage)`). Up to 192 columns a k-block's products are one group (h = 0, part: N / 2
// products per thread); 256 columns' would not fit in registers beside the sum, so they are
// two groups of 128 columns (h = 0, 1; part: 64 products a thread, columns 128 h .. + 127 of
// the tile), the stage released after the second.
template <__nv_fp8_interpretation_t FA, __nv_fp8_interpretation_t FB, int N, int STAGES,
          class Full, class Ops, class Issued, class Release, class Landed, class Promote>
__device__ __forceinline__ void consume_promoted(int lo, int hi, RingPos<STAGES> &ring, Full full, Ops ops,
                                                 Issued issued, Release release, Landed landed,
                                                 Promote promote) {
    // The first k-block apart, so that the loop holds none of its work (the tile lookup, a
    // deferred epilogue, the sum's start).
    if (lo >= hi) return;
    promoted_kblock<true, FA, FB, N>(ring, full, ops, issued, release, landed, promote);
    for (int kb = lo + 1; kb < hi; ++kb) {
        promoted_kblock<false, FA, FB, N>(ring, full, ops, issued, release, landed, promote);
    }
}

// Two consecutive outputs: read (for accumulation) and written as one 8- or 4-byte access.
template <typename Out> __device__ __forceinline__ float2 load2(const Out *p);
template <> __device__ __forceinline__ float2 load2<float>(const float *p) {
    return *reinterpret_cast<const float2 *>(p);
}
template <> __device__ __forceinline__ float2 load2<__nv_bfloat16>(const __nv_bfloat16 *p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(p));
}
template <typename Out> __device__ __forceinline__ void store2(Out *p, float a, float b);
template <> __device__ __forceinline__ void store2<float>(float *p, float a, float b) {
    *reinterpret_cast<float2 *>(p) = make_float2(a, b);
}
template <> __device__ __forceinline__ void store2<__nv_bfloat16>(__nv_bfloat16 *p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162 *>(p) = __floats2bfloat162_rn(a, b);
}

__device__ __forceinline__ float bias_at(const void *bias, int kind, int c) {
    if (kind == 1) return __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(bias)[c]);
    if (kind == 2) return reinterpret_cast<const float *>(bias)[c];
    return 0.0f;
}
#endif

// How the problem's tiles and reductions are laid out (the `MODE` of gemm below).
enum Mode : int {
    // Groups of [m, k] A and [n, k] B blocks, D [groups, m, n]; rows of group g below
    // min(counts[g], m) (all m when counts is null).
    GROUPED = 0,
    // The packed layout (forward and data gradient): `counts` holds groups + 1 offsets, m is
    // the capacity, A one [m, k] block, D one [m, n] block, group g's rows offsets[g] ..
    // offsets[g + 1].
    PACKED = 1,
    // The packed weight gradient: A [m, k] and B [n, k] with k the capacity (the transposed
    // packed buffers), D [groups, m, n]; group g reduces over k in offsets[g] .. offsets[g + 1]
    // (multiples of BK). A group with no k-block leaves D[g] unchanged when accumulating and
    // writes +0 otherwise.
    WGRAD = 2,
};

// The tiles of the weight gradient: every (g, mt, nt), group-major, then row-major (n
// fastest): a wave of CTAs writes whole rows of D, one contiguous stretch of memory (3% faster
// than the bands of tile_at, which favour reuse of A and B in L2: the weight gradient's
// operands are small, its f32 output large).
__device__ __forceinline__ Tile wgrad_tile_at(int t, int m, int ntiles) {
    const int per = ((m + BM - 1) / BM) * ntiles;
    const int g = t / per, rem = t - g * per;
    return Tile{g, rem / ntiles, rem % ntiles};
}

// dims = (m, n, k, groups); flags = (sa index, sb index, bias kind 0/1 bf16/2 f32, epilogue):
// flags.w bit 0 accumulates into D, bit 1 takes the store epilogue through `td`, a tensor
// map of D as [groups, rows, n] (PACKED: [1, m, n]) with boxes of 64 rows x
// StoreBox<Out>::COLS columns, 128-byte swizzle (both bits: reduce-add of the boxes); the host
// sets bit 1 with bit 0 only for an f32 D. GROUPED with counts stores through `td` only tiles
// whose every row lies below the group's count (the others from registers). Bit 2 gives
// the bulk copies L2 eviction hints (PACKED: B leaves first; WGRAD: A and B stay, D leaves
// first).
// `sbg`, when not null, holds one scale_inv per group of B (instead of sb[flags.y]).
// FAST: fast accumulation (TransformerEngine's fprop default, cuBLASLt's FAST_ACCUM): the
// tensor cores accumulate over the whole reduction in their own accumulator, one k-block's
// wgmma group in flight while the next is issued. Otherwise (promotion, as DeepGEMM does)
// each k-block's products go to a fresh accumulator, waited for and added in f32.
// BLOCK: block scaling (DeepSeek-V3's 1x128 activations, 128x128 weights; BN 128, 192 or 256
// (bf16 out), one group, promoted): `sa` holds A's scale_inv per (row, k-block) `[m, kbt]`, `sb` B's per
// (128-row block, k-block) `[ceil(n / 128), kbt]`, kbt = ceil(k / 128); each k-block's products
// are scaled by sa[row, kb] * sb[column / 128, kb] as they are added to the f32 sum (alpha 1).
// 192- and 256-wide tiles span two of B's blocks; see `BlockScales`.
// The block scales of one k-block (BLOCK), a stage's worth in shared memory beside the ring
// (BLOCK_SCALE_BYTES a stage): A's scale_inv for the tile's BM rows (0 at rows at or past m),
// then B's for the tile's first 128-column block ("lo") and the next ("hi": the last block's
// where there is no next). The producer's second warp copies them with cp.async, each lane's
// completion an arrival on the stage's full barrier, so a consumer reads them from shared
// memory once the stage has landed. (Loaded by the consumers from global memory one k-block
// ahead, ptxas moved B's two into uniform registers right after issuing their loads: a wait
// for L2 before every k-block's products, 0.78-0.83x of the per-tensor kernel.)
constexpr int BLOCK_SCALE_BYTES = 4 * (BM + 4);  // 528: 16-byte multiple
// B's blocks under tile nt (BN wide): its first and the next, clamped to B's last. A 192-wide
// tile starts at column 192 nt = 128 b + 64 (nt odd) or 128 b (even); a 256-wide one at
// 128 (2 nt).
template <int BN> __device__ __forceinline__ int2 b_blocks(int nt, int n) {
    const int nblk = (n + 127) / 128;
    const int b = BN == 128 ? nt : BN == 192 ? (3 * nt) / 2 : 2 * nt;
    return make_int2(b, min(b + 1, nblk - 1));
}
// The block scales one consumer thread applies to a k-block: its two rows' A scales and the B
// scales of its tile's columns. A 128-wide tile is one of B's 128-column blocks; a 192-wide
// tile's column pairs 8p .. 8p + 7 lie in block b for p < 8, in block b + 1 for p >= 16 and,
// for 8 <= p < 16, in b (nt even) or b + 1 (odd): three B scales ("lo", "mid", "hi") chosen
// per p at compile time. A 256-wide tile's first 128 columns (p < 16) are block b's, the rest
// block b + 1's: each of consume_promoted's halves has one B scale.
template <int BN>
struct BlockScales {
    static_assert(BN == 128 || BN == 192 || BN == 256, "block-scaled tile width");
    float r0, r1, lo, mid, hi;
    // From a stage's scales (`at`, BLOCK_SCALE_BYTES): rows rl and rl + 8 of the tile.
    __device__ __forceinline__ void read(const float *at, int rl, int nt) {
        r0 = at[rl];
        r1 = at[rl + 8];
        lo = at[BM];
        hi = BN == 128 ? lo : at[BM + 1];
        mid = BN == 128 || (BN == 192 && (nt & 1) == 0) ? lo : hi;
    }
    // The values in registers (their shared-memory reads complete) from here on: before the
    // stage that holds them is released to the producer.
    __device__ __forceinline__ void settle() const {
        asm volatile("" ::"f"(r0), "f"(r1), "f"(lo), "f"(hi));
    }
    // The six factors sa[row] * sb[block]: {r0 lo, r0 mid, r0 hi, r1 lo, r1 mid, r1 hi}.
    struct Products {
        float v[6];
        // The factor of column group p (compile-time after unrolling) in row rl (+ 8 if `second`).
        __device__ __forceinline__ float at(int p, bool second) const {
            const int region = BN == 256 ? (p < 16 ? 0 : 2) : p < 8 ? 0 : (p < 16 ? 1 : 2);
            return v[(second ? 3 : 0) + region];
        }
    };
    __device__ __forceinline__ Products products() const {
        return Products{{r0 * lo, r0 * mid, r0 * hi, r1 * lo, r1 * mid, r1 * hi}};
    }
};

// One 4-byte cp.async into shared memory, `bytes` (4, or 0: zeros) read from `src`.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void *src, uint32_t bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes)
                 : "memory");
}
// An arrival on `bar` once this thread's cp.asyncs so far have landed (counted in the
// barrier's expected arrivals: noinc).
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// SWIGLU (PACKED, bf16 D, BN 128 or 256, the store epilogue, not accumulating; n / 2 a
// multiple of BN / 2): tile nt computes gate columns nt * BN / 2 .. + BN / 2 (its first
// half, B rows from the first half of each group's weight) and the up columns F = n / 2
// further (its second half), so each thread holds both inputs of its SwiGLU outputs. The
// epilogue stores the two halves to their columns of D, then h = cast(silu(gate) * up) of
// the bf16-rounded values (bit for bit what the SwiGLU cast computes reading D) into `sw`,
// through the consumer's staging (after D's boxes have been read from it) with TMA stores of
// 64 x 64-byte boxes. (Written from registers, a warp's 2-byte and 1-byte stores scattered
// over 8 and 4 sectors each, the fused kernel took 41.9 us at T = 256 against 28.5 + 5.8 for
// the GEMM and the SwiGLU cast apart.)
template <__nv_fp8_interpretation_t FA, __nv_fp8_interpretation_t FB, typename Out, int BN,
          int MODE = GROUPED, bool FAST = false, bool BLOCK = false, bool SWIGLU = false>
__device__ __forceinline__ void gemm(const TmaDesc *ta, const TmaDesc *tb, const TmaDesc *td, Out *d,
                                     const void *bias, const float *sa, const float *sb,
                                     const int *counts, uint4 dims, uint4 flags,
                                     const float *sbg = nullptr, const SwigluOut *sw = nullptr) {
#ifdef FP8K_SM90A
    using C = Cfg<BN, Out, BLOCK ? BLOCK_SCALE_BYTES : 0>;
    // 256 columns hold 128 accumulator registers per thread: room for a 128-column promotion
    // accumulator beside them only (consume_promoted's halves), plain per-tensor sums only.
    static_assert(FAST || BN <= 192 || !SWIGLU, "BN 256, promoted: no fused SwiGLU");
    constexpr int STAGES = C::STAGES, STAGE_BYTES = C::STAGE_BYTES;
    constexpr int NACC = BN / 2;  // accumulator registers per thread
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = smem_u32(smem_raw);
    // Kept in a register (opaque): otherwise the compiler re-derives the shared window address
    // (S2UR of the CTA id and its latency) at every k-block of the main loops.
    const uint32_t base = opaque_u32((raw + 1023u) & ~1023u);
    const uint32_t staging = base + STAGES * STAGE_BYTES;
    const uint32_t bars = staging + C::STAGING;
    int *const offsets_smem = reinterpret_cast<int *>(smem_raw + (bars + 16u * STAGES - raw));
    // BLOCK: each stage's block scales (BlockScales), after the offsets.
    const uint32_t scale_ring = bars + 16u * STAGES + 4u * OFFSETS_CACHED;
    auto scales_at = [&](int s) { return scale_ring + uint32_t(s) * BLOCK_SCALE_BYTES; };
    auto full = [&](int s) { return bars + 8u * s; };
    auto empty = [&](int s) { return bars + 8u * (STAGES + s); };
    auto tile_a = [&](int s) { return base + s * STAGE_BYTES; };
    auto tile_b = [&](int s) { return base + s * STAGE_BYTES + TILE_A; };

    const int m = int(dims.x), n = int(dims.y), k = int(dims.z), groups = int(dims.w);
    const int ntiles = (n + BN - 1) / BN;
    const int kblocks = (k + BK - 1) / BK;
    const int kbt = kblocks;  // BLOCK: k-blocks per row of the block scales
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(ta)) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(tb)) : "memory");
        if (flags.w & 2u) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(td)) : "memory");
        }
        if constexpr (SWIGLU) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(sw->ty)) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(sw->tyt)) : "memory");
        }
        // BLOCK: the 32 lanes of the scale copier arrive on full(s) beside the producer.
        init_ring(STAGES, full, empty, BLOCK ? 1 + 32 : 1);
    }
    __syncthreads();
    // Programmatic dependent launch: the set-up above overlaps the previous kernel's tail;
    // counts, scales, A, B and D are touched only after the wait.
    cuda_graph::pdl_enter();
    // The packed layout's offsets: in shared memory for fewer than OFFSETS_CACHED groups (one
    // round trip here instead of one per step of every lookup's search).
    const int *offsets = counts;
    if constexpr (MODE == PACKED) {
        if (groups < OFFSETS_CACHED) {
            for (int i = threadIdx.x; i <= groups; i += blockDim.x) offsets_smem[i] = __ldg(counts + i);
            __syncthreads();
            offsets = offsets_smem;
        }
    }
    const int total = MODE == PACKED  ? packed_mtiles(offsets, groups, m) * ntiles
                      : MODE == WGRAD ? groups * ((m + BM - 1) / BM) * ntiles
                                      : total_tiles(counts, groups, m, ntiles);
    auto whole_tile = [&](int t) {
        return MODE == PACKED  ? packed_tile_at(t, offsets, groups, m, ntiles)
               : MODE == WGRAD ? wgrad_tile_at(t, m, ntiles)
                               : tile_at(t, counts, groups, m, ntiles);
    };
    // HALVES: the last wave's R tiles as 2R halves (tail_halves). Work item t of `units`: the
    // whole tiles below total - R, then the halves, two a tile (CTAs 2i and 2i + 1 share its A).
    constexpr bool HALVES = BN == 256 && MODE != WGRAD && !BLOCK && !SWIGLU;
    const int tail = HALVES ? tail_halves(total, int(gridDim.x)) : 0;
    const int units = total + tail;
    auto tile = [&](int t) {
        if (HALVES && t >= total - tail) {
            const int u = t - (total - tail);
            Tile tl = whole_tile(total - tail + u / 2);
            tl.half = 1 + (u & 1);
            return tl;
        }
        return whole_tile(t);
    };
    // The k-blocks of a tile: all of K, or (WGRAD) the group's reduction range, offsets
    // clamped to [0, k] and taken in whole blocks.
    struct KRange {
        int lo, hi;
    };
    auto krange = [&](const Tile &tl) {
        if constexpr (MODE == WGRAD) {
            const int lo = packed_offset(offsets, tl.g, k);
            const int hi = max(lo, packed_offset(offsets, tl.g + 1, k));
            return KRange{lo / BK, (hi + BK - 1) / BK};
        } else {
            return KRange{0, kblocks};
        }
    };

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (threadIdx.x == 0) {
            int stage = 0;
            uint32_t phase = 0;
            // L2 hints (flags.w bit 2): the weight gradient's operands (each box read by many
            // tiles) stay in L2 over its output stream (see the epilogue's `out_hint`); the
            // packed layout's weights (B, each box read by about one tile) leave first.
            const bool hints = (flags.w & 4u) != 0;
            const L2Hint a_hint = MODE == WGRAD && hints ? l2_evict_last() : NO_HINT;
            const L2Hint b_hint = MODE == WGRAD ? a_hint
                                  : MODE == PACKED && hints ? l2_evict_first()
                                                            : NO_HINT;
            for (int t = blockIdx.x; t < units; t += gridDim.x) {
                const Tile tl = tile(t);
                const KRange kr = krange(tl);
                for (int kb = kr.lo; kb < kr.hi; ++kb) {
                    mbar_wait(empty(stage), phase ^ 1u);
                    mbar_expect_tx(full(stage), tl.half ? TILE_A + C::TILE_B / 2 : STAGE_BYTES);
                    tma_load_3d(tile_a(stage), ta, full(stage), kb * BK, tl.mt * BM,
                                MODE == GROUPED ? tl.g : 0, a_hint);
                    if constexpr (SWIGLU) {
                        // Two boxes of BN / 2 rows (the map's box): gate rows, then up rows.
                        const int f0 = tl.nt * (BN / 2);
                        tma_load_3d(tile_b(stage), tb, full(stage), kb * BK, f0, tl.g, b_hint);
                        tma_load_3d(tile_b(stage) + (BN / 2) * BK, tb, full(stage), kb * BK,
                                    n / 2 + f0, tl.g, b_hint);
                    } else if constexpr (HALVES) {
                        // Boxes of BN / 2 rows (the map's box): both, or the half's alone.
                        const int r0 = tl.nt * BN + (tl.half == 2 ? BN / 2 : 0);
                        tma_load_3d(tile_b(stage), tb, full(stage), kb * BK, r0, tl.g, b_hint);
                        if (tl.half == 0) {
                            tma_load_3d(tile_b(stage) + (BN / 2) * BK, tb, full(stage), kb * BK,
                                        r0 + BN / 2, tl.g, b_hint);
                        }
                    } else {
                        tma_load_3d(tile_b(stage), tb, full(stage), kb * BK, tl.nt * BN,
                                    MODE == WGRAD ? 0 : tl.g, b_hint);
                    }
                    if (++stage == STAGES) {
                        stage = 0;
                        phase ^= 1u;
                    }
                }
            }
        }
        if constexpr (BLOCK) {
            // The scale copier (the producer's second warp): each stage's block scales
            // (BlockScales) into its slot, 4 of A's rows and one of B's blocks a lane, rows at
            // or past m as zeros.
            if (threadIdx.x / 32 == 1) {
                const int lane = threadIdx.x % 32;
                RingPos<STAGES> pos;
                for (int t = blockIdx.x; t < units; t += gridDim.x) {
                    const Tile tl = tile(t);
                    const int2 bb = b_blocks<BN>(tl.nt, n);
                    const int blk = lane == 0 ? bb.x : bb.y;
                    const KRange kr = krange(tl);  // the producer's k-blocks, stage for stage
                    for (int kb = kr.lo; kb < kr.hi; ++kb) {
                        mbar_wait(empty(pos.stage), pos.phase ^ 1u);
                        const uint32_t at = scales_at(pos.stage);
#pragma unroll
                        for (int j = 0; j < BM / 32; ++j) {
                            const int r = lane + 32 * j, row = tl.mt * BM + r;
                            const bool in = row < m;
                            cp_async4(at + 4u * r, sa + (in ? size_t(row) * kbt + kb : 0), in ? 4u : 0u);
                        }
                        if (lane < 2) cp_async4(at + 4u * (BM + lane), sb + size_t(blk) * kbt + kb, 4u);
                        cp_async_arrive(full(pos.stage));
                        pos.advance();
                    }
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
        const int cw = wg - 1;  // which 64-row half of the tile
        const int t128 = threadIdx.x - 128 * wg;
        const int warp = t128 / 32, lane = t128 % 32;
        static_assert(!BLOCK || ((BN == 128 || BN == 192 || (BN == 256 && sizeof(Out) == 2)) &&
                                 !FAST && MODE == GROUPED),
                      "block scaling");
        const float sa_v = BLOCK ? 1.0f : sa[flags.x];
        const float sb_v = BLOCK || sb == nullptr ? 1.0f : sb[flags.y];
        const int bias_kind = bias == nullptr ? 0 : int(flags.z);
        const bool accumulate = (flags.w & 1u) != 0;
        const bool store_epilogue = (flags.w & 2u) != 0;
        // This consumer's staging (64 x BN outputs) and the thread that issues its stores.
        const uint32_t stage_out = staging + cw * (C::STAGING / 2);
        uint8_t *const stage_ptr = smem_raw + (stage_out - raw);
        const bool issuer = t128 == 0;
        // L2 hints (flags.w bit 2): the weight gradient's D, written once and most of its
        // traffic at a k-block or two a tile, leaves L2 before its operands (the host's
        // WGRAD_STREAM_ROWS has the figures).
        const L2Hint out_hint =
            MODE == WGRAD && issuer && (flags.w & 4u) != 0 ? l2_evict_first() : NO_HINT;
        static_assert(!SWIGLU || (MODE == PACKED && !BLOCK && (BN == 128 || BN == 256) &&
                                  sizeof(Out) == 2),
                      "fused SwiGLU");
        // The D column of tile tl's column tc (SWIGLU: gate half, then up half; a tail half:
        // its column tc, of BN / 2).
        auto dcol = [&](const Tile &tl, int tc) {
            if constexpr (SWIGLU) {
                return (tc >= BN / 2 ? n / 2 : 0) + tl.nt * (BN / 2) + tc % (BN / 2);
            } else {
                return tl.nt * BN + tc + (HALVES && tl.half == 2 ? BN / 2 : 0);
            }
        };
        // Whether tile tl holds its column tc (a tail half: the first BN / 2; the products
        // in acc[0 .. NACC / 2)).
        auto holds = [&](const Tile &tl, int tc) { return !HALVES || tl.half == 0 || tc < BN / 2; };
        // SWIGLU: the cast's scale (waited for at the first epilogue), and this thread's max
        // |h| over its tiles.
        float sw_scale = 1.0f;
        unsigned sw_amax = 0;
        if constexpr (SWIGLU) sw_scale = *sw->scale;
        RingPos<STAGES> ring;
        // Ping-pong (the f32 weight gradient at 128 columns, the instance `wgrad_bn` takes for
        // few rows a group): on a tile of at most STAGES k-blocks the consumers take turns at
        // the tensor cores: consumer 1's products after consumer 0's (named barrier 3),
        // consumer 0's next tile's after consumer 1's (barrier 4), so that each one's epilogue
        // runs under the other's products instead of both epilogues at once with the tensor
        // cores idle (at small T a tile is one k-block and the f32 epilogue most of its
        // time). Both consumers decide it per tile from the same k-range. With more k-blocks
        // than stages they run side by side as before: consumer 0 alone can not take all of
        // a tile's k-blocks before consumer 1 releases a stage. On an H200, 8 x 4096 x 2048
        // with 128 rows a group: 75 us against 81 (f32); the bf16 weight gradient (a shorter
        // epilogue) lost 4-5 us a T = 256 step with it, so only this instance takes turns.
        constexpr bool PINGPONG = MODE == WGRAD && sizeof(Out) == 4 && BN == 128;
        constexpr int ORDER_01 = 3, ORDER_10 = 4;
        auto ordered = [&](const KRange &r) {
            return PINGPONG && r.hi > r.lo && r.hi - r.lo <= STAGES;
        };
        bool prev_ordered = false;  // consumer 0: its previous tile took turns
        // The next tile is worked out while the tensor cores run this tile's first k-block
        // (its binary search and divisions would otherwise stall both consumers, and the
        // tensor cores, at every tile start).
        auto tile_after = [&](int t) {
            const int u = t + int(gridDim.x);
            return u < units ? tile(u) : Tile{-1, 0, 0};
        };
        // The f32 sum of this consumer's 64 x BN of the tile.
        float acc[NACC];
        // Whether tile tl takes the store epilogue. Grouped blocks with counts: the store
        // epilogue writes whole tiles, so only a tile whose rows all lie below its group's count
        // takes it.
        auto takes_store = [&](const Tile &tl) {
            bool tile_store = store_epilogue;
            if constexpr (MODE == GROUPED) {
                if (tile_store && counts != nullptr) {
                    const int rows_g = min(max(__ldg(counts + tl.g), 0), m);
                    tile_store = (tl.mt + 1) * BM <= rows_g;
                }
            }
            return tile_store;
        };
        // Tile tl's epilogue: acc times alpha_t plus the bias of kind bk (0: none) into D.
        // `deferred`: a tile known to take the store epilogue, without a bias (constants there,
        // so that inlined copy holds neither the bias nor the register epilogue).
        auto epilogue = [&](const Tile &tl, float alpha_t, int bk, bool deferred) {
            if (deferred || takes_store(tl)) {
                // Thread (warp, lane) holds rows rl and rl + 8 (rl = warp * 16 + lane / 4) and
                // the column pairs c0 + 8 p (c0 = 2 (lane % 4), p < BN / 8) of the consumer's
                // 64 x BN: acc[4p], acc[4p + 1] in row rl, acc[4p + 2], acc[4p + 3] in row rl + 8.
                // In the box of its columns (COLS wide, 128-byte rows), a row's 16-byte chunk q
                // sits at chunk q ^ (row % 8): a warp's 8 rows then hit distinct banks per chunk
                // (a full-speed store). Column pair p's byte in its box row is
                // c0 * SZ + ((8 p) % COLS) * SZ, the second term a multiple of 16, so its chunk is
                // ((8 p) % COLS) * SZ / 16 ^ (c0 * SZ / 16): all that varies with p is a
                // compile-time constant XORed into a per-thread one (y), and the unrolled stores
                // take immediate offsets. Bias columns are loaded first, in one uniform branch
                // (loads can not move past the stores), and only when there is a bias: without
                // one this is 2 FFMA, a convert (bf16) and one store per pair.
                // The tile goes through the staging in PARTS parts (Cfg): each waits until the
                // copy engine has read the staging (the previous part's or tile's stores), fills
                // it, and has its boxes stored.
                constexpr int COLS = StoreBox<Out>::COLS, SZ = int(sizeof(Out)), PAIRS = BN / 8;
                constexpr int PARTS = C::PARTS, PART_PAIRS = PAIRS / PARTS;
                constexpr int PART_BOXES = BN / COLS / PARTS;
                static_assert(PART_PAIRS * 8 == PART_BOXES * COLS, "a part is whole boxes");
                const int rl = warp * 16 + lane / 4, c0 = 2 * (lane % 4);
                uint8_t *const row_base = stage_ptr + rl * 128 + ((c0 * SZ) & 15);
                const int y = ((c0 * SZ) >> 4) ^ (rl & 7);
                const int row = tl.mt * BM + cw * 64;
                const int g = MODE == PACKED ? 0 : tl.g;
                auto store_tile = [&](auto bias_of) {
#pragma unroll
                    for (int part = 0; part < PARTS; ++part) {
                        // (A tail half: its BN / 2 columns, the first half of the parts.)
                        static_assert(!HALVES || PARTS % 2 == 0, "a tail half is whole parts");
                        if (!holds(tl, part * (BN / PARTS))) break;
                        if (issuer) bulk_wait_read();
                        named_sync(1 + cw, 128);
#pragma unroll
                        for (int pp = 0; pp < PART_PAIRS; ++pp) {
                            const int p = part * PART_PAIRS + pp;
                            const float2 bv = bias_of(p);
                            const int chunk = ((((8 * p) % COLS) * SZ) >> 4) ^ y;
                            const int box = 8 * p / COLS - part * PART_BOXES;
                            uint8_t *const at = row_base + box * StoreBox<Out>::BYTES + chunk * 16;
                            // As the register epilogue rounds: alpha * acc + bias (+0 without one).
                            store2<Out>(reinterpret_cast<Out *>(at), alpha_t * acc[4 * p] + bv.x,
                                        alpha_t * acc[4 * p + 1] + bv.y);
                            store2<Out>(reinterpret_cast<Out *>(at + 8 * 128), alpha_t * acc[4 * p + 2] + bv.x,
                                        alpha_t * acc[4 * p + 3] + bv.y);
                        }
                        fence_async_shared();
                        named_sync(1 + cw, 128);
                        if (issuer) {
#pragma unroll
                            for (int q = 0; q < PART_BOXES; ++q) {
                                const int col = dcol(tl, (part * PART_BOXES + q) * COLS);
                                if (col >= n) continue;
                                const uint32_t box = stage_out + q * StoreBox<Out>::BYTES;
                                tma_store_3d(td, box, col, row, g, accumulate, out_hint);
                            }
                            bulk_commit();
                        }
                    }
                    if constexpr (SWIGLU) {
                        // h of gate pair p (tile columns c0 + 8 p) and up pair p + PAIRS / 2,
                        // from D's values as stored (bf16-rounded), in rows rl and rl + 8 of
                        // this consumer's 64: into the staging (once the copy engine has read
                        // D's last part) as HB / 64 row-major boxes of y, then as many boxes
                        // of yt, each 64 x 64 bytes (box64), stored by the copy engine.
                        constexpr int HB = BN / 2, HBOX = HB / 64;
                        static_assert(2 * HBOX * BOX64 <= C::STAGING / 2, "h fits the staging");
                        if (issuer) bulk_wait_read();
                        named_sync(1 + cw, 128);
                        uint8_t *const ys = stage_ptr, *const yts = stage_ptr + HBOX * BOX64;
                        auto bf16r = [](float v) { return __bfloat162float(__float2bfloat16_rn(v)); };
#pragma unroll
                        for (int p = 0; p < PAIRS / 2; ++p) {
                            const int q = p + PAIRS / 2;
                            const float2 bg = bias_of(p), bu = bias_of(q);
                            float h[4];
#pragma unroll
                            for (int i = 0; i < 4; ++i) {
                                const float g = bf16r(alpha_t * acc[4 * p + i] + ((i & 1) ? bg.y : bg.x));
                                const float u = bf16r(alpha_t * acc[4 * q + i] + ((i & 1) ? bu.y : bu.x));
                                h[i] = swiglu_f32(g, u);
                                sw_amax = max(sw_amax, abs_bits(h[i]));
                            }
                            const unsigned short v0 = __nv_cvt_float2_to_fp8x2(
                                make_float2(h[0] * sw_scale, h[1] * sw_scale), __NV_SATFINITE, __NV_E4M3);
                            const unsigned short v1 = __nv_cvt_float2_to_fp8x2(
                                make_float2(h[2] * sw_scale, h[3] * sw_scale), __NV_SATFINITE, __NV_E4M3);
                            // Column c0 + 8 p of the h tile: box p / 8 (c0 + 8 (p % 8) < 64).
                            const int bo = (p / 8) * BOX64, cc = c0 + 8 * (p % 8);
                            put_pair(ys + bo, rl, cc, v0);
                            put_pair(ys + bo, rl + 8, cc, v1);
                            put_pair_t(yts + bo, cc, rl, v0);
                            put_pair_t(yts + bo, cc, rl + 8, v1);
                        }
                        fence_async_shared();
                        named_sync(1 + cw, 128);
                        if (issuer) {
                            const int f0 = tl.nt * HB;
#pragma unroll
                            for (int j = 0; j < HBOX; ++j) {
                                tma_store_3d(sw->ty, stage_out + j * BOX64, f0 + 64 * j, row, 0);
                                tma_store_3d(sw->tyt, stage_out + (HBOX + j) * BOX64, row, f0 + 64 * j, 0);
                            }
                            bulk_commit();
                        }
                    }
                };
                if (bk == 0) {
                    store_tile([](int) { return make_float2(0.0f, 0.0f); });
                } else {
                    float2 bias_v[PAIRS];
#pragma unroll
                    for (int p = 0; p < PAIRS; ++p) {
                        const int gc = dcol(tl, c0 + 8 * p);  // even, like n: gc + 1 < n too
                        bias_v[p] = make_float2(0.0f, 0.0f);
                        if (gc < n) bias_v[p] = make_float2(bias_at(bias, bk, gc), bias_at(bias, bk, gc + 1));
                    }
                    store_tile([&](int p) { return bias_v[p]; });
                }
                return;
            }
            // Register epilogue: rows below the group's count, columns below n.
            // Packed: row indices are absolute, the bound is the group's end.
            const int rows = MODE == PACKED    ? packed_offset(offsets, tl.g + 1, m)
                             : MODE == WGRAD || counts == nullptr ? m
                                                 : min(max(__ldg(counts + tl.g), 0), m);
            const int row0 = tl.mt * BM + cw * 64 + warp * 16 + lane / 4;
            const int col0 = 2 * (lane % 4);  // in the tile
            Out *dg = MODE == PACKED ? d : d + size_t(tl.g) * size_t(m) * size_t(n);
            // In chunks of EPI pairs: first every load the chunk needs (bias, and D when
            // accumulating), independent of each other, then the stores. Loads interleaved
            // with stores to the same array run one round trip at a time (the compiler can not
            // move a load above a possibly aliasing store): an accumulating 256x128x16 took
            // 9.5 us that way.
            constexpr int EPI = 8;
            static_assert((NACC / 2) % EPI == 0, "epilogue chunks");
#pragma unroll
            for (int j0 = 0; j0 < NACC / 2; j0 += EPI) {
                float2 bv[EPI], old[EPI];
#pragma unroll
                for (int q = 0; q < EPI; ++q) {
                    const int j = j0 + q;
                    const int tc = col0 + 8 * (j >> 1);
                    const int r = row0 + 8 * (j & 1), c = dcol(tl, tc);
                    bv[q] = make_float2(0.0f, 0.0f);
                    old[q] = make_float2(0.0f, 0.0f);
                    if (r < rows && c < n && holds(tl, tc)) {
                        bv[q] = make_float2(bias_at(bias, bk, c), bias_at(bias, bk, c + 1));
                        if (accumulate) old[q] = load2<Out>(dg + size_t(r) * size_t(n) + c);
                    }
                }
#pragma unroll
                for (int q = 0; q < EPI; ++q) {
                    const int j = j0 + q;
                    const int tc = col0 + 8 * (j >> 1);
                    const int r = row0 + 8 * (j & 1), c = dcol(tl, tc);
                    if (r < rows && c < n && holds(tl, tc)) {
                        // (alpha * acc + bias) + old: the rounding order of the unsplit form.
                        float a = alpha_t * acc[2 * j] + bv[q].x, b = alpha_t * acc[2 * j + 1] + bv[q].y;
                        if (accumulate) {
                            a += old[q].x;
                            b += old[q].y;
                        }
                        store2<Out>(dg + size_t(r) * size_t(n) + c, a, b);
                    }
                }
            }
        };
        // The promoted sums' epilogues run under the next tile's first products: a tile's epilogue
        // is held (pend) until the consumer has issued the next tile's first wgmma group, whose
        // products go to registers of their own (consume_promoted's part, consume_pipelined's p)
        // while the sum is stored, and the sum then starts from them (promote's `first`). The
        // tensor cores then do not wait for the epilogue between tiles. On an H200: 8192^3 at 1.02x
        // cuBLASLt in four runs (0.94-0.99x before), the packed fc1 forward and data gradient
        // at T = 4096 3-5% faster (docs/perf-notes.md). With the first k-block's work inside
        // consume_promoted's loop, the loop got slower than the epilogue it hid; hence
        // promoted_kblock's peeled first k-block. Only tiles that take the store epilogue, without
        // a bias (the bias columns' and the register epilogue's registers beside both sets of
        // products would not fit in 232), up to 192 columns (256: 128 + 64 products, and spills),
        // not the block-scaled sums (their scales hold registers too), and not the ping-pong weight
        // gradient, whose consumers take whole tiles in turns. Fast accumulation keeps one
        // accumulator, so its epilogue runs in place, and zeroes it at each tile's start; the
        // per-tensor promoted sums start from their first products (promote's `first`). The
        // block-scaled sums zero it too: started from the first products, the 256-wide one
        // spilled 164 bytes (and ran 4-5% slower at 4096 x 7168 x 4096 on an H200).
        constexpr bool DEFER = !FAST && !PINGPONG && !BLOCK && BN <= 192;
        // Promoted sums up to 128 columns: consume_pipelined.
        constexpr bool PIPELINED = !FAST && BN <= 128;
        // Group g's alpha (sa * sb, or sa * sbg[g]).
        auto alpha_of = [&](int g) { return sa_v * (sbg != nullptr ? __ldg(sbg + g) : sb_v); };
        // The held tile (g < 0: none). Never an empty reduction, so its alpha is its group's.
        Tile pend{-1, 0, 0};
        auto flush = [&] {
            if constexpr (DEFER) {
                if (pend.g >= 0) {
                    epilogue(pend, alpha_of(pend.g), 0, true);
                    pend.g = -1;
                }
            }
        };
        Tile tl = int(blockIdx.x) < units ? tile(int(blockIdx.x)) : Tile{-1, 0, 0}, next = tl;
        for (int t = blockIdx.x; t < units; t += gridDim.x, tl = next) {
            const float alpha = alpha_of(tl.g);  // (loaded under the main loop)
            if constexpr (FAST || BLOCK) {
#pragma unroll
                for (int i = 0; i < NACC; ++i) acc[i] = 0.0f;
            }
            const KRange kr = krange(tl);
            const bool turns = ordered(kr);
            if (kr.hi <= kr.lo) next = tile_after(t);
            // An empty reduction (WGRAD) leaves an accumulated D[g] as it was.
            if (kr.hi <= kr.lo && accumulate) {
                prev_ordered = false;
                continue;
            }
            if (turns) {
                // Consumer 1 after consumer 0's products of this tile; consumer 0 after
                // consumer 1's of the previous tile, where that one took turns too.
                if (cw == 1) {
                    named_sync(ORDER_01, 256);
                } else if (prev_ordered) {
                    named_sync(ORDER_10, 256);
                }
            }
            auto ops = [&](int st) {
                return make_uint2(tile_a(st) + cw * 64 * BK, tile_b(st));
            };
            auto issued = [&] {
                next = tile_after(t);
                flush();
            };
            auto release = [&](int st) {
                if (lane == 0) mbar_arrive(empty(st));
            };
            // Block scaling: this thread's two rows of the tile (rl and rl + 8 of its
            // consumer's 64), read from each k-block's stage before it is released
            // (`landed`).
            const int brl = cw * 64 + warp * 16 + lane / 4;
            BlockScales<BLOCK ? BN : 128> bs{};  // (unused without BLOCK)
            // A tail half (HALVES): HN = BN / 2 columns (B's at the stage's B), its sum the first
            // NACC / 2 of acc. (HN = BN elsewhere, where `half` is false.)
            constexpr int HN = HALVES ? BN / 2 : BN;
            const bool half = HALVES && tl.half != 0;
            if constexpr (FAST) {
                if (half) {
                    auto &acc_h = *reinterpret_cast<float(*)[HN / 2]>(&acc[0]);
                    consume_fast<FA, FB, HN>(acc_h, kr.lo, kr.hi, ring, full, ops, issued, release);
                } else {
                    consume_fast<FA, FB, BN>(acc, kr.lo, kr.hi, ring, full, ops, issued, release);
                }
            } else {
                auto landed = [&](int st) {
                    if constexpr (BLOCK) {
                        bs.read(reinterpret_cast<const float *>(smem_raw + (scales_at(st) - raw)),
                                brl, tl.nt);
                    }
                };
                // The products of one group: half the tile's columns at 256 (consume_promoted's
                // halves), all of them otherwise.
                constexpr int NP = BN > 192 ? NACC / 2 : NACC;
                auto promote = [&](const float(&part)[NP], int h, bool first_kb) {
                    // (The per-tensor sums start from the first products: 0 + part, the bits of
                    // a zeroed sum.)
                    const bool first = !BLOCK && first_kb;
                    if constexpr (BLOCK) {
                        // acc[4p], acc[4p + 1] are row rl's, acc[4p + 2], acc[4p + 3] row rl +
                        // 8's, all in columns 8p .. 8p + 7 of the tile.
                        // (BN 256: half h's column groups are the tile's 16 h .. 16 h + 15.)
                        const auto f = bs.products();
#pragma unroll
                        for (int i = 0; i < NP; ++i) {
                            const int j = h * NP + i;
                            acc[j] = fmaf(part[i], f.at(j / 4, (i & 2) != 0), first ? 0.0f : acc[j]);
                        }
                    } else {
                        // (Half h's column groups are the sum's NP / 4 h .. + NP / 4 - 1.)
#pragma unroll
                        for (int i = 0; i < NP; ++i) acc[h * NP + i] = (first ? 0.0f : acc[h * NP + i]) + part[i];
                    }
                };
                // (BLOCK: the scales read before their stage goes back to the producer.)
                auto release_read = [&](int st) {
                    if constexpr (BLOCK) {
                        bs.settle();
                        __syncwarp();
                    }
                    release(st);
                };
                if constexpr (PIPELINED) {
                    consume_pipelined<FA, FB, BN>(kr.lo, kr.hi, ring, full, ops, issued, release_read,
                                                  landed, promote);
                } else if (half) {
                    // (One group of HN columns a k-block: the products of consume_promoted's
                    // first half alone.)
                    consume_promoted<FA, FB, HN>(kr.lo, kr.hi, ring, full, ops, issued, release_read,
                                                 landed, promote);
                } else {
                    consume_promoted<FA, FB, BN>(kr.lo, kr.hi, ring, full, ops, issued, release_read,
                                                 landed, promote);
                }
            }
            if (turns) {
                // Hand the tensor cores over: consumer 1 arrives for consumer 0's next tile
                // only where that one takes turns (each arrival has its one waiter).
                if (cw == 0) {
                    named_arrive(ORDER_01, 256);
                } else if (next.g >= 0 && ordered(krange(next))) {
                    named_arrive(ORDER_10, 256);
                }
            }
            prev_ordered = turns;
            // (An empty reduction writes +0: alpha * 0 would be NaN for an infinite alpha.)
            const float alpha_t = kr.hi > kr.lo ? alpha : 0.0f;
            if (DEFER && bias_kind == 0 && kr.hi > kr.lo && takes_store(tl)) {
                // Stored under the next tile's first products (flush, from `issued`).
                pend = tl;
            } else {
                // (An empty reduction has no products to hide the held epilogue under, and
                // its own sum is 0.)
                flush();
                if (kr.hi <= kr.lo) {
#pragma unroll
                    for (int i = 0; i < NACC; ++i) acc[i] = 0.0f;
                }
                epilogue(tl, alpha_t, bias_kind, false);
            }
        }
        flush();
        // The staging must outlive the stores that read it, and D be written, before exit.
        if (store_epilogue && issuer) bulk_wait();
        if constexpr (SWIGLU) {
            // One atomicMax a warp: max is order-free, so amax is the same every run.
            sw_amax = __reduce_max_sync(0xffffffffu, canonical_amax(sw_amax));
            if (lane == 0 && sw_amax != 0u && sw->amax != nullptr) {
                atomicMax(reinterpret_cast<unsigned *>(sw->amax), sw_amax);
            }
            if (blockIdx.x == 0 && threadIdx.x == 128 && sw->scale_inv != nullptr) {
                *sw->scale_inv = 1.0f / sw_scale;
            }
        }
    }
#else
    __trap();
#endif
}

// Split-K's sum: D[i] = sum over s < splits of partial[s * m * n + i] (s order) + bias[col]
// (+ D[i] when accumulating), two columns per thread (n is even), grid-stride.
// dims = (m, n, splits, accumulate); bias_kind 0 none, 1 bf16, 2 f32.
template <typename Out>
__device__ __forceinline__ void split_reduce(const float *partial, Out *d, const void *bias, uint4 dims,
                                             unsigned bias_kind) {
#ifdef FP8K_SM90A
    cuda_graph::pdl_enter();
    const size_t total = size_t(dims.x) * size_t(dims.y), pairs = total / 2;
    const unsigned n = dims.y, splits = dims.z;
    const bool accumulate = dims.w != 0;
    for (size_t q = size_t(blockIdx.x) * blockDim.x + threadIdx.x; q < pairs;
         q += size_t(gridDim.x) * blockDim.x) {
        const size_t i = 2 * q;
        float a = 0.0f, b = 0.0f;
        for (unsigned sp = 0; sp < splits; ++sp) {
            const float2 v = *reinterpret_cast<const float2 *>(partial + size_t(sp) * total + i);
            a += v.x;
            b += v.y;
        }
        const int c = int(i % n);
        a += bias_at(bias, int(bias_kind), c);
        b += bias_at(bias, int(bias_kind), c + 1);
        if (accumulate) {
            const float2 old = load2<Out>(d + i);
            a += old.x;
            b += old.y;
        }
        store2<Out>(d + i, a, b);
    }
#else
    __trap();
#endif
}

// Naive reference: one thread per output, fp32 accumulation in k order,
// d[r, c] = sa * sb * sum_k A[r, k] * B[c, k] (f32 output, no bias).
template <__nv_fp8_interpretation_t FA, __nv_fp8_interpretation_t FB>
__device__ __forceinline__ void gemm_ref(const uint8_t *a, const uint8_t *b, float *d, const float *sa,
                                         const float *sb, uint4 dims, uint2 idx) {
    const unsigned m = dims.x, n = dims.y, k = dims.z;
    const unsigned c = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
    if (c >= n || r >= m) return;
    float s = 0.0f;
    for (unsigned i = 0; i < k; ++i) {
        __nv_fp8_storage_t av = a[size_t(r) * k + i], bv = b[size_t(c) * k + i];
        const float fa = __half2float(__half(__nv_cvt_fp8_to_halfraw(av, FA)));
        const float fb = __half2float(__half(__nv_cvt_fp8_to_halfraw(bv, FB)));
        s = fmaf(fa, fb, s);
    }
    d[size_t(r) * n + c] = sa[idx.x] * sb[idx.y] * s;
}

}  // namespace sm90
}  // namespace fp8k

#define FP8K_GEMM_SM90(AN, FA, BN_, FB, ON, OT, W)                                                     \
    extern "C" __global__ void __launch_bounds__(fp8k::sm90::THREADS, 1)                             \
        fp8_gemm_sm90_##AN##_##BN_##_##ON##_n##W(const __grid_constant__ fp8k::sm90::TmaDesc ta,       \
                                                 const __grid_constant__ fp8k::sm90::TmaDesc tb,       \
                                                 const __grid_constant__ fp8k::sm90::TmaDesc td,       \
                                                 OT *d, const void *bias, const float *sa,             \
                                                 const float *sb, const int *counts, uint4 dims,       \
                                                 uint4 flags) {                                        \
        fp8k::sm90::gemm<FA, FB, OT, W>(&ta, &tb, &td, d, bias, sa, sb, counts, dims, flags);             \
    }
#define FP8K_GEMM_SM90_PACKED(AN, FA, BN_, FB, ON, OT, W)                                              \
    extern "C" __global__ void __launch_bounds__(fp8k::sm90::THREADS, 1)                             \
        fp8_gemm_sm90_packed_##AN##_##BN_##_##ON##_n##W(                                             \
            const __grid_constant__ fp8k::sm90::TmaDesc ta, const __grid_constant__ fp8k::sm90::TmaDesc tb, \
            const __grid_constant__ fp8k::sm90::TmaDesc td, OT *d, const void *bias, const float *sa, const float *sb, const float *sbg,            \
            const int *offsets, uint4 dims, uint4 flags) {                                           \
        fp8k::sm90::gemm<FA, FB, OT, W, fp8k::sm90::PACKED>(&ta, &tb, &td, d, bias, sa, sb, offsets, dims, \
                                                            flags, sbg);                         \
    }
// Fast accumulation (E4M3 x E4M3, bf16 out: the forward GEMMs), grouped blocks and packed.
#define FP8K_GEMM_SM90_FAST(W)                                                                         \
    extern "C" __global__ void __launch_bounds__(fp8k::sm90::THREADS, 1)                             \
        fp8_gemm_sm90_fast_e4m3_e4m3_bf16_n##W(const __grid_constant__ fp8k::sm90::TmaDesc ta,         \
                                               const __grid_constant__ fp8k::sm90::TmaDesc tb,         \
                                               const __grid_constant__ fp8k::sm90::TmaDesc td,         \
                                               __nv_bfloat16 *d, const void *bias, const float *sa,    \
                                               const float *sb, const int *counts, uint4 dims,         \
                                               uint4 flags) {                                          \
        fp8k::sm90::gemm<__NV_E4M3, __NV_E4M3, __nv_bfloat16, W, fp8k::sm90::GROUPED, true>(           \
            &ta, &tb, &td, d, bias, sa, sb, counts, dims, flags);                                      \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(fp8k::sm90::THREADS, 1)                             \
        fp8_gemm_sm90_packed_fast_e4m3_e4m3_bf16_n##W(                                                 \
            const __grid_constant__ fp8k::sm90::TmaDesc ta, const __grid_constant__ fp8k::sm90::TmaDesc tb, \
            const __grid_constant__ fp8k::sm90::TmaDesc td, __nv_bfloat16 *d, const void *bias,          \
            const float *sa, const float *sb, const float *sbg, const int *offsets, uint4 dims,        \
            uint4 flags) {                                                                             \
        fp8k::sm90::gemm<__NV_E4M3, __NV_E4M3, __nv_bfloat16, W, fp8k::sm90::PACKED, true>(            \
            &ta, &tb, &td, d, bias, sa, sb, offsets, dims, flags, sbg);                                \
    }
// The packed weight gradient: dims = (m, n, capacity, groups), no bias, per-tensor scales.
// Every kernel's `td` is D's store tensor map (read with flags.w & 2 only; zeros otherwise).
#define FP8K_GEMM_SM90_WGRAD(AN, FA, BN_, FB, ON, OT, W)                                               \
    extern "C" __global__ void __launch_bounds__(fp8k::sm90::THREADS, 1)                             \
        fp8_gemm_sm90_wgrad_##AN##_##BN_##_##ON##_n##W(                                              \
            const __grid_constant__ fp8k::sm90::TmaDesc ta, const __grid_constant__ fp8k::sm90::TmaDesc tb, \
            const __grid_constant__ fp8k::sm90::TmaDesc td, OT *d, const float *sa, const float *sb, const int *offsets, uint4 dims, uint4 flags) {  \
        fp8k::sm90::gemm<FA, FB, OT, W, fp8k::sm90::WGRAD>(&ta, &tb, &td, d, nullptr, sa, sb, offsets, dims, \
                                                           flags);                               \
    }
// The instances of one format pair: bf16 and f32 outputs at both tile widths for every
// layout.
#define FP8K_GEMM_SM90_OUTS(AN, FA, BN_, FB)                                                           \
    FP8K_GEMM_SM90(AN, FA, BN_, FB, bf16, __nv_bfloat16, 128)                                        \
    FP8K_GEMM_SM90(AN, FA, BN_, FB, f32, float, 128)                                                 \
    FP8K_GEMM_SM90(AN, FA, BN_, FB, bf16, __nv_bfloat16, 192)                                        \
    FP8K_GEMM_SM90(AN, FA, BN_, FB, f32, float, 192)                                                 \
    FP8K_GEMM_SM90_PACKED(AN, FA, BN_, FB, bf16, __nv_bfloat16, 128)                                 \
    FP8K_GEMM_SM90_PACKED(AN, FA, BN_, FB, f32, float, 128)                                          \
    FP8K_GEMM_SM90_PACKED(AN, FA, BN_, FB, bf16, __nv_bfloat16, 192)                                 \
    FP8K_GEMM_SM90_PACKED(AN, FA, BN_, FB, f32, float, 192)                                          \
    FP8K_GEMM_SM90_WGRAD(AN, FA, BN_, FB, bf16, __nv_bfloat16, 128)                                  \
    FP8K_GEMM_SM90_WGRAD(AN, FA, BN_, FB, f32, float, 128)                                           \
    FP8K_GEMM_SM90_WGRAD(AN, FA, BN_, FB, bf16, __nv_bfloat16, 192)                                  \
    FP8K_GEMM_SM90_WGRAD(AN, FA, BN_, FB, f32, float, 192)                                           \
    extern "C" __global__ void fp8_gemm_ref_##AN##_##BN_(const uint8_t *a, const uint8_t *b, float *d, \
                                                        const float *sa, const float *sb, uint4 dims,  \
                                                        uint2 idx) {                                   \
        cuda_graph::pdl_enter();                                                                      \
        fp8k::sm90::gemm_ref<FA, FB>(a, b, d, sa, sb, dims, idx);                                     \
    }
FP8K_GEMM_SM90_OUTS(e4m3, __NV_E4M3, e4m3, __NV_E4M3)
FP8K_GEMM_SM90_OUTS(e4m3, __NV_E4M3, e5m2, __NV_E5M2)
FP8K_GEMM_SM90_OUTS(e5m2, __NV_E5M2, e4m3, __NV_E4M3)
FP8K_GEMM_SM90_OUTS(e5m2, __NV_E5M2, e5m2, __NV_E5M2)
FP8K_GEMM_SM90_FAST(128)
FP8K_GEMM_SM90_FAST(192)
FP8K_GEMM_SM90_FAST(256)
// Promoted sums at 256 columns (consume_promoted's halves): E4M3 x E4M3, bf16 out, grouped blocks.
FP8K_GEMM_SM90(e4m3, __NV_E4M3, e4m3, __NV_E4M3, bf16, __nv_bfloat16, 256)
// The packed fc1 GEMM with the fused SwiGLU epilogue (SWIGLU; E4M3 x E4M3, bf16 D, h in
// E4M3): fast accumulation at 128 and 256 columns, the promoted sum at 128. ty and tyt map
// the cast's outputs; hy and hyt are those outputs' buffers, unused by the kernel but
// passed so that a capture keeps them alive. The scalar slots arrive as (buffer, index)
// pairs: hidx = (scale, scale_inv, amax).
#define FP8K_GEMM_SM90_SWIGLU(LAYOUT, FASTV, W)                                                        \
    extern "C" __global__ void __launch_bounds__(fp8k::sm90::THREADS, 1)                             \
        fp8_gemm_sm90_packed_swiglu_##LAYOUT##e4m3_e4m3_bf16_n##W(                                     \
            const __grid_constant__ fp8k::sm90::TmaDesc ta, const __grid_constant__ fp8k::sm90::TmaDesc tb, \
            const __grid_constant__ fp8k::sm90::TmaDesc td, __nv_bfloat16 *d, const void *bias,          \
            const float *sa, const float *sb, const float *sbg, const int *offsets, uint4 dims,        \
            uint4 flags, const __grid_constant__ fp8k::sm90::TmaDesc ty,                                \
            const __grid_constant__ fp8k::sm90::TmaDesc tyt, const uint8_t *hy, const uint8_t *hyt,     \
            float *hscale, float *hscale_inv,                                                          \
            float *hamax, uint4 hidx) {                                                                \
        const fp8k::sm90::SwigluOut sw{&ty, &tyt, fp8k::slot(hscale, hidx.x),                        \
                                       fp8k::slot(hscale_inv, hidx.y), fp8k::slot(hamax, hidx.z)};    \
        fp8k::sm90::gemm<__NV_E4M3, __NV_E4M3, __nv_bfloat16, W, fp8k::sm90::PACKED, FASTV, false,     \
                         true>(&ta, &tb, &td, d, bias, sa, sb, offsets, dims, flags, sbg, &sw);        \
    }
FP8K_GEMM_SM90_SWIGLU(fast_, true, 128)
FP8K_GEMM_SM90_SWIGLU(fast_, true, 256)
FP8K_GEMM_SM90_SWIGLU(, false, 128)
// Split-K's sum into D (see split_reduce).
extern "C" __global__ void __launch_bounds__(256)
    fp8_gemm_split_reduce_bf16(const float *partial, __nv_bfloat16 *d, const void *bias, uint4 dims,
                               unsigned bias_kind) {
    fp8k::sm90::split_reduce<__nv_bfloat16>(partial, d, bias, dims, bias_kind);
}
extern "C" __global__ void __launch_bounds__(256)
    fp8_gemm_split_reduce_f32(const float *partial, float *d, const void *bias, uint4 dims,
                              unsigned bias_kind) {
    fp8k::sm90::split_reduce<float>(partial, d, bias, dims, bias_kind);
}
// Block-scaled (sa, sb: the block scales; see BLOCK), E4M3 x E4M3, one group, 128 or 192 wide
// (both outputs) or 256 (bf16).
#define FP8K_GEMM_SM90_BLOCK(ON, OT, W)                                                                \
    extern "C" __global__ void __launch_bounds__(fp8k::sm90::THREADS, 1)                             \
        fp8_gemm_sm90_block_e4m3_e4m3_##ON##_n##W(const __grid_constant__ fp8k::sm90::TmaDesc ta,      \
                                                  const __grid_constant__ fp8k::sm90::TmaDesc tb,      \
                                                  const __grid_constant__ fp8k::sm90::TmaDesc td,      \
                                                  OT *d, const void *bias, const float *sa,            \
                                                  const float *sb, const int *counts, uint4 dims,      \
                                                  uint4 flags) {                                       \
        fp8k::sm90::gemm<__NV_E4M3, __NV_E4M3, OT, W, fp8k::sm90::GROUPED, false, true>(               \
            &ta, &tb, &td, d, bias, sa, sb, counts, dims, flags);                                      \
    }
FP8K_GEMM_SM90_BLOCK(bf16, __nv_bfloat16, 128)
FP8K_GEMM_SM90_BLOCK(f32, float, 128)
FP8K_GEMM_SM90_BLOCK(bf16, __nv_bfloat16, 192)
FP8K_GEMM_SM90_BLOCK(f32, float, 192)
FP8K_GEMM_SM90_BLOCK(bf16, __nv_bfloat16, 256)
