"""C++ CPU kernels of the fused transformer ops (``csrc/cpu/fused.cpp``), called directly.

These functions have the signatures of the references in :mod:`hanzo_torch.ops.fused` and run the
C++ kernel itself (``torch.ops.hanzo_cpu.*``), whatever the dispatch state: for tests and
benchmarks that want the kernel, not the op. ``torch.ops.hanzo.<op>`` on CPU tensors reaches the
same kernels through the CPU dispatch key (csrc/cpu/ops.cpp). If the extension cannot be built,
they run the references.

Maths (float32 whatever the input dtype; one rounding to the input dtype at the end):
    rms_norm / add_rms_norm: one pass per row; ``x + residual`` is rounded to the input dtype
        before the norm, as in the reference.
    qk_norm_rope: per-head RMSNorm (optional) then NEOX RoPE with the reference's float32
        ``inv_freq``/angle arithmetic.
    kv_cache_write: caches f32/f16/bf16 or q8_0 blocks (uint8), whatever k/v's dtype: a copy
        when the dtypes match, else per row a rounding to nearest even or ggml's q8_0 quantizer.
    qk_norm_rope_kv_write: the two kernels above in one call (the rotated k rounded to the
        activation dtype before the cache write, as the two ops give it): bit-identical to them.
    attention: one query token (T = 1, decode): per (batch, token, KV head, chunk of 256 keys
        of ``0..position``) each key and value row is read and converted to float32 once for the
        G query heads of the group; chunks run on separate threads and are merged by their
        softmax maxima and sums (one chunk is the exact max-subtracted softmax). T > 1 (prompts,
        chunked prefill): flash-style tiles. A query tile of ~48 rows (tokens x the G heads of
        one KV head) meets key tiles of 64 keys up to the tile's last position; each key tile is
        converted to float32 once for all those rows, scores are masked per row at its own
        position, and an online softmax (running max and sum, float32) accumulates P*V, so no
        score row longer than one key tile exists. Few query tiles on a long context split
        their key range over threads (merged like the decode chunks). P*V in float32
        throughout; only the live prefix ``0..max(positions)`` of the cache is read. ``impl``
        (eager/flash) is an accuracy/memory choice of the references; this kernel gives the
        same maths for all. :func:`use_attention_prefill` selects the earlier prompt kernel
        (two BLAS GEMMs per token tile on a float32 copy of the live prefix) for an A/B.
    moe_route: torch's float32 softmax, then top-k by a partial sort with ties to the lower
        expert index and the optional renormalization in C++.

Tolerance against the references (tests/test_cpu_fused.py): float32 results agree to ~1e-5
relative (summation order and libm differ); bf16/f16 results to one rounding of the dtype.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import Tensor

from ...ops import fused as _ref

__all__ = ["rms_norm", "add_rms_norm", "swiglu", "qk_norm_rope", "kv_cache_write", "qk_norm_rope_kv_write", "attention",
           "moe_route", "OPS", "ATTENTION_PREFILL_PATHS", "use_attention_prefill",
           "ATTENTION_DECODE_PATHS", "use_attention_decode"]

OPS = ("rms_norm", "add_rms_norm", "swiglu", "qk_norm_rope", "kv_cache_write", "qk_norm_rope_kv_write", "attention",
       "moe_route")


def _kernel(name: str):
    from . import extension

    return getattr(torch.ops.hanzo_cpu, name).default if extension() is not None else None


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    k = _kernel("rms_norm")
    return _ref.rms_norm_reference(x, w, eps) if k is None else k(x, w, eps)


def add_rms_norm(x: Tensor, residual: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    k = _kernel("add_rms_norm")
    return _ref.add_rms_norm_reference(x, residual, w, eps) if k is None else k(x, residual, w, eps)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    k = _kernel("swiglu")
    return _ref.swiglu_reference(gate, up) if k is None else k(gate, up)


def qk_norm_rope(q: Tensor, k: Tensor, q_w: Optional[Tensor], k_w: Optional[Tensor], positions: Tensor,
                 theta: float, eps: float) -> tuple[Tensor, Tensor]:
    op = _kernel("qk_norm_rope")
    if op is None:
        return _ref.qk_norm_rope_reference(q, k, q_w, k_w, positions, theta, eps)
    return op(q, k, q_w, k_w, positions, theta, eps)


def kv_cache_write(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> None:
    op = _kernel("kv_cache_write")
    if op is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        _ref.kv_cache_write_reference(k_cache, v_cache, k, v, positions)
        return
    op(k_cache, v_cache, k, v, positions)


def qk_norm_rope_kv_write(q: Tensor, k: Tensor, v: Tensor, q_w: Optional[Tensor], k_w: Optional[Tensor],
                          k_cache: Tensor, v_cache: Tensor, positions: Tensor, theta: float, eps: float) -> Tensor:
    op = _kernel("qk_norm_rope_kv_write")
    if op is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return _ref.qk_norm_rope_kv_write_reference(q, k, v, q_w, k_w, k_cache, v_cache, positions, theta, eps)
    return op(q, k, v, q_w, k_w, k_cache, v_cache, positions, theta, eps)


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor, scale: float,
              impl: str = "auto") -> Tensor:
    op = _kernel("attention")
    if op is None:
        return _ref.attention_reference(q, k_cache, v_cache, positions, scale, impl)
    return op(q, k_cache, v_cache, positions, scale)


ATTENTION_PREFILL_PATHS = ("flash", "gemm", "flash-dot")
"""Kernels of CPU attention calls with T > 1 query tokens: ``flash`` (the default: online-softmax
tiles, a prompt tile's scores by a GEMM over its key tile transposed), ``gemm`` (the earlier
kernel: BLAS GEMM tiles from 8 tokens, the decode kernel below) and ``flash-dot`` (the flash tiles
with every tile's scores as dot products over the head dimension)."""


@contextlib.contextmanager
def use_attention_prefill(path: str) -> Iterator[None]:
    """Run CPU attention calls of T > 1 query tokens with kernel ``path`` inside the block.

    ``path`` is one of :data:`ATTENTION_PREFILL_PATHS`. The choice is process-wide (every thread,
    every caller of ``torch.ops.hanzo.attention`` on CPU tensors) and is restored on exit; it is
    meant for comparing the kernels in one process (tests, benchmarks).

    Raises:
        ValueError: ``path`` is not one of :data:`ATTENTION_PREFILL_PATHS`.
        RuntimeError: the C++ extension cannot be built.
    """
    yield from _switched("use_attention_prefill", ATTENTION_PREFILL_PATHS, path, "set_attention_prefill")


def _switched(name: str, paths: tuple, path: str, setter: str) -> Iterator[None]:
    """Body of the ``use_attention_*`` context managers: set the kernel ``path`` (an index into
    ``paths``) with the extension's ``setter`` op, yield, restore the previous one."""
    if path not in paths:
        raise ValueError(f"{name}: path must be one of {paths}, got {path!r}")
    if _kernel("attention") is None:
        raise RuntimeError(f"{name}: the C++ CPU kernels are not available")
    op = getattr(torch.ops.hanzo_cpu, setter).default
    prev = op(paths.index(path))
    try:
        yield
    finally:
        op(prev)


ATTENTION_DECODE_PATHS = ("flash", "rows")
"""Kernels of CPU attention calls with one query token: ``flash`` (the default: the prefill's
tiles of 64 keys, register-tiled over the G query heads of a group, an f16 cache read in place)
and ``rows`` (split-K over one key or value row at a time)."""


@contextlib.contextmanager
def use_attention_decode(path: str) -> Iterator[None]:
    """Run CPU attention calls of one query token with kernel ``path`` inside the block.

    ``path`` is one of :data:`ATTENTION_DECODE_PATHS`; process-wide and restored on exit, as
    :func:`use_attention_prefill` (for comparing the kernels in one process).

    Raises:
        ValueError: ``path`` is not one of :data:`ATTENTION_DECODE_PATHS`.
        RuntimeError: the C++ extension cannot be built.
    """
    yield from _switched("use_attention_decode", ATTENTION_DECODE_PATHS, path, "set_attention_decode")


def moe_route(logits: Tensor, k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    op = _kernel("moe_route")
    if op is None:
        return _ref.moe_route_reference(logits, k, normalize)
    return op(torch.softmax(logits.float(), dim=-1), k, normalize)
