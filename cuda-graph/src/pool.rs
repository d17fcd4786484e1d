//! A private pool of ordinary device memory shared by graphs captured in execution order —
//! what PyTorch's graph pool does.
//!
//! Allocating from a [`GraphPool`] makes no driver call: it carves a range out of memory the
//! pool reserved up front, so it is legal in the middle of a stream capture (where
//! `cuMemAlloc` would invalidate the capture) and the range's address is simply baked into
//! the captured nodes. A graph that uses a pool buffer keeps the *pool's memory* alive, not
//! the range: once the buffer handle is dropped, a later capture may get the same range.
//!
//! # Contract and trade-offs
//! * Sharing is the point: graphs A then B captured in that order, where A's temporaries are
//!   dropped before B is captured, use the same memory for those temporaries. That is right
//!   only if the graphs then *run* in capture order and never concurrently (one stream, or
//!   explicit ordering). Out-of-order or concurrent replays make them overwrite each other's
//!   temporaries: wrong results, though never host memory unsafety (the memory stays
//!   allocated while any graph holds the pool).
//! * Capacity is fixed at creation; an allocation that does not fit is an error (nothing is
//!   allocated behind the user's back during a capture).
//! * The alternative, graph memory nodes (`DeviceBuffer::alloc_async` inside a capture, or
//!   explicit alloc/free nodes), lets the driver share physical memory between graphs and
//!   return it with [`Device::graph_mem_trim`](crate::driver::Device::graph_mem_trim); but such
//!   graphs cannot be cloned or instantiated twice, and their addresses are only valid while the
//!   graph's allocation is live, so buffers that cross graph boundaries want this pool.

use std::sync::{Arc, Mutex};

use cuda_graph_sys::CUdeviceptr;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::memory::{Allocation, DeviceBuffer, DeviceRepr};

/// Allocation granularity and alignment in bytes (enough for 16-byte vector and TMA access).
pub const POOL_ALIGN: usize = 256;

/// A fixed-capacity pool of device memory for graph-captured buffers; see the
/// [sharing contract](crate::pool#contract-and-trade-offs) in the module docs. Cheap to clone
/// (a handle).
#[derive(Debug, Clone)]
pub struct GraphPool {
    inner: Arc<PoolInner>,
}

/// The pool's memory and its free list; kept alive by every graph that uses a range of it.
#[derive(Debug)]
pub struct PoolInner {
    memory: Arc<Allocation>,
    ctx: Arc<Context>,
    free: Mutex<FreeList>,
}

impl GraphPool {
    /// Reserves `capacity` bytes (rounded up to [`POOL_ALIGN`]) with
    /// [`cuMemAlloc`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html). Call it before capturing: a capture may refuse that call.
    ///
    /// Errors: [`Error::InvalidArgument`] when rounding `capacity` up overflows; those of
    /// [`DeviceBuffer::alloc`].
    pub fn new(ctx: &Arc<Context>, capacity: usize) -> Result<GraphPool> {
        let capacity = capacity
            .checked_next_multiple_of(POOL_ALIGN)
            .ok_or_else(|| Error::invalid(format!("pool capacity {capacity} overflows")))?;
        let memory = DeviceBuffer::<u8>::alloc(ctx, capacity)?;
        Ok(GraphPool {
            inner: Arc::new(PoolInner {
                memory: memory.allocation().clone(),
                ctx: ctx.clone(),
                free: Mutex::new(FreeList::new(capacity)),
            }),
        })
    }

    /// A buffer of `len` elements carved from the pool, no driver call. Its contents are
    /// whatever the range last held.
    ///
    /// Errors: [`Error::InvalidArgument`] when the byte count overflows, or when the pool
    /// is exhausted: no free range is large enough (the pool never grows, so nothing is
    /// allocated during a capture). That message starts with `graph pool exhausted` and
    /// gives the bytes asked for, the largest free range, the free bytes and the capacity.
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = DeviceBuffer::<T>::bytes_for(len)?;
        let size = bytes
            .max(1)
            .checked_next_multiple_of(POOL_ALIGN)
            .ok_or_else(|| Error::invalid(format!("graph pool: {bytes} bytes overflow")))?;
        let offset = {
            let mut free = self.inner.lock();
            match free.take(size) {
                Some(offset) => offset,
                None => {
                    return Err(Error::invalid(format!(
                        "graph pool exhausted: {len} x {} needs {size} bytes, but the largest \
                         free range is {} bytes ({} of {} bytes free); the pool never grows: \
                         create it with a larger capacity",
                        std::any::type_name::<T>(),
                        free.largest(),
                        free.free_bytes(),
                        self.capacity()
                    )));
                }
            }
        };
        let ptr = self.inner.memory.ptr() + offset as CUdeviceptr;
        let alloc = Allocation::new_pooled(ptr, size, &self.inner.ctx, self.inner.clone());
        Ok(DeviceBuffer::from_alloc(alloc, len))
    }

    /// Total bytes the pool reserved.
    pub fn capacity(&self) -> usize {
        self.inner.memory.bytes()
    }

    /// Bytes not handed out.
    pub fn free_bytes(&self) -> usize {
        self.inner.lock().free_bytes()
    }
}

