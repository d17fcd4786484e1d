//! Replay programs: for each step of the schedule, which graphs it launches and which eager
//! segments it runs, in order, and which graphed segments each graph was captured from.
//!
//! A step (the forward or backward of one (chunk, microbatch)) runs its chunk's layers in
//! pass order, and each layer its segments ([`SegmentPlan`]). Without merging every graphed
//! segment of every layer is a graph of its own (TransformerEngine's granularity: one graph
//! per callable and microbatch). With merging ([`GraphedOptions::merge_layers`](crate::GraphedOptions::merge_layers),
//! the default) consecutive graphed segments of a step are captured into one graph, across
//! layer boundaries; only eager segments split it. A chain of small layers then costs one
//! graph launch per step instead of one per layer: graph launches are not free on the
//! device (each one waits for the previous to drain and then starts its first nodes), and a
//! layer of two or three short kernels is dominated by that.

use std::collections::HashMap;

use crate::error::{Error, Result};

use crate::schedule::{LayerStep, Pass, Schedule};
use crate::segments::{SegmentPlan, SegmentRun};

/// One segment of one layer's pass in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Part {
    /// The layer step (graph index, callable, pass).
    pub(crate) ls: LayerStep,
    /// The segment index in the layer's pass.
    pub(crate) segment: usize,
}

/// What a step does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Item {
    /// Launch exec `exec`, captured from `parts` in this order.
    Launch {
        /// The index into the runtime's execs (and captured graphs).
        exec: usize,
        /// The graphed segments the graph holds, in capture order.
        parts: Vec<Part>,
    },
    /// Call the eager code of a segment.
    Eager(Part),
}

/// The programs of every step, by step position ([`Schedule::steps`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct Programs {
    steps: Vec<Vec<Item>>,
    execs: usize,
    /// (pass, graph index, segment) -> exec.
    lookup: HashMap<(Pass, usize, usize), usize>,
}

impl Programs {
    /// The programs of `schedule` with the per-callable segment plans; `merge` captures
    /// consecutive graphed segments of a step into one graph.
    pub(crate) fn new(
        schedule: &Schedule,
        forward: &[SegmentPlan],
        backward: &[SegmentPlan],
        merge: bool,
    ) -> Result<Programs> {
        let mut p = Programs {
            steps: vec![Vec::new(); schedule.steps().len()],
            ..Programs::default()
        };
        // A weight-gradient step is one graphed segment per layer.
        let single = SegmentPlan::single();
        for ls in schedule.layer_steps() {
            let pass = ls.step.pass();
            let plan = match pass {
                Pass::Forward => forward.get(ls.callable),
                Pass::Backward => backward.get(ls.callable),
                Pass::WeightGrad => Some(&single),
            }
            .ok_or_else(|| {
                Error::invalid(format!("internal: callable {} has no plan", ls.callable))
            })?;
            let items = p.steps.get_mut(ls.position).ok_or_else(|| {
                Error::invalid(format!("internal: step {} out of range", ls.position))
            })?;
            for run in plan.runs() {
                let part = Part {
                    ls,
                    segment: run.segment(),
                };
                match run {
                    SegmentRun::Eager { .. } => items.push(Item::Eager(part)),
                    SegmentRun::Graphed { .. } => {
                        let exec = match items.last_mut() {
                            Some(Item::Launch { exec, parts }) if merge => {
                                parts.push(part);
                                *exec
                            }
                            _ => {
                                let exec = p.execs;
                                p.execs += 1;
                                items.push(Item::Launch {
                                    exec,
                                    parts: vec![part],
                                });
                                exec
                            }
                        };
                        p.lookup.insert((pass, ls.graph, part.segment), exec);
                    }
                }
            }
        }
        Ok(p)
    }

    /// What the step at `position` runs, in order (empty out of range).
    pub(crate) fn step(&self, position: usize) -> &[Item] {
        self.steps.get(position).map_or(&[], Vec::as_slice)
    }

    /// Every step's program, by position.
    pub(crate) fn steps(&self) -> impl Iterator<Item = &[Item]> {
        self.steps.iter().map(Vec::as_slice)
    }

    /// The number of graphs (execs) over all steps.
    pub(crate) fn execs(&self) -> usize {
        self.execs
    }

    /// The exec holding segment `segment` of graph index `graph`'s `pass`; `None` if that
    /// segment is eager or out of range.
    pub(crate) fn exec_of(&self, pass: Pass, graph: usize, segment: usize) -> Option<usize> {
        self.lookup.get(&(pass, graph, segment)).copied()
    }

