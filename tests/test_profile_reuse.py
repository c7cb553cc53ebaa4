"""No timing job twice for the same evidence (`cudagym.rewards.reuse`): a submit takes its
episode's profile of the same build, files, task and settings, verifies again, says so; anything
changed is timed again. CPU target, real evaluator and sandbox; the jobs a call ran are recorded
by a wrapper around the sandbox's `run`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cudagym.core.verdict import ErrorKind, ProfileResult
from cudagym.env.kernel_env import KernelEnv
from cudagym.rewards.evaluator import Evaluator
from cudagym.rewards.reuse import REUSED, ProfileMemo
from cudagym.sandbox.protocol import TimingConfig
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.model import Target

from conftest import SOLUTIONS, solution_workspace, task_of

TASK = task_of("ew_scale_bias_gelu").for_target(Target.CPU)


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    return solution_workspace(tmp_path / "ws", TASK, SOLUTIONS / TASK.id / "cpu")


def profiled(evaluator: Evaluator, ws: Workspace) -> tuple[ProfileMemo, ProfileResult]:
    """An episode's memo after one profile of `ws`."""
    memo = ProfileMemo()
    p = asyncio.run(evaluator.aprofile(TASK, ws))
    assert p.ok and p.evidence, p.reasons
    memo.record(p)
    return memo, p


def test_a_submit_reuses_its_episodes_profile_of_the_same_build_and_verifies_again(
        evaluator: Evaluator, ws: Workspace, jobs: list[str]) -> None:
    memo, p = profiled(evaluator, ws)
    jobs.clear()
    v = evaluator.evaluate(TASK, ws, profiled=memo)
    assert v.correct and v.reward >= 1, v.reasons
    assert v.timing_reused and v.summary()["timing_reused"] is True
    assert any(r.startswith(REUSED) and "verify ran again" in r for r in v.reasons), v.reasons
    assert v.candidate_ms == p.candidate.median_ms  # type: ignore[union-attr]
    assert "verify" in jobs and "profile" not in jobs, jobs  # verified again, not timed again
    assert v.profile_result is not None and v.profile_result.reused


def test_without_the_memo_or_with_reuse_off_the_submit_times_again(evaluator: Evaluator, ws: Workspace,
                                                                   jobs: list[str]) -> None:
    memo, _ = profiled(evaluator, ws)
    jobs.clear()
    v = evaluator.evaluate(TASK, ws)
    assert v.correct and not v.timing_reused and "profile" in jobs
    off = Evaluator(evaluator.config.model_copy(update={"reuse_profiles": False}), sandbox=evaluator.sandbox)
    jobs.clear()
    v = off.evaluate(TASK, ws, profiled=memo)
    assert v.correct and not v.timing_reused and "profile" in jobs


def test_a_changed_file_is_timed_again(evaluator: Evaluator, ws: Workspace, jobs: list[str]) -> None:
    memo, _ = profiled(evaluator, ws)
    ws.write("model_new.py", ws.read("model_new.py") + "\n# a comment: the same build, other files\n")
    jobs.clear()
    v = evaluator.evaluate(TASK, ws, profiled=memo)
    assert v.correct and not v.timing_reused and "profile" in jobs
    assert not any(r.startswith(REUSED) for r in v.reasons)


def test_a_changed_timing_config_is_timed_again(evaluator: Evaluator, ws: Workspace, jobs: list[str]) -> None:
    memo, _ = profiled(evaluator, ws)
    timing = evaluator.config.timing.model_copy(update={"stop": "fixed"})
    other = Evaluator(evaluator.config.model_copy(update={"timing": timing}), sandbox=evaluator.sandbox)
    assert other.config.timing != evaluator.config.timing
    jobs.clear()
    v = other.evaluate(TASK, ws, profiled=memo)
    assert v.correct and not v.timing_reused and "profile" in jobs


def test_a_reused_profile_is_audited_against_the_submits_verify(evaluator: Evaluator, ws: Workspace,
                                                                jobs: list[str]) -> None:
    """The timed calls' reported ops of the profile reused go through the submit's audit: a
    torch compute op among them (strict mode) fails the submit, as in its own timing job."""
    _, p = profiled(evaluator, ws)
    memo = ProfileMemo()
    memo.record(p.model_copy(update={"timed_ops": [{**p.timed_ops[0], "aten::mm": 3}]}))
    jobs.clear()
    v = evaluator.evaluate(TASK, ws, profiled=memo)
    assert v.reward < 0 and v.error_kind == ErrorKind.AUDIT, v.reasons
    assert any("aten::mm" in r for r in v.reasons) and "profile" not in jobs


