"""The op table (hanzo_torch/ops/spec.py): what is derived from it, the generated C++ op enum
(csrc/cpu/hz_ops.h), and the gate of ``hanzo::lora_mul_mat``, the op added through it."""
from __future__ import annotations

import pytest
import torch

import hanzo_torch
from hanzo_torch import export as hexport
from hanzo_torch.backends.triton._testing import random_packed
from hanzo_torch.ops import codegen, spec
from hanzo_torch.ops.lora import lora_mul_mat_reference

ops = torch.ops.hanzo


# ---------------------------------------------------------------------------------------------- table
def test_everything_derives_from_the_table():
    names = list(spec.SPECS)
    assert hanzo_torch.ops.OPS == names
    for name, s in spec.SPECS.items():
        assert str(s.overload._schema) == f"hanzo::{name}{s.schema}"
        assert str(getattr(torch.ops.hanzo_ref, name).default._schema) == f"hanzo_ref::{name}{s.schema}"
        assert s.tolerance in ("exact", "same_bytes", "close", "contraction"), name
    assert set(hexport.DECOMPOSITIONS) - {torch.ops.aten.view.dtype} == {s.overload for s in spec.SPECS.values()}
    with pytest.raises(ValueError, match="unknown hanzo op 'nope'"):
        hanzo_torch.ops.check_args("nope")
    with pytest.raises(ValueError, match="declared twice"):
        spec.declare(spec.SPECS["swiglu"])


def test_the_fake_is_the_check_plus_the_output_rule():
    w = random_packed("Q8_0", (6, 64), seed=1)
    with torch._subclasses.FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(3, 64))
        wf = mode.from_tensor(w)
        y = ops.lora_mul_mat(x, wf, "Q8_0", torch.empty(2, 64), torch.empty(6, 2), 1.0)
        assert tuple(y.shape) == (3, 6) and y.dtype == torch.float32
        with pytest.raises(ValueError, match=r"lora_b must be \[N, r\] = \[6, 2\]"):
            ops.lora_mul_mat(x, wf, "Q8_0", torch.empty(2, 64), torch.empty(5, 2), 1.0)


# ---------------------------------------------------------------------------------------------- the header
def test_committed_header_is_the_generated_one():
    assert codegen.HEADER_PATH.read_text() == codegen.render_header(), \
        "csrc/cpu/hz_ops.h is stale: run python -m hanzo_torch.ops.codegen"
    text = codegen.HEADER_PATH.read_text()
    for i, name in enumerate(spec.SPECS):
        assert f"    {name.upper()},\n" in text and f'    "{name}",\n' in text
    assert text.index("LORA_MUL_MAT") > text.index("SWIGLU_MUL_MAT")  # table order


def test_check_mode_reports_a_stale_header(tmp_path, capsys):
    path = tmp_path / "hz_ops.h"
    path.write_text(codegen.render_header().replace("ATTENTION", "ATTN"))
    assert codegen.main(["--check", "--header", str(path)]) == 1
    assert "hz_ops.h is not what the op table gives" in capsys.readouterr().err
    path.write_text(codegen.render_header())
    assert codegen.main(["--check", "--header", str(path)]) == 0


def test_no_import_cycle_among_the_op_modules():
    """spec imports only _dispatch (and _dispatch nothing of ops at import); the op modules import
    spec and each other downwards (quant <- ffn, lora), never the package."""
    import ast
    import inspect

    from hanzo_torch.ops import _dispatch, ffn, fused, lora, quant

    def rel_imports(mod):
        tree = ast.parse(inspect.getsource(mod))
        out = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.level == 1:
                out |= {n.module} if n.module else {a.name for a in n.names}
        return out

    assert rel_imports(spec) <= {"_dispatch"}
    assert rel_imports(_dispatch) == set()
    # nor does any op module reach up to the backends (they import ops, never the reverse)
    for mod in (spec, _dispatch, quant, fused, ffn, lora):
        tree = ast.parse(inspect.getsource(mod))
        up = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 2
              and (n.module or "").split(".")[0] == "backends" or isinstance(n, ast.ImportFrom) and n.level == 2
              and n.module is None and any(a.name == "backends" for a in n.names)]
        assert not up, (mod.__name__, up)
    assert rel_imports(quant) <= {"spec"} and rel_imports(fused) <= {"spec"}
    assert rel_imports(ffn) <= {"spec", "quant"} and rel_imports(lora) <= {"spec", "quant"}


