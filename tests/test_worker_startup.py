"""Where a worker's start-up goes: the ready frame carries the worker's own clock of each step,
and the job's outcome carries them with the wall time from spawn to ready (the throughput
benchmark's start-up table reads them). A spawned worker imports torch and the harness itself;
a forked one (the default) starts from its fork server, which did that once."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from cudagym.sandbox.config import LocalSandboxConfig
from cudagym.sandbox.local import LocalSandbox
from cudagym.sandbox.protocol import LimitsConfig
from cudagym.sandbox.worker.wire import Job


def startup_of_a_job(tmp_path: Path, fork_server: bool) -> dict[str, float]:
    sandbox = LocalSandbox(LocalSandboxConfig(spare_workers=0, fork_server=fork_server), home=tmp_path / "home")
    try:
        job = Job(kind="probe", nonce=uuid.uuid4().hex, task_id="startup", probe="RESULT = 6 * 7",
                  limits=LimitsConfig(timeout_s=120))
        outcome = sandbox.run_sync(job, "cpu")
        if fork_server:
            assert sandbox._fork_servers["cpu"] is not None, "the fork server did not start"
    finally:
        sandbox.close()
    assert outcome.final is not None and outcome.final["result"] == "42"
    steps = {k[len("startup_"):]: v for k, v in outcome.phases.items() if k.startswith("startup_")}
    assert "cuda_context" not in steps  # the CPU target creates none
    assert all(v >= 0 for v in steps.values())
    return steps


def test_a_spawned_workers_outcome_says_how_it_started(tmp_path: Path) -> None:
    steps = startup_of_a_job(tmp_path, fork_server=False)
    assert {"import_torch", "import_harness", "prewarm", "prewarm_device", "wall"} <= set(steps), steps
    # the worker's own steps happen between its spawn and its ready frame
    assert steps["wall"] >= steps["import_torch"] + steps["import_harness"] + steps["prewarm"]


def test_a_forked_worker_skips_the_imports(tmp_path: Path) -> None:
    steps = startup_of_a_job(tmp_path, fork_server=True)
    assert {"fork", "prewarm_device", "wall"} <= set(steps), steps
    assert not {"import_torch", "import_harness", "prewarm"} & set(steps)  # its server paid for them
    assert steps["wall"] >= steps["fork"] + steps["prewarm_device"]


@pytest.mark.parametrize("fork_server", [True, False])
def test_workers_are_apart_from_each_other(tmp_path: Path, fork_server: bool) -> None:
    """Forked or spawned, each job's worker is its own process: its own PID namespace (where
    the host gives one), no network, and nothing of an earlier job's process left in it."""
    sandbox = LocalSandbox(LocalSandboxConfig(spare_workers=1, fork_server=fork_server), home=tmp_path / "home")
    probe = ("import os, socket, sys\n"
             "left = getattr(sys, 'cudagym_left_here', None); sys.cudagym_left_here = os.getpid()\n"
             "try:\n    socket.create_connection(('192.0.2.1', 9), timeout=1); net = 'reached'\n"
             "except OSError as e:\n    net = 'no network'\n"
             "RESULT = (os.getpid(), left, net)")
    try:
        results = []
        for _ in range(2):
            o = sandbox.run_sync(Job(kind="probe", nonce=uuid.uuid4().hex, task_id="apart", probe=probe,
                                     limits=LimitsConfig(timeout_s=120)), "cpu")
            assert o.final is not None, o.output
            results.append(o.final["result"])
        isolation = sandbox.isolation
    finally:
        sandbox.close()
    for r in results:
        pid, left, net = eval(r)  # noqa: S307 - our own probe's repr
        assert left is None  # a fresh process: nothing the last job set survives
        if isolation["pid_namespace"]:
            assert pid == 1
        if isolation["network_namespace"]:
            assert net == "no network"


def test_a_fork_server_that_dies_is_started_again(tmp_path: Path) -> None:
    """Killing the fork server (out of memory, an operator) costs the spares it had forked (they
    die with it), not the sandbox and not a job: a job given a spare that died before it started
    runs again on another worker, from a new server."""
    import os
    import signal

    sandbox = LocalSandbox(LocalSandboxConfig(spare_workers=1), home=tmp_path / "home")
    job = lambda: Job(kind="probe", nonce=uuid.uuid4().hex, task_id="startup", probe="RESULT = 6 * 7",  # noqa: E731
                      limits=LimitsConfig(timeout_s=120))
    try:
        assert sandbox.run_sync(job(), "cpu").final["result"] == "42"
        first = sandbox._fork_servers["cpu"]
        assert first is not None and first.proc is not None
        os.killpg(first.proc.pid, signal.SIGKILL)
        outcomes = [sandbox.run_sync(job(), "cpu") for _ in range(3)]
        second = sandbox._fork_servers["cpu"]
    finally:
        sandbox.close()
    # the spare forked before the kill may die with the server before or after it is taken: its
    # job then runs on a worker of the new server
    assert all(o.final is not None and o.final["result"] == "42" for o in outcomes), [
        (o.final, o.returncode, o.channel_error, o.timed_out, o.output) for o in outcomes]
    assert second is not None and second is not first
