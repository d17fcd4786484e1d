//! FP8 GEMM tests. CPU: the fp64 reference on hand-checked cases (also in the crate's unit
//! tests). GPU (`#[ignore]`d here; run with `cargo test -p fp8-kernels --test gemm --
//! --include-ignored` on a CUDA machine): every entry point against the fp64 CPU reference
//! (small shapes) or the GPU fp32 reference kernel (large shapes), on fresh random FP8 bytes
//! (every finite value, NaN and inf excluded), outputs poisoned (all-ones bytes, a NaN)
//! first, on `GemmPath::Portable` and `GemmPath::Auto`.
//!
//! Error bounds, as `max |got - want| / max |want|` against the unrounded fp64 reference:
//! FP8 x FP8 products are exact in fp32, so the only error is fp32 accumulation order and
//! the output rounding: f32 output < 1e-5, bf16 output < 8e-3 (bf16 rounding alone is up to
//! 2^-9 = 1.95e-3 of the largest value). `GemmPath::Auto` runs the sm_90a wgmma path on
//! Hopper, whose tensor cores keep about 14 bits within each 128-deep slice of K before the
//! promotion into fp32 (fp8.md): there f32 output is held to < 2e-3 (4.3e-4 seen).

use std::sync::Arc;

use cuda_graph::{
    CaptureMode, Context, DeviceBuffer, Error, GraphExec, InstantiateFlags, Result, Stream,
};
use fp8_kernels::gemm::reference::{RefGemm, RefScaling, gemm_f64, rel_error};
use fp8_kernels::gemm::{
    Bias, BlockOperand, GemmOptions, GemmPath, GemmShape, GroupedShape, Operand, gemm,
    gemm_blockwise, gemm_reference, grouped_gemm,
};
use fp8_kernels::reference as r;

mod common;
use common::{BiasBuf, Out, Rng, setup};
use fp8_kernels::{BlockShape, DType, DeviceScalar, Fp8Format, HpBuffer, quantize_blockwise};

const E4: Fp8Format = Fp8Format::E4M3;
const E5: Fp8Format = Fp8Format::E5M2;
const F32_BOUND: f64 = 1e-5;
/// f32-output bound of a path that may use Hopper's FP8 tensor cores (see the module docs).
const TENSOR_CORE_F32_BOUND: f64 = 2e-3;
const BF16_BOUND: f64 = 8e-3;
const PATHS: [GemmPath; 2] = [GemmPath::Portable, GemmPath::Auto];

fn bound(out: DType, path: GemmPath) -> f64 {
    match (out, path) {
        (DType::F32, GemmPath::Portable) => F32_BOUND,
        (DType::F32, _) => TENSOR_CORE_F32_BOUND,
        _ => BF16_BOUND,
    }
}

/// One plain-GEMM case.
#[derive(Debug, Clone, Copy)]
struct Case {
    m: usize,
    n: usize,
    k: usize,
    fa: Fp8Format,
    fb: Fp8Format,
    out: DType,
    bias: Option<DType>,
    accumulate: bool,
    path: GemmPath,
    seed: u64,
}

impl Case {
    fn new(m: usize, n: usize, k: usize) -> Case {
        Case {
            m,
            n,
            k,
            fa: E4,
            fb: E4,
            out: DType::F32,
            bias: None,
            accumulate: false,
            path: GemmPath::Portable,
            seed: (m * 1_000_003 + n * 1009 + k) as u64,
        }
    }
}

