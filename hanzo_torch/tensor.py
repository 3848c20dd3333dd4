"""``GGUFTensor``: a weight kept packed in its ggml block format.

A :class:`GGUFTensor` is a ``torch.Tensor`` wrapper subclass whose ``shape`` is the logical
(unpacked) shape of the weight and whose ``dtype`` is the *compute* dtype (what
:meth:`GGUFTensor.dequantize` and the ops it routes to produce). It owns exactly one real tensor,
``packed``: ``uint8`` of shape ``(*shape[:-1], row_bytes)``, the ggml blocks of each row laid out
back to back (docs/ARCHITECTURE.md, "Packed data convention"). Nothing full-size is ever
allocated behind the user's back:

==========================================  ===========================================
expression                                   runs
==========================================  ===========================================
``F.linear(x, w[, b])``, ``x @ w.T``,         ``torch.ops.hanzo.mul_mat(x, w.packed, w.qtype)``
``torch.matmul(x, w.T)``, ``nn.Linear``       (plus ``b``)
``F.embedding(ids, w)``, ``nn.Embedding``     ``torch.ops.hanzo.get_rows(w.packed, ids, w.qtype, w.dtype)``
``w.to(device)``, ``.cpu()``, ``.cuda()``     moves ``packed``
``w.to(dtype)``, ``.half()``, ...             changes the compute dtype only
``detach``, ``clone``, ``contiguous``,        as for a dense tensor
``copy_`` (same format and shape)
anything else                                 ``NotImplementedError`` naming the op and
                                              pointing to ``.dequantize()``
==========================================  ===========================================

3-D stacked expert weights ``(E, N, K)`` are GGUFTensors too; models pass their ``packed``
and ``qtype`` to ``torch.ops.hanzo.mul_mat_id``.

The class follows torchao's ``TorchAOBaseTensor`` habits: the tensor fields and the metadata
fields are declared once (:attr:`GGUFTensor.tensor_data_names`,
:attr:`GGUFTensor.tensor_attribute_names`) and flatten/unflatten, repr and device moves derive
from them; ops are implemented in one table filled by the :func:`_implements` decorator, shared
by ``__torch_function__`` (torch-level functions) and ``__torch_dispatch__`` (aten ops), so
``F.linear`` and ``aten.linear`` have one handler. ``__tensor_flatten__`` /
``__tensor_unflatten__`` let ``torch.compile`` see through the wrapper: a compiled model's graph
holds the ``hanzo`` ops on the ``uint8`` data.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from .formats import Format, get_format

__all__ = ["GGUFTensor"]

aten = torch.ops.aten

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# One table for torch-level functions (seen by __torch_function__) and aten overloads (seen by
# __torch_dispatch__): func -> handler(func, args, kwargs).
_OPS: dict[Any, Callable] = {}


def _implements(*funcs):
    """Register the decorated handler for each of ``funcs`` (torch functions or aten ops)."""

    def deco(handler):
        for f in funcs:
            _OPS[f] = handler
        return handler

    return deco


class GGUFTensor(torch.Tensor):
    """A packed ggml weight that behaves like a ``(…, K)`` float tensor for linear/embedding.

    Args:
        packed: ``uint8`` tensor ``(*shape[:-1], row_bytes)`` with ``row_bytes =
            get_format(qtype).row_bytes(shape[-1])``; any device. Kept as is (not copied) when
            already contiguous.
        qtype: ggml type name (``"Q4_K"``), id (``12``) or :class:`~hanzo_torch.formats.Format`;
            stored as the canonical name.
        shape: logical shape in torch order, ``(N, K)`` for a matrix, ``(E, N, K)`` for stacked
            experts, ``(K,)`` for a vector. The last dim is the row length.
        dtype: compute dtype (float32, float16, bfloat16 or float64): what ``dequantize()``,
            ``F.embedding`` and ``repr`` report. ``F.linear``/``matmul`` return ``x.dtype``.
        transposed: internal; True for the view ``w.T`` of a 2-D weight (logical shape
            ``(K, N)``), which only ``matmul``/``mm`` accept.

    Raises:
        ValueError: unknown format, ``packed`` not ``uint8``, a row length that is not a multiple
            of the block size, a ``packed`` shape that does not match ``shape``, or a non-float
            ``dtype``.

    Attributes:
        packed: the ``uint8`` blocks.
        qtype: ggml name of the format (``str``).
        format: the :class:`~hanzo_torch.formats.Format` trait of ``qtype``.
    """

    # The constructor takes the tensor fields then the metadata fields, in these orders; flatten,
    # unflatten, pickling and copies are derived from the two lists.
    tensor_data_names = ["packed"]
    tensor_attribute_names = ["qtype", "logical_shape", "dtype", "transposed"]

    packed: torch.Tensor
    qtype: str
    logical_shape: tuple
    transposed: bool

    @staticmethod
    def __new__(cls, packed, qtype, shape, dtype=torch.float32, transposed=False):
        fmt = get_format(qtype)
        shape = tuple(shape)
        if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
            got = packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__
            raise ValueError(f"GGUFTensor: packed data must be a uint8 tensor, got {got}")
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"GGUFTensor: compute dtype must be a float dtype, got {dtype}")
        if len(shape) == 0:
            raise ValueError("GGUFTensor: shape must have at least one dim")
        want = (*shape[:-1], fmt.row_bytes(shape[-1]))
        if tuple(packed.shape) != want:
            raise ValueError(
                f"GGUFTensor: {fmt.name} weight of logical shape {shape} needs packed uint8 of shape "
                f"{want}, got {tuple(packed.shape)}"
            )
        if transposed and len(shape) != 2:
            raise ValueError("GGUFTensor: only a 2-D weight can be transposed")
        outer = (shape[1], shape[0]) if transposed else shape
        return torch.Tensor._make_wrapper_subclass(
            cls, outer, dtype=dtype, device=packed.device, requires_grad=False
        )

    def __init__(self, packed, qtype, shape, dtype=torch.float32, transposed=False):
        self.packed = packed if packed.is_contiguous() else packed.contiguous()
        self.qtype = get_format(qtype).name
        self.logical_shape = tuple(int(s) for s in shape)
        self.transposed = bool(transposed)

    # ------------------------------------------------------------------ basic API
    @property
    def format(self) -> Format:
        """The :class:`~hanzo_torch.formats.Format` trait of this weight."""
        return get_format(self.qtype)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The full dense tensor (``self.shape``, ``dtype`` or the compute dtype), on ``packed``'s device.

        This is the only GGUFTensor method that allocates the full-size weight. Runs
        ``torch.ops.hanzo.dequantize`` (bit-identical to ``gguf.quants.dequantize`` in float32).
        """
        dtype = self.dtype if dtype is None else dtype
        out = torch.ops.hanzo.dequantize(self.packed, self.qtype, list(self.logical_shape), dtype)
        return out.t() if self.transposed else out

    def _fields(self) -> tuple[list, list]:
        return ([getattr(self, n) for n in self.tensor_data_names],
                [getattr(self, n) for n in self.tensor_attribute_names])

    def _with(self, **changes) -> "GGUFTensor":
        """A new GGUFTensor with some fields replaced (``packed=``, ``dtype=``, ``transposed=``)."""
        data, attrs = self._fields()
        fields = dict(zip(self.tensor_data_names + self.tensor_attribute_names, data + attrs))
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"GGUFTensor._with: unknown fields {sorted(unknown)}")
        fields.update(changes)
        return GGUFTensor(*fields.values())

    def __repr__(self, *, tensor_contents=None) -> str:  # never prints the data
        shape = tuple(self.shape)
        extra = ", transposed=True" if self.transposed else ""
        return (
            f"GGUFTensor(qtype={self.qtype}, shape={shape}, dtype={self.dtype}, "
            f"device={self.device}, packed_bytes={self.packed.numel()}{extra})"
        )

    # ------------------------------------------------------------------ pickling
    def __reduce_ex__(self, protocol):
        data, attrs = self._fields()
        return (_rebuild_gguf_tensor, (*data, *attrs))

    def __deepcopy__(self, memo):
        out = self._with(packed=self.packed.clone())
        memo[id(self)] = out
        return out

    # ------------------------------------------------------------------ torch.compile
    def _stable_hash_for_caching(self) -> str:
        # AOT autograd cache key: everything but the bytes, which are a graph input
        attrs = ":".join(str(a) for a in self._fields()[1])
        return f"GGUFTensor:{attrs}:{tuple(self.packed.shape)}:{self.packed.device.type}"

    def __tensor_flatten__(self):
        return list(self.tensor_data_names), tuple(self._fields()[1])

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, ctx, outer_size, outer_stride):
        return cls(*[inner_tensors[n] for n in cls.tensor_data_names], *ctx)

    # ------------------------------------------------------------------ dispatch
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        handler = _OPS.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        handler = _OPS.get(func)
        if handler is None:
            handler = _OPS.get(func.overloadpacket)
        if handler is not None:
            return handler(func, args, kwargs)
        raise NotImplementedError(
            f"GGUFTensor does not implement {func} (the weight is kept packed; only linear/matmul, "
            f"embedding, device/dtype moves, detach, clone and copy_ are supported). Call "
            f".dequantize() first to get a dense tensor, e.g. w.dequantize(torch.float32)."
        )


