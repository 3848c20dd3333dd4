"""i-quant formats: IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ4_NL IQ4_XS.

Block layouts are ggml's (``ggml-common.h``, ``block_iq*``); the dequantization formulas and
their float32 operation order are those of ``gguf.quants`` (the numpy oracle), which every
function here reproduces bit for bit.

The codebooks (grids), the IQ4 non-linear values and the IQ2 sign table are read from the
``gguf`` package at import (``gguf.quants.<TYPE>.init_grid()``/``.grid``, ``.kvalues``,
``.ksigns``), turned into torch tensors once and cached per device (:class:`DeviceTable`).
Nothing here copies those tables.

This module also holds the small bit-unpacking helpers shared by the ternary and fp4 modules.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as _gq

from . import Format, register

__all__ = ["IQ_FORMATS"]


# ---------------------------------------------------------------------------------------------
# Shared helpers (also used by ternary.py and fp4.py)
# ---------------------------------------------------------------------------------------------


class DeviceTable:
    """A constant lookup table built once on the CPU and copied to each device on first use.

    ``table.on(device)`` returns the tensor on ``device``; later calls return the cached copy,
    so steady-state dequantization does no host-to-device transfer.
    """

    def __init__(self, cpu_tensor: torch.Tensor):
        self._cpu = cpu_tensor.contiguous()
        self._by_device: dict[torch.device, torch.Tensor] = {self._cpu.device: self._cpu}

    def on(self, device: torch.device) -> torch.Tensor:
        t = self._by_device.get(device)
        if t is None:
            t = self._by_device[device] = self._cpu.to(device)
        return t

    @property
    def cpu(self) -> torch.Tensor:
        return self._cpu


def check_blocks(blocks: torch.Tensor, name: str, type_size: int) -> torch.Tensor:
    """Validate ``uint8 [n, type_size]`` packed blocks; return them as int32 for bit work.

    Raises:
        ValueError: wrong dtype, rank or block width (the message names the format).
    """
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8:
        got = blocks.dtype if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise ValueError(f"{name}: packed blocks must be a uint8 tensor, got {got}")
    if blocks.dim() != 2 or blocks.shape[1] != type_size:
        raise ValueError(f"{name}: packed blocks must have shape [n, {type_size}], got {tuple(blocks.shape)}")
    return blocks.to(torch.int32)


def le_u16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian uint16 fields from int32 bytes ``[n, 2m] -> int32 [n, m]`` (0..65535)."""
    return b[:, 0::2] | (b[:, 1::2] << 8)


def le_u32(b: torch.Tensor) -> torch.Tensor:
    """Little-endian uint32 fields from int32 bytes ``[n, 4m] -> int64 [n, m]``."""
    b = b.to(torch.int64)
    return b[:, 0::4] | (b[:, 1::4] << 8) | (b[:, 2::4] << 16) | (b[:, 3::4] << 24)


def half_bits_to_f32(bits: torch.Tensor) -> torch.Tensor:
    """IEEE fp16 bit patterns (integers 0..65535, any int dtype) -> float32 values, same shape."""
    bits = bits.to(torch.int32)
    signed = bits - ((bits >> 15) << 16)  # two's-complement int16 value of the same 16 bits
    return signed.to(torch.int16).view(torch.float16).to(torch.float32)


_SHIFTS: dict[tuple, torch.Tensor] = {}


