"""Row sums of each row after sorting it. Sorting changes no sum, so a kernel that only sums is
correct and faster than eager and torch.compile by a margin no host load can close (a test task
of cudagym's own, KernelBench format)."""

import torch
import torch.nn as nn

ROWS, COLS = 16, 16384


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sort(x, dim=-1).values.sum(dim=-1)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(ROWS, COLS)]


def get_init_inputs() -> list:
    return []
