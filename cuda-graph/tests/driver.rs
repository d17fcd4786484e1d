//! GPU tests of initialisation, device queries and feature gates.

use cuda_graph::Error;
use cuda_graph::driver::{self, Device, DriverVersion, Feature};

#[test]
#[ignore = "needs a CUDA device"]
fn device_queries_are_consistent() {
    driver::init().expect("cuInit");
    let version = driver::driver_version().unwrap();
    assert!(version >= DriverVersion(12040), "driver {version}");
    let count = Device::count().unwrap();
    assert!(count >= 1);
    let dev = Device::get(0).unwrap();
    assert!(!dev.name().unwrap().is_empty());
    let (major, _minor) = dev.compute_capability().unwrap();
    assert!(major >= 7, "compute capability {major}");
    assert!(dev.multiprocessor_count().unwrap() > 0);
    assert!(dev.total_memory().unwrap() > (1 << 30));
    match Device::get(count) {
        Err(Error::NoDevice { ordinal, count: c }) => assert_eq!((ordinal, c), (count, count)),
        other => panic!("expected NoDevice, got {other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn feature_support_matches_the_driver_version() {
    let version = driver::driver_version().unwrap();
    let dev = Device::get(0).unwrap();
    for f in [
        Feature::ConditionalIfWhile,
        Feature::ConditionalIfElseSwitch,
    ] {
        assert_eq!(dev.supports(f).unwrap(), version >= f.min_driver(), "{f:?}");
    }
    let (major, _) = dev.compute_capability().unwrap();
    assert_eq!(
        dev.supports(Feature::ProgrammaticDependentLaunch).unwrap(),
        major >= 9 && version >= DriverVersion(12030)
    );
}
