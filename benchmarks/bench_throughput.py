"""Throughput: K concurrent episodes of a recorded policy trace through one shared evaluator --
an `Evaluator` over this host's GPUs (`--harness local`), or a Ray `EvalPool` of device actors,
one per GPU (`--harness ray`) -- against a baseline row measured in the same run.

Protocol (one process; every row replays the same trace):
1. Trace: the scripted policy's turns (`ScriptedPolicy`: write the stored solution, compile,
   verify, profile, submit) for episodes 0..N-1 over the bundled tasks in manifest order (episode
   i plays task i mod 13), recorded once. Each turn is preceded by a think time (the policy's
   generation, simulated) drawn once, seeded, from `--think-s` x [1 - jitter, 1 + jitter], so
   that concurrent episodes do not move in lockstep. A row of n episodes replays episodes 0..n-1.
   Each episode's submit follows its profile of the same files: with `reuse_profiles` (the
   default; `--no-reuse` turns it off) it takes that profile's timing and verifies again
   (`cudagym.rewards.reuse`), so an episode asks for one timing job, not two.
2. Warm-up (not timed): one Evaluator (its default config: strict mode, warm spare workers,
   6 per GPU; the timed loops' stop rule from `--stop`, `--precision-rel`, `--min-timed-ms`,
   their warm-up from `--warmup-ms`) builds the stored solution and measures the baselines of
   every task the trace or the spread uses, so every row meets a warm build cache and baseline
   cache, as an RL run does after its first steps. A pool's actors share that cache directory.
   The torch.compile baselines are off unless `--compile-baseline`: they are measured once per
   task and cached, so they would only lengthen the warm-up.
3. Spread, no load: `--spread-jobs` (6; 3 on the CPU target) profile jobs of each
   `--spread-tasks` solution (default layernorm and a GELU resized to 1 MB, a few us), one after
   another (each in a fresh worker, spares starting in between, as in real use), on every GPU of
   the harness (a pool's: each device actor's own, at once).
4. Rows (the GPU idle `--settle-s` before each): n episodes (`--episodes`, default max(K, 3)),
   K at a time (a semaphore of K), each a `KernelEnv` on the shared evaluator played by
   `run_episode` -- what `cudagym run --concurrency K` does (`cudagym.agent.runner.arun`),
   without its trajectory store and report. The local harness's rows are `--ks` ("spares K=16");
   the ray harness's are `--pool-rows` GxK ("pool 2 GPU K=32"), each pool size started once
   (after the local evaluator is closed, so each actor has its GPU alone). Per row:
   - episodes completed (submitted) in the row's wall seconds, and episodes per hour;
   - GPU busy: NVML utilization (the share of each sample period in which a kernel ran) of the
     visible GPUs, summed and divided by the row's number of GPUs, sampled every 100 ms by a
     thread, averaged over the row's wall time and, beside it, over its checks window (first
     evaluator call's start to last one's end: the think-only ramp at the start of a row left
     out); "-" on the CPU target;
   - latency, seconds, p50 and p95, of each evaluator call the env's tools make (`acompile`,
     `averify`, `aprofile`; `aevaluate` for submit), timed around the call by a wrapper of the
     evaluator in this script; verify+profile is, per episode, its verify turn's call plus its
     profile turn's call (what an agent waits for to learn whether and how fast); beside them,
     the worker wait: per verify or profile call, its longest wait for a ready worker (the
     evaluator's breakdown), i.e. how much of the latency is the spares running out;
   - the GPU leases (`JobScheduler.holds`; a pool's from each device actor): the share of the
     row a timing job held a GPU alone, each timing job's exclusive hold p50 / p95 (issue 28's
     "1.2 s per job"), the part of it after its result, timing jobs and exclusive seconds per
     episode, the waits;
   - the candidate's timing jobs (profiles, and submits that did not reuse one): timed-loop calls
     p50 / p95 and the median's 95% interval, the worker's phases (the problem's set-up, the
     timer's calibration (0 where the GPU's last one was handed over), the candidate's load, the
     wait for the GPU alone, the timed loop (issue 28's "0.75 s"), the end checks), submits that
     reused their profile;
   - ratios against `--baseline` (default the first row measured): episodes per hour, p95
     verify+profile, exclusive hold p50, exclusive seconds per episode, timed calls.
   Beside the local row of K = `--spread-k` (default 16), and beside each pool's largest-K row,
   the spread jobs run again on every GPU, one after another, beside the episodes, on the same
   evaluator (they wait for the GPU lease and take spares like any check; that row's figures
   include their load; each job records whether episodes were still running when it ended).
5. Process-per-check rows (local harness; `--ppc-ks`, default 1; `--ppc-episodes` each): the
   same trace with an Evaluator of `spare_workers=0` on a local sandbox without its fork server:
   every check always gets a fresh worker; with no spares, none is started ahead, and with no
   fork server none is forked from a warm parent, so each check starts its own (python, import
   torch, CUDA context) when it arrives, as a harness that starts a process per check does.
   Same cache directory: builds and baselines stay warm. (The first Evaluator stays open
   meanwhile, its spares idle.)
   Run order: the smallest K row, the process-per-check rows, then the other rows ascending
   (the rows the comparisons need first). A row is skipped, and marked so, when the time so far
   plus its predicted duration would pass `--budget-s` (450 s), so that the default run ends
   within 8 minutes. The prediction, from the harness's last row: its waves of K episodes at
   that row's seconds per wave, or its episodes' verify, profile and submit seconds one after
   another per GPU (they queue for the GPUs), whichever is longer.

`--spare-workers`, `--spare-nice` and `--no-freeze` set the local sandbox's spares (how many, their
CPU priority while they start, whether timed loops pause them), to find what the worker wait at
K = 16 comes from; `--no-fork-server` spawns each worker, `--release-at-result` ends a job's GPU
lease when its result is in rather than once its worker is gone, `--exclusive-from loop` gives a
timing job the GPU alone only for its calibration and its timed loop (the candidate loads under a
shared lease), and `--calibration-max-age-s S` hands a GPU's calibration to later timing jobs.

Printed (stdout): the rows table, the ratios table, the lease table, the timing-job table; the
workers' start-up per row (spawn to ready, and each step on the worker's own clock: importing
torch, the CUDA context, importing the harness, `prewarm`, `prewarm_device` (where the gate
kernels are loaded, or compiled where the parent stored no image), mapping the result memory);
the spread table (each task on each GPU, idle and beside the row, against the protocol's target:
CV < 1% from 50 us of kernel, < 3% below), and issue 28's acceptance, each PASS or FAIL: at K = 16
on one GPU >= 1,500 episodes/h with p95 verify+profile < 10 s; the spreads within target; the
exclusive lease per timing job <= 0.5 s (p50) at K = 1; K = 32 on two GPUs >= 1.8x K = 16 on one
(the pool rows 1x16 and 2x32).
Progress goes to stderr; `--out` gets every raw number (each call's latency, each NVML sample,
each episode, each spread job), rewritten after every phase, so a run cut short keeps what it
measured.

Usage: python benchmarks/bench_throughput.py [--ks 1,4,16,32] [--episodes N] [--think-s 2]
           [--ppc-ks 1] [--ppc-episodes 2] [--spread-tasks norm_layernorm,...] [--spread-jobs 6]
           [--stop fixed|precision] [--no-reuse] [--baseline 'spares K=1']
           [--budget-s 450] [--target auto|cuda|cpu] [--out FILE.json]
       python benchmarks/bench_throughput.py --harness ray --pool-rows 1x16,2x32 [--baseline 'pool 1 GPU K=16']
One GPU with the local harness: on a host with several, make one visible (CUDA_VISIBLE_DEVICES),
or the evaluator uses all. The ray harness needs Ray (`pip install 'cudagym[ray]'`; the GPU image
lacks it: `benchmarks/fetch_verl_gpu_wheels.sh` puts a trimmed Ray wheel and jsonschema's into
.whl_verl/, installed there with `pip install --target` as .whl is).
CPU smoke runs: python benchmarks/bench_throughput.py --target cpu --ks 1,2 --think-s 0.2 --episodes 2
                python benchmarks/bench_throughput.py --target cpu --harness ray --pool-rows 1x2,2x4 --think-s 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from cudagym.agent.episode import EpisodeResult, run_episode
from cudagym.agent.policy import AssistantTurn, Policy, TurnContext
from cudagym.agent.scripted import ScriptedPolicy
from cudagym.env.kernel_env import EnvConfig, KernelEnv
from cudagym.core.verdict import ProfileResult
from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig, resolve_target
from cudagym.rewards.reuse import ProfileMemo
from cudagym.sandbox.gpu import _nvml, gpu_count
from cudagym.sandbox.config import LocalSandboxConfig
from cudagym.sandbox.local import LocalSandbox
from cudagym.sandbox.protocol import TimingConfig
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import bundled_task, bundled_tasks
from cudagym.tasks.model import Target, Task

# issue 28: >= 1,500 episodes/h at K = 16 on one GPU with p95 verify+profile < 10 s; an exclusive lease
# per timing job of <= 0.5 s (p50) at K = 1; K = 32 on two GPUs >= 1.8x K = 16 on one
GOAL_K, GOAL_RATE, GOAL_P95_S, GOAL_HOLD_S, GOAL_SCALE = 16, 1500, 10.0, 0.5, 1.8
# layernorm (63 us on an H100, CV target < 1%) and a 1 MB GELU of a few us (target < 3%)
DEFAULT_SPREAD = "norm_layernorm,ew_scale_bias_gelu:BATCH=16:FEATURES=16384"
KINDS = ("compile", "verify", "profile", "submit", "verify+profile")
WAIT = "worker wait"  # per verify or profile call: its longest wait for a ready worker (breakdown's *.wait_ready_s)


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between order statistics; None if empty."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def spread_target_cv(median_ms: float) -> float:
    """The timing protocol's target for the CV of candidate medians over separate jobs."""
    return 0.01 if median_ms >= 0.05 else 0.03


