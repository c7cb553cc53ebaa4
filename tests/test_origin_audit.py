"""The audit by origin: what the candidate's built objects import (both targets, before anything
runs), which module every kernel its calls launch came from (GPU, in every phase, CUDA-graph
replays included), and that a candidate gains nothing by behaving differently when the
profiler is on. Each attack is real code of ours, built and run by the evaluator.

CPU tests run in CI; GPU tests (`-m gpu`) need a GPU and build their CUDA sources there.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from cudagym.core.audit import Origins, foreign_kernels, foreign_work, own_time_share, unmeasured_work
from cudagym.rewards.evaluator import Evaluator
from cudagym.core.verdict import ErrorKind
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
    # run-time lookup (what the imports cannot show) and RecordFunction switches (what the op
    # counter cannot see within a call)
    for sym in ("dlsym", "dlvsym", "dlopen", "dlmopen", "dladdr", "dl_iterate_phdr",
                "c10::DynamicLibrary::sym(char const*)", "at::enableRecordFunction(bool)",
                "at::clearCallbacks()", "at::disableCallback(unsigned long)",
                "at::set_record_function_tls_(at::RecordFunctionTLS const&)",
                "at::ThreadLocalState::setThreadLocalState(at::ThreadLocalState const&)"):
        why = forbidden_import(sym)
        assert why and "no need for it" in why, sym
    assert "run-time symbol lookup" in (forbidden_import("dlsym") or "")
    for ok in ("at::_ops::empty_like::call(at::Tensor const&, std::optional<c10::ScalarType>)",
               "at::RecordFunction::RecordFunction(at::RecordScope)",
               "at::getStepCallbacksUnlessEmpty(at::RecordScope)",
               "at::isRecordFunctionEnabled()", "dlerror",
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
    counts = {**records_as_counts(records), "aten::add": 1, MODEL_CALLS_KEY: 7}
    assert sorted(records_from_counts(counts)) == sorted(records)


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


# The same GELU reached at run time: the binding looks up torch's CPU kernel by a mangled name it
# assembles itself, so no import names it; only the lookup shows.
RUNTIME_LOOKUP_BINDING = r"""
#include <torch/extension.h>
#include <dlfcn.h>
#include <string>

using Gelu = at::Tensor (*)(const at::Tensor&, c10::string_view);

torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias, double scale) {
    static Gelu gelu = nullptr;
    if (!gelu) {
        const std::string ns = "_ZN2at3cpu";
        gelu = reinterpret_cast<Gelu>(dlsym(
            RTLD_DEFAULT, (ns + "4geluERKNS_6TensorESt17basic_string_viewIcSt11char_traitsIcEE").c_str()));
        TORCH_CHECK(gelu != nullptr, "lookup failed");
    }
    torch::Tensor v = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    const float* bp = bias.data_ptr<float>();
    float* vp = v.data_ptr<float>();
    const int64_t cols = x.size(-1), n = x.numel();
    for (int64_t i = 0; i < n; ++i) vp[i] = xp[i] * static_cast<float>(scale) + bp[i % cols];
    return gelu(v, "none");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }
"""

# RecordFunction switched off around torch's own ops inside one call, on again before it returns:
# the op counter (a RecordFunction callback) would see none of them.
RECORD_FUNCTION_SWITCH_BINDING = r"""
#include <torch/extension.h>
#include <ATen/record_function.h>

void watched(bool on) { at::enableRecordFunction(on); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("watched", &watched); }
"""
RECORD_FUNCTION_SWITCH_MODEL = """\
import torch
import torch.nn as nn
import torch.nn.functional as F
import kernel_ext


class ModelNew(nn.Module):
    def __init__(self, features, scale):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(features) * 0.5)

    def forward(self, x):
        kernel_ext.watched(False)
        try:
            return F.gelu(x * self.scale + self.bias)
        finally:
            kernel_ext.watched(True)
