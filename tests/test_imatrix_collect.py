"""``compute_imatrix`` / ``hanzo-torch imatrix``: the collected sums and counts against a plain
torch computation on transformers' own model (the toy checkpoints of test_convert), and, slow,
against llama-imatrix on the real model."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

import hanzo_torch
from hanzo_torch.convert_hf import convert
from hanzo_torch.imatrix import MIN_DENSE_ROWS, compute_imatrix, load_imatrix, save_imatrix

N_CTX = 32

_HF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
       "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


@pytest.fixture(scope="module")
def toys(tmp_path_factory):
    from test_convert import TOY_VOCAB, _checkpoint

    root = tmp_path_factory.mktemp("imc")
    out = {}
    for arch in ("qwen2", "qwen3moe"):  # qwen2: dense, untied output; qwen3moe: experts, tied
        model = _checkpoint(root / arch, arch, tie_word_embeddings=arch != "qwen2")
        gguf_path = root / f"{arch}.gguf"
        convert(root / arch, gguf_path, "F32", progress=False)
        out[arch] = (model, gguf_path)
    tokens = torch.randint(0, TOY_VOCAB, (3 * N_CTX + 5,), generator=torch.Generator().manual_seed(2)).tolist()
    return out, tokens


def _reference(hf, gguf_path, tokens, n_chunks, process_output=False):
    """Sums (float64) and counts of every mat-mul input of transformers' forward, chunk by chunk."""
    f = hanzo_torch.GGUFFile(gguf_path)
    sums, counts = {}, {}

    def add(name, rows, expert=None, n_mat=1):
        rows = rows.detach().double().reshape(-1, rows.shape[-1])
        if name not in sums:
            sums[name] = torch.zeros(n_mat, rows.shape[-1], dtype=torch.float64)
            counts[name] = torch.zeros(n_mat, dtype=torch.int64)
        e = 0 if expert is None else expert
        sums[name][e] += rows.square().sum(0)
        counts[name][e] += rows.shape[0]

    hooks = []
    for mname, mod in hf.named_modules():
        parts = mname.split(".")
        if len(parts) < 3 or parts[0] != "model" or parts[1] != "layers":
            continue
        i, leaf = parts[2], parts[-1]
        if leaf in _HF and isinstance(mod, torch.nn.Linear):
            name = f"blk.{i}.{_HF[leaf]}.weight"
            hooks.append(mod.register_forward_pre_hook(lambda m, a, name=name: add(name, a[0])))
        elif leaf == "gate" and parts[-2] == "mlp":  # the MoE router
            hooks.append(mod.register_forward_pre_hook(lambda m, a, i=i: add(f"blk.{i}.ffn_gate_inp.weight", a[0])))
        elif leaf == "experts":
            wg = f.tensors[f"blk.{i}.ffn_gate_exps.weight"].dequantize().double()
            wu = f.tensors[f"blk.{i}.ffn_up_exps.weight"].dequantize().double()
            n_exp = wg.shape[0]

            def experts(m, a, i=i, wg=wg, wu=wu, n_exp=n_exp):
                x, sel = a[0].double(), a[1]
                for t in range(x.shape[0]):
                    for e in sel[t].tolist():
                        add(f"blk.{i}.ffn_gate_exps.weight", x[t:t + 1], e, n_exp)
                        add(f"blk.{i}.ffn_up_exps.weight", x[t:t + 1], e, n_exp)
                        h = torch.nn.functional.silu(x[t] @ wg[e].T) * (x[t] @ wu[e].T)
                        add(f"blk.{i}.ffn_down_exps.weight", h[None], e, n_exp)
            hooks.append(mod.register_forward_pre_hook(experts))
    if process_output:
        hooks.append(hf.lm_head.register_forward_pre_hook(lambda m, a: add("output.weight", a[0])))
    try:
        with torch.no_grad():
            for c in range(n_chunks):
                hf(torch.tensor([tokens[c * N_CTX:(c + 1) * N_CTX]]))
    finally:
        for h in hooks:
            h.remove()
    return sums, counts


