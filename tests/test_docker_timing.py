"""The docker backend times what the local backend times: baselines, the profile, server mode.

The task (`tests/assets/row_sum_sorted`) sorts each row before summing it; its solution only sums,
so it is correct and faster than eager and torch.compile by two orders of magnitude on any host
load: the +3 milestone is the behaviour under test, not a threshold that load could flip."""

from __future__ import annotations

from pathlib import Path

import pytest

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import resolve_task

from conftest import require_docker

ASSETS = Path(__file__).resolve().parent / "assets" / "row_sum_sorted"


def _evaluate(tmp_path: Path, sandbox: str):
    cfg = EvaluatorConfig(target="cpu", mode="strict", sandbox=sandbox, server_gap_ms=(0.2, 1.0),
                          cache_dir=tmp_path / f"cache-{sandbox}")
    with Evaluator(cfg) as ev:
        task = resolve_task(str(ASSETS / "task.py")).for_target(ev.target)
        ws = Workspace.from_solution(tmp_path / f"ws-{sandbox}", task, ASSETS / "cpu")
        return ev.evaluate(task, ws)


def _assert_timed(v) -> None:
    assert v.correct and v.profile_result is not None and v.profile_result.ok, v.reasons
    p = v.profile_result
    for stats in (p.candidate, p.eager, p.compiled, p.server.candidate, p.server.eager, p.server.compiled):
        assert stats is not None and stats.median_ms > 0, v.reasons
    assert v.candidate_ms and v.eager_ms and v.compile_ms, v.reasons
    assert v.milestone == "faster_than_compile" and v.reward == 3, v.reasons


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_docker_backend_times_like_the_local_backend(tmp_path: Path) -> None:
    require_docker()
    local, docker = _evaluate(tmp_path, "local"), _evaluate(tmp_path, "docker")
    _assert_timed(local)
    _assert_timed(docker)
    assert docker.milestone == local.milestone
