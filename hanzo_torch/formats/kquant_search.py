"""Quantizers for the K-quant formats Q2_K, Q3_K, Q4_K, Q5_K and Q6_K.

These follow ggml's reference quantizers (``quantize_row_q{2..6}_K_ref`` in ``ggml-quants.c``,
with their scale searches ``make_qkx2_quants``, ``make_q3_quants`` and ``make_qx_quants``),
which is also what ``ggml_quantize_chunk`` and ``llama-quantize`` run for these types when no
importance matrix is given. Every super-block and sub-block is processed at once as torch
vectors on any device; the loops that remain in Python run over the values of one sub-block
(16 or 32) and over the candidate scales, because ggml accumulates its sums value by value and
float32 addition is not associative: the same order gives the same bits.

The reference quantizers live in ``libggml-base``, which ggml's CMake build compiles without
``-march`` flags (GGML_NATIVE applies to the ``ggml-cpu`` backend only): on x86-64 that is SSE2
scalar float32 code with no fused multiply-add, which is what :data:`EMULATE_FMA` False (the
default) reproduces, byte for byte against that library (see tests/test_kquant_oracle.py). A ggml built with
contraction into FMA (GCC's default ``-ffp-contract=fast`` on an ISA with FMA) is matched more
closely with :data:`EMULATE_FMA` True: each fused ``a * b + c`` is then evaluated with one
rounding (the exact product in float64, then the sum rounded to float32; that double rounding
can differ from a true fused operation when the float64 sum lies halfway between two float32
values). Devices without float64 (MPS) need it False.

On CPU tensors the C kernel ``csrc/quant/kquants.c`` (:mod:`~hanzo_torch.formats._kquant_native`,
the same algorithms with every float32 operation rounded once; ``HANZO_QUANT_NATIVE=0`` turns it
off) runs instead of the torch version when :data:`EMULATE_FMA` is False: the torch version
takes minutes per million super-blocks on two cores, the kernel seconds.

Non-finite inputs raise ValueError (ggml's C has undefined behaviour there).
"""
from __future__ import annotations

import torch

from . import _kquant_native
from ._bits import check_values, pack_bits

__all__ = ["EMULATE_FMA", "quantize_q2_k", "quantize_q3_k", "quantize_q4_k", "quantize_q5_k", "quantize_q6_k"]

QK_K = 256
GROUP_MAX_EPS = 1e-15  # ggml's threshold under which a group counts as all zero

EMULATE_FMA = False
"""True: evaluate the multiply-adds that GCC fuses with one rounding; False: two roundings."""

_CHUNK = 1 << 15  # super-blocks per pass: bounds the working set to a few tens of MiB


def _fma(a: torch.Tensor, b, c) -> torch.Tensor:
    """``a * b + c`` rounded once to float32 (see :data:`EMULATE_FMA`)."""
    if EMULATE_FMA:
        b64 = b.double() if isinstance(b, torch.Tensor) else float(b)
        c64 = c.double() if isinstance(c, torch.Tensor) else float(c)
        return (a.double() * b64 + c64).float()
    return a * b + c


def _fnma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``c - a * b`` rounded once to float32 (see :data:`EMULATE_FMA`)."""
    if EMULATE_FMA:
        return (c.double() - a.double() * b.double()).float()
    return c - a * b


def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    """A float32 0-dim tensor: ``_f32(c, x) / t`` is a true division (``c / t`` with a Python ``c``
    is ``t.reciprocal() * c`` in torch, which rounds twice)."""
    return torch.full((), v, dtype=torch.float32, device=like.device)


def _fp16_round(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest fp16 value (ggml's ``GGML_FP32_TO_FP16`` then back), as float32."""
    return x.to(torch.float16).to(torch.float32)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 ``[n]`` -> little-endian fp16 bytes ``uint8 [n, 2]``."""
    bits = x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack([bits & 0xFF, bits >> 8], dim=-1).to(torch.uint8)


def _pack(q: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    return pack_bits(q, bits, group)


def _first_absmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax, max)`` of the rows of ``x [N, n]``: the largest ``|x|`` and the first value that has it
    (ggml's loop ``if (ax > amax) { amax = ax; max = x[i]; }``)."""
    a = x.abs()
    idx = a.argmax(dim=-1, keepdim=True)
    return a.gather(-1, idx).squeeze(-1), x.gather(-1, idx).squeeze(-1)


