// The capture scope lives only inside the closure: it cannot be kept and used after the
// capture ended.
use cuda_graph::{CaptureMode, CaptureScope, Stream};

fn leak(stream: &Stream) {
    let mut kept: Option<&mut CaptureScope<'_>> = None;
    let _ = stream.capture(CaptureMode::Global, |scope| {
        kept = Some(scope);
        Ok(())
    });
    let _ = kept.map(|s| s.fork());
}

fn main() {
    let _ = leak;
}
