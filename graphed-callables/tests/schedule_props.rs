//! Generated-input tests of schedules and layouts (proptest, CPU only).
//!
//! * Arbitrary integer and float orders with arbitrary `layers_per_chunk`: parsing never
//!   panics; it accepts exactly what an independent statement of the rules accepts; an
//!   accepted schedule keeps every invariant; a rejection names the offending position and
//!   value (or layer count), and what it claims about them is true.
//! * Valid pipelines built step by step (random interleavings) are accepted with exactly the
//!   steps built; the same pipelines mutated a little are accepted exactly when the rules say.
//! * [`Layout`]'s index maps are mutually consistent bijections for random shapes, and every
//!   query outside them answers `None` (or `false`) without panicking, huge shapes included.
//!
//! Each property runs 100 000 cases (a fresh random seed each run; proptest saves a failing
//! case next to this file, in `schedule_props.proptest-regressions`, to be replayed first).

use std::collections::{BTreeSet, HashMap};

use graphed_callables::{GraphIndex, Layout, OrderEntry, Pass, Schedule, ScheduleError, Step};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::RngAlgorithm;

const CASES: u32 = 100_000;

/// `cases` cases; XorShift rather than the default ChaCha, which dominates the run time of
/// these cheap cases in a debug build.
fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        rng_algorithm: RngAlgorithm::XorShift,
        ..ProptestConfig::default()
    }
}

// ---- an independent statement of the rules ----------------------------------------------

/// The reference's float encoding, stated independently of `OrderEntry::from_f64`: an
/// integer of magnitude at most 2^53, or `-k - 0.5`.
fn parse_f64(v: f64) -> Option<OrderEntry> {
    if !v.is_finite() || v.abs() > 9_007_199_254_740_992.0 {
        return None;
    }
    if v.floor() == v {
        return Some(OrderEntry::from(v as i64));
    }
    let w = v + 0.5;
    // Below 2^52 in magnitude (where halves exist) adding 0.5 is exact.
    (v < 0.0 && w.floor() == w).then(|| OrderEntry::WeightGrad((-w) as u64))
}

/// What a valid schedule is, written from the rules in `Schedule::from_entries`'s docs rather
/// than from its code: `Some((chunks, microbatches, split))` when `order` with
/// `layers_per_chunk` is valid.
fn model(order: &[OrderEntry], layers: &[usize]) -> Option<(usize, usize, bool)> {
    if order.iter().any(|e| e.chunk_id() == 0) {
        return None;
    }
    let chunks = order
        .iter()
        .filter(|e| e.pass() == Pass::Forward)
        .map(|e| e.chunk_id())
        .max()?;
    if order.iter().any(|e| e.chunk_id() > chunks) {
        return None;
    }
    // Every id is in 1..=chunks; all of them appear iff there are `chunks` distinct ones.
    let ids: BTreeSet<u64> = order.iter().map(|e| e.chunk_id()).collect();
    if ids.len() as u64 != chunks {
        return None;
    }
    let chunks = ids.len();
    // Per chunk: forwards, backwards and weight gradients seen so far.
    let mut seen = vec![[0usize; 3]; chunks];
    for e in order {
        let c = &mut seen[e.chunk_id() as usize - 1];
        match e.pass() {
            Pass::Forward => c[0] += 1,
            Pass::Backward => c[1] += 1,
            Pass::WeightGrad => c[2] += 1,
        }
        // A backward after its forward, a weight gradient after its backward.
        if c[1] > c[0] || c[2] > c[1] {
            return None;
        }
    }
    let microbatches = seen[0][0];
    let split = seen.iter().any(|c| c[2] > 0);
    let want = [
        microbatches,
        microbatches,
        if split { microbatches } else { 0 },
    ];
    if microbatches == 0 || seen.iter().any(|c| *c != want) {
        return None;
    }
    if layers.len() != chunks || layers.contains(&0) {
        return None;
    }
    layers
        .iter()
        .try_fold(0usize, |sum, &l| sum.checked_add(l))?
        .checked_mul(microbatches)?;
    Some((chunks, microbatches, split))
}

// ---- checks of results --------------------------------------------------------------------

