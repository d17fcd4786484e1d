//! f64 host models of the model's ops ([`super::ops::Ops`]), forward and backward, for the
//! GPU tests to compare against. Row-major `[rows, cols]` slices; the shapes come from the
//! lengths as in the launchers. Each function panics when the lengths do not fit together.
//!
//! The backward models are checked here against central finite differences of the forward
//! models: that is what proves the gradient formulas the kernels implement.

/// `out[t, :] = table[tokens[t], :]` for a `[vocab, d]` table; a token outside `0..vocab`
/// gives a row of zeros (as the kernel).
///
/// # Panics
/// When `table.len()` is not a positive multiple of `vocab`.
pub fn embedding_forward(tokens: &[i32], table: &[f64], vocab: usize) -> Vec<f64> {
    assert!(vocab > 0 && !table.is_empty() && table.len() % vocab == 0);
    let d = table.len() / vocab;
    let mut out = vec![0.0; tokens.len() * d];
    for (t, &tok) in tokens.iter().enumerate() {
        if let Ok(v) = usize::try_from(tok)
            && v < vocab
        {
            out[t * d..(t + 1) * d].copy_from_slice(&table[v * d..(v + 1) * d]);
        }
    }
    out
}

/// The table's gradient `dtable[v, :] = sum over t with tokens[t] == v of dout[t, :]`
/// (`[vocab, d]`, d = `dout.len() / tokens.len()`); tokens outside `0..vocab` add nothing.
///
/// # Panics
/// When `tokens` is empty or `dout.len()` is not a multiple of its length.
pub fn embedding_backward(tokens: &[i32], dout: &[f64], vocab: usize) -> Vec<f64> {
    assert!(!tokens.is_empty() && dout.len() % tokens.len() == 0);
    let d = dout.len() / tokens.len();
    let mut dtable = vec![0.0; vocab * d];
    for (t, &tok) in tokens.iter().enumerate() {
        if let Ok(v) = usize::try_from(tok)
            && v < vocab
        {
            for c in 0..d {
                dtable[v * d + c] += dout[t * d + c];
            }
        }
    }
    dtable
}

/// RMSNorm's forward: what [`rmsnorm_forward`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct RmsNormForward {
    /// `[rows, cols]`: `x * rstd * w`.
    pub y: Vec<f64>,
    /// `[rows]`: `1 / sqrt(mean_c(x^2) + eps)`.
    pub rstd: Vec<f64>,
}

/// RMSNorm over rows of `w.len()` columns: `rstd[t] = 1 / sqrt(mean_c(x[t, c]^2) + eps)`,
/// `y = x * rstd * w`.
///
/// # Panics
/// When `w` is empty or `x.len()` is not a multiple of its length.
pub fn rmsnorm_forward(x: &[f64], w: &[f64], eps: f64) -> RmsNormForward {
    let cols = w.len();
    assert!(cols > 0 && x.len() % cols == 0);
    let rows = x.len() / cols;
    let mut y = vec![0.0; x.len()];
    let mut rstd = vec![0.0; rows];
    for t in 0..rows {
        let xr = &x[t * cols..(t + 1) * cols];
        let ms = xr.iter().map(|v| v * v).sum::<f64>() / cols as f64;
        let r = 1.0 / (ms + eps).sqrt();
        rstd[t] = r;
        for c in 0..cols {
            y[t * cols + c] = xr[c] * r * w[c];
        }
    }
    RmsNormForward { y, rstd }
}

/// RMSNorm's gradients: what [`rmsnorm_backward`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct RmsNormGrads {
    /// `[rows, cols]`: the input gradient, the residual gradient added.
    pub dx: Vec<f64>,
    /// `[cols]`: the weight gradient.
    pub dw: Vec<f64>,
}

