"""LoRA training step on a GGUF model: peak RSS against the file size, and training tokens/s.

One process per run (peak RSS is per process): load the model, wrap it with PEFT LoRA
(:mod:`hanzo_torch.lora`), run ``--steps`` AdamW steps of ``--batch`` random-token sequences of
``--seq`` tokens (forward with ``use_cache=False, labels=ids``: the LM head and next-token loss in checkpointed
token chunks; ``--full-logits``: ``[B, T, V]`` logits and ``F.cross_entropy`` instead; backward, step), and print
the forward / backward / optimizer seconds of each step, the median tokens/s of the steps after
the first, the peak RSS (``ru_maxrss``: the mapped file pages the process touched included), and
that peak against the GGUF's size.

    python benchmarks/bench_lora.py [-m model.gguf] [--seq 512] [--steps 3] [--r 16]
        [--targets attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down] [--layers N] [--no-checkpointing]
        [--full-logits] [--glibc-heap]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.nn.functional as F


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def rss_now_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", help="GGUF file (default: the pulled Qwen2.5-Coder-1.5B-Instruct Q4_K_M)")
    ap.add_argument("--seq", type=int, default=512, help="tokens per sequence (default 512)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    ap.add_argument("--steps", type=int, default=3, help="training steps (default 3; the first is a warm-up)")
    ap.add_argument("--r", type=int, default=16, help="LoRA rank (default 16)")
    ap.add_argument("--targets", default="attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down")
    ap.add_argument("--layers", type=int, metavar="N", help="adapt only the last N blocks (default: all)")
    ap.add_argument("--no-checkpointing", action="store_true", help="keep every block's activations")
    ap.add_argument("--full-logits", action="store_true", help="materialize the [B, T, V] logits for the loss")
    ap.add_argument("--glibc-heap", action="store_true",
                    help="keep glibc's dynamic mmap threshold (finetune sets 1 MiB: hanzo_torch.finetune.set_mmap_threshold)")
    ap.add_argument("-t", "--threads", type=int, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import peft

    import hanzo_torch
    import hanzo_torch.lora  # noqa: F401 (registers the LoRA layers with PEFT)
    from hanzo_torch.finetune import set_mmap_threshold

    if not args.glibc_heap:
        set_mmap_threshold()

    path = args.model or str(hanzo_torch.pull(quiet=True))
    file_bytes = os.path.getsize(path)
    rss0 = rss_now_bytes()
    model = hanzo_torch.load(path, max_context=max(args.seq, 64))
    n_layer = model.args.n_layer
    layers = list(range(n_layer - args.layers, n_layer)) if args.layers else None
    pm = peft.get_peft_model(model, peft.LoraConfig(r=args.r, lora_alpha=2 * args.r,
                                                    target_modules=args.targets.split(","), layers_to_transform=layers,
                                                    layers_pattern="blk" if layers else None))
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable()
    params = [p for p in pm.parameters() if p.requires_grad]
    n_train = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-4)
    V = model.args.vocab_size
    g = torch.Generator().manual_seed(0)
    tok_s = []
    print(f"{os.path.basename(path)} ({file_bytes / 2**30:.2f} GiB), seq {args.seq} x batch {args.batch}, "
          f"LoRA r={args.r} on {args.targets} of {'the last %d' % args.layers if args.layers else 'all'} blocks "
          f"({n_train / 1e6:.2f} M trainable), checkpointing "
          f"{'off' if args.no_checkpointing else 'on'}, {'full logits' if args.full_logits else 'chunked loss'}, "
          f"bf16 backward {os.environ.get('HANZO_LORA_BF16_BACKWARD', '0')}, "
          f"{'glibc default' if args.glibc_heap else '1 MiB'} mmap threshold, {torch.get_num_threads()} threads")
    for step in range(args.steps):
        ids = torch.randint(0, V, (args.batch, args.seq), generator=g)
        t0 = time.perf_counter()
        if args.full_logits:
            logits = pm(ids, use_cache=False)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
            del logits
        else:
            loss = pm(ids, labels=ids, use_cache=False).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        del loss
        n = args.batch * args.seq
        print(f"step {step}: forward {t1 - t0:.2f} s, backward {t2 - t1:.2f} s, optimizer {t3 - t2:.3f} s, "
              f"{n / (t3 - t0):.1f} tokens/s, RSS peak {rss_peak_bytes() / 2**30:.2f} GiB")
        if step:
            tok_s.append(n / (t3 - t0))
    peak = rss_peak_bytes()
    med = statistics.median(tok_s) if tok_s else float("nan")
    print(f"median {med:.1f} training tokens/s; peak RSS {peak / 2**30:.2f} GiB = {peak / file_bytes:.2f} x the "
          f"file (RSS before load {rss0 / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
