"""Output comparison: tolerance, NaN and infinity rules, halves, chunking, shapes, every dtype, malformed frames."""

from __future__ import annotations

import math
import random

import pytest
import torch

from cudagym.rewards import compare
from cudagym.rewards.compare import Comparison, compare_outcome, compare_outputs
from cudagym.sandbox.worker.wire import JobOutcome
from cudagym.sandbox.worker.dtypes import WIRE_DTYPES
from cudagym.tasks.loaders import bundled_task
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


# -- every dtype and every malformed frame gets a verdict, never an exception ------------------
ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
SHAPES = [(), (0, 4), (3, 5)]


def worker_frame(t: torch.Tensor, role: str, trial: int = 0, index: int = 0) -> tuple:
    """The (header, payload) the worker sends for `t` (`Channel.send_tensor`: its dtype name, its bytes)."""
    c = t.detach().contiguous()
    header = {"type": "tensor", "role": role, "trial": trial, "index": index,
              "dtype": str(c.dtype).removeprefix("torch."), "shape": list(c.shape)}
    return header, memoryview(bytearray(c.reshape(-1).view(torch.uint8).numpy().tobytes()))


def random_tensor(dtype: torch.dtype, shape: tuple, seed: int = 0) -> torch.Tensor:
    """Arbitrary bytes (NaN and infinity patterns included) viewed as `dtype`; bool as 0/1."""
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    if dtype == torch.bool:
        raw %= 2
    return raw.view(dtype).reshape(shape)


