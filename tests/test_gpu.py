"""GPU tests (run on a machine with an NVIDIA GPU: `python -m pytest -m gpu`)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.core.verdict import ErrorKind
from cudagym.sandbox.timing import MAX_OVERHEAD_NS
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import bundled_task, bundled_task_ids

from test_reward_integrity import FORGE_TIMES, REBIND_REFERENCE

pytestmark = pytest.mark.gpu
SOLUTIONS = Path(__file__).resolve().parent.parent / "examples" / "solutions"
HONEST = "ew_scale_bias_gelu"


@pytest.fixture(scope="module")
def ev(tmp_path_factory):
    cfg = EvaluatorConfig(target="cuda", cache_dir=tmp_path_factory.mktemp("cache"), compile_baseline=False)
    with Evaluator(cfg) as e:
        yield e


def workspace(tmp_path: Path, task_id: str, solution: str | Path, evaluator: Evaluator) -> tuple:
    task = bundled_task(task_id).for_target(evaluator.target)
    return task, Workspace.from_solution(tmp_path / "ws", task, SOLUTIONS / task_id / solution)


def hacked(tmp_path: Path, evaluator: Evaluator, model_new: str, cu: str | None = None) -> tuple:
    """The honest ew_scale_bias_gelu workspace with model_new.py (and the kernel) replaced."""
    task, ws = workspace(tmp_path, HONEST, "cuda", evaluator)
    ws.write("model_new.py", model_new)
    if cu is not None:
        for p in (ws.root / "kernels").glob("*"):
            p.unlink()
        ws.write("kernels/hack.cu", cu)
    return task, ws


HEADER = '''
import ctypes, torch, torch.nn as nn, torch.nn.functional as F
from cudagym.runtime import kernel_library, ptr, stream

class ModelNew(nn.Module):
    def __init__(self, features, scale):
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(features) * 0.5)  # as Model draws it
'''


@pytest.mark.parametrize("task_id", bundled_task_ids())
def test_honest_cuda_solution_accepted(tmp_path, ev, task_id):
    task, ws = workspace(tmp_path, task_id, "cuda", ev)
    v = ev.evaluate(task, ws)
    assert v.reward >= 1, v.summary()
    assert v.candidate_ms and v.eager_ms
    assert v.profile_result.telemetry["before"].get("gpu_name"), v.profile_result.telemetry
    # the timer's own overhead was measured (before any candidate code) and left out
    assert 0 < (v.profile_result.harness_overhead_ns or 0) < MAX_OVERHEAD_NS, v.profile_result
    assert v.profile_result.close_timeouts == 0


def test_torch_ops_rejected_on_gpu(tmp_path, ev):
    task, ws = hacked(tmp_path, ev,
                      HEADER + "    def forward(self, x):\n        return F.gelu(x * self.scale + self.bias)\n")
    v = ev.evaluate(task, ws)
    assert v.reward < 0 and v.error_kind == ErrorKind.AUDIT
    assert any("aten::gelu" in r for r in v.reasons)


def test_stale_gpu_memory_rejected(tmp_path, ev):
    task, ws = hacked(tmp_path, ev, HEADER + "    def forward(self, x):\n        return torch.empty_like(x)\n")
    v = ev.evaluate(task, ws)
    assert v.reward < 0 and v.error_kind == ErrorKind.MISMATCH, v.summary()


SIDE_STREAM_CU = r'''
#include <cstdint>
#include <cuda_runtime.h>
__global__ void slow_gelu(const float* x, const float* bias, float* out, int64_t n, int64_t cols, float scale) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    long long t0 = clock64();
    while (clock64() - t0 < 20000000) {}  // ~10 ms: finish well after forward returns
    if (i < n) { float v = x[i] * scale + bias[i % cols]; out[i] = 0.5f * v * (1.0f + erff(v * 0.70710678f)); }
}
extern "C" int launch(const float* x, const float* bias, float* out, int64_t rows, int64_t cols, float scale) {
    static cudaStream_t side = nullptr;
    if (!side) cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
    int64_t n = rows * cols;
    slow_gelu<<<(unsigned)((n + 255) / 256), 256, 0, side>>>(x, bias, out, n, cols, scale);
    return (int)cudaGetLastError();
}
'''
SIDE_STREAM_PY = HEADER + '''
_lib = kernel_library()
_lib.launch.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]

def _forward(self, x):
    out = torch.empty_like(x)
    _lib.launch(ptr(x), ptr(self.bias), ptr(out), x.size(0), x.size(1), self.scale)
    return out  # the caller's stream is never joined with the side stream
ModelNew.forward = _forward
'''


def test_side_stream_work_rejected(tmp_path, ev):
    task, ws = hacked(tmp_path, ev, SIDE_STREAM_PY, SIDE_STREAM_CU)
    v = ev.evaluate(task, ws)
    assert v.reward < 0, v.summary()
    assert v.error_kind in (ErrorKind.MISMATCH, ErrorKind.AUDIT), v.summary()


IMA_CU = r'''
#include <cstdint>
#include <cuda_runtime.h>
__global__ void bad(float* out, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i + (1LL << 40)] = 1.0f;  // far outside any allocation
}
extern "C" int launch(float* out, int64_t n, void* s) {
    bad<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)s>>>(out, n);
    return (int)cudaGetLastError();
}
'''
IMA_PY = HEADER + '''
_lib = kernel_library()
_lib.launch.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]

def _forward(self, x):
    out = torch.empty_like(x)
    _lib.launch(ptr(out), out.numel(), stream())
    return out
ModelNew.forward = _forward
'''


TIMED_CU = r"""
#include <cstdint>
#include <cuda_runtime.h>
__global__ void gelu(const float* x, const float* bias, float* out, int64_t n, int64_t cols, float scale) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float v = x[i] * scale + bias[i % cols]; out[i] = 0.5f * v * (1.0f + erff(v * 0.70710678f)); }
}
__global__ void spin(long long cycles) { long long t0 = clock64(); while (clock64() - t0 < cycles) {} }
extern "C" int launch(const float* x, const float* bias, float* out, int64_t rows, int64_t cols, float scale,
                      void* s, long long side_cycles) {
    int64_t n = rows * cols;
    gelu<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)s>>>(x, bias, out, n, cols, scale);
    if (side_cycles > 0) {  // busy work on a side stream the caller's stream never waits for
        static cudaStream_t side = nullptr;
        if (!side) cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
        spin<<<1, 1, 0, side>>>(side_cycles);
    }
    return (int)cudaGetLastError();
}
"""
TIMED_PY = HEADER + """
import time
_lib = kernel_library()
_lib.launch.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
                        + [ctypes.c_float, ctypes.c_void_p, ctypes.c_longlong])

