//! Whole-graph and per-node updates of live execs, each followed by replays checked against
//! a reference, interleaved with the soak's replays ([`Updates::event`]):
//!
//! * **The MoE layer itself** ([`MoeExec`]): a whole training pass of a full-layer
//!   [`MoeLayer`] ([`train_pass`]: weight gradients zeroed, weights cast, forward, backward)
//!   captured by hand into a [`GraphExec`]; every event captures the same pass again on the
//!   next of three buffer sets (input, output gradient, output, input gradient, saved
//!   buffers) and updates the exec to it with [`GraphExec::update_or_reinstantiate`]. Two
//!   replays follow, each on a new input routed as planned and a new output gradient (see
//!   [`super::moe`]), with every set's output and input gradient poisoned first: the replay
//!   must write exactly the new set's, and its output, input gradient, weight gradients and
//!   routing must equal an eager pass of an identical layer bit for bit and route as
//!   planned.
//! * **A chain of axpy kernels** ([`Chain`]): `y = 0`, then `y += a_k * x[s_k]` for 8 links,
//!   built explicitly. Every event builds a fresh graph with new coefficients and sources
//!   (a whole-graph update), then changes one link through a node handle of the graph the
//!   exec was instantiated from and one through a handle of the graph of the latest update
//!   ([`GraphExec::set_kernel_params`]: a new scalar and, often, a new buffer). Each change
//!   is followed by a replay whose `y` must equal the host's sum exactly (small integers:
//!   no rounding).

use std::sync::Arc;

use cuda_graph::half::bf16;
use cuda_graph::{
    CaptureMode, Context, DeviceBuffer, Graph, GraphExec, InstantiateFlags, Kernel, KernelNode,
    LaunchConfig, MemsetValue, Module, Stream, UpdateOutcome, kernel_args,
};
use fp8_moe::moe::layer::MoeLayer;
use serde::Serialize;

use super::moe::{
    Grads, MOE, PassBuffers, PassResult, Plan, Reference, fill_grad, layer, params, pass_problems,
    train_pass,
};
use super::{Rng, Stats, diff_problem};
use crate::bench::BenchResult;

/// The chain's kernel, built from `src/kernels/soak.cu`.
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/soak.fatbin"));

/// Links of the chain.
const LINKS: usize = 8;
/// Elements of the chain's vectors.
const CHAIN_LEN: usize = 4096;
/// Buffer sets the MoE exec moves between.
const SETS: usize = 3;
/// Checked replays after each update of the MoE exec.
const REPLAYS_PER_UPDATE: usize = 2;
/// The byte every output and input gradient of the MoE exec is set to before a replay, and
/// the bf16 it makes (a NaN).
const POISON: u8 = 0xff;
const POISON_BITS: u16 = 0xffff;

/// How whole-graph updates of one exec went.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct WholeGraph {
    /// Updates made.
    pub updates: u64,
    /// Of those, updated in place.
    pub in_place: u64,
    /// Of those, refused for a structural reason and replaced by a fresh instantiation
    /// ([`GraphExec::update_or_reinstantiate`]).
    pub reinstantiated: u64,
    /// Of those, refused for a reason a fresh instantiation does not fix
    /// ([`Error::Update`](cuda_graph::Error::Update) from `update_or_reinstantiate`): the
    /// soak instantiates afresh anyway and counts the next check as a mismatch.
    pub refused: u64,
}

