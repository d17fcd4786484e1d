#!/usr/bin/env bash
# The tests: sets up what is missing, then runs every test of the workspace. Tests that need
# a GPU are #[ignore]d here; pass `-- --include-ignored` on a machine with one (or use
# scripts/gpu-bundle.sh to run them on a GPU machine without a Rust toolchain).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root"
exec cargo test --workspace "$@"