@pytest.mark.parametrize("arch", ["qwen2", "qwen3moe"])
def test_sums_equal_a_plain_torch_computation(toys, arch, tmp_path):
    models, tokens = toys
    hf, path = models[arch]
    model = hanzo_torch.load(str(path), kv_dtype="f32")
    m = compute_imatrix(model, tokens, N_CTX, 2, dataset="toy.txt", n_ubatch=16)
    ref_sums, ref_counts = _reference(hf, path, tokens, 2)
    assert set(m.entries) == set(ref_sums)
    assert (m.chunk_count, m.chunk_size, m.datasets) == (2, N_CTX, ["toy.txt"])
    for name, e in m.entries.items():
        assert torch.equal(e.counts, ref_counts[name]), name
        ref = ref_sums[name].float()
        err = float((e.sums - ref).abs().max() / ref.abs().max())
        assert err < 1e-4, (name, err)  # float32 kernels vs transformers: ~1e-6 measured
    if arch == "qwen3moe":
        c = m.entries["blk.0.ffn_up_exps.weight"].counts
        assert int(c.sum()) == 2 * N_CTX * model.args.n_expert_used  # every routed (token, slot)
        assert torch.equal(c, m.entries["blk.0.ffn_down_exps.weight"].counts)
    else:
        assert torch.equal(m.entries["blk.1.ffn_gate.weight"].sums, m.entries["blk.1.ffn_up.weight"].sums)
        assert int(m.entries["blk.0.attn_q.weight"].counts[0]) == 2 * N_CTX
    # written and read back as llama-imatrix's GGUF
    save_imatrix(tmp_path / "im.gguf", m)
    back = load_imatrix(tmp_path / "im.gguf")
    assert all(torch.equal(back.entries[n].sums, e.sums) for n, e in m.entries.items())


def test_small_batches_skip_dense_weights_and_output(toys):
    """As llama-imatrix: a dense mat-mul of fewer than 16 rows is not collected; routed experts
    always are; output.weight only with process_output (and only an untied one)."""
    models, tokens = toys
    model = hanzo_torch.load(str(models["qwen3moe"][1]), kv_dtype="f32")
    m = compute_imatrix(model, tokens, N_CTX, 2, n_batch=MIN_DENSE_ROWS - 1)
    assert sorted(m.entries) == sorted(n for n in m.entries if "_exps" in n) and len(m.entries) == 3 * model.args.n_layer
    hf, path = models["qwen2"]
    model = hanzo_torch.load(str(path), kv_dtype="f32")
    m = compute_imatrix(model, tokens, N_CTX, 3, process_output=True)
    ref_sums, ref_counts = _reference(hf, path, tokens, 3, process_output=True)
    assert torch.equal(m.entries["output.weight"].counts, ref_counts["output.weight"])
    ref = ref_sums["output.weight"].float()
    assert float((m.entries["output.weight"].sums - ref).abs().max() / ref.abs().max()) < 1e-4
    assert "output.weight" not in compute_imatrix(model, tokens, N_CTX, 2).entries
    moe = hanzo_torch.load(str(models["qwen3moe"][1]), kv_dtype="f32")  # tied: no output.weight
    assert "output.weight" not in compute_imatrix(moe, tokens, N_CTX, 2, process_output=True).entries


def test_hooks_are_removed_and_state_restored(toys):
    models, tokens = toys
    model = hanzo_torch.load(str(models["qwen2"][1]), kv_dtype="f32")
    ids = torch.tensor([tokens[:20]])
    before = model(ids)
    model.reset()
    ub = model.ubatch
    compute_imatrix(model, tokens, N_CTX, 1)
    assert model.ubatch == ub and "swiglu" not in vars(model.blk[0].ffn_gate)
    assert all(not mod._forward_pre_hooks for mod in model.modules())
    assert torch.equal(model(ids), before)


def test_bad_arguments(toys):
    models, tokens = toys
    model = hanzo_torch.load(str(models["qwen2"][1]), kv_dtype="f32", max_context=64)
    with pytest.raises(ValueError, match=r"tokenizes to 40 tokens; a context of 32 needs at least 64"):
        compute_imatrix(model, tokens[:40], N_CTX)
    with pytest.raises(ValueError, match="n_ctx 128 exceeds the model's max_context 64"):
        compute_imatrix(model, tokens, 128)
    with pytest.raises(ValueError, match="n_batch must be a positive int"):
        compute_imatrix(model, tokens, N_CTX, n_batch=0)


