//! The driver entry-point table: one line per entry point, typed with the `PFN_*_vNNNNN`
//! typedef of `cudaTypedefs.h` whose ABI version the loader asks the driver for.
//!
//! The typedef name is the single source of truth: the version requested from
//! `cuGetProcAddress_v2` is parsed from it at compile time, and a line whose field name does
//! not match its typedef fails to compile. A CPU test checks that each line names the newest
//! ABI that the header defines (up to the header's `CUDA_VERSION`).

use crate::*;

/// The function type inside a `PFN_*` typedef (bindgen makes each one an
/// `Option<unsafe extern "C" fn(..)>`).
pub trait EntryFn {
    /// The bare function pointer type.
    type Fn: Copy;
}

impl<F: Copy> EntryFn for Option<F> {
    type Fn = F;
}

/// Name and requested ABI version of one entry of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntrySpec {
    /// The driver's base name, e.g. `cuGraphAddNode` (not the `_v2` symbol).
    pub name: &'static str,
    /// The ABI version passed to `cuGetProcAddress_v2`, e.g. 12030.
    pub version: u32,
    /// The typedef the table uses for it, e.g. `PFN_cuGraphAddNode_v12030`.
    pub typedef: &'static str,
}

impl EntrySpec {
    /// Parses `PFN_<name>_v<digits>`; panics (at compile time, as the table is a `const`) when
    /// the typedef does not belong to `name`.
    const fn parse(name: &'static str, typedef: &'static str) -> Self {
        let n = name.as_bytes();
        let t = typedef.as_bytes();
        let prefix = b"PFN_";
        assert!(
            t.len() > prefix.len() + n.len() + 2,
            "typedef name too short"
        );
        let mut i = 0;
        while i < prefix.len() {
            assert!(t[i] == prefix[i], "typedef must start with PFN_");
            i += 1;
        }
        let mut j = 0;
        while j < n.len() {
            assert!(
                t[prefix.len() + j] == n[j],
                "typedef does not match the field name"
            );
            j += 1;
        }
        let mut k = prefix.len() + n.len();
        assert!(
            t[k] == b'_' && t[k + 1] == b'v',
            "typedef must end in _v<version>"
        );
        k += 2;
        let mut version = 0u32;
        while k < t.len() {
            assert!(t[k].is_ascii_digit(), "typedef version must be decimal");
            version = version * 10 + (t[k] - b'0') as u32;
            k += 1;
        }
        EntrySpec {
            name,
            version,
            typedef,
        }
    }
}

macro_rules! driver_entries {
    ($( $(#[$meta:meta])* $name:ident : $pfn:ident ,)*) => {
        #[allow(non_camel_case_types, clippy::upper_case_acronyms)]
        #[derive(Clone, Copy)]
        #[repr(usize)]
        enum Slot { $($name,)* }

        /// Every entry point of the table, in table order.
        pub const ENTRIES: &[EntrySpec] = &[
            $( EntrySpec::parse(stringify!($name), stringify!($pfn)), )*
        ];

        /// Number of entries in the table.
        pub const ENTRY_COUNT: usize = ENTRIES.len();

        impl crate::Driver {
            $(
                #[doc = concat!("`", stringify!($name), "`, resolved as `", stringify!($pfn),
                                "`; an error if the installed driver lacks it.")]
                #[inline]
                pub fn $name(&self) -> Result<<$pfn as EntryFn>::Fn, crate::LoadError> {
                    let ptr = self.entry_ptr(Slot::$name as usize);
                    // SAFETY: the pointer is null or was returned by cuGetProcAddress_v2 for
                    // exactly this name and the ABI version of this typedef; a null pointer
                    // becomes `None`, as `Option<fn>` has the null niche.
                    let f = unsafe { core::mem::transmute::<*mut core::ffi::c_void, $pfn>(ptr) };
                    f.ok_or_else(|| self.missing(Slot::$name as usize))
                }
            )*
        }
    };
}

