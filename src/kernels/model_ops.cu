// The train job's model kernels around its GEMMs, attention and MoE (src/model/ops.rs):
// embedding forward and backward, RMSNorm forward and backward, the residual add, fused
// cross-entropy (loss and logits gradient), a fixed-order sum, and the gradient norm with
// PyTorch's clip_grad_norm_ factor.
//
// Deterministic: every floating-point sum has a fixed order that depends only on the shape
// and on whether the launcher chose the vector path (sequential loops per thread, fixed xor
// shuffle trees, then sums over warps or lanes in index order); no floating-point atomics.
// A graph replay therefore gives the bits of an eager run. Every kernel waits for its
// predecessor at entry (cuda_graph::pdl_enter: the launchers use Stream::launch_pdl).
//
// Vector paths: the launcher passes `vec` = 1 only where every row start it touches is
// 16-byte aligned (base pointers aligned and row lengths multiples of the vector); a thread
// then moves 8 bf16 (one 16-byte access) or 4 / 8 floats at once. Otherwise the same code
// runs with one element per step (W = 1). bf16 results are rounded once, to nearest even.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_graph/pdl.cuh>

#include "vec.cuh"
#include "warp.cuh"

#define OPS_BLOCK 256
#define OPS_WARPS (OPS_BLOCK / 32)
// Threads of the single-block reductions (ops_sum, ops_grad_norm_final).
#define OPS_REDUCE_BLOCK 1024
// Embedding backward: threads per block, the tokens scanned per tile (the matching rows'
// list lives in shared memory), and the most column groups per block (`EMB_GROUPS` in
// ops.rs): the block's other threads split the rows (EMB_THREADS / groups lanes).
#define EMB_THREADS 512
#define EMB_TILE 4096
#define EMB_GROUPS 32
// RMSNorm backward's weight gradient: rows per chunk (one partial row of the workspace per
// chunk, `RMS_CHUNK_ROWS`), the most column groups per block (`RMS_GROUPS`), and the chunk
// lanes of the reduce (`RMS_REDUCE_LANES`, one warp each, 32 columns per block).
#define RMS_CHUNK_ROWS 32
#define RMS_GROUPS 64
#define RMS_REDUCE_LANES 8
// Tensors per gradient-norm launch (`GN_SLOTS`).
#define GN_SLOTS 16

namespace {

// Exclusive prefix sum of `v` over a block of `WARPS` warps; `total` gets the block's sum.
// `warp_tot` is WARPS ints of shared memory. Ends with a barrier (the caller may reuse
// `warp_tot` after its next barrier).
template <int WARPS>
__device__ __forceinline__ int block_exclusive_scan(int v, int *warp_tot, int &total) {
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const int inc = warp_scan(v);
    if (lane == 31) warp_tot[warp] = inc;
    __syncthreads();
    int before = 0, all = 0;
#pragma unroll
    for (unsigned w = 0; w < (unsigned)WARPS; ++w) {
        const int t = warp_tot[w];
        if (w < warp) before += t;
        all += t;
    }
    total = all;
    __syncthreads();
    return before + inc - v;
}

// The block's sum of `v` (warp xor trees, then the warps in order); valid in thread 0.
// `warp_part` is (blockDim.x / 32) doubles of shared memory.
__device__ __forceinline__ double block_sum(double v, double *warp_part) {
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) warp_part[warp] = v;
    __syncthreads();
    double s = 0.0;
    if (threadIdx.x == 0)
        for (unsigned w = 0; w < blockDim.x / 32; ++w) s += warp_part[w];
    return s;
}

// Smallest power of two >= n (n >= 1), at most `cap` (a power of two).
__device__ __forceinline__ unsigned pow2_at_least(unsigned n, unsigned cap) {
    unsigned g = 1;
    while (g < n && g < cap) g <<= 1;
    return g;
}

// W consecutive bf16 as floats, through the read-only cache (data no thread of the kernel
// writes). W = 8: one 16-byte load.
template <int W> __device__ __forceinline__ void load_bf16(const __nv_bfloat16 *p, float (&f)[W]) {
    if constexpr (W == 8) {
        bf16x8_to_f32(__ldg(reinterpret_cast<const uint4 *>(p)), f);
    } else {
#pragma unroll
        for (int v = 0; v < W; ++v) f[v] = __bfloat162float(__ldg(p + v));
    }
}

