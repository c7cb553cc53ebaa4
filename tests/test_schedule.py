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
