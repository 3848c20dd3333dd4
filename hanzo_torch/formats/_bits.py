"""Block-level helpers shared by every format module: the one place for generic byte and bit work.

The format modules (``dense``, ``legacy``, ``kquants``, ``iquants``, ``ternary``, ``fp4``,
``q8_1``) hold only their own block layouts and maths; everything that is not about one format
lives here:

* building and checking: :func:`make_format` (id and sizes read from ``gguf``),
  :func:`block_layout` (typed fields -> a :class:`Layout` of byte slices and
  :class:`~hanzo_torch.formats.Field` s, checked against gguf's type size), the field types
  :func:`half`, :func:`u8`, :func:`i8`, :func:`u16`, :func:`u32`, :func:`f32`,
  :func:`check_blocks` (``uint8 [n, type_size]`` arguments), :func:`check_values`
  (``[n, block_size]`` quantizer arguments);
* bytes and words: :func:`view_bytes_as`, :func:`le_bytes`, :func:`le_u16`, :func:`le_u32`;
* floats: :func:`fp16_field`, :func:`half_bits_to_f32` (read), :func:`fp16_bytes` (write), all
  exactly as ``gguf.quants`` (numpy) does;
* bit fields: :func:`unpack_bits` / :func:`pack_bits` (ggml's bit-plane order of packed quants),
  :func:`split_bits` (fields of multi-byte words), :func:`signs_from_bits`;
* rounding as ggml's C references and gguf's numpy: :func:`round_half_away` (C ``roundf``),
  :func:`float_const`, :func:`safe_reciprocal`, :func:`signed_absmax`,
  :func:`codes_from_float`, :func:`round_codes`;
* constant tables: :class:`DeviceTable`, :func:`table_from_gguf`, :func:`lookup`.

Every function is vectorized torch, runs on any device (``meta`` included: no data-dependent
host step) and makes no host-to-device copy per call. All byte reinterpretation assumes a
little-endian host, as ggml files are little-endian.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import Field, Format

__all__ = [
    # building and checking
    "make_format", "block_layout", "Layout", "check_blocks", "check_values",
    "half", "u8", "i8", "u16", "u32", "f32",
    # bytes and words
    "view_bytes_as", "le_bytes", "le_u16", "le_u32",
    # floats
    "fp16_field", "half_bits_to_f32", "fp16_bytes",
    # bit fields
    "unpack_bits", "pack_bits", "split_bits", "signs_from_bits",
    # rounding
    "round_half_away", "float_const", "safe_reciprocal", "signed_absmax", "codes_from_float", "round_codes",
    # constant tables
    "DeviceTable", "table_from_gguf", "lookup",
]


def _sizes(name: str) -> tuple[int, int]:
    """``(block_size, type_size)`` of ggml type ``name``, from gguf."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[name]]


# ---------------------------------------------------------------------------------------------
# building and checking
# ---------------------------------------------------------------------------------------------

def make_format(
    name: str,
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor],
    quantize_blocks: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    dense: bool = False,
    *,
    layout: Optional["Layout"] = None,
    vec_dot_type: Optional[str] = None,
    tables: Optional[Mapping[str, "DeviceTable"]] = None,
    group_len: int = 0,
    quantize_weighted: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
) -> Format:
    """A :class:`Format` for ggml type ``name`` with id, block and type size taken from ``gguf``.

    ``layout`` (from :func:`block_layout`) gives the trait's fields; ``vec_dot_type``,
    ``tables`` and ``group_len`` are the trait's attributes of the same names.
    """
    qtype = GGMLQuantizationType[name]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return Format(
        name=name,
        type_id=int(qtype),
        block_size=block_size,
        type_size=type_size,
        dequantize_blocks=dequantize_blocks,
        quantize_blocks=quantize_blocks,
        dense=dense,
        fields=layout.fields if layout is not None else (),
        vec_dot_type=vec_dot_type,
        tables=dict(tables or {}),
        group_len=group_len,
        quantize_weighted=quantize_weighted,
    )


class _FieldType:
    """A field's C type and array length, before its offset is known (see :func:`block_layout`)."""

    def __init__(self, ctype: str, count: int, scale: Optional[str]):
        self.ctype, self.count, self.scale = ctype, count, scale


def half(count: int = 0) -> _FieldType:
    """``ggml_half`` (fp16) field, ``count`` elements (0: a scalar); holds an f16 scale."""
    return _FieldType("ggml_half", count, "f16")


def u8(count: int = 0, scale: Optional[str] = None) -> _FieldType:
    """``uint8_t`` field (``scale``: the kind of one-byte scale it holds, e.g. ``"e8m0"``)."""
    return _FieldType("uint8_t", count, scale)