def _forward(self, x):
    out = torch.empty_like(x)
    _lib.launch(ptr(x), ptr(self.bias), ptr(out), x.size(0), x.size(1), self.scale, stream(), SIDE_CYCLES)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < HOST_S:  # work on the host after the launch
        pass
    return out
ModelNew.forward = _forward
"""


@pytest.mark.parametrize("side_cycles,host_s", [(4_000_000, 0.0), (0, 0.002)], ids=["side-stream", "host"])
def test_timing_counts_work_on_side_streams_and_on_the_host(tmp_path, ev, side_cycles, host_s):
    """Correct outputs on the caller's stream, plus about 2 ms of other work per call: a kernel
    spinning on a side stream nobody waits for, or a busy loop on the host after the launch.
    Either is inside the timed interval (the honest kernel alone takes well under 0.2 ms)."""
    code = TIMED_PY.replace("SIDE_CYCLES", str(side_cycles)).replace("HOST_S", str(host_s))
    task, ws = hacked(tmp_path, ev, code, TIMED_CU)
    v = ev.evaluate(task, ws)
    assert v.correct, v.summary()
    assert v.candidate_ms > 1.0, v.summary()


EARLY_CU = r"""
#include <cstdint>
#include <cuda_runtime.h>
__global__ void gelu(const float* x, const float* bias, float* out, int64_t n, int64_t cols, float scale) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float v = x[i] * scale + bias[i % cols]; out[i] = 0.5f * v * (1.0f + erff(v * 0.70710678f)); }
}
__global__ void wait_ns(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
extern "C" int launch(const float* x, const float* bias, float* out, int64_t rows, int64_t cols, float scale,
                      void* s) {
    // all of the call's work on a side stream that does not wait for the caller's stream (the
    // caller's stream waits for it at the end): 150 us of waiting, then the result
    static cudaStream_t side = nullptr;
    static cudaEvent_t done = nullptr;
    if (!side) {
        cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
        cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    }
    int64_t n = rows * cols;
    wait_ns<<<1, 1, 0, side>>>(150000ull);
    gelu<<<(unsigned)((n + 255) / 256), 256, 0, side>>>(x, bias, out, n, cols, scale);
    cudaEventRecord(done, side);
    cudaStreamWaitEvent((cudaStream_t)s, done, 0);
    return (int)cudaGetLastError();
}
"""
EARLY_PY = HEADER + """
_lib = kernel_library()
_lib.launch.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_void_p]

