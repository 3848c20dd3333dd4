"""One conformance suite: every hanzo op on every backend that runs here, every format, against the reference.

A test body per op, parametrized over (backend, format or dtype); the tolerance of each op is
declared once, in :data:`TOLERANCE`, and applies to every backend. The oracle is
``torch.ops.hanzo_ref.<op>`` (the vectorized-torch references, themselves gated bit for bit against
``gguf.quants.dequantize`` in tests/test_formats.py and tests/test_ops_quant.py, and against
textbook float64 compositions in tests/test_ops_fused.py and tests/test_ops_ffn.py).

Backends:
- ``cpu-<isa>`` for every instruction set this CPU runs (scalar, avx2, avx512, avx512-sim): the C++
  kernels through ``torch.ops.hanzo`` (the CPU dispatch key), with the ISA set in process.
  ``cpu-avx512-sim`` is the AVX-512 kernel source built for AVX2 with SIMDe's AVX-512 intrinsics
  (where the SIMDe headers were installed at build time): the gate of that source on CPUs without
  AVX-512. Only its contractions (mul_mat, mul_mat_id, swiglu_mul_mat) run code of their own; its
  other ops run the avx2 code again, which costs ~2 s;
- ``triton-interp``: the Triton kernels as registered on the CUDA key (checks, format routing,
  kernel), on CPU tensors under ``TRITON_INTERPRET=1``. The interpreter must be chosen before triton
  is imported, so the parent test runs this file again in a child process with
  ``HANZO_CONFORMANCE=triton-interp``;
- ``vulkan``: the ops on "vulkan" tensors (arguments moved there, results brought back), on
  whatever Vulkan device is here (lavapipe in CI); formats from the Vulkan rule table. An op
  without a native Vulkan kernel runs its reference on the device (aten ops natively or through
  the CPU fallback). Skipped, with the backend's reason, when it cannot run here. Its contractions
  take the float path (the int8 path off);
- ``vulkan-int8``: the contraction ops (``mul_mat``, ``swiglu_mul_mat``) on the vulkan device with
  its int8 path forced on (activations quantized to q8_1 on the device, int8 dot products), for
  the formats with int8 rules; held to float32 rounding of ``x_hat @ W^T`` with ``x_hat`` the q8_1
  values of x. Present where the device enables integer dot products (lavapipe does).

- ``mps-sim``: the Metal kernels of the mps backend (hanzo_torch/backends/mps, translated from the
  Vulkan shaders) compiled as C++ and run on the CPU harness, through the launch code a Mac runs;
  ``mps-sim-int8``: its contractions with the int8 path forced on (formats with int8 kernels);
- ``mps``: the ops on "mps" tensors, on a Mac with torch's MPS device (benchmarks/mps_check.py).

A new backend gets its tests by adding a :class:`Backend` to :func:`_backends`; the optional
fields say what the suite can check more tightly (the activations its contractions really use,
where its mat-vec path ends, which dtypes it computes in).

What is checked beyond the plain op-vs-reference comparison, per op: edge shapes (empty, width 1,
odd and long rows, tails of every tile), every cache dtype of the KV ops (f32/f16/bf16/q8_0),
both sides of the mat-vec/GEMM crossover, prefill and decode of attention, slots past a position
that must not leak in, extreme packed bytes, and that bad arguments raise the reference's errors.
:func:`test_tolerances_reject_real_bugs` shows that each tolerance is orders of magnitude below
what a real bug gives.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch

import hanzo_torch
from hanzo_torch import constants, get_format
from hanzo_torch.backends.triton._testing import random_packed
from hanzo_torch.ops import fused as ref_fused

ONLY = os.environ.get("HANZO_CONFORMANCE", "")  # set in the child process that runs the interpreter
KV_DTYPES = ("f32", "f16", "bf16", "q8_0")


@dataclass
class Backend:
    """One backend of the suite.

    ``run(op, *args)`` returns the op's result on this backend; ``formats`` are the ggml formats
    its quantized kernels handle. Optional:

    - ``dtypes``: the activation dtypes checked (float32 and bfloat16 unless more are given);
    - ``matvec_max_rows``: the activation rows up to which ``mul_mat`` runs a mat-vec path (the
      suite then checks M = 1, this, this + 1 and a ragged GEMM); None: M = 1 and 7;
    - ``x_hat(op, x, qtype)``: the activations (float64) the backend's contraction really uses
      (after its activation quantization); given, the quantized contractions are held to float32
      rounding of ``x_hat @ W^T``, else to the looser activation-quantization bound (:func:`_act_bound`);
    - ``host_index_errors``: out-of-range row/expert ids and positions raise their errors on the
      host (device backends assert on the device instead: no host sync);
    - ``rounds_to_nearest``: its float32 -> bf16/f16 conversions round to nearest even (then sums
      and casts are compared bit for bit; else to one ulp);
    - ``gemm_k_panel``: the K values per panel of its GEMM (the suite then takes K just past one
      panel, so a K tail is taken); None: K = 512;
    - ``edge_formats``: the formats of the edge-case sweeps (row and block tails, extreme bytes,
      every M and dtype of the contractions); None: all of ``formats`` (an interpreted backend
      names fewer to stay fast; its other formats get the decode and GEMM cases);
    - ``interpreted``: its kernels run in an interpreter (seconds per call): the sweeps take their
      smaller cases (fewer rows, one impl name per kernel, the small attention shapes), and the
      tail, extreme-byte and gate+up sweeps run on the first three ``edge_formats`` only.
    """

    name: str
    run: Callable
    formats: tuple
    dtypes: tuple = (torch.float32, torch.bfloat16)
    matvec_max_rows: Optional[int] = None
    x_hat: Optional[Callable] = None
    host_index_errors: bool = False
    rounds_to_nearest: bool = True
    gemm_k_panel: Optional[int] = None
    edge_formats: Optional[tuple] = None
    interpreted: bool = False

    def edge(self, qtype: str) -> bool:
        return self.edge_formats is None or qtype in self.edge_formats

    def sweep(self, qtype: str) -> bool:
        """Whether the long per-format sweeps (tails, extreme bytes, gate+up) run on ``qtype``."""
        return self.edge(qtype) and not (self.interpreted and qtype not in self.edge_formats[:3])


def _cpu_x_hat(op, x, qtype):
    """The C++ kernels quantize x to int8 once per op, in blocks of the weight's block size."""
    from hanzo_torch.backends import cpu

    fmt = get_format(qtype)
    if fmt.dense:  # torch GEMM on the float activations
        return x.double()
    bs = fmt.block_size
    x2 = x.float().reshape(-1, x.shape[-1]).contiguous()
    q, d, _, _ = cpu.extension().quantize_activation(x2, bs, 0)
    return (q.double().reshape(x2.shape[0], -1, bs) * d.double().unsqueeze(-1)).reshape(x.shape)


def _cpu_backend(isa: str) -> Backend:
    from hanzo_torch.backends import cpu

    def run(op, *args):
        with cpu.use_isa(isa), hanzo_torch.ops.use_reference(op, enabled=False):
            return getattr(torch.ops.hanzo, op)(*args)

    return Backend(f"cpu-{isa}", run, tuple(cpu.formats()), dtypes=(torch.float32, torch.bfloat16, torch.float16),
                   matvec_max_rows=cpu.MV_MAX_ROWS, x_hat=_cpu_x_hat, host_index_errors=True, gemm_k_panel=2048)


def _q8_1_values(x):
    """float64 values of the q8_1 blocks of x (d as stored, fp16, times the int8 codes)."""
    b = torch.ops.hanzo_ref.quantize_q8_1(x.float()).reshape(-1, 36)
    d = b[:, 0:2].contiguous().view(torch.float16).double()
    qs = b[:, 4:].contiguous().view(torch.int8).double()
    return (d * qs).reshape(x.shape)


