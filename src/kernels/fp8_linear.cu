// Kernels of the FP8 linear layer (src/linear.rs) that fp8-kernels does not provide.

// Bias gradient: db[c] += sum over r of dy[r * cols + c], for a row-major [rows, cols] f32
// dy. One thread per column sums its rows in order, so the result is deterministic (no
// atomics; the same bits on every run).
extern "C" __global__ void fp8_linear_bias_grad_f32(const float* dy, float* db,
                                                    unsigned int rows, unsigned int cols) {
    unsigned int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float acc = 0.0f;
    for (unsigned int r = 0; r < rows; ++r) acc += dy[(size_t)r * cols + c];
    db[c] += acc;
}
