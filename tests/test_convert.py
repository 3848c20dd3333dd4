"""``hanzo_torch.convert`` / ``hanzo-torch convert``: random-weight transformers checkpoints
(``save_pretrained``) converted to GGUF and run through ``hanzo_torch.load``.

Tolerances, on the logits of a 12-token prompt (relative: max |ours - transformers| / max |transformers|):

* F32: ``F32_RTOL = 1e-5`` (both sides float32 with the same weights; measured 3e-7 to 5e-7).
  A wrong name, layout, bias, norm, head split or expert stacking is O(1).
* Q8_0 and Q4_K_M: the packed tensors are checked byte for byte against ``hanzo_torch.quantize``
  of the checkpoint's tensors and against ``hanzo-torch quantize`` of the F32 conversion (the
  shared llama-quantize recipe), and the logits with ``||ours - theirs|| / ||theirs||`` below
  ``Q8_0_RTOL = 0.05`` (measured 0.014-0.021) and ``Q4_K_M_RTOL = 0.3`` (measured 0.11-0.17;
  random weights have no structure for a 4-bit code to keep). F16 / BF16 matrices: 2e-3 / 2e-2
  (measured 4e-4-6e-4 / 3e-3-4e-3 on the MoE model).

The checkpoints use a small byte-level BPE trained here with Qwen2's pre-tokenizer (the
conversion of the 152k-token Qwen vocabulary takes seconds in the gguf writer); one Qwen3
checkpoint carries the real Qwen3 tokenizer files (tests/qwen_vocab.py) and checks the
tokenizer keys against the ones llama.cpp writes and encoding against transformers'.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import hanzo_torch
from hanzo_torch import cli
from hanzo_torch.convert_hf import QWEN2_PRE_REGEX, ConvertError, convert
from hanzo_torch.requantize import requantize

transformers = pytest.importorskip("transformers")

F32_RTOL = 1e-5
Q8_0_RTOL = 0.05
Q4_K_M_RTOL = 0.3
TOY_VOCAB = 512

TEXTS = ["Hello, world! hello there", "def f(x):\n    return x * 2\n", "1234 + 5678 = 6912",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n</think>", "naïve café 你好"]


def _toy_tokenizer(folder: Path) -> tuple[int, int]:
    """tokenizer.json (byte-level BPE of <= 400 tokens, Qwen2's pre-tokenizer) and
    tokenizer_config.json; returns the ids of ``<|endoftext|>`` (bos, as Qwen's config.json) and
    ``<|im_end|>`` (eos)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TEXTS * 8, trainer)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["<think>", "</think>"])
    tok.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": template, "tokenizer_class": "Qwen2Tokenizer"}))
    return tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")


