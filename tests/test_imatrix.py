"""imatrix files (hanzo_torch.imatrix): GGUF and legacy .dat reading as untrusted input, the GGUF
writer, llama-quantize's per-column weights, and ``requantize(..., imatrix=)``."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
import torch

import hanzo_torch
from hanzo_torch.gguf_file import GGUFError
from hanzo_torch.imatrix import IMatrix, IMatrixEntry, load_imatrix, save_imatrix


def _matrix() -> IMatrix:
    g = torch.Generator().manual_seed(3)
    return IMatrix({
        "blk.0.attn_q.weight": IMatrixEntry(torch.rand(1, 64, generator=g) * 100, torch.tensor([40])),
        "blk.0.ffn_down_exps.weight": IMatrixEntry(torch.rand(4, 32, generator=g) * 9, torch.tensor([7, 0, 12, 1])),
    }, ["calib.txt"], chunk_count=2, chunk_size=20)


def test_gguf_round_trip_and_layout(tmp_path):
    m = _matrix()
    p = tmp_path / "im.gguf"
    save_imatrix(p, m)
    # the layout llama-imatrix writes, read back through gguf's own reader
    r = gguf.GGUFReader(p)
    assert bytes(r.fields["general.type"].parts[-1]).decode() == "imatrix"
    assert int(r.fields["imatrix.chunk_count"].parts[-1][0]) == 2
    assert int(r.fields["imatrix.chunk_size"].parts[-1][0]) == 20
    names = [t.name for t in r.tensors]
    # entries sorted by name, each its in_sum2 then its counts (llama-imatrix's order)
    assert names == [n + s for n in sorted(m.entries) for s in (".in_sum2", ".counts")]
    shapes = {t.name: [int(x) for x in t.shape] for t in r.tensors}  # ggml ne order
    assert shapes["blk.0.attn_q.weight.in_sum2"] == [64]
    assert shapes["blk.0.attn_q.weight.counts"] == [1]
    assert shapes["blk.0.ffn_down_exps.weight.in_sum2"] == [32, 4]
    assert shapes["blk.0.ffn_down_exps.weight.counts"] == [1, 4]
    back = load_imatrix(p)
    assert (back.datasets, back.chunk_count, back.chunk_size, back.legacy) == (["calib.txt"], 2, 20, False)
    for name, e in m.entries.items():
        assert torch.equal(back.entries[name].sums, e.sums.float())
        assert torch.equal(back.entries[name].counts, e.counts)


def test_weights_as_llama_quantize_computes_them():
    m = _matrix()
    q = m.entries["blk.0.attn_q.weight"]
    assert torch.equal(m.weights("blk.0.attn_q.weight"), (q.sums / torch.tensor(40.0)).reshape(-1))
    e = m.entries["blk.0.ffn_down_exps.weight"]
    w = m.weights("blk.0.ffn_down_exps.weight").reshape(4, 32)
    for i, c in enumerate([7, 0, 12, 1]):
        want = torch.ones(32) if c == 0 else e.sums[i] / torch.tensor(float(c))  # no data: weight 1
        assert torch.equal(w[i], want)
    assert m.weights("blk.9.ffn_up.weight") is None


def _dat(entries, trailer=(3, "text.txt")) -> bytes:
    b = struct.pack("<i", len(entries))
    for name, ncall, vals in entries:
        nb = name.encode()
        b += struct.pack("<i", len(nb)) + nb + struct.pack("<ii", ncall, len(vals)) + np.asarray(vals, "<f4").tobytes()
    if trailer:
        ds = trailer[1].encode()
        b += struct.pack("<ii", trailer[0], len(ds)) + ds
    return b


def test_legacy_dat(tmp_path):
    p = tmp_path / "im.dat"
    p.write_bytes(_dat([("blk.0.ffn_up.weight", 4, [8.0, 2.0, 0.5, 0.0]), ("blk.1.attn_k.weight", 0, [3.0, 1.0])]))
    m = load_imatrix(p)
    assert m.legacy and m.chunk_count == 3 and m.datasets == ["text.txt"] and len(m) == 2
    assert m.weights("blk.0.ffn_up.weight").tolist() == [2.0, 0.5, 0.125, 0.0]  # values / ncall
    assert m.weights("blk.1.attn_k.weight").tolist() == [3.0, 1.0]  # ncall 0: values as stored
    p.write_bytes(_dat([("a.weight", 1, [1.0])], trailer=None))  # the trailer is optional
    assert load_imatrix(p).chunk_count == 0
    with pytest.raises(ValueError, match="writes raw sums"):
        save_imatrix(tmp_path / "x.gguf", m)


@pytest.mark.parametrize("data,match", [
    (b"", "truncated reading the entry count"),
    (struct.pack("<i", 0), "entry count 0"),
    (struct.pack("<i", 1 << 30) + bytes(32), "claims 1073741824 entries"),
    (struct.pack("<ii", 1, 5000) + bytes(16), "entry 0: name length 5000"),
    (struct.pack("<ii", 1, 3) + b"abc" + struct.pack("<ii", 1, 10) + bytes(8), "entry 'abc''s 10 values"),
    (struct.pack("<ii", 1, 3) + b"abc" + struct.pack("<ii", 1, 0), "entry 'abc': value count 0"),
    (struct.pack("<ii", 1, 3) + b"abc" + struct.pack("<ii", -2, 1) + bytes(4), "ncall -2"),
    (struct.pack("<ii", 1, 3) + b"abc" + struct.pack("<ii", 1, 1) + struct.pack("<f", float("nan")), "non-finite"),
    (struct.pack("<ii", 1, 2) + b"\xff\xfe" + struct.pack("<ii", 1, 1) + bytes(4), "not valid UTF-8"),
])
def test_legacy_bad_input_is_a_clear_error(tmp_path, data, match):
    p = tmp_path / "bad.dat"
    p.write_bytes(data)
    with pytest.raises(ValueError, match=match) as e:
        load_imatrix(p)
    assert str(p) in str(e.value)


def _write(p, tensors, meta=None):
    w = gguf.GGUFWriter(str(p), "")
    base = {"imatrix.datasets": ["t.txt"], "imatrix.chunk_count": 1, "imatrix.chunk_size": 8}
    for k, v in {**base, **(meta if meta is not None else {})}.items():
        if v is None:
            continue
        if isinstance(v, list):
            w.add_array(k, v)
        else:
            w.add_uint32(k, v)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tensors,meta,match", [
    ({"a.weight.in_sum2": np.ones(8, np.float32)}, None, "entry 'a.weight' has in_sum2 but no counts"),
    ({"a.weight.counts": np.ones(1, np.float32)}, None, "entry 'a.weight' has counts but no in_sum2"),
    ({"a.weight.in_sum2": np.ones(8, np.float16), "a.weight.counts": np.ones(1, np.float32)}, None,
     "'a.weight.in_sum2' is F16, expected F32"),
    ({"a.weight.in_sum2": np.ones(9, np.float32), "a.weight.counts": np.ones(2, np.float32)}, None,
     "9 sums do not split into 2 experts"),
    ({"a.weight.in_sum2": np.full(8, np.inf, np.float32), "a.weight.counts": np.ones(1, np.float32)}, None,
     "in_sum2 holds non-finite"),
    ({"a.weight.in_sum2": np.ones(8, np.float32), "a.weight.counts": -np.ones(1, np.float32)}, None,
     "counts must be finite and >= 0"),
    ({"a.weight.in_sum2": np.ones(8, np.float32), "a.weight.counts": np.ones(1, np.float32)},
     {"imatrix.chunk_size": None}, "imatrix.chunk_size missing"),
    ({"other": np.ones(8, np.float32)}, None, "no <weight>.in_sum2"),
])
def test_gguf_bad_input_is_a_clear_error(tmp_path, tensors, meta, match):
    p = tmp_path / "bad.gguf"
    _write(p, tensors, meta)
    with pytest.raises(GGUFError, match=match) as e:
        load_imatrix(p)
    assert str(p) in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such imatrix file"):
        load_imatrix(tmp_path / "nope.gguf")


# ------------------------------------------------------------------------------ requantize
@pytest.fixture(scope="module")
def f32_model(tmp_path_factory):
    from gguf_builders import tiny_spec, write_tiny_gguf

    from qwen_vocab import toy_tokenizer_metadata

    path = tmp_path_factory.mktemp("imq") / "tiny-f32.gguf"
    return write_tiny_gguf(path, tiny_spec("qwen3", n_layer=2), toy_tokenizer_metadata())


def _model_imatrix(model_path) -> IMatrix:
    f = hanzo_torch.GGUFFile(model_path)
    g = torch.Generator().manual_seed(11)
    ents = {n: IMatrixEntry(torch.rand(1, i.shape[-1], generator=g).pow(3) * 50, torch.tensor([16]))
            for n, i in f.tensor_info.items() if n.startswith("blk.") and n.endswith("weight") and len(i.shape) == 2}
    return IMatrix(ents, ["calib.txt"], 1, 16)


@pytest.mark.parametrize("ftype", ["Q4_K_M", "IQ4_XS"])
def test_requantize_with_imatrix_uses_the_weights(f32_model, tmp_path, ftype):
    from hanzo_torch.requantize import requantize

    m = _model_imatrix(f32_model)
    p = tmp_path / "im.gguf"
    save_imatrix(p, m)
    out = tmp_path / "out.gguf"
    plan = requantize(str(f32_model), str(out), ftype, progress=False, imatrix=str(p))
    src, dst = hanzo_torch.GGUFFile(f32_model), hanzo_torch.GGUFFile(out)
    name = "blk.0.ffn_down.weight"
    x = src.tensors[name].dequantize()
    want = hanzo_torch.quantize(x, plan[name], quant_weights=m.weights(name))
    assert torch.equal(dst.packed(name).reshape(want.shape), want)
    assert not torch.equal(want, hanzo_torch.quantize(x, plan[name]))  # the weights change the bytes
    # output.weight has no entry (llama-imatrix skips it): quantized without weights
    if "output.weight" in plan:
        o = src.tensors["output.weight"].dequantize()
        assert torch.equal(dst.packed("output.weight").reshape(-1), hanzo_torch.quantize(o, plan["output.weight"]).reshape(-1))
    assert dst.metadata["quantize.imatrix.file"] == str(p)
    assert dst.metadata["quantize.imatrix.dataset"] == "calib.txt"
    assert dst.metadata["quantize.imatrix.entries_count"] == len(m)
    assert dst.metadata["quantize.imatrix.chunks_count"] == 1


def test_iq4_recipes(f32_model, tmp_path):
    """llama-quantize's IQ4_NL / IQ4_XS choices: output Q6_K, ffn_down Q5_K in the first n/8 layers
    without an imatrix only, attn_v Q5_K when n_gqa >= 4 (the toy model: n_gqa 2)."""
    from hanzo_torch.requantize import _State, requantize, tensor_type

    plan = requantize(str(f32_model), str(tmp_path / "a.gguf"), "IQ4_XS", progress=False)
    assert plan["blk.0.attn_q.weight"] == "IQ4_XS" and plan["blk.0.attn_v.weight"] == "IQ4_XS"
    assert hanzo_torch.GGUFFile(tmp_path / "a.gguf").metadata["general.file_type"] == 30
    for ftype in ("IQ4_NL", "IQ4_XS"):
        st = _State(n_layer=16, n_attn_v=16, tied=False, n_gqa=6)
        assert tensor_type("blk.0.attn_v.weight", (256, 1536), "F32", ftype, st) == "Q5_K"
        assert tensor_type("blk.0.ffn_down.weight", (1536, 8960), "F32", ftype, st) == "Q5_K"
        assert tensor_type("blk.2.ffn_down.weight", (1536, 8960), "F32", ftype, st) == ftype
        assert tensor_type("output.weight", (1000, 1536), "F32", ftype, st) == "Q6_K"
        assert tensor_type("token_embd.weight", (1000, 1536), "F32", ftype, st) == ftype
        st = _State(n_layer=16, n_attn_v=16, tied=False, has_imatrix=True)
        assert tensor_type("blk.0.ffn_down.weight", (1536, 8960), "F32", ftype, st) == ftype
        assert tensor_type("blk.0.attn_v.weight", (256, 1536), "F32", ftype, st) == ftype
    st = _State(n_layer=4, n_attn_v=4, tied=False)
    assert tensor_type("blk.0.attn_q.weight", (64, 96), "F32", "IQ4_XS", st) == "IQ4_NL"  # 96 % 256: fallback
    st = _State(n_layer=16, n_attn_v=16, tied=False, has_imatrix=True)
    assert tensor_type("blk.0.ffn_down.weight", (64, 256), "F32", "Q4_0", st) == "Q4_1"


def test_requantize_imatrix_errors(f32_model, tmp_path):
    from hanzo_torch.requantize import requantize

    f = hanzo_torch.GGUFFile(f32_model)
    k = f.tensor_info["blk.0.attn_q.weight"].shape[-1]
    bad = IMatrix({"blk.0.attn_q.weight": IMatrixEntry(torch.ones(1, k + 32), torch.tensor([4]))}, ["t"], 1, 4)
    out = tmp_path / "o.gguf"
    with pytest.raises(ValueError, match=rf"imatrix entry 'blk.0.attn_q.weight' has {k + 32} values"):
        requantize(str(f32_model), str(out), "Q4_K_M", progress=False, imatrix=bad)
    assert not out.exists()
    good = IMatrix({"blk.0.attn_q.weight": IMatrixEntry(torch.ones(1, k), torch.tensor([4]))}, ["t"], 1, 4)
    # Q5_0 with an imatrix: the weighted Q5_0 quantizer (2 layers: no Q5_1 ffn_down, n/8 = 0)
    plan = requantize(str(f32_model), str(out), "Q5_0", progress=False, imatrix=good)
    assert plan["blk.0.ffn_down.weight"] == plan["blk.0.attn_q.weight"] == "Q5_0"
    x = f.tensors["blk.0.attn_q.weight"].dequantize()
    want = hanzo_torch.quantize(x, "Q5_0", quant_weights=torch.ones(k))
    assert torch.equal(hanzo_torch.GGUFFile(out).packed("blk.0.attn_q.weight").reshape(want.shape), want)
    assert not torch.equal(want, hanzo_torch.quantize(x, "Q5_0"))
    # Q8_0 ignores importance weights in ggml: same bytes with and without
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    requantize(str(f32_model), str(a), "Q8_0", progress=False, imatrix=good)
    requantize(str(f32_model), str(b), "Q8_0", progress=False)
    fa, fb = hanzo_torch.GGUFFile(a), hanzo_torch.GGUFFile(b)
    assert all(torch.equal(fa.packed(n), fb.packed(n)) for n in fa.tensor_info)


def test_cli_quantize_imatrix(f32_model, tmp_path, capsys):
    from hanzo_torch import cli

    p = tmp_path / "im.gguf"
    save_imatrix(p, _model_imatrix(f32_model))
    out = tmp_path / "o.gguf"
    assert cli.main(["quantize", str(f32_model), str(out), "iq4_nl", "--imatrix", str(p)]) == 0
    assert "IQ4_NL" in capsys.readouterr().out
    assert hanzo_torch.GGUFFile(out).metadata["quantize.imatrix.file"] == str(p)
    bad = tmp_path / "bad.dat"
    bad.write_bytes(b"\0\0\0\0")
    assert cli.main(["quantize", str(f32_model), str(tmp_path / "x.gguf"), "Q4_K_M", "--imatrix", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "--imatrix" in err and "entry count 0" in err
    assert cli.main(["quantize", str(f32_model), str(tmp_path / "x.gguf"), "Q4_K_M", "--imatrix",
                     str(tmp_path / "none.gguf")]) == 1
    assert "no such imatrix file" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
