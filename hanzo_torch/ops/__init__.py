"""The ``hanzo`` custom ops (``torch.ops.hanzo.*``): the contraction axis.

Importing this package defines every op: schema, fake kernel, argument checks, and the
vectorized-torch reference, which is also registered as ``torch.ops.hanzo_ref.<op>``. Backends
(:mod:`hanzo_torch.backends`) register their kernels on torch's dispatch keys; they are loaded on
the first op call on a device type. See docs/ARCHITECTURE.md for the schemas and
:mod:`hanzo_torch.ops._dispatch` for the dispatch rules.

A/B against the references: ``HANZO_<OP>_FALLBACK=1`` (read at import) or, in process,
``with hanzo_torch.ops.use_reference("mul_mat"): ...``.
"""
from . import _dispatch
from . import quant  # noqa: F401  dequantize, quantize_q8_1, mul_mat, mul_mat_id, get_rows
from . import fused  # noqa: F401  moe_route, rms_norm, add_rms_norm, qk_norm_rope, swiglu, kv_cache_write, attention
from . import ffn  # noqa: F401  swiglu_mul_mat
from ._dispatch import OPS, reference_enabled, reference_ops, set_reference, use_reference  # noqa: F401

__all__ = ["OPS", "use_reference", "set_reference", "reference_enabled", "reference_ops", "check_args"]


def check_args(op: str, *args) -> None:
    """Run the argument checks of ``hanzo::<op>`` (the ones its fake kernel and reference run).

    For backends written in Python, which must reject what the reference rejects. Raises the op's
    ValueError/IndexError; returns None when the arguments are acceptable.
    """
    for mod in (quant, fused):
        if op in mod._CHECKS:
            mod._CHECKS[op](*args)
            return
    if op == "swiglu_mul_mat":
        ffn.check_args(op, *args)
        return
    raise ValueError(f"unknown hanzo op {op!r}")
