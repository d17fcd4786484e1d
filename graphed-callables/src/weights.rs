//! Weight caching and step hooks, FP8-agnostic: how the runtime makes a callable's per-step
//! weight casts ([`Callable::cast_weights`](crate::Callable::cast_weights)) run once per
//! training step, and the hooks through which a caller runs amax reductions and scale
//! updates after replays and saves and restores its scaling state around warmup.
//!
//! # Weight caching
//!
//! A layer with FP8 weights quantizes them once per training step, on its chunk's first
//! microbatch, and reuses the cast weights for the other microbatches. Graph replays can not
//! branch on the host, so the decision is made on the device from a flag the runtime owns
//! per (chunk, microbatch) and writes on the replay stream (a stream-ordered memset, no host
//! synchronization) before every forward replay, from
//! [`GraphedCallables::is_first_microbatch`](crate::GraphedCallables::is_first_microbatch):
//!
//! * [`WeightCaching::Conditional`]: each forward graph that casts starts with a one-thread
//!   setter kernel that copies the `i32` flag (1 = first microbatch) into the handle of one
//!   IF conditional node, whose body holds the casts of every layer in the graph (a whole
//!   step's layers with [`GraphedOptions::merge_layers`](crate::GraphedOptions::merge_layers));
//!   the forwards follow. On later microbatches the IF body is skipped: no cast kernel is
//!   launched at all. Callables
//!   see [`Slot::skip_weight_cast`](crate::Slot::skip_weight_cast) `== None` and cast
//!   unconditionally. Needs a driver with [`Feature::ConditionalIfWhile`] (12.4).
//! * [`WeightCaching::NoopFlag`]: the casts are captured unconditionally before the forward
//!   and every cast kernel must read the `f32` flag of
//!   [`Slot::skip_weight_cast`](crate::Slot::skip_weight_cast) (1.0 = skip: not the first
//!   microbatch) as its noop flag and do nothing when it is 1.0, like fp8-kernels'
//!   quantize. A cast kernel that ignores the flag recasts on every microbatch: the result
//!   is the same (the weights did not change within the step) but the work is repeated; a
//!   test can detect it by counting casts (see this crate's tests/graphed_fp8.rs).
//! * [`WeightCaching::Static`]: since a replay's first-microbatch-ness follows from its
//!   position in the schedule, the first microbatch's forward graphs hold the casts
//!   unconditionally and the others hold none: no flag, no setter kernel, no IF node, no
//!   launches on later microbatches. It is the cheapest on the device; the two flag
//!   mechanisms keep the decision on the device, as TransformerEngine does.
//!
//! # Casts beside the forward
//!
//! A callable whose forward starts with work that does not read its cast weights (a MoE
//! layer's router and permute) can say so
//! ([`Callable::overlaps_weight_cast`](crate::Callable::overlaps_weight_cast)): the runtime
//! then captures the graph's casts (the IF node, the noop-flag casts or the static ones) on
//! a stream forked from the capture, so they run concurrently with that head, and the
//! callable waits for them ([`Slot::wait_weight_cast`](crate::Slot::wait_weight_cast))
//! right before its first read of the cast weights; the fork is joined at the graph's end.
//! Warmup and eager runs cast first, as always (the wait is a no-op there).
//!
//! Whether a forward graph casts at all is found at build by capturing its
//! `cast_weights` into a throwaway graph: a callable that enqueues nothing gets neither
//! the IF node nor a flag write
//! ([`GraphedCallables::casts_weights`](crate::GraphedCallables::casts_weights)).
//!
//! Warmup calls `cast_weights` eagerly before every forward with first-microbatch
//! semantics (in `NoopFlag` mode the flags read 0.0 then), so lazily created state (cast
//! buffers, scale tensors) exists before capture.
//!
//! # Hooks: amax reduction, scale update, warmup state
//!
//! [`GraphedOptions::after_forward`](crate::GraphedOptions::after_forward) and
//! [`after_backward`](crate::GraphedOptions::after_backward) run on the host right after a
//! replay's graphs were launched, with the replay stream and the step: they enqueue, e.g.,
//! one fused launch that reduces the amaxes of all registered FP8 tensors (over
//! fp8-kernels' `ReductionGroup`, say) and updates the scales. They
//! must not synchronize. They run once per replay, in replay order.
//!
//! [`before_warmup`](crate::GraphedOptions::before_warmup) and
//! [`after_warmup`](crate::GraphedOptions::after_warmup) run once each, on the warmup
//! stream, around the warmup iterations: warmup runs real forwards and backwards, so a
//! delayed-scaling recipe's amax history and scales move; the intended use is to snapshot
//! that state (a device-to-device copy enqueued on the given stream) before, and copy it
//! back after, so training starts from the state it would have had without warmup.
//!
//! # Which FP8 tensors ran: MoE filtering
//!
//! A layer does not always run all of its FP8 modules: a MoE layer's experts that get no
//! tokens skip their quantization and GEMMs. TransformerEngine registers for amax
//! reduction only the modules that actually ran while warming up; here a callable reports
//! the FP8 tensors each pass ran through [`Slot::record_tensors`](crate::Slot::record_tensors),
//! the runtime records them per callable during warmup, and hands the result, a
//! [`WarmupRecord`], to [`after_warmup`](crate::GraphedOptions::after_warmup); that hook
//! registers exactly those tensors with the scaling state (e.g. fp8-kernels'
//! `DelayedScaling::register`), so the fused update after each replay covers only them. The
//! record is also kept ([`GraphedCallables::warmup_record`](crate::GraphedCallables::warmup_record)).
//! The runtime itself stays FP8-agnostic: it never reads what the indices mean.