def test_cli_imatrix(toys, tmp_path, capsys):
    from hanzo_torch import cli

    models, tokens = toys
    hf, path = models["qwen2"]
    tok = hanzo_torch.load(str(path)).tokenizer
    text = tok.decode(tokens)
    txt = tmp_path / "calib.txt"
    txt.write_text(text)
    n = len(tok.encode(text))
    out = tmp_path / "im.gguf"
    assert cli.main(["imatrix", "-m", str(path), "-f", str(txt), "-o", str(out), "-c", str(N_CTX), "--chunks", "2"]) == 0
    assert "wrote" in capsys.readouterr().out
    m = load_imatrix(out)
    assert m.chunk_count == 2 and m.datasets == [str(txt)] and int(m.entries["blk.0.attn_q.weight"].counts[0]) == 64
    dat = tmp_path / "im.dat"
    assert cli.main(["imatrix", "-m", str(path), "-f", str(txt), "-o", str(dat), "-c", str(N_CTX), "--chunks", "2",
                     "--output-format", "dat"]) == 0
    legacy = load_imatrix(dat)
    assert legacy.legacy and legacy.chunk_count == 2
    w, wl = m.weights("blk.1.ffn_down.weight"), legacy.weights("blk.1.ffn_down.weight")
    assert torch.allclose(w, wl, rtol=1e-6)  # the same weights for llama-quantize from both forms
    capsys.readouterr()
    big = n // 2 + 1  # below the toy's context length 256, above half the text
    assert big < 256
    assert cli.main(["imatrix", "-m", str(path), "-f", str(txt), "-o", str(out), "-c", str(big)]) == 1
    assert f"tokenizes to {n} tokens; -c {big} needs at least {2 * big}" in capsys.readouterr().err
    assert cli.main(["imatrix", "-m", str(path), "-f", str(tmp_path / "none.txt"), "-o", str(out)]) == 1
    assert "cannot read" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the real model
@pytest.mark.slow
def test_real_model_against_llama_imatrix(tmp_path):
    """Our imatrix of the real model vs llama-imatrix's on the same text and chunks (HANZO_LLAMA_BIN:
    a llama.cpp build's bin folder). Same activations up to kernel rounding (llama.cpp quantizes
    activations to Q8_K/Q8_0 for its dot products, hanzo-torch's CPU kernels differ): the same
    entries and counts, and per entry a relative L2 difference of the weights (mean squared
    activations) below 3 % (measured on llama.cpp's README: median 0.34 %, worst 1.6 %, an
    ffn_down; a wrong input or count is off by 100 % or more)."""
    from conftest import real_model_path

    d = os.environ.get("HANZO_LLAMA_BIN")
    if not d or not (Path(d) / "llama-imatrix").is_file():
        pytest.skip("set HANZO_LLAMA_BIN to a llama.cpp build's bin folder holding llama-imatrix")
    model_path = real_model_path()
    text = (Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md").read_text()[:20000]
    txt = tmp_path / "calib.txt"
    txt.write_text(text)
    theirs = tmp_path / "theirs.gguf"
    # -nr: llama.cpp's AMX repacked weights crash its imatrix callback on this box
    proc = subprocess.run([str(Path(d) / "llama-imatrix"), "-m", str(model_path), "-f", str(txt), "-o", str(theirs),
                           "-c", "128", "-b", "128", "--chunks", "4", "--no-ppl", "-nr", "-t", "2"],
                          capture_output=True, text=True, env=dict(os.environ, LD_LIBRARY_PATH=d), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = hanzo_torch.load(str(model_path), kv_dtype="f32")
    ours = compute_imatrix(model, model.tokenizer.encode(text), 128, 4, n_batch=128, dataset=str(txt))
    ref = load_imatrix(theirs)
    assert set(ours.entries) == set(ref.entries)
    assert ours.chunk_count == ref.chunk_count == 4
    worst = 0.0
    for name in ref.entries:
        assert torch.equal(ours.entries[name].counts, ref.entries[name].counts), name
        a, b = ours.weights(name), ref.weights(name)
        worst = max(worst, float((a - b).norm() / b.norm()))
    assert worst < 0.03, worst
