// A capture must end on the thread that began it: the scope cannot move to another thread.
use cuda_graph::{CaptureMode, Stream};

fn spawn_in_capture(stream: &Stream) {
    let _ = stream.capture(CaptureMode::Global, |scope| {
        std::thread::scope(|t| {
            t.spawn(move || {
                let _ = scope.fork();
            });
        });
        Ok(())
    });
}

fn main() {
    let _ = spawn_in_capture;
}
