//! MoE filtering of amax registration: warmup records which FP8 tensors each callable ran,
//! and only those are registered for the scale updates.
//!
//! The stack is one chunk of two layers, 2 microbatches: an [`Fp8Linear`] (graphed) and an
//! expert bank of `E` FP8 linear experts (its forward and backward one eager segment each:
//! the routing is read on the host, as a MoE layer with host-read token counts does). An
//! expert runs (quantizes its input, its GEMMs) only when the microbatch's routing mask has
//! its bit; the bank casts every expert's weights on the first microbatch. Everything shares
//! one [`DelayedScaling`] (3 tensors per linear: x, W, dY).
//!
//! During warmup the routing sends microbatch 0 to expert 0 and microbatch 1 to expert 2,
//! so expert 1 never runs: the warmup record holds every tensor of the first layer, every
//! expert's W, and x and dY of experts 0 and 2 only; `after_warmup` registers exactly that.
//! The replays then route to every expert. Expected, checked bit for bit against an eager
//! run of fresh layers with the same registration: outputs, input-gradient and weight
//! gradients, and the scaling state — where expert 1's x and dY keep scale 1 and an
//! unrolled history (slot 0 collects their amax; nothing updates them) while every
//! registered tensor's scale moves.
//!
//! The same graphed run with the hooks' amax reduction over NCCL (`NcclGroup` on a one-rank
//! communicator) must give the same bits as the single-process group.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use cuda_graph::{Context, DeviceBuffer, GraphPool, Result, Stream};
use fp8_kernels::{AmaxAlgo, DelayedScaling, Fp8Format, IdentityGroup, ReductionGroup};
use fp8_moe::dist::{NcclGroup, Placement, communicator};
use fp8_moe::linear::{self, Fp8Linear};
use fp8_moe::scaling;
use graphed_callables::{
    Callable, GraphIndex, GraphedCallables, GraphedOptions, Schedule, SegmentKind, Slot, Step,
    TensorRecorder, WarmupRecord,
};

/// Tokens per microbatch.
const T: usize = 64;
/// Features of every linear (in = out).
const H: usize = 128;
/// Experts.
const E: usize = 3;
const MICROBATCHES: usize = 2;
const ORDER: [i64; 4] = [1, 1, -1, -1];
const STEPS: usize = 2;
const HISTORY: usize = 4;
/// Routing masks (bit e = expert e runs) per microbatch during warmup and at replay.
const WARMUP_ROUTES: [u32; MICROBATCHES] = [0b001, 0b100];
const REPLAY_ROUTES: [u32; MICROBATCHES] = [0b111, 0b011];

/// The FP8 tensors of linear `k` (0 = the first layer, 1 + e = expert e).
fn tensors_of(k: usize) -> [usize; linear::TENSORS] {
    [0, 1, 2].map(|i| k * linear::TENSORS + i)
}
const X: usize = 0;
const W: usize = 1;
const DY: usize = 2;

fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

struct Gpu {
    ctx: Arc<Context>,
    stream: Stream,
}

impl Gpu {
    fn new() -> Gpu {
        let ctx = Context::default_device().expect("context");
        let stream = Stream::new(&ctx).expect("stream");
        Gpu { ctx, stream }
    }
    fn upload_bytes(&self, v: &[u8]) -> DeviceBuffer<u8> {
        DeviceBuffer::from_host(&self.stream, v).expect("upload")
    }

    fn upload(&self, v: &[f32]) -> DeviceBuffer<f32> {
        let b = DeviceBuffer::from_host(&self.stream, v).expect("upload");
        self.stream.synchronize().expect("sync");
        b
    }
    fn bits(&self, b: &DeviceBuffer<f32>) -> Vec<u32> {
        self.stream.synchronize().expect("sync before read back");
        let v = b.to_vec(&self.stream).expect("read back");
        v.iter().map(|x| x.to_bits()).collect()
    }
}

