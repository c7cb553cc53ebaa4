"""The sandbox interface: run one `Job` in a fresh isolated worker and return what it reported."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cudagym.sandbox.worker.wire import Job


@dataclass
class JobOutcome:
    """What came back from one worker. `final` is None when the worker died or was killed."""

    final: dict[str, Any] | None
    tensors: list[tuple[dict[str, Any], bytes | memoryview]] = field(default_factory=list)
    started: dict[str, Any] | None = None
    returncode: int | None = None
    timed_out: bool = False
    memory_exceeded: bool = False
    process_limited: bool = False
    channel_error: str | None = None  # malformed or forged frames
    output: str = ""  # the worker's stdout+stderr (the candidate's prints), trimmed
    seconds: float = 0.0  # from the worker's ready frame to its exit
    wait_s: float = 0.0  # waiting for a spare worker to be ready (start-up not yet done)
    lease_wait_s: float = 0.0  # then waiting for the device (a GPU's lease, the CPU's slots)
    phases: dict[str, float] = field(default_factory=dict)  # the worker's own time per phase (s)
    # a timing job: another process used its GPU before or during it (what was seen); the
    # timing is not valid
    device_busy: str | None = None
    # a timing job: the host's load during its timed loops (`QuietWindows.load`): windows,
    # window_s, host_busy_s, job_busy_s, parent_busy_s, other_cores, frozen_jobs, frozen_processes
    host_load: dict[str, Any] = field(default_factory=dict)
    # where the job's directories were as the worker saw them, {worker path: host path}, for
    # those it saw elsewhere than the host (a container's job directory); paths a job's outputs
    # name (a build's dependency files) are read through it
    paths: dict[str, str] = field(default_factory=dict)


# Answers a worker's request during its job: `responder(request, arrived_s)` gets the request
# frame's header and the `time.perf_counter()` at which it arrived, and returns the answer (a
# JSON object written to the worker as one line). Called on the sandbox's own thread, one request
# at a time per job; it must not block.
Responder = Callable[[dict[str, Any], float], dict[str, Any]]


class Sandbox(abc.ABC):
    """Runs jobs in fresh worker processes. Implementations: `LocalSandbox` (processes on this
    host) and `DockerSandbox` (a container per worker)."""

    @abc.abstractmethod
    async def run(self, job: Job, device: str, responder: Responder | None = None) -> JobOutcome:
        """Run `job` on `device` ("cpu" or "cuda:N") in a fresh worker; never raises for the
        candidate's failures (crash, hang, limits): those are described in the outcome.

        While the job runs, the worker may send request frames (`{"type": "request", ...}`);
        each is answered by `responder` (without one: `{"refused": ...}`). This is how a secret
        reaches a worker only when the step that needs it starts (a trial's inputs, a timed
        call's), and how the parent observes the pace of timed calls with its own clock."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop spare workers."""

    @property
    @abc.abstractmethod
    def isolation(self) -> dict[str, bool]:
        """Which isolation features are active (landlock, network namespace, pid cgroup, ...)."""
