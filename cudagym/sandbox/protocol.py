"""The settings of the protocols a job runs under: correctness (`VerifyConfig`), timing
(`TimingConfig`) and the sandbox's limits (`LimitsConfig`).

Apart from the wire format (`cudagym.sandbox.worker.wire`, whose `Job` carries them) because
every layer that configures an evaluation imports them, and none of those needs the frames.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import BaseModel, Field, field_validator


# What a timer leaves out of a call (`Calibration`; the timing protocol: `cudagym.sandbox.timing`)
CALIBRATION_ELEMENTS = 1 << 18  # the fp32 output the GPU calibration's calls' close reads (and projects)
READ_SLACK_REL = 0.1  # a call's read phase is left out up to its projections' share of it plus this
# elements of each output of a timed call its close reads at random positions (all, if it has no more;
# `DeviceTimer.read_at_end`), as the parent checks a native close's evidence (`wire.native_layout`)
EVIDENCE_SAMPLES = 2048
MAX_OVERHEAD_NS = 30_000  # the most overhead a timer leaves out: a measurement above it is capped (H100: 4.3 us)
# A call's read phase is left out up to the calibration's plus this (H100: 9.5-11.2 us, calibration 10.6-11.5)
READ_SLACK_NS = 2_000
TAIL_ALLOWANCE_MS = 1.0  # the host's wake-up after the device-wide synchronize, at most (step 5)


class Calibration(NamedTuple):
    """What a timer leaves out of each call (`cudagym.sandbox.timing.DeviceTimer.calibrate`).

    Measured by the timing job's worker before any candidate code loads and sent to the parent
    then (`CallFeed`), which applies it to each call's raw interval (`call_ms_from`): a candidate
    that rewrites the worker's copy afterwards changes nothing the parent computes."""

    overhead_ns: int  # the interval of a call that launches nothing, less its read phase
    read_cap_ns: int  # the most of a call's own read phase left out of it (0: none is)
    # the cap's growth per element projected beyond CALIBRATION_ELEMENTS, contiguous (counted as
    # max(elements, bytes / 4)) and not (ps)
    read_ps_per_element: float = 0.0
    read_ps_per_strided_element: float = 0.0
    base_elements: int = CALIBRATION_ELEMENTS  # the output of the calls that measured `read_cap_ns`

    @classmethod
    def measured(cls, overhead_ns: float, read_ns: float, per_element_ps: float = 0.0,
                 per_strided_element_ps: float = 0.0, base_elements: int = CALIBRATION_ELEMENTS) -> Calibration:
        """From a calibration's medians: the overhead, at most `MAX_OVERHEAD_NS`; the read
        phase, plus `READ_SLACK_NS`, as the cap; the cap's growth per projected element, plus
        `READ_SLACK_REL`."""
        return cls(min(max(int(overhead_ns), 0), MAX_OVERHEAD_NS), max(int(read_ns), 0) + READ_SLACK_NS,
                   max(float(per_element_ps), 0.0) * (1 + READ_SLACK_REL),
                   max(float(per_strided_element_ps), 0.0) * (1 + READ_SLACK_REL), base_elements)

    def left_out_ns(self, read_ns: int, dense: int = 0, strided: int = 0) -> int:
        """What is left out of a call whose close took `read_ns` to read its outputs and to
        project `dense` contiguous elements (max(elements, bytes / 4) of each) and `strided`
        others."""
        grown = (self.read_ps_per_element * max(dense - self.base_elements, 0)
                 + self.read_ps_per_strided_element * strided)
        return self.overhead_ns + min(max(read_ns, 0), self.read_cap_ns + int(grown / 1000))


def call_ms_from(cal: Calibration, span_ms: float, read_ns: int, dense: int, strided: int) -> float:
    """A call's time (ms) from its raw interval `span_ms` (CPU: the wall clock's; GPU: to the end
    event, or to the last event less `TAIL_ALLOWANCE_MS` if the close kernel gave up), its close's
    read phase `read_ns` and what it projected (`dense` contiguous elements, `strided` others),
    less what `cal` leaves out; never negative."""
    return max(span_ms - cal.left_out_ns(read_ns, dense, strided) / 1e6, 0.0)


class VerifyConfig(BaseModel):
    """Correctness protocol: trials with fresh secret seeds, half of them candidate-first."""

    trials: int = Field(default=6, ge=5)
    scaled_trial: bool = True  # one trial with floating inputs scaled x3 (another distribution)
    min_own_share: float = 0.3  # permissive mode: share of device time in the candidate's kernels
    settle_ms: float = 20.0  # wait before re-reading an output, to catch work finishing late
    # Outputs up to this size go to the parent whole and are compared element by element; larger
    # ones as evidence (`cudagym.sandbox.worker.verify.output_evidence`: values at secret
    # positions and projections of every element). Each trial's whole outputs stay in the
    # worker's result memory, charged to its limit (8 GiB): six trials of 256 MiB take 1.5 GiB,
    # beside the trial's own 3x the output (the output, its snapshot, the reference's); a 1 GiB
    # output sent whole was killed after five trials (`benchmarks/probe_verify_memory.py`).
    whole_output_mb: int = Field(default=256, ge=1)
    # Where verify's two workers run (`cudagym.rewards.evaluator.Evaluator.averify`): the
    # candidate's and the reference-only worker at once ("side_by_side"), or the reference's job
    # first and then the candidate's ("reference_first": one problem's memory on the device at a
    # time, as KernelBench's harness runs them). "auto": side by side where the task's reference,
    # measured by an earlier job of the evaluator, held at most `side_by_side_share` of the
    # device's memory and of the host's; else reference first. A task not yet measured runs side
    # by side and, if a job of it ran out of memory, once more reference first.
    layout: Literal["auto", "side_by_side", "reference_first"] = "auto"
    side_by_side_share: float = Field(default=0.1, gt=0.0, le=1.0)


