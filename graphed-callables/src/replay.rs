//! Replaying graphed callables in schedule order.

use crate::error::{Error, Result};
use cuda_graph::Stream;
use cuda_graph::{DeviceBuffer, DeviceRepr};

use crate::program::{Item, Part};
use crate::runtime::GraphedCallables;
use crate::schedule::{Pass, Schedule, Step};
use crate::weights::StepHook;

/// Where a training step stands: the position of the next step in the schedule.
///
/// Replays must follow the schedule, since the graphs share a pool in capture order and the
/// static buffers of a microbatch hold its activations until its backward. After the last
/// step the cursor wraps: the next replay must be the schedule's first step and starts a new
/// training step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ReplayCursor {
    next: usize,
    /// A step whose replay failed after it may have enqueued part of its work: replaying it
    /// again would repeat that part (gradients added twice), so only
    /// [`reset`](Self::reset) moves on.
    broken: Option<Step>,
}

impl ReplayCursor {
    /// The position of the next step (0 after the last one).
    fn position(&self, schedule: &Schedule) -> usize {
        if self.next >= schedule.steps().len() {
            0
        } else {
            self.next
        }
    }

    /// The step the schedule expects next.
    pub(crate) fn next_step(&self, schedule: &Schedule) -> Option<Step> {
        schedule.steps().get(self.position(schedule)).copied()
    }

    /// Checks that `got` is the expected step; returns its position. Does not advance.
    pub(crate) fn check(&self, schedule: &Schedule, got: Step) -> Result<usize> {
        if let Some(failed) = self.broken {
            return Err(Error::invalid(format!(
                "the {} failed after part of it was enqueued, and replaying it again would \
                 repeat that part (its gradients added twice): call reset_step to start the \
                 training step over",
                describe_step(&failed)
            )));
        }
        let position = self.position(schedule);
        match schedule.steps().get(position) {
            Some(&expected) if expected == got => Ok(position),
            Some(&expected) => Err(Error::ReplayOrder {
                position,
                expected,
                got,
            }),
            None => Err(Error::invalid("the schedule has no steps")),
        }
    }

    /// Moves past the step at `position`.
    pub(crate) fn advance(&mut self, position: usize) {
        self.next = position + 1;
    }

    /// Back to the schedule's first step (a failed step forgotten).
    pub(crate) fn reset(&mut self) {
        self.next = 0;
        self.broken = None;
    }
}

/// How a step reads in messages: "forward of chunk 1 microbatch 0 (entry 2)", chunk and
/// microbatch 0-based like everywhere, with the order entry (1-based) that produces it.
pub(crate) fn describe_step(step: &Step) -> String {
    let pass = match step.pass() {
        Pass::Forward => "forward",
        Pass::Backward => "backward",
        Pass::WeightGrad => "weight gradient",
    };
    format!(
        "{pass} of chunk {} microbatch {} (entry {})",
        step.chunk(),
        step.microbatch(),
        step.entry()
    )
}

/// Copies `src` into the static buffer `dst` on `stream` unless they are the same memory;
/// returns whether it enqueued a copy.
///
/// The static buffers are written through `&` so that replays take `&self` and callers may
/// pass buffers the runtime returned (e.g. chunk 0's outputs as chunk 1's inputs).
pub(crate) fn copy_in<T: DeviceRepr>(
    dst: &DeviceBuffer<T>,
    src: &DeviceBuffer<T>,
    stream: &Stream,
) -> Result<bool> {
    // Callers check lengths first, with messages that name the buffer.
    if src.len() != dst.len() {
        return Err(Error::invalid(format!(
            "a buffer of {} elements given for a static buffer of {}",
            src.len(),
            dst.len()
        )));
    }
    // The caller passing the static buffer itself (e.g. written in place) is the fast path:
    // nothing to copy.
    if src.as_raw() == dst.as_raw() || dst.is_empty() {
        return Ok(false);
    }
    dst.copy_from_device(stream, src)?;
    Ok(true)
}

