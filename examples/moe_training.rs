//! Training a mixture-of-experts layer under CUDA graphs.
//!
//! A dropless top-2 SwiGLU MoE layer ([`MoeLayer`]: softmax router with the load-balancing
//! loss, FP8 expert GEMMs, E4M3 forward and E5M2 gradients) is built as full-layer graphs by
//! the graphed-callables runtime: two microbatches per step, both forwards then both
//! backwards, one graph per pass, the grouped GEMMs reading each microbatch's per-expert
//! token counts on the device. The activations and gradients are cast with current scaling
//! (each tensor's own amax), the expert weights with per-expert delayed scales; the weight
//! gradients are the step's ([`MoeLayer::with_step_gradients`]).
//!
//! First the graphed step is checked against an eager run of an identical layer, bit for
//! bit (outputs, input gradients, weight gradients). Then the layer learns a fixed
//! regression (`target = 0.25 x`, loss `0.5 / T * sum (y - target)^2` over both
//! microbatches) with AdamW on the device ([`MoeAdamW`]), which also writes the FP8 expert
//! weights ([`MoeLayer::with_fp8_weights_from_optimizer`]: no forward casts them); each step
//! ends with the scale update, then the optimizer step. The loss must fall; the example exits
//! non-zero otherwise.
//!
//! `cargo run --release --example moe_training` (needs an NVIDIA GPU and driver).

use std::sync::Arc;

use cuda_graph::half::bf16;
use cuda_graph::{Context, DeviceBuffer, Stream};
use fp8_kernels::{AdamW, AmaxAlgo, CastScaling, DelayedScaling};
use fp8_moe::moe::layer::{
    ExpertGemm, Fp8Recipe, GradDtype, MoeLayer, MoeLayerConfig, MoeParams, WeightGrad, formats,
};
use fp8_moe::moe::optim::MoeAdamW;
use fp8_moe::moe::routing::{RouterConfig, ScoreFn};
use fp8_moe::rng::Rng;
use graphed_callables::{Callable, GraphIndex, GraphedCallables, GraphedOptions, Schedule, Slot};

type BoxError = Box<dyn std::error::Error>;

const CFG: MoeLayerConfig = MoeLayerConfig {
    tokens: 256,
    hidden: 128,
    ffn: 128,
    experts: 4,
    router: RouterConfig {
        top_k: 2,
        score: ScoreFn::Softmax,
        renormalize: false,
        aux_coef: 1e-2,
        z_coef: 0.0,
    },
    recipe: Fp8Recipe::Hybrid,
    expert_gemm: ExpertGemm::Grouped,
    scaling: CastScaling::Current,
    grad_dtype: GradDtype::F32,
};
const MICROBATCHES: usize = 2;
const STEPS: usize = 12;
/// AdamW's hyperparameters for the regression.
const ADAMW: AdamW = AdamW {
    lr: 3e-3,
    beta1: 0.9,
    beta2: 0.99,
    eps: 1e-8,
    weight_decay: 0.0,
};

