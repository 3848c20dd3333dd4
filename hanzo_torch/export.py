"""Export a loaded model's prefill and decode step to ``torch.export`` and to MLIR (torch-mlir).

The ``hanzo`` custom ops have no meaning outside this package, so an exported program that
keeps them cannot be lowered by torch-mlir (``torch.operator "torch.hanzo.mul_mat"`` fails to
legalize). :data:`DECOMPOSITIONS` replaces each op with a composition of aten ops that any
compiler understands: packed weights stay ``uint8`` and are unpacked inside the program with
integer aten ops (shifts, masks, gathers from small codebook constants) right before their
matmul, the maths of the references in :mod:`hanzo_torch.ops` with static shapes only (no host
reads of data: ids are clamped, attention masks the whole cache, the KV write is a one-hot
contraction instead of a scatter). The weights are never expanded to float32 in the exported
program; the constants it holds are the GGUF's bytes.

Programs (:func:`export_program`):

* ``prefill``: ``(input_ids int64 [B, T], positions int64 [B, T], k_0, v_0, ..., k_{L-1}, v_{L-1})``
  -> ``(logits float32 [B, T, V], k_0', v_0', ...)``
* ``decode``: the same with ``T = 1``.

The KV cache is explicit: each layer's ``k``/``v`` cache ``[B, S, Hk, D]`` (``S`` the
``max_context`` of the export) is an input and the updated cache is an output, so the programs
are pure functions (no mutated buffers), which torch-mlir's linalg-on-tensors backend and IREE
handle. Shapes are static: ``T`` of the prefill is fixed at export time (pad shorter prompts
and pass the real positions; slots past a query's position are masked).

:func:`export_mlir` lowers both programs through torch-mlir (``pip install -e ".[mlir]"``) into
one ``linalg-on-tensors`` module with functions ``prefill`` and ``decode``; :func:`compile_iree`
and :class:`IreeModel` compile it with IREE for ``llvm-cpu`` and run it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch import Tensor
from torch.overrides import TorchFunctionMode

from . import formats as _formats

__all__ = [
    "DECOMPOSITIONS",
    "ExportResult",
    "export_program",
    "export_mlir",
    "lower_to_mlir",
    "compile_iree",
    "IreeModel",
    "mlir_available",
]

aten = torch.ops.aten
hanzo = torch.ops.hanzo

_MLIR_EXTRA = 'the MLIR export needs the [mlir] extra: python3 -m pip install -e ".[mlir]" ' \
              "(torch-mlir, iree-base-compiler, iree-base-runtime)"


# ---------------------------------------------------------------------------------------------
# trace-friendly references of the hanzo ops
# ---------------------------------------------------------------------------------------------
# The op references in hanzo_torch.ops read data on the host where that is free on the CPU
# (id range checks, the live prefix of the cache, grouping MoE rows by expert); a traced program
# has no data at trace time, so these versions compute the same values with static shapes only.
# Ids are clamped instead of range-checked: the exported program cannot raise.

_MATMUL_CHUNK_BYTES = 64 << 20  # most float32 bytes of one dequantized weight slice in the program


def _dequant_rows(w: Tensor, qtype: str, K: int) -> Tensor:
    fmt = _formats.get_format(qtype)
    lead = tuple(w.shape[:-1])
    return fmt.dequantize_blocks(w.reshape(-1, fmt.type_size)).reshape(*lead, K)


def _row_length(w: Tensor, qtype: str) -> int:
    fmt = _formats.get_format(qtype)
    return w.shape[-1] // fmt.type_size * fmt.block_size


def _mul_mat(x: Tensor, w: Tensor, qtype: str) -> Tensor:
    K, N = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, K).to(torch.float32)
    step = max(1, _MATMUL_CHUNK_BYTES // (4 * K))
    parts = [x2 @ _dequant_rows(w[n0:n0 + step], qtype, K).t() for n0 in range(0, N, step)]
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return y.reshape(*x.shape[:-1], N).to(x.dtype)


def _mul_mat_id(x: Tensor, w: Tensor, ids: Tensor, qtype: str) -> Tensor:
    # gathers the packed rows of each selection's expert (uint8), then unpacks them
    E, N = w.shape[0], w.shape[1]
    T, k = ids.shape
    K = x.shape[-1]
    flat = ids.reshape(-1).to(torch.int64).clamp(0, E - 1)
    xs = (x.unsqueeze(1).expand(T, k, K) if x.dim() == 2 else x).reshape(T * k, K).to(torch.float32)
    step = max(1, _MATMUL_CHUNK_BYTES // (4 * N * K))
    parts = []
    for p0 in range(0, T * k, step):
        wp = w.index_select(0, flat[p0:p0 + step])  # [P, N, rb] uint8
        parts.append(torch.bmm(_dequant_rows(wp, qtype, K), xs[p0:p0 + step].unsqueeze(-1)).squeeze(-1))
    y = parts[0] if len(parts) == 1 else torch.cat(parts)
    return y.reshape(T, k, N).to(x.dtype)


def _get_rows(w: Tensor, ids: Tensor, qtype: str, dtype: torch.dtype) -> Tensor:
    H = _row_length(w, qtype)
    flat = ids.reshape(-1).to(torch.int64).clamp(0, w.shape[0] - 1)
    return _dequant_rows(w.index_select(0, flat), qtype, H).reshape(*ids.shape, H).to(dtype)


def _dequantize(data: Tensor, qtype: str, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    shape = tuple(shape)
    return _dequant_rows(data.reshape(-1, data.shape[-1]), qtype, shape[-1]).reshape(shape).to(dtype)


def _moe_route(logits: Tensor, k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    # k rounds of argmax (the first maximum: ties go to the lower expert id, as in the op)
    probs = torch.softmax(logits.float(), dim=-1)
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


def _rms(xf: Tensor, w: Tensor, eps: float) -> Tensor:
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * w.float()


def _rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return _rms(x.float(), w, eps).to(x.dtype)


def _add_rms_norm(x: Tensor, residual: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    s = x + residual
    return _rms_norm(s, w, eps), s


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _qk_norm_rope(q, k, q_w, k_w, positions, theta: float, eps: float) -> tuple[Tensor, Tensor]:
    from .ops.fused import rope_cos_sin

    qf, kf = q.float(), k.float()
    if q_w is not None:
        qf, kf = _rms(qf, q_w, eps), _rms(kf, k_w, eps)
    cos, sin = rope_cos_sin(positions, q.shape[-1], theta)
    return _rope(qf, cos, sin).to(q.dtype), _rope(kf, cos, sin).to(k.dtype)


def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


def _swiglu_mul_mat(x, w_gate, w_up, qtype_gate: str, qtype_up: str) -> Tensor:
    return _swiglu(_mul_mat(x, w_gate, qtype_gate), _mul_mat(x, w_up, qtype_up))


def _cache_update(cache: Tensor, new: Tensor, positions: Tensor) -> Tensor:
    # cache [B, S, H, D], new [B, T, H, D], positions [B, T]: slot s takes the new row whose
    # position is s (a one-hot contraction: no scatter, so it lowers to plain linalg)
    S = cache.shape[1]
    hit = (positions.to(torch.int64)[:, :, None] == torch.arange(S, device=cache.device)).to(cache.dtype)  # [B, T, S]
    written = hit.amax(dim=1)[:, :, None, None]  # [B, S, 1, 1]
    scattered = torch.einsum("bts,bthd->bshd", hit, new)
    return torch.where(written > 0, scattered, cache)


def _kv_cache_write(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> None:
    k_cache.copy_(_cache_update(k_cache, k, positions))
    v_cache.copy_(_cache_update(v_cache, v, positions))


def _qk_norm_rope_kv_write(q, k, v, q_w, k_w, k_cache, v_cache, positions, theta: float, eps: float) -> Tensor:
    q, k = _qk_norm_rope(q, k, q_w, k_w, positions, theta, eps)
    _kv_cache_write(k_cache, v_cache, k, v, positions)
    return q


def _attention(q, k_cache, v_cache, positions, scale: float, impl: str) -> Tensor:
    # every slot of the cache, slots past each query's position masked (eager softmax in float32)
    B, T, Hq, D = q.shape
    S, Hk = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hk
    qf = q.float().reshape(B, T, Hk, G, D).permute(0, 2, 3, 1, 4)  # [B, Hk, G, T, D]
    kf = k_cache.float().permute(0, 2, 1, 3)[:, :, None]  # [B, Hk, 1, S, D]
    vf = v_cache.float().permute(0, 2, 1, 3)[:, :, None]
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [B, Hk, G, T, S]
    visible = torch.arange(S, device=q.device)[None, None, :] <= positions.to(torch.int64)[:, :, None]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [B, Hk, G, T, D]
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D).to(q.dtype)


def _quantize_q8_1(x: Tensor) -> Tensor:
    from .formats.q8_1 import quantize_q8_1

    return quantize_q8_1(x)


# ---- Tensor.view(dtype) between byte widths ---------------------------------------------------
# The format decoders read fp16 scales by reinterpreting packed bytes (uint8 -> float16,
# int16 -> float16) and signed codes by uint8 -> int8. torch-mlir has no lowering for a bitcast
# that changes the element width, so the exported program decodes the bits with integer
# arithmetic instead; every fp16 value (subnormals, infinities, signed zeros) comes out exact.
# 2 ** (e - 25) for the fp16 exponent field e (e = 0 takes e = 1's scale: subnormals); a tensor
# made once, so a traced program holds it as a constant
_POW2 = torch.tensor([2.0 ** (max(e, 1) - 25) for e in range(32)], dtype=torch.float32)


def _half_bits_to_float(bits: Tensor) -> Tensor:
    """fp16 bit patterns ``[0, 65535]`` (any int dtype) -> float32 values (exact)."""
    bits = bits.to(torch.int64)
    e = (bits >> 10) & 31
    m = bits & 1023
    mag = (m + torch.where(e > 0, 1024, 0)).to(torch.float32) * _POW2.to(bits.device)[e]
    special = torch.where(m == 0, torch.full_like(mag, float("inf")), torch.full_like(mag, float("nan")))
    mag = torch.where(e == 31, special, mag)
    return torch.where((bits >> 15) != 0, -mag, mag)


def _view_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    src = x.dtype
    if src == dtype:
        return x.clone()
    if src == torch.uint8 and dtype == torch.int8:
        v = x.to(torch.int32)
        return torch.where(v >= 128, v - 256, v).to(torch.int8)
    if src == torch.int8 and dtype == torch.uint8:
        v = x.to(torch.int32)
        return torch.where(v < 0, v + 256, v).to(torch.uint8)
    if dtype == torch.float16 and src in (torch.uint8, torch.int16):
        if src == torch.uint8:
            b = x.to(torch.int32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
            bits = b[..., 0] | (b[..., 1] << 8)
        else:
            bits = x.to(torch.int32) & 0xFFFF
        return _half_bits_to_float(bits).to(torch.float16)
    raise NotImplementedError(f"hanzo_torch.export: no exportable form of Tensor.view({dtype}) on {src} data")


def _decompositions() -> dict:
    return {
        hanzo.mul_mat.default: _mul_mat,
        hanzo.mul_mat_id.default: _mul_mat_id,
        hanzo.get_rows.default: _get_rows,
        hanzo.dequantize.default: _dequantize,
        hanzo.quantize_q8_1.default: _quantize_q8_1,
        hanzo.moe_route.default: _moe_route,
        hanzo.rms_norm.default: _rms_norm,
        hanzo.add_rms_norm.default: _add_rms_norm,
        hanzo.qk_norm_rope.default: _qk_norm_rope,
        hanzo.swiglu.default: _swiglu,
        hanzo.swiglu_mul_mat.default: _swiglu_mul_mat,
        hanzo.kv_cache_write.default: _kv_cache_write,
        hanzo.qk_norm_rope_kv_write.default: _qk_norm_rope_kv_write,
        hanzo.attention.default: _attention,
        aten.view.dtype: _view_dtype,
    }


DECOMPOSITIONS: dict = _decompositions()
"""``{op overload: trace-friendly aten composition}`` for every ``torch.ops.hanzo`` op (and
``aten.view.dtype`` between byte widths). :func:`export_program` applies it while tracing (a
``TorchFunctionMode``), not with ``ExportedProgram.run_decompositions``: the codebook and
shift-table constants the format decoders use would be traced as tensor constants that
``run_decompositions`` does not register (``SpecViolationError``)."""


class _Decompose(TorchFunctionMode):
    """Runs :data:`DECOMPOSITIONS` in place of the ops they replace while a program is traced."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = getattr(func, "default", func)  # torch.ops.hanzo.x is a packet of overloads
        fn = DECOMPOSITIONS.get(op)
        if fn is None and func is Tensor.view and len(args) == 2 and isinstance(args[1], torch.dtype):
            fn = _view_dtype
        if fn is None:
            fn = _BITWISE.get(func)
        if fn is None:
            fn = _packed_weight_function(func, args, kwargs)
        if fn is None:
            return func(*args, **kwargs)
        # the mode is off inside this method; the replacement's own calls must see it too
        with _Decompose():
            return fn(*args, **kwargs)


