"""Output comparison, done in the evaluator's process on raw bytes sent by the worker."""

from __future__ import annotations

import warnings
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
    with warnings.catch_warnings():  # read-only buffers: the comparison never writes to its inputs
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape)  # no copy


@dataclass
class Comparison:
    trials: int
    passed: int
    max_abs_error: float | None
    reasons: list[str]
    kind: str | None  # None when all passed; "mismatch" or "output_format"


_CHUNK = 1 << 22  # elements per step: temporaries are reused, not allocated (and faulted in) per output


def _compare_values(c: torch.Tensor, r: torch.Tensor, tol: Tolerance) -> tuple[float, int, bool]:
    """(max abs error, elements out of tolerance, NaN/inf disagreement) of two floating tensors.

    An element passes if r is finite and |c - r| <= atol + rtol * |r|, or both are NaN, or
    both are the same infinity. The max error ignores elements where both are NaN/the same infinity, and is inf
    where NaNs disagree.
    """
    c, r = c.reshape(-1), r.reshape(-1)
    n = r.numel()
    if n == 0:
        return 0.0, 0, False
    f = torch.float32 if r.dtype in (torch.float16, torch.bfloat16) else r.dtype
    size = min(n, _CHUNK)
    diff, bound = torch.empty(size, dtype=f), torch.empty(size, dtype=f)
    within = torch.empty(size, dtype=torch.bool)
    worst, nbad, nan_bad = 0.0, 0, False
    for lo in range(0, n, _CHUNK):
        cc, rr = c[lo : lo + _CHUNK].to(f), r[lo : lo + _CHUNK].to(f)  # halves: compared in fp32
        k = rr.numel()
        d, b, w = diff[:k], bound[:k], within[:k]
        torch.sub(cc, rr, out=d).abs_()
        torch.abs(rr, out=b).mul_(tol.rtol).add_(tol.atol)
        torch.le(d, b, out=w)
        # fast path: NaN anywhere makes `w` False, and the bound is infinite only at an infinite r
        if bool(w.all()) and float(b.max()) != float("inf"):
            worst = max(worst, float(d.max()))
            continue
        same_special = (torch.isnan(cc) & torch.isnan(rr)) | ((cc == rr) & torch.isinf(rr))
        good = (w & torch.isfinite(rr)) | same_special
        nbad += int((~good).sum())
        d = d.masked_fill(same_special, 0.0).nan_to_num_(float("inf"), float("inf"))
        worst = max(worst, float(d.max()))
        nan_bad = nan_bad or not bool((torch.isnan(cc) == torch.isnan(rr)).all())
    return worst, nbad, nan_bad


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
            err, nbad, nan_bad = _compare_values(c, r, tol)
            worst = max(worst, err)
            if nbad:
                reasons.append(f"trial {trial}: output {i} mismatches at {nbad}/{r.numel()} elements "
                               f"(max abs error {err:.3g}; atol={tol.atol}, rtol={tol.rtol}"
                               + ("; NaN where the reference has none" if nan_bad else "") + ")")
                kind, ok = kind or "mismatch", False
        passed += ok
    if not by_trial:
        reasons.append("no outputs were compared")
        kind = "mismatch"
    return Comparison(trials=len(by_trial), passed=passed, max_abs_error=worst if by_trial else None,
                      reasons=reasons[:8], kind=kind)
