"""Result types of compile, verify, profile and the final verdict.

Every result carries its reasons: a reward is never a bare number. Times are in milliseconds
(`_ms`) or seconds (`_s`) as named.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, Field

from cudagym.core import stats

AuditMode = Literal["strict", "permissive"]


class ErrorKind(str, Enum):
    """Why a job failed, as the agent and the reward see it."""

    COMPILE = "compile_error"
    EXCEPTION = "exception"  # the candidate raised
    CRASH = "crash"  # the worker died (segfault, abort, illegal memory access)
    TIMEOUT = "timeout"
    MEMORY = "memory_limit"
    PROCESS_LIMIT = "process_limit"
    SANDBOX = "sandbox_violation"  # wrote outside the workspace, network, ...
    MISMATCH = "mismatch"  # wrong output values
    OUTPUT_FORMAT = "output_format"  # wrong type/shape/dtype/device
    AUDIT = "audit"  # forbidden op or rule broken
    TAMPER = "tamper"  # harness, timer or result channel tampered with
    IMPLAUSIBLE = "implausible"  # faster than the roofline floor
    INTERNAL = "internal"  # a harness failure: not the candidate's fault
    # another process used the GPU during a timing: no valid time, not the candidate's fault
    DEVICE_BUSY = "device_busy"


class TimingStats(BaseModel):
    """Statistics of repeated timed calls, in milliseconds."""

    n: int
    median_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    iqr_ms: float
    cv: float  # stdev / mean of the calls
    p10_ms: float | None = None  # 10th percentile
    # the median's distribution-free 95% confidence interval: its farther end from the median,
    # relative to it (`cudagym.core.stats`); None for fewer than 6 calls
    median_ci_rel: float | None = None

    @classmethod
    def from_samples(cls, samples_ms: list[float]) -> TimingStats:
        import statistics

        s = sorted(samples_ms)
        n = len(s)
        if n == 0:
            raise ValueError("no samples")
        q1, q3 = (statistics.quantiles(s, n=4)[0], statistics.quantiles(s, n=4)[2]) if n >= 2 else (s[0], s[0])
        mean = statistics.fmean(s)
        sd = statistics.pstdev(s) if n > 1 else 0.0
        median = statistics.median(s)
        return cls(
            n=n,
            median_ms=median,
            mean_ms=mean,
            min_ms=s[0],
            max_ms=s[-1],
            iqr_ms=q3 - q1,
            cv=(sd / mean) if mean > 0 else 0.0,
            p10_ms=statistics.quantiles(s, n=10)[0] if n >= 2 else s[0],
            median_ci_rel=stats.median_ci_rel(s, median),
        )


class CompileResult(BaseModel):
    ok: bool
    seconds: float = 0.0
    cached: bool = False  # nothing was compiled: every object came from the build cache
    artifact_dir: str | None = None  # holds libkernels.so and/or kernel_ext*.so
    compiled: list[str] = Field(default_factory=list)  # sources compiled this time
    reused: list[str] = Field(default_factory=list)  # sources taken from the cache
    errors: list[str] = Field(default_factory=list)  # "file:line: message", trimmed
    log: str = ""  # trimmed compiler output
    inline_modules: list[str] = Field(default_factory=list)  # load_inline modules pre-built


class AuditResult(BaseModel):
    mode: AuditMode
    passed: bool
    forbidden_ops: list[str] = Field(default_factory=list)
    ops_seen: dict[str, int] = Field(default_factory=dict)
    own_kernel_share: float | None = None  # share of device time in the candidate's kernels
    reasons: list[str] = Field(default_factory=list)


class VerifyResult(BaseModel):
    ok: bool  # correct, audit passed, no rule broken
    correct: bool = False
    trials: int = 0
    trials_passed: int = 0
    max_abs_error: float | None = None  # over every element compared (of a sampled output, its samples)
    # outputs above `VerifyConfig.whole_output_mb`, checked by samples and projections rather
    # than element by element (`cudagym.rewards.compare.SampledOutput`)
    sampled_outputs: list[int] = Field(default_factory=list)
    audit: AuditResult | None = None
    params: str | None = None  # how ModelNew got its parameters, in words
    # which path decided: its own same-seed build, or Model's state_dict loaded on a second try
    params_path: Literal["seed", "state_dict"] = "seed"
    error_kind: ErrorKind | None = None
    error: str | None = None  # the candidate's own traceback / crash message, trimmed
    reasons: list[str] = Field(default_factory=list)
    seconds: float = 0.0
    breakdown: dict[str, float] = Field(default_factory=dict)  # where the seconds went


class ServerTiming(BaseModel):
    """Times of calls that arrive after random idle gaps (server mode, `TimingConfig.idle_ms`),
    beside the offline ones of back-to-back calls: a separate job for the candidate and for the
    baselines, under the same protocol."""

    gap_ms: tuple[float, float]
    candidate: TimingStats
    eager: TimingStats | None = None
    compiled: TimingStats | None = None
    speedup_vs_eager: float | None = None
    speedup_vs_compile: float | None = None
    library: dict[str, TimingStats] = Field(default_factory=dict)
    speedup_vs_library: dict[str, float] = Field(default_factory=dict)


class ProfileResult(BaseModel):
    ok: bool
    params_path: Literal["seed", "state_dict"] = "seed"  # ModelNew's parameters in the timed job (`VerifyResult`)
    candidate: TimingStats | None = None
    eager: TimingStats | None = None
    compiled: TimingStats | None = None  # torch.compile baseline
    # library baselines by name (`cudagym.sandbox.library`: cuBLASLt's, for GEMM tasks) and the
    # candidate's speedup over each
    library: dict[str, TimingStats] = Field(default_factory=dict)
    speedup_vs_library: dict[str, float] = Field(default_factory=dict)
    harness_overhead_ns: int | None = None  # diagnostic: the timer's own overhead, left out of every GPU call
    close_timeouts: int = 0  # GPU calls whose SMs were still busy a second after the caller's stream ended
    # the parent's clock less the reported times, beyond the overhead its probes measured (median, ms
    # per call; about 0 when honest): the bound on what an in-process forgery could hide
    clock_gap_ms: float | None = None
    # diagnostic (GPU): the median host time from the timer's open kernel to its close kernel, and
    # the timed calls where it passed the launch window, so that their times hold host work
    host_ms: float | None = None
    late_launches: int = 0
    speedup_vs_eager: float | None = None
    speedup_vs_compile: float | None = None
    roofline_floor_ms: float | None = None
    baselines_cached: bool = False
    telemetry: dict[str, Any] = Field(default_factory=dict)
    ncu: dict[str, Any] | None = None
    server: ServerTiming | None = None  # server mode, when asked for (`EvaluatorConfig.server_gap_ms`)
    error_kind: ErrorKind | None = None
    error: str | None = None
    reasons: list[str] = Field(default_factory=list)
    seconds: float = 0.0
    breakdown: dict[str, float] = Field(default_factory=dict)  # where the seconds went
    # what the timing measured (`cudagym.rewards.reuse.evidence_key`), on an accepted profile: a
    # submit of the same episode with the same key reuses it
    evidence: str | None = None
    reused: bool = False  # this is an earlier profile's timing, reused by a submit (its reasons say which)
    # the op counts and kernel records each timing job's calls reported (offline, then server
    # mode's), kept (not dumped) so that a reuse audits them against the submit's own verify
    timed_ops: list[dict[str, int]] = Field(default_factory=list, exclude=True)


class Verdict(BaseModel):
    """The final judgement of a submission: reward plus everything it was computed from."""

    reward: float
    milestone: Literal["failed", "correct", "faster_than_eager", "faster_than_compile"]
    compiled: bool
    correct: bool
    audit: AuditResult | None = None
    eager_ms: float | None = None
    compile_ms: float | None = None  # the torch.compile baseline's time, not compile seconds
    candidate_ms: float | None = None
    speedup_vs_eager: float | None = None
    speedup_vs_compile: float | None = None
    library_ms: dict[str, float] = Field(default_factory=dict)  # library baselines' medians (GEMM tasks)
    speedup_vs_library: dict[str, float] = Field(default_factory=dict)
    server: ServerTiming | None = None  # server-mode times beside these (when asked for); not rewarded
    timing_reused: bool = False  # the times are an earlier profile's of the same evidence (`ProfileResult.reused`)
    reasons: list[str] = Field(default_factory=list)
    error: str | None = None
    error_kind: ErrorKind | None = None
    compile_result: CompileResult | None = None
    verify_result: VerifyResult | None = None
    profile_result: ProfileResult | None = None

    def summary(self) -> dict[str, Any]:
        """The flat JSON object of `cudagym check --json`."""
        return {
            "reward": self.reward,
            "milestone": self.milestone,
            "compiled": self.compiled,
            "correct": self.correct,
            "audit": None
            if self.audit is None
            else {"mode": self.audit.mode, "passed": self.audit.passed, "reasons": self.audit.reasons,
                  "forbidden_ops": self.audit.forbidden_ops},
            "eager_ms": self.eager_ms,
            "compile_ms": self.compile_ms,
            "candidate_ms": self.candidate_ms,
            "speedup_vs_eager": self.speedup_vs_eager,
            "speedup_vs_compile": self.speedup_vs_compile,
            "library_ms": self.library_ms,
            "speedup_vs_library": self.speedup_vs_library,
            "timing_reused": self.timing_reused,
            "reasons": self.reasons,
            "error": self.error,
            "error_kind": self.error_kind.value if self.error_kind else None,
        }
