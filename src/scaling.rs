//! Delayed scaling under graphed callables.
//!
//! * [`ScalingSnapshot`]: a device copy of a [`DelayedScaling`] state (amax history, scales,
//!   inverse scales), to save it before graphed-callables warmup and restore it after (the
//!   `before_warmup` / `after_warmup` hooks), so training starts from the state it would
//!   have had without warmup.
//! * [`install_hooks`]: all four hooks a delayed-scaling recipe needs, in one call.

use std::sync::{Arc, Mutex};

use cuda_graph::{Context, DeviceBuffer, Error, Result, Stream};
use fp8_kernels::{DelayedScaling, ReductionGroup};
use graphed_callables::{GraphedOptions, Step, WarmupRecord};

/// Sets `options`' hooks for one [`DelayedScaling`] state shared by the callables:
///
/// * `before_warmup`: snapshot the state ([`ScalingSnapshot::save`]);
/// * `after_warmup`: restore it and [register](DelayedScaling::register) exactly the FP8
///   tensors warmup recorded ([`WarmupRecord::tensors`]: MoE experts that got no tokens
///   stay out of the updates);
/// * `after_forward` and `after_backward`: reduce the amaxes over `group` (TransformerEngine's
///   `fp8_group`; [`IdentityGroup`](fp8_kernels::IdentityGroup) in one process) over the
///   whole history buffer (entries past slot 0 already agree across ranks, so only the
///   current amaxes change) and run the fused [`update`](DelayedScaling::update) of every
///   registered tensor.
///
/// `ctx` is the state's context. Replaces hooks already set; the snapshot's device memory is
/// allocated here (not during a capture).
pub fn install_hooks(
    options: &mut GraphedOptions,
    ctx: &Arc<Context>,
    scaling: &Arc<DelayedScaling>,
    group: Arc<dyn ReductionGroup>,
) -> Result<()> {
    let snapshot = Arc::new(Mutex::new(ScalingSnapshot::new(ctx, scaling)?));
    // A poisoned lock only means another hook panicked mid-copy enqueue; the buffers are
    // still the snapshot's, so keep using them.
    options.before_warmup = Some(Box::new({
        let (snap, s) = (snapshot.clone(), scaling.clone());
        move |st: &Stream| snap.lock().unwrap_or_else(|p| p.into_inner()).save(st, &s)
    }));
    options.after_warmup = Some(Box::new({
        let (snap, s) = (snapshot, scaling.clone());
        move |st: &Stream, record: &WarmupRecord| {
            snap.lock()
                .unwrap_or_else(|p| p.into_inner())
                .restore(st, &s)?;
            s.register(st, record.tensors())
        }
    }));
    for hook in [&mut options.after_forward, &mut options.after_backward] {
        let (s, group) = (scaling.clone(), group.clone());
        *hook = Some(Box::new(move |st: &Stream, _: Step| {
            group.all_reduce_max(st, s.history_buffer())?;
            s.update(st)
        }));
    }
    Ok(())
}

/// Device copies of a [`DelayedScaling`]'s history, scale and scale_inv buffers.
#[derive(Debug)]
pub struct ScalingSnapshot {
    history: DeviceBuffer<f32>,
    scale: DeviceBuffer<f32>,
    scale_inv: DeviceBuffer<f32>,
}

impl ScalingSnapshot {
    /// Buffers shaped like `state`'s (contents unspecified until [`save`](Self::save)).
    /// `ctx` is the context the state lives in.
    pub fn new(ctx: &Arc<Context>, state: &DelayedScaling) -> Result<ScalingSnapshot> {
        Ok(ScalingSnapshot {
            history: DeviceBuffer::alloc(ctx, state.history_buffer().len())?,
            scale: DeviceBuffer::alloc(ctx, state.scale_buffer().len())?,
            scale_inv: DeviceBuffer::alloc(ctx, state.scale_inv_buffer().len())?,
        })
    }

    fn check(&self, state: &DelayedScaling) -> Result<()> {
        if self.history.len() == state.history_buffer().len()
            && self.scale.len() == state.scale_buffer().len()
        {
            Ok(())
        } else {
            Err(Error::InvalidArgument(
                "ScalingSnapshot: the state has another shape than the snapshot".into(),
            ))
        }
    }

    /// Enqueues copies of `state`'s buffers into the snapshot on `stream` (no wait).
    pub fn save(&self, stream: &Stream, state: &DelayedScaling) -> Result<()> {
        self.check(state)?;
        self.history
            .copy_from_device(stream, state.history_buffer())?;
        self.scale.copy_from_device(stream, state.scale_buffer())?;
        self.scale_inv
            .copy_from_device(stream, state.scale_inv_buffer())
    }

    /// Enqueues copies of the snapshot back into `state`'s buffers on `stream` (no wait).
    pub fn restore(&self, stream: &Stream, state: &DelayedScaling) -> Result<()> {
        self.check(state)?;
        state
            .history_buffer()
            .copy_from_device(stream, &self.history)?;
        state.scale_buffer().copy_from_device(stream, &self.scale)?;
        state
            .scale_inv_buffer()
            .copy_from_device(stream, &self.scale_inv)
    }
}
