//! Breaking-layer capture: a toy MoE-like layer whose forward is router (graphed), experts
//! (eager: reads the routed-token count to the host and launches exactly that many threads)
//! and combine (graphed), and whose backward is a graphed pass-through then eager experts.
//! With token distributions changing every step, graphed-with-eager-segments outputs and
//! gradients equal a fully eager run and the host bit for bit over 2 training steps of the
//! interleaved 2 x 3 schedule; so does the same layer in full-layer mode (experts reading the
//! count from device memory, the whole pass one graph) and split into several graphed
//! segments. The weight casts sit in the first graphed forward segment; eager-only passes
//! work; an empty segment list is rejected; a pass with eager segments is refused on a
//! capturing stream.
//!
//! The layer (tests/kernels/graphed_kernels.cu, `gs_*`): with `thr = 0.5`,
//! `y[i] = x[i] > thr ? x[i] * w[i] + b[i] : x[i] / 2`; backward `dx[i] = routed ? dy[i] * w[i]
//! : dy[i] / 2`, `dw[i] += dy[i] * x[i]`, `db[i] += dy[i]` for routed `i`. The router lists
//! the routed indices in a saved buffer and their count in another (typed views of
//! buffers), which carry the routing from segment to segment and from forward to backward.

use cuda_graph::{
    CaptureMode, DeviceBuffer, Error, GraphPool, Kernel, LaunchConfig, NodeKind, Result, Stream,
    kernel_args,
};
use graphed_callables::{
    Callable, GraphIndex, GraphedCallables, GraphedOptions, Pass, Schedule, SegmentKind, Slot,
    Step, WeightCaching,
};
use std::sync::{Arc, Mutex};

/// Tokens (elements) per buffer: more than one block, not a multiple of it.
mod graphed_common;
use graphed_common::Gpu;

const N: usize = 300;
/// Training steps each test replays; inputs differ between them.
const STEPS: usize = 2;
/// Warmup iterations (the default).
const WARMUP: usize = 3;
/// The router's threshold.
const THR: f32 = 0.5;
/// 2 chunks x 3 microbatches, interleaved.
const ORDER_2X3: [i64; 12] = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1];
const BLOCK: u32 = 128;

use SegmentKind::{Eager as E, Graphed as G};

// ---- data: deterministic per callable, chunk, microbatch and training step ----

fn weights(callable: usize) -> (Vec<f32>, Vec<f32>) {
    let w = (0..N)
        .map(|i| 0.75 + 0.0625 * ((i * 3 + callable * 5) % 9) as f32)
        .collect();
    let b = (0..N)
        .map(|i| 0.03125 * ((i + 7 * callable) % 13) as f32 - 0.1875)
        .collect();
    (w, b)
}

/// The token distribution of (chunk, microbatch) in training step `step`: a base pattern in
/// [-2, 2] shifted per (chunk, microbatch, step), so the routed count changes every step
/// (and is 0 for some).
fn input(chunk: usize, microbatch: usize, step: usize) -> Vec<f32> {
    let off = [0.0f32, -1.0, 0.75, -2.25][(3 * chunk + microbatch + 2 * step) % 4];
    (0..N)
        .map(|i| 0.25 * ((i * 31 + 7 * chunk + 13 * microbatch + 5 * step) % 17) as f32 - 2.0 + off)
        .collect()
}

fn grad_output(chunk: usize, microbatch: usize, step: usize) -> Vec<f32> {
    (0..N)
        .map(|i| 0.125 * ((i * 5 + 3 * microbatch + 11 * chunk + step) % 11) as f32 - 0.5)
        .collect()
}

// ---- the layer ----

/// One stage of work; segments are lists of stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Nothing (an eager prologue, e.g. host-side bookkeeping).
    Nop,
    /// The router: idx, count (device).
    Route,
    /// Experts over exactly `count` tokens, count read to the host (synchronizes).
    ExpertsHost,
    /// Experts reading the count from device memory (capturable).
    ExpertsDev,
    /// y = x / 2, then the expert results scattered over it.
    Combine,
    /// dx = dy / 2.
    BwdPass,
    /// Expert backward over `count` tokens read to the host.
    BwdExpertsHost,
    /// Expert backward reading the count from device memory.
    BwdExpertsDev,
}

/// How a layer splits its passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// fwd [G route, E experts, G combine], bwd [G pass, E experts].
    Breaking,
    /// fwd [E nop, G route, E experts, G combine], bwd [E nop, G pass, E experts]: the casts
    /// must go into segment 1, the first graphed one.
    EagerPrologue,
    /// One graph per pass (the default segments), experts with device-side counts.
    FullLayer,
    /// fwd [G, G, G], bwd [G, G] with device-side counts: several graphs per pass.
    GraphedSegments,
    /// fwd [E all], bwd [E all]: no graph at all.
    EagerOnly,
    /// fwd [] (rejected at build).
    Empty,
}

type Segments = Vec<(SegmentKind, Vec<Stage>)>;

