"""The timed jobs: `profile` (the candidate's timed loop), `baseline` (the reference's, eager and
compiled, and library baselines) and `ncu` (the candidate's calls under Nsight Compute).

Every role's calls go through one loop (`timing_run`) under the timing protocol
(`cudagym.sandbox.timing`): the parent decides each call (`cudagym.sandbox.feed.CallFeed`), and
each call's time and evidence go to it before the next call is asked for.
"""

from __future__ import annotations

import gc
import os
import secrets
from typing import Any

import torch

from cudagym.sandbox.inline import inline_problems
from cudagym.sandbox.opwatch import CHANNEL_FD
from cudagym.sandbox.origin import MODEL_CALLS_KEY, records_as_counts
from cudagym.sandbox.protocol import MAX_IDLE_MS
from cudagym.sandbox.timing import (PROJECTIONS, SAMPLE_SIZE, Calibration, DeviceTimer, Evidence, TimerTamperedError,
                                    drive_calls, foreign_hooks, harness_calibration)
from cudagym.sandbox.worker.failures import CandidateError, candidate_traceback, failure_kind
from cudagym.sandbox.worker.maker import Maker
from cudagym.sandbox.worker.maker import attach as attach_maker
from cudagym.sandbox.worker.integrity import (c_entries, check_channel, check_classes, check_reclassed, check_tamper,
                                              entries_changed, foreign_signal_handlers, kernel_watch, kernels_alive,
                                              live_threads, op_watch, slots_changed, watch_alive, watch_changes)
from cudagym.sandbox.worker.problem import Problem, as_outputs, clone_args
from cudagym.sandbox.worker.state import WorkerState
from cudagym.sandbox.worker.telemetry import Phases
from cudagym.sandbox.worker.wire import HARNESS_STEPS_S, LOADING_MARK, Channel, Job


def probe_fn(p: Problem) -> Any:
    """A call of one tiny kernel: the probes among a loop's calls that measure the loop's own
    overhead on the parent's clock (`cudagym.sandbox.feed`)."""
    probe = torch.zeros(1, dtype=torch.int32, device=p.device)

    def fill(*args: Any) -> torch.Tensor:
        probe.zero_()
        return probe

    return fill


def job_timer(p: Problem, job: Job, state: WorkerState, ch: Channel, share_after: bool = False) -> DeviceTimer:
    """The job's timer, its overhead measured before any candidate code loads, with the GPU alone
    (the spares that are still starting paused), on a separate timer without the flush
    (`harness_calibration`). Measured once per process while a spare waits, it read up to the
    cap in some processes on an H100 (other spares creating their CUDA contexts), and calls
    shorter than it then read 0. Without the flush the output the close reads is hot, as a
    call's is. The calibration goes to the parent before the candidate loads.

    On a GPU the parent may know one already: the calibration an earlier timing job measured
    this way on the same GPU (`cudagym.sandbox.schedule.JobLease`), which it then applies to this
    job's calls itself; this job neither measures it nor asks for the GPU alone for it. With
    `share_after`, a GPU job gives the GPU back once its calibration is in (its candidate then
    loads under a shared lease; `alone` asks for it again before the timed loop)."""
    cpu = p.device.type == "cpu"
    native, opener, flush = ((op_watch(state).cpu_close, op_watch(state).cpu_open, op_watch(state).cpu_flush) if cpu
                             else (None, None, None))
    # the CPU calls' stamps and evidence go on the channel from the native open and close (`DeviceTimer.call`),
    # which write at a fixed descriptor: the channel's pipe is put there now, before any candidate code
    native_channel = False
    if cpu:
        try:
            os.dup2(ch.fd, CHANNEL_FD, inheritable=False)
            native_channel = True
        except OSError:
            pass
    known = ch.request("calibration_known").get("calibration") if p.device.type == "cuda" else None
    if isinstance(known, dict):
        calibration = Calibration(**known)
    elif p.device.type == "cuda":
        ch.request("exclusive")
        calibration = harness_calibration.__wrapped__()
    else:
        calibration = DeviceTimer(p.device, flush_l2=False, calibration=Calibration(0, 0), native_close=native,
                                  native_open=opener, native_channel=native_channel).calibrate()
    timer = DeviceTimer(p.device, job.timing.flush_l2, launch_window_us=job.timing.launch_window_us,
                        calibration=calibration, native_close=native, native_flush=flush, native_open=opener,
                        native_channel=native_channel)
    if state.opwatch_callbacks is not None:  # before any candidate code loads (`timing_run` compares after each call)
        state.callbacks_before = state.opwatch_callbacks()
    if not isinstance(known, dict):
        # the parent computes each call's time with this copy (`CallFeed`): the worker's can be rewritten later
        ch.request("calibration", calibration=timer.calibration._asdict(), native_stamps=timer.native_channel)
        if share_after and p.device.type == "cuda":
            ch.request("shared")  # the candidate loads beside checks (`share_after`)
    return timer


