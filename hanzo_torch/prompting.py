"""What a generation request is made of, shared by single (:mod:`hanzo_torch.generation`) and
batched (:mod:`hanzo_torch.batching`) generation: prompts (text, token ids, chat messages) turned
into checked token ids, the token budget and stop strings, the model's tokenizer, the per-model
run lock, and the result types (:class:`GenerationResult`, :class:`GenerationStats`).
"""
from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

__all__ = ["GenerationStats", "GenerationResult", "Prompt"]


@dataclass
class GenerationStats:
    """Token counts and timings of one :func:`generate` call (seconds, wall clock).

    ``prefill_s`` covers the prompt forward and the first sample; ``decode_s`` the
    ``decode_steps`` single-token forwards (and their samples) after it. ``generated_tokens``
    excludes a final end-of-generation token, so it is ``decode_steps`` when generation ended on
    one and ``decode_steps + 1`` otherwise.
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: Optional[str] = None  # "eos", "stop", "length", "context"
    seed: Optional[int] = None
    cuda_graph: bool = False  # decode steps replayed a captured CUDA/HIP or Vulkan graph
    vulkan_profile: Optional[dict] = None
    """On a device whose backend collects profile counters (vulkan with ``HANZO_VK_PROFILE=1``):
    its counters (``Backend.profile``, :func:`hanzo_torch.backends.vulkan.profile`) for the ``"prefill"`` (prompt forward and first
    sample), the ``"first_decode"`` step (graph warm-up and capture included) and the
    ``"decode"`` steps after it (summed over ``decode_steps - 1`` steps); None otherwise."""

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else float("nan")

    def summary(self) -> str:
        def rate(r: float) -> str:
            return f"{r:.1f} tok/s" if math.isfinite(r) else "no timing"

        return (f"prefill: {self.prompt_tokens} tokens in {self.prefill_s:.2f} s "
                f"({rate(self.prefill_tokens_per_s)}) | decode: {self.decode_steps} tokens in "
                f"{self.decode_s:.2f} s ({rate(self.decode_tokens_per_s)}, {'graph' if self.cuda_graph else 'eager'}) "
                f"| stop: {self.stop_reason}")


@dataclass
class GenerationResult:
    """Output of :func:`generate`: the new text (stop string and special tokens excluded), the
    generated token ids (an end-of-generation token is not included), and the stats."""

    text: str
    token_ids: list[int]
    stats: GenerationStats

    def __str__(self) -> str:
        return self.text


def _model_device(model: torch.nn.Module) -> torch.device:
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def _stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


Prompt = Union[str, Sequence[int], torch.Tensor, Sequence[Mapping[str, Any]]]


def _needs_tokenizer(prompt: Any) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, Sequence) and bool(prompt) and isinstance(prompt[0], Mapping))


def _model_tokenizer(model: Any, prompts: Any, needed: bool, batch: bool = False) -> Any:
    """``model.tokenizer``, or None when it has none; a file whose tokenizer is broken raises its
    GGUFError when the call needs one (text or chat prompts, stop strings, streaming)."""
    try:
        return model.tokenizer
    except (AttributeError, ValueError) as exc:
        from .gguf_file import GGUFError

        rows = prompts if batch else [prompts]
        if isinstance(exc, GGUFError) and (needed or any(_needs_tokenizer(p) for p in rows)):
            raise
        return None


def _check_text_fits(text: str, tokenizer: Any, max_context: Optional[int]) -> None:
    # Encoding a huge text costs memory in proportion (tens of bytes per character in the BPE
    # library, which aborts the process when an allocation fails): refuse, before encoding, a
    # text that cannot fit in max_context tokens anyway.
    per = getattr(tokenizer, "max_token_bytes", None)
    if max_context and isinstance(per, int) and per > 0 and len(text) > max_context * per:
        raise ValueError(f"the prompt has {len(text)} characters, more than max_context={max_context} tokens "
                         f"of this vocabulary can hold (at most {per} bytes each); shorten it")



def _checked_budget_and_stops(max_new_tokens, stop) -> list:
    """Check ``max_new_tokens`` (an integer >= 0) and ``stop`` (a str or strs, none empty);
    returns the stop strings as a list. ValueError naming the argument otherwise."""
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError(f"stop strings must be non-empty str, got {stop!r}")
    return stops


def _checked_prompt_ids(prompt, tokenizer, add_generation_prompt, template_kwargs, max_context) -> list:
    """:func:`_prompt_ids`, then checked: not empty, every id in the vocabulary, no longer than
    ``max_context``; ValueError naming the problem otherwise."""
    ids = _prompt_ids(prompt, tokenizer, add_generation_prompt, template_kwargs, max_context)
    if not ids:
        raise ValueError("empty prompt: give at least one token")
    if tokenizer is not None:
        bad = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})")
    if max_context is not None and len(ids) > max_context:
        raise ValueError(f"the prompt has {len(ids)} tokens but the model's max_context is {max_context}; "
                         "shorten it or load the model with a larger max_context")
    return ids

def _prompt_ids(prompt: Prompt, tokenizer: Any, add_generation_prompt: bool, template_kwargs: dict,
                max_context: Optional[int] = None) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer (model.tokenizer or tokenizer=)")
        _check_text_fits(prompt, tokenizer, max_context)
        return tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
            raise TypeError(f"a token id tensor must be integer [T] or [1, T], got {prompt.dtype} {tuple(prompt.shape)}")
        return [int(i) for i in prompt.tolist()]
    if isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], Mapping):
        if tokenizer is None:
            raise ValueError("chat messages need a tokenizer with a chat template")
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=add_generation_prompt, **template_kwargs)
        _check_text_fits(text, tokenizer, max_context)
        return tokenizer.encode(text, add_special_tokens=False)
    if isinstance(prompt, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        return [int(i) for i in prompt]
    raise TypeError(f"prompt must be a str, token ids or chat messages, got {type(prompt).__name__}")


class _GenerateLock:
    """Serializes generation runs on one model object (its KV cache and sequence position are
    shared state). A second thread waits; the thread already running one (an unfinished
    stream) gets a RuntimeError instead of a deadlock or interleaved caches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: Optional[int] = None

    @contextlib.contextmanager
    def hold(self):
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError("generate() is already running on this model in this thread (an unfinished "
                               "stream=True iterator?); exhaust or close() it before starting another")
        with self._lock:
            self._owner = me
            try:
                yield
            finally:
                self._owner = None


_LOCKS: "weakref.WeakKeyDictionary[Any, _GenerateLock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _generate_lock(model) -> Optional[_GenerateLock]:
    with _LOCKS_GUARD:
        try:
            lock = _LOCKS.get(model)
            if lock is None:
                lock = _LOCKS[model] = _GenerateLock()
        except TypeError:  # not weak-referenceable or unhashable: nothing to key a lock on
            return None
    return lock
