#!/usr/bin/env bash
# Builds every test binary and the CLI in release for x86-64, strips them, and gathers them
# with a runner into .bundle/ (ignored by git), so a GPU machine with no Rust toolchain runs
# the whole GPU suite with one command:
#
#     .bundle/run.sh LOG_DIR [FILTER]
#
# (or, from the compressed copy: tar xzf .gpu-pack/bundle.tgz && .bundle/run.sh LOG_DIR)
#
# It runs each test binary with --include-ignored (one test at a time: GPU tests share one
# device), then the CLI's `info`, and writes one log per binary plus summary.txt to LOG_DIR.
# Its exit status is non-zero if anything failed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root"
bundle="$root/.bundle"
rm -rf "$bundle"
mkdir -p "$bundle/bin"

# Test binaries: one per (package, target); the JSON messages name each executable.
cargo test --workspace --release --no-run --message-format=json 2>/dev/null \
  | python3 -c '
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
' > "$bundle/tests.txt"
# Surface compile errors (the JSON run above is silent).
cargo test --workspace --release --no-run --quiet

cargo build --release --quiet -p fp8-moe
while read -r name exe; do
  # Compile-fail tests run cargo at test time: they belong to CI, not the GPU machine.
  case "$name" in *.compile_fail) continue ;; esac
  cp "$exe" "$bundle/bin/test.$name"
done < "$bundle/tests.txt"
cp target/release/fp8-moe "$bundle/bin/fp8-moe"
strip "$bundle"/bin/*

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
"$here/bin/fp8-moe" info > "$logs/info.log" 2>&1
rc=$?
printf '%-48s rc=%d\n' "fp8-moe info" "$rc" | tee -a "$summary"
[ $rc = 0 ] || status=1
cat "$logs/info.log"
exit $status
RUN
chmod +x "$bundle/run.sh"
du -sh "$bundle" | sed 's/^/gpu-bundle: /'

# The same, compressed (the fatbins in every binary compress about 3x), for transports with a
# size limit: unpack with `tar xzf .gpu-pack/bundle.tgz` in the repository root.
mkdir -p "$root/.gpu-pack"
tar czf "$root/.gpu-pack/bundle.tgz" -C "$root" .bundle
du -sh "$root/.gpu-pack/bundle.tgz" | sed 's/^/gpu-bundle: /'