// As load_bf16 through the coherent path (ld.global.cg, L2): for data this kernel also
// writes (an output aliasing an input, each element read by the thread that then writes it),
// which the read-only cache must not hold. The intrinsic keeps the 16-byte load whole.
template <int W>
__device__ __forceinline__ void load_bf16_plain(const __nv_bfloat16 *p, float (&f)[W]) {
    if constexpr (W == 8) {
        bf16x8_to_f32(__ldcg(reinterpret_cast<const uint4 *>(p)), f);
    } else {
#pragma unroll
        for (int v = 0; v < W; ++v) f[v] = __bfloat162float(__ldcg(p + v));
    }
}

// ---------------------------------------------------------------------------------------
// Embedding

template <int W>
__device__ __forceinline__ void embedding_forward_body(const int *tokens, const float *table,
                                                       __nv_bfloat16 *out, unsigned rows,
                                                       unsigned cols, unsigned vocab) {
    const unsigned per_row = cols / W;
    const size_t p = (size_t)blockIdx.x * OPS_BLOCK + threadIdx.x;
    if (p >= (size_t)rows * per_row) return;
    const unsigned t = (unsigned)(p / per_row), c = (unsigned)(p % per_row) * W;
    const int tok = __ldg(tokens + t);
    float f[W];
    if (tok >= 0 && (unsigned)tok < vocab) {
        load_f32<W>(table + (size_t)tok * cols + c, f);
    } else {
#pragma unroll
        for (int v = 0; v < W; ++v) f[v] = 0.0f;
    }
    store_bf16<W>(out + (size_t)t * cols + c, f);
}

// One thread per W columns of one row. vec: cols % 8 == 0, table and out 16-byte aligned.
extern "C" __global__ void __launch_bounds__(OPS_BLOCK, 4)
    ops_embedding_forward(const int *tokens, const float *table, __nv_bfloat16 *out,
                          unsigned rows, unsigned cols, unsigned vocab, unsigned vec) {
    cuda_graph::pdl_enter();
    if (vec)
        embedding_forward_body<8>(tokens, table, out, rows, cols, vocab);
    else
        embedding_forward_body<1>(tokens, table, out, rows, cols, vocab);
}

// W consecutive bf16 as loaded (one 16-byte word for W = 8), kept packed until used so that
// several loads are in flight at once (converted on load, the compiler issues them one at a
// time).
template <int W> struct Bf16s;
template <> struct Bf16s<8> {
    uint4 u;
    __device__ __forceinline__ void load(const __nv_bfloat16 *p) {
        u = __ldg(reinterpret_cast<const uint4 *>(p));
    }
    __device__ __forceinline__ void add_to(float (&acc)[8]) const {
        float f[8];
        bf16x8_to_f32(u, f);
#pragma unroll
        for (int v = 0; v < 8; ++v) acc[v] += f[v];
    }
};
template <> struct Bf16s<1> {
    __nv_bfloat16 b;
    __device__ __forceinline__ void load(const __nv_bfloat16 *p) { b = __ldg(p); }
    __device__ __forceinline__ void add_to(float (&acc)[1]) const { acc[0] += __bfloat162float(b); }
};

// Adds dout rows `list[e]` for the entries e = e0, e0 + step, ... < n to acc, in that order,
// eight loads in flight.
template <int W>
__device__ __forceinline__ void add_rows(const __nv_bfloat16 *dout, size_t cols, unsigned c,
                                         const int *list, unsigned e0, unsigned n, unsigned step,
                                         float (&acc)[W]) {
    unsigned e = e0;
    for (; e + 7 * step < n; e += 8 * step) {
        Bf16s<W> r[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) r[i].load(dout + (size_t)list[e + i * step] * cols + c);
#pragma unroll
        for (int i = 0; i < 8; ++i) r[i].add_to(acc);
    }
    for (; e < n; e += step) {
        Bf16s<W> r;
        r.load(dout + (size_t)list[e] * cols + c);
        r.add_to(acc);
    }
}

