//! `fp8-moe train`: trains the byte-level MoE transformer ([`Model`]) on a corpus, shows the
//! run (progress bar, comparison table of graph modes, a generated sample) and writes its
//! report folder and checkpoints.
//!
//! What a run does, in order:
//! 1. reads the corpus (`--data`, or the repository's own text files) and splits it;
//! 2. builds the model (or resumes a checkpoint: the checkpoint's configuration and state,
//!    continued bit for bit as the run that saved it would have);
//! 3. trains `--steps` steps in the chosen `--graphs` mode, reporting loss, tokens/s and
//!    step time, with the validation loss every `--eval-every` steps;
//! 4. saves a checkpoint (`--save`), generates a sample under a CUDA graph;
//! 5. times `--compare-steps` steps of every graph mode from the same start on the same
//!    batches (CUDA events, medians), checks their losses equal eager's bit for bit, and
//!    prints the table;
//! 6. writes the report folder: `loss.svg`, `run.json`, the captured graphs as DOT (and
//!    SVG with Graphviz).

use std::path::{Path, PathBuf};
use std::time::Instant;

use cuda_graph::{Event, Stream};
use serde::{Deserialize, Serialize};

use super::checkpoint::{self, Dtype, TensorData};
use super::data::{Corpus, Sampler, SamplerState, Split};
use super::report::{self, LossCurve, TrainProgress};
use crate::dist::{Placement, communicator};
use crate::model::{GraphMode, Model, ModelConfig, TrainConfig};

/// The checkpoint format's version (`state.json`'s `version`).
pub const CHECKPOINT_VERSION: u32 = 1;

/// The most bytes `--sample-bytes` asks for (each is a forward pass).
pub const MAX_SAMPLE_BYTES: usize = 1 << 20;

/// A run's settings, as the command line gives them.
#[derive(Debug, Clone)]
pub struct JobConfig {
    /// The model's shape.
    pub model: ModelConfig,
    /// The optimizer and schedule.
    pub train: TrainConfig,
    /// How steps run.
    pub mode: GraphMode,
    /// The corpus (`None`: the repository's text files).
    pub data: Option<PathBuf>,
    /// Where to save a checkpoint at the end.
    pub save: Option<PathBuf>,
    /// The checkpoint to continue.
    pub resume: Option<PathBuf>,
    /// The report folder.
    pub report: PathBuf,
    /// Validation loss every this many steps (0: only at the end).
    pub eval_every: usize,
    /// Validation microbatches per evaluation.
    pub eval_batches: usize,
    /// Steps per graph mode in the comparison table (0: no table).
    pub compare_steps: usize,
    /// Bytes to generate at the end (0: none).
    pub sample_bytes: usize,
    /// The sample's prompt.
    pub prompt: String,
    /// The sample's temperature.
    pub temperature: f32,
    /// Draw the progress bar (it hides itself when stdout is not a terminal).
    pub progress: bool,
    /// Stop once this many steps are done (the schedule still spans the run's `steps`):
    /// splits a run into parts that `--save` and `--resume` join.
    pub stop_after: Option<usize>,
    /// Data-parallel ranks: 1, or the job's `WORLD_SIZE` (started by `fp8-moe --gpus N`);
    /// see [`Model::new_data_parallel`]. Rank 0 alone prints, evaluates, saves and reports.
    pub dp: usize,
    /// Expert-parallel ranks: 1, or the job's `WORLD_SIZE` (with `dp` 1); see
    /// [`Model::new_expert_parallel`]. Every rank evaluates, generates and gathers the
    /// checkpoint (collectives); rank 0 alone prints, writes and reports.
    pub ep: usize,
}

/// What `state.json` of a checkpoint holds besides the tensors.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointState {
    /// [`CHECKPOINT_VERSION`].
    pub version: u32,
    /// The model's shape.
    pub model: ModelConfig,
    /// The run's settings (the learning-rate schedule depends on them).
    pub train: TrainConfig,
    /// Steps taken.
    pub steps_done: usize,
    /// The data sampler's position.
    pub sampler: SamplerState,
    /// The loss of the evaluation batch stored beside the weights (`eval.tokens`,
    /// `eval.targets`), as this run computed it (what `scripts/torch_check.py` compares
    /// with).
    pub eval_loss: Option<f32>,
}