impl Mode {
    fn forward(self) -> Segments {
        use Stage::*;
        match self {
            Mode::Breaking => vec![(G, vec![Route]), (E, vec![ExpertsHost]), (G, vec![Combine])],
            Mode::EagerPrologue => vec![
                (E, vec![Nop]),
                (G, vec![Route]),
                (E, vec![ExpertsHost]),
                (G, vec![Combine]),
            ],
            Mode::FullLayer => vec![(G, vec![Route, ExpertsDev, Combine])],
            Mode::GraphedSegments => {
                vec![(G, vec![Route]), (G, vec![ExpertsDev]), (G, vec![Combine])]
            }
            Mode::EagerOnly => vec![(E, vec![Route, ExpertsHost, Combine])],
            Mode::Empty => vec![],
        }
    }
    fn backward(self) -> Segments {
        use Stage::*;
        match self {
            Mode::Breaking => vec![(G, vec![BwdPass]), (E, vec![BwdExpertsHost])],
            Mode::EagerPrologue => vec![
                (E, vec![Nop]),
                (G, vec![BwdPass]),
                (E, vec![BwdExpertsHost]),
            ],
            Mode::FullLayer => vec![(G, vec![BwdPass, BwdExpertsDev])],
            Mode::GraphedSegments => vec![(G, vec![BwdPass]), (G, vec![BwdExpertsDev])],
            Mode::EagerOnly => vec![(E, vec![BwdPass, BwdExpertsHost])],
            Mode::Empty => vec![(G, vec![BwdPass, BwdExpertsDev])],
        }
    }
}

/// What an eager host-count stage saw: (warmup, pass, where, count read to the host).
type Log = Arc<Mutex<Vec<(bool, Pass, GraphIndex, u32)>>>;

struct Moe {
    mode: Mode,
    w: DeviceBuffer<f32>,
    b: DeviceBuffer<f32>,
    dw: DeviceBuffer<f32>,
    db: DeviceBuffer<f32>,
    log: Log,
    /// A counting "weight cast" (incremented per cast that was not skipped), if any.
    cast_counter: Option<Arc<DeviceBuffer<u32>>>,
    k: Kernels,
}

struct Kernels {
    route: Kernel,
    expert: Kernel,
    expert_dev: Kernel,
    pass: Kernel,
    scatter: Kernel,
    expert_bwd: Kernel,
    expert_bwd_dev: Kernel,
    cast: Kernel,
    cast_ignoring: Kernel,
}

/// The buffers a stage works on.
struct Io<'a> {
    x: &'a DeviceBuffer<f32>,
    y: &'a DeviceBuffer<f32>,
    dy: Option<&'a DeviceBuffer<f32>>,
    dx: Option<&'a DeviceBuffer<f32>>,
    /// saved[0]: count (one u32), saved[1]: idx (N u32), saved[2]: h (N floats).
    saved: &'a [&'a DeviceBuffer<u8>],
}

impl Moe {
    fn new(gpu: &Gpu, callable: usize, mode: Mode, log: Log) -> Moe {
        let (w, b) = weights(callable);
        Moe {
            mode,
            w: gpu.upload(&w),
            b: gpu.upload(&b),
            dw: gpu.upload(&[0.0f32; N]),
            db: gpu.upload(&[0.0f32; N]),
            log,
            cast_counter: None,
            k: Kernels {
                route: gpu.k("gs_route"),
                expert: gpu.k("gs_expert"),
                expert_dev: gpu.k("gs_expert_dev"),
                pass: gpu.k("gs_pass"),
                scatter: gpu.k("gs_scatter"),
                expert_bwd: gpu.k("gs_expert_bwd"),
                expert_bwd_dev: gpu.k("gs_expert_bwd_dev"),
                cast: gpu.k("gl_count_cast"),
                cast_ignoring: gpu.k("gl_count_cast_ignoring_flag"),
            },
        }
    }

    /// Reads the routed count to the host: a device-to-host copy that synchronizes `stream`
    /// (the dynamic part a graph can not hold).
    fn host_count(stream: &Stream, count: &DeviceBuffer<u32>) -> Result<u32> {
        let v = count.to_vec(stream)?;
        stream.synchronize()?;
        Ok(v[0])
    }

    fn run(&self, stage: Stage, stream: &Stream, io: &Io<'_>, slot: &Slot<'_, f32>) -> Result<()> {
        let n = N as u32;
        let (count, idx, h) = (
            io.saved[0].reinterpret::<u32>()?,
            io.saved[1].reinterpret::<u32>()?,
            io.saved[2].reinterpret::<f32>()?,
        );
        let full = LaunchConfig::for_elements(n, BLOCK);
        // SAFETY (every launch below): x, y, dy, dx, w, b, dw, db, idx and h have N elements
        // and count one; the kernels touch at most n elements of each (idx entries are < n,
        // count <= n, both written by gs_route).
        match stage {
            Stage::Nop => Ok(()),
            Stage::Route => unsafe {
                stream.launch(
                    &self.k.route,
                    &LaunchConfig::linear(1, 1),
                    &kernel_args![*io.x, THR, idx, count, n],
                )
            },
            Stage::ExpertsHost => {
                let c = Moe::host_count(stream, &count)?;
                self.log
                    .lock()
                    .expect("log")
                    .push((slot.is_warmup(), Pass::Forward, slot.at(), c));
                if c == 0 {
                    return Ok(()); // no tokens: no launch at all
                }
                // The grid comes from the host value: exactly c threads do work.
                unsafe {
                    stream.launch(
                        &self.k.expert,
                        &LaunchConfig::for_elements(c, BLOCK),
                        &kernel_args![*io.x, self.w, self.b, idx, h, c],
                    )
                }
            }
            Stage::ExpertsDev => unsafe {
                stream.launch(
                    &self.k.expert_dev,
                    &full,
                    &kernel_args![*io.x, self.w, self.b, idx, h, count],
                )
            },
            Stage::Combine => {
                unsafe { stream.launch(&self.k.pass, &full, &kernel_args![*io.x, *io.y, n]) }?;
                unsafe {
                    stream.launch(&self.k.scatter, &full, &kernel_args![h, idx, count, *io.y])
                }
            }
            Stage::BwdPass => {
                let (dy, dx) = (need(io.dy, stage)?, need(io.dx, stage)?);
                unsafe { stream.launch(&self.k.pass, &full, &kernel_args![*dy, *dx, n]) }
            }
            Stage::BwdExpertsHost => {
                let (dy, dx) = (need(io.dy, stage)?, need(io.dx, stage)?);
                let c = Moe::host_count(stream, &count)?;
                self.log.lock().expect("log").push((
                    slot.is_warmup(),
                    Pass::Backward,
                    slot.at(),
                    c,
                ));
                if c == 0 {
                    return Ok(());
                }
                unsafe {
                    stream.launch(
                        &self.k.expert_bwd,
                        &LaunchConfig::for_elements(c, BLOCK),
                        &kernel_args![*dy, *io.x, self.w, idx, *dx, self.dw, self.db, c],
                    )
                }
            }
            Stage::BwdExpertsDev => {
                let (dy, dx) = (need(io.dy, stage)?, need(io.dx, stage)?);
                unsafe {
                    stream.launch(
                        &self.k.expert_bwd_dev,
                        &full,
                        &kernel_args![*dy, *io.x, self.w, idx, *dx, self.dw, self.db, count],
                    )
                }
            }
        }
    }

