"""ew_scale_bias_gelu in CuPy: one fused elementwise kernel (scale, bias, erf-GELU), its CUDA
source a string in this file, compiled by `cupy.RawKernel` (NVRTC) and launched from `forward` on
torch's current stream over torch's tensors (zero-copy, through `__cuda_array_interface__`).
Needs a GPU and CuPy; its kernel counts as its own in permissive mode, because the source CuPy
compiled is this file's string (see docs/protection.md)."""

import cupy
import torch
import torch.nn as nn

SCALE_BIAS_GELU = r"""
extern "C" __global__ void scale_bias_gelu(const float* x, const float* bias, float* out,
                                           long long n, long long cols, float scale) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i] * scale + bias[i % cols];
        out[i] = 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));
    }
}
"""

_kernel = cupy.RawKernel(SCALE_BIAS_GELU, "scale_bias_gelu")


class ModelNew(nn.Module):
    def __init__(self, features: int, scale: float):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(features) * 0.5)  # as Model draws it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        block = 256
        args = (cupy.asarray(x.detach()), cupy.asarray(self.bias.detach()), cupy.asarray(out),
                cupy.int64(n), cupy.int64(x.size(-1)), cupy.float32(self.scale))
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            _kernel(((n + block - 1) // block,), (block,), args)
        return out
