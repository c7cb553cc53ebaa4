"""The timing benchmark's problems (benchmarks/timing_problems.py): valid KernelBench-format
references that run on the CPU at their CPU sizes, and same-ops candidates that match them."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from cudagym.tasks.loaders import check_task_builds
from cudagym.tasks.model import Target, validate_reference_source

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str) -> types.ModuleType:
    """A module of benchmarks/ (not a package), registered under its own name as its script
    neighbours import it."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


tp = _load("timing_problems")


def test_problem_set_spans_the_range():
    names = [p.name for p in tp.PROBLEMS]
    assert len(names) >= 20 and len(set(names)) == len(names)
    assert {p.time_class for p in tp.PROBLEMS} == {"tiny", "small", "medium", "large"}
    assert sum(p.dtype == "float16" for p in tp.PROBLEMS) >= 2
    assert min(p.expected_us for p in tp.PROBLEMS) <= 2 and max(p.expected_us for p in tp.PROBLEMS) >= 5000


def _exec(code: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(code, name, "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("problem", tp.PROBLEMS, ids=lambda p: p.name)
def test_problem_runs_on_the_cpu_and_its_candidate_matches(problem):
    validate_reference_source(problem.source, problem.name)
    task = problem.task().for_target(Target.CPU)  # an unknown name in cpu_sizes raises here
    check_task_builds(task, "cpu")  # builds the model and runs one forward at the CPU sizes

    candidate = tp.candidate_source(task.code)
    ref, cand = _exec(task.code, "reference"), _exec(candidate, "candidate")
    assert not hasattr(cand, "Model") and issubclass(cand.ModelNew, torch.nn.Module)
    torch.manual_seed(0)
    init = ref.get_init_inputs()
    model = ref.Model(*init)
    model_new = cand.ModelNew(*init)
    model_new.load_state_dict(model.state_dict())
    inputs = ref.get_inputs()
    assert all(x.device.type == "cpu" for x in inputs if isinstance(x, torch.Tensor))  # KernelBench-style
    with torch.no_grad():
        expected, got = model(*inputs), model_new(*inputs)
    assert expected.dtype == getattr(torch, problem.dtype)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_time_class_bounds():
    assert [tp.time_class(us) for us in (0.5, 9.99, 10.0, 99.9, 100.0, 999.0, 1000.0, 1e5)] == [
        "tiny", "tiny", "small", "small", "medium", "medium", "large", "large"]
