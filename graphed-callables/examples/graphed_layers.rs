//! Graphed callables: a stack of two small layers captured as CUDA graphs under a pipeline
//! schedule (one chunk, three microbatches, all forwards then all backwards), replayed for a
//! training step, and checked bit for bit against the same layers run eagerly.
//!
//! Each layer is `z = x * w + b; y = z > 0 ? z : z / 8` elementwise (tests/kernels'
//! `gl_fwd` / `gl_bwd`), keeping `z` for its backward in a saved buffer (bytes, viewed as
//! f32).
//!
//! `cargo run -p graphed-callables --example graphed_layers` (needs an NVIDIA GPU and driver).

use cuda_graph::{
    Context, DeviceBuffer, Error, Kernel, LaunchConfig, Module, Result, Stream, kernel_args,
};
use graphed_callables::{Callable, GraphIndex, GraphedCallables, GraphedOptions, Slot, Step};

static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/graphed_kernels.fatbin"));

const N: usize = 4096;
const ORDER: [i64; 6] = [1, 1, 1, -1, -1, -1];

struct Layer {
    w: DeviceBuffer<f32>,
    b: DeviceBuffer<f32>,
    dw: DeviceBuffer<f32>,
    db: DeviceBuffer<f32>,
    fwd: Kernel,
    bwd: Kernel,
}

impl Layer {
    fn new(stream: &Stream, module: &Module, seed: usize) -> Result<Layer> {
        let w: Vec<f32> = (0..N)
            .map(|i| ((i * 7 + seed) % 13) as f32 * 0.125 - 0.75)
            .collect();
        let b: Vec<f32> = (0..N)
            .map(|i| ((i + seed) % 5) as f32 * 0.25 - 0.5)
            .collect();
        Ok(Layer {
            w: DeviceBuffer::from_host(stream, &w)?,
            b: DeviceBuffer::from_host(stream, &b)?,
            dw: DeviceBuffer::from_host(stream, &[0.0; N])?,
            db: DeviceBuffer::from_host(stream, &[0.0; N])?,
            fwd: module.kernel("gl_fwd")?,
            bwd: module.kernel("gl_bwd")?,
        })
    }
}

impl Callable<f32> for Layer {
    fn input_lens(&self) -> Vec<usize> {
        vec![N]
    }
    fn output_lens(&self) -> Vec<usize> {
        vec![N]
    }
    fn saved_bytes(&self) -> Vec<usize> {
        vec![N * size_of::<f32>()]
    }
    fn parameters(&self) -> Vec<&DeviceBuffer<f32>> {
        vec![&self.w, &self.b]
    }
    fn gradients(&self) -> Vec<&DeviceBuffer<f32>> {
        vec![&self.dw, &self.db]
    }
    fn forward(
        &mut self,
        stream: &Stream,
        inputs: &[&DeviceBuffer<f32>],
        outputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let z = slot.saved()[0].reinterpret::<f32>()?;
        let n = N as u32;
        // SAFETY: gl_fwd(x, w, b, z, y, n) touches n floats of each; all hold N.
        unsafe {
            stream.launch(
                &self.fwd,
                &LaunchConfig::for_elements(n, 256),
                &kernel_args![inputs[0], &self.w, &self.b, &z, outputs[0], n],
            )
        }
    }
    fn backward(
        &mut self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<f32>],
        grad_inputs: &[&DeviceBuffer<f32>],
        slot: &Slot<'_, f32>,
    ) -> Result<()> {
        let z = slot.saved()[0].reinterpret::<f32>()?;
        let n = N as u32;
        // SAFETY: gl_bwd(dy, x, w, z, dx, dw, db, n) touches n floats of each; all hold N.
        unsafe {
            stream.launch(
                &self.bwd,
                &LaunchConfig::for_elements(n, 256),
                &kernel_args![
                    grad_outputs[0],
                    slot.inputs()[0],
                    &self.w,
                    &z,
                    grad_inputs[0],
                    &self.dw,
                    &self.db,
                    n
                ],
            )
        }
    }
}

