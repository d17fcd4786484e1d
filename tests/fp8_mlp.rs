//! End to end: an FP8 MLP stack of [`Fp8Linear`] layers (linear only, with bias), run as
//! graphed callables and eagerly, must give the same bits: every forward output and every
//! input gradient per replay, every weight and bias gradient and the whole delayed-scaling
//! state after every step, for (a) 1 chunk x 3 microbatches, (b) 2 chunks x 3 microbatches
//! interleaved `[1,2,1,2,-2,-1,1,2,-2,-1,-2,-1]`, (c) uneven layers per chunk `[1, 2]`,
//! under both weight-caching mechanisms; and FP8 weights are cast once per step (on the
//! first microbatch). Case (b) also runs with FP8 on for some callables and off for others
//! ([`LowPrecision::PerCallable`]; the eager run's slots carry the same flags): the FP8-off
//! layers run their f32 path, get no weight casts and leave their scaling tensors alone.
//!
//! # The recipe both runs follow
//!
//! * One [`DelayedScaling`] state for the whole stack (3 tensors per layer: x E4M3, W E4M3,
//!   dY E5M2; history 4, margin 0, max over the history), fresh (history 0, scales 1), with
//!   the tensors of the FP8-on layers registered for updates (graphed: what warmup
//!   recorded; eager: the same set, given directly).
//! * For every schedule entry in order: a forward of (chunk, microbatch) runs the chunk's
//!   layers first to last (each casting its weights first when the microbatch is 0), then
//!   one [`DelayedScaling::update`]; a backward runs them last to first, then one update.
//!   Graphed: the runtime casts (IF node or noop flag) and the `after_forward` /
//!   `after_backward` hooks update. Eager: the test calls `cast_weights` on microbatch 0
//!   only (and never for an FP8-off layer), and `update` at the same points.
//! * Graphed warmup moves the state (amaxes, scales); `before_warmup` saves it into a
//!   [`ScalingSnapshot`] and `after_warmup` restores it, so both runs start from the fresh
//!   state (checked right after the build). Warmup's backward sees zero output gradients,
//!   so it adds exact zeros to the weight gradients.
//! * Fresh inputs and output gradients for every (step, chunk, microbatch), deterministic;
//!   the gradients are never zeroed (both runs accumulate the same sums).
//!
//! # Weight caching
//!
//! After the forward of (chunk 0, microbatch 0) of step 0, the f32 weights of chunk 0 are
//! overwritten on the device. The cached FP8 copies must be used for the rest of the step
//! (microbatches 1 and 2 and every backward give the bits of a run that never changed the
//! weights), and the next step must cast the new weights (its outputs differ from that
//! run's and equal the eager run that made the same change).
//!
//! Sizes: 64 tokens, layers alternate 128 -> 256 and 256 -> 128 features, so every GEMM's K
//! (128, 256 or 64) is a multiple of 16.

use std::sync::Arc;

use cuda_graph::{Context, DeviceBuffer, GraphPool, NodeKind, Stream};
use fp8_kernels::{AmaxAlgo, DelayedScaling, Fp8Format, IdentityGroup};
use fp8_moe::linear::{self, Fp8Linear};
use fp8_moe::scaling;
use graphed_callables::{
    Callable, GraphIndex, GraphedCallables, GraphedOptions, Layout, LowPrecision, Schedule, Slot,
    Step, TensorRecorder, WeightCaching,
};

/// Tokens per microbatch.
const M: usize = 64;
/// The narrow and wide widths of the stack.
const NARROW: usize = 128;
const WIDE: usize = 256;
/// Training steps replayed.
const STEPS: usize = 2;
const HISTORY: usize = 4;
/// Error bound (relative to the largest reference value) of an f32-output GEMM on the
/// tensor-core paths, as fp8-kernels' own GEMM tests use it (Hopper's FP8 wgmma accumulates
/// with about 14 bits between fp32 promotions).
const TENSOR_CORE_BOUND: f64 = 2e-3;

const ORDER_1X3: [i64; 6] = [1, 1, 1, -1, -1, -1];
const ORDER_2X3: [i64; 12] = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1];

/// Input and output features of layer `layer` of any chunk: 128 -> 256, 256 -> 128, ...
fn widths(layer: usize) -> (usize, usize) {
    if layer % 2 == 0 {
        (NARROW, WIDE)
    } else {
        (WIDE, NARROW)
    }
}

/// A deterministic value in `[-scale, scale]`, a multiple of `scale / 512` (exact in f32).
fn value(seed: u64, i: usize, scale: f32) -> f32 {
    let mut h = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9));
    h ^= h >> 31;
    h = h.wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^= h >> 29;
    ((h % 1025) as f32 - 512.0) * (scale / 512.0)
}

fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|i| value(seed, i, scale)).collect()
}

/// Weights of callable `c` (`[out, in]`); `generation` 1 is what the tamper writes.
fn weights(c: usize, layer: usize, generation: u64) -> Vec<f32> {
    let (i, o) = widths(layer);
    values(1000 + 17 * c as u64 + 7919 * generation, i * o, 0.0625)
}

fn bias(c: usize, layer: usize) -> Vec<f32> {
    values(2000 + c as u64, widths(layer).1, 0.25)
}

fn input(step: usize, chunk: usize, microbatch: usize) -> Vec<f32> {
    values(
        3000 + 100 * step as u64 + 10 * chunk as u64 + microbatch as u64,
        M * NARROW,
        2.0,
    )
}

fn grad_output(step: usize, chunk: usize, microbatch: usize, width: usize) -> Vec<f32> {
    values(
        5000 + 100 * step as u64 + 10 * chunk as u64 + microbatch as u64,
        M * width,
        0.5,
    )
}

/// A test case: the order and the layers per chunk.
struct Case {
    name: &'static str,
    order: Vec<f64>,
    layers: Vec<usize>,
}

fn to_f64(order: &[i64]) -> Vec<f64> {
    order.iter().map(|&e| e as f64).collect()
}

/// 2 chunks x 3 microbatches interleaved, each microbatch's weight gradients a step of
/// their own (`-k - 0.5`), some delayed past another backward.
const ORDER_2X3_SPLIT: [f64; 18] = [
    1.0, 2.0, 1.0, 2.0, -2.0, -2.5, -1.0, -1.5, 1.0, 2.0, -2.0, -1.0, -2.5, -1.5, -2.0, -2.5, -1.0,
    -1.5,
];

