"""Model-level CPU benchmark: llama-bench style rows (pp<N>, tg<N>, at a depth), hanzo-torch vs llama.cpp.

    python benchmarks/bench_model.py [--model PATH] [--threads 2] [--reps 3]
        [--rows pp128,pp512,pp2048,tg128,tg32@d2048,tg32@d4096]
        [--llama-bench PATH ...] [--llama-args FLAGS] [--ik-llama-bench PATH [--ik-args="-rtr 1"]] [--no-llama-cpp] [--attention-ab] [--threads-ab] [--busy N]
        [--busy-kind spin|matmul] [--matvec-ab] [--panels-ab] [--graph-ab] [--prefetch-ab] [--repack-ab] [--group-ab] [--ranged-ab] [--mmap-ab] [--decode-attention-ab] [--profile]
        [--kv-dtype auto|f32|f16|bf16|q8_0]

Engines, run alternately on the same GGUF file with the same thread count (one measurement of each
per row per round, ``--reps`` rounds), so load on a shared machine hits them alike; the table gives
medians, ranges and the ratio hanzo-torch / llama.cpp per row:

- hanzo-torch, in this process (``backend: cpu``, the instruction set in use is printed).
- llama.cpp through ``llama-cpp-python`` in this process, if installed (not a dependency:
  ``pip install llama-cpp-python`` builds llama.cpp from source, ~15 min on 2 cores; keep it out of
  CI). ``--no-llama-cpp`` skips it.
- ``--llama-bench PATH``: llama.cpp's own ``llama-bench`` binary as a subprocess, one
  ``-r 1 -o json`` run per row per round (it loads the model and does its own warm-up run each
  time; only its timed run counts). Depth rows use its ``-d`` (``--n-depth``) flag; a build
  without it (older than mid-2025) gets "n/a" on those rows. Repeatable: each binary is one engine.
  ``--llama-args FLAGS`` go to every such run (``--repack 0`` where its AMX/CPU repack crashes at
  load, as on an Intel Xeon with AMX).
- ``--ik-llama-bench PATH``: ik_llama.cpp's ``llama-bench`` the same way (extra flags of its own,
  e.g. ``-rtr 1`` for its run-time repack, in ``--ik-args``). Its depth rows use ``-gp D,N`` (tg N
  after a D-token prompt, only the N steps timed: the same as llama-bench's ``-d D -n N``); it has
  no pp at depth (n/a).

Rows (``--rows``, comma-separated; ``--pp 128,512`` / ``--tg 128`` are shorthands for
``pp128,pp512,tg128``), the protocol of llama-bench:

- ``pp<N>``: one forward of N random prompt tokens (logits of the last position only, what
  generation needs); tokens/s = N / time.
- ``tg<N>``: N single-token decode steps after a 16-token prompt (greedy on our side; llama.cpp is
  fed the same ids); tokens/s = N / total time of the N steps.
- ``<row>@d<D>`` (e.g. ``tg32@d4096``, ``pp512@d2048``): the same after D context tokens already in
  the KV cache (fed untimed, in chunks of 512), llama-bench's ``-d D``.

``--attention-ab`` adds our model once more with the earlier prompt attention kernel (two BLAS
GEMMs per token tile instead of the flash-style tiles; ``use_attention_prefill("gemm")``), same
weights, alternating with the others; its ratio column is flash / gemm. ``HANZO_ATTENTION_FALLBACK=1``
(at start) runs the torch reference attention instead, for every hanzo-torch engine.

``--threads-ab`` adds our model once more with the adaptive thread count of the CPU kernels off
(every parallel region on all threads, as ``HANZO_CPU_ADAPTIVE_THREADS=0``), same weights,
alternating with the others; its ratio column is adaptive / fixed. After the table, each of our
engines' parallel-region counters over its measurements: regions, the share run serially by the
adaptive thread count, and the share of parallel regions slower than their calling thread's
estimate of running them alone ("lost": a late or descheduled thread). The one-minute load
average is printed with every round.

``--matvec-ab`` adds our model once more with the avx512 level's 256-bit Q4_K/Q6_K mat-vec rows
(``set_matvec512(False)``, what ``HANZO_CPU_MATVEC512=0`` gives), same weights, alternating; its
ratio column is 512-bit / 256-bit rows.

``--graph-ab`` adds our model once more decoding eagerly, a Python forward per token, instead of
replaying the decode step's captured CPU graph (what ``HANZO_CPU_GRAPH=0`` gives), same weights,
alternating; its ratio column is graph / eager.

``--prefetch-ab`` adds our model once more with the mat-vec's weight prefetch into L1, 2 KiB ahead,
instead of into L2, 8 KiB ahead (``set_prefetch_l2(False)``, what ``HANZO_CPU_PREFETCH_L2=0``
gives), same weights, alternating; its ratio column is L2 / L1.

``--panels-ab`` adds our model once more with the decode mat-vec on the packed rows instead of the
Q4_K weights' row-interleaved panels built at load (``set_panels(False)``, what ``HANZO_CPU_PANELS=0``
gives at load), same weights, alternating; its ratio column is panels / rows.

``--decode-attention-ab`` adds our model once more with one-token attention calls on the
row-by-row split-K kernel (``use_attention_decode("rows")``) instead of the flash tiles, same
weights, alternating; its ratio column is tiles / rows (the tg rows at depth show it).

``--group-ab`` adds our model once more with the attention's q, k and v projections as three
module calls (``hanzo::mul_mat`` each, and the bias adds) instead of one ``hanzo::mul_mat_group``,
same weights, alternating; its ratio column is grouped / apart.

``--repack-ab`` adds our model once more with the 256-bit Q4_K / Q6_K GEMM on row-by-row tiles instead of
row-interleaved panels (``set_repack(False)``, what ``HANZO_CPU_REPACK=0`` gives), same weights,
alternating; its ratio column is interleaved / row tiles.

``--ranged-ab`` adds our model once more with every parallel region's tasks handed out from one
shared counter (``set_ranged_tasks(False)``, what ``HANZO_CPU_RANGED_TASKS=0`` gives) instead of one
contiguous range per thread, same weights, alternating; its ratio column is ranged / shared.

``--mmap-ab`` loads our model a second time with ``mmap=True`` (packed weights left as views of the
mapped file) beside the default one (copied into memory advised for transparent huge pages where
the kernel offers them), alternating; its ratio column is default / mapped.

``--busy N`` starts N extra processes beside the engines for the whole run (the busy-machine
case): ``--busy-kind spin`` (default) a Python busy loop each, ``matmul`` a one-thread float32
512x512 matmul loop each (also loads caches and memory bandwidth). They are stopped at exit.

--profile: op counts, and the share of one decode token spent outside the hanzo ops (host).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import hanzo_torch  # first: it bounds libgomp's spin before torch loads it, as the CLI does (see its __init__)
from hanzo_torch import host_memory
import torch
from hanzo_torch.backends import cpu as hcpu

DEFAULT_MODEL = os.path.expanduser("~/.cache/hanzo-torch/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")


CHUNK = 512  # context tokens per forward when filling the KV cache for a depth row (untimed)


@dataclass(frozen=True)
class Row:
    """One benchmark row: ``kind`` "pp" (prompt processing) or "tg" (generation) of ``n`` tokens
    after ``depth`` tokens already in the KV cache."""

    kind: str
    n: int
    depth: int = 0

    @property
    def name(self) -> str:  # llama-bench's test names: pp512, tg128, tg32 @ d4096
        return f"{self.kind}{self.n}" + (f" @ d{self.depth}" if self.depth else "")

    @property
    def ctx_len(self) -> int:  # tokens before the timed ones (tg at depth 0: a 16-token prompt)
        return self.depth if self.depth or self.kind == "pp" else 16


def parse_rows(spec: str) -> list[Row]:
    """``"pp512,tg32@d4096"`` -> rows. Raises ValueError naming the bad entry."""
    rows = []
    for item in (v.strip() for v in spec.split(",")):
        if not item:
            continue
        m = re.fullmatch(r"(pp|tg)(\d+)(?:\s*@\s*d(\d+))?", item)
        if m is None or int(m.group(2)) < 1:
            raise ValueError(f"--rows: {item!r} is not pp<N>, tg<N>, pp<N>@d<D> or tg<N>@d<D> with N >= 1")
        rows.append(Row(m.group(1), int(m.group(2)), int(m.group(3) or 0)))
    if not rows:
        raise ValueError("--rows: no rows given")
    return rows


class Hanzo:
    name = "hanzo-torch"

    def __init__(self, path: str, n_ctx: int, kv_dtype: Optional[str] = None, mmap: Optional[bool] = None):
        self.version = hanzo_torch.__version__
        self.model = hanzo_torch.load(path, max_context=n_ctx, kv_dtype=kv_dtype, mmap=mmap)
        self.mapped = all(self.model.gguf.maps(w.packed) for w in _packed_weights(self.model))
        self.graph = True  # decode steps through a captured graph where the backend has them (generate's default)

    def measure(self, row: Row, ctx: list[int], ids: list[int]) -> float:
        """Tokens/s of ``row``: ``ctx`` fed untimed, then ``ids`` (pp) or ``row.n`` decode steps (tg),
        each through ``generate``'s decode step (a CPU graph's replay unless :attr:`graph` is False;
        the capture, on the first step of the first measurement, runs untimed)."""
        from hanzo_torch.decode_graphs import DecodeStep

        m = self.model
        m.reset()
        with torch.inference_mode():
            logits = None
            for i in range(0, len(ctx), CHUNK):
                logits = m(torch.tensor([ctx[i:i + CHUNK]]), last_only=True)
            if row.kind == "pp":
                t0 = time.perf_counter()
                m(torch.tensor([ids]), last_only=True)
                return row.n / (time.perf_counter() - t0)
            tok = logits[:, -1].argmax(-1, keepdim=True)
            step = DecodeStep(m, 1, m.device, cuda_graph=self.graph, last_only=True)
            step.input_ids.copy_(tok)
            step.positions.fill_(len(ctx))
            if step.use_graph and step._captured is None:
                step()  # the capture: the first timed step's own work, done again by it
            t0 = time.perf_counter()
            for i in range(row.n):
                step.input_ids.copy_(tok)
                step.positions.fill_(len(ctx) + i)
                tok = step()[:, -1].argmax(-1, keepdim=True)
            return row.n / (time.perf_counter() - t0)


def _packed_weights(model) -> list:
    from hanzo_torch.tensor import GGUFTensor

    return [p for p in model.parameters() if isinstance(p, GGUFTensor)]


class HanzoMapped(Hanzo):
    """A second loaded model whose packed weights stay views of the file mapping (``mmap=True``),
    beside the default one (copied into huge-page memory where the kernel offers it): ``--mmap-ab``."""

    name = "hanzo-torch (mmap)"

    def __init__(self, path: str, n_ctx: int, kv_dtype: Optional[str] = None):
        super().__init__(path, n_ctx, kv_dtype, mmap=True)


class HanzoGemmAttention:
    """The same loaded model with the earlier prompt attention kernel (BLAS GEMM tiles) for calls of
    T > 1 tokens: an in-process A/B of the attention kernels at model level (``--attention-ab``)."""

    name = "hanzo-torch (gemm attention)"

    def __init__(self, ours: Hanzo):
        from hanzo_torch.backends.cpu import fused

        self.ours, self.fused, self.version = ours, fused, ours.version

    def measure(self, row: Row, ctx: list[int], ids: list[int]) -> float:
        with self.fused.use_attention_prefill("gemm"):
            return self.ours.measure(row, ctx, ids)


class HanzoRowsAttention:
    """The same loaded model with one-token attention calls on the row-by-row split-K kernel
    instead of the flash tiles (``--decode-attention-ab``; ``use_attention_decode("rows")``)."""

    name = "hanzo-torch (rows decode attention)"

    def __init__(self, ours: Hanzo):
        from hanzo_torch.backends.cpu import fused

        self.ours, self.fused, self.version = ours, fused, ours.version

    def measure(self, row: Row, ctx: list[int], ids: list[int]) -> float:
        with self.fused.use_attention_decode("rows"):
            return self.ours.measure(row, ctx, ids)


class HanzoFixedThreads:
    """The same loaded model with the adaptive thread count off: every parallel region of the CPU
    kernels on all threads (``--threads-ab``)."""

    name = "hanzo-torch (adaptive threads off)"

    def __init__(self, ours: Hanzo):
        self.ours, self.version = ours, ours.version

    def measure(self, row: Row, ctx: list[int], ids: list[int]) -> float:
        with hcpu.adaptive_threads(False):
            return self.ours.measure(row, ctx, ids)


class HanzoSwitchedOff:
    """The same loaded model with one of the CPU kernels' A/B switches off (the ``hcpu`` getter and
    setter named ``getter`` and ``set_<getter>``) during each measurement:

    - ``matvec512``: the avx512 level's 256-bit Q4_K/Q6_K mat-vec rows instead of its 512-bit ones
      (``--matvec-ab``; ``HANZO_CPU_MATVEC512=0``);
    - ``repack``: the 256-bit Q4_K / Q6_K prefill GEMM on row-by-row tiles instead of
      row-interleaved panels (``--repack-ab``; ``HANZO_CPU_REPACK=0``);
    - ``ranged_tasks``: every parallel region's tasks from one shared counter instead of one
      contiguous range per thread (``--ranged-ab``; ``HANZO_CPU_RANGED_TASKS=0``);
    - ``panels``: the decode mat-vec on the packed rows instead of the row-interleaved panels built
      at load (``--panels-ab``; ``HANZO_CPU_PANELS=0``);
    - ``prefetch_l2``: the mat-vec's weight prefetch into L1, 2 KiB ahead, instead of into L2, 8 KiB
      ahead (``--prefetch-ab``; ``HANZO_CPU_PREFETCH_L2=0``)."""

    NAMES = {"matvec512": "hanzo-torch (256-bit mat-vec)", "repack": "hanzo-torch (no repack)",
             "ranged_tasks": "hanzo-torch (shared task counter)", "panels": "hanzo-torch (mat-vec on rows)",
             "prefetch_l2": "hanzo-torch (L1 prefetch)"}

    def __init__(self, ours: Hanzo, getter: str):
        self.ours, self.version, self.name = ours, ours.version, self.NAMES[getter]
        self.get, self.set = getattr(hcpu, getter), getattr(hcpu, "set_" + getter)

    def measure(self, row: Row, ctx: list[int], ids: list[int]) -> float:
        on = self.get()
        self.set(False)
        try:
            return self.ours.measure(row, ctx, ids)
        finally:
            self.set(on)


class HanzoEager:
    """The same loaded model decoding eagerly, each step a Python forward, instead of replaying the
    captured CPU graph (``--graph-ab``; ``HANZO_CPU_GRAPH=0``, ``--no-graph`` on the command line)."""

    name = "hanzo-torch (eager decode)"

    def __init__(self, ours: Hanzo):
        self.ours, self.version = ours, ours.version

    def measure(self, row: Row, ctx: list[int], ids: list[int]) -> float:
        self.ours.graph = False
        try:
            return self.ours.measure(row, ctx, ids)
        finally:
            self.ours.graph = True


class HanzoApartQKV:
    """The same loaded model with q, k and v as three module calls instead of one
    ``hanzo::mul_mat_group`` (``--group-ab``)."""

    name = "hanzo-torch (q/k/v apart)"

    def __init__(self, ours: Hanzo):
        from hanzo_torch.models import qwen

        self.ours, self.qwen, self.version = ours, qwen, ours.version

    def measure(self, row: Row, ctx: list[int], ids: list[int]) -> float:
        grouped = self.qwen.linear_group
        self.qwen.linear_group = lambda x, *linears: tuple(m(x) for m in linears)
        try:
            return self.ours.measure(row, ctx, ids)
        finally:
            self.qwen.linear_group = grouped


class LlamaCpp:
    name = "llama.cpp (llama-cpp-python)"

    def __init__(self, path: str, n_ctx: int, threads: int):
        import llama_cpp

        self.version = getattr(llama_cpp, "__version__", "?")
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=CHUNK, n_ubatch=CHUNK, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)

    def measure(self, row: Row, ctx: list[int], ids: list[int]) -> float:
        import numpy as np

        llm = self.llm
        llm.reset()
        if ctx:
            llm.eval(ctx)
        if row.kind == "pp":
            t0 = time.perf_counter()
            llm.eval(ids)
            return row.n / (time.perf_counter() - t0)
        def last_logits():  # Llama.scores is not filled without logits_all: read the context's own
            return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))

        tok = int(np.argmax(last_logits()))
        t0 = time.perf_counter()
        for _ in range(row.n):
            llm.eval([tok])
            tok = int(np.argmax(last_logits()))
        return row.n / (time.perf_counter() - t0)


class LlamaBench:
    """A ``llama-bench`` binary (llama.cpp's or ik_llama.cpp's): one ``-r 1 -o json`` run per
    measurement (its own random tokens, its own warm-up run first); the measurement is its ``avg_ts``.
    Depth rows: ``-d D`` where the binary lists ``--n-depth``, else ``-gp D,N`` for tg rows where it
    lists ``-gp`` (ik_llama.cpp), else n/a. ``extra``: more flags for every run. Raises ValueError
    naming ``flag`` when ``binary`` is not an executable llama-bench."""

    def __init__(self, binary: str, path: str, threads: int, flag: str = "--llama-bench",
                 name: str = "llama-bench", extra: list[str] | None = None):
        exe = shutil.which(binary) or binary
        if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise ValueError(f"{flag}: {binary!r} is not an executable file")
        self.exe, self.path, self.threads, self.extra = exe, path, threads, list(extra or [])
        self.name = name + (f" {' '.join(self.extra)}" if self.extra else "")
        try:
            h = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ValueError(f"{flag}: {exe} --help failed: {e}") from e
        text = h.stdout + h.stderr
        if "--n-prompt" not in text:
            raise ValueError(f"{flag}: {exe} --help does not list --n-prompt; is it llama-bench?")
        self.has_d = "--n-depth" in text
        self.has_gp = re.search(r"^\s*-gp\b", text, re.M) is not None
        self.has_depth = self.has_d or self.has_gp
        self.version = "?"

    def measure(self, row: Row, ctx: list[int], ids: list[int]) -> float | None:
        cmd = [self.exe, "-m", self.path, "-t", str(self.threads), "-r", "1", "-o", "json", *self.extra]
        want_prompt = row.n if row.kind == "pp" else 0
        if not row.depth:
            cmd += ["-p", str(want_prompt), "-n", str(row.n if row.kind == "tg" else 0)]
        elif self.has_d:
            cmd += ["-p", str(want_prompt), "-n", str(row.n if row.kind == "tg" else 0), "-d", str(row.depth)]
        elif self.has_gp and row.kind == "tg":  # the records of -gp carry n_prompt = D, n_gen = N
            cmd += ["-p", "0", "-n", "0", "-gp", f"{row.depth},{row.n}"]
            want_prompt = row.depth
        else:
            return None  # no way to run this row at a depth: n/a
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with {r.returncode}: {r.stderr.strip()[-500:]}")
        try:
            recs = json.loads(r.stdout)
        except json.JSONDecodeError as e:
            raise RuntimeError(f"{' '.join(cmd)}: output is not JSON ({e}): {r.stdout[:200]!r}") from e
        for rec in recs:
            n = rec.get("n_gen", 0) if row.kind == "tg" else rec.get("n_prompt", 0)
            ok = n == row.n and (rec.get("n_prompt", 0) == want_prompt if row.kind == "tg" else True)
            if ok and (self.has_gp and not self.has_d or rec.get("n_depth", 0) == row.depth):
                self.version = f"build {rec.get('build_number', '?')} ({rec.get('build_commit', '?')})"
                return float(rec["avg_ts"])
        raise RuntimeError(f"{' '.join(cmd)}: no result for {row.name} in its output")


BUSY_CODE = {
    "spin": "while True:\n    pass\n",
    "matmul": "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True:\n    a @ a\n",
}


def start_busy(n: int, kind: str) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BUSY_CODE[kind]], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n)]


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default=DEFAULT_MODEL, help="GGUF file (both engines)")
    ap.add_argument("--threads", "-t", type=int, default=2, help="threads of every engine")
    ap.add_argument("--kv-dtype", default="auto", choices=("auto", "f32", "f16", "bf16", "q8_0"),
                    help="our KV cache type (auto: the backend's default, f16 on the CPU, as llama-bench's)")
    ap.add_argument("--rows", default=None,
                    help="comma-separated rows: pp<N>, tg<N>, pp<N>@d<D>, tg<N>@d<D> "
                         "(default pp128,pp512,pp2048,tg128,tg32@d2048,tg32@d4096)")
    ap.add_argument("--pp", default=None, help="shorthand: rows pp<N> for these N (with --tg, instead of --rows)")
    ap.add_argument("--tg", type=int, default=None, help="shorthand: row tg<N>")
    ap.add_argument("--reps", "-r", type=int, default=3, help="rounds (one measurement per engine per row each)")
    ap.add_argument("--llama-bench", action="append", default=[], metavar="PATH",
                    help="llama.cpp's llama-bench binary to compare with (repeatable: one engine each)")
    ap.add_argument("--llama-args", default="", metavar="FLAGS",
                    help='extra flags for every --llama-bench run, e.g. --llama-args="--repack 0" where its CPU repack crashes')
    ap.add_argument("--ik-llama-bench", default=None, metavar="PATH", help="ik_llama.cpp's llama-bench binary")
    ap.add_argument("--ik-args", default="", metavar="FLAGS",
                    help='extra flags for every ik_llama.cpp run, e.g. --ik-args="-rtr 1" (its run-time repack)')
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip the llama-cpp-python engine")
    ap.add_argument("--busy", type=int, default=0, metavar="N", help="run N busy processes beside the engines")
    ap.add_argument("--busy-kind", choices=sorted(BUSY_CODE), default="spin")
    ap.add_argument("--attention-ab", action="store_true",
                    help="also run our model with the earlier (BLAS GEMM tile) prompt attention kernel")
    ap.add_argument("--decode-attention-ab", action="store_true",
                    help="also run our model with the row-by-row one-token attention kernel")
    ap.add_argument("--threads-ab", action="store_true",
                    help="also run our model with the adaptive thread count off")
    ap.add_argument("--matvec-ab", action="store_true",
                    help="also run our model with the avx512 level's 256-bit Q4_K/Q6_K mat-vec rows")
    ap.add_argument("--graph-ab", action="store_true",
                    help="also run our model decoding eagerly instead of replaying the CPU graph (HANZO_CPU_GRAPH=0)")
    ap.add_argument("--prefetch-ab", action="store_true",
                    help="also run our model with the mat-vec's weight prefetch into L1 instead of L2 (HANZO_CPU_PREFETCH_L2=0)")
    ap.add_argument("--panels-ab", action="store_true",
                    help="also run our model with the decode mat-vec on the packed rows instead of the panels (HANZO_CPU_PANELS=0)")
    ap.add_argument("--repack-ab", action="store_true",
                    help="also run our model with the Q4_K / Q6_K GEMM on row tiles (HANZO_CPU_REPACK=0)")
    ap.add_argument("--group-ab", action="store_true",
                    help="also run our model with q, k and v as three mul_mat calls instead of one mul_mat_group")
    ap.add_argument("--ranged-ab", action="store_true",
                    help="also run our model with each region's tasks from one shared counter (HANZO_CPU_RANGED_TASKS=0)")
    ap.add_argument("--mmap-ab", action="store_true",
                    help="also run a second copy of our model whose weights stay views of the mapped file (mmap=True)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if args.rows is not None and (args.pp is not None or args.tg is not None):
        ap.error("give --rows, or the --pp/--tg shorthands, not both")
    try:
        if args.rows is None and (args.pp is not None or args.tg is not None):
            spec = ",".join([f"pp{v}" for v in (args.pp or "").split(",") if v] + ([f"tg{args.tg}"] if args.tg else []))
        else:
            spec = args.rows or "pp128,pp512,pp2048,tg128,tg32@d2048,tg32@d4096"
        rows = parse_rows(spec)
    except ValueError as e:
        ap.error(str(e))
    if args.reps < 1 or args.threads < 1 or args.busy < 0:
        ap.error("--reps and --threads must be >= 1, --busy >= 0")
    if not os.path.isfile(args.model):
        ap.error(f"--model: {args.model} is not a file")
    torch.set_num_threads(args.threads)
    hcpu.build()
    n_ctx = max(r.ctx_len + r.n for r in rows) + 16
    engines = [Hanzo(args.model, n_ctx, None if args.kv_dtype == "auto" else args.kv_dtype)]
    if args.attention_ab:
        engines.append(HanzoGemmAttention(engines[0]))
    if args.decode_attention_ab:
        engines.append(HanzoRowsAttention(engines[0]))
    if args.threads_ab:
        engines.append(HanzoFixedThreads(engines[0]))
    if args.matvec_ab:
        engines.append(HanzoSwitchedOff(engines[0], "matvec512"))
    if args.graph_ab:
        if not hcpu.GRAPHS:
            ap.error("--graph-ab: CPU graphs are off (HANZO_CPU_GRAPH=0): both columns would be eager")
        engines.append(HanzoEager(engines[0]))
    if args.prefetch_ab:
        if not hcpu.prefetch_l2():
            ap.error("--prefetch-ab: the L2 prefetch is off (HANZO_CPU_PREFETCH_L2=0): both columns would be the same")
        engines.append(HanzoSwitchedOff(engines[0], "prefetch_l2"))
    if args.panels_ab:
        if not hcpu.panels():
            ap.error("--panels-ab: the panels are off (HANZO_CPU_PANELS=0): both columns would be the rows")
        engines.append(HanzoSwitchedOff(engines[0], "panels"))
    if args.group_ab:
        engines.append(HanzoApartQKV(engines[0]))
    if args.repack_ab:
        engines.append(HanzoSwitchedOff(engines[0], "repack"))
    if args.ranged_ab:
        if not hcpu.ranged_tasks():
            ap.error("--ranged-ab: the task ranges are off (HANZO_CPU_RANGED_TASKS=0): both columns would be the shared counter")
        engines.append(HanzoSwitchedOff(engines[0], "ranged_tasks"))
    if args.mmap_ab:
        if engines[0].mapped:
            ap.error("--mmap-ab: our default load kept the weights mapped here (no transparent huge pages or too "
                     "little memory): both columns would be mapped")
        engines.append(HanzoMapped(args.model, n_ctx, None if args.kv_dtype == "auto" else args.kv_dtype))
    if not args.no_llama_cpp:
        try:
            engines.append(LlamaCpp(args.model, n_ctx, args.threads))
        except ImportError:
            print("llama-cpp-python is not installed: no in-process llama.cpp (pip install llama-cpp-python)",
                  file=sys.stderr)
    if args.llama_args and not args.llama_bench:
        ap.error("--llama-args needs --llama-bench")
    benches = [(b, "--llama-bench", "llama-bench" + (f" #{i + 1}" if len(args.llama_bench) > 1 else ""),
                shlex.split(args.llama_args)) for i, b in enumerate(args.llama_bench)]
    if args.ik_llama_bench:
        benches.append((args.ik_llama_bench, "--ik-llama-bench", "ik_llama.cpp llama-bench", shlex.split(args.ik_args)))
    elif args.ik_args:
        ap.error("--ik-args needs --ik-llama-bench")
    for binary, flag, name, extra in benches:
        try:
            engines.append(LlamaBench(binary, args.model, args.threads, flag=flag, name=name, extra=extra))
        except ValueError as e:
            ap.error(str(e))
        if not engines[-1].has_depth and any(r.depth for r in rows):
            print(f"{binary} has no -d/--n-depth nor -gp: its depth rows are n/a", file=sys.stderr)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"cpu: {cpu}; backend: cpu, ISA {hcpu.ISA_NAMES[hcpu.default_isa()]}; threads: {args.threads}; "
          f"busy: {args.busy} ({args.busy_kind}); model: {os.path.basename(args.model)}; our KV cache: {args.kv_dtype}; "
          f"our weights: {'mapped file' if engines[0].mapped else 'copied (huge pages: ' + str(host_memory.thp_mode()) + ')'}")
    print(f"env: HANZO_MUL_MAT_FALLBACK={os.environ.get('HANZO_MUL_MAT_FALLBACK', '0')} "
          f"HANZO_ATTENTION_FALLBACK={os.environ.get('HANZO_ATTENTION_FALLBACK', '0')} "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '-')} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '-')}",
          flush=True)
    g = torch.Generator().manual_seed(0)
    res: dict[tuple[str, str], list[float]] = {}
    regions: dict[str, Counter] = {}
    busy = start_busy(args.busy, args.busy_kind)
    try:
        warm = Row("pp", 32)
        for e in engines:  # page in the weights, build caches
            if not isinstance(e, LlamaBench):
                e.measure(warm, [], torch.randint(100, 20000, (32,), generator=g).tolist())
        for r in range(args.reps):
            for row in rows:
                ctx = torch.randint(100, 20000, (row.ctx_len,), generator=g).tolist()
                ids = torch.randint(100, 20000, (row.n if row.kind == "pp" else 0,), generator=g).tolist()
                for e in engines:
                    s0 = hcpu.thread_stats() if isinstance(e, (Hanzo, HanzoGemmAttention, HanzoRowsAttention, HanzoFixedThreads, HanzoSwitchedOff, HanzoApartQKV)) else None
                    v = e.measure(row, ctx, ids)
                    if s0 is not None:
                        s1 = hcpu.thread_stats()
                        regions.setdefault(e.name, Counter()).update(
                            {k: s1[k] - s0[k] for k in ("regions", "serial_regions", "parallel_regions", "losses")})
                    if v is not None:
                        res.setdefault((row.name, e.name), []).append(v)
            print(f"round {r + 1}/{args.reps} (load {os.getloadavg()[0]:.2f}): "
                  + ", ".join(f"{k[0]} {k[1]} {v[-1]:.1f}" for k, v in res.items()), flush=True)
    finally:
        stop_busy(busy)
    print("engines: " + "; ".join(f"{e.name} {e.version}" for e in engines))
    print_table(rows, [e.name for e in engines], res)
    for name, c in regions.items():
        print(f"parallel regions, {name}: {c['regions']} asked, {c['serial_regions'] / max(c['regions'], 1):.0%} "
              f"run serially, {c['losses'] / max(c['parallel_regions'], 1):.0%} of {c['parallel_regions']} "
              "parallel ones lost")
    if args.profile:
        profile_decode(engines[0].model)


def print_table(rows: list[Row], names: list[str], res: dict) -> None:
    """Medians (ranges) in tokens/s, and hanzo-torch / each other engine per row."""
    def med(t, n):
        v = res.get((t, n))
        return statistics.median(v) if v else None

    print()
    head = ["test"] + [f"{n} tok/s (median, range)" for n in names] + [f"ratio vs {n}" for n in names[1:]]
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for row in rows:
        cells = [row.name]
        for n in names:
            v = res.get((row.name, n))
            cells.append(f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" if v else "n/a")
        ours = med(row.name, names[0])
        for n in names[1:]:
            theirs = med(row.name, n)
            cells.append(f"{ours / theirs:.2f}x" if ours and theirs else "n/a")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
