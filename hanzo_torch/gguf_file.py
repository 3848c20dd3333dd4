"""Reading and writing GGUF files with the weights kept packed.

:class:`GGUFFile` memory-maps a GGUF file, parses and validates its header, and exposes

* ``metadata``: the key/value pairs, typed (ints, floats, bools, strs, lists; numeric arrays of
  more than :data:`TENSOR_ARRAY_MIN` values as 1-D torch tensors), decoded lazily;
* ``tensor_info``: name -> :class:`GGUFTensorInfo` (ggml type, torch-order shape, file offset,
  byte count), for inspection without touching tensor data;
* ``tensors``: name -> :class:`~hanzo_torch.GGUFTensor` whose ``packed`` is a zero-copy
  ``uint8 (*shape[:-1], row_bytes)`` view of the mapping (docs/ARCHITECTURE.md, "Packed data
  convention"); stacked expert weights are ``(E, N, row_bytes)``.

:func:`save_gguf` writes tensors and metadata through ``gguf.GGUFWriter``.

File layout (GGUF v2/v3, little-endian; ``ggml/docs/gguf.md`` and ``gguf.constants``)::

    u32 magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x        (string key, u32 value type, value)
    n_tensors x   (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset)
    padding to ``general.alignment`` (default 32), then the tensor data section; each tensor's
    offset is relative to the start of that section and a multiple of the alignment.
    string = u64 length + UTF-8 bytes; array = u32 element type + u64 count + elements.

``ne[0]`` is the row length (innermost, contiguous), so the torch shape is ``ne`` reversed.

Why not ``gguf.GGUFReader``: it builds one numpy view per array element, so opening a model
with a 152k-entry vocabulary took 15-37 s against ~0.1 s here (Qwen2.5-Coder-1.5B Q4_K_M on a
shared 2-core machine, ``benchmarks/open_model.py --gguf-reader``), and it trusts the counts in
the header (a corrupted scalar-array count makes it loop up to 2**64 times: 49 of 2000 fuzz
mutants did not finish in 3 s). This module uses the ``gguf`` package's tables (value types, ggml
type ids and block sizes, magic, versions) and its writer, and validates every count, size and
offset against the file size before it reads or creates a view: a bad file raises
:class:`GGUFError`, never a crash, a hang or a read outside the file. ``GGUFReader`` remains the
oracle in the tests.
"""
from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

try:  # the versions gguf's own reader accepts (2 and 3 today)
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS as _SUPPORTED_VERSIONS
except ImportError:  # pragma: no cover - older/newer gguf layouts
    _SUPPORTED_VERSIONS = [2, 3]

__all__ = [
    "DeferredTensor",
    "GGUFError",
    "GGUFFile",
    "GGUFMetadata",
    "GGUFTensorInfo",
    "save_gguf",
    "TENSOR_ARRAY_MIN",
]

PathLike = Union[str, "os.PathLike[str]"]

TENSOR_ARRAY_MIN = 1024
"""Numeric metadata arrays with more elements than this are returned as 1-D torch tensors
(a vocabulary's ``token_type``/``scores``); shorter ones as Python lists. Use
:meth:`GGUFFile.get_list` / :meth:`GGUFFile.get_array` for one representation regardless."""

GGML_MAX_DIMS = 4  # ggml tensors have at most 4 dims (ggml.h GGML_MAX_DIMS)
_MAX_ARRAY_DEPTH = 8  # nesting limit for arrays of arrays (real files use at most 2)

