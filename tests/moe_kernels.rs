//! The MoE layer's routing, dispatch and fused-cast kernels against the f64 reference
//! (`fp8_moe::moe::reference`), each on fresh random data (the seed is printed), every output
//! poisoned first:
//!
//! * router + plan: logits to f32 accuracy; top-k, counts, offsets, `row_of` and
//!   `token_of_row` exactly as the reference computes them from the device's logits; gates,
//!   the aux distribution, logsumexp and both losses to f32 accuracy; softmax, renormalised
//!   softmax and sigmoid, k = 1, 2, 8, E up to 256, all tokens to one expert;
//! * the fused casts: the permute and the combine's backward bit for bit against the host's
//!   FP8 conversion of the same f32 values; SwiGLU and its backward within rounding of the
//!   f64 values (the device's `expf` is not the host's), also on edge tiles; padding rows
//!   zero, rows past the ones in use untouched, the transposed copy the same bytes;
//! * combine, the gates' gradient, the router backward, the input and router-weight
//!   gradients against f64;
//! * two runs bit-identical, and a captured forward replayed on new inputs equal to eager.

use std::sync::Arc;

mod common;
use common::{f64s, f64s_bf16, fresh_rng, to_bf16};
use fp8_moe::rng::Rng;

use cuda_graph::half::bf16;
use cuda_graph::{CaptureMode, Context, DeviceBuffer, GraphExec, InstantiateFlags, Stream};
use fp8_kernels::reference::{decode, encode};
use fp8_kernels::{
    CastScaling, Fp8Format, Fp8Tensor, FusedCastOut, Gather, RowsInUse, gather_cast_transpose,
    swiglu_backward_cast_transpose, swiglu_cast_transpose,
};
use fp8_moe::moe::reference::{self as rf, MoeDims};
use fp8_moe::moe::routing::{
    ALIGN_ROWS, Router, RouterConfig, RoutingBuffers, RoutingDims, ScoreFn,
};

/// A NaN with a payload no kernel writes.
const POISON_F32: u32 = 0x7fc0_dead;
const POISON_I32: u32 = 0x5a5a_5a5a;
const POISON_U8: u8 = 0xa5;

struct Gpu {
    _ctx: Arc<Context>,
    stream: Stream,
}

impl Gpu {
    fn new() -> Gpu {
        let ctx = Context::default_device().expect("a CUDA device");
        let stream = Stream::new(&ctx).unwrap();
        Gpu { _ctx: ctx, stream }
    }
}

fn poison_f32(gpu: &Gpu, b: &DeviceBuffer<f32>) {
    b.fill_u32_bits(&gpu.stream, POISON_F32).unwrap();
}

fn poison_i32(gpu: &Gpu, b: &DeviceBuffer<i32>) {
    b.fill_u32_bits(&gpu.stream, POISON_I32).unwrap();
}

/// `|got - want| <= rel * scale + abs` for every element, `scale` the largest |want|.
#[track_caller]
fn assert_close(what: &str, got: &[f64], want: &[f64], rel: f64, abs: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= rel * scale + abs,
            "{what}[{i}]: got {g}, want {w} (scale {scale})"
        );
    }
}

fn ref_dims(d: RoutingDims) -> MoeDims {
    MoeDims {
        tokens: d.tokens,
        hidden: d.hidden,
        ffn: 16,
        experts: d.experts,
        align: d.align,
    }
}

/// One routing case: shape, config, and the data's shape of x and wr.
struct Case {
    dims: RoutingDims,
    cfg: RouterConfig,
    /// All tokens to expert `Some(e)` first (x positive, wr[e] large).
    one_expert: Option<usize>,
}

fn case(
    tokens: usize,
    hidden: usize,
    experts: usize,
    top_k: usize,
    score: ScoreFn,
    renormalize: bool,
) -> Case {
    Case {
        dims: RoutingDims {
            tokens,
            hidden,
            experts,
            top_k,
            align: ALIGN_ROWS,
        },
        cfg: RouterConfig {
            top_k,
            score,
            renormalize,
            aux_coef: 0.01,
            z_coef: 0.001,
        },
        one_expert: None,
    }
}

/// x (`[T, H]`, bf16) and wr (`[E, H]`) for a case.
fn inputs(rng: &mut Rng, c: &Case) -> (Vec<bf16>, Vec<f32>) {
    let d = c.dims;
    let mut x = rng.vec(d.tokens * d.hidden, 1.0);
    let mut wr = rng.vec(d.experts * d.hidden, 0.5);
    if let Some(e) = c.one_expert {
        x.iter_mut().for_each(|v| *v = 0.5 + v.abs() * 0.5);
        wr.iter_mut().for_each(|v| *v *= 0.1);
        wr[e * d.hidden..(e + 1) * d.hidden].fill(1.0);
    }
    (to_bf16(&x), wr)
}

/// Everything the router forward wrote, read back.
struct Routed {
    logits: Vec<f32>,
    probs: Vec<f32>,
    lse: Vec<f32>,
    topk: Vec<i32>,
    gates: Vec<f32>,
    counts: Vec<i32>,
    offsets: Vec<i32>,
    row_of: Vec<i32>,
    token_of_row: Vec<i32>,
    losses: Vec<f32>,
}