// Block (v, s): row v of dtable, columns [s * G * W, (s + 1) * G * W), G = min(EMB_GROUPS,
// pow2 >= cols / W) column groups of W columns; the block's S = EMB_THREADS / G lanes split
// the rows. Per tile of EMB_TILE tokens the block lists the tokens t == v in increasing t
// (ordered block scan), then lane j adds the rows of the matching tokens whose rank (over
// all tiles) is j mod S, in increasing t; at the end the S lane sums are added in lane order.
// A row no token selects gets 0. Out-of-range tokens select no row.
template <int W>
__device__ __forceinline__ void embedding_backward_body(const int *tokens,
                                                        const __nv_bfloat16 *dout,
                                                        float *dtable, unsigned rows,
                                                        unsigned cols, unsigned accumulate,
                                                        int *list, int *warp_tot, float *part) {
    constexpr unsigned PER_THREAD = EMB_TILE / EMB_THREADS;
    static_assert(PER_THREAD % 4 == 0 && PER_THREAD <= 32, "whole int4 loads, one mask word");
    const unsigned v = blockIdx.x;
    const unsigned cw = cols / W;
    const unsigned G = pow2_at_least(cw, EMB_GROUPS), S = EMB_THREADS / G;
    const unsigned g = threadIdx.x % G, j = threadIdx.x / G;
    const unsigned piece = blockIdx.y * G + g;
    const bool active = piece < cw;
    const unsigned c = piece * W;
    float acc[W];
#pragma unroll
    for (int i = 0; i < W; ++i) acc[i] = 0.0f;
    unsigned seen = 0;
    for (unsigned base = 0; base < rows; base += EMB_TILE) {
        const unsigned n = min((unsigned)EMB_TILE, rows - base);
        const unsigned first = threadIdx.x * PER_THREAD;
        int tk[PER_THREAD];
        if (first + PER_THREAD <= n && aligned16(tokens + base + first)) {
#pragma unroll
            for (unsigned k = 0; k < PER_THREAD; k += 4) {
                const int4 q = __ldg(reinterpret_cast<const int4 *>(tokens + base + first + k));
                tk[k] = q.x, tk[k + 1] = q.y, tk[k + 2] = q.z, tk[k + 3] = q.w;
            }
        } else {
            // Clamped indices: every load in bounds and issued at once; the ones past n are
            // masked below.
#pragma unroll
            for (unsigned k = 0; k < PER_THREAD; ++k) tk[k] = __ldg(tokens + base + min(first + k, n - 1));
        }
        unsigned mask = 0;
#pragma unroll
        for (unsigned k = 0; k < PER_THREAD; ++k)
            if (first + k < n && tk[k] == (int)v) mask |= 1u << k;
        int total;
        int at = block_exclusive_scan<EMB_THREADS / 32>(__popc(mask), warp_tot, total);
        for (unsigned m = mask; m != 0; m &= m - 1) list[at++] = (int)(base + first + __ffs(m) - 1);
        __syncthreads();
        if (active) add_rows<W>(dout, cols, c, list, (j + S - seen % S) % S, (unsigned)total, S, acc);
        seen += (unsigned)total;
        __syncthreads();
    }
    const unsigned width = G * W;
#pragma unroll
    for (int i = 0; i < W; ++i) part[j * width + g * W + i] = acc[i];
    __syncthreads();
    for (unsigned q = threadIdx.x; q < width; q += EMB_THREADS) {
        const unsigned col = blockIdx.y * width + q;
        if (col >= cols) break;
        float s = part[q];
        for (unsigned l = 1; l < S; ++l) s += part[l * width + q];
        float *d = dtable + (size_t)v * cols + col;
        *d = accumulate ? *d + s : s;
    }
}

// Grid (vocab, ceil(cols / W / G)), EMB_THREADS threads. vec: cols % 8 == 0, dout and dtable
// 16-byte aligned.
extern "C" __global__ void __launch_bounds__(EMB_THREADS, 2)
    ops_embedding_backward(const int *tokens, const __nv_bfloat16 *dout, float *dtable,
                           unsigned rows, unsigned cols, unsigned accumulate, unsigned vec) {
    cuda_graph::pdl_enter();
    __shared__ int list[EMB_TILE];
    __shared__ int warp_tot[EMB_THREADS / 32];
    __shared__ float part[EMB_THREADS * 8];
    if (vec)
        embedding_backward_body<8>(tokens, dout, dtable, rows, cols, accumulate, list, warp_tot,
                                   part);
    else
        embedding_backward_body<1>(tokens, dout, dtable, rows, cols, accumulate, list, warp_tot,
                                   part);
}

