"""Self-check of a built corpus: sampled tasks, played through the environment, must verify.

Each sampled task is loaded into `KernelEnv`; the "agent" writes the task's own reference as
`model_new.py` (its `Model` class renamed `ModelNew`) with the write tool and calls the verify
tool. The reference is trivially correct, so every failure points at the task: it does not
build on this device, its outputs are not reproducible under the verification protocol (a
stochastic op the filters missed), or it exceeds the sandbox's limits. Permissive mode with no
minimum own-kernel share is the default, since a reference runs only torch ops (strict mode, or
a share above 0, rejects it by design).

It sits above the floors it drives (tasks, the evaluator, the environment), beside `check.py`;
`cudagym/cli.py` registers its command as `cudagym tasks selfcheck`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal, Optional, cast

import typer
from pydantic import BaseModel

from cudagym.core.verdict import AuditMode
from cudagym.errors import CudagymError


SHOW_ALL_UP_TO = 30  # rows the printed table holds before it shows only the failed tasks


class SelfCheckRow(BaseModel):
    id: str
    ok: bool
    seconds: float
    reason: str = ""


def reference_as_candidate(code: str) -> str:
    """The reference source with `class Model(` renamed `class ModelNew(` (not a subclass)."""
    renamed, n = re.subn(r"^class Model\(", "class ModelNew(", code, flags=re.M)
    if n != 1:
        raise ValueError("the task does not define exactly one top-level `class Model(`")
    return re.sub(r"\bsuper\(Model, self\)", "super(ModelNew, self)", renamed)


def selfcheck_tasks(spec: str | Path) -> list[Any]:
    """The tasks a self-check runs over: a built corpus directory (its parquet file), or any task
    source the loaders take (a KernelBench directory, a `.py` file, a parquet file, "bundled")."""
    from cudagym.tasks.corpus.build import PARQUET_NAME
    from cudagym.tasks.loaders import load_parquet, load_tasks

    corpus = Path(spec) / PARQUET_NAME
    return load_parquet(corpus) if corpus.is_file() else load_tasks(spec)


def selfcheck_dir(source: str | Path, *, sample: int = 20, seed: int = 0, mode: AuditMode = "permissive",
                  min_own_share: float = 0.0, target: Literal["auto", "cuda", "cpu"] = "auto",
                  concurrency: int = 1, rows_file: str | Path | None = None, console: Any = None) -> dict[str, Any]:
    """Verify `sample` tasks of `source` (0: all of them) through the environment, `concurrency`
    episodes at a time; the summary. With `rows_file`, each task's row is appended to it as it
    ends, and the tasks it already holds (from an interrupted run with the same settings) are not
    run again."""
    import asyncio

    from cudagym.tasks.corpus.calibrate import sample_ids

    tasks = {t.id: t for t in selfcheck_tasks(source)}
    chosen = [tasks[i] for i in sample_ids(list(tasks), sample or len(tasks), seed)]
    settings = {"mode": mode, "min_own_share": min_own_share, "target": target}
    done = _read_rows(Path(rows_file), settings) if rows_file else {}
    todo = [t for t in chosen if t.id not in done]
    device, rows = asyncio.run(_verify_all(todo, done, settings, concurrency, Path(rows_file) if rows_file else None,
                                           console))
    by_id = {**done, **{r.id: r for r in rows}}
    ordered = [by_id[t.id] for t in chosen if t.id in by_id]
    secs = sorted(r.seconds for r in ordered if r.seconds)
    return {"device": device, "source": str(source), "mode": mode, "min_own_share": min_own_share,
            "sampled": len(ordered), "passed": sum(r.ok for r in ordered), "resumed": len(done),
            "median_verify_s": secs[len(secs) // 2] if secs else None,
            "rows": [r.model_dump() for r in ordered]}


def _read_rows(path: Path, settings: dict[str, Any]) -> dict[str, SelfCheckRow]:
    """The rows an earlier run with the same settings left in `path` (first line: its settings);
    a file from other settings starts again."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"settings": settings}) + "\n")
        return {}
    lines = path.read_text().splitlines()
    try:
        head = json.loads(lines[0]) if lines else {}
    except ValueError:
        head = {}
    if head.get("settings") != settings:  # another mode, target or share: its rows say nothing of these
        path.write_text(json.dumps({"settings": settings}) + "\n")
        return {}
    out = {}
    for line in lines[1:]:
        try:
            row = SelfCheckRow.model_validate_json(line)
        except ValueError:
            continue  # a line cut short by an interrupted write: that task runs again
        out[row.id] = row
    return out


