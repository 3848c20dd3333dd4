"""The C kernel of the K-quant and IQ4 quantizers (``csrc/quant/kquants.c``), loaded through ctypes.

Compiled on first use with the system C compiler (``$CC``, default ``cc``; about a second) into
``~/.cache/hanzo-torch/ext/quant-<hash>/`` (``HANZO_CACHE`` moves the root, as for the other
extensions) keyed by the source's hash, with
``-O3 -ffp-contract=off`` and OpenMP. ``HANZO_QUANT_NATIVE=0`` turns it off (the torch version
runs instead; the two give the same bytes). Without a C compiler the torch version runs.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

from .. import _native

_PKG = Path(__file__).resolve().parents[1] / "_csrc" / "quant" / "kquants.c"
SOURCE = _PKG if _PKG.is_file() else Path(__file__).resolve().parents[2] / "csrc" / "quant" / "kquants.c"
KINDS = {"Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
ROW_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
"""The formats ``hz_quantize_rows`` quantizes (the last four with importance weights only)."""
WEIGHTED_ONLY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1")
KERNEL_ONLY = ("IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
"""Formats quantized by the C kernel only (no torch version)."""
REQUIRES_WEIGHTS = ("IQ2_XXS", "IQ2_XS", "IQ1_S")
"""Formats ggml quantizes only with importance weights (``ggml_quantize_requires_imatrix``)."""

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_error: Optional[str] = None  # why it could not be built (not retried; no warning: error() says it)


def enabled() -> bool:
    """True unless ``HANZO_QUANT_NATIVE=0``."""
    return os.environ.get("HANZO_QUANT_NATIVE", "1") != "0"


def _build() -> ctypes.CDLL:
    src = SOURCE.read_bytes()
    cc = os.environ.get("CC", "cc")
    flags = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-fopenmp", "-std=c11"]
    key = hashlib.sha256(src + " ".join([cc] + flags).encode()).hexdigest()[:16]
    out_dir = _native.cache_root() / f"quant-{key}"
    so = out_dir / "libhzquant.so"
    if not so.is_file():
        with _native.build_lock(out_dir):
            if not so.is_file():
                _compile(cc, flags, so)
    lib = ctypes.CDLL(str(so))
    lib.hz_quantize_k.restype = ctypes.c_int
    lib.hz_quantize_k.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.hz_quant_set_simd.restype = ctypes.c_int
    lib.hz_quant_set_simd.argtypes = [ctypes.c_int]
    lib.hz_quantize_rows.restype = ctypes.c_int
    lib.hz_quantize_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_void_p, ctypes.c_int]
    return lib


def _compile(cc: str, flags: list, so: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed on {SOURCE}: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, so)  # a process that finds the file finds it whole
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library() -> Optional[ctypes.CDLL]:
    """The loaded kernel library, or None (disabled, or it could not be built: see :func:`error`).
    Its AVX2 sub-block search is on where the CPU has AVX2 unless ``HANZO_QUANT_SIMD=0`` (read at
    each call; the two paths give the same bytes)."""
    if not enabled():
        return None
    global _lib, _error
    with _lock:
        if _lib is None and _error is None:
            try:
                _lib = _build()
            except (OSError, RuntimeError) as e:
                _error = str(e)
        if _lib is not None:
            _lib.hz_quant_set_simd(0 if os.environ.get("HANZO_QUANT_SIMD", "1") == "0" else 1)
        return _lib


def error() -> Optional[str]:
    """Why the kernel could not be built, or None."""
    return _error


def raise_non_finite(blocks: torch.Tensor, name: str) -> None:
    """Raise the ValueError naming the first non-finite value of ``blocks [n, block_size]``."""
    bad = (~torch.isfinite(blocks)).nonzero()[0].tolist()
    raise ValueError(f"{name}: cannot quantize non-finite values (block {bad[0]}, value {bad[1]})")


def quantize(x: torch.Tensor, name: str) -> Optional[torch.Tensor]:
    """Quantize float32 super-blocks ``x [n, 256]`` on the CPU to ``name``; None if unavailable.

    Raises:
        ValueError: a non-finite value (the kernel checks each block as it quantizes it).
    """
    lib = library()
    if lib is None or x.device.type != "cpu":
        return None
    from . import get_format
    fmt = get_format(name)
    x = x.contiguous()
    out = torch.empty(x.shape[0], fmt.type_size, dtype=torch.uint8)
    rc = lib.hz_quantize_k(KINDS[name], x.data_ptr(), out.data_ptr(), x.shape[0], max(1, torch.get_num_threads()))
    if rc == -3:
        raise_non_finite(x, name)
    if rc != 0:
        raise RuntimeError(f"hz_quantize_k({name}) returned {rc}")
    return out


def quantize_rows(x: torch.Tensor, name: str, quant_weights: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Quantize finite float32 rows ``x [rows, K]`` on the CPU to ``name`` (one of :data:`ROW_TYPES`)
    as ``ggml_quantize_chunk`` does, with ``quant_weights`` (float32 ``[K]``, shared by every row) or
    None; returns ``uint8 [rows, row_bytes]``, or None if the kernel is unavailable."""
    lib = library()
    if lib is None or x.device.type != "cpu":
        return None
    from . import get_format
    fmt = get_format(name)
    x = x.contiguous()
    out = torch.empty(x.shape[0], fmt.row_bytes(x.shape[1]), dtype=torch.uint8)
    qw = None
    if quant_weights is not None:
        qw = quant_weights.to(torch.float32).contiguous()
    rc = lib.hz_quantize_rows(fmt.type_id, x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                              None if qw is None else qw.data_ptr(), max(1, torch.get_num_threads()))
    if rc == -3:
        raise_non_finite(x.reshape(-1, fmt.block_size), name)
    if rc != 0:
        raise RuntimeError(f"hz_quantize_rows({name}) returned {rc}")
    return out
