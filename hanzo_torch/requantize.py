"""Requantize a GGUF file to another type: ``hanzo-torch quantize in.gguf out.gguf Q4_K_M``.

The command shape and the per-tensor type choices are llama-quantize's (``llama_tensor_get_type``
in llama.cpp's ``src/llama-quant.cpp``, with or without an importance matrix). A tensor whose
type changes is dequantized to float32 from whatever format hanzo-torch reads and quantized with
:func:`hanzo_torch.quantize` (K-quants, IQ4_NL, IQ4_XS: byte-identical to ggml's
``ggml_quantize_chunk``); a tensor already of its chosen type is copied byte for byte, as
llama-quantize does.

With an importance matrix (``imatrix=``, :mod:`hanzo_torch.imatrix`) each quantized tensor that
has an entry is quantized with that entry's per-column weights (per expert for stacked experts),
as llama-quantize ``--imatrix`` does; a tensor without one is quantized without weights.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Optional

import gguf
import torch

__all__ = ["FTYPES", "NEEDS_IMATRIX", "check_imatrix", "quantize_tensor", "requantize", "tensor_type"]

# llama-quantize's file types: the default tensor type and the ``general.file_type`` value
FTYPES: dict[str, tuple[str, int]] = {
    "F32": ("F32", int(gguf.LlamaFileType.ALL_F32)),
    "F16": ("F16", int(gguf.LlamaFileType.MOSTLY_F16)),
    "BF16": ("BF16", int(gguf.LlamaFileType.MOSTLY_BF16)),
    "Q4_0": ("Q4_0", int(gguf.LlamaFileType.MOSTLY_Q4_0)),
    "Q4_1": ("Q4_1", int(gguf.LlamaFileType.MOSTLY_Q4_1)),
    "Q5_0": ("Q5_0", int(gguf.LlamaFileType.MOSTLY_Q5_0)),
    "Q5_1": ("Q5_1", int(gguf.LlamaFileType.MOSTLY_Q5_1)),
    "Q8_0": ("Q8_0", int(gguf.LlamaFileType.MOSTLY_Q8_0)),
    "Q4_K_S": ("Q4_K", int(gguf.LlamaFileType.MOSTLY_Q4_K_S)),
    "Q4_K_M": ("Q4_K", int(gguf.LlamaFileType.MOSTLY_Q4_K_M)),
    "Q5_K_S": ("Q5_K", int(gguf.LlamaFileType.MOSTLY_Q5_K_S)),
    "Q5_K_M": ("Q5_K", int(gguf.LlamaFileType.MOSTLY_Q5_K_M)),
    "Q6_K": ("Q6_K", int(gguf.LlamaFileType.MOSTLY_Q6_K)),
    "IQ4_NL": ("IQ4_NL", int(gguf.LlamaFileType.MOSTLY_IQ4_NL)),
    "IQ4_XS": ("IQ4_XS", int(gguf.LlamaFileType.MOSTLY_IQ4_XS)),
    "IQ3_S": ("IQ3_S", int(gguf.LlamaFileType.MOSTLY_IQ3_S)),
    "IQ3_M": ("IQ3_S", int(gguf.LlamaFileType.MOSTLY_IQ3_M)),
    "IQ3_XXS": ("IQ3_XXS", int(gguf.LlamaFileType.MOSTLY_IQ3_XXS)),
    "IQ2_M": ("IQ2_S", int(gguf.LlamaFileType.MOSTLY_IQ2_M)),
    "IQ2_S": ("IQ2_XS", int(gguf.LlamaFileType.MOSTLY_IQ2_S)),
    "IQ2_XS": ("IQ2_XS", int(gguf.LlamaFileType.MOSTLY_IQ2_XS)),
    "IQ2_XXS": ("IQ2_XXS", int(gguf.LlamaFileType.MOSTLY_IQ2_XXS)),
    "IQ1_M": ("IQ1_M", int(gguf.LlamaFileType.MOSTLY_IQ1_M)),
    "IQ1_S": ("IQ1_S", int(gguf.LlamaFileType.MOSTLY_IQ1_S)),
}
_DENSE = ("F32", "F16", "BF16")
# llama-quantize's fallback when a row length is not a multiple of the block size
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL",
             "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_S": "IQ4_NL",
             "IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL"}
_IQ4 = ("IQ4_NL", "IQ4_XS")
# the file types of llama-quantize's lowest-bit branch (IQ2 and IQ1 mixes)
_IQ_LOW = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M")
# tensor types llama-quantize writes only from an importance matrix (``tensor_requires_imatrix``;
# token_embd and output excepted)
NEEDS_IMATRIX = ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
# ggml's quantizers that take no importance weights (``quantize_q8_0`` etc. ignore them)
_IGNORE_WEIGHTS = ("Q8_0", "MXFP4", "TQ1_0", "TQ2_0")


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for key in ("attn_qkv.weight", "attn_v.weight", "attn_k.weight", "attn_q.weight", "attn_output.weight"):
        if key in name:
            return key.split(".")[0]
    for key in ("ffn_up", "ffn_gate", "ffn_down"):
        if key in name:
            return key
    return "other"


def _quantizable(name: str, n_dims: int) -> bool:
    """llama-quantize quantizes 2-D and 3-D ``*weight`` tensors except norms and the MoE router."""
    return (n_dims >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name)


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass
class _State:
    n_layer: int
    n_attn_v: int
    tied: bool
    n_expert: int = 0
    n_gqa: int = 1
    has_imatrix: bool = False
    i_attn_v: int = 0
    i_ffn_down: int = 0


def _layer(name: str, counter: int) -> int:
    """The layer of ``blk.N.*`` tensors (llama-quantize counts its attn_v / ffn_down tensors in
    layer order, whatever their order in the file); ``counter`` for other names."""
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else counter


def tensor_type(name: str, shape: tuple, src_type: str, ftype: str, state: _State) -> str:
    """The ggml type llama-quantize gives tensor ``name`` (torch-order ``shape``) for ``ftype``."""
    base = FTYPES[ftype][0]
    if not _quantizable(name, len(shape)):
        return src_type
    if base in _DENSE:
        return base
    ncols = shape[-1]
    t = base
    cat = _category(name)
    if cat == "output" or (cat == "token_embd" and state.tied):
        from .formats import get_format
        if ncols % get_format(t).block_size:
            t = "Q8_0"
        elif ftype in _IQ_LOW or ftype == "IQ3_XXS":
            t = "Q5_K"
        elif t != "Q8_0":
            t = "Q6_K"
    elif cat == "token_embd":
        if ftype in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            t = "Q2_K"
        elif ftype in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            t = "IQ3_S"
    elif ftype in _IQ_LOW:
        iq2 = ftype in ("IQ2_S", "IQ2_M")
        if cat in ("attn_v", "attn_qkv"):
            t = "Q4_K" if state.n_gqa >= 4 or state.n_expert >= 4 else "IQ3_S" if iq2 else "Q2_K"
            state.i_attn_v += 1
        elif cat == "attn_k" and state.n_expert == 8:
            t = "Q4_K"
        elif cat == "ffn_down":
            if _layer(name, state.i_ffn_down) < state.n_layer // 8:
                t = "IQ3_S" if iq2 else "Q2_K"
            state.i_ffn_down += 1
        elif cat == "attn_output":
            if state.n_expert == 8:
                t = "Q5_K"
            elif ftype in ("IQ1_S", "IQ1_M"):
                t = "IQ2_XXS"
            elif iq2:
                t = "IQ3_S"
    elif cat in ("attn_v", "attn_qkv"):
        i_v = _layer(name, state.i_attn_v)
        if ftype == "IQ3_XXS":
            t = "Q4_K" if state.n_gqa >= 4 else "IQ3_S" if not state.has_imatrix else "IQ3_XXS"
        elif ftype in _IQ4 and state.n_gqa >= 4:
            t = "Q5_K"
        elif (ftype == "IQ3_S" and state.n_gqa >= 4) or ftype == "IQ3_M":
            t = "Q4_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and _more_bits(i_v, state.n_attn_v):
            t = "Q6_K"
        elif ftype == "Q4_K_S" and i_v < 4:
            t = "Q5_K"
        if state.n_expert == 8:
            t = "Q8_0"
        state.i_attn_v += 1
    elif cat == "attn_k":
        if state.n_expert == 8:
            t = "Q8_0"
        elif ftype == "IQ3_XXS":
            t = "IQ2_S"
    elif cat == "attn_q":
        if ftype == "IQ3_XXS":
            t = "IQ2_S"
    elif cat == "attn_output":
        if state.n_expert == 8:
            if ftype in ("Q4_K_S", "Q4_K_M", "IQ3_XXS", "IQ3_S", "IQ3_M", *_IQ4):
                t = "Q5_K"
        elif ftype == "IQ3_M":
            t = "Q4_K"
        elif ftype == "IQ3_XXS":
            t = "IQ3_S"
    elif cat == "ffn_down":
        i_layer = _layer(name, state.i_ffn_down)
        n = state.n_layer
        if ftype in ("Q4_K_M", "Q5_K_M") and _more_bits(i_layer, n):
            t = "Q6_K"
        elif ftype == "IQ3_XXS" and not state.has_imatrix:
            t = "Q4_K" if i_layer < n // 8 else "Q3_K"
        elif ftype in _IQ4 and i_layer < n // 8 and not state.has_imatrix:
            t = "Q5_K"
        elif ftype == "Q4_K_S" and i_layer < n // 8:
            t = "Q5_K"
        elif ftype == "IQ3_M" and (i_layer < n // 8 or (state.n_expert == 8 and _more_bits(i_layer, n))):
            t = "Q4_K"
        elif ftype in ("Q4_0", "Q5_0") and state.has_imatrix and i_layer < n // 8:
            t = "Q4_1" if ftype == "Q4_0" else "Q5_1"
        state.i_ffn_down += 1
    from .formats import get_format
    if ncols % get_format(t).block_size:
        t = _FALLBACK.get(t, t)
        if ncols % get_format(t).block_size:
            t = "F16"
    return t


def imatrix_weights(imatrix, name: str, shape: tuple) -> Optional[torch.Tensor]:
    """The importance weights llama-quantize uses for tensor ``name`` of torch-order ``shape``
    (``[N, K]`` or stacked experts ``[E, N, K]``): float32 ``[E, K]`` (E = 1 for a matrix), or
    None when ``imatrix`` (an :class:`~hanzo_torch.imatrix.IMatrix` or None) has no entry.

    Raises:
        ValueError: the entry's size is not ``E * K`` (llama-quantize refuses that too, except
            for ``token_embd.weight``, which is then quantized without weights).
    """
    if imatrix is None:
        return None
    w = imatrix.weights(name)
    if w is None:
        return None
    k = shape[-1]
    n_mat = shape[0] if len(shape) == 3 else 1
    if w.numel() != k * n_mat:
        if name == "token_embd.weight":
            return None
        raise ValueError(f"imatrix entry {name!r} has {w.numel()} values, the tensor {list(shape)} needs "
                         f"{k * n_mat} ({n_mat} x {k}): the imatrix was made for another model")
    return w.reshape(n_mat, k)


def check_imatrix(name: str, target: str, ftype: str, imatrix, has_entry: bool = True) -> None:
    """llama-quantize's refusal to write ``target`` (one of :data:`NEEDS_IMATRIX`) for tensor
    ``name`` without importance weights (``token_embd`` and ``output`` excepted).

    Raises:
        ValueError: ``imatrix`` is None (naming the ``--imatrix`` option), or it has no entry for
            ``name`` (``has_entry`` False).
    """
    if target not in NEEDS_IMATRIX or name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        return
    if imatrix is None:
        raise ValueError(f"{ftype} needs an importance matrix (--imatrix FILE; imatrix= in Python), as "
                         f"llama-quantize does: tensor {name!r} would be {target}")
    if not has_entry:
        raise ValueError(f"the imatrix has no entry for tensor {name!r}, which {ftype} writes as {target}: "
                         f"an imatrix of this model is needed (llama-quantize refuses this too)")


def _check_weighted(name: str, target: str) -> None:
    from .formats import get_format
    if target in _DENSE or target in _IGNORE_WEIGHTS:
        return
    if get_format(target).quantize_weighted is None:
        raise ValueError(f"tensor {name!r}: hanzo-torch has no importance-weighted {target} quantizer "
                         f"(ggml's quantize_{target.lower()} uses the imatrix); quantize without --imatrix")


def quantize_tensor(x: torch.Tensor, target: str, quant_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Quantize a float tensor ``[..., K]`` (``[E, N, K]``: stacked experts) to ``target`` as
    llama-quantize does: ``uint8 [..., row_bytes]``. ``quant_weights``: float32 ``[E, K]`` (see
    :func:`imatrix_weights`; expert ``e``'s rows take row ``e``), or None; formats whose ggml
    quantizer ignores weights (Q8_0, MXFP4, TQ1_0, TQ2_0) are quantized without them."""
    from . import quantize
    if quant_weights is None or target in _IGNORE_WEIGHTS:
        return quantize(x.reshape(-1, x.shape[-1]), target).reshape(*x.shape[:-1], -1)
    mats = x.reshape(quant_weights.shape[0], -1, x.shape[-1])
    out = [quantize(mats[e], target, quant_weights=quant_weights[e]) for e in range(mats.shape[0])]
    return torch.stack(out).reshape(*x.shape[:-1], -1)