fn read_routing(gpu: &Gpu, b: &RoutingBuffers) -> Routed {
    let s = &gpu.stream;
    Routed {
        logits: b.logits.to_vec(s).unwrap(),
        probs: b.probs.to_vec(s).unwrap(),
        lse: b.lse.to_vec(s).unwrap(),
        topk: b.topk.to_vec(s).unwrap(),
        gates: b.gates.to_vec(s).unwrap(),
        counts: b.counts.to_vec(s).unwrap(),
        offsets: b.offsets.to_vec(s).unwrap(),
        row_of: b.row_of.to_vec(s).unwrap(),
        token_of_row: b.token_of_row.to_vec(s).unwrap(),
        losses: b.losses.to_vec(s).unwrap(),
    }
}

fn poison_routing(gpu: &Gpu, b: &RoutingBuffers) {
    for f in [&b.logits, &b.probs, &b.lse, &b.gates, &b.losses] {
        poison_f32(gpu, f);
    }
    for i in [&b.topk, &b.counts, &b.offsets, &b.row_of, &b.token_of_row] {
        poison_i32(gpu, i);
    }
}

/// Runs the router forward on fresh buffers and checks everything against the reference;
/// returns the router, its buffers, the uploaded inputs and what was read back.
struct Run {
    router: Router,
    b: RoutingBuffers,
    x: DeviceBuffer<bf16>,
    x_host: Vec<bf16>,
    wr: DeviceBuffer<f32>,
    wr_host: Vec<f32>,
    got: Routed,
    /// The reference's routing from the device's logits.
    reference: rf::Routing,
}

