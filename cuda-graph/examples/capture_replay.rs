//! Capture and replay: 200 small kernel launches captured into one graph, replayed with one
//! launch, checked against the same work done eagerly. Also shows views (the work runs on two
//! halves of one buffer) and a capture closure that returns a value.
//!
//! `cargo run -p cuda-graph --example capture_replay` (needs an NVIDIA GPU and driver).

use cuda_graph::{
    CaptureMode, Context, DeviceBuffer, GraphExec, InstantiateFlags, LaunchConfig, Module, Result,
    Stream, kernel_args,
};

/// The example kernels (examples/kernels/examples.cu, built by build.rs).
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/examples.fatbin"));

const N: u32 = 1 << 16;
const STEPS: usize = 100;

fn main() -> Result<()> {
    let ctx = Context::default_device()?;
    let stream = Stream::new(&ctx)?;
    let module = Module::from_image(&ctx, FATBIN)?;
    let (add, axpy) = (module.kernel("add_f32")?, module.kernel("axpy_f32")?);

    let x0: Vec<f32> = (0..2 * N).map(|i| (i % 97) as f32 * 0.25).collect();
    let buf = DeviceBuffer::from_host(&stream, &x0)?;
    // Two views of one allocation: x and y.
    let (x, y) = buf.split_at(N as usize)?;
    let cfg = LaunchConfig::for_elements(N, 256);

    let (graph, launches) = stream.capture_with(CaptureMode::Global, |s| {
        for _ in 0..STEPS {
            // SAFETY: add_f32(float* x, float v, unsigned n) touches x[0..n); x has N floats.
            unsafe { s.stream().launch(&add, &cfg, &kernel_args![&x, 1.0f32, N]) }?;
            // SAFETY: axpy_f32(float a, const float* x, float* y, unsigned n): n floats each.
            unsafe {
                s.stream()
                    .launch(&axpy, &cfg, &kernel_args![0.5f32, &x, &y, N])
            }?;
        }
        Ok(2 * STEPS)
    })?;
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
    // The exec keeps the allocation alive: the buffer and the graph may go.
    drop((graph, x, y));
    println!("captured {launches} launches into one graph");

    let t = std::time::Instant::now();
    exec.launch(&stream)?;
    stream.synchronize()?;
    println!("one replay: {:?} (host + device)", t.elapsed());

    // The same arithmetic on the host, in the same order.
    let (mut hx, mut hy) = (x0[..N as usize].to_vec(), x0[N as usize..].to_vec());
    for _ in 0..STEPS {
        for (a, b) in hx.iter_mut().zip(hy.iter_mut()) {
            *a += 1.0;
            *b += 0.5 * *a;
        }
    }
    let got = buf.to_vec(&stream)?;
    let want: Vec<f32> = hx.into_iter().chain(hy).collect();
    let bad = got.iter().zip(&want).filter(|(g, w)| g != w).count();
    if bad != 0 {
        return Err(cuda_graph::Error::invalid(format!(
            "{bad} of {} elements differ from the host reference",
            want.len()
        )));
    }
    println!("all {} elements equal the host reference", want.len());
    Ok(())
}
