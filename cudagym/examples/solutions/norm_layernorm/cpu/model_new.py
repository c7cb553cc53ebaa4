"""norm_layernorm on the CPU: a two-pass (mean, then variance) LayerNorm per row in C++."""

import ctypes

import torch
import torch.nn as nn

from cudagym.runtime import kernel_library, ptr

_lib = kernel_library()
_lib.layernorm_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float]
_lib.layernorm_rows.restype = None


class ModelNew(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, eps=1e-5)  # parameter holder only; never called
        with torch.no_grad():  # as Model draws them
            self.norm.weight.copy_(1.0 + 0.5 * torch.randn(hidden))
            self.norm.bias.copy_(0.5 * torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        cols = x.size(-1)
        _lib.layernorm_rows(ptr(x), ptr(self.norm.weight), ptr(self.norm.bias), ptr(out), x.numel() // cols, cols,
                            self.norm.eps)
        return out
