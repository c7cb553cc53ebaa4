"""Outputs too large to send whole (`VerifyConfig.whole_output_mb`): verify checks them by
evidence (`cudagym.sandbox.worker.verify.output_evidence`: values at positions drawn from a seed
the parent reveals once the outputs exist, and projections of every element) and still catches
an output that is wrong anywhere that matters; the verdict says so.

On the host: the comparison of evidence frames. Then for real, on the CPU target, with a task of
our own (an outer product: a 4 MiB output from 8 KiB of inputs) under a 1 MiB threshold (the
CPU's projections take ~0.3 us per element), and on a GPU (`@pytest.mark.gpu`) with a 309 MiB
output under the default threshold.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cudagym.core.verdict import ErrorKind
from cudagym.rewards.compare import compare_outputs
from cudagym.rewards.evaluator import Evaluator
from cudagym.sandbox.protocol import VerifyConfig
from cudagym.sandbox.timing import PROJECTIONS
from cudagym.sandbox.worker.verify import EVIDENCE_SAMPLES, output_evidence
from cudagym.tasks.model import Task, Tolerance

from conftest import cpu_config

TOL = Tolerance(atol=1e-4, rtol=1e-4)
SEED = 0xC0FFEE_5EED_0001


# -- the comparison, on the host -------------------------------------------------------------------
def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(bytearray(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()))


def evidence_frames(role: str, out: torch.Tensor, trial: int = 0, index: int = 0, seed: int = SEED) -> list:
    """The frames a worker sends for an output above the threshold (`send_evidence`)."""
    values, sums = output_evidence(out, seed, index)
    sums = sums if role == "reference" else sums[:PROJECTIONS]
    head = {"role": role, "trial": trial, "index": index}
    return [({**head, "part": "samples", "of_shape": list(out.shape), "dtype": str(values.dtype)[6:],
              "shape": list(values.shape)}, _raw(values)),
            ({**head, "part": "projections", "dtype": "float64", "shape": list(sums.shape)}, _raw(sums))]


def whole_frame(role: str, out: torch.Tensor, trial: int = 0, index: int = 0) -> tuple:
    return ({"role": role, "trial": trial, "index": index, "dtype": str(out.dtype)[6:], "shape": list(out.shape)},
            _raw(out))


def compared(cand: torch.Tensor, ref: torch.Tensor):
    return compare_outputs(evidence_frames("candidate", cand) + evidence_frames("reference", ref), TOL)


REF = torch.randn(512, 1024, generator=torch.Generator().manual_seed(1))


def test_an_honest_sampled_output_passes_and_is_named() -> None:
    """Errors up to the tolerance, of either sign, pass; the comparison names the output."""
    g = torch.Generator().manual_seed(2)
    honest = REF + (torch.rand(REF.shape, generator=g) * 2 - 1) * (TOL.atol + TOL.rtol * REF.abs()) * 0.999
    cmp = compared(honest, REF)
    assert cmp.kind is None and cmp.passed == 1 and cmp.sampled == [0], cmp
    assert compared(REF.t().contiguous().t(), REF).kind is None  # any strides: row-major positions


def test_an_output_right_only_at_the_sampled_positions_fails_its_projections() -> None:
    """What a candidate that knew the positions would return: the samples agree, the rest is 0."""
    values, _ = output_evidence(REF, SEED, 0)
    gen = torch.Generator().manual_seed(SEED)
    flat = torch.randint(REF.numel(), (EVIDENCE_SAMPLES,), generator=gen)
    forged = torch.zeros(REF.numel())
    forged[flat] = REF.reshape(-1)[flat]
    assert torch.equal(output_evidence(forged.view_as(REF), SEED, 0)[0], values)
    cmp = compared(forged.view_as(REF), REF)
    assert cmp.kind == "mismatch" and "mismatches by its projections" in cmp.reasons[0], cmp


def test_one_element_wrong_beyond_the_projections_bound_is_caught_where_no_sample_fell() -> None:
    """One element of 524288 off by 5 (an honest output's projections differ by at most 1.1
    here), at the first and last elements and at one no sample fell on: a mismatch each time,
    the last by the projections."""
    sampled = output_evidence(REF, SEED, 0)[0]
    unsampled = None
    for at in (0, REF.numel() - 1, *range(1000, 1100)):
        wrong = REF.clone().reshape(-1)
        wrong[at] += 5.0
        if at >= 1000 and not torch.equal(output_evidence(wrong, SEED, 0)[0], sampled):
            continue  # a sample fell there
        cmp = compared(wrong.view_as(REF), REF)
        assert cmp.kind == "mismatch", (at, cmp)
        if at >= 1000:
            unsampled = cmp.reasons[0]
            break
    assert unsampled is not None and "mismatches by its projections" in unsampled


def test_integer_outputs_are_checked_exactly() -> None:
    ref = torch.randint(-100, 100, (700, 700), generator=torch.Generator().manual_seed(3))
    assert compared(ref.clone(), ref).kind is None
    off = ref.clone()
    off[300, 300] += 1
    assert compared(off, ref).kind == "mismatch"


def test_evidence_that_does_not_match_the_reference_is_an_output_format_error() -> None:
    """Another shape; a whole output where the reference's came as evidence (and the reverse);
    samples without projections; projections that are not float64; a part sent twice."""
    cand = evidence_frames("candidate", REF)
    ref = evidence_frames("reference", REF)
    cases = {
        "expected": evidence_frames("candidate", REF.reshape(1024, 512)) + ref,
        "whole, the reference's as evidence": [whole_frame("candidate", REF)] + ref,
        "as evidence, the reference's whole": cand + [whole_frame("reference", REF)],
        "samples without projections": cand[:1] + ref,
        "torch.float32 projections": [cand[0], ({**cand[1][0], "dtype": "float32", "shape": [2 * PROJECTIONS]},
                                                cand[1][1])] + ref,
        "sent twice": cand + cand[1:] + ref,
    }
    for needle, frames in cases.items():
        cmp = compare_outputs(frames, TOL)
        assert cmp.kind == "output_format" and needle in " ".join(cmp.reasons), (needle, cmp)
    bad_shape = [({**cand[0][0], "of_shape": [-1, 3]}, cand[0][1]), cand[1]] + ref
    assert compare_outputs(bad_shape, TOL).kind == "output_format"


# -- for real, on the CPU target ----------------------------------------------------------------------
N = 1024  # a 4 MiB fp32 output, over the tests' 1 MiB threshold
OUTER = Task(id="outer_large", code=f"""\
import torch
import torch.nn as nn

