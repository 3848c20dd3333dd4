"""The quantized ``hanzo`` ops: ``dequantize``, ``quantize_q8_1``, ``mul_mat``, ``mul_mat_id``, ``get_rows``.

Each op is a ``torch.library.custom_op`` with the schema of docs/ARCHITECTURE.md, a fake
(meta) kernel that checks shapes and dtypes, and a default body that runs the fast kernel a
backend registered on the device's dispatch key (:mod:`hanzo_torch.ops._dispatch`), or else the
vectorized-torch reference below. ``HANZO_<OP>_FALLBACK=1`` (for example
``HANZO_MUL_MAT_FALLBACK=1``) forces the reference.

The references (:func:`dequantize_reference`, :func:`quantize_q8_1_reference`,
:func:`mul_mat_reference`, :func:`mul_mat_id_reference`, :func:`get_rows_reference`) are plain
Python functions, device-agnostic torch, usable as the oracle of a backend's kernels. They never
materialize more than :data:`CHUNK_BYTES` of dequantized float32 weight at a time.

Formats are passed as ggml names (``"Q4_K"``) and resolved through the format registry
(:func:`hanzo_torch.formats.get_format`); no code here knows about a particular format.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import torch

from .. import formats as _formats
from ..formats import Format, get_format
from . import spec as _spec
from .spec import OpSpec, compute_dtype, declare

__all__ = [
    "OPS",
    "CHUNK_BYTES",
    "dequantize_reference",
    "quantize_q8_1_reference",
    "mul_mat_reference",
    "mul_mat_id_reference",
    "get_rows_reference",
]

OPS = ("dequantize", "quantize_q8_1", "mul_mat", "mul_mat_id", "get_rows")
"""The ops this module defines (``torch.ops.hanzo.<name>``)."""

CHUNK_BYTES = 64 << 20
"""Most bytes of dequantized float32 weight a reference holds at once (64 MiB): bounds the
memory of ``mul_mat`` on a 151936 x 1536 output matrix (933 MB as float32) to 16 chunks."""

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # float64: reference only
from ..constants import Q8_1_BLOCK as _Q8_1_BLOCK, Q8_1_BYTES as _Q8_1_BYTES  # noqa: E402


# ---------------------------------------------------------------------- argument checks
# Shared by the fake kernels and the references, so a bad call fails the same way when traced
# (torch.compile, meta tensors) and when run. They read shapes and dtypes only.
def _fmt_and_row_length(qtype: str, row_bytes, op: str) -> tuple[Format, int]:
    fmt = get_format(qtype)
    if row_bytes % fmt.type_size != 0:
        raise ValueError(f"{op}: {fmt.name} rows of {row_bytes} bytes are not a whole number of "
                         f"{fmt.type_size}-byte blocks")
    return fmt, row_bytes // fmt.type_size * fmt.block_size


def _check_row_length(fmt: Format, K, op: str) -> None:
    if K % fmt.block_size != 0:
        raise ValueError(f"{op}: K={K} is not a multiple of the {fmt.name} block size {fmt.block_size}")


def _check_packed(w: torch.Tensor, dim: int, op: str, what: str) -> None:
    if w.dtype != torch.uint8:
        raise ValueError(f"{op}: packed weight must be uint8, got {w.dtype}")
    if w.dim() != dim:
        raise ValueError(f"{op}: packed weight must be {what}, got shape {tuple(w.shape)}")


def _check_act(x: torch.Tensor, op: str) -> None:
    if x.dtype not in _ACT_DTYPES:
        raise ValueError(f"{op}: x must be float32, bfloat16 or float16 (float64: reference only), got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least one dim")


def _check_ids_dtype(ids: torch.Tensor, op: str) -> None:
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{op}: ids must be an integer tensor, got {ids.dtype}")


def _check_same_device(op: str, *tensors: torch.Tensor) -> None:
    devs = {t.device for t in tensors}
    if len(devs) > 1:
        raise ValueError(f"{op}: tensors are on different devices: {sorted(map(str, devs))}")


def _check_rows_fit(x: torch.Tensor, w: torch.Tensor, qtype: str, op: str) -> Format:
    """The format of ``qtype``, after checking that ``w``'s packed rows hold exactly K = x.shape[-1] values."""
    fmt = get_format(qtype)
    K = x.shape[-1]
    _check_row_length(fmt, K, op)
    if w.shape[-1] != fmt.row_bytes(K):
        raise ValueError(f"{op}: x has K={K}, which needs {fmt.row_bytes(K)} bytes per {fmt.name} row, "
                         f"but w has rows of {w.shape[-1]} bytes (shape {tuple(w.shape)})")
    return fmt


