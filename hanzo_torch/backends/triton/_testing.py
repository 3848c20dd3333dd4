"""Test-data helpers for the Triton kernels (used by tests/test_triton_*.py and
benchmarks/triton_gpu_check.py); numpy/torch only, importable without triton.

:func:`random_packed` makes packed weights of any supported format from random bytes whose
scale fields are overwritten with small finite values, so every quant code, sub-block scale,
grid index and sign occurs while the dequantized values stay in a numerically sane range.
The scale fields are read from the registry's block fields (ggml-common.h's structs).
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ...constants import Q8_1_BLOCK, Q8_1_BYTES


def _scale_fields(qtype: str) -> list:
    """``(byte offset, kind)`` of each scale the block of ``qtype`` holds, from the registry's
    block fields (``Field.scale``: ``"f16"``, ``"f16_iq1m"``, ``"e8m0"``, ``"ue4m3"``, ...)."""
    from ...formats import get_format

    out = []
    for f in get_format(qtype).fields:
        if f.scale is not None:
            out.append((f.offset, f.scale))
    return out


def random_packed(qtype: str, shape: tuple, seed: int = 0, scale: float = 0.02) -> torch.Tensor:
    """``uint8 [*shape[:-1], row_bytes(shape[-1])]`` of format ``qtype`` with sane scales.

    Dense formats (F32/F16/BF16) hold ``scale``-sized normal values. Raises KeyError for a
    format this helper does not know.
    """
    rng = np.random.default_rng(seed)
    qt = GGMLQuantizationType[qtype]
    qk, ts = GGML_QUANT_SIZES[qt]
    lead, K = tuple(shape[:-1]), int(shape[-1])
    n_rows = int(np.prod(lead)) if lead else 1
    if qtype in ("F32", "F16", "BF16"):
        v = torch.from_numpy(rng.standard_normal((n_rows, K)).astype(np.float32) * scale)
        v = v.to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[qtype])
        return v.contiguous().view(torch.uint8).reshape(*lead, K * ts)
    nb = n_rows * K // qk
    blocks = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)
    d = rng.uniform(0.5, 1.0, size=nb).astype(np.float32) * scale
    fields = _scale_fields(qtype)
    if not fields:
        raise KeyError(f"random_packed: no scale field in the {qtype} block")
    for off, kind in fields:
        if kind == "f16":
            blocks[:, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
        elif kind == "f16_iq1m":  # the fp16 d is the top nibbles of the 4 u16 scale words
            bits = d.astype(np.float16).view(np.uint16)
            for i in range(4):
                nib = ((bits >> (4 * i)) & 0xF).astype(np.uint8)
                blocks[:, off + 1 + 2 * i] = (blocks[:, off + 1 + 2 * i] & 0x0F) | (nib << 4)
        elif kind == "e8m0":
            blocks[:, off] = rng.integers(118, 124, size=nb, dtype=np.uint8)  # E8M0 exponents ~2^-9..2^-4
        elif kind == "ue4m3":  # one byte per sub-block scale
            n_sub = next(f.count for f in _fields(qtype) if f.offset == off)
            blocks[:, off:off + n_sub] = rng.integers(0x08, 0x30, size=(nb, n_sub), dtype=np.uint8)  # small UE4M3
        else:
            raise KeyError(f"random_packed: no rule for {kind} scales ({qtype})")
    rb = K // qk * ts
    return torch.from_numpy(blocks.reshape(*lead, rb).copy()) if lead else torch.from_numpy(blocks.reshape(rb).copy())


def _fields(qtype: str):
    from ...formats import get_format

    return get_format(qtype).fields


def _q1_0_ggml(data: np.ndarray) -> np.ndarray:
    # ggml-quants.c dequantize_row_q1_0: y[j] = bit ? d : -d, bit = (qs[j/8] >> (j%8)) & 1,
    # block_q1_0 = { ggml_half d; uint8_t qs[16]; } (128 values)
    blocks = data.reshape(-1, 18)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    bits = (blocks[:, 2:, None] >> np.arange(8, dtype=np.uint8)) & 1  # [n, 16, 8]: byte, bit
    y = np.where(bits.reshape(-1, 128) == 1, d, -d)
    return y.reshape(*data.shape[:-1], data.shape[-1] // 18 * 128)


GGML_RULES = {"Q1_0": _q1_0_ggml}
"""Oracles for the formats ``gguf.quants`` has no dequantizer for: numpy restatements of ggml's C
``dequantize_row_<type>``, ``uint8 [..., row_bytes] -> float32 [..., row_length]``."""


def gguf_dequantize(packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 dequantization by ``gguf.quants.dequantize`` (the oracle), same leading shape;
    :data:`GGML_RULES` for the formats gguf cannot dequantize."""
    from gguf import quants

    arr = packed.detach().cpu().numpy()
    if qtype in GGML_RULES and not hasattr(quants, qtype):
        with np.errstate(all="ignore"):
            return torch.from_numpy(np.ascontiguousarray(GGML_RULES[qtype](arr), dtype=np.float32))
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(arr, GGMLQuantizationType[qtype]), dtype=np.float32))


