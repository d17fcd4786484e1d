//! Pipeline schedules: the order in which the forward, backward and weight-gradient passes of
//! each (chunk, microbatch) run, validated up front.
//!
//! The input is the reference's `_order`: a list of 1-based chunk ids, `k` for the forward of
//! chunk `k`'s next microbatch, `-k` for its backward, and (when the weight gradient is a
//! separate pass) `-k - 0.5` for its weight gradient. The `n`-th `k` is microbatch `n - 1` of
//! chunk `k`; likewise for `-k` and `-k - 0.5`. Everything after parsing is 0-based: the
//! order's chunk `1` is [`Step`]'s chunk `0`.

use std::collections::BTreeSet;
use std::fmt;

use crate::layout::Layout;

/// One entry of a schedule order, with its 1-based chunk id as written in the order.
///
/// Converts from the reference's integers (`k` → `Forward(k)`, `-k` → `Backward(k)`) with
/// `From<i64>`, and from its floats (`-k - 0.5` → `WeightGrad(k)`) with
/// [`from_f64`](Self::from_f64). Displays as the reference writes it: `2`, `-2`, `-2.5`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OrderEntry {
    /// `k`: the forward of chunk `k`'s next microbatch.
    Forward(u64),
    /// `-k`: the backward (input gradient, and the weight gradient unless it is split off)
    /// of chunk `k`'s next microbatch.
    Backward(u64),
    /// `-k - 0.5`: the separate weight-gradient pass of chunk `k`'s next microbatch.
    WeightGrad(u64),
}

impl OrderEntry {
    /// The 1-based chunk id as written in the order (0 only for an invalid entry).
    pub fn chunk_id(self) -> u64 {
        match self {
            OrderEntry::Forward(k) | OrderEntry::Backward(k) | OrderEntry::WeightGrad(k) => k,
        }
    }

    /// The pass this entry runs.
    pub fn pass(self) -> Pass {
        match self {
            OrderEntry::Forward(_) => Pass::Forward,
            OrderEntry::Backward(_) => Pass::Backward,
            OrderEntry::WeightGrad(_) => Pass::WeightGrad,
        }
    }

    /// Parses the reference's float encoding: an integer `k` or `-k`, or `-k - 0.5` for a
    /// weight-gradient entry. `None` for anything else (NaN, infinities, other fractions,
    /// magnitudes beyond 2^53 where floats stop being exact integers).
    pub fn from_f64(value: f64) -> Option<OrderEntry> {
        const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
        if !value.is_finite() || value.abs() > EXACT {
            return None;
        }
        if value.fract() == 0.0 {
            // Exact: |value| <= 2^53 fits an i64 and is an integer.
            Some(OrderEntry::from(value as i64))
        } else if value < 0.0 && value.fract() == -0.5 {
            // -k - 0.5: -value = k + 0.5, whose integer part is k.
            Some(OrderEntry::WeightGrad((-value).trunc() as u64))
        } else {
            None
        }
    }
}

impl From<i64> for OrderEntry {
    /// `k > 0` → `Forward(k)`, `k < 0` → `Backward(-k)`; `0` becomes `Forward(0)`, which a
    /// schedule rejects.
    fn from(value: i64) -> OrderEntry {
        if value < 0 {
            OrderEntry::Backward(value.unsigned_abs())
        } else {
            OrderEntry::Forward(value.unsigned_abs())
        }
    }
}

impl fmt::Display for OrderEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OrderEntry::Forward(k) => write!(f, "{k}"),
            OrderEntry::Backward(k) => write!(f, "-{k}"),
            OrderEntry::WeightGrad(k) => write!(f, "-{k}.5"),
        }
    }
}

/// Which pass a step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    /// The forward pass.
    Forward,
    /// The backward pass: input gradients, and weight gradients unless split off.
    Backward,
    /// The separate weight-gradient pass.
    WeightGrad,
}

/// One step of a schedule: a pass of one (chunk, microbatch), both 0-based.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// The forward pass of (`chunk`, `microbatch`).
    Forward {
        /// The model chunk (0-based).
        chunk: usize,
        /// The microbatch of that chunk (0-based).
        microbatch: usize,
    },
    /// The backward pass of (`chunk`, `microbatch`).
    Backward {
        /// The model chunk (0-based).
        chunk: usize,
        /// The microbatch of that chunk (0-based).
        microbatch: usize,
    },
    /// The separate weight-gradient pass of (`chunk`, `microbatch`).
    WeightGrad {
        /// The model chunk (0-based).
        chunk: usize,
        /// The microbatch of that chunk (0-based).
        microbatch: usize,
    },
}