impl PoolInner {
    fn lock(&self) -> std::sync::MutexGuard<'_, FreeList> {
        self.free
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Returns a range handed out by `GraphPool::alloc` (called when its buffer drops).
    pub(crate) fn release(&self, ptr: CUdeviceptr, bytes: usize) {
        let offset = (ptr - self.memory.ptr()) as usize;
        self.lock().give_back(offset, bytes);
    }
}

/// First-fit free list of `(offset, size)` ranges, sorted and coalesced.
#[derive(Debug)]
struct FreeList {
    ranges: Vec<(usize, usize)>,
}

impl FreeList {
    fn new(capacity: usize) -> FreeList {
        FreeList {
            ranges: if capacity > 0 {
                vec![(0, capacity)]
            } else {
                Vec::new()
            },
        }
    }

    fn free_bytes(&self) -> usize {
        self.ranges.iter().map(|r| r.1).sum()
    }

    /// The size of the largest free range (what one allocation can get).
    fn largest(&self) -> usize {
        self.ranges.iter().map(|r| r.1).max().unwrap_or(0)
    }

    /// The offset of a free range of `size` bytes, taken from the lowest fitting range.
    fn take(&mut self, size: usize) -> Option<usize> {
        let i = self.ranges.iter().position(|&(_, len)| len >= size)?;
        let (offset, len) = self.ranges[i];
        if len == size {
            self.ranges.remove(i);
        } else {
            self.ranges[i] = (offset + size, len - size);
        }
        Some(offset)
    }

    /// Puts a range back, merging it with its neighbours.
    fn give_back(&mut self, offset: usize, size: usize) {
        let i = self.ranges.partition_point(|&(o, _)| o < offset);
        self.ranges.insert(i, (offset, size));
        if i + 1 < self.ranges.len() && offset + size == self.ranges[i + 1].0 {
            self.ranges[i].1 += self.ranges[i + 1].1;
            self.ranges.remove(i + 1);
        }
        if i > 0 && self.ranges[i - 1].0 + self.ranges[i - 1].1 == offset {
            self.ranges[i - 1].1 += self.ranges[i].1;
            self.ranges.remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::FreeList;

    #[test]
    fn first_fit_and_coalescing() {
        let mut f = FreeList::new(1024);
        let a = f.take(256).unwrap();
        let b = f.take(256).unwrap();
        let c = f.take(512).unwrap();
        assert_eq!((a, b, c), (0, 256, 512));
        assert_eq!(f.take(1), None);
        assert_eq!(f.largest(), 0);
        f.give_back(b, 256);
        assert_eq!(f.free_bytes(), 256);
        // Freed ranges are reused lowest first.
        assert_eq!(f.take(256), Some(256));
        f.give_back(256, 256);
        f.give_back(a, 256);
        assert_eq!(f.ranges, vec![(0, 512)]);
        f.give_back(c, 512);
        assert_eq!(f.ranges, vec![(0, 1024)]);
        assert_eq!(f.take(1024), Some(0));
    }

    #[test]
    fn out_of_order_release_merges_both_sides() {
        let mut f = FreeList::new(768);
        let (a, b, c) = (
            f.take(256).unwrap(),
            f.take(256).unwrap(),
            f.take(256).unwrap(),
        );
        f.give_back(a, 256);
        f.give_back(c, 256);
        assert_eq!(f.ranges, vec![(0, 256), (512, 256)]);
        // 512 bytes free, but no range of more than 256.
        assert_eq!((f.free_bytes(), f.largest()), (512, 256));
        f.give_back(b, 256);
        assert_eq!(f.ranges, vec![(0, 768)]);
    }
}
