//! Finds the CUDA toolkit, generates the driver API types with bindgen, and tells dependent
//! crates where the toolkit is (`DEP_CUDAGRAPH_*`), so the whole workspace builds against
//! one `cuda.h`.
//!
//! Search order for the toolkit: `CUDA_HOME`, `CUDA_PATH`, the project-local pip wheels
//! (`<workspace>/.toolchain/cuda/nvidia/cu13`, installed by `scripts/setup.sh`), then
//! `/usr/local/cuda`. A variable that is set but points at no `include/cuda.h` is an error:
//! silently building against another toolkit than the one the user named is worse.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const SETUP_HINT: &str = "run `scripts/setup.sh` in the workspace (it installs the CUDA 13.0 \
compiler and headers from pip wheels into .toolchain/), or point CUDA_HOME at a CUDA toolkit \
(>= 12.4) that has include/cuda.h";

fn main() {
    for var in ["CUDA_HOME", "CUDA_PATH", "LIBCLANG_PATH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=compat.h");
    println!("cargo:rerun-if-changed=tests/kernels/add.cu");

    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets this"));
    let workspace = manifest.parent().map(Path::to_path_buf).unwrap_or_default();
    let root = match find_cuda_root(&workspace) {
        Ok(root) => root,
        Err(msg) => fail(&msg),
    };
    let include = root.join("include");
    let cuda_h = include.join("cuda.h");
    let typedefs_h = include.join("cudaTypedefs.h");
    println!("cargo:rerun-if-changed={}", cuda_h.display());
    println!("cargo:rerun-if-changed={}", typedefs_h.display());
    if !typedefs_h.is_file() {
        fail(&format!(
            "{} has cuda.h but no cudaTypedefs.h; {SETUP_HINT}",
            include.display()
        ));
    }

    let version = match cuda_version(&cuda_h) {
        Some(v) => v,
        None => fail(&format!(
            "no `#define CUDA_VERSION` in {}",
            cuda_h.display()
        )),
    };
    if version < 12040 {
        fail(&format!(
            "{} is CUDA {}.{}; this workspace needs CUDA >= 12.4 headers. {SETUP_HINT}",
            cuda_h.display(),
            version / 1000,
            version % 1000 / 10
        ));
    }

    // A header older than 12.8 lacks enum values the safe crate names; lib.rs declares them.
    println!("cargo::rustc-check-cfg=cfg(cuda_header_before_12080)");
    if version < 12080 {
        println!("cargo:rustc-cfg=cuda_header_before_12080");
    }

    // Dependent crates read these as DEP_CUDAGRAPH_ROOT, _INCLUDE, _CUDA_VERSION.
    println!("cargo:root={}", root.display());
    println!("cargo:include={}", include.display());
    println!("cargo:cuda_version={version}");
    println!(
        "cargo:rustc-env=CUDA_GRAPH_SYS_TYPEDEFS_H={}",
        typedefs_h.display()
    );

    let builtin_include = use_local_libclang(&workspace);
    // Other bindgen users of the workspace (cuda-graph-nccl) read these as
    // DEP_CUDAGRAPH_LIBCLANG_PATH and DEP_CUDAGRAPH_CLANG_BUILTIN_INCLUDE.
    if let Some(dir) = env::var_os("LIBCLANG_PATH") {
        println!("cargo:libclang_path={}", PathBuf::from(dir).display());
    }
    if let Some(dir) = &builtin_include {
        println!("cargo:clang_builtin_include={}", dir.display());
    }
    generate_bindings(&manifest, &include, builtin_include.as_deref());
    compile_test_kernel(&root, &manifest);
}

fn fail(msg: &str) -> ! {
    eprintln!("error: cuda-graph-sys: {msg}");
    println!("cargo:warning=cuda-graph-sys: {msg}");
    std::process::exit(1);
}