# torch-mlir lowers the bitwise ops on two tensors, not Python's operators (``x >> 4`` is
# ``aten.__rshift__``): scalars become 0-dim tensors of the other operand's dtype.
def _bitwise(op: Callable, reflected: bool = False) -> Callable:
    def fn(a, b):
        if reflected:
            a, b = b, a
        if not isinstance(a, Tensor):
            a = torch.full((), a, dtype=b.dtype, device=b.device)
        if not isinstance(b, Tensor):
            b = torch.full((), b, dtype=a.dtype, device=a.device)
        return op(a, b)

    return fn


_BITWISE = {
    Tensor.__rshift__: _bitwise(torch.bitwise_right_shift),
    Tensor.__lshift__: _bitwise(torch.bitwise_left_shift),
    Tensor.__rrshift__: _bitwise(torch.bitwise_right_shift, reflected=True),
    Tensor.__rlshift__: _bitwise(torch.bitwise_left_shift, reflected=True),
    Tensor.__and__: _bitwise(torch.bitwise_and),
    Tensor.__rand__: _bitwise(torch.bitwise_and, reflected=True),
    Tensor.__or__: _bitwise(torch.bitwise_or),
    Tensor.__ror__: _bitwise(torch.bitwise_or, reflected=True),
    Tensor.__xor__: _bitwise(torch.bitwise_xor),
    Tensor.__rxor__: _bitwise(torch.bitwise_xor, reflected=True),
}


