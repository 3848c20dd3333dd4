"""C++ CPU kernels for the quantized ``hanzo`` ops (``csrc/cpu/``).

Importing this package is cheap. :func:`register` (called by :func:`hanzo_torch.backends.activate`
on the first ``hanzo`` op call on a CPU tensor) loads the extension, whose kernels register
themselves on torch's CPU dispatch key (``TORCH_LIBRARY_IMPL`` in csrc/cpu/ops.cpp). The
extension is compiled on first use with ``torch.utils.cpp_extension.load``
(ninja, about 1.5-4 minutes on 2 cores) and cached in ``~/.cache/hanzo-torch/ext/<hash>`` keyed by
a hash of the sources, their folder, the torch version and install folder, and the compiler, so
later processes load it in well under a second. ``python -m hanzo_torch.backends.cpu`` builds it ahead of time.

If no compiler is available or the build fails, one warning is issued and the vectorized-torch
references run instead (the answers are the same up to the documented tolerance).

Kernels (one generic C++ body per contraction, instantiated per format trait and per ISA):
    ``mul_mat``     x is quantized once per op to int8 blocks (scale per weight block size:
                    32 values, 128 for Q1_0, 256 for K-quant style formats; int16 sums per 16), then integer
                    dot products against the weight's unpacked integers. Small M (decode) reads
                    each weight block once per 4 rows; large M (prefill) unpacks weight tiles once
                    into an L1 buffer and runs a register-blocked int8 tile.
    ``mul_mat_id``  the same, per expert, on the rows routed to it (tokens grouped by expert).
    ``get_rows``    per-row dequantization (float32, then cast).
    ``dequantize``  whole-tensor dequantization, parallel over rows (bit-identical to gguf).
    fused ops       rms_norm, add_rms_norm, qk_norm_rope, swiglu, kv_cache_write,
                    qk_norm_rope_kv_write, attention and moe_route (csrc/cpu/fused.cpp, registered
                    by :mod:`.fused`).
Instruction sets, chosen at run time from the CPU: ``avx512`` (AVX-512 VL/BW + VNNI),
``avx2`` (AVX2 + FMA + F16C), ``scalar`` (portable C++). ``avx512-sim`` is the ``avx512`` kernel
source built for AVX2 with SIMDe's portable AVX-512 intrinsics (present when the SIMDe headers,
``simde/x86/avx512.h``, were found at build time): it tests the AVX-512 code on AVX2 CPUs and is
never chosen by default. ``HANZO_CPU_ISA=scalar|avx2|avx512|avx512-sim`` forces one (for tests
and A/B); ``HANZO_MUL_MAT_FALLBACK=1`` etc. select the torch reference.
On ``avx512`` (and ``avx512-sim``) the prefill GEMM runs 512-bit register tiles (``vpdpbusd`` for the 32-value formats,
``vpmaddubsw`` + ``vpdpwssd`` for the 256-value ones); ``HANZO_CPU_GEMM512=0`` (read when the
kernels load) or :func:`set_gemm512` gives that level's 256-bit tiles instead, for A/B runs.
Its decode mat-vec (M = 1) of Q4_K and Q6_K runs 512-bit rows, two 32-value chunks per step, with
the same bits as the 256-bit rows; ``HANZO_CPU_MATVEC512=0`` or :func:`set_matvec512` gives those.
Where the CPU reports GFNI, its Q6_K rows assemble the six-bit values with ``vgf2p8affineqb``
(same bits); ``HANZO_CPU_GFNI=0`` or :func:`set_matvec_gfni` gives shifts and masks instead.
The GEMM of Q4_K and Q6_K (at least 16 activation rows) repacks each weight panel into rows
interleaved 8 at a time (one activation broadcast feeds 8 rows) on every SIMD level, ``avx512``
included (256-bit vectors: 1.6x the 512-bit row tiles on Zen 4); ``HANZO_CPU_REPACK=0`` or
:func:`set_repack` gives the row-by-row tiles (the 512-bit ones on ``avx512``).

Threads: torch's intra-op pool (``torch.set_num_threads``). Each parallel region of the kernels
deals each thread a contiguous range of its tasks (a mat-vec thread streams one run of weight
rows), and a thread done with its own range takes the others' from their back;
``HANZO_CPU_RANGED_TASKS=0`` or :func:`set_ranged_tasks` hands out every task from one shared
counter instead, for A/B runs. An adaptive thread count runs the regions on the calling
thread alone while parallel ones keep coming out slower than that (another process busy on the
cores), probing the pool again now and then. Results are the same bits either way.
``HANZO_CPU_ADAPTIVE_THREADS=0`` (read when the kernels load) or :func:`set_adaptive_threads`
turns it off; :func:`thread_stats` gives its counters.

Graphs: :func:`capture` records a call's hanzo ops (a decode step, through
:class:`hanzo_torch.decode_graphs.DecodeStep`) as a CPU graph of their C++ kernels with the tensors
bound, replayed with no Python, dispatcher or allocation between them (csrc/cpu/graph.h);
``HANZO_CPU_GRAPH=0`` at import (:data:`GRAPHS`) decodes eagerly.

Accuracy: the activation quantization is the only approximation. For one output,
``|y - x @ w| <= sum_k |w_k| * d_k / 2`` plus float32 rounding, where ``d_k`` is the int8
scale (block max / 127) of the block holding ``x_k`` (see tests/test_cpu_kernels.py).
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import warnings
from pathlib import Path
from typing import Optional

import torch

from ... import constants as _constants
from ...formats import FORMATS as _REGISTRY
from . import rules as _rules
from .. import _build
from ..base import Backend, Capture, CaptureRejected, ComputeDefaults

__all__ = ["extension", "available", "isa_levels", "default_isa", "ISA_NAMES", "SUPPORTED_QTYPES",
           "mul_mat", "mul_mat_id", "swiglu_mul_mat", "mul_mat_group", "get_rows", "dequantize", "build",
           "set_adaptive_threads", "adaptive_threads", "thread_stats", "set_gemm512", "gemm512",
           "set_matvec512", "matvec512", "set_matvec_gfni", "matvec_gfni", "set_repack", "repack", "set_ranged_tasks", "ranged_tasks",
           "set_panels", "panels", "set_q6k_planes", "q6k_planes", "panel_bytes", "attach_panels", "set_prefetch_l2", "prefetch_l2", "set_prefetch_act", "prefetch_act",
           "set_prefetch_panels", "prefetch_panels", "set_adaptive_prefetch", "adaptive_prefetch", "set_graph_plans", "graph_plans", "capture",
           "GRAPHS"]

ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512", 3: "avx512-sim"}
_ISA_BY_NAME = {v: k for k, v in ISA_NAMES.items()}
SIMULATED_ISAS = frozenset({3})
"""Levels that emulate another instruction set (for tests): never the default choice."""
SIMDE_HEADER = "simde/x86/avx512.h"

MV_MAX_ROWS = _constants.CPU_MATVEC_MAX_ROWS
"""mul_mat uses the mat-vec kernel up to this many activation rows and the tiled GEMM above it
(:data:`hanzo_torch.constants.CPU_MATVEC_MAX_ROWS`, where the crossover measurement is)."""

# A wheel ships the sources as hanzo_torch/_csrc (setup.py); a checkout has them in csrc/.
_PKG_SRC = Path(__file__).resolve().parents[2] / "_csrc" / "cpu"
_SRC_DIR = _PKG_SRC if _PKG_SRC.is_dir() else Path(__file__).resolve().parents[3] / "csrc" / "cpu"
_SOURCES = ("ops.cpp", "threading.cpp", "isa_scalar.cpp", "isa_avx2.cpp", "isa_avx512.cpp", "isa_avx512_sim.cpp",
            "fused.cpp", "graph.cpp")
_HEADERS = ("hz_api.h", "ggml_blocks.h", "format_list.h", "formats.h", "kernels.h", "kernels_matvec.h", "kernels_panels.h",
            "kernels_gemm.h", "kernels_gemm512.h", "threading.h", "hz_ops.h", "graph.h", "../common/format_lookup.h",
            "../common/hz_constants.h")


SUPPORTED_QTYPES = tuple(n for n in _rules.RULES if n in _REGISTRY) if _SRC_DIR.is_dir() else ()
"""The quantized formats with a C++ kernel (:data:`.rules.RULES`, the list csrc/cpu/format_list.h is
generated from, that the registry holds; empty when installed without the C++ sources); dense
F32/F16/BF16 weights use torch GEMMs."""

_slot = _build.Slot("the C++ CPU kernels", "the torch reference implementations will be used (slower).", "CPU")
"""The extension of this process (``_slot.ext``) or why it could not be built (``_slot.failed``)."""


def _source_hash() -> str:
    h = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        h.update(name.encode())
        h.update((_SRC_DIR / name).read_bytes())
    h.update(torch.__version__.encode())
    h.update(os.environ.get("CXX", "c++").encode())
    # ninja's commands name the source and torch include folders: another checkout or venv of the
    # same sources gets its own build folder (a shared one would rebuild silently on every switch)
    h.update(str(_SRC_DIR).encode())
    h.update(str(Path(torch.__file__).resolve().parent).encode())
    # isa_avx512_sim.cpp builds to a stub without the SIMDe headers: installing them later gets a new build
    h.update(str(_simde_header()).encode())
    return h.hexdigest()[:16]


def _simde_header() -> Optional[Path]:
    """The SIMDe AVX-512 header the compiler would find in its usual folders (``CPATH``,
    ``CPLUS_INCLUDE_PATH``, /usr/local/include, /usr/include), or None."""
    dirs = [d for var in ("CPLUS_INCLUDE_PATH", "CPATH") for d in os.environ.get(var, "").split(os.pathsep) if d]
    for d in dirs + ["/usr/local/include", "/usr/include"]:
        p = Path(d) / SIMDE_HEADER
        if p.is_file():
            return p
    return None


def _install_grids(ext) -> None:
    """Install the registry's large tables (the i-quant grids) into the slots of ggml_blocks.h."""
    from ...formats.codegen import table_slots

    for slot, _, _, table in table_slots():
        ext.set_table(slot, table)


