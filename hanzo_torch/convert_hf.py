"""Hugging Face checkpoint (safetensors) to GGUF: ``hanzo-torch convert DIR -o out.gguf --type Q4_K_M``.

The file written is what llama.cpp's ``convert_hf_to_gguf.py`` writes for the same checkpoint
(tensor names, shapes and ggml order, ``{arch}.*`` hyper-parameters, ``tokenizer.ggml.*``), with
the tensor types of ``llama-quantize`` for quantized file types: the per-tensor choice is
:func:`hanzo_torch.requantize.tensor_type`, the one ``hanzo-torch quantize`` uses.

Architectures (``config.json`` ``architectures[0]``) and their GGUF names:

=====================  ============  =================================================
Hugging Face           GGUF          differences
=====================  ============  =================================================
Qwen2ForCausalLM       ``qwen2``     q/k/v biases
Qwen3ForCausalLM       ``qwen3``     per-head RMSNorm of q and k (``attn_q_norm``), ``head_dim``
Qwen3MoeForCausalLM    ``qwen3moe``  router ``ffn_gate_inp``, experts stacked as ``ffn_*_exps``
=====================  ============  =================================================

Tensor layouts: a torch ``[out, in]`` matrix is stored as is (ggml ``ne = {in, out}``); Qwen's
RoPE is the NEOX (half-split) kind, which ggml applies to q and k as stored, so no row permutation
is made (llama.cpp permutes only for LLaMA-style interleaved checkpoints). Experts
``mlp.experts.E.{gate,up,down}_proj.weight`` (or the fused ``mlp.experts.gate_up_proj``
``[E, 2F, H]`` and ``mlp.experts.down_proj`` ``[E, H, F]``) are stacked along a first dimension
of size E: ``ffn_gate_exps``/``ffn_up_exps`` ``[E, F, H]``, ``ffn_down_exps`` ``[E, H, F]``.

Tensor types: 1-D tensors (norms, biases) and the MoE router stay F32, as llama.cpp keeps them;
every other matrix gets the file type's type, and for the K-quant mixes (``Q4_K_M``, ``Q5_K_M``,
``Q6_K``, ...) llama-quantize's recipe (Q6_K ``output``, Q6_K for some ``attn_v``/``ffn_down``).
A matrix whose row length is not a multiple of the block size of its type falls back as
llama-quantize does (Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, then F16); each fallback is
reported through ``log``.

Memory: the safetensors files are memory-mapped and one output tensor (a stacked expert tensor
for MoE) is in memory at a time, in float32 plus its packed form; the output is written to a
temporary file next to ``out`` and renamed into place when complete.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import gguf
import numpy as np
import torch

__all__ = ["ARCHITECTURES", "ConvertError", "convert"]

# config.json architectures[0] -> GGUF general.architecture
ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe"}

# The pre-tokenizer split of the Qwen2/Qwen2.5/Qwen3 tokenizers, which llama.cpp calls ``qwen2``.
QWEN2_PRE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# per-layer Hugging Face name (after ``model.layers.N.``) -> GGUF name (after ``blk.N.``)
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj(?:\.weight)?$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
# checkpoint entries llama.cpp's converter skips: RoPE tables the model recomputes
_SKIP = re.compile(r".*\.rotary_emb\.inv_freq$")

_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class ConvertError(ValueError):
    """A checkpoint that cannot be converted; the message names the file, key or tensor."""


# ---------------------------------------------------------------------------------- sources
@dataclass
class _Source:
    """Where one output tensor comes from: a single checkpoint tensor, or experts to stack."""

    name: str  # GGUF name
    shape: tuple  # torch-order shape of the output tensor
    parts: list = field(default_factory=list)  # [(file, hf name, slice of dim -2 or None)], stacked along dim 0
    stack: bool = False


class _Checkpoint:
    """The safetensors files of a checkpoint, read through their headers until a tensor is asked for."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self.files = files
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple] = {}
        self.dtypes: dict[str, str] = {}
        self._open = {}
        for path in files:
            try:
                f = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for a bad header
                raise ConvertError(f"{path}: not a readable safetensors file ({exc})") from None
            self._open[path] = f
            for name in f.keys():
                if name in self.where:
                    raise ConvertError(f"tensor {name!r} is in both {self.where[name]} and {path}")
                sl = f.get_slice(name)
                self.where[name] = path
                self.shapes[name] = tuple(sl.get_shape())
                self.dtypes[name] = sl.get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self._open[self.where[name]].get_tensor(name)


