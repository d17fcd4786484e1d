//! The runtime's error type: the CUDA errors of `cuda-graph`, plus schedule and replay-order
//! errors of its own. `cuda_graph::Error` knows nothing of this crate.

use crate::schedule::{ScheduleError, Step};

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong building or replaying graphed callables.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A CUDA call, a capture, or a callable failed (callables and hooks return
    /// [`cuda_graph::Result`]; errors of a caller's own code travel as
    /// [`cuda_graph::Error::External`]).
    #[error(transparent)]
    Cuda(#[from] cuda_graph::Error),
    /// A pipeline schedule or graph layout was rejected before any driver call.
    #[error("invalid schedule: {0}")]
    Schedule(#[from] ScheduleError),
    /// A replay did not follow the schedule; nothing was enqueued.
    #[error(
        "replay out of schedule order at order[{position}]: expected {}, got {}",
        crate::replay::describe_step(expected),
        crate::replay::describe_step(got)
    )]
    ReplayOrder {
        /// The position in the order of the step expected next.
        position: usize,
        /// The step the schedule expects there.
        expected: Step,
        /// The step asked for.
        got: Step,
    },
}

impl Error {
    /// An invalid-argument error (a [`cuda_graph::Error::InvalidArgument`]): something the
    /// caller passed was rejected before any work was enqueued.
    pub(crate) fn invalid(msg: impl Into<String>) -> Error {
        Error::Cuda(cuda_graph::Error::InvalidArgument(msg.into()))
    }

    /// The CUDA error inside, if this is one.
    pub fn as_cuda(&self) -> Option<&cuda_graph::Error> {
        match self {
            Error::Cuda(e) => Some(e),
            _ => None,
        }
    }
}

/// Back into `cuda_graph::Error` (a CUDA error as itself, the rest as
/// [`cuda_graph::Error::External`]), so runtime calls can be made inside capture closures and
/// callables, which return `cuda_graph::Result`.
impl From<Error> for cuda_graph::Error {
    fn from(e: Error) -> cuda_graph::Error {
        match e {
            Error::Cuda(e) => e,
            other => cuda_graph::Error::External(Box::new(other)),
        }
    }
}
