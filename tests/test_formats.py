"""The format registry against its oracle, ``gguf.quants`` (numpy).

Dequantization is compared bit for bit (NaN matches NaN) for every registered format, with
random bytes (NaN/inf scales included), random valid blocks (finite scales: every format's scale
fields are listed in ``format_utils.FLOAT_FIELDS``), all-zero blocks, multi-block rows, strided
and offset inputs, empty and meta inputs and bad arguments; formats with float scales also on
extreme finite scales. Quantizers are compared byte for byte. q8_1 is checked against a
per-block reference written from ggml's definition (``quantize_row_q8_1_ref``). The i-quant,
ternary and FP4 specifics are in tests/test_formats_iq.py.
"""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

import hanzo_torch
from hanzo_torch.formats.q8_1 import dequantize_q8_1, quantize_q8_1
from format_utils import (
    EXTREME_BITS, FLOAT_FIELDS, assert_bits_equal, check_dequantize, field_kinds,
    gguf_dequantize, gguf_quantize, has_float_scales, random_blocks, seeded, with_float_fields,
)

ALL = list(hanzo_torch.FORMATS)
QUANTIZED = [n for n in ALL if not hanzo_torch.FORMATS[n].dense]
FLOAT_SCALED = [n for n in ALL if has_float_scales(n)]
# gguf.quants has no K-quant or IQ4 quantizer: those are checked against ggml (tests/test_kquant_*.py,
# tests/test_iq4_quantize.py)
# gated against ggml's own quantizer instead (tests/test_kquant_*.py, test_iq4_quantize.py, test_iquant_quantize.py)
KQUANT_QUANTIZERS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
                     "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
QUANTIZABLE = [n for n in ALL if hanzo_torch.FORMATS[n].quantize_blocks is not None and n not in KQUANT_QUANTIZERS]
NOT_QUANTIZABLE = [n for n in ALL if hanzo_torch.FORMATS[n].quantize_blocks is None]
OWN = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _random_bytes(shape, g) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)


def _row_len(fmt, blocks_per_row: int) -> int:
    # dense formats: an odd row length; others: whole blocks
    return 37 if fmt.dense else blocks_per_row * fmt.block_size


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------

def test_registry_has_own_formats_with_gguf_sizes():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for name in OWN:
        fmt = hanzo_torch.get_format(name)
        qt = GGMLQuantizationType[name]
        assert fmt.type_id == int(qt)
        assert (fmt.block_size, fmt.type_size) == GGML_QUANT_SIZES[qt]
        assert fmt.dense == (name in ("F32", "F16", "BF16"))
        assert hanzo_torch.get_format(int(qt)) is fmt
        assert hanzo_torch.get_format(name.lower()) is fmt
    for name in ALL:
        fmt = hanzo_torch.FORMATS[name]
        assert (fmt.block_size, fmt.type_size) == GGML_QUANT_SIZES[GGMLQuantizationType[name]], name


def test_every_format_declares_its_scale_fields():
    # random_blocks and the valid-block tests need to know where each format keeps its scales
    assert set(ALL) <= set(FLOAT_FIELDS), sorted(set(ALL) - set(FLOAT_FIELDS))
    for name in ALL:
        type_size = hanzo_torch.get_format(name).type_size
        assert FLOAT_FIELDS[name], f"{name}: no scale field"
        for offset, kind in FLOAT_FIELDS[name]:
            width = 8 if kind == "f16_iq1m" else 4 if kind == "f32" else 2 if kind in ("f16", "bf16") else 1
            assert 0 <= offset and offset + width <= type_size, (name, offset, kind)
    # offsets of ggml-common.h's block structs, written out here independently of the registry
    ggml = {"Q2_K": ((80, "f16"), (82, "f16")), "Q3_K": ((108, "f16"),), "Q6_K": ((208, "f16"),),
            "Q4_1": ((0, "f16"), (2, "f16")), "TQ1_0": ((52, "f16"),), "TQ2_0": ((64, "f16"),),
            "IQ1_M": ((48, "f16_iq1m"),), "MXFP4": ((0, "e8m0"),)}
    for name, fields in ggml.items():
        assert FLOAT_FIELDS[name] == fields, name


