"""The evaluator: compile → verify → profile → milestone reward.

One `Evaluator` serves many episodes: it owns the build cache (`Toolchain`), the sandbox with
its spare workers, and the baseline cache. Every check runs in a fresh sandboxed worker; the
evaluator compares outputs and computes statistics itself, out of the candidate's reach.

Sync methods call the async ones; the async ones are safe to run concurrently.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field, field_validator, model_validator

from cudagym.core.audit import (
    Origins, foreign_kernels, foreign_work, forbidden_ops, op_counts, own_time_share, unmeasured_work,
)
from cudagym.rewards.compare import Comparison, compare_outputs, decode_tensor, projected_mismatch, projection_seeds
from cudagym.rewards.milestone import RewardConfig, milestone_verdict
from cudagym.core.verdict import (
    AuditMode, AuditResult, CompileResult, ErrorKind, ProfileResult, ServerTiming, TimingStats, Verdict, VerifyResult,
)
from cudagym.sandbox.base import JobOutcome, Sandbox
from cudagym.sandbox.baselines import BaselineCache
from cudagym.sandbox.bridge import run_sync
from cudagym.sandbox.config import LocalSandboxConfig, SandboxConfig, reject_moved
from cudagym.sandbox.feed import CallFeed, TrialFeed
from cudagym.sandbox.gpu import cpu_name, gpu_count, gpu_names, peaks_for
from cudagym.sandbox.inline import InlineBuild, InlineBuildCache, InlineCompileError
from cudagym.sandbox.library import LIBRARY_BASELINES, LIBRARY_TITLES
from cudagym.sandbox.origin import MODEL_CALLS_KEY, ImportAudit, candidate_objects, import_audit, records_from_counts
from cudagym.sandbox.protocol import LimitsConfig, TimingConfig, VerifyConfig
from cudagym.sandbox.toolchain import Toolchain, ToolchainConfig
from cudagym.sandbox.worker.wire import Job
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


_KIND = {k.value: k for k in ErrorKind}
MAX_INLINE_PASSES = 6  # compile passes of a solution with extensions (each runs it once)


def _outcome_failure(o: JobOutcome, what: str) -> tuple[ErrorKind, str] | None:
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
        return ErrorKind.CRASH, (f"{what}: the worker crashed" + (f" (signal {sig})" if sig else f" (exit {o.returncode})")
                                 + (f"\n{tail}" if tail else ""))
    if not o.final.get("ok"):
        kind = _KIND.get(str(o.final.get("kind")), ErrorKind.EXCEPTION)
        if o.process_limited and kind in (ErrorKind.EXCEPTION, ErrorKind.CRASH):
            kind = ErrorKind.PROCESS_LIMIT
        return kind, str(o.final.get("error", "failed"))
    return None


_RELEASER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cudagym-release")


def _comparer_threads() -> None:
    # A few intra-op threads, set for this thread only: with every core's thread in each op,
    # one core busy elsewhere (a spare starting) stalls every op of the comparison.
    import torch

    torch.set_num_threads(max(1, min(8, (os.cpu_count() or 2) // 4)))


_COMPARER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cudagym-compare", initializer=_comparer_threads)


async def _compare(o: JobOutcome, task: Task) -> Comparison:
    """Compare the outcome's outputs on the comparer thread (the event loop stays free).

    Never raises: `compare_outputs` turns whatever the worker sent into a verdict, and a failure
    of the comparison itself (out of memory, a bug) is a Comparison of kind "internal".
    """
    try:
        return await asyncio.get_running_loop().run_in_executor(
            _COMPARER, compare_outputs, o.tensors, task.effective_tolerance)
    except Exception as e:  # noqa: BLE001 - the evaluator's failure, not the candidate's: named, not raised
        return Comparison(trials=0, passed=0, max_abs_error=None, kind=ErrorKind.INTERNAL.value,
                          reasons=[f"the evaluator failed to compare the outputs: {type(e).__name__}: {e}"])


def _raw(t: Any) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def sampled_pairs(candidate: list[tuple[dict[str, Any], Any]], reference: list[tuple[dict[str, Any], Any]],
                  picks: list[tuple[int, int]]) -> list[tuple[dict[str, Any], bytes]] | str:
    """Candidate/reference frames for `compare_outputs` from the samples of the picked timed
    calls (`picks[t]` = (call index, seed); the reference worker ran seed t as its trial t): the
    reference's outputs at the sampled positions. A string names a structural mismatch."""
    samples: dict[tuple[int, int], dict[str, Any]] = {}
    for h, payload in candidate:
        if h.get("role") in ("sample", "positions"):
            samples.setdefault((h.get("trial"), h.get("index")), {})[h["role"]] = (h, payload)
    refs: dict[tuple[int, int], tuple[dict[str, Any], Any]] = {
        (h.get("trial"), h.get("index")): (h, p) for h, p in reference if h.get("role") == "reference"}
    pairs: list[tuple[dict[str, Any], bytes]] = []
    for t, (call, _seed) in enumerate(picks):
        outs = sorted(j for (c, j) in samples if c == call)
        want = sorted(j for (tt, j) in refs if tt == t)
        if outs != want:
            return f"timed call {call}: ModelNew returned {len(outs)} outputs, the reference {len(want)}"
        for j in outs:
            sh, sp = samples[(call, j)]["sample"]
            rh, rp = refs[(t, j)]
            if list(sh.get("full_shape") or []) != list(rh.get("shape") or []) or sh.get("dtype") != rh.get("dtype"):
                return (f"timed call {call}: output {j} is {sh.get('dtype')} {tuple(sh.get('full_shape') or [])}, "
                        f"expected {rh.get('dtype')} {tuple(rh.get('shape') or [])}")
            ref = decode_tensor(rh, rp)
            if "positions" in samples[(call, j)]:
                ph, pp = samples[(call, j)]["positions"]
                idx = decode_tensor(ph, pp)
                if idx.dtype != torch.int64 or idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= ref.numel()):
                    return f"timed call {call}: the sampled positions of output {j} are invalid"
                ref = ref.reshape(-1)[idx]
            head = {"trial": t, "index": j, "dtype": rh.get("dtype"), "shape": list(ref.shape)}
            pairs.append(({**head, "role": "candidate", "shape": list(sh.get("shape") or [])}, bytes(sp)))
            pairs.append(({**head, "role": "reference"}, _raw(ref)))
    return pairs


