#!/usr/bin/env bash
# Installs what flashmsa needs on a fresh Debian/Ubuntu machine (only what is missing) and builds
# it with CMake in $BUILD_DIR (default build), showing ninja's progress.
#   bash scripts/setup.sh              everything scripts/test.sh checks: the library, the main job,
#                                      the tests and the benchmark, warnings as errors
#   bash scripts/setup.sh --main-job   the library and the main job only (scripts/run.sh)
# FLASHMSA_CUDA=ON|OFF|AUTO: the CUDA kernels (sm_90a); AUTO (default) builds them when nvcc is
# found, the same choice as `pip install .` (cmake/pep517_backend.py makes it for both).
# Python packages go into a venv: the active one ($VIRTUAL_ENV), else .venv, made here (Debian's
# python3 refuses pip installs outside a venv, PEP 668). .venv sees the system's packages, so a
# system-wide torch of the pinned version (requirements-test.txt) is used, not installed again.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
case $mode in all | --main-job) ;; *) echo "usage: bash scripts/setup.sh [--main-job]" >&2; exit 2 ;; esac
BUILD_DIR=${BUILD_DIR:-build}
cuda_off=false
case ${FLASHMSA_CUDA:-AUTO} in OFF | off | Off) cuda_off=true ;; esac
# Python is needed for the tests, and for a CUDA build (the CuTe headers come from PyPI)
need_python=true
[ "$mode" = --main-job ] && $cuda_off && need_python=false

need_apt=()
pkgs=(cmake ninja-build g++)
[ "$mode" = --main-job ] || pkgs+=(libgtest-dev ccache git)
$need_python && pkgs+=(python3)
for pkg in "${pkgs[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
# python3 -m venv needs ensurepip, which Debian ships in python3-venv
if $need_python && ! python3 -c "import ensurepip" >/dev/null 2>&1; then need_apt+=(python3-venv); fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "[setup] apt-get install ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

cmake_args=(-DCMAKE_BUILD_TYPE=Release)
if $cuda_off; then cuda=OFF; else cuda=$(python3 cmake/pep517_backend.py); fi  # "ON <nvcc>" or "OFF"
if [ "$cuda" = OFF ]; then
  cmake_args+=(-DFLASHMSA_CUDA=OFF)
else
  export CUDACXX=${cuda#ON }
  cmake_args+=(-DFLASHMSA_CUDA=ON)
fi
echo "[setup] CUDA kernels: ${cuda}"

if $need_python; then
  VENV=${VIRTUAL_ENV:-$PWD/.venv}
  if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] python3 -m venv --system-site-packages $VENV"
    python3 -m venv --system-site-packages "$VENV"
  fi
  PY=$VENV/bin/python
  pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }
  cmake_args+=(-DPython3_EXECUTABLE="$PY")
  if [ "$mode" != --main-job ]; then
    # numpy, pytest, torch, pinned (a no-op when present). PyPI's Linux torch wheel brings its
    # CUDA libraries (about 2.7 GB; docs/python.md says why it is still the pick).
    echo "[setup] pip install -r requirements-test.txt (into $VENV)"
    pip_install -r requirements-test.txt
  fi
  if [ "$cuda" != OFF ]; then
    # the headers only: the package's Python dependencies (scipy, cuda-python, ...) are not needed
    pip_install --no-deps -r requirements-cutlass.txt
    # the SASS check of the kernels (tests/sass) needs cuobjdump + nvdisasm (pinned PyPI wheels,
    # 5 MB, when the toolkit has none)
    if [ "$mode" != --main-job ] && ! "$PY" tests/sass/check_sass.py --tools >/dev/null 2>&1; then
      echo "[setup] pip install -r requirements-sass.txt (cuobjdump, nvdisasm)"
      pip_install -r requirements-sass.txt ||
        echo "[setup] WARNING: no cuobjdump/nvdisasm: the ctest sass_bwd_reductions will fail (offline?)" >&2
    fi
  fi
fi

targets=()
if [ "$mode" = --main-job ]; then
  targets=(--target flashmsa_runtime)  # the library and the main job: what pip install . builds
else
  cmake_args+=(-DFLASHMSA_BUILD_TESTS=ON -DFLASHMSA_BUILD_BENCH=ON -DFLASHMSA_WERROR=ON)
fi
cmake -S . -B "$BUILD_DIR" -G Ninja "${cmake_args[@]}" >/dev/null
echo "[setup] building in $BUILD_DIR ($(nproc) cores)"
cmake --build "$BUILD_DIR" -j "$(nproc)" "${targets[@]}"