def _triton_backend() -> Backend:
    import hanzo_torch.backends.triton as backend
    from hanzo_torch.backends.triton import ffn, quant

    fmts = frozenset(backend.supported_formats())
    table = {**backend.kernels(), "swiglu_mul_mat": ffn.swiglu_mul_mat}
    kernels = {op: backend.wrap(op, fn, fmts) for op, fn in table.items()}

    def run(op, *args):
        with hanzo_torch.ops.use_reference(op, enabled=False):
            return kernels[op](*args)

    def x_hat(op, x, qtype):
        # the int8 decode (DECODE_PATH) quantizes x to q8_1 blocks; every other path is float
        rows = math.prod(x.shape[:-1]) if op == "mul_mat" else x.shape[0]
        decode = rows == 1 if op == "mul_mat" else (op == "mul_mat_id" and rows <= quant.MATVEC_MAX_M)
        return _q8_1_values(x) if decode and quant._decode_int8(qtype) else x.double()

    edge = ("Q4_K", "Q8_0", "IQ2_XXS", "Q4_0", "Q5_0", "Q6_K", "IQ3_S", "MXFP4", "F16", "BF16", "F32")
    # the interpreter takes ~1 s per call: by default every family once (the edge formats plus the
    # families they miss); every format with HANZO_CONFORMANCE_ALL=1 (the slow-marked test)
    every = sorted(q for q in fmts if q != "NVFP4")
    chosen = every if os.environ.get("HANZO_CONFORMANCE_ALL") else [q for q in every if q in edge + TRITON_MORE]
    return Backend("triton-interp", run, tuple(chosen), matvec_max_rows=quant.MATVEC_MAX_M, x_hat=x_hat,
                   rounds_to_nearest=False, edge_formats=edge, interpreted=True)


TRITON_MORE = ("Q2_K", "IQ1_S", "IQ4_XS", "TQ2_0")


_IN_PLACE = {"kv_cache_write": (0, 1), "qk_norm_rope_kv_write": (5, 6)}
"""The arguments each in-place op writes (a device backend copies them back to the caller's tensors)."""


def _vulkan_run(int8: bool):
    """``run`` of the vulkan backends: arguments moved to the device, the op run with the int8 path
    of the contractions forced on or off, results brought back."""
    from hanzo_torch.backends.vulkan import quant as vulkan_quant

    def to_device(a):
        return a.to("vulkan") if isinstance(a, torch.Tensor) else a

    def to_host(r):
        if isinstance(r, (tuple, list)):
            return type(r)(to_host(v) for v in r)
        return r.cpu() if isinstance(r, torch.Tensor) else r

    def run(op, *args):
        dev = [to_device(a) for a in args]
        with hanzo_torch.ops.use_reference(op, enabled=False), vulkan_quant.use_int8(int8):
            out = getattr(torch.ops.hanzo, op)(*dev)
        for i in _IN_PLACE.get(op, ()):  # the caller's caches get the device's result
            args[i].copy_(dev[i].cpu())
        return to_host(out)

    return run


def _vulkan_backend() -> Backend:
    from hanzo_torch.backends import vulkan

    # float kernels (no activation quantization): contractions are held to float32 rounding of x @ W^T;
    # ids and positions are checked on the device (no host sync), as on CUDA
    return Backend("vulkan", _vulkan_run(False), tuple(vulkan.formats()),
                   dtypes=(torch.float32, torch.bfloat16, torch.float16), x_hat=lambda op, x, qtype: x.double(),
                   host_index_errors=False, matvec_max_rows=constants.VULKAN_MATVEC_MAX_ROWS)


def _vulkan_int8_backend() -> Optional[Backend]:
    """The vulkan backend with its int8 path forced on, for the contraction ops of the formats
    with int8 rules (None where the device lacks integer dot products)."""
    from hanzo_torch.backends import vulkan
    from hanzo_torch.backends.vulkan import quant as vulkan_quant

    with vulkan_quant.use_int8(True):
        int8 = frozenset(vulkan_quant.int8_formats())
    if not int8:
        return None

    def x_hat(op, x, qtype):
        # mul_mat and both projections of swiglu_mul_mat quantize x to q8_1 blocks; mul_mat_id is float
        return _q8_1_values(x) if op != "mul_mat_id" and qtype in int8 else x.double()

    # the formats of the common recipes get every edge case, the others the decode and GEMM cases
    edge = tuple(q for q in ("Q4_0", "Q8_0", "Q4_K", "Q6_K") if q in int8)
    return Backend("vulkan-int8", _vulkan_run(True), tuple(q for q in vulkan.formats() if q in int8),
                   x_hat=x_hat, host_index_errors=False, matvec_max_rows=constants.VULKAN_MATVEC_MAX_ROWS,
                   edge_formats=edge)


def _mps_sim_backend(int8: bool) -> Backend:
    """The Metal kernels of the mps backend on the CPU harness (hanzo_torch/backends/mps/sim):
    the launch code a Mac runs, with the harness's runner; float path, or the int8 path of the
    contractions for the formats with int8 kernels."""
    from hanzo_torch.backends.mps import launch as mps_launch
    from hanzo_torch.backends.mps.sim import SimRunner

    runner = SimRunner()

    def run(op, *args):
        with mps_launch.use_int8(int8):
            return mps_launch.OPS[op](runner, *args)

    fmts = mps_launch.formats()
    if int8:
        int8_fmts = mps_launch.int8_formats()
        return Backend("mps-sim-int8", run, tuple(q for q in fmts if q in int8_fmts),
                       x_hat=lambda op, x, qtype: _q8_1_values(x) if op != "mul_mat_id" else x.double(),
                       matvec_max_rows=mps_launch.MATVEC_MAX_ROWS, edge_formats=("Q4_0", "Q8_0", "Q4_K", "Q6_K"))
    # every format gets the decode, GEMM, mul_mat_id and dequantize cases; the sweeps (tails,
    # extreme bytes, every dtype) take the formats of each kernel family once
    edge = ("F32", "F16", "BF16", "Q4_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q6_K", "IQ2_XXS", "IQ2_S", "IQ3_S",
            "IQ1_M", "IQ4_XS", "TQ1_0", "MXFP4", "NVFP4")
    return Backend("mps-sim", run, fmts, dtypes=(torch.float32, torch.bfloat16, torch.float16),
                   x_hat=lambda op, x, qtype: x.double(), matvec_max_rows=mps_launch.MATVEC_MAX_ROWS,
                   edge_formats=tuple(q for q in edge if q in fmts))


def _mps_backend() -> Backend:
    """The ops on "mps" tensors (a Mac): arguments moved there, results brought back."""
    from hanzo_torch.backends import mps

    def run(op, *args):
        dev = [a.to("mps") if isinstance(a, torch.Tensor) else a for a in args]
        with hanzo_torch.ops.use_reference(op, enabled=False):
            out = getattr(torch.ops.hanzo, op)(*dev)
        for i in _IN_PLACE.get(op, ()):
            args[i].copy_(dev[i].cpu())
        if isinstance(out, (tuple, list)):
            return type(out)(v.cpu() for v in out)
        return out.cpu() if isinstance(out, torch.Tensor) else out

    return Backend("mps", run, tuple(mps.formats()), dtypes=(torch.float32, torch.bfloat16, torch.float16),
                   x_hat=lambda op, x, qtype: x.double(), matvec_max_rows=constants.VULKAN_MATVEC_MAX_ROWS)


def _backends() -> list:
    if ONLY == "triton-interp":
        return [_triton_backend()]
    from hanzo_torch.backends import cpu, mps, vulkan
    from hanzo_torch.backends.mps import sim as mps_sim

    out = [_cpu_backend(isa) for isa in cpu.isa_levels()] if cpu.extension() is not None else []
    if vulkan.available():
        out.append(_vulkan_backend())
    if mps_sim.reason() is None:
        out.append(_mps_sim_backend(False))
    if mps.available():
        out.append(_mps_backend())
    return out


def _contraction_backends() -> list:
    """The backends of the contraction tests: every backend, and the vulkan one again with its int8 path."""
    out = list(BACKENDS)
    if any(b.name == "vulkan" for b in BACKENDS):
        int8 = _vulkan_int8_backend()
        if int8 is not None:
            out.append(int8)
    if any(b.name == "mps-sim" for b in BACKENDS):
        out.append(_mps_sim_backend(True))
    return out


BACKENDS = _backends()
_IDS = [b.name for b in BACKENDS]
CONTRACTION_BACKENDS = _contraction_backends()


def _g(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(*shape, key, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=_g(*key)) * scale).to(dtype)


_MEMO: dict = {}


def _fingerprint(a):
    if isinstance(a, torch.Tensor):
        b = a.detach().contiguous().reshape(-1).view(torch.uint8) if a.numel() else a.reshape(-1)
        return ("T", tuple(a.shape), str(a.dtype), zlib.crc32(b.numpy().tobytes()) if a.numel() else 0)
    if isinstance(a, (list, tuple)):
        return tuple(_fingerprint(v) for v in a)
    return repr(a)