_VT = GGUFValueType
# scalar value type -> (struct format, numpy dtype); BOOL is a byte that must be 0 or 1.
_SCALARS: dict[GGUFValueType, tuple[struct.Struct, np.dtype]] = {
    _VT.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    _VT.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    _VT.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    _VT.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    _VT.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    _VT.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    _VT.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    _VT.BOOL: (struct.Struct("<B"), np.dtype("<u1")),
    _VT.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    _VT.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    _VT.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
_INT_TYPES = {_VT.UINT8, _VT.INT8, _VT.UINT16, _VT.INT16, _VT.UINT32, _VT.INT32, _VT.UINT64, _VT.INT64}
_FLOAT_TYPES = {_VT.FLOAT32, _VT.FLOAT64}
_INT_RANGES = {
    _VT.UINT8: (0, 2**8 - 1),
    _VT.INT8: (-(2**7), 2**7 - 1),
    _VT.UINT16: (0, 2**16 - 1),
    _VT.INT16: (-(2**15), 2**15 - 1),
    _VT.UINT32: (0, 2**32 - 1),
    _VT.INT32: (-(2**31), 2**31 - 1),
    _VT.UINT64: (0, 2**64 - 1),
    _VT.INT64: (-(2**63), 2**63 - 1),
}
# torch dtype of a big numeric array (unsigned types widened where torch's support is thin)
_ARRAY_TORCH = {
    _VT.UINT8: torch.uint8,
    _VT.INT8: torch.int8,
    _VT.UINT16: torch.int32,
    _VT.INT16: torch.int16,
    _VT.UINT32: torch.int64,
    _VT.INT32: torch.int32,
    _VT.FLOAT32: torch.float32,
    _VT.BOOL: torch.bool,
    _VT.UINT64: torch.uint64,
    _VT.INT64: torch.int64,
    _VT.FLOAT64: torch.float64,
}
# smallest encoding of one value of each type, to bound element counts by the bytes left
_MIN_SIZE = {**{t: s.size for t, (s, _) in _SCALARS.items()}, _VT.STRING: 8, _VT.ARRAY: 12}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class GGUFError(ValueError):
    """A GGUF file (or a value asked of it) is malformed; the message names the file and the
    key, tensor or byte offset concerned."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in a GGUF file (read from the header; no data is touched).

    Attributes:
        name: tensor name (``"blk.0.attn_q.weight"``).
        qtype: ggml type name (``"Q4_K"``).
        type_id: ggml type id (``gguf.GGMLQuantizationType`` value).
        shape: logical shape in torch order (the file's ``ne`` reversed): ``(out, in)`` for a
            matrix, ``(E, N, K)`` for stacked experts.
        offset: absolute byte offset of the data in the file.
        nbytes: bytes of packed data.
    """

    name: str
    qtype: str
    type_id: int
    shape: tuple
    offset: int
    nbytes: int

    @property
    def packed_shape(self) -> tuple:
        """``(*shape[:-1], row_bytes)``: the shape of the ``uint8`` packed view."""
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.type_id)]
        return (*self.shape[:-1], self.shape[-1] // block * size)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class _LazyArray:
    """An array value not decoded yet: ``count`` elements of ``elem`` starting at ``offset``."""

    elem: GGUFValueType
    count: int
    offset: int


class GGUFMetadata(Mapping):
    """The key/value metadata of a GGUF file: a read-only mapping ``key -> value``.

    Values: ``int`` (any integer type), ``float`` (FLOAT32/FLOAT64), ``bool``, ``str``,
    ``list`` (arrays; nested arrays as nested lists), or a 1-D ``torch.Tensor`` for numeric
    arrays longer than :data:`TENSOR_ARRAY_MIN`. Arrays are decoded on first access and cached
    (do not mutate them). The file's own value types are kept: :meth:`value_type`,
    :meth:`element_type`; :func:`save_gguf` writes them back unchanged.

    Raises (on access):
        GGUFError: an array holds invalid UTF-8 or a bool byte other than 0/1.
    """

    def __init__(self, path: str, header: bytes, entries: dict[str, tuple[GGUFValueType, Any]]):
        self._path = path
        self._header = header
        self._entries = entries  # key -> (value type, value or _LazyArray)
        self._elem = {k: v.elem for k, (_, v) in entries.items() if isinstance(v, _LazyArray)}

    def __getitem__(self, key: str) -> Any:
        vtype, value = self._entries[key]
        if isinstance(value, _LazyArray):
            value, _ = _decode_array_at(self._path, self._header, key, value.elem, value.count, value.offset, True)
            self._entries[key] = (vtype, value)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __repr__(self) -> str:
        keys = list(self._entries)
        return f"GGUFMetadata({len(keys)} keys: {', '.join(keys[:8])}{', ...' if len(keys) > 8 else ''})"

    def value_type(self, key: str) -> GGUFValueType:
        """The GGUF value type of ``key`` (``GGUFValueType.ARRAY`` for arrays). KeyError if absent."""
        return self._entries[key][0]

    def element_type(self, key: str) -> Optional[GGUFValueType]:
        """The element type of an array value (outermost level), None for scalars. KeyError if absent."""
        if key not in self._entries:
            raise KeyError(key)
        return self._elem.get(key)


def _decode_array_at(path: str, buf: bytes, key: str, elem: GGUFValueType, count: int, off: int, top: bool):
    """Decode an array whose extent was validated at open. Returns (value, end offset)."""
    if elem in _SCALARS:
        dt = _SCALARS[elem][1]
        raw = np.frombuffer(buf, dtype=dt, count=count, offset=off)
        end = off + count * dt.itemsize
        if elem == _VT.BOOL:
            if count and int(raw.max()) > 1:
                raise GGUFError(f"{path}: metadata key {key!r}: bool array holds a byte other than 0/1")
            raw = raw.astype(np.bool_)
        if top and count > TENSOR_ARRAY_MIN:
            if elem in (_VT.UINT16, _VT.UINT32):
                raw = raw.astype(np.int64 if elem == _VT.UINT32 else np.int32)
            return torch.from_numpy(raw.astype(raw.dtype.newbyteorder("="), copy=True)), end
        return raw.tolist(), end
    if elem == _VT.STRING:
        out = [None] * count
        unpack = _U64.unpack_from
        for i in range(count):
            (n,) = unpack(buf, off)
            off += 8
            try:
                out[i] = buf[off : off + n].decode("utf-8")
            except UnicodeDecodeError as e:
                raise GGUFError(f"{path}: metadata key {key!r}: string {i} is not valid UTF-8 ({e.reason})") from None
            off += n
        return out, off
    # arrays of arrays (validated at open: known element types, in bounds, depth-limited)
    out = [None] * count
    for i in range(count):
        (sub,) = _U32.unpack_from(buf, off)
        (n,) = _U64.unpack_from(buf, off + 4)
        out[i], off = _decode_array_at(path, buf, key, _VT(sub), n, off + 12, top=False)
    return out, off


class _Parser:
    """Bounds-checked reads of the header from a buffer of ``size`` bytes."""

    def __init__(self, path: str, buf, size: int):
        self.path = path
        self.buf = buf
        self.size = size

    def fail(self, msg: str) -> GGUFError:
        return GGUFError(f"{self.path}: {msg}")

    def need(self, off: int, n: int, what: str) -> None:
        if off + n > self.size:
            raise self.fail(
                f"truncated file: {what} at byte {off} needs {n} bytes but the file has {self.size}"
            )

    def u32(self, off: int, what: str) -> int:
        self.need(off, 4, what)
        return _U32.unpack_from(self.buf, off)[0]

    def u64(self, off: int, what: str) -> int:
        self.need(off, 8, what)
        return _U64.unpack_from(self.buf, off)[0]

    def string(self, off: int, what: str) -> tuple[str, int]:
        n = self.u64(off, f"{what} (length)")
        self.need(off + 8, n, what)
        try:
            s = self.buf[off + 8 : off + 8 + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason})") from None
        return s, off + 8 + n

    def value_type(self, off: int, what: str) -> GGUFValueType:
        raw = self.u32(off, what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(f"{what}: unknown GGUF value type {raw} at byte {off}") from None

    def scalar(self, off: int, vtype: GGUFValueType, what: str) -> tuple[Any, int]:
        if vtype == _VT.STRING:
            return self.string(off, what)
        st = _SCALARS[vtype][0]
        self.need(off, st.size, what)
        (v,) = st.unpack_from(self.buf, off)
        if vtype == _VT.BOOL:
            if v > 1:
                raise self.fail(f"{what}: bool value byte is {v}, not 0 or 1")
            v = bool(v)
        return v, off + st.size

    def skip_array(self, off: int, elem: GGUFValueType, count: int, depth: int, what: str) -> int:
        """Validate an array's extent without decoding it; return its end offset."""
        if count * _MIN_SIZE[elem] > self.size - off:
            raise self.fail(
                f"{what}: array of {count} {elem.name} values at byte {off} cannot fit in the "
                f"{self.size}-byte file (corrupted count?)"
            )
        if elem in _SCALARS:
            return off + count * _SCALARS[elem][0].size
        if elem == _VT.STRING:
            buf, size, unpack = self.buf, self.size, _U64.unpack_from
            for i in range(count):
                if off + 8 > size:
                    self.need(off, 8, f"{what}[{i}] (length)")
                off += 8 + unpack(buf, off)[0]
                if off > size:
                    raise self.fail(f"truncated file: {what}[{i}] (string) ends at byte {off}, past the end ({size})")
            return off
        if depth >= _MAX_ARRAY_DEPTH:
            raise self.fail(f"{what}: arrays nested more than {_MAX_ARRAY_DEPTH} deep")
        for i in range(count):
            sub = self.value_type(off, f"{what}[{i}] (element type)")
            n = self.u64(off + 4, f"{what}[{i}] (count)")
            off = self.skip_array(off + 12, sub, n, depth + 1, f"{what}[{i}]")
        return off


@dataclass
class _Header:
    version: int
    entries: dict
    infos: dict
    alignment: int
    data_offset: int
    header_end: int


def _parse_header(path: str, buf, size: int) -> _Header:
    p = _Parser(path, buf, size)
    if size == 0:
        raise p.fail("file is empty, not a GGUF file")
    p.need(0, 4, "magic")
    magic = _U32.unpack_from(buf, 0)[0]
    if magic != GGUF_MAGIC:
        raise p.fail(f"not a GGUF file: magic is {bytes(buf[0:4])!r}, expected b'GGUF'")
    version = p.u32(4, "version")
    if version not in _SUPPORTED_VERSIONS:
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        if swapped in _SUPPORTED_VERSIONS:
            raise p.fail(f"big-endian GGUF (version {swapped}) is not supported")
        raise p.fail(f"unsupported GGUF version {version} (supported: {list(_SUPPORTED_VERSIONS)})")
    n_tensors = p.u64(8, "tensor count")
    n_kv = p.u64(16, "metadata key/value count")
    off = 24
    # every key/value needs >= 13 bytes (empty key, u32 type, 1-byte value), every tensor info
    # >= 32 (empty name, 1 dim): bound the counts by the file size before looping on them.
    if n_kv * 13 + n_tensors * 32 > size - off:
        raise p.fail(
            f"header claims {n_kv} metadata keys and {n_tensors} tensors, which cannot fit in "
            f"the {size}-byte file (corrupted counts or truncated file)"
        )

    entries: dict[str, tuple[GGUFValueType, Any]] = {}
    for i in range(n_kv):
        key, off = p.string(off, f"metadata key #{i}")
        if key in entries:
            raise p.fail(f"duplicate metadata key {key!r}")
        what = f"metadata key {key!r}"
        vtype = p.value_type(off, what)
        off += 4
        if vtype == _VT.ARRAY:
            elem = p.value_type(off, f"{what} (array element type)")
            count = p.u64(off + 4, f"{what} (array count)")
            start = off + 12
            off = p.skip_array(start, elem, count, 1, what)
            entries[key] = (vtype, _LazyArray(elem, count, start))
        else:
            value, off = p.scalar(off, vtype, what)
            entries[key] = (vtype, value)

    alignment = GGUF_DEFAULT_ALIGNMENT
    if "general.alignment" in entries:
        vtype, value = entries["general.alignment"]
        if vtype != _VT.UINT32:
            raise p.fail(f"metadata key 'general.alignment' must be UINT32, got {vtype.name}")
        if value == 0 or value & (value - 1):
            raise p.fail(f"general.alignment must be a non-zero power of two, got {value}")
        alignment = value

    raw_infos = []
    names = set()
    for i in range(n_tensors):
        name, off = p.string(off, f"tensor #{i} name")
        what = f"tensor {name!r}"
        if name in names:
            raise p.fail(f"duplicate tensor name {name!r}")
        names.add(name)
        n_dims = p.u32(off, f"{what} (n_dims)")
        off += 4
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise p.fail(f"{what} has {n_dims} dims; GGUF tensors have 1 to {GGML_MAX_DIMS}")
        p.need(off, 8 * n_dims, f"{what} (dims)")
        ne = struct.unpack_from(f"<{n_dims}Q", buf, off)
        off += 8 * n_dims
        type_id = p.u32(off, f"{what} (ggml type)")
        tensor_off = p.u64(off + 4, f"{what} (data offset)")
        off += 12
        raw_infos.append((name, ne, type_id, tensor_off))

    header_end = off
    data_offset = -(-off // alignment) * alignment
    infos: dict[str, GGUFTensorInfo] = {}
    for name, ne, type_id, tensor_off in raw_infos:
        what = f"tensor {name!r}"
        try:
            qt = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[qt]
        except (ValueError, KeyError):
            raise p.fail(f"{what} has unknown ggml type id {type_id}") from None
        # torch (and ggml) index with int64: the element count, counting empty dims as 1 (as
        # strides do), must fit.
        if math.prod(max(d, 1) for d in ne) >= 2**63:
            raise p.fail(f"{what}: dims {list(ne)} overflow a 64-bit element count")
        if ne[0] % block:
            raise p.fail(
                f"{what}: row length {ne[0]} is not a multiple of the {qt.name} block size {block}"
            )
        nbytes = math.prod(ne) // block * type_size
        if tensor_off % alignment:
            raise p.fail(f"{what}: data offset {tensor_off} is not a multiple of the alignment {alignment}")
        start = data_offset + tensor_off
        if start + nbytes > size:
            raise p.fail(
                f"{what}: data [{start}, {start + nbytes}) lies past the end of the file ({size} bytes)"
            )
        infos[name] = GGUFTensorInfo(name, qt.name, int(qt), tuple(reversed(ne)), start, nbytes)
    return _Header(version, entries, infos, alignment, data_offset, header_end)


_MISSING = object()


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


class GGUFFile:
    """A memory-mapped GGUF file.

    Opening parses and validates the header only (no tensor data is read); tensors are
    zero-copy views of a private (copy-on-write) mapping, so writing into one never changes the
    file. Use as a context manager or call :meth:`close`.

    Args:
        path: the ``.gguf`` file.
        dtype: compute dtype given to every :class:`~hanzo_torch.GGUFTensor` in :attr:`tensors`
            (float32 by default).

    Attributes:
        path: the file path (``str``).
        version: GGUF version (2 or 3).
        alignment: data alignment in bytes.
        data_offset: byte offset of the tensor data section.
        metadata: :class:`GGUFMetadata`, ``key -> value``.
        tensor_info: ``dict name -> GGUFTensorInfo`` in file order.

    Raises:
        GGUFError: bad magic, unsupported version (1, big-endian), truncated header, counts or
            lengths that cannot fit in the file, unknown value type or ggml type id, a row
            length that is not a multiple of the block size, a misaligned offset, tensor data
            past the end of the file, duplicate keys or tensor names, invalid UTF-8 in a key,
            name or string value, a bad ``general.alignment``; a path that is not a regular
            file (named pipe, device, directory), refused before any read.
        OSError: the file cannot be opened.
    """

    def __init__(self, path: PathLike, dtype: torch.dtype = torch.float32):
        self.path = os.fspath(path)
        self.dtype = dtype
        self._tensors: Optional[dict] = None
        self._mmap: Optional[mmap.mmap] = None
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever; the
        # type is checked on the opened descriptor, so the file cannot be swapped in between
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise GGUFError(f"{self.path}: not a regular file ({_file_kind(st.st_mode)}); "
                                "a GGUF model must be a regular file")
            size = st.st_size
            if size == 0:
                raise GGUFError(f"{self.path}: file is empty, not a GGUF file")
            self._mmap = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        try:
            hdr = _parse_header(self.path, self._mmap, size)
        except BaseException:
            self.close()
            raise
        self.size = size
        self.version = hdr.version
        self.alignment = hdr.alignment
        self.data_offset = hdr.data_offset
        # lazy metadata decodes from a copy of the header, so it outlives close()
        self.metadata = GGUFMetadata(self.path, self._mmap[: hdr.header_end], hdr.entries)
        self.tensor_info: dict[str, GGUFTensorInfo] = hdr.infos

    # ------------------------------------------------------------------ tensors
    @property
    def raw_tensor_info(self) -> list:
        """The :class:`GGUFTensorInfo` records in file order (same objects as :attr:`tensor_info`)."""
        return list(self.tensor_info.values())

    def packed(self, name: str) -> torch.Tensor:
        """The packed bytes of tensor ``name``: zero-copy ``uint8 (*shape[:-1], row_bytes)`` view.

        Works for every ggml type the ``gguf`` package knows, including ones hanzo-torch cannot
        compute with. Raises KeyError (unknown name), GGUFError (file closed).
        """
        info = self.tensor_info[name]
        if self._mmap is None:
            raise GGUFError(f"{self.path}: file is closed (tensor {name!r})")
        if info.nbytes == 0:
            return torch.empty(info.packed_shape, dtype=torch.uint8)
        arr = np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return torch.from_numpy(arr).view(info.packed_shape)

    @property
    def tensors(self) -> dict:
        """``dict name -> GGUFTensor`` (file order), built on first access; views of the mapping.

        Raises:
            GGUFError: the file is closed, or a tensor's ggml type is not a hanzo-torch format
                (its bytes stay available through :meth:`packed`).
        """
        if self._tensors is None:
            self._tensors = {name: self._make_tensor(info) for name, info in self.tensor_info.items()}
        return self._tensors

    def _make_tensor(self, info: GGUFTensorInfo):
        from .tensor import GGUFTensor

        packed = self.packed(info.name)
        try:
            return GGUFTensor(packed, info.qtype, info.shape, dtype=self.dtype)
        except ValueError as e:
            raise GGUFError(f"{self.path}: tensor {info.name!r} ({info.qtype}): {e}") from None

    # ------------------------------------------------------------------ metadata
    @property
    def architecture(self) -> Optional[str]:
        """``general.architecture`` (e.g. ``"qwen2"``), or None when absent. GGUFError if not a string."""
        return self.get_str("general.architecture", None)

    def _lookup(self, key: str, default: Any) -> Any:
        if key not in self.metadata:
            if default is _MISSING:
                raise GGUFError(f"{self.path}: missing metadata key {key!r}")
            return default
        return self.metadata[key]

    def _wrong(self, key: str, want: str) -> GGUFError:
        vt = self.metadata.value_type(key)
        el = self.metadata.element_type(key)
        got = f"ARRAY of {el.name}" if el is not None else vt.name
        return GGUFError(f"{self.path}: metadata key {key!r} holds {got}, expected {want}")

    def get(self, key: str, default: Any = None) -> Any:
        """``metadata[key]`` or ``default`` (no type check)."""
        return self.metadata[key] if key in self.metadata else default

    def get_int(self, key: str, default: Any = _MISSING) -> int:
        """An integer value (any of the 8 GGUF integer types; not BOOL).

        Raises GGUFError when the key is missing (and no default given) or holds another type."""
        if key in self.metadata and self.metadata.value_type(key) not in _INT_TYPES:
            raise self._wrong(key, "an integer")
        return self._lookup(key, default)

    def get_float(self, key: str, default: Any = _MISSING) -> float:
        """A FLOAT32/FLOAT64 value (integer types are accepted and converted) as ``float``."""
        if key in self.metadata:
            if self.metadata.value_type(key) not in _FLOAT_TYPES | _INT_TYPES:
                raise self._wrong(key, "a float")
            return float(self.metadata[key])
        return self._lookup(key, default)

    def get_bool(self, key: str, default: Any = _MISSING) -> bool:
        """A BOOL value. Raises GGUFError when missing (no default) or of another type."""
        if key in self.metadata and self.metadata.value_type(key) != _VT.BOOL:
            raise self._wrong(key, "a bool")
        return self._lookup(key, default)

    def get_str(self, key: str, default: Any = _MISSING) -> str:
        """A STRING value. Raises GGUFError when missing (no default) or of another type."""
        if key in self.metadata and self.metadata.value_type(key) != _VT.STRING:
            raise self._wrong(key, "a string")
        return self._lookup(key, default)

    def get_list(self, key: str, default: Any = _MISSING) -> list:
        """An ARRAY value as a Python list (a big numeric array's tensor is converted)."""
        if key in self.metadata:
            if self.metadata.value_type(key) != _VT.ARRAY:
                raise self._wrong(key, "an array")
            v = self.metadata[key]
            return v.tolist() if isinstance(v, torch.Tensor) else list(v)
        return self._lookup(key, default)

    def get_array(self, key: str, default: Any = _MISSING) -> torch.Tensor:
        """A numeric or bool ARRAY value as a 1-D tensor (UINT16 -> int32, UINT32 -> int64)."""
        if key in self.metadata:
            el = self.metadata.element_type(key)
            if el is None or el not in _ARRAY_TORCH:
                raise self._wrong(key, "a numeric array")
            v = self.metadata[key]
            return v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=_ARRAY_TORCH[el])
        return self._lookup(key, default)

    def prefetch(self) -> bool:
        """Ask the OS to read the whole file into the page cache in the background
        (``madvise(MADV_WILLNEED)`` on the mapping; llama.cpp does the same at load).

        Pages of the mapping are otherwise read from disk on first touch: the matmul weights are
        all touched by the first forward, but a token embedding row only when that token first
        appears, which costs a disk read (~3 ms measured on a 2-core VM) inside a decode step.
        Returns False (and does nothing) where the platform has no ``madvise`` or the file is
        closed; never raises for an advisory failure.
        """
        mm = self._mmap
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_WILLNEED"):
            return False
        try:
            mm.madvise(mmap.MADV_WILLNEED)
        except (OSError, ValueError):
            return False
        return True

    def _map_address(self) -> Optional[int]:
        """Address of the mapping's first byte; None when closed or empty."""
        mm = self._mmap
        return None if mm is None or len(mm) == 0 else np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data

    def maps(self, t: torch.Tensor) -> bool:
        """Whether CPU tensor ``t``'s first byte lies inside this file's memory mapping (a
        zero-copy view such as :meth:`packed` returns, not a copy). False once the file is closed
        or for an empty mapping."""
        base = self._map_address()
        return base is not None and t.device.type == "cpu" and base <= t.data_ptr() < base + len(self._mmap)

    def advise(self, views, *, willneed: bool = False, release: bool = False) -> None:
        """Page advice for the byte ranges of ``views`` (tensors or GGUFTensors, views of this
        mapping; others are skipped): ``willneed`` reads them ahead (``MADV_WILLNEED``, the pages
        overlapping each range), ``release`` drops the pages wholly inside each range from this
        process's mapping (``MADV_DONTNEED``: for ranges copied out; the page cache keeps them and a
        later touch maps them again). Advisory: a no-op where ``madvise`` is missing or the file is
        closed, never raises for an advisory failure."""
        mm, base = self._mmap, self._map_address()
        if base is None or not hasattr(mm, "madvise"):
            return
        page, size = mmap.PAGESIZE, len(mm)
        todo = ([(getattr(mmap, "MADV_WILLNEED", None), False)] if willneed else []) + \
               ([(getattr(mmap, "MADV_DONTNEED", None), True)] if release else [])
        for option, inward in todo:
            if option is None:
                continue
            for v in views:
                t = getattr(v, "packed", v)
                start = t.data_ptr() - base
                end = start + t.numel() * t.element_size()
                if start < 0 or end > size:
                    continue
                lo = -(-start // page) * page if inward else start // page * page
                hi = end // page * page if inward else min(size, -(-end // page) * page)
                if hi > lo:
                    try:
                        mm.madvise(option, lo, hi - lo)
                    except (OSError, ValueError):
                        pass

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Release the mapping. Tensors already handed out stay valid (they keep it alive);
        metadata stays readable; :attr:`tensors`/:meth:`packed` raise GGUFError afterwards."""
        mm, self._mmap = self._mmap, None
        self._tensors = None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # live views: the mapping is unmapped when the last one is freed

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFFile({self.path!r}, v{self.version}, arch={self.metadata.get('general.architecture')!r}, "
            f"{len(self.metadata)} keys, {len(self.tensor_info)} tensors)"
        )


# ---------------------------------------------------------------------- writing
_TORCH_DENSE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_NP_ELEM = {
    np.dtype(np.uint8): _VT.UINT8,
    np.dtype(np.int8): _VT.INT8,
    np.dtype(np.uint16): _VT.UINT16,
    np.dtype(np.int16): _VT.INT16,
    np.dtype(np.uint32): _VT.UINT32,
    np.dtype(np.int32): _VT.INT32,
    np.dtype(np.float32): _VT.FLOAT32,
    np.dtype(np.bool_): _VT.BOOL,
    np.dtype(np.uint64): _VT.UINT64,
    np.dtype(np.int64): _VT.INT64,
    np.dtype(np.float64): _VT.FLOAT64,
}


def _int_type_for(lo: int, hi: int) -> Optional[GGUFValueType]:
    for t in (_VT.UINT32, _VT.INT32, _VT.UINT64, _VT.INT64):
        a, b = _INT_RANGES[t]
        if a <= lo and hi <= b:
            return t
    return None


def _infer_scalar(v: Any) -> GGUFValueType:
    if isinstance(v, (bool, np.bool_)):
        return _VT.BOOL
    if isinstance(v, np.generic) and v.dtype in _NP_ELEM:
        return _NP_ELEM[v.dtype]
    if isinstance(v, int):
        t = _int_type_for(v, v)
        if t is None:
            raise ValueError(f"integer {v} does not fit in 64 bits")
        return t
    if isinstance(v, float):
        return _VT.FLOAT32
    if isinstance(v, str):
        return _VT.STRING
    if isinstance(v, (list, tuple)):
        return _VT.ARRAY
    raise ValueError(f"cannot store a {type(v).__name__} in GGUF metadata")


def _infer_elem(items: list) -> GGUFValueType:
    kinds = {_infer_scalar(x) for x in items}
    if kinds <= _INT_TYPES:
        t = _int_type_for(min(items), max(items))
        if t is None:
            raise ValueError("integers do not fit in 64 bits")
        return t
    if kinds <= _INT_TYPES | _FLOAT_TYPES:
        return _VT.FLOAT32
    if len(kinds) == 1:
        return kinds.pop()
    raise ValueError(f"array mixes element types {sorted(k.name for k in kinds)}")


def _check_value(v: Any, vtype: GGUFValueType, what: str) -> Any:
    """Validate ``v`` against ``vtype`` and return it in the form GGUFWriter packs."""
    if vtype in _INT_TYPES:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{what}: {vtype.name} needs an int, got {type(v).__name__}")
        lo, hi = _INT_RANGES[vtype]
        if not lo <= int(v) <= hi:
            raise ValueError(f"{what}: {int(v)} out of range for {vtype.name}")
        return int(v)
    if vtype in _FLOAT_TYPES:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise ValueError(f"{what}: {vtype.name} needs a float, got {type(v).__name__}")
        return float(v)
    if vtype == _VT.BOOL:
        if not isinstance(v, (bool, np.bool_)):
            raise ValueError(f"{what}: BOOL needs a bool, got {type(v).__name__}")
        return bool(v)
    if vtype == _VT.STRING:
        if not isinstance(v, str):
            raise ValueError(f"{what}: STRING needs a str, got {type(v).__name__}")
        return v
    raise ValueError(f"{what}: value type {vtype!r} is not a scalar type")


def _metadata_entry(key: str, value: Any, override: Any):
    """-> (value for GGUFWriter, value type, element type or None)."""
    what = f"metadata key {key!r}"
    if isinstance(value, (torch.Tensor, np.ndarray)):
        arr = value.numpy(force=True) if isinstance(value, torch.Tensor) else value
        if arr.ndim != 1:
            raise ValueError(f"{what}: array values must be 1-D, got shape {arr.shape}")
        if override is None and arr.dtype in _NP_ELEM:
            override = (_VT.ARRAY, _NP_ELEM[arr.dtype])
        value = arr.tolist()
    vtype, elem = (override if isinstance(override, tuple) else (override, None))
    if vtype is None:
        vtype = _infer_scalar(value)
    vtype = GGUFValueType(vtype)
    if vtype != _VT.ARRAY:
        return _check_value(value, vtype, what), vtype, None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{what}: ARRAY needs a list, tuple or 1-D tensor, got {type(value).__name__}")
    items = list(value)
    if not items:
        raise ValueError(f"{what}: gguf.GGUFWriter cannot write an empty array")
    if elem is None:
        try:
            elem = _infer_elem(items)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    elem = GGUFValueType(elem)
    if elem == _VT.ARRAY:
        # inner element types are inferred by GGUFWriter (ints as INT32, floats as FLOAT32)
        if not all(isinstance(x, (list, tuple)) and x for x in items):
            raise ValueError(f"{what}: an array of arrays needs non-empty lists as elements")
        return [list(x) for x in items], vtype, elem
    return [_check_value(x, elem, f"{what}[{i}]") for i, x in enumerate(items)], vtype, elem


def _tensor_entry(name: str, t: Any) -> tuple[np.ndarray, GGMLQuantizationType]:
    """-> (uint8 numpy bytes (*rows, row_bytes), ggml type) for GGUFWriter.add_tensor."""
    if hasattr(t, "packed") and hasattr(t, "qtype"):  # GGUFTensor (or anything shaped like it)
        if getattr(t, "transposed", False):
            raise ValueError(f"tensor {name!r}: cannot write a transposed view; write the weight itself")
        packed, qtype = t.packed, t.qtype
        shape = tuple(getattr(t, "logical_shape", t.shape))
    else:
        if isinstance(t, np.ndarray):
            t = torch.from_numpy(t)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensor {name!r}: expected a GGUFTensor or a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _TORCH_DENSE:
            raise ValueError(
                f"tensor {name!r}: plain tensors must be float32/float16/bfloat16 (written as F32/F16/BF16), "
                f"got {t.dtype}"
            )
        if t.dim() == 0:
            raise ValueError(f"tensor {name!r}: a 0-dim tensor has no row; reshape it to (1,)")
        shape, qtype = tuple(t.shape), _TORCH_DENSE[t.dtype]
        packed = t.detach().cpu().contiguous().view(torch.uint8)
    try:
        qt = GGMLQuantizationType[str(qtype).upper()]
    except KeyError:
        raise ValueError(f"tensor {name!r}: unknown ggml type {qtype!r}") from None
    if not 1 <= len(shape) <= GGML_MAX_DIMS:
        raise ValueError(f"tensor {name!r}: GGUF tensors have 1 to {GGML_MAX_DIMS} dims, got shape {shape}")
    block, size = GGML_QUANT_SIZES[qt]
    if shape[-1] % block:
        raise ValueError(f"tensor {name!r}: row length {shape[-1]} is not a multiple of the {qt.name} block size {block}")
    want = (*shape[:-1], shape[-1] // block * size)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != want:
        raise ValueError(
            f"tensor {name!r}: {qt.name} shape {shape} needs packed uint8 {want}, got {packed.dtype} {tuple(packed.shape)}"
        )
    return packed.detach().cpu().contiguous().numpy(), qt


class DeferredTensor:
    """A tensor :func:`save_gguf` asks for only when it writes it, so a file is written one tensor
    at a time (memory bounded by the largest tensor).

    Args:
        shape: torch-order logical shape (elements, not bytes).
        qtype: ggml type name of what ``produce`` returns (``"Q4_K"``, ``"F16"``, ...).
        produce: called once, while writing; returns a :class:`~hanzo_torch.GGUFTensor` or a
            float32/float16/bfloat16 tensor of that shape and type. A mismatch raises ValueError
            (the partial output is removed).
    """

    def __init__(self, shape, qtype: str, produce):
        self.shape = tuple(int(d) for d in shape)
        self.qtype = str(qtype).upper()
        self.produce = produce


class _DeferredBytes:
    """What GGUFWriter writes for a DeferredTensor: ``nbytes`` known up front, the bytes made in
    ``tofile``."""

    def __init__(self, name: str, d: DeferredTensor, nbytes: int):
        self.name, self.d, self.nbytes = name, d, nbytes

    def tofile(self, fout) -> None:
        data, qt = _tensor_entry(self.name, self.d.produce())
        if qt.name != self.d.qtype or data.nbytes != self.nbytes:
            raise ValueError(f"tensor {self.name!r}: deferred as {self.d.qtype} {self.d.shape} ({self.nbytes} bytes), "
                             f"produced {qt.name} with {data.nbytes} bytes")
        data.tofile(fout)


def _deferred_entry(name: str, d: DeferredTensor):
    try:
        qt = GGMLQuantizationType[d.qtype]
    except KeyError:
        raise ValueError(f"tensor {name!r}: unknown ggml type {d.qtype!r}") from None
    shape = d.shape
    if not 1 <= len(shape) <= GGML_MAX_DIMS:
        raise ValueError(f"tensor {name!r}: GGUF tensors have 1 to {GGML_MAX_DIMS} dims, got shape {shape}")
    block, size = GGML_QUANT_SIZES[qt]
    if shape[-1] % block:
        raise ValueError(f"tensor {name!r}: row length {shape[-1]} is not a multiple of the {qt.name} block size {block}")
    byte_shape = (*shape[:-1], shape[-1] // block * size)
    return byte_shape, qt, _DeferredBytes(name, d, int(np.prod(byte_shape)))


def save_gguf(
    path: PathLike,
    tensors: Mapping,
    metadata: Optional[Mapping] = None,
    architecture: Optional[str] = None,
    *,
    metadata_types: Optional[Mapping] = None,
) -> None:
    """Write a GGUF v3 file through ``gguf.GGUFWriter``.

    Args:
        path: output file; written to ``path + ".tmp"`` then renamed, so a failed write never
            leaves a partial file at ``path``.
        tensors: ``name -> tensor`` in file order. A :class:`~hanzo_torch.GGUFTensor` is written
            as its packed bytes with its ggml type (byte for byte); a plain float32/float16/
            bfloat16 tensor (or numpy array) as F32/F16/BF16; a :class:`DeferredTensor` is made
            when its turn to be written comes. Shapes are in torch order.
        metadata: ``key -> value``. Types: bool -> BOOL; int -> UINT32 if it fits, else INT32,
            UINT64, INT64; float -> FLOAT32; str -> STRING; list/tuple/1-D tensor -> ARRAY
            (element type inferred the same way, or from the tensor's dtype). A
            :class:`GGUFMetadata` (``GGUFFile.metadata``) keeps the file's own types.
        architecture: ``general.architecture``; defaults to ``metadata["general.architecture"]``
            (then none is written when both are absent).
        metadata_types: explicit types, ``key -> gguf.GGUFValueType`` or, for arrays,
            ``(GGUFValueType.ARRAY, element GGUFValueType)``; they win over inference.

    Raises:
        ValueError: a value that does not fit its type, an empty array, an unsupported tensor
            dtype, a packed shape that does not match the format, conflicting architectures,
            a bad ``general.alignment``.
    """
    import gguf

    path = os.fspath(path)
    meta = metadata if metadata is not None else {}
    types: dict = {}
    if isinstance(meta, GGUFMetadata):  # keep the file's own value types
        for key in meta:
            vt = meta.value_type(key)
            types[key] = (vt, meta.element_type(key)) if vt == _VT.ARRAY else vt
    types.update(metadata_types or {})

    arch = meta.get("general.architecture") if "general.architecture" in meta else None
    if architecture is not None:
        if arch is not None and arch != architecture:
            raise ValueError(
                f"architecture={architecture!r} conflicts with metadata general.architecture={arch!r}"
            )
        arch = architecture
    if arch is not None and not isinstance(arch, str):
        raise ValueError(f"general.architecture must be a str, got {type(arch).__name__}")

    entries = []
    for key, value in meta.items():
        if not isinstance(key, str):
            raise ValueError(f"metadata keys must be str, got {key!r}")
        if key == "general.architecture":
            continue
        entries.append((key, *_metadata_entry(key, value, types.get(key))))
    prepared = [(name, *(_deferred_entry(name, t) if isinstance(t, DeferredTensor) else _tensor_entry(name, t)))
                for name, t in tensors.items()]

    # GGUFWriter writes general.architecture first unless arch is "" (then it writes none).
    writer = gguf.GGUFWriter(None, arch if arch is not None else "")
    for key, value, vtype, elem in entries:
        if key == "general.alignment":
            if vtype != _VT.UINT32:
                raise ValueError("metadata key 'general.alignment' must be UINT32")
            writer.add_custom_alignment(value)  # ValueError unless a power of two
        else:
            writer.add_key_value(key, value, vtype, sub_type=elem)
    for name, data, qt, *deferred in prepared:
        if deferred:  # data is the byte shape; GGUFWriter calls .tofile on what .tensor holds
            writer.add_tensor_info(name, data, np.dtype(np.uint8), deferred[0].nbytes, raw_dtype=qt)
            writer.tensors[-1][name].tensor = deferred[0]
        else:
            writer.add_tensor(name, data, raw_dtype=qt)

    tmp = path + ".tmp"
    try:
        writer.write_header_to_file(path=Path(tmp))
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