/// Every invariant of an accepted schedule.
fn check_ok(s: &Schedule, order: &[OrderEntry], layers: &[usize], want: (usize, usize, bool)) {
    let (chunks, microbatches, split) = want;
    assert_eq!(
        (s.num_chunks(), s.num_microbatches(), s.splits_weight_grad()),
        want
    );
    assert_eq!(s.layers_per_chunk(), layers);
    assert_eq!(
        s.layout(),
        &Layout::new(layers.to_vec(), microbatches).unwrap()
    );
    assert_eq!(s.order().collect::<Vec<_>>(), order);
    assert_eq!(s.steps().len(), order.len());

    // Step i is the n-th entry of its (chunk, pass), n counted from 0; each (pass, chunk,
    // microbatch) appears once, the forward before the backward before the weight gradient.
    let mut counter = HashMap::<(Pass, usize), usize>::new();
    let mut at = HashMap::<Step, usize>::new();
    for (i, (&step, &entry)) in s.steps().iter().zip(order).enumerate() {
        let chunk = entry.chunk_id() as usize - 1;
        let n = counter.entry((entry.pass(), chunk)).or_default();
        assert_eq!(step, Step::new(entry.pass(), chunk, *n), "step {i}");
        assert_eq!(step.entry(), entry);
        assert_eq!(step.is_first_microbatch(), *n == 0);
        *n += 1;
        assert!(at.insert(step, i).is_none(), "{step:?} twice");
        assert_eq!(s.position(step), Some(i));
    }
    let passes: &[Pass] = if split {
        &[Pass::Forward, Pass::Backward, Pass::WeightGrad]
    } else {
        &[Pass::Forward, Pass::Backward]
    };
    assert_eq!(at.len(), passes.len() * chunks * microbatches);
    for c in 0..chunks {
        for b in 0..microbatches {
            let pos: Vec<usize> = passes.iter().map(|&p| at[&Step::new(p, c, b)]).collect();
            assert!(pos.windows(2).all(|w| w[0] < w[1]), "({c}, {b}) at {pos:?}");
        }
        assert_eq!(s.position(Step::new(Pass::Forward, c, microbatches)), None);
    }
    assert_eq!(s.position(Step::new(Pass::Forward, chunks, 0)), None);

    check_layer_steps(s);
}

/// `layer_steps` against `steps` and the layout: every graph of every pass once (all of them
/// for small layouts, the first few hundred for huge ones), layers first to last forward and
/// last to first otherwise.
fn check_layer_steps(s: &Schedule) {
    let layout = s.layout();
    let small = layout.total_callables() <= 64;
    let limit = if small { usize::MAX } else { 256 };
    let mut seen = BTreeSet::<(u8, usize)>::new();
    let mut expect = s.steps().iter().enumerate().flat_map(|(position, &step)| {
        let layers = layout.layers(step.chunk()).unwrap();
        (0..layers).map(move |i| {
            let layer = if step.pass() == Pass::Forward {
                i
            } else {
                layers - 1 - i
            };
            (position, step, layer)
        })
    });
    let mut count = 0;
    for g in s.layer_steps().take(limit) {
        let (position, step, layer) = expect.next().expect("more layer steps than layers");
        assert_eq!((g.position, g.step, g.layer), (position, step, layer));
        assert_eq!(
            layout.index(step.chunk(), step.microbatch(), layer),
            Some(g.graph)
        );
        assert_eq!(layout.callable_index(step.chunk(), layer), Some(g.callable));
        assert_eq!(layout.callable_of_graph(g.graph), Some(g.callable));
        let pass = match step.pass() {
            Pass::Forward => 0,
            Pass::Backward => 1,
            Pass::WeightGrad => 2,
        };
        assert!(seen.insert((pass, g.graph)), "{g:?} twice");
        count += 1;
    }
    if small {
        assert!(expect.next().is_none(), "fewer layer steps than layers");
        let passes = if s.splits_weight_grad() { 3 } else { 2 };
        assert_eq!(count, passes * layout.total_graphs());
    }
}

