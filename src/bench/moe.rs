//! `fp8-moe bench moe`: one training step (forward + backward) of the dropless top-k SwiGLU
//! MoE layer ([`MoeLayer`]) eagerly, as breaking-layer graphs and as full-layer graphs, with
//! the inputs rotating so that the routing changes every step.
//!
//! Shapes: T = 256 and T = 4096 tokens, H = 2048, F = 2048, E = 8, top-2 softmax with the aux
//! loss; and many experts: E = 256, top-8, H = 2048, F = 256, T = 4096. Beside each mode: the
//! step's GEMM FLOP rate (`18 T k H F` FLOPs: fc1 and fc2 forward, their dgrads and wgrads, on
//! the real rows) and, measured in the same run, our dense FP8 GEMM on fc1's forward shape
//! (`T k x 2F x H`). The yardstick from the issue (PyTorch 2.11 on this H200, bf16, the same
//! layer with `torch._grouped_mm`): T = 4096 2.80 ms eager, 2.10 ms as one CUDA graph;
//! T = 256 2.51 ms eager, 0.68 ms as one graph. Targets: full-layer T = 4096 <= 0.85 ms,
//! T = 256 <= 0.20 ms; breaking-layer within 1.3x of full-layer at T = 4096.
//!
//! The full-layer targets are marked on the row that does what PyTorch's step does: weights
//! already in the type the GEMMs read (FP8 from the optimizer, TransformerEngine's FP8
//! parameters) and gradients in the parameters' type (bf16, as PyTorch's bf16 parameters get),
//! written by the step. The other full-layer rows do more than that step: they cast bf16
//! weights to FP8 inside the step (TransformerEngine's default when its weights are not FP8),
//! or write f32 gradients (Megatron's `main_grad`), or add to them; they print their distance
//! to the target instead of a mark. Every full-layer row prints the DRAM floor of its own
//! weight-side traffic: the bytes its weights and weight gradients must move
//! ([`weight_side_bytes`]: 4 bytes a weight for the marked row, 6 to 14 for the others) at the
//! device-to-device copy rate measured in the same run. At T = 256 the floor of the rows that
//! cast in the step is about the target or above it.
//!
//! On Hopper the grouped GEMMs (forward, data and weight gradients) run on the sm_90a kernels
//! (`GemmPath::Auto`); a fourth row per shape runs the full layer with them on the portable
//! `mma.sync` kernels (`GemmPath::Portable`) for comparison.
//!
//! The step is the layer's work only (weight casts once per step, router, dispatch, experts,
//! combine and the backward); no scale update or optimizer. Two more full-layer rows per shape
//! take the FP8 weights from the optimizer instead ([`MoeLayer::with_fp8_weights_from_optimizer`],
//! TransformerEngine's FP8 parameters: the step casts nothing), with f32 and bf16 weight
//! gradients; beside them the optimizer step ([`MoeAdamW`]) in both modes, AdamW fused with
//! the FP8 cast against AdamW writing the bf16 weights, and the sums of step and optimizer,
//! so the cast's cost is never out of view. The weight gradients are the
//! step's ([`MoeLayer::with_step_gradients`]: the step's one microbatch writes them, as
//! PyTorch's first backward after `zero_grad()` does); a fifth row per shape runs the full
//! layer adding them to f32 gradients that are never zeroed instead (the layer's default),
//! which reads them once more per step. Every mode's output is checked
//! against the eager run on the same input (bit for bit for breaking-layer, which runs the
//! same kernels; to 1e-2 of the largest value for full-layer, whose grouped GEMMs sum in
//! another order than the dense ones).

use std::sync::Arc;

use cuda_graph::half::bf16;
use cuda_graph::{Context, DeviceBuffer, Event, Stream};
use fp8_kernels::gemm::{GemmOptions, GemmPath, GemmShape, Operand, gemm};
use fp8_kernels::{AdamW, AmaxAlgo, CastScaling, DelayedScaling, DeviceScalar, Fp8Format};
use fp8_moe::moe::layer::{
    ExpertGemm, Fp8Recipe, GradDtype, MoeLayer, MoeLayerConfig, MoeParams, formats,
};
use fp8_moe::moe::optim::MoeAdamW;
use fp8_moe::moe::routing::{RouterConfig, ScoreFn};
use graphed_callables::{Callable, GraphIndex, GraphedCallables, GraphedOptions, Schedule, Slot};

