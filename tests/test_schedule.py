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


def test_a_timing_job_loads_beside_checks_and_times_alone():
    """With `exclusive_from="loop"` a timing job holds a shared lease while it loads (a check
    runs beside it), and its request for the GPU alone waits for that check to end; a call
    request that comes first (a forged one) gets the GPU alone first too."""

    async def main() -> list[str]:
        sched = JobScheduler(exclusive_from="loop")
        events: list[str] = []
        check_may_end = asyncio.Event()
        loaded = asyncio.Event()

        async def timing(ask) -> dict:
            events.append("timing job loads")
            loaded.set()
            assert (await ask({"what": "call", "role": "candidate", "index": 0})) == {"seed": 1}
            events.append("first call answered")
            return {}

        async def check(ask) -> dict:
            await loaded.wait()
            events.append("check runs beside the load")
            await asyncio.sleep(0.05)
            events.append("check ends")
            check_may_end.set()
            return {}

        log: list = []
        t = _answers("profile", sched, timing, log)
        c = _answers("verify", sched, check, log)
        out = await asyncio.wait_for(t, 5)
        await asyncio.wait_for(c, 5)
        assert out.lease_upgrade_s > 0.03, "the upgrade waited for the check"
        holds = list(sched.holds)
        assert [(h.kind, h.exclusive) for h in holds] == [("profile", False), ("verify", False), ("profile", True)]
        assert all(h.released_s is not None for h in holds)
        return events

    assert asyncio.run(main()) == ["timing job loads", "check runs beside the load", "check ends",
                                   "first call answered"]


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

        async def shared_only(ask) -> dict:  # never asked for the GPU alone
            await ask({"what": "calibration", "calibration": dict(cal, overhead_ns=80_000)})
            return {}

        await asyncio.wait_for(_answers("profile", sched, shared_only, log), 5)
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


def test_a_timing_job_that_ends_while_waiting_for_the_gpu_leaves_no_lease():
    async def main() -> None:
        sched = JobScheduler(exclusive_from="loop")
        log: list = []
        hold = asyncio.Event()

        async def holder(ask) -> dict:  # a check that holds its shared lease
            await hold.wait()
            return {}

        async def waiter(ask) -> dict:
            asking = asyncio.ensure_future(ask({"what": "exclusive"}))
            await asyncio.sleep(0.05)
            assert not asking.done(), "a check still shares the GPU"
            return {"abandoned": asking}  # the job ends (timed out) while its request waits

        h = _answers("verify", sched, holder, log)
        await asyncio.sleep(0.02)
        out = await asyncio.wait_for(_answers("profile", sched, waiter, log), 5)
        hold.set()
        await asyncio.wait_for(h, 5)
        assert await asyncio.wait_for(out.final["abandoned"], 5) == {
            "refused": "the job ended before it had the GPU alone"}
        lease = sched._gpu_leases[0]
        assert (lease.shared, lease.exclusive, lease.waiting) == (0, False, {})

    asyncio.run(main())


def test_a_timing_job_gives_the_gpu_back_between_its_calibration_and_its_loop():
    """"exclusive" (the calibration), "shared" (the candidate's load: a check may run beside it),
    then the first call has the GPU alone again; "shared" after a call is refused."""

    async def main() -> None:
        sched = JobScheduler(exclusive_from="loop")
        log: list = []
        loading = asyncio.Event()
        beside: list[bool] = []

        async def timing(ask) -> dict:
            assert await ask({"what": "exclusive"}) == {}
            assert await ask({"what": "shared"}) == {}
            loading.set()
            await asyncio.sleep(0.05)
            assert await ask({"what": "call", "role": "candidate", "index": 0}) == {"seed": 1}
            assert "refused" in await ask({"what": "shared"})
            return {}

        async def check(ask) -> dict:
            await loading.wait()
            beside.append(sched._gpu_leases[0].shared == 2)  # the timing job's load and this check
            return {}

        t = _answers("profile", sched, timing, log)
        await asyncio.sleep(0.01)
        c = _answers("verify", sched, check, log)
        await asyncio.wait_for(asyncio.gather(t, c), 5)
        assert beside == [True]
        kinds = [(h.kind, h.exclusive) for h in sched.holds if h.kind == "profile"]
        assert kinds == [("profile", False), ("profile", True), ("profile", False), ("profile", True)]
        lease = sched._gpu_leases[0]
        assert (lease.shared, lease.exclusive, lease.waiting) == (0, False, {})

    asyncio.run(main())


