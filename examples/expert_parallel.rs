//! Expert parallelism in a training loop: the byte-level MoE transformer
//! ([`Model::new_expert_parallel_in`]) with each MoE layer's experts spread over the ranks,
//! every rank training on its own share of each step's batch.
//!
//! The ranks are NCCL's, one per GPU, when this machine has two or more (graph mode step:
//! each rank's whole step, its all-gathers and all-to-alls included, is one CUDA graph), else
//! two threads on this one GPU over a [`LocalGroup`] (eager: its collectives are device
//! copies ordered by events, which cannot be captured). Either way rank `r` holds experts
//! `2r, 2r + 1` of 4 and the rest of the model replicated.
//!
//! Every rank must report the same loss at every step, the loss must fall, and at the end
//! every rank must gather the same whole model ([`Model::gather_state`]: the one-GPU
//! layout, what a checkpoint holds); the example exits non-zero otherwise.
//!
//! `cargo run --release --example expert_parallel` (needs an NVIDIA GPU and driver; NCCL
//! only with several GPUs: `CUDA_GRAPH_NCCL_LIBRARY` names `libnccl.so.2` if the loader does
//! not find it).

use std::sync::Arc;

use cuda_graph::driver::Device;
use cuda_graph::{Context, Stream};
use fp8_moe::dist::NcclGroup;
use fp8_moe::model::{GraphMode, HostTensor, Model, ModelConfig, TrainConfig};
use fp8_moe::moe::ep::{ExpertGroup, LocalGroup};
use fp8_moe::rng::Rng;

const RANKS: usize = 2;
const STEPS: usize = 40;

/// Text a small model learns quickly: words of a small vocabulary.
fn corpus(len: usize) -> Vec<u8> {
    const WORDS: [&str; 8] = [
        "the ", "graph ", "replays ", "each ", "expert ", "on ", "its ", "rank. ",
    ];
    let mut rng = Rng::new(3, 0);
    let mut text = Vec::with_capacity(len + 8);
    while text.len() < len {
        text.extend_from_slice(WORDS[rng.below(WORDS.len())].as_bytes());
    }
    text.truncate(len);
    text
}

/// One rank's run: its model over `group`, `STEPS` steps on its share of every step's
/// windows (every rank draws the same windows). Returns the losses and the gathered model.
fn rank(
    ctx: Arc<Context>,
    group: Arc<dyn ExpertGroup>,
    mode: GraphMode,
    (cfg, train): (ModelConfig, TrainConfig),
) -> cuda_graph::Result<(Vec<f32>, Vec<HostTensor>)> {
    let stream = Stream::new(&ctx)?;
    let r = group.rank();
    let mut model = Model::new_expert_parallel_in(&stream, cfg, train, mode, group)?;
    let text = corpus(1 << 16);
    let mut rng = Rng::new(7, 1);
    let share = cfg.batch * train.microbatches;
    let mut losses = Vec::with_capacity(STEPS);
    for step in 0..STEPS {
        let (mut tokens, mut targets) = (Vec::new(), Vec::new());
        for w in 0..share * RANKS {
            let start = rng.below(text.len() - cfg.context - 1);
            if w / share == r {
                let window = &text[start..start + cfg.context + 1];
                tokens.extend(window[..cfg.context].iter().map(|&b| i32::from(b)));
                targets.extend(window[1..].iter().map(|&b| i32::from(b)));
            }
        }
        model.load_batch(&stream, &tokens, &targets)?;
        model.step(&stream, train.lr_at(step))?;
        losses.push(model.stats(&stream)?.loss);
    }
    Ok((losses, model.gather_state(&stream)?))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cfg = ModelConfig {
        d_model: 128,
        heads: 2,
        layers: 2,
        experts: 4,
        top_k: 2,
        ffn: 512,
        context: 64,
        batch: 4,
        ..ModelConfig::default()
    };
    let train = TrainConfig {
        microbatches: 2,
        lr: 3e-3,
        warmup: 5,
        steps: STEPS,
        ..TrainConfig::default()
    };
    let gpus = Device::count()? as usize;
    let (ctxs, groups, mode): (Vec<Arc<Context>>, Vec<Arc<dyn ExpertGroup>>, GraphMode) =
        if gpus >= RANKS {
            let ctxs = (0..RANKS as i32)
                .map(|i| Context::new(Device::get(i)?))
                .collect::<cuda_graph::Result<Vec<_>>>()?;
            let groups = cuda_graph_nccl::Communicator::init_all(&ctxs)?
                .into_iter()
                .map(|c| Arc::new(NcclGroup::new(c)) as Arc<dyn ExpertGroup>)
                .collect();
            (ctxs, groups, GraphMode::Step)
        } else {
            let ctx = Context::new(Device::get(0)?)?;
            let groups = LocalGroup::new(RANKS)?
                .into_iter()
                .map(|g| Arc::new(g) as Arc<dyn ExpertGroup>)
                .collect();
            (vec![ctx; RANKS], groups, GraphMode::None)
        };
    println!(
        "{RANKS} expert-parallel ranks ({}), {} experts each, graph mode {}",
        if gpus >= RANKS {
            "NCCL, one per GPU"
        } else {
            "threads on one GPU"
        },
        cfg.experts / RANKS,
        mode.name()
    );
    // One thread per rank: every collective needs all ranks in flight.
    let runs = std::thread::scope(|s| {
        let handles: Vec<_> = ctxs
            .into_iter()
            .zip(groups)
            .map(|(ctx, group)| s.spawn(move || rank(ctx, group, mode, (cfg, train))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect::<cuda_graph::Result<Vec<_>>>()
    })?;
    let (losses, state) = &runs[0];
    for (step, loss) in losses.iter().enumerate().step_by(5) {
        println!("step {:>2}: loss {loss:.4}", step + 1);
    }
    for (r, (l, st)) in runs.iter().enumerate().skip(1) {
        let same_losses = l
            .iter()
            .zip(losses)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        let same_state = st.len() == state.len()
            && st.iter().zip(state).all(|(a, b)| {
                a.0 == b.0
                    && a.2
                        .iter()
                        .zip(&b.2)
                        .all(|(x, y)| x.to_bits() == y.to_bits())
            });
        if !(same_losses && same_state) {
            return Err(format!(
                "rank {r} differs from rank 0 (losses the same: {same_losses}, gathered \
                 model the same: {same_state})"
            )
            .into());
        }
    }
    let first = losses[0];
    let last = losses[STEPS - 5..].iter().sum::<f32>() / 5.0;
    println!(
        "every rank: the same losses, and the same gathered model ({} tensors, {} values); \
         loss {first:.3} -> {last:.3}",
        state.len(),
        state.iter().map(|t| t.2.len()).sum::<usize>()
    );
    // (A NaN fails too.)
    let fell = last < first - 1.0;
    if !fell {
        return Err(format!("the loss did not fall: {first} -> mean of the last 5 {last}").into());
    }
    Ok(())
}
