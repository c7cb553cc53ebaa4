"""The `Task`: a PyTorch reference problem in KernelBench format plus its metadata."""

from __future__ import annotations

import ast
import hashlib
import re
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cudagym.errors import TaskError


class Target(str, Enum):
    """Where kernels run: CUDA kernels on an NVIDIA GPU, or C++ kernels on the host CPU."""

    CUDA = "cuda"
    CPU = "cpu"


class Tolerance(BaseModel):
    """Absolute and relative tolerance of the output comparison (`|a-b| <= atol + rtol*|b|`)."""

    model_config = ConfigDict(frozen=True)
    atol: float
    rtol: float


# Defaults per dtype: fp32 1e-4 (TF32 is off for the reference), half precision 1e-2.
DEFAULT_TOLERANCE: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-4, rtol=1e-4),
    "float64": Tolerance(atol=1e-6, rtol=1e-6),
    "float16": Tolerance(atol=1e-2, rtol=1e-2),
    "bfloat16": Tolerance(atol=1e-2, rtol=1e-2),
}

_REQUIRED_NAMES = ("Model", "get_inputs", "get_init_inputs")


class Task(BaseModel):
    """One kernel-optimization problem.

    `code` is Python source defining `class Model(nn.Module)`, `get_inputs()` and
    `get_init_inputs()` (the KernelBench / CUDA-Agent-Ops-6K format). Problem sizes are
    module-level numeric constants (`BATCH = 128`); `sizes` lists them and `resized()` rewrites
    them. `cpu_sizes` are the constants used on the CPU target (bundled tasks carry both).
    """

    model_config = ConfigDict(frozen=True)

    id: str
    code: str
    source: str = "bundled"
    ops: list[str] = Field(default_factory=list)
    level: int | None = None
    dtype: str = "float32"
    target: Target | None = None  # None: any target
    tolerance: Tolerance | None = None  # None: DEFAULT_TOLERANCE[dtype]
    cpu_sizes: dict[str, int | float] = Field(default_factory=dict)
    path: str | None = None  # where it was loaded from, for messages
    metadata: dict[str, Any] = Field(default_factory=dict)

    @property
    def effective_tolerance(self) -> Tolerance:
        return self.tolerance or DEFAULT_TOLERANCE.get(self.dtype, DEFAULT_TOLERANCE["float32"])

    @property
    def sizes(self) -> dict[str, int | float]:
        """Module-level numeric constants of the reference (problem sizes)."""
        return module_constants(self.code)

    @property
    def digest(self) -> str:
        """Content hash of the reference code: keys the baseline cache."""
        return hashlib.sha256(self.code.encode()).hexdigest()[:16]

    def resized(self, **sizes: int | float) -> Task:
        """A copy with the given module-level constants replaced (unknown names are an error)."""
        known = self.sizes
        unknown = sorted(set(sizes) - set(known))
        if unknown:
            raise TaskError(f"task {self.id}: no module-level constant(s) {unknown}; has {sorted(known)}")
        code = self.code
        for name, value in sizes.items():
            code = re.sub(
                rf"^({re.escape(name)}\s*(?::[^=]+)?=\s*)[^#\n]+",
                lambda m, v=value: f"{m.group(1)}{v!r}",
                code,
                count=1,
                flags=re.MULTILINE,
            )
        return self.model_copy(update={"code": code})

    def for_target(self, target: Target) -> Task:
        """The task as it runs on `target`: CPU sizes applied on the CPU target."""
        if self.target is not None and self.target != target:
            raise TaskError(f"task {self.id} is for the {self.target.value} target only")
        if target == Target.CPU and self.cpu_sizes:
            return self.resized(**self.cpu_sizes).model_copy(update={"target": target, "cpu_sizes": {}})
        return self.model_copy(update={"target": target})

    def validate_source(self) -> None:
        """Static checks: it parses and defines `Model`, `get_inputs`, `get_init_inputs`."""
        validate_reference_source(self.code, self.id)


def module_constants(code: str) -> dict[str, int | float]:
    """Module-level `NAME = <int or float literal>` assignments, in source order."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return {}
    out: dict[str, int | float] = {}
    for node in tree.body:
        target = value = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            if isinstance(value.value, (int, float)) and not isinstance(value.value, bool):
                out[target.id] = value.value
    return out


def validate_reference_source(code: str, task_id: str = "<task>") -> None:
    """Raise `TaskError` naming the problem if `code` is not a KernelBench-format reference."""
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise TaskError(f"task {task_id}: syntax error at line {e.lineno}: {e.msg}") from None
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
    missing = [n for n in _REQUIRED_NAMES if n not in defined]
    if missing:
        raise TaskError(f"task {task_id}: missing {', '.join(missing)} (a task must define Model, get_inputs, get_init_inputs)")