fn route_and_check(gpu: &Gpu, rng: &mut Rng, c: &Case) -> Run {
    let d = c.dims;
    let label = format!("{:?} {:?}", d, c.cfg);
    let router = Router::new(&gpu.stream, d, c.cfg).unwrap();
    let b = RoutingBuffers::new(&gpu.stream, d).unwrap();
    let (x_host, wr_host) = inputs(rng, c);
    let x = DeviceBuffer::from_host(&gpu.stream, &x_host).unwrap();
    let wr = DeviceBuffer::from_host(&gpu.stream, &wr_host).unwrap();
    poison_routing(gpu, &b);
    router.forward(&gpu.stream, &x, &wr, &b).unwrap();
    let got = read_routing(gpu, &b);
    let rd = ref_dims(d);
    let rcfg = rf::RouterConfig::from(c.cfg);
    // Logits: f32 sums of H products against f64.
    let from_inputs = rf::route(&rd, &rcfg, &f64s_bf16(&x_host), &f64s(&wr_host)).unwrap();
    assert_close(
        &format!("{label} logits"),
        &f64s(&got.logits),
        &from_inputs.logits,
        1e-5,
        1e-6,
    );
    // Everything downstream from the device's own logits, so that f32 rounding of a logit
    // cannot flip a near-tie and fail the exact comparisons.
    let reference = rf::route_logits(&rd, &rcfg, &f64s(&got.logits)).unwrap();
    let topk: Vec<i32> = reference.topk.iter().map(|&e| e as i32).collect();
    assert_eq!(got.topk, topk, "{label}: top-k");
    let counts: Vec<i32> = reference.plan.counts.iter().map(|&c| c as i32).collect();
    assert_eq!(got.counts, counts, "{label}: counts");
    let offsets: Vec<i32> = reference.plan.offsets.iter().map(|&o| o as i32).collect();
    assert_eq!(got.offsets, offsets, "{label}: offsets");
    let row_of: Vec<i32> = reference.plan.row_of.iter().map(|&r| r as i32).collect();
    assert_eq!(got.row_of, row_of, "{label}: row_of");
    // The reference's capacity is the bound T * k + E * (align - 1); the device's rounds it
    // up to a whole row tile for the GEMMs. The rows between are padding (-1).
    assert!(reference.plan.capacity <= d.capacity(), "{label}: capacity");
    assert!(
        d.capacity() < reference.plan.capacity + d.align,
        "{label}: capacity"
    );
    let mut token_of_row: Vec<i32> = reference
        .plan
        .token_of_row
        .iter()
        .map(|a| a.map_or(-1, |(t, j)| (t as usize * d.top_k + j as usize) as i32))
        .collect();
    token_of_row.resize(d.capacity(), -1);
    assert_eq!(got.token_of_row, token_of_row, "{label}: token_of_row");
    assert_close(
        &format!("{label} gates"),
        &f64s(&got.gates),
        &reference.gates,
        1e-5,
        1e-7,
    );
    assert_close(
        &format!("{label} probs"),
        &f64s(&got.probs),
        &reference.probs,
        1e-5,
        1e-7,
    );
    assert_close(
        &format!("{label} lse"),
        &f64s(&got.lse),
        &reference.lse,
        1e-5,
        1e-6,
    );
    assert_close(
        &format!("{label} losses"),
        &f64s(&got.losses),
        &[reference.aux_loss, reference.z_loss],
        1e-4,
        1e-9,
    );
    Run {
        router,
        b,
        x,
        x_host,
        wr,
        wr_host,
        got,
        reference,
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn router_and_plan_match_the_reference() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("router_and_plan_match_the_reference");
    let mut cases = vec![
        case(37, 64, 8, 2, ScoreFn::Softmax, false),
        case(64, 48, 8, 2, ScoreFn::Softmax, true),
        case(50, 32, 16, 8, ScoreFn::Sigmoid, false),
        case(300, 64, 256, 8, ScoreFn::Softmax, true),
        case(1000, 16, 4, 1, ScoreFn::Softmax, false),
        case(513, 32, 64, 4, ScoreFn::Sigmoid, false),
        // H not a multiple of 8 and E not of 4: the kernels' scalar (unvectorised) paths.
        case(77, 20, 5, 2, ScoreFn::Softmax, false),
        // From 32 experts the logits come from the tiled GEMM (moe_router_logits): its scalar
        // path (H = 20), and H = 40, whose last 16-column pieces fall past H (scalar there,
        // vector loads elsewhere); T and E not multiples of its 64 x 64 tiles.
        case(90, 20, 40, 2, ScoreFn::Softmax, false),
        case(130, 40, 48, 4, ScoreFn::Sigmoid, true),
        // The plan in one block (T * k <= 4096, E <= 256: every case above) and in three
        // launches: more assignments, more experts.
        case(2100, 16, 8, 2, ScoreFn::Softmax, false),
        case(600, 16, 256, 8, ScoreFn::Sigmoid, true),
        case(60, 16, 300, 4, ScoreFn::Softmax, false),
        // The single-block plan's edges: 4096 assignments (its last pass full), 1 expert.
        case(2048, 16, 16, 2, ScoreFn::Softmax, false),
        case(33, 16, 1, 1, ScoreFn::Softmax, false),
    ];
    for (k, score) in [(1, ScoreFn::Softmax), (2, ScoreFn::Sigmoid)] {
        let mut c = case(200, 32, 8, k, score, false);
        c.one_expert = Some(5);
        cases.push(c);
    }
    for c in &cases {
        let run = route_and_check(&gpu, &mut rng, c);
        if let Some(e) = c.one_expert {
            // Every token's first choice is expert e: the others get k - 1 tokens' worth.
            assert_eq!(run.got.counts[e] as usize, c.dims.tokens, "one expert");
            if c.dims.top_k == 1 {
                assert!(
                    run.got
                        .counts
                        .iter()
                        .enumerate()
                        .all(|(i, &n)| i == e || n == 0)
                );
            }
        }
    }
}

/// Checks an FP8 byte against an f64 value computed on the host: the byte the host's
/// conversion gives, or the one a relative 1e-5 away gives (the device's f32 `expf` and
/// products may land on the other side of a rounding boundary).
fn fp8_near(got: u8, v: f64, fmt: Fp8Format) -> bool {
    [v, v * (1.0 - 1e-5), v * (1.0 + 1e-5)]
        .iter()
        .any(|&w| encode(w as f32, fmt) == got)
}

/// A packed-layout FP8 output's row-major and transposed bytes, checked: rows in use equal
/// `want` (by `same`), rows past `used` keep the poison in both copies.
#[allow(clippy::too_many_arguments)]
fn check_packed(
    what: &str,
    y: &[u8],
    yt: &[u8],
    rows: usize,
    cols: usize,
    used: usize,
    want: impl Fn(usize, usize) -> f64,
    same: impl Fn(u8, f64) -> bool,
) {
    for r in 0..rows {
        for c in 0..cols {
            let (b, bt) = (y[r * cols + c], yt[c * rows + r]);
            if r < used {
                let v = want(r, c);
                assert!(same(b, v), "{what} [{r}, {c}]: byte {b:#04x} for {v}");
                assert_eq!(b, bt, "{what} [{r}, {c}]: transposed copy");
            } else if r >= used.next_multiple_of(128) {
                // Whole tiles past the rows in use are not written at all.
                assert_eq!(
                    (b, bt),
                    (POISON_U8, POISON_U8),
                    "{what} [{r}, {c}] past use"
                );
            } else {
                assert_eq!((b, bt), (0, 0), "{what} [{r}, {c}] in the last tile");
            }
        }
    }
}

fn fp8_out(
    gpu: &Gpu,
    rows: usize,
    cols: usize,
    fmt: Fp8Format,
    scale: f32,
) -> (Fp8Tensor, DeviceBuffer<u8>) {
    let out = Fp8Tensor::new(&gpu.stream, &[rows, cols], fmt).unwrap();
    out.data().memset_bytes(&gpu.stream, POISON_U8).unwrap();
    out.scale().write(&gpu.stream, scale).unwrap();
    out.amax().write(&gpu.stream, 0.0).unwrap();
    let out_t = DeviceBuffer::<u8>::alloc(gpu.stream.context(), rows * cols).unwrap();
    out_t.memset_bytes(&gpu.stream, POISON_U8).unwrap();
    (out, out_t)
}

/// The permute of `run`'s x into a poisoned E4M3 output (scale slot preset to `preset`, amax
/// to a value the launch must not keep) with `scaling`, checked: the bytes bit for bit
/// against the host's conversion of the same f32 products with the scale the cast used
/// (`preset`, or `448 / max |x|` computed on the device), the amax (`max |x|`: every token is
/// in some row), scale_inv, padding rows zero, rows past the ones in use untouched.
fn check_permute(gpu: &Gpu, run: &Run, d: RoutingDims, scaling: CastScaling, preset: f32) {
    let s = &gpu.stream;
    let (rows, h, k) = (d.capacity(), d.hidden, d.top_k);
    let used = run.got.offsets[d.experts] as usize;
    let xf: Vec<f32> = run.x_host.iter().map(|v| v.to_f32()).collect();
    let amax = xf.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let (out, out_t) = fp8_out(gpu, rows, h, Fp8Format::E4M3, preset);
    if scaling == CastScaling::Current {
        out.amax().write(s, 99.0).unwrap();
    }
    let gather = Gather {
        token_of_row: &run.b.token_of_row,
        top_k: k,
        row_scale: None,
    };
    let used_at = RowsInUse::last(&run.b.offsets).unwrap();
    let dst = FusedCastOut::new(&out, &out_t).scaling(scaling);
    gather_cast_transpose(s, &run.x, (d.tokens, h), gather, used_at, dst).unwrap();
    let scale = match scaling {
        CastScaling::Delayed => preset,
        CastScaling::Current => 448.0 / amax,
    };
    let label = format!("permute {scaling:?}");
    assert_eq!(out.amax().read(s).unwrap(), amax, "{label} amax");
    assert_eq!(out.scale().read(s).unwrap(), scale, "{label} scale");
    assert_eq!(
        out.scale_inv().read(s).unwrap(),
        1.0 / scale,
        "{label} scale_inv"
    );
    let (y, yt) = (out.data().to_vec(s).unwrap(), out_t.to_vec(s).unwrap());
    let tor = &run.got.token_of_row;
    let x_of = |r: usize, col: usize| {
        if tor[r] < 0 {
            0.0
        } else {
            xf[(tor[r] as usize / k) * h + col]
        }
    };
    check_packed(
        &label,
        &y,
        &yt,
        rows,
        h,
        used,
        |r, col| f64::from(x_of(r, col)),
        |b, v| b == encode(v as f32 * scale, Fp8Format::E4M3),
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn fused_casts_match_the_host() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("fused_casts_match_the_host");
    let c = case(300, 64, 8, 2, ScoreFn::Softmax, false);
    let run = route_and_check(&gpu, &mut rng, &c);
    let d = c.dims;
    let (rows, h, k) = (d.capacity(), d.hidden, d.top_k);
    let used = run.got.offsets[d.experts] as usize;
    let s = &gpu.stream;
    let tor = &run.got.token_of_row;
    let assignment = |r: usize| (tor[r] >= 0).then(|| tor[r] as usize);

    // The permute: E4M3, bit for bit against the host's conversion of the same f32 product.
    check_permute(&gpu, &run, d, CastScaling::Delayed, 3.5);
    let used_at = RowsInUse::last(&run.b.offsets).unwrap();

    // The combine's backward: dY[r] = gate * dy[t], E5M2, bit for bit (one f32 product).
    let dy_host = to_bf16(&rng.vec(d.tokens * h, 2.0));
    let dy = DeviceBuffer::from_host(s, &dy_host).unwrap();
    let (out, out_t) = fp8_out(&gpu, rows, h, Fp8Format::E5M2, 16.0);
    let gather = Gather {
        token_of_row: &run.b.token_of_row,
        top_k: k,
        row_scale: Some(&run.b.gates),
    };
    gather_cast_transpose(
        s,
        &dy,
        (d.tokens, h),
        gather,
        used_at,
        FusedCastOut::new(&out, &out_t),
    )
    .unwrap();
    let (y, yt) = (out.data().to_vec(s).unwrap(), out_t.to_vec(s).unwrap());
    let g = &run.got.gates;
    let dy_of = |r: usize, col: usize| {
        assignment(r).map_or(0.0, |a| dy_host[(a / k) * h + col].to_f32() * g[a])
    };
    check_packed(
        "combine backward",
        &y,
        &yt,
        rows,
        h,
        used,
        |r, col| f64::from(dy_of(r, col)),
        |b, v| b == encode(v as f32 * 16.0, Fp8Format::E5M2),
    );
    let amax = (0..used)
        .flat_map(|r| (0..h).map(move |col| (r, col)))
        .fold(0.0f32, |m, (r, col)| m.max(dy_of(r, col).abs()));
    assert_eq!(out.amax().read(s).unwrap(), amax, "combine backward amax");

    // SwiGLU and its backward on a packed fc1 output: real rows random, padding rows zero,
    // rows past the ones in use garbage (must not count).
    let f = 64;
    let mut a_host = rng.vec(rows * 2 * f, 3.0);
    let mut dh_host = rng.vec(rows * f, 1.0);
    for r in 0..used {
        if assignment(r).is_none() {
            a_host[r * 2 * f..(r + 1) * 2 * f].fill(0.0);
            dh_host[r * f..(r + 1) * f].fill(0.0);
        }
    }
    for r in used..rows {
        a_host[r * 2 * f..(r + 1) * 2 * f].fill(1e4);
    }
    let (a_host, dh_host) = (to_bf16(&a_host), to_bf16(&dh_host));
    let a = DeviceBuffer::from_host(s, &a_host).unwrap();
    let dh = DeviceBuffer::from_host(s, &dh_host).unwrap();
    let af = f64s_bf16(&a_host);
    let dhf = f64s_bf16(&dh_host);
    let h_ref = rf::swiglu(&af, f).unwrap();
    let da_ref = rf::swiglu_backward(&af, &dhf, f).unwrap();
    let scale = 2.0f32;
    let (out, out_t) = fp8_out(&gpu, rows, f, Fp8Format::E4M3, scale);
    swiglu_cast_transpose(s, &a, (rows, f), used_at, FusedCastOut::new(&out, &out_t)).unwrap();
    let (y, yt) = (out.data().to_vec(s).unwrap(), out_t.to_vec(s).unwrap());
    let fwd_amax = out.amax().read(s).unwrap();
    check_packed(
        "swiglu",
        &y,
        &yt,
        rows,
        f,
        used,
        |r, col| h_ref[r * f + col],
        |b, v| fp8_near(b, v * f64::from(scale), Fp8Format::E4M3),
    );
    let (fwd_y, fwd_yt) = (y, yt);
    let amax_ref = h_ref[..used * f].iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let amax = f64::from(out.amax().read(s).unwrap());
    assert!(
        (amax - amax_ref).abs() <= 1e-5 * amax_ref,
        "swiglu amax {amax} vs {amax_ref}"
    );

    let (out, out_t) = fp8_out(&gpu, rows, 2 * f, Fp8Format::E5M2, scale);
    swiglu_backward_cast_transpose(
        s,
        &a,
        &dh,
        (rows, f),
        used_at,
        FusedCastOut::new(&out, &out_t),
    )
    .unwrap();
    let (y, yt) = (out.data().to_vec(s).unwrap(), out_t.to_vec(s).unwrap());
    check_packed(
        "swiglu backward",
        &y,
        &yt,
        rows,
        2 * f,
        used,
        |r, col| da_ref[r * 2 * f + col],
        |b, v| fp8_near(b, v * f64::from(scale), Fp8Format::E5M2),
    );
    let amax_ref = da_ref[..used * 2 * f]
        .iter()
        .fold(0.0f64, |m, v| m.max(v.abs()));
    let amax = f64::from(out.amax().read(s).unwrap());
    assert!(
        (amax - amax_ref).abs() <= 1e-5 * amax_ref,
        "swiglu backward amax"
    );
    // The E5M2 bytes decode to the values they encode (a sanity check of the format pair).
    assert!(
        y[..used * 2 * f]
            .iter()
            .all(|&b| decode(b, Fp8Format::E5M2).is_finite())
    );
    let (bwd_y, bwd_yt, bwd_amax) = (y, yt, out.amax().read(s).unwrap());

    // With the plan's padding marks (RowsInUse::padding) the padding rows are read as zeros:
    // garbage written into them changes nothing, bit for bit, amax included.
    let (mut a_pad, mut dh_pad) = (a_host.clone(), dh_host.clone());
    for r in (0..used).filter(|&r| assignment(r).is_none()) {
        a_pad[r * 2 * f..(r + 1) * 2 * f].fill(bf16::from_f32(-3e4));
        dh_pad[r * f..(r + 1) * f].fill(bf16::from_f32(f32::NAN));
    }
    assert!(
        (0..used).any(|r| assignment(r).is_none()),
        "the routing has padding rows"
    );
    a.copy_from_host(s, &a_pad).unwrap();
    dh.copy_from_host(s, &dh_pad).unwrap();
    let marked = used_at.padding(&run.b.token_of_row);
    // (row-major bytes, transposed bytes, amax) of a cast's output.
    let results = |out: &Fp8Tensor, out_t: &DeviceBuffer<u8>| {
        (
            out.data().to_vec(s).unwrap(),
            out_t.to_vec(s).unwrap(),
            out.amax().read(s).unwrap(),
        )
    };
    let (out, out_t) = fp8_out(&gpu, rows, f, Fp8Format::E4M3, scale);
    swiglu_cast_transpose(s, &a, (rows, f), marked, FusedCastOut::new(&out, &out_t)).unwrap();
    assert!(
        results(&out, &out_t) == (fwd_y, fwd_yt, fwd_amax),
        "swiglu with padding marks: bytes or amax differ"
    );
    let (out_b, out_bt) = fp8_out(&gpu, rows, 2 * f, Fp8Format::E5M2, scale);
    let dst = FusedCastOut::new(&out_b, &out_bt);
    swiglu_backward_cast_transpose(s, &a, &dh, (rows, f), marked, dst).unwrap();
    assert!(
        results(&out_b, &out_bt) == (bwd_y, bwd_yt, bwd_amax),
        "swiglu backward with padding marks: bytes or amax differ"
    );
    // Too few marks for the rows: refused before any launch (the output keeps its bytes).
    let short = DeviceBuffer::from_host(s, &vec![0i32; rows - 1]).unwrap();
    let before = results(&out, &out_t);
    let dst = FusedCastOut::new(&out, &out_t);
    match swiglu_cast_transpose(s, &a, (rows, f), used_at.padding(&short), dst) {
        Err(e) => assert!(
            e.to_string().contains("padding marks"),
            "short padding marks: {e}"
        ),
        Ok(()) => panic!("short padding marks accepted"),
    }
    assert!(results(&out, &out_t) == before, "a refused cast wrote");
}

/// SwiGLU and its backward on tiles the routed shapes above do not reach: F = 80 (a fast and
/// an edge column tile, so the backward's two output halves on both paths), rows in use
/// ending inside a fast row tile (its rows past them written zero), a whole row tile past
/// them (untouched), and a row count off the fast path (rows % 16 != 0). Rows past the ones
/// in use hold garbage that must not count.
#[test]
#[ignore = "needs a CUDA device"]
fn swiglu_casts_on_edge_tiles() {
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let mut rng = fresh_rng("swiglu_casts_on_edge_tiles");
    let f = 80;
    for (rows, used) in [(256usize, 200usize), (256, 100), (100, 90)] {
        let what = format!("[{rows}, {f}] with {used} rows in use");
        let mut a_host = rng.vec(rows * 2 * f, 3.0);
        for r in used..rows {
            a_host[r * 2 * f..(r + 1) * 2 * f].fill(1e4);
        }
        let (a_host, dh_host) = (to_bf16(&a_host), to_bf16(&rng.vec(rows * f, 1.0)));
        let a = DeviceBuffer::from_host(s, &a_host).unwrap();
        let dh = DeviceBuffer::from_host(s, &dh_host).unwrap();
        let used_buf = DeviceBuffer::from_host(s, &[used as i32]).unwrap();
        let used_at = RowsInUse::at(&used_buf, 0).unwrap();
        let af = f64s_bf16(&a_host);
        let h_ref = rf::swiglu(&af, f).unwrap();
        let da_ref = rf::swiglu_backward(&af, &f64s_bf16(&dh_host), f).unwrap();
        let scale = 4.0f32;
        for (label, fmt, cols, want) in [
            ("swiglu", Fp8Format::E4M3, f, &h_ref),
            ("swiglu backward", Fp8Format::E5M2, 2 * f, &da_ref),
        ] {
            let label = format!("{label} {what}");
            let (out, out_t) = fp8_out(&gpu, rows, cols, fmt, scale);
            let dst = FusedCastOut::new(&out, &out_t);
            if cols == f {
                swiglu_cast_transpose(s, &a, (rows, f), used_at, dst).unwrap();
            } else {
                swiglu_backward_cast_transpose(s, &a, &dh, (rows, f), used_at, dst).unwrap();
            }
            let (y, yt) = (out.data().to_vec(s).unwrap(), out_t.to_vec(s).unwrap());
            check_packed(
                &label,
                &y,
                &yt,
                rows,
                cols,
                used,
                |r, col| want[r * cols + col],
                |b, v| fp8_near(b, v * f64::from(scale), fmt),
            );
            let amax_ref = want[..used * cols]
                .iter()
                .fold(0.0f64, |m, v| m.max(v.abs()));
            let amax = f64::from(out.amax().read(s).unwrap());
            assert!(
                (amax - amax_ref).abs() <= 1e-5 * amax_ref,
                "{label}: amax {amax} vs {amax_ref}"
            );
            assert_eq!(
                out.scale_inv().read(s).unwrap(),
                1.0 / scale,
                "{label}: scale_inv"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn combine_and_the_backward_match_the_reference() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("combine_and_the_backward_match_the_reference");
    for c in [
        case(200, 64, 8, 2, ScoreFn::Softmax, false),
        case(150, 32, 16, 4, ScoreFn::Softmax, true),
        case(120, 32, 32, 8, ScoreFn::Sigmoid, false),
        // The scalar paths (H not a multiple of 8, E not of 4).
        case(90, 20, 5, 2, ScoreFn::Softmax, true),
        // Enough tokens for several tokens per block in every kernel (up to 4 in the
        // combine's, 8 in the input gradient's), the last block short.
        case(1101, 64, 8, 2, ScoreFn::Softmax, false),
        case(1030, 32, 16, 1, ScoreFn::Sigmoid, false),
        case(515, 32, 16, 4, ScoreFn::Softmax, true),
        // From 32 experts the tiled kernels (logits, router weight gradient): two chunks of
        // tokens with a short last one, E and H not multiples of the 64 x 64 tiles, H = 40
        // with its last 16-column pieces past H; then E not a multiple of 4 and H = 20 (their
        // scalar loads).
        case(1101, 40, 48, 2, ScoreFn::Softmax, false),
        case(300, 20, 37, 2, ScoreFn::Sigmoid, false),
    ] {
        let run = route_and_check(&gpu, &mut rng, &c);
        let d = c.dims;
        let label = format!("{d:?} {:?}", c.cfg);
        let (rows, h, k, t, e) = (d.capacity(), d.hidden, d.top_k, d.tokens, d.experts);
        let s = &gpu.stream;
        let (r, b) = (&run.router, &run.b);
        let gates = f64s(&run.got.gates);
        let row_of = &run.got.row_of;

        // Combine.
        let y_host = to_bf16(&rng.vec(rows * h, 1.0));
        let y = DeviceBuffer::from_host(s, &y_host).unwrap();
        let out = DeviceBuffer::from_host(s, &vec![bf16::NAN; t * h]).unwrap();
        r.combine(s, &y, b, &out).unwrap();
        let yf = f64s_bf16(&y_host);
        let mut want = vec![0.0; t * h];
        for tok in 0..t {
            for j in 0..k {
                let row = row_of[tok * k + j] as usize;
                for col in 0..h {
                    want[tok * h + col] += gates[tok * k + j] * yf[row * h + col];
                }
            }
        }
        // bf16 output: half an ulp (2^-9 relative) plus f32 sums.
        let got: Vec<f64> = f64s_bf16(&out.to_vec(s).unwrap());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= w.abs() * 2f64.powi(-8) + 1e-6,
                "{label} combine[{i}]: {g} vs {w}"
            );
        }

        // The gates' gradient, then the logits'.
        let dy_host = to_bf16(&rng.vec(t * h, 1.0));
        let dy = DeviceBuffer::from_host(s, &dy_host).unwrap();
        poison_f32(&gpu, &b.d_gates);
        poison_f32(&gpu, &b.d_logits);
        r.combine_backward(s, &dy, &y, b).unwrap();
        let dyf = f64s_bf16(&dy_host);
        let want: Vec<f64> = (0..t * k)
            .map(|a| {
                let row = row_of[a] as usize;
                (0..h)
                    .map(|col| dyf[(a / k) * h + col] * yf[row * h + col])
                    .sum()
            })
            .collect();
        let d_gates = b.d_gates.to_vec(s).unwrap();
        assert_close(
            &format!("{label} d_gates"),
            &f64s(&d_gates),
            &want,
            1e-5,
            1e-6,
        );

        // The logits' gradient, from the device's d_gates.
        let rd = ref_dims(d);
        let want = rf::router_backward(
            &rd,
            &rf::RouterConfig::from(c.cfg),
            &run.reference,
            &f64s(&d_gates),
        )
        .unwrap();
        let d_logits = b.d_logits.to_vec(s).unwrap();
        assert_close(
            &format!("{label} d_logits"),
            &f64s(&d_logits),
            &want,
            1e-5,
            1e-7,
        );

        // Beside the kernel before it (the combine, which writes nothing it reads): the same
        // bits.
        poison_f32(&gpu, &b.d_gates);
        poison_f32(&gpu, &b.d_logits);
        r.combine(s, &y, b, &out).unwrap();
        r.combine_backward_beside_previous(s, &dy, &y, b).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&b.d_gates.to_vec(s).unwrap()),
            bits(&d_gates),
            "{label} d_gates beside the previous kernel"
        );
        assert_eq!(
            bits(&b.d_logits.to_vec(s).unwrap()),
            bits(&d_logits),
            "{label} d_logits beside the previous kernel"
        );

        // The input gradient.
        let dxp_host = to_bf16(&rng.vec(rows * h, 1.0));
        let dxp = DeviceBuffer::from_host(s, &dxp_host).unwrap();
        let dx = DeviceBuffer::from_host(s, &vec![bf16::NAN; t * h]).unwrap();
        r.input_backward(s, &dxp, &run.wr, b, &dx).unwrap();
        let dxpf = f64s_bf16(&dxp_host);
        let wrf = f64s(&run.wr_host);
        let dl = f64s(&d_logits);
        let got = f64s_bf16(&dx.to_vec(s).unwrap());
        for tok in 0..t {
            for col in 0..h {
                let mut w = 0.0;
                let mut mag = 0.0;
                for j in 0..k {
                    let v = dxpf[row_of[tok * k + j] as usize * h + col];
                    w += v;
                    mag += v.abs();
                }
                for ex in 0..e {
                    let v = dl[tok * e + ex] * wrf[ex * h + col];
                    w += v;
                    mag += v.abs();
                }
                let g = got[tok * h + col];
                assert!(
                    (g - w).abs() <= w.abs() * 2f64.powi(-8) + 1e-6 * mag + 1e-9,
                    "{label} dx[{tok}, {col}]: {g} vs {w}"
                );
            }
        }

        // The router weight's gradient, then accumulated once more (exactly twice).
        let dwr = DeviceBuffer::from_host(s, &vec![f32::NAN; e * h]).unwrap();
        r.weight_backward(s, &run.x, b, &dwr, false).unwrap();
        let xf = f64s_bf16(&run.x_host);
        let want: Vec<f64> = (0..e * h)
            .map(|q| {
                (0..t)
                    .map(|tok| dl[tok * e + q / h] * xf[tok * h + q % h])
                    .sum()
            })
            .collect();
        let once = dwr.to_vec(s).unwrap();
        assert_close(&format!("{label} dwr"), &f64s(&once), &want, 1e-5, 1e-7);
        r.weight_backward(s, &run.x, b, &dwr, true).unwrap();
        let twice = dwr.to_vec(s).unwrap();
        assert!(
            once.iter()
                .zip(&twice)
                .all(|(a, b)| (2.0 * a).to_bits() == b.to_bits()),
            "{label} accumulate"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn routing_is_deterministic_and_replays_in_a_graph() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("routing_is_deterministic_and_replays_in_a_graph");
    let c = case(777, 64, 32, 4, ScoreFn::Softmax, true);
    let d = c.dims;
    let s = &gpu.stream;
    let router = Router::new(s, d, c.cfg).unwrap();
    let b = RoutingBuffers::new(s, d).unwrap();
    let (x1, wr_host) = inputs(&mut rng, &c);
    let (x2, _) = inputs(&mut rng, &c);
    let x = DeviceBuffer::from_host(s, &x1).unwrap();
    let wr = DeviceBuffer::from_host(s, &wr_host).unwrap();
    let eager = |x_host: &[bf16]| {
        x.copy_from_host(s, x_host).unwrap();
        poison_routing(&gpu, &b);
        router.forward(s, &x, &wr, &b).unwrap();
        read_routing(&gpu, &b)
    };
    let bits = |r: &Routed| {
        let f = |v: &[f32]| v.iter().map(|x| x.to_bits() as i64).collect::<Vec<_>>();
        let i = |v: &[i32]| v.iter().map(|&x| i64::from(x)).collect::<Vec<_>>();
        [
            f(&r.logits),
            f(&r.probs),
            f(&r.lse),
            i(&r.topk),
            f(&r.gates),
            i(&r.counts),
            i(&r.offsets),
            i(&r.row_of),
            i(&r.token_of_row),
            f(&r.losses),
        ]
    };
    let first = bits(&eager(&x1));
    assert_eq!(bits(&eager(&x1)), first, "two eager runs");
    let second = bits(&eager(&x2));
    assert_ne!(second[3], first[3], "the two inputs route differently");
    // Thread-local: this binary's tests may run on parallel threads, whose API calls (an
    // allocation, a synchronisation) a global-mode capture would forbid and invalidate.
    let graph = s
        .capture(CaptureMode::ThreadLocal, |cs| {
            router.forward(cs.stream(), &x, &wr, &b)
        })
        .unwrap();
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
    for (input, want) in [(&x1, &first), (&x2, &second), (&x1, &first)] {
        x.copy_from_host(s, input).unwrap();
        poison_routing(&gpu, &b);
        exec.launch(s).unwrap();
        assert_eq!(&bits(&read_routing(&gpu, &b)), want, "graph replay");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn fused_casts_with_current_scaling() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("fused_casts_with_current_scaling");
    let c = case(300, 64, 8, 2, ScoreFn::Softmax, false);
    let run = route_and_check(&gpu, &mut rng, &c);
    let d = c.dims;
    let rows = d.capacity();
    let used = run.got.offsets[d.experts] as usize;
    let s = &gpu.stream;
    let used_at = RowsInUse::last(&run.b.offsets).unwrap();
    let tor = &run.got.token_of_row;
    let assignment = |r: usize| (tor[r] >= 0).then(|| tor[r] as usize);

    // The permute, E4M3: amax = max |x| (every token is in some row), scale = 448 / amax,
    // bytes bit for bit. The scale slot starts at a value the cast must not use.
    check_permute(&gpu, &run, d, CastScaling::Current, 1234.0);

    // SwiGLU, E5M2: the amax over the rows in use only (garbage past them must not count).
    let f = 32;
    let mut a_host = rng.vec(rows * 2 * f, 3.0);
    for r in 0..used {
        if assignment(r).is_none() {
            a_host[r * 2 * f..(r + 1) * 2 * f].fill(0.0);
        }
    }
    for r in used..rows {
        a_host[r * 2 * f..(r + 1) * 2 * f].fill(1e4);
    }
    let a_host = to_bf16(&a_host);
    let a = DeviceBuffer::from_host(s, &a_host).unwrap();
    let h_ref = rf::swiglu(&f64s_bf16(&a_host), f).unwrap();
    let (out, out_t) = fp8_out(&gpu, rows, f, Fp8Format::E5M2, 1234.0);
    let dst = FusedCastOut::new(&out, &out_t).scaling(CastScaling::Current);
    swiglu_cast_transpose(s, &a, (rows, f), used_at, dst).unwrap();
    let amax_ref = h_ref[..used * f].iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let amax = out.amax().read(s).unwrap();
    assert!(
        (f64::from(amax) - amax_ref).abs() <= 1e-5 * amax_ref,
        "swiglu amax {amax}"
    );
    let scale = 57344.0 / amax;
    assert_eq!(out.scale().read(s).unwrap(), scale, "current swiglu scale");
    let (y, yt) = (out.data().to_vec(s).unwrap(), out_t.to_vec(s).unwrap());
    check_packed(
        "current swiglu",
        &y,
        &yt,
        rows,
        f,
        used,
        |r, col| h_ref[r * f + col],
        |b, v| fp8_near(b, v * f64::from(scale), Fp8Format::E5M2),
    );
}