// ---------------------------------------------------------------------------------------
// RMSNorm: one warp per row; lane l takes the W-column pieces l, l + 32, ...

template <int W>
__device__ __forceinline__ void rmsnorm_forward_row(const __nv_bfloat16 *x, const float *w,
                                                    __nv_bfloat16 *y, float *rstd, unsigned row,
                                                    unsigned cols, float eps) {
    const unsigned lane = threadIdx.x & 31u;
    const __nv_bfloat16 *xr = x + (size_t)row * cols;
    __nv_bfloat16 *yr = y + (size_t)row * cols;
    float ss = 0.0f;
#pragma unroll 4
    for (unsigned c = lane * W; c < cols; c += 32 * W) {
        float f[W];
        load_bf16<W>(xr + c, f);
#pragma unroll
        for (int v = 0; v < W; ++v) ss += f[v] * f[v];
    }
    ss = warp_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)cols + eps);
    if (lane == 0) rstd[row] = r;
#pragma unroll 4
    for (unsigned c = lane * W; c < cols; c += 32 * W) {
        float f[W], g[W];
        load_bf16<W>(xr + c, f);
        load_f32<W>(w + c, g);
#pragma unroll
        for (int v = 0; v < W; ++v) f[v] = f[v] * r * g[v];
        store_bf16<W>(yr + c, f);
    }
}

// 8 rows per block. vec: cols % 8 == 0, x, w, y 16-byte aligned.
extern "C" __global__ void __launch_bounds__(OPS_BLOCK, 4)
    ops_rmsnorm_forward(const __nv_bfloat16 *x, const float *w, __nv_bfloat16 *y, float *rstd,
                        unsigned rows, unsigned cols, float eps, unsigned vec) {
    cuda_graph::pdl_enter();
    const unsigned row = blockIdx.x * OPS_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    if (vec)
        rmsnorm_forward_row<8>(x, w, y, rstd, row, cols, eps);
    else
        rmsnorm_forward_row<1>(x, w, y, rstd, row, cols, eps);
}

// dx of one row: with xhat = x * rstd, g = dy * w, m = sum_c(g * xhat) / cols,
// dx = res + rstd * (g - xhat * m). `res` may be `dx` itself (each element read by the
// thread that then writes it: plain loads, no restrict), or null.
template <int W>
__device__ __forceinline__ void rmsnorm_dx_row(const __nv_bfloat16 *x, const float *w,
                                               const float *rstd, const __nv_bfloat16 *dy,
                                               const __nv_bfloat16 *res, __nv_bfloat16 *dx,
                                               unsigned row, unsigned cols) {
    const unsigned lane = threadIdx.x & 31u;
    const size_t off = (size_t)row * cols;
    const float r = __ldg(rstd + row);
    float dot = 0.0f;
#pragma unroll 2
    for (unsigned c = lane * W; c < cols; c += 32 * W) {
        float xv[W], dv[W], wv[W];
        load_bf16<W>(x + off + c, xv);
        load_bf16<W>(dy + off + c, dv);
        load_f32<W>(w + c, wv);
#pragma unroll
        for (int v = 0; v < W; ++v) dot += (dv[v] * wv[v]) * (xv[v] * r);
    }
    const float m = warp_sum(dot) / (float)cols;
#pragma unroll 2
    for (unsigned c = lane * W; c < cols; c += 32 * W) {
        float xv[W], dv[W], wv[W], rv[W];
        load_bf16<W>(x + off + c, xv);
        load_bf16<W>(dy + off + c, dv);
        load_f32<W>(w + c, wv);
        if (res != nullptr) {
            load_bf16_plain<W>(res + off + c, rv);
        } else {
#pragma unroll
            for (int v = 0; v < W; ++v) rv[v] = 0.0f;
        }
#pragma unroll
        for (int v = 0; v < W; ++v) rv[v] += r * ((dv[v] * wv[v]) - (xv[v] * r) * m);
        store_bf16<W>(dx + off + c, rv);
    }
}

