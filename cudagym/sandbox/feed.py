"""What the parent answers a worker while its job runs (see `Sandbox.run`'s responder).

Secrets reach the candidate's process one step at a time, and the parent keeps the record:

- `TrialFeed` (verify): trial t's input seed, scale and order are revealed when the worker asks
  for trial t, after `ModelNew` is built and trial t-1's outputs are sent; each trial once, in
  order. Nothing about a later trial is in the worker before it starts. The seed of trial t's
  evidence (outputs too large to send whole) is revealed once, when the worker asks for it after
  trial t's call returned (`cudagym.sandbox.worker.verify.run_verify`).
- `CallFeed` (profile, baseline): the parent decides every timed-loop call. The worker asks for
  call i (reporting call i-1: its time and the cumulative op counts of the candidate's calls)
  and gets the seed of call i's inputs or `stop`. Warm-up, the number of timed calls and which
  calls count are decided here, with the parent's clock; every seed, report and arrival time is
  kept here, not in the worker.

A request out of order, a repeated one, or a report that does not add up is a *violation*: the
request is refused (the worker reports tampering) and the violation is kept for the verdict.

How long a role's timed loop runs (`TimingConfig.stop`): "fixed" plans `target_ms` of the
parent's clock at the warm-up's pace once warm-up ends; "precision" takes that length as a
ceiling and stops sooner, at the first request where the timed calls' median is known closely
enough: its distribution-free confidence interval (`cudagym.core.stats`) within
`precision_rel` of it, after at least `min_calls` timed calls and `min_timed_ms` of the clock
(floors: a 2 us kernel is still measured over as many calls, and over as much time, as the
floors say, whatever its spread). The rule reads the times the worker reported, which the
candidate's process could forge; what it could gain is a shorter loop, no shorter than the
floors, whose times are held to the same checks (the parent's clock, `clock_gap_ms`; the
re-checked outputs, drawn from the calls made): a loop cut at a consistent stretch of calls has
that stretch's median, which the calls really took.

The parent's clock bounds the worker's reported times (`CallFeed.clock_gap_ms`): the interval
between the requests for calls i and i+1 holds call i entirely (the worker synchronizes the
device before asking again), plus the loop's own overhead. Every `PROBE_EVERY`-th call of a
loop is a *probe*: the harness calls a tiny kernel of its own instead of the model, through the
same steps, so the probes measure that overhead under the same host load as the calls around
them (measured once before the loop, it was 19-121 ms off under a loaded host: a busy parent
answers late). A candidate that under-reports its times in its own process shows up as a gap
between what the parent's clock saw and what was reported, beyond the probes' overhead; a
probe's own time, which the candidate could shrink too, is a few microseconds.
"""

from __future__ import annotations

import math
import random
import secrets
import statistics
from dataclasses import dataclass, field
from typing import Any

from cudagym.core.stats import median_ci_rel
from cudagym.sandbox.protocol import MAX_OVERHEAD_NS, Calibration, TimingConfig, call_ms_from

PROBE_EVERY = 4  # every 4th call of a loop is a probe (not a call of the model)


@dataclass
class Call:
    """One call of a timed loop, as the parent saw it."""

    seed: int
    asked_s: float  # when the worker asked for it (parent's clock, s)
    wall_ms: float | None = None  # from its request to the next request (parent's clock)
    ms: float | None = None  # the worker's measured time of the call
    probe: bool = False  # the harness's tiny kernel, not the model
    host_ms: float | None = None  # the worker's host span of the call (`DeviceTimer.host_ms`; diagnostic)
    span_ms: float | None = None  # the raw interval its time is computed from (`call_ms_from`)
    idle_ms: float = 0.0  # server mode: the gap the worker idled before the call (left out of wall_ms)


def native_raw(stamps: list[dict[str, Any]]) -> list[Any] | str:
    """A CPU call's raw measurements (`call_ms_from`'s: its interval in ms, its close's read phase
    in ns, the elements it projected, none strided) from its native stamps (`FrameReader.stamped`):
    exactly one open, then one close, each once; or why they cannot be the harness's."""
    if [s.get("what") for s in stamps] != ["open", "close"]:
        return (f"its native stamps were {[s.get('what') for s in stamps]!r}, not one open and one close (written "
                "on the channel by something other than the harness's timer)")
    opened, closed = stamps
    values = [opened.get("ns"), closed.get("ns"), closed.get("phase_ns"), closed.get("dense")]
    ints = [v for v in values if type(v) is int and v >= 0]
    if len(ints) != len(values) or ints[1] < ints[0]:
        return f"its native stamps are malformed: {values!r}"
    return [(ints[1] - ints[0]) / 1e6, ints[2], ints[3], 0]


