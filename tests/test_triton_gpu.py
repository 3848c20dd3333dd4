"""The Triton kernels on a real CUDA/ROCm device, at real shapes (marked ``gpu``).

The same gates as tests/test_triton_kernels.py (which runs them under the CPU interpreter at
tiny shapes): bit-exact dequantization against ``gguf.quants.dequantize`` for every format,
the op references for the contractions and fused ops with tolerances derived from the
rounding of the computation, plus what only a device shows: the registration for device type
"cuda", the bf16 tensor-core GEMM, and a CUDA-graph replay of a decode step whose position is
read from a device tensor (DESIGN section 4). Run with ``pytest -m gpu tests/test_triton_gpu.py``
(benchmarks/triton_gpu_check.py runs it too). Skipped without a CUDA/HIP device.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device"),
]

DEV = "cuda"
# Real shapes (module constants so that a dry run of this file can shrink them)
BIG = 4096          # rows and columns of the weight matrices
PREFILL_M = 512     # activation rows of the GEMM
VOCAB = 32000
SEQ = 256           # query positions of the fused-op checks
CACHE = 1024        # KV cache slots
QWEN_FORMATS = ("Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0", "F16", "BF16", "F32")


def _formats():
    try:
        from hanzo_torch.backends.triton.formats import SUPPORTED
    except ImportError:
        return ()
    return tuple(SUPPORTED)


ALL_FORMATS = _formats()


@pytest.fixture(scope="module")
def tk():
    import hanzo_torch.backends.triton as backend
    from hanzo_torch.backends.triton import formats, fused, quant

    assert backend.AVAILABLE, f"Triton backend not registered: {backend.REASON}"
    assert type(quant._dequantize_kernel).__name__ == "JITFunction", "kernels are interpreted, not compiled"
    return type("TK", (), dict(formats=formats, quant=quant, fused=fused))


@pytest.fixture(autouse=True)
def f32_decode(monkeypatch):
    """The float32 decode path unless a test asks for int8 (the tolerances below are float32's)."""
    monkeypatch.setattr("hanzo_torch.backends.triton.quant.DECODE_OVERRIDE", "f32")


def _bits_equal(a, b) -> bool:
    a, b = a.float().contiguous(), b.float().contiguous()
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


def _within(y, ref, bound, rel, what):
    err = (y.double() - ref.double()).abs().reshape(bound.shape)
    ratio = (err / (rel * bound + 1e-30)).max().item()
    assert ratio <= 1.0, f"{what}: max error {err.max().item():.3e} over tolerance (ratio {ratio:.2f})"


def test_registered_for_cuda(tk):
    from hanzo_torch import backends

    assert {"mul_mat", "attention", "mul_mat_id", "swiglu_mul_mat"} <= backends.activate("cuda")
    assert "IQ2_XXS" in tk.supported_formats()


@pytest.mark.parametrize("qtype", ALL_FORMATS)
def test_dequantize_bit_exact_4096(tk, qtype):
    from hanzo_torch.backends.triton._testing import gguf_dequantize

    qk, ts = tk.formats.format_info(qtype)[1:]
    K = BIG
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (BIG, K // qk * ts), dtype=torch.uint8, generator=g)
    ref = gguf_dequantize(data, qtype)
    out = tk.quant.dequantize(data.to(DEV), qtype, (BIG, K), torch.float32).cpu()
    assert _bits_equal(out, ref), qtype
    out16 = tk.quant.dequantize(data.to(DEV), qtype, (BIG, K), torch.bfloat16).cpu()
    assert _bits_equal(out16, ref.to(torch.bfloat16)), f"{qtype} bf16 rounding"


@pytest.mark.parametrize("qtype", ALL_FORMATS)
def test_mul_mat_decode_4096(tk, qtype):
    from hanzo_torch.ops.quant import mul_mat_reference
    from hanzo_torch.backends.triton._testing import matmul_bound, random_packed

    N, K = BIG, BIG
    w = random_packed(qtype, (N, K), seed=1).to(DEV)
    wf = tk.quant.dequantize(w, qtype, (N, K), torch.float32)
    for M, dtype in ((1, torch.float32), (1, torch.bfloat16), (8, torch.bfloat16)):
        x = torch.randn(M, K, device=DEV).to(dtype)
        y = tk.quant.mul_mat(x, w, qtype)
        ref = mul_mat_reference(x, w, qtype)
        # f32 accumulation + one rounding of the output to x.dtype
        rel = 1e-5 if dtype == torch.float32 else 1e-5 + 2 ** -8
        _within(y, ref, matmul_bound(x, wf), rel, f"mul_mat {qtype} M={M} {dtype}")


@pytest.mark.parametrize("qtype", QWEN_FORMATS + ("IQ2_XXS", "IQ4_XS", "Q2_K", "Q3_K", "Q5_K"))
def test_mul_mat_prefill_512(tk, qtype):
    from hanzo_torch.ops.quant import mul_mat_reference
    from hanzo_torch.backends.triton._testing import matmul_bound, random_packed

    M, N, K = PREFILL_M, BIG, BIG
    w = random_packed(qtype, (N, K), seed=2).to(DEV)
    wf = tk.quant.dequantize(w, qtype, (N, K), torch.float32)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(M, K, device=DEV).to(dtype)
        y = tk.quant.mul_mat(x, w, qtype)
        ref = mul_mat_reference(x, w, qtype)
        # bf16: the weight tile is rounded to bf16 for the tensor-core dot (2^-9 per product)
        # and the output to bf16 (2^-9 of |y| <= bound)
        rel = 1e-5 if dtype == torch.float32 else 2 ** -7
        _within(y, ref, matmul_bound(x, wf), rel, f"mul_mat {qtype} M={M} {dtype}")


@pytest.mark.parametrize("qtype", ("Q4_K", "Q6_K", "Q8_0", "IQ3_S"))
@pytest.mark.parametrize("T", (1, 300))  # decode, grouped prefill
def test_mul_mat_id(tk, qtype, T):
    from hanzo_torch.ops.quant import mul_mat_id_reference
    from hanzo_torch.backends.triton._testing import random_packed

    E, N, K, k = 8, BIG // 4, BIG // 2, 4
    w = random_packed(qtype, (E, N, K), seed=3).to(DEV)
    wf = tk.quant.dequantize(w, qtype, (E, N, K), torch.float32)
    ids = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(T)])
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    y = tk.quant.mul_mat_id(x, w, ids, qtype)
    ref = mul_mat_id_reference(x, w, ids, qtype)
    per_expert = torch.einsum("tk,enk->etn", x.double().abs(), wf.double().abs())  # [E, T, N]
    bound = per_expert[ids, torch.arange(T, device=DEV)[:, None]]                    # [T, k, N]
    _within(y, ref, bound, 2 ** -7, f"mul_mat_id {qtype} T={T}")


