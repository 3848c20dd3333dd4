"""The formats of the Vulkan rule table, as data: the one list the shaders are compiled for.

Each ``// hz: per-format`` shader is compiled once per name here with ``-DHZ_FMT_<NAME>=1``, and
``csrc/vulkan/shaders/formats.glsl`` holds one ``HZ_FMT_<NAME>`` rule per name
(tests/test_backends_contract.py checks both ways). Adding a format to the Vulkan backend: its
rule in formats.glsl and its name here.

:data:`INT8_RULES` are the formats of the int8 contraction shaders (``mul_mat_q8.comp``,
``mul_mat_vec_q8.comp``, whose first line ``// hz: variants @int8`` compiles them once per name
here with ``-DHZ_VARIANT_<NAME>=1``); ``csrc/vulkan/int8_formats.h`` gives the same list to the C++
side (``python -m hanzo_torch.backends.vulkan.rules`` rewrites it; a test checks it is up to date).
"""
from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["RULES", "INT8_RULES", "HEADER_PATH", "render_header"]

RULES = ("F32", "F16", "BF16", "Q1_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
         "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS", "TQ1_0",
         "TQ2_0", "MXFP4", "NVFP4")
"""ggml names of the formats with a Vulkan shader rule (dense F32/F16/BF16 included)."""

INT8_RULES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
"""ggml names of the formats whose mul_mat has an int8 rule (weights unpacked to int8 and dotted
with q8_1 activations); a subset of :data:`RULES`."""

HEADER_PATH = Path(__file__).resolve().parents[3] / "csrc" / "vulkan" / "int8_formats.h"


def render_header() -> str:
    """The text of ``csrc/vulkan/int8_formats.h`` for :data:`INT8_RULES`."""
    names = ", ".join(f'"{n}"' for n in INT8_RULES)
    return "\n".join([
        "// Generated from hanzo_torch/backends/vulkan/rules.py (python -m hanzo_torch.backends.vulkan.rules);",
        "// do not edit. The formats of the int8 contraction shaders (mul_mat_q8, mul_mat_vec_q8).",
        "#pragma once", "", f"#define HZ_VK_INT8_FORMATS {names}", ""])


if __name__ == "__main__":
    HEADER_PATH.write_text(render_header())
    print(f"wrote {HEADER_PATH}", file=sys.stderr)
