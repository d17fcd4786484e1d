//! The MLP part of the soak: the FP8 MLP stack of `bench graphed` (4 [`Fp8Linear`] layers
//! with bias, 128 -> 256 -> 128 -> 256 -> 128 features, 16 tokens, one delayed-scaling state
//! updated after every forward and backward) under the schedule `[1, 1, 1, -1, -1, -1]`,
//! one graph per step (layers merged, static weight casts), and the same stack run eagerly.
//!
//! The two stacks start equal and are fed the same new inputs and output gradients every
//! step, so their whole state (weight and bias gradients, which accumulate, and the amax
//! histories and scales) evolves identically step after step; every step that holds a
//! replay whose number is a multiple of `check_every` compares, bit for bit, every
//! microbatch's output and input gradient, every gradient and the scaling state
//! (tests/fp8_mlp.rs shows graphed == eager bit for bit). A divergence on any step, checked
//! or not, stays in the accumulated gradients or the scaling state and shows at the next
//! check.

use std::sync::Arc;

use cuda_graph::{Context, DeviceBuffer, GraphPool, Stream};
use fp8_kernels::{AmaxAlgo, DelayedScaling, Fp8Format, IdentityGroup};
use fp8_moe::linear::{self, Fp8Linear};
use graphed_callables::{
    Callable, GraphIndex, GraphedCallables, GraphedOptions, Schedule, Slot, Step,
};

use super::{Rng, Stats, diff_problem};
use crate::bench::BenchResult;

/// Tokens per microbatch.
pub const TOKENS: usize = 16;
/// The stack's narrow and wide features.
pub const NARROW: usize = 128;
/// See [`NARROW`].
pub const WIDE: usize = 256;
/// Layers of the stack.
pub const LAYERS: usize = 4;
const MICROBATCHES: usize = 3;
const ORDER: [i64; 6] = [1, 1, 1, -1, -1, -1];
/// Replays (graph launches: a forward or a backward of a microbatch) per training step.
pub const REPLAYS_PER_STEP: u64 = ORDER.len() as u64;
const HISTORY: usize = 16;

/// Input and output features of `layer`.
fn widths(layer: usize) -> (usize, usize) {
    if layer % 2 == 0 {
        (NARROW, WIDE)
    } else {
        (WIDE, NARROW)
    }
}

fn scaling(stream: &Stream) -> BenchResult<Arc<DelayedScaling>> {
    let formats: Vec<Fp8Format> = (0..LAYERS).flat_map(|_| linear::FORMATS).collect();
    Ok(Arc::new(DelayedScaling::new(
        stream,
        &formats,
        HISTORY,
        0,
        AmaxAlgo::Max,
    )?))
}

/// The stack's initial weights and biases, per layer.
struct Init {
    weights: Vec<Vec<f32>>,
    biases: Vec<Vec<f32>>,
}

impl Init {
    fn new(rng: &mut Rng) -> Init {
        let (mut weights, mut biases) = (Vec::new(), Vec::new());
        for l in 0..LAYERS {
            let (i, o) = widths(l);
            weights.push((0..i * o).map(|_| rng.uniform(0.03)).collect());
            biases.push((0..o).map(|_| rng.uniform(0.1)).collect());
        }
        Init { weights, biases }
    }

    fn layers(
        &self,
        stream: &Stream,
        scaling: &Arc<DelayedScaling>,
    ) -> BenchResult<Vec<Fp8Linear>> {
        (0..LAYERS)
            .map(|l| {
                let (i, o) = widths(l);
                Ok(Fp8Linear::new(
                    stream,
                    TOKENS,
                    i,
                    o,
                    &self.weights[l],
                    Some(&self.biases[l]),
                    scaling.clone(),
                    l * linear::TENSORS,
                )?)
            })
            .collect()
    }
}

/// The eager stack: layers, scaling state, and its buffers.
struct Eager {
    schedule: Schedule,
    layers: Vec<Fp8Linear>,
    scaling: Arc<DelayedScaling>,
    bufs: EagerBuffers,
}

/// Per microbatch and layer, the buffers the runtime keeps for its graphs: outputs, input
/// gradients, saved activations.
struct EagerBuffers {
    outs: Vec<Vec<DeviceBuffer<f32>>>,
    dxs: Vec<Vec<DeviceBuffer<f32>>>,
    saved: Vec<Vec<Vec<DeviceBuffer<u8>>>>,
    pool: GraphPool,
}

