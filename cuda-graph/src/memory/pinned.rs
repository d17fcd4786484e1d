//! Page-locked host memory.

use std::sync::Arc;

use crate::context::Context;
use crate::error::Result;
use crate::memory::{DeviceBuffer, DeviceRepr};

/// Page-locked host memory (`cuMemAllocHost`): fast, truly asynchronous host-device copies.
#[derive(Debug)]
pub struct PinnedBuffer<T: DeviceRepr> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<Context>,
}

// SAFETY: it owns its memory as a `Box<[T]>` does (no other handle to it exists), and
// `T: DeviceRepr` is `Send`; `cuMemFreeHost` may run on any thread (`Drop` binds the
// context first).
unsafe impl<T: DeviceRepr> Send for PinnedBuffer<T> {}
// SAFETY: `&self` gives `&[T]` only, `T: DeviceRepr` is `Sync`, and writing needs
// `&mut self`. Device work that writes the memory (through a raw address, an `unsafe`
// launch) is ordered by the caller, as for any device write.
unsafe impl<T: DeviceRepr> Sync for PinnedBuffer<T> {}

impl<T: DeviceRepr> PinnedBuffer<T> {
    /// `len` elements of pinned memory, every byte zero.
    ///
    /// Wraps [`cuMemAllocHost`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    /// (freed with `cuMemFreeHost` on drop).
    /// Errors: [`Error::InvalidArgument`](crate::Error::InvalidArgument) when the byte count
    /// overflows; [`Error::Driver`](crate::Error::Driver) (also from making `ctx` current).
    pub fn zeroed(ctx: &Arc<Context>, len: usize) -> Result<PinnedBuffer<T>> {
        let bytes = DeviceBuffer::<T>::bytes_for(len)?.max(1);
        ctx.bind()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer; context current.
        unsafe { cu!(cuMemAllocHost(&mut p, bytes)) }?;
        // SAFETY: p is valid for `bytes` writes.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, bytes) };
        Ok(PinnedBuffer {
            ptr: p.cast(),
            len,
            ctx: ctx.clone(),
        })
    }
}

impl<T: DeviceRepr> std::ops::Deref for PinnedBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: ptr is valid for len initialised elements while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T: DeviceRepr> std::ops::DerefMut for PinnedBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as above, and &mut self is unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: DeviceRepr> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        if let Ok(free) = cuda_graph_sys::driver().and_then(|d| d.cuMemFreeHost()) {
            // SAFETY: owned allocation, freed once.
            unsafe { free(self.ptr.cast()) };
        }
    }
}