impl Case {
    fn a() -> Case {
        Case {
            name: "(a) 1 chunk x 3 microbatches",
            order: to_f64(&ORDER_1X3),
            layers: vec![2],
        }
    }
    fn b() -> Case {
        Case {
            name: "(b) 2 chunks x 3 microbatches, interleaved",
            order: to_f64(&ORDER_2X3),
            layers: vec![2, 2],
        }
    }
    fn d() -> Case {
        Case {
            name: "(d) 2 chunks x 3 microbatches, interleaved, split weight gradients",
            order: ORDER_2X3_SPLIT.to_vec(),
            layers: vec![2, 2],
        }
    }
    fn c() -> Case {
        Case {
            name: "(c) uneven layers per chunk [1, 2]",
            order: to_f64(&ORDER_2X3),
            layers: vec![1, 2],
        }
    }
    fn schedule(&self) -> Schedule {
        Schedule::from_f64(&self.order, self.layers.clone()).expect("valid order")
    }
    /// FP8 on for every callable.
    fn all_fp8(&self) -> Vec<bool> {
        vec![true; self.layers.iter().sum()]
    }
}

/// The FP8 tensors (indices into the stack's scaling state) of the callables with FP8 on.
fn fp8_tensors_of(fp8: &[bool]) -> Vec<usize> {
    fp8.iter()
        .enumerate()
        .filter(|(_, on)| **on)
        .flat_map(|(c, _)| c * linear::TENSORS..(c + 1) * linear::TENSORS)
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
    fn upload(&self, v: &[f32]) -> DeviceBuffer<f32> {
        let b = DeviceBuffer::from_host(&self.stream, v).expect("upload");
        self.stream.synchronize().expect("sync");
        b
    }
    fn bits(&self, b: &DeviceBuffer<f32>) -> Vec<u32> {
        self.stream.synchronize().expect("sync before read back");
        let v = b.to_vec(&self.stream).expect("read back");
        self.stream.synchronize().expect("sync");
        v.iter().map(|x| x.to_bits()).collect()
    }
    /// `b`'s values, after the stream's work.
    fn floats(&self, b: &DeviceBuffer<f32>) -> Vec<f32> {
        self.bits(b).into_iter().map(f32::from_bits).collect()
    }
    /// `b`'s bytes, after the stream's work.
    fn bytes(&self, b: &DeviceBuffer<u8>) -> Vec<u8> {
        self.stream.synchronize().expect("sync");
        b.to_vec(&self.stream).expect("read back")
    }
    /// Overwrites `buf` (owned elsewhere, e.g. by a layer inside the runtime) with `v`.
    fn overwrite(&self, buf: &DeviceBuffer<f32>, v: &[f32]) {
        buf.copy_from_host(&self.stream, v).expect("overwrite");
    }
    /// `n` bytes of `fill` on the device (0xff poisons: as f32 words they are NaN).
    fn filled_bytes(&self, n: usize, fill: u8) -> DeviceBuffer<u8> {
        DeviceBuffer::from_host(&self.stream, &vec![fill; n]).expect("upload")
    }
}

/// One layer's buffers for running it eagerly on one microbatch: its input and output
/// gradient uploaded; its output, input gradient and saved buffers poisoned (NaN).
struct LayerIo {
    x: DeviceBuffer<f32>,
    dy: DeviceBuffer<f32>,
    y: DeviceBuffer<f32>,
    dx: DeviceBuffer<f32>,
    saved: Vec<DeviceBuffer<u8>>,
    pool: GraphPool,
}

impl LayerIo {
    fn new(gpu: &Gpu, layer: &Fp8Linear, x: &[f32], dy: &[f32]) -> LayerIo {
        let (m, n, k) = (layer.tokens(), layer.out_features(), layer.in_features());
        LayerIo {
            x: gpu.upload(x),
            dy: gpu.upload(dy),
            y: gpu.upload(&vec![f32::NAN; m * n]),
            dx: gpu.upload(&vec![f32::NAN; m * k]),
            saved: layer
                .saved_bytes()
                .iter()
                .map(|&len| gpu.filled_bytes(len, 0xff))
                .collect(),
            pool: GraphPool::new(&gpu.ctx, 256).expect("pool"),
        }
    }

    /// The slot of (chunk 0, microbatch 0, layer 0) over these buffers.
    fn slot<'a>(
        x: &'a DeviceBuffer<f32>,
        y: &'a DeviceBuffer<f32>,
        saved: &'a [DeviceBuffer<u8>],
        pool: &'a GraphPool,
    ) -> Slot<'a, f32> {
        let at = GraphIndex {
            chunk: 0,
            microbatch: 0,
            layer: 0,
        };
        Slot::new(at, vec![x], vec![y], saved.iter().collect()).with_pool(pool)
    }
}

/// One recorded value: the step it belongs to, what it is, its bits.
struct Entry {
    step: usize,
    label: String,
    bits: Vec<u32>,
}

#[derive(Default)]
struct Record {
    entries: Vec<Entry>,
}

impl Record {
    fn push(&mut self, step: usize, label: String, bits: Vec<u32>) {
        self.entries.push(Entry { step, label, bits });
    }
    fn step(&self, step: usize) -> impl Iterator<Item = &Entry> {
        self.entries.iter().filter(move |e| e.step == step)
    }
}

/// Asserts `got` and `want` hold the same entries with the same bits.
fn assert_same<'a>(
    what: &str,
    got: impl Iterator<Item = &'a Entry>,
    want: impl Iterator<Item = &'a Entry>,
) {
    let (got, want): (Vec<_>, Vec<_>) = (got.collect(), want.collect());
    assert_eq!(got.len(), want.len(), "{what}: entry counts differ");
    assert!(!got.is_empty(), "{what}: nothing recorded");
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.label, w.label, "{what}: entries out of step");
        assert_eq!(g.bits.len(), w.bits.len(), "{what}: {}: lengths", g.label);
        if let Some(i) = (0..g.bits.len()).find(|&i| g.bits[i] != w.bits[i]) {
            let n = g.bits.iter().zip(&w.bits).filter(|(a, b)| a != b).count();
            panic!(
                "{what}: {}: {n} of {} elements differ; first at {i}: got {} ({:#010x}), want \
                 {} ({:#010x})",
                g.label,
                g.bits.len(),
                f32::from_bits(g.bits[i]),
                g.bits[i],
                f32::from_bits(w.bits[i]),
                w.bits[i]
            );
        }
    }
}

fn new_scaling(gpu: &Gpu, callables: usize) -> Arc<DelayedScaling> {
    let formats: Vec<Fp8Format> = (0..callables).flat_map(|_| linear::FORMATS).collect();
    let s = DelayedScaling::new(&gpu.stream, &formats, HISTORY, 0, AmaxAlgo::Max)
        .expect("delayed scaling");
    gpu.stream.synchronize().expect("sync");
    Arc::new(s)
}

