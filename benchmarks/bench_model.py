"""Model-level CPU benchmark: pp<N> / tg<N> tokens/s, hanzo-torch side by side with llama.cpp.

    python benchmarks/bench_model.py [--model PATH] [--threads 2] [--pp 128,512] [--tg 128]
                                     [--reps 3] [--no-llama-cpp] [--profile]

Both engines run the same GGUF file in the same process, alternately (one measurement of each
per round, ``--reps`` rounds), so load on a shared machine hits both alike; the table gives the
medians and our/llama.cpp ratios. llama.cpp runs through ``llama-cpp-python`` (not a dependency:
``pip install llama-cpp-python`` builds llama.cpp from source, ~15 min on 2 cores; keep it out
of CI). Without it only our numbers are printed.

Protocol (same for both engines):

- pp<N>: one forward of N random prompt tokens into an empty KV cache, logits of the last
  position only (what generation needs); tokens/s = N / time.
- tg<N>: a 16-token prompt, then N single-token decode steps (greedy on our side; llama.cpp is
  fed the same token ids); tokens/s = 1 / median step time.

--profile: op counts, and the share of one decode token spent outside the hanzo ops (host).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter

import hanzo_torch  # first: it bounds libgomp's spin before torch loads it, as the CLI does (see its __init__)
import torch
from hanzo_torch.backends import cpu as hcpu

DEFAULT_MODEL = os.path.expanduser("~/.cache/hanzo-torch/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")


class Hanzo:
    name = "hanzo-torch"

    def __init__(self, path: str, n_ctx: int):
        self.model = hanzo_torch.load(path, max_context=n_ctx)

    def pp(self, ids: list[int]) -> float:
        self.model.reset()
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model(x, last_only=True)
        return time.perf_counter() - t0

    def tg(self, prompt: list[int], n: int) -> list[float]:
        self.model.reset()
        ts = []
        with torch.inference_mode():
            logits = self.model(torch.tensor([prompt]), last_only=True)
            tok = logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(n):
                t0 = time.perf_counter()
                logits = self.model(tok, last_only=True)
                tok = logits[:, -1].argmax(-1, keepdim=True)
                ts.append(time.perf_counter() - t0)
        return ts


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path: str, n_ctx: int, threads: int):
        import llama_cpp

        self.version = getattr(llama_cpp, "__version__", "?")
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)

    def pp(self, ids: list[int]) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t0

    def tg(self, prompt: list[int], n: int) -> list[float]:
        import numpy as np

        self.llm.reset()
        self.llm.eval(prompt)
        tok = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.llm.eval([tok])
            tok = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            ts.append(time.perf_counter() - t0)
        return ts


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
          f"{max(0.0, wall - sum(hanzo.values()) / 1e6) / wall:.0%} (inflated: the profiler's own cost)")
    glue_replay(model)


def glue_replay(model, steps: int = 30) -> None:
    """Host time of a decode step without the profiler: the model's own ``torch.ops.hanzo``
    calls (the ``hanzo`` of models/qwen.py and models/layers.py) are recorded for one step, then the step is replayed with
    each call returning its recorded output at once, so what is timed is everything but the hanzo
    ops: Python modules, views, bias adds, the embedding, argmax-free glue. Medians of ``steps``.
    (Time inside the ops that is not kernel work, ~5-10 us of C++ dispatch per call, is not in it.)"""
    from hanzo_torch.models import layers, qwen

    real = torch.ops.hanzo
    rec, pos, mode = [], [0], ["record"]

    class Replay:
        def __getattr__(self, name):
            op = getattr(real, name)

            def call(*args, **kwargs):
                if mode[0] == "record":
                    rec.append(op(*args, **kwargs))
                    return rec[-1]
                pos[0] += 1
                return rec[pos[0] - 1]

            return call

    tok = torch.tensor([[1000]])

    def step() -> float:
        pos[0] = 0
        t0 = time.perf_counter()
        model(tok, last_only=True)
        return time.perf_counter() - t0

    steps = max(1, min(steps, (model.max_context - 17) // 2))
    model.reset()
    with torch.inference_mode():
        model(torch.randint(100, 20000, (1, 16)), last_only=True)
        full = statistics.median(step() for _ in range(steps))
        saved, qwen.hanzo, layers.hanzo = qwen.hanzo, Replay(), Replay()
        try:
            step()  # record (the replayed steps reuse this position's outputs)
            mode[0] = "replay"
            glue = statistics.median(step() for _ in range(steps))
            t0 = time.perf_counter()  # the replay wrapper's own cost, to subtract
            for _ in range(len(rec)):
                pos[0] = 0
                Replay().mul_mat()
            wrap = time.perf_counter() - t0
        finally:
            qwen.hanzo = layers.hanzo = saved
    host = max(0.0, glue - wrap)
    print(f"glue replay: {len(rec)} hanzo calls per step; step {full * 1e3:.1f} ms, everything but the hanzo "
          f"ops {host * 1e3:.2f} ms = {host / full:.1%} of the step (host share)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pp", default="128,512")
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-llama-cpp", action="store_true", help="run only hanzo-torch")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hcpu.build()
    pps = [int(v) for v in args.pp.split(",") if v]
    n_ctx = max(pps + [16 + args.tg]) + 16
    engines = [Hanzo(args.model, n_ctx)]
    if not args.no_llama_cpp:
        try:
            engines.append(LlamaCpp(args.model, n_ctx, args.threads))
        except ImportError:
            print("llama-cpp-python is not installed: hanzo-torch only (pip install llama-cpp-python)",
                  file=sys.stderr)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"cpu: {cpu}; threads={args.threads}; hanzo isa={hcpu.ISA_NAMES[hcpu.default_isa()]}; "
          f"mul_mat fallback={os.environ.get('HANZO_MUL_MAT_FALLBACK', '0')}; "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '-')} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '-')}; "
          + "; ".join(f"{e.name} {getattr(e, 'version', hanzo_torch.__version__)}" for e in engines))
    g = torch.Generator().manual_seed(0)
    res: dict[tuple[str, str], list[float]] = {}
    for e in engines:  # warm-up: page in the weights, build caches
        e.pp(torch.randint(100, 20000, (32,), generator=g).tolist())
    for r in range(args.reps):
        for n in pps:
            ids = torch.randint(100, 20000, (n,), generator=g).tolist()
            for e in engines:
                res.setdefault((f"pp{n}", e.name), []).append(n / e.pp(ids))
        if args.tg:
            prompt = torch.randint(100, 20000, (16,), generator=g).tolist()
            for e in engines:
                res.setdefault((f"tg{args.tg}", e.name), []).append(1.0 / statistics.median(e.tg(prompt, args.tg)))
        print(f"round {r + 1}/{args.reps}: " + ", ".join(f"{k[0]} {k[1]} {v[-1]:.1f}" for k, v in res.items()),
              flush=True)
    tests = list(dict.fromkeys(k[0] for k in res))
    names = [e.name for e in engines]
    print()
    print("| test | " + " | ".join(f"{n} tok/s (median, range)" for n in names)
          + (" | ratio hanzo/llama.cpp |" if len(names) > 1 else " |"))
    print("|---" * (len(names) + 1 + (len(names) > 1)) + "|")
    for t in tests:
        cells = []
        for n in names:
            v = res[(t, n)]
            cells.append(f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})")
        row = f"| {t} | " + " | ".join(cells)
        if len(names) > 1:
            row += f" | {statistics.median(res[(t, names[0])]) / statistics.median(res[(t, names[1])]):.2f}x"
        print(row + " |")
    if args.profile:
        profile_decode(engines[0].model)


if __name__ == "__main__":
    main()
