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
