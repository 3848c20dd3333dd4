"""``hanzo-torch`` command line: generate, pull, inspect, bench.

    hanzo-torch generate -p "def quicksort(xs):" -n 128          # default model, pulled on first use
    hanzo-torch generate -m model.gguf --chat -p "Hi" --temp 0    # chat template, greedy
    hanzo-torch pull                                              # fetch the default model
    hanzo-torch inspect model.gguf                                # metadata + tensor table
    hanzo-torch bench -m model.gguf -p 128,512 -n 32 -r 3         # llama-bench style pp/tg tokens/s
    hanzo-torch serve -m model.gguf --port 8080 -np 4 -c 8192     # OpenAI-compatible server
    hanzo-torch finetune -m model.gguf --data train.jsonl -o out/  # LoRA: PEFT adapter + adapter.gguf
    hanzo-torch generate -m model.gguf --lora out/adapter.gguf -p "Hi"  # apply a llama.cpp LoRA adapter

Generated text goes to stdout as it decodes; load time and prefill/decode tokens/s go to
stderr. Errors are one line on stderr: exit 1 for a runtime problem (missing file, not a GGUF,
a malformed model, download failure), 2 for bad arguments (checked before any download or
load); ``--debug`` adds the Python traceback. A traceback without ``--debug`` means a bug.
Text that comes from a file (metadata keys and values, tensor names) is printed with control
characters escaped, so a file cannot send terminal escape sequences.
"""
from __future__ import annotations

import argparse
import os
import stat
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["main", "build_parser"]

