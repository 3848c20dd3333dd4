"""The real Qwen2.5-Coder-1.5B-Instruct Q4_K_M file (1.1 GB): header and layout (default suite),
every tensor dequantized bit for bit against ``gguf.quants.dequantize`` and the header against
``gguf.GGUFReader`` (``-m slow``). Skipped when the file is absent. Timing lives in
``benchmarks/open_model.py``, not here."""
from __future__ import annotations

import os
from collections import Counter

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFValueType as VT

import hanzo_torch
from hanzo_torch import GGUFFile, GGUFTensor, get_format, save_gguf

MODEL = str(hanzo_torch.hub.model_path())  # where the library keeps the default model ($HANZO_CACHE)
needs_model = pytest.mark.skipif(not os.path.exists(MODEL),
                                 reason=f"real model not downloaded: {MODEL} is absent (run `hanzo-torch pull`)")

ROWS_PER_CHUNK = 4096  # bounds the memory of the numpy oracle on the 151936-row embeddings


@pytest.fixture(scope="module")
def model():
    with GGUFFile(MODEL) as f:
        yield f


@needs_model
def test_real_model_header_and_torch_order_layout(model):
    f = model
    assert f.version == 3 and f.architecture == "qwen2"
    assert f.get_int("qwen2.block_count") == 28
    assert f.get_int("qwen2.embedding_length") == 1536
    assert f.get_int("qwen2.feed_forward_length") == 8960
    assert f.get_int("qwen2.attention.head_count_kv") == 2
    assert f.get_float("qwen2.rope.freq_base") == 1e6
    assert f.metadata.value_type("qwen2.block_count") == VT.UINT32
    assert f.get_bool("tokenizer.ggml.add_bos_token") is False
    assert "<|im_start|>" in f.get_str("tokenizer.chat_template")
    tokens = f.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 151936 and tokens[0] == "!"
    assert f.get_array("tokenizer.ggml.token_type").shape == (151936,)
    assert len(f.get_list("tokenizer.ggml.merges")) == 151387

    assert len(f.tensor_info) == 339
    assert Counter(i.qtype for i in f.raw_tensor_info) == {"Q4_K": 169, "F32": 141, "Q6_K": 29}
    # torch order: (out_features, in_features)
    assert f.tensor_info["token_embd.weight"].shape == (151936, 1536)
    assert f.tensor_info["blk.0.attn_q.weight"].shape == (1536, 1536)
    assert f.tensor_info["blk.0.attn_k.weight"].shape == (256, 1536)
    assert f.tensor_info["blk.0.ffn_gate.weight"].shape == (8960, 1536)
    assert f.tensor_info["blk.0.ffn_down.weight"].shape == (1536, 8960)
    assert f.tensor_info["blk.0.attn_norm.weight"].shape == (1536,)

    base = np.frombuffer(f._mmap, dtype=np.uint8).ctypes.data
    end = 0
    for name, t in f.tensors.items():
        info = f.tensor_info[name]
        assert isinstance(t, GGUFTensor) and tuple(t.shape) == info.shape and t.qtype == info.qtype
        fmt = get_format(info.qtype)
        assert tuple(t.packed.shape) == (*info.shape[:-1], fmt.row_bytes(info.shape[-1]))
        assert t.packed.data_ptr() == base + info.offset  # zero-copy view of the mapping
        end = max(end, info.offset + info.nbytes)
    assert end <= f.size and f.size - end < f.alignment


@needs_model
def test_real_model_metadata_round_trip(model, tmp_path):
    """All 26 keys (incl. the 152k-entry vocabulary arrays) and a few tensors, written and read back."""
    out = tmp_path / "rt.gguf"
    keep = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_q.bias", "blk.0.ffn_down.weight"]
    save_gguf(out, {n: model.tensors[n] for n in keep}, model.metadata)
    with GGUFFile(out) as g:
        assert list(g.metadata) == list(model.metadata)
        for key in model.metadata:
            assert g.metadata.value_type(key) == model.metadata.value_type(key), key
            assert g.metadata.element_type(key) == model.metadata.element_type(key), key
            a, b = g.metadata[key], model.metadata[key]
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, key
        assert list(g.tensor_info) == keep
        for n in keep:
            assert g.tensor_info[n].shape == model.tensor_info[n].shape
            assert torch.equal(g.packed(n), model.packed(n)), n


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


@pytest.mark.slow
@needs_model
def test_real_model_every_tensor_dequantizes_like_gguf(model):
    checked = Counter()
    for name, info in model.tensor_info.items():
        qt = gguf.GGMLQuantizationType(info.type_id)
        packed = model.packed(name)
        rows = packed.reshape(-1, packed.shape[-1])
        for r0 in range(0, rows.shape[0], ROWS_PER_CHUNK):
            chunk = rows[r0 : r0 + ROWS_PER_CHUNK]
            ours = hanzo_torch.dequantize(chunk, info.qtype, (chunk.shape[0], info.shape[-1]), torch.float32)
            ref = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(chunk.numpy(), qt), dtype=np.float32))
            assert ref.shape == ours.shape, name
            if not torch.equal(_bits(ours), _bits(ref)):
                bad = (_bits(ours) != _bits(ref)).nonzero()[0].tolist()
                pytest.fail(
                    f"{name} ({info.qtype}) rows {r0}..: first mismatch at {bad}: "
                    f"ours {ours[tuple(bad)].item()!r} vs gguf {ref[tuple(bad)].item()!r}"
                )
        checked[info.qtype] += 1
    assert sum(checked.values()) == 339, checked


@pytest.mark.slow
@needs_model
def test_real_model_header_matches_gguf_reader(model):
    reader = gguf.GGUFReader(MODEL)  # ~15 s: builds one numpy view per vocabulary entry
    fields = {k: v for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(model.metadata)
    for key, field in fields.items():
        ours = model.metadata[key]
        ours = ours.tolist() if isinstance(ours, torch.Tensor) else ours
        assert ours == field.contents(), key
        assert model.metadata.value_type(key) == field.types[0], key
    assert reader.data_offset == model.data_offset and reader.alignment == model.alignment
    assert [t.name for t in reader.tensors] == list(model.tensor_info)
    for rt in reader.tensors:
        info = model.tensor_info[rt.name]
        assert info.offset == rt.data_offset and info.nbytes == rt.n_bytes
        assert info.shape == tuple(reversed(rt.shape.tolist())) and info.type_id == int(rt.tensor_type)
