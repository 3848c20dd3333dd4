"""GGUF files as untrusted input: hanzo_torch.load() validates every hyper-parameter, tensor shape
and the tokenizer before allocating, and raises GGUFError naming the file and the key or tensor.
Named regression tests for the hangs, garbage outputs and thread-safety problems found by
fuzzing (tests/test_load_fuzz.py runs the fuzzer itself)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from gguf import GGUFValueType as VT

import hanzo_torch
from hanzo_torch import GGUFError
from load_fuzz import Base, _write, build_bases


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    from hanzo_torch.backends import cpu

    cpu.extension()
    return {b.arch: b for b in build_bases(str(tmp_path_factory.mktemp("bases")))}


def mutant(tmp_path, base: Base, meta=None, types=None, tensors=None, drop=(), name="m.gguf") -> str:
    m, t, ts = dict(base.meta), dict(base.types), dict(base.tensors)
    m.update(meta or {})
    t.update(types or {})
    ts.update(tensors or {})
    for k in drop:
        m.pop(k, None)
        ts.pop(k, None)
    path = str(tmp_path / name)
    _write(path, m, t, ts)
    return path


def test_bases_load_and_generate(bases, tmp_path):
    for b in bases.values():
        model = hanzo_torch.load(mutant(tmp_path, b))
        assert model._tokenizer is not None  # built (and checked) at load
        out = model.generate("hello", max_new_tokens=2, temperature=0, ignore_eos=True)
        assert len(out.token_ids) == 2


def test_huge_block_count_is_refused_at_once(bases, tmp_path):
    """A corrupted block_count used to build that many layers before looking for their tensors
    (memory grew ~100 MB/s until the allocator failed). Now: GGUFError, quickly, in bounded
    memory (a subprocess with a 4 GiB address-space limit and a 120 s timeout)."""
    values = [65535, 2**32 - 1, 10**9, 2**63]
    paths = [mutant(tmp_path, bases["qwen3"], {"qwen3.block_count": v}, {"qwen3.block_count": VT.UINT64},
                    name=f"layers{v}.gguf") for v in values]
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); import hanzo_torch\n"
            "for p in sys.argv[1:]:\n"
            "    try:\n        hanzo_torch.load(p)\n    except hanzo_torch.GGUFError as e:\n        print('GGUFError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert len(lines) == len(values)
    for line, v, p in zip(lines, values, paths):
        assert line.startswith(f"GGUFError: {p}: qwen3.block_count = {v} does not match the layers present (2 blk.N")


def test_block_count_must_match_layers(bases, tmp_path):
    for n in (0, 1, 3):
        with pytest.raises(GGUFError, match=rf"qwen3.block_count.*{n}"):
            hanzo_torch.load(mutant(tmp_path, bases["qwen3"], {"qwen3.block_count": n}))


@pytest.mark.parametrize("key, value, match", [
    ("attention.head_count", 0, "'qwen3.attention.head_count' = 0 must be > 0"),
    ("attention.head_count_kv", 0, "head_count_kv' = 0 must be > 0"),
    ("attention.head_count_kv", 3, "head_count 2 is not a multiple of attention.head_count_kv 3"),
    ("embedding_length", 63, "embedding_length 63 is not a multiple of attention.head_count 2"),
    ("embedding_length", 2**64 - 1, "embedding_length"),
    ("feed_forward_length", 65, "'blk.0.ffn_gate.weight' has shape"),
    ("context_length", 0, "context_length' = 0 must be > 0"),
    ("attention.key_length", 33, "key_length 33 must be even"),
    ("attention.value_length", 16, "value_length 16 != key_length 32"),
])
def test_bad_integer_hyper_parameters(bases, tmp_path, key, value, match):
    path = mutant(tmp_path, bases["qwen3"], {f"qwen3.{key}": value}, {f"qwen3.{key}": VT.UINT64})
    with pytest.raises(GGUFError, match=match) as e:
        hanzo_torch.load(path)
    assert path in str(e.value)


def test_negative_and_wrongly_typed_values(bases, tmp_path):
    b = bases["qwen3"]
    with pytest.raises(GGUFError, match="head_count' = -2 must be > 0"):
        hanzo_torch.load(mutant(tmp_path, b, {"qwen3.attention.head_count": -2}, {"qwen3.attention.head_count": VT.INT32}))
    with pytest.raises(GGUFError, match="'qwen3.block_count' holds FLOAT32, expected an integer"):
        hanzo_torch.load(mutant(tmp_path, b, {"qwen3.block_count": 2.0}, {"qwen3.block_count": VT.FLOAT32}))
    with pytest.raises(GGUFError, match="'qwen3.rope.freq_base' holds STRING, expected a float"):
        hanzo_torch.load(mutant(tmp_path, b, {"qwen3.rope.freq_base": "1e6"}, {"qwen3.rope.freq_base": VT.STRING}))
    with pytest.raises(GGUFError, match="missing metadata key 'qwen3.embedding_length'"):
        hanzo_torch.load(mutant(tmp_path, b, drop=["qwen3.embedding_length"]))


@pytest.mark.parametrize("key, value", [
    ("attention.layer_norm_rms_epsilon", math.inf), ("attention.layer_norm_rms_epsilon", 1e30),
    ("attention.layer_norm_rms_epsilon", 0.0), ("attention.layer_norm_rms_epsilon", math.nan),
    ("attention.layer_norm_rms_epsilon", -1e-6),
    ("rope.freq_base", math.inf), ("rope.freq_base", 1e-12), ("rope.freq_base", 0.0), ("rope.freq_base", math.nan),
    ("rope.freq_base", -1e4), ("rope.freq_base", 1e300),
])
def test_garbage_float_hyper_parameters(bases, tmp_path, key, value):
    """These used to load and decode silently wrong (constant logits, token 0 repeated) or fail
    at sampling time."""
    path = mutant(tmp_path, bases["qwen3"], {f"qwen3.{key}": value}, {f"qwen3.{key}": VT.FLOAT64})
    with pytest.raises(GGUFError, match=rf"'qwen3.{key}' = .* is outside"):
        hanzo_torch.load(path)


def test_moe_expert_counts(bases, tmp_path):
    b = bases["qwen3moe"]
    with pytest.raises(GGUFError, match="expert_used_count 5 exceeds expert_count 4"):
        hanzo_torch.load(mutant(tmp_path, b, {"qwen3moe.expert_used_count": 5}))
    with pytest.raises(GGUFError, match="'blk.0.ffn_gate_inp.weight' has shape"):
        hanzo_torch.load(mutant(tmp_path, b, {"qwen3moe.expert_count": 2**20, "qwen3moe.expert_used_count": 2}))


def test_vocabulary_must_match_embedding_rows(bases, tmp_path):
    """Fewer embedding rows than tokens gave get_rows out-of-range errors mid-generation; more
    gave "token id 1152 is outside the vocabulary" during decode."""
    b = bases["qwen3"]
    embd = b.tensors["token_embd.weight"].dequantize(torch.float32)
    for rows in (200, 300):
        e = embd[:rows] if rows < len(embd) else torch.cat([embd, embd[: rows - len(embd)]])
        with pytest.raises(GGUFError, match=rf"tokenizer.ggml.tokens has 263 tokens but token_embd.weight has {rows} rows"):
            hanzo_torch.load(mutant(tmp_path, b, tensors={"token_embd.weight": e.contiguous()}))


@pytest.mark.parametrize("meta, types, match", [
    ({"tokenizer.ggml.bos_token_id": 1.0}, {"tokenizer.ggml.bos_token_id": VT.FLOAT32}, "bos_token_id must be an integer, got float"),
    ({"tokenizer.ggml.eos_token_id": True}, {"tokenizer.ggml.eos_token_id": VT.BOOL}, "eos_token_id must be an integer, got bool"),
    ({"tokenizer.ggml.eos_token_id": 263}, {}, "eos_token_id 263 is outside the vocabulary"),
    ({"tokenizer.chat_template": 3}, {"tokenizer.chat_template": VT.INT32}, "chat_template must be a string"),
    ({"tokenizer.chat_template": "{% for %}"}, {}, "chat_template does not parse"),
    ({"tokenizer.ggml.merges": [["h", "e"]]}, {"tokenizer.ggml.merges": (VT.ARRAY, VT.ARRAY)}, r"merges\[0\] is list"),
    ({"tokenizer.ggml.merges": ["zq qz"]}, {}, "invalid BPE vocabulary/merges"),
    ({"tokenizer.ggml.token_type": [[1]] * 263}, {"tokenizer.ggml.token_type": (VT.ARRAY, VT.ARRAY)}, "token_type"),
    ({"tokenizer.ggml.tokens": [["a"]] * 263}, {"tokenizer.ggml.tokens": (VT.ARRAY, VT.ARRAY)}, "array of strings"),
])
def test_tokenizer_problems_found_at_load(bases, tmp_path, meta, types, match):
    path = mutant(tmp_path, bases["qwen3"], meta, types)
    with pytest.raises(GGUFError, match=match) as e:
        hanzo_torch.load(path)
    assert str(e.value).startswith(path + ": ")


def test_tensor_shape_and_set_checked_before_building(bases, tmp_path):
    b = bases["qwen2"]
    q = b.tensors["blk.0.attn_q.weight"].dequantize(torch.float32)
    with pytest.raises(GGUFError, match=r"'blk.0.attn_q.weight' has shape \(64, 32\), expected \(64, 64\)"):
        hanzo_torch.load(mutant(tmp_path, b, tensors={"blk.0.attn_q.weight": q[:, :32].contiguous()}))
    with pytest.raises(GGUFError, match="missing tensor 'blk.0.attn_q.bias'"):
        hanzo_torch.load(mutant(tmp_path, b, drop=["blk.0.attn_q.bias"]))
    with pytest.raises(GGUFError, match="not used by the qwen2 model: 'foo.weight'"):
        hanzo_torch.load(mutant(tmp_path, b, tensors={"foo.weight": torch.zeros(2, 32)}))


def test_non_finite_weights(bases, tmp_path):
    b = bases["qwen3"]
    norm = b.tensors["blk.0.attn_norm.weight"].dequantize(torch.float32).clone()
    norm[3] = math.nan
    with pytest.raises(GGUFError, match="'blk.0.attn_norm.weight' holds NaN or inf"):
        hanzo_torch.load(mutant(tmp_path, b, tensors={"blk.0.attn_norm.weight": norm}))
    # finite in float32, but the residual overflows: the next RMSNorm divides by sqrt(inf) and
    # every logit is 0 (the model used to print token 0 repeated and exit 0); with an f16 KV cache
    # the keys overflow first and the logits are NaN: either way a GGUFError, not garbage
    big = torch.full_like(norm, 1e30)
    model = hanzo_torch.load(mutant(tmp_path, b, tensors={"blk.0.attn_norm.weight": big}, name="big.gguf"))
    with pytest.raises(GGUFError, match="first logits (are the same for every token|contain NaN or inf)"):
        model.generate("hello", max_new_tokens=1, temperature=0)
    model = hanzo_torch.load(mutant(tmp_path, b, tensors={"blk.0.ffn_norm.weight": big}, name="big2.gguf"))
    with pytest.raises(GGUFError, match="first logits contain NaN or inf"):
        model.generate("hello", max_new_tokens=1, temperature=0)
    up = b.tensors["blk.1.ffn_up.weight"].dequantize(torch.float32).clone()
    up[0, 0] = math.inf
    model = hanzo_torch.load(mutant(tmp_path, b, tensors={"blk.1.ffn_up.weight": up}, name="inf.gguf"))
    with pytest.raises(GGUFError, match="first logits contain NaN or inf"):
        model(torch.tensor([[1, 2, 3]]))


def test_max_context_above_context_length_needs_opt_in(bases, tmp_path):
    path = mutant(tmp_path, bases["qwen3"])  # context_length 256
    with pytest.raises(ValueError, match="max_context=10000000 exceeds the model's context_length 256"):
        hanzo_torch.load(path, max_context=10**7)
    assert hanzo_torch.load(path, max_context=512, extend_context=True).max_context == 512
    assert hanzo_torch.load(path).max_context == 256
    for bad, exc in ((0, ValueError), (-5, ValueError), (1.5, TypeError), (True, TypeError), ("64", TypeError)):
        with pytest.raises(exc, match="max_context"):
            hanzo_torch.load(path, max_context=bad)
    with pytest.raises(TypeError, match="extend_context"):
        hanzo_torch.load(path, extend_context="yes")


def test_named_pipe_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    with pytest.raises(GGUFError, match="not a regular file \\(a named pipe\\)"):
        hanzo_torch.GGUFFile(fifo)
    with pytest.raises(GGUFError, match="not a regular file"):
        hanzo_torch.load(fifo)
    assert time.monotonic() - t0 < 30


def test_two_threads_generate_on_one_model_serialize(bases, tmp_path):
    """Two threads calling generate() on the same model object used to mix their KV caches
    (5 of 6 runs gave wrong text, silently). They now take turns: each result equals the one
    computed alone."""
    model = hanzo_torch.load(mutant(tmp_path, bases["qwen3"]))
    prompts = ["hello world", "the cat sat on"]
    expected = {p: model.generate(p, max_new_tokens=12, temperature=0, ignore_eos=True).token_ids for p in prompts}
    assert expected[prompts[0]] != expected[prompts[1]]
    for _ in range(3):
        results, errors = {}, []
        start = threading.Barrier(2)

        def work(p):
            try:
                start.wait()
                results[p] = model.generate(p, max_new_tokens=12, temperature=0, ignore_eos=True).token_ids
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=work, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and results == expected


def test_two_models_in_two_threads(bases, tmp_path):
    path = mutant(tmp_path, bases["qwen3moe"])
    models = [hanzo_torch.load(path), hanzo_torch.load(path)]
    want = models[0].generate("hello", max_new_tokens=8, temperature=0, ignore_eos=True).token_ids
    got = [None, None]

    def work(i):
        got[i] = models[i].generate("hello", max_new_tokens=8, temperature=0, ignore_eos=True).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == [want, want]


def test_open_stream_then_generate_in_same_thread_raises(bases, tmp_path):
    model = hanzo_torch.load(mutant(tmp_path, bases["qwen3"]))
    stream = model.generate("hello", max_new_tokens=4, temperature=0, ignore_eos=True, stream=True)
    next(stream)
    with pytest.raises(RuntimeError, match="already running on this model in this thread"):
        model.generate("hi", max_new_tokens=1)
    stream.close()  # releases the model
    assert len(model.generate("hi", max_new_tokens=1, temperature=0, ignore_eos=True).token_ids) == 1


def test_huge_prompt_is_refused_before_encoding(bases, tmp_path):
    """A 40 MB one-word prompt under a memory limit used to end in a Rust panic (or abort) inside
    the tokenizer. generate() now refuses a text that cannot fit in max_context tokens before
    encoding it: a ValueError, quickly, in a process limited to its size + 300 MiB."""
    path = mutant(tmp_path, bases["qwen3"])
    code = ("import resource, sys, time, hanzo_torch\n"
            "m = hanzo_torch.load(sys.argv[1])\n"
            "text = 'a' * 40_000_000\n"
            "soft = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024 + (300 << 20)\n"
            "resource.setrlimit(resource.RLIMIT_AS, (soft, soft))\n"
            "try:\n    m.generate(text, max_new_tokens=1)\n"
            "except ValueError as e:\n    print('ValueError', e)\n")
    r = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ValueError the prompt has 40000000 characters, more than max_context=256 tokens")