    /// Runs segment `segment` of `pass`, checking that the runtime called the method of
    /// its kind.
    fn segment(
        &self,
        pass: Pass,
        segment: usize,
        called_as: SegmentKind,
        stream: &Stream,
        io: &Io<'_>,
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let segs = match pass {
            Pass::Forward => self.mode.forward(),
            _ => self.mode.backward(),
        };
        let (kind, stages) = segs.get(segment).ok_or_else(|| {
            Error::InvalidArgument(format!("{:?}: no {pass:?} segment {segment}", self.mode))
        })?;
        if *kind != called_as {
            return Err(Error::InvalidArgument(format!(
                "{:?}: {pass:?} segment {segment} is {kind:?} but was run as {called_as:?}",
                self.mode
            )));
        }
        for &s in stages {
            self.run(s, stream, io, slot)?;
        }
        Ok(())
    }

    /// The whole pass, every segment in order, eagerly (the eager reference).
    fn whole(&self, pass: Pass, stream: &Stream, io: &Io<'_>, slot: &Slot<'_, f32>) -> Result<()> {
        let segs = match pass {
            Pass::Forward => self.mode.forward(),
            _ => self.mode.backward(),
        };
        for (_, stages) in segs {
            for s in stages {
                self.run(s, stream, io, slot)?;
            }
        }
        Ok(())
    }
}

/// The gradient buffer a backward stage needs.
fn need(b: Option<&DeviceBuffer<f32>>, stage: Stage) -> Result<&DeviceBuffer<f32>> {
    b.ok_or_else(|| Error::InvalidArgument(format!("{stage:?} needs gradients")))
}

fn fwd_io<'a>(
    inputs: &'a [&'a DeviceBuffer<f32>],
    outputs: &'a [&'a DeviceBuffer<f32>],
    slot: &'a Slot<'a, f32>,
) -> Io<'a> {
    Io {
        x: inputs[0],
        y: outputs[0],
        dy: None,
        dx: None,
        saved: slot.saved(),
    }
}

fn bwd_io<'a>(
    grad_outputs: &'a [&'a DeviceBuffer<f32>],
    grad_inputs: &'a [&'a DeviceBuffer<f32>],
    slot: &'a Slot<'a, f32>,
) -> Io<'a> {
    Io {
        x: slot.inputs()[0],
        y: slot.outputs()[0],
        dy: Some(grad_outputs[0]),
        dx: Some(grad_inputs[0]),
        saved: slot.saved(),
    }
}

