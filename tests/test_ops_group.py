"""``hanzo::mul_mat_group`` (several mat-muls of one activation): the C++ CPU kernel gives the bits
of the ``mul_mat`` calls it replaces, on every ISA level and thread count; the reference and the
argument errors; the model's q/k/v through :func:`~hanzo_torch.models.layers.linear_group` and the
layers that must keep their own module calls (hooks, LoRA, dense twins)."""
from __future__ import annotations

import pytest
import torch

import hanzo_torch
from hanzo_torch.backends import cpu
from hanzo_torch.backends.triton._testing import random_packed
from hanzo_torch.models import layers
from hanzo_torch.models.layers import PackedLinear, linear_group
from hanzo_torch.tensor import GGUFTensor

ops = torch.ops.hanzo

# (formats, widths): the q/k/v of Q4_K_M files (Q4_K, Q4_K, Q6_K), formats of another block size
# (Q8_0: 32 values, quantized apart from the 256-value blocks), an i-quant and a dense weight
GROUPS = [
    (("Q4_K", "Q4_K", "Q6_K"), (64, 16, 16)),
    (("Q8_0", "Q4_K", "Q5_0"), (40, 8, 9)),
    (("IQ4_XS", "F16"), (33, 7)),
]


def _group(qtypes, widths, K=512, seed=0):
    ws = [random_packed(q, (n, K), seed=seed + i) for i, (q, n) in enumerate(zip(qtypes, widths))]
    g = torch.Generator().manual_seed(seed)
    bs = [torch.randn(n, generator=g) if i != 1 else None for i, n in enumerate(widths)]
    return ws, bs


def _one_by_one(x, ws, qtypes, bs):
    out = []
    for w, q, b in zip(ws, qtypes, bs):
        y = ops.mul_mat(x, w, q)
        out.append(y if b is None else y + b)
    return out


