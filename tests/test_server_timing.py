"""Server-mode timing (CUDA-L2): every call of a profile's second job arrives after a seeded idle
gap, and its times are reported beside the offline ones, held to the same checks. Real sandbox,
CPU target."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cudagym.cli import app
from cudagym.env.format import format_profile
from cudagym.rewards.evaluator import Evaluator

from conftest import SOLUTIONS, cpu_config, solution_workspace, task_of

TASK = task_of("ew_residual_relu_clamp")


@pytest.fixture(scope="module")
def server_evaluator(tmp_path_factory):
    with Evaluator(cpu_config(tmp_path_factory.mktemp("server-cache"), server_gap_ms=(2.0, 6.0))) as ev:
        yield ev


def test_a_profile_reports_server_mode_beside_offline(server_evaluator: Evaluator, tmp_path) -> None:
    task = TASK.for_target(server_evaluator.target)
    ws = solution_workspace(tmp_path / "ws", task, SOLUTIONS / TASK.id / "cpu")
    p = server_evaluator.profile(task, ws)
    assert p.ok and p.server is not None, (p.reasons, p.error)
    s = p.server
    assert s.gap_ms == (2.0, 6.0)
    assert s.candidate.n >= 10 and s.eager is not None and s.speedup_vs_eager is not None
    assert s.speedup_vs_eager == pytest.approx(s.eager.median_ms / s.candidate.median_ms)
    assert "server_s" in p.breakdown
    text = format_profile(p, 4000)
    assert "Server mode (calls after 2-6 ms idle gaps)" in text, text
    v = server_evaluator.evaluate(task, ws)
    assert v.reward >= 1 and v.server is not None and v.server.candidate.n >= 10, v.summary()


def test_a_profile_without_server_mode_has_none(evaluator: Evaluator, tmp_path) -> None:
    task = TASK.for_target(evaluator.target)
    ws = solution_workspace(tmp_path / "ws", task, SOLUTIONS / TASK.id / "cpu")
    p = evaluator.profile(task, ws)
    assert p.ok and p.server is None and "server_s" not in p.breakdown


@pytest.mark.parametrize("gaps", ["5,1", "abc", "1,2,3", "0,5000"])
def test_bad_server_gaps_are_refused_by_check(gaps: str, tmp_path) -> None:
    result = CliRunner().invoke(app, ["check", TASK.id, str(SOLUTIONS / TASK.id / "cpu"), "--target", "cpu",
                                      "--server-gaps", gaps])
    assert result.exit_code == 2, result.output
    assert "server-gaps" in result.output
