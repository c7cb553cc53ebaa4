"""Hooks that run the candidate's code at the harness's own steps after a timed call (CPU target).

Before: on the CPU target a call's clock stopped after its pages were read, and the harness then
drew the sample positions (`torch.randint`) and gathered the values with ATen ops in the
candidate's process. A Python profile hook or a RecordFunction callback of the candidate's ran
there: it did the call's work after the clock stopped (+3 with nothing computed inside the
call), or computed only the sampled positions once it saw them. Now the close is one native call
of the harness's own library, inside the interval (`DeviceTimer.call`, `cudagym_cpu_close` in
opwatch.cpp): positions are drawn with getrandom() inside it and read there, so an observer of
every ATen op never sees them before the values are taken, and whatever a hook runs before the
close is timed. Belt and braces: profile, trace, monitoring and audit hooks are refused in a
worker, one found after a call is TAMPER, and so is a RecordFunction callback registered after the
candidate's code loaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cudagym.rewards.evaluator import Evaluator
from cudagym.core.verdict import ErrorKind
from cudagym.sandbox import timing
from cudagym.sandbox.opwatch import OpWatch
from cudagym.rewards.compare import projection_mismatch
from cudagym.sandbox.timing import PROJECTIONS, DeviceTimer, TimerTamperedError, projection
from cudagym.tasks.model import Tolerance

from conftest import make_workspace
from test_reward_hacking import GELU, GELU_KERNELS, INIT, assert_rejected, gelu_model

REPO = Path(__file__).resolve().parents[1]
TOL = Tolerance(atol=1e-4, rtol=1e-3)


@pytest.fixture(scope="module")
def native_close(eval_cache: Path):
    """The harness's native CPU close, as a worker binds it (`OpWatch.cpu_close`)."""
    return OpWatch.load(eval_cache).cpu_close


def _gelu(x: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.nn.functional.gelu(x * scale + bias)


# -- the mechanism, in this process ---------------------------------------------------------------


def test_the_cpu_close_is_one_native_call_inside_the_interval(native_close) -> None:
    """`after` (which registers outputs) and the native close run between the two clock reads; no
    `torch.randint` and no Python runs between the positions' draw and the values' read."""
    order: list[str] = []

    def close(*a):  # the native close, its call noted
        order.append("close")
        return native_close(*a)

    timer = DeviceTimer(torch.device("cpu"), flush_l2=False, native_close=close)
    timer._perf = lambda: order.append("clock") or 0.0  # type: ignore[method-assign]
    x = torch.randn(64, 100)
    evs: list[timing.Evidence] = []
    real_randint = torch.randint
    torch.randint = None  # type: ignore[assignment]  # the CPU path must not draw with torch
    try:
        out, _ = timer.call(lambda a: (a * 2, (a + 1).t(), a[:4, :4].clone()), [x],
                            after=lambda o: (order.append("after"), evs.extend(timer.read_at_end(t) for t in o)))
    finally:
        torch.randint = real_randint
    assert order == ["clock", "after", "close", "clock"]
    dense, strided, small = evs
    assert dense.positions is not None and strided.positions is not None and small.positions is None
    assert torch.equal(dense.values, out[0].reshape(-1)[dense.positions])
    assert torch.equal(strided.values, out[1].reshape(-1)[strided.positions])  # row-major positions of a transpose
    assert torch.equal(small.values, out[2])  # all of it, in its shape
    assert 0 <= int(dense.positions.min()) and int(dense.positions.max()) < x.numel()
    assert len(set(dense.positions.tolist())) > 1600  # 2048 draws from 6400: ~1754 distinct
    assert bytes(dense.raw[0]) == dense.values.numpy().tobytes()  # what the harness sends, as raw bytes


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int8, torch.bool, torch.complex64])
def test_the_native_close_reads_any_element_size(native_close, dtype) -> None:
    timer = DeviceTimer(torch.device("cpu"), flush_l2=False, native_close=native_close)
    x = (torch.randn(80, 70) * 5).to(dtype)
    evs: list[timing.Evidence] = []
    out, _ = timer.call(lambda a: (a, a.t(), a[::3, 1::2], a.expand(3, 80, 70)), [x],
                        after=lambda o: evs.extend(timer.read_at_end(t) for t in o))
    for o, ev in zip(out, evs):
        assert torch.equal(ev.values, o if ev.positions is None else o.reshape(-1)[ev.positions])
    assert evs[2].positions is None and evs[3].positions is not None  # 27 x 35: all of it; an expanded view: sampled


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
                                   torch.uint8, torch.bool, torch.complex64])
