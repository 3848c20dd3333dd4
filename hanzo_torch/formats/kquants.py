"""The K-quant formats Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: super-blocks of QK_K = 256 values.

Each super-block holds an fp16 scale ``d`` (and for Q2_K/Q4_K/Q5_K an fp16 ``dmin``) and 16 or
8 sub-blocks with small integer scales (and mins). Layouts are ggml's (``ggml-common.h``);
dequantization repeats the float32 operations of ``gguf.quants`` in the same order (first the
sub-block scale ``d * sc``, then ``(d * sc) * q``, then ``- dmin * m``), so the results are
bit-identical to it. The quantizers, ggml's reference scale searches, are in
:mod:`hanzo_torch.formats.kquant_search` (gguf has no numpy quantizer for K-quants: their oracle
is ggml's own ``ggml_quantize_chunk``). The generic bit helpers live in
:mod:`hanzo_torch.formats._bits`.
"""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, QK_K

from . import iq4_search, kquant_search, register
from ._bits import block_layout, check_blocks, fp16_field, half, i8, make_format, u8, unpack_bits

__all__ = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "K_SCALE_SIZE"]

assert all(GGML_QUANT_SIZES[GGMLQuantizationType[n]][0] == QK_K for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))

K_SCALE_SIZE = 12  # bytes of packed 6-bit scales and mins of Q4_K/Q5_K (and 6-bit scales of Q3_K)


