//! Driver initialisation, version, devices, and the graph features the installed driver
//! supports.

use std::ffi::c_char;
use std::sync::OnceLock;

use cuda_graph_sys::{CUdevice, CUdevice_attribute, CUresult, Driver};

use crate::error::{Error, Result};

/// A CUDA driver version as `cuDriverGetVersion` reports it: `1000 * major + 10 * minor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DriverVersion(pub i32);

impl DriverVersion {
    /// Major version, e.g. 13.
    pub fn major(self) -> i32 {
        self.0 / 1000
    }
    /// Minor version, e.g. 0.
    pub fn minor(self) -> i32 {
        self.0 % 1000 / 10
    }
}

impl std::fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major(), self.minor())
    }
}

/// Loads the driver and runs `cuInit` once per process; later calls return the cached
/// outcome, so a failed initialisation is not retried. [`Device::count`] and
/// [`Context::new`](crate::Context::new) call it, and everything else starts from them.
///
/// Wraps [`cuInit`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__INITIALIZE.html).
/// Errors: [`Error::Load`] when the driver library cannot be opened or predates CUDA 12.0;
/// [`Error::Driver`] from `cuInit` (e.g. `CUDA_ERROR_NO_DEVICE` on a machine without a GPU).
pub fn init() -> Result<&'static Driver> {
    static INIT: OnceLock<CUresult> = OnceLock::new();
    let d = cuda_graph_sys::driver()?;
    let init = d.cuInit()?;
    // SAFETY: cuInit takes a flags word that must be 0.
    let rc = *INIT.get_or_init(|| unsafe { init(0) });
    crate::error::check("cuInit", rc)?;
    Ok(d)
}

/// The installed driver's CUDA version (not the version of the headers we were built with).
/// Needs no `cuInit`, so feature checks work before any device is touched.
///
/// Wraps [`cuDriverGetVersion`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VERSION.html).
/// Errors: [`Error::Load`] when the driver library cannot be opened or predates CUDA 12.0;
/// [`Error::Driver`].
pub fn driver_version() -> Result<DriverVersion> {
    let d = cuda_graph_sys::driver()?;
    let mut v = 0;
    // SAFETY: valid out-pointer; cuDriverGetVersion needs no cuInit.
    crate::error::check("cuDriverGetVersion", unsafe {
        d.cuDriverGetVersion()?(&mut v)
    })?;
    Ok(DriverVersion(v))
}

/// The CUDA version of the headers this crate was built against (`CUDA_VERSION`).
pub const HEADER_VERSION: DriverVersion = DriverVersion(cuda_graph_sys::CUDA_VERSION as i32);

/// A graph feature that depends on the driver (and for some, the device).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Feature {
    /// Conditional IF (without else) and WHILE nodes.
    ConditionalIfWhile,
    /// Conditional IF with an else body, and SWITCH nodes.
    ConditionalIfElseSwitch,
    /// Kernel nodes whose parameters device code may update.
    DeviceUpdatableKernelNodes,
    /// Programmatic dependent launch: programmatic edges and stream serialization.
    ProgrammaticDependentLaunch,
}

impl Feature {
    /// Every feature, in the order `info` lists them.
    pub const ALL: [Feature; 4] = [
        Feature::ConditionalIfWhile,
        Feature::ConditionalIfElseSwitch,
        Feature::DeviceUpdatableKernelNodes,
        Feature::ProgrammaticDependentLaunch,
    ];

    /// A short human name.
    pub fn name(self) -> &'static str {
        match self {
            Feature::ConditionalIfWhile => "conditional IF and WHILE nodes",
            Feature::ConditionalIfElseSwitch => "conditional IF-ELSE and SWITCH nodes",
            Feature::DeviceUpdatableKernelNodes => "device-updatable kernel nodes",
            Feature::ProgrammaticDependentLaunch => "programmatic dependent launch",
        }
    }

    /// The oldest driver that has it.
    pub fn min_driver(self) -> DriverVersion {
        DriverVersion(match self {
            Feature::ConditionalIfWhile | Feature::DeviceUpdatableKernelNodes => 12040,
            Feature::ConditionalIfElseSwitch => 12080,
            Feature::ProgrammaticDependentLaunch => 12030,
        })
    }

    /// The lowest compute capability that has it, if it depends on the device.
    pub fn min_compute_capability(self) -> Option<(i32, i32)> {
        match self {
            Feature::ProgrammaticDependentLaunch => Some((9, 0)),
            _ => None,
        }
    }

    /// `Ok` when a driver of `version` has the feature; no driver call.
    ///
    /// Errors: [`Error::Unsupported`], naming the feature and the version it needs.
    pub fn check_driver(self, version: DriverVersion) -> Result<()> {
        if version >= self.min_driver() {
            Ok(())
        } else {
            Err(Error::Unsupported {
                feature: self.name(),
                needed: self.min_driver(),
                found: version,
            })
        }
    }
}

