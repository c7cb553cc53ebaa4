"""norm_softmax on the CPU: a three-pass row softmax in C++ (max, sum of exponentials, write)."""

import ctypes

import torch
import torch.nn as nn

from cudagym.runtime import kernel_library, ptr

_lib = kernel_library()
_lib.softmax_rows.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
_lib.softmax_rows.restype = None


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        cols = x.size(-1)
        _lib.softmax_rows(ptr(x), ptr(out), x.numel() // cols, cols)
        return out
