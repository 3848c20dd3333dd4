"""Seeded fuzzing of ``load()`` -> tokenizer -> one generated token on mutated tiny models
(:mod:`tests.load_fuzz`: a fork server, one child per case with a memory limit and a timeout).

Every case must end as "ok" (loaded, finite logits, one token generated and decoded) or as a
``GGUFError``; any other exception, non-finite logits accepted, a timeout or a crash fails. The
default run has cases 0-999; the slow-marked ones cases 1,000-1,999 and 20,000 more.

Outcomes when this was written: cases 0-1,999 -> 1,490 GGUFError, 510 ok (120 s of CPU over the
two fork servers), of which cases 0-999 -> 751 GGUFError, 249 ok (73 s of CPU on a loaded
machine); 20,000 cases -> 15,023 GGUFError, 4,977 ok; no other exception, non-finite logits,
timeout or crash in any.
"""
from __future__ import annotations

import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

SEED = 20261201
ROOT = Path(__file__).resolve().parent.parent
GOOD = {"ok", "GGUFError", "unwritable"}  # unwritable: gguf's writer refused the mutant (not a case)


def fuzz(first: int, n: int, case_timeout_s: float = 10.0, total_timeout_s: float = 3600.0,
         workers: int = 2) -> tuple[dict, list]:
    """Run cases ``first .. first + n - 1`` on ``workers`` fork servers (one per core of the 2-core
    CI machine; each forks its cases one at a time); returns (outcome counts, failing reports)."""
    code = ("import sys; sys.path[:0] = [{root!r}, {tests!r}]; from load_fuzz import serve; serve()"
            .format(root=str(ROOT), tests=str(ROOT / "tests")))
    bounds = [first + n * w // workers for w in range(workers + 1)]
    errs = [tempfile.TemporaryFile(mode="w+") for _ in range(workers)]  # a file: a full pipe would block
    procs = [subprocess.Popen([sys.executable, "-c", code, str(SEED), str(lo), str(hi - lo), str(case_timeout_s)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=errs[w], text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
             for w, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
    counts: collections.Counter = collections.Counter()
    failures: list = []
    seen = [0] * workers

    def read(w: int) -> None:
        for line in procs[w].stdout:
            r = json.loads(line)
            if r.get("ready"):
                continue
            seen[w] += 1
            with lock:
                counts[r["outcome"]] += 1
                if r["outcome"] not in GOOD:
                    failures.append(r)

    lock = threading.Lock()
    readers = [threading.Thread(target=read, args=(w,), daemon=True) for w in range(workers)]
    for t in readers:
        t.start()
    deadline = time.monotonic() + total_timeout_s
    try:
        for t in readers:
            t.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None and any(t.is_alive() for t in readers):
                p.kill()
            p.wait()
    for w, p in enumerate(procs):
        errs[w].seek(0)
        err = errs[w].read()
        errs[w].close()
        want = bounds[w + 1] - bounds[w]
        assert p.returncode == 0 and seen[w] == want, (
            f"fuzz server {w} failed (exit {p.returncode}, {seen[w]}/{want} cases): {err[-3000:]}")
    failures.sort(key=lambda r: r["case"])
    return dict(counts), failures


def _check(counts: dict, failures: list, n: int) -> None:
    shown = "\n".join(f"case {r['case']} ({r.get('mutation')}): {r['outcome']}: {r.get('detail')}" for r in failures[:15])
    assert not failures, f"{len(failures)} of {n} cases failed (seed {SEED}): {counts}\n{shown}"
    # both outcomes must be exercised substantially, or the fuzzer is not testing the loader
    assert counts.get("ok", 0) > n // 10 and counts.get("GGUFError", 0) > n // 4, counts
    assert counts.get("unwritable", 0) < n // 20, counts


def _report(n: int, t0: float, r0, counts: dict) -> None:
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    print(f"\nload fuzz: {n} cases in {time.perf_counter() - t0:.1f} s wall, {cpu:.1f} s CPU: {counts}")


def test_load_fuzz_1000_cases():
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    counts, failures = fuzz(0, 1000)
    _report(1000, t0, r0, counts)
    _check(counts, failures, 1000)


@pytest.mark.slow
def test_load_fuzz_cases_1000_to_1999():
    # the second half of the former default run (cases 0-1999), kept with the slow runs
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    counts, failures = fuzz(1000, 1000)
    _report(1000, t0, r0, counts)
    _check(counts, failures, 1000)


@pytest.mark.slow
def test_load_fuzz_20000_cases():
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    counts, failures = fuzz(100_000, 20_000, case_timeout_s=20.0, total_timeout_s=6 * 3600)
    _report(20_000, t0, r0, counts)
    _check(counts, failures, 20_000)