def _forward(self, x):
    out = torch.empty_like(x)
    _lib.launch(ptr(x), ptr(self.bias), ptr(out), x.size(0), x.size(1), self.scale, stream())
    return out
ModelNew.forward = _forward
"""


def test_side_stream_work_cannot_start_inside_the_launch_window(tmp_path, ev):
    """The call's work is launched while the timer's launch window runs, on a stream that does
    not wait for the caller's stream (which waits for it). If the window left SMs free, the
    150 us wait would be over before the call's time starts."""
    task, ws = hacked(tmp_path, ev, EARLY_PY, EARLY_CU)
    v = ev.evaluate(task, ws)
    assert v.correct, v.summary()
    assert v.candidate_ms > 0.15, v.summary()



TINY_RELU = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(16, 1024)]


def get_init_inputs():
    return []
"""
TINY_HEADER = """
import ctypes, torch, torch.nn as nn
from cudagym.runtime import kernel_library, ptr, stream

_lib = kernel_library()
_lib.launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]

class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        _lib.launch(ptr(x), ptr(out), x.numel(), stream())
        return out
"""
TINY_HONEST_CU = r"""
#include <cstdint>
#include <cuda_runtime.h>
__global__ void relu(const float* x, float* out, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = fmaxf(x[i], 0.0f);
}
extern "C" int launch(const float* x, float* out, int64_t n, void* s) {
    relu<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)s>>>(x, out, n);
    return (int)cudaGetLastError();
}
"""
TINY_HOST_CU = r"""
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>
// no kernel: the input is read by a copy engine on a side stream that waits for nothing (so
// during the timer's launch window), the answer computed on the host and copied back the same
// way, all before forward returns
extern "C" int launch(const float* x, float* out, int64_t n, void*) {
    static cudaStream_t side = nullptr;
    if (!side) cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
    static std::vector<float> host;
    host.resize(n);
    cudaMemcpyAsync(host.data(), x, n * sizeof(float), cudaMemcpyDeviceToHost, side);
    cudaStreamSynchronize(side);
    for (int64_t i = 0; i < n; ++i) host[i] = host[i] > 0.0f ? host[i] : 0.0f;
    cudaMemcpyAsync(out, host.data(), n * sizeof(float), cudaMemcpyHostToDevice, side);
    cudaStreamSynchronize(side);
    return (int)cudaGetLastError();
}
"""


def test_host_work_inside_the_launch_window_sees_no_inputs(tmp_path, ev):
    """Host work is hidden up to the launch window, but the call's inputs take their values only
    at its end: a solution that copies its input out during the window, computes on the host
    and copies the answer in computed it from an earlier call's values (MISMATCH); run any
    later, it is timed. The honest kernel of the same task is accepted."""
    from cudagym.tasks.model import Task

    task = Task(id="tiny_relu", code=TINY_RELU, source="test", dtype="float32").for_target(ev.target)
    results = {}
    for name, cu in (("honest", TINY_HONEST_CU), ("host", TINY_HOST_CU)):
        ws = Workspace.create(tmp_path / name, task, model_new=TINY_HEADER)
        ws.write("kernels/relu.cu", cu)
        results[name] = ev.evaluate(task, ws)
    honest, host = results["honest"], results["host"]
    assert honest.correct and honest.reward >= 1, honest.summary()
    assert host.reward < honest.reward, host.summary()
    assert host.error_kind == ErrorKind.MISMATCH, host.summary()


TAIL_CU = TIMED_CU.split("__global__ void spin")[0] + r"""
extern "C" int launch(const float* x, const float* bias, float* scratch, float* out, int64_t rows, int64_t cols,
                      float scale, void* s) {
    // the result is computed on the caller's stream, then copied into the output by a copy
    // engine on a side stream the caller's stream never waits for
    static cudaStream_t side = nullptr;
    static cudaEvent_t done = nullptr;
    if (!side) {
        cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
        cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    }
    int64_t n = rows * cols;
    gelu<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)s>>>(x, bias, scratch, n, cols, scale);
    cudaEventRecord(done, (cudaStream_t)s);
    cudaStreamWaitEvent(side, done, 0);
    cudaMemcpyAsync(out, scratch, n * sizeof(float), cudaMemcpyDeviceToDevice, side);
    return (int)cudaGetLastError();
}
"""
TAIL_PY = HEADER + """
_lib = kernel_library()
_lib.launch.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_void_p]