/// The stack's layers by callable index, all on `scaling`.
fn new_layers(gpu: &Gpu, layout: &Layout, scaling: &Arc<DelayedScaling>) -> Vec<Fp8Linear> {
    let mut layers = Vec::new();
    for chunk in 0..layout.num_chunks() {
        for layer in 0..layout.layers(chunk).expect("chunk") {
            let c = layout.callable_index(chunk, layer).expect("callable");
            assert_eq!(c, layers.len(), "callables are laid out (chunk, layer)");
            let (i, o) = widths(layer);
            let l = Fp8Linear::new(
                &gpu.stream,
                M,
                i,
                o,
                &weights(c, layer, 0),
                Some(&bias(c, layer)),
                scaling.clone(),
                c * linear::TENSORS,
            )
            .expect("Fp8Linear");
            layers.push(l);
        }
    }
    layers
}

/// Records every gradient of every callable and the scaling state after step `step`.
fn record_step(
    gpu: &Gpu,
    rec: &mut Record,
    step: usize,
    grads: &[Vec<&DeviceBuffer<f32>>],
    scaling: &DelayedScaling,
) {
    for (c, g) in grads.iter().enumerate() {
        assert_eq!(g.len(), 2, "dW and db");
        rec.push(step, format!("step {step} callable {c} dW"), gpu.bits(g[0]));
        rec.push(step, format!("step {step} callable {c} db"), gpu.bits(g[1]));
    }
    rec.push(
        step,
        format!("step {step} amax history"),
        gpu.bits(scaling.history_buffer()),
    );
    rec.push(
        step,
        format!("step {step} scale"),
        gpu.bits(scaling.scale_buffer()),
    );
    rec.push(
        step,
        format!("step {step} scale_inv"),
        gpu.bits(scaling.scale_inv_buffer()),
    );
}

fn forward_label(step: usize, pos: usize, chunk: usize, microbatch: usize) -> String {
    format!("step {step} order[{pos}] forward chunk {chunk} microbatch {microbatch}: y")
}

fn backward_label(step: usize, pos: usize, chunk: usize, microbatch: usize) -> String {
    format!("step {step} order[{pos}] backward chunk {chunk} microbatch {microbatch}: dx")
}

/// Whether to overwrite chunk 0's weights after step 0's first forward.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Tamper {
    No,
    AfterFirstForward,
}

/// Overwrites the weights of chunk 0's layers (given as `(callable, layer, weight)`).
fn tamper(gpu: &Gpu, targets: &[(usize, usize, &DeviceBuffer<f32>)]) {
    for &(c, layer, w) in targets {
        gpu.overwrite(w, &weights(c, layer, 1));
    }
}

fn check_tamper_point(schedule: &Schedule) {
    assert_eq!(
        schedule.steps()[0],
        Step::Forward {
            chunk: 0,
            microbatch: 0
        },
        "the tamper point is the first entry"
    );
}

/// The graphed run, with weight caching `mode`, layers merged into one graph per step or
/// one graph per layer, FP8 on for callable `c` iff `fp8[c]`.
fn run_graphed(
    gpu: &Gpu,
    case: &Case,
    (mode, merge): (WeightCaching, bool),
    tamper_at: Tamper,
    fp8: &[bool],
) -> Record {
    mode.check()
        .unwrap_or_else(|e| panic!("{}: {mode:?} unsupported by this driver: {e}", case.name));
    let schedule = case.schedule();
    check_tamper_point(&schedule);
    let layout = schedule.layout().clone();
    assert_eq!(
        fp8.len(),
        layout.total_callables(),
        "one FP8 flag per callable"
    );
    let scaling = new_scaling(gpu, layout.total_callables());
    let layers = new_layers(gpu, &layout, &scaling);
    let callables: Vec<Box<dyn Callable<f32>>> = layers
        .into_iter()
        .map(|l| Box::new(l) as Box<dyn Callable<f32>>)
        .collect();

    let mut options = GraphedOptions::new(schedule.clone())
        .with_weight_caching(mode)
        .with_merge_layers(merge);
    options.low_precision = LowPrecision::PerCallable(fp8.to_vec());
    // Snapshot/restore around warmup, register what warmup ran, reduce + update after
    // every replay.
    scaling::install_hooks(&mut options, &gpu.ctx, &scaling, Arc::new(IdentityGroup))
        .expect("scaling hooks");

    let sample = gpu.upload(&input(99, 9, 9));
    // One set per callable: the first layer of each chunk reads it.
    let samples: Vec<Vec<&DeviceBuffer<f32>>> = (0..layout.total_callables())
        .map(|c| {
            if layout.is_chunk_input(c) {
                vec![&sample]
            } else {
                vec![]
            }
        })
        .collect();
    let graphed = GraphedCallables::build(&gpu.stream, callables, &samples, options)
        .unwrap_or_else(|e| panic!("{}: build ({mode:?}): {e}", case.name));
    gpu.stream.synchronize().expect("sync after build");

    // Every FP8-on layer ran its x, W and dY casts in warmup, the FP8-off layers none: those
    // recorded are registered.
    let n = layout.total_callables() * linear::TENSORS;
    for (c, &on) in fp8.iter().enumerate() {
        let want: Vec<usize> = if on {
            (c * linear::TENSORS..(c + 1) * linear::TENSORS).collect()
        } else {
            Vec::new()
        };
        let got: Vec<usize> = graphed
            .warmup_record()
            .of_callable(c)
            .expect("callable recorded")
            .iter()
            .copied()
            .collect();
        assert_eq!(
            got, want,
            "{}: FP8 tensors callable {c} ran in warmup",
            case.name
        );
    }
    assert_eq!(scaling.registered(), fp8_tensors_of(fp8));
    // Warmup's changes to the FP8 state were undone by the hooks.
    assert_eq!(
        gpu.bits(scaling.history_buffer()),
        vec![0u32; n * HISTORY],
        "{}: {mode:?}: amax history not restored after warmup",
        case.name
    );
    assert_eq!(
        gpu.bits(scaling.scale_buffer()),
        vec![1f32.to_bits(); n],
        "{}: {mode:?}: scales not restored after warmup",
        case.name
    );
    assert_eq!(
        gpu.bits(scaling.scale_inv_buffer()),
        vec![1f32.to_bits(); n],
        "{}: {mode:?}: inverse scales not restored after warmup",
        case.name
    );
    // Every FP8-on layer's forward graph casts, no FP8-off one; in Conditional mode inside
    // one IF node, holding the casts of every casting layer in the graph: with merged
    // layers a forward graph holds all its chunk's layers (it has the IF node when any of
    // them has FP8 on), without it holds its own layer only.
    assert_eq!(graphed.merges_layers(), merge);
    for g in 0..layout.total_graphs() {
        let c = layout.callable_of_graph(g).expect("callable of graph");
        assert_eq!(
            graphed.casts_weights(g),
            Some(fp8[c]),
            "graph {g} (callable {c}, FP8 {}) casts iff FP8 is on",
            fp8[c]
        );
        let in_graph = if merge {
            let chunk = layout.locate(g).expect("graph").chunk;
            layout.chunk_callables(chunk).expect("chunk")
        } else {
            c..c + 1
        };
        let any_casts = in_graph.into_iter().any(|c| fp8[c]);
        let conds = graphed
            .forward_graph(g)
            .expect("forward graph")
            .nodes()
            .expect("nodes")
            .iter()
            .filter(|n| n.kind == NodeKind::Conditional)
            .count();
        let want = usize::from(mode == WeightCaching::Conditional && any_casts);
        assert_eq!(
            conds, want,
            "{mode:?}, merged {merge}, FP8 {fp8:?}: conditional nodes of forward graph {g}"
        );
    }

    // Chunk 0's layers' weights, for the tamper.
    let chunk0: Vec<(usize, usize, &DeviceBuffer<f32>)> = (0..layout.layers(0).expect("chunk 0"))
        .map(|l| {
            let c = layout.callable_index(0, l).expect("callable");
            (c, l, graphed.callables()[c].parameters()[0])
        })
        .collect();
    let grads: Vec<Vec<&DeviceBuffer<f32>>> =
        graphed.callables().iter().map(|c| c.gradients()).collect();

    let mut rec = Record::default();
    for step in 0..STEPS {
        for (pos, &st) in schedule.steps().iter().enumerate() {
            let (chunk, mb) = (st.chunk(), st.microbatch());
            match st {
                Step::Forward { .. } => {
                    let x = gpu.upload(&input(step, chunk, mb));
                    let y = graphed
                        .forward(chunk, mb, &[&x], &gpu.stream)
                        .unwrap_or_else(|e| panic!("forward {chunk}/{mb}: {e}"));
                    rec.push(step, forward_label(step, pos, chunk, mb), gpu.bits(&y[0]));
                    if step == 0 && pos == 0 && tamper_at == Tamper::AfterFirstForward {
                        tamper(gpu, &chunk0);
                    }
                }
                Step::Backward { .. } => {
                    let last = layout.layers(chunk).expect("chunk") - 1;
                    let dy = gpu.upload(&grad_output(step, chunk, mb, widths(last).1));
                    let dx = graphed
                        .backward(chunk, mb, &[&dy], &gpu.stream)
                        .unwrap_or_else(|e| panic!("backward {chunk}/{mb}: {e}"));
                    rec.push(step, backward_label(step, pos, chunk, mb), gpu.bits(&dx[0]));
                }
                Step::WeightGrad { .. } => graphed
                    .weight_grad(chunk, mb, &gpu.stream)
                    .unwrap_or_else(|e| panic!("weight gradient {chunk}/{mb}: {e}")),
            }
        }
        record_step(gpu, &mut rec, step, &grads, &scaling);
    }
    rec
}

