"""The evaluator: compile → verify → profile → milestone reward.

One `Evaluator` serves many episodes: it owns the build cache (`Toolchain`), the sandbox with
its spare workers, and the baseline cache. Every check runs in a fresh sandboxed worker; the
evaluator compares outputs and computes statistics itself, out of the candidate's reach.

Sync methods call the async ones; the async ones are safe to run concurrently.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import shutil
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil
import torch
from pydantic import BaseModel, Field, field_validator, model_validator

import cudagym
from cudagym.core.audit import forbidden_ops
from cudagym.core.verdict import (
    AuditMode, AuditResult, CompileResult, ErrorKind, ProfileResult, ServerTiming, TimingStats, Verdict, VerifyResult,
)
from cudagym.rewards.checks import FORBIDDEN_IMPORTS, Audit, TimedRun, apply_checks, outcome_failure, release_later
from cudagym.rewards.compare import Comparison, compare_outcome
from cudagym.rewards.milestone import RewardConfig, milestone_verdict
from cudagym.rewards.reuse import REUSED, ProfileMemo, evidence_key
from cudagym.sandbox.base import Sandbox
from cudagym.sandbox.backends import open_sandbox
from cudagym.sandbox.baselines import BaselineCache
from cudagym.sandbox.bridge import run_sync
from cudagym.sandbox.config import LocalSandboxConfig, SandboxConfig, reject_moved
from cudagym.sandbox.feed import CallFeed, TrialFeed
from cudagym.sandbox.gpu import cpu_name, gpu_count, gpu_memory_bytes, gpu_names, peaks_for
from cudagym.sandbox.inline import InlineBuild, InlineBuildCache, InlineCompileError
from cudagym.sandbox.library import LIBRARY_BASELINES, LIBRARY_TITLES
from cudagym.sandbox.ncu import ncu_job_limits
from cudagym.sandbox.protocol import LimitsConfig, TimingConfig, VerifyConfig
from cudagym.sandbox.timing import PROTOCOL_VERSION
from cudagym.sandbox.toolchain import Toolchain, ToolchainConfig
from cudagym.sandbox.worker.wire import Job, JobKind, JobOutcome
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.gemm import GEMM_SOURCE
from cudagym.tasks.model import Target, Task


def default_cache_dir() -> Path:
    return Path(os.environ.get("CUDAGYM_CACHE", Path.home() / ".cache" / "cudagym"))


class EvaluatorConfig(BaseModel):
    """Everything that decides a verdict, in one place."""

    target: Literal["auto", "cuda", "cpu"] = Field(
        default="auto", description="Kernel target: 'auto' (CUDA if a GPU is present, else CPU), 'cuda' or 'cpu'.")
    mode: AuditMode = Field(
        default="strict", description="Op audit: 'strict' (only your kernels plus allocation/view ops in forward) or "
                                      "'permissive' (torch ops allowed, own kernels must carry the work).")
    cache_dir: Path = Field(default_factory=default_cache_dir,
                            description="Build and baseline cache (default ~/.cache/cudagym or $CUDAGYM_CACHE).")
    toolchain: ToolchainConfig = Field(default_factory=ToolchainConfig)
    verify: VerifyConfig = Field(default_factory=VerifyConfig)
    timing: TimingConfig = Field(default_factory=TimingConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    compile_baseline: bool = Field(default=True, description="Measure the torch.compile baseline (the +3 milestone "
                                                             "needs it).")
    # measure the cuBLASLt baselines (heuristic and autotuned; `cudagym.sandbox.library`) of the
    # GEMM family's tasks, beside eager and torch.compile
    library_baselines: bool = True
    roofline_slack: float = 0.5  # a time below slack x the roofline floor is implausible
    # where workers run, with its settings; a backend's name ("local", "docker") is that backend
    # with its defaults
    sandbox: SandboxConfig = Field(
        default_factory=LocalSandboxConfig,
        description="Sandbox backend: 'local' (worker processes on this host) or 'docker' (a container per worker; "
                    "image from `cudagym sandbox image build`).")
    # Server mode beside offline in every profile: each call after an idle gap drawn from this
    # range (ms; `TimingConfig.idle_ms`), at most server_calls timed calls. None: offline only.
    server_gap_ms: tuple[float, float] | None = Field(
        default=None, description="Also time every profile in server mode (CUDA-L2): each call after an idle gap "
                                  "drawn from LOW,HIGH ms (e.g. 1,10), reported beside the offline time; the reward "
                                  "stays offline.")
    server_calls: int = 100
    # a submit takes the timing of an accepted profile of its episode that measured the same evidence
    # (`cudagym.rewards.reuse`) instead of timing it again; verify runs again either way
    reuse_profiles: bool = Field(default=True, description="Let a submit reuse its episode's profile of the same "
                                                           "build, files, task and settings (verify still runs).")

    @model_validator(mode="before")
    @classmethod
    def _backend_by_name(cls, data: Any) -> Any:
        if isinstance(data, dict):
            reject_moved(data, {"spare_workers": "sandbox.spare_workers", "docker": "sandbox (backend 'docker')"},
                         "EvaluatorConfig")
            if isinstance(data.get("sandbox"), str):
                data = {**data, "sandbox": {"backend": data["sandbox"]}}
        return data

    @field_validator("server_gap_ms")
    @classmethod
    def _server_gap(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        return TimingConfig(idle_ms=v).idle_ms  # its bounds

    def server_timing(self) -> TimingConfig | None:
        """The timing of server-mode jobs (None: not asked for)."""
        if self.server_gap_ms is None:
            return None
        t = self.timing
        return TimingConfig.model_validate({**t.model_dump(), "idle_ms": self.server_gap_ms,
                                            "max_calls": min(t.max_calls, self.server_calls),
                                            "min_calls": min(t.min_calls, self.server_calls)})


def resolve_target(target: str) -> Target:
    if target == "auto":
        return Target.CUDA if gpu_count() > 0 else Target.CPU
    return Target(target)


MAX_INLINE_PASSES = 6  # compile passes of a solution with extensions (each runs it once)
CPU_BUSY_PAUSE_S = 1.0  # before a CPU timing job runs again after the host was too busy to time it


@dataclass(frozen=True)
class Footprint:
    """The memory a task's reference took in a reference-only worker (`run_reference_outputs`):
    the growth of its host memory's peak over the job, and on a GPU the peak the allocator
    reserved; a worker that runs no candidate code measured it."""

    host_bytes: int
    device_bytes: int | None = None

    @classmethod
    def of(cls, o: JobOutcome) -> Footprint | None:
        final = o.final or {}
        found = final.get("footprint") if final.get("ok") else None
        if not isinstance(found, dict):
            return None
        try:
            device = found.get("device_bytes")
            return cls(max(int(found.get("host_bytes") or 0), 0), None if device is None else max(int(device), 0))
        except (TypeError, ValueError):
            return None


def _out_of_memory(o: JobOutcome) -> bool:
    """Whether a job ended for want of memory: killed at its host limit, or an allocation failed
    (host or device: CUDA's OutOfMemoryError, by the harness or in the candidate's forward)."""
    if o.memory_exceeded:
        return True
    final = o.final or {}
    return not final.get("ok", True) and (final.get("kind") == ErrorKind.MEMORY.value
                                          or "out of memory" in str(final.get("error", "")))


def _device_out_of_memory(o: JobOutcome) -> bool:
    """Whether a job's worker reported that its device's memory ran out ("out of memory": CUDA's
    allocator, torch's or the candidate's own `cudaMalloc`), as against a host allocation refused
    at the job's own limit ("can't allocate memory") or the job killed at that limit."""
    final = o.final or {}
    error = str(final.get("error", "")).lower()
    return not o.memory_exceeded and not final.get("ok", True) and "out of memory" in error


