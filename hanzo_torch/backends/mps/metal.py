"""The Mac side of the MPS backend: Metal kernels compiled with ``torch.mps.compile_shader``.

:class:`MetalRunner` runs the launch descriptions of :mod:`.launch` on "mps" tensors: each
kernel's generated source (:func:`..generate.ensure_sources`) is compiled on its first launch
(one library per kernel: every translation defines its own ``Push`` struct), then called with the
arguments in its buffer order (:func:`.launch.encode`): the push constants as a uint8 "mps"
tensor at ``buffer(0)`` (a ``constant`` argument), every bound tensor after it (a 16-byte dummy
where a field has no tensor), ``threads`` = threadgroups x threads per group in each dimension
and ``group_size`` the kernel's threadgroup size, so every threadgroup is whole.

None of this has run on Apple hardware (see the README): tests/test_mps.py runs it against a
recording stand-in for ``compile_shader`` that checks every call against the parsed kernel
signature.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

from .launch import encode

__all__ = ["MetalRunner"]


class MetalRunner:
    """Runs :class:`.launch.Launch` descriptions through ``compile``
    (default ``torch.mps.compile_shader``) on ``device``."""

    def __init__(self, device: torch.device = torch.device("mps"), compile: Optional[Callable] = None,
                 source: Optional[Callable[[str], str]] = None):
        self.device = torch.device(device)
        self._compile = compile
        self._source = source
        self._libs: dict = {}
        self._lock = threading.Lock()
        self._dummy: Optional[torch.Tensor] = None
        self.launches = 0

    def _text(self, entry: str) -> str:
        if self._source is not None:
            return self._source(entry)
        from . import generate

        return (generate.ensure_sources() / f"{entry}.metal").read_text()

    def kernel(self, entry: str):
        """The compiled kernel function ``entry`` (compiled on first use)."""
        with self._lock:
            fn = self._libs.get(entry)
            if fn is None:
                compile_shader = self._compile or torch.mps.compile_shader
                fn = self._libs[entry] = getattr(compile_shader(self._text(entry)), entry)
            return fn

    def launch(self, launch) -> None:
        sig, push, buffers = encode(launch)
        if any(g == 0 for g in launch.groups):
            return
        if self._dummy is None:
            self._dummy = torch.zeros(16, dtype=torch.uint8, device=self.device)
        args = [torch.frombuffer(bytearray(push), dtype=torch.uint8).to(self.device)]
        for b in buffers:
            args.append(self._dummy if b is None else b[0])
        local = tuple(sig["local"])
        threads = tuple(g * n for g, n in zip(launch.groups, local))
        self.kernel(sig["entry"])(*args, threads=threads, group_size=local)
        self.launches += 1
