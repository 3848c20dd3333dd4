"""``torch.vulkan``: the device module torch consults for the PrivateUse1 device named "vulkan"
(registered by :func:`hanzo_torch.backends.vulkan.build` with ``torch._register_device_module``).

One device (index 0) with one in-order queue. :class:`VulkanGraph` and :class:`graph` record work
once and replay it, as ``torch.cuda.CUDAGraph`` and ``torch.cuda.graph`` do on CUDA.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["VulkanGraph", "graph", "is_capturing", "is_available", "is_initialized", "device_count",
           "current_device", "set_device", "synchronize", "manual_seed_all", "get_rng_state", "set_rng_state",
           "get_amp_supported_dtype"]


def _ext():
    from . import _need

    return _need()


def is_available() -> bool:
    from . import available

    return available()


def is_initialized() -> bool:
    from . import _slot

    return _slot.ext is not None


def _lazy_init() -> None:
    _ext()


def device_count() -> int:
    return 1 if is_available() else 0


def current_device() -> int:
    return 0


def set_device(device) -> None:
    idx = torch.device(device).index if not isinstance(device, int) else device
    if idx not in (None, 0):
        raise ValueError(f"the vulkan backend has one device (vulkan:0), got index {idx}")


def synchronize(device=None) -> None:
    """Submit the recorded work and wait for the device."""
    _ext().synchronize()


def _is_in_bad_fork() -> bool:
    return False


def manual_seed_all(seed: int) -> None:
    """Random numbers for vulkan tensors are drawn on the CPU (the fallback): nothing to seed here."""


def get_rng_state(device=None) -> torch.Tensor:
    """The generator state random ops on vulkan tensors use: the CPU generator's, since they run on
    the CPU through the fallback (uint8 tensor, as ``torch.get_rng_state``). ``torch.random.fork_rng``
    asks for it: torch takes this device as the default accelerator once it is named."""
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    """Restore a state from :func:`get_rng_state` (the CPU generator's)."""
    torch.set_rng_state(state)


def get_amp_supported_dtype():
    return [torch.float16, torch.bfloat16]


class VulkanGraph:
    """Vulkan work recorded once into one command buffer and replayed (``torch.cuda.CUDAGraph``'s twin).

    Between :meth:`capture_begin` and :meth:`capture_end` (or inside ``with graph(g):``), the ops on
    vulkan tensors record their dispatches and device copies into this graph instead of running;
    :meth:`replay` submits them all at once, after the work issued before it and before the work
    issued after it. The push constants, hence every tensor address and every size, are fixed at
    capture: between replays only the contents of the tensors the graph reads may change (write
    inputs in place: ``x.copy_(...)``, ``x.fill_(...)``), and outputs are the tensors created
    during capture, overwritten by each replay.

    Memory: tensors created during capture come from a private pool of this graph, and memory
    freed during capture stays in it, so that no tensor created outside the graph shares memory
    with it. Deleting the graph (or the last reference to it) waits for the device and hands the
    pool back to the shared cache (``memory_stats()["graph_pool_bytes"]`` counts the pools of
    live graphs; :func:`hanzo_torch.backends.vulkan.empty_cache` then returns large blocks to the
    driver).

    What cannot be recorded raises RuntimeError during capture (naming it) and makes the capture
    fail: reading a tensor on the host (``.item()``, ``.cpu()``, ``.tolist()``, printing),
    :func:`synchronize`, a copy from a CPU tensor (``torch.tensor(..., device="vulkan")``,
    ``.to("vulkan")``: the host bytes would be read at capture, not at replay), ops without a
    vulkan kernel (the CPU fallback), ``empty_cache``. One capture at a time per process; work
    from every thread records into it.
    """

    def __init__(self):
        self._g = _ext().Graph()

    def capture_begin(self) -> None:
        """Start recording (the work issued so far is submitted first). Raises RuntimeError when
        another capture is under way or this graph already holds one (:meth:`reset` it)."""
        self._g.capture_begin()

    def capture_end(self) -> None:
        """Stop recording. Raises RuntimeError naming the first operation refused during the
        capture, if any (the graph then holds nothing)."""
        self._g.capture_end()

    def capture_abort(self) -> None:
        """Stop recording and discard it (what ``with graph(g):`` does when its body raises)."""
        self._g.capture_abort()

    def replay(self) -> None:
        """Submit the recorded work (asynchronous, like the ops). Raises RuntimeError when nothing
        was captured, or when called while capturing."""
        self._g.replay()

    def reset(self) -> None:
        """Drop the recorded work (waits for replays in flight); the private pool is kept."""
        self._g.reset()

    def info(self) -> dict:
        """``recorded`` (bool), the recorded ``dispatches``, ``barriers`` and ``copies`` (each replay
        runs that many), ``pool_bytes`` (bytes in the private pool, live tensors or cached)."""
        return dict(self._g.info())


class graph:
    """``with torch.vulkan.graph(g):`` records the body's vulkan work into ``g`` (a :class:`VulkanGraph`).

    On a normal exit the capture ends (RuntimeError if an operation was refused during it); when
    the body raises, the capture is discarded and the exception propagates.
    """

    def __init__(self, vulkan_graph: VulkanGraph):
        if not isinstance(vulkan_graph, VulkanGraph):
            raise TypeError(f"torch.vulkan.graph expects a VulkanGraph, got {type(vulkan_graph).__name__}")
        self.vulkan_graph = vulkan_graph

    def __enter__(self) -> None:
        self.vulkan_graph.capture_begin()

    def __exit__(self, exc_type, exc, tb) -> Optional[bool]:
        if exc_type is not None:
            self.vulkan_graph.capture_abort()
            return None
        self.vulkan_graph.capture_end()
        return None


def is_capturing() -> bool:
    """True while a :class:`VulkanGraph` capture is under way (``torch.cuda.is_current_stream_capturing``'s twin)."""
    from . import _slot

    ext = _slot.ext
    return bool(ext.capturing()) if ext is not None else False
