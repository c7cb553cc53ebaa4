"""Where forward's CPU time goes, sampled by the kernel from outside the candidate's process
(`cudagym.sandbox.cpusamples`; CPU target, real perf events, real workers and builds).

torch's own CPU kernel reached below the dispatcher, through a function pointer computed from
libtorch's symbol table and called with ctypes (no op recorded, no lookup the audit hook sees),
is refused in strict mode, in verify's trials and in the timed calls alone; the same forward
with both steps in the candidate's own code passes. Forward's windows come from marks the parent
stamps (a replaced clock is caught); threads too short to be sampled are not counted as own."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from typing import Any

import pytest

from cudagym.core.verdict import ErrorKind
from cudagym.rewards.checks import cpu_foreign_work
from cudagym.rewards.evaluator import Evaluator
from cudagym.sandbox.worker import wire
from cudagym.sandbox.cpusamples import (SYSTEM, UNMAPPED, CpuSampler, attribute, candidate_loaded_at, classify,
                                       read_maps, windows_from_marks)

from test_reward_hacking import GELU, INIT, assert_rejected

pytestmark = pytest.mark.slow

# two steps of the task, each a C function: scale and bias, then GELU in place
TWO_STEPS_CPP = """\
#include <cmath>
#include <cstdint>
extern "C" void scale_bias(const float* x, const float* bias, float* out, int64_t rows, int64_t cols, float scale) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = x[r * cols + c] * scale + bias[c];
}
extern "C" void gelu_inplace(float* v, int64_t n) {
    for (int64_t i = 0; i < n; ++i) v[i] = 0.5f * v[i] * (1.0f + std::erf(v[i] * 0.70710678118654752f));
}
"""

def _model(torch_gelu: str) -> str:
    """ModelNew: scale and bias in its own kernel, then GELU by its own kernel or, by
    `torch_gelu` ("never", "always", "timed": only where no dispatch recorder is on, the timed
    loop), by torch's CPU kernel through a function pointer."""
    return f'''\
import ctypes
import os
import torch
import torch.nn as nn
from torch.utils._python_dispatch import _len_torch_dispatch_stack
from cudagym.runtime import kernel_library, ptr

_lib = kernel_library()
_lib.scale_bias.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
_lib.gelu_inplace.argtypes = [ctypes.c_void_p, ctypes.c_int64]
_SYMBOL = b"_ZN2at3cpu5gelu_ERNS_6TensorESt17basic_string_viewIcSt11char_traitsIcEE"


class _View(ctypes.Structure):  # std::string_view, passed by value
    _fields_ = [("size", ctypes.c_size_t), ("data", ctypes.c_char_p)]


def _torch_gelu():
    from elftools.elf.elffile import ELFFile
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    with open(path, "rb") as f:
        value = ELFFile(f).get_section_by_name(".dynsym").get_symbol_by_name(_SYMBOL.decode())[0]["st_value"]
    with open("/proc/self/maps") as f:
        base = min(int(line.split("-")[0], 16) - int(line.split()[2], 16) for line in f
                   if line.rstrip().endswith("/libtorch_cpu.so"))
    fn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, _View)(base + value)

    unwrap = ctypes.pythonapi.PyCapsule_GetPointer
    unwrap.restype, unwrap.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]

    def gelu_(t):  # an at::Tensor is its TensorImpl*
        handle = ctypes.c_void_p(unwrap(torch._C._tensor_impl_raw_handle(t), None))
        fn(ctypes.addressof(handle), _View(4, b"none"))

    return gelu_


_GELU = _torch_gelu()


{INIT}
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        _lib.scale_bias(ptr(x), ptr(self.bias), ptr(out), x.numel() // x.size(-1), x.size(-1), self.scale)
        if {torch_gelu!r} == "always" or ({torch_gelu!r} == "timed" and not _len_torch_dispatch_stack()):
            _GELU(out)
        else:
            _lib.gelu_inplace(ptr(out), out.numel())
        return out
'''


def test_own_kernels_in_two_steps_pass(evaluator: Evaluator, build_ws) -> None:
    v = evaluator.evaluate(GELU, build_ws(GELU, _model("never"), {"kernels/steps.cpp": TWO_STEPS_CPP}))
    assert v.reward >= 1, v.reasons


def test_a_job_the_host_was_too_busy_to_time_runs_again_once(evaluator: Evaluator, build_ws, monkeypatch,
                                                              jobs: list[str]) -> None:
    """A CPU timing job whose windows say the host was too busy to time on (here: every one, the
    pass bound below any hand-over) runs once more after a pause; the second job's verdict
    stands, and says the first was busy. A correct candidate keeps +1."""
    import cudagym.rewards.checks as checks

    ws = build_ws(GELU, _model("never"), {"kernels/steps.cpp": TWO_STEPS_CPP})
    monkeypatch.setattr(checks, "CPU_WINDOW_PASS_US", -1e9)
    monkeypatch.setattr(checks, "CPU_PROBE_CAP_US", -1e9)
    v = evaluator.evaluate(GELU, ws)
    p = v.profile_result
    assert p is not None and not p.ok and p.error_kind == ErrorKind.DEVICE_BUSY, (p and p.error_kind, p and p.error)
    assert jobs.count("profile") == 2 and p.reasons[-1].startswith("timed again"), (" ".join(jobs), p.reasons)
    assert v.reward == 1 and v.correct, v.reasons


@pytest.mark.parametrize("when,needle", [("always", "not your own"), ("timed", "during timed calls")])
def test_torchs_cpu_kernel_through_a_function_pointer_is_refused_in_strict_mode(evaluator: Evaluator, build_ws,
                                                                                  when: str, needle: str) -> None:
    v = evaluator.evaluate(GELU, build_ws(GELU, _model(when), {"kernels/steps.cpp": TWO_STEPS_CPP}))
    assert_rejected(v, ErrorKind.AUDIT, needle, "gelu")


CHILD = """\
import sys, time, torch
torch.backends.mkldnn.enabled = False
x = torch.randn(2_000_000)
print("ready", flush=True)
sys.stdin.readline()
windows = []
for op in (torch.nn.functional.gelu, lambda t: t.clone()):
    spans = []
    for _ in range(10):
        a = time.perf_counter(); op(x); spans.append((a, time.perf_counter()))
    windows.append(spans)
print(repr(windows), flush=True)
sys.stdin.readline()
"""


def test_the_sampler_names_torchs_compute_and_allows_its_copies() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        sampler = CpuSampler([child.pid], period_us=100)
        assert not sampler.samples.error, sampler.samples.error
        child.stdin.write("go\n")
        child.stdin.flush()
        gelu, copies = eval(child.stdout.readline())  # noqa: S307 - our own child's repr of floats
        maps = read_maps([child.pid])
        samples = sampler.close()
    finally:
        child.kill()
        child.wait()
    computed = attribute(samples, maps, gelu, [])
    copied = attribute(samples, maps, copies, [])
    assert computed.forward > 20 and copied.forward > 5, (computed, copied)
    assert any("gelu" in k for k in computed.foreign), computed.foreign
    why = cpu_foreign_work(computed.as_counts(), len(gelu))
    assert why and "not your own" in why, why
    assert cpu_foreign_work(copied.as_counts(), len(copies)) is None, copied


