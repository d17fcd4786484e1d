//! A conditional WHILE node: the body halves a vector and recomputes the loop condition on the
//! device (x[0] > limit), so the number of iterations is decided by the data, not the host.
//! Needs a driver >= 12.4.
//!
//! `cargo run -p cuda-graph --example while_loop` (needs an NVIDIA GPU and driver).

use cuda_graph::{
    ConditionalHandle, Context, DeviceBuffer, Error, Graph, GraphExec, InstantiateFlags,
    LaunchConfig, Module, Result, Stream, kernel_args,
};

static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/examples.fatbin"));

const N: u32 = 1024;
const LIMIT: f32 = 1.0;

fn main() -> Result<()> {
    let ctx = Context::default_device()?;
    let stream = Stream::new(&ctx)?;
    let module = Module::from_image(&ctx, FATBIN)?;
    let (halve, above) = (module.kernel("halve_f32")?, module.kernel("above_f32")?);
    let x = DeviceBuffer::<f32>::alloc(&ctx, N as usize)?;
    let flag = DeviceBuffer::<i32>::alloc(&ctx, 1)?;

    let mut graph = Graph::new(&ctx)?;
    // The value starts at 1 on every launch (reset_each_launch): the body runs at least once.
    let handle = ConditionalHandle::new(&mut graph, 1, true)?;
    graph.add_while(&[], handle, |s| {
        // SAFETY: halve_f32 touches x[0..N); above_f32 reads x[0] and writes flag[0].
        unsafe {
            s.launch(
                &halve,
                &LaunchConfig::for_elements(N, 256),
                &kernel_args![&x, N],
            )?;
            s.launch(
                &above,
                &LaunchConfig::linear(1, 1),
                &kernel_args![&x, LIMIT, &flag],
            )?;
        }
        handle.set_from_flag_on(s, &flag)
    })?;
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;

    for start in [1000.0f32, 3.0, 0.5] {
        x.copy_from_host(&stream, &vec![start; N as usize])?;
        exec.launch(&stream)?;
        stream.synchronize()?;
        // Host model: halve at least once, then while x > limit.
        let (mut v, mut iters) = (start * 0.5, 1);
        while v > LIMIT {
            v *= 0.5;
            iters += 1;
        }
        let got = x.to_vec(&stream)?;
        if got.iter().any(|&g| g != v) {
            return Err(Error::invalid(format!(
                "start {start}: got {}, expected {v}",
                got[0]
            )));
        }
        println!("start {start}: {iters} iteration(s) on the device, x = {v}");
    }
    Ok(())
}
