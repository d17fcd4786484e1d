//! `fp8-moe bench gemm`: our FP8 GEMMs against cuBLASLt (loaded at run time, the yardstick
//! only) in the same run, each checked against the other before it is timed.

use std::sync::Arc;

use cuda_graph::half::bf16;
use cuda_graph::{CaptureMode, Context, DeviceBuffer, GraphExec, InstantiateFlags, Stream};
use fp8_kernels::gemm::{
    ALIGN_ROWS, BlockOperand, GemmOptions, GemmOut, GemmPath, GemmShape, GroupedShape, Operand,
    PackedShape, WgradShape, gemm, gemm_blockwise, grouped_gemm, grouped_gemm_packed,
    grouped_gemm_wgrad, split_k_workspace_bytes,
};
use fp8_kernels::{DeviceScalar, Fp8Format};

use super::cublaslt::{CublasLt, Plan};
use super::{BenchResult, Row, event_median_ms, timed_medians, xorshift};

const WARMUP: usize = 3;
const REPS: usize = 10;
/// (M, N, K) of the dense shapes the issue names.
const SHAPES: [(usize, usize, usize); 5] = [
    (8192, 8192, 8192),
    (4096, 7168, 4096),
    (2048, 2048, 2048),
    (128, 7168, 2048),
    (64, 4096, 7168),
];
/// cuBLASLt on this H200, measured earlier through torch._scaled_mm (TFLOP/s).
const CUBLAS_BEFORE: [f64; 5] = [1440.0, 1094.0, 477.0, 121.0, 132.0];
/// Issue 13's targets for `SHAPES`: our rate over cuBLASLt's in the same run (promoted sums,
/// bf16 out).
const TARGET_VS_CUBLAS: [f64; 5] = [1.05, 1.05, 1.05, 1.0, 1.5];
/// The grouped problem: 8 groups sharing N and K.
const GROUPS: usize = 8;
const GROUP_N: usize = 4096;
const GROUP_K: usize = 2048;

/// The MoE layer's expert GEMMs in its packed layout (H = F = 2048, 8 experts, top-2): the
/// row counts of T = 4096 (8192 assignments, uneven like a router's) and of T = 256 (512).
const PACKED_COUNTS: [(&str, [usize; 8]); 2] = [
    ("T=4096", [1100, 950, 1024, 1010, 980, 1070, 1040, 1018]),
    ("T=256", [70, 58, 64, 66, 61, 69, 60, 64]),
];
/// (name, N, K) of the packed forward-layout GEMMs: fc1's forward, fc1's data gradient.
const PACKED_FWD: [(&str, usize, usize); 2] =
    [("fc1 forward", 4096, 2048), ("fc1 dgrad", 2048, 4096)];
/// (M, N) of the packed weight gradient: fc1's (2F x H).
const PACKED_WGRAD: (usize, usize) = (4096, 2048);

/// Small problems (M, N, K, accumulate) whose time is the kernel's latency: the three GEMMs
/// of the graphed-callables bench's FP8 linear layers (forward, dgrad, wgrad) at 16 tokens
/// with 128/256 features and at 64 tokens with 1024/2048, f32 out.
const SMALL: [(usize, usize, usize, bool); 6] = [
    (16, 256, 128, false),
    (16, 128, 256, false),
    (256, 128, 16, true),
    (64, 2048, 1024, false),
    (64, 1024, 2048, false),
    (2048, 1024, 64, true),
];
/// GEMMs per graph when timing the small problems.
const CHAIN: usize = 50;

/// Device microseconds per GEMM of a small problem on `path`: `CHAIN` launches captured
/// into one graph, replayed (median), divided by `CHAIN`.
fn small_us(
    stream: &Stream,
    (m, n, k, acc): (usize, usize, usize, bool),
    path: GemmPath,
    one: &DeviceScalar,
) -> BenchResult<f64> {
    let ctx = stream.context();
    let a = DeviceBuffer::from_host(stream, &random_e4m3(m * k, 60))?;
    let b = DeviceBuffer::from_host(stream, &random_e4m3(n * k, 61))?;
    let d = DeviceBuffer::<f32>::alloc(ctx, m * n)?;
    let run = |s: &Stream| {
        gemm(
            s,
            GemmShape::new(m, n, k),
            e4m3(&a, one),
            e4m3(&b, one),
            GemmOut::F32(&d),
            GemmOptions::new().path(path).accumulate(acc),
        )
    };
    run(stream)?;
    let graph = stream.capture(CaptureMode::ThreadLocal, |s| {
        (0..CHAIN).try_for_each(|_| run(s.stream()))
    })?;
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
    let ms = event_median_ms(stream, WARMUP, REPS, || Ok(exec.launch(stream)?))?;
    Ok(ms * 1e3 / CHAIN as f64)
}

