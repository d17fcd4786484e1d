//! Where each graph and each callable sits: the (chunk, microbatch, layer) index math, in
//! one place.
//!
//! Graphs are laid out chunk by chunk; inside a chunk, microbatch by microbatch; inside a
//! microbatch, layer by layer. With `prefix[m]` the number of layers of the chunks before
//! chunk `m`, the forward graph of (chunk `m`, microbatch `b`, layer `l`) has index
//!
//! ```text
//! prefix[m] * num_microbatches + b * layers[m] + l
//! ```
//!
//! and its backward graph has the same index in the list of backward graphs. Callables (and
//! with them parameters) belong to a (chunk, layer) and are shared by the chunk's
//! microbatches: callable `prefix[m] + l`.
//!
//! The (chunk, *layer*, microbatch) order, `prefix[m] * num_microbatches + l *
//! num_microbatches + b`, is a different permutation as soon as a chunk has more than one
//! layer and there is more than one microbatch; pairing per-callable parameters by it hands
//! a graph the parameters of another layer (the bug the reference's MoE change fixed for
//! pipeline schedules). Every index in this crate comes from [`Layout`], so the two can not
//! be mixed.

use std::fmt;
use std::ops::Range;

use crate::schedule::ScheduleError;

/// The position of one graph: chunk, microbatch and layer, all 0-based.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphIndex {
    /// The model chunk (0-based: the order's `+1` is chunk 0).
    pub chunk: usize,
    /// The microbatch of that chunk (0-based).
    pub microbatch: usize,
    /// The layer within the chunk (0-based).
    pub layer: usize,
}

impl fmt::Display for GraphIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "(chunk {}, microbatch {}, layer {})",
            self.chunk, self.microbatch, self.layer
        )
    }
}

/// The index layout of graphs and callables for a number of chunks (each with its own
/// number of layers) and microbatches.
///
/// ```
/// use graphed_callables::{GraphIndex, Layout};
/// // Two chunks with 2 and 3 layers, 3 microbatches each.
/// let layout = Layout::new(vec![2, 3], 3)?;
/// assert_eq!(layout.total_graphs(), 15);
/// assert_eq!(layout.index(1, 2, 0), Some(12)); // 2 * 3 + 2 * 3 + 0
/// assert_eq!(
///     layout.locate(12),
///     Some(GraphIndex { chunk: 1, microbatch: 2, layer: 0 })
/// );
/// assert_eq!(layout.callable_index(1, 0), Some(2));
/// # Ok::<(), graphed_callables::ScheduleError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    layers_per_chunk: Vec<usize>,
    /// `prefix[m]`: layers of the chunks before `m`; one extra entry holds the total.
    prefix: Vec<usize>,
    num_microbatches: usize,
}

impl Layout {
    /// A layout of `layers_per_chunk.len()` chunks, chunk `m` having `layers_per_chunk[m]`
    /// layers, each run for `num_microbatches` microbatches.
    ///
    /// Errors: no chunks or no microbatches ([`ScheduleError::EmptyLayout`]), a chunk
    /// with no layers ([`ScheduleError::ZeroLayers`]), or more graphs than `usize` counts
    /// ([`ScheduleError::TooManyGraphs`]).
    pub fn new(
        layers_per_chunk: Vec<usize>,
        num_microbatches: usize,
    ) -> Result<Layout, ScheduleError> {
        if layers_per_chunk.is_empty() || num_microbatches == 0 {
            return Err(ScheduleError::EmptyLayout {
                num_chunks: layers_per_chunk.len(),
                num_microbatches,
            });
        }
        if let Some(chunk) = layers_per_chunk.iter().position(|&layers| layers == 0) {
            return Err(ScheduleError::ZeroLayers { chunk });
        }
        // Exact: fewer than 2^64 terms, each below 2^64.
        let total_layers: u128 = layers_per_chunk.iter().map(|&layers| layers as u128).sum();
        let too_many = || ScheduleError::TooManyGraphs {
            total_layers,
            num_microbatches,
        };
        let total = usize::try_from(total_layers).map_err(|_| too_many())?;
        // Every index is below total * num_microbatches, so checking it once makes the
        // arithmetic of `index` and `locate` overflow-free.
        total.checked_mul(num_microbatches).ok_or_else(too_many)?;
        let mut prefix = Vec::with_capacity(layers_per_chunk.len() + 1);
        let mut sum = 0;
        for &layers in &layers_per_chunk {
            prefix.push(sum);
            // No overflow: every partial sum is at most `total`.
            sum += layers;
        }
        prefix.push(sum);
        Ok(Layout {
            layers_per_chunk,
            prefix,
            num_microbatches,
        })
    }

