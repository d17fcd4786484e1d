//! Conditional handles, the values they carry, and the helper kernels that set them.

use std::sync::Arc;

use cuda_graph_sys::{CU_GRAPH_COND_ASSIGN_DEFAULT, CUgraph, CUgraphConditionalHandle};

use crate::context::Context;
use crate::driver::{Feature, driver_version};
use crate::error::{Error, Result};
use crate::graph::Graph;
use crate::launch::{KernelArgs, LaunchConfig};
use crate::memory::DeviceBuffer;
use crate::module::Module;
use crate::stream::Stream;

use super::capture::capture_info;

/// The helper kernels of `kernels/conditional.cu`.
pub(crate) static HELPER_IMAGE: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/conditional.fatbin"));

/// The value a conditional node reads, by handle (`CUgraphConditionalHandle`). A plain
/// `Copy` identifier: it belongs to the graph it was created for (the top-level graph, or the
/// body graph that holds its node) and to that graph's context. See the
/// [rules for conditional bodies](crate::conditional#rules-for-conditional-bodies).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConditionalHandle {
    pub(crate) raw: CUgraphConditionalHandle,
    pub(crate) default: u32,
    pub(crate) reset_each_launch: bool,
    /// The graph it was created for, to reject use in another graph (an address, never
    /// dereferenced).
    pub(crate) graph: usize,
    /// The context, as an address, to reject setters on streams of another context.
    pub(crate) ctx: usize,
}

impl ConditionalHandle {
    /// A handle for a conditional node of `graph`
    /// ([`cuGraphConditionalHandleCreate`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)).
    /// With `reset_each_launch` the value is set to `default` at the start of every launch
    /// (`CU_GRAPH_COND_ASSIGN_DEFAULT`). Without it the value starts at 0 and each launch
    /// sees what device code last set, also in an earlier launch: set the value before the
    /// node reads it.
    ///
    /// Errors: a non-zero `default` without `reset_each_launch` is refused
    /// ([`Error::InvalidArgument`]): the driver does not apply such a default (seen on driver
    /// 13.0: the first launch read 0 with a default of 1), so it would be silently ignored.
    /// [`Error::Unsupported`] on drivers before 12.4; [`Error::Driver`].
    pub fn new(graph: &mut Graph, default: u32, reset_each_launch: bool) -> Result<Self> {
        // Under the graph object's lock: an exec's setters on another thread look nodes up
        // through it.
        let owner = graph.owner().clone();
        owner.locked(|| create_handle(graph.context(), graph.as_raw(), default, reset_each_launch))
    }

    /// A handle for a conditional node that will be added to the graph `stream` is
    /// capturing into (see [`Stream::capture_if`]).
    ///
    /// Wraps [`cuGraphConditionalHandleCreate`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
    /// on the graph that [`cuStreamGetCaptureInfo`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    /// reports.
    /// Errors: [`Error::Unsupported`] on drivers before 12.4; [`Error::InvalidArgument`] when
    /// `stream` is not capturing, or for a non-zero `default` without `reset_each_launch` (see
    /// [`ConditionalHandle::new`]); [`Error::Driver`].
    pub fn in_capture(stream: &Stream, default: u32, reset_each_launch: bool) -> Result<Self> {
        Feature::ConditionalIfWhile.check_driver(driver_version()?)?;
        let info = capture_info(stream)?;
        create_handle(stream.context(), info.graph, default, reset_each_launch)
    }

    /// Loads the helper kernels of [`ConditionalHandle::set_on`] for `ctx` now. Their first
    /// use loads them otherwise, which is legal inside a capture (the load runs with the
    /// thread's capture mode relaxed, see [`Module::from_image`]); loading ahead keeps that
    /// one-time work out of the code being captured.
    ///
    /// Errors: as [`Module::from_image`].
    pub fn load_helpers(ctx: &Arc<Context>) -> Result<()> {
        Module::embedded(ctx, HELPER_IMAGE).map(drop)
    }

