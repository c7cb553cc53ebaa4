"""ew_scale_bias_gelu on the CPU: one fused C++ loop (scale, bias, erf-GELU) instead of three ops."""

import ctypes

import torch
import torch.nn as nn

from cudagym.runtime import kernel_library, ptr

_lib = kernel_library()
_lib.scale_bias_gelu.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
_lib.scale_bias_gelu.restype = None


class ModelNew(nn.Module):
    def __init__(self, features: int, scale: float):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(features) * 0.5)  # as Model draws it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        cols = x.size(-1)
        _lib.scale_bias_gelu(ptr(x), ptr(self.bias), ptr(out), x.numel() // cols, cols, self.scale)
        return out
