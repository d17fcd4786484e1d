//! An f64 host reference of a top-k SwiGLU mixture-of-experts layer, forward and full
//! backward: the oracle the GPU kernels are tested against. Pure Rust, no device.
//!
//! # Shapes
//!
//! `T` tokens, `H` hidden, `F` ffn, `E` experts (`>= 1`), `k` = [`RouterConfig::top_k`] in
//! `1..=`[`MAX_TOP_K`] with `k <= E`, `align >= 1` the padding multiple of the packed layout
//! ([`MoeDims`]). `T`, `H` and `F` may be 0 (empty results, zero losses). All tensors are
//! flat row-major `Vec<f64>`: router weight `wr [E, H]`, `w1 [E, 2F, H]` (per expert, rows
//! `0..F` are the *gate* projection, rows `F..2F` the *up* projection), `w2 [E, H, F]`
//! ([`Params`]), input `x [T, H]`.
//!
//! # Forward
//!
//! 1. Router: `logits[t,e] = sum_h x[t,h] * wr[e,h]`.
//! 2. Scores: [`ScoreFn::Softmax`]: `s[t,:] = softmax(logits[t,:])`; [`ScoreFn::Sigmoid`]
//!    (DeepSeek-V3): `s[t,e] = sigmoid(logits[t,e])`.
//! 3. Top-k: per token the `k` experts with the largest score, in descending score order,
//!    equal scores to the lower expert index; `topk[t*k + j]` is the `j`-th chosen expert.
//! 4. Gates `g[t,j]`: Softmax: `s[t, topk_j]`, divided by `sum_j s[t, topk_j]` if
//!    [`RouterConfig::renormalize`]. Sigmoid: always `s[t, topk_j] / sum_j' s[t, topk_j']`
//!    (`renormalize` is ignored).
//! 5. Aux loss (Switch/GShard, Megatron's formula): `counts[e]` = the number of `(t, j)`
//!    with `topk = e`, `f_e = counts[e] / (T*k)`, `P_e = (1/T) sum_t p[t,e]` with `p` the
//!    per-token distribution over all `E` experts (Softmax: `p = s`; Sigmoid:
//!    `p[t,e] = s[t,e] / sum_e' s[t,e']`); `aux = aux_coef * E * sum_e f_e * P_e`. The
//!    counts are constants for the backward (no gradient through `f_e`).
//! 6. Z-loss: `z = z_coef * (1/T) * sum_t (logsumexp_e logits[t,e])^2`.
//! 7. Dispatch [`Plan`] (packed, padded): `padded[e] = ceil(counts[e]/align) * align`,
//!    `offsets[0] = 0`, `offsets[e+1] = offsets[e] + padded[e]` (`E + 1` entries),
//!    `capacity = T*k + E*(align - 1)` (a static bound of `offsets[E]`). Assignment `(t, j)`
//!    to expert `e` sits at row `offsets[e] + #{(t', j') -> e : t' < t}` (stable token
//!    order; a token picks an expert at most once). `row_of [T*k]`, `token_of_row
//!    [capacity]` (`None` for padding rows).
//! 8. Experts, per packed row `r` holding `(t, j)` with expert `e`: `x_p[r,:] = x[t,:]`,
//!    `a[r,:] = x_p[r,:] . w1[e]^T` (`[2F]`), `gate = a[r, 0..F]`, `up = a[r, F..2F]`,
//!    `h[r,f] = silu(gate_f) * up_f` with `silu(v) = v * sigmoid(v)`,
//!    `y[r,:] = h[r,:] . w2[e]^T` (`[H]`). Padding rows are all zero.
//! 9. Combine: `out[t,:] = sum_{j = 0..k} g[t,j] * y[row_of(t,j), :]` (summed in `j` order).
//!
//! # Backward
//!
//! Of `L = sum_{t,h} dy[t,h] * out[t,h] + aux + z` ([`loss`]) for an upstream `dy [T, H]`
//! ([`backward`], [`Grads`]):
//!
//! * `d_gates[t,j] = dy[t,:] . y[row_of(t,j), :]`; `d_y[row_of(t,j), :] = g[t,j] * dy[t,:]`
//!   (0 in padding rows);
//! * `d_h[r,:] = d_y[r,:] . w2[e]`, `dw2[e] += d_y[r,:]^T h[r,:]`;
//! * SwiGLU ([`swiglu_backward`]): `d_a[r,f] = d_h * up * silu'(gate)` with
//!   `silu'(v) = sigmoid(v) * (1 + v * (1 - sigmoid(v)))`, `d_a[r,F+f] = d_h * silu(gate)`;
//! * `d_xp[r,:] = d_a[r,:] . w1[e]`, `dw1[e] += d_a[r,:]^T x_p[r,:]`;
//! * router ([`router_backward`]), per token, with `ds` the gradient of the scores:
//!   - gates: Softmax without renormalisation `ds[topk_j] += d_gates[j]`; otherwise (with
//!     `S = sum_j s[topk_j]`) `ds[topk_i] += (d_gates[i] - sum_j d_gates[j] g[j]) / S`;
//!   - aux: `c_e = aux_coef * E * f_e / T` on `p[t,e]`; Softmax `ds[e] += c_e`; Sigmoid
//!     (with `Σ = sum_e s[e]`) `ds[e] += (c_e - sum_e' c_e' p[e']) / Σ`;
//!   - score function: Softmax `d_logits = s * (ds - sum_e ds[e] s[e])`; Sigmoid
//!     `d_logits = ds * s * (1 - s)`;
//!   - z-loss: `d_logits[t,e] += z_coef * (2/T) * lse_t * softmax(logits[t,:])[e]`;
//! * `dx[t,:] = sum_j d_xp[row_of(t,j), :]` (in `j` order) `+ d_logits[t,:] . wr`,
//!   `dwr = d_logits^T . x`.
//!
//! Top-k selection is piecewise constant: the backward is the gradient where the chosen set
//! does not change. Under Sigmoid, logits below about -745 underflow `sigmoid` to 0 and a
//! token whose chosen scores are all 0 gets NaN gates.

use std::fmt;

/// The largest supported [`RouterConfig::top_k`] (the device router's).
pub use super::routing::MAX_TOP_K;

/// A bad input to a function of this module: which argument and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefError {
    /// The offending argument (or field), e.g. `"top_k"`, `"x"`, `"w1"`.
    pub argument: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl fmt::Display for RefError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "moe reference: invalid `{}`: {}",
            self.argument, self.reason
        )
    }
}

impl std::error::Error for RefError {}

type Res<T> = std::result::Result<T, RefError>;

fn bad<T>(argument: &'static str, reason: impl Into<String>) -> Res<T> {
    Err(RefError {
        argument,
        reason: reason.into(),
    })
}

pub use super::routing::ScoreFn;

/// The router's configuration (f64 coefficients; [`RouterConfig::from`] the device router's
/// [`routing::RouterConfig`](super::routing::RouterConfig)).
#[derive(Debug, Clone, PartialEq)]
pub struct RouterConfig {
    /// The score function.
    pub score: ScoreFn,
    /// Experts per token, `1..=`[`MAX_TOP_K`] and at most the number of experts.
    pub top_k: usize,
    /// Softmax only: divide the chosen scores by their sum (Sigmoid always does).
    pub renormalize: bool,
    /// Coefficient of the load-balancing aux loss (finite).
    pub aux_coef: f64,
    /// Coefficient of the router z-loss (finite).
    pub z_coef: f64,
}

impl From<super::routing::RouterConfig> for RouterConfig {
    fn from(c: super::routing::RouterConfig) -> RouterConfig {
        RouterConfig {
            score: c.score,
            top_k: c.top_k,
            renormalize: c.renormalize,
            aux_coef: f64::from(c.aux_coef),
            z_coef: f64::from(c.z_coef),
        }
    }
}

/// The layer's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeDims {
    /// Tokens `T`.
    pub tokens: usize,
    /// Hidden size `H`.
    pub hidden: usize,
    /// FFN size `F` (`w1` has `2F` rows per expert).
    pub ffn: usize,
    /// Experts `E`, at least 1.
    pub experts: usize,
    /// Padding multiple of the packed layout, at least 1.
    pub align: usize,
}

/// The layer's parameters, flat row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// Router weight `[E, H]`.
    pub wr: Vec<f64>,
    /// First projection `[E, 2F, H]`: rows `0..F` gate, `F..2F` up.
    pub w1: Vec<f64>,
    /// Second projection `[E, H, F]`.
    pub w2: Vec<f64>,
}

