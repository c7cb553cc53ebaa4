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

from cudagym.sandbox.protocol import TimingConfig
from cudagym.sandbox.timing import (MAX_OVERHEAD_NS, TAIL_ALLOWANCE_MS, DeviceTimer, call_ms, gate_source,
                                    run_timed_loop)


def test_the_cpu_loop_times_a_fixed_number_of_calls_and_offers_each_for_re_checks() -> None:
    timer = DeviceTimer(torch.device("cpu"), flush_l2=False)
    calls: list[int] = []
    kept: list[tuple[int, int]] = []
    x = [torch.zeros(1000)]

    def fn(a: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return a + 1

    cfg = TimingConfig(warmup_calls=3, warmup_ms=0.0, min_calls=7, max_calls=9, target_ms=1e6)
    times = run_timed_loop(fn, [x], lambda: [torch.randn(1000)], timer, cfg, lambda i, n, args, out: kept.append((i, n)))
    assert len(times) == 9 and all(t > 0 for t in times)  # target far away: max_calls
    assert len(calls) == 3 + 9  # the warm-up calls are made, not recorded
    assert kept == [(i, 9) for i in range(9)]
    cfg = TimingConfig(warmup_calls=3, warmup_ms=0.0, min_calls=7, max_calls=9, target_ms=1e-6)
    assert len(run_timed_loop(fn, [x], lambda: [torch.randn(1000)], timer, cfg)) == 7  # target met at once: min_calls


def test_a_gpu_call_runs_to_its_end_event_less_the_harness_overhead() -> None:
    assert call_ms(0.055, 0.070, 3_000) == pytest.approx(0.052)
    # the close kernel gave up: the call runs to the last event, less the host's allowance
    assert call_ms(1000.5, 1200.0, 3_000) == pytest.approx(1200.0 - TAIL_ALLOWANCE_MS - 0.003)
    assert call_ms(0.001, 0.010, 3_000) == 0.0  # never negative


def test_the_overhead_a_timer_leaves_out_is_capped() -> None:
    assert DeviceTimer(torch.device("cpu"), flush_l2=False, overhead_ns=10**9).overhead_ns == MAX_OVERHEAD_NS
    assert DeviceTimer(torch.device("cpu"), flush_l2=False, overhead_ns=-5).overhead_ns == 0


def test_the_cpu_call_runs_the_after_hook_outside_the_timed_interval() -> None:
    import time

    timer = DeviceTimer(torch.device("cpu"), flush_l2=False)
    seen: list[torch.Tensor] = []
    timer.start()
    out = timer.call(lambda a: a + 1, [torch.zeros(3)], after=lambda o: (seen.append(o), time.sleep(0.05)))
    (ms,) = timer.finish()
    assert seen[0] is out and torch.equal(out, torch.ones(3))
    assert ms < 50  # the hook's sleep is not in the call's time


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
