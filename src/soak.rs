//! `fp8-moe soak`: replays the graphed FP8 MoE layer and the graphed FP8 MLP stack many
//! times with data that changes on every replay, checks them against eager runs, updates
//! live execs in between, and watches device and host memory for drift.
//!
//! * MoE ([`moe`]): the training MoE layer (`MoeLayer`: top-1 router, SwiGLU experts, FP8
//!   expert GEMMs) as full-layer graphs (grouped GEMMs on device-side offsets), forward and
//!   backward, 3 microbatches; a new input every forward replay, planned so the per-expert
//!   token counts differ from the previous forward replay's, and a new output gradient every
//!   backward. A microbatch holding a replay whose number is a multiple of `check_every` is
//!   compared bit for bit with an eager pass of an identical layer on the same data: output,
//!   input gradient, that backward's weight gradients, gates, losses and routing; its counts
//!   also with the plan and with the forward replay before. A replay is a forward or
//!   backward graph launch (6 per training step).
//! * MLP ([`mlp`]): the FP8 MLP stack, one graph per step, lockstep with an eager twin on
//!   the same data; every step holding a multiple of `check_every` replays compares
//!   outputs, input gradients, weight and bias gradients and the scaling state bit for bit.
//!   A replay is a forward or backward graph launch (6 per training step).
//! * Updates ([`updates`]), every `update_every` replays: whole-graph updates of a
//!   hand-captured MoE training pass (forward and backward) and of a chain of axpy kernels,
//!   and per-node updates of the chain, each followed by checked replays.
//! * Memory ([`memory`]): device memory in use and the resident set are sampled after a
//!   warmup (which runs every path once: replays, checks, updates), about 20 times during
//!   the run and at its end; the run passes with no mismatch and both drifts under 1 MiB.
//!
//! Mismatches are counted, never fatal; each of the first few is printed to stderr.

pub mod memory;
pub mod mlp;
pub mod moe;
pub mod updates;

use std::fmt::Write as _;
use std::io::Write;
use std::time::Instant;

use cuda_graph::{Context, Stream};
use serde::Serialize;

use crate::bench::Rng;
use crate::bench::{BenchResult, Row};
use memory::{DRIFT_LIMIT, Drift, MemSample, signed_size, size};

/// Which workloads a soak replays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// The graphed FP8 MoE layer only.
    Moe,
    /// The graphed FP8 MLP stack only.
    Mlp,
    /// Both, half the replays each.
    Both,
}

impl Workload {
    /// `(moe, mlp)` replays out of `total`: all to one workload, or half each (the MoE
    /// workload takes the odd one).
    pub fn split(self, total: u64) -> (u64, u64) {
        match self {
            Workload::Moe => (total, 0),
            Workload::Mlp => (0, total),
            Workload::Both => (total - total / 2, total / 2),
        }
    }
}

/// The settings of a soak run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SoakConfig {
    /// Replays of the measured phase, over the workloads (rounded up to whole steps).
    pub replays: u64,
    /// Compare with eager every this many replays of each workload (at least 1).
    pub check_every: u64,
    /// Run an update event every this many replays (at least 1).
    pub update_every: u64,
    /// Seeds every weight and input.
    pub seed: u64,
    /// What to replay.
    pub workload: Workload,
    /// Stop the measured phase after this many seconds, if set, even short of `replays`.
    pub max_seconds: Option<f64>,
}

/// Update events in the warmup.
const WARMUP_EVENTS: u64 = 4;
/// Memory samples over the measured phase (plus the first and the last).
const SAMPLES: u64 = 20;
/// Mismatches printed to stderr as they happen (all are counted).
const PRINTED_MISMATCHES: u64 = 10;

/// What one workload did and found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Stats {
    /// Replays, warmup included.
    pub replays: u64,
    /// Comparisons with the reference.
    pub checks: u64,
    /// Comparisons that found a difference.
    pub mismatches: u64,
    /// The first mismatch, described.
    pub first_mismatch: Option<String>,
}

