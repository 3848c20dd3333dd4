"""i-quant, ternary and FP4 formats against their oracle, ``gguf.quants`` (numpy).

Dequantization is compared bit for bit (NaN matches NaN, -0.0 differs from +0.0) on random
valid blocks (random bytes with finite scale fields: this file knows where each format keeps
its scales), all-zero blocks, extreme scales and rows of many blocks, on the CPU and on CUDA
when present. TQ1_0, TQ2_0 and MXFP4 quantization is compared byte for byte, ties, zeros, tiny,
huge and non-finite inputs included. The parity rule for the IQ2/IQ3 sign bits is checked
against gguf's ``ksigns`` table.
"""
from __future__ import annotations

import platform
import zlib

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants

import hanzo_torch
from hanzo_torch.formats import dequantize, get_format, quantize
from hanzo_torch.formats.iquants import parity_signs
from format_utils import assert_bits_equal, gguf_dequantize, gguf_quantize

# Where each format keeps its scale fields (offsets of ggml-common.h's block structs):
#   ("f16", offset): an fp16 scale d at that byte offset;
#   ("f16_iq1m",):   IQ1_M's fp16 d, split into the top nibbles of the 4 uint16 words at 48..55;
#   ("e8m0", 0):     MXFP4's E8M0 exponent byte (every byte value decodes to a finite scale);
#   ("ue4m3", 0):    NVFP4's 4 UE4M3 sub-block scales at bytes 0..3 (all byte values finite).
SCALES = {
    "IQ1_S": ("f16", 0),
    "IQ1_M": ("f16_iq1m",),
    "IQ2_XXS": ("f16", 0),
    "IQ2_XS": ("f16", 0),
    "IQ2_S": ("f16", 0),
    "IQ3_XXS": ("f16", 0),
    "IQ3_S": ("f16", 0),
    "IQ4_NL": ("f16", 0),
    "IQ4_XS": ("f16", 0),
    "TQ1_0": ("f16", 52),  # after qs[48], qh[4]
    "TQ2_0": ("f16", 64),  # after qs[64]
    "MXFP4": ("e8m0", 0),
    "NVFP4": ("ue4m3", 0),
}
OURS = [n for n in SCALES if n in hanzo_torch.FORMATS]
F16_SCALED = [n for n in OURS if SCALES[n][0] in ("f16", "f16_iq1m")]
QUANTIZERS = ["TQ1_0", "TQ2_0", "MXFP4"]

# fp16 bit patterns: max, -max, smallest subnormal (both signs), smallest normal, 1.0, -0.0, +inf, NaN
EXTREME_F16 = (0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x0400, 0x3C00, 0x8000, 0x7C00, 0x7E00)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _finite_f16_bits(n: int, g: torch.Generator) -> torch.Tensor:
    """int64 [n] random fp16 bit patterns with a finite value (exponent field not all ones)."""
    bits = torch.randint(0, 1 << 16, (n,), generator=g, dtype=torch.int64)
    return torch.where((bits & 0x7C00) == 0x7C00, bits ^ 0x4000, bits)


def _set_f16_scale(blocks: torch.Tensor, name: str, bits: torch.Tensor) -> torch.Tensor:
    """A copy of ``blocks`` whose fp16 scale d is ``bits`` (int64 [n] or a Python int)."""
    out = blocks.clone()
    bits = torch.as_tensor(bits, dtype=torch.int64).expand(out.shape[0])
    if SCALES[name][0] == "f16":
        off = SCALES[name][1]
        out[:, off] = (bits & 0xFF).to(torch.uint8)
        out[:, off + 1] = (bits >> 8).to(torch.uint8)
    else:  # IQ1_M: nibble i of d goes to bits 12..15 of the i-th uint16 word at byte 48 + 2i
        for i in range(4):
            hi = 48 + 2 * i + 1
            nib = ((bits >> (4 * i)) & 0xF).to(torch.uint8)
            out[:, hi] = (out[:, hi] & 0x0F) | (nib << 4)
    return out


def _valid_blocks(name: str, n: int, g: torch.Generator) -> torch.Tensor:
    """uint8 [n, type_size]: random bytes, scale fields finite (any byte is a finite E8M0/UE4M3)."""
    blocks = torch.randint(0, 256, (n, get_format(name).type_size), generator=g, dtype=torch.uint8)
    if SCALES[name][0] in ("f16", "f16_iq1m"):
        blocks = _set_f16_scale(blocks, name, _finite_f16_bits(n, g))
    return blocks


