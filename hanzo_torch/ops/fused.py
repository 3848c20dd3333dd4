"""Fused transformer ops: MoE routing, RMSNorm (+add), q/k-norm + RoPE (+ KV-cache write), SwiGLU,
KV-cache write, attention.

Each op is a ``torch.library`` custom op in namespace ``hanzo`` with a fake kernel and a
vectorized-torch reference that runs on any device; a backend's kernel registered on the
device's dispatch key runs instead where there is one (:mod:`hanzo_torch.ops._dispatch`), and
``HANZO_<OP>_FALLBACK=1`` or :func:`hanzo_torch.ops.use_reference` forces the reference.

Statistics (norms, softmax, RoPE angles, attention scores, P*V) are computed in float32 whatever
the activation dtype (float64 for float64 inputs, a reference-only dtype: see
:mod:`hanzo_torch.ops.spec`); results are returned in the input's dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .spec import OpSpec, compute_dtype, declare

__all__ = [
    "moe_route_reference",
    "rms_norm_reference",
    "add_rms_norm_reference",
    "qk_norm_rope_reference",
    "swiglu_reference",
    "kv_cache_write_reference",
    "qk_norm_rope_kv_write_reference",
    "attention_reference",
    "ATTENTION_IMPLS",
    "KV_CACHE_DTYPES",
    "kv_cache_shape",
    "kv_to_cache",
    "kv_from_cache",
]

ATTENTION_IMPLS = ("auto", "eager", "flash")
# Keys per step of the reference flash (online-softmax) attention: bounds its f32 score tile to
# [B, Hq, T, FLASH_BLOCK].
FLASH_BLOCK = 256

_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # float64: reference only


def _check(cond: bool, op: str, msg) -> None:
    # msg: a str, or a callable returning it (so the f-string is built only when the check fails:
    # formatting shapes on every call cost more than the CPU kernels themselves at decode shapes)
    if not cond:
        raise ValueError(f"hanzo.{op}: {msg() if callable(msg) else msg}")


def _check_float(t: Tensor, op: str, name: str) -> None:
    _check(t.dtype in _FLOAT_TYPES, op, lambda: f"{name} must be float32/float16/bfloat16 (float64: reference only), got {t.dtype}")


# ----------------------------------------------------------------------------------------------
# moe_route
# ----------------------------------------------------------------------------------------------
def _check_moe_route(logits: Tensor, k: int) -> None:
    _check(logits.dim() == 2, "moe_route", lambda: f"logits must be [T, E], got shape {tuple(logits.shape)}")
    _check_float(logits, "moe_route", "logits")
    _check(1 <= k <= logits.shape[1], "moe_route", lambda: f"k={k} must be in [1, E={logits.shape[1]}]")


def moe_route_reference(logits: Tensor, k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """Softmax over experts (f32), top-k with ties to the lower expert index, optional renormalization."""
    probs = torch.softmax(logits.to(compute_dtype(logits)), dim=-1)
    # A stable descending sort keeps equal probabilities in index order: ties go to the lower id.
    vals, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = vals[:, :k].contiguous(), ids[:, :k].contiguous()
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


# ----------------------------------------------------------------------------------------------
# rms_norm / add_rms_norm
# ----------------------------------------------------------------------------------------------
def _check_norm(op: str, x: Tensor, w: Tensor) -> None:
    _check_float(x, op, "x")
    _check_float(w, op, "w")
    _check(w.dim() == 1 and x.dim() >= 1 and w.shape[0] == x.shape[-1], op,
           lambda: f"w must be [{x.shape[-1] if x.dim() else '?'}] to match x's last dim, got w {tuple(w.shape)}, x {tuple(x.shape)}")


def rms_norm_reference(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * w``, statistics and product in float32, result in x.dtype."""
    xf = x.to(compute_dtype(x))
    inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv * w.to(xf.dtype)).to(x.dtype)


