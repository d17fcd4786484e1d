//! GPU tests of cast-transpose (plain and batched) and block-scaled quantize against the
//! bit-exact CPU reference, on fresh random data of odd shapes, outputs poisoned first; the
//! batched cast against separate casts; the noop flag; graph capture and replay; bad input. Run with `cargo test -p fp8-kernels -- --include-ignored` on a
//! CUDA machine.

use cuda_graph::{DeviceBuffer, GraphExec, InstantiateFlags, Result, Stream};
use fp8_kernels::reference as r;
use fp8_kernels::{
    BatchedCastOut, BlockShape, DType, DeviceScalar, Fp8Format, Fp8Tensor, HpBuffer, ScalarSlots,
};

/// Odd shapes (tails in both dimensions), one aligned shape of whole tiles, and one aligned
/// shape whose edge tiles are partial (fast and edge paths in one launch).
mod common;
use common::*;

const CT_SHAPES: [(usize, usize); 9] = [
    (1, 1),
    (1, 37),
    (37, 1),
    (67, 131),
    (255, 513),
    (1000, 1003),
    (256, 512),
    (272, 144),
    (16, 16),
];

/// Compares bytes with the reference's bytes; `x_of(i)` is the scaled value behind byte i,
/// used to accept any NaN byte on devices without hardware FP8 conversion.
fn check_against(what: &str, got: &[u8], want: &[u8], fmt: Fp8Format, exact_nan: bool) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if fmt.is_nan(w) && !exact_nan {
            assert!(fmt.is_nan(g), "{what}: [{i}] -> {g:#04x}, want a NaN");
        } else {
            assert_eq!(g, w, "{what}: [{i}] -> {g:#04x}, want {w:#04x}");
        }
    }
}

fn poisoned_matrix(stream: &Stream, rows: usize, cols: usize, fmt: Fp8Format) -> Fp8Tensor {
    let t = Fp8Tensor::new(stream, &[rows, cols], fmt).unwrap();
    t.data().memset_bytes(stream, 0xff).unwrap();
    stream.synchronize().unwrap();
    t
}

fn poisoned_bytes(stream: &Stream, n: usize) -> DeviceBuffer<u8> {
    poisoned_bytes_with(stream, n, 0xff)
}

fn poisoned_bytes_with(stream: &Stream, n: usize, poison: u8) -> DeviceBuffer<u8> {
    let b = DeviceBuffer::<u8>::alloc(stream.context(), n).unwrap();
    b.memset_bytes(stream, poison).unwrap();
    stream.synchronize().unwrap();
    b
}

/// Whether every byte of `b` still holds the 0xaa poison of [`poisoned_bytes_with`].
fn still_poisoned(stream: &Stream, b: &DeviceBuffer<u8>) -> bool {
    b.to_vec(stream).unwrap().iter().all(|&x| x == 0xaa)
}

