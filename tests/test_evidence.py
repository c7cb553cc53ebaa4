"""The evidence of timed calls, attacked for real: it leaves the candidate's reach before the
candidate's code runs again, cannot be forged without computing the whole output (GPU: the close
kernel's projections), and an output is complete when its call's interval ends (CPU: its pages
are read inside the interval; GPU: the close kernel projects every element). Hooks that run the
candidate's code at the harness's steps after a call: `test_evidence_hooks.py`.

CPU-target classes run in CI; `@pytest.mark.gpu` ones on a GPU. Each attack earns no positive
reward, or (the lazily filled output) is timed with the work it deferred.
"""

from __future__ import annotations

import pytest
import torch

from cudagym.rewards.compare import projection_mismatch
from cudagym.rewards.evaluator import Evaluator
from cudagym.core.verdict import ErrorKind
from cudagym.sandbox.protocol import TimingConfig
from cudagym.sandbox.timing import PROJECTIONS, DeviceTimer, projection, reference_projection, touch_pages
from cudagym.tasks.model import Tolerance

from conftest import task_of
from test_reward_hacking import GELU, GELU_KERNELS, assert_rejected, gelu_model

TOL = Tolerance(atol=1e-4, rtol=1e-3)

# -- the bound, on the host ----------------------------------------------------------------------


def test_an_honest_output_passes_its_projections_and_an_uncomputed_one_fails() -> None:
    """Honest errors up to the tolerance (signs at random, or all at the tolerance in one
    direction) pass; an output computed only at 2048 positions, or missing 1% of its elements, or
    with one integer off by one, or a NaN the reference lacks, fails."""
    g = torch.Generator().manual_seed(0)
    r = torch.randn(700, 300, generator=g)
    seed, n = 0xDEADBEEFCAFEBABE, r.numel()
    ref = projection(r, seed, 0)
    bound = TOL.atol + TOL.rtol * r.abs()

    def check(c: torch.Tensor, exact: bool = False) -> str | None:
        return projection_mismatch(projection(c, seed, 0)[:PROJECTIONS], ref, n, TOL, exact)

    assert check(r + (torch.rand(r.shape, generator=g) * 2 - 1) * bound) is None
    assert check(r + 0.999 * bound) is None
    sampled = torch.zeros(n)
    at = torch.randint(n, (2048,), generator=g)
    sampled[at] = r.reshape(-1)[at]
    assert "not computed in full" in (check(sampled.view_as(r)) or "")
    partial = r.clone().reshape(-1)
    partial[: n // 100] = 0
    assert "not computed in full" in (check(partial.view_as(r)) or "")
    nan = r.clone()
    nan[3, 4] = float("nan")
    assert "not finite" in (check(nan) or "")
    assert projection_mismatch(projection(nan, seed, 0)[:PROJECTIONS], projection(nan, seed, 0), n, TOL, False) is None
    ints = torch.randint(-9, 9, (5000,), generator=g)
    off = ints.clone()
    off[17] += 1
    assert projection_mismatch(projection(ints, 5, 1)[:PROJECTIONS], projection(ints, 5, 1), 5000, TOL, True) is None
    assert projection_mismatch(projection(off, 5, 1)[:PROJECTIONS], projection(ints, 5, 1), 5000, TOL, True)


@pytest.fixture(scope="module")
def native_project(tmp_path_factory: pytest.TempPathFactory):
    from cudagym.sandbox.opwatch import OpWatch

    return OpWatch.load(tmp_path_factory.mktemp("opwatch")).cpu_project


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
                                   torch.bool, torch.complex64])