// Block b's partial column sums of dy * xhat over the rows of chunk b / slices (RMS_CHUNK_ROWS
// rows), columns of slice b % slices (G groups of W columns, G = min(RMS_GROUPS, pow2 >=
// cols / W)): lane j of the S = OPS_BLOCK / G lanes takes rows j, j + S, ... of the chunk in
// order, then the lanes are added in order into ws[chunk * cols + col].
template <int W>
__device__ __forceinline__ void rmsnorm_dw_chunk(const __nv_bfloat16 *x, const float *rstd,
                                                 const __nv_bfloat16 *dy, float *ws,
                                                 unsigned rows, unsigned cols, unsigned b,
                                                 float *part) {
    const unsigned cw = cols / W;
    const unsigned G = pow2_at_least(cw, RMS_GROUPS), S = OPS_BLOCK / G;
    const unsigned slices = (cw + G - 1) / G;
    const unsigned chunk = b / slices, slice = b % slices;
    const unsigned g = threadIdx.x % G, j = threadIdx.x / G;
    const unsigned piece = slice * G + g;
    const unsigned r0 = chunk * RMS_CHUNK_ROWS, r1 = min(rows, r0 + RMS_CHUNK_ROWS);
    float acc[W];
#pragma unroll
    for (int v = 0; v < W; ++v) acc[v] = 0.0f;
    if (piece < cw) {
        const unsigned c = piece * W;
#pragma unroll 4
        for (unsigned t = r0 + j; t < r1; t += S) {
            float xv[W], dv[W];
            load_bf16<W>(x + (size_t)t * cols + c, xv);
            load_bf16<W>(dy + (size_t)t * cols + c, dv);
            const float r = __ldg(rstd + t);
#pragma unroll
            for (int v = 0; v < W; ++v) acc[v] += dv[v] * (xv[v] * r);
        }
    }
    const unsigned width = G * W;
#pragma unroll
    for (int v = 0; v < W; ++v) part[j * width + g * W + v] = acc[v];
    __syncthreads();
    for (unsigned q = threadIdx.x; q < width; q += OPS_BLOCK) {
        const unsigned col = slice * width + q;
        if (col >= cols) break;
        float s = part[q];
        for (unsigned l = 1; l < S; ++l) s += part[l * width + q];
        ws[(size_t)chunk * cols + col] = s;
    }
}

// RMSNorm backward, step 1 of 2: blocks [0, dx_blocks) compute dx, 8 rows each; the rest
// (ceil(rows / RMS_CHUNK_ROWS) * slices of them) the weight gradient's per-chunk partial sums
// into ws. has_res: res is read (else treated as 0). vec: cols % 8 == 0 and x, w, dy, res,
// dx, ws 16-byte aligned.
extern "C" __global__ void __launch_bounds__(OPS_BLOCK, 4)
    ops_rmsnorm_backward(const __nv_bfloat16 *x, const float *w, const float *rstd,
                         const __nv_bfloat16 *dy, const __nv_bfloat16 *res, __nv_bfloat16 *dx,
                         float *ws, unsigned rows, unsigned cols, unsigned has_res,
                         unsigned dx_blocks, unsigned vec) {
    cuda_graph::pdl_enter();
    __shared__ float part[OPS_BLOCK * 8];
    if (blockIdx.x < dx_blocks) {
        const unsigned row = blockIdx.x * OPS_WARPS + (threadIdx.x >> 5);
        if (row >= rows) return;
        const __nv_bfloat16 *rp = has_res ? res : nullptr;
        if (vec)
            rmsnorm_dx_row<8>(x, w, rstd, dy, rp, dx, row, cols);
        else
            rmsnorm_dx_row<1>(x, w, rstd, dy, rp, dx, row, cols);
    } else {
        const unsigned b = blockIdx.x - dx_blocks;
        if (vec)
            rmsnorm_dw_chunk<8>(x, rstd, dy, ws, rows, cols, b, part);
        else
            rmsnorm_dw_chunk<1>(x, rstd, dy, ws, rows, cols, b, part);
    }
}