/// The packed, padded dispatch plan (step 7 of the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Assignments per expert `[E]`.
    pub counts: Vec<u32>,
    /// First row of each expert `[E + 1]`, multiples of `align`; `offsets[E]` rows in use.
    pub offsets: Vec<u32>,
    /// `T*k + E*(align - 1)`, the static bound of `offsets[E]`: rows of the packed buffers.
    pub capacity: usize,
    /// Row of assignment `(t, j)` at `t*k + j`, `[T*k]`.
    pub row_of: Vec<u32>,
    /// `(t, j)` held by each row, `None` for padding, `[capacity]`.
    pub token_of_row: Vec<Option<(u32, u32)>>,
}

/// The router's results (steps 1 to 7).
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// `[T, E]`.
    pub logits: Vec<f64>,
    /// Scores `s [T, E]` (softmax or sigmoid of the logits).
    pub scores: Vec<f64>,
    /// Per-token distribution `p [T, E]` of the aux loss (`s` for Softmax, `s` normalised
    /// over all experts for Sigmoid).
    pub probs: Vec<f64>,
    /// `logsumexp_e logits[t,e]`, `[T]` (the z-loss's).
    pub lse: Vec<f64>,
    /// Chosen experts `[T*k]`, descending score per token.
    pub topk: Vec<u32>,
    /// Gates `[T*k]`.
    pub gates: Vec<f64>,
    /// The aux loss, coefficient included.
    pub aux_loss: f64,
    /// The z-loss, coefficient included.
    pub z_loss: f64,
    /// The dispatch plan of `topk`.
    pub plan: Plan,
}

/// The forward's results; the packed buffers have `plan.capacity` rows, zero in padding.
#[derive(Debug, Clone, PartialEq)]
pub struct Forward {
    /// The router's results.
    pub routing: Routing,
    /// Dispatched input `[capacity, H]`.
    pub x_p: Vec<f64>,
    /// First projection `[capacity, 2F]` (gate then up).
    pub a: Vec<f64>,
    /// SwiGLU output `[capacity, F]`.
    pub h: Vec<f64>,
    /// Expert output `[capacity, H]`.
    pub y: Vec<f64>,
    /// Combined output `[T, H]`.
    pub out: Vec<f64>,
}

/// The gradients of [`loss`], with the intermediates the kernels are compared with.
#[derive(Debug, Clone, PartialEq)]
pub struct Grads {
    /// `[T, H]`.
    pub dx: Vec<f64>,
    /// `[E, H]`.
    pub dwr: Vec<f64>,
    /// `[E, 2F, H]`.
    pub dw1: Vec<f64>,
    /// `[E, H, F]`.
    pub dw2: Vec<f64>,
    /// `dL/dg`, `[T*k]`.
    pub d_gates: Vec<f64>,
    /// `[capacity, H]`.
    pub d_y: Vec<f64>,
    /// `[capacity, F]`.
    pub d_h: Vec<f64>,
    /// `[capacity, 2F]`.
    pub d_a: Vec<f64>,
    /// Gradient of `x_p`, `[capacity, H]`.
    pub d_xp: Vec<f64>,
    /// All router contributions (gates, aux, z), `[T, E]`.
    pub d_logits: Vec<f64>,
}

/// Checked sizes of a layer.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    t: usize,
    h: usize,
    f: usize,
    e: usize,
    k: usize,
    cap: usize,
}

fn mul(argument: &'static str, parts: &[usize]) -> Res<usize> {
    parts
        .iter()
        .try_fold(1usize, |acc, &p| acc.checked_mul(p))
        .map_or_else(
            || bad(argument, format!("size {parts:?} overflows usize")),
            Ok,
        )
}

/// Checks `tokens`, `top_k`, `experts` and `align` and returns the capacity.
fn plan_capacity(tokens: usize, top_k: usize, experts: usize, align: usize) -> Res<usize> {
    if experts == 0 {
        return bad("experts", "must be at least 1");
    }
    if align == 0 {
        return bad("align", "must be at least 1");
    }
    if top_k == 0 || top_k > MAX_TOP_K {
        return bad("top_k", format!("{top_k} is not within 1..={MAX_TOP_K}"));
    }
    if top_k > experts {
        return bad("top_k", format!("{top_k} exceeds experts = {experts}"));
    }
    let assigned = tokens
        .checked_mul(top_k)
        .filter(|&a| u32::try_from(a).is_ok());
    let Some(assigned) = assigned else {
        return bad(
            "tokens",
            format!("tokens * top_k = {tokens} * {top_k} does not fit in u32"),
        );
    };
    match experts
        .checked_mul(align - 1)
        .and_then(|b| assigned.checked_add(b))
    {
        Some(c) if u32::try_from(c).is_ok() => Ok(c),
        _ => bad(
            "align",
            format!(
                "capacity T*k + E*(align-1) for T*k = {assigned}, E = {experts}, align = {align} does not fit in u32"
            ),
        ),
    }
}

fn sizes(dims: &MoeDims, cfg: &RouterConfig) -> Res<Sizes> {
    let cap = plan_capacity(dims.tokens, cfg.top_k, dims.experts, dims.align)?;
    if !cfg.aux_coef.is_finite() {
        return bad("aux_coef", format!("{} is not finite", cfg.aux_coef));
    }
    if !cfg.z_coef.is_finite() {
        return bad("z_coef", format!("{} is not finite", cfg.z_coef));
    }
    let (t, h, f, e) = (dims.tokens, dims.hidden, dims.ffn, dims.experts);
    mul("hidden", &[t.max(e).max(cap), h])?;
    mul("ffn", &[e.max(cap), 2, f, h.max(1)])?;
    mul("experts", &[t, e])?;
    Ok(Sizes {
        t,
        h,
        f,
        e,
        k: cfg.top_k,
        cap,
    })
}

fn check_len(argument: &'static str, v: &[f64], want: usize) -> Res<()> {
    if v.len() != want {
        return bad(argument, format!("length {} != expected {want}", v.len()));
    }
    Ok(())
}

fn check_finite(argument: &'static str, v: &[f64], want: usize) -> Res<()> {
    check_len(argument, v, want)?;
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return bad(argument, format!("element {i} is {}", v[i]));
    }
    Ok(())
}

/// `1 / (1 + exp(-v))`, without overflow.
pub fn sigmoid(v: f64) -> f64 {
    if v >= 0.0 {
        1.0 / (1.0 + (-v).exp())
    } else {
        let z = v.exp();
        z / (1.0 + z)
    }
}

/// `v * sigmoid(v)`.
pub fn silu(v: f64) -> f64 {
    v * sigmoid(v)
}

/// `d silu / dv = sigmoid(v) * (1 + v * (1 - sigmoid(v)))`.
pub fn silu_grad(v: f64) -> f64 {
    let s = sigmoid(v);
    s * (1.0 + v * (1.0 - s))
}

fn swiglu_rows(a: &[f64], ffn: usize) -> Res<usize> {
    let width = ffn
        .checked_mul(2)
        .map_or_else(|| bad("ffn", "2*ffn overflows usize"), Ok)?;
    if width == 0 {
        return if a.is_empty() {
            Ok(0)
        } else {
            bad("a", "must be empty when ffn = 0")
        };
    }
    if a.len() % width != 0 {
        return bad(
            "a",
            format!("length {} is not a multiple of 2*ffn = {width}", a.len()),
        );
    }
    Ok(a.len() / width)
}

/// SwiGLU of rows `a [rows, 2F]` (gate then up): `h [rows, F]` with
/// `h[r,f] = silu(a[r,f]) * a[r,F+f]`.
pub fn swiglu(a: &[f64], ffn: usize) -> Result<Vec<f64>, RefError> {
    let rows = swiglu_rows(a, ffn)?;
    let mut h = vec![0.0; rows * ffn];
    for r in 0..rows {
        let ar = &a[r * 2 * ffn..(r + 1) * 2 * ffn];
        for f in 0..ffn {
            h[r * ffn + f] = silu(ar[f]) * ar[ffn + f];
        }
    }
    Ok(h)
}

