//! The f64 host model of [`attention`](super::attention): causal multi-head self-attention
//! and its backward, computed directly from the definition (no online softmax, no
//! rounding), which the GPU tests compare against.
//!
//! Layouts are the device's: `qkv` is `[T, 3d]` (`T = batch * seq` rows, token `t = b * seq
//! + s`; row `t` holds q for heads `0..H` (`D` columns each), then k, then v; `d = H * D`),
//! `o` and `d_o` are `[T, d]` (head `h` at columns `h * D ..`), `lse` is `[B, H, S]`.
//!
//! For one sequence `b` and head `h`, with `q_i`, `k_j`, `v_j` the head's rows of tokens `i`
//! and `j` of the sequence and `scale` the softmax scale:
//!
//! * scores `s_ij = scale * q_i . k_j` for `j <= i` (causal; later keys are masked out);
//! * `lse_i = ln sum_{j <= i} exp(s_ij)`, `p_ij = exp(s_ij - lse_i)`;
//! * `o_i = sum_{j <= i} p_ij v_j`.
//!
//! The backward of a loss `L` with `d_o = dL/do`: `dv_j = sum_{i >= j} p_ij do_i`,
//! `dp_ij = do_i . v_j`, `ds_ij = p_ij (dp_ij - sum_j' p_ij' dp_ij')`, `dq_i = scale
//! sum_j ds_ij k_j`, `dk_j = scale sum_i ds_ij q_i` (the saved `lse` is an output, not
//! differentiated).
//!
//! The shape is not checked against the device kernels' limits (any head dimension works
//! here); slices must have the layout's lengths (asserted).

use super::attention::AttentionShape;

/// The forward's outputs.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardOutput {
    /// `[T, d]` the attention output.
    pub o: Vec<f64>,
    /// `[B, H, S]` the natural log-sum-exp of each query's scaled (unmasked) scores.
    pub lse: Vec<f64>,
}

/// The column of head `h`'s element `c` of part `part` (0 q, 1 k, 2 v) in a `[T, 3d]` row.
fn col(shape: &AttentionShape, part: usize, h: usize, c: usize) -> usize {
    part * shape.heads * shape.head_dim + h * shape.head_dim + c
}

/// The probabilities `p[i * S + j]` (0 for `j > i`) and `lse[i]` of sequence `b`, head `h`.
fn probs(
    shape: &AttentionShape,
    scale: f64,
    qkv: &[f64],
    b: usize,
    h: usize,
) -> (Vec<f64>, Vec<f64>) {
    let (s_len, dh) = (shape.seq, shape.head_dim);
    let w3 = 3 * shape.heads * dh;
    let row = |s: usize| &qkv[(b * s_len + s) * w3..(b * s_len + s + 1) * w3];
    let mut p = vec![0.0; s_len * s_len];
    let mut lse = vec![0.0; s_len];
    for i in 0..s_len {
        let qi = row(i);
        let scores: Vec<f64> = (0..=i)
            .map(|j| {
                let kj = row(j);
                scale
                    * (0..dh)
                        .map(|c| qi[col(shape, 0, h, c)] * kj[col(shape, 1, h, c)])
                        .sum::<f64>()
            })
            .collect();
        let m = scores.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v));
        let sum: f64 = scores.iter().map(|&v| (v - m).exp()).sum();
        lse[i] = m + sum.ln();
        for (j, &v) in scores.iter().enumerate() {
            p[i * s_len + j] = (v - lse[i]).exp();
        }
    }
    (p, lse)
}

/// Asserts the layout's lengths.
fn check(shape: &AttentionShape, qkv: &[f64], d_o: Option<&[f64]>) {
    let t = shape.batch * shape.seq;
    let d = shape.heads * shape.head_dim;
    assert_eq!(qkv.len(), t * 3 * d, "qkv must be [T, 3d] for {shape:?}");
    if let Some(d_o) = d_o {
        assert_eq!(d_o.len(), t * d, "d_o must be [T, d] for {shape:?}");
    }
}

