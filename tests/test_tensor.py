"""GGUFTensor: construction, routing to the hanzo ops, refusals, moves, and state-dict round trips."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hanzo_torch import GGUFTensor, get_format
from hanzo_torch.serialization import METADATA_KEY, load_packed, save_packed

from test_ops_quant import gguf_dequant, random_packed, references_only  # noqa: F401 (autouse fixture)

QT = "Q4_K"  # a format with 256-value blocks and per-block offsets
N, K, V = 12, 256, 20


def make(qtype=QT, shape=(N, K), seed=0, dtype=torch.float32):
    return GGUFTensor(random_packed(qtype, shape, seed=seed), qtype, shape, dtype)


class OpLog(TorchDispatchMode):
    """Records every op that reaches dispatch (to prove which kernels a call ran)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket).split(".")[-1] if "hanzo" not in str(func) else str(func))
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------- construction
def test_construct_and_attributes():
    w = make()
    assert isinstance(w, torch.Tensor) and isinstance(w, GGUFTensor)
    assert w.shape == (N, K) and w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2
    assert w.packed.dtype == torch.uint8 and w.packed.shape == (N, get_format(QT).row_bytes(K))
    assert w.qtype == "Q4_K" and w.format is get_format("Q4_K") and not w.requires_grad
    assert GGUFTensor(w.packed, 12, (N, K)).qtype == "Q4_K"  # ggml id is accepted, name stored
    assert GGUFTensor(w.packed, "q4_k", (N, K), torch.bfloat16).dtype == torch.bfloat16


def test_repr_shows_format_and_shape_not_data():
    w = make()
    r = repr(w)
    assert "Q4_K" in r and "(12, 256)" in r and "float32" in r
    assert str(float(w.dequantize()[0, 0])) not in r and len(r) < 200
    assert str(w) == r and "Q4_K" in repr(nn.Parameter(w, requires_grad=False))


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.zeros(12, 144, dtype=torch.uint8), "Q4_K", (12, 512)), r"needs packed uint8 of shape \(12, 288\)"),
        ((torch.zeros(12, 144, dtype=torch.int8), "Q4_K", (12, 256)), "uint8"),
        ((torch.zeros(12, 144, dtype=torch.uint8), "Q4_K", (12, 200)), "not a multiple of the block size"),
        ((torch.zeros(12, 144, dtype=torch.uint8), "Q4_Z", (12, 256)), "unknown"),
        ((torch.zeros(12, 144, dtype=torch.uint8), "Q4_K", (12, 256), torch.int32), "float dtype"),
        ((torch.zeros(12, 144, dtype=torch.uint8), "Q4_K", ()), "at least one dim"),
    ],
)
def test_construct_errors(args, match):
    with pytest.raises(ValueError, match=match):
        GGUFTensor(*args)


@pytest.mark.parametrize("qtype", ["Q8_0", "IQ4_XS", "F16", "BF16"])
def test_dequantize_matches_gguf(qtype):
    w = make(qtype, (4, 256), seed=1)
    ref = gguf_dequant(w.packed, qtype).float()
    assert torch.equal(w.dequantize(), ref) and w.dequantize().dtype == torch.float32
    assert torch.equal(w.dequantize(torch.float16), ref.half())
    assert torch.equal(w.to(torch.bfloat16).dequantize(), ref.bfloat16())
    assert torch.equal(w.T.dequantize(), ref.T)


