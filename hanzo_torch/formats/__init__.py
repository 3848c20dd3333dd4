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
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

__all__ = [
    "Format",
    "Field",
    "VEC_DOT_TYPES",
    "register",
    "get_format",
    "FORMATS",
    "QUANTIZED_FORMATS",
    "dequantize",
    "quantize",
    "row_bytes",
]


C_TYPE_BYTES = {"ggml_half": 2, "uint8_t": 1, "int8_t": 1, "uint16_t": 2, "uint32_t": 4, "float": 4}
"""Bytes of each C type a block field may have (ggml's ``ggml_half`` is an IEEE fp16 in a uint16_t)."""

VEC_DOT_TYPES = ("q8_0", "q8_1", "q8_K")
"""ggml's activation block types a weight block is dotted with (``type_traits_cpu.vec_dot_type``)."""


@dataclass(frozen=True)
class Field:
    """One field of a ggml block struct (``ggml-common.h``), e.g. ``uint8_t scales[12]`` of Q4_K.

    Attributes:
        name: the field's name in ggml's struct (``"d"``, ``"qs"``, ``"scales"``).
        ctype: its C element type, a key of :data:`C_TYPE_BYTES`.
        count: array length; 0 for a scalar field.
        offset: byte offset within the block.
        scale: the float scale this field holds, for fields that hold one: ``"f16"``, ``"f32"``,
            ``"bf16"``, ``"e8m0"``, ``"ue4m3"`` (one per element), or ``"f16_iq1m"`` (IQ1_M's fp16
            ``d``, spread over the top nibbles of its four uint16 ``scales`` words); None otherwise.
    """

    name: str
    ctype: str
    count: int
    offset: int
    scale: Optional[str] = None

    @property
    def nbytes(self) -> int:
        return C_TYPE_BYTES[self.ctype] * max(self.count, 1)

    @property
    def bytes(self) -> slice:
        """The field's byte slice within a block."""
        return slice(self.offset, self.offset + self.nbytes)


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
        fields: the block struct, in declaration order (:class:`Field`; offsets add up to
            ``type_size``, checked at registration). Backends read bytes by field name.
        vec_dot_type: ggml's activation block type for dot products with this format
            (``"q8_0"``, ``"q8_1"`` or ``"q8_K"``, as ``ggml-cpu``'s ``vec_dot_type``); None for
            dense formats.
        tables: constant tables of the format, by name (``"grid"``: an i-quant codebook, float32
            ``[entries, width]``; ``"kvalues"``: the levels of a 4-bit code, float32 ``[16]``),
            each a :class:`~hanzo_torch.formats._bits.DeviceTable` read from ``gguf.quants``.
        group_len: values per group that shares one scale and one offset (the grouped form
            ``w = scale * code + offset`` of a kernel); 0 for dense formats.
        quantize_weighted: ``(float32 [rows, K], quant_weights float32 [K]) -> uint8 [rows,
            row_bytes]``, quantization with one importance weight per column (ggml's
            ``quantize_*`` with ``quant_weights``), or None where hanzo-torch has none.
    """

    name: str
    type_id: int
    block_size: int
    type_size: int
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor] = field(repr=False)
    quantize_blocks: Optional[Callable[[torch.Tensor], torch.Tensor]] = field(default=None, repr=False)
    dense: bool = False
    fields: tuple = ()
    vec_dot_type: Optional[str] = None
    tables: Mapping[str, Any] = field(default_factory=dict, repr=False)
    group_len: int = 0
    quantize_weighted: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = field(default=None, repr=False)

    def field(self, name: str) -> Field:
        """The :class:`Field` called ``name``; KeyError naming the format and its fields if none."""
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.name} has no block field {name!r}; fields: {[f.name for f in self.fields]}")

    def offset(self, name: str) -> int:
        """Byte offset of field ``name`` within a block."""
        return self.field(name).offset

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
    _check_trait(fmt)
    FORMATS[fmt.name] = fmt
    _BY_ID[fmt.type_id] = fmt
    return fmt


def _check_trait(fmt: Format) -> None:
    """The consistency checks ggml puts next to each block struct (``static_assert`` sizes)."""
    pos = 0
    for f in fmt.fields:
        if f.ctype not in C_TYPE_BYTES:
            raise ValueError(f"{fmt.name}.{f.name}: unknown C type {f.ctype!r}")
        if f.offset != pos:
            raise ValueError(f"{fmt.name}.{f.name}: offset {f.offset}, expected {pos}")
        pos += f.nbytes
    if fmt.fields and pos != fmt.type_size:
        raise ValueError(f"{fmt.name}: block fields add up to {pos} bytes, type size is {fmt.type_size}")
    if not fmt.dense:
        if not fmt.fields:
            raise ValueError(f"{fmt.name}: a quantized format must declare its block fields")
        if fmt.vec_dot_type not in VEC_DOT_TYPES:
            raise ValueError(f"{fmt.name}: vec_dot_type {fmt.vec_dot_type!r} is not one of {VEC_DOT_TYPES}")
        if fmt.group_len <= 0 or fmt.block_size % fmt.group_len:
            raise ValueError(f"{fmt.name}: group_len {fmt.group_len} does not divide the block size {fmt.block_size}")


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


def quantize(tensor: torch.Tensor, qtype: Union[str, int, Format],
             quant_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pack a float tensor into ggml blocks of ``qtype``.

    Args:
        tensor: float tensor ``[..., K]``; K a multiple of the block size. Converted to float32
            first, as ``gguf.quants.quantize`` does.
        qtype: target format.
        quant_weights: optional importance weights, float ``[K]`` (one per column, shared by all
            rows: llama-quantize's per-tensor imatrix entry, see :mod:`hanzo_torch.imatrix`);
            formats with a ``quantize_weighted`` only (Q2_K..Q6_K, Q4_0..Q5_1, IQ4_NL, IQ4_XS,
            IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M); required for IQ2_XXS, IQ2_XS
            and IQ1_S, as in ggml (``ggml_quantize_requires_imatrix``).

    Returns:
        ``uint8 [..., K // block_size * type_size]`` byte-identical to ``gguf.quants.quantize``;
        for Q2_K..Q6_K, IQ4_NL, IQ4_XS and the codebook i-quants above (which gguf cannot
        quantize) to ggml's ``ggml_quantize_chunk`` with the same ``quant_weights`` (see
        :mod:`hanzo_torch.formats.kquant_search`, :mod:`hanzo_torch.formats.iq4_search`).

    Raises:
        NotImplementedError: the format has no quantizer in hanzo-torch (NVFP4, Q1_0; with
            ``quant_weights``: no importance-weighted one; K-quants with weights and
            the codebook i-quants also when the C kernel is unavailable).
        ValueError: K is not a multiple of the block size; a non-finite value (K-quants, IQ4,
            codebook i-quants); ``quant_weights`` not of shape ``[K]`` or not finite, or missing
            for IQ2_XXS / IQ2_XS / IQ1_S.
    """
    fmt = get_format(qtype)
    shape = tuple(tensor.shape)
    if quant_weights is not None:
        if fmt.quantize_weighted is None:
            raise NotImplementedError(f"quantize to {fmt.name} with quant_weights (an importance matrix) "
                                      f"is not implemented in hanzo-torch")
        rb = fmt.row_bytes(shape[-1]) if shape else fmt.row_bytes(0)
        out = fmt.quantize_weighted(tensor.to(torch.float32).reshape(-1, shape[-1]), quant_weights)
        return out.reshape(*shape[:-1], rb)
    if fmt.quantize_blocks is None:
        raise NotImplementedError(f"quantize to {fmt.name} is not implemented in hanzo-torch")
    rb = fmt.row_bytes(shape[-1])
    blocks = tensor.to(torch.float32).reshape(-1, fmt.block_size)
    out = fmt.quantize_blocks(blocks)
    return out.reshape(*shape[:-1], rb)


# Each module registers its formats at import. Order: dense, legacy, K-quants, i-quants,
# ternary, fp4, binary.
from . import dense, legacy, kquants, iquants, ternary, fp4, binary  # noqa: E402,F401

QUANTIZED_FORMATS = tuple(f.name for f in FORMATS.values() if not f.dense)
