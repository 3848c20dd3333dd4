"""GPU check of the Triton backend: speed per format against the card's own copy bandwidth,
GEMM throughput, and the gpu-marked tests. One short run, ratios measured in the same run.

    python benchmarks/triton_gpu_check.py                 # everything (about 3-5 min on an H100/H200)
    python benchmarks/triton_gpu_check.py --formats Q4_K,Q6_K --no-tests
    python benchmarks/triton_gpu_check.py --aot           # no GPU needed: compile every kernel for
                                                          # sm_90 and gfx942, report registers/spills

Reports (GPU mode):
- copy bandwidth: ``dst.copy_(src)`` of 1 GiB, counted as read + write bytes per second;
- mat-vec (decode, M=1, bf16 activations) at N x K = 14336 x 4096 per format: packed weight
  bytes per second and the fraction of the copy bandwidth (a decode mat-vec at the memory
  roofline reaches 0.88-0.99 of it, ../shared/DESIGN.md section 5); for formats with a grouped
  rule also the per-value-rule kernel (quant.GROUPED = False) as an A/B in the same run;
  the GEMM column uses the grouped weight-tile unpack likewise (A/B by hand with that variable);
- GEMM (prefill, M=512, bf16) per format: TFLOP/s and the ratio to torch's dense bf16 matmul
  of the same shape;
- each kernel's result is checked against the op reference (max relative error) before it is
  timed: a wrong fast kernel is reported as FAIL, not as a speed.
Then ``pytest -m gpu tests/test_triton_gpu.py``. Every step is guarded: a failure is printed
and the run goes on. ``--budget-s`` stops starting new formats once that much time has passed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _median_time(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn`` (CUDA events on a GPU; wall clock otherwise, for dry runs)."""
    import torch

    for _ in range(warmup):
        fn()
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if gpu:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(device: str = "cuda", n: int = 1 << 30) -> float:
    """Device copy bandwidth in bytes/s (read + write) of an ``n``-byte buffer."""
    import torch

    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), reps=10)
    del src, dst
    return 2 * n / t


