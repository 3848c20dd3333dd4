"""The int8 path of the Vulkan contractions (csrc/vulkan/ops_quant.cpp: quantize_q8_1.comp,
mul_mat_vec_q8.comp, mul_mat_q8.comp) beyond what tests/test_conformance.py checks (its
``vulkan-int8`` backend holds the numerics to the reference, and ``quantize_q8_1`` to its bytes):
when the path is taken (mode, HANZO_VK_INT8, formats), that it really quantizes the activations,
and that gate and up share one quantized activation.

Runs on lavapipe in the default suite (it enables integer dot products without accelerating
them, so the path is forced on here); skipped where no Vulkan device is available.
"""
from __future__ import annotations

import pytest
import torch

from hanzo_torch.backends import vulkan
from hanzo_torch.backends.triton._testing import random_packed

pytestmark = pytest.mark.skipif(not vulkan.available(), reason=f"vulkan backend unavailable: {vulkan.reason()}")

COMMON = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")


def _quant():
    from hanzo_torch.backends.vulkan import quant

    vulkan.register()
    torch.ops.hanzo.dequantize(torch.zeros(1, 34, dtype=torch.uint8, device="vulkan"), "Q8_0", [1, 32], torch.float32)
    return quant


def test_modes_and_formats(monkeypatch):
    quant = _quant()
    feats = vulkan.features()
    with quant.use_int8(False):
        assert quant.int8_formats() == ()
    with quant.use_int8(True):
        assert set(COMMON) <= set(quant.int8_formats()) if feats["int8_dot"] else quant.int8_formats() == ()
        assert "IQ2_XXS" not in quant.int8_formats() and "F16" not in quant.int8_formats()
    with quant.use_int8("auto"):
        assert bool(quant.int8_formats()) == bool(feats["int8_dot"] and feats["int8_dot_accelerated"])
    try:
        monkeypatch.setenv("HANZO_VK_INT8", "0")
        quant.set_int8(None)
        assert quant.int8_formats() == ()
        monkeypatch.setenv("HANZO_VK_INT8", "1")
        quant.set_int8(None)
        assert bool(quant.int8_formats()) == bool(feats["int8_dot"])
    finally:
        monkeypatch.delenv("HANZO_VK_INT8")
        quant.set_int8(None)
    with pytest.raises(ValueError, match="mode"):
        quant.set_int8(2)


def _x_hat(x):
    b = torch.ops.hanzo_ref.quantize_q8_1(x).reshape(-1, 36)
    d = b[:, 0:2].contiguous().view(torch.float16).double()
    return (d * b[:, 4:].contiguous().view(torch.int8).double()).reshape(x.shape)


@pytest.mark.parametrize("M", [2, 20])
def test_int8_path_quantizes_the_activations(M):
    """Forced on, mul_mat (mat-vec and GEMM) is x_hat @ W^T, not x @ W^T (their gap is far above
    float32 rounding), in two dispatches (quantize, contraction); off, one dispatch and x @ W^T."""
    quant = _quant()
    if not vulkan.features()["int8_dot"]:
        pytest.skip("the device does not enable integer dot products")
    K, N = 256, 9
    w = random_packed("Q4_K", (N, K), seed=11)
    wf = torch.ops.hanzo_ref.dequantize(w, "Q4_K", [N, K], torch.float32).double()
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    want_int8, want_float = _x_hat(x) @ wf.t(), x.double() @ wf.t()
    bound = 1e-5 * (x.double().abs() @ wf.abs().t()) + 1e-6
    assert ((want_int8 - want_float).abs() > 10 * bound).any()
    xv, wv = x.to("vulkan"), w.to("vulkan")
    for mode, want in ((True, want_int8), (False, want_float)):
        with quant.use_int8(mode):
            vulkan.synchronize()
            vulkan.set_profiling(True)
            try:
                y = torch.ops.hanzo.mul_mat(xv, wv, "Q4_K")
                vulkan.synchronize()
                dispatches = vulkan.profile()["dispatches"]
            finally:
                vulkan.set_profiling(False)
        assert dispatches == (2 if mode else 1)
        assert ((y.cpu().double() - want).abs() <= bound).all(), mode


def test_quantize_q8_1_native_and_reference_mode():
    """quantize_q8_1 has a kernel on the vulkan device; in reference mode the reference runs there."""
    import hanzo_torch

    _quant()
    assert "quantize_q8_1" in vulkan.register()
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(5)) * 3
    want = torch.ops.hanzo_ref.quantize_q8_1(x)
    for ref in (False, True):
        with hanzo_torch.ops.use_reference("quantize_q8_1", enabled=ref):
            got = torch.ops.hanzo.quantize_q8_1(x.to("vulkan"))
        assert got.device.type == "vulkan" and torch.equal(got.cpu(), want)
    with pytest.raises(ValueError, match="multiple of 32"):
        torch.ops.hanzo.quantize_q8_1(torch.randn(2, 48).to("vulkan"))


def test_int8_formats_are_the_shader_variants():
    """The C++ list of int8 formats (kInt8Formats, the built extension's) is rules.INT8_RULES, for
    which both int8 shaders were compiled."""
    from hanzo_torch.backends.vulkan.rules import INT8_RULES

    quant = _quant()
    if not vulkan.features()["int8_dot"]:
        pytest.skip("the device does not enable integer dot products")
    with quant.use_int8(True):
        have = set(quant.int8_formats())
    assert have == set(INT8_RULES)
    for shader in ("mul_mat_q8.comp", "mul_mat_vec_q8.comp"):
        first = (vulkan._SHADER_DIR / shader).read_text().splitlines()[0].split()
        assert first[:4] == ["//", "hz:", "variants", "@int8"], shader
        assert all((vulkan.spv_dir() / f"{shader[:-5]}.{q}.spv").is_file() for q in have)
