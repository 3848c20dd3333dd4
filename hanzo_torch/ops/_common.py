"""Backend dispatch shared by every ``hanzo`` op.

Each op's default implementation asks :func:`kernel_for` for a fast kernel registered for the
input's device type (and format, for quantized ops). ``HANZO_<OP>_FALLBACK=1`` (for example
``HANZO_MUL_MAT_FALLBACK=1``) makes :func:`kernel_for` return None, so the vectorized-torch
reference runs instead: an A/B changes exactly one op.
"""
from __future__ import annotations

import os
from typing import Callable, Iterable, Optional

__all__ = ["register_kernel", "kernel_for", "fallback_enabled", "registered_kernels"]

# (op, device_type) -> list of (qtypes or None, fn); later registrations take precedence.
_KERNELS: dict[tuple[str, str], list[tuple[Optional[frozenset], Callable]]] = {}


def fallback_enabled(op: str) -> bool:
    """True when ``HANZO_<OP>_FALLBACK`` is set to a true value (1, true, yes, on)."""
    v = os.environ.get(f"HANZO_{op.upper()}_FALLBACK", "")
    return v.strip().lower() in ("1", "true", "yes", "on")


def register_kernel(op: str, device_type: str, fn: Callable, qtypes: Optional[Iterable[str]] = None) -> None:
    """Register ``fn`` as the fast kernel of ``hanzo::<op>`` on ``device_type`` ("cpu", "cuda").

    ``qtypes``: the ggml format names it handles (None: every format, or the op has none).
    """
    entry = (frozenset(q.upper() for q in qtypes) if qtypes is not None else None, fn)
    _KERNELS.setdefault((op, device_type), []).insert(0, entry)


def kernel_for(op: str, device_type: str, qtype: Optional[str] = None) -> Optional[Callable]:
    """The fast kernel for ``op`` on ``device_type`` and format ``qtype``, or None for the reference."""
    entries = _KERNELS.get((op, device_type))
    if not entries or fallback_enabled(op):
        return None
    for qtypes, fn in entries:
        if qtypes is None or qtype is None or qtype.upper() in qtypes:
            return fn
    return None


def registered_kernels() -> dict[tuple[str, str], list[Optional[frozenset]]]:
    """What is registered: ``{(op, device_type): [qtypes, ...]}`` (for diagnostics and tests)."""
    return {k: [q for q, _ in v] for k, v in _KERNELS.items()}