def _sub_blocks(q: torch.Tensor, n_sub: int) -> torch.Tensor:
    """``[n, QK_K]`` -> float32 ``[n, n_sub, QK_K // n_sub]``."""
    return q.to(torch.float32).reshape(q.shape[0], n_sub, QK_K // n_sub)


# ---------------------------------------------------------------------------------------------
# Q2_K: 2.625 bits per weight.  x = d * (sc & 15) * q - dmin * (sc >> 4), q in [0, 3]
#   struct block_q2_K {
#       uint8_t   scales[QK_K/16];  // 16 sub-blocks of 16: 4-bit scale (low), 4-bit min (high)
#       uint8_t   qs[QK_K/4];       // 2-bit quants, 4 bit planes per 32-byte group
#       ggml_half d;                // super-block scale for the scales
#       ggml_half dmin;             // super-block scale for the mins
#   };  // 84 bytes
# ---------------------------------------------------------------------------------------------
_Q2_K = block_layout("Q2_K", scales=u8(QK_K // 16), qs=u8(QK_K // 4), d=half(), dmin=half())


def _q2_k_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "Q2_K")
    n = blocks.shape[0]
    d = fp16_field(blocks, _Q2_K["d"])
    dmin = fp16_field(blocks, _Q2_K["dmin"])
    sc = blocks[:, _Q2_K["scales"]]
    dl = (d * (sc & 0x0F).to(torch.float32)).unsqueeze(-1)  # [n, 16, 1]
    ml = (dmin * (sc >> 4).to(torch.float32)).unsqueeze(-1)
    q = _sub_blocks(unpack_bits(blocks[:, _Q2_K["qs"]], 2, 32), QK_K // 16)
    return (dl * q - ml).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------------
# Q3_K: 3.4375 bits per weight.  x = d * (s - 32) * (q - 4 * (1 - h)), q in [0, 3], h the hmask bit
#   struct block_q3_K {
#       uint8_t   hmask[QK_K/8];    // high bit: value i is bit i // 32 of hmask[i % 32]
#       uint8_t   qs[QK_K/4];       // low 2 bits, as Q2_K
#       uint8_t   scales[12];       // 16 6-bit scales: low nibbles in bytes 0-7, high 2 bits in 8-11
#       ggml_half d;                // super-block scale
#   };  // 110 bytes
# ---------------------------------------------------------------------------------------------
_Q3_K = block_layout("Q3_K", hmask=u8(QK_K // 8), qs=u8(QK_K // 4), scales=u8(K_SCALE_SIZE), d=half())


def _q3_k_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "Q3_K")
    n = blocks.shape[0]
    d = fp16_field(blocks, _Q3_K["d"])
    packed = blocks[:, _Q3_K["scales"]]
    low = unpack_bits(packed[:, :8], 4, 8)    # [n, 16]: scale j, bits 0-3
    high = unpack_bits(packed[:, 8:], 2, 4)   # [n, 16]: scale j, bits 4-5
    scales = (low | (high << 4)).to(torch.float32) - 32
    dl = (d * scales).unsqueeze(-1)           # [n, 16, 1]
    ql = unpack_bits(blocks[:, _Q3_K["qs"]], 2, 32).to(torch.int16)
    h = unpack_bits(blocks[:, _Q3_K["hmask"]], 1, 32).to(torch.int16)
    q = _sub_blocks(ql - ((h ^ 1) << 2), QK_K // 16)  # the offset 4 applies where the bit is 0
    return (dl * q).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------------
# Q4_K: 4.5 bits per weight.  x = d * sc * q - dmin * m, q in [0, 15], 8 sub-blocks of 32
#   struct block_q4_K {
#       ggml_half d;                      // super-block scale for the scales
#       ggml_half dmin;                   // super-block scale for the mins
#       uint8_t   scales[K_SCALE_SIZE];   // 8 6-bit scales and 8 6-bit mins (see _scale_min_k4)
#       uint8_t   qs[QK_K/2];             // 4-bit quants: per 32 bytes, 32 low then 32 high nibbles
#   };  // 144 bytes
# ---------------------------------------------------------------------------------------------
_Q4_K = block_layout("Q4_K", d=half(), dmin=half(), scales=u8(K_SCALE_SIZE), qs=u8(QK_K // 2))


def _scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte scales of Q4_K/Q5_K into 8 scales and 8 mins, ``uint8 [n, 8]`` each.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales and mins 4-7 have
    their low 4 bits in the low/high nibble of bytes 8-11 and their top 2 bits in the top 2 bits
    of bytes 0-3 (scales) and 4-7 (mins).
    """
    s_lo, m_lo, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([s_lo & 0x3F, (mixed & 0x0F) | ((s_lo >> 2) & 0x30)], dim=1)
    mn = torch.cat([m_lo & 0x3F, (mixed >> 4) | ((m_lo >> 2) & 0x30)], dim=1)
    return sc, mn


def _k4_scales(blocks: torch.Tensor, layout: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``d * sc`` and ``dmin * m`` of Q4_K/Q5_K, float32 ``[n, 8, 1]`` each."""
    d = fp16_field(blocks, layout["d"])
    dmin = fp16_field(blocks, layout["dmin"])
    sc, mn = _scale_min_k4(blocks[:, layout["scales"]])
    return (d * sc.to(torch.float32)).unsqueeze(-1), (dmin * mn.to(torch.float32)).unsqueeze(-1)


def _q4_k_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "Q4_K")
    n = blocks.shape[0]
    dl, ml = _k4_scales(blocks, _Q4_K)
    q = _sub_blocks(unpack_bits(blocks[:, _Q4_K["qs"]], 4, 32), 8)
    return (dl * q - ml).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------------
# Q5_K: 5.5 bits per weight.  x = d * sc * q - dmin * m, q in [0, 31], 8 sub-blocks of 32
#   struct block_q5_K {
#       ggml_half d;
#       ggml_half dmin;
#       uint8_t   scales[K_SCALE_SIZE];   // as Q4_K
#       uint8_t   qh[QK_K/8];             // fifth bit: value i is bit i // 32 of qh[i % 32]
#       uint8_t   qs[QK_K/2];             // low 4 bits, as Q4_K
#   };  // 176 bytes
# ---------------------------------------------------------------------------------------------
_Q5_K = block_layout("Q5_K", d=half(), dmin=half(), scales=u8(K_SCALE_SIZE), qh=u8(QK_K // 8), qs=u8(QK_K // 2))


def _q5_k_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "Q5_K")
    n = blocks.shape[0]
    dl, ml = _k4_scales(blocks, _Q5_K)
    ql = unpack_bits(blocks[:, _Q5_K["qs"]], 4, 32)
    qh = unpack_bits(blocks[:, _Q5_K["qh"]], 1, 32)
    q = _sub_blocks(ql | (qh << 4), 8)
    return (dl * q - ml).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------------
# Q6_K: 6.5625 bits per weight.  x = d * sc * (q - 32), q in [0, 63], 16 sub-blocks of 16
#   struct block_q6_K {
#       uint8_t   ql[QK_K/2];       // low 4 bits: per 64 bytes, 64 low then 64 high nibbles
#       uint8_t   qh[QK_K/4];       // high 2 bits: per 32 bytes, 4 bit planes of 32 values
#       int8_t    scales[QK_K/16];  // 8-bit signed sub-block scales
#       ggml_half d;                // super-block scale
#   };  // 210 bytes
# ---------------------------------------------------------------------------------------------
_Q6_K = block_layout("Q6_K", ql=u8(QK_K // 2), qh=u8(QK_K // 4), scales=i8(QK_K // 16), d=half())


def _q6_k_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "Q6_K")
    n = blocks.shape[0]
    d = fp16_field(blocks, _Q6_K["d"])
    sc = blocks[:, _Q6_K["scales"]].view(torch.int8).to(torch.float32)
    dl = (d * sc).unsqueeze(-1)  # [n, 16, 1]
    ql = unpack_bits(blocks[:, _Q6_K["ql"]], 4, 64)
    qh = unpack_bits(blocks[:, _Q6_K["qh"]], 2, 32)
    q = _sub_blocks((ql | (qh << 4)).to(torch.int16) - 32, QK_K // 16)
    return (dl * q).reshape(n, QK_K)


Q2_K = register(make_format("Q2_K", _q2_k_dequantize, kquant_search.quantize_q2_k, layout=_Q2_K, vec_dot_type="q8_K", group_len=16,
                           quantize_weighted=iq4_search.WEIGHTED["Q2_K"]))
Q3_K = register(make_format("Q3_K", _q3_k_dequantize, kquant_search.quantize_q3_k, layout=_Q3_K, vec_dot_type="q8_K", group_len=16,
                           quantize_weighted=iq4_search.WEIGHTED["Q3_K"]))
Q4_K = register(make_format("Q4_K", _q4_k_dequantize, kquant_search.quantize_q4_k, layout=_Q4_K, vec_dot_type="q8_K", group_len=32,
                           quantize_weighted=iq4_search.WEIGHTED["Q4_K"]))
Q5_K = register(make_format("Q5_K", _q5_k_dequantize, kquant_search.quantize_q5_k, layout=_Q5_K, vec_dot_type="q8_K", group_len=32,
                           quantize_weighted=iq4_search.WEIGHTED["Q5_K"]))
Q6_K = register(make_format("Q6_K", _q6_k_dequantize, kquant_search.quantize_q6_k, layout=_Q6_K, vec_dot_type="q8_K", group_len=16,
                           quantize_weighted=iq4_search.WEIGHTED["Q6_K"]))