/// RMSNorm's backward given the forward's `rstd` (`[rows]`): with `xhat = x * rstd` and `g =
/// dy * w`, `dx = residual_grad + rstd * (g - xhat * mean_c(g * xhat))` (the full derivative
/// of `sum(y * dy)` with respect to `x`, through `rstd` too) and `dw = sum_t dy * xhat`.
///
/// # Panics
/// When the lengths do not fit `[rstd.len(), w.len()]`.
pub fn rmsnorm_backward(
    x: &[f64],
    w: &[f64],
    rstd: &[f64],
    dy: &[f64],
    residual_grad: Option<&[f64]>,
) -> RmsNormGrads {
    let (rows, cols) = (rstd.len(), w.len());
    assert!(x.len() == rows * cols && dy.len() == x.len());
    assert!(residual_grad.is_none_or(|r| r.len() == x.len()));
    let mut dx = vec![0.0; x.len()];
    let mut dw = vec![0.0; cols];
    for (t, &r) in rstd.iter().enumerate() {
        let o = t * cols;
        let mean = (0..cols)
            .map(|c| dy[o + c] * w[c] * x[o + c] * r)
            .sum::<f64>()
            / cols as f64;
        for c in 0..cols {
            let xhat = x[o + c] * r;
            let g = dy[o + c] * w[c];
            let res = residual_grad.map_or(0.0, |rg| rg[o + c]);
            dx[o + c] = res + r * (g - xhat * mean);
            dw[c] += dy[o + c] * xhat;
        }
    }
    RmsNormGrads { dx, dw }
}

/// `a + b` elementwise.
///
/// # Panics
/// When the lengths differ.
pub fn add(a: &[f64], b: &[f64]) -> Vec<f64> {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

/// Cross-entropy's loss and logits gradient: what [`cross_entropy`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct CrossEntropy {
    /// `[T]`: `logsumexp(logits[t]) - logits[t, targets[t]]`.
    pub loss_rows: Vec<f64>,
    /// `[T, V]`: `(softmax(logits[t]) - onehot(targets[t])) * grad_scale`.
    pub dlogits: Vec<f64>,
}

/// Cross-entropy over rows of `V = logits.len() / targets.len()` logits: the loss of each row
/// and the gradient of `grad_scale * sum_t loss[t]`. A negative target ignores the row (loss
/// and gradient 0); a target `>= V` gives NaN (as the kernel).
///
/// # Panics
/// When `targets` is empty or `logits.len()` is not a multiple of its length.
pub fn cross_entropy(logits: &[f64], targets: &[i32], grad_scale: f64) -> CrossEntropy {
    assert!(!targets.is_empty() && logits.len() % targets.len() == 0);
    let v = logits.len() / targets.len();
    let mut loss_rows = vec![0.0; targets.len()];
    let mut dlogits = vec![0.0; logits.len()];
    for (t, &tgt) in targets.iter().enumerate() {
        let row = &logits[t * v..(t + 1) * v];
        let d = &mut dlogits[t * v..(t + 1) * v];
        if tgt < 0 {
            continue;
        }
        let tgt = tgt as usize;
        if tgt >= v {
            loss_rows[t] = f64::NAN;
            d.fill(f64::NAN);
            continue;
        }
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = row.iter().map(|l| (l - m).exp()).sum();
        loss_rows[t] = m + z.ln() - row[tgt];
        for (c, g) in d.iter_mut().enumerate() {
            let p = (row[c] - m).exp() / z;
            *g = (p - if c == tgt { 1.0 } else { 0.0 }) * grad_scale;
        }
    }
    CrossEntropy { loss_rows, dlogits }
}

/// The sum of `values`.
pub fn sum(values: &[f64]) -> f64 {
    values.iter().sum()
}

/// Gradient-norm clipping: what [`grad_norm_clip`] returns.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradNorm {
    /// The L2 norm of all the tensors together.
    pub norm: f64,
    /// `min(1, max_norm / (norm + 1e-6))`, NaN when that quotient is NaN.
    pub factor: f64,
}

