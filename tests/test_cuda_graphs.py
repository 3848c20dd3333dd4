"""Decode under CUDA/HIP graphs: a replayed decode step gives the eager step's logits, bit for bit.

The GPU cases (marked ``gpu``; ``pytest -m gpu tests/test_cuda_graphs.py``, also run by
benchmarks/gpu_check.py) write a tiny random-weight model per architecture, run the same
teacher-forced token sequence through two copies of it, one eager and one replaying the decode
step captured by :mod:`hanzo_torch.cuda_graphs`, and require max |logits diff| == 0 at every one
of ``N_TOKENS`` positions: the same kernels on the same inputs are deterministic, so any
difference is a captured value that should have been read from a device tensor (the MoE
position bug of DESIGN section 4 made replays diverge from about token 12). On a mismatch the
assertion lists the per-layer max diff of the first diverging step (:func:`layer_probe`).

The CPU cases check what runs without a device: ``generate`` with ``cuda_graph`` on and off
gives the same tokens on the CPU (where it is ignored), and the CLI flag.
"""
from __future__ import annotations

import pytest
import torch

import hanzo_torch
from hanzo_torch.cuda_graphs import DecodeStep, layer_probe
from tests.gguf_builders import write_small_vocab_models

N_TOKENS = 512  # decode steps compared per architecture
PROMPT = 8
# K-quant / legacy formats on the packed layers, as in the real Qwen files
SPECS = {
    "qwen3": dict(tied=False, qtypes=dict(embd="Q8_0", output="Q6_K", attn="Q4_K", ffn="Q4_K", ffn_down="Q6_K")),
    "qwen3moe": dict(qtypes=dict(embd="Q8_0", attn="Q8_0", ffn="Q4_K", ffn_down="Q6_K")),
    "qwen2": dict(qtypes=dict(embd="Q4_K", attn="Q4_K", ffn="Q4_K", ffn_down="Q6_K")),
}
VOCAB = 4096  # the first tokens of the Qwen vocabulary: a small LM head keeps the CPU cases fast

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_small_vocab_models(tmp_path_factory.mktemp("graph_models"), SPECS, VOCAB)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one CPU thread is much faster than two on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _layer_report(eager_probe, graph_probe) -> str:
    rows = [f"  layer {i}: max |diff| {(a - b).abs().max().item():.3e}"
            for i, (a, b) in enumerate(zip(eager_probe, graph_probe))]
    return "\n".join(rows)


def replay_vs_eager(path: str, n_tokens: int, device: str = "cuda", dtype=None) -> tuple[float, str]:
    """Max |logits diff| of replay vs eager over ``n_tokens`` teacher-forced decode steps, and a
    per-layer report of the first step that differed ("" when none did)."""
    eager = hanzo_torch.load(path, device=device, dtype=dtype, max_context=PROMPT + n_tokens + 1)
    graph = hanzo_torch.load(path, device=device, dtype=dtype, max_context=PROMPT + n_tokens + 1)
    V = eager.args.vocab_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (PROMPT + n_tokens,), generator=g).to(device)
    worst, report = 0.0, ""
    with torch.inference_mode(), layer_probe(eager) as pe, layer_probe(graph) as pg:
        prompt = tokens[:PROMPT][None]
        pos = torch.arange(PROMPT, device=device)[None]
        eager(prompt, positions=pos, last_only=True)
        graph(prompt, positions=pos, last_only=True)
        e_ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        e_pos = torch.zeros((1, 1), dtype=torch.long, device=device)
        step = DecodeStep(graph, 1, torch.device(device), cuda_graph=True, last_only=True)
        for t in range(PROMPT, PROMPT + n_tokens):
            e_ids.copy_(tokens[t].view(1, 1))
            e_pos.fill_(t)
            ref = eager(e_ids, positions=e_pos, last_only=True)
            step.input_ids.copy_(tokens[t].view(1, 1))
            step.positions.fill_(t)
            out = step()
            assert step.graphed, "the decode step was not captured"
            diff = (out - ref).abs().max().item()
            if diff > worst or diff != diff:
                worst = diff if diff == diff else float("inf")
                if not report:
                    report = f"first difference at position {t}:\n" + _layer_report(pe, pg)
    return worst, report


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("arch", list(SPECS))
def test_replay_equals_eager(files, arch):
    worst, report = replay_vs_eager(files[arch], N_TOKENS)
    assert worst == 0.0, f"{arch}: replay differs from eager by {worst:.3e}\n{report}"


