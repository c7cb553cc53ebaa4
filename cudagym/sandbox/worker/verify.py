"""The correctness jobs: `verify` (the candidate's trials, audited) and `reference` (the
reference's outputs for the same plan, in a worker that runs no candidate code).

A verify trial's inputs are revealed when it starts (`Channel.request`); the candidate's outputs
go to the parent as they exist, and the parent compares them with the reference-only worker's:
whole, or, above `VerifyConfig.whole_output_mb`, as evidence (`output_evidence`), so that a
worker's memory does not grow with the trials by the size of the output.
The audit here collects what ran (ops at the dispatcher, by the profiler and by the op counter;
kernels by origin) and checks that nothing was left running or changed afterwards.
"""

from __future__ import annotations

import math
import os
import secrets
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from cudagym.core.audit import STRICT_ALLOWED, forbidden_ops
from cudagym.sandbox.inline import inline_problems
from cudagym.sandbox.origin import records_as_counts
from cudagym.sandbox.timing import PROJECTIONS, projection, reference_projection
from cudagym.sandbox.worker.failures import CandidateError, candidate_traceback, failure_kind
from cudagym.sandbox.worker.integrity import (OpRecorder, check_channel, check_tamper, check_torch_lookups,
                                              check_torch_modes, kernel_watch, kernels_alive, live_helpers, op_watch,
                                              poison_allocator, watch_alive, watch_changes)
from cudagym.sandbox.worker.problem import Problem, as_outputs, clone_args, same_bits
from cudagym.sandbox.worker.state import WorkerState
from cudagym.sandbox.worker.telemetry import Phases
from cudagym.sandbox.worker.wire import Channel, Job


# values of an output sent as evidence, per trial: 4 MiB of fp32, a 64th of the smallest such output
EVIDENCE_SAMPLES = 1 << 20


def _aten_ops_seen_by_profiler(prof: Any) -> Counter[str]:
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def sent_whole(t: torch.Tensor, job: Job) -> bool:
    """Whether output `t` of a verify trial goes to the parent whole (else as `output_evidence`)."""
    return t.numel() * t.element_size() <= job.verify.whole_output_mb << 20


