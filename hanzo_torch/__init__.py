"""hanzo-torch: run GGUF-quantized LLMs inside PyTorch with the weights kept packed.

Public API:
    formats:   :func:`dequantize`, :func:`quantize`, :func:`quantize_q8_1`, :func:`get_format`,
               :data:`FORMATS`
    files:     :class:`GGUFFile`, :func:`save_gguf`, :class:`GGUFError`
    tensors:   :class:`GGUFTensor`
    ops:       ``torch.ops.hanzo.*`` (registered on import of :mod:`hanzo_torch.ops`),
               ``torch.ops.hanzo_ref.*`` (the references), :func:`hanzo_torch.ops.use_reference`
    backends:  :func:`hanzo_torch.backends.status`, :func:`hanzo_torch.backends.cpu.use_isa`
    convert:   :func:`convert` (Hugging Face safetensors checkpoint -> GGUF)
    models:    :func:`load`, :func:`generate`, :func:`stream_generate`, :class:`Tokenizer`, :func:`pull`,
               :class:`hanzo_torch.decode_graphs.DecodeStep` (also as ``hanzo_torch.cuda_graphs``)
"""
import os as _os
import sys as _sys

# CPU threads (torch's OpenMP pool, which the C++ kernels share): libgomp's default keeps an idle
# thread spinning for ~300,000 iterations (milliseconds) before it sleeps. On a machine whose
# cores are busy with other processes, the spinning threads take the cores from the ones doing
# the work, and a 2-thread decode step measured 7-20x slower (benchmarks/RESULTS.md); sleeping
# at once (OMP_WAIT_POLICY=passive) costs ~50% on an idle machine. A bounded spin keeps both.
# libgomp reads the variable when torch loads it, so this only applies when hanzo_torch is
# imported before torch (as by the hanzo-torch command), and never overrides a value you set.
if "torch" not in _sys.modules and "GOMP_SPINCOUNT" not in _os.environ and "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = "20000"

from .formats import FORMATS, QUANTIZED_FORMATS, Format, dequantize, get_format, quantize  # noqa: F401,E402
from .formats.q8_1 import quantize_q8_1, dequantize_q8_1  # noqa: F401
from .gguf_file import GGUFError, GGUFFile, save_gguf  # noqa: F401
from .tensor import GGUFTensor  # noqa: F401
from . import ops  # noqa: F401  (registers torch.ops.hanzo.*)
from . import backends  # noqa: F401  (status(), activate(); each backend loads on first use)
from .models import load  # noqa: F401
from .tokenizer import Tokenizer  # noqa: F401
from .generation import generate, stream_generate  # noqa: F401
from .hub import pull  # noqa: F401
from .convert_hf import convert  # noqa: F401,E402
from . import decode_graphs, cuda_graphs  # noqa: F401,E402  (DecodeStep; cuda_graphs: an alias of decode_graphs)

__version__ = "0.1.0"
