"""The quantized ``hanzo`` ops: schemas (opcheck), the references' numerics against the gguf oracle, dispatch.

(Every backend's kernels against these references, and every backend's bad-argument errors
against the reference's: tests/test_conformance.py.)

Oracle: ``gguf.quants.dequantize`` (numpy) of the same packed bytes, and float64 products of those
weights. Packed test weights are random bytes (every quant code and sub-block scale occurs) whose
blocks are redrawn until they dequantize (per gguf) to finite values in a given magnitude range, so
the test data needs no knowledge of any format's layout and every registered format is covered.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

import hanzo_torch
from hanzo_torch import FORMATS, QUANTIZED_FORMATS, get_format
from hanzo_torch.backends.triton._testing import GGML_RULES
from hanzo_torch.ops import quant as Q

ALL_FORMATS = tuple(FORMATS)
# a few formats of different families for the (slower) opcheck runs
OPCHECK_FORMATS = tuple(q for q in ("Q8_0", "Q4_K", "IQ2_XXS") if q in FORMATS) or ALL_FORMATS[:1]
U32 = 2.0 ** -24  # unit roundoff of float32


@pytest.fixture(autouse=True)
def references_only(monkeypatch):
    """These tests are the oracle of the references: HANZO_<OP>_FALLBACK=1 for every quantized op, so a
    fast backend registered on this machine does not change what is tested (backends have their own
    gates against these references)."""
    with hanzo_torch.ops.use_reference(*Q.OPS):
        yield


# ---------------------------------------------------------------------- test data
def gguf_dequant(packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """The oracle: ``gguf.quants.dequantize`` of ``uint8 [..., row_bytes]`` -> float64 ``[..., K]``
    (ggml's rule in numpy for a format gguf cannot dequantize, ``GGML_RULES``)."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        arr = np.ascontiguousarray(packed.cpu().numpy())
        if qtype in GGML_RULES and not hasattr(gguf_quants, qtype):
            out = GGML_RULES[qtype](arr)
        else:
            out = gguf_quants.dequantize(arr, GGMLQuantizationType[qtype])
        return torch.from_numpy(np.array(out, dtype=np.float64))


def random_packed(qtype: str, shape, seed: int = 0, lo: float = 1.0, hi: float = 10.0) -> torch.Tensor:
    """``uint8 (*shape[:-1], row_bytes)``: random blocks of ``qtype`` that gguf decodes to finite
    values whose largest magnitude per block lies in ``[lo, hi]`` (blocks that do not are redrawn).

    The default range keeps the blocks of a row of similar weight, as in real models, so that an
    error in any one block is visible in a product.
    """
    fmt = get_format(qtype)
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) // fmt.block_size
    blocks = torch.randint(0, 256, (n, fmt.type_size), generator=g, dtype=torch.uint8)
    todo = torch.arange(n)
    for _ in range(4000):  # MXFP4 (e8m0 scales) accepts ~1 draw in 80
        v = gguf_dequant(blocks[todo], qtype).reshape(-1, fmt.block_size)
        amax = v.abs().amax(1)
        bad = ~(torch.isfinite(v).all(1) & (amax >= lo) & (amax <= hi))
        todo = todo[bad]
        if todo.numel() == 0:
            break
        blocks[todo] = torch.randint(0, 256, (todo.numel(), fmt.type_size), generator=g, dtype=torch.uint8)
    else:
        raise AssertionError(f"could not draw valid {qtype} blocks")
    return blocks.reshape(*shape[:-1], fmt.row_bytes(shape[-1]))


