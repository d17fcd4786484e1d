//! `fp8-moe bench graph`: a dependent chain of 1000 launches of a kernel that adds 1.0 to
//! 1024 floats (4 blocks of 256 threads), measured three ways in one run: through the safe
//! API, through the raw driver table (the floor the safe layer must not add to), and as a
//! graph; plus capture, instantiate, whole-graph update and one kernel-node update.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use cuda_graph::sys::{self, CUresult};
use cuda_graph::{
    CaptureMode, Context, DeviceBuffer, Event, Graph, GraphExec, InstantiateFlags, Kernel,
    KernelArgs, KernelNode, LaunchConfig, Module, Node, Stream,
};

use super::{BenchResult, Row, event_median_ms, median};

const CHAIN: usize = 1000;
const N: u32 = 1024;
const REPS: usize = 21;
const WARMUP: usize = 3;
const FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/bench_graph.fatbin"));

struct Setup {
    ctx: Arc<Context>,
    stream: Stream,
    add_one: Kernel,
    add_one_pdl: Kernel,
    x: DeviceBuffer<f32>,
    cfg: LaunchConfig,
}

fn check_raw(call: &'static str, rc: CUresult) -> BenchResult<()> {
    if rc == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cuda_graph::Error::driver(call, rc).into())
    }
}

/// Runs the benchmark; returns the rows (also printed by the caller).
pub fn run() -> BenchResult<Vec<Row>> {
    let ctx = Context::default_device()?;
    let stream = Stream::new(&ctx)?;
    let module = Module::from_image(&ctx, FATBIN)?;
    let s = Setup {
        add_one: module.kernel("add_one")?,
        add_one_pdl: module.kernel("add_one_pdl")?,
        x: DeviceBuffer::from_host(&stream, &vec![0.0f32; N as usize])?,
        cfg: LaunchConfig::linear(4, 256),
        ctx,
        stream,
    };

    // Bring the GPU out of idle clocks before measuring anything.
    for _ in 0..100 {
        launch_chain(&s, &s.stream)?;
    }
    s.stream.synchronize()?;
    let (eager_safe, eager_raw) = eager(&s)?;
    let raw = Raw::load()?;
    let replay = graph_replay(&s)?;
    let [capture_safe, instantiate_safe, capture_raw, instantiate_raw] =
        capture_instantiate(&s, &raw)?;
    let pdl = pdl_replay(&s)?;
    let other = DeviceBuffer::from_host(&s.stream, &vec![0.0f32; N as usize])?;
    let (update, update_raw, update_same) = whole_graph_update(&s, &raw, &other)?;
    let node_update = node_update(&s, &other)?;

    let ci_safe = capture_safe + instantiate_safe;
    let ci_raw = capture_raw + instantiate_raw;
    Ok(vec![
        Row {
            name: "eager launch, safe API (per kernel)".into(),
            value: eager_safe,
            unit: "us",
            yardstick: format!(
                "raw table {eager_raw:.3} us in this run (<= 1.10x: {:.3}); CUDA C++ 3.4-4.1, PyTorch 6.9",
                eager_safe / eager_raw
            ),
            pass: Some(eager_safe <= 1.10 * eager_raw),
        },
        Row {
            name: "eager launch, raw table (per kernel)".into(),
            value: eager_raw,
            unit: "us",
            yardstick: "the floor; CUDA C++ 3.4-4.1".into(),
            pass: None,
        },
        Row {
            name: "graph replay (per kernel)".into(),
            value: replay,
            unit: "us",
            yardstick: "target <= 0.9; CUDA C++ 0.83, PyTorch CUDAGraph 1.10".into(),
            pass: Some(replay <= 0.9),
        },
        Row {
            name: "graph replay, programmatic edges (per kernel)".into(),
            value: pdl,
            unit: "us",
            yardstick: "target <= 0.7; CUDA C++ 0.66".into(),
            pass: Some(pdl <= 0.7),
        },
        Row {
            name: "capture + instantiate, safe API".into(),
            value: ci_safe,
            unit: "ms",
            yardstick: format!(
                "raw {ci_raw:.3} ms in this run (<= 1.15x: {:.3}); capture {capture_safe:.3} + instantiate {instantiate_safe:.3}; CUDA C++ 1.5 + 3.7-5.9, PyTorch 9.7",
                ci_safe / ci_raw
            ),
            pass: Some(ci_safe <= 1.15 * ci_raw),
        },
        Row {
            name: "capture + instantiate, raw table".into(),
            value: ci_raw,
            unit: "ms",
            yardstick: format!("capture {capture_raw:.3} + instantiate {instantiate_raw:.3}"),
            pass: None,
        },
        Row {
            name: "whole-graph exec update".into(),
            value: update,
            unit: "ms",
            yardstick: format!(
                "target <= 0.35; raw cuGraphExecUpdate {update_raw:.3} ms in this run; CUDA C++ 0.15-0.23"
            ),
            pass: Some(update <= 0.35),
        },
        Row {
            name: "whole-graph exec update, unchanged arguments".into(),
            value: update_same,
            unit: "ms",
            yardstick: "a recapture of the same chain; the row above changes every node".into(),
            pass: None,
        },
        Row {
            name: "one kernel-node parameter update".into(),
            value: node_update,
            unit: "us",
            yardstick: "target <= 1.5; CUDA C++ 0.34-0.66".into(),
            pass: Some(node_update <= 1.5),
        },
    ])
}