"""


@pytest.mark.timeout(900)
def test_cpu_kernel_found_at_run_time_with_dlsym_is_rejected_in_strict(evaluator: Evaluator, build_ws) -> None:
    ws = build_ws(GELU, BINDING_MODEL, {"kernels/gelu_binding.cpp": RUNTIME_LOOKUP_BINDING})
    assert evaluator.compile(GELU, ws).ok
    v = evaluator.evaluate(GELU, ws)
    assert_rejected(v, ErrorKind.AUDIT, "strict mode", "dlsym", "run-time symbol lookup", "no need for it")


@pytest.mark.timeout(900)
def test_cpu_record_function_switched_off_within_a_call_is_rejected_in_strict(evaluator: Evaluator,
                                                                              build_ws) -> None:
    ws = build_ws(GELU, RECORD_FUNCTION_SWITCH_MODEL, {"kernels/rf_binding.cpp": RECORD_FUNCTION_SWITCH_BINDING})
    assert evaluator.compile(GELU, ws).ok
    v = evaluator.evaluate(GELU, ws)
    assert_rejected(v, ErrorKind.AUDIT, "strict mode", "at::enableRecordFunction", "recordfunction")


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layout", [("ew_scale_bias_gelu", "cpu_binding"), ("ew_residual_relu_clamp", "cpu_inline")])
def test_honest_torch_bindings_import_no_lookup_and_pass_strict(evaluator: Evaluator, eval_cache: Path, tmp_path: Path,
                                                                layout: tuple[str, str]) -> None:
    """torch's and pybind11's headers pull no run-time lookup or RecordFunction switch into an
    honest binding's object, whether the toolchain or load_inline built it."""
    from cudagym.sandbox.origin import candidate_objects, import_audit
    from conftest import make_workspace, task_of

    task = task_of(layout[0])
    src = Path(__file__).resolve().parent.parent / "examples" / "solutions" / layout[0] / layout[1]
    files = {str(p.relative_to(src)): p.read_text() for p in src.rglob("*") if p.is_file()}
    ws = make_workspace(tmp_path / "ws", task, files.pop("model_new.py"), files)
    built = evaluator.compile(task, ws)
    assert built.ok, built.errors
    v = evaluator.evaluate(task, ws)
    assert v.reward >= 1 and v.audit and v.audit.passed, (v.reward, v.reasons, v.error)
    inline = [p for p in candidate_objects([eval_cache / "build" / "inline"]) if "residual_relu_clamp" in p.name]
    objects = candidate_objects([Path(built.artifact_dir)] if built.artifact_dir else []) + inline
    assert objects if layout[1] == "cpu_binding" else inline, (built.artifact_dir, inline)
    audit = import_audit(objects)
    assert not audit.forbidden, audit.reasons()


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

