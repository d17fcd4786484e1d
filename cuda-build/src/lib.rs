//! Build-script helper: compiles CUDA sources to standalone fatbins in `OUT_DIR`, with the
//! nvcc of the toolkit `cuda-graph-sys` found (its `DEP_CUDAGRAPH_ROOT`; the calling crate
//! must depend on `cuda-graph-sys` directly for cargo to pass that variable).
//!
//! The `cc` crate is not used: it builds host objects linked with cudart, while this
//! workspace loads standalone fatbins through the driver (`cuModuleLoadData`) and links no
//! CUDA library.
//!
//! ```no_run
//! // build.rs
//! cuda_build::compile_dirs(&["kernels"]); // kernels/foo.cu -> $OUT_DIR/foo.fatbin
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;

/// sm_90a SASS (wgmma, setmaxnreg), sm_89 SASS, and compute_80 PTX for everything else.
pub const GENCODE: &[&str] = &[
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_89,code=sm_89",
    "-gencode=arch=compute_80,code=compute_80",
];

/// Compiles every `*.cu` directly in each directory to `$OUT_DIR/<stem>.fatbin`, and tells
/// cargo to rerun when they change. Exits the build with one clear message on failure.
pub fn compile_dirs(dirs: &[&str]) {
    let nvcc = nvcc();
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap_or_else(|_| fail("OUT_DIR unset")));
    for dir in dirs {
        println!("cargo:rerun-if-changed={dir}");
        for src in cu_files(Path::new(dir)) {
            println!("cargo:rerun-if-changed={}", src.display());
            let stem = src.file_stem().map(|s| s.to_string_lossy().into_owned());
            let stem = stem.unwrap_or_else(|| fail("a .cu file without a name"));
            compile(&nvcc, &src, &out.join(format!("{stem}.fatbin")), &[]);
        }
    }
}

/// The nvcc of the toolkit cuda-graph-sys found.
pub fn nvcc() -> PathBuf {
    let root = std::env::var("DEP_CUDAGRAPH_ROOT").unwrap_or_else(|_| {
        fail("DEP_CUDAGRAPH_ROOT is unset: the crate must depend on cuda-graph-sys directly")
    });
    let nvcc = Path::new(&root).join("bin/nvcc");
    if !nvcc.is_file() {
        fail(&format!(
            "no nvcc at {}; run scripts/setup.sh, or set CUDA_HOME to a toolkit with bin/nvcc",
            nvcc.display()
        ));
    }
    nvcc
}

/// This crate's headers for device code (`#include <cuda_graph/pdl.cuh>`: programmatic
/// dependent launch helpers), on the include path of every [`compile`].
pub fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("include")
}

/// Compiles one source to a fatbin with [`GENCODE`], `-O3 -std=c++17`, this crate's
/// [`include_dir`], and `extra` flags.
pub fn compile(nvcc: &Path, src: &Path, out: &Path, extra: &[&str]) {
    println!("cargo:rerun-if-changed={}", include_dir().display());
    let status = Command::new(nvcc)
        .arg("-fatbin")
        .args(GENCODE)
        .args(["-O3", "-std=c++17"])
        .arg("-I")
        .arg(include_dir())
        .args(extra)
        .arg("-o")
        .arg(out)
        .arg(src)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => fail(&format!("nvcc failed ({s}) on {}", src.display())),
        Err(e) => fail(&format!("cannot run {}: {e}", nvcc.display())),
    }
}

fn cu_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "cu"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

fn fail(msg: &str) -> ! {
    let pkg = std::env::var("CARGO_PKG_NAME").unwrap_or_default();
    eprintln!("error: {pkg}: {msg}");
    std::process::exit(1);
}