# -- forward's windows, out of the worker's reach -----------------------------------------------
def test_windows_come_from_marks_the_parent_stamped() -> None:
    verify = [("request:trial", None, 9.0), ("forward", 10.0, 10.001), ("returned", 10.5, 10.501),
              ("request:evidence", None, 10.6), ("request:trial", None, 10.9), ("forward", 11.0, 11.002),
              ("returned", 11.25, 11.2501)]
    # each window from the earlier of a start's time and its arrival to the later of an end's
    assert windows_from_marks(verify, "returned", "request:trial") == ([(10.0, 10.501), (11.0, 11.2501)], "")
    # a timed call's end: its "returned" mark, written once its interval is over, before the
    # checks that precede the next request; one per call, and one request more (answered stop)
    timed = [("request:call", None, 9.0), ("forward", 10.0, 10.001), ("returned", 10.4, 10.4001),
             ("request:call", None, 10.5), ("forward", 11.0, 11.002), ("returned", 11.2, 11.201),
             ("request:call", None, 11.25)]
    assert windows_from_marks(timed, "returned", "request:call", stop=True) == ([(10.0, 10.4001), (11.0, 11.201)], "")
    assert "2 forward calls were marked for 3 calls" in windows_from_marks(timed, "returned", "request:call")[1]
    # the request alone does not end a call: the window stays open over the checks before it
    assert "ended by 'request:call'" in windows_from_marks([*timed[:2], *timed[3:]], "returned", "request:call",
                                                           stop=True)[1]
    # a timed job's worker marks where the candidate's code begins to load: once, before any call
    loading = [("candidate", 9.5, 9.6), *timed]
    assert windows_from_marks(loading, "returned", "request:call", stop=True)[1] == ""
    assert candidate_loaded_at(loading) == 9.6 and candidate_loaded_at(timed) is None
    assert "twice" in windows_from_marks([("candidate", 9.5, 9.6), *loading], "returned", "request:call",
                                         stop=True)[1]
    assert "after a forward call" in windows_from_marks([*timed[:4], ("candidate", 10.6, 10.7), *timed[4:]],
                                                        "returned", "request:call", stop=True)[1]
    # a replaced clock only widens verify's windows: an end that reads the start's time again
    # (red team 11's a1) still ends where the parent got the mark; a start read late opens on arrival
    forged = [("request:trial", None, 9.0), ("forward", 10.0, 10.001), ("returned", 10.0, 10.4),
              ("request:trial", None, 10.5), ("forward", 11.001, 11.001), ("returned", 11.001, 11.3)]
    assert windows_from_marks(forged, "returned", "request:trial") == ([(10.0, 10.4), (11.001, 11.3)], "")

    def why(marks: list) -> str:
        return windows_from_marks(marks, "returned", "request:trial")[1]

    # a start after the parent read it: the worker's clock is not the harness's
    assert "clock was replaced" in why([("request:trial", None, 9.0), ("forward", 10.2, 10.001)])
    # one long before (a clock that reads the past, or a mark that waited over a second for a parent
    # busy with twelve other checks): the window opens where the parent had the mark, no earlier
    late = [("request:trial", None, 9.0), ("forward", 5.0, 10.001), ("returned", 6.0, 10.5)]
    assert windows_from_marks(late, "returned", "request:trial") == ([(10.001, 10.5)], "")
    assert "twice" in why([("request:trial", None, 9.0), ("forward", 10.0, 10.001), ("forward", 10.1, 10.2)])
    # an end written by the candidate inside forward (the harness's own then arrives with none open)
    assert "no forward call running" in why(verify[:3] + [("returned", 10.55, 10.551)] + verify[3:])
    # ... or a forged end and a forged start: one call, two windows
    assert "2 forward calls were marked for 1 calls" in why(
        verify[:3] + [("forward", 10.3, 10.31), ("returned", 10.52, 10.521)])
    # an end before its start, or after its arrival: a replaced clock
    assert "end was marked" in why([("request:trial", None, 9.0), ("forward", 10.0, 10.001), ("returned", 9.5, 10.5)])
    assert "end was marked" in why([("request:trial", None, 9.0), ("forward", 10.0, 10.001), ("returned", 10.6, 10.5)])
    assert "not by 'returned'" in why([("request:trial", None, 9.0), ("forward", 10.0, 10.001),
                                       ("request:evidence", None, 10.5)])


