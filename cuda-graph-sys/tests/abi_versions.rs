//! CPU test: every table entry asks the driver for the newest ABI that the `cudaTypedefs.h`
//! the bindings were generated from defines (up to the header's CUDA_VERSION), together with
//! the declarations `compat.h` adds for an older 12.x header; fallback versions and older-ABI
//! accessors name real, older typedefs of the same entry.

use std::collections::{HashMap, HashSet};

use cuda_graph_sys::{CUDA_VERSION, ENTRIES, EntrySpec};

const TYPEDEFS_H: &str = include_str!(env!("CUDA_GRAPH_SYS_TYPEDEFS_H"));
const COMPAT_H: &str = include_str!("../compat.h");

/// typedef name (`cuCtxSynchronize_v13000`) -> its declaration's parameter list, for every
/// default-stream (not _ptsz/_ptds) `PFN_*_v<digits>` typedef of a header.
fn typedefs(header: &str) -> HashMap<(String, u32), String> {
    let mut map = HashMap::new();
    for line in header.lines() {
        let Some(rest) = line.split("(CUDAAPI *PFN_").nth(1) else {
            continue;
        };
        let Some((typedef, params)) = rest.split_once(')') else {
            continue;
        };
        let Some((name, version)) = typedef.rsplit_once("_v") else {
            continue;
        };
        if let Ok(v) = version.parse::<u32>() {
            let params = params.trim().trim_end_matches(';').trim();
            map.insert((name.to_owned(), v), params.to_owned());
        }
    }
    map
}

/// name -> every ABI version with a typedef in the header or in compat.h, ascending.
fn versions(
    header: &HashMap<(String, u32), String>,
    compat: &HashMap<(String, u32), String>,
) -> HashMap<String, Vec<u32>> {
    let mut map: HashMap<String, Vec<u32>> = HashMap::new();
    for (name, v) in header.keys().chain(compat.keys()) {
        map.entry(name.clone()).or_default().push(*v);
    }
    for vs in map.values_mut() {
        vs.sort_unstable();
        vs.dedup();
    }
    map
}

/// The newest version an entry may ask for: the header's own, or what compat.h declares
/// for an older header.
fn ceiling(compat: &HashMap<(String, u32), String>) -> u32 {
    compat
        .keys()
        .map(|(_, v)| *v)
        .chain([CUDA_VERSION])
        .max()
        .unwrap_or(CUDA_VERSION)
}

/// The parameter list of `PFN_<name>_v<version>` in the header, else in compat.h.
fn params<'a>(
    header: &'a HashMap<(String, u32), String>,
    compat: &'a HashMap<(String, u32), String>,
    name: &str,
    version: u32,
) -> Option<&'a str> {
    let key = (name.to_owned(), version);
    header
        .get(&key)
        .or_else(|| compat.get(&key))
        .map(String::as_str)
}

fn newest_line<'a>(e: &EntrySpec) -> Option<&'a EntrySpec> {
    ENTRIES.iter().find(|n| n.accessor == e.name)
}

#[test]
fn header_was_parsed() {
    let header = typedefs(TYPEDEFS_H);
    let versions = versions(&header, &HashMap::new());
    assert!(versions.len() > 300, "only {} names parsed", versions.len());
    assert!(
        versions["cuGraphAddNode"].ends_with(&[12020, 12030]),
        "{:?}",
        versions["cuGraphAddNode"]
    );
    assert_eq!(
        params(&header, &HashMap::new(), "cuCtxSynchronize", 2000),
        Some("(void)")
    );
    let compat = typedefs(COMPAT_H);
    assert!(
        compat.len() >= 5,
        "compat.h: only {} typedefs parsed",
        compat.len()
    );
}

