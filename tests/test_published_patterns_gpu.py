"""Honest CUDA solutions written the way published KernelBench-format solutions are, on the GPU:
an extension built with load_inline in `__init__` or on the first forward behind a try/except
torch fallback, parameters fused (judged by the outputs after the same seed), a fast-math kernel
within KernelBench's 1e-2 on a KernelBench-format file; and an extension that really fails to
compile, which must be a compile error and never a torch fallback with reward.
(The CPU target's versions: tests/test_inline_build.py and tests/test_published_patterns.py.)
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from cudagym.rewards.evaluator import Evaluator
from cudagym.core.verdict import ErrorKind
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import bundled_task, load_task_file

import test_inline_build as inline_build
import test_published_patterns as published
from test_gpu import SOLUTIONS, ev  # noqa: F401 - the GPU evaluator fixture

pytestmark = pytest.mark.gpu
SEED_PATH = "built after the same seed"


def gpu_workspace(root: Path, task_id: str, model_new: str, kernels: dict[str, str] | None = None):
    task = bundled_task(task_id).for_target("cuda")
    ws = Workspace.create(root, task)
    ws.write("model_new.py", model_new)
    for rel, text in (kernels or {}).items():
        ws.write(rel, text)
    return task, ws


# -- load_inline with a try/except torch fallback ------------------------------------------------
# A Python C-API module (no torch headers: seconds to build) whose launcher runs on the stream
# handle it is given; the kernel is min(relu(x + residual), clamp_max).
EXT_CPP = r"""
#include <Python.h>
#include <cstdint>
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define STR2(x) #x
#define STR(x) STR2(x)
extern "C" int launch_residual_relu_clamp(const float*, const float*, float*, long long, float, void*);
static PyObject* residual_relu_clamp(PyObject*, PyObject* args) {
    unsigned long long x, r, o, s; long long n; double hi;
    if (!PyArg_ParseTuple(args, "KKKLdK", &x, &r, &o, &n, &hi, &s)) return nullptr;
    int err = launch_residual_relu_clamp(reinterpret_cast<const float*>(x), reinterpret_cast<const float*>(r),
                                         reinterpret_cast<float*>(o), n, static_cast<float>(hi),
                                         reinterpret_cast<void*>(s));
    if (err) { PyErr_Format(PyExc_RuntimeError, "launch failed: CUDA error %d", err); return nullptr; }
    Py_RETURN_NONE;
}
static PyMethodDef methods[] = {{"residual_relu_clamp", residual_relu_clamp, METH_VARARGS, ""},
                                {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""

EXT_CU = r"""
#include <cuda_runtime.h>
__global__ void residual_relu_clamp_kernel(const float* __restrict__ x, const float* __restrict__ r,
                                           float* __restrict__ out, long long n, float hi) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i] + r[i];
    v = v > 0.0f ? v : 0.0f;
    out[i] = v < hi ? v : hi;
}
extern "C" int launch_residual_relu_clamp(const float* x, const float* r, float* out, long long n, float hi,
                                          void* stream) {
    const int threads = 256;
    const unsigned blocks = static_cast<unsigned>((n + threads - 1) / threads);
    residual_relu_clamp_kernel<<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(x, r, out, n, hi);
    return static_cast<int>(cudaGetLastError());
}
"""

HEADER = '''\
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CPP = {cpp!r}
CU = {cu!r}


def build():
    return load_inline(name="{name}", cpp_sources=CPP, cuda_sources=CU, no_implicit_headers=True,
                       extra_cflags=["-O2"], extra_cuda_cflags=["-O3"])


def fallback(x, residual, clamp_max):
    return torch.clamp(torch.relu(x + residual), max=clamp_max)


def own(ext, x, residual, clamp_max):
    x, residual = x.contiguous(), residual.contiguous()
    out = torch.empty_like(x)
    ext.residual_relu_clamp(x.data_ptr(), residual.data_ptr(), out.data_ptr(), x.numel(), clamp_max,
                            torch.cuda.current_stream().cuda_stream)
    return out
'''

# The CPU tests' solutions (tests/test_inline_build.py), on this file's CUDA extension
BUILT_IN_INIT = HEADER + inline_build.BUILT_IN_INIT[len(inline_build.HEADER):]
BUILT_ON_FIRST_FORWARD = HEADER + inline_build.BUILT_ON_FIRST_FORWARD[len(inline_build.HEADER):]


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("template", [BUILT_IN_INIT, BUILT_ON_FIRST_FORWARD],
                         ids=["in_init_with_fallback", "on_first_forward_with_fallback"])
def test_cuda_extension_is_built_wherever_the_solution_builds_it(tmp_path, ev: Evaluator, template: str) -> None:
    name = unique("gpu_ext")
    task, ws = gpu_workspace(tmp_path / "ws", "ew_residual_relu_clamp",
                             template.format(cpp=EXT_CPP, cu=EXT_CU, name=name))
    c = ev.compile(task, ws)
    assert c.ok, c.errors
    assert c.inline_modules == [name] and not c.cached
    v = ev.evaluate(task, ws)
    # strict mode: the torch fallback would fail the op audit, so a reward means the kernel ran
    assert v.reward >= 1, v.summary()
    assert v.audit is not None and v.audit.passed


def test_cuda_extension_that_does_not_compile_is_a_compile_error_not_a_fallback(tmp_path, ev: Evaluator) -> None:
    broken = EXT_CU.replace("float v = x[i] + r[i];", "float v = x[i] + undeclared_r[i];")
    task, ws = gpu_workspace(tmp_path / "ws", "ew_residual_relu_clamp",
                             BUILT_IN_INIT.format(cpp=EXT_CPP, cu=broken, name=unique("gpu_broken")))
    v = ev.evaluate(task, ws)
    assert v.reward < 0 and v.compile_result is not None and not v.compile_result.ok, v.summary()
    errors = "\n".join(v.compile_result.errors)
    assert "undeclared_r" in errors and "undefined" in errors, errors
    assert str(ws.root) not in errors


# -- restructured and fused parameters -----------------------------------------------------------
FUSED_HEADER = '''\
import ctypes
import torch
import torch.nn as nn
from cudagym.runtime import kernel_library, ptr, stream

_lib = kernel_library()
_lib.linear_bias_gelu.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
_lib.linear_bias_gelu.restype = ctypes.c_int


'''
FUSED_FORWARD = '''    def forward(self, x):
        x = x.contiguous()
        n, k = self.weight.shape
        m = x.numel() // k
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
        err = _lib.linear_bias_gelu(ptr(x), ptr(self.weight), ptr(self.fused_bias), ptr(out), m, n, k, stream())
        if err:
            raise RuntimeError(f"linear_bias_gelu launch failed: CUDA error {err}")
        return out
'''
_CPU_FUSED = published.FUSED_MODEL  # its __init__: parameters drawn as the reference draws them, biases fused
FUSED_MODEL = (FUSED_HEADER + _CPU_FUSED[_CPU_FUSED.index("class ModelNew"):_CPU_FUSED.index("    def forward")]
               + FUSED_FORWARD)


def fused_kernel() -> str:
    """The example's tiled GEMM with its epilogue reading one bias instead of two."""
    cu = (SOLUTIONS / "mm_linear_gelu" / "cuda" / "kernels" / "linear_gelu.cu").read_text()
    cu = "\n".join(line for line in cu.splitlines() if not line.startswith("//"))  # its header names b2
    cu = cu.replace("const float* __restrict__ b1, const float* __restrict__ b2,", "const float* __restrict__ b1,")
    cu = cu.replace("(acc + b1[n]) + b2[n]", "acc + b1[n]")
    cu = cu.replace("const float* b1, const float* b2, float* out", "const float* b1, float* out")
    cu = cu.replace("(x, w, b1, b2, out,", "(x, w, b1, out,")
    assert "b2" not in cu, "the example kernel changed: update this test's rewrite"
    return cu


def test_fused_parameters_are_judged_by_the_outputs_on_the_gpu(tmp_path, ev: Evaluator) -> None:
    task, ws = gpu_workspace(tmp_path / "ws", "mm_linear_gelu", FUSED_MODEL, {"kernels/linear_gelu.cu": fused_kernel()})
    v = ev.evaluate(task, ws)
    assert v.reward >= 1, v.summary()
    assert any(SEED_PATH in r for r in v.reasons), v.reasons


# -- fast math within KernelBench's tolerance ----------------------------------------------------
def fast_gelu_kernel() -> str:
    """The example's scale-bias-GELU with the tanh approximation through __expf (max error ~1e-3)."""
    cu = (SOLUTIONS / "ew_scale_bias_gelu" / "cuda" / "kernels" / "scale_bias_gelu.cu").read_text()
    exact = "out[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));"
    assert exact in cu, "the example kernel changed: update this test's rewrite"
    fast = ("const float u = 0.7978845608f * (v + 0.044715f * v * v * v);\n"
            "    out[i] = v - v / (__expf(2.0f * u) + 1.0f);  // 0.5 v (1 + tanh u)")
    return cu.replace(exact, fast)


def test_fast_math_within_kernelbench_tolerance_is_accepted_on_the_gpu(tmp_path, ev: Evaluator) -> None:
    bundled = bundled_task("ew_scale_bias_gelu")
    path = tmp_path / "scale_bias_gelu.py"  # the same model as a KernelBench-format file
    path.write_text(bundled.code)
    task = load_task_file(path).for_target("cuda")
    assert task.effective_tolerance.atol == 1e-2
    model = (SOLUTIONS / "ew_scale_bias_gelu" / "cuda" / "model_new.py").read_text()
    kernels = {"kernels/scale_bias_gelu.cu": fast_gelu_kernel()}
    ws = Workspace.create(tmp_path / "kb", task)
    ws.write("model_new.py", model)
    ws.write("kernels/scale_bias_gelu.cu", kernels["kernels/scale_bias_gelu.cu"])
    v = ev.evaluate(task, ws)
    assert v.reward >= 1, v.summary()
    # the same kernel on the bundled task, whose tolerance is 1e-4, is refused
    own_task, own_ws = gpu_workspace(tmp_path / "own", "ew_scale_bias_gelu", model, kernels)
    refused = ev.evaluate(own_task, own_ws)
    assert refused.reward < 0 and refused.error_kind == ErrorKind.MISMATCH, refused.summary()