PROG = "hanzo-torch"
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_KV_DTYPES = ("auto", "f32", "f16", "bf16", "q8_0")


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 1."""


# ---------------------------------------------------------------------- argument parsing
def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected an integer > 0, got {v}")
    return v


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return vals


def _add_debug(p: argparse.ArgumentParser, default) -> None:
    p.add_argument("--debug", action="store_true", default=default,
                   help="show the Python traceback of an error (for bug reports)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-t", "--threads", type=_positive_int, metavar="N",
                   help="CPU threads for the kernels (torch.set_num_threads; default: torch's)")
    p.add_argument("-m", "--model", metavar="PATH",
                   help="GGUF file (default: Qwen2.5-Coder-1.5B-Instruct Q4_K_M, downloaded on first use)")
    p.add_argument("--device", default="auto", help="torch device: cpu, cuda, cuda:1, vulkan, ... (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=_DTYPES,
                   help="activation dtype (default: the backend's: float32 on cpu and vulkan, bfloat16 on cuda)")
    p.add_argument("--max-context", type=_positive_int, metavar="N", help="KV cache length in tokens")
    p.add_argument("--kv-dtype", default="auto", choices=_KV_DTYPES,
                   help="KV cache type (default: f16 on cpu, the --dtype elsewhere); q8_0: 8.5 bits per value")
    p.add_argument("--mmap", action=argparse.BooleanOptionalAction, default=None,
                   help="cpu: keep the weights as views of the mapped GGUF file (--mmap) or copy them into memory "
                        "advised for transparent huge pages, faster to stream (--no-mmap); default: copy when the "
                        "kernel offers huge pages and the weights take at most half the available memory")
    p.add_argument("--tp", type=_positive_int, metavar="N",
                   help="tensor parallel over N ranks, under torchrun --nproc-per-node N (N must equal the world "
                        "size; gloo on cpu, nccl on cuda); rank 0 prints; generate and bench only (serve refuses it)")


def build_parser() -> argparse.ArgumentParser:
    from .sampling import DEFAULT_MIN_P, DEFAULT_REPEAT_LAST_N, DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P

    parser = argparse.ArgumentParser(prog=PROG, description="Run GGUF LLMs in PyTorch with packed weights.")
    _add_debug(parser, False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    g = sub.add_parser("generate", help="generate text from a prompt (streamed to stdout)")
    _add_debug(g, argparse.SUPPRESS)  # after the command too; SUPPRESS keeps the global value
    _add_model_args(g)
    g.add_argument("-p", "--prompt", help="prompt text ('-' or omitted with piped stdin: read stdin)")
    g.add_argument("-f", "--file", metavar="PATH", help="read the prompt from a file")
    g.add_argument("-n", "--n-predict", type=int, default=256, metavar="N", help="max new tokens (default 256)")
    g.add_argument("--temp", type=float, default=DEFAULT_TEMPERATURE, help=f"temperature, 0 = greedy (default {DEFAULT_TEMPERATURE})")
    g.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help=f"top-k, 0 = off (default {DEFAULT_TOP_K})")
    g.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help=f"top-p, 1 = off (default {DEFAULT_TOP_P})")
    g.add_argument("--min-p", type=float, default=DEFAULT_MIN_P, help=f"min-p, 0 = off (default {DEFAULT_MIN_P})")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="repetition penalty, 1 = off (default 1.0)")
    g.add_argument("--repeat-last-n", type=int, default=DEFAULT_REPEAT_LAST_N,
                   help=f"tokens the penalty looks back at (default {DEFAULT_REPEAT_LAST_N})")
    g.add_argument("--seed", type=int, help="sampling seed (default: random, printed with the stats)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--system", metavar="TEXT", help="system message (implies --chat)")
    g.add_argument("--no-think", action="store_true", help="chat template enable_thinking=False (Qwen3)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")
    g.add_argument("--no-graph", action="store_true",
                   help="decode eagerly (default: replay a captured decode graph on CUDA/HIP, vulkan and the CPU)")
    g.add_argument("--lora", action="append", default=[], metavar="FNAME",
                   help="apply a llama.cpp LoRA adapter GGUF (repeatable; needs the [train] extra: peft)")
    g.add_argument("--lora-scaled", action="append", default=[], nargs=2, metavar=("FNAME", "SCALE"),
                   help="apply a LoRA adapter GGUF scaled by SCALE (repeatable)")
    g.add_argument("-q", "--quiet", action="store_true", help="no stats on stderr")

    p = sub.add_parser("pull", help="download the default model into the cache")
    _add_debug(p, argparse.SUPPRESS)  # after the command too; SUPPRESS keeps the global value
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--force", action="store_true", help="download again even if present")
    p.add_argument("--verify", action="store_true",
                   help="re-hash the whole cached file (sha256) even if its marker matches")

    i = sub.add_parser("inspect", help="show a GGUF file's metadata and tensors")
    _add_debug(i, argparse.SUPPRESS)  # after the command too; SUPPRESS keeps the global value
    i.add_argument("path", nargs="?", help="GGUF file")
    i.add_argument("--backends", action="store_true",
                   help="list the kernel backends instead: available or why not, formats, CPU instruction set")
    i.add_argument("--no-tensors", action="store_true", help="metadata only")

    b = sub.add_parser("bench", help="prompt-processing / generation tokens per second (llama-bench style)")
    _add_debug(b, argparse.SUPPRESS)  # after the command too; SUPPRESS keeps the global value
    _add_model_args(b)
    b.add_argument("-p", "--n-prompt", type=_int_list, default=[128], metavar="N[,N...]",
                   help="prompt lengths to test, 0 = skip (default 128)")
    b.add_argument("-n", "--n-gen", type=_int_list, default=[32], metavar="N[,N...]",
                   help="generation lengths to test, 0 = skip (default 32)")
    b.add_argument("-r", "--repetitions", type=_positive_int, default=3, metavar="R", help="runs per test (default 3)")
    b.add_argument("--warmup", type=int, default=1, metavar="W", help="untimed runs before each test (default 1)")
    b.add_argument("--no-graph", action="store_true",
                   help="tg: decode eagerly (default: replay a captured decode graph on CUDA/HIP, vulkan and the CPU)")

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching (llama-server's flags)")
    _add_debug(s, argparse.SUPPRESS)
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    s.add_argument("-np", "--parallel", type=_positive_int, default=1, metavar="N",
                   help="slots: sequences decoded at once (default 1)")
    s.add_argument("-c", "--ctx-size", type=_positive_int, default=4096, metavar="N",
                   help="total context in tokens, split evenly between the slots (default 4096)")
    s.add_argument("--max-queue", type=_positive_int, default=64, metavar="N",
                   help="requests that may wait for a slot; more get HTTP 503 (default 64)")
    s.add_argument("--alias", metavar="NAME", help="model name in the API (default: the file name)")
    s.add_argument("--no-graph", action="store_true",
                   help="decode eagerly (default: replay a captured decode graph on CUDA/HIP, vulkan and the CPU)")

    e = sub.add_parser("export", help="write the prefill and decode step as a torch-mlir linalg-on-tensors module "
                                      "(needs the [mlir] extra)")
    _add_debug(e, argparse.SUPPRESS)
    e.add_argument("path", help="GGUF file")
    e.add_argument("-o", "--output", required=True, metavar="PATH", help="MLIR file (.mlirbc: bytecode, else text)")
    e.add_argument("-c", "--ctx-size", type=_positive_int, default=512, metavar="N",
                   help="KV cache length S of the exported functions (default 512)")
    e.add_argument("--prefill-len", type=_positive_int, default=16, metavar="T", help="tokens per prefill call (default 16)")
    e.add_argument("--vmfb", metavar="PATH", help="also compile it with IREE for llvm-cpu into this .vmfb")

    q = sub.add_parser("quantize", help="requantize a GGUF file with llama-quantize's per-tensor recipe "
                                        "(e.g. quantize in.gguf out.gguf Q4_K_M)")
    _add_debug(q, argparse.SUPPRESS)
    q.add_argument("input", help="GGUF file (any format hanzo-torch reads)")
    q.add_argument("output", help="output GGUF file (written to OUTPUT.tmp, then renamed)")
    q.add_argument("type", help="Q4_K_M, Q4_K_S, Q5_K_M, Q5_K_S, Q6_K, IQ4_XS, IQ4_NL, IQ3_M, IQ3_S, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                                "F16, BF16, F32; with --imatrix also IQ3_XXS, IQ2_M, IQ2_S, IQ2_XS, IQ2_XXS, IQ1_M, IQ1_S")
    q.add_argument("nthreads", nargs="?", type=_positive_int, help="CPU threads (default: torch's)")
    q.add_argument("--imatrix", metavar="FILE", help="importance matrix (llama-imatrix's GGUF or legacy .dat, or "
                                                     "`hanzo-torch imatrix`'s) to weight the quantization with")

    im = sub.add_parser("imatrix", help="compute an importance matrix over a text (llama-imatrix's flags and GGUF "
                                         "format), for quantize --imatrix")
    _add_debug(im, argparse.SUPPRESS)
    _add_model_args(im)
    im.add_argument("-f", "--file", required=True, metavar="PATH", help="calibration text file")
    im.add_argument("-o", "--output", "--output-file", default="imatrix.gguf", metavar="PATH",
                    help="output file (default imatrix.gguf)")
    im.add_argument("-c", "--ctx-size", type=_positive_int, default=512, metavar="N", help="tokens per chunk (default 512)")
    im.add_argument("--chunks", type=int, default=-1, metavar="N", help="chunks to process (default -1: all)")
    im.add_argument("-b", "--batch-size", type=_positive_int, default=2048, metavar="N",
                    help="tokens per model call (default 2048; a chunk of -c tokens is fed in calls of at most this)")
    im.add_argument("-ub", "--ubatch-size", type=_positive_int, default=512, metavar="N",
                    help="tokens per pass through the layers (default 512)")
    im.add_argument("--process-output", action="store_true", help="collect output.weight too (default: blk.* only)")
    im.add_argument("--output-format", choices=("gguf", "dat"), default=None,
                    help="gguf (default) or the legacy dat")
    im.add_argument("--no-ppl", action="store_true", help="accepted for llama-imatrix compatibility: no perplexity "
                                                          "is computed either way")

    c = sub.add_parser("convert", help="convert a Hugging Face Qwen2/Qwen3/Qwen3-MoE checkpoint (safetensors) to GGUF")
    _add_debug(c, argparse.SUPPRESS)
    c.add_argument("input", help="checkpoint folder (config.json, tokenizer.json, tokenizer_config.json, "
                                 "*.safetensors) or one .safetensors file in such a folder")
    c.add_argument("-o", "--output", "--outfile", required=True, metavar="PATH", help="GGUF file (written atomically)")
    c.add_argument("--type", "--outtype", default="F16", help="F32, F16 (default), BF16, Q8_0, Q4_K_M, Q5_K_M, "
                                                              "Q6_K, or another llama-quantize type of `quantize`")
    c.add_argument("--imatrix", metavar="FILE", help="importance matrix to weight the quantization with (as `quantize`)")
    ft = sub.add_parser("finetune", help="train a LoRA adapter on JSONL chat or text records (PEFT; writes the "
                                         "PEFT adapter and llama.cpp's adapter GGUF; needs the [train] extra)")
    _add_debug(ft, argparse.SUPPRESS)
    ft.add_argument("-t", "--threads", type=_positive_int, metavar="N", help="CPU threads (default: torch's)")
    ft.add_argument("-m", "--model", metavar="PATH",
                    help="GGUF file (default: Qwen2.5-Coder-1.5B-Instruct Q4_K_M, downloaded on first use)")
    ft.add_argument("--device", default="auto", help="torch device (default: cuda if available)")
    ft.add_argument("--dtype", default="auto", choices=_DTYPES, help="activation dtype (default: the backend's)")
    ft.add_argument("--data", required=True, metavar="PATH",
                    help='JSONL: {"messages": [{"role", "content"}, ...]} (loss on assistant tokens) or {"text": ...}')
    ft.add_argument("-o", "--output", required=True, metavar="DIR", help="output folder")
    ft.add_argument("--lora-r", type=_positive_int, default=8, metavar="R", help="adapter rank (default 8)")
    ft.add_argument("--lora-alpha", type=float, default=16.0, metavar="A", help="adapter alpha (default 16)")
    ft.add_argument("--lora-dropout", type=float, default=0.0, metavar="P", help="adapter dropout (default 0)")
    ft.add_argument("--target-modules", default="attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down",
                    metavar="NAMES", help="comma-separated layer names (GGUF names: attn_q, ffn_up, ffn_up_exps, ...; "
                                          "default all attention and feed-forward projections)")
    ft.add_argument("--lora-layers", type=_int_list, metavar="I[,I...]",
                    help="adapt only these blocks (0-based); backward stops at the first one, so the last "
                         "few layers train fastest (default: all)")
    ft.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate (default 2e-4)")
    ft.add_argument("--epochs", type=_positive_int, default=1, metavar="N", help="passes over the data (default 1)")
    ft.add_argument("-b", "--batch-size", type=_positive_int, default=1, metavar="N",
                    help="records per step (default 1)")
    ft.add_argument("-c", "--ctx-size", type=_positive_int, default=512, metavar="N",
                    help="tokens per record; longer ones are cut (default 512)")
    ft.add_argument("--save-every", type=int, default=0, metavar="N",
                    help="write OUTPUT/checkpoint-<step> every N steps (default 0: none)")
    ft.add_argument("--resume", nargs="?", const="", metavar="DIR",
                    help="continue from a checkpoint folder (alone: the latest one in OUTPUT)")
    ft.add_argument("--no-gradient-checkpointing", action="store_true",
                    help="keep every block's activations (faster, more memory)")
    ft.add_argument("--seed", type=int, default=0, help="data order and adapter init seed (default 0)")
    ft.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return parser


# ---------------------------------------------------------------------- helpers
def _die(msg: str) -> None:
    raise CLIError(msg)


def _check_gguf_path(path: str) -> Path:
    p = Path(path).expanduser()
    shown = _esc(path)
    try:
        st = os.stat(p)  # never blocks, unlike opening a named pipe
    except FileNotFoundError:
        _die(f"file not found: {shown}")
    except OSError as exc:
        _die(f"cannot access {shown}: {exc.strerror or exc}")
    if stat.S_ISDIR(st.st_mode):
        _die(f"{shown} is a directory, not a GGUF file")
    if not stat.S_ISREG(st.st_mode):
        _die(f"{shown} is not a regular file (named pipe, device or socket), not a GGUF file")
    # O_NONBLOCK: were the path swapped for a named pipe since the stat, open() returns at once
    with open(os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
        magic = f.read(4) or b""
    if magic != b"GGUF":
        _die(f"{shown} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    return p


def _esc(text) -> str:
    """``text`` with every non-printable character (C0/C1 controls such as ESC, bidi and other
    format characters, line separators) written as a Python escape: safe to print to a terminal."""
    text = str(text)
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable():
            out.append(ch)
        else:
            o = ord(ch)
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
    return "".join(out)


def _model_path(arg: Optional[str], quiet: bool = False) -> Path:
    if arg:
        return _check_gguf_path(arg)
    from .hub import pull

    return pull(quiet=quiet)


def _device_dtype(device: str, dtype: str):
    import torch

    from . import backends

    if device == "auto":
        device = backends.auto_device()
    try:
        dev = torch.device(device)
        dev = backends.prepare_device(dev)  # the vulkan backend claims its device type here
    except RuntimeError as exc:
        _die(f"bad --device {device!r}: {exc}")
    why = backends.for_device(dev).device_reason(dev)
    if why is not None:
        _die(f"--device {dev.type} requested but {why}")
    return dev, (None if dtype == "auto" else getattr(torch, dtype))


def _load(args, max_context: Optional[int] = None):
    from . import backends, load

    device, dtype = _device_dtype(args.device, args.dtype)  # a bad --device fails before a download
    backends.check_environment()  # a malformed HANZO_CPU_ISA, too
    device, tp = _init_tp(args, device)
    path = _model_path(args.model, quiet=getattr(args, "quiet", False))
    t0 = time.perf_counter()
    kv = getattr(args, "kv_dtype", "auto")
    model = load(path, device=device, dtype=dtype, max_context=args.max_context or max_context,
                 kv_dtype=None if kv == "auto" else kv, tensor_parallel=tp, mmap=getattr(args, "mmap", None))
    backends.activate(device.type)  # a first build of the CPU kernels is loading time, not prefill time
    return model, path, time.perf_counter() - t0


def _init_tp(args, device):
    """``--tp N``: check N against torchrun's ``WORLD_SIZE``, join the process group (gloo on the
    CPU, NCCL on CUDA/ROCm with rank i on ``cuda:LOCAL_RANK``) and quiet every rank but 0.
    Returns ``(device, tensor_parallel)``."""
    tp = getattr(args, "tp", None)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if tp is None or (tp == 1 and world == 1):
        return device, False
    if tp != world:
        raise UsageError(f"--tp {tp} must equal the world size {world} (run it as torchrun --nproc-per-node {tp} "
                         f"-m hanzo_torch ...)")
    from . import backends

    backend = backends.for_device(device)
    if backend.distributed is None:
        raise UsageError(f"--tp runs on cpu or cuda devices (gloo or nccl), not {device.type}")
    import atexit

    import torch.distributed as dist

    from . import distributed

    device = backend.rank_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    distributed.init_from_env(device)
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    if dist.get_rank() != 0:
        args.quiet = True
        sys.stdout = open(os.devnull, "w")
    return device, True


def _tp_note(model) -> str:
    tp = getattr(model, "tp", None)
    if tp is None:
        return ""
    return (f", tensor parallel over {tp.world_size} ranks ({_fmt_bytes(tp.weight_bytes)} of "
            f"{_fmt_bytes(tp.file_weight_bytes)} weights per rank)")


def _err(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr)


def _read_prompt(args) -> str:
    if args.file:
        try:
            return Path(args.file).read_text(encoding="utf-8")
        except OSError as exc:
            _die(f"cannot read prompt file {args.file}: {exc.strerror or exc}")
    if args.prompt == "-" or (args.prompt is None and not sys.stdin.isatty()):
        return sys.stdin.read()
    if args.prompt is None:
        _die("no prompt: give -p TEXT, -f FILE, or pipe text to stdin")
    return args.prompt


# ---------------------------------------------------------------------- commands
class UsageError(CLIError):
    """A bad argument found after parsing (exit code 2, like argparse's own errors)."""


_SAMPLING_FLAGS = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
                   "repetition_penalty": "--repeat-penalty", "repeat_last_n": "--repeat-last-n"}