def test_the_reference_workers_native_projection_is_the_close_s(dtype: torch.dtype, native_project) -> None:
    """The reference-only worker projects each re-checked call's output in the harness's C
    (`OpWatch.cpu_project`, threads over parts of it): the same 7 sums as `projection`, NaN and
    infinities counted apart, for every kind the close projects; other weights, other sums."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3001, 1777, generator=g) * 4
    x = torch.complex(x, -2 * x) if dtype.is_complex else x.to(dtype)
    seed = 0x0123456789ABCDEF
    want = projection(x, seed, 2)
    assert torch.allclose(reference_projection(x, seed, 2, native_project), want, rtol=1e-9, atol=1e-4)
    assert not torch.allclose(reference_projection(x, seed + 1, 2, native_project)[:PROJECTIONS], want[:PROJECTIONS])
    if dtype.is_floating_point:
        x.view(-1)[[7, 100_000]] = torch.tensor([float("nan"), float("inf")]).to(dtype)
        got, want = reference_projection(x, seed, 2, native_project), projection(x, seed, 2)
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-4, equal_nan=True) and got[-1] == 2, (got, want)


def test_the_weights_depend_on_the_seed_and_the_output_and_complex_parts_count_twice() -> None:
    x = torch.randn(4096)
    assert not torch.equal(projection(x, 1, 0), projection(x, 2, 0))
    assert not torch.equal(projection(x, 1, 0), projection(x, 1, 1))
    c = torch.randn(2048, dtype=torch.complex64)
    assert torch.equal(projection(c, 7, 0), projection(torch.view_as_real(c), 7, 0))


def test_the_read_phase_left_out_grows_with_what_the_close_projects_and_no_more() -> None:
    """The close's projections take time per element: a call's read phase is left out up to the
    calibration's, plus the calibrated time per element beyond the calibration's output (+10%)."""
    from cudagym.sandbox.timing import CALIBRATION_ELEMENTS, READ_SLACK_NS, READ_SLACK_REL, Calibration

    cal = Calibration.measured(4_000, 10_000, 2.0, 20.0)
    extra = 10**6
    dense_cap = 10_000 + READ_SLACK_NS + int(2.0 * (1 + READ_SLACK_REL) * extra / 1000)
    assert cal.left_out_ns(10**9, CALIBRATION_ELEMENTS + extra) == 4_000 + dense_cap
    assert cal.left_out_ns(10**9, CALIBRATION_ELEMENTS) == 4_000 + 10_000 + READ_SLACK_NS
    assert cal.left_out_ns(10**9, 0, extra) == (4_000 + 10_000 + READ_SLACK_NS
                                                + int(20.0 * (1 + READ_SLACK_REL) * extra / 1000))
    assert cal.left_out_ns(7_000, CALIBRATION_ELEMENTS + extra) == 4_000 + 7_000  # as measured, below the cap


def test_the_cpu_close_reads_every_page_of_the_output_inside_the_interval() -> None:
    """The close runs between the call's return and the end of its interval, after `after` has
    registered the outputs: a fault handler or a lazy mapping is served there. A worker's timer
    closes with the harness's native `cudagym_cpu_close` (`tests/test_evidence_hooks.py`); a timer
    without it (tools, tests) with `touch_pages` and torch's draw, in the same place."""
    timer = DeviceTimer(torch.device("cpu"), flush_l2=False)
    order: list[str] = []
    timer._perf = lambda: order.append("clock") or 0.0  # type: ignore[method-assign]
    real = touch_pages
    import cudagym.sandbox.timing.timer as timer_module

    def counted(out: object) -> None:
        order.append("touch")
        real(out)

    timer_module.touch_pages = counted
    try:
        timer.call(lambda a: a + 1, [torch.zeros(5000)], after=lambda o: (order.append("after"), timer.read_at_end(o)))
    finally:
        timer_module.touch_pages = real
    assert order == ["clock", "after", "touch", "clock"]


# -- attacks on the CPU target -------------------------------------------------------------------