use super::{BenchResult, Rng, Row, event_median_ms, median};

const WARMUP: usize = 3;
const REPS: usize = 20;
/// Inputs the steps rotate over.
const INPUTS: usize = 4;

/// One benchmarked shape.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    pub(super) tokens: usize,
    pub(super) hidden: usize,
    pub(super) ffn: usize,
    pub(super) experts: usize,
    pub(super) top_k: usize,
    /// The full-layer target (ms), if any.
    pub(super) target_ms: Option<f64>,
    /// PyTorch's figures on this machine (eager, one CUDA graph), if measured.
    pub(super) torch_ms: Option<(f64, f64)>,
}

const SHAPES: [Shape; 3] = [
    Shape {
        tokens: 256,
        hidden: 2048,
        ffn: 2048,
        experts: 8,
        top_k: 2,
        target_ms: Some(0.20),
        torch_ms: Some((2.51, 0.68)),
    },
    Shape {
        tokens: 4096,
        hidden: 2048,
        ffn: 2048,
        experts: 8,
        top_k: 2,
        target_ms: Some(0.85),
        torch_ms: Some((2.80, 2.10)),
    },
    Shape {
        tokens: 4096,
        hidden: 2048,
        ffn: 256,
        experts: 256,
        top_k: 8,
        target_ms: None,
        torch_ms: None,
    },
];

pub(super) fn config(s: Shape, expert_gemm: ExpertGemm, grad_dtype: GradDtype) -> MoeLayerConfig {
    MoeLayerConfig {
        tokens: s.tokens,
        hidden: s.hidden,
        ffn: s.ffn,
        experts: s.experts,
        router: RouterConfig {
            top_k: s.top_k,
            score: ScoreFn::Softmax,
            renormalize: false,
            aux_coef: 1e-2,
            z_coef: 0.0,
        },
        recipe: Fp8Recipe::Hybrid,
        expert_gemm,
        scaling: CastScaling::Delayed,
        grad_dtype,
    }
}

