//! The crate's first launch in a process may be the first call inside a stream capture: the
//! module load it triggers then runs with the thread's capture mode relaxed instead of
//! invalidating the capture. One test per binary, so nothing loaded the module before.

use cuda_graph::{CaptureMode, Context, DeviceBuffer, GraphExec, InstantiateFlags, Stream};
use fp8_kernels::reference;
use fp8_kernels::{DeviceScalar, Fp8Format, Fp8Tensor, quantize};

#[test]
#[ignore = "needs a CUDA device"]
fn the_first_quantize_can_be_captured_in_global_mode() {
    let ctx = Context::default_device().expect("context");
    let stream = Stream::new(&ctx).expect("stream");
    let n = 4096usize;
    let xs: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 * 0.37 - 185.0)
        .collect();
    let x = DeviceBuffer::from_host(&stream, &xs).expect("upload");
    let scale = 1.5f32;
    // No constructor that loads the module: scalars and bytes made by hand.
    let y = Fp8Tensor::from_parts(
        DeviceBuffer::from_host(&stream, &vec![0u8; n]).expect("bytes"),
        &[n],
        Fp8Format::E4M3,
        DeviceScalar::new(&stream, scale).expect("scale"),
        DeviceScalar::new(&stream, 0.0).expect("scale_inv"),
        DeviceScalar::new(&stream, 0.0).expect("amax"),
    )
    .expect("tensor");
    let graph = stream
        .capture(CaptureMode::Global, |s| quantize(s.stream(), &x, &y, None))
        .expect("the first launch, captured");
    let exec = GraphExec::instantiate(&graph, InstantiateFlags::empty()).expect("instantiate");
    exec.launch(&stream).expect("launch");
    stream.synchronize().expect("sync");
    let got = y.data().to_vec(&stream).expect("read back");
    for (i, (&g, &v)) in got.iter().zip(&xs).enumerate() {
        assert_eq!(
            g,
            reference::quantize(v, scale, Fp8Format::E4M3),
            "element {i} ({v})"
        );
    }
    assert_eq!(y.scale_inv().read(&stream).expect("scale_inv"), 1.0 / scale);
}
