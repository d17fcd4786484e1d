//! Causal self-attention ([`Attention`]) against the f64 reference
//! (`fp8_moe::model::attention_reference`) on fresh random data (the seed is printed;
//! `FP8_MOE_TEST_SEED` replays one), every output poisoned first:
//!
//! * the forward's `o` and `lse`, and the backward's dq, dk, dv, for one token, the train
//!   job's shape, a sequence that is no multiple of the kernels' tiles, every supported head
//!   dimension, and an explicit scale;
//! * two runs bit-identical, and a captured forward + backward replayed on new inputs equal
//!   to eager bit for bit;
//! * bad shapes, lengths, alignment, overlaps and scales rejected with nothing launched.
//!
//! # Tolerances
//! The reference takes the same bf16 inputs (widened to f64), so what remains is the
//! device's rounding: scores and sums in f32 (relative 2^-24 per operation, negligible), the
//! probabilities P rounded to bf16 before `P V` (relative error uniform within +-2^-9 per
//! entry, random in sign), and each output rounded once to bf16 (+-2^-9). For the forward,
//! `o_i = sum_j p_ij v_j` with each `p_ij` off by up to 2^-9 relative errs by about 2^-9
//! |v| (P's errors do not cancel with the normaliser, which sums the unrounded P), so `o`'s
//! norm-wise relative error is expected near 2^-9 .. 2^-8; it is checked at `4 * 2^-8`
//! (1.6%), and every element within `2^-6` of the largest |o| (a wrong key, head, mask or
//! normaliser is off by order 1). `lse` is pure f32 arithmetic: within 1e-4 absolute (it is
//! a log, so absolute error is what matters for `exp(s - lse)`).
//!
//! The backward rounds P and `dS = P (dP - delta)` to bf16 before their products (as
//! flash-attention does), and `delta = rowsum(dO * O)` uses the bf16 `o`; `dS` loses
//! relative accuracy where `dP` and `delta` nearly cancel, which the norm-wise check
//! absorbs. Each of dq, dk, dv is checked at a norm-wise relative error of `8 * 2^-8` (3%)
//! and every element within `2^-5` of the part's largest |value| (both at least 1/64 of the
//! largest |gradient| of all three parts: dq and dk of a one-token sequence are exactly 0,
//! and the device's are rounding noise, since its `dP` and `delta` sum in different orders).
//!
//! Seen on the H200: norm-wise 1.7e-3 .. 1.9e-3 for `o`, 2.2e-3 .. 3.6e-3 for the gradients,
//! `lse` within 2.4e-6; the largest element errors at most 3.4e-3 of their part's scale.

use std::sync::Arc;

mod common;
use common::{f64s_bf16, fresh_rng, to_bf16};
use fp8_moe::rng::Rng;

use cuda_graph::half::bf16;
use cuda_graph::{
    CaptureMode, Context, DeviceBuffer, Error, Event, GraphExec, InstantiateFlags, Stream,
};
use fp8_moe::model::attention::{Attention, AttentionShape};
use fp8_moe::model::attention_reference as rf;

/// A NaN with a payload no kernel writes.
const POISON_F32: u32 = 0x7fc0_dead;
/// bf16 NaN in every element (bytes 0xff).
const POISON_BYTE: u8 = 0xff;

const FWD_NORM: f64 = 4.0 / 256.0;
const FWD_MAX: f64 = 1.0 / 64.0;
const LSE_ABS: f64 = 1e-4;
const BWD_NORM: f64 = 8.0 / 256.0;
const BWD_MAX: f64 = 1.0 / 32.0;

struct Gpu {
    ctx: Arc<Context>,
    stream: Stream,
    att: Attention,
}

impl Gpu {
    fn new() -> Gpu {
        let ctx = Context::default_device().expect("a CUDA device");
        let stream = Stream::new(&ctx).unwrap();
        let att = Attention::new(&ctx).unwrap();
        Gpu { ctx, stream, att }
    }

    fn alloc<T: cuda_graph::DeviceRepr>(&self, n: usize) -> DeviceBuffer<T> {
        DeviceBuffer::alloc(&self.ctx, n).unwrap()
    }
}

