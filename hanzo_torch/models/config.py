"""Model hyper-parameters read from GGUF metadata, and their validation.

A GGUF file is untrusted input: :meth:`ModelArgs.from_gguf` checks every value it reads (type,
sign, finiteness, range, consistency between keys) and every tensor's presence, rank and shape
against what the values imply, using only the header (``GGUFFile.metadata`` and
``GGUFFile.tensor_info``: no tensor data is read and no module is built). Every quantity that
sizes an allocation is tied to the file's tensors: the layer count must equal the ``blk.N``
tensor groups present, the vocabulary the embedding rows, the expert count the stacked expert
tensors' first dimension; and the tensors themselves were checked to lie inside the file. A file
that passes cannot make :func:`hanzo_torch.load` allocate more than its own size implies (plus
the KV cache of the ``max_context`` the caller chose).

Every problem raises :class:`~hanzo_torch.GGUFError` naming the file and the key or tensor.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

__all__ = ["ModelArgs", "ARCHITECTURES", "DEFAULT_MAX_CONTEXT", "expected_tensor_shapes", "check_max_context"]

DEFAULT_MAX_CONTEXT = 4096  # KV cache length when the caller gives none (capped by the file's context_length)

# Architecture name (``general.architecture``) -> the flags that set it apart.
ARCHITECTURES: dict[str, dict] = {
    "qwen2": dict(qkv_bias=True, qk_norm=False, moe=False),
    "qwen3": dict(qkv_bias=False, qk_norm=True, moe=False),
    "qwen3moe": dict(qkv_bias=False, qk_norm=True, moe=True),
}

# RMSNorm epsilon must lie in (0, MAX_NORM_EPS): real models use 1e-6 / 1e-5; a large one makes
# every normalized activation ~0 (constant logits), an infinite one exactly 0.
MAX_NORM_EPS = 1.0
# RoPE base must lie in (1, MAX_ROPE_BASE]: at or below 1 the per-pair frequencies
# base^(-2i/D) no longer decrease with i; real models use 1e4 .. 1e7.
MAX_ROPE_BASE = 1e12

_BLK = re.compile(r"blk\.(\d{1,9})\.")  # longer indices cannot match a layer count; they end up "unexpected"


@dataclass
class ModelArgs:
    """Hyper-parameters, read from GGUF metadata only (:meth:`from_gguf`)."""

    arch: str
    n_layer: int
    dim: int  # hidden size
    n_head: int
    n_head_kv: int
    head_dim: int  # attention.key_length; NOT dim // n_head in Qwen3
    ffn_dim: int  # dense SwiGLU width
    vocab_size: int
    context_length: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ffn_dim: int = 0
    tied_embeddings: bool = False  # no output.weight: the LM head is token_embd

    @classmethod
    def from_gguf(cls, f) -> "ModelArgs":
        """Config of a :class:`~hanzo_torch.GGUFFile` from its ``{arch}.*`` keys, validated
        against its tensor table (module docstring).

        Raises:
            GGUFError: unknown/missing architecture; a missing key or one of the wrong type; a
                value that is not positive, not finite or out of range; inconsistent values
                (``embedding_length % head_count``, ``head_count % head_count_kv``,
                ``expert_used_count > expert_count``); ``block_count`` different from the
                ``blk.N`` tensor groups present; a missing, unexpected or wrongly shaped tensor.
        """
        from ..gguf_file import GGUFError

        path = f.path

        def fail(msg: str) -> GGUFError:
            return GGUFError(f"{path}: {msg}")

        arch = f.architecture
        if arch is None:
            raise fail("no general.architecture key; cannot tell which model this is")
        if arch not in ARCHITECTURES:
            raise fail(f"unsupported architecture {_short(arch)}; hanzo_torch.load supports "
                       f"{', '.join(sorted(ARCHITECTURES))}")
        flags = ARCHITECTURES[arch]

        def pos_int(key: str, default=None) -> int:
            full = f"{arch}.{key}"
            v = f.get_int(full) if default is None else f.get_int(full, default)
            if v <= 0:
                raise fail(f"metadata key {full!r} = {v} must be > 0")
            return v

        def pos_float(key: str, default: float, lo: float, hi: float, why: str) -> float:
            full = f"{arch}.{key}"
            v = f.get_float(full, default)
            if not math.isfinite(v) or not lo < v <= hi:
                raise fail(f"metadata key {full!r} = {v!r} is outside ({lo:g}, {hi:g}]: {why}")
            return v

        n_layer = pos_int("block_count")
        dim = pos_int("embedding_length")
        n_head = pos_int("attention.head_count")
        n_head_kv = pos_int("attention.head_count_kv", n_head)
        if dim % n_head:
            raise fail(f"embedding_length {dim} is not a multiple of attention.head_count {n_head}")
        if n_head % n_head_kv:
            raise fail(f"attention.head_count {n_head} is not a multiple of attention.head_count_kv {n_head_kv}")
        head_dim = pos_int("attention.key_length", dim // n_head)
        if head_dim % 2:
            raise fail(f"attention.key_length {head_dim} must be even (RoPE rotates pairs)")
        v_dim = pos_int("attention.value_length", head_dim)
        if v_dim != head_dim:
            raise fail(f"attention.value_length {v_dim} != key_length {head_dim} is not supported")
        ffn_dim = pos_int("feed_forward_length")
        context_length = pos_int("context_length")
        rope_theta = pos_float("rope.freq_base", 10000.0, 1.0, MAX_ROPE_BASE,
                               "RoPE frequencies need a finite base above 1")
        norm_eps = pos_float("attention.layer_norm_rms_epsilon", 1e-6, 0.0, MAX_NORM_EPS,
                             "RMSNorm needs a small positive finite epsilon")

        info = f.tensor_info
        embd = info.get("token_embd.weight")
        if embd is None:
            raise fail("missing tensor 'token_embd.weight'")
        if len(embd.shape) != 2 or embd.shape[1] != dim:
            raise fail(f"tensor 'token_embd.weight' has shape {embd.shape}, expected (n_vocab, {dim}) "
                       f"from embedding_length")
        vocab_size = embd.shape[0]
        if vocab_size <= 0:
            raise fail("tensor 'token_embd.weight' has no rows (empty vocabulary)")

        # the layer count sizes a ModuleList: it must be what the tensors hold, checked before
        # anything is built (a corrupted block_count of 2**32 would otherwise build 4e9 modules)
        layers = {int(m.group(1)) for name in info if (m := _BLK.match(name))}
        if n_layer != len(layers) or (layers and max(layers) != n_layer - 1):
            found = f"blk.0 .. blk.{max(layers)}" if layers else "none"
            raise fail(f"{arch}.block_count = {n_layer} does not match the layers present "
                       f"({len(layers)} blk.N tensor groups: {found})")

        args = cls(
            arch=arch, n_layer=n_layer, dim=dim, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
            ffn_dim=ffn_dim, vocab_size=vocab_size, context_length=context_length, rope_theta=rope_theta,
            norm_eps=norm_eps, tied_embeddings="output.weight" not in info, **flags,
        )
        if args.moe:
            args.n_expert = pos_int("expert_count")
            args.n_expert_used = pos_int("expert_used_count")
            args.expert_ffn_dim = pos_int("expert_feed_forward_length")
            if args.n_expert_used > args.n_expert:
                raise fail(f"{arch}.expert_used_count {args.n_expert_used} exceeds expert_count {args.n_expert}")

        want = expected_tensor_shapes(args)
        for name, shape in want.items():
            t = info.get(name)
            if t is None:
                if name == "output.weight":
                    continue  # absent: tied to token_embd
                raise fail(f"missing tensor {name!r} for architecture {arch!r}")
            if tuple(t.shape) != shape:
                raise fail(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape} from the metadata")
        unexpected = [n for n in info if n not in want]
        if unexpected:
            raise fail(f"tensors not used by the {arch} model: {', '.join(_short(n) for n in unexpected[:8])}")
        return args


def expected_tensor_shapes(args: ModelArgs) -> dict[str, tuple]:
    """Every tensor name of the model described by ``args`` -> its torch-order shape
    (``output.weight`` included; a file may omit it to tie the head to ``token_embd``)."""
    H, D, V = args.dim, args.head_dim, args.vocab_size
    Hq, Hk = args.n_head * D, args.n_head_kv * D
    out = {"token_embd.weight": (V, H), "output_norm.weight": (H,), "output.weight": (V, H)}
    for i in range(args.n_layer):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = (H,)
        out[p + "attn_q.weight"] = (Hq, H)
        out[p + "attn_k.weight"] = (Hk, H)
        out[p + "attn_v.weight"] = (Hk, H)
        if args.qkv_bias:
            out[p + "attn_q.bias"] = (Hq,)
            out[p + "attn_k.bias"] = (Hk,)
            out[p + "attn_v.bias"] = (Hk,)
        if args.qk_norm:
            out[p + "attn_q_norm.weight"] = (D,)
            out[p + "attn_k_norm.weight"] = (D,)
        out[p + "attn_output.weight"] = (H, Hq)
        out[p + "ffn_norm.weight"] = (H,)
        if args.moe:
            E, Fe = args.n_expert, args.expert_ffn_dim
            out[p + "ffn_gate_inp.weight"] = (E, H)
            out[p + "ffn_gate_exps.weight"] = (E, Fe, H)
            out[p + "ffn_up_exps.weight"] = (E, Fe, H)
            out[p + "ffn_down_exps.weight"] = (E, H, Fe)
        else:
            F = args.ffn_dim
            out[p + "ffn_gate.weight"] = (F, H)
            out[p + "ffn_up.weight"] = (F, H)
            out[p + "ffn_down.weight"] = (H, F)
    return out


def check_max_context(max_context: Optional[int], context_length: int, extend_context: bool = False) -> int:
    """The KV cache length to use: ``max_context``, or ``min(context_length, DEFAULT_MAX_CONTEXT)``
    when None.

    Raises:
        TypeError: ``max_context`` is not an int (bool included) or ``extend_context`` not a bool.
        ValueError: ``max_context <= 0``, or above the file's ``context_length`` without
            ``extend_context=True`` (the model was not trained for it).
    """
    if not isinstance(extend_context, bool):
        raise TypeError(f"extend_context must be a bool, got {type(extend_context).__name__}")
    if max_context is None:
        return min(context_length, DEFAULT_MAX_CONTEXT)
    if isinstance(max_context, bool) or not isinstance(max_context, int):
        raise TypeError(f"max_context must be an int, got {type(max_context).__name__} {max_context!r}")
    if max_context <= 0:
        raise ValueError(f"max_context must be > 0, got {max_context}")
    if max_context > context_length and not extend_context:
        raise ValueError(f"max_context={max_context} exceeds the model's context_length {context_length}; "
                         "pass extend_context=True to allocate a longer KV cache anyway")
    return max_context


def _short(text: str, limit: int = 80) -> str:
    """``repr`` of a file-provided string, cut to ``limit`` characters (control characters escaped)."""
    r = repr(text)
    return r if len(r) <= limit else r[: limit - 4] + "...'"


def load_tokenizer(f, vocab_size: int):
    """Build and check the tokenizer of :class:`~hanzo_torch.GGUFFile` ``f`` for a model with
    ``vocab_size`` embedding rows.

    Returns None when the file carries no tokenizer (no ``tokenizer.ggml.model``), or only a
    vocabulary (``tokenizer.ggml.tokens`` without ``tokenizer.ggml.merges``, enough to size a
    model, not to encode text; the token count is still checked).

    Raises:
        GGUFError: the token count differs from ``vocab_size``, or the tokenizer metadata is
            unusable (:meth:`hanzo_torch.tokenizer.Tokenizer.from_gguf`'s errors, with the file
            named).
    """
    from ..gguf_file import GGUFError
    from ..tokenizer import Tokenizer, TokenizerError

    meta = f.metadata
    if "tokenizer.ggml.tokens" in meta:
        el = meta.element_type("tokenizer.ggml.tokens")
        if el is None or el.name != "STRING":
            raise GGUFError(f"{f.path}: metadata key 'tokenizer.ggml.tokens' must be an array of strings, "
                            f"got {meta.value_type('tokenizer.ggml.tokens').name}"
                            + (f" of {el.name}" if el is not None else ""))
        n = len(meta["tokenizer.ggml.tokens"])
        if n != vocab_size:
            raise GGUFError(f"{f.path}: tokenizer.ggml.tokens has {n} tokens but token_embd.weight has "
                            f"{vocab_size} rows; they must be equal")
    if "tokenizer.ggml.model" not in meta or "tokenizer.ggml.merges" not in meta:
        return None
    try:
        return Tokenizer.from_gguf(f)
    except TokenizerError as exc:
        msg = str(exc)
        raise GGUFError(msg if msg.startswith(f"{f.path}: ") else f"{f.path}: {msg}") from None