def test_trait_fields_tile_the_block():
    # fields in declaration order, back to back, adding up to gguf's type size (ggml's
    # static_assert); every quantized format says what it is dotted with and its group length
    from hanzo_torch.formats import VEC_DOT_TYPES

    for name in ALL:
        fmt = hanzo_torch.FORMATS[name]
        pos = 0
        for f in fmt.fields:
            assert f.offset == pos, (name, f.name)
            assert fmt.offset(f.name) == pos
            pos += f.nbytes
        assert pos == fmt.type_size, name
        if fmt.dense:
            assert fmt.vec_dot_type is None and fmt.group_len == 0
        else:
            assert fmt.vec_dot_type in VEC_DOT_TYPES, name
            assert fmt.block_size % fmt.group_len == 0, name
            # q8_K activation blocks are QK_K = 256 values: only 256-value formats use them
            assert (fmt.vec_dot_type == "q8_K") == (fmt.block_size == 256), name
    with pytest.raises(KeyError, match="Q4_K has no block field 'nope'"):
        hanzo_torch.get_format("Q4_K").field("nope")


def test_trait_tables_are_gguf_tables():
    from gguf import quants as gq

    for name in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S"):
        cls = getattr(gq, name)
        cls.init_grid()
        grid = hanzo_torch.get_format(name).tables["grid"].cpu
        assert torch.equal(grid, torch.from_numpy(np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)))
    assert hanzo_torch.get_format("IQ1_M").tables["grid"] is hanzo_torch.get_format("IQ1_S").tables["grid"]
    kv = hanzo_torch.get_format("IQ4_NL").tables["kvalues"].cpu
    assert kv.tolist() == [float(v) for v in gq.IQ4_NL.kvalues]


def test_q1_0_oracle_on_a_hand_made_block():
    # ggml's rule written out by hand: bit j of qs[j // 8] (lsb first) selects +d, else -d
    if "Q1_0" not in hanzo_torch.FORMATS:
        pytest.skip("the installed gguf has no Q1_0 type")
    block = torch.zeros(1, 18, dtype=torch.uint8)
    block[0, 0:2] = torch.tensor([0x00, 0x40], dtype=torch.uint8)  # fp16 2.0
    block[0, 2] = 0b00000101  # values 0 and 2 positive
    block[0, 17] = 0x80  # value 127 positive
    want = torch.full((1, 128), -2.0)
    want[0, [0, 2, 127]] = 2.0
    assert_bits_equal(hanzo_torch.dequantize(block, "Q1_0", (1, 128)), want, "Q1_0")
    assert_bits_equal(gguf_dequantize(block, "Q1_0"), want, "Q1_0 oracle")


# ---------------------------------------------------------------------------------------------
# dequantize, every registered format
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_dequantize_random_bytes(name):
    fmt = hanzo_torch.get_format(name)
    n = 256 if fmt.dense else 48
    blocks = _random_bytes((n, fmt.type_size), seeded("random", name))
    check_dequantize(blocks, name, what="random bytes")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ALL)
def test_dequantize_random_valid_blocks(name, device):
    fmt = hanzo_torch.get_format(name)
    blocks = random_blocks(name, 128 if fmt.dense else 96, seeded("valid", name))
    out = check_dequantize(blocks, name, device, "random valid blocks")
    if has_float_scales(name):  # a finite scale times a bounded code is finite
        assert torch.isfinite(out).all(), f"{name}: finite scales gave non-finite values"
    assert out.abs().amax() > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ALL)
def test_dequantize_zero_blocks(name, device):
    fmt = hanzo_torch.get_format(name)
    blocks = torch.zeros(3, fmt.type_size, dtype=torch.uint8)
    out = check_dequantize(blocks, name, device, "zero blocks")
    assert not out.any()


@pytest.mark.parametrize("name", ALL)
def test_dequantize_rows_of_many_blocks(name):
    fmt = hanzo_torch.get_format(name)
    k = _row_len(fmt, 5)
    rb = fmt.row_bytes(k)
    data = _random_bytes((2, 3, rb), seeded("rows", name))
    ref = gguf_dequantize(data, name)
    assert ref.shape == (2, 3, k)
    assert_bits_equal(hanzo_torch.dequantize(data, name, (2, 3, k)), ref, name)
    assert_bits_equal(hanzo_torch.dequantize(data.reshape(6, rb), name, (6, k)), ref.reshape(6, k), name)
    # the result dtype is a cast of the float32 values
    out16 = hanzo_torch.dequantize(data, name, (2, 3, k), torch.bfloat16)
    assert out16.dtype == torch.bfloat16
    assert torch.equal(torch.isnan(out16), torch.isnan(ref))
    ok = torch.isnan(ref)
    assert torch.equal(out16[~ok], ref.to(torch.bfloat16)[~ok])
    # no rows at all
    assert hanzo_torch.dequantize(data[:0].reshape(0, rb), name, (0, k)).shape == (0, k)