def test_the_native_close_projects_every_element_as_the_host_does(native_close, dtype) -> None:
    """The native close's projections (every element, weights from the seed it drew) equal the
    host's `projection` of the same output, for each layout: the parent checks them against the
    reference's as it checks the GPU close kernel's."""
    timer = DeviceTimer(torch.device("cpu"), flush_l2=False, native_close=native_close)
    x = (torch.randn(300, 170) * 7).to(dtype) if dtype is not torch.complex64 else torch.randn(300, 170, dtype=dtype)
    evs: list[timing.Evidence] = []
    out, _ = timer.call(lambda a: (a, a.t(), a[::3, 1::2], a[:5, :5]), [x],
                        after=lambda o: evs.extend(timer.read_at_end(t) for t in o))
    seeds = {ev.cpu_seed() for ev in evs}
    assert len(seeds) == 1 and 0 not in seeds  # one secret seed per call, drawn by the close
    for j, (o, ev) in enumerate(zip(out, evs)):
        assert ev.projections is not None
        assert torch.allclose(ev.projections, projection(o, ev.cpu_seed(), j)[:PROJECTIONS], rtol=1e-12, atol=1e-9)


def test_samples_rewritten_after_the_close_leave_the_projections_of_what_was_there(native_close) -> None:
    """A4 of red team 3: the call returns zeros and something of the candidate's (a native thread,
    a fault handler) writes the right values at the drawn positions after the close read them:
    the samples then match, but the projections the close made of the whole output do not."""
    timer = DeviceTimer(torch.device("cpu"), flush_l2=False, native_close=native_close)
    x, bias = torch.randn(512, 256), torch.randn(256)
    want = _gelu(x, bias, 0.5)
    evs: list[timing.Evidence] = []
    out, _ = timer.call(lambda a: torch.zeros_like(a), [x], after=lambda o: evs.append(timer.read_at_end(o)))
    ev = evs[0]
    assert ev.positions is not None and ev.projections is not None
    ev.values.copy_(want.reshape(-1)[ev.positions])  # the forged samples: exactly the reference's
    assert torch.equal(ev.values, want.reshape(-1)[ev.positions])
    why = projection_mismatch(ev.projections, projection(want, ev.cpu_seed(), 0), want.numel(), TOL, False)
    assert why is not None and "not computed in full" in why
    honest: list[timing.Evidence] = []
    timer.call(lambda a: _gelu(a, bias, 0.5), [x], after=lambda o: honest.append(timer.read_at_end(o)))
    h = honest[0]
    assert projection_mismatch(h.projections, projection(want, h.cpu_seed(), 0), want.numel(), TOL, False) is None


def test_the_cpu_evidence_leaves_inside_the_interval(native_close) -> None:
    """The evidence is sent after the close and before the clock stops: whatever rewrites it
    before it leaves runs inside the call's interval, and is timed."""
    order: list[str] = []
    timer = DeviceTimer(torch.device("cpu"), flush_l2=False, native_close=native_close)
    timer._perf = lambda: order.append("clock") or 0.0  # type: ignore[method-assign]
    timer.call(lambda a: a + 1, [torch.zeros(5000)], after=lambda o: (order.append("after"), timer.read_at_end(o)),
               send=lambda: order.append("send"))
    assert order == ["clock", "after", "send", "clock"]


