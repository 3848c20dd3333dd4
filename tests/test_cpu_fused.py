"""What is CPU-specific about the C++ kernels of the fused ops (csrc/cpu/fused.cpp).

The op-vs-reference gates of these kernels (every shape, dtype, cache dtype, ISA, prefill and
decode path) are in tests/test_conformance.py. Here: the thread split of large calls, the
thread pool under ``torch.inference_mode``, the direct kernels' own range checks, and the
fallback when the extension is missing. Tolerance: float32 results agree with the reference to
rtol = atol = 1e-5 of the output's magnitude (summation order, exact vs online softmax, libm).
"""
from __future__ import annotations

import pytest
import torch

import hanzo_torch  # noqa: F401  registers torch.ops.hanzo.*
from hanzo_torch.backends import cpu as hcpu
from hanzo_torch.ops import fused as ref
from hanzo_torch.backends.cpu import fused as cf

pytestmark = pytest.mark.skipif(not hcpu.available(), reason="C++ CPU extension could not be built")

TOL = {torch.float32: (1e-5, 1e-5)}


def err(a, b):
    """Largest |a - b| relative to the reference's largest magnitude (float32)."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def close(a, b, dtype):
    rtol, atol = TOL[dtype]
    assert a.dtype == b.dtype and a.shape == b.shape
    scale = float(b.float().abs().max().clamp_min(1)) if b.numel() else 1.0
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol * scale)


def g(seed=0):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------ norms
def test_rms_norm_large_parallel_and_noncontiguous():
    x = torch.randn(300, 2048, generator=g())[:, ::2]  # non-contiguous, 300 * 1024 floats: threaded
    w = torch.randn(1024, generator=g(1))
    close(cf.rms_norm(x, w, 1e-5), ref.rms_norm_reference(x, w, 1e-5), torch.float32)


# ------------------------------------------------------------------------------------ kv_cache_write
def test_kv_cache_write_rejects_out_of_range():
    # the direct kernel's own check (the op's ValueError: tests/test_conformance.py)
    kc = torch.zeros(1, 4, 1, 2)
    with pytest.raises(RuntimeError, match="outside"):
        cf.kv_cache_write(kc, kc.clone(), torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), torch.tensor([[4]]))


# ------------------------------------------------------------------------------------ attention
def _attn_inputs(B, T, Hq, Hk, D, S, dtype, positions):
    q = torch.randn(B, T, Hq, D, generator=g()).to(dtype)
    kc = torch.randn(B, S, Hk, D, generator=g(1)).to(dtype)
    vc = torch.randn(B, S, Hk, D, generator=g(2)).to(dtype)
    return q, kc, vc, torch.as_tensor(positions)


def test_attention_large_prefill_threaded():
    q, kc, vc, pos = _attn_inputs(1, 64, 8, 2, 64, 128, torch.float32, [list(range(30, 94))])
    close(cf.attention(q, kc, vc, pos, 0.125), ref.attention_reference(q, kc, vc, pos, 0.125, "eager"), torch.float32)


def test_attention_prefill_under_inference_mode():
    # the model runs under torch.inference_mode: the tiles' pool threads must see it too
    q, kc, vc, pos = _attn_inputs(1, 128, 8, 2, 64, 128, torch.float32, [list(range(128))])
    expect = ref.attention_reference(q, kc, vc, pos, 0.125, "eager")
    with torch.inference_mode():
        q, kc, vc = q.clone(), kc.clone(), vc.clone()
        out = torch.ops.hanzo.attention(q, kc, vc, pos, 0.125, "auto")
    assert err(out, expect) < 1e-5


def test_attention_rejects_out_of_range():
    q, kc, vc, _ = _attn_inputs(1, 1, 2, 1, 4, 8, torch.float32, [[0]])
    with pytest.raises(RuntimeError, match="outside"):
        cf.attention(q, kc, vc, torch.tensor([[8]]), 1.0)


def test_fallback_when_extension_missing(monkeypatch):
    monkeypatch.setattr(cf, "_kernel", lambda name: None)
    x = torch.randn(3, 16, generator=g())
    w = torch.randn(16, generator=g(1))
    assert torch.equal(cf.rms_norm(x, w, 1e-6), ref.rms_norm_reference(x, w, 1e-6))




@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_swiglu_bits_do_not_depend_on_the_split_and_special_values(isa):
    """silu(g) * u (csrc/cpu/fused.cpp hz_silu_mul, also swiglu_mul_mat's epilogue): an element's
    bits are the same whether it sits in 8 full lanes or in a row's tail (the fused op splits rows
    by its tasks, the plain op by its own); within float32 roundings of the float64 formula; the
    exp never overflows (g = -100 gives -0.0-ish, not NaN); NaN stays NaN, +inf gives inf and
    -inf gives NaN, as torch's silu."""
    if isa not in hcpu.isa_levels():
        pytest.skip(f"no {isa} level here")
    x = torch.randn(3, 77, generator=g(7)) * 6
    u = torch.randn(3, 77, generator=g(8))
    with hcpu.use_isa(isa):
        whole = cf.swiglu(x, u)
        for a, b in ((0, 5), (5, 13), (13, 77), (40, 41)):
            assert torch.equal(cf.swiglu(x[:, a:b].contiguous(), u[:, a:b].contiguous()), whole[:, a:b]), (a, b)
        want = x.double() * torch.sigmoid(x.double()) * u.double()
        assert ((whole.double() - want).abs() <= 4e-7 * want.abs() + 1e-30).all()
        sp = torch.tensor([[-100.0, -88.0, float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 90.0]])
        y = cf.swiglu(sp, torch.full_like(sp, 2.0))
    assert y[0, 0].abs() < 1e-30 and y[0, 1].abs() < 1e-30
    assert y[0, 2].isnan() and y[0, 3] == float("inf") and y[0, 4].isnan()
    assert y[0, 5] == 0 and y[0, 6] == 0 and y[0, 7] == 180.0
