"""The C++ dispatch of the hanzo ops on CPU (csrc/cpu/ops.cpp ``fast::``, hanzo_torch/backends/cpu/fused.py).

Once the extension is built, ``torch.ops.hanzo.<op>`` on CPU tensors runs a C++ kernel that
checks the arguments and calls the same C++ kernel the op's Python body would choose. The gate:
for every op, the result is bit-identical (``torch.equal``) to the Python body's on the same
inputs; inputs the Python checks reject raise the same ValueError; ``HANZO_<OP>_FALLBACK``,
``HANZO_CPU_ISA``, dense formats and kernels registered at run time still take effect.
"""
import pytest
import torch

import hanzo_torch  # noqa: F401  (registers the ops)
from hanzo_torch.ops import _common
from hanzo_torch.backends import cpu as hcpu
from hanzo_torch.ops import fused as ref
from hanzo_torch.ops import quant
from hanzo_torch.backends.cpu import fused as cf

from test_cpu_kernels import random_blocks

ops = torch.ops.hanzo


@pytest.fixture(scope="module", autouse=True)
def built():
    if hcpu.extension() is None:
        pytest.fail("the C++ CPU extension failed to build (see the warning above)")
    if not cf.FAST_PATH_INSTALLED:
        pytest.skip("HANZO_CPU_DIRECT_DISPATCH=0: the C++ dispatch is off in this process")


def body(name):
    return cf._BODIES[name]


def g(seed=0):
    return torch.Generator().manual_seed(seed)


def test_installed_for_the_decode_ops():
    assert set(cf.FAST_PATH_INSTALLED) == set(cf.FAST_PATH_OPS)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "IQ2_XXS"])
def test_mul_mat_identical_to_the_python_body(qtype):
    K, N = 512, 13
    w = random_blocks(qtype, N, K, seed=1)
    for shape in ((1, K), (7, K), (2, 3, K), (K,)):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(*shape, generator=g()).to(dtype)
            y = ops.mul_mat(x, w, qtype)
            want = body("mul_mat")(x, w, qtype)
            assert y.shape == want.shape == (*shape[:-1], N) and y.dtype == dtype
            assert torch.equal(y, want), (qtype, shape, dtype)


def test_swiglu_mul_mat_identical_to_the_python_body():
    K, F = 256, 40
    wg, wu = random_blocks("Q4_K", F, K, seed=2), random_blocks("Q6_K", F, K, seed=3)
    for shape in ((1, 1, K), (9, K)):
        for dtype in (torch.float32, torch.float16):
            x = torch.randn(*shape, generator=g(1)).to(dtype)
            y = ops.swiglu_mul_mat(x, wg, wu, "Q4_K", "Q6_K")
            assert torch.equal(y, body("swiglu_mul_mat")(x, wg, wu, "Q4_K", "Q6_K")), (shape, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_identical_to_the_python_body(dtype):
    B, T, Hq, Hk, D, S = 1, 3, 4, 2, 16, 8
    x, r = torch.randn(B, T, 32, generator=g(2)).to(dtype), torch.randn(B, T, 32, generator=g(3)).to(dtype)
    w = torch.randn(32, generator=g(4)).to(dtype)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), body("rms_norm")(x, w, 1e-6))
    for a, b in zip(ops.add_rms_norm(x, r, w, 1e-6), body("add_rms_norm")(x, r, w, 1e-6)):
        assert torch.equal(a, b)
    q, k = torch.randn(B, T, Hq, D, generator=g(5)).to(dtype), torch.randn(B, T, Hk, D, generator=g(6)).to(dtype)
    pos = torch.tensor([[2, 3, 4]])
    qw, kw = torch.randn(D, generator=g(7)).to(dtype), torch.randn(D, generator=g(8)).to(dtype)
    for weights in ((qw, kw), (None, None)):
        for a, b in zip(ops.qk_norm_rope(q, k, *weights, pos, 1e6, 1e-6),
                        body("qk_norm_rope")(q, k, *weights, pos, 1e6, 1e-6)):
            assert torch.equal(a, b)
    v = torch.randn(B, T, Hk, D, generator=g(9)).to(dtype)
    caches = [torch.randn(B, S, Hk, D, generator=g(10)).to(dtype) for _ in range(4)]
    ops.kv_cache_write(caches[0], caches[1], k, v, pos)
    body("kv_cache_write")(caches[2], caches[3], k, v, pos)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    for impl in ("auto", "eager", "flash"):
        y = ops.attention(q, caches[0], caches[1], pos, 0.25, impl)
        assert torch.equal(y, body("attention")(q, caches[0], caches[1], pos, 0.25, impl)), impl