fn bf16s(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// A layer with `params` and its own scaling state: the expert weights' scales set from their
/// amax (`448 / amax`, E4M3; then delayed, from the amax the optimizer records), the rest
/// computed per tensor (current scaling). Its FP8 weights come from the optimizer.
fn layer(stream: &Stream, params: &MoeParams) -> Result<(MoeLayer, Arc<DelayedScaling>), BoxError> {
    let fmts = formats(CFG.recipe, CFG.experts);
    let scaling = Arc::new(DelayedScaling::new(
        stream,
        &fmts,
        1,
        0,
        AmaxAlgo::MostRecent,
    )?);
    let (e, h, f) = (CFG.experts, CFG.hidden, CFG.ffn);
    let amax = |w: &[f32]| w.iter().fold(0f32, |m, v| m.max(v.abs()));
    // Tensors 4.. are W1 of each expert, then W2 of each (see `formats`).
    for x in 0..e {
        let w1 = &params.w1[x * 2 * f * h..(x + 1) * 2 * f * h];
        let w2 = &params.w2[x * h * f..(x + 1) * h * f];
        scaling.scale(4 + x)?.write(stream, 448.0 / amax(w1))?;
        scaling.scale(4 + e + x)?.write(stream, 448.0 / amax(w2))?;
    }
    let layer = MoeLayer::new(stream, CFG, params, scaling.clone(), 0)?
        .with_step_gradients(true)
        .with_fp8_weights_from_optimizer(stream, true)?;
    Ok((layer, scaling))
}

/// The weight gradients of a layer, as shared handles (they outlive the box the runtime
/// takes).
struct Grads([WeightGrad; 3]);

impl Grads {
    fn of(l: &MoeLayer) -> Grads {
        Grads([
            l.fc1().1.share(),
            l.fc2().1.share(),
            WeightGrad::F32(l.router_weight().1.share()),
        ])
    }

    /// The three weight gradients, read back.
    fn read(&self, s: &Stream) -> Result<Vec<Vec<f32>>, BoxError> {
        Ok(self
            .0
            .iter()
            .map(|g| g.to_f32_vec(s))
            .collect::<cuda_graph::Result<_>>()?)
    }
}

/// The loss `0.5 / T * sum (y - target)^2` of one microbatch, and its gradient
/// `(y - target) / T` as bf16.
fn loss_and_grad(y: &[bf16], target: &[f32]) -> (f64, Vec<bf16>) {
    let t = CFG.tokens as f32;
    let mut loss = 0f64;
    let dy = y
        .iter()
        .zip(target)
        .map(|(y, t_)| {
            let d = y.to_f32() - t_;
            loss += f64::from(d * d);
            bf16::from_f32(d / t)
        })
        .collect();
    (0.5 * loss / f64::from(t), dy)
}

fn main() -> Result<(), BoxError> {
    let ctx = Context::default_device()?;
    let stream = Stream::new(&ctx)?;
    let (t, h, f, e) = (CFG.tokens, CFG.hidden, CFG.ffn, CFG.experts);
    let params = MoeParams {
        wr: Rng::new(1, 0).vec(e * h, 0.1),
        w1: Rng::new(2, 0).vec(e * 2 * f * h, 0.1),
        w2: Rng::new(3, 0).vec(e * h * f, 0.1),
    };
    // The data: a fixed input per microbatch, the target a quarter of it.
    let xs_host: Vec<Vec<f32>> = (0..MICROBATCHES)
        .map(|m| Rng::new(10 + m as u64, 0).vec(t * h, 1.0))
        .collect();
    let targets: Vec<Vec<f32>> = xs_host
        .iter()
        .map(|x| {
            x.iter()
                .map(|v| 0.25 * bf16::from_f32(*v).to_f32())
                .collect()
        })
        .collect();
    let xs: Vec<DeviceBuffer<bf16>> = xs_host
        .iter()
        .map(|x| DeviceBuffer::from_host(&stream, &bf16s(x)))
        .collect::<cuda_graph::Result<_>>()?;

    // The graphed layer: full-layer graphs under the schedule [1, 1, -1, -1].
    let (graphed_layer, scaling) = layer(&stream, &params)?;
    let grads = Grads::of(&graphed_layer);
    // The optimizer keeps handles to the layer's weights: it works after the layer moved into
    // the runtime.
    let optimizer = MoeAdamW::new(&stream, &graphed_layer, ADAMW)?;
    let schedule = Schedule::new(&[1, 1, -1, -1], vec![1])?;
    let graphed = GraphedCallables::build(
        &stream,
        vec![Box::new(graphed_layer) as Box<dyn Callable<bf16>>],
        &[vec![&xs[0]]],
        GraphedOptions::new(schedule),
    )?;
    // One training step through the graphs: the forwards, then the backwards with the loss's
    // gradient; returns the step's loss and, for the check, every output and input gradient.
    let graphed_step = || -> Result<(f64, Vec<Vec<bf16>>), BoxError> {
        let (mut loss, mut seen, mut dys) = (0.0, Vec::new(), Vec::new());
        for (m, x) in xs.iter().enumerate() {
            let y = graphed.forward(0, m, &[x], &stream)?[0].to_vec(&stream)?;
            let (l, dy) = loss_and_grad(&y, &targets[m]);
            loss += l;
            dys.push(DeviceBuffer::from_host(&stream, &dy)?);
            seen.push(y);
        }
        for (m, dy) in dys.iter().enumerate() {
            seen.push(graphed.backward(0, m, &[dy], &stream)?[0].to_vec(&stream)?);
        }
        Ok((loss, seen))
    };

    // The same step eagerly, on an identical layer.
    let (mut eager, _) = layer(&stream, &params)?;
    let eager_grads = Grads::of(&eager);
    let saved: Vec<Vec<DeviceBuffer<u8>>> = (0..MICROBATCHES)
        .map(|_| {
            eager
                .saved_bytes()
                .iter()
                .map(|&n| DeviceBuffer::<u8>::alloc(&ctx, n))
                .collect()
        })
        .collect::<cuda_graph::Result<_>>()?;
    let (ys, dxs): (Vec<_>, Vec<_>) = (0..MICROBATCHES)
        .map(|_| {
            Ok::<_, cuda_graph::Error>((
                DeviceBuffer::<bf16>::alloc(&ctx, t * h)?,
                DeviceBuffer::<bf16>::alloc(&ctx, t * h)?,
            ))
        })
        .collect::<cuda_graph::Result<Vec<_>>>()?
        .into_iter()
        .unzip();
    let slot = |m: usize| {
        let at = GraphIndex {
            chunk: 0,
            microbatch: m,
            layer: 0,
        };
        Slot::new(at, vec![&xs[m]], vec![&ys[m]], saved[m].iter().collect())
    };
    let mut eager_seen = Vec::new();
    let mut dys = Vec::new();
    for m in 0..MICROBATCHES {
        if m == 0 {
            eager.cast_weights(&stream, &slot(0))?;
        }
        eager.forward(&stream, &[&xs[m]], &[&ys[m]], &slot(m))?;
        let y = ys[m].to_vec(&stream)?;
        dys.push(DeviceBuffer::from_host(
            &stream,
            &loss_and_grad(&y, &targets[m]).1,
        )?);
        eager_seen.push(y);
    }
    for m in 0..MICROBATCHES {
        eager.backward(&stream, &[&dys[m]], &[&dxs[m]], &slot(m))?;
        eager_seen.push(dxs[m].to_vec(&stream)?);
    }

    let (first_loss, seen) = graphed_step()?;
    let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    if seen
        .iter()
        .map(|v| bits(v))
        .ne(eager_seen.iter().map(|v| bits(v)))
    {
        return Err("the graphed step's outputs or input gradients differ from eager".into());
    }
    let same_bits = |a: &[f32], b: &[f32]| {
        a.iter()
            .map(|x| x.to_bits())
            .eq(b.iter().map(|x| x.to_bits()))
    };
    let (g, ge) = (grads.read(&stream)?, eager_grads.read(&stream)?);
    if g.iter().zip(&ge).any(|(a, b)| !same_bits(a, b)) {
        return Err("the graphed step's weight gradients differ from eager".into());
    }
    println!("step 0: loss {first_loss:.6} (graphed == eager, bit for bit)");

    // Training.
    let mut loss = first_loss;
    for step in 1..=STEPS {
        scaling.update(&stream)?;
        optimizer.step(&stream, None)?;
        loss = graphed_step()?.0;
        if !loss.is_finite() {
            return Err(format!("step {step}: loss {loss}").into());
        }
        println!("step {step}: loss {loss:.6}");
    }
    stream.synchronize()?;
    if loss >= first_loss {
        return Err(format!("the loss did not fall: {first_loss} -> {loss}").into());
    }
    println!("loss {first_loss:.6} -> {loss:.6} over {STEPS} steps");
    Ok(())
}
