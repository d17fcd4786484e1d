//! Modules (fatbin, cubin or PTX images) and the kernels in them.

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::{Arc, Mutex, OnceLock};

use cuda_graph_sys::{CUfunction, CUfunction_attribute, CUjit_option, CUmodule, CUresult};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::launch::LaunchConfig;
use crate::resources::Resource;

/// A loaded module. Kernels taken from it, and graphs whose nodes launch them, keep it loaded.
#[derive(Debug, Clone)]
pub struct Module {
    inner: Arc<ModuleInner>,
}

#[derive(Debug)]
pub(crate) struct ModuleInner {
    raw: CUmodule,
    ctx: Arc<Context>,
    /// Kernels already looked up, by name: a lookup is several driver calls (the function and
    /// each parameter's size), and launchers look kernels up on every call. Not `Kernel`s,
    /// which hold an `Arc` of this module (a cycle).
    kernels: Mutex<HashMap<String, KernelParts>>,
}

/// What [`Module::kernel`] caches of a kernel.
#[derive(Debug, Clone)]
struct KernelParts {
    raw: CUfunction,
    name: Arc<str>,
    params: Option<Arc<[usize]>>,
}

// SAFETY: the fields that are not `Send` by themselves are the raw `CUmodule` and the
// `CUfunction`s of the kernel cache: driver handles not tied to a thread (functions may be
// looked up and launched, and the module unloaded, from any thread).
unsafe impl Send for ModuleInner {}
// SAFETY: through `&self` the module handle only goes to thread-safe driver calls
// (`cuModuleGetFunction`, `cuFuncGetParamInfo`), and the kernel cache, the only state that
// changes, is behind a `Mutex`.
unsafe impl Sync for ModuleInner {}

