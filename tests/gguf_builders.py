"""Write tiny random-weight GGUF files of the Qwen2 / Qwen3 / Qwen3-MoE architectures.

The files carry the metadata keys and tensor names llama.cpp's converter writes
(``gguf.MODEL_TENSORS`` / ``gguf.Keys``), the real Qwen3 vocabulary (from
:mod:`tests.qwen_vocab`), and weights in F32 or in packed ggml formats, so that both
hanzo-torch and transformers' GGUF loader (``from_pretrained(folder, gguf_file=...)``) can load
them. Shapes follow what transformers assumes for each architecture
(``transformers/integrations/ggml.py`` GGUF_CONFIG_MAPPING and the config classes' defaults):

* ``qwen3``: transformers does not map ``attention.key_length``; ``Qwen3Config.head_dim``
  defaults to 128, so the file must use head_dim 128.
* ``qwen3moe``: ``attention.key_length`` maps to ``head_dim``, but
  ``expert_feed_forward_length`` is not mapped and ``Qwen3MoeConfig.moe_intermediate_size``
  defaults to 768, so experts must have ffn 768. ``norm_topk_prob`` is forced True (llama.cpp's
  qwen3moe renormalizes the top-k weights).
* ``qwen2``: head_dim is ``hidden_size // num_attention_heads`` on both sides.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import gguf
import numpy as np

__all__ = ["TinySpec", "tiny_spec", "tokenizer_metadata", "write_tiny_gguf", "pack"]


@dataclass
class TinySpec:
    arch: str  # "qwen2", "qwen3", "qwen3moe"
    n_layer: int = 2
    hidden: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 128
    ffn: int = 768
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ffn: int = 768
    context_length: int = 2048
    rope_theta: float = 1_000_000.0
    eps: float = 1e-6
    tied: bool = True  # no output.weight: the LM head reuses token_embd
    # ggml format per tensor role ("embd", "output", "attn", "ffn", "ffn_down", "router"), F32 when
    # absent; layer_qtypes[i] overrides the roles of layer i.
    qtypes: dict = field(default_factory=dict)
    layer_qtypes: dict = field(default_factory=dict)
    seed: int = 0


def tiny_spec(arch: str, **kw) -> TinySpec:
    """The default tiny shape of ``arch`` (hidden 256, 2 layers), see the module docstring."""
    if arch == "qwen3":
        spec = TinySpec(arch, head_dim=128)
    elif arch == "qwen3moe":
        spec = TinySpec(arch, head_dim=128, n_expert=8, n_expert_used=2, expert_ffn=768)
    elif arch == "qwen2":
        spec = TinySpec(arch, head_dim=256 // 4)
    else:
        raise ValueError(f"no tiny spec for architecture {arch!r}")
    for k, v in kw.items():
        if not hasattr(spec, k):
            raise TypeError(f"TinySpec has no field {k!r}")
        setattr(spec, k, v)
    return spec


def pack(x: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Packed ggml rows of format ``qtype`` for a float32 weight ``x [..., K]``: ``uint8 [..., row_bytes]``.

    Where a quantizer exists (``gguf.quants.quantize``, else ``hanzo_torch.quantize``) the result
    encodes ``x``. Otherwise (the K-quants today) it is random blocks (random quants and sub-block
    scales) whose fp16 super-block scales are set so the values have ``x``'s root mean
    square: the test needs weights of a sane scale in that format, not ``x`` itself. F32
    returns ``x``.
    """
    qt = gguf.GGMLQuantizationType[qtype]
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qt == gguf.GGMLQuantizationType.F32:
        return x
    try:
        return gguf.quants.quantize(x, qt)
    except NotImplementedError:
        pass
    import torch

    import hanzo_torch

    fmt = hanzo_torch.get_format(qtype)
    # K-quants keep the random-block fixtures below: the model tests' tolerances are set for them
    if fmt.quantize_blocks is not None and qtype not in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        from hanzo_torch.formats import _kquant_native

        # unit importance weights for the formats ggml quantizes only with weights
        qw = torch.ones(x.shape[-1]) if qtype in _kquant_native.REQUIRES_WEIGHTS else None
        return hanzo_torch.quantize(torch.from_numpy(x), qtype, quant_weights=qw).numpy()
    from tests.format_utils import FLOAT_FIELDS

    n_blocks = x.size // fmt.block_size
    blocks = rng.integers(0, 256, (n_blocks, fmt.type_size), dtype=np.uint8)

    def set_scales(value: float) -> None:
        bits = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
        for offset, kind in FLOAT_FIELDS[qtype]:
            if kind != "f16":
                raise NotImplementedError(f"pack: no quantizer for {qtype} and its scale field is {kind}")
            blocks[:, offset : offset + 2] = bits

    set_scales(1.0)
    sample = gguf.quants.dequantize(blocks[:4096], qt)  # enough blocks for the rms to 1%
    unit_rms = float(np.sqrt(np.mean(np.square(sample))))
    set_scales(float(np.sqrt(np.mean(np.square(x)))) / unit_rms)
    return blocks.reshape(*x.shape[:-1], -1)