def _host_memory_bytes() -> int:
    return int(psutil.virtual_memory().total)


def _job_breakdown(role: str, o: JobOutcome) -> dict[str, float]:
    """Seconds spent waiting for a ready worker, in the worker, and in each of its phases."""
    return {f"{role}.wait_ready_s": o.wait_s, f"{role}.wait_device_s": o.lease_wait_s,
            **({f"{role}.wait_alone_s": o.lease_upgrade_s} if o.lease_upgrade_s else {}), f"{role}.worker_s": o.seconds,
            **{f"{role}.{k}_s": v for k, v in o.phases.items()}}


class Evaluator:
    """compile / verify / profile / evaluate a workspace for a task; async forms `a*`."""

    def __init__(self, config: EvaluatorConfig | None = None, sandbox: Sandbox | None = None) -> None:
        self.config = config or EvaluatorConfig()
        self._target = resolve_target(self.config.target)
        cache = Path(self.config.cache_dir)
        cache.mkdir(parents=True, exist_ok=True)
        self.toolchain = Toolchain(cache / "build", self.config.toolchain)
        self.inline_cache = InlineBuildCache(cache / "build", self.toolchain.bound,
                                            self.toolchain.config.max_build_output_mb << 20)
        self.sandbox = sandbox or open_sandbox(self.config.sandbox, home=cache / "home", read_only=[cache])
        self.baselines = BaselineCache(cache / "baselines")
        self.audit = Audit(self.config, self._target)
        self._baseline_locks: dict[str, threading.Lock] = {}
        self._footprints: dict[str, Footprint] = {}  # by task: what its reference took (`footprint`)

    @property
    def target(self) -> Target:
        return self._target

    @property
    def device(self) -> str:
        return "cuda" if self._target == Target.CUDA else "cpu"

    @property
    def device_name(self) -> str:
        return gpu_names()[0] if self._target == Target.CUDA and gpu_names() else cpu_name()

    def _job(self, kind: JobKind, task: Task, ws: Workspace | None, **kw: Any) -> Job:
        """A job of `task`; one in a workspace (the candidate's code runs in it) under
        `_candidate_limits`, others under the configured limits unless `limits` is given."""
        limits = kw.pop("limits", None) or (self._candidate_limits(task) if ws is not None else self.config.limits)
        return Job(kind=kind, nonce=secrets.token_hex(16), task_id=task.id, task_code=task.code, dtype=task.dtype,
                   device=self.device, workspace=str(ws.root) if ws else "",
                   cache_dir=str(self.config.cache_dir / "build"),
                   mode=self.config.mode, seed=secrets.randbits(62), verify=self.config.verify,
                   timing=kw.pop("timing", self.config.timing), limits=limits, **kw)

    # -- compile ----------------------------------------------------------------------------
    async def acompile(self, task: Task, workspace: Workspace) -> CompileResult:
        """Build kernels/ (content-addressed cache), then model_new.py's load_inline/load extensions.

        Extensions: a sandboxed job runs the solution as verify will (import, ModelNew, one
        forward) with a loader that builds nothing and reports the extensions it asked for that
        are not in the cache; each is checked, then built by a trusted job that runs no candidate
        code, and filed in the cache; then the solution runs again, until a pass asks for
        nothing new (at most MAX_INLINE_PASSES passes). See `cudagym.sandbox.inline`.
        """
        t0 = time.perf_counter()
        result = await self.toolchain.abuild(workspace, self._target)
        if not result.ok:
            return result
        src = workspace.model_new.read_text(errors="replace") if workspace.model_new.is_file() else ""
        if "cpp_extension" in src or "load_inline" in src:
            result = await self._acompile_inline(task.for_target(self._target), workspace, result)
        return result.model_copy(update={"seconds": time.perf_counter() - t0})

    async def _acompile_inline(self, task: Task, workspace: Workspace, result: CompileResult) -> CompileResult:
        def failed(errors: list[str], log: str = "") -> CompileResult:
            return result.model_copy(update={"ok": False, "errors": errors, "log": log})

        handled: set[str] = set()  # keys built (or found in the cache) by this compile
        built_any = False
        for n in range(1, MAX_INLINE_PASSES + 1):
            # runs the candidate's code and builds nothing (a trusted job does): the job limit
            job = self._job("compile_inline", task, workspace, artifact_dir=result.artifact_dir)
            outcome = await self.sandbox.run(job, self.device)
            failure = outcome_failure(outcome, "running model_new.py for its extensions")
            if failure:
                return failed([failure[1]], outcome.output[-4000:])
            final = outcome.final or {}
            requests = final.get("requests")
            try:
                builds = [self.inline_cache.prepare(r, workspace.root)
                          for r in (requests if isinstance(requests, list) else [])]
            except InlineCompileError as e:
                return failed(str(e).splitlines())
            new = {b.key: b for b in builds if b.key not in handled}
            if not new:
                break
            if n == MAX_INLINE_PASSES:
                return failed([f"model_new.py still asked for new extensions "
                               f"({', '.join(b.name for b in new.values())}) after {MAX_INLINE_PASSES} compile "
                               f"passes (each runs it once and builds what it asked for)"])
            handled.update(new)
            todo = [b for b in new.values() if not self.inline_cache.cached(b, workspace.root)]
            errors = [e for e in await asyncio.gather(*(self._abuild_inline(task, b, workspace) for b in todo)) if e]
            if errors:
                return failed([line for e in errors for line in e.splitlines()])
            built_any = built_any or bool(todo)
        if builds:  # asked for again although built (or found) by this compile: its inputs changed meanwhile
            return failed([f"{b.kind} module '{b.name}' ({b.site}) is in the build cache, but model_new.py did "
                           "not find it there: the files it is built from changed while the compile step ran"
                           for b in builds])
        errors = [str(e) for e in final.get("load_failures") or []]
        if final.get("import_error"):
            errors.append(str(final["import_error"]))
        if errors:
            return failed(errors, outcome.output[-4000:])
        loaded = list(dict.fromkeys(str(m) for m in final.get("loaded") or []))
        return result.model_copy(update={"inline_modules": loaded, "cached": result.cached and not built_any})

    async def _abuild_inline(self, task: Task, build: InlineBuild, workspace: Workspace) -> str | None:
        """Build one checked extension in a trusted job (writable: a fresh staging directory only)
        and file it in the cache; the error text, or None."""
        staging = self.inline_cache.staging()
        build_dir = staging / "build"
        try:
            job = self._job("build_inline", task, None, writable=[str(staging)], inline_build_root=str(build_dir),
                            inline_request=self.inline_cache.job_request(build, workspace.root, staging))
            job.limits = job.limits.model_copy(update={"timeout_s": self.config.toolchain.timeout_s * 3})
            outcome = await self.sandbox.run(job, self.device)
            failure = outcome_failure(outcome, f"building {build.kind} module '{build.name}' ({build.site})")
            if failure:
                return failure[1]
            self.inline_cache.store(build, staging, build_dir, workspace.root, outcome.paths)
            return None
        except InlineCompileError as e:
            return str(e)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    # -- verify -----------------------------------------------------------------------------
    async def averify(self, task: Task, workspace: Workspace, params: Literal["seed", "state_dict"] = "seed",
                      _layout: Literal["side_by_side", "reference_first"] | None = None,
                      _alone: bool = False) -> VerifyResult:
        """Correctness over fresh secret-seeded trials plus the op audit, in a fresh worker.

        ModelNew runs with its own same-seed parameters; only where they differ from Model's under
        the same names and the outputs are wrong does a second verify load Model's state_dict
        (`harness.Problem`); `VerifyResult.params_path` says which decided.

        Two workers: the candidate's (its trials, audited; it also runs the reference, for the
        allocator's poisoning) and a reference-only one whose outputs are the ones compared. They
        run side by side, or, for a problem large beside the device's or the host's memory, the
        reference's job first and the candidate's once that one's result is in (`VerifyConfig.layout`,
        `_verify_layout`): then the device holds one worker's problem at a time, not two (the
        candidate's inputs, their clone, outputs and snapshot beside the reference's). What
        decides is the task's `footprint`, measured by an earlier reference-only job of this
        evaluator; a task not yet measured runs side by side, and if either job ran out of memory
        (device or host), verify runs once more, reference first, with a fresh plan.

        Why reference first keeps verify's guarantees:
        - the candidate's process sees nothing more or sooner. The reference-only worker runs no
          candidate code; its outputs reach only this process (its pipe and result memory, read
          here), never the candidate's worker, which is another process in its own PID namespace
          without ptrace's capabilities. The candidate's worker learns each trial's input seed
          when the trial starts and its evidence seed once its outputs exist (`TrialFeed`), the
          same in either layout: that the reference already ran tells it nothing of them;
        - the reference's worker overwrites each output once it is sent and gives its device
          memory back before its result comes in (`run_reference_outputs`), so the candidate
          that starts after it is handed no memory holding a reference output;
        - the second, reference-first try after an out-of-memory run draws every secret again
          (seeds, orders, evidence seeds) and runs in fresh workers. The candidate cannot tell
          from its first try whether it would pass (no reference output reaches it), so ending
          that try out of memory on purpose gains it nothing but a slower verify; and the layout
          and the candidate's host memory limit are decided by the trusted reference's
          measurement, kept in this process, not by anything the candidate reports.

        Device memory is shared by the jobs on a GPU: two large verifies side by side can each
        run out although each alone fits. A verify whose reference's or candidate's job reported
        that its device ran out of memory (`_device_out_of_memory`) while it did not hold the
        device alone runs once more holding it alone (`Job.alone`: the scheduler's exclusive
        lease, as a timing job's), reference first, with every secret drawn again; one that ran
        out while alone fails as `memory_limit`. `breakdown["alone"]` and a reason say that the
        retry decided. A candidate gains nothing by running out of memory on purpose: its first
        try is discarded unjudged and it learns nothing there of whether it would pass (no
        reference output reaches it, as above); the retry draws new seeds, orders and evidence
        seeds and runs the same trials, comparisons and audit, in fresh workers, so holding the
        GPU alone weakens no check (verify times nothing, so it speeds no verdict either); there is
        one such retry per verify, and the reason says which try decided. What it costs is the
        time of the try it spoiled and a stretch of the GPU held alone, which every profile's
        timing job holds anyway.
        """
        t0 = time.perf_counter()
        task = task.for_target(self._target)
        built = await self.toolchain.abuild(workspace, self._target)
        if not built.ok:
            return VerifyResult(ok=False, error_kind=ErrorKind.COMPILE, error="\n".join(built.errors),
                                reasons=["does not compile"], seconds=time.perf_counter() - t0)
        t_built = time.perf_counter()
        imports = self.audit.imports(built.artifact_dir, [])
        if self.config.mode == "strict" and imports.forbidden:
            why = FORBIDDEN_IMPORTS + "; ".join(imports.reasons())
            return VerifyResult(ok=False, error_kind=ErrorKind.AUDIT, error=why, reasons=[why],
                                audit=AuditResult(mode="strict", passed=False, reasons=[why],
                                                  forbidden_ops=[s for s, _, _ in imports.forbidden]),
                                seconds=time.perf_counter() - t0)
        n = self.config.verify.trials
        orders = ["candidate_first"] * (n // 2) + ["reference_first"] * (n - n // 2)
        secrets.SystemRandom().shuffle(orders)
        init_seed = secrets.randbits(62) | 1
        plan: dict[str, Any] = dict(trial_seeds=[secrets.randbits(62) for _ in range(n)],
                    trial_scales=[0.5 if (self.config.verify.scaled_trial and t == n - 1) else 1.0 for t in range(n)],
                    trial_orders=orders, evidence_seeds=[secrets.randbits(64) for _ in range(n)])
        # the candidate's worker learns each trial's inputs only when the trial starts, and the
        # seed of its evidence (outputs too large to send whole) once its outputs exist
        feed = TrialFeed(plan["trial_seeds"], plan["trial_scales"], plan["trial_orders"], plan["evidence_seeds"])
        measured = self.footprint(task)
        chosen = _layout or self._verify_layout(measured)
        ref_job = self._job("reference", task, None, init_seed=init_seed, limits=self._reference_limits(), alone=_alone,
                            **plan)
        if chosen == "reference_first":
            ref = await self.sandbox.run(ref_job, self.device)
            self._learn_footprint(task, ref)
        cand_job = self._job("verify", task, workspace, artifact_dir=built.artifact_dir, init_seed=init_seed, trials=n,
                             params=params, alone=_alone)  # its host memory limit: from the footprint, if measured
        if chosen == "reference_first":
            ref_failure = outcome_failure(ref, "reference")
            outcome = await self.sandbox.run(cand_job, self.device, feed) if not ref_failure else JobOutcome(final={})
        else:
            outcome, ref = await asyncio.gather(self.sandbox.run(cand_job, self.device, feed),
                                                self.sandbox.run(ref_job, self.device))
            self._learn_footprint(task, ref)
            ref_failure = outcome_failure(ref, "reference")
        failure = outcome_failure(outcome, "verify") if not ref_failure or chosen != "reference_first" else None
        if feed.violations:
            failure = ErrorKind.TAMPER, "verify: " + feed.violations[0]
        blind = chosen == "side_by_side" and measured is None and _layout is None \
            and self.config.verify.layout == "auto"
        tampered = failure is not None and failure[0] == ErrorKind.TAMPER
        shared_out = not _alone and (_device_out_of_memory(ref) or _device_out_of_memory(outcome))
        if not tampered and (shared_out or (blind and (_out_of_memory(ref) or _out_of_memory(outcome)))):
            # out of memory, run blind (the task not yet measured) or beside other jobs on its device:
            # once more, the reference's job first, and then holding the device alone
            release_later(outcome, ref)
            spent_s = time.perf_counter() - t0
            again = await self.averify(task, workspace, params, _layout="reference_first", _alone=shared_out)
            why = "side_by_side_out_of_memory_s" if chosen == "side_by_side" else "shared_out_of_memory_s"
            return again.model_copy(update={"seconds": time.perf_counter() - t0,
                                            "breakdown": {**again.breakdown, why: spent_s}})
        if failure and not tampered and _alone and _device_out_of_memory(outcome):
            failure = ErrorKind.MEMORY, failure[1] + " (the device's memory ran out while this verify held it alone)"
        elif failure and failure[0] == ErrorKind.MEMORY:
            failure = failure[0], failure[1] + self._memory_note(cand_job.limits)
        if ref_failure and not failure:
            if ref_failure[0] == ErrorKind.MEMORY:
                ref_failure = ref_failure[0], ref_failure[1] + self._memory_note(ref_job.limits, reference=True)
            return VerifyResult(ok=False, error_kind=ErrorKind.INTERNAL,
                                error=f"the reference failed: {ref_failure[1]}",
                                reasons=["the reference itself failed (not the candidate's fault)"],
                                seconds=time.perf_counter() - t0)
        # Only the reference-only worker's outputs count; the candidate's process cannot forge them.
        outcome.tensors = [f for f in outcome.tensors if f[0].get("role") == "candidate"]
        outcome.tensors += [f for f in ref.tensors if f[0].get("role") == "reference"]
        t_jobs = time.perf_counter()
        if failure:
            result = self._verify_failure(outcome, *failure)
        else:
            cmp = await compare_outcome(outcome, task)
            # the audit reads files the candidate's job wrote (`Audit.kernels`): off the loop
            result = await asyncio.to_thread(self._verify_result, outcome, cmp, built.artifact_dir, str(workspace.root))
        release_later(outcome, ref)
        breakdown = {"build_check_s": t_built - t0, **_job_breakdown("candidate", outcome),
                     **_job_breakdown("reference", ref), "jobs_s": t_jobs - t_built,
                     "compare_s": time.perf_counter() - t_jobs,
                     "reference_first": float(chosen == "reference_first"), "alone": float(_alone)}
        if _alone:
            result.reasons.append("verify ran again holding the device alone (reference first, new secrets): its "
                                  "first try ran out of device memory beside other jobs")
        result = result.model_copy(update={"breakdown": breakdown, "seconds": time.perf_counter() - t0,
                                           "params_path": params})
        if params == "seed" and result.error_kind == ErrorKind.MISMATCH and (outcome.final or {}).get("params_retry"):
            second = await self.averify(task, workspace, params="state_dict")
            if second.error_kind != ErrorKind.MISMATCH:  # right with Model's parameters: that try decides
                return second.model_copy(update={"seconds": result.seconds + second.seconds})
            result.reasons.append("also wrong with Model's state_dict loaded into ModelNew")
        return result

    # -- memory that scales with the problem ----------------------------------------------------
    def _footprint_key(self, task: Task) -> str:
        return hashlib.sha256(f"{self._target.value}|{task.model_dump_json(exclude={'path'})}".encode()).hexdigest()

    def footprint(self, task: Task) -> Footprint | None:
        """What `task`'s reference took (host and device memory), as a reference-only job of this
        evaluator measured it; None before one has."""
        return self._footprints.get(self._footprint_key(task.for_target(self._target)))

    def _learn_footprint(self, task: Task, ref: JobOutcome) -> None:
        found = Footprint.of(ref)
        if found is not None:
            self._footprints[self._footprint_key(task)] = found

    def _verify_layout(self, measured: Footprint | None) -> Literal["side_by_side", "reference_first"]:
        """Verify's layout (`VerifyConfig.layout`): "auto" runs a task side by side unless its
        measured reference held more than `side_by_side_share` of the device's memory (GPU) or
        of the host's."""
        v = self.config.verify
        if v.layout != "auto":
            return v.layout
        if measured is None:
            return "side_by_side"
        share = v.side_by_side_share
        fits = measured.host_bytes <= share * _host_memory_bytes()
        if self._target == Target.CUDA and measured.device_bytes is not None:
            total = gpu_memory_bytes(0)
            fits = fits and (total is None or measured.device_bytes <= share * total)
        return "side_by_side" if fits else "reference_first"

    def _candidate_limits(self, task: Task) -> LimitsConfig:
        """A job that runs the candidate's code: `LimitsConfig.memory_mb` plus the host memory the
        task's reference took (`footprint`; KernelBench builds its models on the host, then moves
        them), once measured. The trusted reference's measurement, not the candidate's."""
        limits = self.config.limits
        measured = self._footprints.get(self._footprint_key(task))
        if measured is None or measured.host_bytes <= 0:
            return limits
        return limits.model_copy(update={"memory_mb": limits.memory_mb + ((measured.host_bytes + (1 << 20) - 1) >> 20)})

    def _reference_limits(self) -> LimitsConfig:
        """The reference-only job's (the task's own code, no candidate's): `memory_mb`, or a
        quarter of the host's memory where that is more, so that the first measure of a large
        problem is not cut short."""
        limits = self.config.limits
        return limits.model_copy(update={"memory_mb": max(limits.memory_mb, (_host_memory_bytes() >> 20) // 4)})

    def _memory_note(self, limits: LimitsConfig, reference: bool = False) -> str:
        base = self.config.limits.memory_mb
        how = (f"LimitsConfig.memory_mb, {base} MiB" if limits.memory_mb == base
               else f"a quarter of the host's memory, above LimitsConfig.memory_mb ({base} MiB)" if reference
               else f"LimitsConfig.memory_mb, {base} MiB, plus the {limits.memory_mb - base} MiB the task's "
                    "reference took on the host")
        return f" (host memory limit {limits.memory_mb} MiB: {how}; raise LimitsConfig.memory_mb for larger problems)"

    def _verify_failure(self, o: JobOutcome, kind: ErrorKind, msg: str) -> VerifyResult:
        audit = AuditResult(mode=self.config.mode, passed=False, reasons=[msg]) if kind in (
            ErrorKind.AUDIT, ErrorKind.TAMPER) else None
        out = o.output.strip()
        if out and kind not in (ErrorKind.CRASH,):
            msg += "\n--- output ---\n" + out[-2000:]
        return VerifyResult(ok=False, error_kind=kind, error=msg, audit=audit,
                            reasons=[msg.splitlines()[0] if msg else kind.value])

    def _verify_result(self, o: JobOutcome, cmp: Comparison, artifact_dir: str | None = None,
                       workspace: str | None = None) -> VerifyResult:
        final = o.final or {}
        ops = {str(k): int(v) for k, v in (final.get("ops") or {}).items()}
        forbidden = forbidden_ops(ops)  # our own copy of the rule, not the worker's verdict
        audit_reasons: list[str] = []
        notes: list[str] = []  # facts that fail nothing by themselves (`Audit.kernels`)
        share = final.get("own_kernel_share")
        try:
            kernel_forbidden, kernel_reasons, audit_share = self.audit.kernels(final, artifact_dir, workspace, notes)
        except Exception as e:  # noqa: BLE001 - an object that cannot be read fails the audit, named
            kernel_forbidden, kernel_reasons, audit_share = ["<imports>"], [f"the import audit failed: {e}"], None
        ops.update({str(k): int(v) for k, v in (final.get("kernels") or {}).items()})  # measured, for the profile
        if audit_share is not None:
            share = audit_share
        if self.config.mode == "strict":
            passed = not forbidden and not kernel_forbidden
            if forbidden:
                audit_reasons.append("strict mode: ModelNew.forward ran torch compute ops " + ", ".join(forbidden)
                                     + " (only your own kernels plus allocation/view ops are allowed)")
            audit_reasons += kernel_reasons
            forbidden += kernel_forbidden
        elif kernel_reasons:
            passed = False
            audit_reasons += kernel_reasons
        else:
            passed = share is not None and share >= self.config.verify.min_own_share
            if not passed:
                audit_reasons.append(f"permissive mode: your own kernels did {0 if share is None else share:.0%} "
                                     f"of the work (needs >= {self.config.verify.min_own_share:.0%})")
        audit_reasons += notes
        audit = AuditResult(mode=self.config.mode, passed=passed, forbidden_ops=forbidden, ops_seen=ops,
                            own_kernel_share=share, reasons=audit_reasons)
        correct = cmp.kind is None and cmp.passed == cmp.trials and cmp.trials >= self.config.verify.trials
        params = final.get("params") or None
        reasons = list(cmp.reasons) + audit_reasons + ([f"parameters: {params}"] if params else [])
        if cmp.sampled:
            reasons.append(f"output{'s' if len(cmp.sampled) > 1 else ''} {', '.join(map(str, cmp.sampled))} "
                           f"(over {self.config.verify.whole_output_mb} MiB) checked by samples and projections, "
                           "not element by element: in each trial, values at secret positions and secret +-1 "
                           "weighted sums of every element")
        kind = None
        if not correct:
            kind = ErrorKind(cmp.kind or "mismatch")
        elif not passed:
            kind = ErrorKind.AUDIT
        return VerifyResult(ok=correct and passed, correct=correct, trials=cmp.trials, trials_passed=cmp.passed,
                            max_abs_error=cmp.max_abs_error, sampled_outputs=cmp.sampled, audit=audit, params=params,
                            error_kind=kind,
                            error="\n".join(reasons) or None, reasons=reasons)

    # -- profile ----------------------------------------------------------------------------
    def library_baselines_for(self, task: Task) -> tuple[str, ...]:
        """The library baselines measured for `task`: cuBLASLt's for the GEMM family's tasks."""
        return LIBRARY_BASELINES if self.config.library_baselines and task.source == GEMM_SOURCE else ()

    async def abaselines(self, task: Task, timing: TimingConfig | None = None) -> dict[str, Any]:
        """Eager, torch.compile and library (`library_baselines_for`) timings of the reference
        under `timing` (default: the config's), measured once (`ameasure_baselines`), then cached."""
        task = task.for_target(self._target)
        timing = timing or self.config.timing
        library = self.library_baselines_for(task)
        key = BaselineCache.key(task.digest, self.device_name, timing, self.config.compile_baseline, library)
        cached = self.baselines.get(key)
        if cached is not None:
            return {**cached, "cached": True}
        lock = self._baseline_locks.setdefault(key, threading.Lock())
        while not lock.acquire(blocking=False):
            await asyncio.sleep(0.05)
        try:
            cached = self.baselines.get(key)
            if cached is not None:
                return {**cached, "cached": True}
            # re-measured while disturbed (a busy host), and then never cached: see BaselineCache
            value = await self.baselines.measure(lambda: self.ameasure_baselines(task, timing))
            if "error" not in value and not value.get("disturbed"):
                self.baselines.put(key, value)
            return {**value, "cached": False}
        finally:
            lock.release()

    async def ameasure_baselines(self, task: Task, timing: TimingConfig | None = None) -> dict[str, Any]:
        """One baseline job of `task` under `timing`, past the cache: each role's call times
        (ms; ``eager_ms``, ``compile_ms``, ``library_ms`` by name), the roofline inputs, and why
        a baseline is missing; or ``{"error": ...}``. What `abaselines` caches; a benchmark's
        way to measure the spread of separate jobs."""
        task = task.for_target(self._target)
        timing = timing or self.config.timing
        library = self.library_baselines_for(task)
        cache = self.config.cache_dir
        tol = task.effective_tolerance
        job = self._job("baseline", task, None, with_compile_baseline=self.config.compile_baseline,
                        writable=[str(cache / "home")], timing=timing, library_baselines=list(library),
                        library_tolerance=(tol.atol, tol.rtol))
        # Only the trusted reference runs here; inductor writes large precompiled headers.
        job.limits = job.limits.model_copy(update={"timeout_s": max(job.limits.timeout_s, 600),
                                                   "max_file_mb": 4096, "memory_mb": max(job.limits.memory_mb, 16384)})
        feed = CallFeed(timing, ("eager", "compiled", *library))
        o = await self.sandbox.run(job, self.device, feed)
        failure = outcome_failure(o, "baseline")
        if failure or feed.violations:
            return {"error": failure[1] if failure else feed.violations[0]}
        f = o.final or {}
        value = {k: f.get(k) for k in ("compile_error", "bytes", "flops", "close_elements", "close_strided",
                                       "device_name")}
        value.update(eager_ms=feed.times_ms("eager"), compile_ms=feed.times_ms("compiled") or None,
                     eager_clock_gap_ms=feed.clock_gap_ms("eager"), eager_late_launches=feed.late_launches("eager"),
                     breakdown=_job_breakdown("baseline", o),
                     harness_overhead_ns=(f.get("diagnostics") or {}).get("harness_overhead_ns"),
                     host_load=o.host_load,
                     loop_windows_s=[(c[0].asked_s, c[-1].asked_s + (c[-1].wall_ms or 0) / 1e3)
                                     for r in ("eager", "compiled", *library) if (c := feed.timed(r))])
        if library:
            value.update(library_ms={n: ms for n in library if (ms := feed.times_ms(n))},
                         library_errors=f.get("library_errors") or {})
        return value

    async def aprofile(self, task: Task, workspace: Workspace, ncu: bool = False,
                       measured: VerifyResult | None = None) -> ProfileResult:
        """Time the candidate against cached baselines; re-check outputs of timed calls. With
        `server_gap_ms` configured, a second job in server mode (`ServerTiming`), held to the
        same checks: a failure there fails the profile. With `measured` (the verify of the same
        build), permissive mode also holds the timed calls to the foreign work its trials did."""
        t0 = time.perf_counter()
        task = task.for_target(self._target)
        files = workspace.source_digest()  # before any job runs the candidate's code (the evidence's files)
        built = await self.toolchain.abuild(workspace, self._target)
        if not built.ok:
            return ProfileResult(ok=False, error_kind=ErrorKind.COMPILE, error="\n".join(built.errors))
        params = measured.params_path if measured is not None else "seed"
        result = await self._timed_profile(task, workspace, built, self.config.timing, t0, measured, params)
        params = result.params_path
        server = self.config.server_timing()
        if result.ok and server is not None and server.idle_ms is not None:
            s = await self._timed_profile(task, workspace, built, server, time.perf_counter(), measured, params)
            if not s.ok or s.candidate is None:
                why = [f"server mode ({server.idle_ms[0]:g}-{server.idle_ms[1]:g} ms gaps): {r}" for r in s.reasons]
                return s.model_copy(update={"reasons": why or ["server mode failed"],
                                            "seconds": time.perf_counter() - t0})
            result.server = ServerTiming(gap_ms=server.idle_ms, candidate=s.candidate, eager=s.eager,
                                         compiled=s.compiled,
                                         speedup_vs_eager=s.speedup_vs_eager, speedup_vs_compile=s.speedup_vs_compile,
                                         library=s.library, speedup_vs_library=s.speedup_vs_library)
            result.breakdown["server_s"] = s.seconds
            result.timed_ops = [*result.timed_ops, *s.timed_ops]
        if ncu and self._target == Target.CUDA:
            result = result.model_copy(update={"ncu": await self._ancu(task, workspace, built.artifact_dir)})
        key = self.evidence(task, files, built) if result.ok else None
        return result.model_copy(update={"seconds": time.perf_counter() - t0, "evidence": key})

    def evidence(self, task: Task, files: str, built: CompileResult) -> str:
        """The evidence key of a profile of `task` (`cudagym.rewards.reuse`): the build, the
        source files' digest (`files`, taken before any job ran), the task, the device and the
        settings that decide a profile."""
        settings = self.config.model_dump_json(exclude={"reward", "cache_dir"})
        return evidence_key(build=Path(built.artifact_dir).name if built.artifact_dir else None, files=files,
                            task=task.model_dump_json(exclude={"path"}),
                            device=f"{self._target.value}:{self.device_name}", settings=settings,
                            protocol=f"{PROTOCOL_VERSION}|cudagym {cudagym.__version__}|torch {torch.__version__}")

    async def _reused_profile(self, task: Task, workspace: Workspace, files: str, verified: VerifyResult,
                              profiled: ProfileMemo) -> ProfileResult | None:
        """The timing of an accepted profile of this episode (`profiled`) with the same evidence as
        a submit of `workspace` (its files' digest `files`, verified as `verified`), checked again
        where the submit's verify decides (the parameters path, permissive mode's foreign work per
        call); None where none applies (then the submit times it)."""
        t0 = time.perf_counter()
        built = await self.toolchain.abuild(workspace, self._target)  # verify's build: from the cache
        if not built.ok:
            return None
        prior = profiled.lookup(self.evidence(task, files, built))
        if prior is None or prior.params_path != verified.params_path:
            return None
        for ops in prior.timed_ops:
            why = await asyncio.to_thread(self.audit.timed_calls, ops, built.artifact_dir, verified,
                                          str(workspace.root))
            if why:
                return ProfileResult(ok=False, error_kind=ErrorKind.AUDIT, error=why, reasons=[why],
                                     params_path=prior.params_path, seconds=time.perf_counter() - t0)
        note = (f"{REUSED}the profile of this episode that timed this same build under the same settings "
                f"(evidence {prior.evidence[:12] if prior.evidence else '-'}) stands for this submit; "
                "verify ran again")
        return prior.model_copy(update={"reused": True, "ncu": None, "reasons": [*prior.reasons, note],
                                        "seconds": time.perf_counter() - t0,
                                        "breakdown": {"reuse_check_s": time.perf_counter() - t0}})

    async def _ancu(self, task: Task, workspace: Workspace, artifact_dir: str | None) -> dict[str, Any]:
        """Nsight Compute's metrics of the candidate's calls: an `ncu` job (`cudagym.sandbox.ncu`)
        run through the sandbox like any other; why there are none, as {"error": ...}."""
        job = self._job("ncu", task, workspace, artifact_dir=artifact_dir)
        job.limits = ncu_job_limits(job.limits)
        o = await self.sandbox.run(job, self.device)
        if o.timed_out:
            return {"error": "ncu timed out"}
        failure = outcome_failure(o, "ncu")
        if failure:
            return {"error": failure[1]}
        metrics = (o.final or {}).get("ncu")
        return metrics if isinstance(metrics, dict) else {"error": "ncu: the worker returned no metrics"}

    async def _timed_profile(self, task: Task, workspace: Workspace, built: Any, timing: TimingConfig,
                             t0: float, measured: VerifyResult | None = None,
                             params: Literal["seed", "state_dict"] = "seed", busy_tries: int = 2) -> ProfileResult:
        """One profile job under `timing` against its baselines, with every check of `aprofile`;
        ModelNew's parameters as `averify` decides them (`params`; without a verify of the same
        build, a second try with Model's state_dict where the first's re-checked outputs are wrong).
        A CPU job the host was too busy to time (`cpu_times_agree`'s `device_busy`) runs again
        after a pause, up to `busy_tries` jobs in all: only the last one's result counts, and each
        goes through every check, so a candidate that behaves differently across them gains
        nothing one job could not."""
        t_built = time.perf_counter()
        base = await self.abaselines(task, timing)
        t_base = time.perf_counter()
        if "error" in base:
            return ProfileResult(ok=False, error_kind=ErrorKind.INTERNAL, error=f"baseline failed: {base['error']}",
                                 seconds=time.perf_counter() - t0)
        init_seed = secrets.randbits(62) | 1
        feed = CallFeed(timing, ("candidate",))
        close, strided = base.get("close_elements"), base.get("close_strided")
        if isinstance(close, (int, float)) and isinstance(strided, (int, float)) and close >= 0 and strided >= 0:
            feed.max_close_elements = (int(close), int(strided))
        job = self._job("profile", task, workspace, artifact_dir=built.artifact_dir, init_seed=init_seed, timing=timing,
                        params=params)
        o = await self.sandbox.run(job, self.device, feed)
        t_job = time.perf_counter()
        bw, flops = peaks_for(self.device_name if self._target == Target.CUDA else "cpu")
        floor_ms = max((base.get("bytes") or 0) / bw, (base.get("flops") or 0) / flops) * 1e3

        def reference(**plan: Any) -> Awaitable[JobOutcome]:  # a reference-only worker on the same parameters
            return self.sandbox.run(self._job("reference", task, None, init_seed=init_seed, **plan), self.device)

        run = TimedRun(task, o, feed, timing, built.artifact_dir, measured, self.audit, reference, floor_ms,
                       self.config.roofline_slack, workspace=str(workspace.root))
        done_s: dict[str, float] = {}
        refusal, notes = await apply_checks(run, done_s=done_s)  # `checks.PROFILE_CHECKS`, in order
        release_later(o)
        t_cmp = done_s.get("timed_outputs_match", time.perf_counter())
        if refusal is not None and refusal.by == "timed_outputs_match" and refusal.kind == ErrorKind.MISMATCH \
                and params == "seed" and measured is None and run.final.get("params_retry"):
            return await self._timed_profile(task, workspace, built, timing, t0, None, "state_dict", busy_tries)
        if refusal is not None and refusal.by == "cpu_times_agree" and refusal.kind == ErrorKind.DEVICE_BUSY \
                and busy_tries > 1:
            await asyncio.sleep(CPU_BUSY_PAUSE_S)
            again = await self._timed_profile(task, workspace, built, timing, t0, measured, params, busy_tries - 1)
            note = f"timed again: the host was too busy to time the first job ({refusal.reason})"
            return again.model_copy(update={"reasons": [*again.reasons, note]})
        if refusal is not None and not refusal.measured:
            return ProfileResult(ok=False, error_kind=refusal.kind, error=refusal.error, reasons=[refusal.reason],
                                 clock_gap_ms=refusal.clock_gap_ms, seconds=time.perf_counter() - t0)
        final, cand = run.final, run.stats
        eager = TimingStats.from_samples(base["eager_ms"]) if base.get("eager_ms") else None
        comp = TimingStats.from_samples(base["compile_ms"]) if base.get("compile_ms") else None
        library = {n: TimingStats.from_samples(ms) for n, ms in (base.get("library_ms") or {}).items() if ms}
        reasons: list[str] = list(base.get("notes") or [])  # baselines re-measured or disturbed
        if base.get("compile_error"):
            reasons.append(f"torch.compile baseline unavailable: {base['compile_error'][:200]}")
        for name, why in (base.get("library_errors") or {}).items():
            reasons.append(f"{LIBRARY_TITLES.get(name, name)} baseline unavailable: {why[:300]}")
        if params == "state_dict":
            reasons.append("parameters: " + str(final.get("params") or "Model's state_dict loaded into ModelNew"))
        reasons += notes  # (before the result is built: the model keeps a copy of the list it is given)
        result = ProfileResult(
            ok=True, candidate=cand, eager=eager, compiled=comp,
            speedup_vs_eager=eager.median_ms / cand.median_ms if eager and cand.median_ms > 0 else None,
            speedup_vs_compile=comp.median_ms / cand.median_ms if comp and cand.median_ms > 0 else None,
            library=library, speedup_vs_library={n: s.median_ms / cand.median_ms for n, s in library.items()
                                                 if cand.median_ms > 0},
            roofline_floor_ms=floor_ms, baselines_cached=bool(base.get("cached")),
            telemetry=final.get("telemetry") or {}, reasons=reasons,
            harness_overhead_ns=run.diagnostics.get("harness_overhead_ns"), close_timeouts=run.close_timeouts,
            clock_gap_ms=run.clock_gap_ms, params_path=params, timed_ops=[run.timed_ops],
        )
        if self._target == Target.CUDA:
            result.late_launches, result.host_ms = run.late_launches
        if refusal is not None:  # refused as measured (implausible): the times stand beside the verdict
            result = result.model_copy(update={"ok": False, "error_kind": refusal.kind, "error": refusal.error,
                                               "reasons": [*reasons, refusal.reason]})
        breakdown = {"build_check_s": t_built - t0, "baselines_s": t_base - t_built, "job_s": t_job - t_base,
                     **_job_breakdown("candidate", o), "compare_s": t_cmp - t_job,
                     **{f"feed.candidate_{k}": v for k, v in feed.timeline("candidate").items()},
                     "stats_s": time.perf_counter() - t_cmp}
        return result.model_copy(update={"seconds": time.perf_counter() - t0, "breakdown": breakdown})

    # -- the whole pipeline -----------------------------------------------------------------
    async def aevaluate(self, task: Task, workspace: Workspace, profiled: ProfileMemo | None = None) -> Verdict:
        """compile → verify → profile → milestone reward (what `submit` does). `profiled`: the
        episode's profiles, whose timing the submit takes where one measured the same evidence
        (`cudagym.rewards.reuse`)."""
        before = workspace.source_digest()
        c = await self.acompile(task, workspace)
        if not c.ok:
            return milestone_verdict(c, None, None, self.config.reward)
        v, p = await self.ajudge(task, workspace, profiled, before)
        return milestone_verdict(c, v, p, self.config.reward)

    async def ajudge(self, task: Task, workspace: Workspace, profiled: ProfileMemo | None = None,
                     before: str | None = None) -> tuple[VerifyResult, ProfileResult | None]:
        """The device half of a submit, once compiled: verify, then (if correct) the timing: the
        episode's profile of the same evidence (`profiled`, `reuse_profiles`), else a profile job.
        `before`: the source files' digest before the submit ran any of the candidate's code."""
        before = before or workspace.source_digest()
        v = await self.averify(task, workspace)
        # verify ran the candidate's code with its workspace writable: a solution that rewrote itself
        # there would have its profile build and time other code than the code verified
        if v.ok and workspace.source_digest() != before:
            why = "the solution's code rewrote its own source files while it was verified"
            v = v.model_copy(update={"ok": False, "error_kind": ErrorKind.TAMPER, "error": why,
                                     "reasons": [*v.reasons, why]})
        if not v.ok:
            return v, None
        p = None
        if profiled is not None and self.config.reuse_profiles:
            p = await self._reused_profile(task.for_target(self._target), workspace, before, v, profiled)
        if p is None:
            p = await self.aprofile(task, workspace, measured=v)
            if p.ok and workspace.source_digest() != before:
                why = "the solution's code rewrote its own source files while it was profiled"
                p = p.model_copy(update={"ok": False, "error_kind": ErrorKind.TAMPER, "error": why, "reasons": [why]})
        return v, p

    # -- sync forms ---------------------------------------------------------------------------
    def _sync(self, coro: Any) -> Any:
        return run_sync(coro, async_form="the async form (await evaluator.a...)")

    def compile(self, task: Task, workspace: Workspace) -> CompileResult:
        return self._sync(self.acompile(task, workspace))

    def verify(self, task: Task, workspace: Workspace) -> VerifyResult:
        return self._sync(self.averify(task, workspace))

    def profile(self, task: Task, workspace: Workspace, ncu: bool = False) -> ProfileResult:
        return self._sync(self.aprofile(task, workspace, ncu))

    def evaluate(self, task: Task, workspace: Workspace, profiled: ProfileMemo | None = None) -> Verdict:
        return self._sync(self.aevaluate(task, workspace, profiled))

    def close(self) -> None:
        self.sandbox.close()

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
