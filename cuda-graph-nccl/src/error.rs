//! The crate's error type.

use std::path::PathBuf;

use crate::library::Version;
use crate::rendezvous::RendezvousError;
use crate::sys::ncclResult_t;

/// Everything that can go wrong, with enough context to act on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// NCCL could not be opened, or what was opened is not NCCL.
    #[error("NCCL is not available: {reason}")]
    Load {
        /// What failed, with the path tried and what to set.
        reason: String,
    },
    /// The NCCL that was opened is older than this crate needs (or not NCCL 2).
    #[error("NCCL {found} at {} is too old: this crate needs NCCL {required} or newer (set CUDA_GRAPH_NCCL_LIBRARY to another)", path.display())]
    Version {
        /// The version the library reports.
        found: Version,
        /// The oldest version accepted.
        required: Version,
        /// Where it was opened from.
        path: PathBuf,
    },
    /// The opened NCCL lacks an entry point this crate calls.
    #[error("the NCCL library lacks {name}")]
    Missing {
        /// The entry point.
        name: &'static str,
    },
    /// An NCCL call failed.
    #[error("{call} failed: {} ({}){}", result_name(*result), message, if detail.is_empty() { String::new() } else { format!(": {detail}") })]
    Nccl {
        /// The NCCL call.
        call: &'static str,
        /// Its result code.
        result: ncclResult_t,
        /// `ncclGetErrorString` of the code.
        message: String,
        /// `ncclGetLastError`: NCCL's own account of the last failure (may be empty).
        detail: String,
    },
    /// A CUDA call of cuda-graph failed (making a context current, checking a capture).
    #[error(transparent)]
    Cuda(#[from] cuda_graph::Error),
    /// An argument this crate checks before calling NCCL: buffer lengths, ranks, devices.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The processes of a job could not meet.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A copy of a load error, for the process-wide library's cached failure.
    pub(crate) fn again(&self) -> Error {
        match self {
            Error::Load { reason } => Error::Load {
                reason: reason.clone(),
            },
            Error::Version {
                found,
                required,
                path,
            } => Error::Version {
                found: *found,
                required: *required,
                path: path.clone(),
            },
            other => Error::Load {
                reason: other.to_string(),
            },
        }
    }
}

/// The name of an NCCL result code.
pub fn result_name(result: ncclResult_t) -> &'static str {
    match result {
        ncclResult_t::ncclSuccess => "ncclSuccess",
        ncclResult_t::ncclUnhandledCudaError => "ncclUnhandledCudaError",
        ncclResult_t::ncclSystemError => "ncclSystemError",
        ncclResult_t::ncclInternalError => "ncclInternalError",
        ncclResult_t::ncclInvalidArgument => "ncclInvalidArgument",
        ncclResult_t::ncclInvalidUsage => "ncclInvalidUsage",
        ncclResult_t::ncclRemoteError => "ncclRemoteError",
        ncclResult_t::ncclInProgress => "ncclInProgress",
        _ => "an NCCL result this crate does not know",
    }
}

/// Into cuda-graph's error, so NCCL calls can sit in a capture closure or a graphed
/// runtime's hook with `?`: cuda-graph's own errors come back as they were, the others as
/// [`cuda_graph::Error::External`].
impl From<Error> for cuda_graph::Error {
    fn from(e: Error) -> cuda_graph::Error {
        match e {
            Error::Cuda(inner) => inner,
            other => cuda_graph::Error::External(Box::new(other)),
        }
    }
}
