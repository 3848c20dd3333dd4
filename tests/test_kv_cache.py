"""KV caches in f32/f16/bf16/q8_0: what the conformance suite does not cover.

kv_cache_write and attention with every cache dtype, on every backend, against the references:
tests/test_conformance.py (test_kv_cache_write, test_attention_cache_dtypes). Here: the q8_0
bytes against gguf's own quantizer, the CPU decode kernel's portable loops, large-magnitude q8_0
keys, the shape/dtype checks, and the model with an f16 cache.

Tolerances. Writes are compared bit for bit: both sides round to f16/bf16 to nearest even, and
q8_0 rows are ggml's ``quantize_row_q8_0_ref`` (the bytes of ``gguf.quants.quantize``). For
attention, the reference converts the *same* cache bytes to float32 (f16/bf16 exactly, q8_0 as
``d * q``) and then both sides compute in float32, so the results agree to float32 rounding:
rtol = atol = 1e-5 of the output's magnitude (the decode kernel's
split over key chunks adds a few roundings to the merge); bf16 outputs to one bf16 rounding.
An off-by-one position misses that bound by more than 100x (test_tolerance_catches_a_wrong_position).

Model level: the tiny qwen3 file with a float32 vs an f16 KV cache. f16 keeps 11 significant bits
(relative rounding <= 2^-11 = 4.9e-4 per value), which moves the logits by about that much
relative; the bound is 1e-2 of the largest logit, and the greedy tokens must be equal.
"""
from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch

import hanzo_torch
from hanzo_torch.backends import cpu as hcpu
from hanzo_torch.backends.cpu import fused as cf
from hanzo_torch.ops import fused as ref
from tests.gguf_builders import tiny_spec, tokenizer_metadata, write_tiny_gguf

pytestmark = pytest.mark.skipif(not hcpu.available(), reason="C++ CPU extension could not be built")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
LOGIT_RTOL = 1e-2


def g(seed=0):
    return torch.Generator().manual_seed(seed)


def err(a, b):
    """Largest |a - b| relative to the reference's largest magnitude (float32)."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def close(a, b, dtype):
    assert a.dtype == b.dtype == dtype and a.shape == b.shape
    tol = TOL[dtype]
    scale = float(b.float().abs().max().clamp_min(1))
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * scale)


def cache_of(x: torch.Tensor, kv: str) -> torch.Tensor:
    return ref.kv_to_cache(x, ref.KV_CACHE_DTYPES[kv]).contiguous()


def empty_cache(B, S, Hk, D, kv):
    return torch.zeros(ref.kv_cache_shape(B, S, Hk, D, kv), dtype=ref.KV_CACHE_DTYPES[kv])


# ------------------------------------------------------------------------------------ kv_cache_write
def test_q8_0_cache_rows_are_ggml_blocks():
    """The q8_0 bytes the C++ write stores equal gguf.quants.quantize (the oracle), incl. zero blocks."""
    x = torch.randn(1, 4, 2, 64, generator=g(3)) * torch.tensor([1e-3, 1.0, 50.0, 3e4]).view(1, 4, 1, 1)
    x[0, 0, 0, :32] = 0  # d = 0: codes 0
    kc, vc = empty_cache(1, 4, 2, 64, "q8_0"), empty_cache(1, 4, 2, 64, "q8_0")
    cf.kv_cache_write(kc, vc, x, x, torch.arange(4)[None])
    oracle = gguf.quants.quantize(x.numpy().reshape(-1, 64), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(kc.numpy().reshape(oracle.shape), oracle)
    assert torch.equal(kc, vc)


# ------------------------------------------------------------------------------------ attention
def _inputs(B, T, Hq, Hk, D, S, kv, q_dtype, positions, kmag=1.0, seed=0):
    q = torch.randn(B, T, Hq, D, generator=g(seed)).to(q_dtype)
    kc = cache_of(torch.randn(B, S, Hk, D, generator=g(seed + 1)) * kmag, kv)
    vc = cache_of(torch.randn(B, S, Hk, D, generator=g(seed + 2)), kv)
    return q, kc, vc, torch.as_tensor(positions)


CASES = [
    # decode, GQA 6 (the 1.5B model's 12/2), one sequence near the cache end: > 256 keys, so
    # several key chunks are merged; the other short
    dict(B=2, T=1, Hq=12, Hk=2, D=128, S=700, positions=[[698], [40]]),
    # decode, GQA 2, last slot of the cache
    dict(B=1, T=1, Hq=4, Hk=2, D=64, S=300, positions=[[299]]),
    # GQA 1 (MHA), a few tokens at once (the flash tiles: T > 1)
    dict(B=1, T=3, Hq=2, Hk=2, D=32, S=64, positions=[[60, 61, 63]]),
    # prefill tiles, GQA 6, continuing at position 20 up to the cache end
    dict(B=1, T=12, Hq=6, Hk=1, D=64, S=32, positions=[list(range(20, 32))]),
]


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_portable_decode_loops(kv, monkeypatch):
    """The scalar instruction set: the decode kernel's portable loops (the AVX2 ones run by default)."""
    c = dict(CASES[0], D=40)  # D % 8 != 0 also takes the portable loops on AVX2 CPUs
    for case in (CASES[0], c) if kv == "f16" else (CASES[0],):
        q, kc, vc, pos = _inputs(kv=kv, q_dtype=torch.float32, **case)
        expect = ref.attention_reference(q, kc, vc, pos, 0.1, "eager")
        with hcpu.use_isa("scalar"):
            close(cf.attention(q, kc, vc, pos, 0.1), expect, torch.float32)
        close(cf.attention(q, kc, vc, pos, 0.1), expect, torch.float32)