async def _verify_all(tasks: list[Any], done: dict[str, SelfCheckRow], settings: dict[str, Any], concurrency: int,
                      rows_file: Path | None, console: Any) -> tuple[str, list[SelfCheckRow]]:
    """The device's name and the rows of `tasks`, verified `concurrency` at a time."""
    import asyncio

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from cudagym.env.kernel_env import KernelEnv
    from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
    from cudagym.sandbox.protocol import VerifyConfig

    cfg = EvaluatorConfig(target=settings["target"], mode=settings["mode"],
                          verify=VerifyConfig(min_own_share=settings["min_own_share"]), compile_baseline=False)
    rows: list[SelfCheckRow] = []
    sem = asyncio.Semaphore(max(1, concurrency))
    console = console or Console(stderr=True)
    with Evaluator(cfg) as ev, Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                        TimeElapsedColumn(), console=console) as bar:
        failed = 0
        job = bar.add_task(f"verifying on {ev.device_name} ({settings['mode']} mode)",
                           total=len(tasks) + len(done), completed=len(done))

        async def one(task: Any) -> None:
            nonlocal failed
            async with sem:
                row = await _verify_one(KernelEnv([task], evaluator=ev), task)
            rows.append(row)
            if rows_file is not None:
                with rows_file.open("a") as f:
                    f.write(row.model_dump_json() + "\n")
            failed += not row.ok
            bar.update(job, advance=1, description=f"verifying on {ev.device_name} ({settings['mode']} mode), "
                                                   f"{failed} failed; last: {task.id}")

        await asyncio.gather(*(one(t) for t in tasks))
        return ev.device_name, rows


async def _verify_one(env: Any, task: Any) -> SelfCheckRow:
    """One task's episode: the reference written as the candidate, then verified."""
    try:
        await env.areset(options={"task": task.id})
        _, _, _, _, info = await env.astep({"name": "write_file", "arguments": {
            "path": "model_new.py", "content": reference_as_candidate(task.code)}})
        if not info["calls"][0]["ok"]:
            return SelfCheckRow(id=task.id, ok=False, seconds=0.0, reason=str(info["calls"][0]["error"])[:400])
        _, _, _, _, info = await env.astep({"name": "verify", "arguments": {}})
        call = info["calls"][0]
        text = info["tool_results"][0]["text"]
        return SelfCheckRow(id=task.id, ok=bool(call["ok"]), seconds=float(call["seconds"]),
                            reason="" if call["ok"] else " | ".join(text.strip().splitlines()[:3])[:400])
    except Exception as e:  # noqa: BLE001 - one broken task is a row, not the end of the check
        return SelfCheckRow(id=task.id, ok=False, seconds=0.0, reason=f"{type(e).__name__}: {e}"[:400])
    finally:
        env.close()


def print_selfcheck(summary: dict[str, Any], console: Any = None) -> None:
    """The summary as a table: every task's row, or only the failed ones where there are many."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    rows = summary["rows"]
    shown = rows if len(rows) <= SHOW_ALL_UP_TO else [r for r in rows if not r["ok"]]
    t = Table(title=f"reference-as-candidate verify on {summary['device']} ({summary['mode']} mode): "
                    f"{summary['passed']}/{summary['sampled']} pass"
                    + ("" if shown is rows else f" (the {len(shown)} that failed shown)"))
    for c in ("task", "ok", "verify s", "reason"):
        t.add_column(c)
    for r in shown:
        t.add_row(r["id"], "yes" if r["ok"] else "NO", f"{r['seconds']:.2f}", r["reason"])
    console.print(t)


def selfcheck_cmd(
    source: str = typer.Argument(..., help="A built corpus directory, or any task source: a KernelBench level "
                                           "directory, a .py file, a parquet file, 'bundled'."),
    sample: int = typer.Option(20, "--sample", help="Number of tasks to verify (0: all)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sample."),
    mode: str = typer.Option("permissive", "--mode", help="Audit mode: permissive or strict."),
    min_own_share: float = typer.Option(0.0, "--min-own-share",
                                        help="Permissive mode's minimum share of the candidate's own kernels."),
    target: str = typer.Option("auto", "--target", help="auto (GPU if present), cuda or cpu."),
    concurrency: int = typer.Option(1, "--concurrency", min=1, help="Tasks verified at once."),
    report: Optional[Path] = typer.Option(None, "--report", help="Where the summary goes (JSON; default: "
                                          "selfcheck.json in a corpus directory, else ./selfcheck.json). Its rows "
                                          "are kept beside it as they end (.rows.jsonl), and a run started again "
                                          "with the same settings goes on from them."),
) -> None:
    """Play sampled tasks through the environment with the reference as the candidate; all must verify."""
    from rich.console import Console

    from cudagym.tasks.cli import _fail
    from cudagym.tasks.corpus.build import PARQUET_NAME

    corpus = Path(source) / PARQUET_NAME  # a source the loaders cannot read is their TaskError, below
    if mode not in ("permissive", "strict"):
        _fail(ValueError(f"--mode must be permissive or strict, not {mode!r}"))
    out = report or (Path(source) / "selfcheck.json" if corpus.exists() else Path("selfcheck.json"))
    try:
        # mode is checked above; EvaluatorConfig checks target
        summary = selfcheck_dir(source, sample=sample, seed=seed, mode=cast(AuditMode, mode),
                                min_own_share=min_own_share, target=cast(Literal["auto", "cuda", "cpu"], target),
                                concurrency=concurrency, rows_file=out.with_suffix(".rows.jsonl"))
    except CudagymError as e:
        _fail(e)
        return
    print_selfcheck(summary, Console())
    out.write_text(json.dumps(summary, indent=1))
    if summary["passed"] < summary["sampled"]:
        raise typer.Exit(1)
