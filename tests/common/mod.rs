//! Helpers shared by the root package's GPU tests: fresh random data and conversions.

#![allow(dead_code)] // each test binary uses a subset

use std::time::{SystemTime, UNIX_EPOCH};

use std::sync::Arc;

use cuda_graph::Stream;
use cuda_graph::half::bf16;
use fp8_kernels::{AmaxAlgo, DelayedScaling, Fp8Format};
use fp8_moe::moe::layer::{MoeLayerConfig, MoeParams, formats};
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

/// A scaling state for `cfg` with fixed scales (64 for E4M3 tensors, 4096 for E5M2) that
/// suit the tests' data, history 1.
pub fn fixed_scaling(stream: &Stream, cfg: &MoeLayerConfig) -> Arc<DelayedScaling> {
    let fmts = formats(cfg.recipe, cfg.experts);
    let scaling = Arc::new(DelayedScaling::new(stream, &fmts, 1, 0, AmaxAlgo::MostRecent).unwrap());
    for (t, fmt) in fmts.iter().enumerate() {
        let v = if *fmt == Fp8Format::E4M3 {
            64.0
        } else {
            4096.0
        };
        scaling.scale(t).unwrap().write(stream, v).unwrap();
    }
    scaling
}

/// A MoE layer's parameters for `cfg`: router `N(0, 0.3^2)`, expert weights `N(0, 0.2^2)`
/// rounded to bf16.
pub fn random_params(rng: &mut Rng, cfg: &MoeLayerConfig) -> MoeParams {
    let (h, f, e) = (cfg.hidden, cfg.ffn, cfg.experts);
    MoeParams {
        wr: rng.vec(e * h, 0.3),
        w1: bf16_round(&rng.vec(e * 2 * f * h, 0.2)),
        w2: bf16_round(&rng.vec(e * h * f, 0.2)),
    }
}

/// Saved buffers of `bytes` bytes each for a layer's slot, zeroed as the runtime zeroes its
/// own (and as compute-sanitizer's initcheck needs: it does not see the TMA stores of the
/// sm_90a GEMMs' epilogue, so memory they wrote first would read as uninitialized).
pub fn zeroed_saved(stream: &Stream, bytes: &[usize]) -> Vec<cuda_graph::DeviceBuffer<u8>> {
    bytes
        .iter()
        .map(|&n| {
            let b = cuda_graph::DeviceBuffer::<u8>::alloc(stream.context(), n).unwrap();
            b.memset_bytes(stream, 0).unwrap();
            b
        })
        .collect()
}
