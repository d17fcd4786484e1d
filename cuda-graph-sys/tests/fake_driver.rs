//! CPU tests of the loader against a fake libcuda (tests/fake/fake_cuda.c, compiled here with
//! the system C compiler): old drivers, missing entries and misbehaving drivers are errors
//! that name the entry, never panics, and entries a 12.x driver lacks at their newest ABI
//! resolve through their fallbacks.

mod fake;

use cuda_graph_sys::{
    CUdriverProcAddressQueryResult as Status, CUresult, Driver, ENTRIES, ENTRY_COUNT, Fallback,
    LoadError,
};
use fake::{Fake, calls};

fn load(fake: Fake) -> Driver {
    Driver::load(&fake.path()).unwrap_or_else(|e| panic!("the fake driver does not load: {e}"))
}

/// The missing entries, by accessor name (`missing_entries` is in table order).
fn missing_accessors(d: &Driver) -> Vec<&'static str> {
    let errors = d.missing_entries();
    let missing: Vec<_> = ENTRIES
        .iter()
        .filter(|e| d.resolved_version(e.accessor).is_none())
        .map(|e| e.accessor)
        .collect();
    assert_eq!(errors.len(), missing.len());
    missing
}

fn missing_error(d: &Driver, accessor: &str) -> LoadError {
    let i = ENTRIES.iter().position(|e| e.accessor == accessor).unwrap();
    let before = ENTRIES[..i]
        .iter()
        .filter(|e| d.resolved_version(e.accessor).is_none())
        .count();
    d.missing_entries().swap_remove(before)
}

#[test]
fn a_driver_without_get_proc_address_is_too_old() {
    let err = Driver::load(&Fake::new().without_get_proc_address().path()).unwrap_err();
    assert_eq!(err, LoadError::DriverTooOld);
    assert!(err.to_string().contains("cuGetProcAddress_v2"), "{err}");
}

#[test]
fn a_13_0_driver_resolves_every_entry_at_its_newest_abi() {
    let d = load(Fake::new());
    assert_eq!(missing_accessors(&d), Vec::<&str>::new());
    assert_eq!(d.fallbacks(), []);
    for e in ENTRIES {
        assert_eq!(
            d.resolved_version(e.accessor),
            Some(e.version),
            "{}",
            e.accessor
        );
    }
    let mut version = 0;
    // SAFETY: valid out-pointer.
    let rc = unsafe { d.cuDriverGetVersion().unwrap()(&mut version) };
    assert_eq!((rc, version), (CUresult::CUDA_SUCCESS, 13000));
    let mut ms = 0.0;
    let ev = std::ptr::dangling_mut();
    // SAFETY: valid out-pointer; the fake never dereferences event handles.
    let rc = unsafe { d.cuEventElapsedTime().unwrap()(&mut ms, ev, ev) };
    assert_eq!((rc, ms), (CUresult::CUDA_SUCCESS, 1.5));
    assert_eq!(calls(&d, "cuEventElapsedTime@12080"), 1);
    assert_eq!(calls(&d, "cuEventElapsedTime@2000"), 0);
    // Only cuGetProcAddress_v2 was taken by name: no plain export was ever called.
    assert_eq!(calls(&d, "plain"), 0);
}

