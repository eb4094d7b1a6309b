#!/usr/bin/env python3
"""Checks on the compiled kernels' machine code (SASS) that CI can run without a GPU.

The default (non-deterministic, kDet = false) backward kernels must add their gradients with
REDG (a reduction that does not wait for a reply), never ATOMG (the default fused kernel's store-first dq words,
dq_writer.cuh, are the one exception: a 64-bit acquire ATOMG whose reply says whether the contribution is a row's
first, and a 64-bit release REDG that publishes a first store; no gradient is added with them); the main and fused
kernels add dQ
through their dQ writer warp's bulk reductions (cp.reduce.async.bulk: UBLKRED ... ADD.F32, the
TMA engine adding a token slot's rows of the shared-memory dQ tile), which must be there; the
fused kernel's kl walk adds its dQp the same way, so the fused kernel holds at least twice the
main kernel's bulk adds (two writer loops). The fused kernel's producer chunk loops hand the token slots to the
gathering warps by shuffles, with no named barrier of the 96 gathering threads (compute-sanitizer
racecheck reported the item broadcast while they had one); the standalone main kernel keeps that
barrier, which shows the pattern matches. The deterministic main and kl
kernels (kDet = true) add 64-bit fixed-point integers (bwd_params.cuh), whose sum does not depend
on the order: they must hold 64-bit REDG adds, and no GPU-scope fence and no ATOMG. Every
instantiation must be there, and no kernel's wgmma (forward and
selection included) may be serialised by ptxas (C7515: a wait after every HGMMA), which a branch
around a wgmma or a write to an accumulator in flight causes. A fence anywhere in a kernel (a
__threadfence) makes ptxas compile every atomicAdd of the kernel as ATOMG: that cost the main
backward kernel 38% on the H200 (27.3 -> 37.7 ms at m3 32k) while deterministic code with a fence
shared its instantiation, and it is why the deterministic mode adds fixed-point integers, which
need no order and no fence. docs/kernels/bwd.md has the design.

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


# The backward kernels: (kernel name, instantiations expected). Each is a template on the
# element type (bf16, fp16) and on kDet.
KERNELS = {"bwd_main_kernel": 2, "bwd_fused_kernel": 2}
KDET = re.compile(r"Lb([01])E")  # the mangled bool template argument kDet
ATOMIC = re.compile(r"\bATOMG?\.E\.")  # global or generic atomics that return a value
REDUCTION = re.compile(r"\bREDG\.E\.")  # fire-and-forget global reductions
FIXED_ADD = re.compile(r"\bREDG\.E\.ADD\.64\b")  # the deterministic mode's 64-bit integer adds
FIXED_KERNELS = ("bwd_main_kernel", "bwd_fused_kernel")  # deterministic in fixed point
BULK_ADD = re.compile(r"\bUBLKRED\.G\.S\.ADD\.F32\b")  # the dQ writers' adds (default main and fused kernels)
GPU_FENCE = re.compile(r"\bMEMBAR\.[A-Z.]*GPU\b")
# The fused kernel's persistent CTAs take items from a counter: one 32-bit ATOMG.E.ADD per item
# (one copy in each role's loop), whose returned value is the item. Not a gradient add.
ITEM_COUNTER = re.compile(r"\bATOMG\.E\.ADD\.STRONG\.GPU\s")
ITEM_COUNTERS = {"bwd_fused_kernel": 2}
# The default fused kernel's dQ writer keeps a 64-bit word per (token, proxy head) (dq_writer.cuh): the arrivals'
# ATOMG.E.ADD.64 (the reply: is this the row's first contribution) and the first stores' release REDG.E.ADD.64. In that
# kernel only, and there they must be; they add no gradient.
DQ_WORD_ATOM = re.compile(r"\bATOMG\.E\.ADD\.64\.STRONG\.GPU\s")
DQ_WORD_RED = re.compile(r"\bREDG\.E\.ADD\.64\.STRONG\.GPU\s")
DQ_WORD_KERNELS = ("bwd_fused_kernel",)
BULK_STORE = re.compile(r"\bUBLKCP\.G\.S\b")  # the first stores' bulk copies (shared -> global)
HGMMA = re.compile(r"\bHGMMA\.")
DEPBAR = re.compile(r"\bWARPGROUP\.DEPBAR\b")
# a named barrier of the 96 gathering producer threads (NamedBarrier::kGatherers, bar.sync id, 0x60)
GATHER_BARRIER = re.compile(r"\bBAR\.SYNC(?:\.DEFER_BLOCKING)?\s+(?:0x[0-9a-f]+|R\d+),\s*0x60\b")
# A named barrier of both consumer warpgroups (NamedBarrier::kConsumers, 256 threads) and a stmatrix store.
CONSUMER_BARRIER = re.compile(r"\bBAR\.SYNC(?:\.DEFER_BLOCKING)?\s+(?:0x[0-9a-f]+|R\d+),\s*0x100\b")
STSM = re.compile(r"\bSTSM\.")
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/")  # an instruction line of cuobjdump -sass: /*address*/ opcode ...
BRANCH = re.compile(r"\b(?:BRA|BRX|JMP|JMX|RET|EXIT)\b")
BRANCH_TARGET = re.compile(r"\bBRA(?:\.[A-Z]+)*\s+(?:[!A-Z0-9]+,\s*)?(?:`\()?0x([0-9a-f]+)")


def address(line: str) -> int:
    return int(INSTRUCTION.search(line).group(0).strip("/*"), 16)


# The walks that stage a tile both consumer warpgroups read (the main walk's dS^T for dQ = dS K, the kl walk's dz^T for
# dQp = dz Kp): each warpgroup stmatrix-stores its half, the consumers meet, and each issues a GEMM that reads both
# halves from shared memory. The main walk's dS^T has one buffer (bwd_kernel.cuh: the room of a second one holds the
# third pipeline stage), so after that GEMM's wait the consumers must meet again before either stores the next chunk's
# dS^T: a warpgroup that ran ahead would overwrite the tile the other's GEMM is still reading. The tests cannot produce
# that skew (a warpgroup four GEMMs behind the other) and compute-sanitizer racecheck does not see wgmma's reads (a build
# with the barrier removed passed 13 tests and racecheck). So the code is checked here: from the
# wait of every GEMM issued right after a consumers' barrier, every path of the control flow (branches followed, the
# chunk loop's back edge included) meets a consumers' barrier before a stmatrix store. The removed barrier fails it in
# all four main and fused instantiations.
# STAGED_GEMMS: how many such GEMMs each kernel holds (the main walk's dQ; the fused kernel also the kl walk's dQp),
# exactly: the check cannot pass by recognising fewer.
STAGED_GEMMS = {"bwd_main_kernel": 1, "bwd_fused_kernel": 2}


def successors(lines: list[str], k: int, at: dict[int, int]) -> list[int]:
    """The instructions that can run after lines[k]: the next one unless k is an unconditional branch or exit, and a
    branch's target. A branch with a predicate (@P, @!P) or a second operand (BRA.DIV URx, target; BRA.U !UPx, target)
    is conditional. An indirect branch (BRX, JMX) or a return ends the path (none in the checked kernels' loops)."""
    ins = lines[k].split("*/", 1)[-1].split(";", 1)[0].strip()
    predicated = ins.startswith("@")
    op = ins.split()[1] if predicated and len(ins.split()) > 1 else (ins.split() or [""])[0]
    nxt = [k + 1] if k + 1 < len(lines) else []
    if op.startswith(("EXIT", "RET", "BRX", "JMX")):
        return nxt if predicated else []
    m = BRANCH_TARGET.search(ins)
    if op.startswith("BRA") and m:
        target = at.get(int(m.group(1), 16))
        targets = [target] if target is not None else []
        conditional = predicated or "," in ins
        return targets + (nxt if conditional else [])
    return nxt


def staged_gemm_barriers(text: str) -> tuple[int, list[str]]:
    """(GEMMs after a consumers' barrier, the addresses of the barriers before those from whose wait some path of the
    control flow reaches a stmatrix store without passing a consumers' barrier)."""
    lines = [line for line in text.splitlines() if INSTRUCTION.search(line)]
    at = {address(line): k for k, line in enumerate(lines)}
    found, bad = 0, []
    for i, line in enumerate(lines):
        if not CONSUMER_BARRIER.search(line):
            continue
        # a GEMM issued right after the barrier: an HGMMA among the next 16 instructions, with no branch, barrier or
        # stmatrix store before it (its descriptors' setup and the WARPGROUP.ARRIVE only)
        j = next((x for x in range(i + 1, min(len(lines), i + 17))
                  if HGMMA.search(lines[x]) or BRANCH.search(lines[x]) or CONSUMER_BARRIER.search(lines[x]) or
                  STSM.search(lines[x])), None)
        if j is None or not HGMMA.search(lines[j]):
            continue
        found += 1
        while j < len(lines) and not DEPBAR.search(lines[j]):  # that GEMM's wait
            j += 1
        if j >= len(lines):  # no wait at all: the GEMM's reads are never known to be done
            bad.append(f"{address(lines[i]):x}")
            continue
        # every path from the wait (through branches, the chunk loop's back edge included) must meet a consumers'
        # barrier before a stmatrix store
        seen, todo, reached = set(), [j], False
        while todo and not reached:
            k = todo.pop()
            if k in seen:
                continue
            seen.add(k)
            if CONSUMER_BARRIER.search(lines[k]):
                continue
            if STSM.search(lines[k]):
                reached = True
                break
            todo.extend(successors(lines, k, at))
        if reached:
            bad.append(f"{address(lines[i]):x}")
    return found, bad


def main(argv: list[str]) -> int:
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if argv[:1] == ["--tools"]:
        print(f"cuobjdump: {cuobjdump}\nnvdisasm: {nvdisasm}")
        return 0 if cuobjdump and nvdisasm else 1
    if not cuobjdump or not nvdisasm:
        print("check_sass: cuobjdump and nvdisasm are needed (pip install -r requirements-sass.txt)",
              file=sys.stderr)
        return 2
    seen = {(k, det): 0 for k in KERNELS for det in (0, 1)}
    failures, wgmma_kernels = [], 0
    bulk_default = {}  # (kernel, element type) -> bulk fp32 adds of the default instantiation
    for obj in argv:
        if not obj.endswith(".cu.o"):
            continue
        for kname, text in sass(obj, cuobjdump, nvdisasm).items():
            mmas, waits = len(HGMMA.findall(text)), len(DEPBAR.findall(text))
            if mmas:
                wgmma_kernels += 1
                # ptxas serialises every wgmma of a kernel when it cannot prove an accumulator
                # safe (info C7515): a wait after each HGMMA. The kernels wait a few times per chunk.
                if waits * 2 > mmas:
                    failures.append(f"{kname}: {waits} wgmma waits for {mmas} HGMMA (serialised wgmma, ptxas C7515?)")
            kernel = next((k for k in KERNELS if k in kname), None)
            m = KDET.search(kname)
            if not kernel or not m:
                continue
            det = int(m.group(1))
            seen[(kernel, det)] += 1
            atomics, reds, fences, fixed, bulk = (len(r.findall(text))
                                                  for r in (ATOMIC, REDUCTION, GPU_FENCE, FIXED_ADD, BULK_ADD))
            gathers = len(GATHER_BARRIER.findall(text))
            if (kernel == "bwd_fused_kernel") == (gathers > 0):
                failures.append(f"{kname}: {gathers} named barriers of the 96 gathering threads (the fused kernel "
                                f"must hand its token slots over by shuffles, the main kernel by the barrier)")
            staged, unguarded = staged_gemm_barriers(text) if kernel in STAGED_GEMMS else (0, [])
            if kernel in STAGED_GEMMS and (staged != STAGED_GEMMS[kernel] or unguarded):
                failures.append(f"{kname}: {staged} GEMMs on a tile both consumer warpgroups staged (expected "
                                f"{STAGED_GEMMS[kernel]}); no consumers' barrier between the GEMM's wait "
                                f"and the next stmatrix store after the barriers at {unguarded} (the next "
                                f"chunk's dS^T would overwrite the tile the other warpgroup still reads)")
            counters = len(ITEM_COUNTER.findall(text))
            if counters != ITEM_COUNTERS.get(kernel, 0):
                failures.append(f"{kname}: {counters} item-counter ATOMG, expected {ITEM_COUNTERS.get(kernel, 0)}")
            atomics -= counters
            word_atoms, word_reds = 0, 0
            if det == 0:
                word_atoms, word_reds = len(DQ_WORD_ATOM.findall(text)), len(DQ_WORD_RED.findall(text))
                if (kernel in DQ_WORD_KERNELS) != (word_atoms > 0 and word_reds > 0) or (
                        kernel not in DQ_WORD_KERNELS and (word_atoms or word_reds)):
                    failures.append(f"{kname}: {word_atoms} 64-bit ATOMG and {word_reds} 64-bit REDG of the dq words "
                                    f"(the default fused kernel's store-first dQ writer must have both, no other "
                                    f"default kernel either)")
                if kernel in DQ_WORD_KERNELS and not BULK_STORE.search(text):
                    failures.append(f"{kname}: no bulk store (UBLKCP.G.S): the store-first dQ writer's first stores")
                atomics -= word_atoms
                reds -= word_reds
                fixed -= word_reds
            print(f"{kernel} kDet={det} ({os.path.basename(obj)}): REDG {reds} (64-bit integer {fixed}), "
                  f"bulk fp32 adds {bulk}, dq words {word_atoms} ATOMG + {word_reds} REDG, ATOMG/ATOM {atomics}, GPU fences {fences}, HGMMA {mmas}, wgmma waits {waits}, "
                  f"GEMMs on staged tiles {staged}")
            if det == 0 and (atomics or not reds or fixed):
                failures.append(f"{kname}: {atomics} ATOMG/ATOM, {reds} REDG, {fixed} 64-bit (the default kernel "
                                f"must add fp32 with REDG only)")
            if det == 0 and kernel in FIXED_KERNELS:
                bulk_default[(kernel, "half" if "half_t" in kname else "bfloat16")] = (bulk, kname)
            if kernel in FIXED_KERNELS and (det == 0) != (bulk > 0):
                failures.append(f"{kname}: {bulk} bulk fp32 adds (the default kernel's dQ writer must add the dQ "
                                f"tile with cp.reduce.async.bulk, the deterministic kernel not at all)")
            if det == 1 and kernel in FIXED_KERNELS and (atomics or fences or not fixed):
                failures.append(f"{kname}: {atomics} ATOMG/ATOM, {fences} GPU fences, {fixed} 64-bit REDG (the "
                                f"fixed-point deterministic kernel must add 64-bit integers with REDG, fence-free)")
    # the fused kernel's two walks each have a dQ writer loop (main: dQ, kl: dQp)
    for (kernel, elem), (bulk, kname) in bulk_default.items():
        main = bulk_default.get(("bwd_main_kernel", elem))
        if kernel == "bwd_fused_kernel" and main and bulk < 2 * main[0]:
            failures.append(f"{kname}: {bulk} bulk fp32 adds, the main kernel {main[0]} (the fused kernel's main "
                            f"and kl walks must both add through a dQ writer: at least twice as many)")
    for (kernel, det), n in seen.items():
        if n != KERNELS[kernel]:
            failures.append(f"{kernel} kDet={det}: {n} instantiations found, expected {KERNELS[kernel]}")
    for f in failures:
        print("FAIL", f, file=sys.stderr)
    print(f"check_sass: {sum(seen.values())} backward kernels, {wgmma_kernels} wgmma kernels checked, "
          f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
