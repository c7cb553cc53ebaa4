"""The audit by origin: what the candidate's built objects import (both targets, before anything
runs), which module every kernel its calls launch came from (GPU, in every phase, CUDA-graph
replays included), and that a candidate gains nothing by behaving differently when the
profiler is on. Each attack is real code of ours, built and run by the evaluator.

CPU tests run in CI; GPU tests (`-m gpu`) need a GPU and build their CUDA sources there.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from cudagym.rewards.audit import Origins, foreign_kernels, foreign_work, own_time_share, unmeasured_work
from cudagym.rewards.evaluator import Evaluator
from cudagym.rewards.verdict import ErrorKind
from cudagym.sandbox.origin import (
    MODEL_CALLS_KEY, KernelRecord, forbidden_import, records_as_counts, records_from_counts,
)

from conftest import cpu_config
from test_reward_hacking import GELU, GELU_KERNELS, assert_rejected, gelu_model

# -- the rules, on records and symbols ------------------------------------------------------------
TORCH = "/venv/lib/python3.12/site-packages/torch/lib/libtorch_cuda.so"
OWN = "/cache/build/artifacts/abc/libkernels.so"
GELU_TORCH = "_ZN2at6native29vectorized_elementwise_kernelILi4EZZZNS0_18GeluCUDAKernelImplERNS_18TensorIteratorBaseE"
FILL_TORCH = "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEESt5arrayIPcLm1EEEEviT0_T1_"


def test_forbidden_imports_name_torch_compute_below_the_dispatcher() -> None:
    assert forbidden_import("at::cpu::gelu(at::Tensor const&, c10::basic_string_view<char>)")
    assert forbidden_import("at::cuda::gelu_(at::Tensor&, c10::basic_string_view<char>)")
    assert forbidden_import("at::native::add(at::Tensor const&, at::Tensor const&, c10::Scalar const&)")
    assert forbidden_import("at::_ops::gelu::call(at::Tensor const&, c10::basic_string_view<char>)")
    assert forbidden_import("at::_ops::add_Tensor::call(at::Tensor const&, at::Tensor const&, c10::Scalar const&)")
    assert forbidden_import("torch::jit::load(std::string const&, std::optional<c10::Device>, bool)")
    # what honest bindings import: allocation, views, streams, cuBLAS
    for ok in ("at::_ops::empty_like::call(at::Tensor const&, std::optional<c10::ScalarType>)",
               "at::_ops::empty_memory_format::call(c10::ArrayRef<c10::SymInt>)",
               "at::_ops::contiguous::call(at::Tensor const&, c10::MemoryFormat)",
               "at::_ops::view::call(at::Tensor const&, c10::ArrayRef<c10::SymInt>)",
               "at::cuda::getCurrentCUDAStream(signed char)", "at::cuda::getCurrentCUDABlasHandle()",
               "cublasSgemm_v2", "c10::detail::torchCheckFail(char const*, char const*, unsigned int, char const*)",
               "at::internal::invoke_parallel(long, long, long, std::function<void (long, long)> const&)"):
        assert forbidden_import(ok) is None, ok


def test_kernel_rules_go_by_origin_not_by_name() -> None:
    origins = Origins(own_roots=("/cache/build/artifacts",))
    records = [KernelRecord("launch", "own_kernel", OWN, 3, 3 << 20),
               KernelRecord("launch", FILL_TORCH, TORCH, 2, 512),  # a torch fill: allowed
               # the candidate named its own kernel like torch's: still its own
               KernelRecord("launch", GELU_TORCH, OWN, 1, 1 << 20),
               KernelRecord("graph", GELU_TORCH, TORCH, 3, 3 << 20)]  # torch's kernel in a replayed graph
    foreign = foreign_kernels(records, origins)
    assert len(foreign) == 1 and "GeluCUDAKernelImpl" in foreign[0] and "libtorch_cuda.so" in foreign[0]
    assert foreign_kernels(records[:3], origins) == []
    cublas = KernelRecord("launch", "sm90_xmma_gemm", "/nvidia/cu13/lib/libcublasLt.so.13", 1, 1)
    assert foreign_kernels([cublas], origins)
    assert not foreign_kernels([cublas], Origins(own_roots=origins.own_roots, libraries=frozenset({"libcublasLt"})))
    # the records survive the trip with the op counts
    assert sorted(records_from_counts({**records_as_counts(records), "aten::add": 1, MODEL_CALLS_KEY: 7})) == sorted(records)


def test_permissive_rules_share_and_unmeasured_work() -> None:
    origins = Origins(own_roots=("/cache/build/artifacts",))
    timed = [KernelRecord("launch", "own", OWN, 1, 100, time_ns=3000), KernelRecord("launch", GELU_TORCH, TORCH, 1, 100,
                                                                                     time_ns=1000)]
    assert own_time_share(timed, origins) == pytest.approx(0.75)
    measured = foreign_work([KernelRecord("launch", GELU_TORCH, TORCH, 5, 5000)], origins)  # 5 trials, 1000 each
    honest = foreign_work([KernelRecord("launch", GELU_TORCH, TORCH, 100, 100_000)], origins)  # 100 calls, 1000 each
    assert unmeasured_work(measured, 5, honest, 100) == []
    more = foreign_work([KernelRecord("launch", GELU_TORCH, TORCH, 100, 400_000)], origins)  # 4x the threads per call
    assert unmeasured_work(measured, 5, more, 100)
    assert unmeasured_work({}, 5, {"aten::gelu": 100.0}, 100) == ["aten::gelu"]


# -- CPU target, through the evaluator --------------------------------------------------------------
# A torch binding whose forward computes x * scale + bias itself and then calls torch's own CPU
# GELU kernel directly (at::cpu::, the per-backend function below the dispatcher: no op enters
# the dispatcher, so no op counter or profiler sees it).
BELOW_DISPATCHER_BINDING = r"""
#include <torch/extension.h>
#include <ATen/CPUFunctions.h>

torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias, double scale) {
    torch::Tensor v = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    const float* bp = bias.data_ptr<float>();
    float* vp = v.data_ptr<float>();
    const int64_t cols = x.size(-1), n = x.numel();
    for (int64_t i = 0; i < n; ++i) vp[i] = xp[i] * static_cast<float>(scale) + bp[i % cols];
    return at::cpu::gelu(v, "none");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }
"""
BINDING_MODEL = """\
import torch
import torch.nn as nn
import kernel_ext


class ModelNew(nn.Module):
    def __init__(self, features, scale):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.empty(features))

    def forward(self, x):
        return kernel_ext.forward(x.contiguous(), self.bias, self.scale)
"""


@pytest.fixture(scope="module")
def permissive(eval_cache: Path):
    with Evaluator(cpu_config(eval_cache, mode="permissive")) as ev:
        yield ev


@pytest.mark.timeout(900)
def test_cpu_kernel_called_below_the_dispatcher_is_rejected_in_strict(evaluator: Evaluator, build_ws) -> None:
    ws = build_ws(GELU, BINDING_MODEL, {"kernels/gelu_binding.cpp": BELOW_DISPATCHER_BINDING})
    assert evaluator.compile(GELU, ws).ok
    v = evaluator.evaluate(GELU, ws)
    assert_rejected(v, ErrorKind.AUDIT, "strict mode", "at::cpu::gelu", "below the dispatcher")


# Own kernel while a profiler records (verify's trials, the share's measurement), torch otherwise.
PROFILER_AWARE = """\
if torch.autograd._profiler_enabled():
    return run_kernel(x, self.bias, self.scale)
return F.gelu(x * self.scale + self.bias)
"""


def test_permissive_candidate_that_behaves_differently_under_the_profiler(permissive: Evaluator, build_ws) -> None:
    """No better than its honest reward: the timed calls did torch compute that verify's
    trials, where the share was measured, did not."""
    honest = permissive.evaluate(GELU, build_ws(GELU, gelu_model("return run_kernel(x, self.bias, self.scale)"),
                                                GELU_KERNELS))
    assert honest.reward >= 1, honest.reasons
    v = permissive.evaluate(GELU, build_ws(GELU, gelu_model(PROFILER_AWARE), GELU_KERNELS))
    assert any(r.startswith("correct on") for r in v.reasons), v.reasons  # verify saw the own kernel
    assert v.reward <= honest.reward
    assert_rejected(v, ErrorKind.AUDIT, "permissive mode", "timed calls", "aten::gelu")


def test_permissive_candidate_with_the_same_torch_work_everywhere_passes(permissive: Evaluator, build_ws) -> None:
    """The consistency rule holds honest permissive solutions (own kernel plus a torch op in
    every call) to nothing they did not do while measured."""
    body = """\
    out = run_kernel(x, self.bias, self.scale)
    return out.clone()  # an allowed copy, in every call
    """
    v = permissive.evaluate(GELU, build_ws(GELU, gelu_model(body), GELU_KERNELS))
    assert v.reward >= 1, v.reasons


# -- GPU -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_ev(tmp_path_factory: pytest.TempPathFactory):
    from cudagym.rewards.evaluator import EvaluatorConfig

    cfg = EvaluatorConfig(target="cuda", cache_dir=tmp_path_factory.mktemp("cache"), compile_baseline=False)
    with Evaluator(cfg) as e:
        yield e


@pytest.fixture(scope="module")
def gpu_permissive(tmp_path_factory: pytest.TempPathFactory):
    from cudagym.rewards.evaluator import EvaluatorConfig

    cfg = EvaluatorConfig(target="cuda", cache_dir=tmp_path_factory.mktemp("cache"), compile_baseline=False,
                          mode="permissive")
    with Evaluator(cfg) as e:
        yield e


def gpu_ws(root: Path, model_new: str, kernels: dict[str, str] | None = None):
    from cudagym.sandbox.workspace import Workspace
    from cudagym.tasks.loaders import bundled_task

    task = bundled_task("ew_scale_bias_gelu").for_target("cuda")
    ws = Workspace.create(root, task)
    ws.write("model_new.py", textwrap.dedent(model_new))
    for rel, text in (kernels or {}).items():
        ws.write(rel, textwrap.dedent(text))
    return task, ws


SOLUTION = Path(__file__).resolve().parent.parent / "examples" / "solutions" / "ew_scale_bias_gelu" / "cuda"
OWN_CU = (SOLUTION / "kernels" / "scale_bias_gelu.cu").read_text()
OWN_MODEL = (SOLUTION / "model_new.py").read_text()

# A binding that calls torch's CUDA GELU kernel directly (at::cuda::, no dispatcher op), after
# its own scale-and-bias kernel.
CUDA_BELOW_DISPATCHER_BINDING = r"""
#include <torch/types.h>
#include <ATen/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/python.h>

