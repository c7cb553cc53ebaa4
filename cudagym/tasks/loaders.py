"""Loading tasks: KernelBench-format files and directories, Ops-6K parquet files, bundled tasks.

Every loader validates each task statically (`validate_reference_source`) and raises
`TaskError` naming the file (and row) and the problem. `check_task_builds` goes further and
runs the reference once on the CPU; it is for `cudagym tasks` and tests, not for the sandboxed
harness (it executes task code in this process).

Task specs (`load_tasks` / `resolve_task`):

- ``bundled``: every bundled task; a bundled id such as ``norm_layernorm``: that task;
- ``path/to/19_ReLU.py``: one KernelBench-format file;
- ``path/to/dir``: every ``*.py`` in it (or in its ``level*/`` subdirectories);
- ``path/to/tasks.parquet``: every row of an Ops-6K-layout parquet file;
- ``<file set>::<id>`` (``resolve_task`` only): the task with that id in a directory or parquet
  file, e.g. ``KernelBench/level1::19_ReLU`` or ``ops.parquet::ops_17``;
- ``path/to/dir/19_ReLU`` (``resolve_task`` only): shorthand for ``path/to/dir/19_ReLU.py``.
"""

from __future__ import annotations

import ast
import json
import re
import types
from importlib import resources
from pathlib import Path
from typing import Any

from cudagym.errors import TaskError
from cudagym.tasks.model import BUNDLED_SOURCE, Target, Task, Tolerance, optional_tolerance, validate_reference_source

BUNDLED_SPEC = "bundled"
_LEVEL_DIR = re.compile(r"^level(\d+)$")
_PARQUET_CORE_COLUMNS = ("ops", "data_source", "code")


# -- single files and directories --------------------------------------------------------------
def load_task_file(path: str | Path, *, source: str = "file", **meta: Any) -> Task:
    """One KernelBench-format `.py` file as a `Task` (id: the file stem).

    `meta` overrides or adds `Task` fields (`ops`, `level`, `dtype`, `cpu_sizes`, `tolerance`, ...).
    Without an explicit `level`, a parent directory named `levelN` sets it. Without an explicit
    `tolerance`, the source decides it (`default_tolerance`: KernelBench's for "file").
    """
    path = Path(path)
    try:
        code = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError(f"{path}: cannot read task file: {e}") from None
    if "level" not in meta:
        for parent in path.parents:
            m = _LEVEL_DIR.match(parent.name)
            if m:
                meta["level"] = int(m.group(1))
                break
    return _make_task(id=path.stem, code=code, source=source, path=str(path), where=str(path), **meta)


def load_task_dir(path: str | Path) -> list[Task]:
    """Every `*.py` in `path`, sorted by name; if it has none, every `*.py` in its `level*/` subdirs."""
    path = Path(path)
    if not path.is_dir():
        raise TaskError(f"{path}: not a directory")
    files = sorted(p for p in path.glob("*.py") if not p.name.startswith("_"))
    if not files:
        level_dirs = sorted(
            (d for d in path.iterdir() if d.is_dir() and _LEVEL_DIR.match(d.name)),
            key=lambda d: int(_LEVEL_DIR.match(d.name).group(1)),  # type: ignore[union-attr]
        )
        files = [p for d in level_dirs for p in sorted(d.glob("*.py")) if not p.name.startswith("_")]
    if not files:
        raise TaskError(f"{path}: no task files (*.py here or in level*/ subdirectories)")
    return _unique([load_task_file(p) for p in files], str(path))


