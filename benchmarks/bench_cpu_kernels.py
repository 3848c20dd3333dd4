"""Kernel-level CPU benchmark: mat-vec GB/s of weight bytes vs measured read bandwidth, GEMM GFLOP/s.

    python benchmarks/bench_cpu_kernels.py [--formats Q4_K,Q6_K] [--threads 2] [--gemm-m 128,512]

Mat-vec (decode, M=1): a set of weights totalling > 4x the last-level cache is cycled so the
weights stream from DRAM as they do in a model; GB/s counts packed weight bytes read per second.
The read bandwidth is measured in the same run (torch sum over a 1 GiB float32 tensor), so the
ratio is a same-machine, same-load number. With --rounds R (default 3) the bandwidth and every
format are measured R times in turn and each round's mat-vec GB/s is divided by that round's
bandwidth: the table gives the median and [min-max] of both (memory bandwidth on a shared VM
drifts by tens of percent within minutes; every format's ~130 MB of weights stays allocated).
GEMM (prefill): GFLOP/s = 2*M*N*K / time.
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

from hanzo_torch.backends import cpu as hcpu  # noqa: E402

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


def matvec_runner(qtype: str, N: int, K: int, isa: str, total_bytes: float):
    """A function timing one pass (min over 3) of M=1 mat-vecs over > total_bytes of packed
    weights; returns (GB/s of weight bytes, us per call)."""
    one = random_blocks(qtype, N, K, seed=0)
    n_copies = max(2, int(total_bytes // one.numel()) + 1)
    ws = [one.clone() for _ in range(n_copies)]
    x = torch.randn(1, K)
    ext = hcpu.extension()
    tid, lvl = int(GT[qtype]), hcpu._ISA_BY_NAME[isa]

    def run():
        for w in ws:
            ext.mul_mat(x, w, tid, lvl, 8)

    def measure() -> tuple[float, float]:
        s = timeit(run, reps=3, warmup=1)
        return one.numel() * n_copies / s / 1e9, s / n_copies * 1e6

    return measure


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
    ap.add_argument("--gemm512-ab", action="store_true",
                    help="avx512 levels: GEMM with the 512-bit tiles and with the 256-bit ones (HANZO_CPU_GEMM512), alternated")
    ap.add_argument("--repack-ab", action="store_true",
                    help="256-bit GEMM of Q4_K / Q6_K on row-interleaved panels and on the row tiles (HANZO_CPU_REPACK), alternated")
    ap.add_argument("--median", action="store_true", help="median instead of min over repetitions")
    ap.add_argument("--rounds", type=int, default=3, help="bandwidth + mat-vec rounds (median and range reported)")
    ap.add_argument("--prefetch", type=int, default=None,
                    help="mat-vec software prefetch distance, bytes, of the prefetch in use (into L2 unless --prefetch-l1)")
    ap.add_argument("--prefetch-l1", action="store_true",
                    help="mat-vec prefetch into L1 instead of L2 (HANZO_CPU_PREFETCH_L2=0)")
    ap.add_argument("--chunk", type=int, default=None, help="mat-vec task size of the row split, bytes (default 256 KiB)")
    args = ap.parse_args()
    global STAT
    STAT = statistics.median if args.median else min
    torch.set_num_threads(args.threads)
    ext = hcpu.build()
    isa = args.isa or hcpu.ISA_NAMES[hcpu.default_isa()]
    N, K = (int(v) for v in args.shape.split(","))
    if args.prefetch_l1:
        ext.set_prefetch_l2(False)
    if args.prefetch is not None:  # the other distance keeps its default
        ext.set_prefetch_bytes(*((args.prefetch, 8192) if args.prefetch_l1 else (2048, args.prefetch)))
    if args.chunk is not None:
        ext.set_matvec_chunk_bytes(args.chunk)
    fmts = args.formats.split(",")
    runners = {q: matvec_runner(q, N, K, isa, 128e6) for q in fmts}
    bws, res = [], {q: [] for q in fmts}
    for _ in range(args.rounds):
        bws.append(read_bandwidth_gbs())
        for q in fmts:
            res[q].append(runners[q]())

    def mr(v):  # "median [min-max]"
        return f"{statistics.median(v):5.1f} [{min(v):5.1f}-{max(v):5.1f}]"

    print(f"threads={args.threads} isa={isa} stat={STAT.__name__} rounds={args.rounds} "
          f"read bandwidth (torch sum, 1 GiB f32): {mr(bws)} GB/s")
    print(f"mat-vec M=1, W [{N}, {K}] cycled over > 128 MB; of BW = per-round GB/s / that round's bandwidth")
    print(f"{'format':8s} {'bpw':>5s} {'GB/s median [range]':>20s} {'of BW median [range]':>22s} {'us/call':>8s}")
    for q in fmts:
        bs, ts = gguf.GGML_QUANT_SIZES[GT[q]]
        gbs = [g for g, _ in res[q]]
        ratio = [100 * g / b for g, b in zip(gbs, bws)]
        us = statistics.median(u for _, u in res[q])
        print(f"{q:8s} {8 * ts / bs:5.2f} {mr(gbs):>20s} {mr(ratio) + '%':>22s} {us:8.0f}")
    if not args.no_gemm:
        ms = [int(v) for v in args.gemm_m.split(",")]
        xf, wf = torch.randn(ms[-1], K), torch.randn(N, K)
        s = timeit(lambda: xf @ wf.T, reps=3)
        print(f"GEMM GFLOP/s, W [{N}, {K}]; torch f32 matmul M={ms[-1]}: {2 * ms[-1] * N * K / s / 1e9:.1f}")
        ab = args.gemm512_ab and isa.startswith("avx512")
        # (512-bit tiles, interleaved panels) per column, alternated per cell so drift hits both alike
        variants = [(g, r) for g in ((True, False) if ab else (hcpu.gemm512(),))
                    for r in ((True, False) if args.repack_ab else (hcpu.repack(),))]

        def label(m, g, r):
            return f"M={m}" + (" zmm" if g else " ymm") * ab + (" il" if r else " rows") * args.repack_ab
        print(f"{'format':8s} " + " ".join(f"{label(m, g, r):>13s}" for m in ms for g, r in variants))
        for q in args.formats.split(","):
            cells = []
            for m in ms:
                for g, r in variants:
                    hcpu.set_gemm512(g)
                    hcpu.set_repack(r)
                    cells.append(f"{bench_gemm(q, m, N, K, isa):13.1f}")
            print(f"{q:8s} " + " ".join(cells))
        hcpu.set_gemm512(True)
        hcpu.set_repack(True)

if __name__ == "__main__":
    main()
