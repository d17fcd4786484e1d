//! The MoE part of the soak: the full-layer graphed [`Fp8Moe`] (one graph per forward,
//! grouped GEMM reading the per-expert counts on the device) replayed with a new input every
//! replay, planned so that the per-expert token counts differ from the previous replay's,
//! and checked against an eager run of an identical layer every `check_every` replays.
//!
//! # Routing that the host decides
//!
//! The router weights give expert `e` the feature `e` with weight 8 (0 for the others) and
//! every feature from `E` on small noise (|w| <= 1/16). An input row sets feature `k` to 4
//! and the other first `E` features to 0, the rest noise (|x| <= 1): expert `k`'s logit is
//! 32 plus noise, every other one noise alone, and the noise is at most `(H - E) / 16` =
//! 7.5 for H = 128. So the token goes to `k` whatever the rounding, and the host knows each
//! replay's counts before it runs: [`plan_experts`] draws them so that they differ from the
//! previous replay's, and every check reads the layer's counts back and compares them with
//! the plan (and with the counts before the replay, which must differ).

use cuda_graph::{DeviceBuffer, GraphPool, Stream};
use fp8_moe::moe::{ExpertGemm, Fp8Moe, MoeConfig, Routing, RoutingHandle};
use graphed_callables::{Callable, GraphIndex, GraphedCallables, GraphedOptions, Schedule, Slot};

use super::{Rng, Stats, diff_problem};
use crate::bench::BenchResult;

/// The soak's MoE shape: small, so a replay is bound by its launches, not its math.
pub const MOE: MoeConfig = MoeConfig {
    tokens: 128,
    hidden: 128,
    ffn: 64,
    experts: 8,
};
/// Microbatches of the schedule `[1, 1, 1, -1, -1, -1]`: a graph each.
const MICROBATCHES: usize = 3;
const ORDER: [i64; 6] = [1, 1, 1, -1, -1, -1];
/// A routing feature's value in the input, and the router weight that reads it.
const ROUTE_X: f32 = 4.0;
const ROUTE_W: f32 = 8.0;
/// The scale of the noise in the input and in the router and expert weights.
const X_NOISE: f32 = 1.0;
const W_NOISE: f32 = 1.0 / 16.0;

/// Router weights `[E, H]`: expert `e` reads feature `e` with weight 8 and no other routing
/// feature; the features from `E` on get noise.
pub fn router_weights(rng: &mut Rng, cfg: MoeConfig) -> Vec<f32> {
    let (e, h) = (cfg.experts, cfg.hidden);
    let mut w = vec![0f32; e * h];
    for (i, row) in w.chunks_mut(h).enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            *v = if j < e {
                if j == i { ROUTE_W } else { 0.0 }
            } else {
                rng.uniform(W_NOISE)
            };
        }
    }
    w
}

/// Expert weights `[E, F, H]`, noise.
pub fn expert_weights(rng: &mut Rng, cfg: MoeConfig) -> Vec<f32> {
    (0..cfg.experts * cfg.ffn * cfg.hidden)
        .map(|_| rng.uniform(W_NOISE))
        .collect()
}

/// Draws each token's expert for the next replay into `experts_of` (one per token) and
/// returns the per-expert counts, which differ from `prev` whenever that is possible
/// (at least 2 experts and 1 token). The patterns, drawn per replay: every token to one
/// expert (1 in 16), two experts taking turns (1 in 16), or each token to a "hot" expert
/// with a random probability and uniformly otherwise (so some experts often get none).
/// When the draw repeats `prev`, token 0 moves to the next expert.
pub fn plan_experts(
    rng: &mut Rng,
    experts: usize,
    prev: &[i32],
    experts_of: &mut [usize],
) -> Vec<i32> {
    let mut counts = vec![0i32; experts];
    if experts == 0 {
        return counts;
    }
    let pattern = rng.below(16);
    let hot = rng.below(experts);
    let other = rng.below(experts);
    let p_hot = rng.below(1025);
    for (t, e) in experts_of.iter_mut().enumerate() {
        *e = match pattern {
            0 => hot,
            1 => {
                if t % 2 == 0 {
                    hot
                } else {
                    other
                }
            }
            _ => {
                if rng.below(1024) < p_hot {
                    hot
                } else {
                    rng.below(experts)
                }
            }
        };
        counts[*e] += 1;
    }
    if counts == prev
        && experts > 1
        && let Some(first) = experts_of.first_mut()
    {
        counts[*first] -= 1;
        *first = (*first + 1) % experts;
        counts[*first] += 1;
    }
    counts
}