def _rebuild_gguf_tensor(packed, qtype, shape, dtype, transposed=False):
    return GGUFTensor(packed, qtype, shape, dtype, transposed)


# ---------------------------------------------------------------------- helpers
def _plain(w: GGUFTensor, what: str) -> None:
    if w.transposed:
        raise NotImplementedError(
            f"{what}: got the transposed view of a GGUFTensor; pass the weight itself (y = F.linear(x, w)) "
            f"or use x @ w.T"
        )
    if w.packed.dim() != 2:
        raise NotImplementedError(
            f"{what}: GGUFTensor of shape {tuple(w.shape)} is not a 2-D weight; stacked expert weights go "
            f"through torch.ops.hanzo.mul_mat_id(x, w.packed, ids, w.qtype)"
        )


def _mul_mat(x: torch.Tensor, w: GGUFTensor, bias: Optional[torch.Tensor], what: str) -> torch.Tensor:
    """y = x @ W^T (+ bias) for a plain (untransposed) 2-D GGUFTensor W."""
    if isinstance(x, GGUFTensor):
        raise NotImplementedError(f"{what}: both operands are GGUFTensors; dequantize one of them")
    _plain(w, what)
    if isinstance(bias, GGUFTensor):
        bias = bias.dequantize(x.dtype)
    y = torch.ops.hanzo.mul_mat(x, w.packed, w.qtype)
    return y if bias is None else y + bias


