"""The sandbox interface: run one `Job` in a fresh isolated worker and return what it reported."""

from __future__ import annotations

import abc

from cudagym.sandbox.worker.wire import Job, JobOutcome, Responder


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