/// Runs `c` on the GPU and checks it against the fp64 CPU reference.
fn check_case(ctx: &Arc<Context>, stream: &Stream, c: Case) {
    let mut rng = Rng::new(c.seed ^ (c.out as u64) << 40 ^ (c.fa as u64) << 48);
    let a_h = rng.bytes(c.m * c.k, c.fa);
    let b_h = rng.bytes(c.n * c.k, c.fb);
    let (sa, sb) = (0.37f32, 1.5f32);
    let a = DeviceBuffer::from_host(stream, &a_h).unwrap();
    let b = DeviceBuffer::from_host(stream, &b_h).unwrap();
    let sa_d = DeviceScalar::new(stream, sa).unwrap();
    let sb_d = DeviceScalar::new(stream, sb).unwrap();
    let bias_vals: Vec<f32> = (0..c.n).map(|_| rng.unit() * 1000.0).collect();
    let bias = c.bias.map(|dt| BiasBuf::new(stream, dt, &bias_vals));
    let mut d = Out::new(ctx, c.out, c.m * c.n);
    let prev = if c.accumulate {
        let xs: Vec<f32> = (0..c.m * c.n).map(|_| rng.unit() * 5000.0).collect();
        Some(d.fill(stream, &xs))
    } else {
        d.poison(stream);
        None
    };
    let mut opts = GemmOptions::new().accumulate(c.accumulate).path(c.path);
    if let Some((bb, _)) = &bias {
        opts = opts.bias(bb.view());
    }
    gemm(
        stream,
        GemmShape::new(c.m, c.n, c.k),
        Operand {
            data: &a,
            format: c.fa,
            scale_inv: &sa_d,
        },
        Operand {
            data: &b,
            format: c.fb,
            scale_inv: &sb_d,
        },
        d.view(),
        opts,
    )
    .unwrap_or_else(|e| panic!("{c:?}: gemm failed: {e}"));
    stream.synchronize().unwrap();
    let got = d.values(stream);
    let want = gemm_f64(&RefGemm {
        m: c.m,
        n: c.n,
        k: c.k,
        a: &a_h,
        a_format: c.fa,
        b: &b_h,
        b_format: c.fb,
        scaling: RefScaling::Tensor { a: sa, b: sb },
        bias: bias.as_ref().map(|(_, w)| w.as_slice()),
        d: prev.as_deref(),
    });
    let bad = got.iter().position(|v| !v.is_finite());
    assert!(
        bad.is_none(),
        "{c:?}: element {bad:?} not finite (poison left?)"
    );
    let e = rel_error(&got, &want);
    assert!(
        e < bound(c.out, c.path),
        "{c:?}: relative error {e:e} >= {}",
        bound(c.out, c.path)
    );
}

/// Small odd and tall/skinny shapes, E4M3 x E4M3, both outputs, both paths.
#[test]
#[ignore = "needs a CUDA device"]
fn gemm_matches_fp64_reference_on_odd_and_skinny_shapes() {
    let (ctx, stream) = setup();
    for (m, n, k) in [
        (1, 8, 16),
        (77, 40, 48),
        (130, 136, 272),
        (4096, 16, 256),
        (16, 4096, 256),
    ] {
        for out in [DType::F32, DType::Bf16] {
            for path in PATHS {
                check_case(
                    &ctx,
                    &stream,
                    Case {
                        out,
                        path,
                        ..Case::new(m, n, k)
                    },
                );
            }
        }
    }
}

/// Every format combination (E5M2 x E4M3 for gradients first).
#[test]
#[ignore = "needs a CUDA device"]
fn gemm_mixed_formats() {
    let (ctx, stream) = setup();
    for (fa, fb) in [(E5, E4), (E4, E5), (E5, E5)] {
        for (m, n, k) in [(77, 40, 48), (130, 136, 272)] {
            for out in [DType::F32, DType::Bf16] {
                for path in PATHS {
                    check_case(
                        &ctx,
                        &stream,
                        Case {
                            fa,
                            fb,
                            out,
                            path,
                            ..Case::new(m, n, k)
                        },
                    );
                }
            }
        }
    }
}

/// Bias (f32 and bf16) and accumulation into D (f32 and bf16), alone and together.
#[test]
#[ignore = "needs a CUDA device"]
fn gemm_bias_and_accumulate() {
    let (ctx, stream) = setup();
    for (m, n, k) in [(77, 40, 48), (130, 136, 272)] {
        for out in [DType::F32, DType::Bf16] {
            for bias in [None, Some(DType::F32), Some(DType::Bf16)] {
                for accumulate in [false, true] {
                    for path in PATHS {
                        let c = Case {
                            out,
                            bias,
                            accumulate,
                            path,
                            ..Case::new(m, n, k)
                        };
                        check_case(&ctx, &stream, c);
                    }
                }
            }
        }
    }
}