# -- the trace ---------------------------------------------------------------------------------
class TracePolicy(Policy):
    """Replays a recorded trace: turn t of an episode sleeps its think time, then returns its
    recorded turn (the last one again past the end). One instance serves concurrent episodes."""

    name = "trace"

    def __init__(self, turns: dict[str, list[tuple[float, AssistantTurn]]]) -> None:
        self.turns = turns

    async def aact(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                   context: TurnContext) -> AssistantTurn:
        steps = self.turns[context.episode_id]
        think_s, turn = steps[min(context.turn, len(steps) - 1)]
        await asyncio.sleep(think_s)
        return turn


async def record_trace(tasks: list[Task], episodes: int, target: Target, think_s: float, jitter: float,
                       seed: int) -> tuple[list[tuple[Task, str]], TracePolicy, list[dict[str, Any]]]:
    """The scripted policy's turns for episodes 0..episodes-1 (task i mod len(tasks)), up to its
    submit, each with its think time: the episodes (task, id) in order, the policy that replays
    them, and per episode its think times and tool names (for the report)."""
    scripted = ScriptedPolicy()  # Hermes text turns, as `cudagym run --policy scripted` plays them
    rng = random.Random(seed)
    plan: list[tuple[Task, str]] = []
    turns: dict[str, list[tuple[float, AssistantTurn]]] = {}
    summary: list[dict[str, Any]] = []
    for i in range(episodes):
        task = tasks[i % len(tasks)]
        eid = f"{task.id}@{i}"
        steps: list[tuple[float, AssistantTurn]] = []
        tools: list[list[str]] = []
        while not tools or "submit" not in tools[-1]:
            ctx = TurnContext(episode_id=eid, task_id=task.id, target=target.value, turn=len(steps))
            steps.append((think_s * rng.uniform(1 - jitter, 1 + jitter), await scripted.aact([], [], ctx)))
            tools.append([c.name for c in scripted.plan(ctx)[1]])
        plan.append((task, eid))
        turns[eid] = steps
        summary.append({"episode": eid, "task": task.id, "think_s": [t for t, _ in steps], "tools": tools})
    return plan, TracePolicy(turns), summary


# -- measurement -------------------------------------------------------------------------------
class TimedEvaluator:
    """The shared Evaluator with each call the env's tools make timed (seconds, this process's
    clock, from `t0`). Everything else goes to the Evaluator itself."""

    def __init__(self, inner: Any, t0: float) -> None:
        self.inner = inner
        self.t0 = t0
        self.calls: list[dict[str, Any]] = []
        self.first_check = asyncio.Event()  # set when the first verify or profile starts

    @property
    def target(self) -> Target:
        return self.inner.target

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def _timed(self, kind: str, workspace: Workspace, call: Awaitable[Any]) -> Any:
        if kind in ("verify", "profile"):
            self.first_check.set()
        start = time.perf_counter()
        result: Any = None
        try:
            result = await call
            return result
        finally:
            ok = getattr(result, "ok", None)
            if kind == "submit" and result is not None:
                ok = bool(result.correct)
            # the timing job's, where one ran: the profile's own, or the submit's (unless reused)
            p = result if kind == "profile" else getattr(result, "profile_result", None) if kind == "submit" else None
            stats = p.candidate if p is not None and not p.reused else None
            self.calls.append({"kind": kind, "workspace": str(workspace.root), "start_s": start - self.t0,
                               "seconds": time.perf_counter() - start, "ok": ok,
                               "breakdown": getattr(result if kind != "submit" else p, "breakdown", None) or None,
                               "timed_calls": stats.n if stats is not None else None,
                               "median_ci_rel": stats.median_ci_rel if stats is not None else None,
                               "timing_reused": bool(p is not None and p.reused)})

    async def acompile(self, task: Task, workspace: Workspace) -> Any:
        return await self._timed("compile", workspace, self.inner.acompile(task, workspace))

    async def averify(self, task: Task, workspace: Workspace) -> Any:
        return await self._timed("verify", workspace, self.inner.averify(task, workspace))

    async def aprofile(self, task: Task, workspace: Workspace, ncu: bool = False) -> Any:
        return await self._timed("profile", workspace, self.inner.aprofile(task, workspace, ncu))

    async def aevaluate(self, task: Task, workspace: Workspace, profiled: ProfileMemo | None = None) -> Any:
        return await self._timed("submit", workspace, self.inner.aevaluate(task, workspace, profiled))

    def latencies(self) -> dict[str, list[float]]:
        """Seconds per call kind; verify+profile per episode (its verify plus its profile call)."""
        out: dict[str, list[float]] = {k: [] for k in (*KINDS, WAIT)}
        per_ws: dict[str, dict[str, float]] = {}
        for c in self.calls:
            out[c["kind"]].append(c["seconds"])
            if c["kind"] in ("verify", "profile"):
                per_ws.setdefault(c["workspace"], {})[c["kind"]] = c["seconds"]
        out["verify+profile"] = [d["verify"] + d["profile"] for d in per_ws.values() if len(d) == 2]
        out[WAIT] = [max((v for k, v in c["breakdown"].items() if k.endswith("wait_ready_s")), default=0.0)
                     for c in self.calls if c["kind"] in ("verify", "profile") and c["breakdown"]]
        return out

    def checks_window(self) -> tuple[float, float] | None:
        if not self.calls:
            return None
        return min(c["start_s"] for c in self.calls), max(c["start_s"] + c["seconds"] for c in self.calls)


