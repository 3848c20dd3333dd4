"""q8_1: ggml's 8-bit activation format for integer dot products against quantized weights.

Block (``ggml-common.h``), 32 values, 36 bytes, 9.0 bits per value::

    struct block_q8_1 {
        ggml_half d;       // scale: x ~= d * qs[i]
        ggml_half s;       // d * sum(qs[i])
        int8_t    qs[32];  // quants
    };

Quantization follows ggml's CPU reference ``quantize_row_q8_1_ref`` (``ggml-quants.c``) in
float32: ``d = amax / 127`` (amax the largest ``|x|`` of the block), ``id = d ? 1/d : 0``,
``qs[i] = roundf(x[i] * id)`` (ties away from zero), stored ``d = fp16(d)`` and
``s = fp16(float(sum(qs)) * d)`` where ``d`` is the float32 scale before its fp16 rounding.
(ggml's CUDA quantizer stores the fp16 of the sum of the unquantized ``x`` as ``s`` instead; the
two agree to rounding. Kernels that use ``s`` must not depend on which.)

With ``s``, a weight format with a per-block offset ``m`` (Q4_1, Q5_1, Q4_K's ``dmin * m``)
folds its offset term into one multiply: ``sum(x * (dw * q + m)) ~= dw * d * dot(q, qs) + m * s``.
"""
from __future__ import annotations

import torch

from ._bits import fp16_bytes, fp16_field
from .legacy import q8_0_scale_and_codes

__all__ = ["QK8_1", "Q8_1_BLOCK_BYTES", "quantize_q8_1", "dequantize_q8_1"]

QK8_1 = 32              # values per block
Q8_1_BLOCK_BYTES = 36   # 2 (d) + 2 (s) + 32 (qs)


def quantize_q8_1(x: torch.Tensor) -> torch.Tensor:
    """Quantize activations to ggml q8_1 blocks.

    Args:
        x: floating tensor ``[..., K]`` (float32, bfloat16 or float16; computed in float32), on
            any device. K must be a multiple of 32.

    Returns:
        ``uint8 [..., K // 32 * 36]``: per block of 32 values, fp16 ``d``, fp16 ``s``, 32 int8
        ``qs`` (little-endian), byte-identical to ggml's ``quantize_row_q8_1_ref``. No host
        synchronization.

    Raises:
        ValueError: ``x`` is not a floating tensor, is 0-dimensional, or K % 32 != 0.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"quantize_q8_1: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() == 0 or x.shape[-1] % QK8_1:
        k = x.shape[-1] if x.dim() else None
        raise ValueError(f"quantize_q8_1: the last dim of x (K = {k}) must be a multiple of {QK8_1}")
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    blocks = x.to(torch.float32).reshape(-1, QK8_1)
    d, qs = q8_0_scale_and_codes(blocks)  # d and qs are Q8_0's
    s = qs.sum(dim=-1, keepdim=True, dtype=torch.int32).to(torch.float32) * d
    out = torch.cat([fp16_bytes(d), fp16_bytes(s), qs.view(torch.uint8)], dim=1)
    return out.reshape(*lead, k // QK8_1 * Q8_1_BLOCK_BYTES)


def dequantize_q8_1(data: torch.Tensor) -> torch.Tensor:
    """Unpack q8_1 blocks: ``x = d * qs``.

    Args:
        data: ``uint8 [..., B * 36]`` as returned by :func:`quantize_q8_1`.

    Returns:
        ``float32 [..., B * 32]`` (the ``s`` fields are not needed and not checked).

    Raises:
        ValueError: ``data`` is not uint8 or its last dim is not a multiple of 36.
    """
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        raise ValueError(f"dequantize_q8_1: data must be a uint8 tensor, got {getattr(data, 'dtype', type(data))}")
    if data.dim() == 0 or data.shape[-1] % Q8_1_BLOCK_BYTES:
        nb = data.shape[-1] if data.dim() else None
        raise ValueError(f"dequantize_q8_1: the last dim of data ({nb} bytes) must be a multiple of {Q8_1_BLOCK_BYTES}")
    lead, nbytes = tuple(data.shape[:-1]), data.shape[-1]
    blocks = data.reshape(-1, Q8_1_BLOCK_BYTES)
    d = fp16_field(blocks, slice(0, 2))
    qs = blocks[:, 4:].view(torch.int8).to(torch.float32)
    return (d * qs).reshape(*lead, nbytes // Q8_1_BLOCK_BYTES * QK8_1)
