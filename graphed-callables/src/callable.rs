//! What a graphed layer is: the [`Callable`] trait, and the [`Slot`] of static buffers the
//! runtime hands each forward and backward.

use std::sync::Arc;

use cuda_graph::Stream;
use cuda_graph::{DeviceBuffer, DeviceRepr};
use cuda_graph::{Error, Result};
use cuda_graph::{Event, GraphPool};

use crate::layout::GraphIndex;
use crate::segments::SegmentKind;
use crate::weights::TensorRecorder;

/// One layer (or part of a layer) that [`GraphedCallables`](crate::GraphedCallables)
/// captures: a forward and a backward pass over static device buffers.
///
/// A callable belongs to one (chunk, layer) and serves all of that chunk's microbatches; its
/// parameters and gradients are buffers it owns. [`forward`](Self::forward) and
/// [`backward`](Self::backward) run inside stream captures, so they must
///
/// * enqueue work on the given stream only (or on streams forked from it and joined back
///   before returning);
/// * not synchronize, allocate with `cuMemAlloc` or copy synchronously (temporaries that
///   live only within one pass may come from [`Slot::pool`]);
/// * do the same work every time they are called for the same slot: warmup calls them
///   exactly as capture does, and the graph then replays what capture recorded;
/// * keep what the backward of a microbatch needs in the slot's [`saved`](Slot::saved)
///   buffers (one set per (chunk, microbatch, layer), kept until that backward ran), or
///   read it from the slot's forward [`inputs`](Slot::inputs) and
///   [`outputs`](Slot::outputs), which the runtime also keeps per microbatch. Anything kept
///   in the callable itself is shared by all microbatches and is overwritten by the next
///   microbatch's forward before this one's backward runs.
///
/// A layer may split either pass into segments, each graphed or eager (breaking-layer
/// capture for MoE, see [`segments`](crate::segments)): it declares them with
/// [`forward_segments`](Self::forward_segments) / [`backward_segments`](Self::backward_segments)
/// and implements [`forward_segment`](Self::forward_segment) /
/// [`backward_segment`](Self::backward_segment) for the graphed ones and
/// [`forward_eager`](Self::forward_eager) / [`backward_eager`](Self::backward_eager) for the
/// eager ones. The runtime then calls only those; [`forward`](Self::forward) and
/// [`backward`](Self::backward) are best written as the whole pass (every segment in order,
/// eagerly), which is what an eager reference run calls. By default a pass is one graphed
/// segment that is `forward` / `backward`.
///
/// Writing to a `&DeviceBuffer` through a kernel launch is allowed (the memory is on the
/// device; [`Stream::launch`] is `unsafe` and the callable vouches for its kernels).
///
/// # Example
///
/// ```no_run
/// use graphed_callables::{Callable, Slot};
/// use cuda_graph::{kernel_args, DeviceBuffer, Kernel, LaunchConfig, Result, Stream};
///
/// /// y = x * w elementwise; dx = dy * w, dw += dy * x.
/// struct Scale {
///     w: DeviceBuffer<f32>,
///     dw: DeviceBuffer<f32>,
///     fwd: Kernel, // mul(x, w, y, n)
///     bwd: Kernel, // mul_bwd(dy, x, w, dx, dw, n)
/// }
///
/// impl Callable<f32> for Scale {
///     fn input_lens(&self) -> Vec<usize> { vec![self.w.len()] }
///     fn output_lens(&self) -> Vec<usize> { vec![self.w.len()] }
///     fn parameters(&self) -> Vec<&DeviceBuffer<f32>> { vec![&self.w] }
///     fn gradients(&self) -> Vec<&DeviceBuffer<f32>> { vec![&self.dw] }
///     fn forward(
///         &mut self,
///         stream: &Stream,
///         inputs: &[&DeviceBuffer<f32>],
///         outputs: &[&DeviceBuffer<f32>],
///         _slot: &Slot<'_, f32>,
///     ) -> Result<()> {
///         let n = self.w.len() as u32;
///         // SAFETY: the kernel reads n floats of x and w and writes n floats of y.
///         unsafe {
///             stream.launch(&self.fwd, &LaunchConfig::for_elements(n, 256),
///                 &kernel_args![*inputs[0], self.w, *outputs[0], n])
///         }
///     }
///     fn backward(
///         &mut self,
///         stream: &Stream,
///         grad_outputs: &[&DeviceBuffer<f32>],
///         grad_inputs: &[&DeviceBuffer<f32>],
///         slot: &Slot<'_, f32>,
///     ) -> Result<()> {
///         let n = self.w.len() as u32;
///         // The forward input of *this* microbatch, kept by the runtime until now.
///         let x = slot.inputs()[0];
///         // SAFETY: the kernel touches n floats of each buffer.
///         unsafe {
///             stream.launch(&self.bwd, &LaunchConfig::for_elements(n, 256),
///                 &kernel_args![*grad_outputs[0], *x, self.w, *grad_inputs[0], self.dw, n])
///         }
///     }
/// }
/// ```
pub trait Callable<T: DeviceRepr>: Send {
    /// The length in elements of each input.
    fn input_lens(&self) -> Vec<usize>;

