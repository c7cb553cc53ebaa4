"""Task loaders, the bundled task set and its reference solutions."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from cudagym.errors import TaskError
from cudagym.tasks.loaders import (
    bundled_task,
    bundled_task_ids,
    bundled_tasks,
    check_task_builds,
    load_parquet,
    load_task_dir,
    load_task_file,
    load_tasks,
    resolve_task,
)
from cudagym.tasks.model import Target, Task

SOLUTIONS = Path(__file__).resolve().parents[1] / "examples" / "solutions"
CPU_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-march=native", "-shared"]

RELU = '''
import torch
import torch.nn as nn

BATCH = 16
DIM = 32


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(BATCH, DIM)]


def get_init_inputs():
    return []
'''

SCALE = RELU.replace("torch.relu(x)", "x * self.k").replace(
    "def __init__(self):\n        super().__init__()",
    "def __init__(self, k):\n        super().__init__()\n        self.k = k"
).replace("def get_init_inputs():\n    return []", "def get_init_inputs():\n    return [2.0]")


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def run_reference(task: Task) -> torch.Tensor:
    ns: dict = {}
    exec(compile(task.code, task.id, "exec"), ns)  # noqa: S102 - runs the task source under test
    torch.manual_seed(0)
    with torch.no_grad():
        return ns["Model"](*ns["get_init_inputs"]())(*ns["get_inputs"]())


# -- files and directories ---------------------------------------------------------------------
def test_load_task_file(tmp_path):
    task = load_task_file(write(tmp_path / "19_ReLU.py", RELU))
    assert task.id == "19_ReLU"
    assert task.source == "file" and task.level is None and task.path == str(tmp_path / "19_ReLU.py")
    assert task.sizes == {"BATCH": 16, "DIM": 32}
    check_task_builds(task)
    tagged = load_task_file(tmp_path / "19_ReLU.py", source="kernelbench", ops=["relu"], level=1)
    assert (tagged.source, tagged.ops, tagged.level) == ("kernelbench", ["relu"], 1)


def test_kernelbench_layout_infers_levels(tmp_path):
    root = tmp_path / "KernelBench"
    write(root / "level1" / "2_B.py", RELU)
    write(root / "level1" / "1_A.py", RELU)
    write(root / "level2" / "7_C.py", SCALE)
    write(root / "README.md", "not a task")
    tasks = load_task_dir(root)
    assert [(t.id, t.level) for t in tasks] == [("1_A", 1), ("2_B", 1), ("7_C", 2)]
    assert [t.id for t in load_task_dir(root / "level1")] == ["1_A", "2_B"]
    assert [t.id for t in load_tasks(str(root / "level2"))] == ["7_C"]
    assert resolve_task(f"{root / 'level1'}::2_B").id == "2_B"
    assert resolve_task(str(root / "level2" / "7_C")).level == 2  # the .py suffix may be left off
    assert resolve_task(str(root / "level1" / "1_A.py")).id == "1_A"
    with pytest.raises(TaskError, match="names 2 tasks"):
        resolve_task(str(root / "level1"))
    with pytest.raises(TaskError, match="no task 'nope'"):
        resolve_task(f"{root}::nope")


def test_empty_dir_and_unknown_spec(tmp_path):
    with pytest.raises(TaskError, match="no task files"):
        load_task_dir(tmp_path)
    with pytest.raises(TaskError, match="neither a file"):
        load_tasks(str(tmp_path / "missing"))


# -- malformed tasks ---------------------------------------------------------------------------
def test_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path / "bad.py", RELU.replace("def forward(self, x):", "def forward(self, x)"))
    with pytest.raises(TaskError, match=r"bad\.py.*syntax error at line \d+"):
        load_task_file(path)


def test_missing_get_inputs(tmp_path):
    path = write(tmp_path / "noinputs.py", RELU.replace("def get_inputs():", "def make_inputs():"))
    with pytest.raises(TaskError, match=r"noinputs\.py.*missing get_inputs"):
        load_task_file(path)


def test_malformed_file_in_dir_is_rejected(tmp_path):
    write(tmp_path / "a.py", RELU)
    write(tmp_path / "b.py", "class Model: pass\n")
    with pytest.raises(TaskError, match=r"b\.py.*missing get_inputs, get_init_inputs"):
        load_task_dir(tmp_path)


def test_model_that_fails_to_build(tmp_path):
    code = RELU.replace("super().__init__()", "super().__init__()\n        raise ValueError('bad width 7')", 1)
    task = load_task_file(write(tmp_path / "raises.py", code))  # statically fine
    with pytest.raises(TaskError, match="raises.*model failed to build: ValueError: bad width 7"):
        check_task_builds(task)


def test_forward_failure_and_nonfinite_output(tmp_path):
    shape_bug = load_task_file(write(tmp_path / "shape.py", RELU.replace("torch.relu(x)", "x @ x")))
    with pytest.raises(TaskError, match="forward failed: RuntimeError"):
        check_task_builds(shape_bug)
    inf = load_task_file(write(tmp_path / "inf.py", RELU.replace("torch.relu(x)", "x / 0.0")))
    with pytest.raises(TaskError, match="non-finite"):
        check_task_builds(inf)


# -- parquet -----------------------------------------------------------------------------------
def test_load_parquet_ops6k_layout(tmp_path):
    path = tmp_path / "ops.parquet"
    pq.write_table(
        pa.table({
            "ops": ["['relu']", "['mul', 'add']"],
            "data_source": ["ops6k", "ops6k"],
            "code": [RELU, SCALE],
            "difficulty": ["easy", "medium"],
        }),
        path,
    )
    tasks = load_parquet(path)
    assert [t.id for t in tasks] == ["ops_0", "ops_1"]
    assert tasks[1].ops == ["mul", "add"] and tasks[0].ops == ["relu"]
    assert tasks[0].source == "ops6k" and tasks[0].path == str(path)
    assert tasks[1].metadata == {"difficulty": "medium", "row": 1}
    check_task_builds(tasks[1])
    assert [t.id for t in load_tasks(str(path))] == ["ops_0", "ops_1"]
    assert resolve_task(f"{path}::ops_1").ops == ["mul", "add"]


def test_load_parquet_list_ops_and_typed_columns(tmp_path):
    path = tmp_path / "typed.parquet"
    pq.write_table(
        pa.table({
            "id": ["relu_a", "scale_b"],
            "ops": [["relu"], ["mul"]],
            "data_source": ["mine", "mine"],
            "code": [RELU, SCALE],
            "level": [1, 2],
            "dtype": ["float32", "float16"],
        }),
        path,
    )
    a, b = load_parquet(path)
    assert (a.id, a.ops, a.level) == ("relu_a", ["relu"], 1)
    assert b.dtype == "float16" and b.effective_tolerance.atol == 1e-2


def test_parquet_errors_name_the_row(tmp_path):
    path = tmp_path / "broken.parquet"
    pq.write_table(pa.table({"ops": ["[]", "[]"], "data_source": ["x", "x"], "code": [RELU, "def ("]}), path)
    with pytest.raises(TaskError, match=r"broken\.parquet row 1: .*syntax error"):
        load_parquet(path)
    nocode = tmp_path / "nocode.parquet"
    pq.write_table(pa.table({"ops": ["[]"], "data_source": ["x"]}), nocode)
    with pytest.raises(TaskError, match="missing column"):
        load_parquet(nocode)


# -- bundled tasks -----------------------------------------------------------------------------
def test_bundled_manifest():
    tasks = bundled_tasks()
    ids = [t.id for t in tasks]
    assert len(ids) >= 10 and len(set(ids)) == len(ids) and ids == bundled_task_ids()
    assert {t.level for t in tasks} == {1, 2, 3}
    for t in tasks:
        assert t.dtype == "float32" and t.ops and t.source == "bundled"
        assert t.cpu_sizes and set(t.cpu_sizes) <= set(t.sizes), t.id
        assert all(isinstance(v, int) for v in t.cpu_sizes.values()), t.id
        assert "cuda" not in t.code and "device=" not in t.code, t.id
    assert [t.id for t in load_tasks("bundled")] == ids
    assert load_tasks("norm_layernorm")[0].code == bundled_task("norm_layernorm").code
    assert resolve_task("mm_bmm").id == "mm_bmm"
    with pytest.raises(TaskError, match="no bundled task 'nope'"):
        bundled_task("nope")


@pytest.mark.parametrize("task_id", bundled_task_ids())
def test_bundled_task_builds_on_cpu_with_real_variance(task_id):
    task = bundled_task(task_id)
    check_task_builds(task)
    out = run_reference(task.for_target(Target.CPU))
    assert out.dtype == torch.float32
    assert out.std().item() > 1e-3, f"{task_id}: output is (nearly) constant"
    assert out.unique().numel() > out.numel() // 10, f"{task_id}: output has few distinct values"


def test_for_target_and_resized():
    task = bundled_task("red_row_sum")
    cpu = task.for_target(Target.CPU)
    assert cpu.sizes == {"ROWS": 2048, "COLS": 4096} == task.cpu_sizes
    assert cpu.target == Target.CPU and cpu.cpu_sizes == {}
    assert tuple(run_reference(cpu).shape) == (2048,)
    gpu = task.for_target(Target.CUDA)
    assert gpu.code == task.code and gpu.target == Target.CUDA and gpu.sizes == {"ROWS": 8192, "COLS": 8192}
    small = task.resized(ROWS=3, COLS=5)
    assert small.sizes == {"ROWS": 3, "COLS": 5} and small.digest != task.digest
    assert tuple(run_reference(small).shape) == (3,)
    with pytest.raises(TaskError, match="no module-level constant"):
        task.resized(WIDTH=4)
    with pytest.raises(TaskError, match="cuda target only"):
        task.for_target(Target.CUDA).for_target(Target.CPU)


# -- reference solutions -----------------------------------------------------------------------
@pytest.mark.parametrize("task_id", bundled_task_ids())
def test_every_bundled_task_has_cpu_and_cuda_solutions(task_id):
    for target, suffix in (("cpu", ".cpp"), ("cuda", ".cu")):
        d = SOLUTIONS / task_id / target
        assert (d / "model_new.py").is_file(), f"{d}/model_new.py is missing"
        assert list((d / "kernels").glob(f"*{suffix}")), f"{d}/kernels has no {suffix} source"
        assert "class ModelNew" in (d / "model_new.py").read_text()


ALLOCATION_AND_VIEW_OPS = {"empty", "empty_like", "new_empty", "empty_strided", "zeros", "view", "reshape",
                           "_unsafe_view", "permute", "transpose", "contiguous", "alias", "as_strided", "detach"}


@pytest.mark.parametrize("task_id", bundled_task_ids())
def test_cpu_solution_matches_reference(task_id, tmp_path, monkeypatch):
    """Compile the CPU solution as the toolchain does, run it, compare it, and audit its ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func._schema.name.split("::")[-1])
            return func(*args, **(kwargs or {}))

    solution = SOLUTIONS / task_id / "cpu"
    sources = sorted(str(p) for p in (solution / "kernels").glob("*.cpp"))
    subprocess.run(["g++", *CPU_FLAGS, *sources, "-o", str(tmp_path / "libkernels.so")], check=True,
                   capture_output=True)
    monkeypatch.setenv("CUDAGYM_KERNELS", str(tmp_path))
    spec = importlib.util.spec_from_file_location(f"model_new_{task_id}", solution / "model_new.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    task = bundled_task(task_id)
    ns: dict = {}
    exec(compile(task.for_target(Target.CPU).code, task_id, "exec"), ns)  # noqa: S102 - runs the task source under test
    torch.manual_seed(0)
    init = ns["get_init_inputs"]()
    ref, new = ns["Model"](*init), module.ModelNew(*init)
    new.load_state_dict(ref.state_dict())
    tol = task.effective_tolerance
    for seed in (1, 2):
        torch.manual_seed(seed)
        inputs = ns["get_inputs"]()
        with torch.no_grad():
            expected = ref(*[x.clone() for x in inputs])
            log = OpLog()
            with log:
                got = new(*inputs)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=tol.atol, rtol=tol.rtol)
        assert log.ops <= ALLOCATION_AND_VIEW_OPS, (f"ModelNew.forward ran torch compute ops "
                                                    f"{log.ops - ALLOCATION_AND_VIEW_OPS}")
    del module
    sys.modules.pop(f"model_new_{task_id}", None)


def test_parquet_cpu_sizes_column_applies_on_the_cpu_target(tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    task = bundled_task("ew_scale_bias_gelu")
    small = {name: 8 for name, v in task.sizes.items() if isinstance(v, int)}
    pq.write_table(pa.table({"ops": [["gelu"]], "data_source": ["ours"], "code": [task.code],
                             "cpu_sizes": [json.dumps(small)]}), tmp_path / "t.parquet")
    loaded = load_parquet(tmp_path / "t.parquet")[0]
    assert loaded.cpu_sizes == small
    assert loaded.for_target(Target.CPU).sizes == {**task.sizes, **small}
    (bad := tmp_path / "bad.parquet")
    pq.write_table(pa.table({"ops": [["gelu"]], "data_source": ["ours"], "code": [task.code],
                             "cpu_sizes": ["not json"]}), bad)
    with pytest.raises(TaskError, match="cpu_sizes"):
        load_parquet(bad)
