//! Compiles `src/kernels/*.cu` (the benchmark's kernels) into fatbins in OUT_DIR.
fn main() {
    cuda_build::compile_dirs(&["src/kernels"]);
}
