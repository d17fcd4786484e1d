//! Kernel launch: configuration, typed argument lists, and `Stream::launch`.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;

use cuda_graph_sys::{CUlaunchAttribute, CUlaunchAttributeID, CUlaunchConfig, CUstream};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::memory::{Allocation, DeviceBuffer, DeviceRepr};
use crate::module::Kernel;
use crate::resources::Resource;
use crate::stream::Stream;

/// A launch attribute (`CUlaunchAttribute`), for [`LaunchConfig::attributes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LaunchAttribute {
    /// Programmatic dependent launch: this kernel may start before the previous kernel on the
    /// stream finishes; it must call `cudaGridDependencySynchronize()` before reading that
    /// kernel's output (Hopper and newer).
    ProgrammaticStreamSerialization,
    /// Scheduling priority of this launch.
    Priority(i32),
    /// Thread-block cluster dimensions (Hopper and newer).
    ClusterDimension(u32, u32, u32),
}

impl LaunchAttribute {
    pub(crate) fn to_raw(self) -> CUlaunchAttribute {
        let mut a = CUlaunchAttribute::default();
        match self {
            LaunchAttribute::ProgrammaticStreamSerialization => {
                a.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                a.value.programmaticStreamSerializationAllowed = 1;
            }
            LaunchAttribute::Priority(p) => {
                a.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PRIORITY;
                a.value.priority = p;
            }
            LaunchAttribute::ClusterDimension(x, y, z) => {
                a.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
                a.value.clusterDim.x = x;
                a.value.clusterDim.y = y;
                a.value.clusterDim.z = z;
            }
        }
        a
    }
}

/// Grid, block, dynamic shared memory and attributes of a launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, bytes.
    pub shared_mem_bytes: u32,
    /// Extra attributes; empty for a plain `cuLaunchKernel`.
    pub attributes: Vec<LaunchAttribute>,
}

impl LaunchConfig {
    /// A 1-D launch of `grid` blocks of `block` threads.
    pub fn linear(grid: u32, block: u32) -> LaunchConfig {
        LaunchConfig {
            grid: (grid, 1, 1),
            block: (block, 1, 1),
            shared_mem_bytes: 0,
            attributes: Vec::new(),
        }
    }

    /// Enough blocks of `block` threads to cover `n` elements, one per thread.
    pub fn for_elements(n: u32, block: u32) -> LaunchConfig {
        LaunchConfig::linear(n.div_ceil(block).max(1), block)
    }

    /// With an attribute added.
    pub fn with(mut self, attribute: LaunchAttribute) -> LaunchConfig {
        self.attributes.push(attribute);
        self
    }

    /// The driver's form on `stream` with the raw attributes `attrs` (which the result points
    /// at: keep them alive while it is used).
    pub(crate) fn raw(&self, stream: CUstream, attrs: &mut [CUlaunchAttribute]) -> CUlaunchConfig {
        let (g, b) = (self.grid, self.block);
        CUlaunchConfig {
            gridDimX: g.0,
            gridDimY: g.1,
            gridDimZ: g.2,
            blockDimX: b.0,
            blockDimY: b.1,
            blockDimZ: b.2,
            sharedMemBytes: self.shared_mem_bytes,
            hStream: stream,
            attrs: attrs.as_mut_ptr(),
            numAttrs: attrs.len() as u32,
        }
    }
}

/// Something that can be passed to a kernel: a plain value or a device buffer (passed as its
/// device address).
pub trait KernelArg {
    /// Appends this argument to `args`.
    fn push_to<'a>(&'a self, args: &mut KernelArgs<'a>);
}

impl<T: DeviceRepr> KernelArg for T {
    fn push_to<'a>(&'a self, args: &mut KernelArgs<'a>) {
        args.ptrs.push((self as *const T).cast_mut().cast());
        args.sizes.push(size_of::<T>());
    }
}

impl<T: DeviceRepr> KernelArg for DeviceBuffer<T> {
    fn push_to<'a>(&'a self, args: &mut KernelArgs<'a>) {
        args.ptrs
            .push((self.ptr_ref() as *const u64).cast_mut().cast());
        args.sizes.push(size_of::<u64>());
        args.buffers.push(self.allocation());
    }
}

