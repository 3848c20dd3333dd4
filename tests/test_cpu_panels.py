"""Row-interleaved panels of the CPU decode mat-vec (csrc/cpu/kernels_panels.h, backends.cpu.attach_panels).

Gate: on every SIMD level the panel mat-vec is within the tight oracle of tests/test_cpu_kernels.py
(|y - x_hat @ W^T| <= 1e-5 * |x_hat| @ |W|^T against gguf's dequantization) and gives the bits of
the row-interleaved GEMM (gemm_il_q4k), K panels included; the task split, the fused ops and the
registration's lapse rules are checked against the plain mat-vec.
"""
import pytest
import torch

import hanzo_torch
from hanzo_torch.backends import cpu as hcpu
from hanzo_torch.tensor import GGUFTensor
from test_cpu_kernels import act_dequant, assert_tight, gguf_dequant, random_blocks


@pytest.fixture(scope="module")
def ext():
    e = hcpu.extension()
    assert e is not None, "the C++ CPU extension failed to build"
    return e


SIMD = [n for n in ("avx2", "avx512", "avx512-sim") if n in hcpu.isa_levels()]


def _tid():
    return hcpu._type_id("Q4_K")


def _attach(ext, w):
    """Panels for packed rows w (uint8 [N, rb]) built and registered; returns the buffer."""
    n = ext.panel_bytes(_tid(), *w.shape)
    assert n == w.shape[0] // 8 * (w.shape[1] // 144) * 1184
    buf = torch.empty(n, dtype=torch.uint8)
    ext.pack_panels(w, _tid(), buf)
    ext.set_panels_of(w, _tid(), buf)
    return buf


@pytest.mark.parametrize("isa", SIMD)
# 9 blocks: K panels of 8 + 1 (kc = 2048); 257 blocks: past the 256 whose activation sums the
# kernel keeps on the stack (kernels_panels.h)
@pytest.mark.parametrize("N, K", [(200, 512), (64, 9 * 256), (8, 257 * 256)])
@pytest.mark.parametrize("M", [1, 2, 3, 5])
def test_panels_match_the_oracle_and_the_interleaved_gemm(ext, isa, N, K, M):
    w = random_blocks("Q4_K", N, K, seed=N + K)
    buf = _attach(ext, w)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 4
    try:
        assert ext.panels_of(w, _tid())
        y = hcpu.mul_mat(x, w, "Q4_K", isa=isa)
        assert_tight(y, act_dequant(ext, x, 256), gguf_dequant("Q4_K", w, K), f"panels/{isa}/{N}x{K}/M{M}")
        # the GEMM of the same rows (16 activation rows: the interleaved path) gives each row the same bits
        y16 = hcpu.mul_mat(x.repeat(16, 1)[:16], w, "Q4_K", isa=isa)
        assert torch.equal(y, y16[:M])
        hcpu.set_panels(False)
        assert not ext.panels_of(w, _tid())
        rows = hcpu.mul_mat(x, w, "Q4_K", isa=isa)
        assert not torch.equal(rows, torch.zeros_like(rows))
        assert torch.allclose(rows, y, rtol=1e-5, atol=1e-6 * float(y.abs().max()))
    finally:
        hcpu.set_panels(True)
        ext.drop_panels_of(w)
    assert buf.numel() > 0


@pytest.mark.parametrize("M", [1, 3])
def test_panels_independent_of_task_split_and_threads(ext, M):
    """Tasks of 1, 3 and 5 rows (8-row groups computed in part by several tasks, and tasks that
    start in one group and end in the next) and the default size, 1 and 2 threads: the same bits."""
    K, N = 2 * 256, 704  # > 64 KiB: a parallel split
    rb = K // 256 * 144
    w = random_blocks("Q4_K", N, K, seed=5)
    _attach(ext, w)
    x = torch.randn(M, K)
    old = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for chunk in (1, 3 * rb, 5 * rb, 262144):
                ext.set_matvec_chunk_bytes(chunk, 1)
                outs.append(hcpu.mul_mat(x, w, "Q4_K"))
    finally:
        ext.set_matvec_chunk_bytes(262144, 4)
        torch.set_num_threads(old)
        ext.drop_panels_of(w)
    assert all(torch.equal(y, outs[0]) for y in outs[1:])