def _config(arch: str, vocab: int, **kw):
    common = dict(vocab_size=vocab, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
    if arch != "qwen2":
        common.update(head_dim=64)
    if arch == "qwen3moe":
        common.update(moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    common = {**common, "intermediate_size": 512, **kw}
    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "qwen3moe": transformers.Qwen3MoeConfig}[arch]
    return cls(**common)


def _checkpoint(folder: Path, arch: str, real_vocab: bool = False, seed: int = 0, **kw):
    """A random-weight checkpoint in ``folder`` (``save_pretrained``), its tokenizer files, and the model."""
    folder.mkdir(parents=True)
    if real_vocab:
        from qwen_vocab import QWEN3_BOS_TOKEN_ID, QWEN3_VOCAB_SIZE, qwen3_tokenizer_dir

        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(qwen3_tokenizer_dir() / name, folder / name)
        cfg = _config(arch, QWEN3_VOCAB_SIZE, bos_token_id=QWEN3_BOS_TOKEN_ID, eos_token_id=151645, **kw)
    else:
        bos, eos = _toy_tokenizer(folder)
        cfg = _config(arch, TOY_VOCAB, bos_token_id=bos, eos_token_id=eos, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # norms and biases away from their 1 / 0 initial values, so a mix-up shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    return model


class Zoo:
    def __init__(self, root: Path):
        self.root = root
        self._models = {}
        self.ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(1))

    def get(self, arch: str):
        """(folder, transformers model, its logits over ``ids``) of a toy-vocabulary checkpoint."""
        if arch not in self._models:
            kw = dict(tie_word_embeddings=arch != "qwen2")  # qwen2 with an lm_head (output.weight)
            folder = self.root / arch
            model = _checkpoint(folder, arch, **kw)
            with torch.no_grad():
                logits = model(self.ids).logits.float()
            self._models[arch] = (folder, model, logits)
        return self._models[arch]

    def f32(self, arch: str) -> Path:
        """The F32 conversion of :meth:`get`'s checkpoint."""
        out = self.root / f"{arch}-f32.gguf"
        if not out.exists():
            convert(self.get(arch)[0], out, "F32", progress=False)
        return out


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return Zoo(tmp_path_factory.mktemp("convert"))


def _logits(path, ids):
    model = hanzo_torch.load(str(path), kv_dtype="f32")
    with torch.no_grad():
        return model(ids).float(), model


def _max_rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _norm_rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe", "qwen2"])
def test_f32_logits_equal_transformers(zoo, arch, tmp_path):
    folder, model, want = zoo.get(arch)
    out = zoo.f32(arch)
    assert {i.qtype for i in hanzo_torch.GGUFFile(str(out)).tensor_info.values()} == {"F32"}
    got, ours = _logits(out, zoo.ids)
    assert _max_rel(got, want) < F32_RTOL
    f = hanzo_torch.GGUFFile(str(out))
    m = f.metadata
    cfg = model.config
    assert m["general.architecture"] == arch and m["general.file_type"] == 0
    assert m[f"{arch}.block_count"] == 2 and m[f"{arch}.embedding_length"] == 256
    assert m[f"{arch}.attention.head_count_kv"] == 2 and m[f"{arch}.context_length"] == 256
    assert m[f"{arch}.feed_forward_length"] == cfg.intermediate_size
    assert m[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert ("output.weight" in f.tensor_info) == (arch == "qwen2")
    if arch == "qwen3moe":
        assert (m["qwen3moe.expert_count"], m["qwen3moe.expert_used_count"]) == (4, 2)
        assert m["qwen3moe.expert_feed_forward_length"] == 256
        assert f.tensor_info["blk.0.ffn_down_exps.weight"].shape == (4, 256, 256)
        assert f.tensor_info["blk.1.ffn_gate_inp.weight"].qtype == "F32"
        # expert e of the stacked tensor is the checkpoint's expert e
        e2 = model.model.layers[1].mlp.experts
        stacked = f.tensors["blk.1.ffn_up_exps.weight"].dequantize()
        ref = e2.up_proj.weight if hasattr(e2, "up_proj") else None
        if ref is None:  # transformers keeps experts fused as gate_up_proj [E, 2F, H]
            ref = e2.gate_up_proj[:, 256:]
        assert torch.equal(stacked[2], ref[2].detach())
    if arch == "qwen3":
        assert m["qwen3.attention.key_length"] == 64
    # the tokenizer of the file encodes as the checkpoint's tokenizer.json
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        assert ours.tokenizer.encode(text) == hf.encode(text).ids, text
    assert m["tokenizer.ggml.pre"] == "qwen2" and m["tokenizer.ggml.model"] == "gpt2"
    assert m["tokenizer.ggml.eos_token_id"] == hf.token_to_id("<|im_end|>") == model.config.eos_token_id
    assert m["tokenizer.ggml.bos_token_id"] == hf.token_to_id("<|endoftext|>") == model.config.bos_token_id
    assert m["tokenizer.ggml.padding_token_id"] == hf.token_to_id("<|endoftext|>")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe", "qwen2"])
@pytest.mark.parametrize("ftype,tol", [("Q8_0", Q8_0_RTOL), ("Q4_K_M", Q4_K_M_RTOL)])
def test_quantized_conversion(zoo, arch, ftype, tol, tmp_path):
    folder, model, want = zoo.get(arch)
    out = tmp_path / f"{ftype}.gguf"
    notes = []
    plan = convert(folder, out, ftype, progress=False, log=notes.append)
    got, _ = _logits(out, zoo.ids)
    assert _norm_rel(got, want) < tol
    f = hanzo_torch.GGUFFile(str(out))
    # same types and bytes as hanzo-torch quantize (llama-quantize's recipe) of the F32 conversion
    rq = tmp_path / "rq.gguf"
    assert requantize(str(zoo.f32(arch)), str(rq), ftype, progress=False) == plan
    g = hanzo_torch.GGUFFile(str(rq))
    for name in plan:
        assert torch.equal(f.packed(name), g.packed(name)), name
    # the packed bytes are hanzo_torch.quantize of the checkpoint tensor
    w = model.model.layers[0].self_attn.q_proj.weight.detach()
    assert torch.equal(f.packed("blk.0.attn_q.weight").reshape(256, -1),
                       hanzo_torch.quantize(w, plan["blk.0.attn_q.weight"]))
    if ftype == "Q4_K_M":
        assert plan["blk.0.attn_q.weight"] == "Q4_K" and plan["blk.1.attn_v.weight"] == "Q6_K"
        assert plan["output.weight" if arch == "qwen2" else "token_embd.weight"] == "Q6_K"
        assert f.metadata["general.file_type"] == 15
    if arch == "qwen3moe":
        assert plan["blk.0.ffn_gate_inp.weight"] == "F32"
        assert plan["blk.1.ffn_down_exps.weight"] == ("Q8_0" if ftype == "Q8_0" else "Q6_K")
    assert all(t == "F32" for n, t in plan.items() if n.endswith("norm.weight") or n.endswith(".bias"))
    assert notes == []


@pytest.mark.parametrize("ftype,tol", [("F16", 2e-3), ("BF16", 2e-2)])
def test_half_precision_conversion(zoo, ftype, tol, tmp_path):
    """Matrices in F16 / BF16 (the checkpoint's values rounded to nearest), norms and the router F32."""
    folder, model, want = zoo.get("qwen3moe")
    out = tmp_path / "h.gguf"
    plan = convert(folder, out, ftype, progress=False)
    assert plan["blk.0.ffn_up_exps.weight"] == plan["token_embd.weight"] == ftype
    assert plan["blk.0.ffn_gate_inp.weight"] == plan["blk.0.attn_q_norm.weight"] == "F32"
    f = hanzo_torch.GGUFFile(str(out))
    w = model.model.layers[1].self_attn.o_proj.weight.detach()
    dtype = torch.float16 if ftype == "F16" else torch.bfloat16
    assert torch.equal(f.tensors["blk.1.attn_output.weight"].dequantize(), w.to(dtype).float())
    assert f.metadata["general.file_type"] == (1 if ftype == "F16" else 32)
    got, _ = _logits(out, zoo.ids)
    assert _norm_rel(got, want) < tol


def test_fallback_when_rows_are_not_block_multiples(tmp_path):
    """hidden 64: no K-quant block fits; llama-quantize's fallbacks (Q4_K -> Q5_0, Q6_K -> Q8_0)."""
    folder = tmp_path / "small"
    model = _checkpoint(folder, "qwen3", hidden_size=64, intermediate_size=128, head_dim=16,
                        tie_word_embeddings=True)
    notes = []
    plan = convert(folder, tmp_path / "q.gguf", "Q4_K_M", progress=False, log=notes.append)
    assert plan["blk.0.attn_q.weight"] == "Q5_0" and plan["token_embd.weight"] == "Q8_0"
    assert plan["blk.1.ffn_down.weight"] == "Q8_0"  # Q6_K by the recipe, then the fallback
    assert any("blk.0.attn_q.weight: row length 64 is not a multiple of Q4_K's block size 256; written as Q5_0"
               in n for n in notes)
    ids = torch.randint(0, 300, (1, 8))
    with torch.no_grad():
        want = model(ids).logits.float()
    got, _ = _logits(tmp_path / "q.gguf", ids)
    assert _norm_rel(got, want) < Q8_0_RTOL * 2  # 5-bit and 8-bit legacy codes


def test_real_qwen3_vocabulary(tmp_path):
    """The real Qwen3 tokenizer files: the tokenizer keys (chat template included) as llama.cpp
    writes them (tests/qwen_vocab.py derives them independently), encoding as tokenizer.json's."""
    from qwen_vocab import qwen3_tokenizer_metadata

    folder = tmp_path / "real"
    model = _checkpoint(folder, "qwen3", real_vocab=True, hidden_size=64, intermediate_size=128, head_dim=16,
                        tie_word_embeddings=True)
    out = tmp_path / "real.gguf"
    convert(folder, out, "F32", progress=False)
    ids = torch.tensor([[9707, 11, 1879, 0, 151644, 872, 198, 151667, 151645]])
    with torch.no_grad():
        want = model(ids).logits.float()
    got, ours = _logits(out, ids)
    assert _max_rel(got, want) < F32_RTOL
    meta = hanzo_torch.GGUFFile(str(out)).metadata
    for key, value in qwen3_tokenizer_metadata().items():
        assert list(meta[key]) == value if isinstance(value, list) else meta[key] == value, key
    from tokenizers import Tokenizer  # what transformers' Qwen2TokenizerFast runs

    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS + ["Ünïcödé çåfé naïve 한국어 🎉🚀👍🏽", "I'M HERE, you're there, they'll go"]:
        assert ours.tokenizer.encode(text) == hf.encode(text).ids, text


# --------------------------------------------------------------------------------------------- bad input
def test_bad_input_is_a_clear_error_before_writing(zoo, tmp_path):
    folder, _, _ = zoo.get("qwen3")
    out = tmp_path / "x.gguf"

    def bad(src, match, exc=ConvertError, type="F16"):
        with pytest.raises(exc, match=match):
            convert(src, out, type, progress=False)
        assert not out.exists() and not list(tmp_path.glob("x.gguf*")), "nothing written"

    bad(folder, "unknown type 'Q9_K'", type="Q9_K")
    bad(tmp_path / "missing", "no such file or folder", FileNotFoundError)

    def copy(name):
        d = tmp_path / name
        shutil.copytree(folder, d)
        return d

    d = copy("arch")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    bad(d, r"config.json: architecture 'LlamaForCausalLM' is not supported")

    d = copy("key")
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "num_hidden_layers"}))
    bad(d, r"config.json: missing key 'num_hidden_layers'")

    d = copy("tok")
    (d / "tokenizer.json").unlink()
    bad(d, r"tokenizer.json: missing", FileNotFoundError)

    d = copy("layers")  # config says 3 layers, the checkpoint has 2
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    bad(d, r"missing tensor 'model.layers.2.input_layernorm.weight'")

    from safetensors.torch import load_file, save_file

    d = copy("shape")
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.1.self_attn.k_proj.weight"] = sd["model.layers.1.self_attn.k_proj.weight"][:64]
    save_file(sd, str(d / "model.safetensors"))
    bad(d, r"model.safetensors: tensor 'model.layers.1.self_attn.k_proj.weight' has shape \(64, 256\), "
           r"expected \(128, 256\) from config.json")

    d = copy("missing_t")
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.0.self_attn.q_norm.weight"]
    save_file(sd, str(d / "model.safetensors"))
    bad(d, r"missing tensor 'model.layers.0.self_attn.q_norm.weight' \(GGUF 'blk.0.attn_q_norm.weight'\)")

    d = copy("extra")
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.mlp.shared_expert.weight"] = torch.zeros(4, 4)
    save_file(sd, str(d / "model.safetensors"))
    bad(d, r"tensor 'model.layers.0.mlp.shared_expert.weight' has no place in the qwen3 GGUF model")


