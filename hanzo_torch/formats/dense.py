"""Dense formats F32, F16 and BF16 (block size 1).

A dense weight is a format like any other: one value per "block", ``type_size`` bytes each, so
it follows the packed-data convention (``uint8 [N, K * type_size]``) and goes through the same
registry, ops and kernels as the quantized formats. Reads and writes are bit-identical to
``gguf.quants`` (numpy), NaN payloads included (see :func:`~hanzo_torch.formats._bits.fp16_bytes`).
The generic byte helpers live in :mod:`hanzo_torch.formats._bits`.
"""
from __future__ import annotations

import torch

from . import register
from ._bits import (
    block_layout, check_blocks, check_values, f32, fp16_bytes, fp16_field, half, le_bytes, make_format, u16,
    view_bytes_as,
)

__all__ = ["F32", "F16", "BF16"]


# ---------------------------------------------------------------------------------------------
# F32: 4 bytes, IEEE binary32.  F16: 2 bytes, IEEE binary16.  BF16: 2 bytes, top half of binary32.
# ---------------------------------------------------------------------------------------------

def _f32_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "F32")
    # a fresh tensor: callers may treat the result as theirs (and custom ops must not alias)
    return blocks.clone(memory_format=torch.contiguous_format).view(torch.float32)


def _f32_quantize(values: torch.Tensor) -> torch.Tensor:
    return check_values(values, "F32").contiguous().view(torch.uint8).clone()


def _f16_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "F16")
    return fp16_field(blocks, slice(0, 2))


def _f16_quantize(values: torch.Tensor) -> torch.Tensor:
    return fp16_bytes(check_values(values, "F16"))


def _bf16_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "BF16")
    # bf16 -> float32 is exact (the bf16 bits become the high half of the float32 bits)
    return view_bytes_as(blocks, torch.bfloat16).float()


def _bf16_quantize(values: torch.Tensor) -> torch.Tensor:
    # ggml_compute_fp32_to_bf16 (as gguf.quants.BF16): a NaN becomes a quiet NaN with its sign
    # and top payload bits; everything else rounds to nearest even, overflowing to +-inf.
    n = check_values(values, "BF16").contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    n = torch.where((n & 0x7FFFFFFF) > 0x7F800000, (n & 0xFFFF0000) | 0x00400000, n)
    n = (n + (0x7FFF + ((n >> 16) & 1))) >> 16
    return le_bytes(n & 0xFFFF, 2)


F32 = register(make_format("F32", _f32_dequantize, _f32_quantize, dense=True, layout=block_layout("F32", v=f32())))
F16 = register(make_format("F16", _f16_dequantize, _f16_quantize, dense=True, layout=block_layout("F16", v=half())))
BF16 = register(make_format("BF16", _bf16_dequantize, _bf16_quantize, dense=True,
                            layout=block_layout("BF16", v=u16(scale="bf16"))))
