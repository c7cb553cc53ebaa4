"""The Ray evaluation pool on a real local Ray instance, CPU target (no mocks).

One pool for the module (2 device actors, 1 compile actor): 16 concurrent episodes through it;
actors killed mid-job (retried once on the other actor; a job that kills both is a failed result
naming it); and `cudagym run --backend ray` killed with SIGKILL, then resumed, on the same cluster.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from rich.console import Console  # noqa: E402

from conftest import SOLUTIONS, cpu_config, solution_workspace, task_of  # noqa: E402
from cudagym.agent.runner import RunConfig, arun  # noqa: E402
from cudagym.agent.store import TrajectoryStore  # noqa: E402
from cudagym.env.kernel_env import KernelEnv  # noqa: E402
from cudagym.pool import EvalPool, PoolConfig  # noqa: E402
from cudagym.rewards.api import EvaluatorAPI  # noqa: E402
from cudagym.core.verdict import ErrorKind  # noqa: E402
from cudagym.rewards.evaluator import EvaluatorConfig  # noqa: E402
from cudagym.sandbox.workspace import Workspace  # noqa: E402
from test_runner import _cli, _episode_records, kill_midway  # noqa: E402

TASK = "ew_scale_bias_gelu"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # setup (Ray, 3 actors) counts too


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory):
    cache = tmp_path_factory.mktemp("pool-cache")
    # 8 logical CPUs: this pool's 3 actors, and the 3 of the `cudagym run` processes of the resume test
    p = EvalPool.start(PoolConfig(evaluator=cpu_config(cache, sandbox={"backend": "local", "spare_workers": 1}),
                                  device_actors=2, compile_actors=1),
                       ray_init={"num_cpus": 8})
    try:
        yield p
    finally:
        p.close()
    assert not ray.is_initialized()  # the pool started Ray, and stopped it


def _quiet() -> Console:
    return Console(file=open(os.devnull, "w"))


def _slow_workspace(root: Path) -> Workspace:
    """The task's CPU solution, with half a second of sleep in every forward (a verify job of
    ~12 forwards: long enough to be killed in the middle)."""
    ws = solution_workspace(root, task_of(TASK), SOLUTIONS / TASK / "cpu")
    src = ws.read("model_new.py").replace("import ctypes\n", "import ctypes\nimport time\n")
    ws.write("model_new.py", src.replace("        out = torch.empty_like(x)\n",
                                         "        time.sleep(0.5)\n        out = torch.empty_like(x)\n"))
    return ws


async def _wait_for(cond, timeout_s: float = 300.0):
    deadline = time.monotonic() + timeout_s
    while not (found := cond()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)
    return found


def _running(pool: EvalPool, kind: str = "device") -> list[dict]:
    return [a for a in pool.actors() if a["kind"] == kind and a["in_flight"] and a["live"]]


async def test_sixteen_concurrent_episodes_through_two_device_actors(pool, tmp_path):
    assert isinstance(pool, EvaluatorAPI)
    before = {a["name"]: a["done"] for a in pool.actors()}
    cfg = RunConfig(tasks=TASK, policy="test_runner_concurrency:write_then_submit", episodes=16, concurrency=16,
                    evaluator=EvaluatorConfig(target="cpu"), out=tmp_path / "run", backend="ray")
    summary = await arun(cfg, _quiet(), evaluator=pool)
    assert summary.ran == 16
    eps = TrajectoryStore(tmp_path / "run").summaries()
    assert len({e["episode_id"] for e in eps}) == 16
    assert all(e["status"] == "done" for e in eps), [e.get("error") for e in eps]
    assert all(e["verdict"]["correct"] for e in eps), [e["verdict"]["reasons"] for e in eps
                                                       if not e["verdict"]["correct"]]
    done = {a["name"]: a["done"] - before[a["name"]] for a in pool.actors()}
    # both device actors judged episodes; every compile went to the compile actor
    assert done["device-0"] >= 1 and done["device-1"] >= 1 and done["device-0"] + done["device-1"] == 16, done
    assert done["compile-0"] == 16, done
    assert pool.retries == 0 and not pool.lost


async def test_actor_killed_mid_job_is_retried_and_a_job_killing_two_is_named(pool, tmp_path):
    task = task_of(TASK)
    ws = _slow_workspace(tmp_path / "ws")
    # the env takes the pool where it takes an Evaluator
    env = KernelEnv(tasks=[task], evaluator=pool, target="cpu")
    try:
        await env.areset(options={"task": TASK})
        ctx_ws = env.workspace
        assert ctx_ws is not None
        for rel in ws.list():
            if rel != "model.py":
                ctx_ws.write(rel, ws.read(rel))
        step = asyncio.ensure_future(env.astep({"name": "verify", "arguments": {}}))
        victim = (await _wait_for(lambda: _running(pool)))[0]
        await asyncio.sleep(2.0)  # in the middle of the verify job
        ray.kill(victim["handle"], no_restart=False)  # Ray restarts it; the job goes to the other one
        obs, _, _, _, info = await step
        assert info["calls"][0]["ok"], obs
        assert pool.retries == 1 and not pool.lost
        assert "correct on 6/6 trials" in obs
    finally:
        env.close()

    # a job that kills both actors: a failed result naming the job and the actors, not retried again
    job = asyncio.ensure_future(pool.averify(task, ws))
    first = (await _wait_for(lambda: _running(pool)))[0]
    await asyncio.sleep(2.0)
    ray.kill(first["handle"], no_restart=False)
    await _wait_for(lambda: pool.retries == 2)
    second = (await _wait_for(lambda: [a for a in _running(pool) if a["name"] != first["name"]]))[0]
    await asyncio.sleep(2.0)
    ray.kill(second["handle"], no_restart=False)
    v = await job
    assert not v.ok and v.error_kind == ErrorKind.CRASH
    assert f"the verify job of task {TASK} killed two evaluation actors" in v.error
    assert first["name"] in v.error and second["name"] in v.error
    assert pool.lost == [v.error]

    # both come back (Ray restarts them) and serve again; a pickled copy (a rollout worker's) too
    copy = pickle.loads(pickle.dumps(pool))
    v = await copy.averify(task, ws)
    assert v.ok, v.error
    await _wait_for(lambda: all(a["live"] for a in pool.actors()), timeout_s=600)
    copy.close()  # a copy stops nothing
    assert all(not a["gone"] for a in pool.actors())


def test_run_with_ray_backend_resumes_after_sigkill(pool, tmp_path):
    """`cudagym run --backend ray` on this cluster, SIGKILLed mid-run, then run again: every
    episode exactly once, every step once and in order."""
    out = tmp_path / "run"
    address = ray.get_runtime_context().gcs_address
    cpus_free = ray.available_resources().get("CPU", 0)
    args = ["run", "--tasks", TASK, "--policy", "test_runner:slow_policy", "--episodes", "6", "--concurrency", "2",
            "--target", "cpu", "--out", str(out), "--backend", "ray", "--ray-address", address]
    episodes = out / "episodes"
    completed_before = kill_midway(_cli(*args), out)
    assert 2 <= len(completed_before) < 6 and list(episodes.glob("*.partial"))

    proc = _cli(*args)
    output, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, output
    assert "backend ray" in output and f"skipped {len(completed_before)} already complete" in output
    counts, turns = _episode_records(out)
    assert counts == {f"{TASK}@{k}": 1 for k in range(6)}
    assert all(ts == [0, 1, 2, 3] for ts in turns.values()), turns
    assert not list(episodes.glob("*.partial"))
    assert all(s["verdict"]["milestone"] == "failed" for s in TrajectoryStore(out).summaries())
    # the killed run's actors died with it (Ray ends the actors of a driver that is gone), and the
    # second run stopped its own: the cluster's CPUs are all free again but this module's pool's
    deadline = time.monotonic() + 120
    while ray.available_resources().get("CPU", 0) != cpus_free and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) == cpus_free


def test_worker_gets_the_gpu_this_process_sees(monkeypatch):
    """A Ray actor given GPU 3 sees it as cuda:0; its workers must get GPU 3, not GPU 0."""
    from cudagym.sandbox.local import _visible_entry

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert (_visible_entry("0"), _visible_entry("1")) == ("3", "5")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _visible_entry("1") == "1"


def test_snapshot_carries_the_candidates_files_only(tmp_path):
    """What an actor gets of a workspace: model_new.py and kernels/ (not the reference, not the
    build scratch), rebuilt in a directory of its own; a path that leaves it is refused."""
    from cudagym.errors import WorkspaceError
    from cudagym.pool import WorkspaceSnapshot

    task = task_of(TASK)
    ws = solution_workspace(tmp_path / "ws", task, SOLUTIONS / TASK / "cpu")
    (ws.build_dir / "junk.o").write_bytes(b"x")
    snap = WorkspaceSnapshot.of(ws)
    assert set(snap.files) == {"model_new.py", "kernels/scale_bias_gelu.cpp"}
    with snap.materialized(tmp_path / "actor", task) as copy:
        assert copy.root != ws.root and copy.list() == ws.list()
        assert copy.read("model.py") == task.code and copy.read("model_new.py") == ws.read("model_new.py")
    assert not any((tmp_path / "actor").iterdir())  # removed after the call
    with pytest.raises(WorkspaceError), WorkspaceSnapshot({"../outside.py": b"x"}).materialized(tmp_path / "a2", task):
        pass
    assert not (tmp_path / "outside.py").exists()
