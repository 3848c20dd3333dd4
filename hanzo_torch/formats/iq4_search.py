"""Quantizers for IQ4_NL and IQ4_XS, with or without importance weights.

They follow ggml's ``quantize_iq4_nl`` / ``quantize_iq4_xs`` (``quantize_row_iq4_nl_impl`` in
``ggml-quants.c`` with ``ntry = 7``), which is what ``ggml_quantize_chunk`` and ``llama-quantize``
run for these types: per group of 32 values a scale search over 15 candidate scales, each
value mapped to the nearest of the 16 non-linear levels (``kvalues``, read from ``gguf.quants``
through the format trait); IQ4_XS then stores one fp16 super-block scale and eight 6-bit group
scales (``-32 .. 31``, 4 low bits in ``scales_l``, 2 high bits in ``scales_h``). Importance
weights ``qw`` turn the per-value weight ``x^2`` into ``qw * sqrt(sigma2 + x^2)``, ``sigma2`` being
twice the mean square of the super-block.

The torch version runs on any device, every super-block at once; ggml's value-by-value float32
sums are repeated in the same order (a loop over the 32 values of a group), so the bytes equal
the C kernel's (``csrc/quant/kquants.c``, used on CPU tensors unless ``HANZO_QUANT_NATIVE=0``)
and ggml's. :data:`hanzo_torch.formats.kquant_search.EMULATE_FMA` is honoured (True: the torch
version, with the multiply-adds that GCC would contract rounded once).

Non-finite values or weights raise ValueError.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _kquant_native, kquant_search
from ._bits import check_values

__all__ = ["quantize_iq4_nl", "quantize_iq4_xs", "quantize_iq3_xxs", "quantize_iq3_s", "quantize_iq2_xxs", "quantize_iq2_xs",
           "quantize_iq2_s", "quantize_iq1_s", "quantize_iq1_m", "quantize_rows"]

GROUP = 32
NTRY = 7


def _kvalues(device: torch.device) -> torch.Tensor:
    from . import get_format
    return get_format("IQ4_NL").tables["kvalues"].on(device)


def _best_index(v: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """ggml's ``best_index_int8(16, kvalues, v)``: the nearest level's index, the upper one unless
    strictly nearer below (int64, same shape as ``v``)."""
    mu = torch.searchsorted(kv, v.contiguous(), right=True).clamp(1, 15)
    lo, hi = kv[mu - 1], kv[mu]
    idx = torch.where(v - lo < hi - v, mu - 1, mu)
    idx = torch.where(v <= kv[0], torch.zeros_like(idx), idx)
    return torch.where(v >= kv[15], torch.full_like(idx, 15), idx)


def _group_scales(x: torch.Tensor, w: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The best scale ``d`` of every group ``x [G, 32]`` with weights ``w [G, 32]`` (0 for an all-zero group)."""
    fma = kquant_search._fma
    f32 = kquant_search._f32
    amax, mx = kquant_search._first_absmax(x)
    zero = amax < kquant_search.GROUP_MAX_EPS
    mxs = torch.where(zero, torch.ones_like(mx), mx)

    def sums(iscale):
        q = kv[_best_index(iscale[:, None] * x, kv)]
        sqx = torch.zeros_like(mx)
        sq2 = torch.zeros_like(mx)
        for j in range(GROUP):
            wq = w[:, j] * q[:, j]
            sqx = fma(wq, x[:, j], sqx)
            sq2 = fma(wq, q[:, j], sq2)
        return sqx, sq2

    k0 = float(kv[0])
    d = -mxs / f32(k0, x)
    sqx, sq2 = sums(f32(1.0, x) / d)
    pos = sq2 > 0
    d = torch.where(pos, sqx / torch.where(pos, sq2, torch.ones_like(sq2)), torch.zeros_like(sq2))
    best = d * sqx
    for itry in range(-NTRY, NTRY + 1):
        sqx, sq2 = sums(f32(itry + k0, x) / mxs)
        take = (sq2 > 0) & (sqx * sqx > best * sq2)
        nd = sqx / torch.where(sq2 > 0, sq2, torch.ones_like(sq2))
        d = torch.where(take, nd, d)
        best = torch.where(take, nd * sqx, best)
    return torch.where(zero, torch.zeros_like(d), d)


