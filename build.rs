//! Compiles `src/kernels/*.cu` (the layer's and the benchmarks' kernels) into fatbins in
//! OUT_DIR, with fp8-kernels' headers on the include path (the fused routing kernel uses its
//! gather cast: `DEP_FP8KERNELS_INCLUDE`, from its `links` key).
use std::path::PathBuf;

fn main() {
    let fp8 = std::env::var("DEP_FP8KERNELS_INCLUDE").unwrap_or_else(|_| {
        eprintln!(
            "error: fp8-moe: DEP_FP8KERNELS_INCLUDE is unset (fp8-kernels' build script sets it)"
        );
        std::process::exit(1)
    });
    cuda_build::compile_dirs_with(&["src/kernels"], &[PathBuf::from(fp8)]);
}
