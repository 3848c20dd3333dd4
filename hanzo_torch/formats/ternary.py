"""Ternary formats TQ1_0 and TQ2_0: weights in {-1, 0, +1} times one fp16 scale per 256.

Layouts are ggml's (``ggml-common.h``, ``block_tq1_0`` / ``block_tq2_0``). Dequantization repeats
the float32 operations of ``gguf.quants`` and is bit-identical to it; quantization repeats its
rounding (``d = max|x|``, ``q = roundf(x / d)``) and is byte-identical to
``gguf.quants.quantize``. The generic bit and rounding helpers live in
:mod:`hanzo_torch.formats._bits`.
"""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, QK_K

from . import register
from ._bits import (
    DeviceTable, block_layout, check_blocks, check_values, fp16_bytes, fp16_field, half, make_format,
    pack_bits, round_codes, u8, unpack_bits,
)

__all__ = ["TQ_FORMATS"]

assert all(GGML_QUANT_SIZES[GGMLQuantizationType[n]][0] == QK_K for n in ("TQ1_0", "TQ2_0"))

_POW3 = DeviceTable(torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32))


def _ternary_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf's ternary rounding: ``d = max|x|``, ``q = roundf(x * (1/d)) + 1`` in {0, 1, 2}.

    Returns ``(d float32 [n, 1], q int32 [n, QK_K])``. Non-finite products (from an infinite or
    NaN input, or a subnormal d whose reciprocal overflows) give q = 1, as numpy's float->int8
    cast does on x86; gguf then stores d as inf/NaN or 0, so those codes do not change values.
    """
    d = blocks.abs().amax(dim=-1, keepdim=True)
    return d, round_codes(blocks, d, -1, 1, torch.int32) + 1


# ---------------------------------------------------------------------------------------------
# TQ1_0: 1.6875 bits per weight.  x = d * (t - 1), t a base-3 digit in {0, 1, 2}
#   struct block_tq1_0 { uint8_t qs[(QK_K - 4*QK_K/64)/5]; uint8_t qh[QK_K/64]; ggml_half d; };  // 54 bytes
#   qs[0:32] hold weights 0..159 and qs[32:48] weights 160..239, 5 digits per byte;
#   qh[0:4] weights 240..255, 4 digits per byte. Digit j of every byte of a run comes before
#   digit j + 1 (weights 0..31 are digit 0 of qs[0..31]).
#   A byte stores its digits t0..t4 as ceil(256 * (81 t0 + 27 t1 + 9 t2 + 3 t3 + t4) / 243), so
#   digit j is ((byte * 3^j mod 256) * 3) >> 8 (for qh, t4 = 0).
# ---------------------------------------------------------------------------------------------
_TQ1_0 = block_layout("TQ1_0", qs=u8((QK_K - 4 * QK_K // 64) // 5), qh=u8(QK_K // 64), d=half())


def _trits(b: torch.Tensor, k: int) -> torch.Tensor:
    """The first ``k`` base-3 digits of TQ1_0 bytes ``[n, m]`` -> ``int32 [n, k, m]`` in {0, 1, 2}."""
    pow3 = _POW3.on(b.device)[:k].view(k, 1)
    return (((b.to(torch.int32).unsqueeze(-2) * pow3) & 0xFF) * 3) >> 8


def _pack_trits(q: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`_trits` for ``q int32 [n, k, m]`` -> ``uint8 [n, m]``."""
    v = q[:, 0]
    for j in range(1, 5):
        v = v * 3 + (q[:, j] if j < k else 0)
    return ((v * 256 + (243 - 1)) // 243).to(torch.uint8)


def _tq1_0_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "TQ1_0")
    n = blocks.shape[0]
    d = fp16_field(blocks, _TQ1_0["d"])
    qs = blocks[:, _TQ1_0["qs"]]
    q = torch.cat([
        _trits(qs[:, :32], 5).reshape(n, 160),
        _trits(qs[:, 32:], 5).reshape(n, 80),
        _trits(blocks[:, _TQ1_0["qh"]], 4).reshape(n, 16),
    ], dim=1)
    return d * (q - 1).to(torch.float32)


def _tq1_0_quantize(blocks: torch.Tensor) -> torch.Tensor:
    blocks = check_values(blocks, "TQ1_0")
    n = blocks.shape[0]
    d, q = _ternary_codes(blocks)
    return torch.cat([
        _pack_trits(q[:, :160].reshape(n, 5, 32), 5),
        _pack_trits(q[:, 160:240].reshape(n, 5, 16), 5),
        _pack_trits(q[:, 240:].reshape(n, 4, 4), 4),
        fp16_bytes(d),
    ], dim=1)


# ---------------------------------------------------------------------------------------------
# TQ2_0: 2.0625 bits per weight.  x = d * (q - 1), q a 2-bit code in {0, 1, 2} (3 unused)
#   struct block_tq2_0 { uint8_t qs[QK_K/4]; ggml_half d; };  // 66 bytes
#   qs: two runs of 32 bytes; in each, weights 0..31 are bits 0-1 of the 32 bytes, weights
#   32..63 bits 2-3, and so on (ggml's bit-plane order, as Q2_K).
# ---------------------------------------------------------------------------------------------
_TQ2_0 = block_layout("TQ2_0", qs=u8(QK_K // 4), d=half())


def _tq2_0_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "TQ2_0")
    d = fp16_field(blocks, _TQ2_0["d"])
    q = unpack_bits(blocks[:, _TQ2_0["qs"]], 2, 32).to(torch.int32)
    return d * (q - 1).to(torch.float32)


def _tq2_0_quantize(blocks: torch.Tensor) -> torch.Tensor:
    blocks = check_values(blocks, "TQ2_0")
    d, q = _ternary_codes(blocks)
    return torch.cat([pack_bits(q, 2, 32), fp16_bytes(d)], dim=1)


TQ1_0 = register(make_format("TQ1_0", _tq1_0_dequantize, _tq1_0_quantize, layout=_TQ1_0, vec_dot_type="q8_K",
                             group_len=32))
TQ2_0 = register(make_format("TQ2_0", _tq2_0_dequantize, _tq2_0_quantize, layout=_TQ2_0, vec_dot_type="q8_K",
                             group_len=32))

TQ_FORMATS: tuple[str, ...] = ("TQ1_0", "TQ2_0")