/// One row of the comparison table.
#[derive(Debug, Clone, Serialize)]
pub struct ModeRow {
    /// The graph mode.
    pub mode: GraphMode,
    /// Median step time (CUDA events), ms.
    pub step_ms: f64,
    /// Tokens per second at that median.
    pub tokens_per_s: f64,
    /// Eager's median over this one's.
    pub speedup: f64,
    /// The per-step losses.
    pub losses: Vec<f32>,
    /// Whether every loss and gradient norm equals eager's bit for bit.
    pub matches_eager: bool,
}

/// What the run reports (`run.json`).
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// The model's shape.
    pub model: ModelConfig,
    /// The run's settings.
    pub train: TrainConfig,
    /// The mode of the training run.
    pub mode: GraphMode,
    /// Parameters of the model.
    pub parameters: usize,
    /// Bytes of the corpus, and of its training part.
    pub corpus_bytes: usize,
    /// The training steps' (step, loss, gradient norm, ms).
    pub steps: Vec<(usize, f32, f32, f64)>,
    /// (step, validation loss).
    pub validation: Vec<(usize, f32)>,
    /// Tokens per second over the training run (wall clock, after its first step).
    pub tokens_per_s: f64,
    /// The comparison table.
    pub modes: Vec<ModeRow>,
    /// The generated sample.
    pub sample: String,
}

