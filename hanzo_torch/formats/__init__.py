"""The format registry: the value axis of hanzo-torch.

Every ggml tensor type that hanzo-torch understands is described by one :class:`Format`
trait: its ggml type id, its name, the number of logical values per block, the bytes per
block, and a vectorized torch ``dequantize_blocks`` (plus ``quantize_blocks`` where
supported). Dense types (F32, F16, BF16) are formats with a block size of 1, so a dense
weight is just another format.

This module is the only place in hanzo-torch that knows about formats. Kernels and models
look a format up here by name or id and never branch on a particular one.

Block layouts are ggml's (``ggml-common.h``); the numpy dequantizers of the ``gguf``
package (``gguf.quants``) are the oracle every format is tested against.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

__all__ = [
    "Format",
    "register",
    "get_format",
    "FORMATS",
    "QUANTIZED_FORMATS",
    "dequantize",
    "quantize",
    "row_bytes",
]


@dataclass(frozen=True)
class Format:
    """Trait of one ggml tensor type.

    Attributes:
        name: ggml name, e.g. ``"Q4_K"``.
        type_id: ggml type id (``gguf.GGMLQuantizationType`` value), e.g. 12 for Q4_K.
        block_size: logical values per block (1 for dense types, 32 for Q4_0, 256 for K-quants).
        type_size: bytes per block.
        dequantize_blocks: ``uint8 [n, type_size] -> float32 [n, block_size]``, vectorized
            torch, on any device; bit-identical to ``gguf.quants.dequantize``.
        quantize_blocks: ``float32 [n, block_size] -> uint8 [n, type_size]`` or None when
            hanzo-torch cannot quantize to this format.
        dense: True for F32/F16/BF16 (block size 1).
    """

    name: str
    type_id: int
    block_size: int
    type_size: int
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor] = field(repr=False)
    quantize_blocks: Optional[Callable[[torch.Tensor], torch.Tensor]] = field(default=None, repr=False)
    dense: bool = False

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    def row_bytes(self, row_length: int) -> int:
        """Bytes of one packed row of ``row_length`` values; ValueError if not a block multiple."""
        if row_length % self.block_size:
            raise ValueError(
                f"{self.name}: row length {row_length} is not a multiple of the block size {self.block_size}"
            )
        return row_length // self.block_size * self.type_size


FORMATS: dict[str, Format] = {}
_BY_ID: dict[int, Format] = {}


def register(fmt: Format) -> Format:
    """Add a format trait to the registry (called once per format at import)."""
    if fmt.name in FORMATS or fmt.type_id in _BY_ID:
        raise ValueError(f"format {fmt.name} (id {fmt.type_id}) registered twice")
    FORMATS[fmt.name] = fmt
    _BY_ID[fmt.type_id] = fmt
    return fmt


def get_format(qtype: Union[str, int, "Format"]) -> Format:
    """Look a format up by ggml name (``"Q4_K"``), ggml type id (``12``) or enum.

    Raises:
        ValueError: the name or id is not a format hanzo-torch supports.
    """
    if isinstance(qtype, Format):
        return qtype
    if isinstance(qtype, str):
        fmt = FORMATS.get(qtype.upper())
        if fmt is None:
            raise ValueError(f"unknown or unsupported ggml type {qtype!r}; supported: {', '.join(FORMATS)}")
        return fmt
    try:
        key = int(qtype)
    except (TypeError, ValueError):
        raise ValueError(f"not a ggml type: {qtype!r}") from None
    fmt = _BY_ID.get(key)
    if fmt is None:
        raise ValueError(f"unknown or unsupported ggml type id {key}")
    return fmt


def row_bytes(qtype, row_length: int) -> int:
    """Bytes of one packed row of ``row_length`` values of format ``qtype``."""
    return get_format(qtype).row_bytes(row_length)


def dequantize(
    data: torch.Tensor,
    qtype: Union[str, int, Format],
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Unpack ggml blocks into a dense tensor.

    Args:
        data: ``uint8`` tensor of packed blocks (any shape; its bytes are read in order), on
            any device.
        qtype: ggml name or id of the format.
        shape: logical shape in torch order; the last dim is the row length and must be a
            multiple of the format's block size.
        dtype: result dtype (the values are computed in float32 and then cast).

    Returns:
        ``dtype`` tensor of ``shape`` on ``data``'s device, equal to
        ``gguf.quants.dequantize`` (bit for bit in float32).

    Raises:
        ValueError: unknown format, bad row length, or a byte count that does not match.
    """
    fmt = get_format(qtype)
    shape = tuple(int(s) for s in shape)
    if data.dtype != torch.uint8:
        raise ValueError(f"dequantize: packed data must be uint8, got {data.dtype}")
    if len(shape) == 0:
        raise ValueError("dequantize: shape must have at least one dim")
    n_values = math.prod(shape)
    rb = fmt.row_bytes(shape[-1])
    expected = n_values // shape[-1] * rb if shape[-1] else 0
    if data.numel() != expected:
        raise ValueError(
            f"dequantize: {fmt.name} tensor of shape {shape} needs {expected} bytes, got {data.numel()}"
        )
    blocks = data.reshape(-1, fmt.type_size)
    out = fmt.dequantize_blocks(blocks)
    return out.reshape(shape).to(dtype)


def quantize(tensor: torch.Tensor, qtype: Union[str, int, Format]) -> torch.Tensor:
    """Pack a float tensor into ggml blocks of ``qtype``.

    Args:
        tensor: float tensor ``[..., K]``; K a multiple of the block size. Converted to float32
            first, as ``gguf.quants.quantize`` does.
        qtype: target format.

    Returns:
        ``uint8 [..., K // block_size * type_size]`` byte-identical to ``gguf.quants.quantize``.

    Raises:
        NotImplementedError: the format has no quantizer in hanzo-torch.
        ValueError: K is not a multiple of the block size.
    """
    fmt = get_format(qtype)
    if fmt.quantize_blocks is None:
        raise NotImplementedError(f"quantize to {fmt.name} is not implemented in hanzo-torch")
    shape = tuple(tensor.shape)
    rb = fmt.row_bytes(shape[-1])
    blocks = tensor.to(torch.float32).reshape(-1, fmt.block_size)
    out = fmt.quantize_blocks(blocks)
    return out.reshape(*shape[:-1], rb)


# Each module registers its formats at import. Order: dense, legacy, K-quants, i-quants,
# ternary, fp4.
from . import dense, legacy, kquants, iquants, ternary, fp4  # noqa: E402,F401

QUANTIZED_FORMATS = tuple(f.name for f in FORMATS.values() if not f.dense)
