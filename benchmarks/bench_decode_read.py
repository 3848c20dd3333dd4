"""Decode mat-vecs against the box's read bandwidth, in the same run, per kind of weight.

    python benchmarks/bench_decode_read.py [-m GGUF] [--rounds 15] [--tokens 12] [-t 2]
        [--isa LEVELS] [--procs 1] [--fast-gbs 45] [--json FILE]

The CPU decode targets are stated against what a plain read of the same weights reaches on the same
box at the same time: the mat-vecs at >= 0.90 of that read, and a token within 1.10x the sum of its
mat-vecs. This measures both. A process loads the model (default: the README's Q4_K_M model),
prefills a 16-token prompt, captures the decode step's CPU graph and then, per round:

1. a plain read of the packed rows of the weights the token streams (``Tensor.max`` over their bytes
   as int32, torch's own parallel reduction on the same threads; the second of two passes timed).
   Of the reductions tried on the Zen 4 box of RESULTS.md it reads fastest: ``amax`` reached 0.91x
   of it, an int64 ``sum`` 0.95x (40 alternated rounds), and a slower read would flatter the ratios;
2. ``--tokens`` replays of the graph timed node by node (``CpuGraph.replay_timed``; the first is
   dropped), each mat-vec node's bytes from ``CpuGraph.weights`` (the panels' bytes where the
   kernel reads panels);
3. the plain read again; the round's read is the larger of the two.

The box's memory can change speed between minutes (on the Zen 4 guests of RESULTS.md a plain read
ran 30-36 GB/s in some minutes and 47-61 in others), so rounds are binned by their read: at or
below ``--fast-gbs`` "slow", above it "fast". Per level and regime it prints the read, the
mat-vecs' GB/s and their ratio to the round's read (median and quartiles over rounds; also over the
weights' GGUF bytes, fewer than the panels the Q4_K mat-vec streams), the token's
time over its mat-vecs' time, and the GB/s of each kind of weight (its tensor names without the
layer, and formats: ``attn_q+attn_k+attn_v Q4_K,Q6_K``).

``--isa avx512,avx2`` runs one process per level (``HANZO_CPU_ISA``), ``--procs`` processes per
level, the levels alternating. ``--json FILE`` writes every round. Times are wall time of the
graph's nodes on this machine: report the CPU and ISA beside them.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time


def kind_of(names: list[tuple[str, str]]) -> str:
    """A node's kind from its weights' (name, qtype): ``blk.3.attn_q.weight`` -> ``attn_q``."""
    short = []
    for name, _ in names:
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 2:
            parts = parts[2:]
        if parts[-1] == "weight":
            parts = parts[:-1]
        short.append(".".join(parts))
    qtypes = list(dict.fromkeys(q for _, q in names))
    return "+".join(short) + " " + ",".join(qtypes)


def measure(path: str, rounds: int, tokens: int, threads: int, tag: str, out=None) -> list[dict]:
    """The rounds of one process (see the module docstring): one dict per round with ``read``
    (GB/s), ``matvec_gbs`` (bytes the mat-vecs stream per second), ``gguf_gbs`` (the same time
    over the weights' GGUF bytes: Q4_K panels are 1184 bytes per 8 rows and block against the
    rows' 1152), ``token_ms``, ``matvec_ms``, ``kinds`` ({kind: streamed GB/s}) and ``tag``.
    Each row is printed to ``out`` (default: stdout) as a JSON line when it is done.
    Raises RuntimeError when the C++ kernels cannot be built, and ``backends.cpu.CaptureRejected``
    when the model's decode step cannot be captured as a CPU graph."""
    import torch
    import hanzo_torch
    from hanzo_torch.backends import cpu

    if tokens < 2:
        raise ValueError(f"--tokens {tokens}: at least 2 (the first replay is not counted)")
    torch.set_num_threads(threads)
    model = hanzo_torch.load(path, max_context=64)
    packed = {p.packed.data_ptr(): (n, p) for n, p in model.named_parameters() if hasattr(p, "packed")}
    with torch.inference_mode():
        model(torch.randint(0, model.args.vocab_size, (1, 16)), last_only=True)  # allocates the KV cache
        ids, pos = torch.ones(1, 1, dtype=torch.long), torch.full((1, 1), 16, dtype=torch.long)
        # the decode step as generate() replays it (DecodeStep): its hanzo ops captured into a CPU graph
        graph, _ = cpu.capture(lambda: model(ids, positions=pos, last_only=True), 0)
        nodes = []  # per node: (kind or None, bytes streamed, bytes of its GGUF rows)
        streamed = {}
        for ws in graph.weights:
            if not ws:
                nodes.append((None, 0, 0))
                continue
            unknown = [a for a, _ in ws if a not in packed]
            if unknown:
                raise RuntimeError(f"a graph node streams weights at {[hex(a) for a in unknown]} that are not the "
                                   "model's packed parameters")
            names = [(packed[a][0], packed[a][1].qtype) for a, _ in ws]
            nodes.append((kind_of(names), sum(b for _, b in ws), sum(packed[a][1].packed.numel() for a, _ in ws)))
            for a, _ in ws:
                streamed[a] = packed[a][1].packed
        bufs = [t.reshape(-1)[: t.numel() // 4 * 4].view(torch.int32) for t in streamed.values()]
        read_bytes = sum(b.numel() * 4 for b in bufs)

        def read() -> float:
            for b in bufs:
                b.max()
            t0 = time.perf_counter()
            for b in bufs:
                b.max()
            return read_bytes / (time.perf_counter() - t0) / 1e9

        mv_bytes = sum(n[1] for n in nodes)
        gguf_bytes = sum(n[2] for n in nodes)
        rows = []
        for r in range(rounds):
            before = read()
            per_kind = collections.defaultdict(lambda: [0, 0])
            total = mv = 0
            for i in range(tokens):
                ids.fill_(1 + i)
                pos.fill_(16 + i % 32)
                ns = graph.replay_timed()
                if i == 0:
                    continue
                for (kind, nbytes, _), t in zip(nodes, ns):
                    if kind is not None:
                        per_kind[kind][0] += t
                        per_kind[kind][1] += nbytes
                        mv += t
                total += sum(ns)
            row = dict(tag=tag, read=max(before, read()), matvec_gbs=mv_bytes * (tokens - 1) / mv,
                       gguf_gbs=gguf_bytes * (tokens - 1) / mv,
                       token_ms=total / (tokens - 1) / 1e6, matvec_ms=mv / (tokens - 1) / 1e6,
                       kinds={k: b / t for k, (t, b) in per_kind.items()})
            rows.append(row)
            print(json.dumps(row), file=sys.stdout if out is None else out, flush=True)
    return rows


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")  # within the data for few rounds
    return q[0], statistics.median(xs), q[2]


def report(rows: list[dict], fast_gbs: float) -> str:
    """The per-level, per-regime table of ``rows`` (measure()'s dicts) as text."""
    lines = []
    tags = list(dict.fromkeys(r["tag"] for r in rows))
    for regime, pick in (("fast", lambda r: r["read"] > fast_gbs), ("slow", lambda r: r["read"] <= fast_gbs)):
        for tag in tags:
            sel = [r for r in rows if r["tag"] == tag and pick(r)]
            if not sel:
                continue
            lo, med, hi = quartiles([r["matvec_gbs"] / r["read"] for r in sel])
            lines.append(f"{tag} {regime}: {len(sel)} rounds, read {statistics.median(r['read'] for r in sel):.1f} GB/s, "
                         f"mat-vecs {statistics.median(r['matvec_gbs'] for r in sel):.1f} GB/s = "
                         f"{med:.3f} of the read (quartiles {lo:.3f}-{hi:.3f}); over GGUF bytes "
                         f"{statistics.median(r['gguf_gbs'] / r['read'] for r in sel):.3f}; token / mat-vecs "
                         f"{statistics.median(r['token_ms'] / r['matvec_ms'] for r in sel):.3f}, "
                         f"token {statistics.median(r['token_ms'] for r in sel):.2f} ms")
            for kind in sel[0]["kinds"]:
                gbs = statistics.median(r["kinds"][kind] for r in sel)
                lines.append(f"    {kind:40s} {gbs:6.1f} GB/s  ({gbs / statistics.median(r['read'] for r in sel):.3f} of the read)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.replace("``", "`"),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the README's model, downloaded once)")
    ap.add_argument("--rounds", type=int, default=15, help="rounds per process (default 15)")
    ap.add_argument("--tokens", type=int, default=12, help="replayed tokens per round, the first not counted (default 12)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="torch threads of each process (default 2)")
    ap.add_argument("--isa", default="", help="comma-separated ISA levels, one process each (default: this one)")
    ap.add_argument("--procs", type=int, default=1, help="processes per level, levels alternating (default 1)")
    ap.add_argument("--fast-gbs", type=float, default=45.0, help="reads above this many GB/s are the fast regime (default 45)")
    ap.add_argument("--json", default=None, help="write every round here (JSON lines)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.procs < 1 or a.threads < 1:
        ap.error("--rounds, --procs and --threads must be >= 1")
    if a.tokens < 2:
        ap.error("--tokens must be >= 2 (the first replay is not counted)")
    path = a.model
    if path is None:
        import hanzo_torch
        path = str(hanzo_torch.pull())
    elif not os.path.isfile(path):
        ap.error(f"-m {path}: no such file")
    if a.child is not None:
        measure(path, a.rounds, a.tokens, a.threads, a.child)
        return 0
    levels = [x.strip() for x in a.isa.split(",") if x.strip()]
    rows: list[dict] = []
    if not levels:
        import hanzo_torch.backends.cpu as hcpu
        rows = measure(path, a.rounds, a.tokens, a.threads, hcpu.ISA_NAMES[hcpu.default_isa()], out=sys.stderr)
    else:
        for _ in range(a.procs):
            for level in levels:
                env = dict(os.environ, HANZO_CPU_ISA=level)
                cmd = [sys.executable, os.path.abspath(__file__), "-m", path, "--rounds", str(a.rounds),
                       "--tokens", str(a.tokens), "-t", str(a.threads), "--child", level]
                p = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if p.returncode != 0:
                    sys.stderr.write(p.stderr)
                    print(f"bench_decode_read: the {level} process failed (exit {p.returncode})", file=sys.stderr)
                    return 1
                rows += [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if a.json:
        with open(a.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(report(rows, a.fast_gbs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
