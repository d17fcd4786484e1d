//! Tensor descriptions: device scalars (scale, scale_inv, amax, noop flags), FP8 tensors,
//! and views of high-precision buffers.

use cuda_graph::half::{bf16, f16};
use cuda_graph::{DeviceBuffer, Error, Result, Stream};

use crate::format::{DType, Fp8Format};

/// One f32 in device memory: element `index` of a buffer (a view sharing its allocation).
/// Scales, amaxes and noop flags are these, so kernels read them at run time and a captured
/// graph stays right when their values change.
#[derive(Debug)]
pub struct DeviceScalar {
    buf: DeviceBuffer<f32>,
    index: usize,
}

impl Clone for DeviceScalar {
    fn clone(&self) -> DeviceScalar {
        DeviceScalar {
            buf: self.buf.share(),
            index: self.index,
        }
    }
}

impl DeviceScalar {
    /// A new scalar in its own one-element buffer, set to `value` (waits for the copy; not
    /// for use during a capture).
    pub fn new(stream: &Stream, value: f32) -> Result<DeviceScalar> {
        let buf = DeviceBuffer::from_host(stream, &[value])?;
        Ok(DeviceScalar { buf, index: 0 })
    }

    /// Element `index` of `buf` (the scalar keeps `buf`'s memory alive).
    pub fn at(buf: &DeviceBuffer<f32>, index: usize) -> Result<DeviceScalar> {
        if index >= buf.len() {
            return Err(Error::InvalidArgument(format!(
                "scalar index {index} out of a buffer of {} elements",
                buf.len()
            )));
        }
        Ok(DeviceScalar {
            buf: buf.share(),
            index,
        })
    }

    /// The buffer holding it.
    pub fn buffer(&self) -> &DeviceBuffer<f32> {
        &self.buf
    }

    /// The scalar as a one-element view.
    pub fn view(&self) -> Result<DeviceBuffer<f32>> {
        self.buf.slice(self.index..=self.index)
    }

    /// Its index in [`DeviceScalar::buffer`].
    pub fn index(&self) -> usize {
        self.index
    }

    /// Its device address.
    pub fn device_ptr(&self) -> u64 {
        self.buf.as_raw() + (self.index * size_of::<f32>()) as u64
    }

    /// Reads it after earlier work on `stream` (copies and waits; not during a capture).
    pub fn read(&self, stream: &Stream) -> Result<f32> {
        let mut v = [0f32];
        self.view()?.copy_to_host(stream, &mut v)?;
        Ok(v[0])
    }

    /// Sets it, ordered after earlier work on `stream`, and waits (not during a capture).
    pub fn write(&self, stream: &Stream, value: f32) -> Result<()> {
        self.view()?.copy_from_host(stream, &[value])
    }
}

/// An FP8 tensor: its bytes, shape, format, and the device scalars that go with it (`scale`
/// used to quantize, `scale_inv` = 1 / scale for GEMMs and dequantize, `amax` that quantize
/// maxes |x| into).
#[derive(Debug)]
pub struct Fp8Tensor {
    data: DeviceBuffer<u8>,
    shape: Vec<usize>,
    format: Fp8Format,
    scale: DeviceScalar,
    scale_inv: DeviceScalar,
    amax: DeviceScalar,
}

/// The element count of a shape, checked for overflow.
pub(crate) fn numel(shape: &[usize]) -> Result<usize> {
    // A zero dimension makes the count 0 however large the others are (their partial product
    // may overflow).
    if shape.contains(&0) {
        return Ok(0);
    }
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} overflows usize")))
}

impl Fp8Tensor {
    /// A new tensor of `shape` with uninitialised data and its own scalars: scale 1,
    /// scale_inv 1, amax 0 (waits for the copy; not during a capture).
    pub fn new(stream: &Stream, shape: &[usize], format: Fp8Format) -> Result<Fp8Tensor> {
        let n = numel(shape)?;
        let data = DeviceBuffer::alloc(stream.context(), n)?;
        let scalars = DeviceBuffer::from_host(stream, &[1.0f32, 1.0, 0.0])?;
        Fp8Tensor::from_parts(
            data,
            shape,
            format,
            DeviceScalar::at(&scalars, 0)?,
            DeviceScalar::at(&scalars, 1)?,
            DeviceScalar::at(&scalars, 2)?,
        )
    }

    /// Assembles a tensor; `data` must hold exactly the shape's element count.
    pub fn from_parts(
        data: DeviceBuffer<u8>,
        shape: &[usize],
        format: Fp8Format,
        scale: DeviceScalar,
        scale_inv: DeviceScalar,
        amax: DeviceScalar,
    ) -> Result<Fp8Tensor> {
        let n = numel(shape)?;
        if data.len() != n {
            return Err(Error::InvalidArgument(format!(
                "FP8 data has {} bytes, shape {shape:?} needs {n}",
                data.len()
            )));
        }
        Ok(Fp8Tensor {
            data,
            shape: shape.to_vec(),
            format,
            scale,
            scale_inv,
            amax,
        })
    }