impl Stats {
    /// Records one check that found `problems` (none: it matched); the first few mismatches
    /// are printed to stderr with `what` names the replay.
    pub fn record_check(&mut self, what: impl FnOnce() -> String, problems: Vec<String>) {
        self.checks += 1;
        if problems.is_empty() {
            return;
        }
        self.mismatches += 1;
        let line = format!("{}: {}", what(), problems.join("; "));
        if self.mismatches <= PRINTED_MISMATCHES {
            eprintln!("fp8-moe soak: mismatch: {line}");
        }
        self.first_mismatch.get_or_insert(line);
    }
}

/// How `got` differs from `want` bit for bit, or `None` when it does not: how many
/// elements differ and the first one (a length difference counts its extra elements).
pub fn diff_problem(what: &str, got: &[f32], want: &[f32]) -> Option<String> {
    let differ = got
        .iter()
        .zip(want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count()
        + got.len().abs_diff(want.len());
    if differ == 0 {
        return None;
    }
    let first = got
        .iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits());
    Some(match first {
        Some(i) => format!(
            "{what}: {differ} of {} elements differ from eager, first at {i}: {} vs {}",
            want.len(),
            got[i],
            want[i]
        ),
        None => format!(
            "{what}: {} elements against eager's {}",
            got.len(),
            want.len()
        ),
    })
}

/// Warmup replays of each workload before the first memory sample: three checks' worth
/// (so the checks' host buffers have settled in the allocator), at least 600 and at most
/// 20 000; whole steps are run, so a few more may be.
pub fn warmup_replays(check_every: u64) -> u64 {
    check_every.saturating_mul(3).clamp(600, 20_000)
}

/// Whether `start .. start + len` holds a multiple of `every` (0 counts; `every` 0 is taken
/// as 1).
pub fn holds_multiple(start: u64, len: u64, every: u64) -> bool {
    let every = every.max(1);
    len > 0 && (start % every == 0 || start / every != (start + len - 1) / every)
}

/// One workload's line of the report.
#[derive(Debug, Clone, Serialize)]
pub struct WorkloadReport {
    /// `moe` or `mlp`.
    pub name: &'static str,
    /// The shape, in words.
    pub shape: String,
    /// What one replay is.
    pub replay: &'static str,
    /// Replays of the measured phase.
    pub replays: u64,
    /// Replays of the warmup (checked the same way).
    pub warmup_replays: u64,
    /// Measured replays per second of the whole measured phase (which the workloads share).
    pub replays_per_s: f64,
    /// Comparisons with eager, warmup included.
    pub checks: u64,
    /// Comparisons that found a difference.
    pub mismatches: u64,
    /// MoE: checks whose per-expert counts differed from the previous replay's.
    pub counts_changed: Option<u64>,
    /// The first mismatch, described.
    pub first_mismatch: Option<String>,
}

/// The updates' part of the report.
#[derive(Debug, Clone, Serialize)]
pub struct UpdateReport {
    /// Update events (warmup included).
    pub events: u64,
    /// Whole-graph updates of the axpy chain.
    pub chain_whole_graph: updates::WholeGraph,
    /// Per-node updates of the axpy chain.
    pub chain_per_node: u64,
    /// The chain's replays after updates: checks and mismatches.
    pub chain: Stats,
    /// Whole-graph updates of the hand-captured MoE exec (`null` without the MoE workload).
    pub moe_whole_graph: Option<updates::WholeGraph>,
    /// The MoE exec's replays after updates.
    pub moe: Option<Stats>,
}

/// The memory part of the report.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryReport {
    /// The samples, the first after warmup, the last at the end.
    pub samples: Vec<MemSample>,
    /// Last minus first, and the widest swing.
    pub drift: Drift,
    /// The drift limit in bytes (exclusive).
    pub limit_bytes: u64,
}

