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
//! [`Model::new_data_parallel`] trains one replica per rank of an NCCL communicator, each
//! on its own microbatches (modes none and step). Each rank divides its loss by the ranks
//! (the cross-entropy's and the aux loss's gradients: a mean over every rank's tokens, as
//! one GPU takes it over all the microbatches, so that every gradient the backward casts to
//! FP8, and so every amax and scale, has the one-GPU run's magnitude), and the gradients
//! are summed over the ranks in buckets as the last microbatch's backward finishes them:
//! the head's after the head, each block's (its norms, attention and MoE layer) after that
//! block, the embedding's last; each bucket is one NCCL group on a stream forked from the
//! step's (a side stream when eager, a fork of the capture in mode step), so the reductions
//! overlap the rest of the backward. After the joins, each rank max-reduces the FP8 amaxes
//! (TransformerEngine's `fp8_group`: every rank then computes the same scales, those of the
//! union of the ranks' data) and sums the loss; the clip and AdamW then run on identical
//! gradients, so the replicas stay identical. In mode step all of it is part of the
//! captured step graph. `n` ranks of `m` microbatches compute what one GPU computes with
//! `n * m` microbatches, up to the order of the gradient sums.
//! [`Model::new_data_parallel_in`] takes any [`ExpertGroup`] instead of NCCL's (with a
//! [`LocalGroup`](crate::moe::ep::LocalGroup): replicas that are threads on one GPU, mode
//! none).
//!
//! # Expert parallelism
//!
//! [`Model::new_expert_parallel`] spreads each MoE layer's experts over the ranks of an
//! NCCL communicator ([`ExpertParallelMoe`](crate::moe::ep::ExpertParallelMoe), full-layer:
//! its all-gathers and all-to-all inside the step, captured in mode step), `E / n` experts
//! a rank; the rest of the model (embedding, attention, norms, routers, head) is replicated
//! and trained data-parallel as above, each rank on its own microbatches. An expert's
//! gradient already sums every rank's tokens (each divided by the ranks, as above), so the
//! replicated gradients are summed and the experts' are left alone; the gradient norm adds
//! each rank's experts' squares (their partial sums gathered after the replicated ones');
//! the amax max-reduction skips the experts' weight tensors (each lives on one rank). The
//! ranks' state is the one-GPU model's split: [`Model::gather_state`] assembles it
//! (checkpoints are interchangeable with one GPU's) and [`Model::load_state`] takes this
//! rank's part of it. `n` ranks of `m` microbatches compute what one GPU computes with
//! `n * m` microbatches, up to the order of the sums. The ranks are NCCL's, or
//! ([`Model::new_expert_parallel_in`]) any [`ExpertGroup`]: with a
//! [`LocalGroup`](crate::moe::ep::LocalGroup), threads over one GPU (mode none). Every rank
//! runs every pass at once: steps, and also [`evaluate`](Model::evaluate),
//! [`generate`](Model::generate) and [`gather_state`](Model::gather_state) (with the same
//! arguments on every rank).

use std::ops::Range;
use std::sync::{Arc, Mutex};

use cuda_graph::half::bf16;
use cuda_graph::{
    CaptureMode, CaptureScope, DeviceBuffer, Error, Event, Graph, GraphExec, InstantiateFlags,
    Result, Stream,
};
use cuda_graph_nccl::Communicator;
use fp8_kernels::{AdamW, AmaxAlgo, DelayedScaling, DeviceScalar, Fp8Format, HpBuffer};
use graphed_callables::{
    Callable, GraphIndex, GraphedCallables, GraphedOptions, Schedule, Slot, WarmupRecord,
};
use serde::{Deserialize, Serialize};

use super::attention::Attention;
use super::block::{Block, BlockParams, Norm, scaling_tensors, scaling_tensors_per_rank};
use super::config::{ModelConfig, TrainConfig, VOCAB};
use super::dense::{Dense, DenseSaved};
use super::ops::{Ops, grad_norm_workspace_len, rmsnorm_backward_workspace_len};
use super::optim::ModelOptimizer;
use crate::dist::NcclGroup;
use crate::moe::ep::{ExpertGroup, GroupOp, experts_per_rank};
use crate::moe::layer::{ExpertGemm, MoeParams};
use crate::rng::Rng;
use crate::scaling::ScalingSnapshot;
use crate::zeroed;

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

/// A tensor read back to the host: name, shape, values (row-major).
pub type HostTensor = (String, Vec<usize>, Vec<f32>);

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
    /// Data (or expert) parallelism: the communicator over the replicas and the gradient
    /// buckets.
    dp: Option<DataParallel>,
}

/// How a model is spread over the ranks of a group (and its NCCL communicator, if it is
/// one).
enum Parallel {
    /// One GPU.
    None,
    /// Replicas ([`Model::new_data_parallel`]).
    Data(Arc<dyn ExpertGroup>, Option<Communicator>),
    /// Replicas with the experts split ([`Model::new_expert_parallel`]).
    Expert(Arc<dyn ExpertGroup>, Option<Communicator>),
}

/// A data-parallel replica's reduction state.
struct DataParallel {
    /// The collectives over the ranks.
    group: Arc<dyn ExpertGroup>,
    /// The NCCL communicator under `group`, when it is one.
    comm: Option<Communicator>,
    /// Indices into [`grads_of`]'s list, per bucket, in the order the backward finishes
    /// them: the head's (final norm and LM head), each block's, the embedding's.
    head: Vec<usize>,
    blocks: Vec<Vec<usize>>,
    embed: Vec<usize>,
    /// Eager steps: the stream the reductions run on beside the backward, and the event
    /// that orders it after the work it reduces.
    side: Stream,
    event: Arc<Event>,
    /// Expert parallelism's share of the step.
    experts: Option<ExpertShard>,
}