@pytest.mark.parametrize("with_panels", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("M, dtype", [(1, torch.float32), (3, torch.bfloat16)])
def test_fused_ops_on_panels_equal_mul_mat(ext, with_panels, M, dtype):
    """swiglu_mul_mat and mul_mat_group read the panels of whichever weights have them, with
    mul_mat's bits (the composition hanzo::swiglu(mul_mat, mul_mat) and per-weight mul_mat + bias);
    [256, 1024] weights make parallel regions (both on panels: gate's and up's row ranges as the
    tasks of one region, then the epilogue's)."""
    K, F = 1024, 256
    wg, wu = random_blocks("Q4_K", F, K, seed=11), random_blocks("Q4_K", F, K, seed=12)
    for w, on in zip((wg, wu), with_panels):
        if on:
            _attach(ext, w)
    x = torch.randn(M, K).to(dtype)
    bias = torch.randn(F)
    try:
        with torch.inference_mode():
            fused = torch.ops.hanzo.swiglu_mul_mat(x, wg, wu, "Q4_K", "Q4_K")
            g, u = torch.ops.hanzo.mul_mat(x, wg, "Q4_K"), torch.ops.hanzo.mul_mat(x, wu, "Q4_K")
            assert torch.equal(fused, torch.ops.hanzo.swiglu(g, u))
            if dtype == torch.float32:
                ys = torch.ops.hanzo.mul_mat_group(x, [wg, wu], ["Q4_K", "Q4_K"], [bias, None])
                assert torch.equal(ys[0], g + bias) and torch.equal(ys[1], u)
    finally:
        ext.drop_panels_of(wg)
        ext.drop_panels_of(wu)


def test_registration_lapses_on_write_and_refuses_inference_tensors(ext):
    K = 256
    w = random_blocks("Q4_K", 16, K, seed=7)
    other = random_blocks("Q4_K", 16, K, seed=8)
    _attach(ext, w)
    x = torch.randn(1, K)
    assert ext.panels_of(w, _tid())
    w.copy_(other)  # the rows change in place: the panels no longer describe them
    assert not ext.panels_of(w, _tid())
    y = hcpu.mul_mat(x, w, "Q4_K")
    assert_tight(y, act_dequant(ext, x, 256), gguf_dequant("Q4_K", other, K), "after write")
    ext.drop_panels_of(w)
    with torch.inference_mode():
        wi = random_blocks("Q4_K", 16, K, seed=9).clone()
    buf = torch.empty(ext.panel_bytes(_tid(), 16, 144), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="inference mode"):
        ext.set_panels_of(wi, _tid(), buf)
    with pytest.raises(RuntimeError, match="no panel layout"):
        ext.pack_panels(random_blocks("Q4_K", 12, K, seed=1), _tid(), buf)  # 12 rows: not whole groups
    assert hcpu.panel_bytes("Q4_K", (12, 144)) == 0
    planes = hcpu.ISA_NAMES[hcpu.default_isa()] == "avx2"  # Q6_K has planes on the avx2 level only
    assert hcpu.panel_bytes("Q6_K", (16, 210)) == (16 * 210 if planes else 0)
    assert hcpu.panel_bytes("Q5_K", (16, 176)) == 0


def test_load_builds_panels_for_copied_q4k_weights(tmp_path):
    """load(mmap=False) on the CPU: every Q4_K matrix with whole 8-row groups that a mat-vec reads
    gets panels (the token table too when the LM head is tied to it, not when only the embedding
    looks it up), the mapped model none; the decode logits of the two agree to the kernels'
    tolerance and the copy with HANZO_CPU_PANELS off gives the mapped model's bits."""
    from gguf_builders import tiny_spec, write_tiny_gguf

    path, untied = tmp_path / "q4k.gguf", tmp_path / "q4k_untied.gguf"
    qtypes = {"embd": "Q4_K", "output": "Q4_K", "attn": "Q4_K", "ffn": "Q4_K", "ffn_down": "Q4_K"}
    write_tiny_gguf(path, tiny_spec("qwen2", qtypes=qtypes))
    write_tiny_gguf(untied, tiny_spec("qwen2", qtypes=qtypes, tied=False))
    copied = hanzo_torch.load(path, max_context=32, mmap=False)
    mapped = hanzo_torch.load(path, max_context=32, mmap=True)
    ext = hcpu.extension()
    weights = [p for p in copied.parameters() if isinstance(p, GGUFTensor)]
    with_panels = [p for p in weights if ext.panels_of(p.packed, _tid())]
    if hcpu.default_isa() == 0:  # the scalar level has no panel kernel: load builds none
        assert not with_panels
        return
    assert with_panels and all(p.qtype == "Q4_K" for p in with_panels)
    assert ext.panels_of(copied.token_embd.weight.packed, _tid())  # tied: the LM head's mat-vec reads it
    separate = hanzo_torch.load(untied, max_context=32, mmap=False)
    assert not ext.panels_of(separate.token_embd.weight.packed, _tid())  # looked up by get_rows only
    assert ext.panels_of(separate.output.weight.packed, _tid())
    assert ext.panels_of(separate.blk[0].attn_q.weight.packed, _tid())
    assert not any(ext.panels_of(p.packed, _tid()) for p in mapped.parameters() if isinstance(p, GGUFTensor))
    ids = torch.tensor([[11, 22, 33]])
    with torch.inference_mode():
        a, b = copied(ids), mapped(ids)
        step_a, step_b = copied(torch.tensor([[7]])), mapped(torch.tensor([[7]]))
        assert torch.allclose(step_a, step_b, rtol=1e-4, atol=1e-4 * float(step_b.abs().max()))
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
        hcpu.set_panels(False)
        try:
            copied.reset(), mapped.reset()
            assert torch.equal(copied(ids), mapped(ids))
        finally:
            hcpu.set_panels(True)


@pytest.mark.parametrize("isa", SIMD)
def test_prefetch_into_l2_or_l1_gives_the_same_bits(ext, isa):
    """The mat-vec's weight prefetch (into L2 8 KiB ahead, or into L1 2 KiB ahead, or none) is a
    hint only: panels and rows of the formats whose kernels prefetch (Q4_K, Q6_K, the 4-block
    Q4_0 step, the two-block Q4_1 step) give the same bits with each, including prefetches past
    the weight's end (a weight smaller than the distance)."""
    cases = []
    for qtype, N, K in (("Q4_K", 64, 1024), ("Q6_K", 37, 2304), ("Q4_0", 33, 1024), ("Q4_1", 21, 544), ("Q4_K", 8, 256)):
        w = random_blocks(qtype, N, K, seed=N)
        cases.append((qtype, w, torch.randn(1, K, generator=torch.Generator().manual_seed(K)) * 2))
    _attach(ext, cases[0][1])
    _attach(ext, cases[-1][1])
    try:
        outs = []
        for l2, dist in ((True, (2048, 8192)), (False, (2048, 8192)), (True, (0, 0)), (False, (0, 0))):
            hcpu.set_prefetch_l2(l2)
            ext.set_prefetch_bytes(*dist)
            outs.append([hcpu.mul_mat(x, w, q, isa=isa) for q, w, x in cases])
        assert ext.panels_of(cases[0][1], _tid())
        for ys in outs[1:]:
            for (q, w, _), y0, y in zip(cases, outs[0], ys):
                assert torch.equal(y, y0), (q, tuple(w.shape))
        for (q, w, x), y0 in zip(cases, outs[0]):
            assert not torch.equal(y0, torch.zeros_like(y0)), q
    finally:
        hcpu.set_prefetch_l2(True)
        ext.set_prefetch_bytes(2048, 8192)
        ext.drop_panels_of(cases[0][1])
        ext.drop_panels_of(cases[-1][1])


@pytest.mark.parametrize("isa", SIMD)
def test_adaptive_prefetch_gives_the_same_bits(ext, isa):
    """mul_mat's row mat-vec choosing its prefetch per weight (set_adaptive_prefetch, both arms
    taken over 20 calls) gives the bits of the fixed prefetch and of none, on a weight large enough
    for the parallel split that makes the choice (Q6_K on its rows and then on registered planes,
    which the avx2 level reads and which take the same choice; Q4_K with panels off)."""
    cases = [("Q6_K", random_blocks("Q6_K", 512, 1536, seed=3)), ("Q4_K", random_blocks("Q4_K", 256, 2048, seed=4))]
    x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(5)) * 3
    before = hcpu.adaptive_prefetch()
    try:
        hcpu.set_panels(False)
        for q, w in cases:
            K = w.shape[1] // (210 if q == "Q6_K" else 144) * 256
            xs = x[:, :K].contiguous()
            hcpu.set_adaptive_prefetch(False)
            fixed = hcpu.mul_mat(xs, w, q, isa=isa)
            ext.set_prefetch_bytes(0, 0)
            assert torch.equal(hcpu.mul_mat(xs, w, q, isa=isa), fixed), q
            ext.set_prefetch_bytes(2048, 8192)
            hcpu.set_adaptive_prefetch(True)
            for _ in range(20):
                assert torch.equal(hcpu.mul_mat(xs, w, q, isa=isa), fixed), q
            assert_tight(fixed, act_dequant(ext, xs, 256), gguf_dequant(q, w, K), f"adaptive/{q}/{isa}")
            if q == "Q6_K":
                hcpu.set_panels(True)
                _attach_planes(ext, w)
                for _ in range(20):
                    assert torch.equal(hcpu.mul_mat(xs, w, q, isa=isa), fixed), "Q6_K planes"
                ext.drop_panels_of(w)
                hcpu.set_panels(False)
    finally:
        hcpu.set_panels(True)
        hcpu.set_adaptive_prefetch(before)
        ext.set_prefetch_bytes(2048, 8192)