# Once timed, ModelNew computes nothing: at each call it rewrites the harness's evidence of the
# previous call in the worker's result memory (the memfd the harness writes tensor bytes into,
# mapped again here), with the right values at the sampled positions, from a host copy of that
# call's input (numpy: no torch compute op for the audit to see). The same on both targets.
REWRITE_RESULTS = """\
import math, mmap, os
import numpy as np

_SAMPLES = 2048
_erf = np.frompyfunc(math.erf, 1, 1)


def _results():
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "cudagym-results" in os.readlink(f"/proc/self/fd/{fd}"):
                return mmap.mmap(int(fd), 1 << 30, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            continue
    return None


def _rewrite(st, scale):
    mm, at, n = st["mm"], st["cursor"], st["x"].size
    end = min(len(mm), at + (1 << 28)) - _SAMPLES * 8
    while at <= end:
        head = np.frombuffer(mm, dtype=np.int64, count=8, offset=at)
        if head.any() and ((head >= 0) & (head < n)).all():
            pos = np.frombuffer(mm, dtype=np.int64, count=_SAMPLES, offset=at).copy()
            if ((pos >= 0) & (pos < n)).all() and len(np.unique(pos)) > _SAMPLES // 2:
                v = st["x"][pos].astype(np.float64) * scale + st["bias"][pos % st["bias"].size]
                right = 0.5 * v * (1.0 + _erf(v / math.sqrt(2.0)).astype(np.float64))
                np.frombuffer(mm, dtype=np.float32, count=_SAMPLES, offset=at - _SAMPLES * 4)[:] = right
                st["rewritten"] += 1
                at += _SAMPLES * 8
                st["cursor"] = at
                continue
        at += mmap.ALLOCATIONGRANULARITY


def _host(t):
    h = torch.empty(t.shape, dtype=t.dtype)
    h.copy_(t)
    return h.numpy().reshape(-1)
"""

REWRITE_FORWARD = """\
from torch.utils._python_dispatch import _len_torch_dispatch_stack
if _len_torch_dispatch_stack() != 0:
    return run_kernel(x, self.bias, self.scale)  # verify: honest
st = self.__dict__.get("_state")
if st is None:
    st = self.__dict__["_state"] = {"mm": _results(), "cursor": 0, "rewritten": 0, "x": None,
                                    "bias": _host(self.bias.detach())}
if st["mm"] is not None and st["x"] is not None:
    _rewrite(st, self.scale)
st["x"] = _host(x)
return torch.empty_like(x)  # never computed
"""


def test_rewriting_the_result_memory_at_the_next_call_is_caught(evaluator: Evaluator, build_ws) -> None:
    """The samples of a timed call go on the pipe before the next call is asked for, so what
    the candidate finds in its result memory is no longer evidence of anything."""
    v = evaluator.evaluate(GELU, build_ws(GELU, gelu_model(REWRITE_FORWARD, extra=REWRITE_RESULTS), GELU_KERNELS))
    assert_rejected(v, ErrorKind.MISMATCH, "timed calls")


# The output's pages are inaccessible when the call returns; a SIGSEGV handler computes the whole
# output at the first read of any of them (and spends 40 ms more, so that where its work was timed shows).
LAZY_CPP = """\
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <sys/mman.h>

static float* g_out = nullptr;
static const float* g_x = nullptr;
static const float* g_bias = nullptr;
static int64_t g_rows = 0, g_cols = 0;
static float g_scale = 0.f;
static size_t g_bytes = 0;
static int g_filled = 0;

static void fill(int sig, siginfo_t* info, void*) {
    char* a = (char*)info->si_addr;
    if (!g_out || a < (char*)g_out || a >= (char*)g_out + g_bytes) { signal(sig, SIG_DFL); raise(sig); return; }
    mprotect(g_out, g_bytes, PROT_READ | PROT_WRITE);
    for (int64_t r = 0; r < g_rows; ++r)
        for (int64_t c = 0; c < g_cols; ++c) {
            float v = g_x[r * g_cols + c] * g_scale + g_bias[c];
            g_out[r * g_cols + c] = 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
        }
    struct timespec ts = {0, 40 * 1000 * 1000};
    nanosleep(&ts, nullptr);
    g_filled += 1;
}

extern "C" void* lazy_gelu(const float* x, const float* bias, int64_t rows, int64_t cols, float scale) {
    static bool installed = false;
    if (!installed) {
        struct sigaction sa;
        std::memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = fill;
        sa.sa_flags = SA_SIGINFO | SA_NODEFER;
        sigaction(SIGSEGV, &sa, nullptr);
        installed = true;
    }
    size_t bytes = (size_t)rows * cols * sizeof(float);
    if (g_out == nullptr || g_bytes != bytes) {
        g_out = (float*)mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        g_bytes = bytes;
    }
    mprotect(g_out, g_bytes, PROT_NONE);
    g_x = x; g_bias = bias; g_rows = rows; g_cols = cols; g_scale = scale;
    return g_out;
}

extern "C" int lazy_filled() { return g_filled; }
"""

