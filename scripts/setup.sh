#!/usr/bin/env bash
# Installs, when missing, what building this workspace needs, into the ignored .toolchain/:
#   - the CUDA 13.0 compiler and headers, from NVIDIA's pip wheels (pinned to 13.0.x and
#     installed together: a later `pip install --target` would replace the folder);
#   - libclang for bindgen, from the `libclang` wheel;
#   - cuobjdump and nvdisasm (13.2: no 13.0 wheels exist; they read 13.0 cubins) into
#     .toolchain/sass, for fp8-kernels' SASS check (tests/sass.rs), unless CUDA_HOME has them.
#   - NCCL 2.28 (nccl.h and libnccl.so.2, from the nvidia-nccl-cu13 wheel) into .toolchain/nccl,
#     for cuda-graph-nccl's bindings (the header) and its CPU tests (the library), unless
#     NCCL_HOME names an NCCL with include/nccl.h.
# With CUDA_HOME (or CUDA_PATH) set, that toolkit is used instead of the wheels; with
# LIBCLANG_PATH set, that libclang. Idempotent: a second run only checks and returns.
#
# `scripts/setup.sh --cuda12-headers` also installs the CUDA 12.4 headers (cuda.h and
# cudaTypedefs.h, from the nvidia-cuda-runtime-cu12 wheel; no compiler: no 12.x pip wheel
# ships nvcc) into .toolchain/cuda12, and prints the CUDA_HOME to build cuda-graph-sys
# against them. CI uses it to check that the sys crate builds with the oldest headers it
# accepts.
set -euo pipefail

cuda12=0
for arg in "$@"; do
  case $arg in
    --cuda12-headers) cuda12=1 ;;
    *) printf 'setup: unknown argument %s (only --cuda12-headers)\n' "$arg" >&2; exit 2 ;;
  esac
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tc="$root/.toolchain"
cuda_stamp="$tc/cuda/.installed-13.0"
clang_stamp="$tc/libclang/.installed-18.1.1"
cuda12_stamp="$tc/cuda12/.installed-12.4"
sass_stamp="$tc/sass/.installed-13.2"
nccl_stamp="$tc/nccl/.installed-2.28.9"
cuda_wheels=(
  "nvidia-cuda-nvcc==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*"
  "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*"
)

say() { printf 'setup: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

need() { command -v "$1" >/dev/null 2>&1 || die "$1 is required ($2)"; }
need cargo "install Rust with rustup"
need python3 "install Python 3 with pip"
python3 -m pip --version >/dev/null 2>&1 || die "python3 has no pip (apt-get install python3-pip)"
# nvcc preprocesses with the host C compiler, and bindgen borrows its stddef.h.
if ! command -v cc >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing gcc"
    apt-get update -qq && apt-get install -y -qq gcc >/dev/null
  else
    die "a C compiler (cc) is required: apt-get install gcc"
  fi
fi

# pip_into DIR STAMP PACKAGES...: installs into a fresh folder, then swaps it in, so an
# interrupted install never leaves a half-filled toolchain behind.
pip_into() {
  local dir=$1 stamp=$2; shift 2
  rm -rf "$dir.partial"
  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    --target "$dir.partial" "$@" || die "pip could not install: $*"
  rm -rf "$dir"
  mv "$dir.partial" "$dir"
  touch "$stamp"
}

cuda_home=${CUDA_HOME:-${CUDA_PATH:-}}
if [ -n "$cuda_home" ]; then
  [ -f "$cuda_home/include/cuda.h" ] || die "CUDA_HOME=$cuda_home has no include/cuda.h"
  [ -x "$cuda_home/bin/nvcc" ] || die "CUDA_HOME=$cuda_home has no bin/nvcc"
elif [ ! -f "$cuda_stamp" ]; then
  say "installing the CUDA 13.0 compiler and headers into .toolchain/cuda (about 300 MB)"
  mkdir -p "$tc"
  pip_into "$tc/cuda" "$cuda_stamp" "${cuda_wheels[@]}"
  [ -x "$tc/cuda/nvidia/cu13/bin/nvcc" ] || die "the wheels installed no nvidia/cu13/bin/nvcc"
fi

if [ -z "${LIBCLANG_PATH:-}" ] && [ ! -f "$clang_stamp" ]; then
  say "installing libclang into .toolchain/libclang"
  mkdir -p "$tc"
  pip_into "$tc/libclang" "$clang_stamp" "libclang==18.1.1"
fi

if { [ -z "$cuda_home" ] || [ ! -x "$cuda_home/bin/cuobjdump" ] || [ ! -x "$cuda_home/bin/nvdisasm" ]; } &&
  [ ! -f "$sass_stamp" ]; then
  say "installing cuobjdump and nvdisasm into .toolchain/sass"
  mkdir -p "$tc"
  pip_into "$tc/sass" "$sass_stamp" "nvidia-cuda-cuobjdump==13.2.*" "nvidia-cuda-nvdisasm==13.2.*"
  [ -x "$tc/sass/nvidia/cu13/bin/cuobjdump" ] && [ -x "$tc/sass/nvidia/cu13/bin/nvdisasm" ] ||
    die "the wheels installed no nvidia/cu13/bin/cuobjdump and nvdisasm"
fi

# NCCL: pinned to the library on the GPU machine (2.28.9, inside its PyTorch environment).
if [ -n "${NCCL_HOME:-}" ]; then
  [ -f "$NCCL_HOME/include/nccl.h" ] || die "NCCL_HOME=$NCCL_HOME has no include/nccl.h"
elif [ ! -f "$nccl_stamp" ]; then
  say "installing NCCL 2.28.9 into .toolchain/nccl (about 200 MB)"
  mkdir -p "$tc"
  pip_into "$tc/nccl" "$nccl_stamp" --no-deps "nvidia-nccl-cu13==2.28.9"
  [ -f "$tc/nccl/nvidia/nccl/include/nccl.h" ] && [ -f "$tc/nccl/nvidia/nccl/lib/libnccl.so.2" ] ||
    die "the nvidia-nccl-cu13 wheel installed no nvidia/nccl/include/nccl.h and lib/libnccl.so.2"
fi

# install_cuda12_headers: the CUDA 12.4 headers into .toolchain/cuda12 (under 1 MB); prints
# the folder to use as CUDA_HOME.
install_cuda12_headers() {
  local home="$tc/cuda12/nvidia/cuda_runtime"
  if [ ! -f "$cuda12_stamp" ]; then
    say "installing the CUDA 12.4 headers into .toolchain/cuda12"
    mkdir -p "$tc"
    pip_into "$tc/cuda12" "$cuda12_stamp" "nvidia-cuda-runtime-cu12==12.4.*"
  fi
  [ -f "$home/include/cuda.h" ] && [ -f "$home/include/cudaTypedefs.h" ] ||
    die "the nvidia-cuda-runtime-cu12 wheel installed no include/cuda.h and cudaTypedefs.h"
  printf '%s\n' "$home"
}

if [ "$cuda12" = 1 ]; then
  install_cuda12_headers
fi
