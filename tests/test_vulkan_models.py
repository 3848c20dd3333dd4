"""Models on the "vulkan" device: ``hanzo_torch.load(path, device="vulkan")`` gives the same greedy
tokens as the CPU, whatever part of the ``hanzo`` ops has a native Vulkan kernel (the others run
their reference on the device, aten ops natively or through the CPU fallback); the CLI runs
``generate``/``bench`` there and prints the profile counters per token.

Tiny random models (tests/gguf_builders.py, the packed mixes of tests/test_models.py) with the
263-token toy vocabulary: 32 greedy tokens per architecture, the same as on the CPU, and prefill
logits within :data:`LOGITS_RTOL` of the CPU's float references.
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import hanzo_torch
from hanzo_torch.backends import vulkan
from tests.gguf_builders import tiny_spec, write_tiny_gguf
from tests.qwen_vocab import toy_tokenizer_metadata
from tests.test_models import SPECS

if not vulkan.available():
    pytest.skip(f"vulkan backend unavailable: {vulkan.reason()}", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("vk-models")
    return {arch: write_tiny_gguf(root / f"{arch}.gguf", tiny_spec(arch, **SPECS[arch]), toy_tokenizer_metadata())
            for arch in SPECS}


def greedy(model, prompt: torch.Tensor, n: int) -> list:
    """Prefill ``prompt [1, T]`` then ``n - 1`` single-token decode steps through the KV cache."""
    model.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback's once-per-op notices
        tokens = [int(model(prompt)[0, -1].argmax())]
        for _ in range(n - 1):
            tokens.append(int(model(torch.tensor([[tokens[-1]]]))[0, -1].argmax()))
    return tokens


def _same_tokens(path: str, n: int) -> None:
    prompt = torch.randint(0, 263, (1, 12), generator=torch.Generator().manual_seed(3))
    kw = dict(max_context=64, kv_dtype="f32", dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vk = hanzo_torch.load(path, device="vulkan", **kw)
    assert vk.device.type == "vulkan"
    assert vk.blk[0].attn_q.weight.packed.device.type == "vulkan"  # packed weights moved, still packed
    assert vk.blk[0].attn_q.weight.packed.dtype == torch.uint8
    cpu = hanzo_torch.load(path, device="cpu", **kw)
    want = greedy(cpu, prompt, n)
    assert greedy(vk, prompt, n) == want
    # logits of a fresh prefill against the float references on the CPU (the Vulkan kernels compute
    # in float32 too: only summation order differs; a wrong weight or a dropped term gives ~1e-1)
    vk.reset()
    cpu.reset()
    with torch.no_grad(), warnings.catch_warnings(), hanzo_torch.ops.use_reference():
        warnings.simplefilter("ignore")
        ref = cpu(prompt)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = vk(prompt).cpu()
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err < LOGITS_RTOL, err


LOGITS_RTOL = 1e-4
"""Vulkan logits vs the CPU float references, relative to the largest logit (measured ~1e-6 on lavapipe)."""


@pytest.mark.parametrize("arch", tuple(SPECS))
def test_load_on_vulkan_32_greedy_tokens(files, arch):
    _same_tokens(files[arch], 32)


def test_module_to_vulkan(files):
    """``model.to("vulkan")`` moves a CPU-loaded model (packed weights included)."""
    kw = dict(max_context=32, kv_dtype="f32", dtype=torch.float32)
    m = hanzo_torch.load(files["qwen2"], device="cpu", **kw)
    ids = torch.randint(0, 263, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = m(ids)
        m.reset()
        m.to("vulkan")
        assert m.device.type == "vulkan" and m.blk[1].ffn_down.weight.packed.device.type == "vulkan"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = m(ids)
    assert got.device.type == "vulkan"
    # the CPU's C++ kernels quantize activations to int8 blocks (tests/test_conformance.py bounds that
    # per op); the same logits up to it: ~0.7% of the largest logit measured, a wrong weight gives ~100%
    err = (got.cpu() - want).abs().max() / want.abs().max()
    assert err < 2e-2, float(err)


@pytest.mark.slow
def test_cli_generate_and_bench_on_vulkan(files):
    env = {**os.environ, "HANZO_VK_PROFILE": "1", "PYTHONWARNINGS": "ignore"}
    base = [sys.executable, "-m", "hanzo_torch"]
    out = subprocess.run(base + ["generate", "-m", files["qwen3"], "-p", "hello", "-n", "3", "--temp", "0",
                                 "--device", "vulkan", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "on vulkan:0" in out.stderr and "vulkan profile per token" in out.stderr, out.stderr[-3000:]
    out = subprocess.run(base + ["bench", "-m", files["qwen3"], "-p", "4", "-n", "2", "-r", "1", "--warmup", "0",
                                 "--device", "vulkan"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| vulkan:0 |" in out.stdout and "vulkan profile per token:" in out.stderr, out.stdout + out.stderr
    out = subprocess.run(base + ["inspect", "--backends"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=env)
    assert out.returncode == 0 and "vulkan: available" in out.stdout, out.stdout + out.stderr


README_PROMPT = "Write a Python function that returns the n-th Fibonacci number."
REAL_NEW_TOKENS = 6
"""Greedy tokens of the real model's answer compared: enough for "```python\ndef fibonacci(n".
On lavapipe (Mesa 22.3: every shader memory access runs lane by lane) the 41-token prefill is
several CPU minutes and each decode token over a CPU minute, so the test is slow-marked."""


def _greedy_logged(model, ids: torch.Tensor, n: int) -> tuple:
    """``n`` greedy tokens after prefilling ``ids [1, T]``; also whether every logit was finite."""
    model.reset()
    finite = True
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits = model(ids, last_only=True)[0, -1].cpu()
        tokens = []
        for _ in range(n):
            finite = finite and bool(torch.isfinite(logits).all())
            tokens.append(int(logits.argmax()))
            if len(tokens) < n:
                logits = model(torch.tensor([[tokens[-1]]]), last_only=True)[0, -1].cpu()
    return tokens, finite


@pytest.mark.slow
def test_real_model_answers_the_readme_prompt_on_vulkan():
    """The default real model (Qwen2.5-Coder-1.5B Q4_K_M) on vulkan, float32 activations and KV
    cache, answers the README chat prompt with the same greedy tokens as the CPU's float references
    (``hanzo_torch.ops.use_reference``: float32 activations too, where the CPU kernels quantize
    them to int8), and its logits stay finite."""
    from conftest import real_model_path

    path = real_model_path()
    kw = dict(max_context=256, kv_dtype="f32", dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vk = hanzo_torch.load(path, device="vulkan", **kw)
    tok = vk.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": README_PROMPT}], add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    got, finite = _greedy_logged(vk, ids, REAL_NEW_TOKENS)
    answer = tok.decode(got)
    assert finite, answer
    cpu = hanzo_torch.load(path, device="cpu", **kw)
    with hanzo_torch.ops.use_reference():
        want, _ = _greedy_logged(cpu, ids, REAL_NEW_TOKENS)
    assert got == want, (answer, tok.decode(want))
    assert "def " in answer and "fib" in answer.lower(), answer
