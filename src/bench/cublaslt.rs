//! cuBLASLt, loaded at run time, as the FP8 GEMM yardstick of `bench gemm`. Only the
//! benchmark uses it; the library never does.
//!
//! The declarations below follow `cublasLt.h` of CUDA 13 (enum values and struct layouts
//! checked against the header); only the calls the benchmark needs are bound.

use std::ffi::{CString, c_void};

use cuda_graph::sys::CUstream;

use super::BenchResult;

type Status = i32;
type Handle = *mut c_void;
type Desc = *mut c_void;

// cublasComputeType_t, cudaDataType_t, cublasOperation_t, attribute ids (cublasLt.h).
const CUBLAS_COMPUTE_32F: i32 = 68;
const CUDA_R_32F: i32 = 0;
const CUDA_R_16BF: i32 = 14;
const CUDA_R_8F_E4M3: i32 = 28;
const CUBLAS_OP_N: i32 = 0;
const CUBLAS_OP_T: i32 = 1;
const DESC_TRANSA: i32 = 3;
const DESC_TRANSB: i32 = 4;
const DESC_A_SCALE_POINTER: i32 = 17;
const DESC_B_SCALE_POINTER: i32 = 18;
const DESC_FAST_ACCUM: i32 = 25;
const PREF_MAX_WORKSPACE_BYTES: i32 = 1;

/// `cublasLtMatmulHeuristicResult_t`: the 64-byte algo, workspace size, state, waves, 4
/// reserved ints (96 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
struct Heuristic {
    algo: [u64; 8],
    workspace_size: usize,
    state: Status,
    waves: f32,
    reserved: [i32; 4],
}

struct Api {
    create: unsafe extern "C" fn(*mut Handle) -> Status,
    desc_create: unsafe extern "C" fn(*mut Desc, i32, i32) -> Status,
    desc_set: unsafe extern "C" fn(Desc, i32, *const c_void, usize) -> Status,
    desc_destroy: unsafe extern "C" fn(Desc) -> Status,
    layout_create: unsafe extern "C" fn(*mut Desc, i32, u64, u64, i64) -> Status,
    layout_destroy: unsafe extern "C" fn(Desc) -> Status,
    pref_create: unsafe extern "C" fn(*mut Desc) -> Status,
    pref_set: unsafe extern "C" fn(Desc, i32, *const c_void, usize) -> Status,
    pref_destroy: unsafe extern "C" fn(Desc) -> Status,
    heuristic: unsafe extern "C" fn(
        Handle,
        Desc,
        Desc,
        Desc,
        Desc,
        Desc,
        Desc,
        i32,
        *mut Heuristic,
        *mut i32,
    ) -> Status,
    #[allow(clippy::type_complexity)]
    matmul: unsafe extern "C" fn(
        Handle,
        Desc,
        *const c_void,
        *const c_void,
        Desc,
        *const c_void,
        Desc,
        *const c_void,
        *const c_void,
        Desc,
        *mut c_void,
        Desc,
        *const [u64; 8],
        *mut c_void,
        usize,
        CUstream,
    ) -> Status,
}

/// Where libcublasLt may be: the loader's paths, the CUDA toolkit, and the wheels PyTorch
/// ships (`nvidia/cu13/lib`, `nvidia/cublas/lib` under a site-packages directory).
fn candidates() -> Vec<String> {
    let mut out: Vec<String> = std::env::var("CUBLASLT_PATH").into_iter().collect();
    for soname in ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"] {
        out.push(soname.into());
        for dir in [
            "/usr/local/cuda/lib64",
            "/usr/local/cuda/targets/x86_64-linux/lib",
        ] {
            out.push(format!("{dir}/{soname}"));
        }
    }
    for root in ["/usr/local/lib", "/usr/lib", "/opt/conda/lib"] {
        let Ok(entries) = std::fs::read_dir(root) else {
            continue;
        };
        for py in entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        {
            for site in ["dist-packages", "site-packages"] {
                for lib in ["nvidia/cu13/lib", "nvidia/cublas/lib"] {
                    let dir = py.path().join(site).join(lib);
                    for soname in ["libcublasLt.so.13", "libcublasLt.so.12"] {
                        out.push(dir.join(soname).to_string_lossy().into_owned());
                    }
                }
            }
        }
    }
    out
}

