"""Triton kernel of ``hanzo::swiglu_mul_mat``: ``silu(x @ Wg^T) * (x @ Wu^T)``, gate and up fused.

Decode (``M <= quant.MATVEC_MAX_M`` activation rows): one launch streams the BN rows of BOTH
packed weights a program owns, reading each activation tile once for the two products, and
applies the ``silu(gate) * up`` epilogue on the float32 accumulators before one store
(``docs/DESIGN.md`` section 5: gate+up sharing one activation). The two weights may be in
different ggml formats (Q4_K gate, Q6_K up); each is read through the format layer
(:mod:`.formats`): M == 1 with grouped rules for both formats uses the grouped form (scales once
per group, as :func:`.quant._matvec_grouped_kernel`), otherwise the per-value rules (as
:func:`.quant._matvec_kernel`). Prefill (M > 8): the two tiled GEMMs of :func:`.quant.mul_mat`
and the :func:`.fused.swiglu` kernel (the weight tiles dominate there; nothing to share).

Numerics: float32 accumulation; unlike the unfused composition, the gate and up products are
not rounded to ``x.dtype`` before the epilogue (only the result is), so bf16/f16 outputs agree
with the reference to about one ulp of ``x.dtype``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .formats import format_info, format_table, group_code, group_params, unpack_at
from .fused import swiglu as _swiglu
from .quant import (GROUPED_BK, GROUPED_BN, MATVEC_MAX_M, MATVEC_WARPS, _check_float, _check_packed,
                    _group_len, _matvec_config, _row_length, mul_mat)

_OP = "swiglu_mul_mat"


@triton.jit
def _silu_mul(g, u):
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _swiglu_matvec_kernel(x, wg, wu, y, tab_g, tab_u, M, N, K, rb_g, rb_u,
                          FMT_G: tl.constexpr, QK_G: tl.constexpr, TS_G: tl.constexpr,
                          FMT_U: tl.constexpr, QK_U: tl.constexpr, TS_U: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # per-value rules: y[m, n] = silu(sum_k x[m,k] Wg[n,k]) * sum_k x[m,k] Wu[n,k], all (<= BM) m
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < N
    mm = tl.arange(0, BM)
    rows_g = wg + n.to(tl.int64)[:, None] * rb_g                  # [BN, 1]
    rows_u = wu + n.to(tl.int64)[:, None] * rb_u
    acc_g = tl.zeros((BM, BN, BK), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        xt = tl.load(x + mm[:, None].to(tl.int64) * K + k[None, :],
                     mask=(mm[:, None] < M) & km[None, :], other=0.0).to(tl.float32)[:, None, :]  # [BM, 1, BK]
        wm = nm[:, None] & km[None, :]
        acc_g += xt * unpack_at(rows_g, k[None, :], wm, tab_g, FMT_G, QK_G, TS_G)[None, :, :]
        acc_u += xt * unpack_at(rows_u, k[None, :], wm, tab_u, FMT_U, QK_U, TS_U)[None, :, :]
    out = _silu_mul(tl.sum(acc_g, axis=2), tl.sum(acc_u, axis=2))
    tl.store(y + mm[:, None].to(tl.int64) * N + n[None, :], out.to(y.dtype.element_ty),
             mask=(mm[:, None] < M) & nm[None, :])


@triton.jit
def _grouped_dot(rows, nm, k0, K, xk, tab, FMT: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr,
                 GL: tl.constexpr, BK: tl.constexpr):
    # sum over one BK tile of x[k] * W[n, k] for the BN rows at byte pointers ``rows`` through
    # the grouped form (scale * dot(code, x) + offset * sum(x) per group of GL values); ``xk``
    # is the float32 activation tile [BK], shared by both weights.
    G: tl.constexpr = BK // GL
    kg = k0 + tl.arange(0, G) * GL                                     # first column of each group
    gm = kg < K
    bp = rows[:, None, None] + ((kg // QK) * TS)[None, :, None]        # [BN, G, 1]
    jg = (kg % QK)[None, :, None]
    m3 = nm[:, None, None] & gm[None, :, None]
    scale, off, aux = group_params(bp, jg // GL, m3, tab, FMT)
    code = group_code(bp, jg + tl.arange(0, GL)[None, None, :], m3, tab, aux, FMT)  # [BN, G, GL]
    xt = tl.reshape(xk, (G, GL))
    dot = tl.sum(code * xt[None, :, :], axis=2, keep_dims=True)
    xs = tl.sum(xt, axis=1, keep_dims=True)
    return tl.sum(tl.sum(scale * dot + off * xs[None, :, :], axis=2), axis=1)   # [BN]


@triton.jit
def _swiglu_matvec_grouped_kernel(x, wg, wu, y, tab_g, tab_u, N, K, rb_g, rb_u,
                                  FMT_G: tl.constexpr, QK_G: tl.constexpr, TS_G: tl.constexpr,
                                  GL_G: tl.constexpr,
                                  FMT_U: tl.constexpr, QK_U: tl.constexpr, TS_U: tl.constexpr,
                                  GL_U: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # one activation row; each K tile of x is loaded once and dotted with both weights
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < N
    rows_g = wg + n.to(tl.int64) * rb_g
    rows_u = wu + n.to(tl.int64) * rb_u
    acc_g = tl.zeros((BN,), dtype=tl.float32)
    acc_u = tl.zeros((BN,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        xk = tl.load(x + k, mask=k < K, other=0.0).to(tl.float32)
        acc_g += _grouped_dot(rows_g, nm, k0, K, xk, tab_g, FMT_G, QK_G, TS_G, GL_G, BK)
        acc_u += _grouped_dot(rows_u, nm, k0, K, xk, tab_u, FMT_U, QK_U, TS_U, GL_U, BK)
    tl.store(y + n, _silu_mul(acc_g, acc_u).to(y.dtype.element_ty), mask=nm)


def swiglu_mul_mat(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   qtype_gate: str, qtype_up: str) -> torch.Tensor:
    """Triton ``hanzo::swiglu_mul_mat``: ``silu(x @ Wg^T) * (x @ Wu^T)``.

    Args:
        x: ``[..., K]`` float32/bfloat16/float16.
        w_gate, w_up: ``uint8 [F, row_bytes(K)]`` packed in ``qtype_gate`` / ``qtype_up``.
    Returns:
        ``[..., F]`` in ``x.dtype`` (float32 accumulation and epilogue). M = x.numel() / K up to
        :data:`.quant.MATVEC_MAX_M` rows: one fused mat-vec launch; more: two GEMMs + swiglu.
    Raises:
        ValueError: dtype, shape or format problems (an unsupported format, rows that do not
            hold K values, gate and up widths that differ), named.
    """
    fid_g, qk_g, ts_g = format_info(qtype_gate)
    fid_u, qk_u, ts_u = format_info(qtype_up)
    _check_float(x, _OP)
    for w in (w_gate, w_up):
        _check_packed(w, _OP)
        if w.dim() != 2:
            raise ValueError(f"{_OP}: packed weights must be 2-D [F, row_bytes], got shape {tuple(w.shape)}")
    N, rb_g = w_gate.shape
    if w_up.shape[0] != N:
        raise ValueError(f"{_OP}: w_gate has {N} rows (F) but w_up has {w_up.shape[0]}")
    rb_u = w_up.shape[1]
    K = x.shape[-1]
    for rb, qk, ts, qtype, what in ((rb_g, qk_g, ts_g, qtype_gate, "w_gate"), (rb_u, qk_u, ts_u, qtype_up, "w_up")):
        if _row_length(rb, qk, ts, qtype, _OP) != K:
            raise ValueError(f"{_OP}: x has {K} columns but the {qtype} rows of {what} hold "
                             f"{_row_length(rb, qk, ts, qtype, _OP)} values")
    lead = x.shape[:-1]
    M = math.prod(lead)
    if M > MATVEC_MAX_M:
        return _swiglu(mul_mat(x, w_gate, qtype_gate), mul_mat(x, w_up, qtype_up))
    y = torch.empty((*lead, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    x2 = x.reshape(M, K).contiguous()
    w_gate, w_up = w_gate.contiguous(), w_up.contiguous()
    tab_g, tab_u = format_table(qtype_gate, w_gate.device), format_table(qtype_up, w_up.device)
    gl_g, gl_u = _group_len(qtype_gate), _group_len(qtype_up)
    if M == 1 and gl_g and gl_u:
        _swiglu_matvec_grouped_kernel[(triton.cdiv(N, GROUPED_BN),)](
            x2, w_gate, w_up, y, tab_g, tab_u, N, K, rb_g, rb_u,
            FMT_G=fid_g, QK_G=qk_g, TS_G=ts_g, GL_G=gl_g, FMT_U=fid_u, QK_U=qk_u, TS_U=ts_u, GL_U=gl_u,
            BN=GROUPED_BN, BK=GROUPED_BK, num_warps=MATVEC_WARPS)
    else:
        BM, BN, BK = _matvec_config(M)
        # two weight tiles per step: halve BN to keep the accumulators of mul_mat's tile size
        BN = max(BN // 2, 1)
        _swiglu_matvec_kernel[(triton.cdiv(N, BN),)](
            x2, w_gate, w_up, y, tab_g, tab_u, M, N, K, rb_g, rb_u,
            FMT_G=fid_g, QK_G=qk_g, TS_G=ts_g, FMT_U=fid_u, QK_U=qk_u, TS_U=ts_u,
            BM=BM, BN=BN, BK=BK, num_warps=MATVEC_WARPS)
    return y
