"""Fork-server fuzzer of the whole path a GGUF file takes: ``hanzo_torch.load()`` -> tokenizer ->
one forward and one generated token.

Run as a process of its own (``python -c "from load_fuzz import serve; serve()" SEED FIRST N
TIMEOUT_S``, with ``tests/`` on ``sys.path``): it imports hanzo_torch and builds three tiny valid
models (Qwen3 with a Q8_0 layer, Qwen3-MoE, Qwen2; the 263-token toy vocabulary) once, then
forks one child per case. The child applies one seeded mutation to a base file, writes it, runs
the path under an address-space limit and reports its outcome on a pipe; the server kills it
after ``TIMEOUT_S`` seconds. One JSON line per case goes to stdout:
``{"case": i, "mutation": "...", "outcome": "...", "detail": "..."}``.

Outcomes: ``ok`` (loaded, finite logits, a token generated and decoded), ``GGUFError`` (the file
was refused with hanzo_torch's error class), and the failures ``other`` (any other exception),
``nonfinite`` (accepted, but the logits hold NaN/inf), ``timeout`` and ``crash`` (the child died
from a signal or exited without a report).

Mutations are semantic (hyper-parameters set to absurd values or retyped or removed, tokenizer
arrays broken, tensors dropped, added, renamed, reshaped, retyped or filled with NaN/inf/huge
values, the architecture changed) or bytes of the serialized file (overwrites, bit flips,
integer smashes, insertions, deletions, truncations, mostly in the header).
"""
from __future__ import annotations

import gc
import json
import math
import os
import random
import resource
import select
import signal
import struct
import sys
import tempfile
import time

from byte_mutations import mutate

MEMORY_LIMIT = 4 << 30  # address space of a case (the torch import itself maps ~1 GB)

_INTS = [0, 1, 2, 3, 5, 7, 31, 32, 33, 63, 64, 65, 127, 128, 255, 256, 262, 263, 264, 1000, 4095, 4096,
         32768, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1,
         -1, -2, -(2**31), -(2**63)]
_FLOATS = [0.0, -0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e-45, 1e-12, 1e-9, 0.5, 1.0, 2.0,
           1e5, 1e6, 1e30, 3.4e38, 1e300, -1e6]
_TENSOR_VALUES = [float("nan"), float("inf"), float("-inf"), 1e30, -1e30, 1e38, 65504.0 * 4, 1e-30, 0.0]


def _int_types():
    from gguf import GGUFValueType as VT

    return {VT.UINT8: (0, 2**8 - 1), VT.INT8: (-(2**7), 2**7 - 1), VT.UINT16: (0, 2**16 - 1),
            VT.INT16: (-(2**15), 2**15 - 1), VT.UINT32: (0, 2**32 - 1), VT.INT32: (-(2**31), 2**31 - 1),
            VT.UINT64: (0, 2**64 - 1), VT.INT64: (-(2**63), 2**63 - 1)}


class Base:
    """A valid tiny model as editable pieces: metadata values, their GGUF types, tensors."""

    def __init__(self, path: str):
        import torch

        from hanzo_torch import GGUFFile, GGUFTensor

        with GGUFFile(path) as f:
            self.arch = f.architecture
            self.meta, self.types = {}, {}
            for k in f.metadata:
                v = f.metadata[k]
                self.meta[k] = v.tolist() if isinstance(v, torch.Tensor) else v
                vt = f.metadata.value_type(k)
                self.types[k] = (vt, f.metadata.element_type(k)) if f.metadata.element_type(k) is not None else vt
            self.tensors = {}
            for name, info in f.tensor_info.items():
                packed = f.packed(name).clone()  # a copy, not a view of the mapping
                self.tensors[name] = GGUFTensor(packed, info.qtype, info.shape)
        with open(path, "rb") as fh:
            self.raw = fh.read()
        with GGUFFile(path) as f:
            self.header_end = f.data_offset


def _write(path: str, meta: dict, types: dict, tensors: dict) -> None:
    from hanzo_torch import save_gguf

    arch = meta.get("general.architecture", "")
    rest = {k: v for k, v in meta.items() if k != "general.architecture"}
    save_gguf(path, tensors, rest, architecture=arch if isinstance(arch, str) else "",
              metadata_types={k: t for k, t in types.items() if k in rest})