fn bf16s(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// A layer of `cfg` with fixed random parameters and scales suited to them, its weight
/// gradients the step's (`step_gradients`) or accumulated.
fn layer(stream: &Stream, cfg: MoeLayerConfig, step_gradients: bool) -> BenchResult<MoeLayer> {
    let (e, h, f) = (cfg.experts, cfg.hidden, cfg.ffn);
    let params = MoeParams {
        wr: Rng::new(1, 0).vec(e * h, 0.02),
        w1: Rng::new(2, 0).vec(e * 2 * f * h, 0.02),
        w2: Rng::new(3, 0).vec(e * h * f, 0.02),
    };
    let fmts = formats(cfg.recipe, e);
    let scaling = Arc::new(DelayedScaling::new(stream, &fmts, 16, 0, AmaxAlgo::Max)?);
    // Scales for the data's magnitudes (x ~ 1, h ~ 0.1, gradients ~ 1e-2, weights ~ 0.02), so
    // the casts use the formats' range as a trained model's delayed scales would.
    for (t, fmt) in fmts.iter().enumerate() {
        let v = [1.0f32, 0.1, 0.01, 0.01].get(t).copied().unwrap_or(0.02);
        let max = if *fmt == Fp8Format::E4M3 {
            448.0
        } else {
            57344.0
        };
        scaling.scale(t)?.write(stream, max / v)?;
    }
    Ok(MoeLayer::new(stream, cfg, &params, scaling, 0)?.with_step_gradients(step_gradients))
}

fn inputs(stream: &Stream, s: Shape) -> BenchResult<Vec<DeviceBuffer<bf16>>> {
    (0..INPUTS)
        .map(|i| {
            Ok(DeviceBuffer::from_host(
                stream,
                &bf16s(&Rng::new(100 + i as u64, 0).vec(s.tokens * s.hidden, 1.0)),
            )?)
        })
        .collect()
}

fn grad(stream: &Stream, s: Shape) -> BenchResult<DeviceBuffer<bf16>> {
    Ok(DeviceBuffer::from_host(
        stream,
        &bf16s(&Rng::new(200, 0).vec(s.tokens * s.hidden, 0.01)),
    )?)
}

/// Eager step time (ms) and the output for input 0.
fn eager(ctx: &Arc<Context>, stream: &Stream, s: Shape) -> BenchResult<(f64, Vec<bf16>)> {
    let mut layer = layer(
        stream,
        config(s, ExpertGemm::PerExpert, GradDtype::F32),
        true,
    )?;
    let xs = inputs(stream, s)?;
    let dy = grad(stream, s)?;
    let n = s.tokens * s.hidden;
    let (x, y, dx) = (
        DeviceBuffer::<bf16>::alloc(ctx, n)?,
        DeviceBuffer::<bf16>::alloc(ctx, n)?,
        DeviceBuffer::<bf16>::alloc(ctx, n)?,
    );
    let saved = super::zeroed_saved(stream, &layer.saved_bytes())?;
    let at = GraphIndex {
        chunk: 0,
        microbatch: 0,
        layer: 0,
    };
    let step = |layer: &mut MoeLayer, i: usize| -> BenchResult<()> {
        x.copy_from_device(stream, &xs[i % INPUTS])?;
        let slot = Slot::new(at, vec![&x], vec![&y], saved.iter().collect());
        layer.cast_weights(stream, &slot)?;
        layer.forward(stream, &[&x], &[&y], &slot)?;
        layer.backward(stream, &[&dy], &[&dx], &slot)?;
        Ok(())
    };
    step(&mut layer, 0)?;
    let y0 = y.to_vec(stream)?;
    let mut i = 0;
    let ms = event_median_ms(stream, WARMUP, REPS, || {
        i += 1;
        step(&mut layer, i)
    })?;
    Ok((ms, y0))
}

/// What a graphed run varies besides the GEMM mode and path: the step writes the weight
/// gradients (or adds to them), their type, fast accumulation in the forward GEMMs, the FP8
/// weights written by the optimizer instead of cast in the step, and whether the optimizer
/// step ([`MoeAdamW`]) is timed too.
#[derive(Clone, Copy)]
struct Variant {
    step_gradients: bool,
    grad_dtype: GradDtype,
    fast: bool,
    fp8_from_optimizer: bool,
    optimizer: bool,
    /// Where the backward's weight and router gradients run.
    beside: Beside,
}

/// The SMs the full-layer steps' expert weight gradients ([`MoeLayer::with_weight_grads_beside`])
/// and router gradients ([`MoeLayer::with_router_grads_beside`]) take beside other work: each
/// the layer's default where `None`, off (after the work they would run beside) with `Some(0)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Beside {
    /// Beside the data gradients.
    pub weight_grads: Option<usize>,
    /// Beside the expert weight gradients.
    pub router_grads: Option<usize>,
}

impl Beside {
    /// `layer` with these settings.
    fn apply(self, layer: MoeLayer) -> MoeLayer {
        let layer = match self.weight_grads {
            Some(n) => layer.with_weight_grads_beside(Some(n).filter(|&n| n > 0)),
            None => layer,
        };
        match self.router_grads {
            Some(n) => layer.with_router_grads_beside(Some(n).filter(|&n| n > 0)),
            None => layer,
        }
    }

    /// The settings as the rows' notes say them (nothing for the defaults).
    fn note(self) -> String {
        let one = |what: &str, after: &str, sms: Option<usize>| match sms {
            Some(0) => format!("; {what} after {after}"),
            Some(n) => format!("; {what} beside {after} on {n} SMs"),
            None => String::new(),
        };
        one("weight gradients", "the data gradients", self.weight_grads)
            + &one(
                "router gradients",
                "the weight gradients",
                self.router_grads,
            )
    }
}

/// Median times (ms) of a graphed step and of its forward and backward (events between them),
/// and of the optimizer step when timed.
#[derive(Clone, Copy)]
struct Times {
    step: f64,
    forward: f64,
    backward: f64,
    optimizer: Option<f64>,
}

