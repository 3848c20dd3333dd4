"""Qwen2, Qwen3 and Qwen3-MoE as one ``nn.Module`` over packed GGUF weights.

The three architectures differ only by :class:`ModelArgs` flags (llama.cpp's
``src/models/qwen2.cpp``, ``qwen3.cpp``, ``qwen3moe.cpp`` graphs; Hugging Face's
``modeling_qwen2/qwen3/qwen3_moe.py``):

=========  ============  ==================  ===========================================
arch       q/k/v bias    per-head q/k norm   feed-forward
=========  ============  ==================  ===========================================
qwen2      yes           no                  SwiGLU
qwen3      no            yes (RMSNorm on D)  SwiGLU
qwen3moe   no            yes                 top-k of E SwiGLU experts, softmax weights
                                             renormalized over the k chosen
=========  ============  ==================  ===========================================

Parameter names are the GGUF tensor names (``blk.0.attn_q.weight``), so loading is a name
lookup. The model is written with the dense layers of :mod:`hanzo_torch.models.layers`;
:func:`~hanzo_torch.load` swaps in their packed twins, whose weights are
:class:`~hanzo_torch.GGUFTensor` views of the memory-mapped file (norm weights and biases are
small dense tensors). The forward never asks which format, or which twin, a layer has.

Sequence bookkeeping (the KV caches' batch size, the position of the next token, ``reset``)
and the generation conveniences come from :class:`~hanzo_torch.generation.SequenceState`.
Decode is graph-capture friendly (docs/DESIGN.md section 4): the KV cache is allocated once at
``max_context`` and written by index, positions are a device tensor, and nothing in the forward
synchronizes with the host when positions are passed in.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

from ..generation import SequenceState
from ..ops.fused import KV_CACHE_DTYPES, kv_cache_shape
from .config import ARCHITECTURES, DEFAULT_MAX_CONTEXT, ModelArgs  # noqa: F401 (re-exported)
from .layers import Embedding, Experts, Linear, RMSNorm, linear_group
from .loss import CausalLMOutput, causal_lm_loss, loss_chunk_tokens

hanzo = torch.ops.hanzo


class Block(nn.Module):
    """One decoder layer: attention and a dense or MoE SwiGLU feed-forward, pre-norm residuals.

    ``k_cache``/``v_cache``: this layer's static KV cache ``[B, max_context, Hk, D]`` (or q8_0
    blocks), buffers set by :meth:`Transformer.init_kv_cache`; ``attn_impl`` is
    ``hanzo::attention``'s kernel choice (``"auto"``).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        H, D, Hq, Hk, eps = args.dim, args.head_dim, args.n_head, args.n_head_kv, args.norm_eps
        self.attn_norm = RMSNorm(H, eps)
        self.attn_q = Linear(H, Hq * D, bias=args.qkv_bias)
        self.attn_k = Linear(H, Hk * D, bias=args.qkv_bias)
        self.attn_v = Linear(H, Hk * D, bias=args.qkv_bias)
        if args.qk_norm:  # applied by hanzo::qk_norm_rope_kv_write, fused with RoPE
            self.attn_q_norm = RMSNorm(D, eps)
            self.attn_k_norm = RMSNorm(D, eps)
        self.attn_output = Linear(Hq * D, H)
        self.ffn_norm = RMSNorm(H, eps)
        if args.moe:
            E, Fe = args.n_expert, args.expert_ffn_dim
            self.ffn_gate_inp = Linear(H, E)
            self.ffn_gate_exps = Experts(E, Fe, H)
            self.ffn_up_exps = Experts(E, Fe, H)
            self.ffn_down_exps = Experts(E, H, Fe)
        else:
            self.ffn_gate = Linear(H, args.ffn_dim)
            self.ffn_up = Linear(H, args.ffn_dim)
            self.ffn_down = Linear(args.ffn_dim, H)
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)
        self.attn_impl = "auto"

    def forward(self, x: Tensor, residual: Optional[Tensor], positions: Tensor,
                use_cache: bool = True) -> tuple[Tensor, Tensor]:
        """``x [B, T, H]``: the previous sub-layer's output (the embeddings, with ``residual``
        None, for the first layer); ``positions`` int64 ``[B, T]``. Returns ``(output,
        residual)``, the residual add of ``output`` left to the next norm. ``use_cache=False``:
        causal attention over these T tokens only, the KV cache neither read nor written."""
        h, residual = self.attn_norm(x, residual)
        attn = self.attention(h, positions) if use_cache else self.attention_no_cache(h, positions)
        h, residual = self.ffn_norm(attn, residual)
        return (self.moe(h) if self.args.moe else self.feed_forward(h)), residual

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        a = self.args
        B, T, _ = x.shape
        q, k, v = linear_group(x, self.attn_q, self.attn_k, self.attn_v)
        q = q.view(B, T, a.n_head, a.head_dim)  # [B, T, Hq, D]
        k = k.view(B, T, a.n_head_kv, a.head_dim)  # [B, T, Hk, D]
        v = v.view(B, T, a.n_head_kv, a.head_dim)  # [B, T, Hk, D]
        return q, k, v

    def attention_no_cache(self, x: Tensor, positions: Tensor) -> Tensor:
        """Training attention: RoPE at ``positions``, causal by index within the T tokens, scores,
        softmax and P*V in float32 (docs/DESIGN.md section 6), differentiable; no KV cache."""
        a = self.args
        B, T, _ = x.shape
        q, k, v = self._qkv(x)
        q_w, k_w = (self.attn_q_norm.weight, self.attn_k_norm.weight) if a.qk_norm else (None, None)
        q, k = hanzo.qk_norm_rope(q, k, q_w, k_w, positions, a.rope_theta, a.norm_eps)
        # [B, H, T, D] float32; enable_gqa reads KV head h // (Hq/Hk) for query head h, as hanzo::attention
        o = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.float().transpose(1, 2),
                                           v.float().transpose(1, 2), is_causal=True,
                                           scale=1.0 / math.sqrt(a.head_dim), enable_gqa=True)
        o = o.transpose(1, 2).reshape(B, T, a.n_head * a.head_dim).to(x.dtype)
        return self.attn_output(o)  # [B, T, H]

    def attention(self, x: Tensor, positions: Tensor) -> Tensor:
        a = self.args
        B, T, _ = x.shape
        q, k, v = self._qkv(x)
        q_w, k_w = (self.attn_q_norm.weight, self.attn_k_norm.weight) if a.qk_norm else (None, None)
        k_cache, v_cache = self._buffers["k_cache"], self._buffers["v_cache"]
        # q/k norm + RoPE, and the rotated k and v written into the caches, in one op
        q = hanzo.qk_norm_rope_kv_write(q, k, v, q_w, k_w, k_cache, v_cache, positions, a.rope_theta, a.norm_eps)
        o = hanzo.attention(q, k_cache, v_cache, positions, 1.0 / math.sqrt(a.head_dim), self.attn_impl)
        return self.attn_output(o.reshape(B, T, a.n_head * a.head_dim))  # [B, T, H]

    def feed_forward(self, x: Tensor) -> Tensor:
        """SwiGLU: ``down(silu(gate(x)) * up(x))``, ``[B, T, H] -> [B, T, H]``."""
        return self.ffn_down(self.ffn_gate.swiglu(self.ffn_up, x))

    def moe(self, x: Tensor) -> Tensor:
        """Each token through its top-k experts' SwiGLU, summed with the router's weights."""
        B, T, H = x.shape
        xt = x.reshape(B * T, H)  # [N, H]
        weights, ids = hanzo.moe_route(self.ffn_gate_inp(xt), self.args.n_expert_used, True)  # [N, k] f32, int64
        h = hanzo.swiglu(self.ffn_gate_exps(xt, ids), self.ffn_up_exps(xt, ids))  # [N, k, Fe]
        y = self.ffn_down_exps(h, ids)  # [N, k, H]
        return (y * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1).view(B, T, H)


