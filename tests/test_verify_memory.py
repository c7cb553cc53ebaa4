"""Memory that scales with the problem (`Evaluator.averify`): verify's two workers side by side or
the reference's job first (`VerifyConfig.layout`), decided by the task's footprint as a
reference-only job measured it; the host memory limit of a job running the candidate's code
scaled by that footprint; a run that ran out of memory before the task was measured run again,
reference first; a run that ran out of device memory beside other jobs run again holding the device
alone; and an error that names `LimitsConfig.memory_mb` where the limit still holds.

On the CPU target, whose limit is the worker's address space (`apply_rlimits`): a task of our own
whose reference holds a 256 MiB weight, verified under a 384 MiB limit, which the candidate's
worker (the reference's weight and the candidate's) cannot fit until the limit scales.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from cudagym.core.verdict import ErrorKind
from cudagym.rewards.evaluator import Evaluator
from cudagym.sandbox.protocol import LimitsConfig, VerifyConfig
from cudagym.selfcheck import reference_as_candidate
from cudagym.tasks.model import Task

from conftest import cpu_config

SMALL = Task(id="mem_small_scale", code="""\
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x * 2.0 + 1.0


def get_inputs():
    return [torch.randn(64, 64)]


def get_init_inputs():
    return []
""")

# a 4096 x 16384 fp32 weight: 256 MiB on the host, built there as KernelBench builds it
WIDE = Task(id="mem_wide_linear", code="""\
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out, bias=False)

    def forward(self, x):
        return self.fc(x)


def get_inputs():
    return [torch.randn(2, 4096)]


def get_init_inputs():
    return [4096, 16384]
""")


class Recording:
    """The evaluator's sandbox, with when each job started and ended (its kind, start, end)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.jobs: list[tuple[str, float, float, int]] = []

    async def run(self, job: Any, device: str, responder: Any = None) -> Any:
        start = time.perf_counter()
        try:
            return await self.inner.run(job, device, responder)
        finally:
            self.jobs.append((job.kind, start, time.perf_counter(), job.limits.memory_mb))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_reference_first_ends_the_reference_job_before_the_candidate_starts(eval_cache: Path, build_ws) -> None:
    """Side by side while the task is unmeasured; once a reference-only job measured it, a task
    above `side_by_side_share` runs reference first: the reference's job is over before the
    candidate's starts, and verify's verdict is the same."""
    cfg = cpu_config(eval_cache, mode="permissive", verify=VerifyConfig(min_own_share=0.0, side_by_side_share=1e-9))
    with Evaluator(cfg) as ev:
        rec = Recording(ev.sandbox)
        ev.sandbox = rec  # type: ignore[assignment]
        assert ev.footprint(SMALL) is None
        first = ev.verify(SMALL, build_ws(SMALL, reference_as_candidate(SMALL.code)))
        assert first.ok, first.error
        assert first.breakdown["reference_first"] == 0.0
        measured = ev.footprint(SMALL)
        assert measured is not None and measured.host_bytes > 0 and measured.device_bytes is None
        rec.jobs.clear()
        second = ev.verify(SMALL, build_ws(SMALL, reference_as_candidate(SMALL.code)))
        assert second.ok, second.error
        assert second.breakdown["reference_first"] == 1.0
        (ref,) = [j for j in rec.jobs if j[0] == "reference"]
        (cand,) = [j for j in rec.jobs if j[0] == "verify"]
        assert ref[2] <= cand[1], rec.jobs


def test_a_wrong_candidate_still_fails_reference_first(eval_cache: Path, build_ws) -> None:
    """The layout changes when the reference runs, not what is compared."""
    cfg = cpu_config(eval_cache, mode="permissive", verify=VerifyConfig(min_own_share=0.0, layout="reference_first"))
    with Evaluator(cfg) as ev:
        wrong = reference_as_candidate(SMALL.code).replace("x * 2.0 + 1.0", "x * 2.0 + 1.5")
        r = ev.verify(SMALL, build_ws(SMALL, wrong))
        assert not r.ok and r.error_kind == ErrorKind.MISMATCH, r.error
        assert r.breakdown["reference_first"] == 1.0


@pytest.fixture(scope="module")
def tight(eval_cache: Path):
    """A CPU evaluator whose jobs get 384 MiB of address space: less than the candidate's worker
    of `WIDE` takes (its reference's 256 MiB weight and the candidate's own)."""
    ev = Evaluator(cpu_config(eval_cache, mode="permissive", verify=VerifyConfig(min_own_share=0.0),
                              limits=LimitsConfig(memory_mb=384)))
    try:
        yield ev
    finally:
        ev.close()


