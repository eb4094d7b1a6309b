#!/usr/bin/env python3
"""CPU check of the regrouping with masks (src/cuda/fwd/fwd_regroup.cu): a lane-by-lane Python transliteration of its
regroup_kernel (the mask path at W = 2, 4, 8 words and the slot-by-slot path past 256 distinct blocks) against the host
rule of the GPU tests (distinct valid blocks, ties to the earliest), on 400 random spans: topk 1-64, NT 2-128, repeats,
invalid slots, partial spans. Prints the paths taken; fails on the first difference.
    python3 bench/tools/regroup_masks_emu.py  (~10 s)"""
import random
SPAN=128; KC=4; MW=8
def popc(x): return bin(x & 0xffffffff).count('1')
def host(idxs, span, K, NT):  # idxs: n lists of K
    n=len(idxs)
    sel=[sorted({j for j in row if 0<=j<=span}) for row in idxs]
    used=[False]*n; out=[]; pos=0
    while pos<n:
        u=set()
        for m in range(NT):
            if pos>=n: break
            best=-1; ba=0
            for c in range(n):
                if used[c]: continue
                add=sum(1 for j in sel[c] if j not in u)
                if m==0: add=0
                if best<0 or add<ba: best,ba=c,add
            used[best]=True; u.update(sel[best]); out.append(best); pos+=1
    return out
def kernel(idxs, span, K, NT):
    n=len(idxs)
    idx=[[None]*SPAN for _ in range(K)]  # slot-major, unwritten = None (garbage)
    for e in range(n*K):
        t,s=e//K,e%K; j=idxs[t][s]
        idx[s][t]= j if (j>=0 and j<=span) else -1
    left=[0]*32
    for lane in range(32):
        for k in range(KC):
            if lane+32*k<n: left[lane]|=1<<k
    out=[None]*n
    nwords=span//32+1
    ubits=[0]*nwords
    for lane in range(32):
        for e in range(lane, K*SPAN, 32):
            j= idx[e//SPAN][e%SPAN] if e%SPAN<n else -1
            if j>=0: ubits[j//32]|=1<<(j%32)
    wprefix=[0]*nwords; D=0
    for w in range(nwords):
        wprefix[w]=D; D+=popc(ubits[w])
    if D<=32*MW:
        W=2 if D<=64 else 4 if D<=128 else 8
        sel=[[[0]*MW for k in range(KC)] for lane in range(32)]
        for lane in range(32):
            for k in range(KC):
                c=lane+32*k
                if c>=n: continue
                for u in range(K):
                    j=idx[u][c]
                    if j<0: continue
                    i=wprefix[j//32]+popc(ubits[j//32]&((1<<(j%32))-1))
                    for w in range(MW):
                        if i//32==w: sel[lane][k][w]|=1<<(i%32)
        assert all(sel[l][k][w]==0 for l in range(32) for k in range(KC) for w in range(W,MW))
        pos=0
        while pos<n:
            U=[0]*W
            def place(c):
                nonlocal pos
                kc,src=c//32,c%32
                for w in range(W): U[w]|=sel[src][kc][w]
                left[src]&=~(1<<kc)
                out[pos]=c; pos+=1
            firsts=[]
            for lane in range(32):
                l=left[lane]
                firsts.append(lane+32*((l&-l).bit_length()-1) if l else 2**31-1)
            place(min(firsts))
            m=1
            while m<NT and pos<n:
                keys=[]
                for lane in range(32):
                    key=2**31-1
                    for k in range(KC):
                        add=sum(popc(sel[lane][k][w]&~U[w]) for w in range(W))
                        if (left[lane]>>k)&1: key=min(key, add<<8 | (lane+32*k))
                    keys.append(key)
                place(min(keys)&0xff); m+=1
        return out,('mask',W)
    # fallback: dedup, then slot lookups
    for lane in range(32):
        for k in range(KC):
            c=lane+32*k
            if c>=n: continue
            for u in range(1,K):
                j=idx[u][c]
                if j<0: continue
                if any(idx[v][c]==j for v in range(u)): idx[u][c]=-1
    pos=0
    while pos<n:
        ub=[0]*nwords
        def place(c):
            nonlocal pos
            for s in range(K):
                j=idx[s][c]
                if j>=0: ub[j//32]|=1<<(j%32)
            left[c%32]&=~(1<<(c//32)); out[pos]=c; pos+=1
        firsts=[]
        for lane in range(32):
            l=left[lane]; firsts.append(lane+32*((l&-l).bit_length()-1) if l else 2**31-1)
        place(min(firsts)); m=1
        while m<NT and pos<n:
            keys=[]
            for lane in range(32):
                key=2**31-1
                for k in range(KC):
                    if not (left[lane]>>k)&1: continue
                    c=lane+32*k
                    add=sum(1 for u in range(K) if idx[u][c]>=0 and not (ub[idx[u][c]//32]>>(idx[u][c]%32))&1)
                    key=min(key, add<<8|c)
                keys.append(key)
            place(min(keys)&0xff); m+=1
    return out,('fallback',0)
rng=random.Random(7)
stats={}
for trial in range(400):
    K=rng.choice([1,2,4,8,16,16,32,64]); NT=rng.choice([2,4,8,8,32,64,128])
    span=rng.choice([0,1,5,40,63,64,100,200,255,256,300,700,1000])
    n=rng.choice([128,128,128,1,7,77,127])
    mode=rng.random()
    idxs=[]
    for t in range(n):
        row=[]
        for s in range(K):
            d=rng.random()
            if d<0.05: row.append(rng.choice([-1,-5,span+1,span+7,2**31-1]))
            elif d<0.12 and row: row.append(rng.choice(row))  # a repeat
            elif mode<0.4: row.append(max(0, span - rng.randrange(0, 6)) if rng.random()<0.6 else rng.randrange(0, span+1))  # clustered-ish
            else: row.append(rng.randrange(0, span+1))
        idxs.append(row)
    want=host(idxs,span,K,NT)
    got,path=kernel(idxs,span,K,NT)
    stats[path]=stats.get(path,0)+1
    assert got==want, (trial,K,NT,span,n,path)
    assert sorted(got)==list(range(n))
print('all equal', stats)
