//! GPU tests of the train job's model (`fp8_moe::model::Model`): every graph mode computes
//! eager's bits, the loss falls below what byte frequencies alone give, a resumed run
//! continues bit for bit, decoding under a graph is deterministic, and data- and
//! expert-parallel ranks compute what one GPU does.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use cuda_graph::{Context, Stream};
use fp8_moe::model::{GraphMode, Model, ModelConfig, TrainConfig};
use fp8_moe::moe::ep::{ExpertGroup, LocalGroup};
use fp8_moe::rng::Rng;

/// A small model: 2 blocks of d 128 (2 heads), 4 experts top-2 with F 512, 4 sequences of
/// 64 tokens per microbatch, 2 microbatches a step.
fn small() -> (ModelConfig, TrainConfig) {
    (
        ModelConfig {
            d_model: 128,
            heads: 2,
            layers: 2,
            experts: 4,
            top_k: 2,
            // K = 512 in fc2 and 1024 in fc1's data gradient: experts with at most 128 rows
            // (about half of them at 128 rows each on average) meet the GEMM shapes a plain
            // GEMM would split K over, which the per-expert (breaking) mode must not.
            ffn: 512,
            context: 64,
            batch: 4,
            ..ModelConfig::default()
        },
        TrainConfig {
            microbatches: 2,
            lr: 3e-3,
            warmup: 5,
            steps: 60,
            ..TrainConfig::default()
        },
    )
}

/// Text with structure a small model learns quickly: words from a small vocabulary.
fn corpus(rng: &mut Rng, len: usize) -> Vec<u8> {
    const WORDS: [&str; 12] = [
        "the ",
        "graph ",
        "replays ",
        "kernel ",
        "expert ",
        "token ",
        "FP8 ",
        "scale ",
        "device ",
        "stream ",
        "captures ",
        "each ",
    ];
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        out.extend_from_slice(WORDS[rng.below(WORDS.len())].as_bytes());
        if rng.below(8) == 0 {
            out.extend_from_slice(b".\n");
        }
    }
    out.truncate(len);
    out
}

/// A step's batch: `windows` random windows of the corpus.
fn batch(rng: &mut Rng, text: &[u8], windows: usize, seq: usize) -> (Vec<i32>, Vec<i32>) {
    let (mut t, mut y) = (Vec::new(), Vec::new());
    for _ in 0..windows {
        let s = rng.below(text.len() - seq - 1);
        t.extend(text[s..s + seq].iter().map(|&b| i32::from(b)));
        y.extend(text[s + 1..s + seq + 1].iter().map(|&b| i32::from(b)));
    }
    (t, y)
}

/// A model's training state by tensor name.
type State = BTreeMap<String, Vec<f32>>;

