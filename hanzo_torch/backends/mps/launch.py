"""The launch code of the Metal kernels: for each ``hanzo`` op, which kernels to dispatch, with
what push constants, buffers and threadgroups.

The same code drives a Mac (:class:`..metal.MetalRunner`: ``torch.mps.compile_shader``) and the
CPU harness (:class:`..sim.SimRunner`): every op function takes a *runner* first and hands it
:class:`Launch` descriptions; :func:`encode` turns one into the kernel's argument list from its
manifest signature (``kernels.json``). The choices (mat-vec up to
:data:`~hanzo_torch.constants.VULKAN_MATVEC_MAX_ROWS` rows, GEMM tiles, the expert sort of
``mul_mat_id``, the key split of decode attention, the prefill kernel) are those of the Vulkan
backend (``csrc/vulkan/ops_quant.cpp``, ``ops_fused.cpp``), whose shaders these kernels are.

A call the kernels do not fit (a format without a translation, a dtype or shape the shader was
not written for, tensors on another device) runs the op's reference,
``torch.ops.hanzo_ref.<op>``, which also raises the op's errors for bad arguments. Ids and
positions are read by the kernels, never on the host: an expert or row id out of range gives NaN
in its output row, as on Vulkan.

Pointer push-constant fields hold ``1 + byte offset`` into the tensor bound for them, 0 for none
(:mod:`..generate`).
"""
from __future__ import annotations

import contextlib
import struct
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from ...constants import Q8_0_BLOCK, Q8_1_BLOCK, Q8_1_BYTES, VULKAN_MATVEC_MAX_ROWS, q8_0_row_bytes

__all__ = ["Launch", "encode", "formats", "int8_formats", "use_int8", "OPS", "MATVEC_MAX_ROWS"]

MATVEC_MAX_ROWS = VULKAN_MATVEC_MAX_ROWS
"""Activation rows up to which ``mul_mat`` runs the mat-vec kernel (HZ_MV_MAX_M of mul_mat_vec.comp)."""
TILE = 64                 # BM = BN of mul_mat.comp
MAX_GROUPS = 65535        # threadgroups per grid dimension the launch code uses (Vulkan's minimum)
ID_GROUPED_PAIRS = 16     # (token, slot) pairs from which mul_mat_id sorts them by expert
ID_CHUNK = 8              # HZ_CHUNK of mul_mat_id.comp
ID_MAX_EXPERTS = 4096     # MAX_E of mul_mat_id_sort.comp
QKKV_MAX_D = 1024         # FZ_MAX_D of qk_norm_rope_kv_write.comp
ATTN_CHUNK, ATTN_BUSY_GROUPS, ATTN_MAX_SPLIT = 64, 128, 32
ATTN_PREFILL_TOKENS, ATTN_PREFILL_ROWS, ATTN_PREFILL_ACC, ATTN_PREFILL_KV = 8, 64, 4096, 1024
MAX_INDEX = 1 << 31       # the kernels index elements with 32-bit integers
U32 = (1 << 32) - 1

_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_Q8_0 = 3

INT8 = False
"""Whether ``mul_mat`` (and ``swiglu_mul_mat``'s projections) of the formats with int8 kernels
quantize the activations to q8_1 and run ``mul_mat_vec_q8`` / ``mul_mat_q8``. Off by default:
Metal has no packed int8 dot product, the translation does four byte products instead (see
:mod:`..generate`), so nothing says it pays; :func:`use_int8` for an A/B."""


@contextlib.contextmanager
def use_int8(enabled: bool = True) -> Iterator[None]:
    """Within the block, the int8 path of the contractions is ``enabled``; restored after."""
    global INT8
    prev, INT8 = INT8, bool(enabled)
    try:
        yield
    finally:
        INT8 = prev


@dataclass
class Launch:
    """One dispatch: kernel ``entry`` (a key of the manifest), the push-constant values ``push``
    (field -> int or float; fields not given are 0), ``bind`` (pointer or storage field ->
    ``(tensor, byte offset)``; a field not given is "no tensor"), ``groups`` threadgroups (x, y, z)."""

    entry: str
    push: dict
    bind: dict
    groups: tuple
    sig: dict = field(default=None, repr=False)


_PACK = {"ulong": "Q", "long": "q", "uint": "I", "int": "i", "float": "f", "ushort": "H", "short": "h",
         "uchar": "B", "char": "b"}


def _manifest() -> dict:
    from . import generate

    global _MANIFEST
    if _MANIFEST is None:
        _MANIFEST = generate.manifest()["kernels"]
    return _MANIFEST


_MANIFEST: Optional[dict] = None