@pytest.mark.parametrize("name", ALL)
def test_dequantize_strided_and_offset_inputs(name):
    fmt = hanzo_torch.get_format(name)
    k = _row_len(fmt, 3)
    rb = fmt.row_bytes(k)
    g = seeded("strided", name)
    wide = _random_bytes((4, rb + 7), g)
    rows = wide[:, 3:3 + rb]  # non-contiguous rows, odd byte offset
    assert not rows.is_contiguous()
    ref = gguf_dequantize(rows.contiguous(), name)
    assert_bits_equal(hanzo_torch.dequantize(rows, name, (4, k)), ref, name)

    # dequantize_blocks itself on a storage offset of 1 byte and on every other block
    n = 9
    flat = _random_bytes((n * fmt.type_size + 1,), g)
    shifted = flat[1:].view(n, fmt.type_size)
    ref = gguf_dequantize(shifted.contiguous(), name).reshape(n, fmt.block_size)
    assert_bits_equal(fmt.dequantize_blocks(shifted), ref, name)
    assert_bits_equal(fmt.dequantize_blocks(shifted[::2]), ref[::2].contiguous(), name)


@pytest.mark.parametrize("name", ALL)
def test_dequantize_rejects_wrong_byte_count_and_dtype(name):
    fmt = hanzo_torch.get_format(name)
    k = _row_len(fmt, 2)
    rb = fmt.row_bytes(k)
    data = torch.zeros(3, rb, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bytes"):
        hanzo_torch.dequantize(data.reshape(-1)[:-1], name, (3, k))
    with pytest.raises(ValueError, match="bytes"):
        hanzo_torch.dequantize(data, name, (4, k))
    with pytest.raises(ValueError, match="uint8"):
        hanzo_torch.dequantize(data.to(torch.int8), name, (3, k))


@pytest.mark.parametrize("name", QUANTIZED)
def test_dequantize_rejects_bad_row_length(name):
    fmt = hanzo_torch.get_format(name)
    data = torch.zeros(2 * fmt.type_size, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of the block size"):
        hanzo_torch.dequantize(data, name, (2, fmt.block_size + 1))
    with pytest.raises(ValueError, match="multiple of the block size"):
        fmt.row_bytes(fmt.block_size // 2)


@pytest.mark.parametrize("name", ALL)
def test_dequantize_blocks_shapes_and_errors(name):
    fmt = hanzo_torch.get_format(name)
    empty = fmt.dequantize_blocks(torch.zeros(0, fmt.type_size, dtype=torch.uint8))
    assert empty.shape == (0, fmt.block_size) and empty.dtype == torch.float32
    # meta tensors: shape-only, so the code has no data-dependent host step
    meta = fmt.dequantize_blocks(torch.zeros(4, fmt.type_size, dtype=torch.uint8, device="meta"))
    assert meta.shape == (4, fmt.block_size) and meta.dtype == torch.float32
    with pytest.raises(ValueError, match=rf"{name}: .*\[n, {fmt.type_size}\]"):
        fmt.dequantize_blocks(torch.zeros(2, fmt.type_size + 1, dtype=torch.uint8))
    for dtype in (torch.int8, torch.int16):
        with pytest.raises(ValueError, match=f"{name}: .*uint8"):
            fmt.dequantize_blocks(torch.zeros(2, fmt.type_size, dtype=dtype))


def test_unknown_format():
    with pytest.raises(ValueError, match="unknown"):
        hanzo_torch.get_format("Q7_Z")
    with pytest.raises(ValueError, match="unknown"):
        hanzo_torch.dequantize(torch.zeros(4, dtype=torch.uint8), "Q7_Z", (4,))


# ---------------------------------------------------------------------------------------------
# extreme finite scales (formats whose scales are floats)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FLOAT_SCALED)
def test_dequantize_extreme_scales(name):
    (kind,) = field_kinds(name)
    base = random_blocks(name, 16, seeded("extreme", name))
    for bits in EXTREME_BITS[kind]:
        out = check_dequantize(with_float_fields(base, name, bits), name, what=f"field={bits:#x}")
        assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------
# quantize
# ---------------------------------------------------------------------------------------------

# per format: (anchor values fixing d = 1, or d = 1 with min 0; range of the half-integer codes)
TIE_ANCHORS = {
    "Q4_0": ([-8.0], -7.5, 7.5), "Q5_0": ([-16.0], -15.5, 15.5), "Q8_0": ([127.0], -126.5, 126.5),
    "Q4_1": ([0.0, 15.0], 0.5, 14.5), "Q5_1": ([0.0, 31.0], 0.5, 30.5),
}


def _tie_blocks(name: str, g: torch.Generator):
    """Blocks whose scale is exactly 1 (times a power of two), so x / d lands on the rounding ties;
    None for a format without an entry in TIE_ANCHORS."""
    if name in ("F16", "BF16", "F32"):
        # midpoints between neighbouring representable values (exact in float32)
        lo = torch.randint(0, 0x7BFF if name != "BF16" else 0x7F7F, (512,), generator=g, dtype=torch.int64)
        if name == "BF16":
            a = (lo << 16).to(torch.int32).view(torch.float32)
            b = ((lo + 1) << 16).to(torch.int32).view(torch.float32)
        else:
            a = lo.to(torch.int16).view(torch.float16).float()
            b = (lo + 1).to(torch.int16).view(torch.float16).float()
        mid = a + (b - a) / 2
        return torch.cat([mid, -mid]).reshape(-1, 1)
    if name not in TIE_ANCHORS:
        return None
    anchor, lo, hi = TIE_ANCHORS[name]
    n = 24
    steps = torch.randint(0, int(hi - lo) + 1, (n, 32 - len(anchor)), generator=g).float()
    body = lo + steps
    blocks = torch.cat([torch.tensor(anchor).expand(n, -1), body], dim=1)
    perm = torch.argsort(torch.rand(n, 32, generator=g), dim=1)
    blocks = torch.gather(blocks, 1, perm)
    scale = 2.0 ** torch.randint(-20, 20, (n, 1), generator=g).float()
    return blocks * scale


def _quantize_cases(name: str) -> dict[str, torch.Tensor]:
    fmt = hanzo_torch.get_format(name)
    bs = fmt.block_size
    g = seeded("quantize", name)
    n = 64
    normal = torch.randn(n, bs, generator=g) * torch.exp(torch.empty(n, 1).uniform_(-12, 12, generator=g))
    cases = {
        "normal": normal,
        "zeros": torch.zeros(4, bs),
        "negative zeros": torch.full((2, bs), -0.0),
        "constant": torch.full((3, bs), 0.3),
        # fp16 scales overflow to inf from about 6.5e4 * step; kept below float32 overflow of max - min
        "large": torch.randn(8, bs, generator=g) * torch.tensor([1e4, 6e4, 7e4, 1e8, 1e20, 1e30, 1e36, 1e37])[:, None],
        "small": torch.randn(4, bs, generator=g) * torch.tensor([1e-5, 1e-7, 1e-8, 1e-30]).view(4, 1),
    }
    ties = _tie_blocks(name, g)
    if ties is not None:
        cases["ties"] = ties
    if fmt.dense:
        special = torch.tensor([float("inf"), -float("inf"), 3e38, -3.4e38, 65504.0, 65519.99, 65520.0,
                                1e-45, -1e-45, 2.0 ** -25, 2.0 ** -24 * 1.5, 0.0, -0.0])
        cases["special"] = special.reshape(-1, 1)
        # NaNs with assorted payloads and signs
        cases["nan"] = torch.tensor([0x7FC00000, 0x7F800001, 0xFFC12345 - (1 << 32), 0x7FFFFFFF, 0x7F802000],
                                    dtype=torch.int64).to(torch.int32).view(torch.float32).reshape(-1, 1)
    return cases


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_quantize_matches_gguf_bytes(name):
    fmt = hanzo_torch.get_format(name)
    for case, x in _quantize_cases(name).items():
        if fmt.dense:
            x = x.reshape(-1, 4) if x.numel() % 4 == 0 else x.reshape(1, -1)
        out = hanzo_torch.quantize(x, name)
        ref = gguf_quantize(x, name)
        assert out.dtype == torch.uint8 and out.shape == ref.shape, (name, case, out.shape, ref.shape)
        if name == "F16" and case == "nan":
            # numpy's NaN payload for float16 casts is platform-dependent (hardware F16C vs its
            # software npy_floatbits_to_halfbits); gguf's bytes must be NaNs, and ours follow the
            # software rule: sign, 0x7c00 | top 10 payload bits, 0x7c01 if those are zero
            assert torch.isnan(ref.view(torch.float16)).all()
            for v, h in zip(x.reshape(-1).view(torch.int32).tolist(), out.view(torch.int16).reshape(-1).tolist()):
                v &= 0xFFFFFFFF
                want = 0x7C00 | ((v & 0x7FFFFF) >> 13)
                want = (want if want != 0x7C00 else 0x7C01) | ((v >> 16) & 0x8000)
                assert h & 0xFFFF == want, (hex(v), hex(h & 0xFFFF), hex(want))
            continue
        assert torch.equal(out, ref), f"{name} {case}: {int((out != ref).sum())} bytes differ"


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_quantize_roundtrip_and_errors(name):
    fmt = hanzo_torch.get_format(name)
    x = torch.randn(3, 2 * fmt.block_size if not fmt.dense else 10, generator=seeded("rt", name))
    q = hanzo_torch.quantize(x, name)
    assert q.shape == (3, fmt.row_bytes(x.shape[-1]))
    y = hanzo_torch.dequantize(q, name, x.shape)
    assert_bits_equal(y, gguf_dequantize(gguf_quantize(x, name), name), name)
    if name in OWN:
        # dense: relative rounding error; legacy: at most one step, amax/8 for Q4_0 .. amax/127 for Q8_0
        assert (y - x).abs().max() <= 0.13 * x.abs().max()
    if not fmt.dense:
        with pytest.raises(ValueError, match="multiple of the block size"):
            hanzo_torch.quantize(torch.zeros(2, fmt.block_size + 1), name)
    # quantize_blocks itself checks its [n, block_size] argument (every quantizer, dense included)
    with pytest.raises(ValueError, match=rf"{name}: values must have shape \[n, {fmt.block_size}\]"):
        fmt.quantize_blocks(torch.zeros(2, fmt.block_size + 1))
    with pytest.raises(ValueError, match=f"{name}: values must be a tensor"):
        fmt.quantize_blocks([[0.0] * fmt.block_size])


@pytest.mark.parametrize("name", [n for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0") if n in QUANTIZABLE])
def test_quantize_float32_subnormal_scale(name):
    # A block whose scale d is a float32 subnormal makes gguf's 1/d overflow; its codes are then
    # platform-dependent in numpy, but d (and m) round to 0 in fp16, so the decoded values agree.
    x = torch.tensor([1e-39, -2e-39, 5e-40, 0.0] * 8).reshape(1, 32)
    ours = hanzo_torch.dequantize(hanzo_torch.quantize(x, name), name, x.shape)
    assert torch.equal(ours, gguf_dequantize(gguf_quantize(x, name), name))  # values: +-0 may differ


@pytest.mark.parametrize("name", NOT_QUANTIZABLE)
def test_quantize_unsupported_format_raises(name):
    fmt = hanzo_torch.get_format(name)
    with pytest.raises(NotImplementedError, match=name):
        hanzo_torch.quantize(torch.zeros(1, fmt.block_size), name)


# ---------------------------------------------------------------------------------------------
# q8_1
# ---------------------------------------------------------------------------------------------

def _roundf(v: np.float32) -> int:
    # C roundf: halves away from zero (exact in float64 for |v| < 2^24)
    return int(math.copysign(math.floor(abs(float(v)) + 0.5), float(v)))


def _q8_1_reference(x: np.ndarray) -> bytes:
    """ggml quantize_row_q8_1_ref, one block at a time, in numpy float32 scalars."""
    with np.errstate(all="ignore"):
        return _q8_1_blocks(x)


def _q8_1_blocks(x: np.ndarray) -> bytes:
    out = bytearray()
    for block in x.astype(np.float32).reshape(-1, 32):
        amax = np.float32(0.0)
        for v in block:
            amax = max(amax, np.float32(abs(v)))
        d = np.float32(amax / np.float32(127.0))
        inv = np.float32(np.float32(1.0) / d) if d != 0 else np.float32(0.0)
        qs = [_roundf(np.float32(v * inv)) for v in block]
        s = np.float32(np.float32(sum(qs)) * d)
        out += np.float16(d).tobytes() + np.float16(s).tobytes() + struct.pack("<32b", *qs)
    return bytes(out)


def _q8_1_cases() -> dict[str, torch.Tensor]:
    g = seeded("q8_1")
    ties = (torch.randint(-127, 127, (4, 64), generator=g).float() + 0.5)
    ties[:, 0] = 127.0  # amax 127 -> d = 1 exactly, every other value a tie
    ties[:, 32] = -127.0
    return {
        "normal": torch.randn(3, 2, 96, generator=g) * 3,
        "scaled": torch.randn(16, 32, generator=g) * torch.exp(torch.empty(16, 1).uniform_(-20, 20, generator=g)),
        "zeros": torch.zeros(2, 64),
        "one block": torch.randn(32, generator=g),
        "ties": ties,
        "large": torch.randn(2, 32, generator=g) * torch.tensor([[1e5], [1e30]]),
    }


def test_q8_1_quantize_matches_reference():
    for case, x in _q8_1_cases().items():
        q = quantize_q8_1(x)
        assert q.dtype == torch.uint8 and q.shape == (*x.shape[:-1], x.shape[-1] // 32 * 36), case
        assert bytes(q.reshape(-1).numpy()) == _q8_1_reference(x.numpy()), case


def test_q8_1_agrees_with_gguf_q8_0():
    # d and qs are Q8_0's (an independent oracle); s is d * sum(qs)
    x = torch.randn(5, 128, generator=seeded("q8_1 vs q8_0")) * 7
    q = quantize_q8_1(x).reshape(-1, 36)
    ref = gguf_quantize(x, "Q8_0").reshape(-1, 34)
    assert torch.equal(q[:, 0:2], ref[:, 0:2]) and torch.equal(q[:, 4:], ref[:, 2:])
    y = dequantize_q8_1(quantize_q8_1(x))
    assert_bits_equal(y, gguf_dequantize(ref.reshape(5, -1), "Q8_0"), "q8_1")


def test_q8_1_input_dtypes_and_dequantize():
    x = torch.randn(4, 64, generator=seeded("q8_1 dtypes"))
    for dt in (torch.bfloat16, torch.float16):
        xd = x.to(dt)
        assert torch.equal(quantize_q8_1(xd), quantize_q8_1(xd.float()))
    q = quantize_q8_1(x)
    y = dequantize_q8_1(q)
    blocks = q.reshape(-1, 36)
    d = torch.from_numpy(blocks[:, :2].numpy().copy().view(np.float16).astype(np.float32))
    qs = torch.from_numpy(blocks[:, 4:].numpy().copy().view(np.int8).astype(np.float32))
    assert_bits_equal(y, (d * qs).reshape(4, 64), "dequantize_q8_1")
    assert (y - x).abs().max() <= x.abs().max() / 127


def test_q8_1_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_1(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_1(torch.tensor(1.0))
    with pytest.raises(ValueError, match="floating"):
        quantize_q8_1(torch.zeros(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 36"):
        dequantize_q8_1(torch.zeros(2, 35, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_q8_1(torch.zeros(2, 36, dtype=torch.int8))


# ---------------------------------------------------------------------------------------------
# the same on an accelerator (bit-identical to the CPU results)
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
@pytest.mark.parametrize("name", ALL)
def test_device_matches_cpu(name):
    fmt = hanzo_torch.get_format(name)
    blocks = _random_bytes((64, fmt.type_size), seeded("device", name))
    cpu = fmt.dequantize_blocks(blocks)
    dev = fmt.dequantize_blocks(blocks.cuda())
    assert dev.device.type == "cuda"
    assert_bits_equal(dev, cpu, name)
    if fmt.quantize_blocks is not None:
        for case, x in _quantize_cases(name).items():
            if fmt.dense:
                x = x.reshape(-1, 1)
            assert torch.equal(fmt.quantize_blocks(x.cuda()).cpu(), fmt.quantize_blocks(x)), (name, case)
    x = torch.randn(3, 256, generator=seeded("device q8_1")) * 5
    assert torch.equal(quantize_q8_1(x.cuda()).cpu(), quantize_q8_1(x))