def _check_layouts(ext) -> None:
    """The built kernels cover exactly :data:`SUPPORTED_QTYPES`, with the registry's block sizes."""
    from ...formats import FORMATS

    by_id = {f.type_id: f for f in FORMATS.values()}
    built = {}
    for tid, qk, nbytes in ext.formats():
        fmt = by_id.get(tid)
        if fmt is None:  # a format this gguf does not know: not registered, never dispatched
            continue
        if (fmt.block_size, fmt.type_size) != (qk, nbytes):
            raise RuntimeError(f"csrc/cpu block size of {fmt.name} is {(qk, nbytes)}, the registry says "
                               f"{(fmt.block_size, fmt.type_size)}")
        built[fmt.name] = tid
    if set(built) != set(SUPPORTED_QTYPES):
        raise RuntimeError(f"csrc/cpu kernels cover {sorted(built)}, backends/cpu/rules.py lists {sorted(SUPPORTED_QTYPES)} "
                           "(python -m hanzo_torch.backends.cpu.rules regenerates csrc/cpu/format_list.h)")


def build(verbose: bool = False):
    """Compile (or load from the cache) the extension now and return it.

    Raises:
        RuntimeError: the build failed (the message holds the compiler's reason).
    """
    with _slot.lock:
        if _slot.ext is not None:
            return _slot.ext
        key = _source_hash()
        build_dir = _build.cache_root() / key
        _build.announce(build_dir, "the C++ CPU kernels", "about 1.5-4 minutes on 2 cores", verbose)
        ext = _build.load_extension(build_dir, verbose, name=f"hanzo_cpu_{key}",
                                    sources=[str(_SRC_DIR / s) for s in _SOURCES],
                                    extra_cflags=["-O3", "-fopenmp", "-std=c++17"], extra_ldflags=["-fopenmp"])
        _check_layouts(ext)
        _install_grids(ext)
        _slot.loaded(ext)
    _configure(ext)  # outside the lock: the ISA self-check calls extension()
    return ext


def extension():
    """The compiled extension, building it on first use; None (after one warning) if it cannot be built."""
    return _slot.get(build)


def available() -> bool:
    """True when the extension is (or can be) built."""
    return extension() is not None


