"""The MPS backend (hanzo_torch/backends/mps) on a machine without Metal.

- the backend says why it cannot run here, and serves the "mps" device type on the contract;
- the generated Metal sources are those of the committed manifest (``generate --check``);
- every kernel's Metal signature is what the launch code binds (buffer indices, types, sizes);
- the Mac launch path (:class:`~hanzo_torch.backends.mps.metal.MetalRunner`) against a recording
  stand-in for ``torch.mps.compile_shader``: every call checked against the parsed kernel
  signature, then run on the harness, so each op's Mac path gives the reference's result;
- the harness catches what it must: a deliberately broken kernel fails the conformance bound by
  orders of magnitude, an out-of-bounds access raises :class:`~hanzo_torch.backends.mps.sim.KernelFault`;
- a whole model (tiny qwen3 and qwen3moe) with every ``hanzo`` op on the harness gives the CPU's
  greedy tokens.

The per-op, per-format conformance of the kernels is backend ``mps-sim`` of tests/test_conformance.py.
"""
from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import hanzo_torch
from hanzo_torch import backends
from hanzo_torch.backends.base import QUANT_OPS
from hanzo_torch.backends.mps import generate, launch, sim
from hanzo_torch.backends.mps.metal import MetalRunner
from hanzo_torch.backends.triton._testing import random_packed

ROOT = Path(__file__).resolve().parents[1]
HARNESS = sim.reason()
needs_harness = pytest.mark.skipif(HARNESS is not None, reason=f"mps-sim harness unavailable: {HARNESS}")

APPLE_THREADGROUP_BYTES = 32768
"""Threadgroup memory of every Apple GPU family (Metal feature set tables)."""


def test_backend_serves_mps_and_says_why_it_cannot_run_here():
    b = backends.backend("mps")
    assert backends.for_device("mps") is b and b.dispatch_key == "MPS"
    assert b.defaults.activations == torch.float16
    assert set(b.op_formats) == set(QUANT_OPS) and all(f == frozenset(launch.formats()) for f in b.op_formats.values())
    if sys.platform != "darwin":
        assert b.reason().startswith("not macOS")
        st = b.status()
        assert st["available"] is False and st["formats"] == () and st["kernels"] == len(generate.manifest()["kernels"])
        assert b.register() == frozenset()
        with pytest.raises(RuntimeError, match="mps device is unavailable: not macOS"):
            hanzo_torch.load(str(ROOT / "no-such-file.gguf"), device="mps")
    # every op the Vulkan backend has a kernel for has Metal launch code (its shaders are these kernels)
    vk = set()
    for f in (ROOT / "csrc" / "vulkan").glob("ops_*.cpp"):
        vk |= set(re.findall(r'm\.impl\("(\w+)"', f.read_text()))
    assert vk and set(launch.OPS) == vk
    assert set(launch.formats()) == set(generate._vulkan().rule_formats())


