"""Open a GGUF model with hanzo_torch.GGUFFile: time and resident memory.

Prints the open time (median of --repeat opens, each in this process), the process RSS before and
after the first open and after building ``f.tensors`` (zero-copy views: should not grow by the
tensor bytes), and the time to decode the vocabulary arrays on first access. With
``--gguf-reader`` it also opens the file with ``gguf.GGUFReader`` in a subprocess for comparison.

    python benchmarks/open_model.py [path.gguf] [--repeat 5] [--gguf-reader]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

DEFAULT = os.path.expanduser("~/.cache/hanzo-torch/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")


def rss_mib() -> float:
    """Resident set size of this process in MiB (Linux /proc; ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def gguf_reader_child(path: str) -> None:
    import gguf

    before = rss_mib()
    t = time.perf_counter()
    gguf.GGUFReader(path)
    print(f"{time.perf_counter() - t:.3f} {rss_mib() - before:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", nargs="?", default=DEFAULT)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--gguf-reader", action="store_true", help="also time gguf.GGUFReader (subprocess)")
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        gguf_reader_child(args.path)
        return
    if not os.path.exists(args.path):
        sys.exit(f"model not found: {args.path}")

    import torch  # noqa: F401  (imported before measuring, so its RSS is in the baseline)

    from hanzo_torch import GGUFFile

    size_mib = os.path.getsize(args.path) / 2**20
    rss0 = rss_mib()
    t = time.perf_counter()
    f = GGUFFile(args.path)
    first = time.perf_counter() - t
    rss_open = rss_mib()
    t = time.perf_counter()
    tensors = f.tensors
    t_tensors = time.perf_counter() - t
    rss_tensors = rss_mib()
    t = time.perf_counter()
    n_tok = len(f.metadata.get("tokenizer.ggml.tokens", []))
    n_merge = len(f.metadata.get("tokenizer.ggml.merges", []))
    t_vocab = time.perf_counter() - t
    rss_vocab = rss_mib()

    times = [first]
    for _ in range(args.repeat - 1):
        t = time.perf_counter()
        GGUFFile(args.path).close()
        times.append(time.perf_counter() - t)

    print(f"file: {args.path} ({size_mib:.0f} MiB, {len(f.tensor_info)} tensors, {len(f.metadata)} keys)")
    print(f"open: first {first * 1e3:.0f} ms, median of {len(times)} {statistics.median(times) * 1e3:.0f} ms")
    print(f"RSS: {rss0:.0f} MiB before open, {rss_open:.0f} MiB after open (+{rss_open - rss0:.1f})")
    print(f"f.tensors ({len(tensors)} zero-copy GGUFTensors): {t_tensors * 1e3:.0f} ms, RSS {rss_tensors:.0f} MiB "
          f"(+{rss_tensors - rss_open:.1f})")
    print(f"decode {n_tok} tokens + {n_merge} merges on first access: {t_vocab * 1e3:.0f} ms, RSS {rss_vocab:.0f} MiB "
          f"(+{rss_vocab - rss_tensors:.1f})")
    f.close()

    if args.gguf_reader:
        out = subprocess.run([sys.executable, __file__, args.path, "--_child"], capture_output=True, text=True,
                             check=True).stdout.split()
        print(f"gguf.GGUFReader open (subprocess): {float(out[0]) * 1e3:.0f} ms, RSS +{float(out[1]):.0f} MiB "
              f"-> GGUFFile is {float(out[0]) / statistics.median(times):.0f}x faster")


if __name__ == "__main__":
    main()