/// What an expert-parallel rank does beside the data-parallel reductions.
struct ExpertShard {
    /// Where this rank's experts' gradients start in [`grads_of`]'s list (they end it): they
    /// are not reduced, and their squares' partial sums are gathered for the norm.
    first: usize,
    /// Those partial sums, this rank's.
    partials: DeviceBuffer<f32>,
    /// The amax history rows of the scaling tensors every rank holds (all but the experts'
    /// weights'), views max-reduced over the ranks.
    shared_amax: Vec<DeviceBuffer<f32>>,
}

impl DataParallel {
    fn new(
        stream: &Stream,
        (group, comm): (Arc<dyn ExpertGroup>, Option<Communicator>),
        optim: &ModelOptimizer,
        layers: usize,
        experts: Option<ExpertShard>,
    ) -> Result<DataParallel> {
        let (mut head, mut blocks, mut embed) = (Vec::new(), vec![Vec::new(); layers], Vec::new());
        // Every gradient the optimizer steps is in exactly one bucket, but an expert-parallel
        // rank's own experts'.
        for (i, owner) in grad_owners(optim, layers)?.into_iter().enumerate() {
            match owner {
                GradOwner::Embed => embed.push(i),
                GradOwner::Head => head.push(i),
                GradOwner::Block(l) => blocks[l].push(i),
                GradOwner::Experts(_) if experts.is_some() => {}
                GradOwner::Experts(l) => blocks[l].push(i),
            }
        }
        Ok(DataParallel {
            group,
            comm,
            head,
            blocks,
            embed,
            side: Stream::new(stream.context())?,
            event: Arc::new(Event::new(stream.context())?),
            experts,
        })
    }

