"""The local sandbox reaps each worker process once, through asyncio's child watcher.

Any other waitpid on a worker (Popen.poll, os.wait*) can take its exit status first; the watcher
then logs "Unknown child process pid N, will report returncode 255" (Python 3.12+: "exit status
already read") and reports 255 as the worker's exit status.
"""

from __future__ import annotations

import logging
import re
import shutil
import signal
import uuid
from pathlib import Path

import pytest

from cudagym.errors import SandboxError
from cudagym.sandbox.config import LocalSandboxConfig
from cudagym.sandbox.local import LocalSandbox
from cudagym.sandbox.protocol import LimitsConfig
from cudagym.sandbox.worker.wire import Job

DOUBLE_REAP = re.compile(r"Unknown child process pid|exit status already read")
# Workers that die at start-up are killed as they exit, the closest race with the watcher: enough
# of them that a second reaper shows (with one, 0.7% to 9% of them were reaped twice on a 2-core host).
DYING_WORKERS = 500


def probe(source: str, timeout_s: float = 60.0) -> Job:
    return Job(kind="probe", nonce=uuid.uuid4().hex, task_id="reaping", probe=source,
               limits=LimitsConfig(timeout_s=timeout_s))


@pytest.mark.slow
def test_each_worker_is_reaped_once(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                    capfd: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.WARNING, logger="asyncio")
    sandbox = LocalSandbox(LocalSandboxConfig(spare_workers=2), home=tmp_path / "home")
    try:  # real workers: killed once their result is in, exited by themselves, timed out
        answered = sandbox.run_sync(probe("RESULT = 6 * 7"), "cpu")
        exited = sandbox.run_sync(probe("import os; os._exit(3)"), "cpu")
        hung = sandbox.run_sync(probe("import time; time.sleep(600)", timeout_s=1.0), "cpu")
    finally:
        sandbox.close()
    assert answered.final is not None and answered.final["result"] == "42"
    assert exited.final is None and exited.returncode == 3
    assert hung.timed_out and hung.returncode == -signal.SIGKILL

    exits_at_once = shutil.which("false") or "/bin/false"  # in place of the Python interpreter
    dying = LocalSandbox(LocalSandboxConfig(spare_workers=0, python=exits_at_once), home=tmp_path / "home")
    try:
        for _ in range(DYING_WORKERS):
            with pytest.raises(SandboxError, match="failed to start"):
                dying.run_sync(probe("RESULT = 1"), "cpu")
    finally:
        dying.close()

    reaped_twice = [r.getMessage() for r in caplog.records if DOUBLE_REAP.search(r.getMessage())]
    assert not reaped_twice, f"{len(reaped_twice)} workers reaped twice: {reaped_twice[:3]}"
    assert not DOUBLE_REAP.search(capfd.readouterr().err)
