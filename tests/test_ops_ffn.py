"""``hanzo::swiglu_mul_mat`` (gate+up fused FFN): schema, numerics, errors, dispatch, Triton kernel.

The oracle is float64 ``silu(x @ Wg^T) * (x @ Wu^T)`` of ``gguf.quants.dequantize``-d weights.
The Triton kernel runs on CPU tensors under TRITON_INTERPRET=1 in a child pytest (the
interpreter must be chosen before triton decorates the kernels, see tests/test_triton_kernels.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import hanzo_torch
from hanzo_torch.ops.ffn import swiglu_mul_mat_reference
from hanzo_torch.backends.triton._testing import gguf_dequantize, random_packed

U32 = 2.0 ** -24  # unit roundoff of float32
_CHILD = os.environ.get("HANZO_FFN_INTERPRET_CHILD") == "1"

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
    to int8; their own gate is tests/test_cpu_kernels.py)."""
    with hanzo_torch.ops.use_reference("mul_mat", "swiglu", "swiglu_mul_mat"):
        yield


if not _CHILD:
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
        x, wg, wu = _make("Q4_K", "Q6_K", 2)
        op = torch.ops.hanzo.swiglu_mul_mat
        with pytest.raises(ValueError, match="same width"):
            op(x, wg, wu[:20], "Q4_K", "Q6_K")
        with pytest.raises(ValueError, match="bytes per Q6_K row"):
            op(x, wg, random_packed("Q6_K", (24, 512)), "Q4_K", "Q6_K")
        with pytest.raises(ValueError, match="not a multiple of the Q4_K block size"):
            op(torch.randn(2, 128), wg, wu, "Q4_K", "Q6_K")
        with pytest.raises(ValueError, match="bytes per Q8_0 row"):
            op(x, wg, wu, "Q4_K", "Q8_0")  # format name does not match the bytes
        with pytest.raises(ValueError, match="uint8"):
            op(x, wg.float(), wu, "Q4_K", "Q6_K")
        with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
            op(x.double(), wg, wu, "Q4_K", "Q6_K")
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

    def test_triton_ffn_under_interpreter():
        """Runs the Triton cases below in a child pytest with TRITON_INTERPRET=1."""
        pytest.importorskip("triton")
        env = dict(os.environ, TRITON_INTERPRET="1", HANZO_FFN_INTERPRET_CHILD="1")
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
                               "-W", "ignore::RuntimeWarning"], env=env, capture_output=True, text=True, timeout=600)
        tail = (proc.stdout + proc.stderr)[-6000:]
        assert proc.returncode == 0, f"interpreter cases failed (rc {proc.returncode}):\n{tail}"
        assert " passed" in proc.stdout and "skipped" not in proc.stdout, tail
        print(f"interpreter cases: {proc.stdout.strip().splitlines()[-1]} ({time.monotonic() - t0:.1f} s)")

else:
    @pytest.fixture(scope="module")
    def tffn():
        from triton.runtime.interpreter import InterpretedFunction

        from hanzo_torch.backends.triton import ffn

        assert isinstance(ffn._swiglu_matvec_kernel, InterpretedFunction), "TRITON_INTERPRET=1 not in effect"
        return ffn

    # M == 1 grouped (both formats grouped), M == 1 per-value (a dense format), M = 3 per-value,
    # M = 11 (> MATVEC_MAX_M: two GEMMs + swiglu); mixed formats
    @pytest.mark.parametrize("qg,qu,M", [("Q4_K", "Q6_K", 1), ("Q8_0", "IQ2_XXS", 1), ("F16", "Q4_K", 1),
                                         ("Q4_K", "Q6_K", 3), ("Q5_0", "Q4_0", 8), ("Q4_K", "Q6_K", 11)])
    def test_triton_swiglu_mul_mat_numeric(tffn, qg, qu, M, references):
        K = 256
        x, wg, wu = _make(qg, qu, M, F_=20, K=K, seed=7)
        y = tffn.swiglu_mul_mat(x, wg, wu, qg, qu)
        assert y.shape == (M, 20) and y.dtype == torch.float32
        ref, g, u, sg, su = _oracle(x, wg, wu, qg, qu)
        err = (y.double() - ref).abs()
        lim = _bound(g, u, sg, su, K)
        assert (err <= lim).all(), f"{qg}+{qu} M={M}: error {err.max().item():.3e}, ratio {(err / lim).max():.2f}"

    def test_triton_swiglu_mul_mat_bf16_and_leading_dims(tffn):
        x, wg, wu = _make("Q4_K", "Q4_K", 2, F_=12, seed=9)
        xb = x.to(torch.bfloat16).reshape(2, 1, 256)
        y = tffn.swiglu_mul_mat(xb, wg, wu, "Q4_K", "Q4_K")
        assert y.shape == (2, 1, 12) and y.dtype == torch.bfloat16
        ref, g, u, sg, su = _oracle(xb.float(), wg, wu, "Q4_K", "Q4_K")
        # one bf16 rounding of the output (the interpreter truncates: up to one ulp = 2^-7 relative)
        lim = _bound(g, u, sg, su, 256, extra_rel=2.0 ** -7)
        assert ((y.reshape(2, 12).double() - ref).abs() <= lim).all()

    def test_triton_swiglu_mul_mat_errors(tffn):
        x, wg, wu = _make("Q4_K", "Q6_K", 1)
        with pytest.raises(ValueError, match="w_up has 20"):
            tffn.swiglu_mul_mat(x, wg, wu[:20], "Q4_K", "Q6_K")
        with pytest.raises(ValueError, match="hold 512 values"):
            tffn.swiglu_mul_mat(x, wg, random_packed("Q6_K", (24, 512)), "Q4_K", "Q6_K")

    def test_registered_triton_kernel_runs(tffn, monkeypatch):
        """The dispatcher kernel the Triton backend registers (checks, format routing, then the
        kernel) launches the fused grouped kernel once for a decode call."""
        import hanzo_torch.backends.triton as backend

        calls = []
        real = tffn._swiglu_matvec_grouped_kernel

        class Spy:
            def __getitem__(self, grid):
                calls.append(grid)
                return real[grid]

        monkeypatch.setattr(tffn, "_swiglu_matvec_grouped_kernel", Spy())
        kernel = backend.wrap("swiglu_mul_mat", tffn.swiglu_mul_mat, frozenset(backend.supported_formats()))
        x, wg, wu = _make("Q4_K", "Q6_K", 1, seed=11)
        y = kernel(x, wg, wu, "Q4_K", "Q6_K")
        assert len(calls) == 1
        with hanzo_torch.ops.use_reference():  # the float32 composition (no CPU int8 kernels)
            ref = swiglu_mul_mat_reference(x, wg, wu, "Q4_K", "Q6_K")
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
