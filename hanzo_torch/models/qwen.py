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
lookup. Projection and embedding weights are :class:`~hanzo_torch.GGUFTensor` (packed, views of
the memory-mapped file); norm weights and biases are small dense tensors. The forward uses
only ``torch.ops.hanzo`` ops (``F.linear``/``F.embedding`` on a GGUFTensor route to
``hanzo::mul_mat``/``hanzo::get_rows``) and never asks which format a weight has.

Decode is graph-capture friendly (docs/DESIGN.md section 4): the KV cache is allocated once at
``max_context`` and written by index, positions are a device tensor, and nothing in the forward
synchronizes with the host when positions are passed in.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..ops.fused import KV_CACHE_DTYPES, kv_cache_shape
from ..tensor import GGUFTensor
from .config import ARCHITECTURES, DEFAULT_MAX_CONTEXT, ModelArgs  # noqa: F401 (re-exported)

hanzo = torch.ops.hanzo


class Weight(nn.Module):
    """A module holding one ``weight`` (norm vectors, stacked experts) so names match GGUF's."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ weight^T (+ bias)``: ``nn.Linear`` without its random init (which costs seconds on
    the meta device). ``weight`` is a :class:`~hanzo_torch.GGUFTensor`, so ``F.linear`` runs
    ``hanzo::mul_mat`` on the packed rows."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        # parameters straight from the dict: nn.Module.__getattr__ is a Python call (~1 us), and
        # this runs ~200 times per decode token
        p = self._parameters
        w, b = p["weight"], p.get("bias")  # bias None is a plain attribute, not in the dict
        if type(w) is GGUFTensor and not w.transposed:
            # what F.linear on a GGUFTensor routes to, without the __torch_function__ detour
            # (~5-25 us a call)
            y = hanzo.mul_mat(x, w.packed, w.qtype)
            return y if b is None else y + b
        return F.linear(x, w, b)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, bias={self.bias is not None}"


class Block(nn.Module):
    """One decoder layer: attention and a dense or MoE SwiGLU feed-forward, pre-norm residuals."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        H, D, Hq, Hk = args.dim, args.head_dim, args.n_head, args.n_head_kv
        self.attn_norm = Weight(H)
        self.attn_q = Linear(H, Hq * D, bias=args.qkv_bias)
        self.attn_k = Linear(H, Hk * D, bias=args.qkv_bias)
        self.attn_v = Linear(H, Hk * D, bias=args.qkv_bias)
        if args.qk_norm:
            self.attn_q_norm = Weight(D)
            self.attn_k_norm = Weight(D)
        self.attn_output = Linear(Hq * D, H, bias=False)
        self.ffn_norm = Weight(H)
        if args.moe:
            E, Fe = args.n_expert, args.expert_ffn_dim
            self.ffn_gate_inp = Linear(H, E, bias=False)
            self.ffn_gate_exps = Weight(E, Fe, H)
            self.ffn_up_exps = Weight(E, Fe, H)
            self.ffn_down_exps = Weight(E, H, Fe)
        else:
            self.ffn_gate = Linear(H, args.ffn_dim, bias=False)
            self.ffn_up = Linear(H, args.ffn_dim, bias=False)
            self.ffn_down = Linear(args.ffn_dim, H, bias=False)
        self.register_buffer("k_cache", None, persistent=False)  # [B, S, Hk, D], set by Transformer.setup_cache
        self.register_buffer("v_cache", None, persistent=False)
        self.attn_impl = "auto"

    def forward(self, x: Tensor, residual: Optional[Tensor], positions: Tensor) -> tuple[Tensor, Tensor]:
        # x: [B, T, H], the previous sub-layer's output (the embeddings when residual is None)
        eps = self.args.norm_eps
        if residual is None:
            residual, h = x, hanzo.rms_norm(x, self.attn_norm.weight, eps)
        else:
            h, residual = hanzo.add_rms_norm(x, residual, self.attn_norm.weight, eps)
        x = self.attention(h, positions)
        h, residual = hanzo.add_rms_norm(x, residual, self.ffn_norm.weight, eps)
        x = self.moe(h) if self.args.moe else self.feed_forward(h)
        return x, residual

    def attention(self, x: Tensor, positions: Tensor) -> Tensor:
        a = self.args
        B, T, _ = x.shape
        q = self.attn_q(x).view(B, T, a.n_head, a.head_dim)  # [B, T, Hq, D]
        k = self.attn_k(x).view(B, T, a.n_head_kv, a.head_dim)  # [B, T, Hk, D]
        v = self.attn_v(x).view(B, T, a.n_head_kv, a.head_dim)  # [B, T, Hk, D]
        q_w = self.attn_q_norm.weight if a.qk_norm else None
        k_w = self.attn_k_norm.weight if a.qk_norm else None
        q, k = hanzo.qk_norm_rope(q, k, q_w, k_w, positions, a.rope_theta, a.norm_eps)
        hanzo.kv_cache_write(self.k_cache, self.v_cache, k, v, positions)
        o = hanzo.attention(q, self.k_cache, self.v_cache, positions, 1.0 / math.sqrt(a.head_dim), self.attn_impl)
        return self.attn_output(o.reshape(B, T, a.n_head * a.head_dim))  # [B, T, H]

    def feed_forward(self, x: Tensor) -> Tensor:
        gate, up = self.ffn_gate.weight, self.ffn_up.weight
        if isinstance(gate, GGUFTensor) and isinstance(up, GGUFTensor):
            # gate and up in one op (one activation read for both weights on the GPU backend)
            h = hanzo.swiglu_mul_mat(x, gate.packed, up.packed, gate.qtype, up.qtype)  # [B, T, F]
        else:  # dense weights (a model built by hand)
            h = hanzo.swiglu(self.ffn_gate(x), self.ffn_up(x))
        return self.ffn_down(h)  # [B, T, H]

    def moe(self, x: Tensor) -> Tensor:
        B, T, H = x.shape
        xt = x.reshape(B * T, H)  # [N, H]
        weights, ids = hanzo.moe_route(self.ffn_gate_inp(xt), self.args.n_expert_used, True)  # [N, k] f32, int64
        gate, up, down = self.ffn_gate_exps.weight, self.ffn_up_exps.weight, self.ffn_down_exps.weight
        g = hanzo.mul_mat_id(xt, gate.packed, ids, gate.qtype)  # [N, k, Fe]
        u = hanzo.mul_mat_id(xt, up.packed, ids, up.qtype)  # [N, k, Fe]
        y = hanzo.mul_mat_id(hanzo.swiglu(g, u), down.packed, ids, down.qtype)  # [N, k, H]
        y = (y * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1)  # [N, H]
        return y.view(B, T, H)