def isa_levels() -> list[str]:
    """Names of the instruction sets this CPU can run, e.g. ``["scalar", "avx2", "avx512-sim"]``
    (``avx512-sim`` only when the extension was built with the SIMDe headers; :func:`status` says
    why a level is absent)."""
    ext = extension()
    return [ISA_NAMES[i] for i in ext.supported_isas()] if ext is not None else []


_levels_cache: Optional[list] = None
_missing_cache: dict = {}
_isa_checked: dict = {}


def _self_check(ext, level: int) -> bool:
    """Run every format through ISA ``level`` and the scalar path on random blocks; True if they agree.

    Guards the paths this project's CI cannot run (AVX-512 on a machine without it): a
    miscompiled or wrong path is refused, with a warning, instead of giving wrong answers.
    """
    if level in _isa_checked:
        return _isa_checked[level]
    g = torch.Generator().manual_seed(0)
    ok = True
    for tid, qk, nbytes in ext.formats():
        K = 2 * 256
        w = torch.randint(0, 256, (5, K // qk * nbytes), dtype=torch.uint8, generator=g)
        x = torch.randn(7, K, generator=g)
        for mv in (8, 0):
            a, b = ext.mul_mat(x, w, tid, level, mv), ext.mul_mat(x, w, tid, 0, mv)
            fin = torch.isfinite(a) & torch.isfinite(b)
            tol = 1e-4 * (a.abs() + b.abs())
            if not (torch.equal(torch.isfinite(a), torch.isfinite(b)) and ((a - b).abs() <= tol)[fin].all()):
                ok = False
        ids = torch.arange(5)
        if not torch.equal(ext.get_rows(w, ids, tid, level).nan_to_num(), ext.get_rows(w, ids, tid, 0).nan_to_num()):
            ok = False
    if not ok:
        warnings.warn(f"hanzo_torch: the {ISA_NAMES[level]} CPU kernels disagree with the scalar path on this "
                      "machine; using a lower instruction set", RuntimeWarning, stacklevel=3)
    _isa_checked[level] = ok
    return ok


_FORCED_ISA = os.environ.get("HANZO_CPU_ISA", "").strip().lower()  # read once, at import
_default_level: Optional[int] = None
_ADAPTIVE_VALUES = {"": True, "1": True, "on": True, "true": True, "0": False, "off": False, "false": False}


def _flag_env(name: str, default: bool = True) -> bool:
    """A switch ``name``: 1/on/true or 0/off/false, ``default`` when unset or empty; ValueError otherwise."""
    raw = os.environ.get(name, "")
    value = default if not raw.strip() else _ADAPTIVE_VALUES.get(raw.strip().lower())
    if value is None:
        raise ValueError(f"{name}={raw!r}: expected 0 or 1 (or off/on, false/true)")
    return value


# The kernels' on/off switches read from the environment when they load: (variable, extension
# setter, what the setting governs, its default when unset, empty or malformed).
_SWITCHES = (
    ("HANZO_CPU_ADAPTIVE_THREADS", "set_adaptive_threads", "the adaptive thread count", True),
    ("HANZO_CPU_GEMM512", "set_gemm512", "the 512-bit GEMM", True),
    ("HANZO_CPU_REPACK", "set_repack", "the row-interleaved Q4_K / Q6_K GEMM", True),
    ("HANZO_CPU_RANGED_TASKS", "set_ranged_tasks", "the split into contiguous task ranges", True),
    ("HANZO_CPU_MATVEC512", "set_matvec512", "the 512-bit mat-vec", True),
    ("HANZO_CPU_GFNI", "set_matvec_gfni", "the Q6_K mat-vec's GF2P8AFFINEQB", True),
    ("HANZO_CPU_PANELS", "set_panels", "the mat-vec over row-interleaved panels", True),
    ("HANZO_CPU_Q6K_PLANES", "set_q6k_planes", "the avx2 mat-vec over Q6_K planes", True),
    ("HANZO_CPU_PREFETCH_L2", "set_prefetch_l2", "the mat-vec's prefetch into L2", True),
    ("HANZO_CPU_PREFETCH_ACT", "set_prefetch_act", "the panel mat-vec's activation prefetch", True),
    ("HANZO_CPU_PREFETCH_PANELS", "set_prefetch_panels", "the panel mat-vec's weight prefetch", False),
    ("HANZO_CPU_ADAPTIVE_PREFETCH", "set_adaptive_prefetch", "the row mat-vec's prefetch chosen per weight", True),
    ("HANZO_CPU_GRAPH_PLANS", "set_graph_plans", "the CPU graph's prepared mat-vecs", True),
)


def check_environment() -> None:
    """Raise ValueError when ``HANZO_CPU_ISA`` names no instruction set or one of the switch
    variables (``HANZO_CPU_ADAPTIVE_THREADS``, ``_GEMM512``, ``_REPACK``, ``_RANGED_TASKS``,
    ``_MATVEC512``, ``_GFNI``, ``_PANELS``, ``_Q6K_PLANES``, ``_PREFETCH_L2``, ``_PREFETCH_ACT``, ``_PREFETCH_PANELS``,
    ``_ADAPTIVE_PREFETCH``, ``_GRAPH_PLANS``, ``_GRAPH``) is neither 0 nor 1 (cheap: no build, no CPU probe).

    Called before long work (model load, download) so a typo is reported first.
    """
    if _FORCED_ISA and _FORCED_ISA not in _ISA_BY_NAME:
        raise ValueError(f"HANZO_CPU_ISA={_FORCED_ISA!r}: expected one of {', '.join(_ISA_BY_NAME)}")
    for env, _, _, default in _SWITCHES:
        _flag_env(env, default)
    _flag_env("HANZO_CPU_GRAPH")


def default_isa() -> int:
    """The ISA level the registered kernels use: ``HANZO_CPU_ISA`` (read at import) if set, else the
    best this CPU runs that passes a one-time self-check against the scalar path."""
    global _default_level
    if _default_level is None:
        _default_level = _choose_isa(_FORCED_ISA)
    return _default_level


def _choose_isa(forced: str) -> int:
    global _levels_cache
    ext = extension()
    if _levels_cache is None:
        _levels_cache = list(ext.supported_isas())
        _missing_cache.update(_isa_missing(ext))
    levels = _levels_cache
    forced = forced.strip().lower()
    if forced:
        if forced not in _ISA_BY_NAME:
            raise ValueError(f"HANZO_CPU_ISA={forced!r}: expected one of {', '.join(_ISA_BY_NAME)}")
        level = _ISA_BY_NAME[forced]
        if level not in levels:
            why = _missing_cache.get(forced, "not offered")
            raise ValueError(f"HANZO_CPU_ISA={forced!r}: {why}; this machine runs only {[ISA_NAMES[i] for i in levels]}")
        return level
    for level in sorted(set(levels) - SIMULATED_ISAS, reverse=True):
        if level == 0 or _self_check(ext, level):
            return level
    return 0


def _isa(isa) -> int:
    if isa is None:
        return default_isa()
    if isinstance(isa, str):
        if isa not in _ISA_BY_NAME:
            raise ValueError(f"unknown ISA {isa!r}: expected one of {', '.join(_ISA_BY_NAME)}")
        return _ISA_BY_NAME[isa]
    return int(isa)


_TYPE_IDS: dict = {}


def _type_id(qtype: str) -> int:
    tid = _TYPE_IDS.get(qtype)
    if tid is None:
        from ...formats import get_format

        tid = _TYPE_IDS[qtype] = get_format(qtype).type_id
    return tid


def _reference(name: str):
    from ...ops import quant

    return getattr(quant, f"{name}_reference")


def mul_mat(x: torch.Tensor, w: torch.Tensor, qtype: str, *, isa=None, mv_max_rows: Optional[int] = None) -> torch.Tensor:
    """``x [..., K] @ W^T -> [..., N]`` in ``x.dtype`` with ``W`` = ``w`` (uint8 ``[N, row_bytes]``) packed as ``qtype``.

    ``isa``: None (best for this CPU / ``HANZO_CPU_ISA``), ``"scalar"``, ``"avx2"``, ``"avx512"`` or ``"avx512-sim"``.
    ``mv_max_rows``: activation rows up to which the mat-vec kernel runs (default :data:`MV_MAX_ROWS`).
    Raises RuntimeError (from the C++ checks) on mismatched shapes or an unsupported ISA.
    """
    ext = extension()
    if ext is None:
        return _reference("mul_mat")(x, w, qtype)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    y = ext.mul_mat(x2, w, _type_id(qtype), default_isa() if isa is None else _isa(isa),
                    MV_MAX_ROWS if mv_max_rows is None else int(mv_max_rows))
    if x.dim() != 2:
        y = y.reshape(*x.shape[:-1], w.shape[0])
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def mul_mat_id(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, qtype: str, *, isa=None,
               mv_max_rows: Optional[int] = None) -> torch.Tensor:
    """Indexed mul_mat: ``x [T, K] | [T, k, K]``, ``w uint8 [E, N, row_bytes]``, ``ids int [T, k]`` -> ``[T, k, N]``."""
    ext = extension()
    if ext is None:
        return _reference("mul_mat_id")(x, w, ids, qtype)
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    y = ext.mul_mat_id(x3, w, ids, _type_id(qtype), _isa(isa),
                       MV_MAX_ROWS if mv_max_rows is None else int(mv_max_rows))
    return y.to(x.dtype)


_ROUND_TO = {torch.bfloat16: 1, torch.float16: 2}


def swiglu_mul_mat(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, qtype_gate: str, qtype_up: str, *,
                   isa=None, mv_max_rows: Optional[int] = None) -> torch.Tensor:
    """``silu(x @ Wg^T) * (x @ Wu^T)``: ``x [..., K]``, ``w_gate``/``w_up`` uint8 ``[F, row_bytes]`` -> ``[..., F]``
    in ``x.dtype``. One parallel region: each thread's range of F gets its gate rows, its up rows
    and the SwiGLU epilogue (float32) while they are in cache; x is quantized once per block size.
    Bit-identical to ``swiglu(mul_mat(x, Wg), mul_mat(x, Wu))`` of these kernels: for bf16/f16 x
    the projections are rounded to x.dtype before the epilogue, as the unfused ops round them."""
    ext = extension()
    if ext is None:
        from ...ops.ffn import swiglu_mul_mat_reference

        return swiglu_mul_mat_reference(x, w_gate, w_up, qtype_gate, qtype_up)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    y = ext.swiglu_mul_mat(x2, w_gate, w_up, _type_id(qtype_gate), _type_id(qtype_up),
                           default_isa() if isa is None else _isa(isa),
                           MV_MAX_ROWS if mv_max_rows is None else int(mv_max_rows), _ROUND_TO.get(x.dtype, 0))
    if x.dim() != 2:
        y = y.reshape(*x.shape[:-1], w_gate.shape[0])
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def mul_mat_group(x: torch.Tensor, ws: list, qtypes: list, biases: list, *, isa=None,
                  mv_max_rows: Optional[int] = None) -> list:
    """``[x @ W_i^T (+ b_i)]``: ``x [..., K]`` float32 (or bfloat16/float16 without biases),
    ``ws[i]`` uint8 ``[N_i, row_bytes_i]`` packed as ``qtypes[i]``, ``biases[i]`` float32 ``[N_i]``
    or None -> one ``[..., N_i]`` tensor per weight in ``x.dtype``. x is quantized once per block
    size; a mat-vec runs every weight's rows as the tasks of one parallel region. Bit-identical to
    ``mul_mat(x, W_i) + b_i`` of these kernels. Raises ValueError for a bias beside a non-float32 x
    (``hanzo::mul_mat_group`` gives that case torch's promotion), RuntimeError (C++ checks) on bad
    shapes."""
    if x.dtype != torch.float32 and any(b is not None for b in biases):
        raise ValueError(f"mul_mat_group: biases need float32 x here, got {x.dtype} "
                         "(torch.ops.hanzo.mul_mat_group takes that case)")
    ext = extension()
    if ext is None:
        from ...ops.group import mul_mat_group_reference

        return mul_mat_group_reference(x, ws, qtypes, biases)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    ys = ext.mul_mat_group(x2, list(ws), [_type_id(q) for q in qtypes], list(biases),
                           default_isa() if isa is None else _isa(isa),
                           MV_MAX_ROWS if mv_max_rows is None else int(mv_max_rows))
    return [(y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])).to(x.dtype) for y in ys]