@pytest.mark.parametrize("qtypes,widths", GROUPS)
@pytest.mark.parametrize("M", [1, 3, cpu.MV_MAX_ROWS, 40])
def test_cpu_kernel_gives_the_bits_of_mul_mat(qtypes, widths, M):
    ws, bs = _group(qtypes, widths)
    x = torch.randn(M, 512, generator=torch.Generator().manual_seed(M))
    assert "mul_mat_group" in hanzo_torch.backends.activate("cpu")
    with torch.inference_mode():
        got = ops.mul_mat_group(x, ws, list(qtypes), bs)
        want = _one_by_one(x, ws, qtypes, bs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and torch.equal(g, w)


def _isas():
    e = cpu.extension()
    return [cpu.ISA_NAMES[i] for i in e.supported_isas()] if e is not None else ["scalar"]


@pytest.mark.parametrize("isa", _isas())
def test_every_isa_level_and_thread_count_same_bits(isa):
    qtypes, widths = GROUPS[0]
    ws, bs = _group(qtypes, widths, K=1024, seed=3)
    threads = torch.get_num_threads()
    try:
        for M, mv in ((1, None), (4, None), (4, 2)):  # mat-vec, and 4 rows on the GEMM
            x = torch.randn(M, 1024, generator=torch.Generator().manual_seed(M))
            want = [cpu.mul_mat(x, w, q, isa=isa, mv_max_rows=mv) + (0 if b is None else b)
                    for w, q, b in zip(ws, qtypes, bs)]
            for nth in (1, 2, 3):
                torch.set_num_threads(nth)
                got = cpu.mul_mat_group(x, ws, list(qtypes), bs, isa=isa, mv_max_rows=mv)
                assert all(torch.equal(g, w) for g, w in zip(got, want)), (isa, M, mv, nth)
    finally:
        torch.set_num_threads(threads)


def test_bf16_activations_and_the_bias_promotion():
    """Without biases a bfloat16 x gives bfloat16 results, as mul_mat; a float32 bias on a bfloat16
    x gives float32, as ``y + b`` does (the CPU kernel hands that case to the reference)."""
    ws, bs = _group(("Q4_K", "Q8_0"), (24, 8), seed=5)
    x = torch.randn(2, 512).bfloat16()
    got = ops.mul_mat_group(x, ws, ["Q4_K", "Q8_0"], [None, None])
    assert [g.dtype for g in got] == [torch.bfloat16] * 2
    assert all(torch.equal(g, w) for g, w in zip(got, _one_by_one(x, ws, ["Q4_K", "Q8_0"], [None, None])))
    got = ops.mul_mat_group(x, ws, ["Q4_K", "Q8_0"], bs)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    assert all(torch.equal(g, w) for g, w in zip(got, _one_by_one(x, ws, ["Q4_K", "Q8_0"], bs)))


def test_reference_mode_of_mul_mat_reaches_the_group():
    """mul_mat is a part of mul_mat_group: its reference mode puts the group in reference mode too."""
    qtypes, widths = GROUPS[0]
    ws, bs = _group(qtypes, widths, seed=7)
    x = torch.randn(1, 512)
    with hanzo_torch.ops.use_reference("mul_mat"):
        got = ops.mul_mat_group(x, ws, list(qtypes), bs)
        want = [hanzo_torch.ops.quant.mul_mat_reference(x, w, q) + (0 if b is None else b)
                for w, q, b in zip(ws, qtypes, bs)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_errors_name_the_weight_and_the_bias():
    ws, bs = _group(("Q4_K", "Q6_K"), (8, 8), seed=9)
    x = torch.randn(1, 512)
    with pytest.raises(ValueError, match="2 weights, 1 qtypes and 2 biases"):
        ops.mul_mat_group(x, ws, ["Q4_K"], bs)
    with pytest.raises(ValueError, match="at least one weight"):
        ops.mul_mat_group(x, [], [], [])
    with pytest.raises(ValueError, match="weight 1: .*bytes per Q4_K row"):
        ops.mul_mat_group(x, ws, ["Q4_K", "Q4_K"], bs)
    with pytest.raises(ValueError, match=r"bias 0 must be \[N\] = \[8\]"):
        ops.mul_mat_group(x, ws, ["Q4_K", "Q6_K"], [torch.zeros(9), None])
    with pytest.raises(ValueError, match="bias 1 must be a float tensor"):
        ops.mul_mat_group(x, ws, ["Q4_K", "Q6_K"], [None, torch.zeros(8, dtype=torch.int32)])
    with pytest.raises(ValueError, match="weight 0: .*K=100"):
        ops.mul_mat_group(torch.randn(1, 100), ws, ["Q4_K", "Q6_K"], bs)


def _packed_linear(q, n, K, bias, seed):
    m = PackedLinear(K, n, bias=bias)
    m.weight = torch.nn.Parameter(GGUFTensor(random_packed(q, (n, K), seed=seed), q, (n, K)), requires_grad=False)
    if bias:
        m.bias = torch.nn.Parameter(torch.randn(n), requires_grad=False)
    return m


def _count_group_calls(monkeypatch):
    calls = []
    real = torch.ops.hanzo

    class Counting:
        def __getattr__(self, name):
            if name == "mul_mat_group":
                calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(layers, "hanzo", Counting())
    return calls


def test_linear_group_runs_one_op_for_plain_packed_layers(monkeypatch):
    mods = [_packed_linear("Q4_K", 32, 256, True, 1), _packed_linear("Q6_K", 8, 256, True, 2),
            _packed_linear("Q8_0", 8, 256, False, 3)]
    x = torch.randn(1, 2, 256)
    calls = _count_group_calls(monkeypatch)
    with torch.no_grad():
        got = linear_group(x, *mods)
        want = [m(x) for m in mods]
    assert calls == ["mul_mat_group"]
    assert [g.shape for g in got] == [(1, 2, 32), (1, 2, 8), (1, 2, 8)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_linear_group_keeps_module_calls_for_hooks_lora_and_dense_layers(monkeypatch):
    x = torch.randn(1, 256)
    calls = _count_group_calls(monkeypatch)
    mods = [_packed_linear("Q4_K", 16, 256, True, 4), _packed_linear("Q4_K", 8, 256, True, 5)]
    seen = []
    h = mods[1].register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))
    with torch.no_grad():
        got = linear_group(x, *mods)
    h.remove()
    assert calls == [] and seen == [(1, 256)]
    assert all(torch.equal(g, m(x)) for g, m in zip(got, mods))

    dense = layers.Linear(256, 8, bias=True)
    torch.nn.init.normal_(dense.weight)
    torch.nn.init.normal_(dense.bias)
    with torch.no_grad():
        got = linear_group(x, mods[0], dense)
    assert calls == [] and torch.equal(got[1], dense(x))

    peft = pytest.importorskip("peft")
    net = torch.nn.Module()
    net.attn_q, net.attn_k = _packed_linear("Q4_K", 16, 256, False, 6), _packed_linear("Q4_K", 8, 256, False, 7)
    import hanzo_torch.lora as hlora

    lora = peft.get_peft_model(net, hlora.register(peft.LoraConfig(r=2, target_modules=["attn_q"],
                                                                     init_lora_weights=False)))
    q_mod = lora.base_model.model.attn_q
    with torch.no_grad():
        got = linear_group(x, q_mod, lora.base_model.model.attn_k)
        want = q_mod(x)
    assert calls == [] and torch.equal(got[0], want)
    assert not torch.equal(want, ops.mul_mat(x, net.attn_q.base_layer.weight.packed, "Q4_K"))  # the adapter adds


def test_linear_group_trains_x_but_not_a_trainable_bias():
    a, b = _packed_linear("Q8_0", 8, 64, True, 8), _packed_linear("Q8_0", 4, 64, True, 9)
    x = torch.randn(2, 64, requires_grad=True)
    qa, qb = linear_group(x, a, b)
    (qa.sum() + qb.sum()).backward()
    g = x.grad.clone()
    x.grad = None
    (a(x).sum() + b(x).sum()).backward()
    torch.testing.assert_close(g, x.grad)
    b.bias.requires_grad_(True)  # a bias that trains: the layers run one by one and it gets its gradient
    _, qb = linear_group(x, a, b)
    qb.sum().backward()
    assert b.bias.grad is not None and torch.equal(b.bias.grad, torch.full((4,), 2.0))


def test_cpu_wrapper_refuses_a_bias_beside_bf16_x():
    ws, bs = _group(("Q4_K",), (8,), seed=11)
    with pytest.raises(ValueError, match="biases need float32 x"):
        cpu.mul_mat_group(torch.randn(1, 512).bfloat16(), ws, ["Q4_K"], bs)
