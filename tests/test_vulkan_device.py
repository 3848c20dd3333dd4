"""The "vulkan" torch device (csrc/vulkan/runtime_*.cpp, device.cpp) on whatever Vulkan device is here
(lavapipe, Mesa's CPU Vulkan, in CI): copies, views, casts, fill, the native glue ops, the CPU
fallback, out-of-memory errors, the status without a driver, profile counters.

Every result is compared with the same computation on CPU tensors; skipped, with the backend's
reason, where the backend cannot run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from hanzo_torch.backends import vulkan

if not vulkan.available():
    pytest.skip(f"vulkan backend unavailable: {vulkan.reason()}", allow_module_level=True)

VK = torch.device("vulkan")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.int8,
          torch.bool, torch.int16, torch.float64, torch.complex64]


def _sample(dtype, shape=(5, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        x = (torch.randn(shape, generator=g) * 100).to(dtype)
        x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]).to(dtype)
        return x
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=dtype)


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype.is_floating_point or a.dtype.is_complex:
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_round_trip(dtype):
    x = _sample(dtype)
    v = x.to("vulkan")
    assert v.device.type == "vulkan" and v.dtype == dtype and v.shape == x.shape
    _same_bits(v.cpu(), x)
    _same_bits(v.clone().cpu(), x)  # device -> device copy
    assert v.data_ptr() % 256 == 0  # the buffer device address of element 0


def test_views_and_strided_copies():
    x = torch.arange(6 * 8 * 5, dtype=torch.float32).reshape(6, 8, 5)
    v = x.to(VK)
    views = [
        lambda t: t.transpose(0, 2),
        lambda t: t[1:5:2, ::3],
        lambda t: t.permute(2, 0, 1)[:, 3],
        lambda t: t[:, :1].expand(6, 4, 5),
        lambda t: t.narrow(1, 2, 3).unsqueeze(0),
        lambda t: t.view(48, 5)[7:20].t(),
        lambda t: t.reshape(-1)[3:17],
    ]
    for i, f in enumerate(views):
        want = f(x)
        got = f(v)
        assert got.data_ptr() == v.data_ptr() + want.storage_offset() * 4, i  # views are pointer arithmetic
        assert torch.equal(got.cpu(), want), i
        assert torch.equal(got.contiguous().cpu(), want.contiguous()), i
        assert got.contiguous().is_contiguous()
    # writes through strided views: from the CPU, from the device, and a cast on the way
    w, c = v.clone(), x.clone()
    w[:, 2:6, 1] = torch.full((6, 4), -1.0)
    c[:, 2:6, 1] = -1.0
    w[::2, :, 3] = v[1::2, :, 0].to(torch.float16)
    c[::2, :, 3] = c[1::2, :, 0].half().float()
    w.transpose(0, 1)[3] = w.transpose(0, 1)[0]
    c.transpose(0, 1)[3] = c.transpose(0, 1)[0]
    assert torch.equal(w.cpu(), c)


CASTS = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]


def test_casts_on_the_device():
    before = set(vulkan.fallback_ops())
    g = torch.Generator().manual_seed(1)
    for src in CASTS:
        for dst in CASTS:
            if src.is_floating_point:
                # values that need rounding to f16/bf16, subnormals, overflow; no negatives into uint8
                x = torch.cat([torch.randn(200, generator=g) * 300, torch.randn(50, generator=g) * 1e-6,
                               torch.tensor([70000.0, -70000.0, 65519.0, 65520.0, 1e-8, 3e38])])
                if dst == torch.uint8:
                    x = x.abs().clamp(max=255)
                elif not dst.is_floating_point:
                    x = x.clamp(-6e4, 6e4)  # finite in f16 (float -> int of inf is undefined in C)
                x = x.to(src)
            else:
                x = torch.randint(0, 250, (300,), generator=g).to(src)
            got = x.to(VK).to(dst).cpu()
            _same_bits(got, x.to(dst))
            # strided source
            _same_bits(x.to(VK)[::3].to(dst).cpu(), x[::3].to(dst))
    assert set(vulkan.fallback_ops()) == before  # no cast went through the CPU fallback


def test_zeros_ones_full_fill_arange():
    for dt in [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.int16]:
        assert torch.equal(torch.zeros(3, 5, dtype=dt, device=VK).cpu(), torch.zeros(3, 5, dtype=dt))
        assert torch.equal(torch.ones(7, dtype=dt, device=VK).cpu(), torch.ones(7, dtype=dt))
    _same_bits(torch.full((3, 3), 0.1, dtype=torch.float16, device=VK).cpu(), torch.full((3, 3), 0.1, dtype=torch.float16))
    _same_bits(torch.full((5,), -3, dtype=torch.int64, device=VK).cpu(), torch.full((5,), -3, dtype=torch.int64))
    v, c = torch.zeros(4, 6, device=VK), torch.zeros(4, 6)
    v[:, 1].fill_(2.5)   # a strided fill
    c[:, 1].fill_(2.5)
    v[2].fill_(torch.tensor(7.0))
    c[2].fill_(7.0)
    assert torch.equal(v.cpu(), c)
    u = torch.zeros(3, dtype=torch.uint8, device=VK)  # 3 bytes: not a whole 32-bit word
    u.fill_(9)
    assert torch.equal(u.cpu(), torch.full((3,), 9, dtype=torch.uint8))
    assert torch.equal(torch.arange(10, device=VK).cpu(), torch.arange(10))
    assert torch.equal(torch.arange(2, 11, 3, device=VK).cpu(), torch.arange(2, 11, 3))
    assert torch.equal(torch.arange(0, 1, 0.25, device=VK).cpu(), torch.arange(0, 1, 0.25))
    assert torch.arange(5, device=VK)[3].item() == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_add_sub_mul_sum(dtype):
    g = torch.Generator().manual_seed(2)
    a = torch.randn(2, 3, 8, generator=g).to(dtype)
    b = torch.randn(8, generator=g).to(dtype)
    c = torch.randn(2, 1, 8, generator=g).to(dtype)
    va, vb, vc = a.to(VK), b.to(VK), c.to(VK)
    before = set(vulkan.fallback_ops())
    # float32 maths rounded once, as torch's CPU kernels: bit-identical
    for got, want in [(va + vb, a + b), (va - vc, a - c), (va * vc, a * c), (vb * va, b * a),
                      (va + 1, a + 1), (2.5 * va, 2.5 * a), (va - 0.5, a - 0.5), (va + vb * 1.0, a + b),
                      (va.transpose(0, 2) * vb.view(8, 1, 1), a.transpose(0, 2) * b.view(8, 1, 1)),
                      (va * va.float(), a * a.float())]:
        assert got.device.type == "vulkan"
        _same_bits(got.cpu(), want)
    # alpha: one fused multiply-add here; torch's CPU kernels may round alpha * b first (an ulp apart)
    torch.testing.assert_close(torch.add(va, vc, alpha=3).cpu(), torch.add(a, c, alpha=3), rtol=2 ** -7, atol=2 ** -5)
    torch.testing.assert_close(torch.sub(va, vb, alpha=2).cpu(), torch.sub(a, b, alpha=2), rtol=2 ** -7, atol=2 ** -5)
    x, y = va.clone(), a.clone()
    x.add_(vb)
    y.add_(b)
    x.mul_(vc)
    y.mul_(c)
    x.sub_(1)
    y.sub_(1)
    _same_bits(x.cpu(), y)
    assert set(vulkan.fallback_ops()) == before
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for dims, keep in [((1,), False), ((0, 2), True), ((-1,), False), (None, False)]:
        want = a.float().sum(dim=dims, keepdim=keep).to(dtype) if dims else a.float().sum().to(dtype)
        got = va.sum(dim=dims, keepdim=keep) if dims else va.sum()
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.cpu().float(), want.float(), **tol)
    # the MoE combine of the model: y [N, k, H] * w [N, k, 1] summed over k
    w = torch.rand(2, 3, generator=g)
    got = (va * w.to(VK).unsqueeze(-1).to(dtype)).sum(dim=1)
    torch.testing.assert_close(got.cpu().float(), (a * w.unsqueeze(-1).to(dtype)).float().sum(1), **tol)


def test_integer_ops():
    p = torch.arange(6, device=VK) + 17  # the model's positions
    assert p.dtype == torch.int64 and torch.equal(p.cpu(), torch.arange(6) + 17)
    q = p.unsqueeze(0).expand(2, 6)
    assert torch.equal((q * 3 - p).cpu(), torch.arange(6).unsqueeze(0).expand(2, 6) * 2 + 34)
    assert torch.equal(q.sum(dim=1).cpu(), torch.tensor([117, 117]))
    i = torch.tensor([1, 2, 3], dtype=torch.int32, device=VK)
    assert torch.equal((i + 1).cpu(), torch.tensor([2, 3, 4], dtype=torch.int32))
    assert (i * i).sum().item() == 14


def test_ordering_across_submits_and_host_writes():
    """Dependent ops past the auto-submit threshold, and a host write while work is in flight."""
    x = torch.ones(1000, device=VK)
    for _ in range(300):
        x = x * 2 - 1  # stays 1: any missing barrier gives another value
    y = x + 1  # recorded, not run
    x.copy_(torch.full((1000,), 5.0))  # must not change what y reads
    assert torch.equal(y.cpu(), torch.full((1000,), 2.0))
    assert torch.equal(x.cpu(), torch.full((1000,), 5.0))
    vulkan.synchronize()
    torch.vulkan.synchronize()


def test_caching_allocator_reuses_blocks():
    for n in (1000, 3_000_000):  # a small block and a dedicated one
        torch.empty(n, device=VK)  # freed at once
        before = vulkan.memory_stats()["device_allocations"]
        for _ in range(5):
            t = torch.empty(n, device=VK)
            del t
        assert vulkan.memory_stats()["device_allocations"] == before


def test_cpu_fallback_warns_once_per_op():
    x = torch.linspace(-2, 2, 9)
    v = x.to(VK)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        r1 = torch.special.erfcx(v)
        r2 = torch.special.erfcx(v * 2)
    msgs = [str(m.message) for m in w if "erfcx" in str(m.message)]
    assert len(msgs) == 1 and "no vulkan kernel" in msgs[0], msgs
    assert r1.device.type == "vulkan"
    torch.testing.assert_close(r1.cpu(), torch.special.erfcx(x))
    torch.testing.assert_close(r2.cpu(), torch.special.erfcx(x * 2))
    assert any("erfcx" in op for op in vulkan.fallback_ops())


def test_out_of_memory_is_an_error_and_the_process_goes_on():
    with pytest.raises(RuntimeError, match=r"tried to allocate 1125899906842624 bytes .* on "):
        torch.empty(2 ** 50, dtype=torch.uint8, device=VK)
    with pytest.raises(torch.OutOfMemoryError, match="Vulkan out of memory"):
        torch.zeros(2 ** 48, device=VK)
    assert torch.equal((torch.ones(4, device=VK) * 3).cpu(), torch.full((4,), 3.0))


def _children(*runs):
    """Run ``(code, env)`` pairs as child processes at once (each imports torch: seconds); their results."""
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT, env={**os.environ, **env}) for code, env in runs]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        results.append((p.returncode, out, err))
    return results


def test_status_without_a_driver_and_with_a_bad_device_index():
    """With no ICD the backend reports why, and the rest of the package works; a device index
    beyond the devices is named."""
    bogus = os.path.join(ROOT, "no-such-icd.json")
    no_driver = ("import json, torch, hanzo_torch\n"
                 "from hanzo_torch.backends import vulkan\n"
                 "st = vulkan.status()\n"
                 "y = hanzo_torch.dequantize(hanzo_torch.quantize(torch.ones(2, 32), 'Q8_0'), 'Q8_0', (2, 32))\n"
                 "print(json.dumps({'available': st['available'], 'reason': st['reason'],"
                 " 'ok': bool(((y - 1).abs() < 1e-2).all()),"
                 " 'listed': [s.name for s in hanzo_torch.backends.status() if s.name == 'vulkan' and not s.available]}))\n")
    bad_index = "from hanzo_torch.backends import vulkan\nprint(vulkan.available(), vulkan.reason())\n"
    (rc1, out1, err1), (rc2, out2, err2) = _children((no_driver, dict(VK_ICD_FILENAMES=bogus, VK_DRIVER_FILES=bogus)),
                                                     (bad_index, dict(HANZO_VK_DEVICE="99")))
    assert rc1 == 0, err1[-2000:]
    st = json.loads(out1.strip().splitlines()[-1])
    assert st["available"] is False and st["ok"] is True and st["listed"] == ["vulkan"]
    assert "no Vulkan device" in st["reason"] or "no usable driver" in st["reason"], st["reason"]
    assert rc2 == 0, err2[-2000:]
    assert out2.startswith("False HANZO_VK_DEVICE=99: expected a device index"), out2


def test_profile_counters():
    x = torch.ones(64, device=VK)
    vulkan.synchronize()
    vulkan.set_profiling(True)
    try:
        for _ in range(5):
            x = x * 2 + 1
        x.cpu()
        p = vulkan.profile()
        again = vulkan.profile()
    finally:
        vulkan.set_profiling(bool(os.environ.get("HANZO_VK_PROFILE", "") not in ("", "0")))
    assert vulkan.profiling() is (os.environ.get("HANZO_VK_PROFILE", "") not in ("", "0"))
    # 10 dependent dispatches (the scalars 2 and 1 are 2 fills each time): a barrier before each but the first
    assert p["dispatches"] == 10 and p["barriers"] >= 9 and p["submits"] >= 1, p
    assert p["record_us"] > 0 and p["fence_wait_us"] > 0 and p["submit_us"] > 0, p
    assert again["dispatches"] == 0 and again["barriers"] == 0  # profile() resets
