"""Kernel-level CPU benchmark: mat-vec GB/s of weight bytes vs measured read bandwidth, GEMM GFLOP/s.

    python benchmarks/bench_cpu_kernels.py [--formats Q4_K,Q6_K] [--threads 2] [--gemm-m 128,512]

Mat-vec (decode, M=1): a set of weights totalling > 4x the last-level cache is cycled so the
weights stream from DRAM as they do in a model; GB/s counts packed weight bytes read per second.
The read bandwidth is measured in the same run (torch sum over a 1 GiB float32 tensor), so the
ratio is a same-machine, same-load number. GEMM (prefill): GFLOP/s = 2*M*N*K / time.
Ratios are what to quote (a loaded 2-core machine moves absolute numbers).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_cpu_kernels import random_blocks  # noqa: E402

from hanzo_torch.ops import cpu as hcpu  # noqa: E402

GT = gguf.GGMLQuantizationType


STAT = min
"""Statistic over repetitions: ``min`` (default; on a shared, loaded machine the fastest run is the
one least disturbed by other processes) or ``statistics.median`` (--median)."""


def timeit(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return STAT(ts)


def read_bandwidth_gbs() -> float:
    t = torch.ones(256 << 20, dtype=torch.float32)  # 1 GiB
    s = timeit(lambda: t.sum(), reps=7)
    return t.numel() * 4 / s / 1e9


def bench_matvec(qtype: str, N: int, K: int, isa: str, total_bytes: float) -> tuple[float, float]:
    one = random_blocks(qtype, N, K, seed=0)
    n_copies = max(2, int(total_bytes // one.numel()) + 1)
    ws = [one.clone() for _ in range(n_copies)]
    x = torch.randn(1, K)
    ext = hcpu.extension()
    tid, lvl = int(GT[qtype]), hcpu._ISA_BY_NAME[isa]

    def run():
        for w in ws:
            ext.mul_mat(x, w, tid, lvl, 8)

    s = timeit(run, reps=7, warmup=1)
    per_call_us = s / n_copies * 1e6
    return one.numel() * n_copies / s / 1e9, per_call_us


def bench_gemm(qtype: str, M: int, N: int, K: int, isa: str) -> float:
    w = random_blocks(qtype, N, K, seed=0)
    x = torch.randn(M, K)
    ext = hcpu.extension()
    tid, lvl = int(GT[qtype]), hcpu._ISA_BY_NAME[isa]
    s = timeit(lambda: ext.mul_mat(x, w, tid, lvl, 0), reps=5, warmup=1)
    return 2 * M * N * K / s / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="Q4_K,Q6_K,Q4_0,Q8_0,Q5_K,Q5_0,Q2_K,Q3_K,IQ4_XS,IQ4_NL,IQ2_XXS,TQ2_0,MXFP4")
    ap.add_argument("--isa", default=None)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--shape", default="8960,1536", help="N,K of the mat-vec / GEMM weight")
    ap.add_argument("--gemm-m", default="128,512")
    ap.add_argument("--no-gemm", action="store_true")
    ap.add_argument("--median", action="store_true", help="median instead of min over repetitions")
    args = ap.parse_args()
    global STAT
    STAT = statistics.median if args.median else min
    torch.set_num_threads(args.threads)
    ext = hcpu.build()
    isa = args.isa or hcpu.ISA_NAMES[hcpu.default_isa()]
    N, K = (int(v) for v in args.shape.split(","))
    bw = read_bandwidth_gbs()
    print(f"threads={args.threads} isa={isa} stat={STAT.__name__} read bandwidth (torch sum, 1 GiB f32): {bw:.1f} GB/s")
    print(f"mat-vec M=1, W [{N}, {K}] cycled over > 128 MB")
    print(f"{'format':8s} {'bpw':>5s} {'GB/s':>7s} {'of BW':>6s} {'us/call':>8s}")
    for q in args.formats.split(","):
        bs, ts = gguf.GGML_QUANT_SIZES[GT[q]]
        gbs, us = bench_matvec(q, N, K, isa, 128e6)
        print(f"{q:8s} {8 * ts / bs:5.2f} {gbs:7.1f} {gbs / bw:6.0%} {us:8.0f}")
    if not args.no_gemm:
        ms = [int(v) for v in args.gemm_m.split(",")]
        xf, wf = torch.randn(ms[-1], K), torch.randn(N, K)
        s = timeit(lambda: xf @ wf.T, reps=3)
        print(f"GEMM GFLOP/s, W [{N}, {K}]; torch f32 matmul M={ms[-1]}: {2 * ms[-1] * N * K / s / 1e9:.1f}")
        print(f"{'format':8s} " + " ".join(f"{'M=' + str(m):>8s}" for m in ms))
        for q in args.formats.split(","):
            print(f"{q:8s} " + " ".join(f"{bench_gemm(q, m, N, K, isa):8.1f}" for m in ms))


if __name__ == "__main__":
    main()
