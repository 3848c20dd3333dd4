"""``python -m hanzo_torch.backends.vulkan``: build (or load from the cache) the Vulkan backend and report."""
import sys
import time

from . import build, features, spv_dir, status

t0 = time.perf_counter()
try:
    build(verbose="-v" in sys.argv)
except RuntimeError as e:
    print(f"hanzo_torch Vulkan backend unavailable: {e}")
    sys.exit(1)
f = features()
st = status()
print(f"hanzo_torch Vulkan backend ready in {time.perf_counter() - t0:.1f} s: {st['device']}; "
      f"subgroup {f['subgroup_size']}, shared memory {f['shared_memory_bytes']} B, fp16 {f['float16']}, "
      f"int8 dot {f['int8_dot']} (accelerated {f['int8_dot_accelerated']}), bf16 {f['bfloat16']}; "
      f"{len(st['formats'])} formats; shaders in {spv_dir()}")
for name in st.get("shader_errors", []):
    print(f"  shader failed to compile: {name}")
