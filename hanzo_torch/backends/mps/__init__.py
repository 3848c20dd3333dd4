"""MPS backend: the ``hanzo`` ops as Metal kernels on torch's "mps" device (Apple GPUs).

The kernels are the Vulkan backend's GLSL shaders translated to Metal Shading Language
(:mod:`.generate`: glslc, then spirv-cross, then a bound-buffer rewrite), one translation per
(shader, format or variant), generated at build time into the cache. :mod:`.launch` says per op
which kernels run with which push constants, buffers and threadgroups (the Vulkan backend's
choices); on a Mac :mod:`.metal` compiles them with ``torch.mps.compile_shader`` and
:func:`register` puts every op on torch's ``MPS`` dispatch key. Elsewhere :mod:`.sim` compiles the
same sources as C++ and runs the same launches on the CPU (backend ``mps-sim`` of
tests/test_conformance.py).

No Metal kernel of this backend has run on Apple hardware: what runs here is the harness.
``benchmarks/mps_check.py`` is the one script to run on a Mac.

Activations default to float16 (:data:`MPSBackend.defaults`); attention's softmax and P*V are
float32 in the kernels whatever the dtype.
"""
from __future__ import annotations

import sys
import threading
from typing import Optional

import torch

from ..base import QUANT_OPS, Backend, ComputeDefaults
from . import launch as _launch

NAME = "mps"
DEVICE_TYPES = ("mps",)

__all__ = ["NAME", "DEVICE_TYPES", "device_reason", "reason", "available", "status", "formats", "register", "synchronize",
           "MPSBackend", "BACKEND"]

_lock = threading.Lock()
_registered: Optional[frozenset] = None
_lib = None


def device_reason() -> Optional[str]:
    """Why torch cannot make "mps" tensors here (None: it can). Cheap."""
    if sys.platform != "darwin":
        return f"not macOS (this is {sys.platform}): the Metal kernels run only on the CPU harness (mps-sim)"
    if not torch.backends.mps.is_built():
        return "this torch was built without MPS"
    if not torch.backends.mps.is_available():
        return "torch's MPS device is unavailable (macOS 12.3+ with an Apple or AMD GPU)"
    return None


def reason() -> Optional[str]:
    """Why the kernels cannot run here (None: they can): :func:`device_reason`, or the missing
    ``torch.mps.compile_shader`` or translation tools. Cheap: nothing is compiled."""
    why = device_reason()
    if why is not None:
        return why
    if not hasattr(torch.mps, "compile_shader"):
        return f"torch {torch.__version__} has no torch.mps.compile_shader (torch 2.6 or later)"
    from . import generate

    return generate.toolchain_reason()


def available() -> bool:
    """True when the Metal kernels can run here."""
    return reason() is None


def formats() -> tuple:
    """ggml names of the formats with Metal kernels (dense F32/F16/BF16 included)."""
    return _launch.formats()


def status() -> dict:
    """``{"available", "reason", "formats", "kernels", "int8_formats"}``."""
    why = reason()
    from . import generate

    st = {"available": why is None, "reason": why, "formats": formats() if why is None else (),
          "kernels": len(generate.manifest()["kernels"]), "int8": _launch.INT8}
    return st


def register() -> frozenset:
    """Register every op of :data:`.launch.OPS` on the ``MPS`` dispatch key (idempotent); the ops
    registered (empty when the backend cannot run here)."""
    global _registered, _lib
    with _lock:
        if _registered is not None:
            return _registered
        if reason() is not None:
            _registered = frozenset()
            return _registered
        from .metal import MetalRunner

        runner = MetalRunner(torch.device("mps"))
        lib = torch.library.Library("hanzo", "IMPL")
        for op, fn in _launch.OPS.items():
            lib.impl(op, _bind(fn, runner), "MPS")
        _lib = lib
        _registered = frozenset(_launch.OPS)
        return _registered


def _bind(fn, runner):
    def kernel(*args):
        return fn(runner, *args)

    kernel.__name__ = f"mps_{fn.__name__}"
    return kernel


def synchronize() -> None:
    """Wait for the queued MPS work."""
    torch.mps.synchronize()


class MPSBackend(Backend):
    """The contract of the MPS backend (:mod:`hanzo_torch.backends.base`)."""

    name = NAME
    device_types = DEVICE_TYPES
    dispatch_key = "MPS"
    defaults = ComputeDefaults(
        torch.float16, None,
        "float16 activations and KV: every Apple GPU computes in half natively and bfloat16 needs macOS 14; "
        "the kernels keep float32 statistics, softmax and P*V, and llama.cpp's Metal backend uses float16 too")

    @property
    def op_formats(self):
        fmts = frozenset(formats())
        return {op: fmts for op in QUANT_OPS}

    def reason(self) -> Optional[str]:
        return reason()

    def device_reason(self, device) -> Optional[str]:
        return device_reason()

    def prepare_device(self, device):
        why = device_reason()
        if why is not None:
            raise RuntimeError(f"the mps device is unavailable: {why}")
        return torch.device(device)

    def register(self) -> frozenset:
        return register()

    def status(self) -> dict:
        return status()

    def synchronize(self, device) -> None:
        if available():
            synchronize()


BACKEND = MPSBackend()
