//! The element types device buffers hold.

/// Plain data that may be copied to and from the device bit for bit.
///
/// Implemented for the primitive numbers, [`half::f16`], [`half::bf16`] and arrays of
/// `DeviceRepr` values. Implement it for your own `#[repr(C)]` structs of such fields.
///
/// # Safety
/// Every bit pattern must be a valid value, with no padding and no pointers to host memory.
pub unsafe trait DeviceRepr: Copy + Send + Sync + 'static {}

macro_rules! device_repr {
    ($($t:ty),*) => { $(
        // SAFETY: primitive numbers and half's IEEE half / bfloat16 (`#[repr(transparent)]`
        // over u16): every bit pattern is a valid value, no padding.
        unsafe impl DeviceRepr for $t {}
    )* };
}
device_repr!(
    u8,
    i8,
    u16,
    i16,
    u32,
    i32,
    u64,
    i64,
    usize,
    isize,
    f32,
    f64,
    half::f16,
    half::bf16
);
// SAFETY: arrays of plain data are plain data.
unsafe impl<T: DeviceRepr, const N: usize> DeviceRepr for [T; N] {}
