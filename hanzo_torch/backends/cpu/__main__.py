"""``python -m hanzo_torch.backends.cpu``: build (or load from the cache) the C++ CPU kernels and report."""
import time

from . import ISA_NAMES, _isa_missing, build, default_isa

t0 = time.perf_counter()
ext = build(verbose=False)
print(f"hanzo_torch CPU kernels ready in {time.perf_counter() - t0:.1f} s "
      f"(ISAs: {', '.join(ISA_NAMES[i] for i in ext.supported_isas())}; default: {ISA_NAMES[default_isa()]})")
for name, why in _isa_missing(ext).items():
    print(f"  {name}: not offered, {why}")