#[test]
#[ignore = "needs a CUDA device"]
fn cast_transpose_matches_reference() {
    let (_ctx, stream) = setup();
    let exact_nan = hardware_fp8();
    let scale = 0.713_4f32;
    for (di, &dtype) in DTYPES.iter().enumerate() {
        for fmt in Fp8Format::ALL {
            for (si, &(rows, cols)) in CT_SHAPES.iter().enumerate() {
                let what = format!("cast_transpose {dtype:?}->{fmt:?} [{rows}, {cols}]");
                let n = rows * cols;
                let seed = 11 + (di * 100 + si) as u64 * 7 + fmt as u64;
                let xs = random_data(seed, n, true);
                let (input, wide) = upload(&stream, dtype, &xs);
                let out = poisoned_matrix(&stream, rows, cols, fmt);
                let out_t = poisoned_bytes(&stream, n);
                out.scale().write(&stream, scale).unwrap();
                out.scale_inv()
                    .write(&stream, f32::from_bits(POISON_F32))
                    .unwrap();
                fp8_kernels::cast_transpose(&stream, input.view(), rows, cols, &out, &out_t, None)
                    .unwrap();
                let (want_y, want_t, want_amax) =
                    r::cast_transpose_ref(&wide, rows, cols, scale, fmt);
                let got_y = out.data().to_vec(&stream).unwrap();
                let got_t = out_t.to_vec(&stream).unwrap();
                check_against(
                    &format!("{what} row-major"),
                    &got_y,
                    &want_y,
                    fmt,
                    exact_nan,
                );
                check_against(
                    &format!("{what} transposed"),
                    &got_t,
                    &want_t,
                    fmt,
                    exact_nan,
                );
                assert_cast_scalars(&stream, &out, want_amax, scale, &what);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cast_transpose_amax_accumulates_and_noop_writes_nothing() {
    let (_ctx, stream) = setup();
    let (rows, cols) = (67, 131);
    let n = rows * cols;
    let noop = DeviceScalar::new(&stream, 1.0).unwrap();
    for dtype in DTYPES {
        let xs = random_data(31, n, true);
        let (input, wide) = upload(&stream, dtype, &xs);
        let out = poisoned_matrix(&stream, rows, cols, Fp8Format::E4M3);
        let out_t = poisoned_bytes(&stream, n);
        out.scale().write(&stream, 3.0).unwrap();
        out.scale_inv().write(&stream, 7.0).unwrap();
        out.amax().write(&stream, 11.0).unwrap();
        fp8_kernels::cast_transpose(&stream, input.view(), rows, cols, &out, &out_t, Some(&noop))
            .unwrap();
        assert!(
            out.data()
                .to_vec(&stream)
                .unwrap()
                .iter()
                .all(|&b| b == 0xff),
            "{dtype:?}: noop wrote data"
        );
        assert!(
            out_t.to_vec(&stream).unwrap().iter().all(|&b| b == 0xff),
            "{dtype:?}: noop wrote the transpose"
        );
        assert_eq!(out.scale().read(&stream).unwrap(), 3.0, "{dtype:?}: scale");
        assert_eq!(
            out.scale_inv().read(&stream).unwrap(),
            7.0,
            "{dtype:?}: scale_inv"
        );
        assert_eq!(out.amax().read(&stream).unwrap(), 11.0, "{dtype:?}: amax");
        // Any other flag value runs normally; a larger amax already in the slot is kept
        // (the data holds inf and NaN, so use finite data for that part).
        noop.write(&stream, 0.0).unwrap();
        let finite = random_data(32, n, false);
        let (input, wide_f) = upload(&stream, dtype, &finite);
        let big = r::amax(wide_f.iter().copied()) * 2.0;
        out.amax().write(&stream, big).unwrap();
        fp8_kernels::cast_transpose(&stream, input.view(), rows, cols, &out, &out_t, Some(&noop))
            .unwrap();
        assert_eq!(
            out.scale_inv().read(&stream).unwrap(),
            1.0 / 3.0,
            "{dtype:?}: ran"
        );
        assert_eq!(
            out.amax().read(&stream).unwrap(),
            big,
            "{dtype:?}: larger amax kept"
        );
        let (want_y, want_t, _) = r::cast_transpose_ref(&wide_f, rows, cols, 3.0, Fp8Format::E4M3);
        assert!(
            out.data().to_vec(&stream).unwrap() == want_y,
            "{dtype:?}: ran, row-major"
        );
        assert!(
            out_t.to_vec(&stream).unwrap() == want_t,
            "{dtype:?}: ran, transposed"
        );
        noop.write(&stream, 1.0).unwrap();
        let _ = wide;
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn captured_graph_replays_like_eager() {
    let (ctx, stream) = setup();
    let fmt = Fp8Format::E4M3;
    // An odd shape (edge path) and an aligned one (fast path) in the same graph, plus a
    // block-scaled quantize.
    let shapes = [(255usize, 513usize), (512, 256)];
    let inputs: Vec<(Input, Vec<f32>)> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(rr, cc))| {
            upload(
                &stream,
                DType::Bf16,
                &random_data(2024 + i as u64, rr * cc, true),
            )
        })
        .collect();
    struct Side {
        noop: DeviceScalar,
        outs: Vec<(Fp8Tensor, DeviceBuffer<u8>)>,
        bq: DeviceBuffer<u8>,
        bs: DeviceBuffer<f32>,
    }
    let (br, bc) = shapes[0];
    let mk = || Side {
        noop: DeviceScalar::new(&stream, 0.0).unwrap(),
        outs: shapes
            .iter()
            .map(|&(rr, cc)| {
                (
                    poisoned_matrix(&stream, rr, cc, fmt),
                    poisoned_bytes(&stream, rr * cc),
                )
            })
            .collect(),
        bq: poisoned_bytes(&stream, br * bc),
        bs: DeviceBuffer::alloc(&ctx, BlockShape::Row1x128.scales_len(br, bc)).unwrap(),
    };
    let enqueue = |side: &mut Side| -> Result<()> {
        for (k, (out, out_t)) in side.outs.iter_mut().enumerate() {
            let (rr, cc) = shapes[k];
            fp8_kernels::cast_transpose(
                &stream,
                inputs[k].0.view(),
                rr,
                cc,
                out,
                out_t,
                Some(&side.noop),
            )?;
        }
        fp8_kernels::quantize_blockwise(
            &stream,
            inputs[0].0.view(),
            br,
            bc,
            BlockShape::Row1x128,
            fmt,
            &side.bq,
            &side.bs,
        )
    };
    let mut g = mk();
    let mut e = mk();
    let graph = capture(&ctx, &stream, || enqueue(&mut g));
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
    for (step, (scale, flag)) in [(1.0f32, 0.0f32), (0.25, 0.0), (3.5, 1.0), (100.0, 0.0)]
        .into_iter()
        .enumerate()
    {
        for side in [&mut g, &mut e] {
            side.noop.write(&stream, flag).unwrap();
            for (out, out_t) in side.outs.iter_mut() {
                out.scale().write(&stream, scale).unwrap();
                out.amax().write(&stream, 0.0).unwrap();
                out.scale_inv()
                    .write(&stream, f32::from_bits(POISON_F32))
                    .unwrap();
                out.data().memset_bytes(&stream, 0xff).unwrap();
                out_t.memset_bytes(&stream, 0xff).unwrap();
            }
            side.bq.memset_bytes(&stream, 0xff).unwrap();
            side.bs.fill_u32_bits(&stream, POISON_F32).unwrap();
        }
        exec.launch(&stream).unwrap();
        enqueue(&mut e).unwrap();
        stream.synchronize().unwrap();
        let what = format!("step {step} scale {scale} noop {flag}");
        for k in 0..shapes.len() {
            let (rr, cc) = shapes[k];
            let (go, gt) = &g.outs[k];
            let (eo, et) = &e.outs[k];
            let gy = go.data().to_vec(&stream).unwrap();
            let gtv = gt.to_vec(&stream).unwrap();
            assert!(
                gy == eo.data().to_vec(&stream).unwrap(),
                "{what} [{rr}, {cc}]: row-major differs"
            );
            assert!(
                gtv == et.to_vec(&stream).unwrap(),
                "{what} [{rr}, {cc}]: transpose differs"
            );
            for (a, b) in [(go.amax(), eo.amax()), (go.scale_inv(), eo.scale_inv())] {
                assert_eq!(
                    scalar_bits(&stream, a),
                    scalar_bits(&stream, b),
                    "{what}: scalars"
                );
            }
            if flag == 1.0 {
                assert!(
                    gy.iter().all(|&b| b == 0xff),
                    "{what}: noop replay wrote data"
                );
                assert!(
                    gtv.iter().all(|&b| b == 0xff),
                    "{what}: noop replay wrote transpose"
                );
                assert_eq!(
                    go.amax().read(&stream).unwrap(),
                    0.0,
                    "{what}: noop replay wrote amax"
                );
                assert_eq!(
                    scalar_bits(&stream, go.scale_inv()),
                    POISON_F32,
                    "{what}: noop scale_inv"
                );
            } else {
                let (wy, wt, wa) = r::cast_transpose_ref(&inputs[k].1, rr, cc, scale, fmt);
                check_against(&what, &gy, &wy, fmt, true);
                check_against(&what, &gtv, &wt, fmt, true);
                assert_eq!(
                    scalar_bits(&stream, go.amax()),
                    wa.to_bits(),
                    "{what}: amax"
                );
                assert_eq!(
                    go.scale_inv().read(&stream).unwrap(),
                    1.0 / scale,
                    "{what}: scale_inv"
                );
            }
        }
        let gb = g.bq.to_vec(&stream).unwrap();
        assert!(
            gb == e.bq.to_vec(&stream).unwrap(),
            "{what}: blockwise bytes differ"
        );
        let (wb, ws) = r::quantize_blockwise_ref(&inputs[0].1, br, bc, BlockShape::Row1x128, fmt);
        assert!(gb == wb, "{what}: blockwise bytes vs reference");
        let gs: Vec<u32> =
            g.bs.to_vec(&stream)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
        let want: Vec<u32> = ws.iter().map(|v| v.to_bits()).collect();
        assert_eq!(gs, want, "{what}: blockwise scales");
    }
}

/// Batches `(count, rows, cols)`: edge tiles only (rows % 16 != 0), one matrix with fast and
/// edge tiles, fast and edge tiles, whole fast tiles, and single-row matrices at unaligned
/// offsets.
const BATCHES: [(usize, usize, usize); 5] = [
    (3, 100, 72),
    (1, 272, 144),
    (5, 144, 80),
    (8, 256, 128),
    (2, 1, 37),
];

/// The scalars of a batch of `count` matrices, each kind in its own buffer with its own first
/// index and stride (scale: from 2 every 1; scale_inv: from 1 every 2; amax: from 0 every 3,
/// like a delayed-scaling history), every other element poisoned.
struct BatchScalars {
    scale: DeviceBuffer<f32>,
    scale_inv: DeviceBuffer<f32>,
    amax: DeviceBuffer<f32>,
}

impl BatchScalars {
    const LAYOUT: [(usize, usize); 3] = [(2, 1), (1, 2), (0, 3)];

    /// Scales `scales[g]`, amax `amax[g]`, scale_inv poisoned.
    fn new(stream: &Stream, scales: &[f32], amax: &[f32]) -> BatchScalars {
        let count = scales.len();
        let buf = |(first, stride): (usize, usize), vals: Option<&[f32]>| {
            let mut host = vec![f32::from_bits(POISON_F32); first + count * stride + 2];
            if let Some(v) = vals {
                for (g, &x) in v.iter().enumerate() {
                    host[first + g * stride] = x;
                }
            }
            DeviceBuffer::from_host(stream, &host).unwrap()
        };
        BatchScalars {
            scale: buf(Self::LAYOUT[0], Some(scales)),
            scale_inv: buf(Self::LAYOUT[1], None),
            amax: buf(Self::LAYOUT[2], Some(amax)),
        }
    }

    fn out<'a>(
        &self,
        data: &'a DeviceBuffer<u8>,
        data_t: &'a DeviceBuffer<u8>,
        fmt: Fp8Format,
    ) -> BatchedCastOut<'a> {
        let slots = |b: &DeviceBuffer<f32>, (first, stride): (usize, usize)| {
            ScalarSlots::new(DeviceScalar::at(b, first).unwrap(), stride)
        };
        BatchedCastOut {
            data,
            data_t,
            format: fmt,
            scale: slots(&self.scale, Self::LAYOUT[0]),
            scale_inv: slots(&self.scale_inv, Self::LAYOUT[1]),
            amax: slots(&self.amax, Self::LAYOUT[2]),
        }
    }

    /// The bits of (scale, scale_inv, amax) buffers.
    fn bits(&self, stream: &Stream) -> [Vec<u32>; 3] {
        [&self.scale, &self.scale_inv, &self.amax].map(|b| {
            b.to_vec(stream)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        })
    }
}

/// Batched cast-transpose against `count` separate plain casts of the same matrices (each
/// uploaded on its own) and the CPU reference: both outputs bit for bit (poisoned with 0xaa
/// first), every matrix's scale_inv and amax (some preset above the data's amax, which must be
/// kept), scales kept and every element of the scalar buffers outside the slots untouched.
#[test]
#[ignore = "needs a CUDA device"]
fn batched_cast_transpose_equals_separate_casts() {
    let (_ctx, stream) = setup();
    let exact_nan = hardware_fp8();
    for (di, &dtype) in DTYPES.iter().enumerate() {
        for fmt in Fp8Format::ALL {
            for (bi, &(count, rows, cols)) in BATCHES.iter().enumerate() {
                let what = format!("batched {dtype:?}->{fmt:?} {count} x [{rows}, {cols}]");
                let n = rows * cols;
                let seed = 5003 + (di * 100 + bi) as u64 * 7 + fmt as u64;
                // Specials (inf, NaN, ...) land in some matrices only.
                let xs = random_data(seed, count * n, true);
                let (input, wide) = upload(&stream, dtype, &xs);
                let scales: Vec<f32> = (0..count)
                    .map(|g| 0.713_4 * 2f32.powi(g as i32 % 5 - 2))
                    .collect();
                let preset: Vec<f32> = (0..count)
                    .map(|g| if g % 2 == 1 { 1e30 } else { 0.0 })
                    .collect();
                let scalars = BatchScalars::new(&stream, &scales, &preset);
                let before = scalars.bits(&stream);
                let y = poisoned_bytes_with(&stream, count * n, 0xaa);
                let yt = poisoned_bytes_with(&stream, count * n, 0xaa);
                let out = scalars.out(&y, &yt, fmt);
                fp8_kernels::cast_transpose_batched(
                    &stream,
                    input.view(),
                    (count, rows, cols),
                    &out,
                    None,
                )
                .unwrap();
                let (got_y, got_t) = (y.to_vec(&stream).unwrap(), yt.to_vec(&stream).unwrap());
                let after = scalars.bits(&stream);
                for g in 0..count {
                    let what = format!("{what} matrix {g}");
                    let part = g * n..(g + 1) * n;
                    let (one, _) = upload(&stream, dtype, &xs[part.clone()]);
                    let sep = Fp8Tensor::new(&stream, &[rows, cols], fmt).unwrap();
                    sep.data().memset_bytes(&stream, 0xaa).unwrap();
                    let sep_t = poisoned_bytes_with(&stream, n, 0xaa);
                    sep.scale().write(&stream, scales[g]).unwrap();
                    sep.amax().write(&stream, preset[g]).unwrap();
                    sep.scale_inv()
                        .write(&stream, f32::from_bits(POISON_F32))
                        .unwrap();
                    fp8_kernels::cast_transpose(
                        &stream,
                        one.view(),
                        rows,
                        cols,
                        &sep,
                        &sep_t,
                        None,
                    )
                    .unwrap();
                    let sep_y = sep.data().to_vec(&stream).unwrap();
                    let sep_tv = sep_t.to_vec(&stream).unwrap();
                    assert!(
                        got_y[part.clone()] == sep_y[..],
                        "{what}: row-major vs separate"
                    );
                    assert!(
                        got_t[part.clone()] == sep_tv[..],
                        "{what}: transposed vs separate"
                    );
                    let (want_y, want_t, _) =
                        r::cast_transpose_ref(&wide[part.clone()], rows, cols, scales[g], fmt);
                    check_against(
                        &format!("{what} row-major"),
                        &got_y[part.clone()],
                        &want_y,
                        fmt,
                        exact_nan,
                    );
                    check_against(
                        &format!("{what} transposed"),
                        &got_t[part],
                        &want_t,
                        fmt,
                        exact_nan,
                    );
                    let [(s0, ss), (i0, is), (a0, as_)] = BatchScalars::LAYOUT;
                    assert_eq!(
                        after[0][s0 + g * ss],
                        scales[g].to_bits(),
                        "{what}: scale kept"
                    );
                    assert_eq!(
                        after[1][i0 + g * is],
                        scalar_bits(&stream, sep.scale_inv()),
                        "{what}: scale_inv"
                    );
                    assert_eq!(
                        after[1][i0 + g * is],
                        (1.0 / scales[g]).to_bits(),
                        "{what}: scale_inv value"
                    );
                    assert_eq!(
                        after[2][a0 + g * as_],
                        scalar_bits(&stream, sep.amax()),
                        "{what}: amax"
                    );
                }
                for (k, (a, b)) in after.iter().zip(&before).enumerate() {
                    let (first, stride) = BatchScalars::LAYOUT[k];
                    for (i, (x, y)) in a.iter().zip(b).enumerate() {
                        let slot =
                            i >= first && (i - first) % stride == 0 && (i - first) / stride < count;
                        if !slot {
                            assert_eq!(x, y, "{what}: scalar buffer {k} element {i} written");
                        }
                    }
                }
            }
        }
    }
}

/// With the noop flag at 1 a batched cast writes nothing (outputs and every scalar as they
/// were); at 0 it runs.
#[test]
#[ignore = "needs a CUDA device"]
fn batched_cast_transpose_noop_writes_nothing() {
    let (_ctx, stream) = setup();
    let (count, rows, cols) = (4, 144, 80);
    let n = count * rows * cols;
    let noop = DeviceScalar::new(&stream, 1.0).unwrap();
    for dtype in DTYPES {
        let xs = random_data(77, n, false);
        let (input, wide) = upload(&stream, dtype, &xs);
        let scalars = BatchScalars::new(&stream, &[3.0; 4], &[0.0; 4]);
        let before = scalars.bits(&stream);
        let y = poisoned_bytes_with(&stream, n, 0xaa);
        let yt = poisoned_bytes_with(&stream, n, 0xaa);
        let out = scalars.out(&y, &yt, Fp8Format::E4M3);
        let cast = || {
            fp8_kernels::cast_transpose_batched(
                &stream,
                input.view(),
                (count, rows, cols),
                &out,
                Some(&noop),
            )
            .unwrap()
        };
        cast();
        assert!(still_poisoned(&stream, &y), "{dtype:?}: noop wrote data");
        assert!(
            still_poisoned(&stream, &yt),
            "{dtype:?}: noop wrote the transpose"
        );
        assert!(
            scalars.bits(&stream) == before,
            "{dtype:?}: noop wrote a scalar"
        );
        noop.write(&stream, 0.0).unwrap();
        cast();
        let (want_y, _, _) = r::cast_transpose_ref(&wide, count * rows, cols, 3.0, Fp8Format::E4M3);
        assert!(
            y.to_vec(&stream).unwrap() == want_y,
            "{dtype:?}: ran, row-major"
        );
        for g in 0..count {
            assert_eq!(
                out.scale_inv.get(g).unwrap().read(&stream).unwrap(),
                1.0 / 3.0,
                "{dtype:?}: ran, scale_inv {g}"
            );
            let part = &wide[g * rows * cols..(g + 1) * rows * cols];
            assert_eq!(
                out.amax.get(g).unwrap().read(&stream).unwrap(),
                r::amax(part.iter().copied()),
                "{dtype:?}: ran, amax {g}"
            );
        }
        noop.write(&stream, 1.0).unwrap();
    }
}

/// Bad batches are errors before any launch: no matrix, too many, wrong lengths, slots past
/// their buffer, misalignment, an empty dimension; nothing is written.
#[test]
#[ignore = "needs a CUDA device"]
fn batched_cast_transpose_rejects_bad_arguments() {
    let (_ctx, stream) = setup();
    let (count, rows, cols) = (3, 16, 32);
    let n = count * rows * cols;
    let x = DeviceBuffer::from_host(&stream, &vec![1.0f32; n + 4]).unwrap();
    let (exact, short, misaligned) = (
        x.slice(..n).unwrap(),
        x.slice(..n - 1).unwrap(),
        x.slice(1..n + 1).unwrap(),
    );
    let scalars = BatchScalars::new(&stream, &[1.0; 3], &[0.0; 3]);
    let before = scalars.bits(&stream);
    let big = poisoned_bytes_with(&stream, n + 16, 0xaa);
    let y = big.slice(..n).unwrap();
    let yt = poisoned_bytes_with(&stream, n, 0xaa);
    let y_short = big.slice(..n - 1).unwrap();
    let y_misaligned = big.slice(1..n + 1).unwrap();
    let out = scalars.out(&y, &yt, Fp8Format::E4M3);
    let run = |input: &DeviceBuffer<f32>, dims, o: &BatchedCastOut<'_>| {
        fp8_kernels::cast_transpose_batched(&stream, input, dims, o, None)
    };
    let with_data = |data| BatchedCastOut {
        data,
        ..out.clone()
    };
    let with_data_t = |data_t| BatchedCastOut {
        data_t,
        ..out.clone()
    };
    // The amax buffer holds 3 * 3 + 2 elements: from 2 every 4 the third slot (10) is the
    // last element and fits, from 3 it is past the end.
    let amax_at = |first, stride| BatchedCastOut {
        amax: ScalarSlots::new(DeviceScalar::at(&scalars.amax, first).unwrap(), stride),
        ..out.clone()
    };
    let scale_inv_past = BatchedCastOut {
        scale_inv: ScalarSlots::new(DeviceScalar::at(&scalars.scale_inv, 0).unwrap(), 6),
        ..out.clone()
    };
    let dims = (count, rows, cols);
    let cases = [
        (&exact, (0, rows, cols), out.clone(), "count 0"),
        (
            &exact,
            (fp8_kernels::MAX_BATCH + 1, rows, cols),
            out.clone(),
            "count above the grid",
        ),
        (&exact, (count, 0, cols), out.clone(), "empty rows"),
        (&short, dims, out.clone(), "input too short"),
        (&x, dims, out.clone(), "input too long"),
        (&misaligned, dims, out.clone(), "misaligned input"),
        (
            &exact,
            (count + 1, rows, cols),
            out.clone(),
            "one matrix more than the buffers",
        ),
        (&exact, dims, with_data(&y_short), "output too short"),
        (
            &exact,
            dims,
            with_data_t(&y_short),
            "transposed output too short",
        ),
        (&exact, dims, with_data(&y_misaligned), "misaligned output"),
        (&exact, dims, amax_at(3, 4), "amax slots past the buffer"),
        (&exact, dims, amax_at(0, usize::MAX), "amax slots overflow"),
        (
            &exact,
            dims,
            scale_inv_past,
            "scale_inv slots past the buffer",
        ),
    ];
    for (input, d, o, what) in &cases {
        assert!(run(input, *d, o).is_err(), "{what}");
    }
    stream.synchronize().unwrap();
    assert!(still_poisoned(&stream, &big), "output written on error");
    assert!(still_poisoned(&stream, &yt), "transpose written on error");
    assert!(scalars.bits(&stream) == before, "scalars written on error");
    // The edge of the amax buffer is a valid slot, and the valid call works.
    run(&exact, (count, rows, cols), &amax_at(2, 4)).unwrap();
    run(&exact, (count, rows, cols), &out).unwrap();
    assert!(
        yt.to_vec(&stream).unwrap().iter().all(|&b| b == 0x38),
        "1.0 in E4M3"
    );
    assert_eq!(out.amax.get(count - 1).unwrap().read(&stream).unwrap(), 1.0);
}

/// Input for a block-scaled test: random finite values whose magnitude varies by block, an
/// all-zero block (the last one), inf in the first block and NaN in a middle one.
fn blockwise_data(seed: u64, rows: usize, cols: usize, block: BlockShape) -> Vec<f32> {
    let mut rng = Rng(seed | 1);
    let (br, bc) = block.dims();
    let (nr, nc) = block.scales_shape(rows, cols);
    let mut xs = vec![0f32; rows * cols];
    for (i, x) in xs.iter_mut().enumerate() {
        let b = (i / cols / br) * nc + (i % cols) / bc;
        *x = rng.value() * 2f32.powi((b % 9) as i32 * 3 - 12);
    }
    let nb = nr * nc;
    let block_elems = |b: usize| {
        let (bi, bj) = (b / nc, b % nc);
        (bi * br..((bi + 1) * br).min(rows))
            .flat_map(move |r| (bj * bc..((bj + 1) * bc).min(cols)).map(move |c| r * cols + c))
    };
    if nb >= 3 {
        for i in block_elems(nb - 1) {
            xs[i] = 0.0;
        }
        let first: Vec<usize> = block_elems(0).collect();
        xs[first[first.len() / 2]] = f32::INFINITY;
        let mid: Vec<usize> = block_elems(nb / 2).collect();
        xs[*mid.last().unwrap()] = f32::NAN;
    }
    xs
}

#[test]
#[ignore = "needs a CUDA device"]
fn blockwise_matches_reference() {
    let (ctx, stream) = setup();
    let exact_nan = hardware_fp8();
    let shapes = [
        (3usize, 200usize),
        (130, 257),
        (257, 130),
        (1, 1),
        (128, 128),
        (256, 384),
        (5, 1000),
    ];
    for block in [BlockShape::Row1x128, BlockShape::Tile128x128] {
        for (di, &dtype) in DTYPES.iter().enumerate() {
            for fmt in Fp8Format::ALL {
                for (si, &(rows, cols)) in shapes.iter().enumerate() {
                    let what = format!("blockwise {block:?} {dtype:?}->{fmt:?} [{rows}, {cols}]");
                    let seed = 7000 + (di * 100 + si) as u64 * 3 + fmt as u64;
                    let xs = blockwise_data(seed, rows, cols, block);
                    let (input, wide) = upload(&stream, dtype, &xs);
                    let out = poisoned_bytes(&stream, rows * cols);
                    let ns = block.scales_len(rows, cols);
                    let scales = DeviceBuffer::<f32>::alloc(&ctx, ns).unwrap();
                    scales.fill_u32_bits(&stream, POISON_F32).unwrap();
                    fp8_kernels::quantize_blockwise(
                        &stream,
                        input.view(),
                        rows,
                        cols,
                        block,
                        fmt,
                        &out,
                        &scales,
                    )
                    .unwrap();
                    let (wy, ws) = r::quantize_blockwise_ref(&wide, rows, cols, block, fmt);
                    check_against(&what, &out.to_vec(&stream).unwrap(), &wy, fmt, exact_nan);
                    let gs = scales.to_vec(&stream).unwrap();
                    for (b, (g, w)) in gs.iter().zip(&ws).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "{what}: scale_inv[{b}] {g} vs {w}"
                        );
                    }
                    if ns >= 3 {
                        assert_eq!(ws[ns - 1], 1.0, "{what}: the zero block has scale 1");
                        assert_eq!(ws[0], 1.0, "{what}: the inf block has scale 1");
                        assert_eq!(ws[ns / 2], 1.0, "{what}: the NaN block has scale 1");
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn bad_input_is_rejected_before_any_launch() {
    let (ctx, stream) = setup();
    let (rows, cols) = (16, 20);
    let n = rows * cols;
    let x = DeviceBuffer::from_host(&stream, &vec![1.0f32; n + 4]).unwrap();
    // Views into x (n + 4 elements): the first n, and n starting 4 bytes in (misaligned).
    let (exact, misaligned) = (x.slice(..n).unwrap(), x.slice(1..n + 1).unwrap());
    let out = poisoned_matrix(&stream, rows, cols, Fp8Format::E4M3);
    out.amax().write(&stream, 5.0).unwrap();
    out.scale_inv().write(&stream, 9.0).unwrap();
    let out_t = poisoned_bytes(&stream, n);
    let mut short_t = poisoned_bytes(&stream, n - 1);
    let mut transposed_shape = poisoned_matrix(&stream, cols, rows, Fp8Format::E4M3);
    let ct = |input: HpBuffer<'_>, rr, cc, o: &Fp8Tensor, t: &DeviceBuffer<u8>| {
        fp8_kernels::cast_transpose(&stream, input, rr, cc, o, t, None)
    };
    assert!(
        ct(HpBuffer::F32(&x), rows, cols, &out, &out_t).is_err(),
        "input length"
    );
    assert!(
        ct(HpBuffer::F32(&misaligned), rows, cols, &out, &out_t).is_err(),
        "misaligned"
    );
    assert!(
        ct(HpBuffer::F32(&exact), rows, cols, &out, &mut short_t).is_err(),
        "out_t length"
    );
    assert!(
        ct(
            HpBuffer::F32(&exact),
            rows,
            cols,
            &mut transposed_shape,
            &out_t
        )
        .is_err(),
        "out shape [cols, rows]"
    );
    assert!(
        ct(HpBuffer::F32(&exact), 0, cols, &out, &out_t).is_err(),
        "empty rows"
    );
    assert!(
        ct(HpBuffer::F32(&exact), cols, rows, &out, &out_t).is_err(),
        "swapped dims"
    );
    let big_t = poisoned_bytes(&stream, n + 16);
    // A view of n bytes 1 byte into big_t (n + 16 bytes).
    let misaligned_t = big_t.slice(1..n + 1).unwrap();
    assert!(
        ct(HpBuffer::F32(&exact), rows, cols, &out, &misaligned_t).is_err(),
        "misaligned out_t"
    );
    // Block-scaled.
    let mut bq = poisoned_bytes(&stream, n);
    let mut bs =
        DeviceBuffer::<f32>::alloc(&ctx, BlockShape::Row1x128.scales_len(rows, cols)).unwrap();
    bs.fill_u32_bits(&stream, POISON_F32).unwrap();
    let mut bs_short = DeviceBuffer::<f32>::alloc(&ctx, 1).unwrap();
    let bw = |input: HpBuffer<'_>, block, o: &DeviceBuffer<u8>, s: &DeviceBuffer<f32>| {
        fp8_kernels::quantize_blockwise(&stream, input, rows, cols, block, Fp8Format::E4M3, o, s)
    };
    assert!(
        bw(HpBuffer::F32(&x), BlockShape::Row1x128, &mut bq, &mut bs).is_err(),
        "input length"
    );
    assert!(
        bw(
            HpBuffer::F32(&misaligned),
            BlockShape::Row1x128,
            &mut bq,
            &mut bs
        )
        .is_err(),
        "misaligned"
    );
    assert!(
        bw(
            HpBuffer::F32(&exact),
            BlockShape::Row1x128,
            &mut bq,
            &mut bs_short
        )
        .is_err(),
        "scales length"
    );
    assert!(
        bw(
            HpBuffer::F32(&exact),
            BlockShape::Tile128x128,
            &mut bq,
            &mut bs
        )
        .is_err(),
        "1x128 scale count for 128x128 blocks"
    );
    assert!(
        bw(
            HpBuffer::F32(&exact),
            BlockShape::Row1x128,
            &mut short_t,
            &mut bs
        )
        .is_err(),
        "out length"
    );
    stream.synchronize().unwrap();
    for (name, b) in [
        ("out", out.data()),
        ("out_t", &out_t),
        ("short_t", &short_t),
        ("bq", &bq),
        ("big_t", &big_t),
    ] {
        assert!(
            b.to_vec(&stream).unwrap().iter().all(|&v| v == 0xff),
            "{name} written on error"
        );
    }
    assert!(
        transposed_shape
            .data()
            .to_vec(&stream)
            .unwrap()
            .iter()
            .all(|&v| v == 0xff)
    );
    assert_eq!(
        out.amax().read(&stream).unwrap(),
        5.0,
        "amax written on error"
    );
    assert_eq!(
        out.scale_inv().read(&stream).unwrap(),
        9.0,
        "scale_inv written on error"
    );
    let bsv = bs.to_vec(&stream).unwrap();
    assert!(
        bsv.iter().all(|v| v.to_bits() == POISON_F32),
        "scales written on error"
    );
    // The valid call still works afterwards.
    ct(HpBuffer::F32(&exact), rows, cols, &out, &out_t).unwrap();
    assert_eq!(out.amax().read(&stream).unwrap(), 5.0, "amax max(5, 1)");
    assert!(
        out_t.to_vec(&stream).unwrap().iter().all(|&v| v == 0x38),
        "1.0 in E4M3"
    );
}

/// Not a target check (the integrator's `bench fp8-cast` owns that): prints the bandwidth
/// of bf16 -> E4M3 cast-transpose of an 8192 x 16384 matrix (4 bytes an element: 2 read, 1 +
/// 1 written) beside a device copy of the same bf16 buffer, and checks the timed results.
#[test]
#[ignore = "needs a CUDA device"]
fn bandwidth_probe_cast_transpose_bf16() {
    let (ctx, stream) = setup();
    let (rows, cols) = (8192usize, 16384usize);
    let n = rows * cols;
    let x = DeviceBuffer::<cuda_graph::half::bf16>::alloc(&ctx, n).unwrap();
    x.memset_bytes(&stream, 0x3f).unwrap(); // every element bf16 0x3f3f
    let copy = DeviceBuffer::<cuda_graph::half::bf16>::alloc(&ctx, n).unwrap();
    let out = Fp8Tensor::new(&stream, &[rows, cols], Fp8Format::E4M3).unwrap();
    let out_t = DeviceBuffer::<u8>::alloc(&ctx, n).unwrap();
    let bq = DeviceBuffer::<u8>::alloc(&ctx, n).unwrap();
    let bs = DeviceBuffer::<f32>::alloc(&ctx, BlockShape::Row1x128.scales_len(rows, cols)).unwrap();
    let time = |f: &mut dyn FnMut()| mean_ms(&stream, f);
    let ct_ms = time(&mut || {
        fp8_kernels::cast_transpose(&stream, HpBuffer::Bf16(&x), rows, cols, &out, &out_t, None)
            .unwrap()
    });
    let c_ms = time(&mut || copy.copy_from_device(&stream, &x).unwrap());
    let b_ms = time(&mut || {
        fp8_kernels::quantize_blockwise(
            &stream,
            HpBuffer::Bf16(&x),
            rows,
            cols,
            BlockShape::Row1x128,
            Fp8Format::E4M3,
            &bq,
            &bs,
        )
        .unwrap()
    });
    let ct_gbs = 4.0 * n as f64 / (f64::from(ct_ms) * 1e6);
    let c_gbs = 4.0 * n as f64 / (f64::from(c_ms) * 1e6);
    let b_gbs = (3.0 * n as f64 + 4.0 * bs.len() as f64) / (f64::from(b_ms) * 1e6);
    eprintln!(
        "cast-transpose bf16->e4m3 8192x16384: {ct_ms:.3} ms, {ct_gbs:.0} GB/s; d2d copy: {c_ms:.3} ms, {c_gbs:.0} GB/s; ratio {:.2}; blockwise 1x128 quantize: {b_ms:.3} ms, {b_gbs:.0} GB/s",
        ct_gbs / c_gbs
    );
    let v = r::widen(0x3f3f, DType::Bf16);
    assert_eq!(out.amax().read(&stream).unwrap(), v);
    let want = r::quantize(v, 1.0, Fp8Format::E4M3);
    assert!(
        out.data()
            .to_vec(&stream)
            .unwrap()
            .iter()
            .all(|&b| b == want),
        "timed row-major output"
    );
    assert!(
        out_t.to_vec(&stream).unwrap().iter().all(|&b| b == want),
        "timed transposed output"
    );
    let bwant = r::quantize(v, r::current_scale(v, Fp8Format::E4M3), Fp8Format::E4M3);
    assert!(
        bq.to_vec(&stream).unwrap().iter().all(|&b| b == bwant),
        "timed blockwise output"
    );
}

/// Not a target check: prints the time of a MoE layer's expert-weight casts (8 experts, W1
/// [4096, 2048] and W2 [2048, 2048] bf16 -> E4M3, 384 MB moved) as two batched launches,
/// beside the same casts as 16 plain launches and a device copy moving the same bytes, and
/// checks the timed results.
#[test]
#[ignore = "needs a CUDA device"]
fn bandwidth_probe_batched_expert_weights() {
    use cuda_graph::half::bf16;
    let (ctx, stream) = setup();
    let experts = 8usize;
    let shapes = [(4096usize, 2048usize), (2048, 2048)];
    struct Weight {
        rows: usize,
        cols: usize,
        w: DeviceBuffer<bf16>,
        y: DeviceBuffer<u8>,
        yt: DeviceBuffer<u8>,
        scalars: BatchScalars,
        parts: Vec<(Fp8Tensor, DeviceBuffer<u8>)>,
    }
    let weights: Vec<Weight> = shapes
        .iter()
        .map(|&(rows, cols)| {
            let n = experts * rows * cols;
            let w = DeviceBuffer::<bf16>::alloc(&ctx, n).unwrap();
            w.memset_bytes(&stream, 0x3f).unwrap(); // every element bf16 0x3f3f
            let parts = (0..experts)
                .map(|_| {
                    let t = Fp8Tensor::new(&stream, &[rows, cols], Fp8Format::E4M3).unwrap();
                    (t, DeviceBuffer::<u8>::alloc(&ctx, rows * cols).unwrap())
                })
                .collect();
            Weight {
                rows,
                cols,
                w,
                y: DeviceBuffer::alloc(&ctx, n).unwrap(),
                yt: DeviceBuffer::alloc(&ctx, n).unwrap(),
                scalars: BatchScalars::new(&stream, &vec![1.0; experts], &vec![0.0; experts]),
                parts,
            }
        })
        .collect();
    let bytes: usize = shapes.iter().map(|&(r, c)| 4 * experts * r * c).sum();
    let copy_src = DeviceBuffer::<u8>::alloc(&ctx, bytes / 2).unwrap();
    let copy_dst = DeviceBuffer::<u8>::alloc(&ctx, bytes / 2).unwrap();
    let time = |f: &mut dyn FnMut()| mean_ms(&stream, f) * 1e3;
    let batched_us = time(&mut || {
        for w in &weights {
            let out = w.scalars.out(&w.y, &w.yt, Fp8Format::E4M3);
            let dims = (experts, w.rows, w.cols);
            fp8_kernels::cast_transpose_batched(&stream, &w.w, dims, &out, None).unwrap();
        }
    });
    let plain_us = time(&mut || {
        for w in &weights {
            let n = w.rows * w.cols;
            for (x, (t, tt)) in w.parts.iter().enumerate() {
                let part = w.w.slice(x * n..(x + 1) * n).unwrap();
                fp8_kernels::cast_transpose(&stream, &part, w.rows, w.cols, t, tt, None).unwrap();
            }
        }
    });
    let copy_us = time(&mut || copy_dst.copy_from_device(&stream, &copy_src).unwrap());
    let tbs = |us: f32| bytes as f64 / (f64::from(us) * 1e6);
    eprintln!(
        "expert weights, 8 x ([4096, 2048] + [2048, 2048]) bf16 -> e4m3, {} MB: batched (2 \
         launches) {batched_us:.1} us, {:.2} TB/s; plain (16 launches) {plain_us:.1} us, {:.2} \
         TB/s; device copy of as many bytes {copy_us:.1} us, {:.2} TB/s",
        bytes / 1_000_000,
        tbs(batched_us),
        tbs(plain_us),
        tbs(copy_us)
    );
    let v = r::widen(0x3f3f, DType::Bf16);
    let want = r::quantize(v, 1.0, Fp8Format::E4M3);
    for w in &weights {
        assert!(
            w.y.to_vec(&stream).unwrap().iter().all(|&b| b == want),
            "timed row-major"
        );
        assert!(
            w.yt.to_vec(&stream).unwrap().iter().all(|&b| b == want),
            "timed transposed"
        );
        let out = w.scalars.out(&w.y, &w.yt, Fp8Format::E4M3);
        for g in 0..experts {
            assert_eq!(
                out.amax.get(g).unwrap().read(&stream).unwrap(),
                v,
                "amax {g}"
            );
        }
    }
}
