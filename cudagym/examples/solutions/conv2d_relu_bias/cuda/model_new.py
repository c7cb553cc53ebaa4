"""conv2d_relu_bias on the GPU: a direct convolution, one thread per output, ReLU + bias fused."""

import ctypes

import torch
import torch.nn as nn

from cudagym.runtime import kernel_library, ptr, stream

_lib = kernel_library()
_lib.conv2d_relu_bias.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6 + [ctypes.c_void_p]
_lib.conv2d_relu_bias.restype = ctypes.c_int


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
        err = _lib.conv2d_relu_bias(ptr(x), ptr(self.conv.weight), ptr(self.conv.bias), ptr(self.bias), ptr(out),
                                    n, c, o, h, w, k, stream())
        if err:
            raise RuntimeError(f"conv2d_relu_bias launch failed: CUDA error {err}")
        return out