/// Graphed step times and the output for input 0: one microbatch, forward then backward,
/// under the runtime (breaking-layer for per-expert GEMMs, full-layer for grouped).
fn graphed(
    stream: &Stream,
    s: Shape,
    mode: ExpertGemm,
    path: GemmPath,
    v: Variant,
) -> BenchResult<(Times, Vec<bf16>)> {
    let Variant {
        step_gradients,
        grad_dtype,
        fast,
        fp8_from_optimizer,
        optimizer,
        beside,
    } = v;
    let layer = layer(stream, config(s, mode, grad_dtype), step_gradients)?
        .with_gemm_path(path)
        .with_fast_forward_accumulation(fast)
        .with_fp8_weights_from_optimizer(stream, fp8_from_optimizer)?;
    let layer = beside.apply(layer);
    let opt = if optimizer {
        Some(MoeAdamW::new(stream, &layer, AdamW::default())?)
    } else {
        None
    };
    let xs = inputs(stream, s)?;
    let dy = grad(stream, s)?;
    let schedule = Schedule::new(&[1, -1], vec![1])?;
    let graphed = GraphedCallables::build(
        stream,
        vec![Box::new(layer) as Box<dyn Callable<bf16>>],
        &[vec![&xs[0]]],
        GraphedOptions::new(schedule),
    )?;
    let y0 = {
        let y = graphed.forward(0, 0, &[&xs[0]], stream)?;
        let v = y[0].to_vec(stream)?;
        graphed.backward(0, 0, &[&dy], stream)?;
        v
    };
    let mut i = 0;
    let step = event_median_ms(stream, WARMUP, REPS, || {
        i += 1;
        graphed.forward(0, 0, &[&xs[i % INPUTS]], stream)?;
        graphed.backward(0, 0, &[&dy], stream)?;
        Ok(())
    })?;
    // The same steps with an event between the passes (the schedule replays them in order).
    let (e0, e1, e2) = (
        Event::new(stream.context())?,
        Event::new(stream.context())?,
        Event::new(stream.context())?,
    );
    let (mut fwd, mut bwd) = (Vec::with_capacity(REPS), Vec::with_capacity(REPS));
    for rep in 0..WARMUP + REPS {
        i += 1;
        e0.record(stream)?;
        graphed.forward(0, 0, &[&xs[i % INPUTS]], stream)?;
        e1.record(stream)?;
        graphed.backward(0, 0, &[&dy], stream)?;
        e2.record(stream)?;
        e2.synchronize()?;
        if rep >= WARMUP {
            fwd.push(f64::from(Event::elapsed_ms(&e0, &e1)?));
            bwd.push(f64::from(Event::elapsed_ms(&e1, &e2)?));
        }
    }
    let (forward, backward) = (median(&mut fwd), median(&mut bwd));
    // Last: the optimizer steps move the weights.
    let optimizer = opt
        .map(|o| event_median_ms(stream, WARMUP, REPS, || Ok(o.step(stream, None)?)))
        .transpose()?;
    Ok((
        Times {
            step,
            forward,
            backward,
            optimizer,
        },
        y0,
    ))
}

/// Our dense FP8 GEMM on `m x n x k` (E4M3, bf16 out): TFLOP/s.
fn dense_tflops(
    ctx: &Arc<Context>,
    stream: &Stream,
    m: usize,
    n: usize,
    k: usize,
) -> BenchResult<f64> {
    let a = DeviceBuffer::from_host(stream, &vec![0x38u8; m * k])?;
    let b = DeviceBuffer::from_host(stream, &vec![0x30u8; n * k])?;
    let d = DeviceBuffer::<bf16>::alloc(ctx, m * n)?;
    let one = DeviceScalar::new(stream, 1.0)?;
    let op = |data| Operand {
        data,
        format: Fp8Format::E4M3,
        scale_inv: &one,
    };
    let ms = event_median_ms(stream, WARMUP, REPS, || {
        Ok(gemm(
            stream,
            GemmShape::new(m, n, k),
            op(&a),
            op(&b),
            &d,
            GemmOptions::new(),
        )?)
    })?;
    Ok(2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12)
}