/// The forward: `o` (`[T, d]`) and `lse` (`[B, H, S]`) of `qkv` (`[T, 3d]`) with softmax
/// scale `scale` (normally `1 / sqrt(head_dim)`).
///
/// # Panics
/// When `qkv` is not `T * 3d` long.
pub fn forward(shape: &AttentionShape, scale: f64, qkv: &[f64]) -> ForwardOutput {
    check(shape, qkv, None);
    let (s_len, dh, nh) = (shape.seq, shape.head_dim, shape.heads);
    let (d, w3) = (nh * dh, 3 * nh * dh);
    let mut o = vec![0.0; shape.batch * s_len * d];
    let mut lse = vec![0.0; shape.batch * nh * s_len];
    for b in 0..shape.batch {
        for h in 0..nh {
            let (p, l) = probs(shape, scale, qkv, b, h);
            lse[(b * nh + h) * s_len..(b * nh + h + 1) * s_len].copy_from_slice(&l);
            for i in 0..s_len {
                let out = &mut o[(b * s_len + i) * d + h * dh..][..dh];
                for j in 0..=i {
                    let vj = &qkv[(b * s_len + j) * w3..];
                    let pij = p[i * s_len + j];
                    for (c, oc) in out.iter_mut().enumerate() {
                        *oc += pij * vj[col(shape, 2, h, c)];
                    }
                }
            }
        }
    }
    ForwardOutput { o, lse }
}