def _find_files(src: Path) -> tuple[Path, list[Path]]:
    """The checkpoint folder and its safetensors files (one file, an index, or every shard)."""
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such file or folder")
    if src.is_file():
        if src.suffix != ".safetensors":
            raise ConvertError(f"{src}: expected a Hugging Face folder or a .safetensors file")
        return src.parent, [src]
    index = src / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ConvertError(f"{index}: no readable 'weight_map' ({exc})") from None
        files = sorted({src / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: listed in {index.name} but missing")
        return src, files
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src}: no .safetensors files (model.safetensors or model-*-of-*.safetensors)")
    return src, files


# ---------------------------------------------------------------------------------- config
@dataclass
class _Hparams:
    arch: str
    n_layer: int
    dim: int
    n_head: int
    n_head_kv: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    rope_theta: float
    norm_eps: float
    tied: bool
    head_dim_key: bool  # config.json has head_dim (written as key_length/value_length, as llama.cpp does)
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ffn_dim: int = 0
    name: str = ""


def _read_config(folder: Path) -> _Hparams:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (the checkpoint's config.json is needed for its hyper-parameters)")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ConvertError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ConvertError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ConvertError(f"{path}: no 'architectures' list; cannot tell which model this is")
    hf_arch = archs[0]
    if hf_arch not in ARCHITECTURES:
        raise ConvertError(f"{path}: architecture {hf_arch!r} is not supported; hanzo-torch converts "
                           f"{', '.join(ARCHITECTURES)}")
    arch = ARCHITECTURES[hf_arch]

    def get(*keys, default=None, kind=int):
        for k in keys:
            if cfg.get(k) is not None:
                v = cfg[k]
                ok = isinstance(v, bool) if kind is bool else (
                    isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float else
                    isinstance(v, int) and not isinstance(v, bool) and v > 0)
                if not ok:
                    what = "positive int" if kind is int else kind.__name__
                    raise ConvertError(f"{path}: {k!r} = {v!r} is not a {what}")
                return v
        if default is None:
            raise ConvertError(f"{path}: missing key {keys[0]!r}")
        return default

    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict) or not isinstance(cfg.get("rope_scaling") or {}, dict):
        raise ConvertError(f"{path}: rope_parameters / rope_scaling is not a JSON object")
    scaling = cfg.get("rope_scaling") or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    if rope_type not in ("default", None):
        raise ConvertError(f"{path}: RoPE scaling {rope_type!r} (rope_scaling / rope_parameters) is not supported")
    if cfg.get("use_sliding_window"):
        raise ConvertError(f"{path}: use_sliding_window is true; sliding-window attention is not supported")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise ConvertError(f"{path}: rope_theta = {theta!r} is not a number")

    dim = get("hidden_size")
    n_head = get("num_attention_heads")
    hp = _Hparams(
        arch=arch, n_layer=get("num_hidden_layers"), dim=dim, n_head=n_head,
        n_head_kv=get("num_key_value_heads", default=n_head), head_dim=get("head_dim", default=dim // n_head),
        ffn_dim=get("intermediate_size"), vocab_size=get("vocab_size"),
        context_length=get("max_position_embeddings"), rope_theta=float(theta),
        norm_eps=float(get("rms_norm_eps", kind=float)),
        tied=bool(get("tie_word_embeddings", default=False, kind=bool)),
        head_dim_key=cfg.get("head_dim") is not None, name=str(cfg.get("_name_or_path") or folder.name),
    )
    if arch == "qwen2" and hp.head_dim * n_head != dim and cfg.get("head_dim") is None:
        raise ConvertError(f"{path}: hidden_size {dim} is not a multiple of num_attention_heads {n_head}")
    if n_head % hp.n_head_kv:
        raise ConvertError(f"{path}: num_attention_heads {n_head} is not a multiple of num_key_value_heads "
                           f"{hp.n_head_kv}")
    if arch == "qwen3moe":
        hp.n_expert = get("num_local_experts", "num_experts")
        hp.n_expert_used = get("num_experts_per_tok")
        hp.expert_ffn_dim = get("moe_intermediate_size")
        if hp.n_expert_used > hp.n_expert:
            raise ConvertError(f"{path}: num_experts_per_tok {hp.n_expert_used} exceeds the {hp.n_expert} experts")
        # llama.cpp's qwen3moe always renormalizes the chosen experts' weights
        if cfg.get("norm_topk_prob") is not True:
            raise ConvertError(f"{path}: norm_topk_prob is {cfg.get('norm_topk_prob')!r}; the qwen3moe GGUF "
                               f"architecture renormalizes the top-k router weights, so it must be true")
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ConvertError(f"{path}: mlp_only_layers / decoder_sparse_step make some layers dense; the qwen3moe "
                               f"GGUF architecture has experts in every layer")
    return hp


def _model_args(hp: _Hparams):
    from .models.config import ARCHITECTURES as FLAGS, ModelArgs

    return ModelArgs(arch=hp.arch, n_layer=hp.n_layer, dim=hp.dim, n_head=hp.n_head, n_head_kv=hp.n_head_kv,
                     head_dim=hp.head_dim, ffn_dim=hp.ffn_dim, vocab_size=hp.vocab_size,
                     context_length=hp.context_length, rope_theta=hp.rope_theta, norm_eps=hp.norm_eps,
                     n_expert=hp.n_expert, n_expert_used=hp.n_expert_used, expert_ffn_dim=hp.expert_ffn_dim,
                     tied_embeddings=hp.tied, **FLAGS[hp.arch])


# ---------------------------------------------------------------------------------- tensor plan
def _plan_sources(ckpt: _Checkpoint, hp: _Hparams, folder: Path) -> list[_Source]:
    """Every output tensor and its checkpoint tensors, checked against the config's shapes."""
    from .models.config import expected_tensor_shapes

    want = expected_tensor_shapes(_model_args(hp))
    sources: dict[str, _Source] = {}
    experts: dict[tuple, dict] = {}
    where = f"{folder}"
    for hf in ckpt.where:
        if _SKIP.match(hf):
            continue
        if hf in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[hf]
            if name == "output.weight" and hp.tied:
                continue  # tied head: llama.cpp writes token_embd only
            sources[name] = _Source(name, want[name], [(hf, None)])
            continue
        m = _EXPERT.match(hf)
        if m and hp.arch == "qwen3moe":
            layer, e, which = int(m.group(1)), int(m.group(2)), m.group(3)
            experts.setdefault((layer, which), {})[e] = (hf, None)
            continue
        m = _FUSED_EXPERT.match(hf)
        if m and hp.arch == "qwen3moe":
            layer, which = int(m.group(1)), m.group(2)
            shape = ckpt.shapes[hf]
            if which == "gate_up":
                F = hp.expert_ffn_dim
                if len(shape) != 3 or shape[1] != 2 * F:
                    raise ConvertError(f"{ckpt.where[hf]}: tensor {hf!r} has shape {shape}, expected "
                                       f"({hp.n_expert}, {2 * F}, {hp.dim}) from config.json")
                for i, part in enumerate(("gate", "up")):
                    name = f"blk.{layer}.ffn_{part}_exps.weight"
                    sources[name] = _Source(name, want.get(name, ()), [(hf, slice(i * F, (i + 1) * F))])
            else:
                name = f"blk.{layer}.ffn_down_exps.weight"
                sources[name] = _Source(name, want.get(name, ()), [(hf, None)])
            continue
        m = _LAYER.match(hf)
        if m and m.group(2) in _LAYER_NAMES:
            name = f"blk.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}"
            if name in want:
                sources[name] = _Source(name, want[name], [(hf, None)])
                continue
        raise ConvertError(f"{ckpt.where[hf]}: tensor {hf!r} has no place in the {hp.arch} GGUF model "
                           f"(config.json describes {hp.n_layer} layers)")
    for (layer, which), parts in experts.items():
        name = f"blk.{layer}.ffn_{which}_exps.weight"
        missing = [e for e in range(hp.n_expert) if e not in parts]
        if missing:
            raise ConvertError(f"{where}: missing tensor 'model.layers.{layer}.mlp.experts.{missing[0]}."
                               f"{which}_proj.weight' ({len(missing)} of {hp.n_expert} experts missing)")
        extra = sorted(e for e in parts if e >= hp.n_expert)
        if extra:
            raise ConvertError(f"{where}: tensor {parts[extra[0]][0]!r}: expert {extra[0]} beyond the "
                               f"{hp.n_expert} experts of config.json")
        sources[name] = _Source(name, want.get(name, ()), [parts[e] for e in range(hp.n_expert)], stack=True)

    for name, src in sources.items():
        if name not in want:
            hf = src.parts[0][0]
            raise ConvertError(f"{ckpt.where[hf]}: tensor {hf!r} has no place in the {hp.arch} GGUF model "
                               f"(config.json describes {hp.n_layer} layers)")
    hf_of = {v: k for k, v in _GLOBAL_NAMES.items()}
    out = []
    for name, shape in want.items():
        if name == "output.weight" and hp.tied:
            continue
        src = sources.get(name)
        if src is None:
            m = re.match(r"blk\.(\d+)\.(.+)$", name)
            hf = hf_of.get(name) or (f"model.layers.{m.group(1)}." +
                                     {v: k for k, v in _LAYER_NAMES.items()}.get(m.group(2), m.group(2)))
            raise ConvertError(f"{where}: missing tensor {hf!r} (GGUF {name!r}) of the {hp.arch} model")
        # each checkpoint part: its shape after the slice, stacked when experts
        got = []
        for hf, sl in src.parts:
            s = list(ckpt.shapes[hf])
            if sl is not None:
                s[1] = sl.stop - sl.start
            got.append(tuple(s))
        full = ((len(got),) + got[0]) if src.stack else got[0]
        bad = src.stack and any(g != got[0] for g in got)
        if bad or full != shape:
            hf = src.parts[0][0]
            raise ConvertError(f"{ckpt.where[hf]}: tensor {hf!r} has shape {got[0] if not src.stack else got}, "
                               f"expected {shape[1:] if src.stack else shape} from config.json")
        for hf, _ in src.parts:
            if ckpt.dtypes[hf] not in ("F32", "F16", "BF16"):
                raise ConvertError(f"{ckpt.where[hf]}: tensor {hf!r} has dtype {ckpt.dtypes[hf]}; "
                                   f"expected F32, F16 or BF16")
        out.append(src)
    return out


def _load_tensor(ckpt: _Checkpoint, src: _Source) -> torch.Tensor:
    """float32 ``src.shape``: the checkpoint tensor, or the experts stacked."""
    parts = []
    for hf, sl in src.parts:
        t = ckpt.get(hf)
        if sl is not None:
            t = t[:, sl]
        parts.append(t.to(torch.float32))
    t = torch.stack(parts) if src.stack else parts[0]
    return t.contiguous()


# ---------------------------------------------------------------------------------- tokenizer
def _tokenizer(folder: Path, n_vocab: int) -> tuple[list[str], list[int], gguf.SpecialVocab]:
    """Tokens and token types as llama.cpp's ``_set_vocab_gpt2`` derives them (ids with no token up
    to ``n_vocab`` are ``[PAD<id>]`` UNUSED; added tokens that are special or look like
    ``<|...|>`` CONTROL, other added tokens USER_DEFINED, the rest NORMAL), and the merges,
    special token ids, ``add_bos_token`` and chat template (``gguf.SpecialVocab``)."""
    tj = folder / "tokenizer.json"
    tc = folder / "tokenizer_config.json"
    for p in (tj, tc):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: missing (the tokenizer is converted from tokenizer.json and "
                                    f"tokenizer_config.json)")
    try:
        tok = json.loads(tj.read_text(encoding="utf-8"))
        json.loads(tc.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ConvertError(f"{folder}: tokenizer file is not valid JSON ({exc})") from None
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ConvertError(f"{tj}: model.type is {model.get('type')!r}; a byte-level BPE tokenizer (BPE) is expected")
    if _split_regex(tok.get("pre_tokenizer")) != QWEN2_PRE_REGEX:
        raise ConvertError(f"{tj}: pre_tokenizer is not Qwen2's split regex; llama.cpp's 'qwen2' pre-tokenizer "
                           f"would tokenize it differently")
    id_to_token = {int(i): t for t, i in model["vocab"].items()}
    added = {}
    for a in tok.get("added_tokens") or []:
        added[int(a["id"])] = a
        id_to_token[int(a["id"])] = a["content"]
    top = max(id_to_token) + 1
    if top > n_vocab:
        raise ConvertError(f"{tj}: token id {top - 1} does not fit vocab_size {n_vocab} of config.json")
    tokens, types = [], []
    for i in range(n_vocab):
        text = id_to_token.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
        elif i in added:
            tokens.append(text)
            special = added[i].get("special") or (text.startswith("<|") and text.endswith("|>"))
            types.append(int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED))
        else:
            tokens.append(text)
            types.append(int(gguf.TokenType.NORMAL))
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab)
    post = tok.get("post_processor") or {}
    if isinstance(post, dict) and any(isinstance(p, dict) and p.get("type") == "ByteLevel"
                                      for p in post.get("processors", [post])):
        # a ByteLevel post-processor adds no bos/eos; llama.cpp's converter records both as False
        special.add_special_token.setdefault("bos", False)
        special.add_special_token.setdefault("eos", False)
    if not special.merges:
        raise ConvertError(f"{tj}: no model.merges")
    return tokens, types, special


def _split_regex(pre) -> Optional[str]:
    if not isinstance(pre, dict):
        return None
    items = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    for p in items or []:
        if isinstance(p, dict) and p.get("type") == "Split":
            pattern = p.get("pattern") or {}
            return pattern.get("Regex")
    return None


# ---------------------------------------------------------------------------------- convert
def convert(src: Union[str, os.PathLike], out: Union[str, os.PathLike], type: str = "F16", *,
            progress: bool = True, log: Optional[Callable[[str], None]] = None, imatrix=None) -> dict[str, str]:
    """Convert a Hugging Face Qwen2 / Qwen3 / Qwen3-MoE checkpoint to a GGUF file.

    Args:
        src: the checkpoint folder (``config.json``, ``tokenizer.json``, ``tokenizer_config.json``
            and ``model.safetensors``, or shards with ``model.safetensors.index.json``), or one
            ``.safetensors`` file with those files beside it. Tensors in F32, F16 or BF16.
        out: the GGUF file to write; written to a temporary file in the same folder and renamed,
            so ``out`` never holds a partial file.
        type: the file type, llama-quantize's names (case-insensitive): ``F32``, ``F16``,
            ``BF16``, ``Q8_0``, ``Q4_K_M``, ``Q5_K_M``, ``Q6_K``, and the other keys of
            :data:`hanzo_torch.requantize.FTYPES`.
        progress: a tqdm bar over the tensors on stderr.
        log: called with one line per type fallback (a row length that is not a block multiple).
        imatrix: an importance matrix (a path or an :class:`~hanzo_torch.imatrix.IMatrix`), used
            as :func:`hanzo_torch.requantize.requantize` uses it (llama-quantize ``--imatrix``).

    Returns:
        GGUF tensor name -> ggml type written, in file order.

    Raises:
        ConvertError (a ValueError): unknown ``type``, an architecture other than the three, a bad
            or missing config.json key, a checkpoint tensor missing, unexpected, of the wrong
            shape or dtype, a tokenizer that is not Qwen's byte-level BPE; each names the file and
            the key or tensor; a file type that needs an importance matrix (IQ3_XXS, IQ2_*,
            IQ1_*: :func:`hanzo_torch.requantize.check_imatrix`) without one.
        FileNotFoundError: ``src``, config.json, tokenizer.json or tokenizer_config.json missing.
        ValueError / GGUFError: a bad imatrix file, or an entry of the wrong size (named).
        All are raised before ``out`` is created.
    """
    from .formats import get_format
    from .imatrix import IMatrix, load_imatrix
    from .requantize import (FTYPES, _State, _check_weighted, _quantizable, check_imatrix, imatrix_metadata,
                             imatrix_weights, quantize_tensor, tensor_type)

    key = str(type).upper()
    if key not in FTYPES:
        raise ConvertError(f"unknown type {type!r}; one of: {', '.join(FTYPES)}")
    folder, files = _find_files(Path(src).expanduser())
    out = Path(out).expanduser()
    if any(out.resolve() == f.resolve() for f in files):
        raise ConvertError(f"output {out} is an input file; write to another path")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{out.parent}: no such folder for the output")
    if out.is_dir():
        raise ConvertError(f"output {out} is a folder; give a file path")
    if imatrix is not None and not isinstance(imatrix, IMatrix):
        imatrix = load_imatrix(imatrix)
    hp = _read_config(folder)
    tokens, token_types, special = _tokenizer(folder, hp.vocab_size)
    ckpt = _Checkpoint(files)
    sources = _plan_sources(ckpt, hp, folder)

    state = _State(n_layer=hp.n_layer, n_attn_v=hp.n_layer, tied=hp.tied, n_expert=hp.n_expert,
                   n_gqa=hp.n_head // max(1, hp.n_head_kv), has_imatrix=imatrix is not None)
    weights = {}
    base = FTYPES[key][0]
    plan: dict[str, str] = {}
    for s in sources:
        t = tensor_type(s.name, s.shape, "F32", key, state)
        if t not in ("F32", "F16", "BF16") and get_format(t).quantize_blocks is None:
            raise ConvertError(f"tensor {s.name!r}: hanzo-torch cannot quantize to {t}")
        plan[s.name] = t
        if t not in _TORCH_DTYPES:
            weights[s.name] = imatrix_weights(imatrix, s.name, tuple(s.shape))
            if weights[s.name] is not None:
                _check_weighted(s.name, t)
            try:
                check_imatrix(s.name, t, key, imatrix, has_entry=weights[s.name] is not None)
            except ValueError as exc:
                raise ConvertError(str(exc)) from None
        if log is not None and _quantizable(s.name, len(s.shape)) and base not in _TORCH_DTYPES:
            bs = get_format(base).block_size
            if s.shape[-1] % bs:
                log(f"{s.name}: row length {s.shape[-1]} is not a multiple of {base}'s block size {bs}; "
                    f"written as {t}")

    w = gguf.GGUFWriter(None, hp.arch)
    _add_metadata(w, hp, FTYPES[key][1])
    if imatrix is not None:
        meta, types = imatrix_metadata(imatrix)
        for k, v in meta.items():
            w.add_key_value(k, v, types[k])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    special.add_to_gguf(w, quiet=True)
    for s in sources:
        t = plan[s.name]
        rows = int(np.prod(s.shape[:-1]))
        nbytes = rows * get_format(t).row_bytes(s.shape[-1])
        w.add_tensor_info(s.name, s.shape, np.float32, nbytes, raw_dtype=gguf.GGMLQuantizationType[t])

    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would otherwise stay on the renamed file
    bar = None
    try:
        w.write_header_to_file(Path(tmp))
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(sources), unit="tensor", desc=f"convert {key}", leave=False)
        for s in sources:
            t = plan[s.name]
            if bar is not None:
                bar.set_postfix_str(f"{s.name} -> {t}")
            x = _load_tensor(ckpt, s)
            if t == "F32":
                data = x.numpy()
            elif t == "F16":
                data = x.to(torch.float16).numpy()
            elif t == "BF16":
                data = x.to(torch.bfloat16).view(torch.int16).numpy()
            else:
                data = quantize_tensor(x, t, weights.get(s.name)).reshape(-1, get_format(t).row_bytes(x.shape[-1])).numpy()
            w.write_tensor_data(data)
            del x, data
            if bar is not None:
                bar.update(1)
        w.close()
        os.replace(tmp, out)
    except BaseException:
        w.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        if bar is not None:
            bar.close()
    return plan


def _add_metadata(w: gguf.GGUFWriter, hp: _Hparams, file_type: int) -> None:
    """``general.*`` and ``{arch}.*`` keys as llama.cpp's converter writes them for these models."""
    w.add_name(hp.name)
    w.add_type("model")
    w.add_block_count(hp.n_layer)
    w.add_context_length(hp.context_length)
    w.add_embedding_length(hp.dim)
    w.add_feed_forward_length(hp.ffn_dim)
    w.add_head_count(hp.n_head)
    w.add_head_count_kv(hp.n_head_kv)
    w.add_rope_freq_base(hp.rope_theta)
    w.add_layer_norm_rms_eps(hp.norm_eps)
    if hp.arch == "qwen3moe":
        w.add_expert_count(hp.n_expert)
        w.add_expert_used_count(hp.n_expert_used)
        w.add_expert_feed_forward_length(hp.expert_ffn_dim)
    if hp.head_dim_key:
        w.add_key_length(hp.head_dim)
        w.add_value_length(hp.head_dim)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
