"""i-quant, ternary and FP4 formats against their oracle, ``gguf.quants`` (numpy).

Registration, extreme fp16 scales (inf and NaN included), every byte value of the E8M0/UE4M3
scales, and rows of many valid blocks (plus a strided view) are compared bit for bit (NaN
matches NaN, -0.0 differs from +0.0), on the CPU and on CUDA when present; random valid, zero,
empty and meta blocks and bad arguments are covered for every format in tests/test_formats.py
(the scale fields of every format are listed in ``format_utils.FLOAT_FIELDS``). TQ1_0, TQ2_0
and MXFP4 quantization is compared byte for byte, ties, zeros, tiny, huge and non-finite inputs
included. The parity rule for the IQ2/IQ3 sign bits is checked against gguf's ``ksigns`` table.
"""
from __future__ import annotations

import platform

import pytest
import torch
from gguf import quants as gguf_quants

import hanzo_torch
from hanzo_torch.formats import dequantize, get_format, quantize
from hanzo_torch.formats.iquants import parity_signs
from format_utils import (
    EXTREME_BITS, FLOAT_FIELDS, assert_bits_equal, check_dequantize, field_kinds,
    gguf_dequantize, gguf_quantize, random_blocks, seeded, with_float_fields,
)

# The formats of this file, in registration order (NVFP4 where the installed gguf has it).
NAMES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
         "TQ1_0", "TQ2_0", "MXFP4", "NVFP4")
OURS = [n for n in NAMES if n in hanzo_torch.FORMATS]
F16_SCALED = [n for n in OURS if field_kinds(n) <= {"f16", "f16_iq1m"}]  # fp16 d (IQ1_M's split in nibbles)
BYTE_SCALED = [n for n in OURS if field_kinds(n) <= {"e8m0", "ue4m3"}]  # every byte a finite scale
QUANTIZERS = ["TQ1_0", "TQ2_0", "MXFP4"]
# no gguf quantizer: gated against ggml (tests/test_iq4_quantize.py, tests/test_iquant_quantize.py)
GGML_QUANTIZERS = ["IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"]

# fp16 bit patterns: the finite extremes of format_utils (max, -max, smallest subnormal of
# both signs, smallest normal, zero), and 1.0, -0.0, +inf, NaN (two payloads)
EXTREME_F16 = EXTREME_BITS["f16"] + (0x3C00, 0x8000, 0x7C00, 0x7E00)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
X86 = platform.machine().lower() in ("x86_64", "amd64")


# ---------------------------------------------------------------------------------------------
# dequantize
# ---------------------------------------------------------------------------------------------

def test_all_formats_registered_with_gguf_sizes():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    expected = [n for n in NAMES if n != "NVFP4"] + (["NVFP4"] if hasattr(gguf_quants, "NVFP4") else [])
    assert OURS == expected
    assert F16_SCALED + BYTE_SCALED == OURS
    for name in OURS:
        fmt = get_format(name)
        qtype = GGMLQuantizationType[name]
        assert (fmt.type_id, fmt.block_size, fmt.type_size) == (int(qtype), *GGML_QUANT_SIZES[qtype])
        assert get_format(int(qtype)) is fmt
        assert (fmt.quantize_blocks is not None) == (name in QUANTIZERS or name in GGML_QUANTIZERS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", F16_SCALED)
def test_dequantize_extreme_f16_scales(name, device):
    base = random_blocks(name, 16, seeded("extreme", name))
    blocks = torch.cat([with_float_fields(base, name, bits) for bits in EXTREME_F16])
    out = check_dequantize(blocks, name, device, "extreme fp16 scales")
    assert torch.isinf(out).any() and torch.isnan(out).any()  # the inf and NaN scales came through


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", BYTE_SCALED)
def test_dequantize_every_scale_byte(name, device):
    # every byte value in every scale position (E8M0 255 and UE4M3 0x7F/0xFF included)
    fmt = get_format(name)
    offsets = [offset for offset, _ in FLOAT_FIELDS[name]]
    assert len(offsets) == (1 if name == "MXFP4" else 4)
    blocks = random_blocks(name, 256 * len(offsets), seeded("scale bytes", name))
    for i, pos in enumerate(offsets):
        blocks[i * 256:(i + 1) * 256, pos] = torch.arange(256, dtype=torch.uint8)
    assert blocks.shape[1] == fmt.type_size
    check_dequantize(blocks, name, device, "every scale byte")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OURS)
def test_dequantize_rows_of_many_blocks(name, device):
    fmt = get_format(name)
    rows, per_row = 5, 7
    data = random_blocks(name, rows * per_row, seeded("rows", name)).reshape(rows, per_row * fmt.type_size)
    shape = (rows, per_row * fmt.block_size)
    out = dequantize(data.to(device), name, shape)
    assert_bits_equal(out, gguf_dequantize(data, name), f"{name} rows on {device}")
    # a strided view (blocks at an odd offset inside wider rows) gives the same values
    wide = torch.zeros(rows * per_row, fmt.type_size + 3, dtype=torch.uint8)
    wide[:, 1:1 + fmt.type_size] = data.reshape(-1, fmt.type_size)
    strided = fmt.dequantize_blocks(wide[:, 1:1 + fmt.type_size].to(device))
    assert_bits_equal(strided.reshape(shape), out, f"{name} strided on {device}")


