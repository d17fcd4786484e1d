//! The packed fc1 GEMM with the SwiGLU cast fused into its epilogue
//! ([`grouped_gemm_packed_swiglu`]) against the two kernels it stands for
//! ([`grouped_gemm_packed`] then [`swiglu_cast_transpose`] over the rows below
//! `offsets[groups]`), on fresh random data (the seed is printed): D, the row-major and the
//! transposed FP8 output, amax and scale_inv bit for bit, every output poisoned first (so
//! what neither writes must stay poison in both). The function is captured into a graph
//! and the graph's kernel nodes counted: one where the fused sm_90a kernel takes the problem
//! (`GemmPath::Hopper`, E4M3, delayed scaling, F a multiple of 64), the separate kernels
//! otherwise. How close D and the SwiGLU are to fp64 is the business of `grouped_packed.rs`
//! and the root package's `moe_kernels.rs`, which test those two kernels; equality with them
//! carries it over. GPU tests are `#[ignore]`d; run them with `cargo test -p fp8-kernels
//! --test packed_swiglu -- --include-ignored` on an H100/H200.

use std::time::{SystemTime, UNIX_EPOCH};

use cuda_graph::half::bf16;
use cuda_graph::{Context, DeviceBuffer, GraphExec, InstantiateFlags, NodeKind, Stream};
use fp8_kernels::gemm::{
    ALIGN_ROWS, GemmOptions, GemmPath, GroupedOperand, Operand, PackedShape, grouped_gemm_packed,
    grouped_gemm_packed_swiglu,
};
use fp8_kernels::reference as r;
use fp8_kernels::{
    CastScaling, DType, DeviceScalar, Fp8Format, Fp8Tensor, FusedCastOut, RowsInUse,
    swiglu_cast_transpose,
};

mod common;
use common::{BiasBuf, Rng, capture, setup};

const E4: Fp8Format = Fp8Format::E4M3;
/// The poison of the FP8 outputs (a NaN in E4M3) and of D (a bf16 NaN).
const POISON_U8: u8 = 0x7f;
const POISON_BF16: u16 = 0x7fc1;

#[derive(Clone, Debug)]
struct Case {
    name: &'static str,
    /// Real rows per group (each group padded to a multiple of ALIGN_ROWS with zero rows).
    counts: Vec<usize>,
    /// Tiles of rows past `offsets[groups]` (NaN bytes in A: never read).
    slack: usize,
    ffn: usize,
    k: usize,
    fast: bool,
    bias: bool,
    scaling: CastScaling,
}

impl Case {
    fn new(name: &'static str, counts: &[usize], ffn: usize, k: usize) -> Case {
        Case {
            name,
            counts: counts.to_vec(),
            slack: 1,
            ffn,
            k,
            fast: true,
            bias: false,
            scaling: CastScaling::Delayed,
        }
    }

    /// Whether the fused kernel takes the case on an sm_90a device (see the module docs).
    fn fused(&self) -> bool {
        self.scaling == CastScaling::Delayed && self.ffn % 64 == 0
    }
}

/// The outputs of one run: D, h, h^T (as bits) and the bits of amax and scale_inv.
#[derive(PartialEq)]
struct Outputs {
    d: Vec<u16>,
    h: Vec<u8>,
    h_t: Vec<u8>,
    amax: u32,
    scale_inv: u32,
}

/// Poisoned outputs for a `[capacity, 2F]` D and `[capacity, F]` h with cast scale `scale`.
fn outputs(
    stream: &Stream,
    capacity: usize,
    ffn: usize,
    scale: f32,
) -> (DeviceBuffer<bf16>, Fp8Tensor, DeviceBuffer<u8>) {
    let d = DeviceBuffer::from_host(
        stream,
        &vec![bf16::from_bits(POISON_BF16); capacity * 2 * ffn],
    )
    .unwrap();
    let h = Fp8Tensor::new(stream, &[capacity, ffn], E4).unwrap();
    h.data().memset_bytes(stream, POISON_U8).unwrap();
    h.scale().write(stream, scale).unwrap();
    h.scale_inv().write(stream, f32::NAN).unwrap();
    h.amax().write(stream, 0.0).unwrap();
    let h_t = DeviceBuffer::<u8>::alloc(stream.context(), capacity * ffn).unwrap();
    h_t.memset_bytes(stream, POISON_U8).unwrap();
    (d, h, h_t)
}

fn read(stream: &Stream, d: &DeviceBuffer<bf16>, h: &Fp8Tensor, h_t: &DeviceBuffer<u8>) -> Outputs {
    Outputs {
        d: d.to_vec(stream)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        h: h.data().to_vec(stream).unwrap(),
        h_t: h_t.to_vec(stream).unwrap(),
        amax: h.amax().read(stream).unwrap().to_bits(),
        scale_inv: h.scale_inv().read(stream).unwrap().to_bits(),
    }
}

