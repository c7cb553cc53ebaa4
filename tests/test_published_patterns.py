"""Honest solutions written the way published KernelBench-format solutions are: parameters
renamed or fused (KernelBench's convention: both models built after the same seed, the outputs
decide) and fast-math within KernelBench's tolerance. Each is accepted on the CPU target.
(Extensions built in `__init__`, lazily or at import: tests/test_inline_build.py.)
"""

from __future__ import annotations

from pathlib import Path

from cudagym.rewards.evaluator import Evaluator
from cudagym.core.verdict import ErrorKind
from cudagym.tasks.loaders import load_task_file

from conftest import task_of
from test_reward_hacking import GELU, GELU_KERNELS, HEADER, TANH_GELU_CPP, assert_rejected, gelu_model

SEED_PATH = "built after the same seed"


def test_a_renamed_parameter_is_judged_by_the_outputs(evaluator: Evaluator, build_ws) -> None:
    model = HEADER + """
class ModelNew(nn.Module):
    def __init__(self, features, scale):
        super().__init__()
        self.scale = scale
        self.offset = nn.Parameter(torch.randn(features) * 0.5)  # the reference calls it `bias`

    def forward(self, x):
        return run_kernel(x, self.offset, self.scale)
"""
    v = evaluator.evaluate(GELU, build_ws(GELU, model, GELU_KERNELS))
    assert v.reward >= 1, (v.reasons, (v.error or "")[:1500])
    assert any(SEED_PATH in r for r in v.reasons), v.reasons


LINEAR_GELU_CPP = """\
#include <cmath>
#include <cstdint>
// out = erf-GELU(x @ w^T + b), b already holding both of the reference's biases
extern "C" void linear_gelu(const float* x, const float* w, const float* b, float* out,
                            int64_t rows, int64_t in, int64_t outs) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t o = 0; o < outs; ++o) {
            double acc = b[o];
            for (int64_t k = 0; k < in; ++k) acc += (double)x[r * in + k] * w[o * in + k];
            float v = (float)acc;
            out[r * outs + o] = 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
        }
}
"""

FUSED_MODEL = """\
import ctypes
import torch
import torch.nn as nn
from cudagym.runtime import kernel_library, ptr

_lib = kernel_library()
_lib.linear_gelu.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
_lib.linear_gelu.restype = None


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        linear = nn.Linear(in_features, out_features)  # drawn as the reference draws them
        extra = torch.randn(out_features) * 0.1
        self.weight = nn.Parameter(linear.weight.detach().clone())
        self.fused_bias = nn.Parameter(linear.bias.detach() + extra)  # two biases, one parameter

    def forward(self, x):
        x = x.contiguous()
        out = torch.empty(x.size(0), self.weight.size(0))
        _lib.linear_gelu(ptr(x), ptr(self.weight), ptr(self.fused_bias), ptr(out),
                         x.size(0), x.size(1), self.weight.size(0))
        return out
"""


def test_fused_parameters_are_judged_by_the_outputs(evaluator: Evaluator, build_ws) -> None:
    task = task_of("mm_linear_gelu")
    v = evaluator.evaluate(task, build_ws(task, FUSED_MODEL, {"kernels/linear_gelu.cpp": LINEAR_GELU_CPP}))
    assert v.reward >= 1, (v.reasons, (v.error or "")[:1500])
    assert any(SEED_PATH in r for r in v.reasons), v.reasons


def test_fast_math_within_kernelbench_tolerance_is_accepted_on_a_kernelbench_file(
        evaluator: Evaluator, build_ws, tmp_path: Path) -> None:
    """The tanh approximation of GELU (max error ~1e-3): within KernelBench's 1e-2 on a
    KernelBench-format file, outside our own tasks' 1e-4 (tests/test_reward_hacking.py)."""
    path = tmp_path / "scale_bias_gelu.py"
    path.write_text(GELU.code)
    task = load_task_file(path).resized(**GELU.cpu_sizes)
    assert task.effective_tolerance.atol == 1e-2
    solution = gelu_model("return run_kernel(x, self.bias, self.scale)")
    v = evaluator.evaluate(task, build_ws(task, solution, {"kernels/gelu.cpp": TANH_GELU_CPP}))
    assert v.reward >= 1, (v.reasons, (v.error or "")[:1500])
    assert_rejected(evaluator.evaluate(GELU, build_ws(GELU, solution, {"kernels/gelu.cpp": TANH_GELU_CPP})),
                    ErrorKind.MISMATCH, "atol=0.0001")