/// The error's message names the offending position and entry (or layer count), and what the
/// error claims about them holds.
fn check_err(e: &ScheduleError, order: &[OrderEntry], layers: &[usize]) {
    let msg = e.to_string();
    // "order[p] = entry", with the entry really there.
    let names = |position: usize, entry: OrderEntry| {
        assert_eq!(order.get(position), Some(&entry), "{e:?}");
        let at = format!("order[{position}] = {entry}");
        assert!(msg.contains(&at), "{msg:?} does not name {at}");
    };
    let chunk_of = |k: u64| order.iter().filter(move |x| x.chunk_id() == k);
    // How many entries of `entry`'s chunk and pass are at or before `position`.
    let nth = |position: usize, entry: OrderEntry| {
        order[..=position]
            .iter()
            .filter(|x| x.chunk_id() == entry.chunk_id() && x.pass() == entry.pass())
            .count()
    };
    let max_forward = order
        .iter()
        .filter(|x| x.pass() == Pass::Forward)
        .map(|x| x.chunk_id())
        .max()
        .unwrap_or(0);
    let microbatches = |num: usize| {
        // Equal counts passed: the first chunk's forward/backward entries / 2.
        assert_eq!(
            chunk_of(1).filter(|x| x.pass() != Pass::WeightGrad).count(),
            2 * num,
            "{e:?}"
        );
    };
    match *e {
        ScheduleError::Empty => assert!(order.is_empty()),
        ScheduleError::ZeroChunk { position, entry } => {
            names(position, entry);
            assert_eq!(entry.chunk_id(), 0);
            assert!(order[..position].iter().all(|x| x.chunk_id() != 0));
        }
        ScheduleError::ChunkOutOfRange {
            position,
            entry,
            num_chunks,
        } => {
            names(position, entry);
            assert_eq!(num_chunks, max_forward);
            assert!(entry.chunk_id() > num_chunks);
            assert!(msg.contains(&format!("names chunk {}", entry.chunk_id())));
        }
        ScheduleError::ChunkMissing {
            chunk_id,
            position,
            entry,
            num_chunks,
        } => {
            names(position, entry);
            assert_eq!(entry, OrderEntry::Forward(num_chunks));
            assert_eq!(num_chunks, max_forward);
            assert!((1..num_chunks).contains(&chunk_id));
            assert_eq!(chunk_of(chunk_id).count(), 0);
            assert!(msg.contains(&format!("chunk {chunk_id} never appears")));
        }
        ScheduleError::UnequalCounts {
            position,
            entry,
            count,
            other_chunk_id,
            other_count,
        } => {
            names(position, entry);
            assert_ne!(entry.pass(), Pass::WeightGrad);
            let fb = |k: u64| chunk_of(k).filter(|x| x.pass() != Pass::WeightGrad).count();
            assert_eq!(fb(other_chunk_id), other_count);
            assert!(fb(entry.chunk_id()) > other_count);
            assert_eq!(count, other_count + 1);
            let nth_fb = order[..=position]
                .iter()
                .filter(|x| x.chunk_id() == entry.chunk_id() && x.pass() != Pass::WeightGrad)
                .count();
            assert_eq!(nth_fb, count);
            assert!(msg.contains(&format!(
                "chunk {other_chunk_id} appears only {other_count} times"
            )));
        }
        ScheduleError::Indivisible {
            position,
            entry,
            len,
            num_chunks,
        } => {
            names(position, entry);
            let fb: Vec<usize> = (0..order.len())
                .filter(|&p| order[p].pass() != Pass::WeightGrad)
                .collect();
            assert_eq!(fb.last(), Some(&position));
            assert_eq!(fb.len(), len);
            assert_eq!(num_chunks as u64, max_forward);
            assert_ne!(len % (2 * num_chunks), 0);
            assert!(msg.contains(&format!("has {len} forward/backward entries")));
        }
        ScheduleError::TooManyForwards {
            position,
            entry,
            num_microbatches,
        } => {
            names(position, entry);
            assert_eq!(entry.pass(), Pass::Forward);
            assert_eq!(nth(position, entry), num_microbatches + 1);
            microbatches(num_microbatches);
        }
        ScheduleError::BackwardBeforeForward {
            position,
            entry,
            microbatch,
        } => {
            names(position, entry);
            assert_eq!(entry.pass(), Pass::Backward);
            assert_eq!(nth(position, entry), microbatch + 1);
            let forwards = nth(position, OrderEntry::Forward(entry.chunk_id()));
            assert!(forwards <= microbatch);
            assert!(msg.contains(&format!("backward of microbatch {microbatch}")));
        }
        ScheduleError::WeightGradBeforeBackward {
            position,
            entry,
            microbatch,
        } => {
            names(position, entry);
            assert_eq!(entry.pass(), Pass::WeightGrad);
            assert_eq!(nth(position, entry), microbatch + 1);
            let backwards = nth(position, OrderEntry::Backward(entry.chunk_id()));
            assert!(backwards <= microbatch);
            assert!(msg.contains(&format!("weight gradient of microbatch {microbatch}")));
        }
        ScheduleError::TooManyWeightGrads {
            position,
            entry,
            num_microbatches,
        } => {
            names(position, entry);
            assert_eq!(entry.pass(), Pass::WeightGrad);
            assert_eq!(nth(position, entry), num_microbatches + 1);
            microbatches(num_microbatches);
        }
        ScheduleError::MissingWeightGrad {
            position,
            entry,
            microbatch,
        } => {
            names(position, entry);
            assert_eq!(entry.pass(), Pass::Backward);
            assert_eq!(nth(position, entry), microbatch + 1);
            let k = entry.chunk_id();
            assert_eq!(
                chunk_of(k).filter(|x| x.pass() == Pass::WeightGrad).count(),
                microbatch
            );
            assert!(msg.contains(&format!("(-{k}.5)")));
        }
        ScheduleError::LayersPerChunkLength {
            layers_len,
            num_chunks,
            position,
            entry,
        } => {
            names(position, entry);
            assert_eq!(layers_len, layers.len());
            assert_eq!(num_chunks as u64, max_forward);
            assert_ne!(layers_len, num_chunks);
            assert!(msg.contains(&format!("layers_per_chunk has {layers_len} entries")));
        }
        ScheduleError::ZeroLayers { .. } => check_layout_err(e, layers),
        ScheduleError::TooManyGraphs {
            num_microbatches, ..
        } => {
            microbatches(num_microbatches);
            check_layout_err(e, layers);
        }
        _ => panic!("unexpected error from a schedule: {e:?}"),
    }
}