    /// Sums the gradients `bucket` names (of `grads`) over the ranks, as one NCCL group on
    /// a stream forked from `origin` after the work enqueued so far.
    fn reduce(
        &self,
        grads: &[HpBuffer<'_>],
        bucket: &[usize],
        side: &mut Side<'_, '_>,
        origin: &Stream,
    ) -> Result<()> {
        let s = side.fork(origin)?;
        // Every rank divides its loss by the ranks (`Model::data_ranks`): the sum is the
        // one-GPU gradient over the union of the ranks' microbatches.
        let group = &self.group;
        group.batch(&mut || {
            for &i in bucket {
                group.all_reduce(&s, grads[i], GroupOp::Sum)?;
            }
            Ok(())
        })
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
        Model::build(stream, cfg, train, mode, Parallel::None)
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
        let group: Arc<dyn ExpertGroup> = Arc::new(NcclGroup::new(comm.clone()));
        Model::build(stream, cfg, train, mode, Parallel::Data(group, Some(comm)))
    }

    /// [`new_data_parallel`](Self::new_data_parallel) over any group: NCCL's
    /// ([`NcclGroup`]), or ranks that are threads over one device
    /// ([`LocalGroup`](crate::moe::ep::LocalGroup): mode none only), which runs (and tests)
    /// several replicas on one GPU.
    ///
    /// Errors: as [`new_data_parallel`](Self::new_data_parallel); mode step over a group
    /// that cannot be captured.
    pub fn new_data_parallel_in(
        stream: &Stream,
        cfg: ModelConfig,
        train: TrainConfig,
        mode: GraphMode,
        group: Arc<dyn ExpertGroup>,
    ) -> Result<Model> {
        Model::build(stream, cfg, train, mode, Parallel::Data(group, None))
    }

    /// [`new`](Self::new) for one rank of an expert-parallel job over `comm`'s ranks (see the
    /// [module documentation](self#expert-parallelism)): each MoE layer's experts split over
    /// the ranks (`E / n` each, rank `r` holding experts `r E / n ..`), the rest replicated.
    /// Every rank builds its model with the same configuration (the seed included: the
    /// initial weights are the one-GPU model's), then loads its own microbatches and steps
    /// with the others. Modes none and step.
    ///
    /// Errors: as [`new`](Self::new); [`Error::InvalidArgument`] for modes layer and
    /// breaking, and for experts that do not split over the ranks (`E` a multiple of `n`,
    /// at least `top_k` a rank); in mode step, NCCL's errors while the step is captured.
    pub fn new_expert_parallel(
        stream: &Stream,
        cfg: ModelConfig,
        train: TrainConfig,
        mode: GraphMode,
        comm: Communicator,
    ) -> Result<Model> {
        let group: Arc<dyn ExpertGroup> = Arc::new(NcclGroup::new(comm.clone()));
        Model::build(
            stream,
            cfg,
            train,
            mode,
            Parallel::Expert(group, Some(comm)),
        )
    }

    /// [`new_expert_parallel`](Self::new_expert_parallel) over any group: NCCL's
    /// ([`NcclGroup`]), or ranks that are threads over one device
    /// ([`LocalGroup`](crate::moe::ep::LocalGroup): mode none only, its collectives cannot be
    /// captured), which runs (and tests) a model of several ranks on one GPU.
    ///
    /// Errors: as [`new_expert_parallel`](Self::new_expert_parallel); mode step over a group
    /// that cannot be captured.
    pub fn new_expert_parallel_in(
        stream: &Stream,
        cfg: ModelConfig,
        train: TrainConfig,
        mode: GraphMode,
        group: Arc<dyn ExpertGroup>,
    ) -> Result<Model> {
        Model::build(stream, cfg, train, mode, Parallel::Expert(group, None))
    }

    fn build(
        stream: &Stream,
        cfg: ModelConfig,
        train: TrainConfig,
        mode: GraphMode,
        parallel: Parallel,
    ) -> Result<Model> {
        let (kind, group) = match &parallel {
            Parallel::None => (None, None),
            Parallel::Data(g, _) => (Some("data"), Some(g)),
            Parallel::Expert(g, _) => (Some("expert"), Some(g)),
        };
        if let Some(kind) = kind.filter(|_| !matches!(mode, GraphMode::None | GraphMode::Step)) {
            return Err(Error::InvalidArgument(format!(
                "{kind} parallelism runs in graph modes none and step, not {}",
                mode.name()
            )));
        }
        if group.is_some_and(|g| mode == GraphMode::Step && !g.capturable()) {
            return Err(Error::InvalidArgument(
                "graph mode step captures the step, and this group's collectives cannot be \
                 captured (a LocalGroup's cannot): use mode none"
                    .into(),
            ));
        }
        if let Parallel::Expert(g, _) = &parallel {
            experts_per_rank(cfg.experts, cfg.top_k, g.size())?;
        }
        cfg.check()?;
        train.check()?;
        let ctx = stream.context().clone();
        let (t, d, m) = (cfg.tokens(), cfg.d_model, train.microbatches);
        let ops = Arc::new(Ops::new(&ctx)?);
        let attention = Arc::new(Attention::new(&ctx)?);
        // Expert parallelism: the group the experts are spread over, this rank's place.
        let group: Option<Arc<dyn ExpertGroup>> = match &parallel {
            Parallel::Expert(g, _) => Some(g.clone()),
            _ => None,
        };
        let (rank, ranks) = group.as_ref().map_or((0, 1), |g| (g.rank(), g.size()));
        // The ranks whose microbatches make a step (data and expert parallelism alike).
        let data_ranks = match &parallel {
            Parallel::None => 1,
            Parallel::Data(g, _) | Parallel::Expert(g, _) => g.size(),
        };
        let per_block = scaling_tensors_per_rank(&cfg, ranks);
        let mut formats: Vec<Fp8Format> = Vec::new();
        for _ in 0..cfg.layers {
            formats.extend(crate::linear::FORMATS);
            formats.extend(crate::linear::FORMATS);
            formats.extend(crate::moe::layer::formats(
                crate::moe::layer::Fp8Recipe::Hybrid,
                cfg.experts / ranks,
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
        // The aux loss is a mean over the step's microbatches, like the cross-entropy (every
        // rank's: the ranks' gradients are summed).
        let block_cfg = ModelConfig {
            aux_coef: cfg.aux_coef / (m * data_ranks) as f32,
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
                let parts = (ops.clone(), attention.clone());
                match &group {
                    Some(g) => Block::new_expert_parallel(
                        stream,
                        &block_cfg,
                        p,
                        parts,
                        scaling.clone(),
                        l * per_block,
                        g.clone(),
                    ),
                    None => Block::new(
                        stream,
                        &block_cfg,
                        p,
                        parts,
                        scaling.clone(),
                        l * per_block,
                        expert_gemm,
                    ),
                }
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
            moe_opts.push(b.moe.optimizer(stream, hyper)?);
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
        // The gradient norm's partial sums: the replicated gradients', then every rank's
        // experts' (expert parallelism gathers them there).
        let first_expert = grad_owners(&optim, cfg.layers)?
            .iter()
            .position(|o| matches!(o, GradOwner::Experts(_)))
            .unwrap_or(grad_lens.len());
        let (replicated, own) = grad_lens.split_at(first_expert);
        let norm_parts = grad_norm_workspace_len(replicated) + ranks * grad_norm_workspace_len(own);
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
            grad_ws: zeroed(stream, norm_parts.max(1))?,
            snapshot: ScalingSnapshot::new(&ctx, &scaling)?,
            optim,
            step_graph: None,
            steps_done: 0,
            scaling,
            dp: None,
        };
        model.dp = match parallel {
            Parallel::None => None,
            Parallel::Data(group, comm) => Some(DataParallel::new(
                stream,
                (group, comm),
                &model.optim,
                cfg.layers,
                None,
            )?),
            Parallel::Expert(group, comm) => {
                let runs = scaling_runs(&cfg, (rank, ranks));
                let local: usize = runs.iter().map(|(r, _)| r.len()).sum();
                if local != model.scaling.len() {
                    return Err(Error::InvalidArgument(format!(
                        "expert parallelism: {local} scaling tensors in the split layout, the \
                         model has {}",
                        model.scaling.len()
                    )));
                }
                let (history, h) = (model.scaling.history_buffer(), model.scaling.history_len());
                let shard = ExpertShard {
                    first: first_expert,
                    partials: zeroed(stream, grad_norm_workspace_len(own).max(1))?,
                    shared_amax: local_runs(&runs)
                        .into_iter()
                        .filter(|&(_, shared)| shared)
                        .map(|(r, _)| history.slice(r.start * h..r.end * h))
                        .collect::<Result<_>>()?,
                };
                Some(DataParallel::new(
                    stream,
                    (group, comm),
                    &model.optim,
                    cfg.layers,
                    Some(shard),
                )?)
            }
        };
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
        let tokens = (self.cfg.tokens() * self.batches.len() * self.data_ranks()) as f32;
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
        self.leaving_scaling_alone(stream, |m| {
            m.batches[0].tokens.copy_from_host(stream, tokens)?;
            m.batches[0].targets.copy_from_host(stream, targets)?;
            m.forward_only(stream)?;
            let head = &m.head;
            m.ops.cross_entropy(
                stream,
                &head.logits,
                &m.batches[0].targets,
                1.0,
                &head.loss_rows,
                &head.dlogits,
            )?;
            m.ops.sum(stream, &head.loss_rows, &m.stats, EVAL, false)
        })?;
        let v = self.stats.slice(EVAL..EVAL + 1)?.to_vec(stream)?;
        Ok(v[0] / t as f32)
    }

    /// Runs `pass` between a save and a restore of the FP8 scaling state (restored when
    /// `pass` fails too), so the amaxes its forward's casts record leave no trace.
    fn leaving_scaling_alone<T>(
        &mut self,
        stream: &Stream,
        pass: impl FnOnce(&mut Self) -> Result<T>,
    ) -> Result<T> {
        self.snapshot.save(stream, &self.scaling)?;
        let out = pass(self);
        let restored = self.snapshot.restore(stream, &self.scaling);
        let out = out?;
        restored?;
        Ok(out)
    }

    /// Continues `prompt` by `new_tokens` bytes sampled from the model (temperature
    /// `temperature`, greedy at 0; `seed` seeds the sampling), decoding under a CUDA graph:
    /// the forward of one microbatch (the weight casts, every block, the final norm and the
    /// head) is captured once and replayed per token, with the window (the last `context`
    /// bytes) in sequence 0 and the next byte drawn from the logits at its last position.
    /// The FP8 scaling state is left as it was (the casts' amaxes are undone), so training
    /// may continue after. Needs the blocks in the model's hands ([`GraphMode::None`] or
    /// [`GraphMode::Step`]). Over a group whose collectives cannot be captured (a
    /// [`LocalGroup`](crate::moe::ep::LocalGroup)'s), the forward runs eagerly per token,
    /// with the same bits.
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
        let capturable = self.dp.as_ref().is_none_or(|dp| dp.group.capturable());
        let out = self.leaving_scaling_alone(stream, |m| {
            let exec = if capturable {
                let (graph, ()) = stream
                    .capture_with(CaptureMode::ThreadLocal, |s| m.forward_only(s.stream()))?;
                Some(GraphExec::instantiate(&graph, InstantiateFlags::empty())?)
            } else {
                None
            };
            let (s_len, t) = (m.cfg.context, m.cfg.tokens());
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
                m.batches[0].tokens.copy_from_host(stream, &window)?;
                match &exec {
                    Some(exec) => exec.launch(stream)?,
                    None => m.forward_only(stream)?,
                }
                let p = ctx_bytes.len() - 1;
                let row = m
                    .head
                    .logits
                    .slice(p * VOCAB..(p + 1) * VOCAB)?
                    .to_vec(stream)?;
                let next = sample(&row, temperature, &mut rng);
                text.push(next);
                out.push(next);
            }
            Ok(out)
        })?;
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

    /// The training state's f32 buffers as the one-GPU model's tensors: name, one-GPU shape,
    /// how this rank holds it, the buffer.
    fn state_layout(&self) -> Vec<StateTensor<'_>> {
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
                v.push(StateTensor::new(
                    name,
                    shape.clone(),
                    Shard::Replicated,
                    buf,
                ));
            }
        }
        for (l, m) in self.optim.moe().iter().enumerate() {
            for (name, buf) in m.named_buffers() {
                let (shape, shard) = match name.split('.').next() {
                    Some("router") => (vec![e, d], Shard::Replicated),
                    Some("fc1") => (vec![e, 2 * f, d], Shard::Experts),
                    _ => (vec![e, d, f], Shard::Experts),
                };
                let full = if name.contains('.') {
                    format!("optim.blocks.{l}.moe.{name}")
                } else {
                    format!("blocks.{l}.moe.{name}")
                };
                v.push(StateTensor::new(full, shape, shard, buf));
            }
        }
        for (i, s) in self.optim.states().into_iter().enumerate() {
            let name = format!("optim.state.{i}");
            v.push(StateTensor::new(
                name,
                vec![4],
                Shard::Replicated,
                s.buffer(),
            ));
        }
        // The one-GPU model's scaling tensors.
        let tensors = self.cfg.layers * scaling_tensors(&self.cfg) + crate::linear::TENSORS;
        let hist = self.scaling.history_len();
        for (name, shape, buf) in [
            (
                "fp8.amax_history",
                vec![tensors, hist],
                &**self.scaling.history_buffer(),
            ),
            ("fp8.scale", vec![tensors], &**self.scaling.scale_buffer()),
            (
                "fp8.scale_inv",
                vec![tensors],
                &**self.scaling.scale_inv_buffer(),
            ),
        ] {
            v.push(StateTensor::new(name.into(), shape, Shard::Scaling, buf));
        }
        v
    }