fn inputs(mb: usize) -> Vec<f32> {
    (0..N)
        .map(|i| ((i * 31 + mb * 17) % 23) as f32 * 0.25 - 2.75)
        .collect()
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let ctx = Context::default_device()?;
    let stream = Stream::new(&ctx)?;
    let module = Module::from_image(&ctx, FATBIN)?;
    let dy = DeviceBuffer::from_host(&stream, &vec![1.0f32; N])?;
    let xs: Vec<DeviceBuffer<f32>> = (0..3)
        .map(|mb| DeviceBuffer::from_host(&stream, &inputs(mb)))
        .collect::<Result<_>>()?;

    // Graphed: the runtime owns the static buffers; one graph per step of the schedule.
    let layers: Vec<Box<dyn Callable<f32>>> = vec![
        Box::new(Layer::new(&stream, &module, 1)?),
        Box::new(Layer::new(&stream, &module, 2)?),
    ];
    let options = GraphedOptions::from_order(&ORDER, vec![2])?;
    let samples = vec![vec![&xs[0]], vec![]]; // per callable: the first layer's input
    let graphed = GraphedCallables::build(&stream, layers, &samples, options)?;
    let mut dx_graphed = Vec::new();
    for &step in graphed.schedule().steps() {
        match step {
            Step::Forward { microbatch, .. } => {
                graphed.forward(0, microbatch, &[&xs[microbatch]], &stream)?;
            }
            Step::Backward { microbatch, .. } => {
                let dx = graphed.backward(0, microbatch, &[&dy], &stream)?;
                dx_graphed.push(dx[0].to_vec(&stream)?);
            }
            Step::WeightGrad { .. } => unreachable!("no -k - 0.5 entries in ORDER"),
        }
    }
    let grads_graphed: Vec<Vec<f32>> = graphed
        .callables()
        .iter()
        .flat_map(|c| c.gradients())
        .map(|g| g.to_vec(&stream))
        .collect::<Result<_>>()?;

    // Eager: the same layers driven directly, with our own buffers (no pool needed).
    let mut eager = [
        Layer::new(&stream, &module, 1)?,
        Layer::new(&stream, &module, 2)?,
    ];
    let alloc = || DeviceBuffer::<f32>::alloc(&ctx, N);
    let mut dx_eager = Vec::new();
    let ys = [
        [alloc()?, alloc()?],
        [alloc()?, alloc()?],
        [alloc()?, alloc()?],
    ];
    let zs: Vec<Vec<DeviceBuffer<u8>>> = (0..3)
        .map(|_| (0..2).map(|_| DeviceBuffer::alloc(&ctx, 4 * N)).collect())
        .collect::<Result<_>>()?;
    let at = |microbatch, layer| GraphIndex {
        chunk: 0,
        microbatch,
        layer,
    };
    for mb in 0..3 {
        let l0 = Slot::new(at(mb, 0), vec![&xs[mb]], vec![&ys[mb][0]], vec![&zs[mb][0]]);
        eager[0].forward(&stream, &[&xs[mb]], &[&ys[mb][0]], &l0)?;
        let l1 = Slot::new(
            at(mb, 1),
            vec![&ys[mb][0]],
            vec![&ys[mb][1]],
            vec![&zs[mb][1]],
        );
        eager[1].forward(&stream, &[&ys[mb][0]], &[&ys[mb][1]], &l1)?;
    }
    for mb in 0..3 {
        let (g, dx) = (alloc()?, alloc()?);
        let l1 = Slot::new(
            at(mb, 1),
            vec![&ys[mb][0]],
            vec![&ys[mb][1]],
            vec![&zs[mb][1]],
        );
        eager[1].backward(&stream, &[&dy], &[&g], &l1)?;
        let l0 = Slot::new(at(mb, 0), vec![&xs[mb]], vec![&ys[mb][0]], vec![&zs[mb][0]]);
        eager[0].backward(&stream, &[&g], &[&dx], &l0)?;
        dx_eager.push(dx.to_vec(&stream)?);
    }
    let grads_eager: Vec<Vec<f32>> = eager
        .iter()
        .flat_map(|c| c.gradients())
        .map(|g| g.to_vec(&stream))
        .collect::<Result<_>>()?;

    let same = |a: &[Vec<f32>], b: &[Vec<f32>]| {
        a.iter()
            .flatten()
            .zip(b.iter().flatten())
            .all(|(x, y)| x.to_bits() == y.to_bits())
    };
    if !same(&dx_graphed, &dx_eager) || !same(&grads_graphed, &grads_eager) {
        return Err(Error::invalid("graphed and eager results differ").into());
    }
    println!(
        "{} graphs replayed for one step of {} microbatches; input and parameter gradients \
         equal the eager run bit for bit",
        graphed.num_graphs(),
        graphed.schedule().num_microbatches()
    );
    Ok(())
}
