//! [`Model`]: the byte-level MoE transformer and its training step, eager or under CUDA
//! graphs ([`GraphMode`]).
//!
//! A step runs `microbatches` microbatches, each forward then backward at once (so one set
//! of activations serves them all), then the FP8 scale update, the gradient-norm clip and
//! AdamW:
//!
//! ```text
//! per microbatch m:   h0 = embed[tokens]     h_{l+1} = block_l(h_l)     nf = rmsnorm(h_L)
//!                     logits = nf Whead^T (f32)   loss += sum CE(logits, targets)
//!                     backward of all of it (weight gradients: m = 0 writes, later add)
//! then:               scales from the amaxes; clip factor = min(1, clip / |g|); AdamW
//! ```
//!
//! The loss is the mean cross-entropy over the step's tokens plus each MoE layer's
//! load-balancing loss (`aux_coef / microbatches` per microbatch, so that it too is a mean
//! over the step). Every kernel is deterministic, so every [`GraphMode`] computes the same
//! bits as eager:
//!
//! * [`GraphMode::None`]: eager launches;
//! * [`GraphMode::Breaking`]: the blocks under the graphed-callables runtime with the MoE
//!   layers' per-expert GEMMs: graphs around everything but the experts, which run eagerly
//!   on the row counts read back (TransformerEngine's MoE breaking-layer capture);
//! * [`GraphMode::Layer`]: each block's forward and backward of each microbatch one graph
//!   (the graphed-callables runtime, one graph per layer as TransformerEngine makes them);
//! * [`GraphMode::Step`]: the whole step (every microbatch, the scale update, the clip and
//!   the optimizer) captured once and replayed; the host only writes the batch and the
//!   learning rate before each replay.
//!
//! # Data parallelism
//!
//! [`Model::new_data_parallel`] trains one replica per rank of an NCCL communicator, each on
//! its own microbatches (modes none and step). The gradients are averaged over the ranks in
//! buckets as the last microbatch's backward finishes them: the head's after the head, each
//! block's (its norms, attention and MoE layer) after that block, the embedding's last; each
//! bucket is one NCCL group on a stream forked from the step's (a side stream when eager, a
//! fork of the capture in mode step), so the reductions overlap the rest of the backward.
//! After the joins, each rank max-reduces the FP8 amaxes (TransformerEngine's `fp8_group`:
//! every rank then computes the same scales, those of the union of the ranks' data) and sums
//! the loss; the clip and AdamW then run on identical gradients, so the replicas stay
//! identical. In mode step all of it is part of the captured step graph. `n` ranks of `m`
//! microbatches compute what one GPU computes with `n * m` microbatches, up to the order of
//! the gradient sums.

use std::sync::{Arc, Mutex};

use cuda_graph::half::bf16;
use cuda_graph::{
    CaptureMode, CaptureScope, DeviceBuffer, Error, Event, Graph, GraphExec, InstantiateFlags,
    Result, Stream,
};
use cuda_graph_nccl::{Communicator, ReduceOp};
use fp8_kernels::{AdamW, AmaxAlgo, DelayedScaling, DeviceScalar, Fp8Format, HpBuffer};
use graphed_callables::{
    Callable, GraphIndex, GraphedCallables, GraphedOptions, Schedule, Slot, WarmupRecord,
};
use serde::{Deserialize, Serialize};

use super::attention::Attention;
use super::block::{Block, BlockParams, Norm, scaling_tensors};
use super::config::{ModelConfig, TrainConfig, VOCAB};
use super::dense::{Dense, DenseSaved};
use super::ops::{Ops, grad_norm_workspace_len, rmsnorm_backward_workspace_len};
use super::optim::ModelOptimizer;
use super::zeroed;
use crate::moe::layer::{ExpertGemm, MoeParams};
use crate::moe::optim::MoeAdamW;
use crate::rng::Rng;
use crate::scaling::ScalingSnapshot;

/// The amax history length of the FP8 state.
const HISTORY: usize = 16;

/// How a training step runs; see the [module documentation](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum GraphMode {
    /// Eager launches.
    None,
    /// MoE breaking-layer graphs: everything but the experts graphed.
    Breaking,
    /// Each block's forward and backward one graph (graphed-callables runtime).
    Layer,
    /// The whole training step one graph.
    Step,
}

impl GraphMode {
    /// Every mode, eager first.
    pub const ALL: [GraphMode; 4] = [
        GraphMode::None,
        GraphMode::Breaking,
        GraphMode::Layer,
        GraphMode::Step,
    ];

    /// The name the CLI takes.
    pub fn name(self) -> &'static str {
        match self {
            GraphMode::None => "none",
            GraphMode::Breaking => "breaking",
            GraphMode::Layer => "layer",
            GraphMode::Step => "step",
        }
    }
}

/// Indices into the step's statistics buffer.
const LOSS: usize = 0;
const GRAD_NORM: usize = 1;
const CLIP: usize = 2;
const EVAL: usize = 3;
const STATS: usize = 4;

/// What one step reports (read back after it).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    /// Mean cross-entropy over the step's tokens (nats).
    pub loss: f32,
    /// The gradients' global L2 norm before clipping.
    pub grad_norm: f32,
}

/// Per-microbatch inputs.
#[derive(Debug)]
struct Batch {
    tokens: DeviceBuffer<i32>,
    targets: DeviceBuffer<i32>,
}

/// The head's buffers (one microbatch at a time).
#[derive(Debug)]
struct Head {
    norm: Norm,
    dense: Dense,
    saved: DenseSaved,
    rstd: DeviceBuffer<f32>,
    nf: DeviceBuffer<bf16>,
    logits: DeviceBuffer<f32>,
    dlogits: DeviceBuffer<bf16>,
    loss_rows: DeviceBuffer<f32>,
    dnf: DeviceBuffer<bf16>,
    norm_ws: DeviceBuffer<f32>,
}

