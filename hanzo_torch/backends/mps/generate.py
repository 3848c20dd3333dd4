"""The Metal sources of the MPS backend, translated from the Vulkan GLSL shaders.

One translation per (shader, format or variant) of the Vulkan build (the jobs of
:func:`hanzo_torch.backends.vulkan._shader_jobs`): ``glslc`` (the Vulkan backend's flags plus
``-g``, which keeps the names of the push-constant fields) to SPIR-V, then ``spirv-cross --msl``
(the translator MoltenVK uses; ``--msl-version 30000``, ``--msl-force-native-arrays``, the entry
point renamed ``hz_<shader>_<variant>``) to Metal Shading Language, then two rewrites here:

- **bound buffers.** The Vulkan shaders take every tensor as a 64-bit buffer device address in
  their push constants; spirv-cross turns each access into ``reinterpret_cast<device T*>(addr)``.
  ``torch.mps.compile_shader`` kernels take tensors as buffers bound by index, so every pointer
  field ``f`` of the push-constant struct that the kernel reads gets a kernel argument
  ``device uchar* f_buf [[buffer(i)]]`` (i = 1, 2, ... in field order, after the struct at
  ``buffer(0)``) and each read ``pc.f`` becomes ``hz_addr(f_buf, pc.f)``: the field carries
  ``1 + byte offset`` into the bound buffer, 0 for "no tensor" (the shaders test pointers
  against 0). The integer is turned back into a pointer by the cast spirv-cross emits (MSL 3
  device-pointer / ``ulong`` casts).
- **shared counters** (``attention.comp``): spirv-cross cannot translate an atomic on a
  buffer-reference pointer, so the translation compiles a copy of the shader whose completion
  counter is a bound storage buffer (``hz_counter``, a kernel argument of its own).

Two source-level patches (on a copy of the shader folder, never on the Vulkan sources) make the
rest translatable; each must match exactly once (:data:`PATCHES`):

- ``formats_q8.glsl``: the int8 dot product is an ``OpSDot`` through ``GL_EXT_spirv_intrinsics``,
  which spirv-cross cannot translate; the copy defines it as four sign-extended byte products
  (integer arithmetic: the same result);
- ``attention.comp``: the counter, as above.

The sources are generated at build time into ``<cache>/mps-msl-<key>/`` (about 2.6 MB of MSL:
too large to commit) and described in the committed manifest ``kernels.json``: per translation
its entry point, buffer arguments, push-constant layout (field, C type, byte offset), threadgroup
size, threadgroup memory and the SHA-256 of its text. The launch code reads the manifest;
``python -m hanzo_torch.backends.mps.generate --check`` regenerates everything and fails when any
text or signature differs from it (a default-suite test runs it). Without ``--check`` the command
rewrites the manifest.

Requires ``glslc`` (Debian ``glslc``) and ``spirv-cross`` (Debian ``spirv-cross``; macOS:
``brew install shaderc spirv-cross``).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

__all__ = ["MANIFEST_PATH", "SHADERS", "PATCHES", "translate_all", "msl_dir", "manifest", "toolchain_reason", "main"]

MANIFEST_PATH = Path(__file__).resolve().parent / "kernels.json"

SHADERS = ("dequantize", "mul_mat_vec", "mul_mat", "mul_mat_id", "mul_mat_id_sort", "swiglu_mul_mat",
           "swiglu_mul_mat_vec", "quantize_q8_1", "mul_mat_vec_q8", "mul_mat_q8", "rms_norm", "add_rms_norm",
           "qk_norm_rope", "swiglu", "kv_cache_write", "qk_norm_rope_kv_write", "attention", "attention_prefill",
           "moe_route")
"""The Vulkan shaders of the hanzo ops (the device glue ``elementwise`` / ``reduce_sum`` is torch's own on MPS)."""

NOT_POINTERS = {"quantize_q8_1": ("n_blocks",)}
"""64-bit push-constant fields that hold a count, not an address (left as they are)."""

PATCHES = {
    "formats_q8.glsl": [(
        'spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4450)\n'
        "int hz_sdot4x8_(uint a, uint b, spirv_literal int packed_format);\n",
        "int hz_sdot4x8_(uint a, uint b, int packed_format) {  // MSL translation: OpSDot as byte products\n"
        "    int s = 0;\n"
        "    for (int i = 0; i < 32; i += 8) s += bitfieldExtract(int(a), i, 8) * bitfieldExtract(int(b), i, 8);\n"
        "    return s;\n"
        "}\n")],
    "attention.comp": [
        ("layout(buffer_reference, std430, buffer_reference_align = 4) coherent buffer FzCounter { uint v[]; };\n",
         "layout(set = 0, binding = 0, std430) coherent buffer HzCounter { uint v[]; } hz_counter;  // MSL: bound\n"),
        ("atomicAdd(FzCounter(p.counter).v[item], 1u)", "atomicAdd(hz_counter.v[item], 1u)"),
        ("FzCounter(p.counter).v[item] = 0u;", "hz_counter.v[item] = 0u;"),
    ],
}
"""``{file: [(old, new), ...]}``: the source patches of the MSL translation (each ``old`` exactly once)."""

MSL_VERSION = "30000"
SPIRV_CROSS_FLAGS = ("--msl", "--msl-version", MSL_VERSION, "--msl-force-native-arrays")

_HZ_ADDR = ("\n// hz: a pointer field of the push constants is 1 + the byte offset into its bound buffer, 0 for none\n"
            "static inline ulong hz_addr(device uchar* b, ulong v) { return v == 0ul ? 0ul : "
            "reinterpret_cast<ulong>(b) + (v - 1ul); }\n")

_CTYPES = {"ulong": 8, "long": 8, "uint": 4, "int": 4, "float": 4, "ushort": 2, "short": 2, "uchar": 1, "char": 1}


def _vulkan():
    from .. import vulkan

    return vulkan


def toolchain_reason() -> Optional[str]:
    """Why the sources cannot be generated here (a missing tool), or None."""
    for tool, pkg in (("glslc", "glslc"), ("spirv-cross", "spirv-cross")):
        if shutil.which(tool) is None:
            return f"{tool} not found (Debian: apt-get install {pkg}; macOS: brew install shaderc spirv-cross)"
    return None


def _jobs() -> list:
    """``(shader path, variant, extra glslc args)`` of every translation, in manifest order."""
    out = []
    for src, dst, extra in _vulkan()._shader_jobs(Path("/nonexistent")):
        if src.stem not in SHADERS:
            continue
        parts = dst.stem.split(".", 1)
        out.append((src, parts[1] if len(parts) > 1 else "", extra))
    order = {s: i for i, s in enumerate(SHADERS)}
    return sorted(out, key=lambda j: order[j[0].stem])


def entry_name(shader: str, variant: str) -> str:
    """The Metal function name of a translation (``hz_mul_mat_Q4_K``)."""
    return f"hz_{shader}_{variant}" if variant else f"hz_{shader}"


def _key() -> str:
    h = hashlib.sha256()
    vk = _vulkan()
    for f in sorted(vk._SHADER_DIR.glob("*.comp")) + sorted(vk._SHADER_DIR.glob("*.glsl")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(Path(__file__).read_bytes())
    h.update(" ".join(vk.rule_formats() + tuple(vk._rules.INT8_RULES)).encode())
    for tool in ("glslc", "spirv-cross"):
        path = shutil.which(tool) or ""
        h.update(path.encode())
        if path:
            h.update(str(os.stat(path).st_mtime_ns).encode())
    return h.hexdigest()[:16]


def msl_dir() -> Path:
    """The cache folder of this build's generated sources (``<cache>/mps-msl-<key>``); not created."""
    from ..._native import cache_root

    return cache_root() / f"mps-msl-{_key()}"


def _patched_shader_dir(tmp: Path) -> Path:
    d = tmp / "shaders"
    shutil.copytree(_vulkan()._SHADER_DIR, d)
    for name, edits in PATCHES.items():
        f = d / name
        text = f.read_text()
        for old, new in edits:
            n = text.count(old)
            if n != 1:
                raise RuntimeError(f"MSL patch of {name}: expected the text {old[:60]!r} once, found it {n} times")
            text = text.replace(old, new)
        f.write_text(text)
    return d


def _find_kernel(text: str, entry: str):
    m = re.search(r"^kernel void " + re.escape(entry) + r"\((.*)\)\n\{", text, re.M)
    if m is None:
        raise RuntimeError(f"{entry}: no kernel signature in the spirv-cross output")
    return m


def _struct_fields(text: str, name: str) -> list:
    m = re.search(r"^struct " + re.escape(name) + r"\n\{\n(.*?)^\};", text, re.M | re.S)
    if m is None:
        raise RuntimeError(f"struct {name} not found in the spirv-cross output")
    fields = []
    for line in m.group(1).splitlines():
        fm = re.match(r"\s*(\w+) (\w+)(?:\[(\d+)\])?;$", line)
        if fm is None:
            raise RuntimeError(f"struct {name}: unexpected member {line.strip()!r}")
        fields.append((fm.group(2), fm.group(1), int(fm.group(3) or 1)))
    return fields


def _layout(fields: list) -> tuple:
    """``([(name, ctype, offset, count)], size)`` with C (and std430-for-scalars) alignment."""
    out, off, align = [], 0, 1
    for name, ctype, count in fields:
        size = _CTYPES[ctype]
        off = (off + size - 1) // size * size
        out.append([name, ctype, off, count])
        off += size * count
        align = max(align, size)
    return out, (off + align - 1) // align * align


def rewrite(text: str, shader: str, entry: str) -> tuple:
    """The bound-buffer rewrite of one spirv-cross output: ``(msl text, signature dict)``."""
    m = _find_kernel(text, entry)
    args = [a.strip() for a in m.group(1).split(", ")]
    pm = re.match(r"constant (\w+)& (\w+) \[\[buffer\(0\)\]\]$", args[0])
    if pm is None:
        raise RuntimeError(f"{entry}: the first kernel argument is not the push constants: {args[0]!r}")
    struct, pc = pm.group(1), pm.group(2)
    push, push_size = _layout(_struct_fields(text, struct))
    body = text[m.end():]
    buffers = [["push", 0, "constant"]]
    extra = []
    for a in args[1:]:  # bound storage buffers spirv-cross declared itself (the attention counter)
        bm = re.match(r"(?:volatile )?device (\w+)& (\w+) \[\[buffer\((\d+)\)\]\]$", a)
        if bm:
            if int(bm.group(3)) != len(buffers):
                raise RuntimeError(f"{entry}: storage buffer {bm.group(2)} at index {bm.group(3)}, not {len(buffers)}")
            buffers.append([bm.group(2), int(bm.group(3)), "storage"])
    index = len(buffers)
    skip = NOT_POINTERS.get(shader, ())
    for name, ctype, _, _ in push:
        if ctype != "ulong" or name in skip:
            continue
        ref = f"{pc}.{name}"
        if not re.search(re.escape(ref) + r"\b", body):
            continue
        body = re.sub(re.escape(ref) + r"\b", f"hz_addr({name}_buf, {ref})", body)
        extra.append(f"device uchar* {name}_buf [[buffer({index})]]")
        buffers.append([name, index, "pointer"])
        index += 1
    builtins = []
    for a in args[1:]:
        bm = re.match(r"uint3 (\w+) \[\[(\w+)\]\]$", a)
        if bm:
            builtins.append(bm.group(2))
    sig = ", ".join([args[0]] + [a for a in args[1:] if "[[buffer(" in a] + extra +
                    [a for a in args[1:] if "[[buffer(" not in a])
    head = text[:m.start()]
    head = head.replace("\nusing namespace metal;\n", "\nusing namespace metal;\n" + _HZ_ADDR, 1)
    out = head + f"kernel void {entry}({sig})\n{{" + body
    local = re.search(r"constant uint3 gl_WorkGroupSize \[\[maybe_unused\]\] = uint3\((\d+)u, (\d+)u, (\d+)u\);", out)
    if local is None:
        raise RuntimeError(f"{entry}: no gl_WorkGroupSize in the spirv-cross output")
    tg = 0
    for tm in re.finditer(r"^    threadgroup (\w+) (\w+)((?:\[\d+\])*);$", body, re.M):
        n = 1
        for d in re.findall(r"\[(\d+)\]", tm.group(3)):
            n *= int(d)
        tg += n * _CTYPES.get(tm.group(1), 4)
    return out, {"entry": entry, "push_size": push_size, "push": push, "buffers": buffers,
                 "local": [int(local.group(i)) for i in (1, 2, 3)], "threadgroup_bytes": tg,
                 "builtins": builtins, "barrier": "threadgroup_barrier(" in body}


def _translate(job, shader_dir: Path, tmp: Path) -> tuple:
    src, variant, extra = job
    shader = src.stem
    entry = entry_name(shader, variant)
    spv = tmp / f"{entry}.spv"
    vk = _vulkan()
    cmd = ["glslc", *vk.GLSLC_FLAGS, "-g", f"-I{shader_dir}", *extra, str(shader_dir / src.name), "-o", str(spv)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"glslc {src.name} {variant}: {(r.stderr or r.stdout).strip()[-800:]}")
    r = subprocess.run(["spirv-cross", *SPIRV_CROSS_FLAGS, "--rename-entry-point", "main", entry, "comp", str(spv)],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"spirv-cross {src.name} {variant}: {(r.stderr or r.stdout).strip()[-800:]}")
    text, sig = rewrite(r.stdout, shader, entry)
    sig.update(shader=shader, variant=variant, sha256=hashlib.sha256(text.encode()).hexdigest())
    return text, sig


def translate_all(out: Path, jobs: int = 2) -> dict:
    """Translate every kernel into ``out/<entry>.metal``; the manifest (``{"kernels": {entry: signature}}``)."""
    reason = toolchain_reason()
    if reason:
        raise RuntimeError(reason)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hz-msl-") as t:
        tmp = Path(t)
        shader_dir = _patched_shader_dir(tmp)
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(lambda j: _translate(j, shader_dir, tmp), _jobs()))
    kernels = {}
    for text, sig in results:
        tmpf = out / f".{sig['entry']}.{os.getpid()}.tmp"
        tmpf.write_text(text)
        os.replace(tmpf, out / f"{sig['entry']}.metal")
        kernels[sig["entry"]] = sig
    return {"msl_version": MSL_VERSION, "kernels": kernels}


def manifest() -> dict:
    """The committed manifest (``kernels.json``)."""
    return json.loads(MANIFEST_PATH.read_text())


def _dump(m: dict) -> str:
    lines = ["{", f'  "msl_version": {json.dumps(m["msl_version"])},', '  "kernels": {']
    items = list(m["kernels"].items())
    for i, (k, v) in enumerate(items):
        lines.append(f"    {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" + ("," if i + 1 < len(items) else ""))
    lines += ["  }", "}", ""]
    return "\n".join(lines)


def ensure_sources() -> Path:
    """The folder of the generated sources, translating them on first use (under the build lock)."""
    from ..._native import build_lock

    d = msl_dir()
    if (d / "manifest.json").is_file():
        return d
    with build_lock(d):
        if not (d / "manifest.json").is_file():
            m = translate_all(d)
            (d / "manifest.json").write_text(_dump(m))
    return d


def check(out: Optional[Path] = None, cached: bool = False) -> list:
    """Regenerate and compare with the committed manifest: the differences (empty: up to date).
    ``cached``: compare the build of :func:`ensure_sources` instead (translated once per key of
    the shader sources, this file and the tools: what the harness and a Mac run)."""
    if cached:
        new = json.loads((ensure_sources() / "manifest.json").read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="hz-msl-check-") as t:
            new = translate_all(Path(out or t))
    old = manifest()
    diffs = []
    for k in sorted(set(old["kernels"]) | set(new["kernels"])):
        a, b = old["kernels"].get(k), new["kernels"].get(k)
        if a is None or b is None:
            diffs.append(f"{k}: {'new' if a is None else 'gone'}")
        elif a != b:
            keys = sorted(x for x in set(a) | set(b) if a.get(x) != b.get(x))
            diffs.append(f"{k}: {', '.join(keys)} differ")
    if old.get("msl_version") != new["msl_version"]:
        diffs.append("msl_version differs")
    return diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hanzo_torch.backends.mps.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="regenerate and fail if the manifest differs")
    ap.add_argument("--out", type=Path, help="also keep the generated .metal files in this folder")
    a = ap.parse_args(argv)
    if a.check:
        diffs = check(a.out)
        for d in diffs:
            print(d, file=sys.stderr)
        print(f"{'differs' if diffs else 'up to date'}: {MANIFEST_PATH}", file=sys.stderr)
        return 1 if diffs else 0
    if a.out:
        m = translate_all(a.out)
    else:
        m = json.loads((ensure_sources() / "manifest.json").read_text())
    MANIFEST_PATH.write_text(_dump(m))
    print(f"wrote {MANIFEST_PATH} ({len(m['kernels'])} kernels)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
