//! An explicitly built graph: kernel, memcpy and memset nodes with edges; per-node updates of
//! an instantiated exec (a kernel's scalar, a memcpy's source, disabling a node); and the
//! graph written as Graphviz DOT.
//!
//! `cargo run -p cuda-graph --example explicit_graph` (needs an NVIDIA GPU and driver).

use cuda_graph::{
    Context, DeviceBuffer, Error, Graph, GraphExec, InstantiateFlags, LaunchConfig, MemsetValue,
    Module, Result, Stream, kernel_args,
};

static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/examples.fatbin"));

const N: u32 = 4096;

fn check(what: &str, got: &[f32], want: f32) -> Result<()> {
    match got.iter().position(|&v| v != want) {
        None => {
            println!("{what}: every element is {want}");
            Ok(())
        }
        Some(i) => Err(Error::invalid(format!(
            "{what}: element {i} is {}, expected {want}",
            got[i]
        ))),
    }
}

fn main() -> Result<()> {
    let ctx = Context::default_device()?;
    let stream = Stream::new(&ctx)?;
    let module = Module::from_image(&ctx, FATBIN)?;
    let add = module.kernel("add_f32")?;
    let cfg = LaunchConfig::for_elements(N, 256);

    let x = DeviceBuffer::<f32>::alloc(&ctx, N as usize)?;
    let y = DeviceBuffer::<f32>::alloc(&ctx, N as usize)?;
    let other = DeviceBuffer::from_host(&stream, &vec![42.0f32; N as usize])?;

    // memset x = 1.0 -> x += 2.0 -> y = x
    let mut graph = Graph::new(&ctx)?;
    let set = graph.add_memset(&[], &x, MemsetValue::U32(1.0f32.to_bits()))?;
    // SAFETY: add_f32 touches x[0..N); x has N floats.
    let bump =
        unsafe { graph.add_kernel(&[set.node()], &add, &cfg, &kernel_args![&x, 2.0f32, N]) }?;
    let copy = graph.add_memcpy(&[bump.node()], &y, &x)?;

    let mut exec = GraphExec::instantiate(&graph, InstantiateFlags::empty())?;
    let run = |exec: &GraphExec| -> Result<Vec<f32>> {
        exec.launch(&stream)?;
        stream.synchronize()?;
        y.to_vec(&stream)
    };
    check("y = 1 + 2", &run(&exec)?, 3.0)?;

    // Per-node updates, for later launches only; no re-instantiation.
    // SAFETY: as above.
    unsafe { exec.set_kernel_params(&bump, &add, &cfg, &kernel_args![&x, 10.0f32, N]) }?;
    check("y = 1 + 10 after the kernel update", &run(&exec)?, 11.0)?;
    exec.set_memcpy_params(&copy, &y, &other)?;
    check("y = other after the memcpy update", &run(&exec)?, 42.0)?;
    exec.set_memcpy_params(&copy, &y, &x)?;
    exec.set_node_enabled(bump, false)?;
    check("y = 1 with the kernel disabled", &run(&exec)?, 1.0)?;

    let dot = graph.to_dot_string()?;
    let path = std::env::temp_dir().join("cuda_graph_explicit.dot");
    std::fs::write(&path, &dot).map_err(Error::external)?;
    println!(
        "{} nodes, {} edges; DOT ({} bytes) written to {}",
        graph.nodes()?.len(),
        graph.edges()?.len(),
        dot.len(),
        path.display()
    );
    Ok(())
}