# Permissive, third-party style: torch prepares the parameter (bias / scale, one small kernel over
# the features), the own kernel does the whole pass over the input, gelu((x + bias / scale) * scale):
# the own kernel carries most of the GPU time (16M elements against 4096), so the share is far
# above permissive mode's threshold and below 1.
PERMISSIVE_MIXED_CU = r"""
#include <cstdint>
#include <cuda_runtime.h>
__global__ void shift_scale_gelu_kernel(const float* x, const float* shift, float* out, int64_t rows, int cols,
                                        float s) {
    const int64_t n = rows * cols;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        float a = (x[i] + shift[static_cast<int>(i % cols)]) * s;
        out[i] = 0.5f * a * (1.0f + erff(a * 0.70710678118654752f));
    }
}
extern "C" int shift_scale_gelu(const float* x, const float* shift, float* out, int64_t rows, int cols, float s,
                                cudaStream_t stream) {
    int64_t n = rows * cols;
    unsigned blocks = static_cast<unsigned>((n + 255) / 256 < 65535 * 8 ? (n + 255) / 256 : 65535 * 8);
    shift_scale_gelu_kernel<<<blocks, 256, 0, stream>>>(x, shift, out, rows, cols, s);
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
_lib.shift_scale_gelu.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int, ctypes.c_float,
                                                          ctypes.c_void_p]
_lib.shift_scale_gelu.restype = ctypes.c_int


def own_shift_scale_gelu(x, shift, scale):
    out = torch.empty_like(x)
    cols = x.size(-1)
    _lib.shift_scale_gelu(ptr(x), ptr(shift), ptr(out), x.numel() // cols, cols, scale, stream())
    return out


class ModelNew(nn.Module):
    def __init__(self, features, scale):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(features) * 0.5)  # Model's draw after the same seed

    def forward(self, x):
        x = x.contiguous()
        shift = self.bias / self.scale  # torch's kernel, over the features only
{tail}
"""
HONEST_TAIL = "        return own_shift_scale_gelu(x, shift, self.scale)\n"
PROFILER_AWARE_TAIL = """\
        if torch.autograd._profiler_enabled():
            return own_shift_scale_gelu(x, shift, self.scale)
        return F.gelu(x * self.scale + self.bias)
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
def test_gpu_torch_images_are_still_named_by_their_file(tmp_path, gpu_ev) -> None:
    """Images nvcc put in a library's read-only bytes keep their file's name (the watcher names
    anything else by digest): torch's fill kernel before the own kernel is torch's allowed copy
    and fill, from libtorch_cuda.so, and the own kernel is libkernels.so's."""
    model = OWN_MODEL.replace("out = torch.empty_like(x)", "out = torch.zeros_like(x)")
    assert model != OWN_MODEL
    task, ws = gpu_ws(tmp_path / "ws", model, {"kernels/scale_bias_gelu.cu": OWN_CU})
    v = gpu_ev.evaluate(task, ws)
    assert v.reward >= 1, v.summary()
    kernels = records_from_counts(v.verify_result.audit.ops_seen)
    fills = [k for k in kernels if "FillFunctor" in k.name]
    assert fills and all(os.path.basename(k.origin).startswith("libtorch_cuda") for k in fills), kernels
    own = [k for k in kernels if "scale_bias_gelu_kernel" in k.name]
    assert own and all(k.origin.endswith("libkernels.so") for k in own), kernels


@pytest.mark.gpu
def test_gpu_permissive_third_party_style_passes_and_profiler_aware_does_not(tmp_path, gpu_permissive) -> None:
    task, ws = gpu_ws(tmp_path / "honest", PERMISSIVE_MIXED.format(tail=HONEST_TAIL),
                      {"kernels/gelu.cu": PERMISSIVE_MIXED_CU})
    honest = gpu_permissive.evaluate(task, ws)
    assert honest.reward >= 1, (honest.reasons, honest.audit)
    share = honest.verify_result.audit.own_kernel_share
    assert share is not None and 0.5 < share < 1, honest.verify_result.audit  # own kernel: most of the time
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