impl<T: DeviceRepr> GraphedCallables<T> {
    /// Replays the forward graphs of (`chunk`, `microbatch`), layer 0 to last, on `stream`.
    /// Any stream will do: a replay on another stream than the previous replay's (or the
    /// build's) first makes it wait for that one, so replays never overlap on the device
    /// (they share the pool's temporaries, the cached FP8 weights and the gradients); on a
    /// capturing stream that wait is the caller's to avoid (replay on the capturing stream
    /// only).
    /// A layer with several forward segments ([`Callable::forward_segments`](crate::Callable::forward_segments))
    /// runs them in order: a graph launch per graphed segment, a call of
    /// [`Callable::forward_eager`](crate::Callable::forward_eager) (on the host, with `stream`
    /// and the slot's static buffers; it may synchronize `stream`) per eager segment.
    ///
    /// Each input is copied into the static input of layer 0 unless it *is* that buffer
    /// (same device address, see [`static_inputs`](Self::static_inputs)). Returns the
    /// static outputs of the chunk's last layer: they hold this microbatch's result until
    /// its next forward replay (next training step), and are read by its backward.
    ///
    /// When a forward graph of this microbatch casts weights
    /// ([`casts_weights`](Self::casts_weights)) under a flag mechanism (IF node or noop
    /// flag), the (chunk, microbatch)'s weight-cast flag is first written on `stream` from
    /// [`is_first_microbatch`](Self::is_first_microbatch) (a one-word memset, no
    /// synchronization). After the launches the
    /// [`after_forward`](crate::GraphedOptions::after_forward) hook runs with `stream` and
    /// this step.
    ///
    /// Errors: [`Error::ReplayOrder`] if the schedule expects another step next (nothing is
    /// enqueued); [`InvalidArgument`](cuda_graph::Error::InvalidArgument) for a wrong number or length of inputs, or for a
    /// pass with eager segments on a capturing `stream` (nothing is enqueued); an eager
    /// segment's or a launch's error (what came before it was enqueued, so every replay is
    /// refused until [`reset_step`](Self::reset_step) starts the training step over: a
    /// retry would add those gradients twice); the hook's error (the graphs were launched and
    /// the replay position advanced).
    pub fn forward(
        &self,
        chunk: usize,
        microbatch: usize,
        inputs: &[&DeviceBuffer<T>],
        stream: &Stream,
    ) -> Result<&[DeviceBuffer<T>]> {
        let step = Step::Forward { chunk, microbatch };
        let position = self.cursor.get().check(&self.schedule, step)?;
        let graphs = self.graphs_of(chunk, microbatch)?;
        self.check_eager_outside_capture(position, step, stream)?;
        self.begin_replay(stream)?;
        let first = &self.buffers.plan.graphs[graphs.start].inputs;
        self.copy_all_in(inputs, first, stream, "forward", chunk, "input")?;
        // Weight caching: the flag the IF node (or the casts' noop form) reads, written
        // stream-ordered before the launches.
        if graphs.clone().any(|g| self.weights.casts[g]) {
            self.write_cast_flag(chunk, microbatch, stream)?;
        }
        self.run_step(position, step, stream)?;
        self.advance(position);
        // Amax reduction and scale update (the caller's hook) after the forward replay.
        self.run_hook(step, stream, |h| &mut h.after_forward)?;
        Ok(self.buffers.outputs_slice(graphs.end - 1))
    }

    /// Replays the backward graphs of (`chunk`, `microbatch`), last layer to layer 0, on
    /// `stream`; each layer's backward segments run in their order
    /// ([`Callable::backward_segments`](crate::Callable::backward_segments)), eager ones
    /// through [`Callable::backward_eager`](crate::Callable::backward_eager). Each output gradient is copied into the static output gradient of the last
    /// layer unless it is that buffer ([`static_grad_outputs`](Self::static_grad_outputs)).
    /// Returns the static input gradients of layer 0. After the launches the
    /// [`after_backward`](crate::GraphedOptions::after_backward) hook runs with `stream` and
    /// this step.
    ///
    /// Errors as [`forward`](Self::forward).
    pub fn backward(
        &self,
        chunk: usize,
        microbatch: usize,
        grad_outputs: &[&DeviceBuffer<T>],
        stream: &Stream,
    ) -> Result<&[DeviceBuffer<T>]> {
        let step = Step::Backward { chunk, microbatch };
        let position = self.cursor.get().check(&self.schedule, step)?;
        let graphs = self.graphs_of(chunk, microbatch)?;
        self.check_eager_outside_capture(position, step, stream)?;
        self.begin_replay(stream)?;
        let last = &self.buffers.plan.graphs[graphs.end - 1].grad_outputs;
        self.copy_all_in(
            grad_outputs,
            last,
            stream,
            "backward",
            chunk,
            "output gradient",
        )?;
        self.run_step(position, step, stream)?;
        self.advance(position);
        // Amax reduction and scale update (the caller's hook) after the backward replay.
        self.run_hook(step, stream, |h| &mut h.after_backward)?;
        Ok(self.buffers.grad_inputs_slice(graphs.start))
    }

