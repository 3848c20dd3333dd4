"""Properties of the IQ4_NL / IQ4_XS quantizers and of importance-weighted quantization, default suite.

Their oracle is ggml's own quantizer (tests/test_kquant_oracle.py, slow, needs libggml-base);
here: the torch version and the C kernel give the same bytes (IQ4, with and without weights),
round-trip error bounds through the gguf-gated dequantizers, all-zero rows, non-finite input and
weights, determinism, and that importance weights lower the error where they are large.
"""
from __future__ import annotations

import pytest
import torch

import hanzo_torch
from hanzo_torch.formats import _kquant_native, iq4_search, kquant_search
from test_kquant_quantize import _gen, _rel_rms

IQ4 = ["IQ4_NL", "IQ4_XS"]
KQ = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1"]  # importance-weighted in the C kernel; unweighted: gguf's
# relative RMS error of dequantize(quantize(x)) on Gaussian rows; measured 0.0775, 0.0783 with
# and without weights: the bound leaves ~15 % room
RMS_BOUND = {"IQ4_NL": 0.09, "IQ4_XS": 0.09, "Q2_K": 0.35, "Q3_K": 0.175, "Q4_K": 0.085, "Q5_K": 0.042,
             "Q6_K": 0.021, "Q4_0": 0.1, "Q4_1": 0.09, "Q5_0": 0.05, "Q5_1": 0.045}


