"""Numbers that more than one language of hanzo-torch needs: written once here, generated into
``csrc/common/hz_constants.h`` (C++) and ``csrc/vulkan/shaders/hz_constants.glsl`` (GLSL) by
``python -m hanzo_torch.formats.codegen`` (tests/test_formats_codegen.py fails when a committed
file differs from what this module gives).

Format facts come from the format registry (:mod:`hanzo_torch.formats`): the q8_0 block of the
quantized KV cache is the registered ``Q8_0`` format's, the q8_1 activation block is
:mod:`hanzo_torch.formats.q8_1`'s. The mat-vec / GEMM crossovers are measured tuning choices of
one backend each, kept here because the C++ dispatch, the shaders and the Python side (the
kernels' wrappers, the conformance suite) all read them.
"""
from __future__ import annotations

from .formats import FORMATS
from .formats.q8_1 import Q8_1_BLOCK_BYTES, QK8_1

__all__ = ["Q8_0_BLOCK", "Q8_0_BYTES", "Q8_1_BLOCK", "Q8_1_BYTES", "q8_0_row_bytes", "CPU_MATVEC_MAX_ROWS",
           "VULKAN_MATVEC_MAX_ROWS", "CONSTANTS"]

Q8_0_BLOCK: int = FORMATS["Q8_0"].block_size
"""Values per ggml ``block_q8_0`` (32): the block of a ``uint8`` (q8_0) KV cache row."""

Q8_0_BYTES: int = FORMATS["Q8_0"].type_size
"""Bytes per ggml ``block_q8_0`` (34: an fp16 scale ``d``, 32 int8 codes ``qs``)."""

Q8_1_BLOCK: int = QK8_1
"""Values per ggml ``block_q8_1`` (32), the activation block of the int8 dot products."""

Q8_1_BYTES: int = Q8_1_BLOCK_BYTES
"""Bytes per ggml ``block_q8_1`` (36: fp16 ``d``, fp16 ``s = d * sum(qs)``, 32 int8 ``qs``)."""

CPU_MATVEC_MAX_ROWS: int = 5
"""The C++ CPU ``mul_mat`` (and ``mul_mat_id`` per expert, ``swiglu_mul_mat``) uses the mat-vec
kernel up to this many activation rows and the tiled GEMM above it (crossover measured at 6-8
rows for Q4_K and Q6_K, K=1536, on a 2-core AMD EPYC Zen 3 machine)."""

VULKAN_MATVEC_MAX_ROWS: int = 8
"""The Vulkan ``mul_mat`` (and ``swiglu_mul_mat``) runs the mat-vec shaders up to this many
activation rows (their per-row accumulators, ``HZ_MV_MAX_M``) and the tiled GEMM above it."""


def q8_0_row_bytes(d: int) -> int:
    """Bytes of one q8_0 KV cache row of ``d`` values (``d / 32 * 34``; ``d`` a multiple of
    :data:`Q8_0_BLOCK`, which the caller checks)."""
    return d // Q8_0_BLOCK * Q8_0_BYTES


CONSTANTS = {
    "Q8_0_BLOCK": (Q8_0_BLOCK, "values per ggml block_q8_0 (q8_0 KV cache rows)"),
    "Q8_0_BYTES": (Q8_0_BYTES, "bytes per ggml block_q8_0 (fp16 d, int8 qs[32])"),
    "Q8_1_BLOCK": (Q8_1_BLOCK, "values per ggml block_q8_1 (int8 dot-product activations)"),
    "Q8_1_BYTES": (Q8_1_BYTES, "bytes per ggml block_q8_1 (fp16 d, fp16 s, int8 qs[32])"),
    "CPU_MATVEC_MAX_ROWS": (CPU_MATVEC_MAX_ROWS, "CPU mul_mat: mat-vec kernel up to this many rows, GEMM above"),
    "VK_MATVEC_MAX_ROWS": (VULKAN_MATVEC_MAX_ROWS, "Vulkan mul_mat: mat-vec shaders up to this many rows, GEMM above"),
}
"""``{name: (value, what it is)}``: what the generated files define, as ``HZ_<name>``."""
