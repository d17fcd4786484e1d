//! The driver entry-point table: one line per entry point, typed with the `PFN_*_vNNNNN`
//! typedef of `cudaTypedefs.h` whose ABI version the loader asks the driver for.
//!
//! The typedef name is the single source of truth: the version requested from
//! `cuGetProcAddress_v2` is parsed from it at compile time, and a line whose field name does
//! not match its typedef fails to compile. A CPU test checks that each line names the newest
//! ABI that the header (with `compat.h`) defines.
//!
//! A driver older than the newest ABI of an entry lacks it. Two forms of line keep such
//! entries usable:
//!
//! * `name: PFN_name_vNEW | PFN_name_vOLD, ...` lists older ABI versions *with the same
//!   signature*, tried in order when the driver lacks the newest one. That the typedefs are one
//!   type is proved at compile time, so the accessor's type is right whichever one resolved.
//! * `name_vOLD = name: PFN_name_vOLD` is a second accessor, with its own Rust name, for the
//!   same driver symbol at an older ABI *with another signature*. Callers use it when the
//!   newest accessor is an error (see [`Driver::fallbacks`](crate::Driver::fallbacks)).

use std::ffi::CStr;

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

/// Name, requested ABI version and fallbacks of one entry of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntrySpec {
    /// The name of its accessor on [`Driver`](crate::Driver): the base name for the newest
    /// ABI (`cuCtxSynchronize`), or `<name>_v<version>` for an older ABI with another
    /// signature (`cuCtxSynchronize_v2000`).
    pub accessor: &'static str,
    /// The driver's base name, e.g. `cuGraphAddNode` (not the `_v2` symbol).
    pub name: &'static str,
    /// The ABI version passed to `cuGetProcAddress_v2`, e.g. 12030.
    pub version: u32,
    /// The typedef the table uses for it, e.g. `PFN_cuGraphAddNode_v12030`.
    pub typedef: &'static str,
    /// Older ABI versions with the same signature (their `PFN_<name>_v<version>` typedefs are
    /// the entry's type), newest first, that the loader tries in order when the driver lacks
    /// `version`. Empty for most entries.
    pub fallbacks: &'static [u32],
}

impl EntrySpec {
    /// Parses `PFN_<name>_v<digits>` and checks the accessor name and the fallbacks; panics
    /// (at compile time, as the table is a `const`) when the typedef does not belong to
    /// `name`, when an older-ABI accessor is not `<name>_v<version>`, or when the fallbacks
    /// are not strictly older, newest first.
    const fn parse(
        accessor: &'static str,
        name: &'static str,
        typedef: &'static str,
        fallbacks: &'static [u32],
    ) -> Self {
        let version = version_of(name, typedef);
        if !str_eq(accessor, name) {
            // An older-ABI accessor is named after the typedef without its `PFN_` prefix.
            let (a, t) = (accessor.as_bytes(), typedef.as_bytes());
            assert!(
                a.len() + 4 == t.len(),
                "an accessor other than the base name must be <name>_v<version> of its typedef"
            );
            let mut i = 0;
            while i < a.len() {
                assert!(
                    a[i] == t[i + 4],
                    "an accessor other than the base name must be <name>_v<version> of its typedef"
                );
                i += 1;
            }
        }
        let mut newer = version;
        let mut i = 0;
        while i < fallbacks.len() {
            let v = fallbacks[i];
            assert!(
                v < newer,
                "fallbacks must be older than the entry, newest first"
            );
            newer = v;
            i += 1;
        }
        EntrySpec {
            accessor,
            name,
            version,
            typedef,
            fallbacks,
        }
    }

    /// The ABI versions the loader tries, in order: [`version`](Self::version), then each of
    /// the [`fallbacks`](Self::fallbacks).
    pub fn versions(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::once(self.version).chain(self.fallbacks.iter().copied())
    }
}

/// The version of `PFN_<name>_v<digits>`; panics (at compile time for the table) when the
/// typedef does not belong to `name`.
const fn version_of(name: &str, typedef: &str) -> u32 {
    version_of_bytes(name.as_bytes(), typedef.as_bytes())
}

/// The version of `fallback`, which must be a typedef of the same function as `typedef`
/// (`PFN_<name>_v<digits>` with the same name); panics at compile time for the table.
const fn sibling_version(typedef: &str, fallback: &str) -> u32 {
    let t = typedef.as_bytes();
    let mut end = t.len();
    while end > 0 && t[end - 1].is_ascii_digit() {
        end -= 1;
    }
    assert!(
        end > 6 && t[end - 1] == b'v' && t[end - 2] == b'_',
        "typedef must end in _v<version>"
    );
    let (head, _) = t.split_at(end - 2);
    let (_, name) = head.split_at(4);
    version_of_bytes(name, fallback.as_bytes())
}

