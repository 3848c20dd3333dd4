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
# trace forms of the hanzo ops: from the op table (hanzo_torch.ops.spec). An op's reference is its
# trace form unless its declaration gives one with static shapes (where the reference reads data
# on the host: id range checks, the live prefix of the cache, grouping MoE rows by expert).
# ---------------------------------------------------------------------------------------------

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
    from .ops import spec

    return {**spec.decompositions(), aten.view.dtype: _view_dtype}


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
        return lambda ids, _w, *_, **__: DECOMPOSITIONS[hanzo.get_rows.default](w.packed, ids, w.qtype, w.dtype)
    if func is torch.nn.functional.linear and len(args) >= 2 and type(args[1]) is GGUFTensor:
        w = args[1]
        if w.transposed:
            raise NotImplementedError("hanzo_torch.export: F.linear on a transposed packed weight")

        def linear(x, _w, bias=None):
            y = DECOMPOSITIONS[hanzo.mul_mat.default](x, w.packed, w.qtype)
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
