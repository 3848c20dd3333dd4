"""The backend contract: what the rest of hanzo-torch may ask a backend, and nothing else.

A backend is one package under :mod:`hanzo_torch.backends` whose ``BACKEND`` attribute is an
instance of a :class:`Backend` subclass. The model loader, generation, the decode graphs, the
batcher and the CLI ask the backend serving a device (:func:`hanzo_torch.backends.for_device`)
for its defaults, synchronization, graphs and profile counters; none of them names a device
type. Everything here is cheap unless a docstring says otherwise: nothing is built or started by
reading the data attributes.

Data (class attributes, set by each backend):

- ``name``: the package name (``"cpu"``); ``device_types``: the torch device types it serves;
- ``dispatch_key``: the torch dispatch key its kernels register on (``"CPU"``, ``"CUDA"``,
  ``"PrivateUse1"``), or None for a backend without kernels of its own; the reference-mode
  redirect (:mod:`hanzo_torch.ops._dispatch`) is registered on it;
- ``op_formats``: ``{op: frozenset of ggml format names}`` its kernels take, for the ops that read
  packed weights (a Python set: the C++/GLSL rule tables are generated from, or checked against,
  it); an op absent from the map takes no format argument or has no kernel here;
- ``defaults``: :class:`ComputeDefaults`, the activation and KV-cache dtypes :func:`hanzo_torch.load`
  uses when none are given, with the reason;
- ``auto_priority``: rank for ``--device auto`` (higher first; None: never chosen automatically);
- ``distributed``: the ``torch.distributed`` backend of its tensor-parallel runs (``"gloo"``,
  ``"nccl"``), or None when it has none;
- ``host_memory``: its tensors live in host memory (the loader prefetches mapped weight pages).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Optional

import torch

__all__ = ["Backend", "ComputeDefaults", "Capture", "CaptureRejected", "QUANT_OPS"]

QUANT_OPS = ("dequantize", "get_rows", "mul_mat", "mul_mat_id", "swiglu_mul_mat")
"""The ``hanzo`` ops with a ggml format argument (the keys of ``Backend.op_formats``)."""


@dataclass(frozen=True)
class ComputeDefaults:
    """Default compute dtypes of a backend.

    ``activations``: torch dtype of the activations (float32, bfloat16 or float16);
    ``kv``: key of ``hanzo_torch.ops.fused.KV_CACHE_DTYPES`` for the KV cache, or None for the
    activations' dtype; ``reason``: why (a measurement or a precedent), shown by ``inspect --backends``.
    """

    activations: torch.dtype
    kv: Optional[str]
    reason: str


@dataclass
class Capture:
    """A captured graph: ``replay()`` runs it again; ``output`` is what the captured call returned
    (static buffers, overwritten by every replay). ``executed``: the capture itself ran the call
    (the CPU's graphs), so ``output`` already holds its result; on CUDA and vulkan a capture only
    records, and the first replay computes it."""

    replay: Callable[[], None]
    output: Any
    executed: bool = False


class CaptureRejected(RuntimeError):
    """A capture that ran the call to completion eagerly, then found it cannot be replayed (the CPU
    backend's graphs: an op a replay would skip). ``output`` is that eager run's result, valid for
    the step it ran, so the caller need not run the step again."""

    def __init__(self, message: str, output: Any):
        super().__init__(message)
        self.output = output


class Backend:
    """Base class of every backend: defaults that make a backend without kernels, graphs or
    profile counters (the reference) a complete one. Subclasses override what they have."""

    name: ClassVar[str] = ""
    device_types: ClassVar[tuple] = ()
    dispatch_key: ClassVar[Optional[str]] = None
    op_formats: ClassVar[Mapping[str, frozenset]] = {}
    defaults: ClassVar[ComputeDefaults] = ComputeDefaults(
        torch.bfloat16, None, "accelerators without a measured choice: half the bytes of float32 per "
        "activation, the dtype the checkpoints were trained in")
    auto_priority: ClassVar[Optional[int]] = None
    distributed: ClassVar[Optional[str]] = None
    host_memory: ClassVar[bool] = False

    # availability -------------------------------------------------------------------------------
    def available(self) -> bool:
        """True when the kernels can run here (may build them: see each backend)."""
        return self.reason() is None

    def reason(self) -> Optional[str]:
        """Why the backend is unavailable, or None."""
        return None

    def check_environment(self) -> None:
        """Raise ValueError for a malformed setting of this backend in the environment (cheap:
        nothing is built); called before long work (a model load, a download)."""

    def device_reason(self, device: torch.device) -> Optional[str]:
        """Why tensors cannot be made on ``device`` here (None: they can). Cheap where it can be:
        a backend whose device is the host says None without building its kernels."""
        return self.reason()

    def prepare_device(self, device: torch.device) -> torch.device:
        """``device`` as this backend's torch device (a backend may first claim a device type:
        Vulkan renames PrivateUse1 and re-parses ``"vulkan"``). Raises RuntimeError when it cannot."""
        return torch.device(device)

    def rank_device(self, device: torch.device, local_rank: int) -> torch.device:
        """The device of tensor-parallel rank ``local_rank`` on this host (an unindexed device
        gets the rank's index where the backend has several)."""
        return device

    # kernels ------------------------------------------------------------------------------------
    def register(self) -> frozenset:
        """Register the kernels on :attr:`dispatch_key` (idempotent); the ops registered (empty
        when the backend cannot run here)."""
        return frozenset()

    def formats(self, op: str = "mul_mat") -> frozenset:
        """The ggml formats ``op``'s kernel takes here (:attr:`op_formats`; empty when none)."""
        return frozenset(self.op_formats.get(op, ()))

    def status(self) -> dict:
        """``{"available", "reason", "formats", ...details}`` (may build the kernels)."""
        why = self.reason()
        return {"available": why is None, "reason": why,
                "formats": tuple(sorted(self.formats())) if why is None else ()}

    # execution ----------------------------------------------------------------------------------
    def synchronize(self, device: torch.device) -> None:
        """Wait for the work queued on ``device`` (host backends: nothing to wait for)."""

    def graphs_supported(self, device: torch.device) -> bool:
        """True when :meth:`capture` can record work on ``device``."""
        return False

    def capture(self, device: torch.device, fn: Callable[[], Any], warmup: int) -> Capture:
        """Run ``fn`` ``warmup`` times (at least once) eagerly, then capture one call into a graph
        (a backend whose capture runs the call eagerly itself, the CPU's, may skip the warm-up).

        Raises:
            RuntimeError: graphs are not supported here, or capture failed.
        """
        raise RuntimeError(f"the {self.name} backend does not capture graphs")

    # profile counters ---------------------------------------------------------------------------
    def profiling(self) -> bool:
        """True when the backend collects profile counters (:meth:`profile`)."""
        return False

    def profile(self) -> dict:
        """Counters since the last call, then reset (``{}`` without profiling)."""
        return {}

    def __repr__(self) -> str:
        return f"<hanzo_torch backend {self.name!r} on {'/'.join(self.device_types)}>"
