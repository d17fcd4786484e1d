//! `fp8-moe bench dist`: NCCL collectives eager and captured in CUDA graphs, the FP8 amax
//! reduction's cost inside a graph, the MoE layer's step expert parallel over every rank
//! against one GPU, and the train job's default model data parallel over every rank against
//! one GPU.
//!
//! Run it on every GPU with `fp8-moe --gpus N bench dist` (rank 0 prints and writes the
//! JSON); run directly it is one rank, where NCCL's collectives are local copies: the
//! figures then show the call and graph overheads, not the links, and no target is judged.
//! The yardsticks are PyTorch's with NCCL 2.28 on the two-GPU H200 machine (NV18 NVLink, NVLS
//! off), from the issue that set the targets.

use std::sync::Arc;

use cuda_graph::half::bf16;
use cuda_graph::{CaptureMode, Context, DeviceBuffer, GraphExec, InstantiateFlags, Stream};
use cuda_graph_nccl::{Communicator, ReduceOp};
use fp8_kernels::{AmaxAlgo, DelayedScaling};
use fp8_moe::dist::{NcclGroup, Placement, communicator};
use fp8_moe::model::{GraphMode, Model, ModelConfig, TrainConfig};
use fp8_moe::moe::ep::ExpertParallelMoe;
use fp8_moe::moe::layer::{ExpertGemm, GradDtype, MoeLayer, MoeLayerConfig, MoeParams, formats};
use graphed_callables::{Callable, GraphIndex, Slot};

use super::{BenchResult, Row, event_median_ms};

const WARMUP: usize = 5;
const REPS: usize = 20;

/// PyTorch's all-reduce bus bandwidth on two H200s, GB/s: (bytes, eager, captured).
const TORCH_ALL_REDUCE: [(usize, f64, f64); 2] = [(1 << 20, 22.0, 65.0), (256 << 20, 289.0, 302.0)];
/// PyTorch's 256-byte max all-reduce, eager, microseconds.
const TORCH_SMALL_MAX_US: f64 = 50.0;
/// PyTorch's all-to-all of 128 MiB, bus bandwidth GB/s.
const TORCH_ALL_TO_ALL: f64 = 482.0;
/// The amax reduction's budget per step inside the graph, microseconds.
const AMAX_TARGET_US: f64 = 15.0;
/// The amaxes reduced per step in the amax row: f32 slots of a large recipe's history
/// (1024 tensors, as in a 32-layer MoE stack's registered casts, history 1: the reduction
/// runs over the current amaxes).
const AMAX_SLOTS: usize = 1024;

/// The EP step's budget against the one-GPU step over every rank's tokens.
const EP_TARGET: f64 = 0.6;

/// One rank's side of the benchmark.
struct Rank {
    comm: Communicator,
    stream: Stream,
}

impl Rank {
    /// Median milliseconds of `body` run eagerly, and of one captured graph of it replayed.
    fn eager_and_captured(
        &self,
        body: impl Fn(&Stream) -> cuda_graph::Result<()>,
    ) -> BenchResult<(f64, f64)> {
        let eager = event_median_ms(&self.stream, WARMUP, REPS, || Ok(body(&self.stream)?))?;
        let graph = self
            .stream
            .capture(CaptureMode::ThreadLocal, |s| body(s.stream()))?;
        let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
        let captured = event_median_ms(&self.stream, WARMUP, REPS, || {
            exec.launch(&self.stream)?;
            Ok(())
        })?;
        Ok((eager, captured))
    }
}

/// NCCL's bus bandwidth of a collective over `bytes` in `ms` on `n` ranks, GB/s:
/// all-reduce moves `2 (n - 1) / n` of the data over each link, all-to-all `(n - 1) / n`.
fn bus_gbs(bytes: usize, ms: f64, factor: f64) -> f64 {
    bytes as f64 / (ms * 1e-3) / 1e9 * factor
}