/// Fills `x` (`[T, H]`, `T = experts_of.len()`) with the rows that route token `t` to
/// `experts_of[t]`: the routing features one-hot ([`ROUTE_X`]), the rest noise.
pub fn fill_input(rng: &mut Rng, cfg: MoeConfig, experts_of: &[usize], x: &mut [f32]) {
    for (row, &k) in x.chunks_mut(cfg.hidden).zip(experts_of) {
        for (j, v) in row.iter_mut().enumerate() {
            *v = if j < cfg.experts {
                if j == k { ROUTE_X } else { 0.0 }
            } else {
                rng.uniform(X_NOISE)
            };
        }
    }
}

/// An eager MoE layer (grouped GEMM) and its output: the reference every graphed replay is
/// compared with, bit for bit (tests/moe.rs: full-layer == eager grouped).
pub struct Reference {
    layer: Fp8Moe,
    y: DeviceBuffer<f32>,
    pool: GraphPool,
}

impl Reference {
    /// A layer with these weights.
    pub fn new(stream: &Stream, router: &[f32], experts: &[f32]) -> BenchResult<Reference> {
        let ctx = stream.context();
        Ok(Reference {
            layer: Fp8Moe::new(stream, MOE, router, experts, ExpertGemm::Grouped)?,
            y: DeviceBuffer::alloc(ctx, MOE.tokens * MOE.ffn)?,
            pool: GraphPool::new(ctx, 256)?,
        })
    }

    /// The eager forward of `x`: output and routing (waits for `stream`).
    pub fn run(
        &mut self,
        stream: &Stream,
        x: &DeviceBuffer<f32>,
    ) -> BenchResult<(Vec<f32>, Routing)> {
        let slot = Slot::new(at(0), vec![x], vec![&self.y], vec![]).with_pool(&self.pool);
        self.layer.forward(stream, &[x], &[&self.y], &slot)?;
        let y = self.y.to_vec(stream)?;
        Ok((y, self.layer.routing(stream)?))
    }
}

/// Chunk 0, layer 0 of `microbatch`.
pub fn at(microbatch: usize) -> GraphIndex {
    GraphIndex {
        chunk: 0,
        microbatch,
        layer: 0,
    }
}

/// What is wrong with a graphed forward (`y`, `routing`) against the eager one of the same
/// input and the counts its input was planned to give; empty when nothing is. Outputs are
/// compared bit for bit; a non-finite eager output is a problem of its own (the comparison
/// would mean little).
pub fn routing_problems(
    y: &[f32],
    routing: &Routing,
    eager_y: &[f32],
    eager: &Routing,
    planned: &[i32],
) -> Vec<String> {
    let mut problems = Vec::new();
    if let Some(i) = eager_y.iter().position(|v| !v.is_finite()) {
        problems.push(format!("eager output element {i} is {}", eager_y[i]));
    }
    problems.extend(diff_problem("output", y, eager_y));
    if routing.counts != planned {
        problems.push(format!(
            "counts {:?}, the input planned {planned:?}",
            routing.counts
        ));
    }
    if routing.counts != eager.counts
        || routing.expert != eager.expert
        || routing.position != eager.position
    {
        problems.push(format!(
            "routing differs from eager (counts {:?} vs {:?})",
            routing.counts, eager.counts
        ));
    }
    problems
}

/// The graphed MoE layer, its eager twin, and the host side of its inputs.
pub struct MoeSoak {
    graphed: GraphedCallables<f32>,
    routing: RoutingHandle,
    reference: Reference,
    /// The three microbatches' inputs of one step, uploaded in one copy.
    staging: DeviceBuffer<f32>,
    /// Views of `staging`, one per microbatch.
    inputs: Vec<DeviceBuffer<f32>>,
    host: Vec<f32>,
    experts_of: Vec<usize>,
    /// The counts each microbatch's input of this step was planned to give.
    planned: Vec<Vec<i32>>,
    /// The counts of the last planned input.
    last_planned: Vec<i32>,
    rng: Rng,
    /// Replays (forwards), checks, mismatches.
    pub stats: Stats,
    /// Checks whose counts differed from the replay before.
    pub counts_changed: u64,
}

