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
# The Python package as a user gets it: pip install . into a fresh virtual environment that sees
# this machine's packages (torch), reusing the CMake build above (scikit-build-core, build/), then
# pytest against the installed package, run from outside the source tree.
VENV=$(realpath -m "${FLASHMSA_TEST_VENV:-$BUILD_DIR/test-venv}")
echo "[test] pip install . (into $VENV)"
python3 -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check .
echo "[test] pytest (the installed package)"
tests=$(pwd)/tests/python
(cd "$VENV" && FLASHMSA_TEST_INSTALLED=1 "$VENV/bin/python" -m pytest -q "$tests")