extern "C" int scale_bias(const float* x, const float* bias, float* out, int64_t rows, int64_t cols, float scale,
                          cudaStream_t stream);

torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias, double scale) {
    torch::Tensor v = torch::empty_like(x);
    scale_bias(x.data_ptr<float>(), bias.data_ptr<float>(), v.data_ptr<float>(), x.numel() / x.size(-1), x.size(-1),
               static_cast<float>(scale), c10::cuda::getCurrentCUDAStream().stream());
    return at::cuda::gelu(v, "none");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }
"""
SCALE_BIAS_CU = r"""
#include <cstdint>
#include <cuda_runtime.h>
__global__ void scale_bias_kernel(const float* x, const float* bias, float* out, int64_t n, int64_t cols, float s) {
    int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] * s + bias[i % cols];
}
extern "C" int scale_bias(const float* x, const float* bias, float* out, int64_t rows, int64_t cols, float scale,
                          cudaStream_t stream) {
    int64_t n = rows * cols;
    scale_bias_kernel<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(x, bias, out, n, cols, scale);
    return (int)cudaGetLastError();
}
"""

# The reference computation captured into a CUDA graph in __init__ (torch's kernels), replayed
# in forward: copy_ in, replay, clone out. No compute op enters the dispatcher in forward.
GRAPH_REPLAY = """\
import torch
import torch.nn as nn
import torch.nn.functional as F
from cudagym.runtime import kernel_library
from model import BATCH

_lib = kernel_library()  # built, never used


class ModelNew(nn.Module):
    def __init__(self, features, scale):
        super().__init__()
        self.scale = scale
        # Model's own draw after the same seed (so the outputs are right), on the GPU for the capture
        self.bias = nn.Parameter((torch.randn(features) * 0.5).cuda())
        self._x = torch.zeros(BATCH, features, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                F.gelu(self._x * self.scale + self.bias)
        torch.cuda.current_stream().wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self._graph):
            self._y = F.gelu(self._x * self.scale + self.bias)  # reads the parameter's memory

    def forward(self, x):
        self._x.copy_(x)
        self._graph.replay()
        return self._y.clone()
"""

# Permissive, third-party style: torch scales the input (one vectorized kernel), the own kernel
# adds the bias and applies the erf-GELU.
PERMISSIVE_MIXED_CU = r"""
#include <cstdint>
#include <cuda_runtime.h>
__global__ void bias_gelu_kernel(const float* v, const float* bias, float* out, int64_t n, int64_t cols) {
    int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) { float a = v[i] + bias[i % cols]; out[i] = 0.5f * a * (1.0f + erff(a * 0.70710678118654752f)); }
}
extern "C" int bias_gelu(const float* v, const float* bias, float* out, int64_t n, int64_t cols, cudaStream_t stream) {
    bias_gelu_kernel<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(v, bias, out, n, cols);
    return (int)cudaGetLastError();
}
"""
PERMISSIVE_MIXED = """\
import ctypes
import torch
import torch.nn as nn
import torch.nn.functional as F
from cudagym.runtime import kernel_library, ptr, stream

