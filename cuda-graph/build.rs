//! Compiles the crate's CUDA sources with nvcc into fatbins in OUT_DIR:
//! `kernels/*.cu` (the helper kernels the library embeds, e.g. conditional-node setters) and
//! `tests/kernels/*.cu` (kernels the GPU tests and benchmarks launch).
//!
//! nvcc comes from the toolkit cuda-graph-sys found (`DEP_CUDAGRAPH_ROOT`). The `cc` crate is
//! not used: it builds host objects linked with cudart, and we need standalone fatbins that
//! the driver loads at run time (`cuModuleLoadData`), with no cudart link.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// sm_90a SASS (wgmma, setmaxnreg), sm_89 SASS, and compute_80 PTX for everything else.
const GENCODE: &[&str] = &[
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_89,code=sm_89",
    "-gencode=arch=compute_80,code=compute_80",
];

fn main() {
    let root = PathBuf::from(env::var("DEP_CUDAGRAPH_ROOT").expect("set by cuda-graph-sys"));
    let nvcc = root.join("bin/nvcc");
    let out = PathBuf::from(env::var("OUT_DIR").expect("set by cargo"));
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-changed=tests/kernels");
    for dir in ["kernels", "tests/kernels"] {
        for src in cu_files(Path::new(dir)) {
            println!("cargo:rerun-if-changed={}", src.display());
            let stem = src
                .file_stem()
                .expect("a file name")
                .to_string_lossy()
                .into_owned();
            compile(&nvcc, &src, &out.join(format!("{stem}.fatbin")));
        }
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

fn compile(nvcc: &Path, src: &Path, out: &Path) {
    if !nvcc.is_file() {
        eprintln!(
            "error: cuda-graph: no nvcc at {}; run scripts/setup.sh or set CUDA_HOME to a \
             toolkit with bin/nvcc",
            nvcc.display()
        );
        std::process::exit(1);
    }
    let status = Command::new(nvcc)
        .arg("-fatbin")
        .args(GENCODE)
        .args(["-O3", "-std=c++17", "-o"])
        .arg(out)
        .arg(src)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => {
            eprintln!("error: cuda-graph: nvcc failed ({s}) on {}", src.display());
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("error: cuda-graph: cannot run {}: {e}", nvcc.display());
            std::process::exit(1);
        }
    }
}
