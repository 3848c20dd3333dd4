"""Triton backend of the ``hanzo`` ops for CUDA and ROCm (one source for both).

Kernels: ``dequantize``, ``get_rows``, ``mul_mat`` (decode mat-vec and prefill GEMM),
``mul_mat_id`` (decode over all routed slots in one launch; prefill grouped by expert on the
device), ``quantize_q8_1``, ``rms_norm``, ``add_rms_norm``, ``swiglu``, ``qk_norm_rope``,
``moe_route``, ``kv_cache_write``, ``qk_norm_rope_kv_write``, ``attention``. The quantized ones are generic over the ggml
format through :mod:`.formats` (one unpack rule per format, selected by a ``tl.constexpr``).

Importing this package never fails: without triton or without a CUDA/HIP device
:func:`register` registers nothing (``REASON`` says why) and the vectorized-torch references run.
ROCm tensors report device type ``"cuda"`` too, so one registration covers both. Reference mode
(``HANZO_<OP>_FALLBACK=1``, :func:`hanzo_torch.ops.use_reference`) is the redirect of
:mod:`hanzo_torch.ops._dispatch`, registered in front of these kernels on the CUDA key. Tests call the kernels directly on CPU tensors under ``TRITON_INTERPRET=1``
(:func:`kernels`).
"""
from __future__ import annotations

from typing import Optional

from ..base import Backend, Capture

AVAILABLE = False
REASON: Optional[str] = None
"""Why the kernels were not registered (None when they were)."""

QUANT_OPS = ("dequantize", "get_rows", "mul_mat", "mul_mat_id")
PLAIN_OPS = ("quantize_q8_1", "rms_norm", "add_rms_norm", "swiglu", "qk_norm_rope", "moe_route",
             "kv_cache_write", "qk_norm_rope_kv_write", "attention")


def kernels() -> dict:
    """``{op: python wrapper}`` of every Triton kernel (imports triton; raises ImportError without it)."""
    from . import fused, quant

    return {**{op: getattr(quant, op) for op in QUANT_OPS + ("quantize_q8_1",)},
            **{op: getattr(fused, op) for op in PLAIN_OPS if op != "quantize_q8_1"}}


def supported_formats() -> tuple[str, ...]:
    """ggml names the quantized kernels handle (every format with an unpack rule)."""
    from .formats import SUPPORTED

    return tuple(SUPPORTED)


NAME = "triton"
DEVICE_TYPES = ("cuda",)
_REGISTERED: list = []


def _format_args(op: str, args) -> tuple:
    """The format names a call of ``op`` carries (empty for ops without one)."""
    if op == "swiglu_mul_mat":
        return (args[3], args[4])
    if op in ("mul_mat", "dequantize"):
        return (args[2] if op == "mul_mat" else args[1],)
    if op in ("mul_mat_id",):
        return (args[3],)
    if op == "get_rows":
        return (args[2],)
    return ()


def _fits(op: str, args) -> bool:
    """Calls the kernels were written for: attention and the KV write assume caches of the
    activations' dtype (other cache dtypes, e.g. q8_0, run the reference). float64 tensors are
    reference-only (hanzo_torch/ops/spec.py)."""
    import torch

    if any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args):
        return False
    if op == "attention":
        return args[1].dtype == args[0].dtype
    if op == "kv_cache_write":
        return args[0].dtype == args[2].dtype
    return True


def wrap(op: str, fn, fmts: frozenset):
    """``fn`` as a dispatcher kernel: calls it was not written for and formats without a rule go
    to ``torch.ops.hanzo_ref.<op>`` (one warning per format); otherwise the op's checks, then ``fn``."""
    import torch

    from ... import ops

    ref = getattr(torch.ops.hanzo_ref, op)
    warned: set = set()

    def kernel(*args):
        if not _fits(op, args):
            return ref(*args)
        for q in _format_args(op, args):
            if q.upper() not in fmts:
                if q not in warned:
                    warned.add(q)
                    import warnings

                    warnings.warn(f"hanzo triton: no kernel for format {q}; {op} runs the torch reference",
                                  RuntimeWarning, stacklevel=2)
                return ref(*args)
        ops.check_args(op, *args)
        return fn(*args)

    kernel.__name__ = f"triton_{op}"
    return kernel


def register() -> frozenset:
    """Register every Triton kernel on the CUDA dispatch key (also ROCm, which torch calls cuda).

    Returns the ops registered (empty without triton or a device; :data:`REASON` says why).
    """
    import torch

    if _REGISTERED:
        return frozenset(_REGISTERED)
    if REASON is not None:
        return frozenset()
    fmts = frozenset(supported_formats())
    table = kernels()
    from . import ffn  # hanzo::swiglu_mul_mat (gate+up fused), both formats must be in fmts

    table["swiglu_mul_mat"] = ffn.swiglu_mul_mat
    for op, fn in table.items():
        torch.library.register_kernel(f"hanzo::{op}", "cuda", wrap(op, fn, fmts))
        _REGISTERED.append(op)
    return frozenset(_REGISTERED)


def status() -> dict:
    return {"available": REASON is None, "reason": REASON,
            "formats": supported_formats() if REASON is None else ()}


def _probe() -> None:
    global AVAILABLE, REASON
    try:
        import torch
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken triton install
        REASON = f"triton unavailable: {e}"
        return
    if not torch.cuda.is_available():
        REASON = "no CUDA/HIP device"
        return
    AVAILABLE = True


_probe()


class TritonBackend(Backend):
    """The contract of the Triton kernels and of the CUDA/HIP device they run on (graphs are
    torch's CUDA graphs, which need no Triton)."""

    name = NAME
    device_types = DEVICE_TYPES
    dispatch_key = "CUDA"
    distributed = "nccl"

    @property
    def op_formats(self):
        fmts = frozenset(supported_formats()) if REASON is None else frozenset()
        return {op: fmts for op in QUANT_OPS + ("swiglu_mul_mat",)}

    @property
    def auto_priority(self):
        import torch

        return 1 if torch.cuda.is_available() else None

    def reason(self) -> Optional[str]:
        return REASON

    def device_reason(self, device) -> Optional[str]:
        import torch

        return None if torch.cuda.is_available() else "torch sees no CUDA/ROCm device"

    def rank_device(self, device, local_rank: int):
        import torch

        if device.index is None:
            device = torch.device(device.type, local_rank)
            torch.cuda.set_device(device)
        return device

    def register(self) -> frozenset:
        return register()

    def status(self) -> dict:
        return status()

    def synchronize(self, device) -> None:
        import torch

        torch.cuda.synchronize(device)

    def graphs_supported(self, device) -> bool:
        import torch

        return torch.cuda.is_available() and hasattr(torch.cuda, "CUDAGraph")

    def capture(self, device, fn, warmup: int) -> Capture:
        import torch

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the default stream, as torch's graph docs do it
                for _ in range(max(1, warmup)):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                out = fn()

        def replay() -> None:
            with torch.cuda.device(device):
                graph.replay()

        return Capture(replay, out)


BACKEND = TritonBackend()