/// Bytes a training step's expert weights and weight gradients alone must move through DRAM,
/// with `params` expert weights (`3 E H F`): the FP8 weights read by the forward and their
/// transposes by the data gradients (1 byte each), the bf16 weights read and both FP8 copies
/// written when `cast_in_step`, and the gradients (`grad_bytes` each) written, or read and
/// written when `accumulate`. PyTorch's bf16 step moves `6 params` by the same count.
pub fn weight_side_bytes(
    params: usize,
    cast_in_step: bool,
    grad_bytes: usize,
    accumulate: bool,
) -> usize {
    let fp8_reads = 2 * params;
    let cast = if cast_in_step {
        2 * params + 2 * params
    } else {
        0
    };
    let grads = grad_bytes * params * if accumulate { 2 } else { 1 };
    fp8_reads + cast + grads
}

/// This device's device-to-device copy rate (TB/s, bytes read plus bytes written) over
/// 256 MiB: the rate the weight-side floors are priced at.
fn copy_tbs(ctx: &Arc<Context>, stream: &Stream) -> BenchResult<f64> {
    const BYTES: usize = 256 << 20;
    let src = DeviceBuffer::<u8>::alloc(ctx, BYTES)?;
    src.memset_bytes(stream, 0x3c)?;
    let dst = DeviceBuffer::<u8>::alloc(ctx, BYTES)?;
    let ms = event_median_ms(stream, WARMUP, REPS, || {
        Ok(dst.copy_from_device(stream, &src)?)
    })?;
    Ok(2.0 * BYTES as f64 / (ms * 1e-3) / 1e12)
}

/// max |got - want| / max |want| (infinite on a non-finite value or a length mismatch).
fn rel_err(got: &[bf16], want: &[bf16]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let (mut err, mut mag) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        let (g, w) = (f64::from(g.to_f32()), f64::from(w.to_f32()));
        if !g.is_finite() || !w.is_finite() {
            return f64::INFINITY;
        }
        err = err.max((g - w).abs());
        mag = mag.max(w.abs());
    }
    if mag == 0.0 { err } else { err / mag }
}

/// The steps `bench moe` times; `--only` picks some (all by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Step {
    /// Eager, dense per-expert GEMMs on host-read counts.
    Eager,
    /// Breaking-layer graphs.
    Breaking,
    /// Full-layer graphs, f32 weight gradients (with the optimizer step timed).
    Full,
    /// Full-layer, bf16 weight gradients (with the optimizer step timed).
    FullBf16,
    /// Full-layer, f32 weight gradients, FP8 weights from the optimizer.
    Fp8Weights,
    /// Full-layer, bf16 weight gradients, FP8 weights from the optimizer.
    Fp8WeightsBf16,
    /// Full-layer with the forward GEMMs' sums promoted.
    Promoted,
    /// Full-layer on the portable grouped GEMMs.
    Portable,
    /// Full-layer adding into f32 gradients never zeroed.
    Accumulated,
}

/// One timed step's times and output for input 0.
type Timed = (Times, Vec<bf16>);

