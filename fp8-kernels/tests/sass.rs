//! The SASS check of the crate's fatbin (CPU only: it disassembles, it runs nothing): every
//! sm_90a GEMM kernel (`fp8_gemm_sm90_*`: the TMA + wgmma kernels, the skinny ones included)
//! issues its products as QGMMA, the FP8 wgmma of Hopper's tensor cores (not a fallback), at
//! least one k-block's worth (4 of k32), none serialised by ptxas (C7514: every QGMMA then
//! waits for itself), the pipelined ones (fast accumulation, the promoted sums at 128 wide)
//! keeping a group in flight, and no kernel of any architecture touches local memory
//! (`STL`/`LDL`: register spills or stack arrays, which cost a GEMM's main loop dearly).
//!
//! It needs `cuobjdump` and `nvdisasm`: `$CUOBJDUMP` (with `nvdisasm` beside it or on `PATH`),
//! else `$CUDA_HOME/bin`, else `.toolchain/sass` (installed by `scripts/setup.sh`), else
//! `PATH`. Without them the test fails and says so.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What the check reads from one function's listing.
#[derive(Debug, Default, PartialEq)]
struct Listing {
    /// QGMMA instructions.
    qgmma: usize,
    /// QGMMA instructions that close a group (`gsb0`): all of them where ptxas serialised the
    /// wgmmas, one a group (a k-block's last k32 step) otherwise.
    qgmma_closing: usize,
    /// Waits that leave a group in flight (`WARPGROUP.DEPBAR.LE gsb0, 0x1`).
    waits_in_flight: usize,
    /// Local-memory instructions.
    local: Vec<String>,
}

/// Per architecture (`sm_90a`, ...), per function: its [`Listing`].
type Sass = BTreeMap<String, BTreeMap<String, Listing>>;

fn cuobjdump() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let candidates = [
        std::env::var_os("CUOBJDUMP").map(PathBuf::from),
        std::env::var_os("CUDA_HOME").map(|h| Path::new(&h).join("bin/cuobjdump")),
        Some(root.join(".toolchain/sass/nvidia/cu13/bin/cuobjdump")),
    ];
    if let Some(found) = candidates.into_iter().flatten().find(|p| p.is_file()) {
        return found;
    }
    let on_path = Command::new("cuobjdump").arg("--version").output();
    assert!(
        on_path.is_ok_and(|o| o.status.success()),
        "no cuobjdump: run scripts/setup.sh (it installs cuobjdump and nvdisasm into \
         .toolchain/sass), or set CUOBJDUMP"
    );
    PathBuf::from("cuobjdump")
}

/// Disassembles `fatbin` and parses the listing.
fn disassemble(fatbin: &[u8]) -> Sass {
    let tool = cuobjdump();
    let file = std::env::temp_dir().join(format!("fp8_kernels_sass_{}.fatbin", std::process::id()));
    std::fs::write(&file, fatbin).expect("write the fatbin to a temporary file");
    // cuobjdump runs nvdisasm: the one beside it first.
    let mut path = tool
        .parent()
        .map(Path::to_path_buf)
        .into_iter()
        .collect::<Vec<_>>();
    path.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    let out = Command::new(&tool)
        .arg("-sass")
        .arg(&file)
        .env("PATH", std::env::join_paths(path).expect("PATH entries"))
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", tool.display()));
    let _ = std::fs::remove_file(&file);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{} -sass failed: {}",
        tool.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    parse(&text)
}

fn parse(text: &str) -> Sass {
    let mut sass = Sass::new();
    let (mut arch, mut function) = (String::new(), String::new());
    for line in text.lines() {
        let line = line.trim();
        if let Some(a) = line.strip_prefix("code for ") {
            arch = a.trim().to_owned();
        } else if let Some(f) = line.strip_prefix("Function : ") {
            function = f.trim().to_owned();
            sass.entry(arch.clone())
                .or_default()
                .entry(function.clone())
                .or_default();
        } else if line.starts_with("/*") && !function.is_empty() {
            // "/*0a40*/   OPCODE.modifiers operands ;   /* encoding */"
            let Some(op) = line
                .split("*/")
                .nth(1)
                .and_then(|rest| rest.split_whitespace().find(|w| !w.starts_with('@')))
            else {
                continue;
            };
            let base = op.split('.').next().unwrap_or(op);
            let entry = sass
                .entry(arch.clone())
                .or_default()
                .entry(function.clone())
                .or_default();
            if base == "QGMMA" {
                entry.qgmma += 1;
                if line.contains("gsb0") {
                    entry.qgmma_closing += 1;
                }
            }
            if op == "WARPGROUP.DEPBAR.LE" && line.contains("gsb0, 0x1") {
                entry.waits_in_flight += 1;
            }
            if base == "STL" || base == "LDL" {
                entry.local.push(line.to_owned());
            }
        }
    }
    sass
}