class GpuBusySampler:
    """NVML utilization (%) of the visible GPUs every `period_s`, on a thread, as (seconds since
    `t0`, their sum over `gpus`, the GPUs the row uses: a pool of one device actor on a host of
    two may have either, and the other idles); no samples without NVML."""

    def __init__(self, t0: float, gpus: int = 1, period_s: float = 0.1) -> None:
        self.t0 = t0
        self.gpus = gpus
        self.period_s = period_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-nvml", daemon=True)

    def _run(self) -> None:
        def loop(nv: Any, idx: list[int]) -> None:
            handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in idx]
            while handles and not self._stop.is_set():
                busy = min(100.0, sum(int(nv.nvmlDeviceGetUtilizationRates(h).gpu) for h in handles) / self.gpus)
                self.samples.append((time.perf_counter() - self.t0, busy))
                self._stop.wait(self.period_s)

        _nvml(loop)

    def __enter__(self) -> GpuBusySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def busy(self, start_s: float, end_s: float) -> float | None:
        """Mean utilization over [start_s, end_s] as a fraction; None without samples there."""
        xs = [u for t, u in self.samples if start_s <= t <= end_s]
        return statistics.fmean(xs) / 100 if xs else None


# -- phases ------------------------------------------------------------------------------------
def solution_workspace(root: Path, task: Task, target: Target) -> Workspace:
    """A workspace of `task`'s stored solution (a resized task's, `spread_task_of`: its bundled task's)."""
    name = task.id.split(":")[0]
    sol = ScriptedPolicy().solution_dir(name, target.value)
    if sol is None:
        raise SystemExit(f"no stored {target.value} solution for {name}")
    return Workspace.from_solution(root / task.id.replace(":", "_").replace("=", ""), task.for_target(target), sol)


async def warm_up(ev: Evaluator, tasks: list[Task], root: Path) -> dict[str, Any]:
    """Build every stored solution and measure every baseline (builds in parallel; the
    baselines queue for the GPU). Per task: compile ok and seconds, baseline seconds or error."""

    async def one(task: Task) -> tuple[str, dict[str, Any]]:
        t = task.for_target(ev.target)
        t0 = time.perf_counter()
        c = await ev.acompile(t, solution_workspace(root, task, ev.target))
        t1 = time.perf_counter()
        b = await ev.abaselines(t)
        r = {"compile_ok": c.ok, "compile_s": t1 - t0, "baselines_s": time.perf_counter() - t1,
             "baseline_error": b.get("error"), "compile_errors": c.errors[:3] if not c.ok else []}
        progress(f"[warm-up] {task.id}: compile {'ok' if c.ok else 'FAILED'} {r['compile_s']:.1f} s, baselines "
                 f"{r['baselines_s']:.1f} s" + (f"; {str(b['error'])[:300]}" if "error" in b else ""))
        return task.id, r

    return dict(await asyncio.gather(*(one(t) for t in tasks)))


Profile = Callable[[Task, Workspace], Awaitable[ProfileResult]]


def spread_spec(text: str) -> tuple[str, dict[str, int]]:
    """'TASK' or 'TASK:NAME=VALUE:...' (a bundled task, resized: `Task.resized`) as (id, sizes)."""
    name, *sizes = text.split(":")
    try:
        return name, {k: int(v) for k, v in (x.split("=", 1) for x in sizes)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"a spread task is TASK or TASK:NAME=INT:..., not {text!r}") from None


def spread_task_of(spec: tuple[str, dict[str, int]]) -> Task:
    """The bundled task of `spec`, resized, under an id that names its sizes."""
    name, sizes = spec
    task = bundled_task(name)
    if not sizes:
        return task
    return task.resized(**sizes).model_copy(update={"id": name + "".join(f":{k}={v}" for k, v in sizes.items())})


async def spread_jobs(profile: Profile, task: Task, ws: Workspace, jobs: int, t0: float,
                      loaded: Callable[[], bool] = lambda: False, where: str = "") -> dict[str, Any]:
    """`jobs` profile jobs of one solution, one after another (`profile`: an evaluator's, or one
    device actor's): each job's candidate median (ms), its times, and whether the load (`loaded()`)
    ran through it; the CV of the medians."""
    runs: list[dict[str, Any]] = []
    for j in range(jobs):
        start, under = time.perf_counter(), loaded()
        p = await profile(task, ws)
        r: dict[str, Any] = {
            "start_s": start - t0, "seconds": time.perf_counter() - start, "under_load": under and loaded(),
            "median_ms": p.candidate.median_ms if p.ok and p.candidate else None,
            "timed_calls": p.candidate.n if p.ok and p.candidate else None,
            "harness_overhead_ns": p.harness_overhead_ns, "error": None if p.ok else (p.error or "")[:500]}
        runs.append(r)
        progress(f"[spread{where}] {task.id} job {j + 1}/{jobs}: "
                 + (f"{r['median_ms']:.4f} ms over {r['timed_calls']} calls" if r["median_ms"] is not None
                    else f"error {r['error'][:200]}")
                 + f" ({r['seconds']:.1f} s{', under load' if r['under_load'] else ''})")
    medians = [r["median_ms"] for r in runs if r["median_ms"] is not None]
    out: dict[str, Any] = {"task": task.id, "where": where.strip(" @") or "-", "jobs": runs, "medians_ms": medians}
    if len(medians) >= 2:
        out["median_of_medians_ms"] = statistics.median(medians)
        out["cv"] = statistics.pstdev(medians) / statistics.fmean(medians)
    return out


async def spreads(harness: Harness, tasks: list[tuple[Task, Workspace]], jobs: int, t0: float,
                  loaded: Callable[[], bool] = lambda: False) -> list[dict[str, Any]]:
    """The spread of each task's solution on each GPU of the harness (its `profilers`: one for the
    local evaluator, which picks its GPU; one per device actor of a pool), the GPUs at once."""
    async def on(name: str, profile: Profile) -> list[dict[str, Any]]:
        return [await spread_jobs(profile, task, ws, jobs, t0, loaded, f" @{harness.label}{f'/{name}' if name else ''}")
                for task, ws in tasks]

    per_gpu = await asyncio.gather(*(on(name, prof) for name, prof in harness.profilers))
    return [s for found in per_gpu for s in found]


async def play_row(ev: TimedEvaluator, plan: list[tuple[Task, str]], policy: TracePolicy, k: int,
                   env_cfg: EnvConfig, label: str) -> list[dict[str, Any]]:
    """The episodes of `plan`, `k` at a time, as `cudagym.agent.runner.arun` plays them."""
    sem = asyncio.Semaphore(k)
    done = [0]

    async def one(task: Task, eid: str) -> dict[str, Any]:
        async with sem:
            env = KernelEnv(tasks=[task], evaluator=ev, config=env_cfg)  # type: ignore[arg-type]
            start = time.perf_counter()
            try:
                result = await run_episode(env, policy, task, eid, hermes_prompt=True, seed=0)
            except Exception as e:  # noqa: BLE001 - one broken episode must not end the row
                result = EpisodeResult(episode_id=eid, task_id=task.id, status="error", reward=0.0, turns=0,
                                       seconds=time.perf_counter() - start, error=f"{type(e).__name__}: {e}")
            finally:
                env.close()
        v = result.verdict or {}
        done[0] += 1
        progress(f"[{label}] {eid}: {result.status} {v.get('milestone', '')} reward {result.reward:g} "
                 f"{result.seconds:.1f} s ({done[0]}/{len(plan)})"
                 + (f"; {result.error[:300]}" if result.error else ""))
        return {"episode": eid, "task": task.id, "status": result.status, "reward": result.reward,
                "milestone": v.get("milestone"), "correct": v.get("correct"), "turns": result.turns,
                "start_s": start - ev.t0, "seconds": result.seconds, "error": result.error}

    return list(await asyncio.gather(*(one(t, e) for t, e in plan)))


