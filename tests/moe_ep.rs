//! Expert parallelism ([`ExpertParallelMoe`]) against the single-GPU [`MoeLayer`] holding all
//! the experts, on fresh random data.
//!
//! Ranks are threads over one device ([`LocalGroup`]) for 2 and 4 ranks, and a one-rank NCCL
//! communicator for the capture: each rank routes its own tokens, the experts run on the rank
//! holding them over every rank's tokens, and the rows come home. Each rank's output, input
//! gradient, router-weight gradient and losses must equal, bit for bit, those of a single-GPU
//! layer run on that rank's tokens alone (the same rows meet the same weights, scales and
//! sums). Each expert's weight gradient must equal the sum of the single-GPU layers' over all
//! ranks' tokens to the FP8 GEMM's accumulation: on one rank its rows are summed in one GEMM,
//! on one GPU one GEMM per rank's batch and the batches added, so the rows fall into other
//! 128-row k-blocks. The tensor cores sum a k-block's FP8 products in an accumulator of about
//! 14 mantissa bits (DeepSeek-V3, section 3.3.2) before the f32 promotion, so regrouping the
//! rows moves each k-block's sum by about 2^-14 ~ 6e-5 relative (1.1e-4 norm-wise seen on the
//! H200 at 2 ranks). The bound, 1e-3 of the gradient's norm, is ten times that and ten times
//! below a missing or doubled row, which moves the gradient by about 1 / (rows per expert) ~
//! 1e-2 (96 rows an expert at 2 ranks, 192 at 4). With one rank the rows are the single GPU's
//! and so are the bits.

use std::sync::Arc;

mod common;
use common::{fixed_scaling, fresh_rng, random_params, to_bf16, zeroed_saved};

use cuda_graph::half::bf16;
use cuda_graph::{CaptureMode, Context, DeviceBuffer, GraphExec, InstantiateFlags, Stream};
use fp8_kernels::{CastScaling, HpBuffer};
use fp8_moe::dist::{NcclGroup, Placement, communicator};
use fp8_moe::moe::ep::{ExpertGroup, ExpertParallelMoe, GroupOp, LocalGroup};
use fp8_moe::moe::layer::{
    ExpertGemm, Fp8Recipe, GradDtype, MoeLayer, MoeLayerConfig, MoeParams, WeightGrad,
};
use fp8_moe::moe::routing::{RouterConfig, ScoreFn};
use graphed_callables::{Callable, GraphIndex, Slot};

fn config_for(expert_gemm: ExpertGemm) -> MoeLayerConfig {
    MoeLayerConfig {
        tokens: 192,
        hidden: 128,
        ffn: 64,
        experts: 8,
        router: RouterConfig {
            top_k: 2,
            score: ScoreFn::Softmax,
            renormalize: false,
            aux_coef: 0.05,
            z_coef: 0.01,
        },
        recipe: Fp8Recipe::Hybrid,
        expert_gemm,
        scaling: CastScaling::Delayed,
        grad_dtype: GradDtype::F32,
    }
}

fn config() -> MoeLayerConfig {
    config_for(ExpertGemm::Grouped)
}

/// What one rank's pass wrote: the bits of out, dx, the router weight's gradient and the
/// losses, and the f32 weight gradients of fc1 and fc2 (`[experts, ...]`).
#[derive(Debug, Clone, PartialEq)]
struct RankResult {
    bits: Vec<Vec<u32>>,
    dw1: Vec<f32>,
    dw2: Vec<f32>,
}

impl RankResult {
    /// Reads a pass's outputs in `io`, its `losses` and the gradients (router, fc1, fc2).
    fn read(
        stream: &Stream,
        io: &Io,
        losses: &DeviceBuffer<f32>,
        (dwr, dw1, dw2): (&DeviceBuffer<f32>, &WeightGrad, &WeightGrad),
    ) -> RankResult {
        RankResult {
            bits: vec![
                bf16_bits(stream, &io.out),
                bf16_bits(stream, &io.dx),
                f32_bits(stream, dwr),
                f32_bits(stream, losses),
            ],
            dw1: grad(stream, dw1),
            dw2: grad(stream, dw2),
        }
    }
}

fn bf16_bits(stream: &Stream, b: &DeviceBuffer<bf16>) -> Vec<u32> {
    let v = b.to_vec(stream).unwrap();
    v.iter().map(|x| u32::from(x.to_bits())).collect()
}

