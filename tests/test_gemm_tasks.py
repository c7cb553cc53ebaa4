"""The half-precision GEMM task family: drawn deterministically, spread over its shape classes,
written by `cudagym tasks gemm`, loaded like any parquet, and verified on the CPU target with the
reference as the candidate."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from cudagym.cli import app
from cudagym.errors import TaskError
from cudagym.rewards.evaluator import Evaluator
from cudagym.rewards.milestone import RewardConfig, milestone_verdict
from cudagym.core.verdict import CompileResult, ProfileResult, TimingStats, VerifyResult
from cudagym.sandbox.library import LIBRARY_BASELINES
from cudagym.tasks.gemm import GEMM_SOURCE, GEMM_TOLERANCE, SHAPE_CLASSES, gemm_configs, gemm_task
from cudagym.tasks.loaders import load_tasks
from cudagym.tasks.model import Target

from conftest import cpu_config, make_workspace


def test_same_seed_same_configs_and_another_seed_others():
    assert gemm_configs(40, seed=3) == gemm_configs(40, seed=3)
    assert gemm_configs(40, seed=3) != gemm_configs(40, seed=4)
    assert gemm_configs(10, seed=3) == gemm_configs(40, seed=3)[:10]  # a prefix: a larger family extends it


def test_configs_spread_over_classes_alignment_and_dtypes():
    configs = gemm_configs(60, seed=0)
    assert len({(c.m, c.n, c.k, c.dtype) for c in configs}) == 60
    assert {c.shape_class for c in configs} == set(SHAPE_CLASSES)
    assert {c.dtype for c in configs} == {"float16", "bfloat16"}
    for c in configs:
        sides = (c.m, c.n, c.k)
        if c.aligned:
            assert all(s % 128 == 0 for s in sides if not (c.shape_class == "skinny" and s <= 64)), c
        else:
            assert any(s % 8 for s in sides), c
        if c.shape_class == "square":
            assert c.m == c.n == c.k
        if c.shape_class == "skinny":
            assert min(c.m, c.n) <= 64 and max(c.m, c.n) >= 1024
        if c.shape_class == "deep":
            assert c.k >= 8192
    assert {c.aligned for c in configs} == {True, False}


def test_bad_arguments_are_clear_errors():
    with pytest.raises(TaskError, match="dtypes must be among"):
        gemm_configs(4, dtypes=("float32",))
    with pytest.raises(TaskError, match="at least one"):
        gemm_configs(0)


def test_cpu_sizes_keep_the_shape_class():
    for c in gemm_configs(30, seed=1):
        task = gemm_task(c).for_target(Target.CPU)
        m, n, k = (task.sizes[x] for x in ("M", "N", "K"))
        assert max(m, n, k) <= 64
        if c.shape_class == "square":
            assert m == n == k
        if not c.aligned:
            assert any(s % 8 for s in (m, n, k)), (c, m, n, k)


def test_cli_writes_a_family_that_loads_and_verifies_on_the_cpu(tmp_path, eval_cache):
    out = tmp_path / "gemm"
    result = CliRunner().invoke(app, ["tasks", "gemm", "--configs", "12", "--seed", "7", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "12 GEMM tasks" in result.output
    tasks = load_tasks(out / "gemm.parquet")
    assert [t.id for t in tasks] == [c.id for c in gemm_configs(12, seed=7)]
    for t in tasks:
        assert t.source == GEMM_SOURCE and t.ops == ["matmul"]
        assert t.effective_tolerance == GEMM_TOLERANCE[t.dtype]
        assert t.metadata["shape_class"] in SHAPE_CLASSES
    again = tmp_path / "again"
    CliRunner().invoke(app, ["tasks", "gemm", "--configs", "12", "--seed", "7", "--out", str(again)])
    assert [t.code for t in load_tasks(again / "gemm.parquet")] == [t.code for t in tasks]

    # one task of each dtype, verified on the CPU target with the reference as the candidate
    picked = [next(t for t in tasks if t.dtype == d) for d in ("float16", "bfloat16")]
    with Evaluator(cpu_config(eval_cache, mode="permissive")) as ev:
        for t in picked:
            task = t.for_target(ev.target)
            ws = make_workspace(tmp_path / f"ws_{t.id}", task, re.sub(r"\bModel\b", "ModelNew", task.code))
            v = ev.verify(task, ws)
            # correct on every trial (the audit refuses it, rightly: no kernel of its own)
            assert v.correct and v.trials_passed == v.trials == 6, (t.id, v.error)


def test_cli_refuses_an_unknown_dtype(tmp_path):
    result = CliRunner().invoke(app, ["tasks", "gemm", "--configs", "4", "--dtypes", "int8", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "dtypes must be among" in result.output


def test_library_baselines_are_reported_unavailable_on_the_cpu_and_the_reward_falls_back(tmp_path, eval_cache):
    """A GEMM task's baseline job on the CPU target runs its eager loop, skips the cuBLASLt
    baselines with the reason (a real worker: the skipped roles pass the call feed), and a reward
    configured against autotuned cuBLASLt is judged against torch.compile, saying so."""
    task = gemm_task(gemm_configs(1, seed=3)[0])
    with Evaluator(cpu_config(eval_cache, mode="permissive")) as ev:
        assert ev.library_baselines_for(task) == LIBRARY_BASELINES
        task = task.for_target(ev.target)
        ws = make_workspace(tmp_path / "ws", task, re.sub(r"\bModel\b", "ModelNew", task.code))
        p = ev.profile(task, ws)
        assert p.ok and p.eager is not None and p.library == {} and p.speedup_vs_library == {}, p.error
        for title in ("cuBLASLt (heuristic)", "cuBLASLt (autotuned)"):
            assert any(r.startswith(f"{title} baseline unavailable: cuBLASLt baselines need a CUDA GPU")
                       for r in p.reasons), p.reasons
    verify = VerifyResult(ok=True, correct=True, trials=6, trials_passed=6)
    v = milestone_verdict(CompileResult(ok=True), verify, p, RewardConfig(against=("eager", "cublaslt_tuned")))
    assert "no cuBLASLt (autotuned) baseline for this task: this milestone is against torch.compile" in v.reasons
    assert v.library_ms == {} and v.reward >= 1


def _profiled(**speedups: float) -> ProfileResult:
    """A profile in which the candidate took 1 ms and each named baseline `speedup` ms."""
    stats = lambda ms: TimingStats.from_samples([ms] * 5)  # noqa: E731
    lib = {n: s for n, s in speedups.items() if n in LIBRARY_BASELINES}
    return ProfileResult(ok=True, candidate=stats(1.0), eager=stats(speedups["eager"]),
                         compiled=stats(speedups["compiled"]),
                         speedup_vs_eager=speedups["eager"], speedup_vs_compile=speedups["compiled"],
                         library={n: stats(s) for n, s in lib.items()}, speedup_vs_library=lib)


@pytest.mark.parametrize("against, tuned, reward", [
    (("eager", "compiled"), 1.5, 3.0),          # default: faster than eager and torch.compile
    (("eager", "cublaslt_tuned"), 1.5, 3.0),    # and than autotuned cuBLASLt
    (("eager", "cublaslt_tuned"), 1.02, 2.0),   # within the margin of autotuned cuBLASLt: +2 only
    (("cublaslt", "cublaslt_tuned"), 0.9, 1.0),  # slower than both cuBLASLt baselines
])
def test_the_speed_milestones_can_be_against_any_baseline(against, tuned, reward):
    p = _profiled(eager=2.0, compiled=1.6, cublaslt=tuned, cublaslt_tuned=tuned)
    v = milestone_verdict(CompileResult(ok=True), VerifyResult(ok=True, correct=True, trials=6, trials_passed=6), p,
                          RewardConfig(against=against))
    assert v.reward == reward, v.reasons
    assert v.speedup_vs_library == {"cublaslt": tuned, "cublaslt_tuned": tuned}
    named = {"compiled": "torch.compile", "cublaslt_tuned": "cuBLASLt (autotuned)", "cublaslt": "cuBLASLt (heuristic)"}
    assert any(r.startswith(f"speedup vs {named[against[1]]} ") for r in v.reasons), v.reasons


def test_reward_against_is_checked_on_the_command_line(tmp_path):
    result = CliRunner().invoke(app, ["check", "elementwise_relu", str(tmp_path / "x.py"),
                                      "--reward-against", "eager,cublas"])
    assert result.exit_code == 2
    text = " ".join(result.output.replace("│", " ").split())  # the error box wraps its lines
    assert "takes two of eager, compiled, cublaslt, cublaslt_tuned, comma-separated" in text, result.output
