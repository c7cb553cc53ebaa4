"""The GPU lease (`cudagym.sandbox.schedule`): granted in the order jobs asked for it, and asked for
only once a job's worker is ready, so that jobs waiting for workers to start hold no GPU."""

from __future__ import annotations

import asyncio

from cudagym.sandbox.worker.wire import JobOutcome
from cudagym.sandbox.schedule import JobScheduler, _GpuLease
from cudagym.sandbox.worker.wire import Job


def test_a_check_waits_behind_a_timing_job_that_asked_first():
    lease = _GpuLease()
    first = lease.ask(False)
    assert lease.try_acquire(first)  # a check holds it
    timing = lease.ask(True)
    later = lease.ask(False)
    assert not lease.try_acquire(timing), "a timing job waits for the checks that hold the GPU"
    assert not lease.try_acquire(later), "a check that asked after a waiting timing job waits behind it"
    lease.release(False)
    assert lease.try_acquire(timing)
    assert not lease.try_acquire(later)
    lease.release(True)
    assert lease.try_acquire(later)


def test_checks_share_and_a_withdrawn_ticket_blocks_nobody():
    lease = _GpuLease()
    a, b = lease.ask(False), lease.ask(False)
    assert lease.try_acquire(b) and lease.try_acquire(a), "checks share the GPU, in any order"
    gone = lease.ask(True)
    c = lease.ask(False)
    lease.withdraw(gone)  # its job was cancelled
    assert lease.try_acquire(c)
    assert lease.load == 3


def _job(kind: str) -> Job:
    return Job(kind=kind, nonce="n", task_id="t", device="cuda")  # type: ignore[arg-type]


def test_a_job_waiting_for_its_worker_holds_no_gpu():
    """A check whose worker takes a while to start does not hold a timing job off the GPU."""

    async def main() -> list[str]:
        events: list[str] = []
        slow_start = asyncio.Event()

        async def ready(device: str) -> str:
            if not events:
                events.append("check waits for its worker")
                await slow_start.wait()
            return device

        async def run_on(job: Job, device: str, responder, worker):
            events.append(f"{job.kind} runs on {device}")
            if job.kind == "profile":
                slow_start.set()
            await asyncio.sleep(0.01)
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return JobOutcome(final={}, seconds=0.01), done

        sched = JobScheduler()
        check = asyncio.ensure_future(sched.run(_job("verify"), "cuda", None, ready, run_on, lambda w: None))
        await asyncio.sleep(0.05)
        timing = await asyncio.wait_for(sched.run(_job("profile"), "cuda", None, ready, run_on, lambda w: None), 5)
        await asyncio.wait_for(check, 5)
        assert timing.lease_wait_s < 1
        return events

    assert asyncio.run(main()) == ["check waits for its worker", "profile runs on cuda:0", "verify runs on cuda:0"]


def test_a_cancelled_job_returns_its_ready_worker():
    async def main() -> list[str]:
        returned: list[str] = []
        hold = asyncio.Event()

        async def ready(device: str) -> str:
            return "worker"

        async def run_on(job: Job, device: str, responder, worker):
            await hold.wait()
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return JobOutcome(final={}), done

        sched = JobScheduler()
        busy = asyncio.ensure_future(sched.run(_job("profile"), "cuda", None, ready, run_on, returned.append))
        await asyncio.sleep(0.02)
        waiting = asyncio.ensure_future(sched.run(_job("profile"), "cuda", None, ready, run_on, returned.append))
        await asyncio.sleep(0.02)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        hold.set()
        await busy
        return returned

    assert asyncio.run(main()) == ["worker"]


def test_a_reference_job_goes_ahead_of_waiting_timing_jobs_but_never_beside_one():
    """A reference-only job (what a finished profile's re-check or a verify waits on) does not
    queue behind timing jobs that are only waiting, and still never shares the GPU with one."""
    lease = _GpuLease()
    check = lease.ask(False)
    assert lease.try_acquire(check)
    timing = lease.ask(True)
    reference = lease.ask(False, urgent=True)
    assert lease.try_acquire(reference), "an urgent check passes a timing job that only waits"
    lease.release(False)
    lease.release(False)
    assert lease.try_acquire(timing)
    during = lease.ask(False, urgent=True)
    assert not lease.try_acquire(during), "nothing shares the GPU with a timing job"
    lease.release(True)
    assert lease.try_acquire(during)


