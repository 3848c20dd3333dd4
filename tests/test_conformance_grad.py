"""Gradients of every differentiable ``hanzo`` op: ``torch.autograd.gradcheck`` in float64.

float64 is a reference-only dtype (hanzo_torch/ops/spec.py): the checks accept it, every backend
hands such a call to the op's reference, and the references compute in float64 for it, so the
finite differences of the op and its backward (hand-written, or derived from the reference) are
compared at float64 precision. The packed weights, ids, positions and strings are constants.
Ops that write arguments in place have no backward and must say so in backward.
"""
from __future__ import annotations

import pytest
import torch

import hanzo_torch
from hanzo_torch.backends.triton._testing import random_packed
from hanzo_torch.ops.spec import SPECS, NoBackwardError

ops = torch.ops.hanzo
f64 = dict(dtype=torch.float64)


def _r(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, **f64) * scale).requires_grad_(True)


def _cases():
    """op -> (function of the float inputs, the float inputs): tiny shapes."""
    w8 = random_packed("Q8_0", (6, 32), seed=1)
    w8b = random_packed("Q8_0", (6, 32), seed=2)
    w3 = random_packed("Q8_0", (3, 4, 32), seed=3)
    ids = torch.tensor([[0, 2], [1, 1]])
    pos = torch.tensor([[1, 2, 3]])
    D = 8
    return {
        "mul_mat": (lambda x: ops.mul_mat(x, w8, "Q8_0"), (_r(2, 32),)),
        "mul_mat_id": (lambda x: ops.mul_mat_id(x, w3, ids, "Q8_0"), (_r(2, 32, seed=1),)),
        "swiglu_mul_mat": (lambda x: ops.swiglu_mul_mat(x, w8, w8b, "Q8_0", "Q8_0"), (_r(2, 32, seed=2, scale=0.1),)),
        "mul_mat_group": (lambda x: tuple(ops.mul_mat_group(x, [w8, w8b[:3]], ["Q8_0", "Q8_0"],
                                                            [None, torch.ones(3, **f64)])),
                          (_r(2, 32, seed=23),)),
        "lora_mul_mat": (lambda x, a, b: ops.lora_mul_mat(x, w8, "Q8_0", a, b, 0.5),
                         (_r(2, 32, seed=3), _r(2, 32, seed=4), _r(6, 2, seed=5))),
        "moe_route": (lambda lg: ops.moe_route(lg, 2, True)[0], (_r(3, 5, seed=6),)),
        "rms_norm": (lambda x, w: ops.rms_norm(x, w, 1e-6), (_r(2, 8, seed=7), _r(8, seed=8))),
        "add_rms_norm": (lambda x, r, w: ops.add_rms_norm(x, r, w, 1e-6),
                         (_r(2, 8, seed=9), _r(2, 8, seed=10), _r(8, seed=11))),
        "qk_norm_rope": (lambda q, k, qw, kw: ops.qk_norm_rope(q, k, qw, kw, pos, 1e4, 1e-6),
                         (_r(1, 3, 2, D, seed=12), _r(1, 3, 1, D, seed=13), _r(D, seed=14), _r(D, seed=15))),
        "swiglu": (lambda g, u: ops.swiglu(g, u), (_r(2, 8, seed=16), _r(2, 8, seed=17))),
        "attention": (lambda q, kc, vc: (ops.attention(q, kc, vc, pos, 0.3, "eager"),
                                         ops.attention(q, kc, vc, pos, 0.3, "flash")),
                      (_r(1, 3, 2, D, seed=18), _r(1, 5, 1, D, seed=19), _r(1, 5, 1, D, seed=20))),
        "qk_norm_rope_kv_write": (
            lambda q, qw: ops.qk_norm_rope_kv_write(q, torch.ones(1, 3, 1, D, **f64), torch.ones(1, 3, 1, D, **f64), qw,
                                                    torch.ones(D, **f64), torch.zeros(1, 5, 1, D, **f64),
                                                    torch.zeros(1, 5, 1, D, **f64), pos, 1e4, 1e-6),
            (_r(1, 3, 2, D, seed=21), _r(D, seed=22))),
    }


# ops without a float output that a gradient could reach, and the ops that write in place
_NOT_DIFFERENTIABLE = {"dequantize", "get_rows", "quantize_q8_1", "kv_cache_write"}


def test_every_op_is_covered():
    assert set(_cases()) | _NOT_DIFFERENTIABLE == set(SPECS)