def imatrix_metadata(imatrix) -> tuple[dict, dict]:
    """The ``quantize.imatrix.*`` keys llama-quantize writes into a file quantized with
    ``imatrix``: values and their gguf types."""
    vt = gguf.GGUFValueType
    meta = {"quantize.imatrix.file": imatrix.path[:127]}
    if imatrix.datasets:
        meta["quantize.imatrix.dataset"] = imatrix.datasets[0][:127]
    meta["quantize.imatrix.entries_count"] = len(imatrix.entries)
    if imatrix.chunk_count > 0:
        meta["quantize.imatrix.chunks_count"] = imatrix.chunk_count
    return meta, {k: vt.STRING if isinstance(v, str) else vt.UINT32 for k, v in meta.items()}


def requantize(src: str, dst: str, ftype: str, *, progress: bool = True,
               log: Optional[Callable[[str], None]] = None, imatrix=None,
               replace: Optional[dict[str, torch.Tensor]] = None) -> dict[str, str]:
    """Requantize GGUF ``src`` to ``dst`` with llama-quantize's recipe for ``ftype``.

    Args:
        src: a GGUF file hanzo-torch reads (any of its formats).
        dst: output path; written to ``dst + ".tmp"`` and renamed, so it never holds a partial file.
        ftype: a key of :data:`FTYPES` (``"Q4_K_M"``, ``"IQ4_XS"``, ``"Q8_0"``, ...), case-insensitive.
        progress: a tqdm bar per tensor on stderr.
        imatrix: an importance matrix: a path (GGUF or legacy ``.dat``, see
            :func:`hanzo_torch.imatrix.load_imatrix`) or an :class:`~hanzo_torch.imatrix.IMatrix`;
            llama-quantize ``--imatrix``'s type choices and weights, and its ``quantize.imatrix.*``
            keys in the output.
        replace: ``tensor name -> float tensor`` (the tensor's shape) written in place of the
            file's tensor, always quantized to its chosen type (a LoRA merge,
            :func:`hanzo_torch.lora.merge`).

    Returns:
        ``tensor name -> ggml type`` written.

    Raises:
        ValueError: unknown ``ftype``, ``src`` equal to ``dst``, a tensor hanzo-torch cannot
            read or quantize (named), an imatrix entry of the wrong size or a target with no
            importance-weighted quantizer here (Q4_0, Q4_1, Q5_0, Q5_1), a file type that writes
            :data:`NEEDS_IMATRIX` types (IQ3_XXS, IQ2_*, IQ1_*) without ``imatrix`` or a tensor it
            lacks (:func:`check_imatrix`), all before anything is written.
        FileNotFoundError / GGUFError: ``src`` (or the imatrix file) is missing or malformed.
    """
    from .formats import get_format
    from .gguf_file import DeferredTensor, GGUFFile, save_gguf
    from .imatrix import IMatrix, load_imatrix
    from .tensor import GGUFTensor

    key = ftype.upper()
    if key not in FTYPES:
        raise ValueError(f"unknown quantization type {ftype!r}; one of: {', '.join(FTYPES)}")
    if not os.path.isfile(src):
        raise FileNotFoundError(f"{src}: no such file")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError(f"output {dst} is the input file; write to another path")
    if imatrix is not None and not isinstance(imatrix, IMatrix):
        imatrix = load_imatrix(imatrix)
    f = GGUFFile(src)
    infos = f.tensor_info
    arch = f.architecture
    n_layer = int(f.metadata.get(f"{arch}.block_count", 0)) if arch else 0
    names = list(infos)
    state = _State(n_layer=n_layer, n_attn_v=sum(_category(n) in ("attn_v", "attn_qkv") for n in names),
                   tied="output.weight" not in infos,
                   n_expert=int(f.metadata.get(f"{arch}.expert_count", 0)) if arch else 0,
                   n_gqa=_n_gqa(f.metadata, arch), has_imatrix=imatrix is not None)
    replace = dict(replace or {})
    for name, x in replace.items():
        if name not in infos:
            raise ValueError(f"{src}: replace names tensor {name!r}, which the file lacks")
        if tuple(x.shape) != tuple(infos[name].shape) or not x.is_floating_point():
            raise ValueError(f"replace[{name!r}]: a float tensor of shape {tuple(infos[name].shape)} is needed, "
                             f"got {x.dtype} {tuple(x.shape)}")
    plan = {}
    for name in names:
        info = infos[name]
        src_type = get_format(info.qtype).name if _known(info.qtype) else None
        if src_type is None:
            raise ValueError(f"{src}: tensor {name!r} has ggml type {info.qtype}, which hanzo-torch cannot read")
        plan[name] = tensor_type(name, tuple(info.shape), src_type, key, state)
        if imatrix is None and _quantizable(name, len(info.shape)):
            check_imatrix(name, plan[name], key, None)
        if (plan[name] != src_type or name in replace) and get_format(plan[name]).quantize_blocks is None \
                and plan[name] not in _DENSE:
            raise ValueError(f"tensor {name!r}: hanzo-torch cannot quantize to {plan[name]}")
    weights = {}
    for name in names:
        if plan[name] != get_format(infos[name].qtype).name and plan[name] not in _DENSE:
            weights[name] = imatrix_weights(imatrix, name, tuple(infos[name].shape))
            if weights[name] is not None:
                _check_weighted(name, plan[name])
            else:
                check_imatrix(name, plan[name], key, imatrix, has_entry=False)

    meta = dict(f.metadata)
    types = {}
    for k in f.metadata:
        vt = f.metadata.value_type(k)
        types[k] = (vt, f.metadata.element_type(k)) if vt == gguf.GGUFValueType.ARRAY else vt
    meta["general.file_type"] = FTYPES[key][1]
    types["general.file_type"] = gguf.GGUFValueType.UINT32
    meta["general.quantization_version"] = gguf.GGML_QUANT_VERSION
    types["general.quantization_version"] = gguf.GGUFValueType.UINT32
    if imatrix is not None:
        m, mt = imatrix_metadata(imatrix)
        meta.update(m)
        types.update(mt)

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(names), unit="tensor", desc=f"quantize {key}", leave=False)

    def produce(name: str):
        # called by save_gguf as it writes tensor ``name``: one tensor in memory at a time
        t = f.tensors[name]
        target = plan[name]
        if bar is not None:
            bar.set_postfix_str(f"{name} {t.qtype}->{target}")
        if target == t.qtype and name not in replace:
            res = t  # as llama-quantize: a tensor already of its type is copied, not requantized
        else:
            dense = replace[name].float() if name in replace else t.dequantize(torch.float32)
            if target in _DENSE:
                res = dense.to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[target])
            else:
                res = GGUFTensor(quantize_tensor(dense, target, weights.get(name)), target, tuple(dense.shape))
            del dense
        if bar is not None:
            bar.update(1)
        return res

    out = {name: DeferredTensor(tuple(infos[name].shape), plan[name], lambda n=name: produce(n)) for name in names}
    try:
        save_gguf(dst, out, meta, metadata_types=types)
    finally:
        if bar is not None:
            bar.close()
    if log is not None:
        log(f"wrote {dst}: {len(out)} tensors")
    return plan


def _n_gqa(metadata, arch: Optional[str]) -> int:
    """llama.cpp's ``n_gqa()`` (of layer 0): attention heads per KV head; 1 when unknown."""
    if not arch:
        return 1
    def first(v):
        return int(v[0]) if isinstance(v, (list, tuple)) and v else int(v or 0)
    n_head = first(metadata.get(f"{arch}.attention.head_count", 0))
    n_kv = first(metadata.get(f"{arch}.attention.head_count_kv", n_head))
    return n_head // n_kv if n_head and n_kv else 1


def _known(qtype) -> bool:
    from .formats import get_format
    try:
        get_format(qtype)
        return True
    except ValueError:
        return False