# -- a kernel of torch's registered under a host stub of the candidate's own library ------------
# The candidate registers the fatbin of one of libtorch_cuda's translation units with the CUDA
# runtime itself (__cudaRegisterFatBinary on that unit's wrapper, whose address it computes from
# the library's mapping), names one of torch's kernels in it under a host function of its own
# library (__cudaRegisterFunction), and launches that function with cudaLaunchKernel: the stub is
# the candidate's, the kernel's module image is torch's. Pure CUDA runtime API (no torch headers).
# Its own kernel is launched the same way (cudaLaunchKernel on its own stub), the control for the
# stub path. Strict mode must name torch's kernel, with libtorch_cuda.so, and not the own one.
BORROWED_STUB_CU = r"""
#include <cstdint>
#include <cstring>
#include <cuda_runtime.h>

extern "C" void** __cudaRegisterFatBinary(void* fatCubin);
extern "C" void __cudaRegisterFatBinaryEnd(void** fatCubinHandle);
extern "C" void __cudaRegisterFunction(void** fatCubinHandle, const char* hostFun, char* deviceFun,
                                       const char* deviceName, int thread_limit, uint3* tid, uint3* bid,
                                       dim3* bDim, dim3* gDim, int* wSize);

__global__ void own_scale_bias_gelu(const float* x, const float* bias, float* out, int64_t n, int64_t cols, float s) {
    int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) {
        float a = x[i] * s + bias[i % cols];
        out[i] = 0.5f * a * (1.0f + erff(a * 0.70710678118654752f));
    }
}

// A host function of this library that will stand for a kernel of torch's.
extern "C" __attribute__((noinline)) void stand_in() { __asm__ volatile(""); }

static char kernel_name[2048];

extern "C" int borrow(const void* wrapper, const char* mangled) {
    size_t n = std::strlen(mangled);
    if (n >= sizeof kernel_name) return -1;
    std::memcpy(kernel_name, mangled, n + 1);
    void** handle = __cudaRegisterFatBinary(const_cast<void*>(wrapper));
    __cudaRegisterFunction(handle, reinterpret_cast<const char*>(&stand_in), kernel_name, kernel_name, -1,
                           nullptr, nullptr, nullptr, nullptr, nullptr);
    __cudaRegisterFatBinaryEnd(handle);
    cudaFuncAttributes attr;
    return static_cast<int>(cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(&stand_in)));
}

extern "C" int launch_own(const float* x, const float* bias, float* out, int64_t rows, int64_t cols, float scale,
                          cudaStream_t stream) {
    int64_t n = rows * cols;
    void* args[] = {&x, &bias, &out, &n, &cols, &scale};
    return static_cast<int>(cudaLaunchKernel(reinterpret_cast<const void*>(&own_scale_bias_gelu),
                                             dim3(static_cast<unsigned>((n + 255) / 256)), dim3(256), args, 0, stream));
}

// torch's softmax forward kernel: (out, in, classes), one block per row.
extern "C" int launch_borrowed(float* dst, const float* src, int64_t classes, int index64, unsigned rows,
                               unsigned block, unsigned smem, cudaStream_t stream) {
    int c32 = static_cast<int>(classes);
    void* args[] = {&dst, &src, index64 ? static_cast<void*>(&classes) : static_cast<void*>(&c32)};
    return static_cast<int>(cudaLaunchKernel(reinterpret_cast<const void*>(&stand_in), dim3(rows), dim3(block), args,
                                             smem, stream));
}
"""
BORROWED_STUB_MODEL = """\
import ctypes
import torch
import torch.nn as nn
from cudagym.runtime import kernel_library, ptr, stream

BORROW = {borrow!r}  # wrapper: offset of the unit's fatbin wrapper in libtorch_cuda.so; name; index64

_lib = kernel_library()
_lib.borrow.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_lib.launch_own.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_void_p]
_lib.launch_borrowed.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int] + [ctypes.c_uint] * 3 + [
    ctypes.c_void_p]


def _torch_cuda_base():
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[-1].endswith("/libtorch_cuda.so") and int(parts[2], 16) == 0:
                return int(parts[0].split("-")[0], 16)
    raise RuntimeError("libtorch_cuda.so is not mapped")


class ModelNew(nn.Module):
    def __init__(self, features, scale):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(features) * 0.5)  # Model's draw after the same seed
        self._registered = False

    def forward(self, x):
        if BORROW and not self._registered:
            rc = _lib.borrow(_torch_cuda_base() + BORROW["wrapper"], BORROW["name"].encode())
            if rc:
                raise RuntimeError(f"registration failed: {{rc}}")
            self._registered = True
        x = x.contiguous()
        out = torch.empty_like(x)
        cols = x.size(-1)
        err = _lib.launch_own(ptr(x), ptr(self.bias), ptr(out), x.numel() // cols, cols, self.scale, stream())
        if err:
            raise RuntimeError(f"own launch failed: {{err}}")
        if BORROW:
            src = torch.zeros(8, 256, device=x.device)
            dst = torch.empty_like(src)
            err = _lib.launch_borrowed(ptr(dst), ptr(src), 256, BORROW["index64"], 8, 128, 16384, stream())
            if err:
                raise RuntimeError(f"borrowed launch failed: {{err}}")
        return out
"""


