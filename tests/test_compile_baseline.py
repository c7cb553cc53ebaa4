"""The torch.compile baseline, measured for real in a sandboxed worker on the CPU target (the
other tests turn it off for time: `conftest.cpu_config`).

The worker may write only its job's scratch directory, where the baseline job points inductor's
caches. A spare that imported inductor while idle (before the job, to save the job the import)
had already fixed inductor's cache paths under /tmp: every compile then failed on Landlock's
PermissionError, and 11 of the 13 bundled tasks of the README's main job had no torch.compile
baseline.
"""

from __future__ import annotations

from pathlib import Path

from cudagym.rewards.evaluator import Evaluator

from conftest import SOLUTIONS, cpu_config, solution_workspace, task_of


def test_the_torch_compile_baseline_is_measured_in_a_sandboxed_worker(tmp_path: Path) -> None:
    task = task_of("ew_residual_relu_clamp")
    ws = solution_workspace(tmp_path / "ws", task, SOLUTIONS / task.id / "cpu")
    with Evaluator(cpu_config(tmp_path / "cache", compile_baseline=True)) as ev:
        v = ev.evaluate(task, ws)
    assert not any("torch.compile baseline unavailable" in r for r in v.reasons), v.reasons
    assert v.compile_ms, v.reasons
