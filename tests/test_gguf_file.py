"""GGUFFile / save_gguf: typed metadata, torch-order shapes, zero-copy views, byte-identical round
trips, and one test per malformed-file case. ``gguf.GGUFReader`` is the oracle for what a file
holds."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType as VT

import hanzo_torch
from hanzo_torch import GGUFError, GGUFFile, GGUFTensor, save_gguf
from hanzo_torch.gguf_file import TENSOR_ARRAY_MIN

# ---------------------------------------------------------------------- helpers


def packed_random(qtype: str, shape, seed=0) -> torch.Tensor:
    """Random bytes shaped as ``qtype`` packed data of logical ``shape`` (file-level tests only)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (*shape[:-1], shape[-1] // block * size), dtype=torch.uint8, generator=g)


def sample_tensors() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "token_embd.weight": GGUFTensor(packed_random("Q4_K", (8, 256), 1), "Q4_K", (8, 256)),
        "blk.0.attn_q.weight": GGUFTensor(packed_random("Q8_0", (5, 64), 2), "Q8_0", (5, 64)),
        "blk.0.ffn_gate_exps.weight": GGUFTensor(packed_random("Q6_K", (3, 4, 256), 3), "Q6_K", (3, 4, 256)),
        "blk.0.attn_norm.weight": torch.randn(64, generator=g),
        "blk.0.ffn_down.weight": torch.randn(6, 32, generator=g).to(torch.float16),
        "output.weight": torch.randn(4, 16, generator=g).to(torch.bfloat16),
    }


SAMPLE_METADATA = {
    "general.architecture": "qwen3",
    "general.name": "tiny test model \u00e9\u4e2d",
    "qwen3.block_count": 2,
    "qwen3.context_length": 4096,
    "qwen3.rope.freq_base": 1000000.0,
    "qwen3.attention.layer_norm_rms_epsilon": 1e-6,
    "tokenizer.ggml.add_bos_token": False,
    "tokenizer.ggml.tokens": ["a", "b", "\u0120hello", ""],
    "tokenizer.ggml.token_type": [1, 1, 3, 1],
    "tokenizer.ggml.scores": [0.0, -1.5, 2.25, 3.0],
    "tokenizer.chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    "custom.empty_string": "",
    "custom.negative": -7,
    "custom.big": 2**40,
    "custom.bool_list": [True, False, True],
    "custom.nested": [[1, 2], [3, 4, 5]],
}


@pytest.fixture
def sample_file(tmp_path):
    path = tmp_path / "sample.gguf"
    save_gguf(path, sample_tensors(), SAMPLE_METADATA)
    return path


def reader_value(field):
    """What gguf.GGUFReader says a field holds (flattened for nested arrays)."""
    return field.contents()


# ---------------------------------------------------------------------- metadata