# ---------------------------------------------------------------------- matmul family
@_implements(F.linear, aten.linear.default)
def _linear(func, args, kwargs):
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if not isinstance(w, GGUFTensor):
        raise NotImplementedError("F.linear: the input may not be a GGUFTensor; call .dequantize() first")
    return _mul_mat(x, w, bias, "F.linear")


@_implements(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
             aten.matmul.default, aten.mm.default)
def _matmul(func, args, kwargs):
    x, wt = args[0], args[1]
    if not isinstance(wt, GGUFTensor) or not wt.transposed:
        raise NotImplementedError(
            f"{func}: a GGUFTensor can only be the right operand of x @ w.T (w of shape (N, K)); "
            f"call .dequantize() for other products"
        )
    if isinstance(func, torch._ops.OpOverload) and func is aten.mm.default and x.dim() != 2:
        raise ValueError(f"mm: expected a 2-D input, got shape {tuple(x.shape)}")
    return _mul_mat(x, wt._with(transposed=False), None, str(getattr(func, "__name__", func)))


@_implements(torch.Tensor.__rmatmul__)
def _rmatmul(func, args, kwargs):
    # w.T.__rmatmul__(x) == x @ w.T
    return _matmul(torch.matmul, (args[1], args[0]), kwargs)


@_implements(aten.addmm.default)
def _addmm(func, args, kwargs):
    bias, x, wt = args[0], args[1], args[2]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if not isinstance(wt, GGUFTensor) or not wt.transposed or isinstance(bias, GGUFTensor):
        raise NotImplementedError("addmm: a GGUFTensor is only supported as the transposed weight of a linear")
    y = _mul_mat(x, wt._with(transposed=False), None, "addmm")
    if alpha != 1:
        y = y * alpha
    return y + (bias if beta == 1 else beta * bias)