impl Callable<f32> for Moe {
    fn input_lens(&self) -> Vec<usize> {
        vec![N]
    }
    fn output_lens(&self) -> Vec<usize> {
        vec![N]
    }
    fn saved_bytes(&self) -> Vec<usize> {
        vec![4, 4 * N, 4 * N]
    }
    fn parameters(&self) -> Vec<&DeviceBuffer<f32>> {
        vec![&self.w, &self.b]
    }
    fn gradients(&self) -> Vec<&DeviceBuffer<f32>> {
        vec![&self.dw, &self.db]
    }
    fn forward_segments(&self) -> Vec<SegmentKind> {
        match self.mode {
            // Full-layer mode is the default: one graphed segment, forward().
            Mode::FullLayer => vec![G],
            m => m.forward().into_iter().map(|(k, _)| k).collect(),
        }
    }
    fn backward_segments(&self) -> Vec<SegmentKind> {
        self.mode.backward().into_iter().map(|(k, _)| k).collect()
    }
    fn cast_weights(&mut self, stream: &Stream, slot: &Slot<'_, f32>) -> Result<()> {
        let Some(counter) = &self.cast_counter else {
            return Ok(());
        };
        let one = LaunchConfig::linear(1, 1);
        match slot.skip_weight_cast() {
            // SAFETY: one thread reads flag[0] and increments counter[0] (one element each).
            Some(flag) => unsafe {
                stream.launch(&self.k.cast, &one, &kernel_args![**counter, *flag])
            },
            // SAFETY: one thread increments counter[0] of a one-element buffer.
            None => unsafe { stream.launch(&self.k.cast_ignoring, &one, &kernel_args![**counter]) },
        }
    }
    fn forward(
        &mut self,
        stream: &Stream,
        inputs: &[&DeviceBuffer<f32>],
        outputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        self.whole(Pass::Forward, stream, &fwd_io(inputs, outputs, slot), slot)
    }
    fn backward(
        &mut self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<f32>],
        grad_inputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        self.whole(
            Pass::Backward,
            stream,
            &bwd_io(grad_outputs, grad_inputs, slot),
            slot,
        )
    }
    fn forward_segment(
        &mut self,
        segment: usize,
        stream: &Stream,
        inputs: &[&DeviceBuffer<f32>],
        outputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        if self.mode == Mode::FullLayer {
            // Not overridden in spirit: the default (segment 0 = forward) would do the same.
            assert_eq!(segment, 0, "full-layer mode has one segment");
            return self.forward(stream, inputs, outputs, slot);
        }
        let io = fwd_io(inputs, outputs, slot);
        self.segment(Pass::Forward, segment, G, stream, &io, slot)
    }
    fn backward_segment(
        &mut self,
        segment: usize,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<f32>],
        grad_inputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let io = bwd_io(grad_outputs, grad_inputs, slot);
        self.segment(Pass::Backward, segment, G, stream, &io, slot)
    }
    fn forward_eager(
        &self,
        segment: usize,
        stream: &Stream,
        inputs: &[&DeviceBuffer<f32>],
        outputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let io = fwd_io(inputs, outputs, slot);
        self.segment(Pass::Forward, segment, E, stream, &io, slot)
    }
    fn backward_eager(
        &self,
        segment: usize,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<f32>],
        grad_inputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let io = bwd_io(grad_outputs, grad_inputs, slot);
        self.segment(Pass::Backward, segment, E, stream, &io, slot)
    }
}

// ---- runs ----

/// What one run produced: per replayed step (over all training steps) the forward's output
/// or the backward's input gradient, each callable's (dw, db), and the routed counts per
/// (training step, pass, where) in execution order.
#[derive(Debug, PartialEq)]
struct Results {
    steps: Vec<(Step, Vec<f32>)>,
    grads: Vec<(Vec<f32>, Vec<f32>)>,
    counts: Vec<(Pass, GraphIndex, u32)>,
}

fn assert_bit_equal(got: &Results, want: &Results, what: &str) {
    graphed_common::assert_replays_bit_equal(
        (&got.steps, &got.grads),
        (&want.steps, &want.grads),
        what,
    );
}

/// The host reference over `training_steps` steps; `counts` lists every layer's routed
/// count per pass in execution order (forward: layer 0 first; backward: last layer first).
fn run_host(schedule: &Schedule, training_steps: usize) -> Results {
    let layout = schedule.layout();
    let params: Vec<_> = (0..layout.total_callables()).map(weights).collect();
    let mut grads = vec![(vec![0.0f32; N], vec![0.0f32; N]); layout.total_callables()];
    let mut xs = vec![Vec::new(); layout.total_graphs()];
    let mut steps = Vec::new();
    let mut counts = Vec::new();
    for s in 0..training_steps {
        for &step in schedule.steps() {
            let (m, b) = (step.chunk(), step.microbatch());
            let graphs = layout.microbatch_graphs(m, b).unwrap();
            let at = |g: usize| layout.locate(g).unwrap();
            if let Step::Forward { .. } = step {
                let mut x = input(m, b, s);
                for g in graphs {
                    let (w, bias) = &params[layout.callable_of_graph(g).unwrap()];
                    let y: Vec<f32> = (0..N)
                        .map(|i| {
                            if x[i] > THR {
                                x[i] * w[i] + bias[i]
                            } else {
                                x[i] * 0.5
                            }
                        })
                        .collect();
                    let c = x.iter().filter(|&&v| v > THR).count() as u32;
                    counts.push((Pass::Forward, at(g), c));
                    xs[g] = x;
                    x = y;
                }
                steps.push((step, x));
            } else {
                let mut dy = grad_output(m, b, s);
                for g in graphs.rev() {
                    let c = layout.callable_of_graph(g).unwrap();
                    let w = &params[c].0;
                    let x = &xs[g];
                    let mut dx = vec![0.0f32; N];
                    for i in 0..N {
                        if x[i] > THR {
                            dx[i] = dy[i] * w[i];
                            grads[c].0[i] += dy[i] * x[i];
                            grads[c].1[i] += dy[i];
                        } else {
                            dx[i] = dy[i] * 0.5;
                        }
                    }
                    let routed = x.iter().filter(|&&v| v > THR).count() as u32;
                    counts.push((Pass::Backward, at(g), routed));
                    dy = dx;
                }
                steps.push((step, dy));
            }
        }
    }
    Results {
        steps,
        grads,
        counts,
    }
}

