"""The Vulkan kernels of the fused ops beyond the conformance suite's shapes: float16, every KV
cache type (f32/f16/bf16/q8_0) with every activation dtype, the key-split decode attention and
its merge, head dims and group sizes of real models, positions outside the cache, MoE routing
with ties, strided inputs, work chained on the device without a sync, and reference mode.

Oracle: ``torch.ops.hanzo_ref.<op>`` on CPU copies of the inputs; tolerance as in
tests/test_conformance.py (float32 statistics in both, one rounding to the dtype): relative
``rtol`` of the dtype and absolute ``rtol * max|ref|``. kv_cache_write is bit-exact.
Runs on lavapipe (Mesa's CPU Vulkan) in the default suite; skipped with the backend's reason
where there is no Vulkan device.
"""
from __future__ import annotations

import os

import pytest
import torch

import hanzo_torch

vulkan = pytest.importorskip("hanzo_torch.backends.vulkan")
_STATUS = vulkan.status()
pytestmark = pytest.mark.skipif(not _STATUS["available"], reason=f"no Vulkan backend: {_STATUS.get('reason')}")

DEV = "vulkan"
ref = torch.ops.hanzo_ref
ops = torch.ops.hanzo
RTOL = {torch.float32: 2e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}
CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8]  # uint8: q8_0 rows


def _g(*key) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) & 0xFFFF_FFFF)


def _close(got, want, dtype, what=""):
    rtol = RTOL[dtype]
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, what
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rtol * max(1.0, want.float().abs().max().item()),
                               msg=lambda m: f"{what}: {m}")


def _vk(*ts):
    return [t.to(DEV) for t in ts]


def _cache(B, S, Hk, D, dtype, seed):
    """A random cache of ``dtype`` (uint8: q8_0 rows of random values)."""
    x = torch.randn(B, S, Hk, D, generator=_g("cache", seed))
    if dtype == torch.uint8:
        return hanzo_torch.ops.fused.kv_to_cache(x, torch.uint8)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_norms_and_swiglu(dtype):
    x, r = torch.randn(4, 3, 1000, generator=_g(1)).to(dtype), torch.randn(4, 3, 1000, generator=_g(2)).to(dtype)
    for w in (torch.randn(1000, generator=_g(3)).to(dtype), torch.randn(1000, generator=_g(3))):  # and an f32 weight
        xv, rv, wv = _vk(x, r, w)
        _close(ops.rms_norm(xv, wv, 1e-6), ref.rms_norm(x, w, 1e-6), dtype, "rms_norm")
        y, s = ops.add_rms_norm(xv, rv, wv, 1e-5)
        ry, rs = ref.add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(s.cpu(), rs), "x + residual is one rounding of the exact sum"
        _close(y, ry, dtype, "add_rms_norm")
    _close(ops.swiglu(xv, rv), ref.swiglu(x, r), dtype, "swiglu")
    # a strided view (every other row)
    _close(ops.rms_norm(xv[:, ::2], wv, 1e-6), ref.rms_norm(x[:, ::2], w, 1e-6), dtype, "rms_norm of a view")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_qk_norm_rope(dtype):
    B, T, Hq, Hk, D = 2, 3, 4, 2, 128
    q = torch.randn(B, T, Hq, D, generator=_g(4)).to(dtype)
    k = torch.randn(B, T, Hk, D, generator=_g(5)).to(dtype)
    qw, kw = torch.randn(D, generator=_g(6)).to(dtype), torch.randn(D, generator=_g(7)).to(dtype)
    # positions of a long context too: the angles reach 3e4 radians
    for pos in (torch.tensor([[0, 1, 2], [7, 8, 9]]), torch.tensor([[30000, 30001, 30002], [5, 40000, 12345]])):
        for weights in ((qw, kw), (None, None)):
            for p in (pos, pos.int()):
                args = (q, k, *weights, p, 1e6, 1e-6)
                got = ops.qk_norm_rope(*[a.to(DEV) if a is not None else None for a in args[:5]], 1e6, 1e-6)
                for a, b in zip(got, ref.qk_norm_rope(*args)):
                    _close(a, b, dtype, f"qk_norm_rope weights={weights[0] is not None} pos={p.dtype}")


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_kv_cache_write_exact(cache_dtype):
    B, S, Hk, D, T = 2, 10, 2, 64, 3
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        k = torch.randn(B, T, Hk, D, generator=_g(8)).to(dtype) * 3
        v = torch.randn(B, T, Hk, D, generator=_g(9)).to(dtype)
        k[0, 0, 0, :32] = 0  # an all-zero q8_0 block (scale 0)
        pos = torch.tensor([[0, 4, 9], [2, 3, 1]])
        kc, vc = _cache(B, S, Hk, D, cache_dtype, 1), _cache(B, S, Hk, D, cache_dtype, 2)
        kcv, vcv = _vk(kc, vc)
        ops.kv_cache_write(kcv, vcv, *_vk(k, v, pos))
        ref.kv_cache_write(kc, vc, k, v, pos)
        assert torch.equal(kcv.cpu(), kc) and torch.equal(vcv.cpu(), vc), f"{dtype} into {cache_dtype}"
        # a position outside [0, S) writes nothing (the device does not raise)
        before = kcv.cpu()
        ops.kv_cache_write(kcv, vcv, *_vk(k[:, :1], v[:, :1], torch.tensor([[S], [-1]])))
        assert torch.equal(kcv.cpu(), before)


