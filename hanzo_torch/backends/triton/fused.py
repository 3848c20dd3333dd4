"""Triton kernels of the fused ops: rms_norm, add_rms_norm, swiglu, qk_norm_rope, moe_route,
kv_cache_write, qk_norm_rope_kv_write (the two before it, composed), attention.

The wrappers have the signatures of the ``hanzo`` ops (docs/ARCHITECTURE.md, references in
:mod:`hanzo_torch.ops.fused`) and are registered for device type ``"cuda"`` by
:mod:`hanzo_torch.backends.triton`. Statistics, softmax, RoPE angles and P*V are float32 as in the
references. Nothing here synchronizes with the host: positions and routing ids are read on the
device (``docs/DESIGN.md`` section 4), so every kernel can be captured in a CUDA/HIP graph.
The fusions are the ones measured to pay (DESIGN section 5): add+RMSNorm, q/k-norm+RoPE, one-pass
MoE routing.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _interpreting(kernel) -> bool:
    # The Triton CPU interpreter mis-computes tl.dot on bfloat16 operands; under it we feed
    # float32 operands instead (the GPU path keeps bf16/f16 tensor-core dots).
    return type(kernel).__name__ == "InterpretedFunction"


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous() if x.dim() else x.reshape(1, 1)


# ---------------------------------------------------------------------------------------------
# rms_norm, add_rms_norm

@triton.jit
def _rms_norm_kernel(x, r, w, out, s_out, H, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    # One row of H values. ADD: s = x + r (rounded to x's dtype, stored), then the norm of s.
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        h = h0 + tl.arange(0, BLOCK)
        m = h < H
        v = tl.load(x + row * H + h, mask=m, other=0.0)
        if ADD:
            v = (v.to(tl.float32) + tl.load(r + row * H + h, mask=m, other=0.0).to(tl.float32)).to(v.dtype)
            tl.store(s_out + row * H + h, v, mask=m)
        v = v.to(tl.float32)
        acc += v * v
    inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
    for h0 in range(0, H, BLOCK):
        h = h0 + tl.arange(0, BLOCK)
        m = h < H
        if ADD:
            v = tl.load(s_out + row * H + h, mask=m, other=0.0).to(tl.float32)
        else:
            v = tl.load(x + row * H + h, mask=m, other=0.0).to(tl.float32)
        g = tl.load(w + h, mask=m, other=0.0).to(tl.float32)
        tl.store(out + row * H + h, (v * inv * g).to(out.dtype.element_ty), mask=m)


def _norm_block(H: int) -> int:
    return min(triton.next_power_of_2(max(H, 1)), 4096)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton ``hanzo::rms_norm``: ``x [..., H]``, ``w [H]`` -> ``[..., H]`` in x.dtype (f32 stats)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return out
    x2 = _rows(x)
    H = x2.shape[1]
    _rms_norm_kernel[(x2.shape[0],)](x2, x2, w.contiguous(), out, out, H, float(eps),
                                     ADD=False, BLOCK=_norm_block(H), num_warps=4)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float):
    """Triton ``hanzo::add_rms_norm``: ``s = x + residual``; returns ``(rms_norm(s) * w, s)``."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    s = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return out, s
    x2, r2 = _rows(x), _rows(residual)
    H = x2.shape[1]
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, w.contiguous(), out, s, H, float(eps),
                                     ADD=True, BLOCK=_norm_block(H), num_warps=4)
    return out, s


# ---------------------------------------------------------------------------------------------
# swiglu