def _positive_max(v: torch.Tensor) -> torch.Tensor:
    """ggml's ``m = 0; if (v > m) m = v`` over the rows of ``v [N, k]``: +0.0 unless some value is > 0."""
    m = v.amax(dim=1)
    return torch.where(m > 0, m, torch.zeros_like(m))


# ---------------------------------------------------------------------------------------------
# the scale searches
# ---------------------------------------------------------------------------------------------

def _make_qkx2_quants(x, w, nmax, rmin, rdelta, nstep, use_mad):
    """ggml's ``make_qkx2_quants`` for every row of ``x [N, n]`` with weights ``w [N, n]``.

    Returns ``(scale [N], the_min [N], L [N, n])``, float32 (L holds integers in [0, nmax]).
    """
    n = x.shape[1]
    mn = x.amin(dim=1).clamp(max=0.0)  # min over the row, then "if (min > 0) min = 0"
    mx = x.amax(dim=1)
    sum_w = w[:, 0].clone()
    sum_x = sum_w * x[:, 0]
    for i in range(1, n):
        sum_w = sum_w + w[:, i]
        sum_x = _fma(w[:, i], x[:, i], sum_x)
    degenerate = mx == mn
    rng = torch.where(degenerate, torch.ones_like(mx), mx - mn)
    iscale = _f32(nmax, x) / rng
    scale = _f32(1.0, x) / iscale
    xm = x - mn[:, None]
    L = torch.round(iscale[:, None] * xm).clamp(0, nmax)

    def error(s, m, lv):
        err = torch.zeros_like(s)
        for i in range(n):
            diff = _fma(s, lv[:, i], m) - x[:, i]
            diff = diff.abs() if use_mad else diff * diff
            err = _fma(w[:, i], diff, err)
        return err

    best = error(scale, mn, L)
    best_min = mn
    for step in range(nstep + 1):
        # ggml's search moves from the best (scale, min) so far: max - min and x - min use it
        num = _fma(_f32(rdelta, x), _f32(float(step), x), _f32(rmin, x)) + nmax
        iscale = num / torch.where(degenerate, torch.ones_like(mx), mx - best_min)
        la = torch.round(iscale[:, None] * (x - best_min[:, None])).clamp(0, nmax)
        sum_l = torch.zeros_like(mn)
        sum_l2 = torch.zeros_like(mn)
        sum_xl = torch.zeros_like(mn)
        for i in range(n):
            wl = w[:, i] * la[:, i]
            sum_l = sum_l + wl
            sum_l2 = _fma(wl, la[:, i], sum_l2)
            sum_xl = _fma(wl, x[:, i], sum_xl)
        D = _fma(sum_w, sum_l2, -(sum_l * sum_l))
        ok = D > 0
        Ds = torch.where(ok, D, torch.ones_like(D))
        this_scale = _fma(sum_w, sum_xl, -(sum_x * sum_l)) / Ds
        this_min = _fma(sum_l2, sum_x, -(sum_l * sum_xl)) / Ds
        pos = this_min > 0
        this_scale = torch.where(pos, sum_xl / torch.where(sum_l2 == 0, torch.ones_like(sum_l2), sum_l2), this_scale)
        this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
        cur = error(this_scale, this_min, la)
        take = ok & (cur < best)
        L = torch.where(take[:, None], la, L)
        best = torch.where(take, cur, best)
        scale = torch.where(take, this_scale, scale)
        best_min = torch.where(take, this_min, best_min)
    scale = torch.where(degenerate, torch.zeros_like(scale), scale)
    L = torch.where(degenerate[:, None], torch.zeros_like(L), L)
    best_min = torch.where(degenerate, mn, best_min)
    return scale, -best_min, L


