#!/usr/bin/env python3
"""Emulation of the pipeline protocol of the forward's FLASHMSA_FWD_WG_LISTS knob (fwd_kernel.cuh,
docs/kernels/fwd.md "Session 9"): a K and a V producer thread, two consumer warpgroups with their
own lists of union entries processed in runs of consecutive entries, stage tags, and the
producers' stand-in arrivals on the empty barriers for a warpgroup that skips an entry. mbarrier
phases are modelled with their parity waits. Random interleavings and load latencies; checks that
every consumer reads the entry it waited for, that no stage is overwritten while a consumer holds
it, and that nothing deadlocks.

    python3 scripts/emulate_fwd_wg_lists.py [RUNS]             # the protocol as built: passes
    python3 scripts/emulate_fwd_wg_lists.py [RUNS] --no-tag    # without the tag wait: a stale stage
    python3 scripts/emulate_fwd_wg_lists.py [RUNS] --no-runs   # V held across skipped entries: deadlock

The two negative controls show what the tag and the runs are for (the model can fail)."""
import random
import sys

NO_TAG = "--no-tag" in sys.argv
NO_RUNS = "--no-runs" in sys.argv

S = 2  # stages per pipeline

class Pipe:
    def __init__(self):
        self.c_full = [0] * S      # completed full phases per stage
        self.c_empty = [0] * S     # completed empty phases
        self.arr = [0] * S         # arrivals in the current empty phase (2 complete it)
        self.tag = [-1] * S
        self.landed = [-1] * S     # entry whose data is in the stage
        self.inflight = []         # (stage, entry) loads not landed yet
        self.users = [set() for _ in range(S)]  # consumers holding the stage
    def arrive(self, s, who):
        self.arr[s] += 1
        if self.arr[s] == 2:
            self.arr[s] = 0
            self.c_empty[s] += 1

def run(ulen, act, seed):
    rnd = random.Random(seed)
    pk, pv = Pipe(), Pipe()
    lists = [[q for q in range(ulen) if act[w][q]] for w in range(2)]
    # producers: generator per pipe
    def producer(pipe, name):
        for qi in range(ulen):
            s = qi % S
            phase_p = ((qi // S) & 1) ^ 1
            while not ((pipe.c_empty[s] & 1) != phase_p):
                yield False
            assert not pipe.users[s], f"{name}: stage {s} overwritten while held by {pipe.users[s]} (entry {qi})"
            pipe.tag[s] = qi
            for w in range(2):
                if not act[w][qi]:
                    pipe.arrive(s, f"standin{w}")
            pipe.inflight.append((s, qi))
            yield True
    def wait(pipe, qi, w, what):
        s = qi % S
        while pipe.tag[s] != qi and not NO_TAG:
            yield False
        ph = (qi // S) & 1
        while not ((pipe.c_full[s] & 1) != ph):
            yield False
        assert pipe.landed[s] == qi, f"WG{w} {what}: waited for entry {qi}, stage {s} holds {pipe.landed[s]}"
        pipe.users[s].add((w, qi))
    def release(pipe, qi, w):
        s = qi % S
        pipe.users[s].discard((w, qi))
        pipe.arrive(s, f"WG{w}")
    def consumer(w):
        my = lists[w]
        k0 = 0
        while k0 < len(my):
            k1 = k0 + 1
            while k1 < len(my) and (NO_RUNS or my[k1] == my[k1 - 1] + 1):
                k1 += 1
            first, last = my[k0], my[k1 - 1]
            yield from wait(pk, first, w, "K"); yield True
            release(pk, first, w); yield True
            for idx in range(k0 + 1, k1):  # S of entry qi issued before P V of the previous one
                qi, prev = my[idx], my[idx - 1]
                yield from wait(pk, qi, w, "K"); yield True
                yield from wait(pv, prev, w, "V"); yield True
                release(pk, qi, w); yield True
                release(pv, prev, w); yield True
            yield from wait(pv, last, w, "V"); yield True
            release(pv, last, w); yield True
            k0 = k1
    actors = {"PK": producer(pk, "K"), "PV": producer(pv, "V"), "W0": consumer(0), "W1": consumer(1)}
    done = set()
    stuck = 0
    while len(done) < 4 or pk.inflight or pv.inflight:
        progressed = False
        # land some loads
        for pipe in (pk, pv):
            if pipe.inflight and rnd.random() < 0.3:
                s, qi = pipe.inflight.pop(0)
                pipe.landed[s] = qi
                pipe.c_full[s] += 1
                progressed = True
        names = [n for n in actors if n not in done]
        rnd.shuffle(names)
        for n in names[: rnd.randint(1, len(names))] if names else []:
            try:
                if next(actors[n]):
                    progressed = True
            except StopIteration:
                done.add(n)
                progressed = True
        stuck = 0 if progressed else stuck + 1
        if stuck > 2000:
            raise RuntimeError(f"deadlock: done {done}, K tags {pk.tag} full {pk.c_full} empty {pk.c_empty}, "
                               f"V tags {pv.tag} full {pv.c_full} empty {pv.c_empty}")
    return True

def main():
    trials = 0
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    for seed in range(int(args[0]) if args else 3000):
        rnd = random.Random(seed)
        ulen = rnd.randint(1, 40)
        mode = rnd.choice(["random", "clustered", "one_wg", "dense"])
        act = [[False] * ulen for _ in range(2)]
        for q in range(ulen):
            if mode == "dense":
                a = (True, True)
            elif mode == "one_wg":
                a = (True, False)
            else:
                p = 0.35 if mode == "random" else 0.8
                a = (rnd.random() < p, rnd.random() < p)
                if not any(a):
                    a = (True, False) if rnd.random() < 0.5 else (False, True)
            act[0][q], act[1][q] = a
        run(ulen, act, seed)
        trials += 1
    print(f"protocol emulation: {trials} runs, every wait got its entry, no stage overwritten while held, no deadlock")

if __name__ == "__main__":
    main()