    /// The raw handle, e.g. to pass to your own kernels that call `cudaGraphSetConditional`.
    pub fn as_raw(&self) -> CUgraphConditionalHandle {
        self.raw
    }

    /// The value the handle starts each launch with when it
    /// [resets each launch](ConditionalHandle::resets_each_launch).
    pub fn default_value(&self) -> u32 {
        self.default
    }

    /// Whether the value is reset to the default at every launch.
    pub fn resets_each_launch(&self) -> bool {
        self.reset_each_launch
    }

    /// Enqueues a one-thread helper kernel on `stream` that sets this handle's value from
    /// `source`. Meant for a stream that is capturing into this handle's graph (a body
    /// closure's stream, or the capturing stream before [`Stream::capture_if`]): the setter
    /// must run inside a launch of that graph. The graph keeps the buffer alive.
    ///
    /// Launches with [`cuLaunchKernel`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EXEC.html).
    /// Errors: [`Error::InvalidArgument`] when `stream` belongs to another context than the
    /// handle, is not capturing (an eager setter would run outside any launch of the graph),
    /// or a source buffer is empty; those of [`ConditionalHandle::load_helpers`] on a first
    /// use; [`Error::Driver`] from the kernel lookup or the launch.
    pub fn set_on(&self, stream: &Stream, source: ConditionSource<'_>) -> Result<()> {
        self.check_context(stream.context())?;
        if stream.capture_status()? == crate::CaptureStatus::None {
            return Err(Error::invalid(
                "a conditional handle's value is set inside a launch of its graph: call the \
                 setter on a stream capturing into that graph (or a body's stream), not eagerly",
            ));
        }
        source.check()?;
        let module = Module::embedded(stream.context(), HELPER_IMAGE)?;
        let raw = self.raw;
        let config = LaunchConfig::linear(1, 1);
        let (name, args) = match &source {
            ConditionSource::Const(v) => ("cond_set_const", KernelArgs::new().arg(&raw).arg(v)),
            ConditionSource::I32(b) => ("cond_set_from_i32", KernelArgs::new().arg(&raw).arg(*b)),
            ConditionSource::NonZeroI32(b) => {
                ("cond_set_nonzero_i32", KernelArgs::new().arg(&raw).arg(*b))
            }
            ConditionSource::PositiveI32(b) => {
                ("cond_set_positive_i32", KernelArgs::new().arg(&raw).arg(*b))
            }
            ConditionSource::F32(b) => ("cond_set_from_f32", KernelArgs::new().arg(&raw).arg(*b)),
            ConditionSource::Decrement(b) => {
                ("cond_decrement", KernelArgs::new().arg(&raw).arg(*b))
            }
        };
        let kernel = &module.kernel(name)?;
        // SAFETY: the helper kernels take (u64 handle, u32 or pointer) and touch only element
        // 0 of the buffer, which `source.check` proved exists; one thread, so the value is
        // set without races. The handle belongs to this context (checked above).
        unsafe { stream.launch(kernel, &config, &args) }
    }

    /// `set_on(stream, ConditionSource::Const(value))`.
    ///
    /// Errors: as [`ConditionalHandle::set_on`].
    pub fn set_const_on(&self, stream: &Stream, value: u32) -> Result<()> {
        self.set_on(stream, ConditionSource::Const(value))
    }

    /// Sets the value to `flag[0]` (an IF/WHILE flag or a SWITCH index).
    ///
    /// Errors: as [`ConditionalHandle::set_on`].
    pub fn set_from_flag_on(&self, stream: &Stream, flag: &DeviceBuffer<i32>) -> Result<()> {
        self.set_on(stream, ConditionSource::I32(flag))
    }

    /// Sets the value to `flag[0] != 0.0` (1 or 0).
    ///
    /// Errors: as [`ConditionalHandle::set_on`].
    pub fn set_from_f32_flag_on(&self, stream: &Stream, flag: &DeviceBuffer<f32>) -> Result<()> {
        self.set_on(stream, ConditionSource::F32(flag))
    }