/// Runs the benchmark on this process's rank.
pub fn run() -> BenchResult<Vec<Row>> {
    let placement = Placement::from_env()?;
    let ctx: Arc<Context> = placement.context()?;
    let comm = communicator(&ctx, &placement)?;
    let stream = Stream::new(&ctx)?;
    let rank = Rank { comm, stream };
    let n = rank.comm.size();
    let judged = n >= 2;
    let ar_factor = 2.0 * (n as f64 - 1.0) / n as f64;
    let a2a_factor = (n as f64 - 1.0) / n as f64;
    // Bus bandwidth on several ranks; on one (no links) the algorithm bandwidth, bytes/time.
    let (bw, bw_name) = if judged {
        (ar_factor, "bus")
    } else {
        (1.0, "alg")
    };
    let mut rows = Vec::new();

    for (bytes, torch_eager, torch_graph) in TORCH_ALL_REDUCE {
        let len = bytes / 4;
        let send = DeviceBuffer::<f32>::alloc(&ctx, len)?;
        let recv = DeviceBuffer::<f32>::alloc(&ctx, len)?;
        send.memset_bytes(&rank.stream, 0)?;
        let (eager, captured) = rank
            .eager_and_captured(|s| Ok(rank.comm.all_reduce(&send, &recv, ReduceOp::Sum, s)?))?;
        let (e, c) = (bus_gbs(bytes, eager, bw), bus_gbs(bytes, captured, bw));
        let mib = bytes >> 20;
        rows.push(Row {
            name: format!("all-reduce {mib} MiB f32, eager ({n} ranks)"),
            value: e,
            unit: "GB/s",
            yardstick: format!(
                "{bw_name}bw; {eager:.3} ms; PyTorch on 2 H200s: {torch_eager:.0} GB/s busbw"
            ),
            pass: None,
        });
        rows.push(Row {
            name: format!("all-reduce {mib} MiB f32, captured ({n} ranks)"),
            value: c,
            unit: "GB/s",
            yardstick: format!(
                "{bw_name}bw; {captured:.3} ms; {:.2}x eager (target >= 0.95x); PyTorch captured \
                 {torch_graph:.0} GB/s (target: at least that){}",
                c / e,
                if judged { "" } else { "; one rank: not judged" }
            ),
            pass: judged.then_some(c >= 0.95 * e && c >= torch_graph),
        });
    }

    // The 256-byte max all-reduce (an amax vector), latency.
    let small = DeviceBuffer::<f32>::alloc(&ctx, 64)?;
    small.memset_bytes(&rank.stream, 0)?;
    let (eager, captured) = rank
        .eager_and_captured(|s| Ok(rank.comm.all_reduce_in_place(&small, ReduceOp::Max, s)?))?;
    rows.push(Row {
        name: format!("max all-reduce 256 B, eager ({n} ranks)"),
        value: eager * 1e3,
        unit: "us",
        yardstick: format!("PyTorch on 2 H200s: {TORCH_SMALL_MAX_US:.0} us eager"),
        pass: None,
    });
    rows.push(Row {
        name: format!("max all-reduce 256 B, captured ({n} ranks)"),
        value: captured * 1e3,
        unit: "us",
        yardstick: format!("{:.2}x eager's time", captured / eager),
        pass: None,
    });

    // The amax reduction's cost inside a step graph: a graph with a stand-in for the step's
    // work (a 64 MiB memset) and the reduction, against the same graph without it.
    let work = DeviceBuffer::<u8>::alloc(&ctx, 64 << 20)?;
    let amax = DeviceBuffer::<f32>::alloc(&ctx, AMAX_SLOTS)?;
    amax.memset_bytes(&rank.stream, 0)?;
    let (_, with) = rank.eager_and_captured(|s| {
        work.memset_bytes(s, 1)?;
        Ok(rank.comm.all_reduce_in_place(&amax, ReduceOp::Max, s)?)
    })?;
    let (_, without) = rank.eager_and_captured(|s| work.memset_bytes(s, 1))?;
    let cost_us = (with - without) * 1e3;
    rows.push(Row {
        name: format!("amax reduction in a step graph, {AMAX_SLOTS} amaxes ({n} ranks)"),
        value: cost_us,
        unit: "us",
        yardstick: format!(
            "graph with it {:.1} us, without {:.1} us (target <= {AMAX_TARGET_US:.0} us per step){}",
            with * 1e3,
            without * 1e3,
            if judged { "" } else { "; one rank: not judged" }
        ),
        pass: judged.then_some(cost_us <= AMAX_TARGET_US),
    });

    // All-to-all of 128 MiB (the MoE dispatch's collective).
    let bytes = 128usize << 20;
    let len = bytes / 4 / n * n;
    let send = DeviceBuffer::<f32>::alloc(&ctx, len)?;
    let recv = DeviceBuffer::<f32>::alloc(&ctx, len)?;
    send.memset_bytes(&rank.stream, 0)?;
    let (eager, captured) =
        rank.eager_and_captured(|s| Ok(rank.comm.all_to_all(&send, &recv, s)?))?;
    let f = if judged { a2a_factor } else { 1.0 };
    let (e, c) = (bus_gbs(len * 4, eager, f), bus_gbs(len * 4, captured, f));
    rows.push(Row {
        name: format!("all-to-all 128 MiB, eager ({n} ranks)"),
        value: e,
        unit: "GB/s",
        yardstick: format!("{bw_name}bw; PyTorch on 2 H200s: {TORCH_ALL_TO_ALL:.0} GB/s"),
        pass: None,
    });
    rows.push(Row {
        name: format!("all-to-all 128 MiB, captured ({n} ranks)"),
        value: c,
        unit: "GB/s",
        yardstick: format!("{bw_name}bw; {:.2}x eager", c / e),
        pass: None,
    });

    rows.extend(expert_parallel_rows(&rank, judged)?);

    // The train job's default model, one step graph: data parallel over every rank, then
    // (rank 0 alone, the others done) one GPU, then with the experts spread over the ranks
    // (the default model's 8 split evenly over 1, 2 or 4 ranks).
    let model = ModelConfig::default();
    let train = TrainConfig::default();
    let parallel = |expert: bool| -> BenchResult<f64> {
        let (stream, comm) = (&rank.stream, rank.comm.clone());
        let mut m = if expert {
            Model::new_expert_parallel(stream, model, train, GraphMode::Step, comm)?
        } else {
            Model::new_data_parallel(stream, model, train, GraphMode::Step, comm)?
        };
        train_step_ms(stream, &mut m, rank.comm.rank())
    };
    let dp_ms = parallel(false)?;
    let one_ms = if rank.comm.rank() == 0 {
        let mut one = Model::new(&rank.stream, model, train, GraphMode::Step)?;
        train_step_ms(&rank.stream, &mut one, 0)?
    } else {
        f64::NAN
    };
    let splits = model.experts % n == 0 && model.experts / n >= model.top_k;
    let ep_ms = if splits { parallel(true)? } else { f64::NAN };
    let tokens = (model.tokens() * train.microbatches) as f64;
    let tps = |ms: f64| n as f64 * tokens / (ms * 1e-3);
    let one_tps = tokens / (one_ms * 1e-3);
    let gpus = format!("{n} GPU{}", if n == 1 { "" } else { "s" });
    let against = |ms: f64| {
        format!(
            "{ms:.2} ms/step; one GPU {one_ms:.2} ms, {one_tps:.0} tokens/s: {:.2}x",
            tps(ms) / one_tps
        )
    };
    let judged_note = if judged { "" } else { "; one rank: not judged" };
    rows.push(Row {
        name: format!("train step, data parallel over {gpus} (default model, graphs step)"),
        value: tps(dp_ms),
        unit: "tok/s",
        yardstick: format!("{} (target >= 1.8x at 2 GPUs){judged_note}", against(dp_ms)),
        pass: (n == 2).then_some(tps(dp_ms) >= 1.8 * one_tps),
    });
    if splits {
        rows.push(Row {
            name: format!(
                "train step, expert parallel over {gpus} ({} experts each, graphs step)",
                model.experts / n
            ),
            value: tps(ep_ms),
            unit: "tok/s",
            yardstick: format!("{}{judged_note}", against(ep_ms)),
            pass: None,
        });
    }
    Ok(rows)
}

