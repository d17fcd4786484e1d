//! Opening `libnccl.so.2` at run time and checking its version.
//!
//! Where the library is looked for:
//! 1. [`LIBRARY_VAR`] (`CUDA_GRAPH_NCCL_LIBRARY`): the path of `libnccl.so.2`, or a directory
//!    holding it. When it is set, nothing else is tried: a job must not run on another NCCL
//!    than the one its user named.
//! 2. The dynamic loader's usual search for `libnccl.so.2` (`LD_LIBRARY_PATH`, the `ldconfig`
//!    cache, the system directories).
//!
//! PyTorch installs NCCL inside its environment, where the loader does not look:
//! `<site-packages>/nvidia/nccl/lib/libnccl.so.2`. Point the variable there to use it.
//!
//! Nothing is opened until a communicator or a unique id is asked for, so programs built on
//! this crate start, and run their one-GPU paths, on machines without NCCL.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::error::{Error, Result};
use crate::sys;

/// The library's file name.
pub const LIBNCCL: &str = "libnccl.so.2";

/// The environment variable naming the NCCL library to open (a file, or a directory holding
/// `libnccl.so.2`).
pub const LIBRARY_VAR: &str = "CUDA_GRAPH_NCCL_LIBRARY";

/// The oldest NCCL this crate accepts: 2.28, the series whose header it is built against
/// (communicator shrink, device-initiated API; the GPU machines run 2.28.9).
pub const MIN_VERSION: Version = Version {
    major: 2,
    minor: 28,
    patch: 0,
};

/// An NCCL version, decoded from `ncclGetVersion`'s code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Major version (2).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch level.
    pub patch: u32,
}

impl Version {
    /// Decodes `NCCL_VERSION_CODE`: `X*1000 + Y*100 + Z` up to 2.8, `X*10000 + Y*100 + Z`
    /// from 2.9 on.
    pub fn from_code(code: u32) -> Version {
        if code >= 10_000 {
            Version {
                major: code / 10_000,
                minor: code % 10_000 / 100,
                patch: code % 100,
            }
        } else {
            Version {
                major: code / 1000,
                minor: code % 1000 / 100,
                patch: code % 100,
            }
        }
    }

