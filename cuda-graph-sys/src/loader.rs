//! Opens `libcuda.so.1` at run time and resolves the entry-point table through
//! `cuGetProcAddress_v2`.
//!
//! Plain symbol names are never looked up with `dlsym`: libcuda exports the *oldest* ABI under
//! them (`cuGraphInstantiate`, `cuStreamGetCaptureInfo`, ...), so a plain lookup yields a
//! function with another signature. Only `cuGetProcAddress_v2` itself is taken with `dlsym`.
//!
//! Default-stream policy: entries are resolved with `CU_GET_PROC_ADDRESS_LEGACY_STREAM`, so
//! calls that name the null stream mean the legacy default stream. The workspace never uses
//! the null stream itself; it creates explicit non-blocking streams.

use std::ffi::{CStr, CString, c_int, c_void};
use std::sync::OnceLock;

use crate::table::{ENTRIES, ENTRY_COUNT, SYMBOLS};
use crate::{
    CUdriverProcAddress_flags, CUdriverProcAddressQueryResult, CUresult,
    PFN_cuGetProcAddress_v12000,
};

/// Name of the driver library opened at run time.
pub const LIBCUDA: &str = "libcuda.so.1";

/// Why the driver or one of its entry points is not available.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadError {
    /// `libcuda.so.1` could not be opened: no NVIDIA driver is installed here.
    NoDriver {
        /// What `dlerror` said (it names the library).
        reason: String,
    },
    /// The driver has no `cuGetProcAddress_v2` (drivers before CUDA 12.0).
    DriverTooOld,
    /// The installed driver does not provide this entry point at this ABI version (nor at
    /// any of the entry's fallback versions).
    Missing {
        /// The base name, e.g. `cuGraphConditionalHandleCreate`.
        name: &'static str,
        /// The ABI version asked for last: the entry's own, or its oldest fallback.
        version: u32,
        /// What `cuGetProcAddress_v2` returned for it.
        result: CUresult,
        /// Its query status: symbol not found, or version not sufficient.
        status: CUdriverProcAddressQueryResult,
    },
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::NoDriver { reason } => write!(
                f,
                "no CUDA driver: {reason}; is the NVIDIA driver installed?"
            ),
            LoadError::DriverTooOld => write!(
                f,
                "the CUDA driver is too old: it lacks cuGetProcAddress_v2 (needs CUDA >= 12.0)"
            ),
            LoadError::Missing {
                name,
                version,
                result,
                status,
            } => {
                let why = match *status {
                    CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT => {
                        "the driver is older than this ABI version"
                    }
                    CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND => {
                        "the driver has no such symbol"
                    }
                    // Documented for a version newer than the driver; the status may be unset.
                    _ if *result == CUresult::CUDA_ERROR_INVALID_VALUE => {
                        "the driver rejected the request, as it does for ABI versions newer \
                         than itself"
                    }
                    _ => "the driver did not resolve it",
                };
                write!(
                    f,
                    "the installed CUDA driver lacks {name} (ABI {version}): {why} \
                     (cuGetProcAddress_v2 returned {}, status {})",
                    result.0, status.0
                )
            }
        }
    }
}

impl std::error::Error for LoadError {}

/// A table entry that the installed driver lacks at its newest ABI but has at an older one
/// ([`Driver::fallbacks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fallback {
    /// The driver's base name, e.g. `cuCtxSynchronize`.
    pub name: &'static str,
    /// The newest ABI version the table asks for, which the driver lacks.
    pub wanted: u32,
    /// The older ABI version that resolved.
    pub resolved: u32,
    /// The accessor that reaches it: the entry's own when the older ABI has the same
    /// signature (`cuEventElapsedTime`), else an older-ABI accessor with its own signature
    /// (`cuCtxSynchronize_v2000`).
    pub accessor: &'static str,
}

impl std::fmt::Display for Fallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} at ABI {} instead of {} (through {})",
            self.name, self.resolved, self.wanted, self.accessor
        )
    }
}

/// The loaded driver: the library handle and every entry point of the table, resolved once.
///
/// Obtain it with [`driver()`]. Each entry point has an accessor named after it that returns
/// the function pointer or a [`LoadError::Missing`] naming it, e.g.
/// `driver()?.cuGraphLaunch()?`.
pub struct Driver {
    get_proc: unsafe extern "C" fn(
        *const std::ffi::c_char,
        *mut *mut c_void,
        c_int,
        u64,
        *mut CUdriverProcAddressQueryResult,
    ) -> CUresult,
    ptrs: [*mut c_void; ENTRY_COUNT],
    /// The ABI version each entry resolved at; 0 when it did not resolve.
    resolved: [u32; ENTRY_COUNT],
    /// What the last attempt for each entry returned (for an unresolved one, the error):
    /// version, result, status.
    results: [(u32, CUresult, CUdriverProcAddressQueryResult); ENTRY_COUNT],
}