def test_leases_are_logged_and_end_at_the_result_when_asked():
    """`holds` records each GPU lease; with `release_at_result` a timing job's lease ends when
    its result is in, before its worker is gone."""

    async def main(release_at_result: bool) -> tuple[list, bool]:
        worker_gone = asyncio.Event()

        async def ready(device: str) -> str:
            return "worker"

        async def run_on(job: Job, device: str, responder, worker):
            gone = asyncio.get_running_loop().create_future()

            async def go() -> None:
                await worker_gone.wait()
                gone.set_result(None)

            asyncio.ensure_future(go())
            return JobOutcome(final={}), gone

        sched = JobScheduler(release_at_result)
        await sched.run(_job("profile"), "cuda", None, ready, run_on, lambda w: None)
        released_before_gone = sched.holds[0].released_s is not None
        worker_gone.set()
        await asyncio.sleep(0.01)
        return list(sched.holds), released_before_gone

    holds, early = asyncio.run(main(False))
    assert not early and len(holds) == 1 and holds[0].exclusive and holds[0].kind == "profile"
    assert holds[0].asked_s <= holds[0].acquired_s <= holds[0].result_s <= holds[0].released_s
    holds, early = asyncio.run(main(True))
    assert early and holds[0].released_s <= holds[0].result_s + 1


def _answers(kind: str, sched: JobScheduler, script, inner_log: list) -> asyncio.Future:
    """Run one `kind` job through `sched` whose worker sends the requests `script(ask)` makes
    (`ask(request)` answers through the job's responder, from another thread, as the frame
    reader does)."""

    async def ready(device: str) -> str:
        return "worker"

    def inner(request: dict, arrived: float) -> dict:
        inner_log.append(request)
        return {"seed": 1} if request.get("what") == "call" else {}

    async def run_on(job: Job, device: str, responder, worker):
        async def ask(request: dict) -> dict:
            return await asyncio.to_thread(responder, request, 0.0)

        final = await script(ask)
        gone = asyncio.get_running_loop().create_future()
        gone.set_result(None)
        return JobOutcome(final=final), gone

    return asyncio.ensure_future(sched.run(_job(kind), "cuda", inner, ready, run_on, lambda w: None))


def test_a_calibration_measured_alone_is_handed_to_the_next_job_on_the_gpu():
    """The first job measures its calibration alone and before any call; the scheduler keeps it
    and gives it to the next job (and to that job's feed, as if its worker had sent it). A
    calibration sent after a call, or by a job without the GPU alone, is never kept."""
    cal = {"overhead_ns": 4000, "read_cap_ns": 9000, "read_ps_per_element": 0.5,
           "read_ps_per_strided_element": 1.0, "base_elements": 4096}

    async def main() -> None:
        sched = JobScheduler(exclusive_from="loop", calibration_max_age_s=60)
        log: list = []

        async def forged_late(ask) -> dict:
            assert await ask({"what": "calibration_known"}) == {}
            await ask({"what": "exclusive"})
            await ask({"what": "call", "role": "candidate", "index": 0})
            await ask({"what": "calibration", "calibration": dict(cal, overhead_ns=90_000)})  # after a call
            return {}

        await asyncio.wait_for(_answers("profile", sched, forged_late, log), 5)
        assert sched.calibration_for("cuda:0") is None

        async def first(ask) -> dict:
            assert await ask({"what": "calibration_known"}) == {}
            await ask({"what": "exclusive"})
            await ask({"what": "calibration", "calibration": cal})
            return {}

        await asyncio.wait_for(_answers("profile", sched, first, log), 5)
        assert sched.calibration_for("cuda:0") == cal
        log.clear()

        async def second(ask) -> dict:
            assert await ask({"what": "calibration_known"}) == {"calibration": cal}
            assert await ask({"what": "calibration_known"}) == {}, "once per job"
            return {}

        await asyncio.wait_for(_answers("profile", sched, second, log), 5)
        assert log == [{"what": "calibration", "calibration": cal}], "the feed gets the parent's copy"

    asyncio.run(main())
    old = JobScheduler(calibration_max_age_s=0.0)
    old.calibrated("cuda:0", cal)
    assert old.calibration_for("cuda:0") is None, "age 0: every job measures its own"


