"""The real Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB) end to end. Slow: ``pytest -m slow``.

The file is looked up at ``$HANZO_CACHE/models`` (default ``~/.cache/hanzo-torch/models``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hanzo_torch

MODEL_FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
PROMPT = "Write a Python function that returns the n-th Fibonacci number."
RSS_FACTOR = 1.3  # resident memory, as a multiple of the file size (see test_rss_stays_near_file_size)

pytestmark = pytest.mark.slow


def _model_path() -> Path:
    from conftest import real_model_path

    return real_model_path()


@pytest.fixture(scope="module")
def model():
    return hanzo_torch.load(_model_path(), max_context=1024)


def test_config(model):
    a = model.args
    assert (a.arch, a.n_layer, a.dim, a.n_head, a.n_head_kv, a.head_dim, a.ffn_dim) == (
        "qwen2", 28, 1536, 12, 2, 128, 8960)
    assert a.qkv_bias and not a.qk_norm and not a.tied_embeddings


def test_chat_answer_is_python_code(model):
    result = model.generate([{"role": "user", "content": PROMPT}], max_new_tokens=96, temperature=0)
    print(f"\n--- answer ---\n{result.text}\n--- {result.stats.summary()}")
    assert "def " in result.text
    assert "fib" in result.text.lower()


def test_rss_stays_near_file_size():
    """In a fresh interpreter: what loading adds to the interpreter's RSS, and loading plus a
    forward (which pages in every weight), stays under RSS_FACTOR x the file size plus the CPU
    mat-vec's panels (those registered after the load: the Q4_K matrices' 613 MiB for this model,
    and on the ``avx2`` level the Q6_K matrices' planes, 338 MiB more).
    Packed weights are views of the mapped file or (load's default where the kernel has huge
    pages) one packed copy whose file pages are dropped from the mapping; nothing full-precision is
    allocated. (The absolute RSS after a forward is about 1.35-1.45x the file without the panels:
    the weights once plus ~300 MiB of torch.)"""
    path = _model_path()
    script = textwrap.dedent(f"""
        import json, time, torch, hanzo_torch
        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        base = rss()
        t = time.perf_counter()
        m = hanzo_torch.load({str(path)!r}, max_context=512)
        load_s = time.perf_counter() - t
        after_load = rss()
        from hanzo_torch.backends import cpu
        ext = cpu.extension()
        panels = sum(cpu.panel_bytes(p.qtype, tuple(p.packed.shape)) for p in m.parameters()
                     if hasattr(p, "packed") and ext is not None and cpu.panel_bytes(p.qtype, tuple(p.packed.shape))
                     and ext.panels_of(p.packed, cpu._type_id(p.qtype)))
        with torch.no_grad():
            m(torch.tensor([[1, 2, 3, 4]]))
        level = cpu.ISA_NAMES[cpu.default_isa()]
        print(json.dumps(dict(base=base, after_load=after_load, after_forward=rss(), load_s=load_s, panels=panels, level=level)))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    size = path.stat().st_size
    print(f"\nfile {size / 2**20:.0f} MiB, RSS: start {r['base'] / 2**20:.0f} MiB, after load "
          f"{r['after_load'] / 2**20:.0f} MiB, after a forward {r['after_forward'] / 2**20:.0f} MiB "
          f"(panels {r['panels'] / 2**20:.0f} MiB); load {r['load_s']:.2f} s")
    # the Q4_K matrices' panels (1.028x their rows), on avx2 with the Q6_K matrices' planes (1x)
    assert r["panels"] < (0.92 if r["level"] == "avx2" else 0.6) * size
    assert r["after_load"] - r["base"] < RSS_FACTOR * size + r["panels"]
    assert r["after_forward"] - r["base"] < RSS_FACTOR * size + r["panels"]