/// The median step time of `model` (a fixed batch of random bytes, rank `rank`'s own),
/// after warm-up steps, CUDA events.
fn train_step_ms(stream: &Stream, model: &mut Model, rank: usize) -> BenchResult<f64> {
    let n = model.config().tokens() * model.train_config().microbatches;
    let mut rng = super::Rng::new(5, rank as u64);
    let mut bytes = || (0..n).map(|_| rng.below(256) as i32).collect::<Vec<i32>>();
    let (tokens, targets) = (bytes(), bytes());
    model.load_batch(stream, &tokens, &targets)?;
    event_median_ms(stream, 3, 10, || {
        model.step(stream, 1e-4)?;
        Ok(())
    })
}

/// The train job's MoE layer (the default model's: d 512, 8 experts top-2, F 1024) with
/// `tokens` tokens, its experts run as `expert_gemm`, `bench moe`'s settings otherwise.
fn moe_config(tokens: usize, expert_gemm: ExpertGemm) -> MoeLayerConfig {
    let m = ModelConfig::default();
    let shape = super::moe::Shape {
        tokens,
        hidden: m.d_model,
        ffn: m.ffn,
        experts: m.experts,
        top_k: m.top_k,
        target_ms: None,
        torch_ms: None,
    };
    super::moe::config(shape, expert_gemm, GradDtype::F32)
}