    /// Counted loops: `counter[0] -= 1`, then the value is `counter[0] > 0`.
    ///
    /// Errors: as [`ConditionalHandle::set_on`].
    pub fn decrement_on(&self, stream: &Stream, counter: &DeviceBuffer<i32>) -> Result<()> {
        self.set_on(stream, ConditionSource::Decrement(counter))
    }

    pub(crate) fn check_context(&self, ctx: &Arc<Context>) -> Result<()> {
        if ctx.as_raw() as usize == self.ctx {
            Ok(())
        } else {
            Err(Error::invalid(
                "the conditional handle belongs to another context",
            ))
        }
    }
}

/// Where a helper kernel takes a conditional value from ([`ConditionalHandle::set_on`]).
/// Buffers are read (and, for `Decrement`, written) at element 0 when the setter runs.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum ConditionSource<'a> {
    /// A constant.
    Const(u32),
    /// `buf[0]` as an unsigned value: a flag or a SWITCH index (negative values become large
    /// and select no SWITCH case).
    I32(&'a DeviceBuffer<i32>),
    /// `buf[0] != 0` (1 or 0).
    NonZeroI32(&'a DeviceBuffer<i32>),
    /// `buf[0] > 0` (1 or 0), without changing it: the test at the head of a counted loop.
    PositiveI32(&'a DeviceBuffer<i32>),
    /// `buf[0] != 0.0` (1 or 0; NaN counts as non-zero).
    F32(&'a DeviceBuffer<f32>),
    /// `buf[0] -= 1`, then `buf[0] > 0` (1 or 0): the test at the end of a counted loop.
    Decrement(&'a DeviceBuffer<i32>),
}

impl ConditionSource<'_> {
    pub(crate) fn check(&self) -> Result<()> {
        let empty = match self {
            ConditionSource::Const(_) => false,
            ConditionSource::I32(b)
            | ConditionSource::NonZeroI32(b)
            | ConditionSource::PositiveI32(b)
            | ConditionSource::Decrement(b) => b.is_empty(),
            ConditionSource::F32(b) => b.is_empty(),
        };
        if empty {
            Err(Error::invalid("a condition source buffer needs an element"))
        } else {
            Ok(())
        }
    }
}

fn create_handle(
    ctx: &Arc<Context>,
    graph: CUgraph,
    default: u32,
    reset_each_launch: bool,
) -> Result<ConditionalHandle> {
    if default != 0 && !reset_each_launch {
        return Err(Error::invalid(format!(
            "a conditional handle default of {default} without reset_each_launch: the driver \
             applies a default only with reset_each_launch; pass true, or set the value from \
             device code (ConditionalHandle::set_on)"
        )));
    }
    Feature::ConditionalIfWhile.check_driver(driver_version()?)?;
    let flags = if reset_each_launch {
        CU_GRAPH_COND_ASSIGN_DEFAULT
    } else {
        0
    };
    let mut raw = 0;
    // SAFETY: live graph and context, valid out-pointer, flags 0 or ASSIGN_DEFAULT.
    unsafe {
        cu!(cuGraphConditionalHandleCreate(
            &mut raw,
            graph,
            ctx.as_raw(),
            default,
            flags
        ))
    }?;
    Ok(ConditionalHandle {
        raw,
        default,
        reset_each_launch,
        graph: graph as usize,
        ctx: ctx.as_raw() as usize,
    })
}

pub(crate) fn check_handle_graph(handle: &ConditionalHandle, graph: CUgraph) -> Result<()> {
    if handle.graph == graph as usize {
        Ok(())
    } else {
        Err(Error::invalid(
            "the conditional handle was created for another graph (a body's handle comes \
             from ConditionalHandle::in_capture on the body's stream)",
        ))
    }
}