def i8(count: int = 0) -> _FieldType:
    """``int8_t`` field."""
    return _FieldType("int8_t", count, None)


def u16(count: int = 0, scale: Optional[str] = None) -> _FieldType:
    """``uint16_t`` field (little-endian words)."""
    return _FieldType("uint16_t", count, scale)


def u32(count: int = 0) -> _FieldType:
    """``uint32_t`` field (little-endian words)."""
    return _FieldType("uint32_t", count, None)


def f32(count: int = 0) -> _FieldType:
    """``float`` field; holds an f32 value."""
    return _FieldType("float", count, "f32")


class Layout(dict):
    """Byte slices of a block's fields by name (a ``dict[str, slice]``) plus the typed
    :class:`~hanzo_torch.formats.Field` s in declaration order (``.fields``)."""

    fields: tuple


def block_layout(name: str, **field_types: _FieldType) -> Layout:
    """The fields of one ggml block, in declaration order, as ggml's struct declares them.

    ``block_layout("Q4_0", d=half(), qs=u8(16))`` (``struct block_q4_0 { ggml_half d;
    uint8_t qs[16]; }``) returns a :class:`Layout` equal to ``{"d": slice(0, 2),
    "qs": slice(2, 18)}`` whose ``.fields`` are the typed fields with their offsets.

    Raises:
        AssertionError: the sizes do not add up to ``gguf.GGML_QUANT_SIZES[name][1]`` (a layout
            that disagrees with gguf is a bug in hanzo-torch, caught at import; the size
            assertion ggml puts next to each block struct).
    """
    out, fields, pos = Layout(), [], 0
    for fname, ft in field_types.items():
        f = Field(fname, ft.ctype, ft.count, pos, ft.scale)
        fields.append(f)
        out[fname] = f.bytes
        pos += f.nbytes
    type_size = _sizes(name)[1]
    assert pos == type_size, f"{name}: block fields add up to {pos} bytes, gguf says {type_size}"
    out.fields = tuple(fields)
    return out


def check_blocks(blocks: torch.Tensor, name: str) -> None:
    """Raise ValueError unless ``blocks`` is ``uint8 [n, type_size]`` (type size of ggml type ``name``)."""
    type_size = _sizes(name)[1]
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8:
        raise ValueError(f"{name}: blocks must be a uint8 tensor, got {getattr(blocks, 'dtype', type(blocks))}")
    if blocks.dim() != 2 or blocks.shape[1] != type_size:
        raise ValueError(f"{name}: blocks must have shape [n, {type_size}], got {list(blocks.shape)}")


def check_values(values: torch.Tensor, name: str) -> torch.Tensor:
    """Check a quantizer argument ``[n, block_size]`` of ggml type ``name``; return it as float32.

    Raises:
        ValueError: ``values`` is not a tensor of shape ``[n, block_size]``.
    """
    block_size = _sizes(name)[0]
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{name}: values must be a tensor, got {type(values)}")
    if values.dim() != 2 or values.shape[1] != block_size:
        raise ValueError(f"{name}: values must have shape [n, {block_size}], got {list(values.shape)}")
    return values.to(torch.float32)


# ---------------------------------------------------------------------------------------------
# bytes and words
# ---------------------------------------------------------------------------------------------

