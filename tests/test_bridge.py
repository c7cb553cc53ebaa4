"""The sync/async bridge (`cudagym.sandbox.bridge`): sync forms and the sandbox's loop thread."""

from __future__ import annotations

import asyncio
import threading
import warnings

import pytest

from cudagym.sandbox.bridge import LoopThread, run_sync


async def _loop_id() -> int:
    return id(asyncio.get_running_loop())


def test_run_sync_on_a_kept_loop_or_a_fresh_one():
    loop = asyncio.new_event_loop()
    try:
        assert run_sync(_loop_id(), loop) == run_sync(_loop_id(), loop) == id(loop)
    finally:
        loop.close()
    assert run_sync(_loop_id()) != id(loop)


def test_a_sync_form_inside_a_running_loop_names_the_async_form_and_starts_nothing():
    started = []

    async def work() -> None:
        started.append(1)

    async def caller() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "coroutine ... was never awaited" would be one
            with pytest.raises(RuntimeError, match="await thing.awork"):
                run_sync(work(), async_form="await thing.awork()")

    asyncio.run(caller())
    assert started == []


def test_loop_thread_serves_sync_callers_and_other_loops():
    lt = LoopThread("test-bridge")
    try:
        async def where() -> str:
            return threading.current_thread().name

        assert lt.call(where()) == "test-bridge"
        assert asyncio.run(lt.acall(where())) == "test-bridge"

        cancelled = threading.Event()

        async def forever() -> None:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        async def give_up() -> None:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(lt.acall(forever()), timeout=0.2)

        asyncio.run(give_up())
        assert cancelled.wait(5)  # cancelling the awaiting task cancelled the coroutine on the thread
    finally:
        lt.stop()
    assert not lt._thread.is_alive()
