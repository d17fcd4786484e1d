//! `fp8-moe bench graphed`: eager against graphed step time, CUDA events, medians.
//!
//! * The FP8 MLP stack of `tests/fp8_mlp.rs` ([`Fp8Linear`] layers with bias, alternating
//!   narrow -> wide -> narrow features, one [`DelayedScaling`] state updated after every
//!   forward and backward), 1 chunk of 4 layers x 3 microbatches, order
//!   `[1, 1, 1, -1, -1, -1]`: one training step eagerly (a `cast_weights` on microbatch 0,
//!   every layer's forward and backward, the updates) against the same step replayed
//!   through [`GraphedCallables`] with one graph per layer (TransformerEngine's
//!   granularity), one graph per step (the default) and one graph per step with noop-flag
//!   casts. Sizes: 128/256 features at 16 tokens (launch-bound), 1024/2048 at 64 tokens
//!   (bound by per-kernel latency on the device) and at 8192 tokens. Each row also gives
//!   the host time the step took to enqueue.
//!
//! The MoE layer's eager, breaking-layer and full-layer steps are `fp8-moe bench moe`
//! ([`super::moe`]).

use std::sync::Arc;

use cuda_graph::{Context, DeviceBuffer, GraphPool, Stream};
use fp8_kernels::{AmaxAlgo, DelayedScaling, Fp8Format, IdentityGroup};
use fp8_moe::linear::{self, Fp8Linear};
use graphed_callables::{
    Callable, GraphIndex, GraphedCallables, GraphedOptions, Schedule, Slot, Step, WeightCaching,
};

use super::{BenchResult, Rng, Row, Timing, timed_medians};

const WARMUP: usize = 3;
const REPS: usize = 20;
const MLP_ORDER: [i64; 6] = [1, 1, 1, -1, -1, -1];
const MLP_LAYERS: usize = 4;
/// The MLP stack's sizes.
#[derive(Debug, Clone, Copy)]
struct Mlp {
    tokens: usize,
    /// Layers alternate narrow -> wide, wide -> narrow.
    narrow: usize,
    wide: usize,
}

/// Small layers at 16 tokens (every kernel a few microseconds: bound by launches), the
/// 1024/2048 stack at 64 tokens (bound by the device's per-kernel latency) and at 8192
/// tokens (bound by the GEMMs).
const MLPS: [Mlp; 3] = [
    Mlp {
        tokens: 16,
        narrow: 128,
        wide: 256,
    },
    Mlp {
        tokens: 64,
        narrow: 1024,
        wide: 2048,
    },
    Mlp {
        tokens: 8192,
        narrow: 1024,
        wide: 2048,
    },
];
/// Copies `v` into `buf` (e.g. one of the runtime's static buffers); waits.
fn overwrite(stream: &Stream, buf: &DeviceBuffer<f32>, v: &[f32]) -> BenchResult<()> {
    buf.copy_from_host(stream, v)?;
    Ok(())
}

impl Mlp {
    fn widths(self, layer: usize) -> (usize, usize) {
        if layer % 2 == 0 {
            (self.narrow, self.wide)
        } else {
            (self.wide, self.narrow)
        }
    }
}

fn mlp_layers(
    stream: &Stream,
    mlp: Mlp,
    scaling: &Arc<DelayedScaling>,
) -> BenchResult<Vec<Fp8Linear>> {
    (0..MLP_LAYERS)
        .map(|l| {
            let (i, o) = mlp.widths(l);
            Ok(Fp8Linear::new(
                stream,
                mlp.tokens,
                i,
                o,
                &Rng::new(100 + l as u64, 0).vec(i * o, 0.03),
                Some(&Rng::new(200 + l as u64, 0).vec(o, 0.1)),
                scaling.clone(),
                l * linear::TENSORS,
            )?)
        })
        .collect()
}

fn mlp_scaling(stream: &Stream) -> BenchResult<Arc<DelayedScaling>> {
    let formats: Vec<Fp8Format> = (0..MLP_LAYERS).flat_map(|_| linear::FORMATS).collect();
    Ok(Arc::new(DelayedScaling::new(
        stream,
        &formats,
        16,
        0,
        AmaxAlgo::Max,
    )?))
}