def _violation(violations: list[str], why: str) -> dict[str, Any]:
    violations.append(why)
    return {"refused": why}


class TrialFeed:
    """Reveals verify's trials one at a time, in order, and each trial's evidence seed (one of
    `evidence_seeds`) at most once, for the trial under way (see the module's text)."""

    def __init__(self, seeds: list[int], scales: list[float], orders: list[str], evidence_seeds: list[int]) -> None:
        self._plan = list(zip(seeds, scales, orders, evidence_seeds, strict=True))
        self.served = 0
        self.evidence_served: list[int] = []  # the trials whose evidence seed was revealed
        self.violations: list[str] = []

    def __call__(self, request: dict[str, Any], arrived_s: float) -> dict[str, Any]:
        index = request.get("index")
        if request.get("what") == "evidence":
            if type(index) is not int or index != self.served - 1 or index < 0 or index in self.evidence_served:
                return _violation(self.violations, f"the evidence seed of trial {index!r} was asked for out of "
                                  f"order ({self.served} trials served)")
            self.evidence_served.append(index)
            return {"seed": self._plan[index][3]}
        if request.get("what") != "trial":
            return _violation(self.violations, f"a request for {request.get('what')!r} during verify")
        if index != self.served or self.served >= len(self._plan):
            return _violation(self.violations, f"trial {index!r} was asked for out of order "
                              f"({self.served} of {len(self._plan)} served)")
        seed, scale, order, _ = self._plan[self.served]
        self.served += 1
        return {"seed": seed, "scale": scale, "order": order}


@dataclass
class _Role:
    """The calls of one role (candidate, eager, compiled) of a job, probes included."""

    calls: list[Call] = field(default_factory=list)
    timed_from: int | None = None  # index (among all calls) of the first call after warm-up
    timed_n: int = 0  # model calls after warm-up, at most (the fixed rule's length; the ceiling of "precision")
    stopped: bool = False
    stopped_by: str | None = None  # "length": timed_n calls were made; "precision": the median was known closely
    ops: dict[str, int] = field(default_factory=dict)  # cumulative op counts, as last reported
    gaps: random.Random | None = None  # server mode: the role's idle gaps