impl Step {
    /// The step of `pass` for (`chunk`, `microbatch`).
    pub fn new(pass: Pass, chunk: usize, microbatch: usize) -> Step {
        match pass {
            Pass::Forward => Step::Forward { chunk, microbatch },
            Pass::Backward => Step::Backward { chunk, microbatch },
            Pass::WeightGrad => Step::WeightGrad { chunk, microbatch },
        }
    }

    /// The pass this step runs.
    pub fn pass(self) -> Pass {
        match self {
            Step::Forward { .. } => Pass::Forward,
            Step::Backward { .. } => Pass::Backward,
            Step::WeightGrad { .. } => Pass::WeightGrad,
        }
    }

    /// The model chunk (0-based).
    pub fn chunk(self) -> usize {
        match self {
            Step::Forward { chunk, .. }
            | Step::Backward { chunk, .. }
            | Step::WeightGrad { chunk, .. } => chunk,
        }
    }

    /// The microbatch (0-based).
    pub fn microbatch(self) -> usize {
        match self {
            Step::Forward { microbatch, .. }
            | Step::Backward { microbatch, .. }
            | Step::WeightGrad { microbatch, .. } => microbatch,
        }
    }

    /// Whether this is the chunk's first microbatch, the one on which FP8 weights are cast.
    pub fn is_first_microbatch(self) -> bool {
        self.microbatch() == 0
    }

    /// The order entry that produces this step (1-based chunk id).
    pub fn entry(self) -> OrderEntry {
        // usize -> u64 is lossless on every supported target.
        let k = self.chunk() as u64 + 1;
        match self.pass() {
            Pass::Forward => OrderEntry::Forward(k),
            Pass::Backward => OrderEntry::Backward(k),
            Pass::WeightGrad => OrderEntry::WeightGrad(k),
        }
    }
}

/// One graph of a step: what warmup runs and capture records, in this order.
///
/// A forward step runs its chunk's layers first to last; backward and weight-gradient steps
/// run them last to first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayerStep {
    /// The position of the step in the order (and in [`Schedule::steps`]).
    pub position: usize,
    /// The step.
    pub step: Step,
    /// The layer within the step's chunk (0-based).
    pub layer: usize,
    /// The graph's index in the list of graphs of its pass ([`Layout::index`]).
    pub graph: usize,
    /// The callable (and parameters) the graph runs ([`Layout::callable_index`]).
    pub callable: usize,
}

