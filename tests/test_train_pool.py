"""The run's one evaluation pool on a real local Ray instance (CPU target, no mocks).

`cudagym.train.runner.shared_pool` (what cudagym's task runner wraps verl's training in) starts
the named pool on the resource only evaluation GPUs offer; rollout workers (here: Ray actors, as
verl's agent-loop workers are) connect to it by name through the loop's own `evaluator_for`,
evaluate through it, and start nothing; when the run ends it is gone, and a worker that looks
for it then is told so.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

from omegaconf import OmegaConf  # noqa: E402

from conftest import SOLUTIONS  # noqa: E402
from cudagym.pool import EvalPool, PoolError  # noqa: E402
from cudagym.train.settings import EvaluatorSpec, PoolSpec  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
TASK = "ew_scale_bias_gelu"
SPEC = EvaluatorSpec(backend="ray", target="cpu", compile_baseline=False,
                     pool=PoolSpec(name="test-eval", namespace="cudagym-test", gpus=1, gpu_resource="cudagym_eval",
                                   compile_actors=0))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """A local Ray instance whose node offers one unit of the evaluation resource."""
    mp = pytest.MonkeyPatch()
    mp.setenv("CUDAGYM_CACHE", str(tmp_path_factory.mktemp("cache")))  # the actors inherit it
    ray.init(num_cpus=4, resources={"cudagym_eval": 1}, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        mp.undo()


@ray.remote(num_cpus=0)
class RolloutWorker:
    """What a verl agent-loop worker process does with the loop's evaluator settings."""

    def evaluate(self, spec_json: str, solution: str, root: str) -> dict:
        from cudagym.sandbox.workspace import Workspace
        from cudagym.tasks.loaders import bundled_task
        from cudagym.train.settings import EvaluatorSpec
        from cudagym.train.verl_loop import evaluator_for

        ev = evaluator_for(EvaluatorSpec.model_validate_json(spec_json))
        task = bundled_task(TASK)
        ws = Workspace.from_solution(Path(root), task, solution)
        compiled = ev.compile(task, ws)
        verified = ev.verify(task, ws) if compiled.ok else None
        return {"actors": sorted(a["name"] for a in ev.actors()), "owns": ev._owns_actors,
                "ok": bool(verified and verified.ok), "errors": compiled.errors or (verified and verified.error)}


def _named(prefix: str = "test-eval:") -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def test_one_named_pool_for_the_run_every_worker_connects(cluster, tmp_path: Path) -> None:
    from cudagym.train.runner import shared_pool

    cfg = OmegaConf.create({"cudagym": {"evaluator": SPEC.model_dump()},
                            "trainer": {"n_gpus_per_node": 0, "nnodes": 1}})
    with shared_pool(cfg) as pool:
        assert pool is not None and _named() == ["test-eval:device-0"]
        assert ray.available_resources().get("cudagym_eval", 0) == 0  # the device actor holds the evaluation unit
        workers = [RolloutWorker.remote() for _ in range(2)]
        results = ray.get([w.evaluate.remote(SPEC.model_dump_json(), str(SOLUTIONS / TASK / "cpu"),
                                             str(tmp_path / f"w{i}")) for i, w in enumerate(workers)], timeout=900)
        for r in results:
            assert r["actors"] == ["device-0"] and r["owns"] is False
            assert r["ok"], r["errors"]
        assert _named() == ["test-eval:device-0"]  # no worker started a pool of its own
        for w in workers:
            ray.kill(w)
    deadline = time.monotonic() + 60
    while _named() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _named() == []
    with pytest.raises(PoolError, match="no evaluation pool named 'test-eval'"):
        EvalPool.connect("test-eval", SPEC.pool_config(), namespace="cudagym-test")