/// `E` FP8 experts on one input; expert `e` writes output `e` when the microbatch's routing
/// mask has bit `e` (its other outputs keep what they held).
struct ExpertBank {
    /// Shared with the test, which reads their weight gradients (eager segments run on
    /// `&self`, hence the locks).
    experts: Vec<Arc<Mutex<Fp8Linear>>>,
    /// Per microbatch, the routing mask the eager segments read (the test's "router").
    routes: Arc<Mutex<[u32; MICROBATCHES]>>,
    /// Per expert, where its input gradient goes (the bank's own is left zero).
    scratch_dx: Vec<DeviceBuffer<f32>>,
}

impl ExpertBank {
    fn new(
        gpu: &Gpu,
        scaling: &Arc<DelayedScaling>,
        routes: Arc<Mutex<[u32; MICROBATCHES]>>,
    ) -> ExpertBank {
        let experts = (0..E)
            .map(|e| {
                Fp8Linear::new(
                    &gpu.stream,
                    T,
                    H,
                    H,
                    &values(100 + e as u64, H * H, 0.05),
                    None,
                    scaling.clone(),
                    tensors_of(1 + e)[0],
                )
                .map(|x| Arc::new(Mutex::new(x)))
                .expect("expert")
            })
            .collect();
        let scratch_dx = (0..E).map(|_| gpu.upload(&vec![0.0; T * H])).collect();
        ExpertBank {
            experts,
            routes,
            scratch_dx,
        }
    }

    fn run_forward(
        &self,
        stream: &Stream,
        inputs: &[&DeviceBuffer<f32>],
        outputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let mask = self.mask(slot);
        for (e, expert) in self.experts.iter().enumerate() {
            let mut expert = expert.lock().expect("expert");
            let sub = slot.with_buffers(
                inputs.to_vec(),
                vec![outputs[e]],
                ExpertBank::saved_of(slot, e),
            );
            // The forward has no graphed segment, so the runtime leaves the weight casts to
            // the layer: every expert's, on the step's first microbatch.
            if slot.is_first_microbatch() {
                expert.cast_weights(stream, &sub)?;
            }
            if mask & (1 << e) != 0 {
                expert.forward(stream, inputs, &[outputs[e]], &sub)?;
            }
        }
        Ok(())
    }
    fn run_backward(
        &self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<f32>],
        _grad_inputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let mask = self.mask(slot);
        for (e, expert) in self.experts.iter().enumerate() {
            let mut expert = expert.lock().expect("expert");
            if mask & (1 << e) == 0 {
                continue;
            }
            let sub = slot.with_buffers(
                slot.inputs().to_vec(),
                vec![slot.outputs()[e]],
                ExpertBank::saved_of(slot, e),
            );
            expert.backward(stream, &[grad_outputs[e]], &[&self.scratch_dx[e]], &sub)?;
        }
        Ok(())
    }
    fn mask(&self, slot: &Slot<'_, f32>) -> u32 {
        self.routes.lock().expect("routes")[slot.microbatch()]
    }

    /// Expert `e`'s part of `slot`: its output (or output gradient) and saved buffers.
    fn saved_of<'b>(slot: &'b Slot<'_, f32>, e: usize) -> Vec<&'b DeviceBuffer<u8>> {
        let per = linear::saved_bytes(T, H, H).len();
        slot.saved()[per * e..per * (e + 1)].to_vec()
    }
}

