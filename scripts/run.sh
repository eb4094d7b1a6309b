#!/usr/bin/env bash
# The main job on a fresh machine: scripts/setup.sh --main-job (installs what is missing, builds
# the library and the main job: no tests, no torch), then `flashmsa run` with its defaults (on
# the GPU when one is visible, else on the CPU); extra arguments go to `flashmsa run`.
# Where no GPU is visible the build is CPU-only: the CUDA kernels take minutes to compile and
# could not run here. FLASHMSA_CUDA=ON (or AUTO: when nvcc is found) builds them anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${FLASHMSA_CUDA:-}" ] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "[run] no GPU visible: the CPU backend alone (FLASHMSA_CUDA=ON builds the CUDA kernels too)"
  export FLASHMSA_CUDA=OFF
fi
bash scripts/setup.sh --main-job
# (build/flashmsa is the program that `pip install .` puts on the PATH as `flashmsa`)
exec "${BUILD_DIR:-build}/flashmsa" run "$@"