def _shift_tensor(shifts: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (shifts, dtype, device)
    t = _SHIFTS.get(key)
    if t is None:
        t = _SHIFTS[key] = torch.tensor(shifts, dtype=dtype).to(device)
    return t


def split_bits(x: torch.Tensor, shifts: Sequence[int], mask: int, dim: int) -> torch.Tensor:
    """Unpack bit fields: ``(x >> s) & mask`` for each shift, as a new axis at ``dim``.

    ``dim=-1`` interleaves the fields after each source element (``[..., m] -> [..., m, k]``);
    ``dim=-2`` puts all first fields, then all second fields (``[..., m] -> [..., k, m]``).
    The shift vector is cached per (shifts, dtype, device): no small host-to-device copy per call.
    """
    sh = _shift_tensor(tuple(shifts), x.dtype, x.device)
    if dim == -1:
        return (x.unsqueeze(-1) >> sh) & mask
    if dim == -2:
        return (x.unsqueeze(-2) >> sh.unsqueeze(-1)) & mask
    raise ValueError(f"split_bits: dim must be -1 or -2, got {dim}")


def nibbles(b: torch.Tensor, planar: bool) -> torch.Tensor:
    """4-bit fields of bytes ``[n, m]``: planar -> all low nibbles then all high ``[n, 2, m]``,
    else low/high interleaved per byte ``[n, m, 2]``."""
    return split_bits(b, (0, 4), 0xF, dim=-2 if planar else -1)


def table_from_gguf(values, dtype: torch.dtype) -> DeviceTable:
    """A :class:`DeviceTable` from a table kept by ``gguf`` (numpy array, tuple or bytes)."""
    if isinstance(values, (bytes, bytearray)):
        arr = np.frombuffer(bytes(values), dtype=np.uint8)
    else:
        arr = np.asarray(values)
    return DeviceTable(torch.from_numpy(np.array(arr, copy=True)).to(dtype))


def parity_signs(idx7: torch.Tensor) -> torch.Tensor:
    """Expand 7-bit sign indexes ``[...]`` into 8 float32 signs ``[..., 8]`` (+1.0 / -1.0).

    IQ2_XXS, IQ2_XS and IQ3_XXS store 7 sign bits per 8 weights; the 8th sign bit is the
    parity of the 7 stored ones (an even number of negatives per group of 8), which is what
    ggml's ``ksigns_iq2xs`` table (``gguf.quants.IQ2_XXS.ksigns``) encodes. Computing the parity
    is bit-identical to the table gather (tests/test_formats_iq.py checks all 128 entries) and
    avoids a divergent gather in kernels (DESIGN.md section 2).
    """
    p = idx7 ^ (idx7 >> 4)
    p = p ^ (p >> 2)
    p = (p ^ (p >> 1)) & 1
    full = idx7 | (p << 7)
    bits = split_bits(full, range(8), 1, dim=-1)
    return 1.0 - 2.0 * bits.to(torch.float32)


def sign_bits(b: torch.Tensor) -> torch.Tensor:
    """Explicit sign bytes ``[n, m]`` -> float32 signs ``[n, m, 8]`` (bit i set -> weight i negative)."""
    return 1.0 - 2.0 * split_bits(b, range(8), 1, dim=-1).to(torch.float32)


def _grid(cls) -> DeviceTable:
    """The codebook of an i-quant class of ``gguf.quants`` as float32 ``[entries, width]``."""
    cls.init_grid()
    return table_from_gguf(np.asarray(cls.grid).reshape(cls.grid_shape), torch.float32)


def register_checked(
    name: str,
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor],
    quantize_blocks: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> Format:
    """Register the format ``name`` with its ggml id and sizes from ``gguf``.

    The block layout hard-coded in ``dequantize_blocks`` is checked against gguf's
    ``GGML_QUANT_SIZES`` here (a zero block of gguf's width must decode to gguf's block size),
    the run-time twin of a static size assertion next to a block struct.
    """
    qtype = GGMLQuantizationType[name]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    probe = dequantize_blocks(torch.zeros(1, type_size, dtype=torch.uint8))
    if tuple(probe.shape) != (1, block_size) or probe.dtype != torch.float32:
        raise RuntimeError(f"{name}: layout disagrees with gguf ({block_size} values in {type_size} bytes)")
    return register(Format(name, int(qtype), block_size, type_size, dequantize_blocks, quantize_blocks))


QK_K = 256


# ---------------------------------------------------------------------------------------------
# Tables read from gguf
# ---------------------------------------------------------------------------------------------

_GRID_IQ2_XXS = _grid(_gq.IQ2_XXS)  # 256 x 8, magnitudes {8, 25, 43}
_GRID_IQ2_XS = _grid(_gq.IQ2_XS)  # 512 x 8
_GRID_IQ2_S = _grid(_gq.IQ2_S)  # 1024 x 8
_GRID_IQ3_XXS = _grid(_gq.IQ3_XXS)  # 256 x 4, magnitudes 4..62
_GRID_IQ3_S = _grid(_gq.IQ3_S)  # 512 x 4, magnitudes 1..15 (odd)
_GRID_IQ1 = _grid(_gq.IQ1_S)  # 2048 x 8, values {-1, 0, 1}; IQ1_M shares it
_KVALUES_IQ4 = table_from_gguf(_gq.IQ4_NL.kvalues, torch.float32)  # 16 non-linear int8 levels
_IQ1_DELTA = float(_gq.IQ1_S.delta)  # 0.125


# ---------------------------------------------------------------------------------------------
# Dequantizers. Shapes in comments: n blocks.
# ---------------------------------------------------------------------------------------------


# block_iq2_xxs: 256 weights in 8 groups of 32; 66 bytes, 2.0625 bits per weight.
#   d   fp16       super-block scale                                   bytes 0..1
#   qs  u32[16]    per group two words (aux0, aux1):                   bytes 2..65
#                  aux0 = 4 grid indexes (u8, 256-entry grid of 8 magnitudes)
#                  aux1 = 4 x 7-bit sign indexes (bits 0..27) | 4-bit scale ls (bits 28..31)
#   w = d * (0.5 + ls) * 0.25 * grid[idx][j] * sign;  8th sign bit = parity of the 7 stored.
def dequantize_iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    b = check_blocks(blocks, "IQ2_XXS", 66)
    n = b.shape[0]
    d = half_bits_to_f32(le_u16(b[:, 0:2]))  # [n, 1]
    qs = b[:, 2:66].reshape(n, 8, 8)
    idx = qs[:, :, 0:4].reshape(n, 32).to(torch.int64)  # aux0 bytes
    aux1 = le_u32(qs[:, :, 4:8].reshape(n, 32))  # [n, 8]
    db = (d * (0.5 + (aux1 >> 28).to(torch.float32)) * 0.25).reshape(n, 8, 1, 1)
    signs = parity_signs(split_bits(aux1, (0, 7, 14, 21), 0x7F, dim=-1)).reshape(n, 8, 4, 8)
    grid = _GRID_IQ2_XXS.on(b.device)[idx].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


# block_iq2_xs: 256 weights; 74 bytes, 2.3125 bits per weight.
#   d       fp16     super-block scale                                  bytes 0..1
#   qs      u16[32]  per 8 weights: 9-bit grid index | 7-bit sign index  bytes 2..65
#   scales  u8[8]    4-bit scale per 16 weights (low nibble first)       bytes 66..73
#   w = d * (0.5 + s) * 0.25 * grid[idx][j] * sign;  8th sign bit = parity of the 7 stored.
def dequantize_iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    b = check_blocks(blocks, "IQ2_XS", 74)
    n = b.shape[0]
    d = half_bits_to_f32(le_u16(b[:, 0:2]))
    qs = le_u16(b[:, 2:66])  # [n, 32]
    sc = nibbles(b[:, 66:74], planar=False).reshape(n, 16)
    db = (d * (0.5 + sc.to(torch.float32)) * 0.25).reshape(n, 16, 1, 1)
    signs = parity_signs(qs >> 9).reshape(n, 16, 2, 8)
    grid = _GRID_IQ2_XS.on(b.device)[(qs & 511).to(torch.int64)].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


# block_iq2_s: 256 weights; 82 bytes, 2.5625 bits per weight.
#   d       fp16    super-block scale                                   bytes 0..1
#   qs      u8[32]  low 8 bits of a 10-bit grid index per 8 weights     bytes 2..33
#   signs   u8[32]  one explicit sign bit per weight                    bytes 34..65
#   qh      u8[8]   high 2 bits of the grid indexes, 4 per byte         bytes 66..73
#   scales  u8[8]   4-bit scale per 16 weights                          bytes 74..81
#   w = d * (0.5 + s) * 0.25 * grid[idx][j] * sign
def dequantize_iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    b = check_blocks(blocks, "IQ2_S", 82)
    n = b.shape[0]
    d = half_bits_to_f32(le_u16(b[:, 0:2]))
    sc = nibbles(b[:, 74:82], planar=False).reshape(n, 16)
    db = (d * (0.5 + sc.to(torch.float32)) * 0.25).reshape(n, 16, 1, 1)
    signs = sign_bits(b[:, 34:66]).reshape(n, 16, 2, 8)
    qh = split_bits(b[:, 66:74], (0, 2, 4, 6), 0x3, dim=-1).reshape(n, 32)
    idx = (b[:, 2:34] | (qh << 8)).to(torch.int64)
    grid = _GRID_IQ2_S.on(b.device)[idx].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


# block_iq3_xxs: 256 weights in 8 groups of 32; 98 bytes, 3.0625 bits per weight.
#   d                 fp16     super-block scale                        bytes 0..1
#   qs                u8[64]   grid index per 4 weights (256-entry grid) bytes 2..65
#   scales_and_signs  u32[8]   per group: 4 x 7-bit sign indexes | 4-bit scale ls (bits 28..31)
#                                                                        bytes 66..97
#   w = d * (0.5 + ls) * 0.5 * grid[idx][j] * sign;  8th sign bit = parity of the 7 stored.
def dequantize_iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    b = check_blocks(blocks, "IQ3_XXS", 98)
    n = b.shape[0]
    d = half_bits_to_f32(le_u16(b[:, 0:2]))
    aux = le_u32(b[:, 66:98])  # [n, 8]
    db = (d * (0.5 + (aux >> 28).to(torch.float32)) * 0.5).reshape(n, 8, 1, 1)
    signs = parity_signs(split_bits(aux, (0, 7, 14, 21), 0x7F, dim=-1)).reshape(n, 8, 4, 8)
    grid = _GRID_IQ3_XXS.on(b.device)[b[:, 2:66].to(torch.int64)].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


# block_iq3_s: 256 weights in 8 groups of 32; 110 bytes, 3.4375 bits per weight.
#   d       fp16    super-block scale                                   bytes 0..1
#   qs      u8[64]  low 8 bits of a 9-bit grid index per 4 weights      bytes 2..65
#   qh      u8[8]   9th bit of the grid indexes, 8 per byte             bytes 66..73
#   signs   u8[32]  one explicit sign bit per weight                    bytes 74..105
#   scales  u8[4]   4-bit scale s per group (low nibble first)          bytes 106..109
#   w = d * (1 + 2 * s) * grid[idx][j] * sign
def dequantize_iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    b = check_blocks(blocks, "IQ3_S", 110)
    n = b.shape[0]
    d = half_bits_to_f32(le_u16(b[:, 0:2]))
    sc = nibbles(b[:, 106:110], planar=False).reshape(n, 8)
    db = (d * (1 + 2 * sc).to(torch.float32)).reshape(n, 8, 1, 1)
    signs = sign_bits(b[:, 74:106]).reshape(n, 8, 4, 8)
    qh = split_bits(b[:, 66:74], range(8), 0x1, dim=-1).reshape(n, 64)
    idx = (b[:, 2:66] | (qh << 8)).to(torch.int64)
    grid = _GRID_IQ3_S.on(b.device)[idx].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


# block_iq1_s: 256 weights in 8 groups of 32; 50 bytes, 1.5625 bits per weight.
#   d   fp16     super-block scale                                      bytes 0..1
#   qs  u8[32]   low 8 bits of an 11-bit grid index per 8 weights       bytes 2..33
#   qh  u16[8]   per group: 4 x 3 high index bits (bits 0..11), 3-bit scale s (bits 12..14),
#                delta sign (bit 15)                                    bytes 34..49
#   w = d * (2 * s + 1) * (grid[idx][j] + delta),  delta = -0.125 if bit 15 else +0.125
def dequantize_iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    b = check_blocks(blocks, "IQ1_S", 50)
    n = b.shape[0]
    d = half_bits_to_f32(le_u16(b[:, 0:2]))
    qh = le_u16(b[:, 34:50])  # [n, 8]
    dl = (d * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)).reshape(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, _IQ1_DELTA, -_IQ1_DELTA).reshape(n, 8, 1, 1)
    hi = split_bits(qh, (0, 3, 6, 9), 0x7, dim=-1).reshape(n, 32)
    idx = (b[:, 2:34] | (hi << 8)).to(torch.int64)
    grid = _GRID_IQ1.on(b.device)[idx].reshape(n, 8, 4, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


# block_iq1_m: 256 weights in 8 groups of 32; 56 bytes, 1.75 bits per weight.
#   qs      u8[32]  low 8 bits of an 11-bit grid index per 8 weights    bytes 0..31
#   qh      u8[16]  per 8 weights a nibble: 3 high index bits | delta sign (bit 3)
#                                                                       bytes 32..47
#   scales  u16[4]  bits 0..11: four 3-bit scales s (one per 16 weights); bits 12..15 of
#                   word i are bits 4i..4i+3 of the fp16 super-block scale d
#                                                                       bytes 48..55
#   w = d * (2 * s + 1) * (grid[idx][j] + delta),  delta = -0.125 if sign bit else +0.125
def dequantize_iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    b = check_blocks(blocks, "IQ1_M", 56)
    n = b.shape[0]
    sc = le_u16(b[:, 48:56])  # [n, 4]
    top = sc >> 12
    d = half_bits_to_f32(top[:, 0:1] | (top[:, 1:2] << 4) | (top[:, 2:3] << 8) | (top[:, 3:4] << 12))
    s = split_bits(sc, (0, 3, 6, 9), 0x7, dim=-1).reshape(n, 16)
    dl = (d * (2 * s + 1).to(torch.float32)).reshape(n, 8, 2, 1, 1)
    qh = nibbles(b[:, 32:48], planar=False).reshape(n, 32)
    idx = (b[:, 0:32] | ((qh & 0x7) << 8)).to(torch.int64)
    delta = torch.where((qh & 0x8) == 0, _IQ1_DELTA, -_IQ1_DELTA).reshape(n, 8, 2, 2, 1)
    grid = _GRID_IQ1.on(b.device)[idx].reshape(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


# block_iq4_nl: 32 weights; 18 bytes, 4.5 bits per weight.
#   d   fp16    block scale                                             bytes 0..1
#   qs  u8[16]  4-bit indexes into the 16 non-linear levels kvalues: low nibbles are
#               weights 0..15, high nibbles weights 16..31               bytes 2..17
#   w = d * kvalues[q]
def dequantize_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    b = check_blocks(blocks, "IQ4_NL", 18)
    n = b.shape[0]
    d = half_bits_to_f32(le_u16(b[:, 0:2]))
    q = nibbles(b[:, 2:18], planar=True).reshape(n, 32)
    return d * _KVALUES_IQ4.on(b.device)[q.to(torch.int64)]


# block_iq4_xs: 256 weights in 8 groups of 32; 136 bytes, 4.25 bits per weight.
#   d         fp16    super-block scale                                 bytes 0..1
#   scales_h  u16     high 2 bits of each group's 6-bit scale           bytes 2..3
#   scales_l  u8[4]   low 4 bits of the group scales (low nibble first) bytes 4..7
#   qs        u8[128] per group 16 bytes of 4-bit kvalues indexes (low nibbles first)
#                                                                       bytes 8..135
#   w = d * (scale - 32) * kvalues[q]
def dequantize_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    b = check_blocks(blocks, "IQ4_XS", 136)
    n = b.shape[0]
    d = half_bits_to_f32(le_u16(b[:, 0:2]))
    sh = split_bits(le_u16(b[:, 2:4]), range(0, 16, 2), 0x3, dim=-1).reshape(n, 8)
    sl = nibbles(b[:, 4:8], planar=False).reshape(n, 8)
    dl = (d * ((sl | (sh << 4)) - 32).to(torch.float32)).reshape(n, 8, 1)
    q = nibbles(b[:, 8:136].reshape(n, 8, 16), planar=True).reshape(n, 8, 32)
    return (dl * _KVALUES_IQ4.on(b.device)[q.to(torch.int64)]).reshape(n, QK_K)


_DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "IQ2_XXS": dequantize_iq2_xxs,
    "IQ2_XS": dequantize_iq2_xs,
    "IQ3_XXS": dequantize_iq3_xxs,
    "IQ1_S": dequantize_iq1_s,
    "IQ4_NL": dequantize_iq4_nl,
    "IQ3_S": dequantize_iq3_s,
    "IQ2_S": dequantize_iq2_s,
    "IQ4_XS": dequantize_iq4_xs,
    "IQ1_M": dequantize_iq1_m,
}

IQ_FORMATS: tuple[str, ...] = tuple(_DEQUANTIZERS)

for _name, _fn in _DEQUANTIZERS.items():
    register_checked(_name, _fn)