/// Reinterprets a symbol address as the function pointer type `F`.
///
/// # Safety
/// `F` must be a function pointer type matching the symbol's C signature.
unsafe fn as_fn<F: Copy>(p: *mut c_void) -> F {
    const { assert!(size_of::<F>() == size_of::<*mut c_void>()) };
    // SAFETY: same size; the caller vouches for the signature.
    unsafe { std::mem::transmute_copy(&p) }
}

/// An open cuBLASLt with one handle and a workspace.
pub struct CublasLt {
    api: Api,
    handle: Handle,
    workspace: cuda_graph::DeviceBuffer<u8>,
    /// Which library file was opened.
    pub path: String,
}

/// An FP8 GEMM planned once (descriptors and algorithm) and run many times.
pub struct Plan<'a> {
    lt: &'a CublasLt,
    desc: Desc,
    layouts: [Desc; 3],
    algo: Heuristic,
    m: usize,
    n: usize,
}

fn ok(what: &str, s: Status) -> BenchResult<()> {
    if s == 0 {
        Ok(())
    } else {
        Err(format!("cuBLASLt {what} failed with status {s}").into())
    }
}

impl CublasLt {
    /// Opens the library (first candidate that loads) and creates a handle and a 32 MiB
    /// workspace.
    pub fn open(ctx: &std::sync::Arc<cuda_graph::Context>) -> BenchResult<CublasLt> {
        let (lib, path) = candidates()
            .into_iter()
            .find_map(|p| {
                let c = CString::new(p.clone()).ok()?;
                // SAFETY: dlopen of a NUL-terminated path; the handle is kept for the process.
                let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
                (!h.is_null()).then_some((h, p))
            })
            .ok_or("cuBLASLt not found (set CUBLASLT_PATH to libcublasLt.so)")?;
        let sym = |name: &str| -> BenchResult<*mut c_void> {
            let c = CString::new(name)?;
            // SAFETY: lib is a live handle; name is NUL-terminated.
            let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
            if p.is_null() {
                Err(format!("{path} lacks {name}").into())
            } else {
                Ok(p)
            }
        };
        // SAFETY: each symbol has the signature declared in `Api` (cublasLt.h of CUDA 12/13).
        let api = unsafe {
            Api {
                create: as_fn(sym("cublasLtCreate")?),
                desc_create: as_fn(sym("cublasLtMatmulDescCreate")?),
                desc_set: as_fn(sym("cublasLtMatmulDescSetAttribute")?),
                desc_destroy: as_fn(sym("cublasLtMatmulDescDestroy")?),
                layout_create: as_fn(sym("cublasLtMatrixLayoutCreate")?),
                layout_destroy: as_fn(sym("cublasLtMatrixLayoutDestroy")?),
                pref_create: as_fn(sym("cublasLtMatmulPreferenceCreate")?),
                pref_set: as_fn(sym("cublasLtMatmulPreferenceSetAttribute")?),
                pref_destroy: as_fn(sym("cublasLtMatmulPreferenceDestroy")?),
                heuristic: as_fn(sym("cublasLtMatmulAlgoGetHeuristic")?),
                matmul: as_fn(sym("cublasLtMatmul")?),
            }
        };
        let mut handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        ok("create", unsafe { (api.create)(&mut handle) })?;
        let workspace = cuda_graph::DeviceBuffer::alloc(ctx, 32 << 20)?;
        Ok(CublasLt {
            api,
            handle,
            workspace,
            path,
        })
    }