# ---------------------------------------------------------------------- routing
def test_linear_matmul_route_to_mul_mat():
    w = make()
    W = w.dequantize()
    b = torch.randn(N)
    x = torch.randn(2, 3, K)
    want = torch.ops.hanzo.mul_mat(x, w.packed, QT)
    for name, fn in [
        ("F.linear", lambda: F.linear(x, w)),
        ("x @ w.T", lambda: x @ w.T),
        ("matmul", lambda: torch.matmul(x, w.T)),
        ("matmul t()", lambda: torch.matmul(x, w.t())),
        ("transpose", lambda: x @ w.transpose(0, 1)),
        ("mm", lambda: torch.mm(x[0], w.T)),
    ]:
        with OpLog() as log:
            y = fn()
        assert "hanzo.mul_mat.default" in log.ops and "hanzo.dequantize.default" not in log.ops, (name, log.ops)
        # M=3 (mm) runs the mat-vec kernel, M=6 the GEMM: same value up to float32 summation order
        torch.testing.assert_close(y, want if y.dim() == 3 else want[0], msg=name, rtol=1e-5,
                                   atol=1e-6 * want.abs().max().item())
    torch.testing.assert_close(F.linear(x, w, b), want + b)
    torch.testing.assert_close(F.linear(x, w), x @ W.T, rtol=1e-5, atol=1e-4)
    assert (x @ w.T).dtype == torch.float32 and w.T.shape == (K, N) and w.T.T.shape == (N, K)
    assert torch.ops.aten.addmm(b, x[0], w.T).shape == (3, N)
    torch.testing.assert_close(torch.ops.aten.addmm(b, x[0], w.T), want[0] + b, rtol=1e-5,
                               atol=1e-6 * want.abs().max().item())


def test_nn_linear_and_embedding_modules():
    lin = nn.Linear(K, N)
    emb = nn.Embedding(V, K)
    with torch.no_grad():
        lin.weight = nn.Parameter(make(), requires_grad=False)
        emb.weight = nn.Parameter(make(shape=(V, K), seed=2), requires_grad=False)
    assert isinstance(lin.weight, nn.Parameter) and isinstance(lin.weight, GGUFTensor)
    ids = torch.tensor([[0, 19, 5], [5, 5, 1]])
    with OpLog() as log:
        h = emb(ids)
    assert log.ops == ["hanzo.get_rows.default"], log.ops
    assert torch.equal(h, gguf_dequant(emb.weight.packed, QT).float()[ids])
    y = lin(h)
    torch.testing.assert_close(y, torch.ops.hanzo.mul_mat(h, lin.weight.packed, QT) + lin.bias)
    assert torch.equal(F.embedding(ids, emb.weight.to(torch.bfloat16)), h.bfloat16())


def test_half_activations_keep_their_dtype():
    w = make()
    x = torch.randn(3, K, dtype=torch.bfloat16)
    y = F.linear(x, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, torch.ops.hanzo.mul_mat(x, w.packed, QT))


@pytest.mark.parametrize(
    "fn, what",
    [
        (lambda w, x: w + 1, "add"),
        (lambda w, x: w.sum(), "sum"),
        (lambda w, x: torch.relu(w), "relu"),
        (lambda w, x: w[0], "select"),
        (lambda w, x: w.view(-1), "view"),
        (lambda w, x: w * w, "mul"),
        (lambda w, x: x @ w, "matmul"),  # untransposed: shapes would not even match a dense W
        (lambda w, x: w.T + 1, "add"),
        (lambda w, x: w.to(torch.int32), "float dtype"),
        (lambda w, x: F.linear(x, w.T), "transposed view"),
        (lambda w, x: F.linear(w, w), "dequantize"),
    ],
)
def test_other_ops_refuse_and_point_to_dequantize(fn, what):
    w = make()
    x = torch.randn(2, N)
    with pytest.raises(NotImplementedError, match=what) as info:
        fn(w, x)
    assert "dequantize" in str(info.value) or "transposed" in str(info.value)


