"""red_mean_dim on the CPU: column-wise accumulation over the middle dimension in C++."""

import ctypes

import torch
import torch.nn as nn

from cudagym.runtime import kernel_library, ptr

_lib = kernel_library()
_lib.mean_dim1.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3
_lib.mean_dim1.restype = None


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        b, r, c = x.shape
        out = torch.empty(b, c, dtype=x.dtype, device=x.device)
        _lib.mean_dim1(ptr(x), ptr(out), b, r, c)
        return out