/// A layout error names the offending layer count (or the sizes that overflow).
fn check_layout_err(e: &ScheduleError, layers: &[usize]) {
    let msg = e.to_string();
    match *e {
        ScheduleError::ZeroLayers { chunk } => {
            assert_eq!(layers.iter().position(|&l| l == 0), Some(chunk));
            assert!(msg.contains(&format!("layers_per_chunk[{chunk}] is 0")));
        }
        ScheduleError::TooManyGraphs {
            total_layers,
            num_microbatches,
        } => {
            assert!(!layers.contains(&0));
            assert_eq!(
                total_layers,
                layers.iter().map(|&l| l as u128).sum::<u128>()
            );
            let graphs = total_layers.checked_mul(num_microbatches as u128);
            assert!(graphs.is_none_or(|g| g > usize::MAX as u128), "{e:?}");
            let named = format!("{total_layers} layers, which x {num_microbatches} microbatch");
            assert!(msg.contains(&named), "{msg:?} does not name {named}");
        }
        _ => panic!("unexpected layout error: {e:?}"),
    }
}

/// Parses `order` both ways (integers and their float images) and checks the result against
/// the model.
fn check_i64(order: &[i64], layers: &[usize]) {
    let entries: Vec<OrderEntry> = order.iter().map(|&v| OrderEntry::from(v)).collect();
    let got = Schedule::new(order, layers.to_vec());
    check_entries(&got, &entries, layers);
    // The float images of small integers are exact and parse the same.
    if order.iter().all(|v| v.unsigned_abs() <= 1 << 53) {
        let floats: Vec<f64> = order.iter().map(|&v| v as f64).collect();
        assert_eq!(Schedule::from_f64(&floats, layers.to_vec()), got);
    }
}

