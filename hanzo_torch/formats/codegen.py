"""C++ block definitions generated from the format registry: ``csrc/cpu/ggml_blocks.h``.

``python -m hanzo_torch.formats.codegen`` rewrites the header; ``--check`` exits with status 1
(and says which file) when the committed header differs from what the registry gives. The
header is ggml's ``ggml-common.h`` in style: one ``block_<type>`` struct per quantized format
with its fields, types and ``static_assert`` sizes and offsets, plus each format's ggml type
id, block size (``type_id``, ``qk`` as static members) and ``vec_dot_type``, and the format's
constant tables: the small ones (the 16 levels of a 4-bit code) as ``int8_t`` arrays, the
codebook grids as numbered slots (``HzTableSlot``) that the CPU backend fills at run time from
the same registry tables (:func:`table_slots`).

The default test suite regenerates the header and compares it with the file
(tests/test_formats_codegen.py), so the two cannot drift apart.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from . import FORMATS, Format

__all__ = ["HEADER_PATH", "block_struct_name", "table_slots", "render_header", "main"]

HEADER_PATH = Path(__file__).resolve().parents[2] / "csrc" / "cpu" / "ggml_blocks.h"
"""Where the generated header lives in a checkout."""

INLINE_TABLE_MAX = 64
"""Tables with at most this many entries are written into the header; larger ones get a slot."""


def block_struct_name(fmt: Format) -> str:
    """ggml's struct name of ``fmt``'s block: ``block_q4_0``, ``block_q4_K``, ``block_iq2_xxs``."""
    low = fmt.name.lower()
    return "block_" + (low[:-2] + "_K" if low.endswith("_k") else low)


def _tables(fmt: Format):
    for name, table in fmt.tables.items():
        t = table.cpu
        if t.dtype.is_floating_point:
            assert torch.equal(t, t.round()) and t.abs().max() <= 127, f"{fmt.name}.{name}: not int8 values"
        yield name, t


def _slot_names() -> list[tuple[str, int]]:
    """``(HZ_TABLE_<FORMAT>_<TABLE>, slot)`` of every large table; formats that share one table
    object (IQ1_S and IQ1_M share a grid) share its slot."""
    names, by_obj = [], {}
    for fmt in FORMATS.values():
        for name, table in fmt.tables.items():
            if table.cpu.numel() > INLINE_TABLE_MAX:
                slot = by_obj.setdefault(id(table), len(by_obj))
                names.append((f"HZ_TABLE_{fmt.name}_{name.upper()}", slot))
    return names


def table_slots() -> list[tuple[int, str, str, torch.Tensor]]:
    """``(slot, format name, table name, int8 tensor)`` of every table that is installed at run
    time (more than :data:`INLINE_TABLE_MAX` entries), one per slot, in slot order; the slots are
    the ``HZ_TABLE_<FORMAT>_<TABLE>`` constants of the header."""
    out, seen = [], set()
    for fmt in FORMATS.values():
        for name, t in _tables(fmt):
            obj = id(fmt.tables[name])
            if t.numel() > INLINE_TABLE_MAX and obj not in seen:
                seen.add(obj)
                out.append((len(out), fmt.name, name, t.to(torch.int8).contiguous()))
    return out


def render_header() -> str:
    """The text of ``csrc/cpu/ggml_blocks.h`` for the formats registered now."""
    quant = [f for f in FORMATS.values() if not f.dense]
    w = [
        "// Block structs of the ggml formats (ggml-common.h style), GENERATED from the format registry",
        "// (hanzo_torch/formats) by `python -m hanzo_torch.formats.codegen`: edit the registry, not this",
        "// file. tests/test_formats_codegen.py fails when the two differ.",
        "#pragma once",
        "#include <stddef.h>",
        "#include <stdint.h>",
        "",
        "typedef uint16_t ggml_half;  // IEEE fp16 bits",
        "",
        "// ggml's activation block types (vec_dot_type) a weight block is dotted with",
        "enum HzVecDotType { HZ_VEC_DOT_Q8_0 = 0, HZ_VEC_DOT_Q8_1 = 1, HZ_VEC_DOT_Q8_K = 2 };",
        "",
        "// Constant tables installed at run time (hz_tables[slot], from the registry's tables)",
        "enum HzTableSlot {",
    ]
    slots = table_slots()
    for cname, slot in _slot_names():
        w.append(f"    {cname} = {slot},")
    w += [f"    HZ_N_TABLES = {len(slots)}", "};",
          "static const int64_t hz_table_numel[HZ_N_TABLES] = {" + ", ".join(str(t.numel()) for *_, t in slots) + "};",
          ""]
    for fmt in quant:
        s = block_struct_name(fmt)
        w.append(f"// {fmt.name}: ggml type {fmt.type_id}, {fmt.block_size} values in {fmt.type_size} bytes, "
                 f"{fmt.group_len} values per scale group, dotted with {fmt.vec_dot_type}")
        w.append(f"struct {s} {{")
        for f in fmt.fields:
            w.append(f"    {f.ctype} {f.name}{f'[{f.count}]' if f.count else ''};")
        w.append(f"    static constexpr int type_id = {fmt.type_id}, qk = {fmt.block_size}, group_len = {fmt.group_len};")
        w.append(f"    static constexpr HzVecDotType vec_dot_type = HZ_VEC_DOT_{fmt.vec_dot_type.upper()};")
        w.append("};")
        w.append(f'static_assert(sizeof({s}) == {fmt.type_size}, "wrong {fmt.name} block size");')
        for f in fmt.fields:
            w.append(f'static_assert(offsetof({s}, {f.name}) == {f.offset}, "wrong offset of {fmt.name}.{f.name}");')
        for name, t in _tables(fmt):
            if t.numel() <= INLINE_TABLE_MAX:
                vals = ", ".join(str(int(v)) for v in t.reshape(-1).tolist())
                w.append(f"static const int8_t hz_{name}_{fmt.name.lower()}[{t.numel()}] = {{{vals}}};")
        w.append("")
    return "\n".join(w)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hanzo_torch.formats.codegen", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the committed header instead of writing it")
    p.add_argument("-o", "--output", type=Path, default=HEADER_PATH, help="header path (default: %(default)s)")
    a = p.parse_args(argv)
    text = render_header()
    if a.check:
        old = a.output.read_text() if a.output.exists() else None
        if old != text:
            print(f"{a.output} is out of date: run python -m hanzo_torch.formats.codegen", file=sys.stderr)
            return 1
        return 0
    a.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