def _attention_case(B, T, Hq, Hk, D, S, dtype, cache_dtype, pos, seed):
    q = torch.randn(B, T, Hq, D, generator=_g("q", seed)).to(dtype)
    kc, vc = _cache(B, S, Hk, D, cache_dtype, seed), _cache(B, S, Hk, D, cache_dtype, seed + 1)
    got = ops.attention(*_vk(q, kc, vc, pos), D ** -0.5, "auto")
    return got, (q, kc, vc)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_attention_cache_types(dtype, cache_dtype):
    # decode against a long cache (the key split and its merge) and a prompt (one pass per token)
    for B, T, Hq, Hk, D, S, pos in ((2, 1, 8, 2, 64, 300, torch.tensor([[250], [70]])),
                                    (1, 5, 4, 1, 32, 40, torch.tensor([[0, 1, 2, 30, 39]]))):
        got, (q, kc, vc) = _attention_case(B, T, Hq, Hk, D, S, dtype, cache_dtype, pos, seed=T)
        _close(got, ref.attention(q, kc, vc, pos, D ** -0.5, "flash"), dtype, f"T={T} {dtype} cache {cache_dtype}")


@pytest.mark.parametrize("Hq,Hk,D", [(16, 1, 128), (8, 1, 256), (12, 2, 128), (3, 3, 96)])
def test_attention_shapes(Hq, Hk, D):
    """Group sizes and head dims of real models: G up to 16, D up to 256 (several columns per invocation)."""
    for T, S, pos in ((1, 130, torch.tensor([[129]])), (3, 20, torch.tensor([[5, 6, 19]]))):
        got, (q, kc, vc) = _attention_case(1, T, Hq, Hk, D, S, torch.float32, torch.float32, pos, seed=D)
        _close(got, ref.attention(q, kc, vc, pos, D ** -0.5, "eager"), torch.float32, f"Hq={Hq} Hk={Hk} D={D} T={T}")


@pytest.mark.parametrize("Hq,Hk,D", [(16, 1, 128), (8, 1, 256), (12, 2, 128), (3, 3, 96)])
def test_attention_prefill_tiles(Hq, Hk, D):
    """Prompts of 8 tokens or more take the tiled kernel (blocks of query tokens sharing each key
    tile): a prompt continuing at position 10, two sequences of which one starts later, the last
    block ragged; a position >= S sees the whole cache, a negative one nothing."""
    T, S = 21, 40
    pos = torch.stack([torch.arange(10, 10 + T), torch.arange(-3, T - 3)])
    pos[1, -1] = S + 7
    got, (q, kc, vc) = _attention_case(2, T, Hq, Hk, D, S, torch.float32, torch.float32, pos, seed=D + 1)
    want = ref.attention(q, kc, vc, pos.clamp(0, S - 1), D ** -0.5, "eager")
    want[1, :3] = 0.0  # negative positions see no key
    _close(got, want, torch.float32, f"Hq={Hq} Hk={Hk} D={D}")


def test_attention_positions_outside_the_cache():
    """On the device a position >= S sees the whole cache and a negative one nothing (zeros)."""
    B, Hq, Hk, D, S = 2, 4, 2, 32, 16
    got, (q, kc, vc) = _attention_case(B, 1, Hq, Hk, D, S, torch.float32, torch.float32,
                                       torch.tensor([[S + 5], [-1]]), seed=3)
    want = ref.attention(q[:1], kc[:1], vc[:1], torch.tensor([[S - 1]]), D ** -0.5, "eager")
    _close(got[:1], want, torch.float32, "position >= S")
    assert torch.equal(got[1].cpu(), torch.zeros_like(q[1]))


def test_chained_on_the_device():
    """norm -> rope -> cache write -> attention recorded back to back, read once at the end."""
    B, T, Hq, Hk, D, S = 1, 4, 4, 2, 64, 32
    x = torch.randn(B, T, Hq * D, generator=_g(10))
    qw, kw = torch.randn(D, generator=_g(11)), torch.randn(D, generator=_g(12))
    pos = torch.tensor([[3, 4, 5, 6]])
    kc = torch.zeros(B, S, Hk, D, dtype=torch.float16)

    def step(o, x, qw, kw, pos, kc, vc):
        h = o.rms_norm(x, torch.ones(Hq * D, device=x.device), 1e-6).view(B, T, Hq, D)
        q, k = o.qk_norm_rope(h, h[:, :, :Hk].contiguous(), qw, kw, pos, 1e4, 1e-6)
        o.kv_cache_write(kc, vc, k, k, pos)
        return o.attention(q, kc, vc, pos, D ** -0.5, "eager")

    got = step(ops, *_vk(x, qw, kw, pos, kc, kc.clone()))
    want = step(ref, x, qw, kw, pos, kc, kc.clone())
    _close(got, want, torch.float32, "chained")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_moe_route(dtype):
    logits = torch.randn(9, 128, generator=_g(13)).to(dtype)
    logits[0, :] = 0.5  # all tied: experts 0..k-1
    logits[1, 10:20] = 4.0  # a tie among the top
    logits[2, 7] = float("nan")  # NaN sorts first, as torch.sort puts it
    for k, normalize in ((8, True), (1, False), (128, True)):
        w, ids = ops.moe_route(logits.to(DEV), k, normalize)
        rw, rids = ref.moe_route(logits, k, normalize)
        assert torch.equal(ids.cpu(), rids), f"k={k}"
        torch.testing.assert_close(w.cpu(), rw, rtol=2e-5, atol=2e-6, equal_nan=True)