/// The blocks, driven by the model (eager, step graph) or by the runtime.
enum Blocks {
    Direct {
        blocks: Vec<Block>,
        /// `h_0 .. h_L` of the current microbatch.
        hidden: Vec<DeviceBuffer<bf16>>,
        /// Per block, its saved buffers (one microbatch at a time).
        saved: Vec<Vec<DeviceBuffer<u8>>>,
    },
    Graphed(Box<GraphedCallables<bf16>>),
}

/// The model and its training state; see the [module documentation](self).
///
/// ```no_run
/// use cuda_graph::{Context, Stream};
/// use fp8_moe::model::{GraphMode, Model, ModelConfig, TrainConfig};
///
/// let ctx = Context::default_device()?;
/// let stream = Stream::new(&ctx)?;
/// let (cfg, train) = (ModelConfig::default(), TrainConfig::default());
/// let mut model = Model::new(&stream, cfg, train, GraphMode::Step)?;
/// // A step's batch: `microbatches` microbatches of `batch` sequences of `context` bytes.
/// let n = cfg.tokens() * train.microbatches;
/// let (tokens, targets) = (vec![b'a' as i32; n], vec![b'a' as i32; n]);
/// for step in 0..train.steps {
///     model.load_batch(&stream, &tokens, &targets)?;
///     model.step(&stream, train.lr_at(step))?; // one graph replay
/// }
/// println!("loss {}", model.stats(&stream)?.loss);
/// let sample = model.generate(&stream, b"fn ", 100, 0.8, 1)?;
/// # Ok::<(), cuda_graph::Error>(())
/// ```
pub struct Model {
    cfg: ModelConfig,
    train: TrainConfig,
    mode: GraphMode,
    ops: Arc<Ops>,
    scaling: Arc<DelayedScaling>,
    embed: Norm,
    head: Head,
    blocks: Blocks,
    /// Backward ping-pong `[T, d]` gradients through the blocks.
    dh: [DeviceBuffer<bf16>; 2],
    batches: Vec<Batch>,
    stats: DeviceBuffer<f32>,
    grad_ws: DeviceBuffer<f32>,
    /// The FP8 state saved around evaluation and generation, whose casts record amaxes.
    snapshot: ScalingSnapshot,
    optim: ModelOptimizer,
    /// The step graph (mode step) and its exec.
    step_graph: Option<(Graph, GraphExec)>,
    steps_done: usize,
    /// Data parallelism: the communicator over the replicas and the gradient buckets.
    dp: Option<DataParallel>,
}

/// A data-parallel replica's reduction state.
struct DataParallel {
    comm: Communicator,
    /// Indices into [`grads_of`]'s list, per bucket, in the order the backward finishes
    /// them: the head's (final norm and LM head), each block's, the embedding's.
    head: Vec<usize>,
    blocks: Vec<Vec<usize>>,
    embed: Vec<usize>,
    /// Eager steps: the stream the reductions run on beside the backward, and the event
    /// that orders it after the work it reduces.
    side: Stream,
    event: Arc<Event>,
}

impl DataParallel {
    fn new(
        stream: &Stream,
        comm: Communicator,
        optim: &ModelOptimizer,
        layers: usize,
    ) -> Result<DataParallel> {
        let (mut head, mut blocks, mut embed) = (Vec::new(), vec![Vec::new(); layers], Vec::new());
        let mut i = 0;
        for p in optim.dense() {
            match p.name.strip_prefix("blocks.") {
                Some(rest) => {
                    let l: usize = rest
                        .split('.')
                        .next()
                        .and_then(|l| l.parse().ok())
                        .filter(|&l| l < layers)
                        .ok_or_else(|| {
                            Error::InvalidArgument(format!("parameter {} names no block", p.name))
                        })?;
                    blocks[l].push(i);
                }
                None if p.name == "embed" => embed.push(i),
                None => head.push(i),
            }
            i += 1;
        }
        for (l, m) in optim.moe().iter().enumerate() {
            let n = m.gradients().len();
            blocks[l].extend(i..i + n);
            i += n;
        }
        // Every gradient the optimizer steps is in exactly one bucket.
        if i != grads_of(optim).len() {
            return Err(Error::InvalidArgument(format!(
                "data parallelism: {i} gradients in buckets, the optimizer has {}",
                grads_of(optim).len()
            )));
        }
        Ok(DataParallel {
            comm,
            head,
            blocks,
            embed,
            side: Stream::new(stream.context())?,
            event: Arc::new(Event::new(stream.context())?),
        })
    }

    /// Averages the gradients `bucket` names (of `grads`) over the ranks, as one NCCL group
    /// on a stream forked from `origin` after the work enqueued so far.
    fn reduce(
        &self,
        grads: &[HpBuffer<'_>],
        bucket: &[usize],
        side: &mut Side<'_, '_>,
        origin: &Stream,
    ) -> Result<()> {
        let s = side.fork(origin)?;
        let comm = &self.comm;
        cuda_graph_nccl::group(|| {
            for &i in bucket {
                match grads[i] {
                    HpBuffer::F32(b) => comm.all_reduce_in_place(b, ReduceOp::Avg, &s)?,
                    HpBuffer::F16(b) => comm.all_reduce_in_place(b, ReduceOp::Avg, &s)?,
                    HpBuffer::Bf16(b) => comm.all_reduce_in_place(b, ReduceOp::Avg, &s)?,
                }
            }
            Ok(())
        })?;
        Ok(())
    }
}

/// Where the gradient reductions run beside the backward: the replica's side stream when
/// eager, forks of the capture when the step is captured.
enum Side<'a, 's> {
    Eager {
        side: Stream,
        event: Arc<Event>,
    },
    Capture {
        scope: &'a mut CaptureScope<'s>,
        forks: Vec<Stream>,
    },
}

impl Side<'_, '_> {
    /// A stream that runs after the work enqueued on `origin` so far.
    fn fork(&mut self, origin: &Stream) -> Result<Stream> {
        match self {
            Side::Eager { side, event } => {
                event.record(origin)?;
                side.wait_event(event)?;
                Ok(side.clone())
            }
            Side::Capture { scope, forks } => {
                let f = scope.fork()?;
                forks.push(f.clone());
                Ok(f)
            }
        }
    }