LAZY_EXTRA = """\
_lib.lazy_gelu.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_float]
_lib.lazy_gelu.restype = ctypes.c_void_p
"""

LAZY_FORWARD = """\
from torch.utils._python_dispatch import _len_torch_dispatch_stack
if _len_torch_dispatch_stack() != 0:
    return run_kernel(x, self.bias, self.scale)  # verify: honest
x = x.contiguous()
addr = _lib.lazy_gelu(ptr(x), ptr(self.bias), x.size(0), x.size(1), self.scale)
buf = (ctypes.c_float * x.numel()).from_address(addr)
return torch.frombuffer(buf, dtype=torch.float32).view(x.shape)
"""


def test_an_output_filled_by_a_fault_handler_is_timed_with_its_work(evaluator: Evaluator, build_ws) -> None:
    """The close reads every page of the output inside the interval: the handler's work (and its
    40 ms) is in each call's time, so the deferred work buys no speed (before: +3, 'no work
    inside the timed call')."""
    kernels = {**GELU_KERNELS, "kernels/lazy.cpp": LAZY_CPP}
    v = evaluator.evaluate(GELU, build_ws(GELU, gelu_model(LAZY_FORWARD, extra=LAZY_EXTRA), kernels))
    if v.correct and v.profile_result is not None and v.profile_result.ok:
        assert v.candidate_ms is not None and v.candidate_ms >= 40.0, (v.candidate_ms, v.reasons)
        assert v.reward <= 1, (v.reward, v.reasons)  # correct, and no faster than eager
    else:
        assert v.reward < 0 and v.error_kind in (ErrorKind.MISMATCH, ErrorKind.OUTPUT_FORMAT, ErrorKind.AUDIT,
                                                 ErrorKind.TAMPER), (v.error_kind, v.reasons)


# -- on the GPU ---------------------------------------------------------------------------------

GPU_MODEL = """\
import ctypes
import torch
import torch.nn as nn
from cudagym.runtime import kernel_library, ptr, stream

_lib = kernel_library()
_lib.scale_bias_gelu.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_void_p]
_lib.scale_bias_gelu.restype = ctypes.c_int


def run_kernel(x, bias, scale):
    x = x.contiguous()
    out = torch.empty_like(x)
    _lib.scale_bias_gelu(ptr(x), ptr(bias), ptr(out), x.numel() // x.size(-1), x.size(-1), scale, stream())
    return out
{extra}

class ModelNew(nn.Module):
    def __init__(self, features, scale):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.empty(features))

    def forward(self, x):
{body}
"""

