"""The op table: one :class:`OpSpec` per ``hanzo`` op, and everything derived from it.

A declaration (:func:`declare`) names the op and gives its schema, its argument check, its
reference (plain torch), the rule for the shapes of its outputs, the arguments it writes in place,
optionally a hand-written backward, a trace form for ``torch.export`` (only where the reference
reads data on the host) and the conformance tolerance. From it :func:`declare` derives:

- the ``torch.library.custom_op`` ``hanzo::<op>``, whose body runs a backend's kernel or else the
  checked reference (:func:`hanzo_torch.ops._dispatch.default`), and its fake kernel (the check,
  then the output rule on ``new_empty`` tensors);
- ``torch.ops.hanzo_ref.<op>`` (the checked reference as an op) and the entry of ``OPS``;
- the autograd formula: the hand-written one, or a default that differentiates the reference
  with respect to the op's floating-point tensor arguments (packed, integer and string arguments
  are constants); ops that write an argument in place raise a clear error in backward instead;
- :func:`check_args`, ``export.DECOMPOSITIONS`` (:func:`decompositions`), the conformance
  tolerances (:attr:`OpSpec.tolerance`) and the C++ op enum (:mod:`hanzo_torch.ops.codegen`).

Float64: the references compute in ``promote(dtype, float32)``, and the checks accept float64
activations as a reference-only dtype: no backend kernel takes float64 (each one's fit test hands
the call to the reference), so ``torch.autograd.gradcheck`` can run every op in float64.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from . import _dispatch

__all__ = ["OpSpec", "SPECS", "declare", "spec", "check_args", "decompositions", "compute_dtype", "NoBackwardError"]


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a reference computes in for ``t``: float32, or float64 for a float64 input."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class NoBackwardError(RuntimeError):
    """Backward reached an op that writes its arguments in place (it has no gradient formula)."""


@dataclass(eq=False)
class OpSpec:
    """The declaration of one ``hanzo`` op.

    Attributes:
        name: op name (``torch.ops.hanzo.<name>``).
        schema: torch schema without the name, e.g. ``"(Tensor x, Tensor w, str qtype) -> Tensor"``.
        check: ``check(*args)``: raises the op's ValueError for bad shapes, dtypes or devices;
            reads no tensor data (the fake kernel runs it).
        reference: ``reference(*args)``: the op in plain torch, called after ``check``; may read
            data on the host (range checks) and raise IndexError/ValueError for bad values.
        outputs: ``outputs(*args)``: the result as empty tensors of the right shapes and dtypes
            (the fake kernel's), or None for an op that returns nothing.
        mutates: names of the arguments written in place.
        backward: ``(setup_context, backward)`` for ``register_autograd``, overriding the default.
        trace: a form with static shapes for ``torch.export`` where the reference reads data
            on the host; None: the reference is that form.
        tolerance: conformance tolerance (a name in tests/test_conformance.py's ``TOLERANCE``).
        device_arg: index of the argument whose device chooses the backend.
        doc: the op's docstring (``torch.ops.hanzo.<name>``'s ``help``); default: the reference's.
    """

    name: str
    schema: str
    check: Callable[..., None]
    reference: Callable[..., Any]
    outputs: Optional[Callable[..., Any]]
    mutates: tuple = ()
    backward: Optional[tuple] = None
    trace: Optional[Callable[..., Any]] = None
    tolerance: str = "close"
    device_arg: int = 0
    doc: str = ""
    op: Any = field(default=None, repr=False)  # the CustomOpDef, set by declare()

    def checked_reference(self, *args):
        """``check`` then ``reference``: the body of ``torch.ops.hanzo_ref.<name>``."""
        self.check(*args)
        return self.reference(*args)

    @property
    def overload(self):
        """``torch.ops.hanzo.<name>.default``."""
        return getattr(torch.ops.hanzo, self.name).default

    @property
    def export_form(self) -> Callable[..., Any]:
        """What ``torch.export`` traces in place of the op (:attr:`trace`, else :attr:`reference`)."""
        return self.trace or self.reference


SPECS: dict[str, OpSpec] = {}
"""Every declared op by name, in declaration order."""


def spec(name: str) -> OpSpec:
    """The declaration of ``hanzo::<name>``; ValueError for an unknown op."""
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown hanzo op {name!r}; ops: {', '.join(SPECS)}") from None


def check_args(op: str, *args) -> None:
    """Run the argument checks of ``hanzo::<op>`` (the ones its fake kernel and reference run).

    For backends written in Python, which must reject what the reference rejects. Raises the op's
    ValueError; returns None when the arguments are acceptable.
    """
    spec(op).check(*args)


def decompositions() -> dict:
    """``{torch.ops.hanzo.<op>.default: export form}`` of every op (``export.DECOMPOSITIONS``)."""
    return {s.overload: s.export_form for s in SPECS.values()}


# ---------------------------------------------------------------------------------------------- declare
def declare(s: OpSpec):
    """Define ``hanzo::<s.name>`` from its declaration (see the module docstring); returns the
    ``CustomOpDef``."""
    if s.name in SPECS:
        raise ValueError(f"hanzo op {s.name!r} is declared twice")
    name, dev, check, reference = s.name, s.device_arg, s.check, s.reference
    default = _dispatch.default

    def ref(*args):  # the checked reference (OpSpec.checked_reference), without a bound-method call
        check(*args)
        return reference(*args)

    def body(*args):
        return default(name, args[dev].device.type, ref, *args)

    body.__name__ = name
    body.__doc__ = s.doc or s.reference.__doc__
    op = torch.library.custom_op(f"hanzo::{name}", body, mutates_args=s.mutates, schema=s.schema)
    outputs = s.outputs

    def fake(*args):
        check(*args)
        return None if outputs is None else outputs(*args)

    op.register_fake(fake)
    s.op = op
    SPECS[name] = s
    _dispatch.define_reference_op(name, ref)
    _register_autograd(s)
    return op


def _schema_args(s: OpSpec) -> list:
    return list(s.overload._schema.arguments)


def _is_tensor_arg(a) -> bool:
    t = a.type
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


def _register_autograd(s: OpSpec) -> None:
    if s.mutates:
        _register_no_backward(s)
        return
    if s.backward is not None:
        setup, bwd = s.backward
        s.op.register_autograd(bwd, setup_context=setup)
        return
    tensor_idx = tuple(i for i, a in enumerate(_schema_args(s)) if _is_tensor_arg(a))
    setup, bwd = _reference_backward(s, tensor_idx)
    s.op.register_autograd(bwd, setup_context=setup)


def _reference_backward(s: OpSpec, tensor_idx: tuple):
    """``(setup_context, backward)`` that differentiate ``s.reference`` with respect to its float
    tensor arguments, the others held constant."""
    reference = s.reference

    def setup_context(ctx, inputs, output):
        ctx.args = [None if i in tensor_idx else a for i, a in enumerate(inputs)]
        ctx.save_for_backward(*(inputs[i] for i in tensor_idx))

    def backward(ctx, *grads):
        args = list(ctx.args)
        wrt = []
        for i, t in zip(tensor_idx, ctx.saved_tensors):
            if t is not None and t.is_floating_point() and ctx.needs_input_grad[i]:
                t = t.detach().requires_grad_(True)
                wrt.append(i)
            args[i] = t
        result = [None] * len(args)
        if not wrt:
            return tuple(result)
        with torch.enable_grad():
            out = reference(*args)
            outs = out if isinstance(out, tuple) else (out,)
            pairs = [(o, g) for o, g in zip(outs, grads)
                     if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
            if not pairs:
                return tuple(result)
            got = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in wrt],
                                      [g.to(o.dtype) for o, g in pairs], allow_unused=True)
        for i, g in zip(wrt, got):
            result[i] = g
        return tuple(result)

    return setup_context, backward


def _register_no_backward(s: OpSpec) -> None:
    """The autograd kernel of an op that writes arguments in place. When an input needs a gradient,
    the written arguments get a graph node whose backward raises :class:`NoBackwardError` naming the
    op (a gradient through them would otherwise be silently zero); the op's other outputs (the
    rotated q of ``qk_norm_rope_kv_write``) differentiate its reference, run on scratch copies of
    the written arguments."""
    name, args_schema = s.name, _schema_args(s)
    mutated = tuple(i for i, a in enumerate(args_schema) if a.name in s.mutates)
    kept = tuple(i for i, a in enumerate(args_schema) if _is_tensor_arg(a) and i not in mutated)
    overload, reference, n = s.overload, s.reference, len(mutated)
    msg = (f"hanzo::{name} has no backward: it writes {', '.join(s.mutates)} in place, and no gradient "
           f"flows back through what it wrote; a trainable graph keeps its keys and values as tensors "
           f"(no KV cache)")

    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, keyset, *args):
            with torch._C._AutoDispatchBelowAutograd():
                out = overload.redispatch(keyset & torch._C._after_autograd_keyset, *args)
            ctx.set_materialize_grads(False)
            ctx.args = [None if (i in mutated or i in kept) else a for i, a in enumerate(args)]
            ctx.scratch = [(args[i].shape, args[i].dtype, args[i].device) for i in mutated]
            ctx.save_for_backward(*(args[i] for i in kept))
            dirty = [args[i] for i in mutated]
            ctx.mark_dirty(*dirty)
            return (*dirty, out) if out is not None else tuple(dirty)

        @staticmethod
        def backward(ctx, *grads):
            if any(g is not None for g in grads[:n]):
                raise NoBackwardError(msg)
            args = list(ctx.args)
            for i, (shape, dtype, device) in zip(mutated, ctx.scratch):
                args[i] = torch.empty(shape, dtype=dtype, device=device)
            wrt = []
            for i, t in zip(kept, ctx.saved_tensors):
                if t is not None and t.is_floating_point() and ctx.needs_input_grad[1 + i]:
                    t = t.detach().requires_grad_(True)
                    wrt.append(i)
                args[i] = t
            result = [None] * (1 + len(args))
            outs_grads = [(g, k) for k, g in enumerate(grads[n:]) if g is not None]
            if not wrt or not outs_grads:
                return tuple(result)
            with torch.enable_grad():
                out = reference(*args)
                outs = out if isinstance(out, tuple) else (out,)
                got = torch.autograd.grad([outs[k] for _, k in outs_grads], [args[i] for i in wrt],
                                          [g.to(outs[k].dtype) for g, k in outs_grads], allow_unused=True)
            for i, g in zip(wrt, got):
                result[1 + i] = g
            return tuple(result)

    def autograd_impl(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            for i in mutated:
                if not args[i].is_floating_point():
                    raise NoBackwardError(f"{msg}; a {args[i].dtype} {args_schema[i].name} cannot hold a graph "
                                          f"node, so a call whose inputs require grad is refused")
            res = NoBackward.apply(keyset, *args)
            return res[n] if len(res) > n else None
        return overload.redispatch(keyset & torch._C._after_autograd_keyset, *args)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # replaces the custom op's own Autograd kernel, on purpose
        s.op._lib.impl(name, autograd_impl, "Autograd", with_keyset=True)
