"""The Vulkan kernels of the quantized ops (csrc/vulkan/ops_quant.cpp, shaders in csrc/vulkan/shaders)
against the references, on what tests/test_conformance.py does not reach: the mat-vec / GEMM
boundary and GEMM tile edges, float16 / bfloat16 activations and results, int32 ids, views,
out-of-range ids (NaN on the device instead of a host check), and reference mode.

Runs on lavapipe (Mesa's CPU Vulkan) in the default suite; skipped with the backend's reason where
no Vulkan device is available. Shapes are small: lavapipe is a CPU.
"""
from __future__ import annotations

import pytest
import torch

import hanzo_torch
from hanzo_torch.backends import vulkan
from hanzo_torch.constants import VULKAN_MATVEC_MAX_ROWS
from hanzo_torch.backends.triton._testing import random_packed

pytestmark = pytest.mark.skipif(not vulkan.available(), reason=f"vulkan backend unavailable: {vulkan.reason()}")

DEV = "vulkan"


@pytest.fixture(autouse=True)
def _float_contractions():
    """These tests hold mul_mat to float32 rounding of x @ W^T: the int8 path (on by default where a
    device accelerates int8 dot products) is off here; tests/test_vulkan_int8.py covers it."""
    from hanzo_torch.backends.vulkan import quant

    vulkan.register()
    with quant.use_int8(False):
        yield


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fp32_bound(x: torch.Tensor, wf: torch.Tensor) -> torch.Tensor:
    """float32 accumulation error of x @ W^T, per output: K * eps * (|x| @ |W|^T), plus a floor."""
    K = x.shape[-1]
    return K * 2.0 ** -23 * (x.double().abs() @ wf.double().abs().t()) + 1e-6


def test_rule_table_is_the_python_list():
    from hanzo_torch.backends.vulkan.rules import RULES

    fmts = vulkan.formats()
    assert fmts == tuple(n for n in RULES if n in hanzo_torch.FORMATS)
    assert set(hanzo_torch.QUANTIZED_FORMATS) <= set(fmts)
    assert torch.ops.hanzo_vulkan.quant_formats() == sorted(fmts)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_1", "Q3_K", "IQ2_XS", "IQ1_M", "MXFP4", "BF16"])
def test_get_rows_dtypes_int32_ids_and_bad_ids(qtype):
    w = random_packed(qtype, (6, 256), seed=7)
    ids = torch.tensor([[5, 0, 2]], dtype=torch.int32)
    wd = w.to(DEV)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        got = torch.ops.hanzo.get_rows(wd, ids.to(DEV), qtype, dtype).cpu()
        want = torch.ops.hanzo_ref.get_rows(w, ids, qtype, dtype)
        assert got.dtype == dtype and torch.equal(got.nan_to_num(), want.nan_to_num()), dtype  # one RNE rounding
    bad = torch.tensor([1, 6, -1]).to(DEV)
    got = torch.ops.hanzo.get_rows(wd, bad, qtype, torch.float32).cpu()
    assert torch.equal(got[0], torch.ops.hanzo_ref.dequantize(w[1], qtype, [256], torch.float32))
    assert got[1:].isnan().all()


def test_dequantize_shapes_and_dtypes():
    w = random_packed("Q4_K", (2, 3, 512), seed=8)
    got = torch.ops.hanzo.dequantize(w.to(DEV), "Q4_K", [2, 3, 512], torch.float16).cpu()
    assert torch.equal(got, torch.ops.hanzo_ref.dequantize(w, "Q4_K", [2, 3, 512], torch.float16))
    with pytest.raises(ValueError, match="needs"):  # bad arguments: the reference's errors
        torch.ops.hanzo.dequantize(w.to(DEV), "Q4_K", [2, 3, 256], torch.float32)


@pytest.mark.parametrize("qtype", ["Q4_K", "IQ3_S", "F16"])
def test_mul_mat_vec_and_gemm_tiles(qtype):
    K, N = 512, 70  # N: one full 64-row tile and a partial one
    w = random_packed(qtype, (N, K), seed=9)
    wf = torch.ops.hanzo_ref.dequantize(w, qtype, [N, K], torch.float32)
    wd = w.to(DEV)
    mv = VULKAN_MATVEC_MAX_ROWS
    for M in (1, mv, mv + 1, 70):  # mat-vec up to mv rows, the tiled GEMM above
        x = torch.randn(M, K, generator=_g(M))
        got = torch.ops.hanzo.mul_mat(x.to(DEV), wd, qtype).cpu()
        err = (got.double() - x.double() @ wf.double().t()).abs()
        assert got.shape == (M, N) and (err <= _fp32_bound(x, wf)).all(), (M, err.max().item())


