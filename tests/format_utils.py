"""Test helpers for the format registry: the gguf oracle, a NaN-aware bit comparison, and the
per-format knowledge of where the float fields (scales) of a block lie.

To cover a new format with the "valid blocks" and "extreme scales" tests, add its float fields
to :data:`FLOAT_FIELDS` (byte offset within the block and kind); nothing else is needed.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

# name -> ((byte offset, kind), ...): the float fields of one block, kind "f16", "bf16" or "f32".
# Offsets are those of ggml-common.h's block structs.
FLOAT_FIELDS: dict[str, tuple[tuple[int, str], ...]] = {
    "F32": ((0, "f32"),),
    "F16": ((0, "f16"),),
    "BF16": ((0, "bf16"),),
    "Q4_0": ((0, "f16"),),                   # d
    "Q4_1": ((0, "f16"), (2, "f16")),        # d, m
    "Q5_0": ((0, "f16"),),                   # d
    "Q5_1": ((0, "f16"), (2, "f16")),        # d, m
    "Q8_0": ((0, "f16"),),                   # d
    "Q2_K": ((80, "f16"), (82, "f16")),      # d, dmin after scales[16], qs[64]
    "Q3_K": ((108, "f16"),),                 # d after hmask[32], qs[64], scales[12]
    "Q4_K": ((0, "f16"), (2, "f16")),        # d, dmin
    "Q5_K": ((0, "f16"), (2, "f16")),        # d, dmin
    "Q6_K": ((208, "f16"),),                 # d after ql[128], qh[64], scales[16]
}

# kind -> (bytes, exponent mask, a bit of the exponent to clear when the exponent is all ones)
_KINDS = {
    "f16": (2, 0x7C00, 0x4000),
    "bf16": (2, 0x7F80, 0x4000),
    "f32": (4, 0x7F800000, 0x40000000),
}

# Bit patterns of extreme finite values per kind: max, -max, smallest subnormal (both signs),
# smallest normal, zero.
EXTREME_BITS = {
    "f16": (0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x0400, 0x0000),
    "bf16": (0x7F7F, 0xFF7F, 0x0001, 0x8001, 0x0080, 0x0000),
    "f32": (0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000001, 0x00800000, 0x00000000),
}


def _put_bits(blocks: torch.Tensor, offset: int, nbytes: int, bits: torch.Tensor) -> None:
    """Write little-endian ``bits`` (int64 [n]) into bytes ``offset:offset+nbytes`` of each block."""
    for i in range(nbytes):
        blocks[:, offset + i] = ((bits >> (8 * i)) & 0xFF).to(torch.uint8)


def random_blocks(name: str, n: int, generator: torch.Generator) -> torch.Tensor:
    """``uint8 [n, type_size]`` random blocks of format ``name`` whose float fields are finite.

    Every other byte is uniformly random, so all quant codes and sub-block scales occur.

    Raises:
        KeyError: ``name`` has no entry in :data:`FLOAT_FIELDS`.
    """
    import hanzo_torch

    fields = FLOAT_FIELDS[name]
    fmt = hanzo_torch.get_format(name)
    blocks = torch.randint(0, 256, (n, fmt.type_size), generator=generator, dtype=torch.uint8)
    for offset, kind in fields:
        nbytes, exp_mask, clear = _KINDS[kind]
        bits = torch.randint(0, 1 << (8 * nbytes), (n,), generator=generator, dtype=torch.int64)
        bits = torch.where((bits & exp_mask) == exp_mask, bits ^ clear, bits)
        _put_bits(blocks, offset, nbytes, bits)
    return blocks


def with_float_fields(blocks: torch.Tensor, name: str, bits: int) -> torch.Tensor:
    """A copy of ``blocks`` with every float field of ``name`` set to the bit pattern ``bits``."""
    out = blocks.clone()
    for offset, kind in FLOAT_FIELDS[name]:
        _put_bits(out, offset, _KINDS[kind][0], torch.full((out.shape[0],), bits, dtype=torch.int64))
    return out


def field_kinds(name: str) -> set[str]:
    return {kind for _, kind in FLOAT_FIELDS[name]}


def gguf_dequantize(data: torch.Tensor, name: str) -> torch.Tensor:
    """The oracle: ``gguf.quants.dequantize`` of packed rows ``uint8 [..., row_bytes]`` -> float32."""
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
