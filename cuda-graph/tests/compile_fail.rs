//! Compile-fail tests for the lifetime and thread-safety rules the safe API relies on.
//! Needs cargo and the toolchain at test time, so the GPU bundle does not carry it.
//!
//! Not with the `cudarc` feature: cudarc brings its own `CUgraph_st` and friends, so rustc
//! then names this crate's types by their full paths and the expected messages differ. The
//! rules themselves do not depend on features; CI checks them in the default build.
#![cfg(not(feature = "cudarc"))]

#[test]
fn lifetime_rules() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/compile_fail/*.rs");
}
