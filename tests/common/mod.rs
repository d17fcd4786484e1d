//! Helpers shared by the root package's GPU tests: fresh random data and conversions.

#![allow(dead_code)] // each test binary uses a subset

use std::time::{SystemTime, UNIX_EPOCH};

use cuda_graph::half::bf16;
use fp8_moe::rng::Rng;

/// A generator seeded from the clock (fresh data every run), its seed printed so a failure
/// can be replayed: `FP8_MOE_TEST_SEED=<seed>` (decimal or 0x-prefixed hex) seeds every
/// test of the run with it instead.
pub fn fresh_rng(what: &str) -> Rng {
    let fixed = std::env::var("FP8_MOE_TEST_SEED").ok().map(|v| {
        let v = v.trim();
        match v.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16),
            None => v.parse(),
        }
        .unwrap_or_else(|e| panic!("FP8_MOE_TEST_SEED={v}: {e}"))
    });
    let seed = fixed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    println!("{what}: seed {seed:#x}");
    Rng::new(seed, 0)
}

/// Rounds to bf16.
pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// Rounds to bf16 and back (the values the device holds).
pub fn bf16_round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// Widens to f64.
pub fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// Widens bf16 values to f64.
pub fn f64s_bf16(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| f64::from(x.to_f32())).collect()
}