# Installed at import: the harness's Channel.send_tensor replaced (and its identity snapshot made
# to agree), so that each timed call's sample goes out with the right values at the sampled
# positions, computed here from a copy of the call's input, outside the call and its op counter;
# the output itself is never computed.
FORGE_SAMPLES = """\
import math
import sys
import cudagym.sandbox.worker.wire as _h
from cudagym.sandbox.worker.state import WorkerState

def _up_the_stack():  # the harness's objects, up the stack from the import (the object graph's searches are refused)
    f = sys._getframe(1)
    while f is not None:
        yield from list(f.f_locals.values())
        f = f.f_back


_snap = next(o for o in _up_the_stack() if isinstance(o, WorkerState)).snapshot
_send = _h.Channel.send_tensor
_held = {}
_model = []


def _forged(ch, role, trial, index, t, *a, **kw):
    m = _model[0] if _model else None
    if role == "sample" and m is not None and m.__dict__.get("_x") is not None:
        _held[(trial, index)] = (a, kw)
        return None
    if role == "positions" and (trial, index) in _held:
        v = m._x.reshape(-1)[t] * m.scale + m.bias.detach()[t % m.bias.numel()]
        a2, kw2 = _held.pop((trial, index))
        _send(ch, "sample", trial, index, 0.5 * v * (1 + torch.erf(v / math.sqrt(2.0))), *a2, **kw2)
    return _send(ch, role, trial, index, t, *a, **kw)


_h.Channel.send_tensor = _forged
_snap.methods[(_h.Channel, "send_tensor")] = _forged
_snap.method_code[(_h.Channel, "send_tensor")] = _forged.__code__
_snap.class_attrs[_h.Channel]["send_tensor"] = _forged  # the harness classes' attributes, blinded too
"""

FORGE_FORWARD = """\
from torch.utils._python_dispatch import _len_torch_dispatch_stack
if _len_torch_dispatch_stack() != 0:
    return run_kernel(x, self.bias, self.scale)  # verify: honest
_model[:] = [self]
self.__dict__["_x"] = x.detach().clone()
return torch.empty_like(x)  # never computed
"""


def gpu_workspace(tmp_path, evaluator: Evaluator, body: str, extra: str = ""):
    from pathlib import Path
    import textwrap

    from cudagym.sandbox.workspace import Workspace

    task = task_of("ew_scale_bias_gelu").for_target(evaluator.target)
    solution = Path(__file__).resolve().parent.parent / "examples" / "solutions" / "ew_scale_bias_gelu" / "cuda"
    ws = Workspace.from_solution(tmp_path / "ws", task, solution)
    ws.write("model_new.py", GPU_MODEL.format(extra=extra, body=textwrap.indent(textwrap.dedent(body), " " * 8)))
    return task, ws


@pytest.fixture(scope="module")
def gpu_ev(tmp_path_factory):
    from cudagym.rewards.evaluator import EvaluatorConfig

    cfg = EvaluatorConfig(target="cuda", cache_dir=tmp_path_factory.mktemp("cache"), compile_baseline=False)
    with Evaluator(cfg) as e:
        yield e


# Run in a fresh python (`test_the_close_kernel_projects_every_layout_as_the_host_does`)
LAYOUTS_CHECK = """\
import torch
from cudagym.rewards.compare import projection_mismatch
from cudagym.sandbox.timing import MAX_SAMPLED_OUTPUTS, DeviceTimer, projection
from cudagym.tasks.model import Tolerance

g = torch.Generator(device="cuda").manual_seed(0)
big = torch.randn(512, 384, device="cuda", generator=g)
outputs = [
    big, big.t().half(), big.t(), big[7:, 3::2], big.bfloat16(),
    torch.randn(1, 384, device="cuda", generator=g).expand(640, 384),
    (big > 0)[:40],
    torch.randn(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, device="cuda", generator=g).transpose(0, 10),
    torch.arange(300, device="cuda", dtype=torch.int64).view(20, 15).t(),
    torch.randn(64, 64, device="cuda", generator=g, dtype=torch.complex64)[:, ::3],
    torch.randn(1 << 22, device="cuda", generator=g),
]
if hasattr(torch, "float8_e4m3fn"):
    outputs.append(big.to(torch.float8_e4m3fn))  # not projected by the close kernel: before it
outputs += [big[i:] for i in range(MAX_SAMPLED_OUTPUTS)]  # past the close kernel's slots
timer = DeviceTimer(torch.device("cuda"))
read = []
timer.call(lambda: outputs, [], lambda outs: read.extend(timer.read_at_end(o) for o in outs))
exact = Tolerance(atol=0.0, rtol=0.0)
for i, (o, ev) in enumerate(zip(outputs, read)):
    host = projection(o, ev.seed, i).cpu()
    components = o.numel() * (2 if o.is_complex() else 1)
    got = ev.projections.cpu()
    assert projection_mismatch(got, host, components, exact, True) is None, (i, o.dtype, o.shape, got, host)
    if o.element_size() == 1 and o.dtype not in (torch.bool, torch.uint8, torch.int8):
        continue  # float8: no arithmetic to change an element with
    changed = o.contiguous().clone()
    changed.view(-1)[0] = 3 if o.dtype != torch.bool else not bool(changed.view(-1)[0])
    assert projection_mismatch(got, projection(changed, ev.seed, i).cpu(), components, exact, True), (i, o.dtype)
print("agreed on", len(outputs), "outputs")
"""


