//! Graphed callables, weight caching and hooks (FP8-agnostic): a layer's weight casts
//! ([`Callable::cast_weights`]) run exactly once per training step under both mechanisms
//! ([`WeightCaching::Conditional`], [`WeightCaching::NoopFlag`]), for 1 chunk x 3
//! microbatches and for the interleaved 2 x 3 order; the conditional form holds an IF node in
//! every forward graph; a cast that ignores the noop flag is detected (it casts on every
//! microbatch); the replay hooks run once per replay in order and the warmup hooks once
//! each (restoring state warmup changed); a layer that overlaps its casts
//! ([`Callable::overlaps_weight_cast`]) gets them beside its forward's head in every mode.
//!
//! The "cast" is a one-thread kernel that increments a per-layer device counter
//! (tests/kernels/graphed_kernels.cu: `gl_count_cast` honours the noop flag,
//! `gl_count_cast_ignoring_flag` does not), read back after every training step. The forward
//! is the elementwise layer of tests/graphed.rs with w = 2, b = 0.5, checked against the host
//! bit for bit so the forward still runs after the IF node.

use cuda_graph::{
    DeviceBuffer, GraphPool, Kernel, KernelNode, LaunchConfig, NodeId, NodeKind, Result, Stream,
    kernel_args,
};
use graphed_callables::{
    Callable, GraphIndex, GraphedCallables, GraphedOptions, Schedule, Slot, Step, WarmupRecord,
    WeightCaching,
};
use std::sync::{Arc, Mutex};

/// Elements per buffer: more than one block, not a multiple of it.
mod graphed_common;
use graphed_common::Gpu;

const N: usize = 200;
/// Training steps each test replays.
const STEPS: usize = 2;
/// Warmup iterations (the default).
const WARMUP: usize = 3;
const W: f32 = 2.0;
const B: f32 = 0.5;
/// 1 chunk x 3 microbatches.
const ORDER_1X3: [i64; 6] = [1, 1, 1, -1, -1, -1];
/// 2 chunks x 3 microbatches, interleaved.
const ORDER_2X3: [i64; 12] = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1];

fn input(chunk: usize, microbatch: usize) -> Vec<f32> {
    (0..N)
        .map(|i| 0.25 * ((i + 3 * microbatch + 5 * chunk) % 9) as f32 - 1.0)
        .collect()
}

fn leaky(z: f32) -> f32 {
    if z > 0.0 { z } else { z * 0.125 }
}

/// The host forward of `layers` layers (each z = x * W + B, y = leaky(z)), rounded like the
/// kernel (one rounding per operation).
fn host_forward(x: &[f32], layers: usize) -> Vec<f32> {
    let mut y = x.to_vec();
    for _ in 0..layers {
        y = y.iter().map(|&v| leaky(v * W + B)).collect();
    }
    y
}

/// How a layer's cast reads the noop flag.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum CastKind {
    /// Uses `slot.skip_weight_cast()` when the runtime gives one (a well-behaved FP8 layer).
    HonoursFlag,
    /// Always casts, whatever the flag says (the bug the NoopFlag test must detect).
    IgnoresFlag,
}

/// Callable `bad` ignores the skip flag, every other one honours it.
fn ignoring(bad: usize) -> impl Fn(usize) -> CastKind {
    move |c| {
        if c == bad {
            CastKind::IgnoresFlag
        } else {
            CastKind::HonoursFlag
        }
    }
}

/// The elementwise layer of tests/graphed.rs plus a counting "weight cast".
struct CastLayer {
    w: DeviceBuffer<f32>,
    b: DeviceBuffer<f32>,
    dw: DeviceBuffer<f32>,
    db: DeviceBuffer<f32>,
    /// Incremented on the device once per cast that was not skipped.
    counter: Arc<DeviceBuffer<u32>>,
    kind: CastKind,
    fwd: Kernel,
    bwd: Kernel,
    cast: Kernel,
    cast_ignoring: Kernel,
    /// With `Some`, the forward is [head, wait for the casts, snapshot, gl_fwd], and the
    /// layer overlaps its casts (Callable::overlaps_weight_cast) when `opt_in`.
    overlap: Option<Overlap>,
}