def _grouped_formats():
    try:
        from hanzo_torch.backends.triton.formats import GROUP_LEN
    except ImportError:
        return ()
    return tuple(q for q in GROUP_LEN if q in ALL_FORMATS)


@pytest.mark.parametrize("qtype", _grouped_formats())
def test_int8_decode_bit_exact(tk, qtype, monkeypatch):
    """The int8 (q8_1) decode mat-vec, compiled, equals the integer reference bit for bit
    (the kernel runs without FMA contraction; the reference does the same float32 steps)."""
    from hanzo_torch.backends.triton._testing import matvec_q8_1_reference, random_packed

    monkeypatch.setattr("hanzo_torch.backends.triton.quant.DECODE_OVERRIDE", "int8")
    N, K = 512, BIG
    w = random_packed(qtype, (N, K), seed=3).to(DEV)
    x = torch.randn(1, K, device=DEV)
    y = tk.quant.mul_mat(x, w, qtype)
    ref = matvec_q8_1_reference(tk.quant.quantize_q8_1(x)[0], *tk.quant.group_decompose(w, qtype),
                                tk.formats.GROUP_LEN[qtype])
    assert torch.equal(y[0], ref), f"{qtype}: max |diff| {(y[0] - ref).abs().max().item():.3e}"


def test_get_rows_and_quantize_q8_1(tk):
    from hanzo_torch.ops.quant import get_rows_reference, quantize_q8_1_reference
    from hanzo_torch.backends.triton._testing import random_packed

    w = random_packed("Q6_K", (VOCAB, BIG // 2), seed=4).to(DEV)
    ids = torch.randint(0, VOCAB, (4, 77), device=DEV)
    for dtype in (torch.float32, torch.bfloat16):
        assert _bits_equal(tk.quant.get_rows(w, ids, "Q6_K", dtype), get_rows_reference(w, ids, "Q6_K", dtype))
    x = torch.randn(PREFILL_M, BIG, device=DEV) * 3
    assert torch.equal(tk.quant.quantize_q8_1(x), quantize_q8_1_reference(x))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_fused_ops_real_shapes(tk, dtype):
    from hanzo_torch.ops import fused as ref

    # bf16: up to two output ulps (kernel and reference round different float32 values)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2e-2)
    x = torch.randn(PREFILL_M, BIG, device=DEV).to(dtype)
    r = torch.randn(PREFILL_M, BIG, device=DEV).to(dtype)
    w = torch.randn(BIG, device=DEV).to(dtype)
    torch.testing.assert_close(tk.fused.rms_norm(x, w, 1e-6), ref.rms_norm_reference(x, w, 1e-6), **tol)
    for a, b in zip(tk.fused.add_rms_norm(x, r, w, 1e-6), ref.add_rms_norm_reference(x, r, w, 1e-6)):
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(tk.fused.swiglu(x, r), ref.swiglu_reference(x, r), **tol)
    B, T, Hq, Hk, D = 2, SEQ, 32, 8, 128
    q = torch.randn(B, T, Hq, D, device=DEV).to(dtype)
    k = torch.randn(B, T, Hk, D, device=DEV).to(dtype)
    qw, kw = torch.randn(D, device=DEV).to(dtype), torch.randn(D, device=DEV).to(dtype)
    pos = torch.arange(T, device=DEV).repeat(B, 1) + torch.tensor([[0], [CACHE - SEQ]], device=DEV)
    for a, b in zip(tk.fused.qk_norm_rope(q, k, qw, kw, pos, 1e6, 1e-6),
                    ref.qk_norm_rope_reference(q, k, qw, kw, pos, 1e6, 1e-6)):
        torch.testing.assert_close(a, b, **tol)
    logits = torch.randn(PREFILL_M, 128, device=DEV).to(dtype)
    wt, it = tk.fused.moe_route(logits, 8, True)
    wr, ir = ref.moe_route_reference(logits, 8, True)
    assert (it == ir).float().mean() > 0.999  # exp rounding may swap near-ties
    S = CACHE
    kc = torch.randn(B, S, Hk, D, device=DEV).to(dtype)
    vc = torch.randn(B, S, Hk, D, device=DEV).to(dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    tk.fused.kv_cache_write(kc, vc, k, k, pos)
    ref.kv_cache_write_reference(kc2, vc2, k, k, pos)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    kc3, vc3, kc4, vc4 = (torch.zeros_like(kc) for _ in range(4))
    q_rot, k_rot = tk.fused.qk_norm_rope(q, k, qw, kw, pos, 1e6, 1e-6)
    tk.fused.kv_cache_write(kc4, vc4, k_rot, k, pos)
    assert torch.equal(tk.fused.qk_norm_rope_kv_write(q, k, k, qw, kw, kc3, vc3, pos, 1e6, 1e-6), q_rot)
    assert torch.equal(kc3, kc4) and torch.equal(vc3, vc4)
    for TT in (1, T):
        qq, pp = q[:, :TT], pos[:, :TT] + (S - 1 - pos[:, -1:]) * (TT == 1)
        out = tk.fused.attention(qq, kc, vc, pp, D ** -0.5, "auto")
        torch.testing.assert_close(out, ref.attention_reference(qq, kc, vc, pp, D ** -0.5, "eager"), **tol)


def test_decode_step_graph_replay_reads_device_position(tk):
    """A captured decode step (mat-vec, q/k-norm+RoPE, KV write, attention) replays at the
    position held in a device tensor, matching eager at every token (DESIGN section 4)."""
    from hanzo_torch.backends.triton._testing import random_packed

    H, Hq, Hk, D, S = 1024, 8, 2, 128, 600  # S > ATTN_SPLIT_CHUNK: the split decode is captured too
    w = random_packed("Q4_K", ((Hq + 2 * Hk) * D, H), seed=5).to(DEV)
    kc = torch.zeros(1, S, Hk, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    x = torch.randn(1, H, device=DEV, dtype=torch.bfloat16)
    pos = torch.zeros(1, 1, dtype=torch.int64, device=DEV)

    def step():
        qkv = torch.ops.hanzo.mul_mat(x, w, "Q4_K").view(1, 1, Hq + 2 * Hk, D)
        q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hk], qkv[:, :, Hq + Hk:]
        q, k = torch.ops.hanzo.qk_norm_rope(q, k, None, None, pos, 1e6, 1e-6)
        torch.ops.hanzo.kv_cache_write(kc, vc, k, v.contiguous(), pos)
        return torch.ops.hanzo.attention(q, kc, vc, pos, D ** -0.5, "auto")

    step()  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    kc.zero_(), vc.zero_()
    for t in list(range(12)) + [511, 512, 513, 599]:  # across the split boundary
        pos.fill_(t)
        x.normal_()
        g.replay()
        replayed = out.clone()
        expected = step()  # eager at the same position rewrites the same cache slot
        assert torch.equal(replayed, expected), f"graph replay diverged from eager at token {t}"