    /// Replays the weight-gradient graphs of (`chunk`, `microbatch`) on `stream`, for
    /// schedules that split weight gradients into their own steps (order entries
    /// `-k - 0.5`): each layer's [`Callable::backward_weight`](crate::Callable::backward_weight),
    /// last layer first. It takes no buffers: it reads the static output gradients and saved
    /// buffers its backward step left. No hook runs after it.
    ///
    /// Errors: [`Error::ReplayOrder`] if the schedule expects another step next (including
    /// when it has no weight-gradient steps); [`InvalidArgument`](cuda_graph::Error::InvalidArgument) for a (chunk,
    /// microbatch) out of range. Nothing is enqueued then.
    pub fn weight_grad(&self, chunk: usize, microbatch: usize, stream: &Stream) -> Result<()> {
        self.graphs_of(chunk, microbatch)?;
        let step = Step::WeightGrad { chunk, microbatch };
        let position = self.cursor.get().check(&self.schedule, step)?;
        self.begin_replay(stream)?;
        self.run_step(position, step, stream)?;
        self.advance(position);
        Ok(())
    }

    /// What every replay does once its checks passed, before it enqueues anything of its
    /// own: refuses to run from inside a replay hook (the hook's replay would interleave
    /// with the one that called the hook), and orders this replay after everything enqueued
    /// on the previous replay's stream (the build's, before the first) when that was another
    /// stream: the graphs share the pool's temporaries, the cached FP8 weights and the
    /// parameter gradients, so replays must never overlap on the device. On the same stream
    /// it does nothing.
    fn begin_replay(&self, stream: &Stream) -> Result<()> {
        if self.hooks.try_borrow_mut().is_err() {
            return Err(Error::invalid(
                "a replay hook replayed the graphed callables it belongs to",
            ));
        }
        let mut last = self.last_stream.try_borrow_mut().map_err(|_| {
            Error::invalid("a replay of the graphed callables is already under way")
        })?;
        if let Some(prev) = last.as_ref().filter(|prev| *prev != stream) {
            stream.wait_stream(prev)?;
        }
        *last = Some(stream.clone());
        Ok(())
    }

    /// Starts a new training step: the next replay must be the schedule's first step,
    /// whatever ran of the current one.
    pub fn reset_step(&self) {
        let mut c = self.cursor.get();
        c.reset();
        self.cursor.set(c);
    }

    fn advance(&self, position: usize) {
        let mut c = self.cursor.get();
        c.advance(position);
        self.cursor.set(c);
    }

    /// [`run_program`](Self::run_program); on an error (part of the step may be enqueued)
    /// the cursor refuses every step until [`reset_step`](Self::reset_step).
    fn run_step(&self, position: usize, step: Step, stream: &Stream) -> Result<()> {
        let run = self.run_program(position, stream);
        if run.is_err() {
            let mut c = self.cursor.get();
            c.broken = Some(step);
            self.cursor.set(c);
        }
        run
    }

    /// Runs the program of the step at `position` on `stream`: its graph launches and its
    /// eager segments' host calls, in order.
    fn run_program(&self, position: usize, stream: &Stream) -> Result<()> {
        for item in self.programs.step(position) {
            match item {
                Item::Launch { exec, .. } => {
                    let e = self
                        .execs
                        .get(*exec)
                        .ok_or_else(|| Error::invalid(format!("internal: no exec {exec}")))?;
                    e.launch(stream)?;
                }
                Item::Eager(part) => self.run_eager(*part, stream)?,
            }
        }
        Ok(())
    }

    /// Calls the eager code of `part` with its slot's static buffers on `stream`.
    fn run_eager(&self, part: Part, stream: &Stream) -> Result<()> {
        let callable = self.callables.get(part.ls.callable).ok_or_else(|| {
            Error::invalid(format!("internal: callable {} missing", part.ls.callable))
        })?;
        Ok(self
            .rig()
            .run_eager(&**callable, part.ls, part.segment, stream)?)
    }

    /// Eager segments run on the host and may synchronize: a step that has any is refused
    /// on a capturing stream (before anything is enqueued).
    fn check_eager_outside_capture(
        &self,
        position: usize,
        step: Step,
        stream: &Stream,
    ) -> Result<()> {
        if self.programs.has_eager(position)
            && stream.capture_status()? != cuda_graph::CaptureStatus::None
        {
            return Err(Error::invalid(format!(
                "graphed callables: the {} has eager segments and can not be replayed on a \
                 capturing stream",
                describe_step(&step)
            )));
        }
        Ok(())
    }

