"""``hanzo::lora_mul_mat``: a packed mat-mul with a low-rank adapter, ``x @ W^T + scale (x @ A^T) @ B^T``.

The frozen weight ``W`` stays packed in a ggml format; the adapter matrices are plain float
tensors in PEFT's layout (``lora_A.weight`` ``[r, K]``, ``lora_B.weight`` ``[N, r]``, ``scale =
lora_alpha / r``), and are what a LoRA fine-tune trains: the op's backward gives gradients for
``x``, ``lora_a`` and ``lora_b`` (``W`` is a constant).
"""
from __future__ import annotations

import torch

from .quant import _check_mul_mat_args
from .spec import OpSpec, compute_dtype, declare

__all__ = ["lora_mul_mat_reference"]

_OP = "lora_mul_mat"
_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # float64: reference only


def _check_lora_mul_mat(x, w, qtype, lora_a, lora_b, scale) -> None:
    _check_mul_mat_args(x, w, qtype)
    K, N = x.shape[-1], w.shape[0]
    for t, what in ((lora_a, "lora_a"), (lora_b, "lora_b")):
        if t.dtype not in _FLOAT:
            raise ValueError(f"{_OP}: {what} must be float32, bfloat16 or float16 (float64: reference only), "
                             f"got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{_OP}: {what} must be 2-D, got shape {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{_OP}: {what} is on {t.device} but x is on {x.device}")
    r = lora_a.shape[0]
    if lora_a.shape[1] != K:
        raise ValueError(f"{_OP}: lora_a must be [r, K] = [r, {K}] (x has K={K}), got {tuple(lora_a.shape)}")
    if tuple(lora_b.shape) != (N, r):
        raise ValueError(f"{_OP}: lora_b must be [N, r] = [{N}, {r}] (w has N={N} rows, lora_a r={r}), "
                         f"got {tuple(lora_b.shape)}")


def lora_mul_mat_reference(x: torch.Tensor, w: torch.Tensor, qtype: str, lora_a: torch.Tensor,
                           lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``hanzo.mul_mat(x, w, qtype) + scale * (x @ lora_a^T) @ lora_b^T``.

    Args:
        x: ``[..., K]`` float32/bfloat16/float16 (float64: reference only).
        w: ``uint8 [N, row_bytes(K)]``, packed rows of the frozen weight in ggml format ``qtype``.
        qtype: ggml format name of ``w``.
        lora_a: ``[r, K]`` float (PEFT ``lora_A.weight``).
        lora_b: ``[N, r]`` float (PEFT ``lora_B.weight``).
        scale: the adapter's scale (PEFT ``lora_alpha / r``).

    Returns:
        ``[..., N]`` in ``x.dtype``: the ``mul_mat`` result (rounded to ``x.dtype`` as that op
        returns it) plus the adapter term, both in float32 (float64 for float64 ``x``), rounded
        to ``x.dtype`` once.

    Raises:
        ValueError: what ``mul_mat`` rejects; adapter matrices that are not float, not 2-D, not
            ``[r, K]`` and ``[N, r]``, or on another device.
    """
    cd = compute_dtype(x)
    y = torch.ops.hanzo.mul_mat(x, w, qtype)
    x2 = x.reshape(-1, x.shape[-1]).to(cd)
    delta = x2 @ lora_a.to(cd).t() @ lora_b.to(cd).t() * scale
    return (y.reshape(-1, y.shape[-1]).to(cd) + delta).reshape(y.shape).to(x.dtype)


lora_mul_mat = declare(OpSpec(
    _OP, "(Tensor x, Tensor w, str qtype, Tensor lora_a, Tensor lora_b, float scale) -> Tensor",
    check=_check_lora_mul_mat, reference=lora_mul_mat_reference, tolerance="contraction",
    outputs=lambda x, w, *_: x.new_empty(*x.shape[:-1], w.shape[0])))
