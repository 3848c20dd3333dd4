"""Properties of the K-quant quantizers (Q2_K .. Q6_K), default suite.

Their oracle is ggml's own quantizer (tests/test_kquant_oracle.py, slow, needs libggml-base);
here: the torch version and the C kernel give the same bytes, round-trip error bounds through
the gguf-gated dequantizers, all-zero rows, scale invariance, non-finite input, determinism
and chunking invariance.
"""
from __future__ import annotations

import pytest
import torch

import hanzo_torch
from hanzo_torch.formats import _kquant_native, kquant_search

KQ = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# relative RMS error of dequantize(quantize(x)) on Gaussian rows; measured 0.30, 0.15, 0.072,
# 0.036, 0.018: the bounds leave ~15 % room
RMS_BOUND = {"Q2_K": 0.35, "Q3_K": 0.175, "Q4_K": 0.085, "Q5_K": 0.042, "Q6_K": 0.021}


def _gen(tag: str) -> torch.Generator:
    return torch.Generator().manual_seed(sum(map(ord, tag)))


def _rel_rms(y, x):
    return float((y - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt())


def _mixed(rows: int, k: int, tag: str) -> torch.Tensor:
    x = torch.randn(rows, k, generator=_gen(tag)) * 0.02
    x[1] = 0                       # an all-zero row
    x[2, : k // 2] = 0             # zero super-blocks and sub-blocks next to live ones
    x[3, 7] = 3.0                  # an outlier
    x[4] = x[4].abs()              # all positive (min clamped to 0)
    x[5] = -x[5].abs()             # all negative
    x[6, :16] = 0.01               # a constant sub-block
    return x


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("HANZO_QUANT_NATIVE", "0")


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("name", KQ + ["IQ4_XS", "IQ4_NL"])
def test_simd_path_matches_scalar_path(name, weighted, monkeypatch):
    """The kernel's AVX2 searches (one sub-block per lane) give the scalar path's bytes."""
    lib = _kquant_native.library()
    if lib is None:
        pytest.skip(f"the C kernel could not be built: {_kquant_native.error()}")
    if not lib.hz_quant_set_simd(1):
        pytest.skip("this CPU has no AVX2")
    x = _mixed(12, 1024, name + "simd")
    x[7] *= 1e-30                  # tiny and huge magnitudes
    x[8] *= 1e20
    x[9, :32] = -2.0               # a constant negative sub-block
    x[10, ::3] = 0
    qw = None
    if weighted:
        qw = torch.rand(1024, generator=_gen(name + "w"))
        qw[:40] = 0                # zero weights on whole sub-blocks
    simd = _kquant_native.quantize_rows(x, name, qw)
    monkeypatch.setenv("HANZO_QUANT_SIMD", "0")
    scalar = _kquant_native.quantize_rows(x, name, qw)
    assert torch.equal(simd, scalar), f"{int((simd != scalar).sum())} bytes differ"


@pytest.mark.parametrize("name", KQ)
def test_kernel_matches_torch_version(name, monkeypatch):
    if _kquant_native.library() is None:
        pytest.skip(f"the C kernel could not be built: {_kquant_native.error()}")
    x = _mixed(8, 512, name)
    native = hanzo_torch.quantize(x, name)
    monkeypatch.setenv("HANZO_QUANT_NATIVE", "0")
    ref = hanzo_torch.quantize(x, name)
    assert native.shape == ref.shape == (8, 2 * hanzo_torch.get_format(name).type_size)
    assert torch.equal(native, ref), f"{int((native != ref).sum())} bytes differ"


@pytest.mark.parametrize("name", KQ)
def test_roundtrip_error_bound(name):
    x = torch.randn(64, 1024, generator=_gen("rt" + name))
    y = hanzo_torch.dequantize(hanzo_torch.quantize(x, name), name, x.shape)
    assert _rel_rms(y, x) < RMS_BOUND[name]
    # scale invariance up to fp16 scale rounding: the same bound on scaled copies
    for s in (1e3, 1e-3):
        ys = hanzo_torch.dequantize(hanzo_torch.quantize(x * s, name), name, x.shape)
        assert _rel_rms(ys, x * s) < RMS_BOUND[name]


@pytest.mark.parametrize("name", KQ)
def test_roundtrip_torch_version(name, torch_path):
    x = _mixed(8, 256, "tv" + name)
    y = hanzo_torch.dequantize(hanzo_torch.quantize(x, name), name, x.shape)
    live = x.abs().sum(1) > 0
    assert _rel_rms(y[0], x[0]) < RMS_BOUND[name] * 1.5
    assert torch.equal(y[~live], torch.zeros_like(y[~live]))


@pytest.mark.parametrize("name", KQ)
def test_all_zero_rows_are_zero_bytes(name):
    q = hanzo_torch.quantize(torch.zeros(3, 512), name)
    assert torch.equal(q, torch.zeros_like(q))
    q = hanzo_torch.quantize(-torch.zeros(3, 512), name)  # -0.0 gives the same bytes
    assert torch.equal(q, torch.zeros_like(q))


@pytest.mark.parametrize("name", KQ)
def test_deterministic_and_chunking_invariant(name):
    x = _mixed(8, 768, "det" + name)
    a = hanzo_torch.quantize(x, name)
    assert torch.equal(a, hanzo_torch.quantize(x.clone(), name))
    rows = torch.cat([hanzo_torch.quantize(x[i:i + 1], name) for i in range(x.shape[0])])
    assert torch.equal(a, rows)
    # the torch version works in chunks of super-blocks; a chunk boundary inside a row is harmless
    old = kquant_search._CHUNK
    try:
        kquant_search._CHUNK = 5
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("HANZO_QUANT_NATIVE", "0")
            assert torch.equal(a, hanzo_torch.quantize(x, name))
    finally:
        kquant_search._CHUNK = old


@pytest.mark.parametrize("name", KQ)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_a_clear_error(name, bad):
    x = torch.randn(2, 256)
    x[1, 17] = bad
    with pytest.raises(ValueError, match=rf"{name}: cannot quantize non-finite values \(block 1, value 17\)"):
        hanzo_torch.quantize(x, name)


@pytest.mark.parametrize("name", KQ)
def test_bad_shapes(name):
    with pytest.raises(ValueError, match="multiple of the block size"):
        hanzo_torch.quantize(torch.zeros(2, 300), name)
    with pytest.raises(ValueError, match=rf"{name}: values must have shape \[n, 256\]"):
        hanzo_torch.get_format(name).quantize_blocks(torch.zeros(2, 128))


def test_fma_emulation_toggle_changes_only_last_bits():
    x = torch.randn(32, 512, generator=_gen("fma"))
    plain = hanzo_torch.quantize(x, "Q4_K")
    old = kquant_search.EMULATE_FMA
    try:
        kquant_search.EMULATE_FMA = True
        fused = hanzo_torch.quantize(x, "Q4_K")
    finally:
        kquant_search.EMULATE_FMA = old
    yp = hanzo_torch.dequantize(plain, "Q4_K", x.shape)
    yf = hanzo_torch.dequantize(fused, "Q4_K", x.shape)
    assert abs(_rel_rms(yp, x) - _rel_rms(yf, x)) < 1e-3
    blocks_differ = (plain.reshape(-1, 144) != fused.reshape(-1, 144)).any(1).float().mean()
    assert blocks_differ < 0.1  # a few blocks flip a rounding, most are equal