/// Random `qkv` with q and k scaled by `qk_amp` (a larger amplitude sharpens the softmax:
/// the scaled scores' spread grows with its square).
fn random_qkv(rng: &mut Rng, s: AttentionShape, qk_amp: f32) -> Vec<bf16> {
    let d = s.width();
    let mut v = rng.vec(s.qkv_len(), 1.0);
    for row in v.chunks_mut(3 * d) {
        for x in &mut row[..2 * d] {
            *x *= qk_amp;
        }
    }
    to_bf16(&v)
}

/// Norm-wise relative error and largest absolute error.
fn errors(got: &[f64], want: &[f64]) -> (f64, f64) {
    assert_eq!(got.len(), want.len());
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    let max = got
        .iter()
        .zip(want)
        .map(|(g, w)| {
            if g.is_nan() {
                f64::INFINITY
            } else {
                (g - w).abs()
            }
        })
        .fold(0.0, f64::max);
    ((num / den.max(1e-300)).sqrt(), max)
}

fn amax(v: &[f64]) -> f64 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

/// Checks `got` against `want`: norm-wise relative error within `norm`, every element within
/// `max * amax(want)`, where `want`'s norm and largest |value| count as at least `floor`
/// (sqrt(len) * floor for the norm: a part whose exact value is 0, such as dq and dk of a
/// one-token sequence, is then held to rounding noise against the other parts' scale). A
/// NaN (poison left) fails both.
#[track_caller]
fn check(what: &str, got: &[f64], want: &[f64], norm: f64, max: f64, floor: f64) {
    let (n, m) = errors(got, want);
    let wnorm: f64 = want.iter().map(|w| w * w).sum::<f64>().sqrt();
    let n = n * wnorm.max(1e-300) / wnorm.max(floor * (want.len() as f64).sqrt()).max(1e-300);
    let scale = amax(want).max(floor);
    println!("{what}: norm-wise {n:.3e}, max {m:.3e} (of {scale:.3e})");
    assert!(
        n <= norm && m <= max * scale,
        "{what}: norm-wise relative error {n:.3e} (limit {norm:.3e}), largest error {m:.3e} \
         (limit {:.3e})",
        max * scale
    );
}

/// Columns `part * d .. (part + 1) * d` of every `[T, 3d]` row.
fn part(v: &[f64], d: usize, part: usize) -> Vec<f64> {
    v.chunks(3 * d)
        .flat_map(|r| r[part * d..(part + 1) * d].iter().copied())
        .collect()
}

/// Device buffers of one case.
struct Bufs {
    qkv: DeviceBuffer<bf16>,
    o: DeviceBuffer<bf16>,
    lse: DeviceBuffer<f32>,
    d_o: DeviceBuffer<bf16>,
    dqkv: DeviceBuffer<bf16>,
    ws: DeviceBuffer<f32>,
}

impl Bufs {
    fn new(gpu: &Gpu, s: AttentionShape) -> Bufs {
        Bufs {
            qkv: gpu.alloc(s.qkv_len()),
            o: gpu.alloc(s.o_len()),
            lse: gpu.alloc(s.lse_len()),
            d_o: gpu.alloc(s.o_len()),
            dqkv: gpu.alloc(s.qkv_len()),
            ws: gpu.alloc(Attention::backward_workspace_len(s)),
        }
    }

    fn poison(&self, gpu: &Gpu) {
        let st = &gpu.stream;
        self.o.memset_bytes(st, POISON_BYTE).unwrap();
        self.dqkv.memset_bytes(st, POISON_BYTE).unwrap();
        self.lse.fill_u32_bits(st, POISON_F32).unwrap();
        self.ws.fill_u32_bits(st, POISON_F32).unwrap();
    }

    fn forward(&self, gpu: &Gpu, s: AttentionShape, scale: f32) -> Result<(), Error> {
        gpu.att
            .forward(&gpu.stream, s, scale, &self.qkv, &self.o, &self.lse)
    }

    fn backward(&self, gpu: &Gpu, s: AttentionShape, scale: f32) -> Result<(), Error> {
        gpu.att.backward(
            &gpu.stream,
            s,
            scale,
            &self.qkv,
            &self.o,
            &self.lse,
            &self.d_o,
            &self.dqkv,
            &self.ws,
        )
    }

