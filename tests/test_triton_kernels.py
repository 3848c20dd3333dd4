"""What is Triton-specific about the Triton kernels, run on CPU tensors under the Triton interpreter
(TRITON_INTERPRET=1).

Every op of hanzo_torch.backends.triton, every format, is gated against the references in
tests/test_conformance.py (backend ``triton-interp``). Here: the interpreter really runs, the
kernels' own argument checks, the alternative paths the environment selects (the per-value unpack
rules with quant.GROUPED = False, the float decode of the formats whose default decode is int8),
the int8 decode bit for bit against its integer reference, the grouped layout of mul_mat_id, the
split-K decode of attention and its combine launch, out-of-range ids giving NaN rows on the device,
and the registration table. Tolerances derive from the rounding error of the computation (a wrong
nibble, scale or sign exceeds them by orders of magnitude). The same gates at real shapes on a
GPU are in tests/test_triton_gpu.py (marked ``gpu``).

The interpreter is chosen when triton and the kernels are imported (every ``@triton.jit``,
triton's own ``tl.zeros``/``tl.sum`` included, is decorated for one mode), and in a pytest run
hanzo_torch (hence triton) is imported long before this module. So the cases below run in a
child pytest process started with TRITON_INTERPRET=1 (HANZO_TRITON_INTERPRET_CHILD=1 marks
it); in the parent process this module holds only the test that starts the child and checks
its result, and the GPU-compiled kernels of the parent are never touched.
Known interpreter limitations (not kernel behaviour): float32 -> bfloat16 casts truncate
instead of rounding to nearest even, and ``tl.dot`` on bfloat16 operands is wrong (the GEMM
wrappers feed float32 tiles under the interpreter), so bf16 outputs are checked to one ulp.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import pytest
import torch

pytest.importorskip("triton")

import hanzo_torch  # noqa: E402
from hanzo_torch.ops import fused as ref_fused  # noqa: E402
from hanzo_torch.ops import quant as ref_quant  # noqa: E402
from hanzo_torch.backends.triton._testing import (  # noqa: E402
    gguf_dequantize, matmul_bound, matvec_q8_1_reference, random_packed)

def _all_formats():
    from hanzo_torch.backends.triton.formats import SUPPORTED

    return tuple(SUPPORTED)


ALL_FORMATS = _all_formats()


_CHILD = os.environ.get("HANZO_TRITON_INTERPRET_CHILD") == "1"
CHILD_TIMEOUT_S = 600


def test_triton_kernels_under_interpreter():
    """Runs every case of this module in a child pytest under TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1", HANZO_TRITON_INTERPRET_CHILD="1")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
                           "-W", "ignore::RuntimeWarning"],
                          env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"interpreter cases failed (rc {proc.returncode}):\n{tail}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, tail
    print(f"interpreter cases: {proc.stdout.strip().splitlines()[-1]} ({time.monotonic() - t0:.1f} s)")