def add_rms_norm_reference(x: Tensor, residual: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``s = x + residual``; returns ``(rms_norm(s) * w, s)``."""
    s = x + residual
    return rms_norm_reference(s, w, eps), s


def _check_add_norm(x: Tensor, residual: Tensor, w: Tensor) -> None:
    _check_norm("add_rms_norm", x, w)
    _check(x.shape == residual.shape and x.dtype == residual.dtype, "add_rms_norm",
           lambda: f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} {residual.dtype} must match")


# ----------------------------------------------------------------------------------------------
# qk_norm_rope
# ----------------------------------------------------------------------------------------------
def _check_qk(q: Tensor, k: Tensor, q_w: Optional[Tensor], k_w: Optional[Tensor], positions: Tensor,
              op: str = "qk_norm_rope") -> None:
    _check(q.dim() == 4 and k.dim() == 4, op, lambda: f"q and k must be [B, T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    _check_float(q, op, "q")
    _check(k.dtype == q.dtype, op, lambda: f"q and k dtypes differ: {q.dtype}, {k.dtype}")
    B, T, _, D = q.shape
    _check(k.shape[0] == B and k.shape[1] == T and k.shape[3] == D, op,
           lambda: f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in B, T or D")
    _check(D % 2 == 0, op, lambda: f"head dim {D} must be even for RoPE")
    _check(positions.shape == (B, T), op, lambda: f"positions must be [B, T] = [{B}, {T}], got {tuple(positions.shape)}")
    _check(not positions.is_floating_point() and positions.dtype != torch.bool, op,
           lambda: f"positions must be an integer tensor, got {positions.dtype}")
    _check((q_w is None) == (k_w is None), op, "q_w and k_w must both be given or both be None")
    if q_w is not None:
        _check(q_w.shape == (D,) and k_w.shape == (D,), op,
               lambda: f"q_w and k_w must be [{D}], got {tuple(q_w.shape)}, {tuple(k_w.shape)}")


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """NEOX RoPE tables: ``cos, sin`` float32 ``[B, T, head_dim/2]`` for integer ``positions [B, T]``.

    ``inv_freq[i] = 1 / theta^(2i / head_dim)``, angle = position * inv_freq (float32), as
    Hugging Face's Qwen rotary embedding computes it.
    """
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    angles = positions.float()[..., None] * inv_freq
    return angles.cos(), angles.sin()


def _rope_neox(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [B, T, H, D] float32; cos/sin: [B, T, D/2]; rotates pairs (i, i + D/2).
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def qk_norm_rope_reference(q, k, q_w, k_w, positions, theta: float, eps: float) -> tuple[Tensor, Tensor]:
    """Unfused: per-head RMSNorm of q and k (when weights are given), then NEOX RoPE, in float32."""
    qf, kf = q.to(compute_dtype(q)), k.to(compute_dtype(k))
    if q_w is not None:
        qf = rms_norm_reference(qf, q_w, eps)
        kf = rms_norm_reference(kf, k_w, eps)
    cos, sin = rope_cos_sin(positions, q.shape[-1], theta)
    return _rope_neox(qf, cos, sin).to(q.dtype), _rope_neox(kf, cos, sin).to(k.dtype)


# ----------------------------------------------------------------------------------------------
# swiglu
# ----------------------------------------------------------------------------------------------
def _check_swiglu(gate: Tensor, up: Tensor) -> None:
    _check_float(gate, "swiglu", "gate")
    _check(gate.shape == up.shape and gate.dtype == up.dtype, "swiglu",
           lambda: f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` in float32, result in gate.dtype."""
    cd = compute_dtype(gate)
    return (F.silu(gate.to(cd)) * up.to(cd)).to(gate.dtype)


# ----------------------------------------------------------------------------------------------
# kv_cache_write
# ----------------------------------------------------------------------------------------------
def _check_positions_in_range(op: str, positions: Tensor, S: int) -> None:
    # Only where it costs no device sync: a GPU kernel must bound-check on the device instead.
    if positions.device.type == "cpu" and positions.numel():
        if positions.numel() == 1:  # decode with one sequence: one read instead of two reductions
            lo = hi = int(positions.reshape(()))
        else:
            lo, hi = (int(v) for v in torch.aminmax(positions))
        _check(lo >= 0 and hi < S, op, lambda: f"positions must be in [0, {S}) (the cache length), got [{lo}, {hi}]")


KV_CACHE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8_0": torch.uint8}
"""KV cache element types by llama.cpp name (``--cache-type-k`` values) -> the cache tensor's dtype.

A ``q8_0`` cache is ``uint8 [B, S, Hk, D/32*34]``: each row of D values is D/32 ggml
``block_q8_0`` (an f16 scale ``d``, then 32 int8 codes ``q``; value ``d * q``), written with
ggml's ``quantize_row_q8_0_ref`` rounding (the bytes of ``hanzo_torch.quantize(x, "Q8_0")``).
A uint8 cache always means q8_0."""

from ..constants import Q8_0_BLOCK as _Q8_0_BLOCK, q8_0_row_bytes as _q8_0_row_bytes  # noqa: E402
_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.float64)  # float64: reference only