def matmul_bound(x: torch.Tensor, w_f32: torch.Tensor) -> torch.Tensor:
    """``|x| @ |W|^T`` in float64: the scale of the rounding error of ``x @ W^T`` (per output)."""
    return x.double().abs().reshape(-1, x.shape[-1]) @ w_f32.double().abs().reshape(-1, w_f32.shape[-1]).t()


def matvec_q8_1_reference(xq: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, code: torch.Tensor,
                          group_len: int, tile: int = 256) -> torch.Tensor:
    """Integer reference of the int8 decode mat-vec (``quant._matvec_q8_kernel``), in torch.

    Args:
        xq: ``uint8 [K/32*36]``, one q8_1 activation row (fp16 d, fp16 d*sum, 32 int8 q per block).
        scale, offset: float32 ``[N, K/GL]``; code: float32 ``[N, K]`` (integer values), the
            weight's grouped form (``quant.group_decompose``).
        group_len: GL; tile: the kernel's K tile (BK), which fixes the summation order.
    Returns:
        float32 ``[N]``: per group ``scale * (d8 * dot(code, q)) + offset * (d8 * sum(q))`` with
        the dot and sum in exact integer arithmetic, accumulated per group lane in K order and
        the lanes added in order, each step a float32 operation as in the kernel.
    """
    N, K = code.shape
    nb = K // Q8_1_BLOCK
    blocks = xq.reshape(nb, Q8_1_BYTES)
    d = blocks[:, :2].contiguous().view(torch.float16).float().reshape(nb)       # [nb]
    q = blocks[:, 4:].contiguous().view(torch.int8).to(torch.int64).reshape(K)   # [K]
    ng = K // group_len
    assert torch.equal(code, code.round()), "codes must be integers"
    qg = q.reshape(ng, group_len)
    idot = (code.to(torch.int64).reshape(N, ng, group_len) * qg).sum(-1)          # exact
    isum = qg.sum(-1)                                                              # exact
    d8 = d[(torch.arange(ng, device=d.device) * group_len) // 32]                  # [ng]
    part = scale * (d8[None, :] * idot.to(torch.float32)) + offset * (d8 * isum.to(torch.float32))[None, :]
    G = tile // group_len
    n_tiles = -(-ng // G)
    part = torch.cat([part, part.new_zeros(N, n_tiles * G - ng)], dim=1).reshape(N, n_tiles, G)
    acc = torch.zeros(N, G, dtype=torch.float32, device=code.device)
    for t in range(n_tiles):
        acc = acc + part[:, t]
    out = torch.zeros(N, dtype=torch.float32, device=code.device)
    for g in range(G):
        out = out + acc[:, g]
    return out