def _check_sampling(args) -> None:
    from .sampling import SamplingParams

    try:
        SamplingParams(args.temp, args.top_k, args.top_p, args.min_p, args.repeat_penalty, args.repeat_last_n)
    except ValueError as exc:
        msg = str(exc)
        for name, flag in _SAMPLING_FLAGS.items():
            if msg.startswith(name + " "):
                msg = flag + msg[len(name):]
                break
        raise UsageError(msg) from None


def _set_threads(args) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def cmd_generate(args) -> int:
    # every argument is checked before the model is downloaded or loaded
    if args.n_predict < 0:
        raise UsageError(f"-n must be >= 0, got {args.n_predict}")
    _check_sampling(args)
    prompt_text = _read_prompt(args)
    if not prompt_text and not (args.chat or args.system):
        _die("empty prompt: give -p TEXT, -f FILE, or pipe text to stdin")  # before loading 1 GB
    loras = _lora_args(args)
    _set_threads(args)
    model, path, load_s = _load(args)
    tok = model.tokenizer
    if not args.quiet:
        _err(f"model {path.name} loaded in {load_s:.2f} s on {model.device}{_tp_note(model)}")
    _apply_loras(model, loras, args.quiet)
    profiling = _vk_profile_start(model.device)
    if args.chat or args.system:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + \
               [{"role": "user", "content": prompt_text}]
        kw = {"enable_thinking": False} if args.no_think else {}
        prompt = msgs
    else:
        prompt, kw = prompt_text, {}
    stream = model.generate(prompt, max_new_tokens=args.n_predict, temperature=args.temp, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repeat_penalty,
                            repeat_last_n=args.repeat_last_n, seed=args.seed, stop=args.stop or None,
                            ignore_eos=args.ignore_eos, stream=True, tokenizer=tok,
                            cuda_graph=not args.no_graph, **kw)
    out = sys.stdout
    for piece in stream:
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    if not args.quiet:
        st = stream.stats
        # the seed matters only when sampling (--temp 0 is greedy and reproducible without it)
        _err(st.summary() + (f" | seed {st.seed}" if args.temp > 0 else ""))
    if profiling:
        st = stream.stats
        vp = st.vulkan_profile or {}
        if "prefill" in vp:
            _vk_profile_report(1, f"prefill ({st.prompt_tokens} prompt tokens, first sample)", vp["prefill"])
        if "first_decode" in vp:
            _vk_profile_report(1, "first decode step" + (" (warm-up and graph capture)" if st.cuda_graph else ""),
                               vp["first_decode"])
        if "decode" in vp:
            _vk_profile_report(st.decode_steps - 1, f"token (decode, {st.decode_steps - 1} steps after the first, "
                               + ("replayed graph)" if st.cuda_graph else "eager)"), vp["decode"])
    return 0