fn check_f64(order: &[f64], layers: &[usize]) {
    let got = Schedule::from_f64(order, layers.to_vec());
    match order.iter().position(|&v| parse_f64(v).is_none()) {
        Some(p) => {
            let Err(ScheduleError::InvalidValue { position, value }) = got else {
                panic!("{:?} is no entry, but parsing gave {got:?}", order[p]);
            };
            assert_eq!(position, p);
            assert_eq!(value.to_bits(), order[p].to_bits());
            let msg = got.unwrap_err().to_string();
            let at = format!("order[{p}] = {value}");
            assert!(msg.contains(&at), "{msg:?} does not name {at}");
        }
        None => {
            let entries: Vec<OrderEntry> = order.iter().map(|&v| parse_f64(v).unwrap()).collect();
            for (&v, &e) in order.iter().zip(&entries) {
                assert_eq!(OrderEntry::from_f64(v), Some(e), "{v}");
            }
            check_entries(&got, &entries, layers);
            assert_eq!(Schedule::from_entries(&entries, layers.to_vec()), got);
        }
    }
}

fn check_entries(got: &Result<Schedule, ScheduleError>, entries: &[OrderEntry], layers: &[usize]) {
    match (got, model(entries, layers)) {
        (Ok(s), Some(want)) => check_ok(s, entries, layers, want),
        (Err(e), None) => check_err(e, entries, layers),
        (Ok(s), None) => panic!("accepted against the rules: {entries:?} {layers:?}: {s:?}"),
        (Err(e), Some(_)) => panic!("valid order rejected: {entries:?} {layers:?}: {e}"),
    }
}

// ---- strategies -------------------------------------------------------------------------

/// Small chunk ids mostly (so orders are sometimes nearly valid), any i64 sometimes, and the
/// extremes.
fn order_i64() -> impl Strategy<Value = i64> {
    prop_oneof![
        6 => 1i64..=3,
        6 => -3i64..=-1,
        1 => Just(0i64),
        1 => any::<i64>(),
        1 => select(vec![i64::MIN, i64::MIN + 1, i64::MAX, -(1 << 53), 1 << 53, 1 << 32]),
    ]
}

/// Integers and `-k - 0.5` mostly; other fractions, NaN, infinities, huge, tiny and `-0.0`.
fn order_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        8 => (1i64..=3).prop_map(|v| v as f64),
        8 => (-3i64..=-1).prop_map(|v| v as f64),
        1 => Just(0.0),
        4 => (1i64..=3).prop_map(|k| -(k as f64) - 0.5),
        1 => Just(-0.5),
        1 => (-4i64..=4, select(vec![0.25, 0.5, 0.75, 1e-9])).prop_map(|(v, f)| v as f64 + f),
        1 => any::<f64>(),
        1 => select(vec![
            f64::NAN,
            -f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            -0.0,
            f64::MIN_POSITIVE,
            -5e-324,
            f64::MAX,
            f64::MIN,
            9_007_199_254_740_992.0,
            -9_007_199_254_740_992.0,
            9_007_199_254_740_994.0,
            -4_503_599_627_370_495.5,
            1e300,
        ]),
    ]
}

/// Layer counts: mostly 1..=3, sometimes 0 or huge.
fn layer_count() -> impl Strategy<Value = usize> {
    prop_oneof![
        12 => 1usize..=3,
        1 => Just(0usize),
        1 => select(vec![usize::MAX, usize::MAX / 2, usize::MAX / 3, 1 << 32]),
        1 => any::<usize>(),
    ]
}

fn layers() -> impl Strategy<Value = Vec<usize>> {
    vec(layer_count(), 0..=4)
}

/// A valid pipeline: (chunks, microbatches, split, layers, order) with the order a random
/// interleaving in which each (chunk, microbatch) runs forward, then backward, then (split)
/// weight gradient. `choices` pick among the entries that may come next.
fn pipeline() -> impl Strategy<Value = (usize, usize, bool, Vec<usize>, Vec<f64>)> {
    (1usize..=4, 1usize..=4, any::<bool>())
        .prop_flat_map(|(chunks, mb, split)| {
            (
                Just((chunks, mb, split)),
                vec(1usize..=4, chunks),
                vec(any::<u16>(), 3 * chunks * mb),
            )
        })
        .prop_map(|((chunks, mb, split), layers, choices)| {
            let order = interleave(chunks, mb, split, &choices);
            (chunks, mb, split, layers, order)
        })
}

