"""A candidate that registers its own kernel for one of torch's ops with the dispatcher would run
inside the harness's own work between calls (input generation), seeing the next call's inputs
before the timer starts. Such a registration is TAMPER (`worker.integrity.check_tamper`, `dispatch_table`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.core.verdict import ErrorKind
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import bundled_task

from conftest import SOLUTIONS

TASK = "ew_scale_bias_gelu"

# The honest solution, plus a CPU kernel of its own for aten::randn that remembers what the
# harness generates (a real attack would precompute the next output from it, untimed).
OVERRIDE = '''
import torch

_seen = []
_lib = torch.library.Library("aten", "IMPL")


def _randn(size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    out = torch.empty(size, dtype=dtype or torch.float32).normal_(generator=generator)
    _seen.append(out)
    return out


_lib.impl("randn", _randn, "CPU")
'''


@pytest.mark.slow
def test_a_kernel_registered_for_torchs_op_is_tamper(tmp_path: Path) -> None:
    honest = (SOLUTIONS / TASK / "cpu" / "model_new.py").read_text()
    cfg = EvaluatorConfig(target="cpu", mode="strict", compile_baseline=False, cache_dir=tmp_path / "cache")
    with Evaluator(cfg) as ev:
        task = bundled_task(TASK).for_target(ev.target)
        ws = Workspace.from_solution(tmp_path / "ws", task, SOLUTIONS / TASK / "cpu")
        ws.write("model_new.py", honest + OVERRIDE)
        v = ev.verify(task, ws)
        ok_ws = Workspace.from_solution(tmp_path / "ok", task, SOLUTIONS / TASK / "cpu")
        ok = ev.verify(task, ok_ws)
    assert not v.ok and v.error_kind == ErrorKind.TAMPER and "aten::randn" in (v.error or ""), (v.error_kind, v.error)
    assert ok.ok, (ok.error_kind, ok.error)


# A lookup of one of torch's C++ functions by its mangled name, through ctypes from model_new.py:
# the way to call ATen below the dispatcher that leaves no import in any built object.
CTYPES_LOOKUP = '''
import ctypes as _ct
import os as _os
_torch_cpu = _ct.CDLL(_os.path.join(_os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
try:
    _gelu = _torch_cpu["_ZN2at3cpu5gelu_ERNS_6TensorEN3c1017basic_string_viewIcEE"]
except (AttributeError, PermissionError):  # the worker refuses the lookup itself
    _gelu = None
'''


@pytest.mark.slow
def test_torchs_cpp_functions_looked_up_through_ctypes_fail_the_audit(tmp_path: Path) -> None:
    honest = (SOLUTIONS / TASK / "cpu" / "model_new.py").read_text()
    cfg = EvaluatorConfig(target="cpu", mode="strict", compile_baseline=False, cache_dir=tmp_path / "cache")
    with Evaluator(cfg) as ev:
        task = bundled_task(TASK).for_target(ev.target)
        ws = Workspace.from_solution(tmp_path / "ws", task, SOLUTIONS / TASK / "cpu")
        ws.write("model_new.py", honest + CTYPES_LOOKUP)
        v = ev.verify(task, ws)
    assert not v.ok and v.error_kind == ErrorKind.AUDIT and "through ctypes" in (v.error or ""), (v.error_kind, v.error)
