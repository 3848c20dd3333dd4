"""The formats of the C++ CPU rule table, as data: the one list the kernels are built from.

``csrc/cpu/format_list.h`` (``HZ_FOR_EACH_FORMAT``: trait ``F<NAME>`` of csrc/cpu/formats.h per
format) is generated from :data:`RULES` (``python -m hanzo_torch.backends.cpu.rules`` rewrites it;
tests/test_backends_contract.py checks it is up to date), and the built extension's own table is
checked against it when it loads. Adding a format to the CPU backend: its trait in formats.h and
its name here.
"""
from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["RULES", "HEADER_PATH", "render_header"]

RULES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL",
         "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "Q1_0")
"""ggml names of the quantized formats with a C++ trait, in the order of the kernels' table
(dense F32/F16/BF16 weights run torch's GEMM)."""

HEADER_PATH = Path(__file__).resolve().parents[3] / "csrc" / "cpu" / "format_list.h"


def render_header() -> str:
    """The text of ``csrc/cpu/format_list.h`` for :data:`RULES`."""
    lines = ["// Generated from hanzo_torch/backends/cpu/rules.py (python -m hanzo_torch.backends.cpu.rules);",
             "// do not edit. The formats of the CPU kernels' table: X(F<NAME>) per trait of formats.h.",
             "#pragma once", "", "#define HZ_FOR_EACH_FORMAT(X) \\"]
    items = [f"X(F{n})" for n in RULES]
    rows = [" ".join(items[i:i + 8]) for i in range(0, len(items), 8)]
    lines += [f"    {r} \\" for r in rows[:-1]] + [f"    {rows[-1]}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    HEADER_PATH.write_text(render_header())
    print(f"wrote {HEADER_PATH}", file=sys.stderr)
