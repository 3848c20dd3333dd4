"""CPU graphs (csrc/cpu/graph.h, ``hanzo_torch.backends.cpu.capture``): a decode step recorded as
its hanzo ops' kernels and replayed from C++ gives the eager step's logits bit for bit, reads its
inputs at replay, and a call that a replay would get wrong (an op outside the hanzo ops, a
reference path, an output no kernel writes) fails the capture with the reason, after which
decoding stays eager."""
from __future__ import annotations

import warnings

import pytest
import torch

import hanzo_torch
from hanzo_torch.backends import cpu
from hanzo_torch.decode_graphs import DecodeStep
from tests.gguf_builders import write_small_vocab_models
from test_cpu_kernels import random_blocks

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C++ CPU kernels could not be built")

hanzo = torch.ops.hanzo
PROMPT = 8
VOCAB = 4096
SPECS = {
    "qwen3": dict(tied=False, qtypes=dict(embd="Q8_0", output="Q6_K", attn="Q4_K", ffn="Q4_K", ffn_down="Q6_K")),
    "qwen2": dict(qtypes=dict(embd="Q4_K", attn="Q4_K", ffn="Q4_K", ffn_down="Q6_K")),
    "qwen3moe": dict(qtypes=dict(embd="Q8_0", attn="Q8_0", ffn="Q4_K", ffn_down="Q6_K")),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_small_vocab_models(tmp_path_factory.mktemp("cpu_graph_models"), SPECS, VOCAB)


@pytest.fixture(autouse=True)
def graphs_on(monkeypatch):
    monkeypatch.setattr(cpu, "GRAPHS", True)  # whatever HANZO_CPU_GRAPH says in this environment


def replay_vs_eager(path, n_tokens: int, batch: int = 1, **load_kw) -> tuple[float, DecodeStep]:
    """Max |logits diff| of a replayed decode step vs the eager model over ``n_tokens``
    teacher-forced steps of ``batch`` sequences at different positions."""
    ctx = PROMPT + n_tokens + batch
    eager = hanzo_torch.load(path, max_context=ctx, **load_kw)
    graph = hanzo_torch.load(path, max_context=ctx, **load_kw)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, eager.args.vocab_size, (batch, PROMPT + n_tokens + batch), generator=g)
    worst = 0.0
    with torch.inference_mode():
        # sequence b starts b tokens later: one step has rows at different positions
        for m in (eager, graph):
            m(tokens[:, :PROMPT], positions=torch.arange(PROMPT).expand(batch, PROMPT))
        step = DecodeStep(graph, batch, torch.device("cpu"), cuda_graph=True, last_only=True)
        for t in range(PROMPT, PROMPT + n_tokens):
            pos = (torch.arange(batch) + t).clamp(max=ctx - 1).view(batch, 1)
            ids = tokens[torch.arange(batch), pos[:, 0]].view(batch, 1)
            ref = eager(ids, positions=pos, last_only=True)
            step.input_ids.copy_(ids)
            step.positions.copy_(pos)
            out = step()
            assert step.graphed, "the decode step was not captured"
            worst = max(worst, (out - ref).abs().max().item())
    return worst, step


@pytest.mark.parametrize("arch,kv", [("qwen3", None), ("qwen2", None), ("qwen3", "q8_0"), ("qwen2", "f32")])
def test_replay_equals_eager(files, arch, kv):
    worst, _ = replay_vs_eager(files[arch], 24, kv_dtype=kv)
    assert worst == 0.0, f"{arch} (KV {kv}): replay differs from eager by {worst:.3e}"


def test_replay_equals_eager_batched(files):
    worst, _ = replay_vs_eager(files["qwen2"], 12, batch=3)
    assert worst == 0.0


def test_graph_nodes_of_a_decode_step(files):
    model = hanzo_torch.load(files["qwen3"], max_context=32)
    ids, pos = torch.tensor([[3]]), torch.tensor([[2]])
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]))  # the KV cache is allocated (a capture must not allocate it)
        graph, out = cpu.capture(lambda: model(ids, positions=pos, last_only=True), 0)
        ops = [o.removeprefix("hanzo::") for o in graph.ops]
        L = model.args.n_layer
        per_layer = ["mul_mat_group", "qk_norm_rope_kv_write", "attention", "mul_mat", "add_rms_norm",
                     "swiglu_mul_mat", "mul_mat", "add_rms_norm"]
        assert ops == ["get_rows", "rms_norm"] + per_layer * L + ["mul_mat"] and len(graph) == len(ops)
        ref = out.clone()
        out.zero_()
        graph.replay()  # same inputs: the same logits again, in the same buffer
        assert torch.equal(out, ref)


