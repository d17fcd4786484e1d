#!/usr/bin/env bash
# Builds every test binary and the CLI in release for x86-64, strips them, and gathers them
# with a runner into .bundle/ (ignored by git), so a GPU machine with no Rust toolchain runs
# the whole GPU suite with one command:
#
#     .bundle/run.sh LOG_DIR [FILTER]
#
# (or, from the compressed copy: tar xJf .gpu-pack/bundle.txz && .bundle/run.sh LOG_DIR)
#
# It runs each test binary with --include-ignored (one test at a time: GPU tests share one
# device), then each example (bin/example.*, without a FILTER) and the CLI's `info`, and
# writes one log per binary plus summary.txt to LOG_DIR. The cudarc interop test and example
# need libcublas on LD_LIBRARY_PATH; run.sh adds the folder of PyTorch's NVIDIA wheels when
# python3 can import `nvidia`.
# Its exit status is non-zero if anything failed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root"
bundle="$root/.bundle"
rm -rf "$bundle"
mkdir -p "$bundle/bin"

# Test binaries: one per (package, target); the JSON messages name each executable.
# list_tests: cargo's JSON messages on stdin -> "package.target executable" lines.
list_tests() {
  python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        # package_id: "path+file:///dir/name#1.0.0" or "path+file:///dir#name@1.0.0"
        url, _, frag = m["package_id"].partition("#")
        pkg = frag.split("@")[0] if "@" in frag else url.rstrip("/").rsplit("/", 1)[-1]
        print(pkg + "." + m["target"]["name"], m["executable"])
'
}
cargo test --workspace --release --no-run --message-format=json 2>/dev/null | list_tests \
  > "$bundle/tests.txt"
# Surface compile errors (the JSON run above is silent).
cargo test --workspace --release --no-run --quiet

# The cudarc interop (feature `cudarc` of cuda-graph, off in the workspace build, where its
# test binary is empty): its test, built with the feature, replaces that binary below; its
# example becomes bin/example.cudarc_interop.
cudarc_test=(cargo test -p cuda-graph --features cudarc --release --no-run --test cudarc_interop)
"${cudarc_test[@]}" --message-format=json 2>/dev/null | list_tests \
  | grep '^cuda-graph\.cudarc_interop ' > "$bundle/tests-cudarc.txt"
"${cudarc_test[@]}" --quiet
cargo build -p cuda-graph --features cudarc --release --quiet --example cudarc_interop

cargo build --release --quiet -p fp8-moe
while read -r name exe; do
  # Compile-fail tests run cargo at test time, and the SASS check disassembles with the
  # toolchain's cuobjdump: both belong to CI, not the GPU machine.
  case "$name" in *.compile_fail | fp8-kernels.sass) continue ;; esac
  cp "$exe" "$bundle/bin/test.$name"
# The featured cudarc_interop binary comes last: it overwrites the empty one.
done < <(cat "$bundle/tests.txt" "$bundle/tests-cudarc.txt")
cp target/release/fp8-moe "$bundle/bin/fp8-moe"
cp target/release/examples/cudarc_interop "$bundle/bin/example.cudarc_interop"
# The other examples of each crate (each checks its results and exits non-zero on a mismatch).
examples=(capture_replay explicit_graph while_loop graphed_layers fp8_gemm moe_training expert_parallel)
cargo build --release --quiet -p cuda-graph -p graphed-callables -p fp8-kernels -p fp8-moe --examples
for e in "${examples[@]}"; do
  cp "target/release/examples/$e" "$bundle/bin/example.$e"