def test_the_host_limit_scales_with_the_measured_reference(tight: Evaluator, build_ws) -> None:
    """Unmeasured, the candidate's worker runs out of its 384 MiB; verify runs once more,
    reference first, with the limit raised by what the reference took, and passes. The next
    verify of the task starts with the raised limit."""
    rec = Recording(tight.sandbox)
    tight.sandbox = rec  # type: ignore[assignment]
    try:
        r = tight.verify(WIDE, build_ws(WIDE, reference_as_candidate(WIDE.code)))
        assert r.ok, r.error
        assert r.breakdown["reference_first"] == 1.0 and r.breakdown["side_by_side_out_of_memory_s"] > 0
        measured = tight.footprint(WIDE)
        assert measured is not None and measured.host_bytes >= 256 << 20
        verify_limits = [j[3] for j in rec.jobs if j[0] == "verify"]
        assert verify_limits[0] == 384 and verify_limits[-1] >= 384 + 256, rec.jobs
        rec.jobs.clear()
        again = tight.verify(WIDE, build_ws(WIDE, reference_as_candidate(WIDE.code)))
        assert again.ok and "side_by_side_out_of_memory_s" not in again.breakdown, again.error
        assert [j[3] for j in rec.jobs if j[0] == "verify"] == [verify_limits[-1]]
    finally:
        tight.sandbox = rec.inner


def test_a_candidate_beyond_the_scaled_limit_is_named_with_memory_mb(tight: Evaluator, build_ws) -> None:
    """A candidate that asks for far more than the reference took fails as `memory_limit`, and
    the error names the limit, `LimitsConfig.memory_mb` and what the reference added."""
    greedy = reference_as_candidate(WIDE.code).replace(
        "        return self.fc(x)",
        "        hog = torch.ones(1 << 31)  # 8 GiB\n        return self.fc(x) + hog[0] * 0")
    r = tight.verify(WIDE, build_ws(WIDE, greedy))
    assert not r.ok and r.error_kind == ErrorKind.MEMORY, r.error
    assert "LimitsConfig.memory_mb" in (r.error or "") and "the task's reference took on the host" in (r.error or "")


# ModelNew of SMALL that reports CUDA's out-of-memory error (as torch raises it when another job holds
# the device's memory) on its first verify, or on every one
OUT_OF_DEVICE_MEMORY = """\
import os
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        mark = os.path.join(os.getcwd(), "ran_out_once")
        if EVERY_TIME or not os.path.exists(mark):
            open(mark, "w").close()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.19 GiB total "
                                         "capacity; 70.02 GiB already allocated by other processes)")
        return x * 2.0 + 1.0
"""
SLOW_HONEST = reference_as_candidate(SMALL.code).replace(
    "        return x * 2.0 + 1.0", "        import time\n        time.sleep(0.1)\n        return x * 2.0 + 1.0")


