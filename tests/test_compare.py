"""Output comparison: tolerance, NaN and infinity rules, halves, chunking, shapes."""

from __future__ import annotations

import torch

from cudagym.rewards import compare
from cudagym.rewards.compare import compare_outputs
from cudagym.tasks.model import Tolerance

TOL = Tolerance(atol=1e-3, rtol=1e-3)
INF, NAN = float("inf"), float("nan")


def frames(cand: torch.Tensor, ref: torch.Tensor) -> list:
    def one(t: torch.Tensor, role: str) -> tuple:
        raw = bytearray(t.contiguous().view(torch.uint8).numpy().tobytes())
        return ({"role": role, "trial": 0, "index": 0, "dtype": str(t.dtype).removeprefix("torch."),
                 "shape": list(t.shape)}, memoryview(raw))

    return [one(cand, "candidate"), one(ref, "reference")]


def test_special_values() -> None:
    ref = torch.tensor([1.0, NAN, INF, 2.0, -INF])
    assert compare_outputs(frames(ref.clone(), ref), TOL).passed == 1  # NaN == NaN, same infinities
    for i, v in ((0, 1.5), (1, 0.0), (2, 1e30), (4, INF), (3, NAN)):
        cand = ref.clone()
        cand[i] = v
        cmp = compare_outputs(frames(cand, ref), TOL)
        assert cmp.passed == 0 and cmp.kind == "mismatch" and "1/5 elements" in cmp.reasons[0], (i, v, cmp)
    cand = ref.clone()
    cand[3] = 2.0 + 1e-3  # within atol + rtol * |r|
    assert compare_outputs(frames(cand, ref), TOL).passed == 1


def test_halves_compare_in_fp32_and_chunks_cover_every_element(monkeypatch) -> None:
    monkeypatch.setattr(compare, "_CHUNK", 1000)
    ref = torch.randn(4500).half()
    assert compare_outputs(frames(ref.clone(), ref), TOL).passed == 1
    cand = ref.clone()
    cand[4499] += 1  # in the last, partial chunk
    cmp = compare_outputs(frames(cand, ref), TOL)
    assert cmp.passed == 0 and "1/4500 elements" in cmp.reasons[0]


def test_shape_and_dtype_mismatch_is_an_output_format_error() -> None:
    cmp = compare_outputs(frames(torch.zeros(3, 2), torch.zeros(2, 3)), TOL)
    assert cmp.kind == "output_format"
    cmp = compare_outputs(frames(torch.zeros(3, dtype=torch.float64), torch.zeros(3)), TOL)
    assert cmp.kind == "output_format"