def test_moe_missing_expert_and_router_normalization(zoo, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _, _ = zoo.get("qwen3moe")
    out = tmp_path / "x.gguf"
    d = tmp_path / "moe"
    shutil.copytree(folder, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "norm_topk_prob": False}))
    with pytest.raises(ConvertError, match="norm_topk_prob is False"):
        convert(d, out, progress=False)
    (d / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(d / "model.safetensors"))
    names = [n for n in sd if ".experts.3.down_proj" in n and ".layers.1." in n]
    if not names:
        pytest.skip("this transformers version saves experts fused (no per-expert tensor to remove)")
    del sd[names[0]]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ConvertError, match=r"missing tensor 'model.layers.1.mlp.experts.3.down_proj.weight'"):
        convert(d, out, progress=False)
    assert not out.exists()


def test_sharded_checkpoint_and_atomic_output(zoo, tmp_path, monkeypatch):
    """Shards listed in model.safetensors.index.json convert to the same file; a failure while
    writing leaves neither the output nor a temporary file."""
    folder, model, _ = zoo.get("qwen3moe")
    d = tmp_path / "sharded"
    model.save_pretrained(d, max_shard_size="300KB")
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("*.safetensors"))) > 2
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, d / name)
    out = tmp_path / "sharded.gguf"
    convert(d, out, "F32", progress=False)
    a, b = hanzo_torch.GGUFFile(str(out)), hanzo_torch.GGUFFile(str(zoo.f32("qwen3moe")))
    assert list(a.tensor_info) == list(b.tensor_info)
    for name in a.tensor_info:
        assert torch.equal(a.packed(name), b.packed(name)), name

    import hanzo_torch.convert_hf as conv

    calls = []

    def failing(ckpt, src):
        calls.append(src.name)
        if len(calls) == 5:
            raise RuntimeError("read error")
        return real(ckpt, src)

    real = conv._load_tensor
    monkeypatch.setattr(conv, "_load_tensor", failing)
    bad = tmp_path / "partial.gguf"
    with pytest.raises(RuntimeError, match="read error"):
        convert(folder, bad, "Q8_0", progress=False)
    assert len(calls) == 5 and list(tmp_path.glob("partial.gguf*")) == []


