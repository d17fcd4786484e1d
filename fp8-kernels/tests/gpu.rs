//! GPU tests: every kernel against the bit-exact CPU reference, on fresh random data of odd
//! sizes, outputs poisoned first; noop flags; graph capture and replay; delayed scaling over
//! ten steps. Run with `cargo test -p fp8-kernels -- --include-ignored` on a CUDA machine.

use cuda_graph::half::{bf16, f16};
use cuda_graph::{DeviceBuffer, GraphExec, InstantiateFlags, Stream};
use fp8_kernels::reference as r;
use fp8_kernels::{AmaxAlgo, DType, DelayedScaling, DeviceScalar, Fp8Format, Fp8Tensor, HpBuffer};

mod common;
use common::*;

const SIZES: [usize; 4] = [1, 7, 1000, 1_000_003];

fn check_bytes(what: &str, got: &[u8], wide: &[f32], scale: f32, fmt: Fp8Format) {
    assert_eq!(got.len(), wide.len());
    let exact_nan = hardware_fp8();
    for (i, (&g, &x)) in got.iter().zip(wide).enumerate() {
        let want = r::quantize(x, scale, fmt);
        if (x * scale).is_nan() && !exact_nan {
            assert!(fmt.is_nan(g), "{what}: [{i}] x={x} -> {g:#04x}, want a NaN");
        } else {
            assert_eq!(
                g, want,
                "{what}: [{i}] x={x:e} scale={scale} -> {g:#04x}, want {want:#04x}"
            );
        }
    }
}

fn poisoned_fp8(stream: &Stream, n: usize, fmt: Fp8Format) -> Fp8Tensor {
    let t = Fp8Tensor::new(stream, &[n], fmt).unwrap();
    t.data().memset_bytes(stream, 0xff).unwrap();
    stream.synchronize().unwrap();
    t
}

