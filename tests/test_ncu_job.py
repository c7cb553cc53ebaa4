"""The ncu job kind runs through `Sandbox.run` like any other job (the CPU parts; Nsight Compute on
a GPU is `test_gpu.py::test_ncu_summary_holds_only_the_candidates_kernels`).

- Without `ncu` on the worker's PATH, the job's metrics name its absence, as before (the
  evaluator's ncu step sends the job through its sandbox, as `profile(ncu=True)` does on a GPU).
- With one, the sandboxed worker runs it over a child worker on the same job: the child runs the
  candidate's code (under `CUDAGYM_UNDER_NCU`), `ncu` and the child are confined as the job is
  (no write outside the workspace), and the parsed log comes back in the worker's final frame.
  A stand-in script plays `ncu` here: it runs the command it is given and writes one CSV row.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from cudagym.rewards.evaluator import Evaluator
from cudagym.sandbox import ncu
from cudagym.sandbox.limits import landlock_abi
from cudagym.sandbox.local import LocalSandbox, LocalSandboxConfig
from cudagym.sandbox.protocol import LimitsConfig
from cudagym.sandbox.worker.wire import Job
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.model import Target

from conftest import make_workspace, task_of

CANDIDATE = """
    import os
    import torch

    with open("under_ncu.txt", "w") as f:  # the worker's working directory is the workspace
        f.write(os.environ.get("CUDAGYM_UNDER_NCU", ""))


    class ModelNew(torch.nn.Module):
        def __init__(self, *args):
            super().__init__()

        def forward(self, x, *rest):
            return x
"""

FAKE_NCU = """#!/bin/sh
while [ "$1" != "--log-file" ]; do shift; done
log=$2
shift 2
"$@"
if touch {outside} 2>/dev/null; then where=escaped; else where=confined; fi
{{ printf '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\\n'
  printf '"0","%s","gpu__time_duration.sum","usecond","3.0"\\n' "$where"; }} > "$log"
"""


def ncu_job(ws: Workspace) -> Job:
    task = task_of("ew_scale_bias_gelu").for_target(Target.CPU)
    return Job(kind="ncu", nonce=uuid.uuid4().hex, task_id=task.id, task_code=task.code, device="cpu",
               workspace=str(ws.root), cache_dir=str(ws.root / ".cache"),
               limits=ncu.ncu_job_limits(LimitsConfig(timeout_s=60)))


def run_ncu_job(tmp_path: Path, ws: Workspace) -> dict:
    sandbox = LocalSandbox(LocalSandboxConfig(spare_workers=0), home=tmp_path / "home")
    try:
        outcome = sandbox.run_sync(ncu_job(ws), "cpu")
    finally:
        sandbox.close()
    assert outcome.final is not None and outcome.final.get("ok"), (outcome.final, outcome.output[-2000:])
    return outcome.final["ncu"]


def test_without_ncu_the_metrics_name_its_absence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no ncu there (a GPU machine may have one elsewhere)
    if any(os.access(os.path.join(d, "ncu"), os.X_OK) for d in ("/usr/bin", "/bin")):
        pytest.skip("ncu is installed in /usr/bin or /bin")
    ws = make_workspace(tmp_path / "ws", task_of("ew_scale_bias_gelu"), CANDIDATE)
    assert run_ncu_job(tmp_path, ws) == {"error": ncu.NOT_INSTALLED}
    assert not (ws.root / "under_ncu.txt").exists()  # no candidate code ran


def test_ncu_runs_over_a_child_worker_inside_the_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    outside = tmp_path / "outside"
    fake = bin_dir / "ncu"
    fake.write_text(FAKE_NCU.format(outside=outside))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    ws = make_workspace(tmp_path / "ws", task_of("ew_scale_bias_gelu"), CANDIDATE)
    metrics = run_ncu_job(tmp_path, ws)
    assert "error" not in metrics, metrics
    assert (ws.root / "under_ncu.txt").read_text() == "1"  # the child ran the candidate, under ncu
    [kernel] = metrics["kernels"]
    assert kernel["launches"] == 1 and metrics["kernel_ms_per_call"] == pytest.approx(3e-3 / ncu.CALLS)
    if landlock_abi() >= 1:
        assert kernel["kernel"] == "confined" and not outside.exists()


def test_the_evaluators_ncu_step_runs_an_ncu_job_in_its_sandbox(evaluator: Evaluator, tmp_path: Path) -> None:
    if shutil.which("ncu") is not None:
        pytest.skip("ncu is installed here")
    task = task_of("ew_scale_bias_gelu").for_target(evaluator.target)
    ws = make_workspace(tmp_path / "ws", task, CANDIDATE)
    assert evaluator._sync(evaluator._ancu(task, ws, None)) == {"error": ncu.NOT_INSTALLED}


def test_the_ncu_log_is_read_only_where_ncu_wrote_it(tmp_path):
    """A link the candidate planted where ncu writes its log is neither followed nor read back:
    the outer ncu worker runs no candidate code but reads what the child's workspace holds."""
    from cudagym.sandbox.ncu import _read_own_file

    secret = tmp_path / "outside.txt"
    secret.write_text("not ncu's")
    log = tmp_path / "ncu.csv"
    log.symlink_to(secret)
    assert _read_own_file(log) == ""
    log.unlink()
    log.write_text('"ID","Kernel Name"\n')
    assert _read_own_file(log).startswith('"ID"')
    assert _read_own_file(tmp_path / "missing.csv") == ""