@dataclass
class Harness:
    """What a row's episodes run against: an evaluator (an `Evaluator`, or an `EvalPool` of device
    actors), the GPU leases its sandboxes held (`LeaseHold`s, on this host's monotonic clock), and
    a profile function per GPU for the spread (one for a local evaluator, which picks its GPU;
    one per device actor of a pool)."""

    label: str
    evaluator: Any
    holds: Callable[[], Awaitable[list[Any]]]
    profilers: list[tuple[str, Profile]]
    gpus: int = 1


def local_harness(label: str, ev: Evaluator) -> Harness:
    async def holds() -> list[Any]:
        return list(getattr(ev.sandbox, "lease_holds", []))

    return Harness(label, ev, holds, [("", ev.aprofile)], gpus=max(gpu_count(), 1) if ev.target == Target.CUDA else 1)


def pool_harness(pool: Any) -> Harness:
    """A Ray pool's harness: its device actors' leases (each actor's `lease_holds`) and each
    actor's own profile (the spread on every GPU)."""
    from cudagym.pool import WorkspaceSnapshot

    devices = [a for a in pool.actors() if a["kind"] == "device"]

    async def holds() -> list[Any]:
        found = await asyncio.gather(*(a["handle"].lease_holds.remote() for a in devices))
        return [h for held in found for h in held]

    def on(handle: Any) -> Profile:
        async def profile(task: Task, ws: Workspace) -> ProfileResult:
            return await handle.profile.remote(task, WorkspaceSnapshot.of(ws))

        return profile

    return Harness(f"pool {len(devices)} GPU", pool, holds, [(a["name"], on(a["handle"])) for a in devices],
                   gpus=len(devices))


async def measure_row(harness: Harness, plan: list[tuple[Task, str]], policy: TracePolicy, k: int,
                      env_cfg: EnvConfig, cuda: bool,
                      spread: tuple[list[tuple[Task, Workspace]], int] | None = None) -> dict[str, Any]:
    """One row: the episodes of `plan`, `k` at a time, with the NVML sampler running (GPU) and,
    if `spread` is given (its tasks and jobs each), its profile jobs beside them on every GPU
    of the harness once the first check has started."""
    t0 = time.perf_counter()
    name = f"{harness.label} K={k}"
    timed = TimedEvaluator(harness.evaluator, t0)
    running = [True]
    progress(f"[{name}] {len(plan)} episodes, {k} at a time")

    async def beside() -> list[dict[str, Any]] | None:
        if spread is None:
            return None
        await timed.first_check.wait()
        return await spreads(harness, spread[0], spread[1], t0, loaded=lambda: running[0])

    async def episodes() -> list[dict[str, Any]]:
        try:
            return await play_row(timed, plan, policy, k, env_cfg, name)
        finally:
            running[0] = False
            timed.first_check.set()  # no check ran: the spread jobs run anyway, marked not under load

    with GpuBusySampler(t0, harness.gpus) if cuda else contextlib.nullcontext() as sampler:
        spread_task = asyncio.ensure_future(beside())
        eps = await episodes()
        wall = time.perf_counter() - t0
        loaded_spread = await spread_task
    lat = timed.latencies()
    window = timed.checks_window()
    completed = sum(e["status"] == "done" for e in eps)
    row = {"name": name, "label": harness.label, "k": k, "gpus": harness.gpus, "episodes": len(plan),
           "completed": completed, "correct": sum(bool(e["correct"]) for e in eps), "wall_s": wall,
           "episodes_per_hour": completed / wall * 3600 if wall > 0 else None,
           "gpu_busy": sampler.busy(0.0, wall) if sampler else None,
           "gpu_busy_checks_window": sampler.busy(*window) if sampler and window else None,
           "checks_window_s": window,
           "latency_s": {kind: {"p50": percentile(xs, 50), "p95": percentile(xs, 95), "n": len(xs)}
                         for kind, xs in lat.items()},
           "latencies_s": lat, "calls": timed.calls, "episode_results": eps,
           "nvml_samples": sampler.samples if sampler else []}
    if loaded_spread is not None:
        row["spread"] = loaded_spread
    row["leases"] = lease_stats([h for h in await harness.holds() if t0 <= h.acquired_s <= t0 + wall], wall,
                                completed)
    row["timing_jobs"] = timing_job_stats(timed.calls)
    progress(f"[{name}] {completed}/{len(plan)} episodes in {wall:.1f} s; p95 verify+profile "
             f"{fmt_s(row['latency_s']['verify+profile']['p95'])} s; GPU busy {fmt_pct(row['gpu_busy'])}; exclusive "
             f"hold p50 {fmt_s(row['leases']['hold_p50_s'])} s")
    return row


def lease_stats(holds: list[Any], wall_s: float, episodes: int) -> dict[str, Any]:
    """Where the GPUs' time went in a row, from the schedulers' leases (`LeaseHold`): how much of
    the row a timing job held a GPU alone (summed over GPUs), and per timing job its exclusive hold
    (p50, p95; the sum of its parts, `LeaseHold.job`: its calibration's and its loop's), the part
    of it after its result was in (its worker going away), and its waits for the GPU alone; timing
    jobs and exclusive seconds per completed episode; the urgent (reference) and other checks'
    waits."""
    excl = [h for h in holds if h.exclusive and h.released_s is not None]
    refs = [h for h in holds if not h.exclusive and h.kind == "reference"]
    others = [h for h in holds if not h.exclusive and h.kind != "reference" and h.kind not in ("profile", "baseline")]
    per_job: dict[Any, list[Any]] = {}  # a timing job holds the GPU alone in parts (calibration, loop)
    for h in excl:
        per_job.setdefault(h.job or id(h), []).append(h)

    held = [sum(h.released_s - h.acquired_s for h in parts) for parts in per_job.values()]
    tail = [parts[-1].released_s - parts[-1].result_s for parts in per_job.values() if parts[-1].result_s is not None]
    timing_waits = [sum(h.acquired_s - h.asked_s for h in parts) for parts in per_job.values()]
    return {"timing_jobs": len(per_job), "exclusive_share": sum(held) / wall_s if wall_s > 0 else None,
            "hold_p50_s": percentile(held, 50), "hold_p95_s": percentile(held, 95),
            "after_result_p50_s": percentile(tail, 50),
            "timing_jobs_per_episode": len(excl) / episodes if episodes else None,
            "exclusive_s_per_episode": sum(held) / episodes if episodes else None,
            "timing_wait_p50_s": percentile(timing_waits, 50), "timing_wait_p95_s": percentile(timing_waits, 95),
            "reference_wait_p95_s": percentile([h.acquired_s - h.asked_s for h in refs], 95),
            "check_wait_p95_s": percentile([h.acquired_s - h.asked_s for h in others], 95)}