    /// `origin` waits for everything enqueued on the forks.
    fn join(&mut self, origin: &Stream) -> Result<()> {
        match self {
            Side::Eager { side, event } => {
                event.record(side)?;
                origin.wait_event(event)
            }
            Side::Capture { scope, forks } => {
                for f in forks.drain(..) {
                    scope.join(&f)?;
                }
                Ok(())
            }
        }
    }
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("cfg", &self.cfg)
            .field("mode", &self.mode)
            .field("steps_done", &self.steps_done)
            .finish()
    }
}

/// The initial weights of a model of `cfg` from `seed` (host, f32): embedding uniform with
/// standard deviation 1, matrices 0.02 (output projections and fc2 divided by `sqrt(2L)`,
/// GPT-2's rule), the router 0.02.
pub fn init_params(cfg: &ModelConfig, seed: u64) -> (Vec<f32>, Vec<BlockParams>, Vec<f32>) {
    let (d, e, f) = (cfg.d_model, cfg.experts, cfg.ffn);
    // Uniform in [-a, a) has standard deviation a / sqrt(3).
    let u = |std: f32| std * 3f32.sqrt();
    let resid = u(0.02) / (2.0 * cfg.layers as f32).sqrt();
    let mut rng = Rng::new(seed, 0x14);
    let embed = rng.vec(VOCAB * d, u(1.0));
    let blocks = (0..cfg.layers)
        .map(|_| BlockParams {
            wqkv: rng.vec(3 * d * d, u(0.02)),
            wo: rng.vec(d * d, resid),
            moe: MoeParams {
                wr: rng.vec(e * d, u(0.02)),
                w1: rng.vec(e * 2 * f * d, u(0.02)),
                w2: rng.vec(e * d * f, resid),
            },
        })
        .collect();
    let head = rng.vec(VOCAB * d, u(0.02));
    (embed, blocks, head)
}

impl Model {
    /// A model of `cfg` with weights from `train.seed`, whose steps run as `mode`. Builds
    /// (and, in the graphed modes, warms up and captures) everything a step needs; waits.
    pub fn new(
        stream: &Stream,
        cfg: ModelConfig,
        train: TrainConfig,
        mode: GraphMode,
    ) -> Result<Model> {
        Model::build(stream, cfg, train, mode, None)
    }

    /// [`new`](Self::new) for one replica of a data-parallel job over `comm`'s ranks (see the
    /// [module documentation](self#data-parallelism)): every rank builds its model with the
    /// same configuration (the seed included), then loads its own microbatches and steps
    /// with the others. Modes none and step.
    ///
    /// Errors: as [`new`](Self::new); [`Error::InvalidArgument`] for modes layer and
    /// breaking; in mode step, NCCL's errors while the step is captured.
    pub fn new_data_parallel(
        stream: &Stream,
        cfg: ModelConfig,
        train: TrainConfig,
        mode: GraphMode,
        comm: Communicator,
    ) -> Result<Model> {
        if !matches!(mode, GraphMode::None | GraphMode::Step) {
            return Err(Error::InvalidArgument(format!(
                "data parallelism runs in graph modes none and step, not {}",
                mode.name()
            )));
        }
        Model::build(stream, cfg, train, mode, Some(comm))
    }