def _weights(x: torch.Tensor, qw: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-value weights of super-blocks ``x [n, sbs]``: ``x^2``, or ``qw * sqrt(sigma2 + x^2)``."""
    if qw is None:
        return x * x
    sbs = x.shape[1]
    s = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    for j in range(sbs):
        s = kquant_search._fma(x[:, j], x[:, j], s)
    sigma2 = s * kquant_search._f32(2.0 / sbs, x)
    # float64 sqrt then rounded: the correctly rounded sqrtf
    return qw * torch.sqrt((sigma2[:, None] + x * x).double()).float()


def _pack_nibbles(L: torch.Tensor) -> torch.Tensor:
    """Codes ``[n, 32 k]`` -> ``[n, 16 k]`` bytes: ``q[16 i + j] = L[32 i + j] | L[32 i + 16 + j] << 4``."""
    n = L.shape[0]
    g = L.reshape(n, -1, 2, 16)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, -1).to(torch.uint8)


def _torch_nl(x: torch.Tensor, qw: Optional[torch.Tensor]) -> torch.Tensor:
    kv = _kvalues(x.device)
    w = _weights(x, qw)
    d = _group_scales(x, w, kv)
    id_ = torch.where(d != 0, kquant_search._f32(1.0, x) / torch.where(d != 0, d, torch.ones_like(d)),
                      torch.zeros_like(d))
    L = _best_index(id_[:, None] * x, kv)
    return torch.cat([kquant_search._fp16_bytes(d), _pack_nibbles(L)], dim=1)


def _torch_xs(x: torch.Tensor, qw: Optional[torch.Tensor]) -> torch.Tensor:
    kv = _kvalues(x.device)
    n = x.shape[0]
    f32 = kquant_search._f32
    w = _weights(x, qw)
    xg = x.reshape(n * 8, GROUP)
    scales = _group_scales(xg, w.reshape(n * 8, GROUP), kv).reshape(n, 8)
    amax, max_scale = kquant_search._first_absmax(scales)
    max_scale = torch.where(amax > 0, max_scale, torch.zeros_like(max_scale))
    d = -max_scale / f32(32.0, x)
    id_ = torch.where(d != 0, f32(1.0, x) / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    l = torch.round(id_[:, None] * scales).clamp(-32, 31)
    dl = d[:, None] * l
    idl = torch.where(dl != 0, f32(1.0, x) / torch.where(dl != 0, dl, torch.ones_like(dl)), torch.zeros_like(dl))
    L = _best_index(idl.reshape(-1, 1) * xg, kv).reshape(n, -1)
    lu = l.to(torch.int32) + 32
    sl = ((lu[:, 0::2] & 0xF) | ((lu[:, 1::2] & 0xF) << 4)).to(torch.uint8)
    sh = torch.zeros(n, dtype=torch.int32, device=x.device)
    for ib in range(8):
        sh = sh | ((lu[:, ib] >> 4) << (2 * ib))
    sh_bytes = torch.stack([sh & 0xFF, sh >> 8], dim=1).to(torch.uint8)
    return torch.cat([kquant_search._fp16_bytes(d), sh_bytes, sl, _pack_nibbles(L)], dim=1)


def _checked_weights(qw: torch.Tensor, k: int, name: str) -> torch.Tensor:
    if not isinstance(qw, torch.Tensor) or qw.dim() != 1 or qw.shape[0] != k:
        got = list(qw.shape) if isinstance(qw, torch.Tensor) else type(qw).__name__
        raise ValueError(f"{name}: quant_weights must be a 1-D tensor of the row length {k}, got {got}")
    qw = qw.to(torch.float32)
    if not bool(torch.isfinite(qw).all()):
        i = int((~torch.isfinite(qw)).nonzero()[0, 0])
        raise ValueError(f"{name}: quant_weights has a non-finite value at column {i}")
    return qw


def quantize_rows(x: torch.Tensor, name: str, quant_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Quantize rows ``x [rows, K]`` to ``name`` (``"IQ4_NL"``, ``"IQ4_XS"``, or a K-quant or
    Q4_0/Q4_1/Q5_0/Q5_1 with ``quant_weights``) as ``ggml_quantize_chunk`` does:
    ``uint8 [rows, K / block * type_size]``.

    ``quant_weights``: float32 ``[K]``, one importance weight per column (llama-quantize's
    per-tensor imatrix entry), or None.

    Raises:
        ValueError: ``x`` is not 2-D with K a block multiple, a non-finite value or weight.
        NotImplementedError: K-quants and Q4_0..Q5_1 with weights when the C kernel is
            unavailable (``HANZO_QUANT_NATIVE=0``, no C compiler, a non-CPU tensor or
            EMULATE_FMA): the torch version has no importance-weighted search for them.
    """
    from . import get_format
    fmt = get_format(name)
    if name not in _kquant_native.ROW_TYPES:
        raise NotImplementedError(f"{name}: no row quantizer here; one of {', '.join(_kquant_native.ROW_TYPES)}")
    if x.dim() != 2:
        raise ValueError(f"{name}: rows must be a 2-D tensor [rows, K], got {list(x.shape)}")
    k = x.shape[1]
    fmt.row_bytes(k)
    bs = fmt.block_size
    blocks = check_values(x.reshape(-1, bs), name).reshape(x.shape[0], k)
    qw = None if quant_weights is None else _checked_weights(quant_weights, k, name).to(x.device)
    if qw is None and name in _kquant_native.REQUIRES_WEIGHTS:
        raise ValueError(f"{name} needs importance weights (quant_weights, an imatrix), as ggml's quantizer does")
    if not x.shape[0]:
        return torch.empty(0, fmt.row_bytes(k), dtype=torch.uint8, device=x.device)
    if x.device.type == "cpu" and not kquant_search.EMULATE_FMA and not (
            qw is None and name in _kquant_native.WEIGHTED_ONLY):
        out = _kquant_native.quantize_rows(blocks, name, qw)  # checks finiteness itself
        if out is not None:
            return out
    blocks = kquant_search._checked(blocks.reshape(-1, bs), name).reshape(x.shape[0], k)
    if qw is None and name in _kquant_native.WEIGHTED_ONLY:
        return fmt.quantize_blocks(x.reshape(-1, bs)).reshape(x.shape[0], -1)
    if name in _kquant_native.KERNEL_ONLY:
        raise NotImplementedError(
            f"{name} needs the C kernel (csrc/quant/kquants.c on a CPU tensor, HANZO_QUANT_NATIVE not 0, "
            f"kquant_search.EMULATE_FMA False): it has no torch version" + (
                f"; the kernel failed to build: {_kquant_native.error()}" if _kquant_native.error() else ""))
    if name not in ("IQ4_NL", "IQ4_XS"):
        if qw is None:
            return fmt.quantize_blocks(x.reshape(-1, bs)).reshape(x.shape[0], -1)
        raise NotImplementedError(
            f"{name} with quant_weights needs the C kernel (csrc/quant/kquants.c on a CPU tensor, "
            f"HANZO_QUANT_NATIVE not 0, kquant_search.EMULATE_FMA False): the torch version has no "
            f"importance-weighted search for {name}" + (f"; the kernel failed to build: {_kquant_native.error()}"
                                                      if _kquant_native.error() else ""))
    fn = _torch_nl if name == "IQ4_NL" else _torch_xs
    nb = k // bs
    xb = blocks.reshape(-1, bs)
    wb = None if qw is None else qw.reshape(1, nb, bs).expand(x.shape[0], nb, bs).reshape(-1, bs)
    chunk = kquant_search._CHUNK
    outs = [fn(xb[s:s + chunk], None if wb is None else wb[s:s + chunk]) for s in range(0, xb.shape[0], chunk)]
    return torch.cat(outs).reshape(x.shape[0], -1)


def _weighted_fn(name: str):
    def run(x: torch.Tensor, quant_weights: torch.Tensor) -> torch.Tensor:
        return quantize_rows(x, name, quant_weights)
    run.__name__ = f"quantize_{name.lower()}_weighted"
    run.__doc__ = f"{name} with importance weights: see :func:`quantize_rows`."
    return run


WEIGHTED = {n: _weighted_fn(n) for n in _kquant_native.ROW_TYPES}
"""``name -> (rows [R, K], quant_weights [K]) -> uint8 [R, row_bytes]`` for every format with an
importance-weighted quantizer (the formats' ``quantize_weighted``)."""


def _blocks_fn(name: str):
    def run(blocks: torch.Tensor) -> torch.Tensor:
        x = check_values(blocks, name)
        return quantize_rows(x, name)
    run.__name__ = f"quantize_{name.lower()}"
    run.__doc__ = (f"{name} quantizer: float32 ``[n, block_size]`` -> uint8 ``[n, type_size]`` "
                   f"(ggml's ``quantize_{name.lower()}`` without weights).")
    return run


quantize_iq4_nl = _blocks_fn("IQ4_NL")
quantize_iq4_xs = _blocks_fn("IQ4_XS")
quantize_iq3_xxs = _blocks_fn("IQ3_XXS")
quantize_iq3_s = _blocks_fn("IQ3_S")
quantize_iq2_xxs = _blocks_fn("IQ2_XXS")  # raises: IQ2_XXS needs weights
quantize_iq2_xs = _blocks_fn("IQ2_XS")  # raises: IQ2_XS needs weights
quantize_iq2_s = _blocks_fn("IQ2_S")
quantize_iq1_s = _blocks_fn("IQ1_S")  # raises: IQ1_S needs weights
quantize_iq1_m = _blocks_fn("IQ1_M")
