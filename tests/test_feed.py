"""The parent's side of a job's conversation: secrets served in order, the timed loop planned
on the parent's clock, and every report that does not add up named."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Iterator

import pytest

from cudagym.core.stats import median_ci, median_ci_ranks
from cudagym.sandbox.feed import PROBE_EVERY, CallFeed, TrialFeed
from cudagym.sandbox.protocol import MAX_OVERHEAD_NS, Calibration, TimingConfig, call_ms_from

CFG = TimingConfig(warmup_calls=3, warmup_ms=0.0, min_calls=4, max_calls=6, target_ms=1e6)


def test_trials_are_served_once_each_in_order() -> None:
    feed = TrialFeed([11, 22], [1.0, 0.5], ["candidate_first", "reference_first"], [33, 44])
    assert feed({"what": "trial", "index": 0}, 0.0) == {"seed": 11, "scale": 1.0, "order": "candidate_first"}
    assert "refused" in feed({"what": "trial", "index": 0}, 0.0)  # again: the harness would ask for trial 1
    assert feed.violations and "out of order" in feed.violations[0]


def test_a_later_trial_is_not_served_early() -> None:
    feed = TrialFeed([11, 22], [1.0, 1.0], ["candidate_first"] * 2, [33, 44])
    assert "refused" in feed({"what": "trial", "index": 1}, 0.0)
    assert "refused" in feed({"what": "call", "index": 0}, 0.0)
    assert len(feed.violations) == 2


def test_an_evidence_seed_is_served_once_and_only_for_the_trial_under_way() -> None:
    """Before trial 0 starts, nothing (not the last trial's, by index -1); then trial 0's once;
    never a later trial's."""
    feed = TrialFeed([11, 22], [1.0, 1.0], ["candidate_first"] * 2, [33, 44])
    assert "refused" in feed({"what": "evidence", "index": -1}, 0.0)
    assert "refused" in feed({"what": "evidence", "index": 0}, 0.0)
    feed({"what": "trial", "index": 0}, 0.0)
    assert "refused" in feed({"what": "evidence", "index": 1}, 0.0)
    assert feed({"what": "evidence", "index": 0}, 0.0) == {"seed": 33}
    assert "refused" in feed({"what": "evidence", "index": 0}, 0.0)
    feed({"what": "trial", "index": 1}, 0.0)
    assert feed({"what": "evidence", "index": 1}, 0.0) == {"seed": 44}
    assert len(feed.violations) == 4 and feed.evidence_served == [0, 1]


def drive(feed: CallFeed, role: str, ms: float, wall_ms: float, t0: float = 0.0, ops: dict | None = None,
          probe_wall_ms: float = 0.31, probe_ms: float = 0.01) -> float:
    """Play a worker that asks for calls of `role` until stopped, each model call taking
    `wall_ms` on the parent's clock and reporting `ms` (probes: `probe_wall_ms`, `probe_ms`);
    returns the clock at the end."""
    now, i, report = t0, 0, {}
    while True:
        answer = feed({"what": "call", "role": role, "index": i, "ops": ops or {}, **report}, now)
        assert "refused" not in answer, answer
        if answer.get("stop"):
            return now
        assert isinstance(answer["seed"], int)
        now += (probe_wall_ms if answer["probe"] else wall_ms) / 1e3
        report = {"ms": probe_ms if answer["probe"] else ms}
        i += 1


def test_calls_are_planned_after_warm_up_and_recorded_by_the_parent() -> None:
    feed = CallFeed(CFG, ("eager", "compiled"))
    drive(feed, "eager", ms=1.0, wall_ms=1.3)
    timed = feed.timed("eager")
    assert len(timed) == CFG.max_calls  # target far away: max_calls, after warmup_calls
    assert feed.times_ms("eager") == [1.0] * CFG.max_calls  # the probes are not among them
    assert len(feed.timed("eager", probes=True)) >= CFG.max_calls // PROBE_EVERY
    assert len({c.seed for c in timed}) == len(timed)
    assert feed.clock_gap_ms("eager") == pytest.approx(0.0, abs=1e-6)  # the probes' overhead
    picks = feed.recheck_sample("eager", 3)
    assert len(picks) == 3 and {s for _, s in picks} <= {c.seed for c in timed}
    drive(feed, "compiled", ms=0.5, wall_ms=0.8)
    assert len(feed.timed("compiled")) == CFG.max_calls
    assert not feed.violations


def test_an_under_reported_time_shows_as_a_clock_gap() -> None:
    feed = CallFeed(CFG, ("candidate",))
    drive(feed, "candidate", ms=0.1, wall_ms=1.3)  # the call really took 1.0 ms
    assert feed.clock_gap_ms("candidate") == pytest.approx(0.9, abs=1e-6)


def test_a_loaded_host_slows_the_probes_as_much_as_the_calls() -> None:
    """The parent answering 40 ms late to every request: no gap."""
    feed = CallFeed(CFG, ("candidate",))
    drive(feed, "candidate", ms=1.0, wall_ms=41.3, probe_wall_ms=40.31)
    assert feed.clock_gap_ms("candidate") == pytest.approx(0.0, abs=1e-6)


def test_reports_that_do_not_add_up_are_violations() -> None:
    feed = CallFeed(CFG, ("eager", "compiled"))
    assert "refused" in feed({"what": "call", "role": "compiled", "index": 0}, 0.0)  # eager first
    feed = CallFeed(CFG, ("eager", "compiled", "cublaslt"))
    drive(feed, "eager", 1.0, 2.0)
    drive(feed, "cublaslt", 1.0, 2.0)  # a baseline that could not be measured is skipped
    assert "refused" in feed({"what": "call", "role": "compiled", "index": 0}, 1.0)  # never after a later one
    assert "out of order" in feed.violations[-1]
    feed = CallFeed(CFG, ("candidate",))
    assert "seed" in feed({"what": "call", "role": "candidate", "index": 0, "ops": {"aten::add": 2}}, 0.0)
    assert "refused" in feed({"what": "call", "role": "candidate", "index": 1, "ms": 1.0, "ops": {"aten::add": 1}}, 0.0)
    assert "went down" in feed.violations[-1]
    assert "refused" in feed({"what": "call", "role": "candidate", "index": 5, "ms": 1.0}, 0.0)
    assert "refused" in feed({"what": "call", "role": "candidate", "index": 1, "ms": float("nan")}, 0.0)
    assert len(feed.violations) == 3


def test_the_parent_times_each_call_with_the_calibration_it_got_before_the_candidate_loaded() -> None:
    """Red team 4 (b4, b5): a candidate that rewrites the worker's calibration in place (its
    overhead, its read cap) changed the times the worker computed. The parent now computes each
    call's time from the call's raw measurements and the calibration the worker sent before any
    candidate code loaded; the worker's own `ms` is not read, and a second calibration is refused."""
    feed = CallFeed(CFG, ("candidate",))
    cal = Calibration.measured(4_000, 10_000)
    assert feed({"what": "calibration", "calibration": cal._asdict()}, 0.0) == {}
    assert "seed" in feed({"what": "call", "role": "candidate", "index": 0, "ops": {}}, 0.0)
    raw = {"span_ms": 1.0, "read_ns": 10**9, "dense": 0, "strided": 0}  # a read phase far past the cap
    assert "seed" in feed({"what": "call", "role": "candidate", "index": 1, "ops": {}, "ms": 0.001, **raw}, 0.002)
    want = call_ms_from(cal, 1.0, 10**9, 0, 0)
    assert feed._roles["candidate"].calls[0].ms == pytest.approx(want) and want == pytest.approx(1.0 - 0.016)
    assert "refused" in feed({"what": "calibration", "calibration": {**cal._asdict(), "overhead_ns": 10**9}}, 0.003)
    assert "after the first" in feed.violations[-1]
    assert "refused" in feed({"what": "call", "role": "candidate", "index": 2, "ops": {}, "ms": 1.0}, 0.004)
    assert "invalid measurements" in feed.violations[-1]  # raw measurements are required once calibrated
    fresh = CallFeed(CFG, ("candidate",))
    assert fresh({"what": "calibration", "calibration": {**cal._asdict(), "overhead_ns": 10**9}}, 0.0) == {}
    assert fresh.calibration is not None and fresh.calibration.overhead_ns == MAX_OVERHEAD_NS  # capped here too
    assert "refused" in CallFeed(CFG, ("candidate",))({"what": "calibration", "calibration": {"overhead_ns": -1}}, 0.0)


SERVER = CFG.model_copy(update={"idle_ms": (2.0, 9.0), "idle_seed": 7})


def server_gaps(cfg: TimingConfig, role: str = "candidate", calls: int = 12) -> list[float]:
    """The gaps a server-mode feed asks a worker to idle before each call; every call's wall
    time is its gap plus 1 ms."""
    feed, now, gaps, report = CallFeed(cfg, (role,)), 0.0, [], {}
    for i in range(calls):
        answer = feed({"what": "call", "role": role, "index": i, "ops": {}, **report}, now)
        assert "refused" not in answer, answer
        if answer.get("stop"):
            break
        gaps.append(answer.get("idle_ms", 0.0))
        now += (answer.get("idle_ms", 0.0) + 1.0) / 1e3
        report = {"ms": 0.5}
    assert all(c.wall_ms is None or c.wall_ms == pytest.approx(1.0) for c in feed._roles[role].calls)  # gaps left out
    return gaps


def test_server_mode_asks_for_seeded_gaps_within_bounds_before_every_call() -> None:
    gaps = server_gaps(SERVER)
    assert len(gaps) >= 9 and all(2.0 <= g <= 9.0 for g in gaps) and len(set(gaps)) == len(gaps)
    assert server_gaps(SERVER) == gaps  # seeded
    assert server_gaps(SERVER.model_copy(update={"idle_seed": 8})) != gaps
    assert server_gaps(SERVER, role="eager") != gaps  # each role its own
    assert server_gaps(CFG) == [0.0] * len(server_gaps(CFG))  # offline: back to back


def test_a_worker_that_skips_its_idle_gap_is_a_violation() -> None:
    feed = CallFeed(SERVER, ("candidate",))
    answer = feed({"what": "call", "role": "candidate", "index": 0, "ops": {}}, 0.0)
    assert answer["idle_ms"] >= 2.0
    refused = feed({"what": "call", "role": "candidate", "index": 1, "ops": {}, "ms": 0.5}, 0.0015)
    assert "refused" in refused and "idle gap" in feed.violations[0]


@pytest.mark.parametrize("gap", [(-1.0, 2.0), (5.0, 2.0), (0.0, 5000.0)])
def test_server_gaps_out_of_bounds_are_refused(gap: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match="idle_ms"):
        TimingConfig(idle_ms=gap)


def test_rechecks_are_drawn_where_an_input_buffer_comes_back_and_from_every_timed_call() -> None:
    """Call i uses input set i mod the worker's sets: a result replayed by buffer can only come
    back from call `input_sets` on, so half the re-checked calls are drawn there when enough are;
    the other half from every timed call, so that none is out of the draw's reach (red team 22
    returned nothing from the timed calls below `input_sets`, which were never drawn)."""
    cfg = TimingConfig(warmup_calls=2, warmup_ms=0.0, min_calls=20, max_calls=20, target_ms=1e6, input_sets=8)
    feed = CallFeed(cfg, ("candidate",))
    drive(feed, "candidate", ms=1.0, wall_ms=1.0)
    drawn: set[int] = set()
    for _ in range(200):
        picks = feed.recheck_sample("candidate", 6)
        assert len(picks) == 6 and len({i for i, _ in picks}) == 6
        assert sum(i >= cfg.input_sets for i, _ in picks) >= 3
        drawn |= {i for i, _ in picks}
    model = {i for i, c in enumerate(feed.calls("candidate")) if c in feed.timed("candidate") and not c.probe}
    assert drawn == model, sorted(model - drawn)  # every timed model call can be drawn
    assert len(feed.recheck_sample("candidate", 1000)) == len(feed.timed("candidate"))  # too few: from all


def test_the_projections_of_every_timed_call_of_a_short_loop_are_rechecked() -> None:
    """Beside the sampled picks, the projections of more timed calls, drawn by the parent: all of
    them where the loop has no more than `recheck_projected`, none twice, no probe."""
    cfg = TimingConfig(warmup_calls=2, warmup_ms=0.0, min_calls=20, max_calls=20, target_ms=1e6, input_sets=8)
    feed = CallFeed(cfg, ("candidate",))
    drive(feed, "candidate", ms=1.0, wall_ms=1.0)
    model = {i for i, c in enumerate(feed.calls("candidate")) if c in feed.timed("candidate") and not c.probe}
    picks = feed.recheck_sample("candidate", 6)
    rest = feed.projection_sample("candidate", picks, 32)
    assert not {i for i, _ in picks} & {i for i, _ in rest}
    assert {i for i, _ in picks} | {i for i, _ in rest} == model
    seeds = {i: c.seed for i, c in enumerate(feed.calls("candidate"))}
    assert all(seeds[i] == s for i, s in rest)
    drawn: set[int] = set()
    for _ in range(100):
        few = feed.projection_sample("candidate", picks, 10)
        assert len(few) == 4 and not {i for i, _ in picks} & {i for i, _ in few}
        drawn |= {i for i, _ in few}
    assert drawn == model - {i for i, _ in picks}


# -- how long a timed loop runs (`TimingConfig.stop`) -------------------------------------------
PRECISION = TimingConfig(warmup_calls=3, warmup_ms=0.0, min_calls=20, max_calls=400, target_ms=300.0,
                         min_timed_ms=50.0, precision_rel=0.005)


def drive_series(feed: CallFeed, role: str, times_ms: Iterator[float], wall_ms: float) -> int:
    """Play a worker whose model calls report the next value of `times_ms` and take `wall_ms` of
    the parent's clock each (probes 0.3 ms); the number of timed model calls the feed let it make."""
    now, i, report = 0.0, 0, {}
    while True:
        answer = feed({"what": "call", "role": role, "index": i, "ops": {}, **report}, now)
        assert "refused" not in answer, answer
        if answer.get("stop"):
            return len(feed.timed(role))
        now += (0.3 if answer["probe"] else wall_ms) / 1e3
        report = {"ms": 0.001 if answer["probe"] else next(times_ms)}
        i += 1


def lognormal(median_ms: float, sigma: float, seed: int) -> Iterator[float]:
    """Call times around `median_ms` with a relative spread of about `sigma` (right-skewed, as calls are)."""
    rng = random.Random(seed)
    while True:
        yield median_ms * math.exp(rng.gauss(0.0, sigma))


def test_the_median_interval_is_the_sign_tests() -> None:
    assert median_ci_ranks(5) is None  # 2 / 2^5 > 5%: no interval from 5 calls
    assert median_ci_ranks(6) == (0, 5)
    assert median_ci_ranks(20) == (5, 14)  # 1 - 2 P(B <= 5) = 95.9%; rank 7 would give 88.5%
    lo, hi = median_ci_ranks(2000)  # type: ignore[misc]
    assert 950 <= lo < 1000 < hi <= 1050 and lo + hi == 1999  # symmetric, ~ n/2 -+ 1.96 sqrt(n) / 2


def test_the_median_interval_covers_the_median_at_least_as_often_as_asked() -> None:
    """Skewed samples (lognormal, true median 1): the interval of 30 calls holds it in >= 94% of
    2000 draws (the exact coverage at n = 30 is 95.7%)."""
    rng = random.Random(1)
    held = 0
    for _ in range(2000):
        ci = median_ci(sorted(math.exp(rng.gauss(0.0, 0.5)) for _ in range(30)))
        assert ci is not None
        held += ci[0] <= 1.0 <= ci[1]
    assert held / 2000 >= 0.94


def test_a_steady_kernel_stops_at_the_floors() -> None:
    """0.2% spread per call: the median is known within 0.5% from the first calls, so the loop
    ends at its floors (20 calls; 50 ms of the clock: 32 calls of 1.5 ms beside their probes of
    0.3 ms, one every 4th call), not at the fixed rule's 300 ms (200 calls)."""
    feed = CallFeed(PRECISION, ("candidate",))
    n = drive_series(feed, "candidate", lognormal(0.06, 0.002, seed=2), wall_ms=1.5)
    assert feed.stopped_by("candidate") == "precision"
    assert n == math.ceil(50.0 / (1.5 + 0.3 / 3))
    fixed = CallFeed(PRECISION.model_copy(update={"stop": "fixed"}), ("candidate",))
    assert drive_series(fixed, "candidate", lognormal(0.06, 0.002, seed=2), wall_ms=1.5) == 200
    assert fixed.stopped_by("candidate") == "length"


def test_a_fast_kernel_is_measured_over_the_floors_whatever_its_spread() -> None:
    """A 2 us kernel whose calls all read the same (0 spread) at 0.4 ms of clock each: the time
    floor, not the call floor, decides (50 ms: 100 calls beside their probes)."""
    feed = CallFeed(PRECISION, ("candidate",))
    n = drive_series(feed, "candidate", iter(lambda: 0.002, None), wall_ms=0.4)
    assert feed.stopped_by("candidate") == "precision"
    assert 50.0 / (0.4 + 0.3 / 3) <= n <= 50.0 / (0.4 + 0.3 / 3) + 1  # the calls until the clock passed 50 ms


def test_a_noisy_kernel_runs_to_the_fixed_length() -> None:
    """10% spread per call: 0.5% would need ~1000 calls; the loop ends at the fixed rule's length."""
    feed = CallFeed(PRECISION, ("candidate",))
    n = drive_series(feed, "candidate", lognormal(0.008, 0.10, seed=3), wall_ms=1.2)
    assert feed.stopped_by("candidate") == "length" and n == 250


def test_two_levels_of_time_do_not_read_as_precise() -> None:
    """Calls alternating between 1.0 and 1.2 ms (two placements, say): the median's interval
    spans both, so the loop runs its whole length rather than stopping on either level."""
    feed = CallFeed(PRECISION, ("candidate",))
    levels = itertools.cycle([1.0, 1.2])
    assert drive_series(feed, "candidate", levels, wall_ms=2.5) == 120
    assert feed.stopped_by("candidate") == "length"


def test_stopping_early_keeps_the_medians_spread_within_the_rule() -> None:
    """The rule's promise, checked on 300 simulated loops of a skewed 1.5% per-call spread: the
    medians of loops that stopped as soon as their interval was within 0.5% (sd ~0.26%) vary by
    a CV under 0.3% (the sampling share of the spread targets, CV < 1% / < 3%, stays small), and
    sit where the true median is, in loops of a third of the fixed length (231 calls) or so."""
    medians, lengths = [], []
    for seed in range(300):
        feed = CallFeed(PRECISION, ("candidate",))
        lengths.append(drive_series(feed, "candidate", lognormal(0.05, 0.015, seed=100 + seed), wall_ms=1.3))
        medians.append(statistics.median(feed.times_ms("candidate")))
    assert statistics.pstdev(medians) / statistics.fmean(medians) < 0.003
    assert abs(statistics.fmean(medians) / 0.05 - 1) < 0.001
    assert min(lengths) >= 20 and statistics.median(lengths) < 100 and max(lengths) <= 231


def test_what_a_call_says_its_close_projected_is_capped_at_the_reference_outputs_measure() -> None:
    """Red team 21's d: a report that said its close projected 1e13 strided elements raised the
    calibrated cap on the left-out read phase past any bound, and a forged read phase then took
    0.45 of an honest call out of its time (+2). The parent caps the counts at what the
    reference's outputs measure (`CallFeed.max_close_elements`, from the baseline job)."""
    cal = Calibration(overhead_ns=0, read_cap_ns=50_000, read_ps_per_element=4_000.0,
                      read_ps_per_strided_element=8_000.0, base_elements=1 << 16)
    raw = {"span_ms": 10.0, "read_ns": 4_500_000, "dense": 0, "strided": 10**13}
    times = []
    for cap in (None, (1 << 20, 0)):
        feed = CallFeed(CFG, ("candidate",))
        feed.max_close_elements = cap
        assert feed({"what": "calibration", "calibration": cal._asdict()}, 0.0) == {}
        assert "seed" in feed({"what": "call", "role": "candidate", "index": 0, "ops": {}}, 0.0)
        assert "seed" in feed({"what": "call", "role": "candidate", "index": 1, "ops": {}, **raw}, 0.011)
        times.append(feed._roles["candidate"].calls[0].ms)
    assert times[0] == pytest.approx(10.0 - 4.5), "uncapped: the whole forged read phase is left out"
    assert times[1] == pytest.approx(10.0 - 50_000 / 1e6), "capped at the reference's: no strided output there"
    honest = call_ms_from(cal, 10.0, 4_500_000, 1 << 20, 0)
    feed = CallFeed(CFG, ("candidate",))
    feed.max_close_elements = (1 << 20, 0)
    feed({"what": "calibration", "calibration": cal._asdict()}, 0.0)
    feed({"what": "call", "role": "candidate", "index": 0, "ops": {}}, 0.0)
    feed({"what": "call", "role": "candidate", "index": 1, "ops": {},
          **{**raw, "dense": 1 << 20, "strided": 0}}, 0.011)
    assert feed._roles["candidate"].calls[0].ms == pytest.approx(honest), "an honest count is never capped"
