"""``torch.vulkan``: the device module torch consults for the PrivateUse1 device named "vulkan"
(registered by :func:`hanzo_torch.backends.vulkan.build` with ``torch._register_device_module``).

One device (index 0) with one in-order queue.
"""
from __future__ import annotations

import torch


def _ext():
    from . import _need

    return _need()


def is_available() -> bool:
    from . import available

    return available()


def is_initialized() -> bool:
    from . import _ext as ext

    return ext is not None


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
