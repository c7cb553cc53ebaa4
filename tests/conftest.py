"""Shared fixtures: one CPU evaluator per session, and workspaces built from inline strings."""

from __future__ import annotations

import os
from collections.abc import Iterator
import textwrap
from pathlib import Path
from typing import Any

import pytest

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.sandbox.protocol import TimingConfig
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import bundled_task
from cudagym.tasks.model import Task

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS = REPO / "examples" / "solutions"

# Small timing protocol: enough calls for re-checks of timed outputs, short enough for tests.
SMALL_TIMING = TimingConfig(min_calls=10, max_calls=20, target_ms=100, warmup_calls=2)


def cpu_config(cache_dir: Path, **overrides: object) -> EvaluatorConfig:
    """The tests' CPU evaluator config; `overrides` replace top-level fields (mode, limits, ...).

    No torch.compile baseline: on a 2-core CPU it costs 50-90 s per task, and the +3 milestone is
    not what these tests are about (every hack must get < 0, every honest solution >= 1).
    """
    overrides.setdefault("compile_baseline", False)
    return EvaluatorConfig(target="cpu", cache_dir=cache_dir, timing=SMALL_TIMING, **overrides)


# Sandbox backends a test module can run its evaluators on (`backend_config`): docker tests need a
# daemon; they skip without one, except in CI (CI=true), where a missing daemon is a failure.
BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A module's sandbox fixtures (its `BACKEND_FIXTURES`, fixtures that build their evaluator with
    `backend_config(request.param, ...)`) run on the local backend, and on docker too for tests
    marked `both_backends`: a representative set, since every docker job starts a container (CI
    runs the suite on two cores). A test that parametrizes the fixture itself is left as it is."""
    own = {n for m in metafunc.definition.iter_markers("parametrize")
           for n in ([a.strip() for a in m.args[0].split(",")] if isinstance(m.args[0], str) else m.args[0])}
    both = metafunc.definition.get_closest_marker("both_backends") is not None
    for name in getattr(metafunc.module, "BACKEND_FIXTURES", ()):
        if name in metafunc.fixturenames and name not in own:
            metafunc.parametrize(name, BACKENDS if both else ["local"], indirect=True)


def require_docker() -> None:
    """Fail (CI) or skip (elsewhere) without a docker daemon; build the offline image if absent."""
    from cudagym.errors import SandboxError
    from cudagym.sandbox.docker import docker_client
    from cudagym.sandbox.image import DEFAULT_TAG, build_image

    try:
        client = docker_client()
    except SandboxError as e:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must run the docker tests: {e}")
        pytest.skip(str(e))
    if not client.images.list(name=DEFAULT_TAG):
        build_image("host", DEFAULT_TAG, client)


def backend_config(backend: str, cache_dir: Path, **overrides: object) -> EvaluatorConfig:
    """`cpu_config` on the sandbox backend `backend` ("local" or "docker")."""
    if backend == "docker":
        require_docker()
        overrides["sandbox"] = "docker"
    return cpu_config(cache_dir, **overrides)


@pytest.fixture(scope="session")
def eval_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache dir (builds, baselines) shared by every evaluator of the session."""
    return tmp_path_factory.mktemp("cudagym-cache")


@pytest.fixture(scope="session")
def evaluator(eval_cache: Path):
    ev = Evaluator(cpu_config(eval_cache))
    try:
        yield ev
    finally:
        ev.close()


def task_of(task_id: str) -> Task:
    return bundled_task(task_id)


def make_workspace(root: Path, task: Task, model_new: str, kernels: dict[str, str] | None = None) -> Workspace:
    """A workspace for `task` holding `model_new` (dedented) and `kernels` ({"kernels/x.cpp": text})."""
    ws = Workspace.create(root, task)
    ws.write("model_new.py", textwrap.dedent(model_new))
    for rel, text in (kernels or {}).items():
        rel = rel if rel.startswith("kernels/") else f"kernels/{rel}"
        ws.write(rel, textwrap.dedent(text))
    return ws


def solution_workspace(root: Path, task: Task, solution: str | Path) -> Workspace:
    return Workspace.from_solution(root, task, solution)


@pytest.fixture
def build_ws(tmp_path: Path):
    """`build_ws(task, model_new, kernels)` → a fresh workspace under this test's tmp dir."""
    counter = iter(range(1_000_000))

    def _build(task: Task, model_new: str, kernels: dict[str, str] | None = None) -> Workspace:
        return make_workspace(tmp_path / f"ws{next(counter)}", task, model_new, kernels)

    return _build


def pytest_configure(config: pytest.Config) -> None:
    # The hypothesis plugin imports hypothesis lazily in its terminal summary; by then this
    # process has run ast.parse from several threads (task resizing in the evaluator's loops),
    # which on CPython 3.11.7 leaves the AST validator's depth counter off ("AST constructor
    # recursion depth mismatch") and the import fails, turning a green run into exit code 1.
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        pass
    # LocalSandbox.close() stops its private event loop while asyncio subprocess transports of
    # finished workers are still referenced; their __del__ later reports "Event loop is closed".
    # Harmless here (the workers are dead), and reported to the evaluator's owner.
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Exception ignored in. <function BaseSubprocessTransport.__del__"
        ":pytest.PytestUnraisableExceptionWarning",
    )


@pytest.fixture
def jobs(evaluator, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The kinds of the jobs the (module's) evaluator's sandbox runs from now on, in order."""
    kinds: list[str] = []
    run = evaluator.sandbox.run

    async def recording(job: Any, *args: Any, **kw: Any) -> Any:
        kinds.append(job.kind)
        return await run(job, *args, **kw)

    monkeypatch.setattr(evaluator.sandbox, "run", recording)
    yield kinds