/// Memory used by graph memory nodes on a device (`cuDeviceGetGraphMemAttribute`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphMemUsage {
    /// Bytes currently allocated by graph memory nodes.
    pub used: u64,
    /// High-water mark of `used`.
    pub used_high: u64,
    /// Bytes of physical memory reserved for graph memory nodes.
    pub reserved: u64,
    /// High-water mark of `reserved`.
    pub reserved_high: u64,
}

/// A CUDA device, by ordinal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Device {
    raw: CUdevice,
}

impl Device {
    /// Number of devices the driver sees.
    ///
    /// Wraps [`cuDeviceGetCount`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html).
    /// Errors: those of [`init`]; [`Error::Driver`].
    pub fn count() -> Result<i32> {
        init()?;
        let mut n = 0;
        // SAFETY: valid out-pointer.
        unsafe { cu!(cuDeviceGetCount(&mut n)) }?;
        Ok(n)
    }

    /// The device with this ordinal.
    ///
    /// Wraps [`cuDeviceGet`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html).
    /// Errors: [`Error::NoDevice`] for an ordinal outside `0..count`; those of
    /// [`Device::count`]; [`Error::Driver`].
    pub fn get(ordinal: i32) -> Result<Device> {
        let count = Device::count()?;
        if !(0..count).contains(&ordinal) {
            return Err(Error::NoDevice { ordinal, count });
        }
        let mut raw = 0;
        // SAFETY: valid out-pointer; the ordinal is in range.
        unsafe { cu!(cuDeviceGet(&mut raw, ordinal)) }?;
        Ok(Device { raw })
    }

    /// The raw `CUdevice`.
    pub fn as_raw(self) -> CUdevice {
        self.raw
    }

    /// The marketing name, e.g. `NVIDIA H200`.
    ///
    /// Wraps [`cuDeviceGetName`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html).
    /// Errors: [`Error::Driver`].
    pub fn name(self) -> Result<String> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: the buffer is valid for its length, which is passed.
        unsafe {
            cu!(cuDeviceGetName(
                buf.as_mut_ptr(),
                buf.len() as i32,
                self.raw
            ))
        }?;
        let bytes: Vec<u8> = buf
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// A raw device attribute.
    ///
    /// Wraps [`cuDeviceGetAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html).
    /// Errors: [`Error::Driver`] (`CUDA_ERROR_INVALID_VALUE` for an attribute this driver does
    /// not know).
    pub fn attribute(self, attr: CUdevice_attribute) -> Result<i32> {
        let mut v = 0;
        // SAFETY: valid out-pointer; unknown attributes are rejected by the driver.
        unsafe { cu!(cuDeviceGetAttribute(&mut v, attr, self.raw)) }?;
        Ok(v)
    }

    /// Compute capability `(major, minor)`, e.g. `(9, 0)`.
    ///
    /// Two [`cuDeviceGetAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html)
    /// queries.
    /// Errors: [`Error::Driver`].
    pub fn compute_capability(self) -> Result<(i32, i32)> {
        Ok((
            self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ))
    }

    /// Number of streaming multiprocessors.
    ///
    /// Wraps [`cuDeviceGetAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html).
    /// Errors: [`Error::Driver`].
    pub fn multiprocessor_count(self) -> Result<i32> {
        self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
    }

