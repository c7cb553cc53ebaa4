"""Throughput on one GPU: K concurrent episodes of a recorded policy trace through one shared
`Evaluator`, against K = 1 and against a process-per-check harness, all in one run.

Protocol (one process; every row replays the same trace):
1. Trace: the scripted policy's turns (`ScriptedPolicy`: write the stored solution, compile,
   verify, profile, submit) for episodes 0..N-1 over the bundled tasks in manifest order (episode
   i plays task i mod 13), recorded once. Each turn is preceded by a think time (the policy's
   generation, simulated) drawn once, seeded, from `--think-s` x [1 - jitter, 1 + jitter], so
   that concurrent episodes do not move in lockstep. A row of n episodes replays episodes 0..n-1.
2. Warm-up (not timed): one Evaluator (its default config: strict mode, warm spare workers,
   6 per GPU) builds the stored solution and measures the baselines of every task the trace (or
   the spread) uses, so every row meets a warm build cache and baseline cache, as an RL run does
   after its first steps.
   The torch.compile baselines are off unless `--compile-baseline`: they are measured once per
   task and cached, so they would only lengthen the warm-up.
3. Spread, no load: `--spread-jobs` (6; 3 on the CPU target) profile jobs of `--spread-task`'s
   stored solution, one after another (each in a fresh worker, spares starting in between, as
   in real use).
4. Rows of the "spares" harness (the GPU idle `--settle-s` before each): n episodes
   (`--episodes`, default max(K, 3)), K at a time (a semaphore of K), each a `KernelEnv` on the
   shared Evaluator played by `run_episode` -- what `cudagym run --concurrency K` does
   (`cudagym.agent.runner.arun`), without its trajectory store and report. Per row:
   - episodes completed (submitted) in the row's wall seconds, and episodes per hour;
   - GPU busy: NVML utilization (the share of each sample period in which a kernel ran) of the
     first visible GPU, sampled every 100 ms by a thread, averaged over the row's wall time and,
     beside it, over its checks window (first evaluator call's start to last one's end: the
     think-only ramp at the start of a row left out); "-" on the CPU target;
   - latency, seconds, p50 and p95, of each evaluator call the env's tools make (`acompile`,
     `averify`, `aprofile`; `aevaluate` for submit), timed around the call by a wrapper of the
     Evaluator in this script; verify+profile is, per episode, its verify turn's call plus its
     profile turn's call (what an agent waits for to learn whether and how fast); beside them,
     the worker wait: per verify or profile call, its longest wait for a ready worker (the
     evaluator's breakdown), i.e. how much of the latency is the spares running out;
   - ratios against the spares K = 1 row (episodes per hour; p95 verify+profile).
   During the row of K = `--spread-k` (default 16), the spread jobs run again, one after another,
   beside the episodes, on the same Evaluator (they wait for the GPU lease and take spares like
   any check; that row's figures include their load; each job records whether episodes were
   still running when it ended).
5. Process-per-check rows (`--ppc-ks`, default 1; `--ppc-episodes` each): the same trace with an
   Evaluator of `spare_workers=0` on a local sandbox without its fork server: every check
   always gets a fresh worker; with no spares, none is started ahead, and with no fork server
   none is forked from a warm parent, so each check starts its own (python, import torch, CUDA
   context) when it arrives, as a harness that starts a process per check does. Same cache
   directory: builds and baselines stay warm. (The first Evaluator stays open meanwhile, its
   spares idle.)
   Run order: the smallest K row, the process-per-check rows, then the other rows ascending
   (the rows the comparisons need first). A row is skipped, and marked so, when the time so far
   plus its predicted duration would pass `--budget-s` (450 s), so that the default run ends
   within 8 minutes. The prediction, from the harness's last row: its waves of K episodes at
   that row's seconds per wave, or its episodes' verify, profile and submit seconds one after
   another (they queue for the GPU), whichever is longer. (Predicted at the K = 1 row's rate,
   K = 16 read 316 s on an H100 after a K = 1 row of 59 s for 3 episodes.)

`--spare-workers`, `--spare-nice` and `--no-freeze` set the local sandbox's spares (how many, their
CPU priority while they start, whether timed loops pause them), to find what the worker wait at
K = 16 comes from; `--no-fork-server` spawns each worker, `--release-at-result` ends a job's GPU
lease when its result is in. Per row, a table of the GPU leases: the share of the row a timing
job held the GPU alone, each timing job's hold and the part of it after its result, the waits.

Printed (stdout): the rows table; the workers' start-up per row (spawn to ready, and each step
on the worker's own clock: importing torch, the CUDA context, importing the harness, `prewarm`,
mapping the result memory), where the worker wait comes from; the spread table, and the goal of
issue 13: at K = 16, GPU busy >= 80% and p95 verify+profile < 10 s, and the spread of the loaded
jobs' candidate medians within the timing protocol's target (CV < 1% from 50 us of kernel, < 3%
below), each PASS or FAIL.
Progress goes to stderr; `--out` gets every raw number (each call's latency, each NVML sample,
each episode, each spread job), rewritten after every phase, so a run cut short keeps what it
measured. At most about 8 minutes on an H100 with the defaults (the budget above); the K = 32
row is the longest, and the first to be skipped (run it alone with `--ks 32 --ppc-ks ''`).

Usage: python benchmarks/bench_throughput.py [--ks 1,4,16,32] [--episodes N] [--think-s 2]
           [--ppc-ks 1] [--ppc-episodes 2] [--spread-task norm_layernorm] [--spread-jobs 6]
           [--budget-s 450] [--target auto|cuda|cpu] [--out FILE.json]
One GPU: on a host with several, make one visible (CUDA_VISIBLE_DEVICES), or the evaluator uses all.
CPU smoke run: python benchmarks/bench_throughput.py --target cpu --ks 1,2 --think-s 0.2 --episodes 2
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
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from cudagym.agent.episode import EpisodeResult, run_episode
from cudagym.agent.policy import AssistantTurn, Policy, TurnContext
from cudagym.agent.scripted import ScriptedPolicy
from cudagym.env.kernel_env import EnvConfig, KernelEnv
from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig, resolve_target
from cudagym.sandbox.gpu import _nvml, gpu_count
from cudagym.sandbox.config import LocalSandboxConfig
from cudagym.sandbox.local import LocalSandbox
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import bundled_task, bundled_tasks
from cudagym.tasks.model import Target, Task

GOAL_K, GOAL_BUSY, GOAL_P95_S = 16, 0.80, 10.0  # issue 13: >= 80% busy at K = 16, p95 verify+profile < 10 s
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
            self.calls.append({"kind": kind, "workspace": str(workspace.root), "start_s": start - self.t0,
                               "seconds": time.perf_counter() - start, "ok": ok,
                               "breakdown": getattr(result, "breakdown", None) or None})

    async def acompile(self, task: Task, workspace: Workspace) -> Any:
        return await self._timed("compile", workspace, self.inner.acompile(task, workspace))

    async def averify(self, task: Task, workspace: Workspace) -> Any:
        return await self._timed("verify", workspace, self.inner.averify(task, workspace))

    async def aprofile(self, task: Task, workspace: Workspace, ncu: bool = False) -> Any:
        return await self._timed("profile", workspace, self.inner.aprofile(task, workspace, ncu))

    async def aevaluate(self, task: Task, workspace: Workspace) -> Any:
        return await self._timed("submit", workspace, self.inner.aevaluate(task, workspace))

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
    """NVML utilization (%) of the first visible GPU every `period_s`, on a thread, as
    (seconds since `t0`, percent); no samples without NVML."""

    def __init__(self, t0: float, period_s: float = 0.1) -> None:
        self.t0 = t0
        self.period_s = period_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-nvml", daemon=True)

    def _run(self) -> None:
        def loop(nv: Any, idx: list[int]) -> None:
            if not idx:
                return
            handle = nv.nvmlDeviceGetHandleByIndex(idx[0])
            while not self._stop.is_set():
                self.samples.append((time.perf_counter() - self.t0, int(nv.nvmlDeviceGetUtilizationRates(handle).gpu)))
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
    sol = ScriptedPolicy().solution_dir(task.id, target.value)
    if sol is None:
        raise SystemExit(f"no stored {target.value} solution for {task.id}")
    return Workspace.from_solution(root / task.id, task.for_target(target), sol)


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


async def spread_jobs(ev: Evaluator, task: Task, ws: Workspace, jobs: int, t0: float,
                      loaded: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """`jobs` profile jobs of one solution, one after another: each job's candidate median (ms),
    its times, and whether the load (`loaded()`) ran through it; the CV of the medians."""
    task = task.for_target(ev.target)
    runs: list[dict[str, Any]] = []
    for j in range(jobs):
        start, under = time.perf_counter(), loaded()
        p = await ev.aprofile(task, ws)
        r = {"start_s": start - t0, "seconds": time.perf_counter() - start, "under_load": under and loaded(),
             "median_ms": p.candidate.median_ms if p.ok and p.candidate else None,
             "harness_overhead_ns": p.harness_overhead_ns, "error": None if p.ok else (p.error or "")[:500]}
        runs.append(r)
        progress(f"[spread] {task.id} job {j + 1}/{jobs}: "
                 + (f"{r['median_ms']:.4f} ms" if r["median_ms"] is not None else f"error {r['error'][:200]}")
                 + f" ({r['seconds']:.1f} s{', under load' if r['under_load'] else ''})")
    medians = [r["median_ms"] for r in runs if r["median_ms"] is not None]
    out: dict[str, Any] = {"task": task.id, "jobs": runs, "medians_ms": medians}
    if len(medians) >= 2:
        out["median_of_medians_ms"] = statistics.median(medians)
        out["cv"] = statistics.pstdev(medians) / statistics.fmean(medians)
    return out


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


async def measure_row(ev: Evaluator, plan: list[tuple[Task, str]], policy: TracePolicy, k: int, env_cfg: EnvConfig,
                      label: str, cuda: bool, spread: tuple[Task, Workspace, int] | None = None) -> dict[str, Any]:
    """One row: the episodes of `plan`, `k` at a time, with the NVML sampler running (GPU) and,
    if `spread` is given, its profile jobs beside them once the first check has started."""
    t0 = time.perf_counter()
    timed = TimedEvaluator(ev, t0)
    running = [True]
    progress(f"[{label}] {len(plan)} episodes, {k} at a time")

    async def beside() -> dict[str, Any] | None:
        if spread is None:
            return None
        await timed.first_check.wait()
        return await spread_jobs(ev, *spread, t0=t0, loaded=lambda: running[0])

    async def episodes() -> list[dict[str, Any]]:
        try:
            return await play_row(timed, plan, policy, k, env_cfg, label)
        finally:
            running[0] = False
            timed.first_check.set()  # no check ran: the spread jobs run anyway, marked not under load

    with GpuBusySampler(t0) if cuda else contextlib.nullcontext() as sampler:
        spread_task = asyncio.ensure_future(beside())
        eps = await episodes()
        wall = time.perf_counter() - t0
        loaded_spread = await spread_task
    lat = timed.latencies()
    window = timed.checks_window()
    completed = sum(e["status"] == "done" for e in eps)
    row = {"label": label, "k": k, "episodes": len(plan), "completed": completed,
           "correct": sum(bool(e["correct"]) for e in eps), "wall_s": wall,
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
    row["leases"] = lease_stats([h for h in getattr(ev.sandbox, "lease_holds", []) if t0 <= h.acquired_s <= t0 + wall],
                                wall)
    progress(f"[{label}] {completed}/{len(plan)} episodes in {wall:.1f} s; p95 verify+profile "
             f"{fmt_s(row['latency_s']['verify+profile']['p95'])} s; GPU busy {fmt_pct(row['gpu_busy'])}")
    return row


def lease_stats(holds: list[Any], wall_s: float) -> dict[str, Any]:
    """Where the GPU's time went in a row, from the scheduler's leases (`LeaseHold`): how much of
    the row a timing job held the GPU alone, and per timing job its hold, the part of it after
    its result was in (its worker going away), and its wait for the lease; the urgent
    (reference) and other checks' waits."""
    excl = [h for h in holds if h.exclusive and h.released_s is not None]
    refs = [h for h in holds if not h.exclusive and h.kind == "reference"]
    others = [h for h in holds if not h.exclusive and h.kind != "reference"]

    held = [h.released_s - h.acquired_s for h in excl]
    tail = [h.released_s - h.result_s for h in excl if h.result_s is not None]
    timing_waits = [h.acquired_s - h.asked_s for h in excl]
    return {"timing_jobs": len(excl), "exclusive_share": sum(held) / wall_s if wall_s > 0 else None,
            "hold_p50_s": percentile(held, 50), "after_result_p50_s": percentile(tail, 50),
            "timing_wait_p50_s": percentile(timing_waits, 50), "timing_wait_p95_s": percentile(timing_waits, 95),
            "reference_wait_p95_s": percentile([h.acquired_s - h.asked_s for h in refs], 95),
            "check_wait_p95_s": percentile([h.acquired_s - h.asked_s for h in others], 95)}


