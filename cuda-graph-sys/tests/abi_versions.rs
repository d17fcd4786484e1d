//! CPU test: every table entry asks the driver for the newest ABI that the `cudaTypedefs.h`
//! the bindings were generated from defines (up to the header's CUDA_VERSION).

use std::collections::{HashMap, HashSet};

use cuda_graph_sys::{CUDA_VERSION, ENTRIES};

const TYPEDEFS_H: &str = include_str!(env!("CUDA_GRAPH_SYS_TYPEDEFS_H"));

/// name -> every ABI version with a default-stream (not _ptsz/_ptds) typedef in the header.
fn header_versions() -> HashMap<String, Vec<u32>> {
    let mut map: HashMap<String, Vec<u32>> = HashMap::new();
    for line in TYPEDEFS_H.lines() {
        let Some(rest) = line.split("(CUDAAPI *PFN_").nth(1) else {
            continue;
        };
        let Some(typedef) = rest.split(')').next() else {
            continue;
        };
        let Some((name, version)) = typedef.rsplit_once("_v") else {
            continue;
        };
        if let Ok(v) = version.parse::<u32>() {
            map.entry(name.to_owned()).or_default().push(v);
        }
    }
    map
}

#[test]
fn header_was_parsed() {
    let versions = header_versions();
    assert!(versions.len() > 300, "only {} names parsed", versions.len());
    assert_eq!(versions["cuGraphAddNode"], vec![12020, 12030]);
}

#[test]
fn every_entry_requests_the_newest_abi_of_the_header() {
    let versions = header_versions();
    let mut wrong = Vec::new();
    for e in ENTRIES {
        let Some(vs) = versions.get(e.name) else {
            wrong.push(format!("{}: no PFN typedef in cudaTypedefs.h", e.name));
            continue;
        };
        if !vs.contains(&e.version) {
            wrong.push(format!("{}: header has no version {}", e.name, e.version));
        }
        let newest = vs.iter().copied().filter(|&v| v <= CUDA_VERSION).max();
        if newest != Some(e.version) {
            wrong.push(format!(
                "{}: table asks for {} but the newest ABI <= {CUDA_VERSION} is {newest:?}",
                e.name, e.version
            ));
        }
        assert_eq!(e.typedef, format!("PFN_{}_v{}", e.name, e.version));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn entries_are_unique() {
    let mut seen = HashSet::new();
    for e in ENTRIES {
        assert!(seen.insert(e.name), "{} appears twice", e.name);
    }
}

/// The versions the project's driver facts name, and the pitfalls they warn about.
#[test]
fn graph_entries_match_the_driver_facts() {
    let expect = [
        ("cuStreamBeginCapture", 10010),
        ("cuStreamBeginCaptureToGraph", 12030),
        ("cuStreamEndCapture", 10000),
        ("cuStreamIsCapturing", 10000),
        ("cuStreamGetCaptureInfo", 12030),
        ("cuStreamUpdateCaptureDependencies", 12030),
        ("cuThreadExchangeStreamCaptureMode", 10010),
        ("cuGraphAddNode", 12030),
        ("cuGraphGetEdges", 12030),
        ("cuGraphAddDependencies", 12030),
        ("cuGraphRemoveDependencies", 12030),
        ("cuGraphNodeGetDependencies", 12030),
        ("cuGraphNodeGetDependentNodes", 12030),
        ("cuGraphAddKernelNode", 12000),
        ("cuGraphKernelNodeGetParams", 12000),
        ("cuGraphKernelNodeSetParams", 12000),
        ("cuGraphExecKernelNodeSetParams", 12000),
        ("cuGraphInstantiateWithFlags", 11040),
        ("cuGraphInstantiateWithParams", 12000),
        ("cuGraphExecUpdate", 12000),
        ("cuGraphNodeSetParams", 12020),
        ("cuGraphExecNodeSetParams", 12020),
        ("cuGraphConditionalHandleCreate", 12030),
        ("cuGraphUpload", 11010),
        ("cuGraphLaunch", 10000),
        ("cuCtxCreate", 12050),
    ];
    for (name, version) in expect {
        let e = ENTRIES
            .iter()
            .find(|e| e.name == name)
            .unwrap_or_else(|| panic!("{name} is not in the table"));
        assert_eq!(e.version, version, "{name}");
    }
    // cuGetProcAddress("cuGraphInstantiate", v) yields the legacy 5-argument function at
    // every v: the table must reach instantiation only through the WithFlags/WithParams names.
    assert!(!ENTRIES.iter().any(|e| e.name == "cuGraphInstantiate"));
}