def _lora_args(args) -> list:
    """``[(path, scale)]`` of ``--lora`` / ``--lora-scaled``, checked before the model loads."""
    out = [(p, 1.0) for p in args.lora]
    for p, scale in args.lora_scaled:
        try:
            out.append((p, float(scale)))
        except ValueError:
            raise UsageError(f"--lora-scaled {_esc(p)} {_esc(scale)}: the scale must be a number") from None
    for p, _ in out:
        _check_gguf_path(p)
    if out:
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            _die("--lora needs peft: pip install 'hanzo-torch[train]'")
    return out


def _apply_loras(model, loras: list, quiet: bool) -> None:
    """Apply each ``(path, scale)`` adapter to ``model`` in place (its layers get PEFT LoRA layers)."""
    if not loras:
        return
    from . import lora

    pm, names = model, []
    for i, (p, scale) in enumerate(loras):
        name = f"lora{i}"
        pm = lora.load_gguf(pm, p, scale=scale, adapter_name=name)
        names.append(name)
        if not quiet:
            _err(f"LoRA adapter {_esc(p)} applied (scale {scale:g}, {len(lora.read_gguf(p)[2])} tensors)")
    pm.base_model.set_adapter(names)  # every adapter active at once, as llama.cpp


def _vk_profile_start(device) -> bool:
    """True (counters reset) when the backend of ``device`` collects profile counters (vulkan with
    ``HANZO_VK_PROFILE=1``)."""
    from . import backends

    b = backends.for_device(device)
    if not b.profiling():
        return False
    b.synchronize(device)
    b.profile()
    return True


