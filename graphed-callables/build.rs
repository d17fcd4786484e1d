//! Compiles `tests/kernels/*.cu` (kernels of the GPU tests) into fatbins in OUT_DIR.
fn main() {
    cuda_build::compile_dirs(&["tests/kernels"]);
}