def test_wire_dtypes_are_named_as_the_worker_names_them() -> None:
    assert WIRE_DTYPES and all(str(d) == f"torch.{name}" for name, d in WIRE_DTYPES.items())
    for name in ("uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2", "complex32", "complex128"):
        assert name in WIRE_DTYPES


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_identical_bytes_of_every_torch_dtype(dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    for shape in SHAPES:
        t = random_tensor(dtype, shape)
        cmp = compare_outputs([worker_frame(t, "candidate"), worker_frame(t, "reference")], TOL)  # two copies
        assert isinstance(cmp, Comparison)
        if name in WIRE_DTYPES:
            assert (cmp.kind, cmp.passed, cmp.trials) == (None, 1, 1), (shape, cmp)
        else:
            assert cmp.kind == "output_format" and cmp.passed == 0, (shape, cmp)
            assert f"dtype '{name}' cannot be compared" in cmp.reasons[0], cmp.reasons


@pytest.mark.parametrize("name", list(WIRE_DTYPES))
def test_one_wrong_element_of_every_wire_dtype_is_a_mismatch(name: str) -> None:
    dtype = WIRE_DTYPES[name]
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.rand(3, 5) + 1  # [1, 2): representable in every float8, e8m0 included (1 or 2)
        ref = (torch.complex(base, base.flip(0)) if dtype.is_complex else base).to(dtype)
        cand = ref.clone()
        cand[1, 2] = (ref[1, 2].to(torch.complex64 if dtype.is_complex else torch.float32) * 4).to(dtype)
        parts = "real/imaginary parts" if dtype.is_complex else "elements"
        total = 30 if dtype.is_complex else 15
        expected = f"mismatches at {2 if dtype.is_complex else 1}/{total} {parts}"
    else:
        ref = random_tensor(dtype, (3, 5))
        cand = ref.clone()
        cand.view(torch.uint8).view(3, 5, -1)[1, 2, 0] ^= 1  # one bit of one element: exact types differ
        expected = "differs from the reference at 1/15 elements"
    cmp = compare_outputs([worker_frame(cand, "candidate"), worker_frame(ref, "reference")], TOL)
    assert cmp.kind == "mismatch" and cmp.passed == 0, cmp
    assert expected in cmp.reasons[0], cmp.reasons


def test_uint16_output_against_a_float_reference_is_an_output_format_error() -> None:
    cand = torch.arange(6).to(torch.uint16).reshape(2, 3)
    cmp = compare_outputs([worker_frame(cand, "candidate"), worker_frame(torch.zeros(2, 3), "reference")], TOL)
    assert cmp.kind == "output_format"
    assert cmp.reasons == ["trial 0: output 0 is torch.uint16 (2, 3), expected torch.float32 (2, 3)"]


def test_uint64_compares_exactly_above_int64() -> None:
    ref = torch.tensor([2**63 + 1, 5], dtype=torch.uint64)
    cand = torch.tensor([2**63 + 2, 5], dtype=torch.uint64)
    assert compare_outputs([worker_frame(ref, "candidate"), worker_frame(ref, "reference")], TOL).passed == 1
    cmp = compare_outputs([worker_frame(cand, "candidate"), worker_frame(ref, "reference")], TOL)
    assert cmp.kind == "mismatch" and "at 1/2 elements" in cmp.reasons[0]


GOOD = torch.arange(6, dtype=torch.float32).reshape(2, 3)
BAD_VALUES = {
    "role": [None, "", "Candidate", 0, ["candidate"], {"role": "candidate"}],
    "trial": [None, -1, 1.0, 0.5, True, "0", [0], {}, float("nan")],
    "index": [None, -3, 0.0, False, "0", [0]],
    "dtype": [None, "", "float", "torch.float32", "qint8", "uint1", "bits8", "float4_e2m1fn_x2", 32, ["float32"],
              "float64", "x" * 10_000],
    "shape": [None, "2,3", 6, [2.0, 3], [2, "3"], [-2, -3], [True, 6], [[2, 3]], [3, 3], [6, 1, 1, 2],
              [2**64, 0], [2**62, 2**62, 0], [2**40, 2**40], [1] * 65, [2, 3, None]],
}


@pytest.mark.parametrize("key", list(BAD_VALUES))
def test_malformed_header_values_are_output_format_errors(key: str) -> None:
    for value in [*BAD_VALUES[key], "<missing>"]:
        header, payload = worker_frame(GOOD, "candidate")
        if value == "<missing>":
            del header[key]
        else:
            header[key] = value
        cmp = compare_outputs([(header, payload), worker_frame(GOOD, "reference")], TOL)
        assert cmp.kind == "output_format" and cmp.passed == 0 and cmp.reasons, (key, value, cmp)
        assert all(len(r) < 1000 for r in cmp.reasons)


def test_malformed_payloads_and_headers_are_output_format_errors() -> None:
    header, payload = worker_frame(GOOD, "candidate")
    for bad in (payload[:-1], bytes(payload) + b"\0", b"", None, "abc", 24, memoryview(b"").cast("B")):
        cmp = compare_outputs([(header, bad), worker_frame(GOOD, "reference")], TOL)
        assert cmp.kind == "output_format", (bad, cmp)
    for bad_header in (None, [], "tensor", 7):
        cmp = compare_outputs([(bad_header, payload), worker_frame(GOOD, "reference")], TOL)
        assert cmp.kind == "output_format" and "not an object" in cmp.reasons[0], cmp
    twice = compare_outputs([worker_frame(GOOD, "candidate"), worker_frame(GOOD, "candidate"),
                             worker_frame(GOOD, "reference")], TOL)
    assert twice.kind == "output_format" and "sent twice" in twice.reasons[0]


def _json_value(rng: random.Random, depth: int = 0) -> object:
    """A random JSON value: what a header key could hold after `json.loads`."""
    makers = [
        lambda: None, lambda: rng.random() < 0.5, lambda: rng.randint(-2**70, 2**70), lambda: rng.randint(-2, 8),
        lambda: rng.uniform(-1e9, 1e9),
        lambda: rng.choice(["candidate", "reference", "float32", "uint16", "qint8", "", "0", "samples", "projections"]),
        lambda: [rng.randint(0, 4) for _ in range(rng.randrange(4))],
    ]
    if depth < 2:
        makers += [lambda: [_json_value(rng, depth + 1) for _ in range(rng.randrange(4))],
                   lambda: {str(rng.randrange(5)): _json_value(rng, depth + 1) for _ in range(rng.randrange(3))}]
    return rng.choice(makers)()


def test_random_headers_and_payloads_never_raise() -> None:
    rng = random.Random(0)
    keys = ("type", "role", "trial", "index", "dtype", "shape", "part", "of_shape")
    for _ in range(2000):
        frames = []
        for role in ("candidate", "reference"):
            header, payload = worker_frame(GOOD, role)
            for key in rng.sample(keys, rng.randrange(1, len(keys) + 1)):
                if rng.random() < 0.2:
                    header.pop(key, None)
                else:
                    header[key] = _json_value(rng)
            if rng.random() < 0.3:
                payload = memoryview(bytes(rng.randrange(256) for _ in range(rng.randrange(64))))
            frames.append((header, payload))
        cmp = compare_outputs(frames, TOL)
        assert isinstance(cmp, Comparison)
        assert cmp.kind is not None or cmp.passed == cmp.trials


async def test_a_failing_comparison_is_an_internal_verdict_not_an_exception() -> None:
    # Nothing a worker sends makes compare_outputs raise; a broken outcome (here: no list of
    # frames at all) stands for a failure of the evaluator itself.
    cmp = await compare_outcome(JobOutcome(final={"ok": True}, tensors=None), bundled_task("norm_softmax"))
    assert cmp.kind == "internal" and cmp.passed == 0
    assert cmp.reasons[0].startswith("the evaluator failed to compare the outputs: TypeError")


def test_uint16_output_of_a_real_candidate_is_an_output_format_verdict(evaluator, build_ws) -> None:
    """The worker sends a uint16 output; the evaluator's process names it instead of crashing."""
    task = bundled_task("ew_scale_bias_gelu").for_target(evaluator.target)
    ws = build_ws(task, """
        import torch
        import torch.nn as nn

        class ModelNew(nn.Module):
            def __init__(self, features, scale):
                super().__init__()
                self.bias = nn.Parameter(torch.zeros(features))

            def forward(self, x):
                return torch.empty(x.shape, dtype=torch.uint16)  # allocation only: the audit passes
    """)
    result = evaluator.verify(task, ws)
    assert not result.ok and result.error_kind.value == "output_format", result
    assert "is torch.uint16" in result.reasons[0] and "expected torch.float32" in result.reasons[0], result.reasons


def test_every_timed_call_returns_the_references_outputs_in_number_shape_and_dtype() -> None:
    """Red team 22 returned one element from the timed calls the re-check could not draw: every
    model call's evidence says what it returned, and each must match the reference's outputs."""
    from cudagym.rewards.compare import calls_shaped

    reference = [({"role": "reference", "trial": 0, "index": 0, "shape": [4, 8], "dtype": "float32"}, b"")]

    def sample(call: int, shape: list[int], dtype: str = "float32", index: int = 0) -> tuple[dict, bytes]:
        return {"role": "sample", "trial": call, "index": index, "full_shape": shape, "dtype": dtype}, b""

    honest = [sample(c, [4, 8]) for c in range(5)]
    assert calls_shaped(honest, reference, list(range(5))) is None
    assert "output 0 is float32 (1,)" in (calls_shaped([*honest[:3], sample(3, [1]), honest[4]], reference,
                                                       list(range(5))) or "")
    assert "float16" in (calls_shaped([*honest[:4], sample(4, [4, 8], "float16")], reference, list(range(5))) or "")
    assert "returned 0 outputs" in (calls_shaped(honest[:4], reference, list(range(5))) or "")
    assert "returned 2 outputs" in (calls_shaped([*honest, sample(2, [4, 8], index=1)], reference,
                                                 list(range(5))) or "")
    assert calls_shaped(honest[:4], reference, list(range(4))) is None, "only the model calls named"