def get_rows(w: torch.Tensor, ids: torch.Tensor, qtype: str, dtype: torch.dtype, *, isa=None) -> torch.Tensor:
    """Rows ``ids [...]`` of the packed table ``w uint8 [V, row_bytes]`` -> ``dtype [..., H]``."""
    ext = extension()
    if ext is None:
        return _reference("get_rows")(w, ids, qtype, dtype)
    rows = ext.get_rows(w, ids.reshape(-1), _type_id(qtype), _isa(isa))
    return rows.reshape(*ids.shape, rows.shape[-1]).to(dtype)


def dequantize(data: torch.Tensor, qtype: str, shape, dtype: torch.dtype, *, isa=None) -> torch.Tensor:
    """Packed ``uint8`` blocks -> ``dtype`` tensor of ``shape`` (bit-identical to ``gguf.quants.dequantize``
    in float32). Malformed input is handed to the reference, which raises its ValueError."""
    ext = extension()
    ref = _reference("dequantize")
    shape = tuple(int(v) for v in shape)
    if ext is None or data.dtype != torch.uint8 or not shape or shape[-1] <= 0:
        return ref(data, qtype, shape, dtype)
    from ...formats import get_format

    fmt = get_format(qtype)
    if shape[-1] % fmt.block_size:
        return ref(data, qtype, shape, dtype)
    rows, rb = math.prod(shape[:-1]), fmt.row_bytes(shape[-1])
    if rows == 0 or data.numel() != rows * rb:
        return ref(data, qtype, shape, dtype)
    out = ext.dequantize_rows(data.reshape(rows, rb), fmt.type_id, _isa(isa))
    return out.reshape(shape).to(dtype)