    fn build(
        stream: &Stream,
        cfg: ModelConfig,
        train: TrainConfig,
        mode: GraphMode,
        dp: Option<Communicator>,
    ) -> Result<Model> {
        cfg.check()?;
        train.check()?;
        let ctx = stream.context().clone();
        let (t, d, m) = (cfg.tokens(), cfg.d_model, train.microbatches);
        let ops = Arc::new(Ops::new(&ctx)?);
        let attention = Arc::new(Attention::new(&ctx)?);
        let per_block = scaling_tensors(&cfg);
        let mut formats: Vec<Fp8Format> = Vec::new();
        for _ in 0..cfg.layers {
            formats.extend(crate::linear::FORMATS);
            formats.extend(crate::linear::FORMATS);
            formats.extend(crate::moe::layer::formats(
                crate::moe::layer::Fp8Recipe::Hybrid,
                cfg.experts,
            ));
        }
        let head_tensor = formats.len();
        formats.extend(crate::linear::FORMATS);
        let scaling = Arc::new(DelayedScaling::new(
            stream,
            &formats,
            HISTORY,
            0,
            AmaxAlgo::Max,
        )?);
        let (embed_w, block_params, head_w) = init_params(&cfg, train.seed);
        // The aux loss is a mean over the step's microbatches, like the cross-entropy.
        let block_cfg = ModelConfig {
            aux_coef: cfg.aux_coef / m as f32,
            ..cfg
        };
        let expert_gemm = match mode {
            GraphMode::Breaking => ExpertGemm::PerExpert,
            _ => ExpertGemm::Grouped,
        };
        let blocks = block_params
            .iter()
            .enumerate()
            .map(|(l, p)| {
                Block::new(
                    stream,
                    &block_cfg,
                    p,
                    (ops.clone(), attention.clone()),
                    scaling.clone(),
                    l * per_block,
                    expert_gemm,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let hyper = AdamW {
            lr: train.lr,
            beta1: train.betas.0,
            beta2: train.betas.1,
            eps: train.eps,
            weight_decay: train.weight_decay,
        };
        let embed = Norm::new(stream, &embed_w)?;
        let head_dense = Dense::new(stream, (t, d, VOCAB), &head_w, scaling.clone(), head_tensor)?;
        let act = |n: usize| zeroed::<bf16>(stream, n);
        let head = Head {
            norm: Norm::new(stream, &vec![1.0; d])?,
            saved: DenseSaved::alloc(stream, &head_dense)?,
            dense: head_dense,
            rstd: zeroed(stream, t)?,
            nf: act(t * d)?,
            logits: zeroed(stream, t * VOCAB)?,
            dlogits: act(t * VOCAB)?,
            loss_rows: zeroed(stream, t)?,
            dnf: act(t * d)?,
            norm_ws: zeroed(stream, rmsnorm_backward_workspace_len(t, d).max(1))?,
        };
        // Optimizer: handles to every parameter, taken before the blocks move anywhere.
        let mut dense = vec![(
            "embed".to_string(),
            embed.w.share(),
            embed.dw.share(),
            false,
        )];
        let mut moe_opts = Vec::new();
        for (l, b) in blocks.iter().enumerate() {
            for (name, w, g) in b.dense_params() {
                let decay = name.starts_with('w');
                dense.push((format!("blocks.{l}.{name}"), w.share(), g.share(), decay));
            }
            moe_opts.push(MoeAdamW::new(stream, &b.moe, hyper)?);
        }
        dense.push((
            "norm_f".into(),
            head.norm.w.share(),
            head.norm.dw.share(),
            false,
        ));
        dense.push((
            "head".into(),
            head.dense.weight().share(),
            head.dense.weight_grad().share(),
            true,
        ));
        let optim = ModelOptimizer::new(stream, hyper, dense, moe_opts)?;
        let grad_lens: Vec<usize> = grads_of(&optim).iter().map(|g| g.len()).collect();
        let batches = (0..m)
            .map(|_| {
                Ok(Batch {
                    tokens: zeroed(stream, t)?,
                    targets: zeroed(stream, t)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let blocks = match mode {
            GraphMode::None | GraphMode::Step => {
                let saved = blocks
                    .iter()
                    .map(|b| {
                        b.saved_bytes()
                            .iter()
                            .map(|&n| zeroed::<u8>(stream, n))
                            .collect::<Result<Vec<_>>>()
                    })
                    .collect::<Result<Vec<_>>>()?;
                Blocks::Direct {
                    hidden: (0..=cfg.layers)
                        .map(|_| act(t * d))
                        .collect::<Result<_>>()?,
                    blocks,
                    saved,
                }
            }
            GraphMode::Layer | GraphMode::Breaking => {
                Blocks::Graphed(Box::new(build_runtime(stream, &scaling, blocks, m, mode)?))
            }
        };
        let mut model = Model {
            cfg,
            train,
            mode,
            ops,
            embed,
            head,
            blocks,
            dh: [act(t * d)?, act(t * d)?],
            batches,
            stats: zeroed(stream, STATS)?,
            grad_ws: zeroed(stream, grad_norm_workspace_len(&grad_lens).max(1))?,
            snapshot: ScalingSnapshot::new(&ctx, &scaling)?,
            optim,
            step_graph: None,
            steps_done: 0,
            scaling,
            dp: None,
        };
        if let Some(comm) = dp {
            model.dp = Some(DataParallel::new(stream, comm, &model.optim, cfg.layers)?);
        }
        stream.synchronize()?;
        if mode == GraphMode::Step {
            model.capture_step(stream)?;
        }
        Ok(model)
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The run's settings.
    pub fn train_config(&self) -> &TrainConfig {
        &self.train
    }

    /// How steps run.
    pub fn mode(&self) -> GraphMode {
        self.mode
    }

    /// Optimizer steps taken.
    pub fn steps_done(&self) -> usize {
        self.steps_done
    }

    /// The FP8 scaling state.
    pub fn scaling(&self) -> &Arc<DelayedScaling> {
        &self.scaling
    }

    /// The optimizer (parameters, moments and states).
    pub fn optimizer(&self) -> &ModelOptimizer {
        &self.optim
    }

    /// Writes a step's batch: `tokens` and `targets` hold `microbatches * tokens` ids each
    /// (microbatch-major; each microbatch `batch` sequences of `context`), every id below
    /// 256. Enqueued on `stream` (host-to-device copies).
    pub fn load_batch(&self, stream: &Stream, tokens: &[i32], targets: &[i32]) -> Result<()> {
        let t = self.cfg.tokens();
        check_ids(
            "Model::load_batch",
            "a step",
            tokens,
            targets,
            t * self.batches.len(),
        )?;
        for (m, b) in self.batches.iter().enumerate() {
            b.tokens
                .copy_from_host(stream, &tokens[m * t..(m + 1) * t])?;
            b.targets
                .copy_from_host(stream, &targets[m * t..(m + 1) * t])?;
        }
        Ok(())
    }

    /// Enqueues one training step on the batch [`load_batch`](Self::load_batch) wrote, at
    /// learning rate `lr`. Nothing is read back: [`stats`](Self::stats) reads the step's
    /// loss and gradient norm.
    pub fn step(&mut self, stream: &Stream, lr: f32) -> Result<()> {
        self.optim.set_lr(stream, lr)?;
        match &self.step_graph {
            Some((_, exec)) => exec.launch(stream)?,
            None => match &self.dp {
                Some(dp) => {
                    let mut side = Side::Eager {
                        side: dp.side.clone(),
                        event: dp.event.clone(),
                    };
                    self.enqueue_step(stream, Some(&mut side))?
                }
                None => self.enqueue_step(stream, None)?,
            },
        }
        self.steps_done += 1;
        Ok(())
    }

    /// The last step's loss and gradient norm (waits for it).
    pub fn stats(&self, stream: &Stream) -> Result<StepStats> {
        let s = self.stats.to_vec(stream)?;
        let ranks = self.dp.as_ref().map_or(1, |dp| dp.comm.size());
        let tokens = (self.cfg.tokens() * self.batches.len() * ranks) as f32;
        Ok(StepStats {
            loss: s[LOSS] / tokens,
            grad_norm: s[GRAD_NORM],
        })
    }

    /// Whether the model drives its blocks itself (modes none and step), which
    /// [`evaluate`](Self::evaluate) and [`generate`](Self::generate) need.
    pub fn can_evaluate(&self) -> bool {
        matches!(self.blocks, Blocks::Direct { .. })
    }

    /// The mean cross-entropy of one microbatch (`tokens`, `targets`: `batch * context` ids
    /// each), forward only; nothing of the training state changes (the FP8 amaxes the
    /// forward's casts record are undone). Waits. Needs [`can_evaluate`](Self::can_evaluate).
    pub fn evaluate(&mut self, stream: &Stream, tokens: &[i32], targets: &[i32]) -> Result<f32> {
        let t = self.cfg.tokens();
        check_ids("Model::evaluate", "a microbatch", tokens, targets, t)?;
        self.snapshot.save(stream, &self.scaling)?;
        self.batches[0].tokens.copy_from_host(stream, tokens)?;
        self.batches[0].targets.copy_from_host(stream, targets)?;
        self.forward_only(stream)?;
        let head = &self.head;
        self.ops.cross_entropy(
            stream,
            &head.logits,
            &self.batches[0].targets,
            1.0,
            &head.loss_rows,
            &head.dlogits,
        )?;
        self.ops
            .sum(stream, &head.loss_rows, &self.stats, EVAL, false)?;
        self.snapshot.restore(stream, &self.scaling)?;
        let v = self.stats.slice(EVAL..EVAL + 1)?.to_vec(stream)?;
        Ok(v[0] / t as f32)
    }

    /// Continues `prompt` by `new_tokens` bytes sampled from the model (temperature
    /// `temperature`, greedy at 0; `seed` seeds the sampling), decoding under a CUDA graph:
    /// the forward of one microbatch (the weight casts, every block, the final norm and the
    /// head) is captured once and replayed per token, with the window (the last `context`
    /// bytes) in sequence 0 and the next byte drawn from the logits at its last position.
    /// The FP8 scaling state is left as it was (the casts' amaxes are undone), so training
    /// may continue after. Needs the blocks in the model's hands ([`GraphMode::None`] or
    /// [`GraphMode::Step`]).
    pub fn generate(
        &mut self,
        stream: &Stream,
        prompt: &[u8],
        new_tokens: usize,
        temperature: f32,
        seed: u64,
    ) -> Result<Vec<u8>> {
        if !matches!(self.blocks, Blocks::Direct { .. }) {
            return Err(Error::InvalidArgument(format!(
                "generate: the blocks of a model in mode {} run inside the graphed-callables \
                 runtime; generate from a model in mode none or step (e.g. load this one's \
                 state into it)",
                self.mode.name()
            )));
        }
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "generate: temperature {temperature} must be finite and >= 0"
            )));
        }
        self.snapshot.save(stream, &self.scaling)?;
        let (graph, ()) =
            stream.capture_with(CaptureMode::ThreadLocal, |s| self.forward_only(s.stream()))?;
        let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
        let (s_len, t) = (self.cfg.context, self.cfg.tokens());
        let mut text: Vec<u8> = prompt.to_vec();
        if text.is_empty() {
            text.push(b'\n');
        }
        let mut window = vec![0i32; t];
        let mut rng = Rng::new(seed, 0x6E);
        let mut out = Vec::with_capacity(new_tokens);
        for _ in 0..new_tokens {
            let start = text.len().saturating_sub(s_len);
            let ctx_bytes = &text[start..];
            for (w, &b) in window.iter_mut().zip(ctx_bytes) {
                *w = i32::from(b);
            }
            self.batches[0].tokens.copy_from_host(stream, &window)?;
            exec.launch(stream)?;
            let p = ctx_bytes.len() - 1;
            let row = self
                .head
                .logits
                .slice(p * VOCAB..(p + 1) * VOCAB)?
                .to_vec(stream)?;
            let next = sample(&row, temperature, &mut rng);
            text.push(next);
            out.push(next);
        }
        self.snapshot.restore(stream, &self.scaling)?;
        stream.synchronize()?;
        Ok(out)
    }

    /// The forward of microbatch 0 alone, into the head's logits (generation).
    fn forward_only(&mut self, stream: &Stream) -> Result<()> {
        let Blocks::Direct {
            blocks,
            hidden,
            saved,
        } = &mut self.blocks
        else {
            return Err(Error::InvalidArgument(
                "forward_only: graphed blocks".into(),
            ));
        };
        let b = &self.batches[0];
        self.ops
            .embedding_forward(stream, &b.tokens, &self.embed.w, &hidden[0], VOCAB)?;
        for (l, block) in blocks.iter_mut().enumerate() {
            let slot = direct_slot(0, l, hidden, &saved[l]);
            block.cast_weights(stream, &slot)?;
            block.forward(stream, &[&hidden[l]], &[&hidden[l + 1]], &slot)?;
        }
        let head = &self.head;
        head.dense.cast_weight(stream, None)?;
        self.ops.rmsnorm_forward(
            stream,
            &hidden[blocks.len()],
            &head.norm.w,
            &head.nf,
            &head.rstd,
            self.cfg.norm_eps,
        )?;
        head.dense
            .forward(stream, &head.nf, &head.logits, &head.saved, true)
    }

    /// Every f32 buffer of the training state, named and shaped as checkpoints store them:
    /// the parameters (the f32 masters), AdamW's moments and states, and the FP8 scaling
    /// state. The names are stable (README, "Checkpoints"); the order is the model's.
    pub fn state_tensors(&self) -> Vec<(String, Vec<usize>, &DeviceBuffer<f32>)> {
        let (d, e, f) = (self.cfg.d_model, self.cfg.experts, self.cfg.ffn);
        let mut v = Vec::new();
        for p in self.optim.dense() {
            let shape = dense_shape(&p.name, d);
            for (suffix, buf) in [
                ("", &p.param),
                (".exp_avg", &p.exp_avg),
                (".exp_avg_sq", &p.exp_avg_sq),
            ] {
                let name = match suffix {
                    "" => p.name.clone(),
                    s => format!("optim.{}{s}", p.name),
                };
                v.push((name, shape.clone(), buf));
            }
        }
        for (l, m) in self.optim.moe().iter().enumerate() {
            for (name, buf) in m.named_buffers() {
                let shape = match name.split('.').next() {
                    Some("router") => vec![e, d],
                    Some("fc1") => vec![e, 2 * f, d],
                    _ => vec![e, d, f],
                };
                let full = if name.contains('.') {
                    format!("optim.blocks.{l}.moe.{name}")
                } else {
                    format!("blocks.{l}.moe.{name}")
                };
                v.push((full, shape, buf));
            }
        }
        for (i, s) in self.optim.states().into_iter().enumerate() {
            v.push((format!("optim.state.{i}"), vec![4], s.buffer()));
        }
        let (tensors, hist) = (self.scaling.len(), self.scaling.history_len());
        v.push((
            "fp8.amax_history".into(),
            vec![tensors, hist],
            &**self.scaling.history_buffer(),
        ));
        v.push((
            "fp8.scale".into(),
            vec![tensors],
            &**self.scaling.scale_buffer(),
        ));
        v.push((
            "fp8.scale_inv".into(),
            vec![tensors],
            &**self.scaling.scale_inv_buffer(),
        ));
        v
    }

    /// Writes the training state from `get(name, shape)` (every tensor of
    /// [`state_tensors`](Self::state_tensors), which `get` returns or refuses), then
    /// remakes the MoE layers' bf16 and FP8 expert weights from their masters; the model
    /// then continues exactly as the one that saved the state would. `steps_done` is the
    /// number of steps that state had taken. Waits. Nothing is written unless every tensor
    /// is there with its shape.
    pub fn load_state(
        &mut self,
        stream: &Stream,
        steps_done: usize,
        mut get: impl FnMut(&str, &[usize]) -> Result<Vec<f32>>,
    ) -> Result<()> {
        let tensors = self.state_tensors();
        let mut values = Vec::with_capacity(tensors.len());
        for (name, shape, buf) in &tensors {
            let v = get(name, shape)?;
            if v.len() != buf.len() {
                return Err(Error::InvalidArgument(format!(
                    "state tensor {name}: {} values, the model's has {}",
                    v.len(),
                    buf.len()
                )));
            }
            values.push(v);
        }
        for ((_, _, buf), v) in tensors.iter().zip(&values) {
            buf.copy_from_host(stream, v)?;
        }
        stream.synchronize()?;
        for m in self.optim.moe() {
            m.sync_fp8_weights(stream)?;
        }
        self.steps_done = steps_done;
        Ok(())
    }

    /// Every gradient the clip covers, as the kernels read them.
    fn grads(&self) -> Vec<HpBuffer<'_>> {
        grads_of(&self.optim)
    }

    /// Captures [`enqueue_step`](Self::enqueue_step) into the step graph.
    fn capture_step(&mut self, stream: &Stream) -> Result<()> {
        // The first replay's kernels (module loads, attribute queries) ran in an eager
        // warmup step would change the state; capture directly: every launcher only
        // enqueues, and the modules are loaded.
        let (graph, ()) = stream.capture_with(CaptureMode::ThreadLocal, |s| {
            let origin = s.stream().clone();
            if self.dp.is_some() {
                let mut side = Side::Capture {
                    scope: s,
                    forks: Vec::new(),
                };
                self.enqueue_step(&origin, Some(&mut side))
            } else {
                self.enqueue_step(&origin, None)
            }
        })?;
        let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
        self.step_graph = Some((graph, exec));
        Ok(())
    }

    /// The CUDA graphs a step replays, named: the whole step (mode step); each block's
    /// forward and backward graph of microbatch 0 (mode layer: every microbatch has graphs of
    /// the same shape); the graphed segments around the eager experts (mode breaking,
    /// `graph{i}-{pass}-segment{s}`); none in mode none.
    pub fn graphs(&self) -> Vec<(String, &Graph)> {
        let mut v = Vec::new();
        if let Some((g, _)) = &self.step_graph {
            v.push(("step".to_string(), g));
        }
        if let Blocks::Graphed(rt) = &self.blocks {
            // The first microbatch's graphs (graph indices are microbatch-major).
            for i in 0..rt.num_graphs().min(self.cfg.layers) {
                if self.mode == GraphMode::Layer {
                    for (pass, g) in [
                        ("forward", rt.forward_graph(i)),
                        ("backward", rt.backward_graph(i)),
                    ] {
                        if let Some(g) = g {
                            v.push((format!("graph{i}-{pass}"), g));
                        }
                    }
                    continue;
                }
                // Breaking: the graphed segments around the eager experts.
                for seg in 0..3 {
                    for (pass, g) in [
                        ("forward", rt.forward_segment_graph(i, seg)),
                        ("backward", rt.backward_segment_graph(i, seg)),
                    ] {
                        if let Some(g) = g {
                            v.push((format!("graph{i}-{pass}-segment{seg}"), g));
                        }
                    }
                }
            }
        }
        v
    }

    /// Enqueues a whole step (see the [module documentation](self)).
    /// `side`: where a data-parallel replica reduces its gradients beside the last
    /// microbatch's backward (`None` without data parallelism).
    fn enqueue_step(&mut self, stream: &Stream, mut side: Option<&mut Side<'_, '_>>) -> Result<()> {
        let m = self.batches.len();
        for mb in 0..m {
            let reduce = if mb + 1 == m {
                side.as_deref_mut()
            } else {
                None
            };
            self.microbatch(stream, mb, reduce)?;
        }
        if let (Some(dp), Some(side)) = (&self.dp, side) {
            side.join(stream)?;
            self.reduce_amax_and_loss(&dp.comm, stream)?;
        }
        self.scaling.update(stream)?;
        let grads = self.grads();
        self.ops.grad_norm_clip(
            stream,
            &grads,
            &self.grad_ws,
            self.train.clip,
            &self.stats_view()?,
        )?;
        let factor = DeviceScalar::at(&self.stats_view()?, CLIP - GRAD_NORM)?;
        self.optim.step(stream, &factor)
    }

    /// Data parallelism, after the gradients: the amaxes max-reduced and the loss summed over
    /// `comm`'s ranks (see the [module documentation](self#data-parallelism)).
    fn reduce_amax_and_loss(&self, comm: &Communicator, stream: &Stream) -> Result<()> {
        comm.all_reduce_in_place(self.scaling.history_buffer(), ReduceOp::Max, stream)?;
        comm.all_reduce_in_place(&self.stats.slice(LOSS..LOSS + 1)?, ReduceOp::Sum, stream)?;
        Ok(())
    }

    /// The data-parallel communicator, if the model is one replica of several.
    pub fn communicator(&self) -> Option<&Communicator> {
        self.dp.as_ref().map(|dp| &dp.comm)
    }

    /// `stats[GRAD_NORM..]`: the norm and clip factor the clip kernel writes.
    fn stats_view(&self) -> Result<DeviceBuffer<f32>> {
        self.stats.slice(GRAD_NORM..STATS)
    }

    /// Forward and backward of microbatch `mb`; with `reduce`, each gradient bucket of a
    /// data-parallel replica is averaged over the ranks as soon as the backward finishes it.
    fn microbatch(
        &mut self,
        stream: &Stream,
        mb: usize,
        mut reduce: Option<&mut Side<'_, '_>>,
    ) -> Result<()> {
        let first = mb == 0;
        let b = &self.batches[mb];
        match &mut self.blocks {
            Blocks::Direct {
                blocks,
                hidden,
                saved,
            } => {
                self.ops
                    .embedding_forward(stream, &b.tokens, &self.embed.w, &hidden[0], VOCAB)?;
                for (l, block) in blocks.iter_mut().enumerate() {
                    let slot = direct_slot(mb, l, hidden, &saved[l]);
                    if first {
                        block.cast_weights(stream, &slot)?;
                    }
                    block.forward(stream, &[&hidden[l]], &[&hidden[l + 1]], &slot)?;
                }
                let h_last = &hidden[blocks.len()];
                head_pass(
                    &self.ops,
                    &self.head,
                    stream,
                    b,
                    h_last,
                    &self.dh[0],
                    &self.stats,
                    (mb, self.batches.len(), self.cfg.norm_eps),
                )?;
                // The gradients the buckets index, listed once (only when reducing).
                let grads = match reduce {
                    Some(_) => grads_of(&self.optim),
                    None => Vec::new(),
                };
                reduce_bucket(&self.dp, &grads, &mut reduce, stream, |dp| &dp.head)?;
                // The head's backward wrote dh[0]; the blocks' alternate between the two.
                let mut cur = 0;
                for (l, block) in blocks.iter_mut().enumerate().rev() {
                    let slot = direct_slot(mb, l, hidden, &saved[l]);
                    let next = 1 - cur;
                    block.backward(stream, &[&self.dh[cur]], &[&self.dh[next]], &slot)?;
                    reduce_bucket(&self.dp, &grads, &mut reduce, stream, |dp| &dp.blocks[l])?;
                    cur = next;
                }
                self.ops.embedding_backward(
                    stream,
                    &b.tokens,
                    &self.dh[cur],
                    &self.embed.dw,
                    !first,
                )?;
                reduce_bucket(&self.dp, &grads, &mut reduce, stream, |dp| &dp.embed)
            }
            Blocks::Graphed(rt) => {
                let h0 = rt.static_inputs(0, mb)?[0];
                self.ops
                    .embedding_forward(stream, &b.tokens, &self.embed.w, h0, VOCAB)?;
                let out = rt.forward(0, mb, &[h0], stream)?;
                let dh = &self.dh[0];
                head_pass(
                    &self.ops,
                    &self.head,
                    stream,
                    b,
                    &out[0],
                    dh,
                    &self.stats,
                    (mb, self.batches.len(), self.cfg.norm_eps),
                )?;
                let dx = rt.backward(0, mb, &[dh], stream)?;
                self.ops
                    .embedding_backward(stream, &b.tokens, &dx[0], &self.embed.dw, !first)
            }
        }
    }
}

/// With a data-parallel replica's `reduce`, averages the bucket `pick` names over the ranks
/// beside the work that follows (see [`DataParallel::reduce`]).
fn reduce_bucket(
    dp: &Option<DataParallel>,
    grads: &[HpBuffer<'_>],
    reduce: &mut Option<&mut Side<'_, '_>>,
    stream: &Stream,
    pick: impl Fn(&DataParallel) -> &[usize],
) -> Result<()> {
    match (dp, reduce.as_deref_mut()) {
        (Some(dp), Some(side)) => dp.reduce(grads, pick(dp), side, stream),
        _ => Ok(()),
    }
}

/// The head of microbatch `mb`: final norm, LM head, cross-entropy (loss summed into
/// `stats[LOSS]`) and their backward into `dh`, the gradient of `h_last`.
#[allow(clippy::too_many_arguments)] // the model's parts, borrowed separately
fn head_pass(
    ops: &Ops,
    head: &Head,
    stream: &Stream,
    b: &Batch,
    h_last: &DeviceBuffer<bf16>,
    dh: &DeviceBuffer<bf16>,
    stats: &DeviceBuffer<f32>,
    (mb, microbatches, eps): (usize, usize, f32),
) -> Result<()> {
    let first = mb == 0;
    if first {
        head.dense.cast_weight(stream, None)?;
    }
    ops.rmsnorm_forward(stream, h_last, &head.norm.w, &head.nf, &head.rstd, eps)?;
    head.dense
        .forward(stream, &head.nf, &head.logits, &head.saved, true)?;
    let scale = 1.0 / (head.rstd.len() * microbatches) as f32;
    ops.cross_entropy(
        stream,
        &head.logits,
        &b.targets,
        scale,
        &head.loss_rows,
        &head.dlogits,
    )?;
    ops.sum(stream, &head.loss_rows, stats, LOSS, !first)?;
    head.dense
        .backward(stream, &head.dlogits, Some(&head.dnf), &head.saved, !first)?;
    ops.rmsnorm_backward(
        stream,
        h_last,
        &head.norm.w,
        &head.rstd,
        &head.dnf,
        None,
        dh,
        &head.norm.dw,
        !first,
        &head.norm_ws,
    )
}

/// The slot of block `l` in microbatch `mb` when the model drives the blocks: input
/// `hidden[l]`, output `hidden[l + 1]`, the block's saved buffers.
fn direct_slot<'a>(
    mb: usize,
    l: usize,
    hidden: &'a [DeviceBuffer<bf16>],
    saved: &'a [DeviceBuffer<u8>],
) -> Slot<'a, bf16> {
    Slot::new(
        GraphIndex {
            chunk: 0,
            microbatch: mb,
            layer: l,
        },
        vec![&hidden[l]],
        vec![&hidden[l + 1]],
        saved.iter().collect(),
    )
}

/// A byte drawn from `logits`: the arg max at temperature 0 (the lowest on ties), else
/// from `softmax(logits / temperature)` by inverse transform sampling.
pub fn sample(logits: &[f32], temperature: f32, rng: &mut Rng) -> u8 {
    let argmax = logits
        .iter()
        .enumerate()
        .fold(0, |best, (i, &v)| if v > logits[best] { i } else { best });
    if temperature == 0.0 {
        return argmax as u8;
    }
    let max = logits[argmax] as f64;
    let w: Vec<f64> = logits
        .iter()
        .map(|&v| ((v as f64 - max) / temperature as f64).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
    for (i, &wi) in w.iter().enumerate() {
        if u < wi {
            return i as u8;
        }
        u -= wi;
    }
    argmax as u8
}

/// Checks that `tokens` and `targets` hold `want` ids each (`unit` names what takes that
/// many), every one in the vocabulary.
fn check_ids(what: &str, unit: &str, tokens: &[i32], targets: &[i32], want: usize) -> Result<()> {
    if tokens.len() != want || targets.len() != want {
        return Err(Error::InvalidArgument(format!(
            "{what}: {} tokens and {} targets, {unit} takes {want}",
            tokens.len(),
            targets.len()
        )));
    }
    match tokens
        .iter()
        .chain(targets)
        .find(|&&v| !(0..VOCAB as i32).contains(&v))
    {
        Some(bad) => Err(Error::InvalidArgument(format!(
            "{what}: token id {bad} is outside the vocabulary 0..{VOCAB}"
        ))),
        None => Ok(()),
    }
}

/// The shape of dense parameter `name` (see [`Model::state_tensors`]).
fn dense_shape(name: &str, d: usize) -> Vec<usize> {
    match name.rsplit('.').next() {
        Some("embed" | "head") => vec![VOCAB, d],
        Some("wqkv") => vec![3 * d, d],
        Some("wo") => vec![d, d],
        _ => vec![d],
    }
}

/// Every gradient of `optim`'s parameters: the dense ones (f32), then each MoE layer's
/// router (f32) and experts' (their type).
fn grads_of(optim: &ModelOptimizer) -> Vec<HpBuffer<'_>> {
    let mut g: Vec<HpBuffer<'_>> = optim
        .dense()
        .iter()
        .map(|p| HpBuffer::F32(&p.grad))
        .collect();
    for m in optim.moe() {
        g.extend(m.gradients());
    }
    g
}

/// The graphed-callables runtime over `blocks`: one chunk of every block, `microbatches`
/// microbatches each forward then backward, one graph per layer (`Layer`) or the
/// breaking-layer segments merged across layers (`Breaking`). Warmup leaves the scaling
/// state as it found it, and every tensor stays registered (as eager runs them).
fn build_runtime(
    stream: &Stream,
    scaling: &Arc<DelayedScaling>,
    blocks: Vec<Block>,
    microbatches: usize,
    mode: GraphMode,
) -> Result<GraphedCallables<bf16>> {
    let layers = blocks.len();
    let order: Vec<i64> = (0..microbatches).flat_map(|_| [1, -1]).collect();
    let schedule = Schedule::new(&order, vec![layers]).map_err(graphed_callables::Error::from)?;
    let mut options = GraphedOptions::new(schedule).with_merge_layers(mode == GraphMode::Breaking);
    options.reuse_buffers = true;
    let snapshot = Arc::new(Mutex::new(ScalingSnapshot::new(stream.context(), scaling)?));
    options.before_warmup = Some(Box::new({
        let (snap, s) = (snapshot.clone(), scaling.clone());
        move |st: &Stream| snap.lock().unwrap_or_else(|p| p.into_inner()).save(st, &s)
    }));
    options.after_warmup = Some(Box::new({
        let (snap, s) = (snapshot, scaling.clone());
        move |st: &Stream, _: &WarmupRecord| {
            snap.lock()
                .unwrap_or_else(|p| p.into_inner())
                .restore(st, &s)?;
            s.register(st, 0..s.len())
        }
    }));
    let n = blocks[0].input_lens()[0];
    let sample = zeroed::<bf16>(stream, n)?;
    let callables: Vec<Box<dyn Callable<bf16>>> = blocks
        .into_iter()
        .map(|b| Box::new(b) as Box<dyn Callable<bf16>>)
        .collect();
    // Sample inputs per callable: the first block's; the others chain.
    let mut samples: Vec<Vec<&DeviceBuffer<bf16>>> = vec![Vec::new(); layers];
    samples[0].push(&sample);
    GraphedCallables::build(stream, callables, &samples, options)
}
