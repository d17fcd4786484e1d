//! Stream-ordered copies and memsets of device buffers. All take `&self`: see the
//! [rule for device writes](crate::memory#one-rule-for-device-writes).

use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, DeviceRepr};
use crate::stream::Stream;

impl<T: DeviceRepr> DeviceBuffer<T> {
    fn check_len(&self, other: usize, what: &str) -> Result<()> {
        if other == self.len() {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "{what}: buffer has {} elements, host slice {other}",
                self.len()
            )))
        }
    }

    /// Copies `src` into the buffer, ordered on `stream`, and waits for the copy (and all
    /// earlier work on `stream`): the wait is what lets `src` be any host slice.
    ///
    /// Wraps [`cuMemcpyHtoDAsync`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html),
    /// then [`cuStreamSynchronize`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    /// Errors: [`Error::InvalidArgument`] when the lengths differ; [`Error::Driver`]. Not for
    /// a capturing stream: the wait invalidates the capture.
    pub fn copy_from_host(&self, stream: &Stream, src: &[T]) -> Result<()> {
        self.check_len(src.len(), "copy_from_host")?;
        if self.is_empty() {
            return Ok(());
        }
        stream.context().ensure_current()?;
        // SAFETY: src is valid for `bytes` reads until the synchronize below returns.
        unsafe {
            cu!(cuMemcpyHtoDAsync(
                self.as_raw(),
                src.as_ptr().cast(),
                self.bytes(),
                stream.as_raw()
            ))
        }?;
        stream.synchronize()
    }

    /// Copies the buffer into `dst`, ordered on `stream` after earlier work, and waits.
    ///
    /// Wraps [`cuMemcpyDtoHAsync`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html),
    /// then [`cuStreamSynchronize`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    /// Errors: [`Error::InvalidArgument`] when the lengths differ; [`Error::Driver`]. Not for
    /// a capturing stream: the wait invalidates the capture.
    pub fn copy_to_host(&self, stream: &Stream, dst: &mut [T]) -> Result<()> {
        self.check_len(dst.len(), "copy_to_host")?;
        if self.is_empty() {
            return Ok(());
        }
        stream.context().ensure_current()?;
        // SAFETY: dst is valid for `bytes` writes until the synchronize below returns; every
        // bit pattern is a valid T.
        unsafe {
            cu!(cuMemcpyDtoHAsync(
                dst.as_mut_ptr().cast(),
                self.as_raw(),
                self.bytes(),
                stream.as_raw()
            ))
        }?;
        stream.synchronize()
    }

    /// The buffer's contents, copied after earlier work on `stream`.
    ///
    /// Errors: as [`DeviceBuffer::copy_to_host`].
    pub fn to_vec(&self, stream: &Stream) -> Result<Vec<T>> {
        // Zeroed first (T is plain data: all-zero bits are a value), so that no reference to
        // uninitialised memory is ever made; the fill costs far less than the copy's wait.
        // SAFETY: every bit pattern, zeros included, is a valid T (`DeviceRepr`).
        let mut v = vec![unsafe { std::mem::zeroed::<T>() }; self.len()];
        self.copy_to_host(stream, &mut v)?;
        Ok(v)
    }

    /// Enqueues a device-to-device copy of `src` into this buffer on `stream`
    /// ([`cuMemcpyDtoDAsync`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)).
    /// Copying a buffer onto itself (the same view) does nothing.
    ///
    /// Errors: [`Error::InvalidArgument`] when the lengths differ or the ranges overlap
    /// (other than being the same view); [`Error::Driver`].
    pub fn copy_from_device(&self, stream: &Stream, src: &DeviceBuffer<T>) -> Result<()> {
        if src.len() != self.len() {
            return Err(Error::invalid(format!(
                "copy_from_device: destination has {} elements, source {}",
                self.len(),
                src.len()
            )));
        }
        if self.is_empty() || self.same_memory(src) {
            return Ok(());
        }
        if self.overlaps(src) {
            return Err(Error::invalid(format!(
                "copy_from_device: source {:#x} and destination {:#x} ({} bytes) overlap",
                src.as_raw(),
                self.as_raw(),
                self.bytes()
            )));
        }
        stream.retain_for_capture(|| src.resource());
        stream.retain_for_capture(|| self.resource());
        stream.context().ensure_current()?;
        // SAFETY: both ranges are live allocations of `bytes` bytes.
        unsafe {
            cu!(cuMemcpyDtoDAsync(
                self.as_raw(),
                src.as_raw(),
                self.bytes(),
                stream.as_raw()
            ))
        }
    }

    /// Enqueues setting every byte to `value` on `stream`.
    ///
    /// Wraps [`cuMemsetD8Async`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html).
    /// Errors: [`Error::Driver`].
    pub fn memset_bytes(&self, stream: &Stream, value: u8) -> Result<()> {
        if self.is_empty() {
            return Ok(());
        }
        stream.retain_for_capture(|| self.resource());
        stream.context().ensure_current()?;
        // SAFETY: live allocation of `bytes` bytes.
        unsafe {
            cu!(cuMemsetD8Async(
                self.as_raw(),
                value,
                self.bytes(),
                stream.as_raw()
            ))
        }
    }

    /// Enqueues setting every element to `value` on `stream`; `T` must be 4 bytes wide.
    ///
    /// Wraps [`cuMemsetD32Async`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html).
    /// Errors: [`Error::InvalidArgument`] when `T` is not 4 bytes wide; [`Error::Driver`].
    pub fn fill_u32_bits(&self, stream: &Stream, value: u32) -> Result<()> {
        if size_of::<T>() != 4 {
            return Err(Error::invalid(format!(
                "fill_u32_bits needs 4-byte elements, not {}",
                size_of::<T>()
            )));
        }
        if self.is_empty() {
            return Ok(());
        }
        stream.retain_for_capture(|| self.resource());
        stream.context().ensure_current()?;
        // SAFETY: live allocation of `len` 4-byte words.
        unsafe {
            cu!(cuMemsetD32Async(
                self.as_raw(),
                value,
                self.len(),
                stream.as_raw()
            ))
        }
    }
}
