"""Backends: one package per kernel family, each registering on torch's own dispatch keys.

==========  ==================  ===============================================================
backend     dispatch key        kernels
==========  ==================  ===============================================================
reference   any (default body)  the vectorized-torch references of :mod:`hanzo_torch.ops`
cpu         CPU                 C++ (csrc/cpu), int8 dot products, AVX2 / AVX-512 VNNI / scalar
triton      CUDA (and ROCm)     Triton, one source for both vendors
vulkan      PrivateUse1         GLSL compute shaders through Vulkan (csrc/vulkan), device "vulkan"
==========  ==================  ===============================================================

Every backend package has the same small interface:

- ``NAME`` and ``DEVICE_TYPES`` (the torch device types it serves);
- ``status() -> dict`` with ``available`` (bool), ``reason`` (why not, or None), ``formats``
  (the ggml formats its kernels handle, from its own rule table) and backend-specific details
  (the CPU's instruction set);
- ``register() -> frozenset`` registers its kernels on its dispatch key (idempotent) and returns
  the ops it registered (empty when it cannot run here).

:func:`activate` is called by the ops on their first call on a device type; :func:`status`
reports all of them (``hanzo-torch inspect --backends``). A missing backend only means its device
runs the references.
"""
from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["NAMES", "BackendStatus", "get", "status", "activate", "check_environment"]

NAMES = ("reference", "cpu", "triton", "vulkan")
"""Every backend package, in the order :func:`status` lists them."""

_lock = threading.RLock()
_registered: dict[str, frozenset] = {}

from . import vulkan as _vulkan  # noqa: E402  (cheap) torch.device("vulkan") names this package's device

_vulkan.claim_device()


@dataclass
class BackendStatus:
    """What :func:`status` reports for one backend."""

    name: str
    available: bool
    reason: Optional[str]
    device_types: tuple
    formats: tuple = ()
    details: dict = field(default_factory=dict)

    def __str__(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in self.details.items())
        if not self.available:
            return f"{self.name}: unavailable ({self.reason})"
        return f"{self.name}: available on {'/'.join(self.device_types)}, {len(self.formats)} formats{extra}"


def get(name: str):
    """The backend package ``name`` (ValueError for an unknown name)."""
    if name not in NAMES:
        raise ValueError(f"unknown backend {name!r}; backends: {', '.join(NAMES)}")
    return importlib.import_module(f"{__name__}.{name}")


def status() -> list[BackendStatus]:
    """The status of every backend (loads each; the CPU one builds its extension if needed)."""
    out = []
    for name in NAMES:
        try:
            mod = get(name)
            st = dict(mod.status())
        except Exception as e:  # a broken optional backend is reported, never raised
            out.append(BackendStatus(name, False, f"{type(e).__name__}: {e}", ()))
            continue
        out.append(BackendStatus(name, bool(st.pop("available")), st.pop("reason", None), tuple(mod.DEVICE_TYPES),
                                 tuple(st.pop("formats", ())), st))
    return out


def activate(device_type: str) -> frozenset:
    """Register the kernels of every backend serving ``device_type``; the ops that got one.

    Idempotent and thread-safe; a backend that cannot run here registers nothing.
    """
    with _lock:
        done: set = set()
        for name in NAMES:
            mod = get(name)
            if device_type not in mod.DEVICE_TYPES:
                continue
            if name not in _registered:
                try:
                    _registered[name] = frozenset(mod.register())
                except Exception as e:  # never break an op call over an optional backend
                    import warnings

                    warnings.warn(f"hanzo_torch: the {name} backend failed to register ({type(e).__name__}: {e}); "
                                  "using the torch references", RuntimeWarning, stacklevel=3)
                    _registered[name] = frozenset()
            done |= _registered[name]
        return frozenset(done)


def check_environment() -> None:
    """Raise ValueError for a malformed backend setting in the environment (``HANZO_CPU_ISA``).

    Cheap (nothing is built or loaded); the CLI and :func:`hanzo_torch.load` call it before long work.
    """
    get("cpu").check_environment()