/// Runs `steps` steps of `mode` on the batches of `seed`; returns the (loss, grad norm) bits
/// of every step and the final state.
fn run(stream: &Stream, mode: GraphMode, steps: usize, seed: u64) -> (Vec<(u32, u32)>, State) {
    let (cfg, train) = small();
    let mut model = Model::new(stream, cfg, train, mode).unwrap();
    let mut rng = Rng::new(seed, 1);
    let text = corpus(&mut rng, 1 << 16);
    let mut bits = Vec::new();
    for step in 0..steps {
        let (t, y) = batch(&mut rng, &text, cfg.batch * train.microbatches, cfg.context);
        model.load_batch(stream, &t, &y).unwrap();
        model.step(stream, train.lr_at(step)).unwrap();
        let s = model.stats(stream).unwrap();
        assert!(
            s.loss.is_finite() && s.grad_norm.is_finite(),
            "{mode:?} {s:?}"
        );
        bits.push((s.loss.to_bits(), s.grad_norm.to_bits()));
    }
    let state = model
        .state_tensors()
        .into_iter()
        .map(|(n, _, b)| (n, b.to_vec(stream).unwrap()))
        .collect();
    (bits, state)
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_graph_mode_matches_eager_bit_for_bit() {
    let ctx = Context::default_device().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let seed = common::fresh_rng("graph modes").next_u64();
    let (eager, eager_state) = run(&stream, GraphMode::None, 8, seed);
    for mode in [GraphMode::Step, GraphMode::Layer, GraphMode::Breaking] {
        let (bits, state) = run(&stream, mode, 8, seed);
        assert_eq!(
            bits, eager,
            "{mode:?}: losses and gradient norms differ from eager"
        );
        for (name, want) in &eager_state {
            let got = &state[name];
            let same = got
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{mode:?}: state tensor {name} differs from eager's");
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn loss_falls_below_the_unigram_entropy() {
    let ctx = Context::default_device().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let (cfg, train) = small();
    let mut rng = common::fresh_rng("loss falls");
    let text = corpus(&mut rng, 1 << 16);
    // What a model that knows only byte frequencies reaches: the corpus's unigram entropy
    // (nats/byte). Anything below it has learned context.
    let mut counts = [0usize; 256];
    for &b in &text {
        counts[b as usize] += 1;
    }
    let n = text.len() as f64;
    let unigram: f64 = counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| -(c as f64 / n) * (c as f64 / n).ln())
        .sum();
    let mut model = Model::new(&stream, cfg, train, GraphMode::Step).unwrap();
    let mut losses = Vec::new();
    for step in 0..train.steps {
        let (t, y) = batch(&mut rng, &text, cfg.batch * train.microbatches, cfg.context);
        model.load_batch(&stream, &t, &y).unwrap();
        model.step(&stream, train.lr_at(step)).unwrap();
        losses.push(model.stats(&stream).unwrap().loss);
    }
    println!("unigram entropy {unigram:.3} nats; losses {losses:?}");
    // ln(256) = 5.55 at the start (uniform logits, up to the init's noise).
    assert!(
        (losses[0] - 256f32.ln()).abs() < 0.5,
        "first loss {}",
        losses[0]
    );
    let last: f32 = losses[losses.len() - 5..].iter().sum::<f32>() / 5.0;
    assert!(
        (last as f64) < unigram - 0.3,
        "mean of the last 5 losses {last} is not below the unigram entropy {unigram} - 0.3"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_resumed_run_continues_bit_for_bit() {
    let ctx = Context::default_device().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let (cfg, train) = small();
    let seed = common::fresh_rng("resume").next_u64();
    let mut rng = Rng::new(seed, 1);
    let text = corpus(&mut rng, 1 << 16);
    let batches: Vec<_> = (0..6)
        .map(|_| batch(&mut rng, &text, cfg.batch * train.microbatches, cfg.context))
        .collect();
    let mut a = Model::new(&stream, cfg, train, GraphMode::Step).unwrap();
    let mut saved = BTreeMap::new();
    let mut want = Vec::new();
    for (step, (t, y)) in batches.iter().enumerate() {
        if step == 3 {
            for (name, _, buf) in a.state_tensors() {
                saved.insert(name, buf.to_vec(&stream).unwrap());
            }
        }
        a.load_batch(&stream, t, y).unwrap();
        a.step(&stream, train.lr_at(step)).unwrap();
        let s = a.stats(&stream).unwrap();
        if step >= 3 {
            want.push((s.loss.to_bits(), s.grad_norm.to_bits()));
        }
    }
    drop(a);
    // A fresh model (other initial weights: another seed) given the saved state.
    let other = TrainConfig {
        seed: train.seed + 1,
        ..train
    };
    let mut b = Model::new(&stream, cfg, other, GraphMode::None).unwrap();
    b.load_state(&stream, 3, |name, shape| {
        let v = saved[name].clone();
        assert_eq!(v.len(), shape.iter().product::<usize>(), "{name}");
        Ok(v)
    })
    .unwrap();
    let mut got = Vec::new();
    for (step, (t, y)) in batches.iter().enumerate().skip(3) {
        b.load_batch(&stream, t, y).unwrap();
        b.step(&stream, train.lr_at(step)).unwrap();
        let s = b.stats(&stream).unwrap();
        got.push((s.loss.to_bits(), s.grad_norm.to_bits()));
    }
    assert_eq!(got, want, "the resumed run's losses differ");
    // A missing tensor is refused before anything is written.
    let err = b
        .load_state(&stream, 3, |name, _| {
            if name == "head" {
                Err(cuda_graph::Error::InvalidArgument("missing".into()))
            } else {
                Ok(saved[name].clone())
            }
        })
        .unwrap_err();
    assert!(err.to_string().contains("missing"), "{err}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn generation_under_a_graph_is_deterministic_and_leaves_training_alone() {
    let ctx = Context::default_device().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let (cfg, train) = small();
    let mut model = Model::new(&stream, cfg, train, GraphMode::Step).unwrap();
    let mut rng = Rng::new(7, 1);
    let text = corpus(&mut rng, 1 << 15);
    let (t, y) = batch(&mut rng, &text, cfg.batch * train.microbatches, cfg.context);
    model.load_batch(&stream, &t, &y).unwrap();
    model.step(&stream, train.lr_at(0)).unwrap();
    let history = model.scaling().history_buffer().to_vec(&stream).unwrap();
    let a = model.generate(&stream, b"the graph ", 40, 0.8, 3).unwrap();
    let b = model.generate(&stream, b"the graph ", 40, 0.8, 3).unwrap();
    assert_eq!(a.len(), 40);
    assert_eq!(a, b, "same seed, same sample");
    // Greedy decoding of a 70-byte prompt (longer than the context: the window slides).
    let long = vec![b'e'; 70];
    assert_eq!(model.generate(&stream, &long, 5, 0.0, 1).unwrap().len(), 5);
    let after = model.scaling().history_buffer().to_vec(&stream).unwrap();
    assert!(
        history
            .iter()
            .zip(&after)
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "generation changed the FP8 state"
    );
    assert!(model.generate(&stream, b"x", 1, -1.0, 0).is_err());
}

/// What a replica's run reports.
struct Replica {
    /// Each step's (loss, gradient norm).
    stats: Vec<(f32, f32)>,
    /// 8 bytes decoded greedily after the last step.
    sample: Vec<u8>,
    /// The final whole state.
    state: State,
}

/// One replica's run: `steps` steps on rank `rank`'s share (`1 / ranks` of every step's
/// windows, in order) of the batches of `seed`, with `train.microbatches` microbatches,
/// then a greedy sample (every rank decodes at once: under expert parallelism each token's
/// forward is collective).
fn run_replica(
    stream: &Stream,
    model: &mut Model,
    (rank, ranks): (usize, usize),
    steps: usize,
    seed: u64,
) -> Replica {
    let (cfg, train) = (*model.config(), *model.train_config());
    let mut rng = Rng::new(seed, 1);
    let text = corpus(&mut rng, 1 << 16);
    let share = cfg.batch * train.microbatches * cfg.context;
    let mut losses = Vec::new();
    for step in 0..steps {
        let (t, y) = batch(
            &mut rng,
            &text,
            cfg.batch * train.microbatches * ranks,
            cfg.context,
        );
        let mine = rank * share..(rank + 1) * share;
        model
            .load_batch(stream, &t[mine.clone()], &y[mine])
            .unwrap();
        model.step(stream, train.lr_at(step)).unwrap();
        let s = model.stats(stream).unwrap();
        losses.push((s.loss, s.grad_norm));
    }
    let sample = model.generate(stream, b"the graph ", 8, 0.0, 1).unwrap();
    // The whole state (an expert-parallel rank's gathered with the others').
    let state = model
        .gather_state(stream)
        .unwrap()
        .into_iter()
        .map(|(n, _, v)| (n, v))
        .collect();
    Replica {
        stats: losses,
        sample,
        state,
    }
}

/// The model `build` makes over a one-rank communicator, against the plain model in modes
/// none and step over 4 steps of a fresh seed: the same losses and the same whole state,
/// bit for bit. Returns the last mode's model and the plain model's state.
fn one_rank_matches_plain(
    what: &str,
    stream: &Stream,
    build: fn(
        &Stream,
        ModelConfig,
        TrainConfig,
        GraphMode,
        cuda_graph_nccl::Communicator,
    ) -> cuda_graph::Result<Model>,
) -> (Model, State) {
    let seed = common::fresh_rng(what).next_u64();
    let (cfg, train) = small();
    let mut last = None;
    for mode in [GraphMode::None, GraphMode::Step] {
        let (plain, plain_state) = run(stream, mode, 4, seed);
        let mut model = build(stream, cfg, train, mode, one_rank(stream)).unwrap();
        assert_eq!(model.communicator().map(|c| c.size()), Some(1));
        let Replica { stats, state, .. } = run_replica(stream, &mut model, (0, 1), 4, seed);
        let stats: Vec<(u32, u32)> = stats
            .iter()
            .map(|(l, g)| (l.to_bits(), g.to_bits()))
            .collect();
        assert_eq!(
            stats, plain,
            "{what}, {mode:?}: losses or gradient norms differ"
        );
        assert_eq!(state.len(), plain_state.len(), "{what}: tensors");
        for (name, want) in &plain_state {
            assert_eq!(state[name].len(), want.len(), "{what}, {mode:?}: {name}");
            assert!(
                state[name]
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}, {mode:?}: {name} differs"
            );
        }
        last = Some((model, plain_state));
    }
    last.unwrap()
}

/// A one-rank NCCL communicator on `stream`'s device (a process run directly).
fn one_rank(stream: &Stream) -> cuda_graph_nccl::Communicator {
    fp8_moe::dist::communicator(stream.context(), &fp8_moe::dist::Placement::SINGLE).expect("NCCL")
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_one_rank_data_parallel_model_matches_the_plain_model_bit_for_bit() {
    // One rank: the amax max, the gradient sum and the loss sum over NCCL are identities,
    // so every bit must match; in mode step they are captured inside the step graph.
    let ctx = Context::default_device().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    one_rank_matches_plain("data parallel, one rank", &stream, Model::new_data_parallel);
    // Modes whose blocks run in the graphed-callables runtime are refused.
    let (cfg, train) = small();
    let layer = Model::new_data_parallel(&stream, cfg, train, GraphMode::Layer, one_rank(&stream));
    assert!(layer.is_err());
}

#[test]
#[ignore = "needs a CUDA device"]
fn data_parallel_ranks_match_one_gpu_with_all_their_microbatches() {
    // Every GPU of the machine a replica with 2 microbatches, against one GPU running all
    // ranks' microbatches in one step. What differs is the order of the gradient sums (each
    // rank's, then their sum, against one running sum; the experts' in bf16), which can
    // flip an FP8 rounding of the next step's weights and the direction of AdamW's first
    // moves of weights with a gradient near zero: hence the tolerances of
    // `ranks_match_one_gpu`. On one GPU the two runs are the same computation (and agree
    // exactly).
    let n = cuda_graph::driver::Device::count().unwrap() as usize;
    let (ctxs, comms) = gpus_and_communicators(n);
    ranks_match_one_gpu(
        "data parallel",
        (ctxs, comms),
        GraphMode::Step,
        Model::new_data_parallel,
    );
}

/// The contexts of the machine's first `n` GPUs and a communicator over them.
fn gpus_and_communicators(n: usize) -> (Vec<Arc<Context>>, Vec<cuda_graph_nccl::Communicator>) {
    use cuda_graph::driver::Device;
    let ctxs: Vec<_> = (0..n as i32)
        .map(|i| Context::new(Device::get(i).unwrap()).unwrap())
        .collect();
    let comms = cuda_graph_nccl::Communicator::init_all(&ctxs).expect("NCCL");
    (ctxs, comms)
}

/// Ranks (threads, rank `r` on `ctxs[r]` over `groups[r]`) of the models `build` makes,
/// each running its share of the steps of a fresh seed in `mode`, against one GPU (the
/// first context's) running all their microbatches in mode step: every rank reports the same
/// losses and gradient norms and gathers the same state, bit for bit (the gather itself
/// refuses FP8 scaling rows its ranks share but disagree on); they match the one GPU's
/// (exactly with one rank): losses to 1e-3 relative, gradient norms to 1e-3 at the first
/// step (the same weights: only the order of the sums differs) and 1e-2 after it, the
/// optimizers' states exactly, the FP8 scaling state to 3e-2 of each value, parameters and
/// moments to [`STATE_TOLERANCE`] norm-wise.
fn ranks_match_one_gpu<G: Send>(
    what: &str,
    (ctxs, groups): (Vec<Arc<Context>>, Vec<G>),
    mode: GraphMode,
    build: fn(&Stream, ModelConfig, TrainConfig, GraphMode, G) -> cuda_graph::Result<Model>,
) {
    let seed = common::fresh_rng(what).next_u64();
    let (cfg, train) = small();
    let (steps, n) = (4, groups.len());
    // One thread per rank: the ranks' collectives are in flight together.
    let ranks: Vec<Replica> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(r, group)| {
                let ctx = ctxs[r].clone();
                scope.spawn(move || {
                    let stream = Stream::new(&ctx).unwrap();
                    let mut model = build(&stream, cfg, train, mode, group).unwrap();
                    run_replica(&stream, &mut model, (r, n), steps, seed)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let stream = Stream::new(&ctxs[0]).unwrap();
    let all = TrainConfig {
        microbatches: train.microbatches * n,
        ..train
    };
    let mut one = Model::new(&stream, cfg, all, GraphMode::Step).unwrap();
    let one = run_replica(&stream, &mut one, (0, 1), steps, seed);
    let (losses, state) = (&one.stats, &one.state);
    let exact = n == 1;
    let bits = |s: &[(f32, f32)]| -> Vec<(u32, u32)> {
        s.iter().map(|(l, g)| (l.to_bits(), g.to_bits())).collect()
    };
    for (r, rank) in ranks.iter().enumerate() {
        let (rl, rs) = (&rank.stats, &rank.state);
        assert_eq!(
            bits(rl),
            bits(&ranks[0].stats),
            "{what}: ranks {r} and 0 report different losses or gradient norms"
        );
        assert_eq!(rank.sample, ranks[0].sample, "{what}: rank {r}'s sample");
        if exact {
            assert_eq!(rank.sample, one.sample, "{what}: the one GPU's sample");
        }
        for (name, want) in &ranks[0].state {
            assert!(
                rs[name]
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}, rank {r}: {name}"
            );
        }
        for (step, (&(a, ga), &(b, gb))) in rl.iter().zip(losses).enumerate() {
            let tol = if exact { 0.0 } else { 1e-3 * b.abs() };
            assert!(
                (a - b).abs() <= tol,
                "{what}, step {step}: rank {r} loss {a}, one GPU {b}"
            );
            let tol = match (exact, step) {
                (true, _) => 0.0,
                (false, 0) => 1e-3 * gb.abs(),
                (false, _) => 1e-2 * gb.abs(),
            };
            assert!(
                (ga - gb).abs() <= tol,
                "{what}, step {step}: rank {r} gradient norm {ga}, one GPU {gb}"
            );
        }
        assert_eq!(rs.len(), state.len(), "{what}: tensors");
        for (name, want) in state {
            let got = &rs[name];
            assert_eq!(got.len(), want.len(), "{what}, rank {r}: {name}");
            if exact || name.starts_with("optim.state.") {
                // One rank, or the optimizers' step counts and rates: the same bits.
                assert!(
                    got.iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}, rank {r}: {name} differs"
                );
            } else if name.starts_with("fp8.") {
                // Amaxes (and the scales from them) of tensors that differ by bf16 roundings:
                // a few bf16 ulps (2^-8 each) of each value.
                for (i, (a, b)) in got.iter().zip(want).enumerate() {
                    assert!(
                        (a - b).abs() <= 3e-2 * b.abs(),
                        "{what}, rank {r}: {name}[{i}] is {a}, one GPU {b}"
                    );
                }
            } else {
                // Parameters and moments, norm-wise: see `STATE_TOLERANCE`. A second moment
                // holds squared gradients, whose relative differences are twice the
                // gradients' (seen: an fc1 exp_avg_sq 1.01e-2 off with two threaded
                // data-parallel ranks, its exp_avg well inside 1e-2).
                let bound = if name.ends_with(".exp_avg_sq") {
                    2.0 * STATE_TOLERANCE
                } else {
                    STATE_TOLERANCE
                };
                let err = rel_norm(got, want);
                assert!(
                    err <= bound,
                    "{what}, rank {r}: {name} off by {err:.2e} norm-wise (bound {bound:.0e})"
                );
            }
        }
    }
}

/// The bound on `|got - want| / |want|` (L2) of a tensor of parameters or AdamW moments,
/// ranks against one GPU. The experts' weight gradients are bf16 (each microbatch's GEMM adds
/// into them and rounds, 2^-9 relative) and are summed in another grouping (over the ranks,
/// or in one GEMM over every rank's rows, whose FP8 accumulator regroups them too), so each
/// element of a moment can differ by a few bf16 roundings, ~4e-3 of itself, about 2e-3
/// norm-wise. AdamW's first steps move a weight by about `lr * sign(gradient)`, so a weight
/// whose gradient is within that rounding of zero can move the other way (2 lr, ~1e-3): a
/// fraction of a percent of the elements, ~5e-3 of a weight tensor's norm at worst. 1e-2
/// covers both. What it is there to catch (an expert's gradient on the wrong rank or
/// missing a rank's tokens, a loss scaled by the ranks once too often) moves the AdamW
/// moments by 0.3 or more of their norm; the parameters move less (AdamW's update hardly
/// depends on the gradient's scale, and 4 steps move a weight by at most ~2 lr each), so
/// the moments are where such a bug shows, and the losses and gradient norms above.
const STATE_TOLERANCE: f64 = 1e-2;

/// `|got - want| / |want|`, L2 (0 for two zero tensors).
fn rel_norm(got: &[f32], want: &[f32]) -> f64 {
    let (mut d, mut w) = (0f64, 0f64);
    for (&a, &b) in got.iter().zip(want) {
        d += (f64::from(a) - f64::from(b)).powi(2);
        w += f64::from(b).powi(2);
    }
    if w == 0.0 { d.sqrt() } else { (d / w).sqrt() }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_one_rank_expert_parallel_model_matches_the_plain_model_bit_for_bit() {
    // One rank holding every expert: the gathers and the all-to-all move rows to where they
    // are, the sums and maxes over NCCL are identities, and every bit must match the plain
    // model's, in mode step with the collectives inside the step graph.
    let ctx = Context::default_device().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let (cfg, train) = small();
    let (mut model, plain_state) = one_rank_matches_plain(
        "expert parallel, one rank",
        &stream,
        Model::new_expert_parallel,
    );
    assert_eq!(model.expert_ranks(), 1);
    // A fresh rank that loads the plain model's state evaluates as the model it loaded.
    let mut rng = common::fresh_rng("expert parallel, loaded state");
    let text = corpus(&mut rng, 1 << 14);
    let (tokens, targets) = batch(&mut rng, &text, cfg.batch, cfg.context);
    let want = model.evaluate(&stream, &tokens, &targets).unwrap();
    let mut fresh =
        Model::new_expert_parallel(&stream, cfg, train, GraphMode::Step, one_rank(&stream))
            .unwrap();
    fresh
        .load_state(&stream, 4, |name, shape| {
            plain_state
                .get(name)
                .cloned()
                .ok_or_else(|| cuda_graph::Error::InvalidArgument(format!("no {name} {shape:?}")))
        })
        .unwrap();
    let got = fresh.evaluate(&stream, &tokens, &targets).unwrap();
    assert_eq!(got.to_bits(), want.to_bits(), "{got} vs {want}");
    // Modes whose blocks run in the graphed-callables runtime are refused.
    let layer =
        Model::new_expert_parallel(&stream, cfg, train, GraphMode::Layer, one_rank(&stream));
    assert!(layer.is_err());
}

#[test]
#[ignore = "needs a CUDA device"]
fn expert_parallel_ranks_match_one_gpu_with_all_their_microbatches() {
    // As many ranks as the machine's GPUs allow (the 4 experts split in equal parts of at
    // least top-k = 2: 1 or 2 ranks), each with 2 microbatches and half the experts, against
    // one GPU holding every expert and running all ranks' microbatches in one step. The
    // ranks' rows meet the same weights and scales as on one GPU; what differs is the order
    // of the sums (the replicated gradients summed over the ranks, each expert's gradient in
    // one GEMM over every rank's rows): the tolerances of the data-parallel test.
    let (cfg, _) = small();
    let gpus = cuda_graph::driver::Device::count().unwrap() as usize;
    let n = (1..=gpus)
        .rev()
        .find(|r| cfg.experts % r == 0 && cfg.experts / r >= cfg.top_k)
        .unwrap();
    ranks_match_one_gpu(
        "expert parallel",
        gpus_and_communicators(n),
        GraphMode::Step,
        Model::new_expert_parallel,
    );
}

/// `n` ranks of a [`LocalGroup`] (threads over one device) and `n` handles of that device.
fn threads_on_one_gpu(
    ctx: &Arc<Context>,
    n: usize,
) -> (Vec<Arc<Context>>, Vec<Arc<dyn ExpertGroup>>) {
    let groups = LocalGroup::new(n)
        .unwrap()
        .into_iter()
        .map(|g| Arc::new(g) as Arc<dyn ExpertGroup>)
        .collect();
    (vec![ctx.clone(); n], groups)
}

#[test]
#[ignore = "needs a CUDA device"]
fn data_parallel_ranks_as_threads_on_one_gpu_match_one_gpu() {
    // Two replicas that are threads over this GPU (LocalGroup: the gradient sum, the
    // amax max and the loss sum by device copies and a reduction kernel; mode none), against
    // one GPU with both ranks' microbatches: the two-rank test on the machine every session
    // gets.
    let ctx = Context::default_device().unwrap();
    ranks_match_one_gpu(
        "data parallel, threads",
        threads_on_one_gpu(&ctx, 2),
        GraphMode::None,
        Model::new_data_parallel_in,
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn expert_parallel_ranks_as_threads_on_one_gpu_match_one_gpu() {
    // Two ranks that are threads over this GPU (LocalGroup: every collective, the gradient
    // and amax reductions included, device copies and a reduction kernel; mode none), each
    // with 2 experts of 4, against one GPU holding them all with both ranks' microbatches:
    // the two-rank arithmetic of the multi-GPU test on the machine every session gets, with
    // its tolerance (the order of the sums differs).
    let ctx = Context::default_device().unwrap();
    ranks_match_one_gpu(
        "expert parallel, threads",
        threads_on_one_gpu(&ctx, 2),
        GraphMode::None,
        Model::new_expert_parallel_in,
    );
    // The step cannot be captured over such a group.
    let stream = Stream::new(&ctx).unwrap();
    let (cfg, train) = small();
    let one: Arc<dyn ExpertGroup> = Arc::new(LocalGroup::new(1).unwrap().pop().unwrap());
    let e = Model::new_expert_parallel_in(&stream, cfg, train, GraphMode::Step, one).unwrap_err();
    assert!(e.to_string().contains("cannot be captured"), "{e}");
    // Experts that do not split are refused before any collective: top-3 of 4 experts is a
    // valid model, but 2 ranks would hold 2 experts each, fewer than top-k.
    let (_, mut two) = threads_on_one_gpu(&ctx, 2);
    let top3 = ModelConfig { top_k: 3, ..cfg };
    assert!(top3.check().is_ok());
    let e = Model::new_expert_parallel_in(&stream, top3, train, GraphMode::None, two.remove(0))
        .unwrap_err();
    assert!(e.to_string().contains("experts per rank"), "{e}");
}
