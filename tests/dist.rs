//! The FP8 amax reduction over NCCL (`fp8_moe::dist::NcclGroup`, TransformerEngine's
//! `fp8_group`) on every GPU of the machine, one process driving them all.
//!
//! Each rank quantizes its shard of every tensor's data (the casts record the shard's amax),
//! reduces the amaxes over the group and updates its scales, all captured in one graph per
//! rank and replayed over several steps on fresh random data. After every step every rank's
//! history, scales and inverse scales must be bit-identical to one GPU's state that quantized
//! the union of the shards, with no reduction (`IdentityGroup`). On one GPU the union is the
//! one shard (the test then checks the reduction's capture and replay path); on several, the
//! reduction is what makes the ranks agree. The same runs eagerly over three ranks that are
//! threads on one GPU (`LocalGroup`), where several ranks meet on one device.

use std::sync::Arc;

use cuda_graph::driver::Device;
use cuda_graph::{CaptureMode, Context, DeviceBuffer, GraphExec, InstantiateFlags, Stream};
use cuda_graph_nccl::Communicator;
use fp8_kernels::{AmaxAlgo, DelayedScaling, Fp8Format, Fp8Tensor, ReductionGroup, quantize};
use fp8_moe::dist::NcclGroup;
use fp8_moe::moe::ep::LocalGroup;
use fp8_moe::rng::Rng;

const TENSORS: usize = 4;
const HISTORY: usize = 4;
const SHARD: usize = 4096;
const STEPS: usize = 4;

/// One rank: its stream, scaling state, shard inputs and FP8 outputs.
struct RankState {
    stream: Stream,
    scaling: Arc<DelayedScaling>,
    inputs: Vec<DeviceBuffer<f32>>,
    outputs: Vec<Fp8Tensor>,
}

fn state(ctx: &Arc<Context>, len: usize) -> RankState {
    let stream = Stream::new(ctx).unwrap();
    let formats = [
        Fp8Format::E4M3,
        Fp8Format::E5M2,
        Fp8Format::E4M3,
        Fp8Format::E4M3,
    ];
    let scaling =
        Arc::new(DelayedScaling::new(&stream, &formats, HISTORY, 0, AmaxAlgo::Max).unwrap());
    let inputs = (0..TENSORS)
        .map(|_| DeviceBuffer::alloc(ctx, len).unwrap())
        .collect();
    let outputs = (0..TENSORS)
        .map(|t| {
            let data = DeviceBuffer::<u8>::alloc(ctx, len).unwrap();
            scaling.tensor(t, data, &[len]).unwrap()
        })
        .collect();
    RankState {
        stream,
        scaling,
        inputs,
        outputs,
    }
}

/// One step of a rank: quantize every tensor, reduce the amaxes, update the scales.
fn step(r: &RankState, stream: &Stream, group: &dyn ReductionGroup) -> cuda_graph::Result<()> {
    for (x, out) in r.inputs.iter().zip(&r.outputs) {
        quantize(stream, x, out, None)?;
    }
    group.all_reduce_max(stream, r.scaling.history_buffer())?;
    r.scaling.update(stream)
}

fn snapshot(r: &RankState) -> Vec<Vec<u32>> {
    [
        r.scaling.history_buffer(),
        r.scaling.scale_buffer(),
        r.scaling.scale_inv_buffer(),
    ]
    .iter()
    .map(|b| {
        b.to_vec(&r.stream)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    })
    .collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_rank_gets_the_scales_of_the_union_of_the_shards() {
    let n = Device::count().unwrap() as usize;
    assert!(n >= 1, "no CUDA device");
    let ctxs: Vec<Arc<Context>> = (0..n as i32)
        .map(|i| Context::new(Device::get(i).unwrap()).unwrap())
        .collect();
    let comms = Communicator::init_all(&ctxs).expect("NCCL communicators");
    let ranks: Vec<RankState> = ctxs.iter().map(|c| state(c, SHARD)).collect();
    let groups: Vec<NcclGroup> = comms.into_iter().map(NcclGroup::new).collect();
    assert!(groups.iter().all(|g| g.size() == n));
    let union = state(&ctxs[0], SHARD * n);

    // One graph per rank, captured on one thread per rank: NCCL needs every rank's call in
    // flight together.
    let execs: Vec<GraphExec> = std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .iter()
            .zip(&groups)
            .map(|(r, g)| {
                scope.spawn(move || {
                    let graph = r
                        .stream
                        .capture(CaptureMode::ThreadLocal, |s| step(r, s.stream(), g))?;
                    GraphExec::instantiate(&graph, InstantiateFlags::empty())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect()
    });

    steps_match_the_union(&ranks, &union, || {
        for (rank, exec) in ranks.iter().zip(&execs) {
            exec.launch(&rank.stream).unwrap();
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn ranks_as_threads_on_one_gpu_get_the_scales_of_the_union_of_the_shards() {
    // The same over a LocalGroup (three ranks that are threads over this GPU, eager: its
    // all-reduce is a gather and a reduction kernel), so that several ranks meet on the
    // machine every session has.
    let ctx = Context::default_device().unwrap();
    let n = 3;
    let ranks: Vec<RankState> = (0..n).map(|_| state(&ctx, SHARD)).collect();
    let groups = LocalGroup::new(n).unwrap();
    assert!(groups.iter().all(|g| ReductionGroup::size(g) == n));
    let union = state(&ctx, SHARD * n);
    steps_match_the_union(&ranks, &union, || {
        std::thread::scope(|scope| {
            for (r, g) in ranks.iter().zip(&groups) {
                scope.spawn(move || step(r, &r.stream, g).unwrap());
            }
        });
    });
}

/// `STEPS` steps of fresh random data: each tensor's data split into the ranks' shards,
/// `step_ranks` runs every rank's step, the union steps over all of it with no reduction;
/// after each step every rank's scaling state must be the union's, bit for bit.
fn steps_match_the_union(ranks: &[RankState], union: &RankState, step_ranks: impl Fn()) {
    let n = ranks.len();
    let mut rng = Rng::new(
        std::env::var("FP8_MOE_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(7),
        0,
    );
    for s in 0..STEPS {
        for t in 0..TENSORS {
            // A different magnitude per tensor and step, so the amaxes and scales move, and
            // the largest value in a different shard each time.
            let scale = 2f32.powi(rng.below(20) as i32 - 10);
            let mut full: Vec<f32> = (0..SHARD * n)
                .map(|_| (rng.below(2001) as f32 - 1000.0) / 1000.0 * scale)
                .collect();
            let peak = rng.below(SHARD * n);
            full[peak] = 3.0 * scale;
            for (r, rank) in ranks.iter().enumerate() {
                rank.inputs[t]
                    .copy_from_host(&rank.stream, &full[r * SHARD..(r + 1) * SHARD])
                    .unwrap();
            }
            union.inputs[t]
                .copy_from_host(&union.stream, &full)
                .unwrap();
        }
        step_ranks();
        step(union, &union.stream, &fp8_kernels::IdentityGroup).unwrap();
        let want = snapshot(union);
        for (r, rank) in ranks.iter().enumerate() {
            assert!(
                snapshot(rank) == want,
                "step {s}: rank {r}'s FP8 scaling state differs from the union's"
            );
        }
    }
}
