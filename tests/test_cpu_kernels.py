"""What is CPU-specific about the C++ quantized kernels (csrc/cpu, hanzo_torch.backends.cpu).

Every op on every instruction set, every format, both sides of the mat-vec/GEMM crossover, is
gated against the references in tests/test_conformance.py (backends ``cpu-<isa>``), with the
tight oracle below. Here: the int8 activation quantization itself (identical on every ISA), the
fused gate+up kernel being bit-identical to its unfused composition, the extension's own
argument checks, the ISA choice (HANZO_CPU_ISA, the self-check), the reference A/B switch and
the fallback when the build fails.

Tight oracle (tests/test_conformance.py and tests/test_cpu_matvec.py): the kernels quantize x to
int8 blocks (``xq * d``) and then compute ``(xq * d) @ W^T`` up to float32 rounding of per-block
partial sums, so the error against that product (float64) is <= 1e-5 * (|xq*d| @ |W|^T)
(measured <= 5e-8 over all formats, ISAs and paths); a wrong nibble, scale or sign gives errors
of 1e-2..1 of that scale, i.e. >= 1000x the tolerance (test_conformance's
test_tolerances_reject_real_bugs shows one).
"""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import hanzo_torch
from hanzo_torch.backends import cpu as hcpu
from hanzo_torch.ops import quant
from format_utils import FLOAT_FIELDS, gguf_dequantize

GT = gguf.GGMLQuantizationType

# Byte offsets of the fp16 scale fields per block (random bytes there could be inf/nan), from the
# registry's block fields.
_F16_FIELDS = {name: tuple(off for off, kind in fields if kind == "f16") for name, fields in FLOAT_FIELDS.items()}


@pytest.fixture(scope="module")
def ext():
    e = hcpu.extension()
    assert e is not None, "the C++ CPU extension failed to build (see the warning above)"
    return e


def ISAS():
    e = hcpu.extension()
    return [hcpu.ISA_NAMES[i] for i in e.supported_isas()] if e is not None else ["scalar"]


def random_blocks(qtype: str, n_rows: int, K: int, seed: int) -> torch.Tensor:
    """Random packed rows: every bit pattern random except fp16 scales (finite, ~1e-2) and e8m0 exponents."""
    rng = np.random.default_rng(seed)
    bs, ts = gguf.GGML_QUANT_SIZES[GT[qtype]]
    nb = n_rows * K // bs
    b = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
    half = lambda n: (rng.uniform(0.5, 2.0, n) * 1e-2 * rng.choice([-1, 1], n)).astype(np.float16).view(np.uint8).reshape(n, 2)
    for off in _F16_FIELDS.get(qtype, ()):
        b[:, off:off + 2] = half(nb)
    if qtype == "MXFP4":
        b[:, 0] = rng.integers(118, 124, nb)
    if qtype == "IQ1_M":  # the fp16 d is spread over the top nibbles of the 4 scale words
        d = half(nb).view(np.uint16).reshape(nb)
        sc = b[:, 48:56].copy().view(np.uint16) & 0x0FFF
        for i in range(4):
            sc[:, i] |= ((d >> (4 * i)) & 0xF).astype(np.uint16) << 12
        b[:, 48:56] = sc.view(np.uint8)
    return torch.from_numpy(b.reshape(n_rows, -1))


def gguf_dequant(qtype, w, K):
    return gguf_dequantize(w, qtype).reshape(w.shape[0], K)


def qa_of(qtype):  # activation block size the kernels use for this format
    return gguf.GGML_QUANT_SIZES[GT[qtype]][0]


def act_dequant(ext, x, qa):
    q, d, _, _ = ext.quantize_activation(x, qa, 0)
    return (q.double().reshape(x.shape[0], -1, qa) * d.double().unsqueeze(-1)).reshape(x.shape)


def assert_tight(y, x_hat, wf, what):
    """|y - x_hat @ W^T| <= 1e-5 * (|x_hat| @ |W|^T) + 1e-30, elementwise (float64 oracle)."""
    ref = x_hat @ wf.double().T
    scale = x_hat.abs() @ wf.double().abs().T
    err = (y.double() - ref).abs()
    bad = err > 1e-5 * scale + 1e-30
    assert not bad.any(), f"{what}: max err {err.max():.3e}, err/scale {(err / (scale + 1e-30)).max():.3e}"