def test_typed_metadata_explicit_types_match_gguf_reader(tmp_path):
    big = list(range(TENSOR_ARRAY_MIN + 5))
    meta = {
        "general.architecture": "qwen2",
        "t.u8": 255, "t.i8": -128, "t.u16": 65535, "t.i16": -32768,
        "t.u32": 2**32 - 1, "t.i32": -(2**31), "t.u64": 2**64 - 1, "t.i64": -(2**63),
        "t.f32": 0.5, "t.f64": 0.1, "t.bool": True, "t.str": "x\ny",
        "t.arr_u8": [0, 1, 255], "t.arr_i16": [-1, 2], "t.arr_f64": [0.1, 0.2],
        "t.arr_u32_big": big, "t.arr_f32_big": torch.arange(TENSOR_ARRAY_MIN + 1, dtype=torch.float32),
    }
    types = {
        "t.u8": VT.UINT8, "t.i8": VT.INT8, "t.u16": VT.UINT16, "t.i16": VT.INT16,
        "t.u32": VT.UINT32, "t.i32": VT.INT32, "t.u64": VT.UINT64, "t.i64": VT.INT64,
        "t.f32": VT.FLOAT32, "t.f64": VT.FLOAT64,
        "t.arr_u8": (VT.ARRAY, VT.UINT8), "t.arr_i16": (VT.ARRAY, VT.INT16),
        "t.arr_f64": (VT.ARRAY, VT.FLOAT64), "t.arr_u32_big": (VT.ARRAY, VT.UINT32),
    }
    path = tmp_path / "typed.gguf"
    save_gguf(path, {}, meta, metadata_types=types)
    reader = gguf.GGUFReader(path)
    with GGUFFile(path) as f:
        assert set(f.metadata) == set(meta)
        for key, want in types.items():
            want_t = want[0] if isinstance(want, tuple) else want
            assert f.metadata.value_type(key) == want_t, key
            assert reader.fields[key].types[0] == want_t, key
            if isinstance(want, tuple):
                assert f.metadata.element_type(key) == want[1] == reader.fields[key].types[-1]
        for key in meta:
            got = f.metadata[key]
            ref = reader_value(reader.fields[key])
            if isinstance(got, torch.Tensor):
                assert got.tolist() == ref, key
            else:
                assert got == ref and type(got) is type(ref), key
        assert f.metadata["t.f64"] == 0.1  # FLOAT64 is exact
        assert f.metadata["t.f32"] == 0.5
        assert f.metadata.value_type("t.arr_f32_big") == VT.ARRAY
        assert f.metadata.element_type("t.arr_f32_big") == VT.FLOAT32
        # big numeric arrays come back as tensors (UINT32 widened to int64), small ones as lists
        big_t = f.metadata["t.arr_u32_big"]
        assert isinstance(big_t, torch.Tensor) and big_t.dtype == torch.int64 and big_t.tolist() == big
        assert isinstance(f.metadata["t.arr_u8"], list)
        assert f.get_list("t.arr_u32_big") == big
        assert torch.equal(f.get_array("t.arr_i16"), torch.tensor([-1, 2], dtype=torch.int16))
        assert f.metadata.element_type("t.u8") is None