/// The MoE layer's step (forward and backward) expert parallel over every rank, each with the
/// default model's microbatch: full-layer (static exchange, one captured graph replayed) and
/// breaking-layer (exact sizes, eager: counts read back), against one GPU holding every expert
/// over every rank's tokens (full-layer graph; rank 0, after the others are done).
fn expert_parallel_rows(rank: &Rank, judged: bool) -> BenchResult<Vec<Row>> {
    let (n, r) = (rank.comm.size(), rank.comm.rank());
    let s = &rank.stream;
    let tokens = ModelConfig::default().tokens();
    let cfg = moe_config(tokens, ExpertGemm::Grouped);
    let mut rng = super::Rng::new(11, 0);
    let (e, h, f) = (cfg.experts, cfg.hidden, cfg.ffn);
    let params = MoeParams {
        wr: rng.vec(e * h, 0.05),
        w1: rng.vec(e * 2 * f * h, 0.05),
        w2: rng.vec(e * h * f, 0.05),
    };
    let mut data = super::Rng::new(12, r as u64);
    // x, dy, out, dx of `len` elements.
    let mut io = |len: usize| -> BenchResult<Vec<DeviceBuffer<bf16>>> {
        (0..4)
            .map(|_| {
                let v: Vec<bf16> = data
                    .vec(len, 1.0)
                    .iter()
                    .map(|&v| bf16::from_f32(v))
                    .collect();
                Ok(DeviceBuffer::from_host(s, &v)?)
            })
            .collect()
    };
    let scaling = |experts: usize| -> BenchResult<Arc<DelayedScaling>> {
        let fmts = formats(cfg.recipe, experts);
        Ok(Arc::new(DelayedScaling::new(
            s,
            &fmts,
            1,
            0,
            AmaxAlgo::MostRecent,
        )?))
    };
    // (eager, captured) milliseconds of each mode; breaking-layer has no capture.
    let mut ep_ms = Vec::new();
    for mode in [ExpertGemm::Grouped, ExpertGemm::PerExpert] {
        let group = Arc::new(NcclGroup::new(rank.comm.clone()));
        let cfg = moe_config(tokens, mode);
        let layer = ExpertParallelMoe::new(s, cfg, &params, scaling(e / n)?, 0, group)?;
        let saved = super::zeroed_saved(s, &layer.saved_bytes())?;
        let saved: Vec<&DeviceBuffer<u8>> = saved.iter().collect();
        let b = io(tokens * h)?;
        layer.cast_weights(s)?;
        let pass = |st: &Stream| {
            layer.forward(st, &b[0], &b[2], &saved)?;
            layer.backward(st, &b[0], &b[1], &b[3], &saved, false)
        };
        ep_ms.push(if mode == ExpertGemm::Grouped {
            rank.eager_and_captured(pass)?
        } else {
            let eager = event_median_ms(s, WARMUP, REPS, || Ok(pass(s)?))?;
            (eager, f64::NAN)
        });
    }
    let one_ms = if r == 0 {
        let cfg = moe_config(tokens * n, ExpertGemm::Grouped);
        let mut layer = MoeLayer::new(s, cfg, &params, scaling(e)?, 0)?;
        let saved = super::zeroed_saved(s, &layer.saved_bytes())?;
        let b = io(cfg.tokens * h)?;
        let at = GraphIndex {
            chunk: 0,
            microbatch: 0,
            layer: 0,
        };
        let slot = Slot::new(at, vec![&b[0]], vec![&b[2]], saved.iter().collect());
        layer.cast_weights(s, &slot)?;
        let graph = s.capture(CaptureMode::ThreadLocal, |cs| {
            layer.forward(cs.stream(), &[&b[0]], &[&b[2]], &slot)?;
            layer.backward(cs.stream(), &[&b[1]], &[&b[3]], &slot)
        })?;
        let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
        event_median_ms(s, WARMUP, REPS, || {
            exec.launch(s)?;
            Ok(())
        })?
    } else {
        f64::NAN
    };
    let gpus = format!("{n} GPU{}", if n == 1 { "" } else { "s" });
    let one = format!(
        "one GPU with every expert over {} tokens (full-layer graph) {one_ms:.3} ms",
        tokens * n
    );
    let not_judged = if judged { "" } else { "; one rank: not judged" };
    let (full, breaking) = (ep_ms[0], ep_ms[1]);
    Ok(vec![
        Row {
            name: format!("MoE layer step, expert parallel over {gpus}, full-layer graph"),
            value: full.1,
            unit: "ms",
            yardstick: format!(
                "{tokens} tokens a rank; eager {:.3} ms; {one}: {:.2}x (target <= {EP_TARGET}x at \
                 2 GPUs){not_judged}",
                full.0,
                full.1 / one_ms
            ),
            pass: (n == 2).then_some(full.1 / one_ms <= EP_TARGET),
        },
        Row {
            name: format!("MoE layer step, expert parallel over {gpus}, breaking-layer eager"),
            value: breaking.0,
            unit: "ms",
            yardstick: format!(
                "exact sizes, counts read back; {one}: {:.2}x; full-layer graph {:.3} ms",
                breaking.0 / one_ms,
                full.1
            ),
            pass: None,
        },
    ])
}