def kv_cache_shape(B: int, S: int, Hk: int, D: int, kv_dtype: str) -> tuple[int, int, int, int]:
    """Shape of one KV cache of ``kv_dtype`` (a key of :data:`KV_CACHE_DTYPES`) for rows of D values.

    Raises:
        ValueError: unknown ``kv_dtype``, or q8_0 with D not a multiple of 32.
    """
    if kv_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_dtype!r}")
    if kv_dtype == "q8_0":
        if D % _Q8_0_BLOCK:
            raise ValueError(f"kv_dtype q8_0 needs a head dim that is a multiple of 32, got {D}")
        return (B, S, Hk, _q8_0_row_bytes(D))
    return (B, S, Hk, D)


def _cache_fits(cache: Tensor, D: int) -> bool:
    last = cache.shape[-1]
    if cache.dtype == torch.uint8:
        return D % _Q8_0_BLOCK == 0 and last == _q8_0_row_bytes(D)
    return last == D


def _check_caches(op: str, k_cache: Tensor, v_cache: Tensor) -> None:
    _check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape, op,
           lambda: f"k_cache and v_cache must be [B, S, Hk, D] (q8_0: [B, S, Hk, D/32*34]) of one shape, got "
                   f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    _check(k_cache.dtype == v_cache.dtype and k_cache.dtype in _KV_DTYPES, op,
           lambda: f"k_cache and v_cache must share a dtype among float32, float16, bfloat16 and uint8 (q8_0), "
                   f"got {k_cache.dtype}, {v_cache.dtype}")


def _cache_kind(cache: Tensor) -> str:
    return "q8_0 (uint8)" if cache.dtype == torch.uint8 else str(cache.dtype)


def _check_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, positions: Tensor,
              op: str = "kv_cache_write") -> None:
    _check_caches(op, k_cache, v_cache)
    _check(k.dim() == 4 and k.shape == v.shape, op, lambda: f"k and v must be [B, T, Hk, D] of one shape, got {tuple(k.shape)}, {tuple(v.shape)}")
    _check_float(k, op, "k")
    _check(v.dtype == k.dtype, op, lambda: f"k and v dtypes differ: {k.dtype}, {v.dtype}")
    B, S, Hk = k_cache.shape[:3]
    _check(k.shape[0] == B and k.shape[2] == Hk and _cache_fits(k_cache, k.shape[3]), op,
           lambda: f"k {tuple(k.shape)} does not fit the {_cache_kind(k_cache)} cache {tuple(k_cache.shape)} in B, Hk or D")
    _check(positions.shape == k.shape[:2], op, lambda: f"positions must be [B, T] = {tuple(k.shape[:2])}, got {tuple(positions.shape)}")
    _check(not positions.is_floating_point() and positions.dtype != torch.bool, op, "positions must be integers")