# ---------------------------------------------------------------------------------------------- lora_mul_mat
def _lora_inputs(qtype, N=12, K=256, r=4, M=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = random_packed(qtype, (N, K), seed=seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    a = (torch.randn(r, K, generator=g) * 0.1).to(dtype)
    b = (torch.randn(N, r, generator=g) * 0.1).to(dtype)
    return x, w, a, b


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_mul_mat_cpu_kernel_is_the_reference(qtype, dtype):
    """The CPU kernel (C++: the mul_mat kernel plus torch GEMMs) gives the reference's bits, and
    the reference is mul_mat plus the float32 adapter term."""
    assert "lora_mul_mat" in hanzo_torch.backends.activate("cpu")
    x, w, a, b = _lora_inputs(qtype, dtype=dtype)
    y = ops.lora_mul_mat(x, w, qtype, a, b, 0.75)
    assert y.dtype == dtype and y.shape == (3, 12)
    assert torch.equal(y, torch.ops.hanzo_ref.lora_mul_mat(x, w, qtype, a, b, 0.75))
    base = ops.mul_mat(x, w, qtype).double()
    want = base + 0.75 * (x.double() @ a.double().t()) @ b.double().t()
    torch.testing.assert_close(y.double(), want, rtol=1e-6 if dtype == torch.float32 else 2 ** -7, atol=1e-5)
    x3 = x.reshape(1, 3, 256)
    assert torch.equal(ops.lora_mul_mat(x3, w, qtype, a, b, 0.75), y.reshape(1, 3, 12))
    with hanzo_torch.ops.use_reference("lora_mul_mat"):
        assert torch.equal(ops.lora_mul_mat(x, w, qtype, a, b, 0.75), y)


def test_lora_mul_mat_gradients_for_the_adapter():
    """dL/dA = s (B^T G)^T... in closed form: with Y = X W^T + s X A^T B^T, dX = G W + s G B A,
    dA = s B^T G^T X, dB = s G^T X A^T."""
    x, w, a, b = _lora_inputs("Q4_K", seed=3)
    x, a, b = (t.clone().requires_grad_(True) for t in (x, a, b))
    s = 0.5
    y = ops.lora_mul_mat(x, w, "Q4_K", a, b, s)
    g = torch.randn_like(y)
    gx, ga, gb = torch.autograd.grad(y, (x, a, b), g)
    wf = hanzo_torch.formats.dequantize(w, "Q4_K", (12, 256), torch.float32)
    X, A, B, G = (t.detach().double() for t in (x, a, b, g))
    W = wf.double()
    torch.testing.assert_close(gx.double(), G @ W + s * G @ B @ A, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ga.double(), s * B.t() @ G.t() @ X, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb.double(), s * G.t() @ X @ A.t(), rtol=1e-5, atol=1e-5)


def test_lora_mul_mat_rejects_bad_adapters():
    x, w, a, b = _lora_inputs("Q8_0")
    with pytest.raises(ValueError, match=r"lora_a must be \[r, K\]"):
        ops.lora_mul_mat(x, w, "Q8_0", a[:, :128], b, 1.0)
    with pytest.raises(ValueError, match=r"lora_b must be \[N, r\] = \[12, 4\]"):
        ops.lora_mul_mat(x, w, "Q8_0", a, b[:, :3], 1.0)
    with pytest.raises(ValueError, match="lora_a must be float32"):
        ops.lora_mul_mat(x, w, "Q8_0", a.long(), b, 1.0)
    with pytest.raises(ValueError, match="lora_b must be 2-D"):
        ops.lora_mul_mat(x, w, "Q8_0", a, b[None], 1.0)
    with pytest.raises(ValueError, match="bytes per Q8_0 row"):
        ops.lora_mul_mat(x[:, :128], w, "Q8_0", a[:, :128], b, 1.0)
    assert lora_mul_mat_reference.__doc__ and "PEFT" in lora_mul_mat_reference.__doc__


def test_lora_mul_mat_opcheck():
    x, w, a, b = _lora_inputs("Q8_0", N=6, K=64, r=2, M=2)
    torch.library.opcheck(ops.lora_mul_mat, (x, w, "Q8_0", a, b, 0.5))
    torch.library.opcheck(ops.lora_mul_mat, (x.requires_grad_(True), w, "Q8_0", a.requires_grad_(True),
                                             b.requires_grad_(True), 0.5))
