//! The model's ops (`fp8_moe::model::ops::Ops`) against the f64 host models
//! (`fp8_moe::model::ops_reference`), each on fresh random data (the seed is printed;
//! `FP8_MOE_TEST_SEED` replays one), every output poisoned first (bytes 0xFF: NaN in bf16 and
//! f32), on the 16-byte vector path and on the scalar path (odd widths, misaligned views):
//!
//! * embedding forward and `add`: bit for bit against the host's rounding of the same f32
//!   values; out-of-range tokens give zero rows; `add` in place;
//! * embedding backward, RMSNorm forward and backward (with and without the residual
//!   gradient, in place, accumulating), cross-entropy (ignored and out-of-range targets),
//!   `sum` and the gradient norm: within bounds derived from f32 rounding (each tolerance's
//!   comment says how);
//! * the embedding and RMSNorm weight gradients and the gradient norm bit-identical over two
//!   runs, and a captured graph of all the ops replaying the eager run's bits;
//! * wrong lengths and overlaps rejected with `InvalidArgument`, nothing written.

use std::sync::Arc;

mod common;
use common::{f64s, f64s_bf16, fresh_rng, to_bf16};

use cuda_graph::half::{bf16, f16};
use cuda_graph::{
    CaptureMode, Context, DeviceBuffer, DeviceRepr, Error, GraphExec, InstantiateFlags, Result,
    Stream,
};
use fp8_kernels::HpBuffer;
use fp8_moe::model::ops::{Ops, grad_norm_workspace_len, rmsnorm_backward_workspace_len};
use fp8_moe::model::ops_reference as rf;
use fp8_moe::rng::Rng;

/// The f32 unit roundoff, 2^-24: one rounding of a value `v` moves it by at most `U * |v|`.
const U: f64 = 1.0 / (1u64 << 24) as f64;
/// Half a bf16 ulp relative to the value: bf16 keeps 8 significant bits, so rounding `v` to
/// nearest moves it by at most `2^-8 * |v|`.
const BF16_HALF_ULP: f64 = 1.0 / 256.0;

struct Gpu {
    _ctx: Arc<Context>,
    stream: Stream,
    ops: Ops,
}

impl Gpu {
    fn new() -> Gpu {
        let ctx = Context::default_device().expect("a CUDA device");
        let stream = Stream::new(&ctx).unwrap();
        let ops = Ops::new(&ctx).unwrap();
        Gpu {
            _ctx: ctx,
            stream,
            ops,
        }
    }

    /// `n` elements of device memory, poisoned (0xFF bytes); `misaligned` gives a view one
    /// element past a 16-byte boundary, which forces the kernels' scalar path.
    fn alloc<T: DeviceRepr>(&self, n: usize, misaligned: bool) -> DeviceBuffer<T> {
        let at = usize::from(misaligned);
        let b = DeviceBuffer::<T>::alloc(self.stream.context(), n + at + 8).unwrap();
        let v = b.slice(at..at + n).unwrap();
        v.memset_bytes(&self.stream, 0xFF).unwrap();
        v
    }

    /// `data` uploaded, as [`alloc`](Self::alloc) places it.
    fn put<T: DeviceRepr>(&self, data: &[T], misaligned: bool) -> DeviceBuffer<T> {
        let b = self.alloc(data.len(), misaligned);
        b.copy_from_host(&self.stream, data).unwrap();
        b
    }

    fn get<T: DeviceRepr>(&self, b: &DeviceBuffer<T>) -> Vec<T> {
        b.to_vec(&self.stream).unwrap()
    }
}

/// bf16 outputs whose f32 value is within `delta(i)` of the f64 value `want[i]`, then
/// rounded once: `|got - want| <= 2^-8 |want| + 2 delta` (half an ulp of the f32 value, which
/// may round either way when it sits within `delta` of a rounding boundary; the factor 2
/// covers `2^-8 * delta` too). NaN (the poison) fails.
#[track_caller]
fn check_bf16(what: &str, got: &[bf16], want: &[f64], delta: impl Fn(usize) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, &w)) in got.iter().zip(want).enumerate() {
        let g = f64::from(g.to_f32());
        let tol = BF16_HALF_ULP * w.abs() + 2.0 * delta(i);
        assert!(
            (g - w).abs() <= tol,
            "{what}[{i}]: got {g}, want {w} (tolerance {tol:e})"
        );
    }
}

/// f32 outputs within `tol(i)` of the f64 values. NaN (the poison) fails.
#[track_caller]
fn check_f32(what: &str, got: &[f32], want: &[f64], tol: impl Fn(usize) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (g, tol) = (f64::from(g), tol(i));
        assert!(
            (g - w).abs() <= tol,
            "{what}[{i}]: got {g}, want {w} (tolerance {tol:e})"
        );
    }
}