N = {N}


class Model(nn.Module):
    def forward(self, a, b):
        return torch.outer(a, b)


def get_inputs():
    return [torch.randn(N), torch.randn(N)]


def get_init_inputs():
    return []
""")

# out[k] = a[k / m] * b[k % m] where computed: outside [zero_from, zero_to) and at every
# `every`-th element; 0 elsewhere. `bump` is added at element `bump_at` (-1: none).
OUTER_CPP = """\
#include <cstdint>
extern "C" void outer(const float* a, const float* b, float* out, int64_t n, int64_t m, int64_t zero_from,
                      int64_t zero_to, int64_t every, int64_t bump_at, float bump) {
    for (int64_t k = 0; k < n * m; ++k) {
        bool computed = (k < zero_from || k >= zero_to) && k % every == 0;
        out[k] = computed ? a[k / m] * b[k % m] : 0.0f;
    }
    if (bump_at >= 0) out[bump_at] += bump;
}
"""


def outer_model(zero_from: int = 0, zero_to: int = 0, every: int = 1, bump_at: int = -1, bump: float = 0.0,
                before: str = "") -> str:
    return f"""\
import ctypes
import torch
import torch.nn as nn
from cudagym.runtime import kernel_library, ptr

_lib = kernel_library()
_lib.outer.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6 + [ctypes.c_float]
_lib.outer.restype = None


class ModelNew(nn.Module):
    def forward(self, a, b):
{before}
        out = torch.empty(a.numel(), b.numel())
        _lib.outer(ptr(a), ptr(b), ptr(out), a.numel(), b.numel(), {zero_from}, {zero_to}, {every}, {bump_at}, {bump})
        return out
