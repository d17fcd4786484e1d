//! The static buffers of the graphs: which buffer each (chunk, microbatch, layer) reads and
//! writes, how consecutive layers share them, and their allocation from the graph pool.
//!
//! Every graph has its own static inputs, outputs, output gradients, input gradients and
//! saved activations, except where layers chain: within a (chunk, microbatch), layer
//! `l + 1`'s inputs *are* layer `l`'s outputs (the same allocations) and, in reverse, layer
//! `l`'s output gradients *are* layer `l + 1`'s input gradients. Chaining needs layer
//! `l`'s output lengths to equal layer `l + 1`'s input lengths (count and each length); a
//! chunk whose layers do not chain is rejected at build, since a replay runs all of a
//! chunk's layers and data could not flow between them.
//!
//! By default nothing is shared across microbatches or chunks: the buffers of a microbatch
//! hold its activations from its forward replay until its backward replay, whatever runs in
//! between. With buffer reuse ([`GraphedOptions::reuse_buffers`](crate::GraphedOptions::reuse_buffers))
//! the microbatches of a chunk draw *buffer sets* (every layer's buffers of one microbatch)
//! from a free list as the schedule runs ([`buffer_sets`]): a microbatch's forward takes a
//! free set, its last backward step (the backward, or the weight-gradient step of a split
//! schedule) gives it back. The assignment depends only on the schedule, so every graph
//! still sees fixed addresses; a chunk then needs as many sets as it ever has microbatches
//! in flight (forward done, backward not) instead of one per microbatch.

use std::ops::Range;

use cuda_graph::{DeviceBuffer, DeviceRepr};
use cuda_graph::{Error, Result};
use cuda_graph::{GraphPool, POOL_ALIGN};

use crate::layout::Layout;
use crate::schedule::{Pass, Schedule};

/// The buffer set of each (chunk, microbatch), at `chunk * num_microbatches + microbatch`,
/// numbered from 0 within each chunk: with `reuse`, sets are recycled in schedule order
/// (a forward takes the lowest free set, the microbatch's last backward-side step frees
/// it); without, set = microbatch.
pub(crate) fn buffer_sets(schedule: &Schedule, reuse: bool) -> Vec<usize> {
    let mbs = schedule.num_microbatches();
    let chunks = schedule.num_chunks();
    if !reuse {
        return (0..chunks * mbs).map(|p| p % mbs).collect();
    }
    let last = if schedule.splits_weight_grad() {
        Pass::WeightGrad
    } else {
        Pass::Backward
    };
    let mut sets = vec![0; chunks * mbs];
    let mut free: Vec<Vec<usize>> = vec![Vec::new(); chunks];
    let mut count = vec![0usize; chunks];
    for step in schedule.steps() {
        let (c, pair) = (step.chunk(), step.chunk() * mbs + step.microbatch());
        if step.pass() == Pass::Forward {
            sets[pair] = match free[c].iter().enumerate().min_by_key(|&(_, &s)| s) {
                Some((i, _)) => free[c].swap_remove(i),
                None => {
                    count[c] += 1;
                    count[c] - 1
                }
            };
        } else if step.pass() == last {
            free[c].push(sets[pair]);
        }
    }
    sets
}

/// The buffer lengths one callable declares: inputs and outputs in elements, saved
/// buffers in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Shapes {
    pub(crate) inputs: Vec<usize>,
    pub(crate) outputs: Vec<usize>,
    pub(crate) saved: Vec<usize>,
}

/// The buffers of one graph (forward and backward share it), as indices into the arena.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GraphIo {
    pub(crate) inputs: Vec<usize>,
    pub(crate) outputs: Range<usize>,
    pub(crate) grad_outputs: Vec<usize>,
    pub(crate) grad_inputs: Range<usize>,
    /// Indices into the byte arena.
    pub(crate) saved: Range<usize>,
}

/// Where every static buffer goes: the arena's lengths and each graph's indices into it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BufferPlan {
    /// Element counts of the typed arena (inputs, outputs and their gradients).
    pub(crate) lens: Vec<usize>,
    /// Byte counts of the byte arena (saved buffers).
    pub(crate) saved_bytes: Vec<usize>,
    pub(crate) graphs: Vec<GraphIo>,
}