@pytest.mark.slow
def test_kernels_compile_for_cuda_and_rocm():
    """Ahead-of-time compile (no GPU needed) of every kernel for sm_90 and gfx942, two formats."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                          "triton_gpu_check.py")
    proc = subprocess.run([sys.executable, script, "--aot", "--formats", "Q4_K,IQ2_XXS"],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "AOT check: 0 failure(s)" in out, out[-4000:]


PARENT_TESTS = ("test_triton_kernels_under_interpreter", "test_kernels_compile_for_cuda_and_rocm")


@pytest.fixture(scope="module")
def tk():
    """Namespace with the kernel modules (formats, quant, fused), verified to be interpreted."""
    from triton.runtime.interpreter import InterpretedFunction

    import hanzo_torch.backends.triton as backend
    from hanzo_torch.backends.triton import ffn, formats, fused, quant

    assert isinstance(quant._dequantize_kernel, InterpretedFunction), "TRITON_INTERPRET=1 was not in effect"
    return types.SimpleNamespace(formats=formats, quant=quant, fused=fused, ffn=ffn, backend=backend)


@pytest.fixture(autouse=True)
def f32_decode(monkeypatch):
    """The float32 decode path unless a test asks for int8 (its tolerance is the float32 one)."""
    monkeypatch.setattr("hanzo_torch.backends.triton.quant.DECODE_OVERRIDE", "f32")


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.float().contiguous(), b.float().contiguous()
    same = a.view(torch.int32) == b.view(torch.int32)
    return bool((same | (a.isnan() & b.isnan())).all())


def _assert_close_bound(y, ref, bound, rel, what, ulp_dtype=None):
    """|y - ref| <= rel * bound (+ one ulp of ulp_dtype at |ref| when the output is rounded)."""
    err = (y.double() - ref.double()).abs().reshape(bound.shape)
    lim = rel * bound + 1e-30
    if ulp_dtype is not None:
        lim = lim + ref.double().abs().reshape(bound.shape) * torch.finfo(ulp_dtype).eps * 2
    worst = (err / lim).max().item()
    assert worst <= 1.0, f"{what}: error {err.max().item():.3e} exceeds tolerance (ratio {worst:.2f})"


# ------------------------------------------------------------------------------- interpreter

def test_interpreter_runs_kernels_on_cpu(tk):
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(tk.quant._dequantize_kernel, InterpretedFunction)
    assert isinstance(tk.fused._attention_kernel, InterpretedFunction)
    w = random_packed("Q4_0", (1, 32))
    out = tk.quant.dequantize(w, "Q4_0", (1, 32), torch.float32)
    assert out.device.type == "cpu" and _bits_equal(out, gguf_dequantize(w, "Q4_0"))


# ------------------------------------------------------------------------------- format layer

def test_dequantize_errors(tk):
    with pytest.raises(ValueError, match="needs"):
        tk.quant.dequantize(torch.zeros(10, dtype=torch.uint8), "Q4_0", (1, 32), torch.float32)
    with pytest.raises(ValueError, match="multiple of the block size"):
        tk.quant.dequantize(torch.zeros(18, dtype=torch.uint8), "Q4_0", (1, 16), torch.float32)
    with pytest.raises(ValueError, match="no unpack rule|unknown"):
        tk.quant.dequantize(torch.zeros(36, dtype=torch.uint8), "Q8_1", (1, 32), torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        tk.quant.dequantize(torch.zeros(18, dtype=torch.int8), "Q4_0", (1, 32), torch.float32)


def test_iq_tables_come_from_gguf(tk):
    from gguf import quants

    quants.IQ2_XXS.init_grid()
    tab = tk.formats.format_table("IQ2_XXS", torch.device("cpu"))
    assert torch.equal(tab, torch.from_numpy(quants.IQ2_XXS.grid.reshape(-1).astype("float32")))
    assert tk.formats.format_table("IQ4_NL", torch.device("cpu")).tolist() == list(map(float, quants.IQ4_NL.kvalues))


# ------------------------------------------------------------------------------- get_rows

def test_get_rows_out_of_range_id_gives_nan_row(tk):
    w = random_packed("Q8_0", (4, 32), seed=4)
    out = tk.quant.get_rows(w, torch.tensor([1, 4, -1]), "Q8_0", torch.float32)
    assert out[1].isnan().all() and out[2].isnan().all()
    assert _bits_equal(out[0], gguf_dequantize(w, "Q8_0")[1])


# ------------------------------------------------------------------------------- mul_mat

def _check_mul_mat(tk, qtype, M, dtype, N=12, seed=5):
    qk = tk.formats.format_info(qtype)[1]
    K = max(qk, 64)
    w = random_packed(qtype, (N, K), seed=seed)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(dtype)
    y = tk.quant.mul_mat(x, w, qtype)
    ref = ref_quant.mul_mat_reference(x, w, qtype)
    assert y.shape == (M, N) and y.dtype == dtype
    bound = matmul_bound(x, gguf_dequantize(w, qtype))
    # float32 accumulation over K terms: a few K * 2^-24 of sum |x||w|
    _assert_close_bound(y, ref, bound, 1e-5, f"mul_mat {qtype} M={M} {dtype}",
                        ulp_dtype=None if dtype == torch.float32 else dtype)


@pytest.mark.parametrize("qtype", ("Q4_K", "Q6_K", "Q5_0", "Q3_K", "IQ4_XS", "TQ1_0", "IQ2_XXS", "IQ1_M"))
def test_mul_mat_decode_element_rules(tk, qtype, monkeypatch):
    # the same decode through the per-value rules (the path of formats without a grouped rule)
    assert tk.quant._group_len(qtype) > 0
    monkeypatch.setattr("hanzo_torch.backends.triton.quant.GROUPED", False)
    assert tk.quant._group_len(qtype) == 0
    _check_mul_mat(tk, qtype, 1, torch.float32)


@pytest.mark.parametrize("qtype", ("Q4_K", "Q6_K", "IQ2_XS", "MXFP4"))
def test_mul_mat_prefill_element_rules(tk, qtype, monkeypatch):
    # the GEMM with the per-value unpack of the weight tile (quant.GROUPED = False)
    monkeypatch.setattr("hanzo_torch.backends.triton.quant.GROUPED", False)
    _check_mul_mat(tk, qtype, tk.quant.MATVEC_MAX_M + 9, torch.float32, N=20)


@pytest.mark.parametrize("qtype", ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS"))
def test_float_decode_of_the_int8_decode_formats(tk, qtype):
    # DECODE_PATH sends these to the int8 decode (gated against the reference in
    # tests/test_conformance.py); DECODE_OVERRIDE = "f32" (this module's default) runs the grouped
    # float mat-vec, for M = 1 and the mul_mat_id decode
    assert tk.quant.DECODE_PATH[qtype] == "int8"
    _check_mul_mat(tk, qtype, 1, torch.float32)
    E, N, K = 3, 8, 256
    w = random_packed(qtype, (E, N, K), seed=7)
    ids = torch.tensor([[2, 2], [0, 1]])
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(7))
    y = tk.quant.mul_mat_id(x, w, ids, qtype)
    wf = gguf_dequantize(w, qtype).reshape(E, N, K)
    ref = ref_quant.mul_mat_id_reference(x, w, ids, qtype)
    bound = torch.stack([x[t].double().abs() @ wf[ids[t, j]].double().abs().t() for t in range(2) for j in range(2)])
    _assert_close_bound(y, ref, bound, 1e-5, f"mul_mat_id {qtype} f32 decode")


@pytest.mark.parametrize("qtype", ("Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0", "F16", "BF16", "F32"))
def test_mul_mat_float16_activations(tk, qtype):
    # (float32 and bfloat16 activations, every format: tests/test_conformance.py)
    _check_mul_mat(tk, qtype, 5, torch.float16)


def test_mul_mat_errors(tk):
    # the kernel wrapper's own checks, called directly (the op's errors: tests/test_conformance.py)
    w = random_packed("Q4_K", (5, 256), seed=6)
    with pytest.raises(ValueError, match="columns"):
        tk.quant.mul_mat(torch.randn(1, 512), w, "Q4_K")
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        tk.quant.mul_mat(torch.ones(1, 256, dtype=torch.int32), w, "Q4_K")


# ------------------------------------------------------------------------------- mul_mat_id

@pytest.mark.parametrize("T", (1, 12))
def test_mul_mat_id_bad_expert_id_gives_nan_row(tk, T):
    w = random_packed("Q8_0", (3, 4, 32), seed=8)
    ids = torch.zeros(T, 2, dtype=torch.int64)
    ids[0, 1] = 7
    y = tk.quant.mul_mat_id(torch.randn(T, 32), w, ids, "Q8_0")
    assert y[0, 1].isnan().all() and y[0, 0].isfinite().all()


def test_group_by_expert_layout(tk):
    ids = torch.tensor([2, 0, 2, 2, 5, 0, -1])  # 5 and -1 are out of range for E = 3
    rows, tile_e, n_tiles = tk.quant._group_by_expert(ids, 3, 2)
    assert n_tiles == 4 + 3 and rows.shape == (n_tiles * 2,)
    assert tile_e.tolist()[:4] == [0, 2, 2, 3] and all(e == 3 for e in tile_e.tolist()[4:])
    assert rows.tolist()[:6] == [1, 5, 0, 2, 3, -1]


# ------------------------------------------------------------------------------- int8 decode

# one format per grouped-rule shape: GL 32/16/8, offsets (Q4_K, IQ1_M), centred codes (Q6_K),
# codebooks and signs (IQ2_XXS), the e8m0 scale and value table (MXFP4); the interpreter is slow,
# so more formats run with -m slow
INT8_FORMATS = ("Q4_K", "Q6_K", "IQ2_XXS", "IQ1_M", "MXFP4") + tuple(
    pytest.param(q, marks=pytest.mark.slow) for q in ("Q8_0", "Q4_1", "IQ4_XS", "IQ3_S", "Q2_K"))


@pytest.mark.parametrize("qtype", INT8_FORMATS)
def test_group_decompose_rebuilds_the_weights(tk, qtype):
    w = random_packed(qtype, (2, 256), seed=2)
    scale, off, code = tk.quant.group_decompose(w, qtype)
    gl = tk.formats.GROUP_LEN[qtype]
    rebuilt = (scale.repeat_interleave(gl, 1) * code + off.repeat_interleave(gl, 1))
    assert torch.equal(code, code.round()) and -128 <= code.min() and code.max() <= 127  # int8
    torch.testing.assert_close(rebuilt, gguf_dequantize(w, qtype).reshape(2, 256), rtol=1e-6, atol=0)


@pytest.mark.parametrize("qtype", INT8_FORMATS)
def test_int8_decode_bit_exact_vs_integer_reference(tk, qtype, monkeypatch):
    monkeypatch.setattr("hanzo_torch.backends.triton.quant.DECODE_OVERRIDE", "int8")
    N, K = 8, 512  # one row tile, two K tiles
    w = random_packed(qtype, (N, K), seed=4)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, K, generator=g)
    x[0, 64:96] = 0.0  # an all-zero q8_1 block (d = 0)
    y = tk.quant.mul_mat(x, w, qtype)
    scale, off, code = tk.quant.group_decompose(w, qtype)
    ref = matvec_q8_1_reference(tk.quant.quantize_q8_1(x)[0], scale, off, code, tk.formats.GROUP_LEN[qtype])
    assert torch.equal(y[0], ref), f"{qtype}: max |diff| {(y[0] - ref).abs().max().item():.3e}"
    # against the float reference: the only error is the q8_1 rounding of x (|dx| <= d8 / 2)
    blk = x.reshape(-1, 32).abs().amax(1, keepdim=True).expand(-1, 32).reshape(1, K) / 127 / 2
    wf = gguf_dequantize(w, qtype).reshape(N, K)
    bound = blk.double() @ wf.double().abs().t() + 1e-5 * matmul_bound(x, wf)
    err = (y.double() - ref_quant.mul_mat_reference(x, w, qtype).double()).abs()
    assert (err <= bound * 1.01).all(), f"{qtype}: error {err.max().item():.3e} over the q8_1 bound"


def test_int8_decode_mul_mat_id_and_bf16(tk, monkeypatch):
    monkeypatch.setattr("hanzo_torch.backends.triton.quant.DECODE_OVERRIDE", "int8")
    qtype, E, N, K = "IQ4_NL", 3, 8, 64
    w = random_packed(qtype, (E, N, K), seed=6)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 2, K, generator=g)
    ids = torch.tensor([[2, 0], [2, 7]])  # 7: out of range -> NaN row
    y = tk.quant.mul_mat_id(x, w, ids, qtype)
    xq = tk.quant.quantize_q8_1(x)
    gl = tk.formats.GROUP_LEN[qtype]
    for t in range(2):
        for j in range(2):
            e = int(ids[t, j])
            if e >= E:
                assert y[t, j].isnan().all()
                continue
            ref = matvec_q8_1_reference(xq[t, j], *tk.quant.group_decompose(w[e], qtype), gl)
            assert torch.equal(y[t, j], ref), (t, j)
    xb = x[0, :1].to(torch.bfloat16)  # bf16 activations: quantized from their values, bf16 out
    yb = tk.quant.mul_mat(xb, w[1], qtype)
    ref = matvec_q8_1_reference(tk.quant.quantize_q8_1(xb)[0], *tk.quant.group_decompose(w[1], qtype), gl)
    # (the interpreter's float32 -> bfloat16 cast truncates: one bf16 ulp)
    assert yb.dtype == torch.bfloat16
    assert ((yb[0].float() - ref).abs() <= ref.abs() * 2.0 ** -7).all()


def _count_launches(monkeypatch, module, name: str) -> list:
    """Wrap the Triton kernel ``module.name`` so each launch (``kernel[grid](...)``) appends its grid
    to the returned list, then runs the real kernel."""
    calls, real = [], getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setattr(module, name, Spy())
    return calls


def test_decode_path_table(tk, monkeypatch):
    monkeypatch.setattr("hanzo_torch.backends.triton.quant.DECODE_OVERRIDE", "")
    for name in tk.formats.GROUP_LEN:
        assert tk.quant.DECODE_PATH[name] in ("int8", "f32"), name
        assert tk.quant._decode_int8(name) == (tk.quant.DECODE_PATH[name] == "int8")
    assert not tk.quant._decode_int8("F16")  # dense formats: no grouped rule, f32 path
    calls = _count_launches(monkeypatch, tk.quant, "_matvec_q8_kernel")
    w = random_packed("Q4_K", (8, 256), seed=1)
    x = torch.randn(1, 256)
    monkeypatch.setitem(tk.quant.DECODE_PATH, "Q4_K", "f32")
    tk.quant.mul_mat(x, w, "Q4_K")
    assert not calls
    monkeypatch.setitem(tk.quant.DECODE_PATH, "Q4_K", "int8")
    tk.quant.mul_mat(x, w, "Q4_K")
    assert len(calls) == 1
    monkeypatch.setattr("hanzo_torch.backends.triton.quant.DECODE_OVERRIDE", "f32")  # the A/B override wins over the table
    tk.quant.mul_mat(x, w, "Q4_K")
    assert len(calls) == 1


# ------------------------------------------------------------------------------- quantize_q8_1

def test_quantize_q8_1_byte_exact(tk):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 5, 96, generator=g) * 4
    x[0, 0, :32] = 0.0                                            # all-zero block: d = 0
    x[0, 1, :32] = torch.arange(32) - 15.5                        # codes at exact .5 ties
    x[1, 2, 32:64] = torch.linspace(-127, 127, 32)                # amax = 127: d = 1
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        out = tk.quant.quantize_q8_1(xd)
        assert out.shape == (3, 5, 108) and out.dtype == torch.uint8
        assert torch.equal(out, ref_quant.quantize_q8_1_reference(xd)), dtype
    with pytest.raises(ValueError, match="multiple of 32"):
        tk.quant.quantize_q8_1(torch.randn(2, 40))


# ------------------------------------------------------------------------------- fused ops

def _tol(dtype):
    # float32: rounding of a handful of float32 ops; bf16/f16: one ulp of the output (+ the
    # interpreter's truncating bf16 cast)
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-2)


def test_kv_cache_write_skips_out_of_range_positions(tk):
    # the kernel drops rows at positions outside the cache (the op's check rejects them first)
    g = torch.Generator().manual_seed(14)
    B, S, Hk, D, T = 2, 9, 2, 8, 3
    kc, vc = torch.zeros(B, S, Hk, D, dtype=torch.bfloat16), torch.zeros(B, S, Hk, D, dtype=torch.bfloat16)
    k = torch.randn(B, T, Hk, D, generator=g).bfloat16()
    v = torch.randn(B, T, Hk, D, generator=g).bfloat16()
    tk.fused.kv_cache_write(kc, vc, k, v, torch.tensor([[0, 1, 2], [8, 4, 5]]))
    before = kc.clone()
    tk.fused.kv_cache_write(kc, vc, k, v, torch.tensor([[9, -1, 100], [9, 9, 9]]))  # all out of range
    assert torch.equal(kc, before)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("T,G", [(1, 4), (2, 2)])
def test_attention_split_decode_numeric(tk, dtype, T, G, monkeypatch):
    # flash-decoding split over keys (chunks of 32 here), merged by the combine kernel
    monkeypatch.setattr(tk.fused, "ATTN_SPLIT_CHUNK", 32)
    combines = _count_launches(monkeypatch, tk.fused, "_attention_combine_kernel")
    g = torch.Generator().manual_seed(19 + T)
    B, S, Hk, D = 2, 150, 2, 16
    q = torch.randn(B, T, Hk * G, D, generator=g).to(dtype)
    kc = torch.randn(B, S, Hk, D, generator=g).to(dtype)
    vc = torch.randn(B, S, Hk, D, generator=g).to(dtype)
    pos = torch.tensor([[140, 149][:T], [20, 21][:T]])  # batch 1 leaves most splits empty
    out = tk.fused.attention(q, kc, vc, pos, D ** -0.5, "auto")
    ref = ref_fused.attention_reference(q, kc, vc, pos, D ** -0.5, "eager")
    assert len(combines) == 1  # the split path ran
    torch.testing.assert_close(out, ref, **_tol(dtype))


# ------------------------------------------------------------------------------- dispatch

def _wrapped(tk):
    """The dispatcher kernels the backend registers on CUDA, built for CPU tensors (interpreter)."""
    backend = tk.backend
    fmts = frozenset(backend.supported_formats())
    table = backend.kernels()
    table["swiglu_mul_mat"] = tk.ffn.swiglu_mul_mat
    return {op: backend.wrap(op, fn, fmts) for op, fn in table.items()}


def test_registered_kernel_reads_no_reference_flag(tk, monkeypatch):
    """The registered kernel launches whatever the reference mode: that mode is the dispatcher
    redirect registered in front of it on the CUDA key (tests/test_backends_contract.py), never a
    per-call check; the op's own checks run before the kernel."""
    calls = _count_launches(monkeypatch, tk.quant, "_matvec_grouped_kernel")
    mul_mat = _wrapped(tk)["mul_mat"]
    w = random_packed("Q6_K", (6, 256), seed=17)
    x = torch.randn(1, 256)
    y = mul_mat(x, w, "Q6_K")
    assert len(calls) == 1
    torch.testing.assert_close(y, ref_quant.mul_mat_reference(x, w, "Q6_K"), rtol=1e-5, atol=1e-5)
    with hanzo_torch.ops.use_reference("mul_mat"):
        mul_mat(x, w, "Q6_K")
    assert len(calls) == 2
    with pytest.raises(ValueError, match="not a multiple"):
        mul_mat(torch.randn(1, 100), w, "Q6_K")  # the op's own checks run before the kernel


