"""The reference backend: the vectorized-torch references of :mod:`hanzo_torch.ops`.

They are each op's own body (torch registers it for ``CompositeExplicitAutograd``, so it serves
every device without a kernel of its own) and, by name, ``torch.ops.hanzo_ref.<op>``: the oracle
every other backend is gated against. Every registered format, every device torch runs on.
"""
from __future__ import annotations

NAME = "reference"
DEVICE_TYPES = ("cpu", "cuda", "mps", "privateuseone", "meta")


def formats() -> tuple[str, ...]:
    from ...formats import FORMATS

    return tuple(FORMATS)


def register() -> frozenset:
    """Nothing to register: the references are the ops' default bodies."""
    return frozenset()


def status() -> dict:
    return {"available": True, "reason": None, "formats": formats()}