def test_the_weight_prefetch_is_built():
    """The AVX-512 unit's L2 prefetch (prefetcht2) is in the built extension. GCC counts
    __builtin_prefetch as free of side effects and deletes a call to a prefetch helper it leaves
    out of line, prefetches and all (csrc/cpu/kernels.h, hz_prefetch_stream)."""
    import shutil
    import subprocess

    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    so = hcpu.extension().__file__
    out = subprocess.run([objdump, "-d", "--no-show-raw-insn", so], capture_output=True, text=True, check=True).stdout
    assert out.count("prefetcht2") >= 8, "the AVX-512 mat-vec's L2 prefetch is missing from the built code"
    assert out.count("prefetcht0") >= 8


# (switch, rows, K): the activation prefetch runs from K >= 4096 (17 blocks: across the K panels'
# boundaries up to the last block); the weight prefetch at any K
PREFETCHES = [("prefetch_act", 24, 17 * 256), ("prefetch_panels", 40, 6 * 256)]


@pytest.mark.parametrize("isa", SIMD)
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("switch, N, K", PREFETCHES)
def test_prefetch_switches_give_the_same_bits(ext, isa, M, switch, N, K):
    """The panels' results with the activation prefetch (set_prefetch_act) or the rows' weight
    prefetch (set_prefetch_panels) on and off: the same bits, matching the oracle."""
    get, put = getattr(hcpu, switch), getattr(hcpu, "set_" + switch)
    w = random_blocks("Q4_K", N, K, seed=41 + N)
    _attach(ext, w)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(42 + N)) * 3
    before = get()
    try:
        assert ext.panels_of(w, _tid())
        put(True)
        on = hcpu.mul_mat(x, w, "Q4_K", isa=isa)
        put(False)
        off = hcpu.mul_mat(x, w, "Q4_K", isa=isa)
        assert torch.equal(on, off)
        assert_tight(on, act_dequant(ext, x, 256), gguf_dequant("Q4_K", w, K), f"{switch}/{isa}/M{M}")
    finally:
        put(before)
        ext.drop_panels_of(w)