    /// Every f32 buffer of the training state, named as checkpoints store them: the
    /// parameters (the f32 masters), AdamW's moments and states, and the FP8 scaling state.
    /// The names are stable (README, "Checkpoints"); the order is the model's. On one GPU (or
    /// a data-parallel replica) the shapes are the checkpoint's too; an expert-parallel rank
    /// holds its part of the experts' tensors and of the scaling state (the first dimension
    /// shorter), which [`gather_state`](Self::gather_state) assembles.
    pub fn state_tensors(&self) -> Vec<(String, Vec<usize>, &DeviceBuffer<f32>)> {
        let place = self.expert_place();
        self.state_layout()
            .into_iter()
            .map(|t| {
                let rows = t.local_rows(&self.cfg, place);
                let mut shape = t.shape;
                shape[0] = rows.iter().map(|r| r.len()).sum();
                (t.name, shape, t.buf)
            })
            .collect()
    }

    /// The whole training state read back to the host, named and shaped as checkpoints store
    /// them (the one-GPU model's [`state_tensors`](Self::state_tensors)). Under expert
    /// parallelism every rank calls it at once: the experts' tensors and the scaling state
    /// are gathered over the communicator, and every rank gets the whole state (what a
    /// one-GPU model trained on every rank's microbatches would hold). Waits.
    pub fn gather_state(&self, stream: &Stream) -> Result<Vec<HostTensor>> {
        let (_, ranks) = self.expert_place();
        let mut out = Vec::new();
        for t in self.state_layout() {
            // Split tensors only under expert parallelism over several ranks.
            let values = match self.dp.as_ref().map(|dp| &dp.group) {
                Some(group) if ranks > 1 && t.shard != Shard::Replicated => {
                    let all = zeroed::<f32>(stream, ranks * t.buf.len())?;
                    group.all_gather(stream, &t.buf.reinterpret()?, &all.reinterpret()?)?;
                    let all = all.to_vec(stream)?;
                    let parts: Vec<(Vec<Range<usize>>, &[f32])> = all
                        .chunks(t.buf.len())
                        .enumerate()
                        .map(|(r, data)| (t.local_rows(&self.cfg, (r, ranks)), data))
                        .collect();
                    assemble_rows(&t.shape, &parts)
                        .map_err(|e| Error::InvalidArgument(format!("gathering {}: {e}", t.name)))?
                }
                _ => t.buf.to_vec(stream)?,
            };
            out.push((t.name, t.shape, values));
        }
        Ok(out)
    }

