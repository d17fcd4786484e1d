//! fp64 CPU reference of the GEMMs, for tests: FP8 decoded exactly
//! ([`reference::decode`](crate::reference::decode)), products and sums in f64, then the
//! scales, bias and accumulation, and finally one rounding to the output type
//! ([`round_to`]). The GPU kernels differ from it only by fp32 accumulation order and the
//! f32 epilogue; [`rel_error`] measures that as `max |got - want| / max |want|`.
//!
//! The packed grouped GEMMs have their own references, [`grouped_packed_f64`] and
//! [`grouped_wgrad_f64`], built on [`packed_rows`], the model of how the kernels read the
//! device offsets.

use std::ops::Range;

use crate::format::{DType, Fp8Format};
use crate::reference::{decode, narrow, widen};

/// How the product is scaled.
#[derive(Debug, Clone, Copy)]
pub enum RefScaling<'a> {
    /// Per-tensor `scale_inv` of A and of B.
    Tensor {
        /// A's scale_inv.
        a: f32,
        /// B's scale_inv.
        b: f32,
    },
    /// Block scales: A 1x128 (`[M, ceil(K/128)]`), B 128x128 (`[ceil(N/128), ceil(K/128)]`),
    /// as [`quantize_blockwise`](crate::quantize_blockwise) lays them out.
    Block {
        /// A's scales_inv.
        a: &'a [f32],
        /// B's scales_inv.
        b: &'a [f32],
    },
}

/// One GEMM for the reference: `D[M,N] = scaled(A[M,K] . B[N,K]^T) (+ bias) (+ d)`.
#[derive(Debug, Clone, Copy)]
pub struct RefGemm<'a> {
    /// Rows of A and D.
    pub m: usize,
    /// Rows of B, columns of D.
    pub n: usize,
    /// The reduction length.
    pub k: usize,
    /// A, `[m, k]` row-major FP8 bytes.
    pub a: &'a [u8],
    /// A's format.
    pub a_format: Fp8Format,
    /// B, `[n, k]` row-major FP8 bytes.
    pub b: &'a [u8],
    /// B's format.
    pub b_format: Fp8Format,
    /// The scales.
    pub scaling: RefScaling<'a>,
    /// `n` bias values (already widened to f32), added to every row.
    pub bias: Option<&'a [f32]>,
    /// D's previous contents (`[m, n]`, widened to f32) when accumulating.
    pub d: Option<&'a [f32]>,
}

/// The exact-as-f64 result, `[m, n]` row-major, before rounding to the output type.
///
/// # Panics
/// When a slice's length does not match the shape (a test bug).
pub fn gemm_f64(p: &RefGemm<'_>) -> Vec<f64> {
    let (m, n, k) = (p.m, p.n, p.k);
    assert_eq!(p.a.len(), m * k, "reference: A length");
    assert_eq!(p.b.len(), n * k, "reference: B length");
    let kb = k.div_ceil(128);
    if let RefScaling::Block { a, b } = p.scaling {
        assert_eq!(a.len(), m * kb, "reference: A scales length");
        assert_eq!(b.len(), n.div_ceil(128) * kb, "reference: B scales length");
    }
    if let Some(bias) = p.bias {
        assert_eq!(bias.len(), n, "reference: bias length");
    }
    if let Some(d) = p.d {
        assert_eq!(d.len(), m * n, "reference: D length");
    }
    let a: Vec<f64> =
        p.a.iter()
            .map(|&x| f64::from(decode(x, p.a_format)))
            .collect();
    let b: Vec<f64> =
        p.b.iter()
            .map(|&x| f64::from(decode(x, p.b_format)))
            .collect();
    let mut out = vec![0f64; m * n];
    for r in 0..m {
        for c in 0..n {
            let (ar, bc) = (&a[r * k..(r + 1) * k], &b[c * k..(c + 1) * k]);
            let mut v = match p.scaling {
                RefScaling::Tensor { a: sa, b: sb } => {
                    let s: f64 = ar.iter().zip(bc).map(|(x, y)| x * y).sum();
                    s * f64::from(sa) * f64::from(sb)
                }
                RefScaling::Block { a: sa, b: sb } => (0..kb)
                    .map(|q| {
                        let ks = q * 128..((q + 1) * 128).min(k);
                        let s: f64 = ar[ks.clone()].iter().zip(&bc[ks]).map(|(x, y)| x * y).sum();
                        s * f64::from(sa[r * kb + q]) * f64::from(sb[(c / 128) * kb + q])
                    })
                    .sum(),
            };
            if let Some(bias) = p.bias {
                v += f64::from(bias[c]);
            }
            if let Some(d) = p.d {
                v += f64::from(d[r * n + c]);
            }
            out[r * n + c] = v;
        }
    }
    out
}

