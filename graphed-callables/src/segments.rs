//! Breaking-layer capture: a layer's pass as a sequence of segments, each captured into a
//! graph ([`SegmentKind::Graphed`]) or run eagerly at replay ([`SegmentKind::Eager`]).
//!
//! # Why
//!
//! A MoE layer's expert part has data-dependent shapes (tokens per expert), typically read
//! to the host (a device-to-host copy of the counts and a stream synchronization) to size
//! the expert launches; that can not be captured. Breaking-layer capture splits the layer:
//! the router (and, if wanted, the dispatch preprocessing) is graphed, the experts run
//! eagerly from the router's outputs, the combine is graphed again. The split is chosen per
//! layer through [`Callable::forward_segments`](crate::Callable::forward_segments) and
//! [`Callable::backward_segments`](crate::Callable::backward_segments).
//!
//! # How the runtime runs segments
//!
//! * Warmup runs every segment of every pass eagerly, in order, on the warmup stream
//!   (graphed ones through [`Callable::forward_segment`](crate::Callable::forward_segment) /
//!   [`backward_segment`](crate::Callable::backward_segment), eager ones through
//!   [`Callable::forward_eager`](crate::Callable::forward_eager) /
//!   [`backward_eager`](crate::Callable::backward_eager)).
//! * Capture records the graphed segments in schedule order, into the one pool: each into
//!   its own graph with [`GraphedOptions::merge_layers`](crate::GraphedOptions::merge_layers)
//!   off, else every run of consecutive graphed segments of a step (across its layers) into
//!   one graph, so only eager segments split a step's graph. Eager segments are never called
//!   inside a capture.
//! * Replay ([`GraphedCallables::forward`](crate::GraphedCallables::forward) /
//!   [`backward`](crate::GraphedCallables::backward)) runs each layer's segments in order
//!   on the replay stream: a graph launch for a graphed segment (or run of them), a host call
//!   for an eager one, with the same slot ([`Slot`](crate::Slot)) the graphed segments were captured
//!   with. An eager segment may copy sizes to the host, synchronize the stream and launch
//!   work shaped by them. The step hooks run after the whole pass, as before.
//!
//! # Data across segment boundaries
//!
//! Graphs hold fixed device addresses, so whatever one segment produces for a later one
//! must live in the slot's static buffers: its inputs, outputs, gradients and above all its
//! saved buffers ([`Slot::saved`](crate::Slot::saved), declared with
//! [`Callable::saved_bytes`](crate::Callable::saved_bytes)), one set per (chunk, microbatch,
//! layer). In particular an eager segment that feeds a later graphed segment must write
//! into such buffers, never into memory it allocates at replay time; and a graphed segment
//! must read data-dependent sizes from device memory (the captured graph can not depend on
//! host values an eager segment computed).
//!
//! # Full-layer mode
//!
//! When the dynamic part reads its sizes from device memory, the whole layer is one graph:
//! a MoE layer whose experts run as a grouped GEMM with device-side group sizes (each CTA
//! reads its expert's token count and offset from the router's device output and exits when
//! it has no work; the grid is sized for the capacity, not the actual counts) needs no host
//! synchronization, so its forward is the default single [`SegmentKind::Graphed`] segment.
//! Breaking-layer capture is for the layers that must synchronize.
//!
//! # Weight casts
//!
//! [`Callable::cast_weights`](crate::Callable::cast_weights) belongs to the *first graphed*
//! segment of the forward: it is captured at the head of that segment's graph (the IF node
//! of [`WeightCaching::Conditional`](crate::WeightCaching::Conditional), or the noop-flag
//! casts), and warmup calls it right before that segment. Eager segments before it run
//! before the casts and must not read the cast weights. A forward with no graphed segment
//! gets no runtime-managed casts at all (the runtime never calls `cast_weights` for it): such
//! a layer casts in its eager code, e.g. when [`Slot::is_first_microbatch`](crate::Slot::is_first_microbatch).
//!
//! # Edge cases
//!
//! An empty segment list is an error at build (a pass must do something, and "no segment"
//! would be ambiguous between "nothing" and "the default"). A pass of only eager segments
//! is allowed: it has no graph ([`GraphedCallables::forward_exec`](crate::GraphedCallables::forward_exec)
//! is `None` for it) and runs entirely at replay.