impl EagerBuffers {
    /// The slot of layer `l` of microbatch `mb` with input `x`.
    fn slot<'a>(&'a self, mb: usize, l: usize, x: &'a DeviceBuffer<f32>) -> Slot<'a, f32> {
        let at = GraphIndex {
            chunk: 0,
            microbatch: mb,
            layer: l,
        };
        Slot::new(
            at,
            vec![x],
            vec![&self.outs[mb][l]],
            self.saved[mb][l].iter().collect(),
        )
        .with_pool(&self.pool)
    }
}

impl Eager {
    fn new(ctx: &Arc<Context>, stream: &Stream, init: &Init) -> BenchResult<Eager> {
        let scaling = scaling(stream)?;
        let layers = init.layers(stream, &scaling)?;
        let zeros = |n: usize| DeviceBuffer::<f32>::from_host(stream, &vec![0f32; n]);
        let (mut outs, mut dxs, mut saved) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..MICROBATCHES {
            let (mut o, mut d, mut s) = (Vec::new(), Vec::new(), Vec::new());
            for layer in &layers {
                let (i, w) = (layer.in_features(), layer.out_features());
                o.push(zeros(TOKENS * w)?);
                d.push(zeros(TOKENS * i)?);
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
        Ok(Eager {
            schedule: Schedule::new(&ORDER, vec![LAYERS])?,
            layers,
            scaling,
            bufs: EagerBuffers {
                outs,
                dxs,
                saved,
                pool: GraphPool::new(ctx, 256)?,
            },
        })
    }

    /// One training step in the schedule's order, as the graphed runtime runs it: each
    /// microbatch's forward (weights cast on microbatch 0) then a scale update, then each
    /// backward then a scale update. `xs[mb]` and `dys[mb]` are the step's data.
    fn step(
        &mut self,
        stream: &Stream,
        xs: &[DeviceBuffer<f32>],
        dys: &[DeviceBuffer<f32>],
    ) -> BenchResult<()> {
        let Eager {
            schedule,
            layers,
            scaling,
            bufs,
        } = self;
        for &st in schedule.steps() {
            let mb = st.microbatch();
            match st {
                Step::Forward { .. } => {
                    for (l, layer) in layers.iter_mut().enumerate() {
                        let x = if l == 0 {
                            &xs[mb]
                        } else {
                            &bufs.outs[mb][l - 1]
                        };
                        let slot = bufs.slot(mb, l, x);
                        if mb == 0 {
                            layer.cast_weights(stream, &slot)?;
                        }
                        layer.forward(stream, &[x], &[&bufs.outs[mb][l]], &slot)?;
                    }
                }
                Step::Backward { .. } => {
                    for (l, layer) in layers.iter_mut().enumerate().rev() {
                        let x = if l == 0 {
                            &xs[mb]
                        } else {
                            &bufs.outs[mb][l - 1]
                        };
                        let g = if l == LAYERS - 1 {
                            &dys[mb]
                        } else {
                            &bufs.dxs[mb][l + 1]
                        };
                        let slot = bufs.slot(mb, l, x);
                        layer.backward(stream, &[g], &[&bufs.dxs[mb][l]], &slot)?;
                    }
                }
                Step::WeightGrad { .. } => return Err("no weight-gradient steps".into()),
            }
            scaling.update(stream)?;
        }
        Ok(())
    }
}

/// The graphed MLP stack, its eager twin and the host side of their data.
pub struct MlpSoak {
    graphed: GraphedCallables<f32>,
    scaling: Arc<DelayedScaling>,
    eager: Eager,
    /// A step's data in one upload: 3 inputs, then 3 output gradients.
    staging: DeviceBuffer<f32>,
    xs: Vec<DeviceBuffer<f32>>,
    dys: Vec<DeviceBuffer<f32>>,
    host: Vec<f32>,
    rng: Rng,
    /// Replays (forward and backward graph launches), checks, mismatches.
    pub stats: Stats,
    /// Training steps run.
    pub steps: u64,
}

impl MlpSoak {
    /// Builds both stacks with weights from `weights_rng` (the graphed one warmed up and
    /// captured, its scaling state restored after warmup by the hooks) and data from `rng`.
    pub fn new(
        ctx: &Arc<Context>,
        stream: &Stream,
        weights_rng: &mut Rng,
        rng: Rng,
    ) -> BenchResult<MlpSoak> {
        let init = Init::new(weights_rng);
        let scaling = scaling(stream)?;
        let layers = init.layers(stream, &scaling)?;
        let mut options =
            GraphedOptions::new(Schedule::new(&ORDER, vec![LAYERS])?).with_merge_layers(true);
        fp8_moe::scaling::install_hooks(&mut options, ctx, &scaling, Arc::new(IdentityGroup))?;
        let (nx, ndy) = (TOKENS * NARROW, TOKENS * widths(LAYERS - 1).1);
        let staging = DeviceBuffer::from_host(stream, &vec![0f32; MICROBATCHES * (nx + ndy)])?;
        let xs = (0..MICROBATCHES)
            .map(|mb| staging.slice(mb * nx..(mb + 1) * nx))
            .collect::<Result<Vec<_>, _>>()?;
        let base = MICROBATCHES * nx;
        let dys = (0..MICROBATCHES)
            .map(|mb| staging.slice(base + mb * ndy..base + (mb + 1) * ndy))
            .collect::<Result<Vec<_>, _>>()?;
        let sample = vec![&xs[0]];
        let samples: Vec<Vec<&DeviceBuffer<f32>>> = (0..LAYERS)
            .map(|l| if l == 0 { sample.clone() } else { vec![] })
            .collect();
        let callables: Vec<Box<dyn Callable<f32>>> = layers
            .into_iter()
            .map(|l| Box::new(l) as Box<dyn Callable<f32>>)
            .collect();
        let graphed = GraphedCallables::build(stream, callables, &samples, options)?;
        let eager = Eager::new(ctx, stream, &init)?;
        stream.synchronize()?;
        let host = vec![0f32; staging.len()];
        Ok(MlpSoak {
            graphed,
            scaling,
            eager,
            staging,
            xs,
            dys,
            host,
            rng,
            stats: Stats::default(),
            steps: 0,
        })
    }

    /// One training step of both stacks on new data (one upload), compared when it holds a
    /// replay whose number is a multiple of `check_every`.
    pub fn step(&mut self, stream: &Stream, check_every: u64) -> BenchResult<()> {
        let (xs, dys) = self.host.split_at_mut(MICROBATCHES * TOKENS * NARROW);
        self.rng.fill_uniform(xs, 2.0);
        self.rng.fill_uniform(dys, 0.5);
        // Waits for the previous step, whose launches read the old data.
        self.staging.copy_from_host(stream, &self.host)?;
        let first = self.stats.replays;
        for &st in self.graphed.schedule().steps() {
            let mb = st.microbatch();
            match st {
                Step::Forward { .. } => {
                    self.graphed.forward(0, mb, &[&self.xs[mb]], stream)?;
                }
                Step::Backward { .. } => {
                    self.graphed.backward(0, mb, &[&self.dys[mb]], stream)?;
                }
                Step::WeightGrad { .. } => return Err("no weight-gradient steps".into()),
            }
        }
        self.eager.step(stream, &self.xs, &self.dys)?;
        self.stats.replays += REPLAYS_PER_STEP;
        self.steps += 1;
        if super::holds_multiple(first, REPLAYS_PER_STEP, check_every) {
            self.check(stream)?;
        }
        Ok(())
    }

    /// Compares the last step of both stacks, bit for bit.
    fn check(&mut self, stream: &Stream) -> BenchResult<()> {
        let mut problems = Vec::new();
        let mut compare =
            |what: String, got: &DeviceBuffer<f32>, want: &DeviceBuffer<f32>| -> BenchResult<()> {
                let (g, w) = (got.to_vec(stream)?, want.to_vec(stream)?);
                problems.extend(diff_problem(&what, &g, &w));
                if let Some(i) = w.iter().position(|v| !v.is_finite()) {
                    problems.push(format!("{what}: eager element {i} is {}", w[i]));
                }
                Ok(())
            };
        for mb in 0..MICROBATCHES {
            let y = &self.graphed.static_outputs(0, mb)?[0];
            compare(
                format!("output of microbatch {mb}"),
                y,
                &self.eager.bufs.outs[mb][LAYERS - 1],
            )?;
            let dx = &self.graphed.static_grad_inputs(0, mb)?[0];
            compare(
                format!("input gradient of microbatch {mb}"),
                dx,
                &self.eager.bufs.dxs[mb][0],
            )?;
        }
        for (l, (g, e)) in self
            .graphed
            .callables()
            .iter()
            .zip(&self.eager.layers)
            .enumerate()
        {
            for (i, (gg, eg)) in g.gradients().into_iter().zip(e.gradients()).enumerate() {
                let name = if i == 0 { "weight" } else { "bias" };
                compare(format!("layer {l} {name} gradient"), gg, eg)?;
            }
        }
        let (g, e) = (&self.scaling, &self.eager.scaling);
        compare(
            "amax history".into(),
            g.history_buffer(),
            e.history_buffer(),
        )?;
        compare("scales".into(), g.scale_buffer(), e.scale_buffer())?;
        compare(
            "inverse scales".into(),
            g.scale_inv_buffer(),
            e.scale_inv_buffer(),
        )?;
        let step = self.steps - 1;
        self.stats
            .record_check(|| format!("MLP step {step}"), problems);
        Ok(())
    }
}
