"""LayerNorm with a learned scale and shift over the last dimension of (B, S, H)."""

import torch
import torch.nn as nn

BATCH = 32
SEQ = 1024
HIDDEN = 1024


class Model(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, eps=1e-5)
        with torch.no_grad():  # non-trivial affine parameters
            self.norm.weight.copy_(1.0 + 0.5 * torch.randn(hidden))
            self.norm.bias.copy_(0.5 * torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def get_inputs():
    return [torch.randn(BATCH, SEQ, HIDDEN) * 2.0 + 0.5]


def get_init_inputs():
    return [HIDDEN]
