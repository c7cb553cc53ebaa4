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
_load("timing_driver")  # bench_baselines imports both by name
bb = _load("bench_baselines")


def test_problem_set_spans_the_range():
    names = [p.name for p in tp.PROBLEMS]
    assert len(names) >= 20 and len(set(names)) == len(names)
    assert {p.time_class for p in tp.PROBLEMS} == {"tiny", "small", "medium", "large"}
    assert sum(p.dtype == "float16" for p in tp.PROBLEMS) >= 2
    assert min(p.expected_us for p in tp.PROBLEMS) < 5 and max(p.expected_us for p in tp.PROBLEMS) > 5000


def _exec(code: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(code, name, "exec"), module.__dict__)  # noqa: S102 - loads the problem source under test
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


# -- the benchmark's attribution of ncu's kernels to problems and calls ---------------------------
# The layout of `ncu --csv --log-file` (Nsight Compute 2025.3) over `timing_driver.py ncu` with two
# calls of relu_16x16384 and one of mlp_tiny_b8 (kernel names shortened)
NCU_LOG = """==WARNING== Note: Running with unmodified GPU clocks. If not controlled otherwise, profiling results may be inconsistent.
==PROF== Connected to process 605 (/usr/bin/python3.12)
==PROF== Disconnected from process 605
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","605","python3.12","127.0.0.1","void native::vectorized_elementwise_kernel<4, clamp>(int, T2, T3)","1","7","(128, 1, 1)","(256, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","3,680"
"1","605","python3.12","127.0.0.1","cuda::<unnamed>::spin_kernel(long)","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","2,592"
"3","605","python3.12","127.0.0.1","cuda::<unnamed>::spin_kernel(long)","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","2,592"
"2","605","python3.12","127.0.0.1","void native::vectorized_elementwise_kernel<4, clamp>(int, T2, T3)","1","7","(128, 1, 1)","(256, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","3,168"
"4","605","python3.12","127.0.0.1","void gemmSN_TN_kernel<float, 128>(cublasGemmSmallNParams<T9, T10, T11, T1>)","1","7","(128, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","us","5.79"
"5","605","python3.12","127.0.0.1","void native::vectorized_elementwise_kernel<4, clamp>(int, T2, T3)","1","7","(128, 1, 1)","(4, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","2,752"
"6","605","python3.12","127.0.0.1","cuda::<unnamed>::spin_kernel(long)","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","2,592"
"""
MANIFEST = {"relu_16x16384": {"problem": "relu_16x16384", "calls": 2},
            "mlp_tiny_b8": {"problem": "mlp_tiny_b8", "calls": 1}}


def test_ncu_kernels_are_attributed_to_calls_in_launch_order():
    launches = bb.ncu_launches(NCU_LOG)
    assert [round(ms * 1e6) for _, ms in launches] == [3680, 2592, 3168, 2592, 5790, 2752, 2592]  # ID order
    calls = bb.attribute_calls(launches, MANIFEST)
    assert [len(c) for c in calls["relu_16x16384"]] == [1, 1] and [len(c) for c in calls["mlp_tiny_b8"]] == [2]
    relu, mlp = bb.ncu_summary(calls["relu_16x16384"]), bb.ncu_summary(calls["mlp_tiny_b8"])
    assert relu["kernels_per_call"] == [1] and relu["ncu_ms"] == pytest.approx((3.680e-3 + 3.168e-3) / 2)
    assert mlp["kernels_per_call"] == [2] and mlp["ncu_ms"] == pytest.approx(5.79e-3 + 2.752e-3)


def test_ncu_attribution_refuses_counts_that_do_not_match_the_driver():
    launches = bb.ncu_launches(NCU_LOG)
    with pytest.raises(RuntimeError, match="cannot be attributed"):
        bb.attribute_calls(launches, {**MANIFEST, "mlp_tiny_b8": {"calls": 2}})
    with pytest.raises(RuntimeError, match="after the last"):  # a call without its marker
        bb.attribute_calls(launches[:-1], {**MANIFEST, "mlp_tiny_b8": {"calls": 0}})
    with pytest.raises(RuntimeError, match="no metrics table"):
        bb.ncu_launches("==ERROR== ERR_NVGPUCTRPERM - no permission to access the GPU performance counters")


def test_acceptance_of_single_and_multi_kernel_rows():
    row = {"ncu_ms": 0.005, "kernels_per_call": [1]}
    assert bb.acceptance({**row, "eager_median_ms": 0.0069, "candidate_median_ms": 0.0031})[0] is True  # 2 µs floor
    assert bb.acceptance({**row, "eager_median_ms": 0.0071, "candidate_median_ms": 0.005})[0] is False
    big = {"ncu_ms": 1.0, "kernels_per_call": [1]}
    assert bb.acceptance({**big, "eager_median_ms": 1.09, "candidate_median_ms": 0.91})[0] is True  # 10%
    assert bb.acceptance({**big, "eager_median_ms": 1.0, "candidate_median_ms": 1.11})[0] is False
    # 3 kernels: 10% + 3 x 2 us = 7 us of a 10 us sum
    verdict, text = bb.acceptance({"ncu_ms": 0.01, "kernels_per_call": [3], "eager_median_ms": 0.04,
                                   "candidate_median_ms": 0.02})
    assert verdict is False and "+30.0 µs" in text and "+10.0 µs" in text and "±7.0 µs" in text
    assert bb.acceptance({"ncu_ms": 0.01, "kernels_per_call": [3], "eager_median_ms": 0.0169,
                          "candidate_median_ms": 0.0031})[0] is True
    verdict, text = bb.acceptance({**row, "eager_median_ms": 0.005, "candidate_error": "profile: timed out\nmore"})
    assert verdict is None and text == "candidate error: profile: timed out"
