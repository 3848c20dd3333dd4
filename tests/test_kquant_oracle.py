"""The K-quant quantizers against ggml's own (``ggml_quantize_chunk`` in libggml-base), byte for byte.

Slow: needs a built ggml. ``HANZO_GGML_LIB`` names libggml-base.so (``build/bin/`` of llama.cpp
built with CMake and ``-DBUILD_SHARED_LIBS=ON`` from the llama-cpp-python 0.3.36 sdist, as the
benchmarks build it; ``llama-quantize`` is looked up beside it); without it the tests skip. Both our paths are checked:
the C kernel and the torch version (``HANZO_QUANT_NATIVE=0``). With the real model present, some
of its tensors (dequantized from their own formats) are quantized too, and its Q4_K_M requantization
is compared with llama-quantize's, tensor by tensor.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import hanzo_torch

KQ = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
IQ4 = ["IQ4_NL", "IQ4_XS"]
LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1"]
CODEBOOK = ["IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"]  # the C kernel only
NEEDS_WEIGHTS = ["IQ2_XXS", "IQ2_XS", "IQ1_S"]  # ggml_quantize_requires_imatrix

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ggml():
    path = os.environ.get("HANZO_GGML_LIB", "")
    if not path or not Path(path).is_file():
        pytest.skip(f"ggml not built: HANZO_GGML_LIB={path!r} is not a file (set it to a libggml-base.so)")
    lib = ctypes.CDLL(path)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]

    def quantize(x: torch.Tensor, name: str, quant_weights=None) -> torch.Tensor:
        fmt = hanzo_torch.get_format(name)
        a = np.ascontiguousarray(x.numpy(), dtype=np.float32)
        out = np.zeros((a.shape[0], fmt.row_bytes(a.shape[1])), np.uint8)
        qw = None if quant_weights is None else np.ascontiguousarray(quant_weights.numpy(), dtype=np.float32)
        n = lib.ggml_quantize_chunk(fmt.type_id, a.ctypes.data, out.ctypes.data, 0, a.shape[0], a.shape[1],
                                    None if qw is None else qw.ctypes.data)
        assert n == out.nbytes
        return torch.from_numpy(out)

    return quantize


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(25)
    x = torch.randn(256, 1024, generator=g) * 0.02
    x[3] = 0
    x[5, :300] = 0
    x[7, 10] = 5.0
    x[9] = x[9].abs()
    x[11] = -x[11].abs()
    x[13, :64] = 0.5
    heavy = torch.distributions.StudentT(2.0).sample((128, 512)) * 0.01
    return {
        "gauss": x,
        "student-t": heavy,
        "large": torch.randn(32, 2048, generator=g) * 300.0,
        "small": torch.randn(32, 256, generator=g) * 1e-4,
        "uniform": torch.rand(64, 768, generator=g) - 0.3,
        "sparse": torch.randn(64, 512, generator=g) * (torch.rand(64, 512, generator=g) < 0.05),
    }


def _compare(ours: torch.Tensor, ref: torch.Tensor, name: str) -> tuple[int, int]:
    ts = hanzo_torch.get_format(name).type_size
    a, b = ours.reshape(-1, ts), ref.reshape(-1, ts)
    return int((a != b).any(1).sum()), a.shape[0]


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("name", KQ)
def test_random_weights_byte_identical(ggml, name, path, monkeypatch):
    if path == "torch":
        monkeypatch.setenv("HANZO_QUANT_NATIVE", "0")
    for case, x in _cases().items():
        if path == "torch":
            x = x[:32]
        bad, total = _compare(hanzo_torch.quantize(x, name), ggml(x, name), name)
        assert bad == 0, f"{name} {case}: {bad} of {total} blocks differ"


def _imatrix_like(k: int, seed: int) -> torch.Tensor:
    """Positive per-column weights spread over decades, a few zero, like mean squared activations."""
    g = torch.Generator().manual_seed(seed)
    w = torch.exp(torch.randn(k, generator=g) * 2.0)
    w[::97] = 0
    return w


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("name", IQ4)
def test_iq4_random_weights_byte_identical(ggml, name, path, monkeypatch):
    if path == "torch":
        monkeypatch.setenv("HANZO_QUANT_NATIVE", "0")
    for case, x in _cases().items():
        if path == "torch":
            x = x[:32]
        for qw in (None, _imatrix_like(x.shape[1], x.shape[1])):
            ours = hanzo_torch.quantize(x, name, quant_weights=qw)
            bad, total = _compare(ours, ggml(x, name, qw), name)
            assert bad == 0, f"{name} {case} weights={qw is not None}: {bad} of {total} blocks differ"


@pytest.mark.parametrize("name", CODEBOOK)
def test_codebook_iquants_random_byte_identical(ggml, name):
    g = torch.Generator().manual_seed(11)
    for case, x in _cases().items():
        for qw in (None, _imatrix_like(x.shape[1], 5 * x.shape[1]), torch.rand(x.shape[1], generator=g)):
            if qw is None and name in NEEDS_WEIGHTS:
                continue
            bad, total = _compare(hanzo_torch.quantize(x, name, quant_weights=qw), ggml(x, name, qw), name)
            assert bad == 0, f"{name} {case} weights={qw is not None}: {bad} of {total} blocks differ"


@pytest.mark.parametrize("name", KQ + LEGACY)
def test_weighted_kquants_random_byte_identical(ggml, name):
    for case, x in _cases().items():
        qw = _imatrix_like(x.shape[1], 7 * x.shape[1])
        bad, total = _compare(hanzo_torch.quantize(x, name, quant_weights=qw), ggml(x, name, qw), name)
        assert bad == 0, f"{name} {case} with weights: {bad} of {total} blocks differ"


def test_real_weights_with_weights_byte_identical(ggml):
    from conftest import real_model_path

    f = hanzo_torch.GGUFFile(real_model_path())
    for tname in ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.27.ffn_gate.weight"]:
        if tname not in f.tensors:
            continue
        w = f.tensors[tname].dequantize().reshape(-1, f.tensors[tname].shape[-1])[:256].contiguous()
        qw = _imatrix_like(w.shape[1], 3)
        for name in KQ + IQ4 + LEGACY + CODEBOOK:
            for weights in (None, qw):
                if weights is None and name in NEEDS_WEIGHTS:
                    continue
                bad, total = _compare(hanzo_torch.quantize(w, name, quant_weights=weights), ggml(w, name, weights), name)
                assert bad == 0, f"{tname} as {name} weights={weights is not None}: {bad} of {total} blocks differ"


def test_real_weights_byte_identical(ggml):
    from conftest import real_model_path

    f = hanzo_torch.GGUFFile(real_model_path())
    names = ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.27.ffn_gate.weight", "output_norm.weight"]
    names = [n for n in names if n in f.tensors][:3]
    assert names
    for tname in names:
        w = f.tensors[tname].dequantize().reshape(-1, f.tensors[tname].shape[-1])[:512].contiguous()
        if w.shape[-1] % 256:
            continue
        for name in KQ:
            bad, total = _compare(hanzo_torch.quantize(w, name), ggml(w, name), name)
            assert bad == 0, f"{tname} as {name}: {bad} of {total} blocks differ"


def test_requantize_real_model_matches_llama_quantize(tmp_path):
    import subprocess

    from conftest import real_model_path

    from hanzo_torch.requantize import requantize

    lib_dir = Path(os.environ.get("HANZO_GGML_LIB") or ".").parent
    tool = lib_dir / "llama-quantize"
    if not tool.is_file():
        pytest.skip(f"llama-quantize not built: {tool} is absent")
    src = real_model_path()
    theirs, ours = tmp_path / "llama.gguf", tmp_path / "ours.gguf"
    subprocess.run([str(tool), "--allow-requantize", str(src), str(theirs), "Q4_K_M", "2"], check=True,
                   capture_output=True)
    requantize(str(src), str(ours), "Q4_K_M", progress=False)
    a, b = hanzo_torch.GGUFFile(ours), hanzo_torch.GGUFFile(theirs)
    assert set(a.tensor_info) == set(b.tensor_info)  # llama-quantize writes its own tensor order
    for name in a.tensor_info:
        assert a.tensor_info[name].qtype == b.tensor_info[name].qtype, name
        assert torch.equal(a.packed(name).reshape(-1), b.packed(name).reshape(-1)), name


def _f16_and_imatrix(tmp_path):
    """The real model's F16 copy (llama-quantize) and an imatrix llama-imatrix made over 4 chunks
    of 128 tokens; (lib_dir, env, f16 path, imatrix path). Skips without the tools."""
    import subprocess

    from conftest import real_model_path

    lib_dir = Path(os.environ.get("HANZO_GGML_LIB") or ".").parent
    if not (lib_dir / "llama-quantize").is_file() or not (lib_dir / "llama-imatrix").is_file():
        pytest.skip(f"llama-quantize / llama-imatrix not built beside {lib_dir}")
    env = dict(os.environ, LD_LIBRARY_PATH=str(lib_dir))
    src = real_model_path()
    f16, im = tmp_path / "f16.gguf", tmp_path / "im.gguf"
    text = tmp_path / "calib.txt"
    text.write_text((Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md").read_text()[:20000])
    subprocess.run([str(lib_dir / "llama-quantize"), "--allow-requantize", str(src), str(f16), "F16", "2"], check=True,
                   capture_output=True, env=env)
    # -nr: llama.cpp's AMX repacked weights crash its imatrix callback on AMX machines
    subprocess.run([str(lib_dir / "llama-imatrix"), "-m", str(src), "-f", str(text), "-o", str(im), "-c", "128",
                    "-b", "128", "--chunks", "4", "--no-ppl", "-nr", "-t", "2"], check=True, capture_output=True, env=env)
    return lib_dir, env, f16, im


def _same_as_llama_quantize(tmp_path, lib_dir, env, f16, im, ftype):
    import subprocess

    from hanzo_torch.requantize import requantize

    theirs, ours = tmp_path / f"llama-{ftype}.gguf", tmp_path / f"ours-{ftype}.gguf"
    subprocess.run([str(lib_dir / "llama-quantize"), "--imatrix", str(im), str(f16), str(theirs), ftype, "2"],
                   check=True, capture_output=True, env=env)
    requantize(str(f16), str(ours), ftype, progress=False, imatrix=str(im))
    a, b = hanzo_torch.GGUFFile(ours), hanzo_torch.GGUFFile(theirs)
    assert set(a.tensor_info) == set(b.tensor_info)
    for name in a.tensor_info:
        assert a.tensor_info[name].qtype == b.tensor_info[name].qtype, (ftype, name)
        assert torch.equal(a.packed(name).reshape(-1), b.packed(name).reshape(-1)), (ftype, name)
    for key in ("quantize.imatrix.file", "quantize.imatrix.entries_count", "quantize.imatrix.chunks_count"):
        assert a.metadata[key] == b.metadata[key], key
    theirs.unlink()
    ours.unlink()


def test_requantize_real_model_with_imatrix_matches_llama_quantize(tmp_path):
    """The real model's F16 copy quantized to Q4_K_M and IQ4_XS with an imatrix llama-imatrix made
    (4 chunks of 128 tokens): every tensor's type and bytes equal llama-quantize --imatrix's."""
    lib_dir, env, f16, im = _f16_and_imatrix(tmp_path)
    for ftype in ("Q4_K_M", "IQ4_XS"):
        _same_as_llama_quantize(tmp_path, lib_dir, env, f16, im, ftype)


@pytest.mark.parametrize("ftype", ["IQ3_S", "IQ2_XS"])
def test_requantize_real_model_codebook_file_types_match_llama_quantize(tmp_path, ftype):
    """As above for the codebook i-quant file types (long: llama-quantize alone takes about 15 min
    for IQ3_S on 2 busy AVX2 cores, hanzo-torch about the same)."""
    lib_dir, env, f16, im = _f16_and_imatrix(tmp_path)
    _same_as_llama_quantize(tmp_path, lib_dir, env, f16, im, ftype)