/// Random E4M3 bytes without NaN (0x7f, 0xff).
fn random_e4m3(n: usize, seed: u64) -> Vec<u8> {
    let mut next = xorshift(seed);
    (0..n)
        .map(|_| {
            let b = (next() >> 24) as u8;
            if b & 0x7f == 0x7f { b ^ 0x01 } else { b }
        })
        .collect()
}

/// max |ours - theirs| / max |theirs| over the whole output; infinite when either holds a
/// non-finite value (an unwritten, poisoned element) or the lengths differ.
fn rel_err(ours: &[bf16], theirs: &[bf16]) -> f64 {
    let (mut err, mut mag) = (0.0f64, 0.0f64);
    if ours.len() != theirs.len() {
        return f64::INFINITY;
    }
    for (&o, &t) in ours.iter().zip(theirs) {
        let (o, t) = (f64::from(o), f64::from(t));
        if !o.is_finite() || !t.is_finite() {
            return f64::INFINITY;
        }
        err = err.max((o - t).abs());
        mag = mag.max(t.abs());
    }
    if mag == 0.0 { err } else { err / mag }
}

struct Dense {
    shape: GemmShape,
    a: DeviceBuffer<u8>,
    b: DeviceBuffer<u8>,
    d: DeviceBuffer<bf16>,
    d_ref: DeviceBuffer<bf16>,
}

fn dense(stream: &Stream, m: usize, n: usize, k: usize, seed: u64) -> BenchResult<Dense> {
    let ctx = stream.context();
    let d = DeviceBuffer::<bf16>::alloc(ctx, m * n)?;
    let d_ref = DeviceBuffer::<bf16>::alloc(ctx, m * n)?;
    d.memset_bytes(stream, 0xff)?;
    d_ref.memset_bytes(stream, 0xff)?;
    Ok(Dense {
        shape: GemmShape::new(m, n, k),
        a: DeviceBuffer::from_host(stream, &random_e4m3(m * k, seed))?,
        b: DeviceBuffer::from_host(stream, &random_e4m3(n * k, seed + 1))?,
        d,
        d_ref,
    })
}

/// An E4M3 operand with the given scale_inv.
fn e4m3<'a>(data: &'a DeviceBuffer<u8>, scale_inv: &'a DeviceScalar) -> Operand<'a> {
    Operand {
        data,
        format: Fp8Format::E4M3,
        scale_inv,
    }
}

fn tflops(m: usize, n: usize, k: usize, ms: f64) -> f64 {
    2.0 * m as f64 * n as f64 * k as f64 / (ms * 1e-3) / 1e12
}

/// Our per-tensor-scaled GEMM of `p`'s operands (scale 1) into `d`.
fn per_tensor(
    stream: &Stream,
    p: &Dense,
    one: &DeviceScalar,
    d: &DeviceBuffer<bf16>,
    opts: GemmOptions<'_>,
) -> cuda_graph::Result<()> {
    gemm(
        stream,
        p.shape,
        e4m3(&p.a, one),
        e4m3(&p.b, one),
        GemmOut::Bf16(d),
        opts,
    )
}