    /// Total device memory in bytes.
    ///
    /// Wraps [`cuDeviceTotalMem`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html).
    /// Errors: [`Error::Driver`].
    pub fn total_memory(self) -> Result<usize> {
        let mut bytes = 0;
        // SAFETY: valid out-pointer.
        unsafe { cu!(cuDeviceTotalMem(&mut bytes, self.raw)) }?;
        Ok(bytes)
    }

    /// Returns the physical memory that graph memory nodes reserved but no graph is using
    /// back to the OS.
    ///
    /// Wraps [`cuDeviceGraphMemTrim`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    /// Errors: those of [`init`]; [`Error::Driver`].
    pub fn graph_mem_trim(self) -> Result<()> {
        init()?;
        // SAFETY: valid device.
        unsafe { cu!(cuDeviceGraphMemTrim(self.raw)) }
    }

    /// Memory of graph memory nodes on this device, in bytes.
    ///
    /// Four [`cuDeviceGetGraphMemAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
    /// queries.
    /// Errors: those of [`init`]; [`Error::Driver`].
    pub fn graph_mem_usage(self) -> Result<GraphMemUsage> {
        use cuda_graph_sys::CUgraphMem_attribute as A;
        init()?;
        let get = |attr: A| -> Result<u64> {
            let mut v = 0u64;
            // SAFETY: these attributes write a u64.
            unsafe {
                cu!(cuDeviceGetGraphMemAttribute(
                    self.raw,
                    attr,
                    (&raw mut v).cast()
                ))
            }?;
            Ok(v)
        };
        Ok(GraphMemUsage {
            used: get(A::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT)?,
            used_high: get(A::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH)?,
            reserved: get(A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: get(A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)?,
        })
    }

    /// `Ok` when this device, with the installed driver, has `feature`.
    ///
    /// Asks [`cuDriverGetVersion`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VERSION.html),
    /// and for a feature that depends on the device its compute capability
    /// ([`cuDeviceGetAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html)).
    /// Errors: [`Error::Unsupported`] when the driver is older than
    /// [`Feature::min_driver`]; [`Error::UnsupportedDevice`] when the device is below
    /// [`Feature::min_compute_capability`]; [`Error::Load`] and [`Error::Driver`] of the
    /// queries.
    pub fn require(self, feature: Feature) -> Result<()> {
        feature.check_driver(driver_version()?)?;
        if let Some((need_major, need_minor)) = feature.min_compute_capability() {
            let (major, minor) = self.compute_capability()?;
            if (major, minor) < (need_major, need_minor) {
                return Err(Error::UnsupportedDevice {
                    feature: feature.name(),
                    device: self.name()?,
                    major,
                    minor,
                    needed_major: need_major,
                    needed_minor: need_minor,
                });
            }
        }
        Ok(())
    }

    /// Whether this device, with the installed driver, has `feature`: [`Device::require`]
    /// with its `Unsupported` and `UnsupportedDevice` answers turned into `false`.
    ///
    /// Errors: the other errors of [`Device::require`] (a failed query is not a "no").
    pub fn supports(self, feature: Feature) -> Result<bool> {
        match self.require(feature) {
            Ok(()) => Ok(true),
            Err(Error::Unsupported { .. } | Error::UnsupportedDevice { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_parts() {
        let v = DriverVersion(12080);
        assert_eq!((v.major(), v.minor()), (12, 8));
        assert_eq!(v.to_string(), "12.8");
        assert_eq!(DriverVersion(13000).to_string(), "13.0");
    }

    #[test]
    fn feature_gates_follow_the_driver_version() {
        let old = DriverVersion(12030);
        let mid = DriverVersion(12040);
        let new = DriverVersion(13000);
        assert!(Feature::ConditionalIfWhile.check_driver(old).is_err());
        assert!(Feature::ConditionalIfWhile.check_driver(mid).is_ok());
        let err = Feature::ConditionalIfElseSwitch
            .check_driver(mid)
            .unwrap_err();
        assert!(matches!(
            err,
            Error::Unsupported {
                needed: DriverVersion(12080),
                found: DriverVersion(12040),
                ..
            }
        ));
        for f in Feature::ALL {
            assert!(f.check_driver(new).is_ok(), "{f:?}");
        }
    }

    #[test]
    fn header_version_is_at_least_12_4() {
        assert!(HEADER_VERSION >= DriverVersion(12040));
    }
}