# ---------------------------------------------------------------------------- Q6_K planes (avx2)

def _q6k_values(rows: torch.Tensor) -> torch.Tensor:
    """The unsigned six-bit values (0..63) of Q6_K rows (uint8 [N, nb * 210]) -> uint8 [N, nb, 256],
    from ggml's layout (ql's nibbles, qh's bit pairs), written out here independently of the C++."""
    b = rows.reshape(rows.shape[0], -1, 210).to(torch.int32)
    ql, qh = b[..., :128], b[..., 128:192]
    out = []
    for h in range(2):
        a, c, e = ql[..., 64 * h:64 * h + 32], ql[..., 64 * h + 32:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        out += [(a & 15) | (e & 3) << 4, (c & 15) | (e >> 2 & 3) << 4, (a >> 4) | (e >> 4 & 3) << 4, (c >> 4) | (e >> 6 & 3) << 4]
    return torch.cat(out, dim=-1).to(torch.uint8)


def _attach_planes(ext, w):
    tid = hcpu._type_id("Q6_K")
    n = ext.panel_bytes(tid, *w.shape)
    assert n == w.numel()
    buf = torch.empty(n, dtype=torch.uint8)
    ext.pack_panels(w, tid, buf)
    ext.set_panels_of(w, tid, buf)
    return buf


def test_q6k_planes_hold_the_documented_layout(ext):
    """pack_panels' planes of Q6_K rows against kernels_panels.h's formula, computed from the rows
    here: plane j byte l = q(32j + l) | (q(96 + l) >> 2j & 3) << 6 per 128-value half, scales and d
    copied."""
    w = random_blocks("Q6_K", 5, 3 * 256, seed=21)
    buf = torch.empty(w.numel(), dtype=torch.uint8)
    ext.pack_panels(w, hcpu._type_id("Q6_K"), buf)
    q = _q6k_values(w).to(torch.int32)  # [N, nb, 256]
    p = buf.reshape(5, 3, 210).to(torch.int32)
    for h in range(2):
        half, top = q[..., 128 * h:128 * h + 128], q[..., 128 * h + 96:128 * h + 128]
        for j in range(3):
            want = half[..., 32 * j:32 * j + 32] | (top >> (2 * j) & 3) << 6
            assert torch.equal(p[..., 96 * h + 32 * j:96 * h + 32 * j + 32], want), (h, j)
    assert torch.equal(buf.reshape(5, 3, 210)[..., 192:], w.reshape(5, 3, 210)[..., 192:])


@pytest.mark.parametrize("isa", SIMD)
@pytest.mark.parametrize("N, K", [(37, 9 * 256), (200, 1536)])
@pytest.mark.parametrize("M", [1, 2, 4])
def test_q6k_planes_give_the_rows_bits(ext, isa, N, K, M):
    """The avx2 level's Q6_K mat-vec over registered planes gives the rows' bits (the same integers
    and float steps), within the oracle; a change to the planes changes its result, so it reads
    them. The other levels have no plane kernel and run the rows."""
    w = random_blocks("Q6_K", N, K, seed=N + M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K + M)) * 3
    rows = hcpu.mul_mat(x, w, "Q6_K", isa=isa)
    buf = _attach_planes(ext, w)
    reads = ext.format_has_panels(hcpu._type_id("Q6_K"), hcpu._isa(isa))
    assert reads == (isa == "avx2")
    try:
        assert ext.panels_of(w, hcpu._type_id("Q6_K"))
        y = hcpu.mul_mat(x, w, "Q6_K", isa=isa)
        assert torch.equal(y, rows)
        assert_tight(y, act_dequant(ext, x, 256), gguf_dequant("Q6_K", w, K), f"planes/{isa}/{N}x{K}/M{M}")
        buf.view(N, -1)[:, 96:128] ^= 0x15  # a half's second plane: values of chunk 1 and chunk 3's bits 2-3
        assert torch.equal(hcpu.mul_mat(x, w, "Q6_K", isa=isa), rows) != reads
        hcpu.set_q6k_planes(False)
        assert not ext.panels_of(w, hcpu._type_id("Q6_K"))
        assert torch.equal(hcpu.mul_mat(x, w, "Q6_K", isa=isa), rows)
    finally:
        hcpu.set_q6k_planes(True)
        ext.drop_panels_of(w)