MAX_IDLE_MS = 1000.0  # the longest gap server mode may idle before a call


class TimingConfig(BaseModel):
    """Timing protocol (see `cudagym.sandbox.timing`)."""

    warmup_calls: int = 5
    warmup_ms: float = 100.0  # wall-clock, at least: clocks leave their idle state
    min_calls: int = 20
    max_calls: int = 500
    target_ms: float = 300.0  # wall-clock budget of the timed calls (sets their number after warm-up)
    # How long a timed loop runs after its warm-up (`cudagym.sandbox.feed.CallFeed`). "fixed":
    # target_ms of the parent's clock at the warm-up's pace, within [min_calls, max_calls].
    # "precision": that length at most, and it ends sooner once the median's distribution-free
    # confidence interval (at precision_confidence) lies within precision_rel of the median, with
    # at least min_calls timed calls over min_timed_ms of the parent's clock. 0.5% at 95% leaves
    # a median's own sampling error at most ~0.26% (sd), under the spread targets of separate
    # jobs (CV < 1% from 50 us, < 3% below; docs/timing.md)
    stop: Literal["fixed", "precision"] = "precision"
    precision_rel: float = Field(default=0.005, gt=0.0)
    precision_confidence: float = Field(default=0.95, gt=0.5, lt=1.0)
    min_timed_ms: float = Field(default=100.0, ge=0.0)
    # rotating input buffers, refilled with fresh values before every call: up to input_sets of
    # them within input_set_bytes and max_calls / 8 (at least 4). A one-op call of a few
    # microseconds reads a few percent more or less with where its buffers lie; 16 sets instead of
    # 4 (and the placements `drive_calls` rotates) took an 8 us softmax's spread over 10 processes
    # from 3.5% to 2.5% on an H100 (`benchmarks/probe_stamps.py`)
    input_sets: int = 16
    input_set_bytes: int = 512 * 2**20
    recheck_calls: int = 6  # timed calls, drawn by the parent (`CallFeed.recheck_sample`), whose samples are re-checked
    # timed calls whose projections of every output element are re-checked against the
    # reference's: the `recheck_calls` and more drawn among the rest (`CallFeed.projection_sample`),
    # every timed call of a loop that has no more (the CPU target's loops: 20-30 calls). A call
    # left uncomputed is then caught wherever it is, not only among the sampled six (red team
    # 23's escaped them in 4 of 6 runs); what the extra calls cost is the reference's work on them
    recheck_projected: int = Field(default=32, ge=0)
    flush_l2: bool = True
    # GPU: every SM is held this long while each call is launched, so that the host's work of
    # launching it is not timed (host work beyond it is); the call's inputs take their values at
    # its end. 200 us left 10-70% of a one-op call's launches late in the harness on an H100 (host
    # spans 0.11-0.25 ms, median), and those calls read 10-50 us long (benchmarks/probe_launch_window.py)
    launch_window_us: float = 1000.0
    # The parent's clock bounds the reported times on a GPU (`cudagym.sandbox.feed`): a median
    # gap beyond clock_slack_ms + clock_slack_rel x the median call is reported as tampering.
    # Honest gaps: -1.3 to +0.5 ms on an H100 (48 loops, calibration taken before the loop);
    # on a loaded 2-core CPU -13 to +30 ms at 2-19 ms calls, so the CPU target only reports it
    clock_slack_ms: float = 1.0
    clock_slack_rel: float = 1.0
    # Server mode (`ServerTiming`): before every call (warm-up and probes too, so that nothing
    # tells them apart) the worker idles a gap drawn uniformly from idle_ms, from a generator
    # seeded by idle_seed and the role: calls arrive at random intervals, not back to back, so
    # the GPU's clocks and the host are not warm as in a loop. None: offline (back to back).
    idle_ms: tuple[float, float] | None = None
    idle_seed: int = 0

    def input_sets_for(self, set_bytes: int) -> int:
        """How many input sets a loop rotates when one takes `set_bytes`: as many as fit
        input_set_bytes and a full loop uses 8 times each, at most input_sets, at least 4. A set
        that never comes back cannot show a result replayed by buffer (the parent re-checks calls
        whose buffers came back, `CallFeed.recheck_sample`)."""
        fits = min(self.input_sets, self.input_set_bytes // max(set_bytes, 1), self.max_calls // 8)
        return max(min(self.input_sets, 4), fits)

    @staticmethod
    def parse_idle(text: str) -> tuple[float, float]:
        """'LOW,HIGH' in ms (a command line's server-mode gaps) as `idle_ms`; ValueError if not."""
        try:
            low, high = (float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"server-mode gaps are LOW,HIGH in ms (e.g. 1,10), not {text!r}") from None
        return TimingConfig(idle_ms=(low, high)).idle_ms  # type: ignore[return-value]

    @field_validator("idle_ms")
    @classmethod
    def _gap_bounds(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None and not 0.0 <= v[0] <= v[1] <= MAX_IDLE_MS:
            raise ValueError(f"idle_ms must be (low, high) with 0 <= low <= high <= {MAX_IDLE_MS:g} ms, not {v}")
        return v


class LimitsConfig(BaseModel):
    """Per-job sandbox limits."""

    timeout_s: float = 120.0
    # host memory of the worker (resident). A job running the candidate's code gets this plus the
    # host memory the task's reference took, measured by a reference-only job of the evaluator
    # (`Evaluator.averify`): KernelBench builds a model on the host before moving it to the GPU.
    memory_mb: int = 8192
    max_processes: int = 64  # processes + threads of the job
    max_file_mb: int = 64
    network: bool = False
