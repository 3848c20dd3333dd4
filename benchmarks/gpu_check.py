"""One prepared GPU check of hanzo-torch (under 9 minutes on one H200); prints one table.

    python benchmarks/gpu_check.py                 # the full check on cuda:0
    python benchmarks/gpu_check.py --dry-run       # no GPU: every step at toy shapes on the CPU,
                                                   # Triton kernels under TRITON_INTERPRET=1

Steps, in this order (each guarded: a failure becomes a FAIL/ERROR row and the run goes on;
``--budget-s`` is the wall-clock budget, and a step that would start after it is reported as
skipped):

1. replay == eager: ``pytest -m gpu tests/test_cuda_graphs.py`` (qwen3, qwen3moe, qwen2 tiny
   models, 512 decode steps each, max |logits diff| must be 0; the generate() and
   ``torch.compile(mode="reduce-overhead")`` cases).
2. model decode on a random-weight Qwen3-8B-shaped Q4_K_M file written by this script (36
   layers, hidden 4096, 32/8 heads x 128, FFN 12288, vocab 151936; Q4_K/Q6_K as llama.cpp's
   Q4_K_M mix): tokens/s of eager decode and of CUDA-graph replay after a 16-token prompt, and
   GPU kernels per decode token (torch.profiler, eager and replay).
3. copy bandwidth (``dst.copy_(src)``, read + write), then per format the decode mat-vec
   (M = 1, bf16 activation) at N x K = 4096 x 14336: packed-weight GB/s and the fraction of the
   copy bandwidth, for the float32 grouped path and the int8 (q8_1) path, which one is faster
   and which one ``quant.DECODE_PATH`` picks. Each result is checked against the op reference
   first (FAIL instead of a speed).
4. prefill GEMM at M = 512 per format: TFLOP/s and the ratio to torch's dense bf16 matmul.
5. the conformance suite on cuda: ``pytest -m gpu tests/test_triton_gpu.py`` with what is left
   of the budget.
6. with 2 or more GPUs, tensor parallel over NCCL on 2 of them (``benchmarks/tp_check.py`` under
   torchrun, tiny qwen3 Q4_K/Q6_K file): decode under CUDA graphs (collectives captured) ==
   eager, and both against one process; skipped with one GPU. ``--skip tp`` skips it.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

# Qwen3-8B (config.json of Qwen/Qwen3-8B)
QWEN3_8B = dict(n_layer=36, hidden=4096, n_head=32, n_head_kv=8, head_dim=128, ffn=12288, vocab=151936)
TOY = dict(n_layer=2, hidden=256, n_head=4, n_head_kv=2, head_dim=64, ffn=512, vocab=512)


class Table:
    def __init__(self):
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, section: str, item: str, value: str, note: str = "") -> None:
        self.rows.append((section, item, value, note))
        print(f"[{section}] {item}: {value} {note}".rstrip(), flush=True)

    def render(self) -> str:
        head = ("step", "item", "value", "note")
        w = [max(len(r[i]) for r in [head, *self.rows]) for i in range(3)]
        lines = [f"{head[0]:{w[0]}} | {head[1]:{w[1]}} | {head[2]:>{w[2]}} | {head[3]}",
                 "-" * (sum(w) + 20)]
        lines += [f"{s:{w[0]}} | {i:{w[1]}} | {v:>{w[2]}} | {n}" for s, i, v, n in self.rows]
        return "\n".join(lines)


def _sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _pytest(table: Table, step: str, path: str, timeout: float, extra=()) -> None:
    if timeout < 20:
        table.add(step, os.path.basename(path), "skipped", f"budget left {timeout:.0f} s")
        return
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", path, "-m", "gpu", "-q", "-p", "no:cacheprovider",
                            "-W", "ignore::RuntimeWarning", *extra], cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout)
        out = (p.stdout + p.stderr).strip().splitlines()
        summary = out[-1] if out else "(no output)"
        if p.returncode != 0:
            print("\n".join(out[-60:]), flush=True)
        table.add(step, os.path.basename(path), "ok" if p.returncode == 0 else f"rc {p.returncode}",
                  f"{summary} ({time.monotonic() - t0:.0f} s)")
    except subprocess.TimeoutExpired:
        table.add(step, os.path.basename(path), "TIMEOUT", f"after {timeout:.0f} s")


# ------------------------------------------------------------------------------------- step 2


def write_q4_k_m_file(path: str, shape: dict) -> str:
    """A random-weight qwen3 GGUF of ``shape`` in llama.cpp's Q4_K_M mix (attn_v and half of the
    ffn_down in Q6_K, output Q6_K, the rest Q4_K). One layer's bytes are drawn and reused by every
    layer (speed does not depend on the values)."""
    import gguf
    import numpy as np

    from hanzo_torch.backends.triton._testing import random_packed

    H, D, Hq, Hk, F, V, L = (shape["hidden"], shape["head_dim"], shape["n_head"] * shape["head_dim"],
                             shape["n_head_kv"] * shape["head_dim"], shape["ffn"], shape["vocab"], shape["n_layer"])
    T = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_block_count(L)
    w.add_context_length(40960)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(shape["n_head"])
    w.add_head_count_kv(shape["n_head_kv"])
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)

    def packed(qt, rows, cols, seed):
        return random_packed(qt, (rows, cols), seed=seed, scale=0.004).numpy()

    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", packed("Q4_K", V, H, 1), raw_dtype=T.Q4_K)
    w.add_tensor("output_norm.weight", ones(H), raw_dtype=T.F32)
    w.add_tensor("output.weight", packed("Q6_K", V, H, 2), raw_dtype=T.Q6_K)
    layer = dict(q=packed("Q4_K", Hq, H, 3), k=packed("Q4_K", Hk, H, 4), v=packed("Q6_K", Hk, H, 5),
                 o=packed("Q4_K", H, Hq, 6), gate=packed("Q4_K", F, H, 7), up=packed("Q4_K", F, H, 8),
                 down4=packed("Q4_K", H, F, 9), down6=packed("Q6_K", H, F, 10))
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones(H), raw_dtype=T.F32)
        w.add_tensor(p + "attn_q.weight", layer["q"], raw_dtype=T.Q4_K)
        w.add_tensor(p + "attn_k.weight", layer["k"], raw_dtype=T.Q4_K)
        w.add_tensor(p + "attn_v.weight", layer["v"], raw_dtype=T.Q6_K)
        w.add_tensor(p + "attn_q_norm.weight", ones(D), raw_dtype=T.F32)
        w.add_tensor(p + "attn_k_norm.weight", ones(D), raw_dtype=T.F32)
        w.add_tensor(p + "attn_output.weight", layer["o"], raw_dtype=T.Q4_K)
        w.add_tensor(p + "ffn_norm.weight", ones(H), raw_dtype=T.F32)
        w.add_tensor(p + "ffn_gate.weight", layer["gate"], raw_dtype=T.Q4_K)
        w.add_tensor(p + "ffn_up.weight", layer["up"], raw_dtype=T.Q4_K)
        six = i < L // 8 or i >= 7 * L // 8 or (i - L // 8) % 3 == 2  # llama.cpp's use_more_bits
        w.add_tensor(p + "ffn_down.weight", layer["down6"] if six else layer["down4"],
                     raw_dtype=T.Q6_K if six else T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _kernels_per_step(step_fn, device) -> str:
    if device != "cuda":
        return "n/a (cpu)"
    import torch
    from torch.profiler import ProfilerActivity, profile

    step_fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step_fn()
        torch.cuda.synchronize()
    n = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return str(n)


def model_decode(table: Table, device: str, shape: dict, n_decode: int, workdir: str) -> None:
    import torch

    import hanzo_torch
    from hanzo_torch.decode_graphs import DecodeStep

    t0 = time.monotonic()
    path = write_q4_k_m_file(os.path.join(workdir, "qwen3-8b-shape-q4_k_m.gguf"), shape)
    size = os.path.getsize(path)
    table.add("decode", "Q4_K_M file", f"{size / 2**30:.2f} GiB", f"written in {time.monotonic() - t0:.0f} s")
    t0 = time.monotonic()
    model = hanzo_torch.load(path, device=device, max_context=16 + 2 * n_decode + 8)
    table.add("decode", "load", f"{time.monotonic() - t0:.1f} s", f"{device}, {model.dtype}")
    prompt = torch.arange(16, device=device)[None] * 7
    with torch.inference_mode():
        for mode in ("eager", "graph"):
            model.reset()
            model(prompt, positions=torch.arange(16, device=device)[None], last_only=True)
            step = DecodeStep(model, 1, torch.device(device), cuda_graph=(mode == "graph"), last_only=True)
            tok = 3
            pos = 16
            step.input_ids.fill_(tok)
            step.positions.fill_(pos)
            step()  # the capture (graph) or the first launches (eager) are not timed
            _sync(device)
            t1 = time.perf_counter()
            for i in range(n_decode):
                pos += 1
                step.input_ids.fill_(100 + i)
                step.positions.fill_(pos)
                step()
            _sync(device)
            dt = time.perf_counter() - t1
            label = f"tokens/s {mode}" + ("" if mode == "eager" or step.graphed else " (NOT captured)")
            table.add("decode", label, f"{n_decode / dt:.1f}", f"{n_decode} steps, {dt / n_decode * 1e3:.2f} ms/token")

            def one():
                step.positions.fill_(pos)
                step()
            table.add("decode", f"kernels/token {mode}", _kernels_per_step(one, device), "torch.profiler, GPU events")
    del model
    os.remove(path)


# ------------------------------------------------------------------------------------- steps 3-4


def formats_bench(table: Table, device: str, formats, N: int, K: int, M_gemm: int, deadline: float,
                  reps: int) -> None:
    import torch

    from hanzo_torch.backends.triton import quant
    from hanzo_torch.backends.triton._testing import random_packed
    from hanzo_torch.ops.quant import mul_mat_reference
    from triton_gpu_check import _median_time, copy_bandwidth

    bw = copy_bandwidth(device, (1 << 30) if device == "cuda" else (1 << 20))
    table.add("matvec", "copy bandwidth", f"{bw / 1e9:.0f} GB/s", "dst.copy_(src), read+write")
    xg = torch.randn(M_gemm, K, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    wd = torch.randn(N, K, device=device, dtype=xg.dtype)
    t_dense = _median_time(lambda: xg @ wd.t(), reps=reps)
    dense = 2 * M_gemm * N * K / t_dense / 1e12
    table.add("gemm", f"torch dense {M_gemm}x{N}x{K}", f"{dense:.1f} TF/s", str(xg.dtype))
    del wd
    x1 = xg[:1].contiguous()

    def rel(y, r):
        return ((y.float() - r.float()).abs().max() / r.float().abs().max()).item()

    for qtype in formats:
        if time.monotonic() > deadline:
            table.add("matvec", qtype, "skipped", "budget spent")
            continue
        try:
            w = random_packed(qtype, (N, K), seed=0).to(device)
            nbytes = w.numel()
            ref1 = mul_mat_reference(x1, w, qtype)
            speeds = {}
            for path in ("f32", "int8"):
                if path == "int8" and not quant._group_len(qtype):
                    continue
                quant.DECODE_OVERRIDE = path
                try:
                    e = rel(quant.mul_mat(x1, w, qtype), ref1)
                    # int8: the q8_1 rounding of the activation, about 2^-8 relative per value
                    if not e < (2e-2 if path == "int8" else 1e-2):
                        table.add("matvec", f"{qtype} {path}", "FAIL", f"max rel err {e:.1e}")
                        continue
                    t = _median_time(lambda: quant.mul_mat(x1, w, qtype), reps=reps)
                finally:
                    quant.DECODE_OVERRIDE = ""
                speeds[path] = nbytes / t
                table.add("matvec", f"{qtype} {path}", f"{nbytes / t / 1e9:.0f} GB/s",
                          f"{nbytes / t / bw:.2f} of copy, {t * 1e6:.1f} us, err {e:.1e}")
            if len(speeds) == 2:
                best = max(speeds, key=speeds.get)
                table.add("matvec", f"{qtype} faster path", best,
                          f"int8/f32 {speeds['int8'] / speeds['f32']:.2f}, table: {quant.DECODE_PATH.get(qtype)}")
            if time.monotonic() < deadline:
                e = rel(quant.mul_mat(xg, w, qtype), mul_mat_reference(xg, w, qtype))
                if not e < 2e-2:
                    table.add("gemm", qtype, "FAIL", f"max rel err {e:.1e}")
                else:
                    tg = _median_time(lambda: quant.mul_mat(xg, w, qtype), reps=max(reps // 2, 1))
                    tf = 2 * M_gemm * N * K / tg / 1e12
                    table.add("gemm", qtype, f"{tf:.1f} TF/s", f"{tf / dense:.2f} of dense, err {e:.1e}")
            del w
        except Exception as e:  # one broken format must not hide the others
            table.add("matvec", qtype, "ERROR", f"{type(e).__name__}: {str(e)[:160]}")


def tp_check(table: Table, timeout: float) -> None:
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        table.add("tp", "tensor parallel (NCCL)", "skipped", f"{n} GPU(s), needs 2 or more")
        return
    from tests.gguf_builders import tiny_spec, tokenizer_metadata, write_tiny_gguf

    qtypes = {"embd": "Q8_0", "attn": "Q4_K", "ffn": "Q4_K", "ffn_down": "Q6_K"}
    with tempfile.TemporaryDirectory() as d:
        path = write_tiny_gguf(os.path.join(d, "tp.gguf"), tiny_spec("qwen3", ffn=1024, qtypes=qtypes),
                               tokenizer_metadata(full=False))
        try:
            p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                os.path.join(ROOT, "benchmarks", "tp_check.py"), path, "--steps", "128"],
                               cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            table.add("tp", "tensor parallel (NCCL)", "TIMEOUT", f"after {timeout:.0f} s")
            return
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("[tp ")]
    for ln in lines:
        name, _, rest = ln.split("] ", 1)[1].partition(": ")
        verdict, _, note = rest.partition(" ")
        table.add("tp", name, verdict, note)
    if p.returncode != 0 and not lines:
        print((p.stdout + p.stderr)[-4000:], flush=True)
        table.add("tp", "tensor parallel (NCCL)", f"rc {p.returncode}", "see the output above")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy shapes, Triton under TRITON_INTERPRET=1")
    ap.add_argument("--budget-s", type=float, default=500.0, help="wall-clock budget (default 500 s)")
    ap.add_argument("--formats", default="all", help="comma-separated ggml names, 'all' or 'qwen'")
    ap.add_argument("--skip", default="", help="comma-separated steps to skip: graph,decode,formats,tp,conformance")
    args = ap.parse_args()
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from hanzo_torch.backends.triton.formats import SUPPORTED

    table = Table()
    if args.dry_run:
        device, shape, n_decode, N, K, M, reps = "cpu", TOY, 4, 16, 256, 16, 1
        formats = ["Q4_K", "IQ2_XXS"] if args.formats == "all" else args.formats.split(",")
    else:
        if not torch.cuda.is_available():
            print("no CUDA/ROCm device (use --dry-run for the CPU plumbing check)")
            return 1
        import hanzo_torch.backends.triton as backend

        device, shape, n_decode, N, K, M, reps = "cuda", QWEN3_8B, 128, 4096, 14336, 512, 20
        table.add("setup", torch.cuda.get_device_name(), f"torch {torch.__version__}",
                  "triton backend " + ("registered" if backend.AVAILABLE else f"NOT registered: {backend.REASON}"))
        formats = (list(SUPPORTED) if args.formats == "all" else
                   ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0", "BF16", "F16", "F32"] if args.formats == "qwen" else
                   [f.strip().upper() for f in args.formats.split(",") if f.strip()])

    def left():
        return deadline - time.monotonic()

    if "graph" not in skip and not args.dry_run:
        _pytest(table, "replay", os.path.join(ROOT, "tests", "test_cuda_graphs.py"), min(left(), 200))
    if "decode" not in skip:
        try:
            with tempfile.TemporaryDirectory() as d:
                model_decode(table, device, shape, n_decode, d)
        except Exception as e:
            traceback.print_exc()
            table.add("decode", "model decode", "ERROR", f"{type(e).__name__}: {str(e)[:160]}")
    if "formats" not in skip:
        try:
            # the conformance suite keeps at least 180 s
            formats_bench(table, device, formats, N, K, M, deadline - (0 if args.dry_run else 180), reps)
        except Exception as e:
            traceback.print_exc()
            table.add("matvec", "formats", "ERROR", f"{type(e).__name__}: {str(e)[:160]}")
    if "tp" not in skip and not args.dry_run:
        try:
            tp_check(table, min(120.0, max(30.0, left() - 200)))
        except Exception as e:
            traceback.print_exc()
            table.add("tp", "tensor parallel (NCCL)", "ERROR", f"{type(e).__name__}: {str(e)[:160]}")
    if "conformance" not in skip and not args.dry_run:
        _pytest(table, "conformance", os.path.join(ROOT, "tests", "test_triton_gpu.py"), left() - 5, ("-x",))
    table.add("total", "wall clock", f"{time.monotonic() - t_start:.0f} s", f"budget {args.budget_s:.0f} s")
    print()
    print(table.render())
    bad = [r for r in table.rows if r[2] in ("FAIL", "ERROR", "TIMEOUT") or r[2].startswith("rc ")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