def _vk_profile_report(tokens: int, what: str, p: dict) -> None:
    """Print the Vulkan profile counters ``p`` (:func:`hanzo_torch.backends.vulkan.profile`) per
    ``what`` (``tokens`` of them)."""
    n = max(1, tokens)
    _err(f"vulkan profile per {what}: {p['dispatches'] / n:.1f} dispatches, {p['barriers'] / n:.1f} barriers, "
         f"{p['copies'] / n:.1f} copies, {p['submits'] / n:.2f} submits; record {p['record_us'] / n:.0f} us, "
         f"submit {p['submit_us'] / n:.0f} us, fence wait {p['fence_wait_us'] / n:.0f} us")


def cmd_pull(args) -> int:
    from .hub import pull

    path = pull(quiet=args.quiet, force=args.force, verify=args.verify)
    print(path)
    return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _fmt_count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return str(n)


def _fmt_value(meta, key: str) -> str:
    value = meta[key]
    if hasattr(value, "tolist"):  # large numeric arrays come back as tensors
        value = value.tolist()
    if isinstance(value, list):
        elem = meta.element_type(key) if hasattr(meta, "element_type") else None
        kind = elem.name if elem is not None else "?"
        head = ", ".join(repr(v) if isinstance(v, str) else str(v) for v in value[:4])
        more = ", ..." if len(value) > 4 else ""
        return f"[{len(value)} x {kind}] [{head}{more}]"
    if isinstance(value, str):
        one = value.replace("\n", "\\n")
        return repr(one) if len(one) <= 80 else f"{one[:77]!r}... ({len(value)} chars)"
    return str(value)


