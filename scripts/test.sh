#!/usr/bin/env bash
# Every test on a fresh machine: install, build (CUDA code included when nvcc is present),
# then the C++ tests (CTest) and the Python tests (pytest). On a machine with a GPU the GPU
# suite runs too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
# The GPU suite (label gpu) runs where a GPU is visible; elsewhere it is built but not run.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[test] ctest (CPU and GPU suites)"
  ctest --test-dir "$BUILD_DIR" --output-on-failure
else
  echo "[test] ctest (CPU suites; no GPU here: the GPU suite is built, not run)"
  ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)" -LE gpu
fi
echo "[test] pytest"
FLASHMSA_BUILD_DIR="$BUILD_DIR" python3 -m pytest -q tests/python