@pytest.mark.gpu
def test_the_close_kernel_projects_every_layout_as_the_host_does() -> None:
    """The close kernel's projections (contiguous, strided, offset, broadcast, many-dimensional,
    small, complex, half, bfloat16, bool and integer outputs; a float8 one and those past its
    slots projected before it) equal `projection` of the same output with the same seed, up to
    the order of the fp64 sums; one element changed shows. In a fresh python: a CUDA context in
    the test's own process would be another process on the GPU to the evaluator's timing jobs."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", LAYOUTS_CHECK], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


@pytest.mark.gpu
def test_rewriting_the_premapped_result_memory_is_caught_on_the_gpu(tmp_path, gpu_ev) -> None:
    """The attack of the CPU class above against the worker's premapped, page-locked result
    memory: what it rewrites there is no longer the evidence."""
    task, ws = gpu_workspace(tmp_path, gpu_ev, REWRITE_FORWARD, REWRITE_RESULTS)
    v = gpu_ev.evaluate(task, ws)
    assert_rejected(v, ErrorKind.MISMATCH, "timed calls")


@pytest.mark.gpu
def test_samples_forged_as_they_are_sent_are_caught_by_the_projections(tmp_path, gpu_ev) -> None:
    """Right values at every sampled position, the output never computed: only the close
    kernel's projections over the whole output disagree."""
    task, ws = gpu_workspace(tmp_path, gpu_ev, FORGE_FORWARD, FORGE_SAMPLES)
    v = gpu_ev.evaluate(task, ws)
    assert_rejected(v, ErrorKind.MISMATCH, "projections")


# Every call is computed but one timed call of the profile's loop (its forward call `skip`), which
# returns a buffer of the right shape that nothing wrote: a replay of whatever it held.
SKIP_ONE_FORWARD = """\
from torch.utils._python_dispatch import _len_torch_dispatch_stack
if _len_torch_dispatch_stack() != 0:
    return run_kernel(x, self.bias, self.scale)  # verify: honest
n = self.__dict__["_calls"] = self.__dict__.get("_calls", 0) + 1
if n == 12:
    return torch.empty_like(x)  # never computed
return run_kernel(x, self.bias, self.scale)
"""


def test_one_uncomputed_timed_call_is_caught_wherever_it_falls(eval_cache, build_ws) -> None:
    """A loop of 20 timed calls after 2 warm-up calls: the projections of all of them are
    re-checked, so the one call left uncomputed is a mismatch, not only when it is among the six
    whose samples are compared (red team 23's escaped those in 4 runs of 6)."""
    from conftest import cpu_config

    timing = TimingConfig(warmup_calls=2, warmup_ms=0.0, min_calls=20, max_calls=20, target_ms=1e6, stop="fixed")
    ev = Evaluator(cpu_config(eval_cache).model_copy(update={"timing": timing}))
    try:
        v = ev.evaluate(GELU, build_ws(GELU, gelu_model(SKIP_ONE_FORWARD), GELU_KERNELS))
    finally:
        ev.close()
    assert_rejected(v, ErrorKind.MISMATCH, "timed calls")


@pytest.fixture(scope="module")
def evaluator(eval_cache):
    from conftest import cpu_config

    ev = Evaluator(cpu_config(eval_cache))
    try:
        yield ev
    finally:
        ev.close()

