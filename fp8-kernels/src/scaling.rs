//! Delayed scaling (TransformerEngine's default recipe), kept on the device for many tensors
//! and updated by one launch.

use std::sync::{Arc, Mutex};

use cuda_graph::{DeviceBuffer, Error, KernelArgs, LaunchConfig, Result, Stream};

use crate::cast_transpose::ScalarSlots;
use crate::format::Fp8Format;
use crate::module::kernel;
use crate::reference::scaled_max;
use crate::tensor::{DeviceScalar, Fp8Tensor};

/// Which amax the next scale is computed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AmaxAlgo {
    /// The max over the whole history window (NaN entries ignored, as `fmaxf` does).
    Max,
    /// The most recent amax only.
    MostRecent,
}

/// The longest supported amax history (one thread block per tensor holds it).
pub const MAX_HISTORY: usize = 1024;

/// Delayed-scaling state of `tensors` FP8 tensors, on the device:
/// * `history`: `tensors x history_len` f32, tensor-major; slot 0 of each row is the current
///   amax, the one the tensor's quantize maxes into ([`DelayedScaling::amax`]);
/// * `scale` and `scale_inv`: one f32 each per tensor (start at 1).
///
/// [`DelayedScaling::update`] then, per tensor, in one launch: takes amax = max over the row
/// ([`AmaxAlgo::Max`]) or slot 0 ([`AmaxAlgo::MostRecent`]); rolls the row (the old slot 0
/// moves to the end, the oldest entry is dropped, slot 0 becomes 0); sets
/// `scale = fp8_max * 2^-margin / amax` when amax is finite and > 0 and keeps the old scale
/// otherwise (0, inf, NaN); an infinite scale becomes `f32::MAX`; `scale_inv = 1 / scale`.
#[derive(Debug)]
pub struct DelayedScaling {
    formats: Vec<Fp8Format>,
    history_len: usize,
    margin: i32,
    algo: AmaxAlgo,
    history: Arc<DeviceBuffer<f32>>,
    scale: Arc<DeviceBuffer<f32>>,
    scale_inv: Arc<DeviceBuffer<f32>>,
    scaled_max: DeviceBuffer<f32>,
    /// Per tensor 1 = registered (updated), 0 = left alone; the host copy beside it.
    registered: Mutex<(DeviceBuffer<u32>, Vec<bool>)>,
}

/// The largest margin [`DelayedScaling::new`] takes: the target `max * 2^-margin` stays a
/// normal f32 for every format, far past any useful margin (TransformerEngine's default is 0).
pub const MAX_MARGIN: i32 = 64;

