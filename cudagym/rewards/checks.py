"""The checks a job's outcome must pass once its worker has returned: named, in one list.

A worker reports; the evaluator judges, in its own process, with its own copy of the rules.
`PROFILE_CHECKS` is the list a profile job's outcome goes through (`Evaluator` applies it in
order): each check is a small function of the `TimedRun` whose docstring says what it refuses
and why. The first `Refusal` decides the verdict; a `Note` describes a profile that stands.

Also here, shared with verify: `outcome_failure` (what any worker's outcome says went wrong) and
`Audit` (the audit of the candidate's build and of the kernel records its worker reported).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

from pydantic import TypeAdapter

from cudagym.core.audit import (
    Origins, foreign_kernels, foreign_work, forbidden_ops, op_counts, own_time_share, unmeasured_work,
)
from cudagym.core.verdict import AuditMode, ErrorKind, TimingStats, VerifyResult
from cudagym.rewards.compare import (calls_shaped, compare_outputs, in_comparer, projected_mismatch, projection_seeds,
                                     sampled_pairs)
from cudagym.sandbox.worker.wire import JobOutcome
from cudagym.sandbox.cpusamples import CPU_KEY, CpuOrigin
from cudagym.sandbox.feed import CallFeed
from cudagym.sandbox.jit import JitImages, jit_attribution
from cudagym.sandbox.origin import MODEL_CALLS_KEY, ImportAudit, candidate_objects, import_audit, records_from_counts
from cudagym.sandbox.protocol import TimingConfig, VerifyConfig
from cudagym.tasks.model import Target, Task

_KIND = {k.value: k for k in ErrorKind}
_COUNT = TypeAdapter(int)  # a count the worker reported, read as `ProfileResult`'s fields read it
FORBIDDEN_IMPORTS = ("strict mode: your built code imports what strict mode forbids (torch's compute below the "
                     "dispatcher, run-time symbol lookup, RecordFunction's switches): ")
UNBUILT_CODE = ("ModelNew ran native code the harness did not build from your sources (generated or built at run "
                "time, e.g. torch.compile's C++ kernels): ")
# a profile's unbuilt files among its timed calls' counts (`TimedRun.timed_ops`): no op, no kernel record
UNBUILT_KEY = "kernel\tunbuilt\t"
# CPU target, strict mode: foreign code (torch's compute, any other library's) may take this much
# of forward's sampled CPU time (`cudagym.sandbox.cpusamples`) before it is refused: at least
# `CPU_FOREIGN_MIN_SAMPLES` samples, `CPU_FOREIGN_SHARE` of forward's, or `CPU_FOREIGN_US_PER_CALL`
# per call (torch's dispatch and allocation around an own kernel: a few µs per call). The floor is
# the count's grain: an honest tiny kernel's timed calls (tests/assets/row_sum_sorted: ~35 calls of
# 100 µs around a `torch.empty`, with the evidence's own allocations in each window) drew 2 to 4
# one-sample dispatcher symbols (computeStride, globalContext, a PLT stub) per run at 1 ms samples,
# and 4 refused them; foreign compute worth having is dozens of samples
CPU_FOREIGN_MIN_SAMPLES, CPU_FOREIGN_SHARE, CPU_FOREIGN_US_PER_CALL = 6, 0.05, 20.0
# samples of the candidate's work between a timed job's calls that pass (a destructor of its own,
# a thread of its OpenMP runtime leaving its function as the call returns)
CPU_BETWEEN_MIN_SAMPLES = 6
# torch's compute between a timed job's calls (on the harness's threads) in functions the
# harness's own steps before the candidate loaded never fell in (`CpuOrigin.between_unknown`):
# refused beyond CPU_BETWEEN_MIN_SAMPLES samples where its steps' samples make that many unlikely
# to be the harness's (the samples the steps would then have held of them: `steps_foreign` /
# `between_foreign` of these, expected; none held is e^-4 ~ 2% likely). The 13 bundled honest
# solutions read 0 or 1 such sample each (a reduction's setup), expected 0-0.9; red team 19's
# kind of hook, torch's GELU on each next input, 12 (expected 8.2)
CPU_BETWEEN_UNSEEN_EXPECTED = 4.0


def cpu_foreign_work(counts: dict[str, Any], calls: int) -> str | None:
    """Strict mode on the CPU target: why forward's sampled CPU time (`CpuOrigin`, under
    `CPU_KEY` in `counts`) shows foreign compute beyond the allowance, or None. The samples are
    the kernel's, taken out of the candidate's process, so code reached below the dispatcher
    (a function pointer into libtorch called with ctypes) is seen where it runs. `calls`: the
    forward calls the worker made, which its reported windows must match."""
    origin = CpuOrigin.from_counts(counts)
    if origin is None or origin.error:
        return None  # not sampled (off, another backend) or the host refuses sampling: `cpu_origin_note`
    if origin.tamper:
        return "the marks of forward's calls on the worker's pipe are not the harness's: " + origin.tamper
    if origin.windows < calls:
        return (f"the worker marked {origin.windows} forward calls of the {calls} it made (the CPU samples of "
                "forward cannot be told from the harness's)")
    unseen = origin.unseen_ns / max(origin.period_ns, 1)
    foreign = sum(origin.foreign.values()) + origin.lost + round(unseen)
    allowed = max(CPU_FOREIGN_MIN_SAMPLES, CPU_FOREIGN_SHARE * (origin.forward + unseen),
                  calls * CPU_FOREIGN_US_PER_CALL * 1e3 / max(origin.period_ns, 1))
    if foreign <= allowed:
        return None
    top = "; ".join(f"{k} ({v})" for k, v in origin.foreign.most_common(4))
    lost = f"; {origin.lost} samples lost" if origin.lost else ""
    unseen_why = (f"; {origin.unseen_threads} threads started and ended inside calls ran "
                  f"{origin.unseen_ns / 1e6:.1f} ms too briefly to be sampled (whose code they ran cannot be "
                  "told: keep worker threads alive across calls)") if origin.unseen_ns and unseen >= 1 else ""
    total = origin.forward + round(unseen)
    return (f"ModelNew.forward ran code that is not your own for {foreign / max(total, 1):.0%} of its "
            f"sampled CPU time ({foreign} of {total} samples, every {origin.period_ns / 1e3:.0f} µs): "
            f"{top}{lost}{unseen_why}")


# a timed call's window (`windows_from_marks`) must last at least this share of the call's measured
# time, less this slack (a window that ends before its call did was ended by marks that are not the
# harness's); at most CPU_SHORT_WINDOWS of the calls (a loaded host's preempted close) may fall short
CPU_WINDOW_SHARE, CPU_WINDOW_SLACK_US, CPU_SHORT_WINDOWS = 0.9, 50.0, 0.1


def cpu_windows_cover(windows: list[list[int]], calls: list[tuple[float | None, bool]]) -> str | None:
    """CPU target: why the sampled windows of a job's timed calls (`windows`: each one's length
    in µs on the evaluator's clock, in the order of the calls) are shorter than the calls they
    stand for (`calls`: each call's measured time in ms, or None, and whether it was a probe of
    the harness's), or None. Red team 11's a1 ended every window where it began (a replaced
    clock), its b1 and b2 hid the harness's end marks and wrote their own right after forward
    began: torch's compute after each window went unsampled."""
    if not windows or not calls:
        return None
    if len(windows) != len(calls):
        return f"the worker marked {len(windows)} timed calls of the {len(calls)} it made"
    model = [(w[0], ms) for w, (ms, probe) in zip(windows, calls, strict=True) if not probe and ms is not None]
    short = [(w, ms) for w, ms in model if w < CPU_WINDOW_SHARE * ms * 1e3 - CPU_WINDOW_SLACK_US]
    if len(short) <= CPU_SHORT_WINDOWS * len(model):
        return None
    w, ms = short[len(short) // 2]
    return (f"{len(short)} of {len(model)} timed calls were marked as running for less than they took by the "
            f"evaluator's clock (e.g. {w} µs for a call measured at {ms:.3f} ms): the marks that end them are "
            "not the harness's")


# a timed call's window (from the worker's "forward" mark to its "returned" mark, on the evaluator's
# clock) holds the call's raw interval (the close and the evidence are inside it) and around it
# only the marks' passage (the worker waits for the parent to have each one): of the calls at or
# below the median time, the median one may exceed its call's raw interval by this much and this
# share of the median. Honest, on a 2-core host loaded by a test run: 200-650 µs (the median of 5;
# once 1.57 ms), single calls up to 3.7 ms. The closest one, the rule until red team 23, let one
# call cut within it carry every other's forged cut (+3 strict)
CPU_WINDOW_EXCESS_US, CPU_WINDOW_EXCESS_SHARE = 2500.0, 0.05
# ... and passes only within this much and the same share: what the hand-overs take on a host with
# CPUs to spare (honest medians 330-610 µs on the 2-core host beside one other check). Between it
# and the allowance above the host was too busy to time on (`CPU_HOST_BUSY`): red team 28 reported
# 2 ms calls at 0.35x their time within the 2.5 ms (+3 strict), which now costs the speed milestones
CPU_WINDOW_PASS_US = 750.0
# ... or within this much above the same job's probes (the harness's tiny kernel through the same
# hand-overs, every `feed.PROBE_EVERY`th call), whichever is more, up to the allowance: the
# hand-overs' cost on the host as it is. Session 29, the CI host class (2 cores, a VM whose memory
# a daemon reclaims): honest medians 0.77-2.06 ms, 0.9-1.6 ms on an idle host, the probes' 0.46-1.38
# ms beside them; the candidate's less the probes' 0.14-0.68 ms (its calls leave the caches colder).
# A probe's own interval is a few µs, so a forged report of it moves its excess by no more; what
# stretches a probe's hand-overs is code of the candidate's run inside its window (red team 30's a18
# slept 1.5 ms in each probe's, from the answers' reader), so the bound the probes set stops at
# CPU_PROBE_CAP_US: 0.25 ms above the quiet host's probes' bound, where the honest CI host's sits
CPU_PROBE_MARGIN_US, CPU_PROBE_CAP_US = 750.0, 1500.0
CPU_HOST_BUSY = "the host's CPUs were busy"  # how `cpu_windows_tight`'s reason starts when the waits explain it


def cpu_windows_tight(windows: list[list[int]], calls: list[tuple[float | None, bool]], spans: list[float | None],
                      timed: list[bool], made: list[int] | None = None, waited: list[int] | None = None) -> str | None:
    """CPU target: why the timed calls at or below the median time (what the reward reads) were
    reported shorter than the evaluator's own clock saw them run (`windows` as
    `cpu_windows_cover`'s; `spans`: each call's raw interval, ms, whose time is computed from it;
    `made`: the harness's time in each window before the call could start, µs, from its open to
    the worker's resume once the maker wrote the inputs, `cudagym.sandbox.makerlink`), or None.
    The worker measures and reports each call; a candidate that rewrote the report (red team 20's
    b scaled it by 0.65 on the wire) cannot move the marks' arrivals here, which bound the call
    from outside its process. A forger gains only where the calls the reward reads are forged, so
    their median is held.
    An excess over what the hand-overs take (`CPU_WINDOW_PASS_US`, or the job's probes' excess
    and `CPU_PROBE_MARGIN_US`: the harness's own calls through the same steps, whichever is more)
    but within the allowance is a host too busy to time on (`CPU_HOST_BUSY`, the reason's start):
    no speed milestone. `waited`, each window's time (µs) the harness's processes waited for a CPU (the kernel's
    run-queue delay: `MakerLink.waited_s`), only tells why beyond that: when the excess less that time is
    within the allowance, the host was too busy to time on as well,
    which costs the speed milestones and never passes a call (session 27: in CI, sixteen episodes
    through two device actors on two cores stretched honest windows by 5-150 ms, all of it waiting
    for a CPU)."""
    if len(spans) != len(calls):
        return None
    picked = [i for i in _fast_indices(calls, timed) if i < len(windows) and spans[i] is not None]
    if len(picked) < 3 or len(windows) != len(calls):
        return None
    made = made if made is not None and len(made) == len(calls) else [0] * len(calls)
    excess = [windows[i][0] - float(spans[i] or 0.0) * 1e3 - made[i] for i in picked]
    median = statistics.median(float(calls[i][0] or 0.0) for i in picked) * 1e3
    allowed = CPU_WINDOW_EXCESS_US + CPU_WINDOW_EXCESS_SHARE * median
    probes = [windows[i][0] - float(spans[i] or 0.0) * 1e3 - made[i]
              for i, (ms, probe) in enumerate(calls) if probe and ms is not None and spans[i] is not None]
    handovers = statistics.median(probes) if probes else 0.0
    passed = max(CPU_WINDOW_PASS_US, min(handovers + CPU_PROBE_MARGIN_US, CPU_PROBE_CAP_US)) \
        + CPU_WINDOW_EXCESS_SHARE * median
    if statistics.median(excess) <= passed:
        return None
    why = (f"the {len(picked)} timed calls at or below the median time ran {statistics.median(excess) / 1e3:.3f} ms "
           f"longer (median) by the evaluator's own clock than their reported intervals (allowed {allowed / 1e3:.3f} "
           f"ms; median reported time {median / 1e3:.3f} ms)")
    if statistics.median(excess) <= allowed:
        return (f"{CPU_HOST_BUSY}: {why}, more than the hand-overs take on this host "
                f"({passed / 1e3:.3f} ms; the job's {len(probes)} probes: {handovers / 1e3:.3f} ms): timed on a "
                "quieter host, or reported shorter than they ran")
    if waited is not None and len(waited) == len(calls):
        left = statistics.median(e - waited[i] for e, i in zip(excess, picked, strict=True))
        if left <= allowed:
            return (f"{CPU_HOST_BUSY}: {why}, and the worker and the evaluator waited for a CPU "
                    f"{statistics.median(waited[i] for i in picked) / 1e3:.3f} ms (median) of each: the host was too "
                    "busy to time on (fewer concurrent jobs, or a quieter host)")
    return f"{why}: the reported times are not the calls'"


def cpu_fast_calls_foreign(windows: list[list[int]], calls: list[tuple[float | None, bool]], timed: list[bool],
                           period_ns: int) -> str | None:
    """CPU target, strict: why the timed calls at or below the median time (what the reward
    reads) ran foreign code beyond the allowance (`cpu_foreign_work`'s, over their windows'
    samples alone: `windows` as `cpu_windows_cover`'s with each window's samples and foreign
    ones; `timed`: whether each call was a timed one), or None. Red team 12's a6 ran own code
    for 100 ms in each warm-up call, which hid torch's GELU in every timed call below 5% of all
    of forward's samples; slow calls padded with own code dilute the same way."""
    fast = [w for w, _ in _fast_calls(windows, calls, timed)]
    if not fast:
        return None
    n, foreign = sum(w[1] for w in fast), sum(w[2] for w in fast)
    allowed = max(CPU_FOREIGN_MIN_SAMPLES, CPU_FOREIGN_SHARE * n,
                  len(fast) * CPU_FOREIGN_US_PER_CALL * 1e3 / max(period_ns, 1))
    if foreign <= allowed:
        return None
    return (f"in the {len(fast)} timed calls at or below the median time, ModelNew.forward ran code that is not "
            f"your own for {foreign / max(n, 1):.0%} of their sampled CPU time ({foreign} of {n} samples)")


# the wall time the kernel's samples leave room for in the timed calls at or below the median (what
# the reward reads) may exceed their reported times by this share, this much per call (the harness's
# own steps inside each window: the mark's reply, the close, the evidence, the checks before the
# next request) and the samples' grain: two samples, and three standard deviations of a sum of one
# rounding per call (at most half a sample's standard deviation each)
CPU_TIME_SHARE, CPU_TIME_SLACK_US = 1.25, 400.0  # 150 until session 24's per-report checks (`reclassed`
# cold after a call: ~1.6 ms on a loaded host) sat inside each span and refused honest calls (CI49);
# the spans end before those checks since session 25 (the "returned" mark): 150 may hold again, unmeasured
# the wall time between a call's first and last samples of the candidate's work lies inside the
# call's interval, which its reported time holds less the timer's calibrated overhead (a few µs):
# this much per call beside it
CPU_SPREAD_SLACK_US = 30.0


def _fast_indices(calls: list[tuple[float | None, bool]], timed: list[bool]) -> list[int]:
    """Which calls are the timed model calls at or below the median time."""
    if len(timed) != len(calls):
        return []
    picked = [i for i, ((ms, probe), t) in enumerate(zip(calls, timed, strict=True))
              if t and not probe and ms is not None]
    if not picked:
        return []
    median = statistics.median(calls[i][0] for i in picked)  # type: ignore[type-var]
    return [i for i in picked if calls[i][0] <= median]  # type: ignore[operator]


def _fast_calls(windows: list[list[Any]], calls: list[tuple[float | None, bool]],
                timed: list[bool]) -> list[tuple[list[Any], float]]:
    """The timed model calls at or below the median time, each with its window."""
    if not windows or len(windows) != len(calls):
        return []
    return [(windows[i], float(calls[i][0] or 0.0)) for i in _fast_indices(calls, timed)]


def cpu_times_sampled(windows: list[list[Any]], calls: list[tuple[float | None, bool]], timed: list[bool],
                      period_ns: int, lost: int = 0, spans: list[float | None] | None = None) -> str | None:
    """CPU target: why the timed calls at or below the median time were reported faster than
    the kernel's samples of the worker allow (`windows` as `cpu_windows_cover`'s, each with the
    least wall time its samples leave room for, µs: `CpuOrigin.least_wall_ns`), or None. The
    samples are taken by the kernel, out of the candidate's reach: a thread's sampled CPU time
    is a floor on the call's wall time whatever the worker reports. Native code can rewrite
    what a CPU call reports (the times are the worker's own); this bounds what that gains.
    Samples the kernel `lost` (its ring buffer full: a flood of mapping records) count as
    though taken in these calls. First, where the windows carry it, the wall time between each
    call's first and last samples of the candidate's work (`CpuOrigin.work_spread_ns`): the work
    lasted that long whatever the load (the CPU time shrinks with it: a host loaded threefold
    leaves a forger two thirds of each call to hide). It is held to each call's whole measured
    interval where `spans` gives it (ms, the worker's raw span: the call's time adds back what the
    calibration leaves out of it, an estimate that a loaded host can make too large)."""
    fast = _fast_calls(windows, calls, timed)
    if not fast or period_ns <= 0 or any(len(w) < 4 for w, _ in fast):
        return None
    reported = sum(ms for _, ms in fast) * 1e3
    called = f"the {len(fast)} timed calls at or below the median time were reported at {reported / 1e3:.3f} ms in all"
    # the spread: load-independent (a waiting thread stretches the call and its samples' times alike)
    if all(len(w) >= 5 for w, _ in fast):
        spread = sum(w[4] for w, _ in fast)
        interval = reported
        if spans is not None and len(spans) == len(calls):
            picked = [spans[i] for i in _fast_indices(calls, timed)]
            if all(isinstance(v, (int, float)) for v in picked):
                interval = max(reported, sum(float(v) for v in picked if v is not None) * 1e3)
        if spread > (allowed := interval + len(fast) * CPU_SPREAD_SLACK_US):
            return (f"{called}, but the kernel sampled the candidate's work in them over {spread / 1e3:.3f} ms of "
                    f"wall time from first to last sample (allowed {allowed / 1e3:.3f} ms): the reported times are "
                    "not the calls'")
    least = sum(w[3] for w, _ in fast) + lost * period_ns / 1e3
    period = period_ns / 1e3
    allowed = CPU_TIME_SHARE * reported + len(fast) * CPU_TIME_SLACK_US + (2 + 1.5 * len(fast) ** 0.5) * period
    if least <= allowed:
        return None
    return (f"{called}, but the kernel sampled the worker's threads for at least {least / 1e3:.3f} ms of wall time "
            f"in them (allowed {allowed / 1e3:.3f} ms): the reported times are not the calls'")


def cpu_work_between_calls(counts: dict[str, Any]) -> str | None:
    """CPU target: why the samples between a timed job's calls show the candidate's work there
    (`CpuOrigin.between`: its own code on any thread, anything on a thread its code started;
    beyond `CPU_BETWEEN_MIN_SAMPLES`), or None. A thread of its own that computes the next
    call's output while the harness makes the inputs and opens the interval (it reached them
    through a frame saved from forward, or the allocator) leaves the call little to time. Then
    torch's compute on the harness's own threads in functions its own steps there never run
    (`CpuOrigin.between_unknown`; see `CPU_BETWEEN_UNSEEN_EXPECTED`): the candidate's Python,
    run from a read of the harness's it hijacked, computing the next output with torch (red team
    19's a-d: the next seed read in a `json.loads` of its own, an input buffer's own `copy_`)."""
    origin = CpuOrigin.from_counts(counts)
    if origin is None:
        return None
    if origin.between > CPU_BETWEEN_MIN_SAMPLES:
        where = "; ".join(f"{k} ({v})" for k, v in origin.between_code.most_common(4))
        return (f"the candidate's code ran between the timed calls, outside the intervals they are timed in "
                f"({origin.between} samples, every {origin.period_ns / 1e3:.0f} µs of CPU time): {where}")
    unseen = origin.unknown_total
    if unseen > CPU_BETWEEN_MIN_SAMPLES and \
            unseen * origin.steps_foreign >= CPU_BETWEEN_UNSEEN_EXPECTED * max(origin.between_foreign, 1):
        where = "; ".join(f"{k} ({v})" for k, v in origin.between_unknown.most_common(3))
        return (f"torch's compute (or another library's) ran between the timed calls, outside the intervals they are "
                f"timed in, in functions the harness's own steps there (the next inputs, the cache flush) never ran: "
                f"{unseen} of the {origin.between_foreign} samples of compute between the calls (its steps before the "
                f"candidate loaded: {origin.steps_foreign}): {where}")
    return None


def cpu_origin_note(counts: dict[str, Any]) -> str | None:
    """Why forward's CPU time could not be sampled, where it could not (a note, not a refusal:
    the host's `kernel.perf_event_paranoid` decides, not the candidate)."""
    origin = CpuOrigin.from_counts(counts)
    if origin is not None and not origin.error:
        return None
    return ("the CPU-origin audit could not run (torch's compute reached below the dispatcher is not seen): "
            + (origin.error if origin is not None else "this sandbox does not sample forward's CPU time (the docker "
               "backend, or the local one with cpu_sample_us 0)"))


def unbuilt_files(final: dict[str, Any]) -> list[str]:
    """The files of native code the harness did not build that a worker reported it had mapped
    executable (`cudagym.sandbox.worker.verify.unbuilt_code`: verify's and the profile's workers)."""
    return [str(p) for p in final.get("unbuilt_code") or []]


def outcome_failure(o: JobOutcome, what: str) -> tuple[ErrorKind, str] | None:
    """The failure an outcome describes, or None if the worker reported a result."""
    if o.device_busy:
        return ErrorKind.DEVICE_BUSY, f"{what}: device_busy: {o.device_busy}"
    if o.channel_error:
        return ErrorKind.TAMPER, f"{what}: {o.channel_error}"
    if o.memory_exceeded:
        return ErrorKind.MEMORY, f"{what}: the worker exceeded its memory limit and was killed"
    if o.timed_out:
        return ErrorKind.TIMEOUT, f"{what}: timed out and was killed"
    if o.final is None:
        if o.process_limited:
            return ErrorKind.PROCESS_LIMIT, f"{what}: the process limit was hit and the worker was killed"
        sig = -o.returncode if o.returncode and o.returncode < 0 else None
        tail = "\n".join(o.output.strip().splitlines()[-15:])
        how = f" (signal {sig})" if sig else f" (exit {o.returncode})"
        return ErrorKind.CRASH, f"{what}: the worker crashed" + how + (f"\n{tail}" if tail else "")
    if not o.final.get("ok"):
        kind = _KIND.get(str(o.final.get("kind")), ErrorKind.EXCEPTION)
        if o.process_limited and kind in (ErrorKind.EXCEPTION, ErrorKind.CRASH):
            kind = ErrorKind.PROCESS_LIMIT
        return kind, str(o.final.get("error", "failed"))
    return None


_RELEASER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cudagym-release")


def release_later(*outcomes: JobOutcome) -> None:
    """Drop the outcomes' output bytes on a background thread: unmapping hundreds of MB of
    result memory takes a while, and nothing waits for it."""
    held = [o.tensors for o in outcomes]
    for o in outcomes:
        o.tensors = []
    _RELEASER.submit(held.clear)


# -- the audit of the candidate's build and kernels (verify and profile) -----------------------------
class AuditSettings(Protocol):
    """What the audit reads of the evaluator's config (`EvaluatorConfig`), each time it runs."""

    mode: AuditMode
    cache_dir: Path
    verify: VerifyConfig


class Audit:
    """The audit rules (`cudagym.core.audit`) under the evaluator's mode and target, applied to
    the candidate's build artifacts and to the op counts and kernel records its worker reported."""

    def __init__(self, config: AuditSettings, target: Target) -> None:
        self.config, self.target = config, target

    def imports(self, artifact_dir: str | None, loaded: list[Any]) -> ImportAudit:
        """The imports of the candidate's build artifacts and of the cached extensions its
        worker had loaded (`loaded`: paths it reported; only those under the cache's extension
        root are read, by this process)."""
        inline_root = os.path.realpath(self.config.cache_dir / "build" / "inline")
        extra = [Path(p) for p in loaded if isinstance(p, str) and os.path.realpath(p).startswith(inline_root + "/")
                 and Path(p).is_file()]
        return import_audit(candidate_objects(([Path(artifact_dir)] if artifact_dir else []) + extra))

    def origins(self, artifact_dir: str | None, imports: ImportAudit, workspace: str | None = None,
                notes: list[str] | None = None) -> Origins:
        """The candidate's origins. In permissive mode on the GPU, with the job's `workspace`, also
        its own Triton kernels' images, read from the job's Triton cache once the job is over
        (`cudagym.sandbox.jit`, within its budget: why some got no credit unjudged goes to
        `notes`); strict mode counts no image loaded from memory. Blocking: run it off the loop."""
        found = (jit_attribution(Path(workspace)) if workspace and self.config.mode == "permissive"
                 and self.target == Target.CUDA else JitImages())
        if found.unattributed and notes is not None:
            notes.append("permissive mode: " + found.unattributed)
        return Origins(own_roots=tuple(r for r in (artifact_dir, str(self.config.cache_dir / "build" / "inline")) if r),
                       libraries=frozenset(imports.libraries), own_images=found.digests)

    def kernels(self, final: dict[str, Any], artifact_dir: str | None, workspace: str | None = None,
                notes: list[str] | None = None) -> tuple[list[str], list[str], float | None]:
        """Verify's kernel-origin and import rules (GPU: every kernel of every trial by origin;
        both targets: the imports of the extensions it loaded, and native code the harness did
        not build): (forbidden, reasons, share). `share`: the own-kernel share this process
        decides (GPU: by origin; CPU: `uncredited_share`), or None to keep the worker's. `notes`
        gets facts that fail nothing by themselves (`origins`). Blocking: run it off the loop."""
        imports = self.imports(artifact_dir, list(final.get("own_objects") or []))
        forbidden: list[str] = []
        reasons: list[str] = []
        if imports.hooks:  # either mode: code of its own run inside the harness's Python, between its steps
            forbidden += [s for s, _ in imports.hooks]
            reasons.append("the candidate's objects import the interpreter's hooks, which run code inside the "
                           "harness's Python between its steps (outside the timed calls): "
                           + "; ".join(f"{s} (imported by {f})" for s, f in imports.hooks[:6]))
        if self.config.mode == "strict" and imports.forbidden:
            forbidden += [s for s, _, _ in imports.forbidden]
            reasons.append(FORBIDDEN_IMPORTS + "; ".join(imports.reasons()))
        unbuilt = unbuilt_files(final)
        if self.config.mode == "strict" and unbuilt:
            forbidden += unbuilt
            reasons.append("strict mode: " + UNBUILT_CODE + "; ".join(unbuilt[:4]))
        if self.target != Target.CUDA:
            cpu = final.get("cpu_origin") or {}
            if self.config.mode == "strict" and (why := cpu_foreign_work(cpu, _COUNT.validate_python(
                    final.get("trials") or 0))):
                forbidden.append("<foreign CPU code>")
                reasons.append("strict mode: " + why)
            if notes is not None and self.config.mode == "strict" and (note := cpu_origin_note(cpu)):
                notes.append(note)
            if self.config.mode == "permissive" and unbuilt:
                uncredited, uncredited_why = self.uncredited_share(unbuilt)
                return forbidden, reasons + uncredited_why, uncredited
            return forbidden, reasons, None
        if final.get("kernels") is None:
            why = final.get("kernel_watch_error") or "no kernel records came back"
            return forbidden + ["<kernel watcher>"], reasons + [f"the kernel-origin audit could not run: {why}"], None
        origins = self.origins(artifact_dir, imports, workspace, notes)
        records = records_from_counts(final.get("kernels") or {})
        share = None
        if self.config.mode == "strict":
            foreign = foreign_kernels(records, origins)
            if foreign:
                forbidden += foreign
                reasons.append("strict mode: ModelNew.forward launched kernels that are not your own: "
                               + "; ".join(foreign[:6]) + (f" and {len(foreign) - 6} more" if len(foreign) > 6 else ""))
        elif final.get("share_kernels") is not None:
            share = own_time_share(records_from_counts(final["share_kernels"]), origins)
            if not share:  # the measured call came back without timed records: the trials' launches, in threads
                share = own_time_share(records, origins)
        return forbidden, reasons, share

    def uncredited_share(self, unbuilt: list[str]) -> tuple[float, list[str]]:
        """Permissive mode on the CPU target, where native code the harness did not build ran
        (`unbuilt`): the own-kernel share (0), and why it fails where the mode asks for any.

        On the CPU the share is what torch's ops leave of the reference's work (the worker's
        `own_kernel_share`, in elements): all compute outside torch's ops counts as the
        candidate's. With no kernel records there, its own built code and code generated or
        built at run time (inductor's C++ kernels, a library compiled or copied into the
        workspace, a memfd image) are one unmeasured remainder. That code is not the
        candidate's own work (on a GPU the kernel-origin audit counts inductor's kernels as
        foreign), and nothing tells how much of the remainder it did: so none of it is
        credited, as though it did all of it. Such code is not refused as such: permissive mode
        admits foreign work, and with `min_own_share` 0 a forward of it passes as one of torch's
        ops would; above 0 the reason names the files. The timed calls are held to the same
        (`timed_calls`): where verify credited a share, unbuilt code in them is refused."""
        need = self.config.verify.min_own_share
        if need <= 0:
            return 0.0, []
        return 0.0, [f"permissive mode: {UNBUILT_CODE}{'; '.join(unbuilt[:4])}; on the CPU target its work cannot "
                     f"be told from your own kernels', so none of the work outside torch's ops counts as yours "
                     f"(own-kernel share 0%, needs >= {need:.0%})"]

    def timed_calls(self, timed_ops: dict[str, int], artifact_dir: str | None,
                    measured: VerifyResult | None, workspace: str | None = None) -> str | None:
        """The audit of the timed loop's calls (warm-up included), from the counts and kernel
        records they reported and the native code the harness did not build that the job ran
        (`TimedRun.timed_ops`): strict, the op rule, that code refused and (GPU) the
        kernel-origin rule, as in verify; permissive, with `measured`, no foreign work per call
        beyond the verify trials' (torch compute ops on the CPU, foreign kernels' threads on the
        GPU), and on the CPU no such code where verify credited an own-kernel share
        (`uncredited_share`). Why it fails, or None. Blocking: run it off the loop."""
        records = records_from_counts(timed_ops)
        ops = op_counts(timed_ops)
        unbuilt = [str(k)[len(UNBUILT_KEY):] for k in timed_ops if str(k).startswith(UNBUILT_KEY)]
        if self.config.mode == "strict":
            forbidden = forbidden_ops(ops)
            if forbidden:
                return ("strict mode: during timed calls, ModelNew.forward ran torch compute ops "
                        + ", ".join(forbidden) + " (only your own kernels plus allocation/view ops are allowed)")
            if unbuilt:
                return "strict mode: during timed calls, " + UNBUILT_CODE + "; ".join(unbuilt[:4])
            if self.target != Target.CUDA and (why := cpu_foreign_work(timed_ops, int(timed_ops.get(MODEL_CALLS_KEY,
                                                                                                      0)))):
                return "strict mode: during timed calls, " + why
            if self.target == Target.CUDA:
                if not records:  # the probes among the calls launch kernels: none recorded, no watcher
                    return "the kernel-origin audit could not run in the timed calls: no kernel records came back"
                foreign = foreign_kernels(records, self.origins(artifact_dir, self.imports(artifact_dir, [])))
                if foreign:
                    return ("strict mode: during timed calls, ModelNew.forward launched kernels that are not your own: "
                            + "; ".join(foreign[:6]))
            return None
        if measured is None or measured.audit is None or not measured.trials:
            return None
        if self.target != Target.CUDA and unbuilt and (measured.audit.own_kernel_share or 0.0) > 0:
            return ("permissive mode: during timed calls, " + UNBUILT_CODE + "; ".join(unbuilt[:4])
                    + f"; verify's trials ran none and credited your own kernels with "
                      f"{measured.audit.own_kernel_share:.0%} of the work, which this code would take")
        calls = int(timed_ops.get(MODEL_CALLS_KEY, 0))
        seen = measured.audit.ops_seen
        notes: list[str] = []
        if self.target == Target.CUDA:
            origins = self.origins(artifact_dir, self.imports(artifact_dir, []), workspace, notes)
            before, after = foreign_work(records_from_counts(seen), origins), foreign_work(records, origins)
        else:
            before = {k: float(v) for k, v in op_counts(seen).items() if forbidden_ops({k: v})}
            after = {k: float(v) for k, v in ops.items() if forbidden_ops({k: v})}
        extra = unmeasured_work(before, measured.trials, after, calls)
        if extra:
            return ("permissive mode: timed calls did foreign work that verify's trials (where the own-kernel share is "
                    "measured) did not, per call: " + "; ".join(extra[:6]) + "".join(f" ({n})" for n in notes))
        return None


# -- the profile's checks -------------------------------------------------------------------------
@dataclass(frozen=True)
class Refusal:
    """A profile refused: its kind, the error text and the verdict's reason. `measured`: the
    times stand as measurements (the refusal keeps them and the notes before it)."""

    kind: ErrorKind
    error: str
    reason: str
    measured: bool = False
    clock_gap_ms: float | None = None
    by: str = ""  # the check that refused (set by `apply_checks`)


@dataclass(frozen=True)
class Note:
    """A fact about a profile that stands, for its reasons."""

    text: str


@dataclass
class TimedRun:
    """One profile job's outcome and what the checks need to judge it. `reference(**plan)` runs
    a reference-only worker on the profile's parameters for a plan of `Job` fields (trial seeds,
    scales, orders, projection seeds); `floor_ms` is the problem's roofline floor on the device."""

    task: Task
    outcome: JobOutcome
    feed: CallFeed
    timing: TimingConfig
    artifact_dir: str | None
    measured: VerifyResult | None
    audit: Audit
    reference: Callable[..., Awaitable[JobOutcome]]
    floor_ms: float = 0.0
    roofline_slack: float = 0.5
    workspace: str | None = None  # the job's workspace (its Triton cache: `Audit.origins`)

    @property
    def cuda(self) -> bool:
        return self.audit.target == Target.CUDA

    @property
    def final(self) -> dict[str, Any]:
        return self.outcome.final or {}

    @property
    def diagnostics(self) -> dict[str, Any]:
        return self.final.get("diagnostics") or {}

    @cached_property
    def timed_ops(self) -> dict[str, int]:
        """What `Audit.timed_calls` judges, here and where the profile is reused: the candidate's
        timed calls' op counts and kernel records (`CallFeed.ops`), and the native code the
        harness did not build that its worker reported at the loop's end (`UNBUILT_KEY`); the
        CPU samples' counts (`CPU_KEY`) from the sandbox's own record only, never the worker's."""
        worker = {k: v for k, v in self.feed.ops("candidate").items() if not str(k).startswith(CPU_KEY)}
        return {**worker, **{UNBUILT_KEY + f: 1 for f in unbuilt_files(self.final)},
                **{k: int(v) for k, v in (self.final.get("cpu_origin") or {}).items() if str(k).startswith(CPU_KEY)}}

    @cached_property
    def times(self) -> list[float]:
        """The candidate's timed calls (ms), as the worker reported them."""
        return self.feed.times_ms("candidate")

    @cached_property
    def stats(self) -> TimingStats:
        return TimingStats.from_samples(self.times)

    @cached_property
    def late_launches(self) -> tuple[int, float | None]:
        return self.feed.late_launches("candidate")

    @cached_property
    def clock_gap_ms(self) -> float | None:
        return self.feed.clock_gap_ms("candidate")

    @cached_property
    def close_timeouts(self) -> int:
        """Timed calls that left kernels running after the caller's stream ended (as reported)."""
        return _COUNT.validate_python(self.diagnostics.get("candidate_close_timeouts") or 0)


Finding = Refusal | Note
Check = Callable[[TimedRun], Awaitable[Finding | None]]


def _failed(kind: ErrorKind, error: str) -> Refusal:
    """A refusal before any result: the verdict's reason is the error's first line (the rest is
    the worker's output)."""
    return Refusal(kind, error, error.splitlines()[0])


async def feed_protocol(run: TimedRun) -> Finding | None:
    """Refuses a worker that broke the call feed's protocol (a call asked for out of order or
    twice, a report that does not add up, an unexpected request): the parent decides every timed
    call, so a worker that asks otherwise is tampering with the loop (`cudagym.sandbox.feed`)."""
    if run.feed.violations:
        return _failed(ErrorKind.TAMPER, "profile: " + run.feed.violations[0])
    return None


async def worker_result(run: TimedRun) -> Finding | None:
    """Refuses a job without a result: another process on the device (device_busy), a forged or
    malformed result channel (tamper), a limit hit (memory, time, processes), a crash, or the
    candidate's own error (`outcome_failure`)."""
    failure = outcome_failure(run.outcome, "profile")
    return _failed(*failure) if failure else None


async def timed_loop_ran(run: TimedRun) -> Finding | None:
    """Refuses a result with no timed call: the parent ends the loop (`stop`); a loop that ended
    before that was cut short by the candidate's process."""
    if not run.times:
        return _failed(ErrorKind.TAMPER, "profile: the timed loop ended before the evaluator stopped it")
    return None


async def timed_outputs_match(run: TimedRun) -> Finding | None:
    """Refuses timed calls whose outputs were wrong: samples of calls drawn by the parent
    (`CallFeed.recheck_sample`) are compared with a reference-only worker's outputs for the same
    seeds and parameters, and the close's projections of each whole output (the close kernel's
    on a GPU, the native close's on the CPU target) with the reference's, for those calls and up
    to `TimingConfig.recheck_projected` in all (`CallFeed.projection_sample`). A candidate
    correct in verify may compute less once timed."""
    why = await _recheck(run)
    return Refusal(why[0], why[1], why[1]) if why else None


async def _recheck(run: TimedRun) -> tuple[ErrorKind, str] | None:
    wrong = "outputs of timed calls are wrong: "
    o, task = run.outcome, run.task
    picks = run.feed.recheck_sample("candidate", run.timing.recheck_calls)
    if not picks:
        return ErrorKind.TAMPER, "no timed call could be re-checked"
    # the calls whose projections alone are compared follow the sampled ones in the reference's plan
    checked = picks + run.feed.projection_sample("candidate", picks, run.timing.recheck_projected)
    n = len(checked)
    seeds = projection_seeds(o.tensors, checked)  # the weights the close used in each checked call
    if None in seeds:
        return ErrorKind.TAMPER, f"timed call {checked[seeds.index(None)][0]} came without its projections"
    ref = await run.reference(trial_seeds=[s for _, s in checked], trial_scales=[1.0] * n,
                              trial_orders=["reference_first"] * n,
                              projection_seeds=[s or 0 for s in seeds], projected_only_from=len(picks))
    try:
        failure = outcome_failure(ref, "reference")
        if failure:
            return ErrorKind.INTERNAL, f"the reference failed while re-checking timed calls: {failure[1]}"
        try:
            pairs = await in_comparer(sampled_pairs, o.tensors, ref.tensors, picks)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:  # frames the worker should not have sent
            return ErrorKind.OUTPUT_FORMAT, f"outputs of timed calls could not be read: {e}"
        if isinstance(pairs, str):
            return ErrorKind.OUTPUT_FORMAT, wrong + pairs
        model = [i for i, c in enumerate(run.feed.calls("candidate")) if not c.probe]
        if why := await in_comparer(calls_shaped, o.tensors, ref.tensors, model):
            return ErrorKind.OUTPUT_FORMAT, wrong + why
        cmp = await in_comparer(compare_outputs, pairs, task.effective_tolerance)
        if cmp.kind is None:
            why = await in_comparer(projected_mismatch, o.tensors, ref.tensors, checked, task.effective_tolerance)
            if why:
                return ErrorKind.MISMATCH, wrong + why
    finally:
        release_later(ref)
    if cmp.kind is None:
        return None
    if cmp.kind == ErrorKind.INTERNAL.value:
        return ErrorKind.INTERNAL, "; ".join(cmp.reasons[:3])
    return ErrorKind(cmp.kind), wrong + "; ".join(cmp.reasons[:3])


async def timed_calls_audited(run: TimedRun) -> Finding | None:
    """Refuses timed calls that break the audit verify applied to its trials (`Audit.timed_calls`:
    strict, the op rule, native code the harness did not build, and the kernel-origin rule;
    permissive, foreign work per call beyond what verify's trials did, unmeasured by their
    own-kernel share): a candidate may behave differently once timed."""
    why = await asyncio.to_thread(run.audit.timed_calls, run.timed_ops, run.artifact_dir, run.measured, run.workspace)
    return Refusal(ErrorKind.AUDIT, why, why) if why else None


async def cpu_windows_audited(run: TimedRun) -> Finding | None:
    """Strict, CPU target: refuses timed calls whose sampled windows do not cover them
    (`cpu_windows_cover`) or whose calls at or below the median time ran foreign code beyond the
    allowance (`cpu_fast_calls_foreign`)."""
    if run.cuda or run.audit.config.mode != "strict" or not (windows := run.final.get("cpu_windows")):
        return None
    calls = run.feed.calls("candidate")
    timed = {id(c) for c in run.feed.timed("candidate")}
    origin = CpuOrigin.from_counts(run.timed_ops)
    why = cpu_windows_cover(windows, [(c.ms, c.probe) for c in calls]) or cpu_fast_calls_foreign(
        windows, [(c.ms, c.probe) for c in calls], [id(c) in timed for c in calls],
        origin.period_ns if origin is not None else 0)
    return Refusal(ErrorKind.AUDIT, "strict mode: during timed calls, " + why, why) if why else None


async def cpu_times_agree(run: TimedRun) -> Finding | None:
    """CPU target, either mode: refuses timed calls reported faster than the evaluator's clock
    saw them run (`cpu_windows_tight`) or than the kernel's samples of the worker's threads allow
    (`cpu_times_sampled`): forged or tampered timing."""
    if run.cuda or not (windows := run.final.get("cpu_windows")):
        return None
    calls = run.feed.calls("candidate")
    timed = {id(c) for c in run.feed.timed("candidate")}
    origin = CpuOrigin.from_counts(run.timed_ops)
    why = cpu_windows_tight(windows, [(c.ms, c.probe) for c in calls], [c.span_ms for c in calls],
                            [id(c) in timed for c in calls], run.final.get("cpu_made_us"),
                            run.final.get("cpu_waited_us"))
    if why is None or why.startswith(CPU_HOST_BUSY):  # the samples may still refuse a busy host's calls
        sampled = cpu_times_sampled(windows, [(c.ms, c.probe) for c in calls], [id(c) in timed for c in calls],
                                    origin.period_ns if origin is not None else 0,
                                    origin.lost if origin is not None else 0, [c.span_ms for c in calls])
        if why is not None and sampled is None:  # no speed milestone, never a pass
            return Refusal(ErrorKind.DEVICE_BUSY, why, why)
        why = sampled
    return Refusal(ErrorKind.TAMPER, why, why) if why else None


async def cpu_work_between(run: TimedRun) -> Finding | None:
    """CPU target, either mode: refuses a timed job in which the candidate's code ran between
    its calls (`cpu_work_between_calls`): work outside the interval the reward reads."""
    if run.cuda:
        return None
    why = cpu_work_between_calls(run.timed_ops)
    return Refusal(ErrorKind.AUDIT, why, why) if why else None


async def clock_agrees(run: TimedRun) -> Finding | None:
    """Refuses (GPU) reported call times below the pace the parent's own clock saw (the
    interval between requests holds the call), beyond the probes' overhead and the slack
    (`CallFeed.clock_gap_ms`): forged or tampered timing. The CPU target only reports the gap (a
    loaded host's honest gaps are too wide to judge: a bound of twice the median plus 5 ms refused
    an honest candidate under load in session 22, and red team 13 inflated the probes' overhead)."""
    gap, median = run.clock_gap_ms, run.stats.median_ms
    slack = run.timing.clock_slack_ms + run.timing.clock_slack_rel * median
    if gap is not None and gap > slack and run.cuda:
        why = (f"the reported call times are {gap:.4f} ms per call below what the evaluator's own clock saw "
               f"(median {median:.4f} ms reported; allowed {slack:.4f} ms): forged or tampered timing")
        return Refusal(ErrorKind.TAMPER, why, why, clock_gap_ms=gap)
    return None


async def launches_in_window(run: TimedRun) -> Finding | None:
    """Notes (GPU) that most timed calls took the host longer than the launch window to launch:
    their times include that host work (a busy host, or a forward heavy on the host)."""
    late, host_ms = run.late_launches
    if run.cuda and late * 2 > len(run.times):
        return Note(f"{late} of {len(run.times)} timed calls took the host longer than the "
                    f"{run.timing.launch_window_us / 1e3:g} ms launch window to launch (median "
                    f"{host_ms:.3f} ms): their times include that host work")
    return None


async def gate_holds_every_sm(run: TimedRun) -> Finding | None:
    """Notes that the timer's gate kernels could not fill every SM: work on a stream that does
    not wait for the caller's could then start inside the launch window, untimed."""
    if run.diagnostics.get("gate_holds_every_sm") is False:
        return Note("the timer's gate kernels cannot fill every SM of this GPU: work on a stream that does not "
                    "wait for the caller's could start inside the launch window, untimed")
    return None


async def streams_closed(run: TimedRun) -> Finding | None:
    """Notes timed calls that left kernels running after the caller's stream ended (work on a
    stream it never waits for): those were timed to the device-wide synchronize."""
    if run.close_timeouts:
        return Note(f"{run.close_timeouts} timed call(s) left kernels running over a second after the caller's "
                    "stream ended (work on a stream it never waits for): timed to the device-wide synchronize")
    return None


async def above_roofline(run: TimedRun) -> Finding | None:
    """Refuses a median below `roofline_slack` x the problem's roofline floor (its bytes at the
    device's peak bandwidth, its FLOPs at the peak rate): physically implausible. The times
    stand as measured; the verdict is IMPLAUSIBLE."""
    median, floor = run.stats.median_ms, run.floor_ms
    if floor > 0 and median < run.roofline_slack * floor:
        why = (f"implausible: {median:.4f} ms is below the roofline floor of this problem "
               f"({floor:.4f} ms at the device's peak bandwidth/FLOP rate)")
        return Refusal(ErrorKind.IMPLAUSIBLE, why, why, measured=True)
    return None


PROFILE_CHECKS: tuple[Check, ...] = (
    feed_protocol,
    worker_result,
    timed_loop_ran,
    timed_outputs_match,
    timed_calls_audited,
    cpu_windows_audited,
    cpu_work_between,
    cpu_times_agree,
    clock_agrees,
    launches_in_window,
    gate_holds_every_sm,
    streams_closed,
    above_roofline,
)
"""What a profile job's outcome goes through, in order: the first refusal decides."""


async def apply_checks(run: TimedRun, checks: tuple[Check, ...] = PROFILE_CHECKS,
                       done_s: dict[str, float] | None = None) -> tuple[Refusal | None, list[str]]:
    """Apply `checks` in order: the first refusal (None if none) and the notes before it.
    `done_s` gets each applied check's finishing time (`time.perf_counter()`), by name."""
    notes: list[str] = []
    for check in checks:
        found = await check(run)
        if done_s is not None:
            done_s[check.__name__] = time.perf_counter()
        if isinstance(found, Refusal):
            return replace(found, by=check.__name__), notes
        if found is not None:
            notes.append(found.text)
    return None, notes