def _packed_weight_function(func, args, kwargs) -> Optional[Callable]:
    # F.embedding / F.linear on a GGUFTensor: what its __torch_function__ routes to, written
    # here because calls made from a subclass handler bypass this mode
    from .tensor import GGUFTensor

    if func is torch.nn.functional.embedding and len(args) >= 2 and type(args[1]) is GGUFTensor:
        w = args[1]
        max_norm = args[3] if len(args) > 3 else kwargs.get("max_norm")
        if max_norm is not None:
            raise NotImplementedError("hanzo_torch.export: F.embedding with max_norm on a packed weight")
        return lambda ids, _w, *_, **__: _get_rows(w.packed, ids, w.qtype, w.dtype)
    if func is torch.nn.functional.linear and len(args) >= 2 and type(args[1]) is GGUFTensor:
        w = args[1]
        if w.transposed:
            raise NotImplementedError("hanzo_torch.export: F.linear on a transposed packed weight")

        def linear(x, _w, bias=None):
            y = _mul_mat(x, w.packed, w.qtype)
            return y if bias is None else y + bias

        return linear
    return None


# ---------------------------------------------------------------------------------------------
# the step programs
# ---------------------------------------------------------------------------------------------
def _warm_format_tables(qtypes, device) -> None:
    # Some decoders build small constant tensors (shift vectors, codebooks) on first use and
    # cache them; built during a trace they would be traced values, so build them here first.
    for qtype in qtypes:
        fmt = _formats.get_format(qtype)
        fmt.dequantize_blocks(torch.zeros(1, fmt.type_size, dtype=torch.uint8, device=device))