def lease_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="GPU leases per row: timing jobs hold the GPU alone; checks share it (seconds)")
    cols = ("timing_jobs", "exclusive_share", "hold_p50_s", "after_result_p50_s", "timing_wait_p50_s",
            "timing_wait_p95_s", "reference_wait_p95_s", "check_wait_p95_s")
    for c in ("harness", "K", *cols):
        t.add_column(c.replace("_", " "), overflow="fold")
    for r in rows:
        if r.get("skipped") or "leases" not in r:
            continue
        v = r["leases"]
        t.add_row(r["label"], str(r["k"]), *(fmt_pct(v[c]) if c == "exclusive_share" else
                                             str(v[c]) if c == "timing_jobs" else fmt_s(v[c]) for c in cols))
    return t


# -- tables ------------------------------------------------------------------------------------
def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def fmt_ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def rows_table(rows: list[dict[str, Any]], device: str) -> Table:
    t = Table(title=f"throughput on {device}: one shared Evaluator; latency p50 / p95 in seconds; "
                    "ratios against the warm-spares K = 1 row")
    for c in ("harness", "K", "episodes done", "wall s", "episodes/h", "ep/h vs K=1", "GPU busy",
              "busy, checks window", *(f"{k} p50 / p95" for k in (*KINDS, WAIT)), "v+p p95 vs K=1"):
        t.add_column(c, overflow="fold")
    ref = next((r for r in rows if r["label"] == "spares" and r["k"] == 1 and not r.get("skipped")), None)
    for r in rows:
        if r.get("skipped"):
            t.add_row(r["label"], str(r["k"]), f"skipped: {r['skipped']}", *["-"] * (7 + len(KINDS)))
            continue
        lat = r["latency_s"]
        t.add_row(r["label"], str(r["k"]), f"{r['completed']}/{r['episodes']}", f"{r['wall_s']:.1f}",
                  f"{r['episodes_per_hour']:.0f}", fmt_ratio(r["episodes_per_hour"], ref and ref["episodes_per_hour"]),
                  fmt_pct(r["gpu_busy"]), fmt_pct(r["gpu_busy_checks_window"]),
                  *(f"{fmt_s(lat[k]['p50'])} / {fmt_s(lat[k]['p95'])}" for k in (*KINDS, WAIT)),
                  fmt_ratio(lat["verify+profile"]["p95"], ref and ref["latency_s"]["verify+profile"]["p95"]))
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
    for c in ("harness", "K", "workers", *names):
        t.add_column(c, overflow="fold")
    for r, steps in per_row:
        if r.get("skipped"):
            continue
        t.add_row(r["label"], str(r["k"]), str(len(steps.get("wall", []))),
                  *(f"{fmt_s(percentile(steps[n], 50))} / {fmt_s(percentile(steps[n], 95))}" if steps.get(n) else "-"
                    for n in names))
    return t