@pytest.mark.parametrize("panels", [True, False])
def test_graph_accounts_the_weights_each_node_streams(files, panels):
    """CpuGraph.weights: per mat-vec node, each weight's rows (by address, in the op's order) and
    the bytes its kernel reads: the panels' where the mat-vec takes panels, else the rows'."""
    model = hanzo_torch.load(files["qwen2"], max_context=32)
    ext = cpu.extension()
    name_of = {p.packed.data_ptr(): n for n, p in model.named_parameters() if hasattr(p, "packed")}
    params = dict(model.named_parameters())
    ids, pos = torch.tensor([[3]]), torch.tensor([[2]])
    try:
        cpu.set_panels(panels)
        with torch.inference_mode():
            model(torch.tensor([[1, 2]]))
            graph, _ = cpu.capture(lambda: model(ids, positions=pos, last_only=True), 0)
    finally:
        cpu.set_panels(True)
    weights = graph.weights
    assert len(weights) == len(graph)
    names = [[name_of[a] for a, _ in ws] for ws in weights]
    L = model.args.n_layer
    expect = [[], []]
    for i in range(L):
        b = f"blk.{i}."
        expect += [[b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"], [], [], [b + "attn_output.weight"],
                   [], [b + "ffn_gate.weight", b + "ffn_up.weight"], [b + "ffn_down.weight"], []]
    out = "output.weight" if "output.weight" in params else "token_embd.weight"
    assert names == expect + [[out]]
    seen_panels = 0
    for ws in weights:
        for a, nbytes in ws:
            p = params[name_of[a]]
            rows = p.packed.numel()
            if panels and p.qtype == "Q4_K" and ext.panels_of(p.packed, cpu._type_id("Q4_K")):
                assert nbytes == ext.panel_bytes(cpu._type_id("Q4_K"), *p.packed.shape) > rows
                seen_panels += 1
            else:
                assert nbytes == rows
    assert (seen_panels > 0) == panels


def test_replay_reads_the_inputs_it_was_captured_with():
    w = random_blocks("Q4_K", 64, 256, seed=1)
    x = torch.randn(1, 256)
    with torch.inference_mode():
        graph, y = cpu.capture(lambda: hanzo.mul_mat(x, w, "Q4_K"), 0)
        for seed in range(3):
            x.copy_(torch.randn(1, 256, generator=torch.Generator().manual_seed(seed)))
            graph.replay()
            assert torch.equal(y, hanzo.mul_mat(x, w, "Q4_K"))


@pytest.mark.parametrize("case,match", [
    ("add", r"aten::add"),                            # an op between the hanzo ops
    ("inplace", r"aten::mul_"),                       # an in-place write
    ("copy", r"aten::_to_copy"),                      # a dtype conversion that copies
    ("reference", r"hanzo::mul_mat ran its torch reference"),  # a dense weight: the torch path
    ("bf16", r"float32 activations, got BFloat16"),
    ("static_output", r"not written by a hanzo op"),
    ("no_node", r"hanzo::swiglu has no CPU graph node"),
])
def test_capture_rejects_what_a_replay_would_miss(case, match):
    w = random_blocks("Q8_0", 32, 64, seed=2)
    x = torch.randn(1, 64)
    dense = torch.randn(32, 64).view(torch.uint8)  # F32 rows as packed bytes: the torch path
    xb = x.bfloat16()
    norm_w = torch.ones(64)
    calls = {
        "add": lambda: hanzo.mul_mat(x, w, "Q8_0") + 1,
        "inplace": lambda: hanzo.mul_mat(x, w, "Q8_0").mul_(2),
        "copy": lambda: hanzo.mul_mat(x.double(), w, "Q8_0"),
        "reference": lambda: hanzo.mul_mat(x, dense, "F32"),
        "bf16": lambda: hanzo.mul_mat(xb, w, "Q8_0"),
        "static_output": lambda: (hanzo.rms_norm(x, norm_w, 1e-6), x),
        "no_node": lambda: hanzo.swiglu(x, x),
    }
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match=match):
            cpu.capture(calls[case], 0)
    assert not cpu.extension().graph_capturing()


