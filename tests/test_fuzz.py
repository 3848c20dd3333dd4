"""Seeded fuzzing of the GGUF reader: byte mutations, integer smashes, insertions/deletions and
truncations of a small valid file. Every case must either load (and then every metadata value
and every tensor is readable or raises GGUFError) or raise GGUFError; anything else (another
exception, a crash, a hang) fails. When a mutated file loads, ``gguf.GGUFReader`` (if it accepts
the file too) must agree with us on the metadata and on every tensor's type, shape and bytes."""
from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import time

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType as VT

from hanzo_torch import GGUFError, GGUFFile, GGUFTensor, save_gguf

from byte_mutations import mutate

N_CASES = 3000
SEED = 20240601
CASE_TIMEOUT_S = 10  # a hang in one case fails the test instead of stalling the suite


def _packed(qtype, shape, rng):
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    data = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
    return GGUFTensor(torch.from_numpy(data), qtype, shape)


def _make_sample(path):
    rng = np.random.default_rng(0)
    tensors = {
        "token_embd.weight": _packed("Q4_K", (2, 256), rng),
        "blk.0.attn_q.weight": _packed("Q8_0", (3, 64), rng),
        "blk.0.ffn_up_exps.weight": _packed("Q4_0", (2, 2, 32), rng),
        "blk.0.attn_norm.weight": torch.from_numpy(rng.standard_normal(16).astype(np.float32)),
        "blk.0.ffn_down.weight": torch.from_numpy(rng.standard_normal((2, 8)).astype(np.float16)),
        "output.weight": torch.from_numpy(rng.standard_normal((2, 8)).astype(np.float32)).to(torch.bfloat16),
    }
    metadata = {
        "general.architecture": "qwen3",
        "general.alignment": 32,
        "general.name": "fuzz",
        "qwen3.block_count": 1,
        "qwen3.rope.freq_base": 10000.0,
        "qwen3.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.tokens": ["<s>", "a", "bc", "\u00e9", "\u0120x"],
        "tokenizer.ggml.token_type": [3, 1, 1, 1, 1],
        "tokenizer.ggml.scores": [0.0, -1.0, -2.0, -3.0, -4.0],
        "tokenizer.ggml.merges": ["a b", "b c"],
        "custom.i64": -5,
        "custom.f64": 0.125,
        "custom.nested": [[1, 2], [3]],
        "custom.bools": [True, False],
        "tokenizer.chat_template": "{{ messages }}",
    }
    types = {"custom.i64": VT.INT64, "custom.f64": VT.FLOAT64, "tokenizer.ggml.token_type": (VT.ARRAY, VT.INT32)}
    save_gguf(path, tensors, metadata, metadata_types=types)


@contextlib.contextmanager
def _time_limit(seconds, what):
    if not hasattr(signal, "setitimer"):  # pragma: no cover - non-POSIX
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"{what} took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


_SMASH = [0, 1, 2, 3, 5, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1]


def _mutate(raw: bytes, header_end: int, rng: random.Random) -> tuple[bytes, str]:
    return mutate(raw, header_end, rng, kinds=["byte", "byte", "bits", "int", "int", "truncate", "insert", "delete"],
                  widths=[4, 8], smash=_SMASH + [len(raw), len(raw) * 2])


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b and type(a) is type(b)


def _exercise(path) -> str:
    """Open and touch everything; return "loaded" or "rejected"; other exceptions propagate."""
    try:
        f = GGUFFile(path)
    except GGUFError:
        return "rejected"
    with f:
        size = os.path.getsize(path)
        values = {}
        for key in list(f.metadata):
            try:
                v = f.metadata[key]
            except GGUFError:
                continue
            values[key] = v.tolist() if isinstance(v, torch.Tensor) else v
            f.metadata.value_type(key)
            f.metadata.element_type(key)
        for getter in (lambda: f.architecture, lambda: f.get_int("qwen3.block_count", 0)):
            try:
                getter()
            except GGUFError:
                pass
        for name, info in f.tensor_info.items():
            assert 0 <= info.offset and info.offset + info.nbytes <= size
            p = f.packed(name)
            assert p.dtype == torch.uint8 and tuple(p.shape) == info.packed_shape and p.numel() == info.nbytes
            int(p.to(torch.int64).sum())  # reads every byte of the view
        try:
            tensors = f.tensors
        except GGUFError:
            tensors = {}
        for name, t in tensors.items():
            assert tuple(t.shape) == f.tensor_info[name].shape and t.packed.numel() == f.tensor_info[name].nbytes
        agreed = _compare_with_gguf_reader(path, f, values)
    return "loaded, gguf agrees" if agreed else "loaded"


def _compare_with_gguf_reader(path, f, values) -> bool:
    """True when gguf's reader also loaded the file (and agreed); False when it rejected it."""
    try:
        reader = gguf.GGUFReader(path)
    except Exception:  # gguf's reader rejects (or chokes on) more mutants than we do
        return False
    fields = {k: v for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(f.metadata)
    for key, field in fields.items():
        assert field.types[0] == f.metadata.value_type(key), key
        if key not in values or field.types[-1] == VT.ARRAY or (len(field.types) > 1 and field.types[1] == VT.ARRAY):
            continue  # undecodable for us, or nested (gguf flattens nested arrays)
        try:
            ref = field.contents()
        except Exception:
            continue
        if field.types[-1] == VT.BOOL and field.types[0] == VT.ARRAY:
            ref = [bool(x) for x in ref]
        assert _same(values[key], ref), key
    assert [t.name for t in reader.tensors] == list(f.tensor_info)
    for rt in reader.tensors:
        info = f.tensor_info[rt.name]
        assert int(rt.tensor_type) == info.type_id and info.shape == tuple(reversed(rt.shape.tolist()))
        assert info.offset == rt.data_offset
        assert np.array_equal(np.asarray(rt.data).view(np.uint8).reshape(-1), f.packed(rt.name).numpy().reshape(-1))
    return True


def test_fuzz_mutations_and_truncations(tmp_path):
    sample = tmp_path / "sample.gguf"
    _make_sample(sample)
    raw = sample.read_bytes()
    with GGUFFile(sample) as f:
        header_end = f.data_offset
        assert len(f.tensor_info) == 6 and len(f.metadata) == 16
    assert _exercise(sample) == "loaded, gguf agrees"

    rng = random.Random(SEED)
    outcomes = {"loaded, gguf agrees": 0, "loaded": 0, "rejected": 0}
    t0 = time.perf_counter()
    for case in range(N_CASES):
        data, how = _mutate(raw, header_end, rng)
        path = tmp_path / f"case{case}.gguf"
        path.write_bytes(data)
        try:
            with _time_limit(CASE_TIMEOUT_S, f"case {case} ({how})"):
                outcomes[_exercise(path)] += 1
        except Exception as e:  # noqa: BLE001 - any non-GGUFError is a failure
            pytest.fail(f"fuzz case {case} (seed {SEED}, mutation {how}) raised {type(e).__name__}: {e}")
        finally:
            path.unlink()
    elapsed = time.perf_counter() - t0
    print(f"\nfuzz: {N_CASES} cases in {elapsed:.1f} s: {outcomes}")
    # both outcomes must be exercised substantially, or the fuzzer is not testing the parser
    loaded = outcomes["loaded"] + outcomes["loaded, gguf agrees"]
    assert loaded > N_CASES // 10 and outcomes["rejected"] > N_CASES // 4, outcomes
    assert outcomes["loaded, gguf agrees"] > N_CASES // 20, outcomes
