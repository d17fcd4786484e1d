//! [`MoeAdamW`]: AdamW for a [`MoeLayer`]'s parameters on the device, with f32 master
//! weights for the bf16 expert weights, capturable into a graph with the rest of a step.
//!
//! With a layer whose FP8 weights come from the optimizer
//! ([`MoeLayer::with_fp8_weights_from_optimizer`], TransformerEngine's FP8 parameters), each
//! expert weight's update ends in its FP8 cast-transpose, fused
//! ([`AdamWState::update_cast_transpose_batched`]): the step's forward then casts nothing.
//! Otherwise the update writes the layer's bf16 weights and the next step's forward casts
//! them. Both give the same FP8 bytes, scales and amaxes, bit for bit, when the scale update
//! runs between the backward and the optimizer step (as TransformerEngine orders them): the
//! cast in the optimizer uses the scales the next forward would, and records the amax of the
//! weights that forward uses.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use cuda_graph::{Context, Stream};
//! # use fp8_kernels::{AdamW, DelayedScaling};
//! # use fp8_moe::moe::layer::{MoeLayer, MoeLayerConfig, MoeParams};
//! # use fp8_moe::moe::optim::MoeAdamW;
//! # fn demo(stream: &Stream, cfg: MoeLayerConfig, params: &MoeParams,
//! #         scaling: Arc<DelayedScaling>) -> cuda_graph::Result<()> {
//! let layer = MoeLayer::new(stream, cfg, params, scaling.clone(), 0)?
//!     .with_step_gradients(true)
//!     .with_fp8_weights_from_optimizer(stream, true)?;
//! let opt = MoeAdamW::new(stream, &layer, AdamW::default())?;
//! // Per training step: the forwards and backwards of its microbatches (the layer may
//! // move into a graphed-callables runtime: the optimizer keeps handles to its buffers),
//! // then the scale update, then
//! scaling.update(stream)?;
//! opt.step(stream, None)?;
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cuda_graph::{DeviceBuffer, Result, Stream};
use fp8_kernels::{AdamW, AdamWState, AdamWTensor, DeviceScalar, HpBuffer};

use super::ep::ExpertParallelMoe;
use super::layer::{ExpertWeight, MoeLayer};

/// f32 master weights and their moments.
#[derive(Debug)]
struct Master {
    p: DeviceBuffer<f32>,
    m: DeviceBuffer<f32>,
    v: DeviceBuffer<f32>,
}

impl Master {
    /// Zero moments, and `p` as given.
    fn new(stream: &Stream, p: DeviceBuffer<f32>) -> Result<Master> {
        let zeros = || -> Result<DeviceBuffer<f32>> {
            let b = DeviceBuffer::alloc(stream.context(), p.len())?;
            b.memset_bytes(stream, 0)?;
            Ok(b)
        };
        Ok(Master {
            m: zeros()?,
            v: zeros()?,
            p,
        })
    }

    fn tensor<'a>(
        &'a self,
        grad: HpBuffer<'a>,
        copy: Option<&'a DeviceBuffer<cuda_graph::half::bf16>>,
    ) -> AdamWTensor<'a> {
        AdamWTensor {
            param: &self.p,
            grad,
            exp_avg: &self.m,
            exp_avg_sq: &self.v,
            bf16_copy: copy,
        }
    }
}

/// AdamW over one [`MoeLayer`]'s router weight (f32, updated in place) and expert weights
/// (f32 master copies here; the layer's bf16 weights, or its FP8 weights, written from
/// them). See the [module documentation](self).
///
/// [`step`](Self::step) reads the layer's gradients as they are: give the layer
/// [`with_step_gradients`](MoeLayer::with_step_gradients) (or zero them between steps) so
/// that they hold one step's sum.
#[derive(Debug)]
pub struct MoeAdamW {
    state: AdamWState,
    router: (DeviceBuffer<f32>, DeviceBuffer<f32>),
    router_moments: Master,
    experts: [ExpertWeight; 2],
    masters: [Master; 2],
    /// The layer's mode ([`MoeLayer::fp8_weights_from_optimizer`]), read at each step.
    casts: Arc<AtomicBool>,
}

impl MoeAdamW {
    /// An optimizer at step 0 for `layer` (following its mode of
    /// [`with_fp8_weights_from_optimizer`](MoeLayer::with_fp8_weights_from_optimizer) at
    /// every step, also when it changes later): master weights from the layer's bf16 ones
    /// (exact), zero moments. Allocates `4 x 3` bytes per expert parameter and 8 per router
    /// parameter, uploads and waits (not during a capture). `hyper` is checked ([`AdamW::check`]).
    pub fn new(stream: &Stream, layer: &MoeLayer, hyper: AdamW) -> Result<MoeAdamW> {
        MoeAdamW::from_parts(stream, layer, layer.router_params(), hyper)
    }

    /// [`new`](Self::new) for one rank's part of an expert-parallel layer: the replicated
    /// router weight (whose gradient is this rank's tokens', to be summed over the ranks
    /// before the step) and this rank's experts (`E / N` of them).
    pub fn new_expert_parallel(
        stream: &Stream,
        layer: &ExpertParallelMoe,
        hyper: AdamW,
    ) -> Result<MoeAdamW> {
        MoeAdamW::from_parts(stream, layer.experts_layer(), layer.router_params(), hyper)
    }