/// The layer run eagerly (every segment, host-read counts), each microbatch with buffers
/// of its own, poisoned first.
fn run_eager(gpu: &Gpu, schedule: &Schedule) -> Results {
    let layout = schedule.layout();
    let log: Log = Arc::default();
    let mut callables: Vec<Moe> = (0..layout.total_callables())
        .map(|c| Moe::new(gpu, c, Mode::Breaking, log.clone()))
        .collect();
    let pool = GraphPool::new(&gpu.ctx, 4096).expect("pool");
    let total = layout.total_graphs();
    let ys: Vec<_> = (0..total).map(|_| gpu.poisoned(N)).collect();
    let dxs: Vec<_> = (0..total).map(|_| gpu.poisoned(N)).collect();
    let saved: Vec<[DeviceBuffer<u8>; 3]> = (0..total)
        .map(|_| {
            [
                gpu.poisoned_bytes(4),
                gpu.poisoned_bytes(4 * N),
                gpu.poisoned_bytes(4 * N),
            ]
        })
        .collect();
    let mut steps = Vec::new();
    for s in 0..STEPS {
        for &step in schedule.steps() {
            let (m, b) = (step.chunk(), step.microbatch());
            let graphs = layout.microbatch_graphs(m, b).unwrap();
            let x0 = gpu.upload(&input(m, b, s));
            let dy = gpu.upload(&grad_output(m, b, s));
            let input_of = |g: usize| if g == graphs.start { &x0 } else { &ys[g - 1] };
            let slot_of = |g: usize| {
                Slot::new(
                    layout.locate(g).unwrap(),
                    vec![input_of(g)],
                    vec![&ys[g]],
                    saved[g].iter().collect(),
                )
                .with_pool(&pool)
            };
            if let Step::Forward { .. } = step {
                for g in graphs.clone() {
                    callables[layout.callable_of_graph(g).unwrap()]
                        .forward(&gpu.stream, &[input_of(g)], &[&ys[g]], &slot_of(g))
                        .expect("eager forward");
                }
                steps.push((step, gpu.read(&ys[graphs.end - 1])));
            } else {
                for g in graphs.clone().rev() {
                    let go = if g + 1 == graphs.end {
                        &dy
                    } else {
                        &dxs[g + 1]
                    };
                    callables[layout.callable_of_graph(g).unwrap()]
                        .backward(&gpu.stream, &[go], &[&dxs[g]], &slot_of(g))
                        .expect("eager backward");
                }
                steps.push((step, gpu.read(&dxs[graphs.start])));
            }
        }
    }
    let grads = callables
        .iter()
        .map(|c| (gpu.read(&c.dw), gpu.read(&c.db)))
        .collect();
    let counts = log
        .lock()
        .unwrap()
        .iter()
        .map(|&(_, p, at, c)| (p, at, c))
        .collect();
    Results {
        steps,
        grads,
        counts,
    }
}

/// Builds graphed callables for `options` with layers of `mode_of(callable)` (sample inputs
/// all 1.0, unlike the replayed ones), zeroes the gradients warmup touched.
fn build(
    gpu: &Gpu,
    options: GraphedOptions,
    mode_of: &dyn Fn(usize) -> Mode,
    log: &Log,
    counters: Option<&[Arc<DeviceBuffer<u32>>]>,
) -> Result<GraphedCallables<f32>> {
    let layout = options.schedule.layout().clone();
    let callables: Vec<Box<dyn Callable<f32>>> = (0..layout.total_callables())
        .map(|c| {
            let mut m = Moe::new(gpu, c, mode_of(c), log.clone());
            m.cast_counter = counters.map(|cs| cs[c].clone());
            Box::new(m) as Box<dyn Callable<f32>>
        })
        .collect();
    let sample = gpu.upload(&[1.0f32; N]);
    // One set per callable: the first layer of each chunk reads it.
    let samples: Vec<Vec<&DeviceBuffer<f32>>> = (0..layout.total_callables())
        .map(|c| {
            if layout.is_chunk_input(c) {
                vec![&sample]
            } else {
                vec![]
            }
        })
        .collect();
    let graphed = GraphedCallables::build(&gpu.stream, callables, &samples, options)?;
    gpu.stream.synchronize().expect("sync");
    for c in graphed.callables() {
        for g in c.gradients() {
            zero_f32(gpu, g);
        }
    }
    Ok(graphed)
}

/// Sets every element of `b` to 0.0 through `&` (gs_pass of a zero buffer).
fn zero_f32(gpu: &Gpu, b: &DeviceBuffer<f32>) {
    let zero = gpu.upload(&vec![0.0f32; b.len()]);
    let n = b.len() as u32;
    // SAFETY: gs_pass reads n floats of `zero` and writes n floats of `b` (zero / 2 = 0).
    unsafe {
        gpu.stream
            .launch(
                &gpu.k("gs_pass"),
                &LaunchConfig::for_elements(n, BLOCK),
                &kernel_args![zero, *b, n],
            )
            .expect("zero");
    }
    gpu.stream.synchronize().expect("sync");
}

/// Replays `STEPS` training steps with fresh input allocations (changing token
/// distributions), returns the results; `counts` are the eager segments' replay-time reads.
fn replay(gpu: &Gpu, graphed: &GraphedCallables<f32>, log: &Log) -> Results {
    let schedule = graphed.schedule().clone();
    let layout = schedule.layout();
    log.lock().unwrap().clear();
    let mut steps = Vec::new();
    for s in 0..STEPS {
        for &step in schedule.steps() {
            let (m, b) = (step.chunk(), step.microbatch());
            assert_eq!(graphed.next_step(), Some(step));
            let x = gpu.upload(&input(m, b, s));
            let dy = gpu.upload(&grad_output(m, b, s));
            let out = match step {
                Step::Forward { .. } => graphed.forward(m, b, &[&x], &gpu.stream),
                _ => graphed.backward(m, b, &[&dy], &gpu.stream),
            }
            .expect("replay");
            assert_eq!(out.len(), 1);
            steps.push((step, gpu.read(&out[0])));
        }
    }
    let grads = (0..layout.total_callables())
        .map(|c| {
            let g = graphed.callables()[c].gradients();
            (gpu.read(g[0]), gpu.read(g[1]))
        })
        .collect();
    let counts = log
        .lock()
        .unwrap()
        .iter()
        .map(|&(warm, p, at, c)| {
            assert!(!warm, "replay-time eager calls are not warmup");
            (p, at, c)
        })
        .collect();
    Results {
        steps,
        grads,
        counts,
    }
}

