"""conv2d_relu_bias on the CPU: a direct convolution with the ReLU and bias fused into its epilogue."""

import ctypes

import torch
import torch.nn as nn

from cudagym.runtime import kernel_library, ptr

_lib = kernel_library()
_lib.conv2d_relu_bias.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6
_lib.conv2d_relu_bias.restype = None


class ModelNew(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)  # parameter holder only; never called
        self.bias = nn.Parameter(torch.randn(out_channels, 1, 1) * 0.5)  # as Model draws it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        n, c, h, w = x.shape
        k = self.conv.kernel_size[0]
        o = self.conv.out_channels
        out = torch.empty(n, o, h - k + 1, w - k + 1, dtype=x.dtype, device=x.device)
        _lib.conv2d_relu_bias(ptr(x), ptr(self.conv.weight), ptr(self.conv.bias), ptr(self.bias), ptr(out),
                              n, c, o, h, w, k)
        return out