def _forward(self, x):
    scratch, out = torch.empty_like(x), torch.empty_like(x)
    _lib.launch(ptr(x), ptr(self.bias), ptr(scratch), ptr(out), x.size(0), x.size(1), self.scale, stream())
    return out
ModelNew.forward = _forward
"""


def test_a_copy_on_an_unjoined_stream_after_the_call_is_caught_or_timed(tmp_path, ev):
    """A copy engine is not an SM, so the close kernel does not wait for it. The re-checked
    outputs are sampled right after the end event: a copy still running there is a mismatch. A
    driver that copies with a kernel instead gets the copy timed."""
    task, honest = workspace(tmp_path / "honest", HONEST, "cuda", ev)
    honest_ms = ev.evaluate(task, honest).candidate_ms
    task, ws = hacked(tmp_path, ev, TAIL_PY, TAIL_CU)
    v = ev.evaluate(task, ws)
    if v.reward < 0:
        assert v.error_kind == ErrorKind.MISMATCH, v.summary()
    else:
        assert v.candidate_ms > 1.3 * honest_ms, (honest_ms, v.summary())


def test_illegal_memory_access_then_next_check_succeeds(tmp_path, ev):
    task, ws = hacked(tmp_path, ev, IMA_PY, IMA_CU)
    v = ev.evaluate(task, ws)
    assert v.reward < 0 and v.error_kind == ErrorKind.CRASH, v.summary()
    assert "illegal memory access" in (v.error or "").lower() or "cuda error" in (v.error or "").lower()
    task, ws2 = workspace(tmp_path / "next", HONEST, "cuda", ev)
    assert ev.evaluate(task, ws2).reward >= 1


def test_implausible_time_flagged(tmp_path):
    cfg = EvaluatorConfig(target="cuda", cache_dir=tmp_path / "cache", compile_baseline=False, roofline_slack=1e6)
    with Evaluator(cfg) as e:
        task, ws = workspace(tmp_path, HONEST, "cuda", e)
        v = e.evaluate(task, ws)
    assert v.reward < 0 and v.error_kind == ErrorKind.IMPLAUSIBLE, v.summary()


def test_permissive_mode_coverage(tmp_path):
    cfg = EvaluatorConfig(target="cuda", cache_dir=tmp_path / "cache", compile_baseline=False, mode="permissive")
    with Evaluator(cfg) as e:
        task, ws = workspace(tmp_path, HONEST, "cuda", e)
        ok = e.verify(task, ws)
        assert ok.ok and ok.audit.own_kernel_share > 0.5, ok
        # decoy: the kernel is loaded but never launched; torch does the work
        decoy = HEADER + ("_lib = kernel_library()\n    def forward(self, x):\n"
                          "        return F.gelu(x * self.scale + self.bias)\n")
        decoy = HEADER + ("    def forward(self, x):\n        _ = kernel_library()\n"
                          "        return F.gelu(x * self.scale + self.bias)\n")
        task, ws2 = workspace(tmp_path / "d", HONEST, "cuda", e)
        ws2.write("model_new.py", decoy)
        bad = e.verify(task, ws2)
    assert not bad.ok and bad.error_kind == ErrorKind.AUDIT, bad


def test_l2_flush_makes_cached_reads_cold():
    import torch

    from cudagym.sandbox.timing import DeviceTimer

    x = torch.randn(4 * 2**20, device="cuda")  # 16 MiB: fits the L2 of an H100
    fn = lambda a: a.sum()  # noqa: E731

    def median_ms(timer: DeviceTimer) -> float:
        for _ in range(5):
            timer.call(fn, [x])
        return sorted(timer.call(fn, [x])[1] for _ in range(30))[15]

    hot_ms = median_ms(DeviceTimer(torch.device("cuda"), flush_l2=False))
    cold_ms = median_ms(DeviceTimer(torch.device("cuda"), flush_l2=True))
    assert cold_ms > hot_ms, (cold_ms, hot_ms)


def test_ncu_summary_holds_only_the_candidates_kernels(tmp_path, ev):
    """Nsight Compute records the candidate's calls only: not the inputs' random generation, nor
    the copies the harness makes around the calls."""
    import shutil

    from cudagym.sandbox.ncu import CALLS

    if shutil.which("ncu") is None:
        pytest.skip("ncu is not installed on this GPU machine")
    task, ws = workspace(tmp_path, HONEST, "cuda", ev)
    p = ev.profile(task, ws, ncu=True)
    assert p.ok and p.ncu and "error" not in p.ncu, p.ncu
    assert [k["launches"] for k in p.ncu["kernels"]] == [CALLS], p.ncu["kernels"]  # the one fused kernel
    assert "gelu" in p.ncu["kernels"][0]["kernel"].lower(), p.ncu["kernels"]


@pytest.mark.parametrize("task_id,fmt", [("ew_scale_bias_gelu", "cuda_binding"),
                                         ("ew_residual_relu_clamp", "cuda_inline")])
def test_other_candidate_formats_accepted(tmp_path, ev, task_id, fmt):
    task, ws = workspace(tmp_path, task_id, fmt, ev)
    c = ev.compile(task, ws)
    assert c.ok, c.errors
    v = ev.evaluate(task, ws)
    assert v.reward >= 1, v.summary()


# -- reward integrity on the GPU: attacks that keep the GPU busy -------------------------------
# The candidate's own busy kernel (`own_spin=True` in `busy_model`; kernels/spin.cu): a spin of
# `cycles` SM clock cycles on the current stream, as torch.cuda._sleep does with torch's kernel
# (which strict mode's origin audit rightly calls foreign).
SPIN_CU = r"""
#include <cuda_runtime.h>
__global__ void own_spin_kernel(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}
extern "C" int own_spin(long long cycles, cudaStream_t stream) {
    own_spin_kernel<<<1, 1, 0, stream>>>(cycles);
    return (int)cudaGetLastError();
}
"""


def busy_model(attack: str, answer: str, cycles: int, own_spin: bool = False) -> str:
    """The honest solution, plus `attack` run once timed (no verify recorder on the mode stack),
    after which each call keeps the GPU busy `cycles` and returns `answer` (`out`: the honest
    output). The busy work is torch's `_sleep` kernel, or with `own_spin` the candidate's own
    (`SPIN_CU`, to be written to kernels/spin.cu)."""
    honest = (SOLUTIONS / HONEST / "cuda" / "model_new.py").read_text().replace("class ModelNew(", "class _Honest(")
    if own_spin:
        honest += ("\n_lib.own_spin.argtypes = [ctypes.c_longlong, ctypes.c_void_p]\n"
                   "_lib.own_spin.restype = ctypes.c_int\n")
    spin = f"_lib.own_spin({cycles}, stream())" if own_spin else f"torch.cuda._sleep({cycles})"
    return honest + f"""