def test_bad_input_raises_the_python_errors():
    w = random_blocks("Q4_K", 4, 256, seed=4)
    with pytest.raises(ValueError, match="bytes per Q4_K row"):
        ops.mul_mat(torch.randn(1, 512), w, "Q4_K")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        ops.mul_mat(torch.randn(1, 256, dtype=torch.float64), w, "Q4_K")
    with pytest.raises((KeyError, ValueError)):
        ops.mul_mat(torch.randn(1, 256), w, "Q4_Z")
    with pytest.raises(ValueError, match="same width"):
        ops.swiglu_mul_mat(torch.randn(1, 256), w, w[:3], "Q4_K", "Q4_K")
    with pytest.raises(ValueError, match="w must be"):
        ops.rms_norm(torch.randn(2, 16), torch.ones(15), 1e-6)
    with pytest.raises(ValueError, match="must match"):
        ops.add_rms_norm(torch.randn(2, 16), torch.randn(3, 16), torch.ones(16), 1e-6)
    with pytest.raises(ValueError, match="even"):
        ops.qk_norm_rope(torch.randn(1, 1, 2, 5), torch.randn(1, 1, 1, 5), None, None, torch.tensor([[0]]), 1e4, 1e-6)
    kc = torch.zeros(1, 4, 1, 2)
    for p in (4, -1):
        with pytest.raises(ValueError, match="positions must be in"):
            ops.kv_cache_write(kc, kc.clone(), torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), torch.tensor([[p]]))
        with pytest.raises(ValueError, match="positions must be in"):
            ops.attention(torch.ones(1, 1, 1, 2), kc, kc, torch.tensor([[p]]), 1.0, "auto")
    with pytest.raises(ValueError, match="impl must be"):
        ops.attention(torch.ones(1, 1, 1, 2), kc, kc, torch.tensor([[0]]), 1.0, "fast")


def test_fallback_env_isa_env_and_dense_formats_take_effect(monkeypatch):
    K, N = 256, 8
    w = random_blocks("Q6_K", N, K, seed=5)
    x = torch.randn(2, K, generator=g(11))
    fast = ops.mul_mat(x, w, "Q6_K")
    monkeypatch.setenv("HANZO_MUL_MAT_FALLBACK", "1")
    slow = ops.mul_mat(x, w, "Q6_K")
    assert torch.equal(slow, quant.mul_mat_reference(x, w, "Q6_K")) and not torch.equal(fast, slow)
    monkeypatch.delenv("HANZO_MUL_MAT_FALLBACK")
    monkeypatch.setenv("HANZO_CPU_ISA", "scalar")
    assert torch.equal(ops.mul_mat(x, w, "Q6_K"), hcpu.mul_mat(x, w, "Q6_K", isa="scalar"))
    monkeypatch.delenv("HANZO_CPU_ISA")
    assert torch.equal(ops.mul_mat(x, w, "Q6_K"), fast)
    w16 = hanzo_torch.quantize(torch.randn(N, K, generator=g(12)), "F16")
    assert torch.equal(ops.mul_mat(x, w16, "F16"), quant.mul_mat_reference(x, w16, "F16"))
    xs, ws = torch.randn(3, 16, generator=g(13)), torch.randn(16, generator=g(14))
    monkeypatch.setenv("HANZO_RMS_NORM_FALLBACK", "1")
    assert torch.equal(ops.rms_norm(xs, ws, 1e-6), ref.rms_norm_reference(xs, ws, 1e-6))


def test_a_kernel_registered_later_is_the_one_that_runs():
    calls = []
    table = {key: list(v) for key, v in _common._KERNELS.items()}
    w = random_blocks("Q4_K", 4, 256, seed=6)
    x = torch.randn(1, 256, generator=g(15))
    try:
        _common.register_kernel("mul_mat", "cpu", lambda *a: calls.append(a[2]) or quant.mul_mat_reference(*a),
                                qtypes=("Q4_K",))
        assert torch.equal(ops.mul_mat(x, w, "Q4_K"), quant.mul_mat_reference(x, w, "Q4_K")) and calls == ["Q4_K"]
    finally:
        _common._KERNELS.clear()
        _common._KERNELS.update(table)
    assert torch.equal(ops.mul_mat(x, w, "Q4_K"), hcpu.mul_mat(x, w, "Q4_K")) and calls == ["Q4_K"]


def test_kv_cache_write_bumps_the_caches_versions():
    """The C++ ADInplaceOrView kernel of kv_cache_write bumps the mutated caches' version counters,
    as the custom op's own did: autograd still sees the in-place write."""
    kc, vc = torch.zeros(1, 4, 1, 2), torch.zeros(1, 4, 1, 2)
    v0, w0 = kc._version, vc._version
    with torch.no_grad():
        ops.kv_cache_write(kc, vc, torch.ones(1, 1, 1, 2), torch.full((1, 1, 1, 2), 2.0), torch.tensor([[1]]))
    assert (kc._version, vc._version) == (v0 + 1, w0 + 1)
    assert kc[0, 1, 0].tolist() == [1.0, 1.0] and vc[0, 1, 0].tolist() == [2.0, 2.0]
    s = torch.ones(4, requires_grad=True)
    t = s.exp()  # exp saves its output for the backward
    with torch.no_grad():
        ops.kv_cache_write(t.view(1, 4, 1, 1), torch.zeros(1, 4, 1, 1), torch.zeros(1, 1, 1, 1),
                           torch.zeros(1, 1, 1, 1), torch.tensor([[0]]))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        t.sum().backward()
    with torch.inference_mode():  # inference tensors have no version counter
        ki, vi = torch.zeros(1, 4, 1, 2), torch.zeros(1, 4, 1, 2)
        ops.kv_cache_write(ki, vi, torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), torch.tensor([[3]]))
        assert ki[0, 3, 0].tolist() == [1.0, 1.0]
