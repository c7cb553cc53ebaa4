"""Models are built as KernelBench builds them, and ModelNew's own parameters are never overwritten
when they are right (issue 30). CPU target, a task of our own (`tests/assets/linear_div`) with
solutions in the patterns published solutions use."""

from __future__ import annotations

from pathlib import Path

import pytest

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.core.verdict import ErrorKind
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import resolve_task

ASSETS = Path(__file__).resolve().parent / "assets" / "linear_div"
KERNEL = (ASSETS / "linear_scale.cpp").read_text()

HEADER = '''
import ctypes
import torch
import torch.nn as nn
from cudagym.runtime import kernel_library, ptr

_lib = kernel_library()
_lib.linear_scale.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_float]
_lib.linear_scale.restype = None


def _run(x, linear, scale):
    x = x.contiguous()
    out = torch.empty(x.size(0), linear.out_features, dtype=x.dtype)
    _lib.linear_scale(ptr(x), ptr(linear.weight), ptr(linear.bias), ptr(out), x.size(0), x.size(1),
                      linear.out_features, scale)
    return out
'''


def solution(init: str, scale: str) -> str:
    body = "".join(f"        {line}\n" for line in init.splitlines())
    return (HEADER + "\n\nclass ModelNew(nn.Module):\n"
            "    def __init__(self, in_features, out_features, divisor):\n"
            "        super().__init__()\n" + body +
            f"\n    def forward(self, x):\n        return _run(x, self.linear, {scale})\n")


PLAIN = solution("self.linear = nn.Linear(in_features, out_features)\nself.divisor = divisor\n", "1.0 / self.divisor")
# the constant folded into the weights in __init__ (KernelBench level 2's usual trick)
FOLDED = solution("self.linear = nn.Linear(in_features, out_features)\nwith torch.no_grad():\n"
                  "    self.linear.weight /= divisor\n    self.linear.bias /= divisor\n", "1.0")
# an extra random draw before the weights: its own weights differ from Model's, Model's state_dict fits
EXTRA_DRAW = solution("self.probe = torch.randn(16)\nself.linear = nn.Linear(in_features, out_features)\n"
                      "self.divisor = divisor\n", "1.0 / self.divisor")
# the legacy constructor (`torch.Tensor(...)`, then the init nn.Linear runs): torch.Tensor stays on
# the CPU under `with torch.device("cuda")`, so it works only where models are built, then moved
LEGACY_INIT = ("import math\n"
               "self.linear = nn.Module()\n"
               "self.linear.weight = nn.Parameter(torch.Tensor(out_features, in_features))\n"
               "self.linear.bias = nn.Parameter(torch.Tensor(out_features))\n"
               "self.linear.out_features = out_features\n"
               "nn.init.kaiming_uniform_(self.linear.weight, a=math.sqrt(5))\n"
               "nn.init.uniform_(self.linear.bias, -1 / math.sqrt(in_features), 1 / math.sqrt(in_features))\n"
               "self.divisor = divisor\n")
LEGACY = solution(LEGACY_INIT, "1.0 / self.divisor")
# folded twice: wrong with its own parameters and with Model's
WRONG = solution("self.linear = nn.Linear(in_features, out_features)\nwith torch.no_grad():\n"
                 "    self.linear.weight /= divisor * divisor\n    self.linear.bias /= divisor * divisor\n", "1.0")


@pytest.fixture(scope="module")
def ev(tmp_path_factory: pytest.TempPathFactory):
    cfg = EvaluatorConfig(target="cpu", mode="strict", compile_baseline=False,
                          cache_dir=tmp_path_factory.mktemp("cache"))
    with Evaluator(cfg) as e:
        yield e


def _verify(ev: Evaluator, tmp_path: Path, source: str):
    task = resolve_task(str(ASSETS / "task.py")).for_target(ev.target)
    ws = Workspace.create(tmp_path / "ws", task, model_new=source)
    ws.write("kernels/linear_scale.cpp", KERNEL)
    return ev.verify(task, ws)