def _check_mul_mat(x: torch.Tensor, w: torch.Tensor, qtype: str) -> Format:
    _check_act(x, "mul_mat")
    _check_packed(w, 2, "mul_mat", "2-D [N, row_bytes]")
    return _check_rows_fit(x, w, qtype, "mul_mat")


def _check_mul_mat_id(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, qtype: str) -> Format:
    _check_act(x, "mul_mat_id")
    _check_packed(w, 3, "mul_mat_id", "3-D [E, N, row_bytes]")
    _check_ids_dtype(ids, "mul_mat_id")
    if ids.dim() != 2:
        raise ValueError(f"mul_mat_id: ids must be [T, k], got shape {tuple(ids.shape)}")
    if x.dim() == 2:
        if x.shape[0] != ids.shape[0]:
            raise ValueError(f"mul_mat_id: x [T, K] has T={x.shape[0]} but ids has T={ids.shape[0]}")
    elif x.dim() == 3:
        if x.shape[0] != ids.shape[0] or x.shape[1] != ids.shape[1]:
            raise ValueError(f"mul_mat_id: x [T, k, K] of shape {tuple(x.shape)} does not match ids "
                             f"{tuple(ids.shape)}")
    else:
        raise ValueError(f"mul_mat_id: x must be [T, K] or [T, k, K], got shape {tuple(x.shape)}")
    return _check_rows_fit(x, w, qtype, "mul_mat_id")


def _check_ids_range(ids: torch.Tensor, n: int, op: str, what: str) -> torch.Tensor:
    """``ids`` as int64, verified to lie in ``[0, n)``.

    On the CPU the check is exact and raises IndexError. Elsewhere it must not synchronize with
    the host: a device-side assertion (``torch._assert_async``) fires, and the ids are clamped so
    that no kernel ever reads out of bounds.
    """
    flat = ids.reshape(-1).to(torch.int64)
    if flat.numel() == 0:
        return flat
    if flat.device.type == "cpu":
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise IndexError(f"{op}: {what} id {bad} is out of range [0, {n})")
        return flat
    torch._assert_async(((flat >= 0) & (flat < n)).all(), f"{op}: {what} id out of range [0, {n})")
    return flat.clamp(0, max(n - 1, 0))


