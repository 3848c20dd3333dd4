"""``hanzo::mul_mat_group``: several packed mat-muls of one activation, ``[x @ W_i^T (+ b_i)]``.

The attention's q, k and v projections read the same normed hidden state; a decode step runs
them as one op so a backend can quantize the activation once and run all the weights' rows as
the tasks of one parallel region (the two small kv projections, ~0.2 MB each in a 1.5B model,
cost more in their own fork-join and stream start than in reading their bytes). The weights may
have different formats (Q4_K_M files keep ``attn_v`` in Q6_K on some layers) and widths.

Dispatch follows docs/ARCHITECTURE.md: the C++ CPU kernel on the ``CPU`` key
(``mul_mat_group`` in csrc/cpu/ops.cpp, the same bits as the ``mul_mat`` calls it replaces);
every other backend runs :func:`mul_mat_group_reference`, the composition of ``hanzo::mul_mat``
calls (so each still runs its own ``mul_mat`` kernel). ``HANZO_MUL_MAT_GROUP_FALLBACK=1`` forces
that composition on the CPU too.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .quant import _check_mul_mat_args
from .spec import OpSpec, declare

__all__ = ["OPS", "mul_mat_group_reference"]

OPS = ("mul_mat_group",)
"""The ops this module defines (``torch.ops.hanzo.<name>``)."""

_OP = "mul_mat_group"
_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_mul_mat_group(x: torch.Tensor, w: Sequence[torch.Tensor], qtype: Sequence[str],
                         bias: Sequence[Optional[torch.Tensor]]) -> None:
    # shapes, dtypes and devices only: shared by the fake kernel and the reference
    if len(w) == 0:
        raise ValueError(f"{_OP}: needs at least one weight")
    if not (len(qtype) == len(w) == len(bias)):
        raise ValueError(f"{_OP}: got {len(w)} weights, {len(qtype)} qtypes and {len(bias)} biases; "
                         "need one qtype and one bias (or None) per weight")
    for i, (wi, qi, bi) in enumerate(zip(w, qtype, bias)):
        try:
            _check_mul_mat_args(x, wi, qi)
        except ValueError as e:
            raise ValueError(f"{_OP}: weight {i}: {e}") from None
        if bi is None:
            continue
        if bi.dtype not in _FLOAT:
            raise ValueError(f"{_OP}: bias {i} must be a float tensor, got {bi.dtype}")
        if tuple(bi.shape) != (wi.shape[0],):
            raise ValueError(f"{_OP}: bias {i} must be [N] = [{wi.shape[0]}] (weight {i} has N={wi.shape[0]} rows), "
                             f"got {tuple(bi.shape)}")
        if bi.device != x.device:
            raise ValueError(f"{_OP}: bias {i} is on {bi.device} but x is on {x.device}")
    if torch.is_grad_enabled():
        _refuse_trainable_bias(bias)


def _refuse_trainable_bias(bias: Sequence[Optional[torch.Tensor]]) -> None:
    for i, b in enumerate(bias):
        if b is not None and b.requires_grad:
            raise ValueError(f"{_OP}: bias {i} requires grad, but the biases are constants of this op (no "
                             "gradient flows to them); add a trainable bias outside it")


def mul_mat_group_reference(x: torch.Tensor, w: Sequence[torch.Tensor], qtype: Sequence[str],
                            bias: Sequence[Optional[torch.Tensor]]) -> list[torch.Tensor]:
    """``[hanzo.mul_mat(x, w[i], qtype[i]) (+ bias[i]) for each i]``.

    Args:
        x: ``[..., K]`` float32/bfloat16/float16 (float64: reference only).
        w: packed weights, ``uint8 [N_i, row_bytes_i(K)]`` in the ggml formats ``qtype[i]`` (they
            may differ, as may the widths ``N_i``).
        qtype: one ggml format name per weight.
        bias: one ``[N_i]`` float tensor or None per weight.
    Returns:
        One tensor per weight, ``[..., N_i]``: the ``mul_mat`` result in ``x.dtype`` plus the bias
        as torch adds them (``y + b``: a float32 bias on a bfloat16 ``x`` gives float32).
    Raises:
        ValueError: lists of different lengths or empty; anything ``mul_mat`` rejects for a weight
            (named by its index); a bias that is not float, not ``[N_i]``, on another device, or
            requiring grad while grad mode is on (the op gives gradients for ``x`` only).
    """
    ops = torch.ops.hanzo
    out = []
    for wi, qi, bi in zip(w, qtype, bias):
        y = ops.mul_mat(x, wi, qi)
        out.append(y if bi is None else y + bi)
    return out


def _outputs(x, w, qtype, bias):
    return [x.new_empty(*x.shape[:-1], wi.shape[0],
                        dtype=x.dtype if bi is None else torch.promote_types(x.dtype, bi.dtype))
            for wi, bi in zip(w, bias)]


# ---------------------------------------------------------------------- autograd (w.r.t. x only)
# The packed weights and the biases are constants (a list of optional tensors carries no autograd
# edge through a custom op, so a trainable bias is refused by the check rather than given a zero
# gradient). The backward differentiates the composition: each mul_mat's own backward
# dequantizes in chunks.
def _setup_context(ctx, inputs, output):
    x, w, qtype, bias = inputs
    _refuse_trainable_bias(bias)  # the CPU kernel runs no Python check: refused here, once a graph is built
    ctx.save_for_backward(x, *w)
    ctx.qtype = list(qtype)


def _backward(ctx, grads):
    x, *w = ctx.saved_tensors
    gx = None
    pairs = [(i, g) for i, g in enumerate(grads) if g is not None]
    if ctx.needs_input_grad[0] and pairs:
        ops = torch.ops.hanzo
        with torch.enable_grad():
            xr = x.detach().requires_grad_(True)
            ys = [ops.mul_mat(xr, w[i], ctx.qtype[i]) for i, _ in pairs]
            (gx,) = torch.autograd.grad(ys, [xr], [g.to(y.dtype) for y, (_, g) in zip(ys, pairs)])
    nb = ctx.needs_input_grad[3]  # a list when every bias is a tensor, else one flag for the list
    return gx, [None] * len(w), None, [None] * len(nb) if isinstance(nb, list) else None


mul_mat_group = declare(OpSpec(
    _OP, "(Tensor x, Tensor[] w, str[] qtype, Tensor?[] bias) -> Tensor[]",
    check=_check_mul_mat_group, reference=mul_mat_group_reference, tolerance="contraction",
    outputs=_outputs, backward=(_setup_context, _backward),
    doc="""``torch.ops.hanzo.mul_mat_group``: ``[x @ W_i^T (+ b_i)]`` over one activation.

    Args:
        x: ``[..., K]`` float32/bfloat16/float16.
        w: list of ``uint8 [N_i, row_bytes_i(K)]`` packed rows (docs/ARCHITECTURE.md).
        qtype: list of ggml format names, one per weight.
        bias: list of ``[N_i]`` float tensors or None, one per weight (constants: no gradient).
    Returns:
        list of ``[..., N_i]`` tensors, each what ``mul_mat(x, w[i], qtype[i]) + bias[i]`` gives.
    Raises:
        ValueError: list lengths differing or empty, a weight ``mul_mat`` rejects, a bias not
            ``[N_i]`` float on x's device or requiring grad (gradients flow to ``x`` only).
    """))