/// Why a schedule or layout was rejected.
///
/// Positions are 0-based indices into the order as given; entries and `chunk_id`s are shown
/// as written there (1-based, `-k` for backward, `-k.5` for weight gradient). `chunk` in
/// [`ZeroLayers`](Self::ZeroLayers) is 0-based, an index into `layers_per_chunk`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// The order has no entries.
    #[error(
        "the schedule order is empty: it needs a forward (k) and a backward (-k) entry for \
         every microbatch of every chunk k"
    )]
    Empty,
    /// An entry names chunk 0.
    #[error(
        "order[{position}] = {entry} names chunk 0, but chunk ids are 1-based: k is the \
         forward and -k the backward of chunk k"
    )]
    ZeroChunk {
        /// Index into the order.
        position: usize,
        /// The entry there.
        entry: OrderEntry,
    },
    /// A float entry is neither an integer nor `-k - 0.5`.
    #[error(
        "order[{position}] = {value} is not a schedule entry: use an integer k (forward) or \
         -k (backward), or -k - 0.5 (weight gradient) for chunk k"
    )]
    InvalidValue {
        /// Index into the order.
        position: usize,
        /// The value there.
        value: f64,
    },
    /// A backward or weight-gradient entry names a chunk larger than every forward entry.
    #[error(
        "order[{position}] = {entry} names chunk {}, but the largest forward entry is \
         {num_chunks}, which makes {num_chunks} chunk(s): every chunk needs forward entries",
        entry.chunk_id()
    )]
    ChunkOutOfRange {
        /// Index into the order.
        position: usize,
        /// The entry there.
        entry: OrderEntry,
        /// The number of chunks: the largest forward chunk id (0 if there is none).
        num_chunks: u64,
    },
    /// A chunk id between 1 and the largest never appears.
    #[error(
        "chunk {chunk_id} never appears in the order, but order[{position}] = {entry} makes \
         {num_chunks} chunks: use chunk ids 1..={num_chunks} with none left out"
    )]
    ChunkMissing {
        /// The missing chunk id (1-based).
        chunk_id: u64,
        /// Index of the first entry with the largest chunk id.
        position: usize,
        /// The entry there.
        entry: OrderEntry,
        /// The number of chunks the largest id implies.
        num_chunks: u64,
    },
    /// Chunks appear unequally often (counting forward and backward entries).
    #[error(
        "order[{position}] = {entry} is entry {count} of chunk {}, but chunk {other_chunk_id} \
         appears only {other_count} times: every chunk needs the same number of entries, a \
         forward and a backward per microbatch",
        entry.chunk_id()
    )]
    UnequalCounts {
        /// Index of the first entry of the more frequent chunk beyond `other_count`.
        position: usize,
        /// The entry there.
        entry: OrderEntry,
        /// Which entry of its chunk it is (1-based, forward and backward entries counted).
        count: usize,
        /// A chunk that appears least often (1-based).
        other_chunk_id: u64,
        /// How often that chunk appears.
        other_count: usize,
    },
    /// The forward and backward entries do not divide into `2 * num_chunks` equal parts.
    #[error(
        "the order has {len} forward/backward entries for {num_chunks} chunk(s), not a \
         multiple of 2 x {num_chunks}: every microbatch of every chunk needs one forward and \
         one backward (the order ends at order[{position}] = {entry})"
    )]
    Indivisible {
        /// Index of the last forward or backward entry.
        position: usize,
        /// The entry there.
        entry: OrderEntry,
        /// The number of forward and backward entries.
        len: usize,
        /// The number of chunks.
        num_chunks: usize,
    },
    /// A chunk has more forward entries than there are microbatches.
    #[error(
        "order[{position}] = {entry} is forward {} of chunk {}, but there are only \
         {num_microbatches} microbatch(es) per chunk (entries / chunks / 2): the chunk has \
         more forwards than backwards",
        num_microbatches + 1,
        entry.chunk_id()
    )]
    TooManyForwards {
        /// Index into the order.
        position: usize,
        /// The entry there.
        entry: OrderEntry,
        /// The number of microbatches.
        num_microbatches: usize,
    },
    /// A backward entry comes before the forward of its microbatch.
    #[error(
        "order[{position}] = {entry} is the backward of microbatch {microbatch} of chunk {}, \
         but that microbatch's forward has not run yet: move it after forward {} of chunk {}",
        entry.chunk_id(),
        microbatch + 1,
        entry.chunk_id()
    )]
    BackwardBeforeForward {
        /// Index into the order.
        position: usize,
        /// The entry there.
        entry: OrderEntry,
        /// The microbatch (0-based) it would be the backward of.
        microbatch: usize,
    },
    /// A weight-gradient entry comes before the backward of its microbatch.
    #[error(
        "order[{position}] = {entry} is the weight gradient of microbatch {microbatch} of \
         chunk {}, but that microbatch's backward has not run yet: move it after backward {} \
         of chunk {}",
        entry.chunk_id(),
        microbatch + 1,
        entry.chunk_id()
    )]
    WeightGradBeforeBackward {
        /// Index into the order.
        position: usize,
        /// The entry there.
        entry: OrderEntry,
        /// The microbatch (0-based) it would be the weight gradient of.
        microbatch: usize,
    },
    /// A chunk has more weight-gradient entries than microbatches.
    #[error(
        "order[{position}] = {entry} is weight gradient {} of chunk {}, but there are only \
         {num_microbatches} microbatch(es) per chunk",
        num_microbatches + 1,
        entry.chunk_id()
    )]
    TooManyWeightGrads {
        /// Index into the order.
        position: usize,
        /// The entry there.
        entry: OrderEntry,
        /// The number of microbatches.
        num_microbatches: usize,
    },
    /// The order splits off weight gradients, but some backward has none.
    #[error(
        "order[{position}] = {entry}, the backward of microbatch {microbatch} of chunk {}, \
         has no weight-gradient entry (-{}.5) after it: once the order has weight-gradient \
         entries, every backward needs one",
        entry.chunk_id(),
        entry.chunk_id()
    )]
    MissingWeightGrad {
        /// Index of the backward entry.
        position: usize,
        /// The backward entry.
        entry: OrderEntry,
        /// Its microbatch (0-based).
        microbatch: usize,
    },
    /// `layers_per_chunk` does not have one entry per chunk.
    #[error(
        "layers_per_chunk has {layers_len} entries, but the order has {num_chunks} chunk(s) \
         (its largest forward entry, order[{position}] = {entry}): give one layer count per \
         chunk"
    )]
    LayersPerChunkLength {
        /// `layers_per_chunk.len()`.
        layers_len: usize,
        /// The number of chunks of the order.
        num_chunks: usize,
        /// Index of the first entry with the largest chunk id.
        position: usize,
        /// The entry there.
        entry: OrderEntry,
    },
    /// A chunk has no layers.
    #[error(
        "layers_per_chunk[{chunk}] is 0 (chunk {}): every chunk needs at least one layer",
        chunk + 1
    )]
    ZeroLayers {
        /// Index into `layers_per_chunk` (0-based chunk).
        chunk: usize,
    },
    /// A layout with no chunks or no microbatches.
    #[error(
        "a layout needs at least one chunk and one microbatch; got {num_chunks} chunk(s) and \
         {num_microbatches} microbatch(es)"
    )]
    EmptyLayout {
        /// The number of chunks asked for.
        num_chunks: usize,
        /// The number of microbatches asked for.
        num_microbatches: usize,
    },
    /// More graphs than `usize` can count.
    #[error(
        "layers_per_chunk adds up to {total_layers} layers, which x {num_microbatches} \
         microbatch(es) is more graphs than fit in usize"
    )]
    TooManyGraphs {
        /// The sum of `layers_per_chunk`, exact (it may itself exceed `usize`).
        total_layers: u128,
        /// The number of microbatches.
        num_microbatches: usize,
    },
}

