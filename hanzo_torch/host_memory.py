"""Host copies of packed weights in transparent huge pages (``load(..., mmap=False)``).

On the CPU a decode step streams every weight once, so its speed is the rate at which two or
more cores can read memory. Weights that stay views of the memory-mapped GGUF file live in
page-cache pages of 4 KiB; a private anonymous copy advised with ``madvise(MADV_HUGEPAGE)`` lives
in 2 MiB pages wherever the kernel's transparent huge pages allow it (``enabled`` = ``always`` or
``madvise``). Larger pages cost the stream fewer TLB misses (two-level walks under a hypervisor)
and let the hardware prefetchers run across what would be 4 KiB page boundaries.

:func:`resolve_mmap` turns ``load``'s ``mmap`` argument into a decision, and :func:`copy_packed`
makes the copy: one anonymous mapping for all weights, each tensor starting on a page boundary.
"""
from __future__ import annotations

import mmap as _mmap
from typing import Optional, Sequence

import torch

__all__ = ["thp_mode", "mem_available", "resolve_mmap", "copy_packed", "HUGE_PAGE"]

HUGE_PAGE = 2 << 20
"""Bytes of an x86-64 / arm64 transparent huge page (the mapping is aligned to it)."""
_ALIGN = 4096  # each tensor starts on a page of its own

_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = _THP_ENABLED) -> Optional[str]:
    """The kernel's transparent-huge-page mode, the bracketed word of ``path``: ``"always"``,
    ``"madvise"`` or ``"never"``; None where the file is absent or unreadable (not Linux)."""
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def mem_available(path: str = "/proc/meminfo") -> Optional[int]:
    """``MemAvailable`` of ``path`` in bytes (the kernel's estimate of memory a new allocation can
    take without swapping), None where it is absent."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def resolve_mmap(mmap: Optional[bool], nbytes: int, *, thp: Optional[str] = None,
                 available: Optional[int] = None, where: str = "load") -> bool:
    """``load``'s ``mmap`` argument as a decision: True keeps the weights as views of the file.

    ``None`` (the default) copies when the kernel has transparent huge pages (``thp`` is
    ``"always"`` or ``"madvise"``) and the ``nbytes`` of packed weights are at most half of the
    ``available`` memory; otherwise the weights stay mapped. ``thp`` and ``available`` default to
    :func:`thp_mode` and :func:`mem_available`.

    Raises:
        TypeError: ``mmap`` is not None or a bool.
        MemoryError: ``mmap=False`` was asked for and ``nbytes`` exceed the available memory.
    """
    if mmap is not None and not isinstance(mmap, bool):
        raise TypeError(f"{where}: mmap must be None, True or False, got {type(mmap).__name__} {mmap!r}")
    if mmap is True:
        return True
    if available is None:
        available = mem_available()
    if mmap is False:
        if available is not None and nbytes > available:
            raise MemoryError(f"{where}: mmap=False needs {nbytes / 2**30:.2f} GiB for a copy of the weights, "
                              f"{available / 2**30:.2f} GiB available; use mmap=True")
        return False
    thp = thp_mode() if thp is None else thp
    if thp not in ("always", "madvise"):
        return True
    return available is None or 2 * nbytes > available


def _anonymous(nbytes: int) -> tuple[torch.Tensor, object]:
    """A uint8 tensor of at least ``nbytes`` starting on a huge-page boundary, over a private
    anonymous mapping advised for huge pages where the platform has ``madvise``; plain torch
    memory elsewhere. Returns the tensor and the object owning its memory."""
    if hasattr(_mmap, "MAP_PRIVATE") and hasattr(_mmap, "MAP_ANONYMOUS"):
        buf = _mmap.mmap(-1, nbytes + HUGE_PAGE, flags=_mmap.MAP_PRIVATE | _mmap.MAP_ANONYMOUS)
        if hasattr(buf, "madvise") and hasattr(_mmap, "MADV_HUGEPAGE"):
            buf.madvise(_mmap.MADV_HUGEPAGE)  # before the first touch, so faults can take 2 MiB pages
        whole = torch.frombuffer(buf, dtype=torch.uint8)  # holds a reference to buf
        start = (-whole.data_ptr()) % HUGE_PAGE
        return whole[start:start + nbytes], buf
    t = torch.empty(nbytes, dtype=torch.uint8)
    return t, t


def copy_packed(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of uint8 CPU ``tensors`` (same shapes and bytes), laid out one after another in one
    new anonymous mapping (see the module docstring), each on its own page. The mapping lives as
    long as any of the returned tensors.

    Raises:
        ValueError: a tensor that is not a uint8 CPU tensor.
    """
    sizes = []
    for t in tensors:
        if t.dtype != torch.uint8 or t.device.type != "cpu":
            raise ValueError(f"copy_packed: need uint8 CPU tensors, got {t.dtype} on {t.device}")
        sizes.append(t.numel())
    total = sum((n + _ALIGN - 1) // _ALIGN * _ALIGN for n in sizes)
    if total == 0:
        return [t.clone() for t in tensors]
    flat, _owner = _anonymous(total)
    out, off = [], 0
    for t, n in zip(tensors, sizes):
        view = flat[off:off + n].view(t.shape)
        view.copy_(t)
        out.append(view)
        off += (n + _ALIGN - 1) // _ALIGN * _ALIGN
    return out

