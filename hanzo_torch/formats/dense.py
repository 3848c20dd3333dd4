"""Dense formats F32, F16 and BF16 (block size 1), and the block helpers every format shares.

A dense weight is a format like any other: one value per "block", ``type_size`` bytes each, so
it follows the packed-data convention (``uint8 [N, K * type_size]``) and goes through the same
registry, ops and kernels as the quantized formats.

Shared helpers (used by ``legacy``, ``kquants`` and ``q8_1``, and open to every format module):

* :func:`make_format` builds a :class:`~hanzo_torch.formats.Format` with its id, block size
  and type size read from ``gguf`` (never hard-coded).
* :func:`block_layout` turns a list of field sizes into byte slices and checks that they add
  up to gguf's type size (the size assertion ggml puts next to each block struct).
* :func:`check_blocks` validates a ``uint8 [n, type_size]`` argument.
* :func:`fp16_field` / :func:`fp16_bytes` read and write fp16 scale fields exactly as
  ``gguf.quants`` (numpy) does.

All byte reinterpretation assumes a little-endian host, as ggml files are little-endian.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import Format, register

__all__ = [
    "make_format",
    "block_layout",
    "check_blocks",
    "view_bytes_as",
    "fp16_field",
    "fp16_bytes",
    "le_bytes",
]


# ---------------------------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------------------------

def make_format(
    name: str,
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor],
    quantize_blocks: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    dense: bool = False,
) -> Format:
    """A :class:`Format` for ggml type ``name`` with id, block and type size taken from ``gguf``."""
    qtype = GGMLQuantizationType[name]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return Format(
        name=name,
        type_id=int(qtype),
        block_size=block_size,
        type_size=type_size,
        dequantize_blocks=dequantize_blocks,
        quantize_blocks=quantize_blocks,
        dense=dense,
    )


def block_layout(name: str, **field_bytes: int) -> dict[str, slice]:
    """Byte slices of the fields of one ggml block, in declaration order.

    ``block_layout("Q4_0", d=2, qs=16)`` returns ``{"d": slice(0, 2), "qs": slice(2, 18)}``.

    Raises:
        AssertionError: the sizes do not add up to ``gguf.GGML_QUANT_SIZES[name][1]`` (a layout
            that disagrees with gguf is a bug in hanzo-torch, caught at import).
    """
    out, pos = {}, 0
    for field, size in field_bytes.items():
        out[field] = slice(pos, pos + size)
        pos += size
    type_size = GGML_QUANT_SIZES[GGMLQuantizationType[name]][1]
    assert pos == type_size, f"{name}: block fields add up to {pos} bytes, gguf says {type_size}"
    return out


def check_blocks(blocks: torch.Tensor, name: str) -> None:
    """Raise ValueError unless ``blocks`` is ``uint8 [n, type_size]`` (type size of ggml type ``name``)."""
    type_size = GGML_QUANT_SIZES[GGMLQuantizationType[name]][1]
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8:
        raise ValueError(f"{name}: blocks must be a uint8 tensor, got {getattr(blocks, 'dtype', type(blocks))}")
    if blocks.dim() != 2 or blocks.shape[1] != type_size:
        raise ValueError(f"{name}: blocks must have shape [n, {type_size}], got {list(blocks.shape)}")


def view_bytes_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret the bytes of ``uint8 [n, m]`` as ``dtype [n, m // itemsize]``.

    Copies first when ``x`` is not contiguous or its storage offset is not a multiple of the
    item size (``Tensor.view(dtype)`` refuses those), so any slice of packed data works.
    """
    size = dtype.itemsize
    if not x.is_contiguous() or x.storage_offset() % size:
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(dtype)


def fp16_field(blocks: torch.Tensor, field: slice) -> torch.Tensor:
    """Read fp16 values stored little-endian at byte slice ``field`` of each block.

    Args:
        blocks: ``uint8 [n, type_size]`` (any strides, any storage offset).
        field: byte slice of even length.

    Returns:
        ``float32 [n, len(field) // 2]``. Every non-NaN value (subnormals and infinities
        included) is exact; NaN stays NaN (its payload is not preserved).
    """
    return view_bytes_as(blocks[:, field], torch.float16).float()


def le_bytes(v: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Little-endian bytes of non-negative integers ``v [n, k]`` (< 256**nbytes) -> ``uint8 [n, k*nbytes]``."""
    parts = [((v >> (8 * i)) & 0xFF).to(torch.uint8) for i in range(nbytes)]
    return torch.stack(parts, dim=-1).reshape(v.shape[0], v.shape[1] * nbytes)


def fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """Round ``float32 [n, k]`` to fp16 and return the bytes ``uint8 [n, 2k]``.

    Byte-identical to numpy's ``x.astype(np.float16)`` (what ``gguf.quants`` uses): round to
    nearest even, overflow to +-inf, subnormals rounded correctly; a NaN keeps its sign and the
    top 10 bits of its payload, turned into ``0x7c01`` if those are all zero (numpy's
    ``npy_floatbits_to_halfbits`` rule; ``torch.to(float16)`` alone would canonicalize NaNs).
    """
    x = x.to(torch.float32)
    bits = x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    n = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    nan_bits = 0x7C00 + ((n & 0x7FFFFF) >> 13)
    nan_bits = torch.where(nan_bits == 0x7C00, nan_bits + 1, nan_bits) | ((n >> 16) & 0x8000)
    bits = torch.where(torch.isnan(x), nan_bits.to(torch.int32), bits)
    return le_bytes(bits, 2)


# ---------------------------------------------------------------------------------------------
# F32: 4 bytes, IEEE binary32.  F16: 2 bytes, IEEE binary16.  BF16: 2 bytes, top half of binary32.
# ---------------------------------------------------------------------------------------------

def _f32_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "F32")
    # a fresh tensor: callers may treat the result as theirs (and custom ops must not alias)
    return blocks.clone(memory_format=torch.contiguous_format).view(torch.float32)


def _check_values(values: torch.Tensor, name: str) -> None:
    if values.dim() != 2 or values.shape[1] != 1:
        raise ValueError(f"{name}: values must have shape [n, 1], got {list(values.shape)}")


def _f32_quantize(values: torch.Tensor) -> torch.Tensor:
    _check_values(values, "F32")
    return values.to(torch.float32).contiguous().view(torch.uint8).clone()


def _f16_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "F16")
    return fp16_field(blocks, slice(0, 2))


def _f16_quantize(values: torch.Tensor) -> torch.Tensor:
    _check_values(values, "F16")
    return fp16_bytes(values)


def _bf16_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "BF16")
    # bf16 -> float32 is exact (the bf16 bits become the high half of the float32 bits)
    return view_bytes_as(blocks, torch.bfloat16).float()


def _bf16_quantize(values: torch.Tensor) -> torch.Tensor:
    _check_values(values, "BF16")
    # ggml_compute_fp32_to_bf16 (as gguf.quants.BF16): a NaN becomes a quiet NaN with its sign
    # and top payload bits; everything else rounds to nearest even, overflowing to +-inf.
    n = values.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    n = torch.where((n & 0x7FFFFFFF) > 0x7F800000, (n & 0xFFFF0000) | 0x00400000, n)
    n = (n + (0x7FFF + ((n >> 16) & 1))) >> 16
    return le_bytes(n & 0xFFFF, 2)


F32 = register(make_format("F32", _f32_dequantize, _f32_quantize, dense=True))
F16 = register(make_format("F16", _f16_dequantize, _f16_quantize, dense=True))
BF16 = register(make_format("BF16", _bf16_dequantize, _bf16_quantize, dense=True))