def output_evidence(t: torch.Tensor, seed: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the parent compares of output `index` of a trial in place of the whole output: its
    values at `EVIDENCE_SAMPLES` flat (row-major) positions drawn from `seed` (uniform, with
    replacement), and its projections with the weights of `seed` (`projection`: `PROJECTIONS`
    +-1 weighted float64 sums over every element, then sum |x|, sum x^2 and the count of
    non-finite components). Both workers compute it from the same seed, so the parent compares
    the samples with the tolerance and the projections with `projection_mismatch`'s bound.

    Errors in a fraction f of the elements escape the samples of one trial with probability
    (1 - f)^EVIDENCE_SAMPLES (f = 1e-5: 3e-5). The projections catch errors wherever they are
    (an output computed only where it was sampled, too) once their root sum of squares passes
    `cudagym.rewards.compare.PROJECTION_SIGMAS` (8) times that of the tolerance over the whole
    output (values ~N(0, 1), atol = rtol = 1e-2: 0.019 sqrt(numel), 760 for 1.6e9 elements). What
    both may miss: a few elements, wrong by no more than that.
    """
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randint(t.numel(), (EVIDENCE_SAMPLES,), generator=gen).to(t.device)
    values = t.detach()[torch.unravel_index(flat, t.shape)]  # any strides, without a copy of the whole
    return values, projection(t, seed, index)


def send_evidence(ch: Channel, role: str, trial: int, index: int, t: torch.Tensor, seed: int) -> None:
    """`output_evidence` of `t` on the pipe (out of the worker's reach once written): its samples
    (with the output's shape as `of_shape`) and its projections; the candidate's sums only, the
    reference's with the three sums of the parent's bound on honest differences."""
    values, sums = output_evidence(t, seed, index)
    ch.send_tensor(role, trial, index, values, pipe=True, part="samples", of_shape=list(t.shape))
    ch.send_tensor(role, trial, index, sums if role == "reference" else sums[:PROJECTIONS], pipe=True,
                   part="projections")


def run_verify(job: Job, ch: Channel, state: WorkerState) -> None:
    """Correctness trials of the candidate, audited at the dispatcher and by the profiler.

    The reference also runs here (before or after the candidate, by the plan) so that freed
    reference outputs are poisoned where the candidate could pick them up; the outputs that
    are compared come from a separate reference-only worker with the same plan.

    An output above `VerifyConfig.whole_output_mb` goes as evidence (`output_evidence`) whose
    seed the parent reveals (`TrialFeed`) only when asked, once the trial's call has returned
    and its outputs are copied: no code of the candidate's can know the positions or weights
    before its outputs exist. The parent draws the seed with the plan, so that the
    reference-only worker (no candidate code; it holds the trials' input seeds, as secret) can
    project its outputs alongside; drawn later, it would reach the candidate's process no
    sooner. By the reveal no Python thread or child process of the candidate's is left
    (checked after the call), and a dispatch or function mode that would see the evidence's ops
    is refused. A native thread that read the seed could rewrite the snapshot the evidence is
    taken from, but not pass its projections without the whole output right, nor the re-read
    of the outputs against the snapshot at the trial's end.
    """
    from torch.profiler import ProfilerActivity, profile

    check = check_tamper  # bound before any candidate code runs
    clock = state.originals["time.perf_counter"]
    ph = Phases(clock)
    p = Problem(job, state, with_candidate=True)
    ph.mark("load")
    trials = job.trials
    ops: Counter[str] = Counter()
    out_bytes = 1 << 20
    profiler_enabled = torch.autograd._profiler_enabled  # noqa: SLF001 - torch's profiler flag
    watch = op_watch(state)
    changes = watch_changes(state)
    kwatch = kernel_watch(state, p.device)
    if kwatch:
        kwatch.reset()  # every kernel of every trial, by origin: the parent applies the rules
    elif p.device.type == "cuda":  # the harness's start-up failed (e.g. the GPU's memory was full then)
        raise CandidateError("internal", f"the harness's kernel watcher could not start in this worker: "
                                         f"{state.kwatch_error or 'not loaded'}")
    marks = p.device.type == "cpu"
    for t in range(trials):
        plan = ch.request("trial", index=t)  # this trial's secret, only now
        order = plan.get("order")
        base = p.inputs(int(plan["seed"]), float(plan.get("scale", 1.0)))

        def run_reference() -> None:
            args = clone_args(base)
            out = as_outputs(p.ref(*args), "the reference")
            p.sync()
            params = {q.data_ptr() for q in list(p.ref.parameters()) + list(p.ref.buffers())}
            for o in out:  # poison freed output memory before the candidate runs
                view = o._base is not None  # noqa: SLF001 - a view's base tensor
                if o.is_floating_point() and o.data_ptr() not in params and not view:
                    o.fill_(float("nan"))
            del out, args

        if order == "reference_first":
            run_reference()
        args = clone_args(base)
        poison_allocator(p.device, out_bytes)
        before = live_helpers()
        ph.mark("reference")
        rec = OpRecorder()
        still_profiling = True
        before_watch = watch.counts()
        try:
            with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof, rec:
                watch.arm()
                if kwatch:
                    kwatch.arm()
                try:
                    if marks:  # where forward runs, for the sandbox's CPU samples (`Channel.mark`)
                        check_channel(state)
                        ch.mark("forward", wait=True, at=clock())  # forward starts once the parent has it
                    out = p.cand(*args)
                finally:
                    if marks:  # at once, and the harness goes on once the parent has it (`Channel.mark`)
                        ch.mark("returned", wait=True, at=clock())
                    if kwatch:
                        kwatch.disarm()
                    watch.disarm()
                p.sync_caller_stream()
                still_profiling = profiler_enabled()
        except CandidateError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CandidateError(failure_kind(e, state.hook_attempts),
                                 "ModelNew.forward raised:\n" + candidate_traceback(e, [job.workspace])) from None
        returned = clock()
        check(state)
        p.intact()
        check_torch_lookups(state)
        if not still_profiling:
            raise CandidateError("tamper", "ModelNew.forward switched off the harness's profiler")
        watch_alive(state, watch, changes + 2 * (t + 1))
        kernels_alive(state, kwatch)
        seen = rec.ops | (_aten_ops_seen_by_profiler(prof) - rec.ops)  # ops hidden from the dispatch mode
        ops.update(seen | (watch.counts() - before_watch - seen))  # and from both
        outs = as_outputs(out, "ModelNew.forward", p.device)
        after = live_helpers()
        if after[1] > before[1]:
            raise CandidateError("audit", "ModelNew.forward left child processes running after it returned")
        if after[0] > before[0]:
            raise CandidateError("audit", "ModelNew.forward left threads running after it returned")
        ph.mark("candidate")
        # its inputs are not needed after the call: a candidate-first trial's reference then runs
        # beside two input sets (the trial's and its own clone), not three (KernelBench level 1
        # task 45: 16 GiB each)
        del args
        snap = [o.detach().clone() for o in outs]  # on the device: the values at return time
        out_bytes = sum(o.numel() * o.element_size() for o in outs)
        sampled = [i for i, o in enumerate(snap) if not sent_whole(o, job)]
        for i, o in enumerate(snap):
            if i not in sampled:
                ch.send_tensor("candidate", t, i, o)
        if sampled:
            seed = int(ch.request("evidence", index=t)["seed"])  # only now: the outputs exist
            check_torch_modes()
            for i in sampled:
                send_evidence(ch, "candidate", t, i, snap[i], seed)
        ph.mark("send")
        if order == "candidate_first":
            run_reference()
        ph.mark("reference")
        # Outputs must not change once forward has returned: re-read them later (after this
        # trial's other work; in the last trial, after a pause: background work recurs each trial).
        wait = job.verify.settle_ms / 1e3 - (clock() - returned)
        if wait > 0 and t == trials - 1:
            time.sleep(wait)
        p.sync()
        if not all(same_bits(o, s) for o, s in zip(outs, snap)):
            raise CandidateError("audit", "an output of ModelNew.forward changed after forward returned "
                                 "(work finishing in the background)")
        del outs, out, snap
        ph.mark("settle")
    kernels = records_as_counts(kwatch.records()) if kwatch else None
    own_share, share_kernels = None, None
    if job.mode == "permissive":
        own_share, share_kernels = own_kernel_share(p, job, state)
        ph.mark("own_share")
    check(state)
    if problems := inline_problems():  # an extension verify had to do without, named
        raise CandidateError("compile_error", "\n".join(problems))
    ch.final({"ok": True, "trials": trials, "ops": dict(ops), "forbidden": forbidden_ops(ops),
              "own_kernel_share": own_share, "params": p.params, "params_retry": p.params_retry, "phases": ph.times,
              "kernels": kernels,
              "share_kernels": share_kernels, "kernel_watch_error": state.kwatch_error,
              "own_objects": own_objects(job), "unbuilt_code": unbuilt_code(job)})


def run_reference_outputs(job: Job, ch: Channel, state: WorkerState) -> None:
    """The reference's outputs for the verify plan, in a worker that runs no candidate code: whole,
    or, with the trial's evidence seed (verify) and above `whole_output_mb`, as evidence.

    Its final result also says how much memory the problem took (`footprint`): the evaluator
    sizes later jobs of the same task by it (which layout verify runs in, the candidate's host
    memory limit; `Evaluator.averify`). Measured here because this worker runs only the task's
    own code. Before that result, each output is overwritten and the device memory given back,
    so that no reference output outlives the job in memory another process may be handed."""
    ph = Phases(state.originals["time.perf_counter"])
    host0, virtual0 = _status_kib("VmRSS"), _status_kib("VmSize")
    device = torch.device("cuda:0" if job.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    p = Problem(job, state, with_candidate=False)
    native = getattr(state.opwatch, "cpu_project", None)  # the CPU's projections, in the harness's C
    ph.mark("load")
    with torch.no_grad():
        for t, (seed, scale) in enumerate(zip(job.trial_seeds, job.trial_scales)):
            out = as_outputs(p.ref(*p.inputs(seed, scale)), "the reference")
            p.sync()
            ph.mark("reference")
            sent = job.projected_only_from is None or t < job.projected_only_from  # else its projections only
            for i, o in enumerate(out):
                if t < len(job.evidence_seeds) and not sent_whole(o, job):
                    send_evidence(ch, "reference", t, i, o, job.evidence_seeds[t])
                elif sent:
                    ch.send_tensor("reference", t, i, o)
                if t < len(job.projection_seeds):  # the re-check of a timed call: its projections, same weights
                    ch.send_tensor("projection", t, i, reference_projection(o, job.projection_seeds[t], i, native))
            _poison(p, out)
            del out
            ph.mark("send")
    # host: its resident peak's growth; on the CPU, whose limit is on address space
    # (`apply_rlimits`), the growth of its address space's peak if that is more
    grown = max(_status_kib("VmHWM") - host0, _status_kib("VmPeak") - virtual0 if device.type == "cpu" else 0, 0)
    footprint = {"host_bytes": grown << 10,
                 "param_bytes": sum(q.numel() * q.element_size() for q in [*p.ref.parameters(), *p.ref.buffers()])}
    if device.type == "cuda":
        footprint["device_bytes"] = int(torch.cuda.max_memory_reserved(device))
        del p
        torch.cuda.empty_cache()
    ch.final({"ok": True, "trials": len(job.trial_seeds), "phases": ph.times, "footprint": footprint})


def _status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS: resident now; VmHWM: its peak), 0 if unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _poison(p: Problem, outs: list[torch.Tensor]) -> None:
    """Overwrite the reference's floating outputs once they are sent; not views (of its inputs or
    state) nor any tensor the model holds (parameters, buffers, plain attributes), which later
    trials may return again."""
    held = [*p.ref.parameters(), *p.ref.buffers(),
            *(v for m in p.ref.modules() for v in vars(m).values() if isinstance(v, torch.Tensor))]
    keep = {q.untyped_storage().data_ptr() for q in held}
    for o in outs:
        if o.is_floating_point() and o._base is None and o.untyped_storage().data_ptr() not in keep:  # noqa: SLF001
            o.fill_(float("nan"))
    p.sync()


def own_objects(job: Job) -> list[str]:
    """The shared objects of the candidate's build (its artifact directory, its cached
    extensions) this process has mapped: the parent audits their imports itself."""
    roots = [r for r in (job.artifact_dir, str(Path(job.cache_dir) / "inline")) if r]
    libs: list[str] = []
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if line.strip() else ""
            if ".so" in path and any(path.startswith(r) for r in roots) and path not in libs:
                libs.append(path)
    return libs[:64]


def unbuilt_code(job: Job) -> list[str]:
    """Files this process has mapped executable that the job could write and the harness did not
    build (under the job's workspace, outside the candidate's build artifacts), and images with no
    file (memfd): native code generated or built at run time, such as inductor's C++ kernels
    compiled in `__init__`, or a copy of a library the audit would not name. Verify's and the
    profile's workers report it at their end; the parent judges it (`Audit.kernels`,
    `Audit.timed_calls`): strict mode refuses it (the import audit reads only what the harness
    built), permissive mode on the CPU target credits no own-kernel share beside it."""
    roots = [os.path.realpath(r) for r in (job.artifact_dir, str(Path(job.cache_dir) / "inline")) if r]
    workspace = os.path.realpath(job.workspace) + "/" if job.workspace else None
    found: list[str] = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or "x" not in parts[1]:
                continue
            path = parts[5].strip()
            if any(path.startswith(r + "/") for r in roots) or path in found:
                continue
            if path.startswith("/memfd:") or (workspace and path.startswith(workspace)):
                found.append(path)
    return found[:32]


def own_kernel_share(p: Problem, job: Job, state: WorkerState) -> tuple[float | None, dict[str, int] | None]:
    """Permissive mode: on a GPU, the kernel records of one measured call with each launch's GPU
    time (`KernelWatch.timed`; the parent computes the share by origin); on the CPU, the share
    of the forward's compute done outside torch (computed here: no kernel records there)."""
    from torch.profiler import ProfilerActivity, profile

    args = p.inputs(secrets.randbits(62))
    if p.device.type == "cuda":
        kwatch = kernel_watch(state, p.device)
        if kwatch is None:
            return None, None
        with torch.no_grad():
            p.cand(*clone_args(args))  # warm: lazy loads and first-call work are not measured
            p.sync()
            call_args = clone_args(args)

            def measured() -> None:
                p.cand(*call_args)
                p.sync()

            records = kwatch.timed(measured)
        return None, records_as_counts(records)
    acts = [ProfilerActivity.CPU]

    # CPU: the candidate's own (ctypes/binding) calls are invisible to the profiler, so compare
    # the torch compute inside its forward with the reference's torch compute on the same
    # inputs, in elements processed (deterministic, unlike times on a shared host).
    def torch_work(fn: Any) -> float:
        with profile(activities=acts, record_shapes=True) as prof_w:
            fn(*clone_args(args))
        work = 0.0
        for e in prof_w.events():
            if e.name.startswith("aten::") and e.name.split("::")[1] not in STRICT_ALLOWED:
                sizes = [math.prod(s) for s in (e.input_shapes or []) if isinstance(s, (list, tuple))]
                work += max(sizes, default=1)
        return work

    with torch.no_grad():
        ref_work = torch_work(p.ref)
        cand_work = torch_work(p.cand)
    if ref_work <= 0:
        return (1.0 if cand_work == 0 else 0.0), None
    return max(0.0, 1.0 - cand_work / ref_work), None
