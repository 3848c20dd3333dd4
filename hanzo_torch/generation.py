"""Autoregressive text generation: prefill, token-by-token decode, sampling, stop conditions.

Works with any causal LM module following the hanzo-torch model interface (:class:`CausalLM`):
``model(input_ids int64 [B, T], positions=int64 [B, T], last_only=bool) -> float logits [B, T, V]``
(``[B, 1, V]`` with ``last_only``) that appends the tokens' keys/values to its KV cache,
``model.reset()`` to start a new sequence, and optionally ``model.tokenizer``
(:class:`hanzo_torch.tokenizer.Tokenizer`) and ``model.max_context`` (int).
:class:`SequenceState` gives a model with static KV caches the host-side sequence state behind
that interface (and ``model.generate``).

The prompt is prefilled in one forward; each new token is then fed alone with its position in a
preallocated ``[1, 1]`` device tensor (written in place). On CUDA/HIP, vulkan and the CPU the decode step
is captured once into a graph and replayed per token (:mod:`hanzo_torch.decode_graphs`; ``cuda_graph=False``
turns it off); the prefill always runs eagerly.
Sampling: :mod:`hanzo_torch.sampling`; prompts, stop strings and the result types:
:mod:`hanzo_torch.prompting` (shared with the batched path, :mod:`hanzo_torch.batching`).
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Protocol, Union

import torch

from .batching import generate_batch, is_batch
from .prompting import (  # noqa: F401  (re-exported: part of this module's interface)
    GenerationResult,
    GenerationStats,
    Prompt,
    _checked_budget_and_stops,
    _checked_prompt_ids,
    _generate_lock,
    _model_device,
    _model_tokenizer,
    _stop_holdback,
)
from .sampling import (  # noqa: F401  (re-exported)
    DEFAULT_MIN_P,
    DEFAULT_REPEAT_LAST_N,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    SamplingParams,
    _sample,
    apply_repetition_penalty,
    sample_next,
    truncate_candidates,
)

__all__ = [
    "CausalLM",
    "SequenceState",
    "GenerationStats",
    "GenerationResult",
    "TextStream",
    "SamplingParams",
    "generate",
    "stream_generate",
    "sample_next",
    "apply_repetition_penalty",
    "truncate_candidates",
]


# ---------------------------------------------------------------------- the model interface
class CausalLM(Protocol):
    """What :func:`generate` needs of a model (:class:`torch.nn.Module` subclasses qualify by
    their ``forward``). ``tokenizer`` and ``max_context`` are optional attributes."""

    def __call__(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None, *,
                 last_only: bool = False) -> torch.Tensor:
        """Logits ``[B, T, V]`` (``[B, 1, V]`` with ``last_only``) of int64 ``input_ids [B, T]`` at
        ``positions [B, T]``; their keys/values are appended to the model's KV cache."""

    def reset(self) -> None:
        """Start a new sequence."""