/// Runs a whole job (see the [module documentation](self)), printing to stdout.
pub fn run(cfg: &JobConfig) -> Result<RunReport, String> {
    fn err(what: &'static str) -> impl Fn(cuda_graph::Error) -> String {
        move |e| format!("{what}: {e}")
    }
    let placement = Placement::from_env()?;
    // What the end of the run needs, checked before it trains: the sample's settings and
    // (rank 0, which writes it) the checkpoint's folder.
    if cfg.sample_bytes > 0 && !(cfg.temperature.is_finite() && cfg.temperature >= 0.0) {
        return Err(format!(
            "--temperature {}: must be finite and >= 0 (0: greedy)",
            cfg.temperature
        ));
    }
    if cfg.sample_bytes > MAX_SAMPLE_BYTES {
        return Err(format!(
            "--sample-bytes {}: at most {MAX_SAMPLE_BYTES}",
            cfg.sample_bytes
        ));
    }
    if let (Some(dir), 0) = (&cfg.save, placement.rank) {
        if dir == &cfg.report {
            return Err(format!(
                "--save and --report are both {}: a checkpoint folder holds only the \
                 checkpoint; give them different folders",
                dir.display()
            ));
        }
        checkpoint::check_target(dir).map_err(|e| format!("--save: {e}"))?;
    }
    if cfg.dp > 1 && cfg.ep > 1 {
        return Err(format!(
            "--dp {} and --ep {}: expert parallelism is data parallelism for the rest of the \
             model already; take one of them",
            cfg.dp, cfg.ep
        ));
    }
    let (ranks, flag) = if cfg.ep > 1 {
        (cfg.ep, "--ep")
    } else {
        (cfg.dp, "--dp")
    };
    if placement.world_size != ranks {
        return Err(format!(
            "{flag} {ranks} needs as many processes: start it with `fp8-moe --gpus {ranks} train \
             {flag} {ranks}` (or `--gpus G --nnodes M ...` on each of M machines, G x M = \
             {ranks}; this process is rank {} of {})",
            placement.rank, placement.world_size
        ));
    }
    let lead = placement.rank == 0;
    // Expert parallelism: every pass is a collective, so every rank evaluates, generates
    // and gathers the checkpoint with rank 0.
    let collective = cfg.ep > 1;
    // Only rank 0 talks; the others train in silence.
    macro_rules! say {
        ($($t:tt)*) => { if lead { println!($($t)*); } };
    }
    // The same one line as `info` without a driver or device.
    let ctx = placement.context().map_err(|e| e.to_string())?;
    let stream = Stream::new(&ctx).map_err(err("stream"))?;
    let corpus = match &cfg.data {
        Some(p) => Corpus::from_path(p),
        None => Corpus::default_for_repo(),
    }
    .map_err(|e| format!("corpus: {e}"))?;
    let corpus_bytes = corpus.len();
    say!(
        "corpus: {} bytes from {} files",
        corpus_bytes,
        corpus.files().len()
    );
    // Resume: the checkpoint's configuration and state.
    let resumed = match &cfg.resume {
        Some(dir) => Some(load_checkpoint(dir)?),
        None => None,
    };
    let (model_cfg, train_cfg) = match &resumed {
        Some((_, st)) => (st.model, st.train),
        None => (cfg.model, cfg.train),
    };
    let split = corpus
        .split(model_cfg.context)
        .map_err(|e| format!("corpus: {e}"))?;
    let mut model = if ranks > 1 {
        let comm = communicator(&ctx, &placement).map_err(|e| format!("NCCL: {e}"))?;
        if collective {
            Model::new_expert_parallel(&stream, model_cfg, train_cfg, cfg.mode, comm)
        } else {
            Model::new_data_parallel(&stream, model_cfg, train_cfg, cfg.mode, comm)
        }
    } else {
        Model::new(&stream, model_cfg, train_cfg, cfg.mode)
    }
    .map_err(err("building the model"))?;
    let mut sampler = split.sampler(train_cfg.seed).map_err(|e| e.to_string())?;
    if let Some((ck, st)) = &resumed {
        model
            .load_state(&stream, st.steps_done, |name, shape| {
                ck.expect(name, Dtype::F32, shape)
                    .and_then(|t| t.to_vec::<f32>())
                    .map_err(|e| cuda_graph::Error::InvalidArgument(e.to_string()))
            })
            .map_err(err("resuming"))?;
        sampler = Sampler::from_state(&st.sampler, split.train().len(), model_cfg.context)
            .map_err(|e| format!("resuming the data: {e}"))?;
        say!(
            "resumed {} at step {}",
            cfg.resume.as_deref().unwrap_or(Path::new("")).display(),
            st.steps_done
        );
    }
    say!(
        "model: {} parameters, d {} x {} layers, {} experts top-{} (F {}), context {}, {} x {} \
         sequences a step{}; graphs: {}",
        model_cfg.parameters(),
        model_cfg.d_model,
        model_cfg.layers,
        model_cfg.experts,
        model_cfg.top_k,
        model_cfg.ffn,
        model_cfg.context,
        train_cfg.microbatches,
        model_cfg.batch,
        if collective {
            format!(
                " on each of {ranks} expert-parallel GPUs ({} experts each)",
                model_cfg.experts / ranks
            )
        } else if ranks > 1 {
            format!(" on each of {ranks} data-parallel GPUs")
        } else {
            String::new()
        },
        cfg.mode.name()
    );

    // Tokens of one step over every rank; each rank loads its share.
    let step_tokens = model_cfg.tokens() * train_cfg.microbatches * ranks;
    let mut tokens = vec![0i32; step_tokens];
    let mut targets = vec![0i32; step_tokens];
    let mut train_curve = LossCurve::new("train");
    let mut valid_curve = LossCurve::new("validation");
    let mut steps = Vec::new();
    let mut validation = Vec::new();
    let first = model.steps_done();
    if !model.can_evaluate() && cfg.eval_every > 0 {
        say!(
            "validation: not in mode {} (its blocks run inside the graphed-callables runtime; \
             modes none and step evaluate)",
            cfg.mode.name()
        );
    }
    let mut timed_from: Option<(Instant, usize)> = None;
    let end = cfg
        .stop_after
        .map_or(train_cfg.steps, |n| n.min(train_cfg.steps));
    let mut progress = TrainProgress::new(end.max(1) as u64, cfg.progress && lead);
    for step in first..end {
        let t0 = Instant::now();
        next_step_batch(
            &mut sampler,
            &split,
            &model,
            &stream,
            (&mut tokens, &mut targets),
            (placement.rank, ranks),
        )?;
        model
            .step(&stream, train_cfg.lr_at(step))
            .map_err(err("step"))?;
        let stats = model.stats(&stream).map_err(err("step"))?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        if !stats.loss.is_finite() {
            return Err(format!(
                "step {step}: the loss is {} (gradient norm {})",
                stats.loss, stats.grad_norm
            ));
        }
        if timed_from.is_none() {
            timed_from = Some((Instant::now(), step + 1));
        }
        steps.push((step + 1, stats.loss, stats.grad_norm, ms));
        train_curve.push((step + 1) as f64, stats.loss as f64);
        progress.update(
            (step + 1) as u64,
            stats.loss as f64,
            step_tokens as f64 / (ms / 1e3),
            ms,
        );
        let last = step + 1 == end;
        let evaluate = last || (cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0);
        if (lead || collective) && evaluate {
            if let Some(v) = validate(&mut model, &stream, &split, cfg.eval_batches)? {
                valid_curve.push((step + 1) as f64, v as f64);
                validation.push((step + 1, v));
                if lead {
                    progress.println(&format!("step {}: validation loss {v:.4}", step + 1));
                }
            }
        }
    }
    progress.finish();
    let tokens_per_s = match timed_from {
        Some((t, s)) if end > s => {
            (end - s) as f64 * step_tokens as f64 / t.elapsed().as_secs_f64()
        }
        _ => 0.0,
    };
    if let Some(&(s, loss, _, _)) = steps.last() {
        say!("step {s}: loss {loss:.4}, {tokens_per_s:.0} tokens/s over the run");
    }

    let mut run = RunReport {
        model: model_cfg,
        train: train_cfg,
        mode: cfg.mode,
        parameters: model_cfg.parameters(),
        corpus_bytes,
        steps,
        validation,
        tokens_per_s,
        modes: Vec::new(),
        sample: String::new(),
    };
    if !lead && !collective {
        return Ok(run);
    }
    // The checkpoint first: nothing of the report (a folder that cannot be made, Graphviz)
    // may cost the run's trained state.
    if let Some(dir) = &cfg.save {
        let eval_loss = save_checkpoint(dir, &mut model, &stream, &split, &sampler, lead)?;
        say!(
            "saved {} (evaluation batch loss {})",
            dir.display(),
            eval_loss.map_or("n/a".into(), |l| format!("{l:.5}"))
        );
    }
    if lead {
        std::fs::create_dir_all(&cfg.report)
            .map_err(|e| format!("report folder {}: {e}", cfg.report.display()))?;
        // Graphs of the training run.
        for (name, g) in model.graphs() {
            let dot = g.to_dot_string().map_err(err("graph DOT"))?;
            report::write_dot(&cfg.report, &name, &dot).map_err(|e| e.to_string())?;
        }
    }
    if cfg.sample_bytes > 0 {
        let bytes = generate(&mut model, &stream, cfg)?;
        let text = String::from_utf8_lossy(&bytes).into_owned();
        say!(
            "sample ({} bytes, temperature {}):\n{}{}\n",
            bytes.len(),
            cfg.temperature,
            cfg.prompt,
            text
        );
        run.sample = text;
    }
    drop(model);
    if !lead {
        return Ok(run);
    }

    // The comparison runs single-GPU models on this rank's GPU.
    if cfg.compare_steps > 0 && ranks == 1 {
        let rows = compare_modes(&stream, model_cfg, train_cfg, &split, cfg.compare_steps)?;
        println!(
            "{}",
            mode_table(&rows, model_cfg.tokens() * train_cfg.microbatches)
        );
        run.modes = rows;
    }
    let mut curves = vec![train_curve];
    if !valid_curve.points.is_empty() {
        curves.push(valid_curve);
    }
    report::write_loss_svg(
        &cfg.report.join("loss.svg"),
        &curves,
        "fp8-moe train: loss (nats/byte)",
    )
    .map_err(|e| e.to_string())?;
    report::write_json(&cfg.report.join("run.json"), &run).map_err(|e| e.to_string())?;
    println!("report: {}", cfg.report.display());
    Ok(run)
}