impl Callable<f32> for ExpertBank {
    fn input_lens(&self) -> Vec<usize> {
        vec![T * H]
    }
    fn output_lens(&self) -> Vec<usize> {
        vec![T * H; E]
    }
    fn saved_bytes(&self) -> Vec<usize> {
        self.experts
            .iter()
            .flat_map(|x| x.lock().expect("expert").saved_bytes())
            .collect()
    }
    fn forward(
        &mut self,
        stream: &Stream,
        inputs: &[&DeviceBuffer<f32>],
        outputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        self.run_forward(stream, inputs, outputs, slot)
    }
    fn backward(
        &mut self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<f32>],
        grad_inputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        self.run_backward(stream, grad_outputs, grad_inputs, slot)
    }
    fn forward_segments(&self) -> Vec<SegmentKind> {
        vec![SegmentKind::Eager]
    }
    fn backward_segments(&self) -> Vec<SegmentKind> {
        vec![SegmentKind::Eager]
    }
    fn forward_eager(
        &self,
        _segment: usize,
        stream: &Stream,
        inputs: &[&DeviceBuffer<f32>],
        outputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        self.run_forward(stream, inputs, outputs, slot)
    }
    fn backward_eager(
        &self,
        _segment: usize,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<f32>],
        grad_inputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        self.run_backward(stream, grad_outputs, grad_inputs, slot)
    }
}

/// The two layers on a fresh scaling state.
fn new_stack(
    gpu: &Gpu,
    routes: &Arc<Mutex<[u32; MICROBATCHES]>>,
) -> (Arc<DelayedScaling>, Fp8Linear, ExpertBank) {
    let formats: Vec<Fp8Format> = (0..1 + E).flat_map(|_| linear::FORMATS).collect();
    let scaling = Arc::new(
        DelayedScaling::new(&gpu.stream, &formats, HISTORY, 0, AmaxAlgo::Max).expect("scaling"),
    );
    let first = Fp8Linear::new(
        &gpu.stream,
        T,
        H,
        H,
        &values(7, H * H, 0.05),
        None,
        scaling.clone(),
        tensors_of(0)[0],
    )
    .expect("first layer");
    let bank = ExpertBank::new(gpu, &scaling, routes.clone());
    gpu.stream.synchronize().expect("sync");
    (scaling, first, bank)
}

/// What warmup with [`WARMUP_ROUTES`] runs: the first layer's tensors, every expert's W,
/// x and dY of the routed experts.
fn expected_record() -> BTreeSet<usize> {
    let mut want: BTreeSet<usize> = tensors_of(0).into();
    for e in 0..E {
        want.insert(tensors_of(1 + e)[W]);
        if WARMUP_ROUTES.iter().any(|m| m & (1 << e) != 0) {
            want.insert(tensors_of(1 + e)[X]);
            want.insert(tensors_of(1 + e)[DY]);
        }
    }
    want
}

fn input(step: usize, mb: usize) -> Vec<f32> {
    values(1000 + 10 * step as u64 + mb as u64, T * H, 1.0)
}

fn grad_output(step: usize, mb: usize, e: usize) -> Vec<f32> {
    values(
        2000 + 100 * step as u64 + 10 * mb as u64 + e as u64,
        T * H,
        0.1,
    )
}

/// Labelled bit patterns, in the order they were produced.
type Record = Vec<(String, Vec<u32>)>;

fn record_state(
    gpu: &Gpu,
    rec: &mut Record,
    step: usize,
    scaling: &DelayedScaling,
    first_dw: &DeviceBuffer<f32>,
    experts: &[Arc<Mutex<Fp8Linear>>],
) {
    rec.push((
        format!("step {step}: dW of the first layer"),
        gpu.bits(first_dw),
    ));
    for (e, x) in experts.iter().enumerate() {
        let x = x.lock().expect("expert");
        rec.push((
            format!("step {step}: dW of expert {e}"),
            gpu.bits(x.weight_grad()),
        ));
    }
    rec.push((
        format!("step {step}: history"),
        gpu.bits(scaling.history_buffer()),
    ));
    rec.push((
        format!("step {step}: scale"),
        gpu.bits(scaling.scale_buffer()),
    ));
}

