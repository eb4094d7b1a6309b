#!/usr/bin/env bash
# Every test on a fresh machine: scripts/setup.sh (installs what is missing, builds everything:
# the CUDA kernels too when nvcc is present), the C++ tests (CTest), the package installed with
# pip into the venv and pytest against it, then a new user's first contact
# (tests/install/first_contact.sh). On a machine with a GPU the GPU suite runs too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
# setup.sh's venv from here on (python3 of the SASS check and the tests is the venv's)
VENV=${VIRTUAL_ENV:-$PWD/.venv}
export VIRTUAL_ENV=$VENV PATH="$VENV/bin:$PATH"
# The GPU suite (label gpu) runs where a GPU is visible; elsewhere it is built but not run.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[test] ctest (CPU and GPU suites)"
  ctest --test-dir "$BUILD_DIR" --output-on-failure
else
  echo "[test] ctest (CPU suites; no GPU here: the GPU suite is built, not run)"
  ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)" -LE gpu
fi
# The Python package as a user gets it: pip install . (it reuses the build above: same folder,
# same flags; the constraints keep torch and numpy at the pinned versions), then pytest against
# the installed package, run from outside the source tree.
echo "[test] pip install . (into $VENV)"
python3 -m pip install --quiet --disable-pip-version-check -c requirements-test.txt .
echo "[test] pytest (the installed package)"
tests=$(pwd)/tests/python
(cd "$VENV" && FLASHMSA_TEST_INSTALLED=1 python3 -m pytest -q "$tests")
echo "[test] first contact: a fresh clone, a fresh venv, pip install ., examples/quickstart.py, flashmsa run --help"
bash tests/install/first_contact.sh