def test_reference_mode_and_errors():
    """Reference mode reaches the Vulkan kernels (the redirect registered on PrivateUse1 in front
    of them: the reference's torch ops run, not the one dispatch), and bad arguments raise the
    reference's errors."""
    from hanzo_torch.ops import _dispatch

    x, w = torch.randn(3, 64, generator=_g(14)), torch.randn(64, generator=_g(15))
    xv, wv = _vk(x, w)
    ops.rms_norm(xv, wv, 1e-6)
    assert "PrivateUse1" in _dispatch._KEYS
    vulkan.synchronize()
    vulkan.set_profiling(True)
    try:
        counts = []
        for mode in (False, True, False):
            vulkan.profile()
            if mode:
                with hanzo_torch.ops.use_reference("rms_norm"):
                    y = ops.rms_norm(xv, wv, 1e-6)  # the reference, on vulkan tensors
            else:
                ops.rms_norm(xv, wv, 1e-6)
            vulkan.synchronize()
            counts.append(vulkan.profile()["dispatches"])
    finally:
        vulkan.set_profiling(os.environ.get("HANZO_VK_PROFILE", "") not in ("", "0"))
    assert counts[0] == counts[2] == 1 and counts[1] > 1, counts
    assert y.device.type == DEV
    _close(y, ref.rms_norm(x, w, 1e-6), torch.float32, "rms_norm in reference mode")
    with pytest.raises(ValueError, match="w must be"):
        ops.rms_norm(xv, wv[:10], 1e-6)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ops.attention(*_vk(torch.randn(1, 1, 3, 32), torch.zeros(1, 4, 2, 32), torch.zeros(1, 4, 2, 32),
                           torch.tensor([[0]])), 0.1, "eager")


def test_qk_norm_rope_kv_write_one_dispatch_and_reference_mode():
    """Natively one dispatch (the two ops it replaces are two); reference mode of the op, or of
    either of its parts (``HANZO_QK_NORM_ROPE_FALLBACK`` / ``HANZO_KV_CACHE_WRITE_FALLBACK`` keep
    their meaning in the model), runs the torch reference on the device instead: the same q and
    the same v rows, k rows within one bf16 rounding."""
    import os

    B, T, Hq, Hk, D, S = 1, 1, 4, 2, 128, 8
    q, k, v = (torch.randn(B, T, h, D, generator=_g("qkkv", h, i)) for i, h in enumerate((Hq, Hk, Hk)))
    qw, kw = torch.randn(D, generator=_g("qkkvw", 0)), torch.randn(D, generator=_g("qkkvw", 1))
    pos = torch.tensor([[5]])
    caches0 = [_cache(B, S, Hk, D, torch.bfloat16, s) for s in (30, 31)]
    vulkan.synchronize()
    vulkan.set_profiling(True)
    try:
        results = {}
        for mode in (None, "qk_norm_rope_kv_write", "qk_norm_rope", "kv_cache_write"):
            kc, vc = _vk(*caches0)
            args = _vk(q, k, v, qw, kw)
            vulkan.synchronize()
            vulkan.profile()
            if mode is None:
                qo = ops.qk_norm_rope_kv_write(*args, kc, vc, pos.to(DEV), 1e6, 1e-6)
            else:
                with hanzo_torch.ops.use_reference(mode):
                    qo = ops.qk_norm_rope_kv_write(*args, kc, vc, pos.to(DEV), 1e6, 1e-6)
            vulkan.synchronize()
            results[mode] = (vulkan.profile()["dispatches"], qo.cpu(), kc.cpu(), vc.cpu())
    finally:
        vulkan.set_profiling(os.environ.get("HANZO_VK_PROFILE", "") not in ("", "0"))
    assert results[None][0] == 1
    for mode in ("qk_norm_rope_kv_write", "qk_norm_rope", "kv_cache_write"):
        n, qo, kc, vc = results[mode]
        assert n > 3, (mode, n)  # the reference's torch ops
        _close(results[None][1], qo, torch.float32, mode)
        _close(results[None][2], kc, torch.bfloat16, mode)
        assert torch.equal(results[None][3], vc), mode
        assert torch.equal(kc[:, :5], caches0[0][:, :5]) and not torch.equal(kc[:, 5], caches0[0][:, 5])
