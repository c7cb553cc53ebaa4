"""The milestone reward: -1 failed, +1 correct, +2 faster than eager, +3 faster than both.

The two speed milestones are measured against eager and torch.compile by default; `against`
names other baselines for them (the library baselines of GEMM tasks, `cudagym.sandbox.library`):
e.g. ("eager", "cublaslt_tuned") gives +3 only to a kernel faster than eager and than autotuned
cuBLASLt. A task without the named baseline (not a GEMM task, or the library unavailable) is
judged against the default one instead, and the verdict's reasons say so.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from cudagym.core.verdict import CompileResult, ErrorKind, ProfileResult, Verdict, VerifyResult
from cudagym.rewards.reuse import REUSED
from cudagym.sandbox.library import LIBRARY_BASELINES, LIBRARY_TITLES

BaselineName = Literal["eager", "compiled", "cublaslt", "cublaslt_tuned"]
BASELINES: tuple[str, ...] = ("eager", "compiled", *LIBRARY_BASELINES)
BASELINE_TITLES = {"eager": "eager", "compiled": "torch.compile", **LIBRARY_TITLES}


class RewardConfig(BaseModel):
    """Reward values and speed thresholds (a speedup must exceed 1 + margin)."""

    fail: float = -1.0
    correct: float = 1.0
    faster_than_eager: float = 2.0
    faster_than_compile: float = 3.0
    eager_margin: float = 0.05
    compile_margin: float = 0.05
    # the baselines of the +2 and the +3 milestone (see the module's text)
    against: tuple[BaselineName, BaselineName] = Field(
        default=("eager", "compiled"),
        description="The baselines of the +2 and +3 milestones, A,B among eager, compiled, cublaslt, cublaslt_tuned "
                    "(default eager,compiled; the cuBLASLt ones exist for GEMM tasks on a GPU, other tasks fall back "
                    "to the default).")

    @staticmethod
    def parse_against(text: str) -> tuple[str, str]:
        """'A,B' (a command line's --reward-against) as `against`; ValueError if not."""
        names = tuple(x.strip() for x in text.split(","))
        if len(names) != 2 or any(n not in BASELINES for n in names):
            raise ValueError(f"--reward-against takes two of {', '.join(BASELINES)}, comma-separated "
                             f"(the +2 and the +3 milestone's baselines), not {text!r}")
        return names  # type: ignore[return-value]


def _speedup(p: ProfileResult, name: str) -> float | None:
    if name == "eager":
        return p.speedup_vs_eager
    if name == "compiled":
        return p.speedup_vs_compile
    return p.speedup_vs_library.get(name)


def milestone_verdict(
    compile_result: CompileResult,
    verify_result: VerifyResult | None,
    profile_result: ProfileResult | None,
    config: RewardConfig | None = None,
) -> Verdict:
    """Combine the step results into a `Verdict` with its reward and reasons."""
    cfg = config or RewardConfig()
    reasons: list[str] = []
    base: dict[str, Any] = dict(compile_result=compile_result, verify_result=verify_result,
                                profile_result=profile_result)

    if not compile_result.ok:
        reasons.append("did not compile: " + ("; ".join(compile_result.errors[:3]) or "see log"))
        return Verdict(reward=cfg.fail, milestone="failed", compiled=False, correct=False, reasons=reasons,
                       error="\n".join(compile_result.errors) or compile_result.log, error_kind=ErrorKind.COMPILE,
                       **base)
    if verify_result is None:
        raise ValueError("a candidate that compiled needs its verify_result")
    audit = verify_result.audit
    if not verify_result.ok:
        reasons.extend(verify_result.reasons or ["not correct"])
        return Verdict(reward=cfg.fail, milestone="failed", compiled=True, correct=verify_result.correct, audit=audit,
                       reasons=reasons, error=verify_result.error, error_kind=verify_result.error_kind, **base)
    reasons.append(f"correct on {verify_result.trials_passed}/{verify_result.trials} trials; "
                   f"audit ({audit.mode if audit else '-'}) passed")
    if verify_result.params:
        reasons.append(f"parameters: {verify_result.params}")
    timing: dict[str, Any] = dict(audit=audit)
    if profile_result is None or not profile_result.ok:
        why = profile_result.error if profile_result else "not profiled"
        kind = profile_result.error_kind if profile_result is not None else None
        if profile_result is not None and kind is not None and kind.value not in ("internal", "device_busy"):
            reasons.extend(profile_result.reasons or [f"profile failed: {why}"])
            return Verdict(reward=cfg.fail, milestone="failed", compiled=True, correct=False, reasons=reasons,
                           error=why, error_kind=profile_result.error_kind, **timing, **base)
        reasons.append(f"no speed milestone: profile unavailable ({why})")
        return Verdict(reward=cfg.correct, milestone="correct", compiled=True, correct=True, reasons=reasons,
                       **timing, **base)

    p = profile_result
    timing.update(
        eager_ms=p.eager.median_ms if p.eager else None,
        compile_ms=p.compiled.median_ms if p.compiled else None,
        candidate_ms=p.candidate.median_ms if p.candidate else None,
        speedup_vs_eager=p.speedup_vs_eager,
        speedup_vs_compile=p.speedup_vs_compile,
        server=p.server,
        timing_reused=p.reused,
    )
    if p.reused:
        reasons.extend(r for r in p.reasons if r.startswith(REUSED))
    timing.update(library_ms={n: s.median_ms for n, s in p.library.items()}, speedup_vs_library=p.speedup_vs_library)
    fmt = lambda s: "n/a" if s is None else f"{s:.3f}x"  # noqa: E731
    beats = []
    defaults: tuple[BaselineName, BaselineName] = ("eager", "compiled")
    for name, default, margin in zip(cfg.against, defaults, (cfg.eager_margin, cfg.compile_margin)):
        if name != default and _speedup(p, name) is None:
            reasons.append(f"no {BASELINE_TITLES[name]} baseline for this task: this milestone is against "
                           f"{BASELINE_TITLES[default]}")
            name = default
        s = _speedup(p, name)
        beats.append(s is not None and s > 1 + margin)
        reasons.append(f"speedup vs {BASELINE_TITLES[name]} {fmt(s)} (needs > {1 + margin:.2f}x)")
    beats_eager, beats_compile = beats
    if beats_eager and beats_compile:
        return Verdict(reward=cfg.faster_than_compile, milestone="faster_than_compile", compiled=True, correct=True,
                       reasons=reasons, **timing, **base)
    if beats_eager:
        return Verdict(reward=cfg.faster_than_eager, milestone="faster_than_eager", compiled=True, correct=True,
                       reasons=reasons, **timing, **base)
    return Verdict(reward=cfg.correct, milestone="correct", compiled=True, correct=True, reasons=reasons,
                   **timing, **base)
