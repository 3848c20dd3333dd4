"""benchmarks/bench_model.py's llama-bench engines against stand-in binaries: the flags each row
sends (``-d`` for llama.cpp, ``-gp D,N`` for ik_llama.cpp), the record each row picks out of the
JSON, n/a rows, and the errors for a path that is not a llama-bench."""
import importlib.util
import json
import os
import stat
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_model", os.path.join(ROOT, "benchmarks", "bench_model.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_model"] = mod  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("bench_model", None)


def fake_bench(tmp_path, help_flags: str, name: str = "llama-bench"):
    """An executable that prints ``help_flags`` for --help, else logs its argv and prints records
    for what it was asked, with a speed that encodes the request (so a wrong pick shows)."""
    log = tmp_path / f"{name}.log"
    exe = tmp_path / name
    exe.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, sys
        a = sys.argv[1:]
        if "--help" in a:
            print({help_flags!r}); sys.exit(0)
        open({str(log)!r}, "a").write(" ".join(a) + "\\n")
        def val(f, d="0"):
            return a[a.index(f) + 1] if f in a else d
        p, n, d = int(val("-p")), int(val("-n")), int(val("-d"))
        recs = []
        if p: recs.append(dict(n_prompt=p, n_gen=0, n_depth=d, avg_ts=1000.0 + p + d, build_number=1, build_commit="x"))
        if n: recs.append(dict(n_prompt=0, n_gen=n, n_depth=d, avg_ts=100.0 + n + d, build_number=1, build_commit="x"))
        if "-gp" in a:
            dd, nn = map(int, val("-gp").split(","))
            recs.append(dict(n_prompt=dd, n_gen=nn, avg_ts=10.0 + nn + dd / 1000, build_number=2, build_commit="y"))
        print(json.dumps(recs))
        """))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe), log


LLAMA_HELP = "  -p, --n-prompt <n>\n  -n, --n-gen <n>\n  -d, --n-depth <n>\n"
IK_HELP = "  -p, --n-prompt <n>\n  -n, --n-gen <n>\n  -gp <pp,tg>\n  -rtr, --run-time-repack <0|1>\n"


def test_llama_bench_rows(bench, tmp_path):
    exe, log = fake_bench(tmp_path, LLAMA_HELP)
    e = bench.LlamaBench(exe, "m.gguf", 2)
    rows = bench.parse_rows("pp512,tg128,tg32@d2048,pp64@d512")
    got = [e.measure(r, [], []) for r in rows]
    assert got == [1512.0, 228.0, 100.0 + 32 + 2048, 1000.0 + 64 + 512]
    lines = log.read_text().splitlines()
    assert "-d 2048" in lines[2] and "-n 32" in lines[2] and "-d" not in lines[0].split()


def test_ik_llama_bench_rows(bench, tmp_path):
    exe, log = fake_bench(tmp_path, IK_HELP, "ik-bench")
    e = bench.LlamaBench(exe, "m.gguf", 2, flag="--ik-llama-bench", name="ik_llama.cpp llama-bench",
                         extra=["-rtr", "1"])
    assert e.has_depth and not e.has_d and e.name == "ik_llama.cpp llama-bench -rtr 1"
    assert e.measure(bench.Row("tg", 32, 4096), [], []) == pytest.approx(10.0 + 32 + 4.096)
    assert e.measure(bench.Row("pp", 512, 2048), [], []) is None  # no pp at depth: n/a, not run
    assert e.measure(bench.Row("tg", 128), [], []) == 228.0
    lines = log.read_text().splitlines()
    assert len(lines) == 2
    assert "-gp 4096,32" in lines[0] and "-rtr 1" in lines[0] and "-d" not in lines[0].split()
    assert e.version == "build 1 (x)"


def test_llama_bench_bad_paths(bench, tmp_path):
    with pytest.raises(ValueError, match="--ik-llama-bench: .* is not an executable file"):
        bench.LlamaBench(str(tmp_path / "missing"), "m.gguf", 2, flag="--ik-llama-bench")
    exe, _ = fake_bench(tmp_path, "usage: something else", "other")
    with pytest.raises(ValueError, match="does not list --n-prompt"):
        bench.LlamaBench(exe, "m.gguf", 2)


def test_no_depth_flag_gives_na(bench, tmp_path):
    exe, log = fake_bench(tmp_path, "  -p, --n-prompt <n>\n  -n, --n-gen <n>\n", "old-bench")
    e = bench.LlamaBench(exe, "m.gguf", 2)
    assert not e.has_depth and e.measure(bench.Row("tg", 32, 2048), [], []) is None
    assert not log.exists()
