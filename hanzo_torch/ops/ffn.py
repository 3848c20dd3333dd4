"""The gate+up fused feed-forward op ``hanzo::swiglu_mul_mat``.

``swiglu_mul_mat(x, w_gate, w_up, qtype_gate, qtype_up) = silu(x @ Wg^T) * (x @ Wu^T)``: the
first half of a dense SwiGLU FFN (the down projection stays a plain ``hanzo::mul_mat``). Fusing
the two projections lets a backend read the activation once for both weights and apply the
``silu * up`` epilogue in registers (``docs/DESIGN.md`` section 5, "gate+up sharing one
quantized activation").

Dispatch follows docs/ARCHITECTURE.md: a backend's kernel on the device's dispatch key (Triton on
CUDA/ROCm: :mod:`hanzo_torch.backends.triton.ffn`; C++ on the CPU) runs when it handles *both*
formats, else :func:`swiglu_mul_mat_reference`, the unfused composition of ``hanzo::mul_mat``
(twice) and ``hanzo::swiglu``. ``HANZO_SWIGLU_MUL_MAT_FALLBACK=1`` forces the reference.

CPU: ``hanzo_torch.backends.cpu.swiglu_mul_mat`` (csrc/cpu/ops.cpp) quantizes x once per block size
and computes each thread's range of gate rows, up rows and the epilogue in one parallel region,
bit-identical to the composition of the C++ ``mul_mat`` and ``swiglu`` kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .spec import OpSpec, declare
from .quant import _check_act, _check_packed, _check_row_length, _check_same_device, get_format

__all__ = ["OPS", "swiglu_mul_mat_reference"]

OPS = ("swiglu_mul_mat",)
"""The ops this module defines (``torch.ops.hanzo.<name>``)."""

_OP = "swiglu_mul_mat"


def _check_swiglu_mul_mat(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                          qtype_gate: str, qtype_up: str) -> None:
    # shapes and dtypes only: shared by the fake kernel and the op body
    _check_act(x, _OP)
    K = x.shape[-1]
    for w, qtype, what in ((w_gate, qtype_gate, "w_gate"), (w_up, qtype_up, "w_up")):
        _check_packed(w, 2, _OP, f"2-D [F, row_bytes] ({what})")
        fmt = get_format(qtype)
        _check_row_length(fmt, K, _OP)
        if w.shape[1] != fmt.row_bytes(K):
            raise ValueError(f"{_OP}: x has K={K}, which needs {fmt.row_bytes(K)} bytes per {fmt.name} row, "
                             f"but {what} has rows of {w.shape[1]} bytes (shape {tuple(w.shape)})")
    if w_gate.shape[0] != w_up.shape[0]:
        raise ValueError(f"{_OP}: w_gate has {w_gate.shape[0]} rows (F) but w_up has {w_up.shape[0]}; "
                         "the gate and up projections must have the same width")


def swiglu_mul_mat_reference(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                             qtype_gate: str, qtype_up: str) -> torch.Tensor:
    """The unfused composition ``hanzo.swiglu(hanzo.mul_mat(x, Wg), hanzo.mul_mat(x, Wu))``.

    Args:
        x: ``[..., K]`` float32/bfloat16/float16.
        w_gate, w_up: ``uint8 [F, row_bytes(K)]`` packed in ``qtype_gate`` / ``qtype_up``
            (ggml names, may differ, e.g. Q4_K gate and Q6_K up).
    Returns:
        ``[..., F]`` in ``x.dtype``. Each projection accumulates in float32 and is rounded to
        ``x.dtype`` before the float32 ``silu(gate) * up`` (as the two ops are when run apart).
    """
    ops = torch.ops.hanzo
    return ops.swiglu(ops.mul_mat(x, w_gate, qtype_gate), ops.mul_mat(x, w_up, qtype_up))


def check_args(op: str, x, w_gate, w_up, qtype_gate, qtype_up) -> None:
    """The checks of ``hanzo::swiglu_mul_mat`` (shapes, dtypes, devices); raises ValueError."""
    _check_swiglu_mul_mat(x, w_gate, w_up, qtype_gate, qtype_up)
    _check_same_device(_OP, x, w_gate, w_up)


# ---------------------------------------------------------------------- autograd (w.r.t. x only)
# As for hanzo::mul_mat, the packed weights are constants. The backward recomputes the two
# projections with hanzo::mul_mat (whose own backward dequantizes in chunks) and differentiates
# silu(g) * u in float32.
def _setup_context(ctx, inputs, output):
    x, w_gate, w_up, qtype_gate, qtype_up = inputs
    ctx.save_for_backward(x, w_gate, w_up)
    ctx.qtypes = (qtype_gate, qtype_up)


def _backward(ctx, grad):
    x, w_gate, w_up = ctx.saved_tensors
    qg, qu = ctx.qtypes
    with torch.enable_grad():
        xr = x.detach().requires_grad_(True)
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        g = torch.ops.hanzo.mul_mat(xr, w_gate, qg).to(cd)
        u = torch.ops.hanzo.mul_mat(xr, w_up, qu).to(cd)
        y = F.silu(g) * u
        (gx,) = torch.autograd.grad(y, xr, grad.to(cd))
    return gx.to(x.dtype), None, None, None, None


swiglu_mul_mat = declare(OpSpec(
    _OP, "(Tensor x, Tensor w_gate, Tensor w_up, str qtype_gate, str qtype_up) -> Tensor",
    check=lambda x, w_gate, w_up, qtype_gate, qtype_up: check_args(_OP, x, w_gate, w_up, qtype_gate, qtype_up),
    reference=swiglu_mul_mat_reference, tolerance="contraction",
    outputs=lambda x, w_gate, *_: x.new_empty(*x.shape[:-1], w_gate.shape[0]),
    backward=(_setup_context, _backward), doc="""``torch.ops.hanzo.swiglu_mul_mat``: ``silu(x @ Wg^T) * (x @ Wu^T)``.

    Args:
        x: ``[..., K]`` float32/bfloat16/float16.
        w_gate, w_up: ``uint8 [F, row_bytes(K)]`` packed rows (docs/ARCHITECTURE.md) in the
            ggml formats ``qtype_gate`` / ``qtype_up``.
    Returns:
        ``[..., F]`` in ``x.dtype``, float32 accumulation.
    Raises:
        ValueError: x dtype, non-uint8 or non-2-D weights, K not a multiple of a block size, row
            bytes not matching K, gate and up widths F differing, tensors on different devices.
        KeyError/ValueError: an unknown format name (from the format registry).
    """))