/// Draws a step's batch from `sampler` into the host buffers and writes it to `model`.
fn next_step_batch(
    sampler: &mut Sampler,
    split: &Split,
    model: &Model,
    stream: &Stream,
    (tokens, targets): (&mut [i32], &mut [i32]),
    (rank, ranks): (usize, usize),
) -> Result<(), String> {
    // Every rank draws the whole step's windows (the samplers stay in step) and loads its
    // share: rank r the r-th run of `batch x microbatches` windows.
    let windows = model.config().batch * model.train_config().microbatches;
    sampler
        .next_batch(split.train(), windows * ranks, tokens, targets)
        .map_err(|e| e.to_string())?;
    let share = tokens.len() / ranks;
    let mine = rank * share..(rank + 1) * share;
    model
        .load_batch(stream, &tokens[mine.clone()], &targets[mine])
        .map_err(|e| format!("batch: {e}"))
}

/// The mean validation loss over `batches` validation microbatches, `None` when the model's
/// blocks run inside the graphed-callables runtime (modes layer and breaking).
fn validate(
    model: &mut Model,
    stream: &Stream,
    split: &Split,
    batches: usize,
) -> Result<Option<f32>, String> {
    if !model.can_evaluate() || batches == 0 {
        return Ok(None);
    }
    let (b, s) = (model.config().batch, model.config().context);
    let mut tokens = vec![0i32; b * s];
    let mut targets = vec![0i32; b * s];
    let mut total = 0.0f64;
    for i in 0..batches {
        split
            .validation_batch(i, b, &mut tokens, &mut targets)
            .map_err(|e| format!("validation: {e}"))?;
        total += f64::from(
            model
                .evaluate(stream, &tokens, &targets)
                .map_err(|e| format!("validation: {e}"))?,
        );
    }
    Ok(Some((total / batches as f64) as f32))
}

