//! Compile-fail tests for the lifetime and thread-safety rules the safe API relies on.
//! Needs cargo and the toolchain at test time, so the GPU bundle does not carry it.

#[test]
fn lifetime_rules() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/compile_fail/*.rs");
}