impl DelayedScaling {
    /// State for one tensor per entry of `formats`, history zero, scales 1 (waits for the
    /// copies; not during a capture). `history_len` is 1..=[`MAX_HISTORY`], `margin`
    /// 0..=[`MAX_MARGIN`].
    pub fn new(
        stream: &Stream,
        formats: &[Fp8Format],
        history_len: usize,
        margin: i32,
        algo: AmaxAlgo,
    ) -> Result<DelayedScaling> {
        if formats.is_empty() || formats.len() > i32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "delayed scaling needs 1..=2^31-1 tensors, got {}",
                formats.len()
            )));
        }
        if !(1..=MAX_HISTORY).contains(&history_len) {
            return Err(Error::InvalidArgument(format!(
                "amax history length {history_len} outside 1..={MAX_HISTORY}"
            )));
        }
        if !(0..=MAX_MARGIN).contains(&margin) {
            return Err(Error::InvalidArgument(format!(
                "scaling margin {margin} outside 0..={MAX_MARGIN} (the scale targets the \
                 format's largest value times 2^-margin)"
            )));
        }
        let t = formats.len();
        let cells = t
            .checked_mul(history_len)
            .filter(|&c| c <= u32::MAX as usize)
            .ok_or_else(|| Error::InvalidArgument("amax history too large".into()))?;
        let history = DeviceBuffer::from_host(stream, &vec![0f32; cells])?;
        let scale = DeviceBuffer::from_host(stream, &vec![1f32; t])?;
        let scale_inv = DeviceBuffer::from_host(stream, &vec![1f32; t])?;
        let sm: Vec<f32> = formats.iter().map(|&f| scaled_max(f, margin)).collect();
        let scaled_max = DeviceBuffer::from_host(stream, &sm)?;
        let registered = DeviceBuffer::from_host(stream, &vec![1u32; t])?;
        Ok(DelayedScaling {
            formats: formats.to_vec(),
            history_len,
            margin,
            algo,
            history: Arc::new(history),
            scale: Arc::new(scale),
            scale_inv: Arc::new(scale_inv),
            scaled_max,
            registered: Mutex::new((registered, vec![true; t])),
        })
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.formats.len()
    }
    /// Whether it has no tensors (never: `new` needs at least one).
    pub fn is_empty(&self) -> bool {
        self.formats.is_empty()
    }
    /// The history length.
    pub fn history_len(&self) -> usize {
        self.history_len
    }
    /// The margin.
    pub fn margin(&self) -> i32 {
        self.margin
    }
    /// The amax algorithm.
    pub fn algo(&self) -> AmaxAlgo {
        self.algo
    }
    /// Tensor `t`'s format.
    pub fn format(&self, t: usize) -> Option<Fp8Format> {
        self.formats.get(t).copied()
    }

    fn check(&self, t: usize) -> Result<()> {
        if t < self.len() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "tensor {t} of a delayed-scaling state of {}",
                self.len()
            )))
        }
    }

    /// Tensor `t`'s current amax slot (history slot 0).
    pub fn amax(&self, t: usize) -> Result<DeviceScalar> {
        self.check(t)?;
        DeviceScalar::at(&self.history, t * self.history_len)
    }
    /// Tensor `t`'s scale.
    pub fn scale(&self, t: usize) -> Result<DeviceScalar> {
        self.check(t)?;
        DeviceScalar::at(&self.scale, t)
    }
    /// Tensor `t`'s scale_inv.
    pub fn scale_inv(&self, t: usize) -> Result<DeviceScalar> {
        self.check(t)?;
        DeviceScalar::at(&self.scale_inv, t)
    }
    /// The scales of tensors `t0, t0 + 1, ...`, one per matrix of a batched cast
    /// ([`cast_transpose_batched`](crate::cast_transpose_batched) checks that its count fits).
    pub fn scale_slots(&self, t0: usize) -> Result<ScalarSlots> {
        Ok(ScalarSlots::new(self.scale(t0)?, 1))
    }
    /// The amax slots (each tensor's current history entry) of tensors `t0, t0 + 1, ...`, one
    /// per matrix of a batched cast.
    pub fn amax_slots(&self, t0: usize) -> Result<ScalarSlots> {
        Ok(ScalarSlots::new(self.amax(t0)?, self.history_len))
    }

    /// An FP8 tensor of `shape` for slot `t`, with `data` as its bytes and this state's scale,
    /// scale_inv and amax slot.
    pub fn tensor(&self, t: usize, data: DeviceBuffer<u8>, shape: &[usize]) -> Result<Fp8Tensor> {
        self.check(t)?;
        Fp8Tensor::from_parts(
            data,
            shape,
            self.formats[t],
            self.scale(t)?,
            self.scale_inv(t)?,
            self.amax(t)?,
        )
    }

    /// The history buffer (`len() x history_len()`, tensor-major).
    pub fn history_buffer(&self) -> &Arc<DeviceBuffer<f32>> {
        &self.history
    }
    /// The scales, one per tensor.
    pub fn scale_buffer(&self) -> &Arc<DeviceBuffer<f32>> {
        &self.scale
    }
    /// The inverse scales, one per tensor.
    pub fn scale_inv_buffer(&self) -> &Arc<DeviceBuffer<f32>> {
        &self.scale_inv
    }

    /// Registers exactly `tensors` for [`update`](Self::update) (every tensor is registered
    /// from the start): the others keep their history and scales, as TransformerEngine
    /// does for FP8 modules that did not run while a graph was warmed up (MoE experts that
    /// got no tokens). Typically called from graphed callables' `after_warmup` hook with
    /// the tensors warmup recorded. The device copy is written on `stream` (a host copy that
    /// waits; not during a capture); updates captured earlier read the new registration
    /// too. An index out of range is [`Error::InvalidArgument`] and changes nothing.
    pub fn register(
        &self,
        stream: &Stream,
        tensors: impl IntoIterator<Item = usize>,
    ) -> Result<()> {
        let mut mask = vec![false; self.len()];
        for t in tensors {
            *mask.get_mut(t).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "FP8 tensor {t} registered, the scaling state has {}",
                    self.len()
                ))
            })? = true;
        }
        let words: Vec<u32> = mask.iter().map(|&r| u32::from(r)).collect();
        let mut reg = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        reg.0.copy_from_host(stream, &words)?;
        reg.1 = mask;
        Ok(())
    }

    /// The registered tensors (all of them until [`register`](Self::register) is called).
    pub fn registered(&self) -> Vec<usize> {
        let reg = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        reg.1
            .iter()
            .enumerate()
            .filter_map(|(t, &r)| r.then_some(t))
            .collect()
    }

    /// Enqueues the update of every registered tensor (one launch; see the type's docs).
    pub fn update(&self, stream: &Stream) -> Result<()> {
        let (k, _) = kernel(stream.context(), "fp8_delayed_scaling_update")?;
        let h = self.history_len as u32;
        let most_recent = i32::from(self.algo == AmaxAlgo::MostRecent);
        let reg = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        let args = KernelArgs::new()
            .arg(&*self.history)
            .arg(&*self.scale)
            .arg(&*self.scale_inv)
            .arg(&self.scaled_max)
            .arg(&reg.0)
            .arg(&h)
            .arg(&most_recent);
        let threads = h.div_ceil(32) * 32;
        let cfg = LaunchConfig::linear(self.len() as u32, threads);
        // SAFETY: block t touches history[t*H .. t*H+H], scale[t], scale_inv[t],
        // scaled_max[t], registered[t], all inside buffers sized len() x H and len();
        // blockDim >= H, a multiple of 32 and <= 1024 (history_len checked in new).
        unsafe { stream.launch_pdl(&k, &cfg, &args) }
    }
}
/// The group of processes over which amaxes are reduced (the data- or tensor-parallel group
/// whose ranks must agree on FP8 scales). TransformerEngine's `fp8_group`. Scaling hooks call [`all_reduce_max`](Self::all_reduce_max)
/// on the amax buffer between computing local amaxes and updating scales
/// (before [`DelayedScaling::update`]).
pub trait ReductionGroup: Send + Sync + std::fmt::Debug {
    /// Replaces every element of `amaxes` by its maximum over the group, stream-ordered on
    /// `stream` (enqueue only; no synchronization).
    fn all_reduce_max(&self, stream: &Stream, amaxes: &DeviceBuffer<f32>) -> Result<()>;

    /// The number of ranks in the group.
    fn size(&self) -> usize {
        1
    }
}

/// The single-process [`ReductionGroup`]: the maximum over one rank is the value itself, so
/// [`all_reduce_max`](ReductionGroup::all_reduce_max) enqueues nothing. Groups of several
/// ranks implement the trait where their transport lives (NCCL, threads on one device).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IdentityGroup;

impl ReductionGroup for IdentityGroup {
    fn all_reduce_max(&self, _stream: &Stream, _amaxes: &DeviceBuffer<f32>) -> Result<()> {
        Ok(())
    }
}