/// Runs the benchmark on device 0, on the shapes with `tokens` tokens and `experts` experts
/// (every shape where `None`) and the steps `only` (every step when empty); an error if no
/// shape is left. The checks between steps' outputs run where both steps ran. The full-layer
/// steps place their weight and router gradients as `beside` says.
pub fn run(
    tokens: Option<usize>,
    experts: Option<usize>,
    only: &[Step],
    beside: Beside,
) -> BenchResult<Vec<Row>> {
    let shapes: Vec<Shape> = SHAPES
        .into_iter()
        .filter(|s| tokens.is_none_or(|t| t == s.tokens) && experts.is_none_or(|e| e == s.experts))
        .collect();
    if shapes.is_empty() {
        return Err(format!(
            "no shape with tokens {tokens:?} and experts {experts:?} (the shapes: {})",
            SHAPES
                .iter()
                .map(|s| format!("T={} E={}", s.tokens, s.experts))
                .collect::<Vec<_>>()
                .join(", ")
        )
        .into());
    }
    let want = |v: Step| only.is_empty() || only.contains(&v);
    let ctx = Context::default_device()?;
    let stream = Stream::new(&ctx)?;
    let mut rows = Vec::new();
    for s in shapes {
        let flops = 18.0 * (s.tokens * s.top_k * s.hidden * s.ffn) as f64;
        let dense = dense_tflops(&ctx, &stream, s.tokens * s.top_k, 2 * s.ffn, s.hidden)?;
        let copy_rate = copy_tbs(&ctx, &stream)?;
        let params = 3 * s.experts * s.hidden * s.ffn;
        let f32_step = Variant {
            step_gradients: true,
            grad_dtype: GradDtype::F32,
            fast: true,
            fp8_from_optimizer: false,
            optimizer: false,
            beside,
        };
        let f32_timed = Variant {
            optimizer: true,
            ..f32_step
        };
        let full_run = |step: Step, mode: ExpertGemm, path: GemmPath, v: Variant| {
            want(step)
                .then(|| graphed(&stream, s, mode, path, v))
                .transpose()
        };
        let grouped =
            |step: Step, v: Variant| full_run(step, ExpertGemm::Grouped, GemmPath::Auto, v);
        let eager_run: Option<(f64, Vec<bf16>)> = want(Step::Eager)
            .then(|| eager(&ctx, &stream, s))
            .transpose()?;
        let breaking = full_run(
            Step::Breaking,
            ExpertGemm::PerExpert,
            GemmPath::Auto,
            f32_step,
        )?;
        let full = grouped(Step::Full, f32_timed)?;
        let fp8_opt = Variant {
            fp8_from_optimizer: true,
            ..f32_timed
        };
        let opt = grouped(Step::Fp8Weights, fp8_opt)?;
        let opt_bf16 = grouped(
            Step::Fp8WeightsBf16,
            Variant {
                grad_dtype: GradDtype::Bf16,
                ..fp8_opt
            },
        )?;
        let portable = full_run(
            Step::Portable,
            ExpertGemm::Grouped,
            GemmPath::Portable,
            f32_step,
        )?;
        let acc = grouped(
            Step::Accumulated,
            Variant {
                step_gradients: false,
                ..f32_step
            },
        )?;
        let bf16 = grouped(
            Step::FullBf16,
            Variant {
                grad_dtype: GradDtype::Bf16,
                ..f32_timed
            },
        )?;
        let promoted = grouped(
            Step::Promoted,
            Variant {
                fast: false,
                ..f32_step
            },
        )?;
        check_outputs(
            s,
            eager_run.as_ref().map(|e| &e.1[..]),
            &breaking,
            &full,
            [&opt, &opt_bf16, &acc, &bf16],
            &promoted,
            &portable,
        )?;
        let what = format!(
            "MoE T={} H={} F={} E={} top-{}",
            s.tokens, s.hidden, s.ffn, s.experts, s.top_k
        );
        let rate = |ms: f64| flops / (ms * 1e-3) / 1e12;
        let torch = |i: usize| {
            s.torch_ms
                .map(|t| format!("; PyTorch bf16 {:.2} ms", if i == 0 { t.0 } else { t.1 }))
                .unwrap_or_default()
        };
        // The target where the row is marked by it; elsewhere the row's distance to it.
        let target = |ms: f64, marked: bool| {
            s.target_ms
                .map(|t| {
                    if marked {
                        format!("; target <= {t:.2} ms")
                    } else {
                        format!(
                            "; {:.2}x the target {t:.2} ms (marked on the row like PyTorch's \
                             step: FP8 weights, bf16 gradients)",
                            ms / t
                        )
                    }
                })
                .unwrap_or_default()
        };
        // The DRAM floor of the row's weights and weight gradients.
        let floor = |cast_in_step: bool, grad: GradDtype, accumulate: bool| {
            let grad_bytes = match grad {
                GradDtype::F32 => 4,
                GradDtype::Bf16 => 2,
            };
            let bytes = weight_side_bytes(params, cast_in_step, grad_bytes, accumulate) as f64;
            format!(
                "; weight-side DRAM floor {:.3} ms ({:.0} MB at the {copy_rate:.2} TB/s of a \
                 device copy)",
                bytes / (copy_rate * 1e12) * 1e3,
                bytes / 1e6
            )
        };
        let beside = beside.note();
        let parts = |t: &Times| {
            format!(
                "; forward {:.3} + backward {:.3} ms (events between them){beside}",
                t.forward, t.backward
            )
        };
        let full_ms = full.as_ref().map(|f| f.0.step);
        // "0.93x the full-layer step", when it ran.
        let vs_full = |ms: f64, what: &str| {
            full_ms
                .map(|f| format!("; {:.2}x {what}", ms / f))
                .unwrap_or_default()
        };
        if let Some((eager_ms, _)) = eager_run {
            rows.push(Row {
                name: format!("{what}: eager step"),
                value: eager_ms,
                unit: "ms",
                yardstick: format!(
                    "GEMMs at {:.0} TFLOP/s; dense FP8 GEMM {:.0} TFLOP/s{}",
                    rate(eager_ms),
                    dense,
                    torch(0)
                ),
                pass: None,
            });
        }
        if let Some((b, _)) = &breaking {
            rows.push(Row {
                name: format!("{what}: breaking-layer step"),
                value: b.step,
                unit: "ms",
                yardstick: format!(
                    "GEMMs at {:.0} TFLOP/s{} (target <= 1.3x at T=4096)",
                    rate(b.step),
                    vs_full(b.step, "full-layer"),
                ),
                pass: (s.tokens == 4096 && s.experts == 8)
                    .then_some(full_ms.map(|f| b.step <= 1.3 * f))
                    .flatten(),
            });
        }
        if let Some((f, _)) = &full {
            rows.push(Row {
                name: format!("{what}: full-layer step"),
                value: f.step,
                unit: "ms",
                yardstick: format!(
                    "GEMMs at {:.0} TFLOP/s; dense FP8 GEMM {:.0} TFLOP/s{}{}{}{}",
                    rate(f.step),
                    dense,
                    torch(1),
                    target(f.step, false),
                    floor(true, GradDtype::F32, false),
                    parts(f)
                ),
                pass: None,
            });
        }
        if let Some((b, _)) = &bf16 {
            rows.push(Row {
                name: format!("{what}: full-layer step, bf16 weight gradients"),
                value: b.step,
                unit: "ms",
                yardstick: format!(
                    "GEMMs at {:.0} TFLOP/s{}; gradients bf16 like PyTorch's{}{}{}{}",
                    rate(b.step),
                    vs_full(b.step, "the f32-gradient step"),
                    torch(1),
                    target(b.step, false),
                    floor(true, GradDtype::Bf16, false),
                    parts(b)
                ),
                pass: None,
            });
        }
        // The FP8 weights from the optimizer: the step without the cast, and the optimizer
        // step (AdamW with the FP8 cast) beside the one the cast-in-step mode needs (AdamW
        // writing the bf16 weights), so the whole step's cost stays in view.
        for (grad, t, cast_in_step) in [
            (GradDtype::F32, &opt, &full),
            (GradDtype::Bf16, &opt_bf16, &bf16),
        ] {
            let marked = grad == GradDtype::Bf16;
            let grads = if marked { "bf16" } else { "f32" };
            let Some((t, _)) = t else { continue };
            let opt_ms = t.optimizer.unwrap_or(f64::NAN);
            let beside = cast_in_step
                .as_ref()
                .map(|(c, _)| {
                    let plain = c.optimizer.unwrap_or(f64::NAN);
                    format!(
                        "; {:.2}x the step casting its weights ({:.3} ms); optimizer step \
                         {opt_ms:.3} ms (AdamW + FP8 cast) against {plain:.3} (AdamW + bf16 \
                         weights); step + optimizer {:.3} against {:.3} ms",
                        t.step / c.step,
                        c.step,
                        t.step + opt_ms,
                        c.step + plain
                    )
                })
                .unwrap_or_else(|| format!("; optimizer step {opt_ms:.3} ms (AdamW + FP8 cast)"));
            rows.push(Row {
                name: format!(
                    "{what}: full-layer step, {grads} weight gradients, FP8 weights from the \
                     optimizer"
                ),
                value: t.step,
                unit: "ms",
                yardstick: format!(
                    "GEMMs at {:.0} TFLOP/s{beside}{}{}{}{}",
                    rate(t.step),
                    torch(1),
                    target(t.step, marked),
                    floor(false, grad, false),
                    parts(t)
                ),
                pass: s
                    .target_ms
                    .filter(|_| marked)
                    .map(|target| t.step <= target),
            });
        }
        // Variants of the full-layer step, each beside it.
        let promoted_note = ", whose forward GEMMs accumulate fast \
                             (MoeLayer::with_fast_forward_accumulation)";
        for (variant, run, note) in [
            ("forward sums promoted", &promoted, promoted_note),
            ("portable grouped GEMMs", &portable, ""),
            (
                "gradients accumulated",
                &acc,
                &format!(
                    " (f32 gradients read once more){}",
                    floor(true, GradDtype::F32, true)
                )[..],
            ),
        ] {
            let Some((t, _)) = run else { continue };
            rows.push(Row {
                name: format!("{what}: full-layer step, {variant}"),
                value: t.step,
                unit: "ms",
                yardstick: format!(
                    "GEMMs at {:.0} TFLOP/s{}",
                    rate(t.step),
                    full_ms
                        .map(|f| format!("; {:.2}x the full-layer step{note}", t.step / f))
                        .unwrap_or_default(),
                ),
                pass: None,
            });
        }
    }
    Ok(rows)
}

