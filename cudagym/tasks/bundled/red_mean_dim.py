"""Mean over the middle dimension of a 3-D tensor: (B, R, C) -> (B, C)."""

import torch
import torch.nn as nn

BATCH = 32
REDUCE = 1024
COLS = 2048


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mean(x, dim=1)


def get_inputs():
    return [torch.randn(BATCH, REDUCE, COLS)]


def get_init_inputs():
    return []