fn bits_bf16(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bits_f32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `n` random tokens in `0..vocab`, `skew` of them (a fraction) the token 32 (a byte
/// text's space), so one row of the embedding gradient sums many rows.
fn tokens(rng: &mut Rng, n: usize, vocab: usize, skew: f64) -> Vec<i32> {
    (0..n)
        .map(|_| {
            if (rng.below(1000) as f64) < skew * 1000.0 {
                32
            } else {
                rng.below(vocab) as i32
            }
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn embedding_forward_copies_rows() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("embedding_forward_copies_rows");
    let vocab = 256;
    for (t, d, misaligned) in [(1000, 512, false), (333, 20, false), (200, 512, true)] {
        let what = format!("embedding_forward T {t} d {d} misaligned {misaligned}");
        let mut toks = tokens(&mut rng, t, vocab, 0.2);
        toks[3] = -1;
        toks[t - 1] = vocab as i32;
        let table_h = rng.vec(vocab * d, 1.0);
        let tok = gpu.put(&toks, false);
        let table = gpu.put(&table_h, misaligned);
        let out = gpu.alloc::<bf16>(t * d, misaligned);
        gpu.ops
            .embedding_forward(&gpu.stream, &tok, &table, &out, vocab)
            .unwrap();
        let got = gpu.get(&out);
        // Exact: one rounding of the same f32 value, to nearest even on both sides.
        for (i, &tk) in toks.iter().enumerate() {
            let row = &got[i * d..(i + 1) * d];
            if (0..vocab as i32).contains(&tk) {
                let want = to_bf16(&table_h[tk as usize * d..(tk as usize + 1) * d]);
                assert_eq!(bits_bf16(row), bits_bf16(&want), "{what}: row {i}");
            } else {
                assert!(row.iter().all(|v| v.to_bits() == 0), "{what}: row {i} zero");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn embedding_backward_sums_rows_per_token() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("embedding_backward_sums_rows_per_token");
    let vocab = 256;
    // 5000 tokens: two of the kernel's 4096-token scan tiles.
    for (t, d, misaligned) in [(5000, 512, false), (300, 20, false), (700, 64, true)] {
        let what = format!("embedding_backward T {t} d {d} misaligned {misaligned}");
        let mut toks = tokens(&mut rng, t, vocab, 0.4);
        toks[7] = -3;
        toks[11] = vocab as i32;
        let dout_h = to_bf16(&rng.vec(t * d, 1.0));
        let old_h = rng.vec(vocab * d, 1.0);
        let tok = gpu.put(&toks, false);
        let dout = gpu.put(&dout_h, misaligned);
        let dtable = gpu.alloc::<f32>(vocab * d, misaligned);
        let dout64 = f64s_bf16(&dout_h);
        let want = rf::embedding_backward(&toks, &dout64, vocab);
        // |dout| summed per table element, and the rows each table row sums.
        let abs = rf::embedding_backward(
            &toks,
            &dout64.iter().map(|v| v.abs()).collect::<Vec<_>>(),
            vocab,
        );
        let count = |v: usize| toks.iter().filter(|&&k| k == v as i32).count() as f64;
        // The terms are bf16, exact in f32; n of them summed in f32 in any order are within
        // (n - 1) U sum|term| of the exact sum (adding the old value: one more term).
        let tol = |i: usize, old: f64| (count(i / d) + 1.0) * U * (abs[i] + old.abs());

        gpu.ops
            .embedding_backward(&gpu.stream, &tok, &dout, &dtable, false)
            .unwrap();
        let first = gpu.get(&dtable);
        check_f32(&what, &first, &want, |i| tol(i, 0.0));
        // Deterministic: the same bits again (the buffer poisoned in between).
        dtable.memset_bytes(&gpu.stream, 0xFF).unwrap();
        gpu.ops
            .embedding_backward(&gpu.stream, &tok, &dout, &dtable, false)
            .unwrap();
        assert_eq!(
            bits_f32(&gpu.get(&dtable)),
            bits_f32(&first),
            "{what}: rerun"
        );

        // Accumulating onto old values.
        dtable.copy_from_host(&gpu.stream, &old_h).unwrap();
        gpu.ops
            .embedding_backward(&gpu.stream, &tok, &dout, &dtable, true)
            .unwrap();
        let want_acc: Vec<f64> = want
            .iter()
            .zip(&old_h)
            .map(|(w, &o)| w + f64::from(o))
            .collect();
        check_f32(
            &format!("{what} accumulate"),
            &gpu.get(&dtable),
            &want_acc,
            |i| tol(i, f64::from(old_h[i])),
        );
    }
}

/// RMSNorm inputs: x (bf16, scale 2), w (f32 around 1).
fn rms_inputs(rng: &mut Rng, rows: usize, cols: usize) -> (Vec<bf16>, Vec<f32>) {
    let x = to_bf16(&rng.vec(rows * cols, 2.0));
    let w = rng.vec(cols, 0.5).into_iter().map(|v| 1.0 + v).collect();
    (x, w)
}

#[test]
#[ignore = "needs a CUDA device"]
fn rmsnorm_forward_matches_f64() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("rmsnorm_forward_matches_f64");
    let eps = 1e-5f32;
    for (rows, cols, misaligned) in [
        (300, 512, false),
        (77, 20, false),
        (64, 4096, false),
        (50, 512, true),
    ] {
        let what = format!("rmsnorm_forward {rows} x {cols} misaligned {misaligned}");
        let (x_h, w_h) = rms_inputs(&mut rng, rows, cols);
        let x = gpu.put(&x_h, misaligned);
        let w = gpu.put(&w_h, false);
        let y = gpu.alloc::<bf16>(rows * cols, false);
        let rstd = gpu.alloc::<f32>(rows, false);
        gpu.ops
            .rmsnorm_forward(&gpu.stream, &x, &w, &y, &rstd, eps)
            .unwrap();
        let want = rf::rmsnorm_forward(&f64s_bf16(&x_h), &f64s(&w_h), f64::from(eps));
        // rstd: the mean square sums cols positive terms, each lane cols / 32 of them then a
        // 5-level tree (relative error <= (cols / 32 + 6) U), the root halves that; the
        // division, square root and reciprocal add a few U.
        let rel_rstd = (cols as f64 / 32.0 + 10.0) * U;
        check_f32(&format!("{what}: rstd"), &gpu.get(&rstd), &want.rstd, |i| {
            rel_rstd * want.rstd[i]
        });
        // y = (x * rstd) * w: rstd's error and two more roundings, then bf16.
        check_bf16(&format!("{what}: y"), &gpu.get(&y), &want.y, |i| {
            (rel_rstd + 3.0 * U) * want.y[i].abs()
        });
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn rmsnorm_backward_matches_f64() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("rmsnorm_backward_matches_f64");
    let eps = 1e-5;
    // (rows, cols, misaligned, residual: 0 none, 1 separate, 2 in place, accumulate dw)
    for (rows, cols, misaligned, residual, acc) in [
        (1000, 512, false, 1, false),
        (1000, 512, false, 2, true),
        (45, 20, false, 0, false),
        (300, 1024, true, 1, true),
        (33, 8, false, 2, false),
    ] {
        let what = format!(
            "rmsnorm_backward {rows} x {cols} misaligned {misaligned} residual {residual} accumulate {acc}"
        );
        let n = rows * cols;
        let (x_h, w_h) = rms_inputs(&mut rng, rows, cols);
        let dy_h = to_bf16(&rng.vec(n, 1.0));
        let res_h = to_bf16(&rng.vec(n, 1.0));
        let old_dw = rng.vec(cols, 1.0);
        let (x64, w64, dy64, res64) = (
            f64s_bf16(&x_h),
            f64s(&w_h),
            f64s_bf16(&dy_h),
            f64s_bf16(&res_h),
        );
        // The kernel takes rstd as the forward left it (f32); the reference the same values.
        let rstd_h: Vec<f32> = rf::rmsnorm_forward(&x64, &w64, eps)
            .rstd
            .iter()
            .map(|&r| r as f32)
            .collect();
        let rstd64 = f64s(&rstd_h);
        let x = gpu.put(&x_h, misaligned);
        let w = gpu.put(&w_h, false);
        let rstd = gpu.put(&rstd_h, false);
        let dy = gpu.put(&dy_h, misaligned);
        let res = gpu.put(&res_h, misaligned);
        let sep_dx = gpu.alloc::<bf16>(n, misaligned);
        let dx = if residual == 2 { &res } else { &sep_dx };
        let dw = gpu.put(&old_dw, false);
        if !acc {
            dw.memset_bytes(&gpu.stream, 0xFF).unwrap();
        }
        let ws = gpu.alloc::<f32>(rmsnorm_backward_workspace_len(rows, cols), false);
        let res_arg = (residual > 0).then_some(&res);
        gpu.ops
            .rmsnorm_backward(&gpu.stream, &x, &w, &rstd, &dy, res_arg, dx, &dw, acc, &ws)
            .unwrap();
        let want = rf::rmsnorm_backward(
            &x64,
            &w64,
            &rstd64,
            &dy64,
            (residual > 0).then_some(&res64[..]),
        );
        // dx: the row's dot sum_c g * xhat has cols terms of three roundings each, summed in
        // cols / 32 steps per lane and a 5-level tree; its error scaled into the row is at
        // most (cols / 32 + 12) U * |xhat| * mean_c |g * xhat|; the remaining operations add a
        // few U of |res| + rstd * (|g| + |xhat * mean|).
        let k = (cols as f64 / 32.0 + 12.0) * U;
        let mean_abs: Vec<f64> = (0..rows)
            .map(|t| {
                (t * cols..(t + 1) * cols)
                    .map(|j| (dy64[j] * w64[j % cols] * x64[j] * rstd64[t]).abs())
                    .sum::<f64>()
                    / cols as f64
            })
            .collect();
        let delta = |i: usize| {
            let t = i / cols;
            let r = rstd64[t];
            let mean_abs = mean_abs[t];
            let xhat = (x64[i] * r).abs();
            let res = if residual > 0 { res64[i].abs() } else { 0.0 };
            k * (res + r * ((dy64[i] * w64[i % cols]).abs() + xhat * mean_abs))
        };
        check_bf16(&format!("{what}: dx"), &gpu.get(dx), &want.dx, delta);
        // dw: rows terms dy * (x * rstd) (two roundings each) summed in f32 in some order:
        // within (rows + 3) U of the sum of |terms| (plus |old| when accumulating).
        let abs_dw: Vec<f64> = (0..cols)
            .map(|c| {
                (0..rows)
                    .map(|t| (dy64[t * cols + c] * x64[t * cols + c] * rstd64[t]).abs())
                    .sum()
            })
            .collect();
        let want_dw: Vec<f64> = if acc {
            want.dw
                .iter()
                .zip(&old_dw)
                .map(|(w, &o)| w + f64::from(o))
                .collect()
        } else {
            want.dw.clone()
        };
        let old = |c: usize| if acc { f64::from(old_dw[c]).abs() } else { 0.0 };
        let got_dw = gpu.get(&dw);
        check_f32(&format!("{what}: dw"), &got_dw, &want_dw, |c| {
            (rows as f64 + 3.0) * U * (abs_dw[c] + old(c))
        });

        // Deterministic: rerun from the same inputs, the same bits (not in place: the first
        // run overwrote the residual).
        if residual != 2 {
            let first_dx = bits_bf16(&gpu.get(dx));
            dx.memset_bytes(&gpu.stream, 0xFF).unwrap();
            dw.copy_from_host(&gpu.stream, &old_dw).unwrap();
            gpu.ops
                .rmsnorm_backward(&gpu.stream, &x, &w, &rstd, &dy, res_arg, dx, &dw, acc, &ws)
                .unwrap();
            assert_eq!(bits_bf16(&gpu.get(dx)), first_dx, "{what}: dx rerun");
            assert_eq!(
                bits_f32(&gpu.get(&dw)),
                bits_f32(&got_dw),
                "{what}: dw rerun"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn add_rounds_the_f32_sum() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("add_rounds_the_f32_sum");
    for (n, misaligned, in_place) in [
        (1000 * 512 + 3, false, false),
        (4099, true, false),
        (4096, false, true),
    ] {
        let what = format!("add n {n} misaligned {misaligned} in place {in_place}");
        let a_h = to_bf16(&rng.vec(n, 4.0));
        let b_h = to_bf16(&rng.vec(n, 1.0));
        let a = gpu.put(&a_h, misaligned);
        let b = gpu.put(&b_h, false);
        let sep = gpu.alloc::<bf16>(n, misaligned);
        let out = if in_place { &a } else { &sep };
        gpu.ops.add(&gpu.stream, &a, &b, out).unwrap();
        // Exact: the same f32 sum rounded once to nearest even on both sides.
        let want: Vec<bf16> = a_h
            .iter()
            .zip(&b_h)
            .map(|(x, y)| bf16::from_f32(x.to_f32() + y.to_f32()))
            .collect();
        assert_eq!(bits_bf16(&gpu.get(out)), bits_bf16(&want), "{what}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cross_entropy_matches_f64() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("cross_entropy_matches_f64");
    for (t, v, misaligned) in [
        (500, 256, false),
        (64, 3000, false),
        (33, 7, false),
        (40, 256, true),
    ] {
        let what = format!("cross_entropy T {t} V {v} misaligned {misaligned}");
        let mut logits_h = rng.vec(t * v, 4.0);
        // A row far from 0: the max subtraction keeps it finite.
        logits_h[v..2 * v].iter_mut().for_each(|l| *l += 50.0);
        let mut targets_h: Vec<i32> = (0..t).map(|_| rng.below(v) as i32).collect();
        targets_h[3] = -1; // ignored
        targets_h[5] = v as i32; // a data error: NaN
        let scale = 1.0 / t as f32;
        let logits = gpu.put(&logits_h, misaligned);
        let targets = gpu.put(&targets_h, false);
        let loss = gpu.alloc::<f32>(t, false);
        let dlogits = gpu.alloc::<bf16>(t * v, misaligned);
        gpu.ops
            .cross_entropy(&gpu.stream, &logits, &targets, scale, &loss, &dlogits)
            .unwrap();
        let l64 = f64s(&logits_h);
        let want = rf::cross_entropy(&l64, &targets_h, f64::from(scale));
        let (got_loss, got_d) = (gpu.get(&loss), gpu.get(&dlogits));
        for r in 0..t {
            let row = r * v..(r + 1) * v;
            if r == 3 {
                assert_eq!(got_loss[r], 0.0, "{what}: ignored row's loss");
                assert!(
                    got_d[row].iter().all(|g| g.to_f32() == 0.0),
                    "{what}: ignored row"
                );
                continue;
            }
            if r == 5 {
                assert!(got_loss[r].is_nan(), "{what}: bad target's loss");
                assert!(
                    got_d[row].iter().all(|g| g.is_nan()),
                    "{what}: bad target's row"
                );
                continue;
            }
            let m = l64[row.clone()]
                .iter()
                .copied()
                .fold(f64::NEG_INFINITY, f64::max);
            let lt = l64[r * v + targets_h[r] as usize];
            let lse = want.loss_rows[r] + lt;
            // z sums V exponentials (lanes V / 32 each, a 5-level tree), each expf within
            // 2 ulp plus |l - m| <= 16 U from rounding its argument: z within (V / 32 + 25)
            // U relative, so log z within that absolutely; m + log z and the subtraction of
            // the target's logit round on values up to |m|, |lse|, |l_t|.
            let k = (v as f64 / 32.0 + 25.0) * U;
            let tol = k + 2.0 * U * (m.abs() + lse.abs() + lt.abs());
            check_f32(
                &format!("{what}: loss row {r}"),
                &got_loss[r..r + 1],
                &want.loss_rows[r..r + 1],
                |_| tol,
            );
            // Each probability within z's error, expf's and the division's: (V / 32 + 30) U
            // relative; minus the one-hot and times the scale, one rounding more each.
            check_bf16(
                &format!("{what}: dlogits row {r}"),
                &got_d[row.clone()],
                &want.dlogits[row.clone()],
                |c| {
                    let g = want.dlogits[r * v + c];
                    let p = (l64[r * v + c] - m).exp() / (lse - m).exp();
                    (k + 5.0 * U) * p * f64::from(scale) + 2.0 * U * g.abs()
                },
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn sum_is_one_f32_rounding_of_the_total() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("sum_is_one_f32_rounding_of_the_total");
    for (n, misaligned, acc) in [
        (65536 + 3, false, false),
        (65536, true, true),
        (1000, false, true),
        (0, false, false),
    ] {
        let what = format!("sum n {n} misaligned {misaligned} accumulate {acc}");
        let v_h = rng.vec(n, 3.0);
        let values = gpu.put(&v_h, misaligned);
        let old = 2.5f32;
        let out = gpu.put(&[7.0f32, old, 7.0], false);
        if !acc {
            out.slice(1..2)
                .unwrap()
                .memset_bytes(&gpu.stream, 0xFF)
                .unwrap();
        }
        gpu.ops.sum(&gpu.stream, &values, &out, 1, acc).unwrap();
        let got = gpu.get(&out);
        assert_eq!((got[0], got[2]), (7.0, 7.0), "{what}: neighbours untouched");
        let want = rf::sum(&f64s(&v_h)) + if acc { f64::from(old) } else { 0.0 };
        let abs: f64 = v_h.iter().map(|v| f64::from(v.abs())).sum::<f64>() + f64::from(old);
        // f64 sums (n additions of 2^-53 each at most, relative to sum |v|), then one
        // rounding to f32 (2^-24 of the value).
        let tol = U * want.abs() + (n as f64 + 2.0) * 2f64.powi(-53) * abs;
        check_f32(&what, &got[1..2], &[want], |_| tol);
    }
}

/// Gradients of every dtype and many sizes: more than one launch's 16 tensors, an empty
/// one, a misaligned view, tails past the 16-byte pieces.
struct Grads {
    f32s: Vec<DeviceBuffer<f32>>,
    bf16s: Vec<DeviceBuffer<bf16>>,
    f16s: Vec<DeviceBuffer<f16>>,
    /// Every tensor's values as f64, in `list`'s order.
    host: Vec<Vec<f64>>,
}

impl Grads {
    fn new(gpu: &Gpu, rng: &mut Rng) -> Grads {
        let mut g = Grads {
            f32s: Vec::new(),
            bf16s: Vec::new(),
            f16s: Vec::new(),
            host: Vec::new(),
        };
        let mut f32_host = Vec::new();
        let mut bf16_host = Vec::new();
        let mut f16_host = Vec::new();
        for (i, n) in [1_000_003, 4096, 100, 1, 0, 777, 16 * 1024 + 9]
            .into_iter()
            .chain((0..14).map(|i| 37 * i + 3))
            .enumerate()
        {
            let v = rng.vec(n, 0.05);
            let misaligned = i % 4 == 2;
            match i % 3 {
                0 => {
                    g.f32s.push(gpu.put(&v, misaligned));
                    f32_host.push(f64s(&v));
                }
                1 => {
                    let b = to_bf16(&v);
                    bf16_host.push(f64s_bf16(&b));
                    g.bf16s.push(gpu.put(&b, misaligned));
                }
                _ => {
                    let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
                    f16_host.push(h.iter().map(|x| f64::from(x.to_f32())).collect());
                    g.f16s.push(gpu.put(&h, misaligned));
                }
            }
        }
        g.host = f32_host
            .into_iter()
            .chain(bf16_host)
            .chain(f16_host)
            .collect();
        g
    }

    fn list(&self) -> Vec<HpBuffer<'_>> {
        let f = self.f32s.iter().map(HpBuffer::from);
        let b = self.bf16s.iter().map(HpBuffer::from);
        let h = self.f16s.iter().map(HpBuffer::from);
        f.chain(b).chain(h).collect()
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn grad_norm_clip_matches_pytorch_semantics() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("grad_norm_clip_matches_pytorch_semantics");
    let grads = Grads::new(&gpu, &mut rng);
    let list = grads.list();
    let lens: Vec<usize> = list.iter().map(|g| g.len()).collect();
    assert!(lens.len() > 16, "more than one launch");
    let ws = gpu.alloc::<f32>(grad_norm_workspace_len(&lens), false);
    let out = gpu.alloc::<f32>(2, false);
    let host: Vec<&[f64]> = grads.host.iter().map(|v| &v[..]).collect();
    let mut first = None;
    for max_norm in [1.0f32, 1e6] {
        out.memset_bytes(&gpu.stream, 0xFF).unwrap();
        gpu.ops
            .grad_norm_clip(&gpu.stream, &list, &ws, max_norm, &out)
            .unwrap();
        let got = gpu.get(&out);
        let want = rf::grad_norm_clip(&host, f64::from(max_norm));
        // Squares exact in f64, f64 sums (negligible error), each block's partial rounded
        // to f32 (U relative, all positive), the norm's square root halves that, one more
        // rounding to f32: within 2U of the norm; the factor's f32 division adds 2U more.
        check_f32("norm", &got[..1], &[want.norm], |_| 2.0 * U * want.norm);
        check_f32("factor", &got[1..], &[want.factor], |_| {
            4.0 * U * want.factor
        });
        first.get_or_insert(got[0].to_bits());
        assert_eq!(
            first,
            Some(got[0].to_bits()),
            "the same norm bits on every run"
        );
    }
    assert!(
        rf::grad_norm_clip(&host, 1.0).factor < 1.0,
        "the first case clips (norm {})",
        rf::grad_norm_clip(&host, 1.0).norm
    );

    // In two halves (expert parallelism's split: the partial sums of a list's head, then of
    // its tail written after them, then one finish): the same bits as the whole list at once.
    let cut = list.len() / 2 + 1;
    let whole = gpu.get(&out);
    out.memset_bytes(&gpu.stream, 0xFF).unwrap();
    ws.memset_bytes(&gpu.stream, 0xFF).unwrap();
    let head = gpu
        .ops
        .grad_norm_partials(&gpu.stream, &list[..cut], &ws)
        .unwrap();
    let tail = gpu
        .ops
        .grad_norm_partials(&gpu.stream, &list[cut..], &ws.slice(head..).unwrap())
        .unwrap();
    assert_eq!(head + tail, grad_norm_workspace_len(&lens));
    gpu.ops
        .grad_norm_finish(&gpu.stream, &ws.slice(..head + tail).unwrap(), 1e6, &out)
        .unwrap();
    let split: Vec<u32> = gpu.get(&out).iter().map(|x| x.to_bits()).collect();
    assert_eq!(split, whole.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    let e = gpu
        .ops
        .grad_norm_partials(&gpu.stream, &list, &ws.slice(1..).unwrap());
    assert!(e.unwrap_err().to_string().contains("workspace"));

    // No tensors: norm 0, factor 1.
    gpu.ops
        .grad_norm_clip(&gpu.stream, &[], &ws, 1.0, &out)
        .unwrap();
    assert_eq!(gpu.get(&out), vec![0.0, 1.0]);

    // A NaN gradient: the norm and the factor NaN (visible, not clipped away); an infinite
    // one: factor 0.
    for (bad, nan) in [(f32::NAN, true), (f32::INFINITY, false)] {
        grads.f32s[0]
            .slice(3..4)
            .unwrap()
            .copy_from_host(&gpu.stream, &[bad])
            .unwrap();
        gpu.ops
            .grad_norm_clip(&gpu.stream, &list, &ws, 1.0, &out)
            .unwrap();
        let got = gpu.get(&out);
        if nan {
            assert!(got[0].is_nan() && got[1].is_nan(), "NaN gradient: {got:?}");
        } else {
            assert_eq!(got, vec![f32::INFINITY, 0.0], "infinite gradient");
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn wrong_shapes_and_overlaps_are_rejected_untouched() {
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let ops = &gpu.ops;
    let (t, d, v) = (64, 32, 256);
    let tok = gpu.put(&vec![1i32; t], false);
    let table = gpu.put(&vec![1.0f32; v * d], false);
    let x = gpu.put(&vec![bf16::ONE; t * d], false);
    let w = gpu.put(&vec![1.0f32; d], false);
    let rstd = gpu.put(&vec![1.0f32; t], false);
    let logits = gpu.put(&vec![0.0f32; t * v], false);
    // Outputs, poisoned: none may change.
    let out = gpu.alloc::<bf16>(t * d, false);
    let short = gpu.alloc::<bf16>(t * d - 1, false);
    let dtable = gpu.alloc::<f32>(v * d, false);
    let f = gpu.alloc::<f32>(t, false);
    let dw = gpu.alloc::<f32>(d, false);
    let ws = gpu.alloc::<f32>(rmsnorm_backward_workspace_len(t, d), false);
    let dl = gpu.alloc::<bf16>(t * v, false);
    let big = gpu.alloc::<bf16>(2 * t * d, false);
    let (lo, hi) = (
        big.slice(..t * d).unwrap(),
        big.slice(8..8 + t * d).unwrap(),
    );
    let rejected = |what: &str, r: Result<()>| match r {
        Err(Error::InvalidArgument(m)) => println!("{what}: {m}"),
        other => panic!("{what}: {other:?}"),
    };
    rejected(
        "embedding out short",
        ops.embedding_forward(s, &tok, &table, &short, v),
    );
    rejected(
        "embedding vocab 0",
        ops.embedding_forward(s, &tok, &table, &out, 0),
    );
    rejected(
        "embedding vocab not dividing",
        ops.embedding_forward(s, &tok, &table, &out, 255),
    );
    rejected(
        "embedding backward dout",
        ops.embedding_backward(s, &tok, &short, &dtable, false),
    );
    rejected(
        "embedding backward dtable",
        ops.embedding_backward(s, &tok, &x, &dtable.slice(1..).unwrap(), false),
    );
    rejected(
        "embedding backward no tokens",
        ops.embedding_backward(s, &tok.slice(..0).unwrap(), &x, &dtable, false),
    );
    rejected(
        "rmsnorm y short",
        ops.rmsnorm_forward(s, &x, &w, &short, &f, 1e-5),
    );
    rejected(
        "rmsnorm eps NaN",
        ops.rmsnorm_forward(s, &x, &w, &out, &f, f32::NAN),
    );
    rejected(
        "rmsnorm in place",
        ops.rmsnorm_forward(s, &lo, &w, &hi, &f, 1e-5),
    );
    let bwd =
        |res: Option<&DeviceBuffer<bf16>>, dx: &DeviceBuffer<bf16>, ws: &DeviceBuffer<f32>| {
            ops.rmsnorm_backward(s, &x, &w, &rstd, &x, res, dx, &dw, false, ws)
        };
    rejected(
        "rmsnorm backward workspace",
        bwd(None, &out, &ws.slice(1..).unwrap()),
    );
    rejected(
        "rmsnorm backward dx overlapping residual",
        bwd(Some(&lo), &hi, &ws),
    );
    rejected("rmsnorm backward dx is dy", bwd(None, &x, &ws));
    rejected("add lengths", ops.add(s, &x, &short, &out));
    rejected("add shifted alias", ops.add(s, &lo, &x, &hi));
    rejected(
        "cross_entropy dlogits",
        ops.cross_entropy(s, &logits, &tok, 1.0, &f, &short),
    );
    rejected(
        "cross_entropy loss",
        ops.cross_entropy(s, &logits, &tok, 1.0, &dw, &dl),
    );
    rejected(
        "cross_entropy scale",
        ops.cross_entropy(s, &logits, &tok, f32::INFINITY, &f, &dl),
    );
    rejected("sum index", ops.sum(s, &w, &f, t, false));
    rejected("sum overlap", ops.sum(s, &w, &w, 0, false));
    let gl = [HpBuffer::from(&table), HpBuffer::from(&x)];
    let gws = gpu.alloc::<f32>(grad_norm_workspace_len(&[v * d, t * d]), false);
    rejected(
        "grad norm workspace",
        ops.grad_norm_clip(s, &gl, &gws.slice(1..).unwrap(), 1.0, &f),
    );
    rejected(
        "grad norm out",
        ops.grad_norm_clip(s, &gl, &gws, 1.0, &f.slice(..1).unwrap()),
    );
    rejected(
        "grad norm max_norm",
        ops.grad_norm_clip(s, &gl, &gws, 0.0, &f),
    );
    rejected(
        "grad norm out in a gradient",
        ops.grad_norm_clip(s, &gl, &gws, 1.0, &table.slice(..2).unwrap()),
    );
    s.synchronize().unwrap();
    let poisoned16 = |b: &DeviceBuffer<bf16>| gpu.get(b).iter().all(|v| v.to_bits() == 0xFFFF);
    let poisoned32 = |b: &DeviceBuffer<f32>| gpu.get(b).iter().all(|v| v.to_bits() == u32::MAX);
    assert!(
        [&out, &short, &dl, &big].into_iter().all(poisoned16),
        "bf16 outputs untouched"
    );
    assert!(
        [&dtable, &f, &dw, &ws, &gws].into_iter().all(poisoned32),
        "f32 outputs untouched"
    );
    assert!(gpu.get(&table).iter().all(|&v| v == 1.0), "table untouched");
}

/// Every op once, on the train job's shapes in small: the outputs' bits.
struct Pipeline {
    tokens: DeviceBuffer<i32>,
    table: DeviceBuffer<f32>,
    w: DeviceBuffer<f32>,
    logits: DeviceBuffer<f32>,
    targets: DeviceBuffer<i32>,
    h: DeviceBuffer<bf16>,
    n: DeviceBuffer<bf16>,
    rstd: DeviceBuffer<f32>,
    sum: DeviceBuffer<bf16>,
    loss_rows: DeviceBuffer<f32>,
    dlogits: DeviceBuffer<bf16>,
    stats: DeviceBuffer<f32>,
    dx: DeviceBuffer<bf16>,
    dw: DeviceBuffer<f32>,
    ws: DeviceBuffer<f32>,
    dtable: DeviceBuffer<f32>,
    gws: DeviceBuffer<f32>,
}

impl Pipeline {
    fn new(gpu: &Gpu, rng: &mut Rng, t: usize, d: usize, v: usize) -> Pipeline {
        let toks = tokens(rng, t, v, 0.2);
        let targets: Vec<i32> = (0..t).map(|_| rng.below(v) as i32).collect();
        let w: Vec<f32> = rng.vec(d, 0.5).into_iter().map(|x| 1.0 + x).collect();
        let gl = grad_norm_workspace_len(&[v * d, d, t * v]);
        Pipeline {
            tokens: gpu.put(&toks, false),
            table: gpu.put(&rng.vec(v * d, 1.0), false),
            w: gpu.put(&w, false),
            logits: gpu.put(&rng.vec(t * v, 3.0), false),
            targets: gpu.put(&targets, false),
            h: gpu.alloc(t * d, false),
            n: gpu.alloc(t * d, false),
            rstd: gpu.alloc(t, false),
            sum: gpu.alloc(t * d, false),
            loss_rows: gpu.alloc(t, false),
            dlogits: gpu.alloc(t * v, false),
            stats: gpu.alloc(3, false),
            dx: gpu.alloc(t * d, false),
            dw: gpu.alloc(d, false),
            ws: gpu.alloc(rmsnorm_backward_workspace_len(t, d), false),
            dtable: gpu.alloc(v * d, false),
            gws: gpu.alloc(gl, false),
        }
    }

    fn run(&self, ops: &Ops, s: &Stream) -> Result<()> {
        let v = self.table.len() / self.w.len();
        ops.embedding_forward(s, &self.tokens, &self.table, &self.h, v)?;
        ops.rmsnorm_forward(s, &self.h, &self.w, &self.n, &self.rstd, 1e-5)?;
        ops.add(s, &self.h, &self.n, &self.sum)?;
        ops.cross_entropy(
            s,
            &self.logits,
            &self.targets,
            0.01,
            &self.loss_rows,
            &self.dlogits,
        )?;
        ops.sum(s, &self.loss_rows, &self.stats, 0, false)?;
        ops.sum(s, &self.loss_rows, &self.stats, 0, true)?;
        ops.rmsnorm_backward(
            s,
            &self.h,
            &self.w,
            &self.rstd,
            &self.sum,
            Some(&self.n),
            &self.dx,
            &self.dw,
            false,
            &self.ws,
        )?;
        ops.embedding_backward(s, &self.tokens, &self.dx, &self.dtable, false)?;
        let grads = [
            HpBuffer::from(&self.dtable),
            HpBuffer::from(&self.dw),
            HpBuffer::from(&self.dlogits),
        ];
        ops.grad_norm_clip(s, &grads, &self.gws, 1.0, &self.stats.slice(1..3)?)
    }

    fn poison(&self, s: &Stream) {
        for b in [&self.h, &self.n, &self.sum, &self.dlogits, &self.dx] {
            b.memset_bytes(s, 0xFF).unwrap();
        }
        for b in [
            &self.rstd,
            &self.loss_rows,
            &self.stats,
            &self.dw,
            &self.ws,
            &self.dtable,
            &self.gws,
        ] {
            b.memset_bytes(s, 0xFF).unwrap();
        }
    }

    fn bits(&self, gpu: &Gpu) -> Vec<Vec<u32>> {
        let b16 =
            |b: &DeviceBuffer<bf16>| gpu.get(b).iter().map(|x| u32::from(x.to_bits())).collect();
        let b32 = |b: &DeviceBuffer<f32>| bits_f32(&gpu.get(b));
        vec![
            b16(&self.h),
            b16(&self.n),
            b32(&self.rstd),
            b16(&self.sum),
            b32(&self.loss_rows),
            b16(&self.dlogits),
            b32(&self.stats),
            b16(&self.dx),
            b32(&self.dw),
            b32(&self.dtable),
        ]
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn graph_replay_gives_the_eager_bits() {
    let gpu = Gpu::new();
    let mut rng = fresh_rng("graph_replay_gives_the_eager_bits");
    let s = &gpu.stream;
    let p = Pipeline::new(&gpu, &mut rng, 1024, 512, 256);
    p.run(&gpu.ops, s).unwrap();
    let eager = p.bits(&gpu);
    for (i, b) in eager.iter().enumerate() {
        assert!(!b.is_empty(), "output {i}");
    }
    let stats: Vec<f32> = eager[6].iter().map(|&b| f32::from_bits(b)).collect();
    assert!(stats.iter().all(|v| v.is_finite()), "stats {stats:?}");
    p.poison(s);
    p.run(&gpu.ops, s).unwrap();
    assert_eq!(p.bits(&gpu), eager, "two eager runs");
    // Thread-local: this binary's tests may run on parallel threads, whose API calls a
    // global-mode capture would forbid.
    let graph = s
        .capture(CaptureMode::ThreadLocal, |cs| p.run(&gpu.ops, cs.stream()))
        .unwrap();
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).unwrap();
    for replay in 0..2 {
        p.poison(s);
        exec.launch(s).unwrap();
        assert_eq!(p.bits(&gpu), eager, "graph replay {replay}");
    }
}