def test_out_of_device_memory_beside_other_jobs_runs_again_alone(eval_cache: Path, build_ws) -> None:
    """Three verifies at once: one whose first try runs out of device memory, one that always does,
    and an honest one. Each out-of-memory try ran beside other jobs, so its verify runs once more
    with its device alone (`Job.alone`): reference first, and no other job's worker runs while one
    of its jobs does (spans taken where the scheduler hands the worker its job, inside the lease).
    The first then passes and says so; the second, out of memory while alone, fails as
    `memory_limit` after that one retry."""
    cfg = cpu_config(eval_cache, mode="permissive", verify=VerifyConfig(min_own_share=0.0))
    with Evaluator(cfg) as ev:
        spans: list[tuple[str, bool, str, float, float]] = []
        inner = ev.sandbox._run_on  # type: ignore[attr-defined]

        async def run_on(job: Any, device: str, responder: Any, worker: Any) -> Any:
            start = time.perf_counter()
            try:
                return await inner(job, device, responder, worker)
            finally:
                spans.append((job.kind, job.alone, job.workspace, start, time.perf_counter()))

        ev.sandbox._run_on = run_on  # type: ignore[attr-defined]
        once = build_ws(SMALL, OUT_OF_DEVICE_MEMORY.replace("EVERY_TIME", "False"))
        always = build_ws(SMALL, OUT_OF_DEVICE_MEMORY.replace("EVERY_TIME", "True"))
        honest = build_ws(SMALL, SLOW_HONEST)

        async def three() -> list[Any]:
            return list(await asyncio.gather(*(ev.averify(SMALL, ws) for ws in (once, always, honest))))

        r_once, r_always, r_honest = asyncio.run(three())
    assert r_honest.ok and r_honest.breakdown["alone"] == 0.0, r_honest.error
    assert r_once.ok, r_once.error
    assert r_once.breakdown["alone"] == 1.0 and r_once.breakdown["reference_first"] == 1.0
    assert r_once.breakdown["side_by_side_out_of_memory_s"] > 0  # its first try: unmeasured, side by side
    assert any("holding the device alone" in r for r in r_once.reasons), r_once.reasons
    assert not r_always.ok and r_always.error_kind == ErrorKind.MEMORY, r_always.error
    assert "out of memory" in (r_always.error or "") and "held it alone" in (r_always.error or "")
    assert r_always.breakdown["alone"] == 1.0 and r_always.breakdown["side_by_side_out_of_memory_s"] > 0
    tries = {str(ws.root): [s for s in spans if s[0] == "verify" and s[2] == str(ws.root)]
             for ws in (once, always, honest)}
    assert [s[1] for s in tries[str(once.root)]] == [False, True], spans
    assert [s[1] for s in tries[str(always.root)]] == [False, True], spans
    assert [s[1] for s in tries[str(honest.root)]] == [False], spans
    alone = [s for s in spans if s[1]]
    assert len(alone) == 4 and {s[0] for s in alone} == {"verify", "reference"}, spans
    for a in alone:
        beside = [s for s in spans if s is not a and s[3] < a[4] and a[3] < s[4]]
        assert not beside, (a, beside)


def test_out_of_device_memory_reference_first_runs_again_alone(eval_cache: Path, build_ws) -> None:
    """Not only a blind first try: a verify laid out reference first (no retry for the layout's
    sake) whose candidate ran out of device memory while the GPU was shared runs once more alone."""
    cfg = cpu_config(eval_cache, mode="permissive", verify=VerifyConfig(min_own_share=0.0, layout="reference_first"))
    with Evaluator(cfg) as ev:
        r = ev.verify(SMALL, build_ws(SMALL, OUT_OF_DEVICE_MEMORY.replace("EVERY_TIME", "False")))
    assert r.ok, r.error
    assert r.breakdown["alone"] == 1.0 and r.breakdown["shared_out_of_memory_s"] > 0, r.breakdown
    assert "side_by_side_out_of_memory_s" not in r.breakdown


def test_on_a_gpu_a_job_alone_holds_the_lease_alone() -> None:
    """The GPU path of the scheduler (`JobScheduler.run`, one GPU, workers faked): a verify's job
    marked `alone` waits for the checks that hold the GPU, holds its lease exclusive, and a check
    that asks meanwhile waits for it; the lease is shared again once it is over."""
    from cudagym.sandbox.schedule import JobScheduler
    from cudagym.sandbox.worker.wire import Job, JobOutcome

    async def main() -> JobScheduler:
        sched = JobScheduler(release_at_result=True)

        async def ready(device: str) -> str:
            return device

        async def run_on(job: Job, device: str, responder: Any, worker: Any) -> Any:
            await asyncio.sleep(0.05)
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return JobOutcome(final={}), done

        def job(kind: str, alone: bool = False) -> Job:
            return Job(kind=kind, nonce="n", task_id="t", device="cuda", alone=alone)  # type: ignore[arg-type]

        def run(j: Job) -> Any:
            return asyncio.ensure_future(sched.run(j, "cuda", None, ready, run_on, lambda w: None))

        first = [run(job("verify")), run(job("reference"))]
        await asyncio.sleep(0.01)
        alone = run(job("reference", alone=True))
        await asyncio.sleep(0.01)
        later = run(job("verify"))
        await asyncio.wait_for(asyncio.gather(*first, alone, later), 10)
        return sched

    holds = list(asyncio.run(main()).holds)
    assert [(h.kind, h.exclusive) for h in holds] == [("verify", False), ("reference", False), ("reference", True),
                                                      ("verify", False)], holds
    alone = holds[2]
    assert alone.released_s is not None
    for h in holds[:2]:
        assert h.released_s is not None and h.released_s <= alone.acquired_s, holds
    assert alone.released_s <= holds[3].acquired_s, holds