def block_multiple(qtype: str, k: int = 256) -> int:
    """Smallest multiple of the block size >= k."""
    bs = get_format(qtype).block_size
    return -(-k // bs) * bs


def rel_err(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    """max |y - ref| / scale, with scale = |x| @ |W|^T (the natural bound of a dot product's rounding)."""
    return ((y.double() - ref) .abs() / scale.clamp_min(1e-300)).max().item()


# ---------------------------------------------------------------------- dequantize
@pytest.mark.parametrize("qtype", ALL_FORMATS)
def test_dequantize_numeric(qtype):
    K = block_multiple(qtype)
    w = random_packed(qtype, (3, K), seed=1, lo=0.0, hi=1e3)
    out = torch.ops.hanzo.dequantize(w, qtype, [3, K], torch.float32)
    ref = gguf_dequant(w, qtype).to(torch.float32)
    assert out.shape == (3, K) and out.dtype == torch.float32
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), "not bit-identical to gguf.quants.dequantize"
    assert torch.equal(torch.ops.hanzo.dequantize(w, qtype, [3, K], torch.bfloat16), ref.to(torch.bfloat16))
    # a result never aliases the packed input (dense formats could be a mere view)
    assert out.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()


# ---------------------------------------------------------------------- quantize_q8_1
def test_quantize_q8_1_numeric():
    """Against an independent float64 model of ggml's quantize_row_q8_1_ref: d = amax/127,
    qs = round-half-away(x/d), s = d*sum(qs); and the round trip |x - d*qs| <= d/2 with the unrounded d."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4, 128, generator=g) * torch.logspace(-3, 3, 4)[:, None]
    x[0, 0, :32] = 0.0  # an all-zero block: d = 0, qs = 0
    out = torch.ops.hanzo.quantize_q8_1(x)
    assert out.shape == (5, 4, 128 // 32 * 36) and out.dtype == torch.uint8
    b = out.reshape(-1, 36)
    d = b[:, 0:2].contiguous().view(torch.float16).double().reshape(-1)
    s = b[:, 2:4].contiguous().view(torch.float16).double().reshape(-1)
    qs = b[:, 4:].contiguous().view(torch.int8).double()
    xb = x.reshape(-1, 32).double()
    d_ref = xb.abs().amax(1) / 127
    assert torch.equal(d, d_ref.to(torch.float16).double())
    scaled = torch.where(d_ref[:, None] > 0, xb / d_ref[:, None].clamp_min(1e-300), torch.zeros_like(xb))
    q_ref = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    # float32 x*(1/d) may round an exact .5 tie differently from float64 x/d: allow 1 code there only
    diff = (qs - q_ref).abs()
    assert diff.max() <= 1 and (diff > 0).sum() <= max(1, xb.numel() // 10_000)
    torch.testing.assert_close(s, (qs.sum(1) * d_ref).to(torch.float16).double(), rtol=2e-3, atol=1e-30)
    assert ((d_ref[:, None] * qs - xb).abs() <= d_ref[:, None] * (0.5 + 1e-6)).all()
    assert torch.equal(b[0, 4:], torch.zeros(32, dtype=torch.uint8)) and d[0] == 0


def test_quantize_q8_1_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        torch.ops.hanzo.quantize_q8_1(torch.randn(2, 48))
    with pytest.raises(ValueError, match="float"):
        torch.ops.hanzo.quantize_q8_1(torch.ones(2, 32, dtype=torch.int32))


# ---------------------------------------------------------------------- mul_mat
@pytest.mark.parametrize("qtype", QUANTIZED_FORMATS)
def test_mul_mat_numeric(qtype):
    """float32 x: ``max |y - y64| / (|x| @ |W|^T) <= K * 2^-24`` (the first-order rounding bound of
    a float32 dot product of length K with exact float32 operands; the dequantized weights are exact
    float32), y64 the float64 product with gguf-dequantized weights."""
    N, K = 16, block_multiple(qtype, 256)
    w = random_packed(qtype, (N, K), seed=2)
    W = gguf_dequant(w, qtype)
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(4))
    y = torch.ops.hanzo.mul_mat(x, w, qtype)
    assert y.shape == (2, 3, N) and y.dtype == torch.float32
    ref, scale = x.double() @ W.T, x.double().abs() @ W.abs().T
    err, tol = rel_err(y, ref, scale), K * U32
    print(f"mul_mat {qtype}: max rel err {err:.3g} (bound {tol:.3g})")
    assert err <= tol, f"{qtype}: {err} > {tol}"


def test_mul_mat_numeric_detects_bugs():
    """The bound of test_mul_mat_numeric is >= 100x below what real bugs give."""
    qtype = "Q4_K" if "Q4_K" in FORMATS else QUANTIZED_FORMATS[0]
    K = block_multiple(qtype, 512)
    N = 32
    w = random_packed(qtype, (N, K), seed=5)
    W = gguf_dequant(w, qtype)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(6)).double()
    ref, scale, tol = x @ W.T, x.abs() @ W.abs().T, K * U32
    bs = get_format(qtype).block_size
    wrong_scale = W.clone()
    wrong_scale[:, bs:2 * bs] *= 1.5  # one block of every row with a wrong scale
    assert rel_err(x @ wrong_scale.T, ref, scale) >= 100 * tol
    one_row = W.clone()
    one_row[3, :bs] *= 1.5  # a single wrong block scale in the whole matrix
    assert rel_err(x @ one_row.T, ref, scale) >= 100 * tol
    transposed = W.reshape(K, N).T  # bytes right, index order wrong
    assert rel_err(x @ transposed.T, ref, scale) >= 100 * tol
    # and the op itself is within it
    assert rel_err(torch.ops.hanzo.mul_mat(x.float(), w, qtype), ref, scale) <= tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mul_mat_half_inputs(dtype):
    """bf16/f16 x: output in x.dtype, within one rounding of the output (2^-8 / 2^-11 relative) plus
    the float32 accumulation bound."""
    qtype = "Q4_K" if "Q4_K" in FORMATS else QUANTIZED_FORMATS[0]
    K = block_multiple(qtype, 256)
    w = random_packed(qtype, (16, K), seed=7)
    W = gguf_dequant(w, qtype)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(8)).to(dtype)
    y = torch.ops.hanzo.mul_mat(x, w, qtype)
    assert y.dtype == dtype and y.shape == (3, 16)
    ref = x.double() @ W.T
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    bound = u * ref.abs() + K * U32 * (x.double().abs() @ W.abs().T)
    assert ((y.double() - ref).abs() <= bound).all()


def test_mul_mat_chunked(monkeypatch):
    """Dequantizing W in several chunks gives the same result as in one."""
    qtype = "Q8_0"
    w = random_packed(qtype, (37, 64), seed=9)
    x = torch.randn(5, 64)
    whole = torch.ops.hanzo.mul_mat(x, w, qtype)
    monkeypatch.setattr(Q, "CHUNK_BYTES", 64 * 4 * 5)  # 5 rows per chunk
    assert Q._rows_per_chunk(64) == 5
    chunked = torch.ops.hanzo.mul_mat(x, w, qtype)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-4)


def test_mul_mat_grad_x():
    qtype = "Q8_0"
    w = random_packed(qtype, (6, 64), seed=10)
    W = gguf_dequant(w, qtype).float()
    x = torch.randn(3, 64, requires_grad=True)
    g = torch.randn(3, 6)
    torch.ops.hanzo.mul_mat(x, w, qtype).backward(g)
    torch.testing.assert_close(x.grad, g @ W, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- mul_mat_id
@pytest.mark.parametrize("group_on_host", [True, False], ids=["grouped", "gathered"])
@pytest.mark.parametrize("qtype", [q for q in ("Q4_K", "Q8_0", "IQ3_S", "Q6_K", "F16") if q in FORMATS])
@pytest.mark.parametrize("x_rank", [2, 3])
def test_mul_mat_id_numeric(qtype, x_rank, group_on_host):
    """Each [t, j] row against the float64 product with expert ids[t, j]; same bound as mul_mat."""
    E, N, K, T, k = 5, 8, block_multiple(qtype, 256), 6, 3
    w = random_packed(qtype, (E, N, K), seed=11)
    W = gguf_dequant(w, qtype)  # [E, N, K]
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, E, (T, k), generator=g)
    ids[0] = torch.tensor([4, 4, 0])  # repeated expert in one token
    x = torch.randn(T, K, generator=g) if x_rank == 2 else torch.randn(T, k, K, generator=g)
    y = Q.mul_mat_id_reference(x, w, ids, qtype, group_on_host=group_on_host)
    assert y.shape == (T, k, N) and y.dtype == torch.float32
    xs = (x[:, None].expand(T, k, K) if x_rank == 2 else x).double()
    Wsel = W[ids]  # [T, k, N, K]
    ref = torch.einsum("tjk,tjnk->tjn", xs, Wsel)
    scale = torch.einsum("tjk,tjnk->tjn", xs.abs(), Wsel.abs())
    assert rel_err(y, ref, scale) <= K * U32
    if group_on_host:
        torch.testing.assert_close(torch.ops.hanzo.mul_mat_id(x, w, ids.to(torch.int32), qtype), y)


def test_mul_mat_id_gathered_chunks(monkeypatch):
    """The device (gather) path with selection chunks and row chunks smaller than the problem."""
    qtype = "Q8_0"
    E, N, K, T, k = 4, 10, 64, 5, 2
    w = random_packed(qtype, (E, N, K), seed=13)
    ids = torch.randint(0, E, (T, k))
    x = torch.randn(T, k, K)
    want = Q.mul_mat_id_reference(x, w, ids, qtype, group_on_host=True)
    monkeypatch.setattr(Q, "CHUNK_BYTES", N * K * 4 * 3)  # 3 selections per chunk
    torch.testing.assert_close(Q.mul_mat_id_reference(x, w, ids, qtype, group_on_host=False), want)
    monkeypatch.setattr(Q, "CHUNK_BYTES", K * 4 * 3)  # one selection, 3 rows per chunk
    torch.testing.assert_close(Q.mul_mat_id_reference(x, w, ids, qtype, group_on_host=False), want)


def test_mul_mat_id_gathered_path_checks_ids():
    # the gather path of the reference (no host grouping) checks the ids itself; the op's errors,
    # on every backend: tests/test_conformance.py
    w = random_packed("Q8_0", (4, 8, 64))
    with pytest.raises(IndexError, match="expert id -1"):
        Q.mul_mat_id_reference(torch.randn(3, 64), w, torch.tensor([[0, -1]] * 3), "Q8_0", group_on_host=False)


def test_mul_mat_id_grad_x():
    qtype = "Q8_0"
    E, N, K, T, k = 3, 5, 64, 4, 2
    w = random_packed(qtype, (E, N, K), seed=14)
    W = gguf_dequant(w, qtype).float()
    ids = torch.tensor([[0, 2], [1, 1], [2, 0], [0, 0]])
    for x in (torch.randn(T, K, requires_grad=True), torch.randn(T, k, K, requires_grad=True)):
        g = torch.randn(T, k, N)
        torch.ops.hanzo.mul_mat_id(x, w, ids, qtype).backward(g)
        want = torch.einsum("tjn,tjnk->tjk", g, W[ids])
        torch.testing.assert_close(x.grad, want if x.dim() == 3 else want.sum(1), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- get_rows
@pytest.mark.parametrize("qtype", ALL_FORMATS)
def test_get_rows_numeric(qtype):
    V, H = 11, block_multiple(qtype, 256)
    w = random_packed(qtype, (V, H), seed=15, lo=0.0, hi=1e3)
    ids = torch.tensor([[3, 0, 10], [3, 7, 1]], dtype=torch.int32)
    out = torch.ops.hanzo.get_rows(w, ids, qtype, torch.float32)
    ref = gguf_dequant(w, qtype).to(torch.float32)[ids.long()]
    assert out.shape == (2, 3, H)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))
    assert torch.equal(torch.ops.hanzo.get_rows(w, ids, qtype, torch.bfloat16), ref.to(torch.bfloat16))


def test_get_rows_dequantizes_only_selected_rows(monkeypatch):
    fmt = get_format("Q8_0")
    seen = []
    real = fmt.dequantize_blocks

    class Spy:
        def __getattr__(self, name):
            return getattr(fmt, name)

        def dequantize_blocks(self, blocks):
            seen.append(blocks.shape[0])
            return real(blocks)

    monkeypatch.setattr(Q, "get_format", lambda q: Spy())
    w = hanzo_torch.quantize(torch.randn(1000, 64), "Q8_0")
    Q.get_rows_reference(w, torch.tensor([5, 999]), "Q8_0", torch.float32)
    assert seen == [2 * 64 // 32]


# ---------------------------------------------------------------------- opcheck
def _opcheck(op, args):
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("qtype", OPCHECK_FORMATS)
def test_opcheck_dequantize(qtype):
    K = block_multiple(qtype, 256)
    _opcheck(torch.ops.hanzo.dequantize.default, (random_packed(qtype, (2, K)), qtype, [2, K], torch.float32))


def test_opcheck_quantize_q8_1():
    _opcheck(torch.ops.hanzo.quantize_q8_1.default, (torch.randn(3, 64),))
    _opcheck(torch.ops.hanzo.quantize_q8_1.default, (torch.randn(2, 2, 32, dtype=torch.bfloat16),))


@pytest.mark.parametrize("qtype", OPCHECK_FORMATS)
def test_opcheck_mul_mat(qtype):
    K = block_multiple(qtype, 256)
    w = random_packed(qtype, (4, K))
    _opcheck(torch.ops.hanzo.mul_mat.default, (torch.randn(2, 3, K, requires_grad=qtype == "Q8_0"), w, qtype))


@pytest.mark.parametrize("qtype", OPCHECK_FORMATS)
def test_opcheck_mul_mat_id(qtype):
    K = block_multiple(qtype, 256)
    w = random_packed(qtype, (3, 4, K))
    ids = torch.tensor([[0, 2], [1, 1]])
    x = torch.randn(2, K) if qtype == "Q8_0" else torch.randn(2, 2, K, requires_grad=qtype == "Q4_K")
    _opcheck(torch.ops.hanzo.mul_mat_id.default, (x, w, ids, qtype))


@pytest.mark.parametrize("qtype", OPCHECK_FORMATS)
def test_opcheck_get_rows(qtype):
    K = block_multiple(qtype, 256)
    w = random_packed(qtype, (5, K))
    _opcheck(torch.ops.hanzo.get_rows.default, (w, torch.tensor([[4, 0, 2]]), qtype, torch.float32))


def test_fake_kernels_check_shapes():
    """The fake kernels (used by torch.compile and meta tensors) reject what the references reject."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w = torch.empty(8, 68, dtype=torch.uint8)
        assert torch.ops.hanzo.mul_mat(torch.empty(2, 5, 64), w, "Q8_0").shape == (2, 5, 8)
        with pytest.raises(ValueError, match="rows of 68 bytes"):
            torch.ops.hanzo.mul_mat(torch.empty(2, 32), w, "Q8_0")
        w3 = torch.empty(4, 8, 68, dtype=torch.uint8)
        ids = torch.empty(3, 2, dtype=torch.int64)
        assert torch.ops.hanzo.mul_mat_id(torch.empty(3, 64), w3, ids, "Q8_0").shape == (3, 2, 8)
        with pytest.raises(ValueError, match="does not match"):
            torch.ops.hanzo.mul_mat_id(torch.empty(3, 1, 64), w3, ids, "Q8_0")
        assert torch.ops.hanzo.get_rows(w, ids, "Q8_0", torch.bfloat16).shape == (3, 2, 64)
        assert torch.ops.hanzo.dequantize(w, "Q8_0", [8, 64], torch.float16).dtype == torch.float16
        with pytest.raises(ValueError, match="needs 204 bytes"):
            torch.ops.hanzo.dequantize(w, "Q8_0", [3, 64], torch.float32)
        assert torch.ops.hanzo.quantize_q8_1(torch.empty(3, 64)).shape == (3, 72)
        with pytest.raises(ValueError, match="multiple of 32"):
            torch.ops.hanzo.quantize_q8_1(torch.empty(3, 40))


# ---------------------------------------------------------------------- backend dispatch
def test_reference_mode_switches_the_native_kernel():
    """``use_reference`` routes a call to ``torch.ops.hanzo_ref`` on every backend; outside it the
    native kernel of the device runs (the C++ one here: int8 activations, so not bit-identical)."""
    w = random_packed("Q8_0", (4, 64))
    x = torch.randn(2, 64)
    ref = Q.mul_mat_reference(x, w, "Q8_0")
    assert torch.equal(torch.ops.hanzo.mul_mat(x, w, "Q8_0"), ref)  # this module's fixture: reference mode
    assert torch.equal(torch.ops.hanzo_ref.mul_mat(x, w, "Q8_0"), ref)
    with hanzo_torch.ops.use_reference("mul_mat", enabled=False):
        native = torch.ops.hanzo.mul_mat(x, w, "Q8_0")
    if "mul_mat" in hanzo_torch.backends.activate("cpu"):
        assert not torch.equal(native, ref)
    torch.testing.assert_close(native, ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
    with pytest.raises(ValueError, match="unknown hanzo op"):
        hanzo_torch.ops.set_reference("mul_mat_typo")


# ---------------------------------------------------------------------- real weights
@pytest.mark.slow
def test_real_model_weights_numeric():
    """mul_mat and get_rows on real Qwen2.5-Coder-1.5B Q4_K_M weights (Q4_K, Q6_K), same bounds as the
    random-block tests. Reads the file with gguf.GGUFReader (the oracle's own reader)."""
    import os

    import gguf

    from conftest import real_model_path

    reader = gguf.GGUFReader(str(real_model_path()))
    tensors = {t.name: t for t in reader.tensors}
    x = torch.randn(3, 8960, generator=torch.Generator().manual_seed(20))
    for name in ("blk.0.attn_k.weight", "blk.0.ffn_down.weight", "blk.27.ffn_up.weight"):
        t = tensors[name]
        w = torch.from_numpy(np.array(t.data))
        qtype = t.tensor_type.name
        W = gguf_dequant(w, qtype)
        xs = x[:, : W.shape[1]].contiguous()
        y = torch.ops.hanzo.mul_mat(xs, w, qtype)
        err = rel_err(y, xs.double() @ W.T, xs.double().abs() @ W.abs().T)
        assert err <= W.shape[1] * U32, (name, err)
    t = tensors["token_embd.weight"]
    ids = torch.tensor([0, 151935, 9707, 17])
    rows = torch.ops.hanzo.get_rows(torch.from_numpy(np.array(t.data)), ids, t.tensor_type.name, torch.float32)
    want = gguf_dequant(torch.from_numpy(np.array(t.data[ids.numpy()])), t.tensor_type.name).float()
    assert torch.equal(rows, want)
