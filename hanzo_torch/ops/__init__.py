"""The ``hanzo`` custom ops (``torch.ops.hanzo.*``): the contraction axis.

Importing this package defines every op (schema, fake kernel, vectorized-torch reference) and
then loads the optional fast backends, which register their kernels in
:mod:`hanzo_torch.ops._common`. A backend that cannot be used here (no compiler, no GPU, no
triton) registers nothing and the references run. See docs/ARCHITECTURE.md for the schemas.
"""
from . import _common  # noqa: F401
from . import quant  # noqa: F401  dequantize, quantize_q8_1, mul_mat, mul_mat_id, get_rows
from . import fused  # noqa: F401  moe_route, rms_norm, add_rms_norm, qk_norm_rope, swiglu, kv_cache_write, attention
from . import ffn  # noqa: F401  swiglu_mul_mat


def _load_backends() -> None:
    import importlib

    for name in ("cpu", "triton"):
        try:
            importlib.import_module(f"hanzo_torch.backends.{name}")
        except ImportError:
            pass


_load_backends()