def _make_qx_quants_rmse1(x, nmax):
    """ggml's ``make_qx_quants(n, nmax, x, L, 1, NULL)`` (weights x^2) for every row of ``x [N, n]``.

    Returns ``(scale [N], L [N, n])`` (L in [0, 2*nmax - 1]; 0 for an all-zero row).
    """
    n = x.shape[1]
    amax, mx = _first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mxs = torch.where(zero, torch.ones_like(mx), mx)
    wx = x * x * x  # (w * x) with w = x * x, before the multiply by l that GCC fuses
    wv = x * x

    def sums(iscale):
        lv = torch.round(iscale[:, None] * x).clamp(-nmax, nmax - 1)
        slx = torch.zeros_like(mx)
        sl2 = torch.zeros_like(mx)
        for i in range(n):
            slx = _fma(wx[:, i], lv[:, i], slx)
            sl2 = _fma(wv[:, i] * lv[:, i], lv[:, i], sl2)
        return lv, slx, sl2

    iscale = _f32(-nmax, x) / mxs
    L, sumlx, suml2 = sums(iscale)
    scale = torch.where(suml2 != 0, sumlx / torch.where(suml2 != 0, suml2, torch.ones_like(suml2)), torch.zeros_like(suml2))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -_fma(_f32(0.1, x), _f32(float(step), x), _f32(float(nmax), x)) / mxs
        lv, slx, sl2 = sums(iscale)
        take = (sl2 > 0) & (slx * slx > best * sl2)
        L = torch.where(take[:, None], lv, L)
        new_scale = slx / torch.where(sl2 > 0, sl2, torch.ones_like(sl2))
        scale = torch.where(take, new_scale, scale)
        best = torch.where(take, new_scale * slx, best)
    L = torch.where(zero[:, None], torch.zeros_like(L), L + nmax)
    return torch.where(zero, torch.zeros_like(scale), scale), L


def _make_q3_quants_rmse(x, nmax):
    """ggml's ``make_q3_quants(n, nmax, x, L, true)`` for every row of ``x [N, n]``.

    Returns ``(scale [N], L [N, n])`` (L in [0, 2*nmax - 1]; 0 for an all-zero row).
    """
    n = x.shape[1]
    amax, mx = _first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mxs = torch.where(zero, torch.ones_like(mx), mx)
    iscale = _f32(-nmax, x) / mxs
    L = torch.round(iscale[:, None] * x).clamp(-nmax, nmax - 1)
    wv = x * x
    wx = wv * x
    sumlx = torch.zeros_like(mx)
    suml2 = torch.zeros_like(mx)
    for i in range(n):
        sumlx = _fma(wx[:, i], L[:, i], sumlx)
        suml2 = _fma(wv[:, i] * L[:, i], L[:, i], suml2)
    cols = list(L.unbind(1))
    # A pass with no change leaves the state as it was, so the next passes change nothing either:
    # running all five passes on every row equals ggml's early exit.
    for _ in range(5):
        for i in range(n):
            li = cols[i]
            slx = _fnma(wx[:, i], li, sumlx)
            sl2 = _fnma(wv[:, i] * li, li, suml2)
            cand = slx > 0
            new_l = torch.round(x[:, i] * sl2 / torch.where(cand, slx, torch.ones_like(slx))).clamp(-nmax, nmax - 1)
            cand = cand & (new_l != li)
            slx2 = _fma(wx[:, i], new_l, slx)
            sl22 = _fma(wv[:, i] * new_l, new_l, sl2)
            take = cand & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            cols[i] = torch.where(take, new_l, li)
            sumlx = torch.where(take, slx2, sumlx)
            suml2 = torch.where(take, sl22, suml2)
    L = torch.stack(cols, dim=1)
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, torch.ones_like(suml2)), torch.zeros_like(suml2))
    L = torch.where(zero[:, None], torch.zeros_like(L), L + nmax)
    return torch.where(zero, torch.zeros_like(scale), scale), L


def _requant(x, d, dm, lo, hi, L):
    """ggml's final pass: ``L = clamp(nearest_int((x + dm) / d), lo, hi)`` where ``d != 0``, else L kept.

    ``x [N, n]``; ``d``, ``dm`` ``[N]`` (dm None for the symmetric formats)."""
    ok = d != 0
    ds = torch.where(ok, d, torch.ones_like(d))[:, None]
    num = x if dm is None else x + dm[:, None]
    q = torch.round(num / ds).clamp(lo, hi)
    return torch.where(ok[:, None], q, L)


def _checked(blocks: torch.Tensor, name: str) -> torch.Tensor:
    x = check_values(blocks, name)
    if x.numel() and not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()
        raise ValueError(f"{name}: cannot quantize non-finite values (block {bad[0]}, value {bad[1]})")
    return x


def _chunked(fn):
    name = fn.__name__[1:5].upper()

    def run(blocks: torch.Tensor) -> torch.Tensor:
        x = check_values(blocks, name)
        if x.device.type == "cpu" and not EMULATE_FMA and x.shape[0]:
            out = _kquant_native.quantize(x, name)  # checks finiteness itself
            if out is not None:
                return out
        x = _checked(x, name)
        if x.shape[0] <= _CHUNK:
            return fn(x)
        return torch.cat([fn(x[s:s + _CHUNK]) for s in range(0, x.shape[0], _CHUNK)])
    run.__name__ = fn.__name__.lstrip("_")
    run.__doc__ = fn.__doc__
    return run