    /// The length in elements of each output.
    fn output_lens(&self) -> Vec<usize>;

    /// The sizes in bytes of the buffers the backward needs from its microbatch's forward
    /// (saved activations: FP8 bytes, scales, indices, anything). The runtime allocates one
    /// set per (chunk, microbatch, layer), each aligned to
    /// [`POOL_ALIGN`](cuda_graph::POOL_ALIGN) bytes, and passes it as [`Slot::saved`] to both
    /// passes of that microbatch; view one as the type it holds with
    /// [`DeviceBuffer::reinterpret`] and [`DeviceBuffer::slice`]. Default: none.
    fn saved_bytes(&self) -> Vec<usize> {
        Vec::new()
    }

    /// The parameters (buffers the callable owns). The runtime does not touch them; it
    /// reports them per graph ([`GraphedCallables::parameters_of`](crate::GraphedCallables::parameters_of)).
    fn parameters(&self) -> Vec<&DeviceBuffer<T>> {
        Vec::new()
    }

    /// The gradients of [`parameters`](Self::parameters), in the same order. Backward
    /// accumulates into them; the runtime zeroes them once, after warmup (whose backwards
    /// run with zero output gradients but may still add terms of their own, an aux loss's
    /// say), and never again.
    fn gradients(&self) -> Vec<&DeviceBuffer<T>> {
        Vec::new()
    }

    /// Enqueues the weight casts this layer does once per training step (e.g. FP8 weight
    /// quantization into a cast-weight buffer the forward reads). Default: nothing.
    ///
    /// The runtime calls it before [`forward`](Self::forward) and makes it take effect only
    /// on the chunk's first microbatch of each training step, by one of two mechanisms
    /// ([`WeightCaching`](crate::WeightCaching)): with an IF conditional node around the casts
    /// ([`slot.skip_weight_cast()`](Slot::skip_weight_cast) is `None`: cast
    /// unconditionally), or with a device noop flag every cast kernel must honour
    /// (`Some(flag)`: skip the cast when `flag[0] == 1.0`). Warmup calls it eagerly before
    /// every forward, with first-microbatch semantics.
    ///
    /// In the conditional mechanism the casts are captured into the body of an IF node, which
    /// may hold only kernel, memset and memcpy nodes (and nested conditionals): no event
    /// records or waits, no host functions, no stream-ordered allocations, no forks to other
    /// streams. Enqueue the same work on every call for the same slot.
    ///
    /// With segmented forwards ([`forward_segments`](Self::forward_segments)) the casts go at
    /// the head of the first *graphed* segment (warmup calls this right before it); a forward
    /// with no graphed segment never gets this call (cast in the eager code instead). See
    /// [`segments`](crate::segments#weight-casts). Nor does a callable with FP8 off
    /// ([`Slot::low_precision`]).
    fn cast_weights(&mut self, stream: &Stream, slot: &Slot<'_, T>) -> Result<()> {
        let _ = (stream, slot);
        Ok(())
    }

