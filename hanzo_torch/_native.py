"""The cache folder of every native build and the lock that makes a build safe across processes.

Below every other module (it imports nothing of hanzo-torch): the backends' extension builder
(:mod:`hanzo_torch.backends._build`) and the K-quant C kernel (:mod:`hanzo_torch.formats._kquant_native`)
both build into :func:`cache_root` under :func:`build_lock`.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

__all__ = ["cache_root", "build_lock"]


def cache_root() -> Path:
    """``$HANZO_CACHE/ext`` (default ``~/.cache/hanzo-torch/ext``): one cache root for the whole
    package (hub.py keeps models under the same variable)."""
    return Path(os.environ.get("HANZO_CACHE") or Path.home() / ".cache" / "hanzo-torch") / "ext"


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an exclusive, process-wide lock on ``build_dir`` while an extension is built or loaded.

    ``torch.utils.cpp_extension.load`` marks a build in progress with a file ``lock`` in the build
    folder and waits, with no limit, for that file to disappear; a process killed mid-build leaves it
    behind, and every later build would then wait forever (or, once someone deletes it by hand,
    import a library that was never linked). Every build of ours first takes an OS lock
    (``fcntl.flock``, released by the kernel when its holder exits, killed or not), so whoever holds
    it knows that a ``lock`` file present is a leftover, and removes it. Where ``fcntl`` does not
    exist (Windows), only torch's own lock applies.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(build_dir / ".hanzo-build.lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            leftover = build_dir / "lock"
            if leftover.exists():
                leftover.unlink(missing_ok=True)
                print(f"hanzo-torch: removed a build lock left by an interrupted build in {build_dir}",
                      file=sys.stderr, flush=True)
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