def spread_table(idle: dict[str, Any] | None, loaded: dict[str, Any] | None, cuda: bool, k: int) -> Table:
    t = Table(title="timing spread: candidate medians of separate profile jobs of one stored solution")
    for c in ("condition", "task", "jobs ok", "under load", "median of medians ms", "min ms", "max ms", "CV",
              "target", "verdict", "median vs no load"):
        t.add_column(c, overflow="fold")
    base = idle.get("median_of_medians_ms") if idle else None
    for name, s in (("no load", idle), (f"beside K = {k}", loaded)):
        if s is None:
            t.add_row(name, *["-"] * 10)
            continue
        m = s["medians_ms"]
        under = sum(j["under_load"] for j in s["jobs"]) if name != "no load" else "-"
        cv = s.get("cv")
        target = spread_target_cv(base if base is not None else (statistics.median(m) if m else 1.0))
        verdict = "-" if cv is None else (("PASS" if cv < target else "FAIL") if cuda else "n/a (CPU)")
        t.add_row(name, s["task"], f"{len(m)}/{len(s['jobs'])}", str(under),
                  f"{s['median_of_medians_ms']:.4f}" if m and "median_of_medians_ms" in s else "-",
                  f"{min(m):.4f}" if m else "-", f"{max(m):.4f}" if m else "-", "-" if cv is None else f"{cv:.2%}",
                  f"< {target:.0%}", verdict,
                  fmt_ratio(s.get("median_of_medians_ms"), base) if name != "no load" else "-")
    return t