def _ref(op, *args):
    """``torch.ops.hanzo_ref.<op>(*args)``, computed once per distinct arguments (every backend,
    e.g. each CPU instruction set, is compared with the same result). Not for in-place ops."""
    key = (op, _fingerprint(args))
    if key not in _MEMO:
        _MEMO[key] = getattr(torch.ops.hanzo_ref, op)(*args)
    return _MEMO[key]


def _packed(qtype, shape, seed):
    """(packed random weights of ``qtype`` and ``shape``, their float32 values), made once."""
    key = ("packed", qtype, tuple(shape), seed)
    if key not in _MEMO:
        w = random_packed(qtype, tuple(shape), seed=seed)
        _MEMO[key] = (w, _ref("dequantize", w, qtype, list(shape), torch.float32))
    return _MEMO[key]


# ---------------------------------------------------------------------------------------------- tolerances
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
    """Float results of the fused ops: float32 statistics in both, one rounding to ``dtype``; the
    absolute part scales with the result's magnitude."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    rtol = _dtype_rtol(dtype)
    scale = max(1.0, want.float().abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rtol * scale, equal_nan=True)


def _exact(got, want, dtype=None):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())


def _contraction(backend, op, y, ref, x, w_f32, qtype, what, floor=0.0, xh=None):
    """``mul_mat``-like results: with the backend's ``x_hat``, float32 rounding of ``x_hat @ W^T``
    (``1e-5 (|x_hat| @ |W|^T)``, plus one rounding of a bf16/f16 output); else the
    activation-quantization bound around the reference. ``floor``: an absolute allowance for
    weights that are exactly zero while the kernel sums nonzero terms (an offset form ``d (q - 1)``).
    ``xh``: ``x_hat`` of these rows when ``x`` is a slice of a larger call (the backend's choice of
    path depends on the whole call)."""
    K = x.shape[-1]
    wf = w_f32.double().reshape(-1, K)
    if backend.x_hat is None:
        ref = ref() if callable(ref) else ref
        bound = _act_bound(x, w_f32).reshape(ref.shape) + floor
        if y.dtype != torch.float32:
            bound = bound + _dtype_rtol(y.dtype) * ref.double().abs()
        err = (y.double() - ref.double()).abs()
    else:
        xh = (backend.x_hat(op, x, qtype) if xh is None else xh).reshape(-1, K)
        want = (xh @ wf.t()).reshape(y.shape)
        bound = (1e-5 * (xh.abs() @ wf.abs().t())).reshape(y.shape) + 1e-30 + floor
        if y.dtype != torch.float32:
            bound = bound + _dtype_rtol(y.dtype) * want.abs()
        err = (y.double() - want).abs()
    assert (err <= bound).all(), f"{backend.name} {what}: error {err.max().item():.3e} over the bound " \
                                 f"(ratio {(err / bound).max().item():.2f})"


def _same_bytes(got, want, dtype=None):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, first at {bad[0].tolist()}"


_TOLERANCE_RULES = {"exact": _exact, "same_bytes": _same_bytes, "close": _close, "contraction": _contraction}

TOLERANCE = {name: _TOLERANCE_RULES[s.tolerance] for name, s in hanzo_torch.ops.SPECS.items()}
# qk_norm_rope_kv_write: "close" is for q; the caches: see test_qk_norm_rope_kv_write.
# swiglu_mul_mat: the contraction bounds of its two projections carried through silu(g) * u.
"""The tolerance of each op, for every backend (see the module docstring)."""


def _params(formats_of, backends=None):
    return [pytest.param(b, q, id=f"{b.name}-{q}") for b in (BACKENDS if backends is None else backends)
            for q in formats_of(b)]


def _dense_and(b):
    return list(b.formats) + (["F16"] if b.name.startswith("cpu") else [])


def _fused_params():
    return [pytest.param(b, d, id=f"{b.name}-{str(d).split('.')[-1]}") for b in BACKENDS for d in b.dtypes]


def _dequant(w, qtype, shape):
    return torch.ops.hanzo_ref.dequantize(w, qtype, list(shape), torch.float32)


def _rows_m(backend, qtype=None):
    """Activation rows for mul_mat: both sides of the mat-vec/GEMM crossover and a ragged GEMM
    (outside the edge formats: a decode row and the ragged GEMM)."""
    mv = backend.matvec_max_rows
    rows = (1, 7) if mv is None else (1, mv, mv + 1, 2 * mv + 1)
    return rows if qtype is None or backend.edge(qtype) else (rows[0], rows[-1])


def _long_k(backend, qtype):
    """Whole blocks just past one K panel of the backend's GEMM, so a K tail is taken."""
    bs = max(get_format(qtype).block_size, 64)
    if backend.gemm_k_panel is None:
        return 2 * max(bs, 128) if backend.interpreted else 512
    return -(-backend.gemm_k_panel // bs) * bs + bs


# ---------------------------------------------------------------------------------------------- quantized ops
def _random_bytes(qtype, rows, K, seed):
    """Uniformly random bytes: every code, scale, sign and grid index, inf/NaN/subnormal scales too."""
    fmt = get_format(qtype)
    return torch.randint(0, 256, (rows, fmt.row_bytes(K)), dtype=torch.uint8, generator=_g("bytes", qtype, seed))


@pytest.mark.parametrize("backend,qtype", _params(lambda b: b.formats))
def test_dequantize(backend, qtype):
    K = 2 * max(get_format(qtype).block_size, 32 if backend.interpreted else 256)
    for w in (random_packed(qtype, (5, K), seed=1), _random_bytes(qtype, 5, K, 1)):
        got = backend.run("dequantize", w, qtype, [5, K], torch.float32)
        TOLERANCE["dequantize"](got, _ref("dequantize", w, qtype, [5, K], torch.float32))
    K = max(get_format(qtype).block_size, 64)
    w = random_packed(qtype, (2, 3, K), seed=2)
    for dtype in backend.dtypes:
        got = backend.run("dequantize", w, qtype, [2, 3, K], dtype)
        want = _ref("dequantize", w, qtype, [2, 3, K], dtype)
        (_exact if backend.rounds_to_nearest else _close)(got, want, dtype)


@pytest.mark.parametrize("backend,qtype", _params(lambda b: b.formats))
def test_get_rows(backend, qtype):
    K = max(get_format(qtype).block_size, 256)
    w = random_packed(qtype, (10, K), seed=2)
    ids = torch.tensor([[1, 3, 9], [9, 0, 3]])
    for dtype in backend.dtypes:
        got = backend.run("get_rows", w, ids, qtype, dtype)
        want = _ref("get_rows", w, ids, qtype, dtype)
        assert got.dtype == dtype
        (TOLERANCE["get_rows"] if backend.rounds_to_nearest or dtype == torch.float32 else _close)(got, want, dtype)
    ids32 = torch.tensor([4, 4, 2], dtype=torch.int32)
    TOLERANCE["get_rows"](backend.run("get_rows", w, ids32, qtype, torch.float32),
                          torch.ops.hanzo_ref.get_rows(w, ids32, qtype, torch.float32))


@pytest.mark.parametrize("backend,qtype", _params(_dense_and, CONTRACTION_BACKENDS))
def test_mul_mat(backend, qtype):
    """Every M around the crossover, K past one 2048-value panel (a K tail), N = 7 (a ragged tile),
    and a [2, 3, K] input in every activation dtype."""
    N, K = 7, _long_k(backend, qtype)
    w, wf = _packed(qtype, (N, K), 3)
    x = _randn(max(_rows_m(backend)), K, key=("mm", qtype))
    for M in _rows_m(backend, qtype):
        y = backend.run("mul_mat", x[:M], w, qtype)
        assert y.shape == (M, N) and y.dtype == torch.float32
        TOLERANCE["mul_mat"](backend, "mul_mat", y, lambda: _ref("mul_mat", x[:M], w, qtype), x[:M], wf, qtype,
                             f"{qtype} M={M}")
    K = max(get_format(qtype).block_size, 256)
    w, wf = _packed(qtype, (12, K), 4)
    for dtype in backend.dtypes if backend.edge(qtype) else (torch.float32,):
        xb = _randn(2, 3, K, key=("mmb", qtype), dtype=dtype)
        yb = backend.run("mul_mat", xb, w, qtype)
        assert yb.dtype == dtype and yb.shape == (2, 3, 12)
        TOLERANCE["mul_mat"](backend, "mul_mat", yb, lambda: _ref("mul_mat", xb.float(), w, qtype), xb.float(),
                             wf, qtype, f"{qtype} {dtype}")


@pytest.mark.parametrize("backend,qtype", _params(lambda b: [q for q in b.formats if b.sweep(q)], CONTRACTION_BACKENDS))
def test_mul_mat_row_and_block_tails(backend, qtype):
    """Decode with 3 and 7 blocks per row (a one-block tail; a 4-block step and a tail) and N = 1,
    2, 5, 8 rows (one row, one pair, pairs and a tail), one and two activation rows."""
    bs = max(get_format(qtype).block_size, 32)
    for nblk in (3, 7):
        K = nblk * bs
        x = _randn(2, K, key=("tail", qtype, nblk))
        w8, wf8 = _packed(qtype, (8, K), nblk)
        for N in (1, 5) if backend.interpreted else (1, 2, 5, 8):
            w, wf = w8[:N], wf8[:N]
            for M in (1, 2):
                y = backend.run("mul_mat", x[:M], w, qtype)
                TOLERANCE["mul_mat"](backend, "mul_mat", y, lambda: _ref("mul_mat", x[:M], w, qtype), x[:M], wf,
                                     qtype, f"{qtype} blocks={nblk} N={N} M={M}")


def _filled(qtype, rows, K, byte):
    """Every byte = ``byte`` (extreme codes, signs, sub-block scales, high bits) except finite fp16
    scales (1e-2) and e8m0 exponents (2^-6); None for a format with other scale kinds."""
    fmt = get_format(qtype)
    b = torch.full((rows * K // fmt.block_size, fmt.type_size), byte, dtype=torch.uint8)
    for f in fmt.fields:
        if f.scale == "f16":
            b[:, f.offset:f.offset + 2] = torch.tensor([1e-2], dtype=torch.float16).view(torch.uint8)
        elif f.scale == "e8m0":
            b[:, f.offset] = 121
        elif f.scale is not None:
            return None
    return b.reshape(rows, -1)


@pytest.mark.parametrize("backend,qtype",
                         _params(lambda b: [q for q in b.formats if b.sweep(q) and _filled(q, 1, 256, 0) is not None],
                                 CONTRACTION_BACKENDS))
def test_mul_mat_extreme_values(backend, qtype):
    """Saturated int8 activations (|xq| = 127 everywhere) against all-0x00/0x80/0xFF/0x7F weight
    bytes (Q8_0 -128 and +127, largest nibbles and high bits, largest K-quant sub-block scales)."""
    bs = max(get_format(qtype).block_size, 32)
    K = 5 * bs
    signs = torch.where(torch.arange(K) % 3 == 0, -1.0, 1.0)
    x = torch.stack([torch.ones(K), -torch.ones(K), signs])
    for byte in (0x00, 0x80, 0xFF, 0x7F):
        w = _filled(qtype, 3, K, byte)
        wf = _dequant(w, qtype, (3, K))
        for m in (2,) if backend.interpreted else range(3):
            y = backend.run("mul_mat", x[m:m + 1], w, qtype)
            # float32 rounding of K terms of size d |x| = 1e-2 where the weights cancel to zero
            floor = 1e-6 * 1e-2 * K if not wf.any() else 0.0
            TOLERANCE["mul_mat"](backend, "mul_mat", y, lambda: _ref("mul_mat", x[m:m + 1], w, qtype),
                                 x[m:m + 1], wf, qtype, f"{qtype} byte={byte:#x} x{m}", floor=floor)


@pytest.mark.parametrize("backend,qtype", _params(lambda b: b.formats))
def test_mul_mat_id(backend, qtype):
    """Decode-sized (T = 4) and GEMM-sized (T = 12: more rows per expert than a mat-vec takes)
    routing, x shared by the k slots or one per slot, an expert chosen twice by one token."""
    E, N, K, k = 4, 6, max(get_format(qtype).block_size, 256), 2
    w, wf = _packed(qtype, (E, N, K), 4)
    for T in (4, 12) if backend.edge(qtype) else (4,):
        ids = torch.randint(0, E, (T, k), generator=_g("ids", T))
        ids[0] = torch.tensor([3, 3])
        xs_ = (_randn(T, K, key=("mmid", qtype, T)), _randn(T, k, K, key=("mmid3", qtype, T)))
        for x in xs_ if backend.edge(qtype) else xs_[:1]:
            got = backend.run("mul_mat_id", x, w, ids, qtype)
            assert got.shape == (T, k, N) and got.dtype == torch.float32
            ref = _ref("mul_mat_id", x, w, ids, qtype)
            xs = x.unsqueeze(1).expand(T, k, K) if x.dim() == 2 else x
            xh = None
            if backend.x_hat is not None:
                xh = backend.x_hat("mul_mat_id", x, qtype)
                xh = xh.unsqueeze(1).expand(T, k, K) if x.dim() == 2 else xh
            for t in range(T):
                for j in range(k):
                    TOLERANCE["mul_mat_id"](backend, "mul_mat_id", got[t, j:j + 1], ref[t, j:j + 1],
                                            xs[t, j:j + 1], wf[ids[t, j]], qtype,
                                            f"{qtype} T={T} x{x.dim()}D t={t} j={j}",
                                            xh=None if xh is None else xh[t, j:j + 1])
    if backend.host_index_errors:
        with pytest.raises(IndexError, match="out of range"):
            backend.run("mul_mat_id", x, w, torch.tensor([[0, E]] * x.shape[0]), qtype)


def _swiglu_mm_params():
    out = []
    for b in CONTRACTION_BACKENDS:
        for q in [q for q in b.formats if b.sweep(q)]:
            up = "Q6_K" if "Q6_K" in b.formats else q
            out.append(pytest.param(b, q, up, id=f"{b.name}-{q}+{up}"))
        for qg, qu in (("Q4_K", "Q4_K"), ("Q8_0", "Q5_0"), ("IQ2_XXS", "Q2_K"), ("F16", "Q4_0"), ("BF16", "F32")):
            if qg in b.formats and qu in b.formats:
                out.append(pytest.param(b, qg, qu, id=f"{b.name}-{qg}+{qu}"))
    return out


@pytest.mark.parametrize("backend,qtype,up", _swiglu_mm_params())
def test_swiglu_mul_mat(backend, qtype, up):
    """M on both sides of the crossover, F not a multiple of any tile, every activation dtype."""
    K, F = 256, 20
    (wg, Wg), (wu, Wu) = _packed(qtype, (F, K), 5), _packed(up, (F, K), 6)
    Wg, Wu = Wg.double(), Wu.double()
    Ms = _rows_m(backend, qtype)
    for dtype in backend.dtypes if backend.edge(qtype) else (torch.float32,):
        # float16: small activations, so that silu(g) * u stays inside its range
        x = _randn(max(Ms), K, key=("swmm", qtype, up), dtype=dtype, scale=0.05 if dtype == torch.float16 else 1.0)
        for M in (Ms if dtype == torch.float32 and not backend.interpreted else (1, max(Ms))):
            xm = x[:M].reshape(1, M, K) if M > 1 else x[:M]
            got = backend.run("swiglu_mul_mat", xm, wg, wu, qtype, up).reshape(M, F)
            assert got.dtype == dtype
            if backend.x_hat is not None:
                xg = backend.x_hat("swiglu_mul_mat", x[:M].float(), qtype)
                xu = backend.x_hat("swiglu_mul_mat", x[:M].float(), up)
                g, u = xg @ Wg.t(), xu @ Wu.t()
                bg, bu = 1e-5 * (xg.abs() @ Wg.abs().t()), 1e-5 * (xu.abs() @ Wu.abs().t())
            else:
                xd = x[:M].double()
                g, u = xd @ Wg.t(), xd @ Wu.t()
                bg, bu = _act_bound(x[:M].float(), Wg), _act_bound(x[:M].float(), Wu)
            if dtype != torch.float32:  # projections rounded to the activation dtype, as the unfused ops
                bg, bu = bg + _dtype_rtol(dtype) * g.abs(), bu + _dtype_rtol(dtype) * u.abs()
            want = torch.nn.functional.silu(g) * u
            # first-order propagation through silu(g) * u (|silu'| <= 1.1), a few float32 roundings
            bound = 1.1 * bg * (u.abs() + bu) + torch.nn.functional.silu(g).abs() * bu + 1e-6
            bound = bound + (8 * 2.0 ** -24 + (_dtype_rtol(dtype) if dtype != torch.float32 else 0)) * want.abs()
            err = (got.double() - want).abs()
            assert (err <= bound).all(), f"{qtype}+{up} M={M} {dtype}: error {err.max().item():.3e} over the bound"


# ---------------------------------------------------------------------------------------------- fused ops
@pytest.mark.parametrize("backend,dtype", _fused_params())
def test_rms_norm_and_add_rms_norm(backend, dtype):
    """Odd, width-1, empty, model-sized and longer-than-one-block rows; a non-contiguous input."""
    for shape in [(1, 1536), (3, 5, 67), (2, 1), (0, 8), (2, 5000)]:
        x = _randn(*shape, key=("rms", shape), dtype=dtype, scale=3)
        w = _randn(shape[-1], key=("rmsw", shape), dtype=dtype)
        TOLERANCE["rms_norm"](backend.run("rms_norm", x, w, 1e-6), _ref("rms_norm", x, w, 1e-6), dtype)
    x = _randn(30, 256, key="rmsnc", dtype=dtype)[:, ::2]
    w = _randn(128, key="rmsncw", dtype=dtype)
    TOLERANCE["rms_norm"](backend.run("rms_norm", x, w, 1e-5), _ref("rms_norm", x, w, 1e-5), dtype)
    for shape in [(2, 3, 129), (4, 40)]:
        x, r = _randn(*shape, key=("arx", shape), dtype=dtype), _randn(*shape, key=("arr", shape), dtype=dtype)
        w = _randn(shape[-1], key=("arw", shape), dtype=dtype)
        (y, s), (y0, s0) = backend.run("add_rms_norm", x, r, w, 1e-6), _ref("add_rms_norm", x, r, w, 1e-6)
        # the sum is one rounding of x + residual
        (_exact if backend.rounds_to_nearest or dtype == torch.float32 else _close)(s, s0, dtype)
        TOLERANCE["add_rms_norm"](y, y0, dtype)


@pytest.mark.parametrize("backend,dtype", _fused_params())
def test_swiglu(backend, dtype):
    for shape in [(1, 8960), (3, 7, 33), (200, 1001), (3, 70)]:
        a = _randn(*shape, key=("swa", shape), dtype=dtype, scale=4)
        b = _randn(*shape, key=("swb", shape), dtype=dtype)
        TOLERANCE["swiglu"](backend.run("swiglu", a, b), _ref("swiglu", a, b), dtype)


@pytest.mark.parametrize("backend,dtype", _fused_params())
def test_qk_norm_rope(backend, dtype):
    """Head dims 128, 10 (odd half) and 64, GQA 6/1/4, one token to 70, positions up to 5000, with
    and without the q/k norms."""
    shapes = [(1, 1, 12, 2, 128), (2, 5, 6, 3, 10), (1, 70, 4, 1, 64), (2, 3, 4, 2, 16)]
    for B, T, Hq, Hk, D in shapes[:2] + shapes[3:] if backend.interpreted else shapes:
        q = _randn(B, T, Hq, D, key=("q", D, T), dtype=dtype)
        k = _randn(B, T, Hk, D, key=("k", D, T), dtype=dtype)
        pos = torch.randint(0, 5000, (B, T), generator=_g("pos", D), dtype=torch.int32)
        pos[0, 0] = 0
        for norm in (True, False):
            qw = _randn(D, key=("qw", D), dtype=dtype) if norm else None
            kw = _randn(D, key=("kw", D), dtype=dtype) if norm else None
            for a, b in zip(backend.run("qk_norm_rope", q, k, qw, kw, pos, 1e6, 1e-6),
                            _ref("qk_norm_rope", q, k, qw, kw, pos, 1e6, 1e-6)):
                TOLERANCE["qk_norm_rope"](a, b, dtype)


@pytest.mark.parametrize("backend", BACKENDS, ids=_IDS)
def test_moe_route(backend):
    """k = 1..4, normalized or not; all-tied rows (ids 0..k-1), a tie at the top (lower id first)."""
    for dtype in backend.dtypes:
        logits = _randn(9 if backend.interpreted else 37, 60, key="route", dtype=dtype, scale=3)
        logits[0, :] = 0.5
        logits[1, 10] = logits[1, 3] = 100.0
        for k, normalize in ((1, False), (2, True), (3, False), (4, False), (4, True)):
            w, ids = backend.run("moe_route", logits, k, normalize)
            rw, rids = _ref("moe_route", logits, k, normalize)
            assert ids.dtype == torch.int64 and w.dtype == torch.float32
            assert torch.equal(ids, rids), (dtype, k, normalize)
            assert ids[0].tolist() == list(range(k)) and ids[1, :min(k, 2)].tolist() == [3, 10][:k]
            TOLERANCE["moe_route"](w, rw, torch.float32)


KNOWN_BUGS = {
}
"""Known disagreements with the reference, as strict xfails: each fails the suite once fixed."""


def _known(test, backends):
    out = []
    for b in backends:
        reason = KNOWN_BUGS.get((test, b.name))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(b, id=b.name, marks=marks))
    return out


@pytest.mark.parametrize("backend", _known("test_moe_route_nan_row", BACKENDS))
def test_moe_route_nan_row(backend):
    """A row of NaN logits (one NaN is enough): every weight NaN, ids in index order 0..k-1."""
    logits = _randn(4, 60, key="route-nan", scale=3)
    logits[2, 7] = float("nan")
    for k, normalize in ((1, False), (4, True)):
        w, ids = backend.run("moe_route", logits, k, normalize)
        rw, rids = _ref("moe_route", logits, k, normalize)
        assert torch.equal(ids, rids) and ids[2].tolist() == list(range(k)) and torch.isnan(w[2]).all()
        TOLERANCE["moe_route"](w, rw, torch.float32)


def _q8_1_edge_rows() -> torch.Tensor:
    """float32 [rows, 256]: blocks of 32 that probe every step of q8_1 quantization."""
    g = _g("q8_1-edge")
    def f(mags):  # float32 from sign-magnitude bit patterns (a negative int: the sign bit set)
        bits = [m if m >= 0 else (0x80000000 | -m) - (1 << 32) for m in mags]
        return torch.tensor(bits, dtype=torch.int32).view(torch.float32)

    blocks = []
    # random scales over the whole float range: d = amax / 127 and 1 / d must be correctly rounded
    amax = torch.exp2(torch.empty(64).uniform_(-99, 126, generator=g)) * (1 + torch.rand(64, generator=g))
    blocks.append(torch.rand(64, 32, generator=g) * 2 - 1)
    blocks[-1][:, 0] = 1.0
    blocks[-1] *= amax[:, None]
    # amax = 127 (d = 1): exact ties k + 0.5 (away from zero) and their float neighbours
    ties = torch.arange(-15.5, 16.5, 1.0)
    blocks.append(torch.cat([torch.tensor([127.0]), ties[:31]]).reshape(1, 32))
    up, down = torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)
    blocks.append(torch.cat([torch.tensor([-127.0]), up[:31]]).reshape(1, 32))
    blocks.append(torch.cat([torch.tensor([127.0]), down[:31]]).reshape(1, 32))
    # zeros and negative zeros (d = 0), one nonzero among zeros
    blocks += [torch.zeros(1, 32), -torch.zeros(1, 32), torch.zeros(1, 32).index_fill_(1, torch.tensor([7]), -3.0)]
    # tiny blocks: subnormal amax (d subnormal, 1/d overflowing or not), amax just under and at 2^-100,
    # a normal amax with subnormal values that still round to nonzero codes
    for e in (-149, -140, -130, -127, -126, -125, -120, -110, -100.5, -100, -99.5):
        b = (torch.rand(1, 32, generator=g) * 2 - 1) * 2.0 ** e
        b[0, 3] = -(2.0 ** e)
        blocks.append(b)
    blocks.append(f([1, 2, 3, -0x7FFFFF, 0x7FFFFF] + [0x400000 - i for i in range(27)]).reshape(1, 32))
    blocks.append(torch.cat([torch.tensor([2.0 ** -119]), f([0x300000 * (i % 3) - 0x200000 for i in range(31)])])
                  .reshape(1, 32))
    # the largest floats; inf, -inf, NaN (with and without an inf), a NaN with a payload
    big = torch.full((1, 32), 3.4028234e38)
    big[0, 1::2] = -1.7e38
    blocks.append(big)
    for special in (float("inf"), -float("inf"), float("nan")):
        b = torch.randn(1, 32, generator=g)
        b[0, 5] = special
        blocks.append(b)
    b = torch.randn(1, 32, generator=g)
    b[0, 2], b[0, 9] = float("inf"), float("nan")
    blocks.append(b)
    blocks.append(torch.cat([f([0x7F812345, -0x7FC0BCDF]), torch.randn(30, generator=g)]).reshape(1, 32))
    x = torch.cat(blocks)
    pad = -x.shape[0] % 8
    x = torch.cat([x, torch.randn(pad, 32, generator=g)])
    return x.reshape(-1, 256)


@pytest.mark.parametrize("backend", _known("test_quantize_q8_1", BACKENDS))
def test_quantize_q8_1(backend):
    """Bit for bit the reference's bytes: random blocks over the whole float range, exact .5 ties
    and their neighbours, zero blocks, subnormal and tiny blocks, the largest floats, inf and NaN;
    float16/bfloat16 inputs (their subnormals too); leading dims kept."""
    x = _q8_1_edge_rows()
    got = backend.run("quantize_q8_1", x)
    TOLERANCE["quantize_q8_1"](got, torch.ops.hanzo_ref.quantize_q8_1(x))
    for dtype in backend.dtypes:
        if dtype == torch.float32:
            continue
        xd = x.to(dtype)
        tiny = torch.tensor([2.0 ** -20, -(2.0 ** -24), 2.0 ** -130 if dtype == torch.bfloat16 else 2.0 ** -23])
        xd[-1, :3] = tiny.to(dtype)
        xd[-1, 3:32] = 0
        got = backend.run("quantize_q8_1", xd)
        TOLERANCE["quantize_q8_1"](got, torch.ops.hanzo_ref.quantize_q8_1(xd))
    x3 = _randn(2, 3, 64, key="q8_1-3d")
    TOLERANCE["quantize_q8_1"](backend.run("quantize_q8_1", x3), torch.ops.hanzo_ref.quantize_q8_1(x3))


def _kv_cache(x, kv):
    return ref_fused.kv_to_cache(x, ref_fused.KV_CACHE_DTYPES[kv]).contiguous()


def _kv_params():
    return [pytest.param(b, kv, id=f"{b.name}-{kv}") for b in BACKENDS for kv in KV_DTYPES]


@pytest.mark.parametrize("backend,kv", _kv_params())
def test_kv_cache_write(backend, kv):
    """Rows in every activation dtype into caches of every cache dtype, positions out of order and
    at the cache end: bit-identical to the reference (q8_0 rows are ggml's quantize_row_q8_0_ref);
    untouched slots stay."""
    B, S, Hk, D, T = 2, 17, 3, 64, 4
    pos = torch.tensor([[0, 1, 2, 16], [9, 5, 7, 3]])
    for act in backend.dtypes:
        k = _randn(B, T, Hk, D, key=("kvk", kv), dtype=act, scale=3)
        v = _randn(B, T, Hk, D, key=("kvv", kv), dtype=act, scale=3)
        caches = [_kv_cache(_randn(B, S, Hk, D, key=("kvc", i)), kv) for i in range(2)]
        mine = [c.clone() for c in caches]
        backend.run("kv_cache_write", mine[0], mine[1], k, v, pos)
        torch.ops.hanzo_ref.kv_cache_write(caches[0], caches[1], k, v, pos)
        TOLERANCE["kv_cache_write"](mine[0], caches[0])
        TOLERANCE["kv_cache_write"](mine[1], caches[1])
        assert not torch.equal(mine[0][1, 5], _kv_cache(_randn(B, S, Hk, D, key=("kvc", 0)), kv)[1, 5])
        assert torch.equal(mine[0][0, 3], _kv_cache(_randn(B, S, Hk, D, key=("kvc", 0)), kv)[0, 3])


def _qk_kv_inputs(case, dtype, kv):
    """q, k, v, norm weights (None for the Qwen2 cases), caches (random slots) and positions."""
    B, T, Hq, Hk, D, S, norm, pos = (case[n] for n in ("B", "T", "Hq", "Hk", "D", "S", "norm", "positions"))
    key = ("qkkv", T, D)
    q = _randn(B, T, Hq, D, key=key + ("q",), dtype=dtype, scale=2)
    k = _randn(B, T, Hk, D, key=key + ("k",), dtype=dtype, scale=2)
    v = _randn(B, T, Hk, D, key=key + ("v",), dtype=dtype, scale=2)
    qw = _randn(D, key=key + ("qw",), dtype=dtype) if norm else None
    kw = _randn(D, key=key + ("kw",), dtype=dtype) if norm else None
    caches = [_kv_cache(_randn(B, S, Hk, D, key=key + ("c", i)), kv) for i in range(2)]
    return q, k, v, qw, kw, caches, torch.tensor(pos)


_QK_KV = [
    # Qwen3 decode: q/k norms, D 128, GQA 4/2, two sequences at far apart positions
    dict(B=2, T=1, Hq=4, Hk=2, D=128, S=40, norm=True, positions=[[5], [37]]),
    # Qwen2 (no norm) decode, D 64, the cache's last slot
    dict(B=1, T=1, Hq=6, Hk=2, D=64, S=24, norm=False, positions=[[23]]),
    # prompts with gaps and out of order, with and without the norms
    dict(B=2, T=4, Hq=4, Hk=2, D=64, S=20, norm=True, positions=[[0, 1, 4, 9], [12, 3, 7, 8]]),
    dict(B=1, T=5, Hq=2, Hk=1, D=32, S=16, norm=False, positions=[[2, 3, 5, 11, 15]]),
    # a head dim past the Vulkan shader's row buffer (1024 values)
    dict(B=1, T=1, Hq=2, Hk=1, D=1056, S=4, norm=True, positions=[[2]]),
]


@pytest.mark.parametrize("backend,kv", _kv_params())
def test_qk_norm_rope_kv_write(backend, kv):
    """q/k norm + RoPE + KV-cache write in one op, for Qwen2 (no norm) and Qwen3, every activation
    dtype, decode and prompts with gaps: q and the caches against the references (k rows within
    the rounding of the rotated k and the cache's type, v rows bit for bit, slots not written
    untouched), and bit for bit what the backend's own qk_norm_rope then kv_cache_write give."""
    # an interpreted backend (seconds per launch): the prompt case with gaps and one activation
    # dtype per cache dtype (its kernels do not depend on the cache's; other caches are the
    # reference's write)
    cases = _QK_KV[2:3] if backend.interpreted else _QK_KV
    acts = (torch.bfloat16 if kv in ("bf16", "f16") else torch.float32,) if backend.interpreted else backend.dtypes
    for case in cases:
        for act in acts:
            q, k, v, qw, kw, caches, pos = _qk_kv_inputs(case, act, kv)
            args = (1e6, 1e-6)
            mine, ref, two = ([c.clone() for c in caches] for _ in range(3))
            q_mine = backend.run("qk_norm_rope_kv_write", q, k, v, qw, kw, mine[0], mine[1], pos, *args)
            q_ref = torch.ops.hanzo_ref.qk_norm_rope_kv_write(q, k, v, qw, kw, ref[0], ref[1], pos, *args)
            TOLERANCE["qk_norm_rope_kv_write"](q_mine, q_ref, act)
            D = case["D"]
            got_k, want_k = ref_fused.kv_from_cache(mine[0], D), ref_fused.kv_from_cache(ref[0], D)
            # the rotated k is rounded to act, then to the cache's type: one rounding of the
            # coarser of the two apart (q8_0: one code of a block, at most amax / 127)
            coarse = max(_dtype_rtol(act), _dtype_rtol(ref_fused.KV_CACHE_DTYPES[kv])
                         if kv != "q8_0" else 0.0)
            scale = want_k.abs().max().item()
            atol = coarse * scale + (scale / 127 if kv == "q8_0" else 0.0)
            torch.testing.assert_close(got_k, want_k, rtol=coarse, atol=atol, msg=lambda m: f"{kv} {act} k: {m}")
            _exact(mine[1], ref[1])
            written = torch.zeros(caches[0].shape[:2], dtype=torch.bool)
            written[torch.arange(case["B"])[:, None], pos] = True
            for c, orig in zip(mine, caches):
                assert torch.equal(c[~written], orig[~written])
                assert not torch.equal(c[written], orig[written])
            # the same bits as the two ops on this backend
            q_two, k_two = backend.run("qk_norm_rope", q, k, qw, kw, pos, *args)
            backend.run("kv_cache_write", two[0], two[1], k_two, v, pos)
            _exact(q_mine, q_two)
            _exact(mine[0], two[0])
            _exact(mine[1], two[1])


_ATTENTION = [
    # decode: one token, GQA 12/2, two sequences at different lengths, the last slot of the cache
    dict(B=2, T=1, Hq=12, Hk=2, D=128, S=300, positions=[[37], [299]]),
    # prefill from position 0, odd head dim, GQA 6/3
    dict(B=1, T=9, Hq=6, Hk=3, D=10, S=16, positions=[list(range(9))]),
    # chunked prefill continuing at position 20, MHA
    dict(B=2, T=5, Hq=2, Hk=2, D=16, S=40, positions=[[20, 21, 22, 23, 24], [0, 1, 2, 3, 4]]),
    # a few tokens, GQA 3, D not a power of two, one query that sees one key
    dict(B=2, T=4, Hq=6, Hk=2, D=24, S=70, positions=[[0, 33, 34, 69], [5, 6, 7, 8]]),
    # long prompt from position 0, GQA 12/2 (several prefill tiles, the last ragged)
    dict(B=1, T=100, Hq=12, Hk=2, D=64, S=128, positions=[list(range(100))]),
    # chunked prefill: batch 0 continues at 50, batch 1 starts at 0 with its tokens out of order
    dict(B=2, T=40, Hq=4, Hk=1, D=32, S=96,
         positions=[list(range(50, 90)), torch.randperm(40, generator=torch.Generator().manual_seed(3)).tolist()]),
]


def _impls(backend):
    """The attention ``impl`` names to run (an interpreted backend: one kernel serves them all)."""
    return ("auto",) if backend.interpreted else ("auto", "eager", "flash")


def _attention_inputs(c, dtype, kv=None, seed=0):
    q = _randn(c["B"], c["T"], c["Hq"], c["D"], key=("aq", seed, c["T"]), dtype=dtype)
    kc = _randn(c["B"], c["S"], c["Hk"], c["D"], key=("ak", seed, c["T"]), dtype=dtype)
    vc = _randn(c["B"], c["S"], c["Hk"], c["D"], key=("av", seed, c["T"]), dtype=dtype)
    if kv is not None:
        kc, vc = _kv_cache(kc.float(), kv), _kv_cache(vc.float(), kv)
    return q, kc, vc, torch.as_tensor(c["positions"])


@pytest.mark.parametrize("backend,dtype", _fused_params())
def test_attention(backend, dtype):
    """Decode, prefill and chunked prefill (every case above, eager/flash/auto)."""
    for c in _ATTENTION[:4] if backend.interpreted else _ATTENTION:
        q, kc, vc, pos = _attention_inputs(c, dtype)
        scale = 1 / math.sqrt(c["D"])
        for impl in _impls(backend):
            TOLERANCE["attention"](backend.run("attention", q, kc, vc, pos, scale, impl),
                                   _ref("attention", q, kc, vc, pos, scale, impl), dtype)


@pytest.mark.parametrize("backend,kv", _kv_params())
def test_attention_cache_dtypes(backend, kv):
    """Caches of every cache dtype whatever the query dtype (decode with several key chunks to
    merge, prefill tiles): both sides read the same cache bytes as float32."""
    cases = [dict(B=2, T=1, Hq=12, Hk=2, D=128, S=700, positions=[[698], [40]]),
             dict(B=1, T=1, Hq=4, Hk=2, D=64, S=300, positions=[[299]]),
             dict(B=1, T=3, Hq=2, Hk=2, D=32, S=64, positions=[[60, 61, 63]]),
             dict(B=1, T=12, Hq=6, Hk=1, D=64, S=32, positions=[list(range(20, 32))])]
    for c in cases:
        for dtype in (torch.float32, torch.bfloat16):
            q, kc, vc, pos = _attention_inputs(c, dtype, kv=kv, seed=1)
            for impl in _impls(backend)[:2]:
                TOLERANCE["attention"](backend.run("attention", q, kc, vc, pos, 0.1, impl),
                                       _ref("attention", q, kc, vc, pos, 0.1, impl), dtype)


@pytest.mark.parametrize("backend", BACKENDS, ids=_IDS)
def test_attention_prefill_equals_decode_and_ignores_later_slots(backend):
    """A prompt at once and token by token agree; garbage (NaN, 1e30) in slots past each query's
    position changes nothing, in decode and in prefill."""
    c = dict(B=1, T=24, Hq=6, Hk=2, D=16, S=40, positions=[list(range(10, 34))])
    q, kc, vc, pos = _attention_inputs(c, torch.float32, seed=2)
    full = backend.run("attention", q, kc, vc, pos, 0.25, "auto")
    rows = torch.cat([backend.run("attention", q[:, t:t + 1], kc, vc, pos[:, t:t + 1], 0.25, "auto")
                      for t in range(24)], dim=1)
    _close(full, rows, torch.float32)
    for T, last in ((1, 5), (16, 15)):
        q, kc, vc, _ = _attention_inputs(dict(c, T=T, Hq=4, D=8, S=32), torch.float32, seed=3)
        pos = torch.arange(last - T + 1, last + 1)[None]
        for impl in _impls(backend):
            out = backend.run("attention", q, kc, vc, pos, 0.3, impl)
            kb, vb = kc.clone(), vc.clone()
            kb[:, last + 1:], vb[:, last + 1:] = float("nan"), 1e30
            assert torch.equal(backend.run("attention", q, kb, vb, pos, 0.3, impl), out), (T, impl)


# ---------------------------------------------------------------------------------------------- tolerances
def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_tolerances_reject_real_bugs():
    """Each tolerance above is far below what a real bug gives (>= 100x)."""
    ref = torch.ops.hanzo_ref
    f32 = _dtype_rtol(torch.float32)
    x, w = _randn(4, 256, key="bx"), _randn(256, key="bw")
    good = ref.rms_norm(x, w, 1e-6)
    assert _rel(x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6) * w, good) > 100 * f32  # sum, not mean
    assert _rel(ref.rms_norm(x, torch.ones(256), 1e-6), good) > 100 * f32  # weight dropped
    q, k = _randn(1, 4, 2, 64, key="bq"), _randn(1, 4, 2, 64, key="bk")
    pos = torch.tensor([[3, 10, 11, 12]])
    good = ref.qk_norm_rope(q, k, None, None, pos, 10000.0, 1e-6)[0]
    assert _rel(ref.qk_norm_rope(q, k, None, None, pos + 1, 10000.0, 1e-6)[0], good) > 100 * f32  # off by one
    c = dict(B=1, T=3, Hq=4, Hk=2, D=32, S=20, positions=[[4, 5, 6]])
    q, kc, vc, pos = _attention_inputs(c, torch.float32, seed=4)
    good = ref.attention(q, kc, vc, pos, 0.5, "eager")
    assert _rel(ref.attention(q, kc, vc, pos + 1, 0.5, "eager"), good) > 100 * f32  # one key too many
    assert _rel(ref.attention(q, kc.flip(2), vc.flip(2), pos, 0.5, "eager"), good) > 100 * f32  # wrong KV head
    c = dict(B=1, T=16, Hq=4, Hk=2, D=8, S=32, positions=[list(range(16))])
    q, kc, vc, pos = _attention_inputs(c, torch.float32, seed=5)
    assert _rel(ref.attention(q, kc, vc, pos + 1, 0.3, "eager"), ref.attention(q, kc, vc, pos, 0.3, "eager")) > 100 * f32
    # one flipped 4-bit weight of one Q4_K block, against the x_hat bound of the contractions
    K = 512
    wq = random_packed("Q4_K", (4, K), seed=4)
    wf = _dequant(wq, "Q4_K", (4, K)).double()
    xv = _randn(1, K, key="bnib")
    xv[0, 5] = 2.0  # the corrupted weight's activation is not ~0
    bad = wq.clone()
    bad[0, 16 + 5] ^= 0x0F  # the low nibble of qs[5]: weight 5 of row 0
    y = ref.mul_mat(xv, bad, "Q4_K").double()
    assert (y[0, 0] - (xv.double() @ wf.t())[0, 0]).abs() >= 100 * 1e-5 * (xv.double().abs() @ wf.abs().t())[0, 0]


