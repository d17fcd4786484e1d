//! Compiles the FP8 kernels into ONE fatbin, `$OUT_DIR/fp8_kernels.fatbin`, embedded by
//! `src/module.rs` and loaded once per context.
//!
//! One translation unit (`kernels/all.cu`) includes every family's `.cuh`, so a single
//! module holds them all without relocatable device code (`-rdc`), which `-fatbin` with
//! several sources would need.

use std::path::{Path, PathBuf};

fn main() {
    let nvcc = cuda_build::nvcc();
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-changed=kernels");
    for entry in std::fs::read_dir("kernels").expect("fp8-kernels/kernels exists") {
        let path = entry.expect("readable kernels directory").path();
        println!("cargo:rerun-if-changed={}", path.display());
    }
    cuda_build::compile(
        &nvcc,
        Path::new("kernels/all.cu"),
        &out.join("fp8_kernels.fatbin"),
        &["-Ikernels"],
    );
}
