"""The timing protocol's bookkeeping: the loop on the CPU target, and how a GPU trace is read.

The traced CUDA protocol itself runs in the GPU tests. Here `attribute` reads trace records
built by hand, which is how its rules (what a call owns, where its interval starts and ends,
what the timer's stream must hold) are pinned down.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from cudagym.sandbox.protocol import TimingConfig
from cudagym.sandbox.timing import DeviceTimer, TimingTraceError, attribute, run_timed_loop

TIMER, CALLER, SIDE = 11, 7, 23  # stream ids


@dataclass
class Rec:
    """One profiler record, with the accessors `attribute` reads (times in microseconds here)."""

    stream: int
    start_us: float
    end_us: float
    kind: str = "kernel"
    on_gpu: bool = True

    def device_resource_id(self) -> int:
        return self.stream

    def start_ns(self) -> int:
        return int(self.start_us * 1000)

    def end_ns(self) -> int:
        return int(self.end_us * 1000)

    def activity_type(self) -> str:
        return self.kind

    def device_type(self) -> torch.autograd.DeviceType:
        return torch.autograd.DeviceType.CUDA if self.on_gpu else torch.autograd.DeviceType.CPU


def timer_ops(t: float, flush_us: float = 30.0, marker_at: float = 0.0) -> list[Rec]:
    """Flush from t, marker at `marker_at`, separator 20 us after the marker."""
    return [Rec(TIMER, t, t + flush_us), Rec(TIMER, marker_at, marker_at + 1), Rec(TIMER, marker_at + 20, marker_at + 21)]


def test_a_call_runs_from_its_flush_to_the_end_of_its_work() -> None:
    recs = [Rec(TIMER, 0, 1), *timer_ops(100, marker_at=185), Rec(CALLER, 132, 182)]
    times, busy = attribute(recs, 1)
    assert times == [pytest.approx((185 - 130) / 1000)]  # the marker starts after the kernel
    assert busy == [pytest.approx(50 / 1000)]


def test_host_time_after_the_last_kernel_counts_through_the_marker() -> None:
    # the kernel ended at 150, but the call returned on the host later: the marker starts at 400
    recs = [Rec(TIMER, 0, 1), *timer_ops(100, marker_at=400), Rec(CALLER, 131, 150)]
    assert attribute(recs, 1)[0] == [pytest.approx((400 - 130) / 1000)]


def test_side_stream_work_extends_the_call_both_ways() -> None:
    # a side-stream kernel started during the flush and ended after the marker
    recs = [Rec(TIMER, 0, 1), *timer_ops(100, marker_at=185), Rec(CALLER, 132, 182), Rec(SIDE, 110, 300)]
    times, busy = attribute(recs, 1)
    assert times == [pytest.approx((300 - 110) / 1000)]
    assert busy == [pytest.approx((50 + 190) / 1000)]


def test_work_between_calls_belongs_to_no_call() -> None:
    # input refills and kept outputs (after a separator, before the next flush) are the harness's
    recs = [Rec(TIMER, 0, 1), Rec(CALLER, 5, 60),
            *timer_ops(100, marker_at=185), Rec(CALLER, 132, 182),
            Rec(CALLER, 210, 260), Rec(SIDE, 262, 270),
            *timer_ops(300, marker_at=390), Rec(CALLER, 331, 380)]
    times, _ = attribute(recs, 2)
    assert times == [pytest.approx(0.055), pytest.approx(0.060)]


def test_records_other_than_gpu_work_are_ignored() -> None:
    recs = [Rec(TIMER, 0, 1), *timer_ops(100, marker_at=185), Rec(CALLER, 132, 182),
            Rec(CALLER, 120, 900, kind="cuda_runtime"), Rec(CALLER, 120, 900, on_gpu=False)]
    assert attribute(recs, 1)[0] == [pytest.approx(0.055)]


@pytest.mark.parametrize("case", ["extra operation on the timer's stream", "missing marker", "empty trace"])
def test_a_trace_that_is_not_the_timers_is_rejected(case: str) -> None:
    recs = [Rec(TIMER, 0, 1), *timer_ops(100, marker_at=185), Rec(CALLER, 132, 182)]
    if case == "extra operation on the timer's stream":
        recs.append(Rec(TIMER, 150, 160))
    elif case == "missing marker":
        recs.pop(2)
    else:
        recs = []
    with pytest.raises(TimingTraceError):
        attribute(recs, 1)


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


def test_with_a_launch_window_the_call_starts_when_the_window_ends() -> None:
    # flush 100-130, launch window 130-330, marker, separator; the kernel waited for the window
    ops = [Rec(TIMER, 100, 130), Rec(TIMER, 130, 330), Rec(TIMER, 385, 386), Rec(TIMER, 405, 406)]
    recs = [Rec(TIMER, 0, 1), *ops, Rec(CALLER, 332, 382), Rec(SIDE, 140, 150)]
    times, busy = attribute(recs, 1, per_call=4)
    # a side-stream kernel that did not wait for the caller's stream ran inside the window: the
    # call's time starts with it
    assert times == [pytest.approx((385 - 140) / 1000)]
    assert busy == [pytest.approx(60 / 1000)]
    recs = [Rec(TIMER, 0, 1), *ops, Rec(CALLER, 332, 382)]
    assert attribute(recs, 1, per_call=4)[0] == [pytest.approx((385 - 330) / 1000)]


def test_the_harness_latencies_are_left_out_of_the_call_but_host_time_is_not() -> None:
    # window ends at 330; the kernel waited for it and started 2 us later, and the marker waited
    # for the kernel and started 1.5 us after its end
    ops = [Rec(TIMER, 100, 130), Rec(TIMER, 130, 330), Rec(TIMER, 383.5, 384), Rec(TIMER, 405, 406)]
    recs = [Rec(TIMER, 0, 1), *ops, Rec(CALLER, 332, 382)]
    assert attribute(recs, 1, per_call=4)[0] == [pytest.approx((383.5 - 330) / 1000)]
    assert attribute(recs, 1, per_call=4, latency_ns=(2000, 1500))[0] == [pytest.approx(0.050)]
    # the first launch came 40 us after the window ended (host work): counted from the window's
    # end plus the start latency
    recs = [Rec(TIMER, 0, 1), *ops, Rec(CALLER, 370, 382)]
    assert attribute(recs, 1, per_call=4, latency_ns=(2000, 1500))[0] == [pytest.approx((382 - 332) / 1000)]
    # the call returned on the host 100 us after its kernel ended: counted up to the marker less
    # the end latency
    late = [Rec(TIMER, 100, 130), Rec(TIMER, 130, 330), Rec(TIMER, 482, 483), Rec(TIMER, 505, 506)]
    recs = [Rec(TIMER, 0, 1), *late, Rec(CALLER, 332, 382)]
    assert attribute(recs, 1, per_call=4, latency_ns=(2000, 1500))[0] == [pytest.approx((480.5 - 332) / 1000)]
    # a call that ran no GPU work at all takes the window-to-marker time less both latencies
    recs = [Rec(TIMER, 0, 1), *ops]
    assert attribute(recs, 1, per_call=4, latency_ns=(2000, 1500))[0] == [pytest.approx((382 - 332) / 1000)]


def test_the_latencies_a_timer_leaves_out_are_capped() -> None:
    from cudagym.sandbox.timing import MAX_LATENCY_NS

    timer = DeviceTimer(torch.device("cpu"), flush_l2=False, latency_ns=(10**9, -5))
    assert timer.latency_ns == (MAX_LATENCY_NS, 0)
