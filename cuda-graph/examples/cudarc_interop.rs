//! cudarc interop, end to end: a cudarc context and stream, adopted by cuda-graph; a saxpy
//! kernel launched through cudarc, a cuBLAS SGEMM issued through cudarc, and a scale kernel
//! behind an IF conditional node, all captured into one cuda-graph `Graph`; replayed and
//! checked against the CPU; the saxpy node's scalar updated in the exec; the IF toggled from
//! a device flag, both ways.
//!
//! ```text
//! cargo run -p cuda-graph --features cudarc --release --example cudarc_interop
//! ```
//!
//! Needs a GPU, a driver >= 12.4 (IF nodes) and libcublas on the dynamic loader's path
//! (cudarc opens it at run time): e.g.
//! `export LD_LIBRARY_PATH=$(python3 -c 'import nvidia; print(nvidia.__path__[0])')/cu13/lib`.
//! Exits non-zero on any mismatch or error.

use std::process::ExitCode;
use std::sync::Arc;

use cuda_graph::cudarc;
use cuda_graph::driver::{self, Device, Feature};
use cuda_graph::{
    CaptureMode, ConditionalHandle, Context, DeviceBuffer, Graph, GraphExec, InstantiateFlags,
    Kernel, KernelNode, LaunchConfig, NodeKind, Stream, kernel_args,
};
use cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaContext, PushKernelArg};
use cudarc::nvrtc::Ptx;