def _file_type_name(meta) -> Optional[str]:
    import gguf

    ft = meta.get("general.file_type")
    if ft is None:
        return None
    try:
        name = gguf.LlamaFileType(int(ft)).name
    except ValueError:
        return f"type {ft}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _kernels_line(device) -> str:
    """Which kernels run on ``device`` (for the CPU: the C++ kernels' instruction set)."""
    from . import backends

    for b in backends.status():
        if b.name != "reference" and b.available and device.type in b.device_types:
            isa = f", ISA {b.details['isa']}" if "isa" in b.details else ""
            return f"{b.name}{isa}"
    return "torch references"


def _backend_lines() -> list:
    from . import backends

    return [_esc(str(b)) for b in backends.status()]


def cmd_inspect(args) -> int:
    from .gguf_file import GGUFError, GGUFFile

    if args.backends:
        for line in _backend_lines():
            print(line)
        return 0
    if args.path is None:
        raise UsageError("inspect needs a GGUF file (or --backends)")
    path = _check_gguf_path(args.path)
    with GGUFFile(path) as f:
        meta = f.metadata
        infos = list(f.tensor_info.values())
        n_params = sum(t.n_elements for t in infos)
        total = sum(t.nbytes for t in infos)
        print(f"file:         {_esc(path)} ({_fmt_bytes(f.size)})")
        print(f"format:       GGUF v{f.version}, {len(meta)} metadata keys, {len(infos)} tensors, "
              f"alignment {f.alignment}")
        print(f"architecture: {_esc(f.architecture or '(none)')}")
        ft = _file_type_name(meta)
        if ft:
            print(f"file type:    {ft}")
        print(f"parameters:   {n_params:,} ({_fmt_count(n_params)}), tensor data {_fmt_bytes(total)}"
              + (f", {8 * total / n_params:.2f} bits/weight" if n_params else ""))
        print("\nmetadata:")
        width = max((len(_esc(k)) for k in meta), default=0)
        for key in meta:
            try:
                shown = _fmt_value(meta, key)
            except GGUFError as exc:  # one undecodable value (bad UTF-8, a bool byte of 7): say so, go on
                shown = f"<unreadable: {exc}>"
            print(f"  {_esc(key):<{width}}  {_esc(shown)}")
        if infos:
            by_fmt: dict[str, list[int]] = {}
            for t in infos:
                c = by_fmt.setdefault(t.qtype, [0, 0, 0])
                c[0] += 1
                c[1] += t.n_elements
                c[2] += t.nbytes
            print("\nformats:")
            for q, (n, elems, nb) in sorted(by_fmt.items(), key=lambda kv: -kv[1][2]):
                print(f"  {q:<8} {n:>5} tensors  {elems:>14,} weights  {_fmt_bytes(nb):>11}")
        if infos and not args.no_tensors:
            nw = max(len(_esc(t.name)) for t in infos)
            print(f"\ntensors:\n  {'name':<{nw}}  {'format':<8}  {'shape':<22}  {'bytes':>13}")
            for t in infos:
                shape = "x".join(str(s) for s in t.shape) or "scalar"
                print(f"  {_esc(t.name):<{nw}}  {t.qtype:<8}  {shape:<22}  {t.nbytes:>13,}")
    return 0


def _sync(device) -> None:
    from . import backends

    backends.for_device(device).synchronize(device)


def cmd_bench(args) -> int:
    import torch

    from . import backends

    tests = [("pp", n) for n in args.n_prompt if n > 0] + [("tg", n) for n in args.n_gen if n > 0]
    if not tests:
        _die("nothing to run: every -p and -n value is 0")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    need = max(n for _, n in tests)
    _set_threads(args)
    model, path, load_s = _load(args, max_context=need)
    if model.max_context < need:
        _die(f"--max-context {model.max_context} is smaller than the longest test ({need} tokens)")
    device = model.device
    vocab = model.args.vocab_size if hasattr(model, "args") else len(model.tokenizer)
    gen = torch.Generator().manual_seed(1234)

    def run_pp(n: int) -> float:
        ids = torch.randint(0, vocab, (1, n), generator=gen).to(device)
        pos = torch.arange(n, device=device).unsqueeze(0)
        model.reset()
        _sync(device)
        t0 = time.perf_counter()
        out = model(ids, positions=pos, last_only=True)
        float(out[0, -1, 0])  # waits for the device
        return time.perf_counter() - t0

    def run_tg(n: int) -> float:
        from .decode_graphs import DecodeStep

        tok = torch.randint(0, vocab, (1, 1), generator=gen).to(device)
        if getattr(model, "cache_batch_size", 1) != 1:
            model.setup_cache(1)  # before the decode step: a captured graph keeps the cache's address
        model.reset()
        step = DecodeStep(model, 1, device, cuda_graph=not args.no_graph, last_only=True)
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for i in range(n):
                step.positions.fill_(i)
                step.input_ids.copy_(tok)
                tok = step()[:, -1].argmax(-1, keepdim=True)  # stays on the device
            int(tok[0, 0])
        return time.perf_counter() - t0

    from .gguf_file import GGUFFile

    with GGUFFile(path) as f:
        infos = list(f.tensor_info.values())
        size = sum(t.nbytes for t in infos)
        params = sum(t.n_elements for t in infos)
        ftype = _file_type_name(f.metadata) or "?"
        arch = f.architecture or "?"
    dtype = str(model.dtype).removeprefix("torch.") if hasattr(model, "dtype") else "?"
    kv = f", KV cache {model.kv_dtype}" if getattr(model, "kv_dtype", None) else ""
    if not getattr(args, "quiet", False):  # ranks > 0 of --tp
        _err(f"model {path.name} loaded in {load_s:.2f} s on {device}{kv}{_tp_note(model)}")
        _err(f"backend: {_kernels_line(device)}")
    cols = ["model", "size", "params", "device", "dtype", "test", "t/s (median)", "± stdev", "runs"]
    head = f"{arch} {ftype}"
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("-" * (len(c) + 2) for c in cols) + "|")
    with torch.inference_mode():
        for kind, n in tests:
            fn = run_pp if kind == "pp" else run_tg
            for _ in range(args.warmup):
                fn(n)
            profiling = _vk_profile_start(device)
            rates = [n / fn(n) for _ in range(args.repetitions)]
            if profiling:
                _vk_profile_report(n * args.repetitions, "token" if kind == "tg" else f"prompt token ({kind}{n})",
                                   backends.for_device(device).profile())
            med = statistics.median(rates)
            sd = statistics.stdev(rates) if len(rates) > 1 else 0.0
            row = [head, _fmt_bytes(size), _fmt_count(params), str(device), dtype, f"{kind}{n}",
                   f"{med:.2f}", f"{sd:.2f}", str(len(rates))]
            print("| " + " | ".join(row) + " |", flush=True)
    return 0