/// The rows each group owns in the packed layout, exactly as the packed kernels read
/// `offsets` (`groups + 1` entries): entry `i` becomes
/// `eff(i) = clamp(offsets[i], 0, capacity)` rounded down to a multiple of 16, and group `g`
/// gets `lo..hi` with `total = eff(groups)`, `lo = min(eff(g), total)`,
/// `hi = clamp(eff(g + 1), lo, total)`. Well-formed offsets (0 first, non-decreasing,
/// multiples of 16, at most `capacity`) come back unchanged as ranges.
///
/// # Panics
/// When `offsets` is empty or `capacity` is not a multiple of 16 (a test bug).
pub fn packed_rows(offsets: &[i32], capacity: usize) -> Vec<Range<usize>> {
    assert!(!offsets.is_empty(), "packed_rows: no offsets");
    assert_eq!(capacity % 16, 0, "packed_rows: capacity % 16");
    let eff = |o: i32| usize::try_from(o).unwrap_or(0).min(capacity) / 16 * 16;
    let groups = offsets.len() - 1;
    let total = eff(offsets[groups]);
    (0..groups)
        .map(|g| {
            let lo = eff(offsets[g]).min(total);
            let hi = eff(offsets[g + 1]).clamp(lo, total);
            lo..hi
        })
        .collect()
}

/// A packed grouped GEMM for the reference ([`grouped_packed_f64`]): for every group `g` and
/// row `r` it owns, `D[r,:] = a_scale * b_scale_g * A[r,:] . B[g]^T (+ bias) (+ d[r,:])`.
#[derive(Debug, Clone, Copy)]
pub struct RefPacked<'a> {
    /// Rows of A and D.
    pub capacity: usize,
    /// Rows of each B, columns of D.
    pub n: usize,
    /// The reduction length.
    pub k: usize,
    /// `groups + 1` offsets, as uploaded (read through [`packed_rows`]).
    pub offsets: &'a [i32],
    /// A, `[capacity, k]` row-major FP8 bytes.
    pub a: &'a [u8],
    /// A's format.
    pub a_format: Fp8Format,
    /// B, `[groups, n, k]` row-major FP8 bytes.
    pub b: &'a [u8],
    /// B's format.
    pub b_format: Fp8Format,
    /// A's scale_inv.
    pub a_scale: f32,
    /// B's scale_inv: one value (every group) or `groups` values.
    pub b_scales: &'a [f32],
    /// `n` bias values (widened to f32).
    pub bias: Option<&'a [f32]>,
    /// D's previous contents (`[capacity, n]`, widened to f32) when accumulating.
    pub d: Option<&'a [f32]>,
}

/// The fp64 reference of a packed grouped GEMM: for each group, its rows
/// ([`packed_rows`]) and their values, `[rows.len(), n]` row-major, before rounding to the
/// output type. Rows in no group's range are not written by the kernel. Where the offsets
/// make groups overlap (decreasing entries) the forward kernel's result is unspecified and
/// this reference does not model it.
///
/// # Panics
/// When a slice's length does not match the shape (a test bug).
pub fn grouped_packed_f64(p: &RefPacked<'_>) -> Vec<(Range<usize>, Vec<f64>)> {
    let groups = p.offsets.len().saturating_sub(1);
    let (n, k) = (p.n, p.k);
    assert_eq!(p.a.len(), p.capacity * k, "reference: A length");
    assert_eq!(p.b.len(), groups * n * k, "reference: B length");
    assert!(
        p.b_scales.len() == 1 || p.b_scales.len() == groups,
        "reference: B scales length"
    );
    if let Some(d) = p.d {
        assert_eq!(d.len(), p.capacity * n, "reference: D length");
    }
    packed_rows(p.offsets, p.capacity)
        .into_iter()
        .enumerate()
        .map(|(g, rows)| {
            let sb = p.b_scales[if p.b_scales.len() == 1 { 0 } else { g }];
            let want = gemm_f64(&RefGemm {
                m: rows.len(),
                n,
                k,
                a: &p.a[rows.start * k..rows.end * k],
                a_format: p.a_format,
                b: &p.b[g * n * k..(g + 1) * n * k],
                b_format: p.b_format,
                scaling: RefScaling::Tensor {
                    a: p.a_scale,
                    b: sb,
                },
                bias: p.bias,
                d: p.d.map(|d| &d[rows.start * n..rows.end * n]),
            });
            (rows, want)
        })
        .collect()
}