def test_tolerance_catches_a_wrong_position():
    q, kc, vc, pos = _inputs(kv="q8_0", q_dtype=torch.float32, **CASES[0])
    good = ref.attention_reference(q, kc, vc, pos, 0.1, "eager")
    assert err(cf.attention(q, kc, vc, pos, 0.1), good) < TOL[torch.float32]
    assert err(ref.attention_reference(q, kc, vc, pos - 1, 0.1, "eager"), good) > 100 * TOL[torch.float32]


@pytest.mark.parametrize("T", [1, 9])
def test_q8_0_keys_at_large_magnitude_stay_finite(T):
    """Scores far past the f16 range (|q.k| * scale ~ 1e5..1e6) with q8_0 keys: float32 scores and
    a max-subtracted softmax, so no inf - inf and no NaN; the result still matches the reference."""
    c = dict(B=1, T=T, Hq=6, Hk=1, D=128, S=400, positions=[list(range(391 - T, 391))])
    q, kc, vc, pos = _inputs(kv="q8_0", q_dtype=torch.float32, kmag=3e3, **c)
    q = q * 100
    out = cf.attention(q, kc, vc, pos, 1 / math.sqrt(128))
    assert torch.isfinite(out).all()
    close(out, ref.attention_reference(q, kc, vc, pos, 1 / math.sqrt(128), "eager"), torch.float32)


def test_checks_name_the_problem():
    q = torch.zeros(1, 1, 2, 64)
    kc = torch.zeros(1, 4, 1, 64, dtype=torch.uint8)  # q8_0 rows of 64 values are 68 bytes
    with pytest.raises(ValueError, match="q8_0.*does not match q"):
        torch.ops.hanzo.attention(q, kc, kc, torch.tensor([[0]]), 1.0, "auto")
    with pytest.raises(ValueError, match="share a dtype"):
        torch.ops.hanzo.attention(q, torch.zeros(1, 4, 1, 64, dtype=torch.float16), torch.zeros(1, 4, 1, 64), torch.tensor([[0]]), 1.0, "auto")
    with pytest.raises(ValueError, match="must share a dtype"):
        torch.ops.hanzo.kv_cache_write(torch.zeros(1, 4, 1, 64), torch.zeros(1, 4, 1, 64, dtype=torch.int32),
                                       torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 64), torch.tensor([[0]]))
    with pytest.raises(ValueError, match="multiple of 32"):
        ref.kv_cache_shape(1, 4, 1, 48, "q8_0")
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        ref.kv_cache_shape(1, 4, 1, 64, "q4_0")


def test_fake_kernels_accept_q8_0_caches():
    with torch.device("meta"):
        q = torch.empty(1, 2, 4, 64)
        kc = torch.empty(1, 8, 2, 68, dtype=torch.uint8)
        out = torch.ops.hanzo.attention(q, kc, kc, torch.zeros(1, 2, dtype=torch.long), 0.1, "auto")
        torch.ops.hanzo.kv_cache_write(kc, kc.clone(), torch.empty(1, 2, 2, 64), torch.empty(1, 2, 2, 64),
                                       torch.zeros(1, 2, dtype=torch.long))
    assert out.shape == (1, 2, 4, 64) and out.device.type == "meta"


