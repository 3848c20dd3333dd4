"""The ``hanzo`` custom ops (``torch.ops.hanzo.*``): the contraction axis.

Importing this package defines every op from its one declaration in the op table
(:mod:`hanzo_torch.ops.spec`): schema, argument check, vectorized-torch reference (also registered
as ``torch.ops.hanzo_ref.<op>``), fake kernel, autograd formula and ``torch.export`` form. Backends
(:mod:`hanzo_torch.backends`) register their kernels on torch's dispatch keys; they are loaded on
the first op call on a device type. See docs/ARCHITECTURE.md for the schemas and
:mod:`hanzo_torch.ops._dispatch` for the dispatch rules.

A/B against the references: ``HANZO_<OP>_FALLBACK=1`` (read at import) or, in process,
``with hanzo_torch.ops.use_reference("mul_mat"): ...``.
"""
from . import _dispatch
from . import spec  # noqa: F401  the op table (OpSpec, SPECS, declare)
from . import quant  # noqa: F401  dequantize, quantize_q8_1, mul_mat, mul_mat_id, get_rows
from . import fused  # noqa: F401  moe_route, rms_norm, add_rms_norm, qk_norm_rope, swiglu, kv_cache_write, attention
from . import ffn  # noqa: F401  swiglu_mul_mat
from . import group  # noqa: F401  mul_mat_group
from . import lora  # noqa: F401  lora_mul_mat
from ._dispatch import OPS, reference_enabled, reference_ops, set_reference, use_reference  # noqa: F401
from .spec import SPECS, check_args  # noqa: F401

__all__ = ["OPS", "SPECS", "use_reference", "set_reference", "reference_enabled", "reference_ops", "check_args"]
