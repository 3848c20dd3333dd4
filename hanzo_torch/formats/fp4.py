"""FP4 formats: MXFP4 (OCP microscaling, E2M1 values with an E8M0 scale per 32) and NVFP4
(E2M1 values with an unsigned E4M3 scale per 16), where the installed ``gguf`` knows them.

Layouts are ggml's (``ggml-common.h``, ``block_mxfp4`` / ``block_nvfp4``). The E2M1 levels
(stored doubled, as ggml's ``kvalues_mxfp4``), the E8M0 and the UE4M3 scale decoders are read
from ``gguf.quants`` at import: the scale decoders are evaluated once on all 256 byte values and
kept as 256-entry tables, so dequantization is bit-identical to gguf by construction.
MXFP4 quantization repeats gguf's (scale exponent ``floor(log2(max|x|)) - 2``, nearest level,
first on ties) and is byte-identical to ``gguf.quants.quantize``; gguf has no NVFP4 quantizer,
so neither does hanzo-torch. The generic bit and table helpers live in
:mod:`hanzo_torch.formats._bits`.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as _gq

from . import register
from ._bits import (
    DeviceTable, block_layout, check_blocks, check_values, lookup, make_format, pack_bits,
    table_from_gguf, u8, unpack_bits,
)

__all__ = ["FP4_FORMATS"]

_BYTES = np.arange(256, dtype=np.uint8)


def _byte_table(decode) -> DeviceTable:
    """A 256-entry float32 table: ``decode`` (a gguf scale decoder) applied to every byte."""
    with np.errstate(all="ignore"):
        values = np.asarray(decode(_BYTES.copy()))
    assert values.dtype == np.float32 and values.shape == (256,), (values.dtype, values.shape)
    return table_from_gguf(values, torch.float32)


FP4_FORMATS: tuple[str, ...] = ()

# ---------------------------------------------------------------------------------------------
# MXFP4: 4.25 bits per weight.  x = e8m0_half(e) * kvalues[q]
#   struct block_mxfp4 { uint8_t e; uint8_t qs[QK_MXFP4/2]; };  // 17 bytes, QK_MXFP4 = 32
#   e: E8M0 exponent; e8m0_half(e) = 2^(e - 128) (half the E8M0 scale, because kvalues are the
#      E2M1 levels doubled: 0 1 2 3 4 6 8 12 and their negatives)
#   qs: 4-bit E2M1 codes, value j < 16 in the low nibble of qs[j], value j + 16 in its high nibble
# ---------------------------------------------------------------------------------------------
if hasattr(_gq, "MXFP4") and hasattr(GGMLQuantizationType, "MXFP4"):
    QK_MXFP4 = GGML_QUANT_SIZES[GGMLQuantizationType.MXFP4][0]  # 32
    _MXFP4 = block_layout("MXFP4", e=u8(scale="e8m0"), qs=u8(QK_MXFP4 // 2))
    _E8M0_HALF = _byte_table(_gq.MXFP4.e8m0_to_fp32_half)
    _KVALUES_MXFP4 = table_from_gguf(_gq.MXFP4.kvalues, torch.float32)

    def _numpy_floor_log2_thresholds() -> DeviceTable:
        """``t[i]``: the least positive float32 v with ``floor(log2(v)) >= i - 149`` in numpy float32.

        gguf computes the MXFP4 exponent as ``np.floor(np.log2(d))`` in float32, and float32
        ``log2`` rounds up to the next integer for d within a few ulps below a power of two (about
        7.5 thousand float32 values), where gguf stores an exponent one above the exact one. Counting
        these thresholds at or below d reproduces numpy's answer exactly, on any device and
        without depending on the device's own ``log2``. Built once at import by bisection on
        float32 bit patterns with numpy's own ``log2``.
        """
        ks = np.arange(-149, 129, dtype=np.float64)
        lo = np.ones(ks.shape, dtype=np.uint64)  # bit pattern of the least positive subnormal
        hi = np.full(ks.shape, 0x7F7FFFFF, dtype=np.uint64)  # largest finite float32
        while np.any(lo < hi):
            mid = (lo + hi) // 2
            v = mid.astype(np.uint32).view(np.float32)
            ok = np.floor(np.log2(v)) >= ks
            hi = np.where(ok, mid, hi)
            lo = np.where(ok, lo, mid + 1)
        t = lo.astype(np.uint32).view(np.float32)
        assert np.all(np.diff(t) > 0)
        return DeviceTable(torch.from_numpy(t.copy()))

    _LOG2_THRESHOLDS = _numpy_floor_log2_thresholds()

    def _mxfp4_dequantize(blocks: torch.Tensor) -> torch.Tensor:
        check_blocks(blocks, "MXFP4")
        d = lookup(_E8M0_HALF, blocks[:, _MXFP4["e"]])  # [n, 1]
        q = unpack_bits(blocks[:, _MXFP4["qs"]], 4, QK_MXFP4 // 2)
        return d * lookup(_KVALUES_MXFP4, q)

    def _mxfp4_quantize(blocks: torch.Tensor) -> torch.Tensor:
        blocks = check_values(blocks, "MXFP4")
        d = blocks.abs().amax(dim=-1, keepdim=True)  # [n, 1]
        # e = floor(log2(d)) - 2 + 127 as numpy float32 computes it, then numpy's float->uint8
        # cast on x86 (wraps modulo 256 in int32 range; gives 0 for inf); 0 where not d > 0.
        floor_log2 = torch.searchsorted(_LOG2_THRESHOLDS.on(d.device), d.contiguous(), right=True) - 150
        e = torch.where((d > 0) & torch.isfinite(d), (floor_log2 + 125) & 0xFF, torch.zeros_like(floor_log2))
        scale = lookup(_E8M0_HALF, e)  # [n, 1]
        kv = _KVALUES_MXFP4.on(d.device)
        err = (scale.unsqueeze(-1) * kv - blocks.unsqueeze(-1)).abs()  # [n, 32, 16]
        q = err.argmin(dim=-1)  # first minimum on ties, as numpy's argmin
        return torch.cat([e.to(torch.uint8), pack_bits(q, 4, QK_MXFP4 // 2)], dim=1)

    MXFP4 = register(make_format("MXFP4", _mxfp4_dequantize, _mxfp4_quantize, layout=_MXFP4, vec_dot_type="q8_0",
                                 tables={"kvalues": _KVALUES_MXFP4}, group_len=QK_MXFP4))
    FP4_FORMATS += ("MXFP4",)


# ---------------------------------------------------------------------------------------------
# NVFP4: 4.5 bits per weight.  x = ue4m3_half(d[s]) * kvalues[q], 4 sub-blocks s of 16
#   struct block_nvfp4 { uint8_t d[QK_NVFP4/QK_NVFP4_SUB]; uint8_t qs[QK_NVFP4/2]; };  // 36 bytes,
#   QK_NVFP4 = 64, QK_NVFP4_SUB = 16
#   d: unsigned E4M3 scale (bias 7) per sub-block, decoded at half value (doubled kvalues as MXFP4);
#      0x7F (NaN in E4M3) decodes to 0
#   qs: 8 bytes per sub-block: value j < 8 in the low nibble of byte j, value j + 8 in its high nibble
# ---------------------------------------------------------------------------------------------
if hasattr(_gq, "NVFP4") and hasattr(GGMLQuantizationType, "NVFP4"):
    QK_NVFP4 = GGML_QUANT_SIZES[GGMLQuantizationType.NVFP4][0]  # 64
    QK_NVFP4_SUB = 16
    _NVFP4 = block_layout("NVFP4", d=u8(QK_NVFP4 // QK_NVFP4_SUB, scale="ue4m3"), qs=u8(QK_NVFP4 // 2))
    _UE4M3_HALF = _byte_table(_gq.NVFP4.ue4m3_to_fp32)
    _KVALUES_NVFP4 = table_from_gguf(_gq.NVFP4.kvalues, torch.float32)

    def _nvfp4_dequantize(blocks: torch.Tensor) -> torch.Tensor:
        check_blocks(blocks, "NVFP4")
        n = blocks.shape[0]
        n_sub = QK_NVFP4 // QK_NVFP4_SUB
        d = lookup(_UE4M3_HALF, blocks[:, _NVFP4["d"]]).reshape(n, n_sub, 1)
        q = unpack_bits(blocks[:, _NVFP4["qs"]], 4, QK_NVFP4_SUB // 2).reshape(n, n_sub, QK_NVFP4_SUB)
        return (d * lookup(_KVALUES_NVFP4, q)).reshape(n, QK_NVFP4)

    NVFP4 = register(make_format("NVFP4", _nvfp4_dequantize, layout=_NVFP4, vec_dot_type="q8_0",
                                 tables={"kvalues": _KVALUES_NVFP4}, group_len=QK_NVFP4_SUB))
    FP4_FORMATS += ("NVFP4",)