/// The result of a soak run, as written to JSON.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// What was asked for.
    pub config: SoakConfig,
    /// Seconds of the measured phase.
    pub seconds: f64,
    /// Whether `max_seconds` ended the measured phase before `replays`.
    pub stopped_early: bool,
    /// Measured replays over the workloads.
    pub replays: u64,
    /// Per workload.
    pub workloads: Vec<WorkloadReport>,
    /// The update events.
    pub updates: UpdateReport,
    /// Device memory and resident set.
    pub memory: MemoryReport,
    /// Mismatches over everything.
    pub mismatches: u64,
    /// No mismatch and both drifts under the limit.
    pub pass: bool,
    /// The table's rows.
    pub rows: Vec<Row>,
}

impl Report {
    /// One line saying why the run failed (`None` when it passed).
    pub fn failure(&self) -> Option<String> {
        if self.pass {
            return None;
        }
        let d = &self.memory.drift;
        let mut why = Vec::new();
        if self.mismatches > 0 {
            why.push(format!("{} mismatches", self.mismatches));
        }
        if d.device.unsigned_abs() >= DRIFT_LIMIT {
            why.push(format!("device memory drift {}", signed_size(d.device)));
        }
        if d.rss.unsigned_abs() >= DRIFT_LIMIT {
            why.push(format!("host RSS drift {}", signed_size(d.rss)));
        }
        Some(format!(
            "soak failed: {} (limit: 0 mismatches, drift under {})",
            why.join(", "),
            size(DRIFT_LIMIT)
        ))
    }
}

/// The workloads of a run.
struct Soak {
    moe: Option<moe::MoeSoak>,
    mlp: Option<mlp::MlpSoak>,
    updates: updates::Updates,
}

impl Soak {
    fn replays(&self) -> (u64, u64) {
        (
            self.moe.as_ref().map_or(0, |m| m.stats.replays),
            self.mlp.as_ref().map_or(0, |m| m.stats.replays),
        )
    }

    fn mismatches(&self) -> u64 {
        self.moe.as_ref().map_or(0, |m| m.stats.mismatches)
            + self.mlp.as_ref().map_or(0, |m| m.stats.mismatches)
            + self.updates.mismatches()
    }
}

