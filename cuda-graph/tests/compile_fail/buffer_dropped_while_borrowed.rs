// A buffer passed to a kernel argument list cannot be dropped while the list lives.
use cuda_graph::{DeviceBuffer, KernelArgs};

fn use_args(buf: DeviceBuffer<f32>) {
    let args = KernelArgs::new().arg(&buf);
    drop(buf);
    println!("{:?}", args.sizes());
}

fn main() {
    let _ = use_args;
}