def goal(rows: list[dict[str, Any]], idle: dict[str, Any] | None, loaded: dict[str, Any] | None,
         cuda: bool, spread_k: int) -> list[dict[str, Any]]:
    """Issue 13's goal, criterion by criterion: measured value, target, PASS / FAIL ("-" if not
    measured; the busy fraction and the spread are judged on a GPU only)."""
    row = next((r for r in rows if r["label"] == "spares" and r["k"] == GOAL_K and not r.get("skipped")), None)
    busy = row["gpu_busy"] if row else None
    p95 = row["latency_s"]["verify+profile"]["p95"] if row else None
    cv = loaded.get("cv") if loaded else None
    base = (idle or {}).get("median_of_medians_ms") or (loaded or {}).get("median_of_medians_ms")
    target = spread_target_cv(base) if base else None
    idle_cv = idle.get("cv") if idle else None

    def verdict(ok: bool | None) -> str:
        return "-" if ok is None else ("PASS" if ok else "FAIL")

    return [
        {"criterion": f"GPU busy at K = {GOAL_K}", "measured": fmt_pct(busy), "target": f">= {GOAL_BUSY:.0%}",
         "verdict": verdict(None if busy is None or not cuda else busy >= GOAL_BUSY)},
        {"criterion": f"p95 verify+profile at K = {GOAL_K}", "measured": f"{fmt_s(p95)} s",
         "target": f"< {GOAL_P95_S:g} s", "verdict": verdict(None if p95 is None else p95 < GOAL_P95_S)},
        {"criterion": f"timing spread beside K = {spread_k} (no load: {fmt_pct2(idle_cv)})",
         "measured": fmt_pct2(cv), "target": "-" if target is None else f"CV < {target:.0%}",
         "verdict": verdict(None if cv is None or target is None or not cuda else cv < target)},
    ]


