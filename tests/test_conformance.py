"""One conformance suite: every hanzo op on every backend that runs here, every format, against the reference.

A test body per op, parametrized over (backend, format, dtype); the tolerance of each op is declared
once, in :data:`TOLERANCE`, and applies to every backend. The oracle is ``torch.ops.hanzo_ref.<op>``
(the vectorized-torch references, themselves gated bit for bit against ``gguf.quants.dequantize``
in tests/test_formats.py and tests/test_ops_quant.py).

Backends:
- ``cpu-<isa>`` for every instruction set this CPU runs (scalar, avx2, avx512): the C++ kernels
  through ``torch.ops.hanzo`` (the CPU dispatch key), with the ISA set in process;
- ``triton-interp``: the Triton kernels as registered on the CUDA key (checks, format routing,
  kernel), on CPU tensors under ``TRITON_INTERPRET=1``. The interpreter must be chosen before triton
  is imported, so the parent test runs this file again in a child process with
  ``HANZO_CONFORMANCE=triton-interp`` (one format per family: the interpreter is slow; the full format
  matrix of the Triton kernels is in tests/test_triton_kernels.py).

- ``vulkan``: the ops on "vulkan" tensors (arguments moved there, results brought back), on
  whatever Vulkan device is here (lavapipe in CI); formats from the Vulkan rule table. An op
  without a native Vulkan kernel runs its reference on the device (aten ops natively or through
  the CPU fallback). Skipped, with the backend's reason, when it cannot run here.

A new backend gets its tests by adding a :class:`Backend` to :func:`_backends`.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import hanzo_torch
from hanzo_torch.backends.triton._testing import random_packed

ONLY = os.environ.get("HANZO_CONFORMANCE", "")  # set in the child process that runs the interpreter
QUANT = [f for f in hanzo_torch.QUANTIZED_FORMATS if f != "NVFP4"]
ONE_PER_FAMILY = ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ2_XXS", "IQ4_XS", "TQ2_0", "MXFP4"]


@dataclass
class Backend:
    name: str
    run: Callable  # run(op, *args) -> the op's result on this backend
    formats: tuple


def _cpu_backend(isa: str) -> Backend:
    from hanzo_torch.backends import cpu

    def run(op, *args):
        with cpu.use_isa(isa), hanzo_torch.ops.use_reference(op, enabled=False):
            return getattr(torch.ops.hanzo, op)(*args)

    return Backend(f"cpu-{isa}", run, tuple(cpu.formats()))


def _triton_backend() -> Backend:
    import hanzo_torch.backends.triton as backend
    from hanzo_torch.backends.triton import ffn

    fmts = frozenset(backend.supported_formats())
    table = {**backend.kernels(), "swiglu_mul_mat": ffn.swiglu_mul_mat}
    kernels = {op: backend.wrap(op, fn, fmts) for op, fn in table.items()}

    def run(op, *args):
        with hanzo_torch.ops.use_reference(op, enabled=False):
            return kernels[op](*args)

    return Backend("triton-interp", run, tuple(f for f in ONE_PER_FAMILY if f in fmts))


def _vulkan_backend() -> Backend:
    from hanzo_torch.backends import vulkan

    def to_device(a):
        return a.to("vulkan") if isinstance(a, torch.Tensor) else a

    def to_host(r):
        if isinstance(r, (tuple, list)):
            return type(r)(to_host(v) for v in r)
        return r.cpu() if isinstance(r, torch.Tensor) else r

    def run(op, *args):
        dev = [to_device(a) for a in args]
        with hanzo_torch.ops.use_reference(op, enabled=False):
            out = getattr(torch.ops.hanzo, op)(*dev)
        if op == "kv_cache_write":  # in place: the caller's caches get the device's result
            args[0].copy_(dev[0].cpu())
            args[1].copy_(dev[1].cpu())
        return to_host(out)

    return Backend("vulkan", run, tuple(vulkan.formats()))


def _backends() -> list:
    if ONLY == "triton-interp":
        return [_triton_backend()]
    from hanzo_torch.backends import cpu, vulkan

    out = [_cpu_backend(isa) for isa in cpu.isa_levels()] if cpu.extension() is not None else []
    if vulkan.available():
        out.append(_vulkan_backend())
    return out


BACKENDS = _backends()
_IDS = [b.name for b in BACKENDS]


def _g(*key) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) & 0xFFFF_FFFF)


def _act_bound(x: torch.Tensor, w_f32: torch.Tensor) -> torch.Tensor:
    """Per output, the error of ``x @ W^T`` when x is quantized to int8 in blocks of 256 (the
    coarser of the two activation block sizes the CPU kernels use) plus float32 rounding:
    ``sum_k |W_nk| d_k / 2 + 1e-4 (|x| @ |W|^T)``; a float32 kernel is far inside it."""
    x2 = x.double().reshape(-1, x.shape[-1])
    K = x2.shape[1]
    blk = min(256, K)
    d = x2.abs().reshape(x2.shape[0], K // blk, blk).amax(-1) / 127
    dk = d.repeat_interleave(blk, dim=1)
    wa = w_f32.double().abs().reshape(-1, K)
    return 0.5 * dk @ wa.t() + 1e-4 * (x2.abs() @ wa.t()) + 1e-6


def _dtype_rtol(dtype) -> float:
    return {torch.float32: 2e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]


def _close(got, want, dtype):
    """Float results of the fused ops: float32 statistics in both, one rounding to ``dtype``."""
    rtol = _dtype_rtol(dtype)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rtol * max(1.0, want.float().abs().max().item()))


def _exact(got, want, dtype=None):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


TOLERANCE = {
    "dequantize": _exact,
    "get_rows": _exact,
    "kv_cache_write": _exact,
    "rms_norm": _close,
    "add_rms_norm": _close,
    "qk_norm_rope": _close,
    "swiglu": _close,
    "attention": _close,
    "moe_route": _close,
    # mul_mat, mul_mat_id, swiglu_mul_mat: the activation-quantization bound (_act_bound)
}
"""The tolerance of each op, for every backend (see the module docstring)."""


def _within_act_bound(y, ref, x, w_f32, what):
    bound = _act_bound(x, w_f32).reshape(ref.shape)
    err = (y.double() - ref.double()).abs()
    assert (err <= bound).all(), f"{what}: error {err.max().item():.3e} over the bound (ratio {(err / bound).max():.2f})"


def _params(formats_of):
    return [pytest.param(b, q, id=f"{b.name}-{q}") for b in BACKENDS for q in formats_of(b)]


def _dense_and(b):
    return list(b.formats) + (["F16"] if b.name.startswith("cpu") else [])


# ---------------------------------------------------------------------------------------------- quantized ops
@pytest.mark.parametrize("backend,qtype", _params(lambda b: b.formats))
def test_dequantize(backend, qtype):
    w = random_packed(qtype, (5, 256), seed=1)
    got = backend.run("dequantize", w, qtype, [5, 256], torch.float32)
    TOLERANCE["dequantize"](got, torch.ops.hanzo_ref.dequantize(w, qtype, [5, 256], torch.float32))


@pytest.mark.parametrize("backend,qtype", _params(lambda b: b.formats))
def test_get_rows(backend, qtype):
    w = random_packed(qtype, (10, 256), seed=2)
    ids = torch.tensor([[1, 3], [9, 0]])
    got = backend.run("get_rows", w, ids, qtype, torch.float32)
    TOLERANCE["get_rows"](got, torch.ops.hanzo_ref.get_rows(w, ids, qtype, torch.float32))
    # a bf16 result is the float32 row rounded once (the Triton interpreter's rounding may differ
    # from torch's in the last bit)
    got = backend.run("get_rows", w, ids, qtype, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    _close(got, torch.ops.hanzo_ref.get_rows(w, ids, qtype, torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("backend,qtype", _params(_dense_and))
def test_mul_mat(backend, qtype):
    K, N = 256, 12
    w = random_packed(qtype, (N, K), seed=3)
    wf = torch.ops.hanzo_ref.dequantize(w, qtype, [N, K], torch.float32)
    for M in (1, 7):  # mat-vec and GEMM paths
        x = torch.randn(M, K, generator=_g("mm", qtype, M))
        ref = torch.ops.hanzo_ref.mul_mat(x, w, qtype)
        _within_act_bound(backend.run("mul_mat", x, w, qtype), ref, x, wf, f"{backend.name} {qtype} M={M}")
    xb = torch.randn(2, 3, K, generator=_g("mmb", qtype)).to(torch.bfloat16)
    yb = backend.run("mul_mat", xb, w, qtype)
    assert yb.dtype == torch.bfloat16 and yb.shape == (2, 3, N)
    _within_act_bound(yb.float(), torch.ops.hanzo_ref.mul_mat(xb.float(), w, qtype), xb.float(), wf, "bf16")


@pytest.mark.parametrize("backend,qtype", _params(lambda b: b.formats))
def test_mul_mat_id(backend, qtype):
    E, N, K, T = 3, 8, 256, 4
    w = random_packed(qtype, (E, N, K), seed=4)
    wf = torch.ops.hanzo_ref.dequantize(w, qtype, [E, N, K], torch.float32)
    ids = torch.tensor([[0, 2], [1, 1], [2, 0], [0, 1]])
    x = torch.randn(T, K, generator=_g("mmid", qtype))
    got = backend.run("mul_mat_id", x, w, ids, qtype)
    ref = torch.ops.hanzo_ref.mul_mat_id(x, w, ids, qtype)
    for t in range(T):
        for j in range(2):
            _within_act_bound(got[t, j], ref[t, j], x[t:t + 1], wf[ids[t, j]], f"{qtype} t={t} j={j}")
    if backend.name.startswith("cpu"):  # device backends assert on the device instead (no host sync)
        with pytest.raises(IndexError):
            backend.run("mul_mat_id", x, w, torch.tensor([[0, 3]] * T), qtype)


@pytest.mark.parametrize("backend,qtype", _params(lambda b: b.formats))
def test_swiglu_mul_mat(backend, qtype):
    K, F = 256, 16
    up = "Q6_K" if "Q6_K" in backend.formats else qtype
    wg, wu = random_packed(qtype, (F, K), seed=5), random_packed(up, (F, K), seed=6)
    x = torch.randn(3, K, generator=_g("swmm", qtype))
    got = backend.run("swiglu_mul_mat", x, wg, wu, qtype, up)
    with hanzo_torch.ops.use_reference():
        ref = torch.ops.hanzo.swiglu_mul_mat(x, wg, wu, qtype, up)
        g, u = torch.ops.hanzo.mul_mat(x, wg, qtype), torch.ops.hanzo.mul_mat(x, wu, up)
    # first-order propagation of the projections' bounds through silu(g) * u (|silu'| <= 1.1)
    bg = _act_bound(x, torch.ops.hanzo_ref.dequantize(wg, qtype, [F, K], torch.float32))
    bu = _act_bound(x, torch.ops.hanzo_ref.dequantize(wu, up, [F, K], torch.float32))
    bound = 1.1 * bg * (u.double().abs() + bu) + torch.nn.functional.silu(g.double()).abs() * bu + 1e-6
    err = (got.double() - ref.double()).abs()
    assert (err <= bound).all(), f"{qtype}+{up}: error {err.max().item():.3e} over the bound"


# ---------------------------------------------------------------------------------------------- fused ops
_FLOATS = [torch.float32, torch.bfloat16]


def _fused_params():
    return [pytest.param(b, d, id=f"{b.name}-{str(d).split('.')[-1]}") for b in BACKENDS for d in _FLOATS]


@pytest.mark.parametrize("backend,dtype", _fused_params())
def test_norms_swiglu_route(backend, dtype):
    x, r = torch.randn(3, 5, 64, generator=_g(1)).to(dtype), torch.randn(3, 5, 64, generator=_g(2)).to(dtype)
    w = torch.randn(64, generator=_g(3)).to(dtype)
    ref = torch.ops.hanzo_ref
    TOLERANCE["rms_norm"](backend.run("rms_norm", x, w, 1e-6), ref.rms_norm(x, w, 1e-6), dtype)
    for a, b in zip(backend.run("add_rms_norm", x, r, w, 1e-6), ref.add_rms_norm(x, r, w, 1e-6)):
        TOLERANCE["add_rms_norm"](a, b, dtype)
    TOLERANCE["swiglu"](backend.run("swiglu", x, r), ref.swiglu(x, r), dtype)
    logits = torch.randn(7, 16, generator=_g(4)).to(dtype)
    wts, ids = backend.run("moe_route", logits, 4, True)
    rw, rids = ref.moe_route(logits, 4, True)
    assert torch.equal(ids, rids)
    TOLERANCE["moe_route"](wts, rw, torch.float32)


@pytest.mark.parametrize("backend,dtype", _fused_params())
def test_qk_norm_rope_kv_write_attention(backend, dtype):
    B, Hq, Hk, D, S = 2, 6, 2, 32, 24
    ref = torch.ops.hanzo_ref
    for T, start in ((9, 0), (1, 17)):  # a prompt and a decode step
        q = torch.randn(B, T, Hq, D, generator=_g(5, T)).to(dtype)
        k = torch.randn(B, T, Hk, D, generator=_g(6, T)).to(dtype)
        v = torch.randn(B, T, Hk, D, generator=_g(7, T)).to(dtype)
        pos = (torch.arange(T) + start).unsqueeze(0).repeat(B, 1)
        qw, kw = torch.randn(D, generator=_g(8)).to(dtype), torch.randn(D, generator=_g(9)).to(dtype)
        for a, b in zip(backend.run("qk_norm_rope", q, k, qw, kw, pos, 1e6, 1e-6),
                        ref.qk_norm_rope(q, k, qw, kw, pos, 1e6, 1e-6)):
            TOLERANCE["qk_norm_rope"](a, b, dtype)
        caches = [torch.randn(B, S, Hk, D, generator=_g(10, i)).to(dtype) for i in range(2)]
        mine = [c.clone() for c in caches]
        backend.run("kv_cache_write", mine[0], mine[1], k, v, pos)
        ref.kv_cache_write(caches[0], caches[1], k, v, pos)
        TOLERANCE["kv_cache_write"](mine[0], caches[0])
        TOLERANCE["kv_cache_write"](mine[1], caches[1])
        for impl in ("eager", "flash"):
            got = backend.run("attention", q, mine[0], mine[1], pos, D ** -0.5, impl)
            TOLERANCE["attention"](got, ref.attention(q, caches[0], caches[1], pos, D ** -0.5, impl), dtype)


def test_bad_arguments_raise_the_reference_errors():
    """Every backend rejects what the reference rejects, with the reference's error."""
    if not BACKENDS:
        pytest.skip("no native backend here")
    w = random_packed("Q4_K", (4, 256), seed=7)
    for b in BACKENDS:
        with pytest.raises(ValueError, match="bytes per Q4_K row"):
            b.run("mul_mat", torch.randn(1, 512), w, "Q4_K")
        with pytest.raises(ValueError, match="w must be"):
            b.run("rms_norm", torch.randn(2, 16), torch.ones(15), 1e-6)
        if b.name.startswith("cpu"):  # device backends assert on the device instead (no host sync)
            with pytest.raises(IndexError):
                b.run("get_rows", w, torch.tensor([4]), "Q4_K", torch.float32)


@pytest.mark.skipif(bool(ONLY), reason="the child process runs the interpreter cases themselves")
def test_vulkan_backend_runs_here():
    """The vulkan backend takes part in this suite, or says why it cannot."""
    from hanzo_torch.backends import vulkan

    if not vulkan.available():
        pytest.skip(f"vulkan backend unavailable: {vulkan.reason()}")
    assert "vulkan" in _IDS


@pytest.mark.skipif(bool(ONLY), reason="the child process runs the interpreter cases themselves")
def test_triton_interpreter_backend():
    """The Triton backend as a backend of this suite, in a child process with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "HANZO_CONFORMANCE": "triton-interp"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                         capture_output=True, text=True, timeout=900, env=env, cwd=os.path.dirname(__file__))
    tail = (out.stdout + out.stderr)[-3000:]
    assert out.returncode == 0, tail
    assert " passed" in tail and "triton-interp" not in tail.split("passed")[-1], tail