class SequenceState:
    """Host-side sequence state and generation conveniences of a model with static KV caches
    (a mixin of :class:`hanzo_torch.models.qwen.Transformer`).

    The model provides ``max_context`` (int), ``device`` and ``init_kv_cache(batch_size)``
    (allocate its caches for ``batch_size`` sequences), and optionally ``gguf`` (the
    :class:`~hanzo_torch.GGUFFile` its tokenizer comes from). Its forward calls
    :meth:`next_positions` first.

    Attributes:
        cache_batch_size: batch size the KV caches are allocated for (0: none yet).
        seq_len: tokens fed since :meth:`reset` (None when unknown: after explicit positions on
            an accelerator, which are not read back to the host).
    """

    cache_batch_size: int = 0
    seq_len: Optional[int] = 0
    gguf: Any = None
    _tokenizer: Any = None

    def setup_cache(self, batch_size: int) -> None:
        """Allocate the static KV caches for ``batch_size`` sequences (zeros) and :meth:`reset`.

        The forward calls it when the batch size changes at the start of a sequence; call it
        yourself before capturing a graph so the cache address is fixed.
        """
        self.init_kv_cache(batch_size)
        self.cache_batch_size = batch_size
        self.seq_len = 0

    def reset(self) -> None:
        """Start a new sequence (the cache is kept; slots past a query's position are masked)."""
        self.seq_len = 0

    def next_positions(self, B: int, T: int, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The positions ``[B, T]`` of the next ``T`` tokens of ``B`` sequences, on the model's
        device, after the bookkeeping every forward needs: KV caches for ``B`` (allocated at the
        start of a sequence), and :attr:`seq_len` advanced.

        Args:
            positions: integer ``[B, T]`` given by the caller (kept, moved to the device), or None:
                continue after the :attr:`seq_len` tokens fed so far.

        Raises:
            ValueError: the sequence would exceed ``max_context`` (checked on the host for
                ``positions=None`` and for CPU positions), ``positions`` not ``[B, T]``, a batch
                size change mid-sequence, or ``positions=None`` when :attr:`seq_len` is unknown.
        """
        if B != self.cache_batch_size:
            if self.seq_len != 0:
                raise ValueError(
                    f"batch size {B} differs from the current sequence's {self.cache_batch_size}; call reset() first"
                )
            self.setup_cache(B)
        if positions is None:
            start = self.seq_len
            if start is None:
                raise ValueError("the sequence position is unknown after a call with explicit positions on "
                                 f"{self.device.type}; pass positions or call reset()")
            if start + T > self.max_context:
                raise ValueError(
                    f"context overflow: {start} + {T} tokens exceed max_context={self.max_context}; "
                    "call reset() or load with a larger max_context"
                )
            self.seq_len = start + T
            # one op (arange, then an add of start, were two device dispatches per decode step)
            return torch.arange(start, start + T, device=self.device).unsqueeze(0).expand(B, T)
        if positions.shape != (B, T):
            raise ValueError(f"positions must be [B, T] = [{B}, {T}], got {tuple(positions.shape)}")
        if positions.device.type == "cpu" and not torch.compiler.is_compiling():
            # free on the host; on an accelerator (or in a traced graph) it would sync: the ops check there
            hi = int(positions.max()) if positions.numel() else -1
            if hi >= self.max_context or (positions.numel() and int(positions.min()) < 0):
                raise ValueError(f"context overflow: position {hi} is outside [0, max_context={self.max_context})")
            self.seq_len = hi + 1
        else:
            self.seq_len = None
        return positions.to(self.device)

    @property
    def tokenizer(self):
        """The file's tokenizer (:class:`hanzo_torch.tokenizer.Tokenizer`), built and checked by
        :func:`~hanzo_torch.load` (a file without ``tokenizer.ggml.merges`` has none: asking for
        it raises TokenizerError naming the file; a model not loaded from a file: ValueError)."""
        if self._tokenizer is None:
            from .tokenizer import Tokenizer

            if self.gguf is None:
                raise ValueError("this model was not loaded from a GGUF file; it has no tokenizer")
            self._tokenizer = Tokenizer.from_gguf(self.gguf)
        return self._tokenizer

    def generate(self, prompt_or_ids, max_new_tokens: int = 256, **kwargs):
        """Sample a continuation: :func:`generate` applied to this model."""
        return generate(self, prompt_or_ids, max_new_tokens=max_new_tokens, **kwargs)


class TextStream:
    """Iterator over generated text pieces (``str``), from ``generate(..., stream=True)``.

    After it is exhausted, :attr:`result` holds the :class:`GenerationResult` and :attr:`stats`
    its stats (partial stats are available during iteration).
    """

    def __init__(self, gen: Iterator[str], stats: GenerationStats, result_box: list):
        self._gen = gen
        self._box = result_box
        self.stats = stats
        self.result: Optional[GenerationResult] = None

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        try:
            return next(self._gen)
        except StopIteration:
            if self._box:
                self.result = self._box[0]
            raise

    def close(self) -> None:
        self._gen.close()


def generate(model: CausalLM, prompt_or_ids: Prompt, max_new_tokens: int = 256, *,
             temperature: float = DEFAULT_TEMPERATURE, top_k: int = DEFAULT_TOP_K, top_p: float = DEFAULT_TOP_P,
             min_p: float = DEFAULT_MIN_P, repetition_penalty: float = 1.0,
             repeat_last_n: int = DEFAULT_REPEAT_LAST_N, seed: Optional[int] = None,
             stop: Union[str, Sequence[str], None] = None, stream: bool = False, ignore_eos: bool = False,
             tokenizer: Any = None, skip_special_tokens: bool = True,
             add_generation_prompt: bool = True, cuda_graph: bool = True, n_parallel: Optional[int] = None,
             **template_kwargs: Any) -> Union[GenerationResult, TextStream, list]:
    """Generate a continuation of a prompt with ``model``.

    Args:
        model: a causal LM following the hanzo-torch model interface (:class:`CausalLM`).
        prompt_or_ids: text (encoded with the tokenizer, BOS added when the GGUF asks), token ids
            (list of ints or a 1-D / ``[1, T]`` integer tensor), or chat messages
            (``[{"role": ..., "content": ...}]``, rendered with the chat template;
            ``add_generation_prompt`` and extra keyword arguments such as
            ``enable_thinking=False`` go to the template).
        max_new_tokens: limit on generated tokens (>= 0); also clipped to the model's
            ``max_context``.
        temperature, top_k, top_p, min_p, repetition_penalty, repeat_last_n: see
            :class:`SamplingParams` (defaults are llama.cpp's).
        seed: seed of this call's own ``torch.Generator``; None draws one (recorded in
            ``stats.seed``). The same seed, prompt and model give the same tokens.
        stop: string(s) that end generation; the text is cut before the first one found, which
            is not included.
        stream: return a :class:`TextStream` yielding text pieces as they decode (never a partial
            UTF-8 character, never text that could be the start of a stop string).
        ignore_eos: keep going past end-of-generation tokens (for benchmarks).
        tokenizer: overrides ``model.tokenizer`` (needed for text prompts, text output and stop
            strings).
        skip_special_tokens: leave control tokens out of the text.
        cuda_graph: where the model's backend has graphs (CUDA/HIP, vulkan, the CPU), capture the
            decode step into a graph once (per batch size, KV cache and module tree) and replay it
            for every token; ignored on other devices (``HANZO_VK_GRAPH=0`` / ``HANZO_CPU_GRAPH=0``
            at import also turn it off). If the capture fails (on the CPU: anything but the hanzo
            ops and views between them, as MoE and LoRA steps, or forward hooks on the model), a
            RuntimeWarning says why, once per model and batch size, and decode runs eagerly.

        n_parallel: for a batch, the KV-cache slots decoded at once (default: one per prompt).

    A list of prompts (texts, token-id lists, chat message lists) is a batch: see
    :func:`hanzo_torch.batching.generate_batch` (one result per prompt; ``stream`` yields
    ``(row, text)``; an int ``seed`` seeds row i with ``seed + i``).

    Returns:
        :class:`GenerationResult`, or a :class:`TextStream` when ``stream``; for a batch a list
        of :class:`GenerationResult` or a :class:`~hanzo_torch.batching.BatchTextStream`.

    Thread safety: runs on one model object are serialized (a per-model lock held while the
    tokens are computed; for ``stream=True`` from the first ``next()`` until the stream ends
    or is closed): a second thread waits for the first. Starting a second run in the thread
    whose stream is still open raises RuntimeError. Model objects loaded separately run in
    parallel. Direct ``model(...)`` calls are not locked.

    Stops at the first of: an end-of-generation token (the tokenizer's ``eos_token_ids``, such
    as ``<|im_end|>`` and ``<|endoftext|>``) -> ``stop_reason "eos"``; a stop string -> "stop";
    ``max_new_tokens`` -> "length"; the model's ``max_context`` -> "context".

    Raises:
        ValueError: bad sampling parameters, an empty prompt, a prompt that does not fit in
            ``max_context`` (a text longer than ``max_context`` tokens can hold is refused before
            it is encoded), non-finite logits of a model not loaded from a file; TypeError: an
            unsupported prompt type.
        GGUFError: the logits of a model loaded from a file turned non-finite (naming the file).
        RuntimeError: this thread already has an unfinished run on ``model``.
    """
    if is_batch(prompt_or_ids):
        return generate_batch(model, prompt_or_ids, max_new_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                              repeat_last_n=repeat_last_n, seed=seed, stop=stop, stream=stream,
                              ignore_eos=ignore_eos, tokenizer=tokenizer, skip_special_tokens=skip_special_tokens,
                              add_generation_prompt=add_generation_prompt, cuda_graph=cuda_graph,
                              n_parallel=n_parallel, **template_kwargs)
    params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty, repeat_last_n)
    stops = _checked_budget_and_stops(max_new_tokens, stop)

    if tokenizer is None:
        tokenizer = _model_tokenizer(model, prompt_or_ids, bool(stops or stream))
    if stops and tokenizer is None:
        raise ValueError("stop strings need a tokenizer (model.tokenizer or tokenizer=)")
    max_context = getattr(model, "max_context", None)
    prompt_ids = _checked_prompt_ids(prompt_or_ids, tokenizer, add_generation_prompt, template_kwargs, max_context)

    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") & (2**63 - 1)
    stats = GenerationStats(prompt_tokens=len(prompt_ids), seed=seed)
    result_box: list[GenerationResult] = []
    gen = _run(model, prompt_ids, int(max_new_tokens), params, seed, stops, tokenizer, ignore_eos,
               skip_special_tokens, max_context, stats, result_box, cuda_graph)
    if stream:
        if tokenizer is None:
            raise ValueError("stream=True needs a tokenizer (model.tokenizer or tokenizer=)")
        return TextStream(gen, stats, result_box)
    for _ in gen:
        pass
    return result_box[0]


def stream_generate(model: CausalLM, prompt_or_ids: Prompt, max_new_tokens: int = 256,
                    **kwargs: Any) -> TextStream:
    """``generate(..., stream=True)``: an iterator of text pieces with ``.stats``/``.result``."""
    return generate(model, prompt_or_ids, max_new_tokens, stream=True, **kwargs)


def _run(model, *args) -> Iterator[str]:
    lock = _generate_lock(model)
    if lock is None:
        yield from _run_unlocked(model, *args)
        return
    with lock.hold():
        yield from _run_unlocked(model, *args)


def _backend_profiler(device: torch.device):
    """The profile counters of ``device``'s backend (``Backend.profile``: counters since the last
    call) when it collects them (the vulkan one with ``HANZO_VK_PROFILE=1``), else None."""
    from . import backends

    b = backends.for_device(device)
    return b.profile if b.profiling() else None


def _run_unlocked(model, prompt_ids, max_new_tokens, params, seed, stops, tokenizer, ignore_eos, skip_special,
                  max_context, stats: GenerationStats, result_box: list, cuda_graph: bool = True) -> Iterator[str]:
    from .decode_graphs import DecodeStep

    device = _model_device(model)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    eos_ids = frozenset() if ignore_eos or tokenizer is None else frozenset(tokenizer.eos_token_ids)
    budget = max_new_tokens
    context_bound = False
    if max_context is not None and len(prompt_ids) + max_new_tokens - 1 > max_context:
        budget = max_context - len(prompt_ids) + 1  # the last sampled token is never fed back
        context_bound = True
    decoder = tokenizer.incremental_decoder(skip_special_tokens=skip_special) if tokenizer is not None else None
    max_stop = max((len(s) for s in stops), default=0)

    history = list(prompt_ids)  # for the repetition penalty
    out_ids: list[int] = []
    text = ""  # decoded so far (stop string not yet cut)
    emitted = 0  # chars of text already yielded
    stop_reason = None

    if budget == 0:
        stats.stop_reason = "context" if context_bound else "length"
        result_box.append(GenerationResult("", [], stats))
        return

    backend_profile = _backend_profiler(device)
    with torch.inference_mode():
        model.reset()
        if backend_profile is not None:
            backend_profile()  # counters from here on
            stats.vulkan_profile = {}
        t0 = time.perf_counter()
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        pos = torch.arange(len(prompt_ids), dtype=torch.long, device=device).unsqueeze(0)
        logits = model(ids, positions=pos, last_only=True)[0, -1]
        token = _sample(model, logits, params, generator, history)
        stats.prefill_s = time.perf_counter() - t0
        if backend_profile is not None:
            stats.vulkan_profile["prefill"] = backend_profile()

        step = DecodeStep(model, 1, device, cuda_graph, last_only=True)  # [1, 1] id/position buffers
        while True:
            if token in eos_ids:
                stop_reason = "eos"
                break
            out_ids.append(token)
            history.append(token)
            stats.generated_tokens = len(out_ids)
            if decoder is not None:
                text += decoder.push(token)
                if stops:
                    lo = max(0, emitted - max_stop + 1)
                    cut = min((p for p in (text.find(s, lo) for s in stops) if p >= 0), default=-1)
                    if cut >= 0:
                        text = text[:cut]
                        stop_reason = "stop"
                        break
                    hold = _stop_holdback(text, stops)
                else:
                    hold = 0
                if len(text) - hold > emitted:
                    piece = text[emitted:len(text) - hold]
                    emitted = len(text) - hold
                    yield piece  # the consumer's time is not counted in the stats
            if len(out_ids) >= budget:
                stop_reason = "context" if context_bound else "length"
                break
            t1 = time.perf_counter()
            step.input_ids.fill_(token)
            step.positions.fill_(len(prompt_ids) + len(out_ids) - 1)
            logits = step()[0, -1]
            token = _sample(model, logits, params, generator, history)  # waits for the device
            stats.cuda_graph = step.graphed
            stats.decode_s += time.perf_counter() - t1
            stats.decode_steps += 1
            if backend_profile is not None:
                p = backend_profile()
                if stats.decode_steps == 1:
                    stats.vulkan_profile["first_decode"] = p
                else:
                    acc = stats.vulkan_profile.setdefault("decode", dict.fromkeys(p, 0))
                    for k, v in p.items():
                        acc[k] += v
    if decoder is not None and stop_reason != "stop":
        text += decoder.flush()
    if len(text) > emitted:
        yield text[emitted:]
    stats.stop_reason = stop_reason
    result_box.append(GenerationResult(text, out_ids, stats))