    /// Whether this layer's captured weight casts may run *beside* the start of its cast
    /// segment instead of before it. Default `false`.
    ///
    /// With `true`, the runtime captures the casts of a graph whose casting callables all
    /// say so on a stream forked from the capture (the IF node too, in
    /// [`Conditional`](crate::WeightCaching::Conditional) mode), so the segment's first
    /// kernels (a MoE layer's router and permute, say) run while the weights are cast; the
    /// fork is joined at the end of the graph. The segment must call
    /// [`slot.wait_weight_cast(stream)`](Slot::wait_weight_cast) before its first kernel
    /// that reads what [`cast_weights`](Self::cast_weights) writes: until then nothing
    /// orders the two. Later segments, eager ones, warmup and other microbatches need no
    /// call (the wait is a no-op there), but it is always allowed.
    fn overlaps_weight_cast(&self) -> bool {
        false
    }

    /// Enqueues the forward pass on `stream`: reads `inputs` (lengths
    /// [`input_lens`](Self::input_lens)), writes `outputs` (lengths
    /// [`output_lens`](Self::output_lens)) and what the backward needs into
    /// [`slot.saved()`](Slot::saved).
    fn forward(
        &mut self,
        stream: &Stream,
        inputs: &[&DeviceBuffer<T>],
        outputs: &[&DeviceBuffer<T>],
        slot: &Slot<'_, T>,
    ) -> Result<()>;