# -- parquet (CUDA-Agent-Ops-6K layout) --------------------------------------------------------
def load_parquet(path: str | Path) -> list[Task]:
    """Every row of a parquet file with columns `ops`, `data_source`, `code`.

    Optional columns: `id` (else ``f"{stem}_{row}"``), `level`, `dtype`, `atol`/`rtol`, `cpu_sizes`
    (a JSON object of the constants to use on the CPU target); any other
    column goes to `Task.metadata`. `ops` may be a list of op names or the string repr of one.
    `Task.source` is the row's `data_source`; a row without `atol`/`rtol` gets the default of
    that source (`default_tolerance`: ours for our corpus, KernelBench's for Ops-6K and others).
    """
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises many types for a bad file
        raise TaskError(f"{path}: cannot read parquet: {e}") from None
    if rows:
        missing = [c for c in _PARQUET_CORE_COLUMNS if c not in rows[0]]
        if missing:
            raise TaskError(f"{path}: missing column(s) {missing}; an Ops-6K parquet has {list(_PARQUET_CORE_COLUMNS)}")
    tasks = []
    for i, row in enumerate(rows):
        row = dict(row)
        where = f"{path} row {i}"
        code = row.pop("code")
        if not isinstance(code, str):
            raise TaskError(f"{where}: `code` is not a string")
        task_id = str(row.pop("id")) if row.get("id") is not None else f"{path.stem}_{i}"
        row.pop("id", None)
        fields: dict[str, Any] = {"ops": _parse_ops(row.pop("ops"), where)}
        data_source = row.pop("data_source")
        if row.get("level") is not None:
            fields["level"] = int(row.pop("level"))
        if row.get("dtype") is not None:
            fields["dtype"] = str(row.pop("dtype"))
        try:
            fields["tolerance"] = optional_tolerance(row.pop("atol", None), row.pop("rtol", None))
        except ValueError as e:
            raise TaskError(f"{where}: {e}") from None
        cpu_sizes = row.pop("cpu_sizes", None)  # our corpus stores them as a JSON object
        if cpu_sizes:
            try:
                fields["cpu_sizes"] = json.loads(cpu_sizes) if isinstance(cpu_sizes, str) else dict(cpu_sizes)
            except (ValueError, TypeError):
                raise TaskError(f"{where}: `cpu_sizes` is not a JSON object of sizes") from None
        metadata = {k: v for k, v in row.items() if v is not None}
        metadata["row"] = i
        tasks.append(
            _make_task(id=task_id, code=code, source=str(data_source or "parquet"), path=str(path),
                       metadata=metadata, where=where, **fields)
        )
    return _unique(tasks, str(path))


