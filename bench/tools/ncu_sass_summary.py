#!/usr/bin/env python3
"""Summarise an Nsight Compute source page (SASS, CSV) of one kernel: where the warps stall,
which instructions dominate, and local-memory (spill) traffic. The CSV comes from

    ncu --set full --import-source no --kernel-name KERNEL --launch-skip 1 --launch-count 1 -o rep BINARY ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv

    python3 bench/tools/ncu_sass_summary.py sass.csv [--top 25] [--region START:END]

--region limits the instruction mix to an address range (hex offsets from the kernel's first
instruction), e.g. the consumer warpgroups' loop, which the "by 4 KiB" table helps to find.
"""
import argparse
import collections
import csv


def num(row, ix, key):
    try:
        return float(row[ix[key]].replace(",", ""))
    except (KeyError, ValueError, IndexError):
        return 0.0


def opcode(src):
    parts = src.split()
    if not parts:
        return "?"
    op = parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]
    return op.split(".")[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--region", default=None, help="START:END hex offsets")
    a = ap.parse_args()
    rows = list(csv.reader(open(a.csv)))
    hdr_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr, data = rows[hdr_at], [r for r in rows[hdr_at + 1:] if r and r[0].startswith("0x")]
    ix = {h: i for i, h in enumerate(hdr)}
    samples_key = "Warp Stall Sampling (All Samples)"
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    base = int(data[0][0], 16)
    off = [int(r[0], 16) - base for r in data]
    total = sum(num(r, ix, samples_key) for r in data) or 1.0
    print(f"{len(data)} instructions, {total:.0f} stall samples")

    print("\nstall samples by 4 KiB of code (find the loops):")
    by_page = collections.Counter()
    for o, r in zip(off, data):
        by_page[o // 0x1000] += num(r, ix, samples_key)
    for page in sorted(by_page):
        if by_page[page]:
            print(f"  0x{page * 0x1000:06x}  {100 * by_page[page] / total:5.1f}%")

    print(f"\ntop {a.top} instructions by stall samples:")
    for o, r in sorted(zip(off, data), key=lambda x: -num(x[1], ix, samples_key))[:a.top]:
        s = num(r, ix, samples_key)
        why = sorted(((num(r, ix, k), k) for k in stalls), reverse=True)[:2]
        print(f"  0x{o:06x} {100 * s / total:5.1f}%  {r[ix['Source']][:58]:58s} "
              + "  ".join(f"{k[6:]}:{100 * v / max(s, 1):.0f}%" for v, k in why if v))

    lo, hi = 0, max(off) + 1
    if a.region:
        lo, hi = (int(x, 16) for x in a.region.split(":"))
    sel = [(o, r) for o, r in zip(off, data) if lo <= o < hi]
    execd = collections.Counter()
    sampled = collections.Counter()
    reasons = collections.Counter()
    for o, r in sel:
        op = opcode(r[ix["Source"]])
        execd[op] += num(r, ix, "Instructions Executed")
        sampled[op] += num(r, ix, samples_key)
        for k in stalls:
            reasons[k] += num(r, ix, k)
    n_exec = sum(execd.values()) or 1.0
    n_samp = sum(sampled.values()) or 1.0
    print(f"\nregion 0x{lo:06x}..0x{hi:06x}: {n_exec / 1e6:.1f} M warp instructions executed")
    print("  opcode        executed    share   stall share")
    for op, v in execd.most_common(a.top):
        print(f"  {op:12s} {v / 1e6:9.1f}M  {100 * v / n_exec:5.1f}%  {100 * sampled[op] / n_samp:5.1f}%")
    print("  stall reasons: " + ", ".join(f"{k[6:]} {100 * v / (sum(reasons.values()) or 1):.0f}%"
                                          for k, v in reasons.most_common(6)))
    loc = [(o, r) for o, r in sel if opcode(r[ix["Source"]]) in ("LDL", "STL")]
    print(f"  local memory (spills): {len(loc)} instructions, "
          f"{sum(num(r, ix, 'Instructions Executed') for _, r in loc) / 1e6:.1f} M executed")


if __name__ == "__main__":
    main()