def timing_job_stats(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The candidate's timing jobs of a row (its profile calls, and its submits that were not
    reused), from their results: timed-loop calls (p50, p95), the median's confidence interval
    (`TimingStats.median_ci_rel`, p50), and the worker's phases, p50 s: `problem` (its set-up),
    `calibration` (the timer's), `load` (the candidate's), `wait_alone` (for the GPU alone), the
    timed loop (and in it, on the parent's clock, the warm-up, its calls, and the timed calls), the end
    checks (`telemetry`: tamper checks and telemetry), the whole job from its ready worker to
    its result (`worker`), and the part of that outside the worker's own phases (the parent's
    device checks before and after, the job line, the result); submits, and how many reused their
    episode's profile."""
    jobs = [c for c in calls if c["kind"] in ("profile", "submit") and c.get("timed_calls")]

    def phase(key: str) -> list[float]:
        return [c["breakdown"][key] for c in jobs if key in (c.get("breakdown") or {})]

    def outside(c: dict[str, Any]) -> float | None:  # the job's seconds not in the worker's own phases
        b = c.get("breakdown") or {}
        own = [v for k, v in b.items() if k.startswith("candidate.") and not k.startswith(
            ("candidate.startup_", "candidate.wait_", "candidate.parent_")) and k != "candidate.worker_s"]
        return b["candidate.worker_s"] - sum(own) if "candidate.worker_s" in b and own else None

    submits = [c for c in calls if c["kind"] == "submit"]
    n = [float(c["timed_calls"]) for c in jobs]
    return {"jobs": len(jobs), "timed_calls_p50": percentile(n, 50), "timed_calls_p95": percentile(n, 95),
            "median_ci_rel_p50": percentile([c["median_ci_rel"] for c in jobs if c.get("median_ci_rel") is not None],
                                            50),
            "problem_p50_s": percentile(phase("candidate.problem_s"), 50),
            "calibration_p50_s": percentile(phase("candidate.calibration_s"), 50),
            "load_p50_s": percentile(phase("candidate.load_s"), 50),
            "wait_alone_p50_s": percentile(phase("candidate.wait_alone_s"), 50),
            "end_checks_p50_s": percentile(phase("candidate.telemetry_s"), 50),
            "timed_loop_p50_s": percentile(phase("candidate.candidate_timed_loop_s"), 50),
            "warmup_p50_s": percentile(phase("feed.candidate_warmup_s"), 50),
            "warmup_calls_p50": percentile(phase("feed.candidate_warmup_calls"), 50),
            "timed_p50_s": percentile(phase("feed.candidate_timed_s"), 50),
            "timed_loop_p95_s": percentile(phase("candidate.candidate_timed_loop_s"), 95),
            "worker_p50_s": percentile(phase("candidate.worker_s"), 50),
            "outside_phases_p50_s": percentile([x for c in jobs if (x := outside(c)) is not None], 50),
            "submits": len(submits), "submits_reused": sum(bool(c.get("timing_reused")) for c in submits),
            "parent_steps_p50_s": {k.removeprefix("candidate.parent_").removesuffix("_s"): percentile(phase(k), 50)
                                   for k in dict.fromkeys(k for c in jobs for k in (c.get("breakdown") or {})
                                                          if k.startswith("candidate.parent_"))}}


def _per_row_table(title: str, rows: list[dict[str, Any]], key: str, cols: tuple[str, ...],
                   cell: Callable[[str, Any], str]) -> Table:
    """A table of one row per measured bench row: `rows[i][key][c]` for each column `c`, as `cell(c, value)`."""
    t = Table(title=title)
    for c in ("row", *cols):
        t.add_column(c.replace("_", " "), overflow="fold")
    for r in rows:
        if r.get("skipped") or key not in r:
            continue
        t.add_row(r["name"], *(cell(c, r[key][c]) for c in cols))
    return t


def lease_table(rows: list[dict[str, Any]]) -> Table:
    cols = ("timing_jobs", "timing_jobs_per_episode", "exclusive_s_per_episode", "exclusive_share", "hold_p50_s",
            "hold_p95_s", "after_result_p50_s", "timing_wait_p50_s", "timing_wait_p95_s", "reference_wait_p95_s",
            "check_wait_p95_s")
    return _per_row_table("GPU leases per row: timing jobs hold a GPU alone; checks share it (seconds)", rows,
                          "leases", cols, lambda c, v: fmt_pct(v) if c == "exclusive_share"
                          else str(v) if c == "timing_jobs" else fmt_s(v))


def timing_job_table(rows: list[dict[str, Any]]) -> Table:
    cols = ("jobs", "timed_calls_p50", "timed_calls_p95", "median_ci_rel_p50", "problem_p50_s", "calibration_p50_s",
            "load_p50_s", "wait_alone_p50_s", "timed_loop_p50_s", "warmup_p50_s", "warmup_calls_p50", "timed_p50_s",
            "timed_loop_p95_s", "end_checks_p50_s",
            "worker_p50_s", "outside_phases_p50_s", "submits", "submits_reused")
    return _per_row_table("the candidate's timing jobs per row: timed-loop calls, the median's 95% interval "
                          "(relative half-width), the worker's phases (seconds, p50), submits that reused their "
                          "episode's profile",
                          rows, "timing_jobs", cols, lambda c, v: fmt_pct2(v) if c == "median_ci_rel_p50"
                          else str(v) if c in ("jobs", "submits", "submits_reused") else fmt_s(v))


def parent_steps_table(rows: list[dict[str, Any]]) -> Table:
    """The parent's own steps of each row's timing jobs (p50 s, `JobOutcome.phases` "parent_*"):
    each from the one before it, from the ready worker to the collected result."""
    steps = list(dict.fromkeys(k for r in rows for k in (r.get("timing_jobs") or {}).get("parent_steps_p50_s", {})))
    t = Table(title="the parent's steps of a timing job (p50 s, each from the step before; 'worker' holds its run)")
    for c in ("row", *steps):
        t.add_column(c.replace("_", " "), overflow="fold")
    for r in rows:
        if r.get("skipped") or "timing_jobs" not in r:
            continue
        got = r["timing_jobs"].get("parent_steps_p50_s", {})
        t.add_row(r["name"], *(fmt_s(got.get(k)) for k in steps))
    return t


