//! Tensor descriptions: device scalars (scale, scale_inv, amax, noop flags), FP8 tensors,
//! and views of high-precision buffers.

use std::sync::Arc;

use cuda_graph::{DeviceBuffer, Error, Result, Stream};

use crate::format::{DType, Fp8Format};

/// One f32 in device memory: element `index` of a shared buffer. Scales, amaxes and noop
/// flags are these, so kernels read them at run time and a captured graph stays right when
/// their values change.
#[derive(Debug, Clone)]
pub struct DeviceScalar {
    buf: Arc<DeviceBuffer<f32>>,
    index: usize,
}

impl DeviceScalar {
    /// A new scalar in its own one-element buffer, set to `value` (waits for the copy; not
    /// for use during a capture).
    pub fn new(stream: &Stream, value: f32) -> Result<DeviceScalar> {
        let buf = DeviceBuffer::from_host(stream, &[value])?;
        Ok(DeviceScalar {
            buf: Arc::new(buf),
            index: 0,
        })
    }

    /// Element `index` of `buf`.
    pub fn at(buf: Arc<DeviceBuffer<f32>>, index: usize) -> Result<DeviceScalar> {
        if index >= buf.len() {
            return Err(Error::InvalidArgument(format!(
                "scalar index {index} out of a buffer of {} elements",
                buf.len()
            )));
        }
        Ok(DeviceScalar { buf, index })
    }

    /// The buffer holding it.
    pub fn buffer(&self) -> &Arc<DeviceBuffer<f32>> {
        &self.buf
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
        let mut v = 0f32;
        self.copy(stream, Dir::ToHost(&mut v))?;
        Ok(v)
    }

    /// Sets it, ordered after earlier work on `stream`, and waits (not during a capture).
    pub fn write(&self, stream: &Stream, value: f32) -> Result<()> {
        self.copy(stream, Dir::FromHost(&value))
    }

    fn copy(&self, stream: &Stream, dir: Dir<'_>) -> Result<()> {
        let d = cuda_graph::sys::driver()?;
        let rc = match dir {
            // SAFETY: device_ptr() is inside the live buffer (index checked at
            // construction), 4 bytes; the host value outlives the call, which is followed by
            // a synchronize before it goes.
            Dir::ToHost(v) => unsafe {
                d.cuMemcpyDtoHAsync()?(
                    (v as *mut f32).cast(),
                    self.device_ptr(),
                    4,
                    stream.as_raw(),
                )
            },
            // SAFETY: as above.
            Dir::FromHost(v) => unsafe {
                d.cuMemcpyHtoDAsync()?(
                    self.device_ptr(),
                    (v as *const f32).cast(),
                    4,
                    stream.as_raw(),
                )
            },
        };
        if rc != cuda_graph::sys::CUresult::CUDA_SUCCESS {
            return Err(Error::driver("cuMemcpyAsync (device scalar)", rc));
        }
        stream.synchronize()
    }
}

enum Dir<'a> {
    ToHost(&'a mut f32),
    FromHost(&'a f32),
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
        let scalars = Arc::new(DeviceBuffer::from_host(stream, &[1.0f32, 1.0, 0.0])?);
        Fp8Tensor::from_parts(
            data,
            shape,
            format,
            DeviceScalar::at(scalars.clone(), 0)?,
            DeviceScalar::at(scalars.clone(), 1)?,
            DeviceScalar::at(scalars, 2)?,
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
    /// The bytes, to fill or poison.
    pub fn data_mut(&mut self) -> &mut DeviceBuffer<u8> {
        &mut self.data
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

/// A high-precision buffer to read: f32, or f16 / bf16 held as their raw `u16` bits.
#[derive(Debug, Clone, Copy)]
pub enum HpBuffer<'a> {
    /// f32 elements.
    F32(&'a DeviceBuffer<f32>),
    /// IEEE half elements, as bits.
    F16(&'a DeviceBuffer<u16>),
    /// bfloat16 elements, as bits.
    Bf16(&'a DeviceBuffer<u16>),
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
            HpBuffer::F16(b) | HpBuffer::Bf16(b) => b.len(),
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
            HpBuffer::F16(b) | HpBuffer::Bf16(b) => b.as_raw(),
        }
    }
}

/// A high-precision buffer to write: f32, or f16 / bf16 held as their raw `u16` bits.
#[derive(Debug)]
pub enum HpBufferMut<'a> {
    /// f32 elements.
    F32(&'a mut DeviceBuffer<f32>),
    /// IEEE half elements, as bits.
    F16(&'a mut DeviceBuffer<u16>),
    /// bfloat16 elements, as bits.
    Bf16(&'a mut DeviceBuffer<u16>),
}

impl HpBufferMut<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            HpBufferMut::F32(_) => DType::F32,
            HpBufferMut::F16(_) => DType::F16,
            HpBufferMut::Bf16(_) => DType::Bf16,
        }
    }
    /// The element count.
    pub fn len(&self) -> usize {
        match self {
            HpBufferMut::F32(b) => b.len(),
            HpBufferMut::F16(b) | HpBufferMut::Bf16(b) => b.len(),
        }
    }
    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device address.
    pub fn device_ptr(&self) -> u64 {
        match self {
            HpBufferMut::F32(b) => b.as_raw(),
            HpBufferMut::F16(b) | HpBufferMut::Bf16(b) => b.as_raw(),
        }
    }
}

/// Checks that a device address is `align`-byte aligned.
pub(crate) fn check_align(what: &str, addr: u64, align: u64) -> Result<()> {
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
    }

    #[test]
    fn alignment() {
        assert!(check_align("x", 256, 16).is_ok());
        assert!(check_align("x", 258, 16).is_err());
    }
}
