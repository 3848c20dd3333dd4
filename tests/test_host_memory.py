"""host_memory: the mmap decision of load() and the huge-page copies of packed weights."""
from __future__ import annotations

import mmap

import pytest
import torch

from hanzo_torch import host_memory
from hanzo_torch.host_memory import copy_packed, mem_available, resolve_mmap, thp_mode

GIB = 2**30


@pytest.mark.parametrize("text, mode", [
    ("always [madvise] never\n", "madvise"),
    ("[always] madvise never\n", "always"),
    ("always madvise [never]\n", "never"),
    ("garbage\n", None),
])
def test_thp_mode_reads_the_bracketed_word(tmp_path, text, mode):
    p = tmp_path / "enabled"
    p.write_text(text)
    assert thp_mode(str(p)) == mode


def test_thp_mode_and_mem_available_of_missing_files(tmp_path):
    assert thp_mode(str(tmp_path / "absent")) is None
    assert mem_available(str(tmp_path / "absent")) is None


def test_mem_available_parses_meminfo(tmp_path):
    p = tmp_path / "meminfo"
    p.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   12345678 kB\n")
    assert mem_available(str(p), str(tmp_path / "nocg")) == 12345678 * 1024
    p.write_text("MemTotal:       24000000 kB\n")
    assert mem_available(str(p), str(tmp_path / "nocg")) is None


@pytest.mark.parametrize("mmap, nbytes, thp, avail, mapped", [
    (True, 10 * GIB, "always", 1 * GIB, True),       # asked for: kept mapped whatever the memory
    (False, 1 * GIB, "never", 8 * GIB, False),       # asked for: copied even without huge pages
    (None, 1 * GIB, "madvise", 8 * GIB, False),      # default: huge pages on, fits in half
    (None, 1 * GIB, "always", 8 * GIB, False),
    (None, 5 * GIB, "madvise", 8 * GIB, True),       # more than half the available memory
    (None, 1 * GIB, "never", 8 * GIB, True),         # no huge pages: nothing to gain
])
def test_resolve_mmap_decisions(mmap, nbytes, thp, avail, mapped):
    assert resolve_mmap(mmap, nbytes, thp=thp, available=avail) is mapped


def test_resolve_mmap_default_keeps_mapping_when_memory_or_thp_is_unknown(monkeypatch):
    monkeypatch.setattr(host_memory, "mem_available", lambda: None)
    assert resolve_mmap(None, 1, thp="madvise") is True
    monkeypatch.setattr(host_memory, "mem_available", lambda: 8 * GIB)
    monkeypatch.setattr(host_memory, "thp_mode", lambda: None)  # not Linux
    assert resolve_mmap(None, 1) is True
    monkeypatch.setattr(host_memory, "thp_mode", lambda: "madvise")
    assert resolve_mmap(None, 1) is False


def test_resolve_mmap_errors():
    with pytest.raises(TypeError, match="load: mmap must be None, True or False, got int 1"):
        resolve_mmap(1, 10)
    with pytest.raises(MemoryError, match=r"x: mmap=False needs 2.00 GiB .* 1.00 GiB available"):
        resolve_mmap(False, 2 * GIB, available=GIB, where="x")


def test_copy_packed_copies_bytes_into_page_aligned_tensors():
    g = torch.Generator().manual_seed(0)
    src = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=g) for shape in ((3, 144), (5000,), (0, 8), (2, 2, 210))]
    out = copy_packed(src)
    assert len(out) == len(src)
    for a, b in zip(src, out):
        assert b.shape == a.shape and b.dtype == torch.uint8 and torch.equal(a, b)
        if b.numel():
            assert b.data_ptr() % mmap.PAGESIZE == 0 and b.data_ptr() != a.data_ptr()
    first = out[0].data_ptr()
    assert first % host_memory.huge_page_bytes() == 0  # the mapping starts on a huge page
    out[1][0] = out[1][0] ^ 1  # copies, not views: the sources keep their bytes
    assert not torch.equal(out[1], src[1])


def test_copies_own_their_bytes_and_keep_the_mapping_alive():
    """Each copy's storage holds its own bytes only (saving one saves only it), and the copies stay
    readable after copy_packed returns, its local mapping object gone, and a collection."""
    import gc

    src = [torch.arange(100, dtype=torch.uint8), torch.arange(5000, dtype=torch.int64).to(torch.uint8)]
    seen = []
    copies = copy_packed(src, done=seen.append)
    assert [s is t for s, t in zip(seen, src)] == [True, True]  # done() once per source, in order
    assert [c.untyped_storage().nbytes() for c in copies] == [100, 5000]
    gc.collect()
    assert torch.equal(copies[0], src[0]) and torch.equal(copies[1], src[1])


def test_huge_page_bytes_reads_the_kernel_value(tmp_path):
    p = tmp_path / "hpage_pmd_size"
    p.write_text("33554432\n")
    assert host_memory.huge_page_bytes(str(p)) == 32 << 20
    assert host_memory.huge_page_bytes(str(tmp_path / "absent")) == 2 << 20


def test_mem_available_takes_a_cgroup_limit(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemAvailable:   8000000 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    assert mem_available(str(info), str(cg)) == 8000000 * 1024  # no limit files
    (cg / "memory.max").write_text("max\n")
    (cg / "memory.current").write_text("1000\n")
    assert mem_available(str(info), str(cg)) == 8000000 * 1024  # "max": no limit
    (cg / "memory.max").write_text(str(3 << 30) + "\n")
    (cg / "memory.current").write_text(str(1 << 30) + "\n")
    assert mem_available(str(info), str(cg)) == 2 << 30


def test_copy_packed_refuses_other_tensors():
    with pytest.raises(ValueError, match="copy_packed: need uint8 CPU tensors, got torch.float32"):
        copy_packed([torch.zeros(4)])
