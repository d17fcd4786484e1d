//! The FP8 MoE layer ([`Fp8Moe`], forward only) eagerly and under graphed callables, with
//! token distributions that change every microbatch and every step (fresh x each time,
//! including distributions where some experts get no token and one gets them all):
//!
//! * routing: every forward's expert, position and counts equal the host model
//!   ([`plan_routing`]) of the logits it produced (token order kept within each expert);
//! * eager per-expert (dense GEMMs on host-read counts) against the host reference from the
//!   FP8 bytes the layer used (f64 sums), to the tensor-core bound 2e-3;
//! * breaking-layer (router + dispatch graphed, experts eager, combine graphed) equals the
//!   eager per-expert run bit for bit, routing included;
//! * full-layer (one graph, grouped GEMM with device counts) equals an eager run of the
//!   same grouped layer bit for bit, and the per-expert run to 2e-3;
//! * the trivial backward writes zeros to the input gradient (poisoned first).
//!
//! Sizes: T = 128 tokens, H = 128, F = 64, E = 4; 1 chunk x 3 microbatches, 2 steps.

use std::sync::Arc;

use cuda_graph::{Context, DeviceBuffer, GraphPool, Stream};
use fp8_kernels::Fp8Format;
use fp8_kernels::reference::decode;
use fp8_moe::moe::{ExpertGemm, Fp8Moe, MoeConfig, Routing, RoutingHandle, plan_routing};
use graphed_callables::{
    Callable, GraphIndex, GraphedCallables, GraphedOptions, Schedule, SegmentKind, Slot, Step,
};

const T: usize = 128;
const H: usize = 128;
const F: usize = 64;
const E: usize = 4;
const MICROBATCHES: usize = 3;
const STEPS: usize = 2;
const ORDER: [i64; 6] = [1, 1, 1, -1, -1, -1];
/// Relative error bound of the FP8 tensor-core GEMM paths (as fp8-kernels' GEMM tests).
const TENSOR_CORE_BOUND: f64 = 2e-3;