def test_expert_weight_3d():
    E = 3
    w = make("Q8_0", (E, N, 64), seed=3)
    assert w.shape == (E, N, 64) and w.packed.shape == (E, N, 68)
    with pytest.raises(NotImplementedError, match="mul_mat_id"):
        F.linear(torch.randn(2, 64), w)
    with pytest.raises(NotImplementedError, match="2-D"):
        w.transpose(0, 1)
    ids = torch.tensor([[0, 2], [1, 1]])
    x = torch.randn(2, 64)
    y = torch.ops.hanzo.mul_mat_id(x, w.packed, ids, w.qtype)
    W = w.dequantize()
    torch.testing.assert_close(y, torch.einsum("tk,tjnk->tjn", x, W[ids]), rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------- moves and copies
def test_to_dtype_changes_compute_dtype_only():
    w = make()
    h = w.to(torch.float16)
    assert isinstance(h, GGUFTensor) and h.dtype == torch.float16 and h.qtype == QT and h.shape == w.shape
    assert torch.equal(h.packed, w.packed)
    assert w.bfloat16().dtype == torch.bfloat16 and w.half().float().dtype == torch.float32
    assert w.to(torch.float32) is w  # no-op move


def test_device_moves_detach_clone_contiguous():
    w = make()
    for moved in (w.to("cpu", copy=True), w.cpu(), w.to(device="cpu", dtype=torch.bfloat16), w.detach(), w.clone()):
        assert isinstance(moved, GGUFTensor) and moved.qtype == QT and moved.shape == w.shape
        assert torch.equal(moved.packed, w.packed)
    assert w.clone().packed.data_ptr() != w.packed.data_ptr()
    assert w.detach().packed.data_ptr() == w.packed.data_ptr()
    assert w.contiguous() is w and w.cpu() is w
    m = w.to("meta")
    assert isinstance(m, GGUFTensor) and m.device.type == "meta" and m.packed.device.type == "meta"


def test_meta_device():
    w = GGUFTensor(torch.empty(N, 144, dtype=torch.uint8, device="meta"), QT, (N, K))
    assert w.device.type == "meta"
    y = F.linear(torch.empty(2, K, device="meta"), w)
    assert y.shape == (2, N) and y.device.type == "meta"


def test_copy_and_deepcopy():
    w, src = make(seed=0), make(seed=1)
    w.copy_(src)
    assert torch.equal(w.packed, src.packed) and w.packed.data_ptr() != src.packed.data_ptr()
    with pytest.raises(ValueError, match="cannot take"):
        w.copy_(make("Q8_0", (N, K)))
    with pytest.raises(NotImplementedError, match="dense"):
        w.copy_(torch.zeros(N, K))
    d = copy.deepcopy(w)
    assert isinstance(d, GGUFTensor) and torch.equal(d.packed, w.packed) and d.packed.data_ptr() != w.packed.data_ptr()


# ---------------------------------------------------------------------- modules and files
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, K)
        self.proj = nn.Linear(K, N)
        self.norm = nn.Parameter(torch.ones(N))

    def forward(self, ids):
        return self.proj(self.emb(ids)) * self.norm


def packed_tiny(dtype=torch.float32) -> Tiny:
    m = Tiny()
    m.emb.weight = nn.Parameter(make(shape=(V, K), seed=4, dtype=dtype), requires_grad=False)
    m.proj.weight = nn.Parameter(make("Q6_K", (N, K), seed=5, dtype=dtype), requires_grad=False)
    return m.requires_grad_(False)


def assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert type(a[k]) is type(b[k]), k
        if isinstance(a[k], GGUFTensor):
            assert (a[k].qtype, a[k].shape, a[k].dtype) == (b[k].qtype, b[k].shape, b[k].dtype), k
            assert torch.equal(a[k].packed, b[k].packed), k
        else:
            assert torch.equal(a[k], b[k]), k


def test_state_dict_load_assign_on_meta():
    m = packed_tiny()
    sd = m.state_dict()
    assert isinstance(sd["proj.weight"], GGUFTensor) and sd["proj.weight"].qtype == "Q6_K"
    with torch.device("meta"):
        fresh = Tiny()
    fresh.load_state_dict(sd, assign=True)
    assert isinstance(fresh.proj.weight, GGUFTensor) and isinstance(fresh.proj.weight, nn.Parameter)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(fresh(ids), m(ids))
    # load without assign copies bytes into GGUFTensor parameters of the same format
    other = packed_tiny()
    other.emb.weight.packed.zero_()
    other.load_state_dict(sd)
    assert_same_state(other.state_dict(), sd)


