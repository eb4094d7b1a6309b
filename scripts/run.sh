#!/usr/bin/env bash
# The main job on a fresh machine, as a user gets it: install what is missing and build
# (scripts/setup.sh), pip install . into a venv that sees this machine's packages (torch; the
# install reuses the build above), then the package's console command `flashmsa run` with its
# defaults (on the GPU when one is present, else on the CPU). Extra arguments go to `flashmsa run`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=$(realpath -m "${FLASHMSA_RUN_VENV:-${BUILD_DIR:-build}/run-venv}")
echo "[run] pip install . (into $VENV)"
python3 -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check .
exec "$VENV/bin/flashmsa" run "$@"