fn cfg() -> MoeConfig {
    MoeConfig {
        tokens: T,
        hidden: H,
        ffn: F,
        experts: E,
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

/// Router weights `[E, H]`: feature `h < E` is expert `h`'s own (weight 8 on the diagonal,
/// 0 elsewhere), the other features small noise. An input that sets feature `k` to 4 and
/// the other first `E` features to 0 sends the token to expert `k` (a margin of 32 over
/// noise of at most 0.0625 * (H - E)).
fn router_weights() -> Vec<f32> {
    let mut w = vec![0f32; E * H];
    for e in 0..E {
        for h in 0..H {
            w[e * H + h] = if h < E {
                if h == e { 8.0 } else { 0.0 }
            } else {
                value(11 + e as u64, h, 0.0625)
            };
        }
    }
    w
}

/// Expert weights `[E, F, H]`.
fn expert_weights() -> Vec<f32> {
    (0..E * F * H).map(|i| value(77, i, 0.0625)).collect()
}

/// How a microbatch's tokens are routed.
#[derive(Debug, Clone, Copy)]
enum Pattern {
    /// Random routing features: a spread over the experts.
    Random,
    /// Every token to expert `k` (the others get none).
    AllTo(usize),
    /// Even tokens to `a`, odd tokens to `b` (the others get none).
    Pair(usize, usize),
}

/// The pattern of (step, microbatch): every step differs, every microbatch differs.
fn pattern(step: usize, mb: usize) -> Pattern {
    match (step, mb) {
        (0, 0) => Pattern::Random,
        (0, 1) => Pattern::AllTo(2),
        (0, 2) => Pattern::Pair(0, 3),
        (1, 0) => Pattern::AllTo(0),
        (1, 1) => Pattern::Random,
        _ => Pattern::AllTo(E - 1),
    }
}

/// The tokens `[T, H]` of (step, microbatch).
fn input(step: usize, mb: usize) -> Vec<f32> {
    let seed = 3000 + 100 * step as u64 + mb as u64;
    let p = pattern(step, mb);
    let mut x = vec![0f32; T * H];
    for t in 0..T {
        for h in 0..H {
            x[t * H + h] = if h >= E {
                value(seed, t * H + h, 1.0)
            } else {
                match p {
                    Pattern::Random => value(seed + 7, t * H + h, 1.0),
                    Pattern::AllTo(k) => {
                        if h == k {
                            4.0
                        } else {
                            0.0
                        }
                    }
                    Pattern::Pair(a, b) => {
                        if h == (if t % 2 == 0 { a } else { b }) {
                            4.0
                        } else {
                            0.0
                        }
                    }
                }
            };
        }
    }
    x
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
    fn read(&self, b: &DeviceBuffer<f32>) -> Vec<f32> {
        self.stream.synchronize().expect("sync before read back");
        b.to_vec(&self.stream).expect("read back")
    }
    /// Overwrites `buf` (owned elsewhere, e.g. by the runtime) with `v`.
    fn overwrite(&self, buf: &DeviceBuffer<f32>, v: &[f32]) {
        buf.copy_from_host(&self.stream, v).expect("overwrite");
    }
}

fn new_layer(gpu: &Gpu, mode: ExpertGemm) -> Fp8Moe {
    Fp8Moe::new(
        &gpu.stream,
        cfg(),
        &router_weights(),
        &expert_weights(),
        mode,
    )
    .expect("Fp8Moe::new")
}

/// One forward's results.
struct Fwd {
    label: String,
    y: Vec<f32>,
    routing: Routing,
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Checks the routing of (step, mb) against the host model of its own logits and the
/// pattern's intended distribution.
fn check_routing(label: &str, step: usize, mb: usize, r: &Routing) {
    assert!(
        r.logits.iter().all(|l| l.is_finite()),
        "{label}: non-finite logits"
    );
    let (expert, position, counts) = plan_routing(&r.logits, E);
    assert_eq!(r.expert, expert, "{label}: expert per token");
    assert_eq!(r.position, position, "{label}: position within the expert");
    assert_eq!(r.counts, counts, "{label}: tokens per expert");
    assert_eq!(
        r.counts.iter().sum::<i32>(),
        T as i32,
        "{label}: counts sum"
    );
    for (t, &g) in r.gate.iter().enumerate() {
        let row = &r.logits[t * E..(t + 1) * E];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let want = 1.0 / row.iter().map(|&l| f64::from(l - m).exp()).sum::<f64>();
        assert!(
            (f64::from(g) - want).abs() <= 1e-5,
            "{label}: gate of token {t} is {g}, softmax gives {want}"
        );
    }
    let want_counts: Option<Vec<i32>> = match pattern(step, mb) {
        Pattern::Random => None,
        Pattern::AllTo(k) => Some((0..E).map(|e| if e == k { T as i32 } else { 0 }).collect()),
        Pattern::Pair(a, b) => Some(
            (0..E)
                .map(|e| if e == a || e == b { (T / 2) as i32 } else { 0 })
                .collect(),
        ),
    };
    match want_counts {
        Some(w) => assert_eq!(r.counts, w, "{label}: counts of {:?}", pattern(step, mb)),
        None => assert!(
            r.counts.iter().filter(|&&c| c > 0).count() >= 2,
            "{label}: a random pattern should spread over experts: {:?}",
            r.counts
        ),
    }
}

/// max |got - want| / max |want|.
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut err, mut mag) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        err = err.max((f64::from(g) - w).abs());
        mag = mag.max(w.abs());
    }
    if mag == 0.0 { err } else { err / mag }
}