use std::collections::BTreeSet;
use std::sync::Mutex;

use cuda_graph::Result;
use cuda_graph::Stream;
use cuda_graph::driver::{DriverVersion, Feature, driver_version};

use crate::schedule::Step;

/// How the weight casts of [`Callable::cast_weights`](crate::Callable::cast_weights) are
/// limited to the first microbatch of each training step in the forward graphs (see the
/// [module documentation](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightCaching {
    /// An IF conditional node around the casts, set on the device from a runtime-owned
    /// `i32` flag: later microbatches launch no cast kernel. Needs a driver >= 12.4.
    Conditional,
    /// The casts are always captured and take [`Slot::skip_weight_cast`](crate::Slot::skip_weight_cast)
    /// (`f32`, 1.0 = skip) as their noop flag. Works on any driver.
    NoopFlag,
    /// No device flag at all: each chunk's first-microbatch forward graph holds the casts
    /// unconditionally, the other microbatches' graphs hold none. A replay's
    /// first-microbatch-ness is fixed by its position in the schedule
    /// ([`GraphedCallables::is_first_microbatch`](crate::GraphedCallables::is_first_microbatch)),
    /// so this casts exactly when the other two do, with no setter kernel, IF node or noop
    /// launches. Works on any driver.
    Static,
}

impl WeightCaching {
    /// The mechanism a driver of `version` supports best: [`Conditional`](Self::Conditional)
    /// when it has conditional IF nodes ([`Feature::ConditionalIfWhile`]), else
    /// [`NoopFlag`](Self::NoopFlag).
    pub fn for_driver(version: DriverVersion) -> WeightCaching {
        if Feature::ConditionalIfWhile.check_driver(version).is_ok() {
            WeightCaching::Conditional
        } else {
            WeightCaching::NoopFlag
        }
    }

    /// [`for_driver`](Self::for_driver) of the installed driver; [`NoopFlag`](Self::NoopFlag)
    /// when the driver can not be loaded or asked (the build then fails later anyway).
    pub fn detect() -> WeightCaching {
        driver_version()
            .map(WeightCaching::for_driver)
            .unwrap_or(WeightCaching::NoopFlag)
    }

    /// Checks that the installed driver supports this mechanism
    /// ([`Error::Unsupported`](cuda_graph::Error::Unsupported) otherwise).
    pub fn check(self) -> Result<()> {
        match self {
            WeightCaching::Conditional => {
                Feature::ConditionalIfWhile.check_driver(driver_version()?)
            }
            WeightCaching::NoopFlag | WeightCaching::Static => Ok(()),
        }
    }

