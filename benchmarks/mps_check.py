"""One prepared check of the MPS backend on a Mac with torch's MPS device; prints one table.

    python benchmarks/mps_check.py                  # on "mps" (Apple silicon, torch >= 2.6)
    python benchmarks/mps_check.py --dry-run        # anywhere: every step at toy shapes on the CPU,
                                                    # the Metal kernels on the harness (mps-sim)

No Metal kernel of hanzo-torch has run on Apple hardware before this script: read its table
before trusting any other number. Needs ``glslc`` and ``spirv-cross`` (``brew install shaderc
spirv-cross``): the Metal sources are generated at build time. Steps (each guarded: a failure is a
FAIL/ERROR row and the run goes on):

1. the backend's status (why it is unavailable, if it is);
2. the conformance suite on "mps": ``pytest tests/test_conformance.py -k "mps and not sim"``
   (every op and format against the torch references at the declared tolerances) and
   tests/test_mps.py;
3. copy bandwidth (``dst.copy_(src)``, read + write), then per format the decode mat-vec
   (M = 1, float16 activation) at N x K = 4096 x 14336: packed-weight GB/s and the fraction of
   the copy bandwidth; each result checked against the reference first (FAIL instead of a speed);
4. the default model (Qwen2.5-Coder-1.5B-Instruct Q4_K_M, ``hanzo_torch.pull()``, or ``--model``)
   on "mps": prompt processing of ``--pp`` tokens and ``--tg`` greedy decode steps, tokens/s;
5. llama.cpp's Metal numbers for the same file (``llama-bench -p <pp> -n <tg>``) when
   ``llama-bench`` is on PATH.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MATVEC_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS",
                  "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
                  "MXFP4", "NVFP4", "F16", "BF16")


class Table:
    def __init__(self):
        self.rows = []

    def add(self, step: str, item: str, value: str, note: str = "") -> None:
        self.rows.append((step, item, value, note))
        print(f"[{step}] {item}: {value} {note}".rstrip(), flush=True)

    def render(self) -> str:
        head = ("step", "item", "value", "note")
        w = [max(len(r[i]) for r in [head, *self.rows]) for i in range(3)]
        out = [f"{head[0]:{w[0]}} | {head[1]:{w[1]}} | {head[2]:>{w[2]}} | {head[3]}", "-" * (sum(w) + 20)]
        return "\n".join(out + [f"{s:{w[0]}} | {i:{w[1]}} | {v:>{w[2]}} | {n}" for s, i, v, n in self.rows])


def _sync(device: str) -> None:
    import torch

    if device == "mps":
        torch.mps.synchronize()


def _median_time(fn, device: str, reps: int) -> float:
    fn()
    _sync(device)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def status(table: Table) -> bool:
    import torch

    from hanzo_torch.backends import mps

    st = mps.status()
    table.add("status", "torch", torch.__version__, f"mps built {torch.backends.mps.is_built()}")
    table.add("status", "mps backend", "available" if st["available"] else "unavailable",
              st["reason"] or f"{len(st['formats'])} formats, {st['kernels']} kernels")
    return st["available"]


def conformance(table: Table, dry: bool, timeout: float) -> None:
    runs = [("tests/test_conformance.py", "mps-sim and not int8" if dry else "mps and not sim"),
            ("tests/test_mps.py", "not tiny" if dry else "")]
    for path, k in runs:
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning"]
        if k:
            cmd += ["-k", k]
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            out = (p.stdout + p.stderr).strip().splitlines()
            if p.returncode != 0:
                print("\n".join(out[-60:]), flush=True)
            table.add("conformance", f"{os.path.basename(path)} -k {k!r}", "ok" if p.returncode == 0 else
                      f"rc {p.returncode}", f"{out[-1] if out else ''} ({time.monotonic() - t0:.0f} s)")
        except subprocess.TimeoutExpired:
            table.add("conformance", os.path.basename(path), "TIMEOUT", f"after {timeout:.0f} s")


def matvec(table: Table, device: str, N: int, K: int, reps: int, formats) -> None:
    import torch

    from hanzo_torch.backends.triton._testing import random_packed

    n = (1 << 28) if device == "mps" else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), device, reps)
    bw = 2 * n / t
    table.add("matvec", "copy bandwidth", f"{bw / 1e9:.0f} GB/s", f"dst.copy_(src) of {n >> 20} MiB, read+write")
    src = dst = None  # free the copy buffers
    dtype = torch.float16 if device == "mps" else torch.float32
    x = torch.randn(1, K, dtype=dtype)
    for qtype in formats:
        try:
            w = random_packed(qtype, (N, K), seed=0)
            wf = torch.ops.hanzo_ref.dequantize(w, qtype, [N, K], torch.float32)
            ref = x.float() @ wf.t()  # the kernels are float: no activation quantization
            del wf
            wd, xd = w.to(device), x.to(device)
            y = torch.ops.hanzo.mul_mat(xd, wd, qtype).float().cpu()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            if not err < (2e-3 if dtype == torch.float16 else 1e-4):
                table.add("matvec", qtype, "FAIL", f"max rel err {err:.1e}")
                continue
            t = _median_time(lambda: torch.ops.hanzo.mul_mat(xd, wd, qtype), device, reps)
            table.add("matvec", qtype, f"{w.numel() / t / 1e9:.1f} GB/s",
                      f"{w.numel() / t / bw:.2f} of copy, {t * 1e6:.0f} us, err {err:.1e}")
        except Exception as e:  # one broken format must not hide the others
            table.add("matvec", qtype, "ERROR", f"{type(e).__name__}: {str(e)[:160]}")


def model(table: Table, device: str, path: str, pp: int, tg: int) -> None:
    import torch

    import hanzo_torch

    m = hanzo_torch.load(path, device=device, max_context=pp + tg + 8)
    table.add("model", os.path.basename(path), str(m.blk[0].attn_norm.weight.dtype), f"on {device}")
    prompt = torch.randint(0, 200, (1, pp), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        m.reset()
        m(prompt[:, :8])  # first calls compile the kernels
        _sync(device)
        m.reset()
        t = time.perf_counter()
        logits = m(prompt)
        _sync(device)
        t_pp = time.perf_counter() - t
        tok = logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(tg):
            tok = m(tok)[:, -1:].argmax(-1)
        _sync(device)
        t_tg = time.perf_counter() - t
    table.add("model", f"pp{pp}", f"{pp / t_pp:.1f} tok/s")
    table.add("model", f"tg{tg}", f"{tg / t_tg:.1f} tok/s")


def llama_bench(table: Table, path: str, pp: int, tg: int) -> None:
    exe = shutil.which("llama-bench")
    if exe is None:
        table.add("llama.cpp", "llama-bench", "skipped", "not on PATH")
        return
    p = subprocess.run([exe, "-m", path, "-p", str(pp), "-n", str(tg), "-o", "json"], capture_output=True, text=True,
                       timeout=900)
    if p.returncode != 0:
        table.add("llama.cpp", "llama-bench", f"rc {p.returncode}", p.stderr.strip()[-200:])
        return
    for r in json.loads(p.stdout):
        what = f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r['n_gen']}"
        table.add("llama.cpp", what, f"{r['avg_ts']:.1f} tok/s", f"{r.get('backends', '')} {r.get('gpu_info', '')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="toy shapes on the CPU, kernels on the harness")
    ap.add_argument("--model", help="GGUF file (default: hanzo_torch.pull())")
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--skip", default="", help="comma list of steps to skip: conformance,matvec,model,llama")
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    table = Table()

    ok = status(table)
    device = "cpu" if a.dry_run else "mps"
    if not ok and not a.dry_run:
        print(table.render())
        return 1
    from hanzo_torch.backends.mps import sim

    steps = [("conformance", lambda: conformance(table, a.dry_run, 1800)),
             ("matvec", lambda: matvec(table, device, *((64, 512, 2, MATVEC_FORMATS[:6]) if a.dry_run else
                                                        (4096, 14336, a.reps, MATVEC_FORMATS))))]
    path = a.model
    if path is None and not a.dry_run:
        import hanzo_torch

        path = str(hanzo_torch.pull(quiet=True))
    if a.dry_run and path is None:
        from tests.gguf_builders import tiny_spec, write_tiny_gguf
        from tests.test_models import SPECS

        path = write_tiny_gguf(os.path.join(os.environ.get("TMPDIR", "/tmp"), "mps_check_qwen3.gguf"),
                               tiny_spec("qwen3", **SPECS["qwen3"]))
    steps.append(("model", lambda: model(table, device, path, 16 if a.dry_run else a.pp, 4 if a.dry_run else a.tg)))
    steps.append(("llama", lambda: llama_bench(table, path, a.pp, a.tg)))
    for name, fn in steps:
        if name in skip:
            table.add(name, "-", "skipped", "--skip")
            continue
        try:
            # the dry run: the ops of CPU tensors run the Metal kernels on the harness
            with sim.on_cpu() if a.dry_run and name in ("matvec", "model") else contextlib.nullcontext():
                fn()
        except Exception as e:
            traceback.print_exc()
            table.add(name, "-", "ERROR", f"{type(e).__name__}: {str(e)[:200]}")
    print()
    print(table.render())
    return 0 if not any(r[2] in ("FAIL", "ERROR", "TIMEOUT") or r[2].startswith("rc ") for r in table.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