@pytest.mark.skipif("avx2" not in hcpu.isa_levels(), reason="the avx2 level does not run on this CPU")
@pytest.mark.parametrize("M", [1, 3])
def test_fused_ops_on_q6k_planes_equal_mul_mat(ext, M):
    """mul_mat_group (a Q4_K weight on panels beside a Q6_K one on planes, as attn_q/attn_v) and
    swiglu_mul_mat (both weights Q6_K on planes: gate's and up's ranges as one region) on the avx2
    level give mul_mat's bits, with and without the planes, and on 1 and 2 threads."""
    K, F = 1536, 384
    wq, wv = random_blocks("Q4_K", F, K, seed=31), random_blocks("Q6_K", F, K, seed=32)
    wg, wu = random_blocks("Q6_K", F, K, seed=33), random_blocks("Q6_K", F, K, seed=34)
    _attach(ext, wq)
    for w in (wv, wg, wu):
        _attach_planes(ext, w)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * 2
    bias = torch.randn(F)
    old = torch.get_num_threads()
    outs = []
    try:
        for threads, planes in ((2, True), (1, True), (2, False)):
            torch.set_num_threads(threads)
            hcpu.set_q6k_planes(planes)
            q, v = hcpu.mul_mat(x, wq, "Q4_K", isa="avx2"), hcpu.mul_mat(x, wv, "Q6_K", isa="avx2")
            ys = hcpu.mul_mat_group(x, [wq, wv], ["Q4_K", "Q6_K"], [bias, None], isa="avx2")
            assert torch.equal(ys[0], q + bias) and torch.equal(ys[1], v)
            g, u = hcpu.mul_mat(x, wg, "Q6_K", isa="avx2"), hcpu.mul_mat(x, wu, "Q6_K", isa="avx2")
            with hcpu.use_isa("avx2"), torch.inference_mode():
                fused = torch.ops.hanzo.swiglu_mul_mat(x, wg, wu, "Q6_K", "Q6_K")
                assert torch.equal(fused, torch.ops.hanzo.swiglu(g, u))
            outs.append((v, fused))
    finally:
        torch.set_num_threads(old)
        hcpu.set_q6k_planes(True)
        for w in (wq, wv, wg, wu):
            ext.drop_panels_of(w)
    assert all(torch.equal(a, outs[0][0]) and torch.equal(b, outs[0][1]) for a, b in outs[1:])