    /// Writes the training state from `get(name, shape)`, which returns (or refuses) each
    /// tensor of the whole state as [`gather_state`](Self::gather_state) names and shapes
    /// it (a checkpoint's); an expert-parallel rank keeps its part. Then remakes the MoE
    /// layers' bf16 and FP8 expert weights from their masters: the model continues exactly
    /// as the one that saved the state would. `steps_done` is the number of steps that
    /// state had taken. Waits. Nothing is written unless every tensor is there with its
    /// shape.
    pub fn load_state(
        &mut self,
        stream: &Stream,
        steps_done: usize,
        mut get: impl FnMut(&str, &[usize]) -> Result<Vec<f32>>,
    ) -> Result<()> {
        let place = self.expert_place();
        let tensors = self.state_layout();
        let mut values = Vec::with_capacity(tensors.len());
        for t in &tensors {
            let v = get(&t.name, &t.shape)?;
            let whole: usize = t.shape.iter().product();
            if v.len() != whole {
                return Err(Error::InvalidArgument(format!(
                    "state tensor {}: {} values, the model's has {whole}",
                    t.name,
                    v.len()
                )));
            }
            let mine = extract_rows(&v, &t.shape, &t.local_rows(&self.cfg, place));
            if mine.len() != t.buf.len() {
                return Err(Error::InvalidArgument(format!(
                    "state tensor {}: this rank's part has {} values, its buffer {}",
                    t.name,
                    mine.len(),
                    t.buf.len()
                )));
            }
            values.push(mine);
        }
        for (t, v) in tensors.iter().zip(&values) {
            t.buf.copy_from_host(stream, v)?;
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
            self.reduce_amax_and_loss(dp, stream)?;
        }
        self.scaling.update(stream)?;
        let grads = self.grads();
        let (ws, clip, out) = (&self.grad_ws, self.train.clip, &self.stats_view()?);
        match self
            .dp
            .as_ref()
            .and_then(|dp| Some((dp, dp.experts.as_ref()?)))
        {
            // Expert parallelism: the replicated gradients' partial sums (the same on every
            // rank), then every rank's experts' gathered after them.
            Some((dp, x)) => {
                let ops = &self.ops;
                let replicated = ops.grad_norm_partials(stream, &grads[..x.first], ws)?;
                let own = ops.grad_norm_partials(stream, &grads[x.first..], &x.partials)?;
                let all = replicated + dp.group.size() * own;
                dp.group.all_gather(
                    stream,
                    &x.partials.slice(..own)?.reinterpret()?,
                    &ws.slice(replicated..all)?.reinterpret()?,
                )?;
                ops.grad_norm_finish(stream, &ws.slice(..all)?, clip, out)?;
            }
            None => self.ops.grad_norm_clip(stream, &grads, ws, clip, out)?,
        }
        let factor = DeviceScalar::at(&self.stats_view()?, CLIP - GRAD_NORM)?;
        self.optim.step(stream, &factor)
    }

    /// Data parallelism, after the gradients: the amaxes max-reduced (under expert
    /// parallelism all but the experts' weights', which live on one rank each) and the loss
    /// summed over the ranks (see the [module documentation](self#data-parallelism)).
    fn reduce_amax_and_loss(&self, dp: &DataParallel, stream: &Stream) -> Result<()> {
        let (group, history) = (&dp.group, self.scaling.history_buffer());
        match &dp.experts {
            None => group.all_reduce(stream, HpBuffer::F32(history), GroupOp::Max)?,
            Some(x) => {
                group.batch(&mut || {
                    for r in &x.shared_amax {
                        group.all_reduce(stream, HpBuffer::F32(r), GroupOp::Max)?;
                    }
                    Ok(())
                })?;
            }
        }
        let loss = self.stats.slice(LOSS..LOSS + 1)?;
        group.all_reduce(stream, HpBuffer::F32(&loss), GroupOp::Sum)
    }

