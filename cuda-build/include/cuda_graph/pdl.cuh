// Programmatic dependent launch (PDL) for kernels launched with
// `Stream::launch_pdl` (cuda-graph): such a kernel may be scheduled while the previous kernel
// on its stream (or its predecessor node in a graph) is still running, so it must call
// `cuda_graph::pdl_wait()` before it touches any memory earlier work writes or reads; the
// wait returns once the predecessor grid has completed and its writes are visible. Nothing
// the kernel does before the wait may depend on earlier work (kernel parameters, barrier
// initialisation, tensor-map prefetch are fine).
//
// `pdl_launch_dependents()` lets the *next* kernel be scheduled early (its own wait still
// holds it until this grid completes). Calling it at entry is safe: the dependent grid is
// launched only after every block of this grid has called it or exited, so all of this
// grid's blocks are resident first.
//
// A kernel whose launcher vouches that the kernel before it on the stream writes nothing this
// one reads or writes (and reads nothing it writes) may instead run beside that kernel:
// `pdl_enter_beside()` at entry, `pdl_exit_beside()` as its last act on every path. It then
// starts once the predecessor's blocks are resident (work before the predecessor is complete
// when the predecessor waits before letting it be scheduled, as `pdl_enter` does), and its
// completion still implies the predecessor's, which its own successor's `pdl_wait()` relies
// on.
//
// All of these are no-ops when the kernel was launched without the attribute, and compile to nothing
// below sm_90. The header is on nvcc's include path of every `cuda-build` compile.
#pragma once

namespace cuda_graph {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The usual kernel entry: wait for the predecessor, then let the successor be scheduled.
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_launch_dependents();
}

// Entry of a kernel that runs beside its predecessor (see above): let the successor be
// scheduled, wait for nothing.
__device__ __forceinline__ void pdl_enter_beside() { pdl_launch_dependents(); }

// Exit of a kernel that runs beside its predecessor: wait for it, so that this grid completes
// after it.
__device__ __forceinline__ void pdl_exit_beside() { pdl_wait(); }

}  // namespace cuda_graph
