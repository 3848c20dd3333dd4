"""The causal-LM loss of the training forward, computed in chunks of tokens.

``model(input_ids, labels=labels, use_cache=False)`` returns :class:`CausalLMOutput` with the
mean next-token cross entropy (transformers' convention: labels shifted inside, ``-100``
ignored). The LM head and the loss run on :data:`LOSS_CHUNK_BYTES`-sized chunks of tokens, each
under a non-reentrant ``torch.utils.checkpoint``: the forward keeps only the chunk's hidden
states, and the backward recomputes one chunk's logits at a time. The ``[B, T, V]`` logits, their
log-softmax and its gradient (three ``T x V`` float32 arrays, 311 MB each for 512 tokens of a
151936-token vocabulary) never exist at once.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

__all__ = ["IGNORE_INDEX", "LOSS_CHUNK_BYTES", "CausalLMOutput", "causal_lm_loss", "loss_chunk_tokens"]

IGNORE_INDEX = -100
"""Label of a position without loss (torch's ``cross_entropy`` and transformers' default)."""

LOSS_CHUNK_BYTES = 64 << 20
"""Float32 logits per loss chunk (64 MiB: 110 tokens of a 151936-token vocabulary)."""


class CausalLMOutput(NamedTuple):
    """What ``model(input_ids, labels=..., use_cache=False)`` returns: ``loss`` (float32 0-dim),
    ``logits`` (None: the full logits are never materialized on this path)."""

    loss: Tensor
    logits: Optional[Tensor] = None


def loss_chunk_tokens(vocab_size: int, chunk_bytes: int = LOSS_CHUNK_BYTES) -> int:
    """Tokens per loss chunk whose float32 logits ``[chunk, vocab_size]`` fit in ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * max(int(vocab_size), 1)))


def _chunk_loss_sum(head: Callable[[Tensor], Tensor], h: Tensor, y: Tensor) -> Tensor:
    logits = head(h)
    return F.cross_entropy(logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32), y,
                           ignore_index=IGNORE_INDEX, reduction="sum")


def causal_lm_loss(hidden: Tensor, head: Callable[[Tensor], Tensor], labels: Tensor,
                   chunk_tokens: int) -> Tensor:
    """Mean next-token cross entropy of ``head(hidden)`` against ``labels``, in token chunks.

    Args:
        hidden: ``[B, T, H]`` final normed hidden states (float32, or float64 for tests).
        head: the LM head, ``[n, H] -> [n, V]`` logits (any module: a packed or LoRA layer).
        labels: integer ``[B, T]``; position ``t`` predicts ``labels[:, t + 1]`` (shifted
            here, as transformers does); ``-100`` (:data:`IGNORE_INDEX`) marks a position
            without loss.
        chunk_tokens: tokens per chunk (:func:`loss_chunk_tokens`); with grad on, each chunk is
            checkpointed and its logits recomputed in backward.

    Returns:
        0-dim float32 (float64 for a float64 ``hidden``): the sum over counted positions divided
        by their count; 0 (with zero gradients) when no position is counted.

    Raises:
        ValueError: ``labels`` not integer ``[B, T]`` matching ``hidden``, ``chunk_tokens < 1``.
    """
    if labels.is_floating_point() or labels.dim() != 2 or tuple(labels.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"labels must be integer [B, T] = {list(hidden.shape[:2])}, got {labels.dtype} "
                         f"{tuple(labels.shape)}")
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    H = hidden.shape[-1]
    h = hidden[:, :-1].reshape(-1, H)
    y = labels[:, 1:].to(hidden.device).reshape(-1).long()
    count = (y != IGNORE_INDEX).sum()
    checkpoint = torch.is_grad_enabled() and h.requires_grad
    total = None
    for n0 in range(0, h.shape[0], chunk_tokens):
        hc, yc = h[n0:n0 + chunk_tokens], y[n0:n0 + chunk_tokens]
        if checkpoint:
            part = torch.utils.checkpoint.checkpoint(_chunk_loss_sum, head, hc, yc, use_reentrant=False)
        else:
            part = _chunk_loss_sum(head, hc, yc)
        total = part if total is None else total + part
    if total is None:  # T == 1: nothing to predict
        total = hidden.sum() * 0
    return total / count.clamp(min=1).to(total.dtype)