/// A borrowed buffer passes its device address, like the buffer: `kernel_args![x, y]` with
/// `x: &DeviceBuffer<f32>` needs no `*`.
impl<T: DeviceRepr> KernelArg for &DeviceBuffer<T> {
    fn push_to<'a>(&'a self, args: &mut KernelArgs<'a>) {
        (**self).push_to(args);
    }
}

/// A shared buffer passes its device address, like the buffer.
impl<T: DeviceRepr> KernelArg for Arc<DeviceBuffer<T>> {
    fn push_to<'a>(&'a self, args: &mut KernelArgs<'a>) {
        (**self).push_to(args);
    }
}

/// A kernel's argument list: pointers to the values (borrowed for `'a`, so they cannot
/// change or go away before the launch), their sizes (checked against the kernel's
/// parameters), and the buffers used (kept alive by graphs that capture the launch).
///
/// ```no_run
/// # use cuda_graph::{KernelArgs, DeviceBuffer};
/// # fn f(x: &DeviceBuffer<f32>, y: &DeviceBuffer<f32>) {
/// let n = 1024u32;
/// let args = KernelArgs::new().arg(&2.0f32).arg(x).arg(y).arg(&n);
/// # }
/// ```
#[derive(Debug, Default)]
pub struct KernelArgs<'a> {
    ptrs: Vec<*mut c_void>,
    sizes: Vec<usize>,
    buffers: Vec<&'a Arc<Allocation>>,
    _borrow: PhantomData<&'a ()>,
}

impl<'a> KernelArgs<'a> {
    /// An empty list.
    pub fn new() -> KernelArgs<'a> {
        KernelArgs::default()
    }

    /// With `value` appended.
    pub fn arg(mut self, value: &'a (impl KernelArg + ?Sized)) -> KernelArgs<'a> {
        value.push_to(&mut self);
        self
    }

    /// With `buffer` marked as used by the kernel without being passed to it: memory the
    /// kernel reaches through another argument (a TMA tensor map built over it, an address
    /// inside a struct). Nothing is appended to the parameters; a graph that captures the
    /// launch keeps `buffer`'s memory alive, as it does the buffers passed as arguments.
    pub fn uses<T: DeviceRepr>(mut self, buffer: &'a DeviceBuffer<T>) -> KernelArgs<'a> {
        self.buffers.push(buffer.allocation());
        self
    }

    /// The size of each argument in bytes.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// The `void**` array the driver reads (valid while `self` lives).
    pub(crate) fn as_param_array(&self) -> *mut *mut c_void {
        self.ptrs.as_ptr().cast_mut()
    }

    /// Refuses buffers of another context than `ctx` (another GPU's memory: a kernel that
    /// touches it faults, or crosses the interconnect unasked).
    fn check_context(&self, ctx: &Context) -> Result<()> {
        match self
            .buffers
            .iter()
            .find(|a| a.context().as_raw() != ctx.as_raw())
        {
            None => Ok(()),
            Some(a) => Err(Error::invalid(format!(
                "a kernel argument's buffer belongs to device {}, the stream to device {} (to \
                 pass another device's memory on purpose, wrap its address with \
                 DeviceBuffer::from_raw on the stream's context)",
                a.context().device().as_raw(),
                ctx.device().as_raw()
            ))),
        }
    }

    /// The buffers used, as resources to keep alive.
    pub(crate) fn resources(&self) -> impl Iterator<Item = Resource> + '_ {
        self.buffers.iter().map(|a| a.keep_alive())
    }
}

/// `kernel_args![a, b, c]` is `KernelArgs::new().arg(&a).arg(&b).arg(&c)`.
#[macro_export]
macro_rules! kernel_args {
    ($($arg:expr),* $(,)?) => { $crate::KernelArgs::new()$(.arg(&$arg))* };
}