/// The extra forward kernels of an overlapping CastLayer: a head that needs no cast weights
/// (gl_fill of a scratch buffer) and, after `Slot::wait_weight_cast`, a snapshot of the cast
/// counter (gl_copy_u32): it equals the counter when the wait ordered it after the cast.
struct Overlap {
    /// Whether the layer says it overlaps (false: the same kernels, casts before them).
    opt_in: bool,
    head: Kernel,
    copy: Kernel,
    scratch: DeviceBuffer<f32>,
    snapshot: Arc<DeviceBuffer<u32>>,
}

impl CastLayer {
    fn new(gpu: &Gpu, kind: CastKind, counter: Arc<DeviceBuffer<u32>>) -> CastLayer {
        CastLayer {
            w: gpu.upload(&[W; N]),
            b: gpu.upload(&[B; N]),
            dw: gpu.upload(&[0.0f32; N]),
            db: gpu.upload(&[0.0f32; N]),
            counter,
            kind,
            fwd: gpu.k("gl_fwd"),
            bwd: gpu.k("gl_bwd"),
            cast: gpu.k("gl_count_cast"),
            cast_ignoring: gpu.k("gl_count_cast_ignoring_flag"),
            overlap: None,
        }
    }

    /// This layer with the head and snapshot kernels in its forward, overlapping its casts
    /// with them when `opt_in`.
    fn with_head(mut self, gpu: &Gpu, opt_in: bool, snapshot: Arc<DeviceBuffer<u32>>) -> Self {
        self.overlap = Some(Overlap {
            opt_in,
            head: gpu.k("gl_fill"),
            copy: gpu.k("gl_copy_u32"),
            scratch: gpu.upload(&[0.0f32; N]),
            snapshot,
        });
        self
    }
}

impl Callable<f32> for CastLayer {
    fn input_lens(&self) -> Vec<usize> {
        vec![N]
    }
    fn output_lens(&self) -> Vec<usize> {
        vec![N]
    }
    fn saved_bytes(&self) -> Vec<usize> {
        vec![N * size_of::<f32>()]
    }
    fn parameters(&self) -> Vec<&DeviceBuffer<f32>> {
        vec![&self.w, &self.b]
    }
    fn gradients(&self) -> Vec<&DeviceBuffer<f32>> {
        vec![&self.dw, &self.db]
    }
    fn overlaps_weight_cast(&self) -> bool {
        self.overlap.as_ref().is_some_and(|o| o.opt_in)
    }
    fn cast_weights(&mut self, stream: &Stream, slot: &Slot<'_, f32>) -> Result<()> {
        let one = LaunchConfig::linear(1, 1);
        match (self.kind, slot.skip_weight_cast()) {
            // SAFETY: one thread reads flag[0] and increments counter[0]; both have one
            // element.
            (CastKind::HonoursFlag, Some(flag)) => unsafe {
                stream.launch(&self.cast, &one, &kernel_args![*self.counter, *flag])
            },
            // SAFETY: one thread increments counter[0] of a one-element buffer.
            _ => unsafe { stream.launch(&self.cast_ignoring, &one, &kernel_args![*self.counter]) },
        }
    }
    fn forward(
        &mut self,
        stream: &Stream,
        inputs: &[&DeviceBuffer<f32>],
        outputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let n = N as u32;
        let z = slot.saved()[0].reinterpret::<f32>()?;
        if let Some(o) = &self.overlap {
            let all = LaunchConfig::for_elements(n, 128);
            // SAFETY: gl_fill writes n floats of the N-element scratch.
            unsafe { stream.launch(&o.head, &all, &kernel_args![o.scratch, 1.0f32, n]) }?;
            slot.wait_weight_cast(stream)?;
            let one = LaunchConfig::linear(1, 1);
            // SAFETY: gl_copy_u32 copies 1 word between one-element buffers.
            unsafe {
                stream.launch(
                    &o.copy,
                    &one,
                    &kernel_args![*o.snapshot, *self.counter, 1u32],
                )
            }?;
        }
        // SAFETY: gl_fwd reads n floats of x, w, b and writes n floats of z and y; all are
        // N-element buffers.
        unsafe {
            stream.launch(
                &self.fwd,
                &LaunchConfig::for_elements(n, 128),
                &kernel_args![*inputs[0], self.w, self.b, z, *outputs[0], n],
            )
        }
    }
    fn backward(
        &mut self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<f32>],
        grad_inputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let n = N as u32;
        let (x, z) = (slot.inputs()[0], slot.saved()[0].reinterpret::<f32>()?);
        // SAFETY: gl_bwd touches n floats of each N-element buffer.
        unsafe {
            stream.launch(
                &self.bwd,
                &LaunchConfig::for_elements(n, 128),
                &kernel_args![
                    *grad_outputs[0],
                    *x,
                    self.w,
                    z,
                    *grad_inputs[0],
                    self.dw,
                    self.db,
                    n
                ],
            )
        }
    }
}

