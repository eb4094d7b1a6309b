"""The dense (warmup) forward with its kl value (compute_kl=True, no grad: what evaluation and torch.compile run in
warmup mode), timed with the library of FLASHMSA_LIBRARY (or .gpu/libflashmsa.so): one JSON line.

    FLASHMSA_LIBRARY=$PWD/.gpu/libflashmsa_fdk.so python3 bench/probes/dense_kl_fwd_time.py --config m3 --seqlen 32768
"""
import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/
import user_path as U  # noqa: E402
from run_bench import CONFIGS  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="m3", choices=sorted(CONFIGS))
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    flashmsa = U.import_flashmsa()
    cfg = CONFIGS[a.config]
    q, k, v, qp, kp, cu = (x.detach() for x in U.make_inputs(cfg, a.seqlen, "clustered", torch.device("cuda")))

    def run(compute_kl):
        def f():
            with torch.no_grad():
                return flashmsa.msa_attention(q, k, v, qp, kp, cfg["topk"], cu_seqlens=cu, max_seqlen=a.seqlen,
                                              warmup=True, compute_kl=compute_kl)
        return f

    kl = run(True)()[1].item()
    with_kl = U.median_ms(run(True), lambda: None, a.iters, 2, 1)
    without = U.median_ms(run(False), lambda: None, a.iters, 2, 1)
    print(json.dumps(dict(library=str(flashmsa.library_path()), config=a.config, seqlen=a.seqlen, kl=kl,
                          dense_fwd_kl_ms=with_kl, dense_fwd_ms=without, kl_ms=with_kl - without)))


if __name__ == "__main__":
    main()
