"""The quantized ``hanzo`` ops (work in progress: dequantize first; mul_mat, ... follow)."""
from __future__ import annotations

from typing import Sequence

import torch

from .. import formats as _formats
from . import _common


def dequantize_reference(data: torch.Tensor, qtype: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    out = _formats.dequantize(data, qtype, shape, dtype)
    # dense formats may come back as a view of the input; a custom op must not alias it
    return out.clone() if _shares_storage(out, data) else out


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@torch.library.custom_op("hanzo::dequantize", mutates_args=(),
                         schema="(Tensor data, str qtype, SymInt[] shape, ScalarType dtype) -> Tensor")
def dequantize(data: torch.Tensor, qtype: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    fn = _common.kernel_for("dequantize", data.device.type, qtype)
    return fn(data, qtype, shape, dtype) if fn is not None else dequantize_reference(data, qtype, shape, dtype)


@dequantize.register_fake
def _(data, qtype, shape, dtype):
    return data.new_empty(tuple(shape), dtype=dtype)
