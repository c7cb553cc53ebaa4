"""The timing protocol's bookkeeping: the loop on the CPU target, how a GPU call's events become
its time, and the gate kernels built with the local nvcc.

The CUDA protocol itself runs in the GPU tests.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from cudagym.sandbox.timing import (CPU_CALIBRATION, MAX_OVERHEAD_NS, READ_SLACK_NS, TAIL_ALLOWANCE_MS, Calibration,
                                    DeviceTimer, call_ms, drive_calls, gate_source)


def test_the_loop_makes_the_calls_the_parent_asks_for_with_each_calls_inputs() -> None:
    timer = DeviceTimer(torch.device("cpu"), flush_l2=False)
    x = [torch.zeros(4)]
    reports: list[dict] = []
    seeds = iter([3, 5, 7])

    def next_call(report: tuple) -> tuple[int, bool, float] | None:
        assert type(report) is tuple  # nothing to edit in place
        reports.append(dict(report))
        seed = next(seeds, None)
        return None if seed is None else (seed, seed == 5, 0.0)  # the second call is a probe

    def fn(a: torch.Tensor) -> torch.Tensor:
        return a * 2

    n = drive_calls(fn, [x], lambda s: [torch.full((4,), float(s))], next_call, timer,
                    after=lambda i, out: {"first": float(out[0])}, probe=lambda a: -a)
    assert n == 3
    assert reports[0] == {}  # nothing to report before the first call
    assert [r["first"] for r in reports[1:]] == [6.0, -5.0, 14.0]  # each call saw its own seed's inputs
    assert all(r["ms"] >= 0 for r in reports[1:])
    assert torch.equal(x[0], torch.full((4,), 7.0))  # the buffers are refilled in place


def test_a_gpu_call_runs_to_its_end_event_less_the_harness_overhead() -> None:
    assert call_ms(0.055, 0.070, 3_000) == pytest.approx(0.052)
    # the close kernel gave up: the call runs to the last event, less the host's allowance
    assert call_ms(1000.5, 1200.0, 3_000) == pytest.approx(1200.0 - TAIL_ALLOWANCE_MS - 0.003)
    assert call_ms(0.001, 0.010, 3_000) == 0.0  # never negative


def test_what_a_timer_leaves_out_is_capped() -> None:
    assert Calibration.measured(10**9, 10_000).overhead_ns == MAX_OVERHEAD_NS
    assert Calibration.measured(-5, 10_000).overhead_ns == 0
    cal = Calibration.measured(4_000, 10_000)
    assert cal.left_out_ns(9_000) == 4_000 + 9_000  # a call's own read phase is left out
    # a read phase longer than the calibration's (many outputs; or its stamps forged) only up to the slack
    assert cal.left_out_ns(10**9) == 4_000 + 10_000 + READ_SLACK_NS
    assert cal.left_out_ns(-10**9) == 4_000
    # the CPU target measures its close too (its projection pass grows with the output)
    cpu = DeviceTimer(torch.device("cpu"), flush_l2=False).calibrate()
    assert 0 < cpu.overhead_ns <= MAX_OVERHEAD_NS and cpu.base_elements == CPU_CALIBRATION[1]
    assert cpu.read_ps_per_element > 0 and cpu.left_out_ns(10**12, dense=1 << 22) < 10**12


def test_the_cpu_call_runs_the_after_hook_inside_the_timed_interval() -> None:
    """On the CPU target `after` registers the outputs for the close, which runs inside the
    interval (see `DeviceTimer.call`): what a candidate's hook runs there is timed."""
    timer = DeviceTimer(torch.device("cpu"), flush_l2=False)
    order: list[str] = []
    timer._perf = lambda: order.append("clock") or 0.0  # type: ignore[method-assign]
    seen: list[torch.Tensor] = []
    out, _ = timer.call(lambda a: a + 1, [torch.zeros(3)], after=lambda o: (seen.append(o), order.append("after")))
    assert seen[0] is out and torch.equal(out, torch.ones(3))
    assert order == ["clock", "after", "clock"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch,per_sm", [("sm_80", 8), ("sm_90", 8), ("sm_86", 6)])
def test_the_gate_kernels_compile_within_the_register_budget_that_fills_every_sm(tmp_path, arch, per_sm) -> None:
    """The gate kernels hold an SM only if `per_sm` blocks of 256 threads fit its register file
    (64K registers): at most 65536 / (256 * per_sm) registers per thread."""
    src = tmp_path / "gate.cu"
    src.write_text(gate_source(per_sm))
    r = subprocess.run(["nvcc", f"-arch={arch}", "-c", "-o", str(tmp_path / "gate.o"), "-Xptxas", "-v", str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    used = [int(n) for n in re.findall(r"Used (\d+) registers", r.stderr)]
    assert len(used) == 2, r.stderr  # open and close
    assert max(used) <= 65536 // (256 * per_sm), r.stderr


def test_a_replaced_sys_monitoring_is_a_foreign_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """Red team 22 put an object of its own at `sys.monitoring` (absent before Python 3.12): the
    harness's hook check called its `get_tool`, which rewrote the next report from the stack."""
    import sys

    from cudagym.sandbox.timing.timer import foreign_hooks

    assert foreign_hooks() == ""

    class Fake:
        def get_tool(self, i: int) -> None:
            raise AssertionError("the harness called the candidate's get_tool")

    monkeypatch.setattr(sys, "monitoring", Fake(), raising=False)
    assert "sys.monitoring replaced" in foreign_hooks()


def test_replaced_hook_readers_are_foreign_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Red team 23 put functions of its own at `sys.getprofile` and `signal.getsignal`, which the
    harness's per-call checks called and which rewrote the pending report from the stack."""
    import sys

    from cudagym.sandbox.timing.timer import foreign_hooks

    monkeypatch.setattr(sys, "getprofile", lambda: None)
    assert "sys.getprofile or sys.gettrace replaced" in foreign_hooks()