def test_swiglu_mul_mat_decode_launches_the_fused_kernel_once(tk, monkeypatch):
    """The registered swiglu_mul_mat kernel (checks, format routing, then the kernel) launches the
    fused grouped mat-vec once for a decode call; the wrapper's own checks name the mismatch."""
    calls = _count_launches(monkeypatch, tk.ffn, "_swiglu_matvec_grouped_kernel")
    kernel = _wrapped(tk)["swiglu_mul_mat"]
    wg, wu = random_packed("Q4_K", (24, 256), seed=11), random_packed("Q6_K", (24, 256), seed=12)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(13))
    y = kernel(x, wg, wu, "Q4_K", "Q6_K")
    assert len(calls) == 1
    with hanzo_torch.ops.use_reference():  # the float32 composition
        want = torch.ops.hanzo.swiglu_mul_mat(x, wg, wu, "Q4_K", "Q6_K")
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="w_up has 20"):
        tk.ffn.swiglu_mul_mat(x, wg, wu[:20], "Q4_K", "Q6_K")
    with pytest.raises(ValueError, match="hold 512 values"):
        tk.ffn.swiglu_mul_mat(x, wg, random_packed("Q6_K", (24, 512)), "Q4_K", "Q6_K")


def test_every_registered_kernel_matches_its_reference(tk):
    # The dispatcher kernels receive the op's arguments in schema order; each op is run once
    # through its kernel and compared with its reference.
    called = []
    ops = {}
    for op, fn in _wrapped(tk).items():
        def spy(*a, _fn=fn, _op=op):
            called.append(_op)
            return _fn(*a)

        ops[op] = spy
    ops = types.SimpleNamespace(**ops)
    g = torch.Generator().manual_seed(18)
    rq, rf = ref_quant, ref_fused
    w = random_packed("Q4_K", (6, 256), seed=18)
    we = random_packed("Q4_K", (3, 6, 256), seed=19)
    x = torch.randn(2, 256, generator=g)
    ids = torch.tensor([[0, 2], [1, 1]])
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.dequantize(w, "Q4_K", [6, 256], torch.float32),
                               rq.dequantize_reference(w, "Q4_K", [6, 256], torch.float32), rtol=0, atol=0)
    assert torch.equal(ops.quantize_q8_1(x), rq.quantize_q8_1_reference(x))
    torch.testing.assert_close(ops.mul_mat(x, w, "Q4_K"), rq.mul_mat_reference(x, w, "Q4_K"), **close)
    torch.testing.assert_close(ops.mul_mat_id(x, we, ids, "Q4_K"), rq.mul_mat_id_reference(x, we, ids, "Q4_K"), **close)
    torch.testing.assert_close(ops.get_rows(w, ids, "Q4_K", torch.float32),
                               rq.get_rows_reference(w, ids, "Q4_K", torch.float32), rtol=0, atol=0)
    h, r, nw = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g), torch.randn(32, generator=g)
    torch.testing.assert_close(ops.rms_norm(h, nw, 1e-6), rf.rms_norm_reference(h, nw, 1e-6), **close)
    for a, b in zip(ops.add_rms_norm(h, r, nw, 1e-6), rf.add_rms_norm_reference(h, r, nw, 1e-6)):
        torch.testing.assert_close(a, b, **close)
    torch.testing.assert_close(ops.swiglu(h, r), rf.swiglu_reference(h, r), **close)
    for a, b in zip(ops.moe_route(h, 2, True), rf.moe_route_reference(h, 2, True)):
        torch.testing.assert_close(a, b, **close)
    q, k = torch.randn(1, 2, 2, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g)
    pos = torch.tensor([[3, 4]])
    for a, b in zip(ops.qk_norm_rope(q, k, None, None, pos, 1e4, 1e-6),
                    rf.qk_norm_rope_reference(q, k, None, None, pos, 1e4, 1e-6)):
        torch.testing.assert_close(a, b, **close)
    kc, vc = torch.zeros(1, 8, 1, 16), torch.zeros(1, 8, 1, 16)
    ops.kv_cache_write(kc, vc, k, k, pos)
    assert torch.equal(kc[0, 3:5], k[0]) and torch.equal(vc[0, 3:5], k[0])
    kc2, vc2 = torch.zeros(1, 8, 1, 16), torch.zeros(1, 8, 1, 16)
    q_rot, k_rot = ops.qk_norm_rope(q, k, None, None, pos, 1e4, 1e-6)
    assert torch.equal(ops.qk_norm_rope_kv_write(q, k, k, None, None, kc2, vc2, pos, 1e4, 1e-6), q_rot)
    assert torch.equal(kc2[0, 3:5], k_rot[0]) and torch.equal(vc2[0, 3:5], k[0]) and not kc2[0, :3].any()
    torch.testing.assert_close(ops.attention(q, kc, vc, pos, 0.25, "auto"),
                               rf.attention_reference(q, kc, vc, pos, 0.25, "auto"), **close)
    backend = tk.backend
    assert sorted(set(called)) == sorted(backend.QUANT_OPS + backend.PLAIN_OPS)


def test_registration_covers_every_op_and_format(tk):
    backend = tk.backend
    assert set(backend.QUANT_OPS + backend.PLAIN_OPS) <= set(_wrapped(tk))
    assert set(ALL_FORMATS) <= set(backend.supported_formats())
    assert {"Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0", "F16", "BF16", "F32", "IQ2_XXS", "TQ1_0", "MXFP4"} <= set(ALL_FORMATS)


# Parent process: only the tests that start subprocesses are collected; child: only the cases.
for _name in [n for n in list(globals()) if n.startswith("test_") and (n in PARENT_TESTS) == _CHILD]:
    del globals()[_name]