/// The backward of [`swiglu`]: `d_a [rows, 2F]` from `a [rows, 2F]` and `d_h [rows, F]`.
pub fn swiglu_backward(a: &[f64], d_h: &[f64], ffn: usize) -> Result<Vec<f64>, RefError> {
    let rows = swiglu_rows(a, ffn)?;
    check_len("d_h", d_h, rows * ffn)?;
    let mut da = vec![0.0; rows * 2 * ffn];
    for r in 0..rows {
        let ar = &a[r * 2 * ffn..(r + 1) * 2 * ffn];
        for f in 0..ffn {
            let (g, u, dh) = (ar[f], ar[ffn + f], d_h[r * ffn + f]);
            da[r * 2 * ffn + f] = dh * u * silu_grad(g);
            da[r * 2 * ffn + ffn + f] = dh * silu(g);
        }
    }
    Ok(da)
}

/// The dispatch plan of `topk [tokens * top_k]` (step 7 of the module docs). Errors name the
/// argument: `top_k` not in `1..=8` or above `experts`, `experts == 0`, `align == 0`, a
/// wrong `topk` length, an expert index `>= experts` or picked twice by one token, a
/// capacity beyond `u32`.
pub fn plan(
    topk: &[u32],
    tokens: usize,
    top_k: usize,
    experts: usize,
    align: usize,
) -> Result<Plan, RefError> {
    let capacity = plan_capacity(tokens, top_k, experts, align)?;
    if topk.len() != tokens * top_k {
        return bad(
            "topk",
            format!(
                "length {} != tokens * top_k = {}",
                topk.len(),
                tokens * top_k
            ),
        );
    }
    let mut counts = vec![0u32; experts];
    for (t, chosen) in topk.chunks_exact(top_k).enumerate() {
        for (j, &e) in chosen.iter().enumerate() {
            if e as usize >= experts {
                return bad(
                    "topk",
                    format!("expert {e} at token {t}, slot {j} is not below experts = {experts}"),
                );
            }
            if chosen[..j].contains(&e) {
                return bad("topk", format!("token {t} picks expert {e} twice"));
            }
            counts[e as usize] += 1;
        }
    }
    // Every sum below is at most `capacity`, which fits in u32.
    let mut offsets = Vec::with_capacity(experts + 1);
    offsets.push(0u32);
    for (e, &c) in counts.iter().enumerate() {
        let padded = (c as usize).div_ceil(align) * align;
        offsets.push(offsets[e] + padded as u32);
    }
    let mut cursor = offsets[..experts].to_vec();
    let mut row_of = vec![0u32; topk.len()];
    let mut token_of_row = vec![None; capacity];
    for (i, &e) in topk.iter().enumerate() {
        let row = cursor[e as usize];
        cursor[e as usize] += 1;
        row_of[i] = row;
        token_of_row[row as usize] = Some(((i / top_k) as u32, (i % top_k) as u32));
    }
    Ok(Plan {
        counts,
        offsets,
        capacity,
        row_of,
        token_of_row,
    })
}

/// Steps 2 to 7 from the logits `[T, E]` (the hidden size is not used).
pub fn route_logits(
    dims: &MoeDims,
    cfg: &RouterConfig,
    logits: &[f64],
) -> Result<Routing, RefError> {
    let s = sizes(dims, cfg)?;
    let (t_n, e_n, k) = (s.t, s.e, s.k);
    check_finite("logits", logits, t_n * e_n)?;
    let mut scores = vec![0.0; t_n * e_n];
    let mut probs = vec![0.0; t_n * e_n];
    let mut lse = vec![0.0; t_n];
    let mut topk = vec![0u32; t_n * k];
    let mut gates = vec![0.0; t_n * k];
    let mut order: Vec<usize> = (0..e_n).collect();
    for t in 0..t_n {
        let l = &logits[t * e_n..(t + 1) * e_n];
        let sm = softmax_lse(l, &mut lse[t]);
        let sr = &mut scores[t * e_n..(t + 1) * e_n];
        match cfg.score {
            ScoreFn::Softmax => sr.copy_from_slice(&sm),
            ScoreFn::Sigmoid => {
                for (s, &v) in sr.iter_mut().zip(l) {
                    *s = sigmoid(v);
                }
            }
        }
        let pr = &mut probs[t * e_n..(t + 1) * e_n];
        pr.copy_from_slice(sr);
        if cfg.score == ScoreFn::Sigmoid {
            let sum: f64 = pr.iter().sum();
            pr.iter_mut().for_each(|p| *p /= sum);
        }
        for (i, o) in order.iter_mut().enumerate() {
            *o = i;
        }
        // Ranked by the logits (every score function is monotone in them; the scores, even
        // in f64, can round near-equal logits to one value), ties to the lower expert.
        order.sort_by(|&a, &b| {
            l[b].partial_cmp(&l[a])
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.cmp(&b))
        });
        let chosen = &order[..k];
        let sum: f64 = chosen.iter().map(|&e| sr[e]).sum();
        let norm = cfg.renormalize || cfg.score == ScoreFn::Sigmoid;
        for (j, &e) in chosen.iter().enumerate() {
            topk[t * k + j] = e as u32;
            gates[t * k + j] = if norm { sr[e] / sum } else { sr[e] };
        }
    }
    let plan = plan(&topk, t_n, k, e_n, dims.align)?;
    let (mut aux_loss, mut z_loss) = (0.0, 0.0);
    if t_n > 0 {
        let mut acc = 0.0;
        for e in 0..e_n {
            let f_e = f64::from(plan.counts[e]) / (t_n * k) as f64;
            let p_e = (0..t_n).map(|t| probs[t * e_n + e]).sum::<f64>() / t_n as f64;
            acc += f_e * p_e;
        }
        aux_loss = cfg.aux_coef * e_n as f64 * acc;
        z_loss = cfg.z_coef * lse.iter().map(|v| v * v).sum::<f64>() / t_n as f64;
    }
    Ok(Routing {
        logits: logits.to_vec(),
        scores,
        probs,
        lse,
        topk,
        gates,
        aux_loss,
        z_loss,
        plan,
    })
}

/// Softmax of `l`, writing its logsumexp to `lse`.
fn softmax_lse(l: &[f64], lse: &mut f64) -> Vec<f64> {
    let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut ex: Vec<f64> = l.iter().map(|&v| (v - m).exp()).collect();
    let sum: f64 = ex.iter().sum();
    ex.iter_mut().for_each(|v| *v /= sum);
    *lse = m + sum.ln();
    ex
}

/// Steps 1 to 7: the router on `x [T, H]` with `wr [E, H]`.
pub fn route(
    dims: &MoeDims,
    cfg: &RouterConfig,
    x: &[f64],
    wr: &[f64],
) -> Result<Routing, RefError> {
    let s = sizes(dims, cfg)?;
    check_finite("x", x, s.t * s.h)?;
    check_finite("wr", wr, s.e * s.h)?;
    let mut logits = vec![0.0; s.t * s.e];
    for t in 0..s.t {
        for e in 0..s.e {
            logits[t * s.e + e] = dot(&x[t * s.h..(t + 1) * s.h], &wr[e * s.h..(e + 1) * s.h]);
        }
    }
    route_logits(dims, cfg, &logits)
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The weights as fc1 and fc2 use them: rounded at [`Site::W1`] and [`Site::W2`].
fn rounded_weights(params: &Params, round: Rounding<'_>) -> (Vec<f64>, Vec<f64>) {
    let (mut w1, mut w2) = (params.w1.clone(), params.w2.clone());
    round(Site::W1, &mut w1);
    round(Site::W2, &mut w2);
    (w1, w2)
}

fn check_params(s: &Sizes, params: &Params) -> Res<()> {
    check_finite("wr", &params.wr, s.e * s.h)?;
    check_finite("w1", &params.w1, s.e * 2 * s.f * s.h)?;
    check_finite("w2", &params.w2, s.e * s.h * s.f)
}

/// Where an FP8 layer rounds a tensor: its casts (x, the weights, h, the packed dY and dA)
/// and its bf16 GEMM outputs (fc1's `a`, fc2's `y`, the dgrads `d_h` and `d_xp`). A
/// reference that models them ([`forward_rounded`], [`backward_rounded`]) is what the
/// device computes up to f32-versus-f64 sums, so the layer's tests can hold it to bf16
/// precision instead of the FP8 formats' (a wrong scale or a missed row then shows at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Site {
    /// The packed activations fc1 reads (`x_p`).
    X,
    /// fc1's weights.
    W1,
    /// fc1's output `a`.
    A,
    /// SwiGLU's output `h` (fc2's input).
    H,
    /// fc2's weights.
    W2,
    /// fc2's output `y`.
    Y,
    /// The packed output gradient `d_y` (gate times dy).
    Dy,
    /// fc2's data gradient `d_h`.
    Dh,
    /// SwiGLU's backward `d_a`.
    Da,
    /// fc1's data gradient `d_xp`.
    Dxp,
}

