//! Compiles `kernels/*.cu` (helper kernels the library embeds, e.g. conditional-node
//! setters), `tests/kernels/*.cu` (kernels of the GPU tests) and `examples/kernels/*.cu`
//! (kernels of the examples) into fatbins in OUT_DIR.
fn main() {
    cuda_build::compile_dirs(&["kernels", "tests/kernels", "examples/kernels"]);
}
