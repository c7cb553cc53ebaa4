"""Candidates that crash, hang, exhaust memory or processes, or escape their workspace: each gets an
error verdict of the right kind, and the same evaluator then still rewards an honest solution.
Malformed submissions get a clear error and reward -1."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from cudagym.rewards.evaluator import Evaluator
from cudagym.core.verdict import ErrorKind, Verdict
from cudagym.sandbox.limits import JobCgroup
from cudagym.sandbox.protocol import LimitsConfig

from conftest import SOLUTIONS, backend_config, cpu_config, solution_workspace, task_of

TASK = task_of("red_row_sum")
BACKEND_FIXTURES = ("limited",)  # local; docker too for the tests marked both_backends (conftest)

HEADER = """\
import ctypes
import torch
import torch.nn as nn
from cudagym.runtime import kernel_library, ptr

_lib = kernel_library()


class ModelNew(nn.Module):
    def forward(self, x):
"""
NOOP_CPP = 'extern "C" void noop() {}\n'


@pytest.fixture(scope="module")
def limited(request: pytest.FixtureRequest, eval_cache: Path):
    """An evaluator with tight limits: the hang must be killed quickly, the allocation bounded;
    on each sandbox backend (local processes, docker containers)."""
    ev = Evaluator(backend_config(request.param, eval_cache,
                                  limits=LimitsConfig(timeout_s=60, memory_mb=1536, max_processes=64)))
    try:
        yield ev
    finally:
        ev.close()


def candidate(build_ws, forward_body: str, kernels: dict[str, str] | None = None):
    body = "\n".join("        " + line if line.strip() else "" for line in forward_body.strip("\n").splitlines())
    return build_ws(TASK, HEADER + body + "\n", kernels or {"kernels/noop.cpp": NOOP_CPP})


def assert_error(v: Verdict, kind: ErrorKind, *needles: str) -> None:
    text = "\n".join([*v.reasons, v.error or ""]).lower()
    assert v.reward == -1 and v.milestone == "failed", v.reasons
    assert v.error_kind == kind, f"error_kind {v.error_kind}, expected {kind}: {text[:2000]}"
    for n in needles:
        assert n.lower() in text, f"{n!r} not in {text[:2000]}"


def assert_honest_still_rewarded(ev: Evaluator, tmp_path: Path) -> None:
    ws = solution_workspace(tmp_path / f"honest-{uuid.uuid4().hex[:8]}", TASK, SOLUTIONS / TASK.id / "cpu")
    v = ev.evaluate(TASK, ws)
    assert v.reward >= 1, (v.reasons, (v.error or "")[:2000])


# -- crashes ------------------------------------------------------------------------------------
@pytest.mark.both_backends
def test_segfault_in_python_via_ctypes(limited: Evaluator, build_ws, tmp_path: Path) -> None:
    v = limited.evaluate(TASK, candidate(build_ws, "ctypes.string_at(0)\nreturn x.sum(1)"))
    assert_error(v, ErrorKind.CRASH, "crashed", "signal 11")
    assert_honest_still_rewarded(limited, tmp_path)


NULL_WRITE_CPP = """\
#include <cstdint>
extern "C" void row_sum(const float* x, float* out, int64_t rows, int64_t cols) {
    volatile float* p = nullptr;
    *p = x[0];  // a null write
    out[0] = 0;
}
"""


def test_segfault_in_cpp_kernel(limited: Evaluator, build_ws, tmp_path: Path) -> None:
    body = """\
    _lib.row_sum.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    out = torch.empty(x.size(0))
    _lib.row_sum(ptr(x), ptr(out), x.size(0), x.size(1))
    return out
    """
    v = limited.evaluate(TASK, candidate(build_ws, body, {"kernels/row_sum.cpp": NULL_WRITE_CPP}))
    assert_error(v, ErrorKind.CRASH, "signal 11")
    assert_honest_still_rewarded(limited, tmp_path)


# -- hangs --------------------------------------------------------------------------------------
SPIN_CPP = """\
extern "C" void spin() { volatile unsigned long i = 0; for (;;) ++i; }
"""


@pytest.mark.both_backends
@pytest.mark.timeout(300)
def test_hang_in_kernel_is_killed(limited: Evaluator, build_ws, tmp_path: Path) -> None:
    """An infinite loop in native code (which no Python-level interrupt can stop)."""
    v = limited.evaluate(TASK, candidate(build_ws, "_lib.spin()\nreturn x.sum(1)", {"kernels/spin.cpp": SPIN_CPP}))
    assert_error(v, ErrorKind.TIMEOUT, "timed out")
    assert_honest_still_rewarded(limited, tmp_path)


# -- memory -------------------------------------------------------------------------------------
@pytest.mark.both_backends
@pytest.mark.timeout(300)
def test_unbounded_allocation(limited: Evaluator, build_ws, tmp_path: Path) -> None:
    body = """\
    hoard = []
    while True:
        hoard.append(torch.ones(1 << 26))  # 256 MiB at a time, written so it is resident
    """
    v = limited.evaluate(TASK, candidate(build_ws, body))
    assert_error(v, ErrorKind.MEMORY)
    assert_honest_still_rewarded(limited, tmp_path)


# -- processes ----------------------------------------------------------------------------------
def _pids_cgroup_available() -> bool:
    cg = JobCgroup(max_pids=16, memory_mb=None)
    try:
        return cg.caps_processes
    finally:
        cg.remove()


@pytest.mark.both_backends
@pytest.mark.timeout(300)
def test_unbounded_forking(limited: Evaluator, build_ws, tmp_path: Path) -> None:
    if not _pids_cgroup_available():
        pytest.skip("no pids cgroup here: forking without bound is only safe behind the pids cap")
    body = """\
    import os, time
    while True:
        if os.fork() == 0:
            time.sleep(120)
            os._exit(0)
    """
    v = limited.evaluate(TASK, candidate(build_ws, body))
    assert v.reward == -1 and v.milestone == "failed", v.reasons
    assert_honest_still_rewarded(limited, tmp_path)
    assert_error(v, ErrorKind.PROCESS_LIMIT)  # the reason must be the process cap, not memory


# -- writes outside the workspace ---------------------------------------------------------------
def test_outputs_beyond_the_result_memory(eval_cache: Path, build_ws, tmp_path: Path) -> None:
    """Outputs larger than a worker's (sealed, fixed-size) result memory: a clear error, no host
    memory taken beyond the cap; the same evaluator then rewards an honest solution."""
    from cudagym.sandbox.config import LocalSandboxConfig
    from cudagym.sandbox.local import LocalSandbox

    ev = Evaluator(cpu_config(eval_cache), sandbox=LocalSandbox(LocalSandboxConfig(max_result_mb=1, spare_workers=1),
                                                                home=eval_cache / "home"))
    try:
        v = ev.evaluate(TASK, candidate(build_ws, "return torch.zeros(1 << 20)"))
        assert_error(v, ErrorKind.OUTPUT_FORMAT, "result limit")
        assert_honest_still_rewarded(ev, tmp_path)
    finally:
        ev.close()


@pytest.mark.both_backends
def test_write_outside_workspace(limited: Evaluator, build_ws, tmp_path: Path) -> None:
    """Next to the workspace (its parent directory, writable by the test), named relative to the
    workspace: the docker backend runs the job in a copy of the workspace at another path."""
    name = f"outside-{uuid.uuid4().hex}.txt"
    v = limited.evaluate(TASK, candidate(build_ws, f"open('../{name}', 'w').write('x')\nreturn x.sum(1)"))
    assert not list(tmp_path.rglob(name))
    assert_error(v, ErrorKind.SANDBOX, "Permission denied")
    assert_honest_still_rewarded(limited, tmp_path)


# -- malformed submissions ----------------------------------------------------------------------
def test_syntax_error(evaluator: Evaluator, build_ws) -> None:
    v = evaluator.evaluate(TASK, build_ws(TASK, "import torch\nclass ModelNew(torch.nn.Module:\n    pass\n",
                                          {"kernels/noop.cpp": NOOP_CPP}))
    assert_error(v, ErrorKind.EXCEPTION, "importing model_new.py failed", "SyntaxError")


def test_missing_model_new_class(evaluator: Evaluator, build_ws) -> None:
    v = evaluator.evaluate(TASK, build_ws(TASK, "import torch\nclass Model2(torch.nn.Module):\n    pass\n",
                                          {"kernels/noop.cpp": NOOP_CPP}))
    assert_error(v, ErrorKind.EXCEPTION, "must define a class ModelNew")


def test_missing_model_new_file(evaluator: Evaluator, tmp_path: Path) -> None:
    from cudagym.sandbox.workspace import Workspace

    ws = Workspace.create(tmp_path / "empty", TASK)
    ws.write("kernels/noop.cpp", NOOP_CPP)
    v = evaluator.evaluate(TASK, ws)
    assert_error(v, ErrorKind.EXCEPTION, "model_new.py does not exist")


def test_different_parameter_names(evaluator: Evaluator, build_ws) -> None:
    task = task_of("ew_scale_bias_gelu")
    model = """\