/// With the 13.0 header every declaration of compat.h is also the header's; with an older
/// one, those the header has must be the same. Either way compat.h never changes an ABI.
#[test]
fn compat_declarations_match_the_header() {
    let header = typedefs(TYPEDEFS_H);
    let compat = typedefs(COMPAT_H);
    let mut wrong = Vec::new();
    for ((name, v), p) in &compat {
        if let Some(h) = header.get(&(name.clone(), *v)) {
            if h != p {
                wrong.push(format!("PFN_{name}_v{v}: compat.h {p} but the header {h}"));
            }
        } else {
            assert!(
                *v > CUDA_VERSION,
                "compat.h declares PFN_{name}_v{v}, which a CUDA {CUDA_VERSION} header should have"
            );
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn every_entry_requests_the_newest_abi_of_the_header() {
    let header = typedefs(TYPEDEFS_H);
    let compat = typedefs(COMPAT_H);
    let versions = versions(&header, &compat);
    let ceiling = ceiling(&compat);
    let mut wrong = Vec::new();
    for e in ENTRIES {
        assert_eq!(e.typedef, format!("PFN_{}_v{}", e.name, e.version));
        let Some(vs) = versions.get(e.name) else {
            wrong.push(format!("{}: no PFN typedef in cudaTypedefs.h", e.name));
            continue;
        };
        if !vs.contains(&e.version) {
            wrong.push(format!("{}: header has no version {}", e.name, e.version));
        }
        if e.accessor != e.name {
            // Older-ABI lines are checked in `older_abi_accessors_...`.
            continue;
        }
        let newest = vs.iter().copied().filter(|&v| v <= ceiling).max();
        if newest != Some(e.version) {
            wrong.push(format!(
                "{}: table asks for {} but the newest ABI <= {ceiling} is {newest:?}",
                e.name, e.version
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A fallback is an older typedef of the same entry with the same parameters (the compiler
/// proves the Rust types equal; this checks the C declarations too).
#[test]
fn fallbacks_are_older_abis_with_the_same_signature() {
    let header = typedefs(TYPEDEFS_H);
    let compat = typedefs(COMPAT_H);
    let mut wrong = Vec::new();
    for e in ENTRIES {
        let own = params(&header, &compat, e.name, e.version);
        let mut newer = e.version;
        for v in e.versions().skip(1) {
            assert!(v < newer, "{}: fallback {v} not older than {newer}", e.name);
            newer = v;
            match params(&header, &compat, e.name, v) {
                None => wrong.push(format!("{}: header has no fallback version {v}", e.name)),
                Some(p) if Some(p) != own => wrong.push(format!(
                    "{}: fallback {v} takes {p}, the entry {own:?}",
                    e.name
                )),
                Some(_) => {}
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// An older-ABI accessor is `<name>_v<version>`, names an ABI older than the entry's newest
/// line, and exists because the signature changed (else it would be a fallback).
#[test]
fn older_abi_accessors_have_another_signature() {
    let header = typedefs(TYPEDEFS_H);
    let compat = typedefs(COMPAT_H);
    let mut seen = 0;
    for e in ENTRIES.iter().filter(|e| e.accessor != e.name) {
        seen += 1;
        assert_eq!(e.accessor, format!("{}_v{}", e.name, e.version));
        assert!(
            e.fallbacks.is_empty(),
            "{}: give the newest line the fallbacks",
            e.accessor
        );
        let newest = newest_line(e).unwrap_or_else(|| panic!("{}: no newest line", e.accessor));
        assert!(
            e.version < newest.version,
            "{}: not older than {}",
            e.accessor,
            newest.typedef
        );
        let old = params(&header, &compat, e.name, e.version);
        let new = params(&header, &compat, e.name, newest.version);
        assert!(old.is_some(), "{}: no typedef in the header", e.accessor);
        assert_ne!(
            old, new,
            "{}: same signature: make it a fallback of {}",
            e.accessor, e.name
        );
    }
    assert!(
        seen >= 2,
        "the cuCtxSynchronize and cuCtxGetDevice 2000 lines are gone"
    );
}

/// Every entry the table asks for at an ABI newer than some 12.x driver has a way to reach
/// that driver's ABI, where the project relies on it.
#[test]
fn entries_changed_in_13_0_have_an_older_abi() {
    let find = |accessor: &str| {
        ENTRIES
            .iter()
            .find(|e| e.accessor == accessor)
            .unwrap_or_else(|| panic!("{accessor} is not in the table"))
    };
    assert_eq!(find("cuCtxSynchronize").version, 13000);
    assert_eq!(find("cuCtxSynchronize_v2000").name, "cuCtxSynchronize");
    assert_eq!(find("cuCtxGetDevice").version, 13000);
    assert_eq!(find("cuCtxGetDevice_v2000").name, "cuCtxGetDevice");
    let elapsed = find("cuEventElapsedTime");
    assert_eq!(elapsed.versions().collect::<Vec<_>>(), [12080, 2000]);
}

#[test]
fn entries_are_unique() {
    let mut accessors = HashSet::new();
    let mut abis = HashSet::new();
    for e in ENTRIES {
        assert!(accessors.insert(e.accessor), "{} appears twice", e.accessor);
        for v in e.versions() {
            assert!(abis.insert((e.name, v)), "{} ABI {v} appears twice", e.name);
        }
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
            .find(|e| e.accessor == name)
            .unwrap_or_else(|| panic!("{name} is not in the table"));
        assert_eq!(e.version, version, "{name}");
    }
    // cuGetProcAddress("cuGraphInstantiate", v) yields the legacy 5-argument function at
    // every v: the table must reach instantiation only through the WithFlags/WithParams names.
    assert!(!ENTRIES.iter().any(|e| e.name == "cuGraphInstantiate"));
}