def tokenizer_metadata(full: bool = True) -> dict:
    """Qwen3's GGUF ``tokenizer.*`` metadata (:func:`tests.qwen_vocab.qwen3_tokenizer_metadata`).

    ``full=False`` keeps the real 151936-entry token list and the special ids but drops
    ``token_type``, ``merges`` and the chat template: enough for transformers to size the vocabulary
    (it takes ``vocab_size`` from the token count), not enough to build a tokenizer. It exists
    for speed: ``gguf.GGUFReader``, which transformers' loader runs, spends seconds per 100k
    array elements, and the full vocabulary has 455k of them.
    """
    from tests.qwen_vocab import qwen3_tokenizer_metadata

    meta = qwen3_tokenizer_metadata()
    if not full:
        for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.chat_template"):
            meta.pop(key)
    return meta


def write_small_vocab_models(root: str | os.PathLike, specs: dict, vocab: int) -> dict:
    """``{arch: path}``: a tiny random-weight GGUF per ``arch: tiny_spec keyword arguments`` of
    ``specs``, written in ``root``, whose vocabulary is the first ``vocab`` Qwen tokens (a small LM
    head keeps many decode steps fast; the special ids point at the last of them)."""
    meta = tokenizer_metadata(full=False)
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"][:vocab]
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id"):
        meta[key] = vocab - 1
    return {a: write_tiny_gguf(os.path.join(root, f"{a}.gguf"), tiny_spec(a, **s), meta) for a, s in specs.items()}


def write_tiny_gguf(path: str | os.PathLike, spec: TinySpec, tokenizer_meta: Optional[dict] = None,
                    dense_twin: bool = False) -> str:
    """Write a random-weight GGUF of ``spec`` to ``path`` and return the path.

    Weights before packing: token_embd ~ N(0, 1); projections ~ N(0, 1/K) (attention and FFN
    outputs are comparable to the residual, so the context changes the logits); norm weights
    1 + N(0, 0.1); Qwen2 q/k/v biases N(0, 0.5). The vocabulary size is the token count.

    ``dense_twin=True`` writes the same model with every tensor as F32 holding the exact
    ``gguf.quants.dequantize`` of the packed tensor the call without it writes (same seed): a
    float32 oracle (e.g. for transformers) of the packed file.
    """
    from tests.qwen_vocab import add_tokenizer_metadata

    meta = tokenizer_metadata() if tokenizer_meta is None else tokenizer_meta
    n_vocab = len(meta["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(spec.seed)
    a, H, D = spec.arch, spec.hidden, spec.head_dim

    w = gguf.GGUFWriter(os.fspath(path), a)
    w.add_name(f"tiny-random-{a}")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_block_count(spec.n_layer)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(H)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.eps)
    if a in ("qwen3", "qwen3moe"):
        w.add_key_length(D)
        w.add_value_length(D)
    if spec.n_expert:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
        w.add_expert_feed_forward_length(spec.expert_ffn)
    all_f32 = dense_twin or not any(
        q != "F32" for d in (spec.qtypes, *spec.layer_qtypes.values()) for q in d.values()
    )
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if all_f32 else gguf.LlamaFileType.GUESSED)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer_metadata(w, meta)

    def randn(*shape, std=1.0):
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)

    def tensor(name, x, role=None, layer=None):
        roles = {**spec.qtypes, **spec.layer_qtypes.get(layer, {})}
        qt = roles.get(role, "F32") if role else "F32"
        data = pack(x, qt, rng)
        if dense_twin and qt != "F32":
            data, qt = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qt]).astype(np.float32), "F32"
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[qt])

    def norm(n):
        return 1.0 + randn(n, std=0.1)

    tensor("token_embd.weight", randn(n_vocab, H), "embd")
    tensor("output_norm.weight", norm(H))
    if not spec.tied:
        tensor("output.weight", randn(n_vocab, H, std=H**-0.5), "output")
    Hq, Hk = spec.n_head * D, spec.n_head_kv * D
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", norm(H))
        tensor(p + "attn_q.weight", randn(Hq, H, std=H**-0.5), "attn", i)
        tensor(p + "attn_k.weight", randn(Hk, H, std=H**-0.5), "attn", i)
        tensor(p + "attn_v.weight", randn(Hk, H, std=H**-0.5), "attn", i)
        if a == "qwen2":
            tensor(p + "attn_q.bias", randn(Hq, std=0.5))
            tensor(p + "attn_k.bias", randn(Hk, std=0.5))
            tensor(p + "attn_v.bias", randn(Hk, std=0.5))
        if a in ("qwen3", "qwen3moe"):
            tensor(p + "attn_q_norm.weight", norm(D))
            tensor(p + "attn_k_norm.weight", norm(D))
        tensor(p + "attn_output.weight", randn(H, Hq, std=Hq**-0.5), "attn", i)
        tensor(p + "ffn_norm.weight", norm(H))
        if spec.n_expert:
            E, F = spec.n_expert, spec.expert_ffn
            tensor(p + "ffn_gate_inp.weight", randn(E, H, std=H**-0.5), "router", i)
            tensor(p + "ffn_gate_exps.weight", randn(E, F, H, std=H**-0.5), "ffn", i)
            tensor(p + "ffn_up_exps.weight", randn(E, F, H, std=H**-0.5), "ffn", i)
            tensor(p + "ffn_down_exps.weight", randn(E, H, F, std=F**-0.5), "ffn_down", i)
        else:
            F = spec.ffn
            tensor(p + "ffn_gate.weight", randn(F, H, std=H**-0.5), "ffn", i)
            tensor(p + "ffn_up.weight", randn(F, H, std=H**-0.5), "ffn", i)
            tensor(p + "ffn_down.weight", randn(H, F, std=F**-0.5), "ffn_down", i)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)