import torch
import torch.nn as nn

class ModelNew(nn.Module):
    def __init__(self, features, scale):
        super().__init__()
        self.scale = scale
        self.offset = nn.Parameter(torch.empty(features))  # the reference calls it `bias`

    def forward(self, x):
        return torch.empty_like(x)
"""
    v = evaluator.evaluate(task, build_ws(task, model, {"kernels/noop.cpp": NOOP_CPP}))
    # KernelBench's convention: built after the same seed, and the (unwritten) outputs decide
    assert_error(v, ErrorKind.MISMATCH, "built after the same seed", "bias")


def test_constructor_signature_mismatch(evaluator: Evaluator, build_ws) -> None:
    task = task_of("ew_scale_bias_gelu")
    model = "import torch\nclass ModelNew(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    v = evaluator.evaluate(task, build_ws(task, model, {"kernels/noop.cpp": NOOP_CPP}))
    assert_error(v, ErrorKind.EXCEPTION, "ModelNew(*get_init_inputs()) failed", "TypeError")


def test_kernel_compile_error(evaluator: Evaluator, build_ws) -> None:
    v = evaluator.evaluate(TASK, build_ws(TASK, HEADER + "        return x\n",
                                          {"kernels/bad.cpp": 'extern "C" void f() { undeclared_thing(); }\n'}))
    assert_error(v, ErrorKind.COMPILE, "bad.cpp", "undeclared_thing")
    assert not v.compiled
