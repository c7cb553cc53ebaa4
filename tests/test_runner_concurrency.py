"""16 concurrent episodes with the real evaluator on the CPU target, on a 2-core machine."""

import os

import pytest
from rich.console import Console

from cudagym.agent.runner import RunConfig, arun
from cudagym.agent.scripted import ScriptedPolicy
from cudagym.agent.store import TrajectoryStore
from cudagym.rewards.evaluator import EvaluatorConfig

TASK = "ew_scale_bias_gelu"
_SCRIPT = ScriptedPolicy(structured=True)


async def write_then_submit(messages, tools, context):
    """Writes the stored solution, then submits: two turns, one real evaluation per episode."""
    turn = await _SCRIPT.aact(messages, tools, context.model_copy(update={"turn": 0}))
    if context.turn == 0:
        return turn
    return {"name": "submit", "arguments": {}}


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_sixteen_concurrent_episodes_finish(tmp_path):
    cfg = RunConfig(tasks=TASK, policy="test_runner_concurrency:write_then_submit", episodes=16, concurrency=16,
                    evaluator=EvaluatorConfig(target="cpu"), out=tmp_path / "run")
    summary = await arun(cfg, Console(file=open(os.devnull, "w")))  # noqa: SIM115 - lives as long as the run
    assert summary.ran == 16
    eps = TrajectoryStore(tmp_path / "run").summaries()
    assert len(eps) == 16 and len({e["episode_id"] for e in eps}) == 16
    assert all(e["status"] == "done" for e in eps), [e.get("error") for e in eps]
    wrong = [(e["verdict"]["reasons"], e["verdict"].get("error")) for e in eps if not e["verdict"]["correct"]]
    assert not wrong, wrong
    assert summary.rows[0].pass_rate == 1.0