# ---------------------------------------------------------------------------------------------- bad arguments
def _bad_calls():
    """(op, args, exception, message pattern, value check) of calls every backend must reject; a
    value check depends on the values of ids or positions (host backends only: see
    :attr:`Backend.host_index_errors`)."""
    q8 = random_packed("Q8_0", (8, 64), seed=8)
    q4k = random_packed("Q4_K", (4, 256), seed=7)
    q6k = random_packed("Q6_K", (24, 256), seed=9)
    w3 = random_packed("Q8_0", (4, 8, 64), seed=10)
    x2, x64 = torch.randn(2, 8), torch.randn(3, 64)
    q = torch.randn(1, 1, 2, 8)
    kc = torch.randn(1, 4, 2, 8)
    i64 = dict(dtype=torch.int64)
    return [
        ("dequantize", (q8, "Q8_0", [3, 64], torch.float32), ValueError, "bytes", False),
        ("dequantize", (q8, "Q8_0", [8, 48], torch.float32), ValueError, "multiple of the (Q8_0 )?block size", False),
        ("dequantize", (q8.to(torch.int8), "Q8_0", [8, 64], torch.float32), ValueError, "uint8", False),
        ("dequantize", (q8, "Q9_9", [8, 64], torch.float32), ValueError, "unknown", False),
        ("mul_mat", (torch.randn(1, 512), q4k, "Q4_K"), ValueError, "bytes per Q4_K row", False),
        ("mul_mat", (torch.randn(2, 32), q8, "Q8_0"), ValueError, "rows of 68 bytes", False),
        ("mul_mat", (torch.randn(2, 48), q8, "Q8_0"), ValueError, "not a multiple of the Q8_0 block size", False),
        ("mul_mat", (torch.randn(2, 64, dtype=torch.complex64), q8, "Q8_0"), ValueError,
         "float32, bfloat16 or float16", False),
        ("mul_mat", (torch.ones(1, 64, dtype=torch.int32), q8, "Q8_0"), ValueError, "float32, bfloat16 or float16", False),
        ("mul_mat", (torch.randn(2, 64), q8.to(torch.int16), "Q8_0"), ValueError, "uint8", False),
        ("mul_mat", (torch.randn(2, 64), q8[None], "Q8_0"), ValueError, "2-D", False),
        ("mul_mat", (torch.randn(2, 64), q8, "Q8_9"), ValueError, "unknown", False),
        ("mul_mat_id", (x64, w3, torch.zeros(2, 2, **i64), "Q8_0"), ValueError, "T=3 but ids has T=2", False),
        ("mul_mat_id", (torch.randn(3, 3, 64), w3, torch.zeros(3, 2, **i64), "Q8_0"), ValueError, "does not match ids",
         False),
        ("mul_mat_id", (x64, w3, torch.zeros(3, 2), "Q8_0"), ValueError, "integer", False),
        ("mul_mat_id", (x64, w3[0], torch.zeros(3, 2, **i64), "Q8_0"), ValueError, "3-D", False),
        ("mul_mat_id", (torch.randn(3, 32), w3, torch.zeros(3, 2, **i64), "Q8_0"), ValueError, "rows of 68 bytes", False),
        ("mul_mat_id", (x64, w3, torch.tensor([[0, 4]] * 3), "Q8_0"), IndexError, "expert id 4 (is )?out of range", True),
        ("get_rows", (q8, torch.tensor([1, 8]), "Q8_0", torch.float32), IndexError, "row id 8 (is )?out of range", True),
        ("get_rows", (q8, torch.tensor([-2]), "Q8_0", torch.float32), IndexError, "row id -2", True),
        ("get_rows", (q4k, torch.tensor([4]), "Q4_K", torch.float32), IndexError, "out of range", True),
        ("get_rows", (q8, torch.tensor([1.0]), "Q8_0", torch.float32), ValueError, "integer", False),
        ("get_rows", (q8[:, :40], torch.tensor([1]), "Q8_0", torch.float32), ValueError, "whole number", False),
        ("swiglu_mul_mat", (torch.randn(2, 256), q6k, q6k[:20], "Q6_K", "Q6_K"), ValueError, "same width", False),
        ("swiglu_mul_mat", (torch.randn(2, 256), q6k, random_packed("Q6_K", (24, 512)), "Q6_K", "Q6_K"), ValueError,
         "bytes per Q6_K row", False),
        ("swiglu_mul_mat", (torch.randn(2, 128), q6k, q6k, "Q6_K", "Q6_K"), ValueError,
         "not a multiple of the Q6_K block size", False),
        ("swiglu_mul_mat", (torch.randn(2, 256), q6k, q6k, "Q6_K", "Q8_0"), ValueError, "bytes per Q8_0 row", False),
        ("swiglu_mul_mat", (torch.randn(2, 256), q6k.float(), q6k, "Q6_K", "Q6_K"), ValueError, "uint8", False),
        ("swiglu_mul_mat", (torch.ones(2, 256, dtype=torch.int32), q6k, q6k, "Q6_K", "Q6_K"), ValueError,
         "float32, bfloat16 or float16", False),
        ("rms_norm", (x2, torch.randn(7), 1e-6), ValueError, "rms_norm", False),
        ("rms_norm", (torch.randn(2, 16), torch.ones(15), 1e-6), ValueError, "w must be", False),
        ("moe_route", (torch.randn(3, 8), 9, True), ValueError, "k=9", False),
        ("swiglu", (x2, torch.randn(2, 9)), ValueError, "swiglu", False),
        ("swiglu", (x2.long(), x2.long()), ValueError, "float32", False),
        ("attention", (torch.randn(1, 1, 3, 8), kc, kc, torch.tensor([[0]]), 1.0, "eager"), ValueError, "multiple", False),
        ("attention", (q, kc, kc, torch.tensor([[4]]), 1.0, "eager"), ValueError, "cache length", True),
        ("attention", (q, kc, kc, torch.tensor([[0]]), 1.0, "sdpa"), ValueError, "impl", False),
        ("kv_cache_write", (kc, kc.clone(), torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8), torch.tensor([[-1]])),
         ValueError, "positions must be in", True),
        ("kv_cache_write", (kc, kc.clone(), torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8), torch.tensor([[4]])),
         ValueError, "cache length", True),
        ("qk_norm_rope", (q, q, torch.ones(8), None, torch.tensor([[0]]), 1e4, 1e-6), ValueError, "both", False),
        ("qk_norm_rope_kv_write", (q, q, torch.randn(1, 1, 1, 8), None, None, kc, kc.clone(), torch.tensor([[0]]), 1e4,
                                   1e-6), ValueError, "qk_norm_rope_kv_write: k and v must be", False),
        ("qk_norm_rope_kv_write", (q, q, q, None, None, kc, kc[..., :4].clone(), torch.tensor([[0]]), 1e4, 1e-6),
         ValueError, "of one shape", False),
        ("qk_norm_rope_kv_write", (q, q, q, None, None, kc, kc.clone(), torch.tensor([[4]]), 1e4, 1e-6), ValueError,
         "cache length", True),
    ]


