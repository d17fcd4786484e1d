// Kernel of `fp8-moe soak`'s update check: one link of a chain of axpy nodes whose
// coefficient and source buffer whole-graph and per-node updates change.

// y[i] = a * x[i] + y[i] for i < n.
extern "C" __global__ void soak_axpy_f32(float a, const float* x, float* y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = fmaf(a, x[i], y[i]);
}
