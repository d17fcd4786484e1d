// Test kernel for the raw-table GPU test: y[i] = a * x[i] + y[i].
extern "C" __global__ void axpy(float a, const float* __restrict__ x, float* __restrict__ y,
                                unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
