"""How a ``hanzo`` op finds its kernel: torch's dispatcher, one dispatch key per backend.

Every op is a ``torch.library.custom_op`` whose own body (registered by torch for
``CompositeExplicitAutograd``, so it serves any device without a kernel of its own) checks the
arguments and runs the op's vectorized-torch reference. A backend registers real kernels on its
device's dispatch key (the C++ CPU kernels on ``CPU`` from C++, the Triton kernels on ``CUDA``
with :func:`torch.library.register_kernel`, later ``PrivateUse1`` for Vulkan and ``MPS``); the
dispatcher then calls them directly, so a decode step pays no Python between ops on the CPU.

Backends are loaded lazily: the first call of any op on a device type activates the backends
that serve it (:func:`hanzo_torch.backends.activate`), which may compile the C++ CPU kernels once.

The reference of every op is also registered as its own op, ``torch.ops.hanzo_ref.<op>``, so a
native kernel can hand a call it cannot take (an argument its fast path does not cover, a format it
lacks, or reference mode) to the reference through the dispatcher, and tests can call the oracle
by name.

Reference mode: ``HANZO_<OP>_FALLBACK=1`` (read once, at import) or :func:`use_reference` (in
process, for A/B runs) makes that op run its reference on every backend. It is one mechanism,
above the kernels: while an op is in reference mode, a ``torch.library.Library`` registers its
reference on the dispatch key of every backend that registered kernels (``Backend.dispatch_key``),
in front of them; leaving reference mode destroys that registration and the dispatcher goes back
to the kernels. No kernel reads a flag, and an op out of reference mode costs nothing per call.
An op that fuses others (:data:`PARTS`) also runs its reference while one of its parts is in
reference mode. Nothing reads the environment per call.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Callable, Iterable, Iterator, Optional

import torch

__all__ = ["use_reference", "set_reference", "reference_enabled", "reference_ops", "redirected_ops",
           "add_dispatch_key", "define_reference_op", "default", "OPS", "PARTS"]

OPS: list[str] = []
"""Names of every ``hanzo`` op, in definition order (filled as the op modules are imported)."""

_REFERENCE: set[str] = set()
_REFERENCES: dict[str, Callable] = {}  # op -> its checked reference (the body of hanzo_ref::<op>)
_KEYS: set[str] = set()  # dispatch keys that hold native kernels (added as backends register)
_redirect: Optional[torch.library.Library] = None  # the reference registered on _KEYS for redirected_ops()
PARTS: dict[str, tuple] = {"qk_norm_rope_kv_write": ("qk_norm_rope", "kv_cache_write"), "mul_mat_group": ("mul_mat",)}
"""Ops whose kernels fuse other ops: in reference mode while any of their parts is."""
_REF_LIB = torch.library.Library("hanzo_ref", "DEF")
_ACTIVATED: dict[str, frozenset] = {}  # device type -> ops with a native kernel on its dispatch key


def _env_flag(op: str) -> bool:
    v = os.environ.get(f"HANZO_{op.upper()}_FALLBACK", "")
    return v.strip().lower() in ("1", "true", "yes", "on")


def define_reference_op(op: str, reference: Callable) -> None:
    """Register ``reference`` as ``torch.ops.hanzo_ref.<op>`` (same schema as ``hanzo::<op>``).

    ``reference`` takes the op's arguments, checks them (raising the op's ValueError/IndexError)
    and computes the result in plain torch. Called once per op by the module defining it.
    """
    schema = str(getattr(torch.ops.hanzo, op).default._schema)
    _REF_LIB.define(schema.split("::", 1)[1])
    _REF_LIB.impl(op, reference, "CompositeExplicitAutograd")
    _REFERENCES[op] = reference
    OPS.append(op)
    if _env_flag(op):
        _REFERENCE.add(op)


def reference_enabled(op: str) -> bool:
    """True while ``op`` is in reference mode (``HANZO_<OP>_FALLBACK=1`` or :func:`use_reference`)."""
    return op in _REFERENCE


def reference_ops() -> frozenset:
    """The ops now in reference mode."""
    return frozenset(_REFERENCE)


def redirected_ops() -> frozenset:
    """The ops whose calls the redirect sends to their reference: those in reference mode and
    those with a part (:data:`PARTS`) in it."""
    out = set(_REFERENCE)
    for op, parts in PARTS.items():
        if any(p in _REFERENCE for p in parts):
            out.add(op)
    return frozenset(o for o in out if o in _REFERENCES)


def _apply_redirect() -> None:
    """(Re)register the reference of :func:`redirected_ops` on every key of :data:`_KEYS`, newest
    of the key's kernels, so the dispatcher calls it instead of a backend's kernel."""
    global _redirect
    if _redirect is not None:
        _redirect._destroy()  # the dispatcher goes back to the kernels registered before it
        _redirect = None
    ops = redirected_ops()
    if not ops or not _KEYS:
        return
    lib = torch.library.Library("hanzo", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")  # in front of the kernels, on purpose
        for key in sorted(_KEYS):
            for op in sorted(ops):
                lib.impl(op, _REFERENCES[op], key)
    _redirect = lib


def add_dispatch_key(key: str) -> None:
    """Called by :func:`hanzo_torch.backends.activate` after a backend registered kernels on
    ``key``: the redirect is put (back) in front of them."""
    _KEYS.add(key)
    _apply_redirect()


def _set(op: str, enabled: bool) -> bool:
    """Put ``op`` in (or out of) the reference set; True when that changed it."""
    if op not in OPS:
        raise ValueError(f"unknown hanzo op {op!r}; ops: {', '.join(OPS)}")
    if enabled == (op in _REFERENCE):
        return False
    (_REFERENCE.add if enabled else _REFERENCE.discard)(op)
    return True


def set_reference(op: str, enabled: bool = True) -> None:
    """Switch ``op`` into (or out of) reference mode for every backend, in this process.

    Raises:
        ValueError: ``op`` is not a ``hanzo`` op.
    """
    if _set(op, enabled):
        _apply_redirect()


@contextlib.contextmanager
def use_reference(*ops: str, enabled: bool = True) -> Iterator[None]:
    """Run ``ops`` (all ops when none are named) on their torch references inside the block.

    The in-process twin of ``HANZO_<OP>_FALLBACK=1``, for an A/B in which the kernel is the only
    variable::

        with hanzo_torch.ops.use_reference("mul_mat"):
            y_ref = model(ids)

    ``enabled=False`` does the opposite (native kernels inside the block, even if the variable is
    set). The previous modes are restored on exit.

    Raises:
        ValueError: a name is not a ``hanzo`` op (nothing is changed then).
    """
    names: Iterable[str] = ops or tuple(OPS)
    for op in names:
        if op not in OPS:
            raise ValueError(f"unknown hanzo op {op!r}; ops: {', '.join(OPS)}")
    before = {op: op in _REFERENCE for op in names}
    if any([_set(op, enabled) for op in before]):
        _apply_redirect()
    try:
        yield
    finally:
        if any([_set(op, was) for op, was in before.items()]):
            _apply_redirect()


def default(op: str, device_type: str, reference: Callable, *args):
    """Body of ``hanzo::<op>`` for a device whose dispatch key has no native kernel for it.

    The first call on a device type activates the backends serving it; if one of them registered
    a kernel for ``op``, the call goes through the dispatcher again and reaches it (later calls go
    there directly). Otherwise the reference runs.
    """
    native = _ACTIVATED.get(device_type)
    if native is None:
        if _activator is None:  # no backend package imported: the references serve every device
            return reference(*args)
        native = _ACTIVATED[device_type] = _activator(device_type)
        if op in native:
            return getattr(torch.ops.hanzo, op)(*args)
    return reference(*args)


_activator: Optional[Callable[[str], frozenset]] = None


def set_activator(fn: Callable[[str], frozenset]) -> None:
    """Install ``fn(device_type) -> ops with a native kernel there``, called on the first op call
    on a device type: :func:`hanzo_torch.backends.activate`, installed when that package is
    imported (so this module imports no backend)."""
    global _activator
    _activator = fn


def activated(device_type: str) -> Optional[frozenset]:
    """Ops with a native kernel on ``device_type`` (None before the first op call there)."""
    return _ACTIVATED.get(device_type)


def mark_activated(device_type: str, ops: frozenset) -> None:
    _ACTIVATED[device_type] = frozenset(ops)
