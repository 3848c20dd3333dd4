"""The format layer of the Triton backend: one unpack rule per ggml format, written once.

Every Triton kernel of hanzo-torch (dequantize, get_rows, mul_mat, mul_mat_id) reads packed
weights through :func:`unpack`, which turns the bytes of one element's block into the element's
float32 value. The format is a ``tl.constexpr`` (its ggml type id), so each specialization of a
kernel compiles only the branch of its own format: adding a format adds one ``_unpack_<fmt>``
rule here (and its arms of the dispatch chains), and no kernel changes. :data:`SUPPORTED` is
the set of formats with a rule; ids, block sizes, field offsets (``<FMT>_<field>``, e.g.
``Q2_K_d``), group lengths and tables all come from the registry in :mod:`hanzo_torch.formats`.

Addressing convention (shared by every kernel): for logical column ``k`` of a packed row that
starts at byte pointer ``row``, the element lives in block ``k // QK`` at byte
``row + (k // QK) * TS`` and has in-block index ``j = k % QK`` (``QK``/``TS``: the format's
block size and bytes per block, from the registry in :mod:`hanzo_torch.formats`).

Block layouts are ggml's (``ggml-common.h``); the float arithmetic of every rule follows the
order of operations of the numpy dequantizers in ``gguf.quants`` so the results are bit-exact
with them (kernels that must be bit-exact launch with ``enable_fp_fusion=False`` so that no
multiply-add is contracted into an FMA). The IQ grids and the non-linear value tables
(IQ4_NL, MXFP4, NVFP4) are the registry's tables (read from the ``gguf`` package) and are passed
to the kernels as float32 tensors (:func:`format_table`); nothing is copied into this file.

IQ2_XXS, IQ2_XS and IQ3_XXS store 7 sign bits per 8 weights; the 8th sign is the parity of
the 7 (``docs/DESIGN.md`` section 2). We compute the parity with three shifts and xors
instead of gathering from ggml's 128-entry ``ksigns`` table: divergent constant-memory gathers
were the measured i-quant kernel wall.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as _T

from ...formats import FORMATS, get_format


def _name(qtype) -> str:
    """ggml name of ``qtype`` (name, id or Format), via the registry, else the gguf enum."""
    try:
        return get_format(qtype).name
    except ValueError:
        key = qtype.upper() if isinstance(qtype, str) else qtype
        try:
            return _T[key].name if isinstance(key, str) else _T(int(key)).name
        except (KeyError, ValueError, TypeError):
            raise ValueError(f"Triton backend: unknown ggml type {qtype!r}") from None


def format_info(qtype) -> tuple[int, int, int]:
    """``(type_id, block_size, type_size)`` of ``qtype`` for the kernels, from the registry.

    Raises:
        ValueError: the format is unknown or has no Triton unpack rule.
    """
    name = _name(qtype)
    if name not in SUPPORTED:
        raise ValueError(f"Triton backend: no unpack rule for format {name}; supported: {', '.join(SUPPORTED)}")
    fmt = get_format(name)
    return fmt.type_id, fmt.block_size, fmt.type_size


@functools.lru_cache(maxsize=None)
def _table_host(name: str) -> torch.Tensor:
    # the format's one table in the registry (an i-quant grid, rows flattened, or the 16 levels
    # of a 4-bit code), float32; a 1-element dummy for formats without one
    tables = list(get_format(name).tables.values())
    assert len(tables) <= 1, f"{name}: the Triton rules take one table per format"
    if tables:
        return tables[0].cpu.to(torch.float32).reshape(-1).contiguous()
    return torch.zeros(1, dtype=torch.float32)


_TABLE_CACHE: dict[tuple[str, str], torch.Tensor] = {}


def format_table(qtype: str, device: torch.device) -> torch.Tensor:
    """The float32 lookup table of ``qtype`` on ``device`` (a 1-element dummy if it has none).

    IQ formats: the gguf grid, ``[n_rows * row_width]`` (row ``i`` holds the grid values of
    index ``i``); IQ4_NL/IQ4_XS/MXFP4/NVFP4: the 16 values of the 4-bit code. Cached per device
    so decode never copies it again (no host->device traffic per op).
    """
    name = _name(qtype)
    key = (name, str(device))
    t = _TABLE_CACHE.get(key)
    if t is None:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{name}: the format table must reach the device before CUDA-graph capture; "
                               "run the op once eagerly (warm-up) first")
        t = _table_host(name).to(device)
        _TABLE_CACHE[key] = t
    return t


# ---------------------------------------------------------------------------------------------
# byte readers (little-endian, as ggml stores them)

@triton.jit
def _u8(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _u16(p, mask):
    return _u8(p, mask) | (_u8(p + 1, mask) << 8)


@triton.jit
def _u32(p, mask):
    b0 = tl.load(p, mask=mask, other=0).to(tl.uint32)
    b1 = tl.load(p + 1, mask=mask, other=0).to(tl.uint32)
    b2 = tl.load(p + 2, mask=mask, other=0).to(tl.uint32)
    b3 = tl.load(p + 3, mask=mask, other=0).to(tl.uint32)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@triton.jit
def _f16_bits(h):
    return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16(p, mask):
    return _f16_bits(_u16(p, mask))


@triton.jit
def _i8(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.int32)


@triton.jit
def _nibble16(qs, j, mask):
    # 32 4-bit values in 16 bytes: value j < 16 is the low nibble of byte j, j >= 16 the high
    # nibble of byte j - 16 (ggml's legacy/IQ4_NL/MXFP4 order).
    b = _u8(qs + (j % 16), mask)
    return (b >> (4 * (j // 16))) & 0xF


@triton.jit
def _parity7(s):
    # Parity of the 7 stored sign bits = the 8th sign (see module docstring).
    p = s ^ (s >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return p & 1


@triton.jit
def _sign8(s7, i):
    # Sign bit i (0..7) of the 8 signs encoded by 7 stored bits + parity.
    s8 = s7 | (_parity7(s7) << 7)
    return (s8 >> i) & 1


# ---------------------------------------------------------------------------------------------
# one rule per format: (block pointer, in-block index j, mask, table) -> float32

@triton.jit
def _unpack_q4_0(b, j, m):
    d = _f16(b + Q4_0_d, m)
    return d * (_nibble16(b + Q4_0_qs, j, m) - 8).to(tl.float32)


@triton.jit
def _unpack_q4_1(b, j, m):
    d = _f16(b + Q4_1_d, m)
    mn = _f16(b + Q4_1_m, m)
    return d * _nibble16(b + Q4_1_qs, j, m).to(tl.float32) + mn


@triton.jit
def _unpack_q5_0(b, j, m):
    d = _f16(b + Q5_0_d, m)
    qh = (_u32(b + Q5_0_qh, m) >> j.to(tl.uint32)) & 1
    q = _nibble16(b + Q5_0_qs, j, m) | (qh.to(tl.int32) << 4)
    return d * (q - 16).to(tl.float32)


@triton.jit
def _unpack_q5_1(b, j, m):
    d = _f16(b + Q5_1_d, m)
    mn = _f16(b + Q5_1_m, m)
    qh = (_u32(b + Q5_1_qh, m) >> j.to(tl.uint32)) & 1
    q = _nibble16(b + Q5_1_qs, j, m) | (qh.to(tl.int32) << 4)
    return d * q.to(tl.float32) + mn


@triton.jit
def _unpack_q8_0(b, j, m):
    return _i8(b + Q8_0_qs + j, m).to(tl.float32) * _f16(b + Q8_0_d, m)


@triton.jit
def _unpack_q2_k(b, j, m):
    # scales[16] qs[64] d dmin; value = d*(sc&15) * q - dmin*(sc>>4), 16 values per scale.
    sc = _u8(b + Q2_K_scales + j // 16, m)
    d = _f16(b + Q2_K_d, m)
    dmin = _f16(b + Q2_K_dmin, m)
    r = j % 128
    q = (_u8(b + Q2_K_qs + (j // 128) * 32 + r % 32, m) >> (2 * (r // 32))) & 3
    dl = d * (sc & 0xF).to(tl.float32)
    ml = dmin * (sc >> 4).to(tl.float32)
    return dl * q.to(tl.float32) - ml


@triton.jit
def _unpack_q3_k(b, j, m):
    # hmask[32] qs[64] scales[12] d; 6-bit signed scales (minus 32), q = low2 - 4*(1 - hbit).
    hbit = (_u8(b + Q3_K_hmask + j % 32, m) >> (j // 32)) & 1
    r = j % 128
    ql = (_u8(b + Q3_K_qs + (j // 128) * 32 + r % 32, m) >> (2 * (r // 32))) & 3
    s = j // 16
    lo = (_u8(b + Q3_K_scales + s % 8, m) >> (4 * (s // 8))) & 0xF
    hi = (_u8(b + Q3_K_scales + 8 + s % 4, m) >> (2 * (s // 4))) & 3
    scale = (lo | (hi << 4)) - 32
    d = _f16(b + Q3_K_d, m)
    dl = d * scale.to(tl.float32)
    return dl * (ql - ((1 - hbit) << 2)).to(tl.float32)


@triton.jit
def _scale_min_k4(b, s, m):
    # 6-bit scale and min of sub-block s (0..7) from the 12 packed bytes at b (Q4_K, Q5_K).
    lo = s < 4
    a = _u8(b + s % 4, m)        # scales[s] (s < 4) or the top bits source scales[s-4]
    c = _u8(b + 4 + s % 4, m)    # scales[s+4] (s < 4) or scales[s] (s >= 4)
    e = _u8(b + 8 + s % 4, m)    # scales[s+4] for s >= 4
    sc = tl.where(lo, a & 63, (e & 0xF) | ((a >> 6) << 4))
    mn = tl.where(lo, c & 63, (e >> 4) | ((c >> 6) << 4))
    return sc, mn


@triton.jit
def _unpack_q4_k(b, j, m):
    # d dmin scales[12] qs[128]; value = d*sc * q - dmin*mn, 32 values per sub-block.
    d = _f16(b + Q4_K_d, m)
    dmin = _f16(b + Q4_K_dmin, m)
    s = j // 32
    sc, mn = _scale_min_k4(b + Q4_K_scales, s, m)
    q = (_u8(b + Q4_K_qs + (j // 64) * 32 + j % 32, m) >> (4 * (s % 2))) & 0xF
    ds = d * sc.to(tl.float32)
    dm = dmin * mn.to(tl.float32)
    return ds * q.to(tl.float32) - dm


@triton.jit
def _unpack_q5_k(b, j, m):
    # d dmin scales[12] qh[32] qs[128]
    d = _f16(b + Q5_K_d, m)
    dmin = _f16(b + Q5_K_dmin, m)
    s = j // 32
    sc, mn = _scale_min_k4(b + Q5_K_scales, s, m)
    ql = (_u8(b + Q5_K_qs + (j // 64) * 32 + j % 32, m) >> (4 * (s % 2))) & 0xF
    qh = (_u8(b + Q5_K_qh + j % 32, m) >> s) & 1
    ds = d * sc.to(tl.float32)
    dm = dmin * mn.to(tl.float32)
    return ds * (ql | (qh << 4)).to(tl.float32) - dm


@triton.jit
def _unpack_q6_k(b, j, m):
    # ql[128] qh[64] scales[16] (int8) d; value = d*sc * (q - 32), 16 values per scale.
    h = j // 128
    r = j % 128
    ql = (_u8(b + Q6_K_ql + h * 64 + r % 64, m) >> (4 * (r // 64))) & 0xF
    qh = (_u8(b + Q6_K_qh + h * 32 + r % 32, m) >> (2 * (r // 32))) & 3
    sc = _i8(b + Q6_K_scales + j // 16, m)
    d = _f16(b + Q6_K_d, m)
    ds = d * sc.to(tl.float32)
    return ds * ((ql | (qh << 4)) - 32).to(tl.float32)


@triton.jit
def _tq1_code(b, j, m):
    # qs[48] qh[4]: base-3 digits packed 5 (or 4) per byte as a fixed-point fraction -> -1..1.
    first = j < 160
    mid = (j >= 160) & (j < 240)
    jj = tl.where(first, j, tl.where(mid, j - 160, j - 240))
    byte_i = tl.where(first, TQ1_0_qs + jj % 32, tl.where(mid, TQ1_0_qs + 32 + jj % 16, TQ1_0_qh + jj % 4))
    digit = tl.where(first, jj // 32, tl.where(mid, jj // 16, jj // 4))
    pw = tl.where(digit == 0, 1, tl.where(digit == 1, 3, tl.where(digit == 2, 9, tl.where(digit == 3, 27, 81))))
    v = (_u8(b + byte_i, m) * pw) & 0xFF
    return ((v * 3) >> 8) - 1


@triton.jit
def _unpack_tq1_0(b, j, m):
    # qs[48] qh[4] d
    return _f16(b + TQ1_0_d, m) * _tq1_code(b, j, m).to(tl.float32)


@triton.jit
def _unpack_tq2_0(b, j, m):
    # qs[64] d: 2-bit codes 0..2 meaning -1..1.
    r = j % 128
    q = ((_u8(b + TQ2_0_qs + (j // 128) * 32 + r % 32, m) >> (2 * (r // 32))) & 3) - 1
    return _f16(b + TQ2_0_d, m) * q.to(tl.float32)


@triton.jit
def _unpack_mxfp4(b, j, m, tab):
    # e (E8M0 exponent) qs[16]: value = 2^(e-128) * kvalues[q] (kvalues doubled e2m1).
    e = _u8(b + MXFP4_e, m)
    bits = tl.where(e < 2, (0x00200000 << e), (e - 1) << 23)
    d = bits.to(tl.float32, bitcast=True)
    kv = tl.load(tab + _nibble16(b + MXFP4_qs, j, m), mask=m, other=0.0)
    return d * kv


@triton.jit
def _unpack_nvfp4(b, j, m, tab):
    # 4 UE4M3 scales (one per 16 values) then qs[32]; value = 0.5 * ue4m3(s) * kvalues[q].
    s = j // 16
    r = j % 16
    x = _u8(b + NVFP4_d + s, m)
    ex = (x >> 3) & 0xF
    man = (x & 7).to(tl.float32)
    sub = man * 0.001953125  # 2^-9
    nrm = (1.0 + man / 8.0) * ((ex + 120) << 23).to(tl.float32, bitcast=True)  # 2^(ex-7)
    raw = tl.where(ex == 0, sub, nrm)
    d = tl.where((x == 0) | (x == 0x7F), 0.0, raw * 0.5)
    q = (_u8(b + NVFP4_qs + s * 8 + r % 8, m) >> (4 * (r // 8))) & 0xF
    kv = tl.load(tab + q, mask=m, other=0.0)
    return d * kv


@triton.jit
def _unpack_iq4_nl(b, j, m, tab):
    kv = tl.load(tab + _nibble16(b + IQ4_NL_qs, j, m), mask=m, other=0.0)
    return _f16(b + IQ4_NL_d, m) * kv


@triton.jit
def _unpack_iq4_xs(b, j, m, tab):
    # d scales_h(u16) scales_l[4] qs[128]; 6-bit scale (minus 32) per 32 values.
    ib = j // 32
    sl = (_u8(b + IQ4_XS_scales_l + ib // 2, m) >> (4 * (ib % 2))) & 0xF
    sh = (_u16(b + IQ4_XS_scales_h, m) >> (2 * ib)) & 3
    dl = _f16(b + IQ4_XS_d, m) * ((sl | (sh << 4)) - 32).to(tl.float32)
    r = j % 32
    q = (_u8(b + IQ4_XS_qs + ib * 16 + r % 16, m) >> (4 * (r // 16))) & 0xF
    return dl * tl.load(tab + q, mask=m, other=0.0)


@triton.jit
def _unpack_iq2_xxs(b, j, m, tab):
    # d then 8 x (4 grid-index bytes, u32 = 4 x 7 sign bits + 4-bit scale); 32 values each.
    ib = j // 32
    l = (j % 32) // 8
    i = j % 8
    g = b + IQ2_XXS_qs + ib * 8
    aux = _u32(g + 4, m)
    db = _f16(b + IQ2_XXS_d, m) * (0.5 + (aux >> 28).to(tl.float32)) * 0.25
    s7 = ((aux >> (7 * l).to(tl.uint32)) & 127).to(tl.int32)
    gv = tl.load(tab + _u8(g + l, m) * 8 + i, mask=m, other=0.0)
    v = db * gv
    return tl.where(_sign8(s7, i) != 0, -v, v)


@triton.jit
def _unpack_iq2_xs(b, j, m, tab):
    # d qs[32] (u16: 9-bit grid index | 7 sign bits << 9) scales[8] (4 bits per 16 values)
    gi = j // 8
    i = j % 8
    q = _u16(b + IQ2_XS_qs + gi * 2, m)
    sc = (_u8(b + IQ2_XS_scales + j // 32, m) >> (4 * ((j // 16) % 2))) & 0xF
    db = _f16(b + IQ2_XS_d, m) * (0.5 + sc.to(tl.float32)) * 0.25
    gv = tl.load(tab + (q & 511) * 8 + i, mask=m, other=0.0)
    v = db * gv
    return tl.where(_sign8(q >> 9, i) != 0, -v, v)


@triton.jit
def _unpack_iq2_s(b, j, m, tab):
    # d qs[32] signs[32] qh[8] scales[8]; 10-bit grid index = qs | 2 bits of qh << 8.
    gi = j // 8
    i = j % 8
    idx = _u8(b + IQ2_S_qs + gi, m) | (((_u8(b + IQ2_S_qh + gi // 4, m) >> (2 * (gi % 4))) & 3) << 8)
    sgn = (_u8(b + IQ2_S_qs + 32 + gi, m) >> i) & 1
    sc = (_u8(b + IQ2_S_scales + j // 32, m) >> (4 * ((j // 16) % 2))) & 0xF
    db = _f16(b + IQ2_S_d, m) * (0.5 + sc.to(tl.float32)) * 0.25
    v = db * tl.load(tab + idx * 8 + i, mask=m, other=0.0)
    return tl.where(sgn != 0, -v, v)


@triton.jit
def _unpack_iq3_xxs(b, j, m, tab):
    # d qs[64] (grid index per 4 values) then 8 x u32 (4 x 7 sign bits + 4-bit scale).
    ib = j // 32
    l = (j % 32) // 8
    i = j % 8
    aux = _u32(b + IQ3_XXS_qs + 64 + ib * 4, m)
    db = _f16(b + IQ3_XXS_d, m) * (0.5 + (aux >> 28).to(tl.float32)) * 0.5
    s7 = ((aux >> (7 * l).to(tl.uint32)) & 127).to(tl.int32)
    gv = tl.load(tab + _u8(b + IQ3_XXS_qs + j // 4, m) * 4 + j % 4, mask=m, other=0.0)
    v = db * gv
    return tl.where(_sign8(s7, i) != 0, -v, v)


@triton.jit
def _unpack_iq3_s(b, j, m, tab):
    # d qs[64] qh[8] signs[32] scales[4]; 9-bit grid index, explicit signs, scale 1 + 2*s.
    qi = j // 4
    idx = _u8(b + IQ3_S_qs + qi, m) | (((_u8(b + IQ3_S_qh + qi // 8, m) >> (qi % 8)) & 1) << 8)
    sgn = (_u8(b + IQ3_S_signs + j // 8, m) >> (j % 8)) & 1
    sc = (_u8(b + IQ3_S_scales + j // 64, m) >> (4 * ((j // 32) % 2))) & 0xF
    db = _f16(b + IQ3_S_d, m) * (1 + 2 * sc).to(tl.float32)
    v = db * tl.load(tab + idx * 4 + j % 4, mask=m, other=0.0)
    return tl.where(sgn != 0, -v, v)


@triton.jit
def _unpack_iq1_s(b, j, m, tab):
    # d qs[32] qh[8] (u16 per 32 values: 4 x 3 index bits, 3-bit scale, delta sign)
    ib = j // 32
    l = (j % 32) // 8
    qh = _u16(b + IQ1_S_qh + ib * 2, m)
    dl = _f16(b + IQ1_S_d, m) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
    delta = tl.where((qh & 0x8000) == 0, 0.125, -0.125)
    idx = _u8(b + IQ1_S_qs + ib * 4 + l, m) | (((qh >> (3 * l)) & 7) << 8)
    gv = tl.load(tab + idx * 8 + j % 8, mask=m, other=0.0)
    return dl * (gv + delta)


@triton.jit
def _unpack_iq1_m(b, j, m, tab):
    # qs[32] qh[16] scales[8]: the f16 d is spread over the top nibbles of the 4 scale u16s.
    s0 = _u16(b + IQ1_M_scales, m)
    s1 = _u16(b + IQ1_M_scales + 2, m)
    s2 = _u16(b + IQ1_M_scales + 4, m)
    s3 = _u16(b + IQ1_M_scales + 6, m)
    d = _f16_bits(((s0 & 0xF000) >> 12) | ((s1 & 0xF000) >> 8) | ((s2 & 0xF000) >> 4) | (s3 & 0xF000))
    t = j // 16
    sc = (_u16(b + IQ1_M_scales + 2 * (t // 4), m) >> (3 * (t % 4))) & 7
    dl = d * (2 * sc + 1).to(tl.float32)
    u = j // 8
    qh = (_u8(b + IQ1_M_qh + u // 2, m) >> (4 * (u % 2))) & 0xF
    idx = _u8(b + IQ1_M_qs + u, m) | ((qh & 7) << 8)
    delta = tl.where((qh & 8) == 0, 0.125, -0.125)
    gv = tl.load(tab + idx * 8 + j % 8, mask=m, other=0.0)
    return dl * (gv + delta)


@triton.jit
def _unpack_f32(b, j, m):
    return _u32(b + F32_v, m).to(tl.float32, bitcast=True)


@triton.jit
def _unpack_f16(b, j, m):
    return _f16(b + F16_v, m)


@triton.jit
def _unpack_bf16(b, j, m):
    return (_u16(b + BF16_v, m).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _q1_0_sign(b, j, m):
    # qs[16]: value j is bit j % 8 of qs[j // 8] -> +1 / -1
    return 2 * ((_u8(b + Q1_0_qs + j // 8, m) >> (j % 8)) & 1) - 1


@triton.jit
def _unpack_q1_0(b, j, m):
    # d qs[16]: value = d if bit else -d (ggml's (2 * bit - 1) * d)
    return _q1_0_sign(b, j, m).to(tl.float32) * _f16(b + Q1_0_d, m)


@triton.jit
def unpack(b, j, m, tab, FMT: tl.constexpr):
    """float32 value of in-block element ``j`` of the block at byte pointer ``b`` (format FMT).

    ``b``, ``j`` and ``m`` (load mask) broadcast together; ``tab`` is :func:`format_table`.
    """
    if FMT == F32:
        return _unpack_f32(b, j, m)
    elif FMT == F16:
        return _unpack_f16(b, j, m)
    elif FMT == BF16:
        return _unpack_bf16(b, j, m)
    elif FMT == Q1_0:
        return _unpack_q1_0(b, j, m)
    elif FMT == Q4_0:
        return _unpack_q4_0(b, j, m)
    elif FMT == Q4_1:
        return _unpack_q4_1(b, j, m)
    elif FMT == Q5_0:
        return _unpack_q5_0(b, j, m)
    elif FMT == Q5_1:
        return _unpack_q5_1(b, j, m)
    elif FMT == Q8_0:
        return _unpack_q8_0(b, j, m)
    elif FMT == Q2_K:
        return _unpack_q2_k(b, j, m)
    elif FMT == Q3_K:
        return _unpack_q3_k(b, j, m)
    elif FMT == Q4_K:
        return _unpack_q4_k(b, j, m)
    elif FMT == Q5_K:
        return _unpack_q5_k(b, j, m)
    elif FMT == Q6_K:
        return _unpack_q6_k(b, j, m)
    elif FMT == TQ1_0:
        return _unpack_tq1_0(b, j, m)
    elif FMT == TQ2_0:
        return _unpack_tq2_0(b, j, m)
    elif FMT == MXFP4:
        return _unpack_mxfp4(b, j, m, tab)
    elif FMT == NVFP4:
        return _unpack_nvfp4(b, j, m, tab)
    elif FMT == IQ4_NL:
        return _unpack_iq4_nl(b, j, m, tab)
    elif FMT == IQ4_XS:
        return _unpack_iq4_xs(b, j, m, tab)
    elif FMT == IQ2_XXS:
        return _unpack_iq2_xxs(b, j, m, tab)
    elif FMT == IQ2_XS:
        return _unpack_iq2_xs(b, j, m, tab)
    elif FMT == IQ2_S:
        return _unpack_iq2_s(b, j, m, tab)
    elif FMT == IQ3_XXS:
        return _unpack_iq3_xxs(b, j, m, tab)
    elif FMT == IQ3_S:
        return _unpack_iq3_s(b, j, m, tab)
    elif FMT == IQ1_S:
        return _unpack_iq1_s(b, j, m, tab)
    else:
        tl.static_assert(FMT == IQ1_M, "unpack: format id without a rule")
        return _unpack_iq1_m(b, j, m, tab)


@triton.jit
def unpack_at(row, k, m, tab, FMT: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr):
    """float32 value of logical column ``k`` of the packed row starting at byte pointer ``row``."""
    return unpack(row + (k // QK) * TS, k % QK, m, tab, FMT)


# ---------------------------------------------------------------------------------------------
# Grouped form: w = scale[g] * code[j] + offset[g] for the GROUP_LEN[fmt] values of group g.
#
# The per-element rules above reload a block's scales for every value (bit-exact, simple, and
# right for dequantize). A mat-vec only needs sum_j x_j * w_j = scale * sum_j x_j * code_j +
# offset * sum_j x_j per group, so the scales are loaded once per group and each value costs one
# code load and one FMA. Every quantized format has a grouped rule (the IQ codes are signed grid
# values; IQ1's delta is the group offset); the dense ones use the element rules. The group
# length of each format is the registry's ``group_len`` (:data:`GROUP_LEN`).


@triton.jit
def group_params(b, g, m, tab, FMT: tl.constexpr):
    """(scale, offset, aux) of group ``g`` (0-based within the block at byte pointer ``b``).

    scale/offset: float32; aux: int32 per-group payload that :func:`group_code` needs (the sign
    words of IQ2_XXS/IQ3_XXS, the high index bits of IQ1_S/IQ1_M), 0 for the other formats.
    """
    zero = tl.zeros(b.shape, dtype=tl.float32)
    iz = tl.zeros(b.shape, dtype=tl.int32)
    if FMT == Q4_0:
        return _f16(b + Q4_0_d, m), zero, iz
    elif FMT == Q5_0:
        return _f16(b + Q5_0_d, m), zero, iz
    elif FMT == Q8_0:
        return _f16(b + Q8_0_d, m), zero, iz
    elif FMT == IQ4_NL:
        return _f16(b + IQ4_NL_d, m), zero, iz
    elif FMT == Q1_0:
        return _f16(b + Q1_0_d, m), zero, iz
    elif FMT == Q4_1:
        return _f16(b + Q4_1_d, m), _f16(b + Q4_1_m, m), iz
    elif FMT == Q5_1:
        return _f16(b + Q5_1_d, m), _f16(b + Q5_1_m, m), iz
    elif FMT == Q2_K:
        sc = _u8(b + Q2_K_scales + g, m)
        return _f16(b + Q2_K_d, m) * (sc & 0xF).to(tl.float32), -(_f16(b + Q2_K_dmin, m) * (sc >> 4).to(tl.float32)), iz
    elif FMT == Q3_K:
        lo = (_u8(b + Q3_K_scales + g % 8, m) >> (4 * (g // 8))) & 0xF
        hi = (_u8(b + Q3_K_scales + 8 + g % 4, m) >> (2 * (g // 4))) & 3
        return _f16(b + Q3_K_d, m) * ((lo | (hi << 4)) - 32).to(tl.float32), zero, iz
    elif FMT == Q4_K:
        sc, mn = _scale_min_k4(b + Q4_K_scales, g, m)
        return _f16(b + Q4_K_d, m) * sc.to(tl.float32), -(_f16(b + Q4_K_dmin, m) * mn.to(tl.float32)), iz
    elif FMT == Q5_K:
        sc, mn = _scale_min_k4(b + Q5_K_scales, g, m)
        return _f16(b + Q5_K_d, m) * sc.to(tl.float32), -(_f16(b + Q5_K_dmin, m) * mn.to(tl.float32)), iz
    elif FMT == Q6_K:
        return _f16(b + Q6_K_d, m) * _i8(b + Q6_K_scales + g, m).to(tl.float32), zero, iz
    elif FMT == IQ4_XS:
        sl = (_u8(b + IQ4_XS_scales_l + g // 2, m) >> (4 * (g % 2))) & 0xF
        sh = (_u16(b + IQ4_XS_scales_h, m) >> (2 * g)) & 3
        return _f16(b + IQ4_XS_d, m) * ((sl | (sh << 4)) - 32).to(tl.float32), zero, iz
    elif FMT == TQ1_0:
        return _f16(b + TQ1_0_d, m), zero, iz
    elif FMT == TQ2_0:
        return _f16(b + TQ2_0_d, m), zero, iz
    elif FMT == MXFP4:
        e = _u8(b + MXFP4_e, m)
        return tl.where(e < 2, (0x00200000 << e), (e - 1) << 23).to(tl.float32, bitcast=True), zero, iz
    elif FMT == IQ2_XXS:
        aux = _u32(b + IQ2_XXS_qs + g * 8 + 4, m)
        return _f16(b + IQ2_XXS_d, m) * (0.5 + (aux >> 28).to(tl.float32)) * 0.25, zero, (aux & 0x0FFFFFFF).to(tl.int32)
    elif FMT == IQ2_XS:
        sc = (_u8(b + IQ2_XS_scales + g // 2, m) >> (4 * (g % 2))) & 0xF
        return _f16(b + IQ2_XS_d, m) * (0.5 + sc.to(tl.float32)) * 0.25, zero, iz
    elif FMT == IQ2_S:
        sc = (_u8(b + IQ2_S_scales + g // 2, m) >> (4 * (g % 2))) & 0xF
        return _f16(b + IQ2_S_d, m) * (0.5 + sc.to(tl.float32)) * 0.25, zero, iz
    elif FMT == IQ3_XXS:
        aux = _u32(b + IQ3_XXS_qs + 64 + g * 4, m)
        return _f16(b + IQ3_XXS_d, m) * (0.5 + (aux >> 28).to(tl.float32)) * 0.5, zero, (aux & 0x0FFFFFFF).to(tl.int32)
    elif FMT == IQ3_S:
        sc = (_u8(b + IQ3_S_scales + g // 2, m) >> (4 * (g % 2))) & 0xF
        return _f16(b + IQ3_S_d, m) * (1 + 2 * sc).to(tl.float32), zero, iz
    elif FMT == IQ1_S:
        qh = _u16(b + IQ1_S_qh + g * 2, m)
        dl = _f16(b + IQ1_S_d, m) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
        return dl, dl * tl.where((qh & 0x8000) == 0, 0.125, -0.125), qh
    elif FMT == IQ1_M:
        s0 = _u16(b + IQ1_M_scales, m)
        s1 = _u16(b + IQ1_M_scales + 2, m)
        s2 = _u16(b + IQ1_M_scales + 4, m)
        s3 = _u16(b + IQ1_M_scales + 6, m)
        d = _f16_bits(((s0 & 0xF000) >> 12) | ((s1 & 0xF000) >> 8) | ((s2 & 0xF000) >> 4) | (s3 & 0xF000))
        t = g // 2
        sc = (_u16(b + IQ1_M_scales + 2 * (t // 4), m) >> (3 * (t % 4))) & 7
        dl = d * (2 * sc + 1).to(tl.float32)
        qh = (_u8(b + IQ1_M_qh + g // 2, m) >> (4 * (g % 2))) & 0xF
        return dl, dl * tl.where((qh & 8) == 0, 0.125, -0.125), qh
    else:
        tl.static_assert(FMT == NVFP4, "group_params: format without a grouped rule")
        x = _u8(b + NVFP4_d + g, m)
        ex = (x >> 3) & 0xF
        man = (x & 7).to(tl.float32)
        nrm = (1.0 + man / 8.0) * ((ex + 120) << 23).to(tl.float32, bitcast=True)
        raw = tl.where(ex == 0, man * 0.001953125, nrm)
        return tl.where((x == 0) | (x == 0x7F), 0.0, raw * 0.5), zero, iz


@triton.jit
def group_code(b, j, m, tab, aux, FMT: tl.constexpr):
    """float32 code of in-block value ``j``: the value is ``scale * code + offset`` of its group
    (``aux``: the group's payload from :func:`group_params`)."""
    if FMT == Q1_0:
        return _q1_0_sign(b, j, m).to(tl.float32)
    elif FMT == Q4_0:
        return (_nibble16(b + Q4_0_qs, j, m) - 8).to(tl.float32)
    elif FMT == Q4_1:
        return _nibble16(b + Q4_1_qs, j, m).to(tl.float32)
    elif FMT == Q5_0:
        qh = (_u8(b + Q5_0_qh + j // 8, m) >> (j % 8)) & 1
        return ((_nibble16(b + Q5_0_qs, j, m) | (qh << 4)) - 16).to(tl.float32)
    elif FMT == Q5_1:
        qh = (_u8(b + Q5_1_qh + j // 8, m) >> (j % 8)) & 1
        return (_nibble16(b + Q5_1_qs, j, m) | (qh << 4)).to(tl.float32)
    elif FMT == Q8_0:
        return _i8(b + Q8_0_qs + j, m).to(tl.float32)
    elif FMT == Q2_K:
        r = j % 128
        return ((_u8(b + Q2_K_qs + (j // 128) * 32 + r % 32, m) >> (2 * (r // 32))) & 3).to(tl.float32)
    elif FMT == Q3_K:
        hbit = (_u8(b + Q3_K_hmask + j % 32, m) >> (j // 32)) & 1
        r = j % 128
        ql = (_u8(b + Q3_K_qs + (j // 128) * 32 + r % 32, m) >> (2 * (r // 32))) & 3
        return (ql - ((1 - hbit) << 2)).to(tl.float32)
    elif FMT == Q4_K:
        return ((_u8(b + Q4_K_qs + (j // 64) * 32 + j % 32, m) >> (4 * ((j // 32) % 2))) & 0xF).to(tl.float32)
    elif FMT == Q5_K:
        ql = (_u8(b + Q5_K_qs + (j // 64) * 32 + j % 32, m) >> (4 * ((j // 32) % 2))) & 0xF
        qh = (_u8(b + Q5_K_qh + j % 32, m) >> (j // 32)) & 1
        return (ql | (qh << 4)).to(tl.float32)
    elif FMT == Q6_K:
        h = j // 128
        r = j % 128
        ql = (_u8(b + Q6_K_ql + h * 64 + r % 64, m) >> (4 * (r // 64))) & 0xF
        qh = (_u8(b + Q6_K_qh + h * 32 + r % 32, m) >> (2 * (r // 32))) & 3
        return ((ql | (qh << 4)) - 32).to(tl.float32)
    elif FMT == IQ4_NL:
        return tl.load(tab + _nibble16(b + IQ4_NL_qs, j, m), mask=m, other=0.0)
    elif FMT == IQ4_XS:
        ib = j // 32
        r = j % 32
        return tl.load(tab + ((_u8(b + IQ4_XS_qs + ib * 16 + r % 16, m) >> (4 * (r // 16))) & 0xF), mask=m, other=0.0)
    elif FMT == TQ1_0:
        return _tq1_code(b, j, m).to(tl.float32)
    elif FMT == TQ2_0:
        r = j % 128
        return (((_u8(b + TQ2_0_qs + (j // 128) * 32 + r % 32, m) >> (2 * (r // 32))) & 3) - 1).to(tl.float32)
    elif FMT == MXFP4:
        return tl.load(tab + _nibble16(b + MXFP4_qs, j, m), mask=m, other=0.0)
    elif FMT == IQ2_XXS:
        i = j % 8
        gv = tl.load(tab + _u8(b + IQ2_XXS_qs + (j // 32) * 8 + (j % 32) // 8, m) * 8 + i, mask=m, other=0.0)
        s7 = (aux >> (7 * ((j % 32) // 8))) & 127
        return tl.where(_sign8(s7, i) != 0, -gv, gv)
    elif FMT == IQ2_XS:
        i = j % 8
        q = _u16(b + IQ2_XS_qs + (j // 8) * 2, m)
        gv = tl.load(tab + (q & 511) * 8 + i, mask=m, other=0.0)
        return tl.where(_sign8(q >> 9, i) != 0, -gv, gv)
    elif FMT == IQ2_S:
        gi = j // 8
        i = j % 8
        idx = _u8(b + IQ2_S_qs + gi, m) | (((_u8(b + IQ2_S_qh + gi // 4, m) >> (2 * (gi % 4))) & 3) << 8)
        gv = tl.load(tab + idx * 8 + i, mask=m, other=0.0)
        return tl.where(((_u8(b + IQ2_S_qs + 32 + gi, m) >> i) & 1) != 0, -gv, gv)
    elif FMT == IQ3_XXS:
        i = j % 8
        gv = tl.load(tab + _u8(b + IQ3_XXS_qs + j // 4, m) * 4 + j % 4, mask=m, other=0.0)
        s7 = (aux >> (7 * ((j % 32) // 8))) & 127
        return tl.where(_sign8(s7, i) != 0, -gv, gv)
    elif FMT == IQ3_S:
        qi = j // 4
        idx = _u8(b + IQ3_S_qs + qi, m) | (((_u8(b + IQ3_S_qh + qi // 8, m) >> (qi % 8)) & 1) << 8)
        gv = tl.load(tab + idx * 4 + j % 4, mask=m, other=0.0)
        return tl.where(((_u8(b + IQ3_S_signs + j // 8, m) >> (j % 8)) & 1) != 0, -gv, gv)
    elif FMT == IQ1_S:
        l = (j % 32) // 8
        idx = _u8(b + IQ1_S_qs + (j // 32) * 4 + l, m) | (((aux >> (3 * l)) & 7) << 8)
        return tl.load(tab + idx * 8 + j % 8, mask=m, other=0.0)
    elif FMT == IQ1_M:
        idx = _u8(b + IQ1_M_qs + j // 8, m) | ((aux & 7) << 8)
        return tl.load(tab + idx * 8 + j % 8, mask=m, other=0.0)
    else:
        tl.static_assert(FMT == NVFP4, "group_code: format without a grouped rule")
        s = j // 16
        r = j % 16
        return tl.load(tab + ((_u8(b + NVFP4_qs + s * 8 + r % 8, m) >> (4 * (r // 8))) & 0xF), mask=m, other=0.0)


# ---------------------------------------------------------------------------------------------
# The rule table, as data: the element rule of ggml format <NAME> is ``_unpack_<name>`` above
# (its grouped rule is its arm of group_params / group_code); tests/test_backends_contract.py
# checks that the two agree.

RULE_NAMES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "TQ1_0", "TQ2_0",
              "MXFP4", "NVFP4", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S",
              "IQ1_M", "F32", "F16", "BF16", "Q1_0")
"""ggml names of the formats with a Triton unpack rule."""
_RULE_NAMES = RULE_NAMES

SUPPORTED: dict[str, int] = {n: FORMATS[n].type_id for n in FORMATS if n in _RULE_NAMES}
"""The formats the unpack rules cover that the registry holds: ggml name -> ggml type id."""

GROUP_LEN: dict[str, int] = {n: FORMATS[n].group_len for n in SUPPORTED if FORMATS[n].group_len}
"""Values per (scale, offset) group of the formats that have a grouped rule (the registry's
``group_len``; every quantized format has one, the dense ones use the element rules)."""


def _constants() -> dict:
    """The compile-time constants of the rules, from the format registry: ``<NAME>`` the ggml type
    id of each format (the kernels' ``FMT``; -1 for a rule whose format this gguf does not know,
    so its branches never match), ``<NAME>_<field>`` the byte offset of each field of its block
    struct (``Q2_K_d`` = 80). The rules read bytes only through these names; Triton resolves
    them when a kernel is first compiled."""
    out = {n: tl.constexpr(SUPPORTED.get(n, -1)) for n in _RULE_NAMES}
    for name in SUPPORTED:
        for f in FORMATS[name].fields:
            out[f"{name}_{f.name}"] = tl.constexpr(f.offset)
    return out


globals().update(_constants())