impl WholeGraph {
    /// Updates `exec` to `graph` and counts the outcome; a refusal that a reinstantiation
    /// does not fix is reinstantiated all the same and described in `problems`. Returns
    /// whether `exec` is a fresh instantiation (whose node handles are `graph`'s).
    fn update(
        &mut self,
        exec: &mut GraphExec,
        graph: &Graph,
        problems: &mut Vec<String>,
    ) -> BenchResult<bool> {
        self.updates += 1;
        match exec.update_or_reinstantiate(graph, InstantiateFlags::empty()) {
            Ok(UpdateOutcome::Updated) => {
                self.in_place += 1;
                Ok(false)
            }
            Ok(UpdateOutcome::Reinstantiated) => {
                self.reinstantiated += 1;
                Ok(true)
            }
            Err(e @ cuda_graph::Error::Update { .. }) => {
                self.refused += 1;
                problems.push(format!("whole-graph update refused: {e}"));
                *exec = GraphExec::instantiate(graph, InstantiateFlags::empty())?;
                Ok(true)
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// One link of the chain: `y += a * x[source]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// The coefficient, a small integer.
    pub a: f32,
    /// Which of the two source vectors it reads.
    pub source: usize,
}

/// A link with `a` in -3..=3 and either source.
pub fn draw_link(rng: &mut Rng) -> Link {
    Link {
        a: rng.below(7) as f32 - 3.0,
        source: rng.below(2),
    }
}

/// What the chain computes, on the host: `y = 0`, then `y = fma(a, x[source], y)` per link
/// in order (as the kernel does; with the chain's small integers every step is exact).
pub fn chain_reference(links: &[Link], sources: &[Vec<f32>; 2]) -> Vec<f32> {
    let n = sources[0].len().min(sources[1].len());
    let mut y = vec![0f32; n];
    for l in links {
        for (v, &x) in y.iter_mut().zip(&sources[l.source & 1]) {
            *v = l.a.mul_add(x, *v);
        }
    }
    y
}

/// The explicitly built chain of axpy kernels and its exec.
pub struct Chain {
    kernel: Kernel,
    cfg: LaunchConfig,
    xs: [DeviceBuffer<f32>; 2],
    host_xs: [Vec<f32>; 2],
    y: DeviceBuffer<f32>,
    /// The links the exec runs now.
    links: Vec<Link>,
    exec: GraphExec,
    /// Node handles of the graph the exec was instantiated from.
    origin: Vec<KernelNode>,
    /// The graph of the latest whole-graph update, and its node handles.
    latest: (Graph, Vec<KernelNode>),
    /// Whole-graph updates.
    pub whole_graph: WholeGraph,
    /// Per-node updates ([`GraphExec::set_kernel_params`]).
    pub per_node: u64,
    /// Replays (one after each update), checks, mismatches.
    pub stats: Stats,
}

impl Chain {
    /// The chain with sources and links from `rng`, instantiated (not launched).
    pub fn new(ctx: &Arc<Context>, stream: &Stream, rng: &mut Rng) -> BenchResult<Chain> {
        let module = Module::embedded(ctx, FATBIN)?;
        let kernel = module.kernel("soak_axpy_f32")?;
        let cfg = LaunchConfig::for_elements(CHAIN_LEN as u32, 256);
        let host_xs: [Vec<f32>; 2] = [0, 1].map(|_| {
            (0..CHAIN_LEN)
                .map(|_| rng.below(129) as f32 - 64.0)
                .collect()
        });
        let xs = [
            DeviceBuffer::from_host(stream, &host_xs[0])?,
            DeviceBuffer::from_host(stream, &host_xs[1])?,
        ];
        let y = DeviceBuffer::<f32>::alloc(ctx, CHAIN_LEN)?;
        let links: Vec<Link> = (0..LINKS).map(|_| draw_link(rng)).collect();
        let (graph, nodes) = build_chain(ctx, &kernel, &cfg, &xs, &y, &links)?;
        let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
        Ok(Chain {
            kernel,
            cfg,
            xs,
            host_xs,
            y,
            links,
            exec,
            origin: nodes.clone(),
            latest: (graph, nodes),
            whole_graph: WholeGraph::default(),
            per_node: 0,
            stats: Stats::default(),
        })
    }

    /// A whole-graph update to new links, then two per-node updates (through the first
    /// graph's handle, then the latest's), each followed by a checked replay.
    pub fn event(&mut self, stream: &Stream, rng: &mut Rng) -> BenchResult<()> {
        let links: Vec<Link> = (0..LINKS).map(|_| draw_link(rng)).collect();
        let ctx = stream.context();
        let (graph, nodes) = build_chain(ctx, &self.kernel, &self.cfg, &self.xs, &self.y, &links)?;
        let mut problems = Vec::new();
        if self
            .whole_graph
            .update(&mut self.exec, &graph, &mut problems)?
        {
            // A fresh exec's nodes are the new graph's.
            self.origin = nodes.clone();
        }
        self.links = links;
        self.latest = (graph, nodes);
        self.replay_and_check(stream, "after a whole-graph update", problems)?;
        for via_latest in [false, true] {
            let k = rng.below(LINKS);
            let mut link = draw_link(rng);
            if link == self.links[k] {
                link.source ^= 1;
            }
            let node = if via_latest {
                self.latest.1[k]
            } else {
                self.origin[k]
            };
            let n = CHAIN_LEN as u32;
            // SAFETY: soak_axpy_f32(float a, const float* x, float* y, unsigned n) reads n
            // floats of x and updates n of y; both hold CHAIN_LEN = n floats, and the launch
            // covers n threads, bound-checked in the kernel.
            unsafe {
                self.exec.set_kernel_params(
                    &node,
                    &self.kernel,
                    &self.cfg,
                    &kernel_args![link.a, self.xs[link.source], self.y, n],
                )
            }?;
            self.links[k] = link;
            self.per_node += 1;
            let how = if via_latest {
                "the latest update's graph"
            } else {
                "the instantiated graph"
            };
            self.replay_and_check(
                stream,
                &format!("after a per-node update of link {k} through {how}"),
                Vec::new(),
            )?;
        }
        Ok(())
    }

    /// Replays with `y` poisoned first and checks `y` against the host; `problems` are
    /// the update's, if any.
    fn replay_and_check(
        &mut self,
        stream: &Stream,
        what: &str,
        mut problems: Vec<String>,
    ) -> BenchResult<()> {
        self.y.fill_u32_bits(stream, f32::NAN.to_bits())?;
        self.exec.launch(stream)?;
        self.stats.replays += 1;
        let got = self.y.to_vec(stream)?;
        let want = chain_reference(&self.links, &self.host_xs);
        problems.extend(diff_problem("y", &got, &want));
        let n = self.stats.replays;
        self.stats
            .record_check(|| format!("axpy chain replay {n} {what}"), problems);
        Ok(())
    }
}

/// `y = 0` then one kernel node per link, in a line.
fn build_chain(
    ctx: &Arc<Context>,
    kernel: &Kernel,
    cfg: &LaunchConfig,
    xs: &[DeviceBuffer<f32>; 2],
    y: &DeviceBuffer<f32>,
    links: &[Link],
) -> BenchResult<(Graph, Vec<KernelNode>)> {
    let mut graph = Graph::new(ctx)?;
    let mut prev = graph.add_memset(&[], y, MemsetValue::U32(0))?.node();
    let n = CHAIN_LEN as u32;
    let mut nodes = Vec::with_capacity(links.len());
    for l in links {
        // SAFETY: as in Chain::event: n floats of x and y, n threads, bound-checked.
        let node = unsafe {
            graph.add_kernel(
                &[prev],
                kernel,
                cfg,
                &kernel_args![l.a, xs[l.source & 1], *y, n],
            )
        }?;
        prev = node.node();
        nodes.push(node);
    }
    Ok((graph, nodes))
}

/// A hand-captured full-layer MoE training pass whose exec moves between buffer sets by
/// whole-graph updates.
pub struct MoeExec {
    layer: MoeLayer,
    grads: Grads,
    reference: Reference,
    sets: Vec<ExecSet>,
    /// The set the exec reads and writes now.
    current: usize,
    exec: GraphExec,
    host_x: Vec<bf16>,
    host_dy: Vec<bf16>,
    plan: Plan,
    /// Whole-graph updates.
    pub whole_graph: WholeGraph,
    /// Replays (two after each update), checks, mismatches.
    pub stats: Stats,
}

impl MoeExec {
    /// The layer and its eager twin with parameters from `weights_rng`, the training pass
    /// run once eagerly, then captured on set 0 and instantiated.
    pub fn new(stream: &Stream, weights_rng: &mut Rng) -> BenchResult<MoeExec> {
        let params = params(weights_rng, MOE);
        let mut layer = layer(stream, &params)?;
        let reference = Reference::new(stream, &params)?;
        let n = MOE.tokens * MOE.hidden;
        let sets = (0..SETS)
            .map(|_| -> BenchResult<_> {
                Ok(ExecSet {
                    x: DeviceBuffer::from_host(stream, &vec![bf16::ZERO; n])?,
                    dy: DeviceBuffer::from_host(stream, &vec![bf16::ZERO; n])?,
                    bufs: PassBuffers::new(stream, &layer)?,
                })
            })
            .collect::<BenchResult<Vec<_>>>()?;
        // One eager pass first, as the runtime's warmup does: whatever the kernels set up on
        // first use happens outside the capture.
        let s0 = &sets[0];
        train_pass(&mut layer, stream, &s0.x, &s0.dy, &s0.bufs)?;
        let graph = capture(&mut layer, stream, s0)?;
        let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
        Ok(MoeExec {
            grads: Grads::of(&layer),
            layer,
            reference,
            sets,
            current: 0,
            exec,
            host_x: vec![bf16::ZERO; n],
            host_dy: vec![bf16::ZERO; n],
            plan: Plan::all_to_first(),
            whole_graph: WholeGraph::default(),
            stats: Stats::default(),
        })
    }

    /// Captures the training pass on the next set, updates the exec to it, and checks
    /// [`REPLAYS_PER_UPDATE`] replays.
    pub fn event(&mut self, stream: &Stream, rng: &mut Rng) -> BenchResult<()> {
        let next = (self.current + 1) % SETS;
        let graph = capture(&mut self.layer, stream, &self.sets[next])?;
        let mut update_problems = Vec::new();
        self.whole_graph
            .update(&mut self.exec, &graph, &mut update_problems)?;
        self.current = next;
        for _ in 0..REPLAYS_PER_UPDATE {
            let prev = std::mem::take(&mut self.plan.counts);
            self.plan.redraw(rng, &prev, &mut self.host_x);
            fill_grad(rng, &mut self.host_dy);
            let set = &self.sets[next];
            set.x.copy_from_host(stream, &self.host_x)?;
            set.dy.copy_from_host(stream, &self.host_dy)?;
            for s in &self.sets {
                s.bufs.y().memset_bytes(stream, POISON)?;
                s.bufs.dx().memset_bytes(stream, POISON)?;
            }
            self.exec.launch(stream)?;
            self.stats.replays += 1;
            let b = &set.bufs;
            let got = PassResult::read(stream, b.y(), b.dx(), &self.grads, b.routing()?)?;
            let eager = self.reference.run(stream, &set.x, &set.dy)?;
            let mut problems = std::mem::take(&mut update_problems);
            problems.extend(pass_problems(&got, &eager, &self.plan));
            for (j, s) in self.sets.iter().enumerate() {
                if j == next {
                    continue;
                }
                for (what, buf) in [("output", s.bufs.y()), ("input gradient", s.bufs.dx())] {
                    if buf
                        .to_vec(stream)?
                        .iter()
                        .any(|v| v.to_bits() != POISON_BITS)
                    {
                        problems.push(format!(
                            "the replay wrote the {what} of set {j}; the update moved it to \
                             set {next}"
                        ));
                    }
                }
            }
            let n = self.stats.replays;
            self.stats.record_check(
                || {
                    format!(
                        "MoE exec replay {n} (set {next}, after whole-graph update {})",
                        self.whole_graph.updates
                    )
                },
                problems,
            );
        }
        Ok(())
    }
}

/// One buffer set of the MoE exec: the input, the output gradient, and the pass's output,
/// input gradient and saved buffers.
struct ExecSet {
    x: DeviceBuffer<bf16>,
    dy: DeviceBuffer<bf16>,
    bufs: PassBuffers,
}

/// The layer's [`train_pass`] on `set`, captured.
fn capture(layer: &mut MoeLayer, stream: &Stream, set: &ExecSet) -> BenchResult<Graph> {
    Ok(stream.capture(CaptureMode::ThreadLocal, |s| {
        train_pass(layer, s.stream(), &set.x, &set.dy, &set.bufs)
    })?)
}

/// The update events: the chain always, the MoE exec when the MoE workload runs.
pub struct Updates {
    /// The axpy chain.
    pub chain: Chain,
    /// The MoE exec, if any.
    pub moe: Option<MoeExec>,
    rng: Rng,
    /// Events run.
    pub events: u64,
}

impl Updates {
    /// The chain, and the MoE exec when `with_moe`.
    pub fn new(
        ctx: &Arc<Context>,
        stream: &Stream,
        weights_rng: &mut Rng,
        rng: Rng,
        with_moe: bool,
    ) -> BenchResult<Updates> {
        let chain = Chain::new(ctx, stream, weights_rng)?;
        let moe = if with_moe {
            Some(MoeExec::new(stream, weights_rng)?)
        } else {
            None
        };
        Ok(Updates {
            chain,
            moe,
            rng,
            events: 0,
        })
    }

    /// One event: the chain's three updates, then the MoE exec's update, all checked.
    pub fn event(&mut self, stream: &Stream) -> BenchResult<()> {
        self.chain.event(stream, &mut self.rng)?;
        if let Some(m) = &mut self.moe {
            m.event(stream, &mut self.rng)?;
        }
        self.events += 1;
        Ok(())
    }

    /// Checks and mismatches over both.
    pub fn mismatches(&self) -> u64 {
        self.chain.stats.mismatches + self.moe.as_ref().map_or(0, |m| m.stats.mismatches)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_reference_sums_in_link_order() {
        let sources = [vec![1.0, -2.0, 64.0], vec![3.0, 5.0, -64.0]];
        let links = [
            Link { a: 2.0, source: 0 },
            Link { a: -3.0, source: 1 },
            Link { a: 1.0, source: 0 },
        ];
        assert_eq!(
            chain_reference(&links, &sources),
            vec![2.0 - 9.0 + 1.0, -4.0 - 15.0 - 2.0, 128.0 + 192.0 + 64.0]
        );
        assert_eq!(chain_reference(&[], &sources), vec![0.0; 3]);
    }

    #[test]
    fn drawn_links_stay_small_so_the_chain_is_exact() {
        let mut rng = Rng::new(5, 9);
        let (mut lo, mut hi, mut sources) = (0f32, 0f32, [0usize; 2]);
        for _ in 0..10_000 {
            let l = draw_link(&mut rng);
            assert_eq!(l.a, l.a.round());
            lo = lo.min(l.a);
            hi = hi.max(l.a);
            sources[l.source] += 1;
        }
        assert_eq!((lo, hi), (-3.0, 3.0));
        assert!(sources[0] > 4000 && sources[1] > 4000, "{sources:?}");
        // |y| <= LINKS * 3 * 64, far below 2^24: every partial sum is an exact integer.
        const { assert!(LINKS * 3 * 64 < 1 << 24) };
    }
}
