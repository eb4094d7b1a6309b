"""Busy phases of an nvidia-smi clock log (timestamp, clocks.sm, power.draw, event reasons; one row per sample):
a phase is a run of samples at a clock above idle (> 1000 MHz) whose gaps are shorter than 0.5 s. For each phase:
its length (trimmed to the samples between the first and the last below the top clock), the mean and
minimum SM clock, and the share of samples with the SW power cap (reason bit 0x4).
In the bench's run (flashmsa_bench --iters 50) the first phase holds select and the forwards, the last the backward
and the step (the host prepares the backward's inputs in between).
    python3 bench/tools/clock_phases.py [--bwd] clocks.csv
--bwd: also the mean clock over the first 0.8 s of the last phase (with --iters 50 at m3 32k, the backward's calls)."""
import sys
from datetime import datetime

rows = []
bwd = "--bwd" in sys.argv
for line in open([a for a in sys.argv[1:] if a != "--bwd"][0]):
    f = [x.strip() for x in line.split(",")]
    if len(f) < 4 or "MHz" not in f[1]:
        continue
    t = datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
    watts = next(x for x in f if x.endswith(" W"))  # (extra columns, e.g. the memory clock, are skipped)
    rows.append((t, float(f[1].split()[0]), float(watts.split()[0]), int(f[-1], 16)))
phases, cur = [], []
for r in rows:
    busy = r[1] > 1000 and r[2] > 150  # (the idle clock is 345 MHz; 1980 with ~120 W: awake, no work)
    if busy and cur and r[0] - cur[-1][0] > 0.5:
        phases.append(cur); cur = []
    if busy:
        cur.append(r)
if cur:
    phases.append(cur)
def from_first_low(p, to_last_low):
    """The samples of phase p from its first below the top clock (to its last below it with to_last_low): the power
    column is a ~1 s average that lags, the clock is the cap's real-time answer."""
    top = max(r[1] for r in p)
    low = [j for j, r in enumerate(p) if r[1] < top]
    return p[low[0]:low[-1] + 1 if to_last_low else len(p)] if low else p


for i, p in enumerate(phases):
    p = from_first_low(p, True)
    clk = [r[1] for r in p]
    cap = sum(1 for r in p if r[3] & 4) / len(p)
    print(f"  phase {i}: {p[-1][0] - p[0][0]:.2f} s, {len(p)} samples, SM clock mean {sum(clk) / len(clk):.0f} MHz, "
          f"min {min(clk):.0f}, power-capped {100 * cap:.0f}% of samples, last power {p[-1][2]:.0f} W")
if bwd and phases:
    p = from_first_low(phases[-1], False)
    head = [r[1] for r in p if r[0] - p[0][0] < 0.8]
    print(f"  last phase's first 0.8 s (the backward at --iters 50): SM clock mean {sum(head) / len(head):.0f} MHz")