/// A rounding of the values at a [`Site`], in place.
pub type Rounding<'a> = &'a dyn Fn(Site, &mut [f64]);

/// The exact computation: no rounding anywhere.
fn exact(_: Site, _: &mut [f64]) {}

/// The whole forward (steps 1 to 9) of `x [T, H]`.
pub fn forward(
    dims: &MoeDims,
    cfg: &RouterConfig,
    params: &Params,
    x: &[f64],
) -> Result<Forward, RefError> {
    forward_rounded(dims, cfg, params, x, &exact)
}

/// [`forward`] with the values at every forward [`Site`] rounded by `round` before use
/// (`x_p`, the weights, `a`, `h`, `y`; the [`Forward`] holds the rounded ones).
pub fn forward_rounded(
    dims: &MoeDims,
    cfg: &RouterConfig,
    params: &Params,
    x: &[f64],
    round: Rounding<'_>,
) -> Result<Forward, RefError> {
    let s = sizes(dims, cfg)?;
    check_params(&s, params)?;
    let routing = route(dims, cfg, x, &params.wr)?;
    let (h_n, f_n, k, cap) = (s.h, s.f, s.k, s.cap);
    let f2 = 2 * f_n;
    let mut x_p = vec![0.0; cap * h_n];
    let mut a = vec![0.0; cap * f2];
    let mut y = vec![0.0; cap * h_n];
    let mut out = vec![0.0; s.t * h_n];
    let (w1, w2) = rounded_weights(params, round);
    for (i, &r) in routing.plan.row_of.iter().enumerate() {
        let (t, r) = (i / k, r as usize);
        x_p[r * h_n..(r + 1) * h_n].copy_from_slice(&x[t * h_n..(t + 1) * h_n]);
    }
    round(Site::X, &mut x_p);
    for (&e, &r) in routing.topk.iter().zip(&routing.plan.row_of) {
        let (e, r) = (e as usize, r as usize);
        let xr = &x_p[r * h_n..(r + 1) * h_n];
        let w1e = &w1[e * f2 * h_n..(e + 1) * f2 * h_n];
        for c in 0..f2 {
            a[r * f2 + c] = dot(xr, &w1e[c * h_n..(c + 1) * h_n]);
        }
    }
    round(Site::A, &mut a);
    let mut h = swiglu(&a, f_n)?;
    round(Site::H, &mut h);
    for (&e, &r) in routing.topk.iter().zip(&routing.plan.row_of) {
        let (e, r) = (e as usize, r as usize);
        let hr = &h[r * f_n..(r + 1) * f_n];
        let w2e = &w2[e * h_n * f_n..(e + 1) * h_n * f_n];
        for c in 0..h_n {
            y[r * h_n + c] = dot(hr, &w2e[c * f_n..(c + 1) * f_n]);
        }
    }
    round(Site::Y, &mut y);
    // Combine in j order per token.
    for t in 0..s.t {
        for j in 0..k {
            let g = routing.gates[t * k + j];
            let r = routing.plan.row_of[t * k + j] as usize;
            for c in 0..h_n {
                out[t * h_n + c] += g * y[r * h_n + c];
            }
        }
    }
    Ok(Forward {
        routing,
        x_p,
        a,
        h,
        y,
        out,
    })
}

/// `L = sum dy * out + aux + z` of a forward.
pub fn loss(fwd: &Forward, dy: &[f64]) -> Result<f64, RefError> {
    check_finite("dy", dy, fwd.out.len())?;
    Ok(dot(dy, &fwd.out) + fwd.routing.aux_loss + fwd.routing.z_loss)
}

/// Checks that `routing` has the shapes of `dims` and `cfg` and indices in range.
fn check_routing(s: &Sizes, routing: &Routing) -> Res<()> {
    let te = s.t * s.e;
    check_len("routing.logits", &routing.logits, te)?;
    check_len("routing.scores", &routing.scores, te)?;
    check_len("routing.probs", &routing.probs, te)?;
    check_len("routing.lse", &routing.lse, s.t)?;
    check_len("routing.gates", &routing.gates, s.t * s.k)?;
    let p = &routing.plan;
    if routing.topk.len() != s.t * s.k || routing.topk.iter().any(|&e| e as usize >= s.e) {
        return bad("routing.topk", "wrong length or expert index out of range");
    }
    if p.counts.len() != s.e {
        return bad(
            "routing.plan.counts",
            format!("length != experts = {}", s.e),
        );
    }
    if p.capacity != s.cap
        || p.row_of.len() != s.t * s.k
        || p.row_of.iter().any(|&r| r as usize >= s.cap)
    {
        return bad(
            "routing.plan",
            "capacity, row_of length or a row index does not match the dims",
        );
    }
    Ok(())
}

/// The router's backward: `d_logits [T, E]` from `d_gates = dL/dg [T*k]`, with the aux and
/// z-loss gradients added (see the module docs).
pub fn router_backward(
    dims: &MoeDims,
    cfg: &RouterConfig,
    routing: &Routing,
    d_gates: &[f64],
) -> Result<Vec<f64>, RefError> {
    let s = sizes(dims, cfg)?;
    check_routing(&s, routing)?;
    check_finite("d_gates", d_gates, s.t * s.k)?;
    let (t_n, e_n, k) = (s.t, s.e, s.k);
    let mut d_logits = vec![0.0; t_n * e_n];
    if t_n == 0 {
        return Ok(d_logits);
    }
    let c: Vec<f64> = routing
        .plan
        .counts
        .iter()
        .map(|&n| {
            let f_e = f64::from(n) / (t_n * k) as f64;
            cfg.aux_coef * e_n as f64 * f_e / t_n as f64
        })
        .collect();
    let norm = cfg.renormalize || cfg.score == ScoreFn::Sigmoid;
    let mut ds = vec![0.0; e_n];
    for t in 0..t_n {
        let row = t * e_n..(t + 1) * e_n;
        let (sr, pr, l) = (
            &routing.scores[row.clone()],
            &routing.probs[row.clone()],
            &routing.logits[row.clone()],
        );
        let (chosen, dg, g) = (
            &routing.topk[t * k..(t + 1) * k],
            &d_gates[t * k..(t + 1) * k],
            &routing.gates[t * k..(t + 1) * k],
        );
        ds.iter_mut().for_each(|v| *v = 0.0);
        // Gates.
        if norm {
            let sum: f64 = chosen.iter().map(|&e| sr[e as usize]).sum();
            let dot_g = dot(dg, g);
            for (&e, &d) in chosen.iter().zip(dg) {
                ds[e as usize] += (d - dot_g) / sum;
            }
        } else {
            for (&e, &d) in chosen.iter().zip(dg) {
                ds[e as usize] += d;
            }
        }
        // Aux loss through p.
        match cfg.score {
            ScoreFn::Softmax => ds.iter_mut().zip(&c).for_each(|(d, c)| *d += c),
            ScoreFn::Sigmoid => {
                let sum: f64 = sr.iter().sum();
                let cp = dot(&c, pr);
                ds.iter_mut()
                    .zip(&c)
                    .for_each(|(d, c)| *d += (c - cp) / sum);
            }
        }
        // Score function.
        let dl = &mut d_logits[row];
        match cfg.score {
            ScoreFn::Softmax => {
                let dss = dot(&ds, sr);
                for e in 0..e_n {
                    dl[e] = sr[e] * (ds[e] - dss);
                }
            }
            ScoreFn::Sigmoid => {
                for e in 0..e_n {
                    dl[e] = ds[e] * sr[e] * (1.0 - sr[e]);
                }
            }
        }
        // Z-loss.
        let mut lse = 0.0;
        let sm = softmax_lse(l, &mut lse);
        let zc = cfg.z_coef * 2.0 / t_n as f64 * lse;
        for e in 0..e_n {
            dl[e] += zc * sm[e];
        }
    }
    Ok(d_logits)
}