    /// The NCCL communicator, if the model is one rank of a data- or expert-parallel job
    /// over one.
    pub fn communicator(&self) -> Option<&Communicator> {
        self.dp.as_ref().and_then(|dp| dp.comm.as_ref())
    }

    /// The ranks whose microbatches make a step: 1 but for data- and expert-parallel models.
    fn data_ranks(&self) -> usize {
        self.dp.as_ref().map_or(1, |dp| dp.group.size())
    }

    /// The ranks the experts are spread over: 1 but for the models of
    /// [`new_expert_parallel`](Self::new_expert_parallel).
    pub fn expert_ranks(&self) -> usize {
        self.expert_place().1
    }

    /// This rank's place among the expert-parallel ranks: (rank, ranks).
    fn expert_place(&self) -> (usize, usize) {
        match &self.dp {
            Some(dp) if dp.experts.is_some() => (dp.group.rank(), dp.group.size()),
            _ => (0, 1),
        }
    }

    /// `stats[GRAD_NORM..]`: the norm and clip factor the clip kernel writes.
    fn stats_view(&self) -> Result<DeviceBuffer<f32>> {
        self.stats.slice(GRAD_NORM..STATS)
    }

    /// Forward and backward of microbatch `mb`; with `reduce`, each gradient bucket of a
    /// data-parallel replica is summed over the ranks as soon as the backward finishes it.
    fn microbatch(
        &mut self,
        stream: &Stream,
        mb: usize,
        mut reduce: Option<&mut Side<'_, '_>>,
    ) -> Result<()> {
        let first = mb == 0;
        let b = &self.batches[mb];
        // The cross-entropy's gradient is a mean over the step's tokens, every rank's (the
        // ranks' gradients are summed).
        let shares = self.batches.len() * self.data_ranks();
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
                    (mb, shares, self.cfg.norm_eps),
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
                    (mb, shares, self.cfg.norm_eps),
                )?;
                let dx = rt.backward(0, mb, &[dh], stream)?;
                self.ops
                    .embedding_backward(stream, &b.tokens, &dx[0], &self.embed.dw, !first)
            }
        }
    }
}

/// With a data-parallel replica's `reduce`, sums the bucket `pick` names over the ranks
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
/// `stats[LOSS]`) and their backward into `dh`, the gradient of `h_last`; the loss's gradient
/// is divided by the microbatch's tokens times `shares` (the step's microbatches, times the
/// ranks whose gradients are summed).
#[allow(clippy::too_many_arguments)] // the model's parts, borrowed separately
fn head_pass(
    ops: &Ops,
    head: &Head,
    stream: &Stream,
    b: &Batch,
    h_last: &DeviceBuffer<bf16>,
    dh: &DeviceBuffer<bf16>,
    stats: &DeviceBuffer<f32>,
    (mb, shares, eps): (usize, usize, f32),
) -> Result<()> {
    let first = mb == 0;
    if first {
        head.dense.cast_weight(stream, None)?;
    }
    ops.rmsnorm_forward(stream, h_last, &head.norm.w, &head.nf, &head.rstd, eps)?;
    head.dense
        .forward(stream, &head.nf, &head.logits, &head.saved, true)?;
    let scale = 1.0 / (head.rstd.len() * shares) as f32;
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
/// router weight's (f32), then each MoE layer's experts' (fc1's and fc2's, their type). The
/// experts come last, so that an expert-parallel rank's own are one run ending the list.
fn grads_of(optim: &ModelOptimizer) -> Vec<HpBuffer<'_>> {
    let mut g: Vec<HpBuffer<'_>> = optim
        .dense()
        .iter()
        .map(|p| HpBuffer::F32(&p.grad))
        .collect();
    for m in optim.moe() {
        g.extend(m.gradients().into_iter().take(1));
    }
    for m in optim.moe() {
        g.extend(m.gradients().into_iter().skip(1));
    }
    g
}

/// Whose a gradient of [`grads_of`]'s list is: the data-parallel bucket it reduces in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GradOwner {
    /// The embedding.
    Embed,
    /// Block `l`'s norms, projections and router.
    Block(usize),
    /// The final norm and the LM head.
    Head,
    /// Block `l`'s experts.
    Experts(usize),
}

/// The owner of each gradient of [`grads_of`]`(optim)`, in its order.
fn grad_owners(optim: &ModelOptimizer, layers: usize) -> Result<Vec<GradOwner>> {
    let mut owners = Vec::new();
    for p in optim.dense() {
        owners.push(match p.name.strip_prefix("blocks.") {
            Some(rest) => {
                let l: usize = rest
                    .split('.')
                    .next()
                    .and_then(|l| l.parse().ok())
                    .filter(|&l| l < layers)
                    .ok_or_else(|| {
                        Error::InvalidArgument(format!("parameter {} names no block", p.name))
                    })?;
                GradOwner::Block(l)
            }
            None if p.name == "embed" => GradOwner::Embed,
            None => GradOwner::Head,
        });
    }
    let moe = optim.moe();
    if moe.len() != layers {
        return Err(Error::InvalidArgument(format!(
            "{} MoE optimizers for {layers} blocks",
            moe.len()
        )));
    }
    owners.extend((0..layers).map(GradOwner::Block));
    for (l, m) in moe.iter().enumerate() {
        let experts = m.gradients().len().saturating_sub(1);
        owners.extend(std::iter::repeat_n(GradOwner::Experts(l), experts));
    }
    Ok(owners)
}

