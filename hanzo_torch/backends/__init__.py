"""Backends: one package per kernel family, each registering on torch's own dispatch keys.

==========  ==================  ===============================================================
backend     dispatch key        kernels
==========  ==================  ===============================================================
reference   any (default body)  the vectorized-torch references of :mod:`hanzo_torch.ops`
cpu         CPU                 C++ (csrc/cpu), int8 dot products, AVX2 / AVX-512 VNNI / scalar
triton      CUDA (and ROCm)     Triton, one source for both vendors
vulkan      PrivateUse1         GLSL compute shaders through Vulkan (csrc/vulkan), device "vulkan"
==========  ==================  ===============================================================

A backend is one folder: a package here whose ``BACKEND`` is an instance of a
:class:`~hanzo_torch.backends.base.Backend` subclass (the contract: name, device types, dispatch
key, ``available()``/``reason()``, formats per op as data, ``register()``, ``synchronize()``,
graph capture, profile counters, default compute dtypes with their reason). Packages are found
by listing this folder (:data:`NAMES`); :func:`add` takes one from elsewhere (tests, plugins).
Each package also keeps its module-level functions (``status()``, ``register()``...) for callers
that name it.

:func:`activate` is called by the ops on their first call on a device type; :func:`for_device`
gives the backend the rest of the package asks about a device; :func:`status` reports all of
them (``hanzo-torch inspect --backends``). A missing backend only means its device runs the
references.
"""
from __future__ import annotations

import importlib
import pkgutil
import threading
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from .base import Backend, ComputeDefaults  # noqa: F401

__all__ = ["NAMES", "Backend", "BackendStatus", "get", "backend", "for_device", "prepare_device", "add", "status",
           "activate", "check_environment", "auto_device"]

NAMES = ("reference",) + tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)
                                      if m.ispkg and not m.name.startswith("_") and m.name != "reference"))
"""Every backend package of this folder, the reference first (the order :func:`status` lists them)."""

_lock = threading.RLock()
_registered: dict[str, frozenset] = {}
_added: dict[str, Backend] = {}


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


def _names() -> tuple:
    return NAMES + tuple(n for n in _added if n not in NAMES)


def get(name: str):
    """The backend package ``name`` (ValueError for an unknown name)."""
    if name not in NAMES:
        raise ValueError(f"unknown backend {name!r}; backends: {', '.join(_names())}")
    return importlib.import_module(f"{__name__}.{name}")


def backend(name: str) -> Backend:
    """The :class:`~hanzo_torch.backends.base.Backend` of backend ``name`` (ValueError for an unknown name)."""
    if name in _added:
        return _added[name]
    return get(name).BACKEND


def add(b: Backend) -> Backend:
    """Add a backend defined outside this folder (a plugin, a test), after the built-in ones; its
    kernels register on the first op call on one of its device types. Returns ``b``.

    Raises:
        TypeError: ``b`` is not a :class:`~hanzo_torch.backends.base.Backend`.
        ValueError: its name is taken, or it has no name or device type.
    """
    if not isinstance(b, Backend):
        raise TypeError(f"add() takes a hanzo_torch.backends.base.Backend, got {type(b).__name__}")
    if not b.name or not b.device_types:
        raise ValueError(f"backend {b!r} needs a name and at least one device type")
    with _lock:
        if b.name in NAMES or b.name in _added:
            raise ValueError(f"a backend named {b.name!r} exists already")
        _added[b.name] = b
    return b


def remove(name: str) -> None:
    """Remove a backend added with :func:`add` (its registered kernels stay registered)."""
    with _lock:
        _added.pop(name, None)
        _registered.pop(name, None)


def for_device(device: Union[str, torch.device]) -> Backend:
    """The backend serving ``device`` (a torch device or device type): the first of :data:`NAMES`
    (then the added ones) with kernels for its type, else the reference. Cheap: nothing is built."""
    dtype = device if isinstance(device, str) else torch.device(device).type
    dtype = torch.device(dtype).type if ":" in dtype else dtype
    ref = None
    for name in _names():
        b = backend(name)
        if name == "reference":
            ref = b
        elif dtype in b.device_types:
            return b
    return ref


def auto_device() -> str:
    """The device type ``--device auto`` picks: that of the backend with the highest
    ``auto_priority`` (CUDA/ROCm when torch sees a device, else the CPU). Cheap."""
    best, rank = "cpu", None
    for name in _names():
        b = backend(name)
        p = b.auto_priority
        if p is not None and (rank is None or p > rank):
            best, rank = b.device_types[0], p
    return best


def prepare_device(device: Union[str, torch.device]) -> torch.device:
    """``device`` as a torch device once its backend had the chance to claim its type (the
    vulkan backend names PrivateUse1 "vulkan" here, not at import). Raises RuntimeError when the
    backend cannot claim it (another extension owns PrivateUse1, say)."""
    device = torch.device(device) if not isinstance(device, torch.device) else device
    return for_device(device).prepare_device(device)


def status() -> list[BackendStatus]:
    """The status of every backend (loads each; the CPU one builds its extension if needed)."""
    out = []
    for name in _names():
        try:
            b = backend(name)
            st = dict(b.status())
        except Exception as e:  # a broken optional backend is reported, never raised
            out.append(BackendStatus(name, False, f"{type(e).__name__}: {e}", ()))
            continue
        out.append(BackendStatus(name, bool(st.pop("available")), st.pop("reason", None), tuple(b.device_types),
                                 tuple(st.pop("formats", ())), st))
    return out


def activate(device_type: str) -> frozenset:
    """Register the kernels of every backend serving ``device_type``; the ops that got one.

    Idempotent and thread-safe; a backend that cannot run here registers nothing. The
    reference-mode redirect is put in front of the kernels registered (:mod:`hanzo_torch.ops._dispatch`).
    """
    from ..ops import _dispatch

    with _lock:
        done: set = set()
        for name in _names():
            b = backend(name)
            if device_type not in b.device_types:
                continue
            if name not in _registered:
                try:
                    _registered[name] = frozenset(b.register())
                except Exception as e:  # never break an op call over an optional backend
                    import warnings

                    warnings.warn(f"hanzo_torch: the {name} backend failed to register ({type(e).__name__}: {e}); "
                                  "using the torch references", RuntimeWarning, stacklevel=3)
                    _registered[name] = frozenset()
                if _registered[name] and b.dispatch_key:
                    _dispatch.add_dispatch_key(b.dispatch_key)
            done |= _registered[name]
        return frozenset(done)


def check_environment() -> None:
    """Raise ValueError for a malformed backend setting in the environment (``HANZO_CPU_ISA``).

    Cheap (nothing is built or loaded); the CLI and :func:`hanzo_torch.load` call it before long work.
    """
    for name in _names():
        backend(name).check_environment()


def _install() -> None:
    from ..ops import _dispatch

    _dispatch.set_activator(activate)


_install()