/// The eager run's buffers, from which [`EagerSlots::slot`] makes the slot of a (chunk,
/// microbatch, layer) as the runtime would.
struct EagerSlots<'a> {
    layout: &'a Layout,
    /// The first layer's input per (chunk, microbatch).
    first_inputs: &'a [DeviceBuffer<f32>],
    /// Per graph index.
    outputs: &'a [DeviceBuffer<f32>],
    saved: &'a [Vec<DeviceBuffer<u8>>],
    pool: &'a GraphPool,
    fp8: &'a [bool],
}

impl<'a> EagerSlots<'a> {
    /// The graph index, callable, input and slot of layer `l` of (chunk, microbatch).
    fn slot(
        &self,
        chunk: usize,
        mb: usize,
        l: usize,
    ) -> (usize, usize, &'a DeviceBuffer<f32>, Slot<'a, f32>) {
        let g_of = |l: usize| self.layout.index(chunk, mb, l).expect("graph index");
        let g = g_of(l);
        let x = if l == 0 {
            &self.first_inputs[chunk * self.layout.num_microbatches() + mb]
        } else {
            &self.outputs[g_of(l - 1)]
        };
        let at = GraphIndex {
            chunk,
            microbatch: mb,
            layer: l,
        };
        let c = self.layout.callable_index(chunk, l).expect("callable");
        let slot = Slot::new(
            at,
            vec![x],
            vec![&self.outputs[g]],
            self.saved[g].iter().collect(),
        )
        .with_pool(self.pool)
        .with_low_precision(self.fp8[c]);
        (g, c, x, slot)
    }
}

