"""`cudagym check`: evaluate one solution for one task and print the verdict."""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from cudagym.core.verdict import Verdict
from cudagym.errors import CudagymError
from cudagym.options import choices, option
from cudagym.rewards.evaluator import EvaluatorConfig
from cudagym.rewards.milestone import RewardConfig
from cudagym.sandbox.library import LIBRARY_TITLES


def check(
    task: Annotated[str, typer.Argument(help="A task: a KernelBench-format .py file, DIR::ID or DIR/ID of a "
                                             "directory or parquet, or a bundled task id.")],
    solution: Annotated[Path, typer.Argument(help="A workspace directory (model_new.py + kernels/) or a single "
                                                  "model_new.py.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
    mode: str = option(EvaluatorConfig, "mode", "--mode"),
    target: str = option(EvaluatorConfig, "target", "--target"),
    atol: Annotated[Optional[float], typer.Option(help="Absolute tolerance of the output check (with --rtol; "
                                                       "default: the task's own).")] = None,
    rtol: Annotated[Optional[float], typer.Option(help="Relative tolerance of the output check (with --atol; "
                                                       "default: the task's own).")] = None,
    cache_dir: Optional[Path] = option(EvaluatorConfig, "cache_dir", "--cache-dir", default=None),
    sandbox: str = option(EvaluatorConfig, "sandbox", "--sandbox"),
    compile_baseline: bool = option(EvaluatorConfig, "compile_baseline", "--compile-baseline/--no-compile-baseline"),
    server_gaps: Optional[str] = option(EvaluatorConfig, "server_gap_ms", "--server-gaps"),
    reward_against: Optional[str] = option(RewardConfig, "against", "--reward-against", default=None),
) -> None:
    """Compile, verify and profile SOLUTION for TASK, and print the milestone reward with its reasons."""
    from cudagym.rewards.evaluator import Evaluator
    from cudagym.sandbox.protocol import TimingConfig
    from cudagym.sandbox.workspace import Workspace
    from cudagym.tasks.loaders import resolve_task
    from cudagym.tasks.model import optional_tolerance

    for flag, name, value in (("--mode", "mode", mode), ("--sandbox", "sandbox", sandbox),
                              ("--target", "target", target)):
        if value not in (allowed := choices(EvaluatorConfig, name)):
            raise typer.BadParameter(f"{flag} must be {' or '.join(allowed)}", param_hint=flag)
    try:
        tolerance = optional_tolerance(atol, rtol)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--atol/--rtol") from None
    try:
        server_gap_ms = TimingConfig.parse_idle(server_gaps) if server_gaps else None
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--server-gaps") from None
    try:
        against = RewardConfig.parse_against(reward_against) if reward_against else None
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--reward-against") from None
    console = Console(stderr=True)
    cfg = EvaluatorConfig.model_validate({
        "target": target, "mode": mode, "compile_baseline": compile_baseline, "sandbox": sandbox,
        "server_gap_ms": server_gap_ms, **({"reward": {"against": against}} if against else {}),
        **({"cache_dir": cache_dir} if cache_dir else {})})
    try:
        t = resolve_task(task)
        if tolerance is not None:
            t = t.model_copy(update={"tolerance": tolerance})
        tol = t.effective_tolerance
        with Evaluator(cfg) as ev, tempfile.TemporaryDirectory(prefix="cudagym-check-") as tmp:
            t = t.for_target(ev.target)
            ws = Workspace.from_solution(tmp, t, solution)
            if not as_json:
                console.print(f"[bold]{t.id}[/] on the {ev.target.value} target ({ev.device_name}), {mode} mode, "
                              f"atol={tol.atol:g}, rtol={tol.rtol:g}")
            status = (console.status("compiling, verifying, profiling…", spinner="dots") if not as_json
                      else contextlib.nullcontext())
            with status:
                verdict = ev.evaluate(t, ws)
    except CudagymError as e:
        if as_json:
            print(json.dumps({"reward": None, "error": str(e)}))
        else:
            console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps({**verdict.summary(), "tolerance": tol.model_dump()}))
    else:
        _print_verdict(verdict)
    raise typer.Exit(0 if verdict.reward > 0 else 1)


def _print_verdict(v: Verdict) -> None:
    console = Console()
    table = Table(show_header=False, box=None)
    colour = "green" if v.reward > 0 else "red"
    table.add_row("reward", f"[bold {colour}]{v.reward:+g}[/] ({v.milestone})")
    table.add_row("compiled / correct", f"{v.compiled} / {v.correct}")
    if v.audit:
        table.add_row("audit", f"{v.audit.mode}: {'passed' if v.audit.passed else 'FAILED'}")
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    table.add_row("candidate / eager / torch.compile ms",
                  f"{fmt(v.candidate_ms)} / {fmt(v.eager_ms)} / {fmt(v.compile_ms)}")
    table.add_row("speedup vs eager / compile", f"{fmt(v.speedup_vs_eager)} / {fmt(v.speedup_vs_compile)}")
    if v.server is not None:
        s, ms = v.server, (lambda t: None if t is None else t.median_ms)
        table.add_row(f"server mode ({s.gap_ms[0]:g}-{s.gap_ms[1]:g} ms gaps): ms",
                      f"{fmt(ms(s.candidate))} / {fmt(ms(s.eager))} / {fmt(ms(s.compiled))}")
        table.add_row("server mode: speedup vs eager / compile",
                      f"{fmt(s.speedup_vs_eager)} / {fmt(s.speedup_vs_compile)}")
    for name, lib_ms in v.library_ms.items():
        server = "" if v.server is None or name not in v.server.library else \
            f"; server mode {fmt(v.server.library[name].median_ms)} ms, {fmt(v.server.speedup_vs_library.get(name))}x"
        table.add_row(f"{LIBRARY_TITLES.get(name, name)}: ms / speedup",
                      f"{fmt(lib_ms)} / {fmt(v.speedup_vs_library.get(name))}{server}")
    console.print(table)
    for r in v.reasons:
        console.print(f"  • {r}")
    if v.error and v.reward <= 0:
        console.print(f"[red]{v.error[:3000]}[/]")