    /// The bits of o, lse and dqkv.
    fn bits(&self, gpu: &Gpu) -> (Vec<u16>, Vec<u32>, Vec<u16>) {
        let st = &gpu.stream;
        let b16 =
            |b: &DeviceBuffer<bf16>| b.to_vec(st).unwrap().iter().map(|x| x.to_bits()).collect();
        (
            b16(&self.o),
            self.lse
                .to_vec(st)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect(),
            b16(&self.dqkv),
        )
    }
}

/// One case: forward and backward on fresh data against the reference.
fn run_case(gpu: &Gpu, rng: &mut Rng, s: AttentionShape, scale: f32, qk_amp: f32) {
    let what = format!("{s:?} scale {scale}");
    let st = &gpu.stream;
    let b = Bufs::new(gpu, s);
    let qkv = random_qkv(rng, s, qk_amp);
    let d_o = to_bf16(&rng.vec(s.o_len(), 1.0));
    b.qkv.copy_from_host(st, &qkv).unwrap();
    b.d_o.copy_from_host(st, &d_o).unwrap();
    b.poison(gpu);
    b.forward(gpu, s, scale).unwrap();
    b.backward(gpu, s, scale).unwrap();
    st.synchronize().unwrap();

    let qkv64 = f64s_bf16(&qkv);
    let want = rf::forward(&s, f64::from(scale), &qkv64);
    let o = f64s_bf16(&b.o.to_vec(st).unwrap());
    let lse: Vec<f64> = b
        .lse
        .to_vec(st)
        .unwrap()
        .iter()
        .map(|&x| f64::from(x))
        .collect();
    check(&format!("{what} o"), &o, &want.o, FWD_NORM, FWD_MAX, 0.0);
    let (_, lse_err) = errors(&lse, &want.lse);
    println!("{what} lse: max {lse_err:.3e}");
    assert!(
        lse_err <= LSE_ABS,
        "{what} lse: largest error {lse_err:.3e}"
    );

    let grad = rf::backward(&s, f64::from(scale), &qkv64, &f64s_bf16(&d_o));
    let got = f64s_bf16(&b.dqkv.to_vec(st).unwrap());
    let d = s.width();
    let floor = amax(&grad) / 64.0;
    for (p, name) in ["dq", "dk", "dv"].iter().enumerate() {
        check(
            &format!("{what} {name}"),
            &part(&got, d, p),
            &part(&grad, d, p),
            BWD_NORM,
            BWD_MAX,
            floor,
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn forward_and_backward_match_the_reference() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("forward_and_backward_match_the_reference");
    for (s, amp) in [
        (AttentionShape::new(1, 1, 1, 64), 1.0),
        (AttentionShape::new(2, 256, 8, 64), 2.0),
        (AttentionShape::new(3, 100, 2, 64), 3.0),
        (AttentionShape::new(1, 1000, 2, 64), 2.0),
        (AttentionShape::new(2, 77, 3, 32), 2.0),
        (AttentionShape::new(2, 130, 2, 128), 2.0),
        (AttentionShape::new(1, 33, 2, 128), 3.0),
    ] {
        run_case(&gpu, &mut rng, s, s.default_scale(), amp);
    }
    // An explicit scale, not 1 / sqrt(D).
    run_case(&gpu, &mut rng, AttentionShape::new(2, 65, 2, 64), 0.3, 1.0);
}

#[test]
#[ignore = "needs a CUDA device"]
fn train_shape_matches_the_reference() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("train_shape_matches_the_reference");
    let s = AttentionShape::new(16, 256, 8, 64);
    run_case(&gpu, &mut rng, s, s.default_scale(), 2.0);
}

#[test]
#[ignore = "needs a CUDA device"]
fn repeat_runs_and_graph_replay_are_bit_identical() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("repeat_runs_and_graph_replay_are_bit_identical");
    let s = AttentionShape::new(4, 200, 4, 64);
    let scale = s.default_scale();
    let st = &gpu.stream;
    let b = Bufs::new(&gpu, s);
    let inputs: Vec<(Vec<bf16>, Vec<bf16>)> = (0..2)
        .map(|_| {
            (
                random_qkv(&mut rng, s, 2.0),
                to_bf16(&rng.vec(s.o_len(), 1.0)),
            )
        })
        .collect();
    let eager = |(qkv, d_o): &(Vec<bf16>, Vec<bf16>)| {
        b.qkv.copy_from_host(st, qkv).unwrap();
        b.d_o.copy_from_host(st, d_o).unwrap();
        b.poison(&gpu);
        b.forward(&gpu, s, scale).unwrap();
        b.backward(&gpu, s, scale).unwrap();
        b.bits(&gpu)
    };
    let first = eager(&inputs[0]);
    assert_eq!(eager(&inputs[0]), first, "two eager runs");
    let second = eager(&inputs[1]);
    assert_ne!(second.0, first.0, "different inputs, different outputs");
    // Thread-local: this binary's tests may run on parallel threads, whose API calls a
    // global-mode capture would forbid.
    let graph = st
        .capture(CaptureMode::ThreadLocal, |cs| {
            let g = Gpu {
                ctx: gpu.ctx.clone(),
                stream: cs.stream().clone(),
                att: gpu.att.clone(),
            };
            b.forward(&g, s, scale)?;
            b.backward(&g, s, scale)
        })
        .unwrap();
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
    for (input, want) in [
        (&inputs[0], &first),
        (&inputs[1], &second),
        (&inputs[0], &first),
    ] {
        b.qkv.copy_from_host(st, &input.0).unwrap();
        b.d_o.copy_from_host(st, &input.1).unwrap();
        b.poison(&gpu);
        exec.launch(st).unwrap();
        assert!(b.bits(&gpu) == *want, "graph replay differs from eager");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn bad_arguments_are_rejected_without_launching() {
    let gpu = Gpu::new();
    let st = &gpu.stream;
    let s = AttentionShape::new(2, 64, 2, 64);
    let scale = s.default_scale();
    let b = Bufs::new(&gpu, s);
    b.qkv.memset_bytes(st, 0).unwrap();
    b.d_o.memset_bytes(st, 0).unwrap();
    b.poison(&gpu);
    let untouched = b.bits(&gpu);
    let invalid = |r: Result<(), Error>, what: &str| match r {
        Err(Error::InvalidArgument(m)) => println!("{what}: {m}"),
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    };
    let a = &gpu.att;
    let short_bf = |n: usize| -> DeviceBuffer<bf16> { gpu.alloc(n - 8) };
    // Shapes and scales.
    for bad in [
        AttentionShape::new(2, 64, 2, 48),
        AttentionShape::new(0, 64, 2, 64),
        AttentionShape::new(2, 0, 2, 64),
    ] {
        invalid(
            a.forward(st, bad, scale, &b.qkv, &b.o, &b.lse),
            "shape (forward)",
        );
        invalid(
            a.backward(st, bad, scale, &b.qkv, &b.o, &b.lse, &b.d_o, &b.dqkv, &b.ws),
            "shape (backward)",
        );
    }
    for bad in [f32::NAN, f32::INFINITY, 0.0, -0.125] {
        invalid(a.forward(st, s, bad, &b.qkv, &b.o, &b.lse), "scale");
    }
    // Lengths.
    let qkv_short = short_bf(s.qkv_len());
    let o_short = short_bf(s.o_len());
    let lse_short: DeviceBuffer<f32> = gpu.alloc(s.lse_len() - 1);
    let ws_short: DeviceBuffer<f32> = gpu.alloc(Attention::backward_workspace_len(s) - 1);
    invalid(
        a.forward(st, s, scale, &qkv_short, &b.o, &b.lse),
        "qkv length",
    );
    invalid(
        a.forward(st, s, scale, &b.qkv, &o_short, &b.lse),
        "o length",
    );
    invalid(
        a.forward(st, s, scale, &b.qkv, &b.o, &lse_short),
        "lse length",
    );
    let bw = |qkv: &DeviceBuffer<bf16>,
              o: &DeviceBuffer<bf16>,
              d_o: &DeviceBuffer<bf16>,
              dqkv: &DeviceBuffer<bf16>,
              ws: &DeviceBuffer<f32>| {
        a.backward(st, s, scale, qkv, o, &b.lse, d_o, dqkv, ws)
    };
    invalid(bw(&b.qkv, &b.o, &o_short, &b.dqkv, &b.ws), "d_o length");
    invalid(bw(&b.qkv, &b.o, &b.d_o, &qkv_short, &b.ws), "dqkv length");
    invalid(
        bw(&b.qkv, &b.o, &b.d_o, &b.dqkv, &ws_short),
        "workspace length",
    );
    // Alignment: a view one element in.
    let wide: DeviceBuffer<bf16> = gpu.alloc(s.qkv_len() + 1);
    let misaligned = wide.slice(1..).unwrap();
    invalid(
        a.forward(st, s, scale, &misaligned, &b.o, &b.lse),
        "alignment",
    );
    // Overlaps: an output inside an input.
    let inside = b.qkv.slice(..s.o_len()).unwrap();
    invalid(
        a.forward(st, s, scale, &b.qkv, &inside, &b.lse),
        "o inside qkv",
    );
    invalid(bw(&b.qkv, &b.o, &b.d_o, &b.qkv, &b.ws), "dqkv is qkv");
    let ws_in_lse = b.lse.share();
    invalid(
        bw(&b.qkv, &b.o, &b.d_o, &b.dqkv, &ws_in_lse),
        "workspace is lse",
    );
    st.synchronize().unwrap();
    assert!(b.bits(&gpu) == untouched, "a rejected call wrote an output");
    // A longer workspace is fine.
    let ws_long: DeviceBuffer<f32> = gpu.alloc(Attention::backward_workspace_len(s) + 100);
    b.forward(&gpu, s, scale).unwrap();
    bw(&b.qkv, &b.o, &b.d_o, &b.dqkv, &ws_long).unwrap();
    st.synchronize().unwrap();
}

/// Times the train job's shape (and generation's one sequence): prints the mean time of a
/// forward and of a backward over 50 back-to-back calls each (as a graph replays them), after
/// a warm-up. Not a pass/fail check of speed, but it fails if nothing ran.
#[test]
#[ignore = "needs a CUDA device"]
fn train_shape_timing_probe() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("train_shape_timing_probe");
    let st = &gpu.stream;
    for s in [
        AttentionShape::new(16, 256, 8, 64),
        AttentionShape::new(1, 1024, 8, 64),
        AttentionShape::new(4, 1024, 8, 64),
    ] {
        let scale = s.default_scale();
        let b = Bufs::new(&gpu, s);
        b.qkv
            .copy_from_host(st, &random_qkv(&mut rng, s, 2.0))
            .unwrap();
        b.d_o
            .copy_from_host(st, &to_bf16(&rng.vec(s.o_len(), 1.0)))
            .unwrap();
        let (e0, e1, e2) = (
            Event::new(&gpu.ctx).unwrap(),
            Event::new(&gpu.ctx).unwrap(),
            Event::new(&gpu.ctx).unwrap(),
        );
        const N: usize = 50;
        let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            e0.record(st).unwrap();
            for _ in 0..N {
                b.forward(&gpu, s, scale).unwrap();
            }
            e1.record(st).unwrap();
            for _ in 0..N {
                b.backward(&gpu, s, scale).unwrap();
            }
            e2.record(st).unwrap();
            e2.synchronize().unwrap();
            fwd.push(Event::elapsed_ms(&e0, &e1).unwrap() * 1e3 / N as f32);
            bwd.push(Event::elapsed_ms(&e1, &e2).unwrap() * 1e3 / N as f32);
        }
        // The first round is the warm-up.
        let (f, w) = (&mut fwd[1..], &mut bwd[1..]);
        f.sort_by(f32::total_cmp);
        w.sort_by(f32::total_cmp);
        println!(
            "{s:?}: forward {:.1} us, backward {:.1} us (medians of {} rounds of {N} calls)",
            f[f.len() / 2],
            w[w.len() / 2],
            f.len()
        );
        assert!(f[0] > 0.0 && w[0] > 0.0);
    }
}