impl Module {
    /// Loads a fatbin or cubin image
    /// ([`cuModuleLoadData`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MODULE.html)).
    /// The bytes are copied to an 8-byte-aligned buffer first, as the driver reads the
    /// image's headers in place.
    ///
    /// Legal in the middle of a stream capture: the load runs with this thread's capture
    /// mode relaxed, so a library whose first launch happens inside a capture (and loads its
    /// kernels then) does not invalidate it.
    ///
    /// Errors: [`Error::InvalidArgument`] for an empty image; [`Error::Driver`] (not a valid
    /// image for this device, out of memory; also from making `ctx` current or switching
    /// the thread's capture mode).
    pub fn from_image(ctx: &Arc<Context>, image: &[u8]) -> Result<Module> {
        if image.is_empty() {
            return Err(Error::invalid("empty module image"));
        }
        let mut aligned = vec![0u64; image.len().div_ceil(8) + 1];
        // SAFETY: aligned has at least image.len() bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(image.as_ptr(), aligned.as_mut_ptr().cast(), image.len())
        };
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid image pointer for the duration of the call, valid out-pointer.
        crate::capture::relaxed(|| unsafe {
            cu!(cuModuleLoadData(&mut raw, aligned.as_ptr().cast()))
        })?;
        Ok(Module::wrap(ctx, raw))
    }

    /// Compiles and loads PTX text; legal during a capture, like [`Module::from_image`].
    ///
    /// Wraps [`cuModuleLoadDataEx`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MODULE.html),
    /// with an 8 KiB JIT error log.
    /// Errors: [`Error::InvalidArgument`] when the text contains a NUL byte;
    /// [`Error::ModuleLoad`] when the load fails, carrying the driver's error and the JIT's
    /// log (where a PTX syntax error is explained); [`Error::Driver`] from making `ctx`
    /// current or switching the thread's capture mode.
    pub fn from_ptx(ctx: &Arc<Context>, ptx: &str) -> Result<Module> {
        let text = CString::new(ptx).map_err(|_| Error::invalid("PTX contains a NUL byte"))?;
        ctx.bind()?;
        let mut log = vec![0u8; 8192];
        let mut options = [
            CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
            CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        ];
        let mut values: [*mut c_void; 2] = [log.as_mut_ptr().cast(), log.len() as *mut c_void];
        let mut raw = std::ptr::null_mut();
        let load = cuda_graph_sys::driver()?.cuModuleLoadDataEx()?;
        // SAFETY: the option arrays have 2 entries each; the log buffer outlives the call.
        let rc = crate::capture::relaxed(|| {
            Ok(unsafe {
                load(
                    &mut raw,
                    text.as_ptr().cast(),
                    2,
                    options.as_mut_ptr(),
                    values.as_mut_ptr(),
                )
            })
        })?;
        if rc != CUresult::CUDA_SUCCESS {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let log = String::from_utf8_lossy(&log[..end]).trim().to_owned();
            return Err(Error::ModuleLoad {
                source: Box::new(Error::driver("cuModuleLoadDataEx", rc)),
                log,
            });
        }
        Ok(Module::wrap(ctx, raw))
    }

    /// The module of an image embedded in the program (a `static` holding `include_bytes!`:
    /// the cache is keyed by the image's address), loaded in `ctx` on first use and kept for
    /// the life of the process (so the context stays retained too,
    /// as primary contexts are anyway). Libraries that ship kernels use this so every layer,
    /// launcher and thread shares one loaded copy.
    ///
    /// Errors: as [`Module::from_image`], on a first use only; a failed load is not cached,
    /// so the next call tries again.
    pub fn embedded(ctx: &Arc<Context>, image: &'static [u8]) -> Result<Module> {
        static CACHE: OnceLock<Mutex<HashMap<(usize, usize), Module>>> = OnceLock::new();
        let key = (ctx.as_raw() as usize, image.as_ptr() as usize);
        let mut cache = CACHE
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(m) = cache.get(&key) {
            return Ok(m.clone());
        }
        let module = Module::from_image(ctx, image)?;
        cache.insert(key, module.clone());
        Ok(module)
    }

    fn wrap(ctx: &Arc<Context>, raw: CUmodule) -> Module {
        Module {
            inner: Arc::new(ModuleInner {
                raw,
                ctx: ctx.clone(),
                kernels: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The kernel `name` (an `extern "C"` symbol); looked up once, then served from the
    /// module's cache.
    ///
    /// Wraps [`cuModuleGetFunction`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MODULE.html),
    /// and [`cuFuncGetParamInfo`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EXEC.html)
    /// for the parameter sizes (driver >= 12.4; an older driver leaves them unknown, which is not
    /// an error).
    /// Errors: [`Error::InvalidArgument`] when `name` contains a NUL byte; [`Error::Driver`]
    /// (`CUDA_ERROR_NOT_FOUND` for no such kernel). Failed lookups are not cached.
    pub fn kernel(&self, name: &str) -> Result<Kernel> {
        let mut kernels = self
            .inner
            .kernels
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let parts = match kernels.get(name) {
            Some(parts) => parts.clone(),
            None => {
                let parts = self.look_up(name)?;
                kernels.insert(name.to_owned(), parts.clone());
                parts
            }
        };
        Ok(Kernel {
            raw: parts.raw,
            module: self.inner.clone() as Resource,
            name: parts.name,
            params: parts.params,
        })
    }

    fn look_up(&self, name: &str) -> Result<KernelParts> {
        let cname = CString::new(name).map_err(|_| Error::invalid("kernel name contains NUL"))?;
        let mut raw = std::ptr::null_mut();
        self.inner.ctx.ensure_current()?;
        // SAFETY: live module, valid out-pointer and name.
        unsafe {
            cu!(cuModuleGetFunction(
                &mut raw,
                self.inner.raw,
                cname.as_ptr()
            ))
        }?;
        let params = param_sizes(raw)?;
        Ok(KernelParts {
            raw,
            name: name.into(),
            params: params.map(Into::into),
        })
    }

    /// The raw handle; valid while any handle to this module lives.
    pub fn as_raw(&self) -> CUmodule {
        self.inner.raw
    }

    /// The context it was loaded in.
    pub fn context(&self) -> &Arc<Context> {
        &self.inner.ctx
    }
}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        if let Ok(unload) = cuda_graph_sys::driver().and_then(|d| d.cuModuleUnload()) {
            // SAFETY: owned module; every kernel and graph using it held this Arc.
            unsafe { unload(self.raw) };
        }
    }
}

/// The byte size of each parameter, from `cuFuncGetParamInfo` (driver >= 12.4); `None` when
/// the driver cannot tell, and launches are then not checked.
fn param_sizes(f: CUfunction) -> Result<Option<Vec<usize>>> {
    let Ok(info) = cuda_graph_sys::driver()?.cuFuncGetParamInfo() else {
        return Ok(None);
    };
    let mut sizes = Vec::new();
    loop {
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: live function, valid out-pointers.
        let rc = unsafe { info(f, sizes.len(), &mut offset, &mut size) };
        match rc {
            CUresult::CUDA_SUCCESS => sizes.push(size),
            CUresult::CUDA_ERROR_INVALID_VALUE => return Ok(Some(sizes)),
            rc => return Err(Error::driver("cuFuncGetParamInfo", rc)),
        }
    }
}

/// A kernel of a loaded [`Module`] (or of another library's module, e.g. the `cudarc`
/// feature's `Kernel::from_cudarc`); keeps the module loaded. Knows its parameter sizes, so
/// launches and kernel nodes check the argument list before calling the driver.
#[derive(Debug, Clone)]
pub struct Kernel {
    raw: CUfunction,
    /// What keeps the function's module loaded: this crate's module, or another library's
    /// handle of it.
    module: Resource,
    name: Arc<str>,
    params: Option<Arc<[usize]>>,
}

// SAFETY: the only field that is not `Send` by itself is the raw `CUfunction`, a driver
// handle not tied to a thread; `module` (which keeps it loaded) is `Send` and `Sync` by type.
unsafe impl Send for Kernel {}
// SAFETY: the fields never change after construction; `&self` methods only read them or
// pass the handle to thread-safe driver calls (`cuFuncSetAttribute`: two threads setting the
// shared-memory limit at once leave one of the two values, with no data race).
unsafe impl Sync for Kernel {}

impl Kernel {
    /// Adopts a function of a module loaded by another library: `owner` (e.g. the library's
    /// handle of the function or module) is kept alive for as long as this kernel and every
    /// graph and exec launching it live. `name` is for error messages. The parameter sizes
    /// are asked from the driver, as for [`Module::kernel`]. Prefer a safe adopter where one
    /// exists (the `cudarc` feature's `Kernel::from_cudarc`).
    ///
    /// # Safety
    /// `raw` must be a function of a module that stays loaded for as long as `owner` lives.
    pub unsafe fn from_owner(raw: CUfunction, owner: Resource, name: &str) -> Result<Kernel> {
        Ok(Kernel {
            raw,
            module: owner,
            name: name.into(),
            params: param_sizes(raw)?.map(Into::into),
        })
    }

    /// The raw handle; valid while this kernel (or its module) lives.
    pub fn as_raw(&self) -> CUfunction {
        self.raw
    }

    /// The kernel's symbol name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Byte size of each parameter (`None` if the driver cannot report them).
    pub fn param_sizes(&self) -> Option<&[usize]> {
        self.params.as_deref()
    }

    /// The module, to keep it alive from a graph.
    pub(crate) fn module_resource(&self) -> Resource {
        self.module.clone()
    }

    /// Allows up to `bytes` of dynamic shared memory per block (needed above 48 KiB).
    ///
    /// Wraps [`cuFuncSetAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EXEC.html)
    /// (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`).
    /// Errors: [`Error::InvalidArgument`] when `bytes` does not fit an `i32`;
    /// [`Error::Driver`] when it exceeds what the device allows.
    pub fn set_max_dynamic_shared_memory(&self, bytes: usize) -> Result<()> {
        let bytes = i32::try_from(bytes)
            .map_err(|_| Error::invalid(format!("{bytes} bytes of shared memory")))?;
        // SAFETY: live function; the attribute takes an int.
        unsafe {
            cu!(cuFuncSetAttribute(
                self.raw,
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes
            ))
        }
    }

    /// How many clusters of `config`'s cluster dimension (a
    /// [`LaunchAttribute::ClusterDimension`](crate::LaunchAttribute::ClusterDimension) among its
    /// attributes; one block a cluster without) can be resident on the device at once with
    /// `config`'s block size and dynamic shared memory: the size of one wave. The blocks of a
    /// cluster share a GPC, so this can be less than the SM count over the cluster size.
    /// Set the shared-memory limit ([`set_max_dynamic_shared_memory`](Self::set_max_dynamic_shared_memory))
    /// first when `config` asks for more than 48 KiB.
    ///
    /// Wraps [`cuOccupancyMaxActiveClusters`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__OCCUPANCY.html).
    /// Errors: [`Error::Driver`] when the driver refuses the configuration (a cluster larger
    /// than the device allows, shared memory past the kernel's limit) or lacks the entry
    /// point (drivers before 11.8).
    pub fn max_active_clusters(&self, config: &LaunchConfig) -> Result<u32> {
        let mut attrs: Vec<_> = config.attributes.iter().map(|a| a.to_raw()).collect();
        let raw = config.raw(std::ptr::null_mut(), &mut attrs);
        let mut clusters = 0i32;
        // SAFETY: live function; `raw` and its attribute array outlive the call, which only
        // reads them and writes `clusters`.
        unsafe { cu!(cuOccupancyMaxActiveClusters(&mut clusters, self.raw, &raw)) }?;
        Ok(clusters.max(0) as u32)
    }

    /// Checks an argument list's sizes against the kernel's parameters.
    pub(crate) fn check_args(&self, sizes: &[usize]) -> Result<()> {
        check_arg_sizes(self.params.as_deref(), sizes, &self.name)
    }
}

/// Checks argument sizes `got` against a kernel's parameter sizes; `expected` is `None` when
/// the driver is too old to report them, and then there is nothing to check. The error names
/// the kernel, both lists and the first argument that differs.
pub(crate) fn check_arg_sizes(
    expected: Option<&[usize]>,
    got: &[usize],
    kernel_name: &str,
) -> Result<()> {
    let Some(params) = expected else {
        return Ok(());
    };
    let Some(i) = (0..params.len().max(got.len())).find(|&i| params.get(i) != got.get(i)) else {
        return Ok(());
    };
    let first = match (params.get(i), got.get(i)) {
        (Some(p), Some(g)) => format!("argument {i} has {g} bytes, parameter {i} {p}"),
        (Some(p), None) => format!("argument {i} is missing (parameter {i} has {p} bytes)"),
        // They differ at i, so only the arguments reach it.
        (None, g) => format!(
            "argument {i} has {} bytes, beyond the kernel's {} parameter(s)",
            g.copied().unwrap_or(0),
            params.len()
        ),
    };
    Err(Error::invalid(format!(
        "kernel {kernel_name} takes parameters of {params:?} bytes, got arguments of {got:?} \
         bytes: {first}"
    )))
}

#[cfg(test)]
mod tests {
    use proptest::collection::vec;
    use proptest::prelude::*;
    use proptest::sample::select;
    use proptest::test_runner::RngAlgorithm;

    use super::*;

    /// A parameter size: the usual 1 to 16 bytes mostly, sometimes large.
    fn size() -> impl Strategy<Value = usize> {
        prop_oneof![8 => 1usize..=16, 1 => 0usize..=4096, 1 => any::<usize>()]
    }

    /// How the arguments are made from the parameters.
    #[derive(Debug, Clone)]
    enum Edit {
        Same,
        Resize(usize, usize),
        Drop(usize),
        Push(usize),
        Other(Vec<usize>),
    }

    fn edit() -> impl Strategy<Value = Edit> {
        prop_oneof![
            3 => Just(Edit::Same),
            3 => (any::<usize>(), size()).prop_map(|(i, s)| Edit::Resize(i, s)),
            2 => any::<usize>().prop_map(Edit::Drop),
            2 => size().prop_map(Edit::Push),
            1 => vec(size(), 0..=6).prop_map(Edit::Other),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 100_000,
            rng_algorithm: RngAlgorithm::XorShift,
            ..ProptestConfig::default()
        })]

        /// Ok exactly when the sizes are unknown or equal; the error names the kernel and
        /// the first differing argument with both sizes.
        #[test]
        fn arg_sizes_match_or_name_the_first_difference(
            params in vec(size(), 0..=6),
            known in prop_oneof![9 => Just(true), 1 => Just(false)],
            edit in edit(),
            name in select(vec!["add_f32", "fp8_gemm_e4m3_bf16", "", "k<1>", "\u{2603}"]),
        ) {
            let mut got = params.clone();
            match edit {
                Edit::Same => {}
                Edit::Resize(i, s) if !got.is_empty() => {
                    let n = got.len();
                    got[i % n] = s;
                }
                Edit::Resize(..) => {}
                Edit::Drop(i) if !got.is_empty() => {
                    let n = got.len();
                    got.remove(i % n);
                }
                Edit::Drop(_) => {}
                Edit::Push(s) => got.push(s),
                Edit::Other(v) => got = v,
            }
            let expected = known.then_some(params.as_slice());
            let first = params
                .iter()
                .zip(&got)
                .position(|(p, g)| p != g)
                .or((params.len() != got.len()).then(|| params.len().min(got.len())));
            match (check_arg_sizes(expected, &got, name), first) {
                (Ok(()), first) => prop_assert!(!known || first.is_none()),
                (Err(Error::InvalidArgument(msg)), Some(i)) => {
                    prop_assert!(known);
                    prop_assert!(msg.starts_with(&format!("kernel {name} ")), "{}", msg);
                    prop_assert!(msg.contains(&format!("{params:?}")), "{}", msg);
                    prop_assert!(msg.contains(&format!("{got:?}")), "{}", msg);
                    prop_assert!(msg.contains(&format!(": argument {i} ")), "{}", msg);
                    if let Some(p) = params.get(i) {
                        let named = [format!("parameter {i} {p}"), format!("parameter {i} has {p} bytes")];
                        prop_assert!(named.iter().any(|n| msg.contains(n.as_str())), "{}", msg);
                    }
                    if let Some(g) = got.get(i) {
                        prop_assert!(msg.contains(&format!("has {g} bytes")), "{}", msg);
                    }
                }
                (got_err, first) => prop_assert!(false, "{:?} for first difference {:?}", got_err, first),
            }
        }
    }
}
