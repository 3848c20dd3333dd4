"""Thread splitting of the C++ CPU decode kernels (csrc/cpu/kernels_matvec.h).

The mat-vec's row tails, odd block counts and extreme integer values (saturated int16 pair sums,
sign tricks) are gated on every ISA in tests/test_conformance.py (test_mul_mat_row_and_block_tails,
test_mul_mat_extreme_values). Here: the split of rows into tasks, and of mul_mat_id's (expert,
row range) tasks into one parallel region, leaves every output bit-identical.
Tolerance: the tight oracle of tests/test_cpu_kernels.py (|y - x_hat @ W^T| <= 1e-5 * |x_hat| @ |W|^T).
"""
import pytest
import torch

from hanzo_torch.backends import cpu as hcpu
from test_cpu_kernels import act_dequant, assert_tight, gguf_dequant, qa_of, random_blocks


@pytest.fixture(scope="module")
def ext():
    e = hcpu.extension()
    assert e is not None, "the C++ CPU extension failed to build"
    return e


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