/// One cast counter per callable, shared with it.
type Counters = Vec<Arc<DeviceBuffer<u32>>>;

/// Makes one counter (starting at `start`) and one layer per callable of `schedule`.
fn layers(
    gpu: &Gpu,
    schedule: &Schedule,
    kind_of: impl Fn(usize) -> CastKind,
    start: u32,
) -> (Vec<Box<dyn Callable<f32>>>, Counters) {
    let n = schedule.layout().total_callables();
    let counters: Vec<Arc<DeviceBuffer<u32>>> =
        (0..n).map(|_| Arc::new(gpu.upload(&[start]))).collect();
    let callables = (0..n)
        .map(|c| {
            Box::new(CastLayer::new(gpu, kind_of(c), counters[c].clone())) as Box<dyn Callable<f32>>
        })
        .collect();
    (callables, counters)
}

fn build(
    gpu: &Gpu,
    options: GraphedOptions,
    callables: Vec<Box<dyn Callable<f32>>>,
) -> GraphedCallables<f32> {
    let layout = options.schedule.layout().clone();
    let sample = gpu.upload(&input(7, 7));
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
        .expect("build graphed callables");
    gpu.stream.synchronize().expect("sync after build");
    graphed
}

fn read_counters(gpu: &Gpu, counters: &[Arc<DeviceBuffer<u32>>]) -> Vec<u32> {
    counters.iter().map(|c| gpu.read(c)[0]).collect()
}

/// Replays one training step (every schedule step, fresh inputs, zero output gradients),
/// checks every forward output against the host, waits.
fn replay_step(gpu: &Gpu, graphed: &GraphedCallables<f32>, dy: &DeviceBuffer<f32>) {
    let layout = graphed.schedule().layout().clone();
    for &step in graphed.schedule().steps() {
        let (m, b) = (step.chunk(), step.microbatch());
        match step {
            Step::Forward { .. } => {
                let x = gpu.upload(&input(m, b));
                let y = graphed
                    .forward(m, b, &[&x], &gpu.stream)
                    .unwrap_or_else(|e| panic!("forward of chunk {m} microbatch {b}: {e}"));
                let got = gpu.read(&y[0]);
                let want = host_forward(&input(m, b), layout.layers(m).unwrap());
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(g, w)| g.to_bits() == w.to_bits()),
                    "forward output of chunk {m} microbatch {b} differs from the host: \
                     got {:?}.., want {:?}..",
                    &got[..4],
                    &want[..4]
                );
            }
            _ => {
                graphed
                    .backward(m, b, &[dy], &gpu.stream)
                    .unwrap_or_else(|e| panic!("backward of chunk {m} microbatch {b}: {e}"));
            }
        }
    }
    gpu.stream.synchronize().expect("sync after the step");
}

/// Builds with `mode`, checks warmup cast on every microbatch, replays `STEPS` training
/// steps; returns each step's per-callable cast count and the graphed callables.
fn cast_counts(
    gpu: &Gpu,
    (mode, merge): (WeightCaching, bool),
    order: &[i64],
    layers_per_chunk: Vec<usize>,
    kind_of: impl Fn(usize) -> CastKind,
) -> (Vec<Vec<u32>>, GraphedCallables<f32>) {
    let options = GraphedOptions::from_order(order, layers_per_chunk)
        .expect("valid order")
        .with_weight_caching(mode)
        .with_merge_layers(merge);
    assert_eq!(options.warmup_iters, WARMUP);
    let schedule = options.schedule.clone();
    let (callables, counters) = layers(gpu, &schedule, kind_of, 0);
    let graphed = build(gpu, options, callables);
    assert_eq!(graphed.weight_caching(), mode);
    // Warmup casts eagerly before every forward (first-microbatch semantics), whatever the
    // flag handling: warmup_iters x microbatches per callable.
    let warm = (WARMUP * schedule.num_microbatches()) as u32;
    assert_eq!(
        read_counters(gpu, &counters),
        vec![warm; counters.len()],
        "{mode:?}: warmup must cast before every forward ({WARMUP} iterations x {} \
         microbatches)",
        schedule.num_microbatches()
    );
    for g in 0..schedule.layout().total_graphs() {
        assert_eq!(
            graphed.casts_weights(g),
            Some(true),
            "graph {g} casts (probe at build)"
        );
    }
    let dy = gpu.upload(&[0.0f32; N]);
    let mut before = read_counters(gpu, &counters);
    let mut per_step = Vec::new();
    for _ in 0..STEPS {
        replay_step(gpu, &graphed, &dy);
        let now = read_counters(gpu, &counters);
        per_step.push(now.iter().zip(&before).map(|(a, b)| a - b).collect());
        before = now;
    }
    (per_step, graphed)
}