fn interleave(chunks: usize, mb: usize, split: bool, choices: &[u16]) -> Vec<f64> {
    let mut done = vec![[0usize; 3]; chunks];
    let mut order = Vec::new();
    for &choice in choices {
        let mut ready = Vec::new();
        for (c, d) in done.iter().enumerate() {
            let k = c as f64 + 1.0;
            if d[0] < mb {
                ready.push((c, 0, k));
            }
            if d[1] < d[0] {
                ready.push((c, 1, -k));
            }
            if split && d[2] < d[1] {
                ready.push((c, 2, -k - 0.5));
            }
        }
        let Some(&(c, pass, v)) = ready.get(choice as usize % ready.len().max(1)) else {
            break;
        };
        done[c][pass] += 1;
        order.push(v);
    }
    order
}

#[derive(Debug, Clone)]
enum Mutation {
    Swap(usize, usize),
    Remove(usize),
    Duplicate(usize),
    Replace(usize, f64),
    Layers(Vec<usize>),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<usize>(), any::<usize>()).prop_map(|(i, j)| Mutation::Swap(i, j)),
        2 => any::<usize>().prop_map(Mutation::Remove),
        2 => any::<usize>().prop_map(Mutation::Duplicate),
        2 => (any::<usize>(), order_f64()).prop_map(|(i, v)| Mutation::Replace(i, v)),
        1 => layers().prop_map(Mutation::Layers),
    ]
}

fn mutate(order: &mut Vec<f64>, layers: &mut Vec<usize>, m: &Mutation) {
    let n = order.len();
    if n == 0 {
        return;
    }
    match *m {
        Mutation::Swap(i, j) => order.swap(i % n, j % n),
        Mutation::Remove(i) => {
            order.remove(i % n);
        }
        Mutation::Duplicate(i) => order.insert(i % n, order[i % n]),
        Mutation::Replace(i, v) => order[i % n] = v,
        Mutation::Layers(ref l) => *layers = l.clone(),
    }
}

// ---- schedule properties ------------------------------------------------------------------

proptest! {
    #![proptest_config(config(CASES))]

    /// Arbitrary integer orders and layer counts.
    #[test]
    fn any_i64_order(order in vec(order_i64(), 0..=12), layers in layers()) {
        check_i64(&order, &layers);
    }

    /// Arbitrary float orders and layer counts.
    #[test]
    fn any_f64_order(order in vec(order_f64(), 0..=12), layers in layers()) {
        check_f64(&order, &layers);
    }

    /// Valid pipelines are accepted, with the steps they were built from.
    #[test]
    fn valid_pipelines_are_accepted((chunks, mb, split, layers, order) in pipeline()) {
        let s = Schedule::from_f64(&order, layers.clone())
            .unwrap_or_else(|e| panic!("{order:?} {layers:?}: {e}"));
        let entries: Vec<OrderEntry> = order.iter().map(|&v| parse_f64(v).unwrap()).collect();
        check_ok(&s, &entries, &layers, (chunks, mb, split));
        if !split {
            let ints: Vec<i64> = order.iter().map(|&v| v as i64).collect();
            prop_assert_eq!(Schedule::new(&ints, layers), Ok(s));
        }
    }

    /// Valid pipelines a few edits away from valid: accepted exactly when the rules say.
    #[test]
    fn mutated_pipelines(
        (_, _, _, mut layers, mut order) in pipeline(),
        mutations in vec(mutation(), 1..=3),
    ) {
        for m in &mutations {
            mutate(&mut order, &mut layers, m);
        }
        check_f64(&order, &layers);
        if order.iter().all(|v| v.fract() == 0.0) {
            let ints: Vec<i64> = order.iter().map(|&v| v as i64).collect();
            check_i64(&ints, &layers);
        }
    }

    /// Float parsing of single values against the independent statement; display round trip.
    #[test]
    fn order_entries(v in order_f64(), k in 1u64..=(1 << 52) - 1) {
        prop_assert_eq!(OrderEntry::from_f64(v), parse_f64(v));
        for e in [OrderEntry::Forward(k), OrderEntry::Backward(k), OrderEntry::WeightGrad(k)] {
            let shown: f64 = e.to_string().parse().unwrap();
            prop_assert_eq!(OrderEntry::from_f64(shown), Some(e));
        }
        let i = k as i64;
        prop_assert_eq!(OrderEntry::from(i), OrderEntry::Forward(k));
        prop_assert_eq!(OrderEntry::from(-i), OrderEntry::Backward(k));
    }
}