// RMSNorm backward, step 2 of 2: dw[col] (+)= sum over chunks of ws[chunk * cols + col].
// Block: 32 columns x RMS_REDUCE_LANES warps; warp l adds chunks l, l + 8, ... in order, then
// warp 0 adds the warps' sums in order.
extern "C" __global__ void __launch_bounds__(32 * RMS_REDUCE_LANES)
    ops_rmsnorm_dw_reduce(const float *ws, float *dw, unsigned cols, unsigned chunks,
                          unsigned accumulate) {
    cuda_graph::pdl_enter();
    __shared__ float part[RMS_REDUCE_LANES][32];
    const unsigned lane = threadIdx.x & 31u, l = threadIdx.x >> 5;
    const unsigned col = blockIdx.x * 32 + lane;
    float acc = 0.0f;
    if (col < cols) {
        unsigned c = l;
        for (; c + 3 * RMS_REDUCE_LANES < chunks; c += 4 * RMS_REDUCE_LANES) {
            float v[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) v[i] = __ldg(ws + (size_t)(c + i * RMS_REDUCE_LANES) * cols + col);
#pragma unroll
            for (int i = 0; i < 4; ++i) acc += v[i];
        }
        for (; c < chunks; c += RMS_REDUCE_LANES) acc += __ldg(ws + (size_t)c * cols + col);
    }
    part[l][lane] = acc;
    __syncthreads();
    if (l == 0 && col < cols) {
        float s = part[0][lane];
#pragma unroll
        for (int i = 1; i < RMS_REDUCE_LANES; ++i) s += part[i][lane];
        dw[col] = accumulate ? dw[col] + s : s;
    }
}

// ---------------------------------------------------------------------------------------
// Residual add: thread p takes elements [8p, 8p + 8). out may be a or b (each element read
// by the thread that writes it: coherent loads). vec: a, b, out 16-byte aligned.
extern "C" __global__ void __launch_bounds__(OPS_BLOCK, 4)
    ops_add(const __nv_bfloat16 *a, const __nv_bfloat16 *b, __nv_bfloat16 *out, unsigned n,
            unsigned vec) {
    cuda_graph::pdl_enter();
    const size_t e0 = ((size_t)blockIdx.x * OPS_BLOCK + threadIdx.x) * 8;
    if (e0 >= n) return;
    if (vec && e0 + 8 <= n) {
        float fa[8], fb[8];
        load_bf16_plain<8>(a + e0, fa);
        load_bf16_plain<8>(b + e0, fb);
#pragma unroll
        for (int v = 0; v < 8; ++v) fa[v] += fb[v];
        store_bf16<8>(out + e0, fa);
    } else {
        const size_t e1 = min((size_t)n, e0 + 8);
        for (size_t e = e0; e < e1; ++e)
            out[e] = __float2bfloat16_rn(__bfloat162float(__ldcg(a + e)) +
                                         __bfloat162float(__ldcg(b + e)));
    }
}

// ---------------------------------------------------------------------------------------
// Cross-entropy: one warp per row; lane l takes the W-logit pieces l, l + 32, ... The max,
// then z = sum exp(l - max), then the gradient; the row is read three times (L1 hits at the
// train job's 256 logits).

template <int W>
__device__ __forceinline__ void cross_entropy_row(const float *logits, const int *targets,
                                                  float grad_scale, float *loss,
                                                  __nv_bfloat16 *dlogits, unsigned row,
                                                  unsigned vocab) {
    const unsigned lane = threadIdx.x & 31u;
    const float *lr = logits + (size_t)row * vocab;
    __nv_bfloat16 *dr = dlogits + (size_t)row * vocab;
    const int tgt = __ldg(targets + row);
    if (tgt < 0 || (unsigned)tgt >= vocab) {
        // Ignored (negative target): loss and gradient 0. Out of range: NaN, so it shows.
        const float fill = tgt < 0 ? 0.0f : __int_as_float(0x7fc00000);
        if (lane == 0) loss[row] = fill;
        for (unsigned c = lane * W; c < vocab; c += 32 * W) {
            float f[W];
#pragma unroll
            for (int v = 0; v < W; ++v) f[v] = fill;
            store_bf16<W>(dr + c, f);
        }
        return;
    }
    float m = -INFINITY;
#pragma unroll 4
    for (unsigned c = lane * W; c < vocab; c += 32 * W) {
        float f[W];
        load_f32<W>(lr + c, f);
#pragma unroll
        for (int v = 0; v < W; ++v) m = fmaxf(m, f[v]);
    }
    m = warp_max(m);
    float z = 0.0f;
#pragma unroll 4
    for (unsigned c = lane * W; c < vocab; c += 32 * W) {
        float f[W];
        load_f32<W>(lr + c, f);
#pragma unroll
        for (int v = 0; v < W; ++v) z += expf(f[v] - m);
    }
    z = warp_sum(z);
    if (lane == 0) loss[row] = (m + logf(z)) - __ldg(lr + tgt);
#pragma unroll 2
    for (unsigned c = lane * W; c < vocab; c += 32 * W) {
        float f[W];
        load_f32<W>(lr + c, f);
#pragma unroll
        for (int v = 0; v < W; ++v) {
            const float p = expf(f[v] - m) / z;
            f[v] = (c + v == (unsigned)tgt ? p - 1.0f : p) * grad_scale;
        }
        store_bf16<W>(dr + c, f);
    }
}