def _check_transpose_2d(w: GGUFTensor, what: str) -> None:
    if w.dim() != 2:
        raise NotImplementedError(
            f"{what}: only a 2-D GGUFTensor can be transposed (shape {tuple(w.shape)}); call .dequantize() first"
        )


@_implements(aten.t.default, aten.numpy_T.default)
def _t(func, args, kwargs):
    w = args[0]
    _check_transpose_2d(w, str(func))
    return w._with(transposed=not w.transposed)


@_implements(aten.transpose.int)
def _transpose(func, args, kwargs):
    w, d0, d1 = args[0], args[1], args[2]
    _check_transpose_2d(w, "transpose")
    if d0 % 2 == d1 % 2:
        return w._with()
    return w._with(transposed=not w.transposed)


@_implements(aten.permute.default)
def _permute(func, args, kwargs):
    w, dims = args[0], [d % 2 for d in args[1]]
    _check_transpose_2d(w, "permute")
    return w._with(transposed=(not w.transposed) if dims == [1, 0] else w.transposed)


# ---------------------------------------------------------------------- embedding
@_implements(F.embedding, aten.embedding.default)
def _embedding(func, args, kwargs):
    if func is F.embedding:
        ids, w = args[0], args[1]
        max_norm = args[3] if len(args) > 3 else kwargs.get("max_norm")
        if max_norm is not None:
            raise NotImplementedError("F.embedding with max_norm would rewrite a packed weight; not supported")
    else:
        w, ids = args[0], args[1]
    if not isinstance(w, GGUFTensor) or isinstance(ids, GGUFTensor):
        raise NotImplementedError("embedding: ids may not be a GGUFTensor")
    _plain(w, "embedding")
    return torch.ops.hanzo.get_rows(w.packed, ids, w.qtype, w.dtype)


# ---------------------------------------------------------------------- tensor housekeeping
@_implements(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    w = args[0]
    return w._with(packed=func(w.packed))


@_implements(aten.clone.default)
def _clone(func, args, kwargs):
    w = args[0]
    mf = kwargs.get("memory_format")
    if mf not in (None, torch.preserve_format, torch.contiguous_format):
        raise NotImplementedError(f"GGUFTensor.clone: memory_format {mf} is not supported")
    return w._with(packed=w.packed.clone())


@_implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    w = args[0]
    dtype = kwargs.get("dtype") or w.dtype
    if dtype not in _FLOAT_DTYPES:
        raise NotImplementedError(
            f"GGUFTensor.to({dtype}): the compute dtype must be a float dtype; call .dequantize() to get "
            f"a dense tensor"
        )
    device = kwargs.get("device")
    packed = w.packed
    if device is not None:
        packed = packed.to(device=device, non_blocking=bool(kwargs.get("non_blocking", False)), copy=True)
    else:
        packed = packed.clone()
    if kwargs.get("pin_memory"):
        packed = packed.pin_memory()
    return w._with(packed=packed, dtype=dtype)


@_implements(aten.copy_.default)
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if not (isinstance(dst, GGUFTensor) and isinstance(src, GGUFTensor)):
        raise NotImplementedError(
            "copy_ between a GGUFTensor and a dense tensor is not supported; load packed weights with "
            "load_state_dict(..., assign=True) or copy a GGUFTensor of the same format"
        )
    if (dst.qtype, dst.logical_shape, dst.transposed) != (src.qtype, src.logical_shape, src.transposed):
        raise ValueError(
            f"copy_: GGUFTensor {dst.qtype} {tuple(dst.shape)} cannot take {src.qtype} {tuple(src.shape)}"
        )
    dst.packed.copy_(src.packed)
    return dst


@_implements(aten.is_pinned.default)
def _is_pinned(func, args, kwargs):
    return args[0].packed.is_pinned()


@_implements(aten._has_compatible_shallow_copy_type.default)
def _compatible(func, args, kwargs):
    return False


torch.serialization.add_safe_globals([GGUFTensor, _rebuild_gguf_tensor])