fn f32_bits(stream: &Stream, b: &DeviceBuffer<f32>) -> Vec<u32> {
    b.to_vec(stream)
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

fn grad(stream: &Stream, g: &WeightGrad) -> Vec<f32> {
    g.to_f32_vec(stream).unwrap()
}

/// A rank's tokens and output gradient.
struct Batch {
    x: Vec<f32>,
    dy: Vec<f32>,
}

/// The buffers of one pass, outputs poisoned.
struct Io {
    x: DeviceBuffer<bf16>,
    dy: DeviceBuffer<bf16>,
    out: DeviceBuffer<bf16>,
    dx: DeviceBuffer<bf16>,
}

impl Io {
    fn new(stream: &Stream, b: &Batch) -> Io {
        let io = Io {
            x: DeviceBuffer::from_host(stream, &to_bf16(&b.x)).unwrap(),
            dy: DeviceBuffer::from_host(stream, &to_bf16(&b.dy)).unwrap(),
            out: DeviceBuffer::alloc(stream.context(), b.x.len()).unwrap(),
            dx: DeviceBuffer::alloc(stream.context(), b.x.len()).unwrap(),
        };
        io.poison(stream);
        io
    }

    fn poison(&self, stream: &Stream) {
        self.out.memset_bytes(stream, 0xff).unwrap();
        self.dx.memset_bytes(stream, 0xff).unwrap();
    }
}

/// The single-GPU layer with all experts on one rank's batch (a fresh layer: its gradients
/// are that batch's alone).
fn one_gpu(
    ctx: &Arc<Context>,
    cfg: MoeLayerConfig,
    params: &MoeParams,
    batch: &Batch,
) -> RankResult {
    let stream = Stream::new(ctx).unwrap();
    let scaling = fixed_scaling(&stream, &cfg);
    let mut layer = MoeLayer::new(&stream, cfg, params, scaling, 0).unwrap();
    let saved = zeroed_saved(&stream, &layer.saved_bytes());
    let io = Io::new(&stream, batch);
    let at = GraphIndex {
        chunk: 0,
        microbatch: 0,
        layer: 0,
    };
    let slot = Slot::new(at, vec![&io.x], vec![&io.out], saved.iter().collect());
    layer.cast_weights(&stream, &slot).unwrap();
    layer.forward(&stream, &[&io.x], &[&io.out], &slot).unwrap();
    layer
        .backward(&stream, &[&io.dy], &[&io.dx], &slot)
        .unwrap();
    let losses = layer.routing_of(&saved[0]).unwrap().losses;
    let grads = (layer.router_weight().1, layer.fc1().1, layer.fc2().1);
    RankResult::read(&stream, &io, &losses, grads)
}

/// One rank's part of the expert-parallel layer over `group`, on its batch; with `capture`,
/// the pass is also captured, replayed onto poisoned outputs and zeroed gradients, and must
/// give the eager bits.
fn ep_rank(
    ctx: &Arc<Context>,
    cfg: MoeLayerConfig,
    params: &MoeParams,
    batch: &Batch,
    group: Arc<dyn ExpertGroup>,
    capture: bool,
) -> RankResult {
    let stream = Stream::new(ctx).unwrap();
    let experts_cfg = MoeLayerConfig {
        experts: cfg.experts / group.size(),
        ..cfg
    };
    let scaling = fixed_scaling(&stream, &experts_cfg);
    let layer = ExpertParallelMoe::new(&stream, cfg, params, scaling, 0, group).unwrap();
    let saved = zeroed_saved(&stream, &layer.saved_bytes());
    let saved: Vec<&DeviceBuffer<u8>> = saved.iter().collect();
    let io = Io::new(&stream, batch);
    layer.cast_weights(&stream).unwrap();
    let pass = |s: &Stream| -> cuda_graph::Result<()> {
        layer.forward(s, &io.x, &io.out, &saved)?;
        layer.backward(s, &io.x, &io.dy, &io.dx, &saved, false)
    };
    let result = |layer: &ExpertParallelMoe| {
        let losses = layer.routing_of(saved[0]).unwrap().losses;
        let grads = (layer.router_weight().1, layer.fc1().1, layer.fc2().1);
        RankResult::read(&stream, &io, &losses, grads)
    };
    pass(&stream).unwrap();
    let eager = result(&layer);
    if capture {
        let graph = stream
            .capture(CaptureMode::ThreadLocal, |cs| pass(cs.stream()))
            .unwrap();
        let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
        io.poison(&stream);
        layer.fc1().1.zero(&stream).unwrap();
        layer.fc2().1.zero(&stream).unwrap();
        layer.router_weight().1.memset_bytes(&stream, 0).unwrap();
        exec.launch(&stream).unwrap();
        stream.synchronize().unwrap();
        assert!(
            result(&layer) == eager,
            "the graph replay differs from eager"
        );
    }
    eager
}

fn batches(rng: &mut fp8_moe::rng::Rng, ranks: usize) -> Vec<Batch> {
    let n = config().tokens * config().hidden;
    (0..ranks)
        .map(|_| Batch {
            x: rng.vec(n, 1.0),
            dy: rng.vec(n, 0.5),
        })
        .collect()
}

/// Norm-wise relative error of `got` against `want`.
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, w)| (f64::from(g) - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den.max(1e-300)).sqrt()
}

