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
    // Dependents' build scripts get the headers' directory as DEP_FP8KERNELS_INCLUDE (their
    // kernels include the device functions with FP8K_DEVICE_ONLY defined).
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    println!("cargo:include={}", manifest.join("kernels").display());
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