/// Runs a soak on device 0, printing progress to `progress`.
pub fn run(cfg: &SoakConfig, progress: &mut impl Write) -> BenchResult<Report> {
    let ctx = Context::default_device()?;
    let stream = Stream::new(&ctx)?;
    let (moe_target, mlp_target) = cfg.workload.split(cfg.replays);
    let with_moe = cfg.workload != Workload::Mlp;
    let with_mlp = cfg.workload != Workload::Moe;
    let mut weights = Rng::new(cfg.seed, 0);
    let mut soak = Soak {
        moe: if with_moe {
            Some(moe::MoeSoak::new(
                &stream,
                &mut weights,
                Rng::new(cfg.seed, 1),
            )?)
        } else {
            None
        },
        mlp: if with_mlp {
            Some(mlp::MlpSoak::new(
                &ctx,
                &stream,
                &mut weights,
                Rng::new(cfg.seed, 2),
            )?)
        } else {
            None
        },
        updates: updates::Updates::new(
            &ctx,
            &stream,
            &mut weights,
            Rng::new(cfg.seed, 3),
            with_moe,
        )?,
    };

    // Warmup: every path once or more (replays, both kinds of checks, updates), so lazy
    // allocations happen before the first sample.
    let warmup_target = warmup_replays(cfg.check_every);
    if let Some(m) = &mut soak.moe {
        while m.stats.replays < warmup_target {
            m.step(&stream, cfg.check_every)?;
        }
    }
    if let Some(m) = &mut soak.mlp {
        while m.stats.replays < warmup_target {
            m.step(&stream, cfg.check_every)?;
        }
    }
    for _ in 0..WARMUP_EVENTS {
        soak.updates.event(&stream)?;
    }
    stream.synchronize()?;
    let warmup = soak.replays();
    writeln!(
        progress,
        "soak: warmup done ({} MoE + {} MLP replays, {} update events, {} mismatches); \
         {} replays to go (seed {})",
        warmup.0,
        warmup.1,
        soak.updates.events,
        soak.mismatches(),
        cfg.replays,
        cfg.seed
    )?;

    let start = Instant::now();
    let mut samples = vec![MemSample::take(&ctx, 0, 0.0)?];
    let sample_every = cfg.replays.div_ceil(SAMPLES).max(1);
    let (mut next_sample, mut next_update) = (sample_every, cfg.update_every.max(1));
    let mut stopped_early = false;
    loop {
        let (moe_all, mlp_all) = soak.replays();
        let (moe_done, mlp_done) = (moe_all - warmup.0, mlp_all - warmup.1);
        let moe_left = moe_done < moe_target;
        let mlp_left = mlp_done < mlp_target;
        if !moe_left && !mlp_left {
            break;
        }
        // Whichever is further behind its share goes next.
        let moe_next = moe_left
            && (!mlp_left
                || u128::from(moe_done) * u128::from(mlp_target)
                    <= u128::from(mlp_done) * u128::from(moe_target));
        match (moe_next, &mut soak.moe, &mut soak.mlp) {
            (true, Some(m), _) => m.step(&stream, cfg.check_every)?,
            (false, _, Some(m)) => m.step(&stream, cfg.check_every)?,
            _ => return Err("internal: a workload with replays left is missing".into()),
        }
        let (moe_all, mlp_all) = soak.replays();
        let done = moe_all + mlp_all - warmup.0 - warmup.1;
        while done >= next_update {
            soak.updates.event(&stream)?;
            next_update += cfg.update_every.max(1);
        }
        let out_of_time = cfg
            .max_seconds
            .is_some_and(|s| start.elapsed().as_secs_f64() >= s);
        if done >= next_sample || out_of_time {
            next_sample += sample_every;
            stream.synchronize()?;
            let s = MemSample::take(&ctx, done, start.elapsed().as_secs_f64())?;
            samples.push(s);
            writeln!(
                progress,
                "soak: {done}/{} replays in {:.1} s ({:.0}/s), {} mismatches, device {} MiB \
                 ({}), rss {} ({})",
                cfg.replays,
                s.seconds,
                done as f64 / s.seconds.max(1e-9),
                soak.mismatches(),
                s.device_used >> 20,
                signed_size(s.device_used as i64 - samples[0].device_used as i64),
                size(s.rss),
                signed_size(s.rss as i64 - samples[0].rss as i64),
            )?;
        }
        if out_of_time {
            stopped_early = true;
            writeln!(progress, "soak: --max-seconds reached, stopping early")?;
            break;
        }
    }
    stream.synchronize()?;
    let seconds = start.elapsed().as_secs_f64();
    let (moe_all, mlp_all) = soak.replays();
    let done = moe_all + mlp_all - warmup.0 - warmup.1;
    if samples.last().is_none_or(|s| s.replays != done) || samples.len() < 2 {
        samples.push(MemSample::take(&ctx, done, seconds)?);
    }
    Ok(report(cfg, &soak, warmup, samples, seconds, stopped_early))
}