def test_cli_convert(zoo, tmp_path, capsys):
    folder, _, _ = zoo.get("qwen3")
    out = tmp_path / "cli.gguf"
    assert cli.main(["convert", str(folder / "model.safetensors"), "-o", str(out), "--type", "q8_0"]) == 0
    line = capsys.readouterr().out
    assert "wrote" in line and "Q8_0" in line
    assert hanzo_torch.GGUFFile(str(out)).tensor_info["blk.0.attn_q.weight"].qtype == "Q8_0"
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask
    # convert_hf_to_gguf.py's flag names; the default type is F16 as there
    assert cli.main(["convert", str(folder), "--outfile", str(tmp_path / "f16.gguf")]) == 0
    assert hanzo_torch.GGUFFile(str(tmp_path / "f16.gguf")).tensor_info["blk.0.attn_q.weight"].qtype == "F16"
    capsys.readouterr()
    assert cli.main(["convert", str(folder), "-o", str(tmp_path / "y.gguf"), "--type", "Q7"]) == 2
    assert "unknown type Q7" in capsys.readouterr().err
    assert cli.main(["convert", str(tmp_path / "nope"), "-o", str(tmp_path / "y.gguf")]) == 1
    assert "no such file or folder" in capsys.readouterr().err
    assert not (tmp_path / "y.gguf").exists()