def test_mul_mat_half_activations_and_views():
    K, N = 256, 12
    w = random_packed("Q6_K", (N, K), seed=10)
    wf = torch.ops.hanzo_ref.dequantize(w, "Q6_K", [N, K], torch.float32)
    wd = w.to(DEV)
    for dtype in (torch.float16, torch.bfloat16):
        for M in (3, 20):
            x = torch.randn(2, M, K, generator=_g(M)).to(dtype)
            got = torch.ops.hanzo.mul_mat(x.to(DEV), wd, "Q6_K").cpu()
            want = (x.float() @ wf.t()).to(dtype)  # float32 accumulation, one rounding
            assert got.dtype == dtype and got.shape == (2, M, N)
            torch.testing.assert_close(got.float(), want.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-3)
    x = torch.randn(K, 5, generator=_g(11))
    got = torch.ops.hanzo.mul_mat(x.to(DEV).t(), wd, "Q6_K").cpu()  # a transposed view
    err = (got.double() - x.t().double() @ wf.double().t()).abs()
    assert (err <= _fp32_bound(x.t(), wf)).all()


def test_mul_mat_id_layouts_and_bad_ids():
    E, N, K, T = 3, 10, 256, 5
    w = random_packed("IQ4_XS", (E, N, K), seed=12)
    wf = torch.ops.hanzo_ref.dequantize(w, "IQ4_XS", [E, N, K], torch.float32)
    ids = torch.tensor([[0, 2], [1, 1], [2, 0], [0, 1], [2, 2]], dtype=torch.int32)
    wd = w.to(DEV)
    for x in (torch.randn(T, K, generator=_g(13)), torch.randn(T, 2, K, generator=_g(14))):
        got = torch.ops.hanzo.mul_mat_id(x.to(DEV), wd, ids.to(DEV), "IQ4_XS").cpu()
        assert got.shape == (T, 2, N)
        for t in range(T):
            for j in range(2):
                xr = x[t] if x.dim() == 2 else x[t, j]
                ref = xr.double() @ wf[ids[t, j]].double().t()
                assert ((got[t, j].double() - ref).abs() <= _fp32_bound(xr[None], wf[ids[t, j]])[0]).all(), (t, j)
    bad = torch.tensor([[0, 3]] * T)
    got = torch.ops.hanzo.mul_mat_id(x.to(DEV), wd, bad.to(DEV), "IQ4_XS").cpu()
    assert got[:, 1].isnan().all() and not got[:, 0].isnan().any()


def test_mul_mat_id_grouped_by_expert():
    """From 16 (token, slot) pairs on, the pairs are sorted by expert on the device and each
    weight run is read once per expert of a chunk: the same bits as one pair at a time (fewer
    pairs), chunks holding several experts, an expert that no token chose, a bad id (NaN)."""
    E, N, K, T, k = 5, 12, 256, 23, 2
    w = random_packed("Q4_K", (E, N, K), seed=18)
    wd = w.to(DEV)
    ids = torch.randint(0, E - 1, (T, k), generator=_g(19))  # expert E - 1 unused
    ids[4, 1] = E
    for dtype in (torch.int64, torch.int32):
        for x in (torch.randn(T, K, generator=_g(20)), torch.randn(T, k, K, generator=_g(21))):
            xd, idd = x.to(DEV), ids.to(dtype).to(DEV)
            got = torch.ops.hanzo.mul_mat_id(xd, wd, idd, "Q4_K").cpu()
            # 7 tokens x 2 slots = 14 pairs: one pair per workgroup
            one = torch.cat([torch.ops.hanzo.mul_mat_id(xd[t:t + 7], wd, idd[t:t + 7], "Q4_K").cpu()
                             for t in range(0, T, 7)])
            assert got[4, 1].isnan().all() and not got[:4].isnan().any() and not got[5:].isnan().any()
            assert torch.equal(got.nan_to_num(), one.nan_to_num()), (dtype, x.dim())
            ref = torch.ops.hanzo_ref.mul_mat_id(x, w, ids.clamp(max=E - 1), "Q4_K")
            assert (got[5:] - ref[5:]).abs().max() < 1e-3 * ref.abs().max()


def test_swiglu_mul_mat_mixed_formats():
    K, F = 256, 20
    wg, wu = random_packed("Q4_K", (F, K), seed=15), random_packed("Q6_K", (F, K), seed=16)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, K, generator=_g(17)).to(dtype)
        got = torch.ops.hanzo.swiglu_mul_mat(x.to(DEV), wg.to(DEV), wu.to(DEV), "Q4_K", "Q6_K").cpu()
        # the float32 projections (the CPU kernels quantize x to int8: not a reference at this
        # tolerance), each rounded to x.dtype, then silu(g) * u in float32, as the unfused ops
        g, u = ((x.float() @ torch.ops.hanzo_ref.dequantize(w, q, [F, K], torch.float32).t()).to(dtype)
                for w, q in ((wg, "Q4_K"), (wu, "Q6_K")))
        want = torch.ops.hanzo_ref.swiglu(g, u)
        assert got.dtype == dtype and got.shape == (3, F)
        tol = 1e-4 if dtype == torch.float32 else 2 ** -6
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.float().abs().max().item())