def test_cli_device_mps_says_why():
    p = subprocess.run([sys.executable, "-m", "hanzo_torch.cli", "generate", "--device", "mps", "--model", "x.gguf",
                        "-p", "hi"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if sys.platform != "darwin":
        assert p.returncode != 0 and "mps device is unavailable: not macOS" in p.stderr, p.stderr[-2000:]


@needs_harness
def test_generated_sources_match_the_committed_manifest():
    """The translation of this checkout (cached by the key of the shaders, the generator and the
    tools; a cold cache translates everything, ~30 s on 2 cores) is the committed manifest."""
    assert generate.check(cached=True) == []


@pytest.mark.slow
@needs_harness
def test_generate_check_cli():
    p = subprocess.run([sys.executable, "-m", "hanzo_torch.backends.mps.generate", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "up to date" in p.stderr, p.stderr[-3000:]


def _signature(text: str, entry: str) -> list:
    """``[(address space, type, ref, name, buffer index)]`` of a kernel's buffer arguments."""
    m = re.search(r"^kernel void " + re.escape(entry) + r"\((.*)\)$", text, re.M)
    assert m, entry
    out = []
    for a in m.group(1).split(", "):
        am = re.match(r"(?:volatile )?(constant|device) (\w+)([&*]) (\w+) \[\[buffer\((\d+)\)\]\]$", a.strip())
        if am:
            out.append((am.group(1), am.group(2), am.group(3), am.group(4), int(am.group(5))))
        else:
            assert re.match(r"uint3 \w+ \[\[\w+\]\]$", a.strip()), (entry, a)
    return out


def _local(text: str) -> tuple:
    m = re.search(r"gl_WorkGroupSize \[\[maybe_unused\]\] = uint3\((\d+)u, (\d+)u, (\d+)u\);", text)
    return tuple(int(v) for v in m.groups())


@needs_harness
def test_every_kernel_signature_is_what_the_launch_code_binds():
    src = generate.ensure_sources()
    kernels = generate.manifest()["kernels"]
    assert {s["shader"] for s in kernels.values()} == set(generate.SHADERS)
    for entry, sig in kernels.items():
        text = (src / f"{entry}.metal").read_text()
        args = _signature(text, entry)
        assert [a[4] for a in args] == list(range(len(args))) == [b[1] for b in sig["buffers"]], entry
        assert args[0][:3] == ("constant", "Push", "&"), entry
        for (space, _, ref, name, _), (bname, _, kind) in zip(args[1:], sig["buffers"][1:]):
            assert space == "device" and name in (bname, bname + "_buf"), (entry, name)
            assert (ref, kind) in (("*", "pointer"), ("&", "storage")), (entry, name)
        assert _local(text) == tuple(sig["local"]) and sig["local"][0] * sig["local"][1] * sig["local"][2] <= 1024
        assert sig["threadgroup_bytes"] <= APPLE_THREADGROUP_BYTES, entry
        assert "reinterpret_cast<device" in text or sig["shader"] == "mul_mat_id_sort", entry


class _Recorder:
    """A stand-in for ``torch.mps.compile_shader``: parses each source's kernel signature and
    checks every call against it (argument count, order and types, push-constant size, whole
    threadgroups of the kernel's size), records it, then runs it on the harness."""

    def __init__(self):
        self.calls = []
        self.compiled = 0
        self.runner = sim.SimRunner()
        self.kernels = generate.manifest()["kernels"]

    def __call__(self, source: str):
        self.compiled += 1
        rec = self

        class Lib:
            def __getattr__(self, entry):
                sig = rec.kernels[entry]
                args = _signature(source, entry)
                local = _local(source)

                def call(*tensors, threads, group_size):
                    assert len(tensors) == len(args), (entry, len(tensors), len(args))
                    assert all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in tensors), entry
                    assert tensors[0].dtype == torch.uint8 and tensors[0].numel() == sig["push_size"], entry
                    assert tuple(group_size) == local and len(threads) == 3, entry
                    assert all(t % g == 0 and t > 0 for t, g in zip(threads, group_size)), (entry, threads)
                    groups = tuple(t // g for t, g in zip(threads, group_size))
                    rec.calls.append((entry, groups))
                    rec.runner.run(sig, bytes(tensors[0].tolist()), list(tensors[1:]), groups)

                return call

        return Lib()


def _op_calls():
    """(op, args) covering every shader family of the manifest through the launch code."""
    g = torch.Generator().manual_seed(0)

    def rn(*s, dtype=torch.float32):
        return torch.randn(*s, generator=g).to(dtype)

    w = random_packed("Q4_K", (20, 256), seed=1)
    w3 = random_packed("IQ2_XXS", (4, 6, 256), seed=2)
    kc, vc = rn(2, 80, 2, 32), rn(2, 80, 2, 32)
    pos1 = torch.tensor([[40], [79]])
    pos9 = torch.arange(9)[None].repeat(2, 1)
    return [
        ("dequantize", (w, "Q4_K", [20, 256], torch.float16)),
        ("get_rows", (w3.reshape(24, -1), torch.tensor([3, 0, 23]), "IQ2_XXS", torch.float32)),
        ("mul_mat", (rn(3, 256), w, "Q4_K")),                      # mul_mat_vec
        ("mul_mat", (rn(11, 256, dtype=torch.bfloat16), w, "Q4_K")),  # mul_mat (GEMM)
        ("mul_mat_id", (rn(2, 256), w3, torch.tensor([[0, 3], [2, 2]]), "IQ2_XXS")),
        ("mul_mat_id", (rn(10, 2, 256), w3, torch.randint(0, 4, (10, 2), generator=g), "IQ2_XXS")),  # sorted
        ("swiglu_mul_mat", (rn(2, 256), w, w, "Q4_K", "Q4_K")),    # swiglu_mul_mat_vec
        ("swiglu_mul_mat", (rn(12, 256), w, w, "Q4_K", "Q4_K")),   # two GEMMs and the epilogue
        ("quantize_q8_1", (rn(3, 64),)),
        ("rms_norm", (rn(3, 100), rn(100), 1e-6)),
        ("add_rms_norm", (rn(3, 100), rn(3, 100), rn(100), 1e-6)),
        ("swiglu", (rn(5, 33), rn(5, 33))),
        ("qk_norm_rope", (rn(2, 3, 4, 32), rn(2, 3, 2, 32), rn(32), rn(32), torch.tensor([[0, 5, 9], [1, 2, 3]]),
                          1e6, 1e-6)),
        ("kv_cache_write", (kc.clone(), vc.clone(), rn(2, 1, 2, 32), rn(2, 1, 2, 32), pos1)),
        ("qk_norm_rope_kv_write", (rn(2, 1, 4, 32), rn(2, 1, 2, 32), rn(2, 1, 2, 32), None, None, kc.clone(),
                                   vc.clone(), pos1, 1e6, 1e-6)),
        ("attention", (rn(2, 1, 4, 32), kc, vc, pos1, 0.2, "auto")),   # decode, keys split
        ("attention", (rn(2, 9, 4, 32), kc, vc, pos9, 0.2, "auto")),   # prefill
        ("moe_route", (rn(7, 16), 3, True)),
    ]


def _truth(op, args):
    """float64 results of the contractions from the dequantized weights (the op references
    quantize the activations as the CPU kernels do; these kernels are float)."""
    if op not in ("mul_mat", "mul_mat_id", "swiglu_mul_mat"):
        return getattr(torch.ops.hanzo_ref, op)(*args)

    def dense(w, q):
        return torch.ops.hanzo_ref.dequantize(w, q, [*w.shape[:-1], args[0].shape[-1]], torch.float32).double()

    x = args[0].double()
    if op == "mul_mat":
        return x @ dense(args[1], args[2]).t()
    if op == "swiglu_mul_mat":
        return torch.nn.functional.silu(x @ dense(args[1], args[3]).t()) * (x @ dense(args[2], args[4]).t())
    w, ids = dense(args[1], args[3]), args[2]
    xs = x.unsqueeze(1).expand(ids.shape[0], ids.shape[1], x.shape[-1]) if x.dim() == 2 else x
    return torch.einsum("tsk,tsnk->tsn", xs, w[ids])


def _close(got, want):
    if isinstance(want, (tuple, list)):
        for a, b in zip(got, want):
            _close(a, b)
        return
    if want.dtype in (torch.int64, torch.uint8):
        assert torch.equal(got, want)
        return
    # float16/bfloat16 results, and the q8_1 activations of the int8 path, within 2% of the largest
    # value; a wrong buffer, offset or threadgroup count is off by far more
    torch.testing.assert_close(got.double(), want.double(), rtol=2e-2,
                               atol=2e-2 * max(1.0, want.abs().max().item()), check_dtype=False)


@needs_harness
def test_mac_launch_path_against_a_recording_compile_shader():
    rec = _Recorder()
    runner = MetalRunner(torch.device("cpu"), compile=rec)
    for op, args in _op_calls():
        mine = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        ref = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        n = len(rec.calls)
        got = launch.OPS[op](runner, *mine)
        want = _truth(op, ref)
        assert len(rec.calls) > n, f"{op} launched no kernel"
        if op in ("kv_cache_write", "qk_norm_rope_kv_write"):  # the caches, written in place
            i = 0 if op == "kv_cache_write" else 5
            _close(mine[i:i + 2], ref[i:i + 2])
        if got is not None:
            _close(got, want)
    with launch.use_int8(True):
        x, w = torch.randn(12, 256), random_packed("Q8_0", (8, 256), seed=3)
        for m in (1, 12):  # mul_mat_vec_q8, mul_mat_q8 (and quantize_q8_1)
            _close(launch.mul_mat(runner, x[:m], w, "Q8_0"), _truth("mul_mat", (x[:m], w, "Q8_0")))
    shaders = {rec.kernels[e]["shader"] for e, _ in rec.calls}
    assert shaders == set(generate.SHADERS), set(generate.SHADERS) - shaders
    # every format's kernels, at small shapes (their numbers: the mps-sim conformance backend)
    from hanzo_torch import get_format

    int8 = set(launch.int8_formats())
    for q in launch.formats():
        K = max(get_format(q).block_size, 32)
        w, w3 = random_packed(q, (3, K), seed=6), random_packed(q, (2, 3, K), seed=7)
        x = torch.randn(9, K)
        _close(launch.dequantize(runner, w, q, [3, K], torch.float32),
               torch.ops.hanzo_ref.dequantize(w, q, [3, K], torch.float32))
        for m in (1, 9):
            _close(launch.mul_mat(runner, x[:m], w, q), _truth("mul_mat", (x[:m], w, q)))
        ids = torch.tensor([[1], [0]])
        _close(launch.mul_mat_id(runner, x[:2], w3, ids, q), _truth("mul_mat_id", (x[:2], w3, ids, q)))
        _close(launch.swiglu_mul_mat(runner, x[:1], w, w, q, q), _truth("swiglu_mul_mat", (x[:1], w, w, q, q)))
        if q in int8 and K % 32 == 0:
            with launch.use_int8(True):
                for m in (1, 9):
                    _close(launch.mul_mat(runner, x[:m], w, q), _truth("mul_mat", (x[:m], w, q)))
    assert {e for e, _ in rec.calls} == set(rec.kernels), set(rec.kernels) - {e for e, _ in rec.calls}
    assert rec.compiled == len(rec.kernels)  # one library per kernel, compiled once


def _q8_0_matvec(runner, x, w):
    y = torch.empty(x.shape[0], w.shape[0])
    launch._mul_mat(runner, x, w, "Q8_0", y)
    return y


@needs_harness
def test_a_broken_kernel_fails_conformance_by_far():
    """mul_mat_vec of Q8_0 with its last block of every row dropped (a tail bug: ``p.K`` read as
    ``p.K - 32``) against the contraction bound of the conformance suite."""
    sig = generate.manifest()["kernels"]["hz_mul_mat_vec_Q8_0"]
    text = (generate.ensure_sources() / "hz_mul_mat_vec_Q8_0.metal").read_text()
    body = text.index(f"kernel void {sig['entry']}(")
    broken, n = re.subn(r"\b(p|pc)\.K\b", r"(\1.K - 32u)", text[body:])
    assert n > 0
    lib = sim.build("broken_mul_mat_vec", [(text[:body] + broken, sig)])
    x, w = torch.randn(2, 512), random_packed("Q8_0", (5, 512), seed=4)
    wf = torch.ops.hanzo_ref.dequantize(w, "Q8_0", [5, 512], torch.float32).double()
    bound = 1e-5 * (x.double().abs() @ wf.abs().t()) + 1e-30
    want = x.double() @ wf.t()
    good = _q8_0_matvec(sim.SimRunner(), x, w)
    assert ((good.double() - want).abs() <= bound).all()
    bad = _q8_0_matvec(sim.SimRunner(lib), x, w)
    assert ((bad.double() - want).abs() / bound).max() > 1000


@needs_harness
def test_out_of_bounds_accesses_are_caught():
    """A destination one row short, in a kernel without barriers (dequantize: plain calls) and
    one with them (mul_mat_vec: fibers): the write past the end hits the guard page and the
    launch raises; the harness runs correct launches after."""
    runner = sim.SimRunner()
    w = random_packed("Q8_0", (4, 256), seed=5)
    short = torch.empty(3, 256)
    with pytest.raises(sim.KernelFault, match="out-of-bounds"):
        runner.launch(launch.Launch("hz_dequantize_Q8_0", {"row_bytes": w.shape[1], "K": 256, "n_rows": 4,
                                                            "n_src": 4, "out_dtype": 0},
                                    {"src": (w, 0), "dst": (short, 0)}, (1, 4, 1)))
    x = torch.randn(1, 256)
    with pytest.raises(sim.KernelFault, match="out-of-bounds"):
        runner.launch(launch.Launch("hz_mul_mat_vec_Q8_0", {"N": 4, "K": 256, "M": 1, "row_bytes": w.shape[1],
                                                             "x_stride": 256, "y_stride": 4},
                                    {"w": (w, 0), "x": (x, 0), "y": (torch.empty(3), 0)}, (4, 1, 1)))
    torch.testing.assert_close(launch.dequantize(runner, w, "Q8_0", [4, 256], torch.float32),
                               torch.ops.hanzo_ref.dequantize(w, "Q8_0", [4, 256], torch.float32), rtol=0, atol=0)
    _close(launch.mul_mat(runner, x, w, "Q8_0"), torch.ops.hanzo_ref.mul_mat(x, w, "Q8_0"))


_DIVERGENT = """#include <metal_stdlib>
using namespace metal;
struct Push
{
    uint n;
};
kernel void hz_divergent(constant Push& p [[buffer(0)]], device uchar* y_buf [[buffer(1)]], uint3 gl_LocalInvocationID [[thread_position_in_threadgroup]])
{
    if (gl_LocalInvocationID.x < p.n)
    {
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    y_buf[gl_LocalInvocationID.x] = uchar(1);
}
"""


@needs_harness
def test_a_barrier_that_some_threads_skip_is_caught():
    sig = {"entry": "hz_divergent", "shader": "divergent", "builtins": ["thread_position_in_threadgroup"],
           "barrier": True, "local": [4, 1, 1]}
    runner = sim.SimRunner(sim.build("divergent", [(_DIVERGENT, sig)]))
    y = torch.zeros(4, dtype=torch.uint8)
    runner.run(sig, (4).to_bytes(4, "little"), [y], (2, 1, 1))  # every thread at the barrier
    assert y.tolist() == [1, 1, 1, 1]
    with pytest.raises(sim.KernelFault, match="barrier"):
        runner.run(sig, (2).to_bytes(4, "little"), [y], (1, 1, 1))


@needs_harness
@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
def test_tiny_models_on_the_harness_give_the_cpu_greedy_tokens(arch, tmp_path):
    """Every ``hanzo`` op of a whole model (prefill, then decode steps through the KV cache) on
    the Metal kernels in the harness (:func:`~hanzo_torch.backends.mps.sim.on_cpu`), float32:
    the same greedy tokens as the CPU kernels."""
    from tests.gguf_builders import tiny_spec, write_tiny_gguf
    from tests.qwen_vocab import toy_tokenizer_metadata
    from tests.test_models import SPECS

    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", tiny_spec(arch, **SPECS[arch]), toy_tokenizer_metadata())
    model = hanzo_torch.load(path, device="cpu", max_context=48, kv_dtype="f32", dtype=torch.float32)
    prompt = torch.randint(0, 263, (1, 10), generator=torch.Generator().manual_seed(3))

    def greedy(n=12):
        model.reset()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokens = [int(model(prompt)[0, -1].argmax())]
            for _ in range(n - 1):
                tokens.append(int(model(torch.tensor([[tokens[-1]]]))[0, -1].argmax()))
        return tokens

    want = greedy()
    with sim.on_cpu() as runner:
        got = greedy()
    assert runner.launches > 12 * 5  # every step ran its norms, projections, RoPE, attention on the harness
    assert got == want