/// The eager reference: the same layers (fresh, same values) driven directly, with one
/// set of buffers per (chunk, microbatch, layer) like the runtime's, FP8 on for callable `c`
/// iff `fp8[c]` (its slots' flag; no weight casts when off), the FP8-on callables' tensors
/// registered as the graphed run's warmup registers them.
fn run_eager(gpu: &Gpu, case: &Case, tamper_at: Tamper, fp8: &[bool]) -> Record {
    let schedule = case.schedule();
    check_tamper_point(&schedule);
    let layout = schedule.layout().clone();
    assert_eq!(
        fp8.len(),
        layout.total_callables(),
        "one FP8 flag per callable"
    );
    let scaling = new_scaling(gpu, layout.total_callables());
    scaling
        .register(&gpu.stream, fp8_tensors_of(fp8))
        .expect("register");
    gpu.stream.synchronize().expect("sync");
    let mut layers = new_layers(gpu, &layout, &scaling);
    let pool = GraphPool::new(&gpu.ctx, 256).expect("pool");
    let nm = layout.num_microbatches();

    // Per graph index: outputs, input gradients, saved buffers; per (chunk, microbatch):
    // the first layer's input. Outputs and gradients poisoned (NaN) so an unwritten element
    // shows.
    let mut outputs = Vec::new();
    let mut grad_inputs = Vec::new();
    let mut saved = Vec::new();
    for g in 0..layout.total_graphs() {
        let at = layout.locate(g).expect("graph");
        let l = &layers[layout.callable_of_graph(g).expect("callable")];
        assert_eq!(l.in_features(), widths(at.layer).0, "layer of graph {g}");
        outputs.push(gpu.upload(&vec![f32::NAN; M * l.out_features()]));
        grad_inputs.push(gpu.upload(&vec![f32::NAN; M * l.in_features()]));
        saved.push(
            l.saved_bytes()
                .iter()
                .map(|&n| gpu.filled_bytes(n, 0xff))
                .collect::<Vec<_>>(),
        );
    }
    let first_inputs: Vec<DeviceBuffer<f32>> = (0..layout.num_chunks() * nm)
        .map(|_| gpu.upload(&vec![f32::NAN; M * NARROW]))
        .collect();

    let mut rec = Record::default();
    for step in 0..STEPS {
        for (pos, &st) in schedule.steps().iter().enumerate() {
            let (chunk, mb) = (st.chunk(), st.microbatch());
            let nl = layout.layers(chunk).expect("chunk");
            let g_of = |l: usize| layout.index(chunk, mb, l).expect("graph index");
            let pair = chunk * nm + mb;
            match st {
                Step::Forward { .. } => {
                    first_inputs[pair]
                        .copy_from_host(&gpu.stream, &input(step, chunk, mb))
                        .expect("input");
                    let eager = EagerSlots {
                        layout: &layout,
                        first_inputs: &first_inputs,
                        outputs: &outputs,
                        saved: &saved,
                        pool: &pool,
                        fp8,
                    };
                    for l in 0..nl {
                        let (g, c, x, slot) = eager.slot(chunk, mb, l);
                        let at = slot.at();
                        let layer = &mut layers[c];
                        if mb == 0 && fp8[c] {
                            layer.cast_weights(&gpu.stream, &slot).expect("cast");
                        }
                        layer
                            .forward(&gpu.stream, &[x], &[&outputs[g]], &slot)
                            .unwrap_or_else(|e| panic!("eager forward {at}: {e}"));
                    }
                    scaling.update(&gpu.stream).expect("update");
                    rec.push(
                        step,
                        forward_label(step, pos, chunk, mb),
                        gpu.bits(&outputs[g_of(nl - 1)]),
                    );
                    if step == 0 && pos == 0 && tamper_at == Tamper::AfterFirstForward {
                        let targets: Vec<(usize, usize, &DeviceBuffer<f32>)> =
                            (0..layout.layers(0).expect("chunk 0"))
                                .map(|l| {
                                    let c = layout.callable_index(0, l).expect("callable");
                                    (c, l, layers[c].weight())
                                })
                                .collect();
                        tamper(gpu, &targets);
                    }
                }
                Step::Backward { .. } | Step::WeightGrad { .. } => {
                    // A weight-gradient step reads the same dY (regenerated) and slots as
                    // its backward did.
                    let dy = gpu.upload(&grad_output(step, chunk, mb, widths(nl - 1).1));
                    let eager = EagerSlots {
                        layout: &layout,
                        first_inputs: &first_inputs,
                        outputs: &outputs,
                        saved: &saved,
                        pool: &pool,
                        fp8,
                    };
                    for l in (0..nl).rev() {
                        let g = g_of(l);
                        let go = if l == nl - 1 {
                            &dy
                        } else {
                            &grad_inputs[g_of(l + 1)]
                        };
                        let (_, c, _, slot) = eager.slot(chunk, mb, l);
                        let at = slot.at();
                        let gi = [&grad_inputs[g]];
                        match st {
                            Step::WeightGrad { .. } => {
                                layers[c].backward_weight(&gpu.stream, &[go], &slot)
                            }
                            _ if schedule.splits_weight_grad() => {
                                layers[c].backward_input(&gpu.stream, &[go], &gi, &slot)
                            }
                            _ => layers[c].backward(&gpu.stream, &[go], &gi, &slot),
                        }
                        .unwrap_or_else(|e| panic!("eager {st:?} at {at}: {e}"));
                    }
                    if let Step::Backward { .. } = st {
                        scaling.update(&gpu.stream).expect("update");
                        rec.push(
                            step,
                            backward_label(step, pos, chunk, mb),
                            gpu.bits(&grad_inputs[g_of(0)]),
                        );
                    }
                }
            }
        }
        let grads: Vec<Vec<&DeviceBuffer<f32>>> = layers.iter().map(|l| l.gradients()).collect();
        record_step(gpu, &mut rec, step, &grads, &scaling);
    }
    rec
}

/// (weight caching, layers merged) of the graphed runs: the three mechanisms, each with
/// one graph per step and one graph per layer.
const MODES: [(WeightCaching, bool); 6] = [
    (WeightCaching::Conditional, true),
    (WeightCaching::Conditional, false),
    (WeightCaching::NoopFlag, true),
    (WeightCaching::NoopFlag, false),
    (WeightCaching::Static, true),
    (WeightCaching::Static, false),
];

/// Graphed == eager, bit for bit, under both mechanisms, layers merged or not, FP8 on for
/// callable `c` iff `fp8[c]`. Returns the eager record.
fn graphed_equals_eager(case: &Case, fp8: &[bool]) -> Record {
    let gpu = Gpu::new();
    let eager = run_eager(&gpu, case, Tamper::No, fp8);
    // The eager run is itself sane: finite outputs, non-zero gradients.
    for e in &eager.entries {
        assert!(
            e.bits.iter().all(|&b| f32::from_bits(b).is_finite()),
            "{}: eager {} has non-finite values",
            case.name,
            e.label
        );
        if e.label.contains(": y") || e.label.contains(": dx") || e.label.ends_with("dW") {
            assert!(
                e.bits.iter().any(|&b| f32::from_bits(b) != 0.0),
                "{}: eager {} is all zero",
                case.name,
                e.label
            );
        }
    }
    for mode in MODES {
        let graphed = run_graphed(&gpu, case, mode, Tamper::No, fp8);
        assert_same(
            &format!("{}, {mode:?}, FP8 {fp8:?}: graphed vs eager", case.name),
            graphed.entries.iter(),
            eager.entries.iter(),
        );
    }
    eager
}

#[test]
#[ignore = "needs a CUDA device"]
fn graphed_equals_eager_1_chunk_3_microbatches() {
    let case = Case::a();
    graphed_equals_eager(&case, &case.all_fp8());
}

#[test]
#[ignore = "needs a CUDA device"]
fn graphed_equals_eager_2_chunks_3_microbatches_interleaved() {
    let case = Case::b();
    graphed_equals_eager(&case, &case.all_fp8());
}

