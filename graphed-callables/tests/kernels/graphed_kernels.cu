// Kernels of the graphed-callables GPU tests: an elementwise "linear" layer with a leaky
// ReLU, forward and backward. Every float operation is an explicitly rounded single
// operation (no FMA contraction), and no thread sums another thread's values, so results
// are bit-exact and reproducible on the host.

// z = x * w + b (saved for the backward); y = z > 0 ? z : z / 8.
extern "C" __global__ void gl_fwd(const float* __restrict__ x, const float* __restrict__ w,
                                  const float* __restrict__ b, float* __restrict__ z,
                                  float* __restrict__ y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float zi = __fadd_rn(__fmul_rn(x[i], w[i]), b[i]);
        z[i] = zi;
        y[i] = zi > 0.0f ? zi : __fmul_rn(zi, 0.125f);
    }
}

// g = z > 0 ? dy : dy / 8; dx = g * w; dw += g * x; db += g.
extern "C" __global__ void gl_bwd(const float* __restrict__ dy, const float* __restrict__ x,
                                  const float* __restrict__ w, const float* __restrict__ z,
                                  float* __restrict__ dx, float* __restrict__ dw,
                                  float* __restrict__ db, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = z[i] > 0.0f ? dy[i] : __fmul_rn(dy[i], 0.125f);
        dx[i] = __fmul_rn(g, w[i]);
        dw[i] = __fadd_rn(dw[i], __fmul_rn(g, x[i]));
        db[i] = __fadd_rn(db[i], g);
    }
}

// gl_bwd split in two, for schedules with separate weight-gradient steps: the input
// gradient, then (later) the weight gradients, recomputing g the same way.
extern "C" __global__ void gl_bwd_input(const float* __restrict__ dy, const float* __restrict__ w,
                                        const float* __restrict__ z, float* __restrict__ dx,
                                        unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = z[i] > 0.0f ? dy[i] : __fmul_rn(dy[i], 0.125f);
        dx[i] = __fmul_rn(g, w[i]);
    }
}

extern "C" __global__ void gl_bwd_weight(const float* __restrict__ dy,
                                         const float* __restrict__ x,
                                         const float* __restrict__ z, float* __restrict__ dw,
                                         float* __restrict__ db, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = z[i] > 0.0f ? dy[i] : __fmul_rn(dy[i], 0.125f);
        dw[i] = __fadd_rn(dw[i], __fmul_rn(g, x[i]));
        db[i] = __fadd_rn(db[i], g);
    }
}

// x[i] = v.
extern "C" __global__ void gl_fill(float* x, float v, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}

// ---- weight-caching tests (tests/graphed_fp8.rs) ----

// A weight cast that honours its noop flag: *counter += 1 unless *noop == 1.0 (fp8-kernels'
// quantize convention). One thread.
extern "C" __global__ void gl_count_cast(unsigned int* counter, const float* noop) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && !(*noop == 1.0f)) *counter += 1u;
}

// A weight cast that ignores any flag: *counter += 1 every time it runs. One thread.
extern "C" __global__ void gl_count_cast_ignoring_flag(unsigned int* counter) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *counter += 1u;
}

// dst[i] = src[i] for n unsigned words (snapshot and restore of test state).
extern "C" __global__ void gl_copy_u32(unsigned int* dst, const unsigned int* src,
                                       unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}

// ---- breaking-layer (MoE-like) tests (tests/graphed_segments.rs) ----
// Routing indices and counts are unsigned words stored in float buffers (bit patterns).
// Every float operation is one explicitly rounded op; each output element is written by one
// thread per launch, so results are bit-exact and reproducible on the host.

// The router: one thread, in index order, lists every i with x[i] > thr in idx[0..k) and
// writes k to *count (deterministic order).
extern "C" __global__ void gs_route(const float* __restrict__ x, float thr,
                                    unsigned int* __restrict__ idx,
                                    unsigned int* __restrict__ count, unsigned int n) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned int k = 0;
        for (unsigned int i = 0; i < n; ++i) {
            if (x[i] > thr) idx[k++] = i;
        }
        *count = k;
    }
}

// The experts, sized on the host: exactly `count` threads do work (the grid comes from the
// host's copy of the count). j < count: i = idx[j]; h[j] = x[i] * w[i] + b[i].
extern "C" __global__ void gs_expert(const float* __restrict__ x, const float* __restrict__ w,
                                     const float* __restrict__ b,
                                     const unsigned int* __restrict__ idx,
                                     float* __restrict__ h, unsigned int count) {
    unsigned int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < count) {
        unsigned int i = idx[j];
        h[j] = __fadd_rn(__fmul_rn(x[i], w[i]), b[i]);
    }
}

// The experts, sized on the device (full-layer mode): the grid covers the capacity and the
// threads past *count exit.
extern "C" __global__ void gs_expert_dev(const float* __restrict__ x,
                                         const float* __restrict__ w,
                                         const float* __restrict__ b,
                                         const unsigned int* __restrict__ idx,
                                         float* __restrict__ h,
                                         const unsigned int* __restrict__ count) {
    unsigned int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < *count) {
        unsigned int i = idx[j];
        h[j] = __fadd_rn(__fmul_rn(x[i], w[i]), b[i]);
    }
}

// Combine, part 1: y[i] = x[i] / 2 for every i (the tokens no expert took).
extern "C" __global__ void gs_pass(const float* __restrict__ x, float* __restrict__ y,
                                   unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __fmul_rn(x[i], 0.5f);
}

// Combine, part 2: y[idx[j]] = h[j] for j < *count (grid covers the capacity).
extern "C" __global__ void gs_scatter(const float* __restrict__ h,
                                      const unsigned int* __restrict__ idx,
                                      const unsigned int* __restrict__ count,
                                      float* __restrict__ y) {
    unsigned int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < *count) y[idx[j]] = h[j];
}

// Backward of the expert tokens, sized on the host: j < count: i = idx[j];
// dx[i] = dy[i] * w[i]; dw[i] += dy[i] * x[i]; db[i] += dy[i].
extern "C" __global__ void gs_expert_bwd(const float* __restrict__ dy,
                                         const float* __restrict__ x,
                                         const float* __restrict__ w,
                                         const unsigned int* __restrict__ idx,
                                         float* __restrict__ dx, float* __restrict__ dw,
                                         float* __restrict__ db, unsigned int count) {
    unsigned int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < count) {
        unsigned int i = idx[j];
        dx[i] = __fmul_rn(dy[i], w[i]);
        dw[i] = __fadd_rn(dw[i], __fmul_rn(dy[i], x[i]));
        db[i] = __fadd_rn(db[i], dy[i]);
    }
}

// The same, sized on the device.
extern "C" __global__ void gs_expert_bwd_dev(const float* __restrict__ dy,
                                             const float* __restrict__ x,
                                             const float* __restrict__ w,
                                             const unsigned int* __restrict__ idx,
                                             float* __restrict__ dx, float* __restrict__ dw,
                                             float* __restrict__ db,
                                             const unsigned int* __restrict__ count) {
    unsigned int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < *count) {
        unsigned int i = idx[j];
        dx[i] = __fmul_rn(dy[i], w[i]);
        dw[i] = __fadd_rn(dw[i], __fmul_rn(dy[i], x[i]));
        db[i] = __fadd_rn(db[i], dy[i]);
    }
}