impl MoeSoak {
    /// Builds the graphed layer (warmup and capture included) and its eager twin, with
    /// weights from `weights_rng` and inputs from `rng`.
    pub fn new(stream: &Stream, weights_rng: &mut Rng, rng: Rng) -> BenchResult<MoeSoak> {
        let router = router_weights(weights_rng, MOE);
        let experts = expert_weights(weights_rng, MOE);
        let layer = Fp8Moe::new(stream, MOE, &router, &experts, ExpertGemm::Grouped)?;
        let routing = layer.routing_handle();
        let reference = Reference::new(stream, &router, &experts)?;
        let n = MOE.tokens * MOE.hidden;
        // Zeros: the build's warmup runs on them (see `last_planned` below).
        let staging = DeviceBuffer::from_host(stream, &vec![0f32; MICROBATCHES * n])?;
        let inputs = (0..MICROBATCHES)
            .map(|mb| staging.slice(mb * n..(mb + 1) * n))
            .collect::<Result<Vec<_>, _>>()?;
        let mut soak = MoeSoak {
            graphed: GraphedCallables::build(
                stream,
                vec![Box::new(layer) as Box<dyn Callable<f32>>],
                &[vec![&inputs[0]]],
                GraphedOptions::new(Schedule::new(&ORDER, vec![1])?),
            )?,
            routing,
            reference,
            staging,
            inputs,
            host: vec![0f32; MICROBATCHES * n],
            experts_of: vec![0; MOE.tokens],
            planned: vec![Vec::new(); MICROBATCHES],
            last_planned: Vec::new(),
            rng,
            stats: Stats::default(),
            counts_changed: 0,
        };
        // The sample input the build used is zeros: the first plan differs from its counts
        // (all tokens to expert 0) like any other.
        soak.last_planned = vec![0; MOE.experts];
        soak.last_planned[0] = MOE.tokens as i32;
        Ok(soak)
    }

    /// One training step of the schedule: three forward replays (each a new input, each
    /// checked when the replay count is a multiple of `check_every`), then the three
    /// (trivial) backward replays.
    pub fn step(&mut self, stream: &Stream, check_every: u64) -> BenchResult<()> {
        let n = MOE.tokens * MOE.hidden;
        for mb in 0..MICROBATCHES {
            let counts = plan_experts(
                &mut self.rng,
                MOE.experts,
                &self.last_planned,
                &mut self.experts_of,
            );
            fill_input(
                &mut self.rng,
                MOE,
                &self.experts_of,
                &mut self.host[mb * n..(mb + 1) * n],
            );
            self.planned[mb] = counts.clone();
            self.last_planned = counts;
        }
        // Waits for the previous step, whose forwards read the old inputs.
        self.staging.copy_from_host(stream, &self.host)?;
        for mb in 0..MICROBATCHES {
            let check = self.stats.replays % check_every.max(1) == 0;
            let before = if check {
                Some(self.routing.read(stream)?.counts)
            } else {
                None
            };
            self.graphed.forward(0, mb, &[&self.inputs[mb]], stream)?;
            self.stats.replays += 1;
            if let Some(before) = before {
                self.check(stream, mb, &before)?;
            }
        }
        for mb in 0..MICROBATCHES {
            let g = self.graphed.static_grad_outputs(0, mb)?;
            self.graphed.backward(0, mb, &g, stream)?;
        }
        Ok(())
    }

