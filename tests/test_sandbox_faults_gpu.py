"""GPU faults (run on a machine with an NVIDIA GPU: `python -m pytest -m gpu`).

- A kernel that never ends gets a `timeout` within the job's limit + GRACE_S; its process leaves
  the GPU, and the next timing job on that GPU is timed as usual (not `device_busy`).
- The evaluator's process killed (SIGKILL) mid-job leaves no process of its own on the GPU.
- A foreign process spinning on the GPU during a timing job: `device_busy`, no time reported.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.core.verdict import ErrorKind
from cudagym.sandbox.config import LocalSandboxConfig
from cudagym.sandbox.local import LocalSandbox
from cudagym.sandbox.protocol import LimitsConfig
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import bundled_task

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parent.parent
SOLUTIONS = REPO / "examples" / "solutions"
HONEST = "ew_scale_bias_gelu"
LIMIT_S = 20.0
GRACE_S = 15.0  # measured on an H100: the verdict 0.1 s after the limit, the GPU clean within 1 s

SPIN_CU = r"""
#include <cuda_runtime.h>
__global__ void spin(volatile int* flag) { while (flag[0] == 0) {} }
extern "C" int launch(int* flag, void* s) {
    spin<<<1024, 256, 0, (cudaStream_t)s>>>(flag);
    return (int)cudaGetLastError();
}
"""
SPIN_PY = """
import ctypes, torch, torch.nn as nn
from cudagym.runtime import kernel_library, ptr, stream
_lib = kernel_library()
_lib.launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]

class ModelNew(nn.Module):
    def __init__(self, features, scale):
        super().__init__()
        self.bias = nn.Parameter(torch.empty(features))

    def forward(self, x):
        flag = torch.zeros(1, dtype=torch.int32, device=x.device)
        _lib.launch(ptr(flag), stream())
        torch.cuda.synchronize()
        return x
"""


def nvml() -> tuple[list[int], int]:
    """The pids of GPU 0's compute processes and its utilization (%)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return ([int(p.pid) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)],
                int(pynvml.nvmlDeviceGetUtilizationRates(h).gpu))
    finally:
        pynvml.nvmlShutdown()


def wait_for(cond, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.25)
    return cond()


def workspace(tmp_path: Path, spin: bool) -> tuple:
    task = bundled_task(HONEST).for_target("cuda")
    ws = Workspace.from_solution(tmp_path / ("spin" if spin else "honest"), task, SOLUTIONS / HONEST / "cuda")
    if spin:
        ws.write("model_new.py", SPIN_PY)
        for p in (ws.root / "kernels").glob("*"):
            p.unlink()
        ws.write("kernels/spin.cu", SPIN_CU)
    return task, ws


def test_a_spinning_kernel_times_out_leaves_the_gpu_and_the_next_timing_is_clean(tmp_path):
    cfg = EvaluatorConfig(target="cuda", cache_dir=tmp_path / "cache", compile_baseline=False,
                          limits=LimitsConfig(timeout_s=LIMIT_S))
    ev = Evaluator(cfg)
    try:
        # warm first: the limit counts from the worker's ready frame, so a cold evaluator's start-up
        # (CUDA context, spares: 0-5 s on an H100) would sit in the measured time and not in the job's
        task, honest = workspace(tmp_path, spin=False)
        assert ev.verify(task, honest).correct
        task, ws = workspace(tmp_path, spin=True)
        assert ev.compile(task, ws).ok
        t0 = time.perf_counter()
        v = ev.verify(task, ws)
        took = time.perf_counter() - t0
        assert v.error_kind == ErrorKind.TIMEOUT, v
        assert took < LIMIT_S + GRACE_S, f"the verdict came {took:.1f} s after the job started"
        def clean() -> bool:  # the killed worker is off the GPU, no kernel runs (spares hold idle contexts)
            pids, util = nvml()
            ours = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}  # this test's own context
            return util == 0 and set(pids) <= ours

        assert wait_for(clean, GRACE_S), nvml()
        p = ev.profile(task, honest)
        assert p.ok and p.candidate is not None, p
    finally:
        ev.close()
    # nothing of the evaluator's left on the GPU (this test process's own context, where in-process
    # GPU tests ran before it in the same session, is not the evaluator's)
    assert wait_for(lambda: set(nvml()[0]) <= {os.getpid()}, GRACE_S), f"left: {nvml()} (test: {os.getpid()})"


EVALUATOR_SCRIPT = """\
import sys
from pathlib import Path
from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.sandbox.protocol import LimitsConfig
sys.path.insert(0, sys.argv[2])
from test_sandbox_faults_gpu import workspace

ev = Evaluator(EvaluatorConfig(target="cuda", cache_dir=Path(sys.argv[1]) / "cache", compile_baseline=False,
                               limits=LimitsConfig(timeout_s=600)))
task, ws = workspace(Path(sys.argv[1]), spin=True)
ev.compile(task, ws)
ev.verify(task, ws)
"""


def test_an_evaluator_killed_mid_job_leaves_nothing_on_the_gpu(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", EVALUATOR_SCRIPT, str(tmp_path), str(Path(__file__).parent)],
                            env={**os.environ,
                                 "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
                            start_new_session=True)
    try:
        assert wait_for(lambda: proc.poll() is None and nvml()[1] == 100, 240), (proc.poll(), nvml())
        ours = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        on_gpu = set(nvml()[0]) & set(ours)
        assert on_gpu, (nvml(), ours)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert wait_for(lambda: not set(nvml()[0]) & set(ours) and nvml()[1] == 0, 30), \
            f"left on the GPU after the evaluator was killed: {nvml()}"
        alive = [pid for pid in ours if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        assert not alive, alive
    finally:
        if proc.poll() is None:
            proc.kill()


FOREIGN = """\
import torch
torch.cuda.init()
print("spinning", flush=True)
while True:
    torch.cuda._sleep(1_000_000_000)
    torch.cuda.synchronize()
"""


def test_a_foreign_process_on_the_gpu_fails_the_timing_with_device_busy(tmp_path):
    foreign = subprocess.Popen([sys.executable, "-c", FOREIGN], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert foreign.stdout is not None and foreign.stdout.readline().strip() == b"spinning"
        assert wait_for(lambda: foreign.pid in nvml()[0], 60), nvml()
        sandbox = LocalSandbox(LocalSandboxConfig(device_busy_wait_s=3.0), home=tmp_path / "home")
        ev = Evaluator(EvaluatorConfig(target="cuda", cache_dir=tmp_path / "cache", compile_baseline=False),
                       sandbox=sandbox)
        try:
            task, ws = workspace(tmp_path, spin=False)
            p = ev.profile(task, ws)
        finally:
            ev.close()
        assert not p.ok and p.candidate is None, p
        assert "device_busy" in (p.error or ""), p.error
        assert f"pid {foreign.pid}" in (p.error or ""), p.error
    finally:
        foreign.kill()
        foreign.wait()