/// Builds the report and its table rows.
fn report(
    cfg: &SoakConfig,
    soak: &Soak,
    warmup: (u64, u64),
    samples: Vec<MemSample>,
    seconds: f64,
    stopped_early: bool,
) -> Report {
    let rate = |n: u64| n as f64 / seconds.max(1e-9);
    let mut workloads = Vec::new();
    if let Some(m) = &soak.moe {
        let replays = m.stats.replays - warmup.0;
        workloads.push(WorkloadReport {
            name: "moe",
            shape: format!(
                "FP8 MoE layer T={} H={} F={} E={} top-{} SwiGLU, full-layer graphs (grouped \
                 GEMMs, device offsets), forward and backward, 3 microbatches",
                moe::MOE.tokens,
                moe::MOE.hidden,
                moe::MOE.ffn,
                moe::MOE.experts,
                moe::MOE.router.top_k
            ),
            replay: "a forward or backward graph launch (6 per training step)",
            replays,
            warmup_replays: warmup.0,
            replays_per_s: rate(replays),
            checks: m.stats.checks,
            mismatches: m.stats.mismatches,
            counts_changed: Some(m.counts_changed),
            first_mismatch: m.stats.first_mismatch.clone(),
        });
    }
    if let Some(m) = &soak.mlp {
        let replays = m.stats.replays - warmup.1;
        workloads.push(WorkloadReport {
            name: "mlp",
            shape: format!(
                "FP8 MLP {} layers {}/{} x 3 microbatches, {} tokens, graph per step",
                mlp::LAYERS,
                mlp::NARROW,
                mlp::WIDE,
                mlp::TOKENS
            ),
            replay: "a forward or backward graph launch (6 per training step)",
            replays,
            warmup_replays: warmup.1,
            replays_per_s: rate(replays),
            checks: m.stats.checks,
            mismatches: m.stats.mismatches,
            counts_changed: None,
            first_mismatch: m.stats.first_mismatch.clone(),
        });
    }
    let u = &soak.updates;
    let updates = UpdateReport {
        events: u.events,
        chain_whole_graph: u.chain.whole_graph,
        chain_per_node: u.chain.per_node,
        chain: u.chain.stats.clone(),
        moe_whole_graph: u.moe.as_ref().map(|m| m.whole_graph),
        moe: u.moe.as_ref().map(|m| m.stats.clone()),
    };
    let drift = Drift::of(&samples);
    let mismatches = soak.mismatches();
    let pass = mismatches == 0 && drift.within(DRIFT_LIMIT);
    let replays = workloads.iter().map(|w| w.replays).sum();
    let memory = MemoryReport {
        samples,
        drift,
        limit_bytes: DRIFT_LIMIT,
    };
    let rows = rows(cfg, &workloads, &updates, &memory, replays, seconds);
    Report {
        config: cfg.clone(),
        seconds,
        stopped_early,
        replays,
        workloads,
        updates,
        memory,
        mismatches,
        pass,
        rows,
    }
}

