"""ew_residual_relu_clamp on the GPU: add, ReLU and clamp in one elementwise kernel."""

import ctypes

import torch
import torch.nn as nn

from cudagym.runtime import kernel_library, ptr, stream

_lib = kernel_library()
_lib.residual_relu_clamp.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]
_lib.residual_relu_clamp.restype = ctypes.c_int


class ModelNew(nn.Module):
    def __init__(self, clamp_max: float):
        super().__init__()
        self.clamp_max = clamp_max

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        x, residual = x.contiguous(), residual.contiguous()
        out = torch.empty_like(x)
        err = _lib.residual_relu_clamp(ptr(x), ptr(residual), ptr(out), x.numel(), self.clamp_max, stream())
        if err:
            raise RuntimeError(f"residual_relu_clamp launch failed: CUDA error {err}")
        return out