    /// The value the runtime writes into a (chunk, microbatch)'s flag before its forward
    /// replay, as the 32 bits of the flag's element: for `Conditional` the `i32` IF value
    /// (1 = cast), for `NoopFlag` the `f32` noop flag (1.0 = skip the cast); `None` for
    /// `Static`, which has no flag.
    pub fn flag_bits(self, first_microbatch: bool) -> Option<u32> {
        match self {
            WeightCaching::Conditional => Some(u32::from(first_microbatch)),
            WeightCaching::Static => None,
            WeightCaching::NoopFlag => Some(if first_microbatch {
                0.0f32.to_bits()
            } else {
                1.0f32.to_bits()
            }),
        }
    }
}

/// Which callables run their low-precision path (FP8, say;
/// [`GraphedOptions::low_precision`](crate::GraphedOptions::low_precision), TransformerEngine's
/// `fp8_enabled`, a bool or one per callable). The runtime hands it to each callable as
/// [`Slot::low_precision`](crate::Slot::low_precision) and manages weight caching only for
/// callables with it on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum LowPrecision {
    /// Every callable (the default).
    #[default]
    All,
    /// No callable.
    Off,
    /// One flag per callable, by [`Layout::callable_index`](crate::Layout::callable_index).
    PerCallable(Vec<bool>),
}

impl LowPrecision {
    /// The flag of each of `callables` callables; a per-callable list of another length is
    /// [`InvalidArgument`](cuda_graph::Error::InvalidArgument)(cuda_graph::Error::InvalidArgument).
    pub fn resolve(&self, callables: usize) -> Result<Vec<bool>> {
        match self {
            LowPrecision::All => Ok(vec![true; callables]),
            LowPrecision::Off => Ok(vec![false; callables]),
            LowPrecision::PerCallable(v) if v.len() == callables => Ok(v.clone()),
            LowPrecision::PerCallable(v) => Err(cuda_graph::Error::InvalidArgument(format!(
                "low_precision given for {} callables, there are {callables}",
                v.len()
            ))),
        }
    }
}

/// A hook run after each forward or backward replay
/// ([`GraphedOptions::after_forward`](crate::GraphedOptions::after_forward),
/// [`after_backward`](crate::GraphedOptions::after_backward)): the replay stream and the
/// step that was just launched. It enqueues work (e.g. an amax reduction and scale update)
/// on the stream and must not synchronize it.
pub type StepHook = Box<dyn FnMut(&Stream, Step) -> Result<()> + Send>;

/// A hook run once before or after warmup
/// ([`GraphedOptions::before_warmup`](crate::GraphedOptions::before_warmup),
/// [`after_warmup`](crate::GraphedOptions::after_warmup)) with the warmup stream: snapshot
/// and restore scaling state there, stream-ordered.
pub type WarmupHook = Box<dyn FnMut(&Stream) -> Result<()> + Send>;

/// A hook run once after warmup
/// ([`GraphedOptions::after_warmup`](crate::GraphedOptions::after_warmup)) with the warmup
/// stream and what warmup recorded: restore the scaling state saved before warmup and
/// register the FP8 tensors that ran, stream-ordered.
pub type AfterWarmupHook = Box<dyn FnMut(&Stream, &WarmupRecord) -> Result<()> + Send>;

/// Collects the FP8 tensor indices passes report through
/// [`Slot::record_tensors`](crate::Slot::record_tensors). The runtime keeps one
/// per callable during warmup; give one to a slot with
/// [`Slot::with_recorder`](crate::Slot::with_recorder) to see what an eager run reports.
#[derive(Debug, Default)]
pub struct TensorRecorder {
    tensors: Mutex<BTreeSet<usize>>,
}

impl TensorRecorder {
    /// An empty recorder.
    pub fn new() -> TensorRecorder {
        TensorRecorder::default()
    }

    /// Adds `tensors`.
    pub fn record(&self, tensors: impl IntoIterator<Item = usize>) {
        // A panic while the lock was held can only have come from a BTreeSet insert; the set
        // is still a valid set, so keep using it.
        let mut set = self.tensors.lock().unwrap_or_else(|p| p.into_inner());
        set.extend(tensors);
    }