@pytest.mark.parametrize("qa", [32, 256])
def test_activation_quantization(ext, qa):
    x = torch.randn(3, 1024) * torch.logspace(-3, 3, 3).unsqueeze(1)
    x[1, :qa] = 0.0  # an all-zero block
    outs = [ext.quantize_activation(x, qa, hcpu._ISA_BY_NAME[i]) for i in ISAS()]
    q, d, s, sf = outs[0]
    for q2, d2, s2, sf2 in outs[1:]:  # every ISA quantizes bit-identically
        assert torch.equal(q, q2) and torch.equal(d, d2) and torch.equal(s, s2) and torch.equal(sf, sf2)
    xb = x.reshape(3, -1, qa)
    assert torch.equal(d, xb.abs().amax(-1) / 127)
    err = (q.float().reshape(3, -1, qa) * d.unsqueeze(-1) - xb).abs()
    assert (err <= d.unsqueeze(-1) * 0.5 * (1 + 1e-5)).all()
    assert torch.equal(s.int(), q.reshape(3, -1, 16).int().sum(-1))
    assert torch.equal(sf, d.repeat_interleave(qa // 16, dim=1) * s.float())
    assert (q[1, :qa] == 0).all() and d[1, 0] == 0


@pytest.mark.parametrize("qg,qu", [("Q4_K", "Q4_K"), ("Q4_K", "Q6_K"), ("Q8_0", "Q4_K"), ("IQ2_XXS", "Q5_0")])
def test_swiglu_mul_mat_fused_equals_the_composition(ext, qg, qu):
    """The fused CPU swiglu_mul_mat (gate rows, up rows and the epilogue per thread range) is
    bit-identical to swiglu(mul_mat(x, Wg), mul_mat(x, Wu)) of the same kernels, on every ISA,
    decode and GEMM paths, float32 and bfloat16 (projections rounded like the unfused ops)."""
    K, F_ = 512, 41  # F not a multiple of the GEMM tile (3) nor of the thread chunks
    wg, wu = random_blocks(qg, F_, K, seed=20), random_blocks(qu, F_, K, seed=21)
    x = torch.randn(9, K)
    from hanzo_torch.backends.cpu.fused import swiglu as sw

    for isa in ISAS():
        for M, mv in ((1, 8), (4, 8), (9, 8), (9, 0)):
            for dtype in (torch.float32, torch.bfloat16):
                xd = x[:M].to(dtype)
                y = hcpu.swiglu_mul_mat(xd, wg, wu, qg, qu, isa=isa, mv_max_rows=mv)
                g = hcpu.mul_mat(xd, wg, qg, isa=isa, mv_max_rows=mv)
                u = hcpu.mul_mat(xd, wu, qu, isa=isa, mv_max_rows=mv)
                assert y.dtype == dtype and torch.equal(y, sw(g, u)), f"{qg}+{qu}/{isa}/M={M}/mv<={mv}/{dtype}"
    # a large F runs the threaded path; the op routes here on CPU
    wg, wu = random_blocks(qg, 1024, K, seed=22), random_blocks(qu, 1024, K, seed=23)
    xd = torch.randn(1, 1, K)
    y = torch.ops.hanzo.swiglu_mul_mat(xd, wg, wu, qg, qu)
    assert y.shape == (1, 1, 1024)
    assert torch.equal(y, sw(hcpu.mul_mat(xd, wg, qg), hcpu.mul_mat(xd, wu, qu)))


def test_bad_inputs_raise_clear_errors(ext):
    w = random_blocks("Q4_K", 4, 256, seed=6)
    with pytest.raises(RuntimeError, match="features"):
        ext.mul_mat(torch.randn(1, 512), w, int(GT.Q4_K), 0, 8)
    with pytest.raises(RuntimeError, match="whole number"):
        ext.mul_mat(torch.randn(1, 256), w[:, :100], int(GT.Q4_K), 0, 8)
    with pytest.raises(RuntimeError, match="uint8"):
        ext.mul_mat(torch.randn(1, 256), w.float(), int(GT.Q4_K), 0, 8)
    with pytest.raises(ValueError, match="unknown ISA"):
        hcpu.mul_mat(torch.randn(1, 256), w, "Q4_K", isa="neon")


def test_ops_dispatch_and_fallback_ab(ext, monkeypatch):
    """torch.ops.hanzo.* run the C++ kernels on CPU; use_reference selects the reference (one process)."""
    K, N = 512, 8
    w = random_blocks("Q6_K", N, K, seed=7)
    x = torch.randn(2, K, dtype=torch.bfloat16)
    fast = torch.ops.hanzo.mul_mat(x, w, "Q6_K")
    assert torch.equal(fast, hcpu.mul_mat(x, w, "Q6_K"))
    with hanzo_torch.ops.use_reference("mul_mat"):
        slow = torch.ops.hanzo.mul_mat(x, w, "Q6_K")
    assert torch.equal(slow, quant.mul_mat_reference(x, w, "Q6_K"))
    assert not torch.equal(fast, slow)  # different arithmetic: int8 activations vs float32
    torch.testing.assert_close(fast.float(), slow.float(), rtol=0.05, atol=0.05 * slow.float().abs().max().item())
    ids = torch.tensor([[1, 0]])
    emb = torch.ops.hanzo.get_rows(w, ids, "Q6_K", torch.float32)
    assert torch.equal(emb, quant.get_rows_reference(w, ids, "Q6_K", torch.float32))


def test_forced_isa_env(ext, monkeypatch):
    """HANZO_CPU_ISA is read once, at import: a bad value is reported by check_environment (which
    load() and the CLI call before any long work)."""
    monkeypatch.setattr(hcpu, "_FORCED_ISA", "sse9")
    with pytest.raises(ValueError, match="HANZO_CPU_ISA"):
        hcpu.check_environment()
    with pytest.raises(ValueError, match="HANZO_CPU_ISA"):
        hcpu._choose_isa("sse9")
    assert hcpu._choose_isa("scalar") == 0


def test_avx512_sim_level_is_built_where_simde_is_installed(ext):
    """The avx512-sim level is the only run of the AVX-512 kernel source on an AVX2 machine: where
    the SIMDe headers are installed (CI installs libsimde-dev) it must be built and offered, so the
    gate cannot vanish silently; where they are not, status() says why it is missing."""
    simde = Path("/usr/include") / hcpu.SIMDE_HEADER
    level = hcpu._ISA_BY_NAME["avx512-sim"]
    missing = hcpu.status()["isa_missing"]
    if simde.is_file() or hcpu._simde_header() is not None:
        assert ext.isa_built(level), f"{simde} is installed but the extension was built without avx512-sim"
        if 1 in ext.supported_isas():
            assert "avx512-sim" in hcpu.isa_levels() and "avx512-sim" not in missing
    else:
        assert not ext.isa_built(level) and "avx512-sim" not in hcpu.isa_levels()
        assert "SIMDe" in missing["avx512-sim"]
        with pytest.raises(RuntimeError, match="not built"):
            ext.mul_mat(torch.randn(1, 256), random_blocks("Q4_K", 1, 256, seed=1), int(GT.Q4_K), level, 8)


def test_missing_isa_levels_name_their_reason():
    """An extension built without the SIMDe headers (its avx512-sim unit a stub) on an AVX2 CPU."""
    class StubExt:
        def supported_isas(self):
            return [0, 1]

        def isa_built(self, level):
            return level != 3

    missing = hcpu._isa_missing(StubExt())
    assert set(missing) == {"avx512", "avx512-sim"}
    assert "AVX-512" in missing["avx512"] and hcpu.SIMDE_HEADER in missing["avx512-sim"]
    assert "libsimde-dev" in missing["avx512-sim"]


def test_simulated_isa_is_never_the_default_but_can_be_forced(ext):
    levels = ext.supported_isas()
    assert hcpu._choose_isa("") not in hcpu.SIMULATED_ISAS
    if 3 in levels:
        assert hcpu._choose_isa("avx512-sim") == 3
        with hcpu.use_isa("avx512-sim"):
            w = random_blocks("Q4_K", 3, 512, seed=3)
            x = torch.randn(9, 512)  # the GEMM path: 4x3 register tiles at level 2
            assert torch.equal(torch.ops.hanzo.mul_mat(x, w, "Q4_K"), hcpu.mul_mat(x, w, "Q4_K", isa="avx512-sim"))
    else:
        with pytest.raises(ValueError, match="HANZO_CPU_ISA"):
            hcpu._choose_isa("avx512-sim")


def test_isa_self_check_passes_on_this_cpu(ext):
    for level in ext.supported_isas():
        assert hcpu._self_check(ext, level), hcpu.ISA_NAMES[level]


def test_build_failure_warns_once_and_runs_the_reference(ext, monkeypatch):
    def broken_build(verbose=False):
        raise RuntimeError("no C++ compiler found (simulated)")

    monkeypatch.setattr(hcpu._slot, "ext", None)
    monkeypatch.setattr(hcpu._slot, "failed", None)
    monkeypatch.setattr(hcpu, "build", broken_build)
    w = random_blocks("Q4_K", 3, 256, seed=9)
    x = torch.randn(2, 256)
    # a process whose build fails registers no CPU kernel: the backend registers nothing, and its
    # direct wrappers run the references
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert hcpu.register() == frozenset()
        y = hcpu.mul_mat(x, w, "Q4_K")
    assert torch.equal(y, quant.mul_mat_reference(x, w, "Q4_K"))
    import warnings as _w
    with _w.catch_warnings():
        _w.simplefilter("error")  # the second call does not warn again
        assert torch.equal(hcpu.get_rows(w, torch.tensor([2]), "Q4_K", torch.float32),
                           quant.get_rows_reference(w, torch.tensor([2]), "Q4_K", torch.float32))


def _avx512_level():
    """The level that runs the AVX-512 source here: native, else simulated, else None."""
    levels = _avx512_levels()
    return levels[0] if levels else None


def _avx512_levels():
    """Every level here that runs the AVX-512 source: native and simulated (SIMDe)."""
    return [n for n in ("avx512", "avx512-sim") if n in hcpu.isa_levels()]


@pytest.mark.parametrize("qtype,K", [("Q4_0", 2080), ("Q8_0", 96), ("Q4_1", 2080), ("Q5_0", 32), ("IQ4_NL", 2080),
                                     ("Q4_K", 2304), ("Q6_K", 512), ("Q3_K", 2304), ("Q2_K", 512), ("IQ4_XS", 512)])
def test_gemm512_against_its_256_bit_twin(ext, qtype, K):
    """The AVX-512 level's 512-bit GEMM (vpdpbusd for 32-value blocks, offsets and mins folded into
    the int32 sums) against the same level's 256-bit GEMM (HANZO_CPU_GEMM512=0), which gives the
    AVX2 kernels' bits: the same int8 products, another float summation order, so within a few
    float32 roundings of |x_hat| @ |W|^T. K: an odd last 32-value block of a 2048-value panel
    (2080), one block pair (96 = 3 blocks: a lone last block), a single block (32)."""
    level = _avx512_level()
    if level is None:
        pytest.skip("no AVX-512 level here (no AVX-512 CPU, and the extension was built without SIMDe)")
    N, M = 7, 13  # ragged register tiles in both directions (4 x 3)
    w = random_blocks(qtype, N, K, seed=11)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(12))
    wide = hcpu.gemm512()
    try:
        hcpu.set_gemm512(False)
        y256 = hcpu.mul_mat(x, w, qtype, isa=level)
        hcpu.set_gemm512(True)
        y512 = hcpu.mul_mat(x, w, qtype, isa=level)
    finally:
        hcpu.set_gemm512(wide)
    if "avx2" in hcpu.isa_levels():
        assert torch.equal(y256, hcpu.mul_mat(x, w, qtype, isa="avx2"))
    wf = quant.dequantize(w, qtype, [N, K], torch.float32).double()
    qa = gguf.GGML_QUANT_SIZES[GT[qtype]][0]  # the kernels quantize x in blocks of the weight's block size
    xq, xd, _, _ = ext.quantize_activation(x, qa, 0)
    xh = (xq.double().reshape(M, -1, qa) * xd.double().reshape(M, -1, 1)).reshape(M, K)
    bound = 1e-5 * (xh.abs() @ wf.abs().t()) + 1e-30
    assert ((y512.double() - xh @ wf.t()).abs() <= bound).all()
    assert not torch.equal(y512, torch.zeros_like(y512))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("N,M,K", [(13, 16, 256), (8, 37, 2304), (21, 70, 1536), (5, 17, 4352), (1, 19, 512)])
def test_interleaved_gemm_against_rows(ext, qtype, N, M, K):
    """The 256-bit Q4_K / Q6_K GEMM on row-interleaved panels (HANZO_CPU_REPACK, 8 weight rows a
    vector) against the row-by-row tiles and the float64 product: the same int8 products, another
    float summation order. N: ragged 8-row groups (13, 21, 5, 1) and an exact one (8); M: the
    smallest that takes the path (16), ragged 4-row tiles, past one 64-row M block (70); K: one
    block, past the 2048-value K panel (2304, 4352)."""
    if "avx2" not in hcpu.isa_levels():
        pytest.skip("no avx2 level on this CPU")
    w = random_blocks(qtype, N, K, seed=31 + N)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(32 + M))
    before = hcpu.repack()
    try:
        hcpu.set_repack(False)
        rows = hcpu.mul_mat(x, w, qtype, isa="avx2")
        hcpu.set_repack(True)
        il = hcpu.mul_mat(x, w, qtype, isa="avx2")
        small = hcpu.mul_mat(x[:15], w, qtype, isa="avx2")  # below 16 rows: the row tiles
        wide = hcpu.gemm512()
        # the AVX-512 levels run the same panels with vpdpbusd (int32 sums, then the scale): AVX2's
        # bits, 512-bit tiles or not, natively and through SIMDe
        for level in _avx512_levels():
            try:
                for on in (False, True):
                    hcpu.set_gemm512(on)
                    assert torch.equal(hcpu.mul_mat(x, w, qtype, isa=level), il), (level, on)
            finally:
                hcpu.set_gemm512(wide)
    finally:
        hcpu.set_repack(before)
    wf = quant.dequantize(w, qtype, [N, K], torch.float32).double()
    xh = act_dequant(ext, x, 256)
    assert_tight(il, xh, wf, "interleaved")
    assert_tight(rows, xh, wf, "rows")
    assert not torch.equal(il, rows)  # the toggle selects another kernel (float order differs)
    assert torch.equal(small, rows[:15])


