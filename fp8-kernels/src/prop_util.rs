//! Shared pieces of the crate's property tests (validation of shapes, lengths and
//! addresses): the configuration, exact products, and generated lengths and addresses.

use proptest::prelude::*;
use proptest::test_runner::RngAlgorithm;

/// `cases` cases; XorShift, as ChaCha dominates these cheap cases in a debug build.
pub fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        rng_algorithm: RngAlgorithm::XorShift,
        ..ProptestConfig::default()
    }
}

/// The product of `dims` where it fits usize, computed exactly (0 when any is 0).
pub fn fits(dims: &[usize]) -> Option<usize> {
    if dims.contains(&0) {
        return Some(0);
    }
    dims.iter()
        .try_fold(1u128, |p, &x| p.checked_mul(x as u128))
        .and_then(|p| usize::try_from(p).ok())
}

/// How a length is made from the one the shape needs (where that fits usize).
#[derive(Debug, Clone, Copy)]
pub enum Len {
    /// The length the shape needs.
    Exact,
    /// Off by a few.
    Off(i8),
    /// Any value.
    Any(usize),
}

/// Exact lengths mostly, some off by a few, some anything.
pub fn len() -> impl Strategy<Value = Len> {
    prop_oneof![
        24 => Just(Len::Exact),
        1 => any::<i8>().prop_map(Len::Off),
        1 => any::<usize>().prop_map(Len::Any),
    ]
}

/// The length `how` makes from `want` (the needed length, `None` when it overflows).
pub fn make_len(how: Len, want: Option<usize>) -> usize {
    match (how, want) {
        (Len::Exact, Some(want)) => want,
        (Len::Off(o), Some(want)) => want.wrapping_add_signed(isize::from(o)),
        (Len::Any(x), _) => x,
        // No length matches a size that overflows; any will do.
        (_, None) => usize::MAX,
    }
}

/// Aligned (16-byte) addresses mostly; others by a few bytes; any.
pub fn addr() -> impl Strategy<Value = u64> {
    prop_oneof![
        24 => (0u64..1 << 44).prop_map(|x| x * 16),
        2 => ((0u64..1 << 44), 1u64..16).prop_map(|(x, o)| x * 16 + o),
        1 => any::<u64>(),
    ]
}

/// A size: small mostly, zero, powers of two, huge, any.
pub fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        8 => 0usize..=300,
        2 => (0u32..64).prop_map(|s| 1usize << s),
        1 => proptest::sample::select(vec![usize::MAX, usize::MAX / 2, usize::MAX - 1, (1 << 32) - 1]),
        1 => any::<usize>(),
    ]
}

/// Any input dtype.
pub fn dtype() -> impl Strategy<Value = crate::DType> {
    use crate::DType;
    proptest::sample::select(vec![DType::F32, DType::F16, DType::Bf16])
}
