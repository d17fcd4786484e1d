//! The crate's one error type.

use std::ffi::{CStr, c_char};

use cuda_graph_sys::{CUresult, LoadError, driver};

use crate::driver::DriverVersion;

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong, with enough context to act on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A driver call returned an error.
    #[error("{call} failed: {name} ({}): {message}", code.0)]
    Driver {
        /// The driver entry point, e.g. `cuGraphInstantiateWithFlags`.
        call: &'static str,
        /// The result it returned.
        code: CUresult,
        /// The result's name, e.g. `CUDA_ERROR_INVALID_VALUE`.
        name: &'static str,
        /// The driver's description of it.
        message: &'static str,
    },
    /// The driver library, or one of its entry points, is not available.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The installed driver is too old for a feature.
    #[error("{feature} needs a CUDA driver >= {needed}; this driver is {found}")]
    Unsupported {
        /// What was asked for, e.g. `conditional IF-ELSE nodes`.
        feature: &'static str,
        /// The oldest driver that has it.
        needed: DriverVersion,
        /// The installed driver.
        found: DriverVersion,
    },
    /// The device lacks a capability a feature needs.
    #[error(
        "{feature} needs compute capability >= {needed_major}.{needed_minor}; {device} is {major}.{minor}"
    )]
    UnsupportedDevice {
        /// What was asked for.
        feature: &'static str,
        /// The device's name.
        device: String,
        /// Its compute capability.
        major: i32,
        /// Its compute capability (minor part).
        minor: i32,
        /// The capability needed.
        needed_major: i32,
        /// The capability needed (minor part).
        needed_minor: i32,
    },
    /// Instantiation failed; `node` is the node the driver blamed (null if none).
    #[error("graph instantiation failed ({result:?}) at node {node:?}: {source}")]
    Instantiate {
        /// The failing driver call.
        source: Box<Error>,
        /// The driver's instantiate result.
        result: cuda_graph_sys::CUgraphInstantiateResult,
        /// The failing node.
        node: crate::ids::NodeId,
    },
    /// `cuGraphExecUpdate` refused the new graph; the exec is unchanged.
    #[error("graph exec update failed ({reason:?}) at node {node:?}: {source}")]
    Update {
        /// The failing driver call.
        source: Box<Error>,
        /// The driver's reason.
        reason: UpdateReason,
        /// The node the driver blamed (`info.errorNode`; null if none).
        node: crate::ids::NodeId,
    },
    /// A module failed to load; `log` is the JIT compiler's error log (PTX only).
    #[error("{source}; JIT log: {log}")]
    ModuleLoad {
        /// The failing driver call.
        source: Box<Error>,
        /// What the JIT compiler said.
        log: String,
    },
    /// An argument was rejected before any driver call; nothing was changed.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// No device with this ordinal.
    #[error("no CUDA device {ordinal}: {count} device(s) found")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: i32,
        /// How many devices the driver sees.
        count: i32,
    },
    /// A stream capture was invalidated by an operation that is illegal while capturing
    /// (synchronizing or querying the capturing stream, `cuMemAlloc` under
    /// [`CaptureMode::Global`](crate::CaptureMode::Global), ...). The partial graph was
    /// discarded and the streams are usable again.
    #[error("stream capture invalidated by {call}: {source}")]
    CaptureInvalidated {
        /// The driver call that invalidated the capture, e.g. `cuStreamSynchronize` or
        /// `cuMemAlloc`: the first call on the capturing thread that failed with a
        /// stream-capture error. [`UNKNOWN_CAPTURE_CALL`](crate::UNKNOWN_CAPTURE_CALL) when
        /// no such call was seen there (another thread, or a call made outside this crate).
        call: &'static str,
        /// The error the capture ended with: the closure's error if it returned one, else
        /// the invalidating call's error, else `cuStreamEndCapture`'s.
        source: Box<Error>,
    },
    /// A capture scope ended while side streams it forked had work not joined back to the
    /// origin stream. The partial graph was discarded and the streams are usable again.
    #[error("stream capture ended with {forks} forked stream(s) not joined back to the origin")]
    UnjoinedFork {
        /// How many forked streams had unjoined work.
        forks: usize,
    },
    /// An error of the caller's own code, carried through this crate (returned from inside
    /// a capture closure, a host-node callback, a layer of a runtime built on this crate).
    /// Make one with [`Error::external`]; get it back with `std::error::Error::source` or
    /// by matching and downcasting.
    #[error("{0}")]
    External(Box<dyn std::error::Error + Send + Sync + 'static>),
}

