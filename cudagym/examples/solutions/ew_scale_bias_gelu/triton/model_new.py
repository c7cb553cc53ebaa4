"""ew_scale_bias_gelu in Triton (KernelBench's Triton format): one fused elementwise kernel
(scale, bias, erf-GELU), defined in this file and launched from `forward`. Needs a GPU and
Triton; its kernels count as its own in permissive mode (see docs/protection.md)."""

import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def scale_bias_gelu_kernel(x_ptr, bias_ptr, out_ptr, n, cols, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    b = tl.load(bias_ptr + offs % cols, mask=mask)
    v = x * scale + b
    tl.store(out_ptr + offs, 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476)), mask=mask)


class ModelNew(nn.Module):
    def __init__(self, features: int, scale: float):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(features) * 0.5)  # as Model draws it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        block = 1024
        scale_bias_gelu_kernel[(triton.cdiv(n, block),)](x, self.bias, out, n, x.size(-1), self.scale, BLOCK=block)
        return out
