"""The parent's side of a job's conversation: secrets served in order, the timed loop planned
on the parent's clock, and every report that does not add up named."""

from __future__ import annotations

import pytest

from cudagym.sandbox.feed import CALIBRATION_CALLS, CALIBRATION_ROLE, CALIBRATION_WARMUP, CallFeed, TrialFeed
from cudagym.sandbox.protocol import TimingConfig

CFG = TimingConfig(warmup_calls=3, warmup_ms=0.0, min_calls=4, max_calls=6, target_ms=1e6)


def test_trials_are_served_once_each_in_order() -> None:
    feed = TrialFeed([11, 22], [1.0, 0.5], ["candidate_first", "reference_first"])
    assert feed({"what": "trial", "index": 0}, 0.0) == {"seed": 11, "scale": 1.0, "order": "candidate_first"}
    assert "refused" in feed({"what": "trial", "index": 0}, 0.0)  # again: the harness would ask for trial 1
    assert feed.violations and "out of order" in feed.violations[0]


def test_a_later_trial_is_not_served_early() -> None:
    feed = TrialFeed([11, 22], [1.0, 1.0], ["candidate_first"] * 2)
    assert "refused" in feed({"what": "trial", "index": 1}, 0.0)
    assert "refused" in feed({"what": "call", "index": 0}, 0.0)
    assert len(feed.violations) == 2


def drive(feed: CallFeed, role: str, ms: float, wall_ms: float, t0: float = 0.0, ops: dict | None = None) -> float:
    """Play a worker that asks for calls of `role` until stopped, each call taking `wall_ms` on
    the parent's clock and reporting `ms`; returns the clock at the end."""
    now, i, report = t0, 0, {}
    while True:
        answer = feed({"what": "call", "role": role, "index": i, "ops": ops or {}, **report}, now)
        assert "refused" not in answer, answer
        if answer.get("stop"):
            return now
        assert isinstance(answer["seed"], int)
        now += wall_ms / 1e3
        report = {"ms": ms}
        i += 1


def test_calls_are_planned_after_warm_up_and_recorded_by_the_parent() -> None:
    feed = CallFeed(CFG, (CALIBRATION_ROLE, "candidate"))
    t = drive(feed, CALIBRATION_ROLE, ms=0.01, wall_ms=0.31)
    assert len(feed.timed(CALIBRATION_ROLE)) == CALIBRATION_CALLS
    drive(feed, "candidate", ms=1.0, wall_ms=1.3, t0=t)
    timed = feed.timed("candidate")
    assert len(timed) == CFG.max_calls  # target far away: max_calls, after warmup_calls
    assert feed.times_ms("candidate") == [1.0] * CFG.max_calls
    assert len({c.seed for c in timed}) == len(timed)
    assert feed.clock_gap_ms("candidate") == pytest.approx(0.0, abs=1e-6)  # same overhead as calibration
    picks = feed.recheck_sample("candidate", 3)
    assert len(picks) == 3 and all(CFG.warmup_calls <= i < CFG.warmup_calls + CFG.max_calls for i, _ in picks)
    assert not feed.violations
    assert CALIBRATION_WARMUP < CALIBRATION_CALLS


def test_an_under_reported_time_shows_as_a_clock_gap() -> None:
    feed = CallFeed(CFG, (CALIBRATION_ROLE, "candidate"))
    t = drive(feed, CALIBRATION_ROLE, ms=0.01, wall_ms=0.31)
    drive(feed, "candidate", ms=0.1, wall_ms=1.3, t0=t)  # the call really took 1.0 ms
    assert feed.clock_gap_ms("candidate") == pytest.approx(0.9, abs=1e-6)


def test_reports_that_do_not_add_up_are_violations() -> None:
    feed = CallFeed(CFG, (CALIBRATION_ROLE, "candidate"))
    assert "refused" in feed({"what": "call", "role": "candidate", "index": 0}, 0.0)  # calibration first
    feed = CallFeed(CFG, (CALIBRATION_ROLE, "candidate"))
    t = drive(feed, CALIBRATION_ROLE, ms=0.01, wall_ms=0.31)
    assert "seed" in feed({"what": "call", "role": "candidate", "index": 0, "ops": {"aten::add": 2}}, t)
    assert "refused" in feed({"what": "call", "role": "candidate", "index": 1, "ms": 1.0, "ops": {"aten::add": 1}}, t)
    assert "went down" in feed.violations[-1]
    assert "refused" in feed({"what": "call", "role": "candidate", "index": 5, "ms": 1.0}, t)
    assert "refused" in feed({"what": "call", "role": "candidate", "index": 1, "ms": float("nan")}, t)
    assert len(feed.violations) == 3