"""


@pytest.fixture(scope="module")
def sampling_evaluator(eval_cache: Path):
    ev = Evaluator(cpu_config(eval_cache, verify=VerifyConfig(whole_output_mb=1)))
    try:
        yield ev
    finally:
        ev.close()


def verify(ev: Evaluator, build_ws, model_new: str, task: Task = OUTER):
    return ev.verify(task, build_ws(task, model_new, {"kernels/outer.cpp": OUTER_CPP}))


def test_an_honest_kernel_with_a_large_output_passes_checked_by_evidence(sampling_evaluator, build_ws) -> None:
    v = verify(sampling_evaluator, build_ws, outer_model())
    assert v.ok and v.trials_passed == v.trials >= 5, v.reasons
    assert v.sampled_outputs == [0]
    assert any("checked by samples and projections" in r for r in v.reasons), v.reasons
    small = OUTER.resized(N=256)  # 256 KiB: whole, element by element
    v = verify(sampling_evaluator, build_ws, outer_model(), small)
    assert v.ok and v.sampled_outputs == [] and not any("projections" in r for r in v.reasons), v.reasons


def test_an_output_computed_at_every_other_element_is_a_mismatch(sampling_evaluator, build_ws) -> None:
    v = verify(sampling_evaluator, build_ws, outer_model(every=2))
    assert v.error_kind == ErrorKind.MISMATCH and v.sampled_outputs == [0], v.reasons


def test_a_small_region_left_wrong_is_a_mismatch(sampling_evaluator, build_ws) -> None:
    """A block of 0.1% of the output left 0, and one element of a million off by 10 (an honest
    output's projections differ by at most 1.5 here)."""
    v = verify(sampling_evaluator, build_ws, outer_model(zero_from=500_000, zero_to=501_048))
    assert v.error_kind == ErrorKind.MISMATCH and v.sampled_outputs == [0], v.reasons
    v = verify(sampling_evaluator, build_ws, outer_model(bump_at=654_321, bump=10.0))
    assert v.error_kind == ErrorKind.MISMATCH, v.reasons


STEAL_CHANNEL = {  # the harness's result channel, found from forward
    "frames": """\
        import sys
        f, ch = sys._getframe(1), None
        while f is not None and ch is None:
            ch = next((v for v in f.f_locals.values() if type(v).__name__ == "Channel"), None)
            f = f.f_back""",
    "objects": """\
        import gc
        ch = next(o for o in (gc.unfreeze(), gc.get_objects())[1] if type(o).__name__ == "Channel")""",
}


@pytest.mark.parametrize("how,needle", [("frames", "evidence seed"), ("objects", "gc.get_objects is refused")])
def test_asking_for_the_evidence_seed_before_the_outputs_exist_is_tamper(sampling_evaluator, build_ws, how: str,
                                                                          needle: str) -> None:
    """A forward that finds the harness's result channel and asks for its trial's evidence seed
    itself (to know the positions) gets it, and the harness's own request is then refused; the
    object graph's search that found the channel is refused itself (red team 14's b searched it)."""
    steal = STEAL_CHANNEL[how] + """
        trial = getattr(self, "trial", 0)
        self.trial = trial + 1
        self.seed = ch.request("evidence", index=trial)["seed"]"""
    v = verify(sampling_evaluator, build_ws, outer_model(before=steal))
    assert v.error_kind == ErrorKind.TAMPER and needle in (v.error or ""), (v.error_kind, v.reasons)


# -- on a GPU, under the default threshold ----------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_permissive(tmp_path_factory: pytest.TempPathFactory):
    """What `cudagym tasks selfcheck` verifies with: permissive, no own-kernel share."""
    from cudagym.rewards.evaluator import EvaluatorConfig

    cfg = EvaluatorConfig(target="cuda", cache_dir=tmp_path_factory.mktemp("cache"), compile_baseline=False,
                          mode="permissive", verify=VerifyConfig(min_own_share=0.0))
    with Evaluator(cfg) as ev:
        yield ev


WRONG_ROW = """\
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, a, b):
        out = torch.outer(a, b)
        out[4000] = 0  # one row of 9000: 0.011% of the output
        return out
"""


@pytest.mark.gpu
def test_a_309_mib_output_on_a_gpu_is_checked_by_evidence(gpu_permissive, tmp_path) -> None:
    """The reference as its own candidate passes, its output (over the default 256 MiB) checked by
    evidence; the same with one row left 0 is a mismatch."""
    from cudagym.sandbox.workspace import Workspace
    from cudagym.selfcheck import reference_as_candidate

    task = OUTER.resized(N=9000)
    assert VerifyConfig().whole_output_mb << 20 < 4 * 9000**2
    ws = Workspace.create(tmp_path / "honest", task)
    ws.write("model_new.py", reference_as_candidate(task.code))
    v = gpu_permissive.verify(task, ws)
    assert v.ok and v.sampled_outputs == [0], v.reasons
    ws = Workspace.create(tmp_path / "wrong", task)
    ws.write("model_new.py", WRONG_ROW)
    v = gpu_permissive.verify(task, ws)
    assert v.error_kind == ErrorKind.MISMATCH and v.sampled_outputs == [0], v.reasons
