"""C++ CPU kernels of the fused ops (csrc/cpu/fused.cpp) against the torch references.

Tolerances: float32 results must agree with the reference to rtol=1e-5, atol=1e-5 (scaled by the
output's magnitude; summation order, exact vs online softmax and libm differ). bf16/f16 results
may differ by one rounding of the dtype (rtol/atol 1.6e-2 for bf16, 2e-3 for f16). The tests
show that a real bug (an off-by-one position, a wrong KV head, a missing weight) misses the
float32 tolerance by more than 100x.
"""
from __future__ import annotations

import math

import pytest
import torch

import hanzo_torch  # noqa: F401  registers torch.ops.hanzo.*
import hanzo_torch
from hanzo_torch.backends import cpu as hcpu
from hanzo_torch.ops import fused as ref
from hanzo_torch.backends.cpu import fused as cf

pytestmark = pytest.mark.skipif(not hcpu.available(), reason="C++ CPU extension could not be built")

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


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


@pytest.fixture
def both_paths(monkeypatch):
    """Yields a function running a torch.ops.hanzo op with the C++ kernel and with the reference."""

    def run(op, fn):
        with hanzo_torch.ops.use_reference(op, enabled=False):
            fast = fn()
        assert op in hanzo_torch.backends.activate("cpu")  # the C++ kernel is the CPU kernel of the op
        with hanzo_torch.ops.use_reference(op):
            slow = fn()
        return fast, slow

    return run


# ------------------------------------------------------------------------------------ norms
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1536), (3, 5, 67), (2, 1), (0, 8)])
def test_rms_norm(dtype, shape):
    x = (torch.randn(shape, generator=g()) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g(1)).to(dtype)
    close(cf.rms_norm(x, w, 1e-6), ref.rms_norm_reference(x, w, 1e-6), dtype)


def test_rms_norm_large_parallel_and_noncontiguous():
    x = torch.randn(300, 2048, generator=g())[:, ::2]  # non-contiguous, 300 * 1024 floats: threaded
    w = torch.randn(1024, generator=g(1))
    close(cf.rms_norm(x, w, 1e-5), ref.rms_norm_reference(x, w, 1e-5), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype, both_paths):
    x = torch.randn(2, 3, 129, generator=g()).to(dtype)
    r = torch.randn(2, 3, 129, generator=g(1)).to(dtype)
    w = torch.randn(129, generator=g(2)).to(dtype)
    (y, s), (y0, s0) = both_paths("add_rms_norm", lambda: torch.ops.hanzo.add_rms_norm(x, r, w, 1e-6))
    assert torch.equal(s, s0)  # the sum is one rounding of x + residual in either path
    close(y, y0, dtype)


def test_norm_bug_would_be_caught():
    x = torch.randn(4, 256, generator=g())
    w = torch.randn(256, generator=g(1))
    good = ref.rms_norm_reference(x, w, 1e-6)
    assert err(cf.rms_norm(x, w, 1e-6), good) < 1e-6
    # forgetting eps is below tolerance; using sum instead of mean, or dropping w, is not
    assert err(x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6) * w, good) > 100 * 1e-5
    assert err(ref.rms_norm_reference(x, torch.ones(256), 1e-6), good) > 100 * 1e-5


# ------------------------------------------------------------------------------------ swiglu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8960), (3, 7, 33), (200, 1001)])
def test_swiglu(dtype, shape, both_paths):
    a = (torch.randn(shape, generator=g()) * 4).to(dtype)
    b = torch.randn(shape, generator=g(1)).to(dtype)
    fast, slow = both_paths("swiglu", lambda: torch.ops.hanzo.swiglu(a, b))
    close(fast, slow, dtype)


# ------------------------------------------------------------------------------------ qk_norm_rope
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("B,T,Hq,Hk,D", [(1, 1, 12, 2, 128), (2, 5, 6, 3, 10), (1, 70, 4, 1, 64)])
def test_qk_norm_rope(dtype, with_norm, B, T, Hq, Hk, D, both_paths):
    q = torch.randn(B, T, Hq, D, generator=g()).to(dtype)
    k = torch.randn(B, T, Hk, D, generator=g(1)).to(dtype)
    qw = kw = None
    if with_norm:
        qw, kw = torch.randn(D, generator=g(2)).to(dtype), torch.randn(D, generator=g(3)).to(dtype)
    pos = torch.randint(0, 5000, (B, T), generator=g(4), dtype=torch.int32)
    (q1, k1), (q0, k0) = both_paths(
        "qk_norm_rope", lambda: torch.ops.hanzo.qk_norm_rope(q, k, qw, kw, pos, 1e6, 1e-6))
    close(q1, q0, dtype)
    close(k1, k0, dtype)