/// Our GEMM (`run_ours`, into `p.d`) and a cuBLASLt plan (into `p.d_ref`) on the same
/// operands: both run once and must agree within 2e-2 (an error naming `what` otherwise),
/// then the median TFLOP/s of each; returns (ours, cuBLASLt's, their relative difference).
fn ours_and_cublaslt(
    stream: &Stream,
    p: &Dense,
    plan: &Plan<'_>,
    what: &str,
    run_ours: impl Fn() -> cuda_graph::Result<()>,
) -> BenchResult<(f64, f64, f64)> {
    let run_lt = || run_cublaslt(stream, p, plan);
    run_ours()?;
    run_lt()?;
    let err = rel_err(&p.d.to_vec(stream)?, &p.d_ref.to_vec(stream)?);
    if err.is_nan() || err >= 2e-2 {
        return Err(format!("{what}: ours and cuBLASLt differ (rel err {err:.2e})").into());
    }
    let ours = event_median_ms(stream, WARMUP, REPS, || run_ours().map_err(Into::into))?;
    let theirs = event_median_ms(stream, WARMUP, REPS, run_lt)?;
    let GemmShape { m, n, k } = p.shape;
    Ok((tflops(m, n, k, ours), tflops(m, n, k, theirs), err))
}

/// cuBLASLt's GEMM of `p` into `p.d_ref` on `stream`.
fn run_cublaslt(stream: &Stream, p: &Dense, plan: &Plan<'_>) -> BenchResult<()> {
    plan.run(
        stream.as_raw(),
        p.a.as_raw(),
        p.b.as_raw(),
        p.d_ref.as_raw(),
    )
}

/// GEMMs per timed sample of the back-to-back rows.
const BACK_TO_BACK: usize = 20;

/// Ours and cuBLASLt on `p` launched [`BACK_TO_BACK`] times in a row per timed sample (the
/// rate of a stream of such GEMMs, as a decode loop issues them, with each launch's latency
/// hidden behind the GEMM before it): TFLOP/s of each, and the host time one call of each
/// takes to enqueue (us).
fn back_to_back(
    stream: &Stream,
    p: &Dense,
    plan: &Plan<'_>,
    run_ours: impl Fn() -> cuda_graph::Result<()>,
) -> BenchResult<[f64; 4]> {
    let run_lt = || run_cublaslt(stream, p, plan);
    let ours = timed_medians(stream, WARMUP, REPS, || {
        (0..BACK_TO_BACK).try_for_each(|_| run_ours().map_err(Into::into))
    })?;
    let theirs = timed_medians(stream, WARMUP, REPS, || {
        (0..BACK_TO_BACK).try_for_each(|_| run_lt())
    })?;
    let GemmShape { m, n, k } = p.shape;
    let per = BACK_TO_BACK as f64;
    Ok([
        tflops(m, n, k, ours.gpu_ms / per),
        tflops(m, n, k, theirs.gpu_ms / per),
        ours.host_ms / per * 1e3,
        theirs.host_ms / per * 1e3,
    ])
}

