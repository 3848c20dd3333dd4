"""Tensor parallelism over ``torch.distributed``: a model's packed weights sharded at load.

``hanzo_torch.load(path, tensor_parallel=True)`` (or ``tp_group=group``) inside an initialized
process group gives every rank of the group its slices of each matrix, taken from the packed
GGUF bytes without dequantizing anything (Megatron-LM's layout; the packed row layout is
ggml's: a row of ``K`` values is ``K / block_size`` blocks stored one after another).

==========================  =================  ==============================================
tensors                     split              what a rank holds; communication
==========================  =================  ==============================================
attn_q/k/v (+ qwen2 bias)   column (rows N)    heads ``[r*H/tp, (r+1)*H/tp)`` of q and of kv:
                                               a contiguous byte range, a zero-copy view
attn_output                 row (columns K)    the same heads' columns, whole blocks (a copy:
                                               a K slice of each row is strided); all_reduce
ffn_gate/up                 column (rows)      a block-aligned range of the intermediate dim
ffn_down                    row (columns K)    the same range; all_reduce
ffn_{gate,up,down}_exps     as the dense FFN   every expert, a range of its intermediate dim
ffn_gate_inp (router)       replicated         whole
token_embd                  vocabulary (rows)  rows ``[v0, v1)``: lookup of own ids, all_reduce
output (or tied token_embd) vocabulary (rows)  logits ``[v0, v1)``; all_gather to ``[.., V]``
norms                       replicated         whole
==========================  =================  ==============================================

MoE experts are sharded like the dense FFN, not spread over ranks (expert parallel): every rank
computes all k chosen experts on its slice of their intermediate dim, so the work per rank is
1/tp whatever the router picks (expert parallelism leaves a rank idle when the k experts of a
decode token sit on other ranks), the router's ids need no remapping, and the layer keeps one
reduction. The cost: that reduction is over the ``[T, k, H]`` expert outputs (k times the bytes
of a dense layer's), since the weighted sum of the experts stays in the model's code.

Split rules, checked from the header before anything is read: ``head_count % tp`` and
``head_count_kv % tp`` are 0; a rank's attn_output columns (``head_count / tp * head_dim``) are
a multiple of that tensor's block size. The intermediate dim need not divide evenly: it is split
in units of ffn_down's block size, the ranks' shares differing by at most one block (the
fallback when ``ffn_dim / tp`` is not a block multiple, e.g. 8960 = 35 blocks of 256 over 2
ranks is 18 + 17 blocks), and there must be at least ``tp`` such blocks. The vocabulary is split
in ``ceil(V / tp)`` rows per rank (the last one fewer).

Every rank's residual stream is the same after each reduction (the collectives return the same
bits to every rank), so each computes the same routing and the same norms. Logits equal the
single-process model's up to float32 summation order in the row-parallel layers.

On the CPU the file stays mapped as a whole, but a rank's resident weight pages are its own
slices: the whole-file read-ahead of a single-process load is replaced by read-ahead of the
rank's own byte ranges, and the source range of every copied (K-split) tensor is released from
the mapping after the copy.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from .models.layers import PackedEmbedding, PackedExperts, PackedLinear

__all__ = ["TensorParallel", "TensorParallelError", "ShardPlan", "plan_shards", "resolve_group",
           "init_from_env", "DEFAULT_TIMEOUT_S"]

hanzo = torch.ops.hanzo

DEFAULT_TIMEOUT_S = 60.0
"""Collective timeout (seconds) of the process group :func:`init_from_env` creates: a rank that
dies or stops makes the others raise :class:`TensorParallelError` after at most this long."""


class TensorParallelError(RuntimeError):
    """A collective of a tensor-parallel model failed (a peer rank exited, crashed or timed out)."""


def _block_size(qtype: str) -> int:
    from .formats import get_format

    return get_format(qtype).block_size


def _split(n_units: int, tp: int, rank: int) -> tuple[int, int]:
    """Rank's share ``[lo, hi)`` of ``n_units``, the shares differing by at most one unit."""
    return n_units * rank // tp, n_units * (rank + 1) // tp


