"""The layers of the models, each in two twins with the same parameter names and shapes.

====================  ==========================  ==========================================
dense twin            packed twin                 forward
====================  ==========================  ==========================================
:class:`Linear`       :class:`PackedLinear`       ``x @ weight^T (+ bias)``; ``swiglu(up, x)``
                                                  is ``silu(x @ gate^T) * (x @ up^T)``;
                                                  :func:`linear_group` runs several on one x
:class:`Embedding`    :class:`PackedEmbedding`    ``weight[ids]``
:class:`Experts`      :class:`PackedExperts`      ``x @ weight[ids]^T``, per chosen expert
:class:`RMSNorm`      (always dense)              ``hanzo::rms_norm`` / ``add_rms_norm``
====================  ==========================  ==========================================

A model is built from dense twins (on the meta device, so nothing is allocated);
:func:`hanzo_torch.load` swaps in the packed twin of every layer (:func:`packed_twin`) and then
assigns the file's tensors, gpt-fast's way of swapping quantized linears in before loading a
state dict. A packed twin's ``weight`` is a :class:`~hanzo_torch.GGUFTensor` parameter named as
in the file, and its forward calls the ``hanzo`` op on the packed rows directly: no
``__torch_function__`` detour, and the parameter is read from ``_parameters`` rather than
through ``nn.Module.__getattr__`` (decode runs ~200 of these calls per token). Dense twins are
for models built by hand with float weights.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Linear", "PackedLinear", "Embedding", "PackedEmbedding", "Experts", "PackedExperts", "RMSNorm",
           "linear_group", "packed_twin"]

hanzo = torch.ops.hanzo


def _weight(*shape: int) -> nn.Parameter:
    # torch.empty, not nn.Linear's random init (seconds for a real model, even on the meta device)
    return nn.Parameter(torch.empty(shape), requires_grad=False)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, fused with the residual add that precedes it.

    ``norm(x, residual)`` returns ``(n(x + residual), x + residual)`` with ``n(v) = v /
    sqrt(mean(v^2) + eps) * weight``: the pre-norm sub-layer's input and the new residual stream;
    ``residual=None`` (the first sub-layer) returns ``(n(x), x)``. ``x``: ``[..., dim]`` float.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _weight(dim)
        self.eps = eps

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        w = self._parameters["weight"]
        if residual is None:
            return hanzo.rms_norm(x, w, self.eps), x
        return hanzo.add_rms_norm(x, residual, w, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class Linear(nn.Module):
    """``y = x @ weight^T (+ bias)`` with a float ``weight [out_features, in_features]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _weight(out_features, in_features)
        self.register_parameter("bias", _weight(out_features) if bias else None)

    def forward(self, x: Tensor) -> Tensor:
        p = self._parameters
        return F.linear(x, p["weight"], p["bias"])

    def swiglu(self, up: nn.Module, x: Tensor) -> Tensor:
        """``silu(self(x)) * up(x)``, this layer being the gate: the SwiGLU feed-forward's first half."""
        return hanzo.swiglu(self(x), up(x))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedLinear(Linear):
    """:class:`Linear` over a :class:`~hanzo_torch.GGUFTensor` ``weight``: ``hanzo::mul_mat``.

    ``x``: ``[..., in_features]`` float32/bfloat16/float16; returns ``[..., out_features]`` in
    ``x.dtype`` (float32 accumulation); ``bias`` stays dense.
    """

    def forward(self, x: Tensor) -> Tensor:
        p = self._parameters
        w, b = p["weight"], p["bias"]
        y = hanzo.mul_mat(x, w.packed, w.qtype)
        return y if b is None else y + b

    def swiglu(self, up: nn.Module, x: Tensor) -> Tensor:
        """Gate and up projections and ``silu(gate) * up`` in one op (``hanzo::swiglu_mul_mat``:
        the activation is read once for both weights)."""
        if type(up) is not PackedLinear:  # a dense up projection (a model assembled by hand)
            return hanzo.swiglu(self(x), up(x))
        g, u = self._parameters["weight"], up._parameters["weight"]
        return hanzo.swiglu_mul_mat(x, g.packed, u.packed, g.qtype, u.qtype)