    /// Enqueues the backward pass on `stream`: reads `grad_outputs` (one per output) and
    /// the slot's saved buffers and forward inputs/outputs, writes `grad_inputs` (one per
    /// input; overwrite, do not accumulate) and accumulates parameter gradients.
    fn backward(
        &mut self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<T>],
        grad_inputs: &[&DeviceBuffer<T>],
        slot: &Slot<'_, T>,
    ) -> Result<()>;

    /// The input-gradient half of [`backward`](Self::backward), for schedules that split
    /// weight gradients into their own step (order entries `-k - 0.5`, TransformerEngine's
    /// delayed weight-gradient computation): the backward step calls this, the
    /// weight-gradient step later calls [`backward_weight`](Self::backward_weight) for the
    /// same slot. Reads `grad_outputs` and the slot, writes `grad_inputs` (overwrite), and
    /// keeps in [`slot.saved()`](Slot::saved) whatever the weight gradient needs that is not
    /// in the slot already (`grad_outputs` stay untouched until then).
    /// `backward_input` then `backward_weight` must equal `backward`.
    ///
    /// Default: an error naming the slot (a callable that supports split schedules
    /// implements both). A schedule with weight-gradient entries needs every callable's
    /// backward to be the single default segment.
    fn backward_input(
        &mut self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<T>],
        grad_inputs: &[&DeviceBuffer<T>],
        slot: &Slot<'_, T>,
    ) -> Result<()> {
        let _ = (stream, grad_outputs, grad_inputs);
        Err(not_implemented(
            slot,
            "the schedule splits weight gradients (-k - 0.5 entries)",
            "backward_input / backward_weight",
        ))
    }

    /// The weight-gradient half of [`backward`](Self::backward) (see
    /// [`backward_input`](Self::backward_input)): accumulates the parameter gradients from
    /// `grad_outputs` (the static buffers the backward step read) and the slot's buffers.
    /// Default: an error naming the slot.
    fn backward_weight(
        &mut self,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<T>],
        slot: &Slot<'_, T>,
    ) -> Result<()> {
        let _ = (stream, grad_outputs);
        Err(not_implemented(
            slot,
            "the schedule splits weight gradients (-k - 0.5 entries)",
            "backward_weight",
        ))
    }

    /// The segments of the forward pass, run in this order (breaking-layer capture; see
    /// [`segments`](crate::segments)). Default `[Graphed]`: the whole forward is one graph
    /// ([`forward_segment`](Self::forward_segment)`(0)` = [`forward`](Self::forward)). An
    /// empty list is an error at build; a list of only eager segments is allowed (the pass
    /// has no graph). Asked once, at build.
    fn forward_segments(&self) -> Vec<SegmentKind> {
        vec![SegmentKind::Graphed]
    }

    /// The segments of the backward pass, like [`forward_segments`](Self::forward_segments)
    /// (they need not match the forward's). Default `[Graphed]`.
    fn backward_segments(&self) -> Vec<SegmentKind> {
        vec![SegmentKind::Graphed]
    }

    /// Enqueues graphed forward segment `segment` on `stream`: called in warmup (eagerly)
    /// and inside the capture of that segment's graph, under the rules of
    /// [`forward`](Self::forward). Data for later segments goes into static buffers (see
    /// [`segments`](crate::segments#data-across-segment-boundaries)).
    ///
    /// Default: segment 0 is [`forward`](Self::forward); any other segment is an error
    /// (a callable that declares more segments implements this).
    fn forward_segment(
        &mut self,
        segment: usize,
        stream: &Stream,
        inputs: &[&DeviceBuffer<T>],
        outputs: &[&DeviceBuffer<T>],
        slot: &Slot<'_, T>,
    ) -> Result<()> {
        if segment == 0 {
            self.forward(stream, inputs, outputs, slot)
        } else {
            Err(not_implemented(
                slot,
                &format!("forward segment {segment} declared graphed"),
                "forward_segment",
            ))
        }
    }

    /// Enqueues graphed backward segment `segment`, like
    /// [`forward_segment`](Self::forward_segment) for [`backward`](Self::backward).
    fn backward_segment(
        &mut self,
        segment: usize,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<T>],
        grad_inputs: &[&DeviceBuffer<T>],
        slot: &Slot<'_, T>,
    ) -> Result<()> {
        if segment == 0 {
            self.backward(stream, grad_outputs, grad_inputs, slot)
        } else {
            Err(not_implemented(
                slot,
                &format!("backward segment {segment} declared graphed"),
                "backward_segment",
            ))
        }
    }

    /// Runs eager forward segment `segment` on `stream`, outside any capture: in warmup and
    /// at every replay, between the graph launches of the other segments. It may copy
    /// device values to the host, synchronize `stream` and launch work whose shape depends
    /// on them; it reads and writes the slot's static buffers (what a later graphed segment
    /// reads must be written there, at fixed addresses). It takes `&self` because replays
    /// take `&GraphedCallables`: keep mutable host state in a `Cell`/`RefCell`/`Mutex`.
    ///
    /// Default: an error (a callable that declares an eager segment implements this).
    fn forward_eager(
        &self,
        segment: usize,
        stream: &Stream,
        inputs: &[&DeviceBuffer<T>],
        outputs: &[&DeviceBuffer<T>],
        slot: &Slot<'_, T>,
    ) -> Result<()> {
        let _ = (stream, inputs, outputs);
        Err(not_implemented(
            slot,
            &format!("forward segment {segment} declared eager"),
            "forward_eager",
        ))
    }

    /// Runs eager backward segment `segment`, like [`forward_eager`](Self::forward_eager).
    fn backward_eager(
        &self,
        segment: usize,
        stream: &Stream,
        grad_outputs: &[&DeviceBuffer<T>],
        grad_inputs: &[&DeviceBuffer<T>],
        slot: &Slot<'_, T>,
    ) -> Result<()> {
        let _ = (stream, grad_outputs, grad_inputs);
        Err(not_implemented(
            slot,
            &format!("backward segment {segment} declared eager"),
            "backward_eager",
        ))
    }
}

/// The error of a default [`Callable`] method that what the callable declared (`why`) needs
/// but it does not implement (`method`).
fn not_implemented<T: DeviceRepr>(slot: &Slot<'_, T>, why: &str, method: &str) -> Error {
    Error::InvalidArgument(format!(
        "callable of {}: {why} but {method} is not implemented",
        slot.at()
    ))
}