@dataclass(frozen=True)
class ShardPlan:
    """Which slices rank ``rank`` of ``world_size`` takes (see the module docstring).

    Attributes:
        heads: ``(q0, q1)`` query heads of this rank; ``kv_heads``: ``(k0, k1)`` its KV heads.
        ffn: per layer, ``(f0, f1)`` of the intermediate dim (dense or per expert).
        vocab: ``(v0, v1)`` rows of token_embd/output; ``vocab_chunk``: ``ceil(V / tp)``.
    """

    rank: int
    world_size: int
    heads: tuple
    kv_heads: tuple
    ffn: tuple
    vocab: tuple
    vocab_chunk: int


def plan_shards(args, f, world_size: int, rank: int) -> ShardPlan:
    """Check that ``args`` (the file ``f``'s :class:`~hanzo_torch.models.ModelArgs`) can be split
    over ``world_size`` ranks and return rank ``rank``'s :class:`ShardPlan`.

    Raises:
        ValueError: ``head_count`` or ``head_count_kv`` not a multiple of ``world_size``; a rank's
            attn_output columns not a multiple of that tensor's block size; fewer ffn_down blocks
            along the intermediate dim than ranks. The message names the file, tensor and sizes.
    """
    tp, a, path = world_size, args, f.path
    if a.n_head % tp or a.n_head_kv % tp:
        raise ValueError(f"{path}: tensor parallel over {tp} ranks needs attention.head_count ({a.n_head}) and "
                         f"attention.head_count_kv ({a.n_head_kv}) to be multiples of {tp}")
    info = f.tensor_info
    hq = a.n_head // tp
    cols = hq * a.head_dim
    for i in range(a.n_layer):
        name = f"blk.{i}.attn_output.weight"
        bs = _block_size(info[name].qtype)
        if cols % bs:
            raise ValueError(f"{path}: tensor parallel over {tp} ranks splits {name} ({info[name].qtype}, "
                             f"K = {a.n_head * a.head_dim}) into {cols} columns per rank, not a multiple of its "
                             f"block size {bs}")
    ffn = []
    for i in range(a.n_layer):
        name = f"blk.{i}.ffn_down_exps.weight" if a.moe else f"blk.{i}.ffn_down.weight"
        t = info[name]
        bs = _block_size(t.qtype)
        n_blocks = t.shape[-1] // bs
        if n_blocks < tp:
            raise ValueError(f"{path}: tensor parallel over {tp} ranks splits {name} ({t.qtype}, K = {t.shape[-1]}) "
                             f"on {bs}-value block boundaries, but it has only {n_blocks} block(s) per row")
        b0, b1 = _split(n_blocks, tp, rank)
        ffn.append((b0 * bs, b1 * bs))
    V = a.vocab_size
    chunk = -(-V // tp)
    vocab = (min(V, rank * chunk), min(V, (rank + 1) * chunk))
    if vocab[0] >= vocab[1]:
        raise ValueError(f"{path}: tensor parallel over {tp} ranks leaves rank {rank} no rows of a {V}-token vocabulary")
    return ShardPlan(rank, tp, (rank * hq, (rank + 1) * hq),
                     (rank * (a.n_head_kv // tp), (rank + 1) * (a.n_head_kv // tp)), tuple(ffn), vocab, chunk)


class TensorParallel:
    """The collectives of one tensor-parallel model: its process group, rank and size.

    Attributes:
        group: the ``torch.distributed`` process group; ``rank``/``world_size``: within it.
        plan: this rank's :class:`ShardPlan`.
        weight_bytes: bytes of the weights this rank holds (packed bytes of its GGUFTensor slices
            plus its dense norms and biases); ``file_weight_bytes``: all the file's tensor bytes.
    """

    def __init__(self, group, plan: ShardPlan):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.plan = plan
        self.weight_bytes = 0
        self.file_weight_bytes = 0

    def _fail(self, what: str, exc: Exception) -> TensorParallelError:
        msg = " ".join(str(exc).split())
        return TensorParallelError(f"tensor parallel rank {self.rank}/{self.world_size}: {what} failed (a peer rank "
                                   f"exited, crashed or timed out): {msg}")

    def all_reduce(self, x: Tensor, what: str) -> Tensor:
        """Sum ``x`` over the ranks in place; returns ``x``."""
        try:
            dist.all_reduce(x, group=self.group)
        except (RuntimeError, dist.DistError) as exc:
            raise self._fail(f"all_reduce after {what}", exc) from exc
        return x

    def gather_vocab(self, part: Tensor, vocab_size: int) -> Tensor:
        """``[..., v1 - v0]`` logits of every rank -> ``[..., vocab_size]``, on every rank."""
        chunk = self.plan.vocab_chunk
        if part.shape[-1] < chunk:
            part = torch.nn.functional.pad(part, (0, chunk - part.shape[-1]))
        parts = [torch.empty_like(part) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, part.contiguous(), group=self.group)
        except (RuntimeError, dist.DistError) as exc:
            raise self._fail("all_gather of the logits", exc) from exc
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    def broadcast_token(self, token: Optional[int], device) -> int:
        """Rank 0's ``token`` on every rank (the other ranks pass None)."""
        t = torch.tensor([-1 if token is None else token], dtype=torch.long, device=device)
        try:
            dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        except (RuntimeError, dist.DistError) as exc:
            raise self._fail("broadcast of the sampled token", exc) from exc
        return int(t[0])


# ---------------------------------------------------------------------- layers
class RowParallelLinear(PackedLinear):
    """:class:`PackedLinear` holding a K slice of the weight; the partial products are summed over
    the ranks (``x [..., K / tp]`` -> ``[..., out_features]``, every rank the full sum)."""

    tp: TensorParallel

    def forward(self, x: Tensor) -> Tensor:
        w = self._parameters["weight"]
        return self.tp.all_reduce(hanzo.mul_mat(x, w.packed, w.qtype), self.what)


class RowParallelExperts(PackedExperts):
    """:class:`PackedExperts` holding a K slice of every expert; ``[T, k, H]`` summed over the ranks."""

    tp: TensorParallel

    def forward(self, x: Tensor, ids: Tensor) -> Tensor:
        w = self._parameters["weight"]
        return self.tp.all_reduce(hanzo.mul_mat_id(x, w.packed, ids, w.qtype), self.what)


class VocabParallelEmbedding(PackedEmbedding):
    """Rows ``[v0, v1)`` of the table: each rank looks up the ids it holds (zeros elsewhere) and
    the rows are summed over the ranks (exact: one non-zero term per element)."""

    tp: TensorParallel
    v0: int

    def forward(self, ids: Tensor) -> Tensor:
        w = self._parameters["weight"]
        local = ids - self.v0
        mine = (local >= 0) & (local < w.shape[0])
        rows = hanzo.get_rows(w.packed, local.clamp(0, w.shape[0] - 1), w.qtype, w.dtype)
        return self.tp.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype), "token_embd")


class VocabParallelOutput(PackedLinear):
    """Logits of rows ``[v0, v1)`` of the output matrix, gathered to ``[..., vocab_size]``."""

    tp: TensorParallel
    vocab_size: int

    def forward(self, x: Tensor) -> Tensor:
        w = self._parameters["weight"]
        return self.tp.gather_vocab(hanzo.mul_mat(x, w.packed, w.qtype), self.vocab_size)


# ---------------------------------------------------------------------- set-up
def resolve_group(tensor_parallel: bool, tp_group, device: torch.device):
    """The process group ``load(tensor_parallel=..., tp_group=...)`` asks for, or None.

    Raises:
        TypeError: ``tensor_parallel`` not a bool, ``tp_group`` not a ProcessGroup.
        ValueError: no initialized process group; a backend that cannot carry ``device``'s
            tensors (NCCL with CPU weights, gloo with CUDA ones).
    """
    if not isinstance(tensor_parallel, bool):
        raise TypeError(f"tensor_parallel must be a bool, got {type(tensor_parallel).__name__}")
    if tp_group is None and not tensor_parallel:
        return None
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("tensor_parallel=True / tp_group= need an initialized torch.distributed process group "
                         "(torch.distributed.init_process_group, e.g. under torchrun)")
    if tp_group is None:
        tp_group = dist.group.WORLD
    elif not isinstance(tp_group, dist.ProcessGroup):
        raise TypeError(f"tp_group must be a torch.distributed ProcessGroup, got {type(tp_group).__name__}")
    backend = str(dist.get_backend(tp_group)).lower()
    want = _collective_backend(device)
    if backend in ("gloo", "nccl") and backend != want:
        raise ValueError(f"tensor parallel on {device.type} needs a {want} process group, got {backend}")
    return tp_group


def _collective_backend(device: torch.device) -> str:
    """The torch.distributed backend of ``device``'s kernel backend (``Backend.distributed``),
    gloo where it names none."""
    from . import backends

    return backends.for_device(device).distributed or "gloo"


def init_from_env(device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Initialize the default process group from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) unless one exists: gloo for the CPU, NCCL for CUDA/ROCm
    (each rank on ``cuda:LOCAL_RANK``), collectives timing out after ``timeout_s`` seconds."""
    if dist.is_initialized():
        return
    backend = _collective_backend(device)
    kw = {}
    if backend == "nccl":  # one GPU per rank
        kw["device_id"] = torch.device(device.type, int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)


def _gguf(packed: Tensor, like, shape) -> "torch.Tensor":
    from .tensor import GGUFTensor

    return GGUFTensor(packed, like.qtype, shape, dtype=like.dtype)


def _rows(w, lo: int, hi: int):
    """Rows ``[lo, hi)`` of a 2-D packed weight: a view of the same bytes."""
    return _gguf(w.packed[lo:hi], w, (hi - lo, w.shape[1]))


def _cols(w, lo: int, hi: int):
    """Columns ``[lo, hi)`` (whole blocks) of every row of a 2-D or 3-D packed weight: a copy."""
    fmt = w.format
    b0, b1 = lo // fmt.block_size * fmt.type_size, hi // fmt.block_size * fmt.type_size
    return _gguf(w.packed[..., b0:b1].contiguous(), w, (*w.shape[:-1], hi - lo))


def _expert_rows(w, lo: int, hi: int):
    """Rows ``[lo, hi)`` of every expert of a 3-D packed weight: a copy."""
    return _gguf(w.packed[:, lo:hi].contiguous(), w, (w.shape[0], hi - lo, w.shape[2]))


def _swap(parent: nn.Module, leaf: str, cls, weight, tp: TensorParallel, **attrs) -> nn.Module:
    old = getattr(parent, leaf)
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.__dict__.update({k: v for k, v in old.__dict__.items() if not k.startswith("_")})
    new.weight = nn.Parameter(weight, requires_grad=False)
    if "bias" in old._parameters:
        if old._parameters["bias"] is not None and cls is not VocabParallelOutput:
            raise NotImplementedError(f"tensor parallel: {getattr(old, 'what', leaf)} with a bias")
        new.register_parameter("bias", old._parameters["bias"])
    new.tp = tp
    for k, v in attrs.items():
        setattr(new, k, v)
    parent.register_module(leaf, new)
    return new


def _set(module: nn.Module, name: str, value) -> None:
    module.register_parameter(name, None if value is None else nn.Parameter(value, requires_grad=False))


def shard_model(model, f, group, plan: ShardPlan, device: torch.device) -> TensorParallel:
    """Replace every weight of ``model`` (loaded from ``f``, full CPU views of the mapping) by this
    rank's slice, moved to ``device``, and the layers that need a collective by their parallel
    twins; sets ``model.tp`` and returns it. On the CPU, reads ahead the rank's own byte ranges."""
    tp = TensorParallel(group, plan)
    a = model.args
    D = a.head_dim
    q0, q1 = (h * D for h in plan.heads)
    k0, k1 = (h * D for h in plan.kv_heads)
    views, copied = [], []  # source GGUFTensors: read ahead / released from the mapping

    def take(w, kind: str, lo: int, hi: int):
        part = {"rows": _rows, "cols": _cols, "expert_rows": _expert_rows}[kind](w, lo, hi)
        (views if kind == "rows" else copied).append(part if kind == "rows" else w)
        return part

    for i, blk in enumerate(model.blk):
        for leaf, (lo, hi) in (("attn_q", (q0, q1)), ("attn_k", (k0, k1)), ("attn_v", (k0, k1))):
            lin = getattr(blk, leaf)
            lin.weight = nn.Parameter(take(lin.weight, "rows", lo, hi), requires_grad=False)
            lin.out_features = hi - lo
            if lin.bias is not None:
                _set(lin, "bias", lin.bias[lo:hi].clone())
        o = blk.attn_output
        _swap(blk, "attn_output", RowParallelLinear, take(o.weight, "cols", q0, q1), tp,
              in_features=q1 - q0, what=f"blk.{i}.attn_output")
        f0, f1 = plan.ffn[i]
        if a.moe:
            for leaf in ("ffn_gate_exps", "ffn_up_exps"):
                e = getattr(blk, leaf)
                e.weight = nn.Parameter(take(e.weight, "expert_rows", f0, f1), requires_grad=False)
            _swap(blk, "ffn_down_exps", RowParallelExperts, take(blk.ffn_down_exps.weight, "cols", f0, f1), tp,
                  what=f"blk.{i}.ffn_down_exps")
        else:
            for leaf in ("ffn_gate", "ffn_up"):
                lin = getattr(blk, leaf)
                lin.weight = nn.Parameter(take(lin.weight, "rows", f0, f1), requires_grad=False)
                lin.out_features = f1 - f0
            _swap(blk, "ffn_down", RowParallelLinear, take(blk.ffn_down.weight, "cols", f0, f1), tp,
                  in_features=f1 - f0, what=f"blk.{i}.ffn_down")
    v0, v1 = plan.vocab
    tied = model.output.weight is model.token_embd.weight
    emb = _swap(model, "token_embd", VocabParallelEmbedding, take(model.token_embd.weight, "rows", v0, v1), tp, v0=v0)
    out_w = emb.weight if tied else take(model.output.weight, "rows", v0, v1)
    out = _swap(model, "output", VocabParallelOutput, out_w, tp, vocab_size=a.vocab_size, out_features=v1 - v0)
    if tied:
        out.weight = emb.weight
    local = dataclasses.replace(a, n_head=plan.heads[1] - plan.heads[0], n_head_kv=plan.kv_heads[1] - plan.kv_heads[0])
    model.args = local
    for blk in model.blk:
        blk.args = local
    model.tp = tp

    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        data = getattr(p, "packed", p)
        total += data.numel() * data.element_size()
    tp.weight_bytes = total
    tp.file_weight_bytes = sum(t.nbytes for t in f.tensor_info.values())
    if device.type == "cpu":  # read ahead the rank's own views
        f.advise(views, willneed=True)
    f.advise(copied, release=True)  # pages of copied-out (K-split) sources
    if device.type != "cpu":
        moved = {}
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and p.device != device:
                    if id(p) not in moved:
                        moved[id(p)] = nn.Parameter(p.data.to(device) if not hasattr(p, "packed") else p.to(device),
                                                    requires_grad=False)
                    module._parameters[name] = moved[id(p)]
    return tp