class _ComputeAtRandint(TorchDispatchMode):
    """A global observer of every ATen op after the call (a stand-in for a RecordFunction callback
    with outputs): where it sees `aten::randint`'s output, it computes the output only there."""

    def __init__(self, x, bias, scale, out):
        super().__init__()
        self.args, self.out, self.seen = (x, bias, scale), out, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.seen.append(str(func.overloadpacket))
        if func.overloadpacket is torch.ops.aten.randint and result.numel() == 2048:
            x, bias, scale = self.args
            pos = result.clone()
            flat = self.out.view(-1)
            flat[pos] = _gelu(x.reshape(-1)[pos], bias[pos % bias.numel()], scale)
        return result


def test_an_observer_of_the_harness_ops_never_sees_the_positions_before_the_values_are_read(native_close) -> None:
    """The call computes nothing and leaves an op observer behind that computes the sampled
    elements when the positions show up: with the native close they never do, so the samples are
    the uncomputed values (the parent's re-check: MISMATCH)."""
    timer = DeviceTimer(torch.device("cpu"), flush_l2=False, native_close=native_close)
    x, bias, scale = torch.randn(128, 256), torch.randn(256), 0.7
    out = torch.zeros(128, 256)
    mode = _ComputeAtRandint(x, bias, scale, out)
    evs: list[timing.Evidence] = []

    def lazy(a):
        mode.__enter__()  # left on the dispatch stack: it sees every op the harness runs next
        return out

    try:
        timer.call(lazy, [x], after=lambda o: evs.append(timer.read_at_end(o)))
        mode.__exit__(None, None, None)
    finally:
        while torch._C._len_torch_dispatch_stack():
            torch._C._pop_torch_dispatch_stack()
    assert mode.seen and "aten.randint" not in mode.seen  # it saw the harness's allocations, no draw
    ev = evs[0]
    assert torch.count_nonzero(ev.values) == 0  # read before anyone computed them
    honest = _gelu(x, bias, scale).reshape(-1)[ev.positions]
    assert not torch.allclose(ev.values, honest, atol=1e-4, rtol=1e-3)


class _ComputeAtFirstOp(TorchDispatchMode):
    """A global observer that does the whole call's work at the first ATen op after the call."""

    def __init__(self, work):
        super().__init__()
        self.work = work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.work is not None:
            work, self.work = self.work, None
            work()
        return func(*args, **(kwargs or {}))


def test_work_an_observer_defers_to_the_harness_ops_after_the_call_is_timed(native_close) -> None:
    """The whole output computed at the harness's first ATen op after the call: that op is the
    evidence buffers' allocation, before the native close and inside the interval."""
    order: list[str] = []

    def close(*a):
        order.append("close")
        return native_close(*a)

    timer = DeviceTimer(torch.device("cpu"), flush_l2=False, native_close=close)
    timer._perf = lambda: order.append("clock") or 0.0  # type: ignore[method-assign]
    x, bias = torch.randn(64, 32), torch.randn(32)
    out = torch.zeros(64, 32)
    mode = _ComputeAtFirstOp(lambda: (order.append("work"), out.copy_(_gelu(x, bias, 0.5))))
    evs: list[timing.Evidence] = []

    def lazy(a):
        mode.__enter__()
        return out

    try:
        timer.call(lazy, [x], after=lambda o: evs.append(timer.read_at_end(o)))
        mode.__exit__(None, None, None)
    finally:
        while torch._C._len_torch_dispatch_stack():
            torch._C._pop_torch_dispatch_stack()
    assert order == ["clock", "work", "close", "clock"]
    assert torch.equal(evs[0].values, out)  # 2048 elements: all of them, computed inside the interval