@pytest.mark.gpu
@needs_gpu
def test_generate_replays_and_matches_eager_tokens(files):
    model = hanzo_torch.load(files["qwen3moe"], device="cuda", max_context=256)
    a = model.generate([1, 2, 3, 4], 64, temperature=0, ignore_eos=True, cuda_graph=False)
    b = model.generate([1, 2, 3, 4], 64, temperature=0, ignore_eos=True, cuda_graph=True)
    c = model.generate([1, 2, 3, 4], 64, temperature=0, ignore_eos=True)  # cached graph, second use
    assert not a.stats.cuda_graph and b.stats.cuda_graph and c.stats.cuda_graph
    assert a.token_ids == b.token_ids == c.token_ids


@pytest.mark.gpu
@needs_gpu
def test_compile_reduce_overhead_decode_step(files):
    """torch.compile(mode="reduce-overhead") (cudagraph trees) on the decode step equals eager."""
    path = files["qwen3"]
    eager = hanzo_torch.load(path, device="cuda", max_context=64)
    comp = hanzo_torch.load(path, device="cuda", max_context=64)
    torch._dynamo.reset()
    step = torch.compile(comp, mode="reduce-overhead", fullgraph=True)
    ids = torch.zeros((1, 1), dtype=torch.long, device="cuda")
    pos = torch.zeros((1, 1), dtype=torch.long, device="cuda")
    with torch.inference_mode():
        for t in range(32):
            ids.fill_(7 * t + 1)
            pos.fill_(t)
            ref = eager(ids, positions=pos, last_only=True)
            out = step(ids, positions=pos, last_only=True).clone()
            torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3, msg=f"position {t}")


# ---------------------------------------------------------------------------------------------- CPU


def test_generate_on_cpu_with_and_without_graph(files, monkeypatch):
    from hanzo_torch.backends import cpu

    monkeypatch.setattr(cpu, "GRAPHS", True)  # whatever HANZO_CPU_GRAPH says in this environment
    model = hanzo_torch.load(files["qwen3"], max_context=64)
    a = model.generate([5, 6, 7], 6, temperature=0, ignore_eos=True, cuda_graph=True)
    b = model.generate([5, 6, 7], 6, temperature=0, ignore_eos=True, cuda_graph=False)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 6
    assert a.stats.cuda_graph == cpu.available() and not b.stats.cuda_graph  # a CPU graph (tests/test_cpu_graphs.py)


def test_decode_step_eager_on_cpu_and_layer_probe(files):
    """The probe's hooks run Python (and copies) that a CPU graph would not replay: the step says
    so once and stays eager, and the probe still sees every layer."""
    model = hanzo_torch.load(files["qwen3"], max_context=64)
    with torch.inference_mode(), layer_probe(model) as probe:
        model(torch.tensor([[1, 2, 3]]), positions=torch.arange(3)[None])
        step = DecodeStep(model, 1, torch.device("cpu"), cuda_graph=True, last_only=True)
        step.input_ids.fill_(9)
        step.positions.fill_(3)
        if step.use_graph:  # the CPU kernels are built and HANZO_CPU_GRAPH is on
            with pytest.warns(RuntimeWarning, match="capture failed.*forward hooks"):
                out = step()
        else:
            out = step()
        assert not step.use_graph and not step.graphed
        assert len(probe) == model.args.n_layer and probe[0].shape == (1, 1, model.args.dim)
        model.reset()
        model(torch.tensor([[1, 2, 3]]), positions=torch.arange(3)[None])
        ref = model(torch.tensor([[9]]), positions=torch.tensor([[3]]), last_only=True)
    assert torch.equal(out, ref)