def test_rope_off_by_one_position_is_caught():
    q = torch.randn(1, 4, 2, 64, generator=g())
    k = torch.randn(1, 4, 2, 64, generator=g(1))
    pos = torch.tensor([[3, 10, 11, 12]])
    q1, _ = cf.qk_norm_rope(q, k, None, None, pos, 10000.0, 1e-6)
    q0, _ = ref.qk_norm_rope_reference(q, k, None, None, pos, 10000.0, 1e-6)
    qb, _ = ref.qk_norm_rope_reference(q, k, None, None, pos + 1, 10000.0, 1e-6)
    assert err(q1, q0) < 1e-5
    assert err(q1, qb) > 100 * 1e-5


# ------------------------------------------------------------------------------------ kv_cache_write
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_cache_write(dtype, both_paths):
    B, S, Hk, D, T = 2, 17, 3, 8, 4
    kc0 = torch.randn(B, S, Hk, D, generator=g()).to(dtype)
    vc0 = torch.randn(B, S, Hk, D, generator=g(1)).to(dtype)
    k = torch.randn(B, T, Hk, D, generator=g(2)).to(dtype)
    v = torch.randn(B, T, Hk, D, generator=g(3)).to(dtype)
    pos = torch.tensor([[0, 1, 2, 16], [9, 5, 7, 3]])
    caches = []

    def run():
        kc, vc = kc0.clone(), vc0.clone()
        torch.ops.hanzo.kv_cache_write(kc, vc, k, v, pos)
        caches.append((kc, vc))
        return kc, vc

    (kc1, vc1), (kc2, vc2) = both_paths("kv_cache_write", run)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)
    assert torch.equal(kc1[1, 5], k[1, 1]) and torch.equal(vc1[0, 16], v[0, 3])
    assert torch.equal(kc1[0, 3], kc0[0, 3])  # untouched slot


def test_kv_cache_write_rejects_out_of_range():
    kc = torch.zeros(1, 4, 1, 2)
    with pytest.raises(RuntimeError, match="outside"):
        cf.kv_cache_write(kc, kc.clone(), torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), torch.tensor([[4]]))
    with pytest.raises(ValueError, match="positions must be in"):
        torch.ops.hanzo.kv_cache_write(kc, kc.clone(), torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2),
                                       torch.tensor([[-1]]))


# ------------------------------------------------------------------------------------ attention
def _attn_inputs(B, T, Hq, Hk, D, S, dtype, positions):
    q = torch.randn(B, T, Hq, D, generator=g()).to(dtype)
    kc = torch.randn(B, S, Hk, D, generator=g(1)).to(dtype)
    vc = torch.randn(B, S, Hk, D, generator=g(2)).to(dtype)
    return q, kc, vc, torch.as_tensor(positions)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [
    # decode: T=1, GQA 12/2, two batches at different lengths
    dict(B=2, T=1, Hq=12, Hk=2, D=128, S=300, positions=[[37], [299]]),
    # prefill: T=9 from position 0, odd head dim, GQA 6/3
    dict(B=1, T=9, Hq=6, Hk=3, D=10, S=16, positions=[list(range(9))]),
    # chunked prefill continuing at position 20, MHA
    dict(B=2, T=5, Hq=2, Hk=2, D=16, S=40, positions=[[20, 21, 22, 23, 24], [0, 1, 2, 3, 4]]),
])
def test_attention(dtype, case, both_paths):
    q, kc, vc, pos = _attn_inputs(dtype=dtype, **case)
    scale = 1 / math.sqrt(case["D"])
    for impl in ("auto", "eager", "flash"):
        fast, slow = both_paths("attention", lambda: torch.ops.hanzo.attention(q, kc, vc, pos, scale, impl))
        close(fast, slow, dtype)


def test_attention_large_prefill_threaded():
    q, kc, vc, pos = _attn_inputs(1, 64, 8, 2, 64, 128, torch.float32, [list(range(30, 94))])
    close(cf.attention(q, kc, vc, pos, 0.125), ref.attention_reference(q, kc, vc, pos, 0.125, "eager"), torch.float32)


def test_attention_ignores_slots_past_position():
    q, kc, vc, pos = _attn_inputs(1, 1, 4, 2, 8, 32, torch.float32, [[5]])
    out = cf.attention(q, kc, vc, pos, 0.3)
    kc[:, 6:] = float("nan")
    vc[:, 6:] = 1e30
    assert torch.equal(cf.attention(q, kc, vc, pos, 0.3), out)


def test_attention_bugs_are_caught():
    q, kc, vc, pos = _attn_inputs(1, 3, 4, 2, 32, 20, torch.float32, [[4, 5, 6]])
    good = ref.attention_reference(q, kc, vc, pos, 0.5, "eager")
    assert err(cf.attention(q, kc, vc, pos, 0.5), good) < 1e-5
    # one key too many (position + 1) and the wrong KV head per group both miss by > 100x
    assert err(ref.attention_reference(q, kc, vc, pos + 1, 0.5, "eager"), good) > 100 * 1e-5
    swapped = ref.attention_reference(q, kc.flip(2), vc.flip(2), pos, 0.5, "eager")
    assert err(swapped, good) > 100 * 1e-5


