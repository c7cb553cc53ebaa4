"""When and where a job runs: the device scheduling and spare-worker plumbing shared by the
sandbox backends.

One timing job per GPU at a time (timings need the device alone) while checks share it; on the
CPU, timing jobs run alone and checks share the cores.
"""

from __future__ import annotations

import abc
import asyncio
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from cudagym.sandbox.base import JobOutcome, Responder, Sandbox
from cudagym.sandbox.gpu import gpu_count
from cudagym.sandbox.protocol import TIMING_KINDS, Job

RunOn = Callable[[Job, str, "Responder | None"], Awaitable[tuple[JobOutcome, "asyncio.Future[None]"]]]


class _GpuLease:
    """Timing jobs have a GPU to themselves; checks share it (a readers-writer lease)."""

    def __init__(self) -> None:
        self.shared = 0
        self.exclusive = False

    def try_acquire(self, exclusive: bool) -> bool:
        if self.exclusive or (exclusive and self.shared):
            return False
        if exclusive:
            self.exclusive = True
        else:
            self.shared += 1
        return True

    def release(self, exclusive: bool) -> None:
        if exclusive:
            self.exclusive = False
        else:
            self.shared -= 1


class JobScheduler:
    """Leases of the GPUs and slots of the CPU, created on the loop of the first job."""

    def __init__(self) -> None:
        self._gpu_leases: list[_GpuLease] | None = None
        self._cpu_slots: asyncio.Semaphore | None = None
        self._cpu_timing: asyncio.Lock | None = None

    async def run(self, job: Job, device: str, responder: Responder | None, run_on: RunOn) -> JobOutcome:
        """Run `job` through `run_on(job, device, responder)` (a backend's: it returns the outcome
        and a future that resolves once the worker is gone) when its device can take it; "cuda"
        picks the first GPU free for it and passes "cuda:N"."""
        if device == "cuda":
            if self._gpu_leases is None:
                self._gpu_leases = [_GpuLease() for _ in range(max(gpu_count(), 1))]
            exclusive = job.kind in TIMING_KINDS
            while True:  # the first GPU that can take this job now
                for i, lease in enumerate(self._gpu_leases):
                    if lease.try_acquire(exclusive):
                        gone: asyncio.Future[None] | None = None
                        try:
                            outcome, gone = await run_on(job, f"cuda:{i}", responder)
                            return outcome
                        finally:  # the GPU is free once the worker (and its CUDA context) is gone
                            if gone is None:
                                lease.release(exclusive)
                            else:
                                gone.add_done_callback(lambda _f, lease=lease: lease.release(exclusive))
                await asyncio.sleep(0.005)
        if self._cpu_slots is None:
            self._cpu_slots = asyncio.Semaphore(max(1, (os.cpu_count() or 2)))
            self._cpu_timing = asyncio.Lock()
        if job.kind in TIMING_KINDS:
            async with self._cpu_timing:
                outcome, gone = await run_on(job, device, responder)
                await gone
                return outcome
        async with self._cpu_slots:
            return (await run_on(job, device, responder))[0]


class SpareWorkerSandbox(Sandbox):
    """A sandbox whose workers are started ahead of need and used for one job each, driven from
    one private event-loop thread (so callers on any loop, or none, can use it). Backends
    provide `_run_on` (one job in a spare, see `RunOn`), `_replenish` (start spares for a device)
    and `_stop_spares` (stop them at `close`)."""

    _stop_timeout_s = 10.0

    def _start_loop(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False
        self._scheduler = JobScheduler()
        self._starting: dict[str, set[asyncio.Future[None]]] = {}  # spares being started, per device

    @abc.abstractmethod
    async def _run_on(self, job: Job, device: str,
                      responder: Responder | None) -> tuple[JobOutcome, asyncio.Future[None]]: ...

    @abc.abstractmethod
    async def _spawn(self, device: str) -> Any: ...

    async def _replenish(self, device: str) -> None:
        """Start spares for `device`, one after another, until the ready and starting ones make
        `spare_workers`."""
        pool = self._spares.setdefault(device, [])
        starting = self._starting.setdefault(device, set())
        want = self.config.spare_workers
        if want is None:
            want = 6 if device.startswith("cuda") else 2
        while len(pool) + len(starting) < want and not self._closed:
            start = asyncio.ensure_future(self._start_spare(device))
            starting.add(start)
            start.add_done_callback(starting.discard)
            await start

    async def _start_spare(self, device: str) -> None:
        # The spare joins the pool in the same task that starts it: `close` waits for these tasks,
        # then stops the pool's spares, so none is left running
        self._spares.setdefault(device, []).append(await self._spawn(device))

    async def _shutdown(self) -> None:
        while starting := [t for tasks in self._starting.values() for t in tasks]:
            await asyncio.gather(*starting, return_exceptions=True)
        await self._stop_spares()

    @abc.abstractmethod
    async def _stop_spares(self) -> None: ...

    async def run(self, job: Job, device: str, responder: Responder | None = None) -> JobOutcome:
        fut = asyncio.run_coroutine_threadsafe(self._scheduler.run(job, device, responder, self._run_on), self._loop)
        return await asyncio.wrap_future(fut)

    def run_sync(self, job: Job, device: str, responder: Responder | None = None) -> JobOutcome:
        return asyncio.run_coroutine_threadsafe(self._scheduler.run(job, device, responder, self._run_on),
                                                self._loop).result()

    def warm(self, device: str) -> None:
        """Start spare workers for `device` now (they are otherwise started on first use)."""
        asyncio.run_coroutine_threadsafe(self._replenish(device), self._loop).result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=self._stop_timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def __del__(self) -> None:  # best effort: never leave spares behind
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
