"""Tensor parallel (hanzo_torch.distributed): 2 gloo processes against the single-process model.

One spawned pair of processes loads tiny qwen3, qwen2 and qwen3moe files (Q8_0/Q4_K/Q6_K
weights whose row-parallel splits are block-aligned; the experts' 768-wide FFN is 3 blocks of
256, split 1 + 2) with ``tensor_parallel=True``, writes its logits, greedy tokens and weight bytes to files, then
rank 1 exits without a word and rank 0 runs another forward, which must fail with a
TensorParallelError within the group's timeout. The test process computes the single-process
references.
"""
from __future__ import annotations

import datetime
import os
import socket
import time

import pytest
import torch

from tests.gguf_builders import tiny_spec, tokenizer_metadata, write_tiny_gguf

ARCHS = ("qwen3", "qwen2", "qwen3moe")
QTYPES = {"embd": "Q8_0", "attn": "Q8_0", "ffn": "Q4_K", "ffn_down": "Q6_K"}
IDS = [[11, 500, 900, 7000, 8100, 3, 42, 1234]]
TIMEOUT_S = 8  # the process group's collective timeout in the dead-rank check
# The matrix ops run their torch references (dequantize, float32 matmul) on both sides: the C++
# kernels round activations to int8 along paths chosen by the matrix shape, so a sharded matrix
# can round differently from the whole one (measured 1.5e-3 and 2.7e-3 of the largest logit for
# these files), which would hide the float32-order check this test makes.
REF_OPS = ("mul_mat", "mul_mat_id", "swiglu_mul_mat")
ENV = {f"HANZO_{op.upper()}_FALLBACK": "1" for op in REF_OPS}


def _small_vocab(n: int = 8192) -> dict:
    """The first ``n`` Qwen3 tokens, special ids moved into range: a small embedding, fast to write."""
    meta = tokenizer_metadata(full=False)
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"][:n]
    for key, v in (("bos", n - 1), ("eos", n - 2), ("padding", n - 1)):
        meta[f"tokenizer.ggml.{key}_token_id"] = v
    return meta


