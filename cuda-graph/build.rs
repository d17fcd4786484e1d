//! Compiles `kernels/*.cu` (helper kernels the library embeds, e.g. conditional-node
//! setters) and `tests/kernels/*.cu` (kernels of the GPU tests) into fatbins in OUT_DIR.
fn main() {
    cuda_build::compile_dirs(&["kernels", "tests/kernels"]);
}
