"""The CPU attention kernel (flash-style tiles, csrc/cpu/fused.cpp) at its tile edges.

Prompts and single decode tokens both run it (one token: a query tile of the G heads of a group).

The kernel cuts a call into query tiles of ~48 rows (Tq = ceil(48 / G) tokens times the G query
heads of one KV head) and key tiles of 64 keys up to each query tile's largest position, with an
online softmax across key tiles; few query tiles on a long context split their key range into
units (>= 512 keys, fixed by the shapes, not the thread count) merged afterwards. The cases put every edge of that
cut under a reference: T not a multiple of Tq, key ranges ending inside a key tile (and not on a
multiple of 8), positions with gaps and out of order (rows that see none of a key tile or of a
split unit), batches at different offsets, GQA groups 1/2/6/8, head dims 64/128, KV caches
f32/f16/bf16/q8_0, the AVX2 and the scalar loops, and the earlier GEMM kernel for an A/B.

Oracle: ``attention_reference`` (eager: materialized float32 softmax) on the same cache bytes.
Tolerance as tests/test_kv_cache.py: float32 outputs rtol = atol = 1e-5 of the output's
magnitude (summation order and exp differ); bfloat16 outputs one bf16 rounding (1.6e-2). A
position off by one misses the float32 bound by more than 100x (checked below).
"""
from __future__ import annotations

import math

import pytest
import torch

from hanzo_torch.backends import cpu as hcpu
from hanzo_torch.backends.cpu import fused as cf
from hanzo_torch.ops import fused as ref

pytestmark = pytest.mark.skipif(not hcpu.available(), reason="C++ CPU extension could not be built")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def g(seed):
    return torch.Generator().manual_seed(seed)


def close(a, b, dtype):
    assert a.dtype == b.dtype == dtype and a.shape == b.shape
    tol = TOL[dtype]
    scale = float(b.float().abs().max().clamp_min(1))
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * scale)


def err(a, b):
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def inputs(B, Hq, Hk, D, S, positions, kv="f32", q_dtype=torch.float32, seed=0, kmag=1.0):
    pos = torch.as_tensor(positions)
    T = pos.shape[1]
    q = torch.randn(B, T, Hq, D, generator=g(seed)).to(q_dtype)
    kc = ref.kv_to_cache(torch.randn(B, S, Hk, D, generator=g(seed + 1)) * kmag, ref.KV_CACHE_DTYPES[kv]).contiguous()
    vc = ref.kv_to_cache(torch.randn(B, S, Hk, D, generator=g(seed + 2)), ref.KV_CACHE_DTYPES[kv]).contiguous()
    return q, kc, vc, pos


def expect(q, kc, vc, pos, scale):
    return ref.attention_reference(q, kc, vc, pos, scale, "eager")


def gapped(T, start, seed):
    """T increasing positions from ``start`` with random gaps of 0..3 slots."""
    steps = torch.randint(1, 5, (T,), generator=g(seed))
    return (start + torch.cumsum(steps, 0) - steps[0]).tolist()