def test_q6k_interleaved_gemm_extreme_values(ext):
    """Q6_K's interleaved int16 sums at their bound: every value 0 or 63 (q6 - 32 = -32 or +31),
    scales -128 and 127, activations at +-127, so the 4 products (x + 128) * (q6 - 32) of a 16-bit
    lane reach 4 * 255 * -32 = -32640 (x = 127 against q6 = 0): exact only if no partial sum
    saturates or wraps."""
    if "avx2" not in hcpu.isa_levels():
        pytest.skip("no avx2 level on this CPU")
    N, M, K = 11, 16, 512
    w = random_blocks("Q6_K", N, K, seed=5)
    blk = w.view(-1, 210)  # ql[128] qh[64] scales[16] d
    blk[:, :128] = 0xFF  # low nibbles 15
    blk[:, 128:192] = 0xFF  # high bits 3: every q6 is 63
    blk[1::2, :128] = 0x00  # every other block: q6 = 0 (0 - 32)
    blk[1::2, 128:192] = 0x00
    sc = torch.tensor([127, -128] * 8, dtype=torch.int8).view(torch.uint8)
    blk[:, 192:208] = sc
    x = torch.ones(M, K)
    x[1::2] = -1.0  # rows of all +1 / all -1: quantize to +-127
    x[2, ::3] = -1.0
    before = hcpu.repack()
    try:
        hcpu.set_repack(True)
        il = hcpu.mul_mat(x, w, "Q6_K", isa="avx2")
        # the AVX-512 levels' int32 sums with the negative scales sign-extended: the same bits
        for level in _avx512_levels():
            assert torch.equal(hcpu.mul_mat(x, w, "Q6_K", isa=level), il), level
        hcpu.set_repack(False)
        rows = hcpu.mul_mat(x, w, "Q6_K", isa="avx2")
    finally:
        hcpu.set_repack(before)
    wf = quant.dequantize(w, "Q6_K", [N, K], torch.float32).double()
    xh = act_dequant(ext, x, 256)
    assert_tight(il, xh, wf, "interleaved")
    assert_tight(rows, xh, wf, "rows")