def test_a_profile_hook_set_by_the_call_runs_inside_the_interval_and_is_tamper(native_close) -> None:
    """A profile hook the call sets runs its deferred work at the first Python event after the call:
    inside the interval (before the clock's second read), and the timer reports it."""
    timer = DeviceTimer(torch.device("cpu"), flush_l2=False, native_close=native_close)
    order: list[str] = []
    clock = iter(range(1000))
    timer._perf = lambda: order.append("clock") or float(next(clock))  # type: ignore[method-assign]
    x = torch.randn(16, 16)
    out = torch.zeros(16, 16)

    def hook(frame, event, arg):
        if "work" not in order:
            order.append("work")
            out.copy_(x * 2)

    def lazy(a):
        sys.setprofile(hook)
        return out

    try:
        with pytest.raises(TimerTamperedError, match="sys.setprofile"):
            timer.call(lazy, [x], after=lambda o: timer.read_at_end(o))
    finally:
        sys.setprofile(None)
    assert order.index("work") < order.index("clock", 1)  # the deferred work was timed


# -- in a worker, end to end -----------------------------------------------------------------------

# Verify: honest. Timed: nothing computed; a profile hook (refused in a worker; the refusal caught)
# would compute the output at the harness's next Python call.
SETPROFILE_EXTRA = """\
import sys

_pending = []


def _deferred(frame, event, arg):
    if _pending:
        x, bias, scale, out = _pending.pop()
        out.copy_(run_kernel(x, bias, scale))
"""

SETPROFILE_FORWARD = """\
from torch.utils._python_dispatch import _len_torch_dispatch_stack
if _len_torch_dispatch_stack() != 0:
    return run_kernel(x, self.bias, self.scale)  # verify: honest
out = self.__dict__.setdefault("_out", torch.empty_like(x))
_pending.append((x, self.bias, self.scale, out))
try:
    sys.setprofile(_deferred)
except RuntimeError:
    pass  # refused: carry on, the output uncomputed
return out
"""


def test_a_profile_hook_doing_the_work_after_the_call_gets_no_speed_milestone(evaluator: Evaluator, build_ws) -> None:
    v = evaluator.evaluate(GELU, build_ws(GELU, gelu_model(SETPROFILE_FORWARD, extra=SETPROFILE_EXTRA), GELU_KERNELS))
    assert_rejected(v, ErrorKind.TAMPER, "sys.setprofile")


# A C++ binding that registers a global RecordFunction callback at import: it watches the outputs of
# the ops the harness runs after a timed call, and where it finds an int64 tensor of 2048 positions
# (the old CPU close's `torch.randint`), computes the pending output only at those positions.
SAMPLED_BINDING = r"""
#include <torch/extension.h>
#include <ATen/record_function.h>
#include <cmath>

namespace {
const float* g_x = nullptr; const float* g_bias = nullptr; float* g_out = nullptr;
int64_t g_cols = 0, g_numel = 0; float g_scale = 0.f; bool g_pending = false;

void at_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (!g_pending) return;
  for (const c10::IValue& v : fn.outputs()) {
    if (!v.isTensor()) continue;
    const at::Tensor& t = v.toTensor();
    if (t.defined() && t.device().is_cpu() && t.scalar_type() == at::kLong && t.numel() == 2048 && t.is_contiguous()) {
      const int64_t* pos = t.data_ptr<int64_t>();
      for (int64_t i = 0; i < 2048; ++i) {
        int64_t p = pos[i];
        if (p < 0 || p >= g_numel) return;
        float v2 = g_x[p] * g_scale + g_bias[p % g_cols];
        g_out[p] = 0.5f * v2 * (1.0f + std::erf(v2 * 0.70710678118654752f));
      }
      g_pending = false;
      return;
    }
  }
}

std::unique_ptr<at::ObserverContext> at_start(const at::RecordFunction&) { return nullptr; }

struct Install {
  Install() {
    at::addGlobalCallback(at::RecordFunctionCallback(at_start, at_end).needsInputs(false).needsOutputs(true));
  }
};
}  // namespace

at::Tensor honest(at::Tensor x, at::Tensor bias, double scale) {
  at::Tensor out = at::empty_like(x);
  const float* px = x.data_ptr<float>(); const float* pb = bias.data_ptr<float>(); float* po = out.data_ptr<float>();
  const int64_t cols = x.size(-1);
  for (int64_t i = 0; i < x.numel(); ++i) {
    float v = px[i] * (float)scale + pb[i % cols];
    po[i] = 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
  }
  return out;
}

at::Tensor lazy(at::Tensor x, at::Tensor bias, double scale, at::Tensor out) {
  g_x = x.data_ptr<float>(); g_bias = bias.data_ptr<float>(); g_out = out.data_ptr<float>();
  g_cols = x.size(-1); g_numel = x.numel(); g_scale = (float)scale; g_pending = true;
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  static Install install;
  m.def("lazy", &lazy);
  m.def("honest", &honest);
}
"""

