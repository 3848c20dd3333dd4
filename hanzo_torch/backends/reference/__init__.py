"""The reference backend: the vectorized-torch references of :mod:`hanzo_torch.ops`.

They are each op's own body (torch registers it for ``CompositeExplicitAutograd``, so it serves
every device without a kernel of its own) and, by name, ``torch.ops.hanzo_ref.<op>``: the oracle
every other backend is gated against. Every registered format, every device torch runs on; it is
also the backend :func:`hanzo_torch.backends.for_device` gives for a device type no other serves
(``mps``, ``meta``, ...), with the base contract's defaults (bfloat16 activations, no graphs).
"""
from __future__ import annotations

import torch

from ..base import QUANT_OPS, Backend

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


class ReferenceBackend(Backend):
    """The contract of the references: no kernels, no dispatch key, every format."""

    name = NAME
    device_types = DEVICE_TYPES

    def formats(self, op: str = "mul_mat") -> frozenset:
        return frozenset(formats()) if op in QUANT_OPS else frozenset()

    def synchronize(self, device) -> None:
        device = torch.device(device)
        acc = getattr(torch, "accelerator", None)
        if device.type not in ("cpu", "meta") and acc is not None and acc.is_available():
            acc.synchronize(device)

    def status(self) -> dict:
        return status()


BACKEND = ReferenceBackend()