/// The backward: `dqkv` (`[T, 3d]`: dq, dk, dv in q's, k's and v's columns) of a loss whose
/// gradient with respect to the forward's `o` is `d_o` (`[T, d]`).
///
/// # Panics
/// When `qkv` is not `T * 3d` or `d_o` not `T * d` long.
pub fn backward(shape: &AttentionShape, scale: f64, qkv: &[f64], d_o: &[f64]) -> Vec<f64> {
    check(shape, qkv, Some(d_o));
    let (s_len, dh, nh) = (shape.seq, shape.head_dim, shape.heads);
    let (d, w3) = (nh * dh, 3 * nh * dh);
    let mut dqkv = vec![0.0; qkv.len()];
    for b in 0..shape.batch {
        for h in 0..nh {
            let (p, _) = probs(shape, scale, qkv, b, h);
            let tok = |s: usize| b * s_len + s;
            let x = |s: usize, part: usize, c: usize| qkv[tok(s) * w3 + col(shape, part, h, c)];
            let g = |s: usize, c: usize| d_o[tok(s) * d + h * dh + c];
            // ds[i * S + j] for j <= i.
            let mut ds = vec![0.0; s_len * s_len];
            for i in 0..s_len {
                let dp: Vec<f64> = (0..=i)
                    .map(|j| (0..dh).map(|c| g(i, c) * x(j, 2, c)).sum())
                    .collect();
                let delta: f64 = (0..=i).map(|j| p[i * s_len + j] * dp[j]).sum();
                for j in 0..=i {
                    ds[i * s_len + j] = p[i * s_len + j] * (dp[j] - delta);
                }
            }
            for i in 0..s_len {
                for j in 0..=i {
                    let (pij, dsij) = (p[i * s_len + j], ds[i * s_len + j]);
                    for c in 0..dh {
                        dqkv[tok(i) * w3 + col(shape, 0, h, c)] += scale * dsij * x(j, 1, c);
                        dqkv[tok(j) * w3 + col(shape, 1, h, c)] += scale * dsij * x(i, 0, c);
                        dqkv[tok(j) * w3 + col(shape, 2, h, c)] += pij * g(i, c);
                    }
                }
            }
        }
    }
    dqkv
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn random(rng: &mut Rng, n: usize, scale: f32) -> Vec<f64> {
        rng.vec(n, scale).into_iter().map(f64::from).collect()
    }

    #[test]
    fn one_token_attends_to_itself() {
        let sh = AttentionShape::new(2, 1, 3, 4);
        let mut rng = Rng::new(7, 0);
        let qkv = random(&mut rng, 2 * 3 * 12, 1.0);
        let f = forward(&sh, 0.5, &qkv);
        for t in 0..2 {
            for h in 0..3 {
                let row = &qkv[t * 36..(t + 1) * 36];
                let qk: f64 = (0..4).map(|c| row[h * 4 + c] * row[12 + h * 4 + c]).sum();
                assert!((f.lse[t * 3 + h] - 0.5 * qk).abs() < 1e-15);
                for c in 0..4 {
                    assert_eq!(f.o[t * 12 + h * 4 + c], row[24 + h * 4 + c]);
                }
            }
        }
    }

    #[test]
    fn two_tokens_match_the_closed_form() {
        // The second query averages v0 and v1 with weights softmax(s0, s1).
        let sh = AttentionShape::new(1, 2, 1, 2);
        let qkv = vec![
            1.0, 0.0, /* q0 */ 0.5, 1.0, /* k0 */ 3.0, -1.0, /* v0 */
            0.2, 0.4, /* q1 */ -1.0, 2.0, /* k1 */ 1.0, 5.0, /* v1 */
        ];
        let f = forward(&sh, 1.0, &qkv);
        let (s0, s1) = (0.2 * 0.5 + 0.4 * 1.0, -0.2 + 0.4 * 2.0);
        let (e0, e1) = (f64::exp(s0), f64::exp(s1));
        let (p0, p1) = (e0 / (e0 + e1), e1 / (e0 + e1));
        assert!((f.lse[1] - (e0 + e1).ln()).abs() < 1e-14);
        assert!((f.o[2] - (p0 * 3.0 + p1 * 1.0)).abs() < 1e-14);
        assert!((f.o[3] - (-p0 + p1 * 5.0)).abs() < 1e-14);
        assert_eq!(&f.o[..2], &[3.0, -1.0]);
    }

    #[test]
    fn backward_matches_central_differences() {
        let sh = AttentionShape::new(2, 5, 2, 4);
        let scale = 0.7;
        let mut rng = Rng::new(11, 0);
        let qkv = random(&mut rng, 10 * 24, 1.5);
        let d_o = random(&mut rng, 10 * 8, 1.0);
        let loss = |x: &[f64]| -> f64 {
            let f = forward(&sh, scale, x);
            f.o.iter().zip(&d_o).map(|(a, b)| a * b).sum()
        };
        let grad = backward(&sh, scale, &qkv, &d_o);
        let eps = 1e-5;
        let mut x = qkv.clone();
        let mut worst = 0.0f64;
        for i in 0..qkv.len() {
            x[i] = qkv[i] + eps;
            let up = loss(&x);
            x[i] = qkv[i] - eps;
            let down = loss(&x);
            x[i] = qkv[i];
            let fd = (up - down) / (2.0 * eps);
            // Central differences err by O(eps^2) ~ 1e-10 plus rounding ~ 1e-16 / eps.
            worst = worst.max((fd - grad[i]).abs());
            assert!(
                (fd - grad[i]).abs() <= 1e-8 * (1.0 + fd.abs()),
                "element {i}: finite differences {fd}, backward {}",
                grad[i]
            );
        }
        assert!(worst > 0.0 || grad.iter().all(|&g| g == 0.0));
        // Every part gets a gradient (no part silently zero).
        let w3 = 24;
        for part in 0..3 {
            let n: f64 = (0..10)
                .flat_map(|t| (0..8).map(move |c| (t, c)))
                .map(|(t, c)| grad[t * w3 + part * 8 + c].abs())
                .sum();
            assert!(n > 1e-3, "part {part} has a zero gradient");
        }
    }

    #[test]
    fn later_tokens_do_not_change_earlier_outputs() {
        let sh = AttentionShape::new(2, 6, 2, 4);
        let mut rng = Rng::new(3, 0);
        let qkv = random(&mut rng, 12 * 24, 1.0);
        let d_o = random(&mut rng, 12 * 8, 1.0);
        let base = forward(&sh, 0.5, &qkv);
        let base_grad = backward(&sh, 0.5, &qkv, &d_o);
        // Change token 4 of sequence 0 (all of q, k, v): tokens 0..4 of sequence 0 and all of
        // sequence 1 keep their outputs; token 4 changes.
        let mut x = qkv.clone();
        for v in &mut x[4 * 24..5 * 24] {
            *v += 0.75;
        }
        let f = forward(&sh, 0.5, &x);
        for t in (0..4).chain(6..12) {
            assert_eq!(
                f.o[t * 8..(t + 1) * 8],
                base.o[t * 8..(t + 1) * 8],
                "token {t}"
            );
        }
        assert_ne!(f.o[4 * 8..5 * 8], base.o[4 * 8..5 * 8]);
        for h in 0..2 {
            for s in 0..4 {
                assert_eq!(f.lse[h * 6 + s], base.lse[h * 6 + s]);
            }
            assert_eq!(
                f.lse[(2 + h) * 6..(3 + h) * 6],
                base.lse[(2 + h) * 6..(3 + h) * 6]
            );
        }
        // The queries' gradients of earlier tokens do not see it either (their outputs do not
        // depend on it); sequence 1's gradients are untouched.
        let g = backward(&sh, 0.5, &x, &d_o);
        for t in 0..4 {
            assert_eq!(
                g[t * 24..t * 24 + 8],
                base_grad[t * 24..t * 24 + 8],
                "dq of token {t}"
            );
        }
        assert_eq!(g[6 * 24..], base_grad[6 * 24..]);
    }
}