def test_parity_signs_equal_gguf_ksigns_table():
    # The 8th sign bit of IQ2_XXS/IQ2_XS/IQ3_XXS is the parity of the 7 stored: same as ggml's table.
    ksigns = torch.tensor(list(gguf_quants.IQ2_XXS.ksigns), dtype=torch.int64)
    assert ksigns.shape == (128,)
    table_signs = 1.0 - 2.0 * ((ksigns.unsqueeze(-1) >> torch.arange(8)) & 1).to(torch.float32)
    assert torch.equal(parity_signs(torch.arange(128)), table_signs)


# ---------------------------------------------------------------------------------------------
# quantize
# ---------------------------------------------------------------------------------------------

def _ternary_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
    k = 256
    ties = torch.randint(-2, 3, (6, k), generator=g).to(torch.float32) * 0.5  # x / max = +-0.5: ties
    ties[:, 0] = 1.0
    return {
        "normal": torch.randn(40, k, generator=g),
        "zeros": torch.zeros(2, k),
        "ties": ties * torch.tensor([[1.0], [3.0], [0.125], [-7.0], [1e-3], [6e4]]),
        "one nonzero": torch.zeros(3, k).index_fill_(1, torch.tensor([5]), -2.5),
        "tiny": torch.randn(4, k, generator=g) * 1e-40,  # subnormal max: 1/d overflows, d -> 0
        "huge": torch.randn(4, k, generator=g) * 1e38,  # d overflows fp16 -> inf
    }


def _mxfp4_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
    k = 32
    # block max 12 -> scale 1: the levels are 0 1 2 3 4 6 8 12, ties at the midpoints between
    mids = torch.tensor([0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0, 0.0])
    ties = mids[torch.randint(0, 8, (8, k), generator=g)]
    ties = ties * torch.where(torch.rand(8, k, generator=g) < 0.5, -1.0, 1.0)
    ties[:, 0] = 12.0
    ties = ties * torch.tensor([1.0, 2.0**-20, 2.0**30, 0.25, -1.0, 2.0**-100, 2.0**100, 1.0]).unsqueeze(1)
    # block maxima within a few ulps below/above powers of two, where float32 log2 rounds up
    k_exp = torch.arange(-149, 128)
    p2_bits = torch.where(k_exp >= -126, (k_exp + 127).clamp(min=0) << 23, 1 << (k_exp + 149).clamp(0, 22))
    near = (p2_bits.unsqueeze(1) + torch.arange(-40, 3)).reshape(-1)
    near = near[(near > 0) & (near < 0x7F800000)].to(torch.int32).view(torch.float32)
    near_blocks = torch.rand(near.shape[0], k, generator=g) * near.unsqueeze(1)
    near_blocks[:, 7] = -near
    return {
        "normal": torch.randn(64, k, generator=g),
        "zeros": torch.zeros(2, k),
        "ties": ties,
        "near powers of two": near_blocks,
        "subnormal": torch.randn(4, k, generator=g) * 1e-42,
        "huge": torch.randn(4, k, generator=g) * 3e38,
    }


def _non_finite(k: int) -> torch.Tensor:
    x = torch.zeros(4, k)
    x[0, 3] = float("inf")
    x[1, 7] = float("nan")
    x[2] = -float("inf")
    x[3, ::2] = float("nan")
    x[3, 1::2] = 1.5
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", QUANTIZERS)
def test_quantize_matches_gguf_bytes(name, device):
    g = seeded("quantize", name)
    cases = _mxfp4_inputs(g) if name == "MXFP4" else _ternary_inputs(g)
    if X86:  # gguf's codes for inf/NaN come from numpy's float->int cast, as on x86
        cases["non-finite"] = _non_finite(get_format(name).block_size)
    for what, x in cases.items():
        ref = gguf_quantize(x, name)
        out = get_format(name).quantize_blocks(x.to(device))
        assert out.dtype == torch.uint8 and out.device.type == device
        out = out.cpu()
        assert out.shape == ref.shape, what
        bad = (out != ref).any(dim=1)
        assert not bad.any(), f"{name} {what} on {device}: {int(bad.sum())} of {len(bad)} blocks differ"


@pytest.mark.parametrize("name", QUANTIZERS)
def test_quantize_rows_roundtrip(name):
    fmt = get_format(name)
    x = torch.randn(6, 4 * fmt.block_size, generator=seeded("roundtrip", name))
    packed = quantize(x, name)
    assert packed.shape == (6, fmt.row_bytes(x.shape[1]))
    assert torch.equal(packed, gguf_quantize(x, name))
    y = dequantize(packed, name, x.shape)
    assert_bits_equal(y, gguf_dequantize(packed, name), f"{name} roundtrip")
    # each value lands on the nearest representable level of its block: error at most half a step
    blocks, yb = x.reshape(-1, fmt.block_size), y.reshape(-1, fmt.block_size)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    # TQ: levels -d, 0, d with d = max: error <= d / 2. MXFP4: scale s with max in [8s, 16s),
    # levels up to 12s: error <= 4s <= max / 4 (above 12s everything rounds down to 12s).
    half_step = amax * (0.5 if name != "MXFP4" else 0.25)
    assert ((yb - blocks).abs() <= half_step * (1 + 1e-3)).all()
    with pytest.raises(ValueError, match=name):
        fmt.quantize_blocks(torch.zeros(2, fmt.block_size + 1))