use crate::error::{Error, Result};

/// How one segment of a layer's pass runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SegmentKind {
    /// Captured into a graph (its own, or shared with the neighbouring graphed segments of
    /// its step under [`GraphedOptions::merge_layers`](crate::GraphedOptions::merge_layers))
    /// and replayed by a graph launch.
    Graphed,
    /// Run by the host at replay time, between the graph launches, on the replay stream
    /// and outside any capture: it may read sizes to the host and launch dynamic-shaped
    /// work.
    Eager,
}

/// One entry of a [`SegmentPlan`]'s run order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SegmentRun {
    /// Launch the graph of segment `segment`, the `graph`-th graphed segment of the pass
    /// (0-based among the graphed ones: the index of its exec).
    Graphed {
        /// The segment index in the pass.
        segment: usize,
        /// The index among the pass's graphed segments.
        graph: usize,
    },
    /// Call the eager code of segment `segment`.
    Eager {
        /// The segment index in the pass.
        segment: usize,
    },
}

impl SegmentRun {
    /// The segment index in the pass.
    pub fn segment(self) -> usize {
        match self {
            SegmentRun::Graphed { segment, .. } | SegmentRun::Eager { segment } => segment,
        }
    }
}

/// The validated segments of one pass of one callable: which are graphed, which eager, and
/// the order they run in.
///
/// ```
/// use graphed_callables::{SegmentKind::*, SegmentPlan, SegmentRun};
/// // A MoE layer: router graphed, experts eager, combine graphed.
/// let plan = SegmentPlan::new(vec![Graphed, Eager, Graphed])?;
/// assert_eq!(plan.graphs(), 2);
/// assert_eq!(plan.graph_of(2), Some(1));
/// assert_eq!(plan.cast_segment(), Some(0));
/// assert_eq!(
///     plan.runs().collect::<Vec<_>>(),
///     [
///         SegmentRun::Graphed { segment: 0, graph: 0 },
///         SegmentRun::Eager { segment: 1 },
///         SegmentRun::Graphed { segment: 2, graph: 1 },
///     ]
/// );
/// assert!(SegmentPlan::new(vec![]).is_err());
/// # Ok::<(), cuda_graph::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentPlan {
    kinds: Vec<SegmentKind>,
}

impl SegmentPlan {
    /// The plan of `kinds`, segment 0 first. An empty list is [`InvalidArgument`](cuda_graph::Error::InvalidArgument).
    pub fn new(kinds: Vec<SegmentKind>) -> Result<SegmentPlan> {
        if kinds.is_empty() {
            return Err(Error::invalid(
                "a pass needs at least one segment (the default is one graphed segment)",
            ));
        }
        Ok(SegmentPlan { kinds })
    }

    /// The plan of a pass that is one graph: `[Graphed]` (the default).
    pub fn single() -> SegmentPlan {
        SegmentPlan {
            kinds: vec![SegmentKind::Graphed],
        }
    }

    /// The segments, in run order.
    pub fn kinds(&self) -> &[SegmentKind] {
        &self.kinds
    }

    /// The number of segments.
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    /// Always `false`: a plan has at least one segment.
    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// The number of graphed segments (graphs captured per slot for this pass).
    pub fn graphs(&self) -> usize {
        self.kinds
            .iter()
            .filter(|&&k| k == SegmentKind::Graphed)
            .count()
    }

    /// Whether the whole pass is one graph (full-layer capture).
    pub fn is_single_graph(&self) -> bool {
        self.kinds == [SegmentKind::Graphed]
    }

    /// Whether the pass has no graphed segment (it runs entirely at replay).
    pub fn is_eager_only(&self) -> bool {
        self.graphs() == 0
    }