/// Why `cuGraphExecUpdate` refused a graph (`CUgraphExecUpdateResult`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum UpdateReason {
    /// An unexpected failure, described by the driver's return code (e.g. an invalid value).
    Error,
    /// Nodes or edges were added, removed or reordered.
    TopologyChanged,
    /// A node's kind changed.
    NodeTypeChanged,
    /// A kernel node's function changed (drivers before 11.2).
    FunctionChanged,
    /// A node's parameters changed in a way that cannot be updated (e.g. a memcpy's device).
    ParametersChanged,
    /// Something about a node cannot be updated.
    NotSupported,
    /// A kernel node's function changed in a way that cannot be updated.
    UnsupportedFunctionChange,
    /// A node's attributes changed in a way that cannot be updated.
    AttributesChanged,
    /// A value this crate does not know (from a newer driver).
    Unknown(u32),
}

impl UpdateReason {
    /// The reason for a driver value; `None` for `CU_GRAPH_EXEC_UPDATE_SUCCESS`.
    pub fn from_raw(r: cuda_graph_sys::CUgraphExecUpdateResult) -> Option<UpdateReason> {
        Some(match r.0 {
            0 => return None,
            1 => UpdateReason::Error,
            2 => UpdateReason::TopologyChanged,
            3 => UpdateReason::NodeTypeChanged,
            4 => UpdateReason::FunctionChanged,
            5 => UpdateReason::ParametersChanged,
            6 => UpdateReason::NotSupported,
            7 => UpdateReason::UnsupportedFunctionChange,
            8 => UpdateReason::AttributesChanged,
            v => UpdateReason::Unknown(v),
        })
    }

    /// Whether a fresh instantiation of the new graph can succeed where the update failed:
    /// true for every structural reason; false for [`UpdateReason::Error`], which means the
    /// arguments were wrong, and for unknown values.
    pub fn reinstantiate_helps(self) -> bool {
        !matches!(self, UpdateReason::Error | UpdateReason::Unknown(_))
    }
}

impl Error {
    /// The error for `call` returning `code`, with the driver's name and description.
    pub fn driver(call: &'static str, code: CUresult) -> Error {
        let (name, message) = describe(code);
        Error::Driver {
            call,
            code,
            name,
            message,
        }
    }