/// The eager MLP step time.
fn mlp_eager(ctx: &Arc<Context>, stream: &Stream, mlp: Mlp) -> BenchResult<Timing> {
    let tokens = mlp.tokens;
    let scaling = mlp_scaling(stream)?;
    let mut layers = mlp_layers(stream, mlp, &scaling)?;
    let pool = GraphPool::new(ctx, 256)?;
    let mbs = 3;
    let alloc = |n: usize| DeviceBuffer::<f32>::from_host(stream, &vec![0f32; n]);
    // Per microbatch: the input, and per layer the output, input gradient, saved buffers.
    let mut xs = Vec::new();
    let mut outs = Vec::new();
    let mut dxs = Vec::new();
    let mut saved = Vec::new();
    for mb in 0..mbs {
        xs.push(DeviceBuffer::from_host(
            stream,
            &Rng::new(300 + mb as u64, 0).vec(tokens * mlp.narrow, 1.0),
        )?);
        let mut o = Vec::new();
        let mut d = Vec::new();
        let mut s = Vec::new();
        for (l, layer) in layers.iter().enumerate() {
            let (i, w) = mlp.widths(l);
            o.push(alloc(tokens * w)?);
            d.push(alloc(tokens * i)?);
            s.push(
                layer
                    .saved_bytes()
                    .iter()
                    .map(|&n| DeviceBuffer::<u8>::from_host(stream, &vec![0u8; n]))
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
        outs.push(o);
        dxs.push(d);
        saved.push(s);
    }
    let dy = DeviceBuffer::from_host(
        stream,
        &Rng::new(400, 0).vec(tokens * mlp.widths(MLP_LAYERS - 1).1, 0.1),
    )?;
    stream.synchronize()?;
    let t = timed_medians(stream, WARMUP, REPS, || {
        for mb in 0..mbs {
            for l in 0..MLP_LAYERS {
                let x = if l == 0 { &xs[mb] } else { &outs[mb][l - 1] };
                let at = GraphIndex {
                    chunk: 0,
                    microbatch: mb,
                    layer: l,
                };
                let slot = Slot::new(
                    at,
                    vec![x],
                    vec![&outs[mb][l]],
                    saved[mb][l].iter().collect(),
                )
                .with_pool(&pool);
                if mb == 0 {
                    layers[l].cast_weights(stream, &slot)?;
                }
                layers[l].forward(stream, &[x], &[&outs[mb][l]], &slot)?;
            }
            scaling.update(stream)?;
        }
        for mb in 0..mbs {
            for l in (0..MLP_LAYERS).rev() {
                let x = if l == 0 { &xs[mb] } else { &outs[mb][l - 1] };
                let g = if l == MLP_LAYERS - 1 {
                    &dy
                } else {
                    &dxs[mb][l + 1]
                };
                let at = GraphIndex {
                    chunk: 0,
                    microbatch: mb,
                    layer: l,
                };
                let slot = Slot::new(
                    at,
                    vec![x],
                    vec![&outs[mb][l]],
                    saved[mb][l].iter().collect(),
                )
                .with_pool(&pool);
                layers[l].backward(stream, &[g], &[&dxs[mb][l]], &slot)?;
            }
            scaling.update(stream)?;
        }
        Ok(())
    })?;
    Ok(t)
}

/// The graphed MLP step time, with the layers of a step merged into one graph or one graph
/// per layer.
fn mlp_graphed(
    ctx: &Arc<Context>,
    stream: &Stream,
    mlp: Mlp,
    merge: bool,
    caching: WeightCaching,
) -> BenchResult<Timing> {
    let scaling = mlp_scaling(stream)?;
    let tokens = mlp.tokens;
    let layers = mlp_layers(stream, mlp, &scaling)?;
    let schedule = Schedule::new(&MLP_ORDER, vec![MLP_LAYERS])?;
    let mut options = GraphedOptions::new(schedule.clone())
        .with_merge_layers(merge)
        .with_weight_caching(caching);
    // The scale update after every replay, as in the eager step (plus the warmup snapshot
    // and registration, outside the timed steps).
    fp8_moe::scaling::install_hooks(&mut options, ctx, &scaling, Arc::new(IdentityGroup))?;
    let sample = DeviceBuffer::from_host(stream, &Rng::new(300, 0).vec(tokens * mlp.narrow, 1.0))?;
    // One set per callable: only the first layer reads its sample.
    let samples: Vec<Vec<&DeviceBuffer<f32>>> = (0..MLP_LAYERS)
        .map(|l| if l == 0 { vec![&sample] } else { vec![] })
        .collect();
    let callables: Vec<Box<dyn Callable<f32>>> = layers
        .into_iter()
        .map(|l| Box::new(l) as Box<dyn Callable<f32>>)
        .collect();
    let graphed = GraphedCallables::build(stream, callables, &samples, options)?;
    // Inputs and output gradients written straight into the static buffers (no copies in
    // the timed step, as the eager step reads its buffers in place).
    for mb in 0..3 {
        let x = graphed.static_inputs(0, mb)?;
        overwrite(
            stream,
            x[0],
            &Rng::new(300 + mb as u64, 0).vec(tokens * mlp.narrow, 1.0),
        )?;
        let g = graphed.static_grad_outputs(0, mb)?;
        overwrite(
            stream,
            g[0],
            &Rng::new(400, 0).vec(tokens * mlp.widths(MLP_LAYERS - 1).1, 0.1),
        )?;
    }
    stream.synchronize()?;
    let t = timed_medians(stream, WARMUP, REPS, || {
        for &st in schedule.steps() {
            let mb = st.microbatch();
            match st {
                Step::Forward { .. } => {
                    let x = graphed.static_inputs(0, mb)?;
                    graphed.forward(0, mb, &x, stream)?;
                }
                Step::Backward { .. } => {
                    let g = graphed.static_grad_outputs(0, mb)?;
                    graphed.backward(0, mb, &g, stream)?;
                }
                Step::WeightGrad { .. } => return Err("no weight-gradient entries".into()),
            }
        }
        Ok(())
    })?;
    Ok(t)
}

/// Runs the benchmark on device 0.
pub fn run() -> BenchResult<Vec<Row>> {
    let ctx = Context::default_device()?;
    let stream = Stream::new(&ctx)?;
    let mut rows = Vec::new();
    for mlp in MLPS {
        let eager = mlp_eager(&ctx, &stream, mlp)?;
        let per_layer = mlp_graphed(&ctx, &stream, mlp, false, WeightCaching::Static)?;
        let merged = mlp_graphed(&ctx, &stream, mlp, true, WeightCaching::Static)?;
        let cond = mlp_graphed(&ctx, &stream, mlp, true, WeightCaching::Conditional)?;
        let noop = mlp_graphed(&ctx, &stream, mlp, true, WeightCaching::NoopFlag)?;
        let what = format!(
            "FP8 MLP {MLP_LAYERS} layers {}/{} x 3 mb, {} tokens",
            mlp.narrow, mlp.wide, mlp.tokens
        );
        let host = |t: &Timing| format!("host enqueue {:.3} ms", t.host_ms);
        rows.push(Row {
            name: format!("{what}: eager step"),
            value: eager.gpu_ms,
            unit: "ms",
            yardstick: format!(
                "fwd + bwd of every microbatch, scale updates; {}",
                host(&eager)
            ),
            pass: None,
        });
        rows.push(Row {
            name: format!("{what}: graphed, graph per layer"),
            value: per_layer.gpu_ms,
            unit: "ms",
            yardstick: format!(
                "{:.2}x eager (TE's granularity); {}",
                eager.gpu_ms / per_layer.gpu_ms,
                host(&per_layer)
            ),
            pass: None,
        });
        rows.push(Row {
            name: format!("{what}: graphed, graph per step"),
            value: merged.gpu_ms,
            unit: "ms",
            yardstick: format!(
                "{:.2}x eager (layers merged, static casts: the defaults); {}",
                eager.gpu_ms / merged.gpu_ms,
                host(&merged)
            ),
            // Judged where the eager step is bound by its launches (its host enqueue time
            // reaches its device time); elsewhere graphs can only save the gaps.
            pass: (eager.host_ms >= 0.9 * eager.gpu_ms).then_some(merged.gpu_ms < eager.gpu_ms),
        });
        for (label, t) in [
            ("IF-node casts (set from a device flag)", &cond),
            ("noop-flag casts (launched, skipped on the device)", &noop),
        ] {
            rows.push(Row {
                name: format!(
                    "{what}: graphed, graph per step, {}",
                    &label[..label.find(" (").unwrap_or(label.len())]
                ),
                value: t.gpu_ms,
                unit: "ms",
                yardstick: format!(
                    "{:.2}x eager ({label}); {}",
                    eager.gpu_ms / t.gpu_ms,
                    host(t)
                ),
                pass: None,
            });
        }
    }
    Ok(rows)
}