def test_the_memo_keeps_the_first_accepted_profile_and_closes_on_the_candidates_refusal() -> None:
    def accepted(key: str, ms: float) -> ProfileResult:
        return ProfileResult(ok=True, evidence=key, speedup_vs_eager=ms)

    memo = ProfileMemo()
    memo.record(accepted("k", 1.0))
    memo.record(accepted("k", 2.0))  # the same build profiled again: the first one stands
    memo.record(ProfileResult(ok=True))  # no evidence (not keyed): never reused
    assert memo.lookup("k") is not None and memo.lookup("k").speedup_vs_eager == 1.0  # type: ignore[union-attr]
    assert memo.lookup("other") is None
    for harness_side in (ErrorKind.INTERNAL, ErrorKind.DEVICE_BUSY, ErrorKind.COMPILE):
        memo.record(ProfileResult(ok=False, error_kind=harness_side))
    assert memo.lookup("k") is not None and memo.closed is None
    memo.record(ProfileResult(ok=False, error_kind=ErrorKind.MISMATCH))  # a run the checks caught
    assert memo.lookup("k") is None and memo.closed and "mismatch" in memo.closed
    memo.record(accepted("k2", 1.0))
    assert memo.lookup("k2") is None  # closed for the rest of the episode


def test_the_evidence_is_the_same_for_the_same_build_and_differs_with_the_settings(
        evaluator: Evaluator, ws: Workspace, tmp_path: Path) -> None:
    """Two workspaces of the same files (another episode's directory) have the same evidence; a
    setting that decides a profile changes it, the reward's values do not."""
    built = evaluator.toolchain.build(ws, Target.CPU)
    twin = solution_workspace(tmp_path / "twin", TASK, SOLUTIONS / TASK.id / "cpu")
    key = evaluator.evidence(TASK, ws.source_digest(), built)
    assert evaluator.evidence(TASK, twin.source_digest(), evaluator.toolchain.build(twin, Target.CPU)) == key
    reward = evaluator.config.reward.model_copy(update={"eager_margin": 0.2})
    same = Evaluator(evaluator.config.model_copy(update={"reward": reward}), sandbox=evaluator.sandbox)
    assert same.evidence(TASK, ws.source_digest(), built) == key
    for change in ({"timing": TimingConfig(min_calls=11, max_calls=20, target_ms=100, warmup_calls=2)},
                   {"mode": "permissive"}, {"roofline_slack": 0.4}):
        other = Evaluator(evaluator.config.model_copy(update=change), sandbox=evaluator.sandbox)
        assert other.evidence(TASK, ws.source_digest(), built) != key, change
    assert evaluator.evidence(TASK.model_copy(update={"code": TASK.code + "\n"}), ws.source_digest(),
                               built) != key


def test_an_episode_that_profiled_then_submitted_reuses_through_the_env(evaluator: Evaluator, tmp_path: Path,
                                                                       jobs: list[str]) -> None:
    """The env keeps the episode's profiles and hands them to its submit; a new episode starts empty."""
    env = KernelEnv(tasks=[TASK], evaluator=evaluator, workspace_root=tmp_path / "eps", max_turns=8)
    try:
        env.reset(options={"task": TASK.id})
        assert env.workspace is not None
        sol = SOLUTIONS / TASK.id / "cpu"
        env.workspace.write("model_new.py", (sol / "model_new.py").read_text())
        for p in sorted((sol / "kernels").iterdir()):
            env.workspace.write(f"kernels/{p.name}", p.read_text())
        env.step({"name": "compile", "arguments": {}})
        obs, _, _, _, info = env.step({"name": "profile", "arguments": {}})
        assert info["calls"][0]["ok"], obs
        jobs.clear()
        obs, reward, term, _, info = env.step({"name": "submit", "arguments": {}})
        assert term and reward >= 1 and info["verdict"]["timing_reused"] is True, obs
        assert "timing reused" in obs and "profile" not in jobs
    finally:
        env.close()