/// A validated pipeline schedule: the steps in execution order and the [`Layout`] of their
/// graphs.
///
/// ```
/// use graphed_callables::{Schedule, Step};
/// // 2 chunks x 3 microbatches (an interleaved pipeline), 2 and 3 layers.
/// let s = Schedule::new(&[1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1], vec![2, 3])?;
/// assert_eq!((s.num_chunks(), s.num_microbatches()), (2, 3));
/// assert_eq!(s.steps()[4], Step::Backward { chunk: 1, microbatch: 0 });
/// assert_eq!(s.layout().total_graphs(), 15);
///
/// // A backward before its forward is rejected, naming the position.
/// let err = Schedule::new(&[1, -1, -1, 1], vec![1]).unwrap_err();
/// assert!(err.to_string().starts_with("order[2] = -1 is the backward of microbatch 1"));
/// # Ok::<(), graphed_callables::ScheduleError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    steps: Vec<Step>,
    layout: Layout,
    split_weight_grad: bool,
}

impl Schedule {
    /// Parses and validates the reference's integer order (`k` forward, `-k` backward of
    /// 1-based chunk `k`) for chunks with `layers_per_chunk[m]` layers each.
    pub fn new(order: &[i64], layers_per_chunk: Vec<usize>) -> Result<Schedule, ScheduleError> {
        let entries: Vec<OrderEntry> = order.iter().map(|&v| OrderEntry::from(v)).collect();
        Schedule::from_entries(&entries, layers_per_chunk)
    }

