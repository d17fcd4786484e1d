#!/usr/bin/env bash
# The main job: sets up what is missing, then runs the CLI (default: `train`, the FP8 MoE
# transformer trained under CUDA graphs; `info` reports the driver and devices).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root"
[ $# -gt 0 ] || set -- train
exec cargo run --quiet --release -p fp8-moe -- "$@"