/// A packed grouped weight gradient for the reference ([`grouped_wgrad_f64`]): for every
/// group `g` with rows `lo..hi` ([`packed_rows`]),
/// `D[g] = a_scale * b_scale * A[:, lo..hi] . B[:, lo..hi]^T (+ d[g])`.
#[derive(Debug, Clone, Copy)]
pub struct RefWgrad<'a> {
    /// Columns (the row stride) of A and B.
    pub capacity: usize,
    /// Rows of A and of each `D[g]`.
    pub m: usize,
    /// Rows of B, columns of each `D[g]`.
    pub n: usize,
    /// `groups + 1` offsets, as uploaded (read through [`packed_rows`]).
    pub offsets: &'a [i32],
    /// A, `[m, capacity]` row-major FP8 bytes.
    pub a: &'a [u8],
    /// A's format.
    pub a_format: Fp8Format,
    /// B, `[n, capacity]` row-major FP8 bytes.
    pub b: &'a [u8],
    /// B's format.
    pub b_format: Fp8Format,
    /// A's scale_inv.
    pub a_scale: f32,
    /// B's scale_inv.
    pub b_scale: f32,
    /// D's previous contents (`[groups, m, n]`, widened to f32) when accumulating.
    pub d: Option<&'a [f32]>,
}

/// The fp64 reference of a packed grouped weight gradient, `[groups, m, n]` row-major,
/// before rounding to the output type. A group with no rows gets 0 (or, accumulating, its
/// previous contents: the kernel leaves such a group's D alone, so it matches bit for bit).
///
/// # Panics
/// When a slice's length does not match the shape (a test bug).
pub fn grouped_wgrad_f64(p: &RefWgrad<'_>) -> Vec<f64> {
    let groups = p.offsets.len().saturating_sub(1);
    let (cap, m, n) = (p.capacity, p.m, p.n);
    assert_eq!(p.a.len(), m * cap, "reference: A length");
    assert_eq!(p.b.len(), n * cap, "reference: B length");
    if let Some(d) = p.d {
        assert_eq!(d.len(), groups * m * n, "reference: D length");
    }
    let a: Vec<f64> =
        p.a.iter()
            .map(|&x| f64::from(decode(x, p.a_format)))
            .collect();
    let b: Vec<f64> =
        p.b.iter()
            .map(|&x| f64::from(decode(x, p.b_format)))
            .collect();
    let scale = f64::from(p.a_scale) * f64::from(p.b_scale);
    let mut out = vec![0f64; groups * m * n];
    for (g, rows) in packed_rows(p.offsets, cap).into_iter().enumerate() {
        for i in 0..m {
            for j in 0..n {
                let at = (g * m + i) * n + j;
                let prev = p.d.map_or(0.0, |d| f64::from(d[at]));
                if rows.is_empty() {
                    out[at] = prev;
                    continue;
                }
                let (ar, bc) = (&a[i * cap..(i + 1) * cap], &b[j * cap..(j + 1) * cap]);
                let s: f64 = rows.clone().map(|t| ar[t] * bc[t]).sum();
                out[at] = s * scale + prev;
            }
        }
    }
    out
}

/// `v` rounded to `out` (f32, or bf16 / f16 via f32, round to nearest even), as an f32.
pub fn round_to(v: f64, out: DType) -> f32 {
    widen(narrow(v as f32, out), out)
}

/// [`gemm_f64`] rounded to the output type.
pub fn gemm_ref(p: &RefGemm<'_>, out: DType) -> Vec<f32> {
    gemm_f64(p).into_iter().map(|v| round_to(v, out)).collect()
}

