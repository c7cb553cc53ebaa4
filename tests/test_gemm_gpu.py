"""GPU tests of the GEMM family's baselines and of the WMMA solution (`python -m pytest -m gpu`).

The cuBLASLt baselines need nvmath-python (`pip install 'cudagym[gemm]'`); without it these
tests skip, saying so."""

from __future__ import annotations

from pathlib import Path

import pytest

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.rewards.milestone import RewardConfig
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.gemm import GemmConfig, gemm_task

pytestmark = pytest.mark.gpu
WMMA = Path(__file__).resolve().parent.parent / "examples" / "gemm" / "model_new.py"
CONFIGS = [GemmConfig(1024, 768, 512, "float16", "small", True),   # every vector load in bounds
           GemmConfig(999, 517, 333, "bfloat16", "small", False)]  # every edge path, element loads


@pytest.fixture(scope="module")
def ev(tmp_path_factory):
    pytest.importorskip("nvmath", reason="the cuBLASLt baselines need nvmath-python: pip install 'cudagym[gemm]'")
    cfg = EvaluatorConfig(target="cuda", cache_dir=tmp_path_factory.mktemp("cache"),
                          reward=RewardConfig(against=("eager", "cublaslt_tuned")))
    with Evaluator(cfg) as e:
        yield e


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.dtype)
def test_the_wmma_solution_is_correct_and_timed_against_every_baseline(tmp_path, ev, config):
    task = gemm_task(config).for_target(ev.target)
    v = ev.evaluate(task, Workspace.from_solution(tmp_path / "ws", task, WMMA))
    assert v.correct and v.reward >= 1, (v.reasons, v.error)
    assert v.eager_ms and v.compile_ms and set(v.library_ms) == {"cublaslt", "cublaslt_tuned"}, v.reasons
    for name, ms in v.library_ms.items():
        # torch.matmul runs a cuBLAS(Lt) kernel too: a library time far from eager is no measurement
        assert 0.2 < v.eager_ms / ms < 5, (name, ms, v.eager_ms)
    assert any(r.startswith("speedup vs cuBLASLt (autotuned) ") for r in v.reasons), v.reasons
    assert not any("baseline unavailable" in r for r in v.reasons), v.reasons