def bench_formats(formats, budget_s: float, N: int = 14336, K: int = 4096, M_gemm: int = 512,
                  device: str = "cuda", reps: int = 20) -> list[str]:
    import torch

    from hanzo_torch.ops.quant import mul_mat_reference
    from hanzo_torch.backends.triton import quant
    from hanzo_torch.backends.triton._testing import random_packed

    t_start = time.monotonic()
    bw = copy_bandwidth(device, (1 << 30) if device == "cuda" else (1 << 20))
    lines = [f"copy bandwidth: {bw / 1e9:.0f} GB/s (dst.copy_(src) of 1 GiB, read+write)"]
    xg = torch.randn(M_gemm, K, device=device, dtype=torch.bfloat16)
    wd = torch.randn(N, K, device=device, dtype=torch.bfloat16)
    t_dense = _median_time(lambda: xg @ wd.t(), reps=reps)
    dense_tflops = 2 * M_gemm * N * K / t_dense / 1e12
    lines.append(f"torch dense bf16 GEMM {M_gemm}x{N}x{K}: {dense_tflops:.1f} TFLOP/s")
    del wd
    lines.append(f"{'format':8} {'bpw':>5} {'matvec GB/s':>11} {'of copy':>7} {'us':>8} {'err':>8} | "
                 f"{'GEMM TF/s':>9} {'of dense':>8} {'err':>8}")
    x1 = torch.randn(1, K, device=device, dtype=torch.bfloat16)
    for qtype in formats:
        if time.monotonic() - t_start > budget_s:
            lines.append(f"{qtype:8} skipped: --budget-s {budget_s:.0f} s spent")
            continue
        try:
            w = random_packed(qtype, (N, K), seed=0).to(device)
            nbytes = w.numel()
            bpw = 8 * nbytes / (N * K)
            y = quant.mul_mat(x1, w, qtype)
            r = mul_mat_reference(x1, w, qtype)
            e1 = ((y.float() - r.float()).abs().max() / r.float().abs().max()).item()
            t1 = _median_time(lambda: quant.mul_mat(x1, w, qtype), reps=reps)
            gbs = nbytes / t1
            ok1 = "FAIL" if not e1 < 2e-2 else f"{e1:.1e}"
            yg = quant.mul_mat(xg, w, qtype)
            rg = mul_mat_reference(xg, w, qtype)
            eg = ((yg.float() - rg.float()).abs().max() / rg.float().abs().max()).item()
            tg = _median_time(lambda: quant.mul_mat(xg, w, qtype), reps=max(reps // 2, 1))
            tf = 2 * M_gemm * N * K / tg / 1e12
            okg = "FAIL" if not eg < 2e-2 else f"{eg:.1e}"
            ab = ""
            if quant._group_len(qtype):  # A/B: the same decode through the per-value rules
                quant.GROUPED = False
                try:
                    te = _median_time(lambda: quant.mul_mat(x1, w, qtype), reps=reps)
                finally:
                    quant.GROUPED = True
                ab = f"  (element rules: {nbytes / te / 1e9:.0f} GB/s)"
            lines.append(f"{qtype:8} {bpw:5.2f} {gbs / 1e9:11.0f} {gbs / bw:7.2f} {t1 * 1e6:8.1f} {ok1:>8} | "
                         f"{tf:9.1f} {tf / dense_tflops:8.2f} {okg:>8}{ab}")
            del w
        except Exception as e:  # keep going: one broken format must not hide the others
            lines.append(f"{qtype:8} ERROR {type(e).__name__}: {str(e)[:200]}")
        print(lines[-1], flush=True)
    return lines


def aot_check(formats, targets=("cuda:90", "hip:gfx942")) -> int:
    """Compile every kernel (all given formats) for the targets without a GPU; print registers and
    spills (CUDA, via cuobjdump). Returns the number of failures."""
    import re
    import tempfile

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hanzo_torch.backends.triton import formats as F
    from hanzo_torch.backends.triton import fused as f
    from hanzo_torch.backends.triton import quant as q

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    failures = 0

    def comp(target, name, fn, args, opts):
        nonlocal failures
        sig, consts = {}, {}
        for a in fn.arg_names:
            v = args[a]
            if isinstance(v, tuple):  # ("c", value): a constexpr
                sig[a], consts[a] = "constexpr", v[1]
            elif isinstance(v, str):
                sig[a] = v
            else:
                sig[a], consts[a] = "constexpr", v
        t0 = time.monotonic()
        try:
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target, options=opts)
        except Exception as e:
            failures += 1
            print(f"FAIL {target.backend} {name}: {str(e)[-800:]}", flush=True)
            return
        info = ""
        if target.backend == "cuda" and os.path.exists(cuobjdump):
            with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
                fh.write(k.asm["cubin"])
                fh.flush()
                ru = subprocess.run([cuobjdump, "--dump-resource-usage", fh.name], capture_output=True, text=True).stdout
            m = re.search(r"REG:(\d+).*?STACK:(\d+)", ru)
            if m:
                info = f"regs {m.group(1)} stack {m.group(2)}" + ("  <-- spills" if int(m.group(2)) else "")
        print(f"ok   {target.backend} {name} ({time.monotonic() - t0:.1f} s) {info}", flush=True)

    for tspec in targets:
        backend, arch = tspec.split(":")
        target = GPUTarget(backend, int(arch) if backend == "cuda" else arch, 32 if backend == "cuda" else 64)
        for fmt in formats:
            fid, qk, ts = F.format_info(fmt)
            fa = dict(FMT=fid, QK=qk, TS=ts)
            comp(target, f"dequantize {fmt}", q._dequantize_kernel,
                 dict(src="*u8", dst="*bf16", ids="*i64", tab="*fp32", n_src_rows="i32", K="i32", rb="i32",
                      GATHER=True, BLOCK=q._DEQUANT_BLOCK, **fa), {"enable_fp_fusion": False})
            for M in (1, 8):
                BM, BN, BK = q._matvec_config(M)
                comp(target, f"matvec {fmt} M={M}", q._matvec_kernel,
                     dict(x="*bf16", w="*u8", y="*bf16", tab="*fp32", ids="*i64", M="i32", N="i32", K="i32",
                          rb="i32", x_div="i32", n_experts="i32", INDEXED=(M == 1), BM=BM, BN=BN, BK=BK, **fa),
                     {"num_warps": q.MATVEC_WARPS})
            if F.GROUP_LEN.get(fmt):
                comp(target, f"matvec-grouped {fmt}", q._matvec_grouped_kernel,
                     dict(x="*bf16", w="*u8", y="*bf16", tab="*fp32", ids="*i64", N="i32", K="i32", rb="i32",
                          x_div="i32", n_experts="i32", GL=F.GROUP_LEN[fmt], INDEXED=True, BN=q.GROUPED_BN,
                          BK=q.GROUPED_BK, **fa), {"num_warps": q.MATVEC_WARPS})
                comp(target, f"matvec-q8 {fmt}", q._matvec_q8_kernel,
                     dict(xq="*u8", w="*u8", y="*bf16", tab="*fp32", ids="*i64", N="i32", K="i32", rb="i32",
                          x_div="i32", n_experts="i32", GL=F.GROUP_LEN[fmt], INDEXED=True, BN=q.Q8_BN,
                          BK=q.Q8_BK, **fa), {"num_warps": q.MATVEC_WARPS, "enable_fp_fusion": False})
            for grouped in (False, True):
                comp(target, f"gemm {fmt} grouped={grouped}", q._gemm_kernel,
                     dict(x="*bf16", w="*u8", y="*bf16", tab="*fp32", rows_idx="*i64", tile_expert="*i64",
                          M="i32", N="i32", K="i32", rb="i32", x_div="i32", n_experts="i32", DOT=tl.bfloat16,
                          PREC=("c", "tf32"), GROUPED=grouped, GL=q._gemm_group_len(fmt, q._gemm_config(512, None)),
                          **q._gemm_config(512, None), **fa),
                     {"num_warps": q.GEMM_WARPS, "num_stages": 3})
        comp(target, "quantize_q8_1", q._quantize_q8_1_kernel, dict(x="*bf16", out="*u8", n_blocks="i32", BB=8),
             {"enable_fp_fusion": False})
        comp(target, "add_rms_norm", f._rms_norm_kernel,
             dict(x="*bf16", r="*bf16", w="*bf16", out="*bf16", s_out="*bf16", H="i32", eps="fp32", ADD=True,
                  BLOCK=4096), {})
        comp(target, "swiglu", f._swiglu_kernel, dict(g="*bf16", u="*bf16", out="*bf16", n="i32", BLOCK=1024), {})
        comp(target, "qk_norm_rope", f._qk_norm_rope_kernel,
             dict(q="*bf16", k="*bf16", qo="*bf16", ko="*bf16", qw="*bf16", kw="*bf16", pos="*i64",
                  inv_freq="*fp32", T="i32", Hq="i32", Hk="i32", eps="fp32", NORM=True, HALF=64, BH=64), {})
        comp(target, "moe_route", f._moe_route_kernel,
             dict(logits="*bf16", w_out="*fp32", id_out="*i64", E="i32", K=8, KP=8, NORMALIZE=True, BE=128), {})
        comp(target, "kv_cache_write", f._kv_write_kernel,
             dict(kc="*bf16", vc="*bf16", k="*bf16", v="*bf16", pos="*i64", T="i32", S="i32", cs_b="i64",
                  cs_s="i64", HD="i32", BLOCK=1024), {})
        for split in (False, True):
            comp(target, f"attention D=128 split={split}", f._attention_kernel,
                 dict(q="*bf16", kc="*bf16", vc="*bf16", out="*bf16", pos="*i64", ws_m="*fp32", ws_l="*fp32",
                      ws_acc="*fp32", T="i32", S="i32", Hq="i32", Hk="i32", G="i32", scale="fp32", chunk="i32",
                      qs_b="i64", qs_t="i64", qs_h="i64", cs_b="i64", cs_s="i64", cs_h="i64", D=128, BD=128,
                      BR=16, BS=f.ATTN_BS, QK_DOT=tl.bfloat16, QK_PREC=("c", "tf32"), SPLIT=split),
                 {"num_warps": 4})
        comp(target, "attention combine D=128", f._attention_combine_kernel,
             dict(ws_m="*fp32", ws_l="*fp32", ws_acc="*fp32", out="*bf16", T="i32", Hq="i32", Hk="i32", G="i32",
                  n_split="i32", D=128, BD=128, BR=16), {"num_warps": 4})
    print(f"AOT check: {failures} failure(s)")
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="all", help="comma-separated ggml names, or 'all' (default), or 'qwen'")
    ap.add_argument("--no-tests", action="store_true", help="skip pytest -m gpu tests/test_triton_gpu.py")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new formats after this many seconds")
    ap.add_argument("--aot", action="store_true", help="compile-only check for sm_90 and gfx942 (no GPU needed)")
    args = ap.parse_args()

    from hanzo_torch.backends.triton.formats import SUPPORTED

    if args.formats == "all":
        formats = list(SUPPORTED)
    elif args.formats == "qwen":
        formats = ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0", "BF16", "F16", "F32"]
    else:
        formats = [f.strip().upper() for f in args.formats.split(",") if f.strip()]
    if args.aot:
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        return 1 if aot_check(formats) else 0

    import torch

    if not torch.cuda.is_available():
        print("no CUDA/ROCm device: nothing to measure (use --aot for the compile-only check)")
        return 1
    import hanzo_torch.backends.triton as backend

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton backend "
          f"{'registered' if backend.AVAILABLE else 'NOT registered: ' + str(backend.REASON)}", flush=True)
    rc = 0
    try:
        for line in bench_formats(formats, args.budget_s):
            print(line)
    except Exception:
        traceback.print_exc()
        rc = 1
    if not args.no_tests:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "pytest", os.path.join(ROOT, "tests", "test_triton_gpu.py"),
                            "-m", "gpu", "-q", "-x", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning"],
                           cwd=ROOT, capture_output=True, text=True)
        out = (p.stdout + p.stderr).strip().splitlines()
        print("\n".join(out[-30:]))
        print(f"gpu tests: rc {p.returncode} in {time.monotonic() - t0:.0f} s")
        rc = rc or p.returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