fn check(ctx: &std::sync::Arc<Context>, stream: &Stream, c: &Case, seed: u64) {
    let what = format!(
        "{} (F = {}, K = {}, fast {}, bias {}, {:?})",
        c.name, c.ffn, c.k, c.fast, c.bias, c.scaling
    );
    let mut rng = Rng::new(seed);
    let (groups, f, k) = (c.counts.len(), c.ffn, c.k);
    let mut offsets = vec![0i32];
    for &n in &c.counts {
        let last = *offsets.last().unwrap() as usize;
        offsets.push((last + n.div_ceil(ALIGN_ROWS) * ALIGN_ROWS) as i32);
    }
    let used = *offsets.last().unwrap() as usize;
    let capacity = used + c.slack * ALIGN_ROWS;
    // A: small values in the real rows (D of order 1 with sa = 1 / sqrt(K)), zeros in the
    // padding rows, NaN bytes past the rows in use.
    let mut a = vec![POISON_U8; capacity * k];
    for g in 0..groups {
        let r0 = offsets[g] as usize;
        for i in 0..offsets[g + 1] as usize - r0 {
            let row = &mut a[(r0 + i) * k..(r0 + i + 1) * k];
            if i < c.counts[g] {
                row.iter_mut()
                    .for_each(|b| *b = r::encode(2.0 * rng.unit(), E4));
            } else {
                row.fill(0);
            }
        }
    }
    let b: Vec<u8> = (0..groups * 2 * f * k)
        .map(|_| r::encode(2.0 * rng.unit(), E4))
        .collect();
    let a = DeviceBuffer::from_host(stream, &a).unwrap();
    let b = DeviceBuffer::from_host(stream, &b).unwrap();
    let offsets = DeviceBuffer::from_host(stream, &offsets).unwrap();
    let sa = DeviceScalar::new(stream, 1.0 / (k as f32).sqrt()).unwrap();
    let sbg: Vec<f32> = (0..groups).map(|_| 0.5 + rng.unit().abs()).collect();
    let sbg = DeviceBuffer::from_host(stream, &sbg).unwrap();
    let bias_vals: Vec<f32> = (0..2 * f).map(|_| rng.unit()).collect();
    let (bias, _) = BiasBuf::new(stream, DType::Bf16, &bias_vals);
    let shape = PackedShape {
        groups,
        capacity,
        n: 2 * f,
        k,
    };
    let opts = || {
        let o = GemmOptions::new()
            .path(GemmPath::Hopper)
            .fast_accumulation(c.fast);
        if c.bias { o.bias(bias.view()) } else { o }
    };
    let x = || Operand {
        data: &a,
        format: E4,
        scale_inv: &sa,
    };
    let w = || GroupedOperand::per_group(&b, E4, &sbg);
    let scale = 48.0;

    // The two kernels.
    let (d0, h0, h0_t) = outputs(stream, capacity, f, scale);
    grouped_gemm_packed(stream, shape, x(), w(), &d0, &offsets, opts()).unwrap();
    let used_rows = RowsInUse::last(&offsets).unwrap();
    let dst = FusedCastOut::new(&h0, &h0_t).scaling(c.scaling);
    swiglu_cast_transpose(stream, &d0, (capacity, f), used_rows, dst).unwrap();
    let want = read(stream, &d0, &h0, &h0_t);

    // The fused entry point, captured (its kernel nodes counted) and replayed.
    let (d1, h1, h1_t) = outputs(stream, capacity, f, scale);
    let graph = capture(ctx, stream, || {
        let dst = FusedCastOut::new(&h1, &h1_t).scaling(c.scaling);
        grouped_gemm_packed_swiglu(stream, shape, x(), w(), &d1, &offsets, opts(), dst)
    });
    let kernels = graph
        .nodes()
        .unwrap()
        .iter()
        .filter(|n| n.kind == NodeKind::Kernel)
        .count();
    if c.fused() {
        assert_eq!(kernels, 1, "{what}: the fused kernel alone");
    } else {
        assert!(
            kernels >= 2,
            "{what}: the separate kernels, got {kernels} launches"
        );
    }
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
    exec.launch(stream).unwrap();
    let got = read(stream, &d1, &h1, &h1_t);

    // Something was computed (the test can fail): rows in use written, amax positive.
    assert!(
        want.d[..used * 2 * f].iter().all(|&x| x != POISON_BF16) || used == 0,
        "{what}: D written"
    );
    assert!(
        used == 0 || f32::from_bits(want.amax) > 0.0,
        "{what}: amax of real rows"
    );
    assert!(
        want.h[used * f..].iter().all(|&x| x == POISON_U8),
        "{what}: rows past the ones in use untouched"
    );
    for (name, same) in [
        ("D", got.d == want.d),
        ("h", got.h == want.h),
        ("h^T", got.h_t == want.h_t),
        ("amax", got.amax == want.amax),
        ("scale_inv", got.scale_inv == want.scale_inv),
    ] {
        if !same {
            let first = |x: &[u8], y: &[u8]| x.iter().zip(y).position(|(a, b)| a != b);
            panic!(
                "{what} (seed {seed}): {name} differs from the two kernels' (first h byte at {:?}, h^T at {:?}; amax {:e} / {:e})",
                first(&got.h, &want.h),
                first(&got.h_t, &want.h_t),
                f32::from_bits(got.amax),
                f32::from_bits(want.amax)
            );
        }
    }
}