/// How an expert-parallel rank holds a tensor of the one-GPU model's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shard {
    /// Whole, the same on every rank.
    Replicated,
    /// Rows (the first dimension, one per expert) `r E / n .. (r + 1) E / n`.
    Experts,
    /// The FP8 scaling state's rows (one per tensor): [`scaling_runs`].
    Scaling,
}

/// One tensor of the training state (see [`Model::state_layout`]).
struct StateTensor<'a> {
    name: String,
    /// The one-GPU model's shape.
    shape: Vec<usize>,
    shard: Shard,
    buf: &'a DeviceBuffer<f32>,
}

impl<'a> StateTensor<'a> {
    fn new(name: String, shape: Vec<usize>, shard: Shard, buf: &'a DeviceBuffer<f32>) -> Self {
        StateTensor {
            name,
            shape,
            shard,
            buf,
        }
    }

    /// The rows (of the first dimension) of the whole tensor that rank `rank` of `ranks`
    /// holds, in the order it holds them.
    fn local_rows(&self, cfg: &ModelConfig, place: (usize, usize)) -> Vec<Range<usize>> {
        local_rows_of(self.shard, &self.shape, cfg, place)
    }
}

/// The rows (of the first dimension) of a tensor of the one-GPU `shape`, held as `shard`,
/// that rank `rank` of `ranks` holds, in its order.
#[allow(clippy::single_range_in_vec_init)] // lists of row ranges, one of them here
fn local_rows_of(
    shard: Shard,
    shape: &[usize],
    cfg: &ModelConfig,
    (rank, ranks): (usize, usize),
) -> Vec<Range<usize>> {
    let rows = shape.first().copied().unwrap_or(1);
    match shard {
        _ if ranks <= 1 => vec![0..rows],
        Shard::Replicated => vec![0..rows],
        Shard::Experts => {
            let per = rows / ranks;
            vec![rank * per..(rank + 1) * per]
        }
        Shard::Scaling => scaling_runs(cfg, (rank, ranks))
            .into_iter()
            .map(|(r, _)| r)
            .collect(),
    }
}

/// The scaling tensors of rank `rank` of `ranks` expert-parallel ranks in its order, as runs
/// of the one-GPU model's tensors, each with whether every rank holds it: per block its
/// projections' and MoE activations' tensors (shared), its experts' fc1 weights, their fc2
/// weights; then the head's (shared).
fn scaling_runs(cfg: &ModelConfig, (rank, ranks): (usize, usize)) -> Vec<(Range<usize>, bool)> {
    let per = cfg.experts / ranks.max(1);
    let block = scaling_tensors(cfg);
    let shared = 2 * crate::linear::TENSORS + crate::moe::layer::ACTIVATIONS;
    let mut v = Vec::with_capacity(3 * cfg.layers + 1);
    for l in 0..cfg.layers {
        let b = l * block;
        let (w1, w2) = (
            b + shared + rank * per,
            b + shared + cfg.experts + rank * per,
        );
        v.extend([
            (b..b + shared, true),
            (w1..w1 + per, false),
            (w2..w2 + per, false),
        ]);
    }
    let head = cfg.layers * block;
    v.push((head..head + crate::linear::TENSORS, true));
    v
}

/// `runs` (of [`scaling_runs`]) as ranges of the rank's own layout, where they lie back to
/// back.
fn local_runs(runs: &[(Range<usize>, bool)]) -> Vec<(Range<usize>, bool)> {
    let mut at = 0;
    runs.iter()
        .map(|(r, shared)| {
            let local = at..at + r.len();
            at = local.end;
            (local, *shared)
        })
        .collect()
}

/// The values of a tensor of `shape` from its ranks' parts: each part the rows it lists (of
/// the first dimension), back to back. Rows several ranks hold (the shared FP8 scaling
/// state, which the amax reduction keeps the same on every rank) must be the same bits in
/// each. Errors name a part of the wrong size, a row out of range, a shared row whose ranks
/// disagree, or a row no part holds.
fn assemble_rows(
    shape: &[usize],
    parts: &[(Vec<Range<usize>>, &[f32])],
) -> std::result::Result<Vec<f32>, String> {
    let rows = shape.first().copied().unwrap_or(1);
    let row = shape.iter().skip(1).product::<usize>();
    let mut out = vec![0f32; rows * row];
    // The part that wrote each row, if any.
    let mut held: Vec<Option<usize>> = vec![None; rows];
    for (p, (ranges, data)) in parts.iter().enumerate() {
        let want: usize = ranges.iter().map(|r| r.len() * row).sum();
        if data.len() != want {
            return Err(format!(
                "rank {p}'s part has {} values, its rows {ranges:?} take {want}",
                data.len()
            ));
        }
        let mut at = 0;
        for r in ranges {
            if r.end > rows {
                return Err(format!("rank {p}'s rows {r:?} end past {rows}"));
            }
            for (j, i) in r.clone().enumerate() {
                let src = &data[at + j * row..at + (j + 1) * row];
                let dst = &mut out[i * row..(i + 1) * row];
                match held[i] {
                    None => dst.copy_from_slice(src),
                    Some(q) if !same_bits(dst, src) => {
                        return Err(format!("ranks {q} and {p} disagree on row {i}"));
                    }
                    Some(_) => {}
                }
                held[i].get_or_insert(p);
            }
            at += r.len() * row;
        }
    }
    match held.iter().position(Option::is_none) {
        Some(missing) => Err(format!("row {missing} of {rows} is on no rank")),
        None => Ok(out),
    }
}