# ---------------------------------------------------------------------- references
def dequantize_reference(data: torch.Tensor, qtype: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Unpack ``data`` (``uint8``, packed rows) into a ``dtype`` tensor of logical ``shape``.

    Equal to ``gguf.quants.dequantize`` (bit for bit in float32); see
    :func:`hanzo_torch.formats.dequantize` for the errors raised. Never returns a view of ``data``.
    """
    out = _formats.dequantize(data, qtype, shape, dtype)
    # dense formats may come back as a view of the input; a custom op must not alias it
    return out.clone() if _shares_storage(out, data) else out


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def quantize_q8_1_reference(x: torch.Tensor) -> torch.Tensor:
    """ggml ``block_q8_1`` quantization of the activations ``x`` ``[..., K]`` (K % 32 == 0).

    Returns ``uint8 [..., K // 32 * 36]``: per 32 values an fp16 scale ``d = amax / 127``, an
    fp16 ``s = d * sum(qs)`` and 32 int8 ``qs = round(x / d)`` (``ggml-common.h`` ``block_q8_1``),
    via :func:`hanzo_torch.formats.q8_1.quantize_q8_1`.
    """
    from ..formats.q8_1 import quantize_q8_1 as _q8_1

    return _q8_1(x)


def _dequant_rows(fmt: Format, w: torch.Tensor, K: int) -> torch.Tensor:
    """float32 ``[..., K]`` from packed rows ``uint8 [..., row_bytes]``."""
    lead = tuple(w.shape[:-1])
    return fmt.dequantize_blocks(w.reshape(-1, fmt.type_size)).reshape(*lead, K)


def _rows_per_chunk(K: int) -> int:
    return max(1, CHUNK_BYTES // (4 * max(K, 1)))


def _mm_packed(x2: torch.Tensor, w: torch.Tensor, fmt: Format, K: int) -> torch.Tensor:
    """``x2 [M, K] @ dequant(w [N, rb])^T -> [M, N]`` in x2's dtype (float32 or float64), dequantizing
    ``w`` in row chunks."""
    N = w.shape[0]
    step = _rows_per_chunk(K)
    if N <= step:
        return x2 @ _dequant_rows(fmt, w, K).to(x2.dtype).t()
    out = x2.new_empty(x2.shape[0], N)
    for n0 in range(0, N, step):
        out[:, n0:n0 + step] = x2 @ _dequant_rows(fmt, w[n0:n0 + step], K).to(x2.dtype).t()
    return out


def mul_mat_reference(x: torch.Tensor, w: torch.Tensor, qtype: str) -> torch.Tensor:
    """``y = x @ W^T`` with ``W`` packed in ggml format ``qtype``.

    Args:
        x: ``[..., K]`` float32, bfloat16 or float16 (float64: reference only, computed in float64).
        w: ``uint8 [N, row_bytes(K)]``, packed rows of ``W`` (logical ``[N, K]``), same device.
        qtype: ggml format name.

    Returns:
        ``[..., N]`` in ``x.dtype``. ``x`` is converted to float32, ``W`` is dequantized in
        float32 in chunks of at most :data:`CHUNK_BYTES` and the products are accumulated in
        float32; the result is rounded to ``x.dtype`` once.

    Raises:
        ValueError: wrong dtypes or ranks, K not a multiple of the block size, row bytes that do
            not match K, tensors on different devices, unknown format.
    """
    fmt = _check_mul_mat(x, w, qtype)
    _check_same_device("mul_mat", x, w)
    K, N = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, K).to(compute_dtype(x))
    y = _mm_packed(x2, w, fmt, K)
    return y.reshape(*x.shape[:-1], N).to(x.dtype)


def mul_mat_id_reference(
    x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, qtype: str, *, group_on_host: Optional[bool] = None
) -> torch.Tensor:
    """``y[t, j] = x[t(, j)] @ W[ids[t, j]]^T`` for a stacked expert weight ``W``.

    Args:
        x: ``[T, K]`` (every selected expert sees the token's row) or ``[T, k, K]`` (one row per
            selection), float32/bfloat16/float16.
        w: ``uint8 [E, N, row_bytes(K)]``, packed expert weights.
        ids: integer ``[T, k]``, expert of each selection, in ``[0, E)``.
        qtype: ggml format name.
        group_on_host: internal strategy switch (default: True when ``ids`` is on the CPU).
            True: sort the ``T*k`` selections by expert on the host and dequantize each used
            expert once (good for prefill; reads ``ids`` on the host, which is free on the CPU).
            False: gather the packed rows of each selection's expert on the device, in chunks
            of at most :data:`CHUNK_BYTES` float32 (never reads ``ids`` on the host, so it is
            graph-capturable; re-dequantizes an expert per selection).

    Returns:
        ``[T, k, N]`` in ``x.dtype``, accumulated in float32.

    Raises:
        ValueError: shape/dtype mismatch, K not a multiple of the block size.
        IndexError: an id outside ``[0, E)`` (on the CPU; on other devices a device-side assert).
    """
    fmt = _check_mul_mat_id(x, w, ids, qtype)
    _check_same_device("mul_mat_id", x, w, ids)
    E, N = w.shape[0], w.shape[1]
    T, k = ids.shape
    K = x.shape[-1]
    flat = _check_ids_range(ids, E, "mul_mat_id", "expert")
    xs = (x.unsqueeze(1).expand(T, k, K) if x.dim() == 2 else x).reshape(T * k, K).to(compute_dtype(x))
    if group_on_host is None:
        group_on_host = ids.device.type == "cpu"
    y = xs.new_zeros(T * k, N)
    if T * k == 0 or N == 0:
        return y.reshape(T, k, N).to(x.dtype)
    if group_on_host:
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E).tolist()
        start = 0
        for e, c in enumerate(counts):
            if c:
                rows = order[start:start + c]
                y[rows] = _mm_packed(xs[rows], w[e], fmt, K)
                start += c
    else:
        per_sel = N * K * 4
        sel_step = max(1, CHUNK_BYTES // max(per_sel, 1))
        row_step = _rows_per_chunk(K) if sel_step == 1 else N
        for p0 in range(0, T * k, sel_step):
            sel = flat[p0:p0 + sel_step]
            xp = xs[p0:p0 + sel_step].unsqueeze(-1)  # [P, K, 1]
            for n0 in range(0, N, row_step):
                wp = w[:, n0:n0 + row_step].index_select(0, sel)  # [P, n, rb] packed, gathered on device
                y[p0:p0 + sel_step, n0:n0 + row_step] = torch.bmm(_dequant_rows(fmt, wp, K).to(xp.dtype), xp).squeeze(-1)
    return y.reshape(T, k, N).to(x.dtype)


def get_rows_reference(w: torch.Tensor, ids: torch.Tensor, qtype: str, dtype: torch.dtype) -> torch.Tensor:
    """Embedding lookup from a packed table: dequantizes only the selected rows.

    Args:
        w: ``uint8 [V, row_bytes]``, packed rows of a ``[V, H]`` table.
        ids: integer ``[...]`` in ``[0, V)``, same device.
        qtype: ggml format name.
        dtype: result dtype.

    Returns:
        ``dtype [..., H]``, each row equal to the dequantized row ``ids[...]`` (bit-identical to
        ``gguf.quants.dequantize`` in float32).

    Raises:
        ValueError: ``w`` not 2-D uint8 / not whole blocks, ids not integer.
        IndexError: an id outside ``[0, V)`` (on the CPU; on other devices a device-side assert).
    """
    _check_packed(w, 2, "get_rows", "2-D [V, row_bytes]")
    _check_ids_dtype(ids, "get_rows")
    _check_same_device("get_rows", w, ids)
    fmt, H = _fmt_and_row_length(qtype, w.shape[1], "get_rows")
    flat = _check_ids_range(ids, w.shape[0], "get_rows", "row")
    rows = _dequant_rows(fmt, w.index_select(0, flat), H)
    return rows.reshape(*ids.shape, H).to(dtype)


# ---------------------------------------------------------------------- argument checks by op
def _check_dequantize_args(data, qtype, shape, dtype) -> None:
    fmt = get_format(qtype)
    if data.dtype != torch.uint8:
        raise ValueError(f"dequantize: packed data must be uint8, got {data.dtype}")
    if len(shape) == 0:
        raise ValueError("dequantize: shape must have at least one dim")
    _check_row_length(fmt, shape[-1], "dequantize")
    want = math.prod(shape[:-1]) * fmt.row_bytes(shape[-1])
    have = data.numel()
    msg = f"dequantize: {fmt.name} tensor of shape {list(shape)} needs {want} bytes"
    if isinstance(have, int) and isinstance(want, int):
        if have != want:  # the reference's error type for concrete sizes
            raise ValueError(msg)
    else:  # symbolic sizes (fake tensors under dynamic shapes): a guard the tracer can record
        torch._check(have == want, lambda: msg)


def _check_q8_1(x: torch.Tensor) -> None:
    _check_act(x, "quantize_q8_1")
    if x.dtype == torch.float64:
        raise ValueError("quantize_q8_1: x must be float32, bfloat16 or float16, got torch.float64")
    if x.shape[-1] % _Q8_1_BLOCK != 0:
        raise ValueError(f"quantize_q8_1: K={x.shape[-1]} is not a multiple of {_Q8_1_BLOCK}")


def _check_mul_mat_args(x, w, qtype):
    _check_mul_mat(x, w, qtype)
    _check_same_device("mul_mat", x, w)


def _check_mul_mat_id_args(x, w, ids, qtype):
    _check_mul_mat_id(x, w, ids, qtype)
    _check_same_device("mul_mat_id", x, w, ids)


def _check_get_rows(w, ids, qtype) -> int:
    _check_packed(w, 2, "get_rows", "2-D [V, row_bytes]")
    _check_ids_dtype(ids, "get_rows")
    return _fmt_and_row_length(qtype, w.shape[1], "get_rows")[1]


def _check_get_rows_args(w, ids, qtype, dtype):
    _check_get_rows(w, ids, qtype)
    _check_same_device("get_rows", w, ids)


# ---------------------------------------------------------------------- trace forms (torch.export)
# Static shapes only: ids are clamped instead of range-checked (an exported program cannot raise)
# and experts are gathered on the device instead of grouped on the host.
def _row_length(w: torch.Tensor, qtype: str) -> int:
    fmt = get_format(qtype)
    return w.shape[-1] // fmt.type_size * fmt.block_size


def _mul_mat_trace(x: torch.Tensor, w: torch.Tensor, qtype: str) -> torch.Tensor:
    fmt = get_format(qtype)
    K, N = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, K).to(compute_dtype(x))
    step = _rows_per_chunk(K)
    parts = [x2 @ _dequant_rows(fmt, w[n0:n0 + step], K).to(x2.dtype).t() for n0 in range(0, N, step)]
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return y.reshape(*x.shape[:-1], N).to(x.dtype)


def _mul_mat_id_trace(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, qtype: str) -> torch.Tensor:
    fmt = get_format(qtype)
    E, N = w.shape[0], w.shape[1]
    T, k = ids.shape
    K = x.shape[-1]
    flat = ids.reshape(-1).to(torch.int64).clamp(0, E - 1)
    xs = (x.unsqueeze(1).expand(T, k, K) if x.dim() == 2 else x).reshape(T * k, K).to(compute_dtype(x))
    step = max(1, CHUNK_BYTES // (4 * N * K))
    parts = []
    for p0 in range(0, T * k, step):
        wp = w.index_select(0, flat[p0:p0 + step])  # [P, N, rb] uint8
        parts.append(torch.bmm(_dequant_rows(fmt, wp, K).to(xs.dtype), xs[p0:p0 + step].unsqueeze(-1)).squeeze(-1))
    y = parts[0] if len(parts) == 1 else torch.cat(parts)
    return y.reshape(T, k, N).to(x.dtype)


def _get_rows_trace(w: torch.Tensor, ids: torch.Tensor, qtype: str, dtype: torch.dtype) -> torch.Tensor:
    H = _row_length(w, qtype)
    flat = ids.reshape(-1).to(torch.int64).clamp(0, w.shape[0] - 1)
    return _dequant_rows(get_format(qtype), w.index_select(0, flat), H).reshape(*ids.shape, H).to(dtype)


def _dequantize_trace(data: torch.Tensor, qtype: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    shape = tuple(shape)
    rows = _dequant_rows(get_format(qtype), data.reshape(-1, data.shape[-1]), shape[-1])
    return rows.reshape(shape).to(dtype)


# ---------------------------------------------------------------------- autograd (w.r.t. x only)
# The packed weights are constants; gradients flow to the activations so that a model with
# GGUFTensor weights can sit inside a trainable graph (adapters, prompt tuning). The backward
# products dequantize the weight in chunks with hanzo::dequantize, so they trace under
# torch.compile like the forward. Faster than differentiating the reference (no recomputation).
def _mul_mat_setup_context(ctx, inputs, output):
    x, w, qtype = inputs
    ctx.save_for_backward(w)
    ctx.qtype, ctx.K, ctx.x_dtype = qtype, x.shape[-1], x.dtype


BACKWARD_TILE_BYTES = 4 << 20
"""Most bytes of dequantized weight one ``mul_mat`` backward tile holds (4 MiB: 682 rows of 1536
float32 values, which stay in the cache between their dequantization and their GEMM)."""


def _bf16_native(device: torch.device) -> bool:
    """Whether bfloat16 GEMMs are fast on ``device``: on the CPU only with native bfloat16
    instructions (AVX-512 BF16, AMX); on an AVX2 CPU torch's bfloat16 GEMM runs 100x slower than
    float32 (AMD EPYC AVX2: 0.6 against 75 GFLOP/s)."""
    if device.type != "cpu":
        return True
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


_BF16_WARNED = []


def _bf16_backward(device: torch.device) -> bool:
    if os.environ.get("HANZO_LORA_BF16_BACKWARD", "0") in ("", "0"):
        return False
    if _bf16_native(device):
        return True
    if not _BF16_WARNED:
        _BF16_WARNED.append(True)
        import warnings

        warnings.warn("HANZO_LORA_BF16_BACKWARD=1 ignored: this CPU has no native bfloat16 GEMM (it would be "
                      "slower than float32); the mul_mat backward stays float32", RuntimeWarning, stacklevel=2)
    return False


def _mul_mat_backward(ctx, grad):
    # gx = g @ deq(W), W dequantized per tile of rows and accumulated into gx in place; the
    # tiles are never all alive at once. HANZO_LORA_BF16_BACKWARD=1 (where bfloat16 GEMMs are
    # native): tiles and g in bfloat16, each tile's product rounded to bfloat16 and summed in
    # float32 (float32 x only; float64 keeps the exact path).
    (w,) = ctx.saved_tensors
    N, K = w.shape[0], ctx.K
    cd = torch.float64 if ctx.x_dtype == torch.float64 else torch.float32
    bf16 = cd == torch.float32 and _bf16_backward(grad.device)
    g2 = grad.reshape(-1, N).to(torch.bfloat16 if bf16 else cd)
    gx = torch.zeros(g2.shape[0], K, dtype=cd, device=g2.device)
    step = max(1, BACKWARD_TILE_BYTES // ((2 if bf16 else cd.itemsize) * max(K, 1)))
    for n0 in range(0, N, step):
        wc = w[n0:n0 + step]
        tile = torch.ops.hanzo.dequantize(wc, ctx.qtype, [wc.shape[0], K], g2.dtype)
        if bf16:
            gx += torch.mm(g2[:, n0:n0 + step], tile).float()
        else:
            gx.addmm_(g2[:, n0:n0 + step], tile)
    return gx.reshape(*grad.shape[:-1], K).to(ctx.x_dtype), None, None


def _mul_mat_id_setup_context(ctx, inputs, output):
    x, w, ids, qtype = inputs
    ctx.save_for_backward(w, ids)
    ctx.qtype, ctx.K, ctx.x_dtype, ctx.x_dim = qtype, x.shape[-1], x.dtype, x.dim()


def _mul_mat_id_backward(ctx, grad):
    w, ids = ctx.saved_tensors
    E, N = w.shape[0], w.shape[1]
    T, k = ids.shape
    K = ctx.K
    cd = torch.float64 if ctx.x_dtype == torch.float64 else torch.float32
    flat = ids.reshape(-1).to(torch.int64).clamp(0, max(E - 1, 0))  # range checked in the forward
    g = grad.reshape(T * k, 1, N).to(cd)
    step = max(1, CHUNK_BYTES // max(N * K * 4, 1))
    parts = []
    for p0 in range(0, T * k, step):
        sel = flat[p0:p0 + step]
        wp = w.index_select(0, sel)
        wd = torch.ops.hanzo.dequantize(wp, ctx.qtype, [sel.shape[0], N, K], cd)
        parts.append(torch.bmm(g[p0:p0 + step], wd))
    gx = (torch.cat(parts) if parts else g.new_zeros(0, 1, K)).reshape(T, k, K)
    if ctx.x_dim == 2:
        gx = gx.sum(1)
    return gx.to(ctx.x_dtype), None, None, None


# ---------------------------------------------------------------------- the op table entries
dequantize = declare(OpSpec(
    "dequantize", "(Tensor data, str qtype, SymInt[] shape, ScalarType dtype) -> Tensor",
    check=_check_dequantize_args, reference=dequantize_reference, trace=_dequantize_trace, tolerance="exact",
    outputs=lambda data, qtype, shape, dtype: data.new_empty(tuple(shape), dtype=dtype)))

quantize_q8_1 = declare(OpSpec(
    "quantize_q8_1", "(Tensor x) -> Tensor", check=_check_q8_1, reference=quantize_q8_1_reference,
    tolerance="same_bytes",
    outputs=lambda x: x.new_empty(*x.shape[:-1], x.shape[-1] // _Q8_1_BLOCK * _Q8_1_BYTES, dtype=torch.uint8)))

mul_mat = declare(OpSpec(
    "mul_mat", "(Tensor x, Tensor w, str qtype) -> Tensor", check=_check_mul_mat_args,
    reference=mul_mat_reference, trace=_mul_mat_trace, tolerance="contraction",
    outputs=lambda x, w, qtype: x.new_empty(*x.shape[:-1], w.shape[0]),
    backward=(_mul_mat_setup_context, _mul_mat_backward)))

mul_mat_id = declare(OpSpec(
    "mul_mat_id", "(Tensor x, Tensor w, Tensor ids, str qtype) -> Tensor", check=_check_mul_mat_id_args,
    reference=mul_mat_id_reference, trace=_mul_mat_id_trace, tolerance="contraction",
    outputs=lambda x, w, ids, qtype: x.new_empty(ids.shape[0], ids.shape[1], w.shape[1]),
    backward=(_mul_mat_id_setup_context, _mul_mat_id_backward)))

get_rows = declare(OpSpec(
    "get_rows", "(Tensor w, Tensor ids, str qtype, ScalarType dtype) -> Tensor", check=_check_get_rows_args,
    reference=get_rows_reference, trace=_get_rows_trace, tolerance="exact",
    outputs=lambda w, ids, qtype, dtype: w.new_empty(*ids.shape, _check_get_rows(w, ids, qtype), dtype=dtype)))


def check_args(op: str, *args) -> None:
    """Run ``op``'s argument checks (the ones its fake kernel and reference run); raises their errors."""
    _spec.check_args(op, *args)
