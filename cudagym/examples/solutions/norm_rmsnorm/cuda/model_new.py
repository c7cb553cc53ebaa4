"""norm_rmsnorm on the GPU: one block per row, a sum-of-squares reduction and the scaled write."""

import ctypes

import torch
import torch.nn as nn

from cudagym.runtime import kernel_library, ptr, stream

_lib = kernel_library()
_lib.rmsnorm_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_void_p]
_lib.rmsnorm_rows.restype = ctypes.c_int


class ModelNew(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.5 * torch.randn(hidden))  # as Model draws it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        cols = x.size(-1)
        err = _lib.rmsnorm_rows(ptr(x), ptr(self.weight), ptr(out), x.numel() // cols, cols, self.eps, stream())
        if err:
            raise RuntimeError(f"rmsnorm_rows launch failed: CUDA error {err}")
        return out