/// The graphed run, its amaxes reduced over `group` in the hooks; returns the record, the
/// warmup record and the final scaling state.
fn run_graphed(
    gpu: &Gpu,
    group: Arc<dyn ReductionGroup>,
) -> (Record, WarmupRecord, Arc<DelayedScaling>) {
    let routes = Arc::new(Mutex::new(WARMUP_ROUTES));
    let (scaling, first, bank) = new_stack(gpu, &routes);
    let schedule = Schedule::new(&ORDER, vec![2]).expect("schedule");
    let mut options = GraphedOptions::new(schedule.clone());
    // Snapshot/restore around warmup, register what warmup ran, reduce + update after
    // every replay.
    scaling::install_hooks(&mut options, &gpu.ctx, &scaling, group).expect("scaling hooks");
    let sample = gpu.upload(&input(99, 0));
    // One set per callable: the first layer's input; the bank reads the first's outputs.
    let samples: Vec<Vec<&DeviceBuffer<f32>>> = vec![vec![&sample], vec![]];
    let experts = bank.experts.clone();
    let callables: Vec<Box<dyn Callable<f32>>> = vec![Box::new(first), Box::new(bank)];
    let graphed =
        GraphedCallables::build(&gpu.stream, callables, &samples, options).expect("build");
    gpu.stream.synchronize().expect("sync after build");
    let record = graphed.warmup_record().clone();

    *routes.lock().expect("routes") = REPLAY_ROUTES;
    let first_dw = graphed.callables()[0].gradients()[0];
    let mut rec = Record::new();
    for step in 0..STEPS {
        for &st in schedule.steps() {
            let mb = st.microbatch();
            match st {
                Step::Forward { .. } => {
                    let x = gpu.upload(&input(step, mb));
                    let y = graphed.forward(0, mb, &[&x], &gpu.stream).expect("forward");
                    for e in (0..E).filter(|e| REPLAY_ROUTES[mb] & (1 << e) != 0) {
                        rec.push((
                            format!("step {step} mb {mb}: y of expert {e}"),
                            gpu.bits(&y[e]),
                        ));
                    }
                }
                _ => {
                    let dys: Vec<DeviceBuffer<f32>> = (0..E)
                        .map(|e| gpu.upload(&grad_output(step, mb, e)))
                        .collect();
                    let dys: Vec<&DeviceBuffer<f32>> = dys.iter().collect();
                    graphed
                        .backward(0, mb, &dys, &gpu.stream)
                        .expect("backward");
                    gpu.stream.synchronize().expect("sync");
                }
            }
        }
        record_state(gpu, &mut rec, step, &scaling, first_dw, &experts);
    }
    (rec, record, scaling)
}

