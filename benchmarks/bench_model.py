"""Model-level CPU benchmark: pp128 / pp512 / tg128 tokens/s through ``hanzo_torch.load``.

    python benchmarks/bench_model.py [--model PATH] [--threads 2] [--pp 128,512] [--tg 128] [--profile]

pp<N>: one forward of N prompt tokens (logits of the last position only, as generation does),
median of --reps runs after a warm-up. tg<N>: N single-token decode steps after a 16-token
prompt; tokens/s from the median step time. llama.cpp is not run here (llama-cpp-python is not
installed and building it would take ~15 min on 2 cores): the ratios below use the llama.cpp
numbers quoted in the issue for this machine (Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 2 threads:
pp128 99.5 tok/s, tg32 33.0 tok/s); they are NOT measured in the same run.
--profile: op counts and the share of one decode token spent outside the hanzo ops (host overhead).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter

import torch

import hanzo_torch
from hanzo_torch.ops import cpu as hcpu

DEFAULT_MODEL = os.path.expanduser("~/.cache/hanzo-torch/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
LLAMA_CPP_QUOTED = {"pp": 99.5, "tg": 33.0}  # tok/s, issue 5, same machine class, 2 threads


def pp_tokens_per_s(model, n: int, reps: int) -> float:
    ids = torch.randint(100, 20000, (1, n))
    ts = []
    for i in range(reps + 1):
        model.reset()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(ids, last_only=True)
        if i:  # first run is the warm-up (page-in of the mmap'd weights)
            ts.append(time.perf_counter() - t0)
    return n / statistics.median(ts)


def tg_tokens_per_s(model, n: int) -> tuple[float, list[float]]:
    model.reset()
    ids = torch.randint(100, 20000, (1, 16))
    with torch.inference_mode():
        logits = model(ids, last_only=True)
        tok = logits[:, -1].argmax(-1, keepdim=True)
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            logits = model(tok, last_only=True)
            tok = logits[:, -1].argmax(-1, keepdim=True)
            ts.append(time.perf_counter() - t0)
    return 1.0 / statistics.median(ts), ts


def profile_decode(model) -> None:
    from torch.profiler import ProfilerActivity, profile

    model.reset()
    with torch.inference_mode():
        model(torch.randint(100, 20000, (1, 16)), last_only=True)
        tok = torch.tensor([[1000]])
        model(tok, last_only=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            model(tok, last_only=True)
            wall = time.perf_counter() - t0
    counts, self_us = Counter(), Counter()
    for ev in prof.key_averages():
        counts[ev.key] = ev.count
        self_us[ev.key] = ev.cpu_time_total
    hanzo = {k: v for k, v in self_us.items() if k.startswith("hanzo::")}
    print(f"one decode token under the profiler: {wall * 1e3:.1f} ms wall")
    print(f"{'op':32s} {'calls':>6s} {'total ms':>9s}")
    for k in sorted(hanzo, key=lambda k: -hanzo[k]):
        print(f"{k:32s} {counts[k]:6d} {hanzo[k] / 1e3:9.2f}")
    mm = self_us.get("hanzo::mul_mat", 0) / 1e6
    print(f"hanzo op calls: {sum(counts[k] for k in hanzo)}; all aten/hanzo calls: {sum(counts.values())}")
    print(f"mul_mat share of the token: {mm / wall:.0%}; outside hanzo ops (host, glue ops): "
          f"{max(0.0, wall - sum(hanzo.values()) / 1e6) / wall:.0%}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pp", default="128,512")
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hcpu.build()
    print(f"threads={args.threads} isa={hcpu.ISA_NAMES[hcpu.default_isa()]} "
          f"fallback={os.environ.get('HANZO_MUL_MAT_FALLBACK', '0')}")
    model = hanzo_torch.load(args.model, max_context=1024)
    for n in (int(v) for v in args.pp.split(",") if v):
        tps = pp_tokens_per_s(model, n, args.reps)
        print(f"pp{n}: {tps:7.1f} tok/s   ({tps / LLAMA_CPP_QUOTED['pp']:.2f}x the quoted llama.cpp pp128)")
    if args.tg:
        tps, _ = tg_tokens_per_s(model, args.tg)
        print(f"tg{args.tg}: {tps:7.1f} tok/s   ({tps / LLAMA_CPP_QUOTED['tg']:.2f}x the quoted llama.cpp tg32)")
    if args.profile:
        profile_decode(model)


if __name__ == "__main__":
    main()
