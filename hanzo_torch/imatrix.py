"""Importance matrices (imatrix files) as llama.cpp's ``llama-imatrix`` writes and ``llama-quantize`` reads them.

An imatrix holds, for every mat-mul weight ``W [N, K]`` of a model, the sum over the tokens of a
calibration text of the squared input activations per input column (``in_sum2``, ``K`` values)
and how many tokens were summed (``counts``); stacked expert weights ``[E, N, K]`` have one row of
sums and one count per expert (only the tokens routed to that expert). Quantizing with it gives
each column the importance weight ``in_sum2 / count`` (:meth:`IMatrix.weights`, what
:func:`hanzo_torch.quantize` takes as ``quant_weights``).

Two file forms, both read here as untrusted input:

* GGUF (what current ``llama-imatrix`` writes, ``tools/imatrix/imatrix.cpp``): ``general.type =
  "imatrix"``, keys ``imatrix.datasets`` (string array), ``imatrix.chunk_count``,
  ``imatrix.chunk_size`` (uint32), and per weight ``<name>.in_sum2`` (F32, torch shape ``[E, K]``)
  and ``<name>.counts`` (F32, ``[E, 1]``), names sorted. Raw sums and counts.
* legacy ``.dat`` (``--output-format dat``): int32 entry count, then per entry int32 name length,
  the name, int32 ``ncall``, int32 value count, the float32 values; then optionally int32 chunk
  count, int32 length and the dataset name. Values are ``sum / count * ncall``.

The weights are computed as ``llama-quantize``'s ``load_imatrix`` (``tools/quantize/quantize.cpp``)
does: GGUF: ``in_sum2 / round(count)`` in float32 per expert, 1 for an expert with count 0;
legacy: ``value / ncall`` (the values as stored when ``ncall`` is 0).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from .gguf_file import GGUFError

__all__ = ["IMatrix", "IMatrixCollector", "IMatrixEntry", "compute_imatrix", "load_imatrix", "save_imatrix",
           "save_imatrix_legacy"]

PathLike = Union[str, os.PathLike]
SUM_SUFFIX = ".in_sum2"
COUNT_SUFFIX = ".counts"
KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"


@dataclass
class IMatrixEntry:
    """One weight's statistics.

    Attributes:
        sums: float32 ``[E, K]``: sums of squared activations per input column (E = 1 for a
            dense weight, the expert count for ``ffn_*_exps``). Legacy files: the stored values
            (``sum / count * ncall``).
        counts: int64 ``[E]``: tokens summed per expert (legacy files: ``[ncall]``).
    """

    sums: torch.Tensor
    counts: torch.Tensor


@dataclass
class IMatrix:
    """An importance matrix: ``entries`` (weight name -> :class:`IMatrixEntry`), the calibration
    ``datasets`` (file names), ``chunk_count`` and ``chunk_size`` (tokens per chunk; 0 in a legacy
    file), whether it came from a ``legacy`` ``.dat`` file, and the ``path`` it was read from
    (empty when built in memory)."""

    entries: dict = field(default_factory=dict)
    datasets: list = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    legacy: bool = False
    path: str = ""

    def weights(self, name: str) -> Optional[torch.Tensor]:
        """The importance weights of weight ``name`` as llama-quantize derives them: float32
        ``[E * K]`` (expert ``e``'s K weights at ``e * K``), or None if the file has no entry.

        GGUF form: ``sums / count`` per expert, all 1 for an expert never routed to; legacy:
        ``sums / ncall``.
        """
        e = self.entries.get(name)
        if e is None:
            return None
        sums = e.sums.to(torch.float32)
        if self.legacy:
            ncall = int(e.counts[0]) if e.counts.numel() else 0
            return (sums / float(ncall) if ncall > 0 else sums.clone()).reshape(-1)
        c = e.counts.to(torch.float32).reshape(-1, 1)
        out = torch.where(c > 0, sums / torch.where(c > 0, c, torch.ones_like(c)), torch.ones_like(sums))
        return out.reshape(-1)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __len__(self) -> int:
        return len(self.entries)


def load_imatrix(path: PathLike) -> IMatrix:
    """Read an imatrix file: GGUF (first bytes ``GGUF``) or the legacy ``.dat`` form.

    Raises:
        FileNotFoundError: no such file.
        GGUFError: a GGUF imatrix that is malformed, lacks ``imatrix.*`` keys (llama-quantize
            refuses those too), has an ``in_sum2`` without its ``counts`` (or the reverse), a
            non-F32 entry, mismatched shapes, negative or non-finite counts, non-finite sums, or
            no entries; the message names the file and the entry.
        ValueError: a legacy file that is truncated or holds impossible sizes (named by entry).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such imatrix file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    m = _load_gguf(path) if magic == b"GGUF" else _load_legacy(path)
    m.path = path
    return m


def _load_gguf(path: str) -> IMatrix:
    from .gguf_file import GGUFFile

    with GGUFFile(path) as f:
        return _read_gguf(path, f)


def _read_gguf(path: str, f) -> IMatrix:
    missing = [k for k in (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE) if k not in f.metadata]
    if missing:
        raise GGUFError(f"{path}: not an imatrix file: metadata key(s) {', '.join(missing)} missing")
    datasets = f.get(KEY_DATASETS)
    if not isinstance(datasets, (list, tuple)) or not all(isinstance(d, str) for d in datasets):
        raise GGUFError(f"{path}: metadata key {KEY_DATASETS!r} must be an array of strings")
    chunk_count, chunk_size = f.get_int(KEY_CHUNK_COUNT), f.get_int(KEY_CHUNK_SIZE)
    pairs: dict = {}
    for tname in f.tensor_info:
        for suffix, slot in ((SUM_SUFFIX, 0), (COUNT_SUFFIX, 1)):
            if tname.endswith(suffix) and len(tname) > len(suffix):
                pairs.setdefault(tname[: -len(suffix)], [None, None])[slot] = tname
    if not pairs:
        raise GGUFError(f"{path}: imatrix has no <weight>.in_sum2 / <weight>.counts tensors")
    entries = {}
    for name in sorted(pairs):
        sname, cname = pairs[name]
        if sname is None or cname is None:
            raise GGUFError(f"{path}: imatrix entry {name!r} has {'counts' if sname is None else 'in_sum2'} "
                            f"but no {'in_sum2' if sname is None else 'counts'} tensor")
        si, ci = f.tensor_info[sname], f.tensor_info[cname]
        for info in (si, ci):
            if info.qtype != "F32":
                raise GGUFError(f"{path}: imatrix tensor {info.name!r} is {info.qtype}, expected F32")
        if len(si.shape) > 2 or len(ci.shape) > 2:
            raise GGUFError(f"{path}: imatrix entry {name!r}: in_sum2 {list(si.shape)} / counts {list(ci.shape)} "
                            f"must be 1-D or 2-D")
        n_mat = ci.n_elements
        if n_mat < 1 or si.n_elements % n_mat or si.n_elements == 0:
            raise GGUFError(f"{path}: imatrix entry {name!r}: {si.n_elements} sums do not split into "
                            f"{n_mat} experts")
        sums = f.packed(sname).reshape(-1).view(torch.float32).reshape(n_mat, -1).clone()
        counts_f = f.packed(cname).reshape(-1).view(torch.float32).clone()
        if not bool(torch.isfinite(sums).all()):
            raise GGUFError(f"{path}: imatrix entry {name!r}: in_sum2 holds non-finite values")
        if not bool(torch.isfinite(counts_f).all()) or bool((counts_f < 0).any()):
            raise GGUFError(f"{path}: imatrix entry {name!r}: counts must be finite and >= 0, got "
                            f"{counts_f.tolist()[:8]}")
        # llama.cpp reads counts with std::lround (halves away from zero); counts are >= 0 here
        counts = torch.floor(counts_f.double() + 0.5).to(torch.int64)
        entries[name] = IMatrixEntry(sums, counts)
    return IMatrix(entries, list(datasets), chunk_count, chunk_size, legacy=False)


class _Reader:
    def __init__(self, path: str, buf: bytes):
        self.path, self.buf, self.off = path, buf, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.off + n > len(self.buf):
            raise ValueError(f"{self.path}: legacy imatrix truncated reading {what} at byte {self.off} "
                             f"(needs {n}, file has {len(self.buf)})")
        b = self.buf[self.off:self.off + n]
        self.off += n
        return b

    def i32(self, what: str) -> int:
        return struct.unpack("<i", self.take(4, what))[0]


def _load_legacy(path: str) -> IMatrix:
    with open(path, "rb") as fh:
        buf = fh.read()
    r = _Reader(path, buf)
    n = r.i32("the entry count")
    if n < 1:
        raise ValueError(f"{path}: not an imatrix file (GGUF or legacy .dat): entry count {n}")
    # every entry needs at least 16 bytes: a bound before allocating anything
    if n > len(buf) // 16:
        raise ValueError(f"{path}: legacy imatrix claims {n} entries in {len(buf)} bytes")
    entries = {}
    for i in range(n):
        ln = r.i32(f"entry {i}'s name length")
        if ln < 1 or ln > 4096:
            raise ValueError(f"{path}: legacy imatrix entry {i}: name length {ln} out of range 1..4096")
        raw = r.take(ln, f"entry {i}'s name")
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{path}: legacy imatrix entry {i}: name is not valid UTF-8") from None
        ncall = r.i32(f"entry {name!r}'s ncall")
        nval = r.i32(f"entry {name!r}'s value count")
        if nval < 1:
            raise ValueError(f"{path}: legacy imatrix entry {name!r}: value count {nval} < 1")
        if ncall < 0:
            raise ValueError(f"{path}: legacy imatrix entry {name!r}: ncall {ncall} < 0")
        data = r.take(4 * nval, f"entry {name!r}'s {nval} values")
        sums = torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(1, nval)
        if not bool(torch.isfinite(sums).all()):
            raise ValueError(f"{path}: legacy imatrix entry {name!r} holds non-finite values")
        if name in entries:
            raise ValueError(f"{path}: legacy imatrix entry {name!r} appears twice")
        entries[name] = IMatrixEntry(sums, torch.tensor([ncall], dtype=torch.int64))
    chunk_count, datasets = 0, []
    if r.off < len(buf):  # optional trailer: chunk count, dataset name
        chunk_count = r.i32("the chunk count")
        if r.off + 4 <= len(buf):
            ln = r.i32("the dataset name length")
            if ln > 0:
                datasets.append(r.take(ln, "the dataset name").decode("utf-8", errors="replace"))
    return IMatrix(entries, datasets, chunk_count, 0, legacy=True)


def save_imatrix(path: PathLike, imatrix: IMatrix) -> None:
    """Write ``imatrix`` in llama-imatrix's GGUF form (raw sums and counts, entries sorted by name).

    Raises:
        ValueError: a legacy-form matrix (its values are not raw sums), an entry whose sums are
            not 2-D ``[E, K]`` with E equal to its count length, non-finite sums, or no entries.
    """
    from .gguf_file import save_gguf

    if imatrix.legacy:
        raise ValueError("save_imatrix writes raw sums: convert a legacy matrix first (llama-imatrix --in-file)")
    if not imatrix.entries:
        raise ValueError(f"{os.fspath(path)}: an imatrix needs at least one entry")
    tensors = {}
    for name in sorted(imatrix.entries):
        e = imatrix.entries[name]
        sums = torch.as_tensor(e.sums, dtype=torch.float32)
        counts = torch.as_tensor(e.counts).reshape(-1)
        if sums.dim() != 2 or sums.shape[0] != counts.numel():
            raise ValueError(f"imatrix entry {name!r}: sums {list(sums.shape)} and counts {list(counts.shape)} "
                             f"must be [E, K] and [E]")
        if not bool(torch.isfinite(sums).all()):
            raise ValueError(f"imatrix entry {name!r}: non-finite sums")
        # ggml drops trailing unit dimensions: a dense entry's tensors are 1-D
        n_mat = counts.numel()
        tensors[name + SUM_SUFFIX] = (sums.reshape(-1) if n_mat == 1 else sums).contiguous()
        tensors[name + COUNT_SUFFIX] = counts.to(torch.float32).reshape((1,) if n_mat == 1 else (n_mat, 1))
    import gguf
    vt = gguf.GGUFValueType
    meta = {"general.type": "imatrix", KEY_DATASETS: list(imatrix.datasets) or [""],
            KEY_CHUNK_COUNT: int(imatrix.chunk_count), KEY_CHUNK_SIZE: int(imatrix.chunk_size)}
    types = {KEY_DATASETS: (vt.ARRAY, vt.STRING), KEY_CHUNK_COUNT: vt.UINT32, KEY_CHUNK_SIZE: vt.UINT32}
    save_gguf(path, tensors, meta, metadata_types=types)


def save_imatrix_legacy(path: PathLike, imatrix: IMatrix) -> None:
    """Write ``imatrix`` (raw sums) in llama-imatrix's legacy ``.dat`` form
    (``--output-format dat``): per entry ``sum / count * ncall`` with ``ncall`` the chunks
    covered (rounded up), 1 for an expert without data; entries without any data are left out.

    Raises:
        ValueError: a legacy-form matrix, or ``chunk_size`` not positive.
    """
    if imatrix.legacy:
        raise ValueError("save_imatrix_legacy writes from raw sums; this matrix is already in the legacy form")
    cs = int(imatrix.chunk_size)
    if cs <= 0:
        raise ValueError(f"chunk_size must be > 0 to write the legacy form, got {cs}")
    names = sorted(n for n, e in imatrix.entries.items() if bool((torch.as_tensor(e.counts) > 0).any()))
    out = [struct.pack("<i", len(names))]
    for name in names:
        e = imatrix.entries[name]
        counts = torch.as_tensor(e.counts).reshape(-1).to(torch.int64)
        sums = torch.as_tensor(e.sums, dtype=torch.float32).reshape(counts.numel(), -1)
        ncall = (int(counts.max()) + cs - 1) // cs
        c = counts.to(torch.float32).reshape(-1, 1)
        vals = torch.where(c == 0, torch.ones_like(sums), sums / torch.where(c == 0, torch.ones_like(c), c)) * float(ncall)
        nb = name.encode()
        out += [struct.pack("<i", len(nb)), nb, struct.pack("<ii", ncall, vals.numel()),
                vals.reshape(-1).numpy().astype("<f4").tobytes()]
    ds = (imatrix.datasets[-1] if imatrix.datasets else "").encode()
    out += [struct.pack("<ii", int(imatrix.chunk_count), len(ds)), ds]
    path = os.fspath(path)
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(b"".join(out))
    os.replace(tmp, path)


# ------------------------------------------------------------------------- collection
MIN_DENSE_ROWS = 16
"""llama-imatrix skips a dense mat-mul of fewer input rows (tokens) than this."""


class IMatrixCollector:
    """Sums of squared activations per input column, and counts, for every mat-mul weight of a
    :class:`~hanzo_torch.models.qwen.Transformer`, collected by module hooks while it runs.

    Inside ``with IMatrixCollector(model) as c:`` every ``Linear`` / ``PackedLinear`` called as a
    module adds its input rows (forward pre-hooks: the ``hanzo::mul_mat`` input), the fused
    gate/up SwiGLU (``hanzo::swiglu_mul_mat``) adds its one input to both ``ffn_gate`` and
    ``ffn_up``, and ``Experts`` / ``PackedExperts`` (``hanzo::mul_mat_id``) add each token's row to
    each expert it is routed to (``x [T, in]``: the same row to its k experts; ``x [T, k, in]``:
    row ``[t, j]`` to expert ``ids[t, j]``), counting per expert. Names are the GGUF tensor names
    (``blk.3.ffn_up.weight``). As llama-imatrix: dense mat-muls of fewer than
    :data:`MIN_DENSE_ROWS` rows are skipped, only ``blk.*`` weights are kept (and
    ``output.weight`` with ``process_output``, when the file has it: a tied output is
    ``token_embd.weight`` and is never collected). Sums are float32, as llama-imatrix keeps them.

    Raises (on a collected call):
        ValueError: a non-finite activation (naming the weight), as llama-imatrix refuses one.
    """

    def __init__(self, model, process_output: bool = False):
        self.model = model
        self.process_output = process_output
        self.sums: dict = {}
        self.counts: dict = {}
        self._handles: list = []
        self._patched: list = []
        self._quiet = 0

    def _add(self, name: str, rows: torch.Tensor, ids: Optional[torch.Tensor] = None, n_mat: int = 1) -> None:
        k = rows.shape[-1]
        if name not in self.sums:
            self.sums[name] = torch.zeros(n_mat, k, dtype=torch.float32, device=rows.device)
            self.counts[name] = torch.zeros(n_mat, dtype=torch.int64, device=rows.device)
        sq = rows.reshape(-1, k).to(torch.float32).square()
        if ids is None:
            self.sums[name][0] += sq.sum(0)
            self.counts[name][0] += sq.shape[0]
            bad = not bool(torch.isfinite(self.sums[name]).all())
        else:
            idx = ids.reshape(-1).to(device=rows.device, dtype=torch.int64)
            self.sums[name].index_add_(0, idx, sq)
            self.counts[name] += torch.bincount(idx, minlength=n_mat)
            bad = not bool(torch.isfinite(self.sums[name][idx.unique()]).all())
        if bad:
            raise ValueError(f"imatrix: non-finite activations at the input of {name}")

    def _dense_hook(self, name: str):
        def hook(module, args):
            if self._quiet:
                return
            x = args[0]
            if x.numel() // x.shape[-1] >= MIN_DENSE_ROWS:
                self._add(name, x)
        return hook

    def _experts_hook(self, name: str, n_expert: int):
        def hook(module, args):
            x, ids = args[0], args[1]
            rows = x.unsqueeze(1).expand(-1, ids.shape[-1], -1) if x.dim() == 2 else x  # [T, k, in]
            self._add(name, rows, ids, n_mat=n_expert)
        return hook

    def _swiglu(self, gate_mod, gate: str, names: dict):
        cls_swiglu = type(gate_mod).swiglu

        def swiglu(up, x):
            if not self._quiet and x.numel() // x.shape[-1] >= MIN_DENSE_ROWS:
                self._add(gate, x)
                if up in names:
                    self._add(names[up], x)
            self._quiet += 1  # a dense up projection calls the modules: not twice
            try:
                return cls_swiglu(gate_mod, up, x)
            finally:
                self._quiet -= 1
        return swiglu

    def __enter__(self) -> "IMatrixCollector":
        from .models.layers import Experts, Linear

        f = getattr(self.model, "gguf", None)
        has_output = f is not None and "output.weight" in f.tensor_info
        names = {}
        for mname, mod in self.model.named_modules():
            if isinstance(mod, (Linear, Experts)):
                names[mod] = mname + ".weight"
        for mod, name in names.items():
            keep = name.startswith("blk.") or (self.process_output and has_output and name == "output.weight")
            if not keep:
                continue
            if isinstance(mod, Experts):
                hook = self._experts_hook(name, mod.weight.shape[0])
            else:
                hook = self._dense_hook(name)
                if name.endswith(".ffn_gate.weight"):
                    mod.swiglu = self._swiglu(mod, name, names)
                    self._patched.append(mod)
            self._handles.append(mod.register_forward_pre_hook(hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        for mod in self._patched:
            del mod.swiglu
        self._handles, self._patched = [], []

    def result(self, chunk_size: int, datasets: Optional[list] = None) -> IMatrix:
        """The sums and counts so far as an :class:`IMatrix` (``chunk_count``: the largest count
        over ``chunk_size``, as llama-imatrix computes it)."""
        entries = {n: IMatrixEntry(self.sums[n].cpu().clone(), self.counts[n].cpu().clone()) for n in sorted(self.sums)}
        top = max((int(e.counts.max()) for e in entries.values()), default=0)
        return IMatrix(entries, list(datasets or []), top // chunk_size if chunk_size else 0, chunk_size)


def compute_imatrix(model, tokens, n_ctx: int = 512, n_chunks: Optional[int] = None, *, n_batch: int = 2048,
                    n_ubatch: int = 512, process_output: bool = False, dataset: str = "",
                    progress: Optional[Callable[[int, int], None]] = None) -> IMatrix:
    """Run ``model`` over ``tokens`` in chunks as llama-imatrix does and collect its imatrix.

    The tokens are cut into ``min(n_chunks, len // n_ctx)`` chunks of ``n_ctx``; each chunk is a
    fresh sequence (positions from 0), its first token replaced by BOS when the tokenizer adds
    one, fed in batches of ``min(n_batch, n_ctx)`` tokens that the model runs in pieces of
    ``n_ubatch`` (llama.cpp's ``n_ubatch``). Logits are computed only for ``process_output``.

    Args:
        model: a loaded :class:`~hanzo_torch.models.qwen.Transformer`.
        tokens: token ids (a list or a 1-D integer tensor), at least ``2 * n_ctx`` of them
            (llama-imatrix's requirement).
        dataset: the text file's name, stored in ``imatrix.datasets``.
        progress: called with ``(chunk index, n_chunks)`` after each chunk.

    Returns:
        The :class:`IMatrix` (``chunk_size = n_ctx``).

    Raises:
        ValueError: fewer than ``2 * n_ctx`` tokens, ``n_ctx`` above the model's ``max_context``,
            non-positive sizes, or non-finite activations.
    """
    ids = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
    for nm, v in (("n_ctx", n_ctx), ("n_batch", n_batch), ("n_ubatch", n_ubatch)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{nm} must be a positive int, got {v!r}")
    if n_ctx > model.max_context:
        raise ValueError(f"n_ctx {n_ctx} exceeds the model's max_context {model.max_context}")
    if ids.numel() < 2 * n_ctx:
        raise ValueError(f"the text tokenizes to {ids.numel()} tokens; a context of {n_ctx} needs at least {2 * n_ctx}")
    n = ids.numel() // n_ctx
    if n_chunks is not None and n_chunks >= 0:
        n = min(n, n_chunks)
    bos = None
    tok = getattr(model, "_tokenizer", None) or (model.tokenizer if getattr(model, "gguf", None) is not None else None)
    if tok is not None and tok.add_bos_token:
        bos = tok.bos_token_id
    step = min(n_batch, n_ctx)
    saved_ubatch = model.ubatch
    model.ubatch = n_ubatch
    c = IMatrixCollector(model, process_output=process_output)
    try:
        with torch.inference_mode(), c:
            for i in range(n):
                chunk = ids[i * n_ctx:(i + 1) * n_ctx].clone()
                if bos is not None:
                    chunk[0] = bos
                model.reset()
                for j in range(0, n_ctx, step):
                    model(chunk[j:j + step].unsqueeze(0), last_only=not process_output)
                if progress is not None:
                    progress(i + 1, n)
    finally:
        model.ubatch = saved_ubatch
        model.reset()
    return c.result(n_ctx, [dataset] if dataset else [])