    /// Plans `D[M,N] (row-major bf16) = sa*sb * A[M,K] . B[N,K]^T` with E4M3 operands, both
    /// K-major: in cuBLASLt's column-major terms `D^T[N,M] = op(B)[N,K] . op(A)[K,M]` with
    /// B transposed and A not (the "TN" layout FP8 requires). `scales` are device pointers
    /// to the two f32 scale_inv values.
    pub fn plan(&self, m: usize, n: usize, k: usize, scales: [u64; 2]) -> BenchResult<Plan<'_>> {
        self.plan_with(m, n, k, scales, false)
    }

    /// [`plan`](Self::plan) with cuBLASLt's FP8 fast accumulation on or off
    /// (`CUBLASLT_MATMUL_DESC_FAST_ACCUM`, off by default).
    pub fn plan_with(
        &self,
        m: usize,
        n: usize,
        k: usize,
        scales: [u64; 2],
        fast: bool,
    ) -> BenchResult<Plan<'_>> {
        let a = &self.api;
        let mut desc = std::ptr::null_mut();
        let mut layouts = [std::ptr::null_mut(); 3];
        let mut pref = std::ptr::null_mut();
        // SAFETY: valid out-pointers and attribute buffers of the sizes passed.
        unsafe {
            ok(
                "desc create",
                (a.desc_create)(&mut desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
            )?;
            let set = |attr: i32, v: *const c_void, size: usize| {
                ok("desc set", (a.desc_set)(desc, attr, v, size))
            };
            let (trans, no_trans) = (CUBLAS_OP_T, CUBLAS_OP_N);
            set(DESC_TRANSA, (&raw const trans).cast(), 4)?;
            set(DESC_TRANSB, (&raw const no_trans).cast(), 4)?;
            set(DESC_A_SCALE_POINTER, (&raw const scales[1]).cast(), 8)?;
            set(DESC_B_SCALE_POINTER, (&raw const scales[0]).cast(), 8)?;
            let fast = i8::from(fast);
            set(DESC_FAST_ACCUM, (&raw const fast).cast(), 1)?;
            // Lt's A is our B ([N,K] row-major = K x N column-major, transposed to N x K); Lt's
            // B is our A ([M,K] row-major = K x M column-major); D is N x M column-major.
            ok(
                "layout A",
                (a.layout_create)(
                    &mut layouts[0],
                    CUDA_R_8F_E4M3,
                    k as u64,
                    n as u64,
                    k as i64,
                ),
            )?;
            ok(
                "layout B",
                (a.layout_create)(
                    &mut layouts[1],
                    CUDA_R_8F_E4M3,
                    k as u64,
                    m as u64,
                    k as i64,
                ),
            )?;
            ok(
                "layout D",
                (a.layout_create)(&mut layouts[2], CUDA_R_16BF, n as u64, m as u64, n as i64),
            )?;
            ok("pref create", (a.pref_create)(&mut pref))?;
            let ws = self.workspace.bytes() as u64;
            ok(
                "pref set",
                (a.pref_set)(pref, PREF_MAX_WORKSPACE_BYTES, (&raw const ws).cast(), 8),
            )?;
            let mut results = [Heuristic {
                algo: [0; 8],
                workspace_size: 0,
                state: 0,
                waves: 0.0,
                reserved: [0; 4],
            }; 1];
            let mut count = 0;
            let rc = (a.heuristic)(
                self.handle,
                desc,
                layouts[0],
                layouts[1],
                layouts[2],
                layouts[2],
                pref,
                1,
                results.as_mut_ptr(),
                &mut count,
            );
            (a.pref_destroy)(pref);
            ok("heuristic", rc)?;
            if count < 1 || results[0].state != 0 {
                return Err(format!("cuBLASLt has no FP8 algorithm for {m}x{n}x{k}").into());
            }
            Ok(Plan {
                lt: self,
                desc,
                layouts,
                algo: results[0],
                m,
                n,
            })
        }
    }
}

impl Plan<'_> {
    /// Enqueues the GEMM on `stream`: `a` is `[M,K]`, `b` `[N,K]` (E4M3), `d` `[M,N]` bf16.
    pub fn run(&self, stream: CUstream, a: u64, b: u64, d: u64) -> BenchResult<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let api = &self.lt.api;
        let _ = (self.m, self.n);
        // SAFETY: descriptors planned for exactly these shapes; the device pointers hold them;
        // the workspace outlives the call's stream work (it lives as long as `self.lt`).
        let rc = unsafe {
            (api.matmul)(
                self.lt.handle,
                self.desc,
                (&raw const alpha).cast(),
                b as *const c_void,
                self.layouts[0],
                a as *const c_void,
                self.layouts[1],
                (&raw const beta).cast(),
                d as *const c_void,
                self.layouts[2],
                d as *mut c_void,
                self.layouts[2],
                &self.algo.algo,
                self.lt.workspace.as_raw() as *mut c_void,
                self.lt.workspace.bytes(),
                stream,
            )
        };
        ok("matmul", rc)
    }
}

impl Drop for Plan<'_> {
    fn drop(&mut self) {
        // SAFETY: created in `plan`, destroyed once.
        unsafe {
            (self.lt.api.desc_destroy)(self.desc);
            for l in self.layouts {
                (self.lt.api.layout_destroy)(l);
            }
        }
    }
}