class Transformer(nn.Module):
    """A Qwen2/Qwen3/Qwen3-MoE causal LM. Build with :func:`hanzo_torch.load`.

    ``model(input_ids[B, T], positions=None) -> float32 logits [B, T, V]``; see :meth:`forward`.
    """

    def __init__(self, args: ModelArgs, max_context: int):
        super().__init__()
        self.args = args
        self.max_context = max_context
        self.token_embd = Weight(args.vocab_size, args.dim)
        self.blk = nn.ModuleList(Block(args) for _ in range(args.n_layer))
        self.output_norm = Weight(args.dim)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        self.kv_dtype: Optional[str] = None  # KV cache type (a key of KV_CACHE_DTYPES); None: self.dtype
        self.cache_batch_size = 0  # batch size the KV caches are allocated for (0: none yet)
        self.seq_len = 0  # tokens fed since reset() (host-side; None when unknown)
        self.gguf = None  # the GGUFFile the weights are mapped from (set by load)
        self._tokenizer = None
        self._logits_checked = False  # the first forward of a loaded model checks its logits once

    @property
    def device(self) -> torch.device:
        return self.token_embd.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the activations (and of the KV cache when :attr:`kv_dtype` is None)."""
        return self.token_embd.weight.dtype

    # ------------------------------------------------------------------ sequence state
    def setup_cache(self, batch_size: int) -> None:
        """Allocate the static KV caches ``[batch_size, max_context, Hk, D]`` (zeros) and reset.

        Their type is :attr:`kv_dtype` (``"f32"``, ``"f16"``, ``"bf16"``, or ``"q8_0"``: uint8
        ``[.., D/32*34]`` blocks), or :attr:`dtype` when that is None. Called by :meth:`forward`
        when the batch size changes at the start of a sequence; call it yourself before
        capturing a graph so the cache address is fixed.
        """
        a = self.args
        if self.kv_dtype is None:
            shape, cache_dtype = (batch_size, self.max_context, a.n_head_kv, a.head_dim), self.dtype
        else:
            shape = kv_cache_shape(batch_size, self.max_context, a.n_head_kv, a.head_dim, self.kv_dtype)
            cache_dtype = KV_CACHE_DTYPES[self.kv_dtype]
        for blk in self.blk:
            blk.k_cache = blk.v_cache = None
        # zeros, not empty: masked slots get probability 0, and 0 * NaN garbage would be NaN.
        # Normal tensors even under inference_mode, so a later no_grad call may write them.
        with torch.inference_mode(False):
            for blk in self.blk:
                blk.k_cache = torch.zeros(shape, dtype=cache_dtype, device=self.device)
                blk.v_cache = torch.zeros(shape, dtype=cache_dtype, device=self.device)
        self.cache_batch_size = batch_size
        self.seq_len = 0

    def reset(self) -> None:
        """Start a new sequence (the cache is kept; slots past a query's position are masked)."""
        self.seq_len = 0

    def _positions(self, B: int, T: int, positions: Optional[Tensor]) -> Tensor:
        if B != self.cache_batch_size:
            if self.seq_len != 0:
                raise ValueError(
                    f"batch size {B} differs from the current sequence's {self.cache_batch_size}; call reset() first"
                )
            self.setup_cache(B)
        if positions is None:
            start = self.seq_len
            if start is None:
                raise ValueError("the sequence position is unknown after a call with explicit positions on "
                                 f"{self.device.type}; pass positions or call reset()")
            if start + T > self.max_context:
                raise ValueError(
                    f"context overflow: {start} + {T} tokens exceed max_context={self.max_context}; "
                    f"call reset() or load with a larger max_context (file context_length "
                    f"{self.args.context_length})"
                )
            self.seq_len = start + T
            return (torch.arange(T, device=self.device) + start).unsqueeze(0).expand(B, T)
        if positions.shape != (B, T):
            raise ValueError(f"positions must be [B, T] = [{B}, {T}], got {tuple(positions.shape)}")
        if positions.device.type == "cpu" and not torch.compiler.is_compiling():
            # free on the host; on an accelerator (or in a traced graph) it would sync: the ops check there
            hi = int(positions.max()) if positions.numel() else -1
            if hi >= self.max_context or (positions.numel() and int(positions.min()) < 0):
                raise ValueError(f"context overflow: position {hi} is outside [0, max_context={self.max_context})")
            self.seq_len = hi + 1
        else:
            self.seq_len = None
        return positions.to(self.device)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: Tensor, positions: Optional[Tensor] = None, *, last_only: bool = False) -> Tensor:
        """Run ``input_ids`` through the model, appending their keys/values to the KV cache.

        Args:
            input_ids: integer ``[B, T]`` token ids.
            positions: integer ``[B, T]`` positions of the tokens (a device tensor, for graph
                capture), or None to continue the sequence after the tokens fed so far.
            last_only: compute logits for the last position only (``[B, 1, V]``), as sampling needs.

        Returns:
            float32 logits ``[B, T, V]``.

        Raises:
            ValueError: the sequence would exceed ``max_context`` (checked on the host for
                ``positions=None`` and for CPU positions), bad shapes, or a batch size change
                mid-sequence.
            GGUFError: on the first forward of a loaded model only, logits that are not finite or
                identical for every token (weights that are NaN/inf or overflow).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        positions = self._positions(B, T, positions)  # [B, T]
        x = F.embedding(input_ids.to(self.device), self.token_embd.weight)  # [B, T, H]
        residual = None
        for blk in self.blk:
            x, residual = blk(x, residual, positions)
        x, _ = hanzo.add_rms_norm(x, residual, self.output_norm.weight, self.args.norm_eps)  # [B, T, H]
        if last_only:
            x = x[:, -1:]
        logits = self.output(x).float()  # [B, T, V]
        if not self._logits_checked and self.gguf is not None:
            self._check_logits(logits)
        return logits

    def _check_logits(self, logits: Tensor) -> None:
        # One host sync on the first forward of a loaded model: weights holding NaN/inf, or
        # values large enough to overflow a norm, give non-finite or constant logits (every
        # activation normalized to 0), which would otherwise decode as token 0 repeated.
        if torch.compiler.is_compiling() or (logits.is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        from ..gguf_file import GGUFError

        if logits.numel() == 0:
            return
        if not bool(torch.isfinite(logits).all()):
            raise GGUFError(f"{self.gguf.path}: the model's first logits contain NaN or inf: its weights "
                            "hold non-finite values or overflow the compute dtype")
        if logits.shape[-1] > 1 and bool((logits.amax(-1) == logits.amin(-1)).all()):
            raise GGUFError(f"{self.gguf.path}: the model's first logits are the same for every token: its "
                            "weights or norms overflow (activations normalized to zero)")
        self._logits_checked = True

    # ------------------------------------------------------------------ text
    @property
    def tokenizer(self):
        """The file's tokenizer (:class:`hanzo_torch.tokenizer.Tokenizer`), built and checked by
        :func:`~hanzo_torch.load` (a file without ``tokenizer.ggml.merges`` has none: asking for
        it raises TokenizerError naming the file)."""
        if self._tokenizer is None:
            from ..tokenizer import Tokenizer

            if self.gguf is None:
                raise ValueError("this model was not loaded from a GGUF file; it has no tokenizer")
            self._tokenizer = Tokenizer.from_gguf(self.gguf)
        return self._tokenizer

    def generate(self, prompt_or_ids, max_new_tokens: int = 256, **kwargs):
        """Sample a continuation: :func:`hanzo_torch.generation.generate` applied to this model."""
        from ..generation import generate

        return generate(self, prompt_or_ids, max_new_tokens=max_new_tokens, **kwargs)

    def extra_repr(self) -> str:
        a = self.args
        return (f"arch={a.arch}, layers={a.n_layer}, dim={a.dim}, heads={a.n_head}/{a.n_head_kv}x{a.head_dim}, "
                f"vocab={a.vocab_size}, max_context={self.max_context}")