/// The per-(chunk, microbatch, layer) context of one pass: where it is, and the static
/// buffers that belong to that microbatch and survive from its forward to its backward.
#[derive(Debug)]
pub struct Slot<'a, T: DeviceRepr> {
    pub(crate) at: GraphIndex,
    pub(crate) inputs: Vec<&'a DeviceBuffer<T>>,
    pub(crate) outputs: Vec<&'a DeviceBuffer<T>>,
    pub(crate) saved: Vec<&'a DeviceBuffer<u8>>,
    pub(crate) pool: Option<&'a GraphPool>,
    pub(crate) warmup: bool,
    pub(crate) skip_weight_cast: Option<&'a DeviceBuffer<f32>>,
    pub(crate) weight_cast: Option<Arc<Event>>,
    pub(crate) recorder: Option<&'a TensorRecorder>,
    pub(crate) fp8: bool,
}

impl<'a, T: DeviceRepr> Slot<'a, T> {
    /// A slot for running a callable outside the runtime (eagerly, e.g. as the reference a
    /// test compares the graphs with): the caller provides the microbatch's buffers and
    /// keeps `saved` (sized by [`Callable::saved_bytes`]) from the forward to the backward.
    /// No pool: give one with [`with_pool`](Self::with_pool) to callables that allocate
    /// temporaries from [`pool`](Self::pool).
    pub fn new(
        at: GraphIndex,
        inputs: Vec<&'a DeviceBuffer<T>>,
        outputs: Vec<&'a DeviceBuffer<T>>,
        saved: Vec<&'a DeviceBuffer<u8>>,
    ) -> Slot<'a, T> {
        Slot {
            at,
            inputs,
            outputs,
            saved,
            pool: None,
            warmup: false,
            skip_weight_cast: None,
            weight_cast: None,
            recorder: None,
            fp8: true,
        }
    }

    /// This slot with `pool` as its [`pool`](Self::pool).
    pub fn with_pool(mut self, pool: &'a GraphPool) -> Slot<'a, T> {
        self.pool = Some(pool);
        self
    }

    /// This slot with FP8 on or off ([`low_precision`](Self::low_precision)), for running a
    /// callable eagerly as the runtime would with
    /// [`GraphedOptions::low_precision`](crate::GraphedOptions::low_precision).
    pub fn with_low_precision(mut self, enabled: bool) -> Slot<'a, T> {
        self.fp8 = enabled;
        self
    }

    /// This slot reporting [`record_tensors`](Self::record_tensors) to `recorder`
    /// (e.g. to see what an eager reference run of a callable uses).
    pub fn with_recorder(mut self, recorder: &'a TensorRecorder) -> Slot<'a, T> {
        self.recorder = Some(recorder);
        self
    }

    /// This slot with `flag` as its [`skip_weight_cast`](Self::skip_weight_cast) flag, for
    /// running a callable eagerly in the noop-flag form.
    pub fn with_skip_weight_cast(mut self, flag: Option<&'a DeviceBuffer<f32>>) -> Slot<'a, T> {
        self.skip_weight_cast = flag;
        self
    }

    /// A slot for a part of this pass (e.g. one expert of a MoE layer run as its own
    /// [`Callable`]) with its own buffers: the same position, pool, warmup state, weight-cast
    /// flag and FP8 recorder, so what the part reports through
    /// [`record_tensors`](Self::record_tensors) is recorded for this pass.
    pub fn with_buffers<'b>(
        &'b self,
        inputs: Vec<&'b DeviceBuffer<T>>,
        outputs: Vec<&'b DeviceBuffer<T>>,
        saved: Vec<&'b DeviceBuffer<u8>>,
    ) -> Slot<'b, T> {
        Slot {
            at: self.at,
            inputs,
            outputs,
            saved,
            pool: self.pool,
            warmup: self.warmup,
            skip_weight_cast: self.skip_weight_cast,
            weight_cast: self.weight_cast.clone(),
            recorder: self.recorder,
            fp8: self.fp8,
        }
    }

    /// The (chunk, microbatch, layer) of this pass.
    pub fn at(&self) -> GraphIndex {
        self.at
    }

    /// The microbatch (0-based).
    pub fn microbatch(&self) -> usize {
        self.at.microbatch
    }

    /// Whether this is its chunk's first microbatch, on which FP8 weights are cast (the
    /// value captured into this graph; it never changes for a given slot).
    pub fn is_first_microbatch(&self) -> bool {
        self.at.microbatch == 0
    }

    /// The static forward inputs of this microbatch (also in the backward).
    pub fn inputs(&self) -> &[&'a DeviceBuffer<T>] {
        &self.inputs
    }

    /// The static forward outputs of this microbatch (also in the backward).
    pub fn outputs(&self) -> &[&'a DeviceBuffer<T>] {
        &self.outputs
    }

    /// This microbatch's saved-activation buffers, lengths
    /// [`Callable::saved_bytes`]; the same buffers in the forward and the backward.
    pub fn saved(&self) -> &[&'a DeviceBuffer<u8>] {
        &self.saved
    }

    /// The pool all graphs draw from, for temporaries that live within one pass (a later
    /// graph may reuse their memory once they are dropped). Always `Some` in the runtime;
    /// `None` in a slot made with [`Slot::new`] unless given [`with_pool`](Self::with_pool).
    pub fn pool(&self) -> Option<&'a GraphPool> {
        self.pool
    }

    /// Whether this call is a warmup run (eager, not captured).
    pub fn is_warmup(&self) -> bool {
        self.warmup
    }

    /// In [`WeightCaching::NoopFlag`](crate::WeightCaching::NoopFlag) mode, the device flag
    /// (one `f32`) the weight-cast kernels of [`Callable::cast_weights`] must take as their
    /// noop flag: 1.0 means skip the cast (not the first microbatch of the step), 0.0 cast.
    /// The runtime writes it before every forward replay of this (chunk, microbatch) whose
    /// graphs cast weights ([`GraphedCallables::casts_weights`](crate::GraphedCallables::casts_weights));
    /// eager segments that cast read [`is_first_microbatch`](Self::is_first_microbatch)
    /// instead.
    /// `None` in [`Conditional`](crate::WeightCaching::Conditional) mode (the IF node
    /// decides; cast unconditionally) and in slots made with [`Slot::new`].
    pub fn skip_weight_cast(&self) -> Option<&'a DeviceBuffer<f32>> {
        self.skip_weight_cast
    }

    /// Makes `stream` wait for this graph's weight casts when the runtime captured them on
    /// a forked stream (a callable that [overlaps its
    /// casts](Callable::overlaps_weight_cast), in its cast segment); a no-op otherwise.
    /// Call it before the first kernel that reads the cast weights.
    ///
    /// Errors: [`Error::Driver`](cuda_graph::Error::Driver) from the event wait.
    pub fn wait_weight_cast(&self, stream: &Stream) -> Result<()> {
        match &self.weight_cast {
            Some(event) => stream.wait_event(event),
            None => Ok(()),
        }
    }

    /// Whether this callable runs its low-precision path
    /// ([`GraphedOptions::low_precision`](crate::GraphedOptions::low_precision), like
    /// TransformerEngine's per-callable `fp8_enabled`): a layer that has an FP8 path and a
    /// high-precision one picks by this, the same in warmup, capture and its eager use. With
    /// it off the runtime never calls [`Callable::cast_weights`] for it. `true` for
    /// [`Slot::new`].
    pub fn low_precision(&self) -> bool {
        self.fp8
    }

    /// Reports that this pass ran the FP8 tensors `tensors`: indices into the caller's
    /// scaling state (a layer's input, weight and gradient tensors; a MoE layer reports
    /// only the experts that got tokens). The runtime gives every warmup pass a recorder
    /// per callable and hands what was reported to
    /// [`GraphedOptions::after_warmup`](crate::GraphedOptions::after_warmup) as a
    /// [`WarmupRecord`](crate::WarmupRecord), so that exactly the tensors that ran are
    /// registered for amax reduction and scale updates (see [`weights`](crate::weights)).
    /// Captures and replays do not record (their work is fixed at capture); a slot without
    /// a recorder ([`Slot::new`]) ignores the call.
    pub fn record_tensors(&self, tensors: impl IntoIterator<Item = usize>) {
        if let Some(r) = self.recorder {
            r.record(tensors);
        }
    }
}