    /// Parses and validates the reference's float order, in which `-k - 0.5` is the
    /// separate weight-gradient pass of chunk `k` (see [`OrderEntry::from_f64`]).
    pub fn from_f64(
        order: &[f64],
        layers_per_chunk: Vec<usize>,
    ) -> Result<Schedule, ScheduleError> {
        let entries = order
            .iter()
            .enumerate()
            .map(|(position, &value)| {
                OrderEntry::from_f64(value).ok_or(ScheduleError::InvalidValue { position, value })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Schedule::from_entries(&entries, layers_per_chunk)
    }

    /// Validates an order of typed entries.
    ///
    /// The number of chunks is the largest forward chunk id; the number of microbatches is
    /// the number of forward and backward entries / chunks / 2. Weight-gradient entries are
    /// all or nothing: if there is one, every backward needs one after it.
    pub fn from_entries(
        order: &[OrderEntry],
        layers_per_chunk: Vec<usize>,
    ) -> Result<Schedule, ScheduleError> {
        if order.is_empty() {
            return Err(ScheduleError::Empty);
        }
        if let Some((position, &entry)) = order.iter().enumerate().find(|(_, e)| e.chunk_id() == 0)
        {
            return Err(ScheduleError::ZeroChunk { position, entry });
        }

        // The number of chunks: the largest forward id, and where it first appears.
        let mut max: Option<(usize, u64)> = None;
        for (p, e) in order.iter().enumerate() {
            if let OrderEntry::Forward(k) = *e {
                if max.is_none_or(|(_, m)| k > m) {
                    max = Some((p, k));
                }
            }
        }
        let max_id = max.map_or(0, |(_, k)| k);
        if let Some((position, &entry)) = order
            .iter()
            .enumerate()
            .find(|(_, e)| e.chunk_id() > max_id)
        {
            return Err(ScheduleError::ChunkOutOfRange {
                position,
                entry,
                num_chunks: max_id,
            });
        }
        // Every entry is in 1..=max_id now, so there is at least one forward.
        let Some((max_pos, _)) = max else {
            // Unreachable: with no forward, max_id is 0 and every entry was out of range.
            return Err(ScheduleError::Empty);
        };
        let ids: BTreeSet<u64> = order.iter().map(|e| e.chunk_id()).collect();
        if let Some(chunk_id) = (1..=max_id)
            .zip(ids.iter())
            .find(|(k, id)| k != *id)
            .map(|(k, _)| k)
        {
            return Err(ScheduleError::ChunkMissing {
                chunk_id,
                position: max_pos,
                entry: order[max_pos],
                num_chunks: max_id,
            });
        }
        // Ids are exactly 1..=max_id, so num_chunks <= order.len() and fits a usize.
        let num_chunks = ids.len();
        let chunk = |e: OrderEntry| (e.chunk_id() - 1) as usize;

        // Equal counts of forward + backward entries per chunk.
        let mut counts = vec![0usize; num_chunks];
        for e in order.iter().filter(|e| e.pass() != Pass::WeightGrad) {
            counts[chunk(*e)] += 1;
        }
        // counts is non-empty (num_chunks >= 1).
        let min = counts.iter().copied().min().unwrap_or(0);
        if let Some(more) = counts.iter().position(|&c| c > min) {
            let least = counts.iter().position(|&c| c == min).unwrap_or(0);
            let (position, entry) = order
                .iter()
                .enumerate()
                .filter(|(_, e)| e.pass() != Pass::WeightGrad && chunk(**e) == more)
                .nth(min)
                .map(|(p, e)| (p, *e))
                .unwrap_or((max_pos, order[max_pos]));
            return Err(ScheduleError::UnequalCounts {
                position,
                entry,
                count: min + 1,
                other_chunk_id: least as u64 + 1,
                other_count: min,
            });
        }
        if min % 2 != 0 {
            let (position, entry) = order
                .iter()
                .enumerate()
                .rev()
                .find(|(_, e)| e.pass() != Pass::WeightGrad)
                .map(|(p, e)| (p, *e))
                .unwrap_or((max_pos, order[max_pos]));
            return Err(ScheduleError::Indivisible {
                position,
                entry,
                len: min * num_chunks,
                num_chunks,
            });
        }
        let num_microbatches = min / 2;

        // Resolve microbatches in order, checking that each pass follows the one before.
        let mut fwd = vec![0usize; num_chunks];
        let mut bwd = vec![0usize; num_chunks];
        let mut wgrad = vec![0usize; num_chunks];
        // bwd_pos[c * num_microbatches + b]: where the backward of (c, b) is.
        let mut bwd_pos = vec![0usize; num_chunks * num_microbatches];
        let mut steps = Vec::with_capacity(order.len());
        let mut split_weight_grad = false;
        for (position, &entry) in order.iter().enumerate() {
            let c = chunk(entry);
            let step = match entry {
                OrderEntry::Forward(_) => {
                    if fwd[c] == num_microbatches {
                        return Err(ScheduleError::TooManyForwards {
                            position,
                            entry,
                            num_microbatches,
                        });
                    }
                    fwd[c] += 1;
                    Step::Forward {
                        chunk: c,
                        microbatch: fwd[c] - 1,
                    }
                }
                OrderEntry::Backward(_) => {
                    if bwd[c] >= fwd[c] {
                        return Err(ScheduleError::BackwardBeforeForward {
                            position,
                            entry,
                            microbatch: bwd[c],
                        });
                    }
                    bwd_pos[c * num_microbatches + bwd[c]] = position;
                    bwd[c] += 1;
                    Step::Backward {
                        chunk: c,
                        microbatch: bwd[c] - 1,
                    }
                }
                OrderEntry::WeightGrad(_) => {
                    split_weight_grad = true;
                    if wgrad[c] == num_microbatches {
                        return Err(ScheduleError::TooManyWeightGrads {
                            position,
                            entry,
                            num_microbatches,
                        });
                    }
                    if wgrad[c] >= bwd[c] {
                        return Err(ScheduleError::WeightGradBeforeBackward {
                            position,
                            entry,
                            microbatch: wgrad[c],
                        });
                    }
                    wgrad[c] += 1;
                    Step::WeightGrad {
                        chunk: c,
                        microbatch: wgrad[c] - 1,
                    }
                }
            };
            steps.push(step);
        }
        if split_weight_grad {
            // The earliest backward without its weight gradient.
            if let Some((position, microbatch)) = (0..num_chunks)
                .filter(|&c| wgrad[c] < num_microbatches)
                .map(|c| (bwd_pos[c * num_microbatches + wgrad[c]], wgrad[c]))
                .min()
            {
                return Err(ScheduleError::MissingWeightGrad {
                    position,
                    entry: order[position],
                    microbatch,
                });
            }
        }

        if layers_per_chunk.len() != num_chunks {
            return Err(ScheduleError::LayersPerChunkLength {
                layers_len: layers_per_chunk.len(),
                num_chunks,
                position: max_pos,
                entry: order[max_pos],
            });
        }
        let layout = Layout::new(layers_per_chunk, num_microbatches)?;
        Ok(Schedule {
            steps,
            layout,
            split_weight_grad,
        })
    }

    /// The steps in execution order; step `i` comes from the order's entry `i`.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    /// The order this schedule was parsed from, as typed entries.
    pub fn order(&self) -> impl Iterator<Item = OrderEntry> + '_ {
        self.steps.iter().map(|s| s.entry())
    }

    /// The index layout of the graphs and callables.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The number of model chunks.
    pub fn num_chunks(&self) -> usize {
        self.layout.num_chunks()
    }

    /// The number of microbatches of each chunk.
    pub fn num_microbatches(&self) -> usize {
        self.layout.num_microbatches()
    }

    /// The number of layers of each chunk.
    pub fn layers_per_chunk(&self) -> &[usize] {
        self.layout.layers_per_chunk()
    }

    /// Whether the weight gradient is a separate pass (the order has `-k - 0.5` entries).
    pub fn splits_weight_grad(&self) -> bool {
        self.split_weight_grad
    }

    /// Every graph of every step, in the order warmup runs them and capture records them:
    /// steps in schedule order; within a forward step layers first to last, within a
    /// backward or weight-gradient step last to first.
    pub fn layer_steps(&self) -> impl Iterator<Item = LayerStep> + '_ {
        let layout = &self.layout;
        self.steps
            .iter()
            .enumerate()
            .flat_map(move |(position, &step)| {
                // A validated schedule's steps all lie inside its layout, so the unchecked
                // index math below stays in range.
                let m = step.chunk();
                let layers = layout.layers_per_chunk()[m];
                let forward = step.pass() == Pass::Forward;
                (0..layers).map(move |i| {
                    let layer = if forward { i } else { layers - 1 - i };
                    let graph = layout.graph_at(m, step.microbatch(), layer);
                    let callable = layout.callable_at(m, layer);
                    LayerStep {
                        position,
                        step,
                        layer,
                        graph,
                        callable,
                    }
                })
            })
    }

    /// The position in [`steps`](Self::steps) of `step`, or `None` if the schedule has no
    /// such step.
    pub fn position(&self, step: Step) -> Option<usize> {
        self.steps.iter().position(|&s| s == step)
    }
}