def test_inferred_metadata_types(sample_file):
    reader = gguf.GGUFReader(sample_file)
    with GGUFFile(sample_file) as f:
        md = f.metadata
        expect = {
            "qwen3.block_count": VT.UINT32, "custom.negative": VT.INT32, "custom.big": VT.UINT64,
            "qwen3.rope.freq_base": VT.FLOAT32, "tokenizer.ggml.add_bos_token": VT.BOOL,
            "general.name": VT.STRING, "tokenizer.ggml.tokens": VT.ARRAY,
        }
        for key, vt in expect.items():
            assert md.value_type(key) == vt == reader.fields[key].types[0], key
        assert md.element_type("tokenizer.ggml.tokens") == VT.STRING
        assert md.element_type("tokenizer.ggml.token_type") == VT.UINT32
        assert md.element_type("tokenizer.ggml.scores") == VT.FLOAT32
        assert md.element_type("custom.nested") == VT.ARRAY
        assert md["qwen3.block_count"] == 2 and isinstance(md["qwen3.block_count"], int)
        assert md["general.name"] == SAMPLE_METADATA["general.name"]
        assert md["tokenizer.ggml.tokens"] == ["a", "b", "\u0120hello", ""]
        assert md["tokenizer.ggml.scores"] == [0.0, -1.5, 2.25, 3.0]
        assert md["custom.nested"] == [[1, 2], [3, 4, 5]]
        assert md["custom.bool_list"] == [True, False, True]
        assert md["custom.empty_string"] == ""
        assert md["qwen3.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6, rel=1e-7)
        assert f.architecture == "qwen3"
        assert f.get_int("qwen3.block_count") == 2
        assert f.get_float("qwen3.context_length") == 4096.0  # ints are accepted as floats
        assert f.get_bool("tokenizer.ggml.add_bos_token") is False
        # the whole mapping agrees with GGUFReader (flattened nested arrays aside)
        for key in md:
            if key != "custom.nested":
                assert md[key] == reader_value(reader.fields[key]), key


def test_typed_getters_raise_naming_file_and_key(sample_file):
    with GGUFFile(sample_file) as f:
        with pytest.raises(GGUFError, match=r"sample\.gguf.*'general\.name'.*STRING.*integer"):
            f.get_int("general.name")
        with pytest.raises(GGUFError, match="'qwen3.block_count'.*UINT32.*string"):
            f.get_str("qwen3.block_count")
        with pytest.raises(GGUFError, match="'tokenizer.ggml.add_bos_token'.*BOOL.*integer"):
            f.get_int("tokenizer.ggml.add_bos_token")
        with pytest.raises(GGUFError, match="'qwen3.block_count'.*bool"):
            f.get_bool("qwen3.block_count")
        with pytest.raises(GGUFError, match="'tokenizer.ggml.tokens'.*ARRAY of STRING.*numeric array"):
            f.get_array("tokenizer.ggml.tokens")
        with pytest.raises(GGUFError, match="'general.name'.*array"):
            f.get_list("general.name")
        with pytest.raises(GGUFError, match="'general.name'.*float"):
            f.get_float("general.name")
        with pytest.raises(GGUFError, match=r"sample\.gguf: missing metadata key 'qwen3\.nope'"):
            f.get_int("qwen3.nope")
        assert f.get_int("qwen3.nope", 5) == 5
        assert f.get_str("qwen3.nope", None) is None
        assert f.get("qwen3.nope") is None
        with pytest.raises(KeyError):
            f.metadata["qwen3.nope"]
        assert isinstance(GGUFError("x"), ValueError)


# ---------------------------------------------------------------------- tensors


def test_torch_order_shapes_and_packed_bytes_match_gguf_reader(sample_file):
    src = sample_tensors()
    reader = gguf.GGUFReader(sample_file)
    by_name = {t.name: t for t in reader.tensors}
    with GGUFFile(sample_file) as f:
        assert list(f.tensor_info) == list(src)
        assert [i.name for i in f.raw_tensor_info] == list(src)
        for name, t in src.items():
            info = f.tensor_info[name]
            rt = by_name[name]
            assert info.shape == tuple(t.shape) == tuple(reversed(rt.shape.tolist()))
            assert info.qtype == rt.tensor_type.name and info.type_id == int(rt.tensor_type)
            assert info.offset == rt.data_offset and info.nbytes == rt.n_bytes
            packed = f.packed(name)
            assert packed.dtype == torch.uint8 and tuple(packed.shape) == info.packed_shape
            want = t.packed if isinstance(t, GGUFTensor) else t.contiguous().view(torch.uint8)
            assert torch.equal(packed, want), name
            assert np.array_equal(packed.numpy().reshape(-1), np.asarray(rt.data).view(np.uint8).reshape(-1))
        assert f.tensor_info["blk.0.attn_q.weight"].shape == (5, 64)  # (out_features, in_features)
        assert f.tensor_info["blk.0.ffn_gate_exps.weight"].packed_shape == (3, 4, 210)
        assert f.tensor_info["blk.0.ffn_down.weight"].qtype == "F16"
        assert f.tensor_info["output.weight"].qtype == "BF16"
        assert f.tensor_info["blk.0.attn_norm.weight"].qtype == "F32"


def test_tensors_are_gguf_tensors_in_torch_order(sample_file):
    src = sample_tensors()
    with GGUFFile(sample_file) as f:
        ts = f.tensors
        assert list(ts) == list(src)
        for name, t in ts.items():
            assert isinstance(t, GGUFTensor)
            assert tuple(t.shape) == tuple(src[name].shape)
            assert t.qtype == f.tensor_info[name].qtype
            assert torch.equal(t.packed, f.packed(name))
        q = ts["blk.0.attn_q.weight"]
        assert tuple(q.shape) == (5, 64) and tuple(q.packed.shape) == (5, 68)
        # dense tensors decode to the values written
        assert torch.equal(ts["blk.0.ffn_down.weight"].dequantize(torch.float16), src["blk.0.ffn_down.weight"])
        assert torch.equal(ts["output.weight"].dequantize(torch.bfloat16), src["output.weight"])
        assert torch.equal(ts["blk.0.attn_norm.weight"].dequantize(), src["blk.0.attn_norm.weight"])


def test_packed_views_are_zero_copy_and_copy_on_write(sample_file):
    raw = sample_file.read_bytes()
    with GGUFFile(sample_file) as f:
        base = np.frombuffer(f._mmap, dtype=np.uint8)
        lo = base.ctypes.data
        for name, info in f.tensor_info.items():
            p = f.packed(name)
            assert p.data_ptr() == lo + info.offset  # a view of the mapping, not a copy
            assert p.untyped_storage().nbytes() == info.nbytes  # own storage: safe to save alone
        p = f.packed("blk.0.attn_q.weight")
        p.fill_(0)  # private mapping: the file does not change
        del base
    assert sample_file.read_bytes() == raw


def test_close_keeps_handed_out_tensors_valid(sample_file):
    f = GGUFFile(sample_file)
    t = f.tensors["blk.0.attn_q.weight"]
    want = t.packed.clone()
    f.close()
    assert f.closed
    assert torch.equal(t.packed, want)  # the view keeps the mapping alive
    assert f.metadata["tokenizer.ggml.tokens"][2] == "\u0120hello"  # metadata outlives close
    with pytest.raises(GGUFError, match="closed"):
        f.tensors
    with pytest.raises(GGUFError, match="closed"):
        f.packed("output.weight")
    f.close()  # idempotent


def test_maps_tells_views_from_copies(sample_file):
    f = GGUFFile(sample_file)
    view = f.packed("blk.0.attn_q.weight")
    assert f.maps(view) and f.maps(f.tensors["blk.0.attn_q.weight"].packed)
    assert not f.maps(view.clone()) and not f.maps(torch.zeros(4))
    f.close()
    assert not f.maps(view)


def test_prefetch_is_advisory(sample_file):
    """prefetch() asks for readahead where madvise exists, leaves contents and views untouched,
    and is a no-op (False) on a closed file."""
    import mmap

    raw = sample_file.read_bytes()
    f = GGUFFile(sample_file)
    t = f.tensors["blk.0.attn_q.weight"]
    want = t.packed.clone()
    assert f.prefetch() is (hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MADV_WILLNEED"))
    assert torch.equal(t.packed, want)
    f.close()
    assert f.prefetch() is False
    assert sample_file.read_bytes() == raw


# ---------------------------------------------------------------------- round trip


def test_round_trip_is_byte_identical(sample_file, tmp_path):
    out = tmp_path / "again.gguf"
    with GGUFFile(sample_file) as f:
        save_gguf(out, f.tensors, f.metadata)
        with GGUFFile(out) as g:
            assert list(g.metadata) == list(f.metadata)
            for key in f.metadata:
                assert g.metadata.value_type(key) == f.metadata.value_type(key), key
                assert g.metadata.element_type(key) == f.metadata.element_type(key), key
                assert g.metadata[key] == f.metadata[key], key
            assert list(g.tensor_info) == list(f.tensor_info)
            for name in f.tensor_info:
                assert g.tensor_info[name].shape == f.tensor_info[name].shape
                assert g.tensor_info[name].qtype == f.tensor_info[name].qtype
                assert torch.equal(g.packed(name), f.packed(name)), name
    # same types, order and alignment: the whole file comes out identical
    assert out.read_bytes() == sample_file.read_bytes()


def test_round_trip_preserves_types_that_inference_would_change(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    meta = {"k.u8": 3, "k.i64": 5, "k.f64": 0.25, "k.arr": [1, 2, 3], "general.alignment": 64}
    types = {"k.u8": VT.UINT8, "k.i64": VT.INT64, "k.f64": VT.FLOAT64, "k.arr": (VT.ARRAY, VT.INT16)}
    save_gguf(a, {"w": torch.ones(2, 3)}, meta, architecture="llama", metadata_types=types)
    with GGUFFile(a) as f:
        assert f.alignment == 64 and f.data_offset % 64 == 0
        assert f.tensor_info["w"].offset % 64 == 0
        assert f.architecture == "llama" and list(f.metadata)[0] == "general.architecture"
        save_gguf(b, f.tensors, f.metadata)
    with GGUFFile(b) as g:
        for key, vt in types.items():
            want = vt[0] if isinstance(vt, tuple) else vt
            assert g.metadata.value_type(key) == want
        assert g.metadata.element_type("k.arr") == VT.INT16
        assert g.alignment == 64
    assert a.read_bytes() == b.read_bytes()


def test_save_without_architecture_and_with_numpy_arrays(tmp_path):
    path = tmp_path / "noarch.gguf"
    save_gguf(path, {"x": np.arange(8, dtype=np.float32)}, {"a.ids": np.array([1, -2], dtype=np.int64)})
    with GGUFFile(path) as f:
        assert f.architecture is None and "general.architecture" not in f.metadata
        assert f.metadata.element_type("a.ids") == VT.INT64 and f.metadata["a.ids"] == [1, -2]
        assert torch.equal(f.packed("x").view(torch.float32), torch.arange(8, dtype=torch.float32))


@pytest.mark.parametrize(
    "tensors, meta, kwargs, match",
    [
        ({}, {"k": []}, {}, "'k'.*empty array"),
        ({}, {"k": 300}, {"metadata_types": {"k": VT.UINT8}}, "'k'.*300 out of range for UINT8"),
        ({}, {"k": "s"}, {"metadata_types": {"k": VT.INT32}}, "'k'.*INT32 needs an int"),
        ({}, {"k": 2**64}, {}, "does not fit in 64 bits"),
        ({}, {"k": [1, "a"]}, {}, "'k'.*mixes element types"),
        ({}, {"k": object()}, {}, "cannot store a object"),
        ({}, {"general.architecture": "a"}, {"architecture": "b"}, "conflicts"),
        ({}, {"general.alignment": 48}, {}, "power of two"),
        ({"w": torch.zeros(2, dtype=torch.int32)}, {}, {}, "'w'.*float32/float16/bfloat16"),
        ({"w": torch.tensor(1.0)}, {}, {}, "'w'.*0-dim"),
        ({"w": GGUFTensor(torch.zeros(2, 34, dtype=torch.uint8), "Q8_0", (2, 32)).T}, {}, {}, "transposed"),
    ],
)
def test_save_gguf_rejects_bad_input(tmp_path, tensors, meta, kwargs, match):
    path = tmp_path / "bad.gguf"
    with pytest.raises(ValueError, match=match):
        save_gguf(path, tensors, meta, **kwargs)
    assert not path.exists() and not (tmp_path / "bad.gguf.tmp").exists()


# ---------------------------------------------------------------------- malformed files


def _tensor_info_offset(raw: bytes, name: str) -> int:
    """Byte offset just after ``name`` in the tensor-info section (n_dims follows)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    pos = raw.rindex(key)
    return pos + len(key)


def _patched(tmp_path, raw: bytes, at: int, data: bytes, name="bad.gguf"):
    buf = bytearray(raw)
    buf[at : at + len(data)] = data
    path = tmp_path / name
    path.write_bytes(bytes(buf))
    return path


def _open_fails(path, match):
    with pytest.raises(GGUFError, match=match) as e:
        GGUFFile(path)
    assert str(path) in str(e.value)  # every message names the file


def test_error_wrong_magic(sample_file, tmp_path):
    _open_fails(_patched(tmp_path, sample_file.read_bytes(), 0, b"GGUG"), "not a GGUF file: magic")


def test_error_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    _open_fails(p, "empty")


@pytest.mark.parametrize("version", [1, 4, 0xFFFF])
def test_error_unsupported_version(sample_file, tmp_path, version):
    _open_fails(_patched(tmp_path, sample_file.read_bytes(), 4, struct.pack("<I", version)), f"unsupported GGUF version {version}")


def test_error_big_endian(sample_file, tmp_path):
    _open_fails(_patched(tmp_path, sample_file.read_bytes(), 4, struct.pack(">I", 3)), "big-endian")


@pytest.mark.parametrize("cut", [3, 10, 23, 60, 200, -1])
def test_error_truncated_header(sample_file, tmp_path, cut):
    raw = sample_file.read_bytes()
    cut = cut if cut >= 0 else _tensor_info_offset(raw, "output.weight") + 6  # inside the last tensor info
    p = tmp_path / "trunc.gguf"
    p.write_bytes(raw[:cut])
    _open_fails(p, "truncated file|cannot fit")


def test_error_truncated_tensor_data(sample_file, tmp_path):
    raw = sample_file.read_bytes()
    with GGUFFile(sample_file) as f:
        last = f.raw_tensor_info[-1]
    p = tmp_path / "trunc.gguf"
    p.write_bytes(raw[: last.offset + last.nbytes - 1])
    _open_fails(p, f"tensor '{last.name}': data .* past the end of the file")


def test_error_tensor_offset_past_end(sample_file, tmp_path):
    raw = sample_file.read_bytes()
    at = _tensor_info_offset(raw, "blk.0.attn_q.weight") + 4 + 2 * 8 + 4  # n_dims, 2 dims, type
    _open_fails(_patched(tmp_path, raw, at, struct.pack("<Q", 1 << 40)), "'blk.0.attn_q.weight': data .* past the end")
    _open_fails(_patched(tmp_path, raw, at, struct.pack("<Q", 2**64 - 32)), "'blk.0.attn_q.weight': data .* past the end")


def test_error_misaligned_offset(sample_file, tmp_path):
    raw = sample_file.read_bytes()
    at = _tensor_info_offset(raw, "blk.0.attn_q.weight") + 4 + 2 * 8 + 4
    (off,) = struct.unpack_from("<Q", raw, at)
    _open_fails(_patched(tmp_path, raw, at, struct.pack("<Q", off + 1)), "'blk.0.attn_q.weight': data offset .* alignment")


@pytest.mark.parametrize("type_id", [4, 5, 31, 99, 2**32 - 1])
def test_error_unknown_ggml_type(sample_file, tmp_path, type_id):
    raw = sample_file.read_bytes()
    at = _tensor_info_offset(raw, "blk.0.attn_q.weight") + 4 + 2 * 8
    assert struct.unpack_from("<I", raw, at)[0] == GGMLQuantizationType.Q8_0
    _open_fails(_patched(tmp_path, raw, at, struct.pack("<I", type_id)), f"'blk.0.attn_q.weight' has unknown ggml type id {type_id}")


def test_error_row_not_multiple_of_block(sample_file, tmp_path):
    raw = sample_file.read_bytes()
    at = _tensor_info_offset(raw, "blk.0.attn_q.weight") + 4
    assert struct.unpack_from("<Q", raw, at)[0] == 64  # ne[0] = row length
    _open_fails(_patched(tmp_path, raw, at, struct.pack("<Q", 48)), "'blk.0.attn_q.weight': row length 48 .* Q8_0 block size 32")


@pytest.mark.parametrize("n_dims", [0, 5, 2**32 - 1])
def test_error_bad_n_dims(sample_file, tmp_path, n_dims):
    raw = sample_file.read_bytes()
    at = _tensor_info_offset(raw, "blk.0.attn_q.weight")
    _open_fails(_patched(tmp_path, raw, at, struct.pack("<I", n_dims)), f"'blk.0.attn_q.weight' has {n_dims} dims")


def test_error_duplicate_tensor_names(tmp_path):
    p = tmp_path / "dup.gguf"
    save_gguf(p, {"a.weight": torch.ones(4), "b.weight": torch.ones(4)}, {})
    raw = p.read_bytes()
    at = raw.rindex(b"b.weight")
    _open_fails(_patched(tmp_path, raw, at, b"a.weight"), "duplicate tensor name 'a.weight'")


def test_error_duplicate_metadata_key(tmp_path):
    p = tmp_path / "dup.gguf"
    save_gguf(p, {}, {"k.aa": 1, "k.bb": 2})
    raw = p.read_bytes()
    _open_fails(_patched(tmp_path, raw, raw.index(b"k.bb"), b"k.aa"), "duplicate metadata key 'k.aa'")


def test_error_wrong_type_alignment(tmp_path):
    p = tmp_path / "al.gguf"
    with pytest.raises(ValueError, match="must be UINT32"):  # save_gguf refuses to write it
        save_gguf(p, {}, {"general.alignment": 16}, metadata_types={"general.alignment": VT.UINT64})
    w = gguf.GGUFWriter(p, "llama")
    w.add_uint64("general.alignment", 16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _open_fails(p, "'general.alignment' must be UINT32")
    save_gguf(p, {}, {"general.alignment": 16})
    raw = p.read_bytes()
    at = raw.index(b"general.alignment") + len("general.alignment") + 4
    _open_fails(_patched(tmp_path, raw, at, struct.pack("<I", 24)), "power of two, got 24")


@pytest.mark.parametrize(
    "field, value",
    [
        ("tensor_count", 2**64 - 1),
        ("tensor_count", 10**6),
        ("kv_count", 2**63),
        ("kv_count", 1000),
    ],
)
def test_error_huge_header_counts(sample_file, tmp_path, field, value):
    at = 8 if field == "tensor_count" else 16
    _open_fails(_patched(tmp_path, sample_file.read_bytes(), at, struct.pack("<Q", value)), "cannot fit|truncated")


@pytest.mark.parametrize("count", [2**64 - 1, 2**40, 10**5])
def test_error_huge_array_count(tmp_path, count):
    p = tmp_path / "arr.gguf"
    save_gguf(p, {}, {"k.ints": [1, 2, 3], "k.strs": ["x", "y"]})
    raw = p.read_bytes()
    for key in ("k.ints", "k.strs"):
        at = raw.index(key.encode()) + len(key) + 4 + 4  # value type, element type
        _open_fails(_patched(tmp_path, raw, at, struct.pack("<Q", count)), f"'{key}'.*(cannot fit|truncated)")


def test_error_huge_string_length(sample_file, tmp_path):
    raw = sample_file.read_bytes()
    key = b"general.name"
    at = raw.index(key) + len(key) + 4
    _open_fails(_patched(tmp_path, raw, at, struct.pack("<Q", 2**63)), "truncated file: metadata key 'general.name'")


def test_error_unknown_value_type(sample_file, tmp_path):
    raw = sample_file.read_bytes()
    at = raw.index(b"general.name") + len("general.name")
    _open_fails(_patched(tmp_path, raw, at, struct.pack("<I", 13)), "'general.name': unknown GGUF value type 13")


def test_error_invalid_utf8_and_bad_bool(sample_file, tmp_path):
    raw = sample_file.read_bytes()
    _open_fails(_patched(tmp_path, raw, raw.index(b"general.name"), b"\xff"), "metadata key #.* not valid UTF-8")
    at = raw.index(b"tokenizer.ggml.add_bos_token") + len("tokenizer.ggml.add_bos_token") + 4
    _open_fails(_patched(tmp_path, raw, at, b"\x02"), "'tokenizer.ggml.add_bos_token': bool value byte is 2")
    # array contents are decoded on access: the error names the key there
    p = _patched(tmp_path, raw, raw.index(b"\xc4\xa0hello"), b"\xc4\x20")
    with GGUFFile(p) as f:
        with pytest.raises(GGUFError, match="'tokenizer.ggml.tokens': string 2 is not valid UTF-8"):
            f.metadata["tokenizer.ggml.tokens"]


def test_error_unsupported_format_for_tensors(tmp_path):
    p = tmp_path / "i32.gguf"
    import gguf as g

    w = g.GGUFWriter(p, "llama")
    w.add_tensor("ids", np.arange(4, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(p) as f:
        assert f.tensor_info["ids"].qtype == "I32"
        assert torch.equal(f.packed("ids").view(torch.int32), torch.arange(4, dtype=torch.int32))
        with pytest.raises(GGUFError, match="'ids' \\(I32\\)"):
            f.tensors


def test_public_api_exports():
    assert hanzo_torch.GGUFFile is GGUFFile and hanzo_torch.save_gguf is save_gguf
    assert issubclass(hanzo_torch.GGUFError, ValueError)


def test_error_dims_overflow(sample_file, tmp_path):
    raw = sample_file.read_bytes()
    at = _tensor_info_offset(raw, "blk.0.attn_q.weight") + 4 + 8  # ne[1]
    _open_fails(_patched(tmp_path, raw, at, struct.pack("<Q", 2**62)), "'blk.0.attn_q.weight': dims .* overflow")


def test_empty_dim_tensor_loads(tmp_path):
    p = tmp_path / "empty_dim.gguf"
    save_gguf(p, {"e": torch.zeros(0, 8), "w": torch.ones(3)}, {})
    with GGUFFile(p) as f:
        assert f.tensor_info["e"].shape == (0, 8) and f.tensor_info["e"].nbytes == 0
        assert tuple(f.packed("e").shape) == (0, 32)
        assert tuple(f.tensors["e"].shape) == (0, 8)
        assert torch.equal(f.tensors["w"].dequantize(), torch.ones(3))


def test_version_2_loads(sample_file, tmp_path):
    p = _patched(tmp_path, sample_file.read_bytes(), 4, struct.pack("<I", 2))  # v2 layout == v3 layout
    with GGUFFile(p, dtype=torch.bfloat16) as f:
        assert f.version == 2
        assert f.metadata["qwen3.block_count"] == 2
        assert f.tensors["blk.0.attn_q.weight"].dtype == torch.bfloat16


def _raw_gguf(kv: bytes, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv) + kv


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def test_error_arrays_nested_too_deep(tmp_path):
    depth = 12
    value = struct.pack("<I", VT.ARRAY)  # the key's value type
    for _ in range(depth - 1):
        value += struct.pack("<IQ", VT.ARRAY, 1)
    value += struct.pack("<IQ", VT.UINT8, 1) + b"\x07"
    p = tmp_path / "deep.gguf"
    p.write_bytes(_raw_gguf(_key("k.deep") + value, 1))
    _open_fails(p, "'k.deep'.*nested more than 8 deep")
    # a shallow nest of the same construction loads and decodes
    shallow = struct.pack("<I", VT.ARRAY) + struct.pack("<IQ", VT.ARRAY, 1) + struct.pack("<IQ", VT.UINT8, 2) + b"\x07\x09"
    p.write_bytes(_raw_gguf(_key("k.nest") + shallow, 1))
    with GGUFFile(p) as f:
        assert f.metadata["k.nest"] == [[7, 9]] and f.tensor_info == {}


def test_error_bad_bool_in_array_raises_on_access(tmp_path):
    value = struct.pack("<IIQ", VT.ARRAY, VT.BOOL, 3) + b"\x01\x00\x05"
    p = tmp_path / "bools.gguf"
    p.write_bytes(_raw_gguf(_key("k.flags") + value, 1))
    with GGUFFile(p) as f:
        with pytest.raises(GGUFError, match="'k.flags': bool array holds a byte other than 0/1"):
            f.metadata["k.flags"]


def test_deferred_tensors_are_made_one_at_a_time_while_writing(tmp_path):
    from hanzo_torch.gguf_file import DeferredTensor
    x = torch.randn(4, 64)
    q = hanzo_torch.quantize(x, "Q8_0")
    made = []

    def make(name, value):
        def produce():
            made.append(name)
            return value
        return produce
    tensors = {"a": DeferredTensor((4, 64), "Q8_0", make("a", GGUFTensor(q, "Q8_0", (4, 64)))),
               "b": DeferredTensor((3,), "F32", make("b", torch.arange(3.0)))}
    path = tmp_path / "d.gguf"
    save_gguf(path, tensors, {"general.name": "d"})
    assert made == ["a", "b"]
    f = GGUFFile(path)
    assert f.tensor_info["a"].qtype == "Q8_0" and tuple(f.tensor_info["a"].shape) == (4, 64)
    assert torch.equal(f.packed("a").reshape(-1), q.reshape(-1))
    assert torch.equal(f.tensors["b"].dequantize(torch.float32), torch.arange(3.0))
    f.close()
    bad = {"a": DeferredTensor((4, 64), "Q8_0", lambda: torch.zeros(4, 64))}  # F32, not Q8_0
    with pytest.raises(ValueError, match="deferred as Q8_0"):
        save_gguf(tmp_path / "bad.gguf", bad)
    assert not (tmp_path / "bad.gguf").exists() and not (tmp_path / "bad.gguf.tmp").exists()