// SAFETY: the pointers are immutable after loading and point to thread-safe driver entry
// points; the library is never closed.
unsafe impl Send for Driver {}
// SAFETY: as above.
unsafe impl Sync for Driver {}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("resolved", &(ENTRY_COUNT - self.missing_entries().len()))
            .field("entries", &ENTRY_COUNT)
            .field("fallbacks", &self.fallbacks())
            .finish()
    }
}

/// Environment variable naming another driver library to open instead of [`LIBCUDA`] (a path
/// or a soname), e.g. for a driver installed outside the loader's search path.
pub const LIBCUDA_ENV: &str = "CUDA_GRAPH_LIBCUDA";

/// The process-wide driver, loaded on first use from [`LIBCUDA`] (or the library named by
/// [`LIBCUDA_ENV`]). Loading never panics: no driver, or a driver too old for
/// `cuGetProcAddress_v2`, is an error; a missing entry point is an error only when that entry
/// is used.
pub fn driver() -> Result<&'static Driver, LoadError> {
    static DRIVER: OnceLock<Result<Driver, LoadError>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            let name = std::env::var(LIBCUDA_ENV).unwrap_or_else(|_| LIBCUDA.to_owned());
            Driver::load(&name)
        })
        .as_ref()
        .map_err(Clone::clone)
}

