// Kernels of the cuda-graph examples (compiled by build.rs into OUT_DIR/examples.fatbin).

// x[i] += v
extern "C" __global__ void add_f32(float* x, float v, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += v;
}

// y[i] = a * x[i] + y[i]
extern "C" __global__ void axpy_f32(float a, const float* __restrict__ x, float* __restrict__ y,
                                    unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

// x[i] = x[i] * 0.5 (one halving step of the WHILE example)
extern "C" __global__ void halve_f32(float* x, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= 0.5f;
}

// flag[0] = x[0] > limit: the WHILE example's loop condition, read by a setter kernel.
extern "C" __global__ void above_f32(const float* x, float limit, int* flag) {
    if (blockIdx.x == 0 && threadIdx.x == 0) flag[0] = x[0] > limit ? 1 : 0;
}
