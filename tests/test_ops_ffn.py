"""``hanzo::swiglu_mul_mat`` (gate+up fused FFN): schema, the reference's numerics, dispatch.

The oracle of the reference is float64 ``silu(x @ Wg^T) * (x @ Wu^T)`` of
``gguf.quants.dequantize``-d weights. Every backend's kernel (C++ on each ISA, Triton under the
interpreter) is held to the reference, and its bad-argument errors to the reference's, in
tests/test_conformance.py; the Triton kernel's launch in tests/test_triton_kernels.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hanzo_torch
from hanzo_torch.ops.ffn import swiglu_mul_mat_reference
from hanzo_torch.backends.triton._testing import gguf_dequantize, random_packed

U32 = 2.0 ** -24  # unit roundoff of float32

# (gate format, up format): same and mixed, K-quants, legacy, dense, i-quant
FORMAT_PAIRS = [("Q4_K", "Q4_K"), ("Q4_K", "Q6_K"), ("Q8_0", "Q5_0"), ("F16", "Q4_0"), ("IQ2_XXS", "Q2_K"),
                ("BF16", "F32")]


def _oracle(x, wg, wu, qg, qu):
    """float64 result, and the float64 ``|x| @ |W|^T`` scales of the two products."""
    Wg, Wu = gguf_dequantize(wg, qg).double(), gguf_dequantize(wu, qu).double()
    xd = x.double().reshape(-1, x.shape[-1])
    g, u = xd @ Wg.T, xd @ Wu.T
    return F.silu(g) * u, g, u, xd.abs() @ Wg.abs().T, xd.abs() @ Wu.abs().T


def _bound(g, u, sg, su, K, extra_rel=0.0):
    """First-order error bound of silu(g~) * u~ with |g~ - g| <= eg = K u32 sg (float32 dot of
    length K with exact float32 operands), likewise eu, |silu'| <= 1.1, plus a few float32
    roundings of the epilogue (and ``extra_rel`` * |y| for a rounded output dtype)."""
    eg, eu = K * U32 * sg, K * U32 * su
    y = F.silu(g) * u
    return 1.1 * (u.abs() + eu) * eg + F.silu(g).abs() * eu + (8 * U32 + extra_rel) * y.abs() + 1e-30


def _make(qg, qu, M, F_=24, K=256, seed=0, dtype=torch.float32):
    wg = random_packed(qg, (F_, K), seed=seed)
    wu = random_packed(qu, (F_, K), seed=seed + 1)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    return x, wg, wu


@pytest.fixture
def references():
    """The float32 references of mul_mat, swiglu and swiglu_mul_mat (the C++ CPU kernels quantize x
    to int8; every backend is held to these references in tests/test_conformance.py)."""
    with hanzo_torch.ops.use_reference("mul_mat", "swiglu", "swiglu_mul_mat"):
        yield


@pytest.mark.parametrize("qg,qu", FORMAT_PAIRS)
def test_swiglu_mul_mat_numeric(qg, qu, references):
    """float32: ``|y - y64| <= 1.1 (|u| + eu) eg + |silu(g)| eu + 8 u32 |y|`` with
    ``eg = K 2^-24 (|x| @ |Wg|^T)`` (and eu for up) — first-order propagation of the float32
    dot-product bound through silu(g) * u; a wrong scale or nibble is orders of magnitude off."""
    K = 256
    x, wg, wu = _make(qg, qu, 3, K=K)
    y = torch.ops.hanzo.swiglu_mul_mat(x.reshape(1, 3, K), wg, wu, qg, qu)
    assert y.shape == (1, 3, 24) and y.dtype == torch.float32
    ref, g, u, sg, su = _oracle(x, wg, wu, qg, qu)
    lim = _bound(g, u, sg, su, K)
    err = (y.reshape(3, 24).double() - ref).abs()
    print(f"{qg}+{qu}: max err/bound {(err / lim).max().item():.3g}")
    assert (err <= lim).all(), f"{qg}+{qu}: error {err.max().item():.3e} over the bound"
    # the bound is tight enough to catch a swapped gate/up
    swapped = torch.ops.hanzo.swiglu_mul_mat(x, wu, wg, qu, qg) if qg != qu else None
    if swapped is not None:
        assert ((swapped.double() - ref).abs() > 100 * lim).any()


def test_swiglu_mul_mat_default_backend_matches_composition():
    """The op body on this machine (C++ CPU kernels when built) equals the unfused composition."""
    x, wg, wu = _make("Q4_K", "Q6_K", 2, F_=40, seed=3)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        y = torch.ops.hanzo.swiglu_mul_mat(xd, wg, wu, "Q4_K", "Q6_K")
        assert y.dtype == dtype
        torch.testing.assert_close(y, swiglu_mul_mat_reference(xd, wg, wu, "Q4_K", "Q6_K"), rtol=0, atol=0)


def test_swiglu_mul_mat_reference_mode():
    """In reference mode the op is the unfused float32 composition; natively (C++ here) it is
    the fused kernel, which quantizes x to int8 (close, not equal)."""
    x, wg, wu = _make("Q4_K", "Q6_K", 1)
    with hanzo_torch.ops.use_reference("swiglu_mul_mat", "mul_mat", "swiglu"):
        ref = torch.ops.hanzo.swiglu_mul_mat(x, wg, wu, "Q4_K", "Q6_K")
        assert torch.equal(ref, torch.ops.hanzo_ref.swiglu_mul_mat(x, wg, wu, "Q4_K", "Q6_K"))
    native = torch.ops.hanzo.swiglu_mul_mat(x, wg, wu, "Q4_K", "Q6_K")
    torch.testing.assert_close(native, ref, rtol=0.05, atol=0.05 * ref.abs().max().item())


def test_swiglu_mul_mat_errors():
    # (the shape, dtype and byte-count errors of every backend: tests/test_conformance.py)
    x, wg, wu = _make("Q4_K", "Q6_K", 2)
    op = torch.ops.hanzo.swiglu_mul_mat
    with pytest.raises((KeyError, ValueError)):
        op(x, wg, wu, "Q4_Z", "Q6_K")
    # the fake kernel checks the same (torch.compile / meta tensors)
    with pytest.raises(ValueError, match="same width"):
        op(x.to("meta"), wg.to("meta"), wu[:20].to("meta"), "Q4_K", "Q6_K")
    assert op(x.to("meta"), wg.to("meta"), wu.to("meta"), "Q4_K", "Q6_K").shape == (2, 24)


def test_swiglu_mul_mat_grad(references):
    x, wg, wu = _make("Q8_0", "Q4_K", 2, F_=8, seed=5)
    x.requires_grad_(True)
    torch.ops.hanzo.swiglu_mul_mat(x, wg, wu, "Q8_0", "Q4_K").sum().backward()
    xr = x.detach().double().requires_grad_(True)
    Wg, Wu = gguf_dequantize(wg, "Q8_0").double(), gguf_dequantize(wu, "Q4_K").double()
    (F.silu(xr @ Wg.T) * (xr @ Wu.T)).sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("qg,qu", [("Q8_0", "Q8_0"), ("Q4_K", "Q6_K")])
def test_opcheck_swiglu_mul_mat(qg, qu):
    x, wg, wu = _make(qg, qu, 3, F_=8)
    torch.library.opcheck(torch.ops.hanzo.swiglu_mul_mat.default, (x.reshape(3, 1, 256), wg, wu, qg, qu))
    torch.library.opcheck(torch.ops.hanzo.swiglu_mul_mat.default,
                          (x.to(torch.bfloat16).requires_grad_(qg == "Q8_0"), wg, wu, qg, qu))