@pytest.mark.parametrize("op", sorted(_cases()))
def test_gradcheck_float64(op):
    fn, inputs = _cases()[op]
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-4)


def test_float64_runs_the_reference_on_the_cpu_backend():
    """A float64 call reaches the reference whatever kernel the backend has."""
    w = random_packed("Q4_K", (4, 256), seed=5)
    x = torch.randn(3, 256, **f64)
    assert "mul_mat" in hanzo_torch.backends.activate("cpu")
    y = ops.mul_mat(x, w, "Q4_K")
    assert y.dtype == torch.float64 and torch.equal(y, torch.ops.hanzo_ref.mul_mat(x, w, "Q4_K"))
    # the float64 result is the float64 product with the dequantized weight (no float32 rounding)
    wf = hanzo_torch.formats.dequantize(w, "Q4_K", (4, 256), torch.float32).double()
    torch.testing.assert_close(y, x @ wf.t(), rtol=1e-12, atol=1e-12)
    a = torch.randn(2, 16, **f64)
    assert torch.equal(ops.rms_norm(a, torch.ones(16, **f64), 1e-6), torch.ops.hanzo_ref.rms_norm(a, torch.ones(16, **f64), 1e-6))


def test_the_hand_written_backward_matches_the_reference_derived_one():
    """mul_mat's own backward (an override kept for speed) against the gradient of its reference."""
    w = random_packed("Q6_K", (7, 256), seed=6)
    x = _r(3, 256, seed=30)
    g = torch.randn(3, 7, **f64)
    (gx,) = torch.autograd.grad(ops.mul_mat(x, w, "Q6_K"), x, g)
    xr = x.detach().requires_grad_(True)
    (want,) = torch.autograd.grad(hanzo_torch.ops.quant.mul_mat_reference(xr, w, "Q6_K"), xr, g)
    torch.testing.assert_close(gx, want, rtol=1e-12, atol=1e-12)


def test_mul_mat_group_refuses_a_bias_that_trains():
    """Its biases are constants: a bias that requires grad is refused, not given a zero gradient."""
    w = random_packed("Q8_0", (6, 32), seed=7)
    b = torch.zeros(6, requires_grad=True)
    with pytest.raises(ValueError, match="bias 0 requires grad"):
        ops.mul_mat_group(torch.randn(2, 32, requires_grad=True), [w], ["Q8_0"], [b])
    with torch.no_grad():  # no graph: the bias is a value like any other
        (y,) = ops.mul_mat_group(torch.randn(2, 32), [w], ["Q8_0"], [b])
    assert y.shape == (2, 6)


def test_kv_cache_write_says_it_has_no_backward():
    kc, vc = torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8)
    k = torch.randn(1, 2, 1, 8, requires_grad=True)
    ops.kv_cache_write(kc, vc, k, torch.randn(1, 2, 1, 8), torch.tensor([[0, 1]]))
    assert torch.equal(kc[0, :2], k.detach()[0])  # the write happened
    out = ops.attention(torch.randn(1, 1, 2, 8), kc, vc, torch.tensor([[1]]), 0.3, "eager")
    with pytest.raises(NoBackwardError, match="hanzo::kv_cache_write has no backward"):
        out.sum().backward()
    with torch.no_grad():  # no graph, no error
        ops.kv_cache_write(kc, vc, k, k, torch.tensor([[2, 3]]))
    # a q8_0 (uint8) cache cannot carry a graph node: refused at the call
    kq = torch.zeros(1, 4, 1, 34, dtype=torch.uint8)
    with pytest.raises(NoBackwardError, match="kv_cache_write.*uint8"):
        ops.kv_cache_write(kq, kq.clone(), k, k.detach(), torch.tensor([[0, 1]]))


def test_qk_norm_rope_kv_write_caches_have_no_backward():
    D = 8
    q, k = torch.randn(1, 1, 2, D, requires_grad=True), torch.randn(1, 1, 1, D, requires_grad=True)
    kc, vc = torch.zeros(1, 4, 1, D), torch.zeros(1, 4, 1, D)
    q2 = ops.qk_norm_rope_kv_write(q, k, torch.randn(1, 1, 1, D), None, None, kc, vc, torch.tensor([[0]]), 1e4, 1e-6)
    out = ops.attention(q2, kc, vc, torch.tensor([[0]]), 0.3, "eager")
    with pytest.raises(NoBackwardError, match="hanzo::qk_norm_rope_kv_write has no backward"):
        out.sum().backward()
