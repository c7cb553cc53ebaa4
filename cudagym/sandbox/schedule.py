"""When and where a job runs: the device scheduling and spare-worker plumbing shared by the
sandbox backends.

One timing job per GPU at a time (timings need the device alone) while checks share it; on the
CPU, timing jobs run alone and checks share the cores.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import itertools
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cudagym.sandbox.base import Sandbox
from cudagym.sandbox.bridge import LoopThread
from cudagym.sandbox.gpu import gpu_count
from cudagym.sandbox.worker.wire import TIMING_KINDS, Job, JobOutcome, Responder

if TYPE_CHECKING:
    from cudagym.sandbox.config import SpareWorkerConfig

Ready = Callable[[str], Awaitable[Any]]  # a ready worker of the device
RunOn = Callable[[Job, str, "Responder | None", Any], Awaitable[tuple[JobOutcome, "asyncio.Future[None]"]]]
Unused = Callable[[Any], None]  # a ready worker that got no job goes back to the spares


class _GpuLease:
    """Timing jobs have a GPU to themselves; checks share it (a readers-writer lease), granted in
    the order the jobs asked for it: a check waits behind a timing job that asked first, so a
    stream of checks cannot hold a timing job off, and a timing job waits for those ahead of it.
    An urgent check (a reference-only job: short, trusted, and what a finished profile or a
    verify waits on) does not wait behind timing jobs that are only waiting; at most one per
    timing job arrives, so they cannot hold one off for long.
    A job asks once its worker is ready (a job waiting for its worker to start holds nothing).
    The timing turn: a timing job's ticket that asks for it (`turn`, the job's number) is not
    granted while another job holds the turn; the first grant takes it, and the job gives it back
    (`end_turn`) only once its worker is gone, so it may share the GPU with checks between its
    loops and after them and still keep every other timing job out (`JobLease`). The holder's
    own tickets go before everything waiting: its next loop waits only for the checks beside it."""

    def __init__(self) -> None:
        self.shared = 0
        self.exclusive = False
        self._tickets = itertools.count()
        self.waiting: dict[int, bool] = {}  # ticket -> exclusive, in the order they asked
        self._urgent: set[int] = set()
        self._turn_of: dict[int, int] = {}  # ticket -> the timing job whose turn it asks for
        self.turn: int | None = None  # the timing job holding the turn

    def ask(self, exclusive: bool, urgent: bool = False, turn: int | None = None) -> int:
        ticket = next(self._tickets)
        self.waiting[ticket] = exclusive
        if urgent and not exclusive:
            self._urgent.add(ticket)
        if turn is not None:
            self._turn_of[ticket] = turn
        return ticket

    def withdraw(self, ticket: int) -> None:
        self.waiting.pop(ticket, None)
        self._urgent.discard(ticket)
        self._turn_of.pop(ticket, None)

    def try_acquire(self, ticket: int) -> bool:
        exclusive = self.waiting[ticket]
        ahead = [e for t, e in self.waiting.items() if t < ticket]
        turn = self._turn_of.get(ticket)
        if turn is not None and turn == self.turn:  # the turn's holder, between its loops: only the
            # checks beside it hold its next loop off (those waiting, and the timing jobs waiting for
            # the turn, come after its job)
            if self.exclusive or (exclusive and self.shared):
                return False
        elif ticket in self._urgent:
            if self.exclusive:
                return False
            self._urgent.discard(ticket)
        elif self.exclusive or any(ahead) or (exclusive and (self.shared or ahead)):
            return False
        elif turn is not None and self.turn not in (None, turn):
            return False
        del self.waiting[ticket]
        if turn is not None:
            del self._turn_of[ticket]
            self.turn = turn
        if exclusive:
            self.exclusive = True
        else:
            self.shared += 1
        return True

    def end_turn(self, turn: int) -> None:
        if self.turn == turn:
            self.turn = None

    def release(self, exclusive: bool) -> None:
        if exclusive:
            self.exclusive = False
        else:
            self.shared -= 1

    @property
    def load(self) -> int:
        return self.shared + self.exclusive + len(self.waiting)


@dataclass
class LeaseHold:
    """One job's hold of a GPU lease, on this process's `time.perf_counter` clock (seconds)."""

    kind: str  # the job's kind
    exclusive: bool
    asked_s: float  # its worker was ready; it asked for the lease
    acquired_s: float
    result_s: float | None = None  # its result was in (the worker killed)
    released_s: float | None = None
    job: int = 0  # which job held it (a timing job holds the GPU alone in parts: `JobLease`)
    # a timing job's first hold (`exclusive_from="loop"`): when it took and gave back its GPU's
    # timing turn (`JobScheduler.run`), the span no other timing job's calibration or loop may enter
    turn_s: tuple[float, float | None] | None = None


class JobScheduler:
    """Leases of the GPUs and slots of the CPU, created on the loop of the first job.

    `release_at_result`: a GPU lease ends when the job's result is in (its worker is killed,
    its CUDA context still being torn down) rather than once its worker is gone. `holds`
    keeps the last `MAX_HOLDS` GPU leases (where a GPU's time goes)."""

    MAX_HOLDS = 100_000

    def __init__(self, release_at_result: bool = False, exclusive_from: str = "job",
                 calibration_max_age_s: float = 0.0) -> None:
        self._gpu_leases: list[_GpuLease] | None = None
        self._cpu_slots: asyncio.Semaphore | None = None
        self._cpu_timing: asyncio.Lock | None = None
        self.release_at_result = release_at_result
        self.exclusive_from = exclusive_from
        self.calibration_max_age_s = calibration_max_age_s
        self._calibrations: dict[str, tuple[dict[str, Any], float]] = {}  # device -> (fields, when measured)
        self.holds: collections.deque[LeaseHold] = collections.deque(maxlen=self.MAX_HOLDS)
        self._jobs = itertools.count(1)

    def calibration_for(self, device: str) -> dict[str, Any] | None:
        """The timer calibration last measured on `device` by a timing job before its candidate
        loaded, if younger than `calibration_max_age_s`."""
        known = self._calibrations.get(device)
        if known is None or time.monotonic() - known[1] >= self.calibration_max_age_s:
            return None
        return dict(known[0])

    def calibrated(self, device: str, fields: dict[str, Any]) -> None:
        if self.calibration_max_age_s > 0:
            self._calibrations[device] = dict(fields), time.monotonic()

    async def run(self, job: Job, device: str, responder: Responder | None, ready: Ready, run_on: RunOn,
                  unused: Unused) -> JobOutcome:
        """Run `job` through `run_on(job, device, responder, worker)` (a backend's: it returns the
        outcome and a future that resolves once the worker is gone) on a worker from
        `ready(device)`, once its device can take it. The worker is made ready first: a job
        waiting for one holds no lease. "cuda" picks the GPU free for it now, or else the least
        loaded one, and passes "cuda:N". A job marked `alone` holds its device alone, as a timing
        job does (on the CPU: no timing job and no other check beside it)."""
        exclusive = job.kind in TIMING_KINDS
        t0 = time.perf_counter()
        if device == "cuda":
            if self._gpu_leases is None:
                self._gpu_leases = [_GpuLease() for _ in range(max(gpu_count(), 1))]
            i = min(range(len(self._gpu_leases)), key=lambda n: self._gpu_leases[n].load)  # type: ignore[index]
            lease, device = self._gpu_leases[i], f"cuda:{i}"
            worker = await ready(device)
            t_ready = time.perf_counter()
            alone = exclusive or job.alone
            number = next(self._jobs)
            # with "loop", a timing job takes its GPU's timing turn with the lease and keeps it until
            # its worker is gone: no other timing job calibrates or times while a process with this
            # job's candidate loaded exists, though checks share the GPU after its loops (`JobLease`)
            turn = number if exclusive and self.exclusive_from == "loop" else None
            ticket = lease.ask(alone, urgent=job.kind == "reference", turn=turn)
            try:
                while not lease.try_acquire(ticket):
                    await asyncio.sleep(0.005)
            except BaseException:
                lease.withdraw(ticket)
                unused(worker)
                raise
            t_leased = time.perf_counter()
            hold = LeaseHold(job.kind, alone, t_ready, t_leased, job=number,
                             turn_s=(t_leased, None) if turn is not None else None)
            self.holds.append(hold)
            timing = JobLease(self, lease, job.kind, device, hold, responder) if exclusive else None

            def release(_f: object = None) -> None:
                if timing is not None:
                    timing.release()
                elif hold.released_s is None:
                    hold.released_s = time.perf_counter()
                    lease.release(hold.exclusive)
                if turn is not None and hold.turn_s is not None and hold.turn_s[1] is None:
                    hold.turn_s = (hold.turn_s[0], time.perf_counter())
                    lease.end_turn(turn)

            gone: asyncio.Future[None] | None = None
            try:
                outcome, gone = await run_on(job, device, timing if timing is not None else responder, worker)
                (timing.last_hold if timing is not None else hold).result_s = time.perf_counter()
            finally:  # by default the GPU is free once the worker (and its CUDA context) is gone
                if gone is None or self.release_at_result:
                    release()
                else:
                    gone.add_done_callback(release)
            if timing is not None:
                outcome.lease_upgrade_s = timing.waited_s
            return _waits(outcome, t0, t_ready, t_leased)
        cores = max(1, (os.cpu_count() or 2))
        if self._cpu_slots is None or self._cpu_timing is None:  # both are made at once
            self._cpu_slots = asyncio.Semaphore(cores)
            self._cpu_timing = asyncio.Lock()
        worker = await ready(device)
        t_ready = time.perf_counter()
        # a job alone: no timing job, and every check's slot (taken behind the timing lock, one at a time)
        slots: list[asyncio.Lock | asyncio.Semaphore] = (
            [self._cpu_timing, *[self._cpu_slots] * cores] if job.alone
            else [self._cpu_timing if exclusive else self._cpu_slots])
        taken = 0
        try:
            for slot in slots:
                await slot.acquire()
                taken += 1
        except BaseException:
            for slot in slots[:taken]:
                slot.release()
            unused(worker)
            raise
        t_leased = time.perf_counter()
        try:
            outcome, gone = await run_on(job, device, responder, worker)
            if exclusive or job.alone:
                await gone
        finally:
            for slot in slots:
                slot.release()
        return _waits(outcome, t0, t_ready, t_leased)


class JobLease:
    """A GPU timing job's lease, and the responder its worker's requests go through.

    With `exclusive_from == "loop"` the job takes its GPU's timing turn with its lease
    (`_GpuLease`) and keeps it until its worker is gone, so no other timing job calibrates or
    times while a process with its candidate loaded exists. It holds the GPU alone from its start
    through its timer's calibration, the candidate's load and its timed loop; a loop's "stop"
    answer gives the GPU back to checks, so the job's end checks and its worker's exit run beside
    them (a check is never timed, and no other timing job starts before the worker is gone). A
    later loop's first "call" (or an "exclusive" request) waits for the GPU alone again, that is
    for the checks beside it to end (checks that ask later wait behind it); no call is ever
    served on a shared GPU. "shared" (which the harness sends once its calibration is in) changes
    nothing: a check let in while the candidate loads would hold the loop off for as long as it
    runs, in the job's turn; it is refused once calls began. The job's time limit is extended
    by its waits. With "job" the job holds the GPU alone from its ready worker until its worker
    is gone (or its result is in: `release_at_result`).

    Calibration: "calibration_known" is answered with the calibration the scheduler keeps for
    this GPU (`JobScheduler.calibration_for`), which is then also handed to the job's feed as if
    the worker had sent it (the parent computes each call's time from its own copy, never from the
    worker's); without one the worker measures its own, alone on the GPU and before its candidate
    loads, and the first such calibration of a job, taken while it held the GPU alone and before
    any call, is kept for the later jobs on the GPU. A candidate that forges a second calibration
    is refused by the feed (one per job, before any call) and is never kept."""

    def __init__(self, scheduler: JobScheduler, lease: _GpuLease, kind: str, device: str, hold: LeaseHold,
                 inner: Responder | None) -> None:
        self._scheduler, self._lease, self._kind, self._device = scheduler, lease, kind, device
        self._inner = inner
        self._loop = asyncio.get_running_loop()
        self._held: bool | None = hold.exclusive  # True: alone, False: shared, None: nothing (waiting, or over)
        self._holds = [hold]
        self._ended = False
        self._calibrated = self._called = False
        self.waited_s = 0.0

    @property
    def exclusive(self) -> bool:
        return self._held is True

    @property
    def shares(self) -> bool:
        """Whether the job gives the GPU back to checks after its loops (`exclusive_from`)."""
        return self._scheduler.exclusive_from == "loop"

    @property
    def last_hold(self) -> LeaseHold:
        return self._holds[-1]

    async def _switch(self, alone: bool) -> None:
        """Give back the lease the job holds and wait, in turn, for the other kind: the GPU alone
        (`alone`: a loop's first call) or shared (after a loop)."""
        holding = not alone  # the kind it must hold now
        if self._held is not holding or self._ended:
            return
        t0 = time.perf_counter()
        self._lease.release(holding)
        self._holds[-1].released_s = t0
        self._held = None
        ticket = self._lease.ask(alone, turn=self._holds[0].job if self.shares else None)
        try:
            while not self._lease.try_acquire(ticket):
                if self._ended:  # the job ended while it waited
                    self._lease.withdraw(ticket)
                    return
                await asyncio.sleep(0.005)
        except BaseException:
            self._lease.withdraw(ticket)
            raise
        t1 = time.perf_counter()
        if self._ended:  # it ended as the lease came: give it (and the turn it may have taken) back
            self._lease.release(alone)
            self._lease.end_turn(self._holds[0].job)
            return
        self._held = alone
        hold = LeaseHold(self._kind, alone, t0, t1, job=self._holds[0].job)
        self._holds.append(hold)
        self._scheduler.holds.append(hold)
        self.waited_s += t1 - t0

    def release(self) -> None:
        """The job is over (on the loop; once)."""
        if self._ended:
            return
        self._ended = True
        if self._held is not None:
            self._lease.release(self._held)
            self._holds[-1].released_s = time.perf_counter()
            self._held = None

    def __call__(self, request: dict[str, Any], arrived_s: float) -> dict[str, Any]:
        """Answer one of the worker's requests (on the frame reader's thread)."""
        what = request.get("what")
        if what in ("exclusive", "call") and self._held is False:
            asyncio.run_coroutine_threadsafe(self._switch(True), self._loop).result()
            arrived_s = time.perf_counter()  # the feed's clock of this request starts now
        if what in ("exclusive", "call") and not self.exclusive:
            return {"refused": "the job ended before it had the GPU alone"}
        if what == "exclusive":
            return {}
        if what == "shared":  # the job keeps the GPU alone until its loop ends (see above)
            if self._called:
                return {"refused": "the GPU was asked back after calls began"}
            return {} if self._held is not None else {"refused": "the job ended"}
        if self._inner is None:
            return {"refused": "this job takes no requests"}
        if what == "calibration_known":
            known = None if self._calibrated or self._called else self._scheduler.calibration_for(self._device)
            if known is None:
                return {}
            reply = self._inner({"what": "calibration", "calibration": known}, arrived_s)
            self._calibrated = True
            return reply if "refused" in reply else {"calibration": known}
        reply = self._inner(request, arrived_s)
        if what == "call" and reply.get("stop") and self._held is True and self.shares:
            # the loop is over (its evidence is in): checks may use the GPU again while the job
            # ends; its next loop's first call waits for the GPU alone, and the job keeps its
            # GPU's timing turn until its worker is gone
            asyncio.run_coroutine_threadsafe(self._switch(False), self._loop).result()
        if what == "calibration" and not self._calibrated and not self._called and self.exclusive \
                and "refused" not in reply and isinstance(request.get("calibration"), dict):
            self._scheduler.calibrated(self._device, request["calibration"])
        self._calibrated |= what == "calibration"
        self._called |= what == "call"
        return reply


def _waits(outcome: JobOutcome, t0: float, t_ready: float, t_leased: float) -> JobOutcome:
    outcome.wait_s, outcome.lease_wait_s = t_ready - t0, t_leased - t_ready
    return outcome


class QuietWindows:
    """When a timing job wants the machine quiet: the other jobs of the sandbox that share its
    cores (every running check on the CPU target; on a GPU, the CPU target's checks) are frozen,
    and the spares still starting (importing torch, creating a CUDA context) are paused, from the
    job's start (its timer's calibration, then its first timed loop) until that loop ends, and
    again during each later timed loop, from a role's first call request to the "stop" answer
    that ends it. Between loops (torch.compile, a library's plan) they go on, so that
    back-to-back timing jobs neither drain the pool of ready spares nor hold checks off for long.
    A job or spare that starts during a window is paused at once.

    `pause(items, on)` pauses (on) or resumes them and returns how many processes it paused;
    `others()` lists what a window pauses; `load()`, where given, returns the cumulative CPU
    seconds (host, the timing job's own processes, the evaluator's process) from which each
    window's host load is measured (`load_report`). The responder runs on the frame reader's
    thread, the rest on the loop."""

    def __init__(self, pause: Callable[[list[Any], bool], int | None], others: Callable[[], list[Any]],
                 load: Callable[[], tuple[float, float, float]] | None = None, shares: bool = True) -> None:
        self._pause, self._others, self._load = pause, others, load
        self.shares = shares  # the job gives the GPU back at its "shared" request (`JobLease`): the window closes
        self._lock = threading.Lock()
        self._paused: list[Any] | None = None  # None: no window open
        self._at_begin: tuple[int, tuple[float, float, float] | None] | None = None
        self.spans_ns: list[list[int]] = []
        self._busy = [0.0, 0.0, 0.0]
        self._frozen_items: set[int] = set()
        self.frozen_processes = 0

    def _paused_now(self, items: list[Any]) -> None:
        n = self._pause(items, True) or 0
        self.frozen_processes += n
        self._frozen_items.update(id(i) for i in items)

    def begin(self) -> None:
        with self._lock:
            if self._paused is None:
                self._paused = self._others()
                self._paused_now(self._paused)
                self._at_begin = time.monotonic_ns(), self._load() if self._load else None

    def end(self) -> None:
        with self._lock:
            if self._paused is not None:
                t_end, load = time.monotonic_ns(), self._load() if self._load else None
                if self._at_begin is not None:
                    t0, load0 = self._at_begin
                    self.spans_ns.append([t0, t_end])
                    if load is not None and load0 is not None:
                        for i in range(3):
                            self._busy[i] += load[i] - load0[i]
                self._pause(self._paused, False)
                self._paused = None

    def started(self, item: Any) -> None:
        """A spare that began starting, or a job that began running, now: paused if a window is open."""
        with self._lock:
            if self._paused is not None and item not in self._paused:  # (begin may have found it)
                self._paused_now([item])
                self._paused.append(item)

    def load_report(self) -> dict[str, Any]:
        """The host's load over the windows so far (see `JobOutcome.host_load`); {} without any."""
        if not self.spans_ns:
            return {}
        window_s = sum(e - b for b, e in self.spans_ns) / 1e9
        report: dict[str, Any] = {"windows": len(self.spans_ns), "window_s": window_s, "spans_ns": list(self.spans_ns),
                                  "frozen_jobs": len(self._frozen_items), "frozen_processes": self.frozen_processes}
        if self._load is not None:
            host, job, parent = self._busy
            report.update(host_busy_s=host, job_busy_s=job, parent_busy_s=parent,
                          other_cores=max(0.0, host - job - parent) / window_s if window_s > 0 else 0.0)
        return report

    def responder(self, inner: Responder | None) -> Responder | None:
        """`inner`, opening a window at each call request (and at the request for the GPU alone)
        and closing it when a loop stops (or a request is refused: the job is over)."""
        if inner is None:
            return None

        def answer(request: dict[str, Any], arrived_s: float) -> dict[str, Any]:
            if request.get("what") == "shared" and self.shares:
                # closed before the job waits for its shared lease: a check that gets the GPU in the
                # meantime must not be frozen by this window, or the timing jobs queued between
                # would wait on it, and this job on them (a deadlock until this job's time limit)
                self.end()
            reply = inner(request, arrived_s)  # (a job that starts shared has the GPU alone once it returns)
            if reply.get("stop") or "refused" in reply:
                self.end()
            elif request.get("what") in ("call", "exclusive"):
                self.begin()  # before the worker has the answer
            return reply

        return answer


@dataclass(eq=False)
class RunningJob:
    """A check running beside timing jobs: what a timing job's windows freeze (its worker and
    whatever holds its processes), and how long it was frozen (its time limit is extended by that)."""

    worker: Any
    device: str
    handle: Any = None  # the backend's (the local backend's job cgroup)
    frozen_total_s: float = 0.0
    frozen_since: float | None = None
    stopped: list[int] | None = None  # pids stopped by signal, where there was no freezer

    def frozen_s(self) -> float:
        now = time.perf_counter()
        return self.frozen_total_s + (now - self.frozen_since if self.frozen_since is not None else 0.0)


def lost_before_start(outcome: JobOutcome) -> bool:
    """Whether the worker was gone before it started its job: it exited without the `started`
    frame it sends once the job is read and confined, before any candidate code runs (a spare
    killed with its fork server, or by the OOM killer, while it waited)."""
    return (outcome.final is None and outcome.started is None and not outcome.timed_out
            and outcome.channel_error is None and not outcome.memory_exceeded and not outcome.process_limited
            and outcome.device_busy is None)


class SpareWorkerSandbox(Sandbox):
    """A sandbox whose workers are started ahead of need and used for one job each, driven from
    one private event-loop thread (so callers on any loop, or none, can use it). Backends
    provide `_ready` (a ready spare), `_run_on` (one job in it, see `RunOn`), `_unused`, `_spawn`
    and `_stop_spares` (stop them at `close`)."""

    _stop_timeout_s = 10.0
    config: SpareWorkerConfig  # the backend's settings
    _spares: dict[str, list[Any]]  # the backend's ready spares, per device

    def _start_loop(self, name: str) -> None:
        self._loop_thread = LoopThread(name)
        self._closed = False
        self._scheduler = JobScheduler(self.config.release_gpu_at_result, self.config.exclusive_from,
                                       self.config.calibration_max_age_s)
        self._starting: dict[str, set[asyncio.Future[None]]] = {}  # spares being started, per device
        self._quiet: dict[str, QuietWindows] = {}  # the running timing job's, per device
        # (device, `QuietWindows.load_report()`) of the last timing jobs: what their windows fenced off
        self.quiet_reports: collections.deque[tuple[str, dict[str, Any]]] = collections.deque(maxlen=1000)

    @abc.abstractmethod
    async def _ready(self, device: str) -> Any:
        """A spare of `device` that is ready for a job (SandboxError if none starts)."""

    @abc.abstractmethod
    def _unused(self, worker: Any) -> None:
        """A ready spare that got no job (its job was cancelled): back to the pool."""

    @abc.abstractmethod
    async def _run_on(self, job: Job, device: str, responder: Responder | None,
                      worker: Any) -> tuple[JobOutcome, asyncio.Future[None]]: ...

    @abc.abstractmethod
    async def _spawn(self, device: str) -> Any: ...

    async def _replenish(self, device: str) -> None:
        """Start spares for `device`, one after another, until the ready and starting ones make
        `spare_workers`."""
        pool = self._spares.setdefault(device, [])
        starting = self._starting.setdefault(device, set())
        want = self.config.spares_for(device)
        while len(pool) + len(starting) < want and not self._closed:
            start = asyncio.ensure_future(self._start_spare(device))
            starting.add(start)
            start.add_done_callback(starting.discard)
            await start

    async def _start_spare(self, device: str) -> None:
        # The spare joins the pool in the same task that starts it: `close` waits for these tasks,
        # then stops the pool's spares, so none is left running
        worker = await self._spawn(device)
        self._spares.setdefault(device, []).append(worker)
        if device in self._quiet:
            self._quiet[device].started(worker)

    @abc.abstractmethod
    def _pause(self, workers: list[Any], pause: bool) -> None:
        """Pause (or resume) these spares."""

    @abc.abstractmethod
    def _is_starting(self, worker: Any) -> bool:
        """Whether this spare is still starting (alive, not yet ready)."""

    def _running_beside(self, device: str) -> list[Any]:
        """The running jobs a timing job on `device` fences off in its windows (none here)."""
        return []

    def _pause_running(self, jobs: list[Any], pause: bool) -> int:
        """Freeze (or thaw) running jobs; the number of processes frozen."""
        return 0

    def _host_load(self, worker: Any) -> Callable[[], tuple[float, float, float]] | None:
        """The cumulative CPU seconds (host, `worker`'s processes, this process), or None."""
        return None

    def _quiet_windows(self, device: str, worker: Any = None, begin: bool = True, shares: bool = False) -> QuietWindows:
        """The quiet windows of the timing job starting now on `device` in `worker` (timing jobs
        have a device alone, so one at a time), the first one open unless not `begin` (a job that
        starts with a shared lease opens it once it has the GPU alone); `_quiet_over` closes them."""
        def others() -> list[Any]:
            spares = [w for w in self._spares.get(device, []) if self._is_starting(w)]
            return (spares if self.config.freeze_starting_spares else []) + self._running_beside(device)

        def pause(items: list[Any], on: bool) -> int:
            spares = [i for i in items if not isinstance(i, RunningJob)]
            if spares:
                self._pause(spares, on)
            return self._pause_running([i for i in items if isinstance(i, RunningJob)], on)

        q = self._quiet[device] = QuietWindows(pause, others, self._host_load(worker), shares)
        if begin:
            q.begin()
        return q

    def _quiet_over(self, device: str, q: QuietWindows) -> None:
        q.end()
        if self._quiet.get(device) is q:
            del self._quiet[device]
        self.quiet_reports.append((device, q.load_report()))

    async def _shutdown(self) -> None:
        while starting := [t for tasks in self._starting.values() for t in tasks]:
            await asyncio.gather(*starting, return_exceptions=True)
        await self._stop_spares()

    @abc.abstractmethod
    async def _stop_spares(self) -> None: ...

    # a spare that dies before it takes its job (its fork server killed, the OOM killer) costs
    # another worker, not the job: retried this many times
    LOST_WORKER_RETRIES = 2

    async def _before_lease(self, job: Job, device: str, worker: Any) -> None:
        """What a backend does for `job` once its worker is ready and before the job asks for its
        device's lease (nothing here): work that needs neither the device alone nor the job's
        candidate, kept out of the lease."""

    async def _run_job(self, job: Job, device: str, responder: Responder | None) -> JobOutcome:
        """Run `job` on a spare; again on another one while the worker was lost before it started
        the job (no `started` frame: no candidate code ran and no request was answered)."""

        async def ready(dev: str) -> Any:
            worker = await self._ready(dev)
            try:
                await self._before_lease(job, dev, worker)
            except BaseException:
                self._unused(worker)
                raise
            return worker

        for _ in range(self.LOST_WORKER_RETRIES):
            outcome = await self._scheduler.run(job, device, responder, ready, self._run_on, self._unused)
            if not lost_before_start(outcome):
                return outcome
        return await self._scheduler.run(job, device, responder, ready, self._run_on, self._unused)

    async def run(self, job: Job, device: str, responder: Responder | None = None) -> JobOutcome:
        return await self._loop_thread.acall(self._run_job(job, device, responder))

    def run_sync(self, job: Job, device: str, responder: Responder | None = None) -> JobOutcome:
        return self._loop_thread.call(self._run_job(job, device, responder))

    @property
    def lease_holds(self) -> list[LeaseHold]:
        """The GPU leases held so far (the last `JobScheduler.MAX_HOLDS`)."""
        return list(self._scheduler.holds)

    def warm(self, device: str) -> None:
        """Start spare workers for `device` now (they are otherwise started on first use)."""
        self._loop_thread.call(self._replenish(device))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._loop_thread.call(self._shutdown(), timeout=self._stop_timeout_s)
        finally:
            self._loop_thread.stop()

    def __del__(self) -> None:  # best effort: never leave spares behind
        try:  # no module global here: at interpreter exit they may be None already (`contextlib` was)
            self.close()
        except Exception:  # noqa: BLE001, S110 - nothing to report to at exit
            pass
