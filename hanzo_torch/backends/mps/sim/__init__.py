"""The CPU harness of the Metal kernels (backend ``mps-sim`` of the conformance suite).

Each generated ``.metal`` (:mod:`..generate`) is compiled as C++17 by ``g++`` against
``metal_shim.h``: the text is changed only where C++ and MSL differ in syntax (:func:`to_cpp`):
the Metal headers are replaced by the shim, ``[[...]]`` attributes are stripped, the kernel-scope
``threadgroup`` arrays become ``static`` (one copy per threadgroup: the harness runs one group at
a time), and the translation is wrapped in a namespace of its own with an ``extern "C"`` launcher
that maps the kernel's built-ins and bound buffers. One shared object per shader family (every
format of a shader in one translation unit), built on first use into
``<cache>/mps-sim-<key>/`` under the shared build lock.

A dispatch runs the threadgroups one after another; a kernel with ``threadgroup_barrier`` runs
its threads as ucontext fibers that switch at each barrier (a barrier some threads of a group
never reach is an error), others as plain calls. Every buffer is copied into memory that ends
at a PROT_NONE page, so a read or write past a buffer's end faults and the launch raises
:class:`KernelFault` (reads before a buffer's start are not caught).

The launches come from :mod:`..launch` through :class:`SimRunner`, the same launch descriptions a
Mac gives ``torch.mps.compile_shader`` (:mod:`..metal`).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import contextlib
import threading
import warnings
from pathlib import Path
from typing import Iterator, Optional

import torch

__all__ = ["KernelFault", "to_cpp", "library", "build", "SimRunner", "on_cpu", "reason", "CXXFLAGS"]

CXXFLAGS = ("-std=c++17", "-O1", "-fPIC", "-shared", "-ffp-contract=off", "-fno-strict-aliasing", "-U_FORTIFY_SOURCE",
            "-w")
"""g++ flags of the harness: no multiply-add contraction (the kernels' roundings stay theirs); no
fortified longjmp (the fibers jump between stacks)."""

_HERE = Path(__file__).resolve().parent
_SHIM = _HERE / "metal_shim.h"
_lock = threading.RLock()
_libs: dict = {}

_ATTR = re.compile(r"\s*\[\[(?:clang::optnone|maybe_unused|buffer\(\d+\)|thread_position_in_grid|"
                   r"threadgroup_position_in_grid|threadgroups_per_grid|thread_position_in_threadgroup)\]\]")


_FLOAT = re.compile(r"(?<![\w.])(\d+\.\d*(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)(?![\w.])")


class KernelFault(RuntimeError):
    """A kernel's dispatch failed in the harness: an out-of-bounds access or a divergent barrier."""


def reason() -> Optional[str]:
    """Why the harness cannot run here, or None."""
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        return "no C++ compiler (g++)"
    from .. import generate

    return generate.toolchain_reason()


def to_cpp(text: str, sig: dict) -> str:
    """The C++ of one generated Metal kernel (its signature ``sig`` from the manifest), wrapped in
    ``namespace k_<entry>`` with ``extern "C" int <entry>_launch(void** buffers, const hzsim::Grid*,
    char* err, size_t errlen)``."""
    entry = sig["entry"]
    lines = []
    for line in text.splitlines():
        if line.startswith("#include <") or line.startswith("#pragma clang"):
            continue
        line = _ATTR.sub("", line)
        line = _FLOAT.sub(r"\1f", line)  # an MSL float literal is a float, a C++ one a double
        if re.match(r"^    threadgroup \w+ \w+(?:\[\d+\])*;$", line):
            line = line.replace("    threadgroup ", "    static ", 1)
        lines.append(line)
    body = "\n".join(lines)
    m = re.search(r"^kernel void " + re.escape(entry) + r"\((.*)\)$", body, re.M)
    if m is None:
        raise RuntimeError(f"{entry}: kernel signature not found")
    args = []
    bi = 0
    for a in m.group(1).split(", "):
        a = a.strip()
        am = re.match(r"(?:volatile )?(?:constant|device) (\w+)([&*]) (\w+)$", a)
        if am:
            t, ref = am.group(1), am.group(2)
            args.append(f"*(k_{entry}::{t}*)b[{bi}]" if ref == "&" else f"({t}*)b[{bi}]")
            bi += 1
        elif re.match(r"uint3 \w+$", a):
            args.append(f"t.{sig['builtins'][len([x for x in args if x.startswith('t.')])]}")
        else:
            raise RuntimeError(f"{entry}: unexpected kernel argument {a!r}")
    barrier = "true" if sig["barrier"] else "false"
    return (f"namespace k_{entry} {{\n{body}\n}}  // namespace k_{entry}\n"
            f'extern "C" __attribute__((visibility("default"))) int {entry}_launch(void** b, const hzsim::Grid* g, '
            f"char* err, size_t errlen) {{\n"
            f"  auto f = [&](const hzsim::Ids& t) {{ k_{entry}::{entry}({', '.join(args)}); }};\n"
            f"  return hzsim::dispatch(*g, f, {barrier}, err, errlen);\n}}\n")


def _build_dir() -> Path:
    """``<cache>/mps-sim-<key>``: keyed by the shim, the flags and the compiler (a library's file
    name is the hash of its C++ text)."""
    from ...._native import cache_root

    h = hashlib.sha256()
    h.update(_SHIM.read_bytes())
    h.update(" ".join(CXXFLAGS).encode())
    h.update((shutil.which(os.environ.get("CXX", "g++")) or "").encode())
    return cache_root() / f"mps-sim-{h.hexdigest()[:16]}"


def library(shader: str) -> ctypes.CDLL:
    """The harness library of one shader family (built on first use)."""
    with _lock:
        lib = _libs.get(shader)
        if lib is not None:
            return lib
        from .. import generate

        src_dir = generate.ensure_sources()
        kernels = [s for s in generate.manifest()["kernels"].values() if s["shader"] == shader]
        if not kernels:
            raise KeyError(f"no Metal kernels of shader {shader!r}")
        lib = _libs[shader] = build(shader, [((src_dir / f"{sig['entry']}.metal").read_text(), sig) for sig in kernels])
        return lib


def build(name: str, kernels: list) -> ctypes.CDLL:
    """Compile ``kernels`` (``[(metal text, manifest signature)]``) into one harness library
    ``<cache>/mps-sim-<key>/<name>-<hash>.so`` (cached by content) and load it.

    Raises:
        RuntimeError: the C++ compiler rejected the translation (its message, shortened).
    """
    from ...._native import build_lock

    cpp_text = "\n".join([f'#include "{_SHIM}"'] + [to_cpp(text, sig) for text, sig in kernels])
    digest = hashlib.sha256(cpp_text.encode()).hexdigest()[:12]
    out = _build_dir()
    so = out / f"{name}-{digest}.so"
    with build_lock(out):
        if not so.is_file():
            cpp = out / f"{name}-{digest}.cpp"
            cpp.write_text(cpp_text)
            tmp = out / f".{name}.{os.getpid()}.so"
            cmd = [os.environ.get("CXX", "g++"), *CXXFLAGS, str(cpp), "-o", str(tmp)]
            r = subprocess.run(["nice", *cmd], capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"mps-sim: compiling {name} failed: {(r.stderr or r.stdout)[-3000:]}")
            os.replace(tmp, so)
    lib = ctypes.CDLL(str(so))
    lib.hz_sim_alloc.restype = ctypes.c_void_p
    lib.hz_sim_alloc.argtypes = [ctypes.c_size_t]
    lib.hz_sim_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib


class _Grid(ctypes.Structure):
    _fields_ = [("groups", ctypes.c_uint * 3), ("local", ctypes.c_uint * 3)]


class SimRunner:
    """Runs launch descriptions (:class:`..launch.Launch`) on the harness, on CPU tensors.

    ``launches`` counts the dispatches (what a test can compare with a recording)."""

    device = torch.device("cpu")

    def __init__(self, lib: Optional[ctypes.CDLL] = None):
        self.launches = 0
        self.lib = lib  # a library of :func:`build` to run instead of the generated kernels (tests)

    def launch(self, launch) -> None:
        """Run one :class:`..launch.Launch` (encoded by :func:`..launch.encode`, as on a Mac)."""
        from ..launch import encode

        sig, push, buffers = encode(launch)
        self.run(sig, push, [None if b is None else b[0] for b in buffers], launch.groups)

    def run(self, sig: dict, push: bytes, buffers: list, groups: tuple) -> None:
        """Dispatch kernel ``sig`` (a manifest signature) over ``groups`` threadgroups; ``buffers``
        are the tensors bound at indices 1.. (None: no tensor, a 16-byte dummy is bound), written
        back after the dispatch."""
        lib = self.lib if self.lib is not None else library(sig["shader"])
        fn = getattr(lib, f"{sig['entry']}_launch")
        if any(g == 0 for g in groups):
            return
        allocs = []
        try:
            ptrs = []
            seen = {}  # one copy of a tensor bound at several indices
            for t, data in [(None, push)] + [(b, None) for b in buffers]:
                key = None if t is None else (t.data_ptr(), t.numel() * t.element_size())
                if key in seen:
                    ptrs.append(seen[key])
                    continue
                if data is not None:
                    n = len(data)
                elif t is None:
                    n = 16
                else:
                    if not t.is_contiguous():
                        raise ValueError(f"{sig['entry']}: a bound buffer must be contiguous")
                    n = max(t.numel() * t.element_size(), 1)
                p = lib.hz_sim_alloc(n)
                if not p:
                    raise MemoryError(f"mps-sim: could not map {n} bytes")
                allocs.append((p, n, t))
                if data is not None:
                    ctypes.memmove(p, data, n)
                elif t is not None and t.numel():
                    ctypes.memmove(p, t.data_ptr(), t.numel() * t.element_size())
                else:
                    ctypes.memset(p, 0, n)
                ptrs.append(p)
                if key is not None:
                    seen[key] = p
            arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
            grid = _Grid((ctypes.c_uint * 3)(*groups), (ctypes.c_uint * 3)(*sig["local"]))
            err = ctypes.create_string_buffer(512)
            rc = fn(arr, ctypes.byref(grid), err, ctypes.c_size_t(512))
            self.launches += 1
            if rc:
                raise KernelFault(f"{sig['entry']}: {err.value.decode()}")
            for p, n, t in allocs[1:]:
                if t is not None and t.numel():
                    ctypes.memmove(t.data_ptr(), p, t.numel() * t.element_size())
        finally:
            for p, n, _ in allocs:
                lib.hz_sim_free(p, n)


@contextlib.contextmanager
def on_cpu(ops: Optional[list] = None) -> Iterator[SimRunner]:
    """Within the block, the ``hanzo`` ops ``ops`` (default every op of :data:`..launch.OPS`) of
    CPU tensors run the Metal kernels on the harness: the launch code of the MPS backend,
    registered on the CPU dispatch key in front of the C++ kernels (removed after). Yields the
    runner (its ``launches`` count the dispatches). Slow (a CPU emulation of a GPU): tiny models."""
    from .. import launch
    from ... import activate

    activate("cpu")  # the C++ kernels first, so that these registrations are in front
    runner = SimRunner()
    lib = torch.library.Library("hanzo", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
            for op in ops or list(launch.OPS):
                fn = launch.OPS[op]
                lib.impl(op, (lambda f: lambda *args: f(runner, *args))(fn), "CPU")
        yield runner
    finally:
        lib._destroy()