/// The host counts: vary between steps, include 0 and partial counts (the test is not
/// vacuous).
fn check_counts_vary(host: &Results) {
    let fwd: Vec<_> = host
        .counts
        .iter()
        .filter(|(p, _, _)| *p == Pass::Forward)
        .collect();
    let per_step = fwd.len() / STEPS;
    assert!(fwd.iter().any(|(_, _, c)| *c == 0), "some count must be 0");
    assert!(
        fwd.iter().any(|(_, _, c)| *c > 0 && (*c as usize) < N),
        "some count must be partial"
    );
    let changed = (0..per_step)
        .filter(|&k| fwd[k].2 != fwd[per_step + k].2)
        .count();
    assert!(
        changed * 2 >= per_step,
        "token distributions must change between steps ({changed} of {per_step} counts did)"
    );
}

/// Graphed (layers of `mode_of`) == eager == host, bit for bit, over the interleaved 2x3
/// order with layers [2, 2], with graphed segments merged across layers (the default) and
/// with one graph per segment; returns the latter (whose structure the callers inspect),
/// its results and the host's.
fn check_mode(mode_of: &dyn Fn(usize) -> Mode) -> (GraphedCallables<f32>, Results, Results) {
    let gpu = Gpu::new();
    let options = || GraphedOptions::from_order(&ORDER_2X3, vec![2, 2]).expect("valid order");
    let schedule = options().schedule.clone();
    let host = run_host(&schedule, STEPS);
    check_counts_vary(&host);
    let eager = run_eager(&gpu, &schedule);
    assert_bit_equal(&eager, &host, "eager vs host");
    assert_eq!(eager.counts, host.counts, "eager counts vs host");
    let log: Log = Arc::default();
    let merged = build(&gpu, options(), mode_of, &log, None).expect("build (merged)");
    assert!(merged.merges_layers());
    let got = replay(&gpu, &merged, &log);
    assert_bit_equal(
        &got,
        &eager,
        "graphed (segments merged across layers) vs eager",
    );
    let log: Log = Arc::default();
    let options = options().with_merge_layers(false);
    let graphed = build(&gpu, options, mode_of, &log, None).expect("build");
    let got = replay(&gpu, &graphed, &log);
    assert_bit_equal(&got, &eager, "graphed (one graph per segment) vs eager");
    assert!(
        host.grads
            .iter()
            .all(|(dw, _)| dw.iter().any(|&v| v != 0.0)),
        "gradients must be non-zero"
    );
    (graphed, got, host)
}

fn kernel_nodes(g: &cuda_graph::Graph) -> usize {
    g.nodes()
        .expect("nodes")
        .iter()
        .filter(|n| n.kind == NodeKind::Kernel)
        .count()
}

/// Router graphed, experts eager (host-read counts, grid from the count), combine graphed:
/// equal to eager and the host over 2 steps of the interleaved 2x3 order with changing
/// token distributions; the eager segments ran at every replay with the counts of that
/// step (in execution order); one exec per graphed segment, none for eager ones.
#[test]
#[ignore = "needs a CUDA device"]
fn breaking_layer_equals_eager_with_changing_tokens() {
    let (graphed, got, host) = check_mode(&|_| Mode::Breaking);
    assert_eq!(
        got.counts, host.counts,
        "the eager segments must run at every replay, in order, with that step's counts"
    );
    for g in 0..graphed.schedule().layout().total_graphs() {
        let fp = graphed.forward_plan(g).expect("plan");
        assert_eq!(fp.kinds(), [G, E, G]);
        assert_eq!(graphed.backward_plan(g).unwrap().kinds(), [G, E]);
        let f0 = graphed.forward_segment_exec(g, 0).expect("router exec");
        assert!(std::ptr::eq(graphed.forward_exec(g).unwrap(), f0));
        assert!(
            graphed.forward_segment_exec(g, 1).is_none(),
            "eager: no exec"
        );
        assert!(graphed.forward_segment_exec(g, 2).is_some(), "combine exec");
        assert!(graphed.forward_segment_exec(g, 3).is_none());
        assert!(graphed.backward_segment_exec(g, 0).is_some());
        assert!(graphed.backward_segment_exec(g, 1).is_none());
        // The graphs hold exactly their segments' kernels: the router (1), the combine (2);
        // the experts' launch is in no graph.
        assert_eq!(
            kernel_nodes(graphed.forward_segment_graph(g, 0).unwrap()),
            1
        );
        assert!(graphed.forward_segment_graph(g, 1).is_none());
        assert_eq!(
            kernel_nodes(graphed.forward_segment_graph(g, 2).unwrap()),
            2
        );
        assert_eq!(
            kernel_nodes(graphed.backward_segment_graph(g, 0).unwrap()),
            1
        );
        assert_eq!(graphed.casts_weights(g), Some(false));
    }
}