/// The callables whose cast count in some step is not exactly 1: those that recast on later
/// microbatches (ignored the skip flag) or never cast.
fn not_once_per_step(per_step: &[Vec<u32>]) -> Vec<usize> {
    let n = per_step.first().map_or(0, Vec::len);
    (0..n)
        .filter(|&c| per_step.iter().any(|s| s[c] != 1))
        .collect()
}

/// How many nodes of each graph are conditional nodes.
fn conditional_nodes(graph: &cuda_graph::Graph) -> usize {
    graph
        .nodes()
        .expect("graph nodes")
        .iter()
        .filter(|n| n.kind == NodeKind::Conditional)
        .count()
}

/// Every forward graph holds exactly one conditional node (the IF around the casts of every
/// layer in it: one, or the whole chunk when layers are merged) in Conditional mode and none
/// in NoopFlag mode; backward graphs hold none. Merged, a layer's forward graph is its
/// chunk's.
fn check_structure(graphed: &GraphedCallables<f32>, mode: WeightCaching) {
    let layout = graphed.schedule().layout();
    let want = match mode {
        WeightCaching::Conditional => 1,
        WeightCaching::NoopFlag | WeightCaching::Static => 0,
    };
    for g in 0..layout.total_graphs() {
        let at = layout.locate(g).unwrap();
        let first = layout.index(at.chunk, at.microbatch, 0).unwrap();
        assert_eq!(
            std::ptr::eq(
                graphed.forward_graph(g).unwrap(),
                graphed.forward_graph(first).unwrap()
            ),
            graphed.merges_layers() || at.layer == 0,
            "graph {g}: merged layers share their step's graph"
        );
        let f = graphed.forward_graph(g).expect("forward graph kept");
        assert_eq!(
            conditional_nodes(f),
            want,
            "{mode:?}: conditional nodes of forward graph {g}"
        );
        let b = graphed.backward_graph(g).expect("backward graph kept");
        assert_eq!(conditional_nodes(b), 0, "backward graph {g}");
    }
}

// ---- Conditional mechanism ----

#[test]
#[ignore = "needs a CUDA device"]
fn conditional_casts_once_per_step_1x3() {
    let gpu = Gpu::new();
    let (per_step, graphed) = cast_counts(
        &gpu,
        (WeightCaching::Conditional, true),
        &ORDER_1X3,
        vec![2],
        |_| CastKind::HonoursFlag,
    );
    assert_eq!(
        per_step,
        vec![vec![1, 1]; STEPS],
        "casts per step per layer"
    );
    check_structure(&graphed, WeightCaching::Conditional);
}

#[test]
#[ignore = "needs a CUDA device"]
fn conditional_casts_once_per_step_interleaved_2x3_even_when_the_cast_ignores_flags() {
    let gpu = Gpu::new();
    // Chunk 0 has 2 layers, chunk 1 one; callable 1 ignores flags, which does not matter
    // here: the IF node launches no cast on later microbatches. One graph per layer here
    // (the 1x3 test above merges layers).
    let (per_step, graphed) = cast_counts(
        &gpu,
        (WeightCaching::Conditional, false),
        &ORDER_2X3,
        vec![2, 1],
        ignoring(1),
    );
    assert_eq!(
        per_step,
        vec![vec![1, 1, 1]; STEPS],
        "casts per step per layer"
    );
    assert!(not_once_per_step(&per_step).is_empty());
    check_structure(&graphed, WeightCaching::Conditional);
}