def fmt_pct2(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def goal_table(g: list[dict[str, Any]]) -> Table:
    t = Table(title="goal (issue 13)")
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


async def run(args: argparse.Namespace, target: Target, work: Path, report: dict[str, Any],
              save: Callable[[], None]) -> None:
    cuda = target == Target.CUDA
    t_start = time.perf_counter()
    tasks = bundled_tasks()
    n_of = {k: args.episodes or max(k, 3) for k in args.ks}
    n_max = max([*n_of.values(), *(max(args.ppc_episodes, k) for k in args.ppc_ks)])
    plan, policy, report["trace"] = await record_trace(tasks, n_max, target, args.think_s, args.think_jitter,
                                                      args.seed)
    spread_task = bundled_task(args.spread_task)
    used = {t.id for t, _ in plan} | {spread_task.id}
    cache = args.cache_dir or work / "cache"
    base_cfg = dict(target=target.value, mode="strict", cache_dir=cache, compile_baseline=args.compile_baseline)
    spread_k = max((k for k in args.ks if k <= args.spread_k), default=max(args.ks))
    report["spread_k"] = spread_k
    rows: list[dict[str, Any]] = report["rows"]

    def env_cfg(name: str) -> EnvConfig:
        return EnvConfig(target=target.value, mode="strict", max_turns=30, workspace_root=work / "episodes" / name)

    # per harness, from its last row: seconds per wave of K episodes, and device-bound seconds per
    # episode (its verify, profile and submit calls, which queue for the GPU)
    pace: dict[str, tuple[float, float]] = {}

    def predict(label: str, k: int, n: int) -> float:
        if label not in pace:
            return 0.0
        wave_s, device_s = pace[label]
        return max(math.ceil(n / k) * wave_s, n * device_s)

    async def row(ev: Evaluator, label: str, k: int, n: int) -> None:
        name = f"{label} K={k}"
        elapsed = time.perf_counter() - t_start
        predicted = predict(label, k, n)
        if elapsed + args.settle_s + predicted > args.budget_s:
            why = f"{elapsed:.0f} s so far + {predicted:.0f} s predicted > the {args.budget_s:g} s budget"
            progress(f"[{name}] skipped: {why}")
            rows.append({"label": label, "k": k, "episodes": n, "skipped": why})
            save()
            return
        await asyncio.sleep(args.settle_s)
        beside = label == "spares" and k == spread_k and args.spread_jobs
        spread = (spread_task, spread_ws, args.spread_jobs) if beside else None
        r = await measure_row(ev, plan[:n], policy, k, env_cfg(name.replace(" ", "_")), name, cuda, spread)
        r["label"] = label
        r["predicted_s"] = predicted or None
        if r["completed"]:
            lat = r["latencies_s"]
            pace[label] = (r["wall_s"] / math.ceil(r["completed"] / k),
                           sum(sum(lat.get(kind, [])) for kind in ("verify", "profile", "submit")) / r["completed"])
        rows.append(r)
        if "spread" in r:
            report["spread"]["loaded"] = r.pop("spread")
        save()

    spares = LocalSandboxConfig(spare_workers=args.spare_workers, freeze_starting_spares=not args.no_freeze,
                                release_gpu_at_result=args.release_at_result, fork_server=not args.no_fork_server,
                                **({} if args.spare_nice is None else {"spare_nice": args.spare_nice}))
    with Evaluator(EvaluatorConfig(**base_cfg, sandbox=spares),
                   sandbox=LocalSandbox(spares, home=Path(cache) / "home")) as ev:
        report["device"] = ev.device_name
        warm = [t for t in tasks if t.id in used]
        progress(f"[warm-up] {len(warm)} tasks on {ev.device_name}: build their stored solutions, measure baselines")
        t0 = time.perf_counter()
        report["warmup"] = await warm_up(ev, warm, work / "warmup")
        report["warmup_s"] = time.perf_counter() - t0
        save()
        spread_ws = solution_workspace(work / "spread", spread_task, target)
        if args.spread_jobs:
            await asyncio.sleep(args.settle_s)
            report["spread"]["idle"] = await spread_jobs(ev, spread_task, spread_ws, args.spread_jobs,
                                                         time.perf_counter())
            save()
        ks = sorted(set(args.ks))
        await row(ev, "spares", ks[0], n_of[ks[0]])
        if args.ppc_ks:
            per_check = LocalSandboxConfig(spare_workers=0, fork_server=False)  # python, torch, CUDA per check
            with Evaluator(EvaluatorConfig(**base_cfg, sandbox=per_check),
                           sandbox=LocalSandbox(per_check, home=Path(cache) / "home")) as ppc:
                for k in args.ppc_ks:
                    await row(ppc, "process per check", k, max(args.ppc_episodes, k))
        for k in ks[1:]:
            await row(ev, "spares", k, n_of[k])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=parse_ks, default=[1, 4, 16, 32],
                    help="concurrent episodes per row (default 1,4,16,32)")
    ap.add_argument("--episodes", "--episodes-per-k", type=int, default=None,
                    help="episodes per row (default max(K, 3); fewer than K leaves K - n slots unused)")
    ap.add_argument("--think-s", type=float, default=2.0, help="mean think time per turn, seconds (default 2)")
    ap.add_argument("--think-jitter", type=float, default=0.5,
                    help="think times drawn from think-s x [1 - j, 1 + j] (default 0.5)")
    ap.add_argument("--ppc-ks", type=lambda text: parse_ks(text) if text else [], default=[1],
                    help="process-per-check rows, K each (default 1; '' for none)")
    ap.add_argument("--ppc-episodes", type=int, default=2,
                    help="episodes per process-per-check row (default 2, at least K)")
    ap.add_argument("--spread-task", default="norm_layernorm",
                    help="bundled task whose stored solution the spread times (default norm_layernorm)")
    ap.add_argument("--spread-jobs", type=int, default=None,
                    help="profile jobs per spread measurement (default 6; 3 on the CPU target, where it is not "
                         "judged; 0: none)")
    ap.add_argument("--spread-k", type=int, default=GOAL_K,
                    help="the row the loaded spread runs beside (default 16; else the largest K below it)")
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
        bundled_task(args.spread_task)
    except Exception as e:  # noqa: BLE001
        ap.error(str(e))
    target = resolve_target(args.target)
    cuda = target == Target.CUDA
    if args.spread_jobs is None:
        args.spread_jobs = 6 if cuda else 3
    console = Console(width=max(shutil.get_terminal_size().columns, 240))
    report: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
                              "cpu_count": os.cpu_count(), "target": target.value, "argv": sys.argv[1:],
                              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                              "rows": [], "spread": {}}
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
        report["goal"] = goal(report["rows"], report["spread"].get("idle"), report["spread"].get("loaded"), cuda,
                              report.get("spread_k", args.spread_k))
        save()
    console.print(f"device: {report.get('device', '-')}; torch {torch.__version__}; think {args.think_s:g} s "
                  f"(x[{1 - args.think_jitter:g}, {1 + args.think_jitter:g}]) per turn; warm-up "
                  f"{report.get('warmup_s', 0):.0f} s; {report['seconds']:.0f} s in all"
                  + ("; INTERRUPTED" if report.get("interrupted") else ""))
    console.print(rows_table(report["rows"], report.get("device", "-")))
    console.print(startup_table(report["rows"]))
    console.print(lease_table(report["rows"]))
    console.print(spread_table(report["spread"].get("idle"), report["spread"].get("loaded"), cuda,
                               report.get("spread_k", args.spread_k)))
    console.print(goal_table(report["goal"]))
    if not cuda:
        console.print("note: CPU target: no GPU busy fraction, and the spread and busy criteria are not judged")
    if args.out:
        progress(f"raw numbers: {args.out}")


if __name__ == "__main__":
    main()