SAMPLED_MODEL = """\
import torch
import torch.nn as nn
from torch.utils._python_dispatch import _len_torch_dispatch_stack

import kernel_ext


""" + INIT + """

    def forward(self, x):
        x, bias = x.contiguous(), self.bias.detach()
        if _len_torch_dispatch_stack() != 0:
            return kernel_ext.honest(x, bias, float(self.scale))  # verify: honest
        out = self.__dict__.setdefault("_out", torch.zeros_like(x))
        return kernel_ext.lazy(x, bias, float(self.scale), out)
"""


def test_a_recordfunction_callback_computing_only_the_sampled_positions_is_rejected(evaluator: Evaluator,
                                                                                      build_ws) -> None:
    v = evaluator.evaluate(GELU, build_ws(GELU, SAMPLED_MODEL, {"kernels/sampled_binding.cpp": SAMPLED_BINDING}))
    assert_rejected(v, {ErrorKind.TAMPER, ErrorKind.MISMATCH})
    assert v.error_kind is ErrorKind.MISMATCH or "recordfunction callback" in (v.error or "").lower(), v.error


def test_the_honest_cpu_solution_is_still_correct_and_timed(evaluator: Evaluator, tmp_path: Path) -> None:
    src = REPO / "examples" / "solutions" / "ew_scale_bias_gelu" / "cpu"
    files = {str(p.relative_to(src)): p.read_text() for p in src.rglob("*") if p.is_file()}
    ws = make_workspace(tmp_path / "ws", GELU, files.pop("model_new.py"), files)
    v = evaluator.evaluate(GELU, ws)
    assert v.correct and v.reward >= 1, (v.reward, v.reasons, v.error)
    assert v.candidate_ms is not None and v.candidate_ms > 0


def test_cpu_inputs_take_their_values_only_after_the_flush() -> None:
    """A thread of the candidate's that watches the input buffers must find, while the CPU cache
    flush runs (untimed, milliseconds), the previous call's values there, never this call's: the
    refill comes after the flush, right before the interval opens (as the open gate copies them
    at the window's end on a GPU). A red-team thread computed the answer during the flush: +3."""
    import torch

    from cudagym.sandbox.timing import DeviceTimer, drive_calls

    timer = DeviceTimer(torch.device("cpu"), flush_l2=False)
    buf = [torch.zeros(1000)]
    seen_at_flush: list[float] = []
    seen_in_call: list[float] = []
    timer.flush = lambda: seen_at_flush.append(float(buf[0][0]))  # type: ignore[method-assign]
    seeds = iter([1.0, 2.0, 3.0])

    def next_call(report: tuple) -> tuple[int, bool, float] | None:
        seed = next(seeds, None)
        return None if seed is None else (int(seed), False, 0.0)

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen_in_call.append(float(x[0]))
        return x + 1

    made = drive_calls(fn, [buf], lambda seed: [torch.full((1000,), float(seed))], next_call, timer)
    assert made == 3
    assert seen_in_call == [1.0, 2.0, 3.0]  # each call sees its own values
    assert seen_at_flush == [0.0, 1.0, 2.0]  # the flush, the previous call's