/// Driver 580 answers a request for an ABI newer than itself with CUDA_ERROR_INVALID_VALUE
/// and writes nothing; a 12.8 driver so answers every 13.0 ABI.
#[test]
fn a_12_8_driver_gets_the_older_abis() {
    let d = load(Fake::new().version(12080));
    assert_eq!(
        missing_accessors(&d),
        ["cuCtxSynchronize", "cuCtxGetDevice"]
    );
    for name in ["cuCtxSynchronize", "cuCtxGetDevice"] {
        let err = missing_error(&d, name);
        let LoadError::Missing {
            name: n,
            version,
            result,
            ..
        } = err
        else {
            panic!("{err:?}");
        };
        assert_eq!(
            (n, version, result),
            (name, 13000, CUresult::CUDA_ERROR_INVALID_VALUE)
        );
        let msg = err.to_string();
        assert!(msg.contains(&format!("lacks {name} (ABI 13000)")), "{msg}");
        assert!(msg.contains("newer than itself"), "{msg}");
    }
    assert_eq!(
        d.fallbacks(),
        [
            Fallback {
                name: "cuCtxSynchronize",
                wanted: 13000,
                resolved: 2000,
                accessor: "cuCtxSynchronize_v2000"
            },
            Fallback {
                name: "cuCtxGetDevice",
                wanted: 13000,
                resolved: 2000,
                accessor: "cuCtxGetDevice_v2000"
            },
        ]
    );
    assert_eq!(d.resolved_version("cuEventElapsedTime"), Some(12080));
    let shown = d.fallbacks()[0].to_string();
    assert_eq!(
        shown,
        "cuCtxSynchronize at ABI 2000 instead of 13000 (through cuCtxSynchronize_v2000)"
    );

    // The older accessors call the older implementations.
    let sync = d.cuCtxSynchronize_v2000().unwrap();
    let retain = d.cuDevicePrimaryCtxRetain().unwrap();
    let set_current = d.cuCtxSetCurrent().unwrap();
    let mut ctx = std::ptr::null_mut();
    // SAFETY: valid out-pointer; then the fake's own context handle.
    unsafe {
        assert_eq!(retain(&mut ctx, 0), CUresult::CUDA_SUCCESS);
        assert_eq!(set_current(ctx), CUresult::CUDA_SUCCESS);
        assert_eq!(sync(), CUresult::CUDA_SUCCESS);
    }
    assert_eq!(calls(&d, "cuCtxSynchronize@2000"), 1);
    assert_eq!(calls(&d, "cuCtxSynchronize@13000"), 0);
}

/// A 12.4 driver lacks cuEventElapsedTime's 12080 ABI too: its fallback, of the same
/// signature, resolves and is called through the entry's own accessor.
#[test]
fn a_12_4_driver_falls_back_to_the_old_elapsed_time() {
    let d = load(Fake::new().version(12040));
    let fallbacks = d.fallbacks();
    assert!(
        fallbacks.contains(&Fallback {
            name: "cuEventElapsedTime",
            wanted: 12080,
            resolved: 2000,
            accessor: "cuEventElapsedTime",
        }),
        "{fallbacks:?}"
    );
    assert_eq!(d.resolved_version("cuEventElapsedTime"), Some(2000));
    let mut ms = 0.0;
    let ev = std::ptr::dangling_mut();
    // SAFETY: valid out-pointer; the fake never dereferences event handles.
    let rc = unsafe { d.cuEventElapsedTime().unwrap()(&mut ms, ev, ev) };
    assert_eq!((rc, ms), (CUresult::CUDA_SUCCESS, 1.5));
    assert_eq!(calls(&d, "cuEventElapsedTime@2000"), 1);
    assert_eq!(calls(&d, "cuEventElapsedTime@12080"), 0);
    // 12.5 ABIs without an older form in the table are errors that name them.
    for name in ["cuCtxCreate", "cuStreamGetCtx"] {
        let msg = missing_error(&d, name).to_string();
        assert!(msg.contains(&format!("lacks {name} (ABI 12050)")), "{msg}");
    }
}

