// Graph objects are not thread-safe (the driver's rule): a &Graph cannot be shared across
// threads, so two threads can never mutate or query one graph at once.
fn need_sync<T: Sync>() {}

fn main() {
    need_sync::<cuda_graph::Graph>();
}