def test_gemm_blocking_knob(ext):
    """The GEMM's M block only regroups rows: any value gives the same bits; a K panel that is not
    a multiple of 256 values is refused."""
    w = random_blocks("Q4_K", 7, 2304, seed=21)
    x = torch.randn(70, 2304, generator=torch.Generator().manual_seed(22))
    before = ext.gemm_blocking()
    try:
        outs = []
        for mc in (1, 5, 64, 256):
            ext.set_gemm_blocking(mc, before[1])
            outs.append(hcpu.mul_mat(x, w, "Q4_K"))
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        with pytest.raises(RuntimeError, match="multiple of 256"):
            ext.set_gemm_blocking(64, 1000)
    finally:
        ext.set_gemm_blocking(*before)
    assert ext.gemm_blocking() == before


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("K", [256, 1536, 2304])
def test_matvec512_same_bits_as_256_bit_rows(ext, qtype, K):
    """The AVX-512 level's 512-bit one-row mat-vec (two 32-value chunks per step) against the same
    level's 256-bit rows (HANZO_CPU_MATVEC512=0) and the avx2 level: the int32 sums fold to the same
    lanes and the float fix-up is shared, so the bits are equal; and against the dequantized
    reference within float32 roundings. Every AVX-512 level present (native and SIMDe-simulated)."""
    levels = [lv for lv in ("avx512", "avx512-sim") if lv in hcpu.isa_levels()]
    if not levels:
        pytest.skip("no AVX-512 level here (no AVX-512 CPU, and the extension was built without SIMDe)")
    N = 37
    w = random_blocks(qtype, N, K, seed=21)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(22)) * 3
    wide, gfni = hcpu.matvec512(), hcpu.matvec_gfni()
    try:
        for level in levels:
            hcpu.set_matvec512(False)
            y256 = hcpu.mul_mat(x, w, qtype, isa=level)
            hcpu.set_matvec512(True)
            for gf in (False, True):  # Q6_K: shifts and masks, then GF2P8AFFINEQB (avx512-sim: SIMDe's)
                hcpu.set_matvec_gfni(gf)
                y512 = hcpu.mul_mat(x, w, qtype, isa=level)
                assert torch.equal(y512, y256), (level, gf)
            if "avx2" in hcpu.isa_levels():
                assert torch.equal(y512, hcpu.mul_mat(x, w, qtype, isa="avx2")), level
    finally:
        hcpu.set_matvec512(wide)
        hcpu.set_matvec_gfni(gfni)
    wf = quant.dequantize(w, qtype, [N, K], torch.float32).double()
    xq, xd, _, _ = ext.quantize_activation(x, 256, 0)
    xh = (xq.double().reshape(1, -1, 256) * xd.double().reshape(1, -1, 1)).reshape(1, K)
    bound = 1e-5 * (xh.abs() @ wf.abs().t()) + 1e-30
    assert ((y512.double() - xh @ wf.t()).abs() <= bound).all()
    assert not torch.equal(y512, torch.zeros_like(y512))