/// The same through the other answer a driver may give: status VERSION_NOT_SUFFICIENT.
#[test]
fn version_not_sufficient_for_every_13_0_abi_picks_the_fallbacks() {
    let d = load(Fake::new().too_new("*@13000,cuEventElapsedTime@12080"));
    assert_eq!(
        missing_accessors(&d),
        ["cuCtxSynchronize", "cuCtxGetDevice"]
    );
    let err = missing_error(&d, "cuCtxSynchronize");
    assert!(
        matches!(
            err,
            LoadError::Missing {
                name: "cuCtxSynchronize",
                version: 13000,
                result: CUresult::CUDA_SUCCESS,
                status: Status::CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT,
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("older than this ABI version"),
        "{err}"
    );
    let names: Vec<_> = d
        .fallbacks()
        .iter()
        .map(|f| (f.name, f.wanted, f.resolved, f.accessor))
        .collect();
    assert_eq!(
        names,
        [
            ("cuCtxSynchronize", 13000, 2000, "cuCtxSynchronize_v2000"),
            ("cuCtxGetDevice", 13000, 2000, "cuCtxGetDevice_v2000"),
            ("cuEventElapsedTime", 12080, 2000, "cuEventElapsedTime"),
        ]
    );
}

#[test]
fn missing_entries_are_errors_that_name_them() {
    let d = load(Fake::new().missing("cuGraphLaunch,cuEventElapsedTime,cuCtxSynchronize"));
    assert_eq!(
        missing_accessors(&d),
        [
            "cuCtxSynchronize",
            "cuCtxSynchronize_v2000",
            "cuEventElapsedTime",
            "cuGraphLaunch"
        ]
    );
    assert_eq!(d.fallbacks(), []);
    let err = d.cuGraphLaunch().unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::Missing {
                name: "cuGraphLaunch",
                version: 10000,
                result: CUresult::CUDA_SUCCESS,
                status: Status::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND,
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("no such symbol"), "{err}");
    // After its fallback failed too, the error names the last ABI tried.
    let err = d.cuEventElapsedTime().unwrap_err();
    assert!(
        err.to_string()
            .contains("lacks cuEventElapsedTime (ABI 2000)"),
        "{err}"
    );
    assert!(d.cuCtxSynchronize().is_err() && d.cuCtxSynchronize_v2000().is_err());
    // Everything else resolved.
    assert!(d.cuGraphUpload().is_ok() && d.cuCtxGetDevice().is_ok());
}

/// A driver with nothing at all: every accessor is an error naming its entry.
#[test]
fn a_driver_without_any_entry_names_every_one() {
    let d = load(Fake::new().missing("*"));
    let errors = d.missing_entries();
    assert_eq!(errors.len(), ENTRY_COUNT);
    for (e, err) in ENTRIES.iter().zip(&errors) {
        let msg = err.to_string();
        assert!(msg.contains(&format!("lacks {} (ABI ", e.name)), "{msg}");
    }
    assert!(d.cuInit().is_err());
}

/// A driver that returns an error code or a null pointer along with SUCCESS is not trusted.
#[test]
fn inconsistent_answers_are_rejected() {
    let d = load(
        Fake::new()
            .resolve_error("cuGraphLaunch")
            .null("cuGraphUpload"),
    );
    assert_eq!(missing_accessors(&d), ["cuGraphUpload", "cuGraphLaunch"]);
    let err = d.cuGraphLaunch().unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::Missing {
                name: "cuGraphLaunch",
                result: CUresult::CUDA_ERROR_UNKNOWN,
                status: Status::CU_GET_PROC_ADDRESS_SUCCESS,
                ..
            }
        ),
        "{err:?}"
    );
    let err = d.cuGraphUpload().unwrap_err();
    assert!(
        err.to_string().contains("lacks cuGraphUpload (ABI 11010)"),
        "{err}"
    );
}

/// Entries that resolve but fail: the loader hands them out, and the call's result is the
/// driver's error.
#[test]
fn failing_entries_return_their_error() {
    let d = load(Fake::new().failing("cuInit,cuCtxSynchronize"));
    assert_eq!(missing_accessors(&d), Vec::<&str>::new());
    // SAFETY: flags 0; a null context is the current one for the 13.0 ABI.
    unsafe {
        assert_eq!(d.cuInit().unwrap()(0), CUresult::CUDA_ERROR_LAUNCH_FAILED);
        assert_eq!(
            d.cuCtxSynchronize().unwrap()(std::ptr::null_mut()),
            CUresult::CUDA_ERROR_LAUNCH_FAILED
        );
    }
    assert_eq!(calls(&d, "cuCtxSynchronize@13000"), 1);
}