/// Generates the sample: from this model when it can, else from a step-mode copy of its
/// state.
fn generate(model: &mut Model, stream: &Stream, cfg: &JobConfig) -> Result<Vec<u8>, String> {
    let err = |e: cuda_graph::Error| format!("generating: {e}");
    let seed = model.train_config().seed;
    if model.can_evaluate() {
        return model
            .generate(
                stream,
                cfg.prompt.as_bytes(),
                cfg.sample_bytes,
                cfg.temperature,
                seed,
            )
            .map_err(err);
    }
    let mut copy = Model::new(
        stream,
        *model.config(),
        *model.train_config(),
        GraphMode::None,
    )
    .map_err(err)?;
    copy_state(model, &mut copy, stream).map_err(err)?;
    copy.generate(
        stream,
        cfg.prompt.as_bytes(),
        cfg.sample_bytes,
        cfg.temperature,
        seed,
    )
    .map_err(err)
}

/// Copies `from`'s training state into `to` (same configuration).
fn copy_state(from: &Model, to: &mut Model, stream: &Stream) -> cuda_graph::Result<()> {
    let mut values = std::collections::BTreeMap::new();
    for (name, _, v) in from.gather_state(stream)? {
        values.insert(name, v);
    }
    to.load_state(stream, from.steps_done(), |name, _| {
        values
            .remove(name)
            .ok_or_else(|| cuda_graph::Error::InvalidArgument(format!("no tensor {name}")))
    })
}

/// Reads a checkpoint and checks its state's version and step.
fn load_checkpoint(dir: &Path) -> Result<(checkpoint::Checkpoint, CheckpointState), String> {
    let ck = checkpoint::load(dir).map_err(|e| format!("resuming {}: {e}", dir.display()))?;
    let st: CheckpointState = ck
        .state_as()
        .map_err(|e| format!("resuming {}: {e}", dir.display()))?;
    if st.version != CHECKPOINT_VERSION {
        return Err(format!(
            "resuming {}: checkpoint version {}, this build reads {CHECKPOINT_VERSION}",
            dir.display(),
            st.version
        ));
    }
    if st.steps_done > st.train.steps {
        return Err(format!(
            "resuming {}: the checkpoint is at step {} of a {}-step run",
            dir.display(),
            st.steps_done,
            st.train.steps
        ));
    }
    Ok((ck, st))
}

/// Writes the model's state, the sampler's position and an evaluation batch with its loss
/// to `dir` (atomically) when `write`; an expert-parallel rank that does not write still
/// takes part in the evaluation and the gathering. Returns that loss.
fn save_checkpoint(
    dir: &Path,
    model: &mut Model,
    stream: &Stream,
    split: &Split,
    sampler: &Sampler,
    write: bool,
) -> Result<Option<f32>, String> {
    let err = |e: cuda_graph::Error| format!("saving {}: {e}", dir.display());
    let (b, s) = (model.config().batch, model.config().context);
    let mut eval_tokens = vec![0i32; b * s];
    let mut eval_targets = vec![0i32; b * s];
    split
        .validation_batch(0, b, &mut eval_tokens, &mut eval_targets)
        .map_err(|e| format!("saving {}: {e}", dir.display()))?;
    let eval_loss = if model.can_evaluate() {
        Some(
            model
                .evaluate(stream, &eval_tokens, &eval_targets)
                .map_err(err)?,
        )
    } else {
        None
    };
    let mut tensors = Vec::new();
    for (name, shape, v) in model.gather_state(stream).map_err(err)? {
        tensors.push(TensorData::from_slice(&name, &shape, &v));
    }
    if !write {
        return Ok(eval_loss);
    }
    tensors.push(TensorData::from_slice("eval.tokens", &[b, s], &eval_tokens));
    tensors.push(TensorData::from_slice(
        "eval.targets",
        &[b, s],
        &eval_targets,
    ));
    let state = CheckpointState {
        version: CHECKPOINT_VERSION,
        model: *model.config(),
        train: *model.train_config(),
        steps_done: model.steps_done(),
        sampler: sampler.state(),
        eval_loss,
    };
    let state = serde_json::to_value(&state).map_err(|e| e.to_string())?;
    checkpoint::save(dir, &tensors, &state)
        .map_err(|e| format!("saving {}: {e}", dir.display()))?;
    Ok(eval_loss)
}

