"""The corpus filters. Each returns a `FilterResult` naming the filter that removed a task.

Order in a build (cheapest first): `workload` (estimate on meta tensors, full sizes), then the
runtime checks at the task's small CPU sizes — `eager` (builds and runs, finite tensor output),
`deterministic` (no stochastic ATen op is executed, and two runs under different RNG states give
bit-identical outputs), `nontrivial` (the output changes with the inputs, and its spread is above
a floor so that an all-zeros answer cannot pass the verifier's tolerance), `compile` (the model
captures as one graph under `torch.compile(fullgraph=True)` and matches eager) — and, across
tasks, `duplicate` (normalized structure seen before) and `contamination` (see contamination.py).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

from pydantic import BaseModel

from cudagym.tasks.corpus.contamination import normalized_tokens
from cudagym.tasks.corpus.estimate import GpuSpec, WorkloadEstimate, load_module
from cudagym.tasks.model import Target, Task

FILTERS = ("compose", "workload", "eager", "deterministic", "nontrivial", "compile", "duplicate", "contamination")

# ATen ops that draw random numbers: a forward that runs any of them is not deterministic.
STOCHASTIC_OPS = frozenset({
    "bernoulli", "bernoulli_", "native_dropout", "dropout", "feature_dropout", "alpha_dropout",
    "feature_alpha_dropout", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like",
    "normal", "normal_", "uniform_", "random_", "multinomial", "randperm", "rrelu_with_noise",
    "exponential_", "geometric_", "cauchy_", "log_normal_", "poisson", "_standard_gamma",
    "_sample_dirichlet", "binomial",
})


class FilterConfig(BaseModel):
    """Thresholds of the filters (defaults follow CUDA Agent's Ops-6K recipe)."""

    min_ms: float = 1.0
    max_ms: float = 100.0
    max_memory_fraction: float = 0.5  # of the target GPU's memory, for the verify footprint
    max_output_mb: float = 1024.0  # per forward: six verification trials send them to the evaluator
    compile_backend: str = "auto"  # auto: inductor where CUDA is present, else eager (dynamo capture only)
    min_output_std: float = 1e-3  # 10x the fp32 atol: zeros must fail the tolerance check
    min_output_abs: float = 1e-3  # for scalar outputs (losses)
    min_output_change: float = 1e-3  # max |out(a) - out(b)| for two input draws
    compile_atol: float = 1e-3
    compile_rtol: float = 1e-3
    contamination_threshold: float = 0.9


class FilterResult(BaseModel):
    ok: bool
    filter: str | None = None
    reason: str = ""

    @classmethod
    def passed(cls) -> FilterResult:
        return cls(ok=True)

    @classmethod
    def removed(cls, filter: str, reason: str) -> FilterResult:  # noqa: A002
        return cls(ok=False, filter=filter, reason=reason[:300])


# -- workload window --------------------------------------------------------------------------
def memory_problem(est: WorkloadEstimate, gpu: GpuSpec, cfg: FilterConfig) -> str | None:
    """Why the task cannot be verified on `gpu` (memory or output size), or None."""
    need = max(est.memory_bytes, est.verify_bytes)
    if need > cfg.max_memory_fraction * gpu.memory_gib * 2**30:
        return f"verification needs {need / 2**30:.1f} GiB on a {gpu.name}"
    if est.output_bytes > cfg.max_output_mb * 2**20:
        return f"outputs of {est.output_bytes / 2**20:.0f} MB per call (limit {cfg.max_output_mb:.0f} MB)"
    return None


def check_workload(est: WorkloadEstimate, gpu: GpuSpec, cfg: FilterConfig) -> FilterResult:
    """Estimated eager time within [min_ms, max_ms]; verifiable within the GPU's memory share
    and the output budget."""
    problem = memory_problem(est, gpu, cfg)
    if problem:
        return FilterResult.removed("workload", problem)
    if not cfg.min_ms <= est.est_ms <= cfg.max_ms:
        return FilterResult.removed("workload", f"estimated {est.est_ms:.3g} ms, outside "
                                                f"[{cfg.min_ms}, {cfg.max_ms}] ms on {gpu.name}")
    return FilterResult.passed()


# -- runtime checks ---------------------------------------------------------------------------
def resolve_backend(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "inductor" if torch.cuda.is_available() else "eager"


def _outputs(out: Any) -> list[Any]:
    import torch

    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    for o in outs:
        if not isinstance(o, torch.Tensor):
            raise TypeError(f"forward returned {type(o).__name__}, not a tensor")
    return outs


def _clone(inputs: list[Any]) -> list[Any]:
    import torch

    return [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]


def check_runtime(task: Task, cfg: FilterConfig, device: str = "cpu") -> FilterResult:
    """Run the eager, deterministic, nontrivial and compile checks at the task's CPU sizes."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    small = task.for_target(Target.CPU if device == "cpu" else Target.CUDA)
    seen: set[str] = set()

    class _Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def inputs(seed: int) -> list[Any]:
        torch.manual_seed(seed)
        with torch.device(device):
            return list(mod.get_inputs())

    # eager
    try:
        mod = load_module(small.code, task.id)
        torch.manual_seed(0)
        with torch.device(device):
            model = mod.Model(*mod.get_init_inputs())
        in_a, in_b = inputs(1), inputs(2)
        with torch.no_grad(), _Record():
            out_a = _outputs(model(*_clone(in_a)))
        for o in out_a:
            if o.is_floating_point() and not bool(torch.isfinite(o).all()):
                return FilterResult.removed("eager", "non-finite output")
    except Exception as e:  # noqa: BLE001 - the task's own failure
        return FilterResult.removed("eager", f"{type(e).__name__}: {e}")

    # deterministic
    stochastic = sorted(seen & STOCHASTIC_OPS)
    if stochastic:
        return FilterResult.removed("deterministic", f"runs stochastic op(s) {', '.join(stochastic)}")
    try:
        torch.manual_seed(12345)
        with torch.no_grad():
            out_a2 = _outputs(model(*_clone(in_a)))
        if len(out_a2) != len(out_a) or not all(torch.equal(p, q) for p, q in zip(out_a, out_a2)):
            return FilterResult.removed("deterministic", "two runs on the same inputs differ")
        with torch.no_grad():
            out_b = _outputs(model(*_clone(in_b)))
    except Exception as e:  # noqa: BLE001
        return FilterResult.removed("eager", f"second run failed: {type(e).__name__}: {e}")

    # nontrivial
    for o_a, o_b in zip(out_a, out_b):
        a, b = o_a.double(), o_b.double()
        change = float((a - b).abs().max()) if a.shape == b.shape else math.inf
        if change < cfg.min_output_change:
            return FilterResult.removed("nontrivial", f"output does not depend on the inputs (max change {change:.2g})")
        if a.numel() > 1:
            std = float(a.std())
            if std < cfg.min_output_std:
                return FilterResult.removed("nontrivial", f"output spread {std:.2g} below {cfg.min_output_std:g}")
        elif float(a.abs().max()) < cfg.min_output_abs:
            return FilterResult.removed("nontrivial", f"output magnitude below {cfg.min_output_abs:g}")

    # compile
    backend = resolve_backend(cfg.compile_backend)
    try:
        torch.compiler.reset()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        torch.manual_seed(0)
        with torch.no_grad():
            out_c = _outputs(compiled(*_clone(in_a)))
        for p, q in zip(out_a, out_c):
            if p.shape != q.shape or not torch.allclose(p.double(), q.double(), atol=cfg.compile_atol,
                                                        rtol=cfg.compile_rtol, equal_nan=False):
                return FilterResult.removed("compile", f"torch.compile({backend}) output differs from eager")
    except Exception as e:  # noqa: BLE001
        return FilterResult.removed("compile", f"torch.compile({backend}, fullgraph=True): "
                                               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    finally:
        torch.compiler.reset()
    return FilterResult.passed()


# -- duplicates -------------------------------------------------------------------------------
def structure_key(code: str) -> str:
    """Hash of the normalized structure: identifiers and literals normalized (contamination's
    normalization), plus each module-level size constant rounded to the nearest power of two.
    Two tasks with the same operators and sizes within a factor of about 1.4 share a key."""
    from cudagym.tasks.model import module_constants

    sizes = [round(math.log2(v)) if isinstance(v, (int, float)) and v > 0 else v
             for v in module_constants(code).values()]
    h = hashlib.sha256(" ".join(normalized_tokens(code)).encode() + repr(sizes).encode())
    return h.hexdigest()[:20]


class Deduplicator:
    """Keeps the first task of each `structure_key` (call in a fixed order for reproducibility)."""

    def __init__(self) -> None:
        self._seen: dict[str, str] = {}

    def check(self, task_id: str, code: str) -> FilterResult:
        key = structure_key(code)
        first = self._seen.setdefault(key, task_id)
        if first != task_id:
            return FilterResult.removed("duplicate", f"same normalized structure as {first}")
        return FilterResult.passed()