def _release_later(*outcomes: JobOutcome) -> None:
    """Drop the outcomes' output bytes on a background thread: unmapping hundreds of MB of
    result memory takes a while, and nothing waits for it."""
    held = [o.tensors for o in outcomes]
    for o in outcomes:
        o.tensors = []
    _RELEASER.submit(held.clear)


def _job_breakdown(role: str, o: JobOutcome) -> dict[str, float]:
    """Seconds spent waiting for a ready worker, in the worker, and in each of its phases."""
    return {f"{role}.wait_ready_s": o.wait_s, f"{role}.wait_device_s": o.lease_wait_s, f"{role}.worker_s": o.seconds,
            **{f"{role}.{k}_s": v for k, v in o.phases.items()}}


class Evaluator:
    """compile / verify / profile / evaluate a workspace for a task; async forms `a*`."""

    def __init__(self, config: EvaluatorConfig | None = None, sandbox: Sandbox | None = None):
        self.config = config or EvaluatorConfig()
        self._target = resolve_target(self.config.target)
        cache = Path(self.config.cache_dir)
        cache.mkdir(parents=True, exist_ok=True)
        self.toolchain = Toolchain(cache / "build", self.config.toolchain)
        self.inline_cache = InlineBuildCache(cache / "build", self.toolchain.bound,
                                            self.toolchain.config.max_build_output_mb << 20)
        self.sandbox = sandbox or self.config.sandbox.open(home=cache / "home", read_only=[cache])
        self.baselines = BaselineCache(cache / "baselines")
        self._baseline_locks: dict[str, threading.Lock] = {}

    @property
    def target(self) -> Target:
        return self._target

    @property
    def device(self) -> str:
        return "cuda" if self._target == Target.CUDA else "cpu"

    @property
    def device_name(self) -> str:
        return gpu_names()[0] if self._target == Target.CUDA and gpu_names() else cpu_name()

    def _job(self, kind: str, task: Task, ws: Workspace | None, **kw: Any) -> Job:
        return Job(kind=kind, nonce=secrets.token_hex(16), task_id=task.id, task_code=task.code, dtype=task.dtype,
                   device=self.device, workspace=str(ws.root) if ws else "", cache_dir=str(self.config.cache_dir / "build"),
                   mode=self.config.mode, seed=secrets.randbits(62), verify=self.config.verify,
                   timing=kw.pop("timing", self.config.timing), limits=self.config.limits, **kw)

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
            failure = _outcome_failure(outcome, "running model_new.py for its extensions")
            if failure:
                return failed([failure[1]], outcome.output[-4000:])
            final = outcome.final or {}
            requests = final.get("requests")
            try:
                builds = [self.inline_cache.prepare(r, workspace.root) for r in (requests if isinstance(requests, list) else [])]
            except InlineCompileError as e:
                return failed(str(e).splitlines())
            new = {b.key: b for b in builds if b.key not in handled}
            if not new:
                break
            if n == MAX_INLINE_PASSES:
                return failed([f"model_new.py still asked for new extensions ({', '.join(b.name for b in new.values())}) "
                               f"after {MAX_INLINE_PASSES} compile passes (each runs it once and builds what it asked for)"])
            handled.update(new)
            todo = [b for b in new.values() if not self.inline_cache.cached(b, workspace.root)]
            errors = [e for e in await asyncio.gather(*(self._abuild_inline(task, b, workspace) for b in todo)) if e]
            if errors:
                return failed([line for e in errors for line in e.splitlines()])
            built_any = built_any or bool(todo)
        if builds:  # asked for again although built (or found) by this compile: its inputs changed meanwhile
            return failed([f"{b.kind} module '{b.name}' ({b.site}) is in the build cache, but model_new.py did not find "
                           "it there: the files it is built from changed while the compile step ran" for b in builds])
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
            failure = _outcome_failure(outcome, f"building {build.kind} module '{build.name}' ({build.site})")
            if failure:
                return failure[1]
            self.inline_cache.store(build, staging, build_dir, workspace.root, outcome.paths)
            return None
        except InlineCompileError as e:
            return str(e)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    # -- verify -----------------------------------------------------------------------------
    async def averify(self, task: Task, workspace: Workspace,
                      params: Literal["seed", "state_dict"] = "seed") -> VerifyResult:
        """Correctness over fresh secret-seeded trials plus the op audit, in a fresh worker.

        ModelNew runs with its own same-seed parameters; only where they differ from Model's under
        the same names and the outputs are wrong does a second verify load Model's state_dict
        (`harness.Problem`); `VerifyResult.params_path` says which decided."""
        t0 = time.perf_counter()
        task = task.for_target(self._target)
        built = await self.toolchain.abuild(workspace, self._target)
        if not built.ok:
            return VerifyResult(ok=False, error_kind=ErrorKind.COMPILE, error="\n".join(built.errors),
                                reasons=["does not compile"], seconds=time.perf_counter() - t0)
        t_built = time.perf_counter()
        imports = self._import_audit(built.artifact_dir, [])
        if self.config.mode == "strict" and imports.forbidden:
            why = ("strict mode: your built code imports what strict mode forbids (torch's compute below the dispatcher, run-time symbol lookup, RecordFunction's switches): "
                   + "; ".join(imports.reasons()))
            return VerifyResult(ok=False, error_kind=ErrorKind.AUDIT, error=why, reasons=[why],
                                audit=AuditResult(mode="strict", passed=False, reasons=[why],
                                                  forbidden_ops=[s for s, _, _ in imports.forbidden]),
                                seconds=time.perf_counter() - t0)
        n = self.config.verify.trials
        orders = ["candidate_first"] * (n // 2) + ["reference_first"] * (n - n // 2)
        secrets.SystemRandom().shuffle(orders)
        init_seed = secrets.randbits(62) | 1
        plan = dict(trial_seeds=[secrets.randbits(62) for _ in range(n)],
                    trial_scales=[0.5 if (self.config.verify.scaled_trial and t == n - 1) else 1.0 for t in range(n)],
                    trial_orders=orders)
        # the candidate's worker learns each trial's inputs only when the trial starts
        feed = TrialFeed(plan["trial_seeds"], plan["trial_scales"], plan["trial_orders"])
        cand_job = self._job("verify", task, workspace, artifact_dir=built.artifact_dir, init_seed=init_seed, trials=n,
                             params=params)
        ref_job = self._job("reference", task, None, init_seed=init_seed, **plan)
        outcome, ref = await asyncio.gather(self.sandbox.run(cand_job, self.device, feed),
                                            self.sandbox.run(ref_job, self.device))
        ref_failure, failure = _outcome_failure(ref, "reference"), _outcome_failure(outcome, "verify")
        if feed.violations:
            failure = ErrorKind.TAMPER, "verify: " + feed.violations[0]
        if ref_failure and not failure:
            return VerifyResult(ok=False, error_kind=ErrorKind.INTERNAL, error=f"the reference failed: {ref_failure[1]}",
                                reasons=["the reference itself failed (not the candidate's fault)"],
                                seconds=time.perf_counter() - t0)
        # Only the reference-only worker's outputs count; the candidate's process cannot forge them.
        outcome.tensors = [f for f in outcome.tensors if f[0].get("role") == "candidate"]
        outcome.tensors += [f for f in ref.tensors if f[0].get("role") == "reference"]
        t_jobs = time.perf_counter()
        if failure:
            result = self._verify_failure(outcome, *failure)
        else:
            result = self._verify_result(outcome, await _compare(outcome, task), built.artifact_dir)
        _release_later(outcome, ref)
        breakdown = {"build_check_s": t_built - t0, **_job_breakdown("candidate", outcome),
                     **_job_breakdown("reference", ref), "jobs_s": t_jobs - t_built,
                     "compare_s": time.perf_counter() - t_jobs}
        result = result.model_copy(update={"breakdown": breakdown, "seconds": time.perf_counter() - t0,
                                           "params_path": params})
        if params == "seed" and result.error_kind == ErrorKind.MISMATCH and (outcome.final or {}).get("params_retry"):
            second = await self.averify(task, workspace, params="state_dict")
            if second.error_kind != ErrorKind.MISMATCH:  # right with Model's parameters: that try decides
                return second.model_copy(update={"seconds": result.seconds + second.seconds})
            result.reasons.append("also wrong with Model's state_dict loaded into ModelNew")
        return result

    def _verify_failure(self, o: JobOutcome, kind: ErrorKind, msg: str) -> VerifyResult:
        audit = AuditResult(mode=self.config.mode, passed=False, reasons=[msg]) if kind in (
            ErrorKind.AUDIT, ErrorKind.TAMPER) else None
        out = o.output.strip()
        if out and kind not in (ErrorKind.CRASH,):
            msg += "\n--- output ---\n" + out[-2000:]
        return VerifyResult(ok=False, error_kind=kind, error=msg, audit=audit,
                            reasons=[msg.splitlines()[0] if msg else kind.value])

    def _import_audit(self, artifact_dir: str | None, loaded: list[Any]) -> ImportAudit:
        """The imports of the candidate's build artifacts and of the cached extensions its
        worker had loaded (`loaded`: paths it reported; only those under the cache's extension
        root are read, by this process)."""
        inline_root = os.path.realpath(self.config.cache_dir / "build" / "inline")
        extra = [Path(p) for p in loaded if isinstance(p, str) and os.path.realpath(p).startswith(inline_root + "/")
                 and Path(p).is_file()]
        return import_audit(candidate_objects(([Path(artifact_dir)] if artifact_dir else []) + extra))

    def _origins(self, artifact_dir: str | None, imports: ImportAudit) -> Origins:
        return Origins(own_roots=tuple(r for r in (artifact_dir, str(self.config.cache_dir / "build" / "inline")) if r),
                       libraries=frozenset(imports.libraries))

    def _kernel_audit(self, final: dict[str, Any], artifact_dir: str | None) -> tuple[list[str], list[str], float | None]:
        """Verify's kernel-origin and import rules (GPU: every kernel of every trial by origin;
        both targets: the imports of the extensions it loaded): (forbidden, reasons, GPU share)."""
        imports = self._import_audit(artifact_dir, list(final.get("own_objects") or []))
        forbidden: list[str] = []
        reasons: list[str] = []
        if self.config.mode == "strict" and imports.forbidden:
            forbidden += [s for s, _, _ in imports.forbidden]
            reasons.append("strict mode: your built code imports what strict mode forbids (torch's compute below the dispatcher, run-time symbol lookup, RecordFunction's switches): "
                           + "; ".join(imports.reasons()))
        if self._target != Target.CUDA:
            return forbidden, reasons, None
        if final.get("kernels") is None:
            why = final.get("kernel_watch_error") or "no kernel records came back"
            return forbidden + ["<kernel watcher>"], reasons + [f"the kernel-origin audit could not run: {why}"], None
        origins = self._origins(artifact_dir, imports)
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

    def _verify_result(self, o: JobOutcome, cmp: Comparison, artifact_dir: str | None = None) -> VerifyResult:
        final = o.final or {}
        ops = {str(k): int(v) for k, v in (final.get("ops") or {}).items()}
        forbidden = forbidden_ops(ops)  # our own copy of the rule, not the worker's verdict
        audit_reasons: list[str] = []
        share = final.get("own_kernel_share")
        try:
            kernel_forbidden, kernel_reasons, gpu_share = self._kernel_audit(final, artifact_dir)
        except Exception as e:  # noqa: BLE001 - an object that cannot be read fails the audit, named
            kernel_forbidden, kernel_reasons, gpu_share = ["<imports>"], [f"the import audit failed: {e}"], None
        ops.update({str(k): int(v) for k, v in (final.get("kernels") or {}).items()})  # measured, for the profile
        if gpu_share is not None:
            share = gpu_share
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
                audit_reasons.append(f"permissive mode: your own kernels did {0 if share is None else share:.0%} of the "
                                     f"work (needs >= {self.config.verify.min_own_share:.0%})")
        audit = AuditResult(mode=self.config.mode, passed=passed, forbidden_ops=forbidden, ops_seen=ops,
                            own_kernel_share=share, reasons=audit_reasons)
        correct = cmp.kind is None and cmp.passed == cmp.trials and cmp.trials >= self.config.verify.trials
        params = final.get("params") or None
        reasons = list(cmp.reasons) + audit_reasons + ([f"parameters: {params}"] if params else [])
        kind = None
        if not correct:
            kind = ErrorKind(cmp.kind or "mismatch")
        elif not passed:
            kind = ErrorKind.AUDIT
        return VerifyResult(ok=correct and passed, correct=correct, trials=cmp.trials, trials_passed=cmp.passed,
                            max_abs_error=cmp.max_abs_error, audit=audit, params=params, error_kind=kind,
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
        failure = _outcome_failure(o, "baseline")
        if failure or feed.violations:
            return {"error": failure[1] if failure else feed.violations[0]}
        f = o.final or {}
        value = {k: f.get(k) for k in ("compile_error", "bytes", "flops", "device_name")}
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
                return s.model_copy(update={"reasons": why or ["server mode failed"], "seconds": time.perf_counter() - t0})
            result.server = ServerTiming(gap_ms=server.idle_ms, candidate=s.candidate, eager=s.eager, compiled=s.compiled,
                                         speedup_vs_eager=s.speedup_vs_eager, speedup_vs_compile=s.speedup_vs_compile,
                                         library=s.library, speedup_vs_library=s.speedup_vs_library)
            result.breakdown["server_s"] = s.seconds
        if ncu and self._target == Target.CUDA:
            from cudagym.sandbox.ncu import ncu_summary

            result = result.model_copy(update={"ncu": await ncu_summary(self, task, workspace, built.artifact_dir)})
        return result.model_copy(update={"seconds": time.perf_counter() - t0})

    async def _timed_profile(self, task: Task, workspace: Workspace, built: Any, timing: TimingConfig,
                             t0: float, measured: VerifyResult | None = None,
                             params: Literal["seed", "state_dict"] = "seed") -> ProfileResult:
        """One profile job under `timing` against its baselines, with every check of `aprofile`;
        ModelNew's parameters as `averify` decides them (`params`; without a verify of the same
        build, a second try with Model's state_dict where the first's re-checked outputs are wrong)."""
        t_built = time.perf_counter()
        base = await self.abaselines(task, timing)
        t_base = time.perf_counter()
        if "error" in base:
            return ProfileResult(ok=False, error_kind=ErrorKind.INTERNAL, error=f"baseline failed: {base['error']}",
                                 seconds=time.perf_counter() - t0)
        init_seed = secrets.randbits(62) | 1
        feed = CallFeed(timing, ("candidate",))
        job = self._job("profile", task, workspace, artifact_dir=built.artifact_dir, init_seed=init_seed, timing=timing,
                        params=params)
        o = await self.sandbox.run(job, self.device, feed)
        t_job = time.perf_counter()
        failure = _outcome_failure(o, "profile")
        if feed.violations:
            failure = ErrorKind.TAMPER, "profile: " + feed.violations[0]
        times = feed.times_ms("candidate")
        if not failure and not times:
            failure = ErrorKind.TAMPER, "profile: the timed loop ended before the evaluator stopped it"
        if failure:
            _release_later(o)
            return ProfileResult(ok=False, error_kind=failure[0], error=failure[1], reasons=[failure[1].splitlines()[0]],
                                 seconds=time.perf_counter() - t0)
        why = await self._recheck(task, o, feed, init_seed, timing.recheck_calls)
        _release_later(o)
        t_cmp = time.perf_counter()
        if why and why[0] == ErrorKind.MISMATCH and params == "seed" and measured is None \
                and (o.final or {}).get("params_retry"):
            return await self._timed_profile(task, workspace, built, timing, t0, None, "state_dict")
        if why:
            return ProfileResult(ok=False, error_kind=why[0], error=why[1], reasons=[why[1]],
                                 seconds=time.perf_counter() - t0)
        final = o.final or {}
        timed_ops = feed.ops("candidate")  # every call of the loop, warm-up included
        why = self._timed_audit(timed_ops, built.artifact_dir, measured)
        if why:  # verify audits its trials; a candidate may behave differently once timed
            return ProfileResult(ok=False, error_kind=ErrorKind.AUDIT, error=why, reasons=[why],
                                 seconds=time.perf_counter() - t0)
        cand = TimingStats.from_samples(times)
        gap = feed.clock_gap_ms("candidate")
        slack = timing.clock_slack_ms + timing.clock_slack_rel * cand.median_ms
        if gap is not None and gap > slack and self._target == Target.CUDA:
            why = (f"the reported call times are {gap:.4f} ms per call below what the evaluator's own clock saw "
                   f"(median {cand.median_ms:.4f} ms reported; allowed {slack:.4f} ms): forged or tampered timing")
            return ProfileResult(ok=False, error_kind=ErrorKind.TAMPER, error=why, reasons=[why], clock_gap_ms=gap,
                                 seconds=time.perf_counter() - t0)
        eager = TimingStats.from_samples(base["eager_ms"]) if base.get("eager_ms") else None
        comp = TimingStats.from_samples(base["compile_ms"]) if base.get("compile_ms") else None
        library = {n: TimingStats.from_samples(ms) for n, ms in (base.get("library_ms") or {}).items() if ms}
        bw, flops = peaks_for(self.device_name if self._target == Target.CUDA else "cpu")
        floor_ms = max((base.get("bytes") or 0) / bw, (base.get("flops") or 0) / flops) * 1e3
        reasons: list[str] = list(base.get("notes") or [])  # baselines re-measured or disturbed
        if base.get("compile_error"):
            reasons.append(f"torch.compile baseline unavailable: {base['compile_error'][:200]}")
        for name, why in (base.get("library_errors") or {}).items():
            reasons.append(f"{LIBRARY_TITLES.get(name, name)} baseline unavailable: {why[:300]}")
        diag = final.get("diagnostics") or {}
        result = ProfileResult(
            ok=True, candidate=cand, eager=eager, compiled=comp,
            speedup_vs_eager=eager.median_ms / cand.median_ms if eager and cand.median_ms > 0 else None,
            speedup_vs_compile=comp.median_ms / cand.median_ms if comp and cand.median_ms > 0 else None,
            library=library, speedup_vs_library={n: s.median_ms / cand.median_ms for n, s in library.items()
                                                 if cand.median_ms > 0},
            roofline_floor_ms=floor_ms, baselines_cached=bool(base.get("cached")),
            telemetry=final.get("telemetry") or {}, reasons=reasons,
            harness_overhead_ns=diag.get("harness_overhead_ns"), close_timeouts=diag.get("candidate_close_timeouts") or 0,
            clock_gap_ms=gap, params_path=params,
        )
        if params == "state_dict":
            reasons.append("parameters: " + str(final.get("params") or "Model's state_dict loaded into ModelNew"))
        if self._target == Target.CUDA:
            result.late_launches, result.host_ms = feed.late_launches("candidate")
            if result.late_launches * 2 > len(times):
                reasons.append(f"{result.late_launches} of {len(times)} timed calls took the host longer than the "
                               f"{timing.launch_window_us / 1e3:g} ms launch window to launch (median "
                               f"{result.host_ms:.3f} ms): their times include that host work")
        if diag.get("gate_holds_every_sm") is False:
            reasons.append("the timer's gate kernels cannot fill every SM of this GPU: work on a stream that does not "
                           "wait for the caller's could start inside the launch window, untimed")
        if result.close_timeouts:
            reasons.append(f"{result.close_timeouts} timed call(s) left kernels running over a second after the caller's "
                           "stream ended (work on a stream it never waits for): timed to the device-wide synchronize")
        if floor_ms > 0 and cand.median_ms < self.config.roofline_slack * floor_ms:
            why = (f"implausible: {cand.median_ms:.4f} ms is below the roofline floor of this problem "
                   f"({floor_ms:.4f} ms at the device's peak bandwidth/FLOP rate)")
            result = result.model_copy(update={"ok": False, "error_kind": ErrorKind.IMPLAUSIBLE, "error": why,
                                               "reasons": [*reasons, why]})
        breakdown = {"build_check_s": t_built - t0, "baselines_s": t_base - t_built, "job_s": t_job - t_base,
                     **_job_breakdown("candidate", o), "compare_s": t_cmp - t_job,
                     "stats_s": time.perf_counter() - t_cmp}
        return result.model_copy(update={"seconds": time.perf_counter() - t0, "breakdown": breakdown})

    def _timed_audit(self, timed_ops: dict[str, int], artifact_dir: str | None,
                     measured: VerifyResult | None) -> str | None:
        """The audit of the timed loop's calls (warm-up included), from the counts and kernel
        records they reported: strict, the op rule and (GPU) the kernel-origin rule, as in
        verify; permissive, with `measured`, no foreign work per call beyond the verify trials'
        (torch compute ops on the CPU, foreign kernels' threads on the GPU). Why it fails, or None."""
        records = records_from_counts(timed_ops)
        ops = op_counts(timed_ops)
        if self.config.mode == "strict":
            forbidden = forbidden_ops(ops)
            if forbidden:
                return ("strict mode: during timed calls, ModelNew.forward ran torch compute ops " + ", ".join(forbidden)
                        + " (only your own kernels plus allocation/view ops are allowed)")
            if self._target == Target.CUDA:
                if not records:  # the probes among the calls launch kernels: none recorded, no watcher
                    return "the kernel-origin audit could not run in the timed calls: no kernel records came back"
                foreign = foreign_kernels(records, self._origins(artifact_dir, self._import_audit(artifact_dir, [])))
                if foreign:
                    return ("strict mode: during timed calls, ModelNew.forward launched kernels that are not your own: "
                            + "; ".join(foreign[:6]))
            return None
        if measured is None or measured.audit is None or not measured.trials:
            return None
        calls = int(timed_ops.get(MODEL_CALLS_KEY, 0))
        seen = measured.audit.ops_seen
        if self._target == Target.CUDA:
            origins = self._origins(artifact_dir, self._import_audit(artifact_dir, []))
            before, after = foreign_work(records_from_counts(seen), origins), foreign_work(records, origins)
        else:
            before = {k: float(v) for k, v in op_counts(seen).items() if forbidden_ops({k: v})}
            after = {k: float(v) for k, v in ops.items() if forbidden_ops({k: v})}
        extra = unmeasured_work(before, measured.trials, after, calls)
        if extra:
            return ("permissive mode: timed calls did foreign work that verify's trials (where the own-kernel share is "
                    "measured) did not, per call: " + "; ".join(extra[:6]))
        return None

    async def _recheck(self, task: Task, o: JobOutcome, feed: CallFeed, init_seed: int,
                       calls: int) -> tuple[ErrorKind, str] | None:
        """Compare the samples of timed calls drawn by the parent with a reference-only worker's
        outputs for the same seeds (and parameters); the failure if they differ."""
        wrong = "outputs of timed calls are wrong: "
        picks = feed.recheck_sample("candidate", calls)
        if not picks:
            return ErrorKind.TAMPER, "no timed call could be re-checked"
        k = len(picks)
        seeds = projection_seeds(o.tensors, picks)  # GPU: the weights the close kernel used in each picked call
        if self._target == Target.CUDA and None in seeds:
            return ErrorKind.TAMPER, f"timed call {picks[seeds.index(None)][0]} came without its projections"
        ref_job = self._job("reference", task, None, init_seed=init_seed, trial_seeds=[s for _, s in picks],
                            trial_scales=[1.0] * k, trial_orders=["reference_first"] * k,
                            projection_seeds=[s or 0 for s in seeds] if self._target == Target.CUDA else [])
        ref = await self.sandbox.run(ref_job, self.device)
        try:
            failure = _outcome_failure(ref, "reference")
            if failure:
                return ErrorKind.INTERNAL, f"the reference failed while re-checking timed calls: {failure[1]}"
            try:
                pairs = await asyncio.get_running_loop().run_in_executor(
                    _COMPARER, sampled_pairs, o.tensors, ref.tensors, picks)
            except (ValueError, KeyError, TypeError, RuntimeError) as e:  # frames the worker should not have sent
                return ErrorKind.OUTPUT_FORMAT, f"outputs of timed calls could not be read: {e}"
            if isinstance(pairs, str):
                return ErrorKind.OUTPUT_FORMAT, wrong + pairs
            cmp = await asyncio.get_running_loop().run_in_executor(
                _COMPARER, compare_outputs, pairs, task.effective_tolerance)
            if cmp.kind is None and self._target == Target.CUDA:
                why = await asyncio.get_running_loop().run_in_executor(
                    _COMPARER, projected_mismatch, o.tensors, ref.tensors, picks, task.effective_tolerance)
                if why:
                    return ErrorKind.MISMATCH, wrong + why
        finally:
            _release_later(ref)
        if cmp.kind is None:
            return None
        if cmp.kind == ErrorKind.INTERNAL.value:
            return ErrorKind.INTERNAL, "; ".join(cmp.reasons[:3])
        return ErrorKind(cmp.kind), wrong + "; ".join(cmp.reasons[:3])

    # -- the whole pipeline -----------------------------------------------------------------
    async def aevaluate(self, task: Task, workspace: Workspace) -> Verdict:
        """compile → verify → profile → milestone reward (what `submit` does)."""
        before = workspace.source_digest()
        c = await self.acompile(task, workspace)
        if not c.ok:
            return milestone_verdict(c, None, None, self.config.reward)
        v = await self.averify(task, workspace)
        # verify ran the candidate's code with its workspace writable: a solution that rewrote itself
        # there would have its profile build and time other code than the code verified
        if v.ok and workspace.source_digest() != before:
            why = "the solution's code rewrote its own source files while it was verified"
            v = v.model_copy(update={"ok": False, "error_kind": ErrorKind.TAMPER, "error": why,
                                     "reasons": [*v.reasons, why]})
        p = await self.aprofile(task, workspace, measured=v) if v.ok else None
        if p is not None and p.ok and workspace.source_digest() != before:
            why = "the solution's code rewrote its own source files while it was profiled"
            p = p.model_copy(update={"ok": False, "error_kind": ErrorKind.TAMPER, "error": why, "reasons": [why]})
        return milestone_verdict(c, v, p, self.config.reward)

    # -- sync forms ---------------------------------------------------------------------------
    def _sync(self, coro: Any) -> Any:
        return run_sync(coro, async_form="the async form (await evaluator.a...)")

    def compile(self, task: Task, workspace: Workspace) -> CompileResult:
        return self._sync(self.acompile(task, workspace))

    def verify(self, task: Task, workspace: Workspace) -> VerifyResult:
        return self._sync(self.averify(task, workspace))

    def profile(self, task: Task, workspace: Workspace, ncu: bool = False) -> ProfileResult:
        return self._sync(self.aprofile(task, workspace, ncu))

    def evaluate(self, task: Task, workspace: Workspace) -> Verdict:
        return self._sync(self.aevaluate(task, workspace))

    def close(self) -> None:
        self.sandbox.close()

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
