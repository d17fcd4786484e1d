//! Bit-exact CPU reference of the kernels' arithmetic: FP8 encode and decode, the quantize
//! and dequantize formulas, amax, a model of the delayed-scaling update, and AdamW's update.
//!
//! Encoding matches `cvt.rn.satfinite.{e4m3,e5m2}x2.f32` (and CUDA's
//! `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, fmt)`):
//! * round to nearest, ties to even, over the format's full range including subnormals;
//! * a finite result beyond the max finite value, and +-inf, saturate to +-max finite
//!   (E4M3 0x7E/0xFE, E5M2 0x7B/0xFB);
//! * every NaN becomes the canonical positive NaN `0x7F` of either format (what the sm_89+
//!   instruction writes, measured on an H200: sign and payload are dropped);
//! * magnitudes at or below half the smallest subnormal become a zero of the input's sign.

use half::{bf16, f16};

use crate::block_scale::BlockShape;
use crate::format::{DType, Fp8Format};

/// Encodes `x` to FP8: round to nearest even, saturate to max finite, NaN to NaN.
///
/// Every NaN becomes `0x7F` in both formats, as `cvt.rn.satfinite.{e4m3,e5m2}x2.f32` does on
/// sm_89 and newer. (CUDA's software fallback, used by the compute_80 PTX on older GPUs,
/// keeps the sign and, for E5M2, part of the payload; the GPU tests accept any NaN there.)
pub fn encode(x: f32, fmt: Fp8Format) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = ((x.to_bits() >> 31) as u8) << 7;
    let a = f64::from(x.abs());
    if a == 0.0 {
        return sign;
    }
    let m = fmt.mantissa_bits() as i32;
    let bias = fmt.bias();
    let max = f64::from(fmt.max_finite());
    if a > max * 2.0 {
        return sign | fmt.max_finite_bits(); // includes inf
    }
    // Round on the grid of the binade (or of the subnormal range): quantum 2^(e - m).
    let e = (((a.to_bits() >> 52) & 0x7ff) as i32 - 1023).max(1 - bias);
    let q = 2f64.powi(e - m);
    let v = (a / q).round_ties_even() * q; // exact: a / q has at most 53 significant bits
    if v > max {
        return sign | fmt.max_finite_bits();
    }
    sign | bits_of_exact(v, fmt)
}

