"""Maximum over the last dimension of a 3-D tensor: (B, M, N) -> (B, M)."""

import torch
import torch.nn as nn

BATCH = 64
ROWS = 1024
COLS = 1024


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.amax(x, dim=-1)


def get_inputs():
    return [torch.randn(BATCH, ROWS, COLS)]


def get_init_inputs():
    return []
