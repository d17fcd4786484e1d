// Kernels of `fp8-moe bench graph`: one element of a dependent chain adds 1.0 to 1024
// floats (4 blocks of 256 threads).

extern "C" __global__ void add_one(float* x, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}

// The same with programmatic dependent launch: wait for the previous kernel's writes before
// touching x, and let the next kernel launch early.
extern "C" __global__ void add_one_pdl(float* x, unsigned int n) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}