    /// Compares the forward just replayed for `mb` with an eager run on its input.
    fn check(&mut self, stream: &Stream, mb: usize, before: &[i32]) -> BenchResult<()> {
        let y = self.graphed.static_outputs(0, mb)?[0].to_vec(stream)?;
        let routing = self.routing.read(stream)?;
        let (eager_y, eager) = self.reference.run(stream, &self.inputs[mb])?;
        let mut problems = routing_problems(&y, &routing, &eager_y, &eager, &self.planned[mb]);
        if routing.counts.as_slice() != before {
            self.counts_changed += 1;
        } else {
            problems.push(format!(
                "counts {:?} did not change from the replay before",
                routing.counts
            ));
        }
        let replay = self.stats.replays - 1;
        self.stats.record_check(
            || format!("MoE replay {replay} (microbatch {mb})"),
            problems,
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fp8_moe::moe::plan_routing;

    #[test]
    fn planned_counts_always_change_and_cover_the_patterns() {
        let mut rng = Rng::new(7, 1);
        let mut experts_of = vec![0usize; MOE.tokens];
        let mut prev = vec![0i32; MOE.experts];
        let (mut all_to_one, mut some_empty) = (0, 0);
        for _ in 0..20_000 {
            let counts = plan_experts(&mut rng, MOE.experts, &prev, &mut experts_of);
            assert_ne!(counts, prev);
            assert_eq!(counts.iter().sum::<i32>(), MOE.tokens as i32);
            let mut recount = vec![0i32; MOE.experts];
            for &e in &experts_of {
                recount[e] += 1;
            }
            assert_eq!(recount, counts, "counts match the assignment");
            all_to_one += usize::from(counts.iter().any(|&c| c >= MOE.tokens as i32 - 1));
            some_empty += usize::from(counts.contains(&0));
            prev = counts;
        }
        assert!(all_to_one > 500, "{all_to_one}");
        assert!(some_empty > 2_000, "{some_empty}");
    }

    #[test]
    fn a_repeated_draw_moves_token_zero() {
        // Two tokens, two experts: the draws repeat often; the counts still change.
        let mut rng = Rng::new(3, 2);
        let mut experts_of = vec![0usize; 2];
        let mut prev = vec![1, 1];
        for _ in 0..1000 {
            let counts = plan_experts(&mut rng, 2, &prev, &mut experts_of);
            assert_ne!(counts, prev);
            prev = counts;
        }
        // One expert: nothing to change, nothing panics.
        let counts = plan_experts(&mut rng, 1, &[2], &mut experts_of);
        assert_eq!(counts, [2]);
        assert!(plan_experts(&mut rng, 0, &[], &mut experts_of).is_empty());
    }

    /// The host model of the router (f64 sums) routes every token where the plan says, with
    /// the margin the module docs derive: the device's f32 sums can not flip it.
    #[test]
    fn routing_features_decide_the_expert_with_a_wide_margin() {
        let mut rng = Rng::new(11, 3);
        let w = router_weights(&mut rng, MOE);
        let mut experts_of = vec![0usize; MOE.tokens];
        let mut x = vec![0f32; MOE.tokens * MOE.hidden];
        let mut prev = Vec::new();
        for _ in 0..50 {
            let counts = plan_experts(&mut rng, MOE.experts, &prev, &mut experts_of);
            fill_input(&mut rng, MOE, &experts_of, &mut x);
            let mut logits = Vec::with_capacity(MOE.tokens * MOE.experts);
            for (t, row) in x.chunks(MOE.hidden).enumerate() {
                let mut l: Vec<f64> = w
                    .chunks(MOE.hidden)
                    .map(|we| {
                        row.iter()
                            .zip(we)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum()
                    })
                    .collect();
                let k = experts_of[t];
                let best_other = l
                    .iter()
                    .enumerate()
                    .filter(|&(e, _)| e != k)
                    .map(|(_, &v)| v)
                    .fold(f64::NEG_INFINITY, f64::max);
                assert!(
                    l[k] - best_other > 16.0,
                    "token {t}: margin {}",
                    l[k] - best_other
                );
                logits.extend(l.drain(..).map(|v| v as f32));
            }
            let (expert, _, host_counts) = plan_routing(&logits, MOE.experts);
            let want: Vec<i32> = experts_of.iter().map(|&e| e as i32).collect();
            assert_eq!(expert, want);
            assert_eq!(host_counts, counts);
            prev = counts;
        }
    }

    #[test]
    fn problems_name_what_differs() {
        let r = |counts: Vec<i32>| Routing {
            logits: vec![],
            expert: vec![0, 1],
            position: vec![0, 0],
            gate: vec![],
            counts,
        };
        let ok = routing_problems(
            &[1.0, 2.0],
            &r(vec![1, 1]),
            &[1.0, 2.0],
            &r(vec![1, 1]),
            &[1, 1],
        );
        assert!(ok.is_empty(), "{ok:?}");
        let p = routing_problems(
            &[1.0, 2.5],
            &r(vec![2, 0]),
            &[1.0, 2.0],
            &r(vec![1, 1]),
            &[1, 1],
        );
        assert_eq!(p.len(), 3, "{p:?}");
        assert!(p[0].contains("output"), "{p:?}");
        assert!(p[1].contains("planned"), "{p:?}");
        assert!(p[2].contains("eager"), "{p:?}");
        let p = routing_problems(
            &[f32::NAN],
            &r(vec![1, 1]),
            &[f32::NAN],
            &r(vec![1, 1]),
            &[1, 1],
        );
        assert_eq!(
            p.len(),
            1,
            "same NaN bits match; the eager NaN is named: {p:?}"
        );
    }
}
