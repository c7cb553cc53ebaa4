"""ew_scale_bias_gelu on the GPU: one fused elementwise kernel (scale, bias, erf-GELU)."""

import ctypes

import torch
import torch.nn as nn

from cudagym.runtime import kernel_library, ptr, stream

_lib = kernel_library()
_lib.scale_bias_gelu.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_void_p]
_lib.scale_bias_gelu.restype = ctypes.c_int


class ModelNew(nn.Module):
    def __init__(self, features: int, scale: float):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(features) * 0.5)  # as Model draws it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        cols = x.size(-1)
        err = _lib.scale_bias_gelu(ptr(x), ptr(self.bias), ptr(out), x.numel() // cols, cols, self.scale, stream())
        if err:
            raise RuntimeError(f"scale_bias_gelu launch failed: CUDA error {err}")
        return out
