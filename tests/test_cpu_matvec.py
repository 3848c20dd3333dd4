"""Decode mat-vec paths of the C++ CPU kernels (csrc/cpu/kernels_matvec.h) against a float64 oracle.

The M == 1 mat-vec takes two weight rows per iteration for the 32-value formats (with a one-row
tail for an odd row count) and signed/offset int8 dot products; these tests pin down the row
tails, odd block counts, agreement with the multi-row (M > 1) tile, and the extreme integer
values where an int16 pair sum (vpmaddubsw saturates) or a sign trick could go wrong.
Tolerance: the tight oracle of tests/test_cpu_kernels.py (|y - x_hat @ W^T| <= 1e-5 * |x_hat| @ |W|^T).
"""
import gguf
import numpy as np
import pytest
import torch

from hanzo_torch.backends import cpu as hcpu
from test_cpu_kernels import ISAS, _F16_FIELDS, act_dequant, assert_tight, gguf_dequant, qa_of, random_blocks

GT = gguf.GGMLQuantizationType
# Every format with its own mat-vec hooks, plus two served by the generic unpack (TQ2_0, and
# Q1_0 with its 128-value blocks where the installed gguf knows it).
MV_QTYPES = ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "MXFP4", "Q4_1", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS",
             "TQ2_0") + tuple(q for q in ("Q1_0",) if q in hcpu.SUPPORTED_QTYPES)


@pytest.fixture(scope="module")
def ext():
    e = hcpu.extension()
    assert e is not None, "the C++ CPU extension failed to build"
    return e


@pytest.mark.parametrize("qtype", MV_QTYPES)
def test_decode_row_tails_and_odd_block_counts(ext, qtype):
    bs = qa_of(qtype)
    # 3 blocks per row: the one-block tail only; 7: one 4-block step of the 32-value formats + tail
    for nblk in (3, 7):
        x = torch.randn(2, nblk * bs)
        x_hat = act_dequant(ext, x, bs)
        for N in (1, 2, 5, 8):  # one row, one pair, pairs + tail
            w = random_blocks(qtype, N, nblk * bs, seed=N)
            wf = gguf_dequant(qtype, w, nblk * bs)
            for isa in ISAS():
                y1 = hcpu.mul_mat(x[:1], w, qtype, isa=isa, mv_max_rows=8)
                assert_tight(y1, x_hat[:1], wf, f"{qtype}/{isa}/N={N}/blocks={nblk}/M=1")
                y2 = hcpu.mul_mat(x, w, qtype, isa=isa, mv_max_rows=8)  # the 2-row tile
                assert_tight(y2, x_hat, wf, f"{qtype}/{isa}/N={N}/blocks={nblk}/M=2")
                # the two paths round differently; bound on the scale of the terms, as assert_tight
                scale = (x_hat[:1].abs().double() @ wf.abs().double().T)[0]
                assert bool(((y1[0] - y2[0]).double().abs() <= 2e-5 * scale + 1e-30).all()), (y1[0], y2[0])


def _filled_blocks(qtype: str, n_rows: int, K: int, byte: int) -> torch.Tensor:
    """Every byte = `byte` (extreme nibbles, signs, scales, high bits) except finite fp16 scales."""
    bs, ts = gguf.GGML_QUANT_SIZES[GT[qtype]]
    b = np.full((n_rows * K // bs, ts), byte, dtype=np.uint8)
    for off in _F16_FIELDS.get(qtype, ()):
        b[:, off:off + 2] = np.array([1e-2], dtype=np.float16).view(np.uint8)
    if qtype == "MXFP4":
        b[:, 0] = 121
    return torch.from_numpy(b.reshape(n_rows, -1))


@pytest.mark.parametrize("qtype", MV_QTYPES)
def test_decode_extreme_values(ext, qtype):
    """Saturated int8 activations (|xq| = 127 everywhere) against all-0x00/0x80/0xFF weight bytes
    (Q8_0 -128 and +127, Q4_0 nibbles 0 and 15, Q5_0 0 and 31, IQ4_NL -127, largest K-quant scales)."""
    bs = qa_of(qtype)
    K = 5 * bs  # a 4-block step and a one-block tail of the 32-value formats
    signs = torch.where(torch.arange(K) % 3 == 0, -1.0, 1.0)
    x = torch.stack([torch.ones(K), -torch.ones(K), signs])  # quantized to exactly +-127
    x_hat = act_dequant(ext, x, bs)
    for byte in (0x00, 0x80, 0xFF, 0x7F):
        w = _filled_blocks(qtype, 3, K, byte)
        wf = gguf_dequant(qtype, w, K)
        for isa in ISAS():
            for m in range(3):
                y = hcpu.mul_mat(x[m:m + 1], w, qtype, isa=isa, mv_max_rows=8)
                assert_tight(y, x_hat[m:m + 1], wf, f"{qtype}/{isa}/byte={byte:#x}/x{m}")


@pytest.mark.parametrize("qtype", ("Q4_K", "Q8_0"))
def test_decode_independent_of_task_split(ext, qtype):
    """The mat-vec's dynamic row split (RowSplit, ~256 KiB tasks) only partitions rows: tasks of
    one row each, or the default size, give bit-identical outputs, with 1 and 2 threads."""
    K, N = 2 * 256, 700  # > 64 KiB of weights, so the split is not serial
    w = random_blocks(qtype, N, K, seed=3)
    x = torch.randn(1, K)
    old = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for chunk in (1, 262144):
                ext.set_matvec_chunk_bytes(chunk, 1)
                outs.append(hcpu.mul_mat(x, w, qtype, mv_max_rows=8))
    finally:
        ext.set_matvec_chunk_bytes(262144, 4)
        torch.set_num_threads(old)
    wf = gguf_dequant(qtype, w, K)
    assert_tight(outs[0], act_dequant(ext, x, qa_of(qtype)), wf, f"{qtype}/split")
    for y in outs[1:]:
        assert torch.equal(y, outs[0])


@pytest.mark.parametrize("T, k", [(1, 8), (3, 2), (48, 2)])
def test_mul_mat_id_one_parallel_region_matches_per_expert_mul_mat(ext, T, k):
    """mul_mat_id runs (expert, row range) tasks of all experts in one parallel region; each
    output row must be bit-identical to mul_mat on that expert's weight alone (mat-vec for few
    rows per expert, GEMM tiles for T=48), with 1 and 2 threads and tasks of one row or default."""
    E, N, K = 8, 200, 512  # 56 KiB per expert: the region is parallel (> 64 KiB in all)
    w = torch.stack([random_blocks("Q4_K", N, K, seed=20 + e) for e in range(E)])
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    x = torch.randn(T, K, generator=g)
    want = torch.empty(T, k, N)
    for e in range(E):
        t, s = (ids == e).nonzero(as_tuple=True)
        if len(t):
            want[t, s] = hcpu.mul_mat(x[t], w[e], "Q4_K")
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for chunk in (1, 262144):
                ext.set_matvec_chunk_bytes(chunk, 1)
                assert torch.equal(hcpu.mul_mat_id(x, w, ids, "Q4_K"), want), (threads, chunk)
    finally:
        ext.set_matvec_chunk_bytes(262144, 4)
        torch.set_num_threads(old)