def _mixed(rows: int, k: int, tag: str) -> torch.Tensor:
    x = torch.randn(rows, k, generator=_gen(tag)) * 0.02
    x[1] = 0                       # an all-zero row
    x[2, : k // 2] = 0             # zero super-blocks and groups next to live ones
    x[3, 7] = 3.0                  # an outlier
    x[4] = x[4].abs()              # all positive
    x[5] = -x[5].abs()             # all negative
    x[6, :32] = 0.01               # a constant group
    return x


def _weights(k: int, tag: str) -> torch.Tensor:
    w = torch.rand(k, generator=_gen("w" + tag)).pow(4) * 50
    w[:5] = 0                      # columns without activations
    return w


def _kernel():
    if _kquant_native.library() is None:
        pytest.skip(f"the C kernel could not be built: {_kquant_native.error()}")


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("name", IQ4)
def test_kernel_matches_torch_version(name, weighted, monkeypatch):
    _kernel()
    x = _mixed(8, 512, name)
    w = _weights(512, name) if weighted else None
    native = hanzo_torch.quantize(x, name, quant_weights=w)
    monkeypatch.setenv("HANZO_QUANT_NATIVE", "0")
    ref = hanzo_torch.quantize(x, name, quant_weights=w)
    assert native.shape == ref.shape == (8, hanzo_torch.get_format(name).row_bytes(512))
    assert torch.equal(native, ref), f"{int((native != ref).sum())} bytes differ"


@pytest.mark.parametrize("name", IQ4)
def test_roundtrip_error_bound(name):
    x = torch.randn(32, 1024, generator=_gen("rt" + name))
    for w in (None, _weights(1024, name)):
        y = hanzo_torch.dequantize(hanzo_torch.quantize(x, name, quant_weights=w), name, x.shape)
        assert _rel_rms(y, x) < RMS_BOUND[name]
        for s in (1e3, 1e-3):  # scale invariance up to fp16 scale rounding
            ys = hanzo_torch.dequantize(hanzo_torch.quantize(x * s, name, quant_weights=w), name, x.shape)
            assert _rel_rms(ys, x * s) < RMS_BOUND[name]


@pytest.mark.parametrize("name", IQ4)
def test_zero_rows(name, monkeypatch):
    """An all-zero row decodes to zeros; its bytes are ggml's: scale +0 (IQ4_XS: -0.0, as ggml's
    ``-max_scale/32``), every code the level nearest 0 (index 8), IQ4_XS group scales 32 (= 0)."""
    fmt = hanzo_torch.get_format(name)
    for native in ("1", "0"):
        monkeypatch.setenv("HANZO_QUANT_NATIVE", native)
        q = hanzo_torch.quantize(torch.zeros(3, 256), name).reshape(-1, fmt.type_size)
        assert torch.equal(hanzo_torch.dequantize(q, name, (3, 256)), torch.zeros(3, 256))
        qs = q[:, fmt.field("qs").bytes]
        assert torch.equal(qs, torch.full_like(qs, 0x88))
        if name == "IQ4_XS":
            assert q[:, :2].tolist() == [[0, 0x80]] * q.shape[0]
            assert q[:, 2:4].tolist() == [[0xAA, 0xAA]] * q.shape[0]  # high bits of 32: 0b10 each
            assert q[:, 4:8].tolist() == [[0, 0, 0, 0]] * q.shape[0]  # low nibbles of 32: 0
        else:
            assert q[:, :2].tolist() == [[0, 0]] * q.shape[0]


@pytest.mark.parametrize("name", IQ4 + KQ + LEGACY)
def test_deterministic(name):
    x = _mixed(8, 512, "det" + name)
    w = _weights(512, name)
    a = hanzo_torch.quantize(x, name, quant_weights=w)
    assert torch.equal(a, hanzo_torch.quantize(x.clone(), name, quant_weights=w.clone()))
    rows = torch.cat([hanzo_torch.quantize(x[i:i + 1], name, quant_weights=w) for i in range(x.shape[0])])
    assert torch.equal(a, rows)


@pytest.mark.parametrize("name", IQ4)
def test_torch_version_chunking_invariant(name, monkeypatch):
    x = _mixed(8, 256, "ch" + name)
    monkeypatch.setenv("HANZO_QUANT_NATIVE", "0")
    a = hanzo_torch.quantize(x, name)
    monkeypatch.setattr(kquant_search, "_CHUNK", 3)
    assert torch.equal(a, hanzo_torch.quantize(x, name))


@pytest.mark.parametrize("name", IQ4 + KQ + LEGACY)
def test_weights_lower_the_error_where_they_are_large(name):
    """Columns with 100x the weight of the others come out more accurate than without weights."""
    _kernel()
    x = torch.randn(64, 512, generator=_gen("imp" + name))
    w = torch.ones(512)
    hot = torch.arange(0, 512, 4)
    w[hot] = 100.0
    plain = hanzo_torch.dequantize(hanzo_torch.quantize(x, name), name, x.shape)
    weighted = hanzo_torch.dequantize(hanzo_torch.quantize(x, name, quant_weights=w), name, x.shape)
    e_plain = (plain - x)[:, hot].pow(2).mean()
    e_weighted = (weighted - x)[:, hot].pow(2).mean()
    assert e_weighted < 0.9 * e_plain, (float(e_weighted), float(e_plain))
    assert _rel_rms(weighted, x) < RMS_BOUND[name] * 1.6  # the other columns pay, within reason


@pytest.mark.parametrize("name", IQ4)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_is_a_clear_error(name, bad):
    x = torch.randn(2, 256)
    x[1, 17] = bad
    bs = hanzo_torch.get_format(name).block_size
    blk, val = divmod(256 + 17, bs)
    with pytest.raises(ValueError, match=rf"{name}: cannot quantize non-finite values \(block {blk}, value {val}\)"):
        hanzo_torch.quantize(x, name)


@pytest.mark.parametrize("name", ["IQ4_XS", "Q4_K"])
def test_bad_weights_are_a_clear_error(name):
    x = torch.randn(2, 512)
    with pytest.raises(ValueError, match=rf"{name}: quant_weights must be a 1-D tensor of the row length 512, got \[256\]"):
        hanzo_torch.quantize(x, name, quant_weights=torch.ones(256))
    w = torch.ones(512)
    w[300] = float("nan")
    with pytest.raises(ValueError, match=rf"{name}: quant_weights has a non-finite value at column 300"):
        hanzo_torch.quantize(x, name, quant_weights=w)


def test_weights_on_a_format_without_a_weighted_quantizer():
    with pytest.raises(NotImplementedError, match="Q8_0 with quant_weights"):
        hanzo_torch.quantize(torch.randn(2, 64), "Q8_0", quant_weights=torch.ones(64))


def test_weighted_kquant_without_the_kernel_names_the_switch(monkeypatch):
    monkeypatch.setenv("HANZO_QUANT_NATIVE", "0")
    with pytest.raises(NotImplementedError, match="Q4_K with quant_weights needs the C kernel.*HANZO_QUANT_NATIVE"):
        hanzo_torch.quantize(torch.randn(2, 256), "Q4_K", quant_weights=torch.ones(256))
    with pytest.raises(NotImplementedError, match="Q5_1 with quant_weights needs the C kernel"):
        hanzo_torch.quantize(torch.randn(2, 256), "Q5_1", quant_weights=torch.ones(256))
    # without weights the torch version still runs
    assert hanzo_torch.quantize(torch.randn(2, 256), "Q4_K").shape == (2, 144)


def test_row_quantizer_rejects_other_formats():
    with pytest.raises(NotImplementedError, match="Q8_0: no row quantizer"):
        iq4_search.quantize_rows(torch.zeros(1, 32), "Q8_0")
