"""Test helpers for the format registry: the gguf oracle, a NaN-aware bit comparison, seeded
generators, and the per-format knowledge of where the scale fields of a block lie.

The scale fields of every format (:data:`FLOAT_FIELDS`, for the "valid blocks" and "extreme
scales" tests of tests/test_formats.py and tests/test_formats_iq.py) are read from the registry's
block fields, so a new format needs nothing here. Formats that ``gguf.quants`` cannot dequantize
(Q1_0 in gguf 0.19) are checked against a numpy restatement of ggml's C reference
(:data:`GGML_RULES`).
"""
from __future__ import annotations

import warnings
import zlib

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from hanzo_torch.backends.triton._testing import GGML_RULES  # numpy only; importable without triton

def _float_fields() -> dict[str, tuple[tuple[int, str], ...]]:
    """name -> ((byte offset, kind), ...): the scale fields of one block, from the registry's
    block fields (``Field.scale``). Kinds:
      "f32", "f16", "bf16": an IEEE float stored little-endian at the offset;
      "f16_iq1m":           IQ1_M's fp16 d, split into the top nibbles of the 4 little-endian
                            uint16 words from the offset (nibble i of d in word i);
      "e8m0", "ue4m3":      a one-byte scale (MXFP4's E8M0 exponent, NVFP4's unsigned E4M3) that
                            decodes to a finite value for every byte, so random bytes are valid.
    """
    import hanzo_torch

    out = {}
    for name, fmt in hanzo_torch.FORMATS.items():
        entries = []
        for f in fmt.fields:
            if f.scale == "f16_iq1m":  # one d spread over the whole field
                entries.append((f.offset, f.scale))
            elif f.scale is not None:
                width = f.nbytes // max(f.count, 1)
                entries += [(f.offset + i * width, f.scale) for i in range(max(f.count, 1))]
        out[name] = tuple(entries)
    return out


FLOAT_FIELDS: dict[str, tuple[tuple[int, str], ...]] = _float_fields()

# float kind -> (bytes, exponent mask, a bit of the exponent to clear when the exponent is all ones)
_KINDS = {
    "f16": (2, 0x7C00, 0x4000),
    "f16_iq1m": (2, 0x7C00, 0x4000),
    "bf16": (2, 0x7F80, 0x4000),
    "f32": (4, 0x7F800000, 0x40000000),
}
BYTE_SCALE_KINDS = frozenset({"e8m0", "ue4m3"})  # every byte value is a finite scale

# Bit patterns of extreme finite values per float kind: max, -max, smallest subnormal (both
# signs), smallest normal, zero.
EXTREME_BITS = {
    "f16": (0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x0400, 0x0000),
    "bf16": (0x7F7F, 0xFF7F, 0x0001, 0x8001, 0x0080, 0x0000),
    "f32": (0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000001, 0x00800000, 0x00000000),
}
EXTREME_BITS["f16_iq1m"] = EXTREME_BITS["f16"]


