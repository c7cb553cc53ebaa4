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
from typing import Any, Literal, cast

import typer
from pydantic import BaseModel

from cudagym.core.verdict import AuditMode
from cudagym.errors import CudagymError


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


def selfcheck_dir(out: str | Path, *, sample: int = 20, seed: int = 0, mode: AuditMode = "permissive",
                  min_own_share: float = 0.0, target: Literal["auto", "cuda", "cpu"] = "auto",
                  console: Any = None) -> dict[str, Any]:
    """Verify `sample` tasks of the corpus in `out` through the environment; the summary."""
    from rich.console import Console
    from rich.progress import Progress

    from cudagym.env.kernel_env import KernelEnv
    from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
    from cudagym.sandbox.protocol import VerifyConfig
    from cudagym.tasks.corpus.build import PARQUET_NAME
    from cudagym.tasks.corpus.calibrate import sample_ids
    from cudagym.tasks.loaders import load_parquet

    console = console or Console(stderr=True)
    tasks = {t.id: t for t in load_parquet(Path(out) / PARQUET_NAME)}
    chosen = [tasks[i] for i in sample_ids(list(tasks), sample, seed)]
    cfg = EvaluatorConfig(target=target, mode=mode, verify=VerifyConfig(min_own_share=min_own_share),
                          compile_baseline=False)
    rows: list[SelfCheckRow] = []
    with Evaluator(cfg) as ev, KernelEnv(chosen, evaluator=ev) as env, Progress(console=console) as bar:
        job = bar.add_task(f"verifying on {ev.device_name} ({mode} mode)", total=len(chosen))
        for task in chosen:
            env.reset(options={"task": task.id})
            _, _, _, _, info = env.step({"name": "write_file", "arguments": {
                "path": "model_new.py", "content": reference_as_candidate(task.code)}})
            if not info["calls"][0]["ok"]:
                rows.append(SelfCheckRow(id=task.id, ok=False, seconds=0.0, reason=str(info["calls"][0]["error"])))
            else:
                _, _, _, _, info = env.step({"name": "verify", "arguments": {}})
                call = info["calls"][0]
                text = info["tool_results"][0]["text"]
                rows.append(SelfCheckRow(id=task.id, ok=bool(call["ok"]), seconds=float(call["seconds"]),
                                         reason="" if call["ok"] else " | ".join(text.strip().splitlines()[:3])[:400]))
            bar.advance(job)
        device = ev.device_name
    passed = sum(r.ok for r in rows)
    secs = sorted(r.seconds for r in rows if r.seconds)
    return {"device": device, "mode": mode, "min_own_share": min_own_share, "sampled": len(rows), "passed": passed,
            "median_verify_s": secs[len(secs) // 2] if secs else None,
            "rows": [r.model_dump() for r in rows]}


def print_selfcheck(summary: dict[str, Any], console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title=f"reference-as-candidate verify on {summary['device']} ({summary['mode']} mode): "
                    f"{summary['passed']}/{summary['sampled']} pass")
    for c in ("task", "ok", "verify s", "reason"):
        t.add_column(c)
    for r in summary["rows"]:
        t.add_row(r["id"], "yes" if r["ok"] else "NO", f"{r['seconds']:.2f}", r["reason"])
    console.print(t)


def _fail(e: Exception) -> None:
    typer.secho(f"error: {e}", fg="red", err=True)
    raise typer.Exit(2)


def selfcheck_cmd(
    out: Path = typer.Argument(..., help="A built corpus directory."),
    sample: int = typer.Option(20, "--sample", help="Number of tasks to verify."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sample."),
    mode: str = typer.Option("permissive", "--mode", help="Audit mode: permissive or strict."),
    min_own_share: float = typer.Option(0.0, "--min-own-share",
                                        help="Permissive mode's minimum share of the candidate's own kernels."),
    target: str = typer.Option("auto", "--target", help="auto (GPU if present), cuda or cpu."),
) -> None:
    """Play sampled tasks through the environment with the reference as the candidate; all must verify."""
    from rich.console import Console

    if not (out / "tasks.parquet").exists():
        _fail(FileNotFoundError(f"{out}: no tasks.parquet (build it first)"))
    if mode not in ("permissive", "strict"):
        _fail(ValueError(f"--mode must be permissive or strict, not {mode!r}"))
    try:
        # mode is checked above; EvaluatorConfig checks target
        summary = selfcheck_dir(out, sample=sample, seed=seed, mode=cast(AuditMode, mode), min_own_share=min_own_share,
                                target=cast(Literal["auto", "cuda", "cpu"], target))
    except CudagymError as e:
        _fail(e)
        return
    print_selfcheck(summary, Console())
    (out / "selfcheck.json").write_text(json.dumps(summary, indent=1))
    if summary["passed"] < summary["sampled"]:
        raise typer.Exit(1)
