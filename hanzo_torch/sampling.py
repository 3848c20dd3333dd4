"""Token sampling shared by single and batched generation.

Sampling runs on the CPU in float32 with its own ``torch.Generator``, so a seed gives the same
tokens whatever the model's device, and the global RNG is untouched.

Sampler chain (llama.cpp's default order, ``common/sampling.cpp``): repetition penalty over the
last ``repeat_last_n`` tokens -> top-k -> top-p -> min-p -> temperature -> draw. The truncation
filters see the temperature-1 distribution, so temperature only reshapes the survivors.
``temperature == 0`` is greedy (argmax after the repetition penalty).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_K",
    "DEFAULT_TOP_P",
    "DEFAULT_MIN_P",
    "DEFAULT_REPEAT_LAST_N",
    "SamplingParams",
    "sample_next",
    "apply_repetition_penalty",
    "truncate_candidates",
]

# llama.cpp defaults (common/common.h, common_params_sampling)
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.05
DEFAULT_REPEAT_LAST_N = 64


@dataclass(frozen=True)
class SamplingParams:
    """Sampler settings; see the module docstring for the order they apply in.

    temperature: >= 0, 0 = greedy. top_k: >= 0, 0 = off. top_p: in (0, 1], 1 = off.
    min_p: in [0, 1), 0 = off (keep tokens with p >= min_p * p_max).
    repetition_penalty: > 0, 1 = off (CTRL rule: positive logits divided, negative multiplied).
    repeat_last_n: how many recent tokens (prompt included) the penalty looks at.
    """

    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    min_p: float = DEFAULT_MIN_P
    repetition_penalty: float = 1.0
    repeat_last_n: int = DEFAULT_REPEAT_LAST_N

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1) (0 = off), got {self.min_p}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if self.repeat_last_n < 0:
            raise ValueError(f"repeat_last_n must be >= 0, got {self.repeat_last_n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


# ---------------------------------------------------------------------- samplers (pure functions)
def apply_repetition_penalty(logits: torch.Tensor, recent_ids: Sequence[int], penalty: float) -> torch.Tensor:
    """CTRL repetition penalty (Keskar et al. 2019, as in llama.cpp and transformers).

    logits: float ``[V]``. Each distinct id in ``recent_ids`` gets its logit divided by
    ``penalty`` if positive, multiplied by it otherwise. Returns a new tensor.
    """
    if penalty == 1.0 or len(recent_ids) == 0:
        return logits
    out = logits.clone()
    ids = torch.tensor(sorted(set(int(i) for i in recent_ids)), dtype=torch.long)
    vals = out[ids]
    out[ids] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return out


def truncate_candidates(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0,
                        min_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply top-k, then top-p, then min-p to float ``[V]`` logits (temperature 1).

    Returns ``(values, ids)``: the surviving logits sorted in descending order and their token
    ids (int64), at least one. top-k keeps the k largest (ties broken by ``torch.topk``); top-p
    keeps the shortest prefix of the sorted distribution (renormalized over the top-k survivors)
    whose probability mass reaches ``top_p``; min-p keeps tokens whose probability is at least
    ``min_p`` times the largest.
    """
    logits = logits.float()
    if top_k and top_k < logits.numel():
        values, ids = torch.topk(logits, int(top_k))  # sorted descending
    else:
        if min_p > 0:  # cheap pre-cut before the full sort: min-p drops these anyway
            keep = (logits >= logits.max() + math.log(min_p)).nonzero().squeeze(1)
            logits_kept = logits[keep]
            values, order = torch.sort(logits_kept, descending=True)
            ids = keep[order]
            if top_p < 1.0:  # top-p needs the full distribution's mass: renormalize over all V
                probs = torch.softmax(logits, dim=0)[ids]
                return _top_p_min_p(values, ids, probs, top_p, min_p)
        else:
            values, ids = torch.sort(logits, descending=True)
    probs = torch.softmax(values, dim=0)
    return _top_p_min_p(values, ids, probs, top_p, min_p)


def _top_p_min_p(values: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, top_p: float,
                 min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    n = values.numel()
    if top_p < 1.0:
        before = torch.cumsum(probs, dim=0) - probs  # mass strictly before each candidate
        n = max(1, int((before < top_p).sum()))
    if min_p > 0:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); sorted, so a prefix
        n = min(n, max(1, int((values[:n] >= values[0] + math.log(min_p)).sum())))
    return values[:n], ids[:n]


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None,
                recent_ids: Sequence[int] = ()) -> int:
    """Pick the next token id from float ``[V]`` logits (any device; sampled on the CPU).

    Raises:
        ValueError: logits are all -inf/NaN (the model produced no usable distribution).
    """
    logits = logits.detach().float().cpu()
    if params.repetition_penalty != 1.0 and params.repeat_last_n:
        logits = apply_repetition_penalty(logits, list(recent_ids)[-params.repeat_last_n:], params.repetition_penalty)
    if params.greedy:
        tid = int(torch.argmax(logits))
        if not math.isfinite(float(logits[tid])):
            raise ValueError("the model's logits contain no finite value (NaN/inf): cannot pick a token")
        return tid
    values, ids = truncate_candidates(logits, params.top_k, params.top_p, params.min_p)
    if not math.isfinite(float(values[0])):
        raise ValueError("the model's logits contain no finite value (NaN/inf): cannot sample a token")
    probs = torch.softmax(values / params.temperature, dim=0)
    return int(ids[torch.multinomial(probs, 1, generator=generator)])


def _sample_checked(model, logits: torch.Tensor, params: SamplingParams, generator, history: list) -> int:
    """:func:`sample_next`; logits without a finite value are the model file's fault: GGUFError
    naming the file (the load-time check only sees the first forward's logits)."""
    try:
        return sample_next(logits, params, generator, history)
    except ValueError as exc:
        from .gguf_file import GGUFError

        path = getattr(getattr(model, "gguf", None), "path", None)
        if path is None:
            raise
        raise GGUFError(f"{path}: {exc} (after {len(history)} tokens): its weights overflow the compute dtype "
                        "at this context") from None


def _sample(model, logits: torch.Tensor, params: SamplingParams, generator, history) -> int:
    """:func:`sample_next`; for a tensor-parallel model (``model.tp``), on rank 0, whose token
    is broadcast to the others, so every rank decodes the same sequence."""
    tp = getattr(model, "tp", None)
    if tp is None:
        return _sample_checked(model, logits, params, generator, history)
    token = _sample_checked(model, logits, params, generator, history) if tp.rank == 0 else None
    return tp.broadcast_token(token, logits.device)