// 8 rows per block. vec: vocab % 4 == 0, logits 16-byte and dlogits 8-byte aligned.
extern "C" __global__ void __launch_bounds__(OPS_BLOCK, 4)
    ops_cross_entropy(const float *logits, const int *targets, float grad_scale, float *loss,
                      __nv_bfloat16 *dlogits, unsigned rows, unsigned vocab, unsigned vec) {
    cuda_graph::pdl_enter();
    const unsigned row = blockIdx.x * OPS_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    if (vec)
        cross_entropy_row<4>(logits, targets, grad_scale, loss, dlogits, row, vocab);
    else
        cross_entropy_row<1>(logits, targets, grad_scale, loss, dlogits, row, vocab);
}

// ---------------------------------------------------------------------------------------
// Sum: one block of OPS_REDUCE_BLOCK threads; thread i adds (in f64) the float4 pieces i,
// i + 1024, ... (vec: values 16-byte aligned) or the elements i, i + 1024, ..., then the
// tail elements; then the block sum. out[index] = s or out[index] + s, rounded once to f32.
extern "C" __global__ void __launch_bounds__(OPS_REDUCE_BLOCK)
    ops_sum(const float *values, float *out, unsigned n, unsigned index, unsigned accumulate,
            unsigned vec) {
    cuda_graph::pdl_enter();
    __shared__ double warp_part[OPS_REDUCE_BLOCK / 32];
    double acc = 0.0;
    unsigned done = 0;
    if (vec) {
        const unsigned pieces = n / 4;
#pragma unroll 4
        for (unsigned q = threadIdx.x; q < pieces; q += OPS_REDUCE_BLOCK) {
            const float4 v = __ldg(reinterpret_cast<const float4 *>(values) + q);
            acc += (double)v.x;
            acc += (double)v.y;
            acc += (double)v.z;
            acc += (double)v.w;
        }
        done = pieces * 4;
    }
#pragma unroll 4
    for (unsigned e = done + threadIdx.x; e < n; e += OPS_REDUCE_BLOCK) acc += (double)__ldg(values + e);
    const double s = block_sum(acc, warp_part);
    if (threadIdx.x == 0) out[index] = (float)(accumulate ? (double)out[index] + s : s);
}

// ---------------------------------------------------------------------------------------
// Gradient norm, step 1: per block, the sum of squares (f64) of a contiguous range of one
// tensor, rounded to f32 into ws[base + blockIdx.x]. Up to GN_SLOTS tensors per launch:
// slot i's blocks are [start[i], start[i + 1]) (unused slots: start = the grid), block k of
// them takes elements [k * per[i], min(len[i], (k + 1) * per[i])) (per a multiple of 8, so
// every range starts 16-byte aligned when the tensor does). dtype: 0 f32, 1 bf16, 2 f16.

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