# Tq = ceil(48 / G): G=1 -> 48, G=2 -> 24, G=6 -> 8, G=8 -> 6 tokens per query tile.
@pytest.mark.parametrize("G", [1, 2, 6, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kv", ["f32", "f16", "bf16", "q8_0"])
def test_tile_edges(G, D, kv):
    Hk = 2 if G < 6 else 1
    Tq = -(-48 // G)
    T = 2 * Tq + 3  # two full query tiles and a ragged one
    S = 61 + 4 * T
    # batch 0: a prompt from 0 (its last tile ends at key T, not a multiple of 64 or of 8);
    # batch 1: chunked prefill at 61 with gaps, so tiles straddle key tiles and rows skip slots
    pos = [list(range(T)), gapped(T, 61, seed=G * D)[:T]]
    assert max(pos[1]) < S and T % Tq and T % 8
    q, kc, vc, pos = inputs(2, G * Hk, Hk, D, S, pos, kv, seed=G + D)
    scale = 1 / math.sqrt(D)
    want = expect(q, kc, vc, pos, scale)
    close(cf.attention(q, kc, vc, pos, scale), want, torch.float32)
    if G == 6 and D == 128:  # the model's shape: the portable loops and a bf16 query too
        with hcpu.use_isa("scalar"):
            close(cf.attention(q, kc, vc, pos, scale), want, torch.float32)
        qb = q.bfloat16()
        close(cf.attention(qb, kc, vc, pos, scale), expect(qb, kc, vc, pos, scale), torch.bfloat16)


@pytest.mark.parametrize("T", [2, 5, 7])
def test_few_tokens(T):
    """T = 2..7 (speculative or short chunks) run the tiles too, not the one-token kernel."""
    q, kc, vc, pos = inputs(1, 12, 2, 128, 300, [list(range(290 - T, 290))], kv="f16")
    close(cf.attention(q, kc, vc, pos, 0.09), expect(q, kc, vc, pos, 0.09), torch.float32)


@pytest.mark.parametrize("kv", ["f32", "q8_0"])
def test_split_key_range_over_threads(kv):
    """One query tile on a long context: its key range is split into units run by the threads.
    Token 0 sits at position 3, so it sees none of the keys of the later unit (running maximum
    -inf there, skipped by the merge). The split depends on the shapes only: 4 threads and 1
    thread give the same bits."""
    prev = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        q, kc, vc, pos = inputs(1, 6, 1, 128, 1400, [[3, 1300, 1301]], kv=kv)
        want = expect(q, kc, vc, pos, 0.1)
        out4 = cf.attention(q, kc, vc, pos, 0.1)
        close(out4, want, torch.float32)
        torch.set_num_threads(1)
        assert torch.equal(cf.attention(q, kc, vc, pos, 0.1), out4)
    finally:
        torch.set_num_threads(prev)


def test_out_of_order_positions_and_batches():
    perm = torch.randperm(40, generator=g(5)).tolist()
    q, kc, vc, pos = inputs(3, 8, 2, 64, 420, [perm, list(range(100, 140)), gapped(40, 0, seed=9)], kv="bf16")
    close(cf.attention(q, kc, vc, pos, 0.125), expect(q, kc, vc, pos, 0.125), torch.float32)


def test_slots_past_the_positions_are_not_read():
    """Slots past a query tile's last position: NaN keys and infinite values change nothing."""
    q, kc, vc, pos = inputs(1, 6, 1, 64, 160, [list(range(20, 37))])  # keys 0..36 of tiles 0..63
    out = cf.attention(q, kc, vc, pos, 0.125)
    assert torch.isfinite(out).all()
    kc[:, 37:] = float("nan")
    vc[:, 37:] = float("inf")
    assert torch.equal(cf.attention(q, kc, vc, pos, 0.125), out)


def test_q8_0_keys_at_large_magnitude_stay_finite():
    """Scores ~1e5 with q8_0 keys and rows that see nothing of later key tiles: finite and exact."""
    q, kc, vc, pos = inputs(1, 12, 2, 128, 400, [gapped(20, 5, seed=2)], kv="q8_0", kmag=3e3)
    q = q * 100
    out = cf.attention(q, kc, vc, pos, 1 / math.sqrt(128))
    assert torch.isfinite(out).all()
    close(out, expect(q, kc, vc, pos, 1 / math.sqrt(128)), torch.float32)


def test_gemm_path_agrees_and_switch_restores():
    """The earlier GEMM-tile kernel (kept for A/B in one process) gives the same answer."""
    q, kc, vc, pos = inputs(2, 12, 2, 128, 100, [list(range(30)), list(range(40, 70))], kv="f16")
    flash = cf.attention(q, kc, vc, pos, 0.1)
    with cf.use_attention_prefill("gemm"):
        gemm = cf.attention(q, kc, vc, pos, 0.1)
    assert torch.equal(cf.attention(q, kc, vc, pos, 0.1), flash)  # flash again after the block
    want = expect(q, kc, vc, pos, 0.1)
    close(flash, want, torch.float32)
    close(gemm, want, torch.float32)
    with pytest.raises(ValueError, match="must be one of"):
        with cf.use_attention_prefill("fast"):
            pass


@pytest.mark.parametrize("D", [36, 40, 128])
@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_gemm_and_dot_scores_agree(D, kv):
    """A prompt tile's scores by the GEMM over its transposed key tile (the default, tiles of at
    least 24 rows) and by dot products over D (``flash-dot``): both within the tolerance of the
    reference, with head dims that leave a transpose remainder (36: D % 8 = 4) or not, key tiles
    ending off a multiple of 8 and tiles of both kinds (48 and 18 rows) in one call; the switch
    restores the default."""
    T = 2 * 8 + 3
    q, kc, vc, pos = inputs(1, 12, 2, D, 120, [gapped(T, 30, seed=D)], kv=kv, seed=D)
    scale = 1 / math.sqrt(D)
    want = expect(q, kc, vc, pos, scale)
    out = cf.attention(q, kc, vc, pos, scale)
    with cf.use_attention_prefill("flash-dot"):
        dot = cf.attention(q, kc, vc, pos, scale)
    close(out, want, torch.float32)
    close(dot, want, torch.float32)
    assert torch.equal(cf.attention(q, kc, vc, pos, scale), out)
    with hcpu.use_isa("scalar"):
        close(cf.attention(q, kc, vc, pos, scale), want, torch.float32)


@pytest.mark.parametrize("kv", ["f32", "f16", "bf16", "q8_0"])
def test_one_token_tiles_and_rows_kernel(kv):
    """One query token per sequence (decode): the tiles (default) and the row-by-row kernel of
    ``use_attention_decode("rows")`` against the reference, at positions that end inside a key
    tile, on a context long enough to split the key range (2 x 4 units of >= 512 keys), batch
    rows at different depths; threads 4 and 1 give the same bits."""
    prev = torch.get_num_threads()
    try:
        q, kc, vc, pos = inputs(2, 12, 2, 128, 2200, [[2100], [77]], kv=kv)
        want = expect(q, kc, vc, pos, 0.09)
        torch.set_num_threads(4)
        tiles = cf.attention(q, kc, vc, pos, 0.09)
        with cf.use_attention_decode("rows"):
            rows = cf.attention(q, kc, vc, pos, 0.09)
        close(tiles, want, torch.float32)
        close(rows, want, torch.float32)
        torch.set_num_threads(1)
        assert torch.equal(cf.attention(q, kc, vc, pos, 0.09), tiles)  # the tiles again after the block
    finally:
        torch.set_num_threads(prev)
    with pytest.raises(ValueError, match="must be one of"):
        with cf.use_attention_decode("fast"):
            pass


@pytest.mark.parametrize("G,D", [(1, 64), (4, 128), (5, 64), (8, 128), (12, 64), (6, 40)])
def test_one_token_f16_cache_in_place(G, D):
    """f16 caches at decode are read in place by the f16 tiles (query tiles of <= 12 rows, D a
    multiple of 16: 6-row tiles and a remainder of 1..5 rows); D = 40 takes the float32 copy.
    Odd key counts (the 2-key score tiles' single last key), key ranges ending inside a key tile,
    two batch rows, and two tokens (12 or more rows: the tiles of a prompt)."""
    Hk = 2
    q, kc, vc, pos = inputs(2, G * Hk, Hk, D, 700, [[600], [130]], kv="f16", seed=G * D)
    close(cf.attention(q, kc, vc, pos, 0.1), expect(q, kc, vc, pos, 0.1), torch.float32)
    q2, kc, vc, pos2 = inputs(1, G * Hk, Hk, D, 300, [[200, 201]], kv="f16", seed=G + D)
    close(cf.attention(q2, kc, vc, pos2, 0.1), expect(q2, kc, vc, pos2, 0.1), torch.float32)


def test_tolerance_catches_a_wrong_position():
    q, kc, vc, pos = inputs(1, 12, 2, 128, 100, [list(range(20, 45))], kv="q8_0")
    good = expect(q, kc, vc, pos, 0.1)
    assert err(cf.attention(q, kc, vc, pos, 0.1), good) < TOL[torch.float32]
    assert err(expect(q, kc, vc, pos - 1, 0.1), good) > 100 * TOL[torch.float32]


# ------------------------------------------------------------------------------------ model
@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    from tests.gguf_builders import tiny_spec, tokenizer_metadata, write_tiny_gguf

    path = tmp_path_factory.mktemp("flash") / "qwen2.gguf"
    # GQA 6 as the 1.5B model (6 query heads on 1 KV head), head dim 64; F32 weights, so the
    # projections are float32 GEMMs (no int8 activation rounding to amplify small differences)
    spec = tiny_spec("qwen2", hidden=384, n_head=6, n_head_kv=1, ffn=256)
    return write_tiny_gguf(path, spec, tokenizer_metadata(full=False))


@pytest.mark.slow  # ~25 s on 2 cores: three forwards through a float32 151936 x 384 LM head per path
def test_model_logits_flash_gemm_reference(tiny_qwen2):
    """A prompt (T = 40), a 3-token chunk and a decode step through the whole model: the logits with
    the flash tiles, with the GEMM tiles and with the reference attention agree to 1e-4 of the
    largest logit (float32 throughout; the attention kernels differ by float32 rounding only)."""
    import hanzo_torch

    model = hanzo_torch.load(tiny_qwen2, max_context=64, dtype=torch.float32, kv_dtype="f32")
    ids = torch.randint(100, 5000, (1, 44), generator=g(11))

    def run():
        model.reset()
        with torch.inference_mode():
            out = [model(ids[:, :40], last_only=True), model(ids[:, 40:43], last_only=True),
                   model(ids[:, 43:44], last_only=True)]
        return torch.cat(out, dim=1)

    flash = run()
    with cf.use_attention_prefill("gemm"):
        gemm = run()
    with hanzo_torch.ops.use_reference("attention"):
        want = run()
    assert err(flash, want) < 1e-4 and err(gemm, want) < 1e-4, (err(flash, want), err(gemm, want))