def view_bytes_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret the bytes of ``uint8 [n, m]`` as ``dtype [n, m // itemsize]``.

    Copies first when ``x`` is not contiguous or its storage offset is not a multiple of the
    item size (``Tensor.view(dtype)`` refuses those), so any slice of packed data works.
    """
    size = dtype.itemsize
    if not x.is_contiguous() or x.storage_offset() % size:
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(dtype)


def le_bytes(v: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Little-endian bytes of non-negative integers ``v [n, k]`` (< 256**nbytes) -> ``uint8 [n, k*nbytes]``."""
    parts = [((v >> (8 * i)) & 0xFF).to(torch.uint8) for i in range(nbytes)]
    return torch.stack(parts, dim=-1).reshape(v.shape[0], v.shape[1] * nbytes)


def le_u16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian uint16 fields of bytes ``[n, 2m]`` (any int dtype) -> ``int32 [n, m]``."""
    b = b.to(torch.int32)
    return b[:, 0::2] | (b[:, 1::2] << 8)


def le_u32(b: torch.Tensor) -> torch.Tensor:
    """Little-endian uint32 fields of bytes ``[n, 4m]`` (any int dtype) -> ``int64 [n, m]``."""
    b = b.to(torch.int64)
    return b[:, 0::4] | (b[:, 1::4] << 8) | (b[:, 2::4] << 16) | (b[:, 3::4] << 24)


# ---------------------------------------------------------------------------------------------
# floats
# ---------------------------------------------------------------------------------------------

def fp16_field(blocks: torch.Tensor, field: slice) -> torch.Tensor:
    """Read fp16 values stored little-endian at byte slice ``field`` of each block.

    Args:
        blocks: ``uint8 [n, type_size]`` (any strides, any storage offset).
        field: byte slice of even length.

    Returns:
        ``float32 [n, len(field) // 2]``. Every non-NaN value (subnormals and infinities
        included) is exact; NaN stays NaN (its payload is not preserved).
    """
    return view_bytes_as(blocks[:, field], torch.float16).float()


def half_bits_to_f32(bits: torch.Tensor) -> torch.Tensor:
    """IEEE fp16 bit patterns (integers in [0, 65535], any int dtype) -> float32, same shape.

    For fp16 values that a block does not store as two whole bytes (IQ1_M spreads its scale
    over four nibbles).
    """
    bits = bits.to(torch.int32)
    as_int16 = bits - ((bits >> 15) << 16)  # the same 16 bits as a two's-complement value
    return as_int16.to(torch.int16).view(torch.float16).to(torch.float32)


def fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """Round ``float32 [n, k]`` to fp16 and return the bytes ``uint8 [n, 2k]``.

    Byte-identical to numpy's ``x.astype(np.float16)`` (what ``gguf.quants`` uses): round to
    nearest even, overflow to +-inf, subnormals rounded correctly; a NaN keeps its sign and the
    top 10 bits of its payload, turned into ``0x7c01`` if those are all zero (numpy's
    ``npy_floatbits_to_halfbits`` rule; ``torch.to(float16)`` alone would canonicalize NaNs).
    """
    x = x.to(torch.float32)
    bits = x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    n = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    nan_bits = 0x7C00 + ((n & 0x7FFFFF) >> 13)
    nan_bits = torch.where(nan_bits == 0x7C00, nan_bits + 1, nan_bits) | ((n >> 16) & 0x8000)
    bits = torch.where(torch.isnan(x), nan_bits.to(torch.int32), bits)
    return le_bytes(bits, 2)


# ---------------------------------------------------------------------------------------------
# bit fields
# ---------------------------------------------------------------------------------------------

def unpack_bits(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Unpack ``bits``-wide fields from bytes in ggml's bit-plane order.

    The bytes of each row are taken ``group`` at a time; one group of bytes yields
    ``8 // bits`` runs of ``group`` values: first bits ``[0, bits)`` of every byte of the group,
    then bits ``[bits, 2*bits)``, and so on. Examples: Q4_0 ``qs`` is ``unpack_bits(qs, 4, 16)``
    (value j < 16 is the low nibble of byte j, value j + 16 its high nibble); a little-endian
    uint32 bit mask is ``unpack_bits(qh, 1, 1)`` (value j is bit j).

    Args:
        x: ``uint8 [n, L]``, L a multiple of ``group``.
        bits: 1, 2, 4 or 8.
        group: bytes per group.

    Returns:
        ``uint8 [n, L * 8 // bits]`` with values in ``[0, 2**bits)``.
    """
    n, length = x.shape
    mask = (1 << bits) - 1
    xv = x.reshape(n, length // group, 1, group)
    # one scalar shift per bit plane (much faster on CPU than a broadcast tensor of shifts)
    planes = [xv & mask if s == 0 else (xv >> s) & mask for s in range(0, 8, bits)]
    return torch.cat(planes, dim=2).reshape(n, length * 8 // bits)


def pack_bits(q: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Inverse of :func:`unpack_bits`: ``q [n, M]`` integers in ``[0, 2**bits)`` -> ``uint8 [n, M * bits // 8]``."""
    n, m = q.shape
    per_byte = 8 // bits
    qv = q.to(torch.int32).reshape(n, m // (group * per_byte), per_byte, group)
    acc = qv[:, :, 0]
    for k in range(1, per_byte):
        acc = acc | (qv[:, :, k] << (k * bits))
    return acc.to(torch.uint8).reshape(n, m * bits // 8)


_SHIFTS: dict[tuple, torch.Tensor] = {}


def split_bits(x: torch.Tensor, shifts: Sequence[int], mask: int) -> torch.Tensor:
    """Bit fields of integer words: ``(x >> s) & mask`` for each shift, ``[..., m] -> [..., m, k]``.

    For fields of multi-byte words (bytes go through :func:`unpack_bits`). The shift vector is
    cached per (shifts, dtype, device), so no small host-to-device copy happens per call.
    """
    key = (tuple(shifts), x.dtype, x.device)
    sh = _SHIFTS.get(key)
    if sh is None:
        sh = _SHIFTS[key] = torch.tensor(key[0], dtype=x.dtype).to(x.device)
    return (x.unsqueeze(-1) >> sh) & mask


def signs_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Sign bits (0/1 integers) -> float32 +1.0 / -1.0, as gguf's ``np.where(s == 0, 1, -1)``."""
    return 1.0 - 2.0 * bits.to(torch.float32)


# ---------------------------------------------------------------------------------------------
# rounding as ggml's C references and gguf's numpy
# ---------------------------------------------------------------------------------------------

def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, ties away from zero (C ``roundf``), in float32.

    The same operations as gguf's ``np_roundf``: ``sign(x) * (floor(|x|) + floor(2 * frac))``.
    (``torch.round`` rounds ties to even and would differ.)
    """
    a = x.abs()
    fl = torch.floor(a)
    return torch.sign(x) * (fl + torch.floor(2 * (a - fl)))


def float_const(value: float, like: torch.Tensor) -> torch.Tensor:
    """A float32 0-dim tensor holding ``value`` on ``like``'s device (a fill, no host copy).

    Used as a divisor so that ``x / c`` is a true IEEE division on every device (CUDA turns
    division by a Python scalar into a multiplication by its reciprocal, which is not bit-exact).
    """
    return torch.full((), value, dtype=torch.float32, device=like.device)


def safe_reciprocal(d: torch.Tensor) -> torch.Tensor:
    """``d ? 1/d : 0`` elementwise (ggml's ``id``), with a true IEEE division (see :func:`float_const`)."""
    return torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / d)


def signed_absmax(blocks: torch.Tensor) -> torch.Tensor:
    """``[n, 1]``: the value of largest magnitude of each row, with its sign; the first one on ties
    (numpy's ``argmax`` rule, which ``torch.argmax`` shares)."""
    idx = blocks.abs().argmax(dim=-1, keepdim=True)
    return torch.gather(blocks, -1, idx)


def codes_from_float(t: torch.Tensor, lo: int, hi: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Convert whole float32 values to integer codes clipped to ``[lo, hi]``.

    gguf converts with ``astype(np.uint8)`` (or int8), which for the non-finite values that
    appear when a block's scale is a float32 subnormal (1/d overflows) or an input is inf/NaN
    yields 0 on x86; we do the same on every device. Such blocks store d = 0 (or a non-finite
    d) in fp16, so their codes never matter for the decoded values.
    """
    t = torch.where(torch.isfinite(t), t, torch.zeros_like(t))
    return t.clamp(lo, hi).to(dtype)


def round_codes(x: torch.Tensor, d: torch.Tensor, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """Nearest-integer codes of ``x`` on the scale ``d``: ``roundf(x * (d ? 1/d : 0))`` clipped to ``[lo, hi]``.

    The rounding of ggml's reference quantizers with a symmetric scale (``quantize_row_q8_0_ref``,
    ``quantize_row_q8_1_ref``, TQ1_0/TQ2_0) and of their numpy versions in ``gguf.quants``.

    Args:
        x: float32 ``[n, k]``.
        d: float32 ``[n, 1]``, the per-row scale.
        lo, hi: the code range; dtype: the integer dtype of the result.

    Returns:
        ``dtype [n, k]``; non-finite products become 0 (see :func:`codes_from_float`).
    """
    return codes_from_float(round_half_away(x * safe_reciprocal(d)), lo, hi, dtype)


# ---------------------------------------------------------------------------------------------
# constant tables
# ---------------------------------------------------------------------------------------------

class DeviceTable:
    """A constant lookup table built once on the CPU and copied to each device on first use.

    ``table.on(device)`` returns the tensor on ``device``; later calls return the cached copy,
    so steady-state dequantization makes no host-to-device transfer.
    """

    def __init__(self, cpu_tensor: torch.Tensor):
        self.cpu = cpu_tensor.contiguous()
        self._by_device: dict[torch.device, torch.Tensor] = {self.cpu.device: self.cpu}

    def on(self, device: torch.device) -> torch.Tensor:
        t = self._by_device.get(device)
        if t is None:
            t = self._by_device[device] = self.cpu.to(device)
        return t


def table_from_gguf(values, dtype: torch.dtype) -> DeviceTable:
    """A :class:`DeviceTable` of ``dtype`` from a table kept by ``gguf`` (numpy array or tuple)."""
    return DeviceTable(torch.from_numpy(np.array(values, copy=True)).to(dtype))


def lookup(table: DeviceTable, idx: torch.Tensor) -> torch.Tensor:
    """``table[idx]`` on ``idx``'s device (``idx`` of any int dtype): shape ``idx.shape + table.shape[1:]``."""
    return table.on(idx.device)[idx.to(torch.int64)]
