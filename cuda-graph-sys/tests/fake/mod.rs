//! The fake driver of the CPU tests: `fake_cuda.c`, compiled with the system C compiler (`cc`,
//! or `$CC`) into a shared library per configuration, under the target's temporary folder
//! (or the system's).
//!
//! Shared by this crate's `tests/fake_driver.rs` and by `cuda-graph/tests/fake_driver.rs`
//! (through `#[path]`), so it names the sys crate as `cuda_graph_sys`, a dependency of both.
#![allow(dead_code)]

use std::collections::hash_map::DefaultHasher;
use std::ffi::{CString, c_char, c_int};
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use cuda_graph_sys::Driver;

const SOURCE: &str = include_str!("fake_cuda.c");

/// One configuration of the fake driver; each method sets one of the macros that
/// `fake_cuda.c` documents. Lists are comma-separated `name`, `name@ABI`, `*` or `*@ABI`.
#[derive(Debug, Clone, Default)]
pub struct Fake {
    defines: Vec<String>,
}

impl Fake {
    /// A CUDA 13.0 driver that has every entry.
    pub fn new() -> Fake {
        Fake::default()
    }

    /// A driver of this version (`1000 * major + 10 * minor`): it rejects newer ABIs with
    /// CUDA_ERROR_INVALID_VALUE, as driver 580 does.
    pub fn version(self, version: u32) -> Fake {
        self.define("FAKE_DRIVER_VERSION", &version.to_string())
    }

    /// No `cuGetProcAddress_v2` (a driver before 12.0).
    pub fn without_get_proc_address(self) -> Fake {
        self.define("FAKE_NO_GET_PROC_ADDRESS", "1")
    }

    /// Entries the driver does not have (status SYMBOL_NOT_FOUND).
    pub fn missing(self, list: &str) -> Fake {
        self.list("FAKE_MISSING", list)
    }

    /// Entries whose ABI the driver reports as not there (status VERSION_NOT_SUFFICIENT).
    pub fn too_new(self, list: &str) -> Fake {
        self.list("FAKE_TOO_NEW", list)
    }

    /// Entries that resolve to a pointer with status SUCCESS but CUDA_ERROR_UNKNOWN.
    pub fn resolve_error(self, list: &str) -> Fake {
        self.list("FAKE_RESOLVE_ERROR", list)
    }

    /// Entries that resolve to NULL with CUDA_SUCCESS and status SUCCESS.
    pub fn null(self, list: &str) -> Fake {
        self.list("FAKE_NULL", list)
    }

    /// Entries that resolve but return CUDA_ERROR_LAUNCH_FAILED (719) when called.
    pub fn failing(self, list: &str) -> Fake {
        self.list("FAKE_FAIL_CALLS", list)
    }

    fn list(self, name: &str, list: &str) -> Fake {
        assert!(
            list.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_,@*".contains(&b)),
            "{list:?}: names, `@`, `*` and commas only"
        );
        self.define(name, &format!("\"{list}\""))
    }

    fn define(mut self, name: &str, value: &str) -> Fake {
        self.defines.push(format!("-D{name}={value}"));
        self
    }

    /// Compiles this configuration (once: the file name is a hash of the source and the
    /// defines) and returns the library's path, for `Driver::load` or `CUDA_GRAPH_LIBCUDA`.
    pub fn build(&self) -> PathBuf {
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
        let mut h = DefaultHasher::new();
        (SOURCE, &self.defines, &cc).hash(&mut h);
        // The target's temporary folder; the system's where that is gone (a test binary
        // copied to another machine, as scripts/gpu-bundle.sh does).
        let dir = [
            PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fake-cuda"),
            std::env::temp_dir().join("cuda-graph-fake-cuda"),
        ]
        .into_iter()
        .find(|d| std::fs::create_dir_all(d).is_ok())
        .expect("no writable folder for the fake driver");
        let lib = dir.join(format!("libcuda-fake-{:016x}.so", h.finish()));
        if lib.is_file() {
            return lib;
        }
        // Built under a name of its own, then renamed: tests that build the same
        // configuration at once never load a half-written file.
        static BUILDS: AtomicU32 = AtomicU32::new(0);
        let tmp = lib.with_extension(format!(
            "{}.{}.tmp",
            std::process::id(),
            BUILDS.fetch_add(1, Ordering::Relaxed)
        ));
        let mut child = Command::new(&cc)
            .args([
                "-shared",
                "-fPIC",
                "-std=c11",
                "-O1",
                "-Wall",
                "-Wextra",
                "-fvisibility=hidden",
            ])
            .args(&self.defines)
            .arg("-o")
            .arg(&tmp)
            .args(["-x", "c", "-"])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {cc} (a C compiler is needed): {e}"));
        child
            .stdin
            .take()
            .unwrap()
            .write_all(SOURCE.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{cc} failed on fake_cuda.c with {:?}:\n{}",
            self.defines,
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::rename(&tmp, &lib).unwrap();
        lib
    }

    /// [`build`](Self::build), as the string `Driver::load` takes.
    pub fn path(&self) -> String {
        self.build().to_str().unwrap().to_owned()
    }
}

/// How often the fake loaded as `driver` ran `counter`: an entry name, `name@ABI` for the
/// entries implemented at two ABIs (`cuCtxSynchronize@2000`), `stub` or `plain`.
pub fn calls(driver: &Driver, counter: &str) -> i32 {
    // SAFETY: the fake resolves `fakeCallCount` to `int fakeCallCount(const char *)` at
    // every ABI; the pointer is transmuted to exactly that.
    let f = unsafe { driver.proc_address(c"fakeCallCount", 2000) }
        .expect("not the fake driver: no fakeCallCount");
    // SAFETY: see above.
    let f = unsafe {
        std::mem::transmute::<*mut std::ffi::c_void, unsafe extern "C" fn(*const c_char) -> c_int>(
            f,
        )
    };
    let name = CString::new(counter).unwrap();
    // SAFETY: a NUL-terminated string, read during the call only.
    let n = unsafe { f(name.as_ptr()) };
    assert!(n >= 0, "the fake has no counter {counter:?}");
    n
}
