"""Properties of the codebook i-quant quantizers (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S,
IQ1_M; C kernel only), default suite.

Their oracle is ggml's own quantizer (tests/test_kquant_oracle.py, slow, needs libggml-base);
here: round-trip error bounds through gguf's dequantizer (an independent decoder of the bytes),
with and without importance weights, all-zero rows, non-finite input, determinism and row
independence, and the errors without the kernel or with a bad row length.
"""
from __future__ import annotations

import gguf.quants as gq
import pytest
import torch

import hanzo_torch
from hanzo_torch.formats import _kquant_native
from test_kquant_quantize import _gen, _rel_rms

CODEBOOK = ["IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"]
NEEDS_WEIGHTS = ("IQ2_XXS", "IQ2_XS", "IQ1_S")  # as ggml_quantize_requires_imatrix
# relative RMS error of dequantize(quantize(x)) on Gaussian rows (IQ2_XXS: unit weights);
# measured 0.213, 0.166, 0.343, 0.299, 0.265, 0.489, 0.586 (IQ1_M without weights): ~15 % room
RMS_BOUND = {"IQ3_XXS": 0.245, "IQ3_S": 0.19, "IQ2_XXS": 0.395, "IQ2_XS": 0.345, "IQ2_S": 0.305,
             "IQ1_S": 0.56, "IQ1_M": 0.67}
# weighted over plain error on the heavily weighted columns; IQ1_S (measured 0.80) has only
# 8 scales per super-block and a shared delta sign per 32 values to spend the weights on
HOT_RATIO = {"IQ1_S": 0.9}


def _q(x, name, w=None):
    """quantize; unit weights for a format that needs them when ``w`` is None"""
    if w is None and name in NEEDS_WEIGHTS:
        w = torch.ones(x.shape[-1])
    return hanzo_torch.quantize(x, name, quant_weights=w)


@pytest.fixture(autouse=True)
def _kernel():
    if _kquant_native.library() is None:
        pytest.skip(f"the C kernel could not be built: {_kquant_native.error()}")


def _gguf_dequantize(q: torch.Tensor, name: str, shape) -> torch.Tensor:
    return torch.from_numpy(gq.dequantize(q.numpy(), getattr(gq.GGMLQuantizationType, name))).reshape(shape)


@pytest.mark.parametrize("name", CODEBOOK)
def test_round_trip_error_bound(name):
    x = torch.randn(32, 1024, generator=_gen(name))
    q = _q(x, name)
    assert q.shape == (32, hanzo_torch.get_format(name).row_bytes(1024)) and q.dtype == torch.uint8
    y = _gguf_dequantize(q, name, x.shape)
    assert _rel_rms(y, x) < RMS_BOUND[name]
    assert torch.equal(y, hanzo_torch.dequantize(q, name, x.shape))  # our decoder agrees


@pytest.mark.parametrize("name", CODEBOOK)
def test_importance_weights_lower_the_error_where_large(name):
    x = torch.randn(64, 512, generator=_gen(name + "w"))
    w = torch.ones(512)
    w[::4] = 1000.0  # one column in four matters
    plain = _gguf_dequantize(_q(x, name), name, x.shape)
    weighted = _gguf_dequantize(hanzo_torch.quantize(x, name, quant_weights=w), name, x.shape)
    hot = slice(None, None, 4)
    assert _rel_rms(weighted[:, hot], x[:, hot]) < HOT_RATIO.get(name, 0.8) * _rel_rms(plain[:, hot], x[:, hot])
    assert _rel_rms(weighted, x) < 1.5 * RMS_BOUND[name]


@pytest.mark.parametrize("name", CODEBOOK)
def test_zero_rows_deterministic_and_row_independent(name):
    x = torch.randn(6, 512, generator=_gen(name + "z")) * 0.02
    x[1] = 0
    x[2, :256] = 0
    x[3, 5] = 4.0
    q = _q(x, name)
    ts = hanzo_torch.get_format(name).type_size
    assert not q[1].any() and not q[2, :ts].any()
    assert torch.equal(_q(-torch.zeros(2, 256), name), torch.zeros(2, ts, dtype=torch.uint8))
    assert torch.equal(q, _q(x.clone(), name))
    assert torch.equal(q, torch.cat([_q(x[i:i + 1], name) for i in range(6)]))
    # the per-column weights follow the column, whatever the row
    w = torch.rand(512, generator=_gen(name + "zw"))
    qw = hanzo_torch.quantize(x, name, quant_weights=w)
    assert torch.equal(qw[3:4], hanzo_torch.quantize(x[3:4], name, quant_weights=w))


@pytest.mark.parametrize("name", CODEBOOK)
def test_bad_input_is_a_clear_error(name, monkeypatch):
    x = torch.randn(2, 512)
    x[1, 300] = float("nan")
    with pytest.raises(ValueError, match=rf"{name}: cannot quantize non-finite values \(block 3, value 44\)"):
        _q(x, name)
    with pytest.raises(ValueError, match="multiple"):
        _q(torch.zeros(2, 300), name)
    if name in NEEDS_WEIGHTS:
        with pytest.raises(ValueError, match=f"{name} needs importance weights"):
            hanzo_torch.quantize(torch.randn(2, 256), name)
    with pytest.raises(ValueError):
        hanzo_torch.quantize(torch.zeros(2, 256), name, quant_weights=torch.ones(100))
    monkeypatch.setenv("HANZO_QUANT_NATIVE", "0")
    with pytest.raises(NotImplementedError, match=f"{name} needs the C kernel.*HANZO_QUANT_NATIVE"):
        _q(torch.randn(2, 256), name)
