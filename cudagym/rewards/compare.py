"""Output comparison, done in the evaluator's process on raw bytes sent by the worker."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from cudagym.tasks.model import Tolerance

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


def decode_tensor(header: dict[str, Any], payload: bytes | memoryview) -> torch.Tensor:
    dtype = _DTYPES.get(str(header.get("dtype")))
    if dtype is None:
        raise ValueError(f"unsupported output dtype {header.get('dtype')!r}")
    shape = [int(s) for s in header.get("shape", [])]
    numel = 1
    for s in shape:
        numel *= s
    elem = torch.empty((), dtype=dtype).element_size()
    if len(payload) != numel * elem:
        raise ValueError("tensor payload size does not match its shape")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if isinstance(payload, bytes) or (isinstance(payload, memoryview) and payload.readonly):
        payload = bytearray(payload)
    return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape)  # no copy


@dataclass
class Comparison:
    trials: int
    passed: int
    max_abs_error: float | None
    reasons: list[str]
    kind: str | None  # None when all passed; "mismatch" or "output_format"


def compare_outputs(tensors: list[tuple[dict[str, Any], bytes]], tol: Tolerance) -> Comparison:
    """Compare candidate and reference outputs per trial: structure, shape, dtype, values."""
    by_trial: dict[int, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: {"candidate": {}, "reference": {}})
    for header, payload in tensors:
        role = header.get("role")
        if role not in ("candidate", "reference"):
            continue
        by_trial[int(header["trial"])][role][int(header["index"])] = decode_tensor(header, payload)
    reasons: list[str] = []
    passed, worst, kind = 0, 0.0, None
    for trial in sorted(by_trial):
        cand, ref = by_trial[trial]["candidate"], by_trial[trial]["reference"]
        ok = True
        if sorted(cand) != sorted(ref):
            reasons.append(f"trial {trial}: ModelNew returned {len(cand)} outputs, the reference {len(ref)}")
            kind, ok = "output_format", False
        for i in sorted(set(cand) & set(ref)):
            c, r = cand[i], ref[i]
            if c.shape != r.shape or c.dtype != r.dtype:
                reasons.append(f"trial {trial}: output {i} is {c.dtype} {tuple(c.shape)}, expected {r.dtype} {tuple(r.shape)}")
                kind, ok = "output_format", False
                continue
            if not r.is_floating_point():
                if not torch.equal(c, r):
                    reasons.append(f"trial {trial}: output {i} differs from the reference")
                    kind, ok = kind or "mismatch", False
                continue
            if c.dtype in (torch.float16, torch.bfloat16):
                c, r = c.float(), r.float()
            # Fast path: NaN anywhere makes `within` False, so all() means finite and close.
            diff = (c - r).abs_()
            within = diff <= r.abs().mul_(tol.rtol).add_(tol.atol)
            if bool(within.all()):
                worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
                continue
            if bool((within | (torch.isnan(c) & torch.isnan(r)) | ((c == r) & torch.isinf(r))).all()):
                worst = max(worst, float(diff.nan_to_num_(0.0, 0.0).max()))
                continue  # differences only where both are NaN or the same infinity
            nan_ok = torch.isnan(c) == torch.isnan(r)
            diff = (c - r).abs_().nan_to_num_(0.0)
            bad = (diff > tol.atol + tol.rtol * r.abs().nan_to_num_(0.0)) | ~nan_ok
            err = float(diff.max()) if diff.numel() else 0.0
            worst = max(worst, err if bool(nan_ok.all()) else float("inf"))
            nbad = int(bad.sum())
            reasons.append(f"trial {trial}: output {i} mismatches at {nbad}/{bad.numel()} elements "
                           f"(max abs error {err:.3g}; atol={tol.atol}, rtol={tol.rtol}"
                           + ("; NaN where the reference has none" if not bool(nan_ok.all()) else "") + ")")
            kind, ok = kind or "mismatch", False
        passed += ok
    if not by_trial:
        reasons.append("no outputs were compared")
        kind = "mismatch"
    return Comparison(trials=len(by_trial), passed=passed, max_abs_error=worst if by_trial else None,
                      reasons=reasons[:8], kind=kind)
