//! `bench train`: tokens/s of the train job's default model (issue 14's configuration) in
//! every graph mode, each from the same start on the same batches, beside PyTorch's figures
//! for the same model on this H200.

use cuda_graph::{Context, Stream};
use fp8_moe::model::{GraphMode, ModelConfig, TrainConfig};
use fp8_moe::train::data::Corpus;
use fp8_moe::train::job::compare_modes;

use super::{BenchResult, Row};

/// PyTorch 2.11 on this H200, the same model and sizes (bf16 autocast, fp32 master weights,
/// flash attention, `torch._grouped_mm` experts, fused AdamW), tokens/s: eager,
/// `torch.compile`, the whole step as one CUDA graph (issue 14).
const TORCH_EAGER: f64 = 206e3;
const TORCH_COMPILE: f64 = 354e3;
const TORCH_GRAPH: f64 = 791e3;

/// Steps each mode runs (the first two untimed).
const STEPS: usize = 22;

/// Runs the benchmark.
pub fn run() -> BenchResult<Vec<Row>> {
    let ctx = Context::default_device()?;
    let stream = Stream::new(&ctx)?;
    let model = ModelConfig::default();
    let train = TrainConfig {
        steps: STEPS,
        ..TrainConfig::default()
    };
    // The repository's text (or, run away from a checkout, bytes of a fixed generator).
    let corpus = Corpus::default_for_repo().unwrap_or_else(|_| {
        let mut rng = super::Rng::new(1, 0);
        Corpus::from_bytes((0..1 << 22).map(|_| b'a' + rng.below(26) as u8).collect())
    });
    let split = corpus.split(model.context)?;
    let modes = compare_modes(&stream, model, train, &split, STEPS)?;
    let torch = format!(
        "PyTorch on this H200: eager {:.0}k, torch.compile {:.0}k, one CUDA graph {:.0}k tokens/s",
        TORCH_EAGER / 1e3,
        TORCH_COMPILE / 1e3,
        TORCH_GRAPH / 1e3
    );
    Ok(modes
        .iter()
        .map(|r| {
            let (target, pass) = match r.mode {
                GraphMode::Step => (
                    format!(
                        "; {:.2}x PyTorch's graph (target >= 1.6M tokens/s, 2x)",
                        r.tokens_per_s / TORCH_GRAPH
                    ),
                    Some(r.tokens_per_s >= 2.0 * TORCH_GRAPH),
                ),
                GraphMode::None => (
                    format!(
                        "; {:.2}x torch.compile (target: ahead of it)",
                        r.tokens_per_s / TORCH_COMPILE
                    ),
                    Some(r.tokens_per_s > TORCH_COMPILE),
                ),
                _ => (String::new(), None),
            };
            let pass = pass.map(|p| p && r.matches_eager);
            Row {
                name: format!("train step, graphs {}", r.mode.name()),
                value: r.tokens_per_s,
                unit: "tok/s",
                yardstick: format!(
                    "{:.2} ms/step, {:.2}x eager, losses {} eager's bits; {torch}{target}",
                    r.step_ms,
                    r.speedup,
                    if r.matches_eager { "=" } else { "!=" },
                ),
                pass,
            }
        })
        .collect())
}
