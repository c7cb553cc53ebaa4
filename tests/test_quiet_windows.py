"""A timing job's quiet windows (`cudagym.sandbox.schedule.QuietWindows`) on real processes:
spares still starting are stopped while a timed loop runs and go on starting between loops."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil
import pytest

from cudagym.sandbox.local import LocalSandbox
from cudagym.sandbox.schedule import QuietWindows


@dataclass
class Spare:
    proc: subprocess.Popen  # what LocalSandbox._signal needs: a process group leader


def pause(spares: list[Spare], on: bool) -> None:
    """The local backend's pause: SIGSTOP / SIGCONT to each spare's process group."""
    LocalSandbox._signal(spares, signal.SIGSTOP if on else signal.SIGCONT)  # type: ignore[arg-type]


def state(s: Spare) -> str:
    for _ in range(100):  # a signal is delivered asynchronously
        status = psutil.Process(s.proc.pid).status()
        if status in (psutil.STATUS_STOPPED, psutil.STATUS_SLEEPING, psutil.STATUS_RUNNING):
            return "stopped" if status == psutil.STATUS_STOPPED else "going"
        time.sleep(0.01)
    return status


def settled(spares: list[Spare], want: str) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if all(state(s) == want for s in spares):
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def spares():
    started = [Spare(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True))
               for _ in range(3)]
    yield started
    for s in started:
        s.proc.kill()
        s.proc.wait()


def test_spares_are_stopped_during_each_loop_and_go_on_between(spares):
    pool = spares[:2]
    q = QuietWindows(pause, lambda: list(pool))
    served = []

    def feed(request, arrived_s):
        served.append(request["role"])
        return {"stop": True} if len(served) in (2, 4) else {"seed": len(served)}

    answer = q.responder(feed)
    q.begin()  # the job starts: calibration, then the first loop
    assert settled(pool, "stopped")
    answer({"what": "call", "role": "eager"}, 0.0)
    assert settled(pool, "stopped")
    assert answer({"what": "call", "role": "eager"}, 0.0) == {"stop": True}
    assert settled(pool, "going"), "between loops (torch.compile) the spares go on starting"
    answer({"what": "call", "role": "compiled"}, 0.0)
    assert settled(pool, "stopped"), "the next loop's first call request stops them again"
    q.started(spares[2])  # a spare started during the loop is stopped at once
    assert settled(spares, "stopped")
    answer({"what": "call", "role": "compiled"}, 0.0)
    assert settled(spares, "going")


def test_a_refused_request_ends_the_window_and_the_job_end_resumes_all(spares):
    q = QuietWindows(pause, lambda: list(spares))
    answer = q.responder(lambda request, arrived_s: {"refused": "out of order"})
    q.begin()
    assert settled(spares, "stopped")
    answer({"what": "call", "role": "x"}, 0.0)
    assert settled(spares, "going")
    q.begin()
    assert settled(spares, "stopped")
    q.end()
    q.end()  # idempotent: the job's end after a loop that already closed its window
    assert settled(spares, "going")


def test_a_job_that_gives_the_gpu_back_closes_its_window_before_it_waits(spares):
    """A timing job that asks to share the GPU again (after its calibration) closes its window
    before its request is answered: a check that gets the GPU while the job waits for its shared
    lease runs, rather than stay stopped by a window whose job waits behind it."""
    q = QuietWindows(pause, lambda: list(spares))
    seen = []

    def lease(request, arrived_s):  # the job's lease (`JobLease`): the "shared" answer waits for the lease
        if request["what"] == "shared":
            seen.append(settled(spares, "going"))
        return {}

    answer = q.responder(lease)
    assert answer({"what": "exclusive"}, 0.0) == {}
    assert settled(spares, "stopped"), "the GPU alone: its window is open (the calibration)"
    answer({"what": "shared"}, 0.0)
    assert seen == [True]
    assert settled(spares, "going")


def test_a_job_that_keeps_the_gpu_keeps_its_window_through_its_load(spares):
    """With the whole job alone on the GPU (`exclusive_from="job"`), "shared" changes nothing: the
    window opened for the calibration stays open through the candidate's load into the loop."""
    q = QuietWindows(pause, lambda: list(spares), shares=False)
    answer = q.responder(lambda request, arrived_s: {})
    q.begin()
    answer({"what": "shared"}, 0.0)
    assert settled(spares, "stopped")
    q.end()
    assert settled(spares, "going")
