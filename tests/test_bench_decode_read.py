"""benchmarks/bench_decode_read.py on a tiny random-weight model: each mat-vec node's weights named
and counted (the panels' bytes where the kernel reads panels), the rounds' numbers, the per-regime
report, and the argument errors."""
import importlib.util
import os
import sys

import pytest
import torch

from hanzo_torch.backends import cpu as hcpu
from tests.gguf_builders import write_small_vocab_models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not hcpu.available(), reason="the C++ CPU kernels could not be built")


@pytest.fixture(scope="module")
def bdr():
    spec = importlib.util.spec_from_file_location("bench_decode_read",
                                                  os.path.join(ROOT, "benchmarks", "bench_decode_read.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    spec = {"qwen2": dict(qtypes=dict(embd="Q4_K", attn="Q4_K", ffn="Q4_K", ffn_down="Q6_K"))}
    return write_small_vocab_models(tmp_path_factory.mktemp("bdr"), spec, 4096)["qwen2"]


def test_kind_names(bdr):
    assert bdr.kind_of([("blk.3.attn_q.weight", "Q4_K"), ("blk.3.attn_k.weight", "Q4_K"),
                        ("blk.3.attn_v.weight", "Q6_K")]) == "attn_q+attn_k+attn_v Q4_K,Q6_K"
    assert bdr.kind_of([("output.weight", "Q6_K")]) == "output Q6_K"
    assert bdr.kind_of([("blk.10.ffn_down.weight", "Q4_K")]) == "ffn_down Q4_K"


def test_rounds_and_report(bdr, qwen2, capsys):
    old = torch.get_num_threads()
    try:
        rows = bdr.measure(qwen2, 2, 3, 1, "lvl")
    finally:
        torch.set_num_threads(old)
    assert len(rows) == 2 and capsys.readouterr().out.count('"tag": "lvl"') == 2
    for r in rows:
        assert set(r["kinds"]) == {"attn_q+attn_k+attn_v Q4_K", "attn_output Q4_K", "ffn_gate+ffn_up Q4_K",
                                   "ffn_down Q6_K", "token_embd Q4_K"}
        assert r["read"] > 0 and r["matvec_gbs"] > 0 and all(v > 0 for v in r["kinds"].values())
        # the Q4_K mat-vecs stream panels (1184 bytes per 8 rows and block against 1152): more bytes
        # in the same time than the GGUF rows
        assert r["matvec_gbs"] > r["gguf_gbs"] > 0
        assert r["token_ms"] > r["matvec_ms"] > 0
    fast, slow = bdr.report(rows, 0.0), bdr.report(rows, 1e9)
    assert fast.startswith("lvl fast: 2 rounds") and "slow" not in fast
    assert slow.startswith("lvl slow: 2 rounds") and "of the read" in slow and "ffn_down Q6_K" in slow


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "1"], "--tokens must be >= 2"),
    (["--rounds", "0"], "must be >= 1"),
    (["-m", "/nonexistent/model.gguf"], "no such file"),
])
def test_bad_arguments(bdr, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bdr.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
