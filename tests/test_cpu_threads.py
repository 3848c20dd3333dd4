"""Parallel regions of the C++ CPU kernels and their adaptive thread count (csrc/cpu/threading.h).

The controller runs a kernel's tasks on the calling thread alone (no fork-join) while parallel
regions keep coming out slower than that thread's own estimate of running them alone ("losses":
another process busy on the cores). Checked here: its policy on synthetic region reports (trip
after 4 losses in 16 regions that together took longer than their serial estimates, hold, probe,
doubling and reset of the hold, the off switch, the environment variable), and that no kernel's
result depends on it or on the thread count: the decode ops and the threaded prefill ops give the
same bits with 1 thread, 2 threads, and 2 threads held serial by the controller (a split that
changed a reduction would fail here).
"""
from __future__ import annotations

import time

import pytest
import torch

from hanzo_torch.backends import cpu as hcpu
from hanzo_torch.backends.cpu import fused as cf
from test_cpu_kernels import random_blocks

pytestmark = pytest.mark.skipif(not hcpu.available(), reason="C++ CPU extension could not be built")

LONG = 10_000_000_000  # ns: a hold that does not expire during a test


@pytest.fixture()
def ext():
    e = hcpu.extension()
    ranged = e.ranged_tasks()
    yield e
    e.set_adaptive_threads(True)  # defaults back
    e.set_ranged_tasks(ranged)


def loss(ext, n=1):
    for _ in range(n):  # 4 tasks in 1000 ns; the calling thread ran all 4 in 500 ns: slower than alone
        ext.report_region(1000, 4, 4, 500)


def win(ext, n=1):
    for _ in range(n):  # the calling thread ran 2 of 4 tasks in 100 ns, the region took 100 ns
        ext.report_region(100, 4, 2, 100)


def test_trips_after_four_losses_in_sixteen_regions(ext):
    ext.set_adaptive_threads(True, LONG, LONG)
    loss(ext, 3)
    win(ext, 12)
    assert ext.region_threads(2) == 2 and not ext.thread_stats()["serial"]
    before = ext.thread_stats()
    loss(ext)  # the fourth loss among the last 16
    s = ext.thread_stats()
    assert s["serial"] and s["holds"] == before["holds"] + 1
    assert ext.region_threads(2) == 1 and ext.region_threads(8) == 1
    assert ext.thread_stats()["serial_regions"] == before["serial_regions"] + 2


def test_losses_outweighed_by_the_window_do_not_trip(ext):
    """Four losses among 16 regions whose total wall time stays under their serial estimates."""
    ext.set_adaptive_threads(True, LONG, LONG)
    for _ in range(3):
        for _ in range(12):  # 2 of 4 tasks in 1000 ns, region 1000 ns: saves 1000 ns against 2000
            ext.report_region(1000, 4, 2, 1000)
        loss(ext, 4)  # each loses 500 ns: 2000 lost against 12000 saved
        assert not ext.thread_stats()["serial"] and ext.region_threads(2) == 2
    loss(ext, 12)  # now the window's losses outweigh its wins
    assert ext.thread_stats()["serial"] and ext.region_threads(2) == 1


def test_old_losses_leave_the_window(ext):
    ext.set_adaptive_threads(True, LONG, LONG)
    for _ in range(10):  # 3 losses, then 13 wins push them out of the 16-region window
        loss(ext, 3)
        win(ext, 13)
    assert not ext.thread_stats()["serial"] and ext.region_threads(2) == 2


def test_calling_thread_without_tasks_is_no_loss(ext):
    ext.set_adaptive_threads(True, LONG, LONG)
    l0 = ext.thread_stats()["losses"]
    for _ in range(8):
        ext.report_region(10_000, 4, 0, 0)
    assert ext.thread_stats()["losses"] == l0 and not ext.thread_stats()["serial"]


def test_probe_doubles_the_hold_up_to_its_cap_and_a_good_probe_resets_it(ext):
    ext.set_adaptive_threads(True, 1000, 4000)  # 1-4 us holds: expired by the next call
    holds = []
    for _ in range(4):
        loss(ext, 4)
        assert ext.thread_stats()["serial"]
        holds.append(ext.thread_stats()["hold_ns"])
        time.sleep(0.001)
        assert ext.region_threads(2) == 2  # hold over: a probe runs parallel
    assert holds == [1000, 2000, 4000, 4000]
    win(ext, 16)  # a probe without losses
    s = ext.thread_stats()
    assert s["hold_ns"] == 1000 and not s["serial"]


def test_off_switch_keeps_every_region_parallel(ext):
    ext.set_adaptive_threads(False)
    h0 = ext.thread_stats()["holds"]
    loss(ext, 32)
    s = ext.thread_stats()
    assert not s["enabled"] and not s["serial"] and s["holds"] == h0
    assert ext.region_threads(2) == 2
    hcpu.set_adaptive_threads(True)
    assert hcpu.thread_stats()["enabled"]
    with hcpu.adaptive_threads(False):
        assert not hcpu.thread_stats()["enabled"]
    assert hcpu.thread_stats()["enabled"]


def test_environment_variable(ext, monkeypatch):
    for value, on in (("0", False), ("off", False), ("1", True), ("", True)):
        monkeypatch.setenv("HANZO_CPU_ADAPTIVE_THREADS", value)
        hcpu._configure(ext)
        assert bool(hcpu.thread_stats()["enabled"]) is on, value
    monkeypatch.setenv("HANZO_CPU_ADAPTIVE_THREADS", "2")
    with pytest.raises(ValueError, match="HANZO_CPU_ADAPTIVE_THREADS"):
        hcpu.check_environment()
    with pytest.warns(RuntimeWarning, match="HANZO_CPU_ADAPTIVE_THREADS"):
        hcpu._configure(ext)
    assert hcpu.thread_stats()["enabled"]