/// The host reference of `y` from the FP8 bytes and inverse scales the layer used and its
/// routing: `y[t, f] = gate[t] * sx * sw * sum_h x8[t, h] * w8[e, f, h]` in f64.
fn host_reference(gpu: &Gpu, layer: &Fp8Moe, r: &Routing) -> Vec<f64> {
    let x8 = layer.input_fp8().data().to_vec(&gpu.stream).expect("x fp8");
    let sx = f64::from(layer.input_fp8().scale_inv().read(&gpu.stream).expect("sx"));
    let w8 = layer
        .expert_weights_fp8()
        .data()
        .to_vec(&gpu.stream)
        .expect("w fp8");
    let sw = f64::from(
        layer
            .expert_weights_fp8()
            .scale_inv()
            .read(&gpu.stream)
            .expect("sw"),
    );
    let dx: Vec<f64> = x8
        .iter()
        .map(|&b| f64::from(decode(b, Fp8Format::E4M3)))
        .collect();
    let dw: Vec<f64> = w8
        .iter()
        .map(|&b| f64::from(decode(b, Fp8Format::E4M3)))
        .collect();
    let mut y = vec![0f64; T * F];
    for t in 0..T {
        let e = r.expert[t] as usize;
        for f in 0..F {
            let w = &dw[(e * F + f) * H..(e * F + f + 1) * H];
            let s: f64 = dx[t * H..(t + 1) * H]
                .iter()
                .zip(w)
                .map(|(a, b)| a * b)
                .sum();
            y[t * F + f] = f64::from(r.gate[t]) * (s * sx * sw);
        }
    }
    y
}

fn label(step: usize, mb: usize) -> String {
    format!("step {step} microbatch {mb} ({:?})", pattern(step, mb))
}

/// The eager run: every microbatch's forward through `Callable::forward` (and the trivial
/// backward), checking routing, the host reference and the zero input gradient.
fn run_eager(gpu: &Gpu, mode: ExpertGemm) -> Vec<Fwd> {
    let mut layer = new_layer(gpu, mode);
    let pool = GraphPool::new(&gpu.ctx, 256).expect("pool");
    let y = gpu.upload(&vec![f32::NAN; T * F]);
    let dy = gpu.upload(&vec![0f32; T * F]);
    let dx = gpu.upload(&vec![f32::NAN; T * H]);
    let mut out = Vec::new();
    for step in 0..STEPS {
        for mb in 0..MICROBATCHES {
            let l = format!("eager {mode:?} {}", label(step, mb));
            let x = gpu.upload(&input(step, mb));
            gpu.overwrite(&y, &vec![f32::NAN; T * F]);
            let at = GraphIndex {
                chunk: 0,
                microbatch: mb,
                layer: 0,
            };
            let slot = Slot::new(at, vec![&x], vec![&y], vec![]).with_pool(&pool);
            layer
                .forward(&gpu.stream, &[&x], &[&y], &slot)
                .unwrap_or_else(|e| panic!("{l}: forward: {e}"));
            let yv = gpu.read(&y);
            let routing = layer.routing(&gpu.stream).expect("routing");
            check_routing(&l, step, mb, &routing);
            let want = host_reference(gpu, &layer, &routing);
            let err = rel_err(&yv, &want);
            assert!(
                err <= TENSOR_CORE_BOUND,
                "{l}: y off the host reference by {err:e} (bound {TENSOR_CORE_BOUND:e})"
            );
            gpu.overwrite(&dx, &vec![f32::NAN; T * H]);
            layer
                .backward(&gpu.stream, &[&dy], &[&dx], &slot)
                .unwrap_or_else(|e| panic!("{l}: backward: {e}"));
            assert!(
                gpu.read(&dx).iter().all(|&v| v.to_bits() == 0),
                "{l}: the trivial backward must write +0.0 everywhere"
            );
            out.push(Fwd {
                label: l,
                y: yv,
                routing,
            });
        }
    }
    out
}