def test_cli_no_graph_flag():
    from hanzo_torch.cli import build_parser

    p = build_parser()
    assert p.parse_args(["generate", "-p", "x", "--no-graph"]).no_graph is True
    assert p.parse_args(["generate", "-p", "x"]).no_graph is False


def test_decode_step_capture_cache_and_fallback(files, monkeypatch):
    """DecodeStep's bookkeeping with a stand-in for the capture (no device needed): one capture per
    batch size and KV cache, reused by later steps and generate calls, a new one after the cache
    is reallocated, and an eager fallback with a warning when capture raises."""
    import hanzo_torch.cuda_graphs as cg

    captures = []

    class FakeCapture:
        def __init__(self, model, input_ids, positions, kwargs):
            captures.append(self)
            self.model, self.input_ids, self.positions, self.kwargs = model, input_ids, positions, kwargs

        def replay(self):
            return self.model(self.input_ids, positions=self.positions, **self.kwargs)

    monkeypatch.setattr(cg, "graphs_supported", lambda device: True)
    monkeypatch.setattr(cg, "CapturedDecode", FakeCapture)
    model = hanzo_torch.load(files["qwen3"], max_context=64)
    a = model.generate([5, 6, 7], 6, temperature=0, ignore_eos=True)
    assert a.stats.cuda_graph and len(captures) == 1
    b = model.generate([5, 6, 7], 6, temperature=0, ignore_eos=True)
    assert b.stats.cuda_graph and len(captures) == 1 and a.token_ids == b.token_ids  # reused
    ref = model.generate([5, 6, 7], 6, temperature=0, ignore_eos=True, cuda_graph=False)
    assert not ref.stats.cuda_graph and ref.token_ids == a.token_ids
    # new KV cache buffers at new addresses (the old ones are kept alive, else the allocator may
    # hand the same memory back, and then the capture still applies): a new capture
    old_caches = [(blk.k_cache, blk.v_cache) for blk in model.blk]
    model.setup_cache(1)
    model.generate([5, 6, 7], 3, temperature=0, ignore_eos=True)
    assert len(captures) == 2
    del old_caches

    def broken(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cg, "CapturedDecode", broken)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    cg.clear_graphs(model)
    with pytest.warns(RuntimeWarning, match="capture failed.*not permitted"):
        c = model.generate([5, 6, 7], 6, temperature=0, ignore_eos=True)
    assert not c.stats.cuda_graph and c.token_ids == a.token_ids


@pytest.mark.parametrize("frozen", [False, True])
def test_replay_probe_on_cpu_catches_a_frozen_position(files, monkeypatch, frozen):
    """The GPU test's comparison run on the CPU with a stand-in capture. A faithful replay gives
    diff 0; a "capture" that freezes the position at its warm-up value (the MoE bug of DESIGN
    section 4) is reported with the per-layer diff."""
    import hanzo_torch.cuda_graphs as cg

    class FakeCapture:
        def __init__(self, model, input_ids, positions, kwargs):
            self.model, self.input_ids, self.kwargs = model, input_ids, kwargs
            self.positions = positions.clone() if frozen else positions

        def replay(self):
            return self.model(self.input_ids, positions=self.positions, **self.kwargs)

    monkeypatch.setattr(cg, "graphs_supported", lambda device: True)
    monkeypatch.setattr(cg, "CapturedDecode", FakeCapture)
    worst, report = replay_vs_eager(files["qwen3moe"], 12, device="cpu")
    if frozen:
        assert worst > 1e-3 and "first difference at position" in report and "layer 1:" in report
    else:
        assert worst == 0.0 and report == ""