def _check_dequantize(blocks: torch.Tensor, name: str, device: str, what: str) -> torch.Tensor:
    ref = gguf_dequantize(blocks, name)
    out = get_format(name).dequantize_blocks(blocks.to(device))
    assert out.device.type == device
    assert_bits_equal(out, ref, f"{name} {what} on {device}")
    return out.cpu()


# ---------------------------------------------------------------------------------------------
# dequantize
# ---------------------------------------------------------------------------------------------

def test_all_formats_registered_with_gguf_sizes():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    expected = [n for n in SCALES if n != "NVFP4"] + (["NVFP4"] if hasattr(gguf_quants, "NVFP4") else [])
    assert OURS == expected
    for name in OURS:
        fmt = get_format(name)
        qtype = GGMLQuantizationType[name]
        assert (fmt.type_id, fmt.block_size, fmt.type_size) == (int(qtype), *GGML_QUANT_SIZES[qtype])
        assert get_format(int(qtype)) is fmt
        assert (fmt.quantize_blocks is not None) == (name in QUANTIZERS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OURS)
def test_dequantize_random_valid_blocks(name, device):
    blocks = _valid_blocks(name, 96, _gen("valid", name))
    out = _check_dequantize(blocks, name, device, "random valid blocks")
    if name in F16_SCALED:  # a finite fp16 scale times a bounded code is finite
        assert torch.isfinite(out).all()
    assert out.abs().amax() > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OURS)
def test_dequantize_zero_blocks(name, device):
    blocks = torch.zeros(3, get_format(name).type_size, dtype=torch.uint8)
    out = _check_dequantize(blocks, name, device, "zero blocks")
    assert not out.any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", F16_SCALED)
def test_dequantize_extreme_f16_scales(name, device):
    base = _valid_blocks(name, 16, _gen("extreme", name))
    blocks = torch.cat([_set_f16_scale(base, name, bits) for bits in EXTREME_F16])
    out = _check_dequantize(blocks, name, device, "extreme fp16 scales")
    assert torch.isinf(out).any() and torch.isnan(out).any()  # the inf and NaN scales came through


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [n for n in OURS if SCALES[n][0] in ("e8m0", "ue4m3")])
def test_dequantize_every_scale_byte(name, device):
    # every byte value in every scale position (E8M0 255 and UE4M3 0x7F/0xFF included)
    fmt = get_format(name)
    n_scales = 1 if SCALES[name][0] == "e8m0" else 4
    blocks = _valid_blocks(name, 256 * n_scales, _gen("scale bytes", name))
    for pos in range(n_scales):
        blocks[pos * 256:(pos + 1) * 256, pos] = torch.arange(256, dtype=torch.uint8)
    assert blocks.shape[1] == fmt.type_size
    _check_dequantize(blocks, name, device, "every scale byte")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OURS)
def test_dequantize_rows_of_many_blocks(name, device):
    fmt = get_format(name)
    rows, per_row = 5, 7
    data = _valid_blocks(name, rows * per_row, _gen("rows", name)).reshape(rows, per_row * fmt.type_size)
    shape = (rows, per_row * fmt.block_size)
    out = dequantize(data.to(device), name, shape)
    assert_bits_equal(out, gguf_dequantize(data, name), f"{name} rows on {device}")
    # a strided view (blocks at an odd offset inside wider rows) gives the same values
    wide = torch.zeros(rows * per_row, fmt.type_size + 3, dtype=torch.uint8)
    wide[:, 1:1 + fmt.type_size] = data.reshape(-1, fmt.type_size)
    strided = fmt.dequantize_blocks(wide[:, 1:1 + fmt.type_size].to(device))
    assert_bits_equal(strided.reshape(shape), out, f"{name} strided on {device}")


@pytest.mark.parametrize("name", OURS)
def test_dequantize_blocks_shapes_and_errors(name):
    fmt = get_format(name)
    empty = fmt.dequantize_blocks(torch.zeros(0, fmt.type_size, dtype=torch.uint8))
    assert empty.shape == (0, fmt.block_size) and empty.dtype == torch.float32
    # meta tensors: shape-only, so the code has no data-dependent host step
    meta = fmt.dequantize_blocks(torch.zeros(4, fmt.type_size, dtype=torch.uint8, device="meta"))
    assert meta.shape == (4, fmt.block_size) and meta.dtype == torch.float32
    with pytest.raises(ValueError, match=name):
        fmt.dequantize_blocks(torch.zeros(2, fmt.type_size + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=name):
        fmt.dequantize_blocks(torch.zeros(2, fmt.type_size, dtype=torch.int8))


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
    g = _gen("quantize", name)
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
    x = torch.randn(6, 4 * fmt.block_size, generator=_gen("roundtrip", name))
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