@pytest.fixture
def profiled():
    """The profile counters on (reset) and the float path of the contractions (not int8) for the
    test, restored after."""
    import os

    from hanzo_torch.backends.vulkan import quant as vulkan_quant

    vulkan.synchronize()
    vulkan.set_profiling(True)
    with vulkan_quant.use_int8(False):
        yield vulkan.profile
    vulkan.set_profiling(os.environ.get("HANZO_VK_PROFILE", "") not in ("", "0"))


@pytest.mark.parametrize("qtype", ["Q4_K", "IQ2_XXS", "F16"])  # a K-quant, a grid format, a dense one
def test_swiglu_mul_mat_vec_one_dispatch_same_bits(qtype, profiled):
    """Gate and up of one format at decode sizes (M <= 8) on the float path: one dispatch (the two
    mat-vecs and the epilogue), bit for bit what the three dispatches give, for every activation
    dtype and M = 1, 3 and 8; M = 9 (GEMM), mixed formats and the int8 path keep theirs."""
    K, F = 512, 37
    wg, wu = (random_packed(qtype, (F, K), seed=s).to(DEV) for s in (21, 22))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for M in (1, 3, 8, 9):
            x = torch.randn(M, K, generator=_g(23 + M)).to(dtype).to(DEV)
            vulkan.synchronize()
            profiled()
            fused = torch.ops.hanzo.swiglu_mul_mat(x, wg, wu, qtype, qtype).cpu()
            n_fused = profiled()["dispatches"]
            prev = torch.ops.hanzo_vulkan.swiglu_mul_mat_fused(False)
            try:
                three = torch.ops.hanzo.swiglu_mul_mat(x, wg, wu, qtype, qtype).cpu()
                n_three = profiled()["dispatches"]
            finally:
                torch.ops.hanzo_vulkan.swiglu_mul_mat_fused(prev)
            assert torch.equal(fused.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               three.view(torch.int16 if dtype != torch.float32 else torch.int32)), (dtype, M)
            assert (n_fused, n_three) == ((1, 3) if M <= 8 else (3, 3)), (dtype, M, n_fused, n_three)
    x = torch.randn(1, K, generator=_g(40)).to(DEV)
    w6 = random_packed("Q6_K" if qtype != "Q6_K" else "Q4_K", (F, K), seed=41).to(DEV)
    q6 = "Q6_K" if qtype != "Q6_K" else "Q4_K"
    vulkan.synchronize()
    profiled()
    torch.ops.hanzo.swiglu_mul_mat(x, wg, w6, qtype, q6).cpu()
    assert profiled()["dispatches"] == 3
    from hanzo_torch.backends.vulkan import quant as vulkan_quant

    with vulkan_quant.use_int8(True):  # the int8 projections keep their own dispatches
        if qtype in vulkan_quant.int8_formats():
            vulkan.synchronize()
            profiled()
            torch.ops.hanzo.swiglu_mul_mat(x, wg, wu, qtype, qtype).cpu()
            assert profiled()["dispatches"] == 4  # quantize_q8_1, two int8 mat-vecs, the epilogue


def test_reference_mode_is_honoured():
    w = random_packed("Q8_0", (4, 64), seed=18).to(DEV)
    bad = torch.tensor([0, 4]).to(DEV)
    assert torch.ops.hanzo.get_rows(w, bad, "Q8_0", torch.float32).cpu()[1].isnan().all()  # the shader
    with hanzo_torch.ops.use_reference("get_rows"):
        assert "get_rows" in hanzo_torch.ops._dispatch.redirected_ops()
        with pytest.raises(RuntimeError, match="out of range"):  # the reference's device-side id check
            torch.ops.hanzo.get_rows(w, bad, "Q8_0", torch.float32)
    assert "get_rows" not in hanzo_torch.ops._dispatch.redirected_ops()
    assert torch.ops.hanzo.get_rows(w, bad, "Q8_0", torch.float32).cpu()[1].isnan().all()


def test_empty_shapes():
    w = torch.zeros(3, 0, dtype=torch.uint8).to(DEV)  # K = 0: the sums are empty
    y = torch.ops.hanzo.mul_mat(torch.randn(2, 0).to(DEV), w, "Q4_0").cpu()
    assert y.shape == (2, 3) and torch.equal(y, torch.zeros(2, 3))
    y = torch.ops.hanzo.swiglu_mul_mat(torch.randn(2, 0).to(DEV), w, w, "Q4_0", "Q4_0").cpu()
    assert y.shape == (2, 3) and torch.equal(y, torch.zeros(2, 3))
    w = random_packed("Q4_0", (3, 64), seed=19).to(DEV)
    assert torch.ops.hanzo.mul_mat(torch.randn(0, 64).to(DEV), w, "Q4_0").shape == (0, 3)
    assert torch.ops.hanzo.get_rows(w, torch.zeros(0, 2, dtype=torch.long).to(DEV), "Q4_0",
                                    torch.float32).shape == (0, 2, 64)
