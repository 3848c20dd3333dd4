"""The legacy ggml formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32 values per block).

Layouts are ggml's (``ggml-common.h``); dequantization repeats the float32 operations of
``gguf.quants`` in the same order, so results are bit-identical to it, and quantization repeats
its rounding, so the bytes are identical too. The generic bit and rounding helpers live in
:mod:`hanzo_torch.formats._bits`.
"""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import iq4_search, register
from ._bits import (
    block_layout, check_blocks, check_values, codes_from_float, float_const, fp16_bytes,
    fp16_field, half, i8, make_format, pack_bits, round_codes, safe_reciprocal, signed_absmax, u8,
    unpack_bits,
)

__all__ = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "q8_0_scale_and_codes"]

QK = 32  # values per legacy block (QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0 = 32)
assert all(GGML_QUANT_SIZES[GGMLQuantizationType[n]][0] == QK for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"))


# ---------------------------------------------------------------------------------------------
# Q4_0: 4.5 bits per weight.  x = d * (q - 8), q in [0, 15]
#   struct block_q4_0 { ggml_half d; uint8_t qs[16]; }  // 18 bytes
#   qs: value j (j < 16) in the low nibble of qs[j], value j + 16 in its high nibble
# ---------------------------------------------------------------------------------------------
_Q4_0 = block_layout("Q4_0", d=half(), qs=u8(QK // 2))


def _q4_0_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "Q4_0")
    d = fp16_field(blocks, _Q4_0["d"])
    q = unpack_bits(blocks[:, _Q4_0["qs"]], 4, QK // 2).to(torch.float32) - 8
    return d * q


def _quantize_symmetric(blocks: torch.Tensor, bits: int):
    # Q4_0/Q5_0 (as gguf): d = max / -2^(bits-1) with max the signed absmax, q = trunc(x/d + 2^(bits-1) + 0.5)
    half = 1 << (bits - 1)
    d = signed_absmax(blocks) / float_const(-half, blocks)
    q = torch.trunc(blocks * safe_reciprocal(d) + (half + 0.5))
    return d, codes_from_float(q, 0, 2 * half - 1)


def _q4_0_quantize(blocks: torch.Tensor) -> torch.Tensor:
    blocks = check_values(blocks, "Q4_0")
    d, q = _quantize_symmetric(blocks, 4)
    return torch.cat([fp16_bytes(d), pack_bits(q, 4, QK // 2)], dim=1)


# ---------------------------------------------------------------------------------------------
# Q4_1: 5.0 bits per weight.  x = d * q + m, q in [0, 15]
#   struct block_q4_1 { ggml_half d; ggml_half m; uint8_t qs[16]; }  // 20 bytes
# ---------------------------------------------------------------------------------------------
_Q4_1 = block_layout("Q4_1", d=half(), m=half(), qs=u8(QK // 2))


def _q4_1_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "Q4_1")
    d = fp16_field(blocks, _Q4_1["d"])
    m = fp16_field(blocks, _Q4_1["m"])
    q = unpack_bits(blocks[:, _Q4_1["qs"]], 4, QK // 2).to(torch.float32)
    return d * q + m


def _quantize_affine(blocks: torch.Tensor, bits: int):
    # Q4_1/Q5_1 (as gguf): d = (max - min) / (2^bits - 1), m = min, q = trunc((x - min)/d + 0.5)
    top = (1 << bits) - 1
    mn = blocks.amin(dim=-1, keepdim=True)
    d = (blocks.amax(dim=-1, keepdim=True) - mn) / float_const(top, blocks)
    q = torch.trunc((blocks - mn) * safe_reciprocal(d) + 0.5)
    return d, mn, codes_from_float(q, 0, top)


def _q4_1_quantize(blocks: torch.Tensor) -> torch.Tensor:
    blocks = check_values(blocks, "Q4_1")
    d, m, q = _quantize_affine(blocks, 4)
    return torch.cat([fp16_bytes(d), fp16_bytes(m), pack_bits(q, 4, QK // 2)], dim=1)


# ---------------------------------------------------------------------------------------------
# Q5_0: 5.5 bits per weight.  x = d * (q - 16), q = low nibble | high bit << 4 in [0, 31]
#   struct block_q5_0 { ggml_half d; uint8_t qh[4]; uint8_t qs[16]; }  // 22 bytes
#   qh: little-endian uint32, bit j = fifth bit of value j; qs as Q4_0
# ---------------------------------------------------------------------------------------------
_Q5_0 = block_layout("Q5_0", d=half(), qh=u8(4), qs=u8(QK // 2))


def _q5_codes(blocks: torch.Tensor, layout: dict) -> torch.Tensor:
    ql = unpack_bits(blocks[:, layout["qs"]], 4, QK // 2)
    qh = unpack_bits(blocks[:, layout["qh"]], 1, 1)
    return (ql | (qh << 4)).to(torch.float32)


def _q5_pack(q: torch.Tensor) -> list[torch.Tensor]:
    return [pack_bits(q >> 4, 1, 1), pack_bits(q & 0x0F, 4, QK // 2)]  # qh, qs


def _q5_0_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "Q5_0")
    d = fp16_field(blocks, _Q5_0["d"])
    return d * (_q5_codes(blocks, _Q5_0) - 16)


def _q5_0_quantize(blocks: torch.Tensor) -> torch.Tensor:
    blocks = check_values(blocks, "Q5_0")
    d, q = _quantize_symmetric(blocks, 5)
    return torch.cat([fp16_bytes(d), *_q5_pack(q)], dim=1)


# ---------------------------------------------------------------------------------------------
# Q5_1: 6.0 bits per weight.  x = d * q + m, q in [0, 31]
#   struct block_q5_1 { ggml_half d; ggml_half m; uint8_t qh[4]; uint8_t qs[16]; }  // 24 bytes
# ---------------------------------------------------------------------------------------------
_Q5_1 = block_layout("Q5_1", d=half(), m=half(), qh=u8(4), qs=u8(QK // 2))


def _q5_1_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "Q5_1")
    d = fp16_field(blocks, _Q5_1["d"])
    m = fp16_field(blocks, _Q5_1["m"])
    return d * _q5_codes(blocks, _Q5_1) + m


def _q5_1_quantize(blocks: torch.Tensor) -> torch.Tensor:
    blocks = check_values(blocks, "Q5_1")
    d, m, q = _quantize_affine(blocks, 5)
    return torch.cat([fp16_bytes(d), fp16_bytes(m), *_q5_pack(q)], dim=1)


# ---------------------------------------------------------------------------------------------
# Q8_0: 8.5 bits per weight.  x = d * q, q int8
#   struct block_q8_0 { ggml_half d; int8_t qs[32]; }  // 34 bytes
# ---------------------------------------------------------------------------------------------
_Q8_0 = block_layout("Q8_0", d=half(), qs=i8(QK))


def _q8_0_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "Q8_0")
    d = fp16_field(blocks, _Q8_0["d"])
    q = blocks[:, _Q8_0["qs"]].view(torch.int8).to(torch.float32)
    return q * d


def q8_0_scale_and_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0's scale and codes (``quantize_row_q8_0_ref``, also the ``d`` and ``qs`` of q8_1).

    ``d = amax / 127`` in float32 (amax the largest ``|x|`` of the block), ``q = roundf(x * (d ? 1/d : 0))``.

    Args:
        blocks: float32 ``[n, 32]``.

    Returns:
        ``(d float32 [n, 1], q int8 [n, 32])``; ``d`` before its fp16 rounding.
    """
    d = blocks.abs().amax(dim=-1, keepdim=True) / float_const(127, blocks)
    return d, round_codes(blocks, d, -128, 127, torch.int8)


def _q8_0_quantize(blocks: torch.Tensor) -> torch.Tensor:
    d, q = q8_0_scale_and_codes(check_values(blocks, "Q8_0"))
    return torch.cat([fp16_bytes(d), q.view(torch.uint8)], dim=1)


# quantize_weighted: ggml's quantize_q{4,5}_{0,1} with an importance matrix (C kernel only)
Q4_0 = register(make_format("Q4_0", _q4_0_dequantize, _q4_0_quantize, layout=_Q4_0, vec_dot_type="q8_0", group_len=QK,
                            quantize_weighted=iq4_search.WEIGHTED["Q4_0"]))
Q4_1 = register(make_format("Q4_1", _q4_1_dequantize, _q4_1_quantize, layout=_Q4_1, vec_dot_type="q8_1", group_len=QK,
                            quantize_weighted=iq4_search.WEIGHTED["Q4_1"]))
Q5_0 = register(make_format("Q5_0", _q5_0_dequantize, _q5_0_quantize, layout=_Q5_0, vec_dot_type="q8_0", group_len=QK,
                            quantize_weighted=iq4_search.WEIGHTED["Q5_0"]))
Q5_1 = register(make_format("Q5_1", _q5_1_dequantize, _q5_1_quantize, layout=_Q5_1, vec_dot_type="q8_1", group_len=QK,
                            quantize_weighted=iq4_search.WEIGHTED["Q5_1"]))
Q8_0 = register(make_format("Q8_0", _q8_0_dequantize, _q8_0_quantize, layout=_Q8_0, vec_dot_type="q8_0", group_len=QK))
