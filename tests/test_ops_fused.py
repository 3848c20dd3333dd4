"""Gates for the fused ops: opcheck, the references against textbook float64 compositions, fake
kernels, fallback toggles.

The numeric tests here hold the references (``torch.ops.hanzo_ref``) to independent float64
oracles (softmax/top-k, rms, NEOX RoPE, SDPA with a position mask); every backend kernel is held
to the references in tests/test_conformance.py, which also checks the bad-argument errors of
every backend against the reference's.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import hanzo_torch  # noqa: F401  registers torch.ops.hanzo
import hanzo_torch
from hanzo_torch.ops import fused

ops = torch.ops.hanzo
R = torch.ops.hanzo_ref  # the numeric tests gate the references themselves
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# f32 oracles differ from the fused op only by float32 rounding order.
F32_TOL = dict(rtol=1e-5, atol=1e-5)


def _tol(dtype):
    return F32_TOL if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------ opcheck
def _opcheck_cases():
    g = _gen(1)
    B, T, Hq, Hk, D, S = 2, 3, 4, 2, 16, 8
    q = torch.randn(B, T, Hq, D, generator=g)
    k = torch.randn(B, T, Hk, D, generator=g)
    pos = torch.tensor([[0, 1, 2], [3, 4, 5]])
    yield "moe_route", (torch.randn(5, 8, generator=g), 2, True)
    yield "rms_norm", (torch.randn(3, 32, generator=g), torch.randn(32, generator=g), 1e-6)
    yield "add_rms_norm", (torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g), torch.randn(32, generator=g), 1e-6)
    yield "qk_norm_rope", (q, k, torch.randn(D, generator=g), torch.randn(D, generator=g), pos, 10000.0, 1e-6)
    yield "qk_norm_rope", (q, k, None, None, pos, 1e6, 1e-6)
    yield "swiglu", (torch.randn(4, 24, generator=g), torch.randn(4, 24, generator=g))
    yield "kv_cache_write", (torch.zeros(B, S, Hk, D), torch.zeros(B, S, Hk, D), k, torch.randn(B, T, Hk, D, generator=g), pos)
    v = torch.randn(B, T, Hk, D, generator=g)
    yield "qk_norm_rope_kv_write", (q, k, v, torch.randn(D, generator=g), torch.randn(D, generator=g),
                                    torch.zeros(B, S, Hk, D, dtype=torch.float16),
                                    torch.zeros(B, S, Hk, D, dtype=torch.float16), pos, 1e6, 1e-6)
    kc, vc = torch.randn(B, S, Hk, D, generator=g), torch.randn(B, S, Hk, D, generator=g)
    for impl in ("eager", "flash", "auto"):
        yield "attention", (q, kc, vc, pos, 0.25, impl)


@pytest.mark.parametrize("name,args", list(_opcheck_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(name, args):
    torch.library.opcheck(getattr(ops, name).default, args)


# ------------------------------------------------------------------------------------------ moe_route
def test_moe_route_numeric():
    g = _gen(2)
    T, E, k = 64, 16, 4
    logits = torch.randn(T, E, generator=g)
    for normalize in (False, True):
        w, ids = R.moe_route(logits, k, normalize)
        assert w.dtype == torch.float32 and ids.dtype == torch.int64
        probs = torch.softmax(logits.double(), -1)
        ref_w, ref_ids = probs.topk(k, dim=-1)  # no ties in random logits
        if normalize:
            ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w.double(), ref_w, rtol=1e-6, atol=1e-7)


def test_moe_route_ties_go_to_lower_index():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    _, ids = R.moe_route(logits, 2, True)
    assert ids.tolist() == [[1, 2], [0, 1]]


def test_moe_route_bf16_logits_softmax_in_f32():
    logits = torch.randn(8, 6, generator=_gen(3)).bfloat16()
    w, ids = R.moe_route(logits, 3, False)
    ref = torch.softmax(logits.float(), -1).gather(1, ids)
    torch.testing.assert_close(w, ref, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ norms
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_numeric(dtype):
    g = _gen(4)
    x = (torch.randn(2, 5, 64, generator=g) * 3).to(dtype)
    w = torch.randn(64, generator=g).to(dtype)
    eps = 1e-6
    xd = x.double()
    ref = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    out = R.rms_norm(x, w, eps)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), ref, **_tol(dtype))
    if dtype == torch.float32:  # unfused torch composition in the same precision
        torch.testing.assert_close(out, F.rms_norm(x, (64,), w, eps), **F32_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_numeric(dtype):
    g = _gen(5)
    x = torch.randn(3, 48, generator=g).to(dtype)
    r = torch.randn(3, 48, generator=g).to(dtype)
    w = torch.randn(48, generator=g).to(dtype)
    normed, s = R.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r)
    torch.testing.assert_close(normed, R.rms_norm(x + r, w, 1e-5), rtol=0, atol=0)
    sd = (x + r).double()
    ref = sd / torch.sqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(normed.double(), ref, **_tol(dtype))


# ------------------------------------------------------------------------------------------ rope
def _rope_unfused(x, pos, theta):
    """Textbook NEOX RoPE in float64: rotate (x_i, x_{i+D/2}) by pos * theta^(-2i/D)."""
    D = x.shape[-1]
    half = D // 2
    i = torch.arange(half, dtype=torch.float64)
    ang = pos.double()[..., None, None] * theta ** (-2 * i / D)  # [B, T, 1, half]
    a, b = x[..., :half].double(), x[..., half:].double()
    return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1)


@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_numeric(with_norm, dtype):
    g = _gen(6)
    B, T, Hq, Hk, D = 2, 5, 4, 2, 32
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, T, Hk, D, generator=g).to(dtype)
    pos = torch.randint(0, 3000, (B, T), generator=g)
    qw = torch.randn(D, generator=g).to(dtype) if with_norm else None
    kw = torch.randn(D, generator=g).to(dtype) if with_norm else None
    theta, eps = 1e6, 1e-6
    qo, ko = R.qk_norm_rope(q, k, qw, kw, pos, theta, eps)
    qr, kr = q.double(), k.double()
    if with_norm:
        qr = qr / torch.sqrt(qr.pow(2).mean(-1, keepdim=True) + eps) * qw.double()
        kr = kr / torch.sqrt(kr.pow(2).mean(-1, keepdim=True) + eps) * kw.double()
    # float32 angles at positions up to 3000 carry ~3000 * 6e-8 rad of rounding: 1e-3 bounds it.
    tol = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(qo.double(), _rope_unfused(qr, pos, theta), **tol)
    torch.testing.assert_close(ko.double(), _rope_unfused(kr, pos, theta), **tol)


def test_qk_norm_rope_position_zero_is_identity_and_norm_preserving():
    g = _gen(7)
    q = torch.randn(1, 2, 2, 8, generator=g)
    k = torch.randn(1, 2, 1, 8, generator=g)
    qo, ko = R.qk_norm_rope(q, k, None, None, torch.tensor([[0, 7]]), 10000.0, 1e-6)
    torch.testing.assert_close(qo[:, 0], q[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(qo.norm(dim=-1), q.norm(dim=-1))
    assert not torch.allclose(qo[:, 1], q[:, 1])


# ------------------------------------------------------------------------------------------ swiglu
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_numeric(dtype):
    g = _gen(8)
    gate = (torch.randn(4, 100, generator=g) * 4).to(dtype)
    up = torch.randn(4, 100, generator=g).to(dtype)
    ref = gate.double() / (1 + torch.exp(-gate.double())) * up.double()
    out = R.swiglu(gate, up)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, **_tol(dtype))


# ------------------------------------------------------------------------------------------ kv cache
def test_kv_cache_write_numeric():
    g = _gen(9)
    B, S, Hk, D, T = 2, 10, 2, 4, 3
    kc, vc = torch.zeros(B, S, Hk, D), torch.zeros(B, S, Hk, D)
    k, v = torch.randn(B, T, Hk, D, generator=g), torch.randn(B, T, Hk, D, generator=g)
    pos = torch.tensor([[2, 3, 4], [0, 5, 9]])
    R.kv_cache_write(kc, vc, k, v, pos)
    ek, ev = torch.zeros_like(kc), torch.zeros_like(vc)
    for b in range(B):
        for t in range(T):
            ek[b, pos[b, t]] = k[b, t]
            ev[b, pos[b, t]] = v[b, t]
    assert torch.equal(kc, ek) and torch.equal(vc, ev)


# ------------------------------------------------------------------------------------------ attention
def _sdpa_reference(q, kc, vc, pos, scale):
    """torch SDPA in float64 with an explicit position mask and repeated KV heads."""
    B, T, Hq, D = q.shape
    S, Hk = kc.shape[1], kc.shape[2]
    G = Hq // Hk
    qq = q.double().transpose(1, 2)
    kk = kc.double().repeat_interleave(G, dim=2).transpose(1, 2)
    vv = vc.double().repeat_interleave(G, dim=2).transpose(1, 2)
    mask = torch.arange(S)[None, None, :] <= pos[:, :, None]  # [B, T, S]
    out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("impl", ["eager", "flash", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_numeric(impl, dtype, monkeypatch):
    monkeypatch.setattr(fused, "FLASH_BLOCK", 16)  # several online-softmax steps at test size
    g = _gen(10)
    B, T, Hq, Hk, D, S = 2, 5, 8, 2, 32, 50
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    kc = torch.randn(B, S, Hk, D, generator=g).to(dtype)
    vc = torch.randn(B, S, Hk, D, generator=g).to(dtype)
    pos = torch.tensor([[10, 11, 12, 13, 14], [40, 41, 42, 43, 44]])
    kc[0, 15:] = 1e4  # garbage past the visible slots must not leak in
    out = R.attention(q, kc, vc, pos, 1 / math.sqrt(D), impl)
    assert out.dtype == dtype and out.shape == q.shape
    ref = _sdpa_reference(q, kc, vc, pos, 1 / math.sqrt(D))
    torch.testing.assert_close(out.double(), ref, **_tol(dtype))


def test_attention_decode_matches_prefill():
    g = _gen(11)
    B, T, Hq, Hk, D, S = 1, 6, 4, 4, 16, 8
    q = torch.randn(B, T, Hq, D, generator=g)
    kc, vc = torch.randn(B, S, Hk, D, generator=g), torch.randn(B, S, Hk, D, generator=g)
    pos = torch.arange(T)[None]
    full = R.attention(q, kc, vc, pos, 0.25, "eager")
    for t in range(T):
        one = R.attention(q[:, t:t + 1], kc, vc, pos[:, t:t + 1], 0.25, "flash")
        torch.testing.assert_close(one, full[:, t:t + 1], **F32_TOL)


# ------------------------------------------------------------------------------------------ fake kernels
def test_fake_kernels_check_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 8)
        with pytest.raises(ValueError, match="rms_norm"):
            ops.rms_norm(x, torch.empty(7), 1e-6)
        w, ids = ops.moe_route(torch.empty(5, 8), 3, True)
        assert w.shape == (5, 3) and ids.dtype == torch.int64
        q, k, kc = torch.empty(1, 2, 4, 16), torch.empty(1, 2, 2, 16), torch.empty(1, 8, 2, 16)
        pos = torch.zeros(1, 2, dtype=torch.int64)
        assert ops.qk_norm_rope_kv_write(q, k, k, None, None, kc, kc.clone(), pos, 1e4, 1e-6).shape == q.shape
        with pytest.raises(ValueError, match="qk_norm_rope_kv_write: k .* does not fit"):
            ops.qk_norm_rope_kv_write(q, k, k, None, None, kc[:, :, :1], kc[:, :, :1].clone(), pos, 1e4, 1e-6)


# ------------------------------------------------------------------------------------------ fallback
def test_reference_mode_selects_reference():
    a = torch.randn(3, 4, dtype=torch.bfloat16)
    with hanzo_torch.ops.use_reference("swiglu"):
        assert hanzo_torch.ops.reference_enabled("swiglu")
        assert torch.equal(ops.swiglu(a, a), fused.swiglu_reference(a, a))
    assert not hanzo_torch.ops.reference_enabled("swiglu")


def test_fallback_env_is_read_at_import():
    import subprocess
    import sys

    code = ("import hanzo_torch, torch; print(hanzo_torch.ops.reference_enabled('swiglu'), "
            "hanzo_torch.ops.reference_enabled('rms_norm'), torch.ops.hanzo.swiglu(torch.ones(3), torch.ones(3)).tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "HANZO_SWIGLU_FALLBACK": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True False [0.731")