/// The graphed run: 1 chunk x 3 microbatches, forwards replayed with fresh inputs, routing
/// read through the layer's [`RoutingHandle`].
fn run_graphed(gpu: &Gpu, mode: ExpertGemm) -> Vec<Fwd> {
    let layer = new_layer(gpu, mode);
    let handle: RoutingHandle = layer.routing_handle();
    let want_segments = match mode {
        ExpertGemm::PerExpert => vec![
            SegmentKind::Graphed,
            SegmentKind::Eager,
            SegmentKind::Graphed,
        ],
        ExpertGemm::Grouped => vec![SegmentKind::Graphed],
    };
    assert_eq!(
        layer.forward_segments(),
        want_segments,
        "{mode:?}: segments"
    );
    let schedule = Schedule::new(&ORDER, vec![1]).expect("schedule");
    let options = GraphedOptions::new(schedule.clone());
    let sample = gpu.upload(&input(99, 0));
    let samples: Vec<Vec<&DeviceBuffer<f32>>> = vec![vec![&sample]]; // one callable
    let graphed = GraphedCallables::build(
        &gpu.stream,
        vec![Box::new(layer) as Box<dyn Callable<f32>>],
        &samples,
        options,
    )
    .unwrap_or_else(|e| panic!("{mode:?}: build: {e}"));
    gpu.stream.synchronize().expect("sync after build");
    for g in 0..MICROBATCHES {
        let plan = graphed.forward_plan(g).expect("forward plan");
        assert_eq!(
            plan.kinds(),
            want_segments.as_slice(),
            "{mode:?}: plan of graph {g}"
        );
        match mode {
            ExpertGemm::PerExpert => {
                assert!(graphed.forward_segment_exec(g, 0).is_some(), "router graph");
                assert!(
                    graphed.forward_segment_exec(g, 1).is_none(),
                    "experts eager"
                );
                assert!(
                    graphed.forward_segment_exec(g, 2).is_some(),
                    "combine graph"
                );
            }
            ExpertGemm::Grouped => {
                assert!(plan.is_single_graph(), "full-layer: one graph");
                assert!(graphed.forward_exec(g).is_some(), "full-layer exec");
            }
        }
    }
    let dy = gpu.upload(&vec![0f32; T * F]);
    let mut out = Vec::new();
    for step in 0..STEPS {
        for &st in schedule.steps() {
            let mb = st.microbatch();
            match st {
                Step::Forward { .. } => {
                    let l = format!("graphed {mode:?} {}", label(step, mb));
                    let x = gpu.upload(&input(step, mb));
                    let outs = graphed.static_outputs(0, mb).expect("static outputs");
                    gpu.overwrite(&outs[0], &vec![f32::NAN; T * F]);
                    let y = graphed
                        .forward(0, mb, &[&x], &gpu.stream)
                        .unwrap_or_else(|e| panic!("{l}: forward: {e}"));
                    let yv = gpu.read(&y[0]);
                    let routing = handle.read(&gpu.stream).expect("routing");
                    check_routing(&l, step, mb, &routing);
                    out.push(Fwd {
                        label: l,
                        y: yv,
                        routing,
                    });
                }
                Step::Backward { .. } => {
                    let l = format!("graphed {mode:?} step {step} backward microbatch {mb}");
                    let gi = graphed.static_grad_inputs(0, mb).expect("grad inputs");
                    gpu.overwrite(&gi[0], &vec![f32::NAN; T * H]);
                    let dx = graphed
                        .backward(0, mb, &[&dy], &gpu.stream)
                        .unwrap_or_else(|e| panic!("{l}: backward: {e}"));
                    assert!(
                        gpu.read(&dx[0]).iter().all(|&v| v.to_bits() == 0),
                        "{l}: the trivial backward must write +0.0 everywhere"
                    );
                }
                Step::WeightGrad { .. } => unreachable!("no weight-gradient entries"),
            }
        }
    }
    gpu.stream.synchronize().expect("sync");
    out
}