def test_a_parent_slow_to_read_verifys_end_marks_keeps_the_harness_out_of_the_windows(
        evaluator: Evaluator, build_ws, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a loaded machine the parent reads a mark late (stop 40's CI: the evaluator in a Ray
    actor on 2 busy cores). Verify's windows close at the later of an end mark's time and its
    arrival, so the worker waits until the parent has read it: what the harness runs next (the
    next trial's reference, in torch's kernels; the dispatcher entries it reads) stays outside."""
    read = wire.read_frame

    def late(read_into, max_payload, admit=None):
        frame = read(read_into, max_payload, admit)
        if frame is not None and frame[0].get("type") == "mark" and frame[0].get("what") == "returned":
            time.sleep(0.05)  # the reader thread gets the CPU 50 ms after the mark came
        return frame

    monkeypatch.setattr(wire, "read_frame", late)
    # verify alone: a timed call's window is held to its interval (`cpu_windows_tight`), so a parent
    # 50 ms late on every call's end cannot time it
    v = evaluator.verify(GELU, build_ws(GELU, _model("never"), {"kernels/steps.cpp": TWO_STEPS_CPP}))
    assert v.ok and v.correct, (v.error, v.reasons)


def test_executable_heap_is_not_the_systems() -> None:
    assert classify("[heap]", 0, [])[0] == UNMAPPED
    assert classify("[vdso]", 0, [])[0] == SYSTEM


WRITTEN_OVER = """\
import mmap, sys
lib = [line.split()[-1] for line in open("/proc/self/maps") if "libm.so" in line][0]
with open(lib, "rb") as f:
    m = mmap.mmap(f.fileno(), 4096, flags=mmap.MAP_PRIVATE,
                  prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m[0] = m[0]  # the page is the process's own copy now: code written at run time
print(lib, flush=True)
sys.stdin.readline()
"""


def test_code_written_over_a_librarys_pages_is_not_that_library() -> None:
    child = subprocess.Popen([sys.executable, "-c", WRITTEN_OVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None
        lib = child.stdout.readline().strip()
        spans = read_maps([child.pid])[child.pid]
    finally:
        child.kill()
        child.wait()
    written = [m for m in spans if m.path == f"<code written at run time over {lib}>"]
    assert len(written) == 1, [m.path for m in spans if "libm" in m.path]
    assert classify(written[0].path, 0, [])[0] == UNMAPPED
    assert any(m.path == lib for m in spans)  # libm's own code, as loaded, stays the system's


# the clock the timed loop marks its calls with, replaced along with the harness's record of it
# (the worker's state, found up the stack): every mark's time moves back by an hour
SHIFTED_CLOCK = """\
import sys as _sys
import time as _time


def _shift():
    f = _sys._getframe(1)
    while f is not None and not hasattr(f.f_locals.get("state"), "originals"):
        f = f.f_back
    if f is None:
        return
    originals = f.f_locals["state"].originals
    real = originals["time.perf_counter"]

    def shifted():
        return real() - 3600.0

    originals["time.perf_counter"] = _time.perf_counter = shifted
"""


def test_a_replaced_clock_does_not_move_the_windows(evaluator: Evaluator, build_ws) -> None:
    """The clock is replaced before the timed loop binds anything: the marks use the job's own,
    bound before candidate code, so torch's kernel in the timed calls is still seen there."""
    model = _model("timed").replace("class ModelNew(nn.Module):", SHIFTED_CLOCK + "\n\nclass ModelNew(nn.Module):")
    model = model.replace("        self.bias = nn.Parameter(torch.empty(features))",
                          "        self.bias = nn.Parameter(torch.empty(features))\n        _shift()")
    v = evaluator.evaluate(GELU, build_ws(GELU, model, {"kernels/steps.cpp": TWO_STEPS_CPP}))
    assert_rejected(v, {ErrorKind.AUDIT, ErrorKind.TAMPER}, "during timed calls")


# the task's two steps, each row block in a thread of its own, started and joined inside the call:
# each thread runs for less than a sampling period
SHORT_THREADS_CPP = """\
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>
extern "C" void scale_bias(const float* x, const float* bias, float* out, int64_t rows, int64_t cols, float scale) {
    const int64_t block = 4, width = 4;  // a wave of 4 threads at a time, 4 rows each
    for (int64_t w0 = 0; w0 < rows; w0 += block * width) {
        std::vector<std::thread> wave;
        for (int64_t r0 = w0; r0 < w0 + block * width && r0 < rows; r0 += block)
            wave.emplace_back([=] {
                for (int64_t r = r0; r < r0 + block && r < rows; ++r)
                    for (int64_t c = 0; c < cols; ++c) {
                        float v = x[r * cols + c] * scale + bias[c];
                        out[r * cols + c] = 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
                    }
            });
        for (auto& t : wave) t.join();
    }
}
extern "C" void gelu_inplace(float*, int64_t) {}
"""


def test_threads_too_short_to_be_sampled_are_not_counted_as_own(evaluator: Evaluator, build_ws) -> None:
    v = evaluator.evaluate(GELU, build_ws(GELU, _model("never"), {"kernels/steps.cpp": SHORT_THREADS_CPP}))
    assert_rejected(v, ErrorKind.AUDIT, "too briefly to be sampled")


def test_an_unsampled_job_says_so() -> None:
    from cudagym.rewards.checks import cpu_origin_note

    assert "does not sample" in (cpu_origin_note({}) or "")
    assert "paranoid" in (cpu_origin_note({"kernel\tcpu\terror\tperf_event_open refused (paranoid 3)": 1}) or "")
    assert cpu_origin_note({"kernel\tcpu\tforward": 10}) is None


# a forward that ends its own window early: the harness's channel, found up the stack, marks the
# call returned before torch's kernel runs; or the channel's write rebound to drop the harness's marks
FORGED_END = """\
import sys as _sys


def _channel():
    f = _sys._getframe(1)
    while f is not None and not hasattr(f.f_locals.get("ch"), "mark"):
        f = f.f_back
    return f.f_locals["ch"] if f is not None else None


def _forge(how):
    ch = _channel()
    if ch is None:
        return
    if how == "end":
        import time
        ch.mark("returned", at=time.perf_counter())
    else:
        write = ch._write
        ch._write = lambda fd, data: write(fd, data)
"""


@pytest.mark.parametrize("how,needle", [("end", "not the harness's"), ("rebind", "result channel was modified")])
def test_marks_the_candidate_writes_or_drops_are_caught(evaluator: Evaluator, build_ws, how: str,
                                                        needle: str) -> None:
    model = _model("always").replace("class ModelNew(nn.Module):", FORGED_END + "\n\nclass ModelNew(nn.Module):")
    model = model.replace("            _GELU(out)", f"            _forge({how!r})\n            _GELU(out)")
    v = evaluator.evaluate(GELU, build_ws(GELU, model, {"kernels/steps.cpp": TWO_STEPS_CPP}))
    assert_rejected(v, {ErrorKind.AUDIT, ErrorKind.TAMPER}, needle)


def test_each_sample_is_judged_by_the_mapping_it_ran_in() -> None:
    """A decoy mapped over torch's code after its last call (red team 9), code mapped over other
    code, or mapped and gone by the end, cannot be judged by the file the end-of-job map names."""
    from cudagym.sandbox.cpusamples import Mapping, _History

    torch_code = Mapping(0x1000, 0x9000, 0x0, "/site-packages/torch/lib/libtorch_cpu.so")
    decoy = Mapping(0x2000, 0x3000, 0x0, "/usr/lib/x86_64-linux-gnu/libc.so.6")
    own = Mapping(0x20000, 0x21000, 0x1000, "/cache/build/artifacts/x/libkernels.so")
    late = _History([torch_code], [(100, decoy)], [torch_code, decoy])
    assert late.live(0x2100, 50) == (torch_code, "<code replaced during the job: " + torch_code.path + ">")
    assert "mapped over other code" in late.live(0x2100, 150)[1]
    gone = _History([torch_code], [(10, own)], [torch_code])
    assert "gone by its end" in gone.live(0x20100, 50)[1]
    loaded = _History([torch_code], [(10, own)], [torch_code, own])
    assert loaded.live(0x20100, 50) == (own, "")  # the candidate's library, loaded during the job
    assert loaded.live(0x5000, 50) == (torch_code, "")
    over = Mapping(0x1000, 0x9000, 0x0, f"<code written at run time over {torch_code.path}>")
    written = _History([torch_code], [], [over])
    assert "written at run time" in written.live(0x5000, 50)[1]


def test_windows_shorter_than_the_calls_they_stand_for_are_refused() -> None:
    """Each timed call's window must last about as long as the call measured (red team 11's
    b1/b2 ended each window with a mark of their own right after forward began); a probe's
    (the harness's tiny kernel) is not held to its call, and a few calls may fall short."""
    from cudagym.rewards.checks import cpu_windows_cover

    calls = [(2.2, i % 4 == 3) for i in range(100)]  # every fourth call a probe
    honest = [[40 if probe else 2_300, 2, 0] for _, probe in calls]
    assert cpu_windows_cover(honest, calls) is None
    preempted = [w if i % 20 else [900, 1, 0] for i, w in enumerate(honest)]  # 5 of 75 model calls short
    assert cpu_windows_cover(preempted, calls) is None
    forged = [[40, 0, 0]] * 100
    why = cpu_windows_cover(forged, calls)
    assert why and "75 of 75" in why and "not the harness's" in why, why
    half = [w if i % 2 else [40, 0, 0] for i, w in enumerate(honest)]
    assert cpu_windows_cover(half, calls), "a share of the calls is enough"
    assert "marked 99 timed calls of the 100" in (cpu_windows_cover(honest[:99], calls) or "")
    assert cpu_windows_cover([], calls) is None, "not sampled: nothing to judge"


def test_foreign_work_in_the_fast_calls_is_not_diluted_by_slow_ones() -> None:
    """Own code padded into some calls (red team 12's a6: 100 ms in each warm-up call) must not
    hide foreign code in the calls the reward reads (those at or below the median time)."""
    from cudagym.rewards.checks import cpu_fast_calls_foreign

    calls = [(100.0, False)] * 5 + [(2.0, False)] * 30  # warm-up padded with own code, then timed calls
    timed = [False] * 5 + [True] * 30
    padded = [[100_000, 100, 0]] * 5 + [[2_100, 2, 1]] * 30  # each timed call: one foreign sample of two
    why = cpu_fast_calls_foreign(padded, calls, timed, 1_000_000)
    assert why and "not your own for 50%" in why, why
    honest = [[100_000, 100, 0]] * 5 + [[2_100, 2, 0]] * 30
    assert cpu_fast_calls_foreign(honest, calls, timed, 1_000_000) is None
    few = [[100_000, 100, 0]] * 5 + [[2_100, 2, int(i == 7)] for i in range(30)]
    assert cpu_fast_calls_foreign(few, calls, timed, 1_000_000) is None, "within the allowance"


# -- reported times against the kernel's samples ------------------------------------------------
def test_reported_times_below_the_sampled_cpu_time_are_refused() -> None:
    """The worker's times are its own (native code can rewrite what a CPU call reports); the
    kernel's samples of its threads are not: a call cannot have taken less wall time than one
    thread ran in it. The calls the reward reads (at or below the median) are held to that."""
    from cudagym.rewards.checks import cpu_times_sampled

    calls = [(2.0, False)] * 5 + [(2.0, i % 6 == 5) for i in range(36)]  # warm-up, then timed calls and probes
    timed = [False] * 5 + [True] * 36
    honest = [[2_100, 2, 0, 2_000]] * 41  # each call: 2 ms sampled, 2 ms reported
    assert cpu_times_sampled(honest, calls, timed, 1_000_000) is None
    forged = [(0.5, probe) for _, probe in calls]  # the same work, reported at a quarter of its time
    why = cpu_times_sampled(honest, forged, timed, 1_000_000)
    assert why and "reported at 15.000 ms" in why and "at least 60.000 ms" in why, why
    slower = [(0.5, probe) if i < 30 else (3.0, probe) for i, (_, probe) in enumerate(calls)]
    assert cpu_times_sampled(honest, slower, timed, 1_000_000), "the calls the reward reads, on their own"
    near = [(1.9, probe) for _, probe in calls]  # within the allowance (the harness's steps in each window)
    assert cpu_times_sampled(honest, near, timed, 1_000_000) is None
    assert cpu_times_sampled(honest, near, timed, 1_000_000, lost=40), "lost samples count as the calls'"
    unbounded = [w[:3] for w in honest]  # no bounds (the marks broke the protocol: refused elsewhere)
    assert cpu_times_sampled(unbounded, forged, timed, 1_000_000) is None


def test_reported_intervals_shorter_than_the_evaluators_windows_are_refused() -> None:
    """Each timed call's window runs from the worker's mark before the interval to its mark
    after it, both stamped on arrival here: a report scaled down on its way (red team 20's b,
    by 0.65) leaves every window of the calls the reward reads longer than its interval."""
    from cudagym.rewards.checks import cpu_windows_tight

    calls = [(10.0, False)] * 5 + [(10.0, i % 6 == 5) for i in range(36)]
    timed = [False] * 5 + [True] * 36
    # honest: each window holds its 10.2 ms raw interval and the marks' passage (0.3 ms, a few stretched)
    honest = [[10_500 + (3_500 if i % 4 == 0 else 0), 10, 0] for i in range(41)]
    assert cpu_windows_tight(honest, calls, [10.2] * 41, timed) is None
    forged = [(6.5, probe) for _, probe in calls]  # raw intervals and times both scaled by 0.65
    why = cpu_windows_tight(honest, forged, [6.63] * 41, timed)
    assert why and "3.870 ms longer (median)" in why, why
    # honest calls among forged ones do not hide them: the reward reads the forged (red team 23 cut a
    # few calls within the allowance, the rest by far more, under a rule that held the closest)
    mixed = [(6.5, probe) if i % 3 else (10.0, probe) for i, (_, probe) in enumerate(calls)]
    spans = [6.63 if i % 3 else 10.2 for i in range(41)]
    assert cpu_windows_tight(honest, mixed, spans, timed)
    few = [(9.8, probe) if i % 4 == 1 else (6.5, probe) for i, (_, probe) in enumerate(calls)]
    assert cpu_windows_tight(honest, few, [9.9 if i % 4 == 1 else 6.63 for i in range(41)], timed)
    near = [(9.7, probe) for _, probe in calls]  # within the allowance
    assert cpu_windows_tight(honest, near, [9.9] * 41, timed) is None
    assert cpu_windows_tight(honest, forged, [None] * 41, timed) is None, "no raw intervals: nothing to hold"


def test_a_report_cut_within_a_busy_hosts_hand_overs_costs_the_speed_milestones() -> None:
    """Red team 28's a11: 2 ms calls reported at 0.35x their time left each window 1.7 ms longer
    than its report, within the 2.5 ms a loaded host's hand-overs may take (+3 strict). Past what
    they take on a host with CPUs to spare, the host was too busy to time on: no pass, whatever
    the waits."""
    from cudagym.rewards.checks import CPU_HOST_BUSY, CPU_WINDOW_PASS_US, cpu_windows_tight

    # 2.0 ms calls and 0.4 ms of hand-overs; every sixth a probe of the harness's (10 µs)
    calls = [(2.0, False)] * 5 + [(0.01, True) if i % 6 == 5 else (2.0, False) for i in range(36)]
    timed = [False] * 5 + [not probe for _, probe in calls[5:]]
    windows = [[round(ms * 1e3) + 400, 10, 0] for ms, _ in calls]
    assert cpu_windows_tight(windows, calls, [ms for ms, _ in calls], timed) is None
    cut = [(ms * 0.35, probe) for ms, probe in calls]  # the probes' reports cut too: 6.5 µs more of excess
    for waited in (None, [0] * 41, [5_000] * 41):
        why = cpu_windows_tight(windows, cut, [ms for ms, _ in cut], timed, waited=waited)
        assert why and why.startswith(CPU_HOST_BUSY) and "1.700 ms longer" in why, why
    light = [(ms - (CPU_WINDOW_PASS_US - 50) / 1e3 * (not probe), probe) for ms, probe in calls]  # within the bound
    assert cpu_windows_tight(windows, light, [c for c, _ in light], timed) is None


def test_the_jobs_probes_set_the_pass_bound_to_the_hosts_hand_overs_up_to_a_cap() -> None:
    """Session 29: on the CI host class every hand-over of a call (the worker's resume, its
    answer's read, the returned mark's write and read) ran on cold caches, 0.8-2.1 ms a call in
    all; the job's probes (the harness's 10 µs kernel through the same steps) took 0.5-1.4 ms.
    An honest call within the probes' excess and `CPU_PROBE_MARGIN_US` passes; a report cut
    beyond it is the busy host's, no pass; probes stretched (by code run inside their windows)
    raise the bound no further than `CPU_PROBE_CAP_US`."""
    from cudagym.rewards.checks import CPU_HOST_BUSY, CPU_PROBE_CAP_US, CPU_PROBE_MARGIN_US, cpu_windows_tight

    calls = [(3.0, False)] * 5 + [(0.01, True) if i % 4 == 3 else (3.0, False) for i in range(28)]
    timed = [False] * 5 + [not probe for _, probe in calls[5:]]
    spans = [ms for ms, _ in calls]

    def windows(call_us: float, probe_us: float) -> list[list[int]]:
        return [[round(ms * 1e3 + (probe_us if probe else call_us)), 10, 0] for ms, probe in calls]

    assert cpu_windows_tight(windows(1_600, 1_100), calls, spans, timed) is None  # honest, on this host
    why = cpu_windows_tight(windows(1_600, 300), calls, spans, timed)  # the same calls beside quick probes
    assert why and why.startswith(CPU_HOST_BUSY) and "probes: 0.300 ms" in why, why
    cut = windows(1_100 + CPU_PROBE_MARGIN_US + 300, 1_100)  # past the probes' margin and 5% of 3 ms
    assert (why := cpu_windows_tight(cut, calls, spans, timed)) and why.startswith(CPU_HOST_BUSY), why
    stretched = windows(CPU_PROBE_CAP_US + 200, 5_000)  # probes stretched by 5 ms: the cap holds
    assert (why := cpu_windows_tight(stretched, calls, spans, timed)) and why.startswith(CPU_HOST_BUSY), why
    assert cpu_windows_tight(windows(CPU_PROBE_CAP_US - 100, 5_000), calls, spans, timed) is None


def test_windows_stretched_by_waits_for_a_cpu_are_a_busy_host_never_a_pass() -> None:
    """On a host with more runnable threads than CPUs, the worker, the maker and the evaluator's
    frames thread each wait for a CPU at every hand-over of a call: the windows outgrow the calls
    by tens of ms (CI, sixteen episodes on two cores). The kernel's run-queue delays of those
    threads tell that load from a forged report: the excess they explain is a busy host (no speed
    milestone), what they leave beyond the allowance is still forged, and a call within the
    allowance passes with or without them."""
    from cudagym.rewards.checks import CPU_HOST_BUSY, cpu_windows_tight

    calls = [(40.0, False)] * 5 + [(40.0, i % 6 == 5) for i in range(36)]
    timed = [False] * 5 + [True] * 36
    loaded = [[40_200 + 15_000, 10, 0] for _ in range(41)]  # 15 ms of hand-overs a call
    why = cpu_windows_tight(loaded, calls, [40.0] * 41, timed, waited=[14_000] * 41)
    assert why and why.startswith(CPU_HOST_BUSY) and "waited for a CPU 14.000 ms" in why, why
    # the same windows with waits that explain too little: refused as forged
    why = cpu_windows_tight(loaded, calls, [40.0] * 41, timed, waited=[5_000] * 41)
    assert why and not why.startswith(CPU_HOST_BUSY) and "not the calls'" in why, why
    # a report scaled by 0.65 on a busy host: the waits explain the load, not the cut
    forged = [(26.0, probe) for _, probe in calls]
    why = cpu_windows_tight(loaded, forged, [26.0] * 41, timed, waited=[14_000] * 41)
    assert why and not why.startswith(CPU_HOST_BUSY), why
    # waits never make a pass of what was within the allowance anyway, nor a refusal of it
    quiet = [[40_500, 10, 0] for _ in range(41)]
    assert cpu_windows_tight(quiet, calls, [40.0] * 41, timed, waited=[0] * 41) is None
    assert cpu_windows_tight(loaded, calls, [40.0] * 41, timed, waited=[14_000] * 3) and \
        not cpu_windows_tight(loaded, calls, [40.0] * 41, timed, waited=[14_000] * 3).startswith(CPU_HOST_BUSY), \
        "waits not of every call: not read"


def test_the_run_queue_delay_of_a_thread_kept_from_its_cpu_is_read() -> None:
    """`run_queue_ns` reads what the kernel counts for a thread that was runnable but not running:
    a thread pinned to one CPU beside two spinning processes pinned there waits for most of its
    time; one alone on it waits for almost none."""
    import multiprocessing
    import threading

    from cudagym.sandbox.cpusamples import run_queue_ns

    cpu = sorted(os.sched_getaffinity(0))[0]
    got: dict[str, int] = {}

    def spin_for(s: float, name: str) -> None:
        os.sched_setaffinity(0, {cpu})
        path = ["/proc/thread-self/schedstat"]
        before, end = run_queue_ns(path), time.perf_counter() + s
        while time.perf_counter() < end:
            pass
        got[name] = run_queue_ns(path) - before

    t = threading.Thread(target=spin_for, args=(0.3, "alone"))
    t.start()
    t.join()
    ctx = multiprocessing.get_context("fork")
    hogs = [ctx.Process(target=spin_for, args=(3.0, "hog"), daemon=True) for _ in range(2)]
    for h in hogs:
        h.start()
    try:
        time.sleep(0.2)
        t = threading.Thread(target=spin_for, args=(1.0, "beside"))
        t.start()
        t.join()
    finally:
        for h in hogs:
            h.kill()
    assert got["beside"] > 0.5e9, got  # two others on its CPU: it waited about 2 of each 3 ms
    assert got["alone"] < 0.1e9 + got["beside"] / 10, got
    assert run_queue_ns(["/proc/0/schedstat"]) == 0, "a thread that is gone counts nothing"


def test_reported_times_below_the_spread_of_the_work_samples_are_refused_on_a_loaded_host() -> None:
    """On a host loaded threefold a call's threads run a third of its wall time: its CPU time
    leaves a forger room to report a third. The kernel's stamps of the first and the last sample
    of the candidate's work do not shrink with the load: the call lasted at least that long."""
    from cudagym.rewards.checks import cpu_times_sampled

    calls = [(6.0, False)] * 5 + [(6.0, i % 6 == 5) for i in range(36)]
    timed = [False] * 5 + [True] * 36
    loaded = [[6_100, 2, 0, 2_000, 5_500]] * 41  # 6 ms calls: 2 ms of CPU, work sampled over 5.5 ms
    assert cpu_times_sampled(loaded, calls, timed, 1_000_000) is None
    third = [(2.0, probe) for _, probe in calls]  # what the CPU time alone would let through
    assert cpu_times_sampled([w[:4] for w in loaded], third, timed, 1_000_000) is None
    why = cpu_times_sampled(loaded, third, timed, 1_000_000)
    assert why and "first to last sample" in why and "reported at 60.000 ms" in why, why
    edge = [(5.48, probe) for _, probe in calls]  # within the calibrated overhead's slack
    assert cpu_times_sampled(loaded, edge, timed, 1_000_000) is None
    # a call's time leaves out what the calibration estimates the close costs (a loaded host can make
    # that too large): the spread is held to each call's whole measured span where it is known
    left_out = [(5.0, probe) for _, probe in calls]
    assert cpu_times_sampled(loaded, left_out, timed, 1_000_000)
    assert cpu_times_sampled(loaded, left_out, timed, 1_000_000, spans=[6.0] * len(calls)) is None
    assert cpu_times_sampled(loaded, left_out, timed, 1_000_000, spans=[5.0] * len(calls))


def test_the_least_wall_time_of_a_window_is_not_raised_by_many_threads_sampled_once() -> None:
    """One thread: its sampled time; several: the busiest less one sample, or all over the CPUs
    (each of many threads sampled once may have run a moment only)."""
    from collections import Counter

    from cudagym.sandbox.cpusamples import CpuOrigin

    origin = CpuOrigin(cpus=2)
    origin.thread_ns = [Counter({7: 3_000}), Counter({t: 1_000 for t in range(64)}),
                        Counter({7: 5_000, 8: 1_000}), Counter()]
    origin.thread_n = [Counter({7: 3}), Counter({t: 1 for t in range(64)}), Counter({7: 5, 8: 1}), Counter()]
    assert origin.least_wall_ns() == [3_000, 32_000, 4_000, 0]
    origin.cpus = 64
    assert origin.least_wall_ns()[1] == 1_000


SPINNER = """\
import sys, time
print("ready", flush=True)
sys.stdin.readline()
spans = []
for ms in (30, 5, 60):
    a = time.perf_counter()
    while time.perf_counter() - a < ms / 1e3:
        pass
    spans.append((a, time.perf_counter()))
    time.sleep(0.02)
print(repr(spans), flush=True)
sys.stdin.readline()
"""


def _sampled_child(code: str, hogs: int = 0) -> tuple[list, dict, Any]:
    """Run `code` in a child (it prints "ready", waits for a line, prints the repr of its spans,
    waits again) sampled every 500 µs of CPU time; with `hogs` busy processes beside it on one
    CPU. Its spans, its maps and the samples."""
    cpu = {min(os.sched_getaffinity(0))}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for proc in (*busy, child) if hogs else ():
            os.sched_setaffinity(proc.pid, cpu)
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        sampler = CpuSampler([child.pid], period_us=500)
        assert not sampler.samples.error, sampler.samples.error
        child.stdin.write("go\n")
        child.stdin.flush()
        spans = eval(child.stdout.readline())  # noqa: S307 - our own child's repr of floats
        maps = read_maps([child.pid])
        return spans, maps, sampler.close()
    finally:
        for proc in (*busy, child):
            proc.kill()
            proc.wait()


def test_the_sampled_time_of_a_busy_thread_fits_in_its_window() -> None:
    """A thread's sampled CPU time in a span (each sample weighed by its CPU's period) is at
    most the span's wall time, give or take a sample, and is most of it for a thread that spun
    through it (on a loaded host, what it was given)."""
    spans, maps, samples = _sampled_child(SPINNER)
    origin = attribute(samples, maps, spans, [], bounds=spans)
    least = origin.least_wall_ns()
    period = max(samples.cpu_period_ns.values())
    for (a, b), ns in zip(spans, least, strict=True):
        assert ns <= (b - a) * 1e9 + period, (spans, least, samples.cpu_period_ns)
    assert sum(least) > 0.2 * sum(b - a for a, b in spans) * 1e9, (least, spans)


LOADED = """\
import os, sys, time, torch
torch.set_num_threads(1)
x = torch.randn(200_000)
print("ready", flush=True)
sys.stdin.readline()
spans = []
for ms in (60, 100, 80):
    a = time.perf_counter()
    while time.perf_counter() - a < ms / 1e3:
        torch.nn.functional.gelu(x)
    b = time.perf_counter()
    while time.perf_counter() - b < 0.02:  # the harness's steps after the call: the interpreter's
        pass
    spans.append((a, b, time.perf_counter()))
print(repr(spans), flush=True)
sys.stdin.readline()
"""


def test_the_work_samples_spread_over_the_call_on_a_loaded_cpu() -> None:
    """Two busy processes beside the worker on its CPU: its thread runs about a third of each
    call, and its sampled CPU time shows that; the first and the last sample of its work (torch's
    GELU here) still span the call, and the interpreter's steps after it add nothing."""
    spans, maps, samples = _sampled_child(LOADED, hogs=2)
    origin = attribute(samples, maps, [(a, b) for a, b, _ in spans], [], bounds=[(a, c) for a, _, c in spans])
    calls = [(b - a) * 1e9 for a, b, _ in spans]
    least, spread = origin.least_wall_ns(), origin.work_spread_ns()
    assert sum(least) < 0.6 * sum(calls), (least, calls)  # the load shows (runs read 0.3-0.45)
    # each span within its call, and most of it (runs read 0.85-0.99 in all; a first call's start,
    # waiting for the CPU before its first sample, lost up to 18 ms of 60)
    assert all(s <= c for s, c in zip(spread, calls, strict=True)) and sum(spread) > 0.7 * sum(calls), (spread, calls)


def test_call_bounds_are_the_parents_arrivals() -> None:
    from cudagym.sandbox.cpusamples import call_bounds

    timed = [("request:call", None, 9.0), ("forward", 10.0, 10.001), ("returned", 10.4, 10.41),
             ("request:call", None, 10.5), ("forward", 11.0, 11.002), ("returned", 11.2, 11.21),
             ("request:call", None, 11.25)]
    assert call_bounds(timed) == [(10.001, 10.41), (11.002, 11.21)]


# Python that writes memory through ctypes (as native code can): the timer's start, a float on the
# close's frame, moved forward in place as forward returns. No identity changes, no hook. Until
# session 30 only the kernel's samples of the worker's threads saw the time the call took (0.6 and
# 0.95 of each call cut: refused by `cpu_times_sampled`); the interval is now the native open's
# and close's stamps, sent on the channel before forward ran and before the close returned
# (tests/test_native_stamps.py): the frame's float is a diagnostic and the cut changes nothing.
SHRINK = '''\


def _shrink(share):
    import sys, time
    f = sys._getframe(1)
    while f is not None and not (f.f_code.co_name == "call" and "t0" in f.f_locals):
        f = f.f_back
    if f is not None and share:
        t0 = f.f_locals["t0"]
        ctypes.c_double.from_address(id(t0) + 16).value = t0 + share * (time.perf_counter() - t0)
'''


def test_a_call_time_rewritten_in_memory_changes_nothing(evaluator: Evaluator, build_ws) -> None:
    medians = []
    for share in (0.0, 0.95):
        model = _model("never").replace("_GELU = _torch_gelu()", "_GELU = None" + SHRINK)
        model = model.replace("        return out\n", f"        _shrink({share})\n        return out\n", 1)
        v = evaluator.evaluate(GELU, build_ws(GELU, model, {"kernels/steps.cpp": TWO_STEPS_CPP}))
        assert v.reward >= 1, v.reasons
        assert v.profile_result is not None and v.profile_result.candidate is not None
        medians.append(v.profile_result.candidate.median_ms)
    assert medians[1] > 0.7 * medians[0], medians  # cut by 0.95, the time would read about 0.05 of it


# three processes of the candidate's own spinning beside every call: its worker's threads wait for a
# CPU, so the run-queue delays the parent reads (`checks.cpu_windows_tight`'s `waited`) grow
CROWD = """
if os.fork() == 0 or os.fork() == 0 or os.fork() == 0:
    while True:
        pass
"""


def test_a_forged_report_beside_its_own_crowd_of_spinning_processes_is_never_paid(evaluator: Evaluator,
                                                                                   build_ws) -> None:
    """The waits for a CPU only ever make a busy host of a refusal. A forger that crowds the CPUs
    itself to have its cut explained by them gets at most the +1 of a correct candidate whose
    profile was unavailable, never a speed milestone: its crowd is its own work, sampled in its
    windows or between its calls (here: -1, "the candidate's code ran between the timed calls")."""
    model = _model("never").replace("_GELU = _torch_gelu()", "_GELU = None" + SHRINK + CROWD)
    model = model.replace("        return out\n", "        _shrink(0.6)\n        return out\n", 1)
    v = evaluator.evaluate(GELU, build_ws(GELU, model, {"kernels/steps.cpp": TWO_STEPS_CPP}))
    assert v.reward <= 1 and v.milestone in ("failed", "correct"), v.reasons

# An op name is the candidate's to choose (RECORD_FUNCTION): one with tabs and a newline once broke
# the worker's parse of the op counts, the profile failed as the harness's fault, and the +1 of an
# unavailable profile stood without the timed calls' audits (red team 14's d), while torch's own
# GELU ran in the timed calls.
NAMED_CPP = """\
#include <cmath>
#include <torch/extension.h>
#include <ATen/record_function.h>

torch::Tensor scaled_gelu(const torch::Tensor& x, const torch::Tensor& bias, double scale, const std::string& name) {
    if (!name.empty()) {
        RECORD_FUNCTION(name.c_str(), std::vector<c10::IValue>());
    }
    torch::Tensor out = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    const float* bp = bias.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t cols = x.size(-1), n = x.numel();
    for (int64_t i = 0; i < n; ++i) {
        float v = xp[i] * static_cast<float>(scale) + bp[i % cols];
        op[i] = 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
    }
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("scaled_gelu", &scaled_gelu); }
"""


def _named_model(name: str) -> str:
    return f'''\
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import _len_torch_dispatch_stack

import kernel_ext


{INIT}
    def forward(self, x):
        x = x.contiguous()
        if {name!r} and not _len_torch_dispatch_stack():  # timed: torch's GELU, and the odd name
            kernel_ext.scaled_gelu(x[:1], self.bias, self.scale, {name!r})
            return F.gelu(x * self.scale + self.bias)
        return kernel_ext.scaled_gelu(x, self.bias, self.scale, "")
'''


@pytest.mark.parametrize("name", ["", "own\tscope\nkernel\tcpu\tforward"], ids=["control", "tabs"])
def test_an_op_name_with_control_characters_does_not_spare_the_timed_calls_audit(evaluator: Evaluator, build_ws,
                                                                                 name: str) -> None:
    v = evaluator.evaluate(GELU, build_ws(GELU, _named_model(name), {"kernels/gelu_binding.cpp": NAMED_CPP}))
    if name:
        assert_rejected(v, {ErrorKind.AUDIT, ErrorKind.TAMPER}, "gelu")
    else:
        assert v.reward >= 1, v.reasons


# Code beside the harness that finds the next call's inputs before its interval opens (red team
# 14's b: a thread of `_thread`'s, which `threading` does not count, read `drive_calls`'s inputs
# through `sys._current_frames` and ran torch's GELU on them while the harness flushed the cache).
BESIDE = {
    "thread": '''
import _thread, time
_thread.start_new_thread(lambda: [time.sleep(0.001) for _ in iter(int, 1)], ())
''',
    "frames": '''
import sys
_FRAMES = []
''',
}


@pytest.mark.parametrize("how", ["thread", "frames"])
def test_code_beside_the_harness_that_reaches_its_inputs_is_refused(evaluator: Evaluator, build_ws, how: str) -> None:
    model = _model("never").replace("_GELU = _torch_gelu()", "_GELU = None\n" + BESIDE[how])
    if how == "frames":
        model = model.replace("        x = x.contiguous()\n", "        _FRAMES.append(len(sys._current_frames()))\n"
                              "        x = x.contiguous()\n", 1)
    v = evaluator.evaluate(GELU, build_ws(GELU, model, {"kernels/steps.cpp": TWO_STEPS_CPP}))
    if how == "thread":
        assert_rejected(v, ErrorKind.AUDIT, "left threads running")
    else:
        assert v.reward < 0 and "sys._current_frames" in " ".join(v.reasons) + (v.error or ""), v.reasons


# The C function behind a clock rewritten in memory (red team 14's a did it from C++ at import, then
# moved each call's end back): here `time.perf_counter`'s definition pointed at `time.monotonic`'s
# C function, which on Linux reads the same clock. Harmless, and still the harness's clock changed.
SWAPPED_CLOCK = '''
import ctypes, time
_word = ctypes.sizeof(ctypes.c_void_p)
_meth = lambda f: ctypes.c_void_p.from_address(ctypes.c_void_p.from_address(id(f) + 2 * _word).value + _word)
_meth(time.perf_counter).value = _meth(time.monotonic).value
'''


def test_a_clock_whose_c_function_was_swapped_is_refused(evaluator: Evaluator, build_ws) -> None:
    model = _model("never").replace("_GELU = _torch_gelu()", "_GELU = None\n" + SWAPPED_CLOCK)
    v = evaluator.evaluate(GELU, build_ws(GELU, model, {"kernels/steps.cpp": TWO_STEPS_CPP}))
    assert_rejected(v, ErrorKind.TAMPER, "timer")


def test_a_thread_started_in_a_call_and_never_sampled_counts_its_whole_cpu_time_there() -> None:
    """A fresh thread per call, each running less than a period, is never sampled: its CPU time
    (the kernel's count at its exit, or read at the job's end while it lives) counts, exactly,
    in the call it started in."""
    from cudagym.sandbox.cpusamples import Samples, thread_cpu_ns

    samples = Samples(period_ns=1_000_000, cpu_period_ns={0: 1_000_000, 1: 1_000_000})
    samples.started = {11: int(10.1e9), 12: int(11.1e9), 13: int(5e9)}
    samples.exited = {11: int(10.3e9)}
    samples.ran_ns[11] = 700_000
    samples.alive_ns = {12: 900_000, 13: 50_000_000}  # 13 started before any call: not a call's
    calls = [(10.0, 10.5), (11.0, 11.5)]
    origin = attribute(samples, {}, calls, [], bounds=calls)
    assert origin.least_wall_ns() == [700_000, 900_000]
    mine = thread_cpu_ns([__import__("os").getpid()])
    assert mine and all(v >= 0 for v in mine.values())


def test_only_the_systems_and_torchs_openmp_runtimes_are_left_out_of_the_sampled_time() -> None:
    """A build of the candidate's named like the runtime (red team 15's `load_inline(name="libgomp_fast")`)
    is the candidate's code, in the bound like any other."""
    import os

    import torch

    from cudagym.sandbox.cpusamples import _openmp_runtime

    assert _openmp_runtime("/usr/lib/x86_64-linux-gnu/libgomp.so.1")
    assert _openmp_runtime(os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), "lib", "libgomp.so.1"))
    for path in ("/root/.cache/cudagym/inline/0123/libgomp_fast.so", "/tmp/ws/site-packages/torch/lib/libgomp.so.1",
                 "/tmp/ws/libgomp.so.1"):
        assert not _openmp_runtime(path), path