def _dense(t):
    import torch

    return t.dequantize(torch.float32).clone() if hasattr(t, "dequantize") else t.clone()


def semantic_mutation(base: Base, rng: random.Random) -> tuple[dict, dict, dict, str]:
    """A mutated (metadata, types, tensors) of ``base`` and a description."""
    import torch
    from gguf import GGUFValueType as VT

    meta, types, tensors = dict(base.meta), dict(base.types), dict(base.tensors)
    a = base.arch
    hp = [k for k in meta if k.startswith(a + ".")]
    tok_ids = ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id"]
    kind = rng.choice(["int", "int", "int", "float", "float", "retype", "retype", "drop", "tokenizer", "tokenizer",
                       "tokenizer", "shape", "tensor_set", "values", "values", "dtype", "arch"])
    if kind == "int":
        key = rng.choice([k for k in hp if not isinstance(meta[k], float)] + tok_ids)
        v = rng.choice(_INTS + [rng.randrange(-(2**63), 2**64)])
        fits = [t for t, (lo, hi) in _int_types().items() if lo <= v <= hi]
        meta[key], types[key] = v, rng.choice(fits)
        return meta, types, tensors, f"int {key}={v} ({types[key].name})"
    if kind == "float":
        key = rng.choice([f"{a}.rope.freq_base", f"{a}.attention.layer_norm_rms_epsilon"])
        v = rng.choice(_FLOATS)
        t = VT.FLOAT64 if abs(v) > 3.4e38 and math.isfinite(v) else rng.choice([VT.FLOAT32, VT.FLOAT64])
        meta[key], types[key] = v, t
        return meta, types, tensors, f"float {key}={v!r} ({t.name})"
    if kind == "retype":
        key = rng.choice(hp + tok_ids + ["tokenizer.ggml.add_bos_token", "tokenizer.ggml.pre",
                                         "tokenizer.ggml.model", "tokenizer.chat_template"])
        v = meta.get(key, 1)
        to = rng.choice(["FLOAT32", "BOOL", "STRING", "ARRAY", "INT8", "UINT64"])
        num = v if isinstance(v, (int, float)) and not isinstance(v, bool) else 1
        if to == "FLOAT32":
            meta[key], types[key] = float(num), VT.FLOAT32
        elif to == "BOOL":
            meta[key], types[key] = bool(num), VT.BOOL
        elif to == "STRING":
            meta[key], types[key] = str(v), VT.STRING
        elif to == "ARRAY":
            meta[key], types[key] = [int(num) if math.isfinite(num) else 1] * 2, (VT.ARRAY, VT.INT32)
        elif to == "INT8":
            meta[key], types[key] = max(-128, min(127, int(num) if math.isfinite(num) else 0)), VT.INT8
        else:
            meta[key], types[key] = abs(int(num)) if math.isfinite(num) else 0, VT.UINT64
        return meta, types, tensors, f"retype {key} -> {to}"
    if kind == "drop":
        key = rng.choice(hp + ["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                               "tokenizer.ggml.model", "general.architecture"] + tok_ids)
        meta.pop(key, None)
        return meta, types, tensors, f"drop {key}"
    if kind == "tokenizer":
        return _tokenizer_mutation(meta, types, tensors, rng)
    names = list(tensors)
    name = rng.choice(names)
    if kind == "shape":
        t = _dense(tensors[name])
        how = rng.choice(["drop_row", "add_row", "transpose", "flatten", "unsqueeze"])
        if how == "drop_row" and t.shape[0] > 1:
            t = t[:-1]
        elif how == "add_row":
            t = torch.cat([t, t[:1]])
        elif how == "transpose" and t.dim() >= 2:
            t = t.transpose(-1, -2)
        elif how == "flatten":
            t = t.reshape(-1)
        else:
            t = t.unsqueeze(0)
        tensors[name] = t.contiguous()
        return meta, types, tensors, f"shape {name} {how} -> {tuple(t.shape)}"
    if kind == "tensor_set":
        how = rng.choice(["drop", "extra", "rename", "duplicate_layer"])
        if how == "drop":
            del tensors[name]
        elif how == "extra":
            tensors[rng.choice(["blk.9.attn_q.weight", "foo.weight", "blk.0.extra.weight"])] = torch.zeros(4, 32)
        elif how == "rename":
            new = name.replace("blk.0.", rng.choice(["blk.5.", "blk.00.", "blk.1.", "blk.65535."]), 1)
            tensors = {(new if n == name else n): v for n, v in tensors.items()}
        else:
            for n in [n for n in names if n.startswith("blk.0.")]:
                tensors["blk.7." + n[len("blk.0."):]] = tensors[n]
        return meta, types, tensors, f"tensors {how} {name}"
    if kind == "values":
        t = _dense(tensors[name])
        v = rng.choice(_TENSOR_VALUES)
        where = rng.choice(["one", "all", "row"])
        flat = t.view(-1)
        if where == "one":
            flat[rng.randrange(flat.numel())] = v
        elif where == "all":
            flat.fill_(v)
        else:
            t.view(-1, t.shape[-1])[0].fill_(v)
        tensors[name] = t
        return meta, types, tensors, f"values {name} {where}={v!r}"
    if kind == "dtype":
        t = _dense(tensors[name])
        to = rng.choice(["F16", "BF16", "Q8_0", "Q4_0"])
        if to == "F16":
            tensors[name] = t.half()
        elif to == "BF16":
            tensors[name] = t.bfloat16()
        elif t.shape[-1] % 32 == 0:
            from hanzo_torch import GGUFTensor, quantize

            tensors[name] = GGUFTensor(quantize(t, to), to, tuple(t.shape))
        return meta, types, tensors, f"dtype {name} -> {to}"
    new = rng.choice(["qwen2", "qwen3", "qwen3moe", "llama", "", "QWEN3", "qwen3\x1b[2J"])
    old = meta.get("general.architecture")
    meta["general.architecture"] = new
    if rng.random() < 0.5:  # also rename the hyper-parameter keys
        meta = {(new + k[len(old):] if k.startswith(old + ".") else k): v for k, v in meta.items()}
        types = {(new + k[len(old):] if k.startswith(old + ".") else k): v for k, v in types.items()}
    return meta, types, tensors, f"arch -> {new!r}"


def _tokenizer_mutation(meta, types, tensors, rng):
    from gguf import GGUFValueType as VT

    tokens = list(meta["tokenizer.ggml.tokens"])
    n = len(tokens)
    how = rng.choice(["tokens_short", "tokens_long", "tokens_nested", "types_nested", "types_float", "types_bad",
                      "types_len", "types_bool", "merges_nested", "merges_bad", "merges_unknown", "merges_dup",
                      "template_int", "template_broken", "template_deep", "pre", "model", "add_bos", "id_float",
                      "id_bool", "id_range", "token_empty", "token_dup_control", "token_ctrl"])
    k_tok, k_typ, k_mer = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"
    if how == "tokens_short":
        meta[k_tok] = tokens[:-1]
    elif how == "tokens_long":
        meta[k_tok] = tokens + ["zz"]
        meta[k_typ] = list(meta[k_typ]) + [1]
    elif how == "tokens_nested":
        meta[k_tok], types[k_tok] = [[t] for t in tokens], (VT.ARRAY, VT.ARRAY)
    elif how == "types_nested":
        meta[k_typ], types[k_typ] = [[int(t)] for t in meta[k_typ]], (VT.ARRAY, VT.ARRAY)
    elif how == "types_float":
        meta[k_typ], types[k_typ] = [float(t) for t in meta[k_typ]], (VT.ARRAY, VT.FLOAT32)
    elif how == "types_bad":
        ty = list(meta[k_typ])
        ty[rng.randrange(n)] = rng.choice([-1, 7, 99, 2**31 - 1])
        meta[k_typ], types[k_typ] = ty, (VT.ARRAY, VT.INT32)
    elif how == "types_len":
        meta[k_typ] = list(meta[k_typ])[: rng.randrange(1, n)]
    elif how == "types_bool":
        meta[k_typ], types[k_typ] = [True] * n, (VT.ARRAY, VT.BOOL)
    elif how == "merges_nested":
        meta[k_mer], types[k_mer] = [m.split(" ") for m in meta[k_mer]], (VT.ARRAY, VT.ARRAY)
    elif how == "merges_bad":
        meta[k_mer] = list(meta[k_mer]) + [rng.choice(["abc", " ", "a  b", "a b c"])]
    elif how == "merges_unknown":
        meta[k_mer] = list(meta[k_mer]) + ["zq qz"]
    elif how == "merges_dup":
        meta[k_mer] = list(meta[k_mer]) * 2
    elif how == "template_int":
        meta["tokenizer.chat_template"], types["tokenizer.chat_template"] = 7, VT.INT32
    elif how == "template_broken":
        meta["tokenizer.chat_template"] = rng.choice(["{% if %}", "{{ x", "{% for %}{% endif %}", "{% raw %}"])
    elif how == "template_deep":
        meta["tokenizer.chat_template"] = "{% if 1 %}" * 2000 + "x" + "{% endif %}" * 2000
    elif how == "pre":
        meta["tokenizer.ggml.pre"] = rng.choice(["falcon", "", "qwen2\x00"])
    elif how == "model":
        meta["tokenizer.ggml.model"] = rng.choice(["llama", "bert", ""])
    elif how == "add_bos":
        meta["tokenizer.ggml.add_bos_token"], types["tokenizer.ggml.add_bos_token"] = 1, VT.UINT8
    elif how == "id_float":
        meta["tokenizer.ggml.bos_token_id"], types["tokenizer.ggml.bos_token_id"] = 1.0, VT.FLOAT32
    elif how == "id_bool":
        meta["tokenizer.ggml.eos_token_id"], types["tokenizer.ggml.eos_token_id"] = True, VT.BOOL
    elif how == "id_range":
        key = rng.choice(["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"])
        meta[key], types[key] = rng.choice([n, n + 1, 2**32 - 1, -1]), VT.INT64
    elif how == "token_empty":
        tokens[rng.randrange(n)] = ""
        meta[k_tok] = tokens
    elif how == "token_dup_control":
        tokens[rng.randrange(256)] = "<|im_end|>"
        meta[k_tok] = tokens
    else:
        tokens[rng.randrange(n)] = "\x1b[31m\x00"
        meta[k_tok] = tokens
    return meta, types, tensors, f"tokenizer {how}"


_SMASH = [0, 1, 2, 3, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x10000, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63,
          2**64 - 1]


def byte_mutation(base: Base, rng: random.Random) -> tuple[bytes, str]:
    def data(buf: bytearray) -> tuple[bytes, str]:  # tensor data: NaN/inf/huge float32 patterns
        i = rng.randrange(base.header_end, len(buf) - 4)
        pat = struct.pack("<f", rng.choice(_TENSOR_VALUES))
        n = rng.choice([1, 1, 16, 256])
        for j in range(n):
            o = i + 4 * j
            if o + 4 <= len(buf):
                buf[o: o + 4] = pat
        return bytes(buf), f"data x{n}@{i}"

    out, how = mutate(base.raw, base.header_end, rng,
                      kinds=["byte", "byte", "bits", "int", "int", "truncate", "insert", "delete", "data"],
                      widths=[2, 4, 8], smash=_SMASH, extra={"data": data})
    return out, f"bytes {how}"


def run_path(path: str) -> str:
    """load -> tokenizer -> one forward -> one generated token; returns "ok" or raises."""
    import torch

    import hanzo_torch

    model = hanzo_torch.load(path)
    tok = model.tokenizer if model._tokenizer is not None else None
    ids = tok.encode("hello world") if tok is not None else [1, 2, 3]
    ids = ids[: model.max_context] or [0]  # a file may declare a context shorter than the prompt
    logits = model(torch.tensor([ids]), last_only=True)
    if not bool(torch.isfinite(logits).all()):
        return "nonfinite"
    out = model.generate(ids, max_new_tokens=1, temperature=0, ignore_eos=True, tokenizer=tok)
    if len(out.token_ids) != 1:
        raise AssertionError(f"generated {out.token_ids}")
    if tok is not None:
        tok.decode(out.token_ids)
    return "ok"


def _child(bases, seed: int, case: int, tmpdir: str, wfd: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    report = {"case": case}
    try:
        rng = random.Random(f"{seed}:{case}")
        base = rng.choice(bases)
        path = os.path.join(tmpdir, f"case{case}.gguf")
        if rng.random() < 0.6:
            meta, types, tensors, how = semantic_mutation(base, rng)
            report["mutation"] = f"{base.arch}: {how}"
            try:
                _write(path, meta, types, tensors)
            except (ValueError, TypeError, OverflowError, KeyError) as exc:  # the writer refuses it
                report["outcome"], report["detail"] = "unwritable", f"{type(exc).__name__}: {exc}"[:300]
                return
        else:
            data, how = byte_mutation(base, rng)
            report["mutation"] = f"{base.arch}: {how}"
            with open(path, "wb") as fh:
                fh.write(data)
        from hanzo_torch import GGUFError

        try:
            report["outcome"] = run_path(path)
        except GGUFError as exc:
            report["outcome"], report["detail"] = "GGUFError", str(exc)[:300]
        except BaseException as exc:  # noqa: BLE001 - classified, reported
            import traceback

            report["outcome"] = "other"
            report["detail"] = f"{type(exc).__name__}: {exc}"[:300] + " | " + "".join(
                traceback.format_exception(exc)[-3:])[-600:]
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
    finally:
        os.write(wfd, json.dumps(report).encode())
        os.close(wfd)


def _run_case(bases, seed: int, case: int, tmpdir: str, timeout_s: float) -> dict:
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(rfd)
            _child(bases, seed, case, tmpdir, wfd)
        except BaseException:  # noqa: BLE001
            code = 3
        os._exit(code)
    os.close(wfd)
    chunks, deadline, timed_out = [], time.monotonic() + timeout_s, False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([rfd], [], [], left)
        if ready:
            b = os.read(rfd, 65536)
            if not b:
                break
            chunks.append(b)
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(rfd)
    try:
        report = json.loads(b"".join(chunks)) if chunks else {"case": case}
    except ValueError:
        report = {"case": case}
    if timed_out:
        report["outcome"] = "timeout"
    elif os.WIFSIGNALED(status):
        report["outcome"], report["detail"] = "crash", f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    elif "outcome" not in report:
        report["outcome"], report["detail"] = "crash", f"exit status {os.WEXITSTATUS(status)} without a report"
    return report


def build_bases(folder: str) -> list:
    from gguf_builders import tiny_spec, write_tiny_gguf
    from qwen_vocab import toy_tokenizer_metadata

    meta = toy_tokenizer_metadata()
    common = dict(hidden=64, n_head=2, n_head_kv=1, head_dim=32, ffn=64, context_length=256)
    specs = [tiny_spec("qwen3", n_layer=2, layer_qtypes={0: dict(attn="Q8_0")}, **common),
             tiny_spec("qwen3moe", n_layer=1, n_expert=4, n_expert_used=2, expert_ffn=32, **common),
             tiny_spec("qwen2", n_layer=1, **{**common, "tied": False})]
    bases = []
    for spec in specs:
        p = write_tiny_gguf(os.path.join(folder, f"base-{spec.arch}.gguf"), spec, meta)
        bases.append(Base(p))
    return bases


def serve(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    seed, first, n, timeout_s = int(argv[0]), int(argv[1]), int(argv[2]), float(argv[3])
    import torch

    torch.set_num_threads(1)  # before any parallel region: forked children inherit no thread pool
    import hanzo_torch  # noqa: F401
    from hanzo_torch.backends import cpu

    cpu.extension()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="hanzo-load-fuzz-", dir=shm) as tmpdir:  # files in memory
        bases = build_bases(tmpdir)
        for b in bases:  # the unmutated bases must pass, or the fuzzer tests nothing
            p = os.path.join(tmpdir, "check.gguf")
            _write(p, b.meta, b.types, b.tensors)
            assert run_path(p) == "ok", b.arch
        gc.collect()
        gc.freeze()  # the children's collections then skip (and do not copy) the server's objects
        print(json.dumps({"ready": True}), flush=True)
        for case in range(first, first + n):
            print(json.dumps(_run_case(bases, seed, case, tmpdir, timeout_s)), flush=True)
