"""C++ CPU kernels of the fused transformer ops (``csrc/cpu/fused.cpp``).

They live in the same lazily built extension as the quantized kernels (built on first use,
cached; see :mod:`hanzo_torch.backends.cpu`) and are registered with the torch dispatcher as
``torch.ops.hanzo_cpu.*``. Each function here has the signature of its reference in
:mod:`hanzo_torch.ops.fused` and is registered with
``register_kernel(op, "cpu", fn)``, so ``torch.ops.hanzo.<op>`` runs it after its checks and
``HANZO_<OP>_FALLBACK=1`` still selects the reference. If the extension cannot be built, the
references run.

Maths (float32 whatever the input dtype; one rounding to the input dtype at the end):
    rms_norm / add_rms_norm: one pass per row; ``x + residual`` is rounded to the input dtype
        before the norm, as in the reference.
    qk_norm_rope: per-head RMSNorm (optional) then NEOX RoPE with the reference's float32
        ``inv_freq``/angle arithmetic.
    kv_cache_write: caches f32/f16/bf16 or q8_0 blocks (uint8), whatever k/v's dtype: a copy
        when the dtypes match, else per row a rounding to nearest even or ggml's q8_0 quantizer.
    attention: decode-sized calls (T < 8): per (batch, token, KV head, chunk of 256 keys of
        ``0..position``) each key and value row is read and converted to float32 once for the
        G query heads of the group; chunks run on separate threads and are merged by their
        softmax maxima and sums (one chunk is the exact max-subtracted softmax). Prompts: per
        (batch, KV head, tile of ~32 tokens) two float32 BLAS GEMMs (``at::mm``) over the keys
        up to the tile's last position, masked per row at its own position, exact softmax, on
        a float32 copy of the live prefix. P*V in float32 throughout; only the live prefix
        ``0..max(positions)`` of the cache is read. ``impl`` (eager/flash) is an
        accuracy/memory choice of the references; this kernel gives the same maths for all.
    moe_route: torch's float32 softmax, then top-k by a partial sort with ties to the lower
        expert index and the optional renormalization in C++.

Tolerance against the references (tests/test_cpu_fused.py): float32 results agree to ~1e-5
relative (summation order and libm differ); bf16/f16 results to one rounding of the dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...ops import _common
from ...ops import fused as _ref

__all__ = ["rms_norm", "add_rms_norm", "swiglu", "qk_norm_rope", "kv_cache_write", "attention", "moe_route",
           "OPS", "DIRECT_DISPATCH_OPS"]

OPS = ("rms_norm", "add_rms_norm", "swiglu", "qk_norm_rope", "kv_cache_write", "attention", "moe_route")

_ops = None  # torch.ops.hanzo_cpu overloads, looked up once the extension is loaded


def _kernels():
    """``{name: OpOverload}`` of the C++ kernels, or None when the extension cannot be built."""
    global _ops
    if _ops is not None:
        return _ops
    from . import extension

    if extension() is None:
        return None
    ns = torch.ops.hanzo_cpu
    _ops = {name: getattr(ns, name).default for name in OPS}
    return _ops


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    k = _ops or _kernels()
    if k is None:
        return _ref.rms_norm_reference(x, w, eps)
    return k["rms_norm"](x, w, eps)


def add_rms_norm(x: Tensor, residual: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    k = _ops or _kernels()
    if k is None:
        return _ref.add_rms_norm_reference(x, residual, w, eps)
    return k["add_rms_norm"](x, residual, w, eps)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    k = _ops or _kernels()
    if k is None:
        return _ref.swiglu_reference(gate, up)
    return k["swiglu"](gate, up)


def qk_norm_rope(q: Tensor, k: Tensor, q_w: Optional[Tensor], k_w: Optional[Tensor], positions: Tensor,
                 theta: float, eps: float) -> tuple[Tensor, Tensor]:
    ops = _ops or _kernels()
    if ops is None:
        return _ref.qk_norm_rope_reference(q, k, q_w, k_w, positions, theta, eps)
    return ops["qk_norm_rope"](q, k, q_w, k_w, positions, theta, eps)


def kv_cache_write(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> None:
    ops = _ops or _kernels()
    if ops is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        _ref.kv_cache_write_reference(k_cache, v_cache, k, v, positions)
        return
    ops["kv_cache_write"](k_cache, v_cache, k, v, positions)


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor, scale: float,
              impl: str = "auto") -> Tensor:
    ops = _ops or _kernels()
    if ops is None:
        return _ref.attention_reference(q, k_cache, v_cache, positions, scale, impl)
    return ops["attention"](q, k_cache, v_cache, positions, scale)


def moe_route(logits: Tensor, k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    ops = _ops or _kernels()
    if ops is None:
        return _ref.moe_route_reference(logits, k, normalize)
    # torch's softmax (one op) keeps the weights bit-identical to the reference's; the C++ kernel
    # replaces the sort, slicing and renormalization
    return ops["moe_route"](torch.softmax(logits.float(), dim=-1), k, normalize)


def _register() -> None:
    for name in OPS:
        _common.register_kernel(name, "cpu", globals()[name])


# ----------------------------------------------------------------------------------------------
# Direct CPU dispatch of the hanzo custom ops
# ----------------------------------------------------------------------------------------------
_DIRECT_LIBS: Optional[dict] = None  # op name -> the torch.library.Library holding its CPU kernel
_BODIES: dict = {}  # op name -> the custom op's Python body

FAST_PATH_OPS = ("mul_mat", "swiglu_mul_mat", "rms_norm", "add_rms_norm", "qk_norm_rope", "kv_cache_write",
                 "attention")
"""The ops whose CPU kernel becomes C++ (csrc/cpu/ops.cpp, ``fast::``) once the extension is built."""


def _direct_dispatch_enabled() -> bool:
    import os

    return os.environ.get("HANZO_CPU_DIRECT_DISPATCH", "1").strip().lower() not in ("0", "false", "no", "off")


def _install_direct_dispatch() -> list[str]:
    """Register each ``hanzo::`` custom op's own Python body as its kernel for the CPU dispatch key.

    ``torch.library.custom_op`` routes every call through a generic backend wrapper (a
    torch._dynamo-disable wrapper, an output-alias check, a per-device-kernel lookup): ~10-30 us
    per call on this machine, paid ~300 times per decode token. The body registered here is the
    same function (same checks, same ``kernel_for`` dispatch, same ``HANZO_<OP>_FALLBACK``
    behaviour); the Autograd, ADInplaceOrView, Meta and fake (torch.compile) registrations of
    the custom op are untouched, and other devices keep the generic path. Once the C++
    extension is built, :func:`install_fast_paths` replaces the bodies of :data:`FAST_PATH_OPS`
    with C++ kernels. ``HANZO_CPU_DIRECT_DISPATCH=0`` (read at import) turns both off.

    Returns the names of the ops registered.
    """
    global _DIRECT_LIBS
    if _DIRECT_LIBS is not None:
        return []
    if not _direct_dispatch_enabled():
        return []
    import importlib

    from torch._library.custom_ops import CustomOpDef

    _DIRECT_LIBS = {}
    for name in ("quant", "fused", "ffn"):  # the modules of hanzo_torch.ops that define custom ops
        try:
            mod = importlib.import_module(f"hanzo_torch.ops.{name}")
        except ImportError:
            continue
        for obj in vars(mod).values():
            body = getattr(obj, "_init_fn", None)
            if (isinstance(obj, CustomOpDef) and getattr(obj, "_namespace", None) == "hanzo" and callable(body)
                    and obj._name not in _DIRECT_LIBS):
                lib = torch.library.Library("hanzo", "IMPL")  # one per op: install_fast_paths may drop it
                lib.impl(obj._name, body, "CPU")
                _DIRECT_LIBS[obj._name] = lib
                _BODIES[obj._name] = body
    return list(_DIRECT_LIBS)


FAST_PATH_INSTALLED: list = []
"""The ops whose CPU kernel is C++ in this process (empty until the extension is built)."""


def install_fast_paths(ext, isa: int, mv_max: int) -> list[str]:
    """Make the C++ kernels of csrc/cpu/ops.cpp (``fast::``) the CPU kernels of :data:`FAST_PATH_OPS`.

    Each checks its arguments in C++ and runs the same C++ kernel as the op's Python body would,
    with the same arguments (identical results, ~20-40 us less per call); a set
    ``HANZO_<OP>_FALLBACK`` or ``HANZO_CPU_ISA``, an unknown or dense format, or arguments the
    Python checks would reject are handed to the Python body (same errors, same references).
    Called once the extension is loaded (:func:`hanzo_torch.backends.cpu.build`); a no-op when direct
    dispatch is off. ``isa``: the instruction set the fast path uses (the self-checked default).
    Returns the names of the ops now running C++ kernels.
    """
    from . import SUPPORTED_QTYPES, _type_id

    if _DIRECT_LIBS is None or FAST_PATH_INSTALLED:
        return list(FAST_PATH_INSTALLED)
    bodies = {name: _BODIES[name] for name in FAST_PATH_OPS if name in _BODIES}
    for name in bodies:  # drop the Python body's registration first (no "overriding kernel" warning)
        lib = _DIRECT_LIBS.pop(name, None)
        if lib is not None:
            lib._destroy()
    done = ext.register_fast_paths(bodies, {q: _type_id(q) for q in SUPPORTED_QTYPES}, int(isa), int(mv_max))
    FAST_PATH_INSTALLED.extend(done)

    def sync() -> None:  # each op takes its C++ path only while the kernel table picks this backend for it
        from . import mul_mat as mm, swiglu_mul_mat as smm

        ours = {"mul_mat": (mm, SUPPORTED_QTYPES), "swiglu_mul_mat": (smm, SUPPORTED_QTYPES)}
        for name in FAST_PATH_INSTALLED:
            fn, qtypes = ours.get(name, (globals().get(name), (None,)))
            ext.set_fast_path_enabled(name, _common.picks(name, "cpu", fn, qtypes))

    sync()
    _common.on_kernels_changed(sync)
    return list(done)


DIRECT_DISPATCH_OPS = _install_direct_dispatch()
"""Names of the ``hanzo`` ops whose CPU calls skip the custom-op backend wrapper (see above)."""

_register()
