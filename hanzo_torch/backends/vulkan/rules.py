"""The formats of the Vulkan rule table, as data: the one list the shaders are compiled for.

Each ``// hz: per-format`` shader is compiled once per name here with ``-DHZ_FMT_<NAME>=1``, and
``csrc/vulkan/shaders/formats.glsl`` holds one ``HZ_FMT_<NAME>`` rule per name
(tests/test_backends_contract.py checks both ways). Adding a format to the Vulkan backend: its
rule in formats.glsl and its name here.
"""
from __future__ import annotations

__all__ = ["RULES"]

RULES = ("F32", "F16", "BF16", "Q1_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
         "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS", "TQ1_0",
         "TQ2_0", "MXFP4", "NVFP4")
"""ggml names of the formats with a Vulkan shader rule (dense F32/F16/BF16 included)."""
