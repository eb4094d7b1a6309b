#!/usr/bin/env bash
# CuTe/CUTLASS C++ headers, pinned, from PyPI's nvidia-cutlass wheel (headers only; nothing is
# installed into Python). They land in .deps/cutlass/include.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=4.2.0.0
DEST=.deps/cutlass
if [ -f "$DEST/VERSION" ] && [ "$(cat "$DEST/VERSION")" = "$VERSION" ]; then exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "[setup] fetching nvidia-cutlass==$VERSION headers"
python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$tmp" "nvidia-cutlass==$VERSION"
python3 - "$tmp" "$DEST" <<'PY'
import sys, zipfile, glob, os, shutil
tmp, dest = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "*.whl"))[0]
prefix = "cutlass_library/source/include/"
shutil.rmtree(dest, ignore_errors=True)
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.startswith(prefix) and not n.endswith("/"):
            out = os.path.join(dest, "include", n[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(n) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
PY
echo "$VERSION" > "$DEST/VERSION"
