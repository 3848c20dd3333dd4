"""The backend contract (hanzo_torch/backends/base.py): every backend package implements it, the
format lists are data (the C++ list generated from it, the shader and Triton rules checked
against it), reference mode is one redirect above the kernels, PrivateUse1 is claimed only when
the vulkan backend is used, and a backend defined through the contract alone (a toy one on the
``meta`` device, in a child process) is served by the loader, the ops, reference mode and the
decode graphs without any shared file knowing it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hanzo_torch
from hanzo_torch import backends
from hanzo_torch.backends.base import QUANT_OPS, Backend, ComputeDefaults
from hanzo_torch.ops import _dispatch

ROOT = Path(__file__).resolve().parents[1]


def _child(code: str, timeout: int = 240, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter at the repository root (``env`` added to the
    environment); its last stdout line, as JSON."""
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT), **env))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_every_backend_package_implements_the_contract():
    folders = sorted(p.name for p in (ROOT / "hanzo_torch" / "backends").iterdir()
                     if p.is_dir() and (p / "__init__.py").is_file() and not p.name.startswith("_"))
    assert set(backends.NAMES) == set(folders) and backends.NAMES[0] == "reference"
    for name in backends.NAMES:
        b = backends.backend(name)
        assert isinstance(b, Backend) and b.name == name and b.device_types, name
        assert isinstance(b.defaults, ComputeDefaults) and len(b.defaults.reason) > 40, name
        assert b.defaults.activations in (torch.float32, torch.bfloat16, torch.float16), name
        assert b.defaults.kv is None or b.defaults.kv in hanzo_torch.ops.fused.KV_CACHE_DTYPES, name
        assert set(b.op_formats) <= set(QUANT_OPS), name
        for op, fmts in b.op_formats.items():
            assert isinstance(fmts, frozenset) and fmts <= set(hanzo_torch.FORMATS), (name, op)
    assert backends.for_device("cpu").name == "cpu" and backends.for_device("cuda:1").name == "triton"
    assert backends.for_device("vulkan").name == "vulkan" and backends.for_device("mps").name == "mps"
    assert backends.auto_device() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_vulkan_defaults_to_float32_activations_and_kv():
    d = backends.backend("vulkan").defaults
    assert d.activations == torch.float32 and d.kv is None and "llama.cpp" in d.reason
    cpu = backends.backend("cpu").defaults
    assert cpu.activations == torch.float32 and cpu.kv == "f16"


def test_cpu_format_list_is_generated_from_the_python_data():
    from hanzo_torch.backends.cpu import SUPPORTED_QTYPES, rules

    assert rules.HEADER_PATH.read_text() == rules.render_header(), (
        "csrc/cpu/format_list.h is stale: run python -m hanzo_torch.backends.cpu.rules")
    assert "#define HZ_FOR_EACH_FORMAT" not in (rules.HEADER_PATH.parent / "formats.h").read_text()
    traits = set(re.findall(r"^struct F(\w+)\b", (rules.HEADER_PATH.parent / "formats.h").read_text(), re.M))
    assert set(rules.RULES) <= traits, set(rules.RULES) - traits  # a listed format without a trait
    assert set(SUPPORTED_QTYPES) == set(rules.RULES) & set(hanzo_torch.FORMATS)
    assert backends.backend("cpu").formats("mul_mat") == frozenset(SUPPORTED_QTYPES)


def test_vulkan_format_list_matches_the_shader_rules():
    from hanzo_torch.backends.vulkan import _SHADER_DIR, rule_formats
    from hanzo_torch.backends.vulkan.rules import RULES

    text = (_SHADER_DIR / "formats.glsl").read_text()
    rules = set(re.findall(r"defined\(HZ_FMT_(\w+)\)", text))
    assert rules == set(RULES), (rules ^ set(RULES))
    assert "hz: formats" not in text.splitlines()[0]
    assert rule_formats() == tuple(n for n in RULES if n in hanzo_torch.FORMATS)
    assert set(hanzo_torch.QUANTIZED_FORMATS) <= set(rule_formats())