/// `max |got - want| / max |want|` (0 when both are all zero; infinite when `want` is all
/// zero and `got` is not, or when any value is not finite).
///
/// # Panics
/// When the lengths differ (a test bug).
pub fn rel_error(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "rel_error: lengths");
    let mut err = 0f64;
    let mut max = 0f64;
    for (&g, &w) in got.iter().zip(want) {
        let e = (f64::from(g) - w).abs();
        if e.is_nan() {
            return f64::INFINITY;
        }
        err = err.max(e);
        max = max.max(w.abs());
    }
    if err == 0.0 {
        0.0
    } else if max == 0.0 {
        f64::INFINITY
    } else {
        err / max
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::encode;

    const E4: Fp8Format = Fp8Format::E4M3;
    const E5: Fp8Format = Fp8Format::E5M2;

    fn enc(xs: &[f32], f: Fp8Format) -> Vec<u8> {
        xs.iter().map(|&x| encode(x, f)).collect()
    }

    #[test]
    fn two_by_two_by_hand() {
        // A = [[1, 2], [3, -0.5]], B = [[4, 0.25], [-1, 448]] (rows of B are columns of D).
        let a = enc(&[1.0, 2.0, 3.0, -0.5], E4);
        let b = enc(&[4.0, 0.25, -1.0, 448.0], E4);
        let p = RefGemm {
            m: 2,
            n: 2,
            k: 2,
            a: &a,
            a_format: E4,
            b: &b,
            b_format: E4,
            scaling: RefScaling::Tensor { a: 0.5, b: 2.0 },
            bias: None,
            d: None,
        };
        // [1*4 + 2*0.25, 1*-1 + 2*448; 3*4 - 0.5*0.25, 3*-1 - 0.5*448]
        assert_eq!(gemm_f64(&p), vec![4.5, 895.0, 11.875, -227.0]);
        let bias = [1.0f32, -1.0];
        let d = [0.5f32, 0.25, 0.0, 1.0];
        let p2 = RefGemm {
            scaling: RefScaling::Tensor { a: 2.0, b: 1.0 },
            bias: Some(&bias),
            d: Some(&d),
            ..p
        };
        assert_eq!(gemm_f64(&p2), vec![10.5, 1789.25, 24.75, -454.0]);
        // bf16 has 8 significant bits: 1789.25 -> 1792, 24.75 stays, 10.5 stays.
        assert_eq!(
            gemm_ref(&p2, DType::Bf16),
            vec![10.5, 1792.0, 24.75, -454.0]
        );
    }

    #[test]
    fn mixed_formats_and_extremes_are_exact() {
        // E5M2 max times E4M3 max, and the smallest subnormals: exact in f64.
        let a = enc(&[57344.0, 2f32.powi(-16)], E5);
        let b = enc(&[448.0, 2f32.powi(-9)], E4);
        let p = RefGemm {
            m: 1,
            n: 1,
            k: 2,
            a: &a,
            a_format: E5,
            b: &b,
            b_format: E4,
            scaling: RefScaling::Tensor { a: 1.0, b: 1.0 },
            bias: None,
            d: None,
        };
        assert_eq!(gemm_f64(&p), vec![57344.0 * 448.0 + 2f64.powi(-25)]);
    }

    #[test]
    fn block_scales_apply_per_k_block() {
        // M = 1, N = 129 (two column blocks), K = 256 (two k-blocks); all ones.
        let (m, n, k) = (1, 129, 256);
        let a = enc(&vec![1.0; m * k], E4);
        let b = enc(&vec![1.0; n * k], E4);
        let sa = [2.0f32, 3.0]; // [1, 2]
        let sb = [1.0f32, 10.0, 0.5, 0.25]; // [2, 2]
        let p = RefGemm {
            m,
            n,
            k,
            a: &a,
            a_format: E4,
            b: &b,
            b_format: E4,
            scaling: RefScaling::Block { a: &sa, b: &sb },
            bias: None,
            d: None,
        };
        let got = gemm_f64(&p);
        // Columns 0..128: 128*2*1 + 128*3*10; column 128: 128*2*0.5 + 128*3*0.25.
        assert_eq!(got[0], 256.0 + 3840.0);
        assert_eq!(got[127], 4096.0);
        assert_eq!(got[128], 128.0 + 96.0);
    }

    #[test]
    fn packed_rows_models_the_kernels_reading_of_offsets() {
        let r = |offs: &[i32], cap| packed_rows(offs, cap);
        // Well-formed: taken as they are, empty groups first, middle and last.
        assert_eq!(
            r(&[0, 0, 256, 256, 640, 640], 1024),
            vec![0..0, 0..256, 256..256, 256..640, 640..640]
        );
        assert_eq!(r(&[0, 1024], 1024), vec![0..1024]);
        // Negative -> 0, past capacity -> capacity, not a multiple of 16 -> rounded down.
        assert_eq!(r(&[-7, 100, 5000], 256), vec![0..96, 96..256]);
        // A decreasing entry: the group is empty, the next starts where the entry says.
        assert_eq!(
            r(&[0, 256, 128, 384], 512),
            vec![0..256, 256..256, 128..384]
        );
        // Nothing at or past total = eff(groups), even where an earlier entry is larger.
        assert_eq!(r(&[0, 512, 256], 512), vec![0..256, 256..256]);
        assert_eq!(r(&[300, 200, 100], 512), vec![96..96, 96..96]);
        assert_eq!(r(&[i32::MIN, i32::MAX], 128), vec![0..128]);
    }

    #[test]
    fn packed_reference_by_hand() {
        // Two groups of 16 rows and a third slack tile past offsets[groups]; k = 2.
        let (cap, n, k) = (48, 1, 2);
        let mut a = vec![0u8; cap * k];
        for r in 0..cap {
            a[r * k] = encode(r as f32, E4); // row r = [r, 1]
            a[r * k + 1] = encode(1.0, E4);
        }
        let b = enc(&[1.0, 2.0, -1.0, 0.5], E4); // B[0] = [1, 2], B[1] = [-1, 0.5]
        let offsets = [0, 16, 32];
        let bias = [0.25f32];
        let got = grouped_packed_f64(&RefPacked {
            capacity: cap,
            n,
            k,
            offsets: &offsets,
            a: &a,
            a_format: E4,
            b: &b,
            b_format: E4,
            a_scale: 2.0,
            b_scales: &[1.0, 4.0],
            bias: Some(&bias),
            d: None,
        });
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].0, 0..16);
        assert_eq!(got[1].0, 16..32);
        // Group 0, row 3: 2 * 1 * (3 + 2) + 0.25; group 1, row 20: 2 * 4 * (-20 + 0.5) + 0.25.
        assert_eq!(got[0].1[3], 10.25);
        assert_eq!(got[1].1[4], -155.75);
    }

    #[test]
    fn wgrad_reference_by_hand() {
        // m = n = 1, capacity 48: A = [1; 48], B = [t for t in 0..48]; groups [0,16), empty,
        // [16, 48).
        let cap = 48;
        let a = enc(&vec![1.0; cap], E4);
        let b: Vec<u8> = (0..cap).map(|t| encode(t as f32, E5)).collect();
        let offsets = [0, 16, 16, 48];
        let p = RefWgrad {
            capacity: cap,
            m: 1,
            n: 1,
            offsets: &offsets,
            a: &a,
            a_format: E4,
            b: &b,
            b_format: E5,
            a_scale: 0.5,
            b_scale: 1.0,
            d: None,
        };
        let decoded: Vec<f64> = b.iter().map(|&x| f64::from(decode(x, E5))).collect();
        let s0: f64 = decoded[..16].iter().sum::<f64>() * 0.5;
        let s2: f64 = decoded[16..].iter().sum::<f64>() * 0.5;
        assert_eq!(grouped_wgrad_f64(&p), vec![s0, 0.0, s2]);
        let prev = [1.0f32, -3.0, 2.0];
        let acc = grouped_wgrad_f64(&RefWgrad {
            d: Some(&prev),
            ..p
        });
        assert_eq!(acc, vec![s0 + 1.0, -3.0, s2 + 2.0]);
    }

    #[test]
    fn relative_error() {
        assert_eq!(rel_error(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert_eq!(rel_error(&[1.0, 2.5], &[1.0, 2.0]), 0.25);
        assert_eq!(rel_error(&[0.0], &[0.0]), 0.0);
        assert!(rel_error(&[f32::NAN], &[1.0]).is_infinite());
        assert!(rel_error(&[1.0], &[0.0]).is_infinite());
    }
}
