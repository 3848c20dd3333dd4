"""Vulkan backend: the ``"vulkan"`` torch device and its kernels (``csrc/vulkan/``).

Importing this package is cheap and never fails. :func:`build` (called by :func:`register`,
:func:`status`, and ``python -m hanzo_torch.backends.vulkan``):

1. compiles every ``csrc/vulkan/shaders/*.comp`` with ``glslc --target-env=vulkan1.2 -O`` into
   ``<cache>/vk-<key>/spv-<hash>/<name>.spv``; a shader whose first line is ``// hz: per-format`` is
   compiled once per format of the Vulkan rule table (:data:`.rules.RULES`, the formats with a
   ``HZ_FMT_<NAME>`` rule in ``shaders/formats.glsl``) with ``-DHZ_FMT_<NAME>=1 -DHZ_FMT=<NAME>`` into ``<name>.<NAME>.spv``;
   a shader whose first line is ``// hz: variants a b ...`` is compiled once per variant with
   ``-DHZ_VARIANT_<v>=1`` into ``<name>.<v>.spv`` (``// hz: variants @int8``: once per format of
   :data:`.rules.INT8_RULES`); a shader that fails to compile is reported
   (:func:`status` ``shader_errors``), not fatal;
2. builds the C++ extension (every ``csrc/vulkan/*.cpp``, linked with ``-lvulkan``) with
   ``torch.utils.cpp_extension.load``, cached like the CPU one (``~/.cache/hanzo-torch/ext``);
3. starts the runtime (``ext.init(spv_dir)``: Vulkan 1.2+ instance, device, compute queue);
4. names PrivateUse1 ``"vulkan"`` (:func:`claim_device`) and registers the device module, so
   ``torch.empty(3, device="vulkan")`` and ``x.to("vulkan")`` work.

Claiming the device: ``import hanzo_torch`` leaves PrivateUse1 alone (another extension may own
it). Until :func:`claim_device` runs, torch parses ``"vulkan"`` as its own built-in (unsupported)
Vulkan type; it runs on the first use of the backend: :func:`available`, :func:`status`,
:func:`build`, ``hanzo_torch.load(device="vulkan")``, ``hanzo_torch.backends.prepare_device("vulkan")``
and the CLI's ``--device vulkan``. Code that makes vulkan tensors itself calls
``hanzo_torch.backends.vulkan.claim_device()`` (or :func:`available`) first. When another
extension already renamed PrivateUse1, the backend is unavailable with that reason and nothing
else changes.

Device choice: ``HANZO_VK_DEVICE=<index>`` (an index of ``vkEnumeratePhysicalDevices``), else the
first discrete GPU, else integrated, virtual, then CPU devices (Mesa's lavapipe). Without the
Vulkan loader, a driver, a device with the required features, or glslc, :func:`available` is
False and :func:`status` says why; nothing else changes (the ops run on the other devices).

Memory and execution model: a vulkan tensor's ``data_ptr()`` is the buffer device address of its
first element. Ops are asynchronous (recorded into one command buffer); a copy to the CPU,
``.item()`` or :func:`synchronize` submits and waits. ``torch.vulkan.VulkanGraph`` records work
once and replays it with one submit (:mod:`.device_module`; the decode step of ``generate`` uses
it unless :data:`GRAPHS` is False: ``HANZO_VK_GRAPH=0``, read at import). ``HANZO_VK_PROFILE=1`` (read at start) collects counters that
:func:`profile` returns and resets.

Note: ``torch.Tensor.is_vulkan`` is torch's own property for its built-in (unrelated) Vulkan
device type and is False for these tensors; use ``t.device.type == "vulkan"``.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import shutil
import subprocess
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

from .. import _build
from . import rules as _rules
from ..base import QUANT_OPS, Backend, Capture, ComputeDefaults

NAME = "vulkan"
DEVICE_TYPES = ("vulkan",)

GRAPHS = os.environ.get("HANZO_VK_GRAPH", "1").strip() != "0"
"""Whether decode steps capture and replay a :class:`~.device_module.VulkanGraph`
(``HANZO_VK_GRAPH=0`` at import turns it off; assign in process for an A/B)."""

__all__ = ["NAME", "DEVICE_TYPES", "claim_device", "build", "extension", "available", "status", "formats", "register",
           "synchronize", "profile", "profiling", "set_profiling", "memory_stats", "empty_cache", "features", "fallback_ops",
           "spv_dir", "GLSLC_FLAGS"]

GLSLC_FLAGS = ("--target-env=vulkan1.2", "-O")

# A wheel ships the sources as hanzo_torch/_csrc (setup.py); a checkout has them in csrc/.
_PKG_SRC = Path(__file__).resolve().parents[2] / "_csrc" / "vulkan"
_SRC_DIR = _PKG_SRC if _PKG_SRC.is_dir() else Path(__file__).resolve().parents[3] / "csrc" / "vulkan"
_SHADER_DIR = _SRC_DIR / "shaders"

_slot = _build.Slot("the Vulkan backend", None, "PrivateUse1")  # no warning on failure: status() says why
_shader_errors: dict = {}
_spv_dir: Optional[Path] = None


def rule_formats() -> tuple:
    """The formats of the Vulkan rule table (:data:`.rules.RULES`) that the registry holds, in
    that order (empty when installed without the shader sources)."""
    from ...formats import FORMATS
    from .rules import RULES

    if not (_SHADER_DIR / "formats.glsl").is_file():
        return ()
    return tuple(n for n in RULES if n in FORMATS)


def _sources() -> list:
    return sorted(_SRC_DIR.glob("*.cpp"))


def _shaders() -> list:
    return sorted(_SHADER_DIR.glob("*.comp"))


def _build_key() -> str:
    """Key of the extension's build folder: the source folder, torch and the compiler (not the
    sources' contents: ninja rebuilds what changed, so an edit recompiles one file, not all)."""
    import torch

    h = hashlib.sha256()
    h.update(str(_SRC_DIR).encode())
    h.update(torch.__version__.encode())
    h.update(str(Path(torch.__file__).resolve().parent).encode())
    h.update(os.environ.get("CXX", "c++").encode())
    return h.hexdigest()[:16]


