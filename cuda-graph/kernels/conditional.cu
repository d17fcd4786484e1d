// Helper kernels that set the value of a conditional node's handle from device code, so a
// graph decides on the device whether (or how often, or which) body runs.
//
// Each is launched with one block of one thread: cudaGraphSetConditional must not be called
// concurrently for the same handle. The handle (cudaGraphConditionalHandle, a 64-bit
// integer) is passed by value. cudaGraphSetConditional is declared by
// cuda_device_runtime_api.h, which nvcc includes implicitly through cuda_runtime.h; the
// handle must belong to the context the kernel runs in.

typedef unsigned long long cond_handle_t;

// value = v
extern "C" __global__ void cond_set_const(cond_handle_t handle, unsigned int value) {
    cudaGraphSetConditional(handle, value);
}

// value = *flag (an int flag or a switch index; negative values wrap to large unsigned
// values, which run no body of a SWITCH and count as true for IF/WHILE).
extern "C" __global__ void cond_set_from_i32(cond_handle_t handle, const int* flag) {
    cudaGraphSetConditional(handle, (unsigned int)(*flag));
}

// value = (*flag != 0.0f); NaN counts as true.
extern "C" __global__ void cond_set_from_f32(cond_handle_t handle, const float* flag) {
    cudaGraphSetConditional(handle, (*flag != 0.0f) ? 1u : 0u);
}

// value = (*flag != 0); for IF/WHILE driven by a u32 or i32 flag.
extern "C" __global__ void cond_set_nonzero_i32(cond_handle_t handle, const int* flag) {
    cudaGraphSetConditional(handle, (*flag != 0) ? 1u : 0u);
}

// Counted loops: *counter -= 1; value = (*counter > 0). With the counter at k before the
// WHILE node (handle default 1, or set from the counter), a body ending in this runs k times.
extern "C" __global__ void cond_decrement(cond_handle_t handle, int* counter) {
    int c = *counter - 1;
    *counter = c;
    cudaGraphSetConditional(handle, c > 0 ? 1u : 0u);
}

// value = (*counter > 0), without changing it: the test at the head of a counted loop.
extern "C" __global__ void cond_set_positive_i32(cond_handle_t handle, const int* counter) {
    cudaGraphSetConditional(handle, *counter > 0 ? 1u : 0u);
}
