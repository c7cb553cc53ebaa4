"""mm_linear_gelu on the GPU: a tiled GEMM whose epilogue adds both biases and applies erf-GELU."""

import ctypes

import torch
import torch.nn as nn

from cudagym.runtime import kernel_library, ptr, stream

_lib = kernel_library()
_lib.linear_bias_gelu.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
_lib.linear_bias_gelu.restype = ctypes.c_int


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)  # parameter holder only; never called
        self.bias = nn.Parameter(torch.randn(out_features) * 0.1)  # as Model draws it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        n, k = self.linear.out_features, self.linear.in_features
        m = x.numel() // k
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
        err = _lib.linear_bias_gelu(ptr(x), ptr(self.linear.weight), ptr(self.linear.bias), ptr(self.bias), ptr(out),
                                    m, n, k, stream())
        if err:
            raise RuntimeError(f"linear_bias_gelu launch failed: CUDA error {err}")
        return out