    /// Enqueues the write of (`chunk`, `microbatch`)'s weight-cast flag from
    /// [`is_first_microbatch`](Self::is_first_microbatch): a one-word memset on `stream`.
    fn write_cast_flag(&self, chunk: usize, microbatch: usize, stream: &Stream) -> Result<()> {
        let first = self.is_first_microbatch(chunk, microbatch);
        let Some(bits) = self.weights.mode.flag_bits(first) else {
            // No flag in this mode (Static): the graphs themselves decide.
            return Ok(());
        };
        let pair = chunk * self.schedule.num_microbatches() + microbatch;
        let flag = self.weights.flag_word(pair).ok_or_else(|| {
            Error::invalid(format!("internal: no weight-cast flag for pair {pair}"))
        })?;
        Ok(flag.fill_u32_bits(stream, bits)?)
    }

    /// Runs the hook `pick` selects, if any, with `stream` and `step`.
    fn run_hook(
        &self,
        step: Step,
        stream: &Stream,
        pick: impl FnOnce(&mut crate::runtime::ReplayHooks) -> &mut Option<StepHook>,
    ) -> Result<()> {
        let mut hooks = self.hooks.try_borrow_mut().map_err(|_| {
            Error::invalid("a replay hook replayed the graphed callables it belongs to")
        })?;
        match pick(&mut hooks) {
            Some(h) => Ok(h(stream, step)?),
            None => Ok(()),
        }
    }

    /// Copies `srcs` into the static buffers at arena indices `dsts` on `stream` (only the
    /// ones that are other allocations), counting the copies. Every count and length is
    /// checked first: on an error nothing is enqueued, and the message names the `pass` of
    /// `chunk` and the `what` at fault.
    fn copy_all_in(
        &self,
        srcs: &[&DeviceBuffer<T>],
        dsts: &[usize],
        stream: &Stream,
        pass: &str,
        chunk: usize,
        what: &str,
    ) -> Result<()> {
        if srcs.len() != dsts.len() {
            return Err(Error::invalid(format!(
                "{pass} of chunk {chunk}: {} {what}s given, it takes {}",
                srcs.len(),
                dsts.len()
            )));
        }
        for (i, (src, &d)) in srcs.iter().zip(dsts).enumerate() {
            let want = self.buffers.arena[d].len();
            if src.len() != want {
                return Err(Error::invalid(format!(
                    "{pass} of chunk {chunk}: {what} {i} has {} elements, the static buffer \
                     {want}",
                    src.len()
                )));
            }
        }
        for (src, &d) in srcs.iter().zip(dsts) {
            let copied = copy_in(&self.buffers.arena[d], src, stream)?;
            self.copies.set(self.copies.get() + u64::from(copied));
        }
        Ok(())
    }

    /// The step the schedule expects next.
    pub fn next_step(&self) -> Option<Step> {
        self.cursor.get().next_step(&self.schedule)
    }

    /// Whether (`chunk`, `microbatch`) is its chunk's first microbatch of a training step,
    /// the one on which FP8 weights are cast. `false` out of range.
    pub fn is_first_microbatch(&self, chunk: usize, microbatch: usize) -> bool {
        chunk < self.schedule.num_chunks()
            && microbatch < self.schedule.num_microbatches()
            && Step::Forward { chunk, microbatch }.is_first_microbatch()
    }

    /// The static inputs of (`chunk`, `microbatch`)'s first layer. Writing an input there
    /// and passing these very buffers to [`forward`](Self::forward) saves the copy.
    pub fn static_inputs(&self, chunk: usize, microbatch: usize) -> Result<Vec<&DeviceBuffer<T>>> {
        let g = self.graphs_of(chunk, microbatch)?;
        Ok(self.buffers.inputs(g.start))
    }

    /// The static outputs of (`chunk`, `microbatch`)'s last layer (what
    /// [`forward`](Self::forward) returns).
    pub fn static_outputs(&self, chunk: usize, microbatch: usize) -> Result<&[DeviceBuffer<T>]> {
        let g = self.graphs_of(chunk, microbatch)?;
        Ok(self.buffers.outputs_slice(g.end - 1))
    }

