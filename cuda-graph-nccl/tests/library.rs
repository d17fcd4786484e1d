//! The NCCL library on the CPU: opening it, its version, unique ids and their transports.
//! The library is the one `scripts/setup.sh` installs (`NCCL_HOME`'s when that is set).

use std::path::PathBuf;
use std::time::Duration;

use cuda_graph_nccl::{Error, Nccl, UniqueId, Version};

/// The NCCL to open: the one `CUDA_GRAPH_NCCL_LIBRARY` names (the GPU machines' suite sets
/// it), else `NCCL_HOME/lib`, else the workspace's `.toolchain` (what set-up installs).
fn installed() -> PathBuf {
    if let Some(lib) = std::env::var_os(cuda_graph_nccl::LIBRARY_VAR).filter(|v| !v.is_empty()) {
        return PathBuf::from(lib);
    }
    match std::env::var_os("NCCL_HOME") {
        Some(home) => PathBuf::from(home).join("lib"),
        None => {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.toolchain/nccl/nvidia/nccl/lib")
        }
    }
}

#[test]
fn the_installed_library_opens_at_the_header_version() {
    let lib = Nccl::open(installed())
        .unwrap_or_else(|e| panic!("{e} (run scripts/setup.sh, or set NCCL_HOME)"));
    assert_eq!(lib.version(), Version::header());
    assert!(lib.version() >= cuda_graph_nccl::MIN_VERSION);
    assert!(lib.source().ends_with("libnccl.so.2"));
}

#[test]
fn unique_ids_survive_hex_and_files() {
    let mut bytes = [0u8; UniqueId::BYTES];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i * 37 + 11) as u8;
    }
    let id = UniqueId::from_bytes(&bytes).unwrap();
    assert_eq!(UniqueId::from_hex(&id.to_hex()).unwrap(), id);
    assert_eq!(
        UniqueId::from_hex(&format!("  {}\n", id.to_hex())).unwrap(),
        id
    );
    for bad in [
        String::new(),
        "zz".repeat(UniqueId::BYTES),
        id.to_hex()[2..].to_string(),
    ] {
        assert!(
            matches!(UniqueId::from_hex(&bad), Err(Error::InvalidArgument(_))),
            "{bad:?}"
        );
    }
    assert!(matches!(
        UniqueId::from_bytes(&bytes[1..]),
        Err(Error::InvalidArgument(_))
    ));

    let dir = std::env::temp_dir().join(format!("nccl-id-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("id");
    // A reader that starts first waits for the writer.
    let reader = {
        let path = path.clone();
        std::thread::spawn(move || UniqueId::wait_for_file(&path, Duration::from_secs(10)))
    };
    std::thread::sleep(Duration::from_millis(50));
    id.publish(&path).unwrap();
    assert_eq!(reader.join().unwrap().unwrap(), id);
    // Nothing but the id is left beside it.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    let missing = dir.join("never");
    let err = UniqueId::wait_for_file(&missing, Duration::from_millis(50)).unwrap_err();
    assert!(err.to_string().contains("never"), "{err}");
    std::fs::write(&missing, "not an id").unwrap();
    assert!(UniqueId::wait_for_file(&missing, Duration::from_secs(1)).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}