# --------------------------------------------------------------------------------------------- llama.cpp
def _llama_bin() -> Path | None:
    d = os.environ.get("HANZO_LLAMA_BIN")
    return Path(d) if d and (Path(d) / "llama-completion").is_file() else None


@pytest.mark.slow
@pytest.mark.parametrize("arch,ftype,agree", [("qwen3", "F32", 16), ("qwen2", "F32", 16), ("qwen3moe", "Q8_0", 16),
                                              ("qwen3", "Q4_K_M", 6)])
def test_llama_cpp_greedy_tokens(arch, ftype, agree, tmp_path):
    """llama.cpp's ``llama-completion`` loads the converted file and continues a prompt greedily
    with the tokens hanzo-torch picks (``HANZO_LLAMA_BIN``: the folder holding llama-completion).

    All 16 tokens must agree for F32 and Q8_0. For Q4_K_M the first ``agree`` = 6: both engines
    quantize the activations (q8_K) and random weights give near-tied logits, so a rounding-level
    difference can change a later token (measured: 15 of 16 agree for this Qwen3; our own
    float32-activation reference and our kernels part at a similar point)."""
    bin_dir = _llama_bin()
    if bin_dir is None:
        pytest.skip("set HANZO_LLAMA_BIN to a llama.cpp build's bin folder holding llama-completion")
    folder = tmp_path / arch
    _checkpoint(folder, arch, real_vocab=True, seed=3, initializer_range=0.1,
                tie_word_embeddings=arch != "qwen2")
    out = tmp_path / f"{arch}-{ftype}.gguf"
    convert(folder, out, ftype, progress=False)
    model = hanzo_torch.load(str(out), kv_dtype="f32")
    prompt, n = "The quick brown fox", 16
    ours = model.generate(prompt, max_new_tokens=n, temperature=0.0, ignore_eos=True)
    assert len(ours.token_ids) == n
    env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir))
    proc = subprocess.run([str(bin_dir / "llama-completion"), "-m", str(out), "-p", prompt, "-n", str(n),
                           "--temp", "0", "--ignore-eos", "-no-cnv", "--no-display-prompt", "--no-warmup",
                           "-c", "256", "-t", "2", "-s", "1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = proc.stdout.strip()
    if agree == n:
        assert theirs == ours.text.strip(), (theirs, ours.text)
    else:
        prefix = model.tokenizer.decode(ours.token_ids[:agree])
        assert theirs.startswith(prefix.strip()), (theirs, ours.text)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe", "qwen2"])
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q8_0"])
def test_llama_quantize_of_f32_conversion_is_byte_identical(zoo, arch, ftype, tmp_path):
    """``llama-quantize`` of the F32 conversion equals the direct conversion: types and bytes of
    every tensor (HANZO_LLAMA_BIN: the folder holding llama-quantize)."""
    bin_dir = _llama_bin()
    if bin_dir is None or not (bin_dir / "llama-quantize").is_file():
        pytest.skip("set HANZO_LLAMA_BIN to a llama.cpp build's bin folder holding llama-quantize")
    folder, _, _ = zoo.get(arch)
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    convert(folder, ours, ftype, progress=False)
    proc = subprocess.run([str(bin_dir / "llama-quantize"), str(zoo.f32(arch)), str(theirs), ftype, "2"],
                          capture_output=True, text=True, env=dict(os.environ, LD_LIBRARY_PATH=str(bin_dir)),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = hanzo_torch.GGUFFile(str(ours)), hanzo_torch.GGUFFile(str(theirs))
    assert {n: i.qtype for n, i in a.tensor_info.items()} == {n: i.qtype for n, i in b.tensor_info.items()}
    for name in a.tensor_info:
        assert torch.equal(a.packed(name), b.packed(name)), name


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe", "qwen2"])
@pytest.mark.parametrize("ftype", ["F16", "Q8_0"])
def test_same_file_as_convert_hf_to_gguf(arch, ftype, tmp_path):
    """llama.cpp's own ``convert_hf_to_gguf.py`` (HANZO_LLAMA_CONVERT: its path, run with the
    ``gguf-py`` beside it) writes the same metadata (all but the cosmetic ``general.name`` and
    ``general.size_label``), the same tensor names, types, shapes and bytes."""
    script = os.environ.get("HANZO_LLAMA_CONVERT")
    if not script or not Path(script).is_file():
        pytest.skip("set HANZO_LLAMA_CONVERT to llama.cpp's convert_hf_to_gguf.py")
    folder = tmp_path / arch
    _checkpoint(folder, arch, real_vocab=True, hidden_size=64, intermediate_size=128,
                moe_intermediate_size=64, head_dim=16, tie_word_embeddings=arch != "qwen2")
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    convert(folder, ours, ftype, progress=False)
    env = dict(os.environ, PYTHONPATH=str(Path(script).parent / "gguf-py"))
    proc = subprocess.run(["python3", script, str(folder), "--outtype", ftype.lower(), "--outfile", str(theirs)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = hanzo_torch.GGUFFile(str(ours)), hanzo_torch.GGUFFile(str(theirs))
    skip = {"general.name", "general.size_label"}
    assert set(a.metadata) - skip == set(b.metadata) - skip
    for key in set(a.metadata) - skip:
        va, vb = a.metadata[key], b.metadata[key]
        if not isinstance(va, (str, int, float)):
            va, vb = list(va), list(vb)
        assert va == vb, key
        assert a.metadata.value_type(key) == b.metadata.value_type(key), key
    assert set(a.tensor_info) == set(b.tensor_info)
    for name, info in b.tensor_info.items():
        assert (a.tensor_info[name].qtype, tuple(a.tensor_info[name].shape)) == (info.qtype, tuple(info.shape)), name
        assert torch.equal(a.packed(name), b.packed(name)), name


# --------------------------------------------------------------------------------------------- imatrix
def _random_imatrix(gguf_path, seed: int = 5):
    """An imatrix for every ``blk.*`` matrix of ``gguf_path`` (per expert for ``*_exps``: one
    expert never routed to), as llama-imatrix would write it."""
    from hanzo_torch.imatrix import IMatrix, IMatrixEntry

    g = torch.Generator().manual_seed(seed)
    ents = {}
    for n, i in hanzo_torch.GGUFFile(str(gguf_path)).tensor_info.items():
        if not n.startswith("blk.") or len(i.shape) < 2 or "gate_inp" in n:
            continue
        e = i.shape[0] if len(i.shape) == 3 else 1
        counts = torch.randint(1, 64, (e,), generator=g)
        if e > 1:
            counts[1] = 0
        ents[n] = IMatrixEntry(torch.rand(e, i.shape[-1], generator=g).pow(3) * counts[:, None] * 4, counts)
    return IMatrix(ents, ["calib.txt"], 2, 32)


@pytest.mark.parametrize("arch", ["qwen3moe"])
def test_conversion_with_imatrix(zoo, arch, tmp_path):
    from hanzo_torch.imatrix import save_imatrix

    folder, model, _ = zoo.get(arch)
    im = _random_imatrix(zoo.f32(arch))
    path = tmp_path / "im.gguf"
    save_imatrix(path, im)
    out = tmp_path / "q.gguf"
    plan = convert(folder, out, "Q4_K_M", progress=False, imatrix=str(path))
    rq = tmp_path / "rq.gguf"
    assert requantize(str(zoo.f32(arch)), str(rq), "Q4_K_M", progress=False, imatrix=im) == plan
    f, g = hanzo_torch.GGUFFile(str(out)), hanzo_torch.GGUFFile(str(rq))
    for name in plan:
        assert torch.equal(f.packed(name), g.packed(name)), name
    assert f.metadata["quantize.imatrix.entries_count"] == len(im)
    # each expert quantized with its own weights (the expert never routed to: weights 1)
    name = "blk.0.ffn_up_exps.weight"
    x = hanzo_torch.GGUFFile(str(zoo.f32(arch))).tensors[name].dequantize()
    w = im.weights(name).reshape(x.shape[0], -1)
    assert torch.equal(w[1], torch.ones_like(w[1]))
    for e in range(x.shape[0]):
        want = hanzo_torch.quantize(x[e], plan[name], quant_weights=w[e])
        assert torch.equal(f.packed(name)[e].reshape(want.shape), want), e


def test_low_bit_conversion_needs_an_imatrix(zoo, tmp_path):
    """IQ3_XXS / IQ2_* / IQ1_* conversions: refused without an imatrix as llama-quantize refuses
    them (naming --imatrix), before anything is written; with one, the same file as requantize."""
    folder, _, _ = zoo.get("qwen3moe")
    out = tmp_path / "q.gguf"
    with pytest.raises(ConvertError, match=r"IQ1_S needs an importance matrix \(--imatrix FILE"):
        convert(folder, out, "IQ1_S", progress=False)
    assert not out.exists()
    im = _random_imatrix(zoo.f32("qwen3moe"))
    plan = convert(folder, out, "IQ2_XS", progress=False, imatrix=im)
    rq = tmp_path / "rq.gguf"
    assert requantize(str(zoo.f32("qwen3moe")), str(rq), "IQ2_XS", progress=False, imatrix=im) == plan
    assert plan["blk.0.ffn_up_exps.weight"] == "IQ2_XS"
    f, g = hanzo_torch.GGUFFile(str(out)), hanzo_torch.GGUFFile(str(rq))
    for name in plan:
        assert torch.equal(f.packed(name), g.packed(name)), name


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
@pytest.mark.parametrize("ftype", ["Q4_K_M", "IQ4_XS", "IQ4_NL", "Q5_K_M", "IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS",
                                   "IQ2_XXS", "IQ1_M", "IQ1_S"])
def test_llama_quantize_imatrix_byte_identical(zoo, arch, ftype, tmp_path):
    """``llama-quantize --imatrix`` of the F32 conversion equals ``convert(..., imatrix=)``: types,
    bytes of every tensor and the ``quantize.imatrix.*`` keys (HANZO_LLAMA_BIN as above)."""
    from hanzo_torch.imatrix import save_imatrix

    bin_dir = _llama_bin()
    if bin_dir is None or not (bin_dir / "llama-quantize").is_file():
        pytest.skip("set HANZO_LLAMA_BIN to a llama.cpp build's bin folder holding llama-quantize")
    folder, _, _ = zoo.get(arch)
    im_path = tmp_path / "im.gguf"
    save_imatrix(im_path, _random_imatrix(zoo.f32(arch)))
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    convert(folder, ours, ftype, progress=False, imatrix=str(im_path))
    proc = subprocess.run([str(bin_dir / "llama-quantize"), "--imatrix", str(im_path), str(zoo.f32(arch)), str(theirs),
                           ftype, "2"], capture_output=True, text=True,
                          env=dict(os.environ, LD_LIBRARY_PATH=str(bin_dir)), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = hanzo_torch.GGUFFile(str(ours)), hanzo_torch.GGUFFile(str(theirs))
    assert {n: i.qtype for n, i in a.tensor_info.items()} == {n: i.qtype for n, i in b.tensor_info.items()}
    bad = [n for n in a.tensor_info if not torch.equal(a.packed(n), b.packed(n))]
    assert bad == [], bad
    for k in ("quantize.imatrix.file", "quantize.imatrix.dataset", "quantize.imatrix.entries_count",
              "quantize.imatrix.chunks_count"):
        assert a.metadata[k] == b.metadata[k], k