def _spec(arch: str, **kw):
    # dense FFNs of 4 Q6_K blocks split 2 + 2, the experts' 3 blocks 1 + 2; qwen2 with a separate
    # output matrix, the others tied to token_embd
    extra = {"qwen3": {"ffn": 1024}, "qwen2": {"ffn": 1024, "tied": False}, "qwen3moe": {}}[arch]
    return tiny_spec(arch, qtypes={**QTYPES, "output": "Q6_K"}, seed=3, **extra, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, paths: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    import hanzo_torch
    from hanzo_torch.distributed import TensorParallelError

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    res = {}
    for arch, path in paths.items():
        m = hanzo_torch.load(path, tensor_parallel=True, max_context=64)
        with torch.inference_mode():
            logits = m(torch.tensor(IDS))
        greedy = m.generate(IDS[0], max_new_tokens=6, temperature=0, ignore_eos=True).token_ids
        sampled = m.generate(IDS[0], max_new_tokens=6, temperature=1.0, seed=rank, ignore_eos=True).token_ids
        res[arch] = dict(logits=logits, greedy=greedy, sampled=sampled, bytes=m.tp.weight_bytes,
                         file_bytes=m.tp.file_weight_bytes, heads=(m.args.n_head, m.args.n_head_kv))
    torch.save(res, f"{out}/rank{rank}.pt")
    dist.all_reduce(torch.zeros(1))  # barrier (dist.barrier asks for the PrivateUse1 device)
    if rank == 1:
        os._exit(3)  # a rank that dies mid-run
    t0 = time.monotonic()
    try:
        with torch.inference_mode():
            m(torch.tensor(IDS), positions=torch.arange(8).unsqueeze(0))
        err = "no error"
    except TensorParallelError as exc:
        err = str(exc)
    except Exception as exc:  # noqa: BLE001 - recorded: the test asserts it was a TensorParallelError
        err = f"{type(exc).__name__}: {exc}"
    torch.save({"error": err, "seconds": time.monotonic() - t0}, f"{out}/dead.pt")


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    import torch.multiprocessing as mp

    d = tmp_path_factory.mktemp("tp")
    meta = _small_vocab()
    paths = {a: write_tiny_gguf(d / f"{a}.gguf", _spec(a), meta) for a in ARCHS}
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)  # spawned children inherit it
    try:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, 2, port, paths, str(d))) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 150
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        assert not alive, "a tensor-parallel rank hung (killed after 150 s)"
        ref = {}
        import hanzo_torch
        from hanzo_torch.ops import use_reference

        with use_reference(*REF_OPS):
            for a, path in paths.items():
                m = hanzo_torch.load(path, max_context=64)
                with torch.inference_mode():
                    logits = m(torch.tensor(IDS))
                greedy = m.generate(IDS[0], max_new_tokens=6, temperature=0, ignore_eos=True).token_ids
                ref[a] = dict(logits=logits, greedy=greedy)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ranks = [torch.load(d / f"rank{r}.pt") for r in range(2)]
    dead = torch.load(d / "dead.pt")
    return ref, ranks, dead, [p.exitcode for p in procs]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_tokens_match_single_process(tp_run, arch):
    ref, ranks, _, _ = tp_run
    want = ref[arch]["logits"]
    for r in ranks:
        got = r[arch]["logits"]
        assert got.shape == want.shape
        err = (got - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item() + 1e-5, f"{arch}: max |tp - single| = {err}"
        assert r[arch]["greedy"] == ref[arch]["greedy"]
    assert torch.equal(ranks[0][arch]["logits"], ranks[1][arch]["logits"])  # the same bits on every rank


@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_on_rank0_is_broadcast(tp_run, arch):
    _, ranks, _, _ = tp_run
    # each rank was given a different seed: only rank 0's sampler counts
    assert ranks[0][arch]["sampled"] == ranks[1][arch]["sampled"]


@pytest.mark.parametrize("arch", ARCHS)
def test_each_rank_holds_about_half_the_weight_bytes(tp_run, arch):
    _, ranks, _, _ = tp_run
    for r in ranks:
        frac = r[arch]["bytes"] / r[arch]["file_bytes"]
        lo, hi = (0.3, 0.7) if arch == "qwen3moe" else (0.4, 0.6)  # the experts' FFN is split 1 + 2 blocks
        assert lo < frac < hi, f"{arch}: a rank holds {frac:.3f} of the weights"
        assert r[arch]["heads"] == (2, 1)  # 4 query / 2 KV heads, half each
    assert sum(r[arch]["bytes"] for r in ranks) < 1.02 * ranks[0][arch]["file_bytes"]


def test_dead_rank_fails_the_others_with_a_clear_error(tp_run):
    _, _, dead, exitcodes = tp_run
    assert exitcodes[1] == 3
    assert dead["error"].startswith("tensor parallel rank 0/2: all_reduce after"), dead["error"]
    assert "peer rank" in dead["error"]
    assert dead["seconds"] < TIMEOUT_S + 10


# ---------------------------------------------------------------------- split checks, no processes
def _plan(tmp_path, arch, tp, rank=0, **kw):
    from hanzo_torch.distributed import plan_shards
    from hanzo_torch.gguf_file import GGUFFile
    from hanzo_torch.models import ModelArgs

    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", tiny_spec(arch, **kw), _small_vocab())
    with GGUFFile(path) as f:
        return plan_shards(ModelArgs.from_gguf(f), f, tp, rank)


def test_plan_splits_ffn_on_block_boundaries_unevenly(tmp_path):
    plans = [_plan(tmp_path, "qwen3", 2, r, qtypes=QTYPES) for r in range(2)]
    assert [p.ffn[0] for p in plans] == [(0, 256), (256, 768)]  # 3 Q6_K blocks of ffn_down over 2 ranks
    assert [p.heads for p in plans] == [(0, 2), (2, 4)] and [p.kv_heads for p in plans] == [(0, 1), (1, 2)]
    assert plans[0].vocab == (0, 4096) and plans[1].vocab == (4096, 8192)


def test_plan_rejects_kv_heads_not_divisible(tmp_path):
    with pytest.raises(ValueError, match=r"head_count_kv \(2\) to be multiples of 4"):
        _plan(tmp_path, "qwen3", 4)


def test_plan_rejects_attn_output_split_inside_a_block(tmp_path):
    # qwen2 tiny: 4 heads of 64, so 128 columns per rank, half a Q4_K block
    with pytest.raises(ValueError, match=r"blk\.0\.attn_output\.weight \(Q4_K.*128 columns per rank.*block size 256"):
        _plan(tmp_path, "qwen2", 2, qtypes={"attn": "Q4_K"})


def test_plan_rejects_fewer_ffn_blocks_than_ranks(tmp_path):
    with pytest.raises(ValueError, match=r"ffn_down\.weight \(Q6_K, K = 768\).*only 3 block"):
        _plan(tmp_path, "qwen3", 4, n_head_kv=4, qtypes=QTYPES)


def test_load_without_a_process_group_is_a_clear_error(tmp_path):
    import hanzo_torch

    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_spec("qwen3"), _small_vocab())
    with pytest.raises(ValueError, match="initialized torch.distributed process group"):
        hanzo_torch.load(path, tensor_parallel=True)
    with pytest.raises(TypeError, match="tensor_parallel must be a bool"):
        hanzo_torch.load(path, tensor_parallel="yes")


def test_cli_tp_must_equal_world_size(tmp_path, capsys, monkeypatch):
    from hanzo_torch.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_spec("qwen3"), _small_vocab())
    assert main(["generate", "-m", path, "-p", "hi", "--tp", "2"]) == 2
    assert "--tp 2 must equal the world size 1" in capsys.readouterr().err
