"""torch.compile sees through GGUFTensor weights: one graph, no breaks, hanzo ops on the packed bytes.

The module mixes every way a model uses packed weights: ``nn.Embedding`` (-> get_rows), ``nn.Linear``
(-> mul_mat), ``x @ w.T`` (-> mul_mat), a stacked expert weight through ``mul_mat_id`` with ids from
``moe_route``, and the fused ``rms_norm`` / ``swiglu`` ops. It must compile with ``fullgraph=True``,
the forward graph handed to the backend must hold the hanzo ops (and no full-size dequantize), and the
compiled result must equal eager.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd

from hanzo_torch import GGUFTensor

from test_ops_quant import random_packed, references_only  # noqa: F401 (autouse fixture)

V, H, FF, E, TOPK = 32, 256, 512, 4, 2


def packed(qtype, shape, seed):
    """A GGUFTensor parameter whose rows repeat 8 drawn rows (drawing every row would be slow)."""
    rows = random_packed(qtype, (8, shape[-1]), seed=seed, lo=0.01, hi=0.1)
    n = torch.Size(shape[:-1]).numel()
    data = rows[(torch.arange(n) * 5 + seed) % 8].reshape(*shape[:-1], rows.shape[-1])
    return nn.Parameter(GGUFTensor(data, qtype, shape), requires_grad=False)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.norm = nn.Parameter(torch.rand(H) + 0.5, requires_grad=False)
        self.gate = nn.Linear(H, FF, bias=False)
        self.up = nn.Linear(H, FF, bias=True)
        self.down = nn.Parameter(torch.empty(H, FF), requires_grad=False)
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.Parameter(torch.empty(E, H, H), requires_grad=False)
        with torch.no_grad():
            self.embed.weight = packed("Q4_K", (V, H), 1)
            self.gate.weight = packed("Q8_0", (FF, H), 2)
            self.up.weight = packed("IQ4_XS", (FF, H), 3)
            self.down = packed("Q6_K", (H, FF), 4)
            self.router.weight = packed("Q4_0", (E, H), 5)
            self.experts = packed("Q5_K", (E, H, H), 6)
        self.requires_grad_(False)

    def forward(self, ids):                                   # ids: [T]
        h = self.embed(ids)                                   # [T, H]
        x = torch.ops.hanzo.rms_norm(h, self.norm, 1e-6)
        y = torch.ops.hanzo.swiglu(self.gate(x), self.up(x))  # [T, FF]
        h = h + y @ self.down.T                               # [T, H]
        weights, sel = torch.ops.hanzo.moe_route(F.linear(h, self.router.weight), TOPK, True)  # [T, k]
        out = torch.ops.hanzo.mul_mat_id(h, self.experts.packed, sel, self.experts.qtype)     # [T, k, H]
        return h + (weights.unsqueeze(-1) * out).sum(1)


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    return Block().eval()


def test_compile_fullgraph_no_breaks(block):
    ids = torch.tensor([3, 1, 31, 0, 7])
    eager = block(ids)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(block)(ids)
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    counter = torch._dynamo.testing.CompileCounterWithBackend(aot_autograd(fw_compiler=capture))
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    with torch.no_grad():
        out = compiled(ids)
    assert counter.frame_count == 1
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)

    # the graph the backend sees holds the hanzo ops on uint8 inputs, not dense weights
    code = graphs[0].code
    for op in ("hanzo.get_rows", "hanzo.mul_mat", "hanzo.mul_mat_id", "hanzo.rms_norm", "hanzo.swiglu",
               "hanzo.moe_route"):
        assert op in code, op
    assert "hanzo.dequantize" not in code
    placeholders = [n for n in graphs[0].graph.nodes if n.op == "placeholder"]
    assert any(n.meta["val"].dtype == torch.uint8 for n in placeholders)


def test_compile_dynamic_lengths(block):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for T in (3, 9, 17):
            ids = torch.randint(0, V, (T,))
            torch.testing.assert_close(compiled(ids), block(ids), rtol=1e-5, atol=1e-5)
            if T == 3:
                # (dynamo may restart its first analysis once to specialize python floats: count after it)
                compiles = counter.frame_count
    assert counter.frame_count == compiles  # no recompilation: one dynamic graph serves every length


@pytest.mark.slow
def test_compile_inductor(block):
    """The default backend (inductor, CPU): compiles and matches eager. Slow (about 40 s of C++ code
    generation and g++ on a cold cache), so it runs with ``-m slow``; the aot_eager tests above cover
    the subclass desugaring and graph-break checks in the default suite."""
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    ids = torch.tensor([2, 30, 2])
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), block(ids), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Guard against positions frozen at trace time (the CPU twin of the CUDA-graph replay test)
#
# A decode step that reads its position from anything but the ``positions`` tensor (a Python int,
# a host copy) replays a stale position once captured: with CUDA graphs every replay runs at the
# capture's position (DESIGN section 4). torch.compile exposes the same bug on the CPU: the step
# is compiled once with ``fullgraph=True`` (a host sync such as ``int(positions[0, 0])`` is a
# graph break, hence an error) and recompiles are errors (a Python int position is guarded on,
# so the next token would recompile); positions are updated in place for GUARD_TOKENS steps and
# every compiled step must give the eager step's logits exactly (same ops, same inputs).

GUARD_TOKENS = 64
GUARD_PROMPT = 4


@pytest.fixture(scope="module")
def guard_files(tmp_path_factory):
    from tests.gguf_builders import tiny_spec, tokenizer_metadata, write_tiny_gguf

    root = tmp_path_factory.mktemp("guard")
    meta = tokenizer_metadata(full=False)
    # a 1024-token vocabulary keeps the LM head small (the step time is what the 64 tokens cost)
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"][:1024]
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id"):
        meta[key] = 1023
    packed = dict(embd="Q8_0", attn="Q4_K", ffn="Q4_K", ffn_down="Q6_K")
    specs = {"qwen3": dict(qtypes=packed), "qwen3moe": dict(qtypes=packed)}
    return {a: write_tiny_gguf(root / f"{a}.gguf", tiny_spec(a, **s), meta) for a, s in specs.items()}


def compiled_decode_guard(path: str, n_tokens: int = GUARD_TOKENS) -> int:
    """Run ``n_tokens`` decode steps compiled once (fullgraph, recompiles forbidden) against eager
    steps of a second copy of the model; assert equal logits; return the number of compiles."""
    import hanzo_torch

    ctx = GUARD_PROMPT + n_tokens
    eager = hanzo_torch.load(path, max_context=ctx)
    model = hanzo_torch.load(path, max_context=ctx)
    tokens = torch.randint(0, eager.args.vocab_size, (ctx,), generator=torch.Generator().manual_seed(3))
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    counter = torch._dynamo.testing.CompileCounterWithBackend(aot_autograd(fw_compiler=keep))
    torch._dynamo.reset()
    step = torch.compile(model, backend=counter, fullgraph=True, dynamic=False)
    ids = torch.zeros((1, 1), dtype=torch.long)
    pos = torch.zeros((1, 1), dtype=torch.long)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is ~15x faster than two on a busy 2-core machine
    try:
        _guard_steps(eager, model, step, tokens, ids, pos, ctx)
    finally:
        torch.set_num_threads(threads)
    # no host sync: a value read back to the host shows up as _local_scalar_dense (.item())
    for gm in graphs:
        assert "_local_scalar_dense" not in gm.code, "the compiled decode step reads a tensor value on the host"
    return counter.frame_count


def _guard_steps(eager, model, step, tokens, ids, pos, ctx):
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        prompt, ppos = tokens[None, :GUARD_PROMPT], torch.arange(GUARD_PROMPT)[None]
        model.host_position = eager.host_position = 0
        eager(prompt, positions=ppos)
        model(prompt, positions=ppos)  # prefill stays eager
        for t in range(GUARD_PROMPT, ctx):
            ids.fill_(int(tokens[t]))
            pos.fill_(t)  # in place: the compiled step must read the new value
            model.host_position = t  # only the mutated variants below read this
            eager.host_position = t
            ref = eager(ids, positions=pos, last_only=True)
            out = step(ids, positions=pos, last_only=True)
            assert torch.equal(out, ref), (
                f"compiled decode step differs from eager at position {t}: "
                f"max |diff| {(out - ref).abs().max().item():.3e}")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
def test_compiled_decode_reads_positions_on_device(guard_files, arch):
    assert compiled_decode_guard(guard_files[arch]) == 1


_ORIGINAL_POSITIONS = None


def _positions_from_python_int(self, B, T, positions):
    # mutation: the position comes from a host-side Python int, not from the positions tensor
    _ORIGINAL_POSITIONS(self, B, T, positions)  # cache allocation and checks, as before
    return torch.arange(T, device=self.device).expand(B, T) + self.host_position


def _positions_synced_to_host(self, B, T, positions):
    # mutation: the position is read back to the host and rebuilt (a device sync on a GPU)
    positions = _ORIGINAL_POSITIONS(self, B, T, positions)
    return torch.arange(T, device=self.device).expand(B, T) + int(positions[0, 0])


@pytest.mark.parametrize("mutation,caught_by", [
    (_positions_from_python_int, "Recompil"),  # guarded on the int: the next token recompiles
    (_positions_synced_to_host, "reads a tensor value on the host"),  # .item() in the graph
])
def test_decode_guard_catches_a_baked_in_position(guard_files, monkeypatch, mutation, caught_by):
    """Both mutations give correct eager logits; the guard must reject them all the same."""
    from hanzo_torch.models.qwen import Transformer

    monkeypatch.setitem(globals(), "_ORIGINAL_POSITIONS", Transformer.next_positions)
    monkeypatch.setattr(Transformer, "next_positions", mutation)
    with pytest.raises((torch._dynamo.exc.RecompileError, torch._dynamo.exc.Unsupported,
                        torch._dynamo.exc.UserError, torch._dynamo.exc.BackendCompilerFailed,
                        AssertionError)) as info:
        compiled_decode_guard(guard_files["qwen3moe"], n_tokens=4)
    assert caught_by in f"{type(info.value).__name__}: {info.value}"
