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