/// Runs the benchmark; returns the rows.
pub fn run() -> BenchResult<Vec<Row>> {
    let ctx: Arc<Context> = Context::default_device()?;
    let stream = Stream::new(&ctx)?;
    let lt = CublasLt::open(&ctx)?;
    let one = DeviceScalar::new(&stream, 1.0)?;
    let scales = [one.device_ptr(), one.device_ptr()];
    let mut rows = Vec::new();
    for (i, &(m, n, k)) in SHAPES.iter().enumerate() {
        let p = dense(&stream, m, n, k, 10 + i as u64)?;
        let plan = lt.plan(m, n, k, scales)?;
        let run_ours = || per_tensor(&stream, &p, &one, &p.d, GemmOptions::default());
        let (ours, theirs, err) =
            ours_and_cublaslt(&stream, &p, &plan, &format!("{m}x{n}x{k}"), run_ours)?;
        rows.push(Row {
            name: format!("gemm {m}x{n}x{k} e4m3 -> bf16"),
            value: ours,
            unit: "TFLOP/s",
            yardstick: format!(
                "cuBLASLt {theirs:.0} in this run ({:.2}x; target >= {:.2}x; earlier {:.0}); rel \
                 err vs cuBLASLt {err:.1e}",
                ours / theirs,
                TARGET_VS_CUBLAS[i],
                CUBLAS_BEFORE[i]
            ),
            pass: Some(ours >= TARGET_VS_CUBLAS[i] * theirs),
        });
        // The skinny shapes (at most 128 rows), whose GEMMs take about as long as a launch:
        // also back to back.
        if m <= 128 {
            let [ours, theirs, host_ours, host_lt] = back_to_back(&stream, &p, &plan, run_ours)?;
            rows.push(Row {
                name: format!("gemm {m}x{n}x{k} e4m3 -> bf16, {BACK_TO_BACK} back to back"),
                value: ours,
                unit: "TFLOP/s",
                yardstick: format!(
                    "cuBLASLt {theirs:.0} launched the same way in this run ({:.2}x); host time \
                     to enqueue one: ours {host_ours:.1} us, cuBLASLt's {host_lt:.1} us",
                    ours / theirs
                ),
                pass: None,
            });
        }
    }

    // Skinny M with a split-K workspace (cuBLASLt has its own workspace).
    for (i, &(m, n, k)) in SHAPES.iter().enumerate().skip(3) {
        let p = dense(&stream, m, n, k, 30 + i as u64)?;
        let plan = lt.plan(m, n, k, scales)?;
        let ws = DeviceBuffer::<u8>::alloc(&ctx, split_k_workspace_bytes(GemmShape::new(m, n, k)))?;
        let run_ours = || {
            per_tensor(
                &stream,
                &p,
                &one,
                &p.d,
                GemmOptions::default().workspace(&ws),
            )
        };
        let what = format!("{m}x{n}x{k} split K");
        let (ours, theirs, err) = ours_and_cublaslt(&stream, &p, &plan, &what, run_ours)?;
        rows.push(Row {
            name: format!("gemm {m}x{n}x{k} e4m3 -> bf16, split-K workspace"),
            value: ours,
            unit: "TFLOP/s",
            yardstick: format!(
                "cuBLASLt {theirs:.0} in this run ({:.2}x); rel err vs cuBLASLt {err:.1e}",
                ours / theirs
            ),
            pass: None,
        });
    }

    // Block scaling (1x128 activations, 128x128 weights) against our per-tensor GEMM.
    for (i, &(m, n, k)) in SHAPES.iter().enumerate().take(2) {
        let p = dense(&stream, m, n, k, 50 + i as u64)?;
        let kb = k.div_ceil(128);
        let scales = |len: usize, seed: u64| -> Vec<f32> {
            let mut next = xorshift(seed);
            (0..len)
                .map(|_| 0.5 + (next() % 1024) as f32 / 1024.0)
                .collect()
        };
        let sa = DeviceBuffer::from_host(&stream, &scales(m * kb, 60 + i as u64))?;
        let sb = DeviceBuffer::from_host(&stream, &scales(n.div_ceil(128) * kb, 70 + i as u64))?;
        let run_block = || {
            gemm_blockwise(
                &stream,
                GemmShape::new(m, n, k),
                BlockOperand {
                    data: &p.a,
                    format: Fp8Format::E4M3,
                    scales_inv: &sa,
                },
                BlockOperand {
                    data: &p.b,
                    format: Fp8Format::E4M3,
                    scales_inv: &sb,
                },
                GemmOut::Bf16(&p.d),
                GemmOptions::default().path(GemmPath::Hopper),
            )
        };
        let run_tensor = || per_tensor(&stream, &p, &one, &p.d_ref, GemmOptions::default());
        run_block()?;
        let ms = |f: &mut dyn FnMut() -> BenchResult<()>| event_median_ms(&stream, WARMUP, REPS, f);
        let block = tflops(m, n, k, ms(&mut || run_block().map_err(Into::into))?);
        let tensor = tflops(m, n, k, ms(&mut || run_tensor().map_err(Into::into))?);
        rows.push(Row {
            name: format!("gemm {m}x{n}x{k} e4m3 -> bf16, block-scaled (1x128, 128x128)"),
            value: block,
            unit: "TFLOP/s",
            yardstick: format!(
                "our per-tensor GEMM {tensor:.0} in this run ({:.2}x; target >= 0.9x)",
                block / tensor
            ),
            pass: Some(block >= 0.9 * tensor),
        });
    }

    // Fast accumulation (the forward GEMMs' mode in TransformerEngine), both sides fast.
    for (i, &(m, n, k)) in SHAPES.iter().enumerate().take(3) {
        let p = dense(&stream, m, n, k, 20 + i as u64)?;
        let plan = lt.plan(m, n, k, scales)?;
        let fast_plan = lt.plan_with(m, n, k, scales, true)?;
        let run_ours = |d: &DeviceBuffer<bf16>, fast: bool| {
            per_tensor(
                &stream,
                &p,
                &one,
                d,
                GemmOptions::default().fast_accumulation(fast),
            )
        };
        let run_lt = || {
            fast_plan.run(
                stream.as_raw(),
                p.a.as_raw(),
                p.b.as_raw(),
                p.d_ref.as_raw(),
            )
        };
        // Against cuBLASLt's promoted (default) result.
        run_ours(&p.d, true)?;
        plan.run(
            stream.as_raw(),
            p.a.as_raw(),
            p.b.as_raw(),
            p.d_ref.as_raw(),
        )?;
        let err = rel_err(&p.d.to_vec(&stream)?, &p.d_ref.to_vec(&stream)?);
        if err.is_nan() || err >= 2e-2 {
            return Err(format!("{m}x{n}x{k} fast accumulation: off cuBLASLt by {err:.2e}").into());
        }
        let ms = |f: &mut dyn FnMut() -> BenchResult<()>| event_median_ms(&stream, WARMUP, REPS, f);
        let ours = tflops(
            m,
            n,
            k,
            ms(&mut || run_ours(&p.d, true).map_err(Into::into))?,
        );
        let promoted = tflops(
            m,
            n,
            k,
            ms(&mut || run_ours(&p.d, false).map_err(Into::into))?,
        );
        let theirs = tflops(m, n, k, ms(&mut || run_lt())?);
        rows.push(Row {
            name: format!("gemm {m}x{n}x{k} e4m3 -> bf16, fast accumulation"),
            value: ours,
            unit: "TFLOP/s",
            yardstick: format!(
                "cuBLASLt fast accumulation {theirs:.0} in this run ({:.2}x); ours promoted \
                 {promoted:.0}; rel err vs cuBLASLt's promoted sum {err:.1e}",
                ours / theirs
            ),
            pass: None,
        });
    }

    // Grouped GEMM: 8 x 512 rows, and a skewed split of the same 4096 rows.
    let even = [512i32; GROUPS];
    let skewed = [2048i32, 1024, 512, 256, 128, 64, 32, 32];
    for (name, counts) in [("8 x 512 rows", even), ("skewed 2048..32 rows", skewed)] {
        let m_max = *counts.iter().max().unwrap_or(&1) as usize;
        let total: usize = counts.iter().map(|&c| c as usize).sum();
        let (n, k) = (GROUP_N, GROUP_K);
        let a = DeviceBuffer::from_host(&stream, &random_e4m3(GROUPS * m_max * k, 40))?;
        let b = DeviceBuffer::from_host(&stream, &random_e4m3(GROUPS * n * k, 41))?;
        let d = DeviceBuffer::<bf16>::alloc(&ctx, GROUPS * m_max * n)?;
        let counts_dev = DeviceBuffer::from_host(&stream, &counts)?;
        let run_ours = || {
            grouped_gemm(
                &stream,
                GroupedShape {
                    groups: GROUPS,
                    m_max,
                    n,
                    k,
                },
                e4m3(&a, &one),
                e4m3(&b, &one),
                GemmOut::Bf16(&d),
                &counts_dev,
                GemmOptions::default(),
            )
        };
        run_ours()?;
        // Check each group's real rows against cuBLASLt on that group alone.
        let got = d.to_vec(&stream)?;
        for (g, &c) in counts.iter().enumerate().filter(|(_, c)| **c > 0) {
            let c = c as usize;
            let plan = lt.plan(c, n, k, scales)?;
            let d_ref = DeviceBuffer::<bf16>::alloc(&ctx, c * n)?;
            let a_g = a.as_raw() + (g * m_max * k) as u64;
            let b_g = b.as_raw() + (g * n * k) as u64;
            plan.run(stream.as_raw(), a_g, b_g, d_ref.as_raw())?;
            let want = d_ref.to_vec(&stream)?;
            let err = rel_err(&got[g * m_max * n..g * m_max * n + c * n], &want);
            if err.is_nan() || err >= 2e-2 {
                return Err(
                    format!("grouped {name}: group {g} differs from cuBLASLt ({err:.2e})").into(),
                );
            }
        }
        let ms = event_median_ms(&stream, WARMUP, REPS, || run_ours().map_err(Into::into))?;
        let ours = tflops(total, n, k, ms);
        // Yardstick: one dense cuBLASLt GEMM with the same real rows.
        let p = dense(&stream, total, n, k, 50)?;
        let plan = lt.plan(total, n, k, scales)?;
        let theirs = tflops(
            total,
            n,
            k,
            event_median_ms(&stream, WARMUP, REPS, || {
                plan.run(
                    stream.as_raw(),
                    p.a.as_raw(),
                    p.b.as_raw(),
                    p.d_ref.as_raw(),
                )
            })?,
        );
        rows.push(Row {
            name: format!("grouped gemm {name}, N={n} K={k}"),
            value: ours,
            unit: "TFLOP/s",
            yardstick: format!(
                "counts real rows only; cuBLASLt dense {total}x{n}x{k} {theirs:.0} in this run ({:.2}x)",
                ours / theirs
            ),
            pass: None,
        });
    }
    rows.extend(packed_rows(&stream, &lt, &one)?);
    // Small problems: latency per GEMM, Hopper against portable kernel.
    for shape in SMALL {
        let (m, n, k, acc) = shape;
        let hopper = small_us(&stream, shape, GemmPath::Hopper, &one)?;
        let portable = small_us(&stream, shape, GemmPath::Portable, &one)?;
        rows.push(Row {
            name: format!(
                "small gemm {m}x{n}x{k} -> f32{}, per GEMM in a graph",
                if acc { " (accumulate)" } else { "" }
            ),
            value: hopper,
            unit: "us",
            yardstick: format!(
                "sm_90a kernel; portable mma.sync kernel {portable:.2} us ({:.2}x)",
                portable / hopper
            ),
            pass: None,
        });
    }
    rows.push(Row {
        name: format!("cuBLASLt library: {}", lt.path),
        value: f64::NAN,
        unit: "",
        yardstick: "yardstick only, loaded at run time".into(),
        pass: None,
    });
    Ok(rows)
}