def linear_group(x: Tensor, *linears: nn.Module) -> tuple[Tensor, ...]:
    """``(linear(x) for linear in linears)``: several projections of one activation (the attention's
    q, k and v), as one ``hanzo::mul_mat_group`` when every layer is a plain :class:`PackedLinear`
    without hooks or a bias that trains: the activation is quantized once and the weights' rows
    share one parallel region, with the same results as the layers called one by one. Any other
    layer (a dense twin, a PEFT LoRA layer, a tensor-parallel shard, a layer with hooks such as
    :class:`~hanzo_torch.imatrix.IMatrixCollector`'s) makes every layer run as a module call.

    ``x``: ``[..., in_features]``; returns one ``[..., out_features_i]`` tensor per layer.
    """
    ws, qtypes, biases = [], [], []
    for m in linears:
        if type(m) is not PackedLinear or m._forward_hooks or m._forward_pre_hooks:
            return tuple(m(x) for m in linears)
        w, b = m._parameters["weight"], m._parameters["bias"]
        if b is not None and b.requires_grad:
            return tuple(m(x) for m in linears)
        ws.append(w.packed)
        qtypes.append(w.qtype)
        biases.append(b)
    return tuple(hanzo.mul_mat_group(x, ws, qtypes, biases))


class Embedding(nn.Module):
    """``weight[ids]``: rows of a float ``weight [num_embeddings, embedding_dim]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = _weight(num_embeddings, embedding_dim)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self._parameters["weight"])

    def extra_repr(self) -> str:
        return "{}, {}".format(*self.weight.shape)


class PackedEmbedding(Embedding):
    """:class:`Embedding` of a :class:`~hanzo_torch.GGUFTensor` table: ``hanzo::get_rows``
    dequantizes only the rows asked for, to the weight's compute dtype."""

    def forward(self, ids: Tensor) -> Tensor:
        w = self._parameters["weight"]
        return hanzo.get_rows(w.packed, ids, w.qtype, w.dtype)


class Experts(nn.Module):
    """Stacked expert projections ``weight [n_expert, out_features, in_features]``.

    ``experts(x, ids int64 [T, k]) -> [T, k, out]``: ``x[t] @ weight[ids[t, j]]^T``, token t
    through each of its k chosen experts, for ``x [T, in]``; ``x[t, j] @ weight[ids[t, j]]^T``
    for ``x [T, k, in]`` (one row per choice, as the down projection after the SwiGLU).
    """

    def __init__(self, n_expert: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = _weight(n_expert, out_features, in_features)

    def forward(self, x: Tensor, ids: Tensor) -> Tensor:
        w = self._parameters["weight"]
        rows = x.unsqueeze(1) if x.dim() == 2 else x  # [T, 1 or k, in]
        return (w[ids].to(x.dtype) @ rows.unsqueeze(-1)).squeeze(-1)  # [T, k, out, in] @ [T, ., in, 1]

    def extra_repr(self) -> str:
        return "n_expert={}, out_features={}, in_features={}".format(*self.weight.shape)


class PackedExperts(Experts):
    """:class:`Experts` over a 3-D :class:`~hanzo_torch.GGUFTensor`: ``hanzo::mul_mat_id``
    (only the chosen experts' rows are read)."""

    def forward(self, x: Tensor, ids: Tensor) -> Tensor:
        w = self._parameters["weight"]
        return hanzo.mul_mat_id(x, w.packed, ids, w.qtype)


def packed_twin(module: nn.Module) -> Optional[nn.Module]:
    """The packed twin of a dense layer (same shapes, parameters allocated like the dense one's:
    build under ``torch.device("meta")``), or None for a module that has none."""
    kind = type(module)
    if kind is Linear:
        return PackedLinear(module.in_features, module.out_features, bias=module._parameters["bias"] is not None)
    if kind is Embedding:
        return PackedEmbedding(*module.weight.shape)
    if kind is Experts:
        return PackedExperts(*module.weight.shape)
    return None
