"""Building native extensions into the shared cache (``~/.cache/hanzo-torch/ext``) safely across processes.

One helper for every backend with native code (the CPU and Vulkan ones): :func:`cache_root` (the
cache folder), :func:`announce` (the one "compiling ..." line of a first build),
:func:`load_extension` (``torch.utils.cpp_extension.load`` under :func:`build_lock`) and
:class:`Slot` (the extension of a process, built once, its failure remembered and described in
one message).
"""
from __future__ import annotations

import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

from .._native import build_lock, cache_root  # noqa: F401  (part of this helper's API)

__all__ = ["cache_root", "announce", "load_extension", "describe", "Slot", "build_lock"]


def announce(build_dir: Path, what: str, how_long: str, verbose: bool = False) -> bool:
    """Print one line on stderr when ``build_dir`` holds no built library yet (a first build
    follows); True then. Silent with ``verbose`` (the compiler's output says it)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not any(build_dir.glob("*.so"))
    if fresh and not verbose:
        print(f"hanzo-torch: compiling {what} (once, {how_long}; cached in {build_dir})", file=sys.stderr, flush=True)
    return fresh


def load_extension(build_dir: Path, verbose: bool = False, **kwargs) -> Any:
    """``torch.utils.cpp_extension.load(build_directory=build_dir, verbose=verbose, **kwargs)``
    under :func:`build_lock`; torch's warning for kernels that replace Python registrations (on
    purpose: the C++ ``ADInplaceOrView`` kernels) is silenced. Raises what the build raises."""
    from torch.utils.cpp_extension import load

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
        with build_lock(build_dir):
            return load(build_directory=str(build_dir), verbose=verbose, **kwargs)


def describe(e: BaseException, limit: int = 500) -> str:
    """One line for a failed build: a RuntimeError's own message (ours name the missing piece),
    else ``Type: message``; the first non-empty line, at most ``limit`` characters."""
    text = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[0][:limit] if lines else type(e).__name__


class Slot:
    """The native extension of one backend in this process: built at most once (``ext``), or
    the reason it could not be (``failed``, never retried).

    ``fallback``: the end of the one warning a failure gives (None: no warning; the backend's
    status says why). ``dispatch_key``: the key the extension's kernels register on when it loads
    (``TORCH_LIBRARY_IMPL``); :meth:`loaded` puts the reference-mode redirect back in front of them.
    """

    def __init__(self, what: str, fallback: Optional[str] = None, dispatch_key: Optional[str] = None):
        self.what = what
        self.fallback = fallback
        self.dispatch_key = dispatch_key
        self.ext: Any = None
        self.failed: Optional[str] = None
        self.lock = threading.RLock()

    def loaded(self, ext: Any) -> None:
        """Record the built extension (its kernels are registered now, whoever loaded it)."""
        self.ext, self.failed = ext, None
        if self.dispatch_key:
            from ..ops import _dispatch

            _dispatch.add_dispatch_key(self.dispatch_key)

    def get(self, build: Callable[[], Any]) -> Any:
        """The extension, calling ``build()`` on first use; None (after one warning if
        ``fallback``) when it fails, now or earlier."""
        if self.ext is not None:
            return self.ext
        if self.failed is not None:
            return None
        try:
            return build()
        except Exception as e:  # no compiler, no driver, failed build, unsupported platform
            self.failed = describe(e)
            if self.fallback:
                warnings.warn(f"hanzo_torch: {self.what} could not be built ({self.failed[:300]}); {self.fallback}",
                              RuntimeWarning, stacklevel=3)
            return None