/// Each rank against the single-GPU layer on its batch (bits), and its experts' weight
/// gradients against the sum of the single-GPU ones over all batches (f32 rounding).
fn check_ranks(label: &str, ep: &[RankResult], single: &[RankResult]) {
    let ranks = ep.len();
    let (e, per_rank) = (config().experts, config().experts / ranks);
    let names = ["out", "dx", "router weight gradient", "losses"];
    for (r, (got, want)) in ep.iter().zip(single).enumerate() {
        for (i, name) in names.iter().enumerate() {
            let bad = got.bits[i]
                .iter()
                .zip(&want.bits[i])
                .filter(|(a, b)| a != b)
                .count();
            assert_eq!(bad, 0, "{label}: rank {r}'s {name} differs in {bad} values");
        }
        for (name, got, want) in [
            (
                "fc1",
                &got.dw1,
                single.iter().map(|s| &s.dw1).collect::<Vec<_>>(),
            ),
            (
                "fc2",
                &got.dw2,
                single.iter().map(|s| &s.dw2).collect::<Vec<_>>(),
            ),
        ] {
            let per_expert = want[0].len() / e;
            let mine = r * per_rank * per_expert..(r + 1) * per_rank * per_expert;
            let sum: Vec<f64> = mine
                .clone()
                .map(|i| want.iter().map(|w| f64::from(w[i])).sum())
                .collect();
            assert_eq!(got.len(), sum.len(), "{label}: rank {r}'s {name} gradient");
            let err = rel_err(got, &sum);
            println!("{label}: rank {r} {name} weight gradient rel err {err:.2e}");
            assert!(
                err < 1e-3,
                "{label}: rank {r}'s {name} weight gradient is {err:.2e} from the sum"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn ranks_on_threads_equal_the_one_gpu_layer() {
    let ctx = Context::default_device().unwrap();
    let mut rng = fresh_rng("ranks_on_threads_equal_the_one_gpu_layer");
    // Full-layer (static exchange) and breaking-layer (exact sizes, counts read back).
    for (mode, ranks) in [
        (ExpertGemm::Grouped, 2),
        (ExpertGemm::Grouped, 4),
        (ExpertGemm::PerExpert, 2),
        (ExpertGemm::PerExpert, 4),
    ] {
        let cfg = config_for(mode);
        let params = random_params(&mut rng, &cfg);
        let batches = Arc::new(batches(&mut rng, ranks));
        let single: Vec<RankResult> = batches
            .iter()
            .map(|b| one_gpu(&ctx, cfg, &params, b))
            .collect();
        let groups = LocalGroup::new(ranks).unwrap();
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let (ctx, params, batches) = (ctx.clone(), params.clone(), batches.clone());
                std::thread::spawn(move || {
                    let r = g.rank();
                    ep_rank(&ctx, cfg, &params, &batches[r], Arc::new(g), false)
                })
            })
            .collect();
        let ep: Vec<RankResult> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        check_ranks(&format!("{mode:?}, {ranks} ranks"), &ep, &single);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn one_nccl_rank_captured_equals_eager_and_the_one_gpu_layer() {
    let ctx = Context::default_device().unwrap();
    let mut rng = fresh_rng("one_nccl_rank_captured_equals_eager_and_the_one_gpu_layer");
    let comm = communicator(&ctx, &Placement::SINGLE).unwrap();
    let group: Arc<dyn ExpertGroup> = Arc::new(NcclGroup::new(comm));
    // Full-layer captured and replayed; breaking-layer eager (it reads counts back).
    for (mode, capture) in [(ExpertGemm::Grouped, true), (ExpertGemm::PerExpert, false)] {
        let cfg = config_for(mode);
        let params = random_params(&mut rng, &cfg);
        let batch = batches(&mut rng, 1).pop().unwrap();
        let ep = ep_rank(&ctx, cfg, &params, &batch, group.clone(), capture);
        let single = one_gpu(&ctx, cfg, &params, &batch);
        let label = format!("{mode:?}, one NCCL rank");
        check_ranks(
            &label,
            std::slice::from_ref(&ep),
            std::slice::from_ref(&single),
        );
        // One rank holds every expert and plans the same rows: the weight gradients too are
        // the single GPU's bits.
        assert!(
            ep.dw1 == single.dw1 && ep.dw2 == single.dw2,
            "{label}: weight gradients differ"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn local_group_all_reduce_gives_every_rank_the_same_reduction() {
    // 3 ranks as threads, f32 and bf16, sum / average / max of fresh random values (in
    // place, a length that is no multiple of the block): every rank holds the reduction of
    // the ranks' inputs in rank order, f32 sums, bf16 rounded once, bit for bit; f16 is
    // refused.
    let ctx = Context::default_device().unwrap();
    let mut rng = fresh_rng("local_group_all_reduce");
    let (ranks, len) = (3usize, 1000 + rng.below(100));
    let inputs: Arc<Vec<Vec<f32>>> = Arc::new((0..ranks).map(|_| rng.vec(len, 4.0)).collect());
    let want = |op: GroupOp, round: fn(f32) -> f32| -> Vec<u32> {
        (0..len)
            .map(|i| {
                let mut acc = round(inputs[0][i]);
                for x in &inputs[1..] {
                    acc = match op {
                        GroupOp::Max => acc.max(round(x[i])),
                        _ => acc + round(x[i]),
                    };
                }
                let v = if op == GroupOp::Avg {
                    acc * (1.0 / ranks as f32)
                } else {
                    acc
                };
                round(v).to_bits()
            })
            .collect()
    };
    let groups = LocalGroup::new(ranks).unwrap();
    let handles: Vec<_> = groups
        .into_iter()
        .map(|g| {
            let (ctx, inputs) = (ctx.clone(), inputs.clone());
            std::thread::spawn(move || {
                let stream = Stream::new(&ctx).unwrap();
                let mine = &inputs[g.rank()];
                let mut got = Vec::new();
                for op in [GroupOp::Sum, GroupOp::Avg, GroupOp::Max] {
                    let f = DeviceBuffer::from_host(&stream, mine).unwrap();
                    g.all_reduce(&stream, HpBuffer::F32(&f), op).unwrap();
                    let b = DeviceBuffer::from_host(&stream, &to_bf16(mine)).unwrap();
                    g.all_reduce(&stream, HpBuffer::Bf16(&b), op).unwrap();
                    got.push((op, f32_bits(&stream, &f), bf16_bits(&stream, &b)));
                }
                let h = DeviceBuffer::<cuda_graph::half::f16>::alloc(&ctx, 4).unwrap();
                let e = g.all_reduce(&stream, HpBuffer::F16(&h), GroupOp::Sum);
                assert!(e.unwrap_err().to_string().contains("f16"));
                got
            })
        })
        .collect();
    let bf = |x: f32| bf16::from_f32(x).to_f32();
    for (r, h) in handles.into_iter().enumerate() {
        for (op, f, b) in h.join().unwrap() {
            assert_eq!(f, want(op, |x| x), "rank {r}, f32 {op:?}");
            let b: Vec<u32> = b
                .iter()
                .map(|&v| f32::from_bits(v << 16).to_bits())
                .collect();
            assert_eq!(b, want(op, bf), "rank {r}, bf16 {op:?}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn bad_inputs_are_errors() {
    let ctx = Context::default_device().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let mut rng = fresh_rng("bad_inputs_are_errors");
    let cfg = config();
    let params = random_params(&mut rng, &cfg);
    let group: Arc<dyn ExpertGroup> = Arc::new(LocalGroup::new(1).unwrap().pop().unwrap());
    let scaling = fixed_scaling(&stream, &cfg);
    let short = MoeParams {
        w1: params.w1[1..].to_vec(),
        ..params.clone()
    };
    let e = ExpertParallelMoe::new(&stream, cfg, &short, scaling.clone(), 0, group.clone())
        .unwrap_err()
        .to_string();
    assert!(e.contains("w1"), "{e}");
    let three: Arc<dyn ExpertGroup> = Arc::new(LocalGroup::new(3).unwrap().pop().unwrap());
    let e = ExpertParallelMoe::new(&stream, cfg, &params, scaling.clone(), 0, three)
        .unwrap_err()
        .to_string();
    assert!(e.contains("do not split over 3"), "{e}");
    let layer = ExpertParallelMoe::new(&stream, cfg, &params, scaling, 0, group).unwrap();
    let saved = zeroed_saved(&stream, &layer.saved_bytes());
    let saved: Vec<&DeviceBuffer<u8>> = saved.iter().collect();
    let n = cfg.tokens * cfg.hidden;
    let x = DeviceBuffer::<bf16>::alloc(&ctx, n).unwrap();
    let small = DeviceBuffer::<bf16>::alloc(&ctx, n - 1).unwrap();
    let e = layer.forward(&stream, &x, &small, &saved).unwrap_err();
    assert!(e.to_string().contains("out has"), "{e}");
    let e = layer.forward(&stream, &x, &x, &saved[..2]).unwrap_err();
    assert!(e.to_string().contains("saved buffers"), "{e}");
}

/// Every output and input gradient of two steps of two microbatches (forward, forward,
/// backward, backward) run by the graphed-callables runtime over `layer` (its warmup's
/// gradients zeroed after the build), then the bits of its gradients `grads` (router, fc1,
/// fc2).
fn runtime_bits(
    stream: &Stream,
    layer: Box<dyn Callable<bf16>>,
    grads: (DeviceBuffer<f32>, WeightGrad, WeightGrad),
    data: &[Batch],
) -> Vec<Vec<u32>> {
    use graphed_callables::{GraphedCallables, GraphedOptions, Schedule, Step};
    let up = |v: &[f32]| DeviceBuffer::from_host(stream, &to_bf16(v)).unwrap();
    let schedule = Schedule::new(&[1, 1, -1, -1], vec![1]).unwrap();
    let sample = up(&data[0].x);
    let g = GraphedCallables::build(
        stream,
        vec![layer],
        &[vec![&sample]],
        GraphedOptions::new(schedule.clone()),
    )
    .unwrap();
    grads.0.memset_bytes(stream, 0).unwrap();
    grads.1.zero(stream).unwrap();
    grads.2.zero(stream).unwrap();
    let mut out = Vec::new();
    for step in 0..2 {
        for st in schedule.steps() {
            let mb = st.microbatch();
            let b = &data[step * 2 + mb];
            match st {
                Step::Forward { .. } => {
                    let y = g.forward(0, mb, &[&up(&b.x)], stream).unwrap();
                    out.push(bf16_bits(stream, &y[0]));
                }
                Step::Backward { .. } => {
                    let dx = g.backward(0, mb, &[&up(&b.dy)], stream).unwrap();
                    out.push(bf16_bits(stream, &dx[0]));
                }
                Step::WeightGrad { .. } => g.weight_grad(0, mb, stream).unwrap(),
            }
        }
    }
    out.push(f32_bits(stream, &grads.0));
    for g in [&grads.1, &grads.2] {
        out.push(grad(stream, g).iter().map(|v| v.to_bits()).collect());
    }
    out
}

#[test]
#[ignore = "needs a CUDA device"]
fn in_the_graphed_runtime_one_nccl_rank_equals_the_one_gpu_layer() {
    let ctx = Context::default_device().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let mut rng = fresh_rng("in_the_graphed_runtime_one_nccl_rank_equals_the_one_gpu_layer");
    let comm = communicator(&ctx, &Placement::SINGLE).unwrap();
    let group: Arc<dyn ExpertGroup> = Arc::new(NcclGroup::new(comm));
    // Full-layer: one graph each way with the collectives in it; breaking-layer: eager
    // segments.
    for mode in [ExpertGemm::Grouped, ExpertGemm::PerExpert] {
        let cfg = config_for(mode);
        let params = random_params(&mut rng, &cfg);
        let data = batches(&mut rng, 4);
        let single = MoeLayer::new(&stream, cfg, &params, fixed_scaling(&stream, &cfg), 0).unwrap();
        let grads = (
            single.router_weight().1.share(),
            single.fc1().1.share(),
            single.fc2().1.share(),
        );
        let want = runtime_bits(&stream, Box::new(single), grads, &data);
        let ep = ExpertParallelMoe::new(
            &stream,
            cfg,
            &params,
            fixed_scaling(&stream, &cfg),
            0,
            group.clone(),
        )
        .unwrap();
        let grads = (
            ep.router_weight().1.share(),
            ep.fc1().1.share(),
            ep.fc2().1.share(),
        );
        let got = runtime_bits(&stream, Box::new(ep), grads, &data);
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let bad = g.iter().zip(w).filter(|(a, b)| a != b).count();
            assert_eq!(bad, 0, "{mode:?}: result {i} differs in {bad} values");
        }
    }
}
