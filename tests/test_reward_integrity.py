"""Attacks on the evaluator's own machinery, attempted for real on the CPU target: nothing that
decides the reward is computed, recorded or kept in the candidate's process, secrets arrive only
when needed, and every output yields a verdict.

Each class: the attack earns less than the honest solution of its task (which gets >= 1 here),
and the verdict names the reason. The build-cache classes live in the toolchain tests.
"""

from __future__ import annotations

import textwrap

import pytest

from cudagym.rewards.evaluator import Evaluator
from cudagym.core.verdict import ErrorKind

from test_reward_hacking import GELU, GELU_KERNELS, assert_rejected, gelu_model

ONLY_WHEN_TIMED = """\
from torch.utils._python_dispatch import _len_torch_dispatch_stack
if _len_torch_dispatch_stack() == 0 and not getattr(self, "_armed", False):
    self._armed = True
{attack}
"""


def timed_only(attack: str, then: str) -> str:
    """A forward body that runs `attack` once, at its first call without the verify recorder
    (that is, once timed), then `then`."""
    return ONLY_WHEN_TIMED.format(attack=textwrap.indent(textwrap.dedent(attack), "    ")) + textwrap.dedent(then)


# Once timed: make the reference model (as the worker holds it) return zeros
REBIND_REFERENCE = """\
    import sys
    def _up_the_stack():  # the harness's objects, up the stack (the object graph's searches are refused)
        f = sys._getframe(1)
        while f is not None:
            yield from list(f.f_locals.values())
            f = f.f_back
    for o in _up_the_stack():
        if type(o).__name__ == "Problem":
            o.ref_mod.Model.forward = lambda self, *a: torch.zeros_like(a[0])
"""
# Once timed: report a tenth of each call's time, and make the harness's identity snapshot agree
# (only the parent's clock can see it, and it is enforced on a GPU only: tests/test_gpu.py)
FORGE_TIMES = """\
    import sys
    import cudagym.sandbox.timing as _t
    from cudagym.sandbox.worker.state import WorkerState
    def _up_the_stack():  # the harness's objects, up the stack (the object graph's searches are refused)
        f = sys._getframe(1)
        while f is not None:
            yield from list(f.f_locals.values())
            f = f.f_back
    _snap = next(o for o in _up_the_stack() if isinstance(o, WorkerState)).snapshot
    _call = _t.DeviceTimer.call
    def _fast(timer, fn, args, *rest, **kw):
        out, ms = _call(timer, fn, args, *rest, **kw)
        span, read, dense, strided = timer.last_raw  # what the parent computes the time from
        timer.last_raw = (span / 10, read, dense, strided)
        return out, ms / 10
    _t.DeviceTimer.call = _fast
    _snap.methods[(_t.DeviceTimer, "call")] = _fast
    _snap.method_code[(_t.DeviceTimer, "call")] = _fast.__code__
    _snap.class_attrs[_t.DeviceTimer]["call"] = _fast  # the harness classes' attributes, blinded too
"""


# -- class 1: outputs the evaluator cannot decode ------------------------------------------------
OUTPUTS = {
    "uint16": "return run_kernel(x, self.bias, self.scale).to(torch.uint16)",
    "uint64": "return run_kernel(x, self.bias, self.scale).to(torch.uint64)",
    "float8_e4m3fn": "return run_kernel(x, self.bias, self.scale).to(torch.float8_e4m3fn)",
    "complex64": "return run_kernel(x, self.bias, self.scale).to(torch.complex64)",
    "bool": "return run_kernel(x, self.bias, self.scale) > 0",
    "quantized": "return torch.quantize_per_tensor(run_kernel(x, self.bias, self.scale), 0.01, 0, torch.qint8)",
    "sparse": "return run_kernel(x, self.bias, self.scale).to_sparse()",
    "nested": "return torch.nested.nested_tensor([run_kernel(x, self.bias, self.scale)])",
    "meta": "return torch.empty(x.shape, device='meta')",
    "not a tensor": "return [run_kernel(x, self.bias, self.scale).tolist()]",
}


@pytest.mark.parametrize("what", list(OUTPUTS))
def test_1_every_output_yields_a_verdict(evaluator: Evaluator, build_ws, what: str) -> None:
    v = evaluator.evaluate(GELU, build_ws(GELU, gelu_model(OUTPUTS[what]), GELU_KERNELS))
    assert_rejected(v, {ErrorKind.OUTPUT_FORMAT, ErrorKind.AUDIT, ErrorKind.MISMATCH})
    assert v.error_kind != ErrorKind.INTERNAL


def test_1_an_exception_the_candidate_raises_anywhere_is_its_own(evaluator: Evaluator, build_ws) -> None:
    """A KeyError holding raw input bytes, raised only outside verify's trials (in a timed call):
    `exception` with the candidate's message, trimmed; never `internal`."""
    body = timed_only("raise KeyError(x.numpy().tobytes())", "return run_kernel(x, self.bias, self.scale)")
    v = evaluator.evaluate(GELU, build_ws(GELU, gelu_model(body), GELU_KERNELS))
    assert_rejected(v, ErrorKind.EXCEPTION, "KeyError")
    assert len(v.error or "") < 4000


# -- class 2: trusted computation inside the candidate's process --------------------------------
def test_2_rebind_the_reference_model_once_timed(evaluator: Evaluator, build_ws) -> None:
    """Once timed, make the reference model (as the worker holds it) return zeros, and return
    zeros: a re-check computed in the candidate's process would compare zeros with zeros."""
    attack = REBIND_REFERENCE
    body = timed_only(attack, """\
    if getattr(self, "_armed", False):
        return torch.zeros_like(x)
    return run_kernel(x, self.bias, self.scale)
    """)
    v = evaluator.evaluate(GELU, build_ws(GELU, gelu_model(body), GELU_KERNELS))
    assert any(r.startswith("correct on") for r in v.reasons), v.reasons  # verify saw an honest kernel
    assert_rejected(v, {ErrorKind.MISMATCH, ErrorKind.TAMPER}, "timed calls")


# -- class 3: secrets reachable from the candidate's process ------------------------------------
def test_3_no_trial_secret_is_reachable_while_modelnew_is_built(evaluator: Evaluator, build_ws) -> None:
    """In __init__, look for the trials' seeds up the stack; find none (the job
    carries no seeds), so ask the evaluator for trial 0 directly and precompute its outputs
    (no kernel at all), replayed in forward."""
    init_extra = """\
    import sys
    from cudagym.sandbox.worker.wire import Channel, Job
    def _up_the_stack():  # the harness's objects, up the stack (the object graph's searches are refused)
        f = sys._getframe(1)
        while f is not None:
            yield from list(f.f_locals.values())
            f = f.f_back
    seeds = [s for o in _up_the_stack() if isinstance(o, Job) for s in o.trial_seeds]
    f = sys._getframe()
    while f is not None:
        seeds += [v for v in f.f_locals.values() if isinstance(v, int) and v > 2**40]
        f = f.f_back
    self._found = len(seeds)
    ch = next(o for o in _up_the_stack() if isinstance(o, Channel))
    self._plan = ch.request("trial", index=0)
    """
    body = """\
    if self._found:
        raise RuntimeError(f"found {self._found} secret seeds in __init__")
    return torch.zeros_like(x)
    """
    v = evaluator.evaluate(GELU, build_ws(GELU, gelu_model(body, init_extra=init_extra), GELU_KERNELS))
    assert "secret seeds" not in (v.error or ""), v.error  # nothing to find
    assert_rejected(v, ErrorKind.TAMPER, "out of order")
