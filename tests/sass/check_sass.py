#!/usr/bin/env python3
"""Checks on the compiled kernels' machine code (SASS) that CI can run without a GPU.

The default (non-deterministic) backward kernels must add their gradients with REDG (a
reduction that does not wait for a reply), never ATOMG. A fence anywhere in a kernel (the
deterministic mode's __threadfence) makes ptxas compile every atomicAdd of the kernel as ATOMG:
that cost the main backward kernel 38% on the H200 (27.3 -> 37.7 ms at m3 32k) before the
deterministic code moved into its own instantiation. docs/kernels/bwd.md has the story.

    python3 tests/sass/check_sass.py OBJECT.o ...      # the library's CUDA objects
    python3 tests/sass/check_sass.py --tools           # exit 0 when cuobjdump/nvdisasm are found

cuobjdump and nvdisasm come from the CUDA toolkit, or from PyPI's nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels (scripts/setup.sh installs them, pinned, when nvcc is present).
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys


def find_tool(name: str) -> str | None:
    for d in [os.environ.get("CUDA_HOME", "/usr/local/cuda") + "/bin"] + sys.path:
        for cand in (pathlib.Path(d) / name, pathlib.Path(d) / "nvidia" / "cu13" / "bin" / name):
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    return shutil.which(name)


def sass(obj: str, cuobjdump: str, nvdisasm: str) -> dict[str, str]:
    """{kernel mangled name: its SASS text} of one object file."""
    env = dict(os.environ, PATH=str(pathlib.Path(nvdisasm).parent) + os.pathsep + os.environ.get("PATH", ""))
    out = subprocess.run([cuobjdump, "-sass", obj], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"cuobjdump failed on {obj}: {out.stderr.strip()}")
    kernels, name, lines = {}, None, []
    for line in out.stdout.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            if name:
                kernels[name] = "\n".join(lines)
            name, lines = m.group(1), []
        elif name:
            lines.append(line)
    if name:
        kernels[name] = "\n".join(lines)
    return kernels


# (object name pattern, kernel name pattern): kernels whose gradient adds must be REDG
RULES = [
    (re.compile(r"bwd_(main|kl|proxy)_[a-z0-9_]+\.cu\.o$"), re.compile(r"bwd_(main|kl|proxy)_kernel")),
]


def main(argv: list[str]) -> int:
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if argv[:1] == ["--tools"]:
        print(f"cuobjdump: {cuobjdump}\nnvdisasm: {nvdisasm}")
        return 0 if cuobjdump and nvdisasm else 1
    if not cuobjdump or not nvdisasm:
        print("check_sass: cuobjdump and nvdisasm are needed (pip install -r requirements-sass.txt)",
              file=sys.stderr)
        return 2
    checked, failures = 0, []
    for obj in argv:
        base = os.path.basename(obj)
        if "_det." in base:  # the deterministic instantiations fence, hence ATOMG: allowed
            continue
        for obj_re, kern_re in RULES:
            if not obj_re.search(base):
                continue
            for kname, text in sass(obj, cuobjdump, nvdisasm).items():
                if not kern_re.search(kname):
                    continue
                atomg = len(re.findall(r"\bATOMG\.", text))
                redg = len(re.findall(r"\bREDG\.", text))
                checked += 1
                print(f"{base}: {kname[:60]}... REDG {redg}, ATOMG {atomg}")
                if atomg or not redg:
                    failures.append(f"{base}: {atomg} ATOMG, {redg} REDG (want 0 ATOMG, REDG > 0)")
    if not checked:
        print("check_sass: no backward kernel object among the arguments", file=sys.stderr)
        return 2
    for f in failures:
        print("FAIL", f, file=sys.stderr)
    print(f"check_sass: {checked} kernels checked, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
