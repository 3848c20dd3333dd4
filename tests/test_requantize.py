"""``hanzo-torch quantize in.gguf out.gguf TYPE``: llama-quantize's recipe, atomic output, bad input."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import hanzo_torch
from hanzo_torch import cli
from hanzo_torch.requantize import requantize


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory) -> Path:
    from gguf_builders import tiny_spec, write_tiny_gguf

    from qwen_vocab import toy_tokenizer_metadata

    path = tmp_path_factory.mktemp("rq") / "tiny-f32.gguf"
    spec = tiny_spec("qwen3", n_layer=2)  # hidden 256: every matrix a K-quant block multiple; all F32
    return Path(write_tiny_gguf(path, spec, toy_tokenizer_metadata()))


def _types(path) -> dict:
    f = hanzo_torch.GGUFFile(path)
    return {n: i.qtype for n, i in f.tensor_info.items()}


def test_q4_k_m_recipe_and_bytes(f32_model, tmp_path):
    out = tmp_path / "q4km.gguf"
    plan = requantize(str(f32_model), str(out), "Q4_K_M", progress=False)
    types = _types(out)
    assert types == plan
    # llama-quantize's Q4_K_M for 2 layers: attn_v and ffn_down get Q6_K where use_more_bits(i, 2)
    # holds (layer 1), output Q6_K, norms stay F32, everything else Q4_K
    assert types["blk.0.attn_v.weight"] == "Q4_K" and types["blk.1.attn_v.weight"] == "Q6_K"
    assert types["blk.0.ffn_down.weight"] == "Q4_K" and types["blk.1.ffn_down.weight"] == "Q6_K"
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.1.ffn_up.weight"] == "Q4_K"
    if "output.weight" in types:
        assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    else:
        assert types["token_embd.weight"] == "Q6_K"
    assert all(t == "F32" for n, t in types.items() if n.endswith("_norm.weight"))
    src, dst = hanzo_torch.GGUFFile(f32_model), hanzo_torch.GGUFFile(out)
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
        want = hanzo_torch.quantize(src.tensors[name].dequantize(), types[name])
        assert torch.equal(dst.packed(name).reshape(want.shape), want), name
    assert dst.metadata["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert dst.metadata["general.architecture"] == src.metadata["general.architecture"]
    assert not os.path.exists(str(out) + ".tmp")


@pytest.mark.parametrize("ftype,tol", [("Q8_0", 0.02), ("Q6_K", 0.05), ("Q4_K_M", 0.25)])
def test_requantized_model_logits_close(f32_model, tmp_path, ftype, tol):
    out = tmp_path / f"{ftype}.gguf"
    requantize(str(f32_model), str(out), ftype, progress=False)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    ref = hanzo_torch.load(str(f32_model))(ids).float()
    got = hanzo_torch.load(str(out))(ids).float()
    rel = float((got - ref).norm() / ref.norm())
    assert rel < tol, rel


def test_bad_input_is_a_clear_error_before_writing(f32_model, tmp_path):
    out = tmp_path / "x.gguf"
    with pytest.raises(ValueError, match="unknown quantization type 'Q9_K'"):
        requantize(str(f32_model), str(out), "Q9_K", progress=False)
    with pytest.raises(ValueError, match="is the input file"):
        requantize(str(f32_model), str(f32_model), "Q8_0", progress=False)
    with pytest.raises(FileNotFoundError, match="no such file"):
        requantize(str(tmp_path / "missing.gguf"), str(out), "Q8_0", progress=False)
    assert not out.exists() and not (tmp_path / "x.gguf.tmp").exists()


def test_cli_quantize(f32_model, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert cli.main(["quantize", str(f32_model), str(out), "q8_0"]) == 0
    line = capsys.readouterr().out
    assert "wrote" in line and "Q8_0" in line
    assert _types(out)["blk.0.attn_q.weight"] == "Q8_0"
    assert cli.main(["quantize", str(f32_model), str(tmp_path / "y.gguf"), "Q7"]) == 2
    assert "unknown type Q7" in capsys.readouterr().err
    assert not (tmp_path / "y.gguf").exists()
    assert cli.main(["quantize", str(tmp_path / "nope.gguf"), str(tmp_path / "y.gguf"), "Q8_0"]) != 0


def test_iq3_recipes():
    """llama-quantize's IQ3_S / IQ3_M choices (llama_tensor_get_type) for a GQA model (n_gqa 6)
    and for one without GQA; rows that are not a 256 multiple fall back to IQ4_NL."""
    from hanzo_torch.requantize import _State, tensor_type
    for gqa in (6, 1):
        for ftype in ("IQ3_S", "IQ3_M"):
            st = _State(n_layer=16, n_attn_v=16, tied=False, n_gqa=gqa)
            v = "Q4_K" if ftype == "IQ3_M" or gqa >= 4 else "IQ3_S"
            assert tensor_type("blk.3.attn_v.weight", (256, 1536), "F32", ftype, st) == v
            assert tensor_type("blk.3.attn_q.weight", (1536, 1536), "F32", ftype, st) == "IQ3_S"
            assert tensor_type("blk.3.attn_output.weight", (1536, 1536), "F32", ftype, st) == (
                "Q4_K" if ftype == "IQ3_M" else "IQ3_S")
            assert tensor_type("blk.1.ffn_down.weight", (1536, 8960), "F32", ftype, st) == (
                "Q4_K" if ftype == "IQ3_M" else "IQ3_S")  # layer 1 < 16 / 8
            assert tensor_type("blk.5.ffn_down.weight", (1536, 8960), "F32", ftype, st) == "IQ3_S"
            assert tensor_type("output.weight", (1000, 1536), "F32", ftype, st) == "Q6_K"
            assert tensor_type("token_embd.weight", (1000, 1536), "F32", ftype, st) == "IQ3_S"
            assert tensor_type("blk.5.ffn_up.weight", (64, 96), "F32", ftype, st) == "IQ4_NL"
    st = _State(n_layer=16, n_attn_v=16, tied=False, n_expert=8)
    assert tensor_type("blk.3.attn_output.weight", (1536, 1536), "F32", "IQ3_S", st) == "Q5_K"


def test_requantize_iq3_s_logits_close(f32_model, tmp_path):
    out = tmp_path / "iq3s.gguf"
    plan = requantize(str(f32_model), str(out), "IQ3_S", progress=False)
    assert plan["blk.0.attn_q.weight"] == "IQ3_S" and _types(out) == plan
    assert hanzo_torch.GGUFFile(out).metadata["general.file_type"] == 26  # LLAMA_FTYPE_MOSTLY_IQ3_S
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    ref = hanzo_torch.load(str(f32_model))(ids).float()
    got = hanzo_torch.load(str(out))(ids).float()
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 0.35, rel  # measured 0.255