/// Full-layer mode: experts read the count from device memory, the whole pass is one graph
/// (the default segments): equal to eager; no eager code runs at replay.
#[test]
#[ignore = "needs a CUDA device"]
fn full_layer_mode_equals_eager() {
    let (graphed, got, _) = check_mode(&|_| Mode::FullLayer);
    assert!(
        got.counts.is_empty(),
        "no eager segment may run: {:?}",
        got.counts
    );
    for g in 0..graphed.schedule().layout().total_graphs() {
        assert!(graphed.forward_plan(g).unwrap().is_single_graph());
        assert!(graphed.backward_plan(g).unwrap().is_single_graph());
        assert_eq!(kernel_nodes(graphed.forward_graph(g).unwrap()), 4);
        assert_eq!(kernel_nodes(graphed.backward_graph(g).unwrap()), 2);
        assert!(graphed.forward_segment_exec(g, 1).is_none());
    }
}

/// The device-count layer split into several graphed segments (3 forward, 2 backward
/// graphs per slot), mixed in one chunk with breaking layers: equal to eager.
#[test]
#[ignore = "needs a CUDA device"]
fn several_graphed_segments_and_mixed_layers_equal_eager() {
    let mode_of = |c: usize| {
        if c % 2 == 0 {
            Mode::GraphedSegments
        } else {
            Mode::Breaking
        }
    };
    let (graphed, got, host) = check_mode(&mode_of);
    // Only the breaking layers (odd callables) logged counts, with the host's values.
    let layout = graphed.schedule().layout().clone();
    let want: Vec<_> = host
        .counts
        .iter()
        .filter(|(_, at, _)| layout.callable_index(at.chunk, at.layer).unwrap() % 2 == 1)
        .copied()
        .collect();
    assert_eq!(got.counts, want);
    for g in 0..layout.total_graphs() {
        let c = layout.callable_of_graph(g).unwrap();
        let fwd_graphs = if c % 2 == 0 { 3 } else { 2 };
        assert_eq!(
            graphed.forward_plan(g).unwrap().graphs(),
            fwd_graphs,
            "graph {g}"
        );
        for s in 0..3 {
            assert_eq!(
                graphed.forward_segment_exec(g, s).is_some(),
                c % 2 == 0 || s != 1,
                "graph {g} segment {s}"
            );
        }
    }
}

/// The weight casts go into the first graphed forward segment (segment 0 of a breaking
/// layer, segment 1 after an eager prologue): once per step per layer under all three
/// mechanisms; in Conditional mode the IF node sits in that segment's graph only; warmup
/// casts before every forward. Results still equal the host.
#[test]
#[ignore = "needs a CUDA device"]
fn weight_casts_go_in_the_first_graphed_segment() {
    let gpu = Gpu::new();
    let mut modes = vec![
        WeightCaching::detect(),
        WeightCaching::NoopFlag,
        WeightCaching::Static,
    ];
    modes.dedup();
    let mode_of = |c: usize| {
        if c % 2 == 0 {
            Mode::Breaking
        } else {
            Mode::EagerPrologue
        }
    };
    for caching in modes {
        // One graph per segment, so each IF node's graph is its layer's own.
        let options = GraphedOptions::from_order(&ORDER_2X3, vec![2, 2])
            .expect("valid order")
            .with_weight_caching(caching)
            .with_merge_layers(false);
        let schedule = options.schedule.clone();
        let layout = schedule.layout().clone();
        let counters: Vec<Arc<DeviceBuffer<u32>>> = (0..layout.total_callables())
            .map(|_| Arc::new(gpu.upload(&[0u32])))
            .collect();
        let log: Log = Arc::default();
        let graphed =
            build(&gpu, options, &mode_of, &log, Some(&counters)).expect("build with casts");
        let read = || -> Vec<u32> { counters.iter().map(|c| gpu.read(c)[0]).collect() };
        let warm = (WARMUP * schedule.num_microbatches()) as u32;
        assert_eq!(
            read(),
            vec![warm; counters.len()],
            "{caching:?}: warmup casts before every forward"
        );
        for g in 0..layout.total_graphs() {
            let c = layout.callable_of_graph(g).unwrap();
            let cast_seg = if c % 2 == 0 { 0 } else { 1 };
            assert_eq!(
                graphed.forward_plan(g).unwrap().cast_segment(),
                Some(cast_seg)
            );
            assert_eq!(graphed.casts_weights(g), Some(true), "graph {g}");
            let plan = graphed.forward_plan(g).unwrap().clone();
            for s in 0..plan.len() {
                let Some(graph) = graphed.forward_segment_graph(g, s) else {
                    continue;
                };
                let conds = graph
                    .nodes()
                    .expect("nodes")
                    .iter()
                    .filter(|n| n.kind == NodeKind::Conditional)
                    .count();
                let want = usize::from(s == cast_seg && caching == WeightCaching::Conditional);
                assert_eq!(conds, want, "{caching:?}: graph {g} segment {s} IF nodes");
            }
        }
        let before = read();
        let got = replay(&gpu, &graphed, &log);
        let after = read();
        for c in 0..counters.len() {
            assert_eq!(
                after[c] - before[c],
                STEPS as u32,
                "{caching:?}: callable {c} must cast once per step"
            );
        }
        let host = run_host(&schedule, STEPS);
        for (k, ((sg, g), (sw, w))) in got.steps.iter().zip(&host.steps).enumerate() {
            assert_eq!(sg, sw);
            assert_eq!(g, w, "{caching:?}: replay {k} ({sg:?})");
        }
    }
}