    /// The optimizer of `experts`' expert weights and of `router` (weight, gradient).
    fn from_parts(
        stream: &Stream,
        layer: &MoeLayer,
        router: (DeviceBuffer<f32>, DeviceBuffer<f32>),
        hyper: AdamW,
    ) -> Result<MoeAdamW> {
        let state = AdamWState::new(stream, hyper)?;
        let experts = layer.expert_weights()?;
        let master = |ew: &ExpertWeight| -> Result<Master> {
            let w: Vec<f32> = ew.w.to_vec(stream)?.iter().map(|x| x.to_f32()).collect();
            Master::new(stream, DeviceBuffer::from_host(stream, &w)?)
        };
        let masters = [master(&experts[0])?, master(&experts[1])?];
        // The router weight is its own master: only its moments live here.
        let router_moments = Master::new(stream, router.0.share())?;
        stream.synchronize()?;
        Ok(MoeAdamW {
            state,
            router,
            router_moments,
            experts,
            masters,
            casts: layer.optimizer_casts_flag(),
        })
    }

    /// The device state (step count, learning rate: [`AdamWState::lr`]).
    pub fn state(&self) -> &AdamWState {
        &self.state
    }

    /// fc1's f32 master weights `[E, 2F, H]`.
    pub fn master_fc1(&self) -> &DeviceBuffer<f32> {
        &self.masters[0].p
    }

    /// fc2's f32 master weights `[E, H, F]`.
    pub fn master_fc2(&self) -> &DeviceBuffer<f32> {
        &self.masters[1].p
    }

    /// Every f32 buffer of the optimizer's state, named: the router weight (the layer's own)
    /// and its moments, then fc1's and fc2's f32 master weights and their moments. A
    /// checkpoint saves these; after writing them back, [`sync_fp8_weights`](Self::sync_fp8_weights)
    /// remakes what derives from the masters.
    pub fn named_buffers(&self) -> Vec<(&'static str, &DeviceBuffer<f32>)> {
        let mut v = vec![
            ("router", &self.router.0),
            ("router.exp_avg", &self.router_moments.m),
            ("router.exp_avg_sq", &self.router_moments.v),
        ];
        for (name, m) in ["fc1", "fc2"].into_iter().zip(&self.masters) {
            let [p, ea, eas] = match name {
                "fc1" => ["fc1", "fc1.exp_avg", "fc1.exp_avg_sq"],
                _ => ["fc2", "fc2.exp_avg", "fc2.exp_avg_sq"],
            };
            v.extend([(p, &m.p), (ea, &m.m), (eas, &m.v)]);
        }
        v
    }

    /// Remakes the layer's bf16 expert weights from the f32 masters (rounded to nearest
    /// even) and, when the optimizer writes the FP8 weights, their FP8 copies with the
    /// scaling state's current scales: after master weights were written from outside (a
    /// checkpoint), the layer then holds exactly what the optimizer step that wrote those
    /// masters left. Reads the masters back (waits; not during a capture).
    pub fn sync_fp8_weights(&self, stream: &Stream) -> Result<()> {
        for (ew, master) in self.experts.iter().zip(&self.masters) {
            let w: Vec<cuda_graph::half::bf16> = master
                .p
                .to_vec(stream)?
                .into_iter()
                .map(cuda_graph::half::bf16::from_f32)
                .collect();
            ew.w.copy_from_host(stream, &w)?;
            if self.casts.load(Ordering::Acquire) {
                fp8_kernels::cast_transpose_batched(stream, &ew.w, ew.shape, &ew.cast_out(), None)?;
            }
        }
        stream.synchronize()
    }

    /// The gradients this optimizer reads: the router weight's (f32), then fc1's and fc2's
    /// (the layer's weight-gradient type), e.g. for a gradient-norm clip over a model.
    pub fn gradients(&self) -> Vec<HpBuffer<'_>> {
        let mut g = vec![HpBuffer::F32(&self.router.1)];
        g.extend(self.experts.iter().map(|ew| ew.grad.view()));
        g
    }

    /// Enqueues one optimizer step on `stream` (also inside a capture; nothing read back):
    /// the step count advances, the router weight and both expert weights are updated from
    /// the layer's gradients (multiplied by `grad_scale` when given, read on the device: a
    /// clipping factor), and the expert weights' new values go to the layer as bf16, or, when
    /// the layer takes its FP8 weights from the optimizer, as FP8 row-major and transposed
    /// with each expert's scale (its scale_inv written, its amax maxed in).
    pub fn step(&self, stream: &Stream, grad_scale: Option<&DeviceScalar>) -> Result<()> {
        self.state.begin_step(stream)?;
        let router = self
            .router_moments
            .tensor(HpBuffer::F32(&self.router.1), None);
        self.state.update(stream, &router, grad_scale)?;
        for (ew, master) in self.experts.iter().zip(&self.masters) {
            if self.casts.load(Ordering::Acquire) {
                let t = master.tensor(ew.grad.view(), None);
                self.state.update_cast_transpose_batched(
                    stream,
                    &t,
                    ew.shape,
                    &ew.cast_out(),
                    grad_scale,
                )?;
            } else {
                let t = master.tensor(ew.grad.view(), Some(&ew.w));
                self.state.update(stream, &t, grad_scale)?;
            }
        }
        Ok(())
    }
}