#[test]
#[ignore = "needs a CUDA device"]
fn graphed_equals_eager_split_weight_gradients() {
    let case = Case::d();
    graphed_equals_eager(&case, &case.all_fp8());
    // One layer of each chunk with FP8 off: its split halves run in f32.
    graphed_equals_eager(&case, &[true, false, false, true]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn graphed_equals_eager_uneven_layers_per_chunk() {
    let case = Case::c();
    graphed_equals_eager(&case, &case.all_fp8());
}

/// Case (b) with FP8 on for some callables and off for others
/// ([`LowPrecision::PerCallable`]), graphed == eager bit for bit under every mode. Callables
/// are (chunk, layer) `0 = (0, 0)`, `1 = (0, 1)`, `2 = (1, 0)`, `3 = (1, 1)`. Alternating
/// on/off: every chunk mixes, an FP8 layer feeding an FP8-off one. Then off/on/off/off:
/// chunk 0 has an FP8-off layer feeding an FP8 one, chunk 1 is all off (no casts at all;
/// with merged layers its forward graphs have no IF node). The FP8-off layers' scaling
/// tensors stay fresh (history 0, scales 1); the FP8 layers' x scales moved.
#[test]
#[ignore = "needs a CUDA device"]
fn graphed_equals_eager_with_fp8_per_callable() {
    let case = Case::b();
    for fp8 in [
        vec![true, false, true, false],
        vec![false, true, false, false],
    ] {
        let eager = graphed_equals_eager(&case, &fp8);
        let last = |what: &str| -> Vec<f32> {
            let label = format!("step {} {what}", STEPS - 1);
            eager
                .entries
                .iter()
                .find(|e| e.label == label)
                .unwrap_or_else(|| panic!("{label} recorded"))
                .bits
                .iter()
                .map(|&b| f32::from_bits(b))
                .collect()
        };
        let (history, scale, scale_inv) = (last("amax history"), last("scale"), last("scale_inv"));
        for (c, &on) in fp8.iter().enumerate() {
            let tensors = c * linear::TENSORS..(c + 1) * linear::TENSORS;
            if on {
                assert_ne!(
                    scale[c * linear::TENSORS],
                    1.0,
                    "FP8 {fp8:?}: callable {c} (FP8 on) updated x's scale"
                );
            } else {
                for t in tensors {
                    assert!(
                        history[t * HISTORY..(t + 1) * HISTORY]
                            .iter()
                            .all(|&h| h.to_bits() == 0),
                        "FP8 {fp8:?}: callable {c} (FP8 off): tensor {t}'s amax history"
                    );
                    assert_eq!(
                        (scale[t].to_bits(), scale_inv[t].to_bits()),
                        (1f32.to_bits(), 1f32.to_bits()),
                        "FP8 {fp8:?}: callable {c} (FP8 off): tensor {t}'s scales"
                    );
                }
            }
        }
    }
}

/// Weights are cast once per step: changing W after the first microbatch's forward does not
/// reach the rest of the step, and does reach the next step.
fn weights_cast_once_per_step(case: Case) {
    let gpu = Gpu::new();
    let fp8 = case.all_fp8();
    let untouched = run_eager(&gpu, &case, Tamper::No, &fp8);
    let eager = run_eager(&gpu, &case, Tamper::AfterFirstForward, &fp8);
    for mode in MODES {
        let what = format!("{}, {mode:?}", case.name);
        let graphed = run_graphed(&gpu, &case, mode, Tamper::AfterFirstForward, &fp8);
        assert_same(
            &format!("{what}: graphed vs eager, weights changed after the first forward"),
            graphed.entries.iter(),
            eager.entries.iter(),
        );
        assert_same(
            &format!(
                "{what}: step 0 with the weights changed after its first forward vs never \
                 changed (a recast on a later microbatch would differ)"
            ),
            graphed.step(0),
            untouched.step(0),
        );
        // Step 1 recast the new weights: chunk 0's first forward differs.
        let first = |r: &Record| {
            r.step(1)
                .find(|e| e.label.contains("forward chunk 0 microbatch 0"))
                .map(|e| e.bits.clone())
                .expect("step 1 forward of chunk 0 microbatch 0")
        };
        assert_ne!(
            first(&graphed),
            first(&untouched),
            "{what}: step 1 must cast the changed weights"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn weights_cast_once_per_step_1_chunk() {
    weights_cast_once_per_step(Case::a());
}

#[test]
#[ignore = "needs a CUDA device"]
fn weights_cast_once_per_step_2_chunks_interleaved() {
    weights_cast_once_per_step(Case::b());
}

/// Pure logic: the test sizes obey the GEMM rules and the layers of a chunk chain.
#[test]
fn test_sizes_are_valid_and_chain() {
    for case in [Case::a(), Case::b(), Case::c()] {
        let schedule = case.schedule();
        for (chunk, &n) in case.layers.iter().enumerate() {
            assert_eq!(widths(0).0, NARROW, "chunk inputs are {NARROW} wide");
            for l in 0..n {
                let (i, o) = widths(l);
                linear::check_shape(M, i, o)
                    .unwrap_or_else(|e| panic!("{} chunk {chunk} layer {l}: {e}", case.name));
                if l + 1 < n {
                    assert_eq!(o, widths(l + 1).0, "layer {l} feeds layer {}", l + 1);
                }
            }
        }
        assert_eq!(schedule.num_microbatches(), 3, "{}", case.name);
    }
    // The deterministic values are exact multiples of scale / 512 within the range.
    for v in values(7, 1000, 2.0) {
        assert!((-2.0..=2.0).contains(&v));
        assert_eq!((v * 256.0).fract(), 0.0);
    }
}

/// One layer, eagerly, against the host: the FP8 copies of W and W^T, x's amax and X^T
/// (saved) bit for bit against fp8-kernels' reference quantize (with the scale the state
/// holds: 1 in the first forward, 448 / amax after an update in the second); y, dX and dW
/// against f64 sums of the dequantized FP8 values (error relative to the largest value below
/// [`TENSOR_CORE_BOUND`]); db bit for bit against a sequential f32 column sum of the
/// unquantized dY.
#[test]
#[ignore = "needs a CUDA device"]
fn fp8_linear_matches_host_reference() {
    use fp8_kernels::reference::{dequantize, quantize};
    let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
    let gpu = Gpu::new();
    let (k, n) = (NARROW, WIDE);
    let scaling = new_scaling(&gpu, 1);
    let w = weights(0, 0, 0);
    let b = bias(0, 0);
    let mut layer =
        Fp8Linear::new(&gpu.stream, M, k, n, &w, Some(&b), scaling.clone(), 0).expect("Fp8Linear");
    let x_host = input(0, 0, 0);
    let dy_host = grad_output(0, 0, 0, n);
    let LayerIo {
        x,
        dy,
        y,
        dx,
        saved,
        pool,
    } = LayerIo::new(&gpu, &layer, &x_host, &dy_host);
    let slot = LayerIo::slot(&x, &y, &saved, &pool);
    let close = |what: &str, got: &[f32], want: &[f64]| {
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "{what}: the reference is all zero");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let err = (f64::from(*g) - w).abs() / scale;
            assert!(
                err < TENSOR_CORE_BOUND,
                "{what}[{i}]: got {g}, want {w} (error {err:e})"
            );
        }
    };

    layer.cast_weights(&gpu.stream, &slot).expect("cast");
    let w_scale = scaling
        .scale(1)
        .expect("scale")
        .read(&gpu.stream)
        .expect("read");
    assert_eq!(w_scale, 1.0, "fresh state");
    let wq: Vec<u8> = w.iter().map(|&v| quantize(v, w_scale, e4)).collect();
    assert_eq!(gpu.bytes(layer.weight_fp8().data()), wq, "FP8 copy of W");
    let wtq: Vec<u8> = (0..k * n).map(|i| wq[(i % n) * k + i / n]).collect();
    assert_eq!(gpu.bytes(layer.weight_t_fp8()), wtq, "FP8 copy of W^T");
    let wd: Vec<f64> = wq
        .iter()
        .map(|&q| f64::from(dequantize(q, 1.0 / w_scale, e4)))
        .collect();

    let mut last_x_scale = 1.0;
    for pass in 0..2 {
        let x_scale = scaling
            .scale(0)
            .expect("scale")
            .read(&gpu.stream)
            .expect("read");
        if pass == 1 {
            assert_ne!(x_scale, 1.0, "the update changed x's scale");
        }
        layer
            .forward(&gpu.stream, &[&x], &[&y], &slot)
            .expect("forward");
        assert_eq!(
            scaling
                .amax(0)
                .expect("amax")
                .read(&gpu.stream)
                .expect("read"),
            fp8_kernels::reference::amax(x_host.iter().copied()),
            "pass {pass}: x's amax"
        );
        let xq: Vec<u8> = x_host.iter().map(|&v| quantize(v, x_scale, e4)).collect();
        let xtq: Vec<u8> = (0..M * k).map(|i| xq[(i % M) * k + i / M]).collect();
        let saved_xt: Vec<u8> = gpu.bytes(&saved[0]);
        assert_eq!(saved_xt, xtq, "pass {pass}: saved X^T bytes");
        assert_eq!(
            gpu.floats(&saved[1].reinterpret().expect("an f32")),
            vec![1.0 / x_scale],
            "pass {pass}: saved scale_inv"
        );
        let xd: Vec<f64> = xq
            .iter()
            .map(|&q| f64::from(dequantize(q, 1.0 / x_scale, e4)))
            .collect();
        let want: Vec<f64> = (0..M * n)
            .map(|i| {
                let (r, o) = (i / n, i % n);
                (0..k).map(|j| xd[r * k + j] * wd[o * k + j]).sum::<f64>() + f64::from(b[o])
            })
            .collect();
        close(&format!("pass {pass}: y"), &gpu.floats(&y), &want);
        last_x_scale = x_scale;
        scaling.update(&gpu.stream).expect("update");
    }

    // Backward after the second forward (saved X^T is the second pass's). dY's scale is
    // still 1: its history is empty and an amax of 0 keeps the old scale.
    let dy_scale = scaling
        .scale(2)
        .expect("scale")
        .read(&gpu.stream)
        .expect("read");
    assert_eq!(dy_scale, 1.0);
    let (x_scale, x_scale_inv) = (
        last_x_scale,
        gpu.floats(&saved[1].reinterpret().expect("an f32"))[0],
    );
    layer
        .backward(&gpu.stream, &[&dy], &[&dx], &slot)
        .expect("backward");
    let dyd: Vec<f64> = dy_host
        .iter()
        .map(|&v| f64::from(dequantize(quantize(v, dy_scale, e5), 1.0 / dy_scale, e5)))
        .collect();
    let xd: Vec<f64> = x_host
        .iter()
        .map(|&v| f64::from(dequantize(quantize(v, x_scale, e4), x_scale_inv, e4)))
        .collect();
    let want_dx: Vec<f64> = (0..M * k)
        .map(|i| {
            let (r, j) = (i / k, i % k);
            (0..n).map(|o| dyd[r * n + o] * wd[o * k + j]).sum()
        })
        .collect();
    close("dX", &gpu.floats(&dx), &want_dx);
    let want_dw: Vec<f64> = (0..n * k)
        .map(|i| {
            let (o, j) = (i / k, i % k);
            (0..M).map(|r| dyd[r * n + o] * xd[r * k + j]).sum()
        })
        .collect();
    close("dW", &gpu.floats(layer.weight_grad()), &want_dw);
    let want_db: Vec<u32> = (0..n)
        .map(|o| {
            let mut acc = 0f32;
            for r in 0..M {
                acc += dy_host[r * n + o];
            }
            acc.to_bits()
        })
        .collect();
    assert_eq!(
        gpu.bits(layer.bias_grad().expect("bias")),
        want_db,
        "db: sequential f32 column sums of dY"
    );
}

/// One layer with FP8 off ([`Slot::with_low_precision`]`(false)`), eagerly, against the host: y, dX
/// and dW (accumulated onto a non-zero dW) against f64 sums of the unquantized f32 values,
/// db bit for bit against a sequential f32 column sum of dY added onto a non-zero db; and
/// nothing FP8 touched: the scaling state (history, scales) keeps its bits, nothing is
/// recorded, the FP8 weight copies and the saved buffers are untouched.
///
/// Sizes 48 tokens, 80 -> 112 features: multiples of 16 (the layer's rule) that are not
/// multiples of the kernels' 32-wide tiles, so every GEMM has partial edge tiles and a
/// partial last K slab. Values are the test's deterministic ones divided by 3, so they
/// carry full 24-bit mantissas and the sums round.
///
/// The bound: each output element is a sequential f32 sum (FMA per term) of `K` products,
/// plus one more addition (the bias, or the old dW), so `|got - exact| <= gamma_(K+1) *
/// (sum of |products| + |added|)` with `gamma_n = n u / (1 - n u)` and `u = 2^-24`
/// (Higham, recursive summation). The test allows `2 (K + 1) 2^-24` times that magnitude
/// per element; the f64 reference is exact up to `K 2^-53` of it (f32 products are exact in
/// f64). A wrong layout, a missing or doubled term or a stale element (NaN poison) is far
/// outside it.
#[test]
#[ignore = "needs a CUDA device"]
fn fp8_off_linear_matches_host_reference() {
    const T: usize = 48;
    const K: usize = 80;
    const N: usize = 112;
    let gpu = Gpu::new();
    let scaling = new_scaling(&gpu, 1);
    let rough = |seed: u64, n: usize, scale: f32| -> Vec<f32> {
        values(seed, n, scale)
            .into_iter()
            .map(|v| v / 3.0)
            .collect()
    };
    let (w, b) = (rough(11, N * K, 0.0625), rough(12, N, 0.25));
    let (x_host, dy_host) = (rough(13, T * K, 2.0), rough(14, T * N, 0.5));
    let (dw0, db0) = (rough(15, N * K, 0.5), rough(16, N, 0.5));
    let mut layer =
        Fp8Linear::new(&gpu.stream, T, K, N, &w, Some(&b), scaling.clone(), 0).expect("Fp8Linear");
    gpu.overwrite(layer.weight_grad(), &dw0);
    gpu.overwrite(layer.bias_grad().expect("bias"), &db0);
    let LayerIo {
        x,
        dy,
        y,
        dx,
        saved,
        pool,
    } = LayerIo::new(&gpu, &layer, &x_host, &dy_host);
    let recorder = TensorRecorder::new();
    let slot = LayerIo::slot(&x, &y, &saved, &pool)
        .with_low_precision(false)
        .with_recorder(&recorder);
    assert!(!slot.low_precision());
    let fp8_state = |layer: &Fp8Linear| {
        (
            gpu.bits(scaling.history_buffer()),
            gpu.bits(scaling.scale_buffer()),
            gpu.bits(scaling.scale_inv_buffer()),
            gpu.bytes(layer.weight_fp8().data()),
            gpu.bytes(layer.weight_t_fp8()),
            gpu.bits(layer.weight_fp8().scale_inv().buffer()),
        )
    };
    let before = fp8_state(&layer);
    // `want` holds (exact value, sum of the magnitudes of its terms) per element, `terms`
    // the number of products.
    let close = |what: &str, got: &[f32], want: &[(f64, f64)], terms: usize| {
        assert_eq!(got.len(), want.len(), "{what}: length");
        let ulp_bound = 2.0 * (terms + 1) as f64 * (-24f64).exp2();
        let scale = want.iter().fold(0f64, |m, (v, _)| m.max(v.abs()));
        assert!(scale > 0.0, "{what}: the reference is all zero");
        let mut worst = 0f64;
        for (i, (g, (v, mag))) in got.iter().zip(want).enumerate() {
            let err = (f64::from(*g) - v).abs();
            let bound = ulp_bound * mag;
            assert!(
                err <= bound,
                "{what}[{i}]: got {g}, want {v} (error {err:e}, bound {bound:e})"
            );
            worst = worst.max(err / scale);
        }
        eprintln!("{what}: largest error {worst:e} of the largest |reference|");
    };

    layer
        .forward(&gpu.stream, &[&x], &[&y], &slot)
        .expect("forward");
    let want_y: Vec<(f64, f64)> = (0..T * N)
        .map(|i| {
            let (r, o) = (i / N, i % N);
            let terms = (0..K).map(|j| f64::from(x_host[r * K + j]) * f64::from(w[o * K + j]));
            terms.fold((f64::from(b[o]), f64::from(b[o]).abs()), |(s, m), t| {
                (s + t, m + t.abs())
            })
        })
        .collect();
    close("y", &gpu.floats(&y), &want_y, K);

    layer
        .backward(&gpu.stream, &[&dy], &[&dx], &slot)
        .expect("backward");
    let want_dx: Vec<(f64, f64)> = (0..T * K)
        .map(|i| {
            let (r, j) = (i / K, i % K);
            let terms = (0..N).map(|o| f64::from(dy_host[r * N + o]) * f64::from(w[o * K + j]));
            terms.fold((0.0, 0.0), |(s, m), t| (s + t, m + t.abs()))
        })
        .collect();
    close("dX", &gpu.floats(&dx), &want_dx, N);
    let want_dw: Vec<(f64, f64)> = (0..N * K)
        .map(|i| {
            let (o, j) = (i / K, i % K);
            let terms =
                (0..T).map(|r| f64::from(dy_host[r * N + o]) * f64::from(x_host[r * K + j]));
            let d0 = f64::from(dw0[i]);
            terms.fold((d0, d0.abs()), |(s, m), t| (s + t, m + t.abs()))
        })
        .collect();
    close("dW", &gpu.floats(layer.weight_grad()), &want_dw, T);
    let want_db: Vec<u32> = (0..N)
        .map(|o| {
            let mut acc = 0f32;
            for r in 0..T {
                acc += dy_host[r * N + o];
            }
            (db0[o] + acc).to_bits()
        })
        .collect();
    assert_eq!(
        gpu.bits(layer.bias_grad().expect("bias")),
        want_db,
        "db: the old db plus sequential f32 column sums of dY"
    );

    assert!(
        recorder.tensors().is_empty(),
        "FP8 off records no FP8 tensor, got {:?}",
        recorder.tensors()
    );
    assert!(
        before == fp8_state(&layer),
        "FP8 off changed the scaling state or the FP8 weight copies"
    );
    for (i, s) in saved.iter().enumerate() {
        assert!(
            gpu.bytes(s).iter().all(|&b| b == 0xff),
            "FP8 off wrote saved buffer {i}"
        );
    }
}

/// `cast_weights` honours the slot's noop flag (the eager form of
/// [`WeightCaching::NoopFlag`]): with the flag at 1.0 the FP8 copies, the `scale_inv` and
/// W's amax stay as they were although W changed; at 0.0 the new W is cast.
#[test]
#[ignore = "needs a CUDA device"]
fn cast_weights_honours_the_noop_flag() {
    use fp8_kernels::reference::quantize;
    let gpu = Gpu::new();
    let (k, n) = (NARROW, WIDE);
    let scaling = new_scaling(&gpu, 1);
    let (w0, w1) = (weights(0, 0, 0), weights(0, 0, 1));
    let mut layer =
        Fp8Linear::new(&gpu.stream, M, k, n, &w0, None, scaling.clone(), 0).expect("Fp8Linear");
    let x = gpu.upload(&input(0, 0, 0));
    let y = gpu.upload(&vec![0f32; M * n]);
    let saved: Vec<DeviceBuffer<u8>> = layer
        .saved_bytes()
        .iter()
        .map(|&len| gpu.filled_bytes(len, 0))
        .collect();
    let pool = GraphPool::new(&gpu.ctx, 256).expect("pool");
    let at = GraphIndex {
        chunk: 0,
        microbatch: 1,
        layer: 0,
    };
    let w_amax = || {
        scaling
            .amax(1)
            .expect("amax")
            .read(&gpu.stream)
            .expect("read")
    };
    let q = |w: &[f32]| -> Vec<u8> {
        w.iter()
            .map(|&v| quantize(v, 1.0, Fp8Format::E4M3))
            .collect()
    };

    let plain = Slot::new(at, vec![&x], vec![&y], saved.iter().collect()).with_pool(&pool);
    layer.cast_weights(&gpu.stream, &plain).expect("cast");
    assert_eq!(gpu.bytes(layer.weight_fp8().data()), q(&w0), "first cast");
    let amax0 = w_amax();
    assert_eq!(amax0, fp8_kernels::reference::amax(w0.iter().copied()));
    let wt0 = gpu.bytes(layer.weight_t_fp8());

    gpu.overwrite(layer.weight(), &w1);
    for (flag, cast) in [(1.0f32, false), (0.0, true)] {
        let f = gpu.upload(&[flag]);
        let slot = Slot::new(at, vec![&x], vec![&y], saved.iter().collect())
            .with_pool(&pool)
            .with_skip_weight_cast(Some(&f));
        layer.cast_weights(&gpu.stream, &slot).expect("cast");
        let (data, t) = (
            gpu.bytes(layer.weight_fp8().data()),
            gpu.bytes(layer.weight_t_fp8()),
        );
        if cast {
            assert_eq!(data, q(&w1), "flag 0.0: the new W is cast");
            assert_ne!(t, wt0, "flag 0.0: W^T recast");
            assert_eq!(
                w_amax(),
                amax0.max(fp8_kernels::reference::amax(w1.iter().copied())),
                "flag 0.0: W's amax maxed"
            );
        } else {
            assert_eq!(data, q(&w0), "flag 1.0: the FP8 copy of W is untouched");
            assert_eq!(t, wt0, "flag 1.0: the FP8 copy of W^T is untouched");
            assert_eq!(w_amax(), amax0, "flag 1.0: W's amax untouched");
        }
    }
}
