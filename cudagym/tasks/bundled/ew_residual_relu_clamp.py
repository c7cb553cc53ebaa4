"""Residual add, ReLU, then clamp from above: min(relu(x + residual), CLAMP_MAX)."""

import torch
import torch.nn as nn

BATCH = 64
CHANNELS = 64
HEIGHT = 64
WIDTH = 64
CLAMP_MAX = 1.5


class Model(nn.Module):
    def __init__(self, clamp_max: float):
        super().__init__()
        self.clamp_max = clamp_max

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return torch.clamp(torch.relu(x + residual), max=self.clamp_max)


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, HEIGHT, WIDTH), torch.randn(BATCH, CHANNELS, HEIGHT, WIDTH)]


def get_init_inputs():
    return [CLAMP_MAX]
