"""The C++ kernels of the hanzo ops on the CPU dispatch key (csrc/cpu/ops.cpp, ``TORCH_LIBRARY_IMPL``).

``torch.ops.hanzo.<op>`` on CPU tensors reaches the C++ kernel through torch's dispatcher. The
gate: for every op the result is bit-identical (``torch.equal``) to the same C++ kernel called
directly (:mod:`hanzo_torch.backends.cpu`); calls the C++ paths do not cover go to
``torch.ops.hanzo_ref`` (same ValueError for bad input, same reference results for dense
formats and in reference mode); :func:`hanzo_torch.backends.cpu.use_isa` and
:func:`hanzo_torch.ops.use_reference` take effect in process.
"""
import warnings

import pytest
import torch

import hanzo_torch
from hanzo_torch.backends import cpu as hcpu
from hanzo_torch.ops import _dispatch
from hanzo_torch.ops import fused as ref
from hanzo_torch.ops import quant
from hanzo_torch.backends.cpu import fused as cf

from test_cpu_kernels import random_blocks

ops = torch.ops.hanzo


@pytest.fixture(scope="module", autouse=True)
def built():
    if hcpu.extension() is None:
        pytest.fail("the C++ CPU extension failed to build (see the warning above)")
    torch.ops.hanzo.swiglu(torch.ones(1), torch.ones(1))  # activates the CPU backend


_DIRECT = {"rms_norm": cf.rms_norm, "add_rms_norm": cf.add_rms_norm, "qk_norm_rope": cf.qk_norm_rope,
           "kv_cache_write": cf.kv_cache_write, "attention": cf.attention}


def body(name):
    """The C++ kernel of ``name`` called directly (no dispatcher)."""
    if name == "mul_mat":
        return hcpu.mul_mat
    if name == "swiglu_mul_mat":
        return hcpu.swiglu_mul_mat
    return _DIRECT[name]


def g(seed=0):
    return torch.Generator().manual_seed(seed)


def test_registered_for_every_op():
    ext = hcpu.extension()
    assert set(hanzo_torch.backends.activate("cpu")) == set(ext.native_ops())
    assert set(ext.native_ops()) == set(_dispatch.OPS) - {"quantize_q8_1"}
    st = {b.name: b for b in hanzo_torch.backends.status()}
    assert st["cpu"].available and st["cpu"].details["isa"] in hcpu.isa_levels()  # HANZO_CPU_ISA may force avx512-sim
    levels, missing = set(st["cpu"].details["isa_levels"]), set(st["cpu"].details["isa_missing"])
    assert levels.isdisjoint(missing) and levels | missing == set(hcpu.ISA_NAMES.values())
    assert set(st["cpu"].formats) == set(hanzo_torch.QUANTIZED_FORMATS) - {"NVFP4"}


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "IQ2_XXS"])
def test_mul_mat_identical_to_the_direct_kernel(qtype):
    K, N = 512, 13
    w = random_blocks(qtype, N, K, seed=1)
    for shape in ((1, K), (7, K), (2, 3, K), (K,)):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(*shape, generator=g()).to(dtype)
            y = ops.mul_mat(x, w, qtype)
            want = body("mul_mat")(x, w, qtype)
            assert y.shape == want.shape == (*shape[:-1], N) and y.dtype == dtype
            assert torch.equal(y, want), (qtype, shape, dtype)


