//! CPU tests of pipeline schedules: parsing, validation (every `ScheduleError` with its exact
//! position) and the order of the graphs warmup runs and capture records.

use graphed_callables::Error;
use graphed_callables::{LayerStep, Layout, OrderEntry, Pass, Schedule, ScheduleError, Step};

use OrderEntry::{Backward as B, Forward as F, WeightGrad as W};

fn fwd(chunk: usize, microbatch: usize) -> Step {
    Step::Forward { chunk, microbatch }
}
fn bwd(chunk: usize, microbatch: usize) -> Step {
    Step::Backward { chunk, microbatch }
}
fn wgrad(chunk: usize, microbatch: usize) -> Step {
    Step::WeightGrad { chunk, microbatch }
}

/// The interleaved order: 2 chunks x 3 microbatches.
const INTERLEAVED: [i64; 12] = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1];

fn err(order: &[i64], layers: &[usize]) -> ScheduleError {
    match Schedule::new(order, layers.to_vec()) {
        Ok(s) => panic!("{order:?} with layers {layers:?} was accepted: {s:?}"),
        Err(e) => e,
    }
}

fn err_f64(order: &[f64], layers: &[usize]) -> ScheduleError {
    match Schedule::from_f64(order, layers.to_vec()) {
        Ok(s) => panic!("{order:?} with layers {layers:?} was accepted: {s:?}"),
        Err(e) => e,
    }
}

// ---- parsing -------------------------------------------------------------------------

#[test]
fn interleaved_two_chunks_three_microbatches() {
    let s = Schedule::new(&INTERLEAVED, vec![2, 3]).unwrap();
    assert_eq!(s.num_chunks(), 2);
    assert_eq!(s.num_microbatches(), 3);
    assert_eq!(s.layers_per_chunk(), [2, 3]);
    assert!(!s.splits_weight_grad());
    assert_eq!(
        s.steps(),
        [
            fwd(0, 0),
            fwd(1, 0),
            fwd(0, 1),
            fwd(1, 1),
            bwd(1, 0),
            bwd(0, 0),
            fwd(0, 2),
            fwd(1, 2),
            bwd(1, 1),
            bwd(0, 1),
            bwd(1, 2),
            bwd(0, 2),
        ]
    );
    let order: Vec<OrderEntry> = s.order().collect();
    let expected: Vec<OrderEntry> = INTERLEAVED.iter().map(|&v| OrderEntry::from(v)).collect();
    assert_eq!(order, expected);
    assert_eq!(s.position(bwd(0, 1)), Some(9));
    assert_eq!(s.position(fwd(0, 3)), None);
    let firsts: Vec<bool> = s.steps().iter().map(|s| s.is_first_microbatch()).collect();
    assert_eq!(
        firsts,
        [
            true, true, false, false, true, true, false, false, false, false, false, false
        ]
    );
    // The float form of the same order parses to the same schedule.
    let floats: Vec<f64> = INTERLEAVED.iter().map(|&v| v as f64).collect();
    assert_eq!(Schedule::from_f64(&floats, vec![2, 3]).unwrap(), s);
}

#[test]
fn one_chunk_three_microbatches() {
    let s = Schedule::new(&[1, 1, 1, -1, -1, -1], vec![4]).unwrap();
    assert_eq!((s.num_chunks(), s.num_microbatches()), (1, 3));
    assert_eq!(
        s.steps(),
        [
            fwd(0, 0),
            fwd(0, 1),
            fwd(0, 2),
            bwd(0, 0),
            bwd(0, 1),
            bwd(0, 2)
        ]
    );
    let graphs: Vec<(Pass, usize)> = s.layer_steps().map(|g| (g.step.pass(), g.graph)).collect();
    let mut expected = Vec::new();
    for b in 0..3 {
        expected.extend((0..4).map(|l| (Pass::Forward, b * 4 + l)));
    }
    for b in 0..3 {
        expected.extend((0..4).rev().map(|l| (Pass::Backward, b * 4 + l)));
    }
    assert_eq!(graphs, expected);
    // One chunk, each forward immediately followed by its backward (1F1B with depth 1).
    let s = Schedule::new(&[1, -1, 1, -1, 1, -1], vec![1]).unwrap();
    assert_eq!(
        s.steps(),
        [
            fwd(0, 0),
            bwd(0, 0),
            fwd(0, 1),
            bwd(0, 1),
            fwd(0, 2),
            bwd(0, 2)
        ]
    );
}