/// Median over REPS of (end - start) / CHAIN in microseconds, after WARMUP runs of `body`.
fn per_kernel_us(s: &Setup, body: impl FnMut() -> BenchResult<()>) -> BenchResult<f64> {
    Ok(event_median_ms(&s.stream, WARMUP, REPS, body)? * 1000.0 / CHAIN as f64)
}

/// Median host time of `body` in the unit `scale` converts seconds to.
fn host_median(
    reps: usize,
    scale: f64,
    mut body: impl FnMut() -> BenchResult<()>,
) -> BenchResult<f64> {
    body()?;
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        body()?;
        samples.push(t.elapsed().as_secs_f64() * scale);
    }
    Ok(median(&mut samples))
}

/// Reads x back and checks every element equals `want` (the chain's additions are exact).
fn verify(s: &Setup, want: f32, what: &str) -> BenchResult<()> {
    let x = s.x.to_vec(&s.stream)?;
    if let Some((i, v)) = x.iter().enumerate().find(|(_, v)| **v != want) {
        return Err(format!("{what}: x[{i}] = {v}, expected {want}").into());
    }
    Ok(())
}

fn launch_chain(s: &Setup, stream: &Stream) -> cuda_graph::Result<()> {
    let args = KernelArgs::new().arg(&s.x).arg(&N);
    for _ in 0..CHAIN {
        // SAFETY: add_one(float*, unsigned) touches x[0..N), which x holds.
        unsafe { stream.launch(&s.add_one, &s.cfg, &args) }?;
    }
    Ok(())
}

