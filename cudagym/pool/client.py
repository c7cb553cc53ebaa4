"""`EvalPool`: the client of an evaluation service on a Ray cluster.

Why this shape
--------------
- **One device actor per GPU** owns that GPU's `Evaluator`: its spare workers, its GPU lease and
  its node's caches. A GPU is therefore never timing two things at once (the actor's lease gives
  timing jobs the device alone, and Ray gives the GPU to that actor only), and the caches live
  where the work runs. **Compile actors** hold CPU resources only: compiles of one episode run
  beside verify and profile jobs of others instead of queueing behind them.
- **The client is the scheduler's only half that exists**: it sends each job to the actor of the
  right kind with the fewest jobs in flight from this client, and Ray does the rest (placement,
  transport, restarts). There is no dispatcher actor to become a bottleneck or a single point of
  failure. Many clients (a trainer's rollout workers: the client pickles into Ray tasks and
  actors) each balance their own jobs; the device actors' leases keep timings apart whatever
  the clients do.
- **Workspaces travel as snapshots** (`WorkspaceSnapshot`): an actor may be on another node.
- **Failure**: an actor that dies mid-job (killed, out of memory, node lost) raises
  `RayActorError` here; the job runs again, once, on another actor of its kind (a compile may
  also go to a device actor, which can compile too), and the caller sees only the result. A job
  that kills two actors is not retried again: it comes back as a failed result (`crash`) whose
  error names the job and both actors. A call that a restarting actor refused (this client had
  not seen it fail: another client's job killed it) never ran and counts for nothing. An actor
  that failed is out of rotation until a ping answers (Ray restarts actors, ``max_restarts=-1``);
  one that is gone for good stays out. Episodes, and their trajectory store, are never touched
  by any of this: the runner writes trajectories in its own process.
- **Not here**: compile actors on a GPU node take host CPU that a device actor's timed loop may
  want (the local sandbox pauses its own starting spares during timing jobs, not other actors);
  where timings matter, give compile actors CPU-only nodes and the cache a shared file system
  (a device actor rebuilds what it does not find in its node's cache: correct, but slower).

`EvalPool` has the methods of `Evaluator` (see `cudagym.rewards.api.EvaluatorAPI`), so the
env and the runner take it where they take an `Evaluator`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from pydantic import BaseModel, Field
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

import cudagym
from cudagym.errors import CudagymError
from cudagym.pool.actors import EvaluatorActor
from cudagym.pool.snapshot import WorkspaceSnapshot
from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.rewards.milestone import milestone_verdict
from cudagym.rewards.reuse import ProfileMemo
from cudagym.core.verdict import CompileResult, ErrorKind, ProfileResult, Verdict, VerifyResult
from cudagym.sandbox.bridge import run_sync
from cudagym.sandbox.gpu import gpu_count
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.model import Target, Task


class PoolError(CudagymError):
    """The pool cannot serve a job at all (no live actor of the kind it needs)."""


class PoolConfig(BaseModel):
    """The evaluation pool: its actors and the evaluator each of them owns."""

    evaluator: EvaluatorConfig = Field(default_factory=EvaluatorConfig)
    device_actors: int | None = Field(default=None, ge=1)  # None: one per GPU of the cluster (CPU target: 2)
    # Compilers run as subprocesses of the actor, several at once: one actor keeps a node's cores
    # busy; more spread compiles over more nodes.
    compile_actors: int = Field(default=1, ge=0)
    # Ray CPUs per actor (a device actor also holds its GPU); on the CPU target the "device"
    # actors hold only CPUs, and share the node's cores
    cpus_per_device_actor: float = Field(default=1.0, gt=0)
    cpus_per_compile_actor: float = Field(default=1.0, gt=0)
    # Ray custom resources each device actor also asks for, e.g. {"cudagym_eval": 1}: a resource
    # only the evaluation GPUs' nodes offer keeps device actors off the trainer's GPUs
    device_resources: dict[str, float] = Field(default_factory=dict)
    max_jobs_per_actor: int = Field(default=256, ge=1)  # the actor's max_concurrency
    start_timeout_s: float = 600.0  # every actor must answer its first ping within this
    readmit_timeout_s: float = 600.0  # how long a failed actor may take to come back


@dataclass
class _Member:
    handle: Any
    name: str  # "device-0", "compile-1"
    kind: str  # "device" | "compile"
    in_flight: int = 0
    done: int = 0  # calls that came back (from this client)
    live: bool = True
    gone: bool = False  # dead for good
    checking: bool = False


@dataclass
class _Lost:
    """A job that two actors died running."""

    what: str
    actors: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def message(self) -> str:
        why = "; ".join(e.splitlines()[0] for e in self.errors if e)
        if len(self.actors) < 2:
            return f"{self.what} could not be run: the evaluation actors kept restarting ({why or 'no live actor'})"
        return f"{self.what} killed two evaluation actors ({', '.join(self.actors)}); it was not retried again: {why}"


def _resolve_target(target: str) -> Target:
    """`auto` by the cluster's resources: CUDA where it has GPUs."""
    if target != "auto":
        return Target(target)
    return Target.CUDA if ray.cluster_resources().get("GPU", 0) >= 1 else Target.CPU


