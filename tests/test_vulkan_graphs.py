"""Vulkan graphs: a decode step recorded once into one command buffer and replayed per token.

``torch.vulkan.VulkanGraph`` records the dispatches and device copies of its capture and replays
them with one submit; :class:`hanzo_torch.cuda_graphs.DecodeStep` captures the decode step on the
"vulkan" device as on CUDA. The model cases run the same teacher-forced tokens through an eager
copy and a replaying copy of a tiny random-weight model (the specs of tests/test_cuda_graphs.py)
and require max |logits diff| == 0 at every step: the same kernels on the same inputs are
deterministic, so a difference is a value baked in at capture that should have been read from a
device buffer. The runtime cases check what a capture refuses, the private memory pool, and
that replays see inputs written in place.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import hanzo_torch
from hanzo_torch.backends import vulkan
from tests.gguf_builders import tiny_spec, write_tiny_gguf
from tests.qwen_vocab import toy_tokenizer_metadata
from tests.test_cuda_graphs import replay_vs_eager

if not vulkan.available():
    pytest.skip(f"vulkan backend unavailable: {vulkan.reason()}", allow_module_level=True)

N_TOKENS = 64  # decode steps compared per architecture
ARCHS = ("qwen3", "qwen3moe", "qwen2")
# Narrow packed models (hidden 64, so 32-element block formats) with the 263-token toy vocabulary:
# every token runs two forwards on lavapipe, whose mat-vecs are slow on a busy machine.
SHAPE = dict(hidden=64, n_head=2, n_head_kv=1, head_dim=32, ffn=128, expert_ffn=128,
             qtypes=dict(embd="Q8_0", output="Q8_0", attn="Q8_0", ffn="Q4_0", ffn_down="Q8_0"))
SPECS = {"qwen3": dict(tied=False, **SHAPE), "qwen3moe": dict(n_expert=4, n_expert_used=2, **SHAPE),
         "qwen2": dict(SHAPE)}  # head_dim = hidden // n_head, as Qwen2 files imply


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("vk_graph_models")
    meta = toy_tokenizer_metadata()
    return {a: write_tiny_gguf(root / f"{a}.gguf", tiny_spec(a, **SPECS[a]), meta) for a in ARCHS}


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback's once-per-op notices (diffs computed outside capture)
        yield


def _vk(*shape, fill=0.0):
    return torch.full(shape, fill, dtype=torch.float32).to("vulkan")


# ---------------------------------------------------------------------------------------------- runtime


def test_replay_reads_inputs_written_in_place():
    g = torch.vulkan.VulkanGraph()
    x = _vk(64)
    b = _vk(64, fill=0.5)
    with torch.vulkan.graph(g):
        y = x * 2.0 + b
        z = y - x  # reads what the previous dispatch wrote
    info = g.info()
    assert info["recorded"] and info["dispatches"] >= 2 and info["pool_bytes"] > 0
    x.fill_(3.0)  # a device fill, ordered before the replay
    g.replay()
    assert torch.equal(z.cpu(), torch.full((64,), 3.5))
    x.copy_(torch.arange(64, dtype=torch.float32))  # host -> device, ordered before the replay
    g.replay()
    want = torch.arange(64, dtype=torch.float32) + 0.5
    assert torch.equal(z.cpu(), want) and torch.equal(y.cpu(), 2 * torch.arange(64.0) + 0.5)
    # replays queued back to back, without a wait in between
    x.fill_(1.0)
    g.replay()
    g.replay()
    assert torch.equal(z.cpu(), torch.full((64,), 1.5))


@pytest.mark.parametrize("what", ["item", "cpu", "synchronize", "from_host"])
def test_capture_refuses_host_sync(what):
    x = _vk(8, fill=1.0)
    g = torch.vulkan.VulkanGraph()
    match = {"item": "copy to the host", "cpu": "copy to the host", "synchronize": "synchronize",
             "from_host": "copy from the host"}[what]
    with pytest.raises(RuntimeError, match=f"Vulkan graph capture: .*{match}.* not allowed while capturing"):
        with torch.vulkan.graph(g):
            y = x + 1.0
            if what == "item":
                y.sum().item()
            elif what == "cpu":
                y.cpu()
            elif what == "synchronize":
                torch.vulkan.synchronize()
            else:
                torch.ones(8).to("vulkan")
    assert not torch.vulkan.is_capturing() and not g.info()["recorded"]
    with pytest.raises(RuntimeError, match="without a successful capture"):
        g.replay()
    # the runtime works normally afterwards, and the graph can capture again
    assert float((x + 1.0).cpu()[0]) == 2.0
    with torch.vulkan.graph(g):
        y = x + 1.0
    g.replay()
    assert torch.equal(y.cpu(), torch.full((8,), 2.0))


def test_refused_op_swallowed_in_the_body_fails_capture_end():
    x = _vk(8, fill=1.0)
    g = torch.vulkan.VulkanGraph()
    with pytest.raises(RuntimeError, match="Vulkan graph capture failed: .*copy to the host"):
        with torch.vulkan.graph(g):
            try:
                x.cpu()
            except RuntimeError:
                pass
    assert not g.info()["recorded"] and not torch.vulkan.is_capturing()


def test_graph_pool_released_when_the_graph_is_destroyed():
    vulkan.empty_cache()
    before = vulkan.memory_stats()
    x = _vk(1 << 20, fill=1.0)  # 4 MiB: large blocks, one device allocation each
    g = torch.vulkan.VulkanGraph()
    with torch.vulkan.graph(g):
        t = x * 3.0  # freed inside the capture: stays in the graph's pool
        t_addr = t.data_ptr()
        out = t + x
        del t
    pool = g.info()["pool_bytes"]
    assert pool >= 2 * (4 << 20)
    assert vulkan.memory_stats()["graph_pool_bytes"] == before["graph_pool_bytes"] + pool
    u = _vk(1 << 20)  # created outside the graph: never the memory of the graph's temporary
    assert u.data_ptr() != t_addr
    g.replay()
    assert torch.equal(out.cpu()[:4], torch.full((4,), 4.0))
    assert torch.equal(u.cpu()[:4], torch.zeros(4))  # the replay did not write u
    held = vulkan.memory_stats()["reserved_bytes"]
    del g
    after = vulkan.memory_stats()
    assert after["graph_pool_bytes"] == before["graph_pool_bytes"]
    assert after["reserved_bytes"] <= held - (4 << 20)  # the temporary's block went back to the driver
    assert torch.equal(out.cpu()[:4], torch.full((4,), 4.0))  # outputs outlive the graph


def test_profile_counts_a_replay_as_its_recorded_commands():
    x = _vk(16)
    g = torch.vulkan.VulkanGraph()
    with torch.vulkan.graph(g):
        y = (x + 1.0) * 2.0
    info = g.info()
    was = vulkan.profiling()
    vulkan.set_profiling(True)
    try:
        vulkan.synchronize()
        vulkan.profile()
        g.replay()
        vulkan.synchronize()
        p = vulkan.profile()
    finally:
        vulkan.set_profiling(was)
    assert p["dispatches"] == info["dispatches"] == 2 and p["barriers"] == info["barriers"]
    assert p["submits"] == 1
    assert torch.equal(y.cpu(), torch.full((16,), 2.0))


# ---------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_replay_equals_eager(files, arch):
    worst, report = replay_vs_eager(files[arch], N_TOKENS, device="vulkan")
    assert worst == 0.0, f"{arch}: replay differs from eager by {worst:.3e}\n{report}"


def test_generate_replays_with_eager_tokens_and_env_toggle(files, monkeypatch):
    model = hanzo_torch.load(files["qwen3moe"], device="vulkan", max_context=32)
    a = model.generate([1, 2, 3, 4], 12, temperature=0, ignore_eos=True, cuda_graph=False)
    b = model.generate([1, 2, 3, 4], 12, temperature=0, ignore_eos=True)
    c = model.generate([1, 2, 3, 4], 12, temperature=0, ignore_eos=True)  # the cached graph
    assert not a.stats.cuda_graph and b.stats.cuda_graph and c.stats.cuda_graph
    assert a.token_ids == b.token_ids == c.token_ids
    assert len(model._hanzo_decode_graphs) == 1
    monkeypatch.setattr(vulkan, "GRAPHS", False)  # what HANZO_VK_GRAPH=0 at import gives
    d = model.generate([1, 2, 3, 4], 4, temperature=0, ignore_eos=True)
    assert not d.stats.cuda_graph and d.token_ids == a.token_ids[:4]


def test_new_kv_cache_invalidates_the_graph(files):
    model = hanzo_torch.load(files["qwen3"], device="vulkan", max_context=16)
    ref = model.generate([5, 6, 7], 6, temperature=0, ignore_eos=True, cuda_graph=False).token_ids
    a = model.generate([5, 6, 7], 6, temperature=0, ignore_eos=True)
    graphs = model._hanzo_decode_graphs
    (old,) = graphs.values()
    model.setup_cache(1)  # new KV caches: the captured graph writes the old ones
    b = model.generate([5, 6, 7], 6, temperature=0, ignore_eos=True)
    assert a.stats.cuda_graph and b.stats.cuda_graph and a.token_ids == b.token_ids == ref
    assert len(graphs) == 1 and old not in graphs.values()  # the graph of the old caches is dropped
    hanzo_torch.cuda_graphs.clear_graphs(model)
    assert not hasattr(model, "_hanzo_decode_graphs")