# -- tables ------------------------------------------------------------------------------------
def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def fmt_pct2(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def fmt_ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def baseline_row(rows: list[dict[str, Any]], name: str | None) -> dict[str, Any] | None:
    """The measured row named `name` (default: the first measured row)."""
    done = [r for r in rows if not r.get("skipped")]
    return next((r for r in done if r["name"] == name), None) if name else (done[0] if done else None)


def rows_table(rows: list[dict[str, Any]], device: str) -> Table:
    t = Table(title=f"throughput on {device}: latency p50 / p95 in seconds")
    for c in ("row", "GPUs", "episodes done", "wall s", "episodes/h", "GPU busy", "busy, checks window",
              *(f"{k} p50 / p95" for k in (*KINDS, WAIT))):
        t.add_column(c, overflow="fold")
    for r in rows:
        if r.get("skipped"):
            t.add_row(r["name"], "-", f"skipped: {r['skipped']}", *["-"] * (4 + len(KINDS) + 1))
            continue
        lat = r["latency_s"]
        t.add_row(r["name"], str(r["gpus"]), f"{r['completed']}/{r['episodes']}", f"{r['wall_s']:.1f}",
                  f"{r['episodes_per_hour']:.0f}", fmt_pct(r["gpu_busy"]), fmt_pct(r["gpu_busy_checks_window"]),
                  *(f"{fmt_s(lat[k]['p50'])} / {fmt_s(lat[k]['p95'])}" for k in (*KINDS, WAIT)))
    return t


def ratios_table(rows: list[dict[str, Any]], base: dict[str, Any] | None) -> Table:
    """Each measured row against the baseline row (measured in the same run)."""
    t = Table(title=f"ratios against {base['name'] if base else '-'} (same run)")
    for c in ("row", "GPUs", "episodes/h", "ep/h ratio", "v+p p95 s", "v+p p95 ratio", "exclusive hold p50 s",
              "hold p50 ratio", "exclusive s / episode", "ratio", "timed calls p50", "ratio"):
        t.add_column(c, overflow="fold")
    if base is None:
        return t

    def get(r: dict[str, Any], *path: str) -> Any:
        for k in path:
            r = (r or {}).get(k)  # type: ignore[assignment]
        return r

    for r in rows:
        if r.get("skipped"):
            continue
        cells = []
        for path in (("episodes_per_hour",), ("latency_s", "verify+profile", "p95"), ("leases", "hold_p50_s"),
                     ("leases", "exclusive_s_per_episode"), ("timing_jobs", "timed_calls_p50")):
            cells += [fmt_s(get(r, *path)), fmt_ratio(get(r, *path), get(base, *path))]
        t.add_row(r["name"], str(r["gpus"]), *cells)
    return t


def startup_table(rows: list[dict[str, Any]]) -> Table:
    """Per row, the workers its checks ran in: spawn to ready (wall, which holds the time a spare
    waited paused or at low priority) and each start-up step on the worker's own clock, p50 / p95 s."""
    t = Table(title="worker start-up of the checks' workers (spawn to ready; steps on the worker's clock), p50 / p95 s")
    per_row: list[tuple[dict[str, Any], dict[str, list[float]]]] = []
    for r in rows:
        steps: dict[str, list[float]] = {}
        for c in r.get("calls") or []:
            for key, v in (c.get("breakdown") or {}).items():
                role_step = key.rsplit(".", 1)[-1]
                if role_step.startswith("startup_") and role_step.endswith("_s"):
                    steps.setdefault(role_step[len("startup_"):-2], []).append(v)
        per_row.append((r, steps))
    names = sorted({n for _, steps in per_row for n in steps}, key=lambda n: (n != "wall", n))
    for c in ("row", "workers", *names):
        t.add_column(c, overflow="fold")
    for r, steps in per_row:
        if r.get("skipped"):
            continue
        t.add_row(r["name"], str(len(steps.get("wall", []))),
                  *(f"{fmt_s(percentile(steps[n], 50))} / {fmt_s(percentile(steps[n], 95))}" if steps.get(n) else "-"
                    for n in names))
    return t


def spread_verdicts(idle: list[dict[str, Any]], loaded: list[dict[str, Any]], cuda: bool) -> list[dict[str, Any]]:
    """Per spread (condition, task, GPU): its CV against the protocol's target for its median."""
    base = {(s["task"], s["where"]): s.get("median_of_medians_ms") for s in idle}
    out = []
    for condition, found in (("no load", idle), ("beside the row", loaded)):
        for s in found:
            m = s["medians_ms"]
            ref = base.get((s["task"], s["where"])) or s.get("median_of_medians_ms") or (statistics.median(m) if m
                                                                                        else 1.0)
            target, cv, median = spread_target_cv(ref), s.get("cv"), s.get("median_of_medians_ms")
            idle_median = base.get((s["task"], s["where"]))
            out.append({"condition": condition, "task": s["task"], "gpu": s["where"], "jobs_ok": len(m),
                        "jobs": len(s["jobs"]), "under_load": sum(j["under_load"] for j in s["jobs"]),
                        "median_ms": s.get("median_of_medians_ms"), "min_ms": min(m) if m else None,
                        "max_ms": max(m) if m else None, "cv": cv, "target": target,
                        "timed_calls_p50": percentile([j["timed_calls"] for j in s["jobs"] if j["timed_calls"]], 50),
                        "ok": None if cv is None or not cuda else cv < target,
                        "vs_no_load": median / idle_median if condition != "no load" and median and idle_median
                        else None})
    return out


def spread_table(verdicts: list[dict[str, Any]]) -> Table:
    t = Table(title="timing spread: candidate medians of separate profile jobs of one stored solution")
    for c in ("condition", "task", "GPU", "jobs ok", "under load", "timed calls p50", "median of medians ms",
              "min ms", "max ms", "CV", "target", "verdict", "median vs no load"):
        t.add_column(c, overflow="fold")
    for v in verdicts:
        t.add_row(v["condition"], v["task"], v["gpu"], f"{v['jobs_ok']}/{v['jobs']}",
                  str(v["under_load"]) if v["condition"] != "no load" else "-", fmt_s(v["timed_calls_p50"]),
                  "-" if v["median_ms"] is None else f"{v['median_ms']:.4f}",
                  "-" if v["min_ms"] is None else f"{v['min_ms']:.4f}",
                  "-" if v["max_ms"] is None else f"{v['max_ms']:.4f}", fmt_pct2(v["cv"]), f"< {v['target']:.0%}",
                  "-" if v["cv"] is None else ("n/a (CPU)" if v["ok"] is None else ("PASS" if v["ok"] else "FAIL")),
                  "-" if v["vs_no_load"] is None else f"{v['vs_no_load']:.2f}x")
    return t


def goal(rows: list[dict[str, Any]], verdicts: list[dict[str, Any]], cuda: bool) -> list[dict[str, Any]]:
    """Issue 28's acceptance, criterion by criterion: measured value, target, PASS / FAIL ("-" if
    not measured in this run; the spread is judged on a GPU only)."""
    done = [r for r in rows if not r.get("skipped")]
    one = next((r for r in done if r["gpus"] == 1 and r["k"] == GOAL_K), None)
    k1 = next((r for r in done if r["gpus"] == 1 and r["k"] == 1), None)
    two = next((r for r in done if r["gpus"] == 2 and r["k"] == 2 * GOAL_K), None)
    one_pool = next((r for r in done if r["gpus"] == 1 and r["k"] == GOAL_K and r["label"] == (two or {}).get(
        "label", "").replace("2 GPU", "1 GPU")), one)
    rate = one["episodes_per_hour"] if one else None
    p95 = one["latency_s"]["verify+profile"]["p95"] if one else None
    hold = k1["leases"]["hold_p50_s"] if k1 else None
    loaded = [v for v in verdicts if v["condition"] != "no load"]
    spread_ok = None if not loaded or any(v["ok"] is None for v in loaded) else all(v["ok"] for v in loaded)
    worst = max((v["cv"] / v["target"] for v in loaded if v["cv"] is not None), default=None)
    scale = two["episodes_per_hour"] / one_pool["episodes_per_hour"] if two and one_pool and \
        one_pool["episodes_per_hour"] else None

    def verdict(ok: bool | None) -> str:
        return "-" if ok is None else ("PASS" if ok else "FAIL")

    return [
        {"criterion": f"episodes/h at K = {GOAL_K}, one GPU", "measured": fmt_s(rate), "target": f">= {GOAL_RATE}",
         "verdict": verdict(None if rate is None or not cuda else rate >= GOAL_RATE)},
        {"criterion": f"p95 verify+profile at K = {GOAL_K}, one GPU", "measured": f"{fmt_s(p95)} s",
         "target": f"< {GOAL_P95_S:g} s", "verdict": verdict(None if p95 is None else p95 < GOAL_P95_S)},
        {"criterion": "timing spread beside the rows (every task and GPU)",
         "measured": "-" if worst is None else f"worst CV at {worst:.0%} of its target",
         "target": "each CV < its target", "verdict": verdict(spread_ok)},
        {"criterion": "exclusive lease per timing job, p50, K = 1", "measured": f"{fmt_s(hold)} s",
         "target": f"<= {GOAL_HOLD_S:g} s",
         "verdict": verdict(None if hold is None or not cuda else hold <= GOAL_HOLD_S)},
        {"criterion": f"K = {2 * GOAL_K} on two GPUs against K = {GOAL_K} on one", "measured": fmt_ratio(scale, 1.0),
         "target": f">= {GOAL_SCALE:g}x",
         "verdict": verdict(None if scale is None or not cuda else scale >= GOAL_SCALE)},
    ]


def goal_table(g: list[dict[str, Any]]) -> Table:
    t = Table(title="acceptance (issue 28)")
    for c in ("criterion", "measured", "target", "verdict"):
        t.add_column(c)
    for r in g:
        t.add_row(r["criterion"], r["measured"], r["target"], r["verdict"])
    return t


# -- main --------------------------------------------------------------------------------------
def parse_ks(text: str) -> list[int]:
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, not {text!r}") from None
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError("every K must be >= 1")
    return ks


def parse_pool_rows(text: str) -> list[tuple[int, int]]:
    """'GxK,...' (device actors x concurrent episodes) as [(G, K), ...]."""
    try:
        rows = [tuple(int(v) for v in x.lower().split("x")) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"pool rows are GxK,... (GPUs x episodes), not {text!r}") from None
    if not rows or any(len(r) != 2 or min(r) < 1 for r in rows):
        raise argparse.ArgumentTypeError(f"pool rows are GxK,... with G, K >= 1, not {text!r}")
    return [(r[0], r[1]) for r in rows]


def timing_config(args: argparse.Namespace) -> TimingConfig:
    """The evaluator's timing protocol with the command line's stop rule."""
    over: dict[str, Any] = {}
    if args.stop is not None:
        over["stop"] = args.stop
    if args.precision_rel is not None:
        over["precision_rel"] = args.precision_rel
    if args.min_timed_ms is not None:
        over["min_timed_ms"] = args.min_timed_ms
    if args.warmup_ms is not None:
        over["warmup_ms"] = args.warmup_ms
    return TimingConfig(**over)


async def run(args: argparse.Namespace, target: Target, work: Path, report: dict[str, Any],
              save: Callable[[], None]) -> None:
    cuda = target == Target.CUDA
    t_start = time.perf_counter()
    tasks = bundled_tasks()
    pool_rows: list[tuple[int, int]] = args.pool_rows if args.harness == "ray" else []
    ks = sorted(set(args.ks)) if args.harness == "local" else []
    n_of = {k: args.episodes or max(k, 3) for k in [*ks, *(k for _, k in pool_rows)]}
    n_max = max([*n_of.values(), *(max(args.ppc_episodes, k) for k in (args.ppc_ks if ks else []))])
    plan, policy, report["trace"] = await record_trace(tasks, n_max, target, args.think_s, args.think_jitter,
                                                      args.seed)
    spread_tasks = [spread_task_of(s) for s in args.spread_tasks]
    used = {t.id for t, _ in plan}
    cache = args.cache_dir or work / "cache"
    base_cfg = dict(target=target.value, mode="strict", cache_dir=cache, compile_baseline=args.compile_baseline,
                    timing=timing_config(args), reuse_profiles=not args.no_reuse)
    report["timing"] = base_cfg["timing"].model_dump()  # type: ignore[union-attr]
    spread_k = max((k for k in ks if k <= args.spread_k), default=max(ks, default=0))
    report["spread_k"] = spread_k
    rows: list[dict[str, Any]] = report["rows"]

    def env_cfg(name: str) -> EnvConfig:
        safe = name.replace(" ", "_").replace("=", "")
        return EnvConfig(target=target.value, mode="strict", max_turns=30, workspace_root=work / "episodes" / safe)

    # per harness, from its last row: seconds per wave of K episodes, and device-bound seconds per
    # episode (its verify, profile and submit calls, which queue for the GPU), per GPU
    pace: dict[str, tuple[float, float]] = {}

    def predict(harness: Harness, k: int, n: int) -> float:
        if harness.label not in pace:
            return 0.0
        wave_s, device_s = pace[harness.label]
        return max(math.ceil(n / k) * wave_s, n * device_s / harness.gpus)

    spread_ws = [(t.for_target(target), solution_workspace(work / "spread" / str(i), t, target))
                 for i, t in enumerate(spread_tasks)]

    async def row(harness: Harness, k: int, n: int, beside: bool) -> None:
        name = f"{harness.label} K={k}"
        elapsed = time.perf_counter() - t_start
        predicted = predict(harness, k, n)
        if elapsed + args.settle_s + predicted > args.budget_s:
            why = f"{elapsed:.0f} s so far + {predicted:.0f} s predicted > the {args.budget_s:g} s budget"
            progress(f"[{name}] skipped: {why}")
            rows.append({"name": name, "label": harness.label, "k": k, "gpus": harness.gpus, "episodes": n,
                         "skipped": why})
            save()
            return
        await asyncio.sleep(args.settle_s)
        spread = (spread_ws, args.spread_jobs) if beside and args.spread_jobs and spread_ws else None
        r = await measure_row(harness, plan[:n], policy, k, env_cfg(name), cuda, spread)
        r["predicted_s"] = predicted or None
        if r["completed"]:
            lat = r["latencies_s"]
            pace[harness.label] = (r["wall_s"] / math.ceil(r["completed"] / k),
                                   sum(sum(lat.get(kind, [])) for kind in ("verify", "profile", "submit"))
                                   / r["completed"])
        rows.append(r)
        if "spread" in r:
            report["spread"]["loaded"] += r.pop("spread")
        save()

    async def idle_spread(harness: Harness) -> None:
        if args.spread_jobs and spread_ws:
            await asyncio.sleep(args.settle_s)
            report["spread"]["idle"] += await spreads(harness, spread_ws, args.spread_jobs, time.perf_counter())
            save()

    spares = LocalSandboxConfig(spare_workers=args.spare_workers, freeze_starting_spares=not args.no_freeze,
                                release_gpu_at_result=args.release_at_result, fork_server=not args.no_fork_server,
                                **({} if args.spare_nice is None else {"spare_nice": args.spare_nice}),
                                **({} if args.exclusive_from is None else {"exclusive_from": args.exclusive_from}),
                                **({} if args.calibration_max_age_s is None
                                   else {"calibration_max_age_s": args.calibration_max_age_s}))
    with Evaluator(EvaluatorConfig(**base_cfg, sandbox=spares),  # type: ignore[arg-type]
                   sandbox=LocalSandbox(spares, home=Path(cache) / "home")) as ev:
        report["device"] = ev.device_name
        warm = [t for t in tasks if t.id in used] + spread_tasks
        progress(f"[warm-up] {len(warm)} tasks on {ev.device_name}: build their stored solutions, measure baselines")
        t0 = time.perf_counter()
        report["warmup"] = await warm_up(ev, warm, work / "warmup")
        report["warmup_s"] = time.perf_counter() - t0
        save()
        if ks:
            local = local_harness("spares", ev)
            await idle_spread(local)
            await row(local, ks[0], n_of[ks[0]], ks[0] == spread_k)
            if args.ppc_ks:
                per_check = LocalSandboxConfig(spare_workers=0, fork_server=False)  # python, torch, CUDA per check
                with Evaluator(EvaluatorConfig(**base_cfg, sandbox=per_check),  # type: ignore[arg-type]
                               sandbox=LocalSandbox(per_check, home=Path(cache) / "home")) as ppc:
                    for k in args.ppc_ks:
                        await row(local_harness("process per check", ppc), k, max(args.ppc_episodes, k), False)
            for k in ks[1:]:
                await row(local, k, n_of[k], k == spread_k)
    if pool_rows:  # the local evaluator's workers are gone: each device actor has its GPU alone
        from cudagym.pool import EvalPool, PoolConfig

        for gpus in sorted({g for g, _ in pool_rows}):
            cfg = PoolConfig(evaluator=EvaluatorConfig(**base_cfg, sandbox=spares),  # type: ignore[arg-type]
                             device_actors=gpus, compile_actors=1)
            t0 = time.perf_counter()
            with EvalPool.start(cfg) as pool:
                harness = pool_harness(pool)
                progress(f"[{harness.label}] started in {time.perf_counter() - t0:.1f} s")
                mine = sorted(k for g, k in pool_rows if g == gpus)
                await idle_spread(harness)
                for k in mine:
                    await row(harness, k, n_of[k], k == mine[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--harness", choices=("local", "ray"), default="local",
                    help="local: one Evaluator in this process over the visible GPUs (rows --ks); ray: an EvalPool "
                         "of device actors, one per GPU (rows --pool-rows); default local")
    ap.add_argument("--ks", type=parse_ks, default=[1, 4, 16, 32],
                    help="concurrent episodes per row of the local harness (default 1,4,16,32)")
    ap.add_argument("--pool-rows", type=parse_pool_rows, default=[(1, GOAL_K), (2, 2 * GOAL_K)],
                    help="rows of the ray harness, GPUsxK: device actors x concurrent episodes (default 1x16,2x32; "
                         "each pool size is started once, its rows run ascending)")
    ap.add_argument("--baseline", default=None,
                    help="the row the ratios table compares against, by name, e.g. 'spares K=1' or 'pool 1 GPU "
                         "K=16' (default: the first row measured)")
    ap.add_argument("--episodes", "--episodes-per-k", type=int, default=None,
                    help="episodes per row (default max(K, 3); fewer than K leaves K - n slots unused)")
    ap.add_argument("--think-s", type=float, default=2.0, help="mean think time per turn, seconds (default 2)")
    ap.add_argument("--think-jitter", type=float, default=0.5,
                    help="think times drawn from think-s x [1 - j, 1 + j] (default 0.5)")
    ap.add_argument("--ppc-ks", type=lambda text: parse_ks(text) if text else [], default=[1],
                    help="process-per-check rows, K each (default 1; '' for none; local harness only)")
    ap.add_argument("--ppc-episodes", type=int, default=2,
                    help="episodes per process-per-check row (default 2, at least K)")
    ap.add_argument("--spread-tasks", type=lambda text: [spread_spec(x) for x in text.split(",") if x],
                    default=[spread_spec(x) for x in DEFAULT_SPREAD.split(",")],
                    help="bundled tasks whose stored solutions the spread times, each TASK or TASK:NAME=INT:... "
                         f"(resized; default {DEFAULT_SPREAD}: layernorm, and a 1 MB GELU of a few us)")
    ap.add_argument("--spread-jobs", type=int, default=None,
                    help="profile jobs per task and GPU per spread measurement (default 6; 3 on the CPU target, where "
                         "it is not judged; 0: none)")
    ap.add_argument("--spread-k", type=int, default=GOAL_K,
                    help="the local row the loaded spread runs beside (default 16; else the largest K below it); "
                         "a pool's runs beside its largest K")
    ap.add_argument("--stop", choices=("fixed", "precision"), default=None,
                    help="the timed loop's length (TimingConfig.stop; default the config's, precision)")
    ap.add_argument("--precision-rel", type=float, default=None,
                    help="precision: the median's 95%% interval within this share of it (default the config's, 0.005)")
    ap.add_argument("--min-timed-ms", type=float, default=None,
                    help="precision: the timed loop's floor of the parent's clock, ms (default the config's, 100)")
    ap.add_argument("--warmup-ms", type=float, default=None,
                    help="each timed loop's warm-up on the parent's clock, ms (default the config's, 100)")
    ap.add_argument("--no-reuse", action="store_true", help="submits time again (EvaluatorConfig.reuse_profiles off)")
    ap.add_argument("--settle-s", type=float, default=3.0, help="idle seconds before each row (spares finish starting)")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="skip a row predicted to end past this many seconds from the start (default 450)")
    ap.add_argument("--spare-workers", type=int, default=None,
                    help="spare workers per device of the shared Evaluator (default: its own, 6 per GPU)")
    ap.add_argument("--spare-nice", type=int, default=None,
                    help="CPU niceness of spares until they take a job (default: the sandbox's, 10; 0: off)")
    ap.add_argument("--no-freeze", action="store_true",
                    help="do not pause starting spares during timed loops (the quiet windows)")
    ap.add_argument("--release-at-result", action="store_true",
                    help="a job's GPU lease ends when its result is in, not once its worker is gone")
    ap.add_argument("--exclusive-from", choices=("job", "loop"), default=None,
                    help="when a timing job holds the GPU alone (default: the sandbox's, job; loop: its calibration "
                         "and its timed loop, the candidate loading under a shared lease)")
    ap.add_argument("--calibration-max-age-s", type=float, default=None,
                    help="how long a GPU timer calibration is handed to later timing jobs (default: the sandbox's, "
                         "0: every job measures its own)")
    ap.add_argument("--no-fork-server", action="store_true", help="spawn each worker (no fork server)")
    ap.add_argument("--compile-baseline", action="store_true", help="measure torch.compile baselines in the warm-up")
    ap.add_argument("--cache-dir", type=Path, default=None, help="the evaluator's cache (default: a fresh temp dir)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the think times")
    ap.add_argument("--target", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--out", type=Path, help="write every raw number to this JSON file")
    args = ap.parse_args()
    if args.target == "cuda" and gpu_count() == 0:
        sys.exit("no NVIDIA GPU is visible (NVML found none): use --target cpu")
    try:
        for spec in args.spread_tasks:
            spread_task_of(spec)
    except Exception as e:  # noqa: BLE001
        ap.error(str(e))
    target = resolve_target(args.target)
    cuda = target == Target.CUDA
    if args.harness == "ray" and cuda and max(g for g, _ in args.pool_rows) > gpu_count():
        ap.error(f"--pool-rows asks for {max(g for g, _ in args.pool_rows)} GPUs; {gpu_count()} are visible")
    if args.spread_jobs is None:
        args.spread_jobs = 6 if cuda else 3
    console = Console(width=max(shutil.get_terminal_size().columns, 240))
    report: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
                              "cpu_count": os.cpu_count(), "target": target.value, "argv": sys.argv[1:],
                              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                              "rows": [], "spread": {"idle": [], "loaded": []}}
    t_start = time.perf_counter()

    def save() -> None:
        """Write what is measured so far (a run killed later keeps it)."""
        report["seconds"] = time.perf_counter() - t_start
        if args.out:
            args.out.write_text(json.dumps(report, indent=1, default=str))

    work = Path(tempfile.mkdtemp(prefix="cudagym-bench-throughput-"))
    try:
        asyncio.run(run(args, target, work, report, save))
    except KeyboardInterrupt:
        report["interrupted"] = True
        progress("interrupted: printing what was measured")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        verdicts = spread_verdicts(report["spread"]["idle"], report["spread"]["loaded"], cuda)
        report["spread_verdicts"] = verdicts
        report["goal"] = goal(report["rows"], verdicts, cuda)
        save()
    base = baseline_row(report["rows"], args.baseline)
    console.print(f"device: {report.get('device', '-')}; torch {torch.__version__}; harness {args.harness}; think "
                  f"{args.think_s:g} s (x[{1 - args.think_jitter:g}, {1 + args.think_jitter:g}]) per turn; timing "
                  f"stop {report.get('timing', {}).get('stop', '-')}; reuse {'off' if args.no_reuse else 'on'}; "
                  f"warm-up {report.get('warmup_s', 0):.0f} s; {report['seconds']:.0f} s in all"
                  + ("; INTERRUPTED" if report.get("interrupted") else ""))
    console.print(rows_table(report["rows"], report.get("device", "-")))
    console.print(ratios_table(report["rows"], base))
    console.print(lease_table(report["rows"]))
    console.print(timing_job_table(report["rows"]))
    console.print(parent_steps_table(report["rows"]))
    console.print(startup_table(report["rows"]))
    console.print(spread_table(verdicts))
    console.print(goal_table(report["goal"]))
    if not cuda:
        console.print("note: CPU target: no GPU busy fraction, and the rate, lease, scaling and spread criteria are "
                      "not judged")
    if args.out:
        progress(f"raw numbers: {args.out}")


if __name__ == "__main__":
    main()
