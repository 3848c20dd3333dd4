"""Triton backend of the ``hanzo`` ops for CUDA and ROCm (one source for both).

Kernels: ``dequantize``, ``get_rows``, ``mul_mat`` (decode mat-vec and prefill GEMM),
``mul_mat_id`` (decode over all routed slots in one launch; prefill grouped by expert on the
device), ``quantize_q8_1``, ``rms_norm``, ``add_rms_norm``, ``swiglu``, ``qk_norm_rope``,
``moe_route``, ``kv_cache_write``, ``attention``. The quantized ones are generic over the ggml
format through :mod:`.formats` (one unpack rule per format, selected by a ``tl.constexpr``).

Importing this package never fails: without triton or without a CUDA/HIP device it registers
nothing (``REASON`` says why) and the vectorized-torch references run. ROCm tensors report
device type ``"cuda"`` too, so one registration covers both. ``HANZO_<OP>_FALLBACK=1`` still
selects the reference per op (``hanzo_torch.ops._common.kernel_for``).
"""
from __future__ import annotations

from typing import Optional

AVAILABLE = False
REASON: Optional[str] = None
"""Why the kernels were not registered (None when they were)."""

QUANT_OPS = ("dequantize", "get_rows", "mul_mat", "mul_mat_id")
PLAIN_OPS = ("quantize_q8_1", "rms_norm", "add_rms_norm", "swiglu", "qk_norm_rope", "moe_route",
             "kv_cache_write", "attention")


def kernels() -> dict:
    """``{op: python wrapper}`` of every Triton kernel (imports triton; raises ImportError without it)."""
    from . import fused, quant

    return {**{op: getattr(quant, op) for op in QUANT_OPS + ("quantize_q8_1",)},
            **{op: getattr(fused, op) for op in PLAIN_OPS if op != "quantize_q8_1"}}


def supported_formats() -> tuple[str, ...]:
    """ggml names the quantized kernels handle (every format with an unpack rule)."""
    from .formats import SUPPORTED

    return tuple(SUPPORTED)


def register_kernels(device_type: str = "cuda") -> None:
    """Register every kernel in :mod:`hanzo_torch.ops._common` for ``device_type``.

    Called at import for ``"cuda"`` when triton and a device are present. Tests call it with
    ``"cpu"`` under ``TRITON_INTERPRET=1`` to run the real op bodies through the kernels.
    """
    from ...ops import _common

    fmts = supported_formats()
    for op, fn in kernels().items():
        _common.register_kernel(op, device_type, fn, qtypes=fmts if op in QUANT_OPS else None)
    from . import ffn  # hanzo::swiglu_mul_mat (gate+up fused), both formats must be in fmts

    _common.register_kernel("swiglu_mul_mat", device_type, ffn.swiglu_mul_mat, qtypes=fmts)


def _autoregister() -> None:
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
    try:
        register_kernels("cuda")
    except Exception as e:  # never break `import hanzo_torch` over the optional backend
        REASON = f"Triton kernels failed to load: {e!r}"
        return
    AVAILABLE = True


_autoregister()