class CallFeed:
    """Plans and records the calls of a job's timed loops, one role after another.

    `roles` are the roles the job runs, in order (the first one first; a later one may be skipped,
    a baseline that could not be measured, but none may come back or come early). Each role's model calls: warm-up until
    `cfg.warmup_calls` calls and `cfg.warmup_ms` of the parent's clock have passed, then
    `cfg.target_ms` over the warm-up's median wall time per call (second half), within
    [`cfg.min_calls`, `cfg.max_calls`], fixed before the first timed call; with
    `cfg.stop == "precision"` that many at most, ending once the median is known within
    `cfg.precision_rel` (see the module's text). Probes are interleaved throughout (see the
    module's text) and are neither warm-up nor timed calls.
    """

    def __init__(self, cfg: TimingConfig, roles: tuple[str, ...]) -> None:
        self.cfg = cfg
        self.roles = roles
        self._roles: dict[str, _Role] = {}
        self.violations: list[str] = []
        # the worker's timer calibration, sent before any candidate code loaded (`calibrated`)
        self.calibration: Calibration | None = None
        # what a call's close may say it projected at most, all of it and not contiguous: the
        # reference's outputs' measures (`timed.roofline_inputs`' "close_elements", "close_strided");
        # more would leave more of the call out of its time (red team 21's d reported 1e13 strided
        # elements: 0.55 of its honest time, +2). An output strided where the reference's is not
        # pays its slower close in its own time.
        self.max_close_elements: tuple[int, int] | None = None
        # the CPU target's calls are stamped natively (`native_stamps` with the calibration, before
        # any candidate code): each call's interval, read phase and projected measure come from the
        # harness's native open and close, on the channel before the candidate ran again
        # (`FrameReader.stamped`), not from the report, which the candidate's code can reach first
        self.native_stamps = False

    # -- answering ---------------------------------------------------------------------------
    def __call__(self, request: dict[str, Any], arrived_s: float) -> dict[str, Any]:
        if request.get("what") == "calibration":
            return self._calibrated(request)
        role_name, index = request.get("role"), request.get("index")
        if request.get("what") != "call" or role_name not in self.roles:
            return _violation(self.violations, f"an unexpected request {request.get('what')!r} "
                              f"for role {role_name!r}")
        last = next(reversed(self._roles), None)  # the role begun last (a role may be skipped, not reordered)
        if role_name not in self._roles:
            if last is not None and not self._roles[last].stopped:
                return _violation(self.violations, f"calls of {role_name!r} began before {last!r} ended")
            if self.roles.index(role_name) < (self.roles.index(last) if last is not None else 0) or (
                    last is None and role_name != self.roles[0]):
                return _violation(self.violations, f"calls of {role_name!r} out of order")
            gaps = None if self.cfg.idle_ms is None else random.Random(f"{self.cfg.idle_seed}:{role_name}")
            self._roles[role_name] = _Role(gaps=gaps)
        role = self._roles[role_name]
        if role.stopped or index != len(role.calls):
            return _violation(self.violations, f"call {index!r} of {role_name!r} was asked for out of order "
                              f"({len(role.calls)} served)")
        why = self._take_report(role, request, arrived_s)
        if why:
            return _violation(self.violations, why)
        if self._plan_next(role, arrived_s):
            role.stopped = True
            return {"stop": True}
        seed = secrets.randbits(62)
        probe = len(role.calls) % PROBE_EVERY == PROBE_EVERY - 1
        idle_ms = role.gaps.uniform(*self.cfg.idle_ms) if role.gaps is not None and self.cfg.idle_ms else 0.0
        role.calls.append(Call(seed=seed, asked_s=arrived_s, probe=probe, idle_ms=idle_ms))
        return {"seed": seed, "probe": probe, **({"idle_ms": idle_ms} if idle_ms else {})}

    def _calibrated(self, request: dict[str, Any]) -> dict[str, Any]:
        """Take the worker's timer calibration (`Calibration`), once, before any call: the worker
        measures it before any candidate code loads, and each call's time is computed here from
        it and the call's raw measurements (`call_ms_from`), so that a candidate that rewrites the
        worker's copy later changes nothing. Its overhead is capped at `MAX_OVERHEAD_NS` here too."""
        if self.calibration is not None or self._roles:
            return _violation(self.violations, "a timer calibration was sent after the first one or after calls began")
        fields = request.get("calibration")
        try:
            if not isinstance(fields, dict) or not all(_finite(v) and v >= 0 for v in fields.values()):
                raise ValueError(fields)
            cal = Calibration(**fields)
        except (TypeError, ValueError):
            return _violation(self.violations, f"a malformed timer calibration: {fields!r}")
        self.calibration = cal._replace(overhead_ns=min(int(cal.overhead_ns), MAX_OVERHEAD_NS))
        self.native_stamps = request.get("native_stamps") is True
        return {}

    def _take_report(self, role: _Role, request: dict[str, Any], arrived_s: float) -> str | None:
        """Record the previous call's report and the role's op counts; a reason if they do not add up."""
        stamps = request.get("stamps") or []
        if self.native_stamps and not role.calls and stamps:
            return "native stamps of a timed call arrived before the role's first call was asked for"
        if role.calls:
            prev = role.calls[-1]
            ms = request.get("ms")
            if self.calibration is not None:  # the call's time from its raw measurements (`_calibrated`)
                raw: list[Any] = [request.get(k) for k in ("span_ms", "read_ns", "dense", "strided")]
                if self.native_stamps:
                    stamped = native_raw(stamps)
                    if isinstance(stamped, str):
                        return f"call {len(role.calls) - 1}: {stamped}"
                    raw = stamped
                if not all(_finite(v) and v >= 0 for v in raw):
                    return f"call {len(role.calls) - 1} reported invalid measurements {raw!r}"
                dense, strided = int(raw[2]), int(raw[3])
                if self.max_close_elements is not None:
                    most, most_strided = self.max_close_elements
                    strided = min(strided, most_strided)
                    dense = min(dense, most - strided)
                ms = call_ms_from(self.calibration, float(raw[0]), int(raw[1]), dense, strided)
                prev.span_ms = float(raw[0])
            if not isinstance(ms, (int, float)) or isinstance(ms, bool) or not math.isfinite(ms) or ms < 0:
                return f"call {len(role.calls) - 1} reported an invalid time {ms!r}"
            prev.ms = float(ms)
            host = request.get("host_ms")
            if isinstance(host, (int, float)) and not isinstance(host, bool) and math.isfinite(host):
                prev.host_ms = float(host)
            wall_ms = (arrived_s - prev.asked_s) * 1e3
            if wall_ms < prev.idle_ms:  # the worker gets the gap after `asked_s` and idles it before the call
                return (f"call {len(role.calls) - 1} was reported {wall_ms:.3f} ms after it was asked for, before its "
                        f"{prev.idle_ms:.3f} ms idle gap could end (server mode)")
            prev.wall_ms = wall_ms - prev.idle_ms
        ops = request.get("ops") or {}
        if not isinstance(ops, dict) or not all(isinstance(v, int) for v in ops.values()):
            return "the op counts reported are malformed"
        if any(ops.get(k, 0) < v for k, v in role.ops.items()):
            return "the op counts went down between calls (the op counter was reset or forged)"
        role.ops = {str(k): int(v) for k, v in ops.items()}
        return None

    def _plan_next(self, role: _Role, now_s: float) -> bool:
        """Plan the timed calls (how many at most) once warm-up is over; True when the role is done."""
        cfg = self.cfg
        if role.timed_from is None:
            model = [c for c in role.calls if not c.probe]
            elapsed_ms = (now_s - role.calls[0].asked_s) * 1e3 if role.calls else 0.0
            if len(model) < max(cfg.warmup_calls, 1) or (elapsed_ms < cfg.warmup_ms and len(model) < cfg.max_calls):
                return False
            walls = [c.wall_ms for c in model[len(model) // 2:] if c.wall_ms is not None]
            per_call = statistics.median(walls) if walls else 1.0
            role.timed_from = len(role.calls)
            role.timed_n = max(cfg.min_calls, min(cfg.max_calls, math.ceil(cfg.target_ms / max(per_call, 1e-6))))
        timed = [c for c in role.calls[role.timed_from:] if not c.probe]
        if len(timed) >= role.timed_n:
            role.stopped_by = "length"
        elif cfg.stop == "precision" and self._precise(timed, now_s):
            role.stopped_by = "precision"
        return role.stopped_by is not None

    def _precise(self, timed: list[Call], now_s: float) -> bool:
        """Whether the timed calls so far (every one reported) pass the floors and their median's
        confidence interval lies within `precision_rel` of it."""
        cfg = self.cfg
        if len(timed) < max(cfg.min_calls, 1) or (now_s - timed[0].asked_s) * 1e3 < cfg.min_timed_ms:
            return False
        times = sorted(c.ms for c in timed if c.ms is not None)
        if len(times) < len(timed):
            return False
        rel = median_ci_rel(times, statistics.median(times), cfg.precision_confidence)
        return rel is not None and rel <= cfg.precision_rel

    # -- results -----------------------------------------------------------------------------
    def timed(self, role: str, probes: bool = False) -> list[Call]:
        """The role's timed calls (warm-up excluded), each with its reported time; or, with
        `probes`, the probes made among them."""
        r = self._roles.get(role)
        if r is None or r.timed_from is None or not r.stopped:
            return []
        return [c for c in r.calls[r.timed_from:] if c.probe == probes]

    def timeline(self, role: str) -> dict[str, float]:
        """Where the role's loop went on the parent's clock (diagnostics, seconds): its warm-up (first
        call asked to first timed call asked), its timed calls (to the stop), and how many calls of
        each kind were made."""
        r = self._roles.get(role)
        if r is None or r.timed_from is None or not r.calls or not r.stopped:
            return {}
        first, last = r.calls[r.timed_from].asked_s, r.calls[-1]
        end = last.asked_s + (last.wall_ms or 0.0) / 1e3
        return {"warmup_s": first - r.calls[0].asked_s, "timed_s": end - first,
                "warmup_calls": float(r.timed_from), "timed_calls": float(len(r.calls) - r.timed_from)}

    def calls(self, role: str) -> list[Call]:
        """Every call of the role so far, warm-up and probes included, in order."""
        r = self._roles.get(role)
        return list(r.calls) if r is not None else []

    def times_ms(self, role: str) -> list[float]:
        return [c.ms for c in self.timed(role) if c.ms is not None]

    def stopped_by(self, role: str) -> str | None:
        """Why the role's timed loop ended: "length" (the planned number of calls, the fixed
        rule's or the ceiling of "precision") or "precision" (its median known closely enough);
        None before it ended."""
        r = self._roles.get(role)
        return r.stopped_by if r is not None and r.stopped else None

    def late_launches(self, role: str) -> tuple[int, float | None]:
        """How many of the role's timed calls took the host longer than the launch window to
        launch (their times hold that excess host work), and the median host span in ms; as the
        worker reported them (diagnostic: the bound on the times is `clock_gap_ms`)."""
        spans = [c.host_ms for c in self.timed(role) if c.host_ms is not None]
        window_ms = self.cfg.launch_window_us / 1e3
        return sum(s > window_ms for s in spans), (statistics.median(spans) if spans else None)

    def ops(self, role: str) -> dict[str, int]:
        """The cumulative op counts of the role's calls (warm-up and timed), as last reported."""
        r = self._roles.get(role)
        return dict(r.ops) if r else {}

    def loop_overhead_ms(self, role: str, probes: bool = False) -> float | None:
        """Median over the role's timed calls (or its probes) of the parent's wall time less the
        reported time."""
        gaps = [c.wall_ms - c.ms for c in self.timed(role, probes) if c.wall_ms is not None and c.ms is not None]
        return statistics.median(gaps) if gaps else None

    def clock_gap_ms(self, role: str) -> float | None:
        """How much more of the parent's clock the role's timed calls took than its probes,
        beyond what the worker reported (median, ms per call); about 0 for honest reports, and
        an under-reported time shows up in full. None without both."""
        probes, own = self.loop_overhead_ms(role, probes=True), self.loop_overhead_ms(role)
        return None if probes is None or own is None else own - probes

    def recheck_sample(self, role: str, k: int) -> list[tuple[int, int]]:
        """`k` of the role's timed calls drawn at random by the parent: (call index, seed).

        Half of them (rounded up) from the calls whose input buffers an earlier call already used
        (call i uses set i mod the worker's sets, at most `cfg.input_sets`), where there are
        enough: a result replayed by buffer can only come back there, and with 16 sets a slow
        call's loop may have few such calls (the CPU target: a replay keyed on the input pointers
        escaped 6 draws from all the calls). The rest from every timed call: drawn from those
        alone, the first `input_sets` calls were never re-checked, and red team 22's candidate
        returned nothing from them (a 25 ms warm-up call moved the timed calls up to them)."""
        r = self._roles.get(role)
        if r is None or r.timed_from is None or not r.stopped:
            return []
        model = [i for i in range(r.timed_from, len(r.calls)) if not r.calls[i].probe]
        reused = [i for i in model if i >= self.cfg.input_sets]
        draw = secrets.SystemRandom()
        picked = draw.sample(reused, (k + 1) // 2) if len(reused) >= (k + 1) // 2 else []
        rest = [i for i in model if i not in picked]
        picked += draw.sample(rest, min(k - len(picked), len(rest)))
        return sorted((i, r.calls[i].seed) for i in picked)

    def projection_sample(self, role: str, picks: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
        """Up to `n` of the role's timed model calls beside `picks` (`recheck_sample`'s), drawn at
        random by the parent, whose projections alone are re-checked: every one of them where
        the loop has no more, so that no call of a short loop (the CPU target's) goes unchecked."""
        r = self._roles.get(role)
        if r is None or r.timed_from is None or not r.stopped:
            return []
        taken = {i for i, _ in picks}
        rest = [i for i in range(r.timed_from, len(r.calls)) if not r.calls[i].probe and i not in taken]
        drawn = secrets.SystemRandom().sample(rest, min(max(n - len(picks), 0), len(rest)))
        return sorted((i, r.calls[i].seed) for i in drawn)


def _finite(v: Any) -> bool:
    """Whether `v` is a finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