class Transformer(SequenceState, nn.Module):
    """A Qwen2/Qwen3/Qwen3-MoE causal LM. Build with :func:`hanzo_torch.load` (packed layers), or
    as ``Transformer(args, max_context)`` with dense layers and ``load_state_dict`` float weights.

    ``model(input_ids[B, T], positions=None) -> float32 logits [B, T, V]``; see :meth:`forward`.
    ``kv_dtype`` is the KV cache element type (a key of ``KV_CACHE_DTYPES``; None: :attr:`dtype`),
    ``gguf`` the :class:`~hanzo_torch.GGUFFile` the weights are mapped from (set by load).
    ``ubatch``: a call of more tokens runs through the layers in pieces of this many (llama.cpp's
    ``n_ubatch``), each piece's keys/values written before the next attends to them; 0 or None: one
    pass. The pieces bound the activations of a long prompt, and on the CPU backend they are faster
    (AVX2 box, Qwen2.5-1.5B Q4_K_M, 2 threads, one process, 4 alternated rounds: a 2048-token prompt
    at 38.5 tok/s in one pass, 42.1 in pieces of 512, 44.9 in pieces of 256; 512 tokens: 47.7, 47.1
    in pieces of 256).
    """

    UBATCH = 256
    """Default :attr:`ubatch`."""

    def __init__(self, args: ModelArgs, max_context: int):
        super().__init__()
        self.args = args
        self.max_context = max_context
        self.token_embd = Embedding(args.vocab_size, args.dim)
        self.blk = nn.ModuleList(Block(args) for _ in range(args.n_layer))
        self.output_norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size)
        self.kv_dtype: Optional[str] = None
        self.gguf = None
        self.ubatch: Optional[int] = self.UBATCH

    # read from a dense norm weight: a GGUFTensor's device/dtype go through __torch_function__
    @property
    def device(self) -> torch.device:
        return self.output_norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the activations (and of the KV cache when :attr:`kv_dtype` is None)."""
        return self.output_norm.weight.dtype

    def init_kv_cache(self, batch_size: int) -> None:
        """Allocate every layer's static KV caches ``[batch_size, max_context, Hk, D]``, zeros.

        Their type is :attr:`kv_dtype` (``"f32"``, ``"f16"``, ``"bf16"``, or ``"q8_0"``: uint8
        ``[.., D/32*34]`` blocks), or :attr:`dtype` when that is None. Use
        :meth:`~hanzo_torch.generation.SequenceState.setup_cache`, which also starts a sequence.
        """
        a = self.args
        if self.kv_dtype is None:
            shape, cache_dtype = (batch_size, self.max_context, a.n_head_kv, a.head_dim), self.dtype
        else:
            shape = kv_cache_shape(batch_size, self.max_context, a.n_head_kv, a.head_dim, self.kv_dtype)
            cache_dtype = KV_CACHE_DTYPES[self.kv_dtype]
        for blk in self.blk:
            blk.k_cache = blk.v_cache = None  # free the old caches before allocating the new ones
        # zeros, not empty: masked slots get probability 0, and 0 * NaN garbage would be NaN.
        # Normal tensors even under inference_mode, so a later no_grad call may write them.
        with torch.inference_mode(False):
            for blk in self.blk:
                blk.k_cache = torch.zeros(shape, dtype=cache_dtype, device=self.device)
                blk.v_cache = torch.zeros(shape, dtype=cache_dtype, device=self.device)

    @contextlib.contextmanager
    def kv_slots(self, start: int, stop: int) -> Iterator[None]:
        """Run forwards on the KV-cache rows ``[start, stop)`` only (continuous batching).

        Inside, every layer's ``k_cache``/``v_cache`` is the view ``cache[start:stop]`` of the
        allocated caches (writes land in them) and the batch size is ``stop - start``; pass
        explicit ``positions``. The caches, batch size and :attr:`seq_len` are restored on exit.

        Raises:
            ValueError: no caches allocated, or ``[start, stop)`` not a non-empty range of them.
        """
        B = self.cache_batch_size
        if not B or not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= B):
            raise ValueError(f"KV-cache slots [{start}, {stop}) are not a non-empty range of the "
                             f"{B} allocated (call setup_cache(batch_size) first)")
        saved = [(blk._buffers["k_cache"], blk._buffers["v_cache"]) for blk in self.blk]
        seq_len = self.seq_len
        try:
            for blk, (k, v) in zip(self.blk, saved):
                blk.k_cache, blk.v_cache = k[start:stop], v[start:stop]
            self.cache_batch_size = stop - start
            yield
        finally:
            for blk, (k, v) in zip(self.blk, saved):
                blk.k_cache, blk.v_cache = k, v
            self.cache_batch_size, self.seq_len = B, seq_len

    def forward(self, input_ids: Tensor, positions: Optional[Tensor] = None, *, last_only: bool = False,
                use_cache: bool = True, labels: Optional[Tensor] = None) -> Union[Tensor, CausalLMOutput]:
        """Run ``input_ids`` through the model, appending their keys/values to the KV cache.

        Args:
            input_ids: integer ``[B, T]`` token ids.
            positions: integer ``[B, T]`` positions of the tokens (a device tensor, for graph
                capture), or None to continue the sequence after the tokens fed so far.
            last_only: compute logits for the last position only (``[B, 1, V]``), as sampling needs.
            use_cache: False: the training forward. ``B`` independent sequences of ``T`` tokens
                (pad on the right), each attending causally to its own tokens only; the KV cache
                and the sequence bookkeeping are neither read nor written, positions default to
                ``0..T-1`` (given ones only move RoPE), and the whole graph is differentiable
                (the LoRA adapters of :mod:`hanzo_torch.lora`, prompt tuning). With
                :meth:`gradient_checkpointing_enable` each block's activations are recomputed in
                backward. ``ubatch`` does not apply.
            labels: with ``use_cache=False`` only: integer ``[B, T]`` targets (transformers'
                convention: shifted inside, ``-100`` ignored). The LM head and the cross entropy
                then run in chunks of :attr:`loss_chunk` tokens, each checkpointed
                (:func:`~hanzo_torch.models.loss.causal_lm_loss`), so the ``[B, T, V]`` logits
                are never materialized.

        Returns:
            float32 logits ``[B, T, V]``; with ``labels``, a
            :class:`~hanzo_torch.models.loss.CausalLMOutput` whose ``.loss`` is the mean over
            the counted positions (0 when none is counted) and ``.logits`` is None.

        Raises:
            ValueError: the sequence would exceed ``max_context`` (checked on the host for
                ``positions=None`` and for CPU positions), bad shapes, a batch size change
                mid-sequence (:meth:`~hanzo_torch.generation.SequenceState.next_positions`), or an
                :attr:`ubatch` that is not a non-negative int, ``labels`` with ``use_cache=True``
                or ``last_only``, or not integer ``[B, T]``.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if labels is not None and (use_cache or last_only):
            raise ValueError("labels (the training loss) need use_cache=False and last_only=False")
        if not use_cache:
            return self._forward_no_cache(input_ids, positions, last_only, labels)
        ub = self.ubatch
        if ub is not None and (not isinstance(ub, int) or isinstance(ub, bool) or ub < 0):
            raise ValueError(f"ubatch must be a non-negative int (0 or None: one pass), got {ub!r}")
        positions = self.next_positions(*input_ids.shape, positions)  # [B, T]
        T = input_ids.shape[1]
        if ub and T > ub:
            pieces = []
            for t0 in range(0, T, ub):
                h = self._hidden(input_ids[:, t0:t0 + ub], positions[:, t0:t0 + ub])
                if not last_only or t0 + ub >= T:  # with last_only, only the last piece's hidden state is used
                    pieces.append(h)
            x = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
        else:
            x = self._hidden(input_ids, positions)
        if last_only:
            x = x[:, -1:]
        return self.output(x).float()  # [B, T, V]

    def _forward_no_cache(self, input_ids: Tensor, positions: Optional[Tensor], last_only: bool,
                          labels: Optional[Tensor] = None) -> Union[Tensor, CausalLMOutput]:
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=self.device).expand(B, T)
        elif tuple(positions.shape) != (B, T) or positions.is_floating_point():
            raise ValueError(f"positions must be integer [B, T] = [{B}, {T}], got {positions.dtype} "
                             f"{tuple(positions.shape)}")
        positions = positions.to(self.device)
        x, residual = self.token_embd(input_ids.to(self.device)), None  # [B, T, H]
        checkpointing = self.gradient_checkpointing and torch.is_grad_enabled()
        for blk in self.blk:
            if checkpointing:
                x, residual = torch.utils.checkpoint.checkpoint(blk, x, residual, positions, False,
                                                                use_reentrant=False)
            else:
                x, residual = blk(x, residual, positions, False)
        x, _ = self.output_norm(x, residual)
        if labels is not None:
            chunk = self.loss_chunk or loss_chunk_tokens(self.args.vocab_size)
            return CausalLMOutput(causal_lm_loss(x, self.output, labels, chunk))
        if last_only:
            x = x[:, -1:]
        return self.output(x).float()  # [B, T, V]

    loss_chunk: Optional[int] = None
    """Tokens per chunk of the ``labels=`` loss; None: :data:`~hanzo_torch.models.loss.LOSS_CHUNK_BYTES`
    of float32 logits (110 tokens of a 151936-token vocabulary)."""

    gradient_checkpointing: bool = False
    """Recompute each block's activations in backward (``use_cache=False`` forwards with grad on)."""

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Optional[dict] = None) -> None:
        """Checkpoint every block (``torch.utils.checkpoint``, non-reentrant) in the training forward,
        as transformers' method of the same name: activations of one block at a time are kept for
        backward, at the cost of a second forward of each block. ``gradient_checkpointing_kwargs``
        is accepted for transformers' signature; only ``use_reentrant=False`` is supported.

        Raises:
            ValueError: ``gradient_checkpointing_kwargs`` asks for ``use_reentrant=True`` or other keys.
        """
        kw = dict(gradient_checkpointing_kwargs or {})
        if kw.pop("use_reentrant", False) or kw:
            raise ValueError(f"gradient_checkpointing_kwargs: only use_reentrant=False is supported, got "
                             f"{gradient_checkpointing_kwargs!r}")
        self.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        """Undo :meth:`gradient_checkpointing_enable`."""
        self.gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        """transformers' name for :attr:`gradient_checkpointing`."""
        return self.gradient_checkpointing

    def _hidden(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """The final normed hidden states ``[B, T, H]`` of tokens at ``positions`` (KV caches written)."""
        x, residual = self.token_embd(input_ids.to(self.device)), None  # [B, T, H]
        for blk in self.blk:
            x, residual = blk(x, residual, positions)
        x, _ = self.output_norm(x, residual)
        return x

    def extra_repr(self) -> str:
        a = self.args
        return (f"arch={a.arch}, layers={a.n_layer}, dim={a.dim}, heads={a.n_head}/{a.n_head_kv}x{a.head_dim}, "
                f"vocab={a.vocab_size}, max_context={self.max_context}")
