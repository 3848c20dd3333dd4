"""Continuous batching: many sequences decoded together, one KV-cache row ("slot") each.

:class:`BatchEngine` owns a model's KV caches allocated for ``n_slots`` rows. A sequence is
prefilled alone in a free slot (``model.kv_slots(slot, slot + 1)``: the same computation as a
single-sequence run), then joins the shared decode step: one forward of the rows ``[0, n)``,
``n`` the highest busy slot + 1, each row at its own position. ``hanzo::attention`` masks cache
slots past a query's position per row, so rows of different lengths never see each other's
tokens nor stale keys of an earlier occupant of their slot (each step writes its key before it
attends). Free rows inside ``[0, n)`` are fed token 0 at position 0 of their own row, which the
next occupant's prefill overwrites. Slots are handed out lowest first so ``n`` stays small; a
sequence that ends frees its slot at once for the next one waiting.

Each sequence has its own sampler state (``torch.Generator``, repetition-penalty history), stop
strings, end-of-generation tokens, token budget and incremental text decoder, exactly as
:func:`hanzo_torch.generation.generate` runs them for one prompt.

:func:`generate_batch` is ``model.generate([prompt, ...])``; :mod:`hanzo_torch.server` drives an
engine from its model worker thread.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

import torch

from .prompting import (
    GenerationResult,
    GenerationStats,
    _checked_budget_and_stops,
    _checked_prompt_ids,
    _generate_lock,
    _model_device,
    _model_tokenizer,
    _stop_holdback,
)
from .sampling import SamplingParams, sample_next

__all__ = ["BatchEngine", "BatchSequence", "BatchTextStream", "generate_batch", "is_batch"]


class BatchSequence:
    """One sequence of a :class:`BatchEngine`: its prompt, sampler state and output so far.

    Attributes:
        prompt_ids: the prompt's token ids.
        token_ids: generated ids (an end-of-generation token excluded).
        text: the text decoded so far (a stop string cut off once found).
        stats: its :class:`~hanzo_torch.prompting.GenerationStats` (``stop_reason`` is set when it
            ends; ``"cancelled"`` after :meth:`BatchEngine.cancel`, ``"error"`` when sampling failed).
        slot: its KV-cache row while it runs, else None.
        finished: generation has ended (text complete).
        error: the exception that ended it, if any (non-finite logits).
        logits: with ``keep_logits``, the float32 ``[V]`` logits each token was sampled from.
        tag: anything the caller attaches (the server's request).
    """

    def __init__(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int,
                 stops: Sequence[str], tokenizer: Any, ignore_eos: bool, skip_special_tokens: bool,
                 max_context: Optional[int], keep_logits: bool = False, tag: Any = None):
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.stops = list(stops)
        self.tokenizer = tokenizer
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.eos_ids = frozenset() if ignore_eos or tokenizer is None else frozenset(tokenizer.eos_token_ids)
        self.budget, self.context_bound = max_new_tokens, False
        if max_context is not None and len(prompt_ids) + max_new_tokens - 1 > max_context:
            self.budget, self.context_bound = max_context - len(prompt_ids) + 1, True
        self.decoder = tokenizer.incremental_decoder(skip_special_tokens=skip_special_tokens) if tokenizer else None
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.history = list(prompt_ids)
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), seed=seed)
        self.slot: Optional[int] = None
        self.finished = False
        self.error: Optional[BaseException] = None
        self.logits: Optional[list[torch.Tensor]] = [] if keep_logits else None
        self.next_token: Optional[int] = None  # sampled, not yet fed to the model
        self.tag = tag
        self.source = "the model"  # its file, set by BatchEngine.add

    @property
    def position(self) -> int:
        """Position of :attr:`next_token` in the sequence."""
        return len(self.prompt_ids) + len(self.token_ids) - 1

    @property
    def result(self) -> GenerationResult:
        return GenerationResult(self.text, list(self.token_ids), self.stats)

    def _sample(self, logits: torch.Tensor) -> Optional[int]:
        if self.logits is not None:
            self.logits.append(logits.detach().float().cpu().clone())
        try:
            return sample_next(logits, self.params, self.generator, self.history)
        except ValueError as exc:
            from .gguf_file import GGUFError

            self.error = GGUFError(f"{self.source}: {exc} (at position {self.position + 1} of a "
                                   "sequence): the weights overflow the compute dtype")
            self._finish("error")
            return None

    def _finish(self, reason: str) -> str:
        """End the sequence; returns the text not yet emitted."""
        if self.decoder is not None and reason not in ("stop", "error", "cancelled"):
            self.text += self.decoder.flush()
        self.stats.stop_reason = reason
        self.finished = True
        piece = self.text[self.emitted:] if reason != "error" else ""
        self.emitted = len(self.text)
        return piece

    def _push(self, token: int) -> str:
        """Account a sampled token (as :func:`generate` does); returns the text it releases."""
        if token in self.eos_ids:
            return self._finish("eos")
        self.token_ids.append(token)
        self.history.append(token)
        self.stats.generated_tokens = len(self.token_ids)
        piece = ""
        if self.decoder is not None:
            self.text += self.decoder.push(token)
            hold = 0
            if self.stops:
                lo = max(0, self.emitted - self.max_stop + 1)
                cut = min((p for p in (self.text.find(s, lo) for s in self.stops) if p >= 0), default=-1)
                if cut >= 0:
                    self.text = self.text[:cut]
                    return self._finish("stop")
                hold = _stop_holdback(self.text, self.stops)
            if len(self.text) - hold > self.emitted:
                piece = self.text[self.emitted:len(self.text) - hold]
                self.emitted = len(self.text) - hold
        if len(self.token_ids) >= self.budget:
            return piece + self._finish("context" if self.context_bound else "length")
        self.next_token = token
        return piece


class BatchEngine:
    """Decode many :class:`BatchSequence` s together on one model, one KV-cache slot each.

    Args:
        model: a model with static KV caches and ``kv_slots`` (what :func:`hanzo_torch.load`
            returns). The engine allocates its caches for ``n_slots`` rows (``setup_cache``);
            the caller keeps other users off the model while the engine is in use (the server's
            worker thread owns it; :func:`generate_batch` holds the model's generate lock).
        n_slots: how many sequences decode at once (llama-server's ``-np``), >= 1.
        cuda_graph: capture the decode step per batch size (CUDA/HIP, vulkan, the CPU), as ``generate``.

    Raises:
        TypeError: ``model`` has no ``kv_slots`` (not a hanzo-torch model).
        ValueError: ``n_slots`` < 1.
        NotImplementedError: a tensor-parallel model (``model.tp``): its ranks would have to agree on
            which sequence joins which slot at every step; one prompt at a time works there.
    """

    def __init__(self, model: Any, n_slots: int, cuda_graph: bool = True):
        if not hasattr(model, "kv_slots") or not hasattr(model, "setup_cache"):
            raise TypeError(f"batched generation needs a model with KV-cache slots (hanzo_torch.load's models), "
                            f"got {type(model).__name__}")
        if getattr(model, "tp", None) is not None:
            raise NotImplementedError("batched generation and the server do not run a tensor-parallel model "
                                      "(loaded with tensor_parallel=True / tp_group=): generate one prompt at a time")
        if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1:
            raise ValueError(f"n_slots must be an integer >= 1, got {n_slots!r}")
        self.model = model
        self.n_slots = n_slots
        self.cuda_graph = cuda_graph
        self.device = _model_device(model)
        self.slots: list[Optional[BatchSequence]] = [None] * n_slots
        self.waiting: deque[BatchSequence] = deque()
        self._steps: dict[int, Any] = {}
        gguf = getattr(model, "gguf", None)
        self.source = str(getattr(gguf, "path", None) or f"the {type(model).__name__} model")
        model.setup_cache(n_slots)

    @property
    def busy(self) -> int:
        """Sequences holding a slot."""
        return sum(s is not None for s in self.slots)

    def free_slots(self) -> int:
        return self.slots.count(None)

    def add(self, seq: BatchSequence) -> None:
        """Queue ``seq``; it takes the lowest free slot at the next :meth:`step`."""
        seq.source = self.source
        self.waiting.append(seq)

    def cancel(self, seq: BatchSequence) -> None:
        """End ``seq`` now (``stop_reason "cancelled"``), freeing its slot or queue place."""
        if seq.finished:
            return
        seq._finish("cancelled")
        if seq.slot is not None:
            self.slots[seq.slot] = None
            seq.slot = None
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _prefill(self, seq: BatchSequence, slot: int) -> str:
        t0 = time.perf_counter()
        ids = torch.tensor([seq.prompt_ids], dtype=torch.long, device=self.device)
        pos = torch.arange(len(seq.prompt_ids), dtype=torch.long, device=self.device).unsqueeze(0)
        with self.model.kv_slots(slot, slot + 1):
            logits = self.model(ids, positions=pos, last_only=True)[0, -1]
        token = seq._sample(logits)
        seq.stats.prefill_s = time.perf_counter() - t0
        return "" if token is None else seq._push(token)

    def step(self) -> list[tuple[BatchSequence, str]]:
        """Admit waiting sequences into free slots (prefill each), then run one decode step of all
        running ones. Returns ``(sequence, text piece)`` for every sequence that advanced or
        ended in this step (the piece may be empty); ended ones have ``finished`` set and their
        slot freed."""
        out: list[tuple[BatchSequence, str]] = []
        with torch.inference_mode():
            while self.waiting and None in self.slots:
                seq = self.waiting.popleft()
                slot = self.slots.index(None)
                self.slots[slot], seq.slot = seq, slot
                out.append((seq, self._prefill(seq, slot)))
                if seq.finished:
                    self.slots[slot], seq.slot = None, None
            running = [(i, s) for i, s in enumerate(self.slots) if s is not None]
            if not running:
                return out
            n = running[-1][0] + 1
            ids = [0] * n
            pos = [0] * n
            for i, s in running:
                ids[i], pos[i] = s.next_token, s.position
            t1 = time.perf_counter()
            with self.model.kv_slots(0, n):
                step = self._steps.get(n)
                if step is None:
                    from .decode_graphs import DecodeStep

                    step = self._steps[n] = DecodeStep(self.model, n, self.device, self.cuda_graph, last_only=True)
                step.input_ids.copy_(torch.tensor(ids, dtype=torch.long).view(n, 1))
                step.positions.copy_(torch.tensor(pos, dtype=torch.long).view(n, 1))
                logits = step()[:, -1].float().cpu()  # [n, V]
            dt = time.perf_counter() - t1
            for i, s in running:
                s.stats.decode_s += dt
                s.stats.decode_steps += 1
                s.stats.cuda_graph = step.graphed
                token = s._sample(logits[i])
                piece = "" if token is None else s._push(token)
                out.append((s, piece))
                if s.finished:
                    self.slots[i], s.slot = None, None
        return out

    def idle(self) -> bool:
        return not self.waiting and self.busy == 0


# ---------------------------------------------------------------------- model.generate([...])
def is_batch(prompt: Any) -> bool:
    """True for a list/tuple of prompts (texts, token-id lists or tensors, chat message lists),
    False for one prompt (a text, a token-id list, a tensor, one chat message list)."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    first = prompt[0]
    return isinstance(first, (str, torch.Tensor)) or (isinstance(first, (list, tuple)))


class BatchTextStream:
    """Iterator of ``(row, text piece)`` from ``generate([...], stream=True)``; :attr:`results`
    holds one :class:`~hanzo_torch.prompting.GenerationResult` per prompt once it is exhausted."""

    def __init__(self, gen: Iterator[tuple[int, str]], seqs: list[BatchSequence]):
        self._gen = gen
        self._seqs = seqs
        self.results: Optional[list[GenerationResult]] = None

    def __iter__(self) -> "BatchTextStream":
        return self

    def __next__(self) -> tuple[int, str]:
        try:
            return next(self._gen)
        except StopIteration:
            self.results = [s.result for s in self._seqs]
            raise

    def close(self) -> None:
        self._gen.close()


def generate_batch(model: Any, prompts: Sequence[Any], max_new_tokens: int = 256, *,
                   temperature: float, top_k: int, top_p: float, min_p: float, repetition_penalty: float,
                   repeat_last_n: int, seed: Union[int, Sequence[int], None] = None,
                   stop: Union[str, Sequence[str], None] = None, stream: bool = False, ignore_eos: bool = False,
                   tokenizer: Any = None, skip_special_tokens: bool = True, add_generation_prompt: bool = True,
                   cuda_graph: bool = True, n_parallel: Optional[int] = None,
                   **template_kwargs: Any) -> Union[list[GenerationResult], BatchTextStream]:
    """``generate(model, [prompt, ...])``: one :class:`GenerationResult` per prompt, in order.

    The arguments are :func:`hanzo_torch.generation.generate`'s, applied to every row, plus:
    ``seed`` an int (row i draws from ``seed + i``), a sequence of one seed per prompt, or None
    (drawn); ``n_parallel`` the KV-cache slots (rows decoded at once; default: one per prompt;
    with fewer, the other prompts wait for a slot to free). With ``stream=True`` returns a
    :class:`BatchTextStream` of ``(row, text piece)``.

    Raises:
        ValueError/TypeError: as ``generate`` for any prompt (naming its row), a bad ``seed``
            list or ``n_parallel``; TypeError: a model without KV-cache slots.
        GGUFError: a row's logits turned non-finite (naming the model's file).
    """
    params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty, repeat_last_n)
    stops = _checked_budget_and_stops(max_new_tokens, stop)
    if tokenizer is None:
        tokenizer = _model_tokenizer(model, prompts, bool(stops or stream), batch=True)
    if (stops or stream) and tokenizer is None:
        raise ValueError("stop strings and stream=True need a tokenizer (model.tokenizer or tokenizer=)")
    n = len(prompts)
    if seed is None:
        seeds = [int.from_bytes(os.urandom(8), "little") & (2**63 - 1) for _ in range(n)]
    elif isinstance(seed, int) and not isinstance(seed, bool):
        seeds = [seed + i for i in range(n)]
    else:
        seeds = list(seed)
        if len(seeds) != n or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds):
            raise ValueError(f"seed must be an int or one int per prompt ({n}), got {seed!r}")
    slots = n if n_parallel is None else n_parallel
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"n_parallel must be an integer >= 1, got {n_parallel!r}")
    max_context = getattr(model, "max_context", None)
    seqs = []
    for row, prompt in enumerate(prompts):
        try:
            ids = _checked_prompt_ids(prompt, tokenizer, add_generation_prompt, template_kwargs, max_context)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"prompt {row}: {exc}") from None
        seqs.append(BatchSequence(ids, int(max_new_tokens), params, seeds[row], stops, tokenizer, ignore_eos,
                                  skip_special_tokens, max_context))
    gen = _run_batch(model, seqs, min(slots, n), cuda_graph)
    if stream:
        return BatchTextStream(gen, seqs)
    for _ in gen:
        pass
    return [s.result for s in seqs]


def _run_batch(model: Any, seqs: list[BatchSequence], n_slots: int, cuda_graph: bool) -> Iterator[tuple[int, str]]:
    lock = _generate_lock(model)
    row_of = {id(s): i for i, s in enumerate(seqs)}
    with (lock.hold() if lock is not None else contextlib.nullcontext()):
        engine = BatchEngine(model, n_slots, cuda_graph)
        if hasattr(model, "reset"):
            model.reset()
        for s in seqs:
            if s.budget == 0:
                s._finish("context" if s.context_bound else "length")
            else:
                engine.add(s)
        while not engine.idle():
            for s, piece in engine.step():
                if s.error is not None:
                    raise s.error
                if piece:
                    yield row_of[id(s)], piece