# The slot of libpython's global offset table through which `time.perf_counter` calls clock_gettime
# (red team 15 wrote a hook of its own there): here pointed at the vDSO's own clock_gettime, the
# function libc's calls (the same clock, another address): any write that changes it is a changed clock.
SLOT_WRITE = '''
import ctypes, time
from cudagym.sandbox.worker.integrity import clock_slots
_vdso = ctypes.cast(ctypes.CDLL("linux-vdso.so.1").__vdso_clock_gettime, ctypes.c_void_p).value
for _slot, _value in clock_slots([time.perf_counter]):
    ctypes.c_void_p.from_address(_slot).value = _vdso
'''


def test_a_clock_slot_rewritten_in_libpythons_offset_table_is_refused(evaluator: Evaluator, build_ws) -> None:
    model = _model("never").replace("_GELU = _torch_gelu()", "_GELU = None\n" + SLOT_WRITE)
    v = evaluator.evaluate(GELU, build_ws(GELU, model, {"kernels/steps.cpp": TWO_STEPS_CPP}))
    assert_rejected(v, ErrorKind.TAMPER, "timer")


# A native thread of the candidate's (no Python thread state: the harness's count of threads does
# not see it), started at import, that works beside the harness: in its own code, or in the C
# library's; "idle" waits. One that computed the next call's output between calls (the inputs
# reached through a frame saved from forward) would leave the timed call little to do.
BESIDE_CPP = """\
#include <cstring>
#include <thread>
#include <unistd.h>
static volatile unsigned sink;
static char buffer[1 << 16];
extern "C" void beside(int mode) {
    std::thread([mode] {
        for (;;) {
            if (mode == 0) { sleep(1000); continue; }
            if (mode == 1) { for (unsigned i = 0; i < 100000; ++i) sink = sink * 31u + i; continue; }
            std::memset(buffer, static_cast<int>(sink++), sizeof buffer);
        }
    }).detach();
}
"""