    /// The static output gradients of (`chunk`, `microbatch`)'s last layer.
    pub fn static_grad_outputs(
        &self,
        chunk: usize,
        microbatch: usize,
    ) -> Result<Vec<&DeviceBuffer<T>>> {
        let g = self.graphs_of(chunk, microbatch)?;
        Ok(self.buffers.grad_outputs(g.end - 1))
    }

    /// The static input gradients of (`chunk`, `microbatch`)'s first layer (what
    /// [`backward`](Self::backward) returns).
    pub fn static_grad_inputs(
        &self,
        chunk: usize,
        microbatch: usize,
    ) -> Result<&[DeviceBuffer<T>]> {
        let g = self.graphs_of(chunk, microbatch)?;
        Ok(self.buffers.grad_inputs_slice(g.start))
    }

    /// The saved buffers of layer `layer` of (`chunk`, `microbatch`): the bytes its callable
    /// sees as [`Slot::saved`](crate::Slot::saved) in every pass of that microbatch (what it
    /// keeps there, e.g. a router's routing, can be read after a replay). Microbatches that
    /// share buffers under [`reuse_buffers`](crate::GraphedOptions::reuse_buffers) share these
    /// too.
    ///
    /// Errors: [`InvalidArgument`](cuda_graph::Error::InvalidArgument) for a chunk,
    /// microbatch or layer out of range.
    pub fn saved(
        &self,
        chunk: usize,
        microbatch: usize,
        layer: usize,
    ) -> Result<Vec<&DeviceBuffer<u8>>> {
        let g = self.graphs_of(chunk, microbatch)?;
        if layer >= g.len() {
            return Err(Error::invalid(format!(
                "no layer {layer} in chunk {chunk}: it has {} layer(s)",
                g.len()
            )));
        }
        Ok(self.buffers.saved(g.start + layer))
    }

    fn graphs_of(&self, chunk: usize, microbatch: usize) -> Result<std::ops::Range<usize>> {
        self.schedule
            .layout()
            .microbatch_graphs(chunk, microbatch)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "no chunk {chunk} microbatch {microbatch}: the schedule has {} chunk(s) \
                     of {} microbatch(es)",
                    self.schedule.num_chunks(),
                    self.schedule.num_microbatches()
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_that_failed_midway_is_refused_until_the_step_restarts() {
        let s = Schedule::new(&[1, -1], vec![2]).unwrap();
        let f = |microbatch| Step::Forward {
            chunk: 0,
            microbatch,
        };
        let mut c = ReplayCursor::default();
        let p = c.check(&s, f(0)).unwrap();
        c.advance(p);
        // The forward of microbatch 1 fails after enqueueing part of itself.
        c.broken = Some(f(1));
        for step in [f(1), f(0)] {
            let e = c.check(&s, step).unwrap_err().to_string();
            assert!(
                e.contains("forward of chunk 0 microbatch 1") && e.contains("reset_step"),
                "{e}"
            );
        }
        c.reset();
        assert_eq!(c.check(&s, f(0)).unwrap(), 0);
    }

    #[test]
    fn cursor_follows_the_schedule_and_wraps() {
        let s = Schedule::new(&[1, 2, -2, -1], vec![1, 1]).unwrap();
        let mut c = ReplayCursor::default();
        let f = |chunk, microbatch| Step::Forward { chunk, microbatch };
        let b = |chunk, microbatch| Step::Backward { chunk, microbatch };
        assert_eq!(c.next_step(&s), Some(f(0, 0)));
        let err = c.check(&s, f(1, 0)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "replay out of schedule order at order[0]: expected forward of chunk 0 \
             microbatch 0 (entry 1), got forward of chunk 1 microbatch 0 (entry 2)"
        );
        assert!(matches!(
            err,
            Error::ReplayOrder {
                position: 0,
                expected: Step::Forward { chunk: 0, .. },
                got: Step::Forward { chunk: 1, .. }
            }
        ));
        for (i, step) in [f(0, 0), f(1, 0), b(1, 0), b(0, 0)].into_iter().enumerate() {
            let p = c.check(&s, step).unwrap();
            assert_eq!(p, i);
            c.advance(p);
        }
        // A new training step starts with the first entry again.
        assert_eq!(c.next_step(&s), Some(f(0, 0)));
        assert!(c.check(&s, b(0, 0)).is_err());
        c.advance(c.check(&s, f(0, 0)).unwrap());
        c.reset();
        assert_eq!(c.check(&s, f(0, 0)).unwrap(), 0);
    }
}
