"""Where a worker's start-up goes: the ready frame carries the worker's own clock of each step,
and the job's outcome carries them with the wall time from spawn to ready (the throughput
benchmark's start-up table reads them)."""

from __future__ import annotations

import uuid
from pathlib import Path

from cudagym.sandbox.local import LocalSandbox, LocalSandboxConfig
from cudagym.sandbox.protocol import Job, LimitsConfig


def test_a_jobs_outcome_says_how_its_worker_started(tmp_path: Path) -> None:
    sandbox = LocalSandbox(LocalSandboxConfig(spare_workers=0), home=tmp_path / "home")
    try:
        job = Job(kind="probe", nonce=uuid.uuid4().hex, task_id="startup", probe="RESULT = 6 * 7",
                  limits=LimitsConfig(timeout_s=120))
        outcome = sandbox.run_sync(job, "cpu")
    finally:
        sandbox.close()
    assert outcome.final is not None and outcome.final["result"] == "42"
    steps = {k[len("startup_"):]: v for k, v in outcome.phases.items() if k.startswith("startup_")}
    assert {"import_torch", "import_harness", "prewarm", "wall"} <= set(steps), outcome.phases
    assert "cuda_context" not in steps  # the CPU target creates none
    assert all(v >= 0 for v in steps.values())
    # the worker's own steps happen between its spawn and its ready frame
    assert steps["wall"] >= steps["import_torch"] + steps["import_harness"] + steps["prewarm"]