impl BufferPlan {
    /// Plans the buffers of every graph of `layout`, `shapes[c]` being callable `c`'s;
    /// microbatches of a chunk with the same entry in `sets` ([`buffer_sets`]) share their
    /// buffers.
    pub(crate) fn new(layout: &Layout, shapes: &[Shapes], sets: &[usize]) -> Result<BufferPlan> {
        let pairs = layout.num_chunks() * layout.num_microbatches();
        if sets.len() != pairs {
            return Err(Error::invalid(format!(
                "internal: {} buffer sets for {pairs} (chunk, microbatch) pairs",
                sets.len()
            )));
        }
        if shapes.len() != layout.total_callables() {
            return Err(Error::invalid(format!(
                "{} callables given, the layout has {}",
                shapes.len(),
                layout.total_callables()
            )));
        }
        for chunk in 0..layout.num_chunks() {
            let Some(range) = layout.chunk_callables(chunk) else {
                continue;
            };
            for c in range.start..range.end.saturating_sub(1) {
                if shapes[c].outputs != shapes[c + 1].inputs {
                    return Err(Error::invalid(format!(
                        "chunk {chunk}: layer {} outputs {:?} elements but layer {} takes \
                         {:?}; consecutive layers of a chunk must chain",
                        c - range.start,
                        shapes[c].outputs,
                        c + 1 - range.start,
                        shapes[c + 1].inputs
                    )));
                }
            }
        }
        let mut lens = Vec::new();
        let mut take = |want: &[usize]| {
            let start = lens.len();
            lens.extend_from_slice(want);
            start..lens.len()
        };
        let mut saved_bytes = Vec::new();
        let mut take_saved = |want: &[usize]| {
            let start = saved_bytes.len();
            saved_bytes.extend_from_slice(want);
            start..saved_bytes.len()
        };
        let mut graphs: Vec<Option<GraphIo>> = vec![None; layout.total_graphs()];
        for chunk in 0..layout.num_chunks() {
            let layers = layout.layers_per_chunk()[chunk];
            let mbs = layout.num_microbatches();
            // Each set's buffers, allocated at its first microbatch.
            let mut allocated: Vec<Option<Vec<GraphIo>>> = vec![None; mbs];
            for microbatch in 0..mbs {
                let set = sets[chunk * mbs + microbatch];
                if let Some(Some(ios)) = allocated.get(set) {
                    for (layer, io) in ios.iter().enumerate() {
                        graphs[layout.graph_at(chunk, microbatch, layer)] = Some(io.clone());
                    }
                    continue;
                }
                let mut prev_outputs: Option<Range<usize>> = None;
                let mut ios: Vec<GraphIo> = Vec::with_capacity(layers);
                for layer in 0..layers {
                    let s = &shapes[layout.callable_at(chunk, layer)];
                    let inputs: Vec<usize> = match prev_outputs.take() {
                        Some(r) => r.collect(),
                        None => take(&s.inputs).collect(),
                    };
                    let grad_inputs = take(&s.inputs);
                    let outputs = take(&s.outputs);
                    let saved = take_saved(&s.saved);
                    prev_outputs = Some(outputs.clone());
                    if let Some(prev) = ios.last_mut() {
                        prev.grad_outputs = grad_inputs.clone().collect();
                    }
                    ios.push(GraphIo {
                        inputs,
                        outputs,
                        grad_outputs: Vec::new(),
                        grad_inputs,
                        saved,
                    });
                }
                if let Some(last) = ios.last_mut() {
                    let s = &shapes[layout.callable_at(chunk, layers - 1)];
                    last.grad_outputs = take(&s.outputs).collect();
                }
                for (layer, io) in ios.iter().enumerate() {
                    graphs[layout.graph_at(chunk, microbatch, layer)] = Some(io.clone());
                }
                match allocated.get_mut(set) {
                    Some(slot) => *slot = Some(ios),
                    None => {
                        return Err(Error::invalid(format!(
                            "internal: buffer set {set} of chunk {chunk} out of range"
                        )));
                    }
                }
            }
        }
        let graphs = graphs
            .into_iter()
            .enumerate()
            .map(|(g, io)| {
                io.ok_or_else(|| Error::invalid(format!("internal: graph {g} got no buffers")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(BufferPlan {
            lens,
            saved_bytes,
            graphs,
        })
    }

    /// The pool bytes the arena needs, with [`GraphPool`]'s per-range rounding.
    pub(crate) fn pool_bytes(&self, elem: usize) -> Result<usize> {
        let typed = self.lens.iter().map(|&len| len.checked_mul(elem));
        let bytes = self.saved_bytes.iter().map(|&b| Some(b));
        typed.chain(bytes).try_fold(0usize, |acc, b| {
            b.map(|b| b.max(1).next_multiple_of(POOL_ALIGN))
                .and_then(|b| acc.checked_add(b))
                .ok_or_else(|| Error::invalid("static buffers overflow usize bytes"))
        })
    }
}

/// The allocated static buffers: the plan and its arena.
#[derive(Debug)]
pub(crate) struct StaticBuffers<T: DeviceRepr> {
    pub(crate) plan: BufferPlan,
    pub(crate) arena: Vec<DeviceBuffer<T>>,
    /// The saved buffers, as bytes (each [`POOL_ALIGN`]-aligned: a callable views them as
    /// any element type).
    pub(crate) saved_arena: Vec<DeviceBuffer<u8>>,
}

impl<T: DeviceRepr> StaticBuffers<T> {
    /// Allocates every buffer of `plan` from `pool` (no driver call).
    pub(crate) fn alloc(plan: BufferPlan, pool: &GraphPool) -> Result<StaticBuffers<T>> {
        let arena = plan
            .lens
            .iter()
            .map(|&len| pool.alloc::<T>(len))
            .collect::<Result<Vec<_>>>()?;
        let saved_arena = plan
            .saved_bytes
            .iter()
            .map(|&bytes| pool.alloc::<u8>(bytes))
            .collect::<Result<Vec<_>>>()?;
        Ok(StaticBuffers {
            plan,
            arena,
            saved_arena,
        })
    }

    fn pick(&self, idx: impl IntoIterator<Item = usize>) -> Vec<&DeviceBuffer<T>> {
        idx.into_iter().map(|i| &self.arena[i]).collect()
    }

    pub(crate) fn io(&self, graph: usize) -> &GraphIo {
        &self.plan.graphs[graph]
    }

    pub(crate) fn inputs(&self, graph: usize) -> Vec<&DeviceBuffer<T>> {
        self.pick(self.io(graph).inputs.iter().copied())
    }

    pub(crate) fn outputs(&self, graph: usize) -> Vec<&DeviceBuffer<T>> {
        self.pick(self.io(graph).outputs.clone())
    }

    pub(crate) fn outputs_slice(&self, graph: usize) -> &[DeviceBuffer<T>] {
        &self.arena[self.io(graph).outputs.clone()]
    }

    pub(crate) fn grad_outputs(&self, graph: usize) -> Vec<&DeviceBuffer<T>> {
        self.pick(self.io(graph).grad_outputs.iter().copied())
    }

    pub(crate) fn grad_inputs(&self, graph: usize) -> Vec<&DeviceBuffer<T>> {
        self.pick(self.io(graph).grad_inputs.clone())
    }

    pub(crate) fn grad_inputs_slice(&self, graph: usize) -> &[DeviceBuffer<T>] {
        &self.arena[self.io(graph).grad_inputs.clone()]
    }

    pub(crate) fn saved(&self, graph: usize) -> Vec<&DeviceBuffer<u8>> {
        self.saved_arena[self.io(graph).saved.clone()]
            .iter()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shapes(i: &[usize], o: &[usize], s: &[usize]) -> Shapes {
        Shapes {
            inputs: i.to_vec(),
            outputs: o.to_vec(),
            saved: s.to_vec(),
        }
    }

    #[test]
    fn layers_chain_and_microbatches_do_not_share() {
        // 2 chunks of 2 and 1 layers, 2 microbatches.
        let layout = Layout::new(vec![2, 1], 2).unwrap();
        let sh = vec![
            shapes(&[4], &[8], &[4]),
            shapes(&[8], &[3], &[]),
            shapes(&[5, 6], &[7], &[2]),
        ];
        let plan = BufferPlan::new(&layout, &sh, &[0, 1, 0, 1]).unwrap();
        assert_eq!(plan.graphs.len(), 6);
        for chunk0_mb in 0..2 {
            let g0 = &plan.graphs[layout.index(0, chunk0_mb, 0).unwrap()];
            let g1 = &plan.graphs[layout.index(0, chunk0_mb, 1).unwrap()];
            // Layer 1 reads layer 0's outputs; layer 0's output gradients are layer 1's
            // input gradients.
            assert_eq!(g1.inputs, g0.outputs.clone().collect::<Vec<_>>());
            assert_eq!(g0.grad_outputs, g1.grad_inputs.clone().collect::<Vec<_>>());
            assert_eq!(plan.lens[g0.inputs[0]], 4);
            assert_eq!(plan.saved_bytes[g0.saved.start], 4);
            assert_eq!(plan.lens[g1.grad_outputs[0]], 3);
            assert!(g1.saved.is_empty());
        }
        let g = &plan.graphs[layout.index(1, 1, 0).unwrap()];
        assert_eq!(
            g.inputs.iter().map(|&i| plan.lens[i]).collect::<Vec<_>>(),
            [5, 6]
        );
        assert_eq!(plan.lens[g.grad_inputs.clone()], [5, 6]);
        // No buffer index appears in two microbatches or chunks.
        let owners = |io: &GraphIo| {
            let mut v: Vec<usize> = io.inputs.clone();
            v.extend(io.outputs.clone());
            v.extend(io.grad_outputs.iter().copied());
            v.extend(io.grad_inputs.clone());
            // Saved buffers live in the byte arena: offset their indices past the typed one.
            v.extend(io.saved.clone().map(|i| i + plan.lens.len()));
            v
        };
        for a in 0..6 {
            for b in 0..6 {
                let (pa, pb) = (layout.locate(a).unwrap(), layout.locate(b).unwrap());
                if (pa.chunk, pa.microbatch) == (pb.chunk, pb.microbatch) {
                    continue;
                }
                let (oa, ob) = (owners(&plan.graphs[a]), owners(&plan.graphs[b]));
                assert!(
                    oa.iter().all(|i| !ob.contains(i)),
                    "graphs {a} and {b} share a buffer"
                );
            }
        }
        // Every arena entry is used by exactly one microbatch; bytes are rounded per range.
        assert_eq!(
            plan.pool_bytes(4).unwrap(),
            (plan.lens.len() + plan.saved_bytes.len()) * POOL_ALIGN
        );
    }

    #[test]
    fn layers_that_do_not_chain_are_rejected() {
        let layout = Layout::new(vec![2], 1).unwrap();
        let sh = vec![shapes(&[4], &[8], &[]), shapes(&[4], &[4], &[])];
        let err = BufferPlan::new(&layout, &sh, &[0]).unwrap_err().to_string();
        assert!(
            err.contains("chunk 0: layer 0 outputs [8] elements but layer 1 takes [4]"),
            "{err}"
        );
        let err = BufferPlan::new(&layout, &sh[..1], &[0])
            .unwrap_err()
            .to_string();
        assert!(err.contains("1 callables given, the layout has 2"), "{err}");
    }

    #[test]
    fn sets_are_recycled_in_schedule_order() {
        // 1 chunk: F0 F1 B0 F2 B1 B2: microbatch 2 reuses microbatch 0's set.
        let s = Schedule::new(&[1, 1, -1, 1, -1, -1], vec![1]).unwrap();
        assert_eq!(buffer_sets(&s, true), [0, 1, 0]);
        assert_eq!(buffer_sets(&s, false), [0, 1, 2]);
        // All forwards first: nothing to reuse.
        let s = Schedule::new(&[1, 1, 1, -1, -1, -1], vec![1]).unwrap();
        assert_eq!(buffer_sets(&s, true), [0, 1, 2]);
        // Interleaved 2 chunks x 3: chunk 0 (pairs 0..3) F0 F1 B0 F2 B1 B2, chunk 1 likewise.
        let s = Schedule::new(&[1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1], vec![2, 1]).unwrap();
        assert_eq!(buffer_sets(&s, true), [0, 1, 0, 0, 1, 0]);
        // Split weight gradients: the set is freed by -k.5, not -k.
        let s = Schedule::from_f64(
            &[1.0, 1.0, -1.0, 1.0, -1.5, -1.0, -1.5, -1.0, -1.5],
            vec![1],
        )
        .unwrap();
        assert_eq!(buffer_sets(&s, true), [0, 1, 2]);
        let s = Schedule::from_f64(
            &[1.0, 1.0, -1.0, -1.5, 1.0, -1.0, -1.5, -1.0, -1.5],
            vec![1],
        )
        .unwrap();
        assert_eq!(buffer_sets(&s, true), [0, 1, 0]);
        // The interleaved split order the GPU tests use is valid.
        let s = Schedule::from_f64(
            &[
                1.0, 2.0, 1.0, 2.0, -2.0, -2.5, -1.0, -1.5, 1.0, 2.0, -2.0, -1.0, -2.5, -1.5, -2.0,
                -2.5, -1.0, -1.5,
            ],
            vec![2, 1],
        )
        .unwrap();
        assert_eq!(buffer_sets(&s, true), [0, 1, 0, 0, 1, 0]);
    }

    #[test]
    fn shared_sets_share_every_buffer_and_shrink_the_arena() {
        let layout = Layout::new(vec![2], 3).unwrap();
        let sh = vec![shapes(&[4], &[8], &[4]), shapes(&[8], &[4], &[2])];
        let own = BufferPlan::new(&layout, &sh, &[0, 1, 2]).unwrap();
        let reused = BufferPlan::new(&layout, &sh, &[0, 1, 0]).unwrap();
        assert_eq!(reused.lens.len() * 3, own.lens.len() * 2);
        for layer in 0..2 {
            let g0 = layout.index(0, 0, layer).unwrap();
            let g2 = layout.index(0, 2, layer).unwrap();
            let g1 = layout.index(0, 1, layer).unwrap();
            assert_eq!(reused.graphs[g0], reused.graphs[g2]);
            assert_ne!(reused.graphs[g0], reused.graphs[g1]);
        }
        assert!(BufferPlan::new(&layout, &sh, &[0, 1]).is_err());
    }
}