def _shader_key() -> str:
    """Key of the SPIR-V folder: every shader and include, the glslc flags and the rule table."""
    h = hashlib.sha256()
    for f in _shaders() + sorted(_SHADER_DIR.glob("*.glsl")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(" ".join(GLSLC_FLAGS).encode())
    h.update(" ".join(rule_formats()).encode())
    h.update(" ".join(_rules.INT8_RULES).encode())
    return h.hexdigest()[:16]


def _shader_jobs(out: Path) -> list:
    """``(source, output .spv, extra glslc args)`` for every shader (per-format ones once per format)."""
    jobs = []
    fmts = rule_formats()
    for src in _shaders():
        with open(src) as f:
            first = f.readline()
        variants = re.match(r"\s*//\s*hz:\s*variants\s+(.*)$", first)
        if variants:
            names = variants.group(1).split()
            if names[:1] == ["@int8"]:  # the int8 rule list of rules.py (the rest of the line is a comment)
                names = list(_rules.INT8_RULES)
            for v in names:
                jobs.append((src, out / f"{src.stem}.{v}.spv", [f"-DHZ_VARIANT_{v}=1"]))
        elif re.match(r"\s*//\s*hz:\s*per-format", first):
            for fmt in fmts:
                jobs.append((src, out / f"{src.stem}.{fmt}.spv", [f"-DHZ_FMT_{fmt}=1", f"-DHZ_FMT={fmt}"]))
        else:
            jobs.append((src, out / f"{src.stem}.spv", []))
    return jobs


def _compile_shaders(out: Path, glslc: str) -> dict:
    """Compile what is missing into ``out``; ``{spv name: error}`` for the shaders that failed."""
    out.mkdir(parents=True, exist_ok=True)
    errors = {}

    def one(job):
        src, dst, extra = job
        if dst.exists():
            return None
        tmp = dst.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        cmd = [glslc, *GLSLC_FLAGS, f"-I{_SHADER_DIR}", *extra, str(src), "-o", str(tmp)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            return dst.name, (r.stderr or r.stdout).strip()[-2000:]
        os.replace(tmp, dst)
        return None

    jobs = _shader_jobs(out)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        for res in pool.map(one, jobs):
            if res is not None:
                errors[res[0]] = res[1]
    return errors


def claim_device() -> bool:
    """Name torch's PrivateUse1 device "vulkan" and register :mod:`.device_module` as ``torch.vulkan``
    (cheap: nothing is built), so that ``torch.device("vulkan")`` means this device (before it,
    torch parses the name as its built-in, unsupported Vulkan type; a ``torch.device`` parsed then
    keeps that type: parse it again). The first vulkan tensor then starts the backend
    (``torch.vulkan._lazy_init``). Idempotent. False, changing nothing, when another extension has
    already named PrivateUse1."""
    import torch

    name = _privateuse1_name()
    if name not in ("privateuseone", NAME):
        return False
    if name != NAME:
        torch.utils.rename_privateuse1_backend(NAME)
    if not hasattr(torch, NAME):
        from . import device_module

        torch._register_device_module(NAME, device_module)
    return True


def _privateuse1_name() -> str:
    import torch

    return torch.device("privateuseone").type


def _register_device() -> None:
    """The device name and module, and the storage methods (once per process)."""
    import torch

    if not claim_device():
        raise RuntimeError(f"the PrivateUse1 device is already named {_privateuse1_name()!r} by another extension")
    try:  # storage.vulkan() / storage.is_vulkan; the Tensor ones clash with torch's built-in Vulkan names
        torch.utils.generate_methods_for_privateuse1_backend(for_tensor=False, for_module=False,
                                                             for_packed_sequence=False, for_storage=True)
    except RuntimeError:
        pass  # already generated in this process


def build(verbose: bool = False):
    """Compile the shaders and the extension (or load them from the cache), start the runtime and
    register the device; return the extension.

    Raises:
        RuntimeError: no glslc, no Vulkan loader or driver or device, a device lacking a required
            feature, or a failed C++ build (the message says which).
    """
    global _spv_dir, _shader_errors
    with _slot.lock:
        if _slot.ext is not None:
            return _slot.ext
        if not claim_device():
            raise RuntimeError(f"the PrivateUse1 device is already named {_privateuse1_name()!r} by another "
                               "extension")
        key = _build_key()
        build_dir = _build.cache_root() / f"vk-{key}"
        spv = build_dir / f"spv-{_shader_key()}"
        jobs = _shader_jobs(spv)
        if not all(dst.exists() for _, dst, _ in jobs):
            glslc = shutil.which("glslc")
            if glslc is None:
                raise RuntimeError("glslc (the GLSL -> SPIR-V compiler) was not found on PATH; on Debian/Ubuntu: "
                                   "apt-get install glslc")
        else:
            glslc = None
        if not Path("/usr/include/vulkan/vulkan.h").exists() and not os.environ.get("VULKAN_SDK"):
            if not any(build_dir.glob("*.so")):
                raise RuntimeError("the Vulkan headers were not found (/usr/include/vulkan/vulkan.h); on "
                                   "Debian/Ubuntu: apt-get install libvulkan-dev")
        _build.announce(build_dir, "the Vulkan backend", "a few minutes", verbose)
        _shader_errors = _compile_shaders(spv, glslc) if glslc else {}
        for spv_name, err in _shader_errors.items():
            warnings.warn(f"hanzo_torch: the Vulkan shader {spv_name} failed to compile; ops that use it will "
                          f"raise:\n{err}", RuntimeWarning, stacklevel=2)
        include = []
        sdk = os.environ.get("VULKAN_SDK")
        if sdk:
            include.append(str(Path(sdk) / "include"))
        ldflags = ["-lvulkan"] + ([f"-L{Path(sdk) / 'lib'}"] if sdk else [])
        try:
            ext = _build.load_extension(build_dir, verbose, name=f"hanzo_vulkan_{key}",
                                        sources=[str(s) for s in _sources()], extra_cflags=["-O2", "-std=c++17"],
                                        extra_ldflags=ldflags, extra_include_paths=include)
        except ImportError as e:  # the .so built elsewhere but libvulkan.so.1 is missing here
            raise RuntimeError(f"the Vulkan loader could not be loaded ({e}); on Debian/Ubuntu: "
                               "apt-get install libvulkan1 mesa-vulkan-drivers") from None
        ext.init(str(spv))
        _register_device()
        _spv_dir = spv
        _slot.loaded(ext)
        return ext


def extension():
    """The started extension, building it on first use; None when the backend cannot run here."""
    return _slot.get(build)


def available() -> bool:
    """True when the vulkan device works here (builds and starts it on first call)."""
    return extension() is not None


def reason() -> Optional[str]:
    """Why the backend is unavailable (None when it is available)."""
    return None if extension() is not None else _slot.failed


def formats() -> tuple:
    """ggml names of the quantized formats the Vulkan shaders handle (the rule table of
    ``shaders/formats.glsl``); dense F32/F16/BF16 are not listed."""
    return rule_formats()


def features() -> dict:
    """The device's name, driver, type and capabilities (subgroup size, shared memory, float16,
    int8 dot product, bfloat16, memory). Raises RuntimeError when the backend is unavailable."""
    ext = extension()
    if ext is None:
        raise RuntimeError(f"the vulkan backend is unavailable: {_slot.failed}")
    return dict(ext.features())


def status() -> dict:
    """``{"available", "reason", "formats", ...}``: device details when available."""
    ext = extension()
    if ext is None:
        return {"available": False, "reason": _slot.failed or "unknown", "formats": ()}
    f = ext.features()
    st = {"available": True, "reason": None, "formats": formats(),
          "device": f"{f['device_name']} ({f['device_type']}, Vulkan {f['api_version']}, {f['driver_name']})",
          "subgroup": f["subgroup_size"], "fp16": f["float16"], "int8_dot": f["int8_dot"],
          "int8_dot_accelerated": f["int8_dot_accelerated"], "bf16": f["bfloat16"], "native_ops": len(ext.native_ops())}
    if _shader_errors:
        st["shader_errors"] = sorted(_shader_errors)
    return st


def register() -> frozenset:
    """Start the backend; the ``hanzo`` ops with a kernel on the vulkan device (empty when unavailable).

    The kernels register themselves on PrivateUse1 when the extension loads
    (``TORCH_LIBRARY_IMPL(hanzo, PrivateUse1, m)`` in csrc/vulkan/ops_*.cpp).
    """
    ext = extension()
    return frozenset(ext.native_ops()) if ext is not None else frozenset()


def spv_dir() -> Optional[Path]:
    """The folder of the compiled shaders (None before :func:`build`)."""
    return _spv_dir


def _need():
    ext = extension()
    if ext is None:
        raise RuntimeError(f"the vulkan backend is unavailable: {_slot.failed}")
    return ext


def synchronize() -> None:
    """Submit the recorded work and wait for the device."""
    _need().synchronize()


def profiling() -> bool:
    """True when ``HANZO_VK_PROFILE=1`` was set when the runtime started."""
    return bool(_need().profiling())


def set_profiling(enabled: bool) -> None:
    """Turn the profile counters on or off in process (``HANZO_VK_PROFILE=1`` turns them on at
    start); resets them."""
    _need().set_profiling(bool(enabled))


def profile() -> dict:
    """Counters since the last call, then reset: ``dispatches``, ``barriers``, ``copies``,
    ``submits``, ``record_us``, ``submit_us``, ``fence_wait_us`` (microseconds). All zero unless
    ``HANZO_VK_PROFILE=1``. A graph replay counts the dispatches, barriers and copies recorded in
    the graph and one submit; commands recorded while capturing count at replay, not at capture."""
    return dict(_need().profile())


def memory_stats() -> dict:
    """``allocated_bytes`` (live tensors), ``reserved_bytes`` (Vulkan memory held, cache included),
    ``peak_allocated_bytes``, ``allocations``, ``device_allocations``, ``graph_pool_bytes`` (held
    by the private pools of live :class:`~hanzo_torch.backends.vulkan.device_module.VulkanGraph`
    objects, their live tensors included)."""
    return dict(_need().memory_stats())


def empty_cache() -> None:
    """Give the cached (unused) large blocks back to the driver (synchronizes)."""
    _need().empty_cache()


def fallback_ops() -> list:
    """The aten ops that ran on the CPU through the fallback in this process."""
    return list(_need().fallback_ops())


class VulkanBackend(Backend):
    """The contract of the Vulkan backend (:mod:`hanzo_torch.backends.base`)."""

    name = NAME
    device_types = DEVICE_TYPES
    dispatch_key = "PrivateUse1"
    defaults = ComputeDefaults(
        torch.float32, None,
        "float32 activations and KV: no GPU measurement shows bfloat16 paying here, it puts the logits of a "
        "tiny qwen3 with F32 weights 1.5% (of the largest) from the CPU's float32 and flips greedy tokens at "
        "near-ties, and llama.cpp's Vulkan backend keeps float32 activations too")

    @property
    def op_formats(self):
        fmts = frozenset(rule_formats())
        return {op: fmts for op in QUANT_OPS}

    def reason(self) -> Optional[str]:
        return reason()

    def prepare_device(self, device):
        if not claim_device():
            raise RuntimeError(f"the vulkan device is unavailable: the PrivateUse1 device is already named "
                               f"{_privateuse1_name()!r} by another extension")
        return torch.device(str(device))  # parsed again: "vulkan" is PrivateUse1 from now on

    def register(self) -> frozenset:
        return register()

    def status(self) -> dict:
        return status()

    def synchronize(self, device) -> None:
        synchronize()

    def graphs_supported(self, device) -> bool:
        return GRAPHS and available()

    def capture(self, device, fn, warmup: int) -> Capture:
        from .device_module import VulkanGraph, graph

        # one queue: the warm-up steps (pipelines created, lazily allocated buffers made) run in
        # order before the capture
        for _ in range(max(1, warmup)):
            fn()
        g = VulkanGraph()
        with graph(g):
            out = fn()
        return Capture(g.replay, out)

    def profiling(self) -> bool:
        return profiling()

    def profile(self) -> dict:
        return profile()


BACKEND = VulkanBackend()