    /// The version of the `nccl.h` this crate was built against.
    pub fn header() -> Version {
        Version::from_code(sys::NCCL_VERSION_CODE)
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// An opened NCCL library whose version was checked.
pub struct Nccl {
    pub(crate) lib: sys::NcclLibrary,
    version: Version,
    source: PathBuf,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("version", &self.version)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl Nccl {
    /// Opens the library at `path` (a file, or a directory holding `libnccl.so.2`; a bare
    /// file name goes through the loader's search) and checks that it is NCCL 2 and at least
    /// [`MIN_VERSION`].
    ///
    /// Most programs use [`nccl()`], which opens the process-wide library once.
    /// Errors: [`Error::Load`] when it cannot be opened or lacks `ncclGetVersion`,
    /// [`Error::Version`] when it is too old or not NCCL 2.
    pub fn open(path: impl AsRef<Path>) -> Result<Nccl> {
        let mut path = path.as_ref().to_path_buf();
        if path.is_dir() {
            path.push(LIBNCCL);
        }
        // SAFETY: opening NCCL runs its library constructors, which only initialise NCCL's own
        // state; the symbols are typed by bindgen from the header of the same major version,
        // and the version is checked below before any other entry is called.
        let lib = unsafe { sys::NcclLibrary::new(&path) }.map_err(|e| Error::Load {
            reason: format!("cannot open {}: {e}", path.display()),
        })?;
        let get_version = lib.ncclGetVersion.as_ref().map_err(|_| Error::Load {
            reason: format!(
                "{} has no ncclGetVersion: not an NCCL library",
                path.display()
            ),
        })?;
        let mut code = 0;
        // SAFETY: valid out-pointer; ncclGetVersion only writes the version.
        let result = unsafe { get_version(&mut code) };
        if result != sys::ncclResult_t::ncclSuccess {
            return Err(Error::Load {
                reason: format!("ncclGetVersion of {} failed ({})", path.display(), result.0),
            });
        }
        let version = Version::from_code(u32::try_from(code).unwrap_or(0));
        if version.major != MIN_VERSION.major || version < MIN_VERSION {
            return Err(Error::Version {
                found: version,
                required: MIN_VERSION,
                path,
            });
        }
        Ok(Nccl {
            lib,
            version,
            source: path,
        })
    }

    /// The run-time library's version.
    pub fn version(&self) -> Version {
        self.version
    }

    /// Where the library was opened from (as given to the loader).
    pub fn source(&self) -> &Path {
        &self.source
    }
}

/// The process-wide NCCL library, opened on first use. Later calls return the same library,
/// or the same error.
///
/// Where it is looked for: [`LIBRARY_VAR`] (`CUDA_GRAPH_NCCL_LIBRARY`: the path of
/// `libnccl.so.2`, or a directory holding it; when set, nothing else is tried), else the
/// dynamic loader's usual search for `libnccl.so.2` (`LD_LIBRARY_PATH`, the `ldconfig` cache).
/// PyTorch keeps its NCCL where the loader does not look
/// (`<site-packages>/nvidia/nccl/lib`): point the variable there to use it.
///
/// Errors: [`Error::Load`] or [`Error::Version`], naming where it looked and how to point
/// [`LIBRARY_VAR`] at an NCCL.
pub fn nccl() -> Result<&'static Nccl> {
    static LIB: OnceLock<Result<Nccl>> = OnceLock::new();
    LIB.get_or_init(|| {
        keep_nvls_off()?;
        open_default(std::env::var_os(LIBRARY_VAR))
    })
    .as_ref()
    .map_err(Error::again)
}

/// The variable that keeps NCCL from using NVLink SHARP multicast.
pub const NVLS_VAR: &str = "NCCL_NVLS_ENABLE";

/// Keeps NVLink multicast off in this process before NCCL can read its settings: sets
/// [`NVLS_VAR`] to `0` when it is unset, and refuses any other value (multicast objects can
/// put shared GPUs out of service; this crate never lets NCCL create them).
fn keep_nvls_off() -> Result<()> {
    match std::env::var_os(NVLS_VAR) {
        None => {
            // SAFETY: runs once, inside the library's one-time initialization, before any
            // NCCL function can run in this process (each goes through the library this
            // initialization returns, and other threads asking for it wait here); Rust's own
            // environment accesses take std's lock. What remains is foreign code reading
            // the environment on another thread at this instant, which this crate does not
            // start.
            unsafe { std::env::set_var(NVLS_VAR, "0") };
            Ok(())
        }
        Some(v) if v.to_str().map(str::trim) == Some("0") => Ok(()),
        Some(v) => Err(Error::Load {
            reason: format!(
                "{NVLS_VAR}={}: NVLink multicast (NVLS) stays off with this crate (its \
                 multicast objects can put shared GPUs out of service); set {NVLS_VAR}=0 or \
                 unset it",
                v.to_string_lossy()
            ),
        }),
    }
}

fn open_default(var: Option<OsString>) -> Result<Nccl> {
    match var.filter(|v| !v.is_empty()) {
        Some(path) => Nccl::open(&path).map_err(|e| match e {
            Error::Load { reason } => Error::Load {
                reason: format!("{LIBRARY_VAR}={}: {reason}", path.to_string_lossy()),
            },
            other => other,
        }),
        None => Nccl::open(LIBNCCL).map_err(|e| match e {
            Error::Load { reason } => Error::Load {
                reason: format!(
                    "{reason}; set {LIBRARY_VAR} to an NCCL >= {MIN_VERSION} (a file or its \
                     directory: PyTorch's is under site-packages/nvidia/nccl/lib)"
                ),
            },
            other => other,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_decode_both_ways() {
        assert_eq!(Version::from_code(22809).to_string(), "2.28.9");
        assert_eq!(Version::from_code(2708).to_string(), "2.7.8");
        assert_eq!(Version::from_code(21903).to_string(), "2.19.3");
        assert!(Version::from_code(22809) > Version::from_code(22799));
        assert_eq!(Version::header().major, 2);
    }

    #[test]
    fn a_named_library_that_is_missing_is_a_clear_error() {
        let err = open_default(Some("/nonexistent/libnccl.so.2".into())).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(LIBRARY_VAR) && msg.contains("/nonexistent"),
            "{msg}"
        );
    }

    #[test]
    fn a_library_that_is_not_nccl_is_refused() {
        // libc is always there and has no ncclGetVersion.
        let err = Nccl::open("libc.so.6").unwrap_err();
        assert!(err.to_string().contains("not an NCCL library"), "{err}");
    }
}
