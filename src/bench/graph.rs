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

use super::{Row, median};

const CHAIN: usize = 1000;
const N: u32 = 1024;
const REPS: usize = 21;
const WARMUP: usize = 3;
const FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/bench_graph.fatbin"));

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

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
    let (replay, capture_safe, instantiate_safe) = graph_replay(&s)?;
    let (capture_raw, instantiate_raw) = capture_instantiate_raw(&s)?;
    let pdl = pdl_replay(&s)?;
    let (update, node_update) = updates(&s)?;

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
            yardstick: "target <= 0.35; CUDA C++ 0.15-0.23".into(),
            pass: Some(update <= 0.35),
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
fn per_kernel_us(s: &Setup, mut body: impl FnMut() -> BenchResult<()>) -> BenchResult<f64> {
    let (start, end) = (Event::new(&s.ctx)?, Event::new(&s.ctx)?);
    for _ in 0..WARMUP {
        body()?;
    }
    s.stream.synchronize()?;
    let mut samples = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        start.record(&s.stream)?;
        body()?;
        end.record(&s.stream)?;
        end.synchronize()?;
        samples.push(Event::elapsed_ms(&start, &end)? as f64 * 1000.0 / CHAIN as f64);
    }
    Ok(median(&mut samples))
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

/// Returns (replay us per kernel, capture ms, instantiate ms), safe API.
fn graph_replay(s: &Setup) -> BenchResult<(f64, f64, f64)> {
    let capture = host_median(5, 1e3, || {
        s.stream
            .capture(CaptureMode::Global, |scope| launch_chain(s, scope.stream()))
            .map(drop)
            .map_err(Into::into)
    })?;
    let graph = s
        .stream
        .capture(CaptureMode::Global, |scope| launch_chain(s, scope.stream()))?;
    let instantiate = host_median(5, 1e3, || {
        GraphExec::instantiate(&graph, InstantiateFlags::empty())
            .map(drop)
            .map_err(Into::into)
    })?;
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
    exec.upload(&s.stream)?;
    let before = s.x.to_vec(&s.stream)?[0];
    let us = per_kernel_us(s, || exec.launch(&s.stream).map_err(Into::into))?;
    verify(s, before + ((WARMUP + REPS) * CHAIN) as f32, "graph replay")?;
    Ok((us, capture, instantiate))
}

/// The same capture and instantiate through raw calls: (capture ms, instantiate ms).
fn capture_instantiate_raw(s: &Setup) -> BenchResult<(f64, f64)> {
    let d = sys::driver()?;
    let (begin, end, launch) = (
        d.cuStreamBeginCapture()?,
        d.cuStreamEndCapture()?,
        d.cuLaunchKernel()?,
    );
    let (instantiate, destroy_exec, destroy_graph) = (
        d.cuGraphInstantiateWithFlags()?,
        d.cuGraphExecDestroy()?,
        d.cuGraphDestroy()?,
    );
    let mut ptr = s.x.as_raw();
    let mut n = N;
    let mut params: [*mut c_void; 2] = [(&raw mut ptr).cast(), (&raw mut n).cast()];
    let (f, st) = (s.add_one.as_raw(), s.stream.as_raw());
    let mut capture_raw = || -> BenchResult<sys::CUgraph> {
        // SAFETY: live stream, kernel and params; the capture is ended below on this thread.
        unsafe {
            check_raw(
                "cuStreamBeginCapture",
                begin(st, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL),
            )?;
            for _ in 0..CHAIN {
                let rc = launch(
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
                check_raw("cuLaunchKernel", rc)?;
            }
            let mut g = std::ptr::null_mut();
            check_raw("cuStreamEndCapture", end(st, &mut g))?;
            Ok(g)
        }
    };
    let capture = host_median(5, 1e3, || {
        let g = capture_raw()?;
        // SAFETY: the graph was just created and is destroyed once.
        unsafe { destroy_graph(g) };
        Ok(())
    })?;
    let g = capture_raw()?;
    let inst = host_median(5, 1e3, || {
        let mut e = std::ptr::null_mut();
        // SAFETY: live graph, valid out-pointer; the exec is destroyed once.
        unsafe {
            check_raw("cuGraphInstantiateWithFlags", instantiate(&mut e, g, 0))?;
            destroy_exec(e);
        }
        Ok(())
    });
    // SAFETY: created above, destroyed once.
    unsafe { destroy_graph(g) };
    Ok((capture, inst?))
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

/// (whole-graph update ms, one kernel-node update us); both checked to take effect.
fn updates(s: &Setup) -> BenchResult<(f64, f64)> {
    let other = DeviceBuffer::from_host(&s.stream, &vec![0.0f32; N as usize])?;
    let (graph_x, nodes) = explicit_chain(s, &s.add_one, &s.x, false)?;
    let (graph_other, _) = explicit_chain(s, &s.add_one, &other, false)?;
    let mut exec = GraphExec::instantiate(&graph_x, InstantiateFlags::empty())?;
    let mut flip = false;
    let update = host_median(8, 1e3, || {
        flip = !flip;
        exec.update(if flip { &graph_other } else { &graph_x })
            .map_err(Into::into)
    })?;
    // After an odd number of updates (1 + 8) the exec points at `other`.
    exec.launch(&s.stream)?;
    let got = other.to_vec(&s.stream)?;
    if got.iter().any(|&v| v != CHAIN as f32) {
        return Err(format!("exec update did not take effect: other[0] = {}", got[0]).into());
    }

    let node = &nodes[CHAIN / 2];
    let args_x = KernelArgs::new().arg(&s.x).arg(&N);
    let args_other = KernelArgs::new().arg(&other).arg(&N);
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
    Ok((update, node_update))
}