_lib = kernel_library()
_lib.bias_gelu.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
_lib.bias_gelu.restype = ctypes.c_int


def own_bias_gelu(v, bias):
    out = torch.empty_like(v)
    _lib.bias_gelu(ptr(v), ptr(bias), ptr(out), v.numel(), v.size(-1), stream())
    return out


class ModelNew(nn.Module):
    def __init__(self, features, scale):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(features) * 0.5)  # Model's draw after the same seed

    def forward(self, x):
        v = x * self.scale  # torch's kernel
{tail}
"""
HONEST_TAIL = "        return own_bias_gelu(v, self.bias)\n"
PROFILER_AWARE_TAIL = """\
        if torch.autograd._profiler_enabled():
            return own_bias_gelu(v, self.bias)
        return F.gelu(v + self.bias)
"""


@pytest.mark.gpu
def test_gpu_torch_cuda_kernel_called_below_the_dispatcher_is_rejected(tmp_path, gpu_ev) -> None:
    task, ws = gpu_ws(tmp_path / "ws", BINDING_MODEL, {"kernels/scale_bias.cu": SCALE_BIAS_CU,
                                                       "kernels/gelu_binding.cpp": CUDA_BELOW_DISPATCHER_BINDING})
    c = gpu_ev.compile(task, ws)
    assert c.ok, c.errors
    v = gpu_ev.evaluate(task, ws)
    assert_rejected(v, ErrorKind.AUDIT, "strict mode", "at::cuda::gelu")


@pytest.mark.gpu
def test_gpu_cuda_graph_of_torch_ops_replayed_in_forward_is_rejected(tmp_path, gpu_ev) -> None:
    task, ws = gpu_ws(tmp_path / "ws", GRAPH_REPLAY, {"kernels/scale_bias_gelu.cu": OWN_CU})
    v = gpu_ev.evaluate(task, ws)
    assert_rejected(v, ErrorKind.AUDIT, "strict mode", "not your own", "libtorch_cuda.so")
    assert any("Gelu" in f or "gelu" in f.lower() for f in v.audit.forbidden_ops), v.audit.forbidden_ops


@pytest.mark.gpu
def test_gpu_honest_solution_passes_strict_with_every_kernel_its_own(tmp_path, gpu_ev) -> None:
    task, ws = gpu_ws(tmp_path / "ws", OWN_MODEL, {"kernels/scale_bias_gelu.cu": OWN_CU})
    v = gpu_ev.evaluate(task, ws)
    assert v.reward >= 1, v.summary()
    kernels = records_from_counts(v.verify_result.audit.ops_seen)
    assert kernels and all("scale_bias_gelu_kernel" in k.name for k in kernels), kernels
    assert all(k.origin.endswith("libkernels.so") for k in kernels), kernels


@pytest.mark.gpu
def test_gpu_permissive_third_party_style_passes_and_profiler_aware_does_not(tmp_path, gpu_permissive) -> None:
    task, ws = gpu_ws(tmp_path / "honest", PERMISSIVE_MIXED.format(tail=HONEST_TAIL),
                      {"kernels/gelu.cu": PERMISSIVE_MIXED_CU})
    honest = gpu_permissive.evaluate(task, ws)
    assert honest.reward >= 1, (honest.reasons, honest.audit)
    assert 0 < honest.verify_result.audit.own_kernel_share < 1, honest.verify_result.audit
    task, ws = gpu_ws(tmp_path / "aware", PERMISSIVE_MIXED.format(tail=PROFILER_AWARE_TAIL),
                      {"kernels/gelu.cu": PERMISSIVE_MIXED_CU})
    v = gpu_permissive.evaluate(task, ws)
    assert v.reward <= honest.reward
    assert_rejected(v, ErrorKind.AUDIT, "permissive mode", "timed calls")


@pytest.mark.gpu
def test_gpu_cpp_binding_calling_torch_ops_through_the_dispatcher_named_too(tmp_path, gpu_ev) -> None:
    """A GELU reached with at::gelu (through the dispatcher, from C++): the import audit names
    the compute op before anything runs."""
    binding = CUDA_BELOW_DISPATCHER_BINDING.replace("at::cuda::gelu(v, \"none\")", "at::gelu(v)")
    task, ws = gpu_ws(tmp_path / "ws", BINDING_MODEL, {"kernels/scale_bias.cu": SCALE_BIAS_CU,
                                                       "kernels/gelu_binding.cpp": binding})
    v = gpu_ev.evaluate(task, ws)
    assert_rejected(v, ErrorKind.AUDIT, "strict mode", "aten::gelu")

