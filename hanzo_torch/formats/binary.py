"""Binary (sign-only) format Q1_0: every weight is +d or -d, one fp16 scale d per 128 weights.

The layout is ggml's (``ggml-common.h``, ``block_q1_0``; ggml type 41, 1.125 bits per weight).
``gguf`` (0.19) knows the type id and sizes but has no numpy dequantizer or quantizer for it,
so the oracle of the tests is ggml's ``dequantize_row_q1_0`` rule, restated in numpy
(``GGML_RULES`` of ``hanzo_torch/backends/triton/_testing.py``); hanzo-torch does not quantize
to Q1_0 (ggml's quantizer has no numpy counterpart to check bytes against). The generic bit helpers live in
:mod:`hanzo_torch.formats._bits`.
"""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import register
from ._bits import block_layout, check_blocks, fp16_field, half, make_format, u8, unpack_bits

__all__ = ["BINARY_FORMATS"]

BINARY_FORMATS: tuple[str, ...] = ()

# ---------------------------------------------------------------------------------------------
# Q1_0: 1.125 bits per weight.  x = d if bit else -d
#   struct block_q1_0 { ggml_half d; uint8_t qs[QK1_0/8]; };  // 18 bytes, QK1_0 = 128
#   qs: value j is bit j % 8 of qs[j // 8] (least significant bit first)
# ---------------------------------------------------------------------------------------------
if hasattr(GGMLQuantizationType, "Q1_0"):
    QK1_0 = GGML_QUANT_SIZES[GGMLQuantizationType.Q1_0][0]  # 128
    _Q1_0 = block_layout("Q1_0", d=half(), qs=u8(QK1_0 // 8))

    def _q1_0_dequantize(blocks: torch.Tensor) -> torch.Tensor:
        check_blocks(blocks, "Q1_0")
        d = fp16_field(blocks, _Q1_0["d"])
        bits = unpack_bits(blocks[:, _Q1_0["qs"]], 1, 1)  # [n, 128], value j = bit j
        return d * (2 * bits.to(torch.float32) - 1)

    Q1_0 = register(make_format("Q1_0", _q1_0_dequantize, layout=_Q1_0, vec_dot_type="q8_0", group_len=QK1_0))
    BINARY_FORMATS += ("Q1_0",)