impl Driver {
    /// Opens the driver library `name` (a soname or a path) and resolves the table. Most
    /// code wants the process-wide [`driver()`] instead.
    pub fn load(name: &str) -> Result<Driver, LoadError> {
        let lib_name = CString::new(name).map_err(|_| LoadError::NoDriver {
            reason: format!("library name {name:?} contains a NUL byte"),
        })?;
        // SAFETY: plain dlopen of a NUL-terminated name; the handle is deliberately leaked so
        // the resolved pointers stay valid for the life of the process.
        let lib = unsafe { libc::dlopen(lib_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            return Err(LoadError::NoDriver {
                reason: last_dl_error(),
            });
        }
        // SAFETY: lib is a valid handle; the name is NUL-terminated.
        let sym = unsafe { libc::dlsym(lib, c"cuGetProcAddress_v2".as_ptr()) };
        // SAFETY: a non-null cuGetProcAddress_v2 has exactly the signature of the 12000
        // typedef; a null pointer becomes None.
        let get_proc =
            unsafe { std::mem::transmute::<*mut c_void, PFN_cuGetProcAddress_v12000>(sym) }
                .ok_or(LoadError::DriverTooOld)?;
        let mut driver = Driver {
            get_proc,
            ptrs: [std::ptr::null_mut(); ENTRY_COUNT],
            resolved: [0; ENTRY_COUNT],
            results: [(0, CUresult::CUDA_SUCCESS, CUdriverProcAddressQueryResult(0)); ENTRY_COUNT],
        };
        for (i, spec) in ENTRIES.iter().enumerate() {
            // The entry's own ABI first, then its same-signature fallbacks, newest first.
            for version in spec.versions() {
                // SAFETY: the name is NUL-terminated; the version is the entry's or one of its
                // fallbacks, whose typedef is the entry's (proved in the table), so the
                // accessor calls the pointer with the right signature.
                let (ptr, result, status) = unsafe { driver.resolve(SYMBOLS[i], version as c_int) };
                driver.results[i] = (version, result, status);
                if !ptr.is_null() {
                    driver.ptrs[i] = ptr;
                    driver.resolved[i] = version;
                    break;
                }
            }
        }
        Ok(driver)
    }

    /// Resolves one entry point; a null pointer unless the driver reports full success.
    ///
    /// # Safety
    /// `version` must be an ABI version of `name` that the caller will call it with.
    unsafe fn resolve(
        &self,
        name: &CStr,
        version: c_int,
    ) -> (*mut c_void, CUresult, CUdriverProcAddressQueryResult) {
        let mut ptr = std::ptr::null_mut();
        let mut status = CUdriverProcAddressQueryResult(u32::MAX);
        let flags = CUdriverProcAddress_flags::CU_GET_PROC_ADDRESS_LEGACY_STREAM.0 as u64;
        // SAFETY: all pointers are valid for writes; name is NUL-terminated.
        let result =
            unsafe { (self.get_proc)(name.as_ptr(), &mut ptr, version, flags, &mut status) };
        let ok = result == CUresult::CUDA_SUCCESS
            && status == CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS
            && !ptr.is_null();
        (if ok { ptr } else { std::ptr::null_mut() }, result, status)
    }

    /// Resolves an entry point that is not in the table, for extensions.
    ///
    /// # Safety
    /// The returned pointer has the signature of `name`'s `PFN_<name>_v<version>` typedef;
    /// the caller must transmute it to exactly that type.
    pub unsafe fn proc_address(&self, name: &CStr, version: u32) -> Option<*mut c_void> {
        // SAFETY: forwarded to the caller's contract.
        let (ptr, _, _) = unsafe { self.resolve(name, version as c_int) };
        (!ptr.is_null()).then_some(ptr)
    }

    /// The table entries this driver did not resolve, one error per accessor that returns
    /// one (empty on a current driver). On a driver older than an entry's newest ABI this
    /// lists that entry even when an older-ABI accessor covers it; [`fallbacks`] says which.
    ///
    /// [`fallbacks`]: Driver::fallbacks
    pub fn missing_entries(&self) -> Vec<LoadError> {
        (0..ENTRY_COUNT)
            .filter(|&i| self.ptrs[i].is_null())
            .map(|i| self.missing(i))
            .collect()
    }

    /// The entries this driver lacks at their newest ABI but has at an older one: entries that
    /// resolved through one of their same-signature fallbacks, and entries whose newest
    /// accessor is an error while an older-ABI accessor for the same symbol resolved (the
    /// caller must use that one). Empty on a driver as new as the headers' table.
    pub fn fallbacks(&self) -> Vec<Fallback> {
        let mut out = Vec::new();
        for (i, spec) in ENTRIES.iter().enumerate() {
            let resolved = self.resolved[i];
            if resolved == 0 {
                continue;
            }
            if spec.accessor == spec.name {
                if resolved != spec.version {
                    out.push(Fallback {
                        name: spec.name,
                        wanted: spec.version,
                        resolved,
                        accessor: spec.accessor,
                    });
                }
                continue;
            }
            // An older-ABI accessor: a fallback when the newest accessor did not resolve.
            let newest = ENTRIES
                .iter()
                .position(|e| e.accessor == spec.name)
                .filter(|&j| self.ptrs[j].is_null());
            if let Some(j) = newest {
                out.push(Fallback {
                    name: spec.name,
                    wanted: ENTRIES[j].version,
                    resolved,
                    accessor: spec.accessor,
                });
            }
        }
        out
    }

    /// The ABI version the entry with this accessor name resolved at (its own or a
    /// fallback's), or `None` when it did not resolve or there is no such accessor.
    pub fn resolved_version(&self, accessor: &str) -> Option<u32> {
        let i = ENTRIES.iter().position(|e| e.accessor == accessor)?;
        (self.resolved[i] != 0).then_some(self.resolved[i])
    }

    #[inline]
    pub(crate) fn entry_ptr(&self, slot: usize) -> *mut c_void {
        self.ptrs[slot]
    }

    #[cold]
    pub(crate) fn missing(&self, slot: usize) -> LoadError {
        let (version, result, status) = self.results[slot];
        LoadError::Missing {
            name: ENTRIES[slot].name,
            version,
            result,
            status,
        }
    }
}

fn last_dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated thread-local string.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        "unknown dlopen error".to_owned()
    } else {
        // SAFETY: non-null, NUL-terminated, valid until the next dl call on this thread.
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_no_driver() {
        let err = Driver::load("/nonexistent/libcuda.so.1").unwrap_err();
        assert!(matches!(err, LoadError::NoDriver { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.starts_with("no CUDA driver:"), "{msg}");
        assert!(msg.contains("/nonexistent/libcuda.so.1"), "{msg}");
    }

    #[test]
    fn a_library_without_get_proc_address_is_too_old() {
        // libc is loaded in every process and has no cuGetProcAddress_v2.
        let err = Driver::load("libc.so.6").unwrap_err();
        assert_eq!(err, LoadError::DriverTooOld);
    }

    #[test]
    fn missing_entry_names_itself() {
        let err = LoadError::Missing {
            name: "cuGraphConditionalHandleCreate",
            version: 12030,
            result: CUresult::CUDA_SUCCESS,
            status: CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT,
        };
        let msg = err.to_string();
        assert!(
            msg.contains("cuGraphConditionalHandleCreate (ABI 12030)"),
            "{msg}"
        );
        assert!(msg.contains("older than this ABI version"), "{msg}");
    }
}