/// A step's output for input 0, if it ran.
fn y(t: &Option<Timed>) -> Option<&[bf16]> {
    t.as_ref().map(|t| &t.1[..])
}

/// The checks between the steps that ran: breaking-layer equals eager bit for bit (the same
/// kernels); the full-layer output is the same with either gradient type, accumulated
/// gradients and FP8 weights from the optimizer (the same scales, never updated here, and
/// weights: the same FP8 bytes); within 1e-2 of eager (grouped GEMMs sum in another order);
/// fast and promoted forward sums within 5e-2 of each other, the portable kernels (which
/// promote) within 1e-2 of the promoted run.
fn check_outputs(
    s: Shape,
    eager: Option<&[bf16]>,
    breaking: &Option<Timed>,
    full: &Option<Timed>,
    same_as_full: [&Option<Timed>; 4],
    promoted: &Option<Timed>,
    portable: &Option<Timed>,
) -> BenchResult<()> {
    if let (Some(e), Some(b)) = (eager, y(breaking)) {
        if b != e {
            return Err(format!("{s:?}: breaking-layer output differs from eager").into());
        }
    }
    if let Some(f) = y(full) {
        if same_as_full.iter().any(|o| y(o).is_some_and(|o| o != f)) {
            return Err(format!(
                "{s:?}: full-layer output depends on the gradient type or accumulation, or on \
                 where the FP8 weights are cast"
            )
            .into());
        }
        if let Some(e) = eager {
            let err = rel_err(f, e);
            if err > 1e-2 {
                return Err(format!("{s:?}: full-layer output off eager by {err:e}").into());
            }
        }
        // Both sums are FP8 computations of the same layer: fc1's outputs that differ in the
        // last bits can round to neighbouring E4M3 values of h (3 mantissa bits), so the
        // outputs differ by about 1e-2 of their largest (1.2e-2 at T = 4096 on the H200);
        // each is within the layer's FP8 tolerance of the exact result (tests/moe_layer.rs).
        if let Some(p) = y(promoted) {
            let err = rel_err(f, p);
            if err > 5e-2 {
                return Err(
                    format!("{s:?}: fast and promoted forward sums differ by {err:e}").into(),
                );
            }
        }
    }
    if let (Some(p), Some(q)) = (y(promoted), y(portable)) {
        let err = rel_err(q, p);
        if err > 1e-2 {
            return Err(format!(
                "{s:?}: full-layer (portable grouped GEMMs) off the promoted sm_90a run by \
                 {err:e}"
            )
            .into());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::weight_side_bytes;

    #[test]
    fn weight_side_bytes_count_each_pass() {
        // E = 8, H = F = 2048: 100.7 M expert weights.
        let p = 3 * 8 * 2048 * 2048;
        // FP8 weights from the optimizer, bf16 gradients: two FP8 reads and one bf16 write.
        assert_eq!(weight_side_bytes(p, false, 2, false), 4 * p);
        // The same with f32 gradients.
        assert_eq!(weight_side_bytes(p, false, 4, false), 6 * p);
        // Cast in the step: the bf16 read and two FP8 writes on top.
        assert_eq!(weight_side_bytes(p, true, 2, false), 8 * p);
        assert_eq!(weight_side_bytes(p, true, 4, false), 10 * p);
        // Accumulated f32 gradients are read and written.
        assert_eq!(weight_side_bytes(p, true, 4, true), 14 * p);
        assert_eq!(weight_side_bytes(p, false, 4, true), 10 * p);
    }
}