def test_vulkan_int8_list_is_data_shared_by_shaders_and_cpp():
    from hanzo_torch.backends import vulkan
    from hanzo_torch.backends.vulkan import rules

    assert rules.HEADER_PATH.read_text() == rules.render_header(), (
        "csrc/vulkan/int8_formats.h is stale: run python -m hanzo_torch.backends.vulkan.rules")
    assert set(rules.INT8_RULES) <= set(rules.RULES)
    text = (vulkan._SHADER_DIR / "formats_q8.glsl").read_text()
    assert set(re.findall(r"defined\(HZ_VARIANT_(\w+)\)", text)) == set(rules.INT8_RULES)
    jobs = {out.name for _, out, _ in vulkan._shader_jobs(vulkan._SHADER_DIR)}
    for shader in ("mul_mat_q8", "mul_mat_vec_q8"):
        assert {n for n in jobs if n.startswith(shader + ".")} == {f"{shader}.{f}.spv" for f in rules.INT8_RULES}
    assert '"Q4_0"' not in (rules.HEADER_PATH.parent / "ops_quant.cpp").read_text()


def test_triton_format_list_matches_the_unpack_rules():
    pytest.importorskip("triton")
    from hanzo_torch.backends.triton import formats

    rules = {n[len("_unpack_"):].upper() for n in vars(formats) if n.startswith("_unpack_")}
    assert rules == set(formats.RULE_NAMES), rules ^ set(formats.RULE_NAMES)


def test_reference_mode_is_a_redirect_registered_only_while_on():
    """Out of reference mode nothing sits in front of the kernels; in it, one Library holds the
    reference on every key with kernels, for the op and the ops fusing it."""
    x, w = torch.randn(2, 64), torch.randn(64)
    torch.ops.hanzo.rms_norm(x, w, 1e-6)  # activates the CPU backend
    assert "CPU" in _dispatch._KEYS
    before = _dispatch.redirected_ops()
    with hanzo_torch.ops.use_reference("kv_cache_write"):
        assert _dispatch.redirected_ops() - before == {"kv_cache_write", "qk_norm_rope_kv_write"}
        assert _dispatch._redirect is not None
    assert _dispatch.redirected_ops() == before
    if not before:
        assert _dispatch._redirect is None
    with pytest.raises(ValueError, match="unknown hanzo op"):
        with hanzo_torch.ops.use_reference("rms_norm", "no_such_op"):
            pass
    assert _dispatch.redirected_ops() == before  # nothing changed by the refused call


def test_reference_mode_reaches_the_cpu_kernels_and_restores_them():
    from hanzo_torch.backends import cpu

    if not cpu.available():
        pytest.skip(f"no C++ CPU kernels: {cpu.status()['reason']}")
    from hanzo_torch.ops import quant

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 256, generator=g)
    w = hanzo_torch.quantize(torch.randn(8, 256, generator=g), "Q4_K")
    fast = torch.ops.hanzo.mul_mat(x, w, "Q4_K")
    with hanzo_torch.ops.use_reference("mul_mat"):
        slow = torch.ops.hanzo.mul_mat(x, w, "Q4_K")
    assert torch.equal(slow, quant.mul_mat_reference(x, w, "Q4_K")) and not torch.equal(fast, slow)
    assert torch.equal(torch.ops.hanzo.mul_mat(x, w, "Q4_K"), fast)  # the kernel again


def test_env_fallback_set_before_the_backend_loads():
    """HANZO_<OP>_FALLBACK=1 at import: the redirect goes in front of kernels registered later."""
    out = _child("""
        import json, torch, hanzo_torch
        from hanzo_torch.ops import quant
        g = torch.Generator().manual_seed(3)
        x = torch.randn(3, 256, generator=g)
        w = hanzo_torch.quantize(torch.randn(8, 256, generator=g), "Q4_K")
        y = torch.ops.hanzo.mul_mat(x, w, "Q4_K")
        with hanzo_torch.ops.use_reference("mul_mat", enabled=False):
            z = torch.ops.hanzo.mul_mat(x, w, "Q4_K")
        from hanzo_torch.backends import cpu
        print(json.dumps({"ref": torch.equal(y, quant.mul_mat_reference(x, w, "Q4_K")),
                          "native_differs": not torch.equal(y, z), "cpu": cpu.available()}))
    """, HANZO_MUL_MAT_FALLBACK="1")
    assert out["ref"]
    assert out["native_differs"] or not out["cpu"]