class ModelNew(_Honest):
    def forward(self, x):
        from torch.utils._python_dispatch import _len_torch_dispatch_stack
        timed = _len_torch_dispatch_stack() == 0
        if timed and not getattr(self, "_armed", False):
            self._armed = True
{textwrap.indent(textwrap.dedent(attack), " " * 12)}
        out = _Honest.forward(self, x)
        if not timed:
            return out
        {spin}
{textwrap.indent(textwrap.dedent(answer), " " * 8)}
"""


def test_rebinding_the_reference_once_timed_is_caught_on_the_gpu(tmp_path, ev):
    attack = REBIND_REFERENCE
    task, ws = workspace(tmp_path, HONEST, "cuda", ev)
    ws.write("model_new.py", busy_model(attack, "return torch.zeros_like(x)", 200_000))
    v = ev.evaluate(task, ws)
    assert v.reward < 0 and v.error_kind in (ErrorKind.MISMATCH, ErrorKind.TAMPER, ErrorKind.AUDIT), v.summary()


def test_forged_call_times_with_blinded_identity_checks_are_caught_on_the_gpu(tmp_path, ev):
    """A tenth of each call's time reported, the identity snapshot made to agree, and the GPU kept
    busy ~2 ms per call by the candidate's own spin kernel (strict mode's origin audit passes it:
    only the times are forged): only the parent's clock disagrees."""
    attack = FORGE_TIMES
    task, ws = workspace(tmp_path, HONEST, "cuda", ev)
    ws.write("kernels/spin.cu", SPIN_CU)
    ws.write("model_new.py", busy_model(attack, "return out", 4_000_000, own_spin=True))
    v = ev.evaluate(task, ws)
    assert v.reward < 0 and v.error_kind == ErrorKind.TAMPER, v.summary()
    assert "own clock" in " ".join(v.reasons), v.reasons