/// Asserts two runs' forwards are the same bits (outputs and routing).
fn assert_same_bits(got: &[Fwd], want: &[Fwd]) {
    assert_eq!(got.len(), want.len(), "forward counts");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(
            bits(&g.routing.logits),
            bits(&w.routing.logits),
            "{} vs {}: logits",
            g.label,
            w.label
        );
        assert_eq!(
            g.routing.expert, w.routing.expert,
            "{} vs {}: experts",
            g.label, w.label
        );
        assert_eq!(
            g.routing.position, w.routing.position,
            "{} vs {}: positions",
            g.label, w.label
        );
        assert_eq!(
            bits(&g.routing.gate),
            bits(&w.routing.gate),
            "{} vs {}: gates",
            g.label,
            w.label
        );
        assert_eq!(
            g.routing.counts, w.routing.counts,
            "{} vs {}: counts",
            g.label, w.label
        );
        if let Some(i) =
            g.y.iter()
                .zip(&w.y)
                .position(|(a, b)| a.to_bits() != b.to_bits())
        {
            panic!(
                "{} vs {}: y differs first at {i} (token {}, feature {}): {} vs {}",
                g.label,
                w.label,
                i / F,
                i % F,
                g.y[i],
                w.y[i]
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn moe_eager_per_expert_matches_host_reference() {
    let gpu = Gpu::new();
    let runs = run_eager(&gpu, ExpertGemm::PerExpert);
    assert_eq!(runs.len(), STEPS * MICROBATCHES);
}

#[test]
#[ignore = "needs a CUDA device"]
fn moe_breaking_layer_equals_eager_bit_for_bit() {
    let gpu = Gpu::new();
    let eager = run_eager(&gpu, ExpertGemm::PerExpert);
    let graphed = run_graphed(&gpu, ExpertGemm::PerExpert);
    assert_same_bits(&graphed, &eager);
}

#[test]
#[ignore = "needs a CUDA device"]
fn moe_full_layer_equals_eager_grouped_bit_for_bit() {
    let gpu = Gpu::new();
    let eager = run_eager(&gpu, ExpertGemm::Grouped);
    let graphed = run_graphed(&gpu, ExpertGemm::Grouped);
    assert_same_bits(&graphed, &eager);
}

#[test]
#[ignore = "needs a CUDA device"]
fn moe_grouped_and_per_expert_agree_to_the_tensor_core_bound() {
    let gpu = Gpu::new();
    let dense = run_eager(&gpu, ExpertGemm::PerExpert);
    let grouped = run_eager(&gpu, ExpertGemm::Grouped);
    for (g, d) in grouped.iter().zip(&dense) {
        // The routing is computed by the same kernels: identical.
        assert_eq!(g.routing.expert, d.routing.expert, "{}: experts", g.label);
        assert_eq!(g.routing.counts, d.routing.counts, "{}: counts", g.label);
        let want: Vec<f64> = d.y.iter().map(|&v| f64::from(v)).collect();
        let err = rel_err(&g.y, &want);
        assert!(
            err <= TENSOR_CORE_BOUND,
            "{} vs {}: grouped vs per-expert relative error {err:e} (bound {TENSOR_CORE_BOUND:e})",
            g.label,
            d.label
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn moe_rejects_bad_buffers() {
    let gpu = Gpu::new();
    let mut layer = new_layer(&gpu, ExpertGemm::Grouped);
    let pool = GraphPool::new(&gpu.ctx, 256).expect("pool");
    let x = gpu.upload(&vec![0f32; T * H - 1]);
    let y = gpu.upload(&vec![0f32; T * F]);
    let at = GraphIndex {
        chunk: 0,
        microbatch: 0,
        layer: 0,
    };
    let slot = Slot::new(at, vec![&x], vec![&y], vec![]).with_pool(&pool);
    let e = layer
        .forward(&gpu.stream, &[&x], &[&y], &slot)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Fp8Moe forward"), "{e}");
    let e = Fp8Moe::new(
        &gpu.stream,
        cfg(),
        &[0.0; 3],
        &expert_weights(),
        ExpertGemm::Grouped,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("router weight"), "{e}");
}
