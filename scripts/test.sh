#!/usr/bin/env bash
# Every test on a fresh machine: install, build (CUDA code included when nvcc is present),
# then the C++ tests (CTest) and the Python tests (pytest). On a machine with a GPU the GPU
# suite runs too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
echo "[test] ctest"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)"
echo "[test] pytest"
FLASHMSA_BUILD_DIR="$BUILD_DIR" python3 -m pytest -q tests/python
