"""Triton kernels of the quantized ops: dequantize, get_rows, mul_mat, mul_mat_id, quantize_q8_1.

Every kernel reads packed weights through :func:`.formats.unpack_at`, generic over the format
(a ``tl.constexpr`` ggml type id); nothing here knows any block layout. The Python wrappers
have the signatures of the ``hanzo`` ops (docs/ARCHITECTURE.md) and are what
``hanzo_torch.backends.triton`` registers for device type ``"cuda"`` (CUDA and ROCm).

Contractions (``docs/DESIGN.md`` section 5):
- decode mat-vec (``M <= MATVEC_MAX_M``): each program owns ``BN`` weight rows and streams them
  once over K, unpacking to float32 and FMA-ing against all M activation rows, so the weight
  bytes are read once per op whatever M is. M == 1 uses the grouped form of the format
  (``w = scale * code + offset`` per group of 8-32 values, :data:`.formats.GROUP_LEN`): scales
  are read once per group and each value costs one code load and one FMA (4x fewer global
  loads than the per-value rules for Q4_K in the sm_90 PTX). The activation is read as-is
  (not re-quantized per block: folding the activation quantization into every mat-vec block
  cost -22% in a bandwidth-bound kernel). The next step, an int8 dot against q8_1, must
  quantize the activation once per op with :func:`quantize_q8_1` and pass the q8_1 rows in;
  the grouped form is already its shape (scale * dot(code, q) * d8 + offset * s8).
  That path is :func:`_matvec_q8_kernel`, chosen per format by :data:`DECODE_PATH`.
- prefill GEMM: 2-D tiles, weight tile unpacked to the activation's dtype (bf16/f16 on tensor
  cores, f32 in IEEE) and fed to ``tl.dot``; each weight tile is decoded once per BM rows of
  activations (the naive tensor-core prefill that re-decoded per tiny tile was 0.26x of int8).
- mul_mat_id: expert ids are read on the device. Decode: one launch over all routed slots.
  Prefill: slots are grouped by expert on the device (argsort + per-expert padding to BM, no
  host sync) so each expert's weight is streamed once per BM tokens (2.58x measured).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ...constants import Q8_1_BLOCK, Q8_1_BYTES
from .formats import GROUP_LEN, _name, format_info, format_table, group_code, group_params, unpack_at

_Q8_1_QK = tl.constexpr(Q8_1_BLOCK)  # the kernels' view of the q8_1 block (values, bytes)
_Q8_1_TS = tl.constexpr(Q8_1_BYTES)

MATVEC_MAX_M = 8
"""Largest number of activation rows that takes the mat-vec path (decode); above: tiled GEMM.
M <= 8 (decode batch sizes); retune on a GPU with benchmarks/triton_gpu_check.py."""

_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _check_float(x: torch.Tensor, op: str) -> None:
    if x.dtype not in _DOT_DTYPES:
        raise ValueError(f"{op}: activations must be float32/bfloat16/float16, got {x.dtype}")


def _check_packed(w: torch.Tensor, op: str) -> None:
    if w.dtype != torch.uint8:
        raise ValueError(f"{op}: packed weight must be uint8, got {w.dtype}")


def _row_length(rb: int, qk: int, ts: int, qtype: str, op: str) -> int:
    if rb % ts:
        raise ValueError(f"{op}: {qtype} row of {rb} bytes is not a whole number of {ts}-byte blocks")
    return rb // ts * qk


# ---------------------------------------------------------------------------------------------
# dequantize / get_rows

@triton.jit
def _dequantize_kernel(src, dst, ids, tab, n_src_rows, K, rb,
                       FMT: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr,
                       GATHER: tl.constexpr, BLOCK: tl.constexpr):
    # One program: BLOCK values of one output row. GATHER: the source row is ids[row] (get_rows).
    r = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = k < K
    if GATHER:
        src_row = tl.load(ids + r).to(tl.int64)
        ok = (src_row >= 0) & (src_row < n_src_rows)
        src_row = tl.where(ok, src_row, 0)
        v = unpack_at(src + src_row * rb, k, k < tl.where(ok, K, 0), tab, FMT, QK, TS)
        v = tl.where(ok, v, float("nan"))  # an out-of-range id gives a NaN row, never a wild read
    else:
        v = unpack_at(src + r * rb, k, m, tab, FMT, QK, TS)
    tl.store(dst + r * K + k, v.to(dst.dtype.element_ty), mask=m)


_DEQUANT_BLOCK = 1024


def dequantize(data: torch.Tensor, qtype: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """Triton ``hanzo::dequantize``: packed ``uint8`` bytes -> ``dtype`` tensor of ``shape``.

    Bit-exact with ``gguf.quants.dequantize`` in float32 (launched without FMA contraction);
    other dtypes are the float32 values rounded to nearest even. Raises ValueError on a format
    without an unpack rule, a bad row length or a byte count that does not match ``shape``.
    """
    fid, qk, ts = format_info(qtype)
    _check_packed(data, "dequantize")
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("dequantize: shape must have at least one dim")
    K = shape[-1]
    if K % qk:
        raise ValueError(f"dequantize: {qtype} row length {K} is not a multiple of the block size {qk}")
    rows = math.prod(shape[:-1])
    rb = K // qk * ts
    if data.numel() != rows * rb:
        raise ValueError(f"dequantize: {qtype} tensor of shape {shape} needs {rows * rb} bytes, got {data.numel()}")
    out = torch.empty(shape, dtype=dtype, device=data.device)
    if out.numel() == 0:
        return out
    data = data.contiguous()
    grid = (rows, triton.cdiv(K, _DEQUANT_BLOCK))
    _dequantize_kernel[grid](data, out, data, format_table(qtype, data.device), rows, K, rb,
                             FMT=fid, QK=qk, TS=ts, GATHER=False, BLOCK=_DEQUANT_BLOCK,
                             enable_fp_fusion=False)
    return out


def get_rows(w: torch.Tensor, ids: torch.Tensor, qtype: str, dtype: torch.dtype) -> torch.Tensor:
    """Triton ``hanzo::get_rows``: rows ``ids`` of packed ``w [V, rb]`` -> ``dtype [..., H]``.

    ``ids`` (any integer dtype and shape) stay on the device; an id outside ``[0, V)`` yields a
    row of NaN (checking on the host would synchronize). Values are bit-exact with dequantize.
    """
    fid, qk, ts = format_info(qtype)
    _check_packed(w, "get_rows")
    if w.dim() != 2:
        raise ValueError(f"get_rows: packed weight must be 2-D [V, row_bytes], got shape {tuple(w.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"get_rows: ids must be an integer tensor, got {ids.dtype}")
    V, rb = w.shape
    H = _row_length(rb, qk, ts, qtype, "get_rows")
    out = torch.empty((*ids.shape, H), dtype=dtype, device=w.device)
    n = ids.numel()
    if n == 0 or H == 0:
        return out
    w = w.contiguous()
    flat = ids.reshape(-1).contiguous()
    grid = (n, triton.cdiv(H, _DEQUANT_BLOCK))
    _dequantize_kernel[grid](w, out, flat, format_table(qtype, w.device), V, H, rb,
                             FMT=fid, QK=qk, TS=ts, GATHER=True, BLOCK=_DEQUANT_BLOCK,
                             enable_fp_fusion=False)
    return out


# ---------------------------------------------------------------------------------------------
# mul_mat: decode mat-vec and prefill GEMM

@triton.jit
def _matvec_kernel(x, w, y, tab, ids, M, N, K, rb, x_div, n_experts,
                   FMT: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr,
                   INDEXED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # y[m, n] = sum_k x[m, k] * W[n, k] for BN rows n and all (<= BM) rows m.
    # INDEXED (mul_mat_id decode): program_id(1) is a routed slot s; the weight is expert
    # ids[s] of w [E, N, rb], the activation row is x[s // x_div], and M == 1.
    pid_n = tl.program_id(0)
    n = pid_n * BN + tl.arange(0, BN)
    nm = n < N
    mm = tl.arange(0, BM)
    if INDEXED:
        s = tl.program_id(1).to(tl.int64)
        e = tl.load(ids + s).to(tl.int64)
        ok = (e >= 0) & (e < n_experts)
        nm = n < tl.where(ok, N, 0)  # a bad id reads nothing
        w = w + tl.where(ok, e, 0) * N * rb
        x = x + (s // x_div) * K
        y = y + s * N
    rows = w + n.to(tl.int64)[:, None] * rb                      # [BN, 1]
    acc = tl.zeros((BM, BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        wt = unpack_at(rows, k[None, :], nm[:, None] & km[None, :], tab, FMT, QK, TS)   # [BN, BK]
        xt = tl.load(x + mm[:, None].to(tl.int64) * K + k[None, :],
                     mask=(mm[:, None] < M) & km[None, :], other=0.0).to(tl.float32)    # [BM, BK]
        acc += xt[:, None, :] * wt[None, :, :]
    out = tl.sum(acc, axis=2)
    if INDEXED:
        out = tl.where(ok, out, float("nan"))  # out-of-range expert id: NaN row, no wild read
    tl.store(y + mm[:, None].to(tl.int64) * N + n[None, :], out.to(y.dtype.element_ty),
             mask=(mm[:, None] < M) & (n[None, :] < N))


@triton.jit
def _matvec_grouped_kernel(x, w, y, tab, ids, N, K, rb, x_div, n_experts,
                           FMT: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, GL: tl.constexpr,
                           INDEXED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # Decode (one activation row) through the grouped form w = scale * code + offset: each
    # group of GL values contributes scale * dot(x, code) + offset * sum(x), so a block's scales
    # are read once per group, not once per value (formats.GROUP_LEN). INDEXED as in
    # _matvec_kernel. The activation row is read once per K tile, as given: no per-block
    # re-quantization (DESIGN section 5: folding it into every block cost -22%).
    G: tl.constexpr = BK // GL
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < N
    if INDEXED:
        s = tl.program_id(1).to(tl.int64)
        e = tl.load(ids + s).to(tl.int64)
        ok = (e >= 0) & (e < n_experts)
        nm = n < tl.where(ok, N, 0)
        w = w + tl.where(ok, e, 0) * N * rb
        x = x + (s // x_div) * K
        y = y + s * N
    rows = w + n.to(tl.int64) * rb                                   # [BN]
    gi = tl.arange(0, G)
    li = tl.arange(0, GL)
    acc = tl.zeros((BN, G, 1), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kg = k0 + gi * GL                                            # first column of each group
        gm = kg < K                                                  # K is a multiple of QK >= GL
        bp = rows[:, None, None] + ((kg // QK) * TS)[None, :, None]  # [BN, G, 1] block pointers
        jg = (kg % QK)[None, :, None]
        m3 = nm[:, None, None] & gm[None, :, None]
        scale, off, aux = group_params(bp, jg // GL, m3, tab, FMT)   # [BN, G, 1]
        code = group_code(bp, jg + li[None, None, :], m3, tab, aux, FMT)  # [BN, G, GL]
        xt = tl.load(x + kg[:, None] + li[None, :], mask=gm[:, None], other=0.0).to(tl.float32)  # [G, GL]
        dot = tl.sum(code * xt[None, :, :], axis=2, keep_dims=True)
        xs = tl.sum(xt, axis=1, keep_dims=True)                      # [G, 1]
        acc += scale * dot + off * xs[None, :, :]
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if INDEXED:
        out = tl.where(ok, out, float("nan"))
    tl.store(y + n, out.to(y.dtype.element_ty), mask=n < N)


@triton.jit
def _matvec_q8_kernel(xq, w, y, tab, ids, N, K, rb, x_div, n_experts,
                      FMT: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, GL: tl.constexpr,
                      INDEXED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # Decode (one activation row) with integer dot products against the q8_1 activation xq
    # ([rows, K/32 * 36] bytes, quantized once per op by the wrapper). Per group of GL values:
    #   sum_j w_j x_j = scale * d8 * dot(code, q) + offset * d8 * sum(q)
    # (the offset term of Q4_1/Q5_1/Q2_K/Q4_K/Q5_K/IQ1 through the integer sum of q, never a
    # per-value float add). code and q are small integers, the dot and sum are exact in int32.
    # Per-group float terms are accumulated per (row, group lane) in K order and the G lanes
    # are added in lane order at the end, so the result is fixed by the inputs
    # (tests: integer reference matvec_q8_1_reference; launched without FMA contraction).
    G: tl.constexpr = BK // GL
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < N
    xrb = (K // _Q8_1_QK) * _Q8_1_TS
    if INDEXED:
        s = tl.program_id(1).to(tl.int64)
        e = tl.load(ids + s).to(tl.int64)
        ok = (e >= 0) & (e < n_experts)
        nm = n < tl.where(ok, N, 0)
        w = w + tl.where(ok, e, 0) * N * rb
        xq = xq + (s // x_div) * xrb
        y = y + s * N
    rows = w + n.to(tl.int64) * rb                                   # [BN]
    gi = tl.arange(0, G)
    li = tl.arange(0, GL)
    acc = tl.zeros((BN, G), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kg = k0 + gi * GL                                            # [G] first column of each group
        gm = kg < K
        bp = rows[:, None, None] + ((kg // QK) * TS)[None, :, None]  # [BN, G, 1]
        jg = (kg % QK)[None, :, None]
        m3 = nm[:, None, None] & gm[None, :, None]
        scale, off, aux = group_params(bp, jg // GL, m3, tab, FMT)   # [BN, G, 1]
        code = group_code(bp, jg + li[None, None, :], m3, tab, aux, FMT).to(tl.int32)  # [BN, G, GL]
        xb = xq + (kg // _Q8_1_QK) * _Q8_1_TS                                   # [G] q8_1 block of each group
        d8 = _f16_le(xb, gm)                                         # [G]
        q = tl.load(xb[:, None] + 4 + (kg % 32)[:, None] + li[None, :], mask=gm[:, None],
                    other=0).to(tl.int8, bitcast=True).to(tl.int32)  # [G, GL]
        idot = tl.sum(code * q[None, :, :], axis=2)                  # [BN, G] exact
        isum = tl.sum(q, axis=1)                                     # [G] exact
        t_dot = tl.sum(scale, axis=2) * (d8[None, :] * idot.to(tl.float32))
        t_off = tl.sum(off, axis=2) * (d8 * isum.to(tl.float32))[None, :]
        acc += t_dot + t_off
    out = tl.zeros((BN,), dtype=tl.float32)
    for g in tl.static_range(G):  # lanes in order (a masked sum picks one lane exactly)
        out += tl.sum(tl.where(gi[None, :] == g, acc, 0.0), axis=1)
    if INDEXED:
        out = tl.where(ok, out, float("nan"))
    tl.store(y + n, out.to(y.dtype.element_ty), mask=n < N)


@triton.jit
def _f16_le(p, m):
    # little-endian fp16 at byte pointer p -> float32
    h = tl.load(p, mask=m, other=0).to(tl.int32) | (tl.load(p + 1, mask=m, other=0).to(tl.int32) << 8)
    return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _group_decompose_kernel(w, tab, scale_out, off_out, code_out, K, rb,
                            FMT: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, GL: tl.constexpr,
                            NG: tl.constexpr):
    # One program per row: the grouped form (scale, offset, GL codes per group) of its K/GL
    # groups, read exactly as the mat-vec kernels read them (test support for the integer
    # reference). NG: K/GL rounded up to a power of two.
    r = tl.program_id(0).to(tl.int64)
    ng = K // GL
    gi = tl.arange(0, NG)
    gm = gi < ng
    kg = gi * GL                                                       # [NG]
    bp = (w + r * rb + (kg // QK) * TS)[:, None]                       # [NG, 1]
    m = gm[:, None]
    scale, off, aux = group_params(bp, ((kg % QK) // GL)[:, None], m, tab, FMT)
    code = group_code(bp, (kg % QK)[:, None] + tl.arange(0, GL)[None, :], m, tab, aux, FMT)  # [NG, GL]
    tl.store(scale_out + r * ng + gi[:, None], scale, mask=m)
    tl.store(off_out + r * ng + gi[:, None], off, mask=m)
    tl.store(code_out + r * K + kg[:, None] + tl.arange(0, GL)[None, :], code, mask=m)


@triton.jit
def _gemm_kernel(x, w, y, tab, rows_idx, tile_expert, M, N, K, rb, x_div, n_experts,
                 FMT: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, DOT: tl.constexpr,
                 PREC: tl.constexpr, GROUPED: tl.constexpr, GL: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    # Y[BM, BN] tiles of x @ W^T. GROUPED (mul_mat_id prefill): tile t holds the BM slots
    # rows_idx[t*BM : (t+1)*BM] (-1 = padding), all routed to expert tile_expert[t].
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    if GROUPED:
        pid_m = pid // n_n
        pid_n = pid % n_n
    else:
        # grouped launch order: GROUP_M row tiles share each weight tile while it is in L2
        width = GROUP_M * n_n
        first_m = (pid // width) * GROUP_M
        gm = tl.minimum(n_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % gm
        pid_n = (pid % width) // gm
    r = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    if GROUPED:
        e = tl.load(tile_expert + pid_m).to(tl.int64)
        if e >= n_experts:
            return  # tile past the last expert's padded group
        slot = tl.load(rows_idx + r.to(tl.int64), mask=r < M, other=-1).to(tl.int64)
        rm = slot >= 0
        xrow = tl.where(rm, slot // x_div, 0)
        yrow = tl.where(rm, slot, 0)
        w = w + e * N * rb
    else:
        rm = r < M
        xrow = r.to(tl.int64)
        yrow = r.to(tl.int64)
    nm = n < N
    wrows = w + n.to(tl.int64)[None, :] * rb                           # [1, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        xt = tl.load(x + xrow[:, None] * K + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        if GL > 0:
            # grouped form: the scales of each group of GL values are read once per tile
            G: tl.constexpr = BK // GL
            kg = k0 + tl.arange(0, G) * GL                                  # [G] group starts
            bp = wrows[None, :, :] + ((kg // QK) * TS)[:, None, None]      # [G, 1, BN]
            jg = (kg % QK)[:, None, None]
            m3 = (kg < K)[:, None, None] & nm[None, None, :]
            scale, off, aux = group_params(bp, jg // GL, m3, tab, FMT)
            code = group_code(bp, jg + tl.arange(0, GL)[None, :, None], m3, tab, aux, FMT)  # [G, GL, BN]
            wt = tl.reshape(scale * code + off, (BK, BN))
        else:
            wt = unpack_at(wrows, k[:, None], km[:, None] & nm[None, :], tab, FMT, QK, TS)   # [BK, BN]
        acc = tl.dot(xt.to(DOT), wt.to(DOT), acc, input_precision=PREC)
    tl.store(y + yrow[:, None] * N + n[None, :], acc.to(y.dtype.element_ty),
             mask=rm[:, None] & nm[None, :])


# Launch configurations. Sized with the sm_90 AOT compile of every format (register count and
# spills from cuobjdump, see benchmarks/triton_gpu_check.py --aot): about 8 unpacked weight
# values per thread keep the heaviest unpack rules (IQ*, K-quants) spill-free. Speed is to be
# tuned on a GPU with benchmarks/triton_gpu_check.py.
MATVEC_WARPS = 8
GEMM_WARPS = 8


def _matvec_config(M: int) -> tuple[int, int, int]:
    # (BM, BN, BK): the weight tile is BN x BK = 2048 values (8 per thread at 8 warps); the
    # float32 accumulator BM x BN x BK is reduced over K once, after the loop.
    BM = triton.next_power_of_2(max(M, 1))
    BK = 256 if BM == 1 else 128 if BM <= 2 else 64
    BN = max(2048 // (BM * BK), 1) if BM > 1 else 8
    return BM, BN, BK


GROUPED_BN, GROUPED_BK = 8, 256
"""Tile of the grouped decode mat-vec: 8 weight rows x 256 columns (2048 values, 8 per thread)."""


GROUPED = os.environ.get("HANZO_TRITON_GROUPED", "1") != "0"
"""Whether the decode mat-vec uses the grouped rules where a format has one (False: the element
rules, an A/B of the two paths). ``HANZO_TRITON_GROUPED=0`` at import; assign in process."""

DECODE_OVERRIDE = os.environ.get("HANZO_TRITON_DECODE", "")
"""``"int8"`` or ``"f32"``: every decode mat-vec takes that path instead of :data:`DECODE_PATH`'s
(an A/B); ``""``: the table. ``HANZO_TRITON_DECODE`` at import; assign in process."""


def _group_len(qtype: str) -> int:
    # values per scale group when the format has a grouped rule (else 0: element rules)
    if not GROUPED:
        return 0
    return GROUP_LEN.get(_name(qtype), 0)


# Decode mat-vec path per format (M == 1 and the mul_mat_id decode): "int8" quantizes the
# activation to q8_1 once per op and runs _matvec_q8_kernel (integer dots); "f32" runs the grouped
# float kernel on the activation as given. Not yet measured on a GPU: the i-quants start on int8
# (their decode is compute-bound on the codebook decode, DESIGN section 5), the bandwidth-bound
# formats on f32. benchmarks/gpu_check.py measures both paths per format and prints which is
# faster; this table is the one place to change. :data:`DECODE_OVERRIDE` (HANZO_TRITON_DECODE=int8|f32) overrides it (A/B).
DECODE_PATH: dict[str, str] = {
    **{n: "f32" for n in GROUP_LEN},
    **{n: "int8" for n in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                           "IQ4_NL", "IQ4_XS")},
}

Q8_BN, Q8_BK = 8, 256
"""Tile of the int8 decode mat-vec: 8 weight rows x 256 columns."""


def _decode_int8(qtype: str) -> bool:
    # int8 decode needs the grouped rule (groups of 8-32 values inside one 32-value q8_1 block)
    name = _name(qtype)
    if not _group_len(qtype):
        return False
    force = DECODE_OVERRIDE
    if force in ("int8", "f32"):
        return force == "int8"
    return DECODE_PATH.get(name, "f32") == "int8"


def group_decompose(w: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grouped form of packed ``w uint8 [N, rb]`` as the mat-vec kernels read it.

    Returns ``(scale, offset, code)``: float32 ``[N, K/GL]``, ``[N, K/GL]`` and ``[N, K]`` with
    ``W[n, k] = scale[n, k // GL] * code[n, k] + offset[n, k // GL]`` (``GL`` =
    :data:`.formats.GROUP_LEN`). Test support for the integer reference of the int8 decode.
    Raises ValueError for a format without a grouped rule.
    """
    fid, qk, ts = format_info(qtype)
    gl = GROUP_LEN.get(_name(qtype), 0)
    if not gl:
        raise ValueError(f"group_decompose: {qtype} has no grouped rule")
    _check_packed(w, "group_decompose")
    N, rb = w.shape
    K = _row_length(rb, qk, ts, qtype, "group_decompose")
    scale = torch.empty((N, K // gl), dtype=torch.float32, device=w.device)
    off = torch.empty_like(scale)
    code = torch.empty((N, K), dtype=torch.float32, device=w.device)
    if N and K:
        _group_decompose_kernel[(N,)](w.contiguous(), format_table(qtype, w.device), scale, off, code, K, rb,
                                      FMT=fid, QK=qk, TS=ts, GL=gl, NG=triton.next_power_of_2(K // gl),
                                      enable_fp_fusion=False)
    return scale, off, code


def _gemm_group_len(qtype: str, cfg: dict) -> int:
    # grouped weight-tile unpack when the K tile holds whole groups (GL <= BK)
    gl = _group_len(qtype)
    return gl if gl and cfg["BK"] % gl == 0 else 0


def _gemm_config(M: int, x_dtype: torch.dtype) -> dict:
    BM = 64 if M >= 64 else max(16, triton.next_power_of_2(M))
    return dict(BM=BM, BN=64, BK=32, GROUP_M=8)


def _dot_dtype(dtype: torch.dtype):
    # The Triton CPU interpreter mis-computes tl.dot on bfloat16 operands: under it the tiles
    # are fed as float32 (the GPU path keeps bf16/f16 tensor-core dots).
    if type(_gemm_kernel).__name__ == "InterpretedFunction":
        return tl.float32
    return _DOT_DTYPES[dtype]


def _prec(dtype: torch.dtype) -> str:
    # float32 activations: IEEE products (TF32 would put ~1e-3 relative error on every output).
    return "ieee" if dtype == torch.float32 else "tf32"


def mul_mat(x: torch.Tensor, w: torch.Tensor, qtype: str) -> torch.Tensor:
    """Triton ``hanzo::mul_mat``: ``y = x @ W^T`` with W packed.

    Args:
        x: ``[..., K]`` float32/bfloat16/float16.
        w: ``uint8 [N, row_bytes(K)]`` packed in ``qtype``.
    Returns:
        ``[..., N]`` in ``x.dtype`` (float32 accumulation). M = x.numel() / K rows up to
        :data:`MATVEC_MAX_M` take the mat-vec kernel (M == 1: its grouped form), more the
        tiled GEMM.
    Raises:
        ValueError: dtype, shape or format problems, named.
    """
    fid, qk, ts = format_info(qtype)
    _check_float(x, "mul_mat")
    _check_packed(w, "mul_mat")
    if w.dim() != 2:
        raise ValueError(f"mul_mat: packed weight must be 2-D [N, row_bytes], got shape {tuple(w.shape)}")
    N, rb = w.shape
    K = _row_length(rb, qk, ts, qtype, "mul_mat")
    if x.shape[-1] != K:
        raise ValueError(f"mul_mat: x has {x.shape[-1]} columns but the {qtype} weight rows hold {K} values")
    lead = x.shape[:-1]
    M = math.prod(lead)
    y = torch.empty((*lead, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    x2 = x.reshape(M, K).contiguous()
    w = w.contiguous()
    tab = format_table(qtype, w.device)
    if M == 1 and _decode_int8(qtype):
        xq = quantize_q8_1(x2)  # once per op, shared by every program
        _matvec_q8_kernel[(triton.cdiv(N, Q8_BN), 1)](xq, w, y, tab, xq, N, K, rb, 1, 1,
                                                      FMT=fid, QK=qk, TS=ts, GL=_group_len(qtype), INDEXED=False,
                                                      BN=Q8_BN, BK=Q8_BK, num_warps=MATVEC_WARPS,
                                                      enable_fp_fusion=False)
    elif M == 1 and _group_len(qtype):
        gl = _group_len(qtype)
        _matvec_grouped_kernel[(triton.cdiv(N, GROUPED_BN), 1)](x2, w, y, tab, x2, N, K, rb, 1, 1,
                                                                FMT=fid, QK=qk, TS=ts, GL=gl, INDEXED=False,
                                                                BN=GROUPED_BN, BK=GROUPED_BK, num_warps=MATVEC_WARPS)
    elif M <= MATVEC_MAX_M:
        BM, BN, BK = _matvec_config(M)
        _matvec_kernel[(triton.cdiv(N, BN), 1)](x2, w, y, tab, x2, M, N, K, rb, 1, 1,
                                                FMT=fid, QK=qk, TS=ts, INDEXED=False,
                                                BM=BM, BN=BN, BK=BK, num_warps=MATVEC_WARPS)
    else:
        cfg = _gemm_config(M, x.dtype)
        grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]),)
        _gemm_kernel[grid](x2, w, y, tab, x2, x2, M, N, K, rb, 1, 1,
                           FMT=fid, QK=qk, TS=ts, DOT=_dot_dtype(x.dtype), PREC=_prec(x.dtype),
                           GROUPED=False, GL=_gemm_group_len(qtype, cfg), **cfg, num_warps=GEMM_WARPS,
                           num_stages=3)
    return y


def _group_by_expert(flat_ids: torch.Tensor, n_experts: int, BM: int):
    """Device-side grouping of routed slots by expert (no host synchronization).

    Returns ``(rows_idx, tile_expert, n_tiles)``: ``rows_idx int64 [n_tiles * BM]`` lists the
    slots of each expert padded to a multiple of BM (-1 = padding); ``tile_expert int64
    [n_tiles]`` the expert of each BM-tile (``n_experts`` for tiles past the end). ``n_tiles``
    is the static upper bound ``cdiv(S, BM) + n_experts``. Slots with an id outside
    ``[0, n_experts)`` are left out (their output rows stay NaN).
    """
    S = flat_ids.numel()
    dev = flat_ids.device
    valid = (flat_ids >= 0) & (flat_ids < n_experts)
    e = torch.where(valid, flat_ids, torch.full_like(flat_ids, n_experts))
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, e, torch.ones_like(e))
    counts = counts[:n_experts]
    padded = (counts + BM - 1) // BM * BM
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(e, stable=True)
    e_sorted = e[order]
    rank = torch.arange(S, device=dev) - start.index_select(0, e_sorted.clamp(max=n_experts - 1))
    n_tiles = triton.cdiv(S, BM) + n_experts
    rows_idx = torch.full((n_tiles * BM + 1,), -1, dtype=torch.int64, device=dev)
    dest = torch.where(e_sorted < n_experts,
                       pad_start.index_select(0, e_sorted.clamp(max=n_experts - 1)) + rank,
                       torch.full_like(rank, n_tiles * BM))  # invalid slots -> the spare last entry
    rows_idx.scatter_(0, dest, order)
    tile_start = torch.arange(n_tiles, device=dev, dtype=torch.int64) * BM
    tile_expert = torch.searchsorted(pad_end, tile_start, right=True)
    return rows_idx[: n_tiles * BM], tile_expert, n_tiles


def mul_mat_id(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, qtype: str) -> torch.Tensor:
    """Triton ``hanzo::mul_mat_id``: ``y[t, j] = x[t(, j)] @ W[ids[t, j]]^T``.

    Args:
        x: ``[T, K]`` (shared by the k routed slots) or ``[T, k, K]``; float32/bfloat16/float16.
        w: ``uint8 [E, N, row_bytes(K)]`` stacked experts packed in ``qtype``.
        ids: integer ``[T, k]`` expert ids, read on the device (never synchronized).
    Returns:
        ``[T, k, N]`` in ``x.dtype``. A slot whose id is outside ``[0, E)`` gets a NaN row.
        Decode (T <= MATVEC_MAX_M): one mat-vec launch over all T*k slots; prefill: slots
        grouped by expert on the device and one grouped GEMM launch.
    """
    fid, qk, ts = format_info(qtype)
    _check_float(x, "mul_mat_id")
    _check_packed(w, "mul_mat_id")
    if w.dim() != 3:
        raise ValueError(f"mul_mat_id: packed weight must be 3-D [E, N, row_bytes], got shape {tuple(w.shape)}")
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"mul_mat_id: ids must be an integer [T, k] tensor, got {ids.dtype} {tuple(ids.shape)}")
    E, N, rb = w.shape
    if E == 0:
        raise ValueError("mul_mat_id: the stacked weight has no experts (E = 0)")
    K = _row_length(rb, qk, ts, qtype, "mul_mat_id")
    T, kk = ids.shape
    if x.dim() == 2 and x.shape == (T, K):
        x_div = kk
    elif x.dim() == 3 and x.shape == (T, kk, K):
        x_div = 1
    else:
        raise ValueError(f"mul_mat_id: x must be [T, K] or [T, k, K] = [{T}, ({kk},) {K}], got {tuple(x.shape)}")
    S = T * kk
    xc = x.contiguous()
    w = w.contiguous()
    flat = ids.reshape(-1).contiguous()
    tab = format_table(qtype, w.device)
    if S == 0 or N == 0:
        return torch.empty((T, kk, N), dtype=x.dtype, device=x.device)
    if T <= MATVEC_MAX_M:
        y = torch.empty((T, kk, N), dtype=x.dtype, device=x.device)
        gl = _group_len(qtype)
        if gl and _decode_int8(qtype):
            xq = quantize_q8_1(xc)  # [T(, k), K/32*36]: rows indexed like x
            _matvec_q8_kernel[(triton.cdiv(N, Q8_BN), S)](xq, w, y, tab, flat, N, K, rb, x_div, E,
                                                          FMT=fid, QK=qk, TS=ts, GL=gl, INDEXED=True,
                                                          BN=Q8_BN, BK=Q8_BK, num_warps=MATVEC_WARPS,
                                                          enable_fp_fusion=False)
            return y
        if gl:
            _matvec_grouped_kernel[(triton.cdiv(N, GROUPED_BN), S)](xc, w, y, tab, flat, N, K, rb, x_div, E,
                                                                    FMT=fid, QK=qk, TS=ts, GL=gl, INDEXED=True,
                                                                    BN=GROUPED_BN, BK=GROUPED_BK,
                                                                    num_warps=MATVEC_WARPS)
            return y
        BM, BN, BK = _matvec_config(1)
        _matvec_kernel[(triton.cdiv(N, BN), S)](xc, w, y, tab, flat, 1, N, K, rb, x_div, E,
                                                FMT=fid, QK=qk, TS=ts, INDEXED=True,
                                                BM=BM, BN=BN, BK=BK, num_warps=MATVEC_WARPS)
        return y
    y = torch.full((T, kk, N), float("nan"), dtype=x.dtype, device=x.device)
    cfg = _gemm_config(max(S // max(E, 1), 1), x.dtype)
    rows_idx, tile_expert, n_tiles = _group_by_expert(flat.to(torch.int64), E, cfg["BM"])
    grid = (n_tiles * triton.cdiv(N, cfg["BN"]),)
    _gemm_kernel[grid](xc, w, y, tab, rows_idx, tile_expert, n_tiles * cfg["BM"], N, K, rb, x_div, E,
                       FMT=fid, QK=qk, TS=ts, DOT=_dot_dtype(x.dtype), PREC=_prec(x.dtype),
                       GROUPED=True, GL=_gemm_group_len(qtype, cfg), **cfg, num_warps=GEMM_WARPS,
                       num_stages=3)
    return y


# ---------------------------------------------------------------------------------------------
# quantize_q8_1

_TWO_POW_M49 = tl.constexpr(2.0 ** -49)

@triton.jit
def _round_half_away(v):
    # C roundf (half away from zero) without the double rounding of floor(|v| + 0.5).
    a = tl.abs(v)
    fl = tl.floor(a)
    r = fl + tl.floor(2.0 * (a - fl))
    return tl.where(v < 0, -r, r)


@triton.jit
def _u16_bytes(out, h, m):
    tl.store(out, (h & 0xFF).to(tl.uint8), mask=m)
    tl.store(out + 1, ((h >> 8) & 0xFF).to(tl.uint8), mask=m)


@triton.jit
def _scale_up_100(bits):
    # x * 2^100 from the int32 bits of a float x with |x| < 2^-100, exact with no subnormal
    # operand: a normal x gets 100 added to its exponent, a subnormal one is its mantissa * 2^-49.
    mant = bits & 0x7FFFFF
    sub = mant.to(tl.float32) * _TWO_POW_M49
    sub = tl.where(bits < 0, -sub, sub)
    normal = ((bits >> 23) & 0xFF) != 0
    return tl.where(normal, (bits + tl.where(normal, 100 << 23, 0)).to(tl.float32, bitcast=True), sub)


@triton.jit
def _quantize_q8_1_kernel(x, out, n_blocks, BB: tl.constexpr):
    # ggml block_q8_1 (quantize_row_q8_1_ref in float32): d = amax/127, id = d ? 1/d : 0,
    # q = roundf(x * id) (0 where not finite, clamped to int8), fields fp16(d), fp16(float(sum(q)) * d).
    # Bit-exact with the reference on a device that flushes subnormals or approximates division:
    # both divisions are div_rn; a block with amax < 2^-100 is worked on scaled by 2^100 (exact,
    # through the bits), its possibly subnormal d rounded on the 2^-149 grid in integers, so no
    # float operand or result that matters is subnormal. Such a block stores d = +0 and s = +-0
    # (the sign of sum(q)); one whose d <= 2^-128 (1/d overflows to inf) stores all zeros.
    # Non-finite blocks store the reference's bytes as the CPU computes them: amax inf -> d = inf,
    # q = 0, s = fp16(0 * inf) = the x86 default NaN 0xFE00; a NaN -> d = s = 0x7E00.
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BB + tl.arange(0, BB)
    bm = b < n_blocks
    j = tl.arange(0, 32)
    v = tl.load(x + r * n_blocks * 32 + b[:, None] * 32 + j[None, :], mask=bm[:, None], other=0.0).to(tl.float32)
    bits = v.to(tl.int32, bitcast=True)
    amax_b = tl.max(bits & 0x7FFFFFFF, axis=1)       # integer max: NaN above inf, no float compare
    is_nan = amax_b > 0x7F800000
    is_inf = amax_b == 0x7F800000
    tiny = amax_b < (27 << 23)                       # amax < 2^-100
    # amax = M * 2^-149 in a tiny block; d is subnormal when M < 127 * 2^23, then d = D * 2^-149
    # with D = M / 127 rounded to nearest (127 is odd: no ties)
    e_a = (amax_b >> 23) & 0xFF
    mant_a = (amax_b & 0x7FFFFF).to(tl.int64)
    shift = tl.minimum(tl.maximum(e_a - 1, 0), 40).to(tl.int64)
    M = tl.where(e_a == 0, mant_a, (mant_a | 0x800000) << shift)
    sub_d = tiny & (M < 127 * 0x800000)
    D = (M + 63) // 127
    zero = sub_d & (D <= (1 << 21))                  # d <= 2^-128 (d = 0 included): 1/d is inf or unused
    special = is_nan | is_inf | zero
    amax_s = tl.where(tiny, _scale_up_100(tl.where(tiny, amax_b, 0)), amax_b.to(tl.float32, bitcast=True))
    amax_s = tl.where(special, 1.0, amax_s)
    d_s = tl.where(sub_d, D.to(tl.float32) * _TWO_POW_M49, tl.math.div_rn(amax_s, 127.0))
    id_s = tl.math.div_rn(tl.full((BB,), 1.0, tl.float32), tl.where(d_s == 0.0, 1.0, d_s))
    xs = tl.where(tiny[:, None], _scale_up_100(tl.where(tiny[:, None], bits, 0)), v)
    xs = tl.where(special[:, None], 0.0, xs)
    q = _round_half_away(xs * id_s[:, None])
    q = tl.minimum(tl.maximum(q, -128.0), 127.0)
    q = tl.where(special[:, None], 0.0, q)
    s = tl.sum(q, axis=1)
    d_h = d_s.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    s_h = (s * d_s).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    d_h = tl.where(tiny, 0, d_h)
    s_h = tl.where(tiny, tl.where(s < 0.0, 0x8000, 0), s_h)
    d_h = tl.where(is_inf, 0x7C00, tl.where(is_nan, 0x7E00, d_h))  # a zero block is tiny: q = s = 0
    s_h = tl.where(is_inf, 0xFE00, tl.where(is_nan, 0x7E00, s_h))
    blk = out + r * n_blocks * _Q8_1_TS + b * _Q8_1_TS
    _u16_bytes(blk, d_h, bm)
    _u16_bytes(blk + 2, s_h, bm)
    tl.store(blk[:, None] + 4 + j[None, :], q.to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True), mask=bm[:, None])


def quantize_q8_1(x: torch.Tensor) -> torch.Tensor:
    """Triton ``hanzo::quantize_q8_1``: ``x [..., K]`` (K % 32 == 0) -> ``uint8 [..., K/32*36]``.

    ggml ``block_q8_1`` layout (fp16 d, fp16 d*sum(q), 32 int8 q), byte-identical to the
    reference :func:`hanzo_torch.formats.q8_1.quantize_q8_1` (ggml's ``quantize_row_q8_1_ref``:
    d = amax/127, q = roundf(x/d)), tiny, subnormal and non-finite blocks included. Meant to run
    once per op on the activation that several int8-dot mat-vecs share (DESIGN: never once per
    weight block).

    Raises:
        ValueError: ``x`` is not float32/bfloat16/float16, is 0-dimensional, or its last dim is not a multiple of 32.
    """
    _check_float(x, "quantize_q8_1")
    if x.dim() == 0 or x.shape[-1] % 32:
        raise ValueError(f"quantize_q8_1: last dim must be a multiple of 32, got shape {tuple(x.shape)}")
    K = x.shape[-1]
    R = math.prod(x.shape[:-1])
    nb = K // Q8_1_BLOCK
    out = torch.empty((*x.shape[:-1], nb * Q8_1_BYTES), dtype=torch.uint8, device=x.device)
    if R == 0 or nb == 0:
        return out
    BB = 8
    _quantize_q8_1_kernel[(R, triton.cdiv(nb, BB))](x.reshape(R, K).contiguous(), out, nb, BB=BB,
                                                     enable_fp_fusion=False)
    return out
