"""hanzo-torch: run GGUF-quantized LLMs inside PyTorch with the weights kept packed.

Public API:
    formats:   :func:`dequantize`, :func:`quantize`, :func:`quantize_q8_1`, :func:`get_format`,
               :data:`FORMATS`
    files:     :class:`GGUFFile`, :func:`save_gguf`, :class:`GGUFError`
    tensors:   :class:`GGUFTensor`
    ops:       ``torch.ops.hanzo.*`` (registered on import of :mod:`hanzo_torch.ops`)
    models:    :func:`load`, :func:`generate`, :func:`stream_generate`, :class:`Tokenizer`, :func:`pull`
"""
from .formats import FORMATS, QUANTIZED_FORMATS, Format, dequantize, get_format, quantize  # noqa: F401
from .formats.q8_1 import quantize_q8_1, dequantize_q8_1  # noqa: F401
from .gguf_file import GGUFError, GGUFFile, save_gguf  # noqa: F401
from .tensor import GGUFTensor  # noqa: F401
from . import ops  # noqa: F401  (registers torch.ops.hanzo.*)
from .models import load  # noqa: F401
from .tokenizer import Tokenizer  # noqa: F401
from .generation import generate, stream_generate  # noqa: F401
from .hub import pull  # noqa: F401

__version__ = "0.1.0"