    /// Every index recorded so far.
    pub fn tensors(&self) -> BTreeSet<usize> {
        self.tensors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// What warmup recorded: per callable ([`Layout::callable_index`](crate::Layout::callable_index)),
/// the FP8 tensors its passes reported through
/// [`Slot::record_tensors`](crate::Slot::record_tensors).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WarmupRecord {
    per_callable: Vec<BTreeSet<usize>>,
}

impl WarmupRecord {
    /// A record of `per_callable`'s sets, callable 0 first.
    pub fn new(per_callable: Vec<BTreeSet<usize>>) -> WarmupRecord {
        WarmupRecord { per_callable }
    }

    /// The tensors callable `callable` reported; `None` out of range.
    pub fn of_callable(&self, callable: usize) -> Option<&BTreeSet<usize>> {
        self.per_callable.get(callable)
    }

    /// Every tensor any callable reported: the ones to register for amax reduction.
    pub fn tensors(&self) -> BTreeSet<usize> {
        self.per_callable.iter().flatten().copied().collect()
    }

    /// The number of callables.
    pub fn callables(&self) -> usize {
        self.per_callable.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_follows_the_driver() {
        assert_eq!(
            WeightCaching::for_driver(DriverVersion(12030)),
            WeightCaching::NoopFlag
        );
        assert_eq!(
            WeightCaching::for_driver(DriverVersion(12040)),
            WeightCaching::Conditional
        );
        assert_eq!(
            WeightCaching::for_driver(DriverVersion(13000)),
            WeightCaching::Conditional
        );
        assert_eq!(
            WeightCaching::for_driver(DriverVersion(11080)),
            WeightCaching::NoopFlag
        );
    }

    #[test]
    fn flag_values() {
        assert_eq!(WeightCaching::Conditional.flag_bits(true), Some(1));
        assert_eq!(WeightCaching::Conditional.flag_bits(false), Some(0));
        assert_eq!(
            WeightCaching::NoopFlag.flag_bits(true).map(f32::from_bits),
            Some(0.0),
            "first microbatch: do not skip"
        );
        assert_eq!(
            WeightCaching::NoopFlag.flag_bits(false).map(f32::from_bits),
            Some(1.0),
            "later microbatches: skip"
        );
        assert_eq!(WeightCaching::Static.flag_bits(true), None, "no flag");
    }

    #[test]
    fn noop_flag_needs_no_driver_check() {
        assert!(WeightCaching::NoopFlag.check().is_ok());
    }

    #[test]
    fn detect_never_fails() {
        // Without a driver this is NoopFlag; with one, what the driver supports.
        let m = WeightCaching::detect();
        match driver_version() {
            Ok(v) => assert_eq!(m, WeightCaching::for_driver(v)),
            Err(_) => assert_eq!(m, WeightCaching::NoopFlag),
        }
    }

    #[test]
    fn recorder_and_record_collect_sets() {
        let r = TensorRecorder::new();
        r.record([3, 1]);
        r.record([1, 7]);
        assert_eq!(r.tensors(), BTreeSet::from([1, 3, 7]));
        let rec = WarmupRecord::new(vec![r.tensors(), BTreeSet::new(), BTreeSet::from([2])]);
        assert_eq!(rec.callables(), 3);
        assert_eq!(rec.tensors(), BTreeSet::from([1, 2, 3, 7]));
        assert!(rec.of_callable(1).unwrap().is_empty());
        assert_eq!(rec.of_callable(3), None);
    }

    #[test]
    fn low_precision_resolves_per_callable() {
        assert_eq!(LowPrecision::All.resolve(2).unwrap(), [true, true]);
        assert_eq!(LowPrecision::Off.resolve(3).unwrap(), [false; 3]);
        let per = LowPrecision::PerCallable(vec![true, false]);
        assert_eq!(per.resolve(2).unwrap(), [true, false]);
        let e = per.resolve(3).unwrap_err().to_string();
        assert!(
            e.contains("low_precision given for 2 callables, there are 3"),
            "{e}"
        );
        assert_eq!(LowPrecision::default(), LowPrecision::All);
    }
}