def _parse_ops(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        try:
            parsed = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return [s.strip().strip("'\"") for s in text.strip("[]()").split(",") if s.strip()]
        value = [parsed] if isinstance(parsed, str) else parsed
    try:
        return [str(v) for v in value]
    except TypeError:
        raise TaskError(f"{where}: `ops` is neither a list of names nor a string: {value!r}") from None


# -- bundled tasks -----------------------------------------------------------------------------
def _bundled_root() -> Any:
    return resources.files("cudagym.tasks").joinpath("bundled")


def _bundled_manifest() -> list[dict[str, Any]]:
    try:
        data = json.loads(_bundled_root().joinpath("manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise TaskError(f"bundled task manifest is unreadable: {e}") from None
    return data["tasks"]


def bundled_task_ids() -> list[str]:
    """Ids of the bundled tasks, in manifest order."""
    return [entry["id"] for entry in _bundled_manifest()]


def _bundled_entry_task(entry: dict[str, Any]) -> Task:
    root = _bundled_root()
    code = root.joinpath(entry["file"]).read_text()
    tolerance = entry.get("tolerance")
    return _make_task(
        id=entry["id"],
        code=code,
        source=BUNDLED_SOURCE,
        ops=list(entry.get("ops", [])),
        level=entry.get("level"),
        dtype=entry.get("dtype", "float32"),
        cpu_sizes=dict(entry.get("cpu_sizes", {})),
        tolerance=Tolerance(**tolerance) if tolerance else None,
        path=f"cudagym/tasks/bundled/{entry['file']}",
        where=f"bundled task file {entry['file']}",
    )


def bundled_tasks() -> list[Task]:
    """All bundled tasks (GPU sizes in the code, CPU sizes in `cpu_sizes`), in manifest order."""
    return [_bundled_entry_task(e) for e in _bundled_manifest()]


def bundled_task(task_id: str) -> Task:
    """The bundled task with id `task_id`."""
    for entry in _bundled_manifest():
        if entry["id"] == task_id:
            return _bundled_entry_task(entry)
    raise TaskError(f"no bundled task {task_id!r}; bundled tasks: {', '.join(bundled_task_ids())}")


# -- one entry point ---------------------------------------------------------------------------
def load_tasks(spec: str | Path) -> list[Task]:
    """Tasks named by `spec`: "bundled", a bundled id, a `.py` file, a directory or a `.parquet`."""
    text = str(spec)
    if text == BUNDLED_SPEC:
        return bundled_tasks()
    path = Path(text)
    if path.is_dir():
        return load_task_dir(path)
    if path.is_file():
        if path.suffix == ".parquet":
            return load_parquet(path)
        if path.suffix == ".py":
            return [load_task_file(path)]
        raise TaskError(f"{path}: not a task file (expected .py or .parquet)")
    if text in bundled_task_ids():
        return [bundled_task(text)]
    raise TaskError(f"{text!r} is neither a file, a directory, 'bundled' nor a bundled task id")


def resolve_task(spec: str | Path) -> Task:
    """Exactly one task: a bundled id, a `.py` file, `<dir or parquet>::<id>`, or `<dir>/<stem>`."""
    text = str(spec)
    if "::" in text:
        where, _, task_id = text.rpartition("::")
        tasks = load_tasks(where)
        for task in tasks:
            if task.id == task_id:
                return task
        raise TaskError(f"no task {task_id!r} in {where} (it has {len(tasks)} tasks)")
    path = Path(text)
    if not path.exists() and path.suffix != ".py" and path.with_name(path.name + ".py").is_file():
        return load_task_file(path.with_name(path.name + ".py"))
    tasks = load_tasks(text)
    if len(tasks) != 1:
        raise TaskError(f"{text!r} names {len(tasks)} tasks; name one (e.g. '{text}::{tasks[0].id}')")
    return tasks[0]


# -- running a reference once ------------------------------------------------------------------
def check_task_builds(task: Task, device: str = "cpu") -> None:
    """Execute the reference in a fresh namespace, build `Model` and run one forward.

    On the CPU the task's CPU sizes are used (`task.for_target(Target.CPU)`). Raises `TaskError`
    naming the task and the failing phase (exec, init inputs, build, inputs, forward, outputs).
    This runs task code in the calling process: use it on trusted tasks only.
    """
    import torch

    target = Target.CPU if torch.device(device).type == "cpu" else Target.CUDA
    task = task.for_target(target)
    name = task.path or task.id
    namespace = types.ModuleType("cudagym_task_" + re.sub(r"\W", "_", task.id))

    def phase(what: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as e:  # any failure of the task's code is the task's
            raise TaskError(f"task {task.id} ({name}): {what}: {type(e).__name__}: {e}") from e

    phase("the code failed to execute",
          lambda: exec(compile(task.code, name, "exec"), namespace.__dict__))  # noqa: S102 - running it is the check
    torch.manual_seed(0)
    with torch.device(device), torch.no_grad():
        init_inputs = phase("get_init_inputs() failed", lambda: list(namespace.get_init_inputs()))
        model = phase("model failed to build", lambda: namespace.Model(*init_inputs))
        inputs = phase("get_inputs() failed", lambda: list(namespace.get_inputs()))
        model = model.to(device)
        inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs]
        out = phase("forward failed", lambda: model(*inputs))
    outs = out if isinstance(out, (tuple, list)) else [out]
    for o in outs:
        if not isinstance(o, torch.Tensor):
            raise TaskError(f"task {task.id} ({name}): forward returned {type(o).__name__}, not a tensor")
        if o.is_floating_point() and not bool(torch.isfinite(o).all()):
            raise TaskError(f"task {task.id} ({name}): forward returned non-finite values")


# -- helpers -----------------------------------------------------------------------------------
def _make_task(*, where: str, **fields: Any) -> Task:
    """A validated `Task`; errors name `where` (a file, or a file and row)."""
    try:
        validate_reference_source(fields["code"], fields["id"])
    except TaskError as e:
        raise TaskError(f"{where}: {e}") from None
    try:
        return Task(**fields)
    except ValueError as e:  # pydantic's ValidationError
        raise TaskError(f"{where}: invalid task metadata: {e}") from None


def _unique(tasks: list[Task], where: str) -> list[Task]:
    seen: set[str] = set()
    for t in tasks:
        if t.id in seen:
            raise TaskError(f"{where}: duplicate task id {t.id!r}")
        seen.add(t.id)
    return tasks