/// Every graph of each pass is warmed up and captured exactly once, with the callable the
/// layout pairs it with, in the schedule's order; layer order forward / reversed backward.
fn check_layer_steps(s: &Schedule) {
    let layout = s.layout();
    let mut seen = std::collections::HashMap::<(Pass, usize), usize>::new();
    let mut last: Option<LayerStep> = None;
    for g in s.layer_steps() {
        assert_eq!(s.steps()[g.position], g.step);
        assert_eq!(
            layout.index(g.step.chunk(), g.step.microbatch(), g.layer),
            Some(g.graph),
            "{g:?}"
        );
        assert_eq!(layout.callable_of_graph(g.graph), Some(g.callable), "{g:?}");
        assert_eq!(
            layout.callable_index(g.step.chunk(), g.layer),
            Some(g.callable)
        );
        *seen.entry((g.step.pass(), g.graph)).or_default() += 1;
        if let Some(p) = last.filter(|p| p.position == g.position) {
            let want = if g.step.pass() == Pass::Forward {
                p.layer + 1
            } else {
                p.layer - 1
            };
            assert_eq!(g.layer, want, "layer order within step {}", g.position);
        } else {
            let layers = layout.layers(g.step.chunk()).unwrap();
            let first = if g.step.pass() == Pass::Forward {
                0
            } else {
                layers - 1
            };
            assert_eq!(g.layer, first, "first layer of step {}", g.position);
            assert!(last.is_none_or(|p| p.position + 1 == g.position));
        }
        last = Some(g);
    }
    let passes: &[Pass] = if s.splits_weight_grad() {
        &[Pass::Forward, Pass::Backward, Pass::WeightGrad]
    } else {
        &[Pass::Forward, Pass::Backward]
    };
    assert_eq!(seen.len(), passes.len() * layout.total_graphs());
    for &pass in passes {
        for i in 0..layout.total_graphs() {
            assert_eq!(seen.get(&(pass, i)), Some(&1), "{pass:?} graph {i}");
        }
    }
}

#[test]
fn uneven_layers() {
    for layers in [vec![1, 3], vec![3, 1], vec![2, 5]] {
        let s = Schedule::new(&INTERLEAVED, layers.clone()).unwrap();
        assert_eq!(s.layout(), &Layout::new(layers.clone(), 3).unwrap());
        assert_eq!(s.layout().total_graphs(), (layers[0] + layers[1]) * 3);
        check_layer_steps(&s);
    }
    let s = Schedule::new(&INTERLEAVED, vec![1, 3]).unwrap();
    // Step 4 is the backward of (chunk 1, microbatch 0): graphs 3 + 0 * 3 + l, l = 2, 1, 0;
    // callables 1 + l.
    let step4: Vec<(usize, usize)> = s
        .layer_steps()
        .filter(|g| g.position == 4)
        .map(|g| (g.graph, g.callable))
        .collect();
    assert_eq!(step4, [(5, 3), (4, 2), (3, 1)]);
    // Three chunks, uneven.
    let order = [1, 2, 3, 1, 2, 3, -3, -2, -1, -3, -2, -1];
    let s = Schedule::new(&order, vec![2, 1, 4]).unwrap();
    assert_eq!((s.num_chunks(), s.num_microbatches()), (3, 2));
    check_layer_steps(&s);
    check_layer_steps(&Schedule::new(&INTERLEAVED, vec![2, 3]).unwrap());
}

