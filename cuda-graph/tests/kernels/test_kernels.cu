// Small kernels the GPU tests and the graph benchmark launch. Each is extern "C" so the
// driver finds it by name.

extern "C" __global__ void add_f32(float* x, float v, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += v;
}

extern "C" __global__ void mul_f32(float* x, float v, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= v;
}

extern "C" __global__ void set_f32(float* x, float v, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}

// y = a * x + y
extern "C" __global__ void axpy_f32(float a, const float* __restrict__ x, float* __restrict__ y,
                                    unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

// Counts how often it ran (one thread increments).
extern "C" __global__ void count_up(unsigned int* counter) {
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(counter, 1u);
}

// Appends `value` to a log at the next slot: records the order in which nodes ran.
extern "C" __global__ void log_value(int* log, unsigned int* cursor, int value) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned int slot = atomicAdd(cursor, 1u);
        log[slot] = value;
    }
}

// The benchmark's chain element with programmatic dependent launch: waits for the previous
// kernel's writes before touching x, and lets the next kernel start its prologue early.
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

// Spins until *flag (host-mapped pinned memory) becomes non-zero: work that keeps its stream
// busy for as long as the host wants.
extern "C" __global__ void spin_until_set(const volatile unsigned int* flag) {
    while (*flag == 0) {
#if __CUDA_ARCH__ >= 700
        __nanosleep(1000);
#endif
    }
}

// Device faults on purpose, for tests/device_fault.rs: when *flag is non-zero the kernel
// ends in a sticky error; otherwise it adds 1 to x[0..n). `__trap()` aborts the kernel.
extern "C" __global__ void add_one_or_trap(const unsigned int* flag, float* x, unsigned int n) {
    if (*flag != 0) __trap();
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}

// The same with a device-side assert (CUDA_ERROR_ASSERT), checked by one thread so that the
// failure prints one message. Asserts stay on whatever flags the build passes.
#undef NDEBUG
#include <assert.h>
extern "C" __global__ void add_one_or_assert(const unsigned int* flag, float* x, unsigned int n) {
    if (blockIdx.x == 0 && threadIdx.x == 0) assert(*flag == 0);
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
