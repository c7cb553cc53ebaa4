"""red_mean_dim on the GPU: one thread per output column, coalesced reads down the middle dimension."""

import ctypes

import torch
import torch.nn as nn

from cudagym.runtime import kernel_library, ptr, stream

_lib = kernel_library()
_lib.mean_dim1.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
_lib.mean_dim1.restype = ctypes.c_int


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        b, r, c = x.shape
        out = torch.empty(b, c, dtype=x.dtype, device=x.device)
        err = _lib.mean_dim1(ptr(x), ptr(out), b, r, c, stream())
        if err:
            raise RuntimeError(f"mean_dim1 launch failed: CUDA error {err}")
        return out