class _Step(nn.Module):
    """``model`` as a pure function of its KV cache: ``(ids, positions, *caches) -> (logits, *caches)``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, positions: Tensor, *caches: Tensor):
        blocks = list(self.model.blk)
        saved = [(b.k_cache, b.v_cache) for b in blocks]
        try:
            for i, b in enumerate(blocks):
                # copies: the op writes them in place; the program returns them
                b.k_cache, b.v_cache = caches[2 * i].clone(), caches[2 * i + 1].clone()
            logits = self.model(input_ids, positions)
            out = [logits]
            for b in blocks:
                out += [b.k_cache, b.v_cache]
            return tuple(out)
        finally:
            for b, (k, v) in zip(blocks, saved):
                b.k_cache, b.v_cache = k, v


def _check_model(model: nn.Module) -> None:
    from .models.qwen import Transformer

    if not isinstance(model, Transformer):
        raise TypeError(f"hanzo_torch.export: expected a model from hanzo_torch.load, got {type(model).__name__}")
    if model.device.type != "cpu":
        raise ValueError(f"hanzo_torch.export: export a model loaded on the CPU, not {model.device}")


def _example_inputs(model, batch_size: int, seq_len: int) -> tuple:
    a = model.args
    cache = torch.zeros(batch_size, model.max_context, a.n_head_kv, a.head_dim, dtype=model.dtype)
    ids = torch.zeros(batch_size, seq_len, dtype=torch.int64)
    positions = torch.arange(seq_len, dtype=torch.int64).unsqueeze(0).expand(batch_size, seq_len).contiguous()
    return (ids, positions, *[cache.clone() for _ in range(2 * a.n_layer)])


def _weight_formats(model) -> set:
    from .tensor import GGUFTensor

    return {p.qtype for p in model.parameters() if isinstance(p, GGUFTensor)}


def export_program(model: nn.Module, seq_len: int = 1, batch_size: int = 1) -> torch.export.ExportedProgram:
    """One step of ``model`` as a ``torch.export`` program made of aten ops only.

    Args:
        model: a CPU model from :func:`hanzo_torch.load`; its ``max_context`` is the cache
            length ``S`` of the program (load with a small ``max_context`` for a small program).
        seq_len: tokens per call ``T`` (1: the decode step; more: a prefill of exactly T tokens).
        batch_size: ``B``.

    Returns:
        An ``ExportedProgram`` of ``(input_ids int64 [B, T], positions int64 [B, T],
        k_cache_0, v_cache_0, ..., v_cache_{L-1})`` -> ``(logits float32 [B, T, V],
        k_cache_0', ..., v_cache_{L-1}')``, caches ``[B, S, Hk, D]`` in the model's compute
        dtype (whatever its ``kv_dtype`` for eager runs).
        Packed weights are ``uint8`` parameters of the program (the GGUF's bytes); every
        ``hanzo`` op is replaced by :data:`DECOMPOSITIONS`. The model is unchanged.

    Raises:
        TypeError: ``model`` is not a hanzo-torch model.
        ValueError: a model on another device than the CPU, ``seq_len``/``batch_size`` < 1 or
            ``seq_len`` > ``max_context``.
    """
    _check_model(model)
    if not isinstance(seq_len, int) or not 1 <= seq_len <= model.max_context:
        raise ValueError(f"seq_len must be an int in [1, max_context={model.max_context}], got {seq_len!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    _warm_format_tables(_weight_formats(model), model.device)
    step = _Step(model)
    blocks = list(model.blk)
    saved = [(b.k_cache, b.v_cache) for b in blocks]
    state = (model.cache_batch_size, model.seq_len)
    try:
        # the program's caches are inputs; the model's own must not become constants of it
        for b in blocks:
            b.k_cache = b.v_cache = None
        model.cache_batch_size = batch_size
        model.seq_len = 0
        with _Decompose():
            ep = torch.export.export(step, _example_inputs(model, batch_size, seq_len), strict=False)
        return ep.run_decompositions({})  # the subclass weights become plain uint8 tensors
    finally:
        for b, (k, v) in zip(blocks, saved):
            b.k_cache, b.v_cache = k, v
        model.cache_batch_size, model.seq_len = state


def mlir_available() -> Optional[str]:
    """None when torch-mlir and IREE can be imported, else the reason (what to install)."""
    try:
        import iree.compiler  # noqa: F401
        import iree.runtime  # noqa: F401
        import torch_mlir.fx  # noqa: F401
    except ImportError as e:
        return f"{_MLIR_EXTRA}; import failed: {e}"
    return None


def _require_mlir() -> None:
    reason = mlir_available()
    if reason is not None:
        raise ImportError(reason)


@dataclass
class ExportResult:
    """What :func:`export_mlir` wrote.

    Attributes:
        path: the MLIR file (linalg-on-tensors; text for ``.mlir``, bytecode for ``.mlirbc``).
        file_bytes: its size in bytes.
        prefill_len: ``T`` of the ``prefill`` function.
        max_context: ``S``, the cache length of both functions.
        batch_size: ``B``.
        n_layer: layers (the functions take and return ``2 * n_layer`` caches).
        packed_weight_bytes: bytes of the packed weights the module holds as ``uint8`` constants.
    """

    path: str
    file_bytes: int
    prefill_len: int
    max_context: int
    batch_size: int
    n_layer: int
    packed_weight_bytes: int


def export_mlir(
    model: nn.Module,
    path: Union[str, "os.PathLike[str]"],
    prefill_len: int = 16,
    batch_size: int = 1,
) -> ExportResult:
    """Write ``model``'s prefill and decode step as one torch-mlir ``linalg-on-tensors`` module.

    The module has two functions, ``prefill`` (``T = prefill_len``) and ``decode`` (``T = 1``),
    with the signature of :func:`export_program`. Weights are frozen into the module as
    ``uint8`` constants holding the packed GGUF bytes. Needs the ``[mlir]`` extra.

    Args:
        model: a CPU model from :func:`hanzo_torch.load` (its ``max_context`` sets ``S``).
        path: output file; ``.mlirbc`` writes MLIR bytecode, anything else MLIR text.
        prefill_len: tokens per prefill call.
        batch_size: sequences per call.

    Returns:
        :class:`ExportResult`.

    Raises:
        ImportError: torch-mlir or IREE is not installed (names the extra to install).
        TypeError, ValueError: as :func:`export_program`.
        RuntimeError: torch-mlir could not lower the program.
    """
    _require_mlir()
    path = os.fspath(path)
    programs = {"prefill": export_program(model, prefill_len, batch_size),
                "decode": export_program(model, 1, batch_size)}
    lower_to_mlir(programs, path)
    from .tensor import GGUFTensor

    packed = {p.packed.data_ptr(): p.packed.numel() for p in model.parameters() if isinstance(p, GGUFTensor)}
    return ExportResult(path=path, file_bytes=os.path.getsize(path), prefill_len=prefill_len,
                        max_context=model.max_context, batch_size=batch_size, n_layer=model.args.n_layer,
                        packed_weight_bytes=sum(packed.values()))


_MLIR_ELEMENT = {torch.uint8: "ui8", torch.int8: "si8", torch.int32: "si32", torch.int64: "si64",
                 torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _literal_hooks(ir):
    """torch-mlir importer hooks that turn each weight into a constant once per module.

    torch-mlir's own conversion copies a tensor through a Python list (hours and tens of GB for a
    1 GB weight) and makes one constant per tensor object, so the same weight seen by two
    functions would be stored twice; here the bytes go to the MLIR resource straight from the
    tensor's memory and one resource is shared by every use of the same data.
    """
    from torch_mlir.extras.fx_importer import FxImporterHooks

    class Hooks(FxImporterHooks):
        def __init__(self):
            self._attrs: dict = {}

        def resolve_literal(self, gni, literal, info):
            if not isinstance(literal, torch.Tensor) or literal.numel() <= 1 or literal.dtype not in _MLIR_ELEMENT:
                return None  # torch-mlir's default (scalars, splats)
            t = literal.detach()
            elt = _MLIR_ELEMENT[t.dtype]
            dims = "x".join(str(d) for d in t.shape)
            key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            attr = self._attrs.get(key)
            if attr is None:
                arr = t.contiguous().numpy() if t.dtype != torch.bfloat16 else t.contiguous().view(torch.int16).numpy()
                attr = ir.DenseResourceElementsAttr.get_from_buffer(
                    memoryview(arr.reshape(-1).view("uint8")), f"hanzo_weight_{len(self._attrs)}",
                    ir.Type.parse(f"tensor<{dims}x{elt}>"))
                self._attrs[key] = attr, arr  # the attribute reads arr's memory: keep it alive
            else:
                attr = attr[0]
            vtype = ir.Type.parse(f"!torch.vtensor<[{dims.replace('x', ',')}],{elt}>")
            return ir.Operation.create("torch.vtensor.literal", results=[vtype], attributes={"value": attr}).result

    return Hooks


def lower_to_mlir(programs: dict, path: Union[str, "os.PathLike[str]"]) -> None:
    """Lower ``{function name: ExportedProgram}`` (from :func:`export_program`) through torch-mlir
    into one ``linalg-on-tensors`` module written to ``path`` (``.mlirbc``: bytecode, else text).

    Parameters and buffers are frozen into the module as constants.

    Raises:
        ImportError: torch-mlir is not installed.
        RuntimeError: torch-mlir could not lower a program (its diagnostics included).
    """
    _require_mlir()
    from torch_mlir import fx as tm_fx
    from torch_mlir import ir
    from torch_mlir.compiler_utils import TorchMlirCompilerError
    from torch_mlir.dialects import torch as torch_d
    from torch_mlir.extras.fx_importer import FxImporter

    path = os.fspath(path)
    context = ir.Context()
    torch_d.register_dialect(context)
    importer = FxImporter(context=context, hooks=_literal_hooks(ir)())
    module = None
    items = list(programs.items())
    try:
        for i, (name, ep) in enumerate(items):
            last = i == len(items) - 1
            # every program goes into one module; the lowering runs once, on the last call
            module = tm_fx.export_and_import(ep, fx_importer=importer, func_name=name, decomposition_table={},
                                             output_type="linalg-on-tensors" if last else "raw")
    except TorchMlirCompilerError as e:
        raise RuntimeError(f"torch-mlir could not lower the exported program: {e}") from None
    if path.endswith(".mlirbc"):
        with open(path, "wb") as f:
            module.operation.write_bytecode(f)
    else:
        with open(path, "w") as f:
            f.write(module.operation.get_asm(large_elements_limit=None, enable_debug_info=False))


def compile_iree(mlir_path: Union[str, "os.PathLike[str]"], vmfb_path: Optional[str] = None,
                 target: str = "llvm-cpu") -> bytes:
    """Compile a module written by :func:`export_mlir` with IREE for ``target`` (``llvm-cpu``).

    Returns the compiled ``.vmfb`` bytes (also written to ``vmfb_path`` when given). The CPU
    target is the host's (``--iree-llvmcpu-target-cpu=host``). Constant evaluation is off: IREE
    would otherwise run the weight unpacking at compile time and store float32 weights (a 4.5x
    larger ``.vmfb`` for Q4_K, and minutes of compile time); the ``.vmfb`` keeps them packed.

    Raises:
        ImportError: IREE is not installed.
        RuntimeError: the IREE compiler failed (its message included).
    """
    _require_mlir()
    import iree.compiler as ireec

    extra = ["--iree-opt-const-eval=false", "--iree-opt-const-expr-hoisting=false"]
    if target == "llvm-cpu":
        extra.append("--iree-llvmcpu-target-cpu=host")
    try:
        vmfb = ireec.compile_file(os.fspath(mlir_path), target_backends=[target], input_type="auto",
                                  extra_args=extra)
    except ireec.CompilerToolError as e:
        raise RuntimeError(f"IREE could not compile {os.fspath(mlir_path)}: {e}") from None
    if vmfb_path is not None:
        with open(vmfb_path, "wb") as f:
            f.write(vmfb)
    return vmfb


class IreeModel:
    """A compiled export run with the IREE runtime on the local CPU (``local-task`` driver).

    Keeps the KV caches between calls: ``prefill(ids, positions)`` / ``decode(ids, positions)``
    return float32 logits ``[B, T, V]`` as a torch tensor, like ``model(ids, positions)``.
    Build it with :meth:`from_model`.

    Args:
        vmfb: the output of :func:`compile_iree`.
        result: the :class:`ExportResult` of the module.
        cache_shape: ``(B, S, Hk, D)`` of each KV cache; ``dtype``: their dtype.
    """

    def __init__(self, vmfb: bytes, result: ExportResult, cache_shape: Sequence[int],
                 dtype: torch.dtype = torch.float32, driver: str = "local-task"):
        _require_mlir()
        import iree.runtime as ireert

        if dtype not in (torch.float32, torch.float16):
            raise ValueError(f"IreeModel: KV caches of {dtype} are not supported (float32 or float16)")
        self._ctx = ireert.SystemContext(config=ireert.Config(driver))
        self._ctx.add_vm_module(ireert.VmModule.copy_buffer(self._ctx.instance, vmfb))
        self._module = self._ctx.modules.module
        self.result = result
        self._cache_shape = tuple(cache_shape)
        self._dtype = dtype
        self.reset()

    @classmethod
    def from_model(cls, vmfb: bytes, result: ExportResult, model) -> "IreeModel":
        """An :class:`IreeModel` whose caches have the shapes of ``model`` (the exported one)."""
        a = model.args
        return cls(vmfb, result, (result.batch_size, result.max_context, a.n_head_kv, a.head_dim), model.dtype)

    def reset(self) -> None:
        """Zero the KV caches (start a new sequence)."""
        self._caches = [torch.zeros(self._cache_shape, dtype=self._dtype).numpy()
                        for _ in range(2 * self.result.n_layer)]

    def _run(self, name: str, ids: Tensor, positions: Tensor) -> Tensor:
        out = self._module[name](ids.to(torch.int64).numpy(), positions.to(torch.int64).numpy(), *self._caches)
        out = [o.to_host() for o in out]
        self._caches = out[1:]
        return torch.from_numpy(out[0].copy())

    def prefill(self, ids: Tensor, positions: Tensor) -> Tensor:
        """Logits ``[B, prefill_len, V]`` of ``ids``/``positions`` ``int64 [B, prefill_len]``."""
        return self._run("prefill", ids, positions)

    def decode(self, ids: Tensor, positions: Tensor) -> Tensor:
        """Logits ``[B, 1, V]`` of one token per sequence, ``ids``/``positions`` ``int64 [B, 1]``."""
        return self._run("decode", ids, positions)