def test_same_seed_build_equal_to_the_reference(ev: Evaluator, tmp_path: Path) -> None:
    v = _verify(ev, tmp_path, PLAIN)
    assert v.ok and v.params_path == "seed" and "equal to Model's" in (v.params or ""), (v.error, v.params)


def test_parameters_made_with_the_legacy_constructor(ev: Evaluator, tmp_path: Path) -> None:
    v = _verify(ev, tmp_path, LEGACY)
    assert v.ok and v.params_path == "seed" and "equal to Model's" in (v.params or ""), (v.error, v.params)


LEGACY_TORCH_FORWARD = (LEGACY.split("\n\nclass ModelNew")[0].split("\n_lib")[0] + "\n\nclass ModelNew"
                        + LEGACY.split("\n\nclass ModelNew")[1].split("    def forward")[0]
                        + "    def forward(self, x):\n        linear = self.linear\n"
                        "        return torch.nn.functional.linear(x, linear.weight, linear.bias) / self.divisor\n")


@pytest.mark.gpu
def test_parameters_made_with_the_legacy_constructor_on_the_gpu(tmp_path: Path) -> None:
    """The same construction on a GPU, forward in torch's ops (permissive mode, no share asked):
    what is judged is where and how the parameters are built."""
    from cudagym.sandbox.protocol import VerifyConfig

    cfg = EvaluatorConfig(target="cuda", mode="permissive", compile_baseline=False, cache_dir=tmp_path / "cache",
                          verify=VerifyConfig(min_own_share=0.0))
    with Evaluator(cfg) as gpu:
        task = resolve_task(str(ASSETS / "task.py")).for_target(gpu.target)
        v = gpu.verify(task, Workspace.create(tmp_path / "ws", task, model_new=LEGACY_TORCH_FORWARD))
    assert v.ok and v.params_path == "seed" and "equal to Model's" in (v.params or ""), (v.error, v.params)


def test_weights_folded_in_init_are_not_overwritten(ev: Evaluator, tmp_path: Path) -> None:
    v = _verify(ev, tmp_path, FOLDED)
    assert v.ok and v.params_path == "seed", (v.error_kind, v.error, v.params)
    assert "differ from Model's" in (v.params or "")


def test_an_extra_random_draw_gets_the_reference_state_dict_on_a_second_try(ev: Evaluator, tmp_path: Path) -> None:
    v = _verify(ev, tmp_path, EXTRA_DRAW)
    assert v.ok and v.params_path == "state_dict", (v.error_kind, v.error, v.params)
    assert "second try" in (v.params or "")


def test_wrong_with_either_parameters_is_a_mismatch(ev: Evaluator, tmp_path: Path) -> None:
    v = _verify(ev, tmp_path, WRONG)
    assert not v.ok and v.error_kind == ErrorKind.MISMATCH, (v.error_kind, v.error)
    assert "also wrong with Model's state_dict" in " ".join(v.reasons)


@pytest.mark.slow
def test_profile_runs_with_the_parameters_verify_decided(ev: Evaluator, tmp_path: Path) -> None:
    """The timed calls' re-checked outputs pass only if the profile builds ModelNew as verify did."""
    task = resolve_task(str(ASSETS / "task.py")).for_target(ev.target)
    for name, source, path in (("extra", EXTRA_DRAW, "state_dict"), ("folded", FOLDED, "seed")):
        ws = Workspace.create(tmp_path / name, task, model_new=source)
        ws.write("kernels/linear_scale.cpp", KERNEL)
        verdict = ev.evaluate(task, ws)
        assert verdict.correct and verdict.profile_result is not None and verdict.profile_result.ok, verdict.reasons
        assert verdict.profile_result.params_path == path
        # an accepted profile's reasons say which parameters its timed calls ran with
        assert (path == "state_dict") == any(r.startswith("parameters: ") for r in verdict.profile_result.reasons), \
            verdict.profile_result.reasons
        alone = ev.profile(task, ws)  # no verify before it: the profile's own second try
        assert alone.ok and alone.params_path == path, alone.reasons
