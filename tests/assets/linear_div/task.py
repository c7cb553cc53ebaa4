"""A linear layer divided by a constant (a test task of cudagym's own, KernelBench format): the
shape of KernelBench level-2 tasks whose solutions fold the constant into the weights."""

import torch
import torch.nn as nn

BATCH, IN_FEATURES, OUT_FEATURES, DIVISOR = 64, 256, 128, 4.0


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int, divisor: float):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.divisor = divisor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) / self.divisor


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(BATCH, IN_FEATURES)]


def get_init_inputs() -> list:
    return [IN_FEATURES, OUT_FEATURES, DIVISOR]