/// The full backward of [`loss`] for the forward `fwd` of `x`, with upstream `dy [T, H]`.
pub fn backward(
    dims: &MoeDims,
    cfg: &RouterConfig,
    params: &Params,
    x: &[f64],
    fwd: &Forward,
    dy: &[f64],
) -> Result<Grads, RefError> {
    backward_rounded(dims, cfg, params, x, fwd, dy, &exact)
}

/// [`backward`] of a [`forward_rounded`] with the values at every backward [`Site`] rounded
/// by `round` before use (`d_y`, `d_h`, `d_a`, `d_xp`), the weights rounded as in the
/// forward, and the forward's rounded tensors (`x_p`, `h`, `y`) where the gradients read
/// them: the straight-through gradient of the rounded forward.
pub fn backward_rounded(
    dims: &MoeDims,
    cfg: &RouterConfig,
    params: &Params,
    x: &[f64],
    fwd: &Forward,
    dy: &[f64],
    round: Rounding<'_>,
) -> Result<Grads, RefError> {
    let s = sizes(dims, cfg)?;
    check_params(&s, params)?;
    check_finite("x", x, s.t * s.h)?;
    check_finite("dy", dy, s.t * s.h)?;
    check_routing(&s, &fwd.routing)?;
    let (t_n, h_n, f_n, e_n, k, cap) = (s.t, s.h, s.f, s.e, s.k, s.cap);
    let f2 = 2 * f_n;
    check_len("fwd.x_p", &fwd.x_p, cap * h_n)?;
    check_len("fwd.a", &fwd.a, cap * f2)?;
    check_len("fwd.h", &fwd.h, cap * f_n)?;
    check_len("fwd.y", &fwd.y, cap * h_n)?;
    check_len("fwd.out", &fwd.out, t_n * h_n)?;
    let routing = &fwd.routing;
    let assignments = || {
        routing
            .topk
            .iter()
            .zip(&routing.plan.row_of)
            .enumerate()
            .map(move |(i, (&e, &r))| (i, i / k, e as usize, r as usize))
    };

    let mut d_gates = vec![0.0; t_n * k];
    let mut d_y = vec![0.0; cap * h_n];
    for (i, t, _, r) in assignments() {
        let dyt = &dy[t * h_n..(t + 1) * h_n];
        d_gates[i] = dot(dyt, &fwd.y[r * h_n..(r + 1) * h_n]);
        let g = routing.gates[i];
        for (d, &v) in d_y[r * h_n..(r + 1) * h_n].iter_mut().zip(dyt) {
            *d = g * v;
        }
    }

    round(Site::Dy, &mut d_y);
    let (w1, w2) = rounded_weights(params, round);
    let mut d_h = vec![0.0; cap * f_n];
    let mut dw2 = vec![0.0; e_n * h_n * f_n];
    for (_, _, e, r) in assignments() {
        let w2e = &w2[e * h_n * f_n..(e + 1) * h_n * f_n];
        let dw2e = &mut dw2[e * h_n * f_n..(e + 1) * h_n * f_n];
        let hr = &fwd.h[r * f_n..(r + 1) * f_n];
        let dyr = &d_y[r * h_n..(r + 1) * h_n];
        let dhr = &mut d_h[r * f_n..(r + 1) * f_n];
        for c in 0..h_n {
            for f in 0..f_n {
                dhr[f] += dyr[c] * w2e[c * f_n + f];
                dw2e[c * f_n + f] += dyr[c] * hr[f];
            }
        }
    }

    round(Site::Dh, &mut d_h);
    let mut d_a = swiglu_backward(&fwd.a, &d_h, f_n)?;
    round(Site::Da, &mut d_a);

    let mut d_xp = vec![0.0; cap * h_n];
    let mut dw1 = vec![0.0; e_n * f2 * h_n];
    for (_, _, e, r) in assignments() {
        let w1e = &w1[e * f2 * h_n..(e + 1) * f2 * h_n];
        let dw1e = &mut dw1[e * f2 * h_n..(e + 1) * f2 * h_n];
        let xr = &fwd.x_p[r * h_n..(r + 1) * h_n];
        let dar = &d_a[r * f2..(r + 1) * f2];
        let dxr = &mut d_xp[r * h_n..(r + 1) * h_n];
        for c in 0..f2 {
            for hh in 0..h_n {
                dxr[hh] += dar[c] * w1e[c * h_n + hh];
                dw1e[c * h_n + hh] += dar[c] * xr[hh];
            }
        }
    }

    round(Site::Dxp, &mut d_xp);
    let d_logits = router_backward(dims, cfg, routing, &d_gates)?;

    let mut dx = vec![0.0; t_n * h_n];
    let mut dwr = vec![0.0; e_n * h_n];
    for t in 0..t_n {
        let dxt = &mut dx[t * h_n..(t + 1) * h_n];
        for j in 0..k {
            let r = routing.plan.row_of[t * k + j] as usize;
            for (d, &v) in dxt.iter_mut().zip(&d_xp[r * h_n..(r + 1) * h_n]) {
                *d += v;
            }
        }
        let xt = &x[t * h_n..(t + 1) * h_n];
        let mut from_router = vec![0.0; h_n];
        for e in 0..e_n {
            let dl = d_logits[t * e_n + e];
            let wre = &params.wr[e * h_n..(e + 1) * h_n];
            for hh in 0..h_n {
                from_router[hh] += dl * wre[hh];
                dwr[e * h_n + hh] += dl * xt[hh];
            }
        }
        for (d, v) in dxt.iter_mut().zip(from_router) {
            *d += v;
        }
    }

    Ok(Grads {
        dx,
        dwr,
        dw1,
        dw2,
        d_gates,
        d_y,
        d_h,
        d_a,
        d_xp,
        d_logits,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// splitmix64: test data (the crate's `bench::Rng` lives in the binary, not the library).
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        /// Uniform in `[-scale, scale)`.
        fn uniform(&mut self, scale: f64) -> f64 {
            ((self.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        }
        fn vec(&mut self, n: usize, scale: f64) -> Vec<f64> {
            (0..n).map(|_| self.uniform(scale)).collect()
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        /// `k` distinct experts out of `e`, in random order.
        fn distinct(&mut self, k: usize, e: usize) -> Vec<u32> {
            let mut all: Vec<u32> = (0..e as u32).collect();
            for i in 0..k {
                let j = i + self.below(e - i);
                all.swap(i, j);
            }
            all.truncate(k);
            all
        }
    }

    const SCORE_CASES: [(ScoreFn, bool); 3] = [
        (ScoreFn::Softmax, false),
        (ScoreFn::Softmax, true),
        (ScoreFn::Sigmoid, false),
    ];

    fn config(score: ScoreFn, top_k: usize, renormalize: bool) -> RouterConfig {
        RouterConfig {
            score,
            top_k,
            renormalize,
            aux_coef: 0.3,
            z_coef: 0.2,
        }
    }

    fn dims(tokens: usize, experts: usize, align: usize) -> MoeDims {
        MoeDims {
            tokens,
            hidden: 8,
            ffn: 5,
            experts,
            align,
        }
    }

    fn random_params(rng: &mut Rng, d: &MoeDims) -> Params {
        let (e, h, f) = (d.experts, d.hidden, d.ffn);
        Params {
            wr: rng.vec(e * h, 0.7),
            w1: rng.vec(e * 2 * f * h, 0.5),
            w2: rng.vec(e * h * f, 0.5),
        }
    }

    const EPS: f64 = 1e-6;

    /// Central differences of `f` at `base` against `analytic`, coordinate by coordinate.
    fn fd_check(what: &str, base: &[f64], analytic: &[f64], mut f: impl FnMut(&[f64]) -> f64) {
        assert_eq!(base.len(), analytic.len(), "{what}: lengths");
        let mut worst = 0.0f64;
        let mut v = base.to_vec();
        for i in 0..base.len() {
            v[i] = base[i] + EPS;
            let lp = f(&v);
            v[i] = base[i] - EPS;
            let lm = f(&v);
            v[i] = base[i];
            let fd = (lp - lm) / (2.0 * EPS);
            let an = analytic[i];
            let err = (an - fd).abs();
            let tol = 1e-6 * an.abs().max(fd.abs()) + 1e-8;
            assert!(
                err <= tol,
                "{what}[{i}]: analytic {an:e} vs finite difference {fd:e} (error {err:e})"
            );
            worst = worst.max(err / (an.abs().max(fd.abs()) + 1e-8));
        }
        assert!(
            analytic.iter().any(|g| g.abs() > 1e-3),
            "{what}: gradient is all but zero, the check means nothing"
        );
        eprintln!("{what}: worst relative error {worst:e}");
    }

    #[test]
    fn gradients_match_finite_differences() {
        let mut seed = 1;
        for (score, renorm) in SCORE_CASES {
            for k in [1, 2, 4] {
                seed += 1;
                let d = dims(6, 4, 3);
                let cfg = config(score, k, renorm);
                let mut rng = Rng(seed);
                let p = random_params(&mut rng, &d);
                let x = rng.vec(d.tokens * d.hidden, 1.0);
                let dy = rng.vec(d.tokens * d.hidden, 1.0);
                let fwd = forward(&d, &cfg, &p, &x).unwrap();
                let g = backward(&d, &cfg, &p, &x, &fwd, &dy).unwrap();
                assert!(fwd.routing.aux_loss != 0.0 && fwd.routing.z_loss != 0.0);
                let topk = fwd.routing.topk.clone();
                let eval = |p: &Params, x: &[f64]| {
                    let f = forward(&d, &cfg, p, x).unwrap();
                    assert_eq!(f.routing.topk, topk, "top-k flipped under eps");
                    loss(&f, &dy).unwrap()
                };
                let tag = format!("{score:?} renorm={renorm} k={k}");
                fd_check(&format!("dx {tag}"), &x, &g.dx, |v| eval(&p, v));
                fd_check(&format!("dwr {tag}"), &p.wr, &g.dwr, |v| {
                    eval(
                        &Params {
                            wr: v.to_vec(),
                            ..p.clone()
                        },
                        &x,
                    )
                });
                fd_check(&format!("dw1 {tag}"), &p.w1, &g.dw1, |v| {
                    eval(
                        &Params {
                            w1: v.to_vec(),
                            ..p.clone()
                        },
                        &x,
                    )
                });
                fd_check(&format!("dw2 {tag}"), &p.w2, &g.dw2, |v| {
                    eval(
                        &Params {
                            w2: v.to_vec(),
                            ..p.clone()
                        },
                        &x,
                    )
                });
            }
        }
    }

    #[test]
    fn router_backward_matches_finite_differences_on_logits() {
        let mut seed = 100;
        for (score, renorm) in SCORE_CASES {
            for k in [1, 2, 3, 6] {
                seed += 1;
                let d = dims(7, 6, 4);
                let cfg = config(score, k, renorm);
                let mut rng = Rng(seed);
                let logits = rng.vec(d.tokens * d.experts, 2.0);
                let dg = rng.vec(d.tokens * k, 1.0);
                let r = route_logits(&d, &cfg, &logits).unwrap();
                let dl = router_backward(&d, &cfg, &r, &dg).unwrap();
                let l_r = |v: &[f64]| {
                    let r2 = route_logits(&d, &cfg, v).unwrap();
                    assert_eq!(r2.topk, r.topk, "top-k flipped under eps");
                    dot(&dg, &r2.gates) + r2.aux_loss + r2.z_loss
                };
                fd_check(
                    &format!("d_logits {score:?} renorm={renorm} k={k}"),
                    &logits,
                    &dl,
                    l_r,
                );
            }
        }
    }

    /// The aux and z-loss gradients alone (no gate gradient), so neither hides the other.
    #[test]
    fn aux_and_z_gradients_alone() {
        for (score, renorm) in SCORE_CASES {
            for (aux_coef, z_coef) in [(1.0, 0.0), (0.0, 1.0)] {
                let d = dims(5, 4, 1);
                let cfg = RouterConfig {
                    aux_coef,
                    z_coef,
                    ..config(score, 2, renorm)
                };
                let logits = Rng(7).vec(d.tokens * d.experts, 2.0);
                let zero = vec![0.0; d.tokens * 2];
                let r = route_logits(&d, &cfg, &logits).unwrap();
                let dl = router_backward(&d, &cfg, &r, &zero).unwrap();
                fd_check(
                    &format!("aux/z {score:?} {aux_coef} {z_coef}"),
                    &logits,
                    &dl,
                    |v| {
                        let r2 = route_logits(&d, &cfg, v).unwrap();
                        assert_eq!(r2.topk, r.topk);
                        r2.aux_loss + r2.z_loss
                    },
                );
            }
        }
    }

    /// A rounding only at `H` that zeroes it: the forward's fc2 sees zeros (out, y and the
    /// gates' gradient vanish, so does dW2), while the backward is straight-through
    /// (`d_h = d_y . W2` does not read h, so dW1 and d_xp equal the exact ones).
    #[test]
    fn roundings_apply_where_they_are_named() {
        let mut rng = Rng(77);
        let d = dims(6, 4, 3);
        let cfg = config(ScoreFn::Softmax, 2, false);
        let p = random_params(&mut rng, &d);
        let x = rng.vec(d.tokens * d.hidden, 1.0);
        let dy = rng.vec(d.tokens * d.hidden, 1.0);
        let zero_h = |site: Site, v: &mut [f64]| {
            if site == Site::H {
                v.fill(0.0);
            }
        };
        let exact_f = forward(&d, &cfg, &p, &x).unwrap();
        let exact_g = backward(&d, &cfg, &p, &x, &exact_f, &dy).unwrap();
        let f = forward_rounded(&d, &cfg, &p, &x, &zero_h).unwrap();
        let g = backward_rounded(&d, &cfg, &p, &x, &f, &dy, &zero_h).unwrap();
        assert!(
            f.out
                .iter()
                .chain(&f.y)
                .chain(&g.d_gates)
                .chain(&g.dw2)
                .all(|&v| v == 0.0)
        );
        assert_eq!(g.dw1, exact_g.dw1);
        assert_eq!(g.d_xp, exact_g.d_xp);
        assert!(exact_g.dw2.iter().any(|&v| v != 0.0));
        // A rounding of the weights reaches both passes: halving W1 halves a (and d_xp).
        let half_w1 = |site: Site, v: &mut [f64]| {
            if site == Site::W1 {
                v.iter_mut().for_each(|x| *x *= 0.5);
            }
        };
        let f = forward_rounded(&d, &cfg, &p, &x, &half_w1).unwrap();
        for (a, b) in f.a.iter().zip(&exact_f.a) {
            assert!((a - 0.5 * b).abs() <= 1e-12 * b.abs().max(1.0));
        }
        let g = backward_rounded(&d, &cfg, &p, &x, &f, &dy, &half_w1).unwrap();
        let dh_same = g.d_h == backward(&d, &cfg, &p, &x, &f, &dy).unwrap().d_h;
        assert!(dh_same, "d_h reads W2 and d_y only");
    }

    #[test]
    fn swiglu_backward_matches_finite_differences() {
        let mut rng = Rng(5);
        let (rows, ffn) = (3, 4);
        let a = rng.vec(rows * 2 * ffn, 3.0);
        let dh = rng.vec(rows * ffn, 1.0);
        let h = swiglu(&a, ffn).unwrap();
        for r in 0..rows {
            for f in 0..ffn {
                let (g, u) = (a[r * 2 * ffn + f], a[r * 2 * ffn + ffn + f]);
                let want = g / (1.0 + (-g).exp()) * u;
                assert!((h[r * ffn + f] - want).abs() < 1e-14);
            }
        }
        let da = swiglu_backward(&a, &dh, ffn).unwrap();
        fd_check("swiglu d_a", &a, &da, |v| {
            dot(&dh, &swiglu(v, ffn).unwrap())
        });
        assert_eq!(swiglu(&[1.0; 7], 2).unwrap_err().argument, "a");
        assert_eq!(
            swiglu_backward(&a, &dh[1..], ffn).unwrap_err().argument,
            "d_h"
        );
    }

    /// Routing against a naive, separately written computation.
    #[test]
    fn routing_matches_naive() {
        let mut seed = 200;
        for (score, renorm) in SCORE_CASES {
            for k in [1, 3, 5] {
                seed += 1;
                let (t_n, e_n) = (9, 5);
                let d = dims(t_n, e_n, 2);
                let cfg = config(score, k, renorm);
                let mut rng = Rng(seed);
                let x = rng.vec(t_n * d.hidden, 1.0);
                let wr = rng.vec(e_n * d.hidden, 1.0);
                let r = route(&d, &cfg, &x, &wr).unwrap();
                let mut counts = vec![0.0; e_n];
                let mut psum = vec![0.0; e_n];
                let mut z = 0.0;
                for t in 0..t_n {
                    let l: Vec<f64> = (0..e_n)
                        .map(|e| {
                            (0..d.hidden)
                                .map(|h| x[t * d.hidden + h] * wr[e * d.hidden + h])
                                .sum()
                        })
                        .collect();
                    let total: f64 = l.iter().map(|v| v.exp()).sum();
                    let s: Vec<f64> = match score {
                        ScoreFn::Softmax => l.iter().map(|v| v.exp() / total).collect(),
                        ScoreFn::Sigmoid => l.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect(),
                    };
                    let ssum: f64 = s.iter().sum();
                    // Repeated argmax, first maximum wins.
                    let mut taken = vec![false; e_n];
                    let mut chosen = vec![];
                    for _ in 0..k {
                        let mut best = usize::MAX;
                        for e in 0..e_n {
                            if !taken[e] && (best == usize::MAX || s[e] > s[best]) {
                                best = e;
                            }
                        }
                        taken[best] = true;
                        chosen.push(best);
                    }
                    let csum: f64 = chosen.iter().map(|&e| s[e]).sum();
                    for (j, &e) in chosen.iter().enumerate() {
                        assert_eq!(r.topk[t * k + j], e as u32);
                        let g = if renorm || score == ScoreFn::Sigmoid {
                            s[e] / csum
                        } else {
                            s[e]
                        };
                        assert!((r.gates[t * k + j] - g).abs() < 1e-12);
                        counts[e] += 1.0;
                    }
                    for e in 0..e_n {
                        assert!((r.logits[t * e_n + e] - l[e]).abs() < 1e-12);
                        assert!((r.scores[t * e_n + e] - s[e]).abs() < 1e-12);
                        let p = if score == ScoreFn::Sigmoid {
                            s[e] / ssum
                        } else {
                            s[e]
                        };
                        assert!((r.probs[t * e_n + e] - p).abs() < 1e-12);
                        psum[e] += p;
                    }
                    z += total.ln().powi(2);
                }
                let aux: f64 = (0..e_n)
                    .map(|e| counts[e] / (t_n * k) as f64 * psum[e] / t_n as f64)
                    .sum::<f64>()
                    * e_n as f64
                    * cfg.aux_coef;
                assert!((r.aux_loss - aux).abs() < 1e-12, "{} vs {aux}", r.aux_loss);
                assert!((r.z_loss - cfg.z_coef * z / t_n as f64).abs() < 1e-12);
            }
        }
    }

    /// Forward against a per-token computation that does not use the plan.
    #[test]
    fn forward_matches_direct_per_token() {
        for (score, renorm) in SCORE_CASES {
            let d = dims(7, 4, 4);
            let cfg = config(score, 2, renorm);
            let mut rng = Rng(300);
            let p = random_params(&mut rng, &d);
            let x = rng.vec(d.tokens * d.hidden, 1.0);
            let fwd = forward(&d, &cfg, &p, &x).unwrap();
            let (h_n, f_n) = (d.hidden, d.ffn);
            for t in 0..d.tokens {
                let xt = &x[t * h_n..(t + 1) * h_n];
                let mut want = vec![0.0; h_n];
                for j in 0..2 {
                    let e = fwd.routing.topk[t * 2 + j] as usize;
                    let row = |i: usize| {
                        (0..h_n)
                            .map(|c| xt[c] * p.w1[(e * 2 * f_n + i) * h_n + c])
                            .sum::<f64>()
                    };
                    let hid: Vec<f64> = (0..f_n)
                        .map(|f| {
                            let g = row(f);
                            g / (1.0 + (-g).exp()) * row(f_n + f)
                        })
                        .collect();
                    for (c, w) in want.iter_mut().enumerate() {
                        let yv: f64 = (0..f_n)
                            .map(|f| hid[f] * p.w2[(e * h_n + c) * f_n + f])
                            .sum();
                        *w += fwd.routing.gates[t * 2 + j] * yv;
                    }
                }
                for (c, w) in want.iter().enumerate() {
                    assert!((fwd.out[t * h_n + c] - w).abs() < 1e-12);
                }
            }
        }
    }

    #[test]
    fn padding_rows_are_zero() {
        let d = dims(5, 4, 8);
        let cfg = config(ScoreFn::Softmax, 2, true);
        let mut rng = Rng(400);
        let p = random_params(&mut rng, &d);
        let x = rng.vec(d.tokens * d.hidden, 1.0);
        let dy = rng.vec(d.tokens * d.hidden, 1.0);
        let fwd = forward(&d, &cfg, &p, &x).unwrap();
        let g = backward(&d, &cfg, &p, &x, &fwd, &dy).unwrap();
        let plan = &fwd.routing.plan;
        assert_eq!(plan.capacity, 5 * 2 + 4 * 7);
        let (h, f) = (d.hidden, d.ffn);
        let mut padding = 0;
        for (r, who) in plan.token_of_row.iter().enumerate() {
            let bufs: [(&[f64], usize); 8] = [
                (&fwd.x_p, h),
                (&fwd.a, 2 * f),
                (&fwd.h, f),
                (&fwd.y, h),
                (&g.d_y, h),
                (&g.d_h, f),
                (&g.d_a, 2 * f),
                (&g.d_xp, h),
            ];
            for (buf, w) in bufs {
                let row = &buf[r * w..(r + 1) * w];
                if who.is_none() {
                    assert!(row.iter().all(|&v| v == 0.0), "padding row {r} not zero");
                } else {
                    assert!(row.iter().any(|&v| v != 0.0), "real row {r} all zero");
                }
            }
            padding += usize::from(who.is_none());
        }
        assert_eq!(padding, plan.capacity - 10);
        // d_gates and d_y by their definitions.
        for t in 0..d.tokens {
            for j in 0..2 {
                let r = plan.row_of[t * 2 + j] as usize;
                let want: f64 = (0..h).map(|c| dy[t * h + c] * fwd.y[r * h + c]).sum();
                assert!((g.d_gates[t * 2 + j] - want).abs() < 1e-12);
                let gate = fwd.routing.gates[t * 2 + j];
                for c in 0..h {
                    assert_eq!(g.d_y[r * h + c], gate * dy[t * h + c]);
                }
            }
        }
    }

    #[test]
    fn no_tokens() {
        let d = dims(0, 4, 16);
        let cfg = config(ScoreFn::Sigmoid, 2, false);
        let p = random_params(&mut Rng(1), &d);
        let fwd = forward(&d, &cfg, &p, &[]).unwrap();
        assert!(fwd.out.is_empty());
        assert_eq!((fwd.routing.aux_loss, fwd.routing.z_loss), (0.0, 0.0));
        assert_eq!(fwd.routing.plan.offsets, vec![0; 5]);
        assert_eq!(fwd.routing.plan.capacity, 4 * 15);
        let g = backward(&d, &cfg, &p, &[], &fwd, &[]).unwrap();
        assert!(g.dwr.iter().chain(&g.dw1).chain(&g.dw2).all(|&v| v == 0.0));
    }

    #[test]
    fn equal_logits_tie_to_lower_index() {
        let e_n = 5;
        for (score, renorm) in SCORE_CASES {
            let d = dims(3, e_n, 1);
            let cfg = config(score, 3, renorm);
            let r = route_logits(&d, &cfg, &[0.0; 15]).unwrap();
            assert_eq!(r.topk, [0, 1, 2, 0, 1, 2, 0, 1, 2]);
            let g = if score == ScoreFn::Softmax && !renorm {
                0.2
            } else {
                1.0 / 3.0
            };
            assert!(r.gates.iter().all(|&v| (v - g).abs() < 1e-15));
            // Uniform p and sum_e f_e = 1: aux = aux_coef; lse = ln E.
            assert!((r.aux_loss - 0.3).abs() < 1e-15);
            assert!((r.z_loss - 0.2 * 5f64.ln().powi(2)).abs() < 1e-14);
        }
        for score in [ScoreFn::Softmax, ScoreFn::Sigmoid] {
            let logits = [1.0, 3.0, 3.0, 0.0, 3.0, -1.0];
            let d = dims(1, 6, 1);
            let r = route_logits(&d, &config(score, 4, false), &logits).unwrap();
            assert_eq!(r.topk, [1, 2, 4, 0]);
            let r = route_logits(&d, &config(score, 6, false), &logits).unwrap();
            assert_eq!(r.topk, [1, 2, 4, 0, 3, 5]);
        }
    }

    #[test]
    fn sigmoid_gates_sum_to_one() {
        for k in 1..=MAX_TOP_K {
            let d = dims(11, 16, 1);
            let cfg = config(ScoreFn::Sigmoid, k, false);
            let logits = Rng(k as u64).vec(11 * 16, 4.0);
            let r = route_logits(&d, &cfg, &logits).unwrap();
            for t in 0..11 {
                let g = &r.gates[t * k..(t + 1) * k];
                assert!((g.iter().sum::<f64>() - 1.0).abs() < 1e-14);
                assert!(g.windows(2).all(|w| w[0] >= w[1]));
                let s = &r.scores[t * 16..(t + 1) * 16];
                let kth = s[r.topk[t * k + k - 1] as usize];
                let chosen = &r.topk[t * k..(t + 1) * k];
                for e in 0..16u32 {
                    if !chosen.contains(&e) {
                        assert!(s[e as usize] <= kth);
                    }
                }
            }
        }
    }

    /// Checks a plan against its definition, computed independently.
    fn check_plan(topk: &[u32], tokens: usize, k: usize, experts: usize, align: usize) -> Plan {
        let p = plan(topk, tokens, k, experts, align).unwrap();
        let cap = tokens * k + experts * (align - 1);
        assert_eq!(p.capacity, cap);
        assert_eq!(p.offsets.len(), experts + 1);
        assert_eq!(p.offsets[0], 0);
        assert!(p.offsets[experts] as usize <= cap);
        assert_eq!(p.token_of_row.len(), cap);
        for e in 0..experts {
            let n = topk.iter().filter(|&&v| v as usize == e).count();
            assert_eq!(p.counts[e] as usize, n);
            let width = (p.offsets[e + 1] - p.offsets[e]) as usize;
            assert_eq!(width % align, 0);
            assert!(width >= n && width < n + align);
        }
        // row_of is a bijection onto the non-padding rows.
        let mut seen = vec![false; cap];
        for (i, &r) in p.row_of.iter().enumerate() {
            let r = r as usize;
            assert!(!seen[r], "row {r} used twice");
            seen[r] = true;
            assert_eq!(p.token_of_row[r], Some(((i / k) as u32, (i % k) as u32)));
            let e = topk[i] as usize;
            assert!(r >= p.offsets[e] as usize && r < (p.offsets[e] + p.counts[e]) as usize);
            // Stable token order: the rank among earlier tokens of the same expert.
            let earlier = topk[..(i / k) * k]
                .iter()
                .filter(|&&v| v == topk[i])
                .count();
            assert_eq!(r, p.offsets[e] as usize + earlier);
        }
        let used = p.token_of_row.iter().filter(|w| w.is_some()).count();
        assert_eq!(used, tokens * k);
        p
    }

    #[test]
    fn plan_layout() {
        let mut rng = Rng(500);
        for (tokens, k, experts, align) in
            [(10, 2, 4, 4), (13, 3, 5, 1), (7, 1, 3, 128), (9, 4, 4, 3)]
        {
            let topk: Vec<u32> = (0..tokens).flat_map(|_| rng.distinct(k, experts)).collect();
            check_plan(&topk, tokens, k, experts, align);
        }
        // All tokens to one expert; experts without tokens.
        let p = check_plan(&[2; 9], 9, 1, 4, 4);
        assert_eq!(p.counts, [0, 0, 9, 0]);
        assert_eq!(p.offsets, [0, 0, 0, 12, 12]);
        assert_eq!(p.row_of, (0..9).collect::<Vec<u32>>());
        // A small hand-checked case.
        let p = check_plan(&[1, 0, 1, 2, 0, 2], 3, 2, 3, 2);
        assert_eq!(p.counts, [2, 2, 2]);
        assert_eq!(p.offsets, [0, 2, 4, 6]);
        assert_eq!(p.row_of, [2, 0, 3, 4, 1, 5]);
        // E = 256, k = 8.
        let topk: Vec<u32> = (0..100).flat_map(|_| rng.distinct(8, 256)).collect();
        let p = check_plan(&topk, 100, 8, 256, 128);
        assert_eq!(p.capacity, 800 + 256 * 127);
    }

    #[test]
    fn bad_input_names_the_argument() {
        let arg = |r: Result<Plan, RefError>| r.unwrap_err().argument;
        assert_eq!(arg(plan(&[], 0, 0, 4, 1)), "top_k");
        assert_eq!(arg(plan(&[0; 9], 1, 9, 16, 1)), "top_k");
        assert_eq!(arg(plan(&[0; 3], 1, 3, 2, 1)), "top_k");
        assert_eq!(arg(plan(&[0, 4], 1, 2, 4, 1)), "topk");
        assert_eq!(arg(plan(&[0, 1, 2], 2, 2, 4, 1)), "topk");
        assert_eq!(arg(plan(&[1, 1], 1, 2, 4, 1)), "topk");
        assert_eq!(arg(plan(&[0], 1, 1, 4, 0)), "align");
        assert_eq!(arg(plan(&[], 0, 1, 0, 1)), "experts");
        assert_eq!(arg(plan(&[], 1 << 31, 8, 16, 1)), "tokens");
        assert_eq!(arg(plan(&[], 1, 1, 1 << 20, 1 << 13)), "align");
        let e = plan(&[0, 4], 1, 2, 4, 1).unwrap_err();
        assert!(e.to_string().contains("`topk`"), "{e}");

        let d = dims(2, 4, 1);
        let cfg = config(ScoreFn::Softmax, 2, false);
        let p = random_params(&mut Rng(9), &d);
        let x = vec![0.5; 2 * 8];
        let fwd_err = |d: &MoeDims, cfg: &RouterConfig, p: &Params, x: &[f64]| {
            forward(d, cfg, p, x).unwrap_err().argument
        };
        assert_eq!(fwd_err(&d, &cfg, &p, &x[1..]), "x");
        let mut nan = x.clone();
        nan[3] = f64::NAN;
        assert_eq!(fwd_err(&d, &cfg, &p, &nan), "x");
        for (field, name) in [(0, "wr"), (1, "w1"), (2, "w2")] {
            let mut q = p.clone();
            [&mut q.wr, &mut q.w1, &mut q.w2][field].pop();
            assert_eq!(fwd_err(&d, &cfg, &q, &x), name);
        }
        let top9 = config(ScoreFn::Softmax, 9, false);
        assert_eq!(fwd_err(&d, &top9, &p, &x), "top_k");
        let top5 = config(ScoreFn::Softmax, 5, false);
        assert_eq!(fwd_err(&d, &top5, &p, &x), "top_k");
        let inf = RouterConfig {
            z_coef: f64::INFINITY,
            ..cfg.clone()
        };
        assert_eq!(fwd_err(&d, &inf, &p, &x), "z_coef");
        let huge = MoeDims {
            hidden: usize::MAX / 2,
            ..d
        };
        assert_eq!(fwd_err(&huge, &cfg, &p, &x), "hidden");

        let fwd = forward(&d, &cfg, &p, &x).unwrap();
        let dy = vec![1.0; 16];
        assert_eq!(loss(&fwd, &dy[1..]).unwrap_err().argument, "dy");
        let bwd_err =
            |fwd: &Forward, dy: &[f64]| backward(&d, &cfg, &p, &x, fwd, dy).unwrap_err().argument;
        assert_eq!(bwd_err(&fwd, &dy[1..]), "dy");
        let mut f2 = fwd.clone();
        f2.routing.topk[0] = 4;
        assert_eq!(bwd_err(&f2, &dy), "routing.topk");
        let mut f2 = fwd.clone();
        f2.routing.plan.row_of[0] = 1000;
        assert_eq!(bwd_err(&f2, &dy), "routing.plan");
        let mut f2 = fwd.clone();
        f2.h.pop();
        assert_eq!(bwd_err(&f2, &dy), "fwd.h");
        let r = &fwd.routing;
        assert_eq!(
            router_backward(&d, &cfg, r, &[0.0; 3])
                .unwrap_err()
                .argument,
            "d_gates"
        );
        assert_eq!(
            route_logits(&d, &cfg, &[0.0; 7]).unwrap_err().argument,
            "logits"
        );
    }
}
