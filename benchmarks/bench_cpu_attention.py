"""CPU attention kernel (hanzo_cpu.attention) at the real model's shapes: prefill and decode.

Qwen2.5-1.5B: 12 query heads, 2 KV heads, head dim 128. Prefill: a prompt of T tokens from
position 0 against a cache of S slots; decode: one token at position P. Prints the median and
range (min-max) of ``--reps`` timings, and the GFLOP/s of the causal work (4*D flops per visible
(query head, key) pair).

    python benchmarks/bench_cpu_attention.py --prefill 128,512,1024 --decode 100,1000
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import hanzo_torch  # noqa: F401
from hanzo_torch.backends.cpu import fused as cf


def timings(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", default="128,512,1024", help="prompt lengths T (from position 0)")
    ap.add_argument("--decode", default="100,1000", help="decode positions")
    ap.add_argument("--heads", default="12,2,128", help="Hq,Hk,D")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    Hq, Hk, D = (int(v) for v in args.heads.split(","))
    dtype = getattr(torch, args.dtype)
    S = 2048
    kc = torch.randn(1, S, Hk, D).to(dtype)
    vc = torch.randn(1, S, Hk, D).to(dtype)
    print(f"threads={args.threads} Hq={Hq} Hk={Hk} D={D} dtype={args.dtype}")
    cases = [("prefill", int(t)) for t in args.prefill.split(",") if t] + \
            [("decode", int(p)) for p in args.decode.split(",") if p]
    for kind, n in cases:
        if kind == "prefill":
            q = torch.randn(1, n, Hq, D).to(dtype)
            pos = torch.arange(n)[None]
            flop = 4 * D * Hq * n * (n + 1) / 2
        else:
            q = torch.randn(1, 1, Hq, D).to(dtype)
            pos = torch.tensor([[n]])
            flop = 4 * D * Hq * (n + 1)
        ts = timings(lambda: cf.attention(q, kc, vc, pos, D ** -0.5), args.reps)
        med = statistics.median(ts)
        print(f"{kind:8s} {n:5d}: {med * 1e6:10.1f} us (range {min(ts) * 1e6:.1f}-{max(ts) * 1e6:.1f})"
              f"  {flop / med / 1e9:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
