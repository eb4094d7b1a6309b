#!/usr/bin/env bash
# Installs what flashmsa needs on a fresh Debian machine (only what is missing) and builds it.
# Used by scripts/run.sh and scripts/test.sh. Environment: BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
for pkg in cmake ninja-build g++ libgtest-dev ccache python3 python3-pip; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
# python3 -m venv (scripts/run.sh and scripts/test.sh install the package into a venv) needs
# ensurepip, which Debian ships in python3-venv
python3 -c "import ensurepip" >/dev/null 2>&1 || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "[setup] apt-get install ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# Python packages for the tests (pinned): numpy, pytest and torch for the PyTorch package
# (python/flashmsa). PyPI's Linux torch wheel brings its CUDA libraries (about 2.7 GB download,
# a minute here); docs/python.md says why it is still the pick. Machines that already have
# them (the GPU machine) install nothing.
if ! python3 -c "import numpy, pytest, torch" >/dev/null 2>&1; then
  echo "[setup] pip install -r requirements-test.txt (numpy, pytest, torch)"
  python3 -m pip install --quiet --disable-pip-version-check -r requirements-test.txt
fi

# nvcc is optional: with it the CUDA backend (sm_90a) is compiled too.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

# With nvcc, the CUDA backend needs the pinned CuTe/CUTLASS headers, and the SASS check of the
# kernels (tests/sass) needs cuobjdump + nvdisasm (pinned PyPI wheels, 5 MB, when the toolkit
# has none).
if command -v nvcc >/dev/null 2>&1; then
  bash scripts/fetch_cutlass.sh
  if ! python3 tests/sass/check_sass.py --tools >/dev/null 2>&1; then
    echo "[setup] pip install -r requirements-sass.txt (cuobjdump, nvdisasm)"
    python3 -m pip install --quiet --disable-pip-version-check -r requirements-sass.txt ||
      echo "[setup] WARNING: no cuobjdump/nvdisasm: the ctest sass_bwd_reductions will fail (offline?)" >&2
  fi
fi

BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHMSA_WERROR=ON >/dev/null
echo "[setup] building in $BUILD_DIR ($(nproc) cores)"
cmake --build "$BUILD_DIR" -j "$(nproc)"