@pytest.mark.parametrize("env, getter, setter, default", [
    ("HANZO_CPU_GEMM512", "gemm512", "set_gemm512", True),
    ("HANZO_CPU_MATVEC512", "matvec512", "set_matvec512", True),
    ("HANZO_CPU_GFNI", "matvec_gfni", "set_matvec_gfni", True),
    ("HANZO_CPU_REPACK", "repack", "set_repack", True),
    ("HANZO_CPU_RANGED_TASKS", "ranged_tasks", "set_ranged_tasks", True),
    ("HANZO_CPU_PANELS", "panels", "set_panels", True),
    ("HANZO_CPU_Q6K_PLANES", "q6k_planes", "set_q6k_planes", True),
    ("HANZO_CPU_PREFETCH_L2", "prefetch_l2", "set_prefetch_l2", True),
    ("HANZO_CPU_PREFETCH_ACT", "prefetch_act", "set_prefetch_act", True),
    ("HANZO_CPU_PREFETCH_PANELS", "prefetch_panels", "set_prefetch_panels", False),
    ("HANZO_CPU_ADAPTIVE_PREFETCH", "adaptive_prefetch", "set_adaptive_prefetch", True),
    ("HANZO_CPU_GRAPH_PLANS", "graph_plans", "set_graph_plans", True),
])
def test_switch_environment_variables(ext, monkeypatch, env, getter, setter, default):
    """Each A/B switch of the kernels: read when they load (0 off, 1 on, unset or empty its
    default), a malformed value refused by check_environment and, at load, warned about with the
    default kept."""
    get, put = getattr(hcpu, getter), getattr(hcpu, setter)
    before = get()
    try:
        put(False)
        assert get() is False and bool(getattr(ext, getter)()) is False
        put(True)
        assert get() is True and bool(getattr(ext, getter)()) is True
        monkeypatch.delenv(env, raising=False)
        hcpu._configure(ext)
        assert get() is default
        for value, on in (("0", False), ("1", True), ("", default), ("off", False), ("on", True)):
            put(not on)
            monkeypatch.setenv(env, value)
            hcpu._configure(ext)
            assert get() is on, value
        put(not default)
        monkeypatch.setenv(env, "maybe")
        with pytest.raises(ValueError, match=env):
            hcpu.check_environment()
        with pytest.warns(RuntimeWarning, match=f"{env}.*stays {'on' if default else 'off'}"):
            hcpu._configure(ext)
        assert get() is default
    finally:
        put(before)