#[test]
fn weight_gradient_split() {
    let order = [
        1.0, 2.0, -2.0, -2.5, -1.0, -1.5, 1.0, 2.0, -2.0, -1.0, -1.5, -2.5,
    ];
    let s = Schedule::from_f64(&order, vec![2, 1]).unwrap();
    assert!(s.splits_weight_grad());
    assert_eq!((s.num_chunks(), s.num_microbatches()), (2, 2));
    assert_eq!(
        s.steps(),
        [
            fwd(0, 0),
            fwd(1, 0),
            bwd(1, 0),
            wgrad(1, 0),
            bwd(0, 0),
            wgrad(0, 0),
            fwd(0, 1),
            fwd(1, 1),
            bwd(1, 1),
            bwd(0, 1),
            wgrad(0, 1),
            wgrad(1, 1),
        ]
    );
    let order_back: Vec<String> = s.order().map(|e| e.to_string()).collect();
    assert_eq!(
        order_back,
        [
            "1", "2", "-2", "-2.5", "-1", "-1.5", "1", "2", "-2", "-1", "-1.5", "-2.5"
        ]
    );
    // The typed form is the same schedule.
    let typed = [
        F(1),
        F(2),
        B(2),
        W(2),
        B(1),
        W(1),
        F(1),
        F(2),
        B(2),
        B(1),
        W(1),
        W(2),
    ];
    assert_eq!(Schedule::from_entries(&typed, vec![2, 1]).unwrap(), s);
    check_layer_steps(&s);
}

#[test]
fn order_entry_from_f64() {
    assert_eq!(OrderEntry::from_f64(3.0), Some(F(3)));
    assert_eq!(OrderEntry::from_f64(-3.0), Some(B(3)));
    assert_eq!(OrderEntry::from_f64(-3.5), Some(W(3)));
    assert_eq!(OrderEntry::from_f64(-0.5), Some(W(0)));
    assert_eq!(OrderEntry::from_f64(0.0), Some(F(0)));
    assert_eq!(OrderEntry::from_f64(-0.0), Some(F(0)));
    for bad in [3.5, -3.25, 0.5, f64::NAN, f64::INFINITY, -1e300] {
        assert_eq!(OrderEntry::from_f64(bad), None, "{bad}");
    }
    assert_eq!(OrderEntry::from(i64::MIN), B(1 << 63));
    assert_eq!(W(7).pass(), Pass::WeightGrad);
    assert_eq!(W(7).chunk_id(), 7);
}

// ---- every error, with its position ---------------------------------------------------

#[test]
fn empty() {
    assert_eq!(err(&[], &[]), ScheduleError::Empty);
    assert_eq!(err_f64(&[], &[1]), ScheduleError::Empty);
}

#[test]
fn zero_chunk() {
    let e = err(&[1, 0, -1], &[1]);
    assert_eq!(
        e,
        ScheduleError::ZeroChunk {
            position: 1,
            entry: F(0)
        }
    );
    assert_eq!(
        e.to_string(),
        "order[1] = 0 names chunk 0, but chunk ids are 1-based: k is the forward and -k the \
         backward of chunk k"
    );
    assert_eq!(
        err_f64(&[1.0, -1.0, -0.5], &[1]),
        ScheduleError::ZeroChunk {
            position: 2,
            entry: W(0)
        }
    );
}

#[test]
fn invalid_value() {
    let e = err_f64(&[1.0, -1.25, -1.0], &[1]);
    assert_eq!(
        e,
        ScheduleError::InvalidValue {
            position: 1,
            value: -1.25
        }
    );
    assert!(
        e.to_string()
            .starts_with("order[1] = -1.25 is not a schedule entry")
    );
    assert!(matches!(
        err_f64(&[1.0, -1.0, f64::NAN], &[1]),
        ScheduleError::InvalidValue { position: 2, value } if value.is_nan()
    ));
}

