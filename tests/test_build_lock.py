"""The extension build lock: a ``lock`` file left by a killed build is cleared, a live build is waited for."""
import subprocess
import sys
import textwrap
import time

from hanzo_torch.backends._build import build_lock


def test_leftover_torch_lock_is_removed(tmp_path):
    (tmp_path / "lock").touch()  # what torch.utils.cpp_extension leaves when its builder is killed
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_live_holder_is_waited_for(tmp_path):
    # a child holds the lock (as a build in progress would) for 1.5 s; we must not enter before it leaves
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from hanzo_torch.backends._build import build_lock
        with build_lock(Path({str(tmp_path)!r})):
            (Path({str(tmp_path)!r}) / "lock").touch()  # torch's marker of a build in progress
            print("held", flush=True)
            time.sleep(1.5)
            (Path({str(tmp_path)!r}) / "lock").unlink()
    """)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    t0 = time.monotonic()
    with build_lock(tmp_path):
        waited = time.monotonic() - t0
        assert child.poll() is not None or waited > 0.5
        assert not (tmp_path / "lock").exists()
    assert child.wait(timeout=30) == 0
    assert waited > 0.5