def test_capture_ends_when_the_call_raises():
    x, w = torch.randn(2, 8), torch.ones(8)

    def boom():
        hanzo.rms_norm(x, w, 1e-6)
        raise KeyError("inside the captured call")

    with pytest.raises(KeyError):
        cpu.capture(boom, 0)
    assert not cpu.extension().graph_capturing()
    graph, y = cpu.capture(lambda: hanzo.rms_norm(x, w, 1e-6), 0)  # a new capture works
    assert len(graph) == 1 and torch.equal(y, hanzo.rms_norm(x, w, 1e-6))


def test_generate_replays_and_matches_eager_tokens(files):
    model = hanzo_torch.load(files["qwen2"], max_context=96)
    a = model.generate([1, 2, 3, 4], 24, temperature=0, ignore_eos=True, cuda_graph=False)
    b = model.generate([1, 2, 3, 4], 24, temperature=0, ignore_eos=True)
    c = model.generate([1, 2, 3, 4], 24, temperature=0, ignore_eos=True)  # the cached graph
    assert not a.stats.cuda_graph and b.stats.cuda_graph and c.stats.cuda_graph
    assert a.token_ids == b.token_ids == c.token_ids
    assert model.seq_len == 4 + 24 - 1  # the replayed steps kept the sequence length as eager steps do


def test_moe_decodes_eagerly_with_one_warning(files):
    model = hanzo_torch.load(files["qwen3moe"], max_context=64)
    ref = model.generate([5, 6, 7], 6, temperature=0, ignore_eos=True, cuda_graph=False)
    with pytest.warns(RuntimeWarning, match="capture failed.*hanzo::"):
        a = model.generate([5, 6, 7], 6, temperature=0, ignore_eos=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the failure is remembered: no second capture, no warning
        b = model.generate([5, 6, 7], 6, temperature=0, ignore_eos=True)
    assert not a.stats.cuda_graph and not b.stats.cuda_graph
    assert a.token_ids == b.token_ids == ref.token_ids


def test_switch_off_and_position_checks(files, monkeypatch):
    model = hanzo_torch.load(files["qwen3"], max_context=16)
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]), positions=torch.arange(2)[None])
        monkeypatch.setattr(cpu, "GRAPHS", False)
        assert not DecodeStep(model, 1, torch.device("cpu"), last_only=True).use_graph
        monkeypatch.setattr(cpu, "GRAPHS", True)
        step = DecodeStep(model, 1, torch.device("cpu"), last_only=True)
        step.input_ids.fill_(4)
        step.positions.fill_(2)
        step()
        assert step.graphed
        step.positions.fill_(16)  # past max_context: the host check raises before any kernel runs
        with pytest.raises(ValueError, match="context overflow"):
            step()


def test_a_step_whose_caches_were_reallocated_runs_eagerly(files):
    model = hanzo_torch.load(files["qwen2"], max_context=16)
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]))
        step = DecodeStep(model, 1, torch.device("cpu"), last_only=True)
        step.input_ids.fill_(3)
        step.positions.fill_(2)
        step()
        assert step.graphed
        model.reset()
        model(torch.tensor([[1, 2], [1, 2]]))  # batch 2: new caches
        model.reset()
        model(torch.tensor([[1, 2]]))  # batch 1 again, in caches the graph does not write
        ref = model(torch.tensor([[3]]), positions=torch.tensor([[2]]), last_only=True)
        out = step()
        assert not step.graphed and torch.equal(out, ref)


def test_a_reallocated_cache_drops_the_old_graph(files):
    model = hanzo_torch.load(files["qwen2"], max_context=32)
    model.generate([1, 2], 3, temperature=0, ignore_eos=True)
    model.setup_cache(1)
    model.generate([1, 2], 3, temperature=0, ignore_eos=True)
    assert len(model._hanzo_decode_graphs) == 1