/// `saxpy` and `scale`, hand-written PTX (loaded by the driver, no NVRTC).
const PTX: &str = include_str!("cudarc_interop.ptx");
/// Saxpy length.
const N: usize = 1 << 16;
/// GEMM: C (M x NC) = A (M x K) * B (K x NC), column-major as cuBLAS has them.
const M: usize = 128;
const NC: usize = 96;
const K: usize = 64;
/// Threads per block of both kernels.
const BLOCK: u32 = 256;
/// cuBLAS workspace of our own (NVIDIA's advice for graph capture; 32 MiB covers Hopper).
const WORKSPACE: usize = 32 << 20;
/// What outputs hold before each replay: a NaN no kernel here produces.
const POISON: u32 = 0x7fc0_dead;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> ExitCode {
    match run() {
        Ok(0) => {
            println!("cudarc_interop: all checks passed");
            ExitCode::SUCCESS
        }
        Ok(failed) => {
            eprintln!("cudarc_interop: {failed} check(s) FAILED");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("cudarc_interop: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs everything; returns the number of failed checks.
fn run() -> Res<usize> {
    let dev = Device::get(0)?;
    println!(
        "device 0: {}, driver {}",
        dev.name()?,
        driver::driver_version()?
    );
    dev.require(Feature::ConditionalIfWhile)?;
    // SAFETY: only asks the dynamic loader whether it can open libcublas.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(
            "libcublas not found by the dynamic loader: put its folder on \
                    LD_LIBRARY_PATH (see the example's header)"
                .into(),
        );
    }

    // cudarc's side. Event tracking stays on (cudarc's default): everything the capture
    // uses is adopted by cuda-graph and passed as DeviceBuffers, which carry no events.
    let cu_ctx = CudaContext::new(0)?;
    let cu_stream = cu_ctx.new_stream()?;
    let module = cu_ctx.load_module(Ptx::from_src(PTX))?;
    let saxpy = module.load_function("saxpy")?;
    let scale = module.load_function("scale")?;
    let blas = Arc::new(CudaBlas::new(cu_stream.clone())?);

    // Adopted by cuda-graph, no `unsafe`: the stream keeps cudarc's Arc<CudaStream>; each
    // buffer owns its CudaSlice (cudarc frees it when the last view, graph or exec goes).
    let ctx = Context::from_cudarc(&cu_ctx)?;
    let stream = Stream::from_cudarc(&cu_stream)?;
    let mut rng = Rng(0x5eed_cafe_f00d_d00d);
    let x_h = rng.vec(N);
    let y_h = rng.vec(N);
    let a_h = rng.vec(M * K);
    let b_h = rng.vec(K * NC);
    let x = DeviceBuffer::from_cudarc(cu_stream.clone_htod(&x_h)?)?;
    let y = DeviceBuffer::from_cudarc(cu_stream.clone_htod(&y_h)?)?;
    let a = DeviceBuffer::from_cudarc(cu_stream.clone_htod(&a_h)?)?;
    let b = DeviceBuffer::from_cudarc(cu_stream.clone_htod(&b_h)?)?;
    let z = DeviceBuffer::from_cudarc(cu_stream.alloc_zeros::<f32>(N)?)?;
    let c = DeviceBuffer::from_cudarc(cu_stream.alloc_zeros::<f32>(M * NC)?)?;
    let d = DeviceBuffer::from_cudarc(cu_stream.alloc_zeros::<f32>(M * NC)?)?;
    let flag = DeviceBuffer::from_cudarc(cu_stream.clone_htod(&[1i32])?)?;
    let workspace = DeviceBuffer::<u8>::alloc(&ctx, WORKSPACE)?;
    // SAFETY: a live handle; the workspace is device memory of the handle's context, 256-byte
    // aligned, WORKSPACE bytes, and kept alive by the graph below for as long as it can run.
    unsafe {
        cudarc::cublas::sys::cublasSetWorkspace_v2(
            *blas.handle(),
            workspace.as_raw() as *mut std::ffi::c_void,
            WORKSPACE,
        )
    }
    .result()?;
    println!("adopted a cudarc context and stream, and 8 cudarc slices as DeviceBuffers");

    let (alpha0, s) = (2.0f32, 0.5f32);
    let (n, mn) = (N as u32, (M * NC) as u32);
    let saxpy_cfg = cudarc::driver::LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let scale_cfg = cudarc::driver::LaunchConfig {
        grid_dim: (mn.div_ceil(BLOCK), 1, 1),
        ..saxpy_cfg
    };
    let gemm = GemmConfig {
        transa: CUBLAS_OP_N,
        transb: CUBLAS_OP_N,
        m: M as i32,
        n: NC as i32,
        k: K as i32,
        alpha: 1.0f32,
        lda: M as i32,
        ldb: K as i32,
        beta: 0.0f32,
        ldc: M as i32,
    };
    // Nothing that allocates or loads modules may run on this thread while it captures:
    // load the IF setter kernels now, and run cuBLAS once eagerly (its first call may set
    // itself up with such calls).
    ConditionalHandle::load_helpers(&ctx)?;
    // SAFETY: as in the capture below.
    unsafe {
        blas.gemm(
            gemm,
            &a.as_cudarc(&cu_stream)?,
            &b.as_cudarc(&cu_stream)?,
            &mut c.as_cudarc(&cu_stream)?,
        )
    }?;
    stream.synchronize()?;

    // One capture: cudarc launches and cuBLAS enqueue on cu_stream, which is `stream`.
    let graph = stream.capture(CaptureMode::ThreadLocal, |scope| {
        // z = alpha0 * x + y, launched through cudarc.
        // SAFETY: saxpy(float, const float*, const float*, float*, unsigned) touches
        // x, y, z[0..n), all n floats long.
        unsafe {
            cu_stream
                .launch_builder(&saxpy)
                .arg(&alpha0)
                .arg(&x)
                .arg(&y)
                .arg(&z)
                .arg(&n)
                .launch(saxpy_cfg)
        }?;
        // c = a * b, cuBLAS SGEMM through cudarc.
        // SAFETY: a is M x K, b is K x NC, c is M x NC, column-major, as `gemm` describes.
        unsafe {
            blas.gemm(
                gemm,
                &a.as_cudarc(&cu_stream)?,
                &b.as_cudarc(&cu_stream)?,
                &mut c.as_cudarc(&cu_stream)?,
            )
        }?;
        // if flag[0] != 0 { d = s * c }: an IF node whose body is a cudarc launch on the
        // scratch stream the body is captured on, lent to cudarc.
        let handle = ConditionalHandle::in_capture(scope.stream(), 0, true)?;
        handle.set_from_flag_on(scope.stream(), &flag)?;
        scope.stream().capture_if(handle, |body| {
            body.with_cudarc(&cu_ctx, |cu_body| {
                // SAFETY: scale(float, const float*, float*, unsigned) reads c[0..mn) and
                // writes d[0..mn), both mn floats long.
                unsafe {
                    cu_body
                        .launch_builder(&scale)
                        .arg(&s)
                        .arg(&c)
                        .arg(&d)
                        .arg(&mn)
                        .launch(scale_cfg)
                }
            })??;
            Ok(())
        })?;
        // What cuda-graph did not see being used: the graph keeps it alive.
        for buf in [&x, &y, &a, &b, &z, &c, &d] {
            scope.keep_alive(buf.resource());
        }
        scope.keep_alive(workspace.resource());
        scope.keep_alive(Arc::new(saxpy.clone()));
        scope.keep_alive(Arc::new(scale.clone()));
        scope.keep_alive(blas.clone());
        Ok(())
    })?;
    let nodes = graph.nodes()?;
    println!(
        "captured {} nodes ({} kernel, {} conditional) from cudarc launches, cuBLAS and an IF",
        nodes.len(),
        nodes.iter().filter(|n| n.kind == NodeKind::Kernel).count(),
        nodes
            .iter()
            .filter(|n| n.kind == NodeKind::Conditional)
            .count()
    );
    let mut exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;

    let poison = |bufs: &[&DeviceBuffer<f32>]| -> Res<()> {
        for buf in bufs {
            buf.fill_u32_bits(&stream, POISON)?;
        }
        Ok(())
    };
    let c_ref = gemm_ref(&a_h, &b_h);
    // Poisons the outputs, sets the flag, replays, checks; whether all was right.
    let replay = |exec: &GraphExec, label: &str, alpha: f32, flag_on: bool| -> Res<bool> {
        poison(&[&z, &c, &d])?;
        flag.copy_from_host(&stream, &[i32::from(flag_on)])?;
        exec.launch(&stream)?;
        stream.synchronize()?;
        let (z_h, c_h, d_h) = (z.to_vec(&stream)?, c.to_vec(&stream)?, d.to_vec(&stream)?);
        let z_bad = (0..N)
            .filter(|&i| z_h[i].to_bits() != alpha.mul_add(x_h[i], y_h[i]).to_bits())
            .count();
        let c_bad = (0..M * NC)
            .filter(|&i| !close(c_h[i], c_ref[i].0, c_ref[i].1))
            .count();
        let d_bad = (0..M * NC)
            .filter(|&i| {
                let want = if flag_on {
                    (s * c_h[i]).to_bits()
                } else {
                    POISON
                };
                d_h[i].to_bits() != want
            })
            .count();
        let ok = z_bad == 0 && c_bad == 0 && d_bad == 0;
        println!(
            "{label}: saxpy a={alpha} {z_bad} wrong, sgemm {c_bad} wrong, IF {} -> scale {} ({d_bad} wrong): {}",
            if flag_on { "taken" } else { "skipped" },
            if flag_on { "ran" } else { "left d poisoned" },
            if ok { "ok" } else { "MISMATCH" }
        );
        Ok(ok)
    };

    let mut failed = 0;
    failed += usize::from(!replay(&exec, "replay 1", alpha0, true)?);
    // Update the captured saxpy node's scalar in the exec: find the node by its function.
    let saxpy_kernel = Kernel::from_cudarc(&saxpy)?;
    let node = find_kernel_node(&graph, &saxpy_kernel)?;
    let alpha1 = -3.0f32;
    let config = LaunchConfig::linear(n.div_ceil(BLOCK), BLOCK);
    // SAFETY: the same kernel, grid and buffers as captured; only `a` changes.
    unsafe {
        exec.set_kernel_params(
            &node,
            &saxpy_kernel,
            &config,
            &kernel_args![alpha1, x, y, z, n],
        )
    }?;
    println!(
        "updated kernel node {:?} ({}): a {alpha0} -> {alpha1}",
        node.id(),
        saxpy_kernel.name()
    );
    for (label, flag_on) in [
        ("replay 2", true),
        ("replay 3 (flag 0)", false),
        ("replay 4 (flag 1)", true),
    ] {
        failed += usize::from(!replay(&exec, label, alpha1, flag_on)?);
    }
    Ok(failed)
}

/// The one kernel node of `graph` that launches `kernel`.
fn find_kernel_node(graph: &Graph, kernel: &Kernel) -> Res<KernelNode> {
    let mut found = Vec::new();
    for node in graph.nodes()? {
        if node.kind != NodeKind::Kernel {
            continue;
        }
        let node = KernelNode::try_from(node)?;
        // A node whose parameters cannot be read (a library's kernel) is not ours.
        if matches!(graph.kernel_function(&node), Ok(f) if f == kernel.as_raw()) {
            found.push(node);
        }
    }
    match found[..] {
        [node] => Ok(node),
        _ => Err(format!("{} kernel nodes launch {}", found.len(), kernel.name()).into()),
    }
}

/// Column-major `A * B` in f64, with the sum of |terms| of each element (for the tolerance).
fn gemm_ref(a: &[f32], b: &[f32]) -> Vec<(f64, f64)> {
    let mut c = vec![(0.0, 0.0); M * NC];
    for j in 0..NC {
        for i in 0..M {
            let (mut sum, mut mag) = (0.0f64, 0.0f64);
            for l in 0..K {
                let t = f64::from(a[i + l * M]) * f64::from(b[l + j * K]);
                sum += t;
                mag += t.abs();
            }
            c[i + j * M] = (sum, mag);
        }
    }
    c
}

/// Whether an f32 GEMM result is within rounding of the f64 reference: K accumulations of
/// f32 rounding error, relative to the sum of the magnitudes of the terms.
fn close(got: f32, want: f64, magnitude: f64) -> bool {
    (f64::from(got) - want).abs() <= (K as f64 + 2.0) * f64::from(f32::EPSILON) * magnitude + 1e-30
}

/// xorshift64*: reproducible inputs in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40; // 24 bits
        bits as f32 / (1u32 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}