// ---- layout properties --------------------------------------------------------------------

/// Every query of a small layout, exhaustively, plus queries just outside it.
fn check_small_layout(layout: &Layout, layers: &[usize], mb: usize) {
    let total_callables: usize = layers.iter().sum();
    assert_eq!(layout.num_chunks(), layers.len());
    assert_eq!(layout.num_microbatches(), mb);
    assert_eq!(layout.layers_per_chunk(), layers);
    assert_eq!(layout.total_callables(), total_callables);
    assert_eq!(layout.total_graphs(), total_callables * mb);
    let total = layout.total_graphs();
    let mut seen = vec![false; total];
    let mut callable_start = 0;
    for (c, &l) in layers.iter().enumerate() {
        assert_eq!(layout.layers(c), Some(l));
        let callables = callable_start..callable_start + l;
        assert_eq!(layout.chunk_callables(c), Some(callables.clone()));
        for layer in 0..l {
            assert_eq!(
                layout.callable_index(c, layer),
                Some(callable_start + layer)
            );
        }
        assert_eq!(layout.callable_index(c, l), None);
        for b in 0..mb {
            let graphs = layout.microbatch_graphs(c, b).unwrap();
            assert_eq!(graphs.len(), l);
            for layer in 0..l {
                let i = layout.index(c, b, layer).unwrap();
                assert_eq!(i, graphs.start + layer);
                assert!(!seen[i], "graph {i} twice");
                seen[i] = true;
                let at = GraphIndex {
                    chunk: c,
                    microbatch: b,
                    layer,
                };
                assert_eq!(layout.locate(i), Some(at));
                assert_eq!(layout.index_of(at), Some(i));
                assert_eq!(layout.callable_of_graph(i), Some(callable_start + layer));
            }
            assert_eq!(layout.index(c, b, l), None);
        }
        assert_eq!(layout.index(c, mb, 0), None);
        assert_eq!(layout.microbatch_graphs(c, mb), None);
        callable_start += l;
    }
    assert!(seen.iter().all(|&s| s));
    let listed: Vec<GraphIndex> = layout.iter().collect();
    assert_eq!(listed.len(), total);
    for (i, at) in listed.into_iter().enumerate() {
        assert_eq!(layout.locate(i), Some(at));
    }
    let firsts: Vec<usize> = (0..total_callables + 2)
        .filter(|&c| layout.is_chunk_input(c))
        .collect();
    let starts: Vec<usize> = (0..layers.len())
        .map(|c| layout.chunk_callables(c).unwrap().start)
        .collect();
    assert_eq!(firsts, starts);
    let chunks = layers.len();
    assert_eq!(layout.layers(chunks), None);
    assert_eq!(layout.index(chunks, 0, 0), None);
    assert_eq!(layout.callable_index(chunks, 0), None);
    assert_eq!(layout.chunk_callables(chunks), None);
    assert_eq!(layout.microbatch_graphs(chunks, 0), None);
    assert_eq!(layout.locate(total), None);
    assert_eq!(layout.callable_of_graph(total), None);
}