// The f64 sum of squares of p[lo, hi) over the block: thread i takes the 16-byte pieces i,
// i + 256, ... (each piece's values in order), then the tail element lo + pieces * VE + i.
template <typename T>
__device__ __forceinline__ double sum_squares(const T *p, size_t lo, size_t hi) {
    constexpr unsigned VE = 16 / sizeof(T);
    double acc = 0.0;
    size_t done = lo;
    if (aligned16(p)) {
        const size_t pieces = (hi - lo) / VE;
        const uint4 *q = reinterpret_cast<const uint4 *>(p + lo);
#pragma unroll 4
        for (size_t i = threadIdx.x; i < pieces; i += OPS_BLOCK) {
            const uint4 u = __ldg(q + i);
            const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
            for (unsigned k = 0; k < VE; ++k) {
                const double d = (double)to_f32<T>(e[k]);
                acc += d * d;
            }
        }
        done = lo + pieces * VE;
    }
    for (size_t i = done + threadIdx.x; i < hi; i += OPS_BLOCK) {
        const double d = (double)to_f32<T>(p[i]);
        acc += d * d;
    }
    return acc;
}

#define GN_PTRS                                                                                    \
    const void *p0, const void *p1, const void *p2, const void *p3, const void *p4,              \
        const void *p5, const void *p6, const void *p7, const void *p8, const void *p9,          \
        const void *p10, const void *p11, const void *p12, const void *p13, const void *p14,     \
        const void *p15

}  // namespace

// The gradient norm's per-slot parameters (kernel parameters, so external linkage).
struct GnU64 {
    unsigned long long v[GN_SLOTS];
};
struct GnU32 {
    unsigned v[GN_SLOTS];
};
struct GnStart {
    unsigned v[GN_SLOTS + 1];
};

extern "C" __global__ void __launch_bounds__(OPS_BLOCK, 4)
    ops_grad_sq_partial(GN_PTRS, GnU64 len, GnU64 per, GnStart start, GnU32 dtype, float *ws,
                        unsigned base) {
    cuda_graph::pdl_enter();
    __shared__ double warp_part[OPS_WARPS];
    unsigned j = 0;
#pragma unroll
    for (unsigned i = 1; i < GN_SLOTS; ++i)
        if (blockIdx.x >= start.v[i]) j = i;
    // Constant indices only (a dynamic index into the parameters would copy them to local
    // memory).
    const void *const ptrs[GN_SLOTS] = {p0, p1, p2, p3, p4, p5, p6, p7,
                                        p8, p9, p10, p11, p12, p13, p14, p15};
    const void *p = p0;
    unsigned long long n = 0, pe = 0;
    unsigned dt = 0, first = 0;
#pragma unroll
    for (unsigned i = 0; i < GN_SLOTS; ++i)
        if (i == j) {
            p = ptrs[i];
            n = len.v[i];
            pe = per.v[i];
            dt = dtype.v[i];
            first = start.v[i];
        }
    const size_t lo = (size_t)(blockIdx.x - first) * pe;
    const size_t hi = min((size_t)n, lo + (size_t)pe);
    double acc;
    if (dt == 0)
        acc = sum_squares(static_cast<const float *>(p), lo, hi);
    else if (dt == 1)
        acc = sum_squares(static_cast<const __nv_bfloat16 *>(p), lo, hi);
    else
        acc = sum_squares(static_cast<const __half *>(p), lo, hi);
    const double s = block_sum(acc, warp_part);
    if (threadIdx.x == 0) ws[base + blockIdx.x] = (float)s;
}

// Gradient norm, step 2: one block; thread i adds (f64) the partials i, i + 1024, ..., then
// the block sum. out[0] = norm = f32(sqrt(total)); out[1] = min(1, max_norm / (norm + 1e-6))
// in f32 (PyTorch's clip_grad_norm_ coefficient), NaN when that quotient is NaN (a NaN
// norm), 0 for an infinite norm.
extern "C" __global__ void __launch_bounds__(OPS_REDUCE_BLOCK)
    ops_grad_norm_final(const float *ws, unsigned parts, float max_norm, float *out) {
    cuda_graph::pdl_enter();
    __shared__ double warp_part[OPS_REDUCE_BLOCK / 32];
    double acc = 0.0;
#pragma unroll 4
    for (unsigned i = threadIdx.x; i < parts; i += OPS_REDUCE_BLOCK) acc += (double)__ldg(ws + i);
    const double s = block_sum(acc, warp_part);
    if (threadIdx.x == 0) {
        const float norm = (float)sqrt(s);
        const float c = max_norm / (norm + 1e-6f);
        out[0] = norm;
        out[1] = isnan(c) ? c : fminf(c, 1.0f);
    }
}