# Prefill-sized calls (T >= 8) run the tiled GEMM path: rows of G heads x Tq tokens per tile,
# keys up to the tile's largest position, masked per row. These cover several tiles, a ragged
# last tile, GQA, batches at different offsets and positions out of order.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [
    # long prompt from position 0, GQA 12/2 (Tq = 16 tokens per tile: 7 tiles, the last ragged)
    dict(B=1, T=100, Hq=12, Hk=2, D=64, S=128, positions=[list(range(100))]),
    # chunked prefill: batch 0 continues at 50, batch 1 starts at 0 with its tokens out of order
    dict(B=2, T=40, Hq=4, Hk=1, D=32, S=96,
         positions=[list(range(50, 90)), torch.randperm(40, generator=torch.Generator().manual_seed(3)).tolist()]),
])
def test_attention_prefill_tiles(dtype, case, both_paths):
    q, kc, vc, pos = _attn_inputs(dtype=dtype, **case)
    scale = 1 / math.sqrt(case["D"])
    for impl in ("eager", "flash"):
        fast, slow = both_paths("attention", lambda: torch.ops.hanzo.attention(q, kc, vc, pos, scale, impl))
        close(fast, slow, dtype)


def test_attention_prefill_under_inference_mode():
    # the model runs under torch.inference_mode: the tiles' pool threads must see it too
    q, kc, vc, pos = _attn_inputs(1, 128, 8, 2, 64, 128, torch.float32, [list(range(128))])
    expect = ref.attention_reference(q, kc, vc, pos, 0.125, "eager")
    with torch.inference_mode():
        q, kc, vc = q.clone(), kc.clone(), vc.clone()
        out = torch.ops.hanzo.attention(q, kc, vc, pos, 0.125, "auto")
    assert err(out, expect) < 1e-5


def test_attention_prefill_matches_token_by_token():
    # the tiled path (T tokens at once) against the per-row path (one decode call per token)
    q, kc, vc, pos = _attn_inputs(1, 24, 6, 2, 16, 40, torch.float32, [list(range(10, 34))])
    full = cf.attention(q, kc, vc, pos, 0.25)
    rows = torch.cat([cf.attention(q[:, t:t + 1], kc, vc, pos[:, t:t + 1], 0.25) for t in range(24)], dim=1)
    assert err(full, rows) < 1e-5


def test_attention_prefill_ignores_slots_past_position():
    # the tile reads keys up to its largest position: each row must still stop at its own
    q, kc, vc, pos = _attn_inputs(1, 16, 4, 2, 8, 32, torch.float32, [list(range(16))])
    out = cf.attention(q, kc, vc, pos, 0.3)
    assert err(out, ref.attention_reference(q, kc, vc, pos, 0.3, "eager")) < 1e-5
    # an off-by-one mask (keys 0..position+1) misses by > 100x the tolerance
    assert err(ref.attention_reference(q, kc, vc, pos + 1, 0.3, "eager"), out) > 100 * 1e-5
    kc[:, 16:] = float("nan")
    vc[:, 16:] = 1e30
    assert torch.equal(cf.attention(q, kc, vc, pos, 0.3), out)


def test_attention_rejects_out_of_range():
    q, kc, vc, _ = _attn_inputs(1, 1, 2, 1, 4, 8, torch.float32, [[0]])
    with pytest.raises(RuntimeError, match="outside"):
        cf.attention(q, kc, vc, torch.tensor([[8]]), 1.0)


# ------------------------------------------------------------------------------------ moe_route
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalize", [False, True])
def test_moe_route(dtype, normalize, both_paths):
    logits = (torch.randn(37, 60, generator=g()) * 3).to(dtype)
    logits[0, :] = 0.5  # all tied: ids 0..k-1
    logits[1, 10] = logits[1, 3] = 100.0  # tie at the top: 3 before 10
    logits[2, 7] = float("nan")  # a NaN row: every probability NaN, ids in index order
    (w1, i1), (w0, i0) = both_paths("moe_route", lambda: torch.ops.hanzo.moe_route(logits, 4, normalize))
    assert torch.equal(i1, i0)
    assert i1[0].tolist() == [0, 1, 2, 3] and i1[1, :2].tolist() == [3, 10]
    assert i1[2].tolist() == [0, 1, 2, 3] and torch.isnan(w1[2]).all()
    torch.testing.assert_close(w1, w0, rtol=1e-6, atol=0, equal_nan=True)
    if not normalize:
        assert torch.equal(w1.nan_to_num(), w0.nan_to_num())  # same softmax: bit-identical


def test_fallback_when_extension_missing(monkeypatch):
    monkeypatch.setattr(cf, "_kernel", lambda name: None)
    x = torch.randn(3, 16, generator=g())
    w = torch.randn(16, generator=g(1))
    assert torch.equal(cf.rms_norm(x, w, 1e-6), ref.rms_norm_reference(x, w, 1e-6))