def cmd_finetune(args) -> int:
    from .finetune import FinetuneConfig, finetune

    if not os.path.isfile(args.data):
        _die(f"--data {_esc(args.data)}: file not found")
    targets = [t.strip() for t in args.target_modules.split(",") if t.strip()]
    if not targets:
        raise UsageError("--target-modules is empty")
    if not 0.0 <= args.lora_dropout < 1.0:
        raise UsageError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    if args.lr <= 0:
        raise UsageError(f"--lr must be > 0, got {args.lr}")
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        _die("finetune needs peft: pip install 'hanzo-torch[train]'")
    from .finetune import load_records

    records = load_records(args.data)  # bad data fails before the model loads
    _set_threads(args)
    args.max_context, args.tp = args.ctx_size, None
    model, path, load_s = _load(args)
    if not args.quiet:
        _err(f"model {path.name} loaded in {load_s:.2f} s on {model.device}; {len(records)} records")
    cfg = FinetuneConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                         target_modules=targets, lr=args.lr, epochs=args.epochs, batch_size=args.batch_size,
                         context=args.ctx_size, save_every=args.save_every, seed=args.seed,
                         gradient_checkpointing=not args.no_gradient_checkpointing, layers=args.lora_layers)
    import torch

    torch.manual_seed(args.seed)
    resume = None if args.resume is None else (args.resume or args.output)
    finetune(model, records, args.output, cfg, resume=resume, progress=not args.quiet,
             log=None if args.quiet else _err)
    return 0


def cmd_quantize(args) -> int:
    import time

    from .requantize import FTYPES, requantize

    if args.type.upper() not in FTYPES:
        raise UsageError(f"unknown type {_esc(args.type)}; one of: {', '.join(FTYPES)}")
    src = _check_gguf_path(args.input)
    if os.path.abspath(args.output) == os.path.abspath(src):
        raise UsageError("the output is the input file; write to another path")
    if args.nthreads:
        import torch

        torch.set_num_threads(args.nthreads)
    imatrix = _load_imatrix_arg(args.imatrix)
    t0 = time.perf_counter()
    try:
        plan = requantize(str(src), args.output, args.type, imatrix=imatrix)
    except ValueError as exc:
        _die(str(exc))
    _print_written(args.output, plan, time.perf_counter() - t0)
    return 0


def _load_imatrix_arg(path: Optional[str]):
    """``--imatrix FILE`` read before any long work; None without the flag."""
    if path is None:
        return None
    from .imatrix import load_imatrix

    try:
        return load_imatrix(os.path.expanduser(path))
    except (OSError, ValueError) as exc:  # GGUFError is a ValueError
        _die(f"--imatrix: {exc}")


def _print_written(path: str, plan: dict, seconds: float) -> None:
    """One line for a written GGUF: its tensor count and the count of each ggml type in ``plan``."""
    counts: dict = {}
    for t in plan.values():
        counts[t] = counts.get(t, 0) + 1
    mix = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    print(f"wrote {_esc(path)}: {len(plan)} tensors ({mix}) in {seconds:.1f} s")


def cmd_convert(args) -> int:
    import time

    from .convert_hf import convert
    from .requantize import FTYPES

    if args.type.upper() not in FTYPES:
        raise UsageError(f"unknown type {_esc(args.type)}; one of: {', '.join(FTYPES)}")
    imatrix = _load_imatrix_arg(args.imatrix)
    t0 = time.perf_counter()
    plan = convert(args.input, args.output, args.type, log=lambda line: _err(f"note: {_esc(line)}"), imatrix=imatrix)
    _print_written(args.output, plan, time.perf_counter() - t0)
    return 0