#[test]
fn chunk_out_of_range() {
    let e = err(&[1, -1, -2], &[1]);
    assert_eq!(
        e,
        ScheduleError::ChunkOutOfRange {
            position: 2,
            entry: B(2),
            num_chunks: 1
        }
    );
    assert_eq!(
        e.to_string(),
        "order[2] = -2 names chunk 2, but the largest forward entry is 1, which makes 1 \
         chunk(s): every chunk needs forward entries"
    );
    assert_eq!(
        err_f64(&[1.0, -1.0, -3.5], &[1]),
        ScheduleError::ChunkOutOfRange {
            position: 2,
            entry: W(3),
            num_chunks: 1
        }
    );
    // No forward at all.
    assert_eq!(
        err(&[-1, -1], &[1]),
        ScheduleError::ChunkOutOfRange {
            position: 0,
            entry: B(1),
            num_chunks: 0
        }
    );
}

#[test]
fn chunk_missing() {
    let e = err(&[1, 3, -1, -3], &[1, 1, 1]);
    assert_eq!(
        e,
        ScheduleError::ChunkMissing {
            chunk_id: 2,
            position: 1,
            entry: F(3),
            num_chunks: 3
        }
    );
    assert_eq!(
        e.to_string(),
        "chunk 2 never appears in the order, but order[1] = 3 makes 3 chunks: use chunk ids \
         1..=3 with none left out"
    );
    // A huge id is caught without allocating per chunk.
    assert_eq!(
        err(&[1, i64::MAX, -1], &[1]),
        ScheduleError::ChunkMissing {
            chunk_id: 2,
            position: 1,
            entry: F(i64::MAX as u64),
            num_chunks: i64::MAX as u64
        }
    );
}

#[test]
fn unequal_counts() {
    let e = err(&[1, 2, 2, -2, -2, -1], &[1, 1]);
    assert_eq!(
        e,
        ScheduleError::UnequalCounts {
            position: 3,
            entry: B(2),
            count: 3,
            other_chunk_id: 1,
            other_count: 2
        }
    );
    assert_eq!(
        e.to_string(),
        "order[3] = -2 is entry 3 of chunk 2, but chunk 1 appears only 2 times: every chunk \
         needs the same number of entries, a forward and a backward per microbatch"
    );
    // The order with chunk 1's last backward dropped.
    assert_eq!(
        err(&INTERLEAVED[..11], &[2, 3]),
        ScheduleError::UnequalCounts {
            position: 10,
            entry: B(2),
            count: 6,
            other_chunk_id: 1,
            other_count: 5
        }
    );
}

#[test]
fn indivisible() {
    let e = err(&[1, 1, -1], &[1]);
    assert_eq!(
        e,
        ScheduleError::Indivisible {
            position: 2,
            entry: B(1),
            len: 3,
            num_chunks: 1
        }
    );
    assert_eq!(
        e.to_string(),
        "the order has 3 forward/backward entries for 1 chunk(s), not a multiple of 2 x 1: \
         every microbatch of every chunk needs one forward and one backward (the order ends at \
         order[2] = -1)"
    );
    // Weight-gradient entries do not count and are not the end named.
    assert_eq!(
        err_f64(&[1.0, 2.0, -1.0, -2.0, 1.0, 2.0, -1.5], &[1, 1]),
        ScheduleError::Indivisible {
            position: 5,
            entry: F(2),
            len: 6,
            num_chunks: 2
        }
    );
}

#[test]
fn too_many_forwards() {
    let e = err(&[1, 1, 1, -1], &[1]);
    assert_eq!(
        e,
        ScheduleError::TooManyForwards {
            position: 2,
            entry: F(1),
            num_microbatches: 2
        }
    );
    assert_eq!(
        e.to_string(),
        "order[2] = 1 is forward 3 of chunk 1, but there are only 2 microbatch(es) per chunk \
         (entries / chunks / 2): the chunk has more forwards than backwards"
    );
}

#[test]
fn backward_before_forward() {
    let e = err(&[-1, 1], &[1]);
    assert_eq!(
        e,
        ScheduleError::BackwardBeforeForward {
            position: 0,
            entry: B(1),
            microbatch: 0
        }
    );
    let e = err(&[1, -1, -1, 1], &[1]);
    assert_eq!(
        e,
        ScheduleError::BackwardBeforeForward {
            position: 2,
            entry: B(1),
            microbatch: 1
        }
    );
    assert_eq!(
        e.to_string(),
        "order[2] = -1 is the backward of microbatch 1 of chunk 1, but that microbatch's \
         forward has not run yet: move it after forward 2 of chunk 1"
    );
    // Two chunks, equal counts, chunk 1's second backward too early.
    assert_eq!(
        err(&[1, 2, -1, -2, -1, 2, 1, -2], &[1, 1]),
        ScheduleError::BackwardBeforeForward {
            position: 4,
            entry: B(1),
            microbatch: 1
        }
    );
}