/// Whether `a` and `b` hold the same bits.
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The rows `ranges` (of the first dimension) of `values`, a tensor of `shape`, back to
/// back; rows out of range are left out (the caller compares the length).
fn extract_rows(values: &[f32], shape: &[usize], ranges: &[Range<usize>]) -> Vec<f32> {
    let row = shape.iter().skip(1).product::<usize>();
    ranges
        .iter()
        .flat_map(|r| values.get(r.start * row..r.end * row).unwrap_or(&[]))
        .copied()
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(layers: usize, experts: usize) -> ModelConfig {
        ModelConfig {
            layers,
            experts,
            ..ModelConfig::default()
        }
    }

    #[test]
    fn scaling_runs_split_the_one_gpu_layout() {
        for (layers, experts, ranks) in [(1, 2, 1), (4, 8, 1), (4, 8, 2), (3, 8, 4), (2, 6, 3)] {
            let c = cfg(layers, experts);
            let whole = layers * scaling_tensors(&c) + crate::linear::TENSORS;
            let mut holders = vec![0usize; whole];
            for rank in 0..ranks {
                let runs = scaling_runs(&c, (rank, ranks));
                // This rank's layout is the model's: blocks of the split size, then the head.
                let local: usize = runs.iter().map(|(r, _)| r.len()).sum();
                assert_eq!(
                    local,
                    layers * scaling_tensors_per_rank(&c, ranks) + crate::linear::TENSORS
                );
                for (r, shared) in &runs {
                    for t in r.clone() {
                        holders[t] += if *shared { 100 } else { 1 };
                    }
                }
                // The shared runs, in the rank's own layout, start each block and the head.
                let shared: Vec<Range<usize>> = local_runs(&runs)
                    .into_iter()
                    .filter(|(_, s)| *s)
                    .map(|(r, _)| r)
                    .collect();
                let per = scaling_tensors_per_rank(&c, ranks);
                let own = 2 * crate::linear::TENSORS + crate::moe::layer::ACTIVATIONS;
                let mut want: Vec<Range<usize>> =
                    (0..layers).map(|l| l * per..l * per + own).collect();
                want.push(layers * per..layers * per + crate::linear::TENSORS);
                assert_eq!(shared, want);
            }
            // Every tensor of the one-GPU layout is held: the experts' weights by one rank,
            // everything else by every rank.
            for (t, &h) in holders.iter().enumerate() {
                assert!(h == 1 || h == 100 * ranks, "tensor {t}: {h}");
            }
            assert_eq!(
                holders.iter().filter(|&&h| h == 1).count(),
                layers * 2 * experts
            );
        }
    }

    #[test]
    fn gathering_and_taking_parts_round_trip() {
        let c = cfg(2, 8);
        let mut rng = Rng::new(7, 0);
        for ranks in [1, 2, 4] {
            for (shard, shape) in [
                (Shard::Experts, vec![8, 3, 2]),
                (Shard::Replicated, vec![5, 4]),
                (
                    Shard::Scaling,
                    vec![2 * scaling_tensors(&c) + crate::linear::TENSORS, 3],
                ),
            ] {
                let whole = rng.vec(shape.iter().product(), 1.0);
                let rows: Vec<Vec<Range<usize>>> = (0..ranks)
                    .map(|r| local_rows_of(shard, &shape, &c, (r, ranks)))
                    .collect();
                let parts: Vec<Vec<f32>> = rows
                    .iter()
                    .map(|r| extract_rows(&whole, &shape, r))
                    .collect();
                let views: Vec<(Vec<Range<usize>>, &[f32])> = rows
                    .iter()
                    .cloned()
                    .zip(parts.iter().map(|p| p.as_slice()))
                    .collect();
                assert_eq!(assemble_rows(&shape, &views).unwrap(), whole, "{shard:?}");
                if ranks > 1 && shard == Shard::Experts {
                    assert_eq!(parts[1].len(), whole.len() / ranks);
                    assert_eq!(parts[1][0], whole[whole.len() / ranks]);
                }
            }
        }
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // lists of row ranges
    fn assembling_names_what_is_missing_or_malformed() {
        let shape = [4, 2];
        let data = [1.0f32; 4];
        // Rows 2 and 3 held by nobody.
        let e = assemble_rows(&shape, &[(vec![0..2], &data[..])]).unwrap_err();
        assert!(e.contains("row 2"), "{e}");
        // A part of the wrong size.
        let e = assemble_rows(&shape, &[(vec![0..4], &data[..])]).unwrap_err();
        assert!(e.contains("rank 0's part"), "{e}");
        // Rows past the end.
        let e = assemble_rows(&shape, &[(vec![3..5], &data[..])]).unwrap_err();
        assert!(e.contains("past"), "{e}");
        // Shared rows must agree bit for bit (NaN payloads and signed zeros included).
        let shared = |a: [f32; 2], b: [f32; 2]| {
            assemble_rows(
                &[2, 2],
                &[
                    (vec![0..2], &[a, [5.0; 2]].concat()[..]),
                    (vec![0..1], &b[..]),
                ],
            )
        };
        assert_eq!(
            shared([1.0, 2.0], [1.0, 2.0]).unwrap(),
            vec![1.0, 2.0, 5.0, 5.0]
        );
        let e = shared([1.0, 2.0], [1.0, 2.5]).unwrap_err();
        assert!(e.contains("ranks 0 and 1 disagree on row 0"), "{e}");
        assert!(shared([0.0, 2.0], [-0.0, 2.0]).is_err());
    }
}