def seeded(*key) -> torch.Generator:
    """A CPU generator seeded from ``key`` (stable across runs and Python versions)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _put_bits(blocks: torch.Tensor, offset: int, kind: str, bits: torch.Tensor) -> None:
    """Write the float bit patterns ``bits`` (int64 [n]) into the field of ``kind`` at ``offset``."""
    if kind == "f16_iq1m":  # nibble i of the fp16 goes to bits 12..15 of the uint16 word i
        for i in range(4):
            hi = offset + 2 * i + 1
            nib = ((bits >> (4 * i)) & 0xF).to(torch.uint8)
            blocks[:, hi] = (blocks[:, hi] & 0x0F) | (nib << 4)
        return
    for i in range(_KINDS[kind][0]):  # little-endian bytes
        blocks[:, offset + i] = ((bits >> (8 * i)) & 0xFF).to(torch.uint8)


def random_blocks(name: str, n: int, generator: torch.Generator) -> torch.Tensor:
    """``uint8 [n, type_size]`` random blocks of format ``name`` whose scale fields are finite.

    Every other byte is uniformly random, so all quant codes and sub-block scales occur.

    Raises:
        KeyError: ``name`` has no entry in :data:`FLOAT_FIELDS`.
    """
    import hanzo_torch

    fields = FLOAT_FIELDS[name]
    fmt = hanzo_torch.get_format(name)
    blocks = torch.randint(0, 256, (n, fmt.type_size), generator=generator, dtype=torch.uint8)
    for offset, kind in fields:
        if kind in BYTE_SCALE_KINDS:
            continue
        nbytes, exp_mask, clear = _KINDS[kind]
        bits = torch.randint(0, 1 << (8 * nbytes), (n,), generator=generator, dtype=torch.int64)
        bits = torch.where((bits & exp_mask) == exp_mask, bits ^ clear, bits)
        _put_bits(blocks, offset, kind, bits)
    return blocks


def with_float_fields(blocks: torch.Tensor, name: str, bits: int) -> torch.Tensor:
    """A copy of ``blocks`` with every float scale field of ``name`` set to the bit pattern ``bits``.

    Raises:
        ValueError: ``name`` has one-byte scales (set those bytes directly).
    """
    out = blocks.clone()
    for offset, kind in FLOAT_FIELDS[name]:
        if kind not in _KINDS:
            raise ValueError(f"{name}: {kind} scale fields are bytes, not float bit patterns")
        _put_bits(out, offset, kind, torch.full((out.shape[0],), bits, dtype=torch.int64))
    return out


def field_kinds(name: str) -> set[str]:
    """The kinds of the scale fields of ``name`` (e.g. ``{"f16"}``)."""
    return {kind for _, kind in FLOAT_FIELDS[name]}


def has_float_scales(name: str) -> bool:
    """True if every scale field of ``name`` is an IEEE float (finite scales -> finite values)."""
    return name in FLOAT_FIELDS and field_kinds(name) <= set(_KINDS)


def check_dequantize(blocks: torch.Tensor, name: str, device: str = "cpu", what: str = "") -> torch.Tensor:
    """``dequantize_blocks`` of ``uint8 [n, type_size]`` on ``device``, asserted bit-equal to gguf.

    Returns the result (``float32 [n, block_size]``) on the CPU.
    """
    import hanzo_torch

    fmt = hanzo_torch.get_format(name)
    out = fmt.dequantize_blocks(blocks.to(device))
    assert out.device.type == torch.device(device).type, f"{name} {what}: result on {out.device}"
    ref = gguf_dequantize(blocks, name).reshape(blocks.shape[0], fmt.block_size)
    assert_bits_equal(out, ref, f"{name} {what} on {device}")
    return out.cpu()


def gguf_dequantize(data: torch.Tensor, name: str) -> torch.Tensor:
    """The oracle: ``gguf.quants.dequantize`` of packed rows ``uint8 [..., row_bytes]`` -> float32
    (:data:`GGML_RULES` for the formats gguf cannot dequantize)."""
    if name in GGML_RULES and not hasattr(gguf_quants, name):
        with np.errstate(all="ignore"):
            return torch.from_numpy(GGML_RULES[name](np.ascontiguousarray(data.cpu().numpy())).astype(np.float32))
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        out = gguf_quants.dequantize(np.ascontiguousarray(data.cpu().numpy()), GGMLQuantizationType[name])
    return torch.from_numpy(np.array(out, dtype=np.float32))


def gguf_quantize(x: torch.Tensor, name: str) -> torch.Tensor:
    """The oracle: ``gguf.quants.quantize`` of float32 ``[..., K]`` -> its bytes ``uint8 [..., row_bytes]``."""
    arr = np.ascontiguousarray(x.cpu().numpy().astype(np.float32))
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        out = gguf_quants.quantize(arr, GGMLQuantizationType[name])
    out = np.ascontiguousarray(out)
    return torch.from_numpy(out.view(np.uint8).reshape(*arr.shape[:-1], -1).copy())


def assert_bits_equal(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """float32 tensors equal bit for bit, except that any NaN matches any NaN (payloads differ).

    Also distinguishes -0.0 from +0.0, which ``torch.equal`` would not.
    """
    assert out.dtype == torch.float32, f"{what}: dtype {out.dtype}"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out, ref = out.detach().cpu(), ref.detach().cpu()
    nan_out, nan_ref = torch.isnan(out), torch.isnan(ref)
    assert torch.equal(nan_out, nan_ref), f"{what}: NaN masks differ at {int((nan_out != nan_ref).sum())} values"
    ok = out.view(torch.int32) == ref.view(torch.int32)
    bad = ~(ok | nan_ref)
    if bad.any():
        i = int(bad.reshape(-1).nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} values differ, first at flat index {i}: "
            f"{out.reshape(-1)[i].item()!r} != {ref.reshape(-1)[i].item()!r}"
        )