#[test]
fn weight_grad_before_backward() {
    let e = err_f64(&[1.0, -1.5, -1.0], &[1]);
    assert_eq!(
        e,
        ScheduleError::WeightGradBeforeBackward {
            position: 1,
            entry: W(1),
            microbatch: 0
        }
    );
    assert_eq!(
        e.to_string(),
        "order[1] = -1.5 is the weight gradient of microbatch 0 of chunk 1, but that \
         microbatch's backward has not run yet: move it after backward 1 of chunk 1"
    );
}

#[test]
fn too_many_weight_grads() {
    let e = err_f64(&[1.0, -1.0, -1.5, -1.5], &[1]);
    assert_eq!(
        e,
        ScheduleError::TooManyWeightGrads {
            position: 3,
            entry: W(1),
            num_microbatches: 1
        }
    );
    assert_eq!(
        e.to_string(),
        "order[3] = -1.5 is weight gradient 2 of chunk 1, but there are only 1 microbatch(es) \
         per chunk"
    );
}

#[test]
fn missing_weight_grad() {
    let e = err_f64(&[1.0, 1.0, -1.0, -1.5, -1.0], &[1]);
    assert_eq!(
        e,
        ScheduleError::MissingWeightGrad {
            position: 4,
            entry: B(1),
            microbatch: 1
        }
    );
    assert_eq!(
        e.to_string(),
        "order[4] = -1, the backward of microbatch 1 of chunk 1, has no weight-gradient entry \
         (-1.5) after it: once the order has weight-gradient entries, every backward needs one"
    );
    // The earliest backward without one is named, across chunks.
    assert_eq!(
        err_f64(&[1.0, 2.0, -2.0, -1.0, -1.5], &[1, 1]),
        ScheduleError::MissingWeightGrad {
            position: 2,
            entry: B(2),
            microbatch: 0
        }
    );
}

#[test]
fn layers_per_chunk_length() {
    let e = err(&[1, 2, -2, -1], &[1]);
    assert_eq!(
        e,
        ScheduleError::LayersPerChunkLength {
            layers_len: 1,
            num_chunks: 2,
            position: 1,
            entry: F(2)
        }
    );
    assert_eq!(
        e.to_string(),
        "layers_per_chunk has 1 entries, but the order has 2 chunk(s) (its largest forward \
         entry, order[1] = 2): give one layer count per chunk"
    );
    assert!(matches!(
        err(&INTERLEAVED, &[1, 1, 1]),
        ScheduleError::LayersPerChunkLength {
            layers_len: 3,
            num_chunks: 2,
            position: 1,
            ..
        }
    ));
}

#[test]
fn zero_layers() {
    let e = err(&[1, 2, -2, -1], &[1, 0]);
    assert_eq!(e, ScheduleError::ZeroLayers { chunk: 1 });
    assert_eq!(
        e.to_string(),
        "layers_per_chunk[1] is 0 (chunk 2): every chunk needs at least one layer"
    );
}

#[test]
fn converts_into_the_crate_error() {
    let e: Error = err(&[-1, 1], &[1]).into();
    assert!(matches!(
        e,
        Error::Schedule(ScheduleError::BackwardBeforeForward { position: 0, .. })
    ));
    assert!(
        e.to_string()
            .starts_with("invalid schedule: order[0] = -1 is the backward")
    );
    fn build() -> graphed_callables::Result<Schedule> {
        Ok(Schedule::new(&[1, 1, -1], vec![1])?)
    }
    assert!(matches!(
        build(),
        Err(Error::Schedule(ScheduleError::Indivisible { .. }))
    ));
}