/// The table: per workload its replays and mismatches, the updates, the drifts.
fn rows(
    cfg: &SoakConfig,
    workloads: &[WorkloadReport],
    updates: &UpdateReport,
    memory: &MemoryReport,
    replays: u64,
    seconds: f64,
) -> Vec<Row> {
    let mut rows = Vec::new();
    for w in workloads {
        let mut yardstick = format!(
            "{:.0}/s of the run's time; {} checks (every {} replays)",
            w.replays_per_s, w.checks, cfg.check_every
        );
        if let Some(c) = w.counts_changed {
            let _ = write!(
                yardstick,
                "; counts changed from the replay before in {c} of {}",
                w.checks
            );
        }
        rows.push(Row {
            name: format!("{}: replays", w.shape),
            value: w.replays as f64,
            unit: "",
            yardstick,
            pass: None,
        });
        rows.push(Row {
            name: format!("{}: mismatches against eager", w.shape),
            value: w.mismatches as f64,
            unit: "",
            yardstick: w
                .first_mismatch
                .clone()
                .unwrap_or_else(|| "bit for bit at every check".into()),
            pass: Some(w.mismatches == 0),
        });
    }
    let wg = |w: &updates::WholeGraph| {
        format!(
            "{} in place, {} reinstantiated, {} refused",
            w.in_place, w.reinstantiated, w.refused
        )
    };
    if let (Some(w), Some(s)) = (&updates.moe_whole_graph, &updates.moe) {
        rows.push(Row {
            name: "hand-captured MoE exec: whole-graph updates".into(),
            value: w.updates as f64,
            unit: "",
            yardstick: format!(
                "{}; {} replays after them checked, {} mismatches",
                wg(w),
                s.checks,
                s.mismatches
            ),
            pass: Some(s.mismatches == 0),
        });
    }
    let c = &updates.chain;
    rows.push(Row {
        name: "axpy chain: whole-graph + per-node updates".into(),
        value: (updates.chain_whole_graph.updates + updates.chain_per_node) as f64,
        unit: "",
        yardstick: format!(
            "{} whole-graph ({}), {} per-node; {} replays after them checked, {} mismatches",
            updates.chain_whole_graph.updates,
            wg(&updates.chain_whole_graph),
            updates.chain_per_node,
            c.checks,
            c.mismatches
        ),
        pass: Some(c.mismatches == 0),
    });
    let d = &memory.drift;
    let mib = |b: i64| b as f64 / (1u64 << 20) as f64;
    for (name, drift, excursion) in [
        (
            "device memory drift (cuMemGetInfo)",
            d.device,
            d.device_max_excursion,
        ),
        (
            "host RSS drift (/proc/self/statm)",
            d.rss,
            d.rss_max_excursion,
        ),
    ] {
        rows.push(Row {
            name: name.into(),
            value: mib(drift),
            unit: "MiB",
            yardstick: format!(
                "{}; widest swing {} over {} samples; limit under {}",
                signed_size(drift),
                size(excursion),
                memory.samples.len(),
                size(memory.limit_bytes)
            ),
            pass: Some(drift.unsigned_abs() < memory.limit_bytes),
        });
    }
    rows.push(Row {
        name: "measured replays, all workloads".into(),
        value: replays as f64,
        unit: "",
        yardstick: format!(
            "{:.1} s, {:.0}/s; {} asked",
            seconds,
            replays as f64 / seconds.max(1e-9),
            cfg.replays
        ),
        pass: None,
    });
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_covers_three_checks_within_bounds() {
        assert_eq!(warmup_replays(1000), 3000);
        assert_eq!(warmup_replays(1), 600);
        assert_eq!(warmup_replays(u64::MAX), 20_000);
    }

    #[test]
    fn workloads_split_the_replays() {
        assert_eq!(Workload::Both.split(1_000_001), (500_001, 500_000));
        assert_eq!(Workload::Moe.split(7), (7, 0));
        assert_eq!(Workload::Mlp.split(7), (0, 7));
        assert_eq!(Workload::Both.split(0), (0, 0));
    }

    #[test]
    fn diffs_count_bits_not_values() {
        assert_eq!(diff_problem("y", &[1.0, 2.0], &[1.0, 2.0]), None);
        assert_eq!(diff_problem("y", &[f32::NAN], &[f32::NAN]), None);
        let p = diff_problem("y", &[0.0, 2.0, 3.0], &[-0.0, 2.0, 4.0]).unwrap();
        assert!(p.starts_with("y: 2 of 3 elements differ"), "{p}");
        assert!(p.contains("first at 0"), "{p}");
        let p = diff_problem("y", &[1.0], &[1.0, 2.0]).unwrap();
        assert!(p.contains("1 elements against eager's 2"), "{p}");
    }

    #[test]
    fn steps_holding_a_multiple_of_check_every() {
        // Steps of 6 replays, checks every 1000: replays 0, 1000, 2000, ... fall in steps
        // starting at 0, 996, 1998, ...
        assert!(holds_multiple(0, 6, 1000));
        assert!(!holds_multiple(6, 6, 1000));
        assert!(holds_multiple(996, 6, 1000));
        assert!(!holds_multiple(1002, 6, 1000));
        assert!(holds_multiple(1998, 6, 1000));
        assert!(!holds_multiple(994, 6, 1000), "994..1000 ends before 1000");
        // Every replay when check_every is 1 (or 0).
        assert!((0..20).all(|s| holds_multiple(s, 1, 1) && holds_multiple(s, 6, 0)));
        assert!(!holds_multiple(5, 0, 1), "an empty range holds nothing");
        let checked = (0..1000u64)
            .filter(|&s| holds_multiple(s * 6, 6, 100))
            .count();
        assert_eq!(checked, 60, "6000 replays, a check per 100");
    }

    fn sample(device_used: u64, rss: u64) -> MemSample {
        MemSample {
            replays: 0,
            seconds: 0.0,
            device_used,
            rss,
        }
    }

    fn fake_report(mismatches: u64, samples: Vec<MemSample>) -> Report {
        let cfg = SoakConfig {
            replays: 10,
            check_every: 5,
            update_every: 5,
            seed: 1,
            workload: Workload::Both,
            max_seconds: None,
        };
        let drift = Drift::of(&samples);
        let pass = mismatches == 0 && drift.within(DRIFT_LIMIT);
        Report {
            config: cfg,
            seconds: 1.0,
            stopped_early: false,
            replays: 10,
            workloads: Vec::new(),
            updates: UpdateReport {
                events: 0,
                chain_whole_graph: Default::default(),
                chain_per_node: 0,
                chain: Stats::default(),
                moe_whole_graph: None,
                moe: None,
            },
            memory: MemoryReport {
                samples,
                drift,
                limit_bytes: DRIFT_LIMIT,
            },
            mismatches,
            pass,
            rows: Vec::new(),
        }
    }

    #[test]
    fn failure_names_each_reason() {
        let ok = fake_report(
            0,
            vec![sample(1 << 30, 1 << 26), sample(1 << 30, (1 << 26) + 8192)],
        );
        assert!(ok.pass);
        assert_eq!(ok.failure(), None);
        let bad = fake_report(
            3,
            vec![
                sample(1 << 30, 1 << 26),
                sample((1 << 30) + (2 << 20), 1 << 26),
            ],
        );
        assert!(!bad.pass);
        let line = bad.failure().unwrap();
        assert_eq!(
            line,
            "soak failed: 3 mismatches, device memory drift +2.0 MiB (limit: 0 mismatches, \
             drift under 1.0 MiB)"
        );
        assert!(!line.contains('\n'));
        let rss = fake_report(
            0,
            vec![sample(0, 1 << 26), sample(0, (1 << 26) - (3 << 20))],
        );
        assert_eq!(
            rss.failure().unwrap(),
            "soak failed: host RSS drift -3.0 MiB (limit: 0 mismatches, drift under 1.0 MiB)"
        );
    }

    #[test]
    fn report_serializes_with_rows_and_verdict() {
        let mut r = fake_report(0, vec![sample(0, 0), sample(0, 0)]);
        r.rows.push(Row {
            name: "x".into(),
            value: f64::NAN,
            unit: "",
            yardstick: String::new(),
            pass: None,
        });
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert_eq!(v["pass"], true);
        assert_eq!(v["config"]["workload"], "both");
        assert_eq!(v["config"]["max_seconds"], serde_json::Value::Null);
        assert_eq!(v["memory"]["drift"]["device"], 0);
        assert_eq!(v["memory"]["limit_bytes"], 1 << 20);
        assert!(v["rows"][0]["value"].is_null());
    }

    #[test]
    fn stats_count_each_failed_check_once() {
        let mut s = Stats::default();
        s.record_check(|| "a".into(), vec![]);
        s.record_check(|| "b".into(), vec!["x".into(), "y".into()]);
        s.record_check(|| "c".into(), vec!["z".into()]);
        assert_eq!((s.checks, s.mismatches), (3, 2));
        assert_eq!(s.first_mismatch.as_deref(), Some("b: x; y"));
    }
}