class EvalPool:
    """compile / verify / profile / evaluate on a Ray cluster; async forms `a*` (see module doc)."""

    def __init__(self, config: PoolConfig, members: list[_Member], target: Target, *, owns_actors: bool,
                 owns_ray: bool) -> None:
        self.config = config
        self._members = members
        self._target = target
        self._owns_actors = owns_actors
        self._owns_ray = owns_ray
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self.retries = 0  # jobs that ran again after an actor died under them
        self.lost: list[str] = []  # jobs that killed two actors

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def start(cls, config: PoolConfig | None = None, *, address: str | None = None,
              ray_init: dict[str, Any] | None = None, name: str | None = None,
              namespace: str | None = None) -> EvalPool:
        """Start the pool's actors on the cluster at `address` (``ray start --head`` gives it;
        ``auto`` finds the local one), or on a new local Ray instance when `address` is None and
        Ray is not initialized in this process; `ray_init` adds arguments of ``ray.init``.
        With `name`, the actors are named ``NAME:device-0``, ... in Ray `namespace`, so that
        other processes of the cluster reach this one pool with `connect` (they live as long
        as the process that started them, or until `close`)."""
        config = config or PoolConfig()
        owns_ray = False
        if not ray.is_initialized():
            kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, **(ray_init or {})}
            if address is None:
                # A local instance: its workers import this very cudagym, wherever it is installed.
                root = str(Path(cudagym.__file__).resolve().parent.parent)
                path = os.pathsep.join([root, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])
                kw.setdefault("runtime_env", {"env_vars": {"PYTHONPATH": path}})
                # Actors mostly wait on their workers: the instance has CPU slots for all of them
                # even on a 2-core machine (Ray's CPUs are logical: placement, not a cap).
                wanted = ((config.device_actors or max(gpu_count(), 2)) * config.cpus_per_device_actor
                          + config.compile_actors * config.cpus_per_compile_actor)
                kw.setdefault("num_cpus", max(os.cpu_count() or 1, math.ceil(wanted)))
                address = "local"
            ray.init(address=address, **kw)
            owns_ray = True
        members: list[_Member] = []
        try:
            target = _resolve_target(config.evaluator.target)
            ev = config.evaluator.model_copy(update={"target": target.value})
            n_dev = config.device_actors or (int(ray.cluster_resources().get("GPU", 0)) if target == Target.CUDA else 2)
            if n_dev < 1:
                raise PoolError("the CUDA target needs GPUs in the Ray cluster; it has none")
            remote = ray.remote(EvaluatorActor)
            gpu: dict[str, Any] = {"num_gpus": 1 if target == Target.CUDA else 0,
                                   "num_cpus": config.cpus_per_device_actor}
            if config.device_resources:
                gpu["resources"] = dict(config.device_resources)
            opts = {"max_restarts": -1, "max_concurrency": config.max_jobs_per_actor}

            def named(member: str) -> dict[str, Any]:
                return {"name": f"{name}:{member}", "namespace": namespace} if name else {}

            members += [_Member(remote.options(**gpu, **opts, **named(f"device-{i}")).remote(ev), f"device-{i}",
                                "device")
                        for i in range(n_dev)]
            infos = ray.get([m.handle.info.remote() for m in members], timeout=config.start_timeout_s)
            if target == Target.CUDA:  # compile actors see no GPU: give them the devices' architecture
                ev = ev.model_copy(update={"toolchain": ev.toolchain.model_copy(
                    update={"cuda_arch": ev.toolchain.cuda_arch or infos[0]["cuda_arch"]})})
            members += [_Member(remote.options(num_cpus=config.cpus_per_compile_actor, num_gpus=0, **opts,
                                               **named(f"compile-{i}")).remote(ev),
                                f"compile-{i}", "compile") for i in range(config.compile_actors)]
            ray.get([m.handle.info.remote() for m in members[n_dev:]], timeout=config.start_timeout_s)
        except BaseException:
            for m in members:
                ray.kill(m.handle)
            if owns_ray:
                ray.shutdown()
            raise
        return cls(config, members, target, owns_actors=True, owns_ray=owns_ray)

    @classmethod
    def connect(cls, name: str, config: PoolConfig | None = None, *, namespace: str | None = None,
                address: str | None = "auto") -> EvalPool:
        """A client of the pool that another process started with ``start(name=NAME)``: its
        named actors, found in Ray `namespace`; this client starts and stops nothing. Connects
        to the cluster at `address` first where Ray is not initialized in this process (a Ray
        actor, e.g. a trainer's rollout worker, already is). `config` gives the client's own
        settings (reward, timeouts); raises `PoolError` when no actor of that name exists."""
        config = config or PoolConfig()
        if not ray.is_initialized():
            ray.init(address=address, namespace=namespace, include_dashboard=False, log_to_driver=False)
        prefix = f"{name}:"
        found = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["name"].startswith(prefix) and (namespace is None or a.get("namespace") == namespace))
        members = [_Member(ray.get_actor(n, namespace=namespace), n[len(prefix):], n[len(prefix):].split("-")[0])
                   for n in found]
        devices = [m for m in members if m.kind == "device"]
        if not devices:
            raise PoolError(f"no evaluation pool named {name!r} in Ray namespace {namespace!r}: it is started once "
                            "per run (`cudagym train` starts it before verl's workers), not by its clients")
        target = Target(ray.get(devices[0].handle.info.remote(), timeout=config.start_timeout_s)["target"])
        return cls(config, members, target, owns_actors=False, owns_ray=False)

    def __getstate__(self) -> dict[str, Any]:
        """A copy for another process (a rollout worker): the same actors, its own bookkeeping;
        it never stops them."""
        return {"config": self.config, "target": self._target,
                "members": [(m.handle, m.name, m.kind) for m in self._members if not m.gone]}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"], [_Member(h, n, k) for h, n, k in state["members"]],  # type: ignore[misc]
                      state["target"], owns_actors=False, owns_ray=False)

    # -- properties -------------------------------------------------------------------------------
    @property
    def target(self) -> Target:
        return self._target

    def actors(self) -> list[dict[str, Any]]:
        """Each actor's name, kind, calls in flight and done (from this client), whether it is in
        rotation (`live`) or dead for good (`gone`), and its Ray handle."""
        return [{"name": m.name, "kind": m.kind, "in_flight": m.in_flight, "done": m.done, "live": m.live,
                 "gone": m.gone, "handle": m.handle} for m in self._members]

    # -- dispatch -------------------------------------------------------------------------------
    async def _pick(self, kinds: tuple[str, ...], exclude: set[str]) -> _Member:
        """The live actor of `kinds` (in order of preference) with the fewest jobs in flight,
        not in `exclude` unless nothing else is left; waits while failed actors come back."""
        deadline = time.monotonic() + self.config.readmit_timeout_s
        while True:
            with self._lock:
                for kind in kinds:
                    live = [m for m in self._members if m.kind == kind and m.live]
                    fresh = [m for m in live if m.name not in exclude]
                    if fresh:
                        turn = next(self._rr)
                        n = len(self._members)
                        best = min(fresh, key=lambda m: (m.in_flight, (self._members.index(m) - turn) % n))
                        best.in_flight += 1
                        return best
                waiting = any(m.kind in kinds and m.checking for m in self._members)
                fallback = [m for m in self._members if m.kind in kinds and m.live]
            if not waiting or time.monotonic() > deadline:
                if fallback:  # no other actor: the one that failed, restarted
                    best = fallback[0]
                    with self._lock:
                        best.in_flight += 1
                    return best
                raise PoolError(f"no live evaluation actor of kind {'/'.join(kinds)}")
            await asyncio.sleep(0.1)

    def _suspect(self, m: _Member) -> None:
        """Take `m` out of rotation; a thread pings it back in (Ray restarts it) or marks it gone."""
        with self._lock:
            if m.checking or m.gone:
                return
            m.live, m.checking = False, True

        def check() -> None:
            # Ray answers `ActorDiedError` for an actor that will not come back (killed for good,
            # restarts used up), `ActorUnavailableError` while it restarts.
            deadline = time.monotonic() + self.config.readmit_timeout_s
            try:
                while time.monotonic() < deadline:
                    try:
                        ray.get(m.handle.info.remote(), timeout=max(1.0, deadline - time.monotonic()))
                        m.live = True
                        return
                    except ActorDiedError:
                        break
                    except (RayActorError, GetTimeoutError):
                        time.sleep(1.0)
                m.gone = True
            finally:
                m.checking = False

        threading.Thread(target=check, name=f"cudagym-pool-check-{m.name}", daemon=True).start()

    async def _call(self, kinds: tuple[str, ...], method: str, what: str, *args: Any) -> Any:
        """`method(*args)` on an actor of `kinds`; once more on another if that actor dies under
        it; a `_Lost` if the second one dies too. A call refused by an actor that is restarting
        (this client did not know) ran nowhere: it goes to another actor and counts for nothing."""
        lost = _Lost(what)
        refused: set[str] = set()
        for _ in range(2 + 2 * len(self._members)):  # at most two deaths, a few refusals
            m = await self._pick(kinds, set(lost.actors) | refused)
            try:
                result = await getattr(m.handle, method).remote(*args)
                m.done += 1
                return result
            except RayActorError as e:
                self._suspect(m)
                if _refused_while_restarting(e):
                    refused.add(m.name)
                    continue
                lost.actors.append(m.name)
                lost.errors.append(str(e))
                if len(lost.actors) == 2:
                    break
                self.retries += 1
            finally:
                m.in_flight -= 1
        self.lost.append(lost.message)
        return lost

    @staticmethod
    def _what(tool: str, task: Task) -> str:
        return f"the {tool} job of task {task.id}"

    def _compile_kinds(self, snapshot: WorkspaceSnapshot) -> tuple[str, ...]:
        src = snapshot.files.get("model_new.py", b"").decode(errors="replace")
        # As `Evaluator.acompile` decides: such a solution is run to learn what to build, and on
        # the CUDA target that run needs the GPU.
        if self._target == Target.CUDA and ("cpp_extension" in src or "load_inline" in src):
            return ("device",)
        return ("compile", "device")

    # -- the evaluator's methods ---------------------------------------------------------------
    async def acompile(self, task: Task, workspace: Workspace) -> CompileResult:
        snap = WorkspaceSnapshot.of(workspace)
        r = await self._call(self._compile_kinds(snap), "compile", self._what("compile", task), task, snap)
        return CompileResult(ok=False, errors=[r.message]) if isinstance(r, _Lost) else r

    async def averify(self, task: Task, workspace: Workspace) -> VerifyResult:
        r = await self._call(("device",), "verify", self._what("verify", task), task, WorkspaceSnapshot.of(workspace))
        return _lost_verify(r) if isinstance(r, _Lost) else r

    async def aprofile(self, task: Task, workspace: Workspace, ncu: bool = False) -> ProfileResult:
        r = await self._call(("device",), "profile", self._what("profile", task), task,
                             WorkspaceSnapshot.of(workspace), ncu)
        if isinstance(r, _Lost):
            return ProfileResult(ok=False, error_kind=ErrorKind.CRASH, error=r.message, reasons=[r.message])
        return r

    async def aevaluate(self, task: Task, workspace: Workspace, profiled: ProfileMemo | None = None) -> Verdict:
        """compile (a compile actor) → verify + profile, or the episode's profile of the same
        evidence (`profiled`; one device actor) → milestone reward."""
        c = await self.acompile(task, workspace)
        if not c.ok:
            return milestone_verdict(c, None, None, self.config.evaluator.reward)
        r = await self._call(("device",), "judge", self._what("submit", task), task, WorkspaceSnapshot.of(workspace),
                             profiled)
        v, p = (_lost_verify(r), None) if isinstance(r, _Lost) else r
        return milestone_verdict(c, v, p, self.config.evaluator.reward)

    # -- sync forms: the evaluator's own, which run the async forms above --------------------
    def _sync(self, coro: Any) -> Any:
        return run_sync(coro, async_form="the async form (await pool.a...)")

    compile = Evaluator.compile
    verify = Evaluator.verify
    profile = Evaluator.profile
    evaluate = Evaluator.evaluate

    def close(self) -> None:
        """Stop the actors this client started (and the Ray instance it started); a copy in
        another process stops nothing."""
        if self._owns_actors:
            for m in self._members:
                with contextlib.suppress(Exception):  # already gone
                    ray.kill(m.handle)
            self._owns_actors = False
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> EvalPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refused_while_restarting(e: RayActorError) -> bool:
    """Whether Ray refused the call because the actor was restarting when it arrived (so it never
    ran), as opposed to the actor dying or restarting under it. Ray raises
    `ActorUnavailableError` for both and tells them apart only in its message ("The actor is
    restarting" / "The actor was restarted"; Ray 2.60)."""
    return isinstance(e, ActorUnavailableError) and "actor is restarting" in str(e)


def _lost_verify(lost: _Lost) -> VerifyResult:
    return VerifyResult(ok=False, error_kind=ErrorKind.CRASH, error=lost.message, reasons=[lost.message])
