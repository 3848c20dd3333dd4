"""csrc/cpu/ggml_blocks.h and csrc/vulkan/shaders/ggml_blocks.glsl are generated from the format
registry and must not drift from it.

The header gives the C++ kernels their block structs, field offsets, type ids and table slots; the
GLSL file gives the Vulkan shaders the same offsets and sizes as constants and the tables as const
arrays. Regenerating them from the registry and comparing with the committed files catches a layout
edited on one side only (run ``python -m hanzo_torch.formats.codegen`` to rewrite them).
"""
from __future__ import annotations

import re

import torch

import hanzo_torch
from hanzo_torch.formats import codegen


def test_committed_header_is_the_generated_one():
    committed = codegen.HEADER_PATH.read_text()
    assert committed == codegen.render_header(), (
        f"{codegen.HEADER_PATH} differs from the registry: run python -m hanzo_torch.formats.codegen")


def test_check_mode_reports_a_stale_header(tmp_path, capsys):
    path = tmp_path / "ggml_blocks.h"
    path.write_text(codegen.render_header())
    assert codegen.main(["--check", "-o", str(path)]) == 0
    path.write_text(codegen.render_header().replace("uint8_t qs[16];", "uint8_t qs[15];", 1))
    assert codegen.main(["--check", "-o", str(path)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert codegen.main(["-o", str(path)]) == 0 and path.read_text() == codegen.render_header()


def test_header_declares_every_quantized_format():
    text = codegen.render_header()
    for fmt in hanzo_torch.FORMATS.values():
        s = codegen.block_struct_name(fmt)
        if fmt.dense:
            assert f"struct {s} " not in text
            continue
        assert f'static_assert(sizeof({s}) == {fmt.type_size},' in text, fmt.name
        for f in fmt.fields:
            assert f"static_assert(offsetof({s}, {f.name}) == {f.offset}," in text, (fmt.name, f.name)
        m = re.search(rf"struct {s} {{\n(.*?)\n}};", text, re.S)
        assert f"type_id = {fmt.type_id}, qk = {fmt.block_size}" in m.group(1), fmt.name
    assert codegen.block_struct_name(hanzo_torch.get_format("Q4_K")) == "block_q4_K"
    assert codegen.block_struct_name(hanzo_torch.get_format("IQ2_XXS")) == "block_iq2_xxs"


def test_table_slots_hold_the_registry_grids():
    slots = codegen.table_slots()
    assert [s for s, *_ in slots] == list(range(len(slots)))
    text = codegen.render_header()
    for slot, name, table, values in slots:
        fmt = hanzo_torch.get_format(name)
        assert values.dtype.is_signed and values.numel() == fmt.tables[table].cpu.numel()
        assert (values.float() == fmt.tables[table].cpu.reshape(values.shape)).all()
        assert f"HZ_TABLE_{name}_{table.upper()} = {slot}," in text
    # IQ1_M reads IQ1_S's grid: one slot for both
    assert "HZ_TABLE_IQ1_M_GRID = " + str(next(s for s, n, *_ in slots if n == "IQ1_S")) in text


def test_committed_glsl_is_the_generated_one():
    committed = codegen.GLSL_PATH.read_text()
    assert committed == codegen.render_glsl(), (
        f"{codegen.GLSL_PATH} differs from the registry: run python -m hanzo_torch.formats.codegen")


def test_check_mode_covers_the_glsl(tmp_path, capsys):
    path = tmp_path / "ggml_blocks.glsl"
    assert codegen.main(["--glsl-output", str(path)]) == 0 and path.read_text() == codegen.render_glsl()
    assert codegen.main(["--check", "--glsl-output", str(path)]) == 0
    path.write_text(codegen.render_glsl().replace("#define HZ_Q4_K_qs 16u", "#define HZ_Q4_K_qs 17u"))
    assert codegen.main(["--check", "--glsl-output", str(path)]) == 1
    assert str(path) in capsys.readouterr().err


def test_glsl_defines_every_format_layout():
    text = codegen.render_glsl()
    for fmt in hanzo_torch.FORMATS.values():
        p = f"HZ_{fmt.name}"
        assert f"#define {p}_TYPE_ID {fmt.type_id}\n" in text, fmt.name
        assert f"#define {p}_QK {fmt.block_size}u\n" in text, fmt.name
        assert f"#define {p}_TS {fmt.type_size}u\n" in text, fmt.name
        assert f"#define {p}_GROUP_LEN {fmt.group_len}u\n" in text, fmt.name
        for f in fmt.fields:
            assert re.search(rf"#define {p}_{f.name} {f.offset}u\b", text), (fmt.name, f.name)


def test_glsl_tables_hold_the_registry_tables():
    text = codegen.render_glsl()
    for fmt in hanzo_torch.FORMATS.values():
        for name, table in fmt.tables.items():
            want = table.cpu.reshape(-1)
            if want.numel() > codegen.INLINE_TABLE_MAX:  # uploaded at run time: only its size is in the file
                assert f"#define HZ_{fmt.name}_TABLE_{name.upper()}_NUMEL {want.numel()}u " in text, (fmt.name, name)
                continue
            arr = codegen.glsl_table_name(fmt, name)
            assert f"#define HZ_{fmt.name}_TABLE_{name.upper()} {arr} " in text, (fmt.name, name)
            m = re.search(rf"const int {arr}\[(\d+)\] = int\[\]\((.*?)\);", text)
            got = torch.tensor([float(v) for v in m.group(2).split(",")])
            assert int(m.group(1)) == want.numel() and torch.equal(got, want.float()), (fmt.name, name)
            # compiled into the shaders of every format that reads it
            guard = text[:m.start()].rsplit("#if ", 1)[1]
            assert f"defined(HZ_FMT_{fmt.name})" in guard, (fmt.name, name)
    assert codegen.glsl_table_name(hanzo_torch.get_format("IQ4_XS"), "kvalues") == "hz_kvalues_iq4_nl"


def test_committed_constants_are_the_generated_ones():
    for path, render in ((codegen.CONSTANTS_HEADER_PATH, codegen.render_constants_header),
                         (codegen.CONSTANTS_GLSL_PATH, codegen.render_constants_glsl)):
        assert path.read_text() == render(), f"{path} differs from hanzo_torch/constants.py: run python -m hanzo_torch.formats.codegen"


def test_check_mode_reports_stale_constants(tmp_path, capsys):
    h, g = tmp_path / "hz_constants.h", tmp_path / "hz_constants.glsl"
    args = ["--constants-output", str(h), "--constants-glsl-output", str(g)]
    assert codegen.main(args) == 0 and h.read_text() == codegen.render_constants_header()
    assert g.read_text() == codegen.render_constants_glsl() and codegen.main(["--check", *args]) == 0
    g.write_text(codegen.render_constants_glsl().replace("#define HZ_Q8_0_BYTES 34u", "#define HZ_Q8_0_BYTES 36u"))
    assert codegen.main(["--check", *args]) == 1
    err = capsys.readouterr().err
    assert str(g) in err and str(h) not in err


def test_constants_are_the_registry_facts():
    from hanzo_torch import constants
    from hanzo_torch.formats import q8_1

    q8 = hanzo_torch.get_format("Q8_0")
    assert (constants.Q8_0_BLOCK, constants.Q8_0_BYTES) == (q8.block_size, q8.type_size) == (32, 34)
    assert (constants.Q8_1_BLOCK, constants.Q8_1_BYTES) == (q8_1.QK8_1, q8_1.Q8_1_BLOCK_BYTES) == (32, 36)
    # a q8_1 block is what quantize_q8_1 writes per 32 values
    assert q8_1.quantize_q8_1(torch.randn(2, 3 * constants.Q8_1_BLOCK)).shape == (2, 3 * constants.Q8_1_BYTES)
    assert constants.q8_0_row_bytes(128) == 4 * 34
    text, glsl = codegen.render_constants_header(), codegen.render_constants_glsl()
    for name, (value, _) in constants.CONSTANTS.items():
        assert re.search(rf"^#define HZ_{name} {value}  //", text, re.M), name
        assert re.search(rf"^#define HZ_{name} {value}u  //", glsl, re.M), name
    from hanzo_torch.backends import cpu

    assert cpu.MV_MAX_ROWS == constants.CPU_MATVEC_MAX_ROWS