# ---------------------------------------------------------------------------------------------
# the formats
# ---------------------------------------------------------------------------------------------

def _scale_bytes_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """8 six-bit scales and mins ``[nb, 8]`` (ints) -> the 12 ``scales`` bytes of Q4_K/Q5_K."""
    lo = torch.cat([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6)], dim=1)
    hi = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return torch.cat([lo, hi], dim=1).to(torch.uint8)


def _k4_common(x: torch.Tensor, nmax: int, rmin: float, nstep: int):
    """Q4_K/Q5_K: scales, mins and codes ``L [nb, 256]`` (ints) of super-blocks ``x [nb, 256]``."""
    nb = x.shape[0]
    xs = x.reshape(nb * 8, 32)
    sum_x2 = torch.zeros(nb * 8, dtype=torch.float32, device=x.device)
    for i in range(32):
        sum_x2 = _fma(xs[:, i], xs[:, i], sum_x2)
    # sqrt in float64 then rounded: the correctly rounded float32 sqrtf (torch's float32 sqrt on
    # CPU can be an ulp off, which moves the weights)
    av_x = torch.sqrt((sum_x2 / _f32(32.0, x)).double()).float()
    w = av_x[:, None] + xs.abs()
    scales, mins, L = _make_qkx2_quants(xs, w, nmax, rmin, 0.1, nstep, False)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale = _positive_max(scales)
    max_min = _positive_max(mins)
    inv_scale = torch.where(max_scale > 0, _f32(63.0, x) / torch.where(max_scale > 0, max_scale, torch.ones_like(max_scale)),
                            torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, _f32(63.0, x) / torch.where(max_min > 0, max_min, torch.ones_like(max_min)),
                          torch.zeros_like(max_min))
    # "uint8_t ls = nearest_int(...)": a negative value wraps modulo 256 before MIN(63, ls)
    ls = (torch.round(inv_scale[:, None] * scales).to(torch.int32) & 0xFF).clamp(max=63)
    lm = (torch.round(inv_min[:, None] * mins).to(torch.int32) & 0xFF).clamp(max=63)
    dq = _fp16_round(max_scale / _f32(63.0, x))
    dmq = _fp16_round(max_min / _f32(63.0, x))
    d = (dq[:, None] * ls.to(torch.float32)).reshape(-1)
    dm = (dmq[:, None] * lm.to(torch.float32)).reshape(-1)
    L = _requant(xs, d, dm, 0, nmax, L).reshape(nb, QK_K).to(torch.int32)
    head = torch.cat([_fp16_bytes(max_scale / _f32(63.0, x)), _fp16_bytes(max_min / _f32(63.0, x)),
                      _scale_bytes_k4(ls, lm)], dim=1)
    return head, L


@_chunked
def _q4_k(x: torch.Tensor) -> torch.Tensor:
    """Q4_K quantizer: float32 ``[n, 256]`` -> uint8 ``[n, 144]`` (ggml's ``quantize_row_q4_K_ref``)."""
    head, L = _k4_common(x, 15, -1.0, 20)
    return torch.cat([head, _pack(L, 4, 32)], dim=1)


@_chunked
def _q5_k(x: torch.Tensor) -> torch.Tensor:
    """Q5_K quantizer: float32 ``[n, 256]`` -> uint8 ``[n, 176]`` (ggml's ``quantize_row_q5_K_ref``)."""
    head, L = _k4_common(x, 31, -0.5, 15)
    return torch.cat([head, _pack(L >> 4, 1, 32), _pack(L & 0xF, 4, 32)], dim=1)


