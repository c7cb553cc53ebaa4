"""Tensor dtypes the result channel carries (placeholder; replaced by the tolerance branch)."""

from __future__ import annotations

import torch

WIRE_DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128)}