impl Stream {
    /// Launches `kernel` on this stream. The argument list is checked against the kernel's
    /// parameter sizes first (driver >= 12.4); a mismatch is an error and nothing runs.
    /// During a capture the launch becomes a kernel node, and the graph keeps the kernel's
    /// module and the buffers alive.
    ///
    /// Wraps [`cuLaunchKernel`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EXEC.html),
    /// or [`cuLaunchKernelEx`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EXEC.html)
    /// when `config` has attributes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when the argument sizes do not
    /// match the kernel's parameters, or a buffer argument belongs to another device's
    /// context than the stream (nothing is enqueued); [`Error::Driver`](crate::Error::Driver)
    /// when the driver refuses the launch (grid, block or shared memory beyond the device's
    /// limits, `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`) or reports a fault of earlier work. A
    /// fault of this kernel itself surfaces later, from a call that waits for it.
    ///
    /// # Safety
    /// The kernel runs arbitrary device code: the arguments must be what it expects (types,
    /// not only sizes), and it must only touch memory within the buffers it is given, sized
    /// as it assumes. Buffers it writes must not be read or written by other work running
    /// concurrently.
    pub unsafe fn launch(
        &self,
        kernel: &Kernel,
        config: &LaunchConfig,
        args: &KernelArgs<'_>,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.launch_with(kernel, config, None, args) }
    }

    /// [`launch`](Self::launch) with programmatic dependent launch where this stream's
    /// context supports it ([`Context::supports_pdl`](crate::Context::supports_pdl); the
    /// attribute [`LaunchAttribute::ProgrammaticStreamSerialization`] added to `config`'s):
    /// the kernel may be scheduled while its predecessor on the stream (or in a captured
    /// graph) still runs, hiding its launch latency. Elsewhere it is a plain launch.
    ///
    /// Wraps [`cuLaunchKernelEx`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EXEC.html)
    /// where the attribute is added, else as [`launch`](Self::launch).
    /// Errors: as [`launch`](Self::launch).
    ///
    /// # Safety
    /// As [`launch`](Self::launch), and the kernel must call `cuda_graph::pdl_wait()`
    /// (`#include <cuda_graph/pdl.cuh>`, on the include path of every `cuda-build` compile)
    /// before it touches memory that earlier work on the stream writes or reads.
    pub unsafe fn launch_pdl(
        &self,
        kernel: &Kernel,
        config: &LaunchConfig,
        args: &KernelArgs<'_>,
    ) -> Result<()> {
        let extra = self
            .context()
            .supports_pdl()
            .then_some(LaunchAttribute::ProgrammaticStreamSerialization);
        // SAFETY: forwarded from the caller.
        unsafe { self.launch_with(kernel, config, extra, args) }
    }

    /// [`launch`](Self::launch) with `extra` appended to `config`'s attributes (without
    /// copying the config).
    unsafe fn launch_with(
        &self,
        kernel: &Kernel,
        config: &LaunchConfig,
        extra: Option<LaunchAttribute>,
        args: &KernelArgs<'_>,
    ) -> Result<()> {
        self.context().ensure_current()?;
        kernel.check_args(args.sizes())?;
        args.check_context(self.context())?;
        if self.is_collecting() {
            self.retain_all_for_capture(
                std::iter::once(kernel.module_resource()).chain(args.resources()),
            );
        }
        let (g, b) = (config.grid, config.block);
        if config.attributes.is_empty() && extra.is_none() {
            // SAFETY: live kernel and stream; the parameter array points at values borrowed
            // for the call; the caller vouches for what the kernel does.
            return unsafe {
                cu!(cuLaunchKernel(
                    kernel.as_raw(),
                    g.0,
                    g.1,
                    g.2,
                    b.0,
                    b.1,
                    b.2,
                    config.shared_mem_bytes,
                    self.as_raw(),
                    args.as_param_array(),
                    std::ptr::null_mut()
                ))
            };
        }
        // The raw attributes on the stack (every attribute kind at most once fits): no
        // allocation per launch; a longer list goes to the heap.
        const INLINE: usize = 4;
        let all = config.attributes.iter().chain(extra.as_ref());
        let n = config.attributes.len() + usize::from(extra.is_some());
        let mut inline = [CUlaunchAttribute::default(); INLINE];
        let mut heap = Vec::new();
        let attrs: &mut [CUlaunchAttribute] = if n <= INLINE {
            for (raw, a) in inline.iter_mut().zip(all) {
                *raw = a.to_raw();
            }
            &mut inline[..n]
        } else {
            heap.extend(all.map(|a| a.to_raw()));
            &mut heap
        };
        let raw = config.raw(self.as_raw(), attrs);
        // SAFETY: as above; the attribute array outlives the call.
        unsafe {
            cu!(cuLaunchKernelEx(
                &raw,
                kernel.as_raw(),
                args.as_param_array(),
                std::ptr::null_mut()
            ))
        }
    }
}
