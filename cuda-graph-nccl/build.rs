//! Finds `nccl.h` and generates NCCL's types and a run-time loaded function table with bindgen.
//!
//! Search order for the header: `NCCL_HOME` (its `include/nccl.h`), the project-local wheel
//! (`<workspace>/.toolchain/nccl/nvidia/nccl`, installed by `scripts/setup.sh`), then
//! `/usr/include` and `/usr/local/cuda/include`. A `NCCL_HOME` that is set but has no header is
//! an error. Nothing is linked: the library is opened at run time (`src/library.rs`).
//!
//! `nccl.h` includes `cuda_runtime.h`; the CUDA headers and the libclang come from
//! cuda-graph-sys (`DEP_CUDAGRAPH_*`), so the workspace parses one toolkit's headers.

use std::env;
use std::path::{Path, PathBuf};

const SETUP_HINT: &str = "run `scripts/setup.sh` in the workspace (it installs NCCL 2.28 from \
the nvidia-nccl-cu13 wheel into .toolchain/nccl), or point NCCL_HOME at an NCCL with \
include/nccl.h";

fn main() {
    for var in [
        "NCCL_HOME",
        "LIBCLANG_PATH",
        "DEP_CUDAGRAPH_INCLUDE",
        "DEP_CUDAGRAPH_LIBCLANG_PATH",
        "DEP_CUDAGRAPH_CLANG_BUILTIN_INCLUDE",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");

    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets this"));
    let workspace = manifest.parent().map(Path::to_path_buf).unwrap_or_default();
    let include = match find_nccl_include(&workspace) {
        Ok(dir) => dir,
        Err(msg) => fail(&msg),
    };
    let nccl_h = include.join("nccl.h");
    println!("cargo:rerun-if-changed={}", nccl_h.display());
    let Some(cuda_include) = env::var_os("DEP_CUDAGRAPH_INCLUDE").map(PathBuf::from) else {
        fail("cuda-graph-sys did not export its CUDA include directory (DEP_CUDAGRAPH_INCLUDE)")
    };

    let inherited = env::var_os("DEP_CUDAGRAPH_LIBCLANG_PATH");
    if let (None, Some(dir)) = (env::var_os("LIBCLANG_PATH"), inherited) {
        // SAFETY: build scripts are single-threaded here; nothing else reads the environment
        // concurrently.
        unsafe { env::set_var("LIBCLANG_PATH", dir) };
    }
    let mut builder = bindgen::Builder::default();
    if let Some(dir) = env::var_os("DEP_CUDAGRAPH_CLANG_BUILTIN_INCLUDE") {
        builder = builder.clang_arg(format!("-isystem{}", PathBuf::from(dir).display()));
    }
    let bindings = builder
        .header(nccl_h.to_string_lossy())
        .clang_arg(format!("-I{}", include.display()))
        .clang_arg(format!("-I{}", cuda_include.display()))
        .allowlist_type("nccl.*")
        .allowlist_var("NCCL_.*")
        // The public entry points only: `pnccl*` are the profiling aliases of the same code.
        .allowlist_function("nccl.*")
        // One struct of function pointers filled by `dlsym` at run time, each an `Err` when the
        // library lacks it: nothing is resolved at link time.
        .dynamic_library_name("NcclLibrary")
        .dynamic_link_require_all(false)
        .default_enum_style(bindgen::EnumVariation::NewType {
            is_bitfield: false,
            is_global: false,
        })
        .derive_default(true)
        .prepend_enum_name(false)
        .layout_tests(true)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .generate();
    let bindings = match bindings {
        Ok(b) => b,
        Err(e) => fail(&format!(
            "bindgen could not parse {} ({e}); {SETUP_HINT}",
            nccl_h.display()
        )),
    };
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets this")).join("nccl.rs");
    if let Err(e) = bindings.write_to_file(&out) {
        fail(&format!("cannot write {}: {e}", out.display()));
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("error: cuda-graph-nccl: {msg}");
    println!("cargo:warning=cuda-graph-nccl: {msg}");
    std::process::exit(1);
}

fn find_nccl_include(workspace: &Path) -> Result<PathBuf, String> {
    if let Some(home) = env::var_os("NCCL_HOME").filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(home).join("include");
        return if dir.join("nccl.h").is_file() {
            Ok(dir)
        } else {
            Err(format!(
                "NCCL_HOME={} has no include/nccl.h; {SETUP_HINT}",
                dir.parent().unwrap_or(&dir).display()
            ))
        };
    }
    let candidates = [
        workspace.join(".toolchain/nccl/nvidia/nccl/include"),
        PathBuf::from("/usr/include"),
        PathBuf::from("/usr/local/cuda/include"),
    ];
    candidates
        .iter()
        .find(|dir| dir.join("nccl.h").is_file())
        .cloned()
        .ok_or_else(|| {
            format!(
                "no nccl.h found (looked in NCCL_HOME, {}, /usr/include, /usr/local/cuda/include); \
                 {SETUP_HINT}",
                candidates[0].display()
            )
        })
}