/// Times `steps` (at least 1) steps of every mode from the same start on the same batches.
pub fn compare_modes(
    stream: &Stream,
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    split: &Split,
    steps: usize,
) -> Result<Vec<ModeRow>, String> {
    if steps == 0 {
        return Err("compare_modes: 0 steps to time".into());
    }
    let step_tokens = model_cfg.tokens() * train_cfg.microbatches;
    let mut rows: Vec<ModeRow> = Vec::new();
    let mut eager: Option<Vec<(u32, u32)>> = None;
    for mode in GraphMode::ALL {
        let err = |e: cuda_graph::Error| format!("mode {}: {e}", mode.name());
        let mut model = Model::new(stream, model_cfg, train_cfg, mode).map_err(err)?;
        let mut sampler = split.sampler(train_cfg.seed).map_err(|e| e.to_string())?;
        let mut tokens = vec![0i32; step_tokens];
        let mut targets = vec![0i32; step_tokens];
        let (start, end) = (
            Event::new(stream.context()).map_err(err)?,
            Event::new(stream.context()).map_err(err)?,
        );
        let mut times = Vec::new();
        let mut bits = Vec::new();
        let mut losses = Vec::new();
        for step in 0..steps {
            next_step_batch(
                &mut sampler,
                split,
                &model,
                stream,
                (&mut tokens, &mut targets),
                (0, 1),
            )?;
            start.record(stream).map_err(err)?;
            model.step(stream, train_cfg.lr_at(step)).map_err(err)?;
            end.record(stream).map_err(err)?;
            let s = model.stats(stream).map_err(err)?;
            times.push(f64::from(Event::elapsed_ms(&start, &end).map_err(err)?));
            bits.push((s.loss.to_bits(), s.grad_norm.to_bits()));
            losses.push(s.loss);
        }
        // The first two steps pay one-time costs (lazy loads, first replays).
        let mut timed: Vec<f64> = times.iter().skip(2.min(steps - 1)).copied().collect();
        let step_ms = median(&mut timed);
        let matches_eager = match &eager {
            None => {
                eager = Some(bits);
                true
            }
            Some(e) => *e == bits,
        };
        let eager_ms = rows.first().map_or(step_ms, |r| r.step_ms);
        rows.push(ModeRow {
            mode,
            step_ms,
            tokens_per_s: step_tokens as f64 / (step_ms / 1e3),
            speedup: eager_ms / step_ms,
            losses,
            matches_eager,
        });
    }
    Ok(rows)
}

/// The comparison table.
pub fn mode_table(rows: &[ModeRow], step_tokens: usize) -> String {
    let body: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.mode.name().to_string(),
                format!("{:.2}", r.step_ms),
                format!("{:.0}", r.tokens_per_s),
                format!("{:.2}x", r.speedup),
                format!("{:.4}", r.losses.last().copied().unwrap_or(f32::NAN)),
                if r.matches_eager { "yes" } else { "NO" }.to_string(),
            ]
        })
        .collect();
    format!(
        "graph modes, {} steps of {step_tokens} tokens each from the same start (median of \
         the steps after the first two, CUDA events):\n{}",
        rows.first().map_or(0, |r| r.losses.len()),
        report::format_table(
            &[
                "graphs",
                "ms/step",
                "tokens/s",
                "vs eager",
                "last loss",
                "= eager bits"
            ],
            &body
        )
    )
}

/// The median of `v` (sorted in place); NaN when empty.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
