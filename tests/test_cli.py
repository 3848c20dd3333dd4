"""hanzo-torch command line on tiny GGUF files (in-process, plus one real subprocess run)."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hanzo_torch import cli
from qwen_vocab import add_tokenizer_metadata, toy_tokenizer_metadata


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from gguf_builders import tiny_spec, write_tiny_gguf

    from hanzo_torch.backends import cpu as hcpu

    # load() builds the C++ extension on first use and says so on stderr; build it here, so the
    # tests that count the CLI's stderr lines also pass on a cold extension cache
    hcpu.extension()
    path = tmp_path_factory.mktemp("cli") / "tiny-qwen3.gguf"
    spec = tiny_spec("qwen3", hidden=64, n_head=2, n_head_kv=1, head_dim=32, ffn=128)  # all F32
    return Path(write_tiny_gguf(path, spec, toy_tokenizer_metadata()))


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "mixed.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_uint32("qwen2.block_count", 1)
    w.add_string("general.name", "mixed test")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    w.add_array("some.list", [1, 2, 3, 4, 5, 6])
    add_tokenizer_metadata(w, toy_tokenizer_metadata())
    q8 = gguf.quants.quantize(np.ones((4, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def run(argv, capsys) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------- generate
def test_generate_streams_same_text_as_api(tiny_model, capsys):
    import hanzo_torch

    rc, out, err = run(["generate", "-m", tiny_model, "-p", "hello", "-n", 6, "--temp", 0, "--max-context", 64],
                       capsys)
    assert rc == 0
    model = hanzo_torch.load(tiny_model, max_context=64)
    expected = model.generate("hello", max_new_tokens=6, temperature=0).text
    assert out == expected + "\n"
    assert re.search(r"prefill: 2 tokens in [\d.]+ s \([\d.]+ tok/s\) \| decode: \d+ tokens", err)
    assert "loaded in" in err and err.count("\n") == 2


@pytest.mark.parametrize("flag, want", [([], None), (["--mmap"], True), (["--no-mmap"], False)])
def test_mmap_flags_reach_load(tiny_model, capsys, monkeypatch, flag, want):
    import hanzo_torch

    real, seen = hanzo_torch.load, []
    monkeypatch.setattr(hanzo_torch, "load", lambda *a, **kw: seen.append(kw.get("mmap", "absent")) or real(*a, **kw))
    rc, out, _ = run(["generate", "-m", tiny_model, "-p", "hello", "-n", 2, "--temp", 0, "--max-context", 32, *flag],
                     capsys)
    assert rc == 0 and out
    assert seen == [want]


def test_generate_seed_sampling_flags_and_stdin(tiny_model, capsys, monkeypatch):
    args = ["generate", "-m", tiny_model, "--max-context", 32, "-p", "hi", "-n", 8, "--temp", 1.5, "--top-k", 0, "--top-p", 1,
            "--min-p", 0, "--ignore-eos", "-q"]
    a = run(args + ["--seed", 7], capsys)
    b = run(args + ["--seed", 7], capsys)
    assert a[0] == 0 and a[1] == b[1] and a[2] == ""  # -q: no stats
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi"))
    c = run([x for x in args if x not in ("-p", "hi")] + ["--seed", 7], capsys)
    assert c[1] == a[1]  # prompt read from piped stdin


def test_generate_chat_uses_template(tiny_model, capsys):
    from hanzo_torch.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(tiny_model)
    msgs = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hey"}]
    n_prompt = len(tok.encode(tok.apply_chat_template(msgs)))
    rc, out, err = run(["generate", "-m", tiny_model, "-p", "hey", "--system", "be nice", "-n", 2,
                        "--max-context", 64], capsys)
    assert rc == 0 and f"prefill: {n_prompt} tokens" in err


def test_generate_default_model_is_pulled(tiny_model, capsys, monkeypatch):
    from hanzo_torch import hub

    calls = []
    monkeypatch.setattr(hub, "pull", lambda quiet=False, **kw: calls.append(quiet) or tiny_model)
    rc, out, err = run(["generate", "-p", "x", "-n", 1, "-q", "--max-context", 16], capsys)
    assert rc == 0 and calls == [True]


# ---------------------------------------------------------------------- bench / inspect / pull
def test_bench_table(tiny_model, capsys):
    rc, out, err = run(["bench", "-m", tiny_model, "-p", "8,16", "-n", "4", "-r", 2, "--warmup", 0], capsys)
    assert rc == 0
    lines = out.strip().splitlines()
    assert lines[0].startswith("| model |") and "t/s (median)" in lines[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [r[5] for r in rows] == ["pp8", "pp16", "tg4"]
    for r in rows:
        assert r[0] == "qwen3 F32" and r[3] == "cpu" and r[4] == "float32" and float(r[6]) > 0 and r[8] == "2"
    from hanzo_torch.backends import cpu

    if cpu.extension() is not None:  # the instruction set in use is on the stderr lines
        assert f"backend: cpu, ISA {cpu.ISA_NAMES[cpu.default_isa()]}" in err


def test_inspect_backends(capsys):
    rc, out, err = run(["inspect", "--backends"], capsys)
    assert rc == 0
    lines = out.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["reference", "cpu", "mps", "triton", "vulkan"]
    assert lines[2].startswith("mps: unavailable (") or lines[2].startswith("mps: available")
    assert "unavailable" in lines[3] or "available" in lines[3]
    assert lines[4].startswith("vulkan: available on vulkan") or lines[4].startswith("vulkan: unavailable (")
    rc, out, err = run(["inspect"], capsys)
    assert rc == 2 and "--backends" in err


def test_inspect(mixed_file, capsys):
    rc, out, err = run(["inspect", mixed_file], capsys)
    assert rc == 0 and err == ""
    assert "architecture: qwen2" in out and "file type:    Q8_0" in out
    assert re.search(r"general\.name\s+'mixed test'", out)
    assert re.search(r"some\.list\s+\[6 x (U?INT\d+)\] \[1, 2, 3, 4, \.\.\.\]", out)
    assert re.search(r"tokenizer\.ggml\.tokens\s+\[263 x STRING\]", out)
    assert re.search(r"blk\.0\.attn_q\.weight\s+Q8_0\s+4x64\s+272\b", out)  # 4 rows x 2 blocks x 34 bytes
    assert re.search(r"output_norm\.weight\s+F16\s+64\s+128\b", out)
    assert "parameters:   320 (320)" in out
    rc, out, _ = run(["inspect", "--no-tensors", mixed_file], capsys)
    assert rc == 0 and "blk.0.attn_q.weight" not in out and "Q8_0" in out  # formats summary stays


def test_pull_prints_path(capsys, monkeypatch, tmp_path):
    from hanzo_torch import hub

    seen = {}

    def fake_pull(quiet=False, force=False, **kw):
        seen.update(quiet=quiet, force=force)
        return tmp_path / "m.gguf"

    monkeypatch.setattr(hub, "pull", fake_pull)
    rc, out, _ = run(["pull", "-q", "--force"], capsys)
    assert rc == 0 and out.strip() == str(tmp_path / "m.gguf") and seen == {"quiet": True, "force": True}

    def failing_pull(quiet=False, force=False, **kw):
        raise hub.HubError("sha256 mismatch for x.gguf: got 00, expected 11;\nthe download is corrupted")

    monkeypatch.setattr(hub, "pull", failing_pull)
    rc, out, err = run(["pull"], capsys)
    assert rc == 1 and err.count("\n") == 1 and "error: sha256 mismatch" in err


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("command", [["inspect"], ["generate", "-p", "x", "-m"], ["bench", "-m"]])
def test_missing_and_non_gguf_files(command, tmp_path, capsys):
    rc, out, err = run(command + [tmp_path / "nope.gguf"], capsys)
    assert rc == 1 and err == f"hanzo-torch: error: file not found: {tmp_path / 'nope.gguf'}\n"
    text = tmp_path / "notes.txt"
    text.write_text("hello world")
    rc, out, err = run(command + [text], capsys)
    assert rc == 1 and "is not a GGUF file" in err and err.count("\n") == 1
    rc, out, err = run(command + [tmp_path], capsys)
    assert rc == 1 and "is a directory" in err
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)  # header counts past the end
    rc, out, err = run(command + [broken], capsys)
    assert rc == 1 and err.startswith("hanzo-torch: error: ") and err.count("\n") == 1 and out == ""


def test_usage_errors_exit_2(tiny_model, capsys):
    for argv in ([], ["frobnicate"], ["generate", "-n", "abc"], ["bench", "-p", "-5"], ["bench", "-r", "0"],
                 ["generate", "--dtype", "int8"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2, argv
    capsys.readouterr()
    rc, _, err = run(["generate", "-m", tiny_model, "-p", "x", "--temp", "-1"], capsys)
    assert rc == 2 and "error: --temp must be" in err and "loaded" not in err
    rc, _, err = run(["bench", "-m", tiny_model, "-p", "0", "-n", "0"], capsys)
    assert rc == 1 and "nothing to run" in err


def test_bad_arguments_rejected_before_download(capsys, monkeypatch):
    """Without -m the default model would be downloaded (1.1 GB): bad sampling flags, -n and
    --device are refused first."""
    from hanzo_torch import hub

    def no_pull(*a, **kw):
        raise AssertionError("pull called before the arguments were checked")

    monkeypatch.setattr(hub, "pull", no_pull)
    for flags, msg in ((["--temp", "-1"], "--temp must be"), (["--top-p", "0"], "--top-p must be"),
                       (["--min-p", "1"], "--min-p must be"), (["--repeat-penalty", "0"], "--repeat-penalty must be"),
                       (["-n", "-3"], "-n must be >= 0"), (["--top-k", "-1"], "--top-k must be"),
                       (["--device", "nonsense"], "bad --device")):
        rc, _, err = run(["generate", "-p", "x", *flags], capsys)
        assert rc in (1, 2) and msg in err and err.count("\n") == 1, (flags, err)


def test_zero_tokens_threads_and_debug(tiny_model, capsys):
    threads = torch.get_num_threads()
    try:
        rc, out, err = run(["generate", "-m", tiny_model, "-p", "hello", "-n", 0, "-t", 1], capsys)
        assert rc == 0 and "nan" not in err and "decode: 0 tokens" in err and "no timing" in err
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(SystemExit):
        cli.main(["generate", "-t", "0", "-p", "x"])
    capsys.readouterr()
    broken = tiny_model.parent / "broken-debug.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    rc, _, err = run(["generate", "-m", broken, "-p", "x"], capsys)
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err
    rc, _, err = run(["--debug", "generate", "-m", broken, "-p", "x"], capsys)
    assert rc == 1 and "Traceback (most recent call last)" in err and "GGUFError" in err
    rc, _, err = run(["generate", "-m", broken, "-p", "x", "--debug"], capsys)
    assert rc == 1 and "Traceback (most recent call last)" in err


@pytest.mark.parametrize("argv", [["quantize", "{missing}", "{out}", "Q4_K_M"],
                                  ["export", "{missing}", "-o", "{out}"],
                                  ["convert", "{missing}", "-o", "{out}"]])
def test_debug_after_every_file_command(tmp_path, capsys, argv):
    """--debug is accepted after quantize, export and convert too (as after generate): the traceback
    of the one-line error."""
    names = {"missing": str(tmp_path / "missing.gguf"), "out": str(tmp_path / "out.bin")}
    argv = [a.format(**names) for a in argv]
    rc, _, err = run(argv, capsys)
    assert rc == 1 and "Traceback" not in err and err.count("\n") == 1
    rc, _, err = run(argv + ["--debug"], capsys)
    assert rc == 1 and "Traceback (most recent call last)" in err


def test_malformed_model_is_one_line(tiny_model, tmp_path, capsys):
    """A file that parses but describes an impossible model (head_count 0) used to reach the
    user as a ZeroDivisionError traceback."""
    import hanzo_torch
    from hanzo_torch import GGUFFile

    with GGUFFile(tiny_model) as f:
        meta = {k: f.metadata[k] for k in f.metadata}
        types = {k: f.metadata.value_type(k) for k in f.metadata}
        arrays = {k: (types[k], f.metadata.element_type(k)) for k in f.metadata if f.metadata.element_type(k)}
        tensors = {n: t.dequantize(torch.float32) for n, t in f.tensors.items()}
    meta["qwen3.attention.head_count"] = 0
    bad = tmp_path / "heads0.gguf"
    hanzo_torch.save_gguf(bad, tensors, {k: v for k, v in meta.items() if k != "general.architecture"},
                          architecture="qwen3", metadata_types={**types, **arrays})
    rc, out, err = run(["generate", "-m", bad, "-p", "x"], capsys)
    assert rc == 1 and out == "" and err.count("\n") == 1
    assert f"error: {bad}: metadata key 'qwen3.attention.head_count' = 0 must be > 0" in err


def test_named_pipe_model_does_not_hang(tmp_path, capsys):
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    for argv in (["inspect", fifo], ["generate", "-m", fifo, "-p", "x"]):
        rc, _, err = run(argv, capsys)
        assert rc == 1 and "is not a regular file" in err and err.count("\n") == 1


def test_inspect_escapes_control_characters(tmp_path, capsys):
    import hanzo_torch

    path = tmp_path / "esc.gguf"
    hanzo_torch.save_gguf(path, {"blk.0.\x1b[31mred\x07.weight": torch.zeros(2, 32)},
                          {"evil.\x1b]0;title\x07key": "value\x1b[2J\u202e", "general.name": "n\x9bame"},
                          architecture="qwen3\x1b[H")
    rc, out, err = run(["inspect", path], capsys)
    assert rc == 0
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out and "\u202e" not in out
    assert "blk.0.\\x1b[31mred\\x07.weight" in out and "evil.\\x1b]0;title\\x07key" in out
    assert "architecture: qwen3\\x1b[H" in out


def test_interrupted_pull_says_so(capsys, monkeypatch):
    from hanzo_torch import hub

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(hub, "pull", interrupted)
    rc, out, err = run(["pull"], capsys)
    assert rc == 130 and "download interrupted" in err


def test_no_prompt_on_a_terminal(tiny_model, capsys, monkeypatch):
    class TTY(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", TTY())
    rc, _, err = run(["generate", "-m", tiny_model], capsys)
    assert rc == 1 and "no prompt" in err


def test_module_entry_point_subprocess(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hanzo_torch", "inspect", str(tmp_path / "missing.gguf")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"hanzo-torch: error: file not found: {tmp_path / 'missing.gguf'}"]


def test_inspect_shows_undecodable_value_and_goes_on(tmp_path, capsys):
    import hanzo_torch

    path = tmp_path / "badutf8.gguf"
    hanzo_torch.save_gguf(path, {"w.weight": torch.zeros(2, 32)}, {"a.list": ["okay", "qzqz"], "b.after": 5},
                          architecture="qwen3")
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"qzqz", b"q\xffzq", 1))  # invalid UTF-8 inside an array element
    rc, out, err = run(["inspect", path], capsys)
    assert rc == 0 and err == ""
    assert re.search(r"a\.list\s+<unreadable: .*UTF-8", out) and re.search(r"b\.after\s+5", out)