def test_swiglu_mul_mat_identical_to_the_direct_kernel():
    K, F = 256, 40
    wg, wu = random_blocks("Q4_K", F, K, seed=2), random_blocks("Q6_K", F, K, seed=3)
    for shape in ((1, 1, K), (9, K)):
        for dtype in (torch.float32, torch.float16):
            x = torch.randn(*shape, generator=g(1)).to(dtype)
            y = ops.swiglu_mul_mat(x, wg, wu, "Q4_K", "Q6_K")
            assert torch.equal(y, body("swiglu_mul_mat")(x, wg, wu, "Q4_K", "Q6_K")), (shape, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_identical_to_the_direct_kernels(dtype):
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
    for a, b in zip(ops.moe_route(x[0], 3, True), cf.moe_route(x[0], 3, True)):
        assert torch.equal(a, b)


def test_bad_input_raises_the_python_errors():
    w = random_blocks("Q4_K", 4, 256, seed=4)
    with pytest.raises(ValueError, match="bytes per Q4_K row"):
        ops.mul_mat(torch.randn(1, 512), w, "Q4_K")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        ops.mul_mat(torch.ones(1, 256, dtype=torch.int32), w, "Q4_K")
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


def test_reference_mode_isa_and_dense_formats_take_effect():
    K, N = 256, 8
    w = random_blocks("Q6_K", N, K, seed=5)
    x = torch.randn(2, K, generator=g(11))
    fast = ops.mul_mat(x, w, "Q6_K")
    with hanzo_torch.ops.use_reference("mul_mat"):
        slow = ops.mul_mat(x, w, "Q6_K")
    assert torch.equal(slow, quant.mul_mat_reference(x, w, "Q6_K")) and not torch.equal(fast, slow)
    with hcpu.use_isa("scalar"):
        assert torch.equal(ops.mul_mat(x, w, "Q6_K"), hcpu.mul_mat(x, w, "Q6_K", isa="scalar"))
    assert torch.equal(ops.mul_mat(x, w, "Q6_K"), fast)
    with pytest.raises(ValueError, match="unknown ISA"):
        with hcpu.use_isa("neon"):
            pass
    w16 = hanzo_torch.quantize(torch.randn(N, K, generator=g(12)), "F16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # dense formats are torch's GEMM: no warning
        assert torch.equal(ops.mul_mat(x, w16, "F16"), quant.mul_mat_reference(x, w16, "F16"))
    xs, ws = torch.randn(3, 16, generator=g(13)), torch.randn(16, generator=g(14))
    with hanzo_torch.ops.use_reference("rms_norm"):
        assert torch.equal(ops.rms_norm(xs, ws, 1e-6), ref.rms_norm_reference(xs, ws, 1e-6))


def test_a_format_without_a_cpu_kernel_warns_once_and_runs_the_reference():
    from hanzo_torch.backends.triton._testing import random_packed

    missing = sorted(set(hanzo_torch.QUANTIZED_FORMATS) - set(hcpu.formats()))
    if not missing:
        pytest.skip("every quantized format has a C++ kernel")
    qtype = missing[0]
    w = random_packed(qtype, (4, 64), seed=3)
    x = torch.randn(1, 64, generator=g(16))
    with pytest.warns(UserWarning, match=f"no C\\+\\+ kernel for format {qtype}"):
        y = ops.mul_mat(x, w, qtype)
    assert torch.equal(y, quant.mul_mat_reference(x, w, qtype))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.mul_mat(x, w, qtype)  # once per format


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


def test_qk_norm_rope_kv_write_bumps_the_caches_versions():
    """qk_norm_rope_kv_write's C++ ADInplaceOrView kernel bumps both caches' versions (not q's or k's)."""
    kc, vc = torch.zeros(1, 4, 1, 2), torch.zeros(1, 4, 1, 2)
    q, k = torch.ones(1, 1, 2, 2), torch.ones(1, 1, 1, 2)
    before = [t._version for t in (kc, vc, q, k)]
    with torch.no_grad():
        q2 = ops.qk_norm_rope_kv_write(q, k, torch.full((1, 1, 1, 2), 2.0), None, None, kc, vc, torch.tensor([[0]]),
                                       1e4, 1e-6)
    assert [t._version for t in (kc, vc, q, k)] == [before[0] + 1, before[1] + 1, before[2], before[3]]
    assert torch.equal(q2, q) and kc[0, 0, 0].tolist() == [1.0, 1.0] and vc[0, 0, 0].tolist() == [2.0, 2.0]
