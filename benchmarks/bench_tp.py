"""Tensor parallel on one machine: ``torchrun --nproc-per-node R ... --tp R`` with T threads per rank
against one process with R*T threads, on the same file, tokens/s from ``hanzo-torch bench``.

    python benchmarks/bench_tp.py [-m model.gguf] [--ranks 2] [--threads 1] [-p 128] [-n 32] [-r 3]

Prints both bench tables, the weight bytes each rank holds, and a Markdown summary row
(pp and tg tokens/s both ways and their ratio) for benchmarks/RESULTS.md. Runs the two
configurations one after the other, alternating ``--rounds`` times.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd: list[str], env: dict) -> tuple[dict, str]:
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    rates = {}
    for line in p.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 9 and re.fullmatch(r"(pp|tg)\d+", cells[5]):
            rates[cells[5]] = float(cells[6])
    loaded = next((ln for ln in p.stderr.splitlines() if "loaded in" in ln), "")
    return rates, loaded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="GGUF file (default: the pulled default model)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="threads per rank")
    ap.add_argument("-p", "--n-prompt", default="128")
    ap.add_argument("-n", "--n-gen", default="32")
    ap.add_argument("-r", "--repetitions", default="3")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two configurations")
    a = ap.parse_args()
    model = a.model
    if model is None:
        sys.path.insert(0, ROOT)
        import hanzo_torch

        model = hanzo_torch.pull(quiet=True)
    bench = ["bench", "-m", model, "-p", a.n_prompt, "-n", a.n_gen, "-r", a.repetitions]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    single = [sys.executable, "-m", "hanzo_torch", *bench, "-t", str(a.ranks * a.threads)]
    tp = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.ranks), "-m", "hanzo_torch",
          *bench, "-t", str(a.threads), "--tp", str(a.ranks)]
    results = {"single": [], "tp": []}
    for _ in range(a.rounds):
        for name, cmd in (("single", single), ("tp", tp)):
            rates, loaded = _run(cmd, env)
            results[name].append(rates)
            print(f"{name}: {rates}  [{loaded}]", flush=True)
    med = {k: {t: statistics.median(r[t] for r in v) for t in v[0]} for k, v in results.items()}
    print(f"\n| test | 1 process x {a.ranks * a.threads} threads | {a.ranks} ranks x {a.threads} thread(s) | ratio |")
    print("|---|---|---|---|")
    for t in med["single"]:
        s, p = med["single"][t], med["tp"][t]
        print(f"| {t} | {s:.2f} | {p:.2f} | {p / s:.2f}x |")


if __name__ == "__main__":
    main()