def alone(p: Problem, ch: Channel) -> None:
    """On a GPU: wait until the job has the GPU alone (a timing job's worker prepares under a
    shared lease, `cudagym.sandbox.schedule.JobLease`); before its timed loops."""
    if p.device.type == "cuda":
        ch.request("exclusive")


def timing_run(p: Problem, fn: Any, job: Job, ch: Channel, role: str, ph: Phases, timer: DeviceTimer,
               state: WorkerState, marks: bool = False, maker: Maker | None = None) -> int:
    """Make the calls of `role` that the parent asks for, under the timing protocol
    (`cudagym.sandbox.timing`); returns how many were made.

    The same steps for every role and every call: the op counter armed around the call (the
    candidate's cumulative counts go with each request), a sample of every output read at
    the call's end (`DeviceTimer.read_at_end`: `SAMPLE_SIZE` secret random positions, drawn
    after the call returned; on a GPU, with projections of the whole output, by the close kernel
    while it holds every SM) and sent on the pipe, out of the worker's reach, before the next
    call is asked for. The calls the parent marks as probes call a tiny kernel of the harness
    instead, through the same steps. With `marks` (the candidate on the CPU target), each call's
    start is marked on the pipe right before its interval opens and its end is the next call's
    request (`Channel.mark`): the windows of the sandbox's CPU samples (`cudagym.sandbox.cpusamples`).
    With `maker`, each call's inputs are made outside this process, into its buffers, once the
    parent has the call's mark (`cudagym.sandbox.worker.maker`): the parent's answer carries no seed.
    """
    rng = secrets.SystemRandom()
    timer_parts = {k: v for k, v in vars(timer).items() if callable(v)}
    timeouts = timer.close_timeouts()  # a baseline job's roles share one timer
    calibration = timer.calibration
    if maker is not None:  # the buffers the maker writes each call's inputs into
        sets = maker.sets
    else:
        sets = [p.inputs(rng.getrandbits(62))]
        n_sets = input_sets(job, sets[0])
        sets += [p.inputs(rng.getrandbits(62)) for _ in range(n_sets - 1)]
    watch = op_watch(state)
    watch.reset()  # the role's counts start here; the parent sees them only grow
    kwatch = kernel_watch(state, p.device) if role == "candidate" else None
    if kwatch:
        kwatch.reset()  # the role's kernel records, sent with the op counts: they only grow
    model_calls = [0]
    changes = watch_changes(state)  # then one arm and one disarm per call
    # Python threads (`_thread`'s too) the loop's calls may find alive: those before the candidate's
    # code loaded (a thread it started at import, alive beside the loop, is one it left running)
    threads = state.threads_before if state.threads_before is not None else live_threads()
    pending: list[tuple[torch.Size, Evidence]] = []
    made = [0]
    who = "ModelNew.forward" if role == "candidate" else f"the {role} model"
    ph.mark(f"{role}_setup")

    probe = probe_fn(p)
    # torch's mode stacks' depths, as bound before candidate code (closure cells: checked before each read)
    dispatch_modes, function_modes = (state.originals["torch._C._len_torch_dispatch_stack"],
                                      state.originals["torch._C._len_torch_function_stack"])

    clock = ph._clock  # noqa: SLF001 - the job's clock (the parent bounds the windows it times)

    cells: list[tuple[Any, Any]] = []  # the closures' cells below, checked before each report (`next_call`)
    request = Channel.request  # the class's, as checked with the channel (`check_channel`): not the instance's
    # and what builds the report's body, bound now (cells, checked before each report): red team 29's
    # a17 made the module's `MODEL_CALLS_KEY` a `str` whose hash put a `dict` of its own in this
    # module's globals for the next lookup, `dict(report)`, which rewrote the report
    as_dict: type[dict[Any, Any]] = type({})
    calls_key = str(MODEL_CALLS_KEY)
    if type(MODEL_CALLS_KEY) is not str:
        raise CandidateError("tamper", "a name of the harness's timed loop was replaced by the candidate")
    # every global of the harness's modules as bound before candidate code (a cell; its own cells are
    # checked with the loop's): read after the per-call checks' first step and right before the report
    # leaves, so that no name this loop, its checks or the channel look up can run the candidate's code
    # in between (the class of one-shot replacements that red teams 16-29 found one name at a time)
    globals_changed = state.globals_changed

    # the clocks' C functions as they were before candidate code (red team 14's a rewrote the one
    # behind `time.perf_counter` at import), and the timer's own
    entries = [*state.c_entries, *c_entries([*timer_parts.values(), clock])]

    def timer_modified() -> bool:  # the timer as bound: a plain dict, its callables, its calibration
        mine = vars(timer)
        return type(mine) is not dict or mine.get("calibration") is not calibration \
            or any(mine.get(k) is not v for k, v in timer_parts.items()) or entries_changed(entries) \
            or slots_changed(state.clock_slots)

    def mark() -> None:  # right before the call's interval opens; the call waits until the parent has it
        check_channel(state)  # what writes the mark is the harness's
        ch.mark("forward", wait=True, at=clock())

    # the last call's objects, held through the next call (`drive_calls`' `held`), freed as it
    # returns, still armed and inside its interval: what the candidate tied to them runs timed and
    # watched (before the clock, untimed, it could compute the call's output from the inputs in
    # place). Freeing the last output is in each call's time, the baselines' as much as the
    # candidate's; alive through the next call, it keeps that call's output off its addresses (on a
    # GPU, with the placement allocation: `drive_calls`).
    held: list[Any] = []

    def call(*args: Any) -> Any:
        model_calls[0] += 1
        watch.arm()
        if kwatch:
            kwatch.arm()
        try:
            return fn(*args)
        except CandidateError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CandidateError(failure_kind(e, state.hook_attempts), f"{who} raised in a timed-loop call:\n"
                                 + candidate_traceback(e, [job.workspace] if job.workspace else [])) from None
        finally:
            held.clear()
            if kwatch:
                kwatch.disarm()
            watch.disarm()
            gc.disable()  # the loop's collector stays paused (forward may have resumed it)

    def after(i: int, out: Any) -> dict[str, Any]:
        pending.extend((o.shape, timer.read_at_end(o, SAMPLE_SIZE)) for o in as_outputs(out, who, p.device))
        return {}

    natively = timer.native_channel  # the CPU close sends the evidence it read itself

    def send_evidence() -> None:
        # the evidence of the call goes on the pipe before the candidate's code runs again (on the
        # CPU target, from inside the call's interval: `DeviceTimer.call`'s `send`); the CPU
        # close's as raw bytes (`Evidence.raw`): no ATen op, so no RecordFunction callback or
        # kernel of anyone's, runs between the close and the pipe
        for j, (shape, ev) in enumerate(pending):
            if ev.raw is not None:
                seed = ev.cpu_seed()
                for what, t, raw, extra in (("sample", ev.values, ev.raw[0], {"full_shape": list(shape)}),
                                            ("positions", ev.positions, ev.raw[1], {}),
                                            ("projection", ev.projections, ev.raw[2], {"seed": seed})):
                    # the native close sent them (`native_channel`), but the projections of a dtype it does not project
                    if natively and (what != "projection" or ev.raw[3].kind != 0):
                        continue
                    if t is not None and raw is not None:  # raw is None exactly when t is
                        ch.send({"type": "tensor", "role": what, "trial": made[0] - 1, "index": j,
                                 "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), **extra}, raw)
                continue
            ch.send_tensor("sample", made[0] - 1, j, ev.values, pipe=True, full_shape=list(shape))
            if ev.positions is not None:
                ch.send_tensor("positions", made[0] - 1, j, ev.positions, pipe=True)
            if ev.projections is not None:
                ch.send_tensor("projection", made[0] - 1, j, ev.projections[:PROJECTIONS], pipe=True, seed=ev.seed)
        pending.clear()

    def returned() -> None:  # the last call's interval (its close and evidence too) is over
        # the parent closes the call's window and its samples' bounds at this mark's arrival (the
        # worker waits for it), before the checks below: their reads of every module and class
        # (~1.6 ms of CPU a call on a loaded 2-core host, its caches cold from the call) are the
        # harness's, not the call's. Nothing is read before the mark but the classes of the state
        # and the channel, and the channel's own path (its class is checked below): what ran there
        # of the candidate's, through a read it hijacked and put back, is in the window and the
        # bounds, where the kernel's samples hold the calls' reported times.
        if type(ch) is not Channel or type(state) is not WorkerState:  # red team 19's f swapped the state's
            raise CandidateError("tamper", "the class of one of the harness's objects was swapped by the candidate")
        ch.mark("returned", wait=True, at=clock())

    def next_call(report: tuple[tuple[str, Any], ...]) -> tuple[int, bool, float] | None:
        if marks and made[0]:
            returned()
        # what made the report is as it was bound: the timer (its dict, its callables: red team 13
        # swapped `vars(timer)` for a dict that rewrote `last_raw`, and `timer._perf`), its class,
        # and what the loop's closures hold (a cell rewritten through `__closure__`)
        if changed := globals_changed():  # before this function's first lookup in this module's globals
            raise CandidateError("tamper", f"a global of the harness's module {changed} was replaced by the candidate")
        check_reclassed(state, (timer, DeviceTimer), (p, Problem), (ch, Channel))  # no read runs code
        check_classes(state)
        if timer_modified() or any(c.cell_contents is not v for c, v in cells):
            raise CandidateError("tamper", "the harness's timer or its timed loop was modified by the candidate")
        send_evidence()  # a GPU call's (a CPU call's went from inside its interval)
        # a mode left on torch's stacks sees every op the harness runs: the next call's inputs as
        # they are generated (before its clock starts), the evidence's reads
        if dispatch_modes() or function_modes():  # bound before the loop: red team 20 chained from torch._C's
            raise CandidateError("tamper", "a torch dispatch or function mode was left active by the candidate")
        if made[0]:
            if state.hook_attempts or (hooks := foreign_hooks()) or (hooks := foreign_signal_handlers(state)):
                raise CandidateError("tamper", "a Python hook or signal handler the harness did not set, or a search "
                                     "it refuses, was tried or is active: "
                                     + (state.hook_attempts[0] if state.hook_attempts else hooks))
            callbacks = state.opwatch_callbacks
            if role == "candidate" and state.callbacks_before is not None and callbacks is not None \
                    and callbacks() != state.callbacks_before:
                raise CandidateError("tamper", "the candidate registered a RecordFunction callback (an observer of the "
                                     "harness's own ops; `at::addGlobalCallback` or `addThreadLocalCallback`)")
            watch_alive(state, watch, changes + 2 * made[0])
            kernels_alive(state, kwatch)
            if live_threads() > threads:
                raise CandidateError("audit", f"{who} left threads running after it returned (or started them "
                                     "beside the harness when it loaded)")
        ops = as_dict(watch.counts())
        ops[calls_key] = model_calls[0]  # the parent's per-call rules divide by it
        if kwatch:
            ops.update(records_as_counts(kwatch.records()))
        # the channel that sends the report is the harness's as the report leaves (red team 28's a8 put a
        # `request` of its own in the channel's dict for one call, which took itself out as it ran)
        check_channel(state)
        if changed := globals_changed():
            raise CandidateError("tamper", f"a global of the harness's module {changed} was replaced by the candidate")
        answer = request(ch, "call", role=role, index=made[0], ops=ops, **as_dict(report))
        if answer.get("stop"):
            return None
        made[0] += 1
        idle_ms = answer.get("idle_ms", 0.0)
        idle_s = min(max(float(idle_ms), 0.0), MAX_IDLE_MS) / 1e3 if isinstance(idle_ms, (int, float)) else 0.0
        if maker is not None:  # the maker writes the inputs once the parent has the call's mark
            if answer.get("made") is not False or "seed" in answer:
                raise CandidateError("internal", f"the parent's answer for call {made[0] - 1} does not leave its "
                                     f"inputs to the inputs maker: {answer!r:.200}")
            return 0, bool(answer.get("probe")), idle_s
        return int(answer["seed"]), bool(answer.get("probe")), idle_s

    def probed(*args: Any) -> Any:  # the op counter goes through the same arm/disarm
        watch.arm()
        if kwatch:
            kwatch.arm()
        try:
            return probe(*args)
        finally:
            held.clear()
            if kwatch:
                kwatch.disarm()
            watch.disarm()
            gc.disable()

    def untouched() -> None:  # the dispatcher's table is read by the job's own last check (`run_profile`)
        check_tamper(state, dispatcher=False)
        if timer_modified():
            raise CandidateError("tamper", "the harness's timer was modified by the candidate")

    # the loop's closures' cells as bound now (none of them is rebound while the loop runs)
    cells.extend((c, c.cell_contents) for f in (mark, returned, call, next_call, probed, after, send_evidence,
                                                 timer_modified, globals_changed)
                 for c in (f.__closure__ or ()))
    with torch.no_grad():
        try:
            n = drive_calls(call, sets, p.inputs if maker is None else maker.inputs, next_call, timer, after, probed,
                            send=send_evidence, mark=mark if marks else None, held=held)
        except TimerTamperedError as e:
            raise CandidateError("tamper", str(e)) from None
        except Exception:
            untouched()  # a harness the candidate patched, which then raised, is tamper
            raise
    held.clear()  # the last call's objects: what the candidate tied to them runs before the checks below
    ph.mark(f"{role}_timed_loop")
    ph.extra["harness_overhead_ns"] = calibration.overhead_ns
    ph.extra["read_cap_ns"] = calibration.read_cap_ns
    if timer.cuda:
        ph.extra[f"{role}_close_timeouts"] = timer.close_timeouts() - timeouts
        ph.extra["gate_holds_every_sm"] = timer.holds_every_sm
    untouched()
    p.intact()
    if maker is not None:  # the worker's own input generation (verify's trials ran on it) is as it was
        p._inputs_untouched(p.input_kernels)  # noqa: SLF001 - the problem's own check, once the loop is over
    ph.mark(f"{role}_loop_checks")
    return n


def input_sets(job: Job, template: list[Any]) -> int:
    """How many input sets a timed loop rotates (`TimingConfig.input_sets_for`)."""
    return job.timing.input_sets_for(sum(a.nbytes for a in template if isinstance(a, torch.Tensor)))


def roofline_inputs(p: Problem) -> dict[str, float]:
    """Bytes moved (inputs + outputs) and FLOPs of one reference call, and what a call's close
    projects of the reference's outputs (`Reading.dense`'s measure of them all, and the elements
    of those that are not contiguous): the parent caps what a candidate's call reports of its
    close with them (`CallFeed`)."""
    from torch.utils.flop_counter import FlopCounterMode

    args = p.inputs(secrets.randbits(62))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        out = as_outputs(p.ref(*args), "the reference")
    nbytes = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
    nbytes += sum(o.numel() * o.element_size() for o in out)
    close = sum(max(o.numel(), o.numel() * o.element_size() // 4) for o in out)
    strided = sum(o.numel() for o in out if not o.is_contiguous())
    return {"bytes": float(nbytes), "flops": float(counter.get_total_flops()), "close_elements": int(close),
            "close_strided": int(strided)}


def run_profile(job: Job, ch: Channel, state: WorkerState) -> None:
    """The timer's overhead (before any candidate code loads), then the candidate's timed loop;
    the times and samples go to the parent call by call (see `timing_run`)."""
    check = check_tamper  # bound before any candidate code runs
    ph = Phases(state.originals["time.perf_counter"])
    p = Problem(job, state, with_candidate=False)
    ph.mark("problem")
    timer = job_timer(p, job, state, ch, share_after=True)
    ph.mark("calibration")
    if timer.native_channel:  # the channel's descriptors stay the harness's pipes (`OpWatch.guard_channel`)
        # (not stdin, where the answers arrive: a process the candidate starts puts its own stdin there)
        os.set_inheritable(ch.fd, False)
        ph.extra["channel_guard"] = op_watch(state).guard_channel((CHANNEL_FD, ch.fd))

    def loading() -> None:  # the threads started from here on are the candidate's (`cpusamples.attribute`)
        threads = torch.get_num_threads()
        torch.ones(threads << 16).sum()  # torch's OpenMP pool, whole, is the harness's: it runs the next inputs
        # the harness's steps between timed calls, as it will take them there (the next inputs made
        # and checked, the cache flush): the kernel's samples of them before the mark are what
        # torch's compute between the calls may be (`cpusamples.attribute`'s `between_unknown`); at
        # least 2 rounds and HARNESS_STEPS_S of them (whose samples hold each function of theirs)
        rng, began, made = secrets.SystemRandom(), ph._clock(), 0  # noqa: SLF001 - the job's clock
        while made < 2 or (ph._clock() - began < HARNESS_STEPS_S and made < 256):  # noqa: SLF001
            p.inputs(rng.getrandbits(62))
            timer.flush()
            made += 1
        check_channel(state)
        ch.mark(LOADING_MARK, wait=True, at=ph._clock())  # noqa: SLF001 - the job's clock

    # the next inputs made outside this process, by a fork of it made now, before candidate code
    maker = None
    if job.inputs_maker and state.maker is not None and p.device.type == "cpu":
        template = p.inputs(secrets.randbits(62))
        maker = attach_maker(state.maker, state.job_line, template, input_sets(job, template))
    state.maker = None
    p.load_candidate(loading if p.device.type == "cpu" else None)
    ph.mark("load")
    alone(p, ch)
    ph.mark("wait_alone")
    tele0 = state.telemetry.read() if p.device.type == "cuda" else {}
    calls = timing_run(p, p.cand, job, ch, "candidate", ph, timer, state, marks=p.device.type == "cpu",
                       maker=maker)
    check(state)
    tele1 = state.telemetry.read() if p.device.type == "cuda" else {}
    ph.mark("telemetry")
    if problems := inline_problems():
        raise CandidateError("compile_error", "\n".join(problems))
    from cudagym.sandbox.worker.verify import unbuilt_code  # verify's report, at the timed loop's end too

    ch.final({"ok": True, "calls": calls, "params": p.params, "params_retry": p.params_retry,
              "telemetry": {"before": tele0, "after": tele1},
              "phases": ph.times, "diagnostics": ph.extra, "unbuilt_code": unbuilt_code(job)})


def run_baseline(job: Job, ch: Channel, state: WorkerState) -> None:
    """The reference's timed loops (eager, then torch.compile), under the candidate's protocol."""
    ph = Phases(state.originals["time.perf_counter"])
    p = Problem(job, state, with_candidate=False)
    alone(p, ch)  # the whole job: it compiles and plans between its loops
    timer = job_timer(p, job, state, ch)
    timing_run(p, p.ref, job, ch, "eager", ph, timer, state)
    body: dict[str, Any] = {"ok": True, **roofline_inputs(p)}
    if job.with_compile_baseline:
        try:
            compiled = torch.compile(p.ref)
            with torch.no_grad():
                compiled(*p.inputs(secrets.randbits(62)))  # the first call compiles
            ph.mark("torch_compile")
        except Exception as e:  # noqa: BLE001
            body["compile_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        else:
            timing_run(p, compiled, job, ch, "compiled", ph, timer, state)
    if job.library_baselines:
        body["library_errors"] = library_runs(p, job, ch, ph, timer, state)
    body["device_name"] = torch.cuda.get_device_name(p.device) if p.device.type == "cuda" else "cpu"
    ch.final({**body, "phases": ph.times, "diagnostics": ph.extra})


def library_runs(p: Problem, job: Job, ch: Channel, ph: Phases, timer: DeviceTimer,
                 state: WorkerState) -> dict[str, str]:
    """The timed loops of the job's library baselines (`cudagym.sandbox.library`), each planned,
    then checked against the reference on one input set; why each one that was not timed was not."""
    from cudagym.sandbox.library import LibraryUnavailableError, library_matmul

    errors: dict[str, str] = {}
    atol, rtol = job.library_tolerance
    for name in job.library_baselines:
        args = p.inputs(secrets.randbits(62))
        try:
            fn = library_matmul(name, args)
            with torch.no_grad():
                want, got = p.ref(*args), fn(*args)
            if not isinstance(want, torch.Tensor) or want.shape != got.shape or not torch.allclose(
                    got.float(), want.float(), atol=atol, rtol=rtol):
                worst = (got.float() - want.float()).abs().max().item() if isinstance(want, torch.Tensor) \
                    and want.shape == got.shape else float("nan")
                raise LibraryUnavailableError(f"its result does not match the reference (max abs error {worst:.3g}, "
                                         f"atol {atol:g}, rtol {rtol:g})")
        except LibraryUnavailableError as e:
            errors[name] = str(e)
            continue
        ph.mark(f"{name}_plan")
        timing_run(p, fn, job, ch, name, ph, timer, state)
    return errors



def run_ncu(job: Job, ch: Channel, state: WorkerState) -> None:
    """The ncu job kind (`cudagym.sandbox.ncu`). In the sandboxed worker: Nsight Compute over a
    child worker on the same job, and its metrics in the final frame. In that child (under ncu):
    run the candidate's forward a few times; ncu records the kernels launched between
    cudaProfilerStart and cudaProfilerStop, which enclose only the candidate's calls (not the
    input generation and copies around them), after one warm-up call."""
    from cudagym.sandbox.ncu import CALLS, UNDER_NCU, ncu_summary

    if not os.environ.get(UNDER_NCU):
        ch.final({"ok": True, "ncu": ncu_summary(job)})
        return
    p = Problem(job, state, with_candidate=True)
    args = p.inputs(secrets.randbits(62))
    sets = [clone_args(args) for _ in range(CALLS + 1)]
    cudart = torch.cuda.cudart()
    with torch.no_grad():
        p.cand(*sets[0])
        p.sync()
        cudart.cudaProfilerStart()
        for a in sets[1:]:
            p.cand(*a)
            p.sync()
        cudart.cudaProfilerStop()
    ch.final({"ok": True, "calls": CALLS})