    /// The number of model chunks.
    pub fn num_chunks(&self) -> usize {
        self.layers_per_chunk.len()
    }

    /// The number of microbatches of every chunk.
    pub fn num_microbatches(&self) -> usize {
        self.num_microbatches
    }

    /// The number of layers of each chunk.
    pub fn layers_per_chunk(&self) -> &[usize] {
        &self.layers_per_chunk
    }

    /// The number of layers of `chunk`, or `None` if there is no such chunk.
    pub fn layers(&self, chunk: usize) -> Option<usize> {
        self.layers_per_chunk.get(chunk).copied()
    }

    /// The number of callables: one per (chunk, layer), the sum of the layers per chunk.
    pub fn total_callables(&self) -> usize {
        self.prefix[self.num_chunks()]
    }

    /// The number of forward graphs (and of backward graphs): one per (chunk, microbatch,
    /// layer).
    pub fn total_graphs(&self) -> usize {
        self.total_callables() * self.num_microbatches
    }

    /// The index of the graph of (`chunk`, `microbatch`, `layer`):
    /// `prefix[chunk] * num_microbatches + microbatch * layers[chunk] + layer`. `None` if
    /// any of the three is out of range.
    pub fn index(&self, chunk: usize, microbatch: usize, layer: usize) -> Option<usize> {
        let layers = self.layers(chunk)?;
        if microbatch >= self.num_microbatches || layer >= layers {
            return None;
        }
        Some(self.graph_at(chunk, microbatch, layer))
    }

    /// [`index`](Self::index) for arguments known to be in range (a validated schedule's
    /// steps). No overflow: the result is below `total_graphs()`, checked in `new`.
    pub(crate) fn graph_at(&self, chunk: usize, microbatch: usize, layer: usize) -> usize {
        self.prefix[chunk] * self.num_microbatches
            + microbatch * self.layers_per_chunk[chunk]
            + layer
    }

    /// The index of `at`'s graph; see [`index`](Self::index).
    pub fn index_of(&self, at: GraphIndex) -> Option<usize> {
        self.index(at.chunk, at.microbatch, at.layer)
    }

    /// The inverse of [`index`](Self::index): the (chunk, microbatch, layer) of graph
    /// `index`, or `None` if `index >= total_graphs()`.
    pub fn locate(&self, index: usize) -> Option<GraphIndex> {
        if index >= self.total_graphs() {
            return None;
        }
        // The chunk is the last one whose first graph is at or before `index`; chunk starts
        // are increasing because every chunk has at least one layer.
        let chunk = self.prefix[..self.num_chunks()]
            .partition_point(|&p| p * self.num_microbatches <= index)
            - 1;
        let offset = index - self.prefix[chunk] * self.num_microbatches;
        let layers = self.layers_per_chunk[chunk];
        Some(GraphIndex {
            chunk,
            microbatch: offset / layers,
            layer: offset % layers,
        })
    }

    /// The index of the callable of (`chunk`, `layer`), shared by all the chunk's
    /// microbatches: `prefix[chunk] + layer`. `None` if out of range.
    pub fn callable_index(&self, chunk: usize, layer: usize) -> Option<usize> {
        if layer >= self.layers(chunk)? {
            return None;
        }
        Some(self.callable_at(chunk, layer))
    }

    /// [`callable_index`](Self::callable_index) for arguments known to be in range.
    pub(crate) fn callable_at(&self, chunk: usize, layer: usize) -> usize {
        self.prefix[chunk] + layer
    }

    /// The callable that graph `index` runs (its parameters are that callable's), or
    /// `None` if `index >= total_graphs()`.
    pub fn callable_of_graph(&self, index: usize) -> Option<usize> {
        let at = self.locate(index)?;
        self.callable_index(at.chunk, at.layer)
    }

    /// The graph indices of (`chunk`, `microbatch`), layer 0 first: a contiguous range.
    /// `None` if out of range.
    pub fn microbatch_graphs(&self, chunk: usize, microbatch: usize) -> Option<Range<usize>> {
        let start = self.index(chunk, microbatch, 0)?;
        Some(start..start + self.layers_per_chunk[chunk])
    }

    /// The indices of `chunk`'s callables, a contiguous range. `None` if out of range.
    pub fn chunk_callables(&self, chunk: usize) -> Option<Range<usize>> {
        let layers = self.layers(chunk)?;
        Some(self.prefix[chunk]..self.prefix[chunk] + layers)
    }