KNOWN_ERROR_MISMATCHES: dict = {}
"""(backend, op, message pattern) -> the exception type a backend raises instead of the
reference's, for a clear message of the wrong type. Strict: an entry that no longer
mismatches fails the test, so it is removed once the backend is fixed."""


def test_bad_arguments_raise_the_reference_errors():
    """The reference rejects each bad call with an error naming the problem, and every backend
    rejects it with the same error (value checks of ids and positions: backends that check on
    the host)."""
    calls = _bad_calls()
    for op, args, exc, match, _ in calls:
        with pytest.raises(exc, match=match):
            getattr(torch.ops.hanzo_ref, op)(*args)
    for b in BACKENDS:
        for op, args, exc, match, value_check in calls:
            if value_check and not b.host_index_errors:
                continue
            with pytest.raises(KNOWN_ERROR_MISMATCHES.get((b.name, op, match), exc), match=match):
                b.run(op, *args)


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
    _triton_child({})


@pytest.mark.slow
@pytest.mark.skipif(bool(ONLY), reason="the child process runs the interpreter cases themselves")
def test_triton_interpreter_backend_every_format():
    _triton_child({"HANZO_CONFORMANCE_ALL": "1"})


def _triton_child(extra_env):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "HANZO_CONFORMANCE": "triton-interp", **extra_env}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W",
                          "ignore::RuntimeWarning", __file__],
                         capture_output=True, text=True, timeout=900, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tail = (out.stdout + out.stderr)[-3000:]
    assert out.returncode == 0, tail
    assert " passed" in tail and "triton-interp" not in tail.split("passed")[-1], tail