def test_a_timing_job_keeps_its_turn_until_its_worker_is_gone():
    """With `exclusive_from="loop"` a timing job keeps its GPU's timing turn from its start until
    its worker is gone: a second timing job does not calibrate (its "exclusive") while the
    first's candidate is loaded under a shared lease, nor while the first's worker, past its
    loop, has not exited; checks run beside the first's load and beside its end (its loop's
    "stop" gave the GPU back to them)."""

    async def main() -> list[str]:
        sched = JobScheduler(exclusive_from="loop")
        events: list[str] = []
        first_loaded, first_stopped, second_started = asyncio.Event(), asyncio.Event(), asyncio.Event()
        first_gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def ready(device: str) -> str:
            return "worker"

        def inner(request: dict, arrived: float) -> dict:
            if request.get("what") != "call":
                return {}
            return {"seed": 1, "stop": request.get("index") == 1}

        def run_on(script, gone):
            async def run(job: Job, device: str, responder, worker):
                async def ask(request: dict) -> dict:
                    return await asyncio.to_thread(responder, request, 0.0)

                await script(ask)
                return JobOutcome(final={}), gone
            return run

        async def first(ask) -> None:
            assert await ask({"what": "exclusive"}) == {}
            events.append("first calibrates")
            assert await ask({"what": "shared"}) == {}
            first_loaded.set()
            await asyncio.sleep(0.1)  # the second job is ready and waits for the turn meanwhile
            assert await ask({"what": "call", "role": "candidate", "index": 0}) == {"seed": 1, "stop": False}
            assert await ask({"what": "call", "role": "candidate", "index": 1}) == {"seed": 1, "stop": True}
            events.append("first loop over")
            first_stopped.set()

        async def second(ask) -> None:
            second_started.set()
            assert await ask({"what": "exclusive"}) == {}
            events.append("second calibrates")

        async def check(ask) -> None:
            await first_loaded.wait()
            events.append(f"check beside the load (shared {sched._gpu_leases[0].shared})")

        async def late_check(ask) -> None:
            events.append(f"check beside the end (exclusive {sched._gpu_leases[0].exclusive})")

        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        t1 = asyncio.ensure_future(sched.run(_job("profile"), "cuda", inner, ready, run_on(first, first_gone),
                                             lambda w: None))
        await asyncio.sleep(0.01)
        c1 = asyncio.ensure_future(sched.run(_job("verify"), "cuda", None, ready, run_on(check, done), lambda w: None))
        await first_loaded.wait()
        t2 = asyncio.ensure_future(sched.run(_job("profile"), "cuda", inner, ready, run_on(second, done),
                                             lambda w: None))
        await asyncio.wait_for(asyncio.gather(t1, c1), 5)
        await first_stopped.wait()
        await asyncio.wait_for(sched.run(_job("verify"), "cuda", None, ready, run_on(late_check, done),
                                         lambda w: None), 5)
        await asyncio.sleep(0.05)
        assert not second_started.is_set(), "the second timing job waits for the first's worker to be gone"
        events.append("first worker gone")
        first_gone.set_result(None)
        await asyncio.wait_for(t2, 5)
        first_hold = sched.holds[0]
        assert first_hold.turn_s is not None and first_hold.turn_s[1] is not None
        exclusive = [h for h in sched.holds if h.exclusive]
        assert [h.kind for h in exclusive] == ["profile"] * 3  # calibration, the first loop; the second's
        return events

    assert asyncio.run(main()) == ["first calibrates", "check beside the load (shared 2)", "first loop over",
                                   "check beside the end (exclusive False)", "first worker gone",
                                   "second calibrates"]