def encode(launch: Launch) -> tuple:
    """``(signature, push bytes, [(tensor or None, byte offset) per bound buffer 1..])`` of a
    launch: the push constants packed at the manifest's offsets (pointer fields as 1 + offset),
    the buffers in the kernel's argument order.

    Raises:
        KeyError: an unknown kernel, or a push or bind field the kernel does not have.
    """
    sig = _manifest()[launch.entry]
    fields = {f[0]: f for f in sig["push"]}
    buf = bytearray(sig["push_size"])
    for name in list(launch.push) + list(launch.bind):
        if name not in fields and not any(b[0] in (name, "hz_" + name) for b in sig["buffers"]):
            raise KeyError(f"{launch.entry}: no push-constant field {name!r}")
    for name, value in launch.push.items():
        _, ctype, off, _ = fields[name]
        struct.pack_into("<" + _PACK[ctype], buf, off, value)
    buffers = []
    for name, index, kind in sig["buffers"][1:]:
        key = name[3:] if kind == "storage" and name.startswith("hz_") else name
        b = launch.bind.get(key)
        buffers.append(b)
    for name, b in launch.bind.items():
        if name in fields and fields[name][1] == "ulong":
            struct.pack_into("<Q", buf, fields[name][2], 0 if b is None else 1 + b[1])
    return sig, bytes(buf), buffers


