"""CPU attention kernel (hanzo_cpu.attention) at the real model's shapes: prefill and decode.

Qwen2.5-1.5B: 12 query heads, 2 KV heads, head dim 128. Prefill: a prompt of T tokens from
position 0 against a cache of S slots; decode: one token at position P. Prints the median and
range (min-max) of ``--reps`` timings, and the GFLOP/s of the causal work (4*D flops per visible
(query head, key) pair). Calls of T > 1 tokens run once per kernel of ``--paths`` (``flash``: the
online-softmax tiles, the default kernel; ``gemm``: the earlier BLAS GEMM tiles; ``flash-dot``:
the flash tiles scored by dot products over D), the kernels
alternating within each repetition so that load hits both alike; one-token calls likewise per
kernel of ``--decode-paths`` (``flash``: the same tiles, the default; ``rows``: split-K row by
row). ``--kv`` picks the KV cache element format, ``--depth`` the tokens already in the cache
before the prompt.

    python benchmarks/bench_cpu_attention.py --prefill 128,512,1024 --decode 100,1000 [--kv f16]
        [--paths flash,gemm] [--decode-paths flash,rows] [--depth 0]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import hanzo_torch  # noqa: F401
from hanzo_torch.backends.cpu import fused as cf
from hanzo_torch.ops import fused as ref


def timings(fns: dict, reps: int) -> dict:
    """{name: [seconds per call]} for each function, called alternately ``reps`` times after a warm-up."""
    out = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            out[k].append(time.perf_counter() - t)
    return out


def under(path: str, fn, use=cf.use_attention_prefill):
    def run():
        with use(path):
            return fn()
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", default="128,512,1024", help="prompt lengths T (from position 0)")
    ap.add_argument("--decode", default="100,1000", help="decode positions")
    ap.add_argument("--heads", default="12,2,128", help="Hq,Hk,D")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--kv", default="f32", choices=list(ref.KV_CACHE_DTYPES), help="KV cache element format")
    ap.add_argument("--paths", default="flash,gemm", help="kernels of T > 1 calls to compare: flash, gemm, flash-dot")
    ap.add_argument("--decode-paths", default="flash,rows", help="kernels of one-token calls: flash, rows")
    ap.add_argument("--depth", type=int, default=0, help="prefill: tokens already in the cache")
    args = ap.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    bad = [p for p in paths if p not in cf.ATTENTION_PREFILL_PATHS]
    if bad or not paths:
        ap.error(f"--paths: {bad or paths} not in {cf.ATTENTION_PREFILL_PATHS}")
    dpaths = [p for p in args.decode_paths.split(",") if p]
    if not dpaths or any(p not in cf.ATTENTION_DECODE_PATHS for p in dpaths):
        ap.error(f"--decode-paths: {dpaths} not in {cf.ATTENTION_DECODE_PATHS}")
    torch.set_num_threads(args.threads)
    Hq, Hk, D = (int(v) for v in args.heads.split(","))
    dtype = getattr(torch, args.dtype)
    cases = [("prefill", int(t)) for t in args.prefill.split(",") if t] + \
            [("decode", int(p)) for p in args.decode.split(",") if p]
    S = max([2048] + [args.depth + n for k, n in cases if k == "prefill"] + [n + 1 for k, n in cases if k == "decode"])
    kc = ref.kv_to_cache(torch.randn(1, S, Hk, D), ref.KV_CACHE_DTYPES[args.kv]).contiguous()
    vc = ref.kv_to_cache(torch.randn(1, S, Hk, D), ref.KV_CACHE_DTYPES[args.kv]).contiguous()
    print(f"threads={args.threads} Hq={Hq} Hk={Hk} D={D} dtype={args.dtype} kv={args.kv} depth={args.depth}")
    for kind, n in cases:
        if kind == "prefill":
            q = torch.randn(1, n, Hq, D).to(dtype)
            pos = torch.arange(args.depth, args.depth + n)[None]
            flop = 4 * D * Hq * (n * args.depth + n * (n + 1) / 2)
        else:
            q = torch.randn(1, 1, Hq, D).to(dtype)
            pos = torch.tensor([[n]])
            flop = 4 * D * Hq * (n + 1)
        call = lambda: cf.attention(q, kc, vc, pos, D ** -0.5)  # noqa: E731
        fns = {p: under(p, call) for p in paths} if kind == "prefill" else \
            {p: under(p, call, cf.use_attention_decode) for p in dpaths}
        for name, ts in timings(fns, args.reps).items():
            med = statistics.median(ts)
            print(f"{kind:8s} {n:5d} {name:6s}: {med * 1e6:10.1f} us (range {min(ts) * 1e6:.1f}-{max(ts) * 1e6:.1f})"
                  f"  {flop / med / 1e9:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
