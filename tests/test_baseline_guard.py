"""Baselines are cached for every later episode, so one measured beside a noisy neighbour must
never be (issue 27, point 3): busy processes started beside a real baseline job get it refused,
measured again, and left uncached, and the profile says so. CPU target, real sandboxed jobs.

Asserts are on the mechanism (what was refused and why, what was cached), never on times."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cudagym.core.verdict import ErrorKind
from cudagym.rewards.evaluator import Evaluator
from cudagym.sandbox.baselines import BaselineCache, BaselineGuard, HostLoad, measure_guarded

from conftest import SOLUTIONS, cpu_config, solution_workspace, task_of

TASK = task_of("ew_scale_bias_gelu")


def busy_processes(n: int) -> list[subprocess.Popen[bytes]]:
    """`n` spinning processes, each its own session (as a candidate's job would start them),
    niced so that the other work on this host keeps most of its share."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True,
                             preexec_fn=lambda: os.nice(10)) for _ in range(n)]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def test_a_baseline_measured_beside_busy_processes_is_refused_and_never_cached(tmp_path: Path) -> None:
    ev = Evaluator(cpu_config(tmp_path / "cache"))
    # 3 runnable threads per core are a lower bound beside the busy processes (whatever else runs)
    ev.baselines.guard = BaselineGuard(attempts=2, max_excess_load=1.0)
    task = TASK.for_target(ev.target)
    key = BaselineCache.key(task.digest, ev.device_name, ev.config.timing, ev.config.compile_baseline,
                            ev.library_baselines_for(task))
    ws = solution_workspace(tmp_path / "ws", TASK, SOLUTIONS / TASK.id / "cpu")
    assert ev.compile(TASK, ws).ok
    busy = busy_processes(4 * HostLoad().cores)
    try:
        value = ev._sync(ev.abaselines(TASK))
        profile = ev.profile(TASK, ws)  # measures its baselines again: none were cached
    finally:
        stop(busy)
        ev.close()
    guard = value["guard"]
    assert guard["attempts"] == 2 and len(guard["refused"]) == 2
    assert all(any("runnable threads per core beyond its cores" in why for why in refusal)
               for refusal in guard["refused"])
    assert value["disturbed"] and not value["cached"]
    assert value["notes"][0].startswith("baselines disturbed in all 2 measurements")
    assert ev.baselines.get(key) is None  # nothing a later episode would read
    # the candidate's own timing beside them: measured with the baselines' note, or refused as a busy
    # host when the waits for a CPU stretched its calls' windows (`checks.cpu_windows_tight`), never
    # as tampered
    if profile.ok:
        assert not profile.baselines_cached
        assert profile.reasons[0].startswith("baselines disturbed in all 2 measurements"), profile.reasons
    else:
        assert profile.error_kind == ErrorKind.DEVICE_BUSY, profile
        assert (profile.error or "").startswith("the host's CPUs were busy"), profile.error


def measurements(*spreads: float):
    """A measurement function whose n-th call returns eager times of that spread (IQR/median)."""
    queue = list(spreads)

    async def measure() -> dict:
        s = queue.pop(0)
        return {"eager_ms": [1.0 - s / 2, 1.0 - s / 2, 1.0, 1.0 + s / 2, 1.0 + s / 2], "compile_ms": None}

    return measure, queue


def test_a_disturbed_measurement_is_measured_again_and_the_clean_one_kept(tmp_path: Path) -> None:
    guard = BaselineGuard(attempts=3, max_spread=0.2, max_excess_load=1e9)  # spread only: the host's load varies
    measure, left = measurements(0.9, 0.05, 0.05)
    value = asyncio.run(measure_guarded(measure, guard))
    assert left == [0.05]  # stopped at the first clean one
    assert value["guard"]["attempts"] == 2 and len(value["guard"]["refused"]) == 1
    assert "eager calls spread" in value["guard"]["refused"][0][0]
    assert value["notes"] == ["baselines measured 2 times: 1 disturbed measurement(s) refused (eager calls spread "
                              "90% (interquartile range over median; allowed 20%))"]
    assert not value.get("disturbed")
    cache = BaselineCache(tmp_path)
    cache.put("k", value)
    assert cache.get("k")["eager_ms"] == value["eager_ms"]


def test_every_attempt_disturbed_keeps_the_least_disturbed_uncached(tmp_path: Path) -> None:
    guard = BaselineGuard(attempts=2, max_spread=0.2, max_excess_load=1e9)
    measure, left = measurements(0.9, 0.5)
    value = asyncio.run(measure_guarded(measure, guard))
    assert not left and value["disturbed"] and len(value["guard"]["refused"]) == 2
    with pytest.raises(ValueError, match="never cached"):
        BaselineCache(tmp_path).put("k", value)
    assert BaselineCache(tmp_path).get("k") is None


def test_the_sandboxs_account_of_other_work_refuses_a_measurement() -> None:
    # JobOutcome.host_load (the local sandbox's quiet windows): other work's cores during the loops
    guard = BaselineGuard(attempts=2, max_spread=10, max_excess_load=1e9, max_other_cores=0.5)
    answers = [{"eager_ms": [1.0] * 5, "host_load": {"other_cores": 1.3}},
               {"eager_ms": [1.0] * 5, "host_load": {"other_cores": 0.1}}]

    async def measure() -> dict:
        return answers.pop(0)

    value = asyncio.run(measure_guarded(measure, guard))
    assert value["host_load"]["other_cores"] == 0.1 and not value.get("disturbed")
    assert value["guard"]["refused"] == [
        ["other work used 1.30 cores of the host during the timed loops (allowed 0.5)"]]