/// A large GEMM against the GPU fp32 reference kernel (both with f32 output; the reference
/// is also checked against the CPU on a sample of rows).
#[test]
#[ignore = "needs a CUDA device"]
fn gemm_large_matches_gpu_reference() {
    let (ctx, stream) = setup();
    let (m, n, k) = (1024, 1536, 2048);
    for (fa, fb) in [(E4, E4), (E5, E4)] {
        let mut rng = Rng::new(99 + fa as u64);
        let a_h = rng.bytes(m * k, fa);
        let b_h = rng.bytes(n * k, fb);
        let a = DeviceBuffer::from_host(&stream, &a_h).unwrap();
        let b = DeviceBuffer::from_host(&stream, &b_h).unwrap();
        let sa = DeviceScalar::new(&stream, 0.25).unwrap();
        let sb = DeviceScalar::new(&stream, 3.0).unwrap();
        let oa = Operand {
            data: &a,
            format: fa,
            scale_inv: &sa,
        };
        let ob = Operand {
            data: &b,
            format: fb,
            scale_inv: &sb,
        };
        let mut want = Out::new(&ctx, DType::F32, m * n);
        want.poison(&stream);
        gemm_reference(
            &stream,
            GemmShape::new(m, n, k),
            oa,
            ob,
            want.view(),
            GemmOptions::new(),
        )
        .unwrap();
        stream.synchronize().unwrap();
        let want = want.values(&stream);
        // The oracle itself, on 4 rows, against the CPU.
        for row in [0, 1, 511, 1023] {
            let cpu = gemm_f64(&RefGemm {
                m: 1,
                n,
                k,
                a: &a_h[row * k..(row + 1) * k],
                a_format: fa,
                b: &b_h,
                b_format: fb,
                scaling: RefScaling::Tensor { a: 0.25, b: 3.0 },
                bias: None,
                d: None,
            });
            let e = rel_error(&want[row * n..(row + 1) * n], &cpu);
            assert!(
                e < F32_BOUND,
                "{fa:?}x{fb:?}: GPU reference row {row}: error {e:e}"
            );
        }
        let want64: Vec<f64> = want.iter().map(|&x| f64::from(x)).collect();
        for out in [DType::F32, DType::Bf16] {
            for path in PATHS {
                let mut d = Out::new(&ctx, out, m * n);
                d.poison(&stream);
                gemm(
                    &stream,
                    GemmShape::new(m, n, k),
                    oa,
                    ob,
                    d.view(),
                    GemmOptions::new().path(path),
                )
                .unwrap();
                stream.synchronize().unwrap();
                let e = rel_error(&d.values(&stream), &want64);
                assert!(
                    e < bound(out, path),
                    "{m}x{n}x{k} {fa:?}x{fb:?} {out:?} {path:?}: error {e:e} vs GPU reference"
                );
            }
        }
    }
}

/// Grouped GEMM: counts include 0 and m_max; rows at or beyond a count keep their poison;
/// captured into a graph and replayed with the counts changed between replays.
#[test]
#[ignore = "needs a CUDA device"]
fn grouped_gemm_in_a_graph_with_changing_counts() {
    let (ctx, stream) = setup();
    let (groups, m_max, n, k) = (4usize, 200usize, 72usize, 80usize);
    for path in PATHS {
        for out in [DType::F32, DType::Bf16] {
            let mut rng = Rng::new(7 + out as u64);
            let a_h = rng.bytes(groups * m_max * k, E4);
            let b_h = rng.bytes(groups * n * k, E4);
            let a = DeviceBuffer::from_host(&stream, &a_h).unwrap();
            let b = DeviceBuffer::from_host(&stream, &b_h).unwrap();
            let sa = DeviceScalar::new(&stream, 0.5).unwrap();
            let sb = DeviceScalar::new(&stream, 0.75).unwrap();
            let bias_vals: Vec<f32> = (0..n).map(|_| rng.unit() * 100.0).collect();
            let (bias, bias_w) = BiasBuf::new(&stream, DType::F32, &bias_vals);
            let counts = DeviceBuffer::<i32>::from_host(&stream, &[0, 0, 0, 0]).unwrap();
            let mut d = Out::new(&ctx, out, groups * m_max * n);
            let opts = GemmOptions::new().bias(bias.view()).path(path);
            let graph = stream
                .capture(CaptureMode::ThreadLocal, |s| {
                    grouped_gemm(
                        s.stream(),
                        GroupedShape {
                            groups,
                            m_max,
                            n,
                            k,
                        },
                        Operand {
                            data: &a,
                            format: E4,
                            scale_inv: &sa,
                        },
                        Operand {
                            data: &b,
                            format: E4,
                            scale_inv: &sb,
                        },
                        d.view(),
                        &counts,
                        opts,
                    )
                })
                .unwrap();
            assert_eq!(
                graph.nodes().unwrap().len(),
                1,
                "grouped GEMM is one launch"
            );
            let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
            for cs in [
                [0, 200, 37, 129],
                [200, 0, 1, 128],
                [5, 17, 200, 0],
                [-3, 250, 64, 65],
            ] {
                counts.copy_from_host(&stream, &cs).unwrap();
                d.poison(&stream);
                exec.launch(&stream).unwrap();
                stream.synchronize().unwrap();
                let bits = d.bits(&stream);
                let vals = d.values(&stream);
                for (g, &c) in cs.iter().enumerate() {
                    let rows = c.clamp(0, m_max as i32) as usize;
                    let base = g * m_max * n;
                    if rows > 0 {
                        let want = gemm_f64(&RefGemm {
                            m: rows,
                            n,
                            k,
                            a: &a_h[g * m_max * k..(g * m_max + rows) * k],
                            a_format: E4,
                            b: &b_h[g * n * k..(g + 1) * n * k],
                            b_format: E4,
                            scaling: RefScaling::Tensor { a: 0.5, b: 0.75 },
                            bias: Some(&bias_w),
                            d: None,
                        });
                        let e = rel_error(&vals[base..base + rows * n], &want);
                        assert!(
                            e < bound(out, path),
                            "{path:?} {out:?} counts {cs:?} group {g}: error {e:e}"
                        );
                    }
                    let tail = &bits[base + rows * n..base + m_max * n];
                    let p = tail.iter().position(|&x| x != d.poison_bits());
                    assert!(
                        p.is_none(),
                        "{path:?} {out:?} counts {cs:?} group {g}: row {} >= count written",
                        rows + p.unwrap_or(0) / n
                    );
                }
            }
        }
    }
}