def kv_to_cache(x: Tensor, cache_dtype: torch.dtype) -> Tensor:
    """Values ``[..., D]`` (float) as cache rows of ``cache_dtype``: rounded to f32/f16/bf16 (nearest
    even), or quantized to q8_0 blocks ``uint8 [..., D/32*34]`` when ``cache_dtype`` is uint8."""
    if cache_dtype != torch.uint8:
        return x.to(cache_dtype)
    from ..formats import quantize

    return quantize(x, "Q8_0")


def kv_from_cache(cache: Tensor, D: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Cache rows as ``dtype`` (float32, or float64 for the reference-only float64) ``[..., D]``
    (q8_0 blocks dequantized: ``d * q``)."""
    if cache.dtype != torch.uint8:
        return cache.to(dtype)
    from ..formats import dequantize

    return dequantize(cache.contiguous(), "Q8_0", (*cache.shape[:-1], D), torch.float32).to(dtype)


def kv_cache_write_reference(k_cache, v_cache, k, v, positions) -> None:
    """``k_cache[b, positions[b, t]] = k[b, t]`` (and v), in place, converted to the cache's type
    (:func:`kv_to_cache`)."""
    B, T = positions.shape
    b_idx = torch.arange(B, device=positions.device)[:, None].expand(B, T)
    pos = positions.long()
    k_cache.index_put_((b_idx, pos), kv_to_cache(k, k_cache.dtype))
    v_cache.index_put_((b_idx, pos), kv_to_cache(v, v_cache.dtype))


# ----------------------------------------------------------------------------------------------
# qk_norm_rope_kv_write
# ----------------------------------------------------------------------------------------------
def _check_qk_kv(q, k, v, q_w, k_w, k_cache, v_cache, positions) -> None:
    op = "qk_norm_rope_kv_write"
    _check_qk(q, k, q_w, k_w, positions, op)
    _check_kv(k_cache, v_cache, k, v, positions, op)


def qk_norm_rope_kv_write_reference(q, k, v, q_w, k_w, k_cache, v_cache, positions, theta: float,
                                    eps: float) -> Tensor:
    """:func:`qk_norm_rope_reference` then :func:`kv_cache_write_reference` of the rotated k and of v;
    returns the rotated q."""
    q, k = qk_norm_rope_reference(q, k, q_w, k_w, positions, theta, eps)
    kv_cache_write_reference(k_cache, v_cache, k, v, positions)
    return q


# ----------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------
def _check_attention(q, k_cache, v_cache, positions, impl) -> None:
    op = "attention"
    _check(impl in ATTENTION_IMPLS, op, lambda: f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    _check(q.dim() == 4, op, lambda: f"q must be [B, T, Hq, D], got {tuple(q.shape)}")
    _check_float(q, op, "q")
    _check_caches(op, k_cache, v_cache)
    B, T, Hq, D = q.shape
    _check(k_cache.shape[0] == B and _cache_fits(k_cache, D), op,
           lambda: f"{_cache_kind(k_cache)} cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)} in B or D")
    Hk = k_cache.shape[2]
    _check(Hk > 0 and Hq % Hk == 0, op, lambda: f"query heads {Hq} must be a multiple of KV heads {Hk}")
    _check(positions.shape == (B, T), op, lambda: f"positions must be [B, T] = [{B}, {T}], got {tuple(positions.shape)}")
    _check(not positions.is_floating_point() and positions.dtype != torch.bool, op, "positions must be integers")


def _attention_dtype(q: Tensor, k_cache: Tensor) -> torch.dtype:
    return torch.float64 if torch.float64 in (q.dtype, k_cache.dtype) else torch.float32


def _attention_eager(q, k_cache, v_cache, positions, scale):
    # q: [B, T, Hq, D] -> [B, Hk, G, T, D]; caches [B, S, Hk, D] -> [B, Hk, 1, S, D]
    B, T, Hq, D = q.shape
    S, Hk = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hk
    cd = _attention_dtype(q, k_cache)
    qf = q.to(cd).view(B, T, Hk, G, D).permute(0, 2, 3, 1, 4)
    kf = kv_from_cache(k_cache, D, cd).permute(0, 2, 1, 3)[:, :, None]
    vf = kv_from_cache(v_cache, D, cd).permute(0, 2, 1, 3)[:, :, None]
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [B, Hk, G, T, S]
    visible = torch.arange(S, device=q.device)[None, None, :] <= positions[:, :, None]  # [B, T, S]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = torch.matmul(p, vf)  # [B, Hk, G, T, D], f32 P*V
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)


def _attention_flash(q, k_cache, v_cache, positions, scale):
    # Online softmax over key blocks of FLASH_BLOCK, running max m, sum l and accumulator acc in f32.
    B, T, Hq, D = q.shape
    S, Hk = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hk
    cd = _attention_dtype(q, k_cache)
    qf = q.to(cd).view(B, T, Hk, G, D).permute(0, 2, 3, 1, 4)  # [B, Hk, G, T, D]
    m = torch.full((B, Hk, G, T, 1), float("-inf"), device=q.device, dtype=cd)
    l = torch.zeros((B, Hk, G, T, 1), device=q.device, dtype=cd)
    acc = torch.zeros((B, Hk, G, T, D), device=q.device, dtype=cd)
    for s0 in range(0, S, FLASH_BLOCK):
        s1 = min(S, s0 + FLASH_BLOCK)
        kb = kv_from_cache(k_cache[:, s0:s1], D, cd).permute(0, 2, 1, 3)[:, :, None]
        vb = kv_from_cache(v_cache[:, s0:s1], D, cd).permute(0, 2, 1, 3)[:, :, None]
        sc = torch.matmul(qf, kb.transpose(-1, -2)) * scale  # [B, Hk, G, T, blk]
        visible = torch.arange(s0, s1, device=q.device)[None, None, :] <= positions[:, :, None]
        sc = sc.masked_fill(~visible[:, None, None], float("-inf"))
        m_new = torch.maximum(m, sc.amax(dim=-1, keepdim=True))
        # Rows with nothing visible yet keep m = -inf; use 0 there so exp() gives 0, not NaN.
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(sc - m_safe)
        corr = torch.exp(m - m_safe)
        l = l * corr + p.sum(dim=-1, keepdim=True)
        acc = acc * corr + torch.matmul(p, vb)
        m = m_new
    out = acc / l
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)


def attention_reference(q, k_cache, v_cache, positions, scale: float, impl: str = "auto") -> Tensor:
    """Causal-by-position grouped-query attention, unfused torch. ``auto``: eager for f16/bf16, flash for f32.

    Cache rows are converted to float32 first (:func:`kv_from_cache`); scores, softmax and P*V
    are float32."""
    if impl == "auto":
        impl = "flash" if q.dtype == torch.float32 else "eager"
    if positions.device.type == "cpu" and positions.numel():
        # Slots past the last position are masked anyway; on the CPU reading the bound costs no
        # device sync, so attend over the live prefix only (cost follows the sequence, not S).
        live = int(positions.max()) + 1
        k_cache, v_cache = k_cache[:, :live], v_cache[:, :live]
    fn = _attention_flash if impl == "flash" else _attention_eager
    return fn(q, k_cache, v_cache, positions, scale).to(q.dtype).contiguous()


# ----------------------------------------------------------------------------------------------
# trace forms (torch.export): static shapes, no data read on the host
# ----------------------------------------------------------------------------------------------
def _moe_route_trace(logits: Tensor, k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    # k rounds of argmax (the first maximum: ties go to the lower expert id, as in the reference);
    # a sort has no lowering in torch-mlir
    probs = torch.softmax(logits.to(compute_dtype(logits)), dim=-1)
    experts = torch.arange(probs.shape[-1], device=probs.device)
    left, weights, ids = probs, [], []
    for _ in range(k):
        i = torch.argmax(left, dim=-1, keepdim=True)  # [T, 1]
        weights.append(torch.gather(probs, -1, i))
        ids.append(i)
        left = torch.where(experts == i, torch.full_like(left, -1.0), left)
    w, i = torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, i


def _cache_update(cache: Tensor, new: Tensor, positions: Tensor) -> Tensor:
    # cache [B, S, H, D], new [B, T, H, D], positions [B, T]: slot s takes the new row whose
    # position is s (a one-hot contraction: no scatter, so it lowers to plain linalg)
    S = cache.shape[1]
    hit = (positions.to(torch.int64)[:, :, None] == torch.arange(S, device=cache.device)).to(cache.dtype)  # [B, T, S]
    written = hit.amax(dim=1)[:, :, None, None]  # [B, S, 1, 1]
    scattered = torch.einsum("bts,bthd->bshd", hit, new)
    return torch.where(written > 0, scattered, cache)


def _kv_cache_write_trace(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> None:
    k_cache.copy_(_cache_update(k_cache, k, positions))
    v_cache.copy_(_cache_update(v_cache, v, positions))


def _qk_norm_rope_kv_write_trace(q, k, v, q_w, k_w, k_cache, v_cache, positions, theta: float, eps: float) -> Tensor:
    q, k = qk_norm_rope_reference(q, k, q_w, k_w, positions, theta, eps)
    _kv_cache_write_trace(k_cache, v_cache, k, v, positions)
    return q


def _attention_trace(q, k_cache, v_cache, positions, scale: float, impl: str) -> Tensor:
    # every slot of the cache (no live prefix read on the host), eager float32 softmax
    return _attention_eager(q, k_cache, v_cache, positions.to(torch.int64), scale).to(q.dtype)


# ----------------------------------------------------------------------------------------------
# the op table entries
# ----------------------------------------------------------------------------------------------
def _kv_cache_write_reference_checked(k_cache, v_cache, k, v, positions) -> None:
    _check_positions_in_range("kv_cache_write", positions, k_cache.shape[1])
    kv_cache_write_reference(k_cache, v_cache, k, v, positions)


def _qk_norm_rope_kv_write_reference_checked(q, k, v, q_w, k_w, k_cache, v_cache, positions, theta, eps):
    _check_positions_in_range("qk_norm_rope_kv_write", positions, k_cache.shape[1])
    return qk_norm_rope_kv_write_reference(q, k, v, q_w, k_w, k_cache, v_cache, positions, theta, eps)


def _attention_reference_checked(q, k_cache, v_cache, positions, scale, impl):
    _check_positions_in_range("attention", positions, k_cache.shape[1])
    return attention_reference(q, k_cache, v_cache, positions, scale, impl)


moe_route = declare(OpSpec(
    "moe_route", "(Tensor logits, SymInt k, bool normalize) -> (Tensor, Tensor)",
    check=lambda logits, k, normalize: _check_moe_route(logits, k), reference=moe_route_reference,
    trace=_moe_route_trace,
    outputs=lambda logits, k, normalize: (logits.new_empty((logits.shape[0], k), dtype=compute_dtype(logits)),
                                          logits.new_empty((logits.shape[0], k), dtype=torch.int64)),
    doc="""Mixture-of-experts routing in one pass.

    Args:
        logits: router logits ``[T, E]`` (f32/f16/bf16).
        k: experts per token (``expert_used_count``), 1 <= k <= E.
        normalize: divide the k selected probabilities by their sum (Qwen3-MoE's ``norm_topk_prob``).

    Returns:
        ``(weights float32 [T, k], ids int64 [T, k])``; experts in descending probability, ties to
        the lower expert index.

    Raises:
        ValueError: bad shape, dtype or k.
    """))

rms_norm = declare(OpSpec(
    "rms_norm", "(Tensor x, Tensor w, float eps) -> Tensor",
    check=lambda x, w, eps: _check_norm("rms_norm", x, w), reference=rms_norm_reference,
    outputs=lambda x, w, eps: torch.empty_like(x), doc="""RMSNorm over the last dim.

    Args:
        x: ``[..., H]`` activations (f32/f16/bf16).
        w: ``[H]`` weight.
        eps: added to the mean square (``layer_norm_rms_epsilon``).

    Returns:
        ``[..., H]`` in x.dtype; statistics in float32.

    Raises:
        ValueError: shape or dtype mismatch.
    """))

add_rms_norm = declare(OpSpec(
    "add_rms_norm", "(Tensor x, Tensor residual, Tensor w, float eps) -> (Tensor, Tensor)",
    check=lambda x, residual, w, eps: _check_add_norm(x, residual, w), reference=add_rms_norm_reference,
    outputs=lambda x, residual, w, eps: (torch.empty_like(x), torch.empty_like(x)), doc="""Fused residual add + RMSNorm.

    Args:
        x, residual: ``[..., H]`` of one dtype.
        w: ``[H]``.
        eps: RMSNorm epsilon.

    Returns:
        ``(normed, s)``: ``s = x + residual`` (x.dtype) and ``normed = rms_norm(s) * w``.

    Raises:
        ValueError: shape or dtype mismatch.
    """))

qk_norm_rope = declare(OpSpec(
    "qk_norm_rope",
    "(Tensor q, Tensor k, Tensor? q_w, Tensor? k_w, Tensor positions, float theta, float eps) -> (Tensor, Tensor)",
    check=lambda q, k, q_w, k_w, positions, theta, eps: _check_qk(q, k, q_w, k_w, positions),
    reference=qk_norm_rope_reference,
    outputs=lambda q, k, *_: (torch.empty_like(q), torch.empty_like(k)), doc="""Per-head RMSNorm of q and k over D (Qwen3's ``attn_q_norm``/``attn_k_norm``), then NEOX RoPE.

    Args:
        q: ``[B, T, Hq, D]``; k: ``[B, T, Hk, D]`` (same dtype).
        q_w, k_w: ``[D]`` norm weights, or both None to skip the norm (Qwen2).
        positions: integer ``[B, T]`` token positions, read on the device (no host sync).
        theta: RoPE base (``rope.freq_base``).
        eps: RMSNorm epsilon.

    Returns:
        ``(q, k)`` rotated, in the input dtype; pairs ``(i, i + D/2)`` rotate by
        ``position / theta^(2i/D)`` radians.

    Raises:
        ValueError: shape or dtype mismatch.
    """))

swiglu = declare(OpSpec(
    "swiglu", "(Tensor gate, Tensor up) -> Tensor", check=_check_swiglu, reference=swiglu_reference,
    outputs=lambda gate, up: torch.empty_like(gate), doc="""SwiGLU activation: ``silu(gate) * up``, elementwise, shapes ``[..., F]``, computed in float32.

    Raises:
        ValueError: shape or dtype mismatch.
    """))

kv_cache_write = declare(OpSpec(
    "kv_cache_write", "(Tensor(a0!) k_cache, Tensor(a1!) v_cache, Tensor k, Tensor v, Tensor positions) -> ()",
    check=_check_kv, reference=_kv_cache_write_reference_checked, trace=_kv_cache_write_trace,
    outputs=None, mutates=("k_cache", "v_cache"), tolerance="exact", device_arg=2, doc="""Write new keys/values into the static KV cache at their positions, in place.

    Args:
        k_cache, v_cache: ``[B, S, Hk, D]`` caches of one dtype, float32, float16 or bfloat16, or
            q8_0 blocks ``uint8 [B, S, Hk, D/32*34]`` (:data:`KV_CACHE_DTYPES`); allocated once at
            max context, never reallocated.
        k, v: ``[B, T, Hk, D]`` new entries (f32/f16/bf16, one dtype, which may differ from the
            caches'): each row is rounded to the cache's dtype (nearest even) or quantized to
            q8_0 as ``hanzo_torch.quantize(row, "Q8_0")`` does.
        positions: integer ``[B, T]`` slots to write, each in ``[0, S)``.

    Raises:
        ValueError: shape/dtype mismatch, or (on CPU) a position outside the cache.
    """))

qk_norm_rope_kv_write = declare(OpSpec(
    "qk_norm_rope_kv_write",
    "(Tensor q, Tensor k, Tensor v, Tensor? q_w, Tensor? k_w, Tensor(a5!) k_cache, Tensor(a6!) v_cache, "
    "Tensor positions, float theta, float eps) -> Tensor",
    check=lambda q, k, v, q_w, k_w, k_cache, v_cache, positions, theta, eps: _check_qk_kv(
        q, k, v, q_w, k_w, k_cache, v_cache, positions),
    reference=_qk_norm_rope_kv_write_reference_checked, trace=_qk_norm_rope_kv_write_trace,
    outputs=lambda q, *_: torch.empty_like(q), mutates=("k_cache", "v_cache"), doc=""":func:`qk_norm_rope` and :func:`kv_cache_write` of its rotated keys in one op (one kernel
    launch where the backend has a fused kernel): the attention block's step between the q/k/v
    projections and ``attention``.

    Args:
        q: ``[B, T, Hq, D]``; k, v: ``[B, T, Hk, D]`` (one float dtype: f32/f16/bf16).
        q_w, k_w: ``[D]`` per-head RMSNorm weights of q and k, or both None (Qwen2: RoPE only).
        k_cache, v_cache: ``[B, S, Hk, D]`` caches of one dtype (float32, float16, bfloat16) or
            q8_0 blocks ``uint8 [B, S, Hk, D/32*34]`` (:data:`KV_CACHE_DTYPES`), written in place.
        positions: integer ``[B, T]`` token positions (the RoPE angles and the cache slots), each
            in ``[0, S)``; read on the device (no host sync).
        theta: RoPE base (``rope.freq_base``).
        eps: RMSNorm epsilon.

    Returns:
        The rotated q ``[B, T, Hq, D]`` in q's dtype. ``k_cache[b, positions[b, t]]`` receives the
        normalized, rotated ``k[b, t]`` rounded to q's dtype and then converted to the cache's
        type, ``v_cache`` receives ``v[b, t]``: the same bits as ``qk_norm_rope`` followed by
        ``kv_cache_write``.

    Raises:
        ValueError: shape/dtype mismatch, or (on CPU) a position outside the cache.
    """))

attention = declare(OpSpec(
    "attention", "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor positions, float scale, str impl) -> Tensor",
    check=lambda q, k_cache, v_cache, positions, scale, impl: _check_attention(q, k_cache, v_cache, positions, impl),
    reference=_attention_reference_checked, trace=_attention_trace,
    outputs=lambda q, *_: torch.empty_like(q), doc="""Causal, grouped-query attention of new queries against the KV cache.

    Args:
        q: ``[B, T, Hq, D]`` queries (already rotated).
        k_cache, v_cache: ``[B, S, Hk, D]``, Hq a multiple of Hk (query head h reads KV head h // (Hq/Hk)).
            One dtype for both, which may differ from q's: float32, float16, bfloat16, or q8_0
            blocks ``uint8 [B, S, Hk, D/32*34]`` (:data:`KV_CACHE_DTYPES`). Rows are converted to
            float32 (q8_0: ``d * q``) before the float32 scores, softmax and P*V.
        positions: integer ``[B, T]``: the query at position p attends to cache slots 0..p
            (slots past p are masked, whatever they hold).
        scale: score scale, usually ``1/sqrt(D)``.
        impl: ``"eager"`` (materialized f32 softmax, f32 P*V), ``"flash"`` (online softmax, f32
            accumulators) or ``"auto"`` (eager for f16/bf16 inputs, per docs/DESIGN.md section 6; flash
            for f32).

    Returns:
        ``[B, T, Hq, D]`` in q.dtype.

    Raises:
        ValueError: shape/dtype mismatch, bad impl, or (on CPU) a position outside the cache.
    """))


def check_args(op: str, *args) -> None:
    """Run ``op``'s argument checks (shapes and dtypes, as its fake kernel does); raises its ValueError."""
    from .spec import check_args as _check_args

    _check_args(op, *args)