NAME = "cpu"
DEVICE_TYPES = ("cpu",)

GRAPHS = _ADAPTIVE_VALUES.get(os.environ.get("HANZO_CPU_GRAPH", "").strip().lower(), True)
"""Whether decode steps capture and replay a CPU graph (:func:`capture`; ``HANZO_CPU_GRAPH=0`` at
import turns it off, a malformed value leaves it on and :func:`check_environment` reports it;
assign in process for an A/B)."""


def _outputs(out) -> list:
    """The tensors of a captured call's result (a tensor, or a tuple / list / dict of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _outputs(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _outputs(o)]
    return []


def capture(fn, warmup: int = 1):
    """Run ``fn()`` ``warmup`` times, then once more while its hanzo ops are recorded into a CPU
    graph (csrc/cpu/graph.h): the kernels of those ops with their tensors bound, replayed from C++
    with no Python, dispatcher or allocation between them. Returns ``(graph, out)``: ``out`` is
    what the recorded call returned, and ``graph.replay()`` recomputes it in place from the current
    contents of the tensors the call read (the ``[B, 1]`` token and position buffers of a decode
    step). As with a CUDA graph, host decisions of the recorded call (Python branches, shapes, the
    position checks of ``next_positions``) are not redone by a replay.

    Raises:
        RuntimeError: the extension cannot be built.
        CaptureRejected: the call ran, but cannot be replayed (its ``output`` is the call's
            result), with the reason: an op other than a hanzo op, a view or a host read
            (``max``, ``min``, ``item``: the position checks of ``next_positions``) ran (a copy,
            an add, an in-place write), a hanzo op ran its reference or a path without a graph node
            (non-float32 activations, an op with no node such as ``mul_mat_id``), or an output is
            not written by a hanzo op.
    """
    ext = _ext_or_raise()
    register()
    for _ in range(max(0, warmup)):
        fn()
    ext.graph_begin()
    try:
        out = fn()
    except BaseException:
        ext.graph_abort()
        raise
    try:
        return ext.graph_end(_outputs(out)), out
    except RuntimeError as e:
        raise CaptureRejected(str(e), out) from None


def _configure(ext) -> None:
    """Hand the format table and ISA to the kernels registered on the CPU key (reference mode is
    the redirect of :mod:`hanzo_torch.ops._dispatch`, registered in front of them)."""
    from ...formats import FORMATS

    ids = {tid for tid, _, _ in ext.formats()}
    qtypes = {f.name: f.type_id for f in FORMATS.values() if f.type_id in ids}
    lacking = [f.name for f in FORMATS.values() if not f.dense and f.name not in qtypes]
    ext.configure(qtypes, lacking, int(default_isa()), int(MV_MAX_ROWS))
    for env, setter, what, default in _SWITCHES:
        try:
            on = _flag_env(env, default)
        except ValueError as e:  # a typo warns here (check_environment raises it before a model load)
            warnings.warn(f"hanzo_torch: {e}; {what} stays {'on' if default else 'off'}", RuntimeWarning, stacklevel=2)
            on = default
        getattr(ext, setter)(on)


def formats() -> tuple[str, ...]:
    """ggml names of the quantized formats with a C++ kernel (from the extension's own table;
    dense F32/F16/BF16 weights run torch's GEMM)."""
    from ...formats import get_format

    ext = extension()
    if ext is None:
        return ()
    return tuple(get_format(tid).name for tid, _, _ in ext.formats())


def register() -> frozenset:
    """Load the extension (building it once), which registers its kernels on the CPU dispatch key.

    Returns the ops that now have a C++ kernel on CPU (empty if the extension cannot be built).
    """
    ext = extension()
    return frozenset(ext.native_ops()) if ext is not None else frozenset()


def _isa_missing(ext) -> dict:
    """``{name: why}`` for each instruction set of :data:`ISA_NAMES` that this extension does not offer here."""
    have = set(ext.supported_isas())
    out = {}
    for level, name in ISA_NAMES.items():
        if level in have:
            continue
        if not ext.isa_built(level):
            out[name] = (f"built without the SIMDe headers ({SIMDE_HEADER} not found at build time; "
                         "Debian/Ubuntu: apt-get install libsimde-dev)")
        elif level == 2:
            out[name] = "this CPU lacks AVX-512 F/BW/VL/DQ/VNNI"
        else:
            out[name] = "this CPU lacks AVX2/FMA"
    return out


def status() -> dict:
    """``{"available", "reason", "formats", "isa", "isa_levels", "isa_missing"}`` of this backend
    (builds the extension); ``isa_missing`` maps each instruction set not offered here to the reason."""
    ext = extension()
    if ext is None:
        return {"available": False, "reason": _slot.failed or "the C++ extension could not be built", "formats": ()}
    return {"available": True, "reason": None, "formats": formats(), "isa": ISA_NAMES[default_isa()],
            "isa_levels": isa_levels(), "isa_missing": _isa_missing(ext)}


@contextlib.contextmanager
def use_isa(isa: str):
    """Run the registered CPU kernels with instruction set ``isa`` ("scalar", "avx2", "avx512", "avx512-sim") inside the block.

    Raises:
        ValueError: unknown name, or an instruction set this CPU lacks.
        RuntimeError: the extension cannot be built.
    """
    ext = extension()
    if ext is None:
        raise RuntimeError(f"the C++ CPU kernels are not available: {_slot.failed}")
    level = _isa(isa)
    if level not in ext.supported_isas():
        raise ValueError(f"{isa} is not offered here ({_isa_missing(ext).get(ISA_NAMES.get(level, ''), 'unknown level')}); "
                         f"this machine runs {', '.join(isa_levels())}")
    ext.set_isa(level)
    try:
        yield
    finally:
        ext.set_isa(default_isa())


def _ext_or_raise():
    ext = extension()
    if ext is None:
        raise RuntimeError(f"the C++ CPU kernels are not available: {_slot.failed}")
    return ext


def set_gemm512(enabled: bool) -> None:
    """On the ``avx512`` level, run the prefill GEMM on 512-bit register tiles (True, the default)
    or on that level's 256-bit tiles (False), for A/B runs; other levels ignore it. Results differ
    only in float32 summation order.

    Raises:
        RuntimeError: the extension cannot be built.
    """
    _ext_or_raise().set_gemm512(bool(enabled))


def gemm512() -> bool:
    """Whether the ``avx512`` level's GEMM uses its 512-bit tiles (:func:`set_gemm512`)."""
    return bool(_ext_or_raise().gemm512())


def set_repack(enabled: bool) -> None:
    """Run the prefill GEMM of Q4_K and Q6_K on every SIMD level on weight panels repacked per call
    into rows interleaved 8 at a time, in 256-bit vectors (True, the default; at least 16
    activation rows) or on the level's row-by-row tiles (False: 512-bit ones on ``avx512`` with
    :func:`set_gemm512` on), for A/B runs. The packed
    weights are not changed (the repack is a per-thread panel buffer, no copy of the model).
    Results differ only in float32 summation order. ``HANZO_CPU_REPACK=0`` (read when the kernels
    load) sets False.

    Raises:
        RuntimeError: the extension cannot be built.
    """
    _ext_or_raise().set_repack(bool(enabled))


def repack() -> bool:
    """Whether the Q4_K / Q6_K GEMM runs on row-interleaved panels (:func:`set_repack`)."""
    return bool(_ext_or_raise().repack())


def set_matvec512(enabled: bool) -> None:
    """On the ``avx512`` level, run the one-row mat-vec (decode, M = 1) of Q4_K and Q6_K on
    512-bit rows (True, the default) or on the 256-bit rows of the ``avx2`` level (False), for A/B
    runs; other levels and formats ignore it. The results are the same bits either way.

    Raises:
        RuntimeError: the extension cannot be built.
    """
    _ext_or_raise().set_matvec512(bool(enabled))


def matvec512() -> bool:
    """Whether the ``avx512`` level's Q4_K/Q6_K mat-vec uses its 512-bit rows (:func:`set_matvec512`)."""
    return bool(_ext_or_raise().matvec512())


def set_matvec_gfni(enabled: bool) -> None:
    """On the ``avx512`` level (where the CPU reports GFNI) and on ``avx512-sim``, assemble the
    six-bit values of the 512-bit Q6_K mat-vec rows with ``vgf2p8affineqb`` and a bit select (True,
    the default: two ops per 64 values where shifts and masks take four or five) or with the
    shifts and masks (False), for A/B runs. The results are the same bits either way.

    Raises:
        RuntimeError: the extension cannot be built.
    """
    _ext_or_raise().set_matvec_gfni(bool(enabled))


def matvec_gfni() -> bool:
    """Whether the 512-bit Q6_K mat-vec rows use ``vgf2p8affineqb`` where the CPU has it
    (:func:`set_matvec_gfni`)."""
    return bool(_ext_or_raise().matvec_gfni())


def set_prefetch_act(enabled: bool) -> None:
    """In the Q4_K panel mat-vec of weights with K >= 4096 values per row, prefetch the next
    256-value block's activation (its int8 values) into L1 (True, the default) or not
    (False), for A/B runs. From that K on, one 8-row group's pass over the panels no longer fits
    in a 32 KiB L1 beside the activation, so without it the activation is re-read from L2 for
    every group. Speed only: the results are the same bits. ``HANZO_CPU_PREFETCH_ACT=0`` (read
    when the kernels load) sets False.

    Raises:
        RuntimeError: the extension cannot be built.
    """
    _ext_or_raise().set_prefetch_act(bool(enabled))


def prefetch_act() -> bool:
    """Whether the Q4_K panel mat-vec of K >= 4096 prefetches the activation (:func:`set_prefetch_act`)."""
    return bool(_ext_or_raise().prefetch_act())


def set_prefetch_panels(enabled: bool) -> None:
    """Give the Q4_K panel mat-vec the rows' software prefetch of its weight stream
    (:func:`set_prefetch_l2`; True) or no software prefetch (False, the default), for A/B runs and
    for CPUs whose hardware prefetchers fall behind a panel stream. Each thread reads its panels
    in address order; on Zen 4 dropping the prefetch made a decoded token 10% faster on the
    ``avx2`` level where memory is fast (on ``avx512`` not measured with the prefetch present;
    csrc/cpu/ops.cpp).
    Speed only: the results are the same bits. ``HANZO_CPU_PREFETCH_PANELS=1`` (read when the
    kernels load) sets True.

    Raises:
        RuntimeError: the extension cannot be built.
    """
    _ext_or_raise().set_prefetch_panels(bool(enabled))


def prefetch_panels() -> bool:
    """Whether the Q4_K panel mat-vec prefetches its weights (:func:`set_prefetch_panels`)."""
    return bool(_ext_or_raise().prefetch_panels())


def set_adaptive_prefetch(enabled: bool) -> None:
    """Let the mat-vec of ``mul_mat`` over rows or Q6_K planes (decode, weights without Q4_K
    panels) choose per weight, by its measured time per byte, between the software prefetch that
    :func:`set_prefetch_l2` gives and none (True, the default), or always prefetch (False). Each
    weight's first calls try both, then one call in eight tries the other and the rest take the
    faster (csrc/cpu/ops.cpp, ``PrefetchChoice``). On a Zen 4 box whose memory changes speed from
    minute to minute, the L2 prefetch took 18% less time than none over the Q6_K output matrix
    while the memory was fast and 8% more while it was slow; choosing per weight gave decode 1.024x of no
    prefetch in fast minutes and 0.999x in slow ones, where always prefetching gave 1.021x and
    0.981x. Speed only: the results are the same bits. ``HANZO_CPU_ADAPTIVE_PREFETCH=0`` (read when
    the kernels load) sets False.

    Raises:
        RuntimeError: the extension cannot be built.
    """
    _ext_or_raise().set_adaptive_prefetch(bool(enabled))


def adaptive_prefetch() -> bool:
    """Whether the row mat-vec chooses its software prefetch per weight (:func:`set_adaptive_prefetch`)."""
    return bool(_ext_or_raise().adaptive_prefetch())


def set_graph_plans(enabled: bool) -> None:
    """Let a CPU graph's mat-vec nodes (``mul_mat``, ``mul_mat_group``, ``swiglu_mul_mat``) replay the
    operands they resolved at their first replay (True, the default): the kernels, weight and panel
    addresses, activation buffers and tasks, rebuilt only when the ISA level, row limit, thread
    count, task size, panel switches or registry, or a weight's version counter has changed since
    (csrc/cpu/ops.cpp, ``PlanKey``). False resolves them again at every replay, as an eager call
    does. Between the mat-vecs of a decode step the tensors' metadata is out of cache: resolving
    took 2-7 us per node on a 2-core Zen 4 box, of nodes of 25-60 us for the attention projections.
    Speed only: the results are the same bits. ``HANZO_CPU_GRAPH_PLANS=0`` (read when the kernels
    load) sets False.

    Raises:
        RuntimeError: the extension cannot be built.
    """
    _ext_or_raise().set_graph_plans(bool(enabled))


def graph_plans() -> bool:
    """Whether CPU graph mat-vec nodes replay prepared operands (:func:`set_graph_plans`)."""
    return bool(_ext_or_raise().graph_plans())


def set_panels(enabled: bool) -> None:
    """Run the mat-vec (decode, at most :data:`MV_MAX_ROWS` activation rows) of weights that have
    row-interleaved panels (:func:`attach_panels`) on those panels (True, the default) or on the
    packed rows (False), for A/B runs. The panels give the bits of the interleaved prefill GEMM
    (:func:`set_repack`); the rows differ from them in float32 summation order only.
    ``HANZO_CPU_PANELS=0`` (read when the kernels load) sets False, and :func:`hanzo_torch.load`
    then builds no panels.

    Raises:
        RuntimeError: the extension cannot be built.
    """
    _ext_or_raise().set_panels(bool(enabled))


def panels() -> bool:
    """Whether the mat-vec reads registered panels (:func:`set_panels`)."""
    return bool(_ext_or_raise().panels())


def set_q6k_planes(enabled: bool) -> None:
    """Run the ``avx2`` level's Q6_K mat-vec on the weights' registered planes (True, the default;
    :func:`attach_panels` builds them when ``avx2`` is the level at load) or on the packed rows
    (False), for A/B runs; the Q4_K panels stay as :func:`set_panels` has them. Same bits either
    way. ``HANZO_CPU_Q6K_PLANES=0`` (read when the kernels load) sets False, and
    :func:`hanzo_torch.load` then builds no planes.

    Raises:
        RuntimeError: the extension cannot be built.
    """
    _ext_or_raise().set_q6k_planes(bool(enabled))


def q6k_planes() -> bool:
    """Whether Q6_K mat-vecs read registered planes (:func:`set_q6k_planes`)."""
    return bool(_ext_or_raise().q6k_planes())


def set_prefetch_l2(enabled: bool) -> None:
    """On the SIMD levels (``avx2``, ``avx512``, ``avx512-sim``), prefetch the mat-vec's weight
    stream into L2 only, 8 KiB ahead (True, the default), or into L1, 2 KiB ahead (False), for A/B
    runs; the rows, the Q6_K planes, and the Q4_K panels where :func:`set_prefetch_panels` is on.
    ``mul_mat``'s mat-vec of one weight may run either without prefetch, weight by weight
    (:func:`set_adaptive_prefetch`). Speed only: the results are the same bits. ``HANZO_CPU_PREFETCH_L2=0`` (read when
    the kernels load) sets False. The measurements behind the default are in csrc/cpu/ops.cpp (Zen 4;
    the L1 distance was chosen on Zen 3).

    Raises:
        RuntimeError: the extension cannot be built.
    """
    _ext_or_raise().set_prefetch_l2(bool(enabled))


def prefetch_l2() -> bool:
    """The L2-prefetch setting (:func:`set_prefetch_l2`): whether the SIMD levels' mat-vec
    prefetches its weights into L2 (else into L1)."""
    return bool(_ext_or_raise().prefetch_l2())


def panel_bytes(qtype: str, shape) -> int:
    """Bytes of the panels (the mat-vec's second packing) of a packed weight of ggml type ``qtype``
    and packed shape ``[N, row_bytes]``, or 0 when there are none for it at the level the kernels
    use (:func:`default_isa`) with :func:`set_panels` on: Q4_K with N a multiple of 8 on the ``avx2``
    and ``avx512`` levels (row-interleaved, 1184 bytes per 8 rows and 256 values, 2.8% above the
    rows), Q6_K on the ``avx2`` level with :func:`set_q6k_planes` on (planes, the rows' size).
    Layouts in csrc/cpu/kernels_panels.h. 0 without the extension."""
    ext = extension()
    if (ext is None or qtype not in _REGISTRY or len(shape) != 2 or not ext.panels()
            or not ext.format_has_panels(_type_id(qtype), int(default_isa()))
            or (qtype == "Q6_K" and not ext.q6k_planes())):
        return 0
    return max(0, int(ext.panel_bytes(_type_id(qtype), int(shape[0]), int(shape[1]))))


def attach_panels(weights) -> int:
    """Build the panels of the packed ``weights`` (:class:`~hanzo_torch.GGUFTensor` of a CPU
    model) that have a panel layout at the kernels' level (:func:`panel_bytes`: Q4_K's
    row-interleaved panels, Q6_K's planes on ``avx2``), in one new mapping advised for
    huge pages (:func:`hanzo_torch.host_memory.empty_packed`), and register them with the kernels:
    from then on ``hanzo::mul_mat``, ``swiglu_mul_mat`` and ``mul_mat_group`` of up to
    :data:`MV_MAX_ROWS` activation rows read them instead of the rows. The rows stay as they are (the
    GEMM, ``get_rows``, saving and other devices read them). A registration serves only the same
    data: it lapses when the weight's storage is freed or its rows are written in place (its
    version counter), and the panels are forgotten when the rows tensor is collected.

    Returns the bytes of panels built (0 when none applies or the extension is unavailable).
    """
    import weakref

    from ... import host_memory

    ext = extension()
    if ext is None:
        return 0
    todo = []
    for w in weights:
        n = panel_bytes(w.qtype, tuple(w.packed.shape)) if w.packed.device.type == "cpu" and w.packed.is_contiguous() else 0
        if n and not w.packed.is_inference():
            todo.append((w, n))
    bufs = host_memory.empty_packed([n for _, n in todo])
    for (w, _), buf in zip(todo, bufs):
        tid = _type_id(w.qtype)
        ext.pack_panels(w.packed, tid, buf)
        ext.set_panels_of(w.packed, tid, buf)
        # on the rows tensor, not the parameter: nn.Module._apply swaps parameters, which a weakref forbids
        weakref.finalize(w.packed, ext.drop_panels_at, w.packed.data_ptr())
    return sum(n for _, n in todo)


def set_ranged_tasks(enabled: bool) -> None:
    """Deal the tasks of the kernels' parallel regions as one contiguous range per thread, taken
    from the front, each thread then taking the others' leftovers from their back (True, the
    default), or hand out every task from one shared counter (False), for A/B runs. Results are
    the same bits either way (no kernel's split depends on which thread runs a task).
    ``HANZO_CPU_RANGED_TASKS=0`` (read when the kernels load) sets False.

    Raises:
        RuntimeError: the extension cannot be built.
    """
    _ext_or_raise().set_ranged_tasks(bool(enabled))


def ranged_tasks() -> bool:
    """Whether parallel regions deal contiguous task ranges (:func:`set_ranged_tasks`)."""
    return bool(_ext_or_raise().ranged_tasks())


def set_adaptive_threads(enabled: bool) -> None:
    """Turn the adaptive thread count of the CPU kernels' parallel regions on or off (and reset its
    state). Off: every region uses all of torch's intra-op threads. Results do not depend on it.

    Raises:
        RuntimeError: the extension cannot be built.
    """
    _ext_or_raise().set_adaptive_threads(bool(enabled))


@contextlib.contextmanager
def adaptive_threads(enabled: bool):
    """Run the block with the adaptive thread count on or off, then restore the previous setting."""
    ext = _ext_or_raise()
    before = bool(ext.thread_stats()["enabled"])
    ext.set_adaptive_threads(bool(enabled))
    try:
        yield
    finally:
        ext.set_adaptive_threads(before)


def thread_stats() -> dict:
    """Counters of the CPU kernels' parallel regions since the extension loaded (ints):
    ``regions`` (calls that asked for more than one thread), ``parallel_regions`` (run on the pool),
    ``serial_regions`` (run on the calling thread by the adaptive thread count), ``losses``
    (parallel regions slower than the calling thread's estimate of running them alone), ``holds``
    (switches to serial), ``start_skew_ns`` (summed over parallel regions: the last thread's start
    after the first's) and ``tail_ns`` (summed: the last thread's finish after the first's, the time
    a thread of the region had no task left); state: ``enabled``, ``serial`` (regions held serial
    now), ``hold_ns``.

    Raises:
        RuntimeError: the extension cannot be built.
    """
    return dict(_ext_or_raise().thread_stats())


class CpuBackend(Backend):
    """The contract of the C++ CPU kernels (:mod:`hanzo_torch.backends.base`)."""

    name = NAME
    device_types = DEVICE_TYPES
    dispatch_key = "CPU"
    op_formats = {op: frozenset(SUPPORTED_QTYPES) for op in ("dequantize", "get_rows", "mul_mat", "mul_mat_id",
                                                             "swiglu_mul_mat")}
    defaults = ComputeDefaults(
        torch.float32, "f16",
        "float32 activations: the kernels quantize them to int8 blocks per op and compute in float32, so "
        "bf16 saves no arithmetic and costs accuracy; an f16 KV cache halves the attention's bytes read "
        "(llama.cpp's CPU default too)")
    auto_priority = 0
    distributed = "gloo"
    host_memory = True

    def available(self) -> bool:
        return available()

    def reason(self) -> Optional[str]:
        return None if extension() is not None else (_slot.failed or "the C++ extension could not be built")

    def device_reason(self, device) -> Optional[str]:
        return None  # CPU tensors need no kernels of ours (the references run without them)

    def check_environment(self) -> None:
        check_environment()

    def register(self) -> frozenset:
        return register()

    def status(self) -> dict:
        return status()

    def graphs_supported(self, device) -> bool:
        return GRAPHS and available()

    def capture(self, device, fn, warmup: int) -> Capture:
        # no warm-up: nothing compiles or allocates lazily on the host, and the recorded call is
        # itself an eager run of fn
        graph, out = capture(fn, 0)
        return Capture(graph.replay, out, executed=True)


BACKEND = CpuBackend()