    /// Whether callable `callable` is the first layer of its chunk: the one whose inputs
    /// come from outside (sample inputs and replay inputs go there; later layers read their
    /// predecessor's outputs). `false` out of range.
    ///
    /// ```
    /// use graphed_callables::Layout;
    /// let layout = Layout::new(vec![2, 3], 4)?;
    /// let firsts: Vec<usize> =
    ///     (0..layout.total_callables()).filter(|&c| layout.is_chunk_input(c)).collect();
    /// assert_eq!(firsts, [0, 2]);
    /// # Ok::<(), graphed_callables::ScheduleError>(())
    /// ```
    pub fn is_chunk_input(&self, callable: usize) -> bool {
        callable < self.total_callables() && self.prefix[..self.num_chunks()].contains(&callable)
    }

    /// Every graph position, in index order: position `i` of the iterator is graph `i`.
    pub fn iter(&self) -> impl Iterator<Item = GraphIndex> + '_ {
        let mb = self.num_microbatches;
        self.layers_per_chunk
            .iter()
            .enumerate()
            .flat_map(move |(chunk, &layers)| {
                (0..mb).flat_map(move |microbatch| {
                    (0..layers).map(move |layer| GraphIndex {
                        chunk,
                        microbatch,
                        layer,
                    })
                })
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gi(chunk: usize, microbatch: usize, layer: usize) -> GraphIndex {
        GraphIndex {
            chunk,
            microbatch,
            layer,
        }
    }

    /// The (chunk, layer, microbatch) order, which the reference used for per-callable
    /// parameters before its MoE change.
    fn chunk_layer_microbatch(layout: &Layout, at: GraphIndex) -> usize {
        layout.prefix[at.chunk] * layout.num_microbatches
            + at.layer * layout.num_microbatches
            + at.microbatch
    }

    const CONFIGS: &[&[usize]] = &[
        &[1],
        &[4],
        &[2, 3],
        &[3, 2],
        &[1, 1, 1],
        &[1, 5, 2],
        &[7, 1, 3, 2],
    ];

    #[test]
    fn index_is_a_bijection_onto_0_total() {
        for &layers in CONFIGS {
            for mb in 1..=5 {
                let layout = Layout::new(layers.to_vec(), mb).unwrap();
                let total = layout.total_graphs();
                assert_eq!(total, layers.iter().sum::<usize>() * mb);
                let mut seen = vec![false; total];
                for (m, &l_m) in layers.iter().enumerate() {
                    for b in 0..mb {
                        for l in 0..l_m {
                            let i = layout.index(m, b, l).unwrap_or_else(|| {
                                panic!("{layers:?} x {mb}: ({m},{b},{l}) has no index")
                            });
                            assert!(i < total, "{layers:?} x {mb}: index {i} >= {total}");
                            assert!(!seen[i], "{layers:?} x {mb}: index {i} hit twice");
                            seen[i] = true;
                            assert_eq!(layout.locate(i), Some(gi(m, b, l)));
                        }
                    }
                }
                assert!(seen.iter().all(|&s| s));
                assert_eq!(layout.locate(total), None);
                let listed: Vec<_> = layout.iter().collect();
                assert_eq!(listed.len(), total);
                for (i, at) in listed.into_iter().enumerate() {
                    assert_eq!(layout.index_of(at), Some(i));
                }
            }
        }
    }

    #[test]
    fn out_of_range_is_none() {
        let layout = Layout::new(vec![2, 3], 3).unwrap();
        assert_eq!(layout.index(2, 0, 0), None);
        assert_eq!(layout.index(0, 3, 0), None);
        assert_eq!(layout.index(0, 0, 2), None);
        assert_eq!(layout.index(1, 0, 2), Some(8));
        assert_eq!(layout.callable_index(0, 2), None);
        assert_eq!(layout.callable_index(2, 0), None);
        assert_eq!(layout.microbatch_graphs(0, 3), None);
        assert_eq!(layout.chunk_callables(2), None);
        assert_eq!(layout.callable_of_graph(15), None);
    }

    #[test]
    fn two_chunks_three_microbatches_layers_2_3_by_hand() {
        let layout = Layout::new(vec![2, 3], 3).unwrap();
        assert_eq!(layout.num_chunks(), 2);
        assert_eq!(layout.total_callables(), 5);
        assert_eq!(layout.total_graphs(), 15);
        // Chunk 0: prefix 0, 2 layers: index = b * 2 + l.
        // Chunk 1: prefix 2, 3 layers: index = 2 * 3 + b * 3 + l = 6 + 3b + l.
        let expected = [
            ((0, 0, 0), 0),
            ((0, 0, 1), 1),
            ((0, 1, 0), 2),
            ((0, 1, 1), 3),
            ((0, 2, 0), 4),
            ((0, 2, 1), 5),
            ((1, 0, 0), 6),
            ((1, 0, 1), 7),
            ((1, 0, 2), 8),
            ((1, 1, 0), 9),
            ((1, 1, 1), 10),
            ((1, 1, 2), 11),
            ((1, 2, 0), 12),
            ((1, 2, 1), 13),
            ((1, 2, 2), 14),
        ];
        for ((m, b, l), i) in expected {
            assert_eq!(layout.index(m, b, l), Some(i), "({m},{b},{l})");
            assert_eq!(layout.locate(i), Some(gi(m, b, l)), "{i}");
        }
        let callables: Vec<_> = (0..15)
            .map(|i| layout.callable_of_graph(i).unwrap())
            .collect();
        assert_eq!(callables, [0, 1, 0, 1, 0, 1, 2, 3, 4, 2, 3, 4, 2, 3, 4]);
        assert_eq!(layout.callable_index(1, 2), Some(4));
        assert_eq!(layout.microbatch_graphs(1, 1), Some(9..12));
        assert_eq!(layout.chunk_callables(1), Some(2..5));
    }

    /// Pairing per-callable parameters by the (chunk, layer, microbatch) order gives graph
    /// `i` the parameters of another layer whenever a chunk has more than one layer and
    /// there is more than one microbatch; the two orders agree only when every chunk has a
    /// single layer or there is a single microbatch. With 2 chunks x 3 microbatches and
    /// layers [2, 3], graph 1 (chunk 0, microbatch 0, layer 1) would get layer 0's
    /// parameters.
    #[test]
    fn chunk_layer_microbatch_order_pairs_the_wrong_parameters() {
        let layout = Layout::new(vec![2, 3], 3).unwrap();
        // Params per graph as the wrong order lays them out: slot j holds the parameters
        // of the callable the wrong order puts at j.
        let mut wrong = vec![usize::MAX; layout.total_graphs()];
        for at in layout.iter() {
            wrong[chunk_layer_microbatch(&layout, at)] =
                layout.callable_index(at.chunk, at.layer).unwrap();
        }
        assert_eq!(wrong, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]);
        assert_eq!(layout.callable_of_graph(1), Some(1));
        assert_eq!(
            wrong[1], 0,
            "graph 1 runs layer 1 but would get layer 0's params"
        );
        let mispaired = (0..layout.total_graphs())
            .filter(|&i| layout.callable_of_graph(i) != Some(wrong[i]))
            .count();
        assert_eq!(mispaired, 8);

        for &layers in CONFIGS {
            for mb in 1..=4 {
                let layout = Layout::new(layers.to_vec(), mb).unwrap();
                let disagree = layout
                    .iter()
                    .any(|at| layout.index_of(at) != Some(chunk_layer_microbatch(&layout, at)));
                let expect = mb > 1 && layers.iter().any(|&l| l > 1);
                assert_eq!(disagree, expect, "{layers:?} x {mb}");
                // Both orders keep each chunk's graphs in the chunk's own block.
                for at in layout.iter() {
                    let w = chunk_layer_microbatch(&layout, at);
                    assert_eq!(layout.locate(w).unwrap().chunk, at.chunk);
                }
            }
        }
    }

    #[test]
    fn bad_layouts_are_rejected() {
        assert_eq!(
            Layout::new(vec![], 3),
            Err(ScheduleError::EmptyLayout {
                num_chunks: 0,
                num_microbatches: 3
            })
        );
        assert_eq!(
            Layout::new(vec![2], 0),
            Err(ScheduleError::EmptyLayout {
                num_chunks: 1,
                num_microbatches: 0
            })
        );
        assert_eq!(
            Layout::new(vec![2, 0, 1], 3),
            Err(ScheduleError::ZeroLayers { chunk: 1 })
        );
        let e = Layout::new(vec![usize::MAX, 1], 1).unwrap_err();
        assert_eq!(
            e,
            ScheduleError::TooManyGraphs {
                total_layers: 1 << 64,
                num_microbatches: 1
            }
        );
        assert_eq!(
            e.to_string(),
            "layers_per_chunk adds up to 18446744073709551616 layers, which x 1 microbatch(es) \
             is more graphs than fit in usize"
        );
        assert_eq!(
            Layout::new(vec![usize::MAX / 2], 3),
            Err(ScheduleError::TooManyGraphs {
                total_layers: (usize::MAX / 2) as u128,
                num_microbatches: 3
            })
        );
        // A chunk without layers is named even where the others overflow.
        assert_eq!(
            Layout::new(vec![usize::MAX, usize::MAX, 0], 1),
            Err(ScheduleError::ZeroLayers { chunk: 2 })
        );
    }
}