/// The byte of a positive value exactly representable in `fmt` (or zero).
fn bits_of_exact(v: f64, fmt: Fp8Format) -> u8 {
    let m = fmt.mantissa_bits() as i32;
    let bias = fmt.bias();
    if v < f64::from(fmt.min_normal()) {
        return (v / 2f64.powi(1 - bias - m)) as u8; // subnormal: count of min subnormals
    }
    let e = ((v.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    let mant = ((v / 2f64.powi(e) - 1.0) * 2f64.powi(m)) as u8;
    (((e + bias) as u8) << m) | mant
}

/// Decodes an FP8 byte to f32 (exact). NaN bytes give NaN; E5M2 infinities give +-inf.
pub fn decode(b: u8, fmt: Fp8Format) -> f32 {
    let neg = b & 0x80 != 0;
    let m = fmt.mantissa_bits();
    let e = i32::from((b & 0x7f) >> m);
    let mant = i32::from(b & ((1 << m) - 1));
    let bias = fmt.bias();
    let mag = match fmt {
        Fp8Format::E4M3 if b & 0x7f == 0x7f => f32::NAN,
        Fp8Format::E5M2 if e == 31 && mant == 0 => f32::INFINITY,
        Fp8Format::E5M2 if e == 31 => f32::NAN,
        _ if e == 0 => mant as f32 * 2f32.powi(1 - bias - m as i32),
        _ => (1.0 + mant as f32 / (1 << m) as f32) * 2f32.powi(e - bias),
    };
    if neg { -mag } else { mag }
}

/// What the quantize kernels write for input `x` (already widened to f32): `encode(x * scale)`
/// with the product rounded to f32 first.
pub fn quantize(x: f32, scale: f32, fmt: Fp8Format) -> u8 {
    encode(x * scale, fmt)
}

/// What the dequantize kernels compute before narrowing: `decode(b) * scale_inv` in f32.
pub fn dequantize(b: u8, scale_inv: f32, fmt: Fp8Format) -> f32 {
    decode(b, fmt) * scale_inv
}

/// Widens a high-precision element, given as its raw bits, to f32 (exact).
pub fn widen(bits: u32, dtype: DType) -> f32 {
    match dtype {
        DType::F32 => f32::from_bits(bits),
        DType::F16 => f16::from_bits(bits as u16).to_f32(),
        DType::Bf16 => bf16::from_bits(bits as u16).to_f32(),
    }
}

/// Narrows f32 to a high-precision element's raw bits, round to nearest even.
pub fn narrow(x: f32, dtype: DType) -> u32 {
    match dtype {
        DType::F32 => x.to_bits(),
        DType::F16 => u32::from(f16::from_f32(x).to_bits()),
        DType::Bf16 => u32::from(bf16::from_f32(x).to_bits()),
    }
}

/// The amax the kernels compute: max |x| by bit pattern, so any NaN wins and is reported
/// as the canonical NaN `0x7FC00000`; 0 for an empty input.
pub fn amax(xs: impl IntoIterator<Item = f32>) -> f32 {
    let m = xs
        .into_iter()
        .map(|x| x.to_bits() & 0x7fff_ffff)
        .max()
        .unwrap_or(0);
    f32::from_bits(if m > 0x7f80_0000 { 0x7fc0_0000 } else { m })
}

/// The current-scaling scale derived from an amax: `fp8_max / amax`, 1 when amax is 0, inf
/// or NaN, f32::MAX when the quotient overflows.
pub fn current_scale(amax: f32, fmt: Fp8Format) -> f32 {
    if amax.is_nan() || amax <= 0.0 || amax.is_infinite() {
        return 1.0;
    }
    let s = fmt.max_finite() / amax;
    if s.is_infinite() { f32::MAX } else { s }
}

/// `fp8_max * 2^-margin`, the numerator of the delayed-scaling scale.
pub fn scaled_max(fmt: Fp8Format, margin: i32) -> f32 {
    fmt.max_finite() * 2f32.powi(-margin)
}

/// One delayed-scaling update of one tensor's state, as the device kernel does it.
/// `history[0]` is the current amax slot. Rolls `history` (slot 0 is zeroed, the old slot 0
/// becomes the last), and writes the new scale and its inverse into `scale` and `scale_inv`.
pub fn delayed_update(
    history: &mut [f32],
    scale: &mut f32,
    scale_inv: &mut f32,
    scaled_max: f32,
    most_recent: bool,
) {
    let last = history[0];
    let amax_max = history.iter().fold(0.0f32, |m, &a| m.max(a)); // f32::max ignores NaN
    history.rotate_left(1);
    history[0] = 0.0;
    let amax = if most_recent { last } else { amax_max };
    let mut s = *scale;
    if amax.is_finite() && amax > 0.0 {
        s = scaled_max / amax;
    }
    if s.is_infinite() {
        s = f32::MAX;
    }
    *scale = s;
    *scale_inv = 1.0 / s;
}

/// [`AdamWState::begin_step`](crate::AdamWState::begin_step) on the state
/// `[steps, lr, beta1^steps, beta2^steps]`, as the kernel does it.
pub fn adamw_begin(state: &mut [f32; 4], beta1: f32, beta2: f32) {
    state[0] += 1.0;
    state[2] *= beta1;
    state[3] *= beta2;
}

/// One element of an AdamW update ([`optim`](crate::optim)) at `state`, bit for bit as the
/// kernels do it: `grad * grad_scale` (pass 1.0 for no scale) updates `m`, `v` and `p`.
pub fn adamw(
    h: &crate::AdamW,
    state: &[f32; 4],
    grad: f32,
    grad_scale: f32,
    p: &mut f32,
    m: &mut f32,
    v: &mut f32,
) {
    let lr = state[1];
    let decay = 1.0 - lr * h.weight_decay;
    let step_size = lr / (1.0 - state[2]);
    let bc2_sqrt = (1.0 - state[3]).sqrt();
    let g = grad * grad_scale;
    *m = h.beta1.mul_add(*m, (1.0 - h.beta1) * g);
    *v = h.beta2.mul_add(*v, ((1.0 - h.beta2) * g) * g);
    let denom = v.sqrt() / bc2_sqrt + h.eps;
    *p = *p * decay - step_size * (*m / denom);
}

/// What cast-transpose writes for `wide` (`[rows, cols]` row-major, already widened to f32)
/// at `scale`: the row-major bytes (`[rows, cols]`), the transposed bytes (`[cols, rows]`,
/// `t[c * rows + r] == y[r * cols + c]`) and the amax of the unscaled input.
pub fn cast_transpose_ref(
    wide: &[f32],
    rows: usize,
    cols: usize,
    scale: f32,
    fmt: Fp8Format,
) -> (Vec<u8>, Vec<u8>, f32) {
    assert_eq!(wide.len(), rows * cols, "reference input length");
    let y: Vec<u8> = wide.iter().map(|&x| quantize(x, scale, fmt)).collect();
    let mut t = vec![0u8; y.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = y[r * cols + c];
        }
    }
    (y, t, amax(wide.iter().copied()))
}

/// What block-scaled quantize writes for `wide` (`[rows, cols]` row-major, already widened
/// to f32): the bytes (`[rows, cols]` row-major) and one `1 / scale` per block, laid out as
/// [`BlockShape::scales_shape`] row-major. Per block: `amax_b` = [`amax`] of its real
/// elements (NaN wins), `scale =` [`current_scale`]`(amax_b)` (1 for 0, inf or NaN;
/// f32::MAX on overflow), bytes [`quantize`]`(x, scale)`, scale_inv `1.0 / scale`.
pub fn quantize_blockwise_ref(
    wide: &[f32],
    rows: usize,
    cols: usize,
    block: BlockShape,
    fmt: Fp8Format,
) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(wide.len(), rows * cols, "reference input length");
    let (br, bc) = block.dims();
    let (nr, nc) = block.scales_shape(rows, cols);
    let mut y = vec![0u8; wide.len()];
    let mut scales_inv = vec![0f32; nr * nc];
    for bi in 0..nr {
        for bj in 0..nc {
            let rs = bi * br..((bi + 1) * br).min(rows);
            let cs = bj * bc..((bj + 1) * bc).min(cols);
            let a = amax(
                rs.clone()
                    .flat_map(|r| cs.clone().map(move |c| r * cols + c))
                    .map(|i| wide[i]),
            );
            let s = current_scale(a, fmt);
            for r in rs.clone() {
                for c in cs.clone() {
                    y[r * cols + c] = quantize(wide[r * cols + c], s, fmt);
                }
            }
            scales_inv[bi * nc + bj] = 1.0 / s;
        }
    }
    (y, scales_inv)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finite_bytes(fmt: Fp8Format) -> impl Iterator<Item = u8> {
        (0..=255u8).filter(move |&b| decode(b, fmt).is_finite())
    }

    /// Positive finite values in increasing order with their bytes.
    fn positive_values(fmt: Fp8Format) -> Vec<(f32, u8)> {
        let mut v: Vec<(f32, u8)> = (0..0x80u8)
            .map(|b| (decode(b, fmt), b))
            .filter(|(x, _)| x.is_finite())
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    }

    #[test]
    fn formats_have_documented_extremes() {
        assert_eq!(decode(0x7e, Fp8Format::E4M3), 448.0);
        assert_eq!(decode(0x7b, Fp8Format::E5M2), 57344.0);
        assert_eq!(decode(0x01, Fp8Format::E4M3), 2f32.powi(-9));
        assert_eq!(decode(0x01, Fp8Format::E5M2), 2f32.powi(-16));
        assert_eq!(decode(0x08, Fp8Format::E4M3), 2f32.powi(-6));
        assert_eq!(decode(0x04, Fp8Format::E5M2), 2f32.powi(-14));
        assert!(decode(0x7f, Fp8Format::E4M3).is_nan());
        assert!(decode(0xff, Fp8Format::E4M3).is_nan());
        assert_eq!(decode(0x7c, Fp8Format::E5M2), f32::INFINITY);
        assert_eq!(decode(0xfc, Fp8Format::E5M2), f32::NEG_INFINITY);
        for b in [0x7d, 0x7e, 0x7f, 0xfd, 0xfe, 0xff] {
            assert!(decode(b, Fp8Format::E5M2).is_nan(), "{b:#x}");
        }
        assert_eq!(finite_bytes(Fp8Format::E4M3).count(), 254);
        assert_eq!(finite_bytes(Fp8Format::E5M2).count(), 248);
        for fmt in Fp8Format::ALL {
            for b in 0..=255u8 {
                assert_eq!(fmt.is_nan(b), decode(b, fmt).is_nan(), "{fmt:?} {b:#x}");
            }
        }
    }

    #[test]
    fn every_finite_value_round_trips() {
        for fmt in Fp8Format::ALL {
            for b in finite_bytes(fmt) {
                assert_eq!(encode(decode(b, fmt), fmt), b, "{fmt:?} byte {b:#04x}");
            }
        }
    }

    #[test]
    fn negative_zero_keeps_its_sign() {
        for fmt in Fp8Format::ALL {
            assert_eq!(encode(-0.0, fmt), 0x80);
            assert_eq!(encode(0.0, fmt), 0x00);
            assert_eq!(decode(0x80, fmt).to_bits(), (-0.0f32).to_bits());
        }
    }

    #[test]
    fn midpoints_tie_to_even_and_neighbours_round_to_nearest() {
        for fmt in Fp8Format::ALL {
            let vals = positive_values(fmt);
            for w in vals.windows(2) {
                let ((lo, lb), (hi, hb)) = (w[0], w[1]);
                let mid = (lo + hi) / 2.0; // exact in f32
                let even = if lb & 1 == 0 { lb } else { hb };
                assert_eq!(encode(mid, fmt), even, "{fmt:?} tie {lo}..{hi}");
                assert_eq!(encode(-mid, fmt), 0x80 | even, "{fmt:?} tie -{lo}..-{hi}");
                let below = f32::from_bits(mid.to_bits() - 1);
                let above = f32::from_bits(mid.to_bits() + 1);
                assert_eq!(encode(below, fmt), lb, "{fmt:?} just below {mid}");
                assert_eq!(encode(above, fmt), hb, "{fmt:?} just above {mid}");
            }
        }
    }

    #[test]
    fn saturates_above_max_finite_and_at_infinity() {
        for fmt in Fp8Format::ALL {
            let max = fmt.max_finite();
            let mb = fmt.max_finite_bits();
            // The gap above max is one ulp of the top binade: 32 (E4M3) or 8192 (E5M2).
            let half_ulp = match fmt {
                Fp8Format::E4M3 => 16.0,
                Fp8Format::E5M2 => 4096.0,
            };
            for x in [
                max,
                max + half_ulp * 0.5,
                max + half_ulp,
                max + half_ulp * 1.5,
                max * 2.0,
                1e30,
                f32::MAX,
                f32::INFINITY,
            ] {
                assert_eq!(encode(x, fmt), mb, "{fmt:?} {x}");
                assert_eq!(encode(-x, fmt), 0x80 | mb, "{fmt:?} -{x}");
            }
        }
    }

    #[test]
    fn nan_stays_nan() {
        for fmt in Fp8Format::ALL {
            for x in [
                f32::NAN,
                -f32::NAN,
                f32::from_bits(0x7f80_0001),
                f32::from_bits(0xffff_ffff),
            ] {
                let b = encode(x, fmt);
                assert!(fmt.is_nan(b), "{fmt:?} {:#x} -> {b:#x}", x.to_bits());
                assert_eq!(b, 0x7f, "canonical NaN");
            }
        }
    }

    #[test]
    fn subnormals_and_underflow() {
        for fmt in Fp8Format::ALL {
            let s = fmt.min_subnormal();
            assert_eq!(encode(s, fmt), 0x01);
            assert_eq!(
                encode(s * 0.5, fmt),
                0x00,
                "half the min subnormal ties to zero"
            );
            assert_eq!(encode(-s * 0.5, fmt), 0x80);
            assert_eq!(encode(s * 0.500_001, fmt), 0x01);
            assert_eq!(encode(s * 1.5, fmt), 0x02, "1.5 ulp ties to even 2");
            assert_eq!(encode(s * 2.5, fmt), 0x02, "2.5 ulp ties to even 2");
            assert_eq!(encode(f32::from_bits(1), fmt), 0x00, "f32 subnormal");
            assert_eq!(encode(-f32::from_bits(1), fmt), 0x80);
            // Largest subnormal rounds up into the first normal binade correctly.
            let min_normal = fmt.min_normal();
            assert_eq!(decode(encode(min_normal - s * 0.4, fmt), fmt), min_normal);
        }
    }

    /// Independent brute force: nearest finite value by search, ties to the even byte,
    /// anything beyond max (or at the tie to the next power) saturating.
    fn brute(x: f32, fmt: Fp8Format, vals: &[(f32, u8)]) -> u8 {
        let sign = ((x.to_bits() >> 31) as u8) << 7;
        let a = f64::from(x.abs());
        let max = f64::from(fmt.max_finite());
        let next_above_max = match fmt {
            Fp8Format::E4M3 => 480.0,
            Fp8Format::E5M2 => 65536.0,
        };
        if a >= (max + next_above_max) / 2.0 {
            return sign | fmt.max_finite_bits();
        }
        let mut best = (f64::INFINITY, 0u8);
        for &(v, b) in vals {
            let d = (f64::from(v) - a).abs();
            if d < best.0 || (d == best.0 && b & 1 == 0) {
                best = (d, b);
            }
        }
        sign | best.1
    }

    #[test]
    fn encode_matches_brute_force_on_many_floats() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for fmt in Fp8Format::ALL {
            let vals = positive_values(fmt);
            for i in 0..200_000 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                // Exponents across the whole fp8 range and beyond, random mantissas.
                let exp = (state % 50) as i32 - 30;
                let mant = f32::from_bits(0x3f80_0000 | (state >> 40) as u32 & 0x7f_ffff);
                let mut x = mant * 2f32.powi(exp);
                if i % 2 == 1 {
                    x = -x;
                }
                assert_eq!(encode(x, fmt), brute(x, fmt, &vals), "{fmt:?} {x:e}");
            }
        }
    }

    #[test]
    fn amax_propagates_nan_and_ignores_sign() {
        assert_eq!(amax([1.0, -3.0, 2.0]), 3.0);
        assert_eq!(amax([]), 0.0);
        assert_eq!(amax([-0.0]), 0.0);
        assert_eq!(amax([1.0, f32::NEG_INFINITY]), f32::INFINITY);
        assert_eq!(
            amax([1.0, f32::from_bits(0xff80_0001)]).to_bits(),
            0x7fc0_0000
        );
    }

    #[test]
    fn current_scale_guards() {
        let f = Fp8Format::E4M3;
        assert_eq!(current_scale(2.0, f), 224.0);
        for a in [0.0, f32::INFINITY, f32::NAN] {
            assert_eq!(current_scale(a, f), 1.0);
        }
        assert_eq!(current_scale(f32::from_bits(1), f), f32::MAX);
    }

    #[test]
    fn delayed_update_rolls_and_keeps_old_scale() {
        let sm = scaled_max(Fp8Format::E4M3, 1);
        assert_eq!(sm, 224.0);
        let mut h = [4.0, 1.0, 8.0, 2.0];
        let (mut s, mut si) = (1.0, 1.0);
        delayed_update(&mut h, &mut s, &mut si, sm, false);
        assert_eq!(h, [0.0, 8.0, 2.0, 4.0]);
        assert_eq!((s, si), (28.0, 1.0 / 28.0));
        delayed_update(&mut h, &mut s, &mut si, sm, true);
        assert_eq!(h, [0.0, 2.0, 4.0, 0.0]);
        assert_eq!(s, 28.0, "most recent amax 0 keeps the old scale");
        h[0] = f32::NAN;
        delayed_update(&mut h, &mut s, &mut si, sm, true);
        assert_eq!(s, 28.0, "NaN keeps the old scale");
        h[0] = f32::INFINITY;
        delayed_update(&mut h, &mut s, &mut si, sm, false);
        assert_eq!(s, 28.0, "inf in the window keeps the old scale");
        let mut h1 = [f32::from_bits(1)];
        delayed_update(&mut h1, &mut s, &mut si, sm, false);
        assert_eq!(s, f32::MAX, "overflowing scale clamps");
        assert_eq!(h1, [0.0]);
    }

    #[test]
    fn widen_and_narrow_are_exact_where_they_must_be() {
        assert_eq!(widen(0x3c00, DType::F16), 1.0);
        assert_eq!(widen(0x3f80, DType::Bf16), 1.0);
        assert_eq!(narrow(1.0, DType::Bf16), 0x3f80);
        assert_eq!(
            narrow(1.0 + 2f32.powi(-8), DType::Bf16),
            0x3f80,
            "tie to even"
        );
    }

    #[test]
    fn cast_transpose_ref_transposes() {
        let f = Fp8Format::E4M3;
        let wide = [1.0, 2.0, 3.0, -4.0, 1000.0, f32::NAN]; // [2, 3]
        let (y, t, a) = cast_transpose_ref(&wide, 2, 3, 0.5, f);
        assert_eq!(y, [0x30, 0x38, 0x3c, 0xc0, 0x7e, 0x7f]);
        assert_eq!(t, [0x30, 0xc0, 0x38, 0x7e, 0x3c, 0x7f]);
        assert_eq!(a.to_bits(), 0x7fc0_0000);
        let (_, _, a) = cast_transpose_ref(&wide[..5], 1, 5, 1.0, f);
        assert_eq!(a, 1000.0);
    }

    #[test]
    fn blockwise_ref_on_tiny_cases() {
        let f = Fp8Format::E4M3;
        // [2, 130], 1x128: blocks (row, 0..128) and (row, 128..130).
        let mut wide = vec![0f32; 260];
        wide[0] = 2.0; // row 0 block 0: amax 2 -> scale 224
        wide[1] = -1.0;
        wide[128] = 0.0; // row 0 block 1: all zero -> scale 1
        wide[130] = f32::INFINITY; // row 1 block 0: inf -> scale 1
        wide[131] = 3.0;
        wide[258] = f32::NAN; // row 1 block 1: NaN -> scale 1
        wide[259] = 1e-30; // tiny
        let (y, si) = quantize_blockwise_ref(&wide, 2, 130, BlockShape::Row1x128, f);
        assert_eq!(si, [1.0 / 224.0, 1.0, 1.0, 1.0]);
        assert_eq!(y[0], 0x7e, "2 * 224 = 448");
        assert_eq!(y[1], encode(-224.0, f));
        assert_eq!(y[128], 0);
        assert_eq!(y[130], 0x7e, "inf saturates");
        assert_eq!(y[131], encode(3.0, f));
        assert_eq!(y[258], 0x7f);
        assert_eq!(y[259], 0);
        // A lone tiny value: the quotient overflows, the scale clamps to f32::MAX.
        let (y, si) = quantize_blockwise_ref(&[f32::from_bits(1)], 1, 1, BlockShape::Row1x128, f);
        assert_eq!(si, [1.0 / f32::MAX]);
        assert_eq!(y, [encode(f32::from_bits(1) * f32::MAX, f)]);
        // 128x128 over [130, 2]: tiles rows 0..128 and 128..130.
        let mut wide = vec![1.0f32; 260];
        wide[5] = -8.0;
        wide[258] = 0.5;
        wide[259] = 0.25;
        let (y, si) = quantize_blockwise_ref(&wide, 130, 2, BlockShape::Tile128x128, f);
        assert_eq!(si, [1.0 / 56.0, 1.0 / 448.0]);
        assert_eq!(y[5], 0xfe, "-8 * 56 = -448");
        assert_eq!(y[0], encode(56.0, f));
        assert_eq!(
            y[256], 0x7e,
            "row 128 is in the second tile: amax 1, 1 * 448"
        );
        assert_eq!(y[258], encode(224.0, f));
        assert_eq!(y[259], encode(112.0, f));
    }
}