/// Block-scaled GEMM on data from `quantize_blockwise` (1x128 for A, 128x128 for B), on the
/// portable path and on `Auto` (the sm_90a kernel for the E4M3 pairs on an H200).
#[test]
#[ignore = "needs a CUDA device"]
fn blockwise_gemm_matches_fp64_reference() {
    let (ctx, stream) = setup();
    for (m, n, k, fa, fb) in [
        (77, 200, 272, E4, E4),
        (130, 136, 256, E4, E4),
        (64, 257, 400, E5, E4),
        (1, 8, 16, E4, E4),
    ] {
        let mut rng = Rng::new((m * n + k) as u64);
        // Rows of very different magnitudes, so the block scales differ.
        let xa: Vec<f32> = (0..m * k)
            .map(|i| rng.unit() * 2f32.powi((i / k % 13) as i32 - 6))
            .collect();
        let xb: Vec<f32> = (0..n * k)
            .map(|i| rng.unit() * 2f32.powi((i % k / 128 % 5) as i32 - 2))
            .collect();
        let xa_d = DeviceBuffer::from_host(&stream, &xa).unwrap();
        let xb_d = DeviceBuffer::from_host(&stream, &xb).unwrap();
        let a = DeviceBuffer::<u8>::alloc(&ctx, m * k).unwrap();
        let b = DeviceBuffer::<u8>::alloc(&ctx, n * k).unwrap();
        let sa = DeviceBuffer::<f32>::alloc(&ctx, BlockShape::Row1x128.scales_len(m, k)).unwrap();
        let sb =
            DeviceBuffer::<f32>::alloc(&ctx, BlockShape::Tile128x128.scales_len(n, k)).unwrap();
        quantize_blockwise(
            &stream,
            HpBuffer::F32(&xa_d),
            m,
            k,
            BlockShape::Row1x128,
            fa,
            &a,
            &sa,
        )
        .unwrap();
        quantize_blockwise(
            &stream,
            HpBuffer::F32(&xb_d),
            n,
            k,
            BlockShape::Tile128x128,
            fb,
            &b,
            &sb,
        )
        .unwrap();
        stream.synchronize().unwrap();
        let (a_h, b_h) = (a.to_vec(&stream).unwrap(), b.to_vec(&stream).unwrap());
        let (sa_h, sb_h) = (sa.to_vec(&stream).unwrap(), sb.to_vec(&stream).unwrap());
        for (out, path) in [DType::F32, DType::Bf16]
            .into_iter()
            .flat_map(|o| PATHS.map(|p| (o, p)))
        {
            for accumulate in [false, true] {
                let mut d = Out::new(&ctx, out, m * n);
                let prev = if accumulate {
                    let xs: Vec<f32> = (0..m * n).map(|_| rng.unit() * 10.0).collect();
                    Some(d.fill(&stream, &xs))
                } else {
                    d.poison(&stream);
                    None
                };
                gemm_blockwise(
                    &stream,
                    GemmShape::new(m, n, k),
                    BlockOperand {
                        data: &a,
                        format: fa,
                        scales_inv: &sa,
                    },
                    BlockOperand {
                        data: &b,
                        format: fb,
                        scales_inv: &sb,
                    },
                    d.view(),
                    GemmOptions::new().accumulate(accumulate).path(path),
                )
                .unwrap();
                stream.synchronize().unwrap();
                let want = gemm_f64(&RefGemm {
                    m,
                    n,
                    k,
                    a: &a_h,
                    a_format: fa,
                    b: &b_h,
                    b_format: fb,
                    scaling: RefScaling::Block { a: &sa_h, b: &sb_h },
                    bias: None,
                    d: prev.as_deref(),
                });
                let e = rel_error(&d.values(&stream), &want);
                assert!(
                    e < bound(out, path),
                    "blockwise {path:?} {m}x{n}x{k} {fa:?}x{fb:?} {out:?} acc {accumulate}: \
                     error {e:e}"
                );
            }
        }
    }
}