/// The eager reference: fresh layers, the expected registration, one set of buffers per
/// microbatch, the same order and updates.
fn run_eager(gpu: &Gpu) -> Record {
    let routes = Arc::new(Mutex::new(REPLAY_ROUTES));
    let (scaling, mut first, mut bank) = new_stack(gpu, &routes);
    scaling
        .register(&gpu.stream, expected_record())
        .expect("register");
    let pool = GraphPool::new(&gpu.ctx, 256).expect("pool");
    let zeros = |n: usize| gpu.upload(&vec![0.0; n]);
    let zero_bytes = |n: usize| gpu.upload_bytes(&vec![0u8; n]);
    let per_mb = |_| {
        (
            zeros(T * H),                                     // x
            zeros(T * H),                                     // first layer's y
            (0..E).map(|_| zeros(T * H)).collect::<Vec<_>>(), // bank outputs
            first_saved(&first, &zero_bytes),
            bank.saved_bytes()
                .iter()
                .map(|&n| zero_bytes(n))
                .collect::<Vec<_>>(),
            zeros(T * H), // dh (bank's dx)
            zeros(T * H), // dx
        )
    };
    let bufs: Vec<_> = (0..MICROBATCHES).map(per_mb).collect();
    let mut rec = Record::new();
    for step in 0..STEPS {
        for &st in Schedule::new(&ORDER, vec![2]).expect("schedule").steps() {
            let mb = st.microbatch();
            let (x, h, ys, s0, s1, dh, dx) = &bufs[mb];
            let at = |layer| GraphIndex {
                chunk: 0,
                microbatch: mb,
                layer,
            };
            let slot0 = Slot::new(at(0), vec![x], vec![h], s0.iter().collect()).with_pool(&pool);
            let slot1 = Slot::new(at(1), vec![h], ys.iter().collect(), s1.iter().collect())
                .with_pool(&pool);
            match st {
                Step::Forward { .. } => {
                    // SAFETY-free upload into the microbatch's own input buffer.
                    let fresh = gpu.upload(&input(step, mb));
                    copy(gpu, x, &fresh);
                    if mb == 0 {
                        first.cast_weights(&gpu.stream, &slot0).expect("cast");
                    }
                    first
                        .forward(&gpu.stream, &[x], &[h], &slot0)
                        .expect("first forward");
                    let ys_ref: Vec<&DeviceBuffer<f32>> = ys.iter().collect();
                    bank.forward(&gpu.stream, &[h], &ys_ref, &slot1)
                        .expect("bank forward");
                    scaling.update(&gpu.stream).expect("update");
                    for e in (0..E).filter(|e| REPLAY_ROUTES[mb] & (1 << e) != 0) {
                        rec.push((
                            format!("step {step} mb {mb}: y of expert {e}"),
                            gpu.bits(&ys[e]),
                        ));
                    }
                }
                _ => {
                    let dys: Vec<DeviceBuffer<f32>> = (0..E)
                        .map(|e| gpu.upload(&grad_output(step, mb, e)))
                        .collect();
                    let dys: Vec<&DeviceBuffer<f32>> = dys.iter().collect();
                    bank.backward(&gpu.stream, &dys, &[dh], &slot1)
                        .expect("bank backward");
                    first
                        .backward(&gpu.stream, &[dh], &[dx], &slot0)
                        .expect("first backward");
                    scaling.update(&gpu.stream).expect("update");
                    gpu.stream.synchronize().expect("sync");
                }
            }
        }
        record_state(
            gpu,
            &mut rec,
            step,
            &scaling,
            first.weight_grad(),
            &bank.experts,
        );
    }
    rec
}

fn first_saved(
    first: &Fp8Linear,
    zeros: &dyn Fn(usize) -> DeviceBuffer<u8>,
) -> Vec<DeviceBuffer<u8>> {
    first.saved_bytes().iter().map(|&n| zeros(n)).collect()
}

/// Copies `src` into `dst` (a buffer the test owns) and waits.
fn copy(gpu: &Gpu, dst: &DeviceBuffer<f32>, src: &DeviceBuffer<f32>) {
    dst.copy_from_device(&gpu.stream, src).expect("copy");
    gpu.stream.synchronize().expect("sync");
}

#[test]
#[ignore = "needs a CUDA device"]
fn only_the_fp8_tensors_warmup_ran_are_registered() {
    let gpu = Gpu::new();
    let (got, record, scaling) = run_graphed(&gpu, Arc::new(IdentityGroup));

    // The record: the first layer's three tensors, every expert's W, x and dY of the experts
    // warmup routed to; nothing of expert 1's activations.
    let want = expected_record();
    assert_eq!(record.tensors(), want);
    assert_eq!(record.of_callable(0), Some(&BTreeSet::from(tensors_of(0))));
    let e1 = tensors_of(2);
    assert!(!want.contains(&e1[X]) && !want.contains(&e1[DY]) && want.contains(&e1[W]));
    assert_eq!(
        scaling.registered(),
        want.iter().copied().collect::<Vec<_>>()
    );

    // Graphed == eager with the same registration, bit for bit.
    let eager = run_eager(&gpu);
    assert_eq!(got.len(), eager.len(), "entry counts");
    for ((gl, g), (el, e)) in got.iter().zip(&eager) {
        assert_eq!(gl, el, "entries out of step");
        assert_eq!(g.len(), e.len(), "{gl}: lengths");
        let diff = g.iter().zip(e).filter(|(a, b)| a != b).count();
        assert_eq!(
            diff,
            0,
            "{gl}: {diff} of {} elements differ from eager",
            g.len()
        );
    }

    // Expert 1 ran at replay, but its x and dY were never updated: scale 1, history never
    // rolled (slot 0 holds the running amax, the rest 0). Registered tensors moved.
    let scale: Vec<f32> = scaling.scale_buffer().to_vec(&gpu.stream).expect("scale");
    let hist: Vec<f32> = scaling
        .history_buffer()
        .to_vec(&gpu.stream)
        .expect("history");
    for t in [e1[X], e1[DY]] {
        assert_eq!(scale[t], 1.0, "unregistered tensor {t} keeps scale 1");
        let row = &hist[t * HISTORY..(t + 1) * HISTORY];
        assert!(
            row[0] > 0.0,
            "tensor {t}: its quantize still maxed its amax into slot 0"
        );
        assert!(
            row[1..].iter().all(|&v| v == 0.0),
            "tensor {t}: history rolled: {row:?}"
        );
    }
    for t in [tensors_of(0)[X], tensors_of(1)[X], tensors_of(3)[DY]] {
        assert_ne!(scale[t], 1.0, "registered tensor {t} got a new scale");
    }
}