@pytest.mark.skipif("avx2" not in hcpu.isa_levels(), reason="the avx2 level does not run on this CPU")
def test_load_builds_q6k_planes_when_avx2_is_the_level(tmp_path, monkeypatch):
    """With avx2 the kernels' level at load, load(mmap=False) gives the Q6_K matrices planes beside
    the Q4_K panels; decode on avx2 reads them and gives the bits of the rows (planes switched off);
    with HANZO_CPU_Q6K_PLANES's switch off at load it builds none."""
    from gguf_builders import tiny_spec, write_tiny_gguf

    path = tmp_path / "q6k.gguf"
    qtypes = {"embd": "Q4_K", "output": "Q6_K", "attn": "Q4_K", "ffn": "Q4_K", "ffn_down": "Q6_K"}
    write_tiny_gguf(path, tiny_spec("qwen2", qtypes=qtypes, tied=False))
    ext = hcpu.extension()
    tid6 = hcpu._type_id("Q6_K")
    level = hcpu.default_isa()
    monkeypatch.setattr(hcpu, "default_isa", lambda: hcpu._isa("avx2"))
    ext.set_isa(hcpu._isa("avx2"))
    try:
        m = hanzo_torch.load(path, max_context=32, mmap=False)
        q6 = [p for p in m.parameters() if isinstance(p, GGUFTensor) and p.qtype == "Q6_K"]
        assert q6 and all(ext.panels_of(p.packed, tid6) for p in q6)
        ids = torch.tensor([[11, 22, 33]])
        with torch.inference_mode():
            a = m(ids), m(torch.tensor([[7]]))
            m.reset()
            hcpu.set_q6k_planes(False)
            b = m(ids), m(torch.tensor([[7]]))
        assert all(torch.equal(u, v) for u, v in zip(a, b))
        off = hanzo_torch.load(path, max_context=32, mmap=False)
        assert not any(ext.panels_of(p.packed, tid6) for p in off.parameters() if isinstance(p, GGUFTensor))
    finally:
        hcpu.set_q6k_planes(True)
        ext.set_isa(level)
