"""Block definitions generated from the format registry: ``csrc/cpu/ggml_blocks.h`` (C++) and
``csrc/vulkan/shaders/ggml_blocks.glsl`` (GLSL); and the shared constants of
:mod:`hanzo_torch.constants` (q8_0 / q8_1 block sizes, mat-vec / GEMM crossovers) as
``csrc/common/hz_constants.h`` (C++, CPU and Vulkan) and ``csrc/vulkan/shaders/hz_constants.glsl``.

``python -m hanzo_torch.formats.codegen`` rewrites all four; ``--check`` exits with status 1 (and
says which file) when a committed file differs from what the registry gives. The
header is ggml's ``ggml-common.h`` in style: one ``block_<type>`` struct per quantized format
with its fields, types and ``static_assert`` sizes and offsets, plus each format's ggml type
id, block size (``type_id``, ``qk`` as static members) and ``vec_dot_type``, and the format's
constant tables: the small ones (the 16 levels of a 4-bit code) as ``int8_t`` arrays, the
codebook grids as numbered slots (``HzTableSlot``) that the CPU backend fills at run time from
the same registry tables (:func:`table_slots`).

The GLSL file gives the Vulkan shaders the same facts as preprocessor constants (GLSL has no
packed structs: the shaders read bytes at field offsets): per format ``HZ_<NAME>_QK`` (values per
block), ``HZ_<NAME>_TS`` (bytes per block), ``HZ_<NAME>_GROUP_LEN``, ``HZ_<NAME>_TYPE_ID`` and
``HZ_<NAME>_<field>`` (byte offset of each block field), and the tables: up to
:data:`INLINE_TABLE_MAX` entries as GLSL ``const int[]`` arrays, compiled only into the shaders
of the formats that read them (``#if defined(HZ_FMT_<NAME>)``); the larger ones (the i-quant
grids) only by size (``HZ_<NAME>_TABLE_<TABLE>_NUMEL``): the Vulkan backend uploads them once
from the registry as int8 buffers whose address the shaders take (lavapipe spends from seconds
to minutes compiling a dynamically indexed ``const`` array of 512+ words, measured).

The constants files define ``HZ_<NAME>`` for every entry of :data:`hanzo_torch.constants.CONSTANTS`
(unsuffixed integers in C++, ``u``-suffixed in GLSL) and the q8_0 KV cache row size
(``hz_q8_0_row_bytes(D)`` in C++, ``HZ_Q8_0_ROW_BYTES(D)`` in GLSL).

The default test suite regenerates every file and compares them with the committed ones
(tests/test_formats_codegen.py), so they cannot drift apart from the registry.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from . import FORMATS, Format

__all__ = ["HEADER_PATH", "GLSL_PATH", "CONSTANTS_HEADER_PATH", "CONSTANTS_GLSL_PATH", "render_constants_header",
           "render_constants_glsl", "block_struct_name", "table_slots", "render_header", "render_glsl",
           "glsl_table_name", "main"]

HEADER_PATH = Path(__file__).resolve().parents[2] / "csrc" / "cpu" / "ggml_blocks.h"
"""Where the generated header lives in a checkout."""

GLSL_PATH = Path(__file__).resolve().parents[2] / "csrc" / "vulkan" / "shaders" / "ggml_blocks.glsl"
"""Where the generated GLSL block definitions live in a checkout."""

CONSTANTS_HEADER_PATH = Path(__file__).resolve().parents[2] / "csrc" / "common" / "hz_constants.h"
"""Where the generated C++ constants header lives in a checkout."""

CONSTANTS_GLSL_PATH = Path(__file__).resolve().parents[2] / "csrc" / "vulkan" / "shaders" / "hz_constants.glsl"
"""Where the generated GLSL constants live in a checkout."""

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


def glsl_table_name(fmt: Format, table: str) -> str:
    """Name of the GLSL ``const`` array of the small table ``table`` of ``fmt`` (``hz_kvalues_mxfp4``);
    formats that share one table object share the array of the first of them (IQ4_XS reads
    ``hz_kvalues_iq4_nl``)."""
    obj = id(fmt.tables[table])
    for other in FORMATS.values():
        for name, t in other.tables.items():
            if id(t) == obj:
                return f"hz_{name}_{other.name.lower()}"
    raise KeyError(f"{fmt.name} has no table {table!r}")


def render_glsl() -> str:
    """The text of ``csrc/vulkan/shaders/ggml_blocks.glsl`` for the formats registered now."""
    w = [
        "// Block layouts and tables of the ggml formats for the Vulkan shaders, GENERATED from the format",
        "// registry (hanzo_torch/formats) by `python -m hanzo_torch.formats.codegen`: edit the registry, not",
        "// this file. tests/test_formats_codegen.py fails when the two differ.",
        "// Per format NAME: HZ_NAME_TYPE_ID (ggml type id), HZ_NAME_QK (values per block), HZ_NAME_TS",
        "// (bytes per block), HZ_NAME_GROUP_LEN (values per scale group, 0 for dense types) and",
        "// HZ_NAME_<field>: the byte offset of each field of ggml's block struct. Tables of up to "
        f"{INLINE_TABLE_MAX} entries",
        "// are const int[] arrays, compiled in when a format that reads them (HZ_FMT_<NAME>) or",
        "// HZ_ALL_TABLES is defined; larger ones (HZ_NAME_TABLE_<TABLE>_NUMEL int8 entries) are uploaded",
        "// at run time from the same registry tables and read through the shader's table address.",
        "#ifndef HZ_GGML_BLOCKS_GLSL",
        "#define HZ_GGML_BLOCKS_GLSL",
        "",
    ]
    users: dict[str, list[str]] = {}
    for fmt in FORMATS.values():
        for name in fmt.tables:
            users.setdefault(glsl_table_name(fmt, name), []).append(fmt.name)
    for fmt in FORMATS.values():
        p = f"HZ_{fmt.name}"
        kind = "dense" if fmt.dense else f"{fmt.group_len} values per scale group, dotted with {fmt.vec_dot_type}"
        w.append(f"// {fmt.name}: ggml type {fmt.type_id}, {fmt.block_size} values in {fmt.type_size} bytes, {kind}")
        w.append(f"#define {p}_TYPE_ID {fmt.type_id}")
        w.append(f"#define {p}_QK {fmt.block_size}u")
        w.append(f"#define {p}_TS {fmt.type_size}u")
        w.append(f"#define {p}_GROUP_LEN {fmt.group_len}u")
        for f in fmt.fields:
            w.append(f"#define {p}_{f.name} {f.offset}u  // {f.ctype} {f.name}{f'[{f.count}]' if f.count else ''}")
        for name, t in _tables(fmt):
            if t.numel() > INLINE_TABLE_MAX:
                w.append(f"#define {p}_TABLE_{name.upper()}_NUMEL {t.numel()}u  // int8 {tuple(t.shape)}, uploaded at run time")
                continue
            arr = glsl_table_name(fmt, name)
            w.append(f"#define {p}_TABLE_{name.upper()} {arr}  // {t.numel()} int8 entries, {tuple(t.shape)}")
            if users[arr][0] != fmt.name:
                continue  # declared by the first format that reads it
            cond = " || ".join(f"defined(HZ_FMT_{u})" for u in users[arr]) + " || defined(HZ_ALL_TABLES)"
            w.append(f"#if {cond}")
            vals = ", ".join(str(int(v)) for v in t.reshape(-1).tolist())
            w.append(f"const int {arr}[{t.numel()}] = int[]({vals});")
            w.append("#endif")
        w.append("")
    w.append("#endif  // HZ_GGML_BLOCKS_GLSL")
    return "\n".join(w) + "\n"


def _constants():
    from ..constants import CONSTANTS

    return CONSTANTS


def render_constants_header() -> str:
    """The text of ``csrc/common/hz_constants.h`` for :data:`hanzo_torch.constants.CONSTANTS`."""
    w = [
        "// Constants shared by the C++ of the CPU and Vulkan backends, GENERATED from hanzo_torch/constants.py",
        "// (format facts from the format registry) by `python -m hanzo_torch.formats.codegen`: edit that",
        "// module, not this file. tests/test_formats_codegen.py fails when the two differ.",
        "#pragma once",
        "#include <stdint.h>",
        "",
    ]
    for name, (value, what) in _constants().items():
        w.append(f"#define HZ_{name} {int(value)}  // {what}")
    w += ["",
          "// Bytes of one q8_0 KV cache row of D values (D a multiple of HZ_Q8_0_BLOCK).",
          "static inline int64_t hz_q8_0_row_bytes(int64_t D) { return D / HZ_Q8_0_BLOCK * HZ_Q8_0_BYTES; }",
          ""]
    return "\n".join(w)


def render_constants_glsl() -> str:
    """The text of ``csrc/vulkan/shaders/hz_constants.glsl`` for :data:`hanzo_torch.constants.CONSTANTS`."""
    w = [
        "// Constants shared with the host code, GENERATED from hanzo_torch/constants.py (format facts from",
        "// the format registry) by `python -m hanzo_torch.formats.codegen`: edit that module, not this",
        "// file. tests/test_formats_codegen.py fails when the two differ.",
        "#ifndef HZ_CONSTANTS_GLSL",
        "#define HZ_CONSTANTS_GLSL",
        "",
    ]
    for name, (value, what) in _constants().items():
        w.append(f"#define HZ_{name} {int(value)}u  // {what}")
    w += ["",
          "// Bytes of one q8_0 KV cache row of D values (D a multiple of HZ_Q8_0_BLOCK).",
          "#define HZ_Q8_0_ROW_BYTES(D) ((D) / HZ_Q8_0_BLOCK * HZ_Q8_0_BYTES)",
          "",
          "#endif  // HZ_CONSTANTS_GLSL",
          ""]
    return "\n".join(w)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hanzo_torch.formats.codegen", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the committed files instead of writing them")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help=f"C++ header path (default: {HEADER_PATH}); naming only one output handles only that one")
    p.add_argument("--glsl-output", type=Path, default=None, help=f"GLSL path (default: {GLSL_PATH})")
    p.add_argument("--constants-output", type=Path, default=None,
                   help=f"C++ constants header path (default: {CONSTANTS_HEADER_PATH})")
    p.add_argument("--constants-glsl-output", type=Path, default=None,
                   help=f"GLSL constants path (default: {CONSTANTS_GLSL_PATH})")
    a = p.parse_args(argv)
    chosen = [(a.output, render_header), (a.glsl_output, render_glsl), (a.constants_output, render_constants_header),
              (a.constants_glsl_output, render_constants_glsl)]
    outputs = [(path, render) for path, render in chosen if path is not None]
    if not outputs:
        outputs = [(HEADER_PATH, render_header), (GLSL_PATH, render_glsl),
                   (CONSTANTS_HEADER_PATH, render_constants_header), (CONSTANTS_GLSL_PATH, render_constants_glsl)]
    status = 0
    for path, render in outputs:
        text = render()
        if a.check:
            old = path.read_text() if path.exists() else None
            if old != text:
                print(f"{path} is out of date: run python -m hanzo_torch.formats.codegen", file=sys.stderr)
                status = 1
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
