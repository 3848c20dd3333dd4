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


def _parse_packed_meta(where: str, text: str) -> dict:
    """The :data:`METADATA_KEY` JSON, with every field's type checked (no truthiness or
    conversion: ``"transposed": "no"`` is an error, not True)."""
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"load_packed: {where}: header metadata {METADATA_KEY!r} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"load_packed: {where}: header metadata {METADATA_KEY!r} must be a JSON object, "
                         f"got {type(meta).__name__}")
    out = {}
    for name, m in meta.items():
        what = f"load_packed: {where}: {METADATA_KEY} entry {name!r}"
        if not isinstance(m, dict):
            raise ValueError(f"{what} must be a JSON object, got {type(m).__name__}")
        unknown = set(m) - {"qtype", "shape", "dtype", "transposed"}
        if unknown:
            raise ValueError(f"{what} has unknown fields {sorted(unknown)}")
        qtype, shape, dtype = m.get("qtype"), m.get("shape"), m.get("dtype")
        transposed = m.get("transposed", False)
        if not isinstance(qtype, str):
            raise ValueError(f"{what}: 'qtype' must be a string, got {qtype!r}")
        if not isinstance(dtype, str):
            raise ValueError(f"{what}: 'dtype' must be a string, got {dtype!r}")
        if not isinstance(transposed, bool):
            raise ValueError(f"{what}: 'transposed' must be true or false, got {transposed!r}")
        if not (isinstance(shape, list) and shape
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise ValueError(f"{what}: 'shape' must be a non-empty list of integers >= 0, got {shape!r}")
        out[name] = {"qtype": qtype, "shape": shape, "dtype": dtype, "transposed": transposed}
    return out


def load_packed(path: Union[str, os.PathLike], device: Union[str, torch.device] = "cpu") -> dict[str, torch.Tensor]:
    """Read a file written by :func:`save_packed` back into a state dict.

    Args:
        path: safetensors file.
        device: where the tensors are placed.

    Returns:
        name -> :class:`GGUFTensor` (for the packed entries) or plain tensor, ready for
        ``module.load_state_dict(sd, assign=True)``.

    Raises:
        ValueError: the header metadata is not a JSON object of objects with the expected field
            types (``qtype``/``dtype`` strings, ``shape`` a list of ints, ``transposed`` a JSON
            bool), names a tensor that is missing or not ``uint8``, an unknown format or dtype,
            or a shape that does not match the packed bytes; the message names the file.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    where = os.fspath(path)
    with safe_open(where, framework="pt") as f:
        header = f.metadata() or {}
    packed_meta = _parse_packed_meta(where, header.get(METADATA_KEY, "{}"))
    tensors = load_file(where, device=str(device))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = packed_meta.get(name)
        if m is None:
            out[name] = t
            continue
        dtype = _DTYPES.get(m["dtype"])
        if dtype is None:
            raise ValueError(f"load_packed: {where}: {name!r} has unsupported compute dtype {m['dtype']!r}")
        try:
            get_format(m["qtype"])  # clear error for an unknown format
            out[name] = GGUFTensor(t, m["qtype"], tuple(m["shape"]), dtype, m["transposed"])
        except (ValueError, KeyError) as exc:
            raise ValueError(f"load_packed: {where}: tensor {name!r}: {exc}") from None
    missing = sorted(set(packed_meta) - set(tensors))
    if missing:
        raise ValueError(f"load_packed: header metadata names tensors that are not in the file: {missing}")
    return out