def test_the_close_kernel_reads_every_layout_of_output_as_indexing_does():
    """`read_at_end` on a GPU: the close kernel's positions, strides and element sizes agree with
    torch's own indexing, for contiguous, strided, offset, broadcast, many-dimensional and small
    outputs of several dtypes."""
    from cudagym.sandbox.timing import MAX_SAMPLED_OUTPUTS, DeviceTimer

    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(512, 384, device="cuda", generator=g)
    outputs = [
        big,                                              # contiguous
        big.t().half(),                                   # transposed fp16 copy: contiguous
        big.t(),                                          # transposed view
        big[7:, 3::2],                                    # offset and strided
        torch.randn(1, 384, device="cuda", generator=g).expand(640, 384),  # stride 0
        (big > 0)[:40],                                   # bool
        torch.randn(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, device="cuda", generator=g).transpose(0, 10),  # 11 dims
        torch.arange(300, device="cuda", dtype=torch.int64).view(20, 15).t(),  # small: read whole
        torch.randn(64, 64, device="cuda", generator=g, dtype=torch.complex64)[:, ::3],
    ]
    outputs += [big[i:] for i in range(MAX_SAMPLED_OUTPUTS)]  # past the close kernel's slots
    timer = DeviceTimer(torch.device("cuda"))
    read: list = []
    timer.call(lambda: outputs, [], lambda outs: read.extend(timer.read_at_end(o) for o in outs))
    assert len(read) == len(outputs)
    for i, (o, (values, positions, *_)) in enumerate(zip(outputs, read)):
        if i < MAX_SAMPLED_OUTPUTS:  # what the close kernel read is copied to host memory at its end
            assert values.device.type == "cpu" and (positions is None or positions.device.type == "cpu")
        values, o = values.cpu(), o.cpu()
        if positions is None:
            assert values.shape == o.shape and torch.equal(values, o)
        else:
            positions = positions.cpu()
            assert int(positions.min()) >= 0 and int(positions.max()) < o.numel()
            assert len(set(positions.tolist())) > len(positions) // 2  # drawn, not constant
            assert torch.equal(values, o.reshape(-1)[positions]), o.shape