// ---- NoopFlag mechanism ----

#[test]
#[ignore = "needs a CUDA device"]
fn noop_flag_casts_once_per_step_1x3_and_detects_a_cast_ignoring_the_flag() {
    let gpu = Gpu::new();
    // Layer 1 of 2 ignores the skip flag.
    let (per_step, graphed) = cast_counts(
        &gpu,
        (WeightCaching::NoopFlag, true),
        &ORDER_1X3,
        vec![2],
        ignoring(1),
    );
    // The honouring layer casts once per step; the ignoring one on all 3 microbatches.
    assert_eq!(
        per_step,
        vec![vec![1, 3]; STEPS],
        "casts per step per layer"
    );
    assert_eq!(
        not_once_per_step(&per_step),
        vec![1],
        "exactly the flag-ignoring layer is detected"
    );
    check_structure(&graphed, WeightCaching::NoopFlag);
}

// ---- Static mechanism ----

/// Static: the first microbatch's forward graphs hold the casts, the others none, so even
/// a cast that ignores every flag runs once per step; no IF node; a later microbatch's
/// forward graph has fewer kernels than the first's (the casts are simply not there).
#[test]
#[ignore = "needs a CUDA device"]
fn static_casts_once_per_step_interleaved_2x3() {
    let gpu = Gpu::new();
    for merge in [true, false] {
        let (per_step, graphed) = cast_counts(
            &gpu,
            (WeightCaching::Static, merge),
            &ORDER_2X3,
            vec![2, 1],
            ignoring(1),
        );
        assert_eq!(
            per_step,
            vec![vec![1, 1, 1]; STEPS],
            "merge {merge}: casts per step per layer"
        );
        check_structure(&graphed, WeightCaching::Static);
        let layout = graphed.schedule().layout().clone();
        let kernels = |g: usize| {
            graphed
                .forward_graph(g)
                .expect("forward graph")
                .nodes()
                .expect("nodes")
                .iter()
                .filter(|n| n.kind == NodeKind::Kernel)
                .count()
        };
        for chunk in 0..layout.num_chunks() {
            let first = layout.index(chunk, 0, 0).unwrap();
            let later = layout.index(chunk, 1, 0).unwrap();
            assert!(
                kernels(first) > kernels(later),
                "merge {merge}: chunk {chunk}: microbatch 0's forward graph holds the casts"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn noop_flag_casts_once_per_step_interleaved_2x3() {
    let gpu = Gpu::new();
    let (per_step, graphed) = cast_counts(
        &gpu,
        (WeightCaching::NoopFlag, false),
        &ORDER_2X3,
        vec![2, 1],
        |_| CastKind::HonoursFlag,
    );
    assert_eq!(
        per_step,
        vec![vec![1, 1, 1]; STEPS],
        "casts per step per layer"
    );
    check_structure(&graphed, WeightCaching::NoopFlag);

    // The same order with chunk 1's only layer ignoring the flag: detected, 3 per step.
    let (per_step, _) = cast_counts(
        &gpu,
        (WeightCaching::NoopFlag, true),
        &ORDER_2X3,
        vec![2, 1],
        ignoring(2),
    );
    assert_eq!(per_step, vec![vec![1, 1, 3]; STEPS]);
    assert_eq!(not_once_per_step(&per_step), vec![2]);
}

// ---- Casts beside the forward (Callable::overlaps_weight_cast) ----

/// Whether `to` is reachable from `from` along `graph`'s edges.
fn reaches(graph: &cuda_graph::Graph, from: NodeId, to: NodeId) -> bool {
    let mut seen = vec![from];
    let mut todo = vec![from];
    while let Some(n) = todo.pop() {
        for (d, _) in graph.dependents(n).expect("dependents") {
            if d == to {
                return true;
            }
            if !seen.contains(&d) {
                seen.push(d);
                todo.push(d);
            }
        }
    }
    false
}

/// The node of `graph` launching one of `kernels` (exactly one such node).
fn kernel_node(graph: &cuda_graph::Graph, kernels: &[&Kernel]) -> NodeId {
    let found: Vec<NodeId> = graph
        .nodes()
        .expect("nodes")
        .into_iter()
        .filter_map(|n| KernelNode::try_from(n).ok())
        .filter(|k| {
            let f = graph.kernel_function(k).expect("kernel params");
            kernels.iter().any(|kernel| kernel.as_raw() == f)
        })
        .map(|k| k.id())
        .collect();
    let names: Vec<&str> = kernels.iter().map(|k| k.name()).collect();
    assert_eq!(found.len(), 1, "one node launching one of {names:?}");
    found[0]
}

/// A layer that overlaps its casts gets them captured on a fork beside its forward's head
/// in every caching mode: in the first microbatch's forward graph neither the casts (the
/// cast kernel, or the IF node holding it) nor the head reaches the other, and both reach
/// the snapshot taken after `Slot::wait_weight_cast`; on the device that snapshot equals
/// the cast counter after every forward (the wait ordered it after this step's cast), casts
/// still run once per step and the outputs are exact. The same layer without the opt-in has
/// its head after the casts, so the structural check can fail.
#[test]
#[ignore = "needs a CUDA device"]
fn overlapped_casts_run_beside_the_forward_head_in_every_mode() {
    let gpu = Gpu::new();
    // The cast kernel honours the flag where there is one (NoopFlag) and casts
    // unconditionally otherwise.
    let casts = [gpu.k("gl_count_cast"), gpu.k("gl_count_cast_ignoring_flag")];
    let (head_k, copy_k) = (gpu.k("gl_fill"), gpu.k("gl_copy_u32"));
    let modes = [
        WeightCaching::Static,
        WeightCaching::NoopFlag,
        WeightCaching::Conditional,
    ];
    for mode in modes {
        for overlap in [true, false] {
            let what = format!("{mode:?}, overlap {overlap}");
            let options = GraphedOptions::from_order(&ORDER_1X3, vec![1])
                .expect("valid order")
                .with_weight_caching(mode);
            let counter = Arc::new(gpu.upload(&[0u32]));
            let snapshot = Arc::new(gpu.upload(&[u32::MAX]));
            let layer = CastLayer::new(&gpu, CastKind::HonoursFlag, counter.clone());
            let layer = layer.with_head(&gpu, overlap, snapshot.clone());
            let graphed = build(&gpu, options, vec![Box::new(layer)]);

            let first = graphed.schedule().layout().index(0, 0, 0).unwrap();
            let g = graphed.forward_graph(first).expect("forward graph kept");
            let cast = match mode {
                WeightCaching::Conditional => {
                    let ifs: Vec<NodeId> = g
                        .nodes()
                        .unwrap()
                        .into_iter()
                        .filter(|n| n.kind == NodeKind::Conditional)
                        .map(|n| n.id)
                        .collect();
                    assert_eq!(ifs.len(), 1, "{what}: one IF node");
                    ifs[0]
                }
                _ => kernel_node(g, &[&casts[0], &casts[1]]),
            };
            let (head, snap) = (kernel_node(g, &[&head_k]), kernel_node(g, &[&copy_k]));
            assert_eq!(
                reaches(g, cast, head),
                !overlap,
                "{what}: head after the casts"
            );
            assert!(!reaches(g, head, cast), "{what}: casts after the head");
            assert!(reaches(g, cast, snap), "{what}: snapshot after the casts");
            assert!(reaches(g, head, snap), "{what}: snapshot after the head");

            let dy = gpu.upload(&[0.0f32; N]);
            let start = gpu.read(&counter)[0];
            for step in 0..STEPS {
                for &s in graphed.schedule().steps() {
                    let (m, b) = (s.chunk(), s.microbatch());
                    if let Step::Forward { .. } = s {
                        let x = gpu.upload(&input(m, b));
                        let y = graphed.forward(m, b, &[&x], &gpu.stream).expect("forward");
                        let (got, want) = (gpu.read(&y[0]), host_forward(&input(m, b), 1));
                        assert!(
                            got.iter()
                                .zip(&want)
                                .all(|(g, w)| g.to_bits() == w.to_bits()),
                            "{what}: forward output of microbatch {b}"
                        );
                        let (snap, now) = (gpu.read(&snapshot)[0], gpu.read(&counter)[0]);
                        assert_eq!(snap, now, "{what}: step {step} microbatch {b} snapshot");
                        assert_eq!(now - start, step as u32 + 1, "{what}: casts once per step");
                    } else {
                        graphed
                            .backward(m, b, &[&dy], &gpu.stream)
                            .expect("backward");
                    }
                }
            }
        }
    }
}

/// The kernels' flag semantics, eagerly with Slot::new(..).with_skip_weight_cast: the
/// honouring cast skips on 1.0 and casts on 0.0; the ignoring one always casts.
#[test]
#[ignore = "needs a CUDA device"]
fn eager_casts_follow_the_slot_flag() {
    let gpu = Gpu::new();
    let pool = GraphPool::new(&gpu.ctx, 4096).expect("pool");
    let skip = gpu.upload(&[1.0f32]);
    let cast = gpu.upload(&[0.0f32]);
    let x = gpu.upload(&[0.0f32; N]);
    let at = GraphIndex {
        chunk: 0,
        microbatch: 0,
        layer: 0,
    };
    for (kind, want) in [(CastKind::HonoursFlag, 1u32), (CastKind::IgnoresFlag, 2)] {
        let counter = Arc::new(gpu.upload(&[0u32]));
        let mut layer = CastLayer::new(&gpu, kind, counter.clone());
        for flag in [&skip, &cast] {
            let slot = Slot::new(at, vec![&x], vec![&x], vec![])
                .with_pool(&pool)
                .with_skip_weight_cast(Some(flag));
            assert!(slot.skip_weight_cast().is_some());
            layer.cast_weights(&gpu.stream, &slot).expect("eager cast");
        }
        assert_eq!(
            gpu.read(&counter)[0],
            want,
            "{kind:?}: casts for flags 1.0, 0.0"
        );
    }
    assert!(
        Slot::new(at, vec![&x], vec![&x], vec![])
            .with_pool(&pool)
            .skip_weight_cast()
            .is_none()
    );
}

// ---- hooks ----

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    BeforeWarmup,
    AfterWarmup,
    Forward(Step),
    Backward(Step),
}

#[test]
#[ignore = "needs a CUDA device"]
fn hooks_run_once_per_replay_in_order_and_warmup_state_is_restored() {
    let gpu = Gpu::new();
    let mode = WeightCaching::detect();
    let mut options = GraphedOptions::from_order(&ORDER_2X3, vec![2, 1])
        .expect("valid order")
        .with_weight_caching(mode);
    let schedule = options.schedule.clone();
    // Counters start at 7; warmup would add 9 to each, the hooks restore 7.
    let (callables, counters) = layers(&gpu, &schedule, |_| CastKind::HonoursFlag, 7);
    let snapshots: Vec<Arc<DeviceBuffer<u32>>> = counters
        .iter()
        .map(|_| Arc::new(gpu.upload(&[0u32])))
        .collect();
    let log: Arc<Mutex<Vec<Event>>> = Arc::default();
    let copy = gpu.k("gl_copy_u32");
    let bump = gpu.k("gl_count_cast_ignoring_flag");
    // Device-side evidence that the replay hooks enqueue on the replay stream.
    let fwd_hook_count = Arc::new(gpu.upload(&[0u32]));
    let bwd_hook_count = Arc::new(gpu.upload(&[0u32]));

    let copy_all = {
        let copy = copy.clone();
        move |stream: &Stream, to: &[Arc<DeviceBuffer<u32>>], from: &[Arc<DeviceBuffer<u32>>]| {
            for (d, s) in to.iter().zip(from) {
                // SAFETY: one thread copies 1 word between one-element buffers.
                unsafe {
                    stream.launch(
                        &copy,
                        &LaunchConfig::linear(1, 1),
                        &kernel_args![**d, **s, 1u32],
                    )?
                }
            }
            Ok(())
        }
    };
    {
        let (log, copy_all, snaps, ctrs) = (
            log.clone(),
            copy_all.clone(),
            snapshots.clone(),
            counters.clone(),
        );
        options.before_warmup = Some(Box::new(move |s: &Stream| {
            log.lock().unwrap().push(Event::BeforeWarmup);
            copy_all(s, &snaps, &ctrs)
        }));
    }
    {
        let (log, copy_all, snaps, ctrs) = (
            log.clone(),
            copy_all.clone(),
            snapshots.clone(),
            counters.clone(),
        );
        options.after_warmup = Some(Box::new(move |s: &Stream, _record: &WarmupRecord| {
            log.lock().unwrap().push(Event::AfterWarmup);
            copy_all(s, &ctrs, &snaps)
        }));
    }
    {
        let (log, bump, count) = (log.clone(), bump.clone(), fwd_hook_count.clone());
        options.after_forward = Some(Box::new(move |s: &Stream, step: Step| {
            log.lock().unwrap().push(Event::Forward(step));
            // SAFETY: one thread increments count[0] of a one-element buffer.
            unsafe { s.launch(&bump, &LaunchConfig::linear(1, 1), &kernel_args![*count]) }
        }));
    }
    {
        let (log, bump, count) = (log.clone(), bump.clone(), bwd_hook_count.clone());
        options.after_backward = Some(Box::new(move |s: &Stream, step: Step| {
            log.lock().unwrap().push(Event::Backward(step));
            // SAFETY: one thread increments count[0] of a one-element buffer.
            unsafe { s.launch(&bump, &LaunchConfig::linear(1, 1), &kernel_args![*count]) }
        }));
    }

    let graphed = build(&gpu, options, callables);
    assert_eq!(
        *log.lock().unwrap(),
        vec![Event::BeforeWarmup, Event::AfterWarmup],
        "the warmup hooks run once each, before and after warmup; no replay hook at build"
    );
    assert_eq!(
        read_counters(&gpu, &snapshots),
        vec![7; counters.len()],
        "before_warmup saw the counters before any warmup cast"
    );
    assert_eq!(
        read_counters(&gpu, &counters),
        vec![7; counters.len()],
        "after_warmup restored the state warmup changed"
    );

    let dy = gpu.upload(&[0.0f32; N]);
    let mut before = read_counters(&gpu, &counters);
    for step in 0..STEPS {
        replay_step(&gpu, &graphed, &dy);
        let now = read_counters(&gpu, &counters);
        let delta: Vec<u32> = now.iter().zip(&before).map(|(a, b)| a - b).collect();
        assert_eq!(
            delta,
            vec![1; counters.len()],
            "{mode:?}: casts in step {step}"
        );
        before = now;
    }

    let mut want = vec![Event::BeforeWarmup, Event::AfterWarmup];
    for _ in 0..STEPS {
        for &s in schedule.steps() {
            want.push(match s {
                Step::Forward { .. } => Event::Forward(s),
                _ => Event::Backward(s),
            });
        }
    }
    assert_eq!(
        *log.lock().unwrap(),
        want,
        "one hook call per replay, in replay order"
    );
    let replays = (STEPS * schedule.num_chunks() * schedule.num_microbatches()) as u32;
    assert_eq!(
        gpu.read(&fwd_hook_count)[0],
        replays,
        "after_forward launches"
    );
    assert_eq!(
        gpu.read(&bwd_hook_count)[0],
        replays,
        "after_backward launches"
    );
}

// ---- CPU: options ----

#[test]
fn options_default_to_static_weight_caching_and_no_hooks() {
    let o = GraphedOptions::from_order(&ORDER_2X3, vec![2, 1]).unwrap();
    assert_eq!(o.weight_caching, WeightCaching::Static);
    assert!(o.after_forward.is_none() && o.after_backward.is_none());
    assert!(o.before_warmup.is_none() && o.after_warmup.is_none());
    assert_eq!(o.warmup_iters, WARMUP);
    let o = o.with_weight_caching(WeightCaching::NoopFlag);
    assert_eq!(o.weight_caching, WeightCaching::NoopFlag);
    fn assert_send<T: Send>() {}
    assert_send::<GraphedOptions>();
    assert_send::<GraphedCallables<f32>>();
    let dbg = format!("{o:?}");
    assert!(dbg.contains("weight_caching: NoopFlag"), "{dbg}");
    assert!(dbg.contains("after_forward: \"None\""), "{dbg}");
}

#[test]
fn mode_selection_follows_the_conditional_if_gate() {
    use cuda_graph::driver::DriverVersion;
    for (v, want) in [
        (12000, WeightCaching::NoopFlag),
        (12030, WeightCaching::NoopFlag),
        (12040, WeightCaching::Conditional),
        (12080, WeightCaching::Conditional),
        (13000, WeightCaching::Conditional),
    ] {
        assert_eq!(
            WeightCaching::for_driver(DriverVersion(v)),
            want,
            "driver {v}"
        );
    }
    assert!(WeightCaching::NoopFlag.check().is_ok());
}