/// The hooks' amax reduction over NCCL (`fp8_moe::dist::NcclGroup`, TransformerEngine's
/// `fp8_group`) in every replay: over one rank (this process's communicator) it must leave
/// every output, gradient and scaling bit as the single-process group does.
#[test]
#[ignore = "needs a CUDA device"]
fn the_hooks_reduce_the_amaxes_over_nccl_with_the_same_bits() {
    let gpu = Gpu::new();
    let (local, _, _) = run_graphed(&gpu, Arc::new(IdentityGroup));
    let comm = communicator(&gpu.ctx, &Placement::SINGLE).expect("an NCCL communicator");
    let (nccl, _, _) = run_graphed(&gpu, Arc::new(NcclGroup::new(comm)));
    assert_eq!(local.len(), nccl.len(), "entry counts");
    for ((ll, l), (nl, n)) in local.iter().zip(&nccl) {
        assert_eq!(ll, nl, "entries out of step");
        assert!(l == n, "{ll}: differs with the amaxes reduced over NCCL");
    }
}

/// An eager slot with a recorder sees what a pass reports: the routed experts' x, every
/// expert's W (cast on the first microbatch).
#[test]
#[ignore = "needs a CUDA device"]
fn an_eager_slot_records_what_the_layer_ran() {
    let gpu = Gpu::new();
    let routes = Arc::new(Mutex::new([0b010, 0b000]));
    let (_scaling, _first, mut bank) = new_stack(&gpu, &routes);
    let pool = GraphPool::new(&gpu.ctx, 256).expect("pool");
    let x = gpu.upload(&input(0, 0));
    let ys: Vec<DeviceBuffer<f32>> = (0..E).map(|_| gpu.upload(&vec![0.0; T * H])).collect();
    let saved: Vec<DeviceBuffer<u8>> = bank
        .saved_bytes()
        .iter()
        .map(|&n| gpu.upload_bytes(&vec![0u8; n]))
        .collect();
    let recorder = TensorRecorder::new();
    let at = GraphIndex {
        chunk: 0,
        microbatch: 0,
        layer: 1,
    };
    let slot = Slot::new(at, vec![&x], ys.iter().collect(), saved.iter().collect())
        .with_pool(&pool)
        .with_recorder(&recorder);
    let ys_ref: Vec<&DeviceBuffer<f32>> = ys.iter().collect();
    bank.forward(&gpu.stream, &[&x], &ys_ref, &slot)
        .expect("forward");
    gpu.stream.synchronize().expect("sync");
    let mut want: BTreeSet<usize> = (0..E).map(|e| tensors_of(1 + e)[W]).collect();
    want.insert(tensors_of(2)[X]);
    assert_eq!(recorder.tensors(), want);
    // A slot without a recorder ignores the reports.
    Slot::new(at, vec![&x], vec![], vec![])
        .with_pool(&pool)
        .record_tensors([1, 2]);
}