def _stops_at(index: int):
    """A feed (the responder inside `JobLease`) whose loop stops at call `index`."""
    def inner(request: dict, arrived: float) -> dict:
        if request.get("what") != "call":
            return {}
        return {"seed": 1, "stop": request.get("index") == index}
    return inner


async def _ready(device: str) -> str:
    return "worker"


def _run_on(script, gone: asyncio.Future):
    """A backend's `run_on` whose worker makes `script(ask)`'s requests; its worker is gone once
    `gone` resolves."""
    async def run(job: Job, device: str, responder, worker):
        async def ask(request: dict) -> dict:
            return await asyncio.to_thread(responder, request, 0.0)

        final = await script(ask)
        return JobOutcome(final=final if isinstance(final, dict) else {}), gone
    return run


def _done() -> asyncio.Future:
    f = asyncio.get_running_loop().create_future()
    f.set_result(None)
    return f


def test_a_timing_job_holds_the_gpu_alone_until_its_loop_stops_then_shares_it():
    """With `exclusive_from="loop"` a check that asks after a timing job started waits through its
    calibration, its candidate's load ("shared" changes nothing) and its loop, and runs beside
    its end once the loop's "stop" is answered; "shared" after a call is refused."""

    async def main() -> list[str]:
        sched = JobScheduler(exclusive_from="loop")
        events: list[str] = []
        started = asyncio.Event()

        async def timing(ask) -> None:
            started.set()
            assert await ask({"what": "exclusive"}) == {}
            assert await ask({"what": "shared"}) == {}
            await asyncio.sleep(0.05)
            events.append("loaded")
            assert await ask({"what": "call", "role": "candidate", "index": 0}) == {"seed": 1, "stop": False}
            assert await ask({"what": "call", "role": "candidate", "index": 1}) == {"seed": 1, "stop": True}
            events.append("loop over")
            assert "refused" in await ask({"what": "shared"})
            await asyncio.sleep(0.05)
            events.append("end checks over")

        async def check(ask) -> None:
            events.append(f"check runs (GPU alone: {sched._gpu_leases[0].exclusive})")

        t = asyncio.ensure_future(sched.run(_job("profile"), "cuda", _stops_at(1), _ready,
                                            _run_on(timing, _done()), lambda w: None))
        await started.wait()
        await asyncio.wait_for(sched.run(_job("verify"), "cuda", None, _ready, _run_on(check, _done()),
                                         lambda w: None), 5)
        await asyncio.wait_for(t, 5)
        assert [(h.kind, h.exclusive) for h in sched.holds] == [("profile", True), ("profile", False),
                                                                 ("verify", False)]
        assert all(h.released_s is not None for h in sched.holds)
        return events

    events = asyncio.run(main())
    # the check runs once the stop is answered, beside the end checks: whether it or the timing job's
    # next step comes first after that answer is the event loop's to choose (a loaded CI host flipped it)
    assert events[0] == "loaded" and events[-1] == "end checks over", events
    assert sorted(events[1:3]) == ["check runs (GPU alone: False)", "loop over"], events


def test_a_timing_job_keeps_its_turn_until_its_worker_is_gone():
    """A second timing job does not start while the first one's worker, past its loop and
    sharing the GPU with checks, has not exited; a check that asks after the second timing job
    waits behind it (the order they asked in), one that asked before runs beside the first's end."""

    async def main() -> list[str]:
        sched = JobScheduler(exclusive_from="loop")
        events: list[str] = []
        first_stopped = asyncio.Event()
        first_gone = asyncio.get_running_loop().create_future()

        async def first(ask) -> None:
            events.append("first starts")
            await ask({"what": "call", "role": "candidate", "index": 0})
            first_stopped.set()

        async def second(ask) -> None:
            events.append("second starts")

        def check(name: str):
            async def script(ask) -> None:
                events.append(name)
            return script

        t1 = asyncio.ensure_future(sched.run(_job("profile"), "cuda", _stops_at(0), _ready,
                                             _run_on(first, first_gone), lambda w: None))
        await asyncio.sleep(0.01)
        early = asyncio.ensure_future(sched.run(_job("verify"), "cuda", None, _ready,
                                                _run_on(check("check asked before the second"), _done()),
                                                lambda w: None))
        await asyncio.sleep(0.01)
        t2 = asyncio.ensure_future(sched.run(_job("profile"), "cuda", _stops_at(0), _ready,
                                             _run_on(second, _done()), lambda w: None))
        await asyncio.sleep(0.01)
        late = asyncio.ensure_future(sched.run(_job("verify"), "cuda", None, _ready,
                                               _run_on(check("check asked after the second"), _done()),
                                               lambda w: None))
        await asyncio.wait_for(asyncio.gather(t1, early), 5)
        await asyncio.sleep(0.05)
        assert not t2.done() and not late.done()
        events.append("first worker gone")
        first_gone.set_result(None)
        await asyncio.wait_for(asyncio.gather(t2, late), 5)
        first_hold = sched.holds[0]
        assert first_hold.turn_s is not None and first_hold.turn_s[1] is not None
        lease = sched._gpu_leases[0]
        assert (lease.shared, lease.exclusive, lease.waiting, lease.turn) == (0, False, {}, None)
        return events

    assert asyncio.run(main()) == ["first starts", "check asked before the second", "first worker gone",
                                   "second starts", "check asked after the second"]