    /// An [`Error::External`] carrying `error`.
    pub fn external(error: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> Error {
        Error::External(error.into())
    }

    /// An [`Error::InvalidArgument`]: an argument rejected before any driver call.
    pub fn invalid(msg: impl Into<String>) -> Error {
        Error::InvalidArgument(msg.into())
    }

    /// The driver result code, if this error came from a driver call.
    pub fn code(&self) -> Option<CUresult> {
        match self {
            Error::Driver { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether this error leaves the context unusable: a fault of device work (an illegal
    /// address or instruction, a device-side `assert` or `__trap()`, a hardware error) that
    /// the driver is documented to return from then on to every call in the context. The
    /// codes are those whose description in `cuda.h` (CUDA 13.0) says the process is left
    /// "in an inconsistent state" or the context "cannot be used anymore":
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`, `..._LAUNCH_TIMEOUT`, `..._ASSERT`,
    /// `..._HARDWARE_STACK_ERROR`, `..._ILLEGAL_INSTRUCTION`, `..._MISALIGNED_ADDRESS`,
    /// `..._INVALID_ADDRESS_SPACE`, `..._INVALID_PC`, `..._LAUNCH_FAILED`,
    /// `..._TENSOR_MEMORY_LEAK`, `..._CONTAINED`, `..._MPS_CLIENT_TERMINATED` and
    /// `..._EXTERNAL_DEVICE` (see the
    /// [driver's error codes](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__TYPES.html)).
    ///
    /// Nothing recovers from such an error: with the primary context (the one [`Context`]
    /// retains) every later call in the process fails the same way, and the process must
    /// exit before it can use the device again. Out of memory, invalid arguments and capture
    /// errors are not sticky. Looks through the driver error inside [`Error::Instantiate`],
    /// [`Error::Update`], [`Error::ModuleLoad`] and [`Error::CaptureInvalidated`], and
    /// through an [`Error::External`] that wraps this crate's `Error`.
    /// [`Context::check_health`](crate::Context::check_health) asks the driver directly.
    ///
    /// [`Context`]: crate::Context
    pub fn is_sticky(&self) -> bool {
        match self {
            Error::Driver { code, .. } => is_sticky_code(*code),
            Error::Instantiate { source, .. }
            | Error::Update { source, .. }
            | Error::ModuleLoad { source, .. }
            | Error::CaptureInvalidated { source, .. } => source.is_sticky(),
            Error::External(e) => e.downcast_ref::<Error>().is_some_and(Error::is_sticky),
            _ => false,
        }
    }
}

/// Whether `code` is one of the sticky device faults listed at [`Error::is_sticky`].
pub(crate) fn is_sticky_code(code: CUresult) -> bool {
    matches!(
        code,
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
            | CUresult::CUDA_ERROR_LAUNCH_TIMEOUT
            | CUresult::CUDA_ERROR_ASSERT
            | CUresult::CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUresult::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUresult::CUDA_ERROR_MISALIGNED_ADDRESS
            | CUresult::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUresult::CUDA_ERROR_INVALID_PC
            | CUresult::CUDA_ERROR_LAUNCH_FAILED
            | CUresult::CUDA_ERROR_TENSOR_MEMORY_LEAK
            | CUresult::CUDA_ERROR_CONTAINED
            | CUresult::CUDA_ERROR_MPS_CLIENT_TERMINATED
            | CUresult::CUDA_ERROR_EXTERNAL_DEVICE
    )
}

/// Turns a driver result into a `Result`, naming the call on failure.
///
/// A stream-capture error is also noted as this thread's capture cause (see
/// [`note_capture_error`]), so a capture scope can name the call that invalidated it even
/// when the caller swallowed the error.
#[inline]
pub(crate) fn check(call: &'static str, code: CUresult) -> Result<()> {
    if code == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        note_capture_error(call, code);
        Err(Error::driver(call, code))
    }
}

/// The first stream-capture error seen on a thread: the call and its code.
pub(crate) type CaptureCause = (&'static str, CUresult);

thread_local! {
    /// Read and cleared by capture scopes (`capture.rs`), which save and restore it so nested
    /// scopes on one thread each see their own.
    static CAPTURE_CAUSE: std::cell::Cell<Option<CaptureCause>> = const { std::cell::Cell::new(None) };
}

/// Whether `code` is an error with which the driver reports an operation illegal during
/// stream capture. These are `CUDA_ERROR_STREAM_CAPTURE_*` (900..=906, 908) and
/// `CUDA_ERROR_CAPTURED_EVENT` (907), except `..._INVALIDATED` (901), which every call on an
/// already invalidated capture returns and so names no cause. cuda.h documents 900
/// (`..._UNSUPPORTED`) as what illegal calls (`cuMemAlloc` under global mode,
/// synchronizing a capturing stream, ...) return while invalidating the capture.
pub(crate) fn is_capture_cause(code: CUresult) -> bool {
    (900..=908).contains(&code.0) && code != CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
}

/// Records `call` as this thread's capture cause if `code` is one and none is recorded yet.
pub(crate) fn note_capture_error(call: &'static str, code: CUresult) {
    if is_capture_cause(code) {
        CAPTURE_CAUSE.with(|c| {
            if c.get().is_none() {
                c.set(Some((call, code)));
            }
        });
    }
}

/// Replaces this thread's capture cause, returning the previous one.
pub(crate) fn replace_capture_cause(cause: Option<CaptureCause>) -> Option<CaptureCause> {
    CAPTURE_CAUSE.with(|c| c.replace(cause))
}

/// The driver's name and description of a result code; both strings are static in libcuda.
fn describe(code: CUresult) -> (&'static str, &'static str) {
    const UNKNOWN: (&str, &str) = ("CUDA_ERROR_UNKNOWN_CODE", "unrecognized error code");
    let Ok(d) = driver() else { return UNKNOWN };
    let (Ok(get_name), Ok(get_string)) = (d.cuGetErrorName(), d.cuGetErrorString()) else {
        return UNKNOWN;
    };
    let mut name: *const c_char = std::ptr::null();
    let mut message: *const c_char = std::ptr::null();
    // SAFETY: valid out-pointers; on success the driver returns pointers to static,
    // NUL-terminated strings that live as long as the loaded (never unloaded) library.
    unsafe {
        if get_name(code, &mut name) != CUresult::CUDA_SUCCESS || name.is_null() {
            return UNKNOWN;
        }
        if get_string(code, &mut message) != CUresult::CUDA_SUCCESS || message.is_null() {
            message = c"".as_ptr();
        }
        (
            CStr::from_ptr(name).to_str().unwrap_or(UNKNOWN.0),
            CStr::from_ptr(message).to_str().unwrap_or(UNKNOWN.1),
        )
    }
}

/// Calls a driver entry point through the run-time table and checks its result:
/// `unsafe { cu!(cuInit(0)) }?`. Missing driver or entry point is an `Error::Load`; a failing
/// result is an `Error::Driver` naming the entry point. The caller supplies the `unsafe`
/// block and with it the guarantee that the arguments are valid for the call.
macro_rules! cu {
    ($name:ident ( $($arg:expr),* $(,)? )) => {
        $crate::error::check(
            stringify!($name),
            ($crate::sys::driver()?.$name()?)($($arg),*),
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_error_names_call_code_and_message() {
        let e = Error::Driver {
            call: "cuGraphLaunch",
            code: CUresult::CUDA_ERROR_INVALID_VALUE,
            name: "CUDA_ERROR_INVALID_VALUE",
            message: "invalid argument",
        };
        assert_eq!(
            e.to_string(),
            "cuGraphLaunch failed: CUDA_ERROR_INVALID_VALUE (1): invalid argument"
        );
        assert_eq!(e.code(), Some(CUresult::CUDA_ERROR_INVALID_VALUE));
    }

    #[test]
    fn device_faults_are_sticky_and_other_errors_are_not() {
        let sticky = [
            (226, "CONTAINED"),
            (700, "ILLEGAL_ADDRESS"),
            (702, "LAUNCH_TIMEOUT"),
            (710, "ASSERT"),
            (714, "HARDWARE_STACK_ERROR"),
            (715, "ILLEGAL_INSTRUCTION"),
            (716, "MISALIGNED_ADDRESS"),
            (717, "INVALID_ADDRESS_SPACE"),
            (718, "INVALID_PC"),
            (719, "LAUNCH_FAILED"),
            (721, "TENSOR_MEMORY_LEAK"),
            (810, "MPS_CLIENT_TERMINATED"),
            (911, "EXTERNAL_DEVICE"),
        ];
        let fault = |code: i32| Error::Driver {
            call: "cuStreamSynchronize",
            code: CUresult(code as _),
            name: "",
            message: "",
        };
        for (code, name) in sticky {
            assert!(fault(code).is_sticky(), "{code} ({name}) is sticky");
        }
        // Errors the context survives: out of memory, bad arguments or handles, not ready,
        // a launch refused for its configuration, capture errors, update failures, unknown.
        for code in [
            1, 2, 3, 201, 400, 500, 600, 701, 720, 900, 901, 910, 999, 12345,
        ] {
            assert!(!fault(code).is_sticky(), "{code} is not sticky");
        }
        // Wrapped driver errors are looked through; crate-side errors are never sticky.
        let wrapped = Error::Instantiate {
            source: Box::new(fault(719)),
            result: cuda_graph_sys::CUgraphInstantiateResult(1),
            node: crate::ids::NodeId::null(),
        };
        assert!(wrapped.is_sticky());
        let captured = Error::CaptureInvalidated {
            call: "cuMemAlloc",
            source: Box::new(fault(900)),
        };
        assert!(!captured.is_sticky());
        assert!(Error::external(fault(710)).is_sticky());
        assert!(!Error::external(std::fmt::Error).is_sticky());
        assert!(!Error::invalid("x").is_sticky());
        assert!(!Error::UnjoinedFork { forks: 1 }.is_sticky());
    }

    #[test]
    fn success_is_ok() {
        assert!(check("cuInit", CUresult::CUDA_SUCCESS).is_ok());
    }

    #[test]
    fn unsupported_names_feature_and_versions() {
        let e = Error::Unsupported {
            feature: "conditional IF-ELSE and SWITCH nodes",
            needed: DriverVersion(12080),
            found: DriverVersion(12040),
        };
        assert_eq!(
            e.to_string(),
            "conditional IF-ELSE and SWITCH nodes needs a CUDA driver >= 12.8; this driver is 12.4"
        );
    }
}