    /// The bytes, row-major.
    pub fn data(&self) -> &DeviceBuffer<u8> {
        &self.data
    }
    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// The element count.
    pub fn numel(&self) -> usize {
        self.data.len()
    }
    /// The format.
    pub fn format(&self) -> Fp8Format {
        self.format
    }
    /// The scale quantize multiplies by.
    pub fn scale(&self) -> &DeviceScalar {
        &self.scale
    }
    /// 1 / scale, written by quantize.
    pub fn scale_inv(&self) -> &DeviceScalar {
        &self.scale_inv
    }
    /// The amax quantize maxes |x| into.
    pub fn amax(&self) -> &DeviceScalar {
        &self.amax
    }
    /// Takes the data back.
    pub fn into_data(self) -> DeviceBuffer<u8> {
        self.data
    }
}

/// A high-precision buffer an FP8 kernel reads or writes: f32, f16 or bf16 elements
/// ([`half`](cuda_graph::half)'s types). Launchers take `impl Into<HpBuffer>`, so a
/// `&DeviceBuffer<f32>`, `&DeviceBuffer<f16>` or `&DeviceBuffer<bf16>` is passed as it is.
#[derive(Debug, Clone, Copy)]
pub enum HpBuffer<'a> {
    /// f32 elements.
    F32(&'a DeviceBuffer<f32>),
    /// IEEE half elements.
    F16(&'a DeviceBuffer<f16>),
    /// bfloat16 elements.
    Bf16(&'a DeviceBuffer<bf16>),
}

impl<'a> From<&'a DeviceBuffer<f32>> for HpBuffer<'a> {
    fn from(b: &'a DeviceBuffer<f32>) -> HpBuffer<'a> {
        HpBuffer::F32(b)
    }
}

impl<'a> From<&'a DeviceBuffer<f16>> for HpBuffer<'a> {
    fn from(b: &'a DeviceBuffer<f16>) -> HpBuffer<'a> {
        HpBuffer::F16(b)
    }
}

impl<'a> From<&'a DeviceBuffer<bf16>> for HpBuffer<'a> {
    fn from(b: &'a DeviceBuffer<bf16>) -> HpBuffer<'a> {
        HpBuffer::Bf16(b)
    }
}

impl HpBuffer<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            HpBuffer::F32(_) => DType::F32,
            HpBuffer::F16(_) => DType::F16,
            HpBuffer::Bf16(_) => DType::Bf16,
        }
    }
    /// The element count.
    pub fn len(&self) -> usize {
        match self {
            HpBuffer::F32(b) => b.len(),
            HpBuffer::F16(b) => b.len(),
            HpBuffer::Bf16(b) => b.len(),
        }
    }
    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device address.
    pub fn device_ptr(&self) -> u64 {
        match self {
            HpBuffer::F32(b) => b.as_raw(),
            HpBuffer::F16(b) => b.as_raw(),
            HpBuffer::Bf16(b) => b.as_raw(),
        }
    }
    /// Appends the buffer to a kernel argument list (its device address).
    pub(crate) fn push_to<'k>(&self, args: cuda_graph::KernelArgs<'k>) -> cuda_graph::KernelArgs<'k>
    where
        Self: 'k,
    {
        match *self {
            HpBuffer::F32(b) => args.arg(b),
            HpBuffer::F16(b) => args.arg(b),
            HpBuffer::Bf16(b) => args.arg(b),
        }
    }
}

/// Checks that a device address is `align`-byte aligned; `what` names it in the error and is
/// formatted only then (callers pass `format_args!`: nothing allocated on the launch path).
pub(crate) fn check_align(what: impl std::fmt::Display, addr: u64, align: u64) -> Result<()> {
    if addr % align == 0 {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what} at {addr:#x} is not {align}-byte aligned"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numel_checks_overflow() {
        assert_eq!(numel(&[]).ok(), Some(1));
        assert_eq!(numel(&[3, 5]).ok(), Some(15));
        assert!(numel(&[usize::MAX, 2]).is_err());
        assert_eq!(numel(&[usize::MAX, 2, 0]).ok(), Some(0));
    }

    #[test]
    fn alignment() {
        assert!(check_align("x", 256, 16).is_ok());
        assert!(check_align("x", 258, 16).is_err());
    }

    use crate::prop_util::{config, fits, size as dim};
    use proptest::collection::vec;
    use proptest::prelude::*;
    use proptest::sample::select;

    proptest! {
        #![proptest_config(config(100_000))]

        /// The element count is the exact product; an error names the shape.
        #[test]
        fn numel_is_the_exact_product(shape in vec(dim(), 0..=5)) {
            match numel(&shape) {
                Ok(n) => prop_assert_eq!(Some(n), fits(&shape)),
                Err(e) => {
                    prop_assert_eq!(fits(&shape), None, "{:?}: {}", shape, e);
                    let msg = e.to_string();
                    prop_assert!(msg.contains(&format!("{shape:?}")), "{}", msg);
                }
            }
        }

        /// Divisibility; an error names what, the address and the alignment.
        #[test]
        fn check_align_is_divisibility(
            addr in prop_oneof![any::<u64>(), (0u64..1 << 40).prop_map(|x| x * 16)],
            align in prop_oneof![select(vec![1u64, 2, 4, 8, 16, 128, 256]), 1..=u64::MAX],
        ) {
            match check_align("prop buffer", addr, align) {
                Ok(()) => prop_assert_eq!(addr % align, 0),
                Err(e) => {
                    prop_assert_ne!(addr % align, 0);
                    let msg = e.to_string();
                    prop_assert!(
                        msg.contains(&format!("prop buffer at {addr:#x}"))
                            && msg.contains(&format!("{align}-byte")),
                        "{}", msg
                    );
                }
            }
        }
    }
}
