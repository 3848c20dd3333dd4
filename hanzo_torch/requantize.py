"""Requantize a GGUF file to another type: ``hanzo-torch quantize in.gguf out.gguf Q4_K_M``.

The command shape and the per-tensor type choices are llama-quantize's (``llama_tensor_get_type``
in llama.cpp's ``src/llama-quant.cpp``, without an importance matrix). A tensor whose
type changes is dequantized to float32 from whatever format hanzo-torch reads and quantized with
:func:`hanzo_torch.quantize` (K-quants: ggml's reference quantizers, byte-identical to ggml's);
a tensor already of its chosen type is copied byte for byte, as llama-quantize does.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Optional

import gguf
import torch

__all__ = ["FTYPES", "requantize", "tensor_type"]

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
}
_DENSE = ("F32", "F16", "BF16")
# llama-quantize's fallback when a row length is not a multiple of the block size
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


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
        elif t != "Q8_0":
            t = "Q6_K"
    elif cat in ("attn_v", "attn_qkv"):
        i_v = _layer(name, state.i_attn_v)
        if ftype in ("Q4_K_M", "Q5_K_M") and _more_bits(i_v, state.n_attn_v):
            t = "Q6_K"
        elif ftype == "Q4_K_S" and i_v < 4:
            t = "Q5_K"
        if state.n_expert == 8:
            t = "Q8_0"
        state.i_attn_v += 1
    elif cat == "attn_k":
        if state.n_expert == 8:
            t = "Q8_0"
    elif cat == "attn_output":
        if state.n_expert == 8 and ftype in ("Q4_K_S", "Q4_K_M"):
            t = "Q5_K"
    elif cat == "ffn_down":
        i_layer = _layer(name, state.i_ffn_down)
        n = state.n_layer
        if ftype in ("Q4_K_M", "Q5_K_M") and _more_bits(i_layer, n):
            t = "Q6_K"
        elif ftype == "Q4_K_S" and i_layer < n // 8:
            t = "Q5_K"
        state.i_ffn_down += 1
    from .formats import get_format
    if ncols % get_format(t).block_size:
        t = _FALLBACK.get(t, t)
        if ncols % get_format(t).block_size:
            t = "F16"
    return t


def requantize(src: str, dst: str, ftype: str, *, progress: bool = True,
               log: Optional[Callable[[str], None]] = None,
               replace: Optional[dict[str, torch.Tensor]] = None) -> dict[str, str]:
    """Requantize GGUF ``src`` to ``dst`` with llama-quantize's recipe for ``ftype``.

    Args:
        src: a GGUF file hanzo-torch reads (any of its formats).
        dst: output path; written to ``dst + ".tmp"`` and renamed, so it never holds a partial file.
        ftype: a key of :data:`FTYPES` (``"Q4_K_M"``, ``"Q8_0"``, ...), case-insensitive.
        progress: a tqdm bar per tensor on stderr.
        replace: ``tensor name -> float tensor`` (the tensor's shape) written in place of the
            file's tensor, always quantized to its chosen type (a LoRA merge,
            :func:`hanzo_torch.lora.merge`).

    Returns:
        ``tensor name -> ggml type`` written.

    Raises:
        ValueError: unknown ``ftype``, ``src`` equal to ``dst``, or a tensor hanzo-torch cannot
            read or quantize (named), all before anything is written.
        FileNotFoundError / GGUFError: ``src`` is missing or not a GGUF file.
    """
    from . import quantize
    from .formats import get_format
    from .gguf_file import GGUFFile, save_gguf
    from .tensor import GGUFTensor

    key = ftype.upper()
    if key not in FTYPES:
        raise ValueError(f"unknown quantization type {ftype!r}; one of: {', '.join(FTYPES)}")
    if not os.path.isfile(src):
        raise FileNotFoundError(f"{src}: no such file")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError(f"output {dst} is the input file; write to another path")
    f = GGUFFile(src)
    infos = f.tensor_info
    arch = f.architecture
    n_layer = int(f.metadata.get(f"{arch}.block_count", 0)) if arch else 0
    names = list(infos)
    state = _State(n_layer=n_layer, n_attn_v=sum(_category(n) in ("attn_v", "attn_qkv") for n in names),
                   tied="output.weight" not in infos,
                   n_expert=int(f.metadata.get(f"{arch}.expert_count", 0)) if arch else 0)
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
        if (plan[name] != src_type or name in replace) and get_format(plan[name]).quantize_blocks is None \
                and plan[name] not in _DENSE:
            raise ValueError(f"tensor {name!r}: hanzo-torch cannot quantize to {plan[name]}")

    meta = dict(f.metadata)
    types = {}
    for k in f.metadata:
        vt = f.metadata.value_type(k)
        types[k] = (vt, f.metadata.element_type(k)) if vt == gguf.GGUFValueType.ARRAY else vt
    meta["general.file_type"] = FTYPES[key][1]
    types["general.file_type"] = gguf.GGUFValueType.UINT32
    meta["general.quantization_version"] = gguf.GGML_QUANT_VERSION
    types["general.quantization_version"] = gguf.GGUFValueType.UINT32

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(names), unit="tensor", desc=f"quantize {key}", leave=False)
    out = {}
    try:
        for name in names:
            t = f.tensors[name]
            target = plan[name]
            if bar is not None:
                bar.set_postfix_str(f"{name} {t.qtype}->{target}")
            if target == t.qtype and name not in replace:
                out[name] = t  # as llama-quantize: a tensor already of its type is copied, not requantized
            else:
                dense = replace[name].float() if name in replace else t.dequantize(torch.float32)
                if target in _DENSE:
                    out[name] = dense.to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[target])
                else:
                    packed = quantize(dense.reshape(-1, dense.shape[-1]), target)
                    out[name] = GGUFTensor(packed.reshape(*dense.shape[:-1], -1), target, tuple(dense.shape))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    save_gguf(dst, out, meta, metadata_types=types)
    if log is not None:
        log(f"wrote {dst}: {len(out)} tensors")
    return plan


def _known(qtype) -> bool:
    from .formats import get_format
    try:
        get_format(qtype)
        return True
    except ValueError:
        return False
