"""The one bridge between sync and async code, in both directions.

cudagym's long-running operations are coroutines (`Evaluator.averify`, `KernelEnv.astep`,
`Policy.aact`, a TRL rollout) whose sync forms run them to completion; the sandbox keeps its
worker subprocesses on an event loop of its own, on a thread of its own, to which callers on any
loop, or on none, hand jobs. Both go through here:

- `run_sync(coro, loop)`: a sync form. Runs `coro` in the calling thread, on `loop` (a private
  loop its owner keeps across calls, so that what is bound to it, such as an HTTP client's
  connections, lives on) or on a fresh one (`asyncio.run`). Inside a running event loop it
  refuses (blocking that loop's thread would stall everything on it) with a RuntimeError that
  names the async form to await instead.
- `LoopThread`: an event loop running forever on a daemon thread; `call` runs a coroutine on it
  from sync code, `acall` from a coroutine on another loop (cancelling the awaiting task cancels
  the coroutine there).

It sits in `sandbox/`, the lowest floor that needs it; the floors above import it from here.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop | None = None, *,
             async_form: str = "the async form") -> T:
    """Run `coro` to completion from sync code, on `loop` or a fresh loop; RuntimeError (and
    `coro` closed, never started) when called inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        coro.close()
        raise RuntimeError(f"a sync form called inside a running event loop: use {async_form}")
    if loop is None:
        return asyncio.run(coro)
    return loop.run_until_complete(coro)


class LoopThread:
    """An event loop of its own, running forever on a daemon thread named `name`, so that sync
    callers and callers on any other loop can run coroutines on it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (from any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)

    async def acall(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and await its result from the caller's loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self, join_timeout_s: float = 5.0) -> None:
        """Stop the loop (after the callbacks already scheduled) and wait for its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=join_timeout_s)