@_chunked
def _q2_k(x: torch.Tensor) -> torch.Tensor:
    """Q2_K quantizer: float32 ``[n, 256]`` -> uint8 ``[n, 84]`` (ggml's ``quantize_row_q2_K_ref``)."""
    nb = x.shape[0]
    xs = x.reshape(nb * 16, 16)
    scales, mins, L = _make_qkx2_quants(xs, xs.abs(), 3, -0.5, 0.1, 15, True)
    scales, mins = scales.reshape(nb, 16), mins.reshape(nb, 16)
    max_scale = _positive_max(scales)
    max_min = _positive_max(mins)
    has_s, has_m = max_scale > 0, max_min > 0
    q4 = _f32(15.0, x)
    isc = q4 / torch.where(has_s, max_scale, torch.ones_like(max_scale))
    imn = q4 / torch.where(has_m, max_min, torch.ones_like(max_min))
    ls = torch.where(has_s[:, None], torch.round(isc[:, None] * scales).to(torch.int32) & 0xFF, 0)
    lm = torch.where(has_m[:, None], torch.round(imn[:, None] * mins).to(torch.int32), 0)
    sc = (ls | (lm << 4)) & 0xFF
    d_val = torch.where(has_s, max_scale / q4, torch.zeros_like(max_scale))
    dm_val = torch.where(has_m, max_min / q4, torch.zeros_like(max_min))
    d = (_fp16_round(d_val)[:, None] * (sc & 0xF).to(torch.float32)).reshape(-1)
    dm = (_fp16_round(dm_val)[:, None] * (sc >> 4).to(torch.float32)).reshape(-1)
    L = _requant(xs, d, dm, 0, 3, L).reshape(nb, QK_K).to(torch.int32)
    return torch.cat([sc.to(torch.uint8), _pack(L, 2, 32), _fp16_bytes(d_val), _fp16_bytes(dm_val)], dim=1)


@_chunked
def _q3_k(x: torch.Tensor) -> torch.Tensor:
    """Q3_K quantizer: float32 ``[n, 256]`` -> uint8 ``[n, 110]`` (ggml's ``quantize_row_q3_K_ref``)."""
    nb = x.shape[0]
    xs = x.reshape(nb * 16, 16)
    scales, L = _make_q3_quants_rmse(xs, 4)
    scales = scales.reshape(nb, 16)
    _, max_scale = _first_absmax(scales)
    has = max_scale != 0
    iscale = _f32(-32.0, x) / torch.where(has, max_scale, torch.ones_like(max_scale))
    # "int8_t l = nearest_int(...)" then MAX(-32, MIN(31, l)) + 32
    l6 = torch.where(has[:, None], torch.round(iscale[:, None] * scales).clamp(-32, 31).to(torch.int32) + 32, 0)
    d_val = torch.where(has, _f32(1.0, x) / iscale, torch.zeros_like(iscale))
    sc = torch.where(has[:, None], l6 - 32, 0)  # a block without scale stores zero bytes, decoding to -32
    d = (_fp16_round(d_val)[:, None] * sc.to(torch.float32)).reshape(-1)
    L = (_requant(xs, d, None, -4, 3, L - 4) + 4).reshape(nb, QK_K).to(torch.int32)
    hmask = _pack((L > 3).to(torch.int32), 1, 32)
    L = torch.where(L > 3, L - 4, L)
    sbytes = torch.cat([_pack(l6 & 0xF, 4, 8), _pack(l6 >> 4, 2, 4)], dim=1)
    return torch.cat([hmask, _pack(L, 2, 32), sbytes, _fp16_bytes(d_val)], dim=1)


@_chunked
def _q6_k(x: torch.Tensor) -> torch.Tensor:
    """Q6_K quantizer: float32 ``[n, 256]`` -> uint8 ``[n, 210]`` (ggml's ``quantize_row_q6_K_ref``)."""
    nb = x.shape[0]
    xs = x.reshape(nb * 16, 16)
    scales, L = _make_qx_quants_rmse1(xs, 32)
    scales = scales.reshape(nb, 16)
    max_abs, max_scale = _first_absmax(scales)
    live = max_abs >= GROUP_MAX_EPS
    iscale = _f32(-128.0, x) / torch.where(live, max_scale, torch.ones_like(max_scale))
    d_val = torch.where(live, _f32(1.0, x) / iscale, torch.zeros_like(iscale))
    sc = torch.where(live[:, None], torch.round(iscale[:, None] * scales).clamp(max=127).to(torch.int32), 0)
    d = (_fp16_round(d_val)[:, None] * sc.to(torch.float32)).reshape(-1)
    L = (_requant(xs, d, None, -32, 31, L - 32) + 32).reshape(nb, QK_K).to(torch.int32)
    L = torch.where(live[:, None], L, 0)
    out = torch.cat([_pack(L & 0xF, 4, 64), _pack(L >> 4, 2, 32), (sc & 0xFF).to(torch.uint8),
                     _fp16_bytes(d_val)], dim=1)
    return out


quantize_q2_k, quantize_q3_k, quantize_q4_k, quantize_q5_k, quantize_q6_k = _q2_k, _q3_k, _q4_k, _q5_k, _q6_k
