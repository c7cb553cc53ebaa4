"""Each corpus filter removes the tasks it must and keeps the ones it must."""

from __future__ import annotations

import pytest

from cudagym.tasks.corpus.estimate import GPUS, estimate_workload
from cudagym.tasks.corpus.filters import Deduplicator, FilterConfig, check_runtime, check_workload
from cudagym.tasks.model import Task

CFG = FilterConfig()


def _task(forward: str, init: str = "", extra: str = "", sizes: str = "BATCH = 4\nFEATURES = 64\n",
          inputs: str = "torch.randn(BATCH, FEATURES)", cpu_sizes: dict | None = None) -> Task:
    code = f'''
import torch
import torch.nn as nn
import torch.nn.functional as F
{extra}
{sizes}

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        {init or "pass"}

    def forward(self, x):
{forward}


def get_inputs():
    return [{inputs}]


def get_init_inputs():
    return []
'''
    return Task(id="t", code=code, cpu_sizes=cpu_sizes or {})


GOOD = _task("        return torch.relu(x) * 2.0")


def test_good_task_passes_every_runtime_check():
    assert check_runtime(GOOD, CFG).ok


def test_eager_removes_a_task_that_raises_or_returns_nonfinite():
    r = check_runtime(_task("        return x @ torch.randn(3, 3)"), CFG)
    assert (r.ok, r.filter) == (False, "eager")
    r = check_runtime(_task("        return torch.log(x - 100.0)"), CFG)
    assert (r.ok, r.filter) == (False, "eager") and "non-finite" in r.reason


@pytest.mark.parametrize("forward, init", [
    ("        return self.drop(x) + 1.0", "self.drop = nn.Dropout(0.5)"),
    ("        return x + 0.1 * torch.randn_like(x)", ""),
])
def test_deterministic_removes_stochastic_ops(forward, init):
    r = check_runtime(_task(forward, init), CFG)
    assert (r.ok, r.filter) == (False, "deterministic")
    assert "stochastic" in r.reason


def test_deterministic_keeps_dropout_in_eval_mode():
    t = _task("        return self.drop(x) + 1.0", "self.drop = nn.Dropout(0.5)\n        self.eval()")
    assert check_runtime(t, CFG).ok


@pytest.mark.parametrize("forward, why", [
    ("        return torch.softmax(x, dim=-1).sum(dim=-1)", "constant"),  # all ones
    ("        return x * 1e-6", "near zero"),
    ("        return torch.ones_like(x) * 3.0", "input independent"),
    ("        return (x - x).sum()", "scalar zero"),
])
def test_nontrivial_removes_constant_and_near_zero_outputs(forward, why):
    r = check_runtime(_task(forward), CFG)
    assert (r.ok, r.filter) == (False, "nontrivial"), (why, r)


def test_nontrivial_keeps_a_loss():
    t = _task("        return F.mse_loss(x, y)", inputs="torch.randn(BATCH, FEATURES), torch.randn(BATCH, FEATURES)")
    t = t.model_copy(update={"code": t.code.replace("def forward(self, x):", "def forward(self, x, y):")})
    assert check_runtime(t, CFG).ok


@pytest.mark.parametrize("forward", [
    "        if x.sum() > 0:\n            return x * 2.0\n        return x - 1.0",
    "        return x * len(x.tolist())",
])
def test_compile_removes_what_does_not_capture_as_one_graph(forward):
    r = check_runtime(_task(forward), CFG)
    assert (r.ok, r.filter) == (False, "compile"), r


def test_workload_window_removes_too_small_and_too_large():
    gpu = GPUS["h100"]
    small = estimate_workload(GOOD.code, gpu)
    assert small.est_ms < 1.0
    r = check_workload(small, gpu, CFG)
    assert (r.ok, r.filter) == (False, "workload")
    fits = GOOD.resized(BATCH=32768, FEATURES=16384)  # 2 GiB per tensor: ~2 ms on an H100
    est = estimate_workload(fits.code, gpu)
    assert 1.0 <= est.est_ms <= 100.0, est
    assert est.output_bytes == 2 * 2**30 and est.verify_bytes >= 4 * est.output_bytes
    assert check_workload(est, gpu, CFG.model_copy(update={"max_output_mb": 4096})).ok
    r = check_workload(est, gpu, CFG)  # by default, outputs over 1 GiB: six trials send them each verify
    assert (r.ok, r.filter) == (False, "workload") and "MB per call" in r.reason
    huge = GOOD.resized(BATCH=2**22, FEATURES=16384)  # 256 GiB
    r = check_workload(estimate_workload(huge.code, gpu), gpu, CFG)
    assert (r.ok, r.filter) == (False, "workload") and "GiB" in r.reason


def test_estimate_counts_conv_flops_exactly():
    t = _task("        return self.conv(x)", "self.conv = nn.Conv2d(8, 16, 3, bias=False)",
              sizes="BATCH = 4\nFEATURES = 1\n", inputs="torch.randn(BATCH, 8, 32, 32)")
    est = estimate_workload(t.code, GPUS["a100"])
    assert est.flops == 2 * 4 * 16 * 30 * 30 * 8 * 3 * 3
    assert est.bytes == 4 * (4 * 8 * 32 * 32 + 16 * 8 * 9 + 4 * 16 * 30 * 30)
    # slower GPU, longer estimate
    assert estimate_workload(t.code, GPUS["l4"]).est_ms > est.est_ms


def test_dedup_removes_exact_and_renamed_duplicates_keeps_others():
    d = Deduplicator()
    assert d.check("a", GOOD.code).ok
    r = d.check("b", GOOD.code)
    assert (r.ok, r.filter) == (False, "duplicate") and "a" in r.reason
    renamed = GOOD.code.replace("x", "inp").replace("FEATURES", "WIDTH").replace("= 64", "= 60")
    assert not d.check("c", renamed).ok
    assert d.check("d", _task("        return torch.tanh(x) * 2.0").code).ok
    assert d.check("e", GOOD.resized(FEATURES=4096).code).ok  # same ops, much larger size: kept
