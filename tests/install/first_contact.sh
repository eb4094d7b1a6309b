#!/usr/bin/env bash
# A new user's first contact, as the README gives it: a fresh clone (of the committed HEAD), a
# fresh venv, `pip install .` (with the CUDA kernels when nvcc is found: ccache serves the objects
# of scripts/setup.sh's build), the README's Python call (examples/quickstart.py) and
# `flashmsa run --help`. Run by scripts/test.sh with python3 = the scripts' venv.
# The fresh venv sees the system's packages and the scripts' venv's (a .pth file), so pip finds the
# pinned torch there instead of downloading torch again; everything else is as a user gets it.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
secs() { python3 -c "import time; print(f'{time.time() - $1:.1f}')"; }

git clone -q "$root" "$work/flashmsa"
python3 -m venv --system-site-packages "$work/venv"
PY=$work/venv/bin/python
python3 -c "import sysconfig; print(sysconfig.get_path('purelib'))" > "$("$PY" -c "import sysconfig; print(sysconfig.get_path('purelib'))")/scripts-venv.pth"

t0=$(date +%s.%N)
if ! (cd "$work/flashmsa" && "$PY" -m pip install -v --disable-pip-version-check . > "$work/pip.log" 2>&1); then
  tail -60 "$work/pip.log"
  echo "[first contact] FAILED: pip install ." >&2
  exit 1
fi
echo "[first contact] pip install . took $(secs "$t0") s: $(grep -oE 'CUDA backend (ON|OFF)' "$work/pip.log")," \
  "$(grep -cE '^ *\[[0-9]+/[0-9]+\] Building' "$work/pip.log") files compiled (through ccache when present)"

# from outside the clone, so that the installed package is the one imported
t0=$(date +%s.%N)
(cd "$work" && "$PY" flashmsa/examples/quickstart.py)
echo "[first contact] examples/quickstart.py took $(secs "$t0") s"
lib=$(cd "$work" && "$PY" -c "import flashmsa; print(flashmsa.library_path())")
case $lib in "$work/venv/"*) ;; *) echo "[first contact] FAILED: library from $lib, not the venv" >&2; exit 1 ;; esac

t0=$(date +%s.%N)
"$work/venv/bin/flashmsa" run --help > "$work/help.txt"
grep -q "usage: flashmsa run" "$work/help.txt"
echo "[first contact] flashmsa run --help took $(secs "$t0") s"
echo "[first contact] passed"