@pytest.mark.parametrize("mode,needle", [(0, ""), (1, "libkernels.so"), (2, "on a thread it started")],
                         ids=["idle", "own", "libc"])
def test_a_native_thread_working_between_the_timed_calls_is_refused(evaluator: Evaluator, build_ws, mode: int,
                                                                    needle: str) -> None:
    model = _model("never").replace("_GELU = _torch_gelu()", f"_GELU = None\n_lib.beside({mode})")
    v = evaluator.evaluate(GELU, build_ws(GELU, model, {"kernels/steps.cpp": TWO_STEPS_CPP + BESIDE_CPP}))
    if needle:
        assert_rejected(v, ErrorKind.AUDIT, "ran between the timed calls", needle)
    else:
        assert v.reward >= 1, v.reasons


# a process whose main thread and two more spin, and a child that spins: what the maker's link stops
SPINNERS = """
import os, sys, threading
def spin():
    while True:
        pass
for _ in range(2):
    threading.Thread(target=spin, daemon=True).start()
if os.fork() == 0:
    spin()
print(os.getpid(), flush=True)
spin()
"""


def _states(pid: int) -> set[bytes]:
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            out.add(f.read().rsplit(b")", 1)[1].split()[0])
    return out


def test_the_workers_processes_are_stopped_while_the_maker_writes_the_inputs() -> None:
    """Red team 28's a15 computed each call's outputs from two native threads while the maker
    wrote its inputs (a time the window rule leaves out). The link stops every thread of every
    process below the worker's root but the maker's (here: the child is kept, as the maker is)
    and waits until each is stopped; SIGCONT lets them go on."""
    import signal

    from cudagym.sandbox.makerlink import _children, stop_tree

    p = subprocess.Popen([sys.executable, "-c", SPINNERS], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and int(p.stdout.readline()) == p.pid
        deadline = time.monotonic() + 10
        while not _children(p.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        (child,) = _children(p.pid)
        stopped = stop_tree(p.pid, keep=None, timeout_s=5)
        assert sorted(stopped) == sorted([p.pid, child])
        assert _states(p.pid) <= {b"T", b"t"} and len(os.listdir(f"/proc/{p.pid}/task")) == 3
        assert _states(child) <= {b"T", b"t"}
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.2)
        assert b"R" in _states(p.pid)
        assert stop_tree(p.pid, keep=child, timeout_s=5) == [p.pid]  # the maker's (kept) runs on
        time.sleep(0.05)
        assert b"R" in _states(child) and _states(p.pid) <= {b"T", b"t"}
        os.kill(p.pid, signal.SIGCONT)
        os.kill(child, signal.SIGKILL)
    finally:
        p.kill()
        p.wait()
