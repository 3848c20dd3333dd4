"""Tensor-parallel decode check, one rank per process: run it under torchrun.

    torchrun --nproc-per-node 2 benchmarks/tp_check.py MODEL.gguf            # NCCL, rank i on cuda:i
    torchrun --nproc-per-node 2 benchmarks/tp_check.py MODEL.gguf --cpu      # gloo, the same plumbing

Each rank loads the file with ``tensor_parallel=True``; after a 16-token prompt it decodes
``--steps`` greedy tokens through ``decode_graphs.DecodeStep`` twice, eagerly and (on CUDA) under
a captured graph (the NCCL collectives captured with the kernels), and rank 0 compares both with
a single-process model of the same file on its own device. Prints one line per check
(``ok``/``FAIL``) on rank 0; exit status 1 on a failure. ``benchmarks/gpu_check.py`` runs it
when the machine has 2 or more GPUs.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def decode(model, device, steps: int, graph: bool):
    import torch

    from hanzo_torch.decode_graphs import DecodeStep

    prompt = torch.arange(100, 116, device=device).unsqueeze(0)
    with torch.inference_mode():
        model.reset()
        logits = [model(prompt, positions=torch.arange(16, device=device).unsqueeze(0), last_only=True)[0, -1]]
        step = DecodeStep(model, 1, device, cuda_graph=graph, last_only=True)
        tok = int(logits[-1].argmax())
        toks = [tok]
        for i in range(steps):
            step.input_ids.fill_(tok)
            step.positions.fill_(16 + i)
            logits.append(step()[0, -1].clone())
            tok = int(logits[-1].argmax())
            toks.append(tok)
    return torch.stack(logits).float().cpu(), toks, step.graphed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU instead of NCCL on CUDA")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--tol", type=float, default=1e-2, help="max |diff| / max |logit| against one process")
    a = ap.parse_args()
    import torch
    import torch.distributed as dist

    import hanzo_torch

    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cpu") if a.cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kw = {} if a.cpu else {"device_id": device}
    dist.init_process_group("gloo" if a.cpu else "nccl", timeout=datetime.timedelta(seconds=120), **kw)
    ok = True
    try:
        model = hanzo_torch.load(a.model, device=device, tensor_parallel=True, max_context=256)
        eager, eager_toks, _ = decode(model, device, a.steps, graph=False)
        replay, replay_toks, graphed = decode(model, device, a.steps, graph=True)
        if rank == 0:
            single = hanzo_torch.load(a.model, device=device, max_context=256)
            ref, ref_toks, _ = decode(single, device, a.steps, graph=False)
            scale = ref.abs().max().item()
            checks = [
                (f"replay ({'graph' if graphed else 'eager'}) == eager, {a.steps} steps",
                 torch.equal(replay, eager), f"max |diff| {(replay - eager).abs().max().item():.3g}"),
                ("eager vs one process", (eager - ref).abs().max().item() <= a.tol * scale,
                 f"max |diff| {(eager - ref).abs().max().item():.3g} of max |logit| {scale:.3g}"),
                ("greedy tokens vs one process", eager_toks == ref_toks == replay_toks,
                 f"{sum(x == y for x, y in zip(eager_toks, ref_toks))}/{len(ref_toks)} equal"),
                ("weight bytes per rank", True,
                 f"{model.tp.weight_bytes / model.tp.file_weight_bytes:.3f} of the file's"),
            ]
            for name, good, note in checks:
                print(f"[tp {dist.get_world_size()} ranks, {device.type}] {name}: {'ok' if good else 'FAIL'} ({note})",
                      flush=True)
                ok &= bool(good)
        flag = torch.tensor([int(ok)], device=device if device.type == "cuda" else "cpu")
        dist.broadcast(flag, src=0)
        ok = bool(flag.item())
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