fn seed() -> u64 {
    let s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    println!("seed {s}");
    s
}

#[test]
#[ignore = "needs a CUDA device"]
fn fused_swiglu_equals_the_two_kernels() {
    let (ctx, stream) = setup();
    assert_eq!(
        ctx.device().compute_capability().unwrap(),
        (9, 0),
        "the fused kernel is sm_90a code: run this test on an H100/H200"
    );
    let base = seed();
    let layer = [70, 61, 66, 58, 64, 73, 55, 65]; // T = 256, top-2, 8 experts
    let mut cases = vec![
        Case::new("layer-like", &layer, 2048, 2048),
        Case::new(
            "skewed, empty first and last",
            &[0, 700, 3, 0, 129, 0],
            128,
            256,
        ),
        Case::new("one group holds every row", &[0, 0, 513, 0], 256, 128),
        Case::new("every group empty", &[0, 0, 0], 128, 128),
        // F = 192: the 256-wide tile's halves do not divide F, so the 128-wide one runs.
        Case::new("F = 192", &[300, 20, 140], 192, 384),
        Case::new("F = 64", &[90, 0, 200], 64, 128),
        // Not fused: F not a multiple of 64; current scaling.
        Case::new("F = 80", &[90, 0, 200], 80, 128),
        Case {
            scaling: CastScaling::Current,
            ..Case::new("current scaling", &[90, 0, 200], 128, 128)
        },
    ];
    for fast in [false, true] {
        cases.push(Case {
            fast,
            bias: true,
            ..Case::new("bias", &[150, 0, 260, 1], 128, 256)
        });
        cases.push(Case {
            fast,
            ..Case::new("many tiles", &[1000, 800, 1200, 900], 512, 512)
        });
    }
    for (i, c) in cases.iter().enumerate() {
        check(&ctx, &stream, c, base.wrapping_add(i as u64));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn fused_swiglu_refuses_bad_arguments_and_writes_nothing() {
    let (_ctx, stream) = setup();
    let (groups, capacity, f, k) = (2, 256, 64, 128);
    let a = DeviceBuffer::from_host(&stream, &vec![0x38u8; capacity * k]).unwrap();
    let b = DeviceBuffer::from_host(&stream, &vec![0x38u8; groups * 2 * f * k]).unwrap();
    let offsets = DeviceBuffer::from_host(&stream, &[0i32, 128, 256]).unwrap();
    let sa = DeviceScalar::new(&stream, 1.0).unwrap();
    let sbg = DeviceBuffer::from_host(&stream, &[1.0f32, 1.0]).unwrap();
    let (d, h, h_t) = outputs(&stream, capacity, f, 1.0);
    let before = read(&stream, &d, &h, &h_t);
    let small = Fp8Tensor::new(&stream, &[capacity, f / 2], E4).unwrap();
    let odd = PackedShape {
        groups,
        capacity,
        n: 2 * f - 2,
        k,
    };
    let ok = PackedShape {
        groups,
        capacity,
        n: 2 * f,
        k,
    };
    let x = Operand {
        data: &a,
        format: E4,
        scale_inv: &sa,
    };
    let w = || GroupedOperand::per_group(&b, E4, &sbg);
    let opts = GemmOptions::new().path(GemmPath::Hopper);
    let cases: Vec<(&str, PackedShape, FusedCastOut<'_>, &str)> = vec![
        (
            "N not 2F with F a multiple of 16",
            odd,
            FusedCastOut::new(&h, &h_t),
            "multiple of 16",
        ),
        (
            "h of the wrong shape",
            ok,
            FusedCastOut::new(&small, &h_t),
            "shape",
        ),
        (
            "h^T of the wrong size",
            ok,
            FusedCastOut::new(&h, &a),
            "transposed",
        ),
    ];
    for (name, shape, dst, fragment) in cases {
        let err = grouped_gemm_packed_swiglu(&stream, shape, x, w(), &d, &offsets, opts, dst)
            .expect_err(name)
            .to_string();
        assert!(
            err.contains("grouped_gemm_packed_swiglu") && err.contains(fragment),
            "{name}: {err}"
        );
    }
    assert!(
        read(&stream, &d, &h, &h_t) == before,
        "a refused call wrote something"
    );
}
