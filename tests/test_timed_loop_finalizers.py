"""What the candidate's finalizers can see of the timed loop (CPU target, real workers and builds).

A finalizer of the candidate's runs on the harness's own thread, wherever the object it is tied to
dies. The timed loop lets everything of the last call's go before it makes the next call's inputs,
and nothing of the candidate's reach between their making and the interval: a finalizer then finds
no next inputs to work on before their call is timed (red team 16's c computed the next output with
torch's GELU from a finalizer of the last inputs, fired as the loop rebound them: +3 in strict mode).

The candidate here is a canary: an honest kernel, and finalizers tied to what the loop drops (the
output, the inputs it made, the hook it passed the timer, an object put in its list of targets).
Each looks up the loop's frame and fails the call if the next inputs are already there.
"""

from __future__ import annotations

import pytest

from cudagym.rewards.evaluator import Evaluator

from test_reward_hacking import GELU, GELU_KERNELS, gelu_model

pytestmark = pytest.mark.slow

CANARY = '''
import sys
import weakref

_armed = {"fresh": None, "hit": ""}


def _loop_locals():
    f = sys._getframe(1)
    while f is not None and f.f_code.co_name != "drive_calls":
        f = f.f_back
    return f


def _trip(where):
    f = _loop_locals()
    if f is None:
        return
    names = f.f_locals
    try:
        fresh = names.get("fresh")
    finally:
        names.clear()  # the frame's snapshot would keep the inputs alive
    if fresh is not None and id(fresh) != _armed["fresh"] and not _armed["hit"]:  # not the list it was set on
        _armed["hit"] = where


class _Tripwire:
    def __del__(self):
        _trip("an object put in the loop's targets")


def _arm(out, what):
    f = _loop_locals()
    if f is None:  # verify's trials
        return
    names = f.f_locals
    try:
        fresh, hook, targets = names.get("fresh"), names.get("hook"), names.get("targets")
    finally:
        names.clear()
    _armed["fresh"] = id(fresh)  # not the list itself: held here, it would not die
    if what == "inputs" and fresh:
        weakref.finalize(fresh[0], _trip, "the inputs the loop made")
    elif what == "hook" and hook is not None:
        weakref.finalize(hook, _trip, "the loop's hook")
    elif what == "targets" and targets is not None:
        targets.append(_Tripwire())
    elif what == "output":
        weakref.finalize(out, _trip, "the call's output")
'''


@pytest.mark.parametrize("what", ["output", "inputs", "hook", "targets"])
def test_a_finalizer_never_finds_the_next_calls_inputs(evaluator: Evaluator, build_ws, what: str) -> None:
    model = gelu_model(f"""
if _armed["hit"]:
    raise RuntimeError("a finalizer on " + _armed["hit"] + " found the next call's inputs made")
out = run_kernel(x, self.bias, self.scale)
_arm(out, {what!r})
return out
""", extra=CANARY)
    v = evaluator.evaluate(GELU, build_ws(GELU, model, GELU_KERNELS))
    assert v.reward >= 1, v.reasons
