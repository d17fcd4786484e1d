// A kernel argument list borrows its values: it cannot outlive them, so the driver never
// reads a dangling pointer at launch.
use cuda_graph::KernelArgs;

fn main() {
    let args;
    {
        let scale = 2.0f32;
        args = KernelArgs::new().arg(&scale);
    }
    println!("{:?}", args.sizes());
}