/// `GemmPath::Hopper` takes the sm_90a block-scaled kernel for E4M3 pairs (the same bits as
/// `Auto` there, which shows `Auto` took it too; within the bf16 bound of the fp64 reference)
/// and refuses an E5M2 operand rather than running it elsewhere.
#[test]
#[ignore = "needs a CUDA device"]
fn blockwise_hopper_path() {
    let (ctx, stream) = setup();
    let (m, n, k) = (130usize, 264usize, 400usize);
    let kb = k.div_ceil(128);
    let mut rng = Rng::new(77);
    let a_h = rng.bytes(m * k, E4);
    let b_h = rng.bytes(n * k, E4);
    let sa_h: Vec<f32> = (0..m * kb).map(|_| 0.25 + rng.unit()).collect();
    let sb_h: Vec<f32> = (0..n.div_ceil(128) * kb)
        .map(|_| 0.25 + rng.unit())
        .collect();
    let up8 = |v: &[u8]| DeviceBuffer::from_host(&stream, v).unwrap();
    let up32 = |v: &[f32]| DeviceBuffer::from_host(&stream, v).unwrap();
    let (a, b, sa, sb) = (up8(&a_h), up8(&b_h), up32(&sa_h), up32(&sb_h));
    let run = |path: GemmPath, fa: Fp8Format| {
        let mut d = Out::new(&ctx, DType::Bf16, m * n);
        d.poison(&stream);
        let r = gemm_blockwise(
            &stream,
            GemmShape::new(m, n, k),
            BlockOperand {
                data: &a,
                format: fa,
                scales_inv: &sa,
            },
            BlockOperand {
                data: &b,
                format: E4,
                scales_inv: &sb,
            },
            d.view(),
            GemmOptions::new().path(path),
        );
        stream.synchronize().unwrap();
        r.map(|()| d.values(&stream))
    };
    let hopper = run(GemmPath::Hopper, E4).expect("the sm_90a block-scaled kernel");
    let auto = run(GemmPath::Auto, E4).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&hopper), bits(&auto), "Auto takes the sm_90a kernel");
    let want = gemm_f64(&RefGemm {
        m,
        n,
        k,
        a: &a_h,
        a_format: E4,
        b: &b_h,
        b_format: E4,
        scaling: RefScaling::Block { a: &sa_h, b: &sb_h },
        bias: None,
        d: None,
    });
    let e = rel_error(&hopper, &want);
    assert!(e < BF16_BOUND, "sm_90a block-scaled: error {e:e}");
    assert!(matches!(
        run(GemmPath::Hopper, E5),
        Err(cuda_graph::Error::InvalidArgument(_))
    ));
}