    /// The index among the graphed segments of segment `segment`; `None` if it is eager
    /// or out of range.
    pub fn graph_of(&self, segment: usize) -> Option<usize> {
        match self.kinds.get(segment)? {
            SegmentKind::Graphed => Some(
                self.kinds[..segment]
                    .iter()
                    .filter(|&&k| k == SegmentKind::Graphed)
                    .count(),
            ),
            SegmentKind::Eager => None,
        }
    }

    /// The segment weight casts go into in a forward: the first graphed one (`None` when
    /// every segment is eager). See the [module documentation](self#weight-casts).
    pub fn cast_segment(&self) -> Option<usize> {
        self.kinds.iter().position(|&k| k == SegmentKind::Graphed)
    }

    /// What runs, segment by segment.
    pub fn runs(&self) -> impl Iterator<Item = SegmentRun> + '_ {
        let mut graph = 0;
        self.kinds
            .iter()
            .enumerate()
            .map(move |(segment, &k)| match k {
                SegmentKind::Graphed => {
                    graph += 1;
                    SegmentRun::Graphed {
                        segment,
                        graph: graph - 1,
                    }
                }
                SegmentKind::Eager => SegmentRun::Eager { segment },
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SegmentKind::{Eager, Graphed};

    #[test]
    fn default_is_one_graph() {
        let p = SegmentPlan::single();
        assert!(p.is_single_graph());
        assert!(!p.is_eager_only());
        assert_eq!(p.graphs(), 1);
        assert_eq!(p.cast_segment(), Some(0));
        assert_eq!(
            p.runs().collect::<Vec<_>>(),
            [SegmentRun::Graphed {
                segment: 0,
                graph: 0
            }]
        );
        assert_eq!(SegmentPlan::new(vec![Graphed]).unwrap(), p);
    }

    #[test]
    fn empty_is_rejected() {
        let e = SegmentPlan::new(vec![]).unwrap_err();
        assert!(
            matches!(e, Error::Cuda(cuda_graph::Error::InvalidArgument(_))),
            "{e:?}"
        );
        assert!(e.to_string().contains("at least one segment"), "{e}");
    }

    #[test]
    fn breaking_layer_plans() {
        let p = SegmentPlan::new(vec![Eager, Graphed, Eager, Graphed, Graphed]).unwrap();
        assert_eq!(p.len(), 5);
        assert_eq!(p.graphs(), 3);
        assert!(!p.is_single_graph());
        assert_eq!(
            p.cast_segment(),
            Some(1),
            "casts go in the first graphed segment"
        );
        let graphs: Vec<_> = (0..6).map(|s| p.graph_of(s)).collect();
        assert_eq!(graphs, [None, Some(0), None, Some(1), Some(2), None]);
        let runs: Vec<_> = p.runs().collect();
        assert_eq!(
            runs,
            [
                SegmentRun::Eager { segment: 0 },
                SegmentRun::Graphed {
                    segment: 1,
                    graph: 0
                },
                SegmentRun::Eager { segment: 2 },
                SegmentRun::Graphed {
                    segment: 3,
                    graph: 1
                },
                SegmentRun::Graphed {
                    segment: 4,
                    graph: 2
                },
            ]
        );
        assert_eq!(
            runs.iter().map(|r| r.segment()).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4]
        );
        // Runs and graph_of agree.
        for r in runs {
            if let SegmentRun::Graphed { segment, graph } = r {
                assert_eq!(p.graph_of(segment), Some(graph));
            }
        }
    }

    #[test]
    fn eager_only_has_no_graph_and_no_cast_segment() {
        let p = SegmentPlan::new(vec![Eager, Eager]).unwrap();
        assert!(p.is_eager_only());
        assert_eq!(p.graphs(), 0);
        assert_eq!(p.cast_segment(), None);
        assert!(p.runs().all(|r| matches!(r, SegmentRun::Eager { .. })));
    }
}