def test_captures_on_two_threads_at_once():
    """Each thread records its own graph (a model per thread in a server, say)."""
    import threading

    barrier = threading.Barrier(2, timeout=60)
    xs = [torch.randn(2, 8) for _ in range(2)]
    w = torch.ones(8)
    results, errors = [None, None], []

    def run(i):
        def step():
            barrier.wait()  # both captures are running now
            return hanzo.rms_norm(xs[i], w, 1e-6)

        try:
            results[i] = cpu.capture(step, 0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, (graph, y) in enumerate(results):
        xs[i].mul_(2)
        graph.replay()
        assert len(graph) == 1 and torch.equal(y, hanzo.rms_norm(xs[i], w, 1e-6))


def test_a_model_with_forward_hooks_decodes_eagerly(files):
    """A hook that runs no tensor op would pass the op check, but a replay skips its Python: the
    step refuses to capture and every token runs the hook."""
    model = hanzo_torch.load(files["qwen3"], max_context=32)
    calls = []
    handle = model.blk[0].register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        with pytest.warns(RuntimeWarning, match="forward hooks"):
            r = model.generate([1, 2, 3], 5, temperature=0, ignore_eos=True)
    finally:
        handle.remove()
    assert not r.stats.cuda_graph and len(calls) == 5  # the prefill and 4 decode steps


def test_graph_switch_value_is_checked(monkeypatch):
    for value in ("0", "1", "off", ""):
        monkeypatch.setenv("HANZO_CPU_GRAPH", value)
        cpu.check_environment()
    monkeypatch.setenv("HANZO_CPU_GRAPH", "maybe")
    with pytest.raises(ValueError, match="HANZO_CPU_GRAPH"):
        cpu.check_environment()


def test_replayed_mat_vecs_follow_what_their_plans_were_built_from():
    """A graph's mat-vec nodes (mul_mat, mul_mat_group, swiglu_mul_mat) resolve their operands once
    and replay them; each replay still gives the eager op's bits after whatever the resolution
    depended on changes: the panels switched off and on, a weight written in place (its panels
    retired: the replay must read the new rows), the thread count, the task size, the ISA level."""
    from test_cpu_panels import _attach

    ext = cpu.extension()
    K, N, F = 1024, 256, 512
    g = torch.Generator().manual_seed(11)
    wq, wk = random_blocks("Q4_K", N, K, seed=21), random_blocks("Q4_K", 64, K, seed=22)
    wv = random_blocks("Q6_K", 64, K, seed=23)
    wg, wu = random_blocks("Q4_K", F, K, seed=24), random_blocks("Q4_K", F, K, seed=25)
    wo = random_blocks("Q4_K", N, K, seed=26)
    bufs = [_attach(ext, w) for w in (wq, wk, wg, wu, wo)]
    bq, bk, bv = (torch.randn(n, generator=g) for n in (N, 64, 64))
    x = torch.randn(1, K, generator=g)

    def step():
        q, k, v = hanzo.mul_mat_group(x, [wq, wk, wv], ["Q4_K", "Q4_K", "Q6_K"], [bq, bk, bv])
        return q, k, v, hanzo.swiglu_mul_mat(x, wg, wu, "Q4_K", "Q4_K"), hanzo.mul_mat(x, wo, "Q4_K")

    def check(what):
        for seed in range(2):
            x.copy_(torch.randn(1, K, generator=torch.Generator().manual_seed(seed)))
            graph.replay()
            for got, want in zip(outs, step()):
                assert torch.equal(got, want), what

    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            graph, outs = cpu.capture(step, 0)
            check("replay")
            cpu.set_graph_plans(False)
            check("operands resolved at every replay")
            cpu.set_graph_plans(True)
            cpu.set_panels(False)
            check("panels off")
            cpu.set_panels(True)
            check("panels on again")
        for w, seed in ((wq, 31), (wg, 32), (wo, 33)):
            w.copy_(random_blocks("Q4_K", w.shape[0], K, seed=seed))  # the rows change: panels retired
        assert not ext.panels_of(wo, cpu._type_id("Q4_K"))
        with torch.inference_mode():
            check("weights written in place")
            torch.set_num_threads(1)
            check("one thread")
            torch.set_num_threads(max(2, threads))
            ext.set_matvec_chunk_bytes(16384, 2)
            check("smaller tasks")
            for isa in cpu.isa_levels():
                with cpu.use_isa(isa):
                    check(isa)
    finally:
        cpu.set_graph_plans(True)
        torch.set_num_threads(threads)
        ext.set_matvec_chunk_bytes(262144, 4)
        cpu.set_panels(True)
        del bufs