def test_load_state_dict_into_dense_module_needs_assign():
    with pytest.raises(RuntimeError, match="assign=True"):  # load_state_dict wraps our NotImplementedError
        Tiny().load_state_dict(packed_tiny().state_dict())


def test_module_to_dtype():
    m = packed_tiny().to(torch.bfloat16)
    assert m.proj.weight.dtype == torch.bfloat16 and isinstance(m.proj.weight, GGUFTensor)
    assert m.norm.dtype == torch.bfloat16 and m(torch.tensor([[0, 1]])).dtype == torch.bfloat16
    assert isinstance(m.cpu().emb.weight, GGUFTensor)


def test_torch_save_load_weights_only():
    m = packed_tiny(torch.bfloat16)
    sd = m.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert_same_state(back, sd)
    assert back["emb.weight"].dtype == torch.bfloat16


def test_safetensors_round_trip(tmp_path):
    m = packed_tiny(torch.float16)
    sd = dict(m.state_dict())
    sd["tied"] = sd["emb.weight"]  # shared storage is written as a second copy
    sd["wT"] = sd["proj.weight"].T
    path = tmp_path / "w.safetensors"
    save_packed(sd, path, metadata={"note": "hi"})
    back = load_packed(path)
    assert_same_state(back, sd)
    assert back["wT"].shape == (K, N) and back["wT"].transposed
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert meta["note"] == "hi" and "proj.weight" in meta[METADATA_KEY]
        raw = f.get_tensor("proj.weight")
    assert raw.dtype == torch.uint8 and torch.equal(raw, sd["proj.weight"].packed)  # plain U8 for other readers
    with torch.device("meta"):
        fresh = Tiny()
    del back["tied"], back["wT"]
    fresh.load_state_dict(back, assign=True)
    assert torch.equal(fresh(torch.tensor([[3]])), m(torch.tensor([[3]])))


def test_save_packed_errors(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        save_packed({"a": torch.zeros(1)}, tmp_path / "a.safetensors", metadata={METADATA_KEY: "x"})
    with pytest.raises(TypeError, match="not a tensor"):
        save_packed({"a": 3}, tmp_path / "a.safetensors")


def test_load_packed_strict_metadata_types(tmp_path):
    """The header JSON is type-checked: a string where a bool belongs, a list where an object
    belongs, a bad shape or broken JSON are ValueErrors naming the file, never a truthiness
    conversion or an AttributeError."""
    import json

    from safetensors.torch import save_file

    m = packed_tiny(torch.float32)
    w = m.state_dict()["proj.weight"]
    good = {"qtype": w.qtype, "shape": list(w.logical_shape), "dtype": "float32", "transposed": False}
    path = tmp_path / "x.safetensors"

    def write(meta_text):
        save_file({"proj.weight": w.packed.contiguous()}, str(path), metadata={METADATA_KEY: meta_text})

    write(json.dumps({"proj.weight": good}))
    assert not load_packed(path)["proj.weight"].transposed
    cases = {
        json.dumps({"proj.weight": dict(good, transposed="no")}): "'transposed' must be true or false",
        json.dumps([good]): "must be a JSON object, got list",
        json.dumps({"proj.weight": [1, 2]}): "must be a JSON object, got list",
        json.dumps({"proj.weight": dict(good, shape=[N, True])}): "'shape' must be",
        json.dumps({"proj.weight": dict(good, shape="64")}): "'shape' must be",
        json.dumps({"proj.weight": dict(good, qtype=5)}): "'qtype' must be a string",
        json.dumps({"proj.weight": dict(good, extra=1)}): "unknown fields",
        "{not json": "not valid JSON",
    }
    for text, msg in cases.items():
        write(text)
        with pytest.raises(ValueError, match=msg) as e:
            load_packed(path)
        assert str(path) in str(e.value)
