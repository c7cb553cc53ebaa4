"""block_transformer on the GPU: the whole block as seven CUDA kernel launches on the current stream.

LayerNorm -> QKV linear -> scores -> softmax -> probs @ V -> projection + residual -> LayerNorm
-> fc1 + GELU -> fc2 + residual. The nn.Linear / nn.LayerNorm submodules only hold the weights.
"""

import ctypes
import math
from typing import Any

import torch
import torch.nn as nn

from cudagym.runtime import kernel_library, ptr, stream

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_lib = kernel_library()
_ARGTYPES: dict[str, list[Any]] = {
    "layernorm_rows": [_P] * 4 + [_I] * 2 + [_F],
    "linear_fused": [_P] * 5 + [_I] * 3 + [ctypes.c_int],
    "attention_scores": [_P] * 2 + [_I] * 4 + [_F],
    "softmax_rows": [_P] * 2 + [_I] * 2,
    "attention_apply": [_P] * 3 + [_I] * 4,
}
for _name, _args in _ARGTYPES.items():
    getattr(_lib, _name).argtypes = _args + [_P]  # + the CUDA stream
    getattr(_lib, _name).restype = ctypes.c_int


def _launch(name: str, *args) -> None:
    err = getattr(_lib, name)(*args, stream())
    if err:
        raise RuntimeError(f"{name} launch failed: CUDA error {err}")


class ModelNew(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def _linear(self, x, layer, out, residual=None, gelu=False):
        _launch("linear_fused", ptr(x), ptr(layer.weight), ptr(layer.bias),
                None if residual is None else ptr(residual), ptr(out),
                x.numel() // layer.in_features, layer.out_features, layer.in_features, int(gelu))
        return out

    def _layernorm(self, x, norm):
        out = torch.empty_like(x)
        d = x.size(-1)
        _launch("layernorm_rows", ptr(x), ptr(norm.weight), ptr(norm.bias), ptr(out), x.numel() // d, d, norm.eps)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        b, s, d = x.shape
        hd = d // self.heads
        qkv = self._linear(self._layernorm(x, self.ln1), self.qkv, x.new_empty(b, s, 3 * d))
        scores = x.new_empty(b, self.heads, s, s)
        _launch("attention_scores", ptr(qkv), ptr(scores), b, s, self.heads, hd, math.sqrt(hd))
        probs = torch.empty_like(scores)
        _launch("softmax_rows", ptr(scores), ptr(probs), b * self.heads * s, s)
        y = torch.empty_like(x)
        _launch("attention_apply", ptr(probs), ptr(qkv), ptr(y), b, s, self.heads, hd)
        h = self._linear(y, self.proj, torch.empty_like(x), residual=x)
        f1 = self._linear(self._layernorm(h, self.ln2), self.fc1, x.new_empty(b, s, 4 * d), gelu=True)
        return self._linear(f1, self.fc2, torch.empty_like(x), residual=h)