/// Arbitrary queries (in range or not) of any layout, without iterating over it: each answer
/// is `Some` exactly when the arguments are in range, and the maps agree with each other.
fn check_queries(layout: &Layout, chunk: usize, microbatch: usize, layer: usize, index: usize) {
    let layers = layout.layers(chunk);
    assert_eq!(layers, layout.layers_per_chunk().get(chunk).copied());
    let in_range = layers.is_some_and(|l| microbatch < layout.num_microbatches() && layer < l);
    let got = layout.index(chunk, microbatch, layer);
    assert_eq!(got.is_some(), in_range);
    if let Some(i) = got {
        assert!(i < layout.total_graphs());
        let at = GraphIndex {
            chunk,
            microbatch,
            layer,
        };
        assert_eq!(layout.locate(i), Some(at));
        assert_eq!(layout.index_of(at), Some(i));
        let mbg = layout.microbatch_graphs(chunk, microbatch).unwrap();
        assert_eq!(mbg.start + layer, i);
        assert_eq!(mbg.len(), layers.unwrap());
        let callable = layout.callable_index(chunk, layer).unwrap();
        assert_eq!(layout.callable_of_graph(i), Some(callable));
        let cc = layout.chunk_callables(chunk).unwrap();
        assert_eq!(cc.start + layer, callable);
        assert_eq!(layout.is_chunk_input(callable), layer == 0);
    }
    let callable = layout.callable_index(chunk, layer);
    assert_eq!(callable.is_some(), layers.is_some_and(|l| layer < l));
    if let Some(c) = callable {
        assert!(c < layout.total_callables());
    }

    let located = layout.locate(index);
    assert_eq!(located.is_some(), index < layout.total_graphs());
    assert_eq!(layout.callable_of_graph(index).is_some(), located.is_some());
    if let Some(at) = located {
        assert_eq!(layout.index_of(at), Some(index));
        assert_eq!(
            layout.callable_of_graph(index),
            layout.callable_index(at.chunk, at.layer)
        );
        let range = layout.microbatch_graphs(at.chunk, at.microbatch).unwrap();
        assert!(range.contains(&index));
    }
    // A callable index is a chunk's first exactly when it starts that chunk's range.
    let c = index;
    let is_first = c < layout.total_callables()
        && (0..layout.num_chunks()).any(|m| layout.chunk_callables(m).unwrap().start == c);
    assert_eq!(layout.is_chunk_input(c), is_first);
}

/// What `Layout::new` accepts, stated independently.
fn layout_valid(layers: &[usize], mb: usize) -> bool {
    !layers.is_empty()
        && mb > 0
        && !layers.contains(&0)
        && layers
            .iter()
            .try_fold(0usize, |s, &l| s.checked_add(l))
            .and_then(|t| t.checked_mul(mb))
            .is_some()
}

/// A query argument: small (near the edges of small layouts) or anything.
fn query() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 0usize..=20,
        1 => any::<usize>(),
        1 => select(vec![usize::MAX, usize::MAX - 1, usize::MAX / 2, 1 << 32]),
    ]
}

proptest! {
    #![proptest_config(config(CASES))]

    /// Small layouts: every map checked exhaustively.
    #[test]
    fn small_layouts_are_bijections(layers in vec(1usize..=5, 1..=5), mb in 1usize..=5) {
        let layout = Layout::new(layers.clone(), mb).unwrap();
        check_small_layout(&layout, &layers, mb);
    }

    /// Any layout, huge ones included: `new` accepts exactly the rules; arbitrary queries
    /// never panic and agree with each other.
    #[test]
    fn any_layout_and_queries(
        layers in vec(layer_count(), 0..=5),
        mb in prop_oneof![4 => 0usize..=5, 1 => any::<usize>()],
        (chunk, microbatch, layer, index) in (query(), query(), query(), query()),
    ) {
        let got = Layout::new(layers.clone(), mb);
        prop_assert_eq!(got.is_ok(), layout_valid(&layers, mb), "{:?} x {}: {:?}", layers, mb, got);
        match got {
            Ok(layout) => {
                check_queries(&layout, chunk, microbatch, layer, index);
                // Queries near the layout's own edges.
                let total = layout.total_graphs();
                for i in [0, total / 2, total - 1, total, index % total] {
                    check_queries(&layout, chunk % layers.len(), microbatch % mb, layer, i);
                }
            }
            Err(e) => {
                let msg = e.to_string();
                match e {
                    ScheduleError::EmptyLayout { num_chunks, num_microbatches } => {
                        prop_assert!(layers.is_empty() || mb == 0);
                        prop_assert_eq!((num_chunks, num_microbatches), (layers.len(), mb));
                        let named =
                            format!("got {num_chunks} chunk(s) and {num_microbatches} microbatch(es)");
                        prop_assert!(msg.contains(&named), "{}", msg);
                    }
                    e => check_layout_err(&e, &layers),
                }
            }
        }
    }
}