driver_entries! {
    // Initialisation, version and errors
    cuInit: PFN_cuInit_v2000,
    cuDriverGetVersion: PFN_cuDriverGetVersion_v2020,
    cuGetErrorName: PFN_cuGetErrorName_v6000,
    cuGetErrorString: PFN_cuGetErrorString_v6000,
    // Devices
    cuDeviceGet: PFN_cuDeviceGet_v2000,
    cuDeviceGetCount: PFN_cuDeviceGetCount_v2000,
    cuDeviceGetName: PFN_cuDeviceGetName_v2000,
    cuDeviceGetAttribute: PFN_cuDeviceGetAttribute_v2000,
    cuDeviceTotalMem: PFN_cuDeviceTotalMem_v3020,
    cuDeviceGetUuid: PFN_cuDeviceGetUuid_v11040,
    // Contexts
    cuDevicePrimaryCtxRetain: PFN_cuDevicePrimaryCtxRetain_v7000,
    cuDevicePrimaryCtxRelease: PFN_cuDevicePrimaryCtxRelease_v11000,
    cuDevicePrimaryCtxGetState: PFN_cuDevicePrimaryCtxGetState_v7000,
    cuDevicePrimaryCtxSetFlags: PFN_cuDevicePrimaryCtxSetFlags_v11000,
    cuCtxCreate: PFN_cuCtxCreate_v12050,
    cuCtxDestroy: PFN_cuCtxDestroy_v4000,
    cuCtxSetCurrent: PFN_cuCtxSetCurrent_v4000,
    cuCtxGetCurrent: PFN_cuCtxGetCurrent_v4000,
    cuCtxPushCurrent: PFN_cuCtxPushCurrent_v4000,
    cuCtxPopCurrent: PFN_cuCtxPopCurrent_v4000,
    cuCtxSynchronize: PFN_cuCtxSynchronize_v13000,
    cuCtxGetDevice: PFN_cuCtxGetDevice_v13000,
    cuCtxGetStreamPriorityRange: PFN_cuCtxGetStreamPriorityRange_v5050,
    cuCtxGetLimit: PFN_cuCtxGetLimit_v3010,
    cuCtxSetLimit: PFN_cuCtxSetLimit_v3010,
    // Streams
    cuStreamCreate: PFN_cuStreamCreate_v2000,
    cuStreamCreateWithPriority: PFN_cuStreamCreateWithPriority_v5050,
    cuStreamDestroy: PFN_cuStreamDestroy_v4000,
    cuStreamSynchronize: PFN_cuStreamSynchronize_v2000,
    cuStreamQuery: PFN_cuStreamQuery_v2000,
    cuStreamWaitEvent: PFN_cuStreamWaitEvent_v3020,
    cuStreamGetPriority: PFN_cuStreamGetPriority_v5050,
    cuStreamGetFlags: PFN_cuStreamGetFlags_v5050,
    cuStreamGetCtx: PFN_cuStreamGetCtx_v12050,
    cuStreamGetId: PFN_cuStreamGetId_v12000,
    cuLaunchHostFunc: PFN_cuLaunchHostFunc_v10000,
    // Stream capture
    cuStreamBeginCapture: PFN_cuStreamBeginCapture_v10010,
    cuStreamBeginCaptureToGraph: PFN_cuStreamBeginCaptureToGraph_v12030,
    cuStreamEndCapture: PFN_cuStreamEndCapture_v10000,
    cuStreamIsCapturing: PFN_cuStreamIsCapturing_v10000,
    cuStreamGetCaptureInfo: PFN_cuStreamGetCaptureInfo_v12030,
    cuStreamUpdateCaptureDependencies: PFN_cuStreamUpdateCaptureDependencies_v12030,
    cuThreadExchangeStreamCaptureMode: PFN_cuThreadExchangeStreamCaptureMode_v10010,
    // Events
    cuEventCreate: PFN_cuEventCreate_v2000,
    cuEventDestroy: PFN_cuEventDestroy_v4000,
    cuEventRecord: PFN_cuEventRecord_v2000,
    cuEventRecordWithFlags: PFN_cuEventRecordWithFlags_v11010,
    cuEventSynchronize: PFN_cuEventSynchronize_v2000,
    cuEventQuery: PFN_cuEventQuery_v2000,
    cuEventElapsedTime: PFN_cuEventElapsedTime_v12080,
    // Memory: allocation and pools
    cuMemAlloc: PFN_cuMemAlloc_v3020,
    cuMemFree: PFN_cuMemFree_v3020,
    cuMemAllocAsync: PFN_cuMemAllocAsync_v11020,
    cuMemFreeAsync: PFN_cuMemFreeAsync_v11020,
    cuMemAllocFromPoolAsync: PFN_cuMemAllocFromPoolAsync_v11020,
    cuMemPoolCreate: PFN_cuMemPoolCreate_v11020,
    cuMemPoolDestroy: PFN_cuMemPoolDestroy_v11020,
    cuMemPoolTrimTo: PFN_cuMemPoolTrimTo_v11020,
    cuMemPoolSetAttribute: PFN_cuMemPoolSetAttribute_v11020,
    cuMemPoolGetAttribute: PFN_cuMemPoolGetAttribute_v11020,
    cuDeviceGetDefaultMemPool: PFN_cuDeviceGetDefaultMemPool_v11020,
    cuDeviceGetMemPool: PFN_cuDeviceGetMemPool_v11020,
    cuDeviceSetMemPool: PFN_cuDeviceSetMemPool_v11020,
    cuMemGetInfo: PFN_cuMemGetInfo_v3020,
    cuPointerGetAttribute: PFN_cuPointerGetAttribute_v4000,
    // Memory: pinned host memory
    cuMemAllocHost: PFN_cuMemAllocHost_v3020,
    cuMemFreeHost: PFN_cuMemFreeHost_v2000,
    cuMemHostAlloc: PFN_cuMemHostAlloc_v2020,
    cuMemHostRegister: PFN_cuMemHostRegister_v6050,
    cuMemHostUnregister: PFN_cuMemHostUnregister_v4000,
    cuMemHostGetDevicePointer: PFN_cuMemHostGetDevicePointer_v3020,
    // Memory: copies and memsets
    cuMemcpy: PFN_cuMemcpy_v4000,
    cuMemcpyAsync: PFN_cuMemcpyAsync_v4000,
    cuMemcpyHtoD: PFN_cuMemcpyHtoD_v3020,
    cuMemcpyDtoH: PFN_cuMemcpyDtoH_v3020,
    cuMemcpyDtoD: PFN_cuMemcpyDtoD_v3020,
    cuMemcpyHtoDAsync: PFN_cuMemcpyHtoDAsync_v3020,
    cuMemcpyDtoHAsync: PFN_cuMemcpyDtoHAsync_v3020,
    cuMemcpyDtoDAsync: PFN_cuMemcpyDtoDAsync_v3020,
    cuMemcpy3D: PFN_cuMemcpy3D_v3020,
    cuMemcpy3DAsync: PFN_cuMemcpy3DAsync_v3020,
    cuMemsetD8: PFN_cuMemsetD8_v3020,
    cuMemsetD16: PFN_cuMemsetD16_v3020,
    cuMemsetD32: PFN_cuMemsetD32_v3020,
    cuMemsetD8Async: PFN_cuMemsetD8Async_v3020,
    cuMemsetD16Async: PFN_cuMemsetD16Async_v3020,
    cuMemsetD32Async: PFN_cuMemsetD32Async_v3020,
    cuMemsetD2D32Async: PFN_cuMemsetD2D32Async_v3020,
    // Modules, libraries and functions
    cuModuleLoadData: PFN_cuModuleLoadData_v2000,
    cuModuleLoadDataEx: PFN_cuModuleLoadDataEx_v2010,
    cuModuleLoadFatBinary: PFN_cuModuleLoadFatBinary_v2000,
    cuModuleUnload: PFN_cuModuleUnload_v2000,
    cuModuleGetFunction: PFN_cuModuleGetFunction_v2000,
    cuModuleGetGlobal: PFN_cuModuleGetGlobal_v3020,
    cuLibraryLoadData: PFN_cuLibraryLoadData_v12000,
    cuLibraryUnload: PFN_cuLibraryUnload_v12000,
    cuLibraryGetKernel: PFN_cuLibraryGetKernel_v12000,
    cuKernelGetFunction: PFN_cuKernelGetFunction_v12000,
    cuFuncGetAttribute: PFN_cuFuncGetAttribute_v2020,
    cuFuncSetAttribute: PFN_cuFuncSetAttribute_v9000,
    cuFuncGetName: PFN_cuFuncGetName_v12030,
    cuFuncGetModule: PFN_cuFuncGetModule_v11000,
    cuFuncGetParamInfo: PFN_cuFuncGetParamInfo_v12040,
    cuOccupancyMaxActiveBlocksPerMultiprocessor: PFN_cuOccupancyMaxActiveBlocksPerMultiprocessor_v6050,
    cuTensorMapEncodeTiled: PFN_cuTensorMapEncodeTiled_v12000,
    // Launch
    cuLaunchKernel: PFN_cuLaunchKernel_v4000,
    cuLaunchKernelEx: PFN_cuLaunchKernelEx_v11060,
    // Graphs: creation and nodes
    cuGraphCreate: PFN_cuGraphCreate_v10000,
    cuGraphDestroy: PFN_cuGraphDestroy_v10000,
    cuGraphClone: PFN_cuGraphClone_v10000,
    cuGraphNodeFindInClone: PFN_cuGraphNodeFindInClone_v10000,
    cuGraphAddNode: PFN_cuGraphAddNode_v12030,
    cuGraphAddKernelNode: PFN_cuGraphAddKernelNode_v12000,
    cuGraphAddMemcpyNode: PFN_cuGraphAddMemcpyNode_v10000,
    cuGraphAddMemsetNode: PFN_cuGraphAddMemsetNode_v10000,
    cuGraphAddHostNode: PFN_cuGraphAddHostNode_v10000,
    cuGraphAddChildGraphNode: PFN_cuGraphAddChildGraphNode_v10000,
    cuGraphAddEmptyNode: PFN_cuGraphAddEmptyNode_v10000,
    cuGraphAddEventRecordNode: PFN_cuGraphAddEventRecordNode_v11010,
    cuGraphAddEventWaitNode: PFN_cuGraphAddEventWaitNode_v11010,
    cuGraphAddMemAllocNode: PFN_cuGraphAddMemAllocNode_v11040,
    cuGraphAddMemFreeNode: PFN_cuGraphAddMemFreeNode_v11040,
    cuGraphAddExternalSemaphoresSignalNode: PFN_cuGraphAddExternalSemaphoresSignalNode_v11020,
    cuGraphAddExternalSemaphoresWaitNode: PFN_cuGraphAddExternalSemaphoresWaitNode_v11020,
    cuGraphAddBatchMemOpNode: PFN_cuGraphAddBatchMemOpNode_v11070,
    cuGraphDestroyNode: PFN_cuGraphDestroyNode_v10000,
    // Graphs: node parameters
    cuGraphNodeSetParams: PFN_cuGraphNodeSetParams_v12020,
    cuGraphNodeGetType: PFN_cuGraphNodeGetType_v10000,
    cuGraphKernelNodeGetParams: PFN_cuGraphKernelNodeGetParams_v12000,
    cuGraphKernelNodeSetParams: PFN_cuGraphKernelNodeSetParams_v12000,
    cuGraphKernelNodeGetAttribute: PFN_cuGraphKernelNodeGetAttribute_v11000,
    cuGraphKernelNodeSetAttribute: PFN_cuGraphKernelNodeSetAttribute_v11000,
    cuGraphKernelNodeCopyAttributes: PFN_cuGraphKernelNodeCopyAttributes_v11000,
    cuGraphMemcpyNodeGetParams: PFN_cuGraphMemcpyNodeGetParams_v10000,
    cuGraphMemcpyNodeSetParams: PFN_cuGraphMemcpyNodeSetParams_v10000,
    cuGraphMemsetNodeGetParams: PFN_cuGraphMemsetNodeGetParams_v10000,
    cuGraphMemsetNodeSetParams: PFN_cuGraphMemsetNodeSetParams_v10000,
    cuGraphHostNodeGetParams: PFN_cuGraphHostNodeGetParams_v10000,
    cuGraphHostNodeSetParams: PFN_cuGraphHostNodeSetParams_v10000,
    cuGraphChildGraphNodeGetGraph: PFN_cuGraphChildGraphNodeGetGraph_v10000,
    cuGraphEventRecordNodeGetEvent: PFN_cuGraphEventRecordNodeGetEvent_v11010,
    cuGraphEventRecordNodeSetEvent: PFN_cuGraphEventRecordNodeSetEvent_v11010,
    cuGraphEventWaitNodeGetEvent: PFN_cuGraphEventWaitNodeGetEvent_v11010,
    cuGraphEventWaitNodeSetEvent: PFN_cuGraphEventWaitNodeSetEvent_v11010,
    cuGraphMemAllocNodeGetParams: PFN_cuGraphMemAllocNodeGetParams_v11040,
    cuGraphMemFreeNodeGetParams: PFN_cuGraphMemFreeNodeGetParams_v11040,
    cuGraphExternalSemaphoresSignalNodeGetParams: PFN_cuGraphExternalSemaphoresSignalNodeGetParams_v11020,
    cuGraphExternalSemaphoresSignalNodeSetParams: PFN_cuGraphExternalSemaphoresSignalNodeSetParams_v11020,
    cuGraphExternalSemaphoresWaitNodeGetParams: PFN_cuGraphExternalSemaphoresWaitNodeGetParams_v11020,
    cuGraphExternalSemaphoresWaitNodeSetParams: PFN_cuGraphExternalSemaphoresWaitNodeSetParams_v11020,
    cuGraphBatchMemOpNodeGetParams: PFN_cuGraphBatchMemOpNodeGetParams_v11070,
    cuGraphBatchMemOpNodeSetParams: PFN_cuGraphBatchMemOpNodeSetParams_v11070,
    // Graphs: topology and debugging
    cuGraphGetNodes: PFN_cuGraphGetNodes_v10000,
    cuGraphGetRootNodes: PFN_cuGraphGetRootNodes_v10000,
    cuGraphGetEdges: PFN_cuGraphGetEdges_v12030,
    cuGraphNodeGetDependencies: PFN_cuGraphNodeGetDependencies_v12030,
    cuGraphNodeGetDependentNodes: PFN_cuGraphNodeGetDependentNodes_v12030,
    cuGraphAddDependencies: PFN_cuGraphAddDependencies_v12030,
    cuGraphRemoveDependencies: PFN_cuGraphRemoveDependencies_v12030,
    cuGraphDebugDotPrint: PFN_cuGraphDebugDotPrint_v11030,
    // Executable graphs: instantiate, upload, launch
    cuGraphInstantiateWithFlags: PFN_cuGraphInstantiateWithFlags_v11040,
    cuGraphInstantiateWithParams: PFN_cuGraphInstantiateWithParams_v12000,
    cuGraphExecGetFlags: PFN_cuGraphExecGetFlags_v12000,
    cuGraphUpload: PFN_cuGraphUpload_v11010,
    cuGraphLaunch: PFN_cuGraphLaunch_v10000,
    cuGraphExecDestroy: PFN_cuGraphExecDestroy_v10000,
    // Executable graphs: updates
    cuGraphExecUpdate: PFN_cuGraphExecUpdate_v12000,
    cuGraphExecNodeSetParams: PFN_cuGraphExecNodeSetParams_v12020,
    cuGraphExecKernelNodeSetParams: PFN_cuGraphExecKernelNodeSetParams_v12000,
    cuGraphExecMemcpyNodeSetParams: PFN_cuGraphExecMemcpyNodeSetParams_v10020,
    cuGraphExecMemsetNodeSetParams: PFN_cuGraphExecMemsetNodeSetParams_v10020,
    cuGraphExecHostNodeSetParams: PFN_cuGraphExecHostNodeSetParams_v10020,
    cuGraphExecChildGraphNodeSetParams: PFN_cuGraphExecChildGraphNodeSetParams_v11010,
    cuGraphExecEventRecordNodeSetEvent: PFN_cuGraphExecEventRecordNodeSetEvent_v11010,
    cuGraphExecEventWaitNodeSetEvent: PFN_cuGraphExecEventWaitNodeSetEvent_v11010,
    cuGraphExecExternalSemaphoresSignalNodeSetParams: PFN_cuGraphExecExternalSemaphoresSignalNodeSetParams_v11020,
    cuGraphExecExternalSemaphoresWaitNodeSetParams: PFN_cuGraphExecExternalSemaphoresWaitNodeSetParams_v11020,
    cuGraphExecBatchMemOpNodeSetParams: PFN_cuGraphExecBatchMemOpNodeSetParams_v11070,
    cuGraphNodeSetEnabled: PFN_cuGraphNodeSetEnabled_v11060,
    cuGraphNodeGetEnabled: PFN_cuGraphNodeGetEnabled_v11060,
    // Conditional nodes
    cuGraphConditionalHandleCreate: PFN_cuGraphConditionalHandleCreate_v12030,
    // Graph memory
    cuDeviceGraphMemTrim: PFN_cuDeviceGraphMemTrim_v11040,
    cuDeviceGetGraphMemAttribute: PFN_cuDeviceGetGraphMemAttribute_v11040,
    cuDeviceSetGraphMemAttribute: PFN_cuDeviceSetGraphMemAttribute_v11040,
    // User objects
    cuUserObjectCreate: PFN_cuUserObjectCreate_v11030,
    cuUserObjectRetain: PFN_cuUserObjectRetain_v11030,
    cuUserObjectRelease: PFN_cuUserObjectRelease_v11030,
    cuGraphRetainUserObject: PFN_cuGraphRetainUserObject_v11030,
    cuGraphReleaseUserObject: PFN_cuGraphReleaseUserObject_v11030,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_reads_the_version_from_the_typedef() {
        let e = EntrySpec::parse("cuGraphAddNode", "PFN_cuGraphAddNode_v12030");
        assert_eq!((e.name, e.version), ("cuGraphAddNode", 12030));
    }

    #[test]
    #[should_panic(expected = "does not match the field name")]
    fn parse_rejects_another_functions_typedef() {
        EntrySpec::parse("cuGraphAddNode", "PFN_cuGraphAddEmptyNode_v10000");
    }

    #[test]
    fn table_is_in_slot_order() {
        assert_eq!(ENTRIES[Slot::cuInit as usize].name, "cuInit");
        assert_eq!(
            ENTRIES[Slot::cuGraphConditionalHandleCreate as usize].name,
            "cuGraphConditionalHandleCreate"
        );
        assert_eq!(ENTRY_COUNT, ENTRIES.len());
    }
}