@triton.jit
def _swiglu_kernel(g, u, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    a = tl.load(g + i, mask=m, other=0.0).to(tl.float32)
    b = tl.load(u + i, mask=m, other=0.0).to(tl.float32)
    tl.store(out + i, (a / (1.0 + tl.exp(-a)) * b).to(out.dtype.element_ty), mask=m)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton ``hanzo::swiglu``: ``silu(gate) * up`` elementwise in float32, result in gate.dtype."""
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    n = gate.numel()
    if n:
        BLOCK = 1024
        _swiglu_kernel[(triton.cdiv(n, BLOCK),)](gate.contiguous(), up.contiguous(), out, n, BLOCK=BLOCK)
    return out


# ---------------------------------------------------------------------------------------------
# qk_norm_rope

@triton.jit
def _qk_norm_rope_kernel(q, k, qo, ko, qw, kw, pos, inv_freq, T, Hq, Hk, eps,
                         NORM: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr):
    # program (b*T + t, head): heads [0, Hq) are q's, [Hq, Hq + Hk) k's. Contiguous [B, T, H, D].
    bt = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1)
    i = tl.arange(0, BH)
    m = i < HALF
    is_q = hd < Hq
    D = 2 * HALF
    if is_q:
        base = q + (bt * Hq + hd) * D
        obase = qo + (bt * Hq + hd) * D
        wp = qw
    else:
        base = k + (bt * Hk + (hd - Hq)) * D
        obase = ko + (bt * Hk + (hd - Hq)) * D
        wp = kw
    x1 = tl.load(base + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + i, mask=m, other=0.0).to(tl.float32)
    if NORM:
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        x1 = x1 * inv * tl.load(wp + i, mask=m, other=0.0).to(tl.float32)
        x2 = x2 * inv * tl.load(wp + HALF + i, mask=m, other=0.0).to(tl.float32)
    p = tl.load(pos + bt).to(tl.float32)  # the position is read on the device
    ang = p * tl.load(inv_freq + i, mask=m, other=0.0)
    c = tl.cos(ang)
    s = tl.sin(ang)
    ty = obase.dtype.element_ty
    tl.store(obase + i, (x1 * c - x2 * s).to(ty), mask=m)
    tl.store(obase + HALF + i, (x2 * c + x1 * s).to(ty), mask=m)


_INV_FREQ: dict[tuple, torch.Tensor] = {}


def _inv_freq(D: int, theta: float, device: torch.device) -> torch.Tensor:
    # Same float32 formula as the reference (hanzo_torch.ops.fused.rope_cos_sin), computed on the
    # device once per (D, theta, device): no host->device copy per op.
    key = (D, float(theta), str(device))
    t = _INV_FREQ.get(key)
    if t is None:
        exponent = torch.arange(0, D, 2, device=device, dtype=torch.int64).float() / D
        t = (1.0 / (theta ** exponent)).contiguous()
        # a tensor made during CUDA-graph capture lives in the graph's pool: never cache it
        if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
            _INV_FREQ[key] = t
    return t


def qk_norm_rope(q, k, q_w, k_w, positions, theta: float, eps: float):
    """Triton ``hanzo::qk_norm_rope``: per-head RMSNorm (if weights) then NEOX RoPE of q and k.

    q ``[B, T, Hq, D]``, k ``[B, T, Hk, D]``, positions integer ``[B, T]`` read on the device.
    Returns new contiguous ``(q, k)`` in the input dtype.
    """
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.numel() == 0 and k.numel() == 0:
        return qo, ko
    norm = q_w is not None
    qc, kc = q.contiguous(), k.contiguous()
    qw = q_w.contiguous() if norm else qc
    kw = k_w.contiguous() if norm else kc
    half = D // 2
    _qk_norm_rope_kernel[(B * T, Hq + Hk)](qc, kc, qo, ko, qw, kw, positions.contiguous(),
                                           _inv_freq(D, theta, q.device), T, Hq, Hk, float(eps),
                                           NORM=norm, HALF=half, BH=triton.next_power_of_2(max(half, 1)))
    return qo, ko


# ---------------------------------------------------------------------------------------------
# moe_route

@triton.jit
def _moe_route_kernel(logits, w_out, id_out, E, K: tl.constexpr, KP: tl.constexpr,
                      NORMALIZE: tl.constexpr, BE: tl.constexpr):
    # One token: softmax over E experts, K rounds of argmax (ties to the lower id), renormalize.
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    m = e < E
    l = tl.load(logits + t * E + e, mask=m, other=float("-inf")).to(tl.float32)
    p = tl.exp(l - tl.max(l, axis=0))
    p = tl.where(m, p, 0.0)
    p = p / tl.sum(p, axis=0)
    # A NaN anywhere (a NaN logit, or +inf - +inf) makes the reference's softmax row all NaN and its
    # stable sort keep index order: select on equal keys (ties to the lower id), store NaN weights.
    # Decided on a flag, not on NaN compares, as max/min may drop NaNs on a device.
    nan_row = tl.max(tl.where(m & (p != p), 1, 0), axis=0) > 0
    cand = tl.where(m, tl.where(nan_row, 0.0, p), -1.0)
    slot = tl.arange(0, KP)
    wv = tl.zeros((KP,), dtype=tl.float32)
    iv = tl.zeros((KP,), dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(cand, axis=0)
        idx = tl.min(tl.where(cand == best, e, BE), axis=0)
        wv = tl.where(slot == j, best, wv)
        iv = tl.where(slot == j, idx.to(tl.int64), iv)
        cand = tl.where(e == idx, -2.0, cand)
    wv = tl.where(nan_row, float("nan"), wv)
    if NORMALIZE:
        wv = wv / tl.sum(tl.where(slot < K, wv, 0.0), axis=0)
    tl.store(w_out + t * K + slot, wv, mask=slot < K)
    tl.store(id_out + t * K + slot, iv, mask=slot < K)


def moe_route(logits: torch.Tensor, k: int, normalize: bool):
    """Triton ``hanzo::moe_route``: ``logits [T, E]`` -> ``(weights f32 [T, k], ids int64 [T, k])``."""
    T, E = logits.shape
    w = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    if T:
        _moe_route_kernel[(T,)](logits.contiguous(), w, ids, E, K=k, KP=triton.next_power_of_2(k),
                                NORMALIZE=bool(normalize), BE=triton.next_power_of_2(E))
    return w, ids


# ---------------------------------------------------------------------------------------------
# kv_cache_write

@triton.jit
def _kv_write_kernel(kc, vc, k, v, pos, T, S, cs_b, cs_s, HD, BLOCK: tl.constexpr):
    # program (b*T + t, chunk): copy HD = Hk*D values of k and v into slot positions[b, t].
    bt = tl.program_id(0).to(tl.int64)
    b = bt // T
    p = tl.load(pos + bt).to(tl.int64)
    lim = tl.where((p >= 0) & (p < S), HD, 0)  # an out-of-range position writes nothing
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < lim
    dst = b * cs_b + p * cs_s + i
    tl.store(kc + dst, tl.load(k + bt * HD + i, mask=m), mask=m)
    tl.store(vc + dst, tl.load(v + bt * HD + i, mask=m), mask=m)


def kv_cache_write(k_cache, v_cache, k, v, positions) -> None:
    """Triton ``hanzo::kv_cache_write``: ``cache[b, positions[b, t]] = k[b, t]`` (and v), in place.

    Caches ``[B, S, Hk, D]`` must have contiguous ``[Hk, D]`` rows (any B/S strides); a position
    outside ``[0, S)`` writes nothing (the check would need a host sync).
    """
    B, S, Hk, D = k_cache.shape
    T = k.shape[1]
    if B * T == 0 or Hk * D == 0:
        return
    for c in (k_cache, v_cache):
        if c.stride(3) != 1 or c.stride(2) != D:
            raise ValueError("kv_cache_write: cache rows [Hk, D] must be contiguous")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("kv_cache_write: k_cache and v_cache must have the same strides")
    HD = Hk * D
    BLOCK = min(triton.next_power_of_2(HD), 1024)
    _kv_write_kernel[(B * T, triton.cdiv(HD, BLOCK))](k_cache, v_cache, k.contiguous(), v.contiguous(),
                                                      positions.contiguous(), T, S,
                                                      k_cache.stride(0), k_cache.stride(1), HD, BLOCK=BLOCK)


# ---------------------------------------------------------------------------------------------
# qk_norm_rope_kv_write

def qk_norm_rope_kv_write(q, k, v, q_w, k_w, k_cache, v_cache, positions, theta: float, eps: float) -> torch.Tensor:
    """Triton ``hanzo::qk_norm_rope_kv_write``: :func:`qk_norm_rope`, then :func:`kv_cache_write` of
    the rotated k and of v (two launches; caches of another dtype than the activations, e.g.
    q8_0, are written by the torch reference, as ``hanzo::kv_cache_write`` does here).
    Returns the rotated q."""
    qo, ko = qk_norm_rope(q, k, q_w, k_w, positions, theta, eps)
    if k_cache.dtype == ko.dtype:
        kv_cache_write(k_cache, v_cache, ko, v, positions)
    else:
        from ...ops.fused import kv_cache_write_reference

        kv_cache_write_reference(k_cache, v_cache, ko, v, positions)
    return qo


# ---------------------------------------------------------------------------------------------
# attention

@triton.jit
def _attention_kernel(q, kc, vc, out, pos, ws_m, ws_l, ws_acc, T, S, Hq, Hk, G, scale, chunk,
                      qs_b, qs_t, qs_h, cs_b, cs_s, cs_h,
                      D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr,
                      QK_DOT: tl.constexpr, QK_PREC: tl.constexpr, SPLIT: tl.constexpr):
    # Program (b * Hk + kv head, row block). Rows are (t, g) pairs: the G query heads sharing
    # one KV head are stacked into the M dim of the dots, so decode (T = 1) still fills a tile.
    # Online softmax in float32; P*V in float32 (DESIGN section 6: bf16 P broke Qwen3-8B).
    # SPLIT (decode, one row block): program_id(1) is a split of the keys [split * chunk,
    # (split + 1) * chunk); the unnormalized (m, l, acc) go to the workspace and
    # _attention_combine_kernel merges them, so a long cache is read by many programs.
    pid = tl.program_id(0)
    b = (pid // Hk).to(tl.int64)
    hk = pid % Hk
    TPB = BR // G  # query positions per row block
    r = tl.arange(0, BR)
    if SPLIT:
        t = r // G
    else:
        t = tl.program_id(1) * TPB + r // G
    g = r % G
    rm = (r < TPB * G) & (t < T)
    hq = hk * G + g
    d = tl.arange(0, BD)
    dm = d < D
    p_row = tl.load(pos + b * T + t, mask=rm, other=-1).to(tl.int64)
    qt = tl.load(q + b * qs_b + t.to(tl.int64)[:, None] * qs_t + hq[:, None] * qs_h + d[None, :],
                 mask=rm[:, None] & dm[None, :], other=0.0)
    hi = tl.minimum(tl.max(p_row, axis=0) + 1, S)
    lo = 0
    if SPLIT:
        lo = tl.program_id(1) * chunk
        hi = tl.minimum(hi, lo + chunk)
    m_i = tl.full((BR,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BR,), dtype=tl.float32)
    acc = tl.zeros((BR, BD), dtype=tl.float32)
    cbase = b * cs_b + hk * cs_h
    for s0 in range(lo, hi, BS):
        s = s0 + tl.arange(0, BS)
        sm = s < hi
        kt = tl.load(kc + cbase + s.to(tl.int64)[:, None] * cs_s + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
        sc = tl.dot(qt.to(QK_DOT), tl.trans(kt.to(QK_DOT)), input_precision=QK_PREC) * scale   # [BR, BS]
        vis = (s[None, :] <= p_row[:, None]) & sm[None, :]
        sc = tl.where(vis, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        pr = tl.exp(sc - m_safe[:, None])
        corr = tl.exp(m_i - m_safe)
        l_i = l_i * corr + tl.sum(pr, axis=1)
        vt = tl.load(vc + cbase + s.to(tl.int64)[:, None] * cs_s + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
        acc = acc * corr[:, None] + tl.dot(pr, vt.to(tl.float32), input_precision="ieee")
        m_i = m_new
    if SPLIT:
        w = (pid.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * BR + r   # workspace rows
        tl.store(ws_m + w, m_i)
        tl.store(ws_l + w, l_i)
        tl.store(ws_acc + w[:, None] * BD + d[None, :], acc)
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out + ((b * T + t.to(tl.int64)) * Hq + hq)[:, None] * D + d[None, :],
                 o.to(out.dtype.element_ty), mask=rm[:, None] & dm[None, :])


@triton.jit
def _attention_combine_kernel(ws_m, ws_l, ws_acc, out, T, Hq, Hk, G, n_split,
                              D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    # Merge the n_split partial softmax states of one (b, kv head) row block (flash-decoding).
    pid = tl.program_id(0)
    b = (pid // Hk).to(tl.int64)
    hk = pid % Hk
    r = tl.arange(0, BR)
    t = r // G
    g = r % G
    rm = (r < (BR // G) * G) & (t < T)
    hq = hk * G + g
    d = tl.arange(0, BD)
    dm = d < D
    m_run = tl.full((BR,), float("-inf"), dtype=tl.float32)
    l_run = tl.zeros((BR,), dtype=tl.float32)
    o_run = tl.zeros((BR, BD), dtype=tl.float32)
    for sp in range(0, n_split):
        w = (pid.to(tl.int64) * n_split + sp) * BR + r
        m = tl.load(ws_m + w)
        m_new = tl.maximum(m_run, m)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        c_old = tl.exp(m_run - m_safe)
        c_new = tl.exp(m - m_safe)
        l_run = l_run * c_old + tl.load(ws_l + w) * c_new
        o_run = o_run * c_old[:, None] + tl.load(ws_acc + w[:, None] * BD + d[None, :]) * c_new[:, None]
        m_run = m_new
    o = o_run / tl.where(l_run == 0.0, 1.0, l_run)[:, None]
    tl.store(out + ((b * T + t.to(tl.int64)) * Hq + hq)[:, None] * D + d[None, :], o.to(out.dtype.element_ty),
             mask=rm[:, None] & dm[None, :])


ATTN_BS = 32
"""Keys per step of the attention kernel; with 16-row blocks at 4 warps and D <= 128 the sm_90
compile is spill-free (benchmarks/triton_gpu_check.py --aot)."""

ATTN_SPLIT_CHUNK = 512
"""Keys per program of the split (flash-decoding) attention, taken when all queries of a
(batch, KV head) fit one row block (decode) and the cache holds more keys than this: without
it decode runs only B * Hk programs (8 for Qwen3-8B), each walking the whole context. The split
count is fixed by the cache length, not the positions, so the launch is graph-capturable; splits
past the largest position exit at once. Retune with a GPU profile."""


def attention(q, k_cache, v_cache, positions, scale: float, impl: str) -> torch.Tensor:
    """Triton ``hanzo::attention``: causal-by-position GQA of ``q [B, T, Hq, D]`` against the caches.

    One kernel serves every ``impl`` ("eager", "flash", "auto"): an online-softmax kernel whose
    P*V stays float32, which is the precision the eager reference guarantees. Keys past the
    largest position of a row block are never read. Positions are not range-checked (that
    would need a host sync): one >= S sees the whole cache, a negative one nothing (zeros).
    Decode against a long cache splits the keys over programs (:data:`ATTN_SPLIT_CHUNK`).
    Returns a contiguous ``[B, T, Hq, D]`` in q.dtype.
    """
    B, T, Hq, D = q.shape
    S, Hk = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    G = Hq // Hk
    for c in (k_cache, v_cache):
        if c.stride(3) != 1:
            raise ValueError("attention: cache rows must be contiguous in D")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("attention: k_cache and v_cache must have the same strides")
    if q.stride(3) != 1:
        q = q.contiguous()
    # 16 rows (query positions x the G heads of one KV head): with the float32 P*V dot, larger
    # row blocks spill on sm_90 (BR=32 at 8 warps: 176 B, BR=64: 1 KB of stack).
    BR = max(16, triton.next_power_of_2(G))
    TPB = BR // G
    BD = max(16, triton.next_power_of_2(D))
    qk_dot = tl.float32 if (q.dtype == torch.float32 or _interpreting(_attention_kernel)) else _TL[q.dtype]
    n_rb = triton.cdiv(T, TPB)
    split = n_rb == 1 and S > ATTN_SPLIT_CHUNK
    n_split = triton.cdiv(S, ATTN_SPLIT_CHUNK) if split else 1
    if split:
        ws_m = torch.empty((B * Hk * n_split * BR,), dtype=torch.float32, device=q.device)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty((B * Hk * n_split * BR, BD), dtype=torch.float32, device=q.device)
    else:
        ws_m = ws_l = ws_acc = out
    pos = positions.contiguous()
    warps = 4 if BR <= 16 else 8
    _attention_kernel[(B * Hk, n_split if split else n_rb)](
        q, k_cache, v_cache, out, pos, ws_m, ws_l, ws_acc, T, S, Hq, Hk, G, float(scale), ATTN_SPLIT_CHUNK,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        D=D, BD=BD, BR=BR, BS=ATTN_BS, QK_DOT=qk_dot, QK_PREC="ieee" if qk_dot == tl.float32 else "tf32",
        SPLIT=split, num_warps=warps)
    if split:
        _attention_combine_kernel[(B * Hk,)](ws_m, ws_l, ws_acc, out, T, Hq, Hk, G, n_split,
                                             D=D, BD=BD, BR=BR, num_warps=warps)
    return out