/// cuBLASLt's dense `m x n x k` (bf16 out) in this run, TFLOP/s: the yardstick of a grouped
/// problem with `m` real rows.
fn cublas_dense_tflops(
    stream: &Stream,
    lt: &CublasLt,
    (m, n, k): (usize, usize, usize),
    scales: [u64; 2],
    seed: u64,
) -> BenchResult<f64> {
    let p = dense(stream, m, n, k, seed)?;
    let plan = lt.plan(m, n, k, scales)?;
    let ms = event_median_ms(stream, WARMUP, REPS, || {
        plan.run(
            stream.as_raw(),
            p.a.as_raw(),
            p.b.as_raw(),
            p.d_ref.as_raw(),
        )
    })?;
    Ok(tflops(m, n, k, ms))
}

/// The MoE layer's packed expert GEMMs on the sm_90a path (forward layout: fc1's forward and
/// data gradient; fc1's weight gradient with a per-group K), each against cuBLASLt's dense
/// GEMM on the same real rows in this run. Rates count real rows only (the padding rows the
/// layout adds are work the yardstick does not do). The forward layouts are checked group by
/// group against cuBLASLt before they are timed.
fn packed_rows(stream: &Stream, lt: &CublasLt, one: &DeviceScalar) -> BenchResult<Vec<Row>> {
    let ctx = stream.context();
    let scales = [one.device_ptr(), one.device_ptr()];
    let mut rows = Vec::new();
    for (li, (layout, counts)) in PACKED_COUNTS.iter().enumerate() {
        let total: usize = counts.iter().sum();
        // Each group's rows start at a multiple of ALIGN_ROWS; padding rows are zero.
        let mut offsets = vec![0usize];
        for &c in counts {
            let last = *offsets.last().unwrap_or(&0);
            offsets.push(last + c.div_ceil(ALIGN_ROWS) * ALIGN_ROWS);
        }
        let capacity = *offsets.last().unwrap_or(&0);
        let offs: Vec<i32> = offsets.iter().map(|&o| o as i32).collect();
        let offsets_dev = DeviceBuffer::from_host(stream, &offs)?;
        let seed = 60 + 10 * li as u64;
        for &(what, n, k) in &PACKED_FWD {
            let mut a_host = random_e4m3(capacity * k, seed);
            for (g, &c) in counts.iter().enumerate() {
                a_host[(offsets[g] + c) * k..offsets[g + 1] * k].fill(0);
            }
            let a = DeviceBuffer::from_host(stream, &a_host)?;
            let b = DeviceBuffer::from_host(stream, &random_e4m3(GROUPS * n * k, seed + 1))?;
            let d = DeviceBuffer::<bf16>::alloc(ctx, capacity * n)?;
            d.memset_bytes(stream, 0xff)?;
            let shape = PackedShape {
                groups: GROUPS,
                capacity,
                n,
                k,
            };
            let opts = GemmOptions::new()
                .path(GemmPath::Hopper)
                .expected_rows(total + GROUPS * ALIGN_ROWS / 2);
            let run_ours = || {
                grouped_gemm_packed(
                    stream,
                    shape,
                    e4m3(&a, one),
                    e4m3(&b, one),
                    GemmOut::Bf16(&d),
                    &offsets_dev,
                    opts,
                )
            };
            run_ours()?;
            let got = d.to_vec(stream)?;
            for (g, &c) in counts.iter().enumerate() {
                let plan = lt.plan(c, n, k, scales)?;
                let d_ref = DeviceBuffer::<bf16>::alloc(ctx, c * n)?;
                let a_g = a.as_raw() + (offsets[g] * k) as u64;
                let b_g = b.as_raw() + (g * n * k) as u64;
                plan.run(stream.as_raw(), a_g, b_g, d_ref.as_raw())?;
                let want = d_ref.to_vec(stream)?;
                let err = rel_err(&got[offsets[g] * n..(offsets[g] + c) * n], &want);
                if err.is_nan() || err >= 2e-2 {
                    return Err(format!(
                        "packed {what} {layout}: group {g} differs from cuBLASLt ({err:.2e})"
                    )
                    .into());
                }
            }
            let ms = event_median_ms(stream, WARMUP, REPS, || run_ours().map_err(Into::into))?;
            let ours = tflops(total, n, k, ms);
            let theirs = cublas_dense_tflops(stream, lt, (total, n, k), scales, seed + 2)?;
            rows.push(Row {
                name: format!("packed MoE {what} {layout}: {total} rows, N={n} K={k}"),
                value: ours,
                unit: "TFLOP/s",
                yardstick: format!(
                    "real rows only ({capacity} in the layout); cuBLASLt dense {total}x{n}x{k} \
                     {theirs:.0} in this run ({:.2}x)",
                    ours / theirs
                ),
                pass: None,
            });
        }
        // fc1's weight gradient: D[g] = A[:, rows of g] . B[:, rows of g]^T, A [m, capacity]
        // (dA^T), B [n, capacity] (X^T), bf16 out.
        let (m, n) = PACKED_WGRAD;
        let a = DeviceBuffer::from_host(stream, &random_e4m3(m * capacity, seed + 3))?;
        let b = DeviceBuffer::from_host(stream, &random_e4m3(n * capacity, seed + 4))?;
        let d = DeviceBuffer::<bf16>::alloc(ctx, GROUPS * m * n)?;
        let shape = WgradShape {
            groups: GROUPS,
            capacity,
            m,
            n,
        };
        let opts = GemmOptions::new().path(GemmPath::Hopper);
        let run_ours = || {
            grouped_gemm_wgrad(
                stream,
                shape,
                e4m3(&a, one),
                e4m3(&b, one),
                GemmOut::Bf16(&d),
                &offsets_dev,
                opts,
            )
        };
        run_ours()?;
        let ms = event_median_ms(stream, WARMUP, REPS, || run_ours().map_err(Into::into))?;
        let ours = tflops(m, n, total, ms);
        let theirs = cublas_dense_tflops(stream, lt, (m, n, total), scales, seed + 5)?;
        rows.push(Row {
            name: format!("packed MoE fc1 wgrad {layout}: {GROUPS} x {m}x{n}, K={total} in all"),
            value: ours,
            unit: "TFLOP/s",
            yardstick: format!(
                "real rows only; cuBLASLt dense {m}x{n}x{total} {theirs:.0} in this run ({:.2}x; \
                 the same FLOPs, one output)",
                ours / theirs
            ),
            pass: None,
        });
    }
    Ok(rows)
}
