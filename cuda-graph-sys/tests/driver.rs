//! GPU tests of the raw table: every entry resolves on the installed driver, and a kernel
//! compiled by nvcc loads, launches and computes the right result through raw calls only.

use std::ffi::c_void;
use std::ptr;

use cuda_graph_sys::*;

/// The nvcc-compiled `axpy` kernel (tests/kernels/add.cu); empty when the build had no nvcc.
const ADD_FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/add.fatbin"));

#[track_caller]
fn ok(rc: CUresult) {
    assert_eq!(
        rc,
        CUresult::CUDA_SUCCESS,
        "driver call failed with {}",
        rc.0
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_entry_resolves() {
    let d = driver().expect("libcuda loads");
    let missing = d.missing_entries();
    assert!(
        missing.is_empty(),
        "{} of {ENTRY_COUNT} entries missing:\n{}",
        missing.len(),
        missing
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    );
    let mut version = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { d.cuDriverGetVersion().unwrap()(&mut version) });
    assert!(
        version >= CUDA_VERSION as i32,
        "driver {version} older than header"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn unknown_entry_is_none_not_a_crash() {
    let d = driver().expect("libcuda loads");
    // SAFETY: the pointer is never called.
    let p = unsafe { d.proc_address(c"cuNoSuchFunctionAnywhere", 12000) };
    assert!(p.is_none());
}

/// Loads the fatbin, launches axpy with both cuLaunchKernel and cuLaunchKernelEx, and checks
/// every element against the host computation.
#[test]
#[ignore = "needs a CUDA device"]
fn nvcc_kernel_runs_through_the_raw_table() {
    assert!(
        !ADD_FATBIN.is_empty(),
        "built without nvcc: no test kernel was compiled"
    );
    let d = driver().expect("libcuda loads");
    // SAFETY: every call below gets valid pointers and handles created in this test, in the
    // order the driver API requires; buffers outlive the synchronous calls that use them.
    unsafe {
        ok(d.cuInit().unwrap()(0));
        let mut dev: CUdevice = 0;
        ok(d.cuDeviceGet().unwrap()(&mut dev, 0));
        let mut ctx: CUcontext = ptr::null_mut();
        ok(d.cuDevicePrimaryCtxRetain().unwrap()(&mut ctx, dev));
        ok(d.cuCtxSetCurrent().unwrap()(ctx));

        let mut module: CUmodule = ptr::null_mut();
        ok(d.cuModuleLoadData().unwrap()(
            &mut module,
            ADD_FATBIN.as_ptr().cast(),
        ));
        let mut func: CUfunction = ptr::null_mut();
        ok(d.cuModuleGetFunction().unwrap()(
            &mut func,
            module,
            c"axpy".as_ptr(),
        ));

        let mut stream: CUstream = ptr::null_mut();
        ok(d.cuStreamCreate().unwrap()(
            &mut stream,
            CUstream_flags::CU_STREAM_NON_BLOCKING.0,
        ));

        // An odd length, so the last block is partial.
        let n: u32 = 100_003;
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 * 0.25 - 100.0)
            .collect();
        let y0: Vec<f32> = (0..n).map(|i| ((i * 104_729) % 977) as f32 * 0.5).collect();
        let bytes = n as usize * 4;
        let (mut dx, mut dy): (CUdeviceptr, CUdeviceptr) = (0, 0);
        ok(d.cuMemAlloc().unwrap()(&mut dx, bytes));
        ok(d.cuMemAlloc().unwrap()(&mut dy, bytes));
        ok(d.cuMemcpyHtoD().unwrap()(dx, x.as_ptr().cast(), bytes));
        ok(d.cuMemcpyHtoD().unwrap()(dy, y0.as_ptr().cast(), bytes));

        // Launch 1: y = 2x + y through cuLaunchKernel.
        let mut a = 2.0f32;
        let mut args: [*mut c_void; 4] = [
            (&raw mut a).cast(),
            (&raw mut dx).cast(),
            (&raw mut dy).cast(),
            (&raw const n).cast_mut().cast(),
        ];
        let grid = n.div_ceil(256);
        ok(d.cuLaunchKernel().unwrap()(
            func,
            grid,
            1,
            1,
            256,
            1,
            1,
            0,
            stream,
            args.as_mut_ptr(),
            ptr::null_mut(),
        ));

        // Launch 2: y = -0.5x + y through cuLaunchKernelEx with a priority attribute.
        let mut a2 = -0.5f32;
        args[0] = (&raw mut a2).cast();
        let mut attr = CUlaunchAttribute {
            id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PRIORITY,
            ..Default::default()
        };
        attr.value.priority = 0;
        let config = CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: 256,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: stream,
            attrs: &mut attr,
            numAttrs: 1,
        };
        ok(d.cuLaunchKernelEx().unwrap()(
            &config,
            func,
            args.as_mut_ptr(),
            ptr::null_mut(),
        ));
        ok(d.cuStreamSynchronize().unwrap()(stream));

        let mut y = vec![f32::NAN; n as usize];
        ok(d.cuMemcpyDtoH().unwrap()(y.as_mut_ptr().cast(), dy, bytes));
        for i in 0..n as usize {
            let want = -0.5f32 * x[i] + (2.0f32 * x[i] + y0[i]);
            assert_eq!(
                y[i].to_bits(),
                want.to_bits(),
                "element {i}: {} != {want}",
                y[i]
            );
        }

        ok(d.cuMemFree().unwrap()(dx));
        ok(d.cuMemFree().unwrap()(dy));
        ok(d.cuStreamDestroy().unwrap()(stream));
        ok(d.cuModuleUnload().unwrap()(module));
        ok(d.cuDevicePrimaryCtxRelease().unwrap()(dev));
    }
}
