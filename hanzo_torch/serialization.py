"""Save and load state dicts holding packed :class:`~hanzo_torch.GGUFTensor` weights as safetensors.

A GGUFTensor is stored as its ``packed`` ``uint8`` tensor under its own name; its format, logical
shape, compute dtype and transposed flag go, as JSON, into the safetensors header metadata under
the key :data:`METADATA_KEY`. Plain tensors are stored as they are. Loading gives back a
GGUFTensor with byte-identical ``packed`` data, so the file can be read by any safetensors reader
(the packed bytes are ordinary ``U8`` tensors) and round trips losslessly through hanzo-torch.

``torch.save`` / ``torch.load(weights_only=True)`` work too (``GGUFTensor`` is registered as a safe
global); safetensors is the format to prefer for sharing: no pickle at all.
"""
from __future__ import annotations

import json
import os
from typing import Mapping, Optional, Union

import torch

from .formats import get_format
from .tensor import GGUFTensor

__all__ = ["save_packed", "load_packed", "METADATA_KEY"]

METADATA_KEY = "hanzo_torch.gguf_tensors"
"""safetensors header metadata key of the JSON ``{name: {"qtype", "shape", "dtype", "transposed"}}``."""

_FORMAT_VERSION = "1"
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def save_packed(
    state_dict: Mapping[str, torch.Tensor],
    path: Union[str, os.PathLike],
    metadata: Optional[Mapping[str, str]] = None,
) -> None:
    """Write ``state_dict`` (GGUFTensors and plain tensors) to the safetensors file ``path``.

    Args:
        state_dict: name -> tensor, e.g. ``model.state_dict()``. Tensors are written from the CPU;
            tensors sharing memory (tied weights) are written once each, as separate copies.
        path: output file.
        metadata: extra ``str -> str`` header metadata (may not use :data:`METADATA_KEY`).

    Raises:
        TypeError: a value is not a tensor or a name is not a string.
        ValueError: ``metadata`` uses the reserved key.
    """
    from safetensors.torch import save_file

    extra = dict(metadata or {})
    if METADATA_KEY in extra or "hanzo_torch.version" in extra:
        raise ValueError(f"save_packed: metadata keys {METADATA_KEY!r} and 'hanzo_torch.version' are reserved")
    tensors: dict[str, torch.Tensor] = {}
    packed_meta: dict[str, dict] = {}
    seen: set[tuple[int, int]] = set()
    for name, t in state_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"save_packed: state dict names must be str, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"save_packed: {name!r} is a {type(t).__name__}, not a tensor")
        if isinstance(t, GGUFTensor):
            packed_meta[name] = {
                "qtype": t.qtype,
                "shape": list(t.logical_shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "transposed": t.transposed,
            }
            data = t.packed
        else:
            data = t
        data = data.detach().to("cpu").contiguous()
        key = (data.untyped_storage().data_ptr(), data.storage_offset())
        if data.numel() and key in seen or _is_view_of_larger(data):
            data = data.clone()
        seen.add((data.untyped_storage().data_ptr(), data.storage_offset()))
        tensors[name] = data
    extra[METADATA_KEY] = json.dumps(packed_meta, sort_keys=True)
    extra["hanzo_torch.version"] = _FORMAT_VERSION
    save_file(tensors, os.fspath(path), metadata=extra)


def _is_view_of_larger(t: torch.Tensor) -> bool:
    # safetensors refuses tensors that share storage with others; a view of a larger storage may
    return t.untyped_storage().nbytes() != t.numel() * t.element_size()


def load_packed(path: Union[str, os.PathLike], device: Union[str, torch.device] = "cpu") -> dict[str, torch.Tensor]:
    """Read a file written by :func:`save_packed` back into a state dict.

    Args:
        path: safetensors file.
        device: where the tensors are placed.

    Returns:
        name -> :class:`GGUFTensor` (for the packed entries) or plain tensor, ready for
        ``module.load_state_dict(sd, assign=True)``.

    Raises:
        ValueError: the header metadata names a tensor that is missing or not ``uint8``, an unknown
            format or dtype, or a shape that does not match the packed bytes.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(os.fspath(path), framework="pt") as f:
        header = f.metadata() or {}
    packed_meta = json.loads(header.get(METADATA_KEY, "{}"))
    tensors = load_file(os.fspath(path), device=str(device))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = packed_meta.get(name)
        if m is None:
            out[name] = t
            continue
        dtype = _DTYPES.get(m.get("dtype"))
        if dtype is None:
            raise ValueError(f"load_packed: {name!r} has unsupported compute dtype {m.get('dtype')!r}")
        get_format(m["qtype"])  # clear error for an unknown format
        out[name] = GGUFTensor(t, m["qtype"], tuple(m["shape"]), dtype, bool(m.get("transposed", False)))
    missing = sorted(set(packed_meta) - set(tensors))
    if missing:
        raise ValueError(f"load_packed: header metadata names tensors that are not in the file: {missing}")
    return out