done
strip "$bundle"/bin/*
# The sanitizer run (compute-sanitizer's four tools over every test binary) and its allow-list.
cp scripts/sanitize.sh scripts/sanitizer-allow.txt "$bundle/"

cat > "$bundle/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the GPU suite gathered by scripts/gpu-bundle.sh. Usage: run.sh LOG_DIR [FILTER]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
logs=${1:?usage: run.sh LOG_DIR [FILTER]}
filter=${2:-}
mkdir -p "$logs"
status=0
summary="$logs/summary.txt"
: > "$summary"
# cuBLAS for the cudarc interop test and example: cudarc opens libcublas at run time, by
# name, through the loader's search path (LD_LIBRARY_PATH). Take it from the NVIDIA wheels
# of python3's environment (PyTorch's) when python3 finds them; otherwise change nothing.
if nv_dirs=$(python3 -c 'import nvidia; print("\n".join(nvidia.__path__))' 2>/dev/null); then
  while read -r nv; do
    for lib in "$nv/cu13/lib" "$nv/cublas/lib"; do
      if compgen -G "$lib/libcublas.so*" > /dev/null; then
        export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "run.sh: cuBLAS from $lib"
      fi
    done
  done <<< "$nv_dirs"
  # NCCL for cuda-graph-nccl and fp8-moe's multi-GPU tests: PyTorch's, unless the caller
  # named one (CUDA_GRAPH_NCCL_LIBRARY).
  if [ -z "${CUDA_GRAPH_NCCL_LIBRARY:-}" ]; then
    while read -r nv; do
      if [ -f "$nv/nccl/lib/libnccl.so.2" ]; then
        export CUDA_GRAPH_NCCL_LIBRARY="$nv/nccl/lib/libnccl.so.2"
        echo "run.sh: NCCL from $CUDA_GRAPH_NCCL_LIBRARY"
        break
      fi
    done <<< "$nv_dirs"
  fi
fi
# NVLink multicast stays off on the shared machines (NCCL would otherwise try it).
export NCCL_NVLS_ENABLE=0
for t in "$here"/bin/test.*; do
  name=${t##*/bin/}
  start=$(date +%s.%N)
  # A hung test must not eat the whole session: each binary gets $TEST_TIMEOUT seconds.
  FP8_MOE_BIN="$here/bin/fp8-moe" timeout "${TEST_TIMEOUT:-180}" \
    "$t" --include-ignored --test-threads=1 $filter > "$logs/$name.log" 2>&1
  rc=$?
  secs=$(python3 -c "print(f'{$(date +%s.%N) - $start:.1f}')" 2>/dev/null || echo "?")
  result=$(grep -E '^test result:' "$logs/$name.log" | tail -1)
  printf '%-48s rc=%d %6ss  %s\n' "$name" "$rc" "$secs" "$result" | tee -a "$summary"
  [ $rc = 0 ] || status=1
done
# Examples (they exit non-zero on a wrong result); not with a test-name filter.
if [ -z "$filter" ]; then
  for e in "$here"/bin/example.*; do
    [ -e "$e" ] || continue
    name=${e##*/bin/}
    timeout "${TEST_TIMEOUT:-180}" "$e" > "$logs/$name.log" 2>&1
    rc=$?
    printf '%-48s rc=%d\n' "$name" "$rc" | tee -a "$summary"
    [ $rc = 0 ] || status=1
  done
fi
"$here/bin/fp8-moe" info > "$logs/info.log" 2>&1
rc=$?
printf '%-48s rc=%d\n' "fp8-moe info" "$rc" | tee -a "$summary"
[ $rc = 0 ] || status=1
cat "$logs/info.log"
exit $status
RUN
chmod +x "$bundle/run.sh"
du -sh "$bundle" | sed 's/^/gpu-bundle: /'

# The same, compressed, for transports with a size limit: unpack with
# `tar xJf .gpu-pack/bundle.txz` in the repository root. xz's 64 MiB window (-9) spans
# several binaries, so the fatbin every test binary embeds is stored about once (178 MB ->
# 7 MB; gzip's 32 KiB window gave 62 MB).
mkdir -p "$root/.gpu-pack"
rm -f "$root/.gpu-pack/bundle.tgz"
tar cf - -C "$root" .bundle | xz -9 -T1 > "$root/.gpu-pack/bundle.txz"
du -sh "$root/.gpu-pack/bundle.txz" | sed 's/^/gpu-bundle: /'