    /// Whether the step at `position` has an eager segment.
    pub(crate) fn has_eager(&self, position: usize) -> bool {
        self.step(position)
            .iter()
            .any(|i| matches!(i, Item::Eager(_)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segments::SegmentKind::{Eager, Graphed};

    fn shape(items: &[Item]) -> Vec<String> {
        items
            .iter()
            .map(|i| match i {
                Item::Launch { exec, parts } => format!(
                    "G{exec}[{}]",
                    parts
                        .iter()
                        .map(|p| format!("{}.{}", p.ls.layer, p.segment))
                        .collect::<Vec<_>>()
                        .join(" ")
                ),
                Item::Eager(p) => format!("E{}.{}", p.ls.layer, p.segment),
            })
            .collect()
    }

    #[test]
    fn unmerged_is_one_graph_per_layer_and_segment() {
        let s = Schedule::new(&[1, -1], vec![3]).unwrap();
        let plans = vec![SegmentPlan::single(); 3];
        let p = Programs::new(&s, &plans, &plans, false).unwrap();
        assert_eq!(p.execs(), 6);
        assert_eq!(shape(p.step(0)), ["G0[0.0]", "G1[1.0]", "G2[2.0]"]);
        // Backward runs the layers last to first.
        assert_eq!(shape(p.step(1)), ["G3[2.0]", "G4[1.0]", "G5[0.0]"]);
        assert_eq!(p.exec_of(Pass::Forward, 1, 0), Some(1));
        assert_eq!(p.exec_of(Pass::Backward, 0, 0), Some(5));
        assert_eq!(p.exec_of(Pass::Forward, 1, 1), None);
    }

    #[test]
    fn merged_steps_are_one_graph_split_only_by_eager_segments() {
        // 1 chunk of 3 layers, 2 microbatches; layer 1 is a MoE layer
        // [Graphed, Eager, Graphed] forward and [Graphed, Eager] backward.
        let s = Schedule::new(&[1, 1, -1, -1], vec![3]).unwrap();
        let moe_f = SegmentPlan::new(vec![Graphed, Eager, Graphed]).unwrap();
        let moe_b = SegmentPlan::new(vec![Graphed, Eager]).unwrap();
        let one = SegmentPlan::single();
        let fwd = vec![one.clone(), moe_f, one.clone()];
        let bwd = vec![one.clone(), moe_b, one];
        let p = Programs::new(&s, &fwd, &bwd, true).unwrap();
        assert_eq!(shape(p.step(0)), ["G0[0.0 1.0]", "E1.1", "G1[1.2 2.0]"]);
        assert_eq!(shape(p.step(1)), ["G2[0.0 1.0]", "E1.1", "G3[1.2 2.0]"]);
        assert_eq!(shape(p.step(2)), ["G4[2.0 1.0]", "E1.1", "G5[0.0]"]);
        assert_eq!(p.execs(), 8);
        assert!(p.has_eager(0) && p.has_eager(3));
        // Graph index 1 is (mb 0, layer 1): its router and combine live in different execs,
        // shared with the neighbouring layers.
        assert_eq!(p.exec_of(Pass::Forward, 1, 0), Some(0));
        assert_eq!(p.exec_of(Pass::Forward, 0, 0), Some(0));
        assert_eq!(p.exec_of(Pass::Forward, 1, 1), None);
        assert_eq!(p.exec_of(Pass::Forward, 1, 2), Some(1));
        // Microbatch 1's graphs are 3..6.
        assert_eq!(p.exec_of(Pass::Forward, 4, 2), Some(3));
        assert_eq!(p.exec_of(Pass::Backward, 2, 0), Some(4));
        assert_eq!(p.exec_of(Pass::Backward, 0, 0), Some(5));
        // Every exec appears in exactly one step.
        let mut seen: Vec<usize> = p
            .steps()
            .flatten()
            .filter_map(|i| match i {
                Item::Launch { exec, .. } => Some(*exec),
                Item::Eager(_) => None,
            })
            .collect();
        seen.sort();
        assert_eq!(seen, (0..p.execs()).collect::<Vec<_>>());
    }

    #[test]
    fn merged_interleaved_schedule_has_one_graph_per_step() {
        let s = Schedule::new(&[1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1], vec![2, 3]).unwrap();
        let plans = vec![SegmentPlan::single(); 5];
        let p = Programs::new(&s, &plans, &plans, true).unwrap();
        assert_eq!(p.execs(), s.steps().len());
        for (position, items) in p.steps().enumerate() {
            assert_eq!(items.len(), 1, "step {position}");
            assert!(!p.has_eager(position));
        }
        // Step 1 is the forward of chunk 1 (3 layers), microbatch 0.
        assert_eq!(shape(p.step(1)), ["G1[0.0 1.0 2.0]"]);
    }

    #[test]
    fn weight_gradient_steps_get_their_own_graphs() {
        let s = Schedule::from_f64(&[1.0, 1.0, -1.0, -1.0, -1.5, -1.5], vec![2]).unwrap();
        let plans = vec![SegmentPlan::single(); 2];
        let p = Programs::new(&s, &plans, &plans, true).unwrap();
        assert_eq!(p.execs(), 6);
        assert_eq!(shape(p.step(4)), ["G4[1.0 0.0]"]);
        assert_eq!(p.exec_of(Pass::WeightGrad, 0, 0), Some(4));
        assert_eq!(p.exec_of(Pass::Backward, 0, 0), Some(2));
        let p = Programs::new(&s, &plans, &plans, false).unwrap();
        assert_eq!(p.execs(), 12);
        assert_eq!(shape(p.step(5)), ["G10[1.0]", "G11[0.0]"]);
    }

    #[test]
    fn eager_only_layers_get_no_graph() {
        let s = Schedule::new(&[1, -1], vec![2]).unwrap();
        let eager = SegmentPlan::new(vec![Eager]).unwrap();
        let plans = vec![eager.clone(), eager];
        let p = Programs::new(&s, &plans, &plans, true).unwrap();
        assert_eq!(p.execs(), 0);
        assert_eq!(shape(p.step(0)), ["E0.0", "E1.0"]);
        assert_eq!(p.exec_of(Pass::Forward, 0, 0), None);
        assert!(p.step(7).is_empty());
    }
}