/// Eager launches through the safe API and through the raw table, measured alternately
/// (safe, raw, safe, ...) so both see the same clocks: (safe us, raw us) per kernel.
fn eager(s: &Setup) -> BenchResult<(f64, f64)> {
    let d = sys::driver()?;
    let launch = d.cuLaunchKernel()?;
    let mut ptr = s.x.as_raw();
    let mut n = N;
    let mut params: [*mut c_void; 2] = [(&raw mut ptr).cast(), (&raw mut n).cast()];
    let (f, st) = (s.add_one.as_raw(), s.stream.as_raw());
    let mut raw_chain = || -> BenchResult<()> {
        for _ in 0..CHAIN {
            // SAFETY: live kernel and stream; params point at live locals of the right types.
            let rc = unsafe {
                launch(
                    f,
                    4,
                    1,
                    1,
                    256,
                    1,
                    1,
                    0,
                    st,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            check_raw("cuLaunchKernel", rc)?;
        }
        Ok(())
    };
    let before = s.x.to_vec(&s.stream)?[0];
    let (start, end) = (Event::new(&s.ctx)?, Event::new(&s.ctx)?);
    let time = |body: &mut dyn FnMut() -> BenchResult<()>| -> BenchResult<f64> {
        start.record(&s.stream)?;
        body()?;
        end.record(&s.stream)?;
        end.synchronize()?;
        Ok(Event::elapsed_ms(&start, &end)? as f64 * 1000.0 / CHAIN as f64)
    };
    let (mut safe, mut raw) = (Vec::with_capacity(REPS), Vec::with_capacity(REPS));
    for rep in 0..WARMUP + REPS {
        let a = time(&mut || launch_chain(s, &s.stream).map_err(Into::into))?;
        let b = time(&mut raw_chain)?;
        if rep >= WARMUP {
            safe.push(a);
            raw.push(b);
        }
    }
    verify(s, before + (2 * (WARMUP + REPS) * CHAIN) as f32, "eager")?;
    Ok((median(&mut safe), median(&mut raw)))
}

/// Graph replay of the captured chain: us per kernel.
fn graph_replay(s: &Setup) -> BenchResult<f64> {
    let graph = capture_chain(s, &s.x)?;
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
    exec.upload(&s.stream)?;
    let before = s.x.to_vec(&s.stream)?[0];
    let us = per_kernel_us(s, || exec.launch(&s.stream).map_err(Into::into))?;
    verify(s, before + ((WARMUP + REPS) * CHAIN) as f32, "graph replay")?;
    Ok(us)
}

/// The chain over `x`, captured through the safe API.
fn capture_chain(s: &Setup, x: &DeviceBuffer<f32>) -> cuda_graph::Result<Graph> {
    let args = KernelArgs::new().arg(x).arg(&N);
    s.stream.capture(CaptureMode::Global, |scope| {
        for _ in 0..CHAIN {
            // SAFETY: add_one(float*, unsigned) touches x[0..N), which x holds.
            unsafe { scope.stream().launch(&s.add_one, &s.cfg, &args) }?;
        }
        Ok(())
    })
}

/// The raw driver calls the safe layer is measured against.
struct Raw {
    begin: <sys::PFN_cuStreamBeginCapture_v10010 as sys::EntryFn>::Fn,
    end: <sys::PFN_cuStreamEndCapture_v10000 as sys::EntryFn>::Fn,
    launch: <sys::PFN_cuLaunchKernel_v4000 as sys::EntryFn>::Fn,
    instantiate: <sys::PFN_cuGraphInstantiateWithFlags_v11040 as sys::EntryFn>::Fn,
    update: <sys::PFN_cuGraphExecUpdate_v12000 as sys::EntryFn>::Fn,
    destroy_exec: <sys::PFN_cuGraphExecDestroy_v10000 as sys::EntryFn>::Fn,
    destroy_graph: <sys::PFN_cuGraphDestroy_v10000 as sys::EntryFn>::Fn,
}

impl Raw {
    fn load() -> BenchResult<Raw> {
        let d = sys::driver()?;
        Ok(Raw {
            begin: d.cuStreamBeginCapture()?,
            end: d.cuStreamEndCapture()?,
            launch: d.cuLaunchKernel()?,
            instantiate: d.cuGraphInstantiateWithFlags()?,
            update: d.cuGraphExecUpdate()?,
            destroy_exec: d.cuGraphExecDestroy()?,
            destroy_graph: d.cuGraphDestroy()?,
        })
    }

    /// Captures the chain over `x` with raw calls; the caller destroys the graph.
    fn capture(&self, s: &Setup, x: &DeviceBuffer<f32>) -> BenchResult<sys::CUgraph> {
        let mut ptr = x.as_raw();
        let mut n = N;
        let mut params: [*mut c_void; 2] = [(&raw mut ptr).cast(), (&raw mut n).cast()];
        let (f, st) = (s.add_one.as_raw(), s.stream.as_raw());
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
        // SAFETY: live stream, kernel and params; the capture ends below on this thread (a
        // failed launch still ends it before returning).
        unsafe {
            check_raw("cuStreamBeginCapture", (self.begin)(st, mode))?;
            let mut rc = CUresult::CUDA_SUCCESS;
            for _ in 0..CHAIN {
                rc = (self.launch)(
                    f,
                    4,
                    1,
                    1,
                    256,
                    1,
                    1,
                    0,
                    st,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                );
                if rc != CUresult::CUDA_SUCCESS {
                    break;
                }
            }
            let mut g = std::ptr::null_mut();
            let end_rc = (self.end)(st, &mut g);
            check_raw("cuLaunchKernel", rc)?;
            check_raw("cuStreamEndCapture", end_rc)?;
            Ok(g)
        }
    }

    fn instantiate(&self, g: sys::CUgraph) -> BenchResult<sys::CUgraphExec> {
        let mut e = std::ptr::null_mut();
        // SAFETY: live graph, valid out-pointer.
        check_raw("cuGraphInstantiateWithFlags", unsafe {
            (self.instantiate)(&mut e, g, 0)
        })?;
        Ok(e)
    }
}

/// Capture and instantiate of the chain through the safe API and raw calls, alternately:
/// medians of (safe capture, safe instantiate, raw capture, raw instantiate), in ms.
fn capture_instantiate(s: &Setup, raw: &Raw) -> BenchResult<[f64; 4]> {
    let mut samples: [Vec<f64>; 4] = Default::default();
    let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
    for rep in 0..WARMUP + REPS {
        let t = Instant::now();
        let graph = capture_chain(s, &s.x)?;
        let cap_safe = ms(t);
        let t = Instant::now();
        let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
        let inst_safe = ms(t);
        drop((exec, graph));

        let t = Instant::now();
        let g = raw.capture(s, &s.x)?;
        let cap_raw = ms(t);
        let t = Instant::now();
        let e = raw.instantiate(g);
        let inst_raw = ms(t);
        // SAFETY: created above, destroyed once.
        unsafe {
            if let Ok(e) = e {
                (raw.destroy_exec)(e);
            }
            (raw.destroy_graph)(g);
        }
        e?;
        if rep >= WARMUP {
            for (v, x) in samples
                .iter_mut()
                .zip([cap_safe, inst_safe, cap_raw, inst_raw])
            {
                v.push(x);
            }
        }
    }
    Ok(samples.map(|mut v| median(&mut v)))
}

/// Builds the chain explicitly, with `edge` connecting consecutive kernel nodes.
fn explicit_chain(
    s: &Setup,
    kernel: &Kernel,
    x: &DeviceBuffer<f32>,
    programmatic: bool,
) -> BenchResult<(Graph, Vec<KernelNode>)> {
    let mut graph = Graph::new(&s.ctx)?;
    let args = KernelArgs::new().arg(x).arg(&N);
    let mut nodes: Vec<KernelNode> = Vec::with_capacity(CHAIN);
    for i in 0..CHAIN {
        let deps: Vec<Node> = if i == 0 || programmatic {
            Vec::new()
        } else {
            vec![nodes[i - 1].node()]
        };
        // SAFETY: the chain kernels touch x[0..N), which x holds.
        let node = unsafe { graph.add_kernel(&deps, kernel, &s.cfg, &args) }?;
        if programmatic && i > 0 {
            graph.add_programmatic_dependency(&nodes[i - 1], &node)?;
        }
        nodes.push(node);
    }
    Ok((graph, nodes))
}

fn pdl_replay(s: &Setup) -> BenchResult<f64> {
    let (graph, _) = explicit_chain(s, &s.add_one_pdl, &s.x, true)?;
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
    exec.upload(&s.stream)?;
    let before = s.x.to_vec(&s.stream)?[0];
    let us = per_kernel_us(s, || exec.launch(&s.stream).map_err(Into::into))?;
    verify(
        s,
        before + ((WARMUP + REPS) * CHAIN) as f32,
        "programmatic edges",
    )?;
    Ok(us)
}

/// Whole-graph update of the captured chain between two buffers, through the safe API and
/// raw calls alternately, checked to take effect; then updates between two captures of the
/// same chain (nothing changes): (safe ms, raw ms, unchanged-arguments ms).
fn whole_graph_update(
    s: &Setup,
    raw: &Raw,
    other: &DeviceBuffer<f32>,
) -> BenchResult<(f64, f64, f64)> {
    let (gx, go) = (capture_chain(s, &s.x)?, capture_chain(s, other)?);
    let mut exec = GraphExec::instantiate(&gx, InstantiateFlags::empty())?;
    let raw_exec = raw.instantiate(gx.as_raw())?;
    let (mut safe, mut rawv) = (Vec::new(), Vec::new());
    let mut result = Ok(());
    for rep in 0..WARMUP + REPS + 1 {
        // Ends (odd count) pointing at `other`.
        let target = if rep % 2 == 0 { &go } else { &gx };
        let t = Instant::now();
        if let Err(e) = exec.update(target) {
            result = Err(e.into());
            break;
        }
        let a = t.elapsed().as_secs_f64() * 1e3;
        let mut info = sys::CUgraphExecUpdateResultInfo {
            result: sys::CUgraphExecUpdateResult(0),
            errorNode: std::ptr::null_mut(),
            errorFromNode: std::ptr::null_mut(),
        };
        let t = Instant::now();
        // SAFETY: live exec and graph, valid out-pointer.
        let rc = unsafe { (raw.update)(raw_exec, target.as_raw(), &mut info) };
        let b = t.elapsed().as_secs_f64() * 1e3;
        if let Err(e) = check_raw("cuGraphExecUpdate", rc) {
            result = Err(e);
            break;
        }
        if rep >= WARMUP {
            safe.push(a);
            rawv.push(b);
        }
    }
    // SAFETY: created above, destroyed once.
    unsafe { (raw.destroy_exec)(raw_exec) };
    result?;
    let before = other.to_vec(&s.stream)?[0];
    exec.launch(&s.stream)?;
    if other.to_vec(&s.stream)?[0] != before + CHAIN as f32 {
        return Err("exec update did not take effect".into());
    }
    let go2 = capture_chain(s, other)?;
    let mut flip = false;
    let same = host_median(REPS, 1e3, || {
        flip = !flip;
        exec.update(if flip { &go2 } else { &go })
            .map_err(Into::into)
    })?;
    Ok((median(&mut safe), median(&mut rawv), same))
}

/// One kernel-node parameter update on the explicitly built chain, us; checked to take effect.
fn node_update(s: &Setup, other: &DeviceBuffer<f32>) -> BenchResult<f64> {
    let (graph, nodes) = explicit_chain(s, &s.add_one, other, false)?;
    let mut exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
    let node = &nodes[CHAIN / 2];
    let args_x = KernelArgs::new().arg(&s.x).arg(&N);
    let args_other = KernelArgs::new().arg(other).arg(&N);
    let mut flip = false;
    let node_update = host_median(1000, 1e6, || {
        flip = !flip;
        let args = if flip { &args_x } else { &args_other };
        // SAFETY: same kernel, same argument types; both buffers hold N floats.
        unsafe { exec.set_kernel_params(node, &s.add_one, &s.cfg, args) }.map_err(Into::into)
    })?;
    // 1 + 1000 updates: the node now writes x while the other 999 still write `other`.
    let (x0, o0) = (s.x.to_vec(&s.stream)?[0], other.to_vec(&s.stream)?[0]);
    exec.launch(&s.stream)?;
    let (x1, o1) = (s.x.to_vec(&s.stream)?[0], other.to_vec(&s.stream)?[0]);
    if x1 - x0 != 1.0 || o1 - o0 != (CHAIN - 1) as f32 {
        return Err(format!(
            "node update did not take effect: x +{}, other +{}",
            x1 - x0,
            o1 - o0
        )
        .into());
    }
    Ok(node_update)
}
