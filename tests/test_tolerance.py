"""Tolerance by source (ours for bundled and corpus tasks, KernelBench's for everything else), a
task's own tolerance over the default, and the overrides of `cudagym check`, `cudagym run` and the env."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gymnasium
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import cudagym.env  # noqa: F401 - registers cudagym/Kernel-v0
from cudagym.agent.runner import RunConfig, arun
from cudagym.agent.store import TrajectoryStore
from cudagym.env import ENV_ID, KernelEnv
from cudagym.errors import ConfigError, TaskError
from cudagym.rewards.evaluator import EvaluatorConfig
from cudagym.tasks.loaders import bundled_task, load_parquet, load_task_dir, load_task_file, load_tasks, resolve_task
from cudagym.tasks.model import (
    CORPUS_SOURCE, KERNELBENCH_TOLERANCE, OWN_TOLERANCE, Task, Tolerance, default_tolerance, optional_tolerance,
)

REPO = Path(__file__).resolve().parent.parent
OURS_FP32 = Tolerance(atol=1e-4, rtol=1e-4)
HALF = Tolerance(atol=1e-2, rtol=1e-2)
KB = Tolerance(atol=1e-2, rtol=1e-2)
REFERENCE = bundled_task("ew_scale_bias_gelu").code  # a valid KernelBench-format reference


def test_default_tolerance_by_source() -> None:
    assert OWN_TOLERANCE["float32"] == OURS_FP32 and KERNELBENCH_TOLERANCE == KB
    for source in ("bundled", CORPUS_SOURCE):
        assert default_tolerance(source, "float32") == OURS_FP32
        assert default_tolerance(source, "float16") == default_tolerance(source, "bfloat16") == HALF
    for source in ("file", "kernelbench", "ops6k", "parquet", "anything else"):
        for dtype in ("float32", "float16", "bfloat16", "float64"):
            assert default_tolerance(source, dtype) == KB
    assert Task(id="t", code=REFERENCE).effective_tolerance == OURS_FP32  # built in Python: ours


def test_kernelbench_files_and_directories_default_to_kernelbench(tmp_path) -> None:
    (tmp_path / "level1").mkdir()
    (tmp_path / "level1" / "19_ReLU.py").write_text(REFERENCE)
    (tmp_path / "level1" / "20_Half.py").write_text(REFERENCE)
    one = load_task_file(tmp_path / "level1" / "19_ReLU.py")
    assert one.effective_tolerance == KB
    assert [t.effective_tolerance for t in load_task_dir(tmp_path)] == [KB, KB]
    assert resolve_task(str(tmp_path / "level1" / "19_ReLU")).effective_tolerance == KB
    assert load_task_file(tmp_path / "level1" / "20_Half.py", dtype="float16").effective_tolerance == KB
    mine = Tolerance(atol=3e-3, rtol=0.0)
    assert load_task_file(tmp_path / "level1" / "19_ReLU.py", tolerance=mine).effective_tolerance == mine


def test_bundled_tasks_keep_ours_and_the_manifest_wins() -> None:
    assert bundled_task("ew_scale_bias_gelu").effective_tolerance == OURS_FP32
    assert bundled_task("norm_softmax").effective_tolerance == Tolerance(atol=1e-6, rtol=1e-4)  # its manifest entry
    assert all(t.source == "bundled" for t in load_tasks("bundled"))


def test_parquet_defaults_by_data_source_and_explicit_columns_win(tmp_path) -> None:
    def table(source: str, **extra: list) -> Path:
        path = tmp_path / f"{source}-{len(extra)}.parquet"
        pq.write_table(pa.table({"ops": [["gelu"]] * 3, "data_source": [source] * 3, "code": [REFERENCE] * 3,
                                 "dtype": ["float32", "float16", "bfloat16"], **extra}), path)
        return path

    ops6k = load_parquet(table("ops6k"))
    assert [t.effective_tolerance for t in ops6k] == [KB, KB, KB]
    corpus = load_parquet(table(CORPUS_SOURCE))
    assert [t.effective_tolerance for t in corpus] == [OURS_FP32, HALF, HALF]
    for source in ("ops6k", CORPUS_SOURCE):
        explicit = load_parquet(table(source, atol=[5e-3, None, 0.0], rtol=[1e-3, None, 0.5]))
        assert [t.effective_tolerance for t in explicit] == [
            Tolerance(atol=5e-3, rtol=1e-3), default_tolerance(source, "float16"), Tolerance(atol=0.0, rtol=0.5)]


def test_parquet_tolerance_errors_name_the_row(tmp_path) -> None:
    lone = tmp_path / "lone.parquet"
    pq.write_table(pa.table({"ops": [["gelu"]] * 2, "data_source": ["x"] * 2, "code": [REFERENCE] * 2,
                             "atol": [1e-3, 1e-3], "rtol": [1e-3, None]}), lone)
    with pytest.raises(TaskError, match=r"lone\.parquet row 1: atol and rtol go together"):
        load_parquet(lone)
    negative = tmp_path / "negative.parquet"
    pq.write_table(pa.table({"ops": [["gelu"]], "data_source": ["x"], "code": [REFERENCE],
                             "atol": [-1e-3], "rtol": [1e-3]}), negative)
    with pytest.raises(TaskError, match=r"negative\.parquet row 0: bad tolerance atol=-0\.001"):
        load_parquet(negative)


def test_optional_tolerance_is_both_or_neither() -> None:
    assert optional_tolerance(None, None) is None
    assert optional_tolerance(0.0, 1e-3) == Tolerance(atol=0.0, rtol=1e-3)
    with pytest.raises(ValueError, match=r"give both or neither \(only atol was given\)"):
        optional_tolerance(1e-3, None)
    with pytest.raises(ValueError, match=r"only rtol was given"):
        optional_tolerance(None, 1e-3)
    for bad in (-1e-3, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="both must be finite numbers >= 0"):
            optional_tolerance(bad, 1e-3)


# -- the overrides -----------------------------------------------------------------------------
def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    return subprocess.run([sys.executable, "-c", "from cudagym.cli import main; main()", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(900)
def test_check_flags_override_the_tasks_tolerance(tmp_path) -> None:
    # norm_softmax's honest CPU solution sums in another order than torch: within the task's own
    # tolerance (atol 1e-6, rtol 1e-4), not bit for bit.
    args = ["check", "norm_softmax", str(REPO / "examples" / "solutions" / "norm_softmax" / "cpu"), "--json",
            "--target", "cpu", "--no-compile-baseline", "--cache-dir", str(tmp_path / "cache")]
    exact = _cli(*args, "--atol", "0", "--rtol", "0")
    assert exact.returncode == 1, exact.stdout + exact.stderr
    verdict = json.loads(exact.stdout)
    assert verdict["tolerance"] == {"atol": 0.0, "rtol": 0.0}
    assert verdict["reward"] == -1.0 and verdict["error_kind"] == "mismatch"
    assert "atol=0.0, rtol=0.0" in verdict["reasons"][0], verdict["reasons"]
    for flags, problem in ((["--atol", "1e-3"], "only atol was given"), (["--rtol", "1e-3"], "only rtol was given"),
                           (["--atol", "-1", "--rtol", "0"], "both must be finite numbers >= 0")):
        bad = _cli(*args, *flags)
        assert bad.returncode == 2 and problem in bad.stderr and bad.stdout == "", (flags, bad.stderr)


async def state_the_tolerance_and_submit(messages, tools, context):
    """A policy that repeats the prompt's tolerance sentence, then submits (the runner test's)."""
    sentence = next(line for line in messages[1]["content"].splitlines() if "outputs must match within" in line)
    return f'{sentence}\n<tool_call>{{"name": "submit", "arguments": {{}}}}</tool_call>'


@pytest.mark.timeout(900)
async def test_run_flags_override_every_tasks_tolerance(tmp_path) -> None:
    out = tmp_path / "run"
    args = ["run", "--tasks", "ew_scale_bias_gelu", "--policy", "test_tolerance:state_the_tolerance_and_submit",
            "--target", "cpu", "--max-turns", "1", "--out", str(out)]
    lone = _cli(*args, "--rtol", "0.5")
    assert lone.returncode == 2 and "atol and rtol go together" in lone.stdout, lone.stdout
    done = _cli(*args, "--atol", "0.25", "--rtol", "0.5")
    assert done.returncode == 0, done.stdout + done.stderr
    store = TrajectoryStore(out)
    (summary,) = store.summaries()
    assert summary["task"]["tolerance"] == {"atol": 0.25, "rtol": 0.5}
    assert "atol=0.25, rtol=0.5" in store.steps(summary["episode_id"])[0]["action"]["content"]
    cfg = RunConfig(tasks="ew_scale_bias_gelu", policy="test_tolerance:state_the_tolerance_and_submit",
                    evaluator=EvaluatorConfig(target="cpu"), max_turns=1, out=out,
                    tolerance=Tolerance(atol=0.25, rtol=0.25))
    with pytest.raises(ConfigError, match="tolerance"):  # a resume must not change the tolerance
        await arun(cfg)


async def test_env_prints_the_effective_tolerance_and_its_option_overrides_it(evaluator, tmp_path) -> None:
    (tmp_path / "kb.py").write_text(REFERENCE)
    kb_task = load_task_file(tmp_path / "kb.py")
    env = KernelEnv(tasks=[kb_task, bundled_task("norm_softmax")], evaluator=evaluator, workspace_root=tmp_path)
    prompt, info = await env.areset(options={"task": "kb"})
    assert "atol=0.01, rtol=0.01" in prompt and info["task"]["tolerance"] == {"atol": 0.01, "rtol": 0.01}
    prompt, info = await env.areset(options={"task": "norm_softmax"})
    assert "atol=1e-06, rtol=0.0001" in prompt
    env.close()

    exact = KernelEnv(tasks=[bundled_task("norm_softmax")], evaluator=evaluator, workspace_root=tmp_path,
                      tolerance={"atol": 0, "rtol": 0})
    prompt, info = await exact.areset()
    assert "atol=0, rtol=0" in prompt and info["task"]["tolerance"] == {"atol": 0.0, "rtol": 0.0}
    solution = REPO / "examples" / "solutions" / "norm_softmax" / "cpu"
    for path in sorted(p for p in solution.rglob("*") if p.is_file()):
        await exact.astep({"name": "write_file", "arguments": {"path": str(path.relative_to(solution)),
                                                                "content": path.read_text()}})
    obs, *_ = await exact.astep({"name": "verify", "arguments": {}})
    assert "atol=0.0, rtol=0.0" in obs, obs  # the override reached the evaluator's comparison
    exact.close()


def test_gymnasium_make_takes_the_tolerance_option() -> None:
    env = gymnasium.make(ENV_ID, tasks=[bundled_task("ew_scale_bias_gelu")], target="cpu",
                         tolerance=Tolerance(atol=0.5, rtol=0.25))
    try:
        prompt, info = env.reset()
        assert "atol=0.5, rtol=0.25" in prompt and info["task"]["tolerance"] == {"atol": 0.5, "rtol": 0.25}
    finally:
        env.close()