def torch_softmax_kernel() -> dict:
    """A softmax forward kernel of libtorch_cuda.so's (out, in, classes) and its translation unit's
    fatbin wrapper, from the library's symbol table: {"wrapper": offset, "name": mangled, "index64"}."""
    import re
    import subprocess

    import torch

    lib = Path(torch.__file__).parent / "lib" / "libtorch_cuda.so"
    listing = subprocess.run(f"readelf -sW '{lib}' | grep -E ' FILE |fatDeviceText|SoftMaxForward'", shell=True,
                             capture_output=True, text=True, timeout=600).stdout
    unit, wrappers, kernels = None, {}, []
    for line in listing.splitlines():
        p = line.split()
        if len(p) < 8:
            continue
        if p[3] == "FILE":
            unit = p[7]
        elif "fatDeviceText" in p[7]:  # the unit's static wrapper (`_ZL15__fatDeviceText` once mangled)
            wrappers.setdefault(unit, int(p[1], 16))
        elif p[3] == "FUNC" and not p[7].startswith("__device_stub"):
            kernels.append((p[7], unit))
    names = subprocess.run(["c++filt"], input="\n".join(k for k, _ in kernels), capture_output=True, text=True,
                           timeout=120).stdout.splitlines()
    found = {}
    for (mangled, unit), name in zip(kernels, names):
        m = re.search(r"::cunn_SoftMaxForward(Reg)?<float, float, float, .*"
                      r"\(float\*, float const\*, (int|long)\)$", name)
        if m and unit in wrappers:
            found.setdefault(bool(m.group(1)), {"wrapper": wrappers[unit], "name": mangled,
                                                "index64": int(m.group(2) == "long")})
    if not found:
        pytest.skip("no softmax forward kernel with its unit's fatbin wrapper in libtorch_cuda.so's symbol table")
    return found.get(False) or found[True]


@pytest.mark.gpu
def test_gpu_torch_kernel_registered_under_an_own_stub_is_foreign(tmp_path, gpu_ev) -> None:
    """A kernel's origin is the file its module image came from, never its launching stub's."""
    task, ws = gpu_ws(tmp_path / "control", BORROWED_STUB_MODEL.format(borrow={}),
                      {"kernels/stub.cu": BORROWED_STUB_CU})
    c = gpu_ev.compile(task, ws)
    assert c.ok, c.errors
    control = gpu_ev.evaluate(task, ws)
    assert control.reward >= 1, control.summary()
    kernels = records_from_counts(control.verify_result.audit.ops_seen)
    assert kernels and all(k.origin.endswith("libkernels.so") for k in kernels), kernels  # the own stub: own

    task, ws = gpu_ws(tmp_path / "borrowed", BORROWED_STUB_MODEL.format(borrow=torch_softmax_kernel()),
                      {"kernels/stub.cu": BORROWED_STUB_CU})
    v = gpu_ev.evaluate(task, ws)
    if v.error_kind == ErrorKind.EXCEPTION and "registration failed" in (v.error or ""):
        # torch 2.11 / CUDA 13 on an H100 refused the borrowed fatbin's registration (error 500,
        # 2026-11-26): the attack cannot be mounted there, and it gains nothing
        assert v.reward < 0, v.summary()
        return
    assert_rejected(v, ErrorKind.AUDIT, "strict mode", "not your own", "libtorch_cuda.so", "softmax")
    assert not any("own_scale_bias_gelu" in f for f in v.audit.forbidden_ops), v.audit.forbidden_ops