/// Bad arguments are rejected with InvalidArgument before any launch: D keeps its poison.
#[test]
#[ignore = "needs a CUDA device"]
fn bad_shapes_are_rejected_and_nothing_is_written() {
    let (ctx, stream) = setup();
    let (m, n, k) = (32usize, 24usize, 48usize);
    let a = DeviceBuffer::<u8>::alloc(&ctx, 2 * m * k).unwrap();
    let b = DeviceBuffer::<u8>::alloc(&ctx, 2 * n * k).unwrap();
    let s = DeviceScalar::new(&stream, 1.0).unwrap();
    let bias = DeviceBuffer::<f32>::alloc(&ctx, n + 1).unwrap();
    let counts = DeviceBuffer::<i32>::from_host(&stream, &[1, 2, 3]).unwrap();
    let mut d = Out::new(&ctx, DType::F32, 2 * m * n);
    d.poison(&stream);
    let a_short = DeviceBuffer::<u8>::alloc(&ctx, m * k - 16).unwrap();
    let sc = DeviceBuffer::<f32>::alloc(&ctx, 4).unwrap();
    let op = |data| Operand {
        data,
        format: E4,
        scale_inv: &s,
    };
    let plain = |m: usize, n: usize, k: usize, a, opts| {
        gemm(
            &stream,
            GemmShape::new(m, n, k),
            op(a),
            op(&b),
            d.view(),
            opts,
        )
    };
    let none = GemmOptions::new().path(GemmPath::Portable);
    let results: Vec<(&str, Result<()>)> = vec![
        ("lengths (buffers of 2 x M)", plain(m, n, k, &a, none)),
        ("K % 16", plain(2 * m, n, 40, &a, none)),
        ("M = 0", plain(0, n, k, &a, none)),
        ("A short", plain(m, n, k, &a_short, none)),
        (
            "bias length",
            gemm(
                &stream,
                GemmShape::new(2 * m, n, k),
                op(&a),
                op(&b),
                d.view(),
                none.bias(Bias::F32(&bias)),
            ),
        ),
        (
            "counts length",
            grouped_gemm(
                &stream,
                GroupedShape {
                    groups: 2,
                    m_max: m,
                    n,
                    k,
                },
                op(&a),
                op(&b),
                d.view(),
                &counts,
                none,
            ),
        ),
        (
            "groups = 0",
            grouped_gemm(
                &stream,
                GroupedShape {
                    groups: 0,
                    m_max: m,
                    n,
                    k,
                },
                op(&a),
                op(&b),
                d.view(),
                &counts,
                none,
            ),
        ),
        (
            "blockwise scales",
            gemm_blockwise(
                &stream,
                GemmShape::new(2 * m, n, k),
                BlockOperand {
                    data: &a,
                    format: E4,
                    scales_inv: &sc,
                },
                BlockOperand {
                    data: &b,
                    format: E4,
                    scales_inv: &sc,
                },
                d.view(),
                none,
            ),
        ),
    ];
    for (what, res) in results {
        assert!(
            matches!(res, Err(Error::InvalidArgument(_))),
            "{what}: expected InvalidArgument, got {res:?}"
        );
    }
    stream.synchronize().unwrap();
    assert!(
        d.bits(&stream).iter().all(|&x| x == u32::MAX),
        "a rejected call wrote D"
    );
}

/// CPU: the reference on a hand-checked 2x3x2 case with bias and accumulation.
#[test]
fn cpu_reference_hand_checked() {
    let enc = |xs: &[f32]| xs.iter().map(|&x| r::encode(x, E4)).collect::<Vec<u8>>();
    let a = enc(&[1.0, -2.0, 0.5, 4.0]); // [2, 2]
    let b = enc(&[3.0, 1.0, -1.0, 0.25, 448.0, 2.0]); // [3, 2]
    let bias = [10.0f32, 20.0, 30.0];
    let prev = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let got = gemm_f64(&RefGemm {
        m: 2,
        n: 3,
        k: 2,
        a: &a,
        a_format: E4,
        b: &b,
        b_format: E4,
        scaling: RefScaling::Tensor { a: 2.0, b: 0.5 },
        bias: Some(&bias),
        d: Some(&prev),
    });
    // A.B^T = [[3 - 2, -1 - 0.5, 448 - 4], [1.5 + 4, -0.5 + 1, 224 + 8]].
    assert_eq!(got, vec![12.0, 20.5, 477.0, 19.5, 25.5, 268.0]);
    assert_eq!(r::decode(r::encode(448.0, E4), E4), 448.0);
}

