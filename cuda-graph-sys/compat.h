/* Typedefs of the run-time table that cudaTypedefs.h of an older CUDA 12.x toolkit (>= 12.4)
   lacks, copied verbatim from CUDA 13.0's cudaTypedefs.h. The table requests these ABI
   versions whatever header it was built against, so its Rust types and accessors are the
   same with every supported toolkit; a driver that lacks one of these ABIs reports it as
   missing at run time, and the table's fallbacks take over where it has them.

   tests/abi_versions.rs checks each declaration here against the header when the header has
   it (always so with CUDA 13.0), so the copies cannot drift. */
#ifndef CUDA_GRAPH_SYS_COMPAT_H
#define CUDA_GRAPH_SYS_COMPAT_H

#if CUDA_VERSION < 12050
/* Opaque with headers before 12.5: the table's cuCtxCreate is only ever given NULL params. */
typedef struct CUctxCreateParams_st CUctxCreateParams;
typedef CUresult (CUDAAPI *PFN_cuCtxCreate_v12050)(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags, CUdevice dev);
typedef CUresult (CUDAAPI *PFN_cuStreamGetCtx_v12050)(CUstream hStream, CUcontext *pctx, CUgreenCtx *pGreenCtx);
#endif

#if CUDA_VERSION < 12080
typedef CUresult (CUDAAPI *PFN_cuEventElapsedTime_v12080)(float *pMilliseconds, CUevent hStart, CUevent hEnd);
#endif

#if CUDA_VERSION < 13000
typedef CUresult (CUDAAPI *PFN_cuCtxGetDevice_v13000)(CUdevice *device, CUcontext ctx);
typedef CUresult (CUDAAPI *PFN_cuCtxSynchronize_v13000)(CUcontext ctx);
#endif

#endif