const fn version_of_bytes(n: &[u8], t: &[u8]) -> u32 {
    let prefix = b"PFN_";
    assert!(
        t.len() > prefix.len() + n.len() + 2,
        "typedef does not match the field name: too short"
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
    version
}

const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// `"<name>\0"` as a `CStr`; panics at compile time on a name with a NUL byte.
const fn c_name(with_nul: &'static str) -> &'static CStr {
    match CStr::from_bytes_with_nul(with_nul.as_bytes()) {
        Ok(c) => c,
        Err(_) => panic!("entry names are NUL-free identifiers"),
    }
}

/// The base name of an entry: the symbol after `=` when there is one, else the accessor.
macro_rules! base_name {
    ($accessor:ident) => {
        stringify!($accessor)
    };
    ($accessor:ident $symbol:ident) => {
        stringify!($symbol)
    };
}

macro_rules! driver_entries {
    ($( $(#[$meta:meta])* $accessor:ident $(= $symbol:ident)? : $pfn:ident $(| $fallback:ident)* ,)*) => {
        #[allow(non_camel_case_types, clippy::upper_case_acronyms)]
        #[derive(Clone, Copy)]
        #[repr(usize)]
        enum Slot { $($accessor,)* }

        /// Every entry point of the table, in table order.
        pub const ENTRIES: &[EntrySpec] = &[
            $( EntrySpec::parse(
                stringify!($accessor),
                base_name!($accessor $($symbol)?),
                stringify!($pfn),
                {
                    // Each fallback's version, from its typedef (checked to be the same
                    // function's as the entry's typedef).
                    const FALLBACKS: &[u32] = &[$(
                        sibling_version(stringify!($pfn), stringify!($fallback)),
                    )*];
                    FALLBACKS
                },
            ), )*
        ];

        /// Number of entries in the table.
        pub const ENTRY_COUNT: usize = ENTRIES.len();

        /// The driver symbol of each entry, NUL-terminated, in table order.
        pub(crate) const SYMBOLS: [&CStr; ENTRY_COUNT] = [
            $( c_name(concat!(base_name!($accessor $($symbol)?), "\0")), )*
        ];

        // A fallback is called through the entry's own typedef: prove they are one type.
        $( $( const _: fn($pfn) -> $fallback = |f| f; )* )*

        impl crate::Driver {
            $(
                #[doc = concat!("`", base_name!($accessor $($symbol)?),
                                "`, resolved as `", stringify!($pfn), "`",
                                $(", else as `", stringify!($fallback), "`",)*
                                "; an error if the installed driver lacks it.")]
                #[inline]
                pub fn $accessor(&self) -> Result<<$pfn as EntryFn>::Fn, crate::LoadError> {
                    let ptr = self.entry_ptr(Slot::$accessor as usize);
                    // SAFETY: the pointer is null or was returned by cuGetProcAddress_v2 for
                    // exactly this name and the ABI version of this typedef or of one of its
                    // fallbacks, which are the same type (proved above); a null pointer
                    // becomes `None`, as `Option<fn>` has the null niche.
                    let f = unsafe { core::mem::transmute::<*mut core::ffi::c_void, $pfn>(ptr) };
                    f.ok_or_else(|| self.missing(Slot::$accessor as usize))
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
    // ... and their ABI before 13.0 (no context argument: they act on the current context)
    cuCtxSynchronize_v2000 = cuCtxSynchronize: PFN_cuCtxSynchronize_v2000,
    cuCtxGetDevice_v2000 = cuCtxGetDevice: PFN_cuCtxGetDevice_v2000,
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
    cuEventElapsedTime: PFN_cuEventElapsedTime_v12080 | PFN_cuEventElapsedTime_v2000,
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
    cuOccupancyMaxActiveClusters: PFN_cuOccupancyMaxActiveClusters_v11070,
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
        let e = EntrySpec::parse(
            "cuGraphAddNode",
            "cuGraphAddNode",
            "PFN_cuGraphAddNode_v12030",
            &[],
        );
        assert_eq!((e.name, e.version), ("cuGraphAddNode", 12030));
        assert_eq!(e.versions().collect::<Vec<_>>(), [12030]);
    }

    #[test]
    #[should_panic(expected = "does not match the field name")]
    fn parse_rejects_another_functions_typedef() {
        EntrySpec::parse(
            "cuGraphAddNode",
            "cuGraphAddNode",
            "PFN_cuGraphAddEmptyNode_v10000",
            &[],
        );
    }

    #[test]
    fn parse_reads_fallbacks_in_order() {
        let e = EntrySpec::parse(
            "cuEventElapsedTime",
            "cuEventElapsedTime",
            "PFN_cuEventElapsedTime_v12080",
            &[2000],
        );
        assert_eq!(e.versions().collect::<Vec<_>>(), [12080, 2000]);
    }

    #[test]
    #[should_panic(expected = "fallbacks must be older")]
    fn parse_rejects_a_newer_fallback() {
        EntrySpec::parse("cuX", "cuX", "PFN_cuX_v2000", &[12080]);
    }

    #[test]
    #[should_panic(expected = "does not match the field name")]
    fn a_fallback_typedef_of_another_function_is_rejected() {
        assert_eq!(sibling_version("PFN_cuX_v12080", "PFN_cuX_v2000"), 2000);
        sibling_version("PFN_cuX_v12080", "PFN_cuY_v2000");
    }

    #[test]
    #[should_panic(expected = "must be <name>_v<version>")]
    fn parse_rejects_an_old_abi_accessor_named_after_another_version() {
        EntrySpec::parse(
            "cuCtxSynchronize_v3000",
            "cuCtxSynchronize",
            "PFN_cuCtxSynchronize_v2000",
            &[],
        );
    }

    #[test]
    fn table_is_in_slot_order() {
        for (i, e) in ENTRIES.iter().enumerate() {
            assert_eq!(SYMBOLS[i].to_str(), Ok(e.name));
        }
        assert_eq!(ENTRIES[Slot::cuInit as usize].name, "cuInit");
        assert_eq!(
            ENTRIES[Slot::cuGraphConditionalHandleCreate as usize].name,
            "cuGraphConditionalHandleCreate"
        );
        let old = ENTRIES[Slot::cuCtxSynchronize_v2000 as usize];
        assert_eq!(
            (old.accessor, old.name, old.version),
            ("cuCtxSynchronize_v2000", "cuCtxSynchronize", 2000)
        );
        assert_eq!(ENTRY_COUNT, ENTRIES.len());
    }
}
