"""The sort's row sums, without the sort: one pass per row (double accumulator)."""

import ctypes

import torch
import torch.nn as nn

from cudagym.runtime import kernel_library, ptr

_lib = kernel_library()
_lib.row_sum.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
_lib.row_sum.restype = None


class ModelNew(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty(x.size(0), dtype=x.dtype)
        _lib.row_sum(ptr(x), ptr(out), x.size(0), x.size(1))
        return out