def test_import_leaves_privateuse1_alone_and_a_foreign_owner_makes_vulkan_unavailable():
    plain = _child("""
        import json, torch, hanzo_torch
        print(json.dumps({"name": torch.device("privateuseone").type}))
    """)
    assert plain["name"] == "privateuseone"
    foreign = _child("""
        import json, torch
        torch.utils.rename_privateuse1_backend("otherdev")
        import hanzo_torch
        from hanzo_torch import backends
        from hanzo_torch.backends import vulkan
        st = vulkan.status()
        y = hanzo_torch.dequantize(hanzo_torch.quantize(torch.ones(2, 32), "Q8_0"), "Q8_0", (2, 32))
        try:
            backends.prepare_device("vulkan")
            claimed = "no error"
        except RuntimeError as e:
            claimed = str(e)
        listed = [(s.name, s.available, s.reason) for s in backends.status() if s.name == "vulkan"]
        print(json.dumps({"available": st["available"], "reason": st["reason"], "claimed": claimed,
                          "ok": bool(((y - 1).abs() < 1e-2).all()), "listed": listed,
                          "name": torch.device("privateuseone").type, "dev": str(torch.device("otherdev", 0))}))
    """)
    assert foreign["available"] is False and "otherdev" in foreign["reason"], foreign
    assert "otherdev" in foreign["claimed"] and foreign["ok"] and foreign["name"] == "otherdev"
    assert foreign["listed"][0][1] is False and foreign["dev"] == "otherdev:0"


def test_a_backend_is_one_folder_toy_backend_on_meta():
    """A backend written against the contract alone, added with backends.add: the loader takes
    its default dtypes, activate() registers its kernel on its key, the op reaches it, reference
    mode redirects around it and back, and DecodeStep captures and replays through it."""
    from tests.gguf_builders import tiny_spec, write_tiny_gguf  # noqa: F401  (the child imports them)

    out = _child("""
        import json, tempfile, os, torch, hanzo_torch
        from hanzo_torch import backends
        from hanzo_torch.backends.base import Backend, Capture, ComputeDefaults
        from hanzo_torch.decode_graphs import DecodeStep
        from tests.gguf_builders import tiny_spec, write_tiny_gguf

        calls = {"swiglu": 0, "capture": 0, "replay": 0, "sync": 0}

        class Toy(Backend):
            name = "toy"
            device_types = ("meta",)
            dispatch_key = "Meta"
            op_formats = {"mul_mat": frozenset({"Q8_0"})}
            defaults = ComputeDefaults(torch.float16, "q8_0", "a toy: half precision to show the loader asks")

            def register(self):
                self.lib = torch.library.Library("hanzo", "IMPL")
                def swiglu(g, u):
                    calls["swiglu"] += 1
                    return torch.empty_like(g)
                self.lib.impl("swiglu", swiglu, "Meta")
                return frozenset({"swiglu"})

            def synchronize(self, device):
                calls["sync"] += 1

            def graphs_supported(self, device):
                return True

            def capture(self, device, fn, warmup):
                calls["capture"] += 1
                out = fn()
                def replay():
                    calls["replay"] += 1
                return Capture(replay, out)

        toy = backends.add(Toy())
        res = {"for_device": backends.for_device("meta").name,
               "listed": [s.name for s in backends.status()][-1]}
        res["activated"] = sorted(backends.activate("meta"))
        g = torch.empty(2, 8, device="meta")
        torch.ops.hanzo.swiglu(g, g)
        with hanzo_torch.ops.use_reference("swiglu"):
            torch.ops.hanzo.swiglu(g, g)  # the reference, on meta tensors
        in_ref = calls["swiglu"]
        torch.ops.hanzo.swiglu(g, g)
        res["swiglu_calls"] = [in_ref, calls["swiglu"]]

        with tempfile.TemporaryDirectory() as d:
            path = write_tiny_gguf(os.path.join(d, "t.gguf"), tiny_spec("qwen3"))
            m = hanzo_torch.load(path, device="meta", max_context=8)
            res["dtype"] = str(m.blk[0].attn_norm.weight.dtype)
            res["kv"] = m.kv_dtype

        class M(torch.nn.Module):
            def forward(self, ids, positions=None, **kw):
                return torch.zeros(ids.shape[0], 1, 4, device=ids.device)

        step = DecodeStep(M(), 1, torch.device("meta"))
        step(); step()
        res["graphed"] = step.graphed
        res.update(calls)
        print(json.dumps(res))
    """)
    assert out["for_device"] == "toy" and out["listed"] == "toy" and out["activated"] == ["swiglu"]
    assert out["swiglu_calls"] == [1, 2]  # the kernel, not in reference mode, then the kernel again
    assert out["dtype"] == "torch.float16" and out["kv"] == "q8_0"
    assert out["graphed"] and out["capture"] == 1 and out["replay"] == 2