/// PyTorch's `clip_grad_norm_`: the total L2 norm of `tensors` and the factor
/// `min(1, max_norm / (norm + 1e-6))` the gradients are multiplied by (NaN propagates, as
/// `torch.clamp` does).
pub fn grad_norm_clip(tensors: &[&[f64]], max_norm: f64) -> GradNorm {
    let norm = tensors
        .iter()
        .flat_map(|t| t.iter())
        .map(|v| v * v)
        .sum::<f64>()
        .sqrt();
    let c = max_norm / (norm + 1e-6);
    GradNorm {
        norm,
        factor: if c.is_nan() { c } else { c.min(1.0) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn rand(rng: &mut Rng, n: usize, scale: f32) -> Vec<f64> {
        rng.vec(n, scale).into_iter().map(f64::from).collect()
    }

    fn dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    /// Central differences of `f` at `x`, one coordinate at a time.
    fn numeric_grad(x: &[f64], h: f64, f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
        let mut p = x.to_vec();
        (0..x.len())
            .map(|i| {
                p[i] = x[i] + h;
                let up = f(&p);
                p[i] = x[i] - h;
                let down = f(&p);
                p[i] = x[i];
                (up - down) / (2.0 * h)
            })
            .collect()
    }

    /// `|got - want| <= tol * max(1, |want|)` everywhere.
    #[track_caller]
    fn assert_near(what: &str, got: &[f64], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= tol * w.abs().max(1.0),
                "{what}[{i}]: {g} vs {w}"
            );
        }
    }

    // Central differences with h = 1e-5 have a truncation error of order h^2 * f''' (about
    // 1e-10 here) and a rounding error of order 1e-16 / h (1e-11): 1e-7 separates a right
    // formula from a wrong one by orders of magnitude.
    const H: f64 = 1e-5;
    const TOL: f64 = 1e-7;

    #[test]
    fn rmsnorm_backward_is_the_derivative_of_the_forward() {
        let mut rng = Rng::new(14, 1);
        let (rows, cols, eps) = (3, 7, 1e-3);
        let x = rand(&mut rng, rows * cols, 1.5);
        let w = rand(&mut rng, cols, 1.0);
        let dy = rand(&mut rng, rows * cols, 1.0);
        let res = rand(&mut rng, rows * cols, 1.0);
        let loss = |x: &[f64], w: &[f64]| dot(&rmsnorm_forward(x, w, eps).y, &dy);
        let fwd = rmsnorm_forward(&x, &w, eps);
        let g = rmsnorm_backward(&x, &w, &fwd.rstd, &dy, None);
        assert_near("dx", &g.dx, &numeric_grad(&x, H, |x| loss(x, &w)), TOL);
        assert_near("dw", &g.dw, &numeric_grad(&w, H, |w| loss(&x, w)), TOL);
        // The residual gradient is added as it is; dw does not see it.
        let with = rmsnorm_backward(&x, &w, &fwd.rstd, &dy, Some(&res));
        assert_near("dx + residual", &with.dx, &add(&g.dx, &res), 1e-15);
        assert_eq!(with.dw, g.dw);
    }

    #[test]
    fn rmsnorm_forward_normalises_rows() {
        // A row of 3s: mean square 9, rstd 1/3 (eps 0), y = w.
        let f = rmsnorm_forward(&[3.0; 4], &[1.0, 2.0, -1.0, 0.5], 0.0);
        assert_eq!(f.rstd, vec![1.0 / 3.0]);
        assert_near("y", &f.y, &[1.0, 2.0, -1.0, 0.5], 1e-15);
    }

    #[test]
    fn embedding_backward_is_the_derivative_of_the_forward() {
        let mut rng = Rng::new(14, 2);
        let (vocab, d) = (5, 3);
        // Repeated tokens, an unused row (4), and out-of-range tokens that select nothing.
        let tokens = [0, 2, 2, 1, -1, 0, 2, 5];
        let table = rand(&mut rng, vocab * d, 1.0);
        let dout = rand(&mut rng, tokens.len() * d, 1.0);
        let loss = |tab: &[f64]| dot(&embedding_forward(&tokens, tab, vocab), &dout);
        let g = embedding_backward(&tokens, &dout, vocab);
        assert_near("dtable", &g, &numeric_grad(&table, H, loss), TOL);
        assert!(g[4 * d..].iter().all(|&v| v == 0.0), "row 4 unused");
        let out = embedding_forward(&tokens, &table, vocab);
        assert!(
            out[4 * d..5 * d].iter().all(|&v| v == 0.0),
            "token -1: zeros"
        );
        assert_eq!(&out[d..2 * d], &table[2 * d..3 * d]);
    }

    #[test]
    fn cross_entropy_gradient_is_the_derivative_of_the_loss() {
        let mut rng = Rng::new(14, 3);
        let (rows, v, scale) = (4, 9, 0.25);
        let targets = [3, 0, -1, 8];
        let logits = rand(&mut rng, rows * v, 4.0);
        let total = |l: &[f64]| {
            scale
                * cross_entropy(l, &targets, scale)
                    .loss_rows
                    .iter()
                    .sum::<f64>()
        };
        let ce = cross_entropy(&logits, &targets, scale);
        assert_near(
            "dlogits",
            &ce.dlogits,
            &numeric_grad(&logits, H, total),
            TOL,
        );
        for t in 0..rows {
            let row = &ce.dlogits[t * v..(t + 1) * v];
            // softmax sums to 1 and the one-hot to 1: each gradient row sums to 0.
            assert!(row.iter().sum::<f64>().abs() < 1e-15, "row {t}");
            assert!(ce.loss_rows[t] >= 0.0);
        }
        assert_eq!(ce.loss_rows[2], 0.0, "ignored row");
        assert!(ce.dlogits[2 * v..3 * v].iter().all(|&g| g == 0.0));
    }

    #[test]
    fn cross_entropy_of_known_rows() {
        // Uniform logits: loss ln V, gradient (1/V - onehot) * scale.
        let ce = cross_entropy(&[2.0; 4], &[1], 2.0);
        assert!((ce.loss_rows[0] - 4f64.ln()).abs() < 1e-15);
        assert_near("uniform", &ce.dlogits, &[0.5, -1.5, 0.5, 0.5], 1e-15);
        // A target past V: NaN loss and gradient, so the data error shows.
        let bad = cross_entropy(&[0.0, 1.0], &[2], 1.0);
        assert!(bad.loss_rows[0].is_nan() && bad.dlogits.iter().all(|g| g.is_nan()));
        // Large logits stay finite (max-subtracted).
        let big = cross_entropy(&[1000.0, 0.0], &[0], 1.0);
        assert!(big.loss_rows[0].abs() < 1e-300 && big.dlogits[1].abs() < 1e-300);
    }

    #[test]
    fn grad_norm_clip_follows_pytorch() {
        let (a, b) = ([3.0], [0.0, 4.0]);
        let g = grad_norm_clip(&[&a, &b], 1.0);
        assert_eq!(g.norm, 5.0);
        assert_eq!(g.factor, 1.0 / (5.0 + 1e-6));
        assert_eq!(grad_norm_clip(&[&a, &b], 10.0).factor, 1.0);
        assert_eq!(
            grad_norm_clip(&[], 1.0),
            GradNorm {
                norm: 0.0,
                factor: 1.0
            }
        );
        let nan = grad_norm_clip(&[&[f64::NAN]], 1.0);
        assert!(nan.norm.is_nan() && nan.factor.is_nan());
        assert_eq!(grad_norm_clip(&[&[f64::INFINITY]], 1.0).factor, 0.0);
    }

    #[test]
    fn add_and_sum() {
        assert_eq!(add(&[1.0, 2.0], &[0.5, -2.0]), vec![1.5, 0.0]);
        assert_eq!(sum(&[1.0, 2.0, 3.5]), 6.5);
        assert_eq!(sum(&[]), 0.0);
    }
}
