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
