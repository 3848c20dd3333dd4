"""The legacy ggml formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32 values per block), and the shared
bit-packing helpers.

Layouts are ggml's (``ggml-common.h``); dequantization repeats the float32 operations of
``gguf.quants`` in the same order, so results are bit-identical to it, and quantization repeats
its rounding, so the bytes are identical too.

Shared helpers, used by the K-quants and open to every format module:

* :func:`unpack_bits` / :func:`pack_bits`: the ggml bit-plane layout of packed quants.
* :func:`round_half_away`: C ``roundf`` (ties away from zero), as gguf's ``np_roundf``.
* :func:`float_const`: a float32 0-dim tensor on the data's device, used as a divisor so that
  ``x / c`` is a true IEEE division on every device (CUDA turns division by a Python scalar into
  a multiplication by its reciprocal, which is not bit-exact).
"""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .dense import block_layout, check_blocks, fp16_bytes, fp16_field, make_format
from . import register

__all__ = ["unpack_bits", "pack_bits", "round_half_away", "float_const", "signed_absmax", "codes_from_float"]

QK = 32  # values per legacy block (QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0 = 32)
assert all(GGML_QUANT_SIZES[GGMLQuantizationType[n]][0] == QK for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"))


# ---------------------------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------------------------

def unpack_bits(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Unpack ``bits``-wide fields from bytes in ggml's bit-plane order.

    The bytes of each row are taken ``group`` at a time; one group of bytes yields
    ``8 // bits`` runs of ``group`` values: first bits ``[0, bits)`` of every byte of the group,
    then bits ``[bits, 2*bits)``, and so on. Examples: Q4_0 ``qs`` is ``unpack_bits(qs, 4, 16)``
    (value j < 16 is the low nibble of byte j, value j + 16 its high nibble); a little-endian
    uint32 bit mask is ``unpack_bits(qh, 1, 1)`` (value j is bit j).

    Args:
        x: ``uint8 [n, L]``, L a multiple of ``group``.
        bits: 1, 2, 4 or 8.
        group: bytes per group.

    Returns:
        ``uint8 [n, L * 8 // bits]`` with values in ``[0, 2**bits)``.
    """
    n, length = x.shape
    mask = (1 << bits) - 1
    xv = x.reshape(n, length // group, 1, group)
    # one scalar shift per bit plane (much faster on CPU than a broadcast tensor of shifts)
    planes = [xv & mask if s == 0 else (xv >> s) & mask for s in range(0, 8, bits)]
    return torch.cat(planes, dim=2).reshape(n, length * 8 // bits)


def pack_bits(q: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Inverse of :func:`unpack_bits`: ``q [n, M]`` integers in ``[0, 2**bits)`` -> ``uint8 [n, M * bits // 8]``."""
    n, m = q.shape
    per_byte = 8 // bits
    qv = q.to(torch.int32).reshape(n, m // (group * per_byte), per_byte, group)
    acc = qv[:, :, 0]
    for k in range(1, per_byte):
        acc = acc | (qv[:, :, k] << (k * bits))
    return acc.to(torch.uint8).reshape(n, m * bits // 8)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, ties away from zero (C ``roundf``), in float32.

    The same operations as gguf's ``np_roundf``: ``sign(x) * (floor(|x|) + floor(2 * frac))``.
    (``torch.round`` rounds ties to even and would differ.)
    """
    a = x.abs()
    fl = torch.floor(a)
    return torch.sign(x) * (fl + torch.floor(2 * (a - fl)))


def float_const(value: float, like: torch.Tensor) -> torch.Tensor:
    """A float32 0-dim tensor holding ``value`` on ``like``'s device (a fill, no host copy)."""
    return torch.full((), value, dtype=torch.float32, device=like.device)


def signed_absmax(blocks: torch.Tensor) -> torch.Tensor:
    """``[n, 1]``: the value of largest magnitude of each row, with its sign; the first one on ties
    (numpy's ``argmax`` rule, which ``torch.argmax`` shares)."""
    idx = blocks.abs().argmax(dim=-1, keepdim=True)
    return torch.gather(blocks, -1, idx)


def codes_from_float(t: torch.Tensor, lo: int, hi: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Convert whole float32 values to integer codes clipped to ``[lo, hi]``.

    gguf converts with ``astype(np.uint8)`` (or int8), which for the non-finite values that
    appear when a block's scale is a float32 subnormal (1/d overflows) yields 0 on x86; we do
    the same on every device. Such blocks store d = 0 in fp16, so their codes never matter for
    the decoded values.
    """
    t = torch.where(torch.isfinite(t), t, torch.zeros_like(t))
    return t.clamp(lo, hi).to(dtype)


def _safe_reciprocal(d: torch.Tensor) -> torch.Tensor:
    # id = d ? 1/d : 0, with a true division (see float_const)
    return torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / d)


def _as_blocks(blocks: torch.Tensor, name: str) -> torch.Tensor:
    if blocks.dim() != 2 or blocks.shape[1] != QK:
        raise ValueError(f"{name}: values must have shape [n, {QK}], got {list(blocks.shape)}")
    return blocks.to(torch.float32)


# ---------------------------------------------------------------------------------------------
# Q4_0: 4.5 bits per weight.  x = d * (q - 8), q in [0, 15]
#   struct block_q4_0 { ggml_half d; uint8_t qs[16]; }  // 18 bytes
#   qs: value j (j < 16) in the low nibble of qs[j], value j + 16 in its high nibble
# ---------------------------------------------------------------------------------------------
_Q4_0 = block_layout("Q4_0", d=2, qs=QK // 2)


def _q4_0_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "Q4_0")
    d = fp16_field(blocks, _Q4_0["d"])
    q = unpack_bits(blocks[:, _Q4_0["qs"]], 4, QK // 2).to(torch.float32) - 8
    return d * q


def _quantize_symmetric(blocks: torch.Tensor, bits: int):
    # Q4_0/Q5_0 (as gguf): d = max / -2^(bits-1) with max the signed absmax, q = trunc(x/d + 2^(bits-1) + 0.5)
    half = 1 << (bits - 1)
    d = signed_absmax(blocks) / float_const(-half, blocks)
    q = torch.trunc(blocks * _safe_reciprocal(d) + (half + 0.5))
    return d, codes_from_float(q, 0, 2 * half - 1)


def _q4_0_quantize(blocks: torch.Tensor) -> torch.Tensor:
    blocks = _as_blocks(blocks, "Q4_0")
    d, q = _quantize_symmetric(blocks, 4)
    return torch.cat([fp16_bytes(d), pack_bits(q, 4, QK // 2)], dim=1)


# ---------------------------------------------------------------------------------------------
# Q4_1: 5.0 bits per weight.  x = d * q + m, q in [0, 15]
#   struct block_q4_1 { ggml_half d; ggml_half m; uint8_t qs[16]; }  // 20 bytes
# ---------------------------------------------------------------------------------------------
_Q4_1 = block_layout("Q4_1", d=2, m=2, qs=QK // 2)


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
    q = torch.trunc((blocks - mn) * _safe_reciprocal(d) + 0.5)
    return d, mn, codes_from_float(q, 0, top)


def _q4_1_quantize(blocks: torch.Tensor) -> torch.Tensor:
    blocks = _as_blocks(blocks, "Q4_1")
    d, m, q = _quantize_affine(blocks, 4)
    return torch.cat([fp16_bytes(d), fp16_bytes(m), pack_bits(q, 4, QK // 2)], dim=1)


# ---------------------------------------------------------------------------------------------
# Q5_0: 5.5 bits per weight.  x = d * (q - 16), q = low nibble | high bit << 4 in [0, 31]
#   struct block_q5_0 { ggml_half d; uint8_t qh[4]; uint8_t qs[16]; }  // 22 bytes
#   qh: little-endian uint32, bit j = fifth bit of value j; qs as Q4_0
# ---------------------------------------------------------------------------------------------
_Q5_0 = block_layout("Q5_0", d=2, qh=4, qs=QK // 2)


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
    blocks = _as_blocks(blocks, "Q5_0")
    d, q = _quantize_symmetric(blocks, 5)
    return torch.cat([fp16_bytes(d), *_q5_pack(q)], dim=1)


# ---------------------------------------------------------------------------------------------
# Q5_1: 6.0 bits per weight.  x = d * q + m, q in [0, 31]
#   struct block_q5_1 { ggml_half d; ggml_half m; uint8_t qh[4]; uint8_t qs[16]; }  // 24 bytes
# ---------------------------------------------------------------------------------------------
_Q5_1 = block_layout("Q5_1", d=2, m=2, qh=4, qs=QK // 2)


def _q5_1_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "Q5_1")
    d = fp16_field(blocks, _Q5_1["d"])
    m = fp16_field(blocks, _Q5_1["m"])
    return d * _q5_codes(blocks, _Q5_1) + m


def _q5_1_quantize(blocks: torch.Tensor) -> torch.Tensor:
    blocks = _as_blocks(blocks, "Q5_1")
    d, m, q = _quantize_affine(blocks, 5)
    return torch.cat([fp16_bytes(d), fp16_bytes(m), *_q5_pack(q)], dim=1)


# ---------------------------------------------------------------------------------------------
# Q8_0: 8.5 bits per weight.  x = d * q, q int8
#   struct block_q8_0 { ggml_half d; int8_t qs[32]; }  // 34 bytes
# ---------------------------------------------------------------------------------------------
_Q8_0 = block_layout("Q8_0", d=2, qs=QK)


def _q8_0_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    check_blocks(blocks, "Q8_0")
    d = fp16_field(blocks, _Q8_0["d"])
    q = blocks[:, _Q8_0["qs"]].view(torch.int8).to(torch.float32)
    return q * d


def _q8_0_quantize(blocks: torch.Tensor) -> torch.Tensor:
    # quantize_row_q8_0_ref: d = amax / 127, q = roundf(x / d)
    blocks = _as_blocks(blocks, "Q8_0")
    d = blocks.abs().amax(dim=-1, keepdim=True) / float_const(127, blocks)
    q = codes_from_float(round_half_away(blocks * _safe_reciprocal(d)), -128, 127, torch.int8)
    return torch.cat([fp16_bytes(d), q.view(torch.uint8)], dim=1)


Q4_0 = register(make_format("Q4_0", _q4_0_dequantize, _q4_0_quantize))
Q4_1 = register(make_format("Q4_1", _q4_1_dequantize, _q4_1_quantize))
Q5_0 = register(make_format("Q5_0", _q5_0_dequantize, _q5_0_quantize))
Q5_1 = register(make_format("Q5_1", _q5_1_dequantize, _q5_1_quantize))
Q8_0 = register(make_format("Q8_0", _q8_0_dequantize, _q8_0_quantize))
