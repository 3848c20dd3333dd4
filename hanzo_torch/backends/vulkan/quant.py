"""The quantized-op kernels of the Vulkan backend (``csrc/vulkan/ops_quant.cpp``): their format
table and reference mode.

The kernels of ``dequantize``, ``get_rows``, ``mul_mat``, ``mul_mat_id`` and ``swiglu_mul_mat``
register themselves on the vulkan (PrivateUse1) dispatch key when the extension loads; the first
of them to run calls :func:`configure` (from C++), which gives them the rule table: the formats of
``csrc/vulkan/shaders/formats.glsl`` with their block sizes from the registry, and the i-quant
grids (too large for GLSL constants), copied to the device once. The registry's other quantized
formats run the reference with one warning per format. Reference mode
(:func:`hanzo_torch.ops.use_reference`, ``HANZO_<OP>_FALLBACK=1``) never reaches the kernels: it
is the redirect of :mod:`hanzo_torch.ops._dispatch`, registered in front of them.

``quantize_q8_1`` runs natively (bit for bit the reference's bytes). ``mul_mat`` (and the two
projections of ``swiglu_mul_mat``) of the formats with int8 rules take an int8 path where it is
on: the activations are quantized to q8_1 on the device, then dotted with the weights' integer
codes (int8 dot products) and scaled per group, as the CPU kernels do; the results are those of
the float path with ``x`` replaced by its q8_1 values. On by default where the device reports
accelerated 4x8-bit packed signed dot products; ``HANZO_VK_INT8=1`` forces it (wherever the device
enables integer dot products), ``HANZO_VK_INT8=0`` turns it off; :func:`use_int8` in process.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Iterator

import torch

__all__ = ["configure", "int8_formats", "set_int8", "use_int8"]

_INT8_MODES = {None: -1, False: 0, True: 1, "auto": 2}


def _tables(fmt) -> torch.Tensor:
    """The format's large table (an i-quant grid) as int8 values, or an empty tensor (the small
    tables are GLSL constants of ggml_blocks.glsl)."""
    from ...formats.codegen import INLINE_TABLE_MAX

    big = [t.cpu for t in fmt.tables.values() if t.cpu.numel() > INLINE_TABLE_MAX]
    assert len(big) <= 1, f"{fmt.name}: the Vulkan rules read one large table per format"
    return big[0].reshape(-1).to(torch.int8).contiguous() if big else torch.empty(0, dtype=torch.int8)


def configure(formats=None) -> None:
    """Hand the rule table (ggml names ``formats``, default the backend's
    :func:`~hanzo_torch.backends.vulkan.rule_formats`) to the kernels.

    Called once the device runs (the grids are copied to it); later calls change nothing. Raises
    RuntimeError when the extension with the kernels is not loaded.
    """
    from ...formats import FORMATS, get_format

    backend = importlib.import_module(__package__)
    fmts = [get_format(n) for n in (backend.rule_formats() if formats is None else formats)]
    names = [f.name for f in fmts]
    lacking = [f.name for f in FORMATS.values() if not f.dense and f.name not in names]
    ops = torch.ops.hanzo_vulkan
    ops.quant_configure(names, [f.block_size for f in fmts], [f.type_size for f in fmts],
                        [_tables(f) for f in fmts], lacking)


def int8_formats() -> tuple:
    """The ggml formats whose ``mul_mat`` takes the int8 path now (empty when it is off, or the
    device lacks integer dot products). Raises RuntimeError when the extension is not loaded."""
    return tuple(torch.ops.hanzo_vulkan.quant_int8_formats())


def set_int8(mode) -> None:
    """Set the int8 path: True (forced on), False (off), ``"auto"`` (where the device accelerates
    int8 dot products) or None (back to ``HANZO_VK_INT8``). Raises ValueError for another mode."""
    if mode not in _INT8_MODES:
        raise ValueError(f"set_int8: mode must be True, False, 'auto' or None, got {mode!r}")
    torch.ops.hanzo_vulkan.quant_set_int8(_INT8_MODES[mode])


@contextlib.contextmanager
def use_int8(mode=True) -> Iterator[None]:
    """Within the block, the int8 path is in ``mode`` (see :func:`set_int8`); restored after."""
    if mode not in _INT8_MODES:
        raise ValueError(f"use_int8: mode must be True, False, 'auto' or None, got {mode!r}")
    prev = torch.ops.hanzo_vulkan.quant_set_int8(_INT8_MODES[mode])
    try:
        yield
    finally:
        torch.ops.hanzo_vulkan.quant_set_int8(prev)