# ------------------------------------------------------------------------------------ model
@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv") / "qwen3.gguf"
    # packed (C++ kernels): a float32 tied 151k-row embedding would be dequantized per forward
    spec = tiny_spec("qwen3", qtypes=dict(embd="Q8_0", attn="Q8_0", ffn="Q8_0", ffn_down="Q8_0"))
    return write_tiny_gguf(path, spec, tokenizer_metadata(full=False))


def _greedy(model, prompt, n):
    """Prefill, then n - 1 decode steps; returns the tokens and the logits of every step."""
    model.reset()
    with torch.inference_mode():
        logits = [model(prompt)[:, -1]]
        toks = [int(logits[-1].argmax())]
        for _ in range(n - 1):
            logits.append(model(torch.tensor([[toks[-1]]]))[:, -1])
            toks.append(int(logits[-1].argmax()))
    return toks, torch.cat(logits)


def test_model_kv_f16_matches_f32(tiny_qwen3):
    prompt = torch.randint(0, 1000, (1, 12), generator=g(5))
    model = hanzo_torch.load(tiny_qwen3, max_context=64)  # f16 cache on the CPU by default
    assert model.kv_dtype == "f16"
    toks16, logits16 = _greedy(model, prompt, 8)
    assert model.blk[0].k_cache.dtype == torch.float16
    model.kv_dtype = "f32"
    model.setup_cache(1)
    toks32, logits32 = _greedy(model, prompt, 8)
    assert model.blk[0].k_cache.dtype == torch.float32
    assert toks16 == toks32
    assert err(logits16, logits32) < LOGIT_RTOL
    model.kv_dtype = "q8_0"
    model.setup_cache(1)
    toks8, logits8 = _greedy(model, prompt, 8)
    assert model.blk[0].k_cache.dtype == torch.uint8 and model.blk[0].k_cache.shape[-1] == 128 // 32 * 34
    assert torch.isfinite(logits8).all() and err(logits8, logits32) < 5 * LOGIT_RTOL


def test_load_rejects_bad_kv_dtype(tiny_qwen3):
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        hanzo_torch.load(tiny_qwen3, kv_dtype="q4_0")


def test_cli_kv_dtype_flag():
    from hanzo_torch.cli import build_parser

    assert build_parser().parse_args(["generate", "-p", "x", "--kv-dtype", "q8_0"]).kv_dtype == "q8_0"
    assert build_parser().parse_args(["bench", "--kv-dtype", "f32"]).kv_dtype == "f32"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kv-dtype", "f64"])


@pytest.mark.parametrize("T", [40, 33])  # pieces 16+16+8, and 16+16+1 (a one-token last piece)
def test_prompt_in_pieces_matches_one_pass(tiny_qwen3, T):
    """A prompt longer than ``ubatch`` runs in pieces, each attending to the keys/values the earlier
    pieces wrote: the logits of every position agree with one pass to float32 rounding (1e-4 of
    the largest logit: the pieces change only the attention kernels' tiling and the GEMM's row
    tiles), the greedy continuation is the same, and ``last_only`` gives the last row."""
    prompt = torch.randint(0, 1000, (1, T), generator=g(7))
    model = hanzo_torch.load(tiny_qwen3, max_context=64)
    assert model.ubatch == model.UBATCH
    outs = {}
    for ub in (None, 16):
        model.ubatch = ub
        model.reset()
        with torch.inference_mode():
            outs[ub] = model(prompt)
        outs[(ub, "greedy")] = _greedy(model, prompt, 6)[0]
        model.reset()
        with torch.inference_mode():
            outs[(ub, "last")] = model(prompt, last_only=True)
    assert outs[None].shape == outs[16].shape == (1, T, outs[None].shape[-1])
    assert err(outs[16], outs[None]) < 1e-4
    assert outs[(16, "greedy")] == outs[(None, "greedy")]
    assert outs[(16, "last")].shape == (1, 1, outs[None].shape[-1])
    assert err(outs[(16, "last")][:, 0], outs[16][:, -1]) < 1e-6
    for bad in (-1, 2.5, True):
        model.ubatch = bad
        model.reset()
        with pytest.raises(ValueError, match="ubatch"):
            model(prompt[:, :20])
        assert model.seq_len == 0  # refused before any state changed
