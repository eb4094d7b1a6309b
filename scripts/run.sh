#!/usr/bin/env bash
# The main job on a fresh machine: install, build, then `flashmsa run` with its defaults
# (on the GPU when one is present, else on the CPU). Extra arguments go to `flashmsa run`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${BUILD_DIR:-build}/flashmsa" run "$@"
