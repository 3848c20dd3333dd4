"""Host copies of packed weights in transparent huge pages (``load(..., mmap=False)``).

On the CPU a decode step streams every weight once, so its speed is the rate at which two or
more cores can read memory. Weights that stay views of the memory-mapped GGUF file live in
page-cache pages (4 KiB on x86-64); a private anonymous copy advised with
``madvise(MADV_HUGEPAGE)`` lives in huge pages (2 MiB on x86-64) wherever the kernel's transparent
huge pages allow it (``enabled`` = ``always`` or ``madvise``), and a huge page costs the stream one
TLB entry where small pages cost hundreds (under a hypervisor each miss is a two-level walk).

:func:`resolve_mmap` turns ``load``'s ``mmap`` argument into a decision, and :func:`copy_packed`
makes the copy: one anonymous mapping for all weights, each tensor on pages of its own.
"""
from __future__ import annotations

import mmap as _mmap
from typing import Callable, Optional, Sequence

import torch

__all__ = ["thp_mode", "huge_page_bytes", "mem_available", "check_mmap_arg", "resolve_mmap", "copy_packed", "empty_packed"]

_THP = "/sys/kernel/mm/transparent_hugepage"
_PAGE = _mmap.PAGESIZE


def thp_mode(path: str = _THP + "/enabled") -> Optional[str]:
    """The kernel's transparent-huge-page mode, the bracketed word of ``path``: ``"always"``,
    ``"madvise"`` or ``"never"``; None where the file is absent or unreadable (not Linux)."""
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def huge_page_bytes(path: str = _THP + "/hpage_pmd_size") -> int:
    """Bytes of one transparent huge page (``hpage_pmd_size``: 2 MiB on x86-64, 2-512 MiB on arm64
    by base page size); 2 MiB where the file is absent."""
    try:
        with open(path, encoding="ascii") as fh:
            v = int(fh.read().strip())
        return v if v > 0 else 2 << 20
    except (OSError, ValueError):
        return 2 << 20


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path, encoding="ascii") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None  # absent, or "max" (no limit)


def mem_available(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes a new allocation can take without swapping or meeting a memory limit: the smaller of
    ``MemAvailable`` in ``meminfo`` and, under a cgroup v2 limit, ``memory.max - memory.current``
    of ``cgroup`` (this process's group, as a container sees it). None where MemAvailable is
    absent."""
    avail = None
    try:
        with open(meminfo, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        return None
    limit, used = _read_int(cgroup + "/memory.max"), _read_int(cgroup + "/memory.current")
    if avail is not None and limit is not None and used is not None:
        avail = min(avail, max(0, limit - used))
    return avail


def check_mmap_arg(mmap, where: str = "load") -> None:
    """Raise TypeError unless ``mmap`` is None, True or False."""
    if mmap is not None and not isinstance(mmap, bool):
        raise TypeError(f"{where}: mmap must be None, True or False, got {type(mmap).__name__} {mmap!r}")


def resolve_mmap(mmap: Optional[bool], nbytes: int, *, thp: Optional[str] = None,
                 available: Optional[int] = None, where: str = "load") -> bool:
    """``load``'s ``mmap`` argument as a decision: True keeps the weights as views of the file.

    ``None`` (the default) copies when the kernel has transparent huge pages (``thp`` is
    ``"always"`` or ``"madvise"``) and the ``nbytes`` to copy are at most half of the ``available``
    memory; otherwise the weights stay mapped. ``thp`` and ``available`` default to
    :func:`thp_mode` and :func:`mem_available`.

    Raises:
        TypeError: ``mmap`` is not None or a bool.
        MemoryError: ``mmap=False`` was asked for and ``nbytes`` exceed the available memory.
    """
    check_mmap_arg(mmap, where)
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


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _huge_mapping(total: int):
    """``(buf, start)``: a private anonymous mapping of ``total`` bytes plus one huge page, advised
    for huge pages, and the offset of its first huge-page boundary; ``(None, None)`` for 0 bytes or
    where the platform has no ``MAP_PRIVATE`` (not a Unix)."""
    if not total or not (hasattr(_mmap, "MAP_PRIVATE") and hasattr(_mmap, "MAP_ANONYMOUS")):
        return None, None
    huge = huge_page_bytes()
    buf = _mmap.mmap(-1, total + huge, flags=_mmap.MAP_PRIVATE | _mmap.MAP_ANONYMOUS)
    if hasattr(buf, "madvise") and hasattr(_mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(_mmap.MADV_HUGEPAGE)  # before the first touch, so faults can take huge pages
        except OSError:  # a kernel built without transparent huge pages
            pass
    return buf, (-torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()) % huge


def copy_packed(tensors: Sequence[torch.Tensor],
                done: Optional[Callable[[torch.Tensor], None]] = None) -> list[torch.Tensor]:
    """Copies of uint8 CPU ``tensors`` (same shapes and bytes), laid out one after another in one
    new private anonymous mapping that starts on a huge-page boundary and is advised for huge pages
    (``madvise`` where the platform has it; advice only, never an error), each tensor starting on a
    page of its own and owning a storage of its own bytes (so saving one saves only its bytes).
    The mapping lives as long as any of the returned tensors. ``done(src)``, when given, is called
    after each source's bytes are copied (``load`` drops them from the file mapping there).
    Without ``mmap.MAP_PRIVATE`` (not a Unix), plain torch allocations.

    Raises:
        ValueError: a tensor that is not a uint8 CPU tensor.
    """
    for t in tensors:
        if t.dtype != torch.uint8 or t.device.type != "cpu":
            raise ValueError(f"copy_packed: need uint8 CPU tensors, got {t.dtype} on {t.device}")
    out = []
    for t, c in zip(tensors, empty_packed([t.numel() for t in tensors])):
        c = c.view(t.shape)
        c.copy_(t)
        out.append(c)
        if done is not None:
            done(t)
    return out


def empty_packed(sizes: Sequence[int]) -> list[torch.Tensor]:
    """Uninitialized 1-D uint8 tensors of ``sizes`` bytes in one new mapping laid out as
    :func:`copy_packed`'s (huge-page advised, each on a page of its own); plain torch allocations
    where the platform has no ``MAP_PRIVATE``.

    Raises:
        ValueError: a negative size.
    """
    if any(n < 0 for n in sizes):
        raise ValueError(f"empty_packed: sizes must be >= 0, got {list(sizes)}")
    buf, start = _huge_mapping(sum(_round_up(n, _PAGE) for n in sizes))
    out, off = [], 0
    for n in sizes:
        if n == 0 or buf is None:
            out.append(torch.empty(n, dtype=torch.uint8))
        else:  # frombuffer holds a reference to buf: the mapping outlives every view
            out.append(torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=start + off))
            off += _round_up(n, _PAGE)
    return out