def cmd_imatrix(args) -> int:
    from .imatrix import compute_imatrix, save_imatrix, save_imatrix_legacy

    text_path = Path(args.file).expanduser()
    try:
        text = text_path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        _die(f"cannot read {_esc(args.file)}: {exc.strerror or exc}")
    out_dir = Path(args.output).expanduser().resolve().parent
    if not out_dir.is_dir():
        _die(f"no such folder for the output: {_esc(str(out_dir))}")
    _set_threads(args)
    model, path, load_s = _load(args, max_context=args.ctx_size)
    tokens = model.tokenizer.encode(text)
    if len(tokens) < 2 * args.ctx_size:
        _die(f"{_esc(args.file)} tokenizes to {len(tokens)} tokens; -c {args.ctx_size} needs at least "
             f"{2 * args.ctx_size}")
    n = len(tokens) // args.ctx_size if args.chunks < 0 else min(args.chunks, len(tokens) // args.ctx_size)
    _err(f"model {path.name} loaded in {load_s:.2f} s; {len(tokens)} tokens, {n} chunks of {args.ctx_size}")
    t0 = time.perf_counter()

    def progress(i, total):
        _err(f"chunk {i}/{total}: {time.perf_counter() - t0:.1f} s")

    try:
        m = compute_imatrix(model, tokens, args.ctx_size, args.chunks, n_batch=args.batch_size,
                            n_ubatch=args.ubatch_size, process_output=args.process_output, dataset=args.file,
                            progress=progress)
    except ValueError as exc:
        _die(str(exc))
    fmt = args.output_format or "gguf"  # as llama-imatrix: the suffix does not choose
    (save_imatrix if fmt == "gguf" else save_imatrix_legacy)(args.output, m)
    print(f"wrote {_esc(args.output)}: {len(m)} entries over {m.chunk_count} chunks of {args.ctx_size} tokens "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_export(args) -> int:
    from . import export, load

    path = _check_gguf_path(args.path)
    if args.prefill_len > args.ctx_size:
        _die(f"--prefill-len {args.prefill_len} exceeds -c {args.ctx_size}")
    reason = export.mlir_available()
    if reason is not None:
        _die(reason)
    model = load(path, max_context=args.ctx_size, mmap=True)  # read once at export: no copy
    try:
        r = export.export_mlir(model, args.output, prefill_len=args.prefill_len)
        if args.vmfb:
            export.compile_iree(r.path, args.vmfb)
    except RuntimeError as exc:  # a lowering or IREE compile failure: its message says where
        _die(str(exc))
    gguf = path.stat().st_size
    print(f"wrote {r.path}: {_fmt_bytes(r.file_bytes)} ({r.file_bytes / gguf:.2f}x the GGUF's {_fmt_bytes(gguf)}; "
          f"packed weights {_fmt_bytes(r.packed_weight_bytes)}), functions prefill (T={r.prefill_len}) and "
          f"decode (T=1), KV cache length {r.max_context}")
    if args.vmfb:
        print(f"wrote {args.vmfb}: {_fmt_bytes(os.path.getsize(args.vmfb))}")
    return 0


def cmd_serve(args) -> int:
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in [1, 65535], got {args.port}")
    if args.ctx_size < args.parallel:
        raise UsageError(f"-c {args.ctx_size} leaves no context for each of -np {args.parallel} slots")
    if args.tp not in (None, 1):
        raise UsageError("serve does not run tensor parallel (--tp): its continuous batching would need every rank "
                         "to agree on each step's slots; run it in one process")
    try:
        from .server import serve
        import uvicorn  # noqa: F401
    except ImportError:
        _die("serve needs FastAPI and uvicorn: pip install 'hanzo-torch[serve]'")
    _set_threads(args)
    model, path, load_s = _load(args, max_context=args.ctx_size // args.parallel)
    _err(f"model {path.name} loaded in {load_s:.2f} s on {model.device}; {args.parallel} slots of "
         f"{model.max_context} tokens; listening on http://{args.host}:{args.port}")
    serve(model, args.host, args.port, n_parallel=args.parallel, max_queue=args.max_queue, model_name=args.alias,
          cuda_graph=not args.no_graph)
    return 0


_COMMANDS = {"generate": cmd_generate, "pull": cmd_pull, "inspect": cmd_inspect, "bench": cmd_bench,
             "export": cmd_export, "serve": cmd_serve, "quantize": cmd_quantize, "convert": cmd_convert,
             "imatrix": cmd_imatrix, "finetune": cmd_finetune}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``hanzo-torch``; returns the exit code (0 ok, 1 error, 2 usage, 130 ^C)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with a usage message on bad arguments
    from .gguf_file import GGUFError
    from .hub import HubError
    from .tokenizer import TokenizerError
    from .distributed import TensorParallelError

    debug = getattr(args, "debug", False)
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        what = {"pull": "download interrupted; nothing partial was kept, run `hanzo-torch pull` again"}
        print(file=sys.stderr)
        _err(what.get(args.command, "interrupted"))
        return 130
    except BrokenPipeError:  # `hanzo-torch ... | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except (CLIError, GGUFError, HubError, TokenizerError, TensorParallelError, ValueError, TypeError, OSError,
            MemoryError, NotImplementedError) as exc:
        # a bad file (GGUFError, TokenizerError), a bad argument (ValueError, TypeError) or the
        # environment: one line; --debug shows where it came from
        if debug:
            import traceback

            traceback.print_exc()
        msg = " ".join(str(exc).split()) or type(exc).__name__  # one line
        if isinstance(exc, OSError) and exc.strerror:
            msg = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
        elif isinstance(exc, MemoryError):
            msg = f"out of memory {msg}" if str(exc) else "out of memory"
        _err(f"error: {_esc(msg)}")
        return 2 if isinstance(exc, UsageError) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