#[test]
#[ignore = "needs a CUDA device"]
fn quantize_matches_reference_with_fused_amax() {
    let (_ctx, stream) = setup();
    let scale = 0.713_4f32;
    for (di, &dtype) in DTYPES.iter().enumerate() {
        for fmt in Fp8Format::ALL {
            for (si, &n) in SIZES.iter().enumerate() {
                let what = format!("quantize {dtype:?}->{fmt:?} n={n}");
                let xs = random_data(1 + (di * 100 + si) as u64 * 7 + fmt as u64, n, true);
                let (input, wide) = upload(&stream, dtype, &xs);
                let out = poisoned_fp8(&stream, n, fmt);
                out.scale().write(&stream, scale).unwrap();
                out.scale_inv()
                    .write(&stream, f32::from_bits(POISON_F32))
                    .unwrap();
                fp8_kernels::quantize(&stream, input.view(), &out, None).unwrap();
                let got = out.data().to_vec(&stream).unwrap();
                check_bytes(&what, &got, &wide, scale, fmt);
                let want_amax = r::amax(wide.iter().copied());
                assert_cast_scalars(&stream, &out, want_amax, scale, &what);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn quantize_amax_accumulates_into_the_slot() {
    let (_ctx, stream) = setup();
    let xs = random_data(77, 1001, false);
    let (input, wide) = upload(&stream, DType::Bf16, &xs);
    let out = poisoned_fp8(&stream, 1001, Fp8Format::E4M3);
    let amax = r::amax(wide.iter().copied());
    out.amax().write(&stream, amax * 2.0).unwrap();
    fp8_kernels::quantize(&stream, input.view(), &out, None).unwrap();
    assert_eq!(
        out.amax().read(&stream).unwrap(),
        amax * 2.0,
        "larger slot value kept"
    );
    out.amax().write(&stream, amax * 0.5).unwrap();
    fp8_kernels::quantize(&stream, input.view(), &out, None).unwrap();
    assert_eq!(
        out.amax().read(&stream).unwrap(),
        amax,
        "smaller slot value raised"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn special_values_convert_like_the_reference() {
    // Every f32 that is an fp8 value, the midpoints between neighbours, and specials, at
    // scale 1: checks the hardware conversion path byte for byte, NaN included.
    let (_ctx, stream) = setup();
    for fmt in Fp8Format::ALL {
        let mut vals: Vec<f32> = (0..=255u8).map(|b| r::decode(b, fmt)).collect();
        let pos: Vec<f32> = {
            let mut p: Vec<f32> = vals
                .iter()
                .copied()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .collect();
            p.sort_by(f32::total_cmp);
            p
        };
        for w in pos.windows(2) {
            vals.push((w[0] + w[1]) / 2.0);
            vals.push(-(w[0] + w[1]) / 2.0);
        }
        vals.extend([
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MAX,
            1e-40,
            -1e-40,
        ]);
        let n = vals.len();
        let (input, wide) = upload(&stream, DType::F32, &vals);
        let out = poisoned_fp8(&stream, n, fmt);
        fp8_kernels::quantize(&stream, input.view(), &out, None).unwrap();
        let got = out.data().to_vec(&stream).unwrap();
        for (i, (&g, &x)) in got.iter().zip(&wide).enumerate() {
            let want = r::encode(x, fmt);
            if x.is_nan() {
                // Reported so the reference can be pinned to the hardware's NaN bytes.
                assert!(
                    fmt.is_nan(g),
                    "{fmt:?} [{i}] NaN {:#x} -> {g:#04x}",
                    x.to_bits()
                );
                if g != want {
                    eprintln!(
                        "{fmt:?}: NaN {:#010x} -> {g:#04x} (reference {want:#04x})",
                        x.to_bits()
                    );
                }
            } else {
                assert_eq!(g, want, "{fmt:?} [{i}] {x:e} -> {g:#04x}, want {want:#04x}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn amax_alone_matches_reference() {
    let (_ctx, stream) = setup();
    for (di, &dtype) in DTYPES.iter().enumerate() {
        for (si, &n) in SIZES.iter().enumerate() {
            for specials in [false, true] {
                let xs = random_data(900 + (di * 10 + si) as u64, n, specials);
                let (input, wide) = upload(&stream, dtype, &xs);
                let amax = DeviceScalar::new(&stream, 0.0).unwrap();
                fp8_kernels::amax(&stream, input.view(), &amax, None).unwrap();
                assert_eq!(
                    scalar_bits(&stream, &amax),
                    r::amax(wide.iter().copied()).to_bits(),
                    "amax {dtype:?} n={n} specials={specials}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn dequantize_matches_reference() {
    let (_ctx, stream) = setup();
    let scale_inv = 1.0 / 0.713_4f32;
    for fmt in Fp8Format::ALL {
        for (si, &n) in SIZES.iter().enumerate() {
            let mut rng = Rng(4242 + si as u64);
            let bytes: Vec<u8> = (0..n)
                .map(|i| if i < 256 { i as u8 } else { rng.next() as u8 })
                .collect();
            let t = Fp8Tensor::new(&stream, &[n], fmt).unwrap();
            t.data().copy_from_host(&stream, &bytes).unwrap();
            t.scale_inv().write(&stream, scale_inv).unwrap();
            for dtype in DTYPES {
                let what = format!("dequantize {fmt:?}->{dtype:?} n={n}");
                let got: Vec<u32> = match dtype {
                    DType::F32 => {
                        let o = DeviceBuffer::<f32>::alloc(stream.context(), n).unwrap();
                        o.fill_u32_bits(&stream, POISON_F32).unwrap();
                        fp8_kernels::dequantize(&stream, &t, &o).unwrap();
                        o.to_vec(&stream)
                            .unwrap()
                            .iter()
                            .map(|v| v.to_bits())
                            .collect()
                    }
                    _ => {
                        let o = DeviceBuffer::<u16>::alloc(stream.context(), n).unwrap();
                        o.memset_bytes(&stream, 0xff).unwrap();
                        if dtype == DType::F16 {
                            let v = o.reinterpret::<f16>().unwrap();
                            fp8_kernels::dequantize(&stream, &t, &v).unwrap();
                        } else {
                            let v = o.reinterpret::<bf16>().unwrap();
                            fp8_kernels::dequantize(&stream, &t, &v).unwrap();
                        }
                        o.to_vec(&stream)
                            .unwrap()
                            .iter()
                            .map(|&v| u32::from(v))
                            .collect()
                    }
                };
                for (i, (&g, &b)) in got.iter().zip(&bytes).enumerate() {
                    let v = r::dequantize(b, scale_inv, fmt);
                    if v.is_nan() {
                        assert!(
                            r::widen(g, dtype).is_nan(),
                            "{what}: [{i}] {b:#04x} -> {g:#x}, want NaN"
                        );
                    } else {
                        let want = r::narrow(v, dtype);
                        assert_eq!(g, want, "{what}: [{i}] {b:#04x} -> {g:#x}, want {want:#x}");
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn current_scaling_derives_the_scale_on_the_device() {
    let (_ctx, stream) = setup();
    // The fused one-block path up to FUSED_CURRENT_MAX, the three-launch path above it.
    let max = fp8_kernels::FUSED_CURRENT_MAX;
    let sizes: Vec<usize> = SIZES.iter().copied().chain([max, max + 1]).collect();
    for (di, &dtype) in DTYPES.iter().enumerate() {
        for fmt in Fp8Format::ALL {
            for (si, &n) in sizes.iter().enumerate() {
                let what = format!("current {dtype:?}->{fmt:?} n={n}");
                let xs = random_data(5000 + (di * 100 + si) as u64 + fmt as u64, n, false);
                let (input, wide) = upload(&stream, dtype, &xs);
                let out = poisoned_fp8(&stream, n, fmt);
                // Stale values everywhere: the amax must be reset, the scale recomputed.
                out.amax().write(&stream, 1e30).unwrap();
                out.scale()
                    .write(&stream, f32::from_bits(POISON_F32))
                    .unwrap();
                fp8_kernels::quantize_current(&stream, input.view(), &out, None).unwrap();
                let amax = r::amax(wide.iter().copied());
                let scale = r::current_scale(amax, fmt);
                assert_eq!(
                    scalar_bits(&stream, out.amax()),
                    amax.to_bits(),
                    "{what}: amax"
                );
                assert_eq!(out.scale().read(&stream).unwrap(), scale, "{what}: scale");
                assert_eq!(
                    out.scale_inv().read(&stream).unwrap(),
                    1.0 / scale,
                    "{what}: scale_inv"
                );
                check_bytes(
                    &what,
                    &out.data().to_vec(&stream).unwrap(),
                    &wide,
                    scale,
                    fmt,
                );
            }
        }
    }
    // amax 0, inf and NaN give scale 1.
    for (xs, amax_bits) in [
        (vec![0.0f32; 9], 0u32),
        (vec![1.0, f32::INFINITY, 2.0], f32::INFINITY.to_bits()),
        (vec![1.0, f32::NAN, 2.0], 0x7fc0_0000),
    ] {
        let (input, wide) = upload(&stream, DType::F32, &xs);
        let out = poisoned_fp8(&stream, xs.len(), Fp8Format::E4M3);
        out.scale().write(&stream, 5.0).unwrap();
        fp8_kernels::quantize_current(&stream, input.view(), &out, None).unwrap();
        assert_eq!(scalar_bits(&stream, out.amax()), amax_bits, "{xs:?}: amax");
        assert_eq!(
            out.scale().read(&stream).unwrap(),
            1.0,
            "{xs:?}: guarded scale"
        );
        check_bytes(
            "guarded",
            &out.data().to_vec(&stream).unwrap(),
            &wide,
            1.0,
            Fp8Format::E4M3,
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn noop_flag_writes_nothing() {
    let (_ctx, stream) = setup();
    let n = 1001;
    let noop = DeviceScalar::new(&stream, 1.0).unwrap();
    for dtype in DTYPES {
        let xs = random_data(31, n, true);
        let (input, _) = upload(&stream, dtype, &xs);
        let out = poisoned_fp8(&stream, n, Fp8Format::E4M3);
        out.scale().write(&stream, 3.0).unwrap();
        out.scale_inv().write(&stream, 7.0).unwrap();
        out.amax().write(&stream, 11.0).unwrap();
        fp8_kernels::quantize(&stream, input.view(), &out, Some(&noop)).unwrap();
        fp8_kernels::quantize_current(&stream, input.view(), &out, Some(&noop)).unwrap();
        fp8_kernels::amax(&stream, input.view(), out.amax(), Some(&noop)).unwrap();
        let bytes = out.data().to_vec(&stream).unwrap();
        assert!(
            bytes.iter().all(|&b| b == 0xff),
            "{dtype:?}: noop wrote data"
        );
        assert_eq!(out.scale().read(&stream).unwrap(), 3.0, "{dtype:?}: scale");
        assert_eq!(
            out.scale_inv().read(&stream).unwrap(),
            7.0,
            "{dtype:?}: scale_inv"
        );
        assert_eq!(out.amax().read(&stream).unwrap(), 11.0, "{dtype:?}: amax");
        // Any other flag value runs normally.
        noop.write(&stream, 0.0).unwrap();
        fp8_kernels::quantize(&stream, input.view(), &out, Some(&noop)).unwrap();
        assert_eq!(
            out.scale_inv().read(&stream).unwrap(),
            1.0 / 3.0,
            "{dtype:?}: ran"
        );
        noop.write(&stream, 1.0).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn captured_graph_replays_like_eager() {
    let (ctx, stream) = setup();
    let n = 1_000_003;
    let fmt = Fp8Format::E4M3;
    let xs = random_data(2024, n, true);
    let (input, wide) = upload(&stream, DType::Bf16, &xs);
    // Graph side and eager side: same inputs, separate outputs.
    let mk = || {
        let noop = DeviceScalar::new(&stream, 0.0).unwrap();
        let q = poisoned_fp8(&stream, n, fmt);
        let c = poisoned_fp8(&stream, n, Fp8Format::E5M2);
        let d = DeviceBuffer::<f32>::alloc(&ctx, n).unwrap();
        (noop, q, c, d)
    };
    let (g_noop, mut gq, mut gc, mut gd) = mk();
    let (e_noop, mut eq, mut ec, mut ed) = mk();
    let graph = capture(&ctx, &stream, || {
        fp8_kernels::quantize(&stream, input.view(), &gq, Some(&g_noop))?;
        fp8_kernels::quantize_current(&stream, input.view(), &gc, Some(&g_noop))?;
        fp8_kernels::dequantize(&stream, &gq, &gd)
    });
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
    for (step, (scale, flag)) in [(1.0f32, 0.0f32), (0.25, 0.0), (3.5, 1.0), (100.0, 0.0)]
        .into_iter()
        .enumerate()
    {
        for (noop, q, c, d) in [
            (&g_noop, &mut gq, &mut gc, &mut gd),
            (&e_noop, &mut eq, &mut ec, &mut ed),
        ] {
            noop.write(&stream, flag).unwrap();
            q.scale().write(&stream, scale).unwrap();
            q.amax().write(&stream, 0.0).unwrap();
            q.data().memset_bytes(&stream, 0xff).unwrap();
            c.data().memset_bytes(&stream, 0xff).unwrap();
            d.fill_u32_bits(&stream, POISON_F32).unwrap();
        }
        exec.launch(&stream).unwrap();
        fp8_kernels::quantize(&stream, input.view(), &eq, Some(&e_noop)).unwrap();
        fp8_kernels::quantize_current(&stream, input.view(), &ec, Some(&e_noop)).unwrap();
        fp8_kernels::dequantize(&stream, &eq, &ed).unwrap();
        stream.synchronize().unwrap();
        let what = format!("step {step} scale {scale} noop {flag}");
        let gqb = gq.data().to_vec(&stream).unwrap();
        assert!(
            gqb == eq.data().to_vec(&stream).unwrap(),
            "{what}: quantize bytes differ"
        );
        assert!(
            gc.data().to_vec(&stream).unwrap() == ec.data().to_vec(&stream).unwrap(),
            "{what}: current bytes differ"
        );
        let gdv: Vec<u32> = gd
            .to_vec(&stream)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        let edv: Vec<u32> = ed
            .to_vec(&stream)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert!(gdv == edv, "{what}: dequantize differs");
        for (a, b) in [
            (gq.amax(), eq.amax()),
            (gq.scale_inv(), eq.scale_inv()),
            (gc.scale(), ec.scale()),
            (gc.amax(), ec.amax()),
        ] {
            assert_eq!(
                scalar_bits(&stream, a),
                scalar_bits(&stream, b),
                "{what}: scalars"
            );
        }
        if flag == 1.0 {
            assert!(
                gqb.iter().all(|&b| b == 0xff),
                "{what}: noop replay wrote data"
            );
            assert_eq!(
                gq.amax().read(&stream).unwrap(),
                0.0,
                "{what}: noop replay wrote amax"
            );
        } else {
            check_bytes(&what, &gqb, &wide, scale, fmt);
            assert_eq!(gq.scale_inv().read(&stream).unwrap(), 1.0 / scale, "{what}");
            assert_eq!(
                scalar_bits(&stream, gq.amax()),
                r::amax(wide.iter().copied()).to_bits()
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn delayed_scaling_ten_steps_match_the_cpu_model() {
    let (ctx, stream) = setup();
    let formats = [Fp8Format::E4M3, Fp8Format::E5M2, Fp8Format::E4M3];
    let n = 4097;
    // Margins whose target is not a normal f32 (or that scale past the format) are refused.
    for margin in [-1, fp8_kernels::MAX_MARGIN + 1, i32::MIN, i32::MAX] {
        let e = DelayedScaling::new(&stream, &formats, 4, margin, AmaxAlgo::Max).unwrap_err();
        assert!(e.to_string().contains("margin"), "{e}");
    }
    for algo in [AmaxAlgo::Max, AmaxAlgo::MostRecent] {
        for (h, margin) in [(1usize, 0i32), (4, 1), (16, 2), (1024, 0)] {
            let what = format!("{algo:?} H={h} margin={margin}");
            let state = DelayedScaling::new(&stream, &formats, h, margin, algo).unwrap();
            let mut tensors: Vec<Fp8Tensor> = (0..formats.len())
                .map(|t| {
                    state
                        .tensor(t, DeviceBuffer::alloc(&ctx, n).unwrap(), &[n])
                        .unwrap()
                })
                .collect();
            // CPU model.
            let mut hist = vec![vec![0f32; h]; formats.len()];
            let mut scale = vec![1f32; formats.len()];
            let mut scale_inv = vec![1f32; formats.len()];
            let mut rng = Rng(99 + h as u64);
            for step in 0..10 {
                for (t, tensor) in tensors.iter_mut().enumerate() {
                    // Magnitudes drift by step; some steps feed 0, inf or NaN amaxes.
                    let mag = 2f32.powi((rng.next() % 20) as i32 - 8);
                    let mut xs: Vec<f32> = (0..n).map(|_| rng.value() * mag * 1e-3).collect();
                    match (step + t) % 7 {
                        3 => xs.iter_mut().for_each(|x| *x = 0.0),
                        5 => xs[17] = f32::INFINITY,
                        6 => xs[n - 1] = f32::NAN,
                        _ => {}
                    }
                    let (input, wide) = upload(&stream, DType::F32, &xs);
                    tensor.data().memset_bytes(&stream, 0xff).unwrap();
                    fp8_kernels::quantize(&stream, input.view(), tensor, None).unwrap();
                    let got = tensor.data().to_vec(&stream).unwrap();
                    check_bytes(
                        &format!("{what} step {step} t {t}"),
                        &got,
                        &wide,
                        scale[t],
                        formats[t],
                    );
                    let a = r::amax(wide.iter().copied());
                    hist[t][0] = f32::from_bits(hist[t][0].to_bits().max(a.to_bits()));
                    assert_eq!(
                        scalar_bits(&stream, tensor.scale_inv()),
                        scale_inv[t].to_bits()
                    );
                }
                // Steps 4..=6: only tensors 0 and 2 registered (tensor 1 keeps its history
                // and scales while its quantize still maxes into slot 0); all again after.
                match step {
                    4 => state.register(&stream, [0, 2]).unwrap(),
                    7 => state.register(&stream, 0..formats.len()).unwrap(),
                    _ => {}
                }
                let registered = |t: usize| !(4..7).contains(&step) || t != 1;
                assert_eq!(
                    state.registered(),
                    (0..formats.len())
                        .filter(|&t| registered(t))
                        .collect::<Vec<_>>()
                );
                state.update(&stream).unwrap();
                for t in (0..formats.len()).filter(|&t| registered(t)) {
                    r::delayed_update(
                        &mut hist[t],
                        &mut scale[t],
                        &mut scale_inv[t],
                        r::scaled_max(formats[t], margin),
                        algo == AmaxAlgo::MostRecent,
                    );
                }
                let dh = state.history_buffer().to_vec(&stream).unwrap();
                let ds = state.scale_buffer().to_vec(&stream).unwrap();
                let dsi = state.scale_inv_buffer().to_vec(&stream).unwrap();
                for t in 0..formats.len() {
                    let dev: Vec<u32> =
                        dh[t * h..(t + 1) * h].iter().map(|v| v.to_bits()).collect();
                    let cpu: Vec<u32> = hist[t].iter().map(|v| v.to_bits()).collect();
                    assert_eq!(dev, cpu, "{what} step {step} tensor {t}: history");
                    assert_eq!(
                        ds[t].to_bits(),
                        scale[t].to_bits(),
                        "{what} step {step} tensor {t}: scale {} vs {}",
                        ds[t],
                        scale[t]
                    );
                    assert_eq!(
                        dsi[t].to_bits(),
                        scale_inv[t].to_bits(),
                        "{what} step {step} tensor {t}: scale_inv"
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn bad_input_is_rejected_before_any_launch() {
    let (ctx, stream) = setup();
    let x = DeviceBuffer::from_host(&stream, &[1.0f32; 64]).unwrap();
    let wrong_len = poisoned_fp8(&stream, 63, Fp8Format::E4M3);
    assert!(fp8_kernels::quantize(&stream, HpBuffer::F32(&x), &wrong_len, None).is_err());
    assert!(fp8_kernels::quantize_current(&stream, HpBuffer::F32(&x), &wrong_len, None).is_err());
    // A view 4 bytes into x, 60 elements.
    let misaligned = x.slice(1..61).unwrap();
    let out60 = poisoned_fp8(&stream, 60, Fp8Format::E4M3);
    out60.amax().write(&stream, 5.0).unwrap();
    assert!(fp8_kernels::quantize(&stream, HpBuffer::F32(&misaligned), &out60, None).is_err());
    assert!(
        fp8_kernels::quantize_current(&stream, HpBuffer::F32(&misaligned), &out60, None).is_err()
    );
    assert!(fp8_kernels::amax(&stream, HpBuffer::F32(&misaligned), out60.amax(), None).is_err());
    let d = DeviceBuffer::<f32>::alloc(&ctx, 62).unwrap();
    assert!(fp8_kernels::dequantize(&stream, &out60, &d).is_err());
    stream.synchronize().unwrap();
    assert!(
        wrong_len
            .data()
            .to_vec(&stream)
            .unwrap()
            .iter()
            .all(|&b| b == 0xff)
    );
    assert!(
        out60
            .data()
            .to_vec(&stream)
            .unwrap()
            .iter()
            .all(|&b| b == 0xff)
    );
    assert_eq!(
        out60.amax().read(&stream).unwrap(),
        5.0,
        "current-scaling reset ran on error"
    );
    assert_eq!(wrong_len.amax().read(&stream).unwrap(), 0.0);
    assert!(DelayedScaling::new(&stream, &[Fp8Format::E4M3], 0, 0, AmaxAlgo::Max).is_err());
    assert!(DelayedScaling::new(&stream, &[Fp8Format::E4M3], 1025, 0, AmaxAlgo::Max).is_err());
    assert!(DelayedScaling::new(&stream, &[], 4, 0, AmaxAlgo::Max).is_err());
    let st = DelayedScaling::new(&stream, &[Fp8Format::E4M3], 4, 0, AmaxAlgo::Max).unwrap();
    // Registering a tensor that does not exist changes nothing.
    let e = st.register(&stream, [0, 1]).unwrap_err();
    assert!(e.to_string().contains("FP8 tensor 1 registered"), "{e}");
    assert_eq!(st.registered(), [0]);
    assert!(
        st.tensor(1, DeviceBuffer::alloc(&ctx, 8).unwrap(), &[8])
            .is_err()
    );
    assert!(
        st.tensor(0, DeviceBuffer::alloc(&ctx, 8).unwrap(), &[9])
            .is_err()
    );
}

/// Not a target check (the integrator's `bench fp8-cast` owns that): prints the bandwidth
/// of bf16 -> E4M3 quantize with fused amax over 2^28 elements (3 bytes an element) beside a
/// device copy of the same bf16 buffer, and checks the result of the timed runs.
#[test]
#[ignore = "needs a CUDA device"]
fn bandwidth_probe_quantize_bf16() {
    let (ctx, stream) = setup();
    let n = 1usize << 28;
    let x = DeviceBuffer::<bf16>::alloc(&ctx, n).unwrap();
    x.memset_bytes(&stream, 0x3f).unwrap(); // every element bf16 0x3f3f
    let copy = DeviceBuffer::<bf16>::alloc(&ctx, n).unwrap();
    let out = Fp8Tensor::new(&stream, &[n], Fp8Format::E4M3).unwrap();
    let time = |f: &mut dyn FnMut()| mean_ms(&stream, f);
    let q_ms =
        time(&mut || fp8_kernels::quantize(&stream, HpBuffer::Bf16(&x), &out, None).unwrap());
    let c_ms = time(&mut || copy.copy_from_device(&stream, &x).unwrap());
    let q_gbs = 3.0 * n as f64 / (f64::from(q_ms) * 1e6);
    let c_gbs = 4.0 * n as f64 / (f64::from(c_ms) * 1e6);
    eprintln!(
        "quantize bf16->e4m3 + amax: {q_ms:.3} ms, {q_gbs:.0} GB/s; d2d copy: {c_ms:.3} ms, {c_gbs:.0} GB/s; ratio {:.2}",
        q_gbs / c_gbs
    );
    let v = r::widen(0x3f3f, DType::Bf16);
    assert_eq!(out.amax().read(&stream).unwrap(), v);
    let want = r::quantize(v, 1.0, Fp8Format::E4M3);
    let got = out.data().to_vec(&stream).unwrap();
    assert!(got.iter().all(|&b| b == want), "timed quantize output");
}

#[test]
#[ignore = "needs a CUDA device"]
fn current_scaling_of_a_small_tensor_is_one_launch() {
    use cuda_graph::CaptureMode;
    let (_ctx, stream) = setup();
    for (n, launches) in [
        (fp8_kernels::FUSED_CURRENT_MAX, 1),
        (fp8_kernels::FUSED_CURRENT_MAX + 1, 3),
    ] {
        let xs = random_data(77, n, false);
        let (input, _) = upload(&stream, DType::Bf16, &xs);
        let out = poisoned_fp8(&stream, n, Fp8Format::E4M3);
        let graph = stream
            .capture(CaptureMode::ThreadLocal, |s| {
                fp8_kernels::quantize_current(s.stream(), input.view(), &out, None)
            })
            .unwrap();
        assert_eq!(graph.nodes().unwrap().len(), launches, "n = {n}");
    }
}