def test_a_timing_job_that_ends_while_waiting_for_the_gpu_leaves_no_lease():
    """A later loop's first call waits for the checks let in after the first loop; the job ends
    (its time limit) while it waits: the request is refused and no lease or turn is left."""

    async def main() -> None:
        sched = JobScheduler(exclusive_from="loop")
        hold = asyncio.Event()
        stopped = asyncio.Event()

        async def waiter(ask) -> dict:
            await ask({"what": "call", "role": "candidate", "index": 0})  # stops: the GPU is shared
            stopped.set()
            await asyncio.sleep(0.05)  # the check takes its shared lease
            asking = asyncio.ensure_future(ask({"what": "call", "role": "baseline", "index": 0}))
            await asyncio.sleep(0.05)
            assert not asking.done(), "a check still shares the GPU"
            return {"abandoned": asking}

        async def holder(ask) -> None:
            await hold.wait()

        t = asyncio.ensure_future(sched.run(_job("profile"), "cuda", _stops_at(0), _ready,
                                            _run_on(waiter, _done()), lambda w: None))
        await stopped.wait()
        h = asyncio.ensure_future(sched.run(_job("verify"), "cuda", None, _ready, _run_on(holder, _done()),
                                            lambda w: None))
        out = await asyncio.wait_for(t, 5)
        hold.set()
        await asyncio.wait_for(h, 5)
        assert await asyncio.wait_for(out.final["abandoned"], 5) == {
            "refused": "the job ended before it had the GPU alone"}
        lease = sched._gpu_leases[0]
        assert (lease.shared, lease.exclusive, lease.waiting, lease.turn) == (0, False, {}, None)

    asyncio.run(main())


def test_a_timing_job_with_two_loops_is_not_held_off_by_the_timing_job_waiting_for_its_turn():
    """A timing job whose second loop (another role) starts after a second timing job asked for
    the GPU: the second loop goes first (the waiting job waits for the turn, which the first holds
    until its worker is gone), once the check let in after the first loop has ended."""

    async def main() -> list[str]:
        sched = JobScheduler(exclusive_from="loop")
        events: list[str] = []
        first_loop_over = asyncio.Event()

        def feed(request: dict, arrived: float) -> dict:
            return {"seed": 1, "stop": True} if request.get("what") == "call" else {}

        async def first(ask) -> None:
            await ask({"what": "call", "role": "candidate", "index": 0})
            first_loop_over.set()
            await asyncio.sleep(0.05)  # the second timing job and a check ask meanwhile
            await ask({"what": "call", "role": "eager", "index": 0})
            events.append("first's second loop")

        async def second(ask) -> None:
            events.append("second timing job")

        async def check(ask) -> None:
            events.append("check")

        t1 = asyncio.ensure_future(sched.run(_job("profile"), "cuda", feed, _ready, _run_on(first, _done()),
                                             lambda w: None))
        await first_loop_over.wait()
        t2 = asyncio.ensure_future(sched.run(_job("profile"), "cuda", feed, _ready, _run_on(second, _done()),
                                             lambda w: None))
        await asyncio.sleep(0.01)
        c = asyncio.ensure_future(sched.run(_job("verify"), "cuda", None, _ready, _run_on(check, _done()),
                                            lambda w: None))
        await asyncio.wait_for(asyncio.gather(t1, t2, c), 5)
        return events

    assert asyncio.run(main()) == ["first's second loop", "second timing job", "check"]