def test_every_task_runs_whatever_the_thread_count(ext):
    """A mat-vec of many small tasks (64-byte task size) in parallel regions (the adaptive count
    off, so none runs inline): each output row is written by one task. Two inputs alternate, so a
    task dealt to no thread would leave the other input's rows (or garbage) in a recycled output
    buffer, whichever thread count and scheme deal them."""
    w = random_blocks("Q4_K", 3001, 256, seed=3)
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(1, 256, generator=g) for _ in range(2)]
    want = [hcpu.mul_mat(x, w, "Q4_K") for x in xs]
    assert not torch.equal(want[0], want[1])
    prev = torch.get_num_threads()
    ext.set_matvec_chunk_bytes(64, 1)
    ext.set_adaptive_threads(False)
    try:
        for threads in (2, 3, 7):
            torch.set_num_threads(threads)
            for ranged in (True, False):
                ext.set_ranged_tasks(ranged)
                s0 = ext.thread_stats()
                for i in range(6):
                    assert torch.equal(hcpu.mul_mat(xs[i % 2], w, "Q4_K"), want[i % 2]), (threads, ranged, i)
                s1 = ext.thread_stats()
                assert s1["parallel_regions"] - s0["parallel_regions"] == 6, (threads, ranged)
                # the regions' tails (first finish to last) are summed: threads never end on one ns
                assert s1["tail_ns"] > s0["tail_ns"] and s1["start_skew_ns"] >= s0["start_skew_ns"], (threads, ranged)
    finally:
        ext.set_matvec_chunk_bytes(262144, 4)
        torch.set_num_threads(prev)


def _kv(S, Hk, D, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, S, Hk, D, generator=g).to(torch.float16),
            torch.randn(1, S, Hk, D, generator=g).to(torch.float16))


def _ops():
    """Calls whose parallel regions hold tasks of every kind: mat-vec and GEMM rows, the fused
    SwiGLU projections, mul_mat_id's (expert, rows) tasks, decode attention's key chunks on a long
    context, prefill (flash) attention with a split key range, and a threaded rms_norm."""
    g = torch.Generator().manual_seed(7)
    K, N, F = 512, 700, 640
    w = random_blocks("Q4_K", N, K, seed=11)
    wg, wu = random_blocks("Q4_K", F, K, seed=12), random_blocks("Q6_K", F, K, seed=13)
    we = torch.stack([random_blocks("Q4_K", 200, K, seed=30 + e) for e in range(8)])
    x1, x16 = torch.randn(1, K, generator=g), torch.randn(16, K, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(3)])
    x3 = torch.randn(3, K, generator=g)
    kc, vc = _kv(1400, 2, 128, 5)
    qd = torch.randn(1, 1, 12, 128, generator=g)
    qp = torch.randn(1, 3, 12, 128, generator=g)
    xn, wn = torch.randn(300, 1024, generator=g), torch.randn(1024, generator=g)
    return [
        lambda: hcpu.mul_mat(x1, w, "Q4_K"),
        lambda: hcpu.mul_mat(x16, w, "Q4_K"),
        lambda: hcpu.swiglu_mul_mat(x1, wg, wu, "Q4_K", "Q6_K"),
        lambda: hcpu.swiglu_mul_mat(x16, wg, wu, "Q4_K", "Q6_K"),
        lambda: hcpu.mul_mat_id(x3, we, ids, "Q4_K"),
        lambda: cf.attention(qd, kc, vc, torch.tensor([[1300]]), 0.09),
        lambda: cf.attention(qp, kc, vc, torch.tensor([[3, 1300, 1301]]), 0.09),
        lambda: cf.rms_norm(xn, wn, 1e-6),
    ]


def test_results_do_not_depend_on_threads_or_the_controller(ext):
    ops = _ops()
    prev = torch.get_num_threads()
    runs = {}
    try:
        torch.set_num_threads(1)
        runs["1 thread"] = [f() for f in ops]
        torch.set_num_threads(2)
        ext.set_adaptive_threads(False)
        p0 = ext.thread_stats()["parallel_regions"]
        runs["2 threads"] = [f() for f in ops]
        assert ext.thread_stats()["parallel_regions"] - p0 >= len(ops)  # every call opened a region
        ext.set_ranged_tasks(False)
        runs["2 threads, one shared counter"] = [f() for f in ops]
        ext.set_ranged_tasks(True)
        torch.set_num_threads(5)  # uneven ranges, more threads than cores: ranges emptied by others
        runs["5 threads"] = [f() for f in ops]
        torch.set_num_threads(2)
        ext.set_adaptive_threads(True, LONG, LONG)
        loss(ext, 4)  # held serial for the rest of the test
        s0 = ext.thread_stats()["serial_regions"]
        runs["2 threads, held serial"] = [f() for f in ops]
        assert ext.thread_stats()["serial_regions"] - s0 >= len(ops)
    finally:
        torch.set_num_threads(prev)
    base = runs.pop("1 thread")
    for name, outs in runs.items():
        for i, (a, b) in enumerate(zip(base, outs)):
            assert torch.equal(a, b), (name, i)