#[test]
fn gemm_kernels_issue_qgmma_and_no_kernel_spills() {
    let sass = disassemble(fp8_kernels::FATBIN);
    let hopper = sass
        .get("sm_90a")
        .unwrap_or_else(|| panic!("no sm_90a code in the fatbin: {:?}", sass.keys()));
    let gemms: Vec<_> = hopper
        .iter()
        .filter(|(name, _)| name.starts_with("fp8_gemm_sm90_"))
        .collect();
    // The families are all there (a renamed or dropped family would otherwise pass unseen).
    for family in [
        "fp8_gemm_sm90_e4m3_e4m3_bf16_n128",
        "fp8_gemm_sm90_fast_e4m3_e4m3_bf16_n256",
        "fp8_gemm_sm90_packed_e5m2_e4m3_f32_n192",
        "fp8_gemm_sm90_wgrad_e4m3_e5m2_f32_n128",
        "fp8_gemm_sm90_packed_swiglu_fast_e4m3_e4m3_bf16_n256",
        "fp8_gemm_sm90_block_e4m3_e4m3_bf16_n192",
        "fp8_gemm_sm90_block_e4m3_e4m3_bf16_n256",
        "fp8_gemm_sm90_e4m3_e4m3_bf16_n256",
        "fp8_gemm_sm90_skinny_e4m3_e4m3_bf16_m64",
        "fp8_gemm_sm90_skinny_fast_e4m3_e4m3_bf16_m128",
    ] {
        assert!(
            hopper.contains_key(family),
            "{family} is not in the sm_90a code"
        );
    }
    let mut without = Vec::new();
    let mut serialised = Vec::new();
    let mut not_pipelined = Vec::new();
    for (name, l) in &gemms {
        if l.qgmma < 4 {
            without.push(format!("{name}: {} QGMMA", l.qgmma));
        }
        if l.qgmma_closing >= l.qgmma {
            serialised.push(format!(
                "{name}: {} of {} QGMMA close a group",
                l.qgmma_closing, l.qgmma
            ));
        }
        // Fast accumulation keeps a k-block's group in flight while it issues the next; so do
        // the promoted sums at 128 wide (consume_pipelined), the skinny ones aside.
        let pipelined =
            name.contains("fast_") || (name.ends_with("_n128") && !name.contains("skinny"));
        if pipelined && l.waits_in_flight == 0 {
            not_pipelined.push(name.to_string());
        }
    }
    assert!(
        without.is_empty(),
        "sm_90a GEMM kernels without a k-block of QGMMA:\n{}",
        without.join("\n")
    );
    assert!(
        serialised.is_empty(),
        "sm_90a GEMM kernels whose wgmmas ptxas serialised (C7514 in its -v output):\n{}",
        serialised.join("\n")
    );
    assert!(
        not_pipelined.is_empty(),
        "pipelined sm_90a GEMM kernels without a wait that leaves a group in flight:\n{}",
        not_pipelined.join("\n")
    );
    let mut local = Vec::new();
    for (arch, functions) in &sass {
        for (name, l) in functions {
            if let Some(first) = l.local.first() {
                local.push(format!("{arch} {name}: {} ({first})", l.local.len()));
            }
        }
    }
    assert!(
        local.is_empty(),
        "kernels using local memory (spills or stack arrays):\n{}",
        local.join("\n")
    );
    println!(
        "{} sm_90a GEMM kernels, each with QGMMA; {} kernels over {} architectures, none with \
         local memory",
        gemms.len(),
        sass.values().map(BTreeMap::len).sum::<usize>(),
        sass.len()
    );
}

#[test]
fn the_parser_reads_cuobjdump_listings() {
    let text = "\n\tcode for sm_90a\n\t\tFunction : k_gemm\n\t.headerflags\t@\"EF_CUDA_SM90\"\n        \
                /*0000*/                   MOV R1, c[0x0][0x28] ;     /* 0x00000a00ff017624 */\n        \
                /*09f0*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR12], RZ, !UPT ;   /* 0x */\n        \
                /*0a00*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR12], R24, gsb0 ;   /* 0x */\n        \
                /*0a10*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;   /* 0x */\n        \
                /*0a20*/              @!P0 STL [R1], R2 ;   /* 0x */\n\t\tFunction : k_other\n        \
                /*0000*/                   LDL.64 R2, [R1+0x8] ;   /* 0x */\n\tcode for sm_89\n\t\tFunction : k_gemm\n        \
                /*0000*/                   EXIT ;   /* 0x */\n";
    let sass = parse(text);
    let gemm = &sass["sm_90a"]["k_gemm"];
    assert_eq!(
        (gemm.qgmma, gemm.qgmma_closing, gemm.waits_in_flight),
        (2, 1, 1)
    );
    assert_eq!(gemm.local.len(), 1);
    assert_eq!(sass["sm_90a"]["k_other"].local.len(), 1);
    assert_eq!(sass["sm_89"]["k_gemm"], Listing::default());
}