/// Times the portable path (prints TFLOP/s; no bound asserted) and checks the result is
/// finite.
#[test]
#[ignore = "needs a CUDA device"]
fn portable_gemm_throughput() {
    let (ctx, stream) = setup();
    for (m, n, k) in [(4096, 4096, 4096), (128, 7168, 2048)] {
        let mut rng = Rng::new(5);
        let a = DeviceBuffer::from_host(&stream, &rng.bytes(m * k, E4)).unwrap();
        let b = DeviceBuffer::from_host(&stream, &rng.bytes(n * k, E4)).unwrap();
        let s = DeviceScalar::new(&stream, 1.0).unwrap();
        let mut d = Out::new(&ctx, DType::Bf16, m * n);
        d.poison(&stream);
        let run = || {
            gemm(
                &stream,
                GemmShape::new(m, n, k),
                Operand {
                    data: &a,
                    format: E4,
                    scale_inv: &s,
                },
                Operand {
                    data: &b,
                    format: E4,
                    scale_inv: &s,
                },
                d.view(),
                GemmOptions::new().path(GemmPath::Portable),
            )
            .unwrap()
        };
        run();
        stream.synchronize().unwrap();
        let iters = 10;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            run();
        }
        stream.synchronize().unwrap();
        let secs = t.elapsed().as_secs_f64() / f64::from(iters);
        println!(
            "portable {m}x{n}x{k}: {:.3} ms, {:.1} TFLOP/s",
            secs * 1e3,
            2.0 * (m * n * k) as f64 / secs / 1e12
        );
        assert!(
            d.values(&stream).iter().all(|v| !v.is_nan()),
            "output left poisoned"
        );
    }
}

/// A captured GEMM keeps its operands alive: on the sm_90a path A and B reach the kernel
/// only through tensor maps, so the graph must hold them by other means. The operands are
/// dropped after the capture and their memory offered to new allocations of fresh bytes;
/// the replay must still read the captured operands (the first launch's bits).
#[test]
#[ignore = "needs a CUDA device"]
fn a_captured_gemm_keeps_its_operands_alive() {
    let (ctx, stream) = setup();
    // A regular tiled shape, a skinny one (split over a cluster) and a split-K one.
    for (m, n, k) in [
        (256usize, 256usize, 512usize),
        (64, 1024, 2048),
        (128, 256, 4096),
    ] {
        let mut rng = Rng::new((m * 31 + n * 7 + k) as u64);
        let (a_bytes, b_bytes) = (rng.bytes(m * k, E4), rng.bytes(n * k, E4));
        let a = DeviceBuffer::from_host(&stream, &a_bytes).unwrap();
        let b = DeviceBuffer::from_host(&stream, &b_bytes).unwrap();
        let (sa, sb) = (
            DeviceScalar::new(&stream, 0.5).unwrap(),
            DeviceScalar::new(&stream, 2.0).unwrap(),
        );
        let mut d = Out::new(&ctx, DType::Bf16, m * n);
        let graph = stream
            .capture(CaptureMode::ThreadLocal, |s| {
                let operand = |data, scale_inv| Operand {
                    data,
                    format: E4,
                    scale_inv,
                };
                gemm(
                    s.stream(),
                    GemmShape { m, n, k },
                    operand(&a, &sa),
                    operand(&b, &sb),
                    d.view(),
                    GemmOptions::new().path(GemmPath::Auto),
                )
            })
            .unwrap();
        let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
        d.poison(&stream);
        exec.launch(&stream).unwrap();
        let want = d.bits(&stream);
        let poison = d.poison_bits();
        assert!(
            want.iter().all(|&x| x != poison),
            "{m}x{n}x{k}: first launch"
        );
        drop((a, b, sa, sb));
        // New allocations of the same sizes, other bytes: where the operands' memory was
        // freed, these take it.
        let fresh: Vec<DeviceBuffer<u8>> = (0..4)
            .flat_map(|_| [m * k, n * k])
            .map(|len| DeviceBuffer::from_host(&stream, &rng.bytes(len, E4)).unwrap())
            .collect();
        d.poison(&stream);
        exec.launch(&stream).unwrap();
        assert!(
            d.bits(&stream) == want,
            "{m}x{n}x{k}: the replay read other memory than the captured operands"
        );
        drop(fresh);
    }
}
