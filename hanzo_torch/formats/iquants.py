"""i-quant formats: IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ4_NL IQ4_XS.

Block layouts are ggml's (``ggml-common.h``, ``block_iq*``); the dequantization formulas and
their float32 operation order are those of ``gguf.quants`` (the numpy oracle), which every
function here repeats, so the results are bit-identical to it. Of the i-quants hanzo-torch
quantizes IQ4_NL and IQ4_XS (:mod:`hanzo_torch.formats.iq4_search`, byte-identical to ggml's)
and, in the C kernel only (``csrc/quant/kquants.c``, which holds ggml's quantization grids as
level codes), IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and IQ1_M.

The codebooks (grids) and the IQ4 non-linear levels are read from the ``gguf`` package at
import (``gguf.quants.<TYPE>.init_grid()`` / ``.grid``, ``.kvalues``), turned into torch tensors
once and cached per device (:class:`DeviceTable`); nothing here copies those tables.

The generic word and bit helpers (little-endian words, bit fields of words, device tables) live
in :mod:`hanzo_torch.formats._bits`; this module keeps the i-quant sign rule
(:func:`parity_signs`) and the codebooks.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, QK_K
from gguf import quants as _gq

from . import iq4_search, register
from ._bits import (
    DeviceTable, block_layout, check_blocks, fp16_field, half, half_bits_to_f32, le_u16, le_u32,
    lookup, make_format, signs_from_bits, split_bits, table_from_gguf, u8, u16, unpack_bits,
)

__all__ = ["IQ_FORMATS", "parity_signs"]


def parity_signs(idx7: torch.Tensor) -> torch.Tensor:
    """Expand 7-bit sign indexes ``int [...]`` into float32 signs ``[..., 8]`` (+1.0 / -1.0).

    IQ2_XXS, IQ2_XS and IQ3_XXS store 7 sign bits per 8 weights; the 8th sign bit is the parity
    of the 7 stored ones (every group of 8 has an even number of negatives). That is exactly
    what ggml's ``ksigns_iq2xs`` table (``gguf.quants.IQ2_XXS.ksigns``) encodes, so computing the
    parity is bit-identical to gathering from it (tests/test_formats_iq.py checks all 128
    entries) and spares kernels a divergent table gather (docs/DESIGN.md section 2).
    """
    p = idx7 ^ (idx7 >> 4)
    p = p ^ (p >> 2)
    p = (p ^ (p >> 1)) & 1
    return signs_from_bits(split_bits(idx7 | (p << 7), range(8), 1))


def _grid(cls) -> DeviceTable:
    """The codebook of an i-quant class of ``gguf.quants``, float32 ``[entries, width]``."""
    cls.init_grid()
    return table_from_gguf(np.asarray(cls.grid).reshape(cls.grid_shape), torch.float32)


assert all(GGML_QUANT_SIZES[GGMLQuantizationType[n]][0] == QK_K for n in (
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS"))
QK4_NL = GGML_QUANT_SIZES[GGMLQuantizationType.IQ4_NL][0]  # 32

# ---------------------------------------------------------------------------------------------
# tables read from gguf
# ---------------------------------------------------------------------------------------------
_GRID_IQ2_XXS = _grid(_gq.IQ2_XXS)  # 256 x 8, magnitudes {8, 25, 43}
_GRID_IQ2_XS = _grid(_gq.IQ2_XS)  # 512 x 8
_GRID_IQ2_S = _grid(_gq.IQ2_S)  # 1024 x 8
_GRID_IQ3_XXS = _grid(_gq.IQ3_XXS)  # 256 x 4, magnitudes 4..62
_GRID_IQ3_S = _grid(_gq.IQ3_S)  # 512 x 4, odd magnitudes 1..15
_GRID_IQ1 = _grid(_gq.IQ1_S)  # 2048 x 8, values {-1, 0, 1}; IQ1_M shares it
_KVALUES_IQ4 = table_from_gguf(_gq.IQ4_NL.kvalues, torch.float32)  # 16 non-linear int8 levels
_IQ1_DELTA = float(_gq.IQ1_S.delta)  # 0.125


# ---------------------------------------------------------------------------------------------
# IQ2_XXS: 2.0625 bits per weight.  x = d * (0.5 + ls) * 0.25 * grid[g][j] * sign
#   struct block_iq2_xxs { ggml_half d; uint16_t qs[QK_K/8]; };  // 66 bytes
#   qs: per group of 32 weights two little-endian uint32 words (aux0, aux1):
#     aux0 = 4 grid indexes g (one byte each; 256-entry grid of 8 magnitudes)
#     aux1 = 4 x 7-bit sign indexes (bits 0..27) | 4-bit group scale ls (bits 28..31)
#   The 8th sign bit of each 8 weights is the parity of the 7 stored ones (parity_signs).
# ---------------------------------------------------------------------------------------------
_IQ2_XXS = block_layout("IQ2_XXS", d=half(), qs=u16(QK_K // 8))


def _iq2_xxs_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "IQ2_XXS")
    n = blocks.shape[0]
    d = fp16_field(blocks, _IQ2_XXS["d"])  # [n, 1]
    qs = blocks[:, _IQ2_XXS["qs"]].reshape(n, 8, 8)  # [n, group, aux0 bytes | aux1 bytes]
    aux1 = le_u32(qs[:, :, 4:].reshape(n, 32))  # [n, 8]
    db = (d * (0.5 + (aux1 >> 28).to(torch.float32)) * 0.25).reshape(n, 8, 1, 1)
    signs = parity_signs(split_bits(aux1, (0, 7, 14, 21), 0x7F)).reshape(n, 8, 4, 8)
    grid = lookup(_GRID_IQ2_XXS, qs[:, :, :4]).reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------------
# IQ2_XS: 2.3125 bits per weight.  x = d * (0.5 + s) * 0.25 * grid[g][j] * sign
#   struct block_iq2_xs { ggml_half d; uint16_t qs[QK_K/8]; uint8_t scales[QK_K/32]; };  // 74 bytes
#   qs: per 8 weights a uint16: 9-bit grid index g (512-entry grid) | 7-bit sign index << 9
#   scales: a 4-bit scale s per 16 weights (low nibble first)
#   The 8th sign bit of each 8 weights is the parity of the 7 stored ones (parity_signs).
# ---------------------------------------------------------------------------------------------
_IQ2_XS = block_layout("IQ2_XS", d=half(), qs=u16(QK_K // 8), scales=u8(QK_K // 32))


def _iq2_xs_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "IQ2_XS")
    n = blocks.shape[0]
    d = fp16_field(blocks, _IQ2_XS["d"])
    qs = le_u16(blocks[:, _IQ2_XS["qs"]])  # [n, 32]
    sc = unpack_bits(blocks[:, _IQ2_XS["scales"]], 4, 1)  # [n, 16]
    db = (d * (0.5 + sc.to(torch.float32)) * 0.25).reshape(n, 16, 1, 1)
    signs = parity_signs(qs >> 9).reshape(n, 16, 2, 8)
    grid = lookup(_GRID_IQ2_XS, qs & 511).reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------------
# IQ2_S: 2.5625 bits per weight.  x = d * (0.5 + s) * 0.25 * grid[g][j] * sign
#   struct block_iq2_s { ggml_half d; uint8_t qs[QK_K/4]; uint8_t qh[QK_K/32]; uint8_t scales[QK_K/32]; };
#   // 82 bytes
#   qs[0:32]: low 8 bits of a 10-bit grid index g per 8 weights (1024-entry grid)
#   qs[32:64]: one explicit sign bit per weight;  qh: the 2 high bits of 4 indexes per byte
#   scales: a 4-bit scale s per 16 weights
# ---------------------------------------------------------------------------------------------
_IQ2_S = block_layout("IQ2_S", d=half(), qs=u8(QK_K // 4), qh=u8(QK_K // 32), scales=u8(QK_K // 32))


def _iq2_s_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "IQ2_S")
    n = blocks.shape[0]
    d = fp16_field(blocks, _IQ2_S["d"])
    sc = unpack_bits(blocks[:, _IQ2_S["scales"]], 4, 1)
    db = (d * (0.5 + sc.to(torch.float32)) * 0.25).reshape(n, 16, 1, 1)
    qs = blocks[:, _IQ2_S["qs"]]
    signs = signs_from_bits(unpack_bits(qs[:, QK_K // 8:], 1, 1)).reshape(n, 16, 2, 8)
    qh = unpack_bits(blocks[:, _IQ2_S["qh"]], 2, 1).to(torch.int32)  # [n, 32]
    g = qs[:, :QK_K // 8].to(torch.int32) | (qh << 8)
    grid = lookup(_GRID_IQ2_S, g).reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------------
# IQ3_XXS: 3.0625 bits per weight.  x = d * (0.5 + ls) * 0.5 * grid[g][j] * sign
#   struct block_iq3_xxs { ggml_half d; uint8_t qs[3*QK_K/8]; };  // 98 bytes
#   qs[0:64]: a grid index g per 4 weights (256-entry grid of 4 magnitudes)
#   qs[64:96]: per group of 32 weights a little-endian uint32:
#     4 x 7-bit sign indexes (bits 0..27) | 4-bit group scale ls (bits 28..31)
#   The 8th sign bit of each 8 weights is the parity of the 7 stored ones (parity_signs).
# ---------------------------------------------------------------------------------------------
_IQ3_XXS = block_layout("IQ3_XXS", d=half(), qs=u8(3 * QK_K // 8))


def _iq3_xxs_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "IQ3_XXS")
    n = blocks.shape[0]
    d = fp16_field(blocks, _IQ3_XXS["d"])
    qs = blocks[:, _IQ3_XXS["qs"]]
    aux = le_u32(qs[:, QK_K // 4:])  # [n, 8]
    db = (d * (0.5 + (aux >> 28).to(torch.float32)) * 0.5).reshape(n, 8, 1, 1)
    signs = parity_signs(split_bits(aux, (0, 7, 14, 21), 0x7F)).reshape(n, 8, 4, 8)
    grid = lookup(_GRID_IQ3_XXS, qs[:, :QK_K // 4]).reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------------
# IQ3_S: 3.4375 bits per weight.  x = d * (1 + 2 * s) * grid[g][j] * sign
#   struct block_iq3_s { ggml_half d; uint8_t qs[QK_K/4]; uint8_t qh[QK_K/32];
#                        uint8_t signs[QK_K/8]; uint8_t scales[QK_K/64]; };  // 110 bytes
#   qs: low 8 bits of a 9-bit grid index g per 4 weights (512-entry grid); qh: their 9th bits
#   signs: one explicit sign bit per weight;  scales: a 4-bit scale s per 32 weights
# ---------------------------------------------------------------------------------------------
_IQ3_S = block_layout("IQ3_S", d=half(), qs=u8(QK_K // 4), qh=u8(QK_K // 32), signs=u8(QK_K // 8), scales=u8(QK_K // 64))


def _iq3_s_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "IQ3_S")
    n = blocks.shape[0]
    d = fp16_field(blocks, _IQ3_S["d"])
    sc = unpack_bits(blocks[:, _IQ3_S["scales"]], 4, 1).to(torch.int32)  # [n, 8]
    db = (d * (1 + 2 * sc).to(torch.float32)).reshape(n, 8, 1, 1)
    signs = signs_from_bits(unpack_bits(blocks[:, _IQ3_S["signs"]], 1, 1)).reshape(n, 8, 4, 8)
    qh = unpack_bits(blocks[:, _IQ3_S["qh"]], 1, 1).to(torch.int32)  # [n, 64]
    g = blocks[:, _IQ3_S["qs"]].to(torch.int32) | (qh << 8)
    grid = lookup(_GRID_IQ3_S, g).reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------------
# IQ1_S: 1.5625 bits per weight.  x = d * (2 * s + 1) * (grid[g][j] + delta)
#   struct block_iq1_s { ggml_half d; uint8_t qs[QK_K/8]; uint16_t qh[QK_K/32]; };  // 50 bytes
#   qs: low 8 bits of an 11-bit grid index g per 8 weights (2048-entry grid of {-1, 0, 1})
#   qh: per group of 32 weights: 4 x 3 high index bits (bits 0..11), 3-bit scale s (bits 12..14),
#       delta = -0.125 if bit 15 else +0.125
# ---------------------------------------------------------------------------------------------
_IQ1_S = block_layout("IQ1_S", d=half(), qs=u8(QK_K // 8), qh=u16(QK_K // 32))


def _iq1_s_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "IQ1_S")
    n = blocks.shape[0]
    d = fp16_field(blocks, _IQ1_S["d"])
    qh = le_u16(blocks[:, _IQ1_S["qh"]])  # [n, 8]
    dl = (d * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)).reshape(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, _IQ1_DELTA, -_IQ1_DELTA).reshape(n, 8, 1, 1)
    hi = split_bits(qh, (0, 3, 6, 9), 0x7).reshape(n, 32)
    g = blocks[:, _IQ1_S["qs"]].to(torch.int32) | (hi << 8)
    grid = lookup(_GRID_IQ1, g).reshape(n, 8, 4, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------------
# IQ1_M: 1.75 bits per weight.  x = d * (2 * s + 1) * (grid[g][j] + delta)
#   struct block_iq1_m { uint8_t qs[QK_K/8]; uint8_t qh[QK_K/16]; uint8_t scales[QK_K/32]; };  // 56 bytes
#   qs: low 8 bits of an 11-bit grid index g per 8 weights (IQ1_S's grid)
#   qh: a nibble per 8 weights (low first): 3 high index bits | delta sign (bit 3;
#       delta = -0.125 if set else +0.125)
#   scales: 4 little-endian uint16 words: bits 0..11 hold four 3-bit scales s (one per 16
#       weights); bits 12..15 of word i are bits 4i..4i+3 of the fp16 super-block scale d
#       (the block has no separate d field)
# ---------------------------------------------------------------------------------------------
_IQ1_M = block_layout("IQ1_M", qs=u8(QK_K // 8), qh=u8(QK_K // 16), scales=u8(QK_K // 32, scale="f16_iq1m"))


def _iq1_m_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "IQ1_M")
    n = blocks.shape[0]
    sc = le_u16(blocks[:, _IQ1_M["scales"]])  # [n, 4]
    top = sc >> 12
    d = half_bits_to_f32(top[:, 0:1] | (top[:, 1:2] << 4) | (top[:, 2:3] << 8) | (top[:, 3:4] << 12))
    s = split_bits(sc, (0, 3, 6, 9), 0x7).reshape(n, 16)
    dl = (d * (2 * s + 1).to(torch.float32)).reshape(n, 8, 2, 1, 1)
    qh = unpack_bits(blocks[:, _IQ1_M["qh"]], 4, 1).to(torch.int32)  # [n, 32]
    g = blocks[:, _IQ1_M["qs"]].to(torch.int32) | ((qh & 0x7) << 8)
    delta = torch.where((qh & 0x8) == 0, _IQ1_DELTA, -_IQ1_DELTA).reshape(n, 8, 2, 2, 1)
    grid = lookup(_GRID_IQ1, g).reshape(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------------
# IQ4_NL: 4.5 bits per weight.  x = d * kvalues[q]  (16 non-linear levels -127..113)
#   struct block_iq4_nl { ggml_half d; uint8_t qs[QK4_NL/2]; };  // 18 bytes
#   qs: value j < 16 in the low nibble of qs[j], value j + 16 in its high nibble
# ---------------------------------------------------------------------------------------------
_IQ4_NL = block_layout("IQ4_NL", d=half(), qs=u8(QK4_NL // 2))


def _iq4_nl_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "IQ4_NL")
    d = fp16_field(blocks, _IQ4_NL["d"])
    return d * lookup(_KVALUES_IQ4, unpack_bits(blocks[:, _IQ4_NL["qs"]], 4, QK4_NL // 2))


# ---------------------------------------------------------------------------------------------
# IQ4_XS: 4.25 bits per weight.  x = d * (s - 32) * kvalues[q]
#   struct block_iq4_xs { ggml_half d; uint16_t scales_h; uint8_t scales_l[QK_K/64];
#                         uint8_t qs[QK_K/2]; };  // 136 bytes
#   6-bit scale s of group i (32 weights): low 4 bits in nibble i of scales_l (low nibble
#   first), high 2 bits in bits 2i..2i+1 of scales_h
#   qs: 16 bytes per group, nibbles as IQ4_NL
# ---------------------------------------------------------------------------------------------
_IQ4_XS = block_layout("IQ4_XS", d=half(), scales_h=u16(), scales_l=u8(QK_K // 64), qs=u8(QK_K // 2))


def _iq4_xs_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "IQ4_XS")
    n = blocks.shape[0]
    d = fp16_field(blocks, _IQ4_XS["d"])
    sh = split_bits(le_u16(blocks[:, _IQ4_XS["scales_h"]]), range(0, 16, 2), 0x3).reshape(n, 8)
    sl = unpack_bits(blocks[:, _IQ4_XS["scales_l"]], 4, 1).to(torch.int32)
    dl = (d * ((sl | (sh << 4)) - 32).to(torch.float32)).reshape(n, 8, 1)
    q = unpack_bits(blocks[:, _IQ4_XS["qs"]], 4, 16).reshape(n, 8, 32)
    return (dl * lookup(_KVALUES_IQ4, q)).reshape(n, QK_K)


def _iq(name, fn, layout, tables, group_len, vec_dot_type="q8_K", quantize=None, weighted=None):
    return register(make_format(name, fn, quantize, layout=layout, vec_dot_type=vec_dot_type, tables=tables,
                                group_len=group_len, quantize_weighted=weighted))


IQ2_XXS = _iq("IQ2_XXS", _iq2_xxs_dequantize, _IQ2_XXS, {"grid": _GRID_IQ2_XXS}, 32,
              quantize=iq4_search.quantize_iq2_xxs, weighted=iq4_search.WEIGHTED["IQ2_XXS"])
IQ2_XS = _iq("IQ2_XS", _iq2_xs_dequantize, _IQ2_XS, {"grid": _GRID_IQ2_XS}, 16,
             quantize=iq4_search.quantize_iq2_xs, weighted=iq4_search.WEIGHTED["IQ2_XS"])
IQ3_XXS = _iq("IQ3_XXS", _iq3_xxs_dequantize, _IQ3_XXS, {"grid": _GRID_IQ3_XXS}, 32,
              quantize=iq4_search.quantize_iq3_xxs, weighted=iq4_search.WEIGHTED["IQ3_XXS"])
IQ1_S = _iq("IQ1_S", _iq1_s_dequantize, _IQ1_S, {"grid": _GRID_IQ1}, 32,
            quantize=iq4_search.quantize_iq1_s, weighted=iq4_search.WEIGHTED["IQ1_S"])
IQ4_NL = _iq("IQ4_NL", _iq4_nl_dequantize, _IQ4_NL, {"kvalues": _KVALUES_IQ4}, 32, vec_dot_type="q8_0",
             quantize=iq4_search.quantize_iq4_nl, weighted=iq4_search.WEIGHTED["IQ4_NL"])
IQ3_S = _iq("IQ3_S", _iq3_s_dequantize, _IQ3_S, {"grid": _GRID_IQ3_S}, 32,
            quantize=iq4_search.quantize_iq3_s, weighted=iq4_search.WEIGHTED["IQ3_S"])
IQ2_S = _iq("IQ2_S", _iq2_s_dequantize, _IQ2_S, {"grid": _GRID_IQ2_S}, 16,
            quantize=iq4_search.quantize_iq2_s, weighted=iq4_search.WEIGHTED["IQ2_S"])
IQ4_XS = _iq("IQ4_XS", _iq4_xs_dequantize, _IQ4_XS, {"kvalues": _KVALUES_IQ4}, 32,
             quantize=iq4_search.quantize_iq4_xs, weighted=iq4_search.WEIGHTED["IQ4_XS"])
IQ1_M = _iq("IQ1_M", _iq1_m_dequantize, _IQ1_M, {"grid": _GRID_IQ1}, 8,
            quantize=iq4_search.quantize_iq1_m, weighted=iq4_search.WEIGHTED["IQ1_M"])

IQ_FORMATS: tuple[str, ...] = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")