/// An eager-only layer (no graph in either pass) next to a breaking layer: allowed, equal to
/// the host; it has no execs and no runtime casts. A pass with eager segments is refused on
/// a capturing stream (before anything is enqueued).
#[test]
#[ignore = "needs a CUDA device"]
fn eager_only_layers_are_allowed_and_capture_is_refused() {
    let gpu = Gpu::new();
    let options = GraphedOptions::from_order(&[1, 1, 1, -1, -1, -1], vec![2]).expect("order");
    let schedule = options.schedule.clone();
    let log: Log = Arc::default();
    let mode_of = |c: usize| {
        if c == 0 {
            Mode::EagerOnly
        } else {
            Mode::Breaking
        }
    };
    let graphed = build(&gpu, options, &mode_of, &log, None).expect("build");
    let layout = schedule.layout().clone();
    for g in 0..layout.total_graphs() {
        let eager_only = layout.callable_of_graph(g) == Some(0);
        assert_eq!(graphed.forward_plan(g).unwrap().is_eager_only(), eager_only);
        assert_eq!(graphed.forward_exec(g).is_none(), eager_only, "graph {g}");
        assert_eq!(graphed.backward_exec(g).is_none(), eager_only, "graph {g}");
        assert_eq!(graphed.forward_graph(g).is_none(), eager_only, "graph {g}");
        assert_eq!(graphed.casts_weights(g), Some(false));
    }
    // Refused inside a capture, before anything is enqueued; the position does not move.
    let x = gpu.upload(&input(0, 0, 0));
    let side = Stream::new(&gpu.ctx).expect("stream");
    let e = side
        .capture(CaptureMode::ThreadLocal, |s| {
            graphed
                .forward(0, 0, &[&x], s.stream())
                .map(|_| ())
                .map_err(Into::into)
        })
        .map(|_| ())
        .unwrap_err();
    assert!(e.to_string().contains("capturing stream"), "{e}");
    assert_eq!(graphed.input_copies(), 0);
    assert_eq!(
        graphed.next_step(),
        Some(Step::Forward {
            chunk: 0,
            microbatch: 0
        })
    );

    let host = run_host(&schedule, STEPS);
    let got = replay(&gpu, &graphed, &log);
    assert_bit_equal(&got, &host, "eager-only + breaking vs host");
    assert_eq!(got.counts, host.counts);
}

/// A layer that declares no forward segments is rejected at build with its index.
#[test]
#[ignore = "needs a CUDA device"]
fn empty_segment_list_is_rejected() {
    let gpu = Gpu::new();
    let options = GraphedOptions::from_order(&[1, -1], vec![2]).expect("order");
    let log: Log = Arc::default();
    let mode_of = |c: usize| if c == 1 { Mode::Empty } else { Mode::Breaking };
    let e = build(&gpu, options, &mode_of, &log, None)
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert!(
        e.to_string()
            .contains("callable 1 declares no forward segments"),
        "{e}"
    );
    assert!(
        log.lock().unwrap().is_empty(),
        "nothing ran before the check"
    );
}

/// Pure logic, runs without a device: the default segments of a callable are one graphed
/// segment per pass, and the test modes' plans put the casts and graphs where the GPU tests
/// expect them.
#[test]
fn segment_plans_of_the_test_modes() {
    use graphed_callables::SegmentPlan;

    /// A callable that overrides nothing about segments.
    struct Plain;
    impl Callable<f32> for Plain {
        fn input_lens(&self) -> Vec<usize> {
            vec![1]
        }
        fn output_lens(&self) -> Vec<usize> {
            vec![1]
        }
        fn forward(
            &mut self,
            _: &Stream,
            _: &[&DeviceBuffer<f32>],
            _: &[&DeviceBuffer<f32>],
            _: &Slot<'_, f32>,
        ) -> Result<()> {
            Ok(())
        }
        fn backward(
            &mut self,
            _: &Stream,
            _: &[&DeviceBuffer<f32>],
            _: &[&DeviceBuffer<f32>],
            _: &Slot<'_, f32>,
        ) -> Result<()> {
            Ok(())
        }
    }
    assert_eq!(Plain.forward_segments(), [G]);
    assert_eq!(Plain.backward_segments(), [G]);

    let plan = |segs: Segments| SegmentPlan::new(segs.into_iter().map(|(k, _)| k).collect());
    let p = plan(Mode::Breaking.forward()).unwrap();
    assert_eq!((p.graphs(), p.cast_segment()), (2, Some(0)));
    let p = plan(Mode::EagerPrologue.forward()).unwrap();
    assert_eq!((p.graphs(), p.cast_segment()), (2, Some(1)));
    assert_eq!(p.graph_of(3), Some(1));
    let p = plan(Mode::FullLayer.forward()).unwrap();
    assert!(p.is_single_graph());
    let p = plan(Mode::GraphedSegments.forward()).unwrap();
    assert_eq!((p.graphs(), p.len()), (3, 3));
    let p = plan(Mode::EagerOnly.forward()).unwrap();
    assert!(p.is_eager_only());
    assert_eq!(p.cast_segment(), None);
    assert!(plan(Mode::Empty.forward()).is_err());
    for m in [
        Mode::Breaking,
        Mode::EagerPrologue,
        Mode::FullLayer,
        Mode::GraphedSegments,
        Mode::EagerOnly,
        Mode::Empty,
    ] {
        // Every backward starts its gradient with the pass-through before the experts
        // overwrite the routed entries.
        let stages: Vec<Stage> = m.backward().into_iter().flat_map(|(_, s)| s).collect();
        let pass = stages.iter().position(|&s| s == Stage::BwdPass).unwrap();
        let experts = stages
            .iter()
            .position(|&s| matches!(s, Stage::BwdExpertsHost | Stage::BwdExpertsDev))
            .unwrap();
        assert!(pass < experts, "{m:?}");
    }
}
