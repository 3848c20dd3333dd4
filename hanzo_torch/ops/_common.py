"""Backend dispatch shared by every ``hanzo`` op.

Each op's default implementation asks :func:`kernel_for` for a fast kernel registered for the
input's device type (and format, for quantized ops). ``HANZO_<OP>_FALLBACK=1`` (for example
``HANZO_MUL_MAT_FALLBACK=1``) makes :func:`kernel_for` return None, so the vectorized-torch
reference runs instead: an A/B changes exactly one op.
"""
from __future__ import annotations

import os
from typing import Callable, Iterable, Optional

__all__ = ["register_kernel", "kernel_for", "fallback_enabled", "registered_kernels", "on_kernels_changed", "picks"]


class _KernelTable(dict):
    """``(op, device_type) -> [(qtypes or None, fn), ...]`` that tells its listeners of every change.

    A backend that bypasses :func:`kernel_for` on its hot path (the C++ dispatch of the CPU ops,
    :mod:`hanzo_torch.backends.cpu.fused`) listens, so a kernel registered later (or a test's
    stand-in set with ``monkeypatch.setitem``) is still the one that runs.
    """

    def __init__(self):
        super().__init__()
        self.listeners: list[Callable[[], None]] = []

    def changed(self) -> None:
        for fn in list(self.listeners):
            fn()

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.changed()

    def __delitem__(self, key):
        super().__delitem__(key)
        self.changed()

    def clear(self):
        super().clear()
        self.changed()

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self.changed()

    def pop(self, *args):
        r = super().pop(*args)
        self.changed()
        return r

    def setdefault(self, key, default=None):
        r = super().setdefault(key, default)
        self.changed()
        return r


# (op, device_type) -> list of (qtypes or None, fn); later registrations take precedence.
_KERNELS: _KernelTable = _KernelTable()


def fallback_enabled(op: str) -> bool:
    """True when ``HANZO_<OP>_FALLBACK`` is set to a true value (1, true, yes, on)."""
    v = os.environ.get(f"HANZO_{op.upper()}_FALLBACK", "")
    return v.strip().lower() in ("1", "true", "yes", "on")


def register_kernel(op: str, device_type: str, fn: Callable, qtypes: Optional[Iterable[str]] = None) -> None:
    """Register ``fn`` as the fast kernel of ``hanzo::<op>`` on ``device_type`` ("cpu", "cuda").

    ``qtypes``: the ggml format names it handles (None: every format, or the op has none).
    """
    entry = (frozenset(q.upper() for q in qtypes) if qtypes is not None else None, fn)
    entries = list(_KERNELS.get((op, device_type), ()))
    entries.insert(0, entry)
    _KERNELS[(op, device_type)] = entries  # one assignment: the listeners see the new table


def on_kernels_changed(fn: Callable[[], None]) -> None:
    """Call ``fn()`` after every change of the kernel table (registrations, test stand-ins)."""
    _KERNELS.listeners.append(fn)


def picks(op: str, device_type: str, fn: Callable, qtypes: Iterable[Optional[str]] = (None,)) -> bool:
    """True when :func:`kernel_for` (ignoring ``HANZO_<OP>_FALLBACK``) returns ``fn`` for every format
    in ``qtypes`` (``None``: an op without formats)."""
    entries = _KERNELS.get((op, device_type)) or ()
    return all(_first_match(entries, qtype) is fn for qtype in qtypes)


def _first_match(entries, qtype: Optional[str]) -> Optional[Callable]:
    for qtypes, fn in entries:
        if qtypes is None or qtype is None or qtype.upper() in qtypes:
            return fn
    return None


def kernel_for(op: str, device_type: str, qtype: Optional[str] = None) -> Optional[Callable]:
    """The fast kernel for ``op`` on ``device_type`` and format ``qtype``, or None for the reference."""
    entries = _KERNELS.get((op, device_type))
    if not entries or fallback_enabled(op):
        return None
    return _first_match(entries, qtype)


def registered_kernels() -> dict[tuple[str, str], list[Optional[frozenset]]]:
    """What is registered: ``{(op, device_type): [qtypes, ...]}`` (for diagnostics and tests)."""
    return {k: [q for q, _ in v] for k, v in _KERNELS.items()}
