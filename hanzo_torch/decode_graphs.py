"""Decode under device graphs: capture one decode step per batch size, replay it per token.

A decode step is ``model(input_ids[B, 1], positions=positions[B, 1], **kwargs)`` with both
inputs in preallocated device buffers that are written in place before each step. The step is
captured once by the backend serving the device (``Backend.capture``: a ``torch.cuda.CUDAGraph``
on CUDA/HIP, a ``torch.vulkan.VulkanGraph`` on ``"vulkan"``, one recorded command buffer
submitted once per token, a CPU graph of the step's C++ kernels on the CPU,
:func:`hanzo_torch.backends.cpu.capture`) and replayed afterwards: the kernels, the KV cache addresses and the logits buffer are fixed at
capture, and only the contents of the two input buffers change. This is
correct only because the model reads the position from the ``positions`` tensor on the device
(RoPE, KV-cache write, attention mask) and never from a Python value: a position baked in at
capture would make every replay run at the warm-up position.

:class:`DecodeStep` is what :func:`hanzo_torch.generation.generate` uses: eager where the
backend has no graphs (``cuda_graph=False``, ``HANZO_VK_GRAPH=0`` on vulkan, ``HANZO_CPU_GRAPH=0``
on the CPU), captured where it has (``hanzo_torch.cuda_graphs`` is an alias of this module).
Captured graphs are cached on the model, keyed by batch size, forward keyword arguments, the
addresses of the model's buffers (the KV caches) and its module tree with its hooks: a cache
reallocated by ``setup_cache`` (whose old graph is then dropped), a layer swapped in (PEFT's LoRA
layers) or a hook added make a new capture. Python attributes the forward reads (``attn_impl``,
``ubatch``) are fixed at capture: call :func:`clear_graphs` after changing them. A capture that
fails is remembered too, so a step that cannot be captured warns once and then runs eagerly.

:func:`layer_probe` records each decoder layer's output into static buffers (also inside a
captured graph), so a replay that differs from eager can be traced to the first layer that
differs.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Optional

import torch

from .backends.base import CaptureRejected

__all__ = ["DecodeStep", "CapturedDecode", "graphs_supported", "layer_probe", "clear_graphs"]

WARMUP_STEPS = 2
"""Eager steps run before capture (on CUDA on a side stream: Triton JIT compiles and caches
format tables there, so nothing in the captured step allocates host memory or compiles). The CPU
backend runs none: its capture is itself an eager run of the step."""

_CACHE_ATTR = "_hanzo_decode_graphs"
_FAILED = object()  # the cache's entry for a step whose capture failed


def graphs_supported(device: torch.device) -> bool:
    """True when the backend serving ``device`` can capture graphs there now
    (``Backend.graphs_supported``: a CUDA/HIP device with CUDA graphs; the ``"vulkan"`` device with
    its backend available and ``hanzo_torch.backends.vulkan.GRAPHS`` on; the CPU with its C++
    extension built and ``hanzo_torch.backends.cpu.GRAPHS`` on)."""
    from . import backends

    device = torch.device(device)
    return backends.for_device(device).graphs_supported(device)


def _synchronize(device: torch.device) -> None:
    from . import backends

    backends.for_device(device).synchronize(device)


def _state_key(model: torch.nn.Module) -> tuple:
    # buffer addresses: the KV caches a captured graph writes must be the ones the model holds now;
    # and the module tree with its hooks: a layer swapped in (PEFT's LoRA layers) or a hook added
    # after a capture changes what a step runs
    buffers = tuple(b.data_ptr() for b in model.buffers() if b is not None)
    modules = tuple((id(m), tuple(m._forward_hooks), tuple(m._forward_pre_hooks)) for m in model.modules())
    return buffers, modules


def _hooked(model: torch.nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def clear_graphs(model: torch.nn.Module) -> None:
    """Drop the decode graphs captured for ``model`` (their memory pools are freed with them)."""
    if hasattr(model, _CACHE_ATTR):
        delattr(model, _CACHE_ATTR)


class CapturedDecode:
    """One decode step of ``model`` captured into a graph by the backend of its device.

    ``input_ids`` and ``positions`` (int64 ``[B, 1]`` on the model's device) are the static
    inputs, ``logits`` (float32 ``[B, 1, V]``) the static output; :meth:`replay` runs the step
    on whatever the input buffers hold.

    Capture writes nothing visible: the warm-up steps are real forwards, so the caller fills the
    input buffers with the step it is about to run (its keys/values are then written by the
    warm-up exactly as the replay writes them again).
    """

    def __init__(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                 kwargs: dict, warmup: int = WARMUP_STEPS):
        from . import backends

        self.input_ids = input_ids
        self.positions = positions
        self.device = input_ids.device
        if self.device.type == "cpu" and _hooked(model):
            # a CPU graph replays C++ kernels only: a hook's Python would silently not run
            raise RuntimeError("the model has forward hooks, which a CPU graph's replay would skip")
        cap = backends.for_device(self.device).capture(
            self.device, lambda: model(input_ids, positions=positions, **kwargs), warmup)
        self._replay = cap.replay
        self.logits = cap.output
        self.executed = cap.executed  # the capture ran the step, and logits hold its result

    def replay(self) -> torch.Tensor:
        """Run the captured step; returns the static logits buffer (overwritten by the next replay)."""
        self._replay()
        return self.logits


class DecodeStep:
    """The decode step of :func:`~hanzo_torch.generation.generate`: owns the ``[B, 1]`` input id
    and position buffers and runs the model on them, replaying a captured graph when it can.

    Args:
        model: a module following the hanzo-torch model interface (``forward(input_ids,
            positions=..., **kwargs)``), with its KV cache already allocated for ``batch_size``
            (the prefill does that).
        batch_size: B.
        device: where the model runs.
        cuda_graph: capture and replay where the device's backend has graphs (CUDA/HIP, vulkan,
            the CPU; ignored elsewhere; ``HANZO_VK_GRAPH=0`` on vulkan and ``HANZO_CPU_GRAPH=0`` on
            the CPU, at import, turn it off too).
        kwargs: extra keyword arguments of every decode forward (``last_only=True``).

    Call :meth:`__call__` after writing ``input_ids`` and ``positions`` (in place) to get the
    float32 logits ``[B, 1, V]``; with a graph they live in a static buffer that the next step
    overwrites, so copy what must outlive it. ``graphed`` says whether replay is in use. If
    capture raises (an op that synchronizes with the host, say), a RuntimeWarning names the
    error and this step stays eager.
    """

    def __init__(self, model: torch.nn.Module, batch_size: int, device: torch.device, cuda_graph: bool = True,
                 **kwargs: Any):
        self.model = model
        self.kwargs = kwargs
        self.device = torch.device(device)
        self.use_graph = bool(cuda_graph) and graphs_supported(self.device)
        self.graphed = False
        self._captured: Optional[CapturedDecode] = None
        self._buffer_slots: Optional[list] = None  # (module._buffers, name, address at capture)
        key = (batch_size, tuple(sorted(kwargs.items())), _state_key(model)) if self.use_graph else None
        self._key = key
        if self.use_graph:
            cached = getattr(model, _CACHE_ATTR, {}).get(key)
            if cached is _FAILED:  # this step failed to capture before (and said why): eager, silently
                self.use_graph = False
            elif cached is not None:
                self._captured = cached
                self._note_buffers()
                self.input_ids, self.positions = cached.input_ids, cached.positions
                return
        self.input_ids = torch.zeros((batch_size, 1), dtype=torch.long, device=self.device)
        self.positions = torch.zeros((batch_size, 1), dtype=torch.long, device=self.device)

    def _host_bookkeeping(self) -> None:
        # Positions on the host: a replay skips the forward's Python, so the checks and the
        # sequence length that next_positions does in an eager step are done here, before the
        # kernels run (on an accelerator the positions stay on the device and the ops check them).
        if self.positions.device.type == "cpu":
            next_positions = getattr(self.model, "next_positions", None)
            if next_positions is not None:
                next_positions(*self.positions.shape, self.positions)

    def _note_buffers(self) -> None:
        # each module's own buffers (the KV caches) and their addresses when the graph is taken up,
        # listed once so that a step compares them in ~10 us (model.buffers() takes ~0.5 ms)
        self._buffer_slots = [(m._buffers, name, b.data_ptr()) for m in self.model.modules()
                              for name, b in m._buffers.items() if b is not None]

    def _buffers_moved(self) -> bool:
        # a buffer at another address: reallocated (setup_cache) while the graph writes the old one
        return any(d.get(name) is None or d[name].data_ptr() != ptr for d, name, ptr in self._buffer_slots)

    def __call__(self) -> torch.Tensor:
        if self._captured is not None and self._buffers_moved():
            self._captured, self.use_graph, self.graphed = None, False, False  # eager from now on
        if self._captured is not None:
            self.graphed = True
            self._host_bookkeeping()
            return self._captured.replay()
        if self.use_graph:
            graphs = getattr(self.model, _CACHE_ATTR, None)
            if graphs is None:
                graphs = {}
                setattr(self.model, _CACHE_ATTR, graphs)
            # graphs of this batch size and arguments on buffers the model no longer holds (a cache
            # reallocated by setup_cache) can never replay again: drop them with the memory they hold
            for k in [k for k in graphs if k[:2] == self._key[:2] and k != self._key]:
                del graphs[k]
            try:
                cap = CapturedDecode(self.model, self.input_ids, self.positions, self.kwargs)
            except Exception as e:  # noqa: BLE001 - any capture failure: run eager, say why (once)
                self.use_graph = False
                graphs[self._key] = _FAILED
                warnings.warn(f"decode graph capture failed, decoding eagerly: {type(e).__name__}: {e}",
                              RuntimeWarning, stacklevel=2)
                _synchronize(self.device)
                if isinstance(e, CaptureRejected):  # the step ran eagerly to the end: its logits stand
                    return e.output
            else:
                graphs[self._key] = cap
                self._captured = cap
                self._note_buffers()
                self.graphed = True
                return cap.logits if getattr(cap, "executed", False) else cap.replay()
        return self.model(self.input_ids, positions=self.positions, **self.kwargs)


@contextlib.contextmanager
def layer_probe(model: torch.nn.Module) -> Iterator[list]:
    """Record the output of every ``model.blk[i]`` decoder layer in static buffers.

    Yields a list that holds, after each forward, one float32 tensor per layer (the layer's
    ``x`` output, ``[B, T, H]``). The buffers are allocated on the first forward and copied into
    in place afterwards, so a forward captured into a graph keeps refreshing them on replay; use
    ``[t.clone() for t in probe]`` to keep a step's values. Hooks are removed on exit.
    """
    outs: list[torch.Tensor] = []
    handles = []

    def hook(i):
        def fn(module, args, output):
            x = output[0] if isinstance(output, tuple) else output
            if len(outs) <= i:
                outs.append(x.detach().float().clone())
            elif outs[i].shape == x.shape:
                outs[i].copy_(x.detach())
            else:
                outs[i] = x.detach().float().clone()
        return fn

    for i, blk in enumerate(model.blk):
        handles.append(blk.register_forward_hook(hook(i)))
    try:
        yield outs
    finally:
        for h in handles:
            h.remove()
