#!/usr/bin/env bash
# The main job: sets up what is missing, then runs the CLI (default: `info`).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root"
[ $# -gt 0 ] || set -- info
exec cargo run --quiet --release -p fp8-moe -- "$@"