def _groups(n: int) -> tuple:
    """(gx, gy) threadgroups covering ``n`` with gx <= MAX_GROUPS (the kernels index x + gx * y)."""
    gx = min(n, MAX_GROUPS)
    return gx, (0 if gx == 0 else -(-n // gx))


def _variants(shader: str) -> dict:
    return {s["variant"]: s for s in _manifest().values() if s["shader"] == shader}


def formats() -> tuple:
    """The ggml formats with Metal kernels (the per-format translations of ``dequantize``)."""
    return tuple(_variants("dequantize"))


def int8_formats() -> tuple:
    """The formats with int8 contraction kernels (``mul_mat_q8`` translations)."""
    return tuple(_variants("mul_mat_q8"))


# ---------------------------------------------------------------------------------------------- device tables
_tables_lock = threading.Lock()
_tables: dict = {}


def _grid_table(qtype: str, device: torch.device) -> Optional[torch.Tensor]:
    """The format's large int8 table (an i-quant grid) on ``device``, or None (the small tables
    are constants of the kernels)."""
    from ...formats import get_format
    from ...formats.codegen import INLINE_TABLE_MAX

    key = ("grid", qtype, str(device))
    with _tables_lock:
        if key not in _tables:
            big = [t.cpu for t in get_format(qtype).tables.values() if t.cpu.numel() > INLINE_TABLE_MAX]
            if len(big) > 1:
                raise RuntimeError(f"{qtype}: the kernels read one large table per format, it has {len(big)}")
            _tables[key] = big[0].reshape(-1).to(torch.int8).contiguous().to(device) if big else None
        return _tables[key]


def _inv_freq(theta: float, D: int, device: torch.device) -> torch.Tensor:
    """1 / theta^(2i / D), float32 [D/2], by the reference's torch calls; once per (theta, D, device)."""
    key = ("inv_freq", float(theta), D, str(device))
    with _tables_lock:
        if key not in _tables:
            exponent = torch.arange(0, D, 2, dtype=torch.long).to(torch.float32) / D
            _tables[key] = torch.pow(theta, exponent).reciprocal().to(device)
        return _tables[key]


def _counters(n: int, device: torch.device) -> torch.Tensor:
    """The split attention's completion counters (int32 zeros, left at 0 by the kernel), grown on demand."""
    key = ("counters", str(device))
    with _tables_lock:
        c = _tables.get(key)
        if c is None or c.numel() < n:
            c = _tables[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        return c


# ---------------------------------------------------------------------------------------------- fit tests
def _on(runner, *ts) -> bool:
    return all(t.device.type == runner.device.type for t in ts)


def _act(runner, t) -> bool:
    return isinstance(t, torch.Tensor) and _on(runner, t) and t.dtype in _DT


def _ids(runner, t) -> bool:
    return isinstance(t, torch.Tensor) and _on(runner, t) and t.dtype in (torch.int32, torch.int64)


def _fmt(qtype: str):
    """(block size, type size) of a format with kernels, or None."""
    if qtype not in _variants("dequantize"):
        return None
    from ...formats import get_format

    f = get_format(qtype)
    return f.block_size, f.type_size


def _packed_ok(runner, w, dims, qtype, K):
    if not (isinstance(w, torch.Tensor) and _on(runner, w) and w.dtype == torch.uint8 and w.dim() == dims):
        return None
    f = _fmt(qtype)
    if f is None or K % f[0] != 0 or w.shape[-1] != K // f[0] * f[1]:
        return None
    return f


def _leading(x) -> int:
    m = 1
    for s in x.shape[:-1]:
        m *= s
    return m


def _ref(op):
    return getattr(torch.ops.hanzo_ref, op)


def _b(t, offset: int = 0):
    return None if t is None else (t, offset)


def _int8_for(qtype: str, K: int) -> bool:
    return INT8 and K % Q8_1_BLOCK == 0 and qtype in _variants("mul_mat_q8")


# ---------------------------------------------------------------------------------------------- quantized ops
def _quantize_q8_1(runner, x2):
    R, K = x2.shape
    out = torch.empty(R, K // Q8_1_BLOCK * Q8_1_BYTES, dtype=torch.uint8, device=x2.device)
    n = R * (K // Q8_1_BLOCK)
    if n == 0:
        return out
    gx, gy = _groups(-(-n // 64))
    runner.launch(Launch("hz_quantize_q8_1", {"n_blocks": n, "blocks_per_row": K // Q8_1_BLOCK, "x_stride": K,
                                              "x_dtype": _DT[x2.dtype]},
                         {"x": _b(x2), "y": _b(out)}, (gx, gy, 1)))
    return out


def _mul_mat(runner, x2, w, qtype, y, xq=None):
    """y [M, N] = x2 [M, K] @ W^T (w packed [N, rb], contiguous)."""
    M, K = x2.shape
    N = w.shape[0]
    if N > U32 or K > U32 or w.shape[1] > U32:
        raise RuntimeError("hanzo mps mul_mat: weight too large")
    int8 = _int8_for(qtype, K)
    push = {"N": N, "K": K, "M": 0, "row_bytes": w.shape[1], "x_stride": K, "y_stride": N,
            "x_dtype": _DT[x2.dtype], "y_dtype": _DT[y.dtype]}
    xt, x_row_bytes = x2, K * x2.element_size()
    if int8:
        xt = _quantize_q8_1(runner, x2) if xq is None else xq
        x_row_bytes = K // Q8_1_BLOCK * Q8_1_BYTES
        push["x_stride"] = x_row_bytes
    table = _grid_table(qtype, x2.device)
    if M <= MATVEC_MAX_ROWS:
        push["M"] = M
        gx, gy = _groups(N)
        runner.launch(Launch(f"hz_{'mul_mat_vec_q8' if int8 else 'mul_mat_vec'}_{qtype}", push,
                             {"w": _b(w), "x": _b(xt), "y": _b(y), "table": _b(table)}, (gx, gy, 1)))
        return
    rows_per = MAX_GROUPS * TILE
    entry = f"hz_{'mul_mat_q8' if int8 else 'mul_mat'}_{qtype}"
    for m0 in range(0, M, rows_per):
        m = min(rows_per, M - m0)
        runner.launch(Launch(entry, dict(push, M=m),
                             {"w": _b(w), "x": _b(xt, m0 * x_row_bytes), "y": _b(y, m0 * N * y.element_size()),
                              "table": _b(table)}, (-(-N // TILE), -(-m // TILE), 1)))


def mul_mat(runner, x, w, qtype):
    """``hanzo::mul_mat`` (x [..., K] @ W^T) through ``runner``."""
    f = _packed_ok(runner, w, 2, qtype, x.shape[-1]) if _act(runner, x) and x.dim() >= 1 else None
    if f is None:
        return _ref("mul_mat")(x, w, qtype)
    K, N, M = x.shape[-1], w.shape[0], _leading(x)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M > 0 and N > 0:
        if K == 0:
            y.zero_()
        else:
            _mul_mat(runner, x.reshape(M, K).contiguous(), w.contiguous(), qtype, y)
    return y.view(*x.shape[:-1], N)


def mul_mat_id(runner, x, w, ids, qtype):
    """``hanzo::mul_mat_id`` (per (token, slot) the expert ``ids[t, s]``'s x @ W_e^T)."""
    ok = (_act(runner, x) and x.dim() in (2, 3) and _ids(runner, ids) and ids.dim() == 2 and
          _packed_ok(runner, w, 3, qtype, x.shape[-1]) is not None)
    if ok:
        ok = x.shape[0] == ids.shape[0] and (x.dim() == 2 or x.shape[1] == ids.shape[1])
    if not ok:
        return _ref("mul_mat_id")(x, w, ids, qtype)
    T, k = ids.shape
    E, N, K = w.shape[0], w.shape[1], x.shape[-1]
    out = torch.empty(T, k, N, dtype=x.dtype, device=x.device)
    if T * k == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    xc, wc, idc = x.contiguous(), w.contiguous(), ids.contiguous()
    ids64 = 1 if ids.dtype == torch.int64 else 0
    push = {"N": N, "K": K, "E": E, "row_bytes": w.shape[2], "n_pairs": T * k, "n_slots": k, "p0": 0,
            "x_per_slot": 1 if x.dim() == 3 else 0, "x_dtype": _DT[x.dtype], "y_dtype": _DT[x.dtype],
            "ids_int64": ids64}
    bind = {"w": _b(wc), "x": _b(xc), "y": _b(out), "ids": _b(idc), "table": _b(_grid_table(qtype, x.device))}
    gx, gy = _groups(N)
    entry = f"hz_mul_mat_id_{qtype}"
    n = T * k
    if n >= ID_GROUPED_PAIRS and E <= ID_MAX_EXPERTS and n <= (1 << 31) - 1:
        # a counting sort of the pairs by expert on the device, then chunks of sorted pairs
        order = torch.empty(n, dtype=torch.int32, device=x.device)
        expert = torch.empty(n, dtype=torch.int32, device=x.device)
        runner.launch(Launch("hz_mul_mat_id_sort", {"n_pairs": n, "E": E, "ids_int64": ids64},
                             {"ids": _b(idc), "order": _b(order), "expert": _b(expert)}, (1, 1, 1)))
        bind.update(order=_b(order), expert=_b(expert))
        per = MAX_GROUPS * ID_CHUNK
        for p0 in range(0, n, per):
            runner.launch(Launch(entry, dict(push, p0=p0), bind, (gx, gy, -(-min(per, n - p0) // ID_CHUNK))))
        return out
    for p0 in range(0, n, MAX_GROUPS):
        runner.launch(Launch(entry, dict(push, p0=p0), bind, (gx, gy, min(MAX_GROUPS, n - p0))))
    return out


SWIGLU_FUSED = True
"""Decode-sized ``swiglu_mul_mat`` (gate and up of one format, float path) as one dispatch of
``swiglu_mul_mat_vec`` instead of two mat-vecs and the epilogue (assign False for an A/B)."""


def swiglu_mul_mat(runner, x, wg, wu, qg, qu):
    """``hanzo::swiglu_mul_mat`` (silu(x @ Wg^T) * (x @ Wu^T))."""
    ok = _act(runner, x) and x.dim() >= 1
    if ok:
        ok = (_packed_ok(runner, wg, 2, qg, x.shape[-1]) is not None and
              _packed_ok(runner, wu, 2, qu, x.shape[-1]) is not None and wg.shape[0] == wu.shape[0])
    if not ok:
        return _ref("swiglu_mul_mat")(x, wg, wu, qg, qu)
    K, F, M = x.shape[-1], wg.shape[0], _leading(x)
    y = torch.empty(M, F, dtype=x.dtype, device=x.device)
    if M == 0 or F == 0:
        return y.view(*x.shape[:-1], F)
    if K == 0:
        return y.zero_().view(*x.shape[:-1], F)
    x2 = x.reshape(M, K).contiguous()
    dt = _DT[x.dtype]
    if M <= MATVEC_MAX_ROWS and qg == qu and not _int8_for(qg, K) and SWIGLU_FUSED:
        gx, gy = _groups(F)
        runner.launch(Launch(f"hz_swiglu_mul_mat_vec_{qg}",
                             {"N": F, "K": K, "M": M, "row_bytes": wg.shape[1], "x_stride": K, "y_stride": F,
                              "x_dtype": dt, "y_dtype": dt, "round_dtype": dt},
                             {"wg": _b(wg.contiguous()), "wu": _b(wu.contiguous()), "x": _b(x2), "y": _b(y),
                              "table": _b(_grid_table(qg, x.device))}, (gx, gy, 1)))
        return y.view(*x.shape[:-1], F)
    g = torch.empty(M, F, dtype=torch.float32, device=x.device)
    u = torch.empty(M, F, dtype=torch.float32, device=x.device)
    xq = _quantize_q8_1(runner, x2) if _int8_for(qg, K) or _int8_for(qu, K) else None
    _mul_mat(runner, x2, wg.contiguous(), qg, g, xq)
    _mul_mat(runner, x2, wu.contiguous(), qu, u, xq)
    n = M * F
    if n > U32:
        raise RuntimeError("hanzo mps swiglu_mul_mat: output too large")
    groups = -(-n // 256)
    runner.launch(Launch("hz_swiglu_mul_mat", {"n": n, "round_dtype": dt, "out_dtype": dt},
                         {"g": _b(g), "u": _b(u), "dst": _b(y)},
                         (min(groups, MAX_GROUPS), -(-groups // MAX_GROUPS), 1)))
    return y.view(*x.shape[:-1], F)


def _dequantize(runner, src, n_src, rb, K, ids, n_rows, qtype, out):
    if max(K, rb, n_src, n_rows) > U32:
        raise RuntimeError("hanzo mps dequantize: tensor too large")
    runner.launch(Launch(f"hz_dequantize_{qtype}",
                         {"row_bytes": rb, "K": K, "n_rows": n_rows, "r0": 0, "n_src": n_src,
                          "out_dtype": _DT[out.dtype], "ids_int64": 1 if ids is not None and ids.dtype == torch.int64 else 0},
                         {"src": _b(src), "dst": _b(out), "ids": _b(ids), "table": _b(_grid_table(qtype, src.device))},
                         (-(-K // 256), min(n_rows, MAX_GROUPS), -(-n_rows // MAX_GROUPS))))


def get_rows(runner, w, ids, qtype, dtype):
    """``hanzo::get_rows`` (rows ``ids`` of the packed w, dequantized to ``dtype``)."""
    f = None
    if (isinstance(w, torch.Tensor) and _on(runner, w) and w.dtype == torch.uint8 and w.dim() == 2 and
            _ids(runner, ids) and dtype in _DT):
        f = _fmt(qtype)
    if f is None or w.shape[1] % f[1] != 0:
        return _ref("get_rows")(w, ids, qtype, dtype)
    rb = w.shape[1]
    K, n = rb // f[1] * f[0], ids.numel()
    out = torch.empty(*ids.shape, K, dtype=dtype, device=w.device)
    if n == 0 or K == 0:
        return out
    _dequantize(runner, w.contiguous(), w.shape[0], rb, K, ids.contiguous(), n, qtype, out)
    return out


def dequantize(runner, data, qtype, shape, dtype):
    """``hanzo::dequantize`` (the packed ``data`` as ``dtype`` values of ``shape``)."""
    f = None
    shape = [int(s) for s in shape]
    if (isinstance(data, torch.Tensor) and _on(runner, data) and data.dtype == torch.uint8 and shape and
            dtype in _DT):
        f = _fmt(qtype)
    if f is not None:
        K = shape[-1]
        rows = 1
        for s in shape[:-1]:
            rows *= s
        ok = K > 0 and K % f[0] == 0 and rows > 0 and data.numel() == rows * (K // f[0] * f[1])
        if not ok:
            f = None
    if f is None:
        return _ref("dequantize")(data, qtype, shape, dtype)
    out = torch.empty(shape, dtype=dtype, device=data.device)
    _dequantize(runner, data.contiguous(), rows, K // f[0] * f[1], K, None, rows, qtype, out)
    return out


def quantize_q8_1(runner, x):
    """``hanzo::quantize_q8_1`` (ggml q8_1 blocks of the rows of x)."""
    if not _act(runner, x) or x.dim() < 1 or x.shape[-1] % Q8_1_BLOCK != 0:
        return _ref("quantize_q8_1")(x)
    K, R = x.shape[-1], _leading(x)
    return _quantize_q8_1(runner, x.reshape(R, K).contiguous()).view(*x.shape[:-1], K // Q8_1_BLOCK * Q8_1_BYTES)


# ---------------------------------------------------------------------------------------------- fused ops
def _fused_groups(groups: int) -> tuple:
    gx = min(groups, MAX_GROUPS)
    gy = -(-groups // gx)
    if gy > MAX_GROUPS:
        raise RuntimeError(f"hanzo mps: {groups} threadgroups is more than one dispatch holds")
    return gx, gy, 1


def _norm_ok(runner, x, w) -> bool:
    return (_act(runner, x) and _act(runner, w) and w.dim() == 1 and x.dim() >= 1 and w.shape[0] == x.shape[-1] and
            x.numel() < MAX_INDEX)


def rms_norm(runner, x, w, eps):
    """``hanzo::rms_norm``."""
    if not _norm_ok(runner, x, w):
        return _ref("rms_norm")(x, w, eps)
    x, w = x.contiguous(), w.contiguous()
    y = torch.empty_like(x)
    H = x.shape[-1]
    rows = x.numel() // H if H else 0
    if rows == 0 or H == 0:
        return y
    runner.launch(Launch("hz_rms_norm", {"rows": rows, "H": H, "dt": _DT[x.dtype], "dt_w": _DT[w.dtype], "eps": eps},
                         {"x": _b(x), "w": _b(w), "y": _b(y)}, _fused_groups(rows)))
    return y


def add_rms_norm(runner, x, r, w, eps):
    """``hanzo::add_rms_norm`` (``(rms_norm(x + r, w), x + r)``)."""
    if not (_norm_ok(runner, x, w) and _act(runner, r) and r.dtype == x.dtype and r.shape == x.shape):
        return _ref("add_rms_norm")(x, r, w, eps)
    x, r, w = x.contiguous(), r.contiguous(), w.contiguous()
    y, s = torch.empty_like(x), torch.empty_like(x)
    H = x.shape[-1]
    rows = x.numel() // H if H else 0
    if rows == 0 or H == 0:
        return y, s
    runner.launch(Launch("hz_add_rms_norm",
                         {"rows": rows, "H": H, "dt": _DT[x.dtype], "dt_w": _DT[w.dtype], "eps": eps},
                         {"x": _b(x), "r": _b(r), "w": _b(w), "y": _b(y), "s": _b(s)}, _fused_groups(rows)))
    return y, s


def swiglu(runner, g, u):
    """``hanzo::swiglu`` (silu(g) * u)."""
    if not (_act(runner, g) and _act(runner, u) and u.dtype == g.dtype and g.shape == u.shape and
            g.numel() < MAX_INDEX):
        return _ref("swiglu")(g, u)
    g, u = g.contiguous(), u.contiguous()
    y = torch.empty_like(g)
    n = g.numel()
    if n:
        runner.launch(Launch("hz_swiglu", {"n": n, "dt": _DT[g.dtype]}, {"g": _b(g), "u": _b(u), "y": _b(y)},
                             _fused_groups(-(-n // 128))))
    return y


def _positions_ok(runner, pos, B, T) -> bool:
    return (isinstance(pos, torch.Tensor) and _on(runner, pos) and pos.dim() == 2 and tuple(pos.shape) == (B, T) and
            pos.dtype in (torch.int64, torch.int32))


def _cache_code(runner, c, D):
    """dtype code of a KV cache [B, S, Hk, D] (f32/f16/bf16, or q8_0 rows uint8 [.., D/32*34]), or None."""
    if not (isinstance(c, torch.Tensor) and _on(runner, c) and c.dim() == 4):
        return None
    if c.dtype == torch.uint8:
        return _Q8_0 if D % Q8_0_BLOCK == 0 and c.shape[3] == q8_0_row_bytes(D) else None
    return _DT[c.dtype] if c.dtype in _DT and c.shape[3] == D else None


def _qk_ok(runner, q, k, qw, kw, pos) -> bool:
    ok = (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4 and k.dim() == 4 and
          _act(runner, q) and _act(runner, k) and k.dtype == q.dtype and q.numel() < MAX_INDEX and
          k.numel() < MAX_INDEX)
    if ok:
        B, T, D = q.shape[0], q.shape[1], q.shape[3]
        ok = (k.shape[0] == B and k.shape[1] == T and k.shape[3] == D and D % 2 == 0 and
              _positions_ok(runner, pos, B, T) and (qw is None) == (kw is None))
        if ok and qw is not None:
            ok = (qw.dim() == 1 and qw.shape[0] == D and kw.dim() == 1 and kw.shape[0] == D and _act(runner, qw) and
                  _act(runner, kw) and kw.dtype == qw.dtype)
    return ok


def qk_norm_rope(runner, q, k, qw, kw, pos, theta, eps):
    """``hanzo::qk_norm_rope`` (per-head RMS norm of q and k, where weights are given, then RoPE)."""
    if not _qk_ok(runner, q, k, qw, kw, pos):
        return _ref("qk_norm_rope")(q, k, qw, kw, pos, theta, eps)
    q, k, pos = q.contiguous(), k.contiguous(), pos.contiguous()
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    rows = B * T * (Hq + Hk)
    if rows == 0 or D == 0:
        return qo, ko
    qw = None if qw is None else qw.contiguous()
    kw = None if kw is None else kw.contiguous()
    runner.launch(Launch("hz_qk_norm_rope",
                         {"BT": B * T, "Hq": Hq, "Hk": Hk, "D": D, "dt": _DT[q.dtype],
                          "dt_w": _DT[qw.dtype] if qw is not None else 0, "pos32": 1 if pos.dtype == torch.int32 else 0,
                          "norm": 1 if qw is not None else 0, "eps": eps},
                         {"q": _b(q), "k": _b(k), "qo": _b(qo), "ko": _b(ko), "qw": _b(qw), "kw": _b(kw),
                          "pos": _b(pos), "inv_freq": _b(_inv_freq(theta, D, q.device))}, _fused_groups(rows)))
    return qo, ko


def _kv_ok(runner, kc, vc, k, v, pos):
    """The caches' dtype code when kv_cache_write's kernel takes the call, else None."""
    ok = (isinstance(kc, torch.Tensor) and isinstance(vc, torch.Tensor) and kc.dim() == 4 and k.dim() == 4 and
          kc.shape == vc.shape and k.shape == v.shape and _act(runner, k) and _act(runner, v) and v.dtype == k.dtype and
          kc.is_contiguous() and vc.is_contiguous() and k.numel() < MAX_INDEX)
    if not ok:
        return None
    D = k.shape[3]
    dc, dvc = _cache_code(runner, kc, D), _cache_code(runner, vc, D)
    if dc is None or dc != dvc or k.shape[0] != kc.shape[0] or k.shape[2] != kc.shape[2] or kc.shape[1] >= MAX_INDEX:
        return None
    return dc if _positions_ok(runner, pos, k.shape[0], k.shape[1]) else None


def kv_cache_write(runner, kc, vc, k, v, pos):
    """``hanzo::kv_cache_write`` (in place: rows k, v into the caches at ``pos``; a position
    outside [0, S) is skipped)."""
    dc = _kv_ok(runner, kc, vc, k, v, pos)
    if dc is None:
        _ref("kv_cache_write")(kc, vc, k, v, pos)
        return
    k, v, pos = k.contiguous(), v.contiguous(), pos.contiguous()
    B, T, Hk, D = k.shape
    if B * T * Hk == 0 or D == 0:
        return
    runner.launch(Launch("hz_kv_cache_write",
                         {"BT": B * T, "T": T, "S": kc.shape[1], "Hk": Hk, "D": D, "dt": _DT[k.dtype], "dt_c": dc,
                          "pos32": 1 if pos.dtype == torch.int32 else 0},
                         {"kc": _b(kc), "vc": _b(vc), "k": _b(k), "v": _b(v), "pos": _b(pos)},
                         _fused_groups(B * T * Hk)))


def qk_norm_rope_kv_write(runner, q, k, v, qw, kw, kc, vc, pos, theta, eps):
    """``hanzo::qk_norm_rope_kv_write`` (qk_norm_rope, then k and v into the caches; returns q)."""
    dc = None
    if _qk_ok(runner, q, k, qw, kw, pos) and _act(runner, v) and v.dtype == q.dtype and v.shape == k.shape:
        dc = _kv_ok(runner, kc, vc, k, v, pos)
        if dc is not None and (kc.shape[0] != q.shape[0]):
            dc = None
    if dc is None:
        return _ref("qk_norm_rope_kv_write")(q, k, v, qw, kw, kc, vc, pos, theta, eps)
    if q.shape[3] > QKKV_MAX_D:
        qo, ko = qk_norm_rope(runner, q, k, qw, kw, pos, theta, eps)
        kv_cache_write(runner, kc, vc, ko, v, pos)
        return qo
    q, k, v, pos = q.contiguous(), k.contiguous(), v.contiguous(), pos.contiguous()
    qo = torch.empty_like(q)
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    rows = B * T * (Hq + Hk)
    if rows == 0 or D == 0:
        return qo
    qw = None if qw is None else qw.contiguous()
    kw = None if kw is None else kw.contiguous()
    runner.launch(Launch("hz_qk_norm_rope_kv_write",
                         {"BT": B * T, "T": T, "S": kc.shape[1], "Hq": Hq, "Hk": Hk, "D": D, "dt": _DT[q.dtype],
                          "dt_w": _DT[qw.dtype] if qw is not None else 0, "dt_c": dc,
                          "pos32": 1 if pos.dtype == torch.int32 else 0, "norm": 1 if qw is not None else 0,
                          "eps": eps},
                         {"q": _b(q), "k": _b(k), "v": _b(v), "qo": _b(qo), "kc": _b(kc), "vc": _b(vc), "qw": _b(qw),
                          "kw": _b(kw), "pos": _b(pos), "inv_freq": _b(_inv_freq(theta, D, q.device))},
                         _fused_groups(rows)))
    return qo


def attention(runner, q, kc, vc, pos, scale, impl):
    """``hanzo::attention`` over the KV caches (float32 softmax and P*V, one rounding of the output)."""
    dc = None
    if (impl in ("auto", "eager", "flash") and isinstance(q, torch.Tensor) and q.dim() == 4 and _act(runner, q) and
            isinstance(kc, torch.Tensor) and isinstance(vc, torch.Tensor) and kc.dim() == 4 and kc.shape == vc.shape and
            kc.is_contiguous() and vc.is_contiguous() and q.numel() < MAX_INDEX):
        B, T, Hq, D = q.shape
        Hk = kc.shape[2]
        dc, dvc = _cache_code(runner, kc, D), _cache_code(runner, vc, D)
        if not (kc.shape[0] == B and dc is not None and dc == dvc and Hk > 0 and Hq % Hk == 0 and Hq // Hk <= 16 and
                (Hq // Hk) * D <= 2048 and kc.shape[1] < MAX_INDEX and _positions_ok(runner, pos, B, T)):
            dc = None
    if dc is None:
        return _ref("attention")(q, kc, vc, pos, scale, impl)
    q, pos = q.contiguous(), pos.contiguous()
    out = torch.empty_like(q)
    B, T, Hq, D = q.shape
    S, Hk = kc.shape[1], kc.shape[2]
    items = B * T * Hk
    if items == 0 or D == 0:
        return out
    G = Hq // Hk
    pos32 = 1 if pos.dtype == torch.int32 else 0
    bind = {"q": _b(q), "kc": _b(kc), "vc": _b(vc), "out_": _b(out), "pos": _b(pos)}
    if T >= ATTN_PREFILL_TOKENS and D <= ATTN_PREFILL_KV and G * D <= ATTN_PREFILL_ACC and G <= ATTN_PREFILL_ROWS:
        BQ = min(T, ATTN_PREFILL_ROWS // G, ATTN_PREFILL_ACC // (G * D))
        runner.launch(Launch("hz_attention_prefill",
                             {"B": B, "T": T, "S": S, "Hq": Hq, "Hk": Hk, "D": D, "dt": _DT[q.dtype], "dt_c": dc,
                              "pos32": pos32, "BQ": BQ, "scale": scale}, bind,
                             _fused_groups(B * (-(-T // BQ)) * Hk)))
        return out
    # few (b, t, kv head) items (decode): the keys split so that a long cache is read by many threadgroups
    chunks = -(-S // ATTN_CHUNK)
    nsplit = 1 if items >= ATTN_BUSY_GROUPS else max(1, min(chunks, ATTN_MAX_SPLIT, ATTN_BUSY_GROUPS // items))
    counter = _counters(items, q.device)
    if nsplit > 1:
        part = torch.empty(items * nsplit * G * (D + 2), dtype=torch.float32, device=q.device)
        bind.update(part=_b(part), counter=_b(counter))
    else:
        bind.update(counter=_b(counter))  # bound for the argument; the kernel touches it only when split
    gx, gy, _ = _fused_groups(items)
    runner.launch(Launch("hz_attention",
                         {"BT": B * T, "T": T, "S": S, "Hq": Hq, "Hk": Hk, "D": D, "dt": _DT[q.dtype], "dt_c": dc,
                          "pos32": pos32, "nsplit": nsplit, "scale": scale}, bind, (gx, gy, nsplit)))
    return out


def moe_route(runner, logits, k, normalize):
    """``hanzo::moe_route`` (top-k softmax weights and expert ids per row)."""
    k = int(k)
    if (not _act(runner, logits) or logits.dim() != 2 or k < 1 or k > logits.shape[1] or logits.shape[1] > 1024 or
            k > 256 or logits.numel() >= MAX_INDEX):
        return _ref("moe_route")(logits, k, normalize)
    logits = logits.contiguous()
    T, E = logits.shape
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T:
        runner.launch(Launch("hz_moe_route", {"T": T, "E": E, "k": k, "_normalize": 1 if normalize else 0,
                                              "dt": _DT[logits.dtype]},
                             {"logits": _b(logits), "w": _b(w), "ids": _b(ids)}, _fused_groups(T)))
    return w, ids


OPS = {"dequantize": dequantize, "get_rows": get_rows, "mul_mat": mul_mat, "mul_mat_id": mul_mat_id,
       "swiglu_mul_mat": swiglu_mul_mat, "quantize_q8_1": quantize_q8_1, "rms_norm": rms_norm,
       "add_rms_norm": add_rms_norm, "swiglu": swiglu, "qk_norm_rope": qk_norm_rope, "kv_cache_write": kv_cache_write,
       "qk_norm_rope_kv_write": qk_norm_rope_kv_write, "attention": attention, "moe_route": moe_route}
"""Every ``hanzo`` op with Metal kernels: ``op -> fn(runner, *op arguments)``."""
