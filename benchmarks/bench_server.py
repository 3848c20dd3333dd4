"""Serving throughput: ``hanzo-torch serve`` against llama-server, 1/2/4/8 concurrent requests.

    python benchmarks/bench_server.py --llama-server PATH/llama-server [-m model.gguf] [-c 1,2,4,8]
        [-n 32] [-t 2] [--rounds 1] [--llama-args="-nr"]

Each server is started with the same model, slots (``-np`` = the largest concurrency), context
(``-c`` = 512 per slot) and threads, in the same run, one after the other (``--rounds`` > 1
alternates them). At each concurrency C, C clients send at once a streamed
``/v1/completions`` of a distinct ~40-token prompt, ``max_tokens=n``, greedy, ``ignore_eos``
(so every answer is exactly n tokens). Reported per server and C: aggregate tokens/s (C * n / wall
time of the whole wave, prefill included), aggregate decode tokens/s (C * (n - 1) / the time
from the first client's first token to the last client's last token), and per-request median
time to first token and total latency. One warm-up request runs before the waves. Without
``--llama-server`` (or ``HANZO_LLAMA_SERVER``) only hanzo-torch is measured.
"""
from __future__ import annotations

import argparse
import json
import shlex
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


def one_request(url: str, prompt: str, n: int, out: dict) -> None:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = None
    text = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0].get("text") or ""
            if piece and first is None:
                first = time.perf_counter()
            text.append(piece)
    end = time.perf_counter()
    out.update(start=t0, first=first or end, end=end, text="".join(text))


def wave(url: str, prompts: list[str], n: int) -> dict:
    results = [dict() for _ in prompts]
    threads = [threading.Thread(target=one_request, args=(url, p, n, r)) for p, r in zip(prompts, results)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    C = len(prompts)
    decode_span = max(r["end"] for r in results) - min(r["first"] for r in results)
    return {"agg": C * n / wall, "agg_decode": C * (n - 1) / decode_span if decode_span > 0 else float("nan"),
            "ttft": statistics.median(r["first"] - r["start"] for r in results),
            "latency": statistics.median(r["end"] - r["start"] for r in results)}


def start(kind: str, args, slots: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    ctx = 512 * slots
    if kind == "hanzo-torch":
        cmd = [sys.executable, "-m", "hanzo_torch", "serve", "-m", args.model, "--port", str(port), "-np", str(slots),
               "-c", str(ctx), "-t", str(args.threads)]
    else:
        cmd = [args.llama_server, "-m", args.model, "--port", str(port), "-np", str(slots), "-c", str(ctx),
               "-t", str(args.threads), "--host", "127.0.0.1"] + shlex.split(args.llama_args)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # graceful shutdown
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", help="GGUF (default: hanzo_torch.pull()'s model)")
    ap.add_argument("--llama-server", default=os.environ.get("HANZO_LLAMA_SERVER"), help="llama-server binary")
    ap.add_argument("--llama-args", default="", help='extra llama-server arguments, e.g. "-nr" (no weight '
                    'repacking: where its AMX repack crashes)')
    ap.add_argument("-c", "--concurrency", default="1,2,4,8")
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    if args.model is None:
        import hanzo_torch

        args.model = hanzo_torch.pull()
    levels = [int(c) for c in args.concurrency.split(",")]
    slots = max(levels)
    base = "def function_{i}(values):\n    \"\"\"Return the sorted unique values of the list, number {i}.\"\"\"\n"
    kinds = ["hanzo-torch"] + (["llama-server"] if args.llama_server else [])
    table: dict = {k: {c: [] for c in levels} for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            proc, url = start(kind, args, slots)
            try:
                one_request(url, base.format(i=-1), 4, {})  # warm-up
                for C in levels:
                    table[kind][C].append(wave(url, [base.format(i=i) for i in range(C)], args.n_gen))
            finally:
                stop(proc)
    print(f"model {os.path.basename(args.model)}, n={args.n_gen}, -np {slots}, -t {args.threads}, "
          f"rounds {args.rounds} (medians)")
    print(f"{'server':13} {'C':>2} {'agg tok/s':>10} {'agg decode':>11} {'TTFT s':>7} {'latency s':>9}")
    for kind in kinds:
        for C in levels:
            rows = table[kind][C]
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print(f"{kind:13} {C:>2} {med['agg']:>10.2f} {med['agg_decode']:>11.2f} {med['ttft']:>7.2f} "
                  f"{med['latency']:>9.2f}")


if __name__ == "__main__":
    main()