fn find_cuda_root(workspace: &Path) -> Result<PathBuf, String> {
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(dir) = env::var_os(var).filter(|v| !v.is_empty()) {
            let dir = PathBuf::from(dir);
            return if dir.join("include/cuda.h").is_file() {
                Ok(dir)
            } else {
                Err(format!(
                    "{var}={} has no include/cuda.h; {SETUP_HINT}",
                    dir.display()
                ))
            };
        }
    }
    let candidates = [
        workspace.join(".toolchain/cuda/nvidia/cu13"),
        PathBuf::from("/usr/local/cuda"),
    ];
    candidates
        .iter()
        .find(|dir| dir.join("include/cuda.h").is_file())
        .cloned()
        .ok_or_else(|| {
            format!(
                "no CUDA headers found (looked in CUDA_HOME, CUDA_PATH, {}, /usr/local/cuda); \
                 {SETUP_HINT}",
                candidates[0].display()
            )
        })
}

fn cuda_version(cuda_h: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(cuda_h).ok()?;
    text.lines().find_map(|line| {
        let rest = line.trim().strip_prefix("#define CUDA_VERSION")?;
        rest.trim().parse().ok()
    })
}

/// bindgen loads libclang at run time; prefer the wheel `scripts/setup.sh` installs when the
/// user has not named one, so no system package is needed.
///
/// The wheel ships libclang without clang's resource headers (`stddef.h`, `stdarg.h`); the C
/// compiler's own copies stand in for them. Returns the extra include directory, if any.
fn use_local_libclang(workspace: &Path) -> Option<PathBuf> {
    if env::var_os("LIBCLANG_PATH").is_some() {
        return None;
    }
    let local = workspace.join(".toolchain/libclang/clang/native");
    if !local.join("libclang.so").is_file() {
        return None;
    }
    // SAFETY: build scripts are single-threaded here; nothing else reads the environment
    // concurrently.
    unsafe { env::set_var("LIBCLANG_PATH", &local) };
    let out = Command::new("cc")
        .arg("-print-file-name=include")
        .output()
        .ok()?;
    let dir = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    dir.join("stddef.h").is_file().then_some(dir)
}

fn generate_bindings(manifest: &Path, include: &Path, builtin_include: Option<&Path>) {
    let mut builder = bindgen::Builder::default();
    if let Some(dir) = builtin_include {
        builder = builder.clang_arg(format!("-isystem{}", dir.display()));
    }
    let bindings = builder
        .header(manifest.join("wrapper.h").to_string_lossy())
        .clang_arg(format!("-I{}", include.display()))
        // Types and constants only: every function is reached through the run-time table
        // (`PFN_*` typedefs), never through a link-time symbol.
        .allowlist_type("PFN_cu.*")
        .blocklist_type(".*_pt(sz|ds)")
        .allowlist_type("CU.*")
        .allowlist_type("cu.*")
        .allowlist_var("CU_.*")
        .allowlist_var("CUDA_.*")
        // A value from a newer driver must never be undefined behaviour: every C enum is a
        // transparent newtype with associated constants, not a Rust enum.
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
            "bindgen could not parse cuda.h ({e}); is libclang installed? {SETUP_HINT}"
        )),
    };
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets this")).join("bindings.rs");
    if let Err(e) = bindings.write_to_file(&out) {
        fail(&format!("cannot write {}: {e}", out.display()));
    }
}

/// The GPU tests of this crate load a real nvcc-compiled kernel through the raw table. The
/// fatbin is built here so the test binary embeds it and runs on a machine with no toolkit.
/// Without nvcc the library still builds; the test then fails and says why.
fn compile_test_kernel(root: &Path, manifest: &Path) {
    let nvcc = root.join("bin/nvcc");
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets this")).join("add.fatbin");
    if !nvcc.is_file() {
        println!(
            "cargo:warning=cuda-graph-sys: no nvcc at {}; the GPU kernel test will fail",
            nvcc.display()
        );
        // An empty file keeps the test compiling; the test reports the missing kernel.
        if let Err(e) = std::fs::write(&out, b"") {
            fail(&format!("cannot write {}: {e}", out.display()));
        }
        return;
    }
    println!("cargo:nvcc={}", nvcc.display());
    let status = Command::new(&nvcc)
        .args([
            "-fatbin",
            "-gencode=arch=compute_90a,code=sm_90a",
            "-gencode=arch=compute_80,code=compute_80",
            "-o",
        ])
        .arg(&out)
        .arg(manifest.join("tests/kernels/add.cu"))
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => fail(&format!("nvcc failed ({s}) on tests/kernels/add.cu")),
        Err(e) => fail(&format!("cannot run {}: {e}", nvcc.display())),
    }
}
